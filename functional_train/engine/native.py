"""Out-of-place Adam / AdamW and SGD steps in C with streaming stores, for the pure ``ft.step``
on float32 and float64 CPU tensors; and the sums of squares of a gradient clip's norm
(:func:`sum_squares`).

A pure step (``ft.step(..., donate=False)``) writes new parameters and moments into fresh
buffers. On CPU an ordinary store first reads the destination's cache line from memory (write
allocate), so an out-of-place Adam step moves about 40 bytes per float32 parameter where torch's
in-place ``_fused_adamw_`` moves 28, and neither torch nor inductor generates a kernel that
avoids it. x86's non-temporal stores (``_mm256_stream_ps``; Intel's optimization reference
manual, "non-temporal stores") write whole lines without reading them. ``_kernels.c`` (next
to this file) runs each leaf in one pass on 256-bit vectors (AVX2 with FMA) and streams the
results; elsewhere it is a plain C loop (no streaming). Its arithmetic is the primitives'
(:func:`~functional_train.scale_by_adam`, ``add_decayed_weights``,
:func:`~functional_train.trace`, the learning rate) with fused multiply-adds and the bias
corrections as reciprocals (one division and one square root per element, as torch's fused
kernel), so it equals them to float rounding, not bit for bit; each element is computed alone
with correctly rounded operations, so a slice of a leaf gives bit for bit what the whole leaf
gives, split across threads or not, streamed or not.

The source is compiled on first use with the system C compiler (``$CC``, else ``cc``, else
Python's; ``-O3 -march=native -ffp-contract=off``) into ``$FT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/functional_train``, else ``~/.cache/functional_train``) under a name keyed
by the source, the compiler, the flags and the CPU: about 2 s, once per machine; later
processes load the cached library. Where that fails (no compiler, a read-only cache) it warns
once and the pure step takes the inductor kernels (:mod:`.kernels`) or the copy + in-place
path. ``FT_NATIVE_KERNELS=0`` in the environment, or ``ENABLED = False`` here, turns it off.

Calls release the GIL (ctypes). A call of at least :data:`PARALLEL_MIN_NUMEL` elements is cut
into ``torch.get_num_threads()`` parts of whole 1024-element blocks run on a thread pool; its
results are streamed when they hold at least :data:`STREAM_MIN_BYTES`.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import operator
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "ENABLED",
    "STREAM_MIN_BYTES",
    "PARALLEL_MIN_NUMEL",
    "available",
    "adam",
    "sgd",
    "sum_squares",
    "sum_squares_op",
]

ENABLED = os.environ.get("FT_NATIVE_KERNELS", "1") != "0"
# results' bytes in one call below which ordinary stores are used: a step this small stays in
# the caches, where the lines a store reads are already there and the next step reads them
STREAM_MIN_BYTES = 8 * 2**20
PARALLEL_MIN_NUMEL = 2**20  # elements in one call below which it runs on the calling thread
_BLOCK = 1024  # parts split leaves at multiples of this many elements (64-byte aligned)
_VERSION = 5

_SOURCE = Path(__file__).with_name("_kernels.c")
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_DTYPES = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}
_RESULTS = {"adam": 5, "sgd": 3}  # per kernel: its first result's pointer (inputs first)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None
_pool_key: tuple = ()  # (workers, pid) of _pool


def _cache_dir() -> Path:
    d = os.environ.get("FT_CACHE_DIR")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "functional_train"


def _cpu() -> str:
    """The CPU's model and feature flags (``-march=native`` code runs only where they match)."""
    seen = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features") and key not in seen:
                    seen[key] = val.strip()
    except OSError:
        pass
    return platform.machine() + "|" + "|".join(f"{k}={v}" for k, v in sorted(seen.items()))


def _compiler() -> str:
    """``$CC`` if set, else the first of ``cc`` and Python's own compiler found on the PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    for cc in ("cc", sysconfig.get_config_var("CC") or "gcc"):
        if shutil.which(cc.split()[0]):
            return cc
    return "cc"


class CompileError(RuntimeError):
    """The C compiler rejected a source."""


def build_library(source: bytes, prefix: str, flags: list) -> Path:
    """The shared library of the C ``source`` compiled with ``flags``: built on first use with
    the system compiler (:func:`_compiler`) into the cache directory (:func:`_cache_dir`)
    under ``<prefix>-<key>.so``, ``key`` a hash of the source, the compiler, the flags and the
    CPU; later calls and processes reuse the file.

    Raises:
        CompileError: the compiler rejected the source.
        OSError: no compiler, an unwritable cache directory.
    """
    cc = _compiler()
    key = hashlib.sha256(
        b"\0".join([source, cc.encode(), " ".join(flags).encode(), _cpu().encode()])
    ).hexdigest()[:24]
    path = _cache_dir() / f"{prefix}-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # private names, then an atomic rename: concurrent processes (ranks) may build it too
    fd, src = tempfile.mkstemp(suffix=".c", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(source)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        res = subprocess.run(
            cc.split() + flags + ["-o", tmp, src, "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            raise CompileError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        for f in (tmp, src):
            if os.path.exists(f):
                os.unlink(f)
    return path


def _build() -> ctypes.CDLL:
    path = build_library(_SOURCE.read_bytes(), "kernels", _CFLAGS)
    lib = ctypes.CDLL(str(path))
    if lib.ft_version() != _VERSION:
        raise RuntimeError(f"{path} is not version {_VERSION} of the kernels")
    for suf, scalar in _DTYPES.values():
        for kind in _RESULTS:
            fn = getattr(lib, f"ft_{kind}_{suf}")
            fn.restype = None
            fn.argtypes = [
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.POINTER(scalar),
                ctypes.c_int,
                ctypes.c_int,
            ]
        fn = getattr(lib, f"ft_sumsq_{suf}")
        fn.restype = None
        fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _build()
                except Exception as e:  # no compiler, a read-only cache directory...
                    warnings.warn(
                        f"functional_train: the native out-of-place optimizer kernels "
                        f"are off for this process ({type(e).__name__}: {e})",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                _tried = True
    return _lib


def available(dtype: torch.dtype) -> bool:
    """Whether :func:`adam` and :func:`sgd` run for leaves of ``dtype`` (building the library
    on the first call)."""
    return ENABLED and dtype in _DTYPES and _library() is not None


def _parts(numel: Sequence[int], n: int) -> list:
    """``numel`` (leaf sizes) cut into ``n`` runs of about equal elements, as lists of
    ``(leaf, start, count)``, each start a multiple of :data:`_BLOCK` in its leaf."""
    total = sum(numel)
    target = -(-total // n)
    parts, cur, size = [], [], 0
    for k, m in enumerate(numel):
        a = 0
        while a < m:
            c = m - a
            if len(parts) < n - 1 and c > target - size:  # cut, rounded up to a block
                c = min(c, -(-(target - size) // _BLOCK) * _BLOCK)
            cur.append((k, a, c))
            size += c
            a += c
            if size >= target and len(parts) < n - 1:
                parts.append(cur)
                cur, size = [], 0
    if cur:
        parts.append(cur)
    return parts


def _executor(n: int) -> ThreadPoolExecutor:
    """The thread pool of ``n`` workers; a new one after a change of ``n`` or a ``fork`` (a
    forked child inherits the pool object but none of its threads)."""
    global _pool, _pool_key
    key = (n, os.getpid())
    if _pool is None or _pool_key != key:
        if _pool is not None and _pool_key[1] == key[1]:
            _pool.shutdown(wait=False)
        _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="ft-native")
        _pool_key = key
    return _pool


def _run(fn, ptrs, numel, s, flags, stream) -> None:
    """``fn`` on the leaves whose pointers are ``ptrs`` (per role, a list of addresses or
    ``None``) and sizes ``numel``."""
    arrays = [None if P is None else array.array("q", P) for P in ptrs]  # kept alive to the end
    roles = (ctypes.c_void_p * len(arrays))(
        *[None if a is None else a.buffer_info()[0] for a in arrays]
    )
    count = array.array("q", numel)
    fn(len(numel), roles, count.buffer_info()[0], s, flags, stream)


def _call(
    kind: str,
    lists: Sequence[Sequence[torch.Tensor] | None],
    scalars: Sequence[float],
    flags: int,
    checked: bool,
) -> bool:
    """Run ``ft_<kind>_<dtype>`` on the leaves of ``lists`` (the kernel's pointers in order:
    per pointer a list with a tensor per leaf, or ``None`` where unused); ``False`` (nothing
    written) where the leaves are not plain contiguous CPU tensors of one dtype and equal
    sizes (unless ``checked``: the caller has made sure of it), or the library is
    unavailable."""
    first = lists[0]
    if not first:
        return True
    dtype = first[0].dtype
    if not available(dtype):
        return False
    n = len(first)
    numel = list(map(torch.Tensor.numel, first))
    # under a dispatch mode (count_collectives, simulated ranks) the leaves are checked to be
    # plain tensors whatever the caller vouches: real ones run here as outside any mode
    for L in () if checked and _get_current_dispatch_mode() is None else lists:
        if L is None:
            continue
        if (
            len(L) != n
            or list(map(torch.Tensor.numel, L)) != numel
            or not all(map(torch.Tensor.is_contiguous, L))
            or not all(type(x) is torch.Tensor and x.dtype == dtype and x.is_cpu for x in L)
        ):
            return False
    ptrs = [None if L is None else list(map(torch.Tensor.data_ptr, L)) for L in lists]
    suf, scalar = _DTYPES[dtype]
    fn = getattr(_lib, f"ft_{kind}_{suf}")
    s = (scalar * len(scalars))(*scalars)
    total, size = sum(numel), first[0].element_size()
    results = sum(L is not None for L in lists[_RESULTS[kind] :])
    stream = int(total * size * results >= STREAM_MIN_BYTES)
    threads = torch.get_num_threads() if total >= PARALLEL_MIN_NUMEL else 1
    if threads <= 1:
        _run(fn, ptrs, numel, s, flags, stream)
        return True
    jobs = [
        (
            [None if P is None else [P[k] + a * size for k, a, _ in part] for P in ptrs],
            [c for _, _, c in part],
        )
        for part in _parts(numel, threads)
    ]

    def run(job):
        _run(fn, job[0], job[1], s, flags, stream)

    done = [_executor(len(jobs) - 1).submit(run, job) for job in jobs[1:]]
    run(jobs[0])
    for f in done:
        f.result()
    return True


def adam(
    p,
    g,
    m,
    v,
    nm,
    new_p,
    new_m,
    new_v,
    new_nm,
    *,
    coef: float,
    weight_decay: float,
    b1: float,
    b2: float,
    eps: float,
    bc1: float,
    bc2_sqrt: float,
    lr: float,
    decoupled: bool,
    amsgrad: bool,
    checked: bool = False,
) -> bool:
    """One out-of-place Adam / AdamW step on lists of leaves (contiguous CPU tensors of one
    dtype, float32 or float64, any shapes, equal sizes leaf by leaf; ``nm``, ``new_nm`` the
    amsgrad maxima, else ``None``): ``coef`` the gradient's scale (the clip factor, negated to
    maximize), ``bc1 = 1 - b1^t`` and ``bc2_sqrt = sqrt(1 - b2^t)``; the scalars are rounded to
    the leaves' dtype. ``False`` (nothing written) where the native kernels are unavailable or
    the leaves do not qualify (``checked``: the caller vouches that they do)."""
    wd, ams = bool(weight_decay), bool(amsgrad)
    flags = (coef != 1.0) | (wd and not decoupled) << 1 | (wd and decoupled) << 2 | ams << 3
    return _call(
        "adam",
        [p, g, m, v, nm if ams else None, new_p, new_m, new_v, new_nm if ams else None],
        (coef, weight_decay, 1.0 - b1, b2, 1.0 - b2, eps, 1.0 / bc1, 1.0 / bc2_sqrt, lr),
        int(flags),
        checked,
    )


def sgd(
    p,
    g,
    buf,
    new_p,
    new_buf,
    *,
    coef: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    lr: float,
    checked: bool = False,
) -> bool:
    """One out-of-place SGD step (weight decay, then momentum -- dampening 0, Nesterov or not
    -- then the learning rate) on lists of leaves as :func:`adam`'s; ``buf``, ``new_buf`` the
    momentum buffers, ``None`` without momentum."""
    mom = bool(momentum)
    flags = (coef != 1.0) | bool(weight_decay) << 1 | mom << 2 | (mom and bool(nesterov)) << 3
    return _call(
        "sgd",
        [p, g, buf if mom else None, new_p, new_buf if mom else None],
        (coef, weight_decay, momentum, lr),
        int(flags),
        checked,
    )


def sum_squares(xs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The sum of squares of each of ``xs`` (plain CPU tensors, float32 or float64; a
    non-contiguous one is copied first), accumulated in float64: a float64 vector with an
    element per tensor, or ``None`` (nothing computed) where the native kernels are unavailable
    or a tensor does not qualify. A sum depends only on its tensor's values in their logical
    order, not on its strides or where it lies in memory (see ``ft_sumsq`` in
    ``_kernels.c``), nor on a dispatch mode (the tensors themselves must be plain). One call
    per dtype, on the calling thread."""
    if not xs or not all(type(x) is torch.Tensor and x.is_cpu for x in xs):
        return None
    dtypes = set(map(_DTYPE_OF, xs))
    if not dtypes <= _DTYPES.keys() or not all(map(available, dtypes)):
        return None
    if not all(map(torch.Tensor.is_contiguous, xs)):
        xs = [x.contiguous() for x in xs]  # (kept alive to the end of the call)
    out = torch.empty(len(xs), dtype=torch.float64)
    for dtype in dtypes:
        idx = (
            range(len(xs))
            if len(dtypes) == 1
            else [k for k, x in enumerate(xs) if x.dtype == dtype]
        )
        part = out if len(dtypes) == 1 else torch.empty(len(idx), dtype=torch.float64)
        ptrs = array.array("q", (xs[k].data_ptr() for k in idx))
        numel = array.array("q", (xs[k].numel() for k in idx))
        getattr(_lib, f"ft_sumsq_{_DTYPES[dtype][0]}")(
            len(idx), ptrs.buffer_info()[0], numel.buffer_info()[0], part.data_ptr()
        )
        if len(dtypes) > 1:
            out[list(idx)] = part
    return out


_DTYPE_OF = operator.attrgetter("dtype")


@torch.library.custom_op("functional_train::sum_squares", mutates_args=())
def sum_squares_op(xs: list[torch.Tensor]) -> torch.Tensor:
    """:func:`sum_squares` as an operator that ``torch.compile`` keeps opaque, so that a
    compiled gradient norm equals the eager one bit for bit. Where the native kernels do not
    run (no compiler), torch sums the squares in float64 instead (the same numbers to float64
    rounding)."""
    out = sum_squares(xs)
    if out is None:
        out = (
            torch.stack([x.double().square().sum() for x in xs])
            if xs
            else torch.zeros(0, dtype=torch.float64)
        )
    return out


@sum_squares_op.register_fake
def _(xs):
    return torch.empty(len(xs), dtype=torch.float64)
