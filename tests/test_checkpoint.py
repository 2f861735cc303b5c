"""Optimizer states checkpoint and reshard with torch.distributed.checkpoint.

States are DTensors with global shapes (row statistics sharded like the rows, column statistics
like the columns, projectors replicated, 8-bit codes like the parameter, ZeRO shards over dp), so
a checkpoint written by 4 gloo ranks at tp=2 x ZeRO dp=2 loads into the state of a one-process
run, leaf by leaf, and equals the state that run computes itself (and ft.checkpoint, whose manifest
records the state's structure, loads it too).

ft.checkpoint.load reads one checkpoint whole while another save replaces it (a thread saving in a
loop; a replacement between the manifest and the tensors, in one process and on 4 gloo ranks),
refuses another optimizer's state whose leaves have the same paths, still loads format version 1,
and raises CheckpointError (an Exception, naming the checkpoint and the file) for damaged files
and hand-edited manifests.
"""

import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import optree
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

import functional_train as ft
from functional_train.tree import tree_paths

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _gloo_ckpt_worker as worker  # noqa: E402


@pytest.mark.slow
@pytest.mark.usefixtures("no_fake_process_group")
def test_states_saved_sharded_load_unsharded(tmp_path, ranks):
    ranks.run(4, "_gloo_ckpt_worker:main", str(tmp_path))
    params0, grads = worker.problem()
    for name, make in worker.optimizers().items():
        tx = ft.zero_redundancy(make())  # one process: the inner transform on whole tensors
        state = tx.init(params0)
        p = dict(params0)
        for g in grads:
            updates, state = tx.update(g, state, p)
            p = ft.apply_updates(p, updates)
        template = optree.tree_map(
            lambda x: torch.full_like(x, -7) if x.is_floating_point() else torch.zeros_like(x),
            worker.flat(state),
        )
        dcp.load(template, checkpoint_id=str(tmp_path / name), no_dist=True)
        want = worker.flat(state)
        assert set(template) == set(want)
        for k in want:
            torch.testing.assert_close(
                template[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}"
            )
        # ft.checkpoint: the structure it records does not depend on the mesh
        zeros = optree.tree_map(torch.zeros_like, params0)
        p_ck, s_ck, step, _ = ft.checkpoint.load(tmp_path / f"ft-{name}", zeros, tx.init(zeros))
        assert step == len(grads)
        have, ref = ((p_ck, s_ck), (p, state))
        assert optree.tree_structure(have, none_is_leaf=True) == optree.tree_structure(
            ref, none_is_leaf=True
        )
        for path, x, y in zip(
            tree_paths(have),
            optree.tree_leaves(have, none_is_leaf=True),
            optree.tree_leaves(ref, none_is_leaf=True),
        ):
            if y is None:
                assert x is None, (name, path)
                continue
            assert not isinstance(x, DTensor), (name, path)
            torch.testing.assert_close(
                x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {path}: {m}"
            )


@pytest.mark.slow
@pytest.mark.usefixtures("no_fake_process_group")
def test_four_ranks_load_one_checkpoint_while_it_is_replaced(tmp_path, ranks):
    """On 4 gloo ranks: a checkpoint replaced between the manifest and the tensors is loaded
    again by every rank (before: step 1 with step 2's tensors); templates that do not match on
    one rank raise on every rank instead of leaving the others in DCP's collectives; a
    truncated data file raises CheckpointError naming it on every rank."""
    res = ranks.run(4, "_gloo_ckpt_worker:replaced_while_loading", str(tmp_path), timeout=120)
    ck = tmp_path / "ck"
    for rank, r in enumerate(res):
        assert (r["step"], r["values"], r["dcp_loads"]) == (2, [2.0], 2), rank
        if rank == 1:
            assert r["one_rank_mismatch"].startswith(
                f"ValueError: checkpoint '{ck}' does not match the templates: missing from the "
                "checkpoint: params/extra"
            )
        else:
            assert r["one_rank_mismatch"].startswith(
                f"RuntimeError: checkpoint '{ck}' could not be loaded: rank 1: ValueError: "
            )
        assert re.match(
            rf"CheckpointError: checkpoint '{ck}' is damaged: __1_0.distcp has \d+ bytes, its "
            r"data runs to byte \d+ \(truncated\)",
            r["truncated"],
        ), r["truncated"]


# --------------------------------------------------------------------------------------------------
# ft.checkpoint: one consistent checkpoint while another save replaces it, another optimizer's
# state refused, damaged checkpoints and hand-edited manifests as clear errors
# --------------------------------------------------------------------------------------------------


def _params():
    gen = torch.Generator().manual_seed(1)
    return {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen)}


def _filled(tree, value):
    """Every tensor leaf of ``tree`` set to ``value`` (a load that mixes two checkpoints saved
    with different values shows it)."""
    return optree.tree_map(lambda x: torch.full_like(x, value), tree)


def _values(tree) -> set:
    return {float(v) for x in optree.tree_leaves(tree) for v in x.flatten().tolist()}


def _saved(directory, step, tx=None):
    """Save params and ``tx``'s state with every value equal to ``step``; returns the trees."""
    tx = tx or ft.adamw(1e-2, weight_decay=0.1)
    params = _params()
    trees = _filled((params, tx.init(params)), step)
    ft.checkpoint.save(directory, params=trees[0], state=trees[1], step=step, extra={"s": step})
    return trees


def _templates(tx=None):
    tx = tx or ft.adamw(1e-2, weight_decay=0.1)
    params = _params()
    return _filled((params, tx.init(params)), -1)


@pytest.mark.usefixtures("no_fake_process_group")
def test_load_starts_again_when_the_checkpoint_is_replaced_while_it_reads(tmp_path, monkeypatch):
    """A save that renames a new checkpoint into place after ``load`` read the manifest (step 1)
    and before DCP reads the tensors: the first attempt sees the manifest changed and the load
    starts again, returning step 2 whole (not step 1's metadata with step 2's tensors)."""
    d = tmp_path / "ck"
    _saved(d, 1)
    real, calls = ft.checkpoint.dcp.load, []

    def replaced_first(state_dict, **kw):
        calls.append(kw["checkpoint_id"])
        if len(calls) == 1:
            _saved(d, 2)  # another process's save, between the manifest and the tensors
        return real(state_dict, **kw)

    monkeypatch.setattr(ft.checkpoint.dcp, "load", replaced_first)
    p, s, step, extra = ft.checkpoint.load(d, *_templates())
    assert (step, extra) == (2, {"s": 2})
    assert _values((p, s)) == {2.0}
    assert calls == [str(d), str(d)]


@pytest.mark.usefixtures("no_fake_process_group")
def test_load_raises_when_the_checkpoint_is_replaced_during_every_attempt(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    _saved(d, 1)
    real, calls = ft.checkpoint.dcp.load, []

    def always_replaced(state_dict, **kw):
        calls.append(1)
        _saved(d, 1 + len(calls) % 2)
        return real(state_dict, **kw)

    monkeypatch.setattr(ft.checkpoint.dcp, "load", always_replaced)
    with pytest.raises(
        ft.checkpoint.CheckpointError,
        match=rf"checkpoint '{d}' was replaced by another save during each of 10 attempts",
    ):
        ft.checkpoint.load(d, *_templates())
    assert len(calls) == ft.checkpoint.LOAD_ATTEMPTS == 10


@pytest.mark.usefixtures("no_fake_process_group")
def test_load_while_another_thread_saves_in_a_loop_reads_one_checkpoint(tmp_path):
    """A real concurrent saver (a thread saving step 1 and step 2 alternately to the same path,
    as fast as it can) and 150 loads: each returns one checkpoint whole (every tensor value
    equals the step and ``extra``), or raises ``CheckpointError`` after 10 replaced attempts.
    Before the fix, 5-10% of the loads returned one checkpoint's step with the other's tensors,
    and some raised DCP's ``CheckpointException``, which ``except Exception`` does not catch."""
    d = tmp_path / "ck"
    _saved(d, 1)
    stop, saves, saver_errors = threading.Event(), [0], []

    def saver():
        try:
            while not stop.is_set():
                _saved(d, 1 + saves[0] % 2)
                saves[0] += 1
        except BaseException as e:  # reported by the test
            saver_errors.append(e)

    thread = threading.Thread(target=saver, daemon=True)
    thread.start()
    mixed, loaded, replaced = [], 0, 0
    try:
        deadline = time.monotonic() + 60
        # (150 loads, and at least 10 saves among them: on a loaded machine the saver thread
        # can get few turns while the loads run; the deadline still fails a saver that never
        # runs)
        while (loaded + replaced < 150 or saves[0] < 10) and time.monotonic() < deadline:
            try:
                p, s, step, extra = ft.checkpoint.load(d, *_templates())
            except ft.checkpoint.CheckpointError as e:
                assert "was replaced by another save" in str(e)
                replaced += 1
                continue
            loaded += 1
            if _values((p, s)) != {float(step)} or extra != {"s": step}:
                mixed.append((step, extra, sorted(_values((p, s)))))
        during = saves[0]
    finally:
        stop.set()
        thread.join(timeout=60)
    assert saver_errors == []
    assert during >= 10, "the saver did not run concurrently"
    assert mixed == []
    assert loaded >= 100, (loaded, replaced)


class _Trace(NamedTuple):  # the fields of ft.trace's state, another type
    count: torch.Tensor
    trace: dict


@pytest.mark.usefixtures("no_fake_process_group")
@pytest.mark.parametrize(
    "saved, template, want",
    [
        # the issue's: both keyed "state/1.0", "state/1.1.w" by position
        (
            lambda: ft.chain(ft.scale(-0.1), ft.ema_params(0.9)),
            lambda: ft.chain(ft.scale(-0.1), ft.trace(0.9)),
            r"state/1 \(saved EmaParamsState, template TraceState\).*"
            r"missing from the checkpoint: state/1.trace.b, state/1.trace.w; "
            r"in the checkpoint but not in the templates: state/1.ema.b, state/1.ema.w",
        ),
        # the same leaf paths, one more chained part
        (
            lambda: ft.adam(1e-2),
            lambda: ft.lamb(1e-2),
            r"state/2 \(saved absent, template EmptyState\)",
        ),
        (
            lambda: ft.adamw(1e-2, weight_decay=0.1),
            lambda: ft.lamb(1e-2, weight_decay=0.1),
            r"state/3 \(saved absent, template EmptyState\)",
        ),
        # the same field names, another NamedTuple
        (
            lambda: ft.trace(0.9),
            lambda: ft.GradientTransformation(
                lambda p: _Trace(torch.zeros([], dtype=torch.int64), _filled(p, 0.0)), None
            ),
            r"state/<root> \(saved TraceState, template _Trace\)",
        ),
    ],
    ids=["ema_params-as-trace", "adam-as-lamb", "adamw-as-lamb", "type-name"],
)
def test_another_optimizers_state_is_refused(tmp_path, saved, template, want):
    """The state is keyed by field name and the manifest records every container's type: a
    state of another optimizer whose leaves have the same paths and shapes (it loaded silently
    before) is refused, the error naming the saved and the template's types."""
    d = tmp_path / "ck"
    _saved(d, 3, saved())
    with pytest.raises(
        ValueError, match=rf"checkpoint '{d}' does not match the templates: .*{want}"
    ):
        ft.checkpoint.load(d, *_templates(template()))
    # the same optimizer loads (the check is not stricter than the structure)
    p, s, step, _ = ft.checkpoint.load(d, *_templates(saved()))
    assert step == 3 and _values((p, s)) == {3.0}


@pytest.mark.usefixtures("no_fake_process_group")
def test_manifest_keys_name_fields_and_record_the_structure(tmp_path):
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1))
    _saved(tmp_path / "ck", 1, tx)
    m = ft.checkpoint.read_manifest(tmp_path / "ck")
    assert m["version"] == ft.checkpoint.FORMAT_VERSION == 2
    assert sorted(k for k in m["keys"] if k.startswith("state/")) == [
        "state/0.global_norm",
        "state/1.0.count",
        "state/1.0.mu.b",
        "state/1.0.mu.w",
        "state/1.0.nu.b",
        "state/1.0.nu.w",
    ]
    assert m["structure"] == {
        "params/<root>": "dict",
        "state/<root>": "tuple",
        "state/0": "ClipByGlobalNormState",
        "state/1": "tuple",
        "state/1.0": "ScaleByAdamState",
        "state/1.0.mu": "dict",
        "state/1.0.nu": "dict",
        "state/1.1": "EmptyState",
        "state/1.2": "EmptyState",
    }
    assert len(m["token"]) == 12 and set(m["files"]) == {".metadata", "extra.pt"}


def _save_version_1(directory, params, state, step):
    """A checkpoint as format version 1 wrote it: keys by position, no token, structure or
    file digests in the manifest."""
    tensors, keys, nones = {}, {}, []
    for name, tree in (("params", params), ("state", state)):
        for path, leaf in zip(tree_paths(tree), optree.tree_leaves(tree, none_is_leaf=True)):
            key = f"{name}/{path}"
            if leaf is None:
                nones.append(key)
                continue
            tensors[key] = leaf
            keys[key] = {"shape": list(leaf.shape), "dtype": "float32", "dtensor": False}
    dcp.save(tensors, checkpoint_id=str(directory), no_dist=True)
    manifest = {
        "format": "functional_train.checkpoint",
        "version": 1,
        "step": step,
        "keys": keys,
        "none": nones,
        "extra": False,
        "world_size": 1,
    }
    (directory / "meta.json").write_text(json.dumps(manifest))


@pytest.mark.usefixtures("no_fake_process_group")
def test_version_1_checkpoints_still_load(tmp_path):
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adam(1e-2))
    params = dict(_params(), frozen=None)
    state = tx.init(params)
    state = optree.tree_map(
        lambda x: torch.randn(x.shape, generator=torch.Generator().manual_seed(x.numel())), state
    )
    _save_version_1(tmp_path / "v1", params, state, 7)
    assert "state/1.0.1.w" in ft.checkpoint.read_manifest(tmp_path / "v1")["keys"]
    p, s, step, extra = ft.checkpoint.load(tmp_path / "v1", *_filled((params, state), -1))
    assert step == 7 and extra is None and p["frozen"] is None
    for a, b in zip(optree.tree_leaves((p, s)), optree.tree_leaves((params, state))):
        assert torch.equal(a, b)


def _flip(path, at):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    # what is done to the checkpoint, and what the error says (after the checkpoint's path)
    "truncated-distcp": (
        lambda d: _truncate(d / "__0_0.distcp"),
        r"is damaged: __0_0.distcp has \d+ bytes, its data runs to byte \d+ \(truncated\)",
    ),
    "deleted-distcp": (lambda d: os.remove(d / "__0_0.distcp"), r"__0_0.distcp is missing"),
    "deleted-metadata": (lambda d: os.remove(d / ".metadata"), r"is damaged: .metadata is missing"),
    "flipped-metadata": (
        lambda d: _flip(d / ".metadata", 40),
        r"\.metadata has \d+ bytes with SHA-256 \w+\.\.\., the manifest records",
    ),
    "flipped-extra": (lambda d: _flip(d / "extra.pt", 60), r"extra.pt has \d+ bytes with SHA-256"),
    # the first item's zip signature: DCP's torch.load fails (a BaseException before)
    "flipped-distcp-header": (
        lambda d: _flip(d / "__0_0.distcp", 0),
        r": reading __0_0.distcp failed \(a damaged file\?\): UnpicklingError: ",
    ),
}


@pytest.mark.usefixtures("no_fake_process_group")
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_raises_checkpoint_error(tmp_path, damage):
    """Damaged files raise ``CheckpointError`` (an ``Exception``: DCP's ``CheckpointException``
    derives from ``BaseException`` and got through ``except Exception``) naming the checkpoint
    and the file."""
    d = tmp_path / "ck"
    _saved(d, 1)
    do, want = DAMAGE[damage]
    do(d)
    with pytest.raises(ft.checkpoint.CheckpointError, match=rf"^checkpoint '{d}'.*{want}") as e:
        ft.checkpoint.load(d, *_templates())
    if damage == "flipped-distcp-header":
        assert isinstance(e.value.__cause__, CheckpointException)
    try:  # resume or start afresh, as a training script does
        ft.checkpoint.load(d, *_templates())
        fresh = False
    except Exception:
        fresh = True
    assert fresh


MANIFEST_EDITS = {
    "step-string": (
        lambda m: dict(m, step="seven"),
        r"field 'step' must be an integer, not \"seven\"",
    ),
    "step-float": (lambda m: dict(m, step=2.9), r"field 'step' must be an integer, not 2.9"),
    "step-bool": (lambda m: dict(m, step=True), r"field 'step' must be an integer, not true"),
    "no-step": (lambda m: {k: v for k, v in m.items() if k != "step"}, r"field 'step' is missing"),
    "extra-int": (lambda m: dict(m, extra=1), r"field 'extra' must be true or false, not 1"),
    "shape": (
        lambda m: dict(m, keys=dict(m["keys"], **{"params/w": {"shape": "6x5", "dtype": "f"}})),
        r"field 'keys' entry 'params/w' must be \{\"shape\": \[sizes\], \"dtype\": name\}",
    ),
    "token": (lambda m: dict(m, token=None), r"field 'token' must be a string, not null"),
    "version": (lambda m: dict(m, version="2"), r"field 'version' must be a positive integer"),
    "newer": (lambda m: dict(m, version=3), r"format version 3; this functional_train reads "),
}


@pytest.mark.usefixtures("no_fake_process_group")
@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS) + ["invalid-json", "not-utf8"])
def test_a_hand_edited_manifest_raises_a_clear_error(tmp_path, edit):
    d = tmp_path / "ck"
    _saved(d, 2)
    file = d / "meta.json"
    if edit == "invalid-json":
        file.write_text(file.read_text()[:-30])
        want = r"is not valid JSON \(.*line \d+ column \d+.*\): a damaged or hand-edited manifest"
    elif edit == "not-utf8":
        file.write_bytes(b"\xff\xfe\xfa" + file.read_bytes())
        want = r"is not valid JSON"
    else:
        change, want = MANIFEST_EDITS[edit]
        file.write_text(json.dumps(change(json.loads(file.read_text()))))
    for read in (
        lambda: ft.checkpoint.read_manifest(d),
        lambda: ft.checkpoint.load(d, *_templates()),
    ):
        with pytest.raises(ft.checkpoint.CheckpointError, match=rf"^{file}:? .*{want}"):
            read()
