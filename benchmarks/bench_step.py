"""Optimizer step time: functional_train vs torch.optim, on plain tensors (one process).

Prints the time of one optimizer step (update + apply_updates) for ``ft.adamw`` and
``ft.chain(ft.clip_by_global_norm, ft.adamw)`` against ``torch.optim.AdamW(foreach=True)``
(+ ``clip_grad_norm_(foreach=True)``), for a model-like tree of many leaves, and the ratio.

    python benchmarks/bench_step.py [--leaves 200] [--size 65536] [--repeat 20]
"""

import argparse
import statistics
import time

import torch

import functional_train as ft


def timeit(fn, repeat):
    fn()  # warm-up
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leaves", type=int, default=200, help="number of parameter tensors")
    ap.add_argument("--size", type=int, default=16384, help="elements per tensor")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    params = {f"p{i}": torch.randn(args.size // 64, 64) for i in range(args.leaves)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}

    results = {}
    for name, tx, clip in [("adamw", ft.adamw(1e-3, weight_decay=0.1), False),
                           ("clip+adamw", ft.chain(ft.clip_by_global_norm(1.0),
                                                   ft.adamw(1e-3, weight_decay=0.1)), True)]:
        state = tx.init(params)

        def ours():
            nonlocal state
            u, state = tx.update(grads, state, params)
            ft.apply_updates(params, u)

        tparams = [torch.nn.Parameter(v.clone()) for v in params.values()]
        for p, g in zip(tparams, grads.values()):
            p.grad = g.clone()
        opt = torch.optim.AdamW(tparams, lr=1e-3, weight_decay=0.1, foreach=True)

        def theirs():
            if clip:
                torch.nn.utils.clip_grad_norm_(tparams, 1.0, foreach=True)
            opt.step()

        a, b = timeit(ours, args.repeat), timeit(theirs, args.repeat)
        results[name] = (a, b)
        print(f"{name:12s} functional_train {a * 1e3:8.2f} ms   torch.optim {b * 1e3:8.2f} ms   "
              f"ratio {a / b:5.2f}x   ({args.leaves} leaves x {args.size} elements, "
              f"{torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
