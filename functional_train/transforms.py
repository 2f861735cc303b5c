"""Elementwise transforms: scale, learning rate, weight decay, momentum, Adam.

Each ``update`` flattens its trees once, reduces unreduced gradients (see
:func:`functional_train.sharding.prepare`), and computes on lists of local shards with
``torch._foreach_*`` ops. Moments are kept in float32 by default (float64 for float64 params;
``*_dtype`` sets them) and have the placements of their parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _validate as V
from . import foreach
from . import quantization as Q
from .autograd import not_differentiable
from .base import EmptyState, GradientTransformation, check_state, declare, elementwise_transform
from .combine import mask_of
from .engine import elementwise as E
from .engine import native
from .engine.scalars import function_of, scalar_program, schedule_numbers, schedule_value
from .engine.view import prepare
from .hyperparams import is_injected, value_of
from .quantization import ScaleByAdam8bitState
from .spec import attach_spec
from .tree import first_device, state_zeros_like, tree_flatten, tree_paths, tree_unflatten

__all__ = [
    "scale",
    "scale_by_learning_rate",
    "ScaleByScheduleState",
    "add_decayed_weights",
    "trace",
    "TraceState",
    "scale_by_adam",
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "scale_by_trust_ratio",
    "stateless_elementwise",
]

Schedule = Callable[[torch.Tensor], Any]
ScalarOrSchedule = float | Schedule


def zero_count(params: Any) -> torch.Tensor:
    """A 0-dim int64 step counter on the device of the first tensor leaf of ``params``."""
    return torch.zeros((), dtype=torch.int64, device=first_device(params))


def stateless(name: str, fn, *, need_params: bool = False) -> GradientTransformation:
    """A transform with an :class:`EmptyState` whose update is ``fn(prepared) -> new locals of
    the active leaves`` (``fn`` is not called when no leaf is active)."""

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        check_state(state, EmptyState, name)
        b = prepare(updates, params, mesh, need_params=need_params, name=name)
        return b.rebuild_active(fn(b) if b.active else []), state

    return GradientTransformation(init_fn, declare(update_fn, view=True))


def _active_locals(b) -> list:
    return [b.locals[i] for i in b.active]


def axpy(x: torch.Tensor, y: torch.Tensor, alpha) -> torch.Tensor:
    """``x + alpha * y`` rounded once (a fused multiply-add, as ATen's ``add(alpha=)``), for a
    float ``alpha`` or a 0-dim tensor one (in ``x``'s dtype)."""
    if isinstance(alpha, torch.Tensor):
        return torch.addcmul(x, y, alpha.to(x.dtype))
    return torch.add(x, y, alpha=alpha)


def times(x: torch.Tensor, alpha) -> torch.Tensor:
    """``x * alpha`` in ``x``'s dtype, for a float ``alpha`` or a 0-dim tensor one (a scalar
    arrives as a 0-dim float64 tensor under ``torch.compile`` and ``inject_hyperparams``: it
    would promote a 0-dim ``x``)."""
    if isinstance(alpha, torch.Tensor):
        return x * alpha.to(x.dtype)
    return x * alpha


def stateless_elementwise(
    name: str,
    leaf,
    scalars: Callable,
    *,
    needs_params: bool = False,
    static=None,
    reduces: bool = False,
    leaf_scalars: tuple = (),
    reads_sum_squares: bool = False,
    reads_params_sum_squares: bool = False,
    starts: Callable | None = None,
) -> GradientTransformation:
    """An elementwise transform with an :class:`EmptyState`: ``leaf`` its per-leaf math,
    ``scalars(b)`` its scalars at this update from the prepared view ``b`` (the updates as
    they reach it where ``reduces``; per-leaf ones, lists over ``b.active``, at the positions
    ``leaf_scalars``); the other arguments are
    :class:`~functional_train.engine.elementwise.Elementwise`'s."""

    def prologue(state, b):
        check_state(state, EmptyState, name)
        if needs_params and b.params is None:
            raise ValueError(f"{name}: needs params (update(..., params))")
        return scalars(b), _empty

    spec = E.Elementwise(
        name,
        leaf,
        prologue,
        E.no_fields,
        0,
        needs_params=needs_params,
        static=static,
        reduces=reduces,
        leaf_scalars=leaf_scalars,
        reads_sum_squares=reads_sum_squares,
        reads_params_sum_squares=reads_params_sum_squares,
        starts=starts,
    )
    return elementwise_transform(spec, _empty_init)


def _empty(trees):
    return EmptyState()


def _empty_init(params):
    del params
    return EmptyState()


def scale(step_size: float) -> GradientTransformation:
    """Multiply updates by the constant ``step_size`` (optax ``scale``). No state."""
    step_size = V.number("step_size", step_size, where="scale")

    def leaf(u, p, s, h, key):
        """``u * step_size``."""
        return u * h[0], ()

    return stateless_elementwise("scale", leaf, lambda b: (step_size,))


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_learning_rate` with a schedule: ``count`` (int64, 0-dim)."""

    count: torch.Tensor


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Scale updates by ``-learning_rate`` (``+`` with ``flip_sign=False``).

    Args:
        learning_rate: a float >= 0, or a schedule ``fn(count) -> lr`` evaluated on the number of
            previous updates (0 on the first update, optax semantics; ``count`` is a 0-dim int64
            tensor, so the schedule must use tensor ops, see :mod:`functional_train.schedules`).
        flip_sign: descend (the default) rather than ascend.

    State: ``EmptyState`` for a float, :class:`ScaleByScheduleState` for a schedule.

    Raises:
        ValueError: a negative learning rate.
    """
    lr = V.learning_rate(learning_rate, where="scale_by_learning_rate")
    sign = -1.0 if flip_sign else 1.0

    def leaf(u, p, s, h, key):
        """``u * (sign * learning_rate)`` (a scheduled one, a tensor, in the leaf's dtype)."""
        lr = h[0]
        return u * (lr.to(u.dtype) if isinstance(lr, torch.Tensor) else lr), ()

    if not callable(lr):
        step = sign * lr
        return stateless_elementwise("scale_by_learning_rate", leaf, lambda b: (step,))

    def init_fn(params):
        return ScaleByScheduleState(zero_count(params))

    # (a plain function, as the library's schedules are: by its number, a constant of the
    # compiled step's operator, see engine.scalars; another callable, such as an injected
    # hyperparameter's cell, traced as it is)
    (number,) = schedule_numbers((lr,))

    def prologue(state, b):
        check_state(state, ScaleByScheduleState, "scale_by_learning_rate")
        if number is not None:
            value, count = _numbered_schedule(number, state.count, sign)
        elif is_injected(lr):  # (its value, a tensor under torch.compile: a program's input)
            value, count = _signed(lr(), state.count, sign)
        else:
            value, count = _signed(schedule_value(lr, state.count), state.count, sign)
        return (value,), lambda trees: ScaleByScheduleState(count)

    spec = E.Elementwise("scale_by_learning_rate", leaf, prologue, E.no_fields, 0)
    return elementwise_transform(spec, init_fn)


def add_decayed_weights(weight_decay: float = 0.0, mask=None) -> GradientTransformation:
    """Add ``weight_decay * param`` to the updates (L2 / decoupled decay, optax semantics).

    Needs ``params`` at update. Placed before :func:`scale_by_adam` it is ``torch.optim.Adam``'s
    ``weight_decay`` (L2 on the gradient); placed after it and before the learning rate it is
    AdamW's decoupled decay ``lr * weight_decay * param``. No state.

    Args:
        weight_decay: >= 0 (default 0).
        mask: ``None`` (every leaf decayed), a tree of bools (Python or NumPy) with the
            structure of the params or of a prefix of it, or ``params -> such a tree`` (e.g.
            :func:`~functional_train.decay_mask`): only the leaves where it is True are decayed,
            the others pass through (optax's ``mask``; see :func:`~functional_train.masked`).

    Raises:
        ValueError: ``weight_decay < 0``; at update, ``params`` missing, a mask that is neither
            the params' structure nor a prefix of it. TypeError: a mask leaf that is not a bool
            (naming it).
    """
    where = "add_decayed_weights"
    wd_arg = V.number("weight_decay", weight_decay, where=where, low=0.0)

    def leaf(u, p, s, h, key):
        """``u + weight_decay * p`` (``p`` in the update's dtype); a leaf the mask leaves out
        passes through."""
        if key is False:
            return u, ()
        return axpy(u, p.to(u.dtype), h[0]), ()

    def scalars(b):
        return (value_of(wd_arg),)

    if mask is None:
        return stateless_elementwise(where, leaf, scalars, needs_params=True)
    keep_of = mask_of(mask, where)

    def init_fn(params):
        keep_of(params)  # resolved (and checked) once eagerly
        return EmptyState()

    def prologue(state, b):
        check_state(state, EmptyState, where)
        return scalars(b), _empty

    spec = E.Elementwise(where, leaf, prologue, E.no_fields, 0, needs_params=True, static=keep_of)
    tx = elementwise_transform(spec, init_fn)
    attach_spec(tx.update, keep_of=keep_of)  # (ft.step's fused AdamW)
    return tx


NO_DECAY_NAMES = ("bias", "norm", "ln_", "embed", "wte", "wpe")


def decay_mask(params: Any, *, exclude: tuple = NO_DECAY_NAMES) -> Any:
    """The usual weight-decay mask of a params tree: ``True`` for the weight matrices, ``False``
    for biases, normalisation gains and embeddings (as HF ``Trainer`` and Colossal-AI exclude
    biases and norm weights, and GPT-style recipes embeddings too).

    A leaf is excluded when any dotted component of its path (``"layers.0.attn_norm"``,
    ``"model.embed_tokens.weight"``), lowercased, contains one of ``exclude`` (default
    ``NO_DECAY_NAMES``: ``bias``, ``norm``, ``ln_``, ``embed``, ``wte``, ``wpe``), or when it has
    fewer than 2 dims (every bias, gain and scalar, whatever its name), or is ``None``.

    Pass it (or the tree it returns) as ``mask=`` of :func:`add_decayed_weights`,
    ``adamw``, ``lamb``, ``adafactor`` or ``came``.

    Returns:
        a tree of bools with the structure of ``params``.
    """
    leaves, treedef = tree_flatten(params)
    pats = tuple(str(e).lower() for e in exclude)
    out = []
    for x, path in zip(leaves, tree_paths(params)):
        parts = path.lower().split(".")
        out.append(
            x is not None
            and getattr(x, "ndim", 0) >= 2
            and not any(p in part for part in parts for p in pats)
        )
    return tree_unflatten(treedef, out)


class TraceState(NamedTuple):
    """State of :func:`trace`: ``count`` (int64, 0-dim) and ``trace`` (params-shaped)."""

    count: torch.Tensor
    trace: Any


def trace(
    decay: float,
    nesterov: bool = False,
    dampening: float = 0.0,
    accumulator_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Momentum, as ``torch.optim.SGD`` computes it.

    ``buf_1 = g``; ``buf_t = decay * buf_{t-1} + (1 - dampening) * g``; the update is ``buf_t``,
    or ``g + decay * buf_t`` with ``nesterov``. With ``dampening=0`` this is optax ``trace``.

    A ``decay`` injected by :func:`~functional_train.inject_hyperparams` may be 0 at some
    updates: those pass the updates through and leave the state as it is (``count`` counts the
    updates with momentum), so a momentum set non-zero later starts its buffer as
    ``torch.optim.SGD`` does (``buf_1 = g``).

    A ``None`` update leaf keeps its buffer (torch.optim skips a parameter without ``.grad``);
    an update where every leaf is ``None`` only advances ``count``, as :func:`scale_by_adam`'s.

    Args:
        decay: momentum factor in [0, 1).
        nesterov: Nesterov momentum (needs ``dampening == 0``, like torch).
        dampening: dampening in [0, 1].
        accumulator_dtype: dtype of the buffer (default ``None``: float32, or the params' dtype
            when wider).

    Raises:
        ValueError: out-of-range hyper-parameters.
    """
    decay_arg = V.number("decay", decay, where="trace", low=0.0)
    damp_arg = V.number("dampening", dampening, where="trace", low=0.0, high=1.0)
    if nesterov and (
        (isinstance(decay_arg, float) and decay_arg <= 0)
        or (isinstance(damp_arg, float) and damp_arg != 0)
    ):
        raise ValueError("trace: nesterov momentum requires decay > 0 and dampening == 0")

    injected = is_injected(decay_arg)
    damped = V.nonzero(damp_arg)

    def init_fn(params):
        return TraceState(zero_count(params), state_zeros_like(params, accumulator_dtype))

    def prologue(state, b):
        check_state(state, TraceState, "trace")
        decay, dampening = value_of(decay_arg), value_of(damp_arg)
        first, on, count = _trace_counts(state.count, decay, injected)
        return (decay, 1.0 - dampening, first, on), lambda trees: TraceState(count, *trees)

    def fields(state):
        return ((state.trace, "TraceState.trace"),)

    def leaf(u, p, s, h, key):
        """``buf = decay * buf + (1 - dampening) * g`` (``g`` itself on the first update when
        damped), the update ``buf``, or ``g + decay * buf`` with ``nesterov``; an injected
        momentum of 0 passes the update through and keeps the buffer (``on`` is 0)."""
        decay, undamped, first, on = h
        tr = s[0]
        g = u.to(tr.dtype)
        new = axpy(times(tr, decay), g, undamped)
        if damped:  # (the first buffer is g: exact without this when not damped)
            new = torch.where(first != 0, g, new)
        out = axpy(g, new, decay) if nesterov else new
        if injected:
            new = torch.where(on != 0, new, tr)
            out = torch.where(on != 0, out, g)
        return out.to(u.dtype), (new,)

    spec = E.Elementwise("trace", leaf, prologue, fields, 1)
    return elementwise_transform(spec, init_fn)


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`: ``count`` (int64, 0-dim), moments ``mu``, ``nu``
    (params-shaped, float32 by default, placements of the parameter)."""

    count: torch.Tensor
    mu: Any
    nu: Any


class ScaleByAmsgradState(NamedTuple):
    """State of :func:`scale_by_adam` with ``amsgrad=True``: adds ``nu_max``."""

    count: torch.Tensor
    mu: Any
    nu: Any
    nu_max: Any


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    amsgrad: bool = False,
    bias_correction: bool = True,
    eps_before_correction: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    optim_bits: int = 32,
    min_8bit_size: int = 4096,
    block_size: int = 256,
) -> GradientTransformation:
    """Adam's scaling (Kingma & Ba 2015), exactly as ``torch.optim.Adam`` computes it.

    ``mu = b1 mu + (1-b1) g``, ``nu = b2 nu + (1-b2) g^2``, t counted from 1;
    update = ``(mu / (1 - b1^t)) / (sqrt(nu) / sqrt(1 - b2^t) + eps)`` (with ``nu`` replaced by
    its running maximum under ``amsgrad``). Multiply by ``-lr`` afterwards
    (:func:`scale_by_learning_rate`).

    Args:
        b1, b2: decay rates in [0, 1). eps: > 0 (added outside the square root, like torch).
        amsgrad: keep the maximum of ``nu`` (torch's ``amsgrad``).
        bias_correction: divide by ``1 - b^t`` (the default); ``False`` uses the raw moments
            (LAMB's ``bias_correction=False``).
        eps_before_correction: add ``eps`` to ``sqrt(nu)`` before the bias correction, as
            HF transformers' / galore-torch's AdamW do: update =
            ``sqrt(1 - b2^t) / (1 - b1^t) * mu / (sqrt(nu) + eps)``. Default ``False`` (torch).
        mu_dtype, nu_dtype: moment dtypes (default ``None``: float32, or the params' dtype when
            wider).
        optim_bits: 32 (the default) keeps float moments (:class:`ScaleByAdamState`); 8 keeps
            the moments of every floating leaf whose GLOBAL numel is at least ``min_8bit_size``
            block-wise quantised to 8 bits (Dettmers et al. 2022, bitsandbytes ``Adam8bit``):
            uint8 codes of the dynamic map (signed for ``mu``, unsigned for ``nu``) and one
            float32 absmax per block of ``block_size`` elements along the last dim of each row
            (see :mod:`functional_train.quantization`). Each update dequantises the moments,
            runs the float update above on them (the update uses the unquantised new moments)
            and requantises them with the new block maxima (nearest code). Smaller leaves keep
            float moments (``mu_dtype`` / ``nu_dtype``). State:
            :class:`~functional_train.quantization.ScaleByAdam8bitState`, about a quarter of
            the float32 state. Exact under sharding: blocks are over the global tensor, and
            blocks that straddle shards of a sharded last dim get their maxima from ONE max
            all-reduce per update for all leaves (none when no quantised leaf shards its last
            dim). Not supported with ``amsgrad``.
        min_8bit_size: with ``optim_bits=8``, the smallest global numel quantised (>= 0;
            bitsandbytes' default 4096).
        block_size: with ``optim_bits=8``, elements per block along the last dim (> 0; 256
            like bitsandbytes' blockwise optimizers).

    Raises:
        ValueError: out-of-range hyper-parameters (``optim_bits`` not 8 or 32,
            ``block_size <= 0``, ``min_8bit_size < 0``, ``amsgrad`` with ``optim_bits=8``); at
            update, a state from another transform or configuration.
    """
    b1_arg = V.beta("b1", b1, where="scale_by_adam")
    b2_arg = V.beta("b2", b2, where="scale_by_adam")
    eps_arg = V.number("eps", eps, where="scale_by_adam", low=0.0)
    if isinstance(optim_bits, bool) or optim_bits not in (8, 32):
        raise ValueError(f"scale_by_adam: optim_bits must be 8 or 32, got {optim_bits!r}")
    block_size = V.integer("block_size", block_size, where="scale_by_adam", low=1)
    min_8bit_size = V.integer("min_8bit_size", min_8bit_size, where="scale_by_adam", low=0)
    eight_bit = optim_bits == 8
    if eight_bit and amsgrad:
        raise ValueError(
            "scale_by_adam: amsgrad is not supported with optim_bits=8 "
            "(bitsandbytes' 8-bit Adam has no amsgrad either)"
        )
    state_cls = (
        ScaleByAdam8bitState if eight_bit else ScaleByAmsgradState if amsgrad else ScaleByAdamState
    )

    def init_fn(params):
        if eight_bit:
            return Q.init_8bit(
                params, zero_count(params), block_size, min_8bit_size, mu_dtype, nu_dtype
            )
        mu = state_zeros_like(params, mu_dtype)
        nu = state_zeros_like(params, nu_dtype)
        if amsgrad:
            return ScaleByAmsgradState(
                zero_count(params), mu, nu, state_zeros_like(params, nu_dtype)
            )
        return ScaleByAdamState(zero_count(params), mu, nu)

    if not eight_bit:
        spec = _adam_spec(
            b1_arg, b2_arg, eps_arg, amsgrad, bias_correction, eps_before_correction, state_cls
        )
        tx = elementwise_transform(spec, init_fn)
        if not amsgrad:
            attach_spec(
                tx.update,
                adam_leaf=AdamLeaf(
                    b1_arg, b2_arg, eps_arg, bias_correction, eps_before_correction, spec
                ),
            )
        return tx

    spec = _adam_spec(
        b1_arg, b2_arg, eps_arg, False, bias_correction, eps_before_correction, state_cls
    )

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        # optim_bits=8: the float math of the spec between dequantisation and requantisation
        check_state(state, state_cls, "scale_by_adam")
        b = prepare(updates, params, mesh, name="scale_by_adam")
        act = b.active
        if not act:  # every leaf None (frozen): nothing to scale, moments unchanged
            return b.rebuild(b.locals), state._replace(count=state.count + 1)
        reject_complex(b, "scale_by_adam with optim_bits=8")
        mu, nu, deq = Q.dequantize_state(b, state, block_size, min_8bit_size)
        if deq.qpos and any(
            V.is_traced(x, batched=False) for x in [*mu, *nu, *(b.locals[i] for i in act)]
        ):
            not_differentiable(
                "scale_by_adam with optim_bits=8", "8-bit quantisation of the moments"
            )
        b1, b2, eps = value_of(b1_arg), value_of(b2_arg), value_of(eps_arg)
        count, bc1, bc2_sqrt = _adam_next(state.count, b1, b2, bias_correction)
        scalars = (b1, b2, eps, bc1, bc2_sqrt)
        out, mu, nu = E.apply_part(spec, [b.locals[i] for i in act], (mu, nu), scalars)
        return b.rebuild_active(out), Q.quantize_state(b, state, count, mu, nu, deq)

    return GradientTransformation(init_fn, declare(update_fn, view=True))


@scalar_program
def _trace_counts(count: torch.Tensor, decay, injected: bool) -> tuple:
    """:func:`trace`'s flags ``first`` (no update yet) and ``on`` (a momentum: ``decay != 0``,
    or not injected), float64 0-dim tensors, and the new count (which counts the updates
    with a momentum)."""
    first = (count == 0).to(torch.float64)
    if isinstance(decay, torch.Tensor):
        on = (decay != 0).to(torch.float64)
        return first, on, count + on.to(count.dtype)
    flag = decay != 0 or not injected
    on = torch.tensor(float(flag), dtype=torch.float64, device=first.device)
    return first, on, count + int(flag)


@scalar_program
def _joined(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """``(torch.cat([a, b]),)``."""
    return (torch.cat([a, b]),)


@scalar_program
def _trust_ratios(
    sums: torch.Tensor, n: int, min_norm: float, trust_coefficient: float, eps: float
) -> tuple:
    """:func:`scale_by_trust_ratio`'s per-leaf ratios (one vector) from ``sums``, the
    parameters' ``n`` global sums of squares then the updates': ``trust_coefficient *
    ||p|| / (||u|| + eps)``, the norms clamped below at ``min_norm``, 1 where either is 0."""
    totals = sums.sqrt()
    pn, un = totals[:n].clamp(min=min_norm), totals[n:].clamp(min=min_norm)
    ratio = trust_coefficient * pn / (un + eps)
    return (torch.where((pn == 0) | (un == 0), torch.ones_like(ratio), ratio),)


@scalar_program
def _signed(value, count: torch.Tensor, sign: float) -> tuple:
    """``(value * sign, count + 1)``: a learning rate (a number or a tensor) as the signed
    float64 0-dim step, and the new count."""
    return torch.as_tensor(value, dtype=torch.float64) * sign, count + 1


@scalar_program
def _numbered_schedule(number: int, count: torch.Tensor, sign: float) -> tuple:
    """:func:`_signed` of the value at ``count`` of the schedule
    :func:`~functional_train.engine.scalars.function_number` gave ``number``."""
    return _signed(schedule_value(function_of(number), count), count, sign)


@scalar_program
def _adam_next(count: torch.Tensor, b1, b2, bias_correction: bool) -> tuple:
    """:func:`scale_by_adam`'s new count ``t = count + 1`` and its bias corrections
    ``(t, 1 - b1^t, sqrt(1 - b2^t))`` (:func:`_corrections`)."""
    t = count + 1
    return (t, *_corrections(t, b1, b2, bias_correction))


def _corrections(count: torch.Tensor, b1, b2, bias_correction: bool) -> tuple:
    """``(1 - b1^t, sqrt(1 - b2^t))`` (float64 0-dim tensors; ones without
    ``bias_correction``) for the count ``t`` of the update."""
    t = count.to(torch.float64)
    if bias_correction:
        return 1.0 - torch.pow(b1, t), torch.sqrt(1.0 - torch.pow(b2, t))
    one = torch.ones((), dtype=torch.float64, device=t.device)
    return one, one


def _adam_spec(b1_arg, b2_arg, eps_arg, amsgrad, bias_correction, eps_before, state_cls):
    """:func:`scale_by_adam`'s float moments as an elementwise spec: the per-leaf math once."""
    n_fields = 3 if amsgrad else 2
    cls = state_cls.__name__

    def prologue(state, b):
        check_state(state, state_cls, "scale_by_adam")
        b1, b2, eps = value_of(b1_arg), value_of(b2_arg), value_of(eps_arg)
        count, bc1, bc2_sqrt = _adam_next(state.count, b1, b2, bias_correction)

        def finish(trees):
            return state_cls(count, *trees)

        return (b1, b2, eps, bc1, bc2_sqrt), finish

    def fields(state):
        out = [(state.mu, f"{cls}.mu"), (state.nu, f"{cls}.nu")]
        if amsgrad:
            out.append((state.nu_max, f"{cls}.nu_max"))
        return out

    def leaf(u, p, s, h, key):
        """``mu = lerp(mu, g, 1 - b1)``, ``nu = b2 nu + (1 - b2) g^2`` (``nu_max`` its running
        maximum), update ``(mu / bc1) / (sqrt(nu) / sqrt(bc2) + eps)`` (or, with
        ``eps_before_correction``, ``mu / (sqrt(nu) + eps) * sqrt(bc2) / bc1``)."""
        b1, b2, eps, bc1, bc2_sqrt = h
        mu, nu = s[0], s[1]
        mu = torch.lerp(mu, u.to(mu.dtype), 1.0 - b1)
        g = u.to(nu.dtype)
        nu = torch.addcmul(nu * b2, g * (1.0 - b2), g)
        new = (mu, nu)
        second = nu
        if amsgrad:
            second = torch.maximum(s[2], nu)
            new = (mu, nu, second)
        denom = torch.sqrt(second)
        if eps_before:
            out = mu.to(denom.dtype) / (denom + eps) * (bc2_sqrt / bc1)
        else:
            out = mu.to(denom.dtype) / (denom / bc2_sqrt + eps) / bc1
        return out.to(u.dtype), new

    return E.Elementwise("scale_by_adam", leaf, prologue, fields, n_fields)


class AdamLeaf(NamedTuple):
    """:func:`scale_by_adam` (float moments, no amsgrad) one leaf at a time, for steps that
    finish each leaf while it is in cache (``ft.step``'s per-leaf GaLore path): its
    elementwise spec (``spec``, the one definition of Adam's math) run on one leaf by the
    engine (:func:`functional_train.engine.elementwise.apply_leaf`), so the moments and the
    update are the update's own. The ``adam_leaf`` of its
    :class:`~functional_train.spec.TransformSpec`."""

    b1: float
    b2: float
    eps: float
    bias_correction: bool
    eps_before_correction: bool
    spec: E.Elementwise

    def resolved(self) -> AdamLeaf:
        """This with injected hyperparameters (``inject_hyperparams``) read as floats: the
        per-leaf steps run eagerly only."""
        if not any(map(is_injected, (self.b1, self.b2, self.eps))):
            return self
        return self._replace(b1=value_of(self.b1), b2=value_of(self.b2), eps=value_of(self.eps))

    def factors(self, count: torch.Tensor) -> tuple:
        """``(1 - b1^t, sqrt(1 - b2^t))`` (float64 0-dim tensors) for ``count`` = the new
        state's count ``t``."""
        return _corrections(count, value_of(self.b1), value_of(self.b2), self.bias_correction)

    def step(
        self,
        g: torch.Tensor,
        mu: torch.Tensor,
        nu: torch.Tensor,
        mu_out: torch.Tensor,
        nu_out: torch.Tensor,
        buf: torch.Tensor,
        factors: tuple,
    ) -> torch.Tensor:
        """New moments written into ``mu_out`` / ``nu_out`` (which may be ``mu`` / ``nu``:
        in place) and the update (into ``buf`` where it fits); returns the update in ``g``'s
        dtype."""
        bc1, bc2_sqrt = factors
        res = E.apply_part(
            self.spec,
            [g],
            ([mu], [nu]),
            (self.b1, self.b2, self.eps, bc1, bc2_sqrt),
            ([buf], [mu_out], [nu_out]),
        )
        return res[0][0]


def reject_complex(b, where: str) -> None:
    """Raise for complex leaves in a transform without a complex definition.

    Raises:
        TypeError: naming the first complex leaf.
    """
    for i in b.active:
        if b.locals[i].is_complex():
            raise TypeError(
                f"{where}: update leaf '{b.paths[i]}' is {b.locals[i].dtype}; "
                f"this transform has no complex definition (Adam, AdamW, SGD, "
                f"LAMB and the elementwise transforms follow torch.optim on "
                f"complex leaves)"
            )


def scale_by_trust_ratio(
    min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0
) -> GradientTransformation:
    """Scale each leaf's update by its trust ratio ``||param|| / ||update||`` (LARS / LAMB, You
    et al. 2019; optax ``scale_by_trust_ratio``).

    ``ratio = trust_coefficient * max(||param||, min_norm) / (max(||update||, min_norm) + eps)``,
    replaced by 1 when either norm is 0. Norms are over the GLOBAL leaf (shards add, replicas
    count once): the local sums of squares of every leaf's parameter and update are completed
    by ONE all-reduce per update, whatever the number of leaves. Needs ``params``. No state.

    The norms are accumulated and the ratios computed in float64 (CPU float32 / float64
    leaves: the native kernels of the gradient clip's norm; others: ``torch._foreach_norm``
    with ``dtype=torch.float64``), so that a tiny update's norm does not underflow to 0 (1e-30
    gradients have the float32 norm 0, ratio 1). In a fused run on CPU the pass before it
    sums the updates' squares as it writes them and, where it reads the parameters (lamb's
    weight decay), the parameters' as it reads them, in the native kernels' order (the same
    bits; ``Elementwise.reads_params_sum_squares``): then the norms read no leaf again. The
    elementwise part, ``u * ratio``, fuses with what follows it (the learning rate,
    ``apply_updates``): each leaf's ratio is a per-leaf scalar of that pass
    (``Elementwise.leaf_scalars``), read once per leaf, so ``lamb`` is two passes over the
    leaves with the norms between them.

    Raises:
        ValueError: negative ``min_norm`` / ``eps``, ``trust_coefficient <= 0``; at update,
            ``params`` missing.
    """
    where = "scale_by_trust_ratio"
    min_norm = V.number("min_norm", min_norm, where=where, low=0.0)
    trust_coefficient = V.number(
        "trust_coefficient", trust_coefficient, where=where, low=0.0, low_open=True
    )
    eps = V.number("eps", eps, where=where, low=0.0)

    def start(b):
        """The norms' all-reduce, issued (the run issues several parts' together: see
        ``Elementwise.starts``): ``finish`` gives the global sums of squares of the active
        leaves' parameters, then of their updates (float64)."""
        act = b.active
        if not act or b.params is None:
            return lambda: None  # (no collective: the prologue returns, or raises, first)
        g = _active_locals(b)
        p = [b.params[i] for i in act]

        # float64 sums of squares: the native kernels (compiled: zeros where not needed at
        # all, see Prepared.needed), else torch's norms accumulated in float64; the updates'
        # as the stage that wrote them summed them, where it did (the same bits), and the
        # parameters' as that stage read them, where it did
        xs = p + g
        sums = None
        if b.sum_squares is not None:
            ps = b.params_sum_squares
            if ps is None:
                ps = native.local_sum_squares(p, b.needed)
            if ps is not None:
                (sums,) = _joined(ps, b.sum_squares)
        if sums is None:
            sums = native.local_sum_squares(xs, b.needed)
        if sums is None:
            if any(x.is_complex() for x in xs):
                norms = [x.double() for x in foreach.norm(xs, 2)]
            else:
                norms = foreach.norm(xs, 2, dtype=torch.float64)
            sums = torch.stack(norms).square()
        return b.leaf_totals_vector_start(act + act, sums)

    def ratios(b):
        if not b.active:
            return ([],)
        totals = E.issued(start, b)()
        (ratio,) = _trust_ratios(totals, len(b.active), min_norm, trust_coefficient, eps)
        return (list(ratio.unbind()),)

    def leaf(u, p, s, h, key):
        """``u * ratio``, the leaf's own ratio (a 0-dim float64 tensor) in ``u``'s dtype."""
        return u * h[0].to(u.dtype), ()

    return stateless_elementwise(
        where,
        leaf,
        ratios,
        needs_params=True,
        reduces=True,
        leaf_scalars=(0,),
        reads_sum_squares=True,
        reads_params_sum_squares=True,
        starts=start,
    )
