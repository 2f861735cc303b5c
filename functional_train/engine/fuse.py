"""Fused elementwise passes: one generated kernel per stage of a chain.

A stage is a per-leaf function written in plain tensor operations (the primitives' own
definitions, composed in the order the user chained them; see :mod:`.elementwise`)::

    def stage(inputs: tuple[Tensor, ...], scalars: tuple[Tensor, ...]) -> tuple[Tensor, ...]

``inputs`` are leaves of one shape (the update, the parameter, state leaves), then any
per-leaf values (0-dim tensors, one per leaf: a trust ratio; ``n_per_leaf`` of
:func:`kernel_for`; values broadcast over a leaf's rows or columns are read by a kernel run
row by row, :meth:`Kernel.by_rows`, with ``vectors``), ``scalars`` are 0-dim tensors or
numbers shared by every leaf
(hyper-parameters, a clip factor, bias corrections), the results are leaves of the inputs'
shape. A value computed from scalars only is computed once per call, from a per-leaf value
once per leaf, the rest once per element. :func:`kernel_for` gives its :class:`Kernel` for a dtype
signature, which :mod:`.elementwise` calls on lists of leaves.

How it runs:

* **CPU, float32 / float64 / bfloat16 / float16 leaves.** The stage is traced once per signature
  (its function and the dtypes of its inputs and scalars) into ATen operations, recorded by a
  ``TorchDispatchMode`` as it runs on 3-element CPU tensors (:func:`trace`, about 1 ms: the
  graph ``make_fx`` records, at a tenth of its cost); each operation becomes one line of C
  inside a single loop over the elements of a leaf, which the C compiler vectorises
  (``-O3 -march=native -fopenmp-simd``). No floating-point
  contraction beyond the fused multiply-adds ATen's own CPU kernels use (``add`` with ``alpha``,
  ``addcmul``, ``lerp``), and IEEE's correctly rounded division and square root: the results
  equal the stage run by torch to float rounding (torch's float32 ``sqrt`` on CPU is not always
  correctly rounded; see ``tests/test_fused.py`` for the tolerance). Selects are exact bitwise
  blends (GCC leaves a loop-invariant ``?:`` as a branch, which stops vectorisation). One call
  runs every leaf of the lists, reading each input once and writing each result once -- the
  memory traffic of torch's fused optimizer kernels, for whatever elementwise work the user
  composed; results may be written over their inputs (the donated step). Scalars reach the
  kernel by address (:func:`scalar_pointers`: a 0-dim CPU tensor's own memory), so no value is
  read on the host. The source is compiled with the system C compiler
  (:func:`.native.build_library`) into ``$FT_CACHE_DIR`` under a name keyed by the source, about
  0.1 s once per machine (concurrent processes build it once); later processes load it.
  Half-precision leaves are loaded into ``float``, computed there and rounded to nearest even
  once, where a result is stored or the stage converts to the half dtype (ATen's ``opmath``, as
  torch's fused optimizer kernels and inductor compute; the stage run by torch rounds every
  operation instead). Their conversions are written as integer operations, which the compiler
  vectorises (it does not vectorise ``_Float16`` conversions), exact against torch's bit for
  bit. Under ``torch.compile`` the kernel runs inside the opaque operator
  ``functional_train::fused_stage`` (:mod:`.elementwise`).
* **CUDA leaves** (where Triton is importable): the same traced graph written as a Triton
  kernel, one launch per call (:mod:`.fuse_triton`; :func:`kernel_for` with ``device_type
  "cuda"``); a graph that is exactly one of torch's foreach operations (a sum written over
  one of its two inputs, a copy: ``multi_steps``' accumulation; :func:`exact_foreach`) runs
  as that operation (:class:`ForeachKernel`), whose host work is a fraction of a launch's.
* **Everywhere else** (a ``torch.func`` transform, :func:`~functional_train.differentiable`,
  an operation the generators do not write, no C compiler or Triton, ``torch.compile`` on
  CUDA): the same function runs leaf by leaf in torch, where torch's own machinery (inductor,
  functorch, autograd) sees the plain operations.

``FT_FUSED_KERNELS=0`` in the environment, or ``ENABLED = False`` here, turns the generated
kernels off (every stage runs leaf by leaf); ``FT_FUSED_DEBUG=1`` warns when a stage cannot be
generated.
"""

from __future__ import annotations

import array
import ctypes
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode, autograd_would_have_decomposed

from . import native
from .pool import const_data_ptr

if TYPE_CHECKING:
    from .fuse_triton import TritonKernel

__all__ = [
    "ENABLED",
    "DEBUG",
    "STREAM_MIN_BYTES",
    "Kernel",
    "kernel_for",
    "scalar_pointers",
    "Unsupported",
]

ENABLED = os.environ.get("FT_FUSED_KERNELS", "1") != "0"
DEBUG = os.environ.get("FT_FUSED_DEBUG", "0") != "0"  # warn when a stage cannot be generated
STREAM_MIN_BYTES = 8 * 2**20  # a call's fresh results below which ordinary stores are used
_CFLAGS = [
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fopenmp-simd",
    "-shared",
    "-fPIC",
]
_CTYPE = {
    torch.float32: "float",
    torch.float64: "double",
    torch.bool: "_Bool",
    torch.int64: "int64_t",
    torch.int32: "int32_t",
}
# half-precision leaves: stored as their 16 bits, computed in float (ATen's ``opmath``, as
# torch's fused optimizer kernels and inductor compute them): rounded once, where a result is
# stored or a conversion to the half dtype is written in the stage
# (float16 through integer operations, which GCC vectorises, where it does not vectorise
# ``_Float16`` conversions)
_HALF = (torch.bfloat16, torch.float16)
_SUMSQ = {torch.float32: "f32", torch.float64: "f64"}  # (the results a stage may sum)
_LOAD = {torch.bfloat16: "ft_lbf16({x})", torch.float16: "ft_lf16({x})"}
_STORE = {torch.bfloat16: "ft_sbf16({x})", torch.float16: "ft_sf16({x})"}


def compute_dtype(dtype):
    """The dtype a value of ``dtype`` is computed in."""
    return torch.float32 if dtype in _HALF else dtype


def _storage(dtype) -> str:
    """The C type a leaf of ``dtype`` is stored as (its 16 bits for a half dtype)."""
    return "uint16_t" if dtype in _HALF else _CTYPE[dtype]


_lock = threading.Lock()
_kernels: dict = {}
_warned: list = []  # whether a stage's build failed for want of a compiler or a cache


class Unsupported(Exception):
    """A stage uses an operation the C code generator does not write."""


def _c_literal(v, dtype) -> str:
    if dtype == torch.bool:
        return "1" if v else "0"
    if dtype in (torch.int64, torch.int32):
        return str(int(v))
    f = float(v)
    if f != f:
        return "NAN"
    if f in (float("inf"), float("-inf")):
        return "INFINITY" if f > 0 else "(-INFINITY)"
    s = repr(f)
    return s + ("f" if dtype == torch.float32 else "")


BINARY = {
    "add": "({a} + {b})",
    "sub": "({a} - {b})",
    "mul": "({a} * {b})",
    "div": "({a} / {b})",
    "maximum": "FT_MAX({a}, {b})",
    "minimum": "FT_MIN({a}, {b})",
    "eq": "({a} == {b})",
    "ne": "({a} != {b})",
    "lt": "({a} < {b})",
    "le": "({a} <= {b})",
    "gt": "({a} > {b})",
    "ge": "({a} >= {b})",
    "logical_and": "({a} && {b})",
    "logical_or": "({a} || {b})",
    "bitwise_and": "({a} & {b})",
    "bitwise_or": "({a} | {b})",
}
_UNARY = {
    "neg": "(-{a})",
    "abs": "FT_ABS({a})",
    "sqrt": "FT_SQRT({a})",
    "reciprocal": "(({t})1 / {a})",
    "logical_not": "(!{a})",
    "bitwise_not": "(!{a})",
    "sign": "FT_SIGN({a})",
    "isnan": "({a} != {a})",
}


def op_name(target) -> str:
    name = getattr(target, "__name__", str(target))  # "add.Tensor"
    return name.split(".")[0]


# the generated source's helpers: NaN-propagating maximum / minimum as torch's, type-generic
# builtins, and an exact bitwise select (FT_SEL; GCC leaves a loop-invariant ``?:`` as a branch)
_HEADER = r"""#include <stdint.h>
#include <math.h>
#define FT_ABS(a) _Generic((a), float: __builtin_fabsf, default: __builtin_fabs)(a)
#define FT_FMA(a, b, c) _Generic((a), float: __builtin_fmaf, default: __builtin_fma)(a, b, c)
#define FT_SQRT(a) _Generic((a), float: __builtin_sqrtf, default: __builtin_sqrt)(a)
#define FT_SIGN(a) (((a) > 0) - ((a) < 0))
static inline float ft_self(_Bool c, float a, float b) {
  uint32_t x, y, m = (uint32_t)0 - (uint32_t)c; float r;
  __builtin_memcpy(&x, &a, 4); __builtin_memcpy(&y, &b, 4);
  x = (x & m) | (y & ~m); __builtin_memcpy(&r, &x, 4); return r;
}
static inline double ft_seld(_Bool c, double a, double b) {
  uint64_t x, y, m = (uint64_t)0 - (uint64_t)c; double r;
  __builtin_memcpy(&x, &a, 8); __builtin_memcpy(&y, &b, 8);
  x = (x & m) | (y & ~m); __builtin_memcpy(&r, &x, 8); return r;
}
/* half-precision conversions, branch free (integer selects: GCC vectorises no ``?:`` here) */
#define FT_PICK(c, a, b) ((((uint32_t)0 - (uint32_t)(c)) & (a)) | (((uint32_t)0 - !(c)) & (b)))
static inline float ft_f32(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline uint32_t ft_u32(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
static inline float ft_lbf16(uint16_t h) { return ft_f32((uint32_t)h << 16); }
static inline uint16_t ft_sbf16(float f) {  /* round to nearest even; NaN as c10's 0x7fc0 */
  uint32_t u = ft_u32(f);
  return (uint16_t)FT_PICK(f != f, 0x7fc0u, (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float ft_lf16(uint16_t h) {  /* exact; no subnormal float arithmetic */
  uint32_t em = (uint32_t)(h & 0x7fffu) << 13, sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = em & 0x0f800000u, n = em + 0x38000000u;  /* rebias: (127 - 15) << 23 */
  /* a subnormal half, renormalised by a subtraction of normal floats */
  uint32_t sub = ft_u32(ft_f32(n + 0x00800000u) - 0x1p-14f);
  uint32_t u = FT_PICK(e == 0x0f800000u, n + 0x38000000u, FT_PICK(e == 0, sub, n));
  return ft_f32(u | sign);
}
static inline uint16_t ft_sf16(float x) {  /* round to nearest even, as c10::Half */
  uint32_t u = ft_u32(x), sign = u & 0x80000000u, a = u ^ sign;
  uint32_t big = FT_PICK(a > 0x7f800000u, 0x7e00u, 0x7c00u);  /* NaN, or inf / overflow */
  uint32_t sub = ft_u32(ft_f32(a) + 0.5f) - ft_u32(0.5f);  /* below 2^-14: the FPU rounds */
  uint32_t nrm = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;  /* rebias, round */
  uint32_t r = FT_PICK(a >= 0x47800000u, big, FT_PICK(a < 0x38800000u, sub, nrm));
  return (uint16_t)(r | (sign >> 16));
}
/* non-temporal stores: whole cache lines written without first reading them (write allocate),
   for results in fresh memory; the head and tail that do not fill an aligned 32 bytes copied */
#define FT_BLOCK 128
#if defined(__AVX__) && (defined(__GNUC__) || defined(__clang__))
/* the compilers' own builtins, which <immintrin.h>'s _mm256_stream_si256 and _mm_sfence wrap
   (that header takes longer to parse than the rest of a stage) */
typedef long long ft_v4di __attribute__((vector_size(32)));
static inline void ft_nt32(char *d, const char *s) {
  ft_v4di v; __builtin_memcpy(&v, s, 32);
#if defined(__clang__)
  __builtin_nontemporal_store(v, (ft_v4di *)d);
#else
  __builtin_ia32_movntdq256((ft_v4di *)d, v);
#endif
}
/* one copy, called per block and result (inlined at each call, it took about a sixth of a
   stage's compile time) */
static __attribute__((noinline)) void ft_stream(void *dst, const void *src, int64_t bytes) {
  char *d = (char *)dst; const char *s = (const char *)src;
  while (bytes > 0 && ((uintptr_t)d & 31)) { *d++ = *s++; bytes--; }
  for (; bytes >= 32; bytes -= 32, d += 32, s += 32) ft_nt32(d, s);
  while (bytes > 0) { *d++ = *s++; bytes--; }
}
#define FT_FENCE() __builtin_ia32_sfence()
#else
static inline void ft_stream(void *dst, const void *src, int64_t bytes) {
  __builtin_memcpy(dst, src, (__SIZE_TYPE__)bytes);
}
#define FT_FENCE() ((void)0)
#endif
#define FT_SEL(c, a, b) _Generic((a), float: ft_self, default: ft_seld)(c, a, b)
#define FT_MAX(a, b) \
  FT_SEL((a) != (a), (a), FT_SEL((b) != (b), (b), FT_SEL((a) > (b), (a), (b))))
#define FT_MIN(a, b) \
  FT_SEL((a) != (a), (a), FT_SEL((b) != (b), (b), FT_SEL((a) < (b), (a), (b))))"""


class Lowering:
    """The lowering of a traced stage's ATen operations into expressions, written once for
    the C kernels (:class:`_Writer`) and the Triton ones (:mod:`.fuse_triton`): a writer
    supplies ``val`` (an argument's expression, converted to a dtype), ``emit`` (a node's
    value), ``emit_tmp`` (a named temporary), ``is_vec`` (a per-element value) and the
    dialect's expressions (``fma``, ``binary``, ``unary``, ``where``, ...). ATen's
    arithmetic: ``add`` / ``sub`` with ``alpha``, ``addcmul`` and ``lerp`` as fused
    multiply-adds, as ATen's kernels write them; a conversion to a half dtype rounds there."""

    #: the dtypes a value may have in the writer's language, with their names there
    TYPES: dict = {}

    def __init__(self, graph: torch.fx.Graph, n_inputs: int, n_per_leaf: int, vectors: tuple = ()):
        self.graph = graph
        self.n_inputs = n_inputs
        self.n_per_leaf = n_per_leaf  # the last inputs: one value per leaf (0-dim)
        # (of those, the ones read per element after all: see kernel_for's ``vectors``)
        self.vectors = tuple(vectors) or (False,) * n_per_leaf
        self.names: dict = {}  # node -> its value's name
        self.dtypes: dict = {}  # node -> the dtype its value is computed in
        self.vec: set = set()  # the nodes of per-element values

    # what a writer supplies: a value's line, a conversion, a literal, its lines so far
    def write(self, name: str, expr: str, dtype, vec: bool) -> None:
        raise NotImplementedError

    def cast(self, name: str, dtype) -> str:
        raise NotImplementedError

    def literal(self, v, dtype) -> str:
        raise NotImplementedError

    def n_lines(self) -> int:
        raise NotImplementedError

    def val(self, arg, want=None) -> str:
        """``arg``'s expression (a node's value or a number), converted to ``want``."""
        want = None if want is None else compute_dtype(want)
        if isinstance(arg, torch.fx.Node):
            name = self.names[arg]
            if want is not None and self.dtypes[arg] != want:
                return self.cast(name, want)
            return name
        if isinstance(arg, (bool, int, float)):
            if want is None:
                want = (
                    torch.bool
                    if isinstance(arg, bool)
                    else torch.float64
                    if isinstance(arg, float)
                    else torch.int64
                )
            return self.literal(arg, want)
        raise Unsupported(f"argument {arg!r}")

    def is_vec(self, arg) -> bool:
        return isinstance(arg, torch.fx.Node) and arg in self.vec

    def emit(self, node, expr: str, dtype, vec: bool) -> None:
        """``node``'s value: ``expr`` in ``dtype``, per element where ``vec``."""
        dtype = compute_dtype(dtype)
        if dtype not in self.TYPES:
            raise Unsupported(f"dtype {dtype} of {node.format_node()}")
        name = f"v{len(self.names)}"
        self.names[node] = name
        self.dtypes[node] = dtype
        self.write(name, expr, dtype, vec)
        if vec:
            self.vec.add(node)
        else:
            self.placed(node)

    def emit_tmp(self, expr: str, dtype, vec: bool) -> str:
        """A named temporary (not a graph node's value)."""
        name = f"t{self.n_lines()}"
        self.write(name, expr, compute_dtype(dtype), vec)
        return name

    def placed(self, node) -> None:
        """Called for a value that is not per element (the C writer tracks per-leaf ones)."""

    def enter(self, node, args, vec: bool) -> None:
        """Called before a node is lowered (the C writer places values by level)."""

    def lower_graph(self) -> list:
        """Lower every operation of the graph (its placeholders named already); its results,
        each a leaf-shaped value (one computed from scalars only, ``zeros_like(x)``, is
        written to every element).

        Raises:
            Unsupported: an operation or result the writer does not write.
        """
        outputs: list = []
        for node in self.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = list(node.args[0])
                continue
            if node.op != "call_function":
                raise Unsupported(node.format_node())
            self.lower(node)
        for o in outputs:
            if not isinstance(o, torch.fx.Node) or (
                not self.is_vec(o) and tuple(o.meta["val"].shape) != (TRACE_NUMEL,)
            ):
                raise Unsupported("a result that is not a leaf-shaped value")
        return outputs

    def lower(self, node):
        op = op_name(node.target)
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise Unsupported(node.format_node())
        dtype = compute_dtype(val.dtype)
        args = node.args
        vec = any(self.is_vec(a) for a in args if isinstance(a, torch.fx.Node))
        self.enter(node, args, vec)
        if op in ("add", "sub") and len(args) == 2 and "alpha" in node.kwargs:
            # ATen: a fused multiply-add, alpha * b + a
            al = self.val(node.kwargs["alpha"], dtype)
            if op == "sub":
                al = f"(-{al})"
            a, b = self.val(args[0], dtype), self.val(args[1], dtype)
            return self.emit(node, self.fma(al, b, a), dtype, vec)
        if op in ("_to_copy", "clone", "alias", "detach", "lift_fresh_copy") and len(args) == 1:
            x = self.val(args[0], dtype)
            src = args[0].meta["val"].dtype if isinstance(args[0], torch.fx.Node) else None
            if val.dtype in _HALF and src != val.dtype:  # a conversion to half: rounded here
                x = self.to_half(x, val.dtype)
            return self.emit(node, x, dtype, vec)
        if op == "addcmul" and len(args) == 3 and set(node.kwargs) <= {"value"}:
            # ATen: fma(value * t1, t2, self)
            a, b, c = (self.val(x, dtype) for x in args)
            if "value" in node.kwargs:
                b = self.binary("mul", self.val(node.kwargs["value"], dtype), b, dtype)
            return self.emit(node, self.fma(b, c, a), dtype, vec)
        if op in ("full_like", "zeros_like", "ones_like", "scalar_tensor", "full") and set(
            node.kwargs
        ) <= {"dtype", "layout", "device", "pin_memory", "memory_format"}:
            # a constant (of the node's dtype: ``val``'s)
            fill = {"zeros_like": 0, "ones_like": 1}.get(op)
            if fill is None:
                fill = args[1] if op in ("full_like", "full") else args[0]
            return self.emit(node, self.val(fill, dtype), dtype, False)
        if node.kwargs:
            raise Unsupported(node.format_node())
        if op == "rsub" and len(args) == 2:
            a, b = self.val(args[0], dtype), self.val(args[1], dtype)
            return self.emit(node, self.binary("sub", b, a, dtype), dtype, vec)
        if op in BINARY and len(args) == 2:
            if dtype == torch.bool and op not in ("logical_and", "logical_or"):
                common = compute_dtype(common_dtype(args))
                a, b = self.val(args[0], common), self.val(args[1], common)
            else:
                a, b = self.val(args[0], dtype), self.val(args[1], dtype)
            return self.emit(node, self.binary(op, a, b, dtype), dtype, vec)
        if op in (*_UNARY, "isfinite", "rsqrt") and len(args) == 1:
            if op in ("isnan", "isfinite"):
                a = self.val(args[0])
            else:
                a = self.val(args[0], dtype if dtype != torch.bool else None)
            return self.emit(node, self.unary(op, a, dtype), dtype, vec)
        if op == "where" and len(args) == 3:
            c = self.val(args[0])
            a, b = self.val(args[1], dtype), self.val(args[2], dtype)
            return self.emit(node, self.where(args[0], c, a, b, dtype, vec), dtype, vec)
        if op == "pow" and len(args) == 2:
            ex = args[1]
            if isinstance(ex, (int, float)) and float(ex) == 2.0:
                a = self.val(args[0], dtype)
                return self.emit(node, self.binary("mul", a, a, dtype), dtype, vec)
            if isinstance(ex, (int, float)) and float(ex) == 0.5:
                return self.emit(
                    node, self.unary("sqrt", self.val(args[0], dtype), dtype), dtype, vec
                )
            if not vec:
                a, b = self.val(args[0], dtype), self.val(ex, dtype)
                return self.emit(node, self.pow_scalar(a, b, dtype), dtype, vec)
            raise Unsupported(node.format_node())
        if op == "lerp" and len(args) == 3:
            # ATen's lerp: start + weight * (end - start) when |weight| < 0.5, else
            # end - (end - start) * (1 - weight), as fma(coeff, end - start, base); the choice
            # as selects of computed values (which a C compiler vectorises, a branch it does not)
            a, b, w = (self.val(x, dtype) for x in args)
            wv = self.is_vec(args[2])
            small = self.emit_tmp(
                self.binary("lt", self.unary("abs", w, dtype), self.val(0.5, dtype), dtype),
                torch.bool,
                wv,
            )
            coeff = self.emit_tmp(self.lerp_pick(small, w, dtype), dtype, wv)
            base = self.emit_tmp(self.where(args[2], small, a, b, dtype, vec), dtype, vec)
            diff = self.binary("sub", b, a, dtype)
            return self.emit(node, self.fma(coeff, diff, base), dtype, vec)
        if op == "addcdiv" and len(args) == 3:
            a, b, c = (self.val(x, dtype) for x in args)
            return self.emit(
                node, self.binary("add", a, self.binary("div", b, c, dtype), dtype), dtype, vec
            )
        if op in ("clamp", "clamp_min", "clamp_max"):
            a = self.val(args[0], dtype)
            lo = args[1] if op != "clamp_max" else None
            hi = (
                args[2]
                if op == "clamp" and len(args) > 2
                else (args[1] if op == "clamp_max" else None)
            )
            expr = a
            if lo is not None:
                expr = self.binary("maximum", expr, self.val(lo, dtype), dtype)
            if hi is not None:
                expr = self.binary("minimum", expr, self.val(hi, dtype), dtype)
            return self.emit(node, expr, dtype, vec)
        raise Unsupported(node.format_node())


MAX_SWITCHES = 2  # (the flags a leaf's loop is specialised for: 2 ** this copies of it)


def unswitched(section: list, switches: list) -> list:
    """The lines ``section`` (a leaf's loop) once per value of each flag of ``switches``
    (``(name, C type)``): ``if (f) { const _Bool f = 1; ... } else { const _Bool f = 0; ... }``,
    the flag shadowed by its constant value, so that the C compiler keeps each copy's side of
    the flag's selects only, and drops the loads only the other side reads (a compiled
    ``multi_steps`` first micro-step's select of ``g`` over ``acc + g`` reads no
    accumulator). The values are the same bits: a select (``FT_SEL``) of a constant
    picks what it picked."""
    if not switches:
        return section
    (name, ctype), rest = switches[0], switches[1:]
    inner = ["  " + line for line in unswitched(section, rest)]
    return [
        f"    if ({name}) {{",
        f"      const {ctype} {name} = 1;",
        *inner,
        "    } else {",
        f"      const {ctype} {name} = 0;",
        *inner,
        "    }",
    ]


class _Writer(Lowering):
    """C source of one stage from its traced graph."""

    TYPES = _CTYPE

    def __init__(
        self,
        graph: torch.fx.Graph,
        n_inputs: int,
        n_scalars: int,
        n_per_leaf: int,
        vectors: tuple = (),
    ):
        super().__init__(graph, n_inputs, n_per_leaf, vectors)
        self.n_scalars = n_scalars
        self.pre: list = []  # scalar-only lines, once per call
        self.mid: list = []  # lines of per-leaf values, once per leaf
        self.body: list = []  # per element
        self.leafy: set = set()  # names of per-leaf values (not per element)
        self.leafy_now = False  # the node being lowered reads a per-leaf value
        # the names (and C types) of the values that are the same for a whole leaf or call
        # and that a ``where`` selects per-element values by (flags: see source)
        self.switches: dict = {}

    def write(self, name: str, expr: str, dtype, vec: bool) -> None:
        # where a value's line goes: per element, per leaf or once per call
        lines = self.body if vec else self.mid if self.leafy_now else self.pre
        lines.append(f"const {_CTYPE[dtype]} {name} = {expr};")

    def cast(self, name: str, dtype) -> str:
        return f"(({_CTYPE[dtype]}){name})"

    def literal(self, v, dtype) -> str:
        return _c_literal(v, dtype)

    def n_lines(self) -> int:
        return len(self.pre) + len(self.mid) + len(self.body)

    def placed(self, node) -> None:
        if self.leafy_now:
            self.leafy.add(node)

    def select(self, cond_arg, c: str, a: str, b: str, dtype, vec: bool) -> str:
        """``c ? a : b``. A condition that is the same for every element (a scalar's: a flag,
        a weight's range) selecting per-element floating values is written as a bitwise
        blend (``FT_SEL``, exact): GCC turns a loop-invariant ``?:`` into branches, and with
        more than one in a loop gives up vectorising it ("control flow in loop")."""
        scalar_cond = not (isinstance(cond_arg, torch.fx.Node) and cond_arg in self.vec)
        if vec and scalar_cond and compute_dtype(dtype) in (torch.float32, torch.float64):
            return f"FT_SEL({c}, {a}, {b})"
        return f"({c} ? {a} : {b})"

    def source(
        self, fn_name: str, sumsq: bool = False, sum_in: int | None = None
    ) -> tuple[str, list]:
        """The C source of the stage, and ``[input dtypes, output dtypes]``. ``sumsq``: the
        stage also writes each leaf's sum of squares of its first result (the updates) into
        one more per-leaf pointer, a float64, summed block by block as the results are
        written, in ``_sumsq.h``'s order (the bits :func:`.native.sum_squares` gives for the
        result in memory). ``sum_in`` (with ``sumsq``): the position of a leaf-shaped input
        (float32 / float64, one no result overwrites: the parameters of a stage that does not
        apply) whose sums of squares it writes too, into a pointer after that one, summed
        from each block as it was read (the same bits as well)."""
        outputs = []
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != self.n_inputs + self.n_scalars:
            raise Unsupported("unexpected placeholders")
        in_dtypes = []
        first_per_leaf = self.n_inputs - self.n_per_leaf
        # the inputs read per element: the leaf-shaped ones, and per-leaf ones given as vectors
        per_element = [
            k < first_per_leaf or self.vectors[k - first_per_leaf] for k in range(self.n_inputs)
        ]
        for k, node in enumerate(placeholders):
            val = node.meta["val"]
            if k < self.n_inputs:
                self.names[node] = f"x{k}"
                (self.vec if per_element[k] else self.leafy).add(node)
                in_dtypes.append(val.dtype)
            else:
                self.names[node] = f"s{k - self.n_inputs}"
                if val.dtype in _HALF:  # (a scalar is read by address, as its own dtype)
                    raise Unsupported(f"a scalar of dtype {val.dtype}")
            if compute_dtype(val.dtype) not in _CTYPE:
                raise Unsupported(f"dtype {val.dtype}")
            self.dtypes[node] = compute_dtype(val.dtype)
        outputs = self.lower_graph()
        out_dtypes = [o.meta["val"].dtype for o in outputs]
        nin, nout = self.n_inputs, len(outputs)
        if sumsq and (not outputs or out_dtypes[0] not in _SUMSQ):
            raise Unsupported("sums of squares of a result that is not float32 or float64")
        if sum_in is not None and (
            not sumsq or not per_element[sum_in] or in_dtypes[sum_in] not in _SUMSQ
        ):
            raise Unsupported("sums of squares of an input that is not float32 or float64")
        n_sums = (1 if sumsq else 0) + (sum_in is not None)
        stride = nin + nout + n_sums  # (pointers per leaf)
        lines = [
            _HEADER,
            *([native.sumsq_header()] if sumsq else []),
            f"void {fn_name}(int64_t nleaves, const int64_t *numel, void *const *ptr,"
            " void *const *sc, int64_t stream) {",
        ]
        for k in range(self.n_scalars):
            node = placeholders[nin + k]
            t = _CTYPE[self.dtypes[node]]
            lines.append(f"  const {t} s{k} = *(const {t} *)sc[{k}];")
        lines += ["  " + x for x in self.pre]
        for j, d in enumerate(out_dtypes):  # the streamed results' blocks
            lines.append(f"  {_storage(d)} b{j}[FT_BLOCK] __attribute__((aligned(64)));")
        lines.append("  for (int64_t l = 0; l < nleaves; l++) {")
        lines.append("    const int64_t n = numel[l];")
        for k, d in enumerate(in_dtypes):
            t = _storage(d)
            lines.append(f"    const {t} *p{k} = (const {t} *)ptr[l * {stride} + {k}];")
        for j, d in enumerate(out_dtypes):
            t = _storage(d)
            lines.append(f"    {t} *q{j} = ({t} *)ptr[l * {stride} + {nin + j}];")
        if sumsq:
            lines.append(f"    double *r = (double *)ptr[l * {stride} + {nin + nout}];")
            lines.append("    ft_sq sq;")
            lines.append("    ft_sq_init(&sq);")
            lines.append("    if (n == 0) *r = 0.0;")
        if sum_in is not None:  # (the input's, in a second accumulator)
            lines.append(f"    double *r1 = (double *)ptr[l * {stride} + {nin + nout + 1}];")
            lines.append("    ft_sq sq1;")
            lines.append("    ft_sq_init(&sq1);")
            lines.append("    if (n == 0) *r1 = 0.0;")
        for k in range(first_per_leaf, nin):  # the leaf's own values, then what they give
            if per_element[k]:
                continue
            d = in_dtypes[k]
            x = _LOAD[d].format(x=f"*p{k}") if d in _HALF else f"*p{k}"
            lines.append(f"    const {_CTYPE[compute_dtype(d)]} x{k} = {x};")
        lines += ["    " + x for x in self.mid]

        def loop(count: str, index: str, dst: str, indent: str) -> list:
            out = [indent + "#pragma omp simd"]
            out.append(f"{indent}for (int64_t i = 0; i < {count}; i++) {{")
            for k, d in enumerate(in_dtypes):
                if not per_element[k]:
                    continue
                x = f"p{k}[{index}]"
                x = _LOAD[d].format(x=x) if d in _HALF else x
                out.append(f"{indent}  const {_CTYPE[compute_dtype(d)]} x{k} = {x};")
            out += [f"{indent}  {x}" for x in self.body]
            for j, (o, d) in enumerate(zip(outputs, out_dtypes)):
                x = self.val(o, d)
                x = _STORE[d].format(x=x) if d in _HALF else x
                out.append(f"{indent}  {dst.format(j=j)}[i] = {x};")
            out.append(f"{indent}}}")
            return out

        sq = _SUMSQ.get(out_dtypes[0]) if sumsq else None

        def summed(block: str) -> list:
            # (the block's whole chunks of 16, and where it is the leaf's last, the rest)
            out = [
                f"      ft_sq_chunks_{sq}(&sq, {block}, m);",
                f"      if (i0 + m == n) *r = ft_sq_end_{sq}(&sq, {block} + (m & ~(int64_t)15),"
                " m & 15);",
            ]
            if sum_in is not None:
                t, x = _SUMSQ[in_dtypes[sum_in]], f"p{sum_in} + i0"
                out += [
                    f"      ft_sq_chunks_{t}(&sq1, {x}, m);",
                    f"      if (i0 + m == n) *r1 = ft_sq_end_{t}(&sq1, {x} + (m & ~(int64_t)15),"
                    " m & 15);",
                ]
            return out

        # the leaf's loop, once per combination of the flags the body selects by (at most
        # MAX_SWITCHES of them; see unswitched). One loop over blocks serves both stores:
        # ordinary stores write the results in place (one block of the whole leaf, or of
        # FT_BLOCK where the block's squares are summed while it is in L1); streamed ones
        # compute each block into a buffer in L1, then write it out with non-temporal stores
        # (no read of the destination's lines: see ft_stream). (Two loops, one per kind of
        # store, had the C compiler vectorise the body twice: the sweep's 430 stages took 53 s
        # to build, 45 s with one loop.)
        head, lines = lines, []
        block = "FT_BLOCK" if sq is not None else "(stream ? FT_BLOCK : n)"
        lines.append(f"    const int64_t bs = {block};")
        lines.append("    for (int64_t i0 = 0; i0 < n; i0 += bs) {")
        lines.append("      const int64_t m = n - i0 < bs ? n - i0 : bs;")
        for j, d in enumerate(out_dtypes):
            t = _storage(d)
            lines.append(f"      {t} *d{j} = stream ? b{j} : q{j} + i0;")
        lines += loop("m", "i0 + i", "d{j}", "      ")
        if sq is not None:
            lines += summed("d0")
        if nout:
            lines.append("      if (stream) {")
            for j in range(nout):
                lines.append(f"        ft_stream(q{j} + i0, b{j}, m * (int64_t)sizeof(*q{j}));")
            lines.append("      }")
        lines.append("    }")
        switches = list(self.switches.items())
        lines = head + unswitched(lines, switches if len(switches) <= MAX_SWITCHES else [])
        lines += ["  }", "  if (stream) FT_FENCE();", "}"]
        return "\n".join(lines) + "\n", [in_dtypes, out_dtypes]

    def enter(self, node, args, vec: bool) -> None:
        # a value from scalars and per-leaf values only: computed once per leaf
        self.leafy_now = not vec and any(
            isinstance(a, torch.fx.Node) and a in self.leafy for a in (*args, *node.kwargs.values())
        )

    # the C dialect of :class:`Lowering`
    def fma(self, a: str, b: str, c: str) -> str:
        return f"FT_FMA({a}, {b}, {c})"

    def binary(self, op: str, a: str, b: str, dtype) -> str:
        return BINARY[op].format(a=a, b=b)

    def unary(self, op: str, a: str, dtype) -> str:
        if op == "rsqrt":
            return f"(({_CTYPE[dtype]})1 / FT_SQRT({a}))"
        if op == "isfinite":
            return f"(({a} - {a}) == ({a} - {a}))"
        return _UNARY[op].format(a=a, t=_CTYPE[dtype])

    def one(self, dtype) -> str:
        return f"({_CTYPE[dtype]})1"

    def to_half(self, x: str, dtype) -> str:
        return _LOAD[dtype].format(x=_STORE[dtype].format(x=x))

    def pow_scalar(self, a: str, b: str, dtype) -> str:
        return f"{'pow' if dtype == torch.float64 else 'powf'}({a}, {b})"

    def where(self, cond_arg, c: str, a: str, b: str, dtype, vec: bool) -> str:
        if vec and not self.is_vec(cond_arg) and isinstance(cond_arg, torch.fx.Node):
            if c == self.names.get(cond_arg):  # (a flag's value, by name: see source)
                self.switches.setdefault(c, _CTYPE[self.dtypes[cond_arg]])
        return self.select(cond_arg, c, a, b, dtype, vec)

    def lerp_pick(self, small: str, w: str, dtype) -> str:
        return f"({small} ? {w} : {w} - {self.one(dtype)})"


def common_dtype(args) -> torch.dtype:
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    return torch.result_type(*vals) if len(vals) == 2 else vals[0].dtype


TRACE_NUMEL = 3  # the leaves a stage is traced on: 1-D, of this many elements


class _Recorder(TorchDispatchMode):
    """Records the ATen operations a stage runs on small real CPU tensors into an FX graph:
    one ``call_function`` node per operation, ``meta["val"]`` a meta tensor of its result's
    dtype and shape (what the writers read). The operations are those ``make_fx`` records:
    the ones that reach the Python dispatch key, a composite one decomposed there as autograd
    would have (where it arrives whole: inside a custom operator), at a tenth of its cost
    (no proxies, no fake tensors). A tensor no operation of the trace made (a constant the
    stage captured), an operation on a Python value of a tensor (a host read, ``bool()``),
    or a result that is not one tensor is :class:`Unsupported`. Results are held by weak
    references: torch's binding hands a factory's result back detached (one more operation)
    where the mode still holds it."""

    def __init__(self, graph: torch.fx.Graph):
        super().__init__()
        self.graph = graph
        self.nodes: dict[int, tuple[weakref.ref, torch.fx.Node]] = {}

    def add(self, x: torch.Tensor, node: torch.fx.Node) -> None:
        node.meta["val"] = torch.empty(x.shape, dtype=x.dtype, device="meta")
        self.nodes[id(x)] = (weakref.ref(x), node)

    def node(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        got = self.nodes.get(id(x))
        if got is None or got[0]() is not x:
            raise Unsupported("a tensor the stage did not compute from its inputs")
        return got[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (a composite operation that reaches this key without autograd's decomposition, as
        # inside a custom operator: decomposed here, as make_fx does)
        if autograd_would_have_decomposed(func, optree.tree_leaves((args, kwargs))):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        node_args = optree.tree_map(self.node, args, none_is_leaf=True)
        node_kwargs = optree.tree_map(self.node, kwargs, none_is_leaf=True)
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise Unsupported(f"{func}: a result that is not one tensor")
        self.add(out, self.graph.call_function(func, node_args, node_kwargs))
        return out


def trace(
    fn: Callable, in_dtypes, scalar_dtypes, n_per_leaf: int, vectors: tuple = ()
) -> torch.fx.Graph:
    """The graph of ATen operations ``fn`` runs (:class:`_Recorder`): its placeholders the
    inputs (leaf-shaped ones 1-D of :data:`TRACE_NUMEL` elements, per-leaf ones 0-dim unless
    ``vectors`` marks them), then the scalars (0-dim); its output the results."""
    first_per_leaf = len(in_dtypes) - n_per_leaf
    vectors = tuple(vectors) or (False,) * n_per_leaf
    graph = torch.fx.Graph()
    rec = _Recorder(graph)
    args = []
    for k, d in enumerate((*in_dtypes, *scalar_dtypes)):
        vec = k < first_per_leaf or (k < len(in_dtypes) and vectors[k - first_per_leaf])
        x = torch.zeros(TRACE_NUMEL, dtype=d) if vec else torch.ones((), dtype=d)
        rec.add(x, graph.placeholder(f"a{k}"))
        args.append(x)
    n = len(in_dtypes)
    with torch.no_grad(), rec:
        outs = tuple(fn(tuple(args[:n]), tuple(args[n:])))
    graph.output(tuple(rec.node(o) for o in outs))
    return graph


_ADD = torch.ops.aten.add.Tensor
_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.clone.default)


def exact_foreach(graph: torch.fx.Graph, in_dtypes: tuple, n_per_leaf: int = 0) -> tuple | None:
    """Whether a traced stage (:func:`trace`) is exactly one of torch's foreach operations:
    ``("add", i, j)`` where its one result is ``a_i + a_j`` (two leaf-shaped inputs of one
    dtype, no ``alpha``: ``torch._foreach_add_``), ``("copy", i)`` where it is ``a_i`` as it
    is or copied to its own dtype (``torch._foreach_copy_``); ``None`` otherwise. The
    accumulation of a ``multi_steps`` micro-step, and the copy that starts a cycle, are such
    stages."""
    first_per_leaf = len(in_dtypes) - n_per_leaf
    places: dict[torch.fx.Node, int] = {}
    calls = []
    out = None
    for node in graph.nodes:
        if node.op == "placeholder":
            places[node] = len(places)
        elif node.op == "call_function":
            calls.append(node)
        elif node.op == "output":
            out = node.args[0]
        else:
            return None
    if not isinstance(out, tuple) or len(out) != 1 or len(calls) > 1:
        return None

    def leaf_input(arg) -> int | None:
        k = places.get(arg) if isinstance(arg, torch.fx.Node) else None
        return k if k is not None and k < first_per_leaf else None

    res = out[0]
    if not calls:
        i = leaf_input(res)
        return None if i is None else ("copy", i)
    node = calls[0]
    if res is not node:
        return None
    if node.target in _COPIES and len(node.args) == 1:
        i = leaf_input(node.args[0])
        kwargs = dict(node.kwargs)
        if i is None or kwargs.pop("dtype", in_dtypes[i]) != in_dtypes[i]:
            return None
        kwargs.pop("memory_format", None)  # (a copy of its values, whatever its strides)
        return ("copy", i) if not kwargs else None
    if node.target is _ADD and len(node.args) == 2 and not node.kwargs:
        i, j = map(leaf_input, node.args)
        if i is None or j is None or in_dtypes[i] != in_dtypes[j]:
            return None
        return ("add", i, j)
    return None


class ForeachKernel:
    """A stage that is exactly one foreach operation (:func:`exact_foreach`), called like
    :class:`Kernel` on lists of leaves: ``torch._foreach_add_`` where the result list is one
    of the two it adds (a donated step: the sum written over that input), ``torch.
    _foreach_copy_`` for a copy; any other call (fresh results of a sum) runs ``inner()``,
    the generated kernel, made on first use. On CUDA, where a call of the generated kernel
    builds and copies an address table and goes through Triton's launcher, torch's foreach
    operation takes a few kernel arguments instead (session 69 measured that launch at about
    0.28 ms of host time per ``multi_steps`` micro-step on the lent GPU's host, torch's
    ``_foreach_add_`` of the same tree at 0.06 ms)."""

    __slots__ = ("op", "out_dtypes", "_inner", "_make_inner")
    sumsq = False
    sum_in = None
    n_sums = 0

    def __init__(self, op: tuple, in_dtypes: tuple, make_inner: Callable[[], Any]):
        self.op = op
        self.out_dtypes = (in_dtypes[op[1]],)
        self._inner = None
        self._make_inner = make_inner

    def inner(self):
        if self._inner is None:
            self._inner = self._make_inner()
        return self._inner

    def __call__(self, inputs, outputs, scalars, fresh: bool = False, sums=None):
        out = outputs[0]
        if self.op[0] == "copy":
            src = inputs[self.op[1]]
            if out is not src:
                torch._foreach_copy_(out, src)
            return True
        a, b = inputs[self.op[1]], inputs[self.op[2]]
        if out is a or out is b:  # (a + b == b + a: IEEE addition commutes)
            torch._foreach_add_(out, b if out is a else a)
            return True
        return self.inner()(inputs, outputs, scalars, fresh=fresh)

    def by_rows(self, inputs, outputs, scalars, kinds, fresh: bool = False):
        return self.inner().by_rows(inputs, outputs, scalars, kinds, fresh=fresh)

    def results(self, inputs) -> list | None:
        """The stage's results in new tensors that torch's foreach operation makes itself
        (``torch._foreach_add``: a sum; on CUDA from the caching allocator), for a call whose
        results are fresh: ``[results]``, or ``None`` for a copy (made into buffers given)."""
        if self.op[0] != "add":
            return None
        return [torch._foreach_add(inputs[self.op[1]], inputs[self.op[2]])]


def _build(source: str) -> ctypes.CDLL:
    path = native.build_library(source.encode(), "stage", _CFLAGS)
    return ctypes.CDLL(str(path))


class Kernel:
    """A stage compiled for one signature: call it with per-leaf pointers. ``sumsq``: it also
    gives each leaf's sum of squares of its first result, and with ``sum_in`` those of that
    input after them (see :meth:`_Writer.source`); ``n_sums``: how many per leaf."""

    __slots__ = (
        "fn",
        "n_inputs",
        "n_outputs",
        "out_dtypes",
        "source",
        "sumsq",
        "sum_in",
        "n_sums",
        "_lib",
    )

    def __init__(
        self,
        fn: Callable,
        in_dtypes,
        scalar_dtypes,
        n_per_leaf: int = 0,
        sumsq: bool = False,
        vectors: tuple = (),
        sum_in: int | None = None,
    ):
        graph = trace(fn, in_dtypes, scalar_dtypes, n_per_leaf, vectors)
        w = _Writer(graph, len(in_dtypes), len(scalar_dtypes), n_per_leaf, vectors)
        self.source, (_, out_dtypes) = w.source("ft_stage", sumsq, sum_in)
        self.sumsq = sumsq
        self.sum_in = sum_in
        self.n_sums = int(sumsq) + (sum_in is not None)
        self.n_inputs = len(in_dtypes)
        self.n_outputs = len(out_dtypes)
        self.out_dtypes = out_dtypes
        self._lib = _build(self.source)
        f = self._lib.ft_stage
        f.restype = None
        f.argtypes = [
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
        ]
        self.fn = f

    def __call__(
        self,
        inputs: Sequence[Sequence[torch.Tensor]],
        outputs,
        scalars,
        fresh: bool = False,
        sums: torch.Tensor | None = None,
    ) -> None:
        """Run on the leaves of ``inputs`` (per input, a list of contiguous CPU tensors of the
        kernel's dtypes; equal sizes leaf by leaf), writing ``outputs`` (per result, a list of
        tensors of those sizes; a result may be its input's tensor: in place). ``scalars``:
        the addresses of the scalars' values (:func:`scalar_pointers`). ``fresh``: no result
        is an input; where the results then hold :data:`STREAM_MIN_BYTES` or more they are
        written with non-temporal stores (a block at a time from a buffer in L1: the
        destination's lines are not read first, which an ordinary store into memory the
        caches do not hold does; a step this small stays in the caches, where they are).
        ``sums``: for a ``sumsq`` kernel, a contiguous float64 CPU tensor of :attr:`n_sums`
        elements per leaf (the results' sums, leaf after leaf, then the ``sum_in`` input's),
        written (required there, refused elsewhere)."""
        n = len(inputs[0])
        roles = list(inputs) + list(outputs)
        if (sums is not None) != self.sumsq:
            raise ValueError("a sumsq kernel takes sums, and only it")
        # (the results' addresses first, for writing: a copy-on-write result, a lazy clone,
        # gets its own memory there; then the inputs', for reading: a lazy clone is read
        # where it lies, not copied)
        n_in = len(inputs)
        if n == 1 and sums is None:  # (per-leaf steps: a call per leaf)
            outs = [lst[0].data_ptr() for lst in outputs]
            ptrs = array.array("q", [const_data_ptr(lst[0]) for lst in inputs] + outs)
            numel = array.array("q", [inputs[0][0].numel()])
        else:
            k = self.n_sums
            width = len(roles) + k
            ptrs = array.array("q", [0]) * (n * width)
            taken: dict = {}  # (id of a list whose addresses are in: its column)
            for r in range(len(roles) - 1, -1, -1):
                column = taken.get(id(roles[r]))
                if column is not None:  # (an input written in place: its result's list)
                    ptrs[r::width] = ptrs[column::width]
                    continue
                addr = const_data_ptr if r < n_in else _PTR
                ptrs[r::width] = array.array("q", map(addr, roles[r]))
                taken[id(roles[r])] = r
            if sums is not None:
                assert sums.dtype == torch.float64 and sums.numel() == n * k
                assert sums.is_contiguous()
                for j in range(k):
                    base = sums.data_ptr() + 8 * n * j
                    ptrs[len(roles) + j :: width] = array.array("q", range(base, base + 8 * n, 8))
            numel = array.array("q", map(torch.Tensor.numel, inputs[0]))
        stream = fresh and sum(numel) * sum(d.itemsize for d in self.out_dtypes) >= STREAM_MIN_BYTES
        self.fn(n, numel.buffer_info()[0], ptrs.buffer_info()[0], scalars.buffer_info()[0], stream)

    def by_rows(self, inputs, outputs, scalars, kinds: Sequence[str], fresh: bool = False) -> None:
        """Run on the leaves of ``inputs`` row by row: each row of each leaf (its last dim;
        a leaf of fewer than 2 dims is one row) is one "leaf" of the call, so that values
        broadcast over a leaf's rows or columns are read as the kernel reads per-leaf and
        leaf-shaped inputs. ``kinds``, per input: ``"v"`` leaf-shaped (a row's elements),
        ``"s"`` one value for the leaf (0-dim or one element), ``"r"`` one value per row
        (shape ``(..., n, 1)``: a per-leaf input here), ``"c"`` one value per column (shape
        ``(..., 1, m)``: read per element, the row's batch's). The kernel is built with
        ``vectors`` marking the per-leaf inputs of kind ``"c"`` or ``"v"``. The pointer table
        is made by tensor arithmetic, a row per row of the leaves."""
        leaves = inputs[0]
        shapes = [x.shape for x in leaves]
        width = [s[-1] if len(s) >= 1 else 1 for s in shapes]
        height = [s[-2] if len(s) >= 2 else 1 for s in shapes]
        rows = [x.numel() // m if m else 0 for x, m in zip(leaves, width)]
        total = sum(rows)
        if total == 0:
            return
        counts = torch.tensor(rows, dtype=torch.int64)
        of_row = torch.repeat_interleave(torch.arange(len(leaves)), counts)
        starts = torch.cumsum(counts, 0) - counts
        r = torch.arange(total) - starts[of_row]  # each row's index in its leaf
        m = torch.tensor(width, dtype=torch.int64)[of_row]
        n = torch.tensor(height, dtype=torch.int64)[of_row]
        roles = [(lst, kind, const_data_ptr) for lst, kind in zip(inputs, kinds)]
        roles += [(lst, "v", _PTR) for lst in outputs]
        table = torch.empty((total, len(roles)), dtype=torch.int64)
        for k, (lst, kind, addr) in enumerate(roles):
            base = torch.tensor([addr(x) for x in lst], dtype=torch.int64)[of_row]
            size = lst[0].element_size()
            if kind == "v":
                table[:, k] = base + r * m * size
            elif kind == "r":
                table[:, k] = base + r * size
            elif kind == "c":
                table[:, k] = base + torch.div(r, n, rounding_mode="floor") * m * size
            else:
                table[:, k] = base
        numel = m.contiguous()
        elements = sum(x.numel() for x in leaves)
        stream = fresh and elements * sum(d.itemsize for d in self.out_dtypes) >= STREAM_MIN_BYTES
        self.fn(total, numel.data_ptr(), table.data_ptr(), scalars.buffer_info()[0], stream)


_PTR: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr


def scalar_pointers(scalars: Sequence, device: torch.device | None = None) -> tuple | None:
    """``(addresses, dtypes, keep)`` for a kernel call: the address of each scalar's value (a
    0-dim CPU tensor's own memory, read by the kernel: no host read in Python; a Python number
    copied into a float64 buffer) and its dtype for the kernel's signature; ``keep`` holds
    what must stay alive through the call. ``None`` where a scalar cannot be read so (a tensor
    on another device, of more than one element, or one autograd records). For the kernels of
    a CUDA ``device``: :func:`.fuse_triton.scalar_slots`."""
    if device is not None and device.type != "cpu":
        from . import fuse_triton

        return fuse_triton.scalar_slots(scalars, device)
    addrs = array.array("q", [0]) * max(len(scalars), 1)
    dtypes = []
    numbers = array.array("d", [0.0]) * max(len(scalars), 1)
    keep: list = [numbers]
    for k, x in enumerate(scalars):
        if isinstance(x, torch.Tensor):
            if (
                type(x) is not torch.Tensor
                or not x.is_cpu
                or x.numel() != 1
                or x.requires_grad
                or x.dtype not in _CTYPE
            ):
                return None
            if not x.is_contiguous():
                x = x.contiguous()
            keep.append(x)
            addrs[k] = const_data_ptr(x)
            dtypes.append(x.dtype)
        else:
            numbers[k] = float(x)
            addrs[k] = numbers.buffer_info()[0] + 8 * k
            dtypes.append(torch.float64)
    keep.append(addrs)
    return addrs, tuple(dtypes), keep


def kernel_for(
    fn: Callable,
    in_dtypes: tuple,
    scalar_dtypes: tuple,
    n_per_leaf: int = 0,
    device_type: str = "cpu",
    sumsq: bool = False,
    vectors: tuple = (),
    sum_in: int | None = None,
) -> Kernel | TritonKernel | ForeachKernel | None:
    """The compiled kernel of ``fn`` for these dtypes, or ``None`` where it cannot be generated
    (an unsupported operation or dtype, no compiler). ``n_per_leaf``: the last inputs hold one
    value per leaf (a 0-dim tensor each: a trust ratio), read once per leaf. ``device_type``
    ``"cuda"``: a :class:`.fuse_triton.TritonKernel` (``scalar_dtypes``: the kinds of
    :func:`.fuse_triton.scalar_slots`). ``sumsq``: a CPU kernel that also sums each leaf's
    squares of its first result (``None`` where it cannot: a result not float32 or float64,
    CUDA); ``sum_in``: with ``sumsq``, the sums of that input's squares too (see
    :meth:`_Writer.source`; ``None`` where it cannot). ``vectors``: per per-leaf input,
    whether it is read per element after all (a value per column, for
    :meth:`Kernel.by_rows`; on CUDA any makes a kernel that reads every per-leaf input per
    element, :meth:`.fuse_triton.TritonKernel.by_rows`)."""
    if sumsq and device_type != "cpu":
        return None
    key = (fn, in_dtypes, scalar_dtypes, n_per_leaf, device_type, sumsq, tuple(vectors), sum_in)
    k = _kernels.get(key, _MISSING)
    if k is not _MISSING:
        return k
    with _lock:
        k = _kernels.get(key, _MISSING)
        if k is not _MISSING:
            return k
        try:
            if device_type == "cpu":
                k = Kernel(fn, in_dtypes, scalar_dtypes, n_per_leaf, sumsq, vectors, sum_in)
            else:
                from .fuse_triton import TritonKernel

                def triton() -> TritonKernel:
                    return TritonKernel(fn, in_dtypes, scalar_dtypes, n_per_leaf, any(vectors))

                exact = None
                if not n_per_leaf and not any(vectors):  # (torch's own, where it is exactly one)
                    # (scalar_dtypes: scalar_slots' kinds here, (dtype, by address) each)
                    graph = trace(fn, in_dtypes, tuple(d for d, _ in scalar_dtypes), n_per_leaf)
                    exact = exact_foreach(graph, in_dtypes, n_per_leaf)
                k = triton() if exact is None else ForeachKernel(exact, in_dtypes, triton)
        except Unsupported as e:
            if DEBUG:
                warnings.warn(f"functional_train: a stage runs leaf by leaf: {e}", stacklevel=3)
            k = None
        except native.CompileError as e:  # the generated source did not compile: a bug here
            warnings.warn(
                f"functional_train: a fused stage runs leaf by leaf, its generated C did not "
                f"compile ({e})",
                RuntimeWarning,
                stacklevel=3,
            )
            k = None
        except Exception as e:  # no compiler, a read-only cache directory
            if not _warned:
                warnings.warn(
                    f"functional_train: a fused stage could not be built and runs leaf by leaf "
                    f"({type(e).__name__}: {e}); stages built later are tried again",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _warned.append(True)
            k = None
        _kernels[key] = k
    return k


_MISSING = object()
