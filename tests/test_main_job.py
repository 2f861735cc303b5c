"""The main job, for real: 3 steps of examples/train_lm.py on 4 gloo processes (dp=2 x tp=2)
give the same parameters as the same 3 steps in one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_lm.py"
SMALL = ["--steps", "3", "--batch", "8", "--accum", "2", "--d-model", "32", "--n-layers", "2",
         "--n-heads", "4", "--seq-len", "32", "--max-bytes", "200000", "--eval-windows", "8",
         "--warmup", "1", "--lr", "1e-2", "--seed", "1"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _run(cmd, out):
    res = subprocess.run(cmd + SMALL + ["--out", str(out)], env=_env(), capture_output=True,
                         text=True, timeout=420)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    return summary, torch.load(out / "params.pt")


def test_dp2_tp2_equals_one_process(tmp_path):
    one, p1 = _run([sys.executable, str(SCRIPT)], tmp_path / "one")
    four, p4 = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "4", str(SCRIPT)], tmp_path / "four")
    assert one["world_size"] == 1 and four["world_size"] == 4
    assert four["mesh"] == {"dp": 2, "tp": 2}
    assert one["steps"] == four["steps"] == 3
    assert set(p1) == set(p4) and len(p1) > 0
    for name in p1:
        assert p1[name].shape == p4[name].shape, name
        torch.testing.assert_close(p4[name], p1[name], rtol=1e-5, atol=1e-6, msg=name)
    for f in ("metrics.json", "loss.png", "params.pt"):
        assert (tmp_path / "four" / f).exists() and (tmp_path / "one" / f).exists()
    assert abs(one["initial_loss"] - four["initial_loss"]) < 1e-4
    assert abs(one["final_loss"] - four["final_loss"]) < 1e-4
