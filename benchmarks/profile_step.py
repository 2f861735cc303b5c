"""Where a donated ``ft.step``'s host time goes, for bench_compose's rows on its benchmark tree.

Not a benchmark (no baselines, no ratios): a profile to read next to one.

    python benchmarks/profile_step.py --rows primitives,multi_steps [--device cuda] [--tool torch]

``--tool cprofile`` (default): Python's cProfile of 10 cycles, by own time and by cumulative
time. ``--tool torch``: ``torch.profiler`` of 5 cycles (CPU and CUDA activity: launches, copies,
synchronisations, each operator's host time and the GPU's time). The gradients are cloned
before the timed cycles, so neither profile counts the copies.
"""

import argparse
import cProfile
import pstats
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
    ap.add_argument("--tool", choices=("cprofile", "torch"), default="cprofile")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
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


if __name__ == "__main__":
    main()
