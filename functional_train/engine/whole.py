"""Whole leaves of sharded DTensors: the global tensor gathered onto every rank, and a rank's
block of a global tensor taken back (for transforms whose arithmetic needs a whole matrix: the
SVD of GaLore's projector refresh, Muon's Newton-Schulz orthogonalisation).

The gather is bucketed: leaves sharded over the same process groups, of one dtype, share one
buffer and ONE all-gather per sharding mesh dim (through :mod:`.collectives`). Rank-dependent
helpers run once per simulated rank under ``LocalTensorMode``.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Shard

from .collectives import all_gather
from .dtensor import Spec
from .layout import shard_region

__all__ = ["per_rank", "is_sharded", "local_part", "gather_global"]

try:  # run a rank-dependent function once per simulated rank (LocalTensorMode); else plain call
    from torch.distributed._local_tensor import maybe_run_for_local_tensor as per_rank
except ImportError:  # pragma: no cover - older torch: no simulation, plain calls

    def per_rank(fn):
        return fn


def is_sharded(spec: Spec | None, dim: int | None = None) -> bool:
    if spec is None:
        return False
    return any(
        isinstance(p, Shard) and (dim is None or p.dim % len(spec.shape) == dim)
        for p in spec.placements
    )


@per_rank
def _narrow_block(
    full: torch.Tensor, shape: tuple, placements: tuple, mesh_shape: tuple, coord: list
) -> torch.Tensor:
    starts, lens = shard_region(shape, placements, mesh_shape, coord)
    x = full
    for d, (st, ln) in enumerate(zip(starts, lens)):
        if ln != shape[d]:
            x = x.narrow(d, st, ln)
    return x


def local_part(full: torch.Tensor, mesh, placements: Sequence) -> torch.Tensor:
    """The block of the (replicated) global tensor ``full`` that this rank holds under
    ``placements`` on ``mesh`` (a view; no communication)."""
    if not any(isinstance(p, Shard) for p in placements):
        return full
    return _narrow_block(
        full,
        tuple(int(s) for s in full.shape),
        tuple(placements),
        tuple(int(s) for s in mesh.shape),
        list(mesh.get_coordinate()),
    )


@per_rank
def _padded_flat(x: torch.Tensor, n: int) -> torch.Tensor:
    flat = x.reshape(-1)
    if flat.numel() == n:
        return flat
    return torch.cat([flat, flat.new_zeros(n - flat.numel())])


def gather_global(b, idx: Sequence[int], values: dict | None = None) -> dict:
    """Global tensors of the sharded DTensor leaves ``idx`` of the prepared view ``b`` (the same
    on every rank): of their local shards ``b.locals[i]``, or of ``values[i]``, local tensors
    laid out like them.

    Each rank pads its flattened local shard to the largest shard's size; leaves sharded over
    the same process groups (and of one dtype) share one buffer, gathered by one all-gather per
    sharding mesh dim; every rank then assembles the global tensors from the blocks of all the
    members (whose regions are known from the placements alone).
    """
    loc = b.locals if values is None else values
    buckets: dict = defaultdict(list)
    for i in idx:
        s = b.specs[i]
        dims = tuple(j for j, p in enumerate(s.placements) if isinstance(p, Shard))
        key = (tuple(s.mesh.get_group(j) for j in dims), loc[i].dtype)
        buckets[key].append((i, dims))
    out = {}
    for items in buckets.values():
        s0 = b.specs[items[0][0]]
        dims0 = items[0][1]
        sizes = [s0.mesh.size(j) for j in dims0]
        flats, offsets, total = [], [], 0
        for i, _ in items:
            s = b.specs[i]
            _, lens = shard_region(s.shape, s.placements, s.mesh.shape, [0] * s.mesh.ndim)
            numel = math.prod(lens)
            flats.append(_padded_flat(loc[i], numel))
            offsets.append(total)
            total += numel
        buf = flats[0] if len(flats) == 1 else torch.cat(flats)
        for j in dims0:  # block index of member c: c[0] + sizes[0] * (c[1] + sizes[1] * ...)
            buf = all_gather(buf, (s0.mesh, j))
        for (i, dims), off in zip(items, offsets):
            s = b.specs[i]
            full = buf.new_empty(tuple(s.shape))
            for c in itertools.product(*(range(k) for k in sizes)):
                coord = [0] * s.mesh.ndim
                block, stride = 0, 1
                for j, cj, k in zip(dims, c, sizes):
                    coord[j] = cj
                    block += cj * stride
                    stride *= k
                starts, lens = shard_region(s.shape, s.placements, s.mesh.shape, coord)
                numel = math.prod(lens)
                if numel == 0:
                    continue
                start = block * total + off
                piece = buf[start : start + numel].view(lens)
                full[tuple(slice(a, a + n) for a, n in zip(starts, lens))] = piece
            out[i] = full
    return out
