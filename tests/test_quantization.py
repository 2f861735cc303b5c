"""8-bit block-wise quantised Adam moments (Dettmers et al. 2022; bitsandbytes ``Adam8bit``).

1. The dynamic map equals bitsandbytes'; block-wise quantisation equals bitsandbytes' reference
   (PyTorch) kernel bitwise, is never farther from the input than its CPU kernel, and round trips
   within the map's resolution (blocks along the last dim, zeros, negatives, all-zero blocks).
2. ``scale_by_adam(optim_bits=8)`` over 25 steps equals a straightforward dequantise / update /
   requantise loop written here; stays close to float32 Adam; equals ``bitsandbytes.optim.Adam8bit``
   / ``AdamW8bit`` on CPU (codes and absmax bitwise with bitsandbytes' reference rounding,
   close with its CPU kernel's rounding).
3. Sharded == unsharded bitwise in the one-process simulation on (2,) and (2, 2) meshes: last
   dims sharded unevenly and nested, blocks straddling ranks, empty shards; state placements.
4. Collectives: one max all-reduce per group of mesh dims sharding last dims (at most), none
   otherwise.
5. Memory: about a quarter of the float32 state. Small leaves stay float32. Bad input.
"""

from __future__ import annotations

import logging
import math

import optree
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import functional_train as ft
from _layouts import (
    S0,
    S1,
    S2,
    R,
    run_with_reference,
    shard,
    update_collectives,
)
from _layouts import run_steps as _run  # noqa: E402
from functional_train.optimizers import adam, adamw
from functional_train.quantization import (
    ScaleByAdam8bitState,
    create_dynamic_map,
    dequantize_blockwise,
    quantize_blockwise,
)
from functional_train.testing import gather, per_rank, simulate
from functional_train.transforms import ScaleByAdamState, scale_by_adam
from functional_train.tree import tree_paths

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
import bitsandbytes as bnb  # noqa: E402  (the reference, a test extra)
import bitsandbytes.functional as BF  # noqa: E402


def _bnb_reference_quantize(x, code, block_size):
    """bitsandbytes' reference PyTorch kernel of ``quantize_blockwise`` (its "default" backend,
    registered as CompositeExplicitAutograd; the CPU backend overrides it with a C kernel)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(keys, x, code, block_size)


# =============================================================================================
# 1. the map and block-wise quantisation
# =============================================================================================
@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_equals_bitsandbytes(signed):
    ours = create_dynamic_map(signed)
    theirs = BF.create_dynamic_map(signed=signed)
    assert ours.dtype == torch.float32 and ours.shape == (256,)
    assert torch.equal(ours, theirs)
    assert ours.unique().numel() == 256 and torch.equal(ours, ours.sort().values)
    assert ours[-1] == 1.0 and ours[127 if signed else 0] == 0.0
    # other bit splits bitsandbytes accepts
    for e, t in [(5, 8), (4, 6), (3, 4)]:
        assert torch.equal(create_dynamic_map(True, e, t), BF.create_dynamic_map(True, e, t))


def _nearest_distance(xn, code):
    return (xn.reshape(-1, 1) - code.reshape(1, -1)).abs().min(-1).values.reshape(xn.shape)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize(
    "shape,block", [((3, 20), 8), ((50,), 16), ((2, 3, 16), 16), ((), 4), ((4, 7), 256)]
)
def test_round_trip_within_resolution(shape, block, signed):
    gen = torch.Generator().manual_seed(sum(shape) + block)
    x = torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape, generator=gen))
    if not signed:
        x = x.abs()
    if len(shape) >= 2:
        x[0] = 0.0  # a row of all-zero blocks
    codes, absmax = quantize_blockwise(x, block_size=block, signed=signed)
    nb = math.ceil((shape[-1] if shape else 1) / block)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert absmax.dtype == torch.float32 and absmax.shape == (shape[:-1] + (nb,) if shape else (1,))
    # blocks run along the last dim of each row
    rows = x.reshape(-1, shape[-1] if shape else 1)
    pad = torch.nn.functional.pad(rows, (0, nb * block - rows.shape[-1]))
    assert torch.equal(absmax.reshape(-1, nb), pad.abs().reshape(-1, nb, block).amax(-1))
    back = dequantize_blockwise(codes, absmax, block_size=block, signed=signed)
    assert back.dtype == torch.float32 and back.shape == x.shape
    scale = (
        absmax.reshape(-1, nb).repeat_interleave(block, -1)[:, : rows.shape[-1]].reshape(x.shape)
    )
    code = create_dynamic_map(signed)
    # the nearest code (up to float rounding of the normalised value) ...
    xn = x / torch.where(scale > 0, scale, torch.ones_like(scale))
    got = (back / torch.where(scale > 0, scale, torch.ones_like(scale)) - xn).abs()
    assert (got <= _nearest_distance(xn, code) + 1e-6).all()
    # ... hence within half the largest gap of the map (0.0070 of the block's absmax; -1 is
    # not in the signed map, -0.99297 is its end), up to float32 rounding
    half_gap = float((code[1:] - code[:-1]).max()) / 2
    if signed:
        half_gap = max(half_gap, float(1 + code[0]))
    assert half_gap < 0.0071
    assert ((back - x).abs() <= (half_gap + 1e-6) * scale).all()
    # zeros stay zeros, signs are kept, block maxima are exact
    zero = 127 if signed else 0
    assert (codes[x == 0] == zero).all() and (back[x == 0] == 0).all()
    assert ((back == 0) | (back.sign() == x.sign())).all()
    top = (x == scale) & (x > 0)  # positive block maxima map to the code 1.0: exact
    assert torch.equal(back[top], x[top])


def test_all_zero_tensor_and_negative_block():
    x = torch.zeros(2, 8)
    x[1] = -torch.arange(1.0, 9.0)
    codes, absmax = quantize_blockwise(x, block_size=4)
    assert torch.equal(absmax, torch.tensor([[0.0, 0.0], [4.0, 8.0]]))
    assert (codes[0] == 127).all()
    back = dequantize_blockwise(codes, absmax, block_size=4)
    assert torch.equal(back[0], torch.zeros(8))
    # -absmax maps to the most negative code, -0.99297 (the signed map has no -1)
    code = create_dynamic_map(True)
    assert codes[1, 3] == codes[1, 7] == 0 and back[1, 7] == code[0] * 8.0
    assert (back[1] < 0).all()
    assert ((back[1] - x[1]).abs() <= 0.0071 * absmax[1].repeat_interleave(4)).all()


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_equals_bitsandbytes_kernels(signed):
    """Bitwise bitsandbytes' reference kernel (1-D, whole blocks), zero blocks included. Its CPU
    C kernel's binary search does not always return the nearest code (e.g. -5.7e-8 of the
    absmax becomes -2.1e-5): ours is never farther from the input than it."""
    gen = torch.Generator().manual_seed(3)
    n = 256 * 24
    x = torch.randn(n, generator=gen) * torch.logspace(-8, 1, n)[torch.randperm(n, generator=gen)]
    x[:256] = 0.0
    if not signed:
        x = x.abs()
    code = BF.create_dynamic_map(signed=signed)
    q_ref, a_ref = _bnb_reference_quantize(x, code, 256)
    q, a = quantize_blockwise(x, code, 256)
    assert torch.equal(q, q_ref) and torch.equal(a, a_ref)
    q_cpu, st = BF.quantize_blockwise(x, code=code, blocksize=256)
    assert torch.equal(st.absmax, a)
    ours = (dequantize_blockwise(q, a, code, 256) - x).abs()
    theirs = (BF.dequantize_blockwise(q_cpu, st) - x).abs()
    assert (ours <= theirs).all()


# =============================================================================================
# 2. 8-bit Adam numerics
# =============================================================================================
def _values(shapes, steps, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}
    grads = [
        {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}
        for _ in range(steps)
    ]
    return params, grads


class _Ref8bit:
    """A straightforward 8-bit Adam: each step dequantise the moments (code * block absmax),
    update them in float32, requantise with the new block absmax (nearest code by midpoints).
    Blocks of ``block`` along the last dim of each row; leaves under ``min_size`` stay float."""

    def __init__(self, b1, b2, eps, block, min_size, eps_before_correction=False):
        self.b1, self.b2, self.eps, self.B, self.min_size = b1, b2, eps, block, min_size
        self.ebc = eps_before_correction
        self.maps = {s: BF.create_dynamic_map(signed=s) for s in (True, False)}
        self.state, self.t = {}, 0

    def _blocks(self, x):
        rows = x.reshape(-1, x.shape[-1] if x.ndim else 1)
        nb = -(-rows.shape[-1] // self.B)
        pad = torch.nn.functional.pad(rows, (0, nb * self.B - rows.shape[-1]))
        return pad.reshape(rows.shape[0], nb, self.B), rows.shape[-1]

    def quantize(self, x, signed):
        blocks, _ = self._blocks(x)
        absmax = blocks.abs().amax(-1)
        scaled = (blocks * (1.0 / absmax.clamp(min=1e-38))[..., None]).clamp(-1, 1)
        code = self.maps[signed]
        mid = (code[:-1] + code[1:]) / 2
        codes = (scaled[..., None] > mid).sum(-1)
        return codes, absmax

    def dequantize(self, codes, absmax, signed, like):
        vals = self.maps[signed][codes] * absmax[..., None]
        _, n = self._blocks(like)
        return vals.reshape(vals.shape[0], -1)[:, :n].reshape(like.shape)

    def step(self, params, grads):
        self.t += 1
        out = {}
        for k, g in grads.items():
            quant = g.numel() >= self.min_size
            if k not in self.state:
                z = torch.zeros_like(g)
                self.state[k] = (
                    (self.quantize(z, True), self.quantize(z, False)) if quant else (z, z)
                )
            if quant:
                (mc, ma), (nc, na) = self.state[k]
                m, v = self.dequantize(mc, ma, True, g), self.dequantize(nc, na, False, g)
            else:
                m, v = self.state[k]
            m = torch.lerp(m, g, 1 - self.b1)
            v = v * self.b2
            v.addcmul_(g, g, value=1 - self.b2)
            bc1, bc2 = 1 - self.b1**self.t, math.sqrt(1 - self.b2**self.t)
            if self.ebc:
                out[k] = m / (v.sqrt() + self.eps) * (bc2 / bc1)
            else:
                out[k] = m / (v.sqrt() / bc2 + self.eps) / bc1
            self.state[k] = (self.quantize(m, True), self.quantize(v, False)) if quant else (m, v)
        return out


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"b1": 0.8, "b2": 0.99, "eps": 1e-6},
        {"eps_before_correction": True},
    ],
    ids=["default", "betas_eps", "eps_before_correction"],
)
def test_matches_reference_loop(kw):
    shapes = {"w": (6, 40), "t": (2, 3, 33), "v": (50,), "s": (), "small": (3, 4)}
    params, grads = _values(shapes, 25)
    block, min_size = 16, 13
    tx = scale_by_adam(**kw, optim_bits=8, min_8bit_size=min_size, block_size=block)
    ref = _Ref8bit(
        kw.get("b1", 0.9),
        kw.get("b2", 0.999),
        kw.get("eps", 1e-8),
        block,
        min_size,
        kw.get("eps_before_correction", False),
    )
    state = tx.init(params)
    for g in grads:
        u, state = tx.update(g, state, params)
        want = ref.step(params, g)
        for k in shapes:
            torch.testing.assert_close(u[k], want[k], rtol=1e-6, atol=0)
    for k in ("w", "t", "v"):
        (mc, ma), (nc, na) = ref.state[k]
        assert state.mu[k] is None and state.nu[k] is None
        for ours, theirs in ((state.mu_codes[k], mc), (state.nu_codes[k], nc)):
            n = shapes[k][-1]
            assert torch.equal(
                ours.long(), theirs.reshape(theirs.shape[0], -1)[:, :n].reshape(shapes[k])
            )
        assert torch.equal(state.mu_absmax[k].reshape(ma.shape), ma)
        assert torch.equal(state.nu_absmax[k].reshape(na.shape), na)
        assert torch.equal(
            dequantize_blockwise(state.mu_codes[k], state.mu_absmax[k], None, block),
            ref.dequantize(mc, ma, True, params[k]),
        )
        assert torch.equal(
            dequantize_blockwise(state.nu_codes[k], state.nu_absmax[k], None, block, signed=False),
            ref.dequantize(nc, na, False, params[k]),
        )
    for k in ("s", "small"):
        assert state.mu_codes[k] is None and state.mu_absmax[k] is None
        torch.testing.assert_close(state.mu[k], ref.state[k][0], rtol=1e-6, atol=0)
        torch.testing.assert_close(state.nu[k], ref.state[k][1], rtol=1e-6, atol=0)
    assert int(state.count) == 25


def test_close_to_float32_adam():
    shapes = {"w": (16, 96), "v": (512,), "small": (5, 5)}
    params, grads = _values(shapes, 30, seed=2)
    p8 = _run(adam(1e-2, optim_bits=8, min_8bit_size=100, block_size=64), params, grads)[2]
    p32 = _run(adam(1e-2), params, grads)[2]
    for k in ("w", "v"):
        d8, d32 = p8[k] - params[k], p32[k] - params[k]
        rel = float((d8 - d32).norm() / d32.norm())
        assert 1e-4 < rel < 0.05, (k, rel)  # quantised, yet within a few percent
    assert torch.equal(p8["small"], p32["small"])  # small leaves: float32 Adam exactly


def _bnb_patch_reference_rounding(monkeypatch):
    """Make bitsandbytes' CPU 8-bit optimizer requantise with its reference kernel."""
    import bitsandbytes.backends.cpu.ops as cpu_ops

    def requantize(A, code, absmax_out, out, blocksize):
        q, a = _bnb_reference_quantize(A, code, blocksize)
        out.copy_(q)
        absmax_out.copy_(a)

    assert hasattr(cpu_ops, "_quant_blockwise_fp32_direct")
    monkeypatch.setattr(cpu_ops, "_quant_blockwise_fp32_direct", requantize)


@pytest.mark.parametrize("decoupled", [False, True], ids=["Adam8bit", "AdamW8bit"])
@pytest.mark.parametrize("rounding", ["reference", "cpu_kernel"])
def test_matches_bitsandbytes_adam8bit(decoupled, rounding, monkeypatch):
    """bitsandbytes blocks the flattened tensor (256 per block): equal to ours for a last dim
    that is a multiple of 256 and for 1-D leaves. Defaults: min_8bit_size 4096 in both."""
    if rounding == "reference":
        _bnb_patch_reference_rounding(monkeypatch)
    shapes = {"w": (8, 512), "v": (4096,), "small": (10, 10)}
    params, grads = _values(shapes, 20, seed=4)
    tp = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    if decoupled:
        opt = bnb.optim.AdamW8bit(list(tp.values()), lr=1e-2, weight_decay=0.1)
        tx = adamw(1e-2, weight_decay=0.1, optim_bits=8)
    else:
        opt = bnb.optim.Adam8bit(list(tp.values()), lr=1e-2)
        tx = adam(1e-2, optim_bits=8)
    state, p = run_with_reference(opt, tp, tx, params, grads)
    st = state[0]
    assert isinstance(st, ScaleByAdam8bitState)
    for k in shapes:
        d_ours, d_bnb = p[k] - params[k], tp[k].detach() - params[k]
        rel = float((d_ours - d_bnb).norm() / d_bnb.norm())
        assert rel < (1e-5 if rounding == "reference" else 1e-2), (k, rel)
    assert "absmax1" not in opt.state[tp["small"]] and st.mu["small"] is not None
    for k in ("w", "v"):
        s = opt.state[tp[k]]
        ours = [st.mu_codes[k], st.nu_codes[k], st.mu_absmax[k], st.nu_absmax[k]]
        theirs = [s["state1"], s["state2"], s["absmax1"], s["absmax2"]]
        if rounding == "reference":
            # codes equal; the block maxima to a float32 rounding (bitsandbytes updates the
            # moments with mul/add, torch's Adam and ours with lerp)
            for a, b in zip(ours[:2], theirs[:2]):
                assert torch.equal(a.reshape(-1), b.reshape(-1)), k
            for a, b in zip(ours[2:], theirs[2:]):
                torch.testing.assert_close(a.reshape(-1), b.reshape(-1), rtol=1e-6, atol=0)
        else:
            for a, b in zip(ours[2:], theirs[2:]):
                torch.testing.assert_close(a.reshape(-1), b.reshape(-1), rtol=0.02, atol=0)


def test_bf16_params_frozen_leaves_and_purity():
    params, grads = _values({"w": (4, 24), "f": (4, 24), "b": (3,)}, 2, dtype=torch.bfloat16)
    tx = adamw(1e-2, optim_bits=8, min_8bit_size=16, block_size=8)
    state = tx.init(params)
    g = dict(grads[0], f=None)
    snap = [x.clone() for x in list(grads[0].values()) + list(params.values())]
    u, new = tx.update(g, state, params)
    assert u["f"] is None and u["w"].dtype == torch.bfloat16
    st, old = new[0], state[0]
    assert st.mu_codes["w"].dtype == torch.uint8 and st.mu_absmax["w"].dtype == torch.float32
    assert st.mu["b"].dtype == torch.float32 and st.mu_codes["b"] is None
    assert st.mu_codes["f"] is old.mu_codes["f"] and st.nu_absmax["f"] is old.nu_absmax["f"]
    assert not torch.equal(st.mu_codes["w"], old.mu_codes["w"])
    for a, b in zip(list(grads[0].values()) + list(params.values()), snap):
        assert torch.equal(a, b)
    assert (old.mu_codes["w"] == 127).all() and (old.nu_codes["w"] == 0).all()
    assert (old.mu_absmax["w"] == 0).all()


# =============================================================================================
# 3. sharded == unsharded (simulation)
# =============================================================================================
LEAVES_2x2 = {
    "a": ((5, 21), [S0, S1]),
    "b": ((5, 21), [R, S1]),
    "c": ((5, 21), [S1, S1]),  # nested uneven sharding of the last dim
    "d": ((5, 21), [S0, R]),  # blocks whole on every rank
    "k": ((6, 16), [S0, R]),  # whole blocks, no padding (the view path)
    "e": ((3, 5, 13), [S2, S1]),  # last dim over dp, rows over tp
    "f": ((3, 5, 13), [S0, S1]),
    "g": ((9,), [S0, R]),
    "h": ((2,), [S0, S0]),  # empty shards
    "i": ((1, 3), [S0, S1]),  # empty row shards
    "j": ((4, 3), None),  # plain tensor
    "s": ((), [R, R]),  # 0-dim
}
LEAVES_2 = {
    "a": ((5, 21), [S0]),
    "b": ((5, 21), [S1]),
    "e": ((3, 5, 13), [S2]),
    "g": ((37,), [S0]),
    "h": ((4, 1), [S1]),  # last dim of 1 over 2 ranks: one empty shard
}


def _absmax_placements(pl, ndim):
    return [R if isinstance(p, Shard) and p.dim % ndim == ndim - 1 else p for p in pl]


def _find8(state):
    if isinstance(state, ScaleByAdam8bitState):
        return state
    found = [s for s in state if isinstance(s, ScaleByAdam8bitState)]
    assert len(found) == 1
    return found[0]


def _check_sharded(leaves, mesh_shape, names, make_tx, steps=3, seed=1):
    shapes = {k: s for k, (s, _) in leaves.items()}
    params, grads = _values(shapes, steps, seed)
    ref_ups, ref_state, ref_p = _run(make_tx(), params, grads)
    with simulate(math.prod(mesh_shape)):
        m = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        dp = {k: shard(params[k], m, pl) for k, (_, pl) in leaves.items()}
        dg = [{k: shard(g[k], m, pl) for k, (_, pl) in leaves.items()} for g in grads]
        ups, state, out = _run(make_tx(), dp, dg)
        st = _find8(state)
        for k, (shape, pl) in leaves.items():
            if pl is None:
                continue
            assert list(out[k].placements) == list(pl)
            if st.mu_codes[k] is not None:
                assert list(st.mu_codes[k].placements) == list(pl)
                assert list(st.nu_absmax[k].placements) == _absmax_placements(pl, len(shape))
        got = gather((ups, state, out))
    ref = (ref_ups, ref_state, ref_p)
    assert optree.tree_structure(ref, none_is_leaf=True) == optree.tree_structure(
        got, none_is_leaf=True
    )
    for path, a, b in zip(
        tree_paths(ref),
        optree.tree_leaves(ref, none_is_leaf=True),
        optree.tree_leaves(got, none_is_leaf=True),
    ):
        assert (a is None) == (b is None), path
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, path
            assert torch.equal(a, b), (path, (a.double() - b.double()).abs().max())
    return _find8(ref_state)


@pytest.mark.parametrize("block,min_size", [(4, 1), (8, 6)])
def test_sharded_equals_unsharded_2x2(block, min_size):
    st = _check_sharded(
        LEAVES_2x2,
        (2, 2),
        ("dp", "tp"),
        lambda: scale_by_adam(optim_bits=8, min_8bit_size=min_size, block_size=block),
    )
    quantised = {k for k in LEAVES_2x2 if st.mu_codes[k] is not None}
    assert quantised == (set(LEAVES_2x2) if min_size == 1 else set("abcdefgjk"))


def test_sharded_equals_unsharded_1d_adamw():
    _check_sharded(
        LEAVES_2,
        (2,),
        ("tp",),
        lambda: adamw(1e-2, weight_decay=0.1, optim_bits=8, min_8bit_size=8, block_size=4),
        steps=3,
    )


def test_data_axis_and_sub_mesh_leaves():
    """Leaves on the ``tp`` sub-mesh of a dp x tp mesh with per-replica gradients (averaged over
    ``Mesh.data_axis``): bitwise the unsharded run on the mean gradient (dyadic values, so the
    mean is exact)."""
    leaves = {"b": ((5, 21), [S1]), "g": ((9,), [S0]), "r": ((3, 8), [R])}
    shapes = {k: s for k, (s, _) in leaves.items()}
    params, grads = _values(shapes, 2, seed=5)
    _, deltas = _values(shapes, 2, seed=6)
    grads = [{k: torch.round(v * 64) / 64 for k, v in g.items()} for g in grads]
    deltas = [{k: torch.round(v * 64) / 64 for k, v in d.items()} for d in deltas]
    make = lambda: scale_by_adam(optim_bits=8, min_8bit_size=8, block_size=4)  # noqa: E731
    ref = _run(make(), params, grads)
    with simulate(4):
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def on_tp(values, pl):  # values[dp coordinate]
            return distribute_tensor(
                per_rank(4, lambda r: values[r // 2]), m["tp"], pl, src_data_rank=None
            )

        dp = {k: on_tp([params[k]] * 2, pl) for k, (_, pl) in leaves.items()}
        dg = [
            {k: on_tp([g[k] + d[k], g[k] - d[k]], pl) for k, (_, pl) in leaves.items()}
            for g, d in zip(grads, deltas)
        ]
        got = gather(_run(make(), dp, dg, ft.Mesh(m, data_axis="dp")))
    for path, a, b in zip(
        tree_paths(ref),
        optree.tree_leaves(ref, none_is_leaf=True),
        optree.tree_leaves(got, none_is_leaf=True),
    ):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), path


# =============================================================================================
# 4. collective counts
# =============================================================================================
def _counts(layouts, n_leaves, mesh_shape=(2, 2), names=("dp", "tp"), **kw):
    return update_collectives(
        lambda: scale_by_adam(optim_bits=8, min_8bit_size=1, block_size=4, **kw),
        n_leaves,
        mesh_shape,
        names,
        layouts,
    )


def test_collectives_one_all_reduce():
    """The block maxima of every leaf with a sharded last dim are completed by ONE
    ``leaf_sums(op="max")`` call: ONE all-reduce (each rank writes its partial maxima at their
    global offsets), whatever the number of leaves and the mesh dims sharding them."""
    over_tp = [((5, 21), [R, S1]), ((7, 10), [S0, S1]), ((9,), [R, S0]), ((3, 4, 9), [S0, S2])]
    assert _counts(over_tp, 4) == _counts(over_tp, 8) == {"all_reduce": 1}
    # groups {tp}, {dp}, {dp, tp}
    mixed = [((5, 21), [R, S1]), ((3, 5, 13), [S2, S1]), ((5, 21), [S1, S1]), ((6, 8), [S0, R])]
    c4 = _counts(mixed, 4)
    assert c4 == _counts(mixed, 8) == {"all_reduce": 1}
    assert _counts([((5, 21), [S0]), ((9,), [S0])], 6, (2,), ("tp",)) == {"all_reduce": 1}


def test_no_collectives_without_a_sharded_last_dim():
    layouts = [((5, 21), [S0, R]), ((6, 8), [S0, S0]), ((3, 5, 13), [S1, S0]), ((9,), [R, R])]
    assert _counts(layouts, 10) == {}
    # leaves too small for 8 bits are float32, sharded last dims or not
    small = [((5, 21), [R, S1]), ((9,), [S0, R])]
    assert (
        update_collectives(lambda: scale_by_adam(optim_bits=8, min_8bit_size=200), 4, mixed=small)
        == {}
    )


# =============================================================================================
# 5. memory, state layout, errors
# =============================================================================================
def _nbytes(tree):
    return sum(
        x.numel() * x.element_size()
        for x in optree.tree_leaves(tree)
        if isinstance(x, torch.Tensor)
    )


def test_state_memory_about_a_quarter():
    params = {"w": torch.zeros(64, 1024), "e": torch.zeros(300, 256), "b": torch.zeros(1024)}
    s8 = scale_by_adam(optim_bits=8).init(params)
    s32 = scale_by_adam().init(params)
    ratio = _nbytes(s8) / _nbytes(s32)
    n_q = 64 * 1024 + 300 * 256
    blocks = 64 * 4 + 300
    want = (2 * n_q + 2 * 4 * blocks + 2 * 4 * 1024 + 8) / (2 * 4 * (n_q + 1024) + 8)
    assert ratio == pytest.approx(want, rel=1e-12)
    assert 0.25 < ratio < 0.27, ratio
    # large leaves only: 1/4 + one float32 per block of 256 per moment
    big = {"w": torch.zeros(64, 1024)}
    r = _nbytes(scale_by_adam(optim_bits=8).init(big)) / _nbytes(scale_by_adam().init(big))
    assert r == pytest.approx(0.25 + 1 / 256, rel=1e-3)


def test_small_leaves_stay_float32_and_32_bit_is_unchanged():
    params = {
        "big": torch.zeros(64, 64),
        "small": torch.zeros(10, 10),
        "b": torch.zeros(64),
        "i": torch.zeros(5000, dtype=torch.int64),
    }
    st = scale_by_adam(optim_bits=8).init(params)
    assert isinstance(st, ScaleByAdam8bitState)
    assert st.mu["big"] is None and st.mu_codes["big"].shape == (64, 64)
    assert st.mu_absmax["big"].shape == (64, 1)
    for k in ("small", "b"):
        assert st.mu[k].dtype == torch.float32 and st.nu[k].dtype == torch.float32
        assert st.mu_codes[k] is None and st.nu_absmax[k] is None
    assert st.mu_codes["i"] is None  # non-floating leaves are never quantised
    assert isinstance(adam(optim_bits=32).init(params)[0], ScaleByAdamState)
    assert isinstance(adam().init(params)[0], ScaleByAdamState)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: scale_by_adam(optim_bits=16), ValueError, "optim_bits"),
        (lambda: scale_by_adam(optim_bits=True), ValueError, "optim_bits"),
        (lambda: adam(optim_bits=4), ValueError, "optim_bits"),
        (lambda: adamw(optim_bits=64), ValueError, "optim_bits"),
        (lambda: scale_by_adam(optim_bits=8, block_size=0), ValueError, "block_size"),
        (lambda: adam(optim_bits=8, block_size=-8), ValueError, "block_size"),
        (lambda: scale_by_adam(block_size=2.5), TypeError, "block_size"),
        (lambda: scale_by_adam(optim_bits=8, min_8bit_size=-1), ValueError, "min_8bit_size"),
        (lambda: adamw(optim_bits=8, min_8bit_size=-5), ValueError, "min_8bit_size"),
        (lambda: scale_by_adam(optim_bits=8, amsgrad=True), ValueError, "amsgrad"),
        (lambda: quantize_blockwise(torch.zeros(4), block_size=0), ValueError, "block_size"),
        (lambda: create_dynamic_map(False, 5, 8), ValueError, "2\\*\\*total_bits"),
    ],
)
def test_bad_hyper_parameters(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_state_that_does_not_fit_names_the_leaf():
    params = {"w": torch.zeros(4, 20), "b": torch.zeros(3)}
    g = {k: torch.ones_like(v) for k, v in params.items()}
    tx = scale_by_adam(optim_bits=8, min_8bit_size=10, block_size=8)
    with pytest.raises(ValueError, match="expected the ScaleByAdam8bitState"):
        tx.update(g, scale_by_adam().init(params), params)
    other_blocks = scale_by_adam(optim_bits=8, min_8bit_size=10, block_size=4).init(params)
    with pytest.raises(ValueError, match=r"mu_absmax: leaf 'w' has shape \(4, 5\)"):
        tx.update(g, other_blocks, params)
    other_min = scale_by_adam(optim_bits=8, min_8bit_size=100, block_size=8).init(params)
    with pytest.raises(ValueError, match="leaf 'w' .* needs 8-bit moments"):
        tx.update(g, other_min, params)
    with pytest.raises(ValueError, match="dequantize_blockwise: absmax has shape"):
        dequantize_blockwise(torch.zeros(4, 20, dtype=torch.uint8), torch.zeros(4, 2), block_size=8)


@pytest.mark.parametrize("signed", [True, False])
def test_nearest_code_table_equals_bucketize(signed):
    """The CPU lookup table of the default maps gives torch.bucketize's codes: random values,
    every midpoint, its neighbouring floats on both sides, the codes, zeros of both signs,
    subnormals and the ends of the range."""
    from functional_train.quantization import _MAPS, _codes_of, _nearest_table

    code, mid, _ = _MAPS.get(signed, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(200_000, generator=gen) * 2 - 1
    lo = -1.0 if signed else 0.0
    special = torch.cat(
        [
            mid,
            torch.nextafter(mid, torch.tensor(2.0)),
            torch.nextafter(mid, torch.tensor(-2.0)),
            code,
            torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-38, -1e-38, 1e-45, -1e-45]),
        ]
    )
    x = torch.cat([x, x[:5000] * 1e-6, x[:5000] * 1e-3, special]).clamp(lo, 1.0)
    assert _nearest_table(mid) is not None  # the table path is taken for the default maps
    want = torch.bucketize(x, mid, out_int32=True).to(torch.uint8)
    assert torch.equal(_codes_of(x, mid), want)
    n = x.numel() // 10 * 10  # a strided view too
    assert torch.equal(_codes_of(x[:n].view(-1, 10)[:, ::2], mid), want[:n].view(-1, 10)[:, ::2])
    # past the ends (the reciprocal's rounding, infinities, NaN): the codes of the clamped
    # values, which the table gives without clamping
    one = torch.tensor(1.0)
    past = torch.stack(
        [
            torch.nextafter(one, torch.tensor(2.0)),
            torch.tensor(1.5),
            torch.tensor(float("inf")),
            torch.nextafter(-one, torch.tensor(-2.0)),
            torch.tensor(-3.0),
            torch.tensor(float("-inf")),
            torch.tensor(float("nan")),
        ]
    )
    want = torch.bucketize(past.clamp(-1.0, 1.0), mid, out_int32=True).to(torch.uint8)
    assert torch.equal(_codes_of(past, mid), want)
