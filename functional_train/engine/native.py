"""The sums of squares of a gradient clip's norm in C (:func:`sum_squares`), and the build of
C sources into shared libraries (:func:`build_library`; the generated stages of :mod:`.fuse`
use it too).

``_kernels.c`` (next to this file) sums each tensor's squares in float64 in 16 interleaved
lanes (256-bit vectors with AVX2 and FMA; elsewhere plain C, which the compiler vectorises as
it can), in an order that depends only on the tensor's length and is the same on every machine
with fused multiply-adds (``_sumsq.h``, which a generated stage uses too where it sums the
updates it writes). The source is compiled on first use with the system C compiler (``$CC``, else
``cc``, else Python's; ``-O3 -march=native -ffp-contract=off``) into ``$FT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/functional_train``, else ``~/.cache/functional_train``) under a name keyed
by the source, the compiler, the flags and the CPU, once per machine; later processes load the
cached library. Where that fails (no compiler, a read-only cache) it warns once and torch sums
the squares instead. ``FT_NATIVE_KERNELS=0`` in the environment, or ``ENABLED = False`` here,
turns it off. ``FT_SANITIZE=address`` builds it, and every generated stage, with
AddressSanitizer (:func:`sanitizer_flags`: a developer's check of the kernels' reads and writes).
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
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

from ..autograd import traced
from .pool import all_in_one_order, const_data_ptr, in_one_order

__all__ = [
    "ENABLED",
    "available",
    "build_library",
    "sanitizer_flags",
    "sum_squares",
    "sum_squares_op",
    "local_sum_squares",
]

ENABLED = os.environ.get("FT_NATIVE_KERNELS", "1") != "0"
_VERSION = 7

_SOURCE = Path(__file__).with_name("_kernels.c")
_SUMSQ_HEADER = Path(__file__).with_name("_sumsq.h")
_INCLUDE = '#include "_sumsq.h"'


def sumsq_header() -> str:
    """The C text of ``_sumsq.h``: the one definition of the clip's sums of squares (their
    order of additions), which ``_kernels.c`` and the generated stages of :mod:`.fuse`
    include (sources are compiled from text, so it is put in place of the ``#include``)."""
    return _SUMSQ_HEADER.read_text()


def _source() -> bytes:
    text = _SOURCE.read_text()
    assert _INCLUDE in text, "_kernels.c includes _sumsq.h"
    return text.replace(_INCLUDE, sumsq_header(), 1).encode()


_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_DTYPES = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
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


def sanitizer_flags() -> list:
    """The compiler flags ``FT_SANITIZE`` asks for: a comma-separated list of the compiler's
    sanitizers (``address``, ``undefined``, ...), given to ``-fsanitize=`` with ``-g`` and
    frame pointers kept, for every library :func:`build_library` builds (the native sums and
    the generated stages; the flags are part of a library's cache key, so sanitized and
    plain builds do not mix). A developer's check that the kernels read and write within
    their tensors: the process must load the sanitizer's runtime first (the README's "Tests"
    gives the command). Empty where it is unset.

    Raises:
        ValueError: ``FT_SANITIZE`` holds anything but names of letters, digits and ``-``,
            separated by commas.
    """
    value = os.environ.get("FT_SANITIZE", "").strip()
    if not value:
        return []
    names = value.split(",")
    if not all(n and n.replace("-", "").isalnum() for n in names):
        raise ValueError(
            f"FT_SANITIZE={value!r}: expected sanitizer names separated by commas, "
            "such as 'address' or 'address,undefined'"
        )
    return [f"-fsanitize={value}", "-fno-omit-frame-pointer", "-g"]


class CompileError(RuntimeError):
    """The C compiler rejected a source."""


def build_library(source: bytes, prefix: str, flags: list) -> Path:
    """The shared library of the C ``source`` compiled with ``flags``: built on first use with
    the system compiler (:func:`_compiler`) into the cache directory (:func:`cache_dir`)
    under ``<prefix>-<key>.so``, ``key`` a hash of the source, the compiler, the flags (with
    :func:`sanitizer_flags`' after them) and the CPU; later calls and processes reuse the
    file. Processes that ask for the same library at once (ranks, test workers) build it
    once: the others wait on a file lock beside it (``fcntl.flock``, where the platform has
    it).

    Raises:
        CompileError: the compiler rejected the source.
        OSError: no compiler, an unwritable cache directory.
        ValueError: a malformed ``FT_SANITIZE`` (:func:`sanitizer_flags`).
    """
    cc = _compiler()
    flags = [*flags, *sanitizer_flags()]
    key = hashlib.sha256(
        b"\0".join([source, cc.encode(), " ".join(flags).encode(), _cpu().encode()])
    ).hexdigest()[:24]
    path = cache_dir() / f"{prefix}-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # one build per library: concurrent processes (ranks, test workers) wait for the one that
    # holds the lock, then find its file. Every holder that finds the library in place removes
    # the lock file: a process that came after the builder removed it made a fresh one
    # (holders check for the library after taking the lock, so none builds twice)
    lock_path = path.with_suffix(".lock")
    with open(lock_path, "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            _compile(cc, source, flags, path)
        lock_path.unlink(missing_ok=True)
    return path


def _compile(cc: str, source: bytes, flags: list, path: Path) -> None:
    # private names, then an atomic rename (where no lock is available, concurrent builds
    # each write their own)
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


def _build() -> ctypes.CDLL:
    path = build_library(_source(), "kernels", _CFLAGS)
    lib = ctypes.CDLL(str(path))
    if lib.ft_version() != _VERSION:
        raise RuntimeError(f"{path} is not version {_VERSION} of the kernels")
    for suf, _ in _DTYPES.values():
        fn = getattr(lib, f"ft_sumsq_{suf}")
        fn.restype = None
        fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn = getattr(lib, f"ft_sumsq2_{suf}")
        fn.restype = None
        fn.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 4]
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
                        f"functional_train: the native sums of squares are off for this "
                        f"process ({type(e).__name__}: {e})",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                _tried = True
    return _lib


def available(dtype: torch.dtype) -> bool:
    """Whether :func:`sum_squares` runs for tensors of ``dtype`` (building the library on the
    first call)."""
    return ENABLED and dtype in _DTYPES and _library() is not None


_IS_CPU = operator.attrgetter("is_cpu")


def sum_squares(xs: Sequence[torch.Tensor], zeroed: bool = False) -> torch.Tensor | None:
    """The sum of squares of each of ``xs`` (plain CPU tensors, float32 or float64),
    accumulated in float64: a float64 vector with an element per tensor, or ``None`` (nothing
    computed) where the native kernels are unavailable or a tensor does not qualify. With
    ``zeroed``, twice as long: then, from the same read, each tensor's sum with its NaNs taken
    as zeros (``ft_sumsq2``: bit for bit the sum of squares of ``zero_nans``' result). Each
    tensor is read in its memory order: a contiguous one, and one dense in memory in another
    order (``channels_last`` convolution weights, a transposed matrix:
    :func:`.pool.in_one_order`) where it lies; one with gaps or overlaps (a slice) is copied
    first, contiguous, one at a time. So a sum depends only on its tensor's values in memory
    order (the logical order's sum to float64 rounding), not on where it lies in memory (see
    ``ft_sumsq`` in ``_kernels.c``), nor on a dispatch mode: the tensors themselves must be
    plain, and under a mode (``LocalTensorMode``'s simulated ranks, a user's) the sums' own
    buffers and copies are made outside it, plain tensors the kernels can read (the mode's
    would be its tensors: a simulated rank's, without data pointers), and so is the result.
    One call per dtype, on the calling thread."""
    if not xs or set(map(type, xs)) != {torch.Tensor} or not all(map(_IS_CPU, xs)):
        return None
    dtypes = set(map(_DTYPE_OF, xs))
    if not dtypes <= _DTYPES.keys() or not all(map(available, dtypes)):
        return None
    outside = outside_dispatch_modes()
    if outside is not None:
        with outside:
            return _sums_of(xs, dtypes, zeroed)
    return _sums_of(xs, dtypes, zeroed)


def outside_dispatch_modes():
    """Where a ``TorchDispatchMode`` is active (``LocalTensorMode``'s simulated ranks, a
    user's), a context with none (the current ones set aside for its span), in which a
    native or generated kernel's own buffers, results and copies are made as plain tensors
    it can read and write (the mode's would be its own tensors: a simulated rank's have no
    data pointer); else ``None`` (the caller runs as it is: nothing to set aside)."""
    return _disable_current_modes() if torch._C._len_torch_dispatch_stack() else None


def _sums_of(xs: Sequence[torch.Tensor], dtypes: set, zeroed: bool) -> torch.Tensor:
    """:func:`sum_squares` of tensors that qualify, of the ``dtypes``."""
    if all_in_one_order(xs):
        return _sums(xs, dtypes, zeroed)
    # one with gaps copied first, one at a time (summed while the copy is in the caches, and
    # the step holds one such copy at a time, not one of every leaf); a copy of a dense one in
    # another order took longer than its sum (a ResNet-18's channels_last weights: 64 ms of
    # an 80 ms step)
    n = len(xs)
    out = torch.empty((2 if zeroed else 1, n), dtype=torch.float64)
    ordered = list(map(in_one_order, xs))
    whole = [k for k, o in enumerate(ordered) if o]
    if whole:
        out[:, whole] = _sums([xs[k] for k in whole], dtypes, zeroed).view(-1, len(whole))
    for k, o in enumerate(ordered):
        if not o:
            out[:, k] = _sums([xs[k].contiguous()], {xs[k].dtype}, zeroed)
    return out.view(-1)


def _sums(xs: Sequence[torch.Tensor], dtypes: set, zeroed: bool = False) -> torch.Tensor:
    """:func:`sum_squares` of contiguous tensors that qualify, of the ``dtypes``."""
    n = len(xs)
    out = torch.empty((2 if zeroed else 1, n), dtype=torch.float64)
    for dtype in dtypes:
        idx = range(n) if len(dtypes) == 1 else [k for k, x in enumerate(xs) if x.dtype == dtype]
        if not idx:
            continue
        part = out if len(dtypes) == 1 else torch.empty((out.shape[0], len(idx)), dtype=out.dtype)
        sub = xs if len(dtypes) == 1 else [xs[k] for k in idx]
        ptrs = array.array("q", map(const_data_ptr, sub))  # (read only: a lazy clone is not copied)
        numel = array.array("q", map(torch.Tensor.numel, sub))
        suf = _DTYPES[dtype][0]
        args = [len(idx), ptrs.buffer_info()[0], numel.buffer_info()[0], part[0].data_ptr()]
        if zeroed:
            getattr(_lib, f"ft_sumsq2_{suf}")(*args, part[1].data_ptr())
        else:
            getattr(_lib, f"ft_sumsq_{suf}")(*args)
        if len(dtypes) > 1:
            out[:, list(idx)] = part
    return out.view(-1)


_DTYPE_OF = operator.attrgetter("dtype")


@torch.library.custom_op("functional_train::sum_squares", mutates_args=())
def sum_squares_op(
    xs: list[torch.Tensor], needed: torch.Tensor | None = None, zeroed: bool = False
) -> torch.Tensor:
    """:func:`sum_squares` as an operator that ``torch.compile`` keeps opaque, so that a
    compiled gradient norm equals the eager one bit for bit. Where the native kernels do not
    run (no compiler), torch sums the squares in float64 instead (the same numbers to float64
    rounding). ``needed``: a 0-dim bool tensor; where false (read when the operator runs)
    nobody uses the sums (a compiled ``multi_steps`` non-final micro-step's clip) and they
    are zeros, without a pass over ``xs``. ``zeroed``: as :func:`sum_squares`'s."""
    if needed is not None and not bool(needed):
        return torch.zeros(len(xs) * (2 if zeroed else 1), dtype=torch.float64)
    return sums_of_squares(xs, zeroed)


def sums_of_squares(xs: list[torch.Tensor], zeroed: bool = False) -> torch.Tensor:
    """:func:`sum_squares` of CPU tensors, or where the native kernels do not run (no
    compiler), torch's sums of squares in float64 (the same numbers to float64 rounding): a
    float64 vector, one element per tensor (two with ``zeroed``, as there). Eager only (the
    operators' bodies)."""
    out = sum_squares(xs, zeroed=True) if zeroed else sum_squares(xs)
    if out is None:
        ys = [*xs, *(torch.where(x.isnan(), 0, x) for x in xs)] if zeroed else xs
        out = (
            torch.stack([x.double().square().sum() for x in ys])
            if ys
            else torch.zeros(0, dtype=torch.float64)
        )
    return out


@sum_squares_op.register_fake
def _(xs, needed=None, zeroed=False):
    return torch.empty(len(xs) * (2 if zeroed else 1), dtype=torch.float64)


def local_sum_squares(
    xs: list, needed: torch.Tensor | None = None, zeroed: bool = False
) -> torch.Tensor | None:
    """The sums of squares of ``xs`` (local leaves; a float64 vector, one per tensor) by the
    native kernels wherever they run: eagerly :func:`sum_squares`, under ``torch.compile``
    :func:`sum_squares_op` (opaque: the eager numbers; ``needed`` as there). ``None`` where
    they do not: under a ``torch.func`` transform or autograd recording (wrappers without
    storage), or for leaves that are not CPU float32 / float64 (the caller then takes
    ``torch._foreach_norm``). Eagerly on CUDA: :func:`.fuse_triton.sum_squares` (plain
    contiguous leaves of one floating dtype; else ``None`` as well; and ``None`` there with
    ``zeroed``). The gradient clip's 2-norm and the trust ratio's norms; with ``zeroed``
    (:func:`sum_squares`'), ``zero_nans``' flags and its results' sums in one read."""
    if traced():
        return None
    if not torch.compiler.is_compiling():
        out = sum_squares(xs, zeroed=True) if zeroed else sum_squares(xs)
        if out is None and not zeroed and xs and type(xs[0]) is torch.Tensor and xs[0].is_cuda:
            from . import fuse_triton  # (CUDA: the generated Triton kernels)

            out = fuse_triton.sum_squares(xs)
        return out
    if compiled_sums(xs):
        return sum_squares_op(xs, needed, zeroed)
    return None


def compiled_sums(xs: list) -> bool:
    """Under ``torch.compile``, whether :func:`local_sum_squares` of ``xs`` takes the native
    sums (:func:`sum_squares_op`): CPU float32 / float64 leaves, the kernels on."""
    return ENABLED and bool(xs) and all([x.is_cpu and x.dtype in _DTYPES for x in xs])
