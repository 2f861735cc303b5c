"""Result buffers for the pure step, reused once the caller has dropped them.

A pure step (``ft.step(..., donate=False)``) must write its new parameters and moments into
fresh memory. On CPU, glibc ``malloc`` hands large freed blocks back to the kernel (``munmap``,
heap trimming; see ``mallopt(3)``), so fresh result buffers are new pages that the kernel maps and
zeroes on first touch: on the 13.65 M-parameter tree of ``benchmarks/bench_engine.py`` that is
about 13,000 page faults and a third of the step's time. CUDA's caching allocator already keeps
freed blocks; this pool does the same for the buffers of one plan on CPU.

A pooled buffer is handed out as a ``detach()`` alias: a tensor of its own that shares the
buffer's storage. The storage's use count (``torch._C._storage_Use_Count``) then counts every
tensor, view, DTensor local shard or C++ reference that can still see the memory, so a buffer is
reused only when nothing but the pool holds it -- results the caller still holds are never
written. In a training loop (``params, state = ft.step(...)``) the results of step ``k - 1`` are
the inputs of step ``k`` and those of step ``k - 2`` are free: the pool keeps at most
``GENERATIONS`` sets per kind of buffer, so between steps it holds one set the caller has
dropped (as a caching allocator would), and nothing when the plan is evicted
(``functional_train.engine.plan.cache_clear``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import torch

from ..leaves import CPU, DEVICE, DTYPE, SHAPE, on_device
from .metadata import Memo

__all__ = [
    "Pool",
    "Scratch",
    "of_plan",
    "lazy_clones",
    "const_data_ptr",
    "LAZY_CLONES",
    "GENERATIONS",
    "in_one_order",
    "all_in_one_order",
    "MIN_MEAN_BYTES",
]

GENERATIONS = 2

# sets whose leaves average less than this are not pooled: small blocks come from the malloc
# heap without faults, and checking and aliasing each buffer (about 1.5 us) would cost more
# than it saves (a 242-leaf tree of 8 KiB leaves ran about 5% slower pooled)
MIN_MEAN_BYTES = 64 * 1024

_use_count = torch._C._storage_Use_Count
_contiguous = torch.Tensor.is_contiguous
_DETACH = torch.Tensor.detach
_is_cow: Callable[[torch.Tensor], bool] | None = getattr(torch._C, "_is_cow_tensor", None)
# a tensor's address for reading (a copy-on-write tensor is read where it lies, not copied:
# the kernels take their inputs' by it; missing from torch's type stubs, and from some builds'
# Tensor (torch 2.11's CUDA wheel): there the address for writing, which a lazy clone copies for)
const_data_ptr: Callable[[torch.Tensor], int] = getattr(
    torch.Tensor, "const_data_ptr", torch.Tensor.data_ptr
)
_LAZY_CLONE: Callable[[torch.Tensor], torch.Tensor] | None = getattr(torch, "_lazy_clone", None)
LAZY_CLONES = _LAZY_CLONE is not None  # (torch's copy-on-write clones: torch 2.2 and later)

# the data address of a copy-on-write tensor -> a weak reference to the latest lazy clone made
# of it by :func:`lazy_clones` (their memory is that of a buffer they were cloned from until
# one of them is written). The latest only: a step's clones are made from the clones of the
# step before, which are dropped as the state they were is replaced; a record that misses an
# older clone still alive costs the copy its buffer's write then makes, never a wrong value
_COW_CLONES: dict = {}
_MAX_COW_ADDRESSES = 4096  # (then the entries of addresses no clone reads any more go)
_ref = weakref.ref
# (held by :meth:`Pool.take` from its check that nothing holds a set to the aliases it hands
# out: steps of one plan in two threads never get one set; one lock for every pool, as a
# pool may be made while dynamo traces, which cannot make one)
_TAKING = threading.Lock()


def lazy_clones(xs: Sequence[torch.Tensor]) -> list | None:
    """Copies of the tensors ``xs`` that share their memory until either side is written
    (torch's copy-on-write ``_lazy_clone``: the write copies), recorded so that a pooled
    buffer they read is not taken while they live (writing the buffer would copy it:
    :meth:`Pool.take` takes another). A miss of the record costs a copy, never a wrong
    value. ``None`` where torch has no lazy clones."""
    if _LAZY_CLONE is None:
        return None
    cs = list(map(_LAZY_CLONE, xs))
    if len(_COW_CLONES) >= _MAX_COW_ADDRESSES:  # (addresses whose clones are all gone)
        # (a copy of the items, and pop: another thread may change the dict meanwhile)
        for gone in [k for k, r in list(_COW_CLONES.items()) if r() is None]:
            _COW_CLONES.pop(gone, None)
    # (whole-list C loops: a Python loop over the clones was 2 us a tensor)
    _COW_CLONES.update(zip(map(const_data_ptr, cs), map(_ref, cs)))
    return cs


def _free(buf: torch.Tensor) -> bool:
    # the temporary UntypedStorage object accounts for one use; a copy-on-write buffer is
    # free once no lazy clone of it lives (then writing it takes its memory without a copy)
    if _use_count(buf.untyped_storage()._cdata) != 2:
        return False
    if _is_cow is None or not _is_cow(buf):
        return True
    ptr = const_data_ptr(buf)
    latest = _COW_CLONES.get(ptr)
    if latest is not None and latest() is not None:
        return False
    _COW_CLONES.pop(ptr, None)
    return True


def in_one_order(x: torch.Tensor) -> bool:
    """Whether ``x`` lies in memory without gaps or overlaps (a permutation of a contiguous
    layout: contiguous, ``channels_last``, a transposed matrix), so that a kernel reading its
    memory in order meets every element once."""
    dims = sorted((st, n) for n, st in zip(x.shape, x.stride()) if n != 1)
    step = 1
    for st, n in dims:
        if st != step:
            return False
        step *= n
    return True


def all_in_one_order(xs: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor of ``xs`` lies in memory without gaps or overlaps (contiguous, or
    another order: :func:`in_one_order`), as the sums of squares read them (in memory order;
    a leaf's sum in another order than its contiguous copy's: the same to float64 rounding).
    Whole-list C loops for the common case, every tensor contiguous."""
    return all(map(torch.Tensor.is_contiguous, xs)) or all(map(in_one_order, xs))


def _inductor_allocator(name: str, device_type: str) -> Callable | None:
    """inductor's allocator of new tensors on ``device_type`` (``torch._C._dynamo.guards.<name>``:
    sizes, strides and dtype in, a new tensor out, without the dispatcher's trip that
    ``torch.empty_like`` makes: on CPU 0.45 against 0.8 us a tensor on a 2-core AMD EPYC),
    where this torch has it in the form used here (a private function: checked by making one
    tensor with it); ``None`` otherwise."""
    try:
        from torch._C._dynamo import guards

        fn = getattr(guards, name)
        t = fn((2, 3), (3, 1), torch.bfloat16)
        ok = t.shape == (2, 3) and t.stride() == (3, 1) and t.dtype == torch.bfloat16
        ok = ok and t.device.type == device_type and not t.requires_grad
        ok = ok and type(t) is torch.Tensor
    except Exception:
        return None
    return fn if ok else None


_EMPTY_STRIDED_CPU = _inductor_allocator("_empty_strided_cpu", "cpu")  # (at import)
# (per list of contiguous CPU or CUDA tensors, by their exact metadata: the allocator, and the
# sizes, strides and dtypes to allocate new ones with; see .metadata)
_EMPTY_BY_METADATA = Memo(per_key=8)
_EMPTY_STRIDED_CUDA: list = []  # (inductor's CUDA allocator, once checked: see _cuda_allocator)


def _cuda_allocator(x: torch.Tensor) -> Callable | None:
    """inductor's allocator of CUDA tensors (``torch._C._dynamo.guards._empty_strided_cuda``:
    sizes, strides and dtype in, a tensor on the *current* CUDA device out, without the
    dispatcher's trip of ``torch.empty_like``, which took about 2.4 us a tensor on the host of
    a lent GPU), where this torch has it in the form used here and ``x``'s device is the
    current one (checked on a first use: importing the library initialises no CUDA)."""
    if not _EMPTY_STRIDED_CUDA:
        _EMPTY_STRIDED_CUDA.append(_inductor_allocator("_empty_strided_cuda", "cuda"))
    fn = _EMPTY_STRIDED_CUDA[0]
    if fn is None or x.get_device() != torch.cuda.current_device():
        return None
    return fn


def empties_like(like: Sequence[torch.Tensor]) -> list:
    """New tensors like those of ``like`` (:func:`_empty_like`'s: contiguous, or in a
    ``like``'s memory order where it lies in one without gaps). Contiguous plain CPU tensors,
    and CUDA ones on the current device, by inductor's allocators, with the sizes, strides
    and dtypes remembered by the list's exact metadata (one check of the list, where each
    tensor's attributes would be read)."""
    recipe = _EMPTY_BY_METADATA.get(len(like), (like,))
    if recipe is not None:
        new = list(map(*recipe))
        # (the CUDA allocator's results are on the current device: still the list's, or the
        # list's made anew below)
        if (
            recipe[0] is _EMPTY_STRIDED_CPU
            or not new
            or new[0].get_device() == like[0].get_device()
        ):
            return new
    if not all(map(_contiguous, like)):
        return list(map(_empty_like, like))
    if not like or set(map(type, like)) != {torch.Tensor}:
        return list(map(torch.empty_like, like))
    if on_device(like, CPU):
        fn = _EMPTY_STRIDED_CPU
    elif on_device(like, like[0].device) and like[0].is_cuda:
        fn = _cuda_allocator(like[0])
    else:
        fn = None
    if fn is None:
        return list(map(torch.empty_like, like))
    recipe = (
        fn,
        list(map(tuple, map(SHAPE, like))),
        list(map(torch.Tensor.stride, like)),
        list(map(DTYPE, like)),
    )
    _EMPTY_BY_METADATA.put(len(like), (like,), recipe)
    return list(map(*recipe))


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    """A new tensor like ``x``: in its memory order where it lies in one
    (:func:`in_one_order`), else contiguous."""
    if x.is_contiguous() or not in_one_order(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return torch.empty_like(x)


def _same_order(buf: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``buf`` lies as :func:`_empty_like` would make it for ``x`` (without making
    one)."""
    if x.is_contiguous() or not in_one_order(x):
        return buf.is_contiguous()
    return buf.stride() == x.stride()


class Pool:
    """Sets of result buffers of one plan, by kind (``"params"``, ``"mu"``, ...). Steps of
    one plan in several threads at once each get buffers of their own: a set is taken under
    a lock (from the check that nothing holds it to the aliases that then do), and each
    thread has its own scratch sets."""

    __slots__ = ("sets", "pooled", "scratches")

    def __init__(self):
        self.sets: dict = {}
        self.pooled: dict = {}  # kind -> whether its leaves are large enough to pool
        self.scratches: dict = {}  # (kind, thread) -> the set of :meth:`scratch`

    def take(self, kind: str, like: Sequence[torch.Tensor]) -> list:
        """Fresh tensors with the shapes, dtypes and devices of ``like``, contiguous, or in the
        memory order of a ``like`` that lies in another one without gaps (:func:`in_one_order`:
        ``channels_last``), from a pooled set nothing else holds, or newly allocated (and
        pooled) on CPU. On other devices, and for sets of small leaves (``MIN_MEAN_BYTES``),
        new tensors (:func:`empties_like`): their allocators cache already."""
        pooled = self.pooled.get(kind)
        if pooled is None:  # the layout is the plan's: decided once per kind
            pooled = self.pooled[kind] = (
                bool(like)
                and like[0].is_cpu
                and sum(x.numel() * x.element_size() for x in like) >= MIN_MEAN_BYTES * len(like)
            )
        if not pooled:
            return empties_like(like)
        contiguous = all(map(_contiguous, like))  # (a map without keywords: 0.8 against 1.1 us)
        # (a set: its buffers, with their shapes, dtypes and whether all are contiguous, read
        # when it was made: they never change, the buffers are handed out as detached aliases;
        # whole-list C loops, the use counts last)
        shapes = list(map(SHAPE, like))
        dtypes = list(map(DTYPE, like))
        with _TAKING:
            sets = self.sets.setdefault(kind, [])
            for bufs, b_shapes, b_dtypes, b_contiguous in sets:
                if (
                    b_shapes == shapes
                    and b_dtypes == dtypes
                    and (b_contiguous if contiguous else all(map(_same_order, bufs, like)))
                    and all(map(_free, bufs))
                ):
                    return list(map(_DETACH, bufs))
            bufs = list(map(_empty_like, like))
            sets.append((bufs, shapes, dtypes, all(map(_contiguous, bufs))))
            if len(sets) > GENERATIONS:
                del sets[0]
            return list(map(_DETACH, bufs))

    def taking(self, prefix: str) -> Callable[[str, Sequence[torch.Tensor]], list]:
        """:meth:`take` under kinds of their own, ``prefix`` before each (``update``'s and
        ``apply_updates``' results: a pure step over the same tree keeps its sets)."""
        take = self.take

        def prefixed(kind: str, like: Sequence[torch.Tensor]) -> list:
            return take(prefix + kind, like)

        return prefixed

    def scratch(self, kind: str, like: Sequence[torch.Tensor]) -> list:
        """Buffers with the shapes, dtypes and devices of ``like`` for work that never leaves
        the step (their contents are garbage afterwards: the gradients the fused kernels
        unscale in place): one set per kind and thread (by ``threading.get_ident``: a thread
        gone leaves its set to the next thread given its identifier, or until the plan is
        evicted), made once and reused without use-count checks, since nothing outside the
        step ever sees them."""
        # (the set, with the shapes, dtypes and devices it was made for: whole-list C loops)
        meta = [list(map(SHAPE, like)), list(map(DTYPE, like)), list(map(DEVICE, like))]
        key = (kind, threading.get_ident())
        hit = self.scratches.get(key)
        if hit is not None and hit[1] == meta:
            return list(hit[0])
        bufs = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in like]
        self.scratches[key] = (bufs, meta)
        return list(bufs)


def of_plan(plan, key: str, cls):
    """The plan's ``cls()`` (a :class:`Pool` or :class:`Scratch`) kept under ``key`` in its
    memo, made on first use: it lives and is evicted with the plan."""
    obj = plan.memo.get(key)
    if obj is None:
        obj = plan.memo[key] = cls()
    return obj


class Scratch:
    """Temporaries of one plan reused leaf after leaf: one flat buffer per slot, dtype, device
    and thread (as :meth:`Pool.scratch`), grown to the largest leaf asked for. A step that
    finishes each leaf before reading the next (``ft.step``'s fused Adafactor) makes its
    leaf-sized temporaries here, so that it neither takes page faults for them nor leaves the
    malloc heap's top free to be trimmed."""

    __slots__ = ("bufs",)

    def __init__(self):
        self.bufs: dict = {}  # (slot, dtype, device, thread) -> its buffer

    def view(
        self, slot: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A contiguous tensor of ``shape`` over the slot's buffer (its previous contents are
        garbage; the previous view of the slot must no longer be in use)."""
        if not all(type(d) is int for d in shape):  # symbolic sizes (simulated ranks)
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        n = 1
        for d in shape:
            n *= d
        key = (slot, dtype, device, threading.get_ident())
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self.bufs[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(tuple(shape))
