"""The wrappers fuse: ``ema_params`` (an elementwise spec), ``apply_if_finite`` and
``multi_steps`` of a fusable inner transform run as generated kernels per stage in ``ft.step``,
with the numbers of the same per-leaf definitions run leaf by leaf in torch (tolerances as in
tests/test_fused.py) and of the wrappers' general paths.
"""

import copy
import gc
import weakref

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_train as ft
from _layouts import params_close, step_by_mode
from _spy import (
    compiled_code_of_steps,
    general_updates,
    kernel_calls,
    kernels_run_on,
    took_torch_fused,
    torch_fused_calls,
    triton_interpreted,
)
from functional_train import accumulation, combine
from functional_train.engine import elementwise as E
from functional_train.engine import fuse

STEPS = 7
BAD = {1: float("nan"), 2: float("inf"), 5: float("-inf")}  # steps with a non-finite element


def _problem(dtype=torch.float32, seed=0, bad=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (17, 33), "b": (33,), "e": (5, 4, 3), "s": ()}
    params = {k: torch.randn(s, generator=g, dtype=dtype).to(device) for k, s in shapes.items()}
    grads = []
    for t in range(STEPS):
        gt = {k: torch.randn(s, generator=g, dtype=dtype) * 0.1 for k, s in shapes.items()}
        if bad and t in BAD:
            gt["w"][3, 4] = BAD[t]
        grads.append({k: v.to(device) for k, v in gt.items()})
    return params, grads


def _run(tx, params, grads, mode):
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        p, state = step_by_mode(
            tx, {k: None if v is None else v.clone() for k, v in g.items()}, state, p, mode
        )
    return p, state


def _states_close(got, want, dtype, structure=True, twice=False):
    a, b = ft.tree.tree_flatten(got)[0], ft.tree.tree_flatten(want)[0]
    assert len(a) == len(b)
    if structure:
        assert optree.tree_structure(got, none_is_leaf=True) == optree.tree_structure(
            want, none_is_leaf=True
        )
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            assert x.dtype == y.dtype
            # (CUDA: an element near 0 of a first moment is a difference of rounded terms, so
            # its absolute bound is relative to the state's largest element, as in test_fused)
            rtol = 1e-5 if dtype == torch.float32 else 1e-12
            atol = 1e-12
            if (twice or x.is_cuda) and x.numel():
                atol = max(atol, rtol * float(y.abs().nan_to_num(0.0, 0.0, 0.0).max()))
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, equal_nan=True)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)


def _foreign_identity():
    """A transform without a spec: appended to a chain, it makes the chain unfusable (the
    wrapper around it takes its general path)."""

    def init(params):
        return ft.EmptyState()

    def update(updates, state, params=None, **kw):
        return updates, state

    return ft.GradientTransformation(init, update)


def _adamw(lr=1e-2):
    return ft.adamw(lr, weight_decay=0.1)


def _clip_adamw(*more, lr=1e-2):
    return ft.chain(ft.clip_by_global_norm(1.0), _adamw(lr), *more)


CASES = {
    # name: (transform, its general path's equivalent, non-finite gradients)
    "ema": (lambda: _clip_adamw(ft.ema_params(0.9)), None, False),
    "ema_warmup": (
        lambda: ft.chain(ft.scale_by_adam(), ft.scale(-1e-2), ft.ema_params(0.99, warmup=True)),
        None,
        False,
    ),
    "apply_if_finite_clip": (
        lambda: ft.apply_if_finite(_clip_adamw(), 3),
        lambda: ft.apply_if_finite(_clip_adamw(_foreign_identity()), 3),
        True,
    ),
    "apply_if_finite": (
        lambda: ft.apply_if_finite(_adamw(), 1),  # step 2's inf is applied (2 > 1 in a row)
        lambda: ft.apply_if_finite(ft.chain(_adamw(), _foreign_identity()), 1),
        True,
    ),
    "apply_if_finite_ema": (
        lambda: ft.chain(ft.apply_if_finite(_clip_adamw(), 3), ft.ema_params(0.9)),
        lambda: ft.chain(
            ft.apply_if_finite(_clip_adamw(_foreign_identity()), 3), ft.ema_params(0.9)
        ),
        True,
    ),
    # (2 inner steps in 7: a larger learning rate for a parameter change of the others' size)
    "multi_steps_clip": (lambda: ft.multi_steps(_clip_adamw(lr=5e-2), 3), None, False),
    "multi_steps": (lambda: ft.multi_steps(_adamw(5e-2), 3), None, False),
    "multi_steps_1": (lambda: ft.multi_steps(_clip_adamw(), 1), None, False),
}


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_equals_unfused(name, mode, dtype, monkeypatch, device):
    """Generated kernels == the per-leaf definitions leaf by leaf (``fuse.ENABLED = False``),
    parameters and states, over steps with non-finite gradients (apply_if_finite) and whole
    and partial cycles (multi_steps)."""
    make, _, bad = CASES[name]
    params, grads = _problem(dtype, bad=bad, device=device)
    got, got_state = _run(make(), params, grads, mode)
    monkeypatch.setattr(fuse, "ENABLED", False)
    want, want_state = _run(make(), params, grads, mode)
    if name == "apply_if_finite":  # its inf was applied: compare where finite
        assert not torch.isfinite(want["w"]).all()
        got, want = _finite_parts(got, want)
        params = {k: torch.nan_to_num(v) for k, v in params.items()}
    params_close(got, want, params, dtype)
    _states_close(got_state, want_state, dtype)


def _finite_parts(got, want):
    for k in want:
        assert torch.equal(torch.isfinite(got[k]), torch.isfinite(want[k])), k
    fin = {k: torch.isfinite(want[k]) for k in want}
    return (
        {k: torch.where(fin[k], got[k], 0) for k in got},
        {k: torch.where(fin[k], want[k], 0) for k in want},
    )


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", ["apply_if_finite_clip", "apply_if_finite_ema"])
def test_apply_if_finite_equals_its_general_path(name, mode, device):
    """The fused wrapper keeps the general path's numbers and state (float64)."""
    make, general, bad = CASES[name]
    params, grads = _problem(torch.float64, bad=bad, device=device)
    got, got_state = _run(make(), params, grads, mode)
    want, want_state = _run(general(), params, grads, mode)
    params_close(got, want, params, torch.float64)
    # (the general path's state has the foreign transform's EmptyState more: no leaves)
    _states_close(got_state, want_state, torch.float64, structure=False)
    inner = got_state[0] if name == "apply_if_finite_ema" else got_state
    assert int(inner.total_notfinite) == len(BAD)
    assert int(inner.notfinite_count) == 0 and bool(inner.last_finite)


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("name", ["multi_steps_clip", "multi_steps", "multi_steps_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multi_steps_fused_equals_its_general_path(name, mode, dtype, monkeypatch, device):
    """ft.step's and update's fused micro-steps == multi_steps' general path (its own
    ``update``, the transform built without its fused form) + ``apply_updates``."""
    make, _, _ = CASES[name]
    params, grads = _problem(dtype, device=device)
    got, got_state = _run(make(), params, grads, mode)
    with monkeypatch.context() as m:
        m.setattr(accumulation, "_fused_micro_steps", lambda *a: None)
        general = make()
    assert E.switch_of(general) is None and E.switch_of(make()) is not None
    want, want_state = _run(general, params, grads, "update")
    params_close(got, want, params, dtype)
    _states_close(got_state, want_state, dtype)


@pytest.mark.parametrize("mode", ["donate", "pure"])
@pytest.mark.parametrize("interpreted", [False, True])
def test_multi_steps_accumulates_by_torch_foreach_on_cuda(interpreted, mode, monkeypatch, device):
    """A ``multi_steps`` micro-step that does not end its cycle is one stage, the
    accumulation (the cycle's first: a copy): on CUDA it runs as torch's foreach operations
    (donated: ``torch._foreach_add_`` / ``torch._foreach_copy_`` over the accumulators; pure:
    ``torch._foreach_add``, which makes the new accumulators, / ``_foreach_copy_`` into new
    buffers), no generated kernel launched, no address table copied; on CPU as the C kernel,
    and as on CUDA where the CPU leaves take the CUDA stages (``interpreted``: the other
    stages' Triton kernels under Triton's interpreter). The parameters and state equal the
    steps with the kernels off."""
    from functional_train.engine import fuse_triton

    if not kernels_run_on(device) or (interpreted and device.type != "cpu"):
        pytest.skip(f"no generated kernels on {device}, or the interpreter off the CPU")
    make, _, _ = CASES["multi_steps_clip"]
    params, grads = _problem(torch.float32, device=device)
    monkeypatch.setattr(fuse, "ENABLED", False)
    want, want_state = _run(make(), params, grads, mode)
    monkeypatch.setattr(fuse, "ENABLED", True)
    as_cuda = device.type == "cuda" or interpreted
    if interpreted:
        _triton_interpreted(monkeypatch)
    calls: list = []
    for name in ("_foreach_add_", "_foreach_add", "_foreach_copy_"):
        real = getattr(torch, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    seen = kernel_calls(monkeypatch)
    tx = make()
    state, p = tx.init(params), {k: v.clone() for k, v in params.items()}
    for i, g in enumerate(grads):
        del seen[:], calls[:]
        tables = fuse_triton.tables_copied
        final = int(state.mini_step) + 1 == 3
        p, state = step_by_mode(tx, {n: v.clone() for n, v in g.items()}, state, p, mode)
        if final:
            continue
        assert len(seen) == 1, (i, seen)
        if as_cuda:
            add = "_foreach_add_" if mode == "donate" else "_foreach_add"
            assert isinstance(seen[0][0], fuse.ForeachKernel), i
            assert calls == ["_foreach_copy_" if i % 3 == 0 else add], (i, calls)
            assert fuse_triton.tables_copied == tables, i
        else:
            assert isinstance(seen[0][0], fuse.Kernel) and not calls, i
    params_close(p, want, params, torch.float32, twice=interpreted)
    _states_close(state, want_state, torch.float32, twice=interpreted)


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
def test_multi_steps_fused_on_fsdp_dtensors(mode, monkeypatch):
    """FSDP-style parameters (``Shard(0)`` over the data axis, 2 simulated ranks, uneven
    shards): the micro-steps run fused (generated kernels on every step) and the non-final
    ones issue no collective (the final one: the clip norm's all-reduce); the parameters and
    state equal the general path's run on plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from _layouts import shard
    from functional_train.testing import count_collectives, on_rank, simulate

    params, grads = _problem(torch.float64)
    # (the leaves that can be sharded: not the 0-dim one)
    params = {k: v for k, v in params.items() if v.dim()}
    grads = [{k: v for k, v in g.items() if k in params} for g in grads]
    with monkeypatch.context() as m:
        m.setattr(accumulation, "_fused_micro_steps", lambda *a: None)
        general = ft.multi_steps(_clip_adamw(lr=5e-2), 3)
    want, want_state = _run(general, params, grads, "update")
    seen = kernel_calls(monkeypatch)
    with simulate(2):
        dm = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        mesh = ft.Mesh(dm, data_axis="dp")

        def dt(tree):
            return {k: shard(v, dm, [Shard(0)]) for k, v in tree.items()}

        params_d = dt(params)
        tx = ft.multi_steps(_clip_adamw(lr=5e-2), 3)
        state = tx.init(params_d)
        p = params_d
        for t, g in enumerate(grads):
            n = len(seen)
            g_d = dt(g)
            with count_collectives() as c:
                if mode == "update":
                    u, state = tx.update(g_d, state, p, mesh=mesh)
                    p = ft.apply_updates(p, u)
                else:
                    p, state = ft.step(tx, g_d, state, p, mesh=mesh, donate=mode == "donate")
            assert len(seen) > n, f"micro-step {t} did not run a generated kernel"
            assert c.counts == ({} if (t + 1) % 3 else {"all_reduce": 1}), (t, c.counts)
        for k, v in p.items():
            full = v.full_tensor()
            got = on_rank(full._local_tensor if hasattr(full, "_local_tensor") else full, 0)
            change = (want[k] - params[k]).abs().max()
            assert (got - want[k]).abs().max() <= 1e-12 * change, k
        assert int(on_rank(state.mini_step, 0)) == int(want_state.mini_step)


def test_ema_equals_by_hand():
    """chain(..., ema_params) fused == the same chain without the average, averaged by hand
    (the first update copies; torch.lerp after)."""
    params, grads = _problem(torch.float64)
    got, state = _run(_clip_adamw(ft.ema_params(0.9)), params, grads, "donate")
    tx = _clip_adamw()
    s = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    ema = None
    for g in grads:
        p, s = ft.step(tx, g, s, p)
        ema = (
            {k: v.clone() for k, v in p.items()}
            if ema is None
            else {k: torch.lerp(ema[k], p[k], 0.1) for k in p}
        )
    params_close(got, p, params, torch.float64)
    for k in p:
        torch.testing.assert_close(ft.averaged_params(state)[k], ema[k], rtol=1e-12, atol=1e-15)


def test_ema_leaf_without_gradient():
    """A None gradient: the leaf's parameter stays, and its average moves towards it (p' = p),
    fused as in the general path."""
    params, grads = _problem(torch.float64)
    for g in grads[2:4]:
        g["b"] = None
    tx = ft.chain(ft.scale_by_adam(), ft.scale(-1e-2), ft.ema_params(0.5))
    got, got_state = _run(tx, params, grads, "donate")
    tx2 = ft.chain(ft.scale_by_adam(), ft.scale(-1e-2), _foreign_identity(), ft.ema_params(0.5))
    want, want_state = _run(tx2, params, grads, "update")
    params_close(got, want, params, torch.float64)
    torch.testing.assert_close(
        ft.averaged_params(got_state)["b"],
        ft.averaged_params(want_state)["b"],
        rtol=1e-12,
        atol=1e-15,
    )


def _calls_per_step(tx, monkeypatch, mode="donate", bad=False):
    params, grads = _problem(torch.float32, bad=bad)
    seen = kernel_calls(monkeypatch)
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    per = []
    for g in grads:
        n = len(seen)
        p, state = ft.step(tx, g, state, p, donate=mode == "donate")
        per.append(len(seen) - n)
        assert all(k == len(params) for _, k in seen[n:])  # every leaf in the call
    return per


@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_one_kernel_call_per_step(mode, monkeypatch):
    """chain(clip, adamw, ema_params) and apply_if_finite(chain(clip, adamw)) (finite and
    non-finite steps alike): the norm, then ONE kernel call over every leaf per step."""
    assert _calls_per_step(_clip_adamw(ft.ema_params(0.999)), monkeypatch, mode) == [1] * STEPS
    tx = ft.apply_if_finite(_clip_adamw(), 3)
    assert _calls_per_step(tx, monkeypatch, mode, bad=True) == [1] * STEPS
    tx = ft.apply_if_finite(_adamw(), 3)
    assert _calls_per_step(tx, monkeypatch, mode, bad=True) == [1] * STEPS


@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_multi_steps_one_kernel_call_per_micro_step(mode, monkeypatch):
    """multi_steps(adamw, 3): one kernel call per micro-step (``acc += g``; the final one
    ``(acc + g) / 3``, AdamW and ``p + u``). With a clip first, the final micro-step is two
    calls (the mean, then its norm, then the clip scale, AdamW and ``p + u``)."""
    assert _calls_per_step(ft.multi_steps(_adamw(), 3), monkeypatch, mode) == [1] * STEPS
    per = _calls_per_step(ft.multi_steps(_clip_adamw(), 3), monkeypatch, mode)
    assert per == [1, 1, 2, 1, 1, 2, 1]


def test_multi_steps_non_final_does_not_touch_params(monkeypatch):
    """A donated non-final micro-step writes nothing into the parameters (no pass over them)
    and keeps its inner state; a pure one returns the same parameters, recorded as shared
    (ft.step's pure contract: a later donated step copies them before writing); the eager
    update's zero updates are known zeros, and apply_updates returns the parameters as they
    are."""
    from functional_train.aliasing import is_known_zero, is_shared

    params, grads = _problem(torch.float32)
    tx = ft.multi_steps(_clip_adamw(), 3)
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    version = {k: v._version for k, v in p.items()}
    inner = state.inner_state
    p2, state = ft.step(tx, grads[0], state, p, donate=True)
    assert all(p2[k] is p[k] and p[k]._version == version[k] for k in p)
    assert state.inner_state is inner
    p3, state3 = ft.step(tx, grads[1], state, p2, donate=False)
    assert all(p3[k] is p2[k] and is_shared(p3[k]) for k in p)
    assert int(state3.mini_step) == 2 and int(state.mini_step) == 1
    u, state4 = tx.update(grads[1], state, p2)
    assert all(is_known_zero(x) and not torch.any(x) for x in u.values())
    p4 = ft.apply_updates(p2, u)
    assert all(p4[k] is p2[k] for k in p)
    torch.testing.assert_close(state4.acc_grads, state3.acc_grads, rtol=0, atol=0)
    p5, _ = ft.step(tx, grads[2], state3, p3, donate=True)  # (the final micro-step)
    assert all(p5[k] is not p2[k] for k in p)
    assert all(torch.equal(p2[k], params[k]) for k in p)  # (p, p2, p3, p4: untouched)


def test_apply_updates_of_known_zeros_asks_no_pairs_memo(monkeypatch):
    """``apply_updates`` of a non-final micro-step's known zero updates (one tensor per
    shape, which the metadata guards cannot take) neither looks the pairs up in its memo nor
    offers them to it (a failed lookup and a refused offer were ~6% of an ``update`` +
    ``apply_updates`` micro-step on 244 leaves); a bad pair still raises, and real updates are
    looked up as before."""
    from functional_train import update as update_module

    calls = []
    memo = update_module._PAIRS_BY_METADATA

    class Spy:
        def get(self, *a):
            calls.append("get")
            return memo.get(*a)

        def put(self, *a):
            calls.append("put")
            return memo.put(*a)

    monkeypatch.setattr(update_module, "_PAIRS_BY_METADATA", Spy())
    params, grads = _problem(torch.float32)
    tx = ft.multi_steps(_clip_adamw(), 3)
    u, _ = tx.update(grads[0], tx.init(params), params)
    p = ft.apply_updates(params, u)
    assert calls == [] and all(p[k] is params[k] for k in params)
    other = {**u, next(iter(u)): torch.zeros(7, 7)}
    with pytest.raises(ValueError, match="shape"):
        ft.apply_updates(params, other)
    calls.clear()
    ft.apply_updates(params, {k: torch.ones_like(v) for k, v in params.items()})
    assert calls[:1] == ["get"]  # (real updates: asked of the memo, as before)


@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_multi_steps_flags_read_as_one_block(mode, monkeypatch):
    """``MultiStepsState.seen`` as the fused micro-steps write it: one buffer per state, read
    with one ``tolist`` (no flag read one at a time after ``init``), reused once nothing
    holds it; a state the caller keeps, a flag or a view of one the caller keeps, keep their
    values; flags written in place (a checkpoint loaded into the state) are what the next
    micro-step reads, as the general path reads them."""
    import copy

    reads = []
    monkeypatch.setattr(
        accumulation,
        "host_values",
        lambda xs, what: reads.append(len(xs)) or [int(x) for x in xs],
    )
    params, grads = _problem(torch.float64)
    tx = ft.multi_steps(_clip_adamw(), 3)
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    kept, one, view = [], None, None
    for t in range(2 * STEPS):
        p, state = step_by_mode(tx, grads[t % STEPS], state, p, mode)
        expect = [0 if (t + 1) % 3 == 0 else 1] * len(params)
        assert [int(f) for f in state.seen] == expect, t
        if t % 4 == 0:
            kept.append((state, expect))
        if t == 1:
            one = state.seen[0]
        if t == 4:
            view = state.seen[1].view(1)
    assert reads == []  # (every flag read as its block)
    for s, expect in kept:  # (no block a state holds was written again)
        assert [int(f) for f in s.seen] == expect
    assert int(one) == 1 and int(view[0]) == 1  # (t == 1, 4: mid-cycle, ones)

    # flags written in place: the next micro-step starts every leaf's cycle again
    p, state = step_by_mode(tx, grads[0], tx.init(params), params, mode)
    other = copy.deepcopy(state)  # (plain flags: read one at a time)
    for f, g in zip(state.seen, other.seen):
        f.zero_(), g.zero_()
    assert not any(accumulation._BLOCKS.values(state.seen))
    _, got = ft.step(tx, grads[1], state, p, donate=mode == "donate")
    _, want = tx.update(grads[1], other, p)
    for a, b in zip(optree.tree_leaves(got.acc_grads), optree.tree_leaves(want.acc_grads)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not torch.equal(a, 2 * b)  # (not acc + g)


@pytest.mark.parametrize("commuted", [True, False])
@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_partition_of_multi_steps_flags_stay_one_block(mode, commuted, monkeypatch):
    """``partition`` of two ``multi_steps``: each label's ``MultiStepsState.seen`` holds a
    flag per leaf, set on its own leaves only. The fused micro-steps keep it one block (no
    flag read one at a time: they were, 244 ``.item()`` a micro-step on the benchmark tree,
    once the first micro-step had set half the flags), with the right values, with the
    general path's numbers over two cycles: run as ``multi_steps`` of the partition
    (``commuted``), every leaf chosen for at once; else (the labels' own transforms, as for
    labels whose ``every_k`` differ) each label's variant chosen from its own leaves (the
    leaves of the other label, ``None`` there, left out: ``accumulation._both_present``)."""
    if not commuted:
        monkeypatch.setattr(combine._Commuted, "of", classmethod(lambda cls, *a: None))
    reads = []
    monkeypatch.setattr(
        accumulation,
        "host_values",
        lambda xs, what: reads.append(len(xs)) or [int(x) for x in xs],
    )
    chosen = []
    real = accumulation._both_present
    monkeypatch.setattr(
        accumulation, "_both_present", lambda g, acc: chosen.append(1) or real(g, acc)
    )
    params, grads = _problem(torch.float64)
    labels = {"w": "a", "b": "b", "e": "a", "s": "b"}
    tx = ft.partition(
        {"a": ft.multi_steps(_clip_adamw(), 3), "b": ft.multi_steps(ft.sgd(0.1, 0.9), 3)},
        labels,
    )
    state = ref_state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    ref = {k: v.clone() for k, v in params.items()}
    keys = sorted(params)
    for t in range(6):
        u, ref_state = tx.update(grads[t], ref_state, ref)  # (first: a donated step
        ref = ft.apply_updates(ref, u)  # may write over the gradients)
        p, state = step_by_mode(tx, grads[t], state, p, mode)
        for label in ("a", "b"):
            seen = state.inner_states[label].seen
            assert accumulation._BLOCKS.values(seen) is not None, (t, label)
            on = 0 if (t + 1) % 3 == 0 else 1
            assert [int(f) for f in seen] == [on * (labels[k] == label) for k in keys], t
        params_close(p, ref, params, torch.float64)
    assert reads == []
    if commuted:
        assert chosen == []  # (one choice over every leaf)
    else:
        assert len(chosen) >= 6 * 2  # (every micro-step, each label: not the general path)


def _same_run(got, want):
    """Two runs' ``(params, state)``: the same parameters and states, bit for bit, the states of
    one structure."""
    (got_p, got_s), (want_p, want_s) = got, want
    for k in want_p:
        assert torch.equal(got_p[k], want_p[k]), k
    assert optree.tree_structure(got_s, none_is_leaf=True) == optree.tree_structure(
        want_s, none_is_leaf=True
    )
    for a, b in zip(ft.tree.tree_flatten(got_s)[0], ft.tree.tree_flatten(want_s)[0]):
        assert (a is None) == (b is None)
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b))


def _groups_of_multi_steps(every_k=3, every_k_b=3):
    """``partition`` of two ``multi_steps`` (each label's chain its own clip; weight decay on
    one label only), the labels and a labelled problem."""
    labels = {"w": "decay", "b": "none", "e": "decay", "s": "none"}

    def group(wd, k):
        return ft.multi_steps(
            ft.chain(ft.clip_by_global_norm(0.05), ft.adamw(1e-2, weight_decay=wd)), k
        )

    return ft.partition({"decay": group(0.1, every_k), "none": group(0.0, every_k_b)}, labels)


def _with_gaps(grads):
    """``grads`` with some leaves' gradients ``None`` on some micro-steps: a leaf without a
    gradient on part of a cycle, and one without any in a whole cycle."""
    out = [dict(g) for g in grads]
    out[1]["b"] = None  # (part of the first cycle)
    for t in (3, 4, 5):  # (the whole second cycle)
        out[t]["e"] = None
    return out


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
def test_partition_of_multi_steps_is_multi_steps_of_partition(mode, gaps, monkeypatch):
    """``partition`` of ``multi_steps`` with one ``every_k`` runs as ``multi_steps`` of the
    partition of their inner transforms (``combine._Commuted``): one kernel call per stage
    where each label took its own, the same parameters and states, bit for bit, as the labels'
    own transforms over two cycles and more (``None`` gradients on part of a cycle and over a
    whole one included), each label's state of ``partition.init``'s structure."""
    params, grads = _problem(torch.float64)
    grads = _with_gaps(grads) if gaps else grads
    with monkeypatch.context() as m:  # (the labels' own transforms)
        m.setattr(combine._Commuted, "of", classmethod(lambda cls, *a: None))
        ref_tx = _groups_of_multi_steps()
    tx = _groups_of_multi_steps()
    outs = []
    real = combine._Commuted.state_out
    monkeypatch.setattr(
        combine._Commuted, "state_out", lambda self, *a: outs.append(1) or real(self, *a)
    )
    calls = kernel_calls(monkeypatch)
    want_p, want_s = _run(ref_tx, params, grads, mode)
    ref_calls, outs_ref = len(calls), len(outs)
    calls.clear()
    got_p, got_s = _run(tx, params, grads, mode)
    assert outs_ref == 0 and len(outs) == STEPS  # (every step commuted)
    _same_run((got_p, got_s), (want_p, want_s))
    if mode != "update" and not gaps:  # (non-final micro-steps: one call, not one a label)
        assert len(calls) < ref_calls, (len(calls), ref_calls)


@given(
    labels=st.lists(st.sampled_from("abc"), min_size=4, max_size=4),
    every_k=st.integers(1, 3),
    gaps=st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=5, max_size=5),
    mode=st.sampled_from(["update", "pure", "donate"]),
)
def test_partition_of_multi_steps_commuted_equals_labelled(labels, every_k, gaps, mode):
    """(Drawn: the leaves' labels, ``every_k``, which gradients are ``None`` at each of 5
    micro-steps, the kind of step.) ``partition`` of ``multi_steps`` run as ``multi_steps`` of
    the partition gives the labels' own transforms' parameters and states bit for bit."""
    params, grads = _problem(torch.float64)
    keys = sorted(params)
    tree = dict(zip(keys, labels))
    chains = {
        "a": lambda: ft.chain(ft.clip_by_global_norm(0.05), ft.adamw(1e-2, weight_decay=0.1)),
        "b": lambda: ft.sgd(0.1, 0.9),
        "c": lambda: ft.chain(ft.clip_by_global_norm(0.02), ft.adam(1e-2)),
    }
    used = sorted(set(labels))

    def build():
        return ft.partition({n: ft.multi_steps(chains[n](), every_k) for n in used}, tree)

    real = combine._Commuted.of
    combine._Commuted.of = classmethod(lambda cls, *a: None)
    try:
        ref_tx = build()
    finally:
        combine._Commuted.of = real
    tx = build()
    seq = [{k: None if off else g[k] for k, off in zip(keys, row)} for g, row in zip(grads, gaps)]
    want_p, want_s = _run(ref_tx, params, seq, mode)
    got_p, got_s = _run(tx, params, seq, mode)
    _same_run((got_p, got_s), (want_p, want_s))


def test_partition_of_multi_steps_keeps_each_labels_counters(monkeypatch):
    """Each label's ``gradient_step`` is its own (moved as the merged one moves, never read on
    the host); labels whose ``mini_step`` differ (a state put together by hand) or whose
    ``every_k`` differ run as their own transforms, with their numbers."""
    params, grads = _problem(torch.float64)
    tx = _groups_of_multi_steps()
    with monkeypatch.context() as m:
        m.setattr(combine._Commuted, "of", classmethod(lambda cls, *a: None))
        ref_tx = _groups_of_multi_steps()
    for change in ("gradient_step", "mini_step"):
        state = tx.init(params)
        inner = dict(state.inner_states)
        inner["none"] = inner["none"]._replace(**{change: torch.tensor(2, dtype=torch.int64)})
        state = ft.PartitionState(inner)
        ref_state = ft.PartitionState(dict(inner))
        p, ref = dict(params), dict(params)
        for g in grads:
            p, state = ft.step(tx, g, state, p)
            ref, ref_state = ft.step(ref_tx, g, ref_state, ref)
        for k in params:
            assert torch.equal(p[k], ref[k]), (change, k)
        for n in ("decay", "none"):
            for f in ("mini_step", "gradient_step"):
                a = getattr(state.inner_states[n], f)
                assert torch.equal(a, getattr(ref_state.inner_states[n], f)), (change, n, f)
    assert int(state.inner_states["decay"].gradient_step) == STEPS // 3
    # (every_k differ: the labels' own transforms, whose cycles are their own)
    tx = _groups_of_multi_steps(3, 2)
    assert combine._Commuted.of  # (not patched here)
    p, s = _run(tx, params, grads, "pure")
    assert int(s.inner_states["decay"].gradient_step) == STEPS // 3
    assert int(s.inner_states["none"].gradient_step) == STEPS // 2


def _commuted_of(tx) -> combine._Commuted:
    """The ``_Commuted`` form ``partition`` took for ``tx`` (its update's closure)."""
    found = [
        c.cell_contents
        for c in tx.update.__closure__ or ()
        if isinstance(c.cell_contents, combine._Commuted)
    ]
    assert len(found) == 1
    return found[0]


def _changed(state, change: str):
    """``state`` (a partition of two ``multi_steps``' state, mid-cycle) changed as a user or a
    checkpoint loader may change it between steps: an accumulator replaced in its dict
    (``"acc"``), flags loaded in place (``"seen"``), one label's counter loaded in place
    (``"mini_step"``)."""
    none = state.inner_states["none"]
    if change == "acc":
        none.acc_grads["b"] = none.acc_grads["b"] * 3.0
    elif change == "seen":
        for f in state.inner_states["decay"].seen:
            f.zero_()
    elif change == "mini_step":
        none.mini_step.fill_(0)
    return state


@pytest.mark.parametrize("change", [None, "acc", "seen", "mini_step"])
@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
def test_partition_of_multi_steps_recalls_the_state_it_returned(mode, change, monkeypatch):
    """The commuted form recalls the merged state of the state it returned last (no
    conversion: ``combine._Last``) on every call but the first, with the labels' own
    transforms' numbers bit for bit; a state changed between two steps (an accumulator
    replaced in its dict, flags or a counter loaded in place) is converted again (or, labels
    whose counters differ, run by the labels' own transforms), with their numbers too."""
    params, grads = _problem(torch.float64)
    with monkeypatch.context() as m:  # (the labels' own transforms)
        m.setattr(combine._Commuted, "of", classmethod(lambda cls, *a: None))
        ref_tx = _groups_of_multi_steps()
    tx = _groups_of_multi_steps()
    recalled: list = []  # (per step, whether each recall gave the merged state)
    real = combine._Last.recall
    monkeypatch.setattr(
        combine._Last,
        "recall",
        lambda self, *a: recalled[-1].append(real(self, *a)) or recalled[-1][-1],
    )
    state, ref_state = tx.init(params), ref_tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    ref = {k: v.clone() for k, v in params.items()}
    for t, g in enumerate(grads):
        if change is not None and t == 4:  # (mid-cycle: a micro-step after the first)
            state, ref_state = _changed(state, change), _changed(ref_state, change)
        recalled.append([])
        p, state = step_by_mode(tx, {k: v.clone() for k, v in g.items()}, state, p, mode)
        ref, ref_state = step_by_mode(ref_tx, dict(g), ref_state, ref, "update")
    _same_run((p, state), (ref, ref_state))
    hits = [[r is not None for r in step] for step in recalled]
    assert hits[0] == [], hits  # (nothing returned yet)
    for t, step in enumerate(hits[1:], 1):
        if change is None or t < 4:
            assert step and all(step), hits
    if change in ("acc", "seen"):
        assert hits[4] and not any(hits[4]), hits  # (the changed state: converted again)
    if change == "mini_step":  # (labels' counters differ: refused before the record is asked)
        assert hits[4] == [], hits
    if change in ("acc", "seen"):
        assert all(hits[6]), hits  # (then recalled again)


def test_partition_of_multi_steps_record_goes_with_its_state():
    """What the commuted form keeps of the state it returned last (``combine._Last``: the
    merged state, Adam's moments in it) goes once its user drops that state: nothing of an
    optimizer state outlives its user's last reference through the transform."""
    params, grads = _problem(torch.float64)
    tx = _groups_of_multi_steps()
    commuted = _commuted_of(tx)
    p, state = dict(params), tx.init(params)
    for g in grads[:5]:
        p, state = ft.step(tx, g, state, p, donate=True)
    assert commuted._last is not None and commuted._last.merged is not None
    moment = weakref.ref(state.inner_states["decay"].inner_state[1][0].mu["w"])
    acc = weakref.ref(state.inner_states["none"].acc_grads["b"])
    gc.collect()
    gc.disable()  # (no cycle collection needed: the record holds no cycle)
    try:
        del state
        assert commuted._last is None
    finally:
        gc.enable()
    assert moment() is None and acc() is None
    # pure steps: the record of one step goes with the next (no old state kept alive, by
    # reference counts alone: no cycle collection)
    p, state = dict(params), tx.init(params)
    olds = []
    gc.collect()
    gc.disable()
    try:
        for g in grads[:5]:  # (floating leaves: the flags' blocks are reused, _FlagBlocks)
            leaves = ft.tree.tree_flatten(state)[0]
            olds.append([weakref.ref(x) for x in leaves if x is not None and x.is_floating_point()])
            p, state = ft.step(tx, g, state, p)
        del leaves
        now = {id(x) for x in ft.tree.tree_flatten(state)[0]}
        assert all(r() is None or id(r()) in now for refs in olds for r in refs)
    finally:
        gc.enable()


def test_partition_of_multi_steps_pickles_after_steps():
    """The transform pickles after steps (cloudpickle, as ``TorchOptimizer`` and its users
    do): without the record of the state returned last (a state's, which the copy would not
    recall, and whose weak references do not pickle); the copy steps as the original. (A
    ``copy.deepcopy`` of a transform shares its functions, so their record: it recalls only
    the states the record names.)"""
    cloudpickle = pytest.importorskip("cloudpickle")
    params, grads = _problem(torch.float64)
    tx = _groups_of_multi_steps()
    p, state = dict(params), tx.init(params)
    for g in grads[:4]:
        p, state = ft.step(tx, g, state, p)
    assert _commuted_of(tx)._last is not None
    other = cloudpickle.loads(cloudpickle.dumps(tx))
    assert _commuted_of(other)._last is None
    got = ft.step(other, grads[4], copy.deepcopy(state), p)
    want = ft.step(tx, grads[4], copy.deepcopy(state), p)
    _same_run(got, want)


def test_multi_steps_partial_cycles_fall_back():
    """A leaf whose gradient is None on part of a cycle (some leaves start their cycle, others
    add; a leaf of the cycle without a gradient on the final micro-step): the general path,
    with its numbers."""
    params, grads = _problem(torch.float64)
    grads[0]["b"] = None
    grads[2]["e"] = None
    got, got_state = _run(ft.multi_steps(_clip_adamw(), 3), params, grads, "donate")
    want, want_state = _run(ft.multi_steps(_clip_adamw(), 3), params, grads, "update")
    params_close(got, want, params, torch.float64)
    _states_close(got_state, want_state, torch.float64)


_MASK = {"w": True, "b": False, "e": True, "s": False}
_LABELS = {"w": "adam", "b": "sgd", "e": "adam", "s": "sgd"}
COMBINED = {
    "masked_decay": lambda: ft.chain(
        ft.clip_by_global_norm(1.0),
        ft.scale_by_adam(),
        ft.masked(ft.add_decayed_weights(0.1), _MASK),
        ft.scale_by_learning_rate(1e-2),
    ),
    "masked_adam": lambda: ft.chain(
        ft.masked(ft.scale_by_adam(), _MASK), ft.scale_by_learning_rate(1e-2)
    ),
    "masked_ema": lambda: ft.chain(_adamw(), ft.masked(ft.ema_params(0.9), _MASK)),
    "masked_alias_mask": lambda: ft.masked(
        ft.adamw(1e-2, weight_decay=0.1, mask={"w": False, "b": True, "e": True, "s": True}),
        _MASK,
    ),
    "partition": lambda: ft.partition(
        {"adam": ft.adamw(1e-2, weight_decay=0.1), "sgd": ft.sgd(1e-1, momentum=0.9)}, _LABELS
    ),
    "partition_in_chain": lambda: ft.chain(
        ft.clip_by_global_norm(1.0),
        ft.partition({"adam": ft.scale_by_adam(), "sgd": ft.trace(0.9)}, _LABELS),
        ft.scale_by_learning_rate(1e-2),
    ),
    # reductions over their own leaves (a norm, a trust ratio, a block RMS)
    "masked_clip": lambda: ft.chain(ft.masked(ft.clip_by_global_norm(0.3), _MASK), _adamw()),
    "masked_clip_nested": lambda: ft.chain(
        ft.masked(ft.masked(ft.clip_by_global_norm(0.3), {**_MASK, "e": False, "b": True}), _MASK),
        _adamw(),
    ),
    "masked_clip_no_leaf": lambda: ft.chain(
        ft.masked(ft.clip_by_global_norm(0.3), {k: False for k in _MASK}), _adamw()
    ),
    "partition_clips": lambda: ft.partition(_clipped_pair(), _LABELS),
    "partition_lamb": lambda: ft.partition(
        {"adam": ft.lamb(1e-2), "sgd": ft.chain(ft.clip_by_global_norm(0.2), ft.sgd(1e-1))},
        _LABELS,
    ),
    "masked_lamb": lambda: ft.masked(ft.lamb(1e-2), _MASK),
    "masked_block_rms": lambda: ft.chain(
        ft.scale_by_adam(), ft.masked(ft.clip_by_block_rms(0.5), _MASK), ft.scale(-1e-2)
    ),
    "apply_if_finite_partition_clips": lambda: ft.apply_if_finite(
        ft.partition(_clipped_pair(), _LABELS), 3
    ),
    # apply_if_finite inside: its check over its own leaves, its zeros on them only
    "masked_apply_if_finite": lambda: ft.chain(
        ft.masked(ft.apply_if_finite(_clip_adamw(), 3), _MASK), ft.sgd(1e-2)
    ),
    "partition_apply_if_finite": lambda: ft.partition(
        {"adam": ft.apply_if_finite(_adamw(), 3), "sgd": ft.apply_if_finite(ft.sgd(1e-1), 3)},
        _LABELS,
    ),
}
# (non-finite gradients at some steps: BAD)
NON_FINITE = {
    "apply_if_finite_partition_clips",
    "masked_apply_if_finite",
    "partition_apply_if_finite",
}
# leaves visited per step where not each of the 4 once: a reduction after a pass that acted
# on its leaves (the block RMS after Adam, the partition's clips after apply_if_finite's
# check: two passes); lamb's trust ratio after a pass over its own leaves only (the 2
# masked-in or "adam" leaves twice, the others once)
VISITS = {
    "partition_lamb": 6,
    "masked_lamb": 6,
    "masked_block_rms": 8,
    "apply_if_finite_partition_clips": 8,
}


def _clipped_pair():
    return {
        "adam": ft.chain(ft.clip_by_global_norm(0.5), _adamw()),
        "sgd": ft.chain(ft.clip_by_global_norm(0.2), ft.sgd(1e-1, momentum=0.9)),
    }


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", sorted(COMBINED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_and_partition_fuse(name, mode, dtype, monkeypatch, device):
    """``masked`` and ``partition`` of fusable transforms run their parts restricted to their
    leaves in the fused pass (generated kernels on every step; the leaves outside pass
    through, their state ``None``), with the numbers and state of the combinators' general
    paths (the transforms built without their fused forms). A reduction inside (a clip, a
    trust ratio) is over its own leaves, as the general path computes it, and one restricted
    to leaves the pass has not acted on yet does not start a pass (``partition`` of two
    clipped chains: one pass per step), and a pass before it that only its own leaves need
    visits only those (lamb's first). ``ft.step`` visits each leaf once per pass: one
    kernel call per group of leaves (in, out, per inner key); non-finite gradients for
    ``apply_if_finite``."""
    params, grads = _problem(dtype, bad=name in NON_FINITE, device=device)
    with monkeypatch.context() as m:
        m.setattr(combine.E, "register", lambda fn, spec: fn)
        general = COMBINED[name]()
    want, want_state = _run(general, params, grads, "update")
    tx = COMBINED[name]()
    assert E.fusable_of(tx) is not None
    seen = kernel_calls(monkeypatch)
    torch_fused = torch_fused_calls(monkeypatch)
    got, got_state = _run(tx, params, grads, mode)
    recognised = took_torch_fused(device, torch_fused, seen)
    if not recognised and mode != "update" and kernels_run_on(device):  # one call per step
        assert sum(k for _, k in seen) == VISITS.get(name, len(params)) * STEPS, seen
    params_close(got, want, params, dtype)
    _states_close(got_state, want_state, dtype)


def _partition_runs(labels, params, grads, mode, monkeypatch):
    """``chain(clip, partition({adam: scale_by_adam, sgd: trace}, labels), lr)`` by its general
    path (``update``) and by ``ft.step`` in ``mode``: ``(want, want_state, got, got_state,
    the generated kernel calls of the latter)``."""

    def make():
        return ft.chain(
            ft.clip_by_global_norm(1.0),
            ft.partition({"adam": ft.scale_by_adam(), "sgd": ft.trace(0.9)}, labels),
            ft.scale_by_learning_rate(1e-2),
        )

    with monkeypatch.context() as m:
        m.setattr(combine.E, "register", lambda fn, spec: fn)
        general = make()
    want, want_state = _run(general, params, grads, "update")
    seen = kernel_calls(monkeypatch)
    got, got_state = _run(make(), params, grads, mode)
    return want, want_state, got, got_state, seen


@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_partition_groups_mixed_leaves(mode, monkeypatch, device):
    """A ``partition`` whose labels group leaves of two dtypes, one of them with a
    non-contiguous gradient: the leaves are grouped by label (and absent state) first, each
    group's lists checked whole; a group that cannot run as one kernel call (two dtypes, a
    strided leaf) is grouped leaf by leaf, the strided leaf running in torch. Numbers and
    state of the general path, and one kernel call per (label, dtype) group of contiguous
    leaves per step."""
    g = torch.Generator().manual_seed(3)
    shapes = {"w": (17, 33), "v": (5, 4), "b": (33,), "e": (4, 3)}
    dtypes = {"w": torch.float32, "v": torch.float64, "b": torch.float32, "e": torch.float32}
    labels = {"w": "adam", "v": "adam", "b": "sgd", "e": "sgd"}
    params = {k: torch.randn(s, generator=g, dtype=dtypes[k]).to(device) for k, s in shapes.items()}
    grads = []
    for _ in range(4):
        gt = {k: torch.randn(s, generator=g, dtype=dtypes[k]) * 0.1 for k, s in shapes.items()}
        gt["e"] = torch.randn(3, 4, generator=g).t()  # (strided: a transposed view)
        grads.append({k: v.to(device) for k, v in gt.items()})
    assert not grads[0]["e"].is_contiguous()
    want, want_state, got, got_state, seen = _partition_runs(
        labels, params, grads, mode, monkeypatch
    )
    if kernels_run_on(device):  # adam's w (float32) and v (float64), sgd's b; e in torch
        assert sorted(k for _, k in seen) == [1, 1, 1] * 4, seen
    for k in params:  # (mixed dtypes: each leaf at its own dtype's tolerance)
        params_close({k: got[k]}, {k: want[k]}, {k: params[k]}, dtypes[k])
    for a, b in zip(ft.tree.tree_flatten(got_state)[0], ft.tree.tree_flatten(want_state)[0]):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert E.statics_memo() is None  # (lives while a step's statics run, no longer)


@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_partition_with_an_empty_label_is_one_group(mode, monkeypatch, device):
    """A ``partition`` whose every leaf has one label (the other transform has no leaves:
    its state leaves are all ``None``): one group, found by one C loop over the leaves'
    keys and absent inputs, one kernel call per step; the general path's numbers and state."""
    params, grads = _problem(device=device)
    labels = {k: "adam" for k in params}
    want, want_state, got, got_state, seen = _partition_runs(
        labels, params, grads, mode, monkeypatch
    )
    if kernels_run_on(device):
        assert [k for _, k in seen] == [len(params)] * STEPS, seen
    params_close(got, want, params, torch.float32)
    _states_close(got_state, want_state, torch.float32)


def _injected_chain():
    return ft.chain(
        ft.clip_by_global_norm(1.0),
        ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, b1=0.8, weight_decay=0.1),
        ft.ema_params(0.9),
    )


def _run_injected(tx, params, grads, mode):
    """Steps with the injected learning rate set every step (a tensor) and ``b1`` changed once
    (a host-read value: the alias rebuilt)."""
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for t, g in enumerate(grads):
        state[1].hyperparams["learning_rate"] = torch.tensor(1e-2 / (t + 1))
        if t == 3:
            state[1].hyperparams["b1"] = 0.7
        p, state = step_by_mode(tx, {k: v.clone() for k, v in g.items()}, state, p, mode)
    return p, state


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chain_with_inject_hyperparams_fuses(mode, dtype, monkeypatch, device):
    """A chain holding ``inject_hyperparams(adamw)`` between a clip and ``ema_params`` is one
    pass per ``ft.step`` (its fused form is chosen per call from the injected values), with
    the numbers and state of the chain's general ``update`` (each transform by its own
    ``update``: the chain's choice of its fused form turned off), the learning rate changed
    every step and ``b1`` once."""
    params, grads = _problem(dtype, device=device)
    with monkeypatch.context() as m:
        general_updates(m)
        want, want_state = _run_injected(_injected_chain(), params, grads, "update")
    tx = _injected_chain()
    assert E.switch_of(tx) is not None
    seen = kernel_calls(monkeypatch)
    torch_fused = torch_fused_calls(monkeypatch)
    got, got_state = _run_injected(tx, params, grads, mode)
    if not took_torch_fused(device, torch_fused, seen) and kernels_run_on(device):
        assert sum(k for _, k in seen) == STEPS * len(params), seen
    params_close(got, want, params, dtype)
    _states_close(got_state, want_state, dtype)
    assert int(got_state[1].count) == STEPS and got_state[1].hyperparams["b1"] == 0.7


def _multi_steps_inside(kind):
    """``multi_steps`` as users put it inside a combinator or before another transform."""
    inner = ft.multi_steps(
        ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)), 3
    )
    if kind == "masked":
        return ft.masked(inner, {"w": True, "b": False, "e": True, "s": False})
    if kind == "partition":
        labels = {"w": "a", "b": "b", "e": "a", "s": "c"}
        return ft.partition(
            {"a": inner, "b": ft.multi_steps(ft.sgd(1e-2, momentum=0.9), 2), "c": ft.adam(1e-2)},
            labels,
        )
    if kind == "apply_if_finite":
        return ft.chain(ft.apply_if_finite(inner, 3), ft.ema_params(0.9))
    return ft.chain(inner, ft.ema_params(0.9))


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("kind", ["masked", "partition", "chain", "apply_if_finite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multi_steps_inside_a_combinator_fuses(kind, mode, dtype, device):
    """``masked(multi_steps)``, ``partition`` of ``multi_steps`` with different cycles beside
    another transform, ``chain(multi_steps, ema_params)`` and ``apply_if_finite(multi_steps)``
    in a chain (non-finite gradients on some steps): every micro-step, non-final ones
    included, is the combinator's fused form (its Switch chooses a Fusable: the inner
    multi_steps' choice on its own leaves, its zero updates written out), with ``update`` +
    ``apply_updates``' numbers and state."""
    params, grads = _problem(dtype, device=device, bad=kind == "apply_if_finite")
    want, want_state = _run(_multi_steps_inside(kind), params, grads, "update")
    tx = _multi_steps_inside(kind)
    switch = E.switch_of(tx)
    assert switch is not None
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        assert switch.choose(g, state, p, None) is not None  # (not the general path)
        p, state = step_by_mode(tx, {k: v.clone() for k, v in g.items()}, state, p, mode)
    params_close(p, want, params, dtype)
    _states_close(state, want_state, dtype)


def _one_injected_twice(kind):
    """One ``inject_hyperparams(adamw)`` transform object in two places of one step (as
    ``TorchOptimizer``'s param groups put it: a ``partition`` of one injected alias)."""
    t = ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, weight_decay=0.1)
    if kind == "partition":
        return ft.partition({"a": t, "b": t}, {"w": "a", "b": "b", "e": "a", "s": "b"})
    if kind == "apply_if_finite":
        return ft.partition(
            {"a": ft.apply_if_finite(t, 2), "b": t}, {"w": "a", "b": "b", "e": "a", "s": "b"}
        )
    return ft.chain(t, ft.clip_by_global_norm(1.0), t)


def _hyperparams_of(state, kind):
    if kind == "chain":
        return [state[0].hyperparams, state[2].hyperparams]
    a = state.inner_states["a"]
    if kind == "apply_if_finite":
        a = a.inner_state
    return [a.hyperparams, state.inner_states["b"].hyperparams]


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("kind", ["partition", "apply_if_finite", "chain"])
def test_one_injected_transform_in_two_places(kind, mode, device):
    """Each appearance of one injected transform reads its own state's values in the fused
    step (its fused form sets the transform's injected values when its parts run, not when
    it is chosen: before, every appearance read the last one chosen, and ``TorchOptimizer``'s
    param groups stepped with one group's learning rate), with ``update``'s numbers while
    the learning rates change every step, differently per appearance; no kernel is built
    after the first steps (the restricted and guarded parts are made once, not per call)."""
    params, grads = _problem(torch.float64, device=device)

    def run(step):
        tx = _one_injected_twice(kind)
        state = tx.init(params)
        p = {k: v.clone() for k, v in params.items()}
        for t, g in enumerate(grads):
            if t == 3:
                built = len(fuse._kernels)
            for h, lr in zip(_hyperparams_of(state, kind), (1e-2 / (t + 1), 3e-3 * (t + 1))):
                h["learning_rate"] = torch.tensor(lr, dtype=torch.float64)
            p, state = step(tx, {k: v.clone() for k, v in g.items()}, state, p)
        return p, state, len(fuse._kernels) - built

    want, want_state, _ = run(lambda tx, g, s, p: step_by_mode(tx, g, s, p, "update"))
    got, got_state, built = run(lambda tx, g, s, p: step_by_mode(tx, g, s, p, mode))
    assert E.switch_of(_one_injected_twice(kind)) is not None
    params_close(got, want, params, torch.float64)
    _states_close(got_state, want_state, torch.float64)
    assert built == 0


def _multi_steps_of_injected():
    return ft.multi_steps(
        ft.chain(
            ft.clip_by_global_norm(0.5),
            ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, weight_decay=0.1),
        ),
        3,
    )


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multi_steps_of_an_injected_chain_fuses(mode, dtype, monkeypatch, device):
    """``multi_steps(chain(clip, inject_hyperparams(adamw)))`` (optax's usual
    ``MultiSteps(inject_hyperparams(...))``): every micro-step is fused, the final one's inner
    form chosen for that update's injected values (it took the general path: 1.6x the same
    chain without inject_hyperparams on the benchmark tree), with multi_steps' general path's
    numbers and state while the learning rate changes every step."""
    params, grads = _problem(dtype, device=device)

    def run(tx, mode, check=None):
        state = tx.init(params)
        p = {k: v.clone() for k, v in params.items()}
        for t, g in enumerate(grads):
            state.inner_state[1].hyperparams["learning_rate"] = torch.tensor(1e-2 / (t + 1))
            if check is not None:
                assert check.choose(g, state, p, None) is not None  # (not the general path)
            p, state = step_by_mode(tx, {k: v.clone() for k, v in g.items()}, state, p, mode)
        return p, state

    tx = _multi_steps_of_injected()
    assert E.switch_of(tx) is not None
    got, got_state = run(tx, mode, E.switch_of(tx))
    with monkeypatch.context() as m:
        m.setattr(accumulation, "_fused_micro_steps", lambda *a: None)
        general = _multi_steps_of_injected()
    assert E.switch_of(general) is None
    want, want_state = run(general, "update")
    params_close(got, want, params, dtype)
    _states_close(got_state, want_state, dtype)


def _adafactor_momentum():
    return ft.adafactor(beta1=0.9, weight_decay=0.1, mask=lambda p: {k: k != "b" for k in p})


def _engine_runs(monkeypatch) -> list:
    """A list that receives the ``apply`` argument of every engine run (``E.run``: ``None``
    for ``update``, ``"pure"`` / ``"donate"`` for ``ft.step``) for the rest of the test."""
    runs: list = []
    real_run = E.run

    def run(*args, **kw):
        runs.append(kw.get("apply"))
        return real_run(*args, **kw)

    monkeypatch.setattr(E, "run", run)
    return runs


# name: (transform, kernel calls per step where it fuses: one per stage and group of leaves)
PRIMITIVES = {
    "identity": (lambda: ft.chain(ft.identity(), _clip_adamw(), ft.identity()), 1),
    "clip": (lambda: ft.chain(ft.clip(0.05), _adamw(), ft.clip(1e-3)), 1),
    "ema": (lambda: _clip_adamw(ft.ema(0.9, debias=True)), 1),
    "ema_momentum": (
        lambda: ft.chain(ft.clip(0.05), ft.scale_by_adam(), ft.ema(0.5), ft.scale(-0.1)),
        1,
    ),
    # two stages: the update from the factored statistics (three calls: the 0-dim leaf, the
    # matrices by rows, the vector by rows), then after the RMS the tail (two: the leaves
    # decayed and the one the mask keeps from decay)
    "adafactor_momentum": (_adafactor_momentum, 5),
    # CAME: the second moment's update (by rows: three calls), the clip and momentum in the
    # confidence part's prologue (two: the factored leaves, which give their residuals, and
    # the others), then the confidence update with the decay, the learning rate and p + u
    # (by rows: three calls)
    "came": (lambda: ft.came(1e-2, weight_decay=0.1), 8),
}


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("name", sorted(PRIMITIVES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identity_clip_and_ema_fuse(name, mode, dtype, monkeypatch, device):
    """``identity`` (no parts), ``clip`` (the clamp) and ``ema`` (the updates' moving average,
    Adafactor's ``beta1`` momentum) are elementwise parts, and so are the Adafactor and CAME
    updates given their statistics (a value per row and one per column): ``ft.step`` runs a
    chain holding them as ONE fused run ending with ``p + u`` (the engine's runs and kernel
    calls counted: one pass per stage and group of leaves), with the numbers and states of
    ``update`` + ``apply_updates`` run leaf by leaf in torch (the kernels off). Before, each
    took its own path: the chain ran transform by transform (``update``), then ``p + u``. On
    CUDA the kernel calls are not counted (the chains ending with adamw may run torch's fused
    kernel there)."""
    make, calls = PRIMITIVES[name]
    params, grads = _problem(dtype, device=device)
    seen = kernel_calls(monkeypatch)
    runs = _engine_runs(monkeypatch)
    tx = make()
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        n, r = len(seen), len(runs)
        g = {k: v.clone() for k, v in g.items()}
        p, state = ft.step(tx, g, state, p, donate=mode == "donate")
        assert runs[r:] == [mode], name
        assert device.type != "cpu" or len(seen) - n == calls, name
    monkeypatch.setattr(fuse, "ENABLED", False)
    want, want_state = _run(make(), params, grads, "update")
    params_close(p, want, params, dtype)
    _states_close(state, want_state, dtype)


def _loss_scaled(general=False):
    more = (_foreign_identity(),) if general else ()
    return {
        "clip": ft.dynamic_loss_scale(_clip_adamw(*more), init_scale=2.0**6, growth_interval=2),
        "plain": ft.dynamic_loss_scale(
            ft.chain(_adamw(), *more), 2.0**6, growth_factor=1.1, backoff_factor=0.3
        ),
    }


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", ["clip", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dynamic_loss_scale_fuses(name, mode, dtype, monkeypatch, device):
    """``dynamic_loss_scale`` of a fusable transform is the unscaling (a pass, which takes the
    squares a leading clip sums), the decision, and ``apply_if_finite``'s guarded parts (one
    pass, ``p + u`` included): ONE engine run per step, two kernel calls, over steps with
    non-finite gradients (skipped, the scale backed off) and finite ones (the scale grown);
    the numbers of its general path (the inner made unfusable by a foreign identity) to the
    kernels' rounding, the scale and counters exactly (kernel calls counted on CPU)."""
    params, grads = _problem(dtype, bad=True, device=device)
    grads = [{k: v * 64 for k, v in g.items()} for g in grads]
    seen = kernel_calls(monkeypatch)
    runs = _engine_runs(monkeypatch)
    tx = _loss_scaled()[name]
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        n, r = len(seen), len(runs)
        g = {k: v.clone() for k, v in g.items()}
        if mode == "update":
            u, state = tx.update(g, state, p)
            p = ft.apply_updates(p, u)
            assert runs[r:] == [None]
        else:
            p, state = ft.step(tx, g, state, p, donate=mode == "donate")
            assert runs[r:] == [mode]
            assert device.type != "cpu" or len(seen) - n == 2
    want, want_state = _run(_loss_scaled(general=True)[name], params, grads, "update")
    assert int(state.total_notfinite) == len(BAD) and bool(state.last_finite)
    assert torch.equal(state.scale, want_state.scale)
    assert torch.equal(state.growth_tracker, want_state.growth_tracker)
    params_close(p, want, params, dtype)
    _states_close(state.inner_state, want_state.inner_state[:-1], dtype)


def _triton_interpreted(monkeypatch) -> None:
    """For the rest of the test, the engine's stages on CPU leaves are the CUDA kernels
    (``fuse_triton``: the Triton writer's source, the address and block tables, the scalars as
    a CUDA stage reads them, :meth:`~functional_train.engine.fuse_triton.TritonKernel.by_rows`'
    index triples) run by Triton's interpreter (:func:`_spy.triton_interpreted`: numpy on the
    host, reading the leaves' memory through the addresses in the table)."""
    from functional_train.engine import fuse_triton

    triton_interpreted(monkeypatch)
    monkeypatch.setattr(fuse, "_kernels", {})
    real = fuse.kernel_for

    def kernel_for(
        fn, in_dtypes, scalar_dtypes, n_per_leaf=0, device_type="cpu", sumsq=False, vectors=()
    ):
        if sumsq:  # (a CUDA stage sums no squares: the engine asks again without)
            return None
        return real(fn, in_dtypes, scalar_dtypes, n_per_leaf, "cuda", vectors=vectors)

    monkeypatch.setattr(fuse, "kernel_for", kernel_for)
    monkeypatch.setattr(
        fuse, "scalar_pointers", lambda sc, device=None: fuse_triton.scalar_slots(sc, device)
    )


INTERPRETED = {
    "clip_adamw": (_clip_adamw, False),
    "adafactor_momentum": (_adafactor_momentum, False),
    "factored_primitives": (
        lambda: ft.chain(ft.scale_by_factored_rms(), ft.clip_by_block_rms(1.0), ft.scale(-1e-2)),
        False,
    ),
    "partition_factored": (
        lambda: ft.partition(
            {"a": _adamw(), "f": ft.adafactor(beta1=0.9)},
            lambda p: {k: "a" if k in ("b", "s") else "f" for k in p},
        ),
        False,
    ),
    "came": (lambda: ft.chain(ft.clip_by_global_norm(1.0), ft.came(1e-2, weight_decay=0.1)), False),
    "apply_if_finite_ema": CASES["apply_if_finite_ema"][::2],
    "multi_steps_clip": CASES["multi_steps_clip"][::2],
}


@pytest.mark.filterwarnings("error:functional_train:RuntimeWarning")
@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("name", sorted(INTERPRETED))
def test_triton_stages_under_the_interpreter(name, mode, monkeypatch):
    """The CUDA stages' kernels, checked where no GPU is: the engine's stages run as the
    generated Triton kernels under Triton's interpreter on CPU leaves (one launch per stage and
    group of leaves; the factored update's leaves by :meth:`TritonKernel.by_rows`, a value per
    row and one per column read per element through each leaf's index triple), over 7 steps
    (non-finite gradients skipped, multi_steps' whole and partial cycles): the numbers and
    states of the same definitions run leaf by leaf in torch (the kernels off), to float32
    rounding as on CUDA (the interpreter rounds a multiply-add twice where torch's CPU
    kernels may not; CUDA's ``libdevice.pow``, which the interpreter does not run, as
    ``exp2(b * log2(a))``). No stage falls back to torch (warnings are errors)."""
    from functional_train.engine import fuse_triton

    make, bad = INTERPRETED[name]
    params, grads = _problem(torch.float32, bad=bad)
    monkeypatch.setattr(fuse, "ENABLED", False)
    want, want_state = _run(make(), params, grads, mode)
    monkeypatch.setattr(fuse, "ENABLED", True)
    _triton_interpreted(monkeypatch)
    seen = kernel_calls(monkeypatch)
    got, got_state = _run(make(), params, grads, mode)
    triton = [k for k, _ in seen if isinstance(k, fuse_triton.TritonKernel)]
    foreach = [k for k, _ in seen if isinstance(k, fuse.ForeachKernel)]
    assert triton and len(triton) + len(foreach) == len(seen), name
    # (multi_steps' accumulation and the copy that starts a cycle: torch's foreach operations,
    # the sum of a pure step into fresh buffers by the generated kernel)
    assert {k.op[0] for k in foreach} == ({"add", "copy"} if "multi_steps" in name else set())
    if name in ("adafactor_momentum", "factored_primitives", "partition_factored", "came"):
        assert any(k.n_per_leaf for k in triton), name  # (the factored update: by rows)
    if name == "apply_if_finite_ema":  # (its inf was skipped: every parameter finite)
        assert all(bool(torch.isfinite(v).all()) for v in got.values())
    params_close(got, want, params, torch.float32, twice=True)
    _states_close(got_state, want_state, torch.float32, twice=True)


@pytest.mark.parametrize("name", ["clip_adamw", "primitives"])
def test_donated_steps_copy_their_address_tables_once(name, monkeypatch):
    """A donated step's address tables are the same every step (its leaves' addresses do not
    change), so a CUDA stage copies each to the device once: its device scalars (the clip
    factor, the bias corrections: new 0-dim tensors each step) are the kernel's pointer
    arguments, not slots of the table. Under Triton's interpreter: no table is made after
    the first step; the numbers those of the same steps with the kernels off."""
    from functional_train.engine import fuse_triton

    make = {
        "clip_adamw": _clip_adamw,
        "primitives": lambda: ft.chain(
            ft.clip_by_global_norm(1.0),
            ft.scale_by_adam(),
            ft.add_decayed_weights(0.1),
            ft.scale_by_learning_rate(1e-2),
        ),
    }[name]
    params, grads = _problem(torch.float32)

    def run():
        tx, g = make(), grads[0]  # (the same gradients' memory every step)
        state, p = tx.init(params), {k: v.clone() for k, v in params.items()}
        per_step = []  # (tables copied so far, after each step)
        start = fuse_triton.tables_copied
        for _ in range(4):
            p, state = ft.step(tx, g, state, p, donate=True)
            per_step.append(fuse_triton.tables_copied - start)
        return p, per_step

    monkeypatch.setattr(fuse, "ENABLED", False)
    want, _ = run()
    monkeypatch.setattr(fuse, "ENABLED", True)
    _triton_interpreted(monkeypatch)
    monkeypatch.setattr(fuse_triton, "_tables", {})
    got, per_step = run()
    assert per_step[0] > 0 and per_step == [per_step[0]] * 4, per_step
    params_close(got, want, params, torch.float32, twice=True)


_ZERO_NANS_AROUND = {
    "apply_if_finite": lambda inner: ft.apply_if_finite(inner, 5),
    "multi_steps": lambda inner: ft.multi_steps(inner, 2),
    "after_scale": lambda inner: ft.chain(ft.scale(2.0), inner),
}


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("around", [*sorted(_ZERO_NANS_AROUND), "masked"])
def test_zero_nans_then_clip_inside_wrappers(around, mode):
    """``chain(zero_nans, clip, adamw)`` inside ``apply_if_finite`` (guarded parts: the clip
    still reads the sums ``zero_nans`` gives), ``multi_steps``, after a ``scale``, and with
    ``zero_nans`` masked (a restricted part: a pass of its own), NaNs in one or two leaves on
    alternate steps: the float64 parameters of the chain run with the kernels off, to 1e-12."""
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (7, 5), "b": (5,), "e": (3, 4, 2)}
    params = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}
    grads = []
    for t in range(6):
        gt = {k: torch.randn(s, generator=g, dtype=torch.float64) * 0.1 for k, s in shapes.items()}
        if t % 2:
            gt["w"][1, 2] = float("nan")
        if t == 4:
            gt["e"][0, 0, 0] = gt["w"][0, 0] = float("nan")
        grads.append(gt)

    def make():
        if around == "masked":
            zn = ft.masked(ft.zero_nans(), lambda p: {k: k != "b" for k in p})
            return ft.chain(zn, ft.clip_by_global_norm(0.5), ft.adamw(1e-2))
        inner = ft.chain(ft.zero_nans(), ft.clip_by_global_norm(0.5), ft.adamw(1e-2))
        return _ZERO_NANS_AROUND[around](inner)

    got, _ = _run(make(), params, grads, mode)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fuse, "ENABLED", False)
        want, _ = _run(make(), params, grads, "update")
    for k in params:
        assert bool(torch.isfinite(got[k]).all()), k
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-15)


@pytest.mark.slow
@pytest.mark.parametrize("after_scale", [False, True])
@pytest.mark.parametrize("donate", [False, True])
def test_compiled_zero_nans_joins_the_clips_pass(donate, after_scale):
    """Under inductor, ``chain(zero_nans, clip, adamw)`` takes its flags and the clip's sums of
    squares from one native read of the gradients (``sum_squares`` with ``zeroed``: each NaN
    taken as zero, the results' sums bit for bit) and runs one stage, as the eager step does
    (before, a stage of its own wrote the cleaned gradients first): the graph holds one stage
    operator; after a ``scale`` (whose pass sums the squares it writes, which the eager step
    takes where no leaf holds a NaN and the compiled one, which cannot look, does not) two.
    Parameters and state bit for bit the eager step's, NaNs in two leaves every other step."""
    params, grads = _problem()
    for t, g in enumerate(grads):
        if t % 2:
            g["w"][t, :3] = float("nan")
            g["e"][0, t % 4, 1] = float("nan")

    def make():
        return ft.chain(*[ft.scale(0.5)] * after_scale, ft.zero_nans(), _clip_adamw())

    code = compiled_code_of_steps(make, params, grads, donate)
    op = "fused_stage_donated" if donate else "fused_stage"
    assert code.count(f"functional_train.{op}.default(") == 1 + after_scale, code
    calls = [line for line in code.splitlines() if "functional_train.sum_squares.default(" in line]
    assert len(calls) == 1 and calls[0].rstrip().endswith("None, True)"), calls  # (zeroed)


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("after_scale", [False, True])
def test_zero_nans_fuses(mode, dtype, after_scale, monkeypatch, device):
    """``zero_nans`` is an elementwise part (its prologue the per-leaf flags, its leaf function
    the replacement): ``chain(zero_nans, clip, adamw)`` is ONE engine run per step, with
    gradients holding NaNs every other step, the numbers and flags of ``update`` +
    ``apply_updates`` with the kernels off; after a ``scale`` too (its flags then from the
    sums of squares the scale's pass wrote). On CPU it adds no pass (as many kernel calls
    as the chain without it). A complex leaf takes its own update: a complex
    element with a NaN part is zeroed whole there (a kernel sees the parts apart)."""
    params, grads = _problem(dtype, device=device)
    for t, g in enumerate(grads):
        if t % 2:
            g["w"][t, :3] = float("nan")
            g["e"][0, t % 4, 1] = float("nan")
    runs = _engine_runs(monkeypatch)
    names = []  # the parts of each engine run
    real_run = E.run
    monkeypatch.setattr(
        E,
        "run",
        lambda fus, *a, **k: names.append([p.name for p in fus.parts]) or real_run(fus, *a, **k),
    )

    def make(zero_nans=True):
        first = (ft.scale(0.5),) if after_scale else ()
        return ft.chain(*first, *[ft.zero_nans()] * zero_nans, _clip_adamw())

    seen = kernel_calls(monkeypatch)
    _run(make(zero_nans=False), params, grads, mode)
    without = len(seen)
    seen.clear(), runs.clear(), names.clear()
    got, got_state = _run(make(), params, grads, mode)
    assert runs == [mode] * len(grads) and all("zero_nans" in n for n in names)
    if torch.device(device).type == "cpu":
        # (its replacement joins the clip's pass: the clip reads the sums of squares its
        # prologue gives, those of the NaN leaves zeroed taken then; elsewhere one pass more)
        assert len(seen) == without, (len(seen), without)
    _, after_nan = _run(make(), params, grads[:2], mode)  # (step 1 had NaNs in w and e)
    zn = after_nan[1] if after_scale else after_nan[0]
    assert {k: bool(v) for k, v in zn.found_nan.items()} == {k: k in ("w", "e") for k in params}
    monkeypatch.setattr(fuse, "ENABLED", False)
    want, want_state = _run(make(), params, grads, "update")
    params_close(got, want, params, dtype)
    _states_close(got_state, want_state, dtype)
    # a complex leaf: zero_nans' own update (no engine run of it), the element zeroed whole
    z = {"z": torch.tensor([1 + 1j, complex(float("nan"), 2.0)], device=device)}
    tx = ft.zero_nans()
    runs.clear()
    u, s = tx.update(z, tx.init(z), z)
    assert runs == [] and u["z"].tolist() == [1 + 1j, 0j] and bool(s.found_nan["z"])
