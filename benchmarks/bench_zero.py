"""ZeRO: ``ft.zero_redundancy(chain(clip, adamw), axis="dp")`` against torch's
``ZeroRedundancyOptimizer`` on the same replicated parameters.

The problem is bench_engine's GPT-like tree (13,650,176 float32 parameters in 122 leaves),
DDP-style: every rank holds the whole parameters and the same, already averaged gradients
(plain tensors; what ``DistributedDataParallel`` hands an optimizer), ``--world`` gloo ranks on
this machine (default 2), 1 thread each. Systems, interleaved round by round
(bench_engine's ``run_rounds``, a barrier before each; a unit's time is the slowest rank's):

  (a) torch ZeRO   torch.nn.utils.clip_grad_norm_(foreach) over the whole gradients, then
                   ZeroRedundancyOptimizer(optimizer_class=AdamW, foreach=True): each rank steps
                   its share of the parameters and broadcasts it
  (b) donate       ft.step(tx, grads, state, params, mesh=ft.Mesh(mesh), donate=True), tx =
                   zero_redundancy(chain(clip_by_global_norm(1.0), adamw(1e-3,
                   weight_decay=0.1)), axis="dp"): each rank steps the chain (fused, p + u
                   included) on 1/world of every leaf, its state too, and the new parameter
                   chunks are all-gathered into the parameters
  (c) pure         the same, donate=False
  (d) update       updates, state = tx.update(...); params = ft.apply_updates(params, updates):
                   the updates all-gathered, then p + u over whole leaves

Printed: the median and minimum per unit, the ratio to (a), and each system's largest
parameter difference from (a) after the timed rounds.

    python benchmarks/bench_zero.py [--rounds 7] [--world 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_compose as bc  # noqa: E402
import bench_engine as be  # noqa: E402
import functional_train as ft  # noqa: E402

LR, WD, MAX_NORM = 1e-3, 0.1, 1.0


class TorchZero:
    def __init__(self, name, params0, grads0):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.name = name
        self.ps = [torch.nn.Parameter(v.clone()) for v in params0.values()]
        self.gsrc = list(grads0.values())
        self.opt = ZeroRedundancyOptimizer(
            self.ps, optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WD, foreach=True
        )

    def prepare(self):
        for p, g in zip(self.ps, self.gsrc):
            p.grad = g.clone()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.ps, MAX_NORM, foreach=True)
        self.opt.step()

    def params(self):
        return [p.detach() for p in self.ps]


def worker(rank, world, port, args):
    with be.gloo_dp(rank, world, port) as (dm, _, log, reduce_max):
        import torch.distributed as dist

        p0, gs = bc.problem(be.gpt_shapes(), "adamw", torch.device("cpu"))
        tx = ft.zero_redundancy(
            ft.chain(ft.clip_by_global_norm(MAX_NORM), ft.adamw(LR, weight_decay=WD)),
            axis="dp",
            device_mesh=dm,
        )
        mesh = ft.Mesh(dm)

        def update_apply(g, s, p):
            u, s = tx.update(g, s, p, mesh=mesh)
            return ft.apply_updates(p, u), s

        systems = [
            TorchZero("(a) torch ZeRO, AdamW(foreach) + clip", p0, gs[0]),
            be.PureLoop(
                "(b) ft.step(donate=True)",
                lambda g, s, p: ft.step(tx, g, s, p, mesh=mesh, donate=True),
                tx,
                p0,
                gs[0],
            ),
            be.PureLoop(
                "(c) ft.step(donate=False), pure",
                lambda g, s, p: ft.step(tx, g, s, p, mesh=mesh),
                tx,
                p0,
                gs[0],
            ),
            be.PureLoop("(d) tx.update + apply_updates", update_apply, tx, p0, gs[0]),
        ]
        times, _, _ = be.run_rounds(
            systems, args.rounds, args.warmup, dist.barrier, reduce_max, log=log
        )
        base = statistics.median(times[systems[0].name])
        ref = systems[0].params()
        log(
            f"torch {torch.__version__}; {world} gloo ranks, 1 thread each; GPT-like tree "
            f"13,650,176 float32 params in 122 leaves, replicated; {args.rounds} timed rounds "
            f"after {args.warmup}, interleaved; medians"
        )
        log(f"  {'system':42s} {'ms/unit':>8s} {'min ms':>8s} {'x torch':>8s} {'max diff':>9s}")
        for s in systems:
            t = times[s.name]
            diff = max(float((a - b).abs().max()) for a, b in zip(s.params(), ref))
            diff = reduce_max(diff)
            log(
                f"  {s.name:42s} {statistics.median(t) * 1e3:8.2f} {min(t) * 1e3:8.2f} "
                f"{statistics.median(t) / base:8.2f} {diff:9.1e}"
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args.world, be._free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
