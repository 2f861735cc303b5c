"""Leaf layouts and helpers shared by the optimizer tests: sizes that do not divide the mesh,
empty shards, nested sharding, a plain-tensor leaf; problem values, a run loop, a tolerance
check."""

import math
import sys

import optree
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import functional_train as ft
from functional_train.engine import fuse
from functional_train.testing import count_collectives, per_rank, simulate


def replicated(x):
    return per_rank(torch.distributed.get_world_size(), lambda r: x)


def shard(x, mesh, placements):
    if placements is None:
        return replicated(x)
    return distribute_tensor(replicated(x), mesh, list(placements), src_data_rank=None)


S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()

# (shape, placements) per leaf; sizes do not divide the mesh; (1, 3) and (2,) give empty shards
LEAVES_2x2 = {
    "a": ((5, 7), [S0, S1]),
    "b": ((5, 7), [R, S1]),
    "c": ((5, 7), [S1, S1]),  # nested sharding of the columns
    "d": ((5, 7), [S0, R]),
    "e": ((3, 5, 6), [S0, S1]),  # batch dim and rows sharded
    "f": ((3, 5, 6), [S2, S1]),  # columns and rows sharded
    "g": ((9,), [S0, R]),
    "h": ((2,), [S0, S0]),  # empty shards
    "i": ((1, 3), [S0, S1]),  # empty row shards
    "j": ((4, 3), None),  # plain tensor
}
LEAVES_2 = {
    "a": ((5, 7), [S0]),
    "b": ((5, 7), [S1]),
    "e": ((3, 5, 6), [S2]),
    "g": ((9,), [S0]),
    "h": ((4, 1), [S1]),
}


# (shape, placements) cycled to build trees of any size for the collective-count tests
MIXED = [
    ((5, 7), [S0, S1]),
    ((5, 7), [R, S1]),
    ((5, 7), [S1, S1]),
    ((5, 7), [S0, R]),
    ((3, 5, 6), [S0, S1]),
    ((9,), [S0, R]),
    ((6, 4), [R, R]),
    ((4,), [R, S0]),
    ((3, 5, 6), [S2, S1]),
    ((7, 3), [S0, S1]),
]


def update_collectives(make_tx, n_leaves, mesh_shape=(2, 2), names=("dp", "tp"), mixed=MIXED):
    """The collectives one ``make_tx().update`` issues on an ``n_leaves`` tree of ``mixed``
    layouts over a simulated mesh."""
    with simulate(math.prod(mesh_shape)):
        m = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        spec = [mixed[i % len(mixed)] for i in range(n_leaves)]
        gen = torch.Generator().manual_seed(0)
        params = {
            f"l{i}": shard(torch.randn(s, generator=gen), m, pl) for i, (s, pl) in enumerate(spec)
        }
        grads = {
            k: shard(torch.randn(v.shape, generator=gen), m, list(v.placements))
            for k, v in params.items()
        }
        tx = make_tx()
        state = tx.init(params)
        with count_collectives() as c:
            tx.update(grads, state, params)
    return c.counts


def values(shapes, steps, dtype, seed=0):
    """Parameters and ``steps`` gradient trees of the given shapes (full-rank random values)."""
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
    grads = [
        {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
        for _ in range(steps)
    ]
    return params, grads


def run_steps(tx, params, grads, mesh=None):
    """``init``, then ``update`` + ``apply_updates`` per gradient tree: (updates, state, params)."""
    state = tx.init(params)
    ups, p = [], params
    for g in grads:
        u, state = tx.update(g, state, p, mesh=mesh)
        ups.append(u)
        p = ft.apply_updates(p, u)
    return ups, state, p


def step_by_mode(tx, g, state, params, mode):
    """One step of ``tx``: ``update`` + ``apply_updates`` (``mode="update"``), or ``ft.step``
    pure (``"pure"``) or donated (``"donate"``). Returns ``(params, state)``."""
    if mode == "update":
        u, state = tx.update(g, state, params)
        return ft.apply_updates(params, u), state
    return ft.step(tx, g, state, params, donate=mode == "donate")


def run_with_reference(opt, ref_params, tx, params, grads):
    """Step a reference ``torch.optim``-style ``opt`` over ``ref_params`` (a dict of
    ``nn.Parameter``) and ``tx`` over ``params`` on the same gradients; returns ``tx``'s final
    (state, params) (``ref_params`` hold the reference's)."""
    state = tx.init(params)
    p = params
    for g in grads:
        for k in ref_params:
            ref_params[k].grad = g[k].clone()
        opt.step()
        u, state = tx.update(g, state, p)
        p = ft.apply_updates(p, u)
    return state, p


def params_close(got, want, params, dtype, twice=False, rtol32=2e-6):
    """The new parameters ``got`` against ``want`` (from ``params``), each within ``rtol`` of
    its largest change: float64 1e-12; float32 ``rtol32`` on CPU (2e-6: the C kernels round as
    torch's CPU kernels do; tests/test_fused.py states 1e-5 for its longer chains, whose
    float32 ``sqrt`` torch does not always round correctly), at least 1e-5 on CUDA (ATen's
    CUDA kernels contract multiply-adds the generated Triton code may round twice). On CUDA
    an element may also differ by one unit in the last place of the parameter: ``p + u``
    rounds once, and an update that differs in its own last bits (the contractions) can round
    that sum to the neighbouring float (a change of 5e-4 on a parameter of 2 is far below the
    parameter's 2.4e-7 spacing). ``twice``: as on CUDA, on any device (kernels that round a
    multiply-add twice: Triton's interpreter)."""
    cuda = twice or next(iter(params.values())).is_cuda
    rtol = (max(rtol32, 1e-5) if cuda else rtol32) if dtype == torch.float32 else 1e-12
    for k in params:
        change = (want[k] - params[k]).abs().max()
        err = (got[k] - want[k]).abs()
        bound = rtol * change + 1e-30
        if cuda:
            bound = bound + torch.finfo(dtype).eps * want[k].abs()
        assert bool((err <= bound).all()), (k, float(err.max()), float(change))


def close(got, want, rtol, atol, what):
    """``max |got - want| <= atol + rtol * max |want|``, naming ``what`` on failure."""
    got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    tol = atol + rtol * (want.abs().max().item() if want.numel() else 0.0)
    assert err <= tol, f"{what}: max abs err {err:.3e} > {tol:.3e}"


def run_on_tp_submesh(make, leaves, params, grads, deltas, collect):
    """``run_steps(make(), ...)`` with every leaf on the ``tp`` sub-mesh of a dp=2 x tp=2 mesh
    (``leaves``: name -> (shape, placements)) and per-replica gradients ``g + d`` / ``g - d``
    (their mean over ``Mesh.data_axis`` is ``g``). Returns ``collect(updates, state, params)``,
    called inside the simulation (gather there)."""
    with simulate(4):
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = m["tp"]

        def on_tp(values, pl):  # values[dp coordinate]
            return distribute_tensor(
                per_rank(4, lambda r: values[r // 2]), tp, pl, src_data_rank=None
            )

        dp = {k: on_tp([params[k]] * 2, pl) for k, (_, pl) in leaves.items()}
        dg = [
            {k: on_tp([g[k] + d[k], g[k] - d[k]], pl) for k, (_, pl) in leaves.items()}
            for g, d in zip(grads, deltas)
        ]
        return collect(*run_steps(make(), dp, dg, ft.Mesh(m, data_axis="dp")))


def check_fused_step(
    make_tx,
    dtype,
    monkeypatch,
    fused_name: str,
    shapes=None,
    steps: int = 3,
    taken_at=None,
    param_rounding: bool = False,
    op_by_op: bool = False,
    engine_reference: bool = False,
) -> None:
    """``ft.step`` through the fused per-leaf path ``functional_train.step.<fused_name>`` equals
    the chain's update + apply_updates bit for bit, pure (inputs unchanged) and donated, over
    ``steps`` steps, for leaves above and below 64 KiB, factored and not (or ``shapes``), with a
    None gradient; the fused path is taken at every step (or at the steps ``taken_at`` is True
    for, and declines at the others).

    ``param_rounding``: the fused path computes the parameters in another order (one matrix
    product for several of the chain's passes), so they equal the chain's to float rounding
    only: within 2 units in the last place of the parameter plus 2 units of the largest
    parameter change, per fused step taken so far (the states still bit for bit, and pure ==
    donated bit for bit).

    ``op_by_op``: the reference runs the chain's definitions operation by operation in torch
    (no generated kernels: they compute half-precision leaves in float and round once, where a
    fused path that runs torch's operations rounds each).

    ``engine_reference``: the reference is the chain's own ``ft.step`` through the engine (the
    per-leaf path turned off), for a per-leaf path that runs the chain's last stage and
    ``apply_updates`` in one kernel as the engine does (with half-precision leaves, one
    rounding of ``p + u`` where update + apply_updates rounds ``u`` first)."""
    step_module = sys.modules["functional_train.step"]
    taken = []
    real = getattr(step_module, fused_name)
    monkeypatch.setattr(step_module, fused_name, lambda *a: taken.append(real(*a)) or taken[-1])
    gen = torch.Generator().manual_seed(0)
    shapes = shapes or {
        "w": (6, 5),
        "b": (7,),
        "t": (3, 4, 5),
        "s": (),
        "big": (130, 140),
        "vec": (20000,),
        "stack": (2, 90, 100),
        "frozen": (40, 30),
    }
    params = {k: torch.randn(v, generator=gen).to(dtype) for k, v in shapes.items()}
    grads = [
        {
            k: (None if k == "frozen" else torch.randn(v, generator=gen).to(dtype))
            for k, v in shapes.items()
        }
        for _ in range(steps)
    ]
    tx = make_tx()
    s_ref = s_pure = s_don = tx.init(params)
    p_ref = p_pure = params
    p_don = {k: v.clone() for k, v in params.items()}
    for g in grads:
        with monkeypatch.context() as m:
            if op_by_op:
                m.setattr(fuse, "ENABLED", False)
            if engine_reference:
                m.setattr(step_module, fused_name, lambda *a: None)
                p_ref, s_ref = ft.step(tx, g, s_ref, p_ref)
            else:
                u, s_ref = tx.update(g, s_ref, p_ref)
                p_ref = ft.apply_updates(p_ref, u)
        before = [x.clone() for x in optree.tree_leaves((p_pure, s_pure, g))]
        old = (p_pure, s_pure, g)
        p_pure, s_pure = ft.step(tx, g, s_pure, p_pure)
        for x, y in zip(before, optree.tree_leaves(old)):
            assert torch.equal(x, y)  # pure: nothing written
        p_don, s_don = ft.step(
            tx,
            {k: (None if v is None else v.clone()) for k, v in g.items()},
            s_don,
            p_don,
            donate=True,
        )
        for got in ((p_pure, s_pure), (p_don, s_don)):
            for x, y in zip(optree.tree_leaves(got[1]), optree.tree_leaves(s_ref)):
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
            for k, y in p_ref.items():
                x = got[0][k]
                if not param_rounding:
                    torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
                    continue
                tol = 2 * torch.finfo(dtype).eps * sum(1 for t in taken if t is not None) / 2
                change = (y.double() - params[k].double()).abs().max().item()
                torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol * change)
        for x, y in zip(optree.tree_leaves((p_pure, s_pure)), optree.tree_leaves((p_don, s_don))):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    want = [True] * steps if taken_at is None else list(taken_at)
    assert [t is not None for t in taken] == [w for w in want for _ in range(2)]
    assert torch.equal(p_pure["frozen"], params["frozen"])
