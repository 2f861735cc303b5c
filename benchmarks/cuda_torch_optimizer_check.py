"""Device check for TorchOptimizer on CUDA parameters (issue 28): against torch.optim.AdamW / SGD
(fused and foreach), state dicts both ways mid-run, deepcopy / pickle, a CUDA tensor lr set to NaN,
and the pure step's copies of unchanged leaves (ft.step pure vs donated, interleaved medians).
Run on a CUDA machine: ``python benchmarks/cuda_torch_optimizer_check.py``."""

import copy
import pickle
import statistics
import time

import torch

import functional_train as ft

print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
dev = "cuda"


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32)
    ).to(dev)


gen = torch.Generator(device=dev).manual_seed(1)
batches = [
    (torch.randn(16, 64, device=dev, generator=gen), torch.randn(16, 32, device=dev, generator=gen))
    for _ in range(8)
]


def run(m, o, bs):
    for x, y in bs:
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()


def maxrel(a, b, s):
    return max(
        ((p - q).abs().max() / (q - r).abs().max().clamp_min(1e-30)).item()
        for p, q, r in zip(a.parameters(), b.parameters(), s.parameters())
    )


for name, make_t, make_f in [
    (
        "AdamW",
        lambda ps, **k: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **k),
        lambda ps: ft.TorchOptimizer(ps, ft.adamw(1e-3, weight_decay=0.1)),
    ),
    (
        "SGD",
        lambda ps, **k: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, **k),
        lambda ps: ft.TorchOptimizer(ps, ft.sgd(1e-2, momentum=0.9)),
    ),
]:
    for impl in ({"fused": True}, {"foreach": True}):
        start = model()
        t, f = copy.deepcopy(start), copy.deepcopy(start)
        ot, of = make_t(t.parameters(), **impl), make_f(f.named_parameters())
        run(t, ot, batches[:3])
        run(f, of, batches[:3])
        r1 = maxrel(f, t, start)
        f2 = copy.deepcopy(t)
        of2 = make_f(f2.parameters())
        of2.load_state_dict(copy.deepcopy(ot.state_dict()))
        t2 = copy.deepcopy(t)
        ot2 = make_t(t2.parameters(), **impl)
        ot2.load_state_dict(copy.deepcopy(of2.state_dict()))
        run(t, ot, batches[3:])
        run(t2, ot2, batches[3:])
        run(f2, of2, batches[3:])
        back = all(torch.equal(p, q) for p, q in zip(t.parameters(), t2.parameters()))
        r2 = maxrel(f2, t, start)
        print(
            f"{name} {impl}: ours vs torch after 3 steps max rel {r1:.2e}; "
            f"torch->ours->torch bitwise {back}; ours from torch's state vs torch {r2:.2e}",
            flush=True,
        )

m = model()
o = ft.TorchOptimizer(m.named_parameters(), ft.adamw(torch.tensor(1e-3, device=dev)))
run(m, o, batches[:2])
o.param_groups[0]["lr"].fill_(float("nan"))
try:
    run(m, o, batches[2:3])
    print("nan cuda lr: NOT raised")
except ValueError as e:
    print("nan cuda lr raised:", str(e)[:90])
m = model()
o = ft.TorchOptimizer(m.named_parameters(), ft.adamw(1e-3))
run(m, o, batches[:2])
for label, c in (("deepcopy", copy.deepcopy(o)), ("pickle", pickle.loads(pickle.dumps(o)))):
    ps = [p for g in c.param_groups for p in g["params"]]
    for p, q in zip(ps, m.parameters()):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    c.step()
    print(label, "steps on", ps[0].device, "step =", float(c.state_dict()["state"][0]["step"]))

# the pure step's copies (issue item 7): 122 leaves, 4M params, interleaved medians
torch.manual_seed(0)
shapes = [(256, 256)] * 60 + [(256,)] * 62
params = {f"p{i}": torch.randn(s, device=dev) for i, s in enumerate(shapes)}
tx = ft.adamw(1e-3)
for frac in (0.0, 0.5, 0.9):
    grads = {
        k: (None if i < int(frac * len(shapes)) else torch.randn_like(v))
        for i, (k, v) in enumerate(params.items())
    }
    s = tx.init(params)
    times = {"pure": [], "donate": []}
    for _r in range(30):
        for mode in ("pure", "donate"):
            p = {k: v.clone() for k, v in params.items()}
            st = copy.deepcopy(s)
            g = {k: (None if v is None else v.clone()) for k, v in grads.items()}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ft.step(tx, g, st, p, donate=(mode == "donate"))
            torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - t0)
    a, b = statistics.median(times["pure"][5:]), statistics.median(times["donate"][5:])
    print(
        f"None fraction {frac}: pure {a * 1e3:.3f} ms, donated {b * 1e3:.3f} ms, ratio {a / b:.2f}",
        flush=True,
    )
