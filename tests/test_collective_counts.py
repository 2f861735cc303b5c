"""Collective counts: O(1) collectives per update, whatever the number of leaves.

* ``clip_by_global_norm`` over a whole tree of DTensors with mixed placements is ONE scalar
  all-reduce;
* elementwise optimizers (``adamw``) on already-reduced gradients issue none;
* ``multi_steps(chain(clip_by_global_norm, adamw), k)`` with gradients unreduced over the data
  axis is the functional ``no_sync``: the non-final micro-steps issue no collective and leave
  the inner state alone, the final one issues exactly one bucketed data-axis mean for all leaves
  plus the norm's scalar.

Runs in one process on a simulated 2x2 mesh (``functional_train.testing.simulate``).
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.testing import count_collectives, on_rank, per_rank, simulate

WORLD = 4

# (mesh: "full" | a sub-mesh dim name | "plain", placements, shape): every kind of leaf of a
# 2 x 2 ("dp", "tp") mesh, uneven and empty shards included
_KINDS = [
    ("full", (Shard(0), Shard(1)), (5, 3)),
    ("full", (Shard(0), Shard(0)), (7,)),
    ("full", (Replicate(), Shard(-1)), (2, 3)),
    ("full", (Replicate(), Replicate()), (3,)),
    ("tp", (Shard(0),), (1, 4)),
    ("tp", (Replicate(),), (2, 2)),
    ("dp", (Shard(1),), (2, 5)),
    ("plain", None, (3,)),
]


def _replicated(x):
    return per_rank(WORLD, lambda r: x)


def _leaf(m, kind, value):
    home, pl, _ = kind
    if home == "plain":
        return _replicated(value)
    dm = m if home == "full" else m[home]
    return distribute_tensor(_replicated(value), dm, list(pl), src_data_rank=None)


def _values(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(_KINDS[i % len(_KINDS)][2], generator=gen) for i in range(n)]


def _tree(m, values):
    return {f"l{i:02d}": _leaf(m, _KINDS[i % len(_KINDS)], v) for i, v in enumerate(values)}


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _locals(tree):
    """Every rank's local values of a tree (plain tensors), for before/after comparisons."""
    out = []
    for x in optree.tree_leaves(tree, none_is_leaf=True):
        if x is None:
            out.append(None)
            continue
        loc = x._local_tensor if isinstance(x, DTensor) else x
        out.append([on_rank(loc, r).clone() for r in range(WORLD)])
    return out


@pytest.mark.parametrize("explicit_mesh", [True, False])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_by_global_norm_is_one_all_reduce_for_50_leaves(norm_type, explicit_mesh):
    vals = _values(50)
    want = torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in vals]), norm_type)
    with simulate(WORLD):
        m = _mesh()
        grads = _tree(m, vals)
        tx = ft.clip_by_global_norm(1.0, norm_type=norm_type)
        state = tx.init(grads)
        with count_collectives() as c:
            _, state = tx.update(grads, state, grads, mesh=ft.Mesh(m) if explicit_mesh else None)
        norms = [on_rank(state.global_norm, r) for r in range(WORLD)]
    assert c.counts == {"all_reduce": 1}, c
    for r in range(WORLD):
        torch.testing.assert_close(norms[r], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_kind", ["none", "mesh", "data_axis_reduced"])
def test_adamw_issues_no_collective_on_reduced_grads(mesh_kind):
    """Reduced gradients: DTensors (any placements, on the mesh or a sub-mesh) and replicated
    plain tensors without a data axis; with ``data_axis="dp"``, DTensors on the whole mesh
    (their placement over dp says they are already reduced: FSDP-style ``Shard`` or
    ``Replicate``)."""
    n = 8
    with simulate(WORLD):
        m = _mesh()
        if mesh_kind == "data_axis_reduced":
            kinds = [k for k in _KINDS if k[0] == "full"]
            gen = torch.Generator().manual_seed(1)
            vals = [torch.randn(kinds[i % len(kinds)][2], generator=gen) for i in range(n)]
            params = {f"l{i}": _leaf(m, kinds[i % len(kinds)], v) for i, v in enumerate(vals)}
            grads = {
                k: _leaf(m, kinds[i % len(kinds)], v * 0.1)
                for i, (k, v) in enumerate(zip(params, vals))
            }
            mesh = ft.Mesh(m, data_axis="dp")
        else:
            params = _tree(m, _values(n, seed=1))
            grads = _tree(m, _values(n, seed=2))
            mesh = None if mesh_kind == "none" else ft.Mesh(m)
        tx = ft.adamw(1e-2, weight_decay=0.1, amsgrad=True)
        state = tx.init(params)
        with count_collectives() as c:
            u, state = tx.update(grads, state, params, mesh=mesh)
            ft.apply_updates(params, u)
    assert c.total == 0, c


def _unreduced_grads(m, n, with_partial=False):
    """Per-dp-rank contributions: plain tensors and DTensors on the tp sub-mesh (unreduced over
    dp), optionally Partial over tp as well (then one contribution per rank)."""
    gen = torch.Generator().manual_seed(3)
    kinds = [
        ("plain", None, (3,)),
        ("tp", (Shard(0),), (5, 2)),
        ("tp", (Replicate(),), (2,)),
        ("tp", (Shard(-1),), (2, 1)),
    ]
    if with_partial:
        kinds.append(("tp_partial", (Partial(),), (3, 2)))
    out = {}
    for i in range(n):
        home, pl, shape = kinds[i % len(kinds)]
        contrib = [torch.randn(shape, generator=gen) for _ in range(WORLD)]
        if home == "plain":
            out[f"l{i:02d}"] = per_rank(WORLD, lambda r: contrib[r // 2])
        elif home == "tp_partial":
            full = torch.empty(shape)
            out[f"l{i:02d}"] = DTensor.from_local(
                per_rank(WORLD, lambda r: contrib[r]),
                m["tp"],
                [Partial()],
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
        else:
            out[f"l{i:02d}"] = distribute_tensor(
                per_rank(WORLD, lambda r: contrib[r // 2]), m["tp"], list(pl), src_data_rank=None
            )
    return out, kinds


def _params_like(m, n, kinds):
    gen = torch.Generator().manual_seed(5)
    out = {}
    for i in range(n):
        home, pl, shape = kinds[i % len(kinds)]
        v = torch.randn(shape, generator=gen)
        if home == "plain":
            out[f"l{i:02d}"] = _replicated(v)
        elif home == "tp_partial":
            out[f"l{i:02d}"] = distribute_tensor(
                _replicated(v), m["tp"], [Replicate()], src_data_rank=None
            )
        else:
            out[f"l{i:02d}"] = distribute_tensor(
                _replicated(v), m["tp"], list(pl), src_data_rank=None
            )
    return out


@pytest.mark.parametrize("n_leaves", [3, 12])
def test_multi_steps_no_sync_then_three_all_reduces(n_leaves):
    """Non-final micro-steps issue nothing; the final one: the presence agreement over dp (a
    few int64 per leaf: which ranks have which gradient), the dp mean, the clip norm."""
    k = 4
    with simulate(WORLD):
        m = _mesh()
        mesh = ft.Mesh(m, data_axis="dp")
        grads, kinds = _unreduced_grads(m, n_leaves)  # the same micro-batch gradients each time
        params = _params_like(m, n_leaves, kinds)
        tx = ft.multi_steps(
            ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1)), k
        )
        state = tx.init(params)
        counts = []
        for step in range(k):
            inner_before = _locals(state.inner_state)
            with count_collectives() as c:
                u, state = tx.update(grads, state, params, mesh=mesh)
            counts.append(c.counts)
            final = (step + 1) % k == 0
            assert bool(on_rank(ft.has_updated(state), 0)) == final
            if not final:
                assert _same(_locals(state.inner_state), inner_before), (
                    f"micro-step {step}: inner_state changed"
                )
                for x in optree.tree_leaves(u):
                    loc = x._local_tensor if isinstance(x, DTensor) else x
                    assert all(torch.count_nonzero(on_rank(loc, r)) == 0 for r in range(WORLD))
    for step, cnt in enumerate(counts):
        if (step + 1) % k:
            assert cnt == {}, f"micro-step {step}: {cnt}"
        else:
            assert cnt == {"all_reduce": 3}, f"final micro-step {step}: {cnt}"


def _same(a, b) -> bool:
    return all(
        (x is None and y is None) or all(torch.equal(p, q) for p, q in zip(x, y))
        for x, y in zip(a, b)
    )


def test_multi_steps_count_does_not_grow_with_leaves_with_partial_grads():
    """With ``Partial`` (over tp) gradients next to the data-axis ones, the final micro-step's
    count is the same for 5 and 10 leaves (one bucket per process group), and the non-final
    micro-steps still issue nothing."""
    k = 2
    per_n = {}
    for n in (5, 10):
        with simulate(WORLD):
            m = _mesh()
            mesh = ft.Mesh(m, data_axis="dp")
            grads, kinds = _unreduced_grads(m, n, with_partial=True)
            params = _params_like(m, n, kinds)
            tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2)), k)
            state = tx.init(params)
            counts = []
            for _step in range(k):
                with count_collectives() as c:
                    _, state = tx.update(grads, state, params, mesh=mesh)
                counts.append(c.counts)
        per_n[n] = counts
    assert per_n[5][0] == per_n[10][0] == {}
    assert per_n[5][1] == per_n[10][1], per_n
    # presence over dp + dp mean + tp Partial sum + norm
    assert per_n[5][1] == {"all_reduce": 4}, per_n


def _label_norm(vals, labels, label, norm_type):
    own = [v.reshape(-1) for v, lab in zip(vals, labels) if lab == label]
    return torch.linalg.vector_norm(torch.cat(own), norm_type)


@pytest.mark.parametrize(
    "how", ["update", "donated", "pure", "multi_steps", "shared_clip", "apply_if_finite"]
)
def test_partition_clips_are_one_all_reduce(how):
    """``partition`` of chains that each start with ``clip_by_global_norm``: the labels' norms
    are started together (``Elementwise.starts``) and coalesced into ONE scalar all-reduce
    per step (two before), each label's norm over its own leaves, several steps; the same
    clip object in both labels too. Norms of different kinds (a 2-norm and an inf-norm:
    sum and max) stay two all-reduces."""
    n = 10
    vals = _values(n, seed=3)
    pvals = _values(n, seed=4)
    labels = ["a" if i % 3 else "b" for i in range(n)]
    clip = ft.clip_by_global_norm(0.5)
    clip_b = clip if how == "shared_clip" else ft.clip_by_global_norm(2.0)
    inner = {
        "a": ft.chain(clip, ft.adamw(1e-2, weight_decay=0.1)),
        "b": ft.chain(clip_b, ft.adamw(3e-2)),
    }
    if how == "apply_if_finite":  # (its first part is the clip's, wrapped: starts passed on)
        inner["a"] = ft.apply_if_finite(inner["a"], max_consecutive_errors=3)
    k = 2 if how == "multi_steps" else 1
    if k > 1:
        inner = {lab: ft.multi_steps(t, k) for lab, t in inner.items()}
    steps = 3 * k
    # (multi_steps: DTensors on the whole mesh, which its fused micro-steps take; with the
    # other kinds of leaves the partition runs each label's multi_steps by its own update)
    kinds = [x for x in _KINDS if x[0] == "full"] if k > 1 else _KINDS
    with simulate(WORLD):
        m = _mesh()
        params = {f"l{i:02d}": _leaf(m, kinds[i % len(kinds)], v) for i, v in enumerate(pvals)}
        grads = {f"l{i:02d}": _leaf(m, kinds[i % len(kinds)], v) for i, v in enumerate(vals)}
        tx = ft.partition(inner, {f"l{i:02d}": lab for i, lab in enumerate(labels)})
        state = tx.init(params)
        counts = []
        for step in range(steps):
            with count_collectives() as c:
                if how == "update":
                    u, state = tx.update(grads, state, params, mesh=ft.Mesh(m))
                    params = ft.apply_updates(params, u)
                else:
                    params, state = ft.step(
                        tx, grads, state, params, mesh=ft.Mesh(m), donate=how != "pure"
                    )
            counts.append(c.counts)
            if (step + 1) % k == 0:
                for lab in "ab":
                    inner_state = state.inner_states[lab]
                    if k > 1 or (how == "apply_if_finite" and lab == "a"):
                        inner_state = inner_state.inner_state
                    got = on_rank(inner_state[0].global_norm, step % WORLD)
                    want = _label_norm([v * k for v in vals] if k > 1 else vals, labels, lab, 2)
                    if k > 1:
                        want = want / k  # (the mean of k equal micro-batch gradients)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for step, cnt in enumerate(counts):
        if (step + 1) % k:
            assert cnt == {}, f"step {step}: {cnt}"
        else:
            assert cnt == {"all_reduce": 1}, f"step {step}: {cnt}"
    # a 2-norm and an inf-norm: a sum and a max, one all-reduce each
    with simulate(WORLD):
        m = _mesh()
        params = _tree(m, pvals)
        grads = _tree(m, vals)
        tx = ft.partition(
            {
                "a": ft.chain(ft.clip_by_global_norm(0.5), ft.sgd(1e-2)),
                "b": ft.chain(ft.clip_by_global_norm(0.5, norm_type=math.inf), ft.sgd(1e-2)),
            },
            {f"l{i:02d}": lab for i, lab in enumerate(labels)},
        )
        state = tx.init(params)
        with count_collectives() as c:
            params, state = ft.step(tx, grads, state, params, mesh=ft.Mesh(m), donate=True)
        got = on_rank(state.inner_states["b"][0].global_norm, 1)
    assert c.counts == {"all_reduce": 2}, c
    torch.testing.assert_close(got, _label_norm(vals, labels, "b", math.inf))


def _full(x, rank=0):
    return on_rank(x.full_tensor() if isinstance(x, DTensor) else x, rank)


def test_partition_of_lambs_trust_ratios_are_coalesced():
    """``partition`` of two ``lamb`` transforms: each label's trust-ratio norms (per-leaf sums
    of its parameters' and updates' squares) are started together and coalesced
    (``Elementwise.starts``): a step issues as many all-reduces as ONE lamb over every leaf
    (twice as many before), and each label's result is its lamb on its own leaves, unsharded,
    over three steps, on every kind of leaf of the mesh."""
    n = 10
    pvals = _values(n, seed=6)
    gvals = [_values(n, seed=10 + s) for s in range(3)]
    labels = ["a" if i % 3 else "b" for i in range(n)]
    inner = {"a": ft.lamb(1e-2, weight_decay=0.1), "b": ft.lamb(3e-2)}
    want = {}
    for lab in "ab":
        own = [i for i in range(n) if labels[i] == lab]
        p = {f"l{i:02d}": pvals[i].clone() for i in own}
        state = inner[lab].init(p)
        for g in gvals:
            u, state = inner[lab].update({f"l{i:02d}": g[i] for i in own}, state, p)
            p = ft.apply_updates(p, u)
        want.update(p)
    with simulate(WORLD):
        m = _mesh()
        params = _tree(m, pvals)
        tx = ft.partition(inner, {f"l{i:02d}": lab for i, lab in enumerate(labels)})
        state = tx.init(params)
        counts = []
        for g in gvals:
            with count_collectives() as c:
                params, state = ft.step(
                    tx, _tree(m, g), state, params, mesh=ft.Mesh(m), donate=True
                )
            counts.append(c.counts)
        single = ft.lamb(1e-2)
        one = _tree(m, pvals)
        with count_collectives() as c:
            ft.step(single, _tree(m, gvals[0]), single.init(one), one, mesh=ft.Mesh(m), donate=True)
        got = {k: [_full(v, r) for r in range(WORLD)] for k, v in params.items()}
    assert c.counts and all(cnt == c.counts for cnt in counts), (counts, c.counts)
    for k, v in want.items():
        change = v - pvals[int(k[1:])]
        assert float(change.abs().max()) > 1e-4
        for r in range(WORLD):
            torch.testing.assert_close(got[k][r] - pvals[int(k[1:])], change, rtol=1e-5, atol=1e-7)


def test_started_collectives_not_taken_are_waited():
    """``Elementwise.starts``: the run issues every part's collective of a stage together,
    also one whose prologue does not take it (a wrapper that hands its part another view
    would not), and waits for that one itself; the parts' results are as without it.
    Outside a run :func:`started` gives ``None``."""
    import dataclasses

    from functional_train.engine import elementwise as E
    from functional_train.engine.view import prepare

    n = 6
    vals = _values(n, seed=5)
    labels = [i % 2 == 0 for i in range(n)]
    clip = E.spec_of_transform(ft.clip_by_global_norm(0.5))

    def untaken(state, b):  # (the factor 1: the updates pass as they are)
        return (torch.ones(()),), lambda trees: state

    def on(mask):  # (a restricted part passes the other leaves through: by their key)
        return dict(
            restrict=lambda p: mask,
            static=lambda p: mask,
            leaf=lambda u, p, s, h, k: (u * h[0] if k else u, ()),
        )

    others = [not x for x in labels]
    parts = (
        dataclasses.replace(clip, prologue=untaken, **on(labels)),
        dataclasses.replace(clip, **on(others)),
    )
    fus = E.Fusable(parts, list, tuple)
    with simulate(WORLD):
        m = _mesh()
        grads = _tree(m, vals)
        state = (ft.ClipByGlobalNormState(torch.zeros(())),) * 2
        b = prepare(grads, grads, ft.Mesh(m))
        assert E.started(clip.starts, b) is None
        with count_collectives() as c:
            updates, new_state = E.run(fus, b, state, grads)
        got = [
            on_rank(x._local_tensor if isinstance(x, DTensor) else x, 0)
            for x in optree.tree_leaves(updates)
        ]
        norm_b = on_rank(new_state[1].global_norm, 2)
        want_local = [
            on_rank(x._local_tensor if isinstance(x, DTensor) else x, 0)
            for x in optree.tree_leaves(grads)
        ]
    assert c.counts == {"all_reduce": 1}, c
    want_norm = _label_norm(vals, labels, False, 2)
    torch.testing.assert_close(norm_b, want_norm, rtol=1e-5, atol=1e-6)
    factor = min(1.0, 0.5 / (float(want_norm) + 1e-6))
    for i, (x, w) in enumerate(zip(got, want_local)):
        torch.testing.assert_close(x, w if labels[i] else w * factor, rtol=1e-5, atol=1e-7)


def test_coalesced_all_reduces():
    """``engine.collectives.coalesced``: the all-reduces started within are issued at the
    first ``finish``, one per (group, op, dtype): two sums and a max are two all-reduces,
    each ``finish`` its own value; one started after that is issued at once (a third)."""
    from functional_train.engine.collectives import all_reduce_start, coalesced, groups_over

    with simulate(WORLD):
        m = _mesh()
        world = groups_over(m, [0, 1])
        a = per_rank(WORLD, lambda r: torch.tensor(float(r)))
        b = per_rank(WORLD, lambda r: torch.tensor([[1.0, r], [2.0 * r, 3.0]]))
        c = per_rank(WORLD, lambda r: torch.tensor(float(10 - r)))
        d = per_rank(WORLD, lambda r: torch.tensor(2.0))
        with count_collectives() as cnt:
            with coalesced():
                fa = all_reduce_start(a, "sum", world)
                fb = all_reduce_start(b, "sum", world)
                fc = all_reduce_start(c, "max", world)
                got_b = fb()  # (issues all three)
                fd = all_reduce_start(d, "sum", world)  # (after: issued at once)
                got = [fa(), got_b, fc(), fd()]
        vals = [[on_rank(x, r) for r in range(WORLD)] for x in got]
    assert cnt.counts == {"all_reduce": 3}, cnt
    want = [
        torch.tensor(6.0),
        torch.tensor([[4.0, 6.0], [12.0, 12.0]]),
        torch.tensor(10.0),
        torch.tensor(8.0),
    ]
    for per, w in zip(vals, want):
        for v in per:
            torch.testing.assert_close(v, w)
