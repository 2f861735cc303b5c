"""Muon's step: functional_train against torch.optim.Muon, one process.

The hidden matrices of a GPT-like tree (``--layers`` layers of q/k/v/o ``d x d``, w1/w3
``ff x d``, w2 ``d x ff``; default 2 layers, d 128, ff 512: 14 matrices, 0.53 M float32
parameters -- bfloat16 matrix products are slow on CPUs without bfloat16 units, about 0.7 s
for one 1024 x 256 Newton-Schulz here, so the benchmark tree of ``bench_engine.py``, 84 such
matrices, would take half a minute a step), gradients ~1e-2 randn, lr 2e-2, weight decay 0.1, momentum 0.95, Nesterov, 5 bfloat16 Newton-Schulz
steps. Systems, interleaved round by round in one process after ``--warmup`` untimed rounds
(``--rounds`` timed; median ms/step and the ratio to the first):

  1. torch.optim.Muon (baseline; its per-parameter loop)
  2. ft.step(ft.muon-equivalent chain, donate=False)
  3. ft.step(..., donate=True)

The chain is ``chain(scale_by_muon(), add_decayed_weights(0.1), scale_by_learning_rate(2e-2))``
(what ``ft.muon`` gives every hidden matrix). Before each timed step every system gets freshly
written gradients, untimed. After all rounds the parameters of every system are compared with
the baseline's (all have taken the same steps).

    python benchmarks/bench_muon.py [--rounds 10] [--warmup 2] [--threads 1] [--layers 2]
        [--d 128] [--ff 512]

Not measured yet: the per-rank time, bytes and FLOPs at tp=2 x dp=2 (the issue's distributed
comparison); see the README's known limitations.
"""

import argparse
import statistics
import time

import torch

import functional_train as ft

LR, WD, MOMENTUM = 2e-2, 0.1, 0.95


def shapes(layers, d, ff):
    out = {}
    for i in range(layers):
        p = f"layers.{i}."
        out.update({p + "wq": (d, d), p + "wk": (d, d), p + "wv": (d, d), p + "wo": (d, d),
                    p + "w1": (ff, d), p + "w3": (ff, d), p + "w2": (d, ff)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ff", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sh = shapes(args.layers, args.d, args.ff)
    p0 = {k: torch.randn(s, generator=gen) * 0.02 for k, s in sh.items()}
    g0 = {k: torch.randn(s, generator=gen) * 1e-2 for k, s in sh.items()}
    n = sum(x.numel() for x in p0.values())
    print(f"torch {torch.__version__}; {len(p0)} matrices, {n:,} float32 params; "
          f"{args.threads} thread(s); {args.rounds} rounds after {args.warmup} warm-up")

    ref = [torch.nn.Parameter(x.clone()) for x in p0.values()]
    opt = torch.optim.Muon(ref, lr=LR, weight_decay=WD, momentum=MOMENTUM)
    tx = ft.chain(ft.scale_by_muon(MOMENTUM), ft.add_decayed_weights(WD),
                  ft.scale_by_learning_rate(LR))
    runs = {"pure": [dict(p0), tx.init(p0)], "donate": [{k: v.clone() for k, v in p0.items()},
                                                       tx.init(p0)]}

    def torch_step():
        opt.step()

    def ft_step(kind):
        def run(grads):
            params, state = runs[kind]
            runs[kind] = list(ft.step(tx, grads, state, params, donate=kind == "donate"))
        return run

    systems = [("torch.optim.Muon", None), ("ft.step(donate=False)", ft_step("pure")),
               ("ft.step(donate=True)", ft_step("donate"))]
    times = {name: [] for name, _ in systems}
    for r in range(args.warmup + args.rounds):
        for name, fn in systems:
            if fn is None:
                for p, g in zip(ref, g0.values()):
                    p.grad = g.clone()
                t = time.perf_counter()
                torch_step()
            else:
                grads = {k: v.clone() for k, v in g0.items()}
                t = time.perf_counter()
                fn(grads)
            dt = time.perf_counter() - t
            if r >= args.warmup:
                times[name].append(dt)
    base = statistics.median(times[systems[0][0]])
    print(f"\n  {'system':28s} {'ms/step':>9s} {'min ms':>8s} {'ratio':>6s}  max|p-p_torch|")
    for name, _ in systems:
        med = statistics.median(times[name])
        if name.startswith("torch"):
            diff = 0.0
        else:
            params = runs["pure" if "False" in name else "donate"][0]
            diff = max((params[k] - r.detach()).abs().max().item() for k, r in zip(p0, ref))
        print(f"  {name:28s} {med * 1e3:9.2f} {min(times[name]) * 1e3:8.2f} {med / base:6.2f}"
              f"  {diff:.1e}")


if __name__ == "__main__":
    main()
