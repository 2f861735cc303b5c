"""The host side of the CUDA stages (``functional_train.engine.fuse_triton``), where no GPU and
no Triton is: how scalars travel (by address on the leaves' device, by value from the host),
the block table every launch walks, and the address table's cache; and the sums of squares'
kernels under Triton's interpreter, on CPU tensors. The stages' kernels run under ``--device
cuda`` (tests/test_fused.py, tests/test_fused_wrappers.py) and, without a GPU, under the
interpreter (``tests/test_fused_wrappers.py -k interpreter``); ``tests/test_fused.py -k
triton_writer`` checks their source for every stage the C writer generates."""

import struct

import pytest
import torch

from _spy import triton_interpreted
from functional_train.engine import fuse, fuse_triton
from functional_train.engine.pool import all_in_one_order

CUDA = torch.device("cuda")  # (a device object only: nothing is allocated on it here)


def _bits(x: float) -> int:
    return struct.unpack("q", struct.pack("d", x))[0]


def test_host_scalars_travel_by_value():
    """Python numbers go as float64 bits (as the C kernels read them), 0-dim CPU tensors as
    their value in their own dtype, for a CUDA stage: no device memory is read on the host."""
    scalars = [0.9, 3, torch.tensor(1e-3), torch.tensor(7), torch.tensor(True)]
    slots, kinds, keep = fuse_triton.scalar_slots(scalars, CUDA)
    assert kinds == (
        (torch.float64, False),
        (torch.float64, False),
        (torch.float32, False),
        (torch.int64, False),
        (torch.bool, False),
    )
    assert list(slots.values) == [_bits(0.9), _bits(3.0), _bits(float(torch.tensor(1e-3))), 7, 1]
    assert slots.pointers == () and keep == []


def test_device_scalars_travel_by_address():
    """A 0-dim tensor on the leaves' device goes by its address, as an argument of the kernel
    (not in the table, whose slots are the host scalars': a donated step's table stays the
    same when such a scalar is a new tensor each step); one that cannot be read so gives
    ``None``: the stage then runs leaf by leaf."""
    cpu = torch.device("cpu")  # (the leaves' device stands in for a GPU here)
    x = torch.tensor(2.5, dtype=torch.float64)
    slots, kinds, keep = fuse_triton.scalar_slots([0.5, x, 3], cpu)
    assert kinds == ((torch.float64, False), (torch.float64, True), (torch.float64, False))
    assert list(slots.values) == [_bits(0.5), _bits(3.0)] and slots.pointers == (x,)
    assert keep == [x]
    assert fuse_triton.scalar_slots([torch.ones(2)], CUDA) is None  # not 0-dim
    assert fuse_triton.scalar_slots([torch.ones(1)], CUDA) is None
    assert fuse_triton.scalar_slots([torch.tensor(1.0, requires_grad=True)], CUDA) is None
    assert fuse.scalar_pointers([0.5], CUDA)[1] == ((torch.float64, False),)


def test_block_table_covers_every_element_once():
    """The (leaf, first element) pairs cover each leaf's elements once, in blocks of
    ``BLOCK``, empty leaves none, and are cached per set of leaf sizes."""
    b = fuse_triton.BLOCK
    numels = (0, 1, b - 1, b, b + 1, 3 * b, 5)
    blocks, n = fuse_triton._blocks(numels, torch.device("cpu"))
    pairs = blocks.view(-1, 2).tolist()
    assert n == len(pairs) == sum(-(-k // b) for k in numels)
    for leaf, k in enumerate(numels):
        starts = [s for (lf, s) in pairs if lf == leaf]
        assert starts == list(range(0, k, b))
    assert fuse_triton._blocks(numels, torch.device("cpu"))[0] is blocks
    empty, n0 = fuse_triton._blocks((0, 0), torch.device("cpu"))
    assert n0 == 0 and empty.numel() == 0


def test_address_table_is_kept_per_content():
    """A table of the same addresses and scalars (a donated step's, every step) is the same
    tensor on the device; another one is copied."""
    import array

    a = array.array("q", [1, 2, 3])
    t = fuse_triton._table(a, torch.device("cpu"))
    assert t.tolist() == [1, 2, 3]
    assert fuse_triton._table(array.array("q", [1, 2, 3]), torch.device("cpu")) is t
    assert fuse_triton._table(array.array("q", [1, 2, 4]), torch.device("cpu")) is not t


def test_triton_stages_need_a_cuda_device():
    """The Triton kernels are for CUDA leaves; CPU leaves take the C kernels."""
    assert not fuse_triton.available(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sums_of_squares_under_the_interpreter(dtype, monkeypatch):
    """The CUDA sums of squares (the clip's and the trust ratio's terms: two launches, per
    block then per leaf over its blocks in order), run by Triton's interpreter on CPU leaves:
    every leaf's sum in float64, empty leaves 0, a NaN leaf NaN, an infinite one inf (what
    ``zero_nans``' flags read), to float64 rounding of the same sums in torch."""
    triton_interpreted(monkeypatch)
    b = fuse_triton.BLOCK
    g = torch.Generator().manual_seed(0)
    sizes = [(0,), (1,), (b - 1,), (b + 1,), (3, b), (7, 5)]
    xs = [torch.randn(s, generator=g).to(dtype) for s in sizes]
    xs[1][0] = float("nan")
    xs[2][3] = float("inf")
    # leaves dense in another memory order, read in it: channels_last, transposed
    xs.append(
        torch.randn(5, 3, 7, b // 9, generator=g).to(dtype, memory_format=torch.channels_last)
    )
    xs.append(torch.randn(b + 3, 5, generator=g).to(dtype).t())
    assert all_in_one_order(xs) and not all_in_one_order([*xs, torch.randn(6, 8)[:, :5]])
    got = fuse_triton._sum_squares(xs, torch.device("cpu"))
    want = torch.stack([x.double().square().sum() for x in xs])
    assert got is not None and got.dtype == torch.float64
    assert torch.isnan(got[1]) and torch.isinf(got[2]) and got[0] == 0
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-12, atol=0)


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    "fn, in_dtypes, n_per_leaf, want",
    [
        (lambda i, s: (i[1] + i[0],), (F32, F32), 0, ("add", 1, 0)),  # multi_steps' sum
        (lambda i, s: (i[0] + i[1],), (BF16, BF16), 0, ("add", 0, 1)),
        (lambda i, s: (i[0].to(F32),), (F32, F32), 0, ("copy", 0)),  # a cycle's first
        (lambda i, s: (i[0].clone(),), (F32,), 0, ("copy", 0)),
        (lambda i, s: (i[1],), (F32, F32), 0, ("copy", 1)),
        (lambda i, s: (i[1] + i[0].to(F32),), (BF16, F32), 0, None),  # a conversion, then add
        (lambda i, s: (i[0].to(F32),), (BF16, F32), 0, None),
        (lambda i, s: (torch.add(i[1], i[0], alpha=2.0),), (F32, F32), 0, None),
        (lambda i, s: (i[1] + 2 * i[0],), (F32, F32), 0, None),
        (lambda i, s: (i[0] + s[0],), (F32,), 0, None),  # a scalar
        (lambda i, s: (i[0] + i[1],), (F32, F32), 1, None),  # a per-leaf value
        (lambda i, s: (i[0] + i[1], i[1]), (F32, F32), 0, None),  # two results
        (lambda i, s: (i[0] - i[1],), (F32, F32), 0, None),
    ],
)
def test_exact_foreach_stages(fn, in_dtypes, n_per_leaf, want):
    """A traced stage that is exactly one of torch's foreach operations (an in-place sum of
    two leaf-shaped inputs of one dtype; a copy of one to its own dtype) is told apart from
    every other stage (a conversion, an ``alpha``, a scalar or per-leaf operand, a second
    result, another operation)."""
    graph = fuse.trace(fn, in_dtypes, (F32,), n_per_leaf)
    assert fuse.exact_foreach(graph, in_dtypes, n_per_leaf) == want


def test_foreach_kernel_writes_as_the_stage():
    """A :class:`fuse.ForeachKernel` called as the engine calls a donated stage (the result
    list is the input it replaces) writes ``acc + g`` over ``acc`` with ``torch._foreach_add_``
    bit for bit as torch adds, and a copy into any buffers; a sum into buffers given goes to
    the generated kernel, made only then; fresh sums come from ``torch._foreach_add``
    (:meth:`~fuse.ForeachKernel.results`). Leaves of several shapes, one empty."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (0,), (2, 3, 4)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    accs = [torch.randn(s, generator=g) for s in shapes]
    want = [a + x for a, x in zip(accs, grads)]
    made = []

    def inner():
        made.append(True)

        def kernel(ins, outs, sc, fresh=False):
            for x, a, o in zip(*ins, outs[0]):
                torch.add(a, x, out=o)
            return True

        return kernel

    add = fuse.ForeachKernel(("add", 1, 0), (F32, F32), inner)
    assert add.out_dtypes == (F32,) and not add.sumsq
    ins = [list(grads), list(accs)]
    assert add(ins, [ins[1]], None) is True
    assert not made and all(torch.equal(a, w) for a, w in zip(accs, want))
    fresh = [torch.empty(s) for s in shapes]
    add([grads, accs], [fresh], None)
    assert made and all(torch.equal(f, a + x) for f, a, x in zip(fresh, accs, grads))
    copy = fuse.ForeachKernel(("copy", 0), (F32, F32), inner)
    into = [torch.empty(s) for s in shapes]
    assert copy([grads, into], [into], None) is True
    assert all(torch.equal(a, x) for a, x in zip(into, grads))
    # (fresh results made by torch's foreach operation itself: a sum; a copy takes buffers)
    (sums,) = add.results([grads, accs])
    assert all(torch.equal(s, a + x) for s, a, x in zip(sums, accs, grads))
    assert not any(s is a or s.data_ptr() == a.data_ptr() for s, a in zip(sums, accs) if a.numel())
    assert copy.results([grads, into]) is None


def test_cuda_stages_that_are_foreach_operations():
    """``kernel_for`` on CUDA gives a :class:`fuse.ForeachKernel` for a stage that is exactly
    one foreach operation (its generated kernel made only if a call needs it) and the Triton
    kernel for any other; the C kernel on CPU either way."""

    def accumulate(ins, sc):
        return (ins[1] + ins[0],)

    def scaled(ins, sc):
        return (ins[1] + ins[0] * sc[0],)

    kinds = ((F32, False),)
    k = fuse.kernel_for(accumulate, (F32, F32), kinds, 0, "cuda")
    assert isinstance(k, fuse.ForeachKernel) and k.op == ("add", 1, 0) and k._inner is None
    assert isinstance(fuse.kernel_for(accumulate, (F32, F32), (F32,), 0, "cpu"), fuse.Kernel)
    pytest.importorskip("triton")
    triton = fuse.kernel_for(scaled, (F32, F32), kinds, 0, "cuda")
    assert isinstance(triton, fuse_triton.TritonKernel)
