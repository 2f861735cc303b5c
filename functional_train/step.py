"""``step``: one optimizer step, ``update`` then ``apply_updates``, fused where possible.

A transform whose chain is made of elementwise specs (``functional_train/engine/
elementwise.py``) runs as its stages, ``p + u`` fused into the last one (:func:`_run_spec`):
on CPU parameters (float32, float64, bfloat16, float16) that path comes first, eagerly and
under ``torch.compile`` (where a stage is the operator ``functional_train::fused_stage``), for
every such chain, the ``sgd`` / ``adam`` / ``adamw`` ones included. What follows describes
the paths the other cases take (CUDA parameters keep the recognised chains' torch fused
kernels; Adafactor, CAME, GaLore and 8-bit Adam their own steps).

The general path runs any transform on the local view (the chain's primitives hand local shards
along; DTensors are built once, for the new parameters) and adds the updates to the local
parameter shards. The fused path, eagerly where the generated stages do not run (CUDA),
recognises ``sgd``, ``adam`` and ``adamw`` (32-bit moments), alone or after
``clip_by_global_norm``, and runs torch's fused optimizer kernels (``torch._fused_sgd_``,
``_fused_adam_``, ``_fused_adamw_``) on the local shards, one pass per group of leaves, with
the clip factor as the kernel's gradient scale (a pure step copies its inputs first). The
numbers are those of the primitives up to float rounding, and sharded equals unsharded as for
``update``: the kernels are elementwise, and the clip norm takes the same one scalar
all-reduce. ``adafactor`` without ``beta1`` and ``came`` have a per-leaf path where no leaf
needs communication (plain tensors, one process): each large leaf is finished -- statistics,
update, clipping, moments, added to its parameter -- while it is in cache, as the reference
implementations' per-parameter loops do, with the chain's numbers bit for bit; so does
``galore_adamw`` between projector refreshes, and 8-bit Adam (these per-leaf steps live in
:mod:`functional_train.per_leaf`, each calling its algorithm module's definitions). Under
``torch.compile`` these recognised paths are not taken: the chain compiles.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree

from . import aliasing
from .autograd import is_differentiable, requires_grad_like
from .base import GradientTransformation, accepts_view, run_sequence
from .came import FusedCame
from .clipping import ClipByGlobalNormState, clip_factor, global_norm_of, global_norm_start
from .engine import elementwise as E
from .engine.dtensor import to_local, to_locals, wrap_like, wraps_like
from .engine.metadata import verifying
from .engine.pool import Pool, of_plan
from .engine.scalars import scalar_program, schedule_value
from .engine.view import Prepared, per_leaf_view, prepare
from .factored import FusedAdafactor
from .galore import FusedGaLore
from .hyperparams import InjectHyperparamsState, is_injected, value_of
from .leaves import DTYPE, SHAPE, on_device
from .mesh import Mesh
from .per_leaf import (
    fused_adafactor_step,
    fused_adam8bit_step,
    fused_came_step,
    fused_galore_step,
)
from .quantization import FusedAdam8bit
from .spec import transform_spec
from .transforms import ScaleByAdamState, ScaleByAmsgradState, ScaleByScheduleState, TraceState
from .tree import (
    CONSTANT_TYPES,
    PyTree,
    flatten_as,
    leaves_of,
    plain_node,
    tensors_into,
    tensors_or_none,
    tree_flatten,
    tree_unflatten,
    unflatten_like,
)
from .update import apply_updates, paired_locals, params_like

__all__ = ["step"]


@dataclasses.dataclass(frozen=True)
class FusedAdam:
    """What ``adam`` / ``adamw`` computed, for the fused kernels (attached to the alias's
    chain's spec as ``fused``): hyper-parameters and where the moments and the learning-rate
    state sit in the chain's state tuple."""

    decoupled: bool
    learning_rate: float | Callable
    b1: float
    b2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    adam_index: int
    lr_index: int
    mask: Callable | None = None  # params -> [bool per leaf]: the leaves decayed


@dataclasses.dataclass(frozen=True)
class FusedSGD:
    """What ``sgd`` computes, for ``torch._fused_sgd_`` (see :class:`FusedAdam`)."""

    learning_rate: float | Callable
    momentum: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    trace_index: int | None
    lr_index: int
    dampening: float = 0.0  # of the momentum (an injected one; the kernel takes only 0)


def _program(tx: GradientTransformation):
    """``(clip, fused)`` when ``tx`` is a fusable optimizer, optionally after a
    ``clip_by_global_norm``: ``clip`` is ``(max_norm, norm_type)`` or ``None``."""
    spec = transform_spec(tx)
    fused = spec.fused
    if fused is not None:
        return None, fused
    parts = spec.parts
    if parts is not None and len(parts) == 2:
        clip = _clip_of(parts[0])
        fused = transform_spec(parts[1]).fused
        if clip is not None and fused is not None:
            return clip, fused
    return None


def _clip_of(tx) -> tuple | None:
    """``(max_norm, norm_type, its elementwise part)`` of a ``clip_by_global_norm``, else
    ``None``."""
    clip = transform_spec(tx).clip
    return None if clip is None else (*clip, E.spec_of_transform(tx))


def _injected_after_clip(tx, grads, state, params, mesh, donate):
    """The fused step of ``chain(clip_by_global_norm, inject_hyperparams(alias)(...))`` (what
    :class:`~functional_train.TorchOptimizer` makes of a clipped alias) by torch's fused
    kernels where the generated stages do not run (CUDA, half precision), or ``None``."""
    parts = transform_spec(tx).parts
    if parts is None or len(parts) != 2:
        return None
    clip = _clip_of(parts[0])
    injected = transform_spec(parts[1]).inject
    if (
        clip is None
        or injected is None
        or torch.compiler.is_compiling()
        or is_differentiable()
        or _spec_first(params)  # (the chain's generated stages: its Switch)
    ):
        return None
    if not (
        isinstance(state, tuple)
        and len(state) == 2
        and isinstance(state[1], InjectHyperparamsState)
    ):
        return None
    inner, hp, count = injected.resolve(state[1])
    fused = transform_spec(inner).fused
    if fused is None:
        return None
    out = _run_fused(
        None, clip, fused, grads, (state[0], state[1].inner_state), params, mesh, donate
    )
    if out is None:
        return None
    new_params, (new_clip, new_inner) = out
    return new_params, (new_clip, InjectHyperparamsState(count, hp, new_inner))


def _learning_rate(lr, state_count, like: torch.Tensor):
    if not callable(lr):
        return lr
    value = schedule_value(lr, state_count)
    return value.to(device=like.device, dtype=like.dtype)


def _fusable(ts_lists) -> bool:
    """Every leaf of every list: one floating (not complex) dtype, the local shape of the first
    list's leaf, contiguous, one device (the kernels' requirements)."""
    first = ts_lists[0]
    dtype, device = first[0].dtype, first[0].device
    if dtype not in _KERNEL_DTYPES:
        return False
    shapes = list(map(SHAPE, first))
    for lst in ts_lists:  # whole-list checks in C loops: this runs for every step
        try:
            if list(map(SHAPE, lst)) != shapes:
                return False
        except AttributeError:  # a None leaf
            return False
        if set(map(DTYPE, lst)) != {dtype} or not all(map(_CONTIGUOUS, lst)):
            return False
        if not on_device(lst, device):
            return False
    return True


_CONTIGUOUS = torch.Tensor.is_contiguous
_KERNEL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _resolved(fused):
    """``fused`` with its injected hyperparameters (``inject_hyperparams``) read as floats:
    the kernels take Python numbers (eagerly only: a compiled step takes the chain)."""
    if not dataclasses.is_dataclass(fused):
        return fused
    names = [
        f.name
        for f in dataclasses.fields(fused)  # (the learning rate: a schedule)
        if is_injected(v := getattr(fused, f.name)) and v.name != "learning_rate"
    ]
    if not names:
        return fused
    return dataclasses.replace(fused, **{n: value_of(getattr(fused, n)) for n in names})


def _run_fused(tx, clip, fused, grads, state, params, mesh, donate):
    """The fused step, or ``None`` when the inputs do not fit the kernels (general path).

    Eager only: under ``torch.compile`` the chain compiles (on CPU its generated stages, the
    operator ``functional_train::fused_stage``)."""
    if torch.compiler.is_compiling():
        return None
    fused = _resolved(fused)
    if isinstance(fused, FusedAdam8bit):
        return (
            None
            if clip is not None or tx is None
            else fused_adam8bit_step(tx, fused, grads, state, params, mesh, donate, _apply)
        )
    if isinstance(fused, FusedGaLore):
        return (
            None
            if clip is not None
            else fused_galore_step(fused, grads, state, params, mesh, donate)
        )
    if isinstance(fused, (FusedAdafactor, FusedCame)):
        run = fused_adafactor_step if isinstance(fused, FusedAdafactor) else fused_came_step
        if clip is None:
            return run(fused, grads, state, params, mesh, donate)
        return _clipped_per_leaf(run, clip, fused, grads, state, params, mesh, donate)
    if clip is not None:
        if not (
            isinstance(state, tuple)
            and len(state) == 2
            and isinstance(state[0], ClipByGlobalNormState)
        ):
            return None
        clip_state, opt_state = state
    else:
        clip_state, opt_state = None, state
    if not isinstance(opt_state, tuple) or hasattr(opt_state, "_fields"):
        return None
    b = prepare(grads, params, mesh, need_params=True, name="step")
    act = b.active
    if not act:
        return None
    pl_tree, treedef = tree_flatten(params)
    g = [b.locals[i] for i in act]
    p = [b.params[i] for i in act]
    if isinstance(fused, FusedAdam):
        st = opt_state[fused.adam_index]
        if type(st) not in (ScaleByAdamState, ScaleByAmsgradState) or (
            fused.amsgrad != isinstance(st, ScaleByAmsgradState)
        ):
            return None
        fields = ("mu", "nu", "nu_max") if fused.amsgrad else ("mu", "nu")
    else:
        if fused.dampening != 0.0:
            return None
        # (an injected momentum of 0: no buffer work, the trace state kept, as trace does)
        st = (
            None
            if fused.trace_index is None or fused.momentum == 0.0
            else opt_state[fused.trace_index]
        )
        if st is not None and not isinstance(st, TraceState):
            return None
        fields = () if st is None else ("trace",)
    trees = {
        f: flatten_as(getattr(st, f), treedef, f"{type(st).__name__}.{f}", "params") for f in fields
    }
    bufs = {f: to_locals([trees[f][i] for i in act]) for f in fields}
    if not _fusable([p, g, *bufs.values()]):
        return None
    lr_state = opt_state[fused.lr_index]
    count = lr_state.count if isinstance(lr_state, ScaleByScheduleState) else None
    if callable(fused.learning_rate) and count is None:
        return None
    # the clip factor, from the same one scalar all-reduce as clip_by_global_norm, issued
    # here and waited for once the result buffers are allocated (_pure)
    coef = None if clip is None else _ClipFactor(global_norm_start(b, clip[1]), clip[0])
    lr = _learning_rate(
        fused.learning_rate, count, torch.empty((), dtype=torch.float64, device=p[0].device)
    )
    new_count = st.count + 1 if st is not None else None
    groups = [(list(range(len(p))), fused.weight_decay)]
    if isinstance(fused, FusedAdam) and fused.mask is not None:  # decayed leaves, the others
        keep = fused.mask(params)
        groups = [
            ([k for k, i in enumerate(act) if bool(keep[i]) == on], wd)
            for on, wd in ((True, fused.weight_decay), (False, 0.0))
        ]
        groups = [(ks, wd) for ks, wd in groups if ks]
    with torch.no_grad():
        if donate:
            new_p, new_bufs = p, bufs
            _in_place(fused, groups, new_p, g, new_bufs, _resolve(coef), lr, new_count)
        else:
            new_p, new_bufs = _pure(
                fused, groups, of_plan(b.plan, "pool", Pool), p, g, bufs, coef, lr, new_count
            )
    # the new trees
    if donate:
        out_params = params
    else:
        out_params = tree_unflatten(treedef, params_like(list(pl_tree), act, new_p))
    new_fields = {}
    for f in fields:
        if donate:
            new_fields[f] = getattr(st, f)
            continue
        leaves = list(trees[f])
        for i, x in zip(act, wraps_like(new_bufs[f], [trees[f][i] for i in act])):
            leaves[i] = x
        new_fields[f] = tree_unflatten(treedef, leaves)
    new_opt = list(opt_state)
    if st is not None:
        new_opt[fused.adam_index if isinstance(fused, FusedAdam) else fused.trace_index] = (
            st._replace(count=new_count, **new_fields)
        )
    if count is not None:
        new_opt[fused.lr_index] = ScaleByScheduleState(count + 1)
    new_opt = tuple(new_opt)
    if clip is not None:
        new_clip = ClipByGlobalNormState(coef.norm().to(clip_state.global_norm.dtype))
        return out_params, (new_clip, new_opt)
    return out_params, new_opt


class _ClipFactor:
    """A step's clip factor ``min(1, max_norm / (norm + 1e-6))`` whose norm's all-reduce is in
    flight (``finish`` from :func:`~functional_train.clipping.global_norm_start`): the step
    allocates its results meanwhile, then :func:`_resolve` waits for it (once)."""

    __slots__ = ("finish", "max_norm", "total", "coef")

    def __init__(self, finish, max_norm: float):
        self.finish, self.max_norm, self.total, self.coef = finish, max_norm, None, None

    def get(self) -> torch.Tensor:
        if self.coef is None:
            self.total = self.finish()
            self.coef = clip_factor(self.total, self.max_norm)
        return self.coef

    def norm(self) -> torch.Tensor:
        """The global norm before clipping (the clip state's)."""
        self.get()
        return self.total


def _resolve(coef):
    """The clip factor as a tensor (``None`` without a clip)."""
    return coef.get() if isinstance(coef, _ClipFactor) else coef


def _pure(fused, groups, pool, p, g, bufs, coef, lr, count):
    """The pure fused step's new parameters and moments (lists like ``p`` and ``bufs``'s),
    written into fresh buffers (pooled on CPU, see :mod:`.engine.pool`); the inputs are not
    modified: they are copied, and torch's in-place kernel runs on the copies (and on a scratch
    copy of the gradients when a clip factor is the kernel's gradient scale, which it writes
    back)."""
    new_p, new_bufs = list(p), {f: list(v) for f, v in bufs.items()}  # filled below
    groups = [(ks, wd) for ks, wd in groups if ks]
    rest = sorted(k for ks, _ in groups for k in ks)
    if not rest:
        return new_p, new_bufs

    def sub(xs):
        return [xs[k] for k in rest] if len(rest) < len(xs) else list(xs)

    src, dst = [], []  # the copies, made by one foreach copy below

    def copies(kind, xs, scratch=False):
        taken = pool.scratch(kind, xs) if scratch else pool.take(kind, xs)
        src.extend(xs)
        dst.extend(taken)
        return taken

    for k, x in zip(rest, copies("params", sub(p))):
        new_p[k] = x
    for f in bufs:
        for k, x in zip(rest, copies(f, sub(bufs[f]))):
            new_bufs[f][k] = x
    g_in = g
    if coef is not None:  # a scratch copy of the gradients, unscaled by the kernel
        g_in = list(g)
        for k, x in zip(rest, copies("grads", sub(g), scratch=True)):
            g_in[k] = x
    torch._foreach_copy_(dst, src)
    _in_place(fused, groups, new_p, g_in, new_bufs, _resolve(coef), lr, count)
    return new_p, new_bufs


def _in_place(fused, groups, p, g, bufs, coef, lr, count):
    """torch's in-place fused kernel on the leaves of ``groups`` (``(indices, weight_decay)``)
    of ``p`` with ``g`` and the moments ``bufs``; the clip factor ``coef`` as its gradient
    scale (which it writes back into ``g``), float64 gradients scaled here instead."""
    grad_scale = None
    if coef is not None and p[0].dtype != torch.float64:
        grad_scale = (1.0 / coef).to(torch.float32)
    if (
        isinstance(lr, torch.Tensor)
        and p[0].device.type != "cpu"
        and (lr.device != p[0].device or lr.dtype != torch.float32)
    ):
        # (an injected learning rate is a float64 tensor; torch's CUDA kernels take a float32
        # one on the parameters' device: "expected scalar type Float but found Double")
        lr = lr.to(device=p[0].device, dtype=torch.float32)
    for ks, wd in groups:

        def sub(xs):
            return [xs[k] for k in ks] if len(ks) < len(xs) else xs

        if coef is not None and grad_scale is None:  # the kernels take a float32 scale
            torch._foreach_mul_(sub(g), coef)
        if isinstance(fused, FusedAdam):
            kernel = torch._fused_adamw_ if fused.decoupled else torch._fused_adam_
            steps = [count.to(device=p[0].device, dtype=torch.float32)] * len(ks)
            kernel(
                sub(p),
                sub(g),
                sub(bufs["mu"]),
                sub(bufs["nu"]),
                sub(bufs["nu_max"]) if fused.amsgrad else [],
                steps,
                lr=lr,
                beta1=fused.b1,
                beta2=fused.b2,
                weight_decay=wd,
                eps=fused.eps,
                amsgrad=fused.amsgrad,
                maximize=fused.maximize,
                grad_scale=grad_scale,
            )
        else:
            torch._fused_sgd_(
                sub(p),
                sub(g),
                sub(bufs["trace"]) if "trace" in bufs else [],
                weight_decay=fused.weight_decay,
                momentum=fused.momentum,
                lr=lr,
                dampening=0.0,
                nesterov=fused.nesterov,
                maximize=fused.maximize,
                is_first_step=False,
                grad_scale=grad_scale,
            )


def _clipped_per_leaf(run, clip, fused, grads, state, params, mesh, donate):
    """``chain(clip_by_global_norm, adafactor / came)`` through their per-leaf step: the clip
    (one norm over every gradient, then its part, ``g * coef``, into pooled buffers), then
    ``run`` on the clipped gradients; ``None`` (general path) where ``run`` does not apply."""
    if not (
        isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], ClipByGlobalNormState)
    ):
        return None
    view = per_leaf_view(grads, params, mesh, "step", fused.min_mean_bytes)
    if view is None:  # checked before the clip's work, which run would otherwise waste
        return None
    b = view[0]
    g_tree, treedef = tree_flatten(grads)
    max_norm, norm_type, clip_part = clip
    total = global_norm_of(b, norm_type)
    coef = clip_factor(total, max_norm)
    pool = of_plan(b.plan, "pool", Pool)
    g = [b.locals[i] for i in b.active]
    leaves = list(g_tree)
    with torch.no_grad():  # clip_by_global_norm's own part: g * coef, in each gradient's dtype
        (clipped,) = E.apply_part(clip_part, g, (), (coef,), out=[pool.take("clipped", g)])
        for i, x in zip(b.active, clipped):
            leaves[i] = x
    out = run(fused, tree_unflatten(treedef, leaves), state[1], params, mesh, donate)
    if out is None:
        return None
    return out[0], (ClipByGlobalNormState(total.to(state[0].global_norm.dtype)), out[1])


SPEC_FIRST = True


# the per-leaf steps (functional_train/per_leaf.py) of chains the engine also runs
_PER_LEAF = (FusedAdafactor, FusedCame)


def _spec_first(params) -> bool:
    """Whether a chain torch's fused kernels also run takes the generated stages instead: on
    CPU (eagerly and under ``torch.compile``, where a stage is the opaque operator
    ``functional_train::fused_stage``): equal speed, one definition, for float32 / float64
    and (computed in float, see :mod:`.engine.fuse`) bfloat16 / float16 parameters. On CUDA
    the recognised chains keep torch's fused kernels: there a step of this size is bound by
    host time, and the recognised path's is the smaller (``chain(clip, adamw)`` donated on an
    H100: 0.69x torch's foreach code against 1.07-1.12x through the generated stages; see the
    README); every other chain runs its generated Triton stages (:mod:`.engine.fuse_triton`)."""
    if not SPEC_FIRST:
        return False
    leaves = leaves_of(params)
    if not torch.compiler.is_compiling():  # (C loops: this runs for every step)
        present = [x for x in leaves if x is not None]
        try:
            return all(map(_IS_CPU, present)) and set(map(DTYPE, present)) <= _SPEC_DTYPE_SET
        except AttributeError:  # (not a tensor: the step's validation names it)
            pass
    return all(x is None or (x.device.type == "cpu" and x.dtype in _SPEC_DTYPES) for x in leaves)


_SPEC_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_SPEC_DTYPE_SET = frozenset(_SPEC_DTYPES)
_IS_CPU = operator.attrgetter("is_cpu")


def _run_spec(fus, grads, state, params, mesh, donate):
    """A fusable transform's step: its stages, the last one ending with ``p + u`` (in place
    with ``donate``, else into fresh buffers from the plan's pool)."""
    b = prepare(grads, params, mesh, need_params=True, name="step", view=True)
    return _run_spec_on(fus, b, state, params, donate)


def _fusable_suffix(tx, state, donate):
    """``(parts, states, rebuild, k, Fusable)`` for a ``chain`` (nested chains taken apart:
    ``parts`` and their ``states`` in order, ``rebuild(new states) -> the chain's state``)
    whose transforms from the ``k``-th on (``0 < k``) are elementwise while the one before is
    not (Adafactor's factored statistics, a user's ``tree_map`` transform, Newton-Schulz):
    ``ft.step`` runs the first ``k`` by their updates and the rest as fused stages, the last
    one ending with ``p + u``, as for a chain that is elementwise throughout. ``None``
    otherwise, and for a donated step whose suffix is more than one stage (an intermediate
    stage writes over its input updates, which a transform before it may share with its
    state)."""
    flat = _chain_parts(tx, state)
    if flat is None:
        return None
    parts, states, rebuild = flat
    k = len(parts)
    while k > 0 and E.fusable_of(parts[k - 1]) is not None:
        k -= 1
    if k == 0 or k == len(parts):
        return None
    fus = E.chained([E.fusable_of(t) for t in parts[k:]])
    if donate and any(part.reduces for part in fus.parts[1:]):
        return None
    return parts, states, rebuild, k, fus


def _chain_parts(tx, state):
    """``(parts, states, rebuild)`` of a ``chain`` and its state, nested chains taken apart;
    ``None`` for anything else (a state that is not the chain's: its update then raises)."""
    parts = transform_spec(tx).parts
    if (
        not parts
        or not isinstance(state, tuple)
        or hasattr(state, "_fields")
        or len(state) != len(parts)
    ):
        return None
    flat: list = []
    states: list = []
    shape: list = []
    for t, s in zip(parts, state):
        inner = _chain_parts(t, s)
        if inner is None:
            flat.append(t)
            states.append(s)
            shape.append(None)
        else:
            flat.extend(inner[0])
            states.extend(inner[1])
            shape.append((len(inner[0]), inner[2]))

    def rebuild(new: list) -> tuple:
        out, i = [], 0
        for sh in shape:
            if sh is None:
                out.append(new[i])
                i += 1
            else:
                out.append(sh[1](new[i : i + sh[0]]))
                i += sh[0]
        return tuple(out)

    return flat, states, rebuild


def _run_suffix(parts, states, rebuild, k, fus, grads, params, mesh, donate, extra):
    """:func:`_fusable_suffix`'s step: the chain's first ``k`` transforms as ``chain`` runs
    them (on the step's prepared view), then ``fus`` with ``apply_updates``."""
    b = prepare(grads, params, mesh, need_params=True, name="step", view=True)
    updates, pre = run_sequence(parts[:k], states[:k], b, params, b.mesh, extra)
    if not isinstance(updates, Prepared):  # (a foreign transform's tree)
        updates = prepare(updates, params, b.mesh, need_params=True, name="step", view=True)
    new_params, post = _run_spec_on(fus, updates, tuple(states[k:]), params, donate)
    return new_params, rebuild([*pre, *post])


def _run_spec_on(fus, b, state, params, donate):
    """:func:`_run_spec` on the prepared view ``b`` (its parameters ``params``)."""
    # (the view's detached locals: plain tensors, where nn.Parameter leaves would keep the
    # generated kernels from taking them; in place, they write the parameters' memory)
    p_loc = b.at(b.params)
    take = None if donate else of_plan(b.plan, "pool", Pool).take
    with torch.no_grad():
        new, new_state = E.run(
            fus,
            b,
            state,
            params,
            apply="donate" if donate else "pure",
            params_locals=p_loc,
            take=take,
        )
    if donate:
        return params, new_state
    if fus.zero_updates:  # the parameters as they are (recorded as shared by step)
        return params, new_state
    new_params = params_like(leaves_of(params), b.active, new)
    return unflatten_like(params, b.treedef, new_params), new_state


def _apply(params: PyTree, updates: Any, donate: bool) -> PyTree:
    """``params + updates`` on local shards; in place into the params' buffers with ``donate``."""
    if is_differentiable():  # recorded for autograd: apply_updates' checked sum
        return apply_updates(params, updates.tree() if isinstance(updates, Prepared) else updates)
    if isinstance(updates, Prepared):  # the chain's view: the plan checked the layout
        pl, treedef = tree_flatten(params)
        idx = [
            i for i, (x, u) in enumerate(zip(pl, updates.locals)) if x is not None and u is not None
        ]
        p_loc = [to_local(pl[i]) for i in idx]
        u_loc = [updates.locals[i] for i in idx]
    else:
        treedef, pl, idx, p_loc, u_loc = paired_locals(params, updates)
    u_loc = [u if u.dtype == x.dtype else u.to(x.dtype) for u, x in zip(u_loc, p_loc)]
    if not idx:
        return params
    with torch.no_grad():
        if donate:
            torch._foreach_add_(p_loc, u_loc)
            return params
        new = torch._foreach_add(p_loc, u_loc)
    return tree_unflatten(treedef, params_like(pl, idx, new))


def step(
    tx: GradientTransformation,
    grads: PyTree,
    state: PyTree,
    params: PyTree,
    *,
    mesh: Mesh | None = None,
    donate: bool = False,
    **extra: Any,
) -> tuple[PyTree, PyTree]:
    """One optimizer step: ``updates, state = tx.update(grads, state, params, mesh=mesh)`` then
    ``params = apply_updates(params, updates)``, fused where possible.

    Args:
        tx: any transform.
        grads: the gradients (the tree of ``params``; ``None`` leaves leave their parameter
            unchanged), plain tensors or DTensors, unreduced over ``mesh.data_axis`` or
            ``Partial`` as ``update`` accepts them.
        state: ``tx``'s state.
        params: the parameters (plain tensors or DTensors; any dtype ``apply_updates`` takes).
        mesh: the :class:`~functional_train.Mesh` descriptor, as for ``update``.
        donate: ``False`` (the default): pure, no input is modified. A leaf the step leaves
            as it was (a ``None`` gradient's parameter and its state, a ``multi_steps``
            micro-step's parameters and inner state) is returned as it is, as optax returns an
            unchanged array, and recorded as shared: a later donated step copies it before
            writing, so donating the result (or the inputs) to a later step cannot write into
            the trees the caller still holds (under ``torch.compile`` and ``torch.func``
            transforms such a leaf is copied instead; a donated ``torch.compile`` of this
            step cannot read the records: do not donate an eager pure step's result to it,
            or donate through ``precompiled_step``, which copies first). Do not modify the
            results in place yourself. ``True``: the buffers of
            ``params``, ``state`` AND ``grads`` may be reused for the results (JAX's
            ``donate_argnums``); the caller must not use the old trees afterwards (in a loop,
            ``params, state = ft.step(tx, grads, state, params, donate=True)``). Gradients
            are donated too because the fused kernels unscale them in place (as torch's
            ``clip_grad_norm_`` scales ``.grad`` in place).
        extra: passed to ``tx.update``.

    Returns:
        ``(new_params, new_state)``, the params in their own layout (placements, dtypes).

    Fused path: a chain of the library's elementwise transforms (and of users' own, written
    with :func:`~functional_train.elementwise`), whatever combinators and wrappers compose it,
    runs as its stages: each run of elementwise work up to a reduction (a global norm) is one
    pass over each group of leaves, the last one ending with ``p + u``, in place with
    ``donate`` (see :mod:`functional_train.engine.elementwise`). A pass is a kernel generated
    for the stage: C on CPU (:mod:`functional_train.engine.fuse`), Triton on CUDA
    (:mod:`functional_train.engine.fuse_triton`, where Triton is importable; else the stage
    runs leaf by leaf), except that on CUDA ``sgd`` / ``adam`` / ``adamw`` (alone or after
    ``clip_by_global_norm``) take torch's fused kernels, the clip factor as their gradient
    scale (a pure step runs them on copies). ``tx`` is ``adafactor`` without ``beta1``
    or ``came`` (alone or after ``clip_by_global_norm``), on plain tensors in one process,
    gradients of their parameters' dtypes: each leaf is finished in cache before the next is
    read (for adafactor the leaves under 64 KiB together; came only where leaves average 64 KiB
    or more), the chain's numbers bit for bit; so is ``galore_adamw`` on steps that do not
    refresh its projectors (leaves averaging 64 KiB or more; not after a
    ``clip_by_global_norm``). Otherwise the general path: the transform's primitives on the
    local view, then one add per leaf. Under ``torch.compile`` the generated stages are the
    operator ``functional_train::fused_stage``; everything else compiles the general path.
    Collectives: those of ``tx.update`` (the fused path issues the same ones).

    Raises:
        ValueError / TypeError: as ``tx.update`` and ``apply_updates`` do; ``params`` missing.
    """
    if params is None:
        raise ValueError("step needs params: step(tx, grads, state, params)")
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"step: tx must be a GradientTransformation, got {type(tx).__name__}")
    if donate:
        grads, state, params = aliasing.claimed((grads, state, params), _copy)
    with verifying():  # (a list's metadata checked once a step, see engine.metadata)
        out = _step(tx, grads, state, params, mesh, donate, extra)
    return out if donate else _unaliased(out, (params, state))


def _unaliased(result: tuple, inputs: tuple) -> tuple:
    """The pure step's ``(params, state)``, with every tensor leaf that is a tensor of
    ``inputs`` (its ``params``, ``state``, anywhere in them) -- the same object, or (eagerly)
    a DTensor over the same local shard -- recorded as *shared*: the leaves the step leaves as
    they were (a ``None`` gradient's parameter and its state, the parameters and inner state of
    a ``multi_steps`` micro-step, injected hyperparameters, GaLore's projectors between
    refreshes) are returned as they are, as ``optax`` returns an unchanged array, and a later
    donated step copies a shared tensor before it writes (:mod:`functional_train.aliasing`),
    so that it cannot write into the trees the caller still holds. Under ``torch.compile``
    and ``torch.func`` transforms, where no later eager step can see the record, such a leaf
    is copied instead (as ``jax.jit`` copies an output that is an input it was not donated),
    where it is at its own place (:func:`_unaliased_traced`). Host cost: the trees are walked
    together (:func:`_walk`): a subtree handed back as it is is taken whole, and a dict's
    tensors by whole-list C loops, rather than both trees flattened (about 0.25 us a leaf on
    each side, a third of a pure ``multi_steps`` micro-step's host time on tiny leaves);
    compiled, at trace time only."""
    if not aliasing.recording():
        return tuple(_unaliased_traced(new, old) for new, old in zip(result, inputs))
    pairs: list = [[], []]  # (leaves of the results and of the inputs, at places walked together)
    whole: list = []  # (the tensors of subtrees handed back as they are)
    for new, old in zip(result, inputs):
        if not _walk(new, old, pairs, whole):
            # (another structure, or nodes the walk leaves to optree: every leaf; what the
            # walk collected before it stopped is right as well)
            pairs[0].extend(leaves_of(new))
            pairs[1].extend(leaves_of(old))
    # (a tensor of the inputs anywhere in them: the same object, or a DTensor over the same
    # local shard; by identity, so a state that moves or swaps its tensors is covered too)
    ids = set(map(id, to_locals(pairs[1])))
    locs = to_locals(pairs[0])
    kept = list(itertools.compress(locs, map(ids.__contains__, map(id, locs))))
    kept.extend(to_locals(whole))
    kinds = set(map(type, kept))
    if type(None) in kinds:
        kinds.discard(type(None))
        kept = list(itertools.compress(kept, map(operator.is_not, kept, _NONES)))
    if kinds != {torch.Tensor}:  # (a constant of a foreign state; an empty tensor)
        kept = [x for x in kept if _writable(x)]
    if kept:  # (empty plain tensors are left out there, once for each: never written)
        aliasing.mark_shared_locals(kept)
    return result


_LEAF_KINDS = (torch.Tensor, type(None))
_NONES = itertools.repeat(None)


def _walk(new: PyTree, old: PyTree, pairs: list, whole: list) -> bool:
    """For :func:`_unaliased`: into ``pairs`` the leaves of ``new`` and ``old`` that the walk
    reaches (``pairs[0]``, ``pairs[1]``), into ``whole`` the tensors of each subtree of ``new``
    that *is* the subtree of ``old`` at its place (no comparison: all of them are handed back
    as they were). Containers of the same kind are walked together (a dict's tensors with
    whole-list C loops: no flatten, which for a ``multi_steps`` state of ~1,000 leaves takes
    ~0.25 us a leaf on each side); ``False`` where the structures differ or a node is one the
    walk leaves to optree (the caller then adds every leaf of both trees)."""
    if new is old:
        return tensors_into(new, whole)
    kind = type(new)
    if kind is dict:
        if type(old) is not dict or new.keys() != old.keys():
            return False
        ns, os_ = list(new.values()), list(map(old.__getitem__, new))
    elif plain_node(kind):
        if type(old) is not kind or len(new) != len(old):
            return False
        ns, os_ = new, old
    elif isinstance(new, _LEAF_KINDS) and isinstance(old, _LEAF_KINDS):
        pairs[0].append(new)
        pairs[1].append(old)
        return True
    else:  # (constants in both: nothing to record; anything else: optree's)
        return kind in CONSTANT_TYPES and type(old) in CONSTANT_TYPES
    if tensors_or_none(ns) and tensors_or_none(os_):
        pairs[0].extend(ns)
        pairs[1].extend(os_)
        return True
    return all(map(_walk, ns, os_, itertools.repeat(pairs), itertools.repeat(whole)))


def _unaliased_traced(new: PyTree, old: PyTree) -> PyTree:
    """:func:`_unaliased` of one tree under ``torch.compile``, by position and identity (the
    graph resolves them at trace time: no guard, no recompile). Dicts, lists and tuples
    (named ones included) of the same type and keys or length on both sides are walked
    container by container, a dict's tensors without a call each (dynamo traces every call
    and every node of a pytree flattening: 1.6 s of the 10 s a 122-leaf ``multi_steps`` step
    took to trace); any other pair of subtrees goes through torch's own pytree (dynamo cannot
    flatten every state with optree: a dict of constants), whose ``None`` is an empty node
    rather than a leaf, the same on both sides."""
    if isinstance(new, torch.Tensor):
        return _copy(new) if new is old and _writable(new) else new
    kind = type(new)
    if kind is not type(old):
        return _unaliased_pytree(new, old)
    if kind is dict:
        # (the key lists first: compared natively by dynamo, where its keys-view comparison
        # is a set comparison run as Python, about 400 bytecodes a 7-key dict)
        if list(new) != list(old) and new.keys() != old.keys():
            return _unaliased_pytree(new, old)
        return {
            k: (_copy(x) if x is old[k] and _writable(x) else x)
            if isinstance(x, torch.Tensor) or x is None
            else _unaliased_traced(x, old[k])
            for k, x in new.items()
        }
    if kind is list or isinstance(new, tuple):
        if len(new) != len(old):
            return _unaliased_pytree(new, old)
        items = [
            (_copy(x) if x is y and _writable(x) else x)
            if isinstance(x, torch.Tensor) or x is None
            else _unaliased_traced(x, y)
            for x, y in zip(new, old)
        ]
        if kind is list:
            return items
        return kind(*items) if hasattr(kind, "_fields") else kind(items)
    if new is None or _pytree.tree_is_leaf(new):  # (a constant: nothing to copy)
        return new
    return _unaliased_pytree(new, old)


def _unaliased_pytree(new: PyTree, old: PyTree) -> PyTree:
    """:func:`_unaliased_traced` of subtrees of other kinds, through torch's own pytree."""
    olds, leaves = _pytree.tree_leaves(old), _pytree.tree_leaves(new)
    if len(olds) != len(leaves):
        return new
    same = iter([x is y for x, y in zip(leaves, olds)])
    return _pytree.tree_map(lambda x: _copy(x) if next(same) and _writable(x) else x, new)


def _writable(x: Any) -> bool:
    """A tensor with elements (a donated step could write into it); one whose number of
    elements is not one int (ranks simulated by ``LocalTensor`` with uneven shards: some
    ranks' empty) counts as one."""
    if not isinstance(x, torch.Tensor):
        return False
    n = x.numel()
    return n > 0 if type(n) is int else True


def _copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of the leaf ``x`` in its layout; for autograd the identity the step is (inside
    :func:`~functional_train.differentiable`) or, outside, a new leaf that requires grad
    where ``x`` did."""
    if is_differentiable():
        return x.clone()
    if torch.compiler.is_compiling() and x.dim() == 0 and not x.requires_grad:
        return _fresh(x)[0]  # (a 0-dim state leaf, an injected value: no kernel to build)
    return requires_grad_like(wrap_like(to_local(x).detach().clone(), x), x)


@scalar_program
def _fresh(x: torch.Tensor) -> tuple:
    """``(x.clone(),)``."""
    return (x.clone(),)


def _step(tx, grads, state, params, mesh, donate, extra):
    """:func:`step` without its argument checks and the pure step's copies."""
    injected = transform_spec(tx).inject
    if injected is not None:  # inject_hyperparams: the transform built for this step, stepped
        inner, hp, count = injected.resolve(state)
        try:
            new_params, inner_state = _step(
                inner, grads, state.inner_state, params, mesh, donate, extra
            )
        except (ValueError, TypeError) as e:
            err = injected.explain(inner, hp, e)
            if err is e:
                raise
            raise err from e
        return new_params, InjectHyperparamsState(count, hp, inner_state)
    zero = transform_spec(tx).zero
    if zero is not None and not is_differentiable():  # the inner stepped on the zero view
        return zero(grads, state, params, mesh, donate, extra, _step)
    out = _injected_after_clip(tx, grads, state, params, mesh, donate)
    if out is not None:
        return out
    switch = E.switch_of(tx)
    if switch is not None and not is_differentiable():
        # multi_steps of a fusable transform; a chain holding inject_hyperparams
        with E.statics_for_step():
            fus = switch.choose(grads, state, params, mesh)
            if fus is not None:
                return _run_spec(fus, grads, state, params, mesh, donate)
    prog = _program(tx)
    fus = E.fusable_of(tx)
    if fus is not None and prog is not None and isinstance(prog[1], _PER_LEAF):
        # (a per-leaf step, each leaf finished in cache, where it applies: faster than the
        # stages, whose reductions need every leaf's statistics first)
        if not is_differentiable():
            out = _run_fused(tx, *prog, grads, state, params, mesh, donate)
            if out is not None:
                return out
        prog = None
    if fus is not None and (prog is None or _spec_first(params)) and not is_differentiable():
        return _run_spec(fus, grads, state, params, mesh, donate)
    if prog is not None and not is_differentiable():
        out = _run_fused(tx, *prog, grads, state, params, mesh, donate)
        if out is not None:
            return out
        if fus is not None:
            # (leaves torch's fused kernels do not take, `channels_last` convolution weights:
            # the generated stages, as on the CPU, where `update` would make every result
            # fresh, the updates and the states, and add the updates after)
            return _run_spec(fus, grads, state, params, mesh, donate)
    suffix = None if is_differentiable() else _fusable_suffix(tx, state, donate)
    if suffix is not None:
        return _run_suffix(*suffix, grads, params, mesh, donate, extra)
    if accepts_view(tx):
        b = prepare(grads, params, mesh, name="step", view=True)
        updates, new_state = tx.update(b, state, params, mesh=b.mesh, **extra)
    else:
        updates, new_state = tx.update(grads, state, params, mesh=mesh, **extra)
    return _apply(params, updates, donate), new_state
