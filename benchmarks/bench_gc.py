"""A training loop's step time with Python's cyclic garbage collector on, frozen and off.

The other benchmarks time their systems with the collector off (``bench_engine.run_rounds``
collects between rounds, untimed), so that a collection of the whole heap does not fall into
one system's round at random. A real training loop pays it. CPython collects its oldest
generation, every object the process holds (about 255,000 after ``import
functional_train``, most of them torch's; about 80 ms on this project's 2-core VMs), once the
objects that survived two young collections since the last one number a quarter of it. A
step that hands back new tensors every call makes such survivors: a pure ``ft.step`` and
``update`` + ``apply_updates`` (their results live a step or a ``multi_steps`` cycle; a pure
step also records the leaves it hands back unchanged, one weak reference each,
``functional_train/aliasing.py``). The torch code writes in place, and so does a donated
``ft.step``.

Each system's loop runs in a process of its own (when a collection starts depends on
everything a process allocates: systems sharing one would pay each other's), the processes
alternated system by system, ``--repeats`` times, each timing ``--cycles`` units (a step, or
a ``multi_steps`` cycle of 4 calls) after ``--warmup``, under three settings of the
collector: ``on`` (Python's default), ``frozen`` (``gc.freeze()`` once the model, its state
and the step are built and warm: the objects alive then are not traversed again) and
``off``. Printed per system and setting: the mean and the median time per unit (medians of
the processes'), the mean's ratio to the torch code's under the same setting, and the oldest
generation's collections per 100 units. A unit's time excludes writing its gradients (fresh
clones, as a backward pass makes; their allocations count for the collector, as a backward
pass's do).

    python benchmarks/bench_gc.py [--rows adamw,multi_steps] [--tree tiny|gpt] [--repeats 3]
                                  [--device cpu|cuda]

The systems and rows are ``bench_compose.py``'s: (b) the torch code (foreach AdamW), (c) a
donated ``ft.step``, (d) a pure one, (e) ``tx.update`` + ``ft.apply_updates``; ``--tree
tiny``: 244 leaves of 4 elements (the time is the host's), ``gpt``: the GPT-like tree. Their
numbers are checked against the torch code's by ``bench_compose.py``, not here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = ("on", "frozen", "off")


def _systems(row: str, tree: str, device_name: str):
    import torch

    import bench_compose as bc
    import bench_engine as be

    torch.set_num_threads(1)
    shapes = bc.tiny_shapes(244) if tree == "tiny" else be.gpt_shapes()
    device = torch.device(device_name)
    params0, grads = bc.problem(shapes, row, device)
    tx = bc.make_tx(row)
    ref = bc.TorchCode(bc.ref_name(row), row, params0, grads, device, fused=False)
    return [ref] + bc.ft_systems(row, tx, params0, grads, device)


def _child(args) -> None:
    """One system's loop under one setting; prints a JSON line of its unit times."""
    system = _systems(args.row, args.tree, args.device)[args.system]
    for _ in range(args.warmup):
        system.prepare()
        system.step()
    gc.collect()
    if args.setting == "frozen":
        gc.freeze()
    elif args.setting == "off":
        gc.disable()
    before = gc.get_stats()[2]["collections"]
    times = []
    for _ in range(args.cycles):
        system.prepare()
        t0 = time.perf_counter()
        system.step()
        times.append(time.perf_counter() - t0)
    full = gc.get_stats()[2]["collections"] - before
    print(json.dumps({"name": system.name, "times": times, "full": full}))


def _run(args, row: str, index: int, setting: str) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        f"--row={row}",
        f"--tree={args.tree}",
        f"--device={args.device}",
        f"--system={index}",
        f"--setting={setting}",
        f"--cycles={args.cycles}",
        f"--warmup={args.warmup}",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=here).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="adamw,multi_steps")
    ap.add_argument("--tree", choices=("tiny", "gpt"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=0, help="units timed (0: 1500 tiny, 400 gpt)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--system", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--setting", choices=SETTINGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.cycles:
        args.cycles = 1500 if args.tree == "tiny" else 400
    if args.child:
        _child(args)
        return
    import torch

    print(f"command: python benchmarks/bench_gc.py {' '.join(sys.argv[1:])}")
    print(
        f"torch {torch.__version__}; {args.device}, 1 thread; tree {args.tree}; each system in "
        f"a process of its own, {args.repeats} per system and setting, alternated; "
        f"{args.cycles} units timed after {args.warmup}; medians of the processes' figures"
    )
    n_systems = 4
    for row in args.rows.split(","):
        got: dict = {}
        for _ in range(args.repeats):
            for setting in SETTINGS:
                for index in range(n_systems):
                    r = _run(args, row, index, setting)
                    got.setdefault((r["name"], setting), []).append(r)
        print(f"\nrow {row} (ms a unit; mean x the torch code's mean; full collections / 100)")
        names = list(dict.fromkeys(name for name, _ in got))
        ref = {
            s: statistics.median(statistics.mean(r["times"]) for r in got[(names[0], s)])
            for s in SETTINGS
        }
        header = "".join(f"{s + ': mean  median   x  full':>32}" for s in SETTINGS)
        print(f"  {'system':<38}{header}")
        for name in names:
            line = f"  {name:<38}"
            for s in SETTINGS:
                rs = got[(name, s)]
                mean = statistics.median(statistics.mean(r["times"]) for r in rs)
                median = statistics.median(statistics.median(r["times"]) for r in rs)
                full = statistics.median(100 * r["full"] / args.cycles for r in rs)
                ms = f"{mean * 1e3:7.3f} {median * 1e3:7.3f}"
                line += f"{' ' * 8}{ms} {mean / ref[s]:5.2f} {full:4.1f}"
            print(line)


if __name__ == "__main__":
    main()
