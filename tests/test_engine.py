"""The engine's shape: a plan per layout, a chain on local shards with
DTensors built once, eager DTensor construction equal to ``DTensor.from_local``, and ``ft.step``
taking torch's fused kernels where they apply."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import functional_train as ft
from _layouts import shard  # noqa: E402  (tests/ is on sys.path)
from functional_train.aliasing import is_shared
from functional_train.engine import dtensor as engine_dtensor
from functional_train.engine.view import prepare
from functional_train.testing import simulate


def make_mesh(shape, names):
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


def _tree(mesh, n=6, seed=0):
    """DTensors made from simulated tensors (not by DTensor ops, whose sharding-propagation
    cache can hand back an equal-looking mesh of an earlier simulation)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        out[f"w{i}"] = shard(torch.randn(5, 3, generator=gen), mesh, [Shard(i % 2)])
        out[f"b{i}"] = shard(torch.randn(3, generator=gen), mesh, [Replicate()])
    return out


def test_eager_wrap_equals_from_local():
    """The eager constructor (``DTensor.__new__`` with a cached spec, no ``__init__``) gives what
    ``DTensor.from_local`` gives: this fences the private construction path."""
    with simulate(2):
        mesh = make_mesh((2,), ("tp",))
        x = shard(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)])
        local = x._local_tensor * 2
        got = engine_dtensor.wrap(local, engine_dtensor.spec_of(x))
        want = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=x.shape, stride=x.stride()
        )
        like = engine_dtensor.wrap_like(local, x)
        for y in (got, like):
            assert type(y) is DTensor and not y.requires_grad
            assert y.placements == want.placements and y.shape == want.shape
            assert y.stride() == want.stride() and y.dtype == want.dtype
            assert y._local_tensor is local
            assert torch.equal(y.full_tensor(), want.full_tensor())
        half = engine_dtensor.wrap(local.double(), engine_dtensor.spec_of(x))
        assert half.dtype == torch.float64 and half._spec.tensor_meta.dtype == torch.float64


def test_detached_reads_dtensors_flags():
    """``autograd.detached`` reads a list of DTensors' ``requires_grad`` with the subclass torch
    function check off (a DTensor's own is torch's disabled one): a DTensor that requires grad
    (an ``nn.Parameter`` of one, a leaf or not) is still found and detached, among plain
    tensors too, and a list of none comes back as it is."""
    from functional_train.autograd import detached

    with simulate(2):
        mesh = make_mesh((2,), ("tp",))
        xs = [shard(torch.randn(4, 3), mesh, [Shard(0)]) for _ in range(3)]
        assert detached(xs) is xs
        for i, make in enumerate(
            (
                lambda x: torch.nn.Parameter(x),
                lambda x: x.detach().requires_grad_(),
                lambda x: x.detach().requires_grad_() * 2,
            )
        ):
            ys = list(xs)
            ys[i] = make(xs[i])
            assert ys[i].requires_grad
            for lst in (ys, [*ys, torch.randn(2)]):
                out = detached(lst)
                assert out is not lst and not any(y.requires_grad for y in out)
                assert all(o is y for j, (o, y) in enumerate(zip(out, lst)) if j != i)
                assert type(out[i]) is DTensor and torch.equal(
                    out[i].full_tensor(), ys[i].detach().full_tensor()
                )


def test_dtensor_parameters_read_by_their_local_shards(monkeypatch):
    """An FSDP2 model's parameters (``nn.Parameter``s holding DTensors, requiring grad): the
    step's view reads their layouts and their local shards, detaching no DTensor (a dispatch
    through DTensor's, about 5 us a leaf: 1.2 ms a step on 242 leaves, session 70; the
    ``dtensors=False`` of ``autograd.detached``), and a local shard that requires grad is
    detached; the steps' parameters and states are those of the same run on plain DTensors."""
    from functional_train.autograd import detached

    real = torch.Tensor.detach
    dtensor_detaches: list = []

    def spy(self, *args, **kwargs):
        if type(self) is DTensor:
            dtensor_detaches.append(self)
        return real(self, *args, **kwargs)

    with simulate(2):
        mesh = make_mesh((2,), ("dp",))
        fmesh = ft.Mesh(mesh, data_axis="dp")
        plain = _tree(mesh)
        grads = [_tree(mesh, seed=s) for s in (1, 2, 3)]
        tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2)), 2)
        runs = []
        for as_parameters in (False, True):
            p = {k: v.clone() for k, v in plain.items()}
            if as_parameters:
                p = {k: torch.nn.Parameter(v) for k, v in p.items()}
            state = tx.init(p)
            with monkeypatch.context() as m:
                m.setattr(torch.Tensor, "detach", spy)
                b = prepare(grads[0], p, fmesh)
                leaves = ft.tree.tree_flatten(p)[0]
                assert all(x is y._local_tensor for x, y in zip(b.params, leaves))
                for g in grads:  # (donated: the gradients too)
                    g = {k: v.clone() for k, v in g.items()}
                    p, state = ft.step(tx, g, state, p, mesh=fmesh, donate=True)
            assert dtensor_detaches == [], as_parameters
            assert all(isinstance(v, torch.nn.Parameter) for v in p.values()) == as_parameters
            runs.append((p, state))
        (p0, s0), (p1, s1) = runs
        for k in p0:
            assert torch.equal(p0[k].full_tensor(), p1[k].detach().full_tensor()), k
        for x, y in zip(ft.tree.tree_flatten(s0)[0], ft.tree.tree_flatten(s1)[0]):
            assert type(x) is type(y)
            if isinstance(x, DTensor):
                assert torch.equal(x.full_tensor(), y.full_tensor())
        # (a local shard that requires grad: detached, its DTensor as it is)
        x = shard(torch.randn(4, 3), mesh, [Shard(0)])
        odd = DTensor.from_local(x._local_tensor.requires_grad_(), mesh, [Shard(0)])
        assert detached([odd], dtensors=False)[0] is odd
        gain = torch.nn.Parameter(torch.randn(3))  # (a plain parameter beside: detached)
        mixed = detached([odd, gain, None], dtensors=False)
        assert mixed[0] is odd and mixed[2] is None
        assert not mixed[1].requires_grad and torch.equal(mixed[1], gain.detach())
        (loc,) = prepare({"w": x}, {"w": odd}, fmesh).params
        assert not loc.requires_grad and torch.equal(loc, odd._local_tensor.detach())


def test_one_plan_per_layout():
    """The second update of one layout reuses its plan; another layout gets another one."""
    with simulate(2):
        mesh = make_mesh((2,), ("tp",))
        params = _tree(mesh)
        grads = _tree(mesh, seed=1)
        a = prepare(grads, params, None)
        b = prepare(_tree(mesh, seed=2), params, None)
        assert a.plan is b.plan
        other = dict(grads, w0=shard(torch.zeros(5, 3), mesh, [Replicate()]))
        c = prepare(other, params, None)
        assert c.plan is not a.plan
        assert c.specs[c.paths.index("w0")].placements == params["w0"].placements  # relaid


def test_layout_checks_remembered_per_spec_objects():
    """``plan.by_specs``: a layout's plan and multi_steps' checks are remembered per the
    DTensors' spec objects, and told apart by them: gradients made anew (new spec objects,
    equal layouts) get the same plan; another placement, shape or dtype gets its own answer."""
    from functional_train.engine import plan as engine_plan

    with simulate(2):
        mesh = make_mesh((2,), ("tp",))
        a, b = _tree(mesh), _tree(mesh, seed=1)
        xs, ys = list(a.values()), list(b.values())
        assert engine_plan.only_dtensors(xs, ys)
        assert engine_plan.same_layouts(xs, ys) and engine_plan.same_layouts(xs, ys)
        moved = dict(b, w0=shard(torch.zeros(5, 3), mesh, [Replicate()]))
        assert not engine_plan.same_layouts(xs, list(moved.values()))
        assert engine_plan.same_layouts(xs, ys)  # (the earlier answer, unchanged)
        treedef = ft.tree.tree_flatten(a)[1]
        p1 = engine_plan.plan_for(treedef, ys, xs, None)
        p2 = engine_plan.plan_for(treedef, list(_tree(mesh, seed=2).values()), xs, None)
        assert p1 is p2  # (equal layouts, other spec objects: the value-keyed cache)
        wide = {k: shard(v.full_tensor().double(), mesh, v.placements) for k, v in b.items()}
        p3 = engine_plan.plan_for(treedef, list(wide.values()), xs, None)
        assert p3 is not p1
        engine_plan.cache_clear()  # (every plan forgotten: the last call's too)
        assert engine_plan.plan_for(treedef, list(wide.values()), xs, None) is not p3


def test_layout_with_absent_leaves_remembered_per_spec_objects(monkeypatch):
    """A masked / partition's transform sees ``None`` outside its leaves: its plan is
    remembered per where they are and the other leaves' spec objects too (``plan.by_specs``,
    no per-leaf key built and compared again: 122 DTensorSpec comparisons a call on the
    benchmark tree), and told apart by them."""
    from functional_train.engine import plan as engine_plan

    with simulate(2):
        mesh = make_mesh((2,), ("tp",))
        a, b = _tree(mesh), _tree(mesh, seed=1)
        names = sorted(a)
        masked = [None if i % 2 else b[k] for i, k in enumerate(names)]
        pmasked = [None if i % 2 else a[k] for i, k in enumerate(names)]
        treedef = ft.tree.tree_flatten(dict(zip(names, masked)))[1]
        p1 = engine_plan.plan_for(treedef, masked, pmasked, None)
        keys = []
        real = engine_plan._leaves_key
        monkeypatch.setattr(engine_plan, "_leaves_key", lambda xs: keys.append(1) or real(xs))
        assert engine_plan.plan_for(treedef, list(masked), list(pmasked), None) is p1
        assert keys == []  # (by the spec objects)
        assert p1.active == [i for i, x in enumerate(masked) if x is not None]
        other = [b[k] if i % 2 else None for i, k in enumerate(names)]
        pother = [a[k] if i % 2 else None for i, k in enumerate(names)]
        treedef2 = ft.tree.tree_flatten(dict(zip(names, other)))[1]
        p2 = engine_plan.plan_for(treedef2, other, pother, None)
        assert p2 is not p1 and p2.active == [i for i, x in enumerate(other) if x is not None]


def test_partition_states_checked_once_per_layout(monkeypatch):
    """The DTensor state of a ``partition``'s transforms (``None`` outside each label's
    leaves) is checked against the updates once per layout: the view remembers its spec
    objects per set of absent leaves (the labels' parts ask in turn; one entry for both
    labels made each check every leaf again, every step), and later steps check no leaf
    again. (Labels' ``multi_steps`` of different ``every_k``: each label's own; with one
    ``every_k`` the partition runs as ``multi_steps`` of a partition.)"""
    from functional_train.engine import view

    with simulate(2):
        mesh = make_mesh((2,), ("tp",))
        params = _tree(mesh)
        labels = {k: "a" if k.startswith("w") else "b" for k in params}
        tx = ft.partition(
            {"a": ft.multi_steps(ft.adamw(1e-2), 2), "b": ft.multi_steps(ft.sgd(0.1, 0.9), 1)},
            labels,
        )
        state = tx.init(params)
        for seed in (1, 2):
            params, state = ft.step(tx, _tree(mesh, seed=seed), state, params, donate=True)
        plan = view.prepare(_tree(mesh, seed=3), params, None).plan
        checked = plan.memo[("state specs", "MultiStepsState.acc_grads")]
        masks = {k[1] for k in checked if isinstance(k, tuple) and k[0] == "all"}
        names = sorted(params)
        assert masks == {tuple(labels[k] == label for k in names) for label in "ab"}
        compared = []
        real = view.same_layout
        monkeypatch.setattr(view, "same_layout", lambda a, b: compared.append(1) or real(a, b))
        for seed in (3, 4):
            params, state = ft.step(tx, _tree(mesh, seed=seed), state, params, donate=True)
        assert compared == []


def test_partition_of_dtensors_chooses_from_its_leaves(monkeypatch):
    """A ``partition`` of ``multi_steps`` over DTensors: its label function runs once per
    params structure and leaf shapes, the shapes remembered per spec objects (no shape read
    per leaf and step); each label's choice is made from the partition's leaves
    (``Switch.choose_leaves``: no tree built for it); and params of other shapes under the
    same keys are labelled again, and stepped as their new labels say. (Labels'
    ``multi_steps`` of different ``every_k``: each label's own; with one ``every_k`` the
    partition runs as ``multi_steps`` of a partition, its state converted each call.)"""
    from functional_train import combine

    calls = []

    def labels(p):
        calls.append(1)
        return {k: "a" if v.shape[0] == 5 else "b" for k, v in p.items()}

    with simulate(2):
        mesh = make_mesh((2,), ("tp",))
        params = _tree(mesh)
        tx = ft.partition(
            {"a": ft.multi_steps(ft.sgd(0.5), 2), "b": ft.multi_steps(ft.scale(0.0), 1)}, labels
        )
        state = tx.init(params)
        rebuilt = []
        real = combine.tree_unflatten
        monkeypatch.setattr(
            combine, "tree_unflatten", lambda d, xs: rebuilt.append(1) or real(d, xs)
        )
        shapes = []
        monkeypatch.setattr(
            combine, "_shapes", lambda xs: shapes.append(1) or tuple(x.shape for x in xs)
        )
        before = {k: v.full_tensor() for k, v in params.items()}
        grads = [_tree(mesh, seed=s) for s in (1, 2)]
        for g in grads:
            params, state = ft.step(tx, g, state, params, donate=True)
        assert calls == [1] and rebuilt == [] and shapes == []
        for k, v in params.items():
            mean = (grads[0][k].full_tensor() + grads[1][k].full_tensor()) / 2
            want = before[k] - 0.5 * mean if k.startswith("w") else before[k]
            torch.testing.assert_close(v.full_tensor(), want, rtol=1e-6, atol=1e-6)
        # other shapes under the same keys: labelled again (the b leaves now "a")
        other = {
            k: shard(torch.randn(5 if k.startswith("b") else 4, 3), mesh, [Shard(0)])
            for k in params
        }
        state = tx.init(other)
        assert len(calls) == 2
        start = {k: v.full_tensor() for k, v in other.items()}
        g = {k: shard(torch.ones(v.shape), mesh, [Shard(0)]) for k, v in other.items()}
        for _ in range(2):
            other, state = ft.step(tx, g, state, other, donate=True)
        for k, v in other.items():
            want = start[k] - 0.5 if k.startswith("b") else start[k]
            torch.testing.assert_close(v.full_tensor(), want)


def test_donated_dtensor_step_gives_its_dtensors_back():
    """A donated step on DTensors writes into their local shards and returns the same
    DTensor objects (no new wrapper per leaf); a pure step returns new ones, the inputs
    unchanged."""
    with simulate(2):
        mesh = make_mesh((2,), ("tp",))
        params, grads = _tree(mesh), _tree(mesh, seed=1)
        tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2))
        before = {k: v.full_tensor() for k, v in params.items()}
        state = tx.init(params)
        pure, pure_state = ft.step(tx, grads, state, params)
        assert all(pure[k] is not params[k] for k in params)
        assert all(torch.equal(params[k].full_tensor(), before[k]) for k in params)
        new, new_state = ft.step(tx, _tree(mesh, seed=1), state, params, donate=True)
        assert all(new[k] is params[k] for k in params)
        for k in params:
            assert torch.equal(new[k].full_tensor(), pure[k].full_tensor())
        # (wraps_like: a DTensor whose own shard is the result is given back; another shard
        # gets a new DTensor of its layout)
        xs = list(params.values())
        locals_ = [x._local_tensor for x in xs]
        assert all(a is b for a, b in zip(engine_dtensor.wraps_like(locals_, xs), xs))
        other = [loc * 1 for loc in locals_]
        got = engine_dtensor.wraps_like([locals_[0], *other[1:]], xs)
        assert got[0] is xs[0] and all(g is not x for g, x in zip(got[1:], xs[1:]))
        assert all(
            g._local_tensor is o and g._spec is x._spec
            for g, o, x in zip(got[1:], other[1:], xs[1:])
        )


def test_chain_builds_dtensors_once(monkeypatch):
    """``chain(clip_by_global_norm, adamw)`` (5 primitives) on n DTensor leaves builds n
    DTensors for the updates and 2n for the moments, not one per leaf per primitive."""
    made = []
    real = engine_dtensor._make
    monkeypatch.setattr(engine_dtensor, "_make", lambda *a: made.append(1) or real(*a))
    with simulate(2):
        mesh = make_mesh((2,), ("tp",))
        params = _tree(mesh)
        n = len(params)
        tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1))
        state = tx.init(params)
        grads = _tree(mesh, seed=1)
        tx.update(grads, state, params)  # the plan and the spec caches are built
        made.clear()
        u, state = tx.update(grads, state, params)
        assert len(made) == 3 * n, len(made)
        assert all(
            type(x) is DTensor and x.placements == params[k].placements for k, x in u.items()
        )


@pytest.mark.usefixtures("recognised_path")
@pytest.mark.parametrize("donate", [False, True])
def test_step_takes_the_fused_kernel(monkeypatch, donate):
    """``ft.step(chain(clip_by_global_norm, adamw))`` runs one fused kernel call for every
    leaf: ``torch._fused_adamw_`` in place with ``donate=True`` (the results then live in the
    params' and moments' own buffers), on copies of them for a pure step (the path CUDA
    takes)."""
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(
        torch, "_fused_adamw_", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k)
    )
    gen = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(5, 3, generator=gen),
        "b": torch.randn(3, generator=gen),
        "frozen": torch.randn(2, generator=gen),
    }
    tx = ft.chain(ft.clip_by_global_norm(0.1), ft.adamw(1e-2, weight_decay=0.1))
    state = tx.init(params)
    grads = {
        "w": torch.randn(5, 3, generator=gen),
        "b": torch.randn(3, generator=gen),
        "frozen": None,
    }
    want_u, want_s = tx.update(grads, state, params)
    want_p = ft.apply_updates({k: v.clone() for k, v in params.items()}, want_u)
    w_buf, mu_buf = params["w"].data_ptr(), state[1][0].mu["w"].data_ptr()
    new_p, new_s = ft.step(tx, dict(grads), state, params, donate=donate)
    assert calls == [2]
    torch.testing.assert_close(new_p, want_p, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(new_s[1][0].mu, want_s[1][0].mu, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(new_s[0].global_norm, want_s[0].global_norm)
    assert int(new_s[1][0].count) == 1
    # the frozen leaf: its own tensor; from a pure step recorded as shared (a later donated
    # step copies it before writing, so that it cannot write into the caller's tree)
    assert new_p["frozen"] is params["frozen"]
    assert is_shared(new_p["frozen"]) != donate
    assert torch.equal(new_p["frozen"], params["frozen"])
    shared = new_p["w"].data_ptr() == w_buf and new_s[1][0].mu["w"].data_ptr() == mu_buf
    assert shared == donate


def test_step_general_path_for_other_transforms(monkeypatch):
    """A transform without a fused kernel (lamb; adamw with bfloat16 params, whose moments are
    float32) takes the general path with the same numbers as update + apply_updates."""
    monkeypatch.setattr(torch, "_fused_adamw_", None)  # would raise if called
    gen = torch.Generator().manual_seed(1)
    for tx, dtype in ((ft.lamb(1e-2), torch.float32), (ft.adamw(1e-2), torch.bfloat16)):
        params = {"w": torch.randn(4, 3, generator=gen).to(dtype)}
        grads = {"w": torch.randn(4, 3, generator=gen).to(dtype)}
        state = tx.init(params)
        u, s = tx.update(grads, state, params)
        p, s2 = ft.step(tx, grads, state, params)
        torch.testing.assert_close(p, ft.apply_updates(params, u), rtol=0, atol=0)


def test_pure_step_reuses_only_dropped_results(monkeypatch):
    """The pure fused step writes its results into pooled CPU buffers: the results of two
    steps ago, once the caller has dropped them, are reused (no fresh pages per step), and a
    result the caller still holds -- the tensor itself, a view of it, or its data in another
    tree -- is never written. (Small leaves are pooled here: the threshold is lowered.)"""
    from functional_train.engine import pool

    monkeypatch.setattr(pool, "MIN_MEAN_BYTES", 0)
    ft.engine.plan.cache_clear()
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1))
    state = tx.init(params)
    grads = [{"w": torch.randn(6, 5), "b": torch.randn(5)} for _ in range(6)]
    ptrs = []
    for g in grads[:4]:  # a training loop: the old results are dropped
        params, state = ft.step(tx, g, state, params)
        ptrs.append(params["w"].data_ptr())
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[0] != ptrs[1]
    # the caller keeps results (a view, a copy of the tree): those buffers stay untouched
    kept_view = params["w"][1:]
    kept_mu = state[1][0].mu["w"]
    snapshot = (kept_view.clone(), kept_mu.clone())
    ref_p, ref_s = params, state
    for g in grads[4:]:
        params, state = ft.step(tx, g, state, params)
        ref_p, ref_s = ft.step(tx, g, ref_s, {k: v.clone() for k, v in ref_p.items()})
    torch.testing.assert_close(kept_view, snapshot[0], rtol=0, atol=0)
    torch.testing.assert_close(kept_mu, snapshot[1], rtol=0, atol=0)
    assert params["w"].data_ptr() not in (kept_view.data_ptr() - 5 * 4, kept_mu.data_ptr())
    torch.testing.assert_close(params["w"], ref_p["w"], rtol=0, atol=0)


def test_apply_updates_reuses_only_dropped_results(monkeypatch):
    """``apply_updates``' new parameters come from the pool of the leaves' plan, as a pure
    step's results: in a loop ``params = apply_updates(params, updates)`` the parameters of two
    calls ago, once dropped, are reused (no fresh pages per call), and parameters the caller
    still holds (the tensor, a view of it, an ``nn.Parameter``'s tree) are never written; the
    values are ``params + updates`` exactly. (Small leaves are pooled here.)"""
    from functional_train.engine import pool

    monkeypatch.setattr(pool, "MIN_MEAN_BYTES", 0)
    ft.engine.plan.cache_clear()
    torch.manual_seed(0)
    params = {"w": torch.randn(6, 5), "b": torch.randn(5)}
    updates = [{"w": torch.randn(6, 5), "b": torch.randn(5)} for _ in range(7)]
    ptrs = []
    for u in updates[:4]:
        want = {k: params[k] + u[k] for k in params}
        params = ft.apply_updates(params, u)
        ptrs.append(params["w"].data_ptr())
        for k in params:
            assert torch.equal(params[k], want[k])
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[0] != ptrs[1]
    kept = params
    kept_view = params["w"][1:]
    snapshot = {k: v.clone() for k, v in kept.items()}
    for u in updates[4:]:
        want = {k: params[k] + u[k] for k in params}
        params = ft.apply_updates(params, u)
        for k in params:
            assert torch.equal(params[k], want[k])
    for k in kept:
        assert torch.equal(kept[k], snapshot[k])
    assert torch.equal(kept_view, snapshot["w"][1:])
    # (parameters that require grad: new leaves that require grad, from the pool too)
    leaves = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    for u in updates[:3]:
        want = {k: leaves[k].detach() + u[k] for k in leaves}
        leaves = ft.apply_updates(leaves, u)
        for k in leaves:
            assert leaves[k].requires_grad and leaves[k].is_leaf
            assert torch.equal(leaves[k].detach(), want[k])


def test_pooled_buffer_with_a_live_lazy_clone_is_not_taken(monkeypatch):
    """``pool.lazy_clones`` records the latest clone of each data address: a pooled buffer
    that clone reads is not handed out again while it lives (writing the buffer would copy
    it), it is once it is gone; a clone of a clone is recorded in its place (one record per
    address); an older clone the record no longer holds keeps its values when the buffer is
    taken and written (the write copies: a miss costs a copy, never a wrong value)."""
    from functional_train.engine import pool

    if not pool.LAZY_CLONES:
        pytest.skip("this torch has no lazy clones")
    monkeypatch.setattr(pool, "MIN_MEAN_BYTES", 0)
    p = pool.Pool()
    like = [torch.empty(64), torch.empty(3, 5)]
    first = p.take("x", like)
    first[0].copy_(torch.arange(64, dtype=torch.float32))
    ptrs = [x.data_ptr() for x in first]
    clones = pool.lazy_clones(first)
    assert all(torch._C._is_cow_tensor(c) for c in clones)
    del first
    second = p.take("x", like)  # (first's buffers are read by the clones: a new set)
    assert [x.data_ptr() for x in second] != ptrs
    del second
    latest = clones
    for _ in range(3):  # (clones of clones, each replacing the one before: one record each)
        latest = pool.lazy_clones(latest)
    recorded = pool._COW_CLONES[ptrs[0]]() is latest[0]  # (no reference kept by an assert)
    assert recorded
    bufs = p.sets["x"][0][0]  # (the first set's buffers, as the pool holds them)
    assert [b.const_data_ptr() for b in bufs] == ptrs  # (reading the address copies nothing)
    assert not any(map(pool._free, bufs))  # (the latest lives: not taken)
    del bufs
    older = clones[0]
    del clones, latest
    third = p.take("x", like)  # (the record's clone is gone: the first set again)
    assert [x.const_data_ptr() for x in third] == ptrs
    third[0].fill_(1.0)  # (an older clone lives: the write copies, the clone keeps its values)
    assert third[0].data_ptr() != ptrs[0]
    torch.testing.assert_close(older, torch.arange(64, dtype=torch.float32), rtol=0, atol=0)
    del older, third
    fourth = p.take("x", like)  # (no clone at all now: written where it lies)
    fourth[1].fill_(2.0)
    assert fourth[1].data_ptr() == ptrs[1]
