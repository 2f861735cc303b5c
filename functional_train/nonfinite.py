"""Non-finite gradients: steps skipped by every rank together, NaNs zeroed, dynamic loss scaling.

optax's ``apply_if_finite`` and ``zero_nans``, and torch's ``GradScaler`` as a transform. The
decision to skip a step is global (every element of every leaf on every rank) and is taken
without a host synchronisation: the inner update is computed, and ``torch.where`` on a 0-dim
flag selects, leaf by leaf, between it and the unchanged state (zero updates). Under a mesh the
flag costs ONE scalar all-reduce per update, or nothing extra when the inner transform starts
with :func:`~functional_train.clip_by_global_norm`, whose norm (one all-reduce already) is
finite exactly when every gradient element is (up to float32 overflow of the squares, as for
torch's ``clip_grad_norm_(error_if_nonfinite=True)``).

``apply_if_finite`` of a fusable inner transform is fusable (:func:`_guarded`): its first part
takes the decision (the flag's reduction, or the leading clip's norm), the inner's parts follow,
each selecting ``torch.where(ok, new, old)`` per state field in its own leaf function, and a
last part zeroes the update where not ``ok``; ``ft.step`` runs it all as one pass per stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from . import _validate as V
from . import foreach
from . import leaves as L
from .base import GradientTransformation, call_reduced, declare, run_fused
from .engine import elementwise as E
from .engine import native
from .engine.dtensor import to_local, wrap_like
from .engine.scalars import scalar_program
from .engine.view import Prepared, prepare
from .spec import transform_spec
from .tree import find_state, first_device, leaves_of

__all__ = [
    "apply_if_finite",
    "ApplyIfFiniteState",
    "zero_nans",
    "ZeroNansState",
    "dynamic_loss_scale",
    "DynamicLossScaleState",
    "loss_scale",
    "all_finite",
    "skip_not_finite",
    "skip_large_updates",
]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite` (optax's fields; 0-dim tensors on the params' device).

    Attributes:
        notfinite_count: consecutive non-finite updates so far (int64).
        last_finite: whether the last update's gradients were all finite (bool).
        total_notfinite: non-finite updates since init (int64).
        inner_state: the inner transform's state, unchanged by skipped steps.
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any


class ZeroNansState(NamedTuple):
    """State of :func:`zero_nans`: ``found_nan``, one 0-dim bool per leaf of the params tree
    (``None`` for ``None`` leaves): whether the last update had a NaN in that leaf, on any
    rank."""

    found_nan: Any


class DynamicLossScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale` (0-dim tensors on the params' device).

    Attributes:
        scale: the loss scale (float32): multiply the loss by it before the backward pass
            (:func:`loss_scale` reads it).
        growth_tracker: finite steps since the scale last changed (int64; torch's is int32).
        last_finite: whether the last update's gradients were all finite (bool).
        total_notfinite: skipped updates since init (int64).
        inner_state: the inner transform's state, unchanged by skipped steps.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: Any


def _leading_clip_norm(inner: GradientTransformation):
    """``state -> pre-clip global norm`` when ``inner`` is ``clip_by_global_norm`` or a chain
    starting with it (the norm then decides finiteness at no extra cost), else ``None``."""
    spec = transform_spec(inner)
    if spec.clip is not None:
        return lambda s: s.global_norm
    parts = spec.parts
    if parts and transform_spec(parts[0]).clip is not None:
        return lambda s: s[0].global_norm
    return None


@scalar_program
def _nonfinite_flags(*xs: torch.Tensor) -> tuple:
    """``(flags,)``: one float32 flag per local shard, 1 where it holds a NaN or an infinity.
    One reduction per leaf: its sum, accumulated at least in float32 (NaN and infinities
    survive a sum; finite values overflow it only within a factor of the element count of
    the dtype's largest value). Under ``torch.compile`` one opaque call (a scalar program:
    no reduction kernels for inductor to build)."""
    sums = []
    for x in xs:
        if x.is_complex():
            x = torch.view_as_real(x)
        s = x.sum(dtype=torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x.sum()
        sums.append(s if s.dtype == torch.float64 else s.float())
    if any(s.dtype == torch.float64 for s in sums):
        sums = [s.double() for s in sums]
    return ((~torch.isfinite(torch.stack(sums))).to(torch.float32),)


def _all_finite_of(b: Prepared) -> torch.Tensor:
    """Whether every element of every active leaf on every rank is finite (a 0-dim bool; ONE
    scalar all-reduce over the mesh unless every leaf is whole on every rank)."""
    if not b.active:
        return torch.ones((), dtype=torch.bool, device=first_device(b.locals))
    (flags,) = _nonfinite_flags(*[b.locals[i] for i in b.active])
    return _none_set(b.global_max(flags, b.active))[0]


@scalar_program
def _none_set(flag: torch.Tensor) -> tuple:
    """``(flag == 0,)``: no leaf flagged (:func:`_all_finite_of`)."""
    return (flag == 0,)


def all_finite(updates, *, mesh=None) -> torch.Tensor:
    """Whether every element of every leaf of ``updates`` on every rank is finite.

    ``updates``: a tree of plain tensors or DTensors (``None`` leaves skipped), possibly
    unreduced over ``mesh.data_axis``. Returns a 0-dim bool tensor, the same on every rank.
    Collectives: one scalar all-reduce over the mesh (none in one process).
    """
    b = prepare(updates, None, mesh, name="all_finite")
    return _all_finite_of(b)


def _where_tree(ok: torch.Tensor, new, old):
    """``torch.where(ok, new, old)`` leaf by leaf (DTensors on their local shards)."""

    def pick(n, o):
        if n is None or not isinstance(n, torch.Tensor):
            return n
        if n is o:
            return n
        ln, lo = to_local(n), to_local(o)
        return wrap_like(torch.where(ok.to(ln.device), ln, lo), n)

    return optree.tree_map(pick, new, old, none_is_leaf=True)


def _zeros_where_not(ok: torch.Tensor, updates):
    """The updates where ``ok``, zeros elsewhere (a view's locals, or a tree's leaves)."""

    def pick(x):
        return torch.where(ok.to(x.device), x, torch.zeros((), dtype=x.dtype, device=x.device))

    if isinstance(updates, Prepared):
        return updates.with_locals([None if x is None else pick(x) for x in updates.locals])
    return optree.tree_map(
        lambda x: None if x is None else wrap_like(pick(to_local(x)), x), updates, none_is_leaf=True
    )


def _run_checked(inner, clip_norm, b: Prepared, inner_state, params, extra, device):
    """Run ``inner`` on the view ``b``; return ``(finite, updates, new inner state)``, with
    ``finite`` (a 0-dim bool on ``device``) from the leading clip's norm when there is one
    (``clip_norm``), else from ONE scalar all-reduce of per-leaf flags."""
    finite = None if clip_norm is not None else _all_finite_of(b)
    updates, new_inner, _ = call_reduced(inner, b, inner_state, params, b.mesh, extra)
    if finite is None:
        (finite,) = _is_finite(clip_norm(new_inner))
    return finite.to(device), updates, new_inner


def _guarded(inner_fus: E.Fusable, clip_first: bool, decide: Callable) -> E.Fusable:
    """The :class:`~functional_train.engine.elementwise.Fusable` of ``apply_if_finite(inner)``
    (:func:`_guarded_parts` of its parts, its state through :func:`_guarded_over`)."""
    parts = _guarded_parts(inner_fus.parts, clip_first, decide)
    return _guarded_over(parts, inner_fus, clip_first)


def _tolerant(max_consecutive_errors: int) -> Callable:
    """``apply_if_finite``'s decision: ``decide(counters, finite) -> (ok, new counters)``, the
    counters ``(notfinite_count, last_finite, total_notfinite)``; after more than
    ``max_consecutive_errors`` non-finite updates in a row the update is applied anyway."""

    def decide(counters, finite):
        notfinite_count, _, total_notfinite = counters
        ok, count, total = _tolerant_decision(
            notfinite_count, total_notfinite, finite, max_consecutive_errors
        )
        return ok, (count, finite, total)

    return decide


@scalar_program
def _tolerant_decision(
    notfinite_count: torch.Tensor,
    total_notfinite: torch.Tensor,
    finite: torch.Tensor,
    max_consecutive_errors: int,
) -> tuple:
    """:func:`_tolerant`'s ``(ok, notfinite_count, total_notfinite)`` after an update whose
    finiteness is ``finite``."""
    count = torch.where(finite, torch.zeros_like(notfinite_count), notfinite_count + 1)
    ok = finite | (count > max_consecutive_errors)
    return ok, count, total_notfinite + (~finite).to(torch.int64)


@scalar_program
def _is_finite(x: torch.Tensor) -> tuple:
    """``(isfinite(x),)``: whether the leading clip's norm is finite (the decision of both
    the general and the fused paths)."""
    return (torch.isfinite(x),)


@scalar_program
def _is_nan(x: torch.Tensor) -> tuple:
    return (torch.isnan(x),)


def _guarded_parts(
    inner_parts: tuple, clip_first: bool, decide: Callable, name: str = "apply_if_finite"
) -> tuple:
    """The parts of ``apply_if_finite(inner)``'s Fusable: a first part that decides (``ok``,
    published in the run context), the inner's parts guarded
    (:func:`~functional_train.engine.elementwise.guarded`), a last part that zeroes
    the update where not ``ok``. ``decide(counters, finite) -> (ok, new counters)``: the
    wrapper's decision (:func:`_tolerant`'s; ``dynamic_loss_scale``'s skips every non-finite
    update and updates its scale), ``name`` the wrapper's.

    With ``clip_first`` (``inner`` starts with ``clip_by_global_norm``) the first part IS the
    clip's: its norm, finite exactly when every element is, decides, and the gradients are
    read once (for the norm) before the pass. Otherwise the first part reduces the per-leaf
    non-finite flags (:func:`_all_finite_of`) and passes the updates through."""
    # this wrapper's entry in the run context (a string: dynamo compares dict keys by value)
    key = E.context_key(name)
    clip = inner_parts[0] if clip_first else None
    if clip is not None and clip.n_fields:
        raise AssertionError("clip_by_global_norm has no state fields")

    def prologue(state, b, ctx):
        # (the counters as a tuple, and the leading clip's state: the new state has this
        # structure too, so that a wrapper guarding this part, a compiled multi_steps or an
        # outer apply_if_finite, selects it leaf by leaf)
        counters, cs = state
        if clip is not None:
            sc, fin = E.call_prologue(clip, cs, b, ctx)
            new_cs = fin(())
            (finite,) = _is_finite(new_cs.global_norm)
        else:
            sc, new_cs = (), None
            finite = _all_finite_of(b)
        finite = finite.to(counters[0].device)
        ok, new_counters = decide(counters, finite)
        ctx[key] = ok

        def finish(trees):
            counters = new_counters
            if clip is None:
                return counters, None
            return counters, E.select_state(ok, new_cs, cs, ())

        return sc, finish

    if clip is not None:
        first = E.Elementwise(
            f"{name}({clip.name})",
            clip.leaf,
            prologue,
            clip.fields,
            0,
            needs_params=clip.needs_params,
            static=clip.static,
            reduces=True,
            context=True,
            # (after an earlier pass, dynamic_loss_scale's unscaling: its sums of squares)
            reads_sum_squares=clip.reads_sum_squares,
            starts=clip.starts,
        )
        rest = inner_parts[1:]
    else:
        first = E.Elementwise(
            name,
            lambda u, p, s, h, k: (u, ()),
            prologue,
            E.no_fields,
            0,
            reduces=True,
            context=True,
        )
        rest = inner_parts

    end = E.zeroed_unless(key, name)
    return (first, *(E.guarded(p, key, name) for p in rest), end)


def _guarded_over(parts: tuple, inner_fus: E.Fusable, clip_first: bool) -> E.Fusable:
    """:func:`_guarded`'s Fusable: its ``parts`` (made from ``inner_fus``' parts), the state
    split and joined through ``inner_fus``' own."""

    def split(state):
        _check_finite_state(state)
        inner_states = list(inner_fus.split(state.inner_state))
        cs = inner_states.pop(0) if clip_first else None
        counters = (state.notfinite_count, state.last_finite, state.total_notfinite)
        return [(counters, cs), *inner_states, None]

    def join(states):
        counters, cs = states[0]
        inner_states = ([cs] if clip_first else []) + list(states[1:-1])
        return ApplyIfFiniteState(*counters, inner_fus.join(inner_states))

    return E.Fusable(parts, split, join)


def _check_finite_state(state):
    if not isinstance(state, ApplyIfFiniteState):
        raise ValueError(
            "apply_if_finite: expected the ApplyIfFiniteState from "
            f"apply_if_finite.init, got {type(state).__name__}"
        )


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformation:
    """Apply ``inner`` only when every gradient element is finite (optax ``apply_if_finite``).

    When a NaN or an infinity is anywhere in the updates (any leaf, any rank), the update is
    zeros and ``inner``'s state is left unchanged, on every rank alike; after more than
    ``max_consecutive_errors`` non-finite updates in a row, the inner update is applied anyway
    (as optax does, so a run that only produces NaNs does not silently stall).

    No host synchronisation: ``inner`` always runs, and ``torch.where`` on a 0-dim flag picks
    its result or the old state leaf by leaf (a step pays one extra read of the inner state).
    Collectives: ``inner``'s, plus ONE scalar all-reduce over the mesh — none when ``inner`` is
    ``clip_by_global_norm`` or a ``chain`` starting with it (its norm is then the test).

    When ``inner`` is fusable (a chain of elementwise transforms), so is the wrapper: ``update``
    and ``ft.step`` run the guarded parts as one pass per stage (the decision's reduction
    first), and a chain around it fuses it with its neighbours.

    Args:
        inner: the transform to guard.
        max_consecutive_errors: >= 0.

    State: :class:`ApplyIfFiniteState`.

    Raises:
        TypeError: ``inner`` is not a GradientTransformation.
        ValueError: ``max_consecutive_errors < 0``; at update, a state from another transform.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"apply_if_finite: inner must be a GradientTransformation, got {type(inner).__name__}"
        )
    max_consecutive_errors = V.integer(
        "max_consecutive_errors", max_consecutive_errors, where="apply_if_finite", low=0
    )
    clip_norm = _leading_clip_norm(inner)
    decide = _tolerant(max_consecutive_errors)
    inner_fus = E.fusable_of(inner)
    fus = None if inner_fus is None else _guarded(inner_fus, clip_norm is not None, decide)

    def init_fn(params):
        dev = first_device(params)
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        return ApplyIfFiniteState(
            zero, torch.ones((), dtype=torch.bool, device=dev), zero.clone(), inner.init(params)
        )

    spec = fus
    if spec is None and (switch := E.switch_of(inner)) is not None:
        spec = _guarded_switch(switch, clip_norm is not None, decide)

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        _check_finite_state(state)
        out = run_fused(spec, updates, state, params, mesh, "apply_if_finite")
        if out is not None:  # (the fused form: the same parts ft.step runs)
            return out
        given_view = isinstance(updates, Prepared)
        b = prepare(updates, params, mesh, name="apply_if_finite", view=True)
        finite, new_updates, new_inner = _run_checked(
            inner, clip_norm, b, state.inner_state, params, extra, state.notfinite_count.device
        )
        ok, counters = decide(state[:3], finite)
        new_updates = _zeros_where_not(ok, new_updates)
        if isinstance(new_updates, Prepared) and not given_view:
            new_updates = new_updates.tree()
        return new_updates, ApplyIfFiniteState(
            *counters, _where_tree(ok, new_inner, state.inner_state)
        )

    if spec is not None:
        E.register(update_fn, spec)
    return GradientTransformation(init_fn, declare(update_fn, view=True))


def _guarded_switch(switch: E.Switch, clip_first: bool, decide: Callable) -> E.Switch:
    """``apply_if_finite(inner)``'s :class:`~functional_train.engine.elementwise.Switch` when
    ``inner`` has one (``multi_steps``, ``inject_hyperparams``): per call, :func:`_guarded`
    of the inner's choice (see :func:`_wrapped_switch`)."""
    return _wrapped_switch(
        switch,
        lambda parts: _guarded_parts(parts, clip_first, decide),
        lambda parts, f: _guarded_over(parts, f, clip_first),
        ApplyIfFiniteState,
    )


def _wrapped_switch(
    switch: E.Switch, make: Callable[[tuple], tuple], over: Callable, state_type: type
) -> E.Switch:
    """The :class:`~functional_train.engine.elementwise.Switch` of a wrapper whose state
    (a ``state_type``) holds its inner transform's (``inner_state``), around the inner's
    Switch: per call, ``over(parts, f)`` of the inner's choice ``f`` (its zero updates
    written out, :func:`~functional_train.engine.elementwise.zeros_written`), ``parts``
    being ``make(f.parts)``, made once per parts tuple
    (:func:`~functional_train.engine.elementwise.derived_parts`). Under ``torch.compile``
    only where the inner Switch declares its parts there (``Switch.traced_parts``: the
    wrapper's parts made here, as a traced step cannot make parts); else ``None`` there
    (the general path)."""
    derived = E.derived_parts(make)
    traced = None if switch.traced_parts is None else derived(switch.traced_parts)

    def choose(updates, state, params, mesh):
        compiling = torch.compiler.is_compiling()
        if (compiling and traced is None) or not isinstance(state, state_type):
            return None  # (the general path: traced, or raising)
        f = switch.choose(updates, state.inner_state, params, mesh)
        if f is None:
            return None
        f = E.zeros_written(f)
        if compiling:  # (the parts the inner declared: see Switch.traced_parts)
            return over(traced, f)
        return over(derived(f.parts), f)

    return E.Switch(choose, traced)


def _zero_nan_leaf(u, p, s, h, key):
    """:func:`zero_nans` on one leaf: its NaN elements zero, the others (infinities too) as
    they are (a complex element with a NaN part zero as a whole, where torch runs it)."""
    return torch.where(torch.isnan(u), torch.zeros_like(u), u), ()


_IS_COMPLEX = torch.Tensor.is_complex


def _squares_and_zeroed(b) -> tuple:
    """The local sums of squares of the view ``b``'s active leaves (``clipping.leaf_squares``'
    numbers) and those of :func:`zero_nans`' results on them: from one read of each leaf by
    the native kernels where they run (``native.local_sum_squares(..., zeroed=True)``: each
    NaN taken as zero, the results' sums bit for bit; eagerly and under ``torch.compile``),
    else by :func:`_zeroed_squares` (eagerly on CPU leaves: host reads). Eagerly, sums the
    stage before wrote (``b.sum_squares``: the same bits as those of the leaves in memory)
    are taken instead of a read where no leaf holds a NaN; under ``torch.compile``, which
    cannot look, the read is made."""
    from .clipping import leaf_squares

    if b.sum_squares is None or torch.compiler.is_compiling():
        g = [b.locals[i] for i in b.active]
        both = native.local_sum_squares(g, b.needed, zeroed=True)
        if both is not None:
            return both[: len(g)], both[len(g) :]
    sq = leaf_squares(b)
    return sq, _zeroed_squares(b, sq)


def _zeroed_squares(b, sq: torch.Tensor) -> torch.Tensor:
    """The local sums of squares of :func:`zero_nans`' results on the view ``b``, given
    ``sq``, those of its inputs (``clipping.leaf_squares(b)``): ``sq`` itself where no leaf
    holds a NaN (the results are the inputs, bit for bit); else those of the results taken
    the same way (the leaves with a NaN zeroed there first). Reads ``sq`` on the host: the
    engine asks only where that is free (eagerly, CPU leaves)."""
    from .clipping import leaf_squares

    nan = torch.isnan(sq)
    if not bool(nan.any()):
        return sq
    locs = list(b.locals)
    for j in nan.nonzero().flatten().tolist():
        i = b.active[j]
        locs[i] = _zero_nan_leaf(locs[i], None, (), (), None)[0]
    return leaf_squares(b.with_locals(locs))


def zero_nans() -> GradientTransformation:
    """Replace NaNs in the updates by zeros (optax ``zero_nans``); infinities pass.

    State: :class:`ZeroNansState`, per leaf whether it had a NaN on any rank (ONE all-reduce of
    the vector of the leaves' local sums of squares over the mesh dims but the pipeline and
    expert ones, as ``leaf_totals``; none in one process).

    An elementwise part for the engine (its prologue the flags, from the leaves' sums of
    squares, NaN exactly where a leaf holds a NaN: the clip's local terms, or the sums the
    stage before wrote; its leaf function the replacement), so ``chain`` and ``ft.step`` run it
    in one pass with its neighbours, where no update leaf is complex (a kernel sees a complex
    leaf as pairs of reals, and a complex element with one NaN part is zeroed whole: such a
    call takes its own update, the same flags). On CPU float32 / float64 leaves, eagerly and
    under ``torch.compile``, a ``clip_by_global_norm`` right after it reads the sums of
    squares its prologue gives (one native read of each gradient gives its sum, whose NaN is
    the flag, and its sum with the NaNs taken as zeros: the results' sums), so the
    replacement joins the clip's pass: ``chain(zero_nans(), clip_by_global_norm(1.0),
    adamw(...))`` makes the passes ``chain(clip_by_global_norm(1.0), adamw(...))`` makes.
    """
    where = "zero_nans"

    def init_fn(params):
        return ZeroNansState(
            optree.tree_map(
                lambda x: None if x is None else torch.zeros((), dtype=torch.bool, device=x.device),
                params,
                none_is_leaf=True,
            )
        )

    def new_state(state, b, ctx=None):
        """The new flags of the leaves of ``b``: a leaf's global sum of squares is NaN
        exactly where the leaf holds a NaN on some rank (the squares are >= 0, so infinities
        sum to infinity, never to NaN; a complex element with a NaN part is NaN in its
        ``abs``). One vector of local sums (the clip's local terms, or the sums the stage
        before wrote), ONE ``leaf_totals`` all-reduce, one ``isnan``. Where the run asks
        (``ctx``, see ``Elementwise.sums_through``), the local sums of the results go there."""
        if not isinstance(state, ZeroNansState):
            raise ValueError(
                f"{where}: expected the ZeroNansState from zero_nans.init, "
                f"got {type(state).__name__}"
            )
        from .clipping import leaf_squares

        if ctx is not None and E.SUM_SQUARES in ctx:  # (asked: see elementwise._through)
            sq, ctx[E.SUM_SQUARES] = _squares_and_zeroed(b)
        else:
            sq = leaf_squares(b)
        found = _is_nan(b.leaf_totals_vector(b.active, sq))[0].unbind()
        flags = b.every_leaf(found)
        old = optree.tree_leaves(state.found_nan, none_is_leaf=True)
        if len(old) != len(flags):
            raise ValueError(
                f"{where}: the state has {len(old)} flags for {len(flags)} "
                f"leaves; it comes from another tree"
            )
        new_flags = [n if n is not None else o for n, o in zip(flags, old)]
        return ZeroNansState(
            optree.tree_unflatten(
                optree.tree_structure(state.found_nan, none_is_leaf=True), new_flags
            )
        )

    def prologue(state, b, ctx):
        ns = new_state(state, b, ctx)
        return (), lambda trees: ns

    fused = E.single(
        E.Elementwise(
            where,
            _zero_nan_leaf,
            prologue,
            E.no_fields,
            0,
            reduces=True,
            context=True,
            reads_sum_squares=True,
            sums_through=True,
        )
    )

    def choose(updates, state, params, mesh):
        leaves = leaves_of(updates)
        if any(x is not None and _IS_COMPLEX(x) for x in leaves):
            return None  # (its own update: see above)
        return fused

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        b = prepare(updates, params, mesh, name=where)
        if not any(_IS_COMPLEX(b.locals[i]) for i in b.active):
            return E.run(fused, b, state, params)
        ns = new_state(state, b)
        out = [_zero_nan_leaf(b.locals[i], None, (), (), None)[0] for i in b.active]
        return b.rebuild_active(out), ns

    E.register(update_fn, E.Switch(choose))
    return GradientTransformation(init_fn, declare(update_fn, view=True))


def dynamic_loss_scale(
    inner: GradientTransformation,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> GradientTransformation:
    """Dynamic loss scaling for float16 training, ``torch.amp.GradScaler``'s semantics as a
    transform around ``inner``.

    The loop multiplies the loss by ``loss_scale(state)`` before the backward pass and hands
    the (scaled) gradients to ``update``, which:

    1. unscales them, ``g * (1 / scale)`` with the reciprocal taken in float64 and rounded to
       float32 (as ``GradScaler.unscale_``);
    2. if every element on every rank is finite, applies ``inner`` to them; else returns zero
       updates and leaves ``inner``'s state unchanged (``GradScaler.step`` skipping
       ``optimizer.step``);
    3. updates the scale as ``GradScaler.update`` does: times ``backoff_factor`` after a
       non-finite step (the growth tracker reset), times ``growth_factor`` after
       ``growth_interval`` finite steps in a row (if the new scale is finite); each product
       taken in float64 and rounded to float32, as torch's ``_amp_update_scale_`` kernels do,
       so the scale equals ``GradScaler``'s bit for bit whatever the factors.

    No host synchronisation (``torch.where`` selects, see :func:`apply_if_finite`).
    Collectives: ``inner``'s, plus ONE scalar all-reduce over the mesh unless ``inner`` starts
    with ``clip_by_global_norm`` (torch's FSDP ``ShardedGradScaler`` all-reduces its flag too).

    When ``inner`` is fusable (a chain of elementwise transforms), so is the wrapper: the
    unscaling is a pass (which sums the squares a leading clip reads), then the decision, then
    ``apply_if_finite``'s guarded parts in one pass (``p + u`` included in ``ft.step``).

    Args:
        inner: the optimizer, e.g. ``chain(clip_by_global_norm(1.0), adamw(1e-3))``.
        init_scale: > 0 (torch's default ``2**16``).
        growth_factor: > 1. backoff_factor: in (0, 1). growth_interval: >= 1.

    State: :class:`DynamicLossScaleState`.

    Raises:
        TypeError: ``inner`` is not a GradientTransformation.
        ValueError: out-of-range arguments; at update, a state from another transform.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"dynamic_loss_scale: inner must be a GradientTransformation, "
            f"got {type(inner).__name__}"
        )
    where = "dynamic_loss_scale"
    init_scale = V.number(
        "init_scale", init_scale, where=where, low=0.0, low_open=True, finite=True
    )
    growth_factor = V.number(
        "growth_factor", growth_factor, where=where, low=1.0, low_open=True, finite=True
    )
    backoff_factor = V.number(
        "backoff_factor",
        backoff_factor,
        where=where,
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    )
    growth_interval = V.integer("growth_interval", growth_interval, where=where, low=1)
    clip_norm = _leading_clip_norm(inner)
    inner_fus = E.fusable_of(inner)

    def init_fn(params):
        dev = first_device(params)
        return DynamicLossScaleState(
            torch.full((), init_scale, dtype=torch.float32, device=dev),
            torch.zeros((), dtype=torch.int64, device=dev),
            torch.ones((), dtype=torch.bool, device=dev),
            torch.zeros((), dtype=torch.int64, device=dev),
            inner.init(params),
        )

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        if not isinstance(state, DynamicLossScaleState):
            raise ValueError(
                "dynamic_loss_scale: expected the DynamicLossScaleState from "
                f"dynamic_loss_scale.init, got {type(state).__name__}"
            )
        out = run_fused(spec, updates, state, params, mesh, where)
        if out is not None:  # (the fused form: the same parts ft.step runs)
            return out
        given_view = isinstance(updates, Prepared)
        b = prepare(updates, params, mesh, name=where, view=True)
        (inv,) = _unscale_factor(state.scale)
        g = [b.locals[i] for i in b.active]
        # (the float32 factor would promote 0-dim low-precision leaves: keep their dtype)
        unscaled = L.cast_like(foreach.mul(g, inv.to(g[0].device)), g) if g else []
        b = b.with_locals(b.every_leaf(unscaled))
        finite, new_updates, new_inner = _run_checked(
            inner, clip_norm, b, state.inner_state, params, extra, state.scale.device
        )
        new_updates = _zeros_where_not(finite, new_updates)
        if isinstance(new_updates, Prepared) and not given_view:
            new_updates = new_updates.tree()
        _, counters = decide(state[:4], finite)
        return new_updates, DynamicLossScaleState(
            *counters, _where_tree(finite, new_inner, state.inner_state)
        )

    def decide(counters, finite):
        old_scale, old_tracker, _, total_notfinite = counters
        scale, tracker, total = _scale_decision(
            old_scale,
            old_tracker,
            total_notfinite,
            finite,
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        return finite, (scale, tracker, finite, total)

    clip_first = clip_norm is not None
    spec = None if inner_fus is None else _scaled(inner_fus, clip_first, decide)
    if spec is None and (switch := E.switch_of(inner)) is not None:
        spec = _wrapped_switch(
            switch,
            lambda parts: _scaled_parts(parts, clip_first, decide),
            lambda parts, f: _scaled_over(parts, f, clip_first),
            DynamicLossScaleState,
        )
    if spec is not None:
        E.register(update_fn, spec)
    return GradientTransformation(init_fn, declare(update_fn, view=True))


@scalar_program
def _scale_decision(
    old_scale: torch.Tensor,
    old_tracker: torch.Tensor,
    total_notfinite: torch.Tensor,
    finite: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> tuple:
    """:func:`dynamic_loss_scale`'s new ``(scale, growth_tracker, total_notfinite)`` after an
    update whose finiteness is ``finite``: torch's ``_amp_update_scale_``, as tensor ops. Its
    kernels (CPU and CUDA) multiply the float32 scale by the factor as a double and round the
    product to float32 once (a float32 product would round a factor such as 1.1 or 0.3 first:
    an ulp off per change)."""
    tracker = torch.where(finite, old_tracker + 1, torch.zeros_like(old_tracker))
    scale64 = old_scale.double()
    grown = (scale64 * growth_factor).to(old_scale.dtype)
    grow = finite & (tracker == growth_interval)
    scale = torch.where(
        ~finite,
        (scale64 * backoff_factor).to(old_scale.dtype),
        torch.where(grow & torch.isfinite(grown), grown, old_scale),
    )
    tracker = torch.where(grow, torch.zeros_like(tracker), tracker)
    return scale, tracker, total_notfinite + (~finite).to(torch.int64)


@scalar_program
def _unscale_factor(scale: torch.Tensor) -> tuple:
    """``(1 / scale,)``, the reciprocal taken in float64 and rounded to float32
    (``GradScaler.unscale_``)."""
    return (scale.double().reciprocal().float(),)


def _unscale_prologue(scale, b):
    return _unscale_factor(scale), lambda trees: None


def _unscale_leaf(u, p, s, h, key):
    """``u * (1 / scale)``, the reciprocal taken in float64 and rounded to float32 (a
    scalar), the result in ``u``'s dtype (``GradScaler.unscale_``)."""
    return (u * h[0]).to(u.dtype), ()


_UNSCALE = E.Elementwise("dynamic_loss_scale", _unscale_leaf, _unscale_prologue, E.no_fields, 0)


def _scaled(inner_fus: E.Fusable, clip_first: bool, decide: Callable) -> E.Fusable:
    """``dynamic_loss_scale(inner)``'s Fusable, for ``update`` and ``ft.step`` when ``inner``
    is fusable: the unscaling, then ``apply_if_finite``'s parts (:func:`_guarded_parts`) deciding
    with ``decide`` (every non-finite update skipped, the scale updated): a pass that unscales
    (taking the squares a leading clip sums), the decision, one pass of the guarded inner."""
    return _scaled_over(_scaled_parts(inner_fus.parts, clip_first, decide), inner_fus, clip_first)


def _scaled_parts(inner_parts: tuple, clip_first: bool, decide: Callable) -> tuple:
    """:func:`_scaled`'s parts, made from the inner's."""
    return (_UNSCALE, *_guarded_parts(inner_parts, clip_first, decide, "dynamic_loss_scale"))


def _scaled_over(parts: tuple, inner_fus: E.Fusable, clip_first: bool) -> E.Fusable:
    """:func:`_scaled`'s Fusable: its ``parts`` (:func:`_scaled_parts` of ``inner_fus``'),
    the state split and joined through ``inner_fus``' own."""

    def split(state):
        if not isinstance(state, DynamicLossScaleState):
            raise ValueError(
                "dynamic_loss_scale: expected the DynamicLossScaleState from "
                f"dynamic_loss_scale.init, got {type(state).__name__}"
            )
        inner_states = list(inner_fus.split(state.inner_state))
        cs = inner_states.pop(0) if clip_first else None
        return [state.scale, (tuple(state[:4]), cs), *inner_states, None]

    def join(states):
        counters, cs = states[1]
        inner_states = ([cs] if clip_first else []) + list(states[2:-1])
        return DynamicLossScaleState(*counters, inner_fus.join(inner_states))

    return E.Fusable(parts, split, join)


def skip_not_finite(updates, gradient_step, params=None, *, mesh=None):
    """For ``multi_steps(..., should_skip_update_fn=skip_not_finite)`` (optax's): skip a
    micro-step whose gradients hold a NaN or an infinity on any rank.

    Returns ``(should_skip, {"should_skip": ..., "num_not_finite": ...})``: 0-dim bool and
    int64 tensors, the same on every rank (non-finite elements counted over the global
    tensors, replicas once). Collectives: one scalar all-reduce over the mesh; under a
    ``Mesh.data_axis`` with unreduced gradients, also the bucketed all-reduce that reduces
    them first (on every micro-step: inside ``multi_steps`` this gives up its
    communication-free micro-steps).
    """
    del gradient_step
    b = prepare(updates, None, mesh, name="skip_not_finite")
    counts = [(~torch.isfinite(b.locals[i])).sum().to(torch.float64) for i in b.active]
    total = b.global_sum(counts, b.active) if counts else torch.zeros((), dtype=torch.float64)
    num = total.round().to(torch.int64)
    skip = num > 0
    return skip, {"should_skip": skip, "num_not_finite": num}


def skip_large_updates(
    updates, gradient_step, params=None, max_squared_norm: float = 1.0, *, mesh=None
):
    """For ``multi_steps(..., should_skip_update_fn=functools.partial(skip_large_updates,
    max_squared_norm=...))`` (optax's): skip a micro-step whose global squared norm is not
    below ``max_squared_norm`` (a non-finite norm skips too).

    Returns ``(should_skip, {"should_skip": ..., "norm_squared": ...})`` (0-dim bool and
    float32/64 tensors, the same on every rank). Collectives: one scalar all-reduce, plus,
    for gradients unreduced over ``Mesh.data_axis``, the all-reduce that reduces them first
    (on every micro-step of ``multi_steps``).
    """
    del gradient_step
    from .clipping import global_norm_of

    b = prepare(updates, None, mesh, name="skip_large_updates")
    norm_sq = global_norm_of(b).square()
    skip = ~(norm_sq < max_squared_norm)
    return skip, {"should_skip": skip, "norm_squared": norm_sq}


def loss_scale(state: Any) -> torch.Tensor:
    """The loss scale held by the :func:`dynamic_loss_scale` state in ``state`` (any tree
    holding exactly one): a 0-dim float32 tensor to multiply the loss by.

    Raises:
        ValueError: no :class:`DynamicLossScaleState` in ``state``.
    """
    return find_state(state, DynamicLossScaleState, "loss_scale").scale
