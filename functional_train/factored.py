"""Factored second moments and the block-RMS transforms of Adafactor (Shazeer & Stern 2018).

Adafactor as composable primitives, exact under sharding:

* :func:`scale_by_factored_rms` - the factored (row x column) second-moment estimate;
* :func:`clip_by_block_rms` - ``u / max(1, RMS(u) / threshold)`` per leaf;
* :func:`scale_by_param_block_rms` - ``u * max(min_scale, RMS(param))`` per leaf;
* :func:`relative_step_schedule` - Adafactor's ``min(1e-2, 1/sqrt(t))`` step size;
* :func:`ema` - exponential moving average of the updates (Adafactor's ``beta1``);
* :func:`adafactor` - the chain equal to ``transformers.optimization.Adafactor``.

Every statistic is computed over the GLOBAL tensor: means over a sharded dim are local sums
completed by :meth:`~functional_train.sharding.Prepared.leaf_sums` (each rank writes its partial
sums at their global offsets into buffers holding the whole statistics; replicas are weighed so
they count once) and divided by the global size of the dim. Collectives are batched: one
:meth:`leaf_sums` call per transform and update, i.e. ONE all-reduce for the statistics of every
leaf, whatever the number of leaves and their placements. Colossal-AI's
``DistributedAdaFactor`` (seed 003) computes its column statistics from the local rows only
under ZeRO and never refreshes its parameter RMS; these are exact.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import _validate as V
from . import foreach
from . import leaves as L
from .autograd import traced
from .base import (
    EmptyState,
    GradientTransformation,
    chain,
    check_state,
    elementwise_transform,
)
from .combine import mask_of
from .engine import elementwise as E
from .engine.dtensor import spec_of, to_local
from .engine.pool import Scratch
from .engine.scalars import schedule_value
from .engine.view import Prepared
from .hyperparams import injectable, value_of
from .spec import attach_spec, transform_spec
from .transforms import (
    ScalarOrSchedule,
    ScaleByScheduleState,
    reject_complex,
    scale,
    scale_by_learning_rate,
    stateless_elementwise,
    zero_count,
)
from .tree import (
    contiguous_stride,
    flatten_as,
    state_dtype,
    state_zeros_like,
    tree_paths,
    tree_unflatten,
)

__all__ = [
    "scale_by_factored_rms",
    "ScaleByFactoredRmsState",
    "clip_by_block_rms",
    "scale_by_param_block_rms",
    "relative_step_schedule",
    "ema",
    "EmaState",
    "adafactor",
]


# ---------------------------------------------------------------------------------------------
# state construction: row / column statistics with derived placements
# ---------------------------------------------------------------------------------------------
def _reduced_placements(x: DTensor, dim: int, path: str) -> list:
    """Placements of ``x`` reduced over tensor dim ``dim`` (the dim disappears): a ``Shard`` on
    ``dim`` becomes ``Replicate``, a ``Shard`` on a later dim moves one dim down."""
    nd = x.ndim
    dim %= nd
    out = []
    for p in x.placements:
        if isinstance(p, Partial):
            raise ValueError(
                f"parameter '{path}' is Partial; optimizer states need parameters "
                "in Shard/Replicate placements"
            )
        if isinstance(p, Shard):
            d = p.dim % nd
            if d == dim:
                out.append(Replicate())
            else:
                out.append(Shard(d if d < dim else d - 1))
        else:
            out.append(Replicate())
    return out


def zeros_reduced(x: Any, dim: int, dtype: torch.dtype, path: str) -> Any:
    """Zeros shaped like ``x`` without tensor dim ``dim``: for a DTensor, a DTensor of global
    shape ``x.shape`` minus ``dim``, sharded like ``x`` over the remaining dims (no
    communication; the local shard is built from the local shard of ``x``, uneven shards
    included)."""
    if isinstance(x, DTensor):
        local = x.to_local()
        z = local.narrow(dim, 0, 0).sum(dim, dtype=dtype)
        shape = list(x.shape)
        del shape[dim % x.ndim]
        return DTensor.from_local(
            z,
            x.device_mesh,
            _reduced_placements(x, dim, path),
            run_check=False,
            shape=torch.Size(shape),
            stride=contiguous_stride(shape),
        )
    return x.narrow(dim, 0, 0).sum(dim, dtype=dtype)


def placeholder(x: Any, dtype: torch.dtype) -> Any:
    """A 0-element state entry (shape ``(0,)``) for a statistic a leaf does not use; replicated
    on the leaf's mesh for DTensor leaves."""
    if isinstance(x, DTensor):
        z = torch.zeros((0,), dtype=dtype, device=x.device)
        return DTensor.from_local(
            z,
            x.device_mesh,
            [Replicate()] * x.device_mesh.ndim,
            run_check=False,
            shape=torch.Size([0]),
            stride=(1,),
        )
    return torch.zeros((0,), dtype=dtype, device=x.device)


def squared(x: torch.Tensor) -> torch.Tensor:
    """``x * x``, a new tensor (``torch.square`` is ``pow(x, 2)``, slower on CPU)."""
    return torch.mul(x, x)


def is_factored(shape: Sequence[int], min_dim: int) -> bool:
    return len(shape) >= 2 and min(shape[-2], shape[-1]) >= min_dim


def state_leaves(
    b: Prepared, tree: Any, what: str, expected: dict, used: Sequence[int]
) -> tuple[list, dict]:
    """Flatten a per-leaf state tree (structure of the updates), check the shapes of the active
    leaves against ``expected[i]`` and return ``(leaves, {i: local shard for i in used})``."""
    leaves = flatten_as(tree, b.treedef, what, "the updates")
    for i, shape in expected.items():
        x = leaves[i]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{what}: leaf '{b.paths[i]}' has shape {got}, expected "
                f"{tuple(shape)} for a parameter of shape "
                f"{tuple(b.updates[i].shape)}"
            )
    return leaves, {i: to_local(leaves[i]) for i in used}


def new_state_tree(b: Prepared, leaves: list, new_locals: dict) -> Any:
    """``leaves`` with the entries in ``new_locals`` (index -> local shard) rewrapped in the
    spec of the old entry; other entries are kept as they are (same objects)."""
    out = list(leaves)
    for i, loc in new_locals.items():
        s = spec_of(leaves[i])
        out[i] = (
            loc
            if s is None
            else DTensor.from_local(
                loc, s.mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride
            )
        )
    return tree_unflatten(b.treedef, out)


# ---------------------------------------------------------------------------------------------
# the factored second moment (reusable by CAME's confidence statistics)
# ---------------------------------------------------------------------------------------------
def _shards_of(x: Any, dim: int) -> int:
    """How many shards the mesh dims splitting tensor dim ``dim`` of ``x`` cut it into."""
    if not isinstance(x, DTensor):
        return 1
    dim %= x.ndim
    return math.prod(
        [
            x.device_mesh.size(m)
            for m, p in enumerate(x.placements)
            if isinstance(p, Shard) and p.dim % x.ndim == dim
        ]
    )


def factored_ema(
    b: Prepared,
    items: Iterable[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]],
    beta: torch.Tensor,
    scratch: Scratch | None = None,
    local: bool = False,
    split: bool = False,
) -> Iterator[tuple]:
    """Exact factored moving averages of per-leaf squared quantities, one ``leaf_sums`` call.

    Args:
        items: an iterable (a generator keeps one ``S`` alive at a time) of ``(leaf index, S,
            R_old, C_old)`` with ``S`` the local shard of a non-negative leaf-shaped quantity
            (``g^2 + eps``), ``R_old`` / ``C_old`` the local shards of its
            row (``shape[:-1]``) and column (``shape[:-2] + shape[-1:]``) statistics.
        beta: 0-dim decay (a tensor; float64 is fine, each statistic keeps its dtype).

    Yields, per item (a generator: ``leaf_sums`` runs when the first result is asked for, and
    each ``F`` is made when its turn comes, in ``scratch``'s slot 1 when given; ``local=True``
    skips ``leaf_sums`` where the caller knows no leaf needs communication), ``(R, C, F)``:
    ``R = beta R_old + (1-beta) mean_{-1}(S)``, ``C = beta C_old + (1-beta) mean_{-2}(S)`` and
    the local shard of the leaf-shaped factor
    ``F = rsqrt(R / mean_{-1}(R))[..., None] * rsqrt(C)[..., None, :]``, every mean over the
    global tensor. With ``split`` the factor's two vectors instead of ``F``: ``(R, C,
    rsqrt(R / mean_{-1}(R))[..., None], rsqrt(C)[..., None, :])`` (``F`` is their product).

    ``mean_{-1}(R)`` needs no second round of communication:
    ``sum_rows R = beta sum_rows R_old + (1-beta) sum_{rows, cols}(S) / n_cols``, and both sums
    are partial sums completed in the same batched call as the row and column sums (reduced over
    the mesh dims that shard the rows, resp. the rows or the columns).
    """
    reqs, kept = [], []
    one_minus = 1.0 - beta
    per_col: dict = {}  # (1 - beta) / n_cols, made once per width
    for i, s, r_old, c_old in items:  # items may be a generator: each S is summed right after
        kept.append((i, r_old, c_old))  # it is made (while in cache), then dropped
        x = b.updates[i]
        n_cols = int(x.shape[-1])
        row = s.sum(-1)  # partial over local columns
        reqs.append((i, row, (-1,)))
        reqs.append((i, s.sum(-2), (-2,)))  # partial over local rows
        # sum_rows R_new = beta sum_rows R_old + (1-beta) sum(S) / n_cols, one partial sum over
        # the local block: R_old is the same on every column shard, so it is divided by their
        # number before the sum over rows AND columns adds it up again
        shards = _shards_of(x, -1)
        w = per_col.get(n_cols)
        if w is None:
            w = per_col[n_cols] = one_minus / n_cols
        total = r_old.sum(-1) * (beta / shards if shards != 1 else beta) + row.sum(-1) * w
        reqs.append((i, total.to(row.dtype), (-2, -1)))
    if not kept:
        return
    # local: the caller knows no leaf needs communication (one process, plain tensors)
    red = [t for _, t, _ in reqs] if local else b.leaf_sums(reqs)
    for k, (i, r_old, c_old) in enumerate(kept):
        row_sum, col_sum, r_total = red[3 * k : 3 * k + 3]
        shape = b.updates[i].shape
        n_rows, n_cols = int(shape[-2]), int(shape[-1])
        r = r_old * beta + (row_sum / n_cols) * one_minus
        c = c_old * beta + (col_sum / n_rows) * one_minus
        r_mean = r_total / n_rows
        rf = torch.rsqrt(r / r_mean.unsqueeze(-1)).unsqueeze(-1)
        cf = torch.rsqrt(c).unsqueeze(-2)
        if split:
            yield r, c, rf, cf
            continue
        if scratch is None:
            f = rf * cf
        else:  # F in the scratch slot 1 (valid until the next item is asked for)
            f = torch.mul(rf, cf, out=scratch.view(1, shape, rf.dtype, rf.device))
        yield r, c, f  # lazily: the caller uses each F while it is in cache


class ScaleByFactoredRmsState(NamedTuple):
    """State of :func:`scale_by_factored_rms`.

    Fields (``v_row``, ``v_col``, ``v`` are trees with the structure of the params, one entry
    per leaf, float32 by default, see ``v_dtype``):

    * ``count``: number of previous updates (int64, 0-dim);
    * ``v_row``: for a factored leaf of shape ``(..., n, m)``, the row statistic ``R`` of shape
      ``(..., n)`` (HF ``exp_avg_sq_row``); for a DTensor leaf a DTensor placed like the rows:
      ``Shard(d)`` kept for ``d < ndim - 1``, a ``Shard`` of the last dim becomes ``Replicate``.
      For a non-factored leaf: a 0-element placeholder of shape ``(0,)`` (``Replicate`` on the
      leaf's mesh for DTensor leaves).
    * ``v_col``: for a factored leaf the column statistic ``C`` of shape ``(..., m)``
      (HF ``exp_avg_sq_col``), placed like the columns: a ``Shard`` of dim ``-2`` becomes
      ``Replicate``, ``Shard(ndim - 1)`` becomes ``Shard(ndim - 2)`` (C's last dim), batch dims
      are kept. Placeholder for non-factored leaves.
    * ``v``: for a non-factored leaf (0-D / 1-D, or below ``min_dim_size_to_factor``) the full
      second moment ``V`` (params-shaped, the parameter's placements; HF ``exp_avg_sq``);
      placeholder for factored leaves.

    Placeholders are never modified: the same objects are returned in the new state.
    """

    count: torch.Tensor
    v_row: Any
    v_col: Any
    v: Any


def factored_rms(
    b: Prepared,
    state: ScaleByFactoredRmsState,
    where: str,
    decay_rate: float,
    beta2: float | None,
    eps: float,
    min_dim: int,
    on_update: Callable[[int, torch.Tensor], None] | None = None,
    scratch: Scratch | None = None,
    local: bool = False,
    operands: bool = False,
) -> tuple[list, ScaleByFactoredRmsState]:
    """:func:`scale_by_factored_rms`'s update on a prepared view: ``(new locals, new state)``.

    With ``operands`` (the transform's prologue) the update is not made: the first result
    holds, per active leaf, the two factors its leaf function multiplies the update by
    (:func:`factored_update`): ``(rsqrt(V), 1)`` for a leaf with the full second moment,
    ``(rsqrt(R / mean(R))[..., None], rsqrt(C)[..., None, :])`` for a factored one.

    ``on_update(i, u)``, when given, is called with each active leaf's update as soon as it is
    made (``u`` is a fresh tensor the callback may modify in place), the dense leaves first,
    then each factored leaf while its buffers are still in cache (``ft.step``'s fused
    Adafactor finishes the leaf there). With ``scratch`` the leaf-sized temporaries of the
    factored leaves (``g^2 + eps``, and their updates) are views of its slots 0 and 1: an
    update is then valid only during its ``on_update`` call, and the returned locals of the
    factored leaves must not be used."""
    reject_complex(b, where)
    fac = [i for i in b.active if is_factored(b.updates[i].shape, min_dim)]
    fset = set(fac)
    dense = [i for i in b.active if i not in fset]
    empty = (0,)
    e_row = {i: (tuple(b.updates[i].shape[:-1]) if i in fset else empty) for i in b.active}
    e_col = {
        i: (tuple(b.updates[i].shape[:-2] + b.updates[i].shape[-1:]) if i in fset else empty)
        for i in b.active
    }
    e_v = {i: (empty if i in fset else tuple(b.updates[i].shape)) for i in b.active}
    row_leaves, row_loc = state_leaves(b, state.v_row, f"{where}: v_row", e_row, fac)
    col_leaves, col_loc = state_leaves(b, state.v_col, f"{where}: v_col", e_col, fac)
    v_leaves, v_loc = state_leaves(b, state.v, f"{where}: v", e_v, dense)
    count = state.count + 1
    if beta2 is None:
        b2 = 1.0 - torch.pow(count.to(torch.float64), decay_rate)
    else:
        b2 = torch.full((), beta2, dtype=torch.float64, device=count.device)
    out: list = [None] * len(b.locals)
    new_row, new_col, new_v = {}, {}, {}
    # other leaves: elementwise, foreach
    if dense:
        g = [b.locals[i] for i in dense]
        v_old = [v_loc[i] for i in dense]
        gs = [x.to(v.dtype) for x, v in zip(g, v_old)]
        gsq = foreach.mul(gs, gs)
        foreach.add_(gsq, eps)
        foreach.mul_(gsq, 1.0 - b2)  # a float64 0-dim scalar keeps each dtype
        # (a 0-dim float64 b2 would promote 0-dim leaves to float64: keep the state dtype)
        v_new = L.cast_like(foreach.mul(v_old, b2), v_old)
        foreach.add_(v_new, gsq)
        rs = foreach.rsqrt(v_new)
        if operands:
            for i, x, vn in zip(dense, rs, v_new):
                new_v[i] = vn
                out[i] = (x, torch.ones((), dtype=x.dtype, device=x.device))
        else:
            u = foreach.mul(rs, gs)  # (out of place: rsqrt's result is saved for autograd
            # under torch.func.grad)
            for i, x, vn, gi in zip(dense, u, v_new, g):
                new_v[i] = vn
                out[i] = x.to(gi.dtype)
                if on_update is not None:
                    on_update(i, out[i])

    # factored leaves: one batched leaf_sums for all of them
    def square(x):
        if scratch is None:
            return squared(x)
        return torch.mul(x, x, out=scratch.view(0, x.shape, x.dtype, x.device))

    items = (
        (i, square(b.locals[i].to(row_loc[i].dtype)).add_(eps), row_loc[i], col_loc[i]) for i in fac
    )
    for i, (r, c, *f) in zip(fac, factored_ema(b, items, b2, scratch, local, operands)):
        new_row[i], new_col[i] = r, c
        if operands:
            out[i] = tuple(f)
            continue
        (f,) = f
        g = b.locals[i]
        # f is a fresh buffer (out of place when traced: autograd may have saved it)
        out[i] = (f * g.to(f.dtype) if traced() else f.mul_(g.to(f.dtype))).to(g.dtype)
        if on_update is not None:
            on_update(i, out[i])
    new_state = ScaleByFactoredRmsState(
        count,
        new_state_tree(b, row_leaves, new_row),
        new_state_tree(b, col_leaves, new_col),
        new_state_tree(b, v_leaves, new_v),
    )
    return out, new_state


def scale_by_factored_rms(
    decay_rate: float = -0.8,
    eps: float = 1e-30,
    *,
    beta2: float | None = None,
    min_dim_size_to_factor: int = 0,
    v_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Adafactor's factored second-moment scaling, exactly as HF ``Adafactor`` computes it.

    With ``t = count + 1`` (1 on the first update) and ``b2t = 1 - t^decay_rate`` (or the
    constant ``beta2``), for every leaf ``g``:

    * ``G = g^2 + eps``;
    * factored leaves (``ndim >= 2`` and both of the last two dims ``>= min_dim_size_to_factor``),
      of shape ``(..., n, m)``: ``R <- b2t R + (1 - b2t) mean_{-1}(G)`` (shape ``(..., n)``),
      ``C <- b2t C + (1 - b2t) mean_{-2}(G)`` (shape ``(..., m)``),
      ``u = g * rsqrt(R / mean_{-1}(R))[..., None] * rsqrt(C)[..., None, :]``;
    * other leaves: ``V <- b2t V + (1 - b2t) G``, ``u = g * rsqrt(V)``.

    The update ``u`` has the dtype and placements of ``g``; statistics are computed in the state
    dtype. Under sharding every mean is over the global tensor (local sum, ``leaf_sums`` over
    the mesh dims that shard the reduced dim, division by the global size); uneven shards and
    empty local shards are fine.

    Communication per update: one batched ``leaf_sums`` call, i.e. ONE all-reduce (per state
    dtype) for the row, column and total statistics of every sharded factored leaf, whatever
    the number of leaves and their placements. ``mean_{-1}(R)`` is completed in the same call
    (see :func:`factored_ema`). Non-factored leaves need no communication.

    An elementwise part for the engine (:mod:`functional_train.engine.elementwise`): its
    prologue computes the statistics (the reduction), its leaf function
    (:func:`factored_update`) makes the update from them, and ``ft.step`` / ``chain`` run it in
    one pass with the elementwise transforms after it (a value per row and one per column,
    read by a kernel run by rows on CPU).

    Args:
        decay_rate: exponent of the relative-step decay ``b2t = 1 - t^decay_rate``; HF's sign
            convention (``<= 0``; the default ``-0.8`` is HF's and the paper's).
        eps: ``eps1`` added to ``g^2`` (>= 0; default ``1e-30`` as HF).
        beta2: a constant decay in [0, 1) used instead of ``b2t`` (CAME's ``beta2``); ``None``
            (default) for Adafactor's ``b2t``.
        min_dim_size_to_factor: factor a leaf only if its last two dims both have at least this
            size (default 0: every leaf with ``ndim >= 2``, as HF).
        v_dtype: dtype of ``R``, ``C``, ``V`` (default ``None``: float32, or the params' dtype
            when wider).

    State: :class:`ScaleByFactoredRmsState`.

    Raises:
        ValueError: ``decay_rate > 0``, ``eps < 0``, ``beta2`` outside [0, 1), negative
            ``min_dim_size_to_factor``; at update, a state from another transform or for
            other parameters (naming the leaf), a ``Partial`` parameter at init.

    Reference: Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
    Cost", Algorithms 4/5; ``transformers.optimization.Adafactor``.
    """
    where = "scale_by_factored_rms"
    decay_rate = V.number("decay_rate", decay_rate, where=where, high=0.0)
    eps = V.number("eps", eps, where=where, low=0.0)
    if beta2 is not None:
        beta2 = V.beta("beta2", beta2, where=where)
    min_dim = V.integer("min_dim_size_to_factor", min_dim_size_to_factor, where=where, low=0)

    def init_fn(params):
        leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
        paths = None
        rows, cols, vs = [], [], []
        for k, x in enumerate(leaves):
            if x is None:
                rows.append(None), cols.append(None), vs.append(None)
                continue
            dt = state_dtype(x.dtype, v_dtype)
            if is_factored(x.shape, min_dim):
                if paths is None:
                    paths = tree_paths(params)
                rows.append(zeros_reduced(x, -1, dt, paths[k]))
                cols.append(zeros_reduced(x, -2, dt, paths[k]))
                vs.append(placeholder(x, dt))
            else:
                rows.append(placeholder(x, dt))
                cols.append(placeholder(x, dt))
                vs.append(state_zeros_like(x, v_dtype))
        return ScaleByFactoredRmsState(
            zero_count(params),
            tree_unflatten(treedef, rows),
            tree_unflatten(treedef, cols),
            tree_unflatten(treedef, vs),
        )

    def prologue(state, b):
        check_state(state, ScaleByFactoredRmsState, where)
        ops, new_state = factored_rms(
            b, state, where, value_of(decay_rate), beta2, eps, min_dim, operands=True
        )
        mine = [ops[i] for i in b.active]
        return ([a for a, _ in mine], [c for _, c in mine]), lambda trees: new_state

    spec = E.Elementwise(
        where,
        factored_update,
        prologue,
        E.no_fields,
        0,
        reduces=True,
        leaf_scalars=(0, 1),
    )
    return elementwise_transform(spec, init_fn)


def factored_scale(x, a, c, dtype, into=None):
    """``x`` scaled by a leaf's factors: ``(a * c) * x`` in ``a``'s dtype (the statistics'),
    rounded to ``dtype``; ``a`` a value per row (``(..., n, 1)``) or one value, ``c`` a value per
    column (``(..., 1, m)``) or one value. Adafactor's update (:func:`factored_update`) and
    CAME's (its momentum by the confidence factors). ``into``: a buffer of the leaf's shape
    and ``a``'s dtype that the product ``a * c`` is written into and then scaled in place (the
    same operations, without the two leaf-sized temporaries: ``ft.step``'s per-leaf steps,
    never recorded by autograd)."""
    if into is None:
        return ((a * c) * x.to(a.dtype)).to(dtype)
    return torch.mul(a, c, out=into).mul_(x.to(a.dtype)).to(dtype)


def factored_update(u, p, s, h, key):
    """:func:`scale_by_factored_rms` on one leaf, given its statistics: ``u * (a * c)`` in the
    statistics' dtype, the result in ``u``'s; ``(a, c)`` is ``(rsqrt(V), 1)`` for a leaf with
    the full second moment, ``(rsqrt(R / mean(R))[..., None], rsqrt(C)[..., None, :])``, a
    value per row and one per column, for a factored one (``factored_rms(operands=True)``)."""
    a, c = h
    return factored_scale(u, a, c, u.dtype), ()


# ---------------------------------------------------------------------------------------------
# block RMS: clipping the updates, scaling by the parameters
# ---------------------------------------------------------------------------------------------
def _unbind(vec: torch.Tensor) -> list:
    """The elements of ``vec`` as 0-dim tensors (which callers may modify in place: under a
    ``torch.func`` transform ``select`` views of a copy: autograd refuses in-place changes to
    the views of ``unbind``, and to a tensor it saved, such as the result of a ``sqrt``)."""
    if traced():
        vec = vec.clone()
        return [vec[k] for k in range(vec.shape[0])]
    return list(vec.unbind())


def block_rms(b: Prepared, locs: Sequence[torch.Tensor], idx: Sequence[int]) -> list:
    """Per-leaf RMS over the GLOBAL leaf (0-dim tensors, float32 for low-precision leaves,
    float64 for float64 ones): local sums of squares completed by ONE ``leaf_totals``
    all-reduce for all leaves, divided by the global numel."""
    if not idx:
        return []
    locs = list(locs)
    vec = _block_rms_vector(b, locs, idx)
    if vec is not None:
        return _unbind(vec)
    low = [k for k, x in enumerate(locs) if torch.finfo(x.dtype).bits < 32]
    if not low:
        norms = list(foreach.norm(locs, 2))
    else:  # bf16 / fp16: accumulate and return in float32 (HF upcasts before its RMS)
        lows = set(low)
        high = [k for k in range(len(locs)) if k not in lows]
        norms = [None] * len(locs)
        for k, n in zip(high, foreach.norm([locs[k] for k in high], 2) if high else []):
            norms[k] = n
        for k, n in zip(low, foreach.norm([locs[k] for k in low], 2, dtype=torch.float32)):
            norms[k] = n
    sq = foreach.mul(norms, norms)
    tot = b.leaf_totals(list(zip(idx, sq)))
    ms = [t / max(b.updates[i].numel(), 1) for i, t in zip(idx, tot)]
    return foreach.sqrt(ms)


def _block_rms_vector(
    b: Prepared, locs: Sequence[torch.Tensor], idx: Sequence[int]
) -> torch.Tensor | None:
    """:func:`block_rms` as one vector (the same numbers: every operation is elementwise on
    the per-leaf values) when every tensor of ``locs`` has one dtype; ``None`` otherwise."""
    dtype = locs[0].dtype
    if any(x.dtype != dtype for x in locs):
        return None
    if torch.finfo(dtype).bits < 32:  # bf16 / fp16: accumulated and returned in float32
        norms = foreach.norm(locs, 2, dtype=torch.float32)
    else:
        norms = foreach.norm(locs, 2)
    v = torch.stack(norms)
    tot = b.leaf_totals_vector(idx, v * v)
    numel = torch.tensor(
        [max(b.updates[i].numel(), 1) for i in idx], dtype=tot.dtype, device=tot.device
    )
    return (tot / numel).sqrt()


def leaf_rms(xs: Sequence[torch.Tensor], numel: int) -> list:
    """:func:`block_rms` of local leaves of one dtype and ``numel`` elements each, in one
    process (no communication), with its numbers in fewer operations (0-dim each)."""
    dt = torch.float32 if torch.finfo(xs[0].dtype).bits < 32 else None
    n = float(max(numel, 1))
    return [(x * x).div_(n).sqrt_() for x in foreach.norm(xs, 2, dtype=dt)]


def clip_by_block_rms(threshold: float = 1.0) -> GradientTransformation:
    """Scale each leaf so that its RMS is at most ``threshold``:
    ``u <- u / max(1, RMS(u) / threshold)``, ``RMS(u) = sqrt(sum(u^2) / numel)`` over the
    GLOBAL leaf (Adafactor's update clipping ``d``, HF ``clip_threshold``; optax
    ``clip_by_block_rms``).

    Communication per update: one batched ``leaf_sums``: ONE all-reduce of the per-leaf sums of
    every sharded leaf, whatever the number of leaves. No state. Elementwise with a per-leaf
    scalar: a fused pass starts here (after the updates' RMS) and takes what follows.

    Args:
        threshold: > 0.

    Raises:
        ValueError: ``threshold <= 0``; at update, a state from another transform.
    """
    where = "clip_by_block_rms"
    threshold = V.number("threshold", threshold, where=where, low=0.0, low_open=True)

    def dens(b):
        if not b.active:
            return ([],)
        return (clip_denominators(b, [b.locals[i] for i in b.active], threshold),)

    return stateless_elementwise(where, _clip_leaf, dens, reduces=True, leaf_scalars=(0,))


def clip_denominators(b: Prepared, rms_or_locals: list, threshold, *, rms: bool = False) -> list:
    """Per active leaf of ``b``, :func:`clip_by_block_rms`' ``max(1, RMS(u) / threshold)``
    (0-dim tensors), from the updates' locals (one ``leaf_totals`` all-reduce for their RMS),
    or from their RMS with ``rms=True`` (CAME's update clipping too)."""
    vals = rms_or_locals if rms else block_rms(b, rms_or_locals, b.active)
    den = L.div(vals, value_of(threshold))
    foreach.clamp_min_(den, 1.0)
    return den


def _clip_leaf(u, p, s, h, key):
    """``clip_by_block_rms`` on one leaf: ``u / den``, the leaf's own ``den = max(1, RMS(u) /
    threshold)`` in ``u``'s dtype."""
    return u / h[0].to(u.dtype), ()


def _scale_leaf(u, p, s, h, key):
    """``scale_by_param_block_rms`` on one leaf: ``u * scale``, the leaf's own ``scale =
    max(min_scale, RMS(param))`` in ``u``'s dtype."""
    return u * h[0].to(u.dtype), ()


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    """Scale each leaf by the RMS of its parameter: ``u <- u * max(min_scale, RMS(param))``,
    RMS over the GLOBAL parameter (Adafactor's relative step size ``scale_parameter``, with
    ``min_scale`` = HF's ``eps[1]``; optax ``scale_by_param_block_rms``).

    The RMS is of the parameters passed to ``update`` (the values before this step), recomputed
    every update. Communication per update: one batched ``leaf_sums`` (see
    :func:`clip_by_block_rms`). No state. Elementwise with a per-leaf scalar: fuses with the
    transforms beside it.

    Args:
        min_scale: >= 0 (default ``1e-3``, HF's ``eps[1]``).

    Raises:
        ValueError: ``min_scale < 0``; at update, ``params`` missing or a state from another
            transform.
    """
    where = "scale_by_param_block_rms"
    min_scale = V.number("min_scale", min_scale, where=where, low=0.0)

    def scales(b):
        if not b.active:
            return ([],)
        rms = block_rms(b, [b.params[i] for i in b.active], b.active)
        foreach.clamp_min_(rms, min_scale)
        return (rms,)

    return stateless_elementwise(where, _scale_leaf, scales, needs_params=True, leaf_scalars=(0,))


def _clip_and_scale_by_param_rms(threshold: float, min_scale: float) -> GradientTransformation:
    """``clip_by_block_rms(threshold)`` and ``scale_by_param_block_rms(min_scale)`` in one
    transform, so that the RMS of every update and of every parameter take ONE all-reduce
    together (Adafactor's two scalar statistics, with ``beta1``). The two primitives' leaf
    functions in sequence: their numbers."""

    def both(b):
        act = b.active
        if not act:
            return ([], [])
        n = len(act)
        rms = block_rms(b, [b.locals[i] for i in act] + [b.params[i] for i in act], act + act)
        scale = rms[n:]
        foreach.clamp_min_(scale, min_scale)
        return (clip_denominators(b, rms[:n], threshold, rms=True), scale)

    def leaf(u, p, s, h, key):
        u, _ = _clip_leaf(u, p, s, h[:1], key)
        return _scale_leaf(u, p, s, h[1:], key)

    return stateless_elementwise(
        "adafactor", leaf, both, needs_params=True, reduces=True, leaf_scalars=(0, 1)
    )


# ---------------------------------------------------------------------------------------------
# step size, momentum
# ---------------------------------------------------------------------------------------------
def relative_step_schedule(warmup_init: bool = False):
    """Adafactor's relative step size as a schedule of the update count.

    ``rho(count) = min(1e-6 * t if warmup_init else 1e-2, 1 / sqrt(t))`` with ``t = count + 1``
    (``count`` = number of previous updates, 0 on the first, as
    :func:`~functional_train.scale_by_learning_rate` passes it). Accepts an int or a 0-dim
    integer tensor; returns a 0-dim float64 tensor (tensor ops only, no host sync).

    Reference: HF ``Adafactor._get_lr`` (``relative_step=True``).
    """
    if not isinstance(warmup_init, bool):
        raise TypeError(
            f"relative_step_schedule: warmup_init must be a bool, got {type(warmup_init).__name__}"
        )

    def schedule(count):
        t = torch.as_tensor(count).to(torch.float64) + 1.0
        min_step = 1e-6 * t if warmup_init else torch.full_like(t, 1e-2)
        return torch.minimum(min_step, torch.rsqrt(t))

    return schedule


class EmaState(NamedTuple):
    """State of :func:`ema`: ``count`` (int64, 0-dim) and ``ema`` (params-shaped, the
    parameter's placements, float32 by default)."""

    count: torch.Tensor
    ema: Any


def ema(
    decay: float, debias: bool = False, *, accumulator_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Exponential moving average of the updates: ``m <- decay m + (1 - decay) u``; the update
    is ``m``, or ``m / (1 - decay^t)`` with ``debias`` (t counted from 1).

    optax ``ema`` semantics, but ``debias`` defaults to ``False`` (Adafactor's ``beta1``
    momentum, HF ``exp_avg``, is not debiased). Elementwise: no communication; an elementwise
    part, fused with the transforms beside it.

    Args:
        decay: in [0, 1).
        debias: divide by ``1 - decay^t``.
        accumulator_dtype: dtype of ``m`` (default ``None``: float32, or the params' dtype when
            wider).

    Raises:
        ValueError: ``decay`` outside [0, 1); at update, a state from another transform.
    """
    where = "ema"
    decay = V.beta("decay", decay, where=where)

    def init_fn(params):
        return EmaState(zero_count(params), state_zeros_like(params, accumulator_dtype))

    def prologue(state, b):
        check_state(state, EmaState, where)
        d = value_of(decay)
        count = state.count + 1
        bc = (1.0 - torch.pow(d, count.to(torch.float64))) if debias else 1.0
        return (1.0 - d, bc), lambda trees: EmaState(count, *trees)

    def fields(state):
        return ((state.ema, "EmaState.ema"),)

    def leaf(u, p, s, h, key):
        """``m = lerp(m, u, 1 - decay)`` (in ``m``'s dtype, torch's formula); the update ``m``,
        or ``m / (1 - decay^t)`` with ``debias``, in ``u``'s dtype."""
        m = s[0]
        w, bc = h
        new = torch.lerp(m, u.to(m.dtype), w.to(m.dtype) if isinstance(w, torch.Tensor) else w)
        out = new / bc.to(new.dtype) if debias else new
        return out.to(u.dtype), (new,)

    return elementwise_transform(E.Elementwise(where, leaf, prologue, fields, 1), init_fn)


# ---------------------------------------------------------------------------------------------
# the alias
def _adafactor_scale(
    threshold: float, min_scale: float | None, weight_decay: float, rho, mask=None
) -> GradientTransformation:
    """Private: Adafactor's tail without ``beta1`` as ONE multiplication per leaf,
    ``u <- -alpha_t (u / max(1, RMS(u) / threshold) + weight_decay theta)`` with
    ``alpha_t = rho_t * max(min_scale, RMS(theta))`` (``rho_t`` when ``min_scale`` is None).

    The same numbers, up to float rounding, as ``clip_by_block_rms``, ``add_decayed_weights``,
    ``scale_by_param_block_rms`` and ``scale_by_learning_rate(rho)`` in sequence, which make
    three passes over every update where this makes one: the per-leaf factor
    ``-rho_t s / max(1, RMS(u) / threshold)`` is a 0-dim tensor, computed in float64 and cast to
    the leaf's dtype. Both RMS take ONE all-reduce together. State: :class:`ScaleByScheduleState`
    when ``rho`` is a schedule, else ``EmptyState``. ``mask``: decay only the leaves where it is
    True.
    """
    where = "adafactor"
    decays = V.nonzero(weight_decay)
    need_params = min_scale is not None or decays
    keep_of = mask_of(mask, where) if (mask is not None and decays) else None
    kind = ScaleByScheduleState if callable(rho) else EmptyState

    def init_fn(params):
        if keep_of is not None:
            keep_of(params)  # resolved (and checked) once eagerly
        return ScaleByScheduleState(zero_count(params)) if callable(rho) else EmptyState()

    def prologue(state, b):
        check_state(state, kind, where)
        new_state = ScaleByScheduleState(state.count + 1) if callable(rho) else state
        act = b.active
        if not act:
            return ([], []), lambda trees: new_state
        if need_params and b.params is None:
            raise ValueError(f"{where}: needs params (update(..., params))")
        g = [b.locals[i] for i in act]
        p = [b.params[i] for i in act] if need_params else []
        factors, steps = adafactor_factors(
            b, act, g, p, rho_at(rho, state), value_of(threshold), min_scale
        )
        return (factors, decay_factors(steps, value_of(weight_decay))), lambda trees: new_state

    def leaf(u, p, s, h, key):
        """``u * factor`` (the leaf's ``-rho_t s / max(1, RMS(u) / threshold)``, in ``u``'s
        dtype), plus ``decay * p`` (the leaf's ``-alpha_t * weight_decay``, float64, cast to
        ``u``'s dtype) where it decays."""
        out = u * h[0].to(u.dtype)
        return (decayed(out, p, h[1], key) if decays else out), ()

    spec = E.Elementwise(
        where,
        leaf,
        prologue,
        E.no_fields,
        0,
        needs_params=need_params,
        static=keep_of,
        reduces=True,
        leaf_scalars=(0, 1),
    )
    tx = elementwise_transform(spec, init_fn)
    attach_spec(tx.update, keep_of=keep_of)
    return tx


def decayed(u: torch.Tensor, p: torch.Tensor, coef: torch.Tensor, key) -> torch.Tensor:
    """Adafactor's decay on one leaf: ``u + p * coef`` (``coef`` the leaf's float64 decay
    factor, cast to ``u``'s dtype), ``u`` itself where the mask keeps it from decay (``key``
    False)."""
    if key is False:
        return u
    return u + p.to(u.dtype) * coef.to(u.dtype)


def rho_at(rho, state) -> torch.Tensor:
    """The learning rate ``rho_t`` (float64, 0-dim) for the tail's state."""
    if callable(rho):
        return schedule_value(rho, state.count)
    return torch.as_tensor(rho, dtype=torch.float64)


def adafactor_factors(
    b: Prepared,
    idx: Sequence[int],
    u: Sequence[torch.Tensor],
    p: Sequence[torch.Tensor],
    lr: torch.Tensor,
    threshold: float,
    min_scale: float | None,
) -> tuple[list, list]:
    """Per leaf ``(factor, step)``: ``step = -lr * max(min_scale, RMS(p))`` (float64; ``-lr``
    when ``min_scale`` is None) and ``factor = step / max(1, RMS(u) / threshold)`` in ``u``'s
    dtype, the RMS over the global leaves (one ``leaf_totals`` for both)."""
    n = len(idx)
    scaled = min_scale is not None
    vec = _block_rms_vector(
        b, list(u) + list(p) if scaled else list(u), list(idx) * (2 if scaled else 1)
    )
    if vec is not None:  # one dtype: the leaves' values as vectors
        factors, step = adafactor_factor(
            vec[:n], vec[n:] if scaled else None, lr, threshold, min_scale, u[0].dtype
        )
        return _unbind(factors), _unbind(step.expand(n))
    rms = block_rms(b, list(u) + list(p) if scaled else list(u), list(idx) * (2 if scaled else 1))
    out = [
        adafactor_factor(rms[k], rms[n + k] if scaled else None, lr, threshold, min_scale, x.dtype)
        for k, x in enumerate(u)
    ]
    return [f for f, _ in out], [a for _, a in out]


def adafactor_factor(
    rms_u: torch.Tensor,
    rms_p: torch.Tensor | None,
    lr: torch.Tensor,
    threshold: float,
    min_scale: float | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adafactor's per-leaf ``(factor, step)`` from the RMS of the update and of the
    parameter (0-dim tensors, or vectors of several leaves' values): ``step = -lr *
    max(min_scale, RMS(p))`` (float64; ``-lr`` when ``rms_p`` is None) and ``factor = step /
    max(1, RMS(u) / threshold)`` in ``dtype``."""
    den = (rms_u / threshold).clamp_min(1.0)
    step = -lr if rms_p is None else -lr * rms_p.clamp_min(min_scale).to(torch.float64)
    return (step / den.to(torch.float64)).to(dtype), step


def decay_factors(steps: Sequence, weight_decay) -> list:
    """Per leaf, the weight decay's factor ``step * weight_decay`` (HF's ``-alpha_t wd``;
    computed even for a zero ``weight_decay``: an injected one makes the tail decay)."""
    return [a * weight_decay for a in steps]


@dataclasses.dataclass(frozen=True)
class FusedAdafactor:
    """What ``adafactor`` without ``beta1`` computes, for ``ft.step``'s per-leaf path (attached
    to the alias's chain's spec as ``fused``): the chain is ``scale_by_factored_rms(decay_rate,
    eps)`` then :func:`_adafactor_scale` ``(threshold, min_scale, weight_decay, rho)``."""

    decay_rate: float
    eps: float
    threshold: float
    min_scale: float | None
    weight_decay: float
    rho: Any
    mask: Any = None  # params -> [bool per leaf]: the leaves decayed (None: all)
    tail: Any = None  # the tail's Elementwise part (_adafactor_scale): its leaf math

    min_mean_bytes = 0  # small leaves are finished together: the path pays on any tree


# ---------------------------------------------------------------------------------------------
class StepSizeDecayState(NamedTuple):
    """State of Adafactor's step-size-scaled weight decay: the step count."""

    count: torch.Tensor


# (the name it had: objects pickled before it was public unpickle by it)
_StepSizeDecayState = StepSizeDecayState


def _add_step_size_decayed_weights(
    weight_decay: float, rho, scale_parameter: bool, min_scale: float, mask=None
) -> GradientTransformation:
    """Private: ``u <- u + weight_decay * alpha_t * param`` with Adafactor's step size
    ``alpha_t = rho(count) * (max(min_scale, RMS(param)) if scale_parameter else 1)``.

    Needed after the ``beta1`` momentum, where HF's weight decay ``theta <- theta - wd alpha_t
    theta`` cannot be folded into the momentum's input. Recomputes ``RMS(param)`` (one batched
    ``leaf_sums``) when ``scale_parameter``. ``mask``: decay only the leaves where it is True.
    """
    where = "adafactor"
    keep_of = mask_of(mask, where) if mask is not None else None

    def init_fn(params):
        if keep_of is not None:
            keep_of(params)
        return StepSizeDecayState(zero_count(params))

    def prologue(state, b):
        check_state(state, StepSizeDecayState, where)
        new_state = StepSizeDecayState(state.count + 1)
        act = b.active
        if not act:
            return ([],), lambda trees: new_state
        if b.params is None:
            raise ValueError(f"{where}: needs params (update(..., params))")
        lr = schedule_value(rho, state.count)
        wd = value_of(weight_decay)
        if scale_parameter:  # (HF's order: alpha_t = rho_t * scale, then alpha_t * wd)
            rms = block_rms(b, [b.params[i] for i in act], act)
            foreach.clamp_min_(rms, min_scale)
            coef = [x.to(torch.float64) * lr * wd for x in rms]
        else:
            coef = [lr * wd] * len(act)
        return (coef,), lambda trees: new_state

    def leaf(u, p, s, h, key):
        """``u + p * coef`` (the leaf's ``weight_decay * alpha_t``) where it decays."""
        return decayed(u, p, h[0], key), ()

    spec = E.Elementwise(
        where,
        leaf,
        prologue,
        E.no_fields,
        0,
        needs_params=True,
        static=keep_of,
        leaf_scalars=(0,),
    )
    return elementwise_transform(spec, init_fn)


@injectable(tensors=("clip_threshold", "decay_rate", "beta1", "weight_decay"))
def adafactor(
    learning_rate: ScalarOrSchedule | None = None,
    eps: tuple[float, float] = (1e-30, 1e-3),
    clip_threshold: float = 1.0,
    decay_rate: float = -0.8,
    beta1: float | None = None,
    weight_decay: float = 0.0,
    scale_parameter: bool = True,
    relative_step: bool = True,
    warmup_init: bool = False,
    *,
    mask=None,
) -> GradientTransformation:
    """``transformers.optimization.Adafactor`` as a chain: same arguments, defaults and numbers.

    With ``t`` the step (1 on the first update) and per leaf:

    * ``rho_t = min(1e-6 t if warmup_init else 1e-2, 1/sqrt(t))`` if ``relative_step`` else
      ``learning_rate`` (a float, or a schedule of the update count);
    * ``alpha_t = rho_t * max(eps[1], RMS(theta))`` if ``scale_parameter`` else ``rho_t``;
    * ``u`` = :func:`scale_by_factored_rms` ``(decay_rate, eps[0])`` of ``g``;
    * ``u <- u / max(1, RMS(u) / clip_threshold)`` (:func:`clip_by_block_rms`); ``u <- alpha_t u``;
    * with ``beta1``: ``m <- beta1 m + (1 - beta1) u``, ``u <- m`` (:func:`ema`);
    * ``theta <- theta - weight_decay * alpha_t * theta - u``.

    The chain: ``scale_by_factored_rms``, then without ``beta1`` ONE private transform that
    multiplies each update once by ``-alpha_t / max(1, RMS(u) / clip_threshold)`` (and adds
    ``-alpha_t weight_decay theta``): the numbers, up to float rounding, of
    ``clip_by_block_rms``, ``add_decayed_weights(weight_decay)`` (``alpha_t (u + wd theta)`` is
    HF's update), ``scale_by_param_block_rms(eps[1])`` and ``scale_by_learning_rate(rho)`` in
    sequence, in one pass over the updates instead of three; its state is
    ``ScaleByScheduleState`` (the update count) when ``rho`` is a schedule, as with
    ``relative_step``. With ``beta1``: ``clip_by_block_rms``, ``scale_by_param_block_rms``,
    ``scale_by_learning_rate(rho, flip_sign=False)``, ``ema(beta1)``, a private transform
    adding ``weight_decay * alpha_t * theta`` (HF decays with ``alpha_t`` after the momentum)
    and ``scale(-1)``; with ``scale_parameter`` the clipping and the parameter scaling are one
    private stateless transform. Both RMS share an all-reduce. Without ``beta1``, ``ft.step``
    runs it leaf by leaf in one process
    (:func:`functional_train.per_leaf.fused_adafactor_step`), with the same numbers.
    All RMS are over the global tensors;
    every statistic is exact under sharding.

    Needs ``params`` at update when ``scale_parameter`` or ``weight_decay``. Communication per
    update, whatever the number of leaves and their placements: ONE all-reduce for the
    factored statistics of every leaf (:func:`scale_by_factored_rms`) and ONE for the RMS of
    every update and every parameter: 2 for a default ``adafactor()``; one more RMS(param) with
    ``beta1`` and ``weight_decay`` and ``scale_parameter`` (the decay after the momentum).

    Args:
        learning_rate: HF ``lr``; must be ``None`` with ``relative_step=True`` and > 0 (or a
            schedule) with ``relative_step=False``.
        eps: ``(eps1, eps2)``: added to ``g^2``; lower bound of the parameter scale.
        clip_threshold: > 0, the update clipping threshold ``d``.
        decay_rate: <= 0, ``b2t = 1 - t^decay_rate``.
        beta1: first-moment decay in [0, 1), or ``None`` (no first moment, HF default).
        weight_decay: >= 0, decoupled decay scaled by ``alpha_t``.
        scale_parameter, relative_step, warmup_init: as HF.
        mask: ``None`` (every leaf decayed), or a tree of bools / ``params -> tree`` (e.g.
            :func:`~functional_train.decay_mask`): only the leaves where it is True are decayed
            (optax's ``mask``).

    State: a tuple of the chain's states (``ScaleByFactoredRmsState`` first; ``EmaState`` holds
    HF's ``exp_avg``).

    Raises:
        ValueError: ``learning_rate`` given with ``relative_step=True`` ("Cannot combine manual
            lr and relative_step=True", as HF); ``learning_rate`` missing or <= 0 with
            ``relative_step=False``; ``warmup_init=True`` without ``relative_step``;
            out-of-range ``eps``, ``clip_threshold``, ``decay_rate``, ``beta1``,
            ``weight_decay``.
        TypeError: ``eps`` is not a pair of numbers, or a flag is not a bool.

    Reference: Shazeer & Stern 2018; ``transformers.optimization.Adafactor`` (which
    Colossal-AI's ``DistributedAdaFactor`` copies).
    """
    where = "adafactor"
    for name, flag in (
        ("scale_parameter", scale_parameter),
        ("relative_step", relative_step),
        ("warmup_init", warmup_init),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{where}: {name} must be a bool, got {type(flag).__name__}")
    if learning_rate is not None and relative_step:
        raise ValueError(
            f"{where}: cannot combine a manual learning_rate with "
            "relative_step=True; pass relative_step=False to use learning_rate"
        )
    if warmup_init and not relative_step:
        raise ValueError(f"{where}: warmup_init=True requires relative_step=True")
    if not relative_step:
        if learning_rate is None:
            raise ValueError(f"{where}: learning_rate is required when relative_step=False")
        if not callable(learning_rate):
            V.number("learning_rate", learning_rate, where=where, low=0.0, low_open=True)
    if not (isinstance(eps, (tuple, list)) and len(eps) == 2):
        raise TypeError(f"{where}: eps must be a pair (eps1, eps2), got {eps!r}")
    eps1 = V.number("eps[0]", eps[0], where=where, low=0.0)
    eps2 = V.number("eps[1]", eps[1], where=where, low=0.0)
    clip_threshold = V.number("clip_threshold", clip_threshold, where=where, low=0.0, low_open=True)
    decay_rate = V.number("decay_rate", decay_rate, where=where, high=0.0)
    if beta1 is not None:
        beta1 = V.beta("beta1", beta1, where=where)
    weight_decay = V.number("weight_decay", weight_decay, where=where, low=0.0)

    if relative_step:
        rho = relative_step_schedule(warmup_init)
    else:
        rho = learning_rate
    txs = [scale_by_factored_rms(decay_rate, eps1)]
    # with scale_parameter, the RMS of the updates and of the parameters share one all-reduce
    if beta1 is None:
        min_scale = eps2 if scale_parameter else None
        txs.append(_adafactor_scale(clip_threshold, min_scale, weight_decay, rho, mask))
        tx = chain(*txs)
        fused = FusedAdafactor(
            decay_rate,
            eps1,
            clip_threshold,
            min_scale,
            weight_decay,
            rho,
            transform_spec(txs[-1]).keep_of,
            E.spec_of_transform(txs[-1]),
        )
        attach_spec(tx.update, fused=fused)  # (ft.step)
        return tx
    else:
        if scale_parameter:
            txs.append(_clip_and_scale_by_param_rms(clip_threshold, eps2))
        else:
            txs.append(clip_by_block_rms(clip_threshold))
        txs.append(scale_by_learning_rate(rho, flip_sign=False))
        txs.append(ema(beta1))
        if V.nonzero(weight_decay):
            rho_fn = rho if callable(rho) else (lambda count, _v=float(rho): _v)
            txs.append(
                _add_step_size_decayed_weights(weight_decay, rho_fn, scale_parameter, eps2, mask)
            )
        txs.append(scale(-1.0))
    return chain(*txs)
