"""Wrappers around a fused chain, ft.step against the torch.optim code for the same math.

On the GPT-like tree of bench_engine.py (13.65 M float32 parameters, 122 leaves), one thread,
interleaved rounds (each round runs every system once, in order), median ms per step (per
cycle of 4 calls for multi_steps) and its ratio to the torch baselines:

  ema:    chain(clip, adamw, ema_params(0.999))   vs AdamW + clip_grad_norm_ + _foreach_lerp_
  finite: apply_if_finite(chain(clip, adamw), 5)  vs clip_grad_norm_, isfinite(norm), AdamW
  multi:  multi_steps(chain(clip, adamw), 4)      vs 3 _foreach_add_ into .grad, clip, AdamW

torch.optim runs both as AdamW(foreach=True) (the "same math" target) and AdamW(fused=True).
Gradients are written before each timed step, untimed (a fresh clone for ft.step, which may
write into donated gradients; ``.grad.copy_`` for torch).

    python benchmarks/bench_wrappers.py [--rounds 15] [--warmup 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import functional_train as ft
from bench_engine import LR, MAX_NORM, WD, clone_tree, gpt_shapes, make_problem

K = 4


def txs():
    def inner():
        return ft.chain(ft.clip_by_global_norm(MAX_NORM), ft.adamw(LR, weight_decay=WD))

    return {
        "ema": ft.chain(
            ft.clip_by_global_norm(MAX_NORM), ft.adamw(LR, weight_decay=WD), ft.ema_params(0.999)
        ),
        "finite": ft.apply_if_finite(inner(), 5),
        "multi": ft.multi_steps(inner(), K),
    }


class Ft:
    def __init__(self, kind, tx, params, grads, donate):
        self.kind, self.tx, self.donate = kind, tx, donate
        self.p = clone_tree(params)
        self.s = tx.init(self.p)
        self.gsrc = grads
        self.name = f"ft.step {kind} {'donate' if donate else 'pure'}"

    def run(self):
        n = K if self.kind == "multi" else 1
        total = 0.0
        for _ in range(n):
            g = clone_tree(self.gsrc)
            t0 = time.perf_counter()
            self.p, self.s = ft.step(self.tx, g, self.s, self.p, donate=self.donate)
            total += time.perf_counter() - t0
            del g
        return total


class Torch:
    def __init__(self, kind, params, grads, impl):
        self.kind = kind
        self.ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
        self.gsrc = list(grads.values())
        for p, g in zip(self.ps, self.gsrc):
            p.grad = g.clone()
        self.opt = torch.optim.AdamW(self.ps, lr=LR, weight_decay=WD, **{impl: True})
        self.ema = [p.detach().clone() for p in self.ps]
        self.name = f"torch {impl} {kind}"

    def run(self):
        with torch.no_grad():
            for p, g in zip(self.ps, self.gsrc):
                p.grad.copy_(g)
        grads = [p.grad for p in self.ps]
        t0 = time.perf_counter()
        if self.kind == "multi":
            for _ in range(K - 1):  # the later micro-batches' backward passes add into .grad
                torch._foreach_add_(grads, self.gsrc)
        norm = torch.nn.utils.clip_grad_norm_(self.ps, MAX_NORM, foreach=True)
        if self.kind == "finite":
            if torch.isfinite(norm):
                self.opt.step()
        else:
            self.opt.step()
        if self.kind == "ema":
            with torch.no_grad():
                torch._foreach_lerp_(self.ema, [p.detach() for p in self.ps], 1 - 0.999)
        return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    params, grads = make_problem(gpt_shapes())
    for kind, tx in txs().items():
        systems = [
            Torch(kind, params, grads, "foreach"),
            Torch(kind, params, grads, "fused"),
            Ft(kind, tx, params, grads, True),
            Ft(kind, tx, params, grads, False),
        ]
        times = {s.name: [] for s in systems}
        for r in range(a.warmup + a.rounds):
            for s in systems:
                t = s.run()
                if r >= a.warmup:
                    times[s.name].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        base_foreach, base_fused = med[systems[0].name], med[systems[1].name]
        print(f"-- {kind} ({'one cycle of 4 calls' if kind == 'multi' else 'one step'})")
        for s in systems:
            m = med[s.name]
            print(
                f"  {s.name:32s} {m * 1e3:8.2f} ms   x{m / base_foreach:5.2f} foreach"
                f"   x{m / base_fused:5.2f} fused"
            )


if __name__ == "__main__":
    main()
