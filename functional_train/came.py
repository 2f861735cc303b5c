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
from . import foreach
from .base import EmptyState, GradientTransformation, chain, check_state, declare
from .engine.pool import MIN_MEAN_BYTES, Pool, Scratch, of_plan
from .engine.view import per_leaf_result, per_leaf_view, prepare
from .factored import (
    ScaleByFactoredRmsState,
    clip_denominators,
    factored_ema,
    factored_rms,
    is_factored,
    leaf_rms,
    new_state_tree,
    placeholder,
    scale_by_factored_rms,
    squared,
    state_leaves,
    zeros_reduced,
)
from .hyperparams import injectable, is_injected
from .spec import attach_spec, transform_spec
from .transforms import (
    ScalarOrSchedule,
    ScaleByScheduleState,
    add_decayed_weights,
    scale_by_learning_rate,
)
from .tree import state_dtype, state_zeros_like, tree_paths

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
            optree.tree_unflatten(treedef, rows),
            optree.tree_unflatten(treedef, cols),
        )

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        check_state(state, ScaleByCameState, where)
        # 1. u: the factored second moment (materialises unreduced gradients)
        u_tree, s = second.update(
            updates,
            ScaleByFactoredRmsState(state.count, state.v_row, state.v_col, state.v),
            params,
            mesh=mesh,
        )
        b = prepare(u_tree, params, None if mesh is None else mesh.reduced(), name=where)
        m_all = b.state_locals(state.exp_avg, "ScaleByCameState.exp_avg")
        fac = [i for i in b.active if is_factored(b.updates[i].shape, 0)]
        empty = (0,)
        fset = set(fac)
        e_row = {i: (tuple(b.updates[i].shape[:-1]) if i in fset else empty) for i in b.active}
        e_col = {
            i: (tuple(b.updates[i].shape[:-2] + b.updates[i].shape[-1:]) if i in fset else empty)
            for i in b.active
        }
        row_leaves, row_loc = state_leaves(b, state.res_row, f"{where}: res_row", e_row, fac)
        col_leaves, col_loc = state_leaves(b, state.res_col, f"{where}: res_col", e_col, fac)
        if not b.active:
            return b.rebuild_active([]), ScaleByCameState(
                s.count, s.v_row, s.v_col, s.v, state.exp_avg, state.res_row, state.res_col
            )
        act = b.active
        m_old = [m_all[i] for i in act]
        u = [
            b.locals[i] if b.locals[i].dtype == m.dtype else b.locals[i].to(m.dtype)
            for i, m in zip(act, m_old)
        ]
        # 2. RMS clipping: one all-reduce of per-leaf sums for all leaves
        den = clip_denominators(b, u, clip_threshold)
        u = [x / d.to(x.dtype) for x, d in zip(u, den)]
        # 3. momentum (as came_pytorch: m * b1 + (1 - b1) * u)
        m_new = foreach.mul(m_old, b1)
        foreach.add_(m_new, u, alpha=1.0 - b1)
        pos = {i: k for k, i in enumerate(act)}
        out: list = [None] * len(b.locals)
        for i, m in zip(act, m_new):  # 1-D / 0-D leaves: a copy of m (never the state itself)
            out[i] = m.to(b.locals[i].dtype, copy=True)
        # 4. confidence statistics of the factored leaves: one batched leaf_sums
        dts = {i: row_loc[i].dtype for i in fac}
        items = (
            (
                i,
                squared(u[pos[i]].to(dts[i]) - m_new[pos[i]].to(dts[i])).add_(eps2),
                row_loc[i],
                col_loc[i],
            )
            for i in fac
        )
        beta3 = torch.full((), b3, dtype=torch.float64, device=state.count.device)
        new_row, new_col = {}, {}
        for i, (r, c, f) in zip(fac, factored_ema(b, items, beta3)):
            new_row[i], new_col[i] = r, c
            m = m_new[pos[i]]
            out[i] = f.mul_(m.to(f.dtype)).to(b.locals[i].dtype)
        new_state = ScaleByCameState(
            s.count,
            s.v_row,
            s.v_col,
            s.v,
            b.state_tree(state.exp_avg, "ScaleByCameState.exp_avg", m_new),
            new_state_tree(b, row_leaves, new_row),
            new_state_tree(b, col_leaves, new_col),
        )
        return b.rebuild(out), new_state

    return GradientTransformation(init_fn, declare(update_fn, unreduced=True))


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
    leaf by leaf in one process (:func:`fused_came_step`), with the same numbers.

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
    fused = FusedCame(
        *(float(x) for x in betas),
        *(float(x) for x in eps),
        clip_threshold if is_injected(clip_threshold) else float(clip_threshold),
        weight_decay,
        learning_rate,
        transform_spec(txs[1]).keep_of if (V.nonzero(weight_decay) and mask is not None) else None,
        len(txs),
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
    weight_decay: float
    learning_rate: Any
    mask: Any = None  # params -> [bool per leaf]: the leaves decayed (None: all)
    parts: int = 2  # transforms in the chain (3 with the decay: its value may be an injected 0)

    @property
    def min_mean_bytes(self) -> int:
        """Each leaf costs ~60 small operations on the per-leaf path against a few batched ones
        in the chain: it is taken only where leaves average this much (as the result pool)."""
        return MIN_MEAN_BYTES


def fused_came_step(
    fused: FusedCame, grads: Any, state: Any, params: Any, mesh: Any, donate: bool
) -> tuple | None:
    """``ft.step`` of ``came`` when no leaf needs communication (plain tensors, one process):
    each leaf is finished while it is in cache -- second moment, RMS clip, momentum,
    confidence statistics, decay and learning rate, added to its parameter (in place with
    ``donate``) -- before the next is read, as ``came_pytorch``'s per-parameter loop does, with
    the chain's numbers op for op. Returns ``None`` where the general path must run (see
    :func:`functional_train.factored.fused_adafactor_step`; also when the leaves average under
    ``engine.pool.MIN_MEAN_BYTES``, 64 KiB, where the chain's batched operations are faster)."""
    lr_state = state[-1] if isinstance(state, tuple) and state else None
    schedule = callable(fused.learning_rate)
    if not (
        isinstance(state, tuple)
        and len(state) == fused.parts
        and isinstance(state[0], ScaleByCameState)
        and isinstance(lr_state, ScaleByScheduleState if schedule else EmptyState)
    ):
        return None
    s = state[0]
    view = per_leaf_view(grads, params, mesh, "came", fused.min_mean_bytes)
    if view is None:
        return None
    b, pl, treedef = view
    act = b.active
    where = "scale_by_came"
    m_all = b.state_locals(s.exp_avg, "ScaleByCameState.exp_avg")
    fac = [i for i in act if is_factored(b.updates[i].shape, 0)]
    fset = set(fac)
    empty = (0,)
    e_row = {i: (tuple(b.updates[i].shape[:-1]) if i in fset else empty) for i in act}
    e_col = {
        i: (tuple(b.updates[i].shape[:-2] + b.updates[i].shape[-1:]) if i in fset else empty)
        for i in act
    }
    row_leaves, row_loc = state_leaves(b, s.res_row, f"{where}: res_row", e_row, fac)
    col_leaves, col_loc = state_leaves(b, s.res_col, f"{where}: res_col", e_col, fac)
    if schedule:  # scale_by_learning_rate's numbers
        step = torch.as_tensor(fused.learning_rate(lr_state.count), dtype=torch.float64) * -1.0
    else:
        step = -1.0 * fused.learning_rate
    beta3 = torch.full((), fused.b3, dtype=torch.float64, device=s.count.device)
    new_p = {}
    if not donate:  # result buffers the caller has dropped are reused (see engine/pool.py)
        pool = of_plan(b.plan, "pool", Pool)
        new_p = dict(zip(act, pool.take("params", [b.params[i] for i in act])))
    scratch = of_plan(b.plan, "scratch", Scratch)
    scratch2 = of_plan(b.plan, "scratch2", Scratch)
    new_m, new_row, new_col = {}, {}, {}
    if not donate:
        new_m = dict(zip(act, pool.take("exp_avg", [m_all[i] for i in act])))
    keep = fused.mask(params) if fused.mask is not None else None

    def finish(i, u):
        g, p, m_old = b.locals[i], b.params[i], m_all[i]
        x = u if u.dtype == m_old.dtype else u.to(m_old.dtype)  # ours: changed in place
        den = leaf_rms([x], x.numel())[0].div_(fused.clip_threshold).clamp_min_(1.0)
        x.div_(den.to(x.dtype))
        m = m_old.mul_(fused.b1) if donate else torch.mul(m_old, fused.b1, out=new_m[i])
        m.add_(x, alpha=1.0 - fused.b1)
        new_m[i] = m
        if i in fset:
            dt = row_loc[i].dtype
            res = torch.sub(x.to(dt), m.to(dt), out=scratch2.view(0, x.shape, dt, x.device))
            res = res.mul_(res).add_(fused.eps2)
            ((r, c, f),) = factored_ema(
                b, [(i, res, row_loc[i], col_loc[i])], beta3, scratch2, local=True
            )
            new_row[i], new_col[i] = r, c
            out = f.mul_(m.to(f.dtype)).to(g.dtype)
        else:
            out = m.to(g.dtype, copy=True)
        if fused.weight_decay and (keep is None or keep[i]):
            out.add_(p if p.dtype == out.dtype else p.to(out.dtype), alpha=fused.weight_decay)
        out.mul_(step.to(out.dtype) if schedule else step)
        if donate:
            p.add_(out)
        else:
            torch.add(p, out, out=new_p[i])

    with torch.no_grad():
        _, new_fac = factored_rms(
            b,
            ScaleByFactoredRmsState(s.count, s.v_row, s.v_col, s.v),
            "scale_by_factored_rms",
            -0.8,
            fused.b2,
            fused.eps1,
            0,
            finish,
            scratch,
            local=True,
        )
    new_s = ScaleByCameState(
        new_fac.count,
        new_fac.v_row,
        new_fac.v_col,
        new_fac.v,
        b.state_tree(s.exp_avg, "ScaleByCameState.exp_avg", [new_m[i] for i in act]),
        new_state_tree(b, row_leaves, new_row),
        new_state_tree(b, col_leaves, new_col),
    )
    new_state = (
        new_s,
        *state[1:-1],
        ScaleByScheduleState(lr_state.count + 1) if schedule else lr_state,
    )
    return per_leaf_result(params, pl, treedef, new_p, new_state, donate)
