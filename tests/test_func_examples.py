"""The torch.func examples run (small sizes): ``examples/ensemble.py`` (a vmapped ensemble
equals K separate ``ft.step`` loops), ``examples/meta_lr.py`` (the meta-gradient through the
unrolled steps equals central differences, and the learned rate lowers the validation loss),
``examples/dp_sgd.py`` (DP-SGD learns the task)."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import dp_sgd  # noqa: E402
import ensemble  # noqa: E402
import meta_lr  # noqa: E402


def test_ensemble_equals_separate_steps():
    out = ensemble.main(["--models", "3", "--steps", "6", "--batch", "16"])
    assert out["max_diff"] < 1e-5
    assert all(b < a for a, b in zip(out["start"], out["losses"]))


def test_meta_lr_gradient_and_progress():
    out = meta_lr.main(["--unroll", "4", "--outer", "5"])
    assert abs(out["grad"] - out["fd"]) <= 1e-6 * abs(out["fd"]) and abs(out["fd"]) > 0.1
    (lr0, loss0), (lr1, loss1) = out["history"][0], out["history"][-1]
    assert lr1 > lr0 and loss1 < loss0


def test_dp_sgd_learns():
    out = dp_sgd.main(["--steps", "30", "--batch", "32"])
    assert out["accuracy_dp"] > 0.9 and out["accuracy"] > 0.9
