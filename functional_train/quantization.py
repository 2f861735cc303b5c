"""Block-wise 8-bit quantisation of optimizer moments (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"; the bitsandbytes ``Adam8bit`` scheme), exact under sharding.

A moment tensor is stored as one ``uint8`` code per element plus one float32 ``absmax`` per
block; an element is ``code_map[code] * absmax`` of its block. The code map is the *dynamic*
8-bit map of bitsandbytes (:func:`create_dynamic_map`): signed for the first moment, unsigned for
the second. Quantising a block divides it by its absolute maximum (multiplying by the reciprocal,
as bitsandbytes does) and picks the nearest code (ties to the smaller code: the thresholds are the
float32 midpoints of neighbouring codes, the rule of bitsandbytes' reference PyTorch kernel and of
its CUDA kernel).

Blocks are defined over the GLOBAL tensor, along its last dim: a leaf of shape ``(..., n)`` has
``ceil(n / block_size)`` blocks per row (row-major; 1-D and 0-dim leaves are one row). Sharding of
the leading dims therefore keeps every block whole on one rank. When the last dim is sharded
(``Shard(-1)``, uneven or nested), a block can straddle ranks: every rank computes the partial
absmax of the blocks its shard touches, and ONE max all-reduce completes them for every such
leaf (each rank writes its partial maxima at their global offsets, see
:meth:`~functional_train.sharding.Prepared.leaf_sums`). The codes are then bitwise those of the
unsharded tensor. (bitsandbytes blocks the flattened tensor; for a last dim that is a multiple
of ``block_size``, and for 1-D leaves, the two blockings coincide.)

Public helpers for plain tensors: :func:`create_dynamic_map`, :func:`quantize_blockwise`,
:func:`dequantize_blockwise`. The optimizer state :class:`ScaleByAdam8bitState` is produced by
``scale_by_adam(..., optim_bits=8)`` (see :mod:`functional_train.transforms`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import foreach
from .engine.dtensor import Spec, spec_of, to_local, wrap, wrap_like
from .engine.view import Prepared
from .tree import (
    contiguous_stride,
    flatten_as,
    state_dtype,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)

__all__ = [
    "create_dynamic_map",
    "quantize_blockwise",
    "dequantize_blockwise",
    "ScaleByAdam8bitState",
]


# ---------------------------------------------------------------------------------------------
# the dynamic code map
# ---------------------------------------------------------------------------------------------
def create_dynamic_map(
    signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8
) -> torch.Tensor:
    """The dynamic quantisation map of bitsandbytes (Dettmers 2016, "8-Bit Approximations for
    Parallelism in Deep Learning"), as a sorted float32 tensor of 256 values in ``[-1, 1]``.

    Values are decades ``10^-(E-1) .. 10^0`` (``E = max_exponent_bits``) of linearly spaced
    fractions: decade ``e`` (counted from the smallest) holds the midpoints of
    ``linspace(0.1, 1, k + 1)`` scaled by ``10^(e - E + 1)``, with ``k = 2^(f + e)`` (signed) or
    ``2^(f + e + 1)`` (unsigned) and ``f = total_bits - 1 - E`` fraction bits at the smallest
    decade; the largest decade gets ``2^f - 1`` more such values; signed maps mirror them to
    negative values; ``0`` and ``1`` complete the map, which is padded with zeros to 256 entries.
    With the defaults: 256 distinct values, ``0`` at index 127 (signed) or 0 (unsigned).

    Equal, value for value, to ``bitsandbytes.functional.create_dynamic_map``.

    Raises:
        ValueError: a bit split that does not give ``2^total_bits`` values.
    """
    if not isinstance(signed, bool):
        raise TypeError(f"create_dynamic_map: signed must be a bool, got {type(signed).__name__}")
    for name, v in (("max_exponent_bits", max_exponent_bits), ("total_bits", total_bits)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"create_dynamic_map: {name} must be an int, got {type(v).__name__}")
    if not 1 <= max_exponent_bits < total_bits <= 8:
        raise ValueError(
            "create_dynamic_map: need 1 <= max_exponent_bits < total_bits <= 8, got "
            f"max_exponent_bits={max_exponent_bits}, total_bits={total_bits}"
        )
    frac_bits = total_bits - 1 - max_exponent_bits

    def decade(count: int, e: int) -> torch.Tensor:
        edges = torch.linspace(0.1, 1.0, count + 1, dtype=torch.float32)
        mids = (edges[1:] + edges[:-1]) / 2.0
        return mids * (10.0 ** (e - (max_exponent_bits - 1)))

    parts = [
        decade(2 ** (frac_bits + e + (0 if signed else 1)), e) for e in range(max_exponent_bits)
    ]
    if 2**frac_bits - 1 > 0:
        parts.append(decade(2**frac_bits - 1, max_exponent_bits - 1))
    positive = torch.cat(parts)
    values = [positive, -positive] if signed else [positive]
    values.append(torch.tensor([0.0, 1.0], dtype=torch.float32))
    out = torch.cat(values)
    if out.numel() != 2**total_bits:
        raise ValueError(
            f"create_dynamic_map: signed={signed}, max_exponent_bits="
            f"{max_exponent_bits}, total_bits={total_bits} gives {out.numel()} "
            f"values, not 2**total_bits = {2**total_bits}"
        )
    out = torch.cat([out, torch.zeros(256 - out.numel(), dtype=torch.float32)])
    return torch.sort(out).values


class _Maps:
    """The signed / unsigned default maps and their rounding thresholds, per device (built
    once, outside any tensor mode, so the cached tensors are plain tensors)."""

    def __init__(self):
        self._cpu = {}
        self._dev: dict = {}
        for signed in (True, False):
            code = create_dynamic_map(signed)
            self._cpu[signed] = (
                code,
                (code[:-1] + code[1:]) / 2.0,
                int(torch.nonzero(code == 0)[0, 0]),
            )

    def get(self, signed: bool, device: torch.device):
        """``(code map, midpoints, index of 0)`` on ``device``."""
        code, mid, zero = self._cpu[signed]
        if device.type == "cpu":
            return code, mid, zero
        key = (signed, device)
        hit = self._dev.get(key)
        if hit is None:
            hit = (code.to(device), mid.to(device), zero)
            self._dev[key] = hit
        return hit


_MAPS = _Maps()


_KERNEL_MAPS: dict = {}


def kernel_maps(device: torch.device) -> tuple:
    """What the compiled 8-bit Adam kernel (:func:`functional_train.engine.kernels.adam8bit`)
    takes, on ``device``: ``(signed map, unsigned map, signed table, unsigned table, signed
    midpoints + inf, unsigned midpoints + inf)``, the tables :class:`_NearestCode`'s with runs
    of ``2**16`` keys (65,536 entries, which fit a core's L2: each run still holds at most one
    midpoint, checked when built)."""
    hit = _KERNEL_MAPS.get(device)
    if hit is None:
        out = {}
        for signed in (True, False):
            code, mid, _ = _MAPS.get(signed, torch.device("cpu"))
            near = _NearestCode(mid, shift=16)
            out[signed] = (code, near.table, near.mid_inf)
        hit = _KERNEL_MAPS[device] = tuple(
            out[sg][k].to(device) for k in range(3) for sg in (True, False)
        )
    return hit


# ---------------------------------------------------------------------------------------------
# plain-tensor helpers
# ---------------------------------------------------------------------------------------------
def _n_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor as one row of one element (``(1,)``); other tensors unchanged (blocks run
    along the last dim, whatever the leading dims)."""
    return x.reshape(1) if x.ndim == 0 else x


def _from_rows(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """Inverse of :func:`_as_rows` for a leaf of ``ndim`` dims."""
    return x.reshape(()) if ndim == 0 else x


def absmax_shape(shape: Sequence[int], block_size: int) -> tuple:
    """Global shape of the absmax of a leaf of ``shape``: ``(*shape[:-1], nblocks)``; ``(1,)``
    for a 0-dim leaf."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return (1,)
    return shape[:-1] + (_n_blocks(shape[-1], block_size),)


def _check_block_size(block_size: Any, where: str) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{where}: block_size must be an int, got {type(block_size).__name__}")
    if block_size <= 0:
        raise ValueError(f"{where}: block_size must be > 0, got {block_size}")
    return block_size


def _code_arg(code: torch.Tensor | None, signed: bool, device: torch.device, where: str):
    """(code map, midpoints) for ``code`` or the default map."""
    if code is None:
        c, mid, _ = _MAPS.get(signed, device)
        return c, mid
    if not isinstance(code, torch.Tensor) or code.ndim != 1 or code.numel() != 256:
        raise ValueError(f"{where}: code must be a 1-D tensor of 256 sorted values")
    code = code.to(device=device, dtype=torch.float32)
    return code, (code[:-1] + code[1:]) / 2.0


def _codes_of(scaled: torch.Tensor, mid: torch.Tensor) -> torch.Tensor:
    """Nearest code of ``scaled`` clamped to ``[-1, 1]``: the number of midpoints strictly
    below (ties go to the smaller code). For the default maps on CPU through a lookup table
    (:class:`_NearestCode`, the same codes as ``torch.bucketize``, about 3x faster) and without
    the clamp: their midpoints lie strictly inside ``(-1, 1)``, so a value past +-1 (the
    reciprocal's rounding) already has the code of +-1, and NaN stays NaN either way.
    Otherwise clamped (in place), then ``torch.bucketize``."""
    if (
        type(scaled) is torch.Tensor
        and scaled.dtype == torch.float32
        and scaled.is_cpu
        and not torch.compiler.is_compiling()
    ):
        table = _nearest_table(mid)
        if table is not None:
            return table(scaled)
    scaled = scaled.clamp_(-1.0, 1.0)
    return torch.bucketize(scaled, mid, out_int32=True).to(torch.uint8)


def _lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` for a 1-D ``table`` and int32 / int64 ``idx`` of any shape, through
    ``index_select`` (on CPU about 3x (int64) to 10x (int32) faster than advanced indexing)."""
    return torch.index_select(table, 0, idx.reshape(-1)).view(idx.shape)


class _NearestCode:
    """``torch.bucketize(x, mid)`` for float32 ``x`` by table lookup.

    A float32's bits, with the lower 31 flipped for negative values, are an int32 in the
    order of the floats. The table holds, for every run of ``2**SHIFT`` consecutive such keys
    (2**20 runs, 4 MiB of int32), the number of midpoints below the run's first key; a run
    holds at most one midpoint (checked when built: the dynamic maps' midpoints are at least
    1.5% apart, a run spans 2**-11 relative), so the code is that count, plus one when ``x``
    is above the next midpoint. Five integer passes and two gathers per element against
    ``bucketize``'s eight-step binary search."""

    SHIFT = 12

    def __init__(self, mid: torch.Tensor, shift: int = SHIFT):
        self.shift = shift
        self.mid_inf = torch.cat([mid, mid.new_full((1,), float("inf"))])
        keys = self.key(mid.contiguous()).to(torch.int64)
        n = 1 << (32 - shift)
        starts = (torch.arange(n, dtype=torch.int64) - n // 2) << shift
        lo = torch.searchsorted(keys, starts)
        hi = torch.searchsorted(keys, starts + (1 << shift))
        if int((hi - lo).max()) > 1:
            raise ValueError("two midpoints in one run of the table")
        if not (float(mid.min()) > -1.0 and float(mid.max()) < 1.0):  # _codes_of's clamp
            raise ValueError("a midpoint at -1 or 1: the table would need the clamp")
        self.table = lo.to(torch.int32)

    @staticmethod
    def key(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(torch.int32)
        return (bits >> 31).bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        run = self.key(x).bitwise_right_shift_(self.shift).add_(1 << (31 - self.shift))
        below = _lookup(self.table, run)
        return below.add_(x > _lookup(self.mid_inf, below)).to(torch.uint8)


_NEAREST: dict = {
    id(_MAPS.get(signed, torch.device("cpu"))[1]): None for signed in (True, False)
}  # the default maps' CPU midpoints -> table


def _nearest_table(mid: torch.Tensor) -> _NearestCode | None:
    """The lookup table of ``mid`` if it is a default map's CPU midpoints (the cached tensors,
    alive as long as the module: their ids are never reused), built on first use."""
    key = id(mid)
    if key not in _NEAREST:
        return None
    table = _NEAREST[key]
    if table is None:
        table = _NEAREST[key] = _NearestCode(mid)
    return table


def quantize_blockwise(
    x: torch.Tensor,
    code: torch.Tensor | None = None,
    block_size: int = 256,
    *,
    signed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a plain tensor block-wise along its last dim.

    Args:
        x: float tensor of shape ``(..., n)`` (0-dim and 1-D tensors are one row).
        code: a sorted map of 256 float32 values in ``[-1, 1]``; default the dynamic map
            (:func:`create_dynamic_map`) with ``signed``.
        block_size: elements per block along the last dim (the last block of a row may be
            shorter).

    Returns:
        ``(codes, absmax)``: ``codes`` uint8 of the shape of ``x``, ``absmax`` float32 of shape
        ``(*x.shape[:-1], ceil(n / block_size))`` (``(1,)`` for 0-dim ``x``), the absolute
        maximum of each block. ``x ~= code[codes] * absmax`` of its block; each element gets the
        code nearest to ``x / absmax``.

    For 1-D ``x`` whose length is a multiple of ``block_size`` this is bitwise bitsandbytes'
    reference (PyTorch) ``quantize_blockwise`` kernel.

    Raises:
        ValueError: ``block_size <= 0``, a malformed ``code``.
    """
    block_size = _check_block_size(block_size, "quantize_blockwise")
    if isinstance(x, DTensor):
        raise TypeError(
            "quantize_blockwise: plain tensors only (scale_by_adam(optim_bits=8) "
            "quantises DTensor moments exactly)"
        )
    code, mid = _code_arg(code, signed, x.device, "quantize_blockwise")
    rows = _as_rows(x.to(torch.float32))
    lay = _Layout.of(rows, rows, block_size)
    absmax = lay.partial_absmax(rows.abs())
    return _from_rows(_quantize_many([rows], [absmax], [mid], [lay])[0], x.ndim), absmax


def dequantize_blockwise(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor | None = None,
    block_size: int = 256,
    *,
    signed: bool = True,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``code[codes] * absmax`` of each element's block,
    float32, shaped like ``codes``.

    Raises:
        ValueError: ``absmax`` does not have the shape :func:`quantize_blockwise` gives.
    """
    block_size = _check_block_size(block_size, "dequantize_blockwise")
    want = absmax_shape(codes.shape, block_size)
    if tuple(absmax.shape) != want:
        raise ValueError(
            f"dequantize_blockwise: absmax has shape {tuple(absmax.shape)}, expected "
            f"{want} for codes of shape {tuple(codes.shape)} and block_size "
            f"{block_size}"
        )
    code, _ = _code_arg(code, signed, codes.device, "dequantize_blockwise")
    rows = _as_rows(codes)
    lay = _Layout.of(rows, rows, block_size)
    out = _dequantize_many([rows], [absmax.to(torch.float32)], [code], [lay])[0]
    return _from_rows(out, codes.ndim)


# ---------------------------------------------------------------------------------------------
# the local view of one quantised leaf
# ---------------------------------------------------------------------------------------------
class _Layout:
    """Which global block each local element of a leaf belongs to.

    A leaf of global shape ``(..., n)`` has ``nb = ceil(n / B)`` blocks per row. Its local
    shard ``(..., L)`` holds global columns ``[off, off + L)`` of each of its rows (``off = 0``,
    ``L = n`` unless the last dim is sharded): it touches the ``k`` global blocks
    ``[b0, b0 + k)`` and, left-padded with ``lead`` and right-padded with ``right`` zeros, is
    ``(..., k, B)``; ``idx[j] = (off + j) // B`` is the global block of local column ``j``.
    On the fast path (last dim whole, ``n`` a multiple of ``B``) blocks are views and ``idx`` is
    ``None``. ``off``, ``L`` and what derives from them are ints (per-rank symbolic ints in the
    one-process simulation); ``sharded`` is static.
    """

    __slots__ = ("B", "nb", "sharded", "idx", "lead", "right", "k", "b0")

    def __init__(self, B, nb, sharded, idx, lead, right, k, b0):
        self.B, self.nb, self.sharded, self.idx = B, nb, sharded, idx
        self.lead, self.right, self.k, self.b0 = lead, right, k, b0

    @classmethod
    def of(cls, u: Any, local: torch.Tensor, B: int) -> _Layout:
        """The layout of ``local``, the local shard (or, for a 0-dim leaf, the one-element row)
        of update leaf ``u``."""
        shape = tuple(u.shape)
        n = int(shape[-1]) if shape else 1
        nb = _n_blocks(n, B)
        if not (isinstance(u, DTensor) and _last_dim_sharded(u)):
            if n % B == 0:
                return cls(B, nb, False, None, 0, 0, nb, 0)
            idx = torch.div(torch.arange(n, device=local.device), B, rounding_mode="floor")
            return cls(B, nb, False, idx, 0, nb * B - n, nb, 0)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(u.shape, u.device_mesh, u.placements)
        off, L = offset[-1], local.shape[-1]
        idx = torch.div(torch.arange(L, device=local.device) + off, B, rounding_mode="floor")
        lead = off % B
        k = (lead + L + (B - 1)) // B
        return cls(B, nb, True, idx, lead, k * B - lead - L, k, off // B)

    def expand(self, block_values: torch.Tensor) -> torch.Tensor:
        """``(..., L)``: the value in ``block_values`` (``(..., nb)``, global blocks) of each
        local element's block."""
        if self.idx is None:
            return block_values.repeat_interleave(self.B, dim=-1)
        return block_values.index_select(-1, self.idx)

    def mul(self, x: torch.Tensor, block_values: torch.Tensor, out: bool = False) -> torch.Tensor:
        """``x * expand(block_values)`` (``x`` of shape ``(..., L)``), in place into ``x``
        unless ``out``; on the fast path by broadcasting over the blocks' views, without the
        expanded tensor."""
        if self.idx is None:
            xb = x.unflatten(-1, (self.nb, self.B))
            vb = block_values.unsqueeze(-1)
            return (xb * vb if out else xb.mul_(vb)).view(x.shape)
        return x * self.expand(block_values) if out else x.mul_(self.expand(block_values))

    def partial_absmax(self, absx: torch.Tensor) -> torch.Tensor:
        """``(..., nb)``: the maximum of ``absx`` (``(..., L)``, non-negative) over the local
        part of every global block, 0 for blocks the shard does not touch (complete it with a
        max over the shards of the last dim)."""
        if self.idx is not None:
            absx = F.pad(absx, (self.lead, self.right))
        part = absx.unflatten(-1, (self.k, self.B)).amax(-1)
        if self.sharded:
            part = F.pad(part, (self.b0, self.nb - self.b0 - self.k))
        return part


def _dequantize_many(
    codes: Sequence[torch.Tensor],
    absmax: Sequence[torch.Tensor],
    maps: Sequence[torch.Tensor],
    layouts: Sequence[_Layout],
) -> list:
    """float32 values ``map[codes] * absmax`` of each element's block, for lists of leaves."""
    if not codes:
        return []
    return [lay.mul(_lookup(m, c.int()), a) for m, c, a, lay in zip(maps, codes, absmax, layouts)]


def _quantize_many(
    vals: Sequence[torch.Tensor],
    absmax: Sequence[torch.Tensor],
    mids: Sequence[torch.Tensor],
    layouts: Sequence[_Layout],
) -> list:
    """uint8 codes of float32 ``vals`` (``(..., L)``) against their global block maxima
    ``absmax`` (``(..., nb)``), as bitsandbytes does it: ``x * (1 / max(absmax, 1e-38))``
    clamped to ``[-1, 1]`` (an all-zero block gives zeros), then the nearest code."""
    if not vals:
        return []
    inv = foreach.reciprocal(foreach.clamp_min(list(absmax), 1e-38))
    return [
        _codes_of(lay.mul(x, v, out=True), mid) for x, v, mid, lay in zip(vals, inv, mids, layouts)
    ]


def _last_dim_sharded(x: DTensor) -> bool:
    nd = x.ndim
    return nd > 0 and any(isinstance(p, Shard) and p.dim % nd == nd - 1 for p in x.placements)


# ---------------------------------------------------------------------------------------------
# the 8-bit Adam state
# ---------------------------------------------------------------------------------------------
class ScaleByAdam8bitState(NamedTuple):
    """State of ``scale_by_adam(..., optim_bits=8)``.

    Every field but ``count`` is a tree with the structure of the params (one entry per leaf,
    ``None`` where the leaf has no such entry, frozen ``None`` params included):

    * ``count``: number of previous updates (int64, 0-dim).
    * ``mu``, ``nu``: float moments (float32 by default, ``mu_dtype`` / ``nu_dtype``), shaped
      and placed like the parameter, for leaves kept in full precision (global numel below
      ``min_8bit_size``, or not floating point); ``None`` for quantised leaves.
    * ``mu_codes``, ``nu_codes``: for quantised leaves, uint8 codes shaped and placed like the
      parameter (signed dynamic map for ``mu``, unsigned for ``nu``); ``None`` otherwise.
    * ``mu_absmax``, ``nu_absmax``: for quantised leaves, float32 absolute maxima of the blocks,
      of global shape ``(*shape[:-1], ceil(shape[-1] / block_size))`` (``(1,)`` for 0-dim
      leaves); for DTensor leaves placed like the parameter on the leading dims, ``Replicate``
      where the parameter shards its last dim (each rank keeps every block its rows have).
      ``None`` otherwise.

    A moment element is ``map[codes] * absmax`` of its block.
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    mu_codes: Any
    mu_absmax: Any
    nu_codes: Any
    nu_absmax: Any


def is_quantized(x: Any, min_8bit_size: int) -> bool:
    """Whether a params leaf gets 8-bit moments: a non-empty floating tensor whose GLOBAL numel
    is at least ``min_8bit_size``."""
    return (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.numel() > 0
        and x.numel() >= min_8bit_size
    )


def _absmax_spec(s: Spec, block_size: int, where: str) -> Spec:
    """The spec of the absmax of a DTensor of spec ``s``: leading-dim placements kept, a
    ``Shard`` of the last dim replaced by ``Replicate``."""
    nd = len(s.shape)
    placements = []
    for p in s.placements:
        if isinstance(p, Partial):
            raise ValueError(
                f"{where} is Partial; optimizer states need parameters in "
                "Shard/Replicate placements"
            )
        if isinstance(p, Shard) and (nd == 0 or p.dim % nd == nd - 1):
            placements.append(Replicate())
        else:
            placements.append(p)
    shape = absmax_shape(s.shape, block_size)
    return Spec(s.mesh, tuple(placements), torch.Size(shape), contiguous_stride(shape))


def _zero_codes(x: Any, zero: int) -> Any:
    """uint8 codes of zeros shaped and placed like ``x``."""
    local = torch.full_like(to_local(x), zero, dtype=torch.uint8)
    return wrap_like(local, x)


def _zero_absmax(x: Any, block_size: int, path: str) -> Any:
    """Zero absmax of leaf ``x`` (see :class:`ScaleByAdam8bitState`), built from the local shard
    (no communication)."""
    local = to_local(x)
    nb = absmax_shape(x.shape, block_size)[-1]
    shape = (*local.shape[:-1], nb) if local.ndim else (1,)
    z = local.new_zeros(shape, dtype=torch.float32)
    if isinstance(x, DTensor):
        return wrap(z, _absmax_spec(spec_of(x), block_size, f"parameter '{path}'"))
    return z


def init_8bit(
    params: Any,
    count: torch.Tensor,
    block_size: int,
    min_8bit_size: int,
    mu_dtype: torch.dtype | None,
    nu_dtype: torch.dtype | None,
) -> ScaleByAdam8bitState:
    """The initial :class:`ScaleByAdam8bitState` (zero moments) of ``params``."""
    leaves, treedef = tree_flatten(params)
    paths = tree_paths(params)
    quant = [is_quantized(x, min_8bit_size) for x in leaves]

    def tree(fn):
        return tree_unflatten(
            treedef, [fn(x, p) if q else None for x, p, q in zip(leaves, paths, quant)]
        )

    def full(dtype):
        return tree_unflatten(
            treedef,
            [
                None if x is None or q else torch.zeros_like(x, dtype=state_dtype(x.dtype, dtype))
                for x, q in zip(leaves, quant)
            ],
        )

    zero_mu = _MAPS.get(True, torch.device("cpu"))[2]
    zero_nu = _MAPS.get(False, torch.device("cpu"))[2]
    for x, q in zip(leaves, quant):  # the maps on the devices of the params, outside any update
        if q:
            _MAPS.get(True, to_local(x).device)
            _MAPS.get(False, to_local(x).device)
    if any(quant):  # the CPU lookup tables too (their one-time checks read the host)
        for signed in (True, False):
            _nearest_table(_MAPS.get(signed, torch.device("cpu"))[1])
    return ScaleByAdam8bitState(
        count,
        full(mu_dtype),
        full(nu_dtype),
        tree(lambda x, p: _zero_codes(x, zero_mu)),
        tree(lambda x, p: _zero_absmax(x, block_size, p)),
        tree(lambda x, p: _zero_codes(x, zero_nu)),
        tree(lambda x, p: _zero_absmax(x, block_size, p)),
    )


class Dequantized:
    """What :func:`dequantize_state` read and :func:`quantize_state` needs: the positions (in
    ``Prepared.active``) of the quantised leaves, their layouts, and the flattened code / absmax
    fields of the old state."""

    __slots__ = ("qpos", "layouts", "fields")

    def __init__(self, qpos, layouts, fields):
        self.qpos, self.layouts, self.fields = qpos, layouts, fields


ADAM8BIT_STATE = "ScaleByAdam8bitState"
QUANTIZED_FIELDS = (("mu_codes", "mu_absmax", True), ("nu_codes", "nu_absmax", False))


def dequantize_state(
    b: Prepared, state: ScaleByAdam8bitState, block_size: int, min_8bit_size: int
) -> tuple[list, list, Dequantized]:
    """The moments of the active leaves as local float tensors: the float state of
    full-precision leaves, the float32 dequantised values of quantised ones (no communication).

    Raises:
        ValueError: a state entry that does not fit its leaf (float / 8-bit kind for the leaf's
            size, shape, dtype), naming the leaf path.
    """
    mu_all = b.state_locals(state.mu, f"{ADAM8BIT_STATE}.mu")
    nu_all = b.state_locals(state.nu, f"{ADAM8BIT_STATE}.nu")
    fields = {
        f: flatten_as(getattr(state, f), b.treedef, f"{ADAM8BIT_STATE}.{f}", "the updates")
        for c, a, _ in QUANTIZED_FIELDS
        for f in (c, a)
    }
    mu, nu, qpos, layouts = [], [], [], []
    for pos, i in enumerate(b.active):
        u = b.updates[i]
        quant = is_quantized(u, min_8bit_size)
        has_q = [fields[f][i] is not None for f in fields]
        has_f = [mu_all[i] is not None, nu_all[i] is not None]
        if not (all(has_q) and not any(has_f) if quant else all(has_f) and not any(has_q)):
            raise ValueError(
                f"{ADAM8BIT_STATE}: leaf '{b.paths[i]}' (shape {tuple(u.shape)}) needs "
                f"{'8-bit' if quant else 'float'} moments (min_8bit_size={min_8bit_size}), but "
                "its state entries do not hold them; was the state built by scale_by_adam.init "
                "with the same optim_bits and min_8bit_size?"
            )
        if not quant:
            mu.append(mu_all[i])
            nu.append(nu_all[i])
            continue
        want_abs = absmax_shape(u.shape, block_size)
        for f in fields:
            x = fields[f][i]
            is_abs = f.endswith("absmax")
            want, dt = (want_abs, torch.float32) if is_abs else (tuple(u.shape), torch.uint8)
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want or x.dtype != dt:
                got = (
                    f"shape {tuple(x.shape)} and dtype {x.dtype}"
                    if isinstance(x, torch.Tensor)
                    else f"a {type(x).__name__}"
                )
                raise ValueError(
                    f"{ADAM8BIT_STATE}.{f}: leaf '{b.paths[i]}' has {got}, expected shape "
                    f"{want} and dtype {dt} for a parameter of shape "
                    f"{tuple(u.shape)} and block_size {block_size}"
                )
        local = b.locals[i]
        layouts.append(_Layout.of(u, _as_rows(local), block_size))
        qpos.append(pos)
        mu.append(None)
        nu.append(None)
    # dequantise every quantised moment (mu and nu of each leaf) in one batch
    items = [
        (pos, b.active[pos], lay, f, out)
        for pos, lay in zip(qpos, layouts)
        for f, out in zip(QUANTIZED_FIELDS, (mu, nu))
    ]
    vals = _dequantize_many(
        [_as_rows(to_local(fields[f[0]][i])) for _, i, _, f, _ in items],
        [to_local(fields[f[1]][i]) for _, i, _, f, _ in items],
        [_MAPS.get(f[2], b.locals[i].device)[0] for _, i, _, f, _ in items],
        [lay for _, _, lay, _, _ in items],
    )
    for (pos, i, _, _, out), v in zip(items, vals):
        out[pos] = _from_rows(v, b.locals[i].ndim)
    return mu, nu, Dequantized(qpos, layouts, fields)


def quantize_state(
    b: Prepared,
    state: ScaleByAdam8bitState,
    count: torch.Tensor,
    mu: list,
    nu: list,
    deq: Dequantized,
) -> ScaleByAdam8bitState:
    """The new state from the updated float moments ``mu``, ``nu`` of the active leaves (local
    shards): full-precision leaves keep them; quantised leaves are requantised with the new
    absmax of each global block.

    Communication: the partial block maxima of every quantised leaf whose last dim is sharded
    (``mu`` and ``nu``) are completed by ONE :meth:`Prepared.leaf_sums` call (``op="max"``
    over the last dim): ONE all-reduce; none when no quantised leaf has its last dim sharded.
    """
    act = b.active
    qset = set(deq.qpos)
    mu_new = b.state_tree(
        state.mu, f"{ADAM8BIT_STATE}.mu", [None if p in qset else m for p, m in enumerate(mu)]
    )
    nu_new = b.state_tree(
        state.nu, f"{ADAM8BIT_STATE}.nu", [None if p in qset else v for p, v in enumerate(nu)]
    )
    # 1. local block maxima of every quantised moment (mu and nu of each leaf)
    items = [
        (act[pos], lay, fs, v)
        for pos, lay in zip(deq.qpos, deq.layouts)
        for fs, v in zip(QUANTIZED_FIELDS, (mu[pos], nu[pos]))
    ]
    vals = [
        _as_rows(v if v.dtype == torch.float32 else v.to(torch.float32)) for _, _, _, v in items
    ]
    absx = foreach.abs(vals) if vals else []
    absmax = [lay.partial_absmax(a) for (_, lay, _, _), a in zip(items, absx)]
    # 2. complete the maxima of blocks that straddle shards: one all-reduce for all leaves
    sharded = [n for n, (_, lay, _, _) in enumerate(items) if lay.sharded]
    if sharded:
        done = b.leaf_sums([(items[n][0], absmax[n], (-1,)) for n in sharded], op="max")
        for n, full in zip(sharded, done):
            absmax[n] = full
    # 3. requantise against the completed maxima
    codes = _quantize_many(
        vals,
        absmax,
        [_MAPS.get(fs[2], v.device)[1] for (_, _, fs, _), v in zip(items, vals)],
        [lay for _, lay, _, _ in items],
    )
    out = {f: list(v) for f, v in deq.fields.items()}
    for (i, _, (codes_f, abs_f, _), _), c, a in zip(items, codes, absmax):
        old_codes, old_abs = deq.fields[codes_f][i], deq.fields[abs_f][i]
        out[codes_f][i] = wrap_like(_from_rows(c, old_codes.ndim), old_codes)
        out[abs_f][i] = wrap_like(a, old_abs)
    trees = {f: tree_unflatten(b.treedef, v) for f, v in out.items()}
    return ScaleByAdam8bitState(
        count,
        mu_new,
        nu_new,
        trees["mu_codes"],
        trees["mu_absmax"],
        trees["nu_codes"],
        trees["nu_absmax"],
    )


# ---------------------------------------------------------------------------------------------
# ft.step of 8-bit Adam / AdamW: the quantised leaves through one compiled kernel each
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FusedAdam8bit:
    """What ``adam`` / ``adamw`` with ``optim_bits=8`` compute, for ``ft.step``'s compiled
    path (the ``fused`` of the alias's chain's spec; see
    :func:`functional_train.per_leaf.fused_adam8bit_step`)."""

    decoupled: bool
    learning_rate: Any
    b1: float
    b2: float
    eps: float
    weight_decay: float
    maximize: bool
    adam_index: int
    lr_index: int
    mask: Any  # params -> [bool per leaf]: the leaves decayed (None: all)
    block_size: int
    min_8bit_size: int
