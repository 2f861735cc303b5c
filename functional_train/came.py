"""CAME: Confidence-guided Adaptive Memory Efficient optimization (Luo et al. 2023).

* :func:`scale_by_came` - CAME's update direction (factored Adafactor second moment with a
  constant ``beta2``, block-RMS clipping, momentum, factored confidence statistics);
* :func:`came` - the alias equal to ``came_pytorch.CAME``.

Built on the factored machinery of :mod:`functional_train.factored`: every mean is over the
GLOBAL tensor under sharding, and communication is batched (a constant number of all-reduces per
update, whatever the number of leaves). Colossal-AI's ``DistributedCAME`` aliases the confidence
statistics to the squared-gradient statistics from step 2 on and scales its 1-D momentum by the
learning rate in place; this module does neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from . import _validate as V
from .base import GradientTransformation, chain, check_state, declare
from .engine import elementwise as E
from .engine.pool import MIN_MEAN_BYTES
from .engine.view import prepare
from .factored import (
    ScaleByFactoredRmsState,
    clip_denominators,
    factored_ema,
    factored_scale,
    is_factored,
    new_state_tree,
    placeholder,
    scale_by_factored_rms,
    squared,
    state_leaves,
    zeros_reduced,
)
from .hyperparams import injectable, is_injected
from .spec import attach_spec
from .transforms import (
    ScalarOrSchedule,
    add_decayed_weights,
    axpy,
    scale_by_learning_rate,
    times,
)
from .tree import state_dtype, state_zeros_like, tree_paths, tree_unflatten

__all__ = ["scale_by_came", "ScaleByCameState", "came"]


class ScaleByCameState(NamedTuple):
    """State of :func:`scale_by_came`.

    Per-leaf trees with the structure of the params (float32, or the params' dtype when wider):

    * ``count``: number of previous updates (int64, 0-dim);
    * ``v_row``, ``v_col``, ``v``: the second-moment statistics, exactly as
      :class:`~functional_train.ScaleByFactoredRmsState` (``exp_avg_sq_row``,
      ``exp_avg_sq_col`` for leaves with ``ndim >= 2``, ``exp_avg_sq`` for the others;
      0-element placeholders for the unused ones);
    * ``exp_avg``: the momentum ``m`` (params-shaped, the parameter's placements);
    * ``res_row``, ``res_col``: the confidence statistics ``R'``, ``C'`` of leaves with
      ``ndim >= 2`` (``exp_avg_res_row`` of shape ``(..., n)``, ``exp_avg_res_col`` of shape
      ``(..., m)``; placed like ``v_row`` / ``v_col``), placeholders of shape ``(0,)`` for
      0-D / 1-D leaves.
    """

    count: torch.Tensor
    v_row: Any
    v_col: Any
    v: Any
    exp_avg: Any
    res_row: Any
    res_col: Any


def momentum_leaf(u, p, s, h, key):
    """CAME's update clipping and momentum on one leaf, :func:`scale_by_came`'s definition:
    ``x = u / den`` (the leaf's ``den = max(1, RMS(u) / clip_threshold)``) and
    ``m <- b1 m + (1 - b1) x``, in the momentum's dtype. The update: ``m`` in ``u``'s dtype, or
    for a factored leaf (``key`` True) the residual ``(x - m)^2 + eps2`` whose row and column
    means are the confidence statistics."""
    b1, eps2, den = h
    (m,) = s
    dt = m.dtype
    x = u.to(dt) / den.to(dt)
    # (scalars as 0-dim float64 tensors, as a compiled stage passes them, in m's dtype: they
    # would promote a 0-dim leaf; 1 - b1 rounded once, as the Python float is)
    m = axpy(times(m, b1), x, 1.0 - b1)
    if key:
        return squared(x - m) + (eps2.to(dt) if isinstance(eps2, torch.Tensor) else eps2), (m,)
    return m.to(u.dtype), (m,)


def _run_by_scale_by_came(state, b):
    raise TypeError("scale_by_came's momentum part runs inside its update (apply_part)")


# (b1, eps2, den): den per leaf; run through the engine's kernels by scale_by_came's update and
# by ft.step's per-leaf step (per_leaf.fused_came_step), so that both compute it once, the same way
MOMENTUM = E.Elementwise(
    "scale_by_came", momentum_leaf, _run_by_scale_by_came, E.no_fields, 1, leaf_scalars=(2,)
)


class _Confidence(NamedTuple):
    """The fields of :class:`ScaleByCameState` the confidence part keeps (its share of the
    state in the engine's split)."""

    exp_avg: Any
    res_row: Any
    res_col: Any


def confidence_update(u, p, s, h, key):
    """CAME's update on one leaf given its statistics: the new momentum ``m`` (made by the
    part's prologue, :data:`MOMENTUM`) scaled by the confidence factors ``(a, c)``
    (:func:`~functional_train.factored.factored_scale`): ``(rsqrt(R' / mean(R'))[..., None],
    rsqrt(C')[..., None, :])`` for a factored leaf, ``(1, 1)`` for the others (the update is
    then ``m``), in ``u``'s dtype."""
    m, a, c = h
    return factored_scale(m, a, c, u.dtype), ()


def confidence_leaves(b, state: ScaleByCameState | _Confidence) -> tuple:
    """``(factored active leaves, res_row leaves, their locals, res_col leaves, their
    locals)`` of the prepared view ``b``: the confidence statistics, checked against the
    updates' shapes (row ``(..., n)``, column ``(..., m)``, ``(0,)`` for the other leaves)."""
    where = "scale_by_came"
    fac = [i for i in b.active if is_factored(b.updates[i].shape, 0)]
    fset = set(fac)
    empty = (0,)
    e_row = {i: (tuple(b.updates[i].shape[:-1]) if i in fset else empty) for i in b.active}
    e_col = {
        i: (tuple(b.updates[i].shape[:-2] + b.updates[i].shape[-1:]) if i in fset else empty)
        for i in b.active
    }
    row_leaves, row_loc = state_leaves(b, state.res_row, f"{where}: res_row", e_row, fac)
    col_leaves, col_loc = state_leaves(b, state.res_col, f"{where}: res_col", e_col, fac)
    return fac, row_leaves, row_loc, col_leaves, col_loc


def _pair_or_triple(name: str, value: Any, n: int, where: str) -> tuple:
    if not (isinstance(value, (tuple, list)) and len(value) == n):
        raise TypeError(f"{where}: {name} must be a tuple of {n} numbers, got {value!r}")
    return tuple(value)


def scale_by_came(
    betas: Sequence[float] = (0.9, 0.999, 0.9999),
    eps: Sequence[float] = (1e-30, 1e-16),
    clip_threshold: float = 1.0,
) -> GradientTransformation:
    """CAME's confidence-guided update direction, exactly as ``came_pytorch.CAME`` computes it
    (without learning rate and weight decay, see :func:`came`).

    For every leaf ``g`` (``b1, b2, b3 = betas``, ``eps1, eps2 = eps``):

    * ``u`` = :func:`~functional_train.scale_by_factored_rms` ``(eps=eps1, beta2=b2)`` of ``g``
      (factored for ``ndim >= 2``, a full second moment otherwise);
    * ``u <- u / max(1, RMS(u) / clip_threshold)`` (RMS over the global leaf);
    * ``m <- b1 m + (1 - b1) u``;
    * ``ndim >= 2``: ``U = (u - m)^2 + eps2``, ``R' <- b3 R' + (1 - b3) mean_{-1}(U)``,
      ``C' <- b3 C' + (1 - b3) mean_{-2}(U)``, update
      ``m * rsqrt(R' / mean_{-1}(R'))[..., None] * rsqrt(C')[..., None, :]``;
    * 0-D / 1-D: the update is ``m``.

    The update has the dtype and placements of ``g``; statistics are in the state dtype.

    Communication per update: that of ``scale_by_factored_rms`` (ONE all-reduce for the factored
    statistics of every sharded leaf), one for the RMS clipping (per-leaf sums of all leaves
    together), and one for the confidence statistics: 3 when some leaf is sharded, whatever the
    number of leaves and their placements.

    Two parts for the engine (:mod:`functional_train.engine.elementwise`): the second moment's
    (:func:`~functional_train.scale_by_factored_rms`), then the confidence part, whose prologue
    is the reduction (the clip, then the momentum and the residuals in one pass, then the
    confidence statistics) and whose leaf function is the update given them
    (:func:`confidence_update`), so ``chain`` and ``ft.step`` run it in one pass with the
    elementwise transforms after it (the decay, the learning rate, ``p + u``).

    Args:
        betas: ``(b1, b2, b3)``, each in [0, 1).
        eps: ``(eps1, eps2)``, each >= 0.
        clip_threshold: > 0.

    State: :class:`ScaleByCameState`.

    Raises:
        TypeError: ``betas`` not a triple or ``eps`` not a pair of numbers.
        ValueError: out-of-range values; at update, a state from another transform or for other
            parameters (naming the leaf).

    Reference: Luo et al. 2023, "CAME: Confidence-guided Adaptive Memory Efficient
    Optimization"; ``came_pytorch.CAME``.
    """
    where = "scale_by_came"
    betas = _pair_or_triple("betas", betas, 3, where)
    eps = _pair_or_triple("eps", eps, 2, where)
    b1 = V.beta("betas[0]", betas[0], where=where)
    b2 = V.beta("betas[1]", betas[1], where=where)
    b3 = V.beta("betas[2]", betas[2], where=where)
    eps1 = V.number("eps[0]", eps[0], where=where, low=0.0)
    eps2 = V.number("eps[1]", eps[1], where=where, low=0.0)
    clip_threshold = V.number("clip_threshold", clip_threshold, where=where, low=0.0, low_open=True)
    second = scale_by_factored_rms(eps=eps1, beta2=b2)

    def init_fn(params):
        s = second.init(params)
        leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
        paths = None
        rows, cols = [], []
        for k, x in enumerate(leaves):
            if x is None:
                rows.append(None), cols.append(None)
                continue
            dt = state_dtype(x.dtype, None)
            if is_factored(x.shape, 0):
                if paths is None:
                    paths = tree_paths(params)
                rows.append(zeros_reduced(x, -1, dt, paths[k]))
                cols.append(zeros_reduced(x, -2, dt, paths[k]))
            else:
                rows.append(placeholder(x, dt))
                cols.append(placeholder(x, dt))
        return ScaleByCameState(
            s.count,
            s.v_row,
            s.v_col,
            s.v,
            state_zeros_like(params),
            tree_unflatten(treedef, rows),
            tree_unflatten(treedef, cols),
        )

    def confidence_prologue(state, b):
        # (b: the view of the second moment's updates u, materialised: a reduction follows)
        m_all = b.state_locals(state.exp_avg, "ScaleByCameState.exp_avg")
        fac, row_leaves, row_loc, col_leaves, col_loc = confidence_leaves(b, state)
        act = b.active
        if not act:
            return ([], [], []), lambda trees: state
        fset = set(fac)
        m_old = [m_all[i] for i in act]
        g = [b.locals[i] for i in act]
        # 1. RMS clipping: one all-reduce of per-leaf sums for all leaves (u in m's dtype)
        den = clip_denominators(
            b,
            [x if x.dtype == m.dtype else x.to(m.dtype) for x, m in zip(g, m_old)],
            clip_threshold,
        )
        # 2. the clip and the momentum (as came_pytorch: m * b1 + (1 - b1) * u), and the
        # factored leaves' residuals, in one pass
        first, m_new = E.apply_part(
            MOMENTUM, g, (m_old,), (b1, eps2, den), keys=[i in fset for i in act]
        )
        pos = {i: k for k, i in enumerate(act)}
        # 3. confidence statistics of the factored leaves: one batched leaf_sums; their
        # factors a value per row and one per column, (1, 1) for the other leaves
        items = ((i, first[pos[i]].to(row_loc[i].dtype), row_loc[i], col_loc[i]) for i in fac)
        beta3 = torch.full((), b3, dtype=torch.float64, device=m_old[0].device)
        rows: list = [None] * len(act)
        cols: list = [None] * len(act)
        new_row, new_col = {}, {}
        for i, (r, c, rf, cf) in zip(fac, factored_ema(b, items, beta3, split=True)):
            new_row[i], new_col[i] = r, c
            rows[pos[i]], cols[pos[i]] = rf, cf
        for k, m in enumerate(m_new):
            if rows[k] is None:
                rows[k] = cols[k] = torch.ones((), dtype=m.dtype, device=m.device)

        def finish(trees):
            return _Confidence(
                b.state_tree(state.exp_avg, "ScaleByCameState.exp_avg", m_new),
                new_state_tree(b, row_leaves, new_row),
                new_state_tree(b, col_leaves, new_col),
            )

        return (m_new, rows, cols), finish

    # the second moment's part, then the confidence part (its prologue the clip, the momentum
    # and the statistics; its leaf function the update given them): the engine's stages
    confidence = E.Elementwise(
        where,
        confidence_update,
        confidence_prologue,
        E.no_fields,
        0,
        reduces=True,
        leaf_scalars=(0, 1, 2),
    )
    second_part = E.spec_of_transform(second)
    assert isinstance(second_part, E.Elementwise)

    def split(state):
        check_state(state, ScaleByCameState, where)
        return [
            ScaleByFactoredRmsState(state.count, state.v_row, state.v_col, state.v),
            _Confidence(state.exp_avg, state.res_row, state.res_col),
        ]

    def join(states):
        s, c = states
        return ScaleByCameState(s.count, s.v_row, s.v_col, s.v, *c)

    fusable = E.Fusable((second_part, confidence), split, join)

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        del extra
        b = prepare(updates, params, mesh, name=where)
        return E.run(fusable, b, state, params)

    E.register(update_fn, fusable)
    return GradientTransformation(init_fn, declare(update_fn, view=True))


@injectable(tensors=("clip_threshold", "weight_decay"))
def came(
    learning_rate: ScalarOrSchedule,
    betas: Sequence[float] = (0.9, 0.999, 0.9999),
    eps: Sequence[float] = (1e-30, 1e-16),
    clip_threshold: float = 1.0,
    weight_decay: float = 0.0,
    *,
    mask=None,
) -> GradientTransformation:
    """``came_pytorch.CAME`` as a chain: same arguments, defaults and numbers.

    ``theta <- theta - lr * weight_decay * theta - lr * update`` with ``update`` from
    :func:`scale_by_came`; the chain is ``scale_by_came``, ``add_decayed_weights(weight_decay)``
    (when non-zero) and ``scale_by_learning_rate(learning_rate)``. Needs ``params`` at update
    when ``weight_decay``. Communication: that of :func:`scale_by_came`. ``ft.step`` runs it
    leaf by leaf in one process where the leaves are large
    (:func:`functional_train.per_leaf.fused_came_step`), elsewhere as the engine's stages (see
    :func:`scale_by_came`), with the same numbers.

    Args:
        learning_rate: > 0 (required, as ``came_pytorch``), or a schedule of the update count.
        betas, eps, clip_threshold: see :func:`scale_by_came`.
        weight_decay: >= 0.
        mask: ``None`` (every leaf decayed), or a tree of bools / ``params -> tree`` (e.g.
            :func:`~functional_train.decay_mask`): only the leaves where it is True are decayed
            (optax's ``mask``; see :func:`~functional_train.add_decayed_weights`).

    Raises:
        ValueError: ``learning_rate`` missing or <= 0, out-of-range hyper-parameters.
        TypeError: ``betas`` / ``eps`` of the wrong length.
    """
    where = "came"
    if learning_rate is None:
        raise ValueError(f"{where}: learning_rate is required")
    if not callable(learning_rate):
        V.number("learning_rate", learning_rate, where=where, low=0.0, low_open=True)
    weight_decay = V.number("weight_decay", weight_decay, where=where, low=0.0)
    txs = [scale_by_came(betas, eps, clip_threshold)]
    if V.nonzero(weight_decay):
        txs.append(add_decayed_weights(weight_decay, mask=mask))
    txs.append(scale_by_learning_rate(learning_rate))
    tx = chain(*txs)
    betas = _pair_or_triple("betas", betas, 3, where)
    eps = _pair_or_triple("eps", eps, 2, where)
    tail = tuple(E.spec_of_transform(t) for t in txs[1:])
    assert all(isinstance(x, E.Elementwise) for x in tail)
    fused = FusedCame(
        *(float(x) for x in betas),
        *(float(x) for x in eps),
        clip_threshold if is_injected(clip_threshold) else float(clip_threshold),
        tail,
    )
    attach_spec(tx.update, fused=fused)  # (ft.step)
    return tx


@dataclasses.dataclass(frozen=True)
class FusedCame:
    """What ``came`` computes, for ``ft.step``'s per-leaf path (the ``fused`` of the alias's
    chain's spec)."""

    b1: float
    b2: float
    b3: float
    eps1: float
    eps2: float
    clip_threshold: float
    # the chain's transforms after scale_by_came (the weight decay where there is one, the
    # learning rate): their elementwise parts, run with apply_updates per leaf
    tail: tuple

    @property
    def min_mean_bytes(self) -> int:
        """Each leaf costs ~60 small operations on the per-leaf path against a few batched ones
        in the chain: it is taken only where leaves average this much (as the result pool)."""
        return MIN_MEAN_BYTES
