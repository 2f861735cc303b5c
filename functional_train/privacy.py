"""Differentially private aggregation of per-example gradients (DP-SGD).

Abadi et al. 2016, "Deep Learning with Differential Privacy"; optax's
``contrib.differentially_private_aggregate`` (its name, arguments and semantics); Opacus'
``DPOptimizer`` with flat clipping computes the same aggregate.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import NamedTuple

import optree
import torch
from torch.distributed.tensor import DTensor

from . import _validate as V
from .autograd import host_value
from .base import GradientTransformation, declare
from .engine.view import prepare
from .tree import format_path, tree_flatten, tree_unflatten

__all__ = ["differentially_private_aggregate", "DifferentiallyPrivateAggregateState"]

_WHERE = "differentially_private_aggregate"


class DifferentiallyPrivateAggregateState(NamedTuple):
    """State of :func:`differentially_private_aggregate`: ``count``, the number of previous
    updates (0-dim int64, always on the CPU: the noise of update ``t`` is drawn from a
    generator seeded by ``(seed, t)``, read on the host without a device synchronisation)."""

    count: torch.Tensor


def differentially_private_aggregate(
    l2_norm_clip: float, noise_multiplier: float, seed: int
) -> GradientTransformation:
    """Clip each example's gradient, sum, add Gaussian noise, average (DP-SGD's aggregation).

    The updates are PER-EXAMPLE gradients: every leaf has a leading batch axis of the same
    size ``B`` (``torch.func.vmap(torch.func.grad(loss))`` gives them; a ``None`` leaf passes
    through). For each example ``i``, ``g_i`` (its slice of every leaf) is scaled by
    ``min(1, l2_norm_clip / ||g_i||)``, ``||g_i||`` its L2 norm over all its leaves; the
    scaled examples are summed, Gaussian noise of standard deviation
    ``l2_norm_clip * noise_multiplier`` is added to every element of the sum, and the result is
    divided by ``B``: params-shaped updates (the batch axis gone), in each leaf's dtype.
    optax's ``differentially_private_aggregate``; Opacus' flat clipping divides by
    ``||g_i|| + 1e-6`` instead of ``||g_i||`` (a relative difference below ``1e-6 /
    ||g_i||``).

    Data parallel (``Mesh(..., data_axis=...)``): each replica holds its own examples (the
    same ``B`` on every replica); the clipped sums are summed over the replicas (one bucketed
    all-reduce), the noise is drawn ONCE for the global batch (the same generator on every
    rank: identical on the replicas, so a run on ``R`` replicas equals one process on the
    ``R * B`` examples with the same seed) and the total is divided by ``R * B``.

    The noise of update ``t`` (0, 1, ...) comes from a CPU ``torch.Generator`` seeded from
    ``(seed, t)`` (a BLAKE2b digest of both), drawn leaf by leaf in the tree's order, in
    float64 for float64 leaves and float32 otherwise, then moved to the leaf's device: the same
    numbers on any device and rank. Under ``torch.func.vmap`` (an ensemble) every batch
    element gets the same noise, as under ``jax.vmap`` of optax's with one seed; under
    ``grad`` / ``jvp`` the noise is a constant.

    Args:
        l2_norm_clip: ``C > 0``, the per-example norm bound.
        noise_multiplier: ``sigma >= 0`` (0: no noise, the clipped mean).
        seed: an int in ``[0, 2**31)``.

    In a chain (``chain(differentially_private_aggregate(...), sgd(...))``) use ``update`` and
    ``apply_updates``: ``ft.step`` checks that the gradients have the parameters' shapes, which
    per-example gradients do not (or aggregate first, and ``ft.step`` the rest of the chain).

    State: :class:`DifferentiallyPrivateAggregateState`.

    Raises:
        ValueError: out-of-range arguments; at update, leaves without a common leading batch
            axis (naming the leaf), an expert axis in the mesh.
        TypeError: a DTensor leaf (per-example gradients are plain tensors per replica), a
            ``seed`` that is not an int.
    """
    l2_norm_clip = V.number(
        "l2_norm_clip", l2_norm_clip, where=_WHERE, low=0.0, low_open=True, finite=True
    )
    noise_multiplier = V.number(
        "noise_multiplier", noise_multiplier, where=_WHERE, low=0.0, finite=True
    )
    seed = V.integer("seed", seed, where=_WHERE, low=0)
    if seed >= 2**31:
        raise ValueError(f"{_WHERE}: seed must be < 2**31, got {seed}")

    def init_fn(params):
        del params
        return DifferentiallyPrivateAggregateState(torch.zeros((), dtype=torch.int64))

    def update_fn(updates, state, params=None, *, mesh=None, **extra):
        del params, extra
        if not isinstance(state, DifferentiallyPrivateAggregateState):
            raise ValueError(
                f"{_WHERE}: expected the DifferentiallyPrivateAggregateState from its init, "
                f"got {type(state).__name__}"
            )
        if mesh is not None and mesh.expert_axis is not None:
            raise ValueError(f"{_WHERE}: a mesh with an expert axis is not supported")
        leaves, treedef = tree_flatten(updates)
        idx = [i for i, x in enumerate(leaves) if x is not None]
        batch = _batch_size(leaves, idx, treedef)
        sums = _clipped_sums([leaves[i] for i in idx], l2_norm_clip)
        replicas = 1
        if mesh is not None and mesh.pending_data_reduction:
            # the clipped sums are per-replica contributions: averaged by the engine (one
            # bucketed all-reduce), times the replicas
            full = [None] * len(leaves)
            for i, s in zip(idx, sums):
                full[i] = s
            b = prepare(tree_unflatten(treedef, full), None, mesh, name=_WHERE)
            sums = [b.locals[i] for i in idx]
            replicas = math.prod(mesh.device_mesh.size(d) for d in mesh.data_dims)
        std = l2_norm_clip * noise_multiplier
        noise = _noise(sums, seed, _count(state.count), std) if std > 0 else None
        out = list(leaves)
        total = float(batch * replicas)
        for k, (i, s) in enumerate(zip(idx, sums)):
            if replicas > 1:
                s = s * replicas
            if noise is not None:
                s = s + noise[k]
            out[i] = (s / total).to(leaves[i].dtype)
        return tree_unflatten(treedef, out), DifferentiallyPrivateAggregateState(state.count + 1)

    return GradientTransformation(init_fn, declare(update_fn, unreduced=True))


def _batch_size(leaves: list, idx: list, treedef) -> int:
    """The common leading batch axis of the per-example leaves.

    Raises:
        TypeError: a DTensor leaf. ValueError: a 0-dim leaf, or batch sizes that differ.
    """
    batch = None
    for i in idx:
        x = leaves[i]
        if isinstance(x, DTensor):
            raise TypeError(
                f"{_WHERE}: update leaf {_path(treedef, i)!r} is a DTensor; per-example "
                f"gradients are plain tensors on each replica (declare the replicas with "
                f"Mesh(..., data_axis=...))"
            )
        if x.ndim == 0 or (batch is not None and x.shape[0] != batch):
            raise ValueError(
                f"{_WHERE}: update leaf {_path(treedef, i)!r} has shape {tuple(x.shape)}; "
                f"per-example gradients need a leading batch axis of the same size on every leaf"
                + ("" if batch is None else f" (the first leaf's is {batch})")
            )
        batch = x.shape[0]
    return 1 if batch is None else int(batch)


def _path(treedef, i: int) -> str:
    return format_path(optree.treespec_paths(treedef)[i])


def _clipped_sums(gs: list, clip: float) -> list:
    """``sum_i g_i * min(1, clip / ||g_i||)`` per leaf (norms over every leaf of example
    ``i``, accumulated in float32 at least)."""
    if not gs:
        return []
    batch = gs[0].shape[0]
    sq = sum(
        g.reshape(batch, -1).to(torch.promote_types(g.dtype, torch.float32)).square().sum(1)
        for g in gs
    )
    norms = torch.sqrt(sq)
    factor = torch.clamp(clip / norms, max=1.0)  # (a zero example: inf, clamped to 1)
    out = []
    for g in gs:
        f = factor.to(torch.promote_types(g.dtype, torch.float32)).reshape(
            (batch,) + (1,) * (g.ndim - 1)
        )
        out.append((g * f).sum(0))
    return out


def _count(count: torch.Tensor) -> int:
    """The update count, read on the host (a CPU tensor; under vmap the same for every batch
    element, see :func:`~functional_train.autograd.host_value`)."""
    return int(host_value(count, f"{_WHERE}: DifferentiallyPrivateAggregateState.count"))


def _one_world():
    """A context outside ``LocalTensorMode`` (ranks simulated in one process run factory
    functions once per rank, which would draw each rank's noise further along the generator)."""
    try:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return maybe_disable_local_tensor_mode()


def _step_seed(seed: int, count: int) -> int:
    """The generator seed of update ``count``: the first 4 bytes (little-endian) of the
    BLAKE2b digest of ``"seed:count"`` (torch's CPU generator keeps 32 bits of a seed)."""
    digest = hashlib.blake2b(f"{seed}:{count}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _noise(sums: list, seed: int, count: int, std: float) -> list:
    """Per leaf, Gaussian noise of standard deviation ``std`` shaped like its sum (see
    :func:`differentially_private_aggregate`), outside any ``torch.func`` transform (a constant
    for it: the same for every batch element under vmap)."""
    gen = torch.Generator(device="cpu").manual_seed(_step_seed(seed, count))
    like = [(tuple(s.shape), s.dtype, s.device) for s in sums]
    out = []
    # (outside torch.func's and a simulated world's dispatch: one draw, then a constant for them)
    with torch._C._DisableFuncTorch(), _one_world():
        for shape, dt, device in like:
            dtype = torch.float64 if dt == torch.float64 else torch.float32
            z = torch.randn(shape, generator=gen, dtype=dtype) * std
            out.append(z.to(device))
    return out
