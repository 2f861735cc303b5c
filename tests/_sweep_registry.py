"""The registry of ``tests/test_sweep.py``: every public name of ``functional_train``, either
swept (``FACTORIES``: a zero-argument builder with small, sensible hyper-parameters) or excluded
with a reason (``EXCLUDED``). ``test_sweep.test_registry_covers_every_public_name`` fails as soon
as a name of ``functional_train.__all__`` is in neither table (or in both), so a new public
transform is swept once it is registered here, and cannot be forgotten.

Besides the builders:

* ``VARIANTS``: further configurations of a registered transform that take other code paths
  (``name[variant]``), swept like the others;
* ``NOT_APPLICABLE``: ``(transform, property) -> reason`` for the properties that do not apply
  to a transform by design (the test is skipped with that reason);
* ``HOST_COUNTER_READS``: the transforms allowed to read a documented CPU step counter on the
  host in ``update`` (the only exception to the no-host-synchronisation property);
* ``COMPILE_GRAPH_BREAKS``: transforms compiled with ``fullgraph=False`` (none so far);
* ``KNOWN_BUGS``: ``(transform, property) -> reason`` of library bugs the sweep found; those
  cases are ``xfail(strict=True)``, so fixing the bug makes the suite fail until the entry is
  removed here;
* ``REFERENCES``: for the transforms that reproduce a torch-world implementation (torch.optim,
  transformers' Adafactor, came-pytorch, galore-torch, ``torch.nn.utils``' clipping, the LAMB
  equations) with the builder's hyper-parameters, a run of that implementation on the same
  params and gradients (the ``zero_grads`` property compares against it).
"""

from __future__ import annotations

from collections.abc import Callable

import optree
import torch

import functional_train as ft

# the properties of test_sweep.py (test function name without "test_" -> property)
PROPERTIES = (
    "sharded",  # sharded == unsharded, hypothesis-drawn meshes / placements / trees
    "sharded_data_axis",  # sharded == unsharded with a data axis and Partial gradients
    "purity",  # params, grads and state are bitwise unchanged by update
    "state_structure",  # treedef / shapes / dtypes / devices: init == after updates
    "torch_load",  # torch.save / torch.load(weights_only=True) round trip of the state
    "state_placements",  # the same for a simulated sharded run, placements included
    "chain",  # chain(clip_by_global_norm, T) == clip, then T
    "named_chain",  # named_chain(("clip", ...), ("tx", T)) == clip, then T
    "multi_steps",  # multi_steps(T, 2) == T on the mean of two micro-gradients
    "zero_redundancy",  # zero_redundancy(T) in one process == T
    "zero_redundancy_dp",  # zero_redundancy(T) on a simulated dp x tp mesh == T unsharded
    "partition",  # partition({"a": T, "b": sgd}) == T on the "a" leaves
    "masked",  # masked(T, mask) == T on the masked-in leaves, others unchanged
    "none_leaves",  # a None gradient leaf passes through; the others are unaffected
    "mixed_dtypes",  # float32 + float64 leaves: each leaf's updates as when alone
    "bf16_states",  # bf16 params: floating states are float32 (init and after updates)
    "bf16_close",  # bf16 run within bf16 tolerance of the float32 run
    "update_dtype",  # the updates have the gradients' dtype (bf16 in, bf16 out)
    "update_dtype_f64",  # the same for float64
    "no_host_sync",  # no aten._local_scalar_dense / aten.item in update
    "compile",  # torch.compile(update, fullgraph=True) == eager
    "torch_optimizer_compile",  # torch.compile(TorchOptimizer.step), inductor == eager step()
    "step_counter",  # int64 counters go past 2**31 - 1 without overflow
    "step",  # ft.step pure / donated == update + apply_updates; pure is pure
    "fused",  # the generated kernels == the same per-leaf definitions leaf by leaf in torch
    # (pure and donated ft.step)
    "step_sharded",  # ft.step sharded == unsharded (data-axis layout), pure and donated
    "compile_dtensor",  # torch.compile(ft.step, fullgraph=True) on DTensors, 2 gloo ranks
    "zero_grads",  # zero / below-eps gradients (whole tree, some leaves, rows, after non-zero
    # steps, a zero parameter): finite, update == ft.step, == the reference where one exists
    "zero_grads_sharded",  # their first step sharded == unsharded (data axis), both finite
    "vmap",  # ft.vmap of init, update and ft.step over a leading model axis == a Python loop
    "grad",  # torch.func.grad / jvp through update and ft.step w.r.t. params, gradients and
    # state == central finite differences in float64 (or the clear error of NOT_DIFFERENTIABLE)
)


# ---------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------
def by_ndim(two_d, other) -> Callable:
    """A labels function for ``partition`` / a mask function for ``masked`` that works on any
    params tree (the sharded property draws arbitrary ones): ``two_d`` for leaves of 2 or more
    dims, ``other`` for the rest, ``None`` leaves included (a partition or mask inside another
    one sees the leaves it does not own as ``None``, and its labels must still name a
    transform)."""

    def labels(params):
        return optree.tree_map(
            lambda x: two_d if x is not None and x.ndim >= 2 else other, params, none_is_leaf=True
        )

    return labels


def _examples() -> ft.GradientTransformation:
    """A foreign (``tree_map``) transform making 2 per-example gradients of each gradient
    ``g``: ``0.5 g`` and ``1.5 g`` (their mean is ``g``), the leading batch axis
    ``differentially_private_aggregate`` takes."""

    def update(updates, state, params=None, **extra):
        del params, extra
        batch = lambda g: None if g is None else torch.stack([0.5 * g, 1.5 * g])  # noqa: E731
        return optree.tree_map(batch, updates, none_is_leaf=True), state

    return ft.GradientTransformation(lambda params: ft.EmptyState(), update)


def _matrices(params):
    return optree.tree_map(lambda x: x is not None and x.ndim >= 2, params, none_is_leaf=True)


def _warmup_cosine():
    return ft.schedules.warmup_cosine_decay_schedule(0.0, 0.1, 1, 10)


FACTORIES: dict[str, Callable[[], ft.GradientTransformation]] = {
    # base combinators
    "identity": lambda: ft.identity(),
    "chain": lambda: ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1)),
    "named_chain": lambda: ft.named_chain(
        ("clip", ft.clip(0.5)), ("opt", ft.sgd(0.1, momentum=0.9))
    ),
    "partition": lambda: ft.partition({"a": ft.adamw(1e-2), "b": ft.sgd(0.1)}, by_ndim("a", "b")),
    "masked": lambda: ft.masked(ft.adamw(1e-2), by_ndim(True, False)),
    # clipping
    "clip": lambda: ft.clip(0.5),
    "clip_by_global_norm": lambda: ft.clip_by_global_norm(1.0),
    # accumulation, ZeRO
    "multi_steps": lambda: ft.multi_steps(ft.adamw(1e-2), every_k=2),
    "zero_redundancy": lambda: ft.zero_redundancy(ft.adamw(1e-2), axis="dp"),
    # parameter averaging
    "ema_params": lambda: ft.ema_params(0.9, warmup=True),
    # a user's elementwise primitive (RMSprop with a schedule of the step count)
    "elementwise": lambda: ft.elementwise(
        _rms_leaf,
        name="rms",
        fields=("v",),
        hyperparams={"beta": 0.9, "lr": lambda count: 0.1 / (1.0 + count)},
    ),
    # hyperparameters as state: the learning rate handed to the alias as a schedule of the state
    "inject_hyperparams": lambda: ft.inject_hyperparams(ft.adamw, static_args=("weight_decay",))(
        learning_rate=1e-2, weight_decay=0.1
    ),
    # non-finite gradients (the swept gradients are finite: the applied branch, and the
    # selection between it and the kept state)
    "apply_if_finite": lambda: ft.apply_if_finite(ft.adamw(1e-2), 2),
    "zero_nans": lambda: ft.zero_nans(),
    "dynamic_loss_scale": lambda: ft.dynamic_loss_scale(
        ft.adamw(1e-2), init_scale=4.0, growth_interval=2
    ),
    # elementwise transforms
    "scale": lambda: ft.scale(-0.5),
    "scale_by_learning_rate": lambda: ft.scale_by_learning_rate(_warmup_cosine()),
    "add_decayed_weights": lambda: ft.add_decayed_weights(0.1),
    "trace": lambda: ft.trace(0.9, nesterov=True),
    "scale_by_adam": lambda: ft.scale_by_adam(),
    "scale_by_trust_ratio": lambda: ft.scale_by_trust_ratio(),
    # factored (Adafactor), CAME
    "scale_by_factored_rms": lambda: ft.scale_by_factored_rms(),
    "clip_by_block_rms": lambda: ft.clip_by_block_rms(0.5),
    "scale_by_param_block_rms": lambda: ft.scale_by_param_block_rms(1e-2),
    "ema": lambda: ft.ema(0.9, debias=True),
    "scale_by_came": lambda: ft.scale_by_came(),
    # GaLore: small rank and a refresh every other step, so the 3-step runs refresh twice
    "galore": lambda: ft.galore(ft.adam(1e-2), rank=2, update_proj_gap=2),
    "galore_adamw": lambda: ft.galore_adamw(1e-2, weight_decay=0.1, rank=2, update_proj_gap=2),
    # Muon: its own transform on the matrices (the swept trees hold vectors and scalars too)
    "scale_by_muon": lambda: ft.masked(ft.scale_by_muon(ns_dtype=torch.float64), _matrices),
    "muon": lambda: ft.muon(1e-2, weight_decay=0.1),
    # optimizers
    "sgd": lambda: ft.sgd(0.1, momentum=0.9, weight_decay=0.1),
    "adam": lambda: ft.adam(1e-2, weight_decay=0.1, amsgrad=True),
    "adamw": lambda: ft.adamw(1e-2, weight_decay=0.1),
    "adafactor": lambda: ft.adafactor(beta1=0.9, weight_decay=0.1),
    "lamb": lambda: ft.lamb(1e-2, weight_decay=0.1),
    "came": lambda: ft.came(1e-2, weight_decay=0.1),
    # per-example gradients made from the swept ones (see _examples), clipped, noised, averaged
    "differentially_private_aggregate": lambda: ft.chain(
        _examples(), ft.differentially_private_aggregate(2.0, 0.5, seed=0)
    ),
}

# other configurations that take other code paths: "name[variant]" -> builder
VARIANTS: dict[str, Callable[[], ft.GradientTransformation]] = {
    # a constant learning rate: the stateless branch
    "scale_by_learning_rate[float]": lambda: ft.scale_by_learning_rate(0.1),
    # HF defaults: relative step, parameter scaling, no momentum
    "adafactor[default]": lambda: ft.adafactor(),
    # 8-bit block-wise quantised moments: every leaf quantised (min_8bit_size=0), blocks of 2
    # elements so that the tiny test leaves have several blocks per row
    "adamw[8bit]": lambda: ft.adamw(
        1e-2, weight_decay=0.1, optim_bits=8, min_8bit_size=0, block_size=2
    ),
    "galore_adamw[8bit]": lambda: ft.galore_adamw(
        1e-2, weight_decay=0.1, rank=2, update_proj_gap=2, optim_bits=8, min_8bit_size=0
    ),
    # reductions over their own leaves inside the combinators: each clip's norm over its
    # label's leaves (one fused pass after both norms), the masked clip's over its leaves
    "partition[clips]": lambda: ft.partition(
        {
            "a": ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)),
            "b": ft.chain(ft.clip_by_global_norm(0.2), ft.sgd(0.1, momentum=0.9)),
        },
        by_ndim("a", "b"),
    ),
    # lamb's first pass over its own leaves only (the "b" leaves skip it), then its trust
    # ratio and the "b" clip in one pass
    "partition[lamb]": lambda: ft.partition(
        {
            "a": ft.lamb(1e-2, weight_decay=0.1),
            "b": ft.chain(ft.clip_by_global_norm(0.2), ft.sgd(0.1)),
        },
        by_ndim("a", "b"),
    ),
    "masked[clip]": lambda: ft.chain(
        ft.masked(ft.clip_by_global_norm(0.3), by_ndim(True, False)), ft.adamw(1e-2)
    ),
    # the fused apply_if_finite guarding a partition (fields absent outside each label)
    "apply_if_finite[partition]": lambda: ft.apply_if_finite(
        ft.partition(
            {"a": ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), "b": ft.trace(0.9)},
            by_ndim("a", "b"),
        ),
        2,
    ),
    # apply_if_finite's first part (its leading clip) guarded by another wrapper: a compiled
    # multi_steps' flag "this is the cycle's last", and an outer apply_if_finite's flag (each
    # selects the part's state leaf by leaf: the same structure in and out)
    "multi_steps[apply_if_finite]": lambda: ft.multi_steps(
        ft.apply_if_finite(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), 2),
        every_k=2,
    ),
    # multi_steps inside a combinator: its fused form (traced under torch.compile) on the
    # leaves the partition gives it, None elsewhere
    "partition[multi_steps]": lambda: ft.partition(
        {
            "a": ft.multi_steps(
                ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)), 2
            ),
            "b": ft.multi_steps(ft.sgd(0.1, momentum=0.9), 2),
        },
        by_ndim("a", "b"),
    ),
    "apply_if_finite[nested]": lambda: ft.apply_if_finite(
        ft.apply_if_finite(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), 1), 2
    ),
    # a weight-decay mask: the masked decay, and ft.step's fused kernel in two calls
    "adamw[mask]": lambda: ft.adamw(1e-2, weight_decay=0.1, mask=ft.decay_mask),
    # b1, eps and the (L2) weight decay as tensors the transforms read at every update
    "inject_hyperparams[tensors]": lambda: ft.inject_hyperparams(ft.adam)(
        learning_rate=1e-2, b1=0.8, eps=1e-7, weight_decay=0.1
    ),
    # hyperparameters read on the host (a factory that declares none as tensors: trace's decay
    # and dampening): the transform rebuilt when they change
    "inject_hyperparams[host]": lambda: ft.inject_hyperparams(ft.trace)(decay=0.9, dampening=0.1),
    # TorchOptimizer's param groups with a scheduler: a partition of clipped, injected aliases
    # (their fused form chosen per call; under torch.compile, restricted parts made when the
    # partition is built over those the injected chain declares)
    "partition[inject]": lambda: ft.partition(
        {
            "a": ft.chain(
                ft.clip_by_global_norm(0.5),
                ft.inject_hyperparams(ft.adamw)(
                    learning_rate=ft.schedules.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.1
                ),
            ),
            "b": ft.inject_hyperparams(ft.sgd)(learning_rate=0.1, momentum=0.9),
        },
        by_ndim("a", "b"),
    ),
    # dynamic_loss_scale around a Switch (the injected chain's)
    "dynamic_loss_scale[inject]": lambda: ft.dynamic_loss_scale(
        ft.chain(
            ft.clip_by_global_norm(1.0),
            ft.inject_hyperparams(ft.adamw)(learning_rate=1e-2, weight_decay=0.1),
        ),
        init_scale=2.0**4,
    ),
    # finiteness read from the leading clip's norm instead of its own all-reduce
    "apply_if_finite[clip]": lambda: ft.apply_if_finite(
        ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2)), 2
    ),
}


def _rms_leaf(u, p, v, *, beta, lr):
    v = beta * v + (1 - beta) * u * u
    return -lr * u / (torch.sqrt(v) + 1e-8), v


EXCLUDED: dict[str, str] = {
    "ElementwiseState": "a state type",
    "GradientTransformation": "the (init, update) NamedTuple type itself",
    "EmptyState": "a state type (checked through the transforms that return it)",
    "differentiable": "a context manager for autograd (tests/test_unusual_input.py)",
    "decay_mask": "builds a mask tree, not a transform (swept as adamw[mask]; "
    "tests/test_decay_mask.py)",
    "is_differentiable": "its query",
    "vmap": "torch.func.vmap with None leaves passed through: how the vmap property runs every "
    "transform (tests/test_func.py)",
    "PartitionState": "a state type",
    "MaskedState": "a state type",
    "ClipByGlobalNormState": "a state type",
    "MultiStepsState": "a state type",
    "ZeroRedundancyState": "a state type",
    "ScaleByScheduleState": "a state type",
    "TraceState": "a state type",
    "ScaleByAdamState": "a state type",
    "ScaleByAmsgradState": "a state type (adam's amsgrad=True entry returns it)",
    "ScaleByFactoredRmsState": "a state type",
    "EmaState": "a state type",
    "ScaleByCameState": "a state type",
    "GaLoreState": "a state type",
    "InjectHyperparamsState": "a state type",
    "EmaParamsState": "a state type",
    "DifferentiallyPrivateAggregateState": "a state type",
    "averaged_params": "reads the average from a state, not a transform (tests/test_ema_params.py)",
    "TorchOptimizer": "a torch.optim.Optimizer running a transform, not a transform "
    "(tests/test_torch_optimizer.py)",
    "set_hyperparams": "sets values in a state, not a transform (tests/test_hyperparams.py)",
    "get_hyperparams": "reads values from a state, not a transform (tests/test_hyperparams.py)",
    "ApplyIfFiniteState": "a state type",
    "ZeroNansState": "a state type",
    "DynamicLossScaleState": "a state type",
    "skip_not_finite": "a should_skip_update_fn for multi_steps, not a transform "
    "(tests/test_nonfinite.py)",
    "skip_large_updates": "a should_skip_update_fn for multi_steps, not a transform "
    "(tests/test_nonfinite.py)",
    "all_finite": "a query returning a 0-dim bool, not a transform (tests/test_nonfinite.py)",
    "loss_scale": "reads the scale from a state, not a transform (tests/test_nonfinite.py)",
    "ScaleByAdam8bitState": "a state type (adamw[8bit] and galore_adamw[8bit] return it)",
    "create_dynamic_map": "builds the 8-bit code map (a tensor), not a transform (swept through "
    "the [8bit] variants)",
    "quantize_blockwise": "a tensor -> (codes, absmax) helper, not a transform",
    "dequantize_blockwise": "a (codes, absmax) -> tensor helper, not a transform",
    "Mesh": "the mesh descriptor, an argument of update, not a transform",
    "step": "update + apply_updates as one call, not a transform (swept as the step and "
    "step_sharded properties of every transform)",
    "apply_updates": "params + updates, not a transform (used by every property that steps)",
    "precompiled_step": "ft.step compiled ahead of time and loaded by a later process, not a "
    "transform (tests/test_precompile.py)",
    "PrecompiledStep": "the callable precompiled_step returns (tests/test_precompile.py)",
    "tree_get": "a state-inspection helper, not a transform",
    "has_updated": "reads a MultiStepsState, not a transform",
    "global_norm": "a function of a gradient tree returning a tensor, not a transform "
    "(swept through clip_by_global_norm)",
    "galore_param_labels": "builds galore_adamw's labels tree, not a transform",
    "muon_param_labels": "builds muon's labels tree, not a transform",
    "MuonDimensionNumbers": "muon's matrix axes per leaf, a parameter of scale_by_muon and muon "
    "(tests/test_muon.py: stacked experts, convolutions, sharded == unsharded)",
    "MUON_EXCLUDE": "muon_param_labels' default names (tests/test_muon.py: BERT, ViT, GPT-2)",
    "newton_schulz": "a function of one matrix (tests/test_muon.py), not a transform",
    "ScaleByMuonState": "a state type (checked through scale_by_muon and muon)",
    "relative_step_schedule": "a schedule (count -> step size), not a transform (swept through "
    "adafactor[default])",
    "schedules": "the module of learning-rate schedules (swept through scale_by_learning_rate)",
    "checkpoint": "a module: save / load of params and states on torch.distributed.checkpoint "
    "(tests/test_resume.py)",
}


def all_entries() -> dict[str, Callable[[], ft.GradientTransformation]]:
    return {**FACTORIES, **VARIANTS}


def base_name(entry: str) -> str:
    return entry.split("[", 1)[0]


# ---------------------------------------------------------------------------------------------
# exceptions by design
# ---------------------------------------------------------------------------------------------
_GLOBAL_NORM = (
    "the clip factor is one number from the norm of the whole tree: a leaf's update "
    "depends on the other leaves by design"
)
_PASSES_UNREDUCED = (
    "identity passes gradients that are unreduced over the data axis on unreduced, by design "
    "(passes_unreduced): each replica's contribution is its correct output"
)
_PER_EXAMPLE = (
    "per-example gradients are plain tensors on each data-parallel replica (a DTensor leaf "
    "raises a TypeError naming it); tests/test_privacy.py runs simulated replicas against one "
    "process"
)
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("clip_by_global_norm", "mixed_dtypes"): _GLOBAL_NORM,
    ("chain", "mixed_dtypes"): _GLOBAL_NORM,
    ("apply_if_finite[clip]", "mixed_dtypes"): _GLOBAL_NORM,
    ("partition[clips]", "mixed_dtypes"): _GLOBAL_NORM,
    ("partition[lamb]", "mixed_dtypes"): _GLOBAL_NORM,
    ("masked[clip]", "mixed_dtypes"): _GLOBAL_NORM,
    ("apply_if_finite[partition]", "mixed_dtypes"): _GLOBAL_NORM,
    ("partition[inject]", "mixed_dtypes"): _GLOBAL_NORM,
    ("multi_steps[apply_if_finite]", "mixed_dtypes"): _GLOBAL_NORM,
    ("apply_if_finite[nested]", "mixed_dtypes"): _GLOBAL_NORM,
    ("partition[multi_steps]", "mixed_dtypes"): _GLOBAL_NORM,
    ("identity", "sharded_data_axis"): _PASSES_UNREDUCED,
    ("identity", "zero_grads_sharded"): _PASSES_UNREDUCED,
    ("differentially_private_aggregate", "mixed_dtypes"): "each example is clipped to its "
    "norm over every leaf: a leaf's update depends on the other leaves by design",
    **{
        ("differentially_private_aggregate", prop): _PER_EXAMPLE
        for prop in (
            "sharded",
            "sharded_data_axis",
            "state_placements",
            "zero_redundancy_dp",
            "step_sharded",
            "zero_grads_sharded",
            "compile_dtensor",
        )
    },
}

# Transforms whose update may read a documented CPU step counter on the host (a 0-dim int64 CPU
# tensor: no device synchronisation). The no-host-sync property allows exactly those reads:
# `aten._local_scalar_dense` of the very MultiStepsState.mini_step / GaLoreState.count tensors
# found in the input state, and nothing else.
HOST_COUNTER_READS: dict[str, str] = {
    "multi_steps": "MultiStepsState.mini_step decides on the host whether the micro-step is the "
    "final one, and MultiStepsState.seen which leaves had a gradient in the cycle "
    "(documented in multi_steps' state docstring)",
    "galore": "GaLoreState.count decides on the host whether the projector is refreshed "
    "(documented in GaLoreState's docstring)",
    "galore_adamw": "a galore chain: GaLoreState.count, as galore",
    "differentially_private_aggregate": "DifferentiallyPrivateAggregateState.count seeds the "
    "noise's generator on the host (documented in its docstring)",
    "inject_hyperparams[tensors]": "InjectHyperparamsState.hyperparams (float64 CPU tensors) are "
    "read as floats eagerly (no device synchronisation; a compiled "
    "step takes them as tensors; documented in value_of)",
    "partition[inject]": "InjectHyperparamsState.hyperparams, as inject_hyperparams[tensors], "
    "and its count, by which the groups share a schedule's value (documented in "
    "InjectHyperparamsState's docstring)",
    "partition[multi_steps]": "MultiStepsState.mini_step and .seen of each label's multi_steps, "
    "as multi_steps",
    "dynamic_loss_scale[inject]": "InjectHyperparamsState.hyperparams, as "
    "inject_hyperparams[tensors]",
    "inject_hyperparams[host]": "InjectHyperparamsState.hyperparams (float64 CPU tensors) that "
    "the factory does not declare as tensors (trace's) are read "
    "on the host to rebuild it when they change (documented in "
    "inject_hyperparams)",
}


def host_reads_allowed(name: str) -> bool:
    """Whether ``name`` (or the transform it is an entry of) may read a documented CPU counter
    on the host (``HOST_COUNTER_READS``): where it does, a compiled step has one graph per
    branch it takes."""
    return name in HOST_COUNTER_READS or base_name(name) in HOST_COUNTER_READS


# Transforms that torch.compile only with graph breaks (compiled with fullgraph=False; the
# compile property still requires eager's numbers): none so far, every transform that compiles
# at all traces as ONE graph.
COMPILE_GRAPH_BREAKS: dict[str, str] = {
    "differentially_private_aggregate": "the noise's generator is seeded on the host from the "
    "CPU count and drawn outside the graph (documented in its docstring)",
    "inject_hyperparams[host]": "trace's decay and dampening are read on the host (a factory "
    "without @injectable; documented in inject_hyperparams)",
}

# transforms that need at least one DTensor parameter (or a mesh at construction) to shard: on a
# tree of plain tensors only, the sharded run must raise a ValueError matching the pattern
# (zero_redundancy: init sees no mesh, so update refuses to mix a whole-leaf state with shards)
NEEDS_A_DTENSOR: dict[str, str] = {"zero_redundancy": "pass the mesh at construction"}

# (empty since session 62: galore_adamw's torch_optimizer_compile cases, listed here since the
# property was written in session 58, pass since tree.tree_unflatten works around dynamo's
# treespecs that cross a graph break)
KNOWN_BUGS: dict[tuple[str, str], str] = {}

# The vmap and grad properties build these instead of the registry's builder, for the reason
# given (name -> (builder, reason)).
_MUON_F64 = (
    "torch.optim.Muon's bfloat16 Newton-Schulz: a batched bfloat16 matmul rounds otherwise than "
    "one matrix's, and the finite differences of a bfloat16 function are its rounding; the "
    "float64 Newton-Schulz is the same code"
)
FUNC_BUILDERS: dict[str, tuple[Callable[[], ft.GradientTransformation], str]] = {
    "muon": (lambda: ft.muon(1e-2, weight_decay=0.1, ns_dtype=torch.float64), _MUON_F64),
}

# The torch_optimizer_compile property builds these instead of the registry's builder
# (name -> (builder, reason)).
_MUON_INDUCTOR = (
    "a bfloat16 Newton-Schulz compiled by inductor rounds otherwise than torch's eager "
    "matmuls (1e-4 of the parameters after one step); the float64 Newton-Schulz is the same code"
)
COMPILED_BUILDERS: dict[str, tuple[Callable[[], ft.GradientTransformation], str]] = {
    "muon": (FUNC_BUILDERS["muon"][0], _MUON_INDUCTOR),
}

# The transforms that refuse to be differentiated (torch.func.grad / jvp, ft.differentiable()),
# and the error they raise (NotImplementedError, a regex): their computation has no useful
# derivative, and a derivative through it would be silently wrong.
_SVD = r"galore: the projector refresh \(an SVD of the gradient.*is not differentiable"
_8BIT = r"scale_by_adam with optim_bits=8: 8-bit quantisation of the moments is not"
NOT_DIFFERENTIABLE: dict[str, str] = {
    "galore": _SVD,  # (the second update refreshes: update_proj_gap=2)
    "galore_adamw": _SVD,
    "galore_adamw[8bit]": _8BIT,
    "adamw[8bit]": _8BIT,
}

# The grad property holds the state leaves whose path contains the substring constant, for the
# reason given (name -> (substring, reason)).
GRAD_HELD_STATE: dict[str, tuple[str, str]] = {
    "inject_hyperparams[host]": (
        "hyperparams",
        "trace's decay and dampening are read on the host (the transform is rebuilt when they "
        "change): a traced value there raises a TypeError (tests/test_func.py)",
    ),
}


# ---------------------------------------------------------------------------------------------
# reference implementations
# ---------------------------------------------------------------------------------------------
# ``reference(params, grads_per_step) -> [params after each step]``: the implementation a
# transform reproduces, run on clones of the params (a dict of plain tensors)
Reference = Callable[[dict, list], list]


def stepped(make: Callable[[dict], Callable[[], None]]) -> Reference:
    """The reference run of a torch-style optimizer: ``make(ref_params)`` (a dict of
    ``nn.Parameter`` clones of the params) builds it and returns its ``step()``, which reads the
    ``.grad`` of those parameters and updates them in place."""

    def run(params: dict, grads_per_step: list) -> list:
        hp = {k: torch.nn.Parameter(x.detach().clone()) for k, x in params.items()}
        step = make(hp)
        out = []
        for g in grads_per_step:
            for k, p in hp.items():
                p.grad = g[k].detach().clone()
            step()
            out.append({k: p.detach().clone() for k, p in hp.items()})
        return out

    return run


def _optim(cls, **kw) -> Reference:
    return stepped(lambda hp: cls(list(hp.values()), **kw).step)


def _clipped(clip: Callable, inner: Callable | None = None) -> Reference:
    """``clip`` (a ``torch.nn.utils`` clipping of the ``.grad``) then the optimizer
    ``inner(params)``, or, without one, ``param += grad`` (the clipped gradient is the update)."""

    def make(hp):
        ps = list(hp.values())
        opt = None if inner is None else inner(ps)

        def step():
            clip(ps)
            if opt is not None:
                opt.step()
                return
            with torch.no_grad():
                for p in ps:
                    p.add_(p.grad)

        return step

    return stepped(make)


def _hf_adafactor(**kw) -> Reference:
    def make(hp):
        from transformers.optimization import Adafactor  # (imported when first run)

        return Adafactor(list(hp.values()), **kw).step

    return stepped(make)


def _came(**kw) -> Reference:
    def make(hp):
        from came_pytorch import CAME

        return CAME(list(hp.values()), **kw).step

    return stepped(make)


def _muon(lr: float, weight_decay: float) -> Reference:
    """``torch.optim.Muon`` on the leaves of 2 or more dims (views of the parameters: a 3-D
    leaf's matrices each a parameter of its own, stacked experts; 2-D and 4-D and more as
    ``(rows, -1)`` matrices), ``torch.optim.AdamW`` on the others: ``ft.muon``'s split and its
    default dimension numbers."""

    def make(hp):
        mats = {}
        for k, p in hp.items():
            if p.ndim == 3:
                mats.update({(k, i): torch.nn.Parameter(p.data[i]) for i in range(p.shape[0])})
            elif p.ndim >= 2:
                mats[(k, None)] = torch.nn.Parameter(p.data.view(p.shape[0], -1))
        muon = torch.optim.Muon(list(mats.values()), lr=lr, weight_decay=weight_decay)
        rest = [p for k, p in hp.items() if p.ndim < 2]
        adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay)

        def step():
            for (k, i), q in mats.items():
                q.grad = hp[k].grad.reshape(q.shape) if i is None else hp[k].grad[i].clone()
            muon.step()
            adamw.step()

        return step

    return stepped(make)


def _galore_adamw(lr: float, weight_decay: float, rank: int, update_proj_gap: int) -> Reference:
    """``galore_torch.GaLoreAdamW``: the 2-D leaves projected (``galore_param_labels``' group,
    scale 0.25, ``proj_type="std"``), the others plain AdamW, all with the weight decay."""

    def make(hp):
        import warnings

        with warnings.catch_warnings():  # galore-torch imports bitsandbytes (no GPU: warns)
            warnings.simplefilter("ignore")
            from galore_torch import GaLoreAdamW

            groups = [
                {"params": [p for p in hp.values() if p.ndim != 2]},
                {
                    "params": [p for p in hp.values() if p.ndim == 2],
                    "rank": rank,
                    "update_proj_gap": update_proj_gap,
                    "scale": 0.25,
                    "proj_type": "std",
                },
            ]
            return GaLoreAdamW(groups, lr=lr, weight_decay=weight_decay).step

    return stepped(make)


def _lamb(lr: float, weight_decay: float) -> Reference:
    """The LAMB equations (``tests/test_lamb.py``'s, optax's ``lamb``) in float64, with
    ``ft.lamb``'s defaults ``b1=0.9, b2=0.999, eps=1e-6``, bias correction on."""

    def run(params: dict, grads_per_step: list) -> list:
        from test_lamb import reference_lamb  # (a whole run per call: one per prefix)

        p64 = {k: x.double() for k, x in params.items()}
        g64 = [{k: x.double() for k, x in g.items()} for g in grads_per_step]
        out = []
        for t in range(len(g64)):
            p, _, _ = reference_lamb(p64, g64[: t + 1], lr, 0.9, 0.999, 1e-6, weight_decay, True)
            out.append({k: x.to(params[k].dtype) for k, x in p.items()})
        return out

    return run


def _references() -> dict[str, Reference]:
    clip_norm = lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0)  # noqa: E731
    clip_value = lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.5)  # noqa: E731
    adamw = lambda wd: lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=wd)  # noqa: E731
    return {
        "chain": _clipped(clip_norm, adamw(0.1)),
        "named_chain": _clipped(clip_value, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        "clip": _clipped(clip_value),
        "clip_by_global_norm": _clipped(clip_norm),
        "zero_redundancy": _optim(torch.optim.AdamW, lr=1e-2),
        "inject_hyperparams": _optim(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
        "inject_hyperparams[tensors]": _optim(
            torch.optim.Adam, lr=1e-2, betas=(0.8, 0.999), eps=1e-7, weight_decay=0.1
        ),
        "apply_if_finite": _optim(torch.optim.AdamW, lr=1e-2),
        "apply_if_finite[clip]": _clipped(clip_norm, adamw(0.01)),
        "sgd": _optim(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.1),
        "adam": _optim(torch.optim.Adam, lr=1e-2, weight_decay=0.1, amsgrad=True),
        "adamw": _optim(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
        "adafactor": _hf_adafactor(beta1=0.9, weight_decay=0.1),
        "adafactor[default]": _hf_adafactor(),
        "came": _came(lr=1e-2, weight_decay=0.1),
        "lamb": _lamb(1e-2, 0.1),
        "muon": _muon(1e-2, 0.1),
        "galore_adamw": _galore_adamw(1e-2, 0.1, rank=2, update_proj_gap=2),
    }


REFERENCES: dict[str, Reference] = _references()
