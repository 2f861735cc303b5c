"""What runs just before a system moves its time: each system timed right after each other one.

``bench_engine.run_rounds`` runs its systems round by round, each round in a shuffled order of
its own (since session 75). Before, every round ran in one order, and this script is how that
order was found to favour some systems: on the GPT-like tree of ``bench_compose.py`` a
functional_train step run right after torch's fused AdamW takes 1 to 1.5 ms more than after
another functional_train step. Page faults depend on more than the last neighbour (what the
allocations before left glibc to hand back to the kernel): ``update`` + ``apply_updates``
took twice its time, about 10,000 faults, after three of the six others in one sequence of
runs and in most rows of a shuffled ``bench_compose.py`` run, and none in this script's
sequence (``apply_updates`` has taken its results from a pool since then).

For one row of ``bench_compose.py`` (``--row``, default ``adamw``) it builds that benchmark's
systems (its ``TorchCode`` and ``ft_systems``, compiled ones included with ``--compile``),
warms each up, then ``--rounds`` times, for each target system (``--targets``, letters of
``bench_compose``'s table: ``a`` the fused AdamW base, ``b`` the torch code, ``c`` donated,
``d`` pure, ``e`` ``update`` + ``apply_updates``, ``f`` / ``g`` compiled pure / donated) and
each other system ``x``: runs ``x`` (its ``prepare`` and ``step``), then the target's
``prepare`` and its timed ``step``. Printed: per target, its median ms after each neighbour,
and the median page faults of those steps. Python's collector is off while timing, collected
between rounds (as ``run_rounds`` does). 1 thread, CPU.

    python benchmarks/bench_neighbours.py [--row adamw] [--targets c,e] [--rounds 9] [--compile]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_compose as bc  # noqa: E402
import bench_engine as be  # noqa: E402


def systems(row: str, compiled: bool) -> dict:
    """``bench_compose``'s systems of ``row``, by their letters."""
    cpu = torch.device("cpu")
    params0, grads = bc.problem(be.gpt_shapes(), row, cpu)
    tx = bc.make_tx(row)
    out = {
        "a": bc.TorchCode(
            "(a) AdamW(fused) + clip", row, params0, grads, cpu, fused=True, plain=True
        ),
        "b": bc.TorchCode(bc.ref_name(row), row, params0, grads, cpu, fused=False),
    }
    fts = bc.ft_systems(row, tx, params0, grads, cpu, compiled=compiled)
    out.update(zip("fgcde" if compiled else "cde", fts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="adamw", help="a row of bench_compose.py")
    ap.add_argument("--targets", default="c,e", help="comma-separated letters (a to g)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--compile", action="store_true", help="also the compiled systems f, g")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*donated buffers.*")
    by = systems(args.row, args.compile)
    targets = args.targets.split(",")
    for t in targets:
        if t not in by:
            ap.error(f"no system {t!r} (have {', '.join(by)}; f and g need --compile)")
    print(
        f"row {args.row}: {bc.describe(args.row)}; torch {torch.__version__}, 1 thread, "
        f"{args.rounds} rounds; ms of the target's step right after each neighbour (medians)"
    )
    for s in by.values():  # (warm: the compiled ones compile here)
        for _ in range(2):
            s.prepare()
            s.step()
    times: dict = {}
    faults: dict = {}
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.rounds):
            for t in targets:
                for x, neighbour in by.items():
                    if x == t:
                        continue
                    neighbour.prepare()
                    neighbour.step()
                    by[t].prepare()
                    f0 = be.minor_faults()
                    t0 = time.perf_counter()
                    by[t].step()
                    times.setdefault((t, x), []).append((time.perf_counter() - t0) * 1e3)
                    faults.setdefault((t, x), []).append(be.minor_faults() - f0)
            gc.collect()
    finally:
        gc.enable()
    for t in targets:
        cells = [
            f"{x}={statistics.median(times[(t, x)]):.2f} ({statistics.median(faults[(t, x)]):.0f})"
            for x in by
            if x != t
        ]
        print(f"  {t} after: " + "  ".join(cells) + "   [neighbour=ms (page faults)]")
    print("  systems: " + "; ".join(f"{k}: {s.name}" for k, s in by.items()))


if __name__ == "__main__":
    main()
