"""Where a donated ``ft.step``'s host time goes, for bench_compose's rows on its benchmark tree.

Not a benchmark (no baselines, no ratios): a profile to read next to one.

    python benchmarks/profile_step.py --rows primitives,multi_steps [--device cuda] [--tool torch]

``--tool cprofile`` (default): Python's cProfile of 10 cycles, by own time and by cumulative
time. ``--tool torch``: ``torch.profiler`` of 5 cycles (CPU and CUDA activity: launches, copies,
synchronisations, each operator's host time and the GPU's time). The gradients are cloned
before the timed cycles, so neither profile counts the copies. ``--tool positions``: per call
of a cycle (``multi_steps``' micro-steps apart), the median host time (to the call's return)
and the time to a synchronisation after it, over ``--cycles`` cycles whose gradients are
fresh clones, freed after their call (as ``bench_compose.py`` runs them, and backward makes
them), and on CUDA the address tables a call copies to the device (a generated stage's
leaves' addresses changed: :mod:`functional_train.engine.fuse_triton`).
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_compose as bc  # noqa: E402
import bench_engine as be  # noqa: E402
import functional_train as ft  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="primitives,multi_steps")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tool", choices=("cprofile", "torch", "positions"), default="cprofile")
    ap.add_argument("--cycles", type=int, default=15, help="--tool positions: timed cycles")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if args.tool == "positions":
        for row in args.rows.split(","):
            positions(row, dev, args.cycles, sync)
        return
    for row in args.rows.split(","):
        params0, grads = bc.problem(be.gpt_shapes(), row, dev)
        tx = bc.make_tx(row)
        p = {k: v.clone() for k, v in params0.items()}
        s = tx.init(p)
        sets = [[{k: v.clone() for k, v in g.items()} for g in grads] for _ in range(28)]
        at = [0]

        def cycle(n: int) -> None:
            nonlocal p, s
            for _ in range(n):
                for g in sets[at[0] % len(sets)]:
                    p, s = ft.step(tx, g, s, p, donate=True)
                at[0] += 1

        cycle(3)
        sync()
        t = time.perf_counter()
        cycle(10)
        sync()
        ms = (time.perf_counter() - t) / 10 * 1e3
        print(f"\n##### {row}: {ms:.2f} ms per cycle of {len(grads)} call(s) on {dev}")
        if args.tool == "torch":
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                cycle(5)
                sync()
            table = prof.key_averages().table
            print(table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
            if dev.type == "cuda":
                print(table(sort_by="self_device_time_total", row_limit=12))
        else:
            pr = cProfile.Profile()
            pr.enable()
            cycle(10)
            sync()
            pr.disable()
            st = pstats.Stats(pr)
            st.sort_stats("tottime").print_stats(25)
            st.sort_stats("cumulative").print_stats(35)


def positions(row: str, dev: torch.device, cycles: int, sync) -> None:
    """``--tool positions`` for one row (see the module docstring)."""
    from functional_train.engine import fuse_triton

    params0, grads = bc.problem(be.gpt_shapes(), row, dev)
    tx = bc.make_tx(row)
    p = {k: v.clone() for k, v in params0.items()}
    s = tx.init(p)
    k = len(grads)
    host: list = [[] for _ in range(k)]
    done: list = [[] for _ in range(k)]
    tables = [0] * k
    for c in range(cycles + 3):  # (3 cycles first, untimed)
        fresh = [be.clone_tree(g) for g in grads]
        sync()
        for i in range(k):
            g = fresh.pop(0)
            before = fuse_triton.tables_copied
            t0 = time.perf_counter()
            p, s = ft.step(tx, g, s, p, donate=True)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            del g  # (freed after the timings: on the CPU a large free unmaps pages)
            if c >= 3:
                host[i].append(t1 - t0)
                done[i].append(t2 - t0)
                tables[i] += fuse_triton.tables_copied - before

    def ms(xs: list) -> str:
        return f"{statistics.median(xs) * 1e3:.3f}"

    print(f"##### {row} on {dev}, donated, fresh gradients, {cycles} cycles; per call:")
    print("  host ms      ", " ".join(ms(x) for x in host))
    print("  synced ms    ", " ".join(ms(x) for x in done))
    if dev.type == "cuda":
        print("  tables copied", " ".join(f"{n / cycles:.2f}" for n in tables))


if __name__ == "__main__":
    main()
