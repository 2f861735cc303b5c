"""8-bit block-wise Adam moments on the main job: loss and optimizer memory against float32.

Runs ``examples/train_lm.py`` twice with the same seed and data, with float32 and with 8-bit
AdamW moments (``--8bit``: ``ft.adamw(..., optim_bits=8)``, leaves of >= 4096 elements), and
prints the final training loss (mean over the last 10 steps, to smooth batch noise), the
validation loss, their relative differences, and the optimizer state bytes.

Usage::

    python benchmarks/bench_8bit.py  # 200 steps of the default model (~5 min on 2 cores)
    python benchmarks/bench_8bit.py --steps 50  # quicker
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "..", "examples", "train_lm.py")


def run(steps, extra, out):
    cmd = [sys.executable, TRAIN, "--steps", str(steps), "--eval-every", "0", "--out", out, *extra]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    with open(os.path.join(out, "metrics.json")) as f:
        losses = [s["loss"] for s in json.load(f)["steps"]]
    summary["last10"] = sum(losses[-10:]) / len(losses[-10:])
    return summary


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="runs/bench_8bit")
    args = p.parse_args()
    f32 = run(args.steps, [], os.path.join(args.out, "fp32"))
    b8 = run(args.steps, ["--8bit"], os.path.join(args.out, "8bit"))
    for name, key in (
        ("final train loss (last 10 steps)", "last10"),
        ("final step loss", "final_loss"),
        ("validation loss", "val_loss"),
    ):
        rel = (b8[key] - f32[key]) / f32[key]
        print(f"{name:34s} float32 {f32[key]:.4f}   8-bit {b8[key]:.4f}   ({100 * rel:+.2f}%)")
    f32_bytes, b8_bytes = f32["state_bytes_per_rank"], b8["state_bytes_per_rank"]
    print(
        f"{'optimizer state bytes':34s} float32 {f32_bytes:,}   8-bit "
        f"{b8_bytes:,}   ({b8_bytes / f32_bytes:.3f}x)"
    )
    f32_time, b8_time = f32["train_time_s"], b8["train_time_s"]
    print(f"{'training time (s)':34s} float32 {f32_time:.1f}   8-bit {b8_time:.1f}")


if __name__ == "__main__":
    main()
