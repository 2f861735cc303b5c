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
