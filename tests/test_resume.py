"""Resumable training: ft.checkpoint (atomic DCP checkpoints of params + optimizer state) and the
main job's --checkpoint-every / --resume.

- save/load round trips bitwise (NamedTuple, tuple and None leaves; the loaded trees train on
  exactly as the saved ones), with clear errors for partial checkpoints and mismatched templates;
- a save that fails mid-way, or crashes between its two renames, leaves the last good checkpoint
  loadable;
- on 4 gloo ranks (dp=2 x tp=2): a one-process checkpoint loads into DTensor templates, a
  DTensor checkpoint into plain tensors in one process, and a donated run resumed from its
  checkpoint equals the uninterrupted run bitwise;
- the main job SIGKILLed after a checkpoint and resumed ends with the parameters of the
  uninterrupted run: bitwise in one process and on 4 processes (the 4-process kill shared by
  both of its tests); a 4-process checkpoint resumed in one process to float tolerance (the
  tensor parallel reductions round differently).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import optree
import pytest
import torch

import functional_train as ft

HERE = Path(__file__).parent
ROOT = HERE.parent
SCRIPT = ROOT / "examples" / "train_lm.py"
sys.path.insert(0, str(HERE))
import _gloo_resume_worker as worker  # noqa: E402

# DCP in this process: no simulated process group left over by earlier tests
pytestmark = pytest.mark.usefixtures("no_fake_process_group")

STEPS = 24
SMALL = [
    "--steps",
    str(STEPS),
    "--d-model",
    "32",
    "--n-layers",
    "1",
    "--n-heads",
    "2",
    "--seq-len",
    "32",
    "--batch",
    "4",
    "--max-bytes",
    "200000",
    "--eval-every",
    "0",
    "--eval-windows",
    "8",
    "--warmup",
    "2",
    "--lr",
    "1e-2",
    "--seed",
    "3",
    "--threads",
    "1",
]


class Extra(NamedTuple):
    count: torch.Tensor
    nothing: object


def _trained(tx, params, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = tx.init(params)
    for _ in range(steps):
        grads = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
        params, state = ft.step(tx, grads, state, params)
    return params, state


def _params():
    gen = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(6, 5, generator=gen),
        "b": torch.randn(5, generator=gen),
        "e": torch.randn(9, 4, generator=gen, dtype=torch.float64),
    }


def _zeros(tree):
    return optree.tree_map(torch.zeros_like, tree)


def _assert_bitwise(a, b):
    la, ta = optree.tree_flatten(a, none_is_leaf=True)
    lb, tb = optree.tree_flatten(b, none_is_leaf=True)
    assert ta == tb
    for path, x, y in zip(ft.tree.tree_paths(a), la, lb):
        if x is None:
            assert y is None, path
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), path


# --------------------------------------------------------------------------------------------------
# ft.checkpoint in one process
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_round_trip_bitwise(tmp_path, name):
    tx = {
        "adamw": lambda: ft.multi_steps(
            ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1)), every_k=2
        ),
        "adafactor": lambda: ft.chain(ft.clip_by_global_norm(1.0), ft.adafactor(beta1=0.9)),
    }[name]()
    params, state = _trained(tx, _params())
    params = dict(params, frozen=None)  # a None leaf in the params
    state = (state, None, Extra(torch.tensor(7), None))  # tuple, NamedTuple, None leaves
    gen = torch.Generator().manual_seed(5)
    extra = {"gen": gen.get_state(), "history": [{"loss": 1.5}], "name": name}
    assert ft.checkpoint.save(
        tmp_path / "ck", params=params, state=state, step=3, extra=extra
    ) == str(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the temporary directory was renamed

    templates = (_zeros(params), (tx.init(_zeros(_params())), None, Extra(torch.tensor(0), None)))
    p, s, step, got = ft.checkpoint.load(tmp_path / "ck", *templates)
    _assert_bitwise(p, params)
    _assert_bitwise(s, state)
    assert type(s[0]) is type(state[0]) and type(s[2]) is Extra
    assert step == 3 and got["history"] == extra["history"] and got["name"] == name
    assert torch.equal(got["gen"], extra["gen"])
    assert all(bool((x == 0).all()) for x in optree.tree_leaves(templates))  # pure: untouched
    # the loaded trees train on exactly as the saved ones (donation reuses the loaded buffers)
    grads = {k: torch.full_like(v, 0.1) for k, v in params.items() if v is not None}
    keep = {k: v for k, v in params.items() if v is not None}
    want = ft.step(tx, grads, state[0], keep)
    have = ft.step(tx, grads, s[0], {k: v for k, v in p.items() if v is not None}, donate=True)
    _assert_bitwise(have, want)


def test_clear_errors(tmp_path):
    tx = ft.adamw(1e-2)
    params, state = _trained(tx, _params(), steps=1)
    d = tmp_path / "ck"
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*ck"):
        ft.checkpoint.load(d, params, state)
    ft.checkpoint.save(d, params=params, state=state, step=1)

    with pytest.raises(ValueError, match=r"missing from the checkpoint: params/extra_leaf"):
        ft.checkpoint.load(d, dict(params, extra_leaf=torch.zeros(2)), state)
    with pytest.raises(ValueError, match=r"in the checkpoint but not in the templates: params/b"):
        ft.checkpoint.load(d, {k: v for k, v in params.items() if k != "b"}, state)
    with pytest.raises(ValueError, match=r"params/w \(saved \(6, 5\) float32, template \(5, 6\)"):
        ft.checkpoint.load(d, dict(params, w=torch.zeros(5, 6)), state)
    with pytest.raises(ValueError, match=r"None in the templates: params/b"):
        ft.checkpoint.load(d, dict(params, b=None), state)
    with pytest.raises(ValueError, match=rf"checkpoint '{d}'.*params/b"):
        ft.checkpoint.load(d, dict(params, b=torch.zeros(5, dtype=torch.float64)), state)

    with pytest.raises(TypeError, match="leaf 'state/x' is a int"):
        ft.checkpoint.save(tmp_path / "other", params=params, state={"x": 3}, step=1)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        ft.checkpoint.save(tmp_path / "mine", params=params, state=state, step=1)
    assert (tmp_path / "mine" / "notes.txt").exists()

    os.remove(d / ft.checkpoint.MANIFEST)  # a partial checkpoint
    with pytest.raises(FileNotFoundError, match=rf"{d}.*has no meta.json"):
        ft.checkpoint.load(d, params, state)


def test_failed_save_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    tx = ft.adamw(1e-2)
    p1, s1 = _trained(tx, _params(), steps=1)
    p2, s2 = _trained(tx, _params(), steps=2)
    d = tmp_path / "ck"
    ft.checkpoint.save(d, params=p1, state=s1, step=1)

    # an unpicklable extra: torch.save fails before anything is renamed
    with pytest.raises(ValueError, match="extra cannot be saved"):
        ft.checkpoint.save(d, params=p2, state=s2, step=2, extra={"f": lambda: 0})

    # DCP fails mid-way, after writing part of the new checkpoint
    real = ft.checkpoint.dcp.save

    def half_written(state_dict, *, checkpoint_id, **kw):
        real(
            {k: v for i, (k, v) in enumerate(state_dict.items()) if i < 2},
            checkpoint_id=checkpoint_id,
            **kw,
        )
        raise OSError("disk full")

    monkeypatch.setattr(ft.checkpoint.dcp, "save", half_written)
    with pytest.raises(OSError, match="disk full"):
        ft.checkpoint.save(d, params=p2, state=s2, step=2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the temporary directories were removed
    p, s, step, _ = ft.checkpoint.load(d, _zeros(p1), tx.init(_zeros(p1)))
    assert step == 1
    _assert_bitwise((p, s), (p1, s1))

    # a crash between the two renames (old renamed away, new not yet in place) and a crashed
    # save's temporary directory: load finds the old checkpoint, the next save cleans up
    os.rename(d, tmp_path / "ck.old-crashed")
    (tmp_path / "ck.tmp-crashed").mkdir()
    p, s, step, _ = ft.checkpoint.load(d, _zeros(p1), tx.init(_zeros(p1)))
    assert step == 1
    _assert_bitwise((p, s), (p1, s1))
    ft.checkpoint.save(d, params=p2, state=s2, step=2)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    p, s, step, _ = ft.checkpoint.load(d, _zeros(p1), tx.init(_zeros(p1)))
    assert step == 2
    _assert_bitwise((p, s), (p2, s2))


def test_async_save_stages_before_returning(tmp_path):
    tx = ft.adamw(1e-2)
    params, state = _trained(tx, _params(), steps=2)
    want = optree.tree_map(torch.clone, (params, state))
    pending = ft.checkpoint.save(
        tmp_path / "ck", params=params, state=state, step=2, extra={"a": 1}, async_save=True
    )
    assert isinstance(pending, ft.checkpoint.PendingSave)
    for x in optree.tree_leaves((params, state)):
        x.add_(1)  # as a donated step would: overwrite the buffers just saved
    assert not (tmp_path / "ck").exists()  # in place only once result() returns
    assert pending.result() == str(tmp_path / "ck") == pending.result()
    p, s, step, extra = ft.checkpoint.load(tmp_path / "ck", _zeros(params), tx.init(_zeros(params)))
    assert step == 2 and extra == {"a": 1}
    _assert_bitwise((p, s), want)


# --------------------------------------------------------------------------------------------------
# ft.checkpoint on 4 gloo ranks
# --------------------------------------------------------------------------------------------------


def _flat(tree):
    return worker.full(tree)


@pytest.mark.slow
def test_four_ranks_reshard_and_resume(tmp_path, ranks):
    params0, grads = worker.problem()
    tx = worker.optimizers()["adamw_zero"]()  # one process: the inner chain on whole tensors
    p, s = params0, tx.init(params0)
    for g in grads[:2]:
        p, s = ft.step(tx, g, s, p)
    gen_state = torch.Generator().manual_seed(9).get_state()
    ft.checkpoint.save(
        tmp_path / "plain", params=p, state=(s, None), step=2, extra={"gen": gen_state}
    )

    res = ranks.run(4, "_gloo_resume_worker:main", str(tmp_path))[0]

    # a one-process checkpoint loaded into DTensor templates on 4 ranks
    got = res["from_plain"]
    assert got["step"] == 2 and torch.equal(got["extra"]["gen"], gen_state)
    for tree, want in (("params", _flat(p)), ("state", _flat(s))):
        assert set(got[tree]) == set(want)
        for k in want:
            assert torch.equal(got[tree][k], want[k]), (tree, k)

    for name, make in worker.optimizers().items():
        # a donated run resumed from its checkpoint on 4 ranks: bitwise the uninterrupted run
        assert res[name]["params_mismatch"] == [] and res[name]["state_mismatch"] == [], name
        # the DTensor checkpoint loaded into plain tensors in one process
        tx = make()
        p, s, step, extra = ft.checkpoint.load(
            tmp_path / f"dt-{name}", _zeros(params0), tx.init(_zeros(params0))
        )
        assert step == worker.SAVE_AT and extra == {"rank0": 0}
        assert all(
            not isinstance(x, torch.distributed.tensor.DTensor) for x in optree.tree_leaves((p, s))
        )
        saved = res[name]["saved"]
        for tree, have in (("params", _flat(p)), ("state", _flat(s))):
            assert set(have) == set(saved[tree]), name
            for k in have:
                assert torch.equal(have[k], saved[tree][k]), (name, tree, k)

    assert res["async"] == {"step": 9, "mismatch": []}


# --------------------------------------------------------------------------------------------------
# the main job, killed and resumed
# --------------------------------------------------------------------------------------------------


def _env():
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


def _cmd(nproc, out, *flags):
    launch = [sys.executable] + (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        if nproc > 1
        else []
    )
    return launch + [str(SCRIPT)] + SMALL + ["--out", str(out), *flags]


def _run(cmd):
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _descendants(pid):
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so
    killing its process group would leave them running)."""
    parent = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [pid]
    while todo:
        q = todo.pop()
        kids = [c for c, pp in parent.items() if pp == q]
        found += kids
        todo += kids
    return found


def _kill_all(proc):
    for pid in _descendants(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _killed_after_checkpoint(cmd, ckpt, at_least=2):
    """Run ``cmd``; SIGKILL it (workers included) as soon as ``ckpt`` holds a checkpoint of step
    >= ``at_least``. Returns the step of the checkpoint left behind and whether the kill landed
    before the run ended (if the run finished first, its last checkpoint is resumed instead)."""
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    killed, deadline = False, time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if ft.checkpoint.read_manifest(ckpt)["step"] >= at_least:
                    _kill_all(proc)
                    killed = True
                    break
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            _kill_all(proc)
    if not killed:
        assert proc.returncode == 0, proc.stderr.read()[-3000:]
    proc.stderr.close()
    return ft.checkpoint.read_manifest(ckpt)["step"], killed


@pytest.fixture(scope="session")  # once per session (see test_sweep's _compiled_on_gloo)
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    _run(_cmd(1, out))
    return torch.load(out / "params.pt"), json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.xdist_group("resume")  # one worker runs the shared runs once
def test_main_job_killed_and_resumed_is_bitwise(tmp_path, uninterrupted):
    ckpt = tmp_path / "killed" / "checkpoint"
    step, killed = _killed_after_checkpoint(
        _cmd(1, tmp_path / "killed", "--checkpoint-every", "2"), ckpt
    )
    assert step % 2 == 0 and 2 <= step <= STEPS
    if not killed:
        print(f"the run ended before the kill: resuming its last checkpoint (step {step})")
    res = _run(_cmd(1, tmp_path / "resumed", "--resume", str(ckpt)))
    assert f"at step {step}" in res.stderr
    want, metrics = uninterrupted
    got = torch.load(tmp_path / "resumed" / "params.pt")
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    resumed = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert [h["loss"] for h in resumed["steps"]] == [h["loss"] for h in metrics["steps"]]
    assert resumed["summary"]["val_loss"] == metrics["summary"]["val_loss"]


@pytest.fixture(scope="session")  # once per session (see test_sweep's _compiled_on_gloo)
def four_killed(tmp_path_factory):
    """A 4-process run (dp=2 x tp=2) SIGKILLed after its checkpoint of step 2 or later: ``(the
    checkpoint, its step)``. Both tests below resume it (reading it only)."""
    out = tmp_path_factory.mktemp("four")
    ckpt = out / "checkpoint"
    step, _ = _killed_after_checkpoint(_cmd(4, out, "--checkpoint-every", "2"), ckpt)
    return ckpt, step


@pytest.mark.slow
@pytest.mark.xdist_group("resume")  # one worker runs the shared runs once
def test_main_job_four_process_checkpoint_resumes_in_one_process(
    tmp_path, uninterrupted, four_killed
):
    ckpt, step = four_killed
    assert ft.checkpoint.read_manifest(ckpt)["world_size"] == 4
    res = _run(_cmd(1, tmp_path / "resumed", "--resume", str(ckpt)))
    assert f"at step {step}" in res.stderr
    want, metrics = uninterrupted
    got = torch.load(tmp_path / "resumed" / "params.pt")
    assert set(got) == set(want)
    for k in want:  # the same global batches; tp=2 reductions round differently before `step`
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)
    resumed = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert len(resumed["steps"]) == STEPS
    assert abs(resumed["summary"]["val_loss"] - metrics["summary"]["val_loss"]) < 1e-4


@pytest.mark.slow
@pytest.mark.xdist_group("resume")  # one worker runs the shared runs once
def test_main_job_four_processes_killed_and_resumed_is_bitwise(tmp_path, four_killed):
    """The 4-process run killed after a checkpoint and resumed on 4 processes ends with the
    parameters of an uninterrupted 4-process run, bit for bit."""
    _run(_cmd(4, tmp_path / "ref"))
    ckpt, step = four_killed
    res = _run(_cmd(4, tmp_path / "resumed", "--resume", str(ckpt)))
    assert f"at step {step}" in res.stderr
    want = torch.load(tmp_path / "ref" / "params.pt")
    got = torch.load(tmp_path / "resumed" / "params.pt")
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
