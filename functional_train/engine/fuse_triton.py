"""Fused elementwise passes on CUDA: one generated Triton kernel per stage.

The CUDA counterpart of :mod:`.fuse`'s C kernels. The stage (a per-leaf function of plain
tensor operations, see :mod:`.fuse`) is traced once per signature into ATen operations, as
for the C kernels (:func:`.fuse.trace`); each operation becomes one line of a
Triton kernel (the lowering is :class:`.fuse.Lowering`'s, shared with the C writer; this module
supplies the Triton dialect), which :func:`triton.jit` compiles for the GPU at its first launch
(Triton caches the binary in ``~/.triton``; the generated source is written to
``$FT_CACHE_DIR/triton``).

One launch runs every leaf of the lists, reading each input once and writing each result once,
in the manner of torch's multi-tensor-apply kernels (``torch._fused_adamw_``): each program
instance takes one block of ``BLOCK`` elements of one leaf, found through a table of (leaf,
first element) pairs, and the leaf's tensors through a table of addresses. The address table
and the host scalars (Python numbers, 0-dim CPU tensors: values, not addresses) travel in one
``int64`` tensor (a few kB), kept on the device per content (a donated step's is copied once)
and otherwise copied through pinned memory, asynchronously; the block table is cached per set
of leaf sizes. A 0-dim tensor on the leaves' device (a clip factor, a bias correction, a
scheduled learning rate) is an argument of the kernel, a pointer it reads, so a stage's
scalars never synchronise the host, and the table does not change when they are new
tensors at each step (as they are: in the table, their addresses made every donated step
copy a new one). No collectives (a stage is local; the engine issues a step's).

A stage whose per-leaf values are vectors broadcast against their leaves (the factored second
moment's value per row, ``(..., n, 1)``, and per column, ``(..., 1, m)``) is written
``indexed``: each leaf's row of the table also holds, per per-leaf input, a triple ``(a, b,
c)``, and element ``offs`` of the leaf reads that input at ``(offs // a) * b + offs % c`` (a
value per row ``(m, 1, 1)``, per column ``(n * m, m, m)``, leaf-shaped ``(1, 1, 1)``, one
value ``(numel + 1, 0, 1)``): still one launch for every leaf (:meth:`TritonKernel.by_rows`).

Arithmetic follows ATen's CUDA kernels: half-precision leaves are computed in float32 and
rounded once where stored (ATen's ``opmath``); float32 division and square root are IEEE's
correctly rounded ones (``div_rn``, ``sqrt_rn``; Triton's defaults are approximations);
``add`` with ``alpha``, ``addcmul`` and ``lerp`` are fused multiply-adds, as ATen writes them.
ATen's CUDA kernels are compiled with contraction on (``nvcc``'s default ``-fmad=true``), so an
unfused ``a * b + c`` of theirs may round once where this kernel rounds twice: the results
equal the stage run by torch to float rounding (``tests/test_fused.py`` states the tolerance).
Selects (``torch.where``, NaN-propagating ``maximum`` / ``minimum``) are exact.

Used when Triton is importable and the leaves are plain contiguous CUDA tensors of float32,
float64, bfloat16 or float16 on one device; anything else (an operation the writer does not
write, another device) runs leaf by leaf in torch, as does a kernel Triton cannot compile
(with a warning). ``FT_FUSED_KERNELS=0`` turns these kernels off as it does the C ones. A call
whose result buffers are not all on the leaves' device raises ``RuntimeError`` (an engine bug
otherwise: the kernel would write through another device's addresses).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import importlib.util
import os
import struct
import sys
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..leaves import on_device
from . import native
from .fuse import BINARY, Lowering, Unsupported, compute_dtype, trace
from .pool import all_in_one_order

__all__ = [
    "available",
    "Scalars",
    "TritonKernel",
    "scalar_slots",
    "source_of",
    "sum_squares",
    "BLOCK",
]

# elements per program instance (``FT_TRITON_BLOCK``: a power of two, for measuring)
BLOCK = int(os.environ.get("FT_TRITON_BLOCK", "1024"))
_NUM_WARPS = 4

# the dtypes a leaf or scalar may have, as Triton names them
_TL = {
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.bfloat16: "tl.bfloat16",
    torch.float16: "tl.float16",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
    torch.bool: "tl.int1",
}
_LEAF_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

_triton = None  # (triton, triton.language) once imported; False when not importable


def available(device: torch.device) -> bool:
    """Whether stages on ``device`` can run as generated Triton kernels: a CUDA device and an
    importable Triton."""
    global _triton
    if device.type != "cuda":
        return False
    if _triton is None:
        try:
            import triton
            import triton.language as tl

            _triton = (triton, tl)
        except Exception:  # (not installed, or no working backend)
            _triton = False
    return _triton is not False


# C's operators but for NaN-propagating maximum / minimum and logical operators on int1
# (division: ``_Writer.binary``)
_BINARY = {
    **BINARY,
    "maximum": "tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": "tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    "logical_and": "({a} & {b})",
    "logical_or": "({a} | {b})",
}


class _Writer(Lowering):
    """Triton source of one stage from its traced graph (the operations :mod:`.fuse`'s C
    writer lowers, with ATen's CUDA arithmetic)."""

    TYPES = _TL

    def __init__(
        self,
        graph: torch.fx.Graph,
        n_inputs: int,
        scalar_kinds,
        n_per_leaf: int,
        indexed: bool = False,
    ):
        super().__init__(graph, n_inputs, n_per_leaf, (indexed,) * n_per_leaf if indexed else ())
        # (every per-leaf input read per element through its leaf's index triple: by_rows)
        self.indexed = indexed
        self.scalar_kinds = scalar_kinds  # per scalar: (dtype, read through an address)
        self.lines: list = []  # (every value a line: Triton computes them per program)
        self.consts: list = []  # the literals, as module-level constexprs

    def literal(self, v, dtype) -> str:
        name = f"_C{len(self.consts)}"
        if dtype == torch.bool:
            v = bool(v)
        elif dtype in (torch.int64, torch.int32):
            v = int(v)
        else:
            v = float(v)
        self.consts.append(f"{name} = tl.constexpr({v!r})")
        if isinstance(v, float) and v != v:
            self.consts[-1] = f"{name} = tl.constexpr(float('nan'))"
        elif isinstance(v, float) and v in (float("inf"), float("-inf")):
            self.consts[-1] = f"{name} = tl.constexpr(float('{'inf' if v > 0 else '-inf'}'))"
        return f"tl.full([], {name}, {_TL[dtype]})"

    def write(self, name: str, expr: str, dtype, vec: bool) -> None:
        self.lines.append(f"{name} = {expr}")

    def cast(self, name: str, dtype) -> str:
        return f"{name}.to({_TL[dtype]})"

    def n_lines(self) -> int:
        return len(self.lines)

    # the Triton dialect of :class:`.fuse.Lowering`
    def fma(self, a: str, b: str, c: str) -> str:
        return f"tl.fma({a}, {b}, {c})"

    def binary(self, op: str, a: str, b: str, dtype) -> str:
        if op == "div":  # (Triton's float32 division is an approximation)
            return f"tl.div_rn({a}, {b})" if dtype == torch.float32 else f"({a} / {b})"
        return _BINARY[op].format(a=a, b=b)

    def sqrt(self, a: str, dtype) -> str:
        return f"tl.sqrt_rn({a})" if dtype == torch.float32 else f"tl.sqrt({a})"

    def unary(self, op: str, a: str, dtype) -> str:
        if op == "sqrt":
            return self.sqrt(a, dtype)
        if op == "rsqrt":
            return self.binary("div", self.one(dtype), self.sqrt(a, dtype), dtype)
        if op == "reciprocal":
            return self.binary("div", self.one(dtype), a, dtype)
        if op == "sign":
            t = _TL[dtype]
            return f"(({a} > 0).to({t}) - ({a} < 0).to({t}))"
        return {
            "neg": f"(-{a})",
            "abs": f"tl.abs({a})",
            "logical_not": f"({a} == 0)",
            "bitwise_not": f"({a} == 0)",
            "isnan": f"({a} != {a})",
            "isfinite": f"(({a} - {a}) == ({a} - {a}))",
        }[op]

    def one(self, dtype) -> str:
        return self.literal(1, dtype)

    def to_half(self, x: str, dtype) -> str:
        return f"{x}.to({_TL[dtype]}).to(tl.float32)"

    def pow_scalar(self, a: str, b: str, dtype) -> str:
        return f"libdevice.pow({a}, {b})"

    def where(self, cond_arg, c: str, a: str, b: str, dtype, vec: bool) -> str:
        return f"tl.where({c}, {a}, {b})"

    def lerp_pick(self, small: str, w: str, dtype) -> str:
        return f"tl.where({small}, {w}, {w} - {self.one(dtype)})"

    def source(self, fn_name: str) -> tuple[str, list]:
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        n_sc = len(self.scalar_kinds)
        if len(placeholders) != self.n_inputs + n_sc:
            raise Unsupported("unexpected placeholders")
        first_per_leaf = self.n_inputs - self.n_per_leaf
        in_dtypes = []
        outputs: list = []
        for k, node in enumerate(placeholders):
            d = node.meta["val"].dtype
            if k < self.n_inputs:
                if d not in _LEAF_DTYPES:
                    raise Unsupported(f"a leaf of dtype {d}")
                in_dtypes.append(d)
                self.names[node] = f"x{k}"
                if k < first_per_leaf or self.indexed:
                    self.vec.add(node)
            else:
                self.names[node] = f"s{k - self.n_inputs}"
            if compute_dtype(d) not in _TL:
                raise Unsupported(f"dtype {d}")
            self.dtypes[node] = compute_dtype(d)
        outputs = self.lower_graph()
        out_dtypes = [o.meta["val"].dtype for o in outputs]
        for d in out_dtypes:
            if d not in _LEAF_DTYPES:
                raise Unsupported(f"a result of dtype {d}")
        nin, nout = self.n_inputs, len(outputs)
        # a leaf's row of the table: its addresses, its numel, then (indexed) an index triple
        # (a, b, c) per per-leaf input, which reads element (offs // a) * b + offs % c
        nr = nin + nout + 1 + (3 * self.n_per_leaf if self.indexed else 0)
        names = [f"p{k}" for k, (_, a) in enumerate(self.scalar_kinds) if a]
        pointers = "".join(f"{p}, " for p in names)
        # (a scalar may be a view at any offset, a vector's element: no kernel per alignment)
        jit = f"@triton.jit(do_not_specialize={names})" if names else "@triton.jit"
        src = [
            "import triton",
            "import triton.language as tl",
            "",
            *self.consts,
            "",
            "",
            jit,
            f"def {fn_name}(tab, blocks, sc_off, {pointers}BLOCK: tl.constexpr):",
            "    pid = tl.program_id(0)",
            "    leaf = tl.load(blocks + 2 * pid)",
            "    offs = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK)",
            f"    row = tab + leaf * {nr}",
            f"    mask = offs < tl.load(row + {nin + nout})",
        ]
        j = 0  # (the host scalars' slots in the table, in order)
        for k, (d, by_address) in enumerate(self.scalar_kinds):
            slot = f"tl.load(tab + sc_off + {j})"
            j += not by_address
            if by_address:  # (an argument of its own: a pointer)
                x = f"tl.load(p{k}.to(tl.pointer_type({_storage_tl(d)})))"
                if d == torch.bool:
                    x = f"({x} != 0)"
                elif compute_dtype(d) != d:  # (a half-precision scalar: computed in float)
                    x = f"{x}.to({_TL[compute_dtype(d)]})"
            elif d.is_floating_point:
                x = f"{slot}.to(tl.float64, bitcast=True).to({_TL[compute_dtype(d)]})"
            elif d == torch.bool:
                x = f"({slot} != 0)"
            else:
                x = f"{slot}.to({_TL[d]})"
            src.append(f"    s{k} = {x}")
        for k, d in enumerate(in_dtypes):
            ptr = f"tl.load(row + {k}).to(tl.pointer_type({_TL[d]}))"
            if k < first_per_leaf:
                x = f"tl.load({ptr} + offs, mask=mask)"
            elif self.indexed:
                t = nin + nout + 1 + 3 * (k - first_per_leaf)
                at = f"(offs // tl.load(row + {t})) * tl.load(row + {t + 1})"
                x = f"tl.load({ptr} + {at} + offs % tl.load(row + {t + 2}), mask=mask)"
            else:
                x = f"tl.load({ptr})"
            if compute_dtype(d) != d:
                x = f"{x}.to({_TL[compute_dtype(d)]})"
            src.append(f"    x{k} = {x}")
        src += ["    " + x for x in self.lines]
        for j, (o, d) in enumerate(zip(outputs, out_dtypes)):
            x = self.val(o, d)
            if not self.is_vec(o):  # (computed from scalars only: written to every element;
                # tl.full, not tl.zeros: a jit function Triton's interpreter runs only when it
                # was on before triton was imported)
                x = f"({x} + tl.full([BLOCK], 0, {_TL[compute_dtype(d)]}))"
            if compute_dtype(d) != d:
                x = f"{x}.to({_TL[d]})"
            ptr = f"tl.load(row + {nin + j}).to(tl.pointer_type({_TL[d]}))"
            src.append(f"    tl.store({ptr} + offs, {x}, mask=mask)")
        return "\n".join(src) + "\n", out_dtypes


def _storage_tl(dtype) -> str:
    """The Triton type a scalar of ``dtype`` is read from memory as (a bool as its byte)."""
    return "tl.int8" if dtype == torch.bool else _TL[dtype]


def _load_source(source: str, fn_name: str):
    """The jitted function of ``source``, written to a file (Triton reads a kernel's source
    from its module's file) in ``$FT_CACHE_DIR/triton`` under a name keyed by the source."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    d = native.cache_dir() / "triton"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"ft_stage_{digest}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    name = f"functional_train_triton_{digest}"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    return getattr(mod, fn_name)


_blocks_cache: dict = {}


def _blocks(numels: tuple, device: torch.device) -> tuple[torch.Tensor, int]:
    """The (leaf, first element) pairs of every block of ``BLOCK`` elements, on ``device``,
    and their number (cached per set of leaf sizes)."""
    key = (numels, device)
    hit = _blocks_cache.get(key)
    if hit is None:
        pairs = array.array("q")
        for leaf, n in enumerate(numels):
            for start in range(0, n, BLOCK):
                pairs.extend((leaf, start))
        if len(_blocks_cache) > 256:
            _blocks_cache.clear()
        on_device = (
            torch.frombuffer(pairs, dtype=torch.int64).to(device)
            if pairs
            else torch.empty(0, dtype=torch.int64, device=device)
        )
        hit = _blocks_cache[key] = (on_device, len(pairs) // 2)
    return hit


def source_of(
    fn, in_dtypes, scalar_kinds, n_per_leaf: int = 0, indexed: bool = False
) -> tuple[str, list]:
    """The Triton source of the stage ``fn`` (its kernel ``ft_stage``) for leaves of
    ``in_dtypes`` and scalars of ``scalar_kinds`` (:func:`scalar_slots`' kinds), and the
    dtypes of its results. ``indexed``: every per-leaf input is read per element, through an
    index triple per leaf in the table (:meth:`TritonKernel.by_rows`). Needs no Triton (the
    source is text).

    Raises:
        Unsupported: an operation or dtype the writer does not write.
    """
    vectors = (True,) * n_per_leaf if indexed else ()
    graph = trace(fn, in_dtypes, tuple(d for d, _ in scalar_kinds), n_per_leaf, vectors)
    writer = _Writer(graph, len(in_dtypes), scalar_kinds, n_per_leaf, indexed)
    source, out_dtypes = writer.source("ft_stage")
    if "libdevice." in source:
        source = source.replace(
            "import triton.language as tl\n",
            "import triton.language as tl\nfrom triton.language.extra import libdevice\n",
            1,
        )
    return source, out_dtypes


_tables: dict = {}  # (the table's bytes, device) -> the table on the device, newest last
_TABLES_MAX = 64
# how many tables this process has copied to a device (a table not kept there yet): read by
# tests and benchmarks/profile_step.py, per step or per call
tables_copied = 0


def _table(tab: array.array, device: torch.device) -> torch.Tensor:
    """``tab`` on ``device``. A donated step's table (the same addresses and host scalars every
    step) is copied once and kept; a new one goes through pinned memory, so the copy is
    asynchronous (from pageable memory, CUDA synchronises the stream first: the host would
    wait for all the work queued before it, every stage)."""
    global tables_copied
    key = (tab.tobytes(), device)
    hit = _tables.pop(key, None)
    if hit is None:
        tables_copied += 1
        src = torch.frombuffer(tab, dtype=torch.int64)
        if device.type == "cuda":
            host = torch.empty(len(tab), dtype=torch.int64, pin_memory=True)
            host.copy_(src)
            hit = host.to(device, non_blocking=True)
        else:  # (Triton's interpreter, in tests: the table is read where it is)
            hit = src.clone()
        if len(_tables) >= _TABLES_MAX:
            del _tables[next(iter(_tables))]
    _tables[key] = hit
    return hit


class TritonKernel:
    """A stage compiled for one signature, called like :class:`.fuse.Kernel` on lists of CUDA
    leaves; ``scalars``: :func:`scalar_slots`' slots (a :class:`Scalars`). It does not sum its
    updates' squares (``sumsq`` is false: the clip's sums run as their own launches,
    :func:`sum_squares`)."""

    __slots__ = ("fn", "n_inputs", "n_outputs", "n_per_leaf", "out_dtypes", "source", "_checked")
    sumsq = False
    sum_in = None
    n_sums = 0

    def __init__(self, fn, in_dtypes, scalar_kinds, n_per_leaf: int = 0, indexed: bool = False):
        self.source, out_dtypes = source_of(fn, in_dtypes, scalar_kinds, n_per_leaf, indexed)
        self.n_per_leaf = n_per_leaf if indexed else 0  # (the index triples a leaf's row has)
        self.n_inputs = len(in_dtypes)
        self.n_outputs = len(out_dtypes)
        self.out_dtypes = out_dtypes
        self.fn = _load_source(self.source, "ft_stage")
        self._checked = False  # Triton compiles at the first launch

    def __call__(self, inputs, outputs, scalars, fresh: bool = False) -> bool:
        """Run on the leaves of ``inputs`` (per input, a list of contiguous CUDA tensors of
        the kernel's dtypes on one device; equal sizes leaf by leaf), writing ``outputs`` (per
        result, a list of tensors of those sizes; a result may be its input's tensor: in
        place). ``fresh`` is :class:`.fuse.Kernel`'s, unused here. ``False`` (nothing written)
        where Triton could not compile the kernel: the caller runs the stage in torch (a
        warning names the error once)."""
        return self._launch(inputs, outputs, scalars, None)

    def by_rows(self, inputs, outputs, scalars, kinds: Sequence[str], fresh: bool = False) -> bool:
        """:meth:`.fuse.Kernel.by_rows`' call (``kinds``: per input, ``"v"``, ``"s"``, ``"r"``
        or ``"c"``) for a kernel built ``indexed``: one launch over the leaves as
        :meth:`__call__`'s, each per-leaf input read per element at ``(offs // a) * b + offs %
        c`` of its leaf's triple: ``"v"`` ``(1, 1, 1)``, ``"s"`` ``(numel + 1, 0, 1)``, a
        value per row ``(m, 1, 1)``, a value per column ``(n * m, m, m)``, for a leaf of shape
        ``(..., n, m)``. ``False`` as :meth:`__call__`."""
        first_per_leaf = len(inputs) - self.n_per_leaf
        triples = array.array("q")
        for x in inputs[0]:
            s = x.shape
            m = max(s[-1], 1) if len(s) >= 1 else 1
            n = max(s[-2], 1) if len(s) >= 2 else 1
            by_kind = {"v": (1, 1, 1), "s": (x.numel() + 1, 0, 1), "r": (m, 1, 1)}
            by_kind["c"] = (n * m, m, m)
            for kind in kinds[first_per_leaf:]:
                triples.extend(by_kind[kind])
        return self._launch(inputs, outputs, scalars, triples)

    def _launch(self, inputs, outputs, scalars, triples) -> bool:
        if self._checked is None:
            return False
        first = inputs[0]
        n = len(first)
        roles = list(inputs) + list(outputs)
        base = len(roles) + 1
        nr = base + 3 * self.n_per_leaf
        numels = tuple(map(torch.Tensor.numel, first))
        tab = array.array("q", [0]) * (n * nr)
        taken: dict = {}  # (id of a list whose addresses are in: its column)
        for r, lst in enumerate(roles):
            column = taken.get(id(lst))
            if column is not None:  # (a result written in place: its input's list)
                tab[r::nr] = tab[column::nr]
                continue
            tab[r::nr] = array.array("q", map(torch.Tensor.data_ptr, lst))
            taken[id(lst)] = r
        tab[base - 1 :: nr] = array.array("q", numels)
        for t in range(3 * self.n_per_leaf):  # (indexed: each leaf's index triples)
            tab[base + t :: nr] = triples[t :: 3 * self.n_per_leaf]
        values, pointers = scalars
        tab.extend(values)
        device = first[0].device
        index = first[0].get_device()
        for lst in outputs:  # (an engine bug otherwise: the kernel would write another device)
            if any(lst is x for x in inputs):
                continue  # (in place: the inputs are on it, the caller checked)
            if not on_device(lst, device):
                raise RuntimeError(f"a fused stage's results are not all on {device}")
        blocks, nblocks = _blocks(numels, device)
        if nblocks == 0:
            return True
        t = _table(tab, device)
        other = device.type == "cuda" and torch.cuda.current_device() != index
        with torch.cuda.device(device) if other else contextlib.nullcontext():
            if self._checked:
                self.fn[(nblocks,)](t, blocks, n * nr, *pointers, BLOCK=BLOCK, num_warps=_NUM_WARPS)
                return True
            try:  # the first launch compiles
                self.fn[(nblocks,)](t, blocks, n * nr, *pointers, BLOCK=BLOCK, num_warps=_NUM_WARPS)
            except Exception as e:
                self._checked = None
                warnings.warn(
                    f"functional_train: a fused stage runs leaf by leaf, its generated Triton "
                    f"kernel did not compile ({type(e).__name__}: {e})",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return False
            self._checked = True
        return True


# the sums of squares of a list of leaves: per block of BLOCK elements (found through the
# block table, as a stage's), then per leaf over its blocks (consecutive in that table, in
# order: the same order every call, so the sums are deterministic); float64 accumulation
_SUMSQ_SOURCE = """import triton
import triton.language as tl


@triton.jit
def ft_add(a, b):
    return a + b


@triton.jit
def ft_sumsq_blocks(tab, blocks, n, partial, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    leaf = tl.load(blocks + 2 * pid)
    offs = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK)
    ptr = tl.load(tab + leaf).to(tl.pointer_type({dtype}))
    x = tl.load(ptr + offs, mask=offs < tl.load(tab + n + leaf), other=0.0).to(tl.float64)
    tl.store(partial + pid, tl.reduce(x * x, 0, ft_add))


@triton.jit
def ft_sumsq_leaves(tab, n, partial, out, BLOCK: tl.constexpr):
    leaf = tl.program_id(0)
    lo = tl.load(tab + 2 * n + leaf)
    hi = tl.load(tab + 2 * n + leaf + 1)
    acc = tl.full([BLOCK], 0, tl.float64)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partial + offs, mask=offs < hi, other=0.0)
    tl.store(out + leaf, tl.reduce(acc, 0, ft_add))
"""
# (tl.reduce with a combine of its own is tl.sum of float64 values, which is a jit function
# of triton.language: Triton's interpreter runs those only when it was on at triton's import)
_sumsq_kernels: dict = {}  # dtype -> (blocks kernel, leaves kernel), or None: did not compile
_REQUIRES_GRAD = torch.Tensor.requires_grad.__get__


def sum_squares(xs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The sum of squares of each of ``xs`` (plain CUDA tensors of one floating dtype on one
    device, without autograd, each dense in memory: :func:`.pool.all_in_one_order`), accumulated
    in float64 as :func:`.native.sum_squares` does on the CPU: a float64 vector on their device,
    an element per tensor. Two launches whatever the number of tensors (the squares per block of
    ``BLOCK`` elements, then per tensor over its blocks in order: deterministic), where
    ``torch._foreach_norm`` and a ``stack`` of its norms take one operation per tensor on the
    host. ``None`` (nothing computed) where the tensors do not qualify, Triton is not
    importable, the kernels are off (``FT_FUSED_KERNELS=0``) or did not compile (a warning,
    once). No collectives, no synchronisation."""
    from . import fuse

    if not xs or not fuse.ENABLED or set(map(type, xs)) != {torch.Tensor}:
        return None
    x0 = xs[0]
    device = x0.device
    if (
        not available(device)
        or not on_device(xs, device)
        or set(map(_DTYPE, xs)) != {x0.dtype}
        or x0.dtype not in _LEAF_DTYPES
        or not all_in_one_order(xs)
        or any(map(_REQUIRES_GRAD, xs))
    ):
        return None
    return _sum_squares(xs, device)


def _sum_squares(xs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """:func:`sum_squares` without its checks (Triton's interpreter runs it on CPU tensors)."""
    dtype = xs[0].dtype
    kernels = _sumsq_kernels.get(dtype, False)
    if kernels is False:
        source = _SUMSQ_SOURCE.replace("{dtype}", _TL[dtype])
        kernels = _sumsq_kernels[dtype] = (
            _load_source(source, "ft_sumsq_blocks"),
            _load_source(source, "ft_sumsq_leaves"),
        )
    if kernels is None:
        return None
    n = len(xs)
    numels = tuple(map(torch.Tensor.numel, xs))
    blocks, nblocks = _blocks(numels, device)
    tab = array.array("q", map(torch.Tensor.data_ptr, xs))
    tab.extend(numels)
    tab.extend(_firsts(numels))
    if nblocks == 0:
        return torch.zeros(n, dtype=torch.float64, device=device)
    t = _table(tab, device)
    out = torch.empty(n, dtype=torch.float64, device=device)  # (every element written)
    partial = torch.empty(nblocks, dtype=torch.float64, device=device)
    index = xs[0].get_device()
    other = device.type == "cuda" and torch.cuda.current_device() != index
    with torch.cuda.device(device) if other else contextlib.nullcontext():
        try:
            kernels[0][(nblocks,)](t, blocks, n, partial, BLOCK=BLOCK, num_warps=_NUM_WARPS)
            kernels[1][(n,)](t, n, partial, out, BLOCK=BLOCK, num_warps=_NUM_WARPS)
        except Exception as e:
            _sumsq_kernels[dtype] = None
            warnings.warn(
                f"functional_train: the sums of squares run in torch, their generated Triton "
                f"kernel did not compile ({type(e).__name__}: {e})",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
    return out


_firsts_cache: dict = {}


def _firsts(numels: tuple) -> array.array:
    """Per leaf the index of its first block in :func:`_blocks`' table, then their total
    (cached per set of leaf sizes)."""
    hit = _firsts_cache.get(numels)
    if hit is None:
        hit = array.array("q", [0])
        for n in numels:
            hit.append(hit[-1] + -(-n // BLOCK))
        if len(_firsts_cache) > 256:
            _firsts_cache.clear()
        _firsts_cache[numels] = hit
    return hit


_DTYPE = torch.Tensor.dtype.__get__


class Scalars(NamedTuple):
    """A :class:`TritonKernel` call's scalars: the host ones' ``int64`` slots of the table
    (``values``) and the device ones, each the kernel's argument (``pointers``)."""

    values: array.array
    pointers: tuple


def scalar_slots(scalars: Sequence, device: torch.device) -> tuple | None:
    """``(slots, kinds, keep)`` for a :class:`TritonKernel` call on ``device``: ``slots`` a
    :class:`Scalars`: a Python number or 0-dim CPU tensor as an ``int64`` slot of the table
    (its value, a float's as float64 bits), a 0-dim tensor on ``device`` as an argument of
    the kernel (a pointer: read by the kernel; not in the table, which a donated step then
    keeps on the device from step to step, though such tensors are new each step); per
    scalar its kind ``(dtype, by address)`` for the kernel's signature; ``keep`` holds what
    must stay alive through the call. ``None`` where a scalar cannot be passed so (a tensor
    of more than one element, on another device, or one autograd records)."""
    slots = array.array("q")
    kinds = []
    keep: list = []
    for x in scalars:
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor or x.numel() != 1 or x.requires_grad or x.ndim != 0:
                return None
            if x.dtype not in _TL:
                return None
            if x.device == device:
                keep.append(x)
                kinds.append((x.dtype, True))
                continue
            if not x.is_cpu:
                return None
            v = x.item()
            d = x.dtype
        else:  # (a Python number: float64, as the C kernels read it)
            v, d = float(x), torch.float64
        if d.is_floating_point:
            slots.append(struct.unpack("q", struct.pack("d", float(v)))[0])
        else:
            slots.append(int(v))
        kinds.append((d, False))
    return Scalars(slots, tuple(keep)), tuple(kinds), keep
