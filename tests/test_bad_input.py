"""Bad input: clear errors that name the offending leaf path or hyper-parameter (mesh=None)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import functional_train as ft


def params():
    return {"a": torch.ones(2, 3), "b": torch.ones(4), "c": {"d": torch.ones(())}}


def grads():
    return {
        "a": torch.full((2, 3), 0.5),
        "b": torch.full((4,), -0.5),
        "c": {"d": torch.tensor(2.0)},
    }


TRANSFORMS = [
    ("sgd", lambda: ft.sgd(0.1)),
    ("sgd_momentum", lambda: ft.sgd(0.1, momentum=0.9, weight_decay=0.1)),
    ("adam", lambda: ft.adam(0.01)),
    ("adam_amsgrad", lambda: ft.adam(0.01, amsgrad=True, weight_decay=0.1)),
    ("adamw", lambda: ft.adamw(0.01)),
    ("adamw_schedule", lambda: ft.adamw(ft.schedules.cosine_decay_schedule(0.1, 10))),
    ("clip", lambda: ft.clip(1.0)),
    ("clip_by_global_norm", lambda: ft.clip_by_global_norm(1.0)),
    ("chain", lambda: ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(0.01))),
    ("multi_steps_1", lambda: ft.multi_steps(ft.adam(0.01), 1)),
    ("multi_steps_3", lambda: ft.multi_steps(ft.adam(0.01), 3)),
]
TX_IDS = [t[0] for t in TRANSFORMS]


# ---------------------------------------------------------------------------------------------
# tree structure mismatches
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,make", TRANSFORMS, ids=TX_IDS)
def test_grads_missing_a_key(name, make):
    tx = make()
    p = params()
    g = grads()
    del g["b"]
    with pytest.raises(ValueError, match=r"structure.*'b'"):
        tx.update(g, tx.init(p), p)


@pytest.mark.parametrize("name,make", TRANSFORMS, ids=TX_IDS)
def test_grads_with_an_extra_key(name, make):
    tx = make()
    p = params()
    g = dict(grads(), e=torch.ones(3))
    with pytest.raises(ValueError, match=r"structure.*'e'"):
        tx.update(g, tx.init(p), p)


@pytest.mark.parametrize("name,make", TRANSFORMS, ids=TX_IDS)
def test_grads_missing_a_nested_key(name, make):
    tx = make()
    p = params()
    g = grads()
    g["c"] = {"x": torch.tensor(1.0)}
    with pytest.raises(ValueError, match=r"c\.(d|x)"):
        tx.update(g, tx.init(p), p)


STATEFUL_NO_PARAMS = [  # params are optional for these (no weight decay)
    ("sgd_momentum", lambda: ft.sgd(0.1, momentum=0.9)),
    ("adam", lambda: ft.adam(0.01)),
    ("adam_amsgrad", lambda: ft.adam(0.01, amsgrad=True)),
    ("adamw_no_decay", lambda: ft.adamw(0.01, weight_decay=0.0)),
    (
        "adamw_schedule",
        lambda: ft.adamw(ft.schedules.cosine_decay_schedule(0.1, 10), weight_decay=0.0),
    ),
    ("multi_steps_1", lambda: ft.multi_steps(ft.adam(0.01), 1)),
    ("multi_steps_3", lambda: ft.multi_steps(ft.adam(0.01), 3)),
]


@pytest.mark.parametrize("name,make", STATEFUL_NO_PARAMS, ids=[t[0] for t in STATEFUL_NO_PARAMS])
def test_state_for_other_params_without_params_argument(name, make):
    # stateful transforms check the updates against their params-shaped state
    tx = make()
    state = tx.init(params())
    g = grads()
    del g["b"]
    with pytest.raises(ValueError, match=r"'b'"):
        tx.update(g, state)


def test_apply_updates_structure_mismatch():
    u = grads()
    del u["b"]
    with pytest.raises(ValueError, match=r"structure.*'b'"):
        ft.apply_updates(params(), u)
    with pytest.raises(ValueError, match=r"structure.*'e'"):
        ft.apply_updates(params(), dict(grads(), e=torch.ones(1)))


# ---------------------------------------------------------------------------------------------
# shape mismatches
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "leaf,bad",
    [("b", torch.ones(5)), ("a", torch.ones(3, 2)), ("c.d", torch.ones(1))],
    ids=["b", "a", "c.d"],
)
@pytest.mark.parametrize("name,make", TRANSFORMS, ids=TX_IDS)
def test_shape_mismatch_names_the_leaf(name, make, leaf, bad):
    tx = make()
    p = params()
    g = grads()
    if leaf == "c.d":
        g["c"]["d"] = bad
    else:
        g[leaf] = bad
    with pytest.raises(ValueError, match=rf"'{leaf}'.*shape"):
        tx.update(g, tx.init(p), p)


@pytest.mark.parametrize(
    "bad",
    [torch.ones(1), torch.ones(5), torch.ones(2, 4)],
    ids=["broadcastable", "longer", "rank2"],
)
@pytest.mark.parametrize(
    "name,make",
    [
        ("sgd_momentum", lambda: ft.sgd(0.1, momentum=0.9)),
        ("adam", lambda: ft.adam(0.01)),
        ("adamw", lambda: ft.adamw(0.01, weight_decay=0.0, amsgrad=True)),
        ("multi_steps", lambda: ft.multi_steps(ft.adam(0.01), 2)),
    ],
    ids=["sgd_momentum", "adam", "adamw", "multi_steps"],
)
def test_shape_mismatch_against_state_without_params(name, make, bad):
    # params are optional for these transforms; the params-shaped state then fixes the shapes.
    # A gradient whose shape differs from its state leaf must be rejected, naming the leaf (not
    # broadcast silently, not a bare torch broadcasting RuntimeError).
    tx = make()
    state = tx.init(params())
    g = dict(grads(), b=bad)
    with pytest.raises(ValueError, match=r"'b'.*shape"):
        tx.update(g, state)


def test_apply_updates_shape_mismatch_names_the_leaf():
    with pytest.raises(ValueError, match=r"'b'.*shape"):
        ft.apply_updates(params(), dict(grads(), b=torch.ones(5)))


def test_non_tensor_leaf():
    tx = ft.adam(0.01)
    p = params()
    with pytest.raises(TypeError, match=r"'b'"):
        tx.update(dict(grads(), b=4.0), tx.init(p), p)


# ---------------------------------------------------------------------------------------------
# states from another transform
# ---------------------------------------------------------------------------------------------
STATE_SWAPS = [
    ("adam->sgd", lambda: ft.adam(0.01), lambda: ft.sgd(0.1), "chain"),
    ("adam->sgd_momentum", lambda: ft.adam(0.01), lambda: ft.sgd(0.1, momentum=0.9), "TraceState"),
    (
        "sgd_momentum->adam",
        lambda: ft.sgd(0.1, momentum=0.9),
        lambda: ft.adam(0.01),
        "ScaleByAdamState",
    ),
    ("adam->adamw", lambda: ft.adam(0.01), lambda: ft.adamw(0.01), "chain"),
    (
        "adam->amsgrad",
        lambda: ft.adam(0.01),
        lambda: ft.adam(0.01, amsgrad=True),
        "ScaleByAmsgradState",
    ),
    (
        "amsgrad->adam",
        lambda: ft.adam(0.01, amsgrad=True),
        lambda: ft.adam(0.01),
        "ScaleByAdamState",
    ),
    (
        "adam->multi_steps",
        lambda: ft.adam(0.01),
        lambda: ft.multi_steps(ft.adam(0.01), 2),
        "MultiStepsState",
    ),
    ("multi_steps->adam", lambda: ft.multi_steps(ft.adam(0.01), 2), lambda: ft.adam(0.01), "chain"),
    (
        "clip->clip_by_global_norm",
        lambda: ft.clip(1.0),
        lambda: ft.clip_by_global_norm(1.0),
        "ClipByGlobalNormState",
    ),
    (
        "clip_by_global_norm->clip",
        lambda: ft.clip_by_global_norm(1.0),
        lambda: ft.clip(1.0),
        "EmptyState",
    ),
    (
        "const_lr->scheduled_lr",
        lambda: ft.scale_by_learning_rate(0.1),
        lambda: ft.scale_by_learning_rate(ft.schedules.constant_schedule(0.1)),
        "ScaleByScheduleState",
    ),
]


@pytest.mark.parametrize("name,src,dst,match", STATE_SWAPS, ids=[s[0] for s in STATE_SWAPS])
def test_state_from_another_transform(name, src, dst, match):
    p = params()
    state = src().init(p)
    with pytest.raises(ValueError, match=match):
        dst().update(grads(), state, p)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_chain_state_of_the_wrong_length(n):
    p = params()
    tx = ft.chain(ft.clip(1.0), ft.adam(0.01))
    full = tx.init(p)
    state = (full + (ft.EmptyState(),))[:n] if n != 3 else full + (ft.EmptyState(),)
    with pytest.raises(ValueError, match=r"chain: expected a tuple of 2 states"):
        tx.update(grads(), state, p)


def test_chain_state_as_list_or_none():
    p = params()
    tx = ft.chain(ft.clip(1.0), ft.adam(0.01))
    with pytest.raises(ValueError, match=r"chain: expected a tuple of 2 states.*list"):
        tx.update(grads(), list(tx.init(p)), p)
    with pytest.raises(ValueError, match=r"chain: expected a tuple of 2 states.*NoneType"):
        tx.update(grads(), None, p)


def test_named_chain_state_with_wrong_names():
    p = params()
    tx = ft.named_chain(("clip", ft.clip(1.0)), ("opt", ft.adam(0.01)))
    state = tx.init(p)
    with pytest.raises(ValueError, match=r"named_chain.*\['clip', 'opt'\]"):
        tx.update(grads(), {"clip": state["clip"], "other": state["opt"]}, p)


@pytest.mark.parametrize("donate", [False, True])
def test_partition_state_leaf_of_another_shape_names_the_leaf(donate):
    """A label's state leaf of another shape inside ``partition`` (its transform's state:
    ``None`` outside the label's leaves, checked by whole lists on plain tensors) is refused,
    naming the leaf and both shapes, as outside a partition."""
    tx = ft.partition(
        {"x": ft.adamw(0.01), "y": ft.adamw(0.01, weight_decay=0.0)},
        {"a": "x", "b": "y", "c": {"d": "y"}},
    )
    p = params()
    state = tx.init(p)
    p, state = ft.step(tx, grads(), state, p)  # (the shapes checked once: then the memo)
    state.inner_states["x"][0].mu["a"] = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"'a' has shape \(2, 3\).*mu leaf has shape \(3, 2\)"):
        ft.step(tx, grads(), state, p, donate=donate)


def test_state_for_a_different_tree():
    p = params()
    other = dict(params(), z=torch.ones(2))
    state = ft.adam(0.01).init(other)
    with pytest.raises(ValueError, match=r"ScaleByAdamState\.mu.*'z'"):
        ft.adam(0.01).update(grads(), state, p)


def test_transform_needing_params():
    tx = ft.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match="params"):
        tx.update(grads(), tx.init(params()))


# ---------------------------------------------------------------------------------------------
# invalid hyper-parameters
# ---------------------------------------------------------------------------------------------
BAD_HYPER = [
    # (id, constructor, exception, message regex)
    ("sgd_lr", lambda: ft.sgd(-0.1), ValueError, r"sgd.*learning_rate"),
    ("adam_lr", lambda: ft.adam(-0.1), ValueError, r"adam.*learning_rate"),
    ("adamw_lr", lambda: ft.adamw(-0.1), ValueError, r"adamw.*learning_rate"),
    (
        "sblr_lr",
        lambda: ft.scale_by_learning_rate(-0.1),
        ValueError,
        r"scale_by_learning_rate.*learning_rate",
    ),
    ("sgd_lr_nan", lambda: ft.sgd(float("nan")), ValueError, r"learning_rate"),
    ("adam_lr_str", lambda: ft.adam("1e-3"), TypeError, r"learning_rate"),
    ("sblr_lr_none", lambda: ft.scale_by_learning_rate(None), TypeError, r"learning_rate"),
    ("ms_every_k_0", lambda: ft.multi_steps(ft.sgd(), 0), ValueError, r"every_k"),
    ("ms_every_k_neg", lambda: ft.multi_steps(ft.sgd(), -2), ValueError, r"every_k"),
    ("ms_every_k_float", lambda: ft.multi_steps(ft.sgd(), 2.0), TypeError, r"every_k"),
    ("ms_every_k_bool", lambda: ft.multi_steps(ft.sgd(), True), TypeError, r"every_k"),
    ("ms_every_k_str", lambda: ft.multi_steps(ft.sgd(), "4"), TypeError, r"every_k"),
    ("ms_inner", lambda: ft.multi_steps(lambda g: g, 2), TypeError, r"inner"),
    ("cgn_max_norm_0", lambda: ft.clip_by_global_norm(0.0), ValueError, r"max_norm"),
    ("cgn_max_norm_neg", lambda: ft.clip_by_global_norm(-1.0), ValueError, r"max_norm"),
    ("cgn_max_norm_str", lambda: ft.clip_by_global_norm("1"), TypeError, r"max_norm"),
    ("cgn_norm_type_0", lambda: ft.clip_by_global_norm(1.0, 0.0), ValueError, r"norm_type"),
    ("cgn_norm_type_neg", lambda: ft.clip_by_global_norm(1.0, -2.0), ValueError, r"norm_type"),
    (
        "cgn_norm_type_-inf",
        lambda: ft.clip_by_global_norm(1.0, -math.inf),
        ValueError,
        r"norm_type",
    ),
    ("cgn_norm_type_nan", lambda: ft.clip_by_global_norm(1.0, math.nan), ValueError, r"norm_type"),
    ("clip_0", lambda: ft.clip(0.0), ValueError, r"max_delta"),
    ("clip_neg", lambda: ft.clip(-0.5), ValueError, r"max_delta"),
    ("clip_none", lambda: ft.clip(None), TypeError, r"max_delta"),
    ("adam_b1_1", lambda: ft.adam(b1=1.0), ValueError, r"b1"),
    ("adam_b1_neg", lambda: ft.adam(b1=-0.1), ValueError, r"b1"),
    ("adam_b2_1", lambda: ft.adam(b2=1.0), ValueError, r"b2"),
    ("adam_b2_big", lambda: ft.adam(b2=1.5), ValueError, r"b2"),
    ("adamw_b1_1", lambda: ft.adamw(b1=1.0), ValueError, r"b1"),
    ("adamw_b2_neg", lambda: ft.adamw(b2=-0.01), ValueError, r"b2"),
    ("adam_decoupled_b2", lambda: ft.adam(b2=1.0, decoupled_weight_decay=True), ValueError, r"b2"),
    ("adam_eps", lambda: ft.adam(eps=-1e-8), ValueError, r"eps"),
    ("adamw_eps", lambda: ft.adamw(eps=-1e-8), ValueError, r"eps"),
    ("scale_by_adam_b1", lambda: ft.scale_by_adam(b1=1.0), ValueError, r"b1"),
    ("sgd_wd", lambda: ft.sgd(weight_decay=-0.1), ValueError, r"weight_decay"),
    ("adam_wd", lambda: ft.adam(weight_decay=-0.1), ValueError, r"weight_decay"),
    (
        "adam_decoupled_wd",
        lambda: ft.adam(weight_decay=-0.1, decoupled_weight_decay=True),
        ValueError,
        r"weight_decay",
    ),
    ("adamw_wd", lambda: ft.adamw(weight_decay=-0.1), ValueError, r"weight_decay"),
    ("add_decayed_weights", lambda: ft.add_decayed_weights(-0.1), ValueError, r"weight_decay"),
    ("sgd_momentum_neg", lambda: ft.sgd(momentum=-0.5), ValueError, r"momentum"),
    ("sgd_dampening_neg", lambda: ft.sgd(momentum=0.5, dampening=-0.5), ValueError, r"dampening"),
    ("sgd_nesterov_no_momentum", lambda: ft.sgd(0.1, nesterov=True), ValueError, r"nesterov"),
    (
        "sgd_nesterov_dampening",
        lambda: ft.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True),
        ValueError,
        r"nesterov",
    ),
    ("trace_nesterov_no_decay", lambda: ft.trace(0.0, nesterov=True), ValueError, r"nesterov"),
    ("trace_decay_neg", lambda: ft.trace(-0.1), ValueError, r"decay"),
    (
        "chain_non_transform",
        lambda: ft.chain(ft.sgd(), lambda g: g),
        TypeError,
        r"chain: argument 1",
    ),
    (
        "named_chain_duplicate",
        lambda: ft.named_chain(("a", ft.sgd()), ("a", ft.adam())),
        ValueError,
        r"duplicate",
    ),
    ("named_chain_not_pair", lambda: ft.named_chain(ft.sgd()), TypeError, r"argument 0"),
    (
        "warmup_cosine_decay_le_warmup",
        lambda: ft.schedules.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10),
        ValueError,
        r"decay_steps",
    ),
    (
        "warmup_cosine_warmup_neg",
        lambda: ft.schedules.warmup_cosine_decay_schedule(0.0, 1.0, -1, 10),
        ValueError,
        r"warmup_steps",
    ),
    (
        "cosine_decay_steps_0",
        lambda: ft.schedules.cosine_decay_schedule(1.0, 0),
        ValueError,
        r"decay_steps",
    ),
    (
        "linear_steps_neg",
        lambda: ft.schedules.linear_schedule(1.0, 0.0, -1),
        ValueError,
        r"transition_steps",
    ),
    (
        "linear_steps_float",
        lambda: ft.schedules.linear_schedule(1.0, 0.0, 2.5),
        TypeError,
        r"transition_steps",
    ),
]


@pytest.mark.parametrize("name,make,exc,match", BAD_HYPER, ids=[b[0] for b in BAD_HYPER])
def test_invalid_hyper_parameters(name, make, exc, match):
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize("norm_type", [0.0, -1.0, -math.inf, math.nan])
def test_global_norm_invalid_norm_type(norm_type):
    with pytest.raises(ValueError, match="norm_type"):
        ft.global_norm({"a": torch.ones(2, 3)}, norm_type=norm_type)


# ---------------------------------------------------------------------------------------------
# the mesh argument
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_mesh", ["dp", 2, object()], ids=["str", "int", "object"])
@pytest.mark.parametrize("name,make", TRANSFORMS, ids=TX_IDS)
def test_non_mesh_argument_raises_type_error(name, make, bad_mesh):
    # every call, including the non-final micro-steps of multi_steps, rejects a non-Mesh
    tx = make()
    p = params()
    with pytest.raises(TypeError, match=r"mesh must be a functional_train\.Mesh"):
        tx.update(grads(), tx.init(p), p, mesh=bad_mesh)


def test_global_norm_non_mesh_argument():
    with pytest.raises(TypeError, match=r"mesh must be a functional_train\.Mesh"):
        ft.global_norm(grads(), mesh="dp")


def test_mesh_device_mesh_must_be_a_device_mesh():
    with pytest.raises(TypeError, match="device_mesh"):
        ft.Mesh("dp")
    with pytest.raises(ValueError, match=r"data_axis='dp'.*device_mesh"):
        ft.Mesh(data_axis="dp")
    with pytest.raises(ValueError, match="is_expert"):
        ft.Mesh(is_expert=lambda path: True)


@pytest.fixture
def dp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    from functional_train.testing import simulate

    was_initialized = dist.is_initialized()
    with simulate(2):
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    if not was_initialized and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"data_axis": "tp"}, r"data_axis='tp'"),
        ({"pipeline_axis": "pp"}, r"pipeline_axis='pp'"),
        ({"expert_axis": "ep"}, r"expert_axis='ep'"),
        ({"data_axis": "dp", "pipeline_axis": "dp"}, r"'dp'"),
    ],
    ids=["data", "pipeline", "expert", "two_roles"],
)
def test_mesh_axis_not_in_device_mesh(dp_mesh, kw, match):
    with pytest.raises(ValueError, match=match):
        ft.Mesh(dp_mesh, **kw)


def test_device_mesh_passed_as_mesh(dp_mesh):
    ft.Mesh(dp_mesh, data_axis="dp")  # valid
    tx = ft.adam(0.01)
    p = params()
    with pytest.raises(TypeError, match=r"mesh must be a functional_train\.Mesh.*DeviceMesh"):
        tx.update(grads(), tx.init(p), p, mesh=dp_mesh)


@pytest.fixture
def two_meshes():
    from torch.distributed.device_mesh import init_device_mesh

    from functional_train.testing import simulate

    was_initialized = dist.is_initialized()
    with simulate(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        other = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        yield world, other
    if not was_initialized and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "make",
    [
        lambda: ft.clip_by_global_norm(1.0),
        lambda: ft.adamw(1e-2),
        lambda: ft.multi_steps(ft.sgd(0.1), 1),
    ],
    ids=["clip_by_global_norm", "adamw", "multi_steps"],
)
def test_dtensor_on_a_mesh_that_is_not_part_of_mesh(two_meshes, make):
    from torch.distributed.tensor import Shard, distribute_tensor

    world, other = two_meshes
    p = {
        "a": distribute_tensor(torch.ones(4, 2), world, [Shard(0), Shard(1)]),
        "moe": {"w": distribute_tensor(torch.ones(8, 2), other, [Shard(0)])},
    }
    g = {k: v for k, v in p.items()}
    tx = make()
    with pytest.raises(ValueError, match=r"'moe\.w'.*not part of the mesh"):
        tx.update(g, tx.init(p), p, mesh=ft.Mesh(world, data_axis="dp"))


def test_dtensors_on_different_meshes_without_mesh(two_meshes):
    from torch.distributed.tensor import Shard, distribute_tensor

    world, other = two_meshes
    p = {
        "a": distribute_tensor(torch.ones(4, 2), world, [Shard(0), Shard(1)]),
        "b": distribute_tensor(torch.ones(8, 2), other, [Shard(0)]),
    }
    tx = ft.clip_by_global_norm(1.0)
    with pytest.raises(ValueError, match=r"'b' is a DTensor on .*different meshes need mesh="):
        tx.update(p, tx.init(p), p)


def test_dtensors_on_equal_meshes_are_on_one_mesh():
    """Two ``DeviceMesh`` objects over the same ranks, layout and names are one mesh to torch
    (``==``; its sharding caches hand back results on the first one made), so they are one to
    the library too: parameters on one and gradients and state on the other step as on one
    mesh (this raised "DTensors on different meshes" before; found by the sharded
    equivalence property, whose ``zeros_like`` state came back on an earlier run's mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from functional_train.testing import simulate

    was_initialized = dist.is_initialized()
    with simulate(2):
        first = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        second = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        assert first == second and first is not second
        w, b = torch.arange(8.0).reshape(4, 2), torch.ones(3)
        p = {
            "w": distribute_tensor(w, first, [Shard(0)]),
            "b": distribute_tensor(b, first, [Replicate()]),
        }
        g = {
            "w": distribute_tensor(w * 0.1, second, [Shard(0)]),
            "b": distribute_tensor(b, second, [Replicate()]),
        }
        tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), ft.sgd(0.1)), 2)
        state = tx.init({k: v.redistribute(second, v.placements) for k, v in p.items()})
        for _ in range(2):
            p, state = ft.step(tx, g, state, p)
        norm = torch.cat([(w * 0.1).flatten(), b]).norm()
        torch.testing.assert_close(p["w"].full_tensor(), w - 0.1 * w * 0.1 / max(1.0, float(norm)))
    if not was_initialized and dist.is_initialized():
        dist.destroy_process_group()
