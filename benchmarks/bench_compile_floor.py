"""What torch alone costs per compiled call with a step's inputs: the floor under ``--compile``.

Issue 29's compiled target is ``torch.compile(ft.step)`` <= 1.2x the eager step of its kind.
A compiled ``ft.step`` of ``multi_steps(chain(clip, adamw), every_k=4)`` on bench_compose's
GPT-like tree (bench_engine's ``gpt_shapes``: 13,650,176 float32 parameters in 122 leaves) takes
610 tensors per call (gradients, accumulators, parameters and Adam's two moments) and calls two
opaque operators (its two stages, see ``functional_train::fused_stage_donated``); a non-final
micro-step makes one pass (the accumulation) and leaves the inner stage idle. This script times
what torch itself costs for such a call, with nothing of functional_train in it, beside the
compiled and eager ``ft.step`` of that row, per micro-step:

  (a) direct       two Python functions called as they are: the first adds the gradients into
                   the accumulators (``torch._foreach_add_``: the micro-step's pass), the second
                   takes the parameters and moments and does nothing (the idle inner stage)
  (b) dispatched   the same two functions as ``torch.library.custom_op`` operators (the first
                   mutating its list, the second declared mutating its inputs, as the donated
                   stage operator is), called through the dispatcher
  (c) compiled     ``torch.compile(fullgraph=True)`` of a function of the five trees (dicts)
                   calling (b)'s operators: dynamo's guard check and input gathering, AOT's
                   runtime wrappers, inductor's ``assert_size_stride`` of every input, the
                   operators' boxed argument lists
  ft eager         ``ft.step(tx, g, s, p, donate=True)``, one cycle of 4 micro-steps
  ft compiled      ``torch.compile`` of the same (fullgraph=True)

Every system runs once per round, interleaved (``--rounds`` timed rounds after 3 untimed ones),
each call after the previous one's pass over the trees (so each starts with cold caches, as in
a training loop). ``(c) - (a)`` is torch's cost per compiled call for these inputs beyond the
pass itself; ``ft compiled - ft eager`` per micro-step is what the compiled step costs beyond the
eager one. At the end the compiled step's parameters are compared with the eager step's (the
largest difference relative to its leaf's largest value). 1 thread (``--threads``), CPU.

    python benchmarks/bench_compile_floor.py [--rounds 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine as be  # noqa: E402
import functional_train as ft  # noqa: E402
from bench_compose import EVERY_K, make_tx, problem  # noqa: E402


@torch.library.custom_op("ft_bench_floor::accumulate", mutates_args=("acc",))
def _accumulate(acc: list[torch.Tensor], g: list[torch.Tensor]) -> None:
    torch._foreach_add_(acc, g)


@_accumulate.register_fake
def _(acc, g):
    return None


@torch.library.custom_op("ft_bench_floor::idle", mutates_args=("xs",))
def _idle(xs: list[torch.Tensor]) -> None:
    pass


@_idle.register_fake
def _(xs):
    return None


def _calling(accumulate, idle):
    """A step of the five trees calling ``accumulate`` and ``idle`` on their tensors."""

    def step(g, acc, p, mu, nu):
        accumulate(list(acc.values()), list(g.values()))
        idle([*p.values(), *mu.values(), *nu.values()])
        return p, (acc, mu, nu)

    return step


_direct = _calling(_accumulate._init_fn, _idle._init_fn)
_dispatched = _calling(_accumulate, _idle)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = be.gpt_shapes()
    g = {k: torch.randn(s) * 1e-2 for k, s in shapes.items()}
    acc, p, mu, nu = ({k: torch.zeros(s) for k, s in shapes.items()} for _ in range(4))
    torch_only = {
        "(a) direct": _direct,
        "(b) dispatched": _dispatched,
        "(c) compiled": torch.compile(_dispatched, fullgraph=True),
    }
    row = "multi_steps"
    tx = make_tx(row)
    params0, grads = problem(shapes, row, torch.device("cpu"))
    steps = {
        "ft eager": lambda g_, s_, p_: ft.step(tx, g_, s_, p_, donate=True),
        "ft compiled": torch.compile(
            lambda g_, s_, p_: ft.step(tx, g_, s_, p_, donate=True), fullgraph=True
        ),
    }

    def fresh():
        params = be.clone_tree(params0)
        return [params, tx.init(params)]

    loops = {n: fresh() for n in steps}
    per_call: dict = {n: [] for n in torch_only}
    per_micro: dict = {n: [[] for _ in range(EVERY_K)] for n in steps}
    gc.collect()
    gc.disable()
    try:
        for r in range(3 + args.rounds):
            gc.collect()
            for name, fn in torch_only.items():
                for _ in range(EVERY_K):  # (as many calls as a cycle: each after a pass)
                    t = time.perf_counter()
                    fn(g, acc, p, mu, nu)
                    if r >= 3:
                        per_call[name].append(time.perf_counter() - t)
            for name, fn in steps.items():
                fresh = [be.clone_tree(x) for x in grads]  # (untimed: donate may write them)
                for i, x in enumerate(fresh):
                    t = time.perf_counter()
                    loops[name][0], loops[name][1] = fn(x, loops[name][1], loops[name][0])
                    if r >= 3:
                        per_micro[name][i].append(time.perf_counter() - t)
    finally:
        gc.enable()

    def ms(xs):
        return statistics.median(xs) * 1e3

    n_in = 5 * len(shapes)
    print(
        f"torch alone, per call: {n_in} input tensors (5 trees x {len(shapes)} leaves), "
        f"median of {args.rounds * EVERY_K} calls, ms"
    )
    direct = ms(per_call["(a) direct"])
    for name, xs in per_call.items():
        extra = "" if name == "(a) direct" else f"   +{ms(xs) - direct:.2f} over (a)"
        print(f"  {name:<16s} {ms(xs):7.2f}{extra}")
    print(f"ft.step({row}, donate=True), per micro-step of a cycle, median of {args.rounds}, ms")
    cycles = {}
    for name, micro in per_micro.items():
        meds = [ms(x) for x in micro]
        cycles[name] = sum(meds)
        row_ms = " ".join(f"{m:7.2f}" for m in meds)
        print(f"  {name:<16s} {row_ms}   cycle {sum(meds):7.2f}")
    eager = [ms(x) for x in per_micro["ft eager"]]
    comp = [ms(x) for x in per_micro["ft compiled"]]
    print(
        "  compiled - eager: "
        + " ".join(f"{c - e:+.2f}" for c, e in zip(comp, eager))
        + f"; compiled x eager (cycle) {cycles['ft compiled'] / cycles['ft eager']:.2f}"
    )
    # (both took the same steps with the same gradients: the compiled step is the eager one)
    diff = max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        for a, b in zip(loops["ft compiled"][0].values(), loops["ft eager"][0].values())
    )
    print(f"  compiled parameters against eager's: largest relative difference {diff:.1e}")
    floor = ms(per_call["(c) compiled"]) - direct
    print(
        f"  torch's own cost per compiled call, (c) - (a): +{floor:.2f} ms; the eager cycle "
        f"with it added to each of its {EVERY_K} calls: "
        f"{(cycles['ft eager'] + EVERY_K * floor) / cycles['ft eager']:.2f}x eager (a compiled "
        "step whose own host work equals the eager step's)"
    )


if __name__ == "__main__":
    main()
