"""ZeRO-1/2: ``zero_redundancy(inner, axis="dp")``.

1. Sharded == unsharded: every optimizer alias under ZeRO over dp=2 x tp=2 (uneven tensor
   parallel shards, a leaf with no free dim, a 0-dim plain leaf, a leaf of size 1) with
   per-replica gradients equals the one-process run over several steps: parameters, updates and
   the gathered inner state.
2. Pure data parallelism on plain tensors (4 ranks), ``Partial``-over-dp gradients, FSDP-style
   parameters already sharded over dp, gradients reduced before zero_redundancy.
3. Per-rank state bytes are about 1/dp of the unsharded state.
4. Collectives: one reduce-scatter in, one all-gather out (whatever the number of leaves),
   plus the inner transform's own; inside multi_steps, non-final micro-steps issue none.
5. One process: zero_redundancy(inner) is inner. Bad input raises clear errors.
"""

from __future__ import annotations

import optree
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.testing import count_collectives, gather, per_rank, simulate
from functional_train.zero import ZeroRedundancyState, zero_redundancy

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()

# leaf -> (shape, placements over the "tp" sub-mesh, None: plain tensor)
LEAVES = {
    "wq": ((5, 7), [S0]),  # colwise: dp shards dim 1
    "wo": ((7, 5), [S1]),  # rowwise: dp shards dim 0
    "t": ((3, 5, 6), [S2]),  # 3-D
    "bias": ((7,), [S0]),  # no free dim: state stays whole over dp
    "norm": ((6,), None),  # plain tensor: dp shards it
    "row": ((1, 3), [R]),  # dim 0 of size 1: dp shards dim 1 (uneven)
    "s": ((), None),  # 0-dim
}


def _problem(steps, seed=0, leaves=LEAVES):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, (s, _) in leaves.items()}
    # per step: the mean gradient, and a per-replica deviation that averages out over dp=2
    grads = [
        {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, (s, _) in leaves.items()}
        for _ in range(steps)
    ]
    noise = [
        {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, (s, _) in leaves.items()}
        for _ in range(steps)
    ]
    return params, grads, noise


def _reference(make_tx, params, grads):
    tx = make_tx()
    state = tx.init(params)
    out = []
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = ft.apply_updates(params, updates)
        out.append((params, updates))
    return out, state


def _dp_coord(rank):
    return rank // 2  # mesh (dp, tp) = (2, 2): ranks 0, 1 are dp 0; ranks 2, 3 are dp 1


def _place(x, mesh, pl):
    return x if pl is None else distribute_tensor(x, mesh["tp"], pl, src_data_rank=None)


def _sharded(make_tx, params, grads, noise, leaves=LEAVES, zero_kwargs=None):
    """Run zero_redundancy(make_tx()) on dp=2 x tp=2 with per-replica gradients."""
    out = []
    with simulate(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        p = {
            k: _place(per_rank(4, lambda r, v=v: v), mesh, leaves[k][1]) for k, v in params.items()
        }
        tx = zero_redundancy(make_tx(), **(zero_kwargs or {}))
        state = tx.init(p)
        fmesh = ft.Mesh(mesh, data_axis="dp")
        for g, n in zip(grads, noise):
            # replica dp=c contributes g + (2c - 1) n: the mean over dp is g
            dg = {
                k: _place(
                    per_rank(4, lambda r, k=k: g[k] + (2 * _dp_coord(r) - 1) * n[k]),
                    mesh,
                    leaves[k][1],
                )
                for k in g
            }
            updates, state = tx.update(dg, state, p, mesh=fmesh)
            for k in p:
                assert type(updates[k]) is type(p[k]), k
                if isinstance(p[k], DTensor):
                    assert updates[k].placements == p[k].placements, k
            p = ft.apply_updates(p, updates)
            out.append((gather(p), gather(updates)))
        final_state = gather(state)
        local_bytes = _state_bytes(state, local=True)
    return out, final_state, local_bytes


def _state_bytes(state, local):
    from torch.distributed._local_tensor import LocalTensor

    total = 0
    for x in optree.tree_leaves(state):
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            continue
        t = x._local_tensor if isinstance(x, DTensor) else x
        if local and isinstance(t, LocalTensor):
            t = t._local_tensors[0]
        total += t.numel() * t.element_size()
    return total


ALIASES = {
    "adamw": lambda: ft.adamw(1e-2, weight_decay=0.1),
    "clip_adam": lambda: ft.chain(ft.clip_by_global_norm(0.5), ft.adam(1e-2)),
    "adafactor": lambda: ft.adafactor(beta1=0.9, weight_decay=0.01),
    "came": lambda: ft.came(1e-2, weight_decay=0.01),
    "lamb": lambda: ft.lamb(1e-2, weight_decay=0.01),
    "sgd": lambda: ft.sgd(1e-1, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", list(ALIASES))
def test_zero_equals_unsharded(name):
    make_tx = ALIASES[name]
    params, grads, noise = _problem(3)
    ref, ref_state = _reference(make_tx, params, grads)
    got, state, _ = _sharded(make_tx, params, grads, noise)
    for step, ((rp, ru), (gp, gu)) in enumerate(zip(ref, got)):
        for k in params:
            torch.testing.assert_close(
                gu[k],
                ru[k],
                rtol=1e-9,
                atol=1e-12,
                msg=lambda m: f"{name} step {step} update {k}: {m}",
            )
            torch.testing.assert_close(gp[k], rp[k], rtol=1e-9, atol=1e-12)
    # the inner state, gathered from the zero view, is the unsharded state
    assert isinstance(state, ZeroRedundancyState)
    ref_leaves, ref_def = optree.tree_flatten(ref_state, none_is_leaf=True)
    got_leaves, got_def = optree.tree_flatten(state.inner_state, none_is_leaf=True)
    assert got_def == ref_def
    for a, b in zip(got_leaves, ref_leaves):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_state_is_sharded_over_dp():
    leaves = {"w": ((64, 32), [S0]), "v": ((32, 64), [S1]), "n": ((64,), None)}
    params, grads, noise = _problem(1, leaves=leaves)
    _, _, zero_bytes = _sharded(lambda: ft.adamw(1e-2), params, grads, noise, leaves=leaves)
    # unsharded per-rank state under tp=2 only: w and v halved by tp, n whole
    tp_bytes = 2 * 8 * (64 * 32 // 2 + 32 * 64 // 2 + 64)  # mu, nu in float64 (the params)
    assert zero_bytes == tp_bytes // 2  # every leaf has a free dim: exactly 1/dp


def test_state_placements_and_shapes():
    with simulate(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        p = {
            k: _place(per_rank(4, lambda r, s=s: torch.zeros(s)), mesh, pl)
            for k, (s, pl) in LEAVES.items()
        }
        state = zero_redundancy(ft.adam()).init(p)
        mu = state.inner_state[0].mu
        want = {
            "wq": (S1, S0),
            "wo": (S0, S1),
            "t": (S0, S2),
            "bias": (S0,),
            "norm": (S0,),
            "row": (S1, R),
        }
        for k, pl in want.items():
            assert tuple(mu[k].placements) == pl, (k, mu[k].placements)
            assert mu[k].shape == p[k].shape
        assert mu["wq"].device_mesh.mesh_dim_names == ("dp", "tp")
        assert mu["norm"].device_mesh.mesh_dim_names == ("dp",)
        assert not isinstance(mu["s"], DTensor)


def test_pure_data_parallel_plain_tensors():
    """4-rank data parallelism on plain tensors, uneven sizes: the mesh comes from device_mesh."""
    leaves = {"w": ((5, 3), None), "b": ((3,), None), "s": ((), None)}
    params, grads, noise = _problem(3, leaves=leaves)
    ref, ref_state = _reference(lambda: ft.adamw(1e-2), params, grads)
    with simulate(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        p = {k: per_rank(4, lambda r, v=v: v) for k, v in params.items()}
        tx = zero_redundancy(ft.adamw(1e-2), device_mesh=mesh)
        state = tx.init(p)
        assert state.inner_state[0].mu["w"].placements == (S0,)
        for step, (g, n) in enumerate(zip(grads, noise)):
            dg = {k: per_rank(4, lambda r, k=k: g[k] + (r - 1.5) * n[k]) for k in g}
            with count_collectives() as c:
                updates, state = tx.update(dg, state, p, mesh=ft.Mesh(mesh, data_axis="dp"))
            # + the presence agreement over dp and the whole 0-dim leaf's mean
            assert c.counts == {
                "reduce_scatter_tensor": 1,
                "all_gather_into_tensor": 1,
                "all_reduce": 2,
            }, c.counts
            p = ft.apply_updates(p, updates)
            for k in params:
                for r in range(4):
                    torch.testing.assert_close(
                        p[k]._local_tensors[r], ref[step][0][k], rtol=1e-9, atol=1e-12
                    )


def test_partial_over_dp_and_reduced_gradients():
    """Gradients Partial over dp are reduce-scattered as sums; reduced (Replicate over dp)
    gradients are sliced without communication."""
    params, grads, _ = _problem(2, leaves={"w": ((6, 4), [S0, R])})
    ref, _ = _reference(lambda: ft.adam(1e-2), params, grads)
    with simulate(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for kind in ("partial", "replicate"):
            p = {
                "w": distribute_tensor(
                    per_rank(4, lambda r: params["w"]), mesh, [R, S0], src_data_rank=None
                )
            }
            tx = zero_redundancy(ft.adam(1e-2))
            state = tx.init(p)
            for step, g in enumerate(grads):
                if kind == "partial":  # each dp rank holds half the sum
                    loc = distribute_tensor(
                        per_rank(4, lambda r: g["w"] / 2), mesh, [R, S0], src_data_rank=None
                    ).to_local()
                    dg = {"w": DTensor.from_local(loc, mesh, [Partial(), S0], run_check=False)}
                else:
                    dg = {
                        "w": distribute_tensor(
                            per_rank(4, lambda r: g["w"]), mesh, [R, S0], src_data_rank=None
                        )
                    }
                with count_collectives() as c:
                    updates, state = tx.update(dg, state, p, mesh=ft.Mesh(mesh, data_axis="dp"))
                want = {"reduce_scatter_tensor": 1} if kind == "partial" else {}
                assert c.counts == {**want, "all_gather_into_tensor": 1}, (kind, c.counts)
                p = ft.apply_updates(p, updates)
                torch.testing.assert_close(gather(p)["w"], ref[step][0]["w"], rtol=1e-9, atol=1e-12)


def test_fsdp_parameters_pass_through():
    """Parameters already sharded over dp (FSDP / ZeRO-3) keep their layout: no extra collective."""
    params, grads, _ = _problem(2, leaves={"w": ((5, 6), [S0, S1])})
    ref, _ = _reference(lambda: ft.adamw(1e-2), params, grads)
    with simulate(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        p = {
            "w": distribute_tensor(
                per_rank(4, lambda r: params["w"]), mesh, [S0, S1], src_data_rank=None
            )
        }
        tx = zero_redundancy(ft.adamw(1e-2))
        state = tx.init(p)
        assert state.inner_state[0].mu["w"].placements == (S0, S1)
        for step, g in enumerate(grads):
            dg = {
                "w": distribute_tensor(
                    per_rank(4, lambda r: g["w"]), mesh, [S0, S1], src_data_rank=None
                )
            }
            with count_collectives() as c:
                updates, state = tx.update(dg, state, p, mesh=ft.Mesh(mesh, data_axis="dp"))
            assert c.total == 0, c.counts
            p = ft.apply_updates(p, updates)
            torch.testing.assert_close(gather(p)["w"], ref[step][0]["w"], rtol=1e-9, atol=1e-12)


def _counts(make_inner, n_leaves):
    with simulate(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        kinds = [((5, 7), [S0]), ((7, 5), [S1]), ((6,), None), ((3, 5, 6), [S2])]
        spec = [kinds[i % len(kinds)] for i in range(n_leaves)]
        gen = torch.Generator().manual_seed(0)
        vals = [torch.randn(s, generator=gen) for s, _ in spec]
        p = {
            f"l{i}": _place(per_rank(4, lambda r, v=v: v), mesh, pl)
            for i, (v, (_, pl)) in enumerate(zip(vals, spec))
        }
        g = {
            k: _place(per_rank(4, lambda r, v=v: v * (1 + r)), mesh, spec[i][1])
            for i, (k, v) in enumerate(zip(p, vals))
        }
        tx = make_inner()
        state = tx.init(p)
        with count_collectives() as c:
            tx.update(g, state, p, mesh=ft.Mesh(mesh, data_axis="dp"))
    return c.counts


@pytest.mark.parametrize("n_leaves", [4, 8])
def test_collectives_constant_in_leaves(n_leaves):
    # adamw needs no statistics: the presence agreement over dp (a few int64 per leaf: which
    # ranks have which gradient), one reduce-scatter in, one all-gather out
    assert _counts(lambda: zero_redundancy(ft.adamw(1e-2)), n_leaves) == {
        "reduce_scatter_tensor": 1,
        "all_gather_into_tensor": 1,
        "all_reduce": 1,
    }
    # clipping adds its one scalar all-reduce (over the whole mesh: every leaf is now split)
    assert _counts(
        lambda: zero_redundancy(ft.chain(ft.clip_by_global_norm(1.0), ft.adamw())), n_leaves
    ) == {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1, "all_reduce": 2}
    # LAMB: its one all-reduce of the trust-ratio norms
    assert _counts(lambda: zero_redundancy(ft.lamb()), n_leaves) == {
        "reduce_scatter_tensor": 1,
        "all_gather_into_tensor": 1,
        "all_reduce": 2,
    }


def test_multi_steps_outside_zero():
    """multi_steps(zero_redundancy(...)): non-final micro-steps communicate nothing; the k-th
    reduce-scatters the accumulated mean once."""
    params, grads, noise = _problem(4)
    k = 2
    mean = [{n: (grads[2 * i][n] + grads[2 * i + 1][n]) / 2 for n in params} for i in range(2)]
    ref, _ = _reference(lambda: ft.adamw(1e-2), params, mean)
    with simulate(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        p = {
            n: _place(per_rank(4, lambda r, v=v: v), mesh, LEAVES[n][1]) for n, v in params.items()
        }
        tx = ft.multi_steps(zero_redundancy(ft.adamw(1e-2)), k)
        state = tx.init(p)
        for step, (g, nz) in enumerate(zip(grads, noise)):
            dg = {
                n: _place(
                    per_rank(4, lambda r, n=n: g[n] + (2 * _dp_coord(r) - 1) * nz[n]),
                    mesh,
                    LEAVES[n][1],
                )
                for n in g
            }
            with count_collectives() as c:
                updates, state = tx.update(dg, state, p, mesh=ft.Mesh(mesh, data_axis="dp"))
            if step % k == 0:
                assert c.total == 0, c.counts
            else:
                assert c.counts["reduce_scatter_tensor"] == 1
            p = ft.apply_updates(p, updates)
        got = gather(p)
    for n in params:
        torch.testing.assert_close(got[n], ref[-1][0][n], rtol=1e-9, atol=1e-12)


def test_one_process_is_inner():
    params, grads, _ = _problem(3)
    ref, ref_state = _reference(lambda: ft.adafactor(), params, grads)
    got, state = _reference(lambda: zero_redundancy(ft.adafactor()), params, grads)
    for (rp, _), (gp, _) in zip(ref, got):
        for k in params:
            assert torch.equal(rp[k], gp[k])
    assert optree.tree_all(
        optree.tree_map(lambda a, b: torch.equal(a, b), state.inner_state, ref_state)
    )


def test_bad_input():
    with pytest.raises(TypeError, match="inner must be a GradientTransformation"):
        zero_redundancy(ft.adamw)
    with pytest.raises(TypeError, match="axis"):
        zero_redundancy(ft.adamw(), axis=0)
    with pytest.raises(ValueError, match="expected a ZeroRedundancyState"):
        zero_redundancy(ft.adamw()).update(
            {"w": torch.ones(2)}, ft.adamw().init({"w": torch.ones(2)}), {"w": torch.ones(2)}
        )
    with simulate(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        p = {
            "w": distribute_tensor(
                per_rank(2, lambda r: torch.ones(4, 2)), mesh, [S0], src_data_rank=None
            )
        }
        with pytest.raises(ValueError, match="axis='dp' is not a dim of the device mesh"):
            zero_redundancy(ft.adamw()).init(p)


def test_plain_params_without_device_mesh_is_a_clear_error():
    """Plain-tensor parameters give init no mesh: an update on a dp mesh must say so rather than
    mix a whole-leaf state with dp-sharded views."""
    with simulate(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        p = {"w": per_rank(2, lambda r: torch.ones(4, 2))}
        tx = zero_redundancy(ft.adamw())
        state = tx.init(p)
        with pytest.raises(ValueError, match="pass the mesh at construction"):
            tx.update(p, state, p, mesh=ft.Mesh(mesh, data_axis="dp"))


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("inner", ["adamw", "multi_steps", "lamb", "foreign"])
def test_step_equals_update_and_apply(inner, donate):
    """``ft.step`` of ``zero_redundancy(inner)`` (the inner stepped on the zero view, fused
    where it is, the new parameter chunks all-gathered) gives ``update`` + ``apply_updates``'
    parameters and state over 4 steps on 4 simulated data parallel ranks, a gradient ``None``
    at one step, with the same collectives."""

    def foreign():  # no spec: ft.step runs it by its update, then p + u on the zero view
        def update(updates, state, params=None, **kw):
            return optree.tree_map(lambda u: -1e-2 * u, updates), state

        return ft.GradientTransformation(lambda params: ft.EmptyState(), update)

    makes = {
        "adamw": lambda: ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1)),
        "multi_steps": lambda: ft.multi_steps(ft.adamw(5e-2), 2),
        "lamb": lambda: ft.lamb(1e-2),
        "foreign": foreign,
    }
    leaves = {"w": ((5, 3), None), "b": ((3,), None), "s": ((), None)}
    params, grads, noise = _problem(4, leaves=leaves)
    with simulate(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        fmesh = ft.Mesh(mesh, data_axis="dp")
        runs = {}
        for how in ("update", "step"):
            p = {k: per_rank(4, lambda r, v=v: v.clone()) for k, v in params.items()}
            tx = zero_redundancy(makes[inner](), device_mesh=mesh)
            state = tx.init(p)
            counts = []
            for step, (g, n) in enumerate(zip(grads, noise)):
                dg = {k: per_rank(4, lambda r, k=k: g[k] + (r - 1.5) * n[k]) for k in g}
                if step == 2:
                    dg["b"] = None
                with count_collectives() as c:
                    if how == "update":
                        updates, state = tx.update(dg, state, p, mesh=fmesh)
                        p = ft.apply_updates(p, updates)
                    else:
                        p, state = ft.step(tx, dg, state, p, mesh=fmesh, donate=donate)
                counts.append(c.counts)
            runs[how] = (p, state, counts)
        (pu, su, cu), (ps, ss, cs) = runs["update"], runs["step"]
        assert cs == cu, (cs, cu)
        for k in params:
            for r in range(4):
                torch.testing.assert_close(
                    ps[k]._local_tensors[r], pu[k]._local_tensors[r], rtol=1e-12, atol=1e-14
                )
        for a, b in zip(optree.tree_leaves(ss), optree.tree_leaves(su)):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(gather(a), gather(b), rtol=1e-12, atol=1e-14)
