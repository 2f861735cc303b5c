"""The main job, for real: 3 steps of examples/train_lm.py on 4 gloo processes (dp=2 x tp=2)
give the same parameters as the same 3 steps in one process."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # runs examples/train_lm.py, on 4 processes too

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_lm.py"
SMALL = [
    "--steps",
    "3",
    "--batch",
    "8",
    "--accum",
    "2",
    "--d-model",
    "32",
    "--n-layers",
    "2",
    "--n-heads",
    "4",
    "--seq-len",
    "32",
    "--max-bytes",
    "200000",
    "--eval-windows",
    "8",
    "--warmup",
    "1",
    "--lr",
    "1e-2",
    "--seed",
    "1",
]


def _env():
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]


def _run(cmd, out, extra=()):
    """The job as ``cmd`` + SMALL + ``extra``; returns ``(summary, params, its stderr)``."""
    res = subprocess.run(
        cmd + SMALL + [*extra, "--out", str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    return summary, torch.load(out / "params.pt"), res.stderr.replace("\r", "\n")


def test_dp2_tp2_equals_one_process(tmp_path):
    one, p1, _ = _run([sys.executable, str(SCRIPT)], tmp_path / "one")
    four, p4, _ = _torchrun([], tmp_path / "four")
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


def _torchrun(args, out, extra=()):
    """4 gloo processes of the job with ``args`` under torchrun: see :func:`_run`."""
    return _run(TORCHRUN + [str(SCRIPT), *args], out, extra)


def _job(ranks, world, args, out, extra=()):
    """The job with ``args`` + SMALL + ``extra`` on ``world`` of the session's ranks (its
    ``main`` run as ``python`` / ``torchrun`` run the script, without starting processes);
    returns ``(summary, params, rank 0's output)`` as :func:`_run` does."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [*args, *SMALL, *extra, "--out", str(out)]
    summary = ranks.run(world, "_main_job:main", argv, log=out / "job.log", timeout=420)[0]
    log = (out / "job.log.rank0").read_text(errors="replace")
    return summary, torch.load(out / "params.pt"), log.replace("\r", "\n")


def _same_training(one, p1, p4, out):
    """The parameters within 1e-5 and the logged gradient norm at every step of the run in
    ``out`` equal the one-process run's; returns the run's per-step metrics."""
    assert set(p1) == set(p4)
    for name in p1:
        torch.testing.assert_close(p4[name], p1[name], rtol=1e-5, atol=1e-6, msg=name)
    steps4 = json.loads((out / "metrics.json").read_text())["steps"]
    steps1 = json.loads((Path(one["out"]) / "metrics.json").read_text())["steps"]
    assert len(steps4) == len(steps1) == 3
    for a, b in zip(steps4, steps1):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    return steps4


def _collectives(log):
    return [line for line in log.splitlines() if "collectives per update" in line]


_ONE = {}


def _one_process(ranks, optimizer, tmp_path_factory):
    """The one-process run of ``optimizer`` (cached: the pipeline layouts compare with it)."""
    if optimizer not in _ONE:
        out = tmp_path_factory.mktemp(f"one-{optimizer}")
        _ONE[optimizer] = _job(ranks, 1, ["--optimizer", optimizer], out)[:2]
    return _ONE[optimizer]


def _every_pair(first: list, second: list) -> list:
    """Every pair of two parameter lists (a 4-process case takes about 2 s on the session's
    ranks; before they were kept, about 15, and the tests ran a covering subset)."""
    return [(a, b) for a in first for b in second]


OPTIMIZERS = ["adamw", "adafactor", "lamb"]


@pytest.mark.parametrize(
    "optimizer,layout",
    _every_pair(OPTIMIZERS, ["pp2-tp2", "pp2-dp2"]),
)
def test_pipeline_stages_equal_one_process(layout, optimizer, tmp_path, tmp_path_factory, ranks):
    """3 steps with the decoder's 2 layers in 2 pipeline stages (torch.distributed.pipelining,
    1F1B over micro-batches; with tensor or data parallelism beside it) on 4 gloo processes
    give one process's parameters within 1e-5 (adamw, adafactor and lamb: per-leaf statistics
    and norms that live on one stage, a clip over both), its logged gradient norm at every
    step, and each stage's own norm, which the job logs too, differs from it while their root
    sum of squares is it. The step's all-reduces (``COLLECTIVES``, as measured; constant in the
    number of layers, see below) are the clip's one and the optimizer's statistics (adafactor
    2, lamb 1) at pp=2 x tp=2; at pp=2 x dp=2, where ``multi_steps`` (``--accum 2``) averages
    the gradients over dp on the last micro-step, the data-parallel reductions come on top."""
    dims = {
        "pp2-tp2": ["--pp", "2", "--tp", "2"],
        "pp2-dp2": ["--pp", "2", "--dp", "2", "--tp", "1"],
    }[layout]
    one, p1 = _one_process(ranks, optimizer, tmp_path_factory)
    four, p4, log = _job(ranks, 4, ["--optimizer", optimizer, *dims], tmp_path)
    assert four["mesh"] == {
        "pp": 2,
        "dp": 2 if "dp2" in layout else 1,
        "tp": 2 if "tp2" in layout else 1,
    }
    for a in _same_training(one, p1, p4, tmp_path):
        stage = a["stage_grad_norms"]
        assert len(stage) == 2 and all(s < a["grad_norm"] for s in stage)
        assert math.hypot(*stage) == pytest.approx(a["grad_norm"], rel=1e-5)
        # each stage's own: a norm over every rank (both stages mixed) would give both the
        # same value, global / sqrt(2)
        assert abs(stage[0] - stage[1]) > 1e-3 * a["grad_norm"], stage
    collectives = _collectives(log)
    want = COLLECTIVES[optimizer][layout]
    assert collectives and collectives[0].endswith(f"all_reduce {want}"), collectives


COLLECTIVES = {
    "adamw": {"pp2-tp2": 1, "pp2-dp2": 3},
    "adafactor": {"pp2-tp2": 3, "pp2-dp2": 4},
    "lamb": {"pp2-tp2": 2, "pp2-dp2": 4},
}


def test_pipeline_collectives_do_not_grow_with_layers(tmp_path, ranks):
    """Twice the layers per stage (4 in 2 stages, pp=2 x tp=2): the same 3 all-reduces for
    clip + adafactor as with 2 layers."""
    _, _, log = _job(
        ranks,
        4,
        ["--optimizer", "adafactor", "--pp", "2", "--tp", "2"],
        tmp_path,
        ["--n-layers", "4", "--steps", "1"],
    )
    collectives = _collectives(log)
    assert collectives and collectives[0].endswith("all_reduce 3"), collectives


_ONE_MOE = {}


def _one_process_moe(ranks, optimizer, experts, tmp_path_factory):
    """The one-process MoE run (cached per optimizer and expert representation)."""
    key = (optimizer, experts)
    if key not in _ONE_MOE:
        out = tmp_path_factory.mktemp(f"one-moe-{optimizer}-{experts}")
        _ONE_MOE[key] = _job(ranks, 1, ["--optimizer", optimizer, *MOE, "--experts", experts], out)[
            :2
        ]
    return _ONE_MOE[key]


MOE = ["--moe", "4", "--top-k", "2"]


@pytest.mark.parametrize(
    "optimizer,experts",
    _every_pair(OPTIMIZERS, ["stacked", "separate"]),
)
def test_expert_parallel_equals_one_process(experts, optimizer, tmp_path, tmp_path_factory, ranks):
    """3 steps of the MoE decoder (4 SwiGLU experts per layer, top-2, load-balancing loss,
    dropless) at ep=2 x dp=2 on 4 gloo processes (tokens dispatched by all-to-all; each rank
    holds 2 experts and its own quarter of the batch) give one process's parameters within
    1e-5 and its gradient norm at every step, with the experts declared either as DTensors
    ``Shard(0)`` over "ep" (stacked) or by ``is_expert`` (separate modules). Each ep rank's own
    norm, which the job logs, differs from the global one. The step's all-reduces: agreeing on
    present gradients, the mean over dp, the mean over ep (experts: over dp, divided by ep), the
    clip's norm, and adafactor's or lamb's per-leaf statistics."""
    one, p1 = _one_process_moe(ranks, optimizer, experts, tmp_path_factory)
    four, p4, log = _job(
        ranks,
        4,
        [
            "--optimizer",
            optimizer,
            *MOE,
            "--experts",
            experts,
            "--ep",
            "2",
            "--dp",
            "2",
            "--tp",
            "1",
        ],
        tmp_path,
    )
    assert four["mesh"] == {"dp": 2, "ep": 2, "tp": 1}
    assert (
        four["moe"]
        == one["moe"]
        == {"experts": 4, "top_k": 2, "aux_loss": 0.01, "stacked": experts == "stacked"}
    )
    expert_names = [k for k in p1 if ".experts." in k or k.endswith(("mlp.w_up", "mlp.w_gate"))]
    assert len(expert_names) == (2 * 2 if experts == "stacked" else 2 * 4 * 3)
    for a in _same_training(one, p1, p4, tmp_path):
        own = a["ep_rank_grad_norms"]
        assert len(own) == 2 and all(abs(n - a["grad_norm"]) > 1e-3 * a["grad_norm"] for n in own)
        assert abs(own[0] - own[1]) > 1e-3 * a["grad_norm"], own  # each rank's own, not mixed
    collectives = _collectives(log)
    want = {"adamw": 4, "adafactor": 5, "lamb": 5}[optimizer]
    assert collectives and collectives[0].endswith(f"all_reduce {want}"), collectives
    assert any("each expert-parallel rank's own norm" in line for line in log.splitlines())


@pytest.mark.parametrize("optimizer, experts", [("adafactor", "stacked"), ("adamw", "separate")])
def test_expert_parallel_with_zero_equals_one_process(
    optimizer, experts, tmp_path, tmp_path_factory, ranks
):
    """``--zero`` at ep=2 x dp=2: the optimizer state sharded over dp, the gradients averaged
    over ep first (one all-reduce), then reduce-scattered over dp; the same parameters and
    gradient norms as one process."""
    one, p1 = _one_process_moe(ranks, optimizer, experts, tmp_path_factory)
    four, p4, log = _job(
        ranks,
        4,
        [
            "--optimizer",
            optimizer,
            *MOE,
            "--experts",
            experts,
            "--ep",
            "2",
            "--dp",
            "2",
            "--tp",
            "1",
            "--zero",
        ],
        tmp_path,
    )
    assert four["zero"] and four["mesh"] == {"dp": 2, "ep": 2, "tp": 1}
    _same_training(one, p1, p4, tmp_path)
    collectives = _collectives(log)
    assert collectives and "reduce_scatter_tensor 1" in collectives[0], collectives


def test_expert_collectives_do_not_grow_with_experts(tmp_path, ranks):
    """Twice the experts (8 per layer, 4 per ep rank): the same 5 all-reduces for clip +
    adafactor at ep=2 x dp=2 as with 4."""
    _, _, log = _job(
        ranks,
        4,
        ["--optimizer", "adafactor", "--moe", "8", "--ep", "2", "--dp", "2", "--tp", "1"],
        tmp_path,
        ["--steps", "1"],
    )
    collectives = _collectives(log)
    assert collectives and collectives[0].endswith("all_reduce 5"), collectives


def _job_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_lm_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ep", "2"], "--ep needs routed experts"),
        (["--moe", "3", "--ep", "2", "--tp", "1"], "experts must be divisible by --ep 2"),
        (["--moe", "4", "--ep", "3"], "does not divide the world size 4"),
        (["--moe", "4", "--ep", "2", "--dp", "2", "--tp", "2"], "!= world size 4"),
        (["--pp", "2", "--n-layers", "3", "--tp", "2"], "--n-layers 3 must be divisible by --pp 2"),
        (["--moe", "4", "--top-k", "5"], "--top-k 5 must be between 1 and --moe 4"),
        (
            ["--moe", "4", "--ep", "2", "--tp", "1", "--eval-windows", "6"],
            "--eval-windows 6 must be divisible by --dp 2 x --ep 2",
        ),
    ],
)
def test_bad_layouts_stop_at_start(monkeypatch, argv, message):
    """Sizes that cannot make the launched world stop before any process group is made, with
    a message naming them (here as if launched on 4 processes)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit, match=message.replace("+", r"\+")):
        _job_module().main(argv)
