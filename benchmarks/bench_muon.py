"""Muon's step: functional_train against torch.optim.Muon, one process.

The hidden matrices of a GPT-like tree (``--layers`` layers of q/k/v/o ``d x d``, w1/w3
``ff x d``, w2 ``d x ff``; default 2 layers, d 128, ff 512: 14 matrices, 0.53 M float32
parameters -- bfloat16 matrix products are slow on CPUs without bfloat16 units, about 0.7 s
for one 1024 x 256 Newton-Schulz here, so the benchmark tree of ``bench_engine.py``, 84 such
matrices, would take half a minute a step), gradients ~1e-2 randn, lr 2e-2, weight decay 0.1,
momentum 0.95, Nesterov, 5 bfloat16 Newton-Schulz steps. Systems, interleaved round by round
in one process after ``--warmup`` untimed rounds (``--rounds`` timed; median ms/step and the
ratio to the first):

  1. torch.optim.Muon (baseline; its per-parameter loop)
  2. ft.step(ft.muon-equivalent chain, donate=False)
  3. ft.step(..., donate=True)

The chain is ``chain(scale_by_muon(), add_decayed_weights(0.1), scale_by_learning_rate(2e-2))``
(what ``ft.muon`` gives every hidden matrix). Before each timed step every system gets freshly
written gradients, untimed. After all rounds the parameters of every system are compared with
the baseline's (all have taken the same steps).

    python benchmarks/bench_muon.py [--rounds 10] [--warmup 2] [--threads 1] [--layers 2]
        [--d 128] [--ff 512]

Under torchrun (``torchrun --standalone --nproc-per-node 4 benchmarks/bench_muon.py``) the
same matrices are DTensors on a (dp, tp) gloo mesh (``--tp``, default 2; tensor parallel
``Shard(0)`` for q/k/v/w1/w3 and ``Shard(1)`` for o/w2, ``Replicate`` over dp) and the
distributed schemes are compared, interleaved round by round, pure ``ft.step``:

  1. Newton-Schulz gathered onto every rank (every rank all-gathers every sharded matrix and
     orthogonalises all of them; the scheme before owners, ``muon._DISTRIBUTED = False``)
  2. Newton-Schulz at owner ranks (each matrix once; all-to-alls; the default)

printing per scheme the slowest rank's median ms/step and its ratio to the first, the bytes of a
rank's collective inputs per step (mean over ranks; an all-gather's input goes to each of the
other ``tp - 1`` ranks, an all-to-all's input is split among the ranks of its mesh dim, the
rank's own block staying), and the Newton-Schulz multiply-adds of the busiest rank (and their
fraction of the whole tree's). The parameters of both are compared after
all rounds (bit for bit).
"""

import argparse
import importlib
import os
import statistics
import time

import torch

import functional_train as ft

fm = importlib.import_module("functional_train.muon")  # (ft.muon is the function)

LR, WD, MOMENTUM = 2e-2, 0.1, 0.95


def shapes(layers, d, ff):
    out = {}
    for i in range(layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "wq": (d, d),
                p + "wk": (d, d),
                p + "wv": (d, d),
                p + "wo": (d, d),
                p + "w1": (ff, d),
                p + "w3": (ff, d),
                p + "w2": (d, ff),
            }
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--tp", type=int, default=2, help="tensor parallel size under torchrun")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return distributed(args)
    gen = torch.Generator().manual_seed(0)
    sh = shapes(args.layers, args.d, args.ff)
    p0 = {k: torch.randn(s, generator=gen) * 0.02 for k, s in sh.items()}
    g0 = {k: torch.randn(s, generator=gen) * 1e-2 for k, s in sh.items()}
    n = sum(x.numel() for x in p0.values())
    print(
        f"torch {torch.__version__}; {len(p0)} matrices, {n:,} float32 params; "
        f"{args.threads} thread(s); {args.rounds} rounds after {args.warmup} warm-up"
    )

    ref = [torch.nn.Parameter(x.clone()) for x in p0.values()]
    opt = torch.optim.Muon(ref, lr=LR, weight_decay=WD, momentum=MOMENTUM)
    tx = ft.chain(
        ft.scale_by_muon(MOMENTUM), ft.add_decayed_weights(WD), ft.scale_by_learning_rate(LR)
    )
    runs = {
        "pure": [dict(p0), tx.init(p0)],
        "donate": [{k: v.clone() for k, v in p0.items()}, tx.init(p0)],
    }

    def torch_step():
        opt.step()

    def ft_step(kind):
        def run(grads):
            params, state = runs[kind]
            runs[kind] = list(ft.step(tx, grads, state, params, donate=kind == "donate"))

        return run

    systems = [
        ("torch.optim.Muon", None),
        ("ft.step(donate=False)", ft_step("pure")),
        ("ft.step(donate=True)", ft_step("donate")),
    ]
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
        print(
            f"  {name:28s} {med * 1e3:9.2f} {min(times[name]) * 1e3:8.2f} {med / base:6.2f}"
            f"  {diff:.1e}"
        )


def ns_cost(shape):
    m, n = sorted(shape)
    return 2 * m * m * n + m * m * m


def distributed(args):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from functional_train.testing import count_collectives

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(0)
    sh = shapes(args.layers, args.d, args.ff)
    p0 = {k: torch.randn(s, generator=gen) * 0.02 for k, s in sh.items()}
    g0 = {k: torch.randn(s, generator=gen) * 1e-2 for k, s in sh.items()}

    def placed(k, v):
        tp = Shard(1) if k.endswith(("wo", "w2")) else Shard(0)
        return distribute_tensor(v, mesh, [Replicate(), tp])

    params0 = {k: placed(k, v) for k, v in p0.items()}
    grads = {k: placed(k, v) for k, v in g0.items()}
    share = sum(v.to_local().numel() * v.element_size() for v in params0.values())
    tx = ft.chain(
        ft.scale_by_muon(MOMENTUM), ft.add_decayed_weights(WD), ft.scale_by_learning_rate(LR)
    )
    fmesh = ft.Mesh(mesh)
    schemes = {"gather onto every rank": False, "owners": True}
    runs = {name: [params0, tx.init(params0)] for name in schemes}
    flops = [0]
    real_ns = fm.newton_schulz

    def counting_ns(x, *a, **k):
        flops[0] += ns_cost(tuple(x.shape))
        return real_ns(x, *a, **k)

    stats = {}
    for name, owners in schemes.items():  # one counted step each (not timed)
        fm._DISTRIBUTED = owners
        fm.newton_schulz, flops[0] = counting_ns, 0
        with count_collectives() as c:
            ft.step(tx, grads, *runs[name][1:], runs[name][0], mesh=fmesh)
        fm.newton_schulz = real_ns
        stats[name] = dict(counts=c.counts, bytes=sum(c.bytes.values()), flops=flops[0])
    n = sum(x.numel() for x in p0.values())
    if rank == 0:
        print(
            f"torch {torch.__version__}; {len(p0)} matrices, {n:,} float32 params on a "
            f"(dp {world // args.tp}, tp {args.tp}) gloo mesh, {args.threads} thread(s) per "
            f"rank; {args.rounds} rounds after {args.warmup} warm-up"
        )
    times = {name: [] for name in schemes}
    for r in range(args.warmup + args.rounds):
        for name, owners in schemes.items():
            fm._DISTRIBUTED = owners
            params, state = runs[name]
            dist.barrier()
            t = time.perf_counter()
            runs[name] = list(ft.step(tx, grads, state, params, mesh=fmesh))
            dt = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(dt, dist.ReduceOp.MAX)
            if r >= args.warmup:
                times[name].append(dt.item())
    every = [None] * world
    dist.all_gather_object(every, {k: v for k, v in stats.items()})
    first = {k: v.full_tensor() for k, v in runs["gather onto every rank"][0].items()}
    other = {k: v.full_tensor() for k, v in runs["owners"][0].items()}
    same = all(torch.equal(first[k], other[k]) for k in first)
    if rank == 0:
        base = statistics.median(times["gather onto every rank"])
        print(
            f"\n  {'scheme':24s} {'ms/step':>9s} {'ratio':>6s} {'collectives':>34s} "
            f"{'input KiB':>10s} {'NS MACs (max rank)':>19s} {'vs total':>8s}"
        )
        total = sum(ns_cost(s) for s in sh.values())
        for name in schemes:
            med = statistics.median(times[name])
            kib = statistics.mean(e[name]["bytes"] for e in every) / 1024
            mx = max(e[name]["flops"] for e in every)
            counts = ", ".join(f"{k} {v}" for k, v in sorted(stats[name]["counts"].items()))
            print(
                f"  {name:24s} {med * 1e3:9.1f} {med / base:6.2f} {counts:>34s} {kib:10.1f} "
                f"{mx:19,d} {mx / total:8.2f}"
            )
        print(
            f"\n  a rank's share of the matrices: {share / 1024:.1f} KiB; parameters of the two "
            f"schemes after all rounds bit for bit equal: {same}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
