"""Gradient clipping that stays right under tensor, pipeline, expert and data parallelism.

Colossal-AI's ``clip_grad_by_value`` / ``clip_grad_by_norm`` (seeds 000/001) as pure transforms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import optree
import torch

from . import _validate as V
from . import foreach
from .base import GradientTransformation, elementwise_transform
from .engine import elementwise as E
from .engine import native
from .engine.scalars import scalar_program
from .engine.view import prepare
from .leaves import DTYPE
from .spec import attach_spec
from .transforms import stateless_elementwise
from .tree import first_device

__all__ = ["clip", "clip_by_global_norm", "ClipByGlobalNormState", "global_norm"]


def clip(max_delta: float) -> GradientTransformation:
    """Clamp every element of the updates to ``[-max_delta, max_delta]``.

    Same as ``torch.nn.utils.clip_grad_value_`` and Colossal-AI's ``clip_grad_by_value``.
    Elementwise, so it needs no communication beyond reducing unreduced gradients. No state.
    Complex leaves: the real and imaginary parts are clamped separately (their
    ``torch.view_as_real``, as ``torch.optim`` treats complex parameters; torch's
    ``clip_grad_value_`` itself rejects them).

    Raises:
        ValueError: ``max_delta <= 0``.
    """
    max_delta = V.number("max_delta", max_delta, where="clip", low=0.0, low_open=True)

    def leaf(u, p, s, h, key):
        """``clamp(u, -max_delta, max_delta)``."""
        return torch.clamp(u, -h[0], h[0]), ()

    return stateless_elementwise("clip", leaf, lambda b: (max_delta,))


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: ``global_norm``, the pre-clip norm of the last
    update (0-dim float32, float64 for float64 params), kept so training loops can log it
    without recomputing it."""

    global_norm: torch.Tensor


_F32 = frozenset({torch.float32})


def _local_norm_terms(b, norm_type: float):
    """Per-leaf local terms, the kind of their reduction ('sum' of |g|^p, or 'max'), and the
    dtype the norm is given in where the terms are wider than that (else ``None``).

    The 2-norm of plain CPU float32 / float64 leaves sums their squares in float64 in one
    native call (:func:`~functional_train.engine.native.sum_squares`; about 2.5x faster than
    ``torch._foreach_norm`` on 242 leaves of 2,176 elements; each leaf read in its memory
    order, without a copy where it is dense in it, and independent of dispatch modes; under
    ``torch.compile`` through an opaque operator, so a compiled norm is the eager one); on
    CUDA the generated Triton sums (:func:`~functional_train.engine.fuse_triton.sum_squares`);
    everything else takes ``torch._foreach_norm``."""
    g = b.at(b.locals)
    if math.isinf(norm_type):
        # _foreach_norm has no identity for inf on empty shards (uneven sharding): pad one zero.
        return [torch.cat([x.reshape(-1), x.new_zeros(1)]).abs().max() for x in g], "max", None
    if norm_type == 2.0:
        # (given by the stage that wrote them; compiled: zeros where not needed at all, see
        # Prepared.needed)
        squares = b.sum_squares
        if squares is None:
            squares = native.local_sum_squares(g, b.needed)
        if squares is not None:
            f32 = (
                all([x.dtype == torch.float32 for x in g])  # (a list: dynamo traces it)
                if torch.compiler.is_compiling()
                else set(map(DTYPE, g)) <= _F32
            )
            return squares, "sum", torch.float32 if f32 else None
    norms = foreach.norm(g, norm_type) if g else []
    if norms and all(n.dtype == norms[0].dtype for n in norms):  # one vector, three ops
        v = torch.stack(norms).to(_wide(norms[0].dtype))
        return (v.square() if norm_type == 2.0 else v.pow(norm_type)), "sum", None
    if norm_type == 2.0:
        return [n.to(_wide(n.dtype)).square() for n in norms], "sum", None
    return [n.to(_wide(n.dtype)).pow(norm_type) for n in norms], "sum", None


def leaf_squares(b) -> torch.Tensor:
    """Per active leaf of the prepared view ``b``, the sum of its local shard's squares: a
    vector (float64 where the native sums run, else at least float32), by the clip's own
    local terms (one native call or ``torch._foreach_norm``; no leaf-sized temporary). A sum
    is NaN exactly where its leaf holds a NaN (the squares are >= 0: infinities sum to
    infinity, never to NaN). No collective."""
    terms, _, _ = _local_norm_terms(b, 2.0)
    if isinstance(terms, torch.Tensor):
        return terms
    return torch.stack(terms) if terms else torch.zeros(0, dtype=torch.float64)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 leaves: norms are accumulated at least in float32."""
    return torch.promote_types(dtype, torch.float32)


def global_norm_of(b, norm_type: float = 2.0) -> torch.Tensor:
    """The p-norm of a prepared tree over every leaf of every rank (ONE all-reduce)."""
    return global_norm_start(b, norm_type)()


def global_norm_start(b, norm_type: float = 2.0) -> Callable[[], torch.Tensor]:
    """:func:`global_norm_of` with its all-reduce issued now: returns ``finish``, which waits
    for it and gives the norm (host work in between overlaps the collective)."""
    terms, kind, dtype = _local_norm_terms(b, norm_type)
    finish = b.global_reduce_start(terms, b.active, kind)
    if kind == "max":
        return finish
    return lambda: _root(finish(), norm_type, dtype)[0]


@scalar_program
def _root(total: torch.Tensor, norm_type: float, dtype: torch.dtype | None) -> tuple:
    """``(total^(1/p),)`` for the sum ``total`` of the p-th powers (in ``dtype`` where given)."""
    x = total.sqrt() if norm_type == 2.0 else total.pow(1.0 / norm_type)
    return (x if dtype is None else x.to(dtype),)


def global_norm(updates, *, mesh=None, norm_type: float = 2.0) -> torch.Tensor:
    """The global p-norm of a tree of (possibly sharded, possibly unreduced) gradients.

    Every element of every leaf on every rank is counted once: shards add, replicas count once,
    pipeline stages and experts add. Returns a 0-dim float32 tensor (float64 when a leaf is
    float64; a plain tensor, the same
    value on every rank).
    """
    norm_type = V.number("norm_type", norm_type, where="global_norm", low=0.0, low_open=True)
    b = prepare(updates, None, mesh, name="global_norm")
    return global_norm_of(b, norm_type)


def clip_factor(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """:func:`clip_by_global_norm`'s factor ``min(1, max_norm / (total + 1e-6))`` for the
    global norm ``total`` (a 0-dim tensor; the result has its dtype and device), as
    ``torch.nn.utils.clip_grad_norm_`` computes it."""
    return _clip_factor(total, max_norm)[0]


@scalar_program
def _clip_factor(total: torch.Tensor, max_norm: float) -> tuple:
    return (torch.clamp(max_norm / (total + 1e-6), max=1.0),)


def clip_by_global_norm(max_norm: float, norm_type: float = 2.0) -> GradientTransformation:
    """Scale the updates so that their global p-norm is at most ``max_norm``.

    ``total = (sum over every element of every leaf of every rank, counted once, |g|^p)^(1/p)``
    (max for ``p = inf``); ``g <- g * min(1, max_norm / (total + 1e-6))``: the unsharded
    ``torch.nn.utils.clip_grad_norm_`` and Colossal-AI's ``clip_grad_by_norm``, but exact under
    TP (shards add), PP (stages add), MoE (experts add over ``Mesh.expert_axis``) and DP (replicas
    count once). One scalar all-reduce over the whole mesh per update, whatever the number of
    leaves and meshes. The 2-norm of float32 / float64 CPU leaves sums their squares in float64
    (a native kernel, see ``functional_train/engine/native.py``), so it can differ from
    ``clip_grad_norm_``'s float32 accumulation in the last bits, being the more accurate.

    Args:
        max_norm: > 0.
        norm_type: p > 0, or ``float('inf')``.

    State: :class:`ClipByGlobalNormState` with the pre-clip norm.

    Raises:
        ValueError: ``max_norm <= 0`` or ``norm_type <= 0``; at update, a state from another
            transform.
    """
    max_norm = V.number(
        "max_norm", max_norm, where="clip_by_global_norm", low=0.0, low_open=True, finite=True
    )
    norm_type = V.number(
        "norm_type", norm_type, where="clip_by_global_norm", low=0.0, low_open=True
    )

    def init_fn(params):
        leaves = [x for x in optree.tree_leaves(params) if isinstance(x, torch.Tensor)]
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32
        return ClipByGlobalNormState(torch.zeros((), dtype=dtype, device=first_device(params)))

    def start(b):
        """The norm's all-reduce, issued (the run issues several parts' together: see
        ``Elementwise.starts``)."""
        return global_norm_start(b, norm_type)

    def prologue(state, b):
        if not isinstance(state, ClipByGlobalNormState):
            raise ValueError(
                f"clip_by_global_norm: expected a ClipByGlobalNormState, got {type(state).__name__}"
            )
        total = E.issued(start, b)()
        coef = clip_factor(total, max_norm)
        return (coef,), lambda trees: ClipByGlobalNormState(total.to(state.global_norm.dtype))

    def leaf(u, p, s, h, key):
        """``u * coef`` (in ``u``'s dtype), ``coef = min(1, max_norm / (total + 1e-6))``."""
        return (u * h[0]).to(u.dtype), ()

    spec = E.Elementwise(
        "clip_by_global_norm",
        leaf,
        prologue,
        E.no_fields,
        0,
        reduces=True,
        reads_sum_squares=norm_type == 2.0,
        starts=start,
    )
    tx = elementwise_transform(spec, init_fn)
    attach_spec(tx.update, clip=(max_norm, norm_type))  # (ft.step, apply_if_finite)
    return tx
