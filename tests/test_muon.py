"""Muon (functional_train/muon.py) against torch.optim.Muon and against its equations in
float64; labels; errors. Sharded == unsharded is swept (tests/test_sweep.py: scale_by_muon,
muon) and shown on uneven 2-D meshes here."""

import math
import re

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import functional_train as ft
from functional_train.muon import MuonDimensionNumbers
from functional_train.testing import assert_sharded_equivalent
from functional_train.tree import find_state

_muon = pytest.importorskip("torch.optim._muon")

SHAPES = [(16, 16), (40, 12), (9, 33)]  # square, tall, wide


@pytest.mark.parametrize("shape", SHAPES + [(1, 7), (7, 1)])
def test_newton_schulz_is_torchs_bit_for_bit(shape):
    """bfloat16 Newton-Schulz equals torch.optim.Muon's, bit for bit, and leaves its input."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    ours = ft.newton_schulz(x)
    ref = _muon._zeropower_via_newtonschulz(x.clone(), (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref)
    assert torch.equal(x, before)


OPTIONS = {
    "defaults": dict(),
    "no nesterov": dict(nesterov=False),
    "match_rms_adamw": dict(adjust_lr_fn="match_rms_adamw"),
    "original, 3 steps, own coefficients, eps": dict(
        adjust_lr_fn="original", ns_steps=3, ns_coefficients=(3.0, -3.2, 1.2), eps=1e-3
    ),
    "no decay": dict(weight_decay=0.0),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_muon_equals_torch_optim_muon(name):
    """20 steps of ``ft.muon`` (every leaf a matrix: all Muon) equal ``torch.optim.Muon`` with
    the same arguments: parameters within 1e-5 of their change plus 4 float32 ulps (the
    update's roundings differ: torch scales the parameter by ``1 - lr wd`` then adds
    ``-lr ratio O``; the chain adds ``-lr (ratio O + wd p)``), momentum buffers bit for bit."""
    kw = dict(OPTIONS[name])
    wd = kw.pop("weight_decay", 0.1)
    gen = torch.Generator().manual_seed(1)
    p0 = [torch.randn(s, generator=gen) for s in SHAPES]
    ref = [torch.nn.Parameter(x.clone()) for x in p0]
    momentum = 0.9
    opt = torch.optim.Muon(ref, lr=2e-2, weight_decay=wd, momentum=momentum, **kw)
    tx = ft.muon(2e-2, weight_decay=wd, beta=momentum, **kw)
    params = {f"w{i}": x.clone() for i, x in enumerate(p0)}
    state = tx.init(params)
    for _ in range(20):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        params, state = ft.step(tx, {f"w{i}": g for i, g in enumerate(grads)}, state, params)
    for i, (r, x0) in enumerate(zip(ref, p0)):
        ours, theirs = params[f"w{i}"], r.detach()
        change = (theirs - x0).abs().max()
        ulps = 4 * torch.finfo(torch.float32).eps * theirs.abs().max()
        assert (ours - theirs).abs().max() <= 1e-5 * change + ulps, SHAPES[i]
        mu = find_state(state, ft.ScaleByMuonState, "test").mu[f"w{i}"]
        assert torch.equal(mu, opt.state[r]["momentum_buffer"])


def _reference_muon(p, grads, lr, wd, beta, nesterov, coeffs, steps, eps, adjust, dims=None):
    """The equations, written out in float64 (one leaf). ``dims``: ``(output axes, reduction
    axes)`` of the leaf's matrices (default the last two axes); every other axis is a batch
    axis, each of its indices a matrix of its own."""
    a, b, c = coeffs
    out, red = dims or ((p.ndim - 2,), (p.ndim - 1,))
    batch = [d for d in range(p.ndim) if d not in out + red]
    order = batch + list(out) + list(red)
    rows = math.prod(p.shape[d] for d in out)
    cols = math.prod(p.shape[d] for d in red)
    ratio = (
        0.2 * math.sqrt(max(rows, cols))
        if adjust == "match_rms_adamw"
        else math.sqrt(max(1, rows / cols))
    )
    buf = torch.zeros_like(p)
    for g in grads:
        buf = beta * buf + (1 - beta) * g
        u = (1 - beta) * g + beta * buf if nesterov else buf
        moved = u.permute(order)
        mats = moved.reshape(-1, rows, cols)
        o = torch.empty_like(mats)
        for k in range(mats.shape[0]):
            m = mats[k]
            x = m.T if rows > cols else m
            x = x / max(torch.linalg.matrix_norm(x).item(), eps)
            for _ in range(steps):
                A = x @ x.T
                x = a * x + (b * A + c * A @ A) @ x
            o[k] = x.T if rows > cols else x
        o = o.reshape(moved.shape).permute([order.index(d) for d in range(p.ndim)])
        p = p - lr * (ratio * o + wd * p)
    return p


# float64 leaves: (shape, MuonDimensionNumbers or None, (output axes, reduction axes))
FLOAT64_LEAVES = {
    **{f"w{i}": (s, None, None) for i, s in enumerate(SHAPES)},
    # stacked experts (E, d_out, d_in): by default E matrices
    "experts": ((3, 6, 4), None, None),
    # a convolution's filters (out, in, kh, kw) as one out x (in kh kw) matrix
    "conv": (
        (6, 2, 3, 3),
        MuonDimensionNumbers(reduction_axis=(1, 2, 3), output_axis=0),
        ((0,), (1, 2, 3)),
    ),
    # (in, out) like transformers' Conv1D, with a batch axis between them
    "conv1d": ((5, 2, 7), MuonDimensionNumbers(reduction_axis=0, output_axis=-1), ((2,), (0,))),
}


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_float64_equals_the_equations(x64, adjust, nesterov):
    """With ``ns_dtype=torch.float64`` on float64 leaves (square, tall and wide matrices,
    stacked experts orthogonalised one by one, a 4-D convolution filter flattened to ``(out,
    in * kh * kw)`` and an ``(in, batch, out)`` leaf, given by ``weight_dimension_numbers``),
    6 steps equal the equations to 1e-12 of the parameter change."""
    gen = torch.Generator().manual_seed(2)
    p0 = {
        k: torch.randn(s, generator=gen, dtype=torch.float64)
        for k, (s, _, _) in FLOAT64_LEAVES.items()
    }
    grads = [
        {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in p0.items()}
        for _ in range(6)
    ]
    tx = ft.muon(
        3e-2,
        weight_decay=0.05,
        beta=0.8,
        nesterov=nesterov,
        ns_dtype=torch.float64,
        adjust_lr_fn=adjust,
        weight_dimension_numbers={k: d for k, (_, d, _) in FLOAT64_LEAVES.items()},
    )
    p, s = p0, tx.init(p0)
    for g in grads:
        p, s = ft.step(tx, g, s, p)
    for k in p0:
        ref = _reference_muon(
            p0[k],
            [g[k] for g in grads],
            3e-2,
            0.05,
            0.8,
            nesterov,
            (3.4445, -4.775, 2.0315),
            5,
            1e-7,
            adjust,
            FLOAT64_LEAVES[k][2],
        )
        assert (p[k] - ref).abs().max() <= 1e-12 * (ref - p0[k]).abs().max(), k


def test_stacked_experts_equal_torch_muon_per_expert():
    """A stacked ``(E, d_out, d_in)`` leaf (tall experts, and wide ones inside a 4-D
    ``(layers, E, d_out, d_in)`` stack) is E (L x E) matrices: 12 steps of ``ft.muon`` equal
    ``torch.optim.Muon`` on each expert as a parameter of its own (its bfloat16 Newton-Schulz
    and shape ratio ``sqrt(max(1, d_out / d_in))``), the parameters within 1e-5 of their change
    plus 4 float32 ulps, the momentum buffers bit for bit. (Orthogonalising the flattened
    ``(E, d_out * d_in)`` matrix moves each expert by a different amount.)"""
    gen = torch.Generator().manual_seed(11)
    shapes = {"experts": (4, 9, 5), "stack": (2, 3, 4, 7)}
    p0 = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    refs = {
        k: [torch.nn.Parameter(e.clone()) for e in v.reshape(-1, *v.shape[-2:])]
        for k, v in p0.items()
    }
    opt = torch.optim.Muon(
        [q for r in refs.values() for q in r], lr=2e-2, weight_decay=0.1, momentum=0.9
    )
    # (a 4-D leaf is a convolution's filters by default: the stack names its matrix axes)
    dims = {"experts": None, "stack": MuonDimensionNumbers()}
    tx = ft.muon(2e-2, weight_decay=0.1, beta=0.9, weight_dimension_numbers=dims)
    assert ft.muon_param_labels(p0) == {"experts": "muon", "stack": "muon"}
    params = dict(p0)
    state = tx.init(params)
    for _ in range(12):
        grads = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
        for k, r in refs.items():
            for q, g in zip(r, grads[k].reshape(-1, *shapes[k][-2:])):
                q.grad = g.clone()
        opt.step()
        params, state = ft.step(tx, grads, state, params)
    mu = find_state(state, ft.ScaleByMuonState, "test").mu
    for k, r in refs.items():
        theirs = torch.stack([q.detach() for q in r]).reshape(shapes[k])
        change = (theirs - p0[k]).abs().max()
        ulps = 4 * torch.finfo(torch.float32).eps * theirs.abs().max()
        assert (params[k] - theirs).abs().max() <= 1e-5 * change + ulps, k
        buffers = torch.stack([opt.state[q]["momentum_buffer"] for q in r])
        assert torch.equal(mu[k], buffers.reshape(shapes[k])), k


def test_labels_route_vectors_embeddings_and_head_to_adam():
    params = {
        "embed": torch.zeros(10, 4),
        "layers.0.wq": torch.zeros(4, 4),
        "layers.0.norm": torch.zeros(4),
        "layers.0.b1": torch.zeros(8),
        "conv.weight": torch.zeros(3, 2, 3, 3),
        "lm_head": torch.zeros(10, 4),
        "scale": torch.zeros(()),
    }
    assert ft.muon_param_labels(params) == {
        "embed": "adam",
        "layers.0.wq": "muon",
        "layers.0.norm": "adam",
        "layers.0.b1": "adam",
        "conv.weight": "muon",
        "lm_head": "adam",
        "scale": "adam",
    }
    assert ft.muon_param_labels(params, exclude=("wq",))["embed"] == "muon"
    assert ft.muon_param_labels(params, exclude=("wq",))["layers.0.wq"] == "adam"
    with pytest.raises(TypeError, match="sequence of strings"):
        ft.muon_param_labels(params, exclude="embed")
    for bad in ("", "output..weight", ".weight"):
        with pytest.raises(ValueError, match=f"exclude entry '{re.escape(bad)}' has an empty"):
            ft.muon_param_labels(params, exclude=("embed", bad))


def _labels(module, **kw):
    """``muon_param_labels`` of a module's ``named_parameters()`` dict, as ``{"muon": [...],
    "adam": [...]}`` (names in order)."""
    params = {k: v.detach() for k, v in module.named_parameters()}
    labels = ft.muon_param_labels(params, **kw)
    return {lab: [k for k in params if labels[k] == lab] for lab in ("muon", "adam")}


def test_labels_of_bert_and_vit_keep_their_hidden_matrices():
    """transformers' BertModel and ViTModel (tiny configs): every hidden matrix of each layer is
    Muon's, the attention output projection (``attention.output.dense``) and the FFN's second
    matrix (``output.dense``) included (a component named ``output`` is not an output head);
    the embeddings (word, position, token type; ViT's patch projection, position embeddings and
    class token, 3-D and 4-D) and every vector are AdamW's."""
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=30,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=12,
            max_position_embeddings=16,
        )
    )
    got = _labels(bert)
    layer = "encoder.layer.0."
    assert got["muon"] == [
        layer + "attention.self.query.weight",
        layer + "attention.self.key.weight",
        layer + "attention.self.value.weight",
        layer + "attention.output.dense.weight",
        layer + "intermediate.dense.weight",
        layer + "output.dense.weight",
        "pooler.dense.weight",
    ]
    assert {k for k in got["adam"] if not k.endswith("bias") and "LayerNorm" not in k} == {
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
    }
    vit = transformers.ViTModel(
        transformers.ViTConfig(
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=12,
            image_size=8,
            patch_size=4,
        )
    )
    got = _labels(vit)
    params = dict(vit.named_parameters())
    assert got["muon"] == [k for k, v in params.items() if v.ndim == 2 and "embeddings" not in k]
    assert len(got["muon"]) == 7  # q, k, v, o, fc1 / intermediate, fc2 / output, pooler
    assert {k for k in got["adam"] if params[k].ndim >= 2} == {
        "embeddings.cls_token",
        "embeddings.position_embeddings",
        "embeddings.patch_embeddings.projection.weight",
    }


def test_labels_of_torch_decoder_gpt2_and_torchtitan_names():
    """``nn.TransformerDecoderLayer``: its cross-attention ``multihead_attn`` matrices are
    Muon's like the self-attention's and the FFN's; GPT-2 (transformers, tied head): ``wte``
    and ``wpe`` are AdamW's; a torchtitan Llama / MoE naming: ``tok_embeddings`` and the final
    projection ``output`` are AdamW's, the attention, FFN, router and stacked experts Muon's."""
    dec = torch.nn.TransformerDecoderLayer(8, 2, 12)
    got = _labels(dec)
    assert got["muon"] == [
        "self_attn.in_proj_weight",
        "self_attn.out_proj.weight",
        "multihead_attn.in_proj_weight",
        "multihead_attn.out_proj.weight",
        "linear1.weight",
        "linear2.weight",
    ]
    assert all(dict(dec.named_parameters())[k].ndim == 1 for k in got["adam"])

    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=30, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    )
    got = _labels(gpt2)
    assert got["muon"] == [
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
    ]
    assert [k for k in got["adam"] if k.endswith("weight") and "ln" not in k] == [
        "transformer.wte.weight",
        "transformer.wpe.weight",
    ]

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (
                torch.nn.Linear(8, 8, bias=False) for _ in range(4)
            )

    class MoE(torch.nn.Module):  # torchtitan's GroupedExperts and TokenChoiceTopKRouter names
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.Module()
            self.experts.w1 = torch.nn.Parameter(torch.zeros(4, 12, 8))
            self.experts.w2 = torch.nn.Parameter(torch.zeros(4, 8, 12))
            self.router = torch.nn.Module()
            self.router.gate = torch.nn.Linear(8, 4, bias=False)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.moe = Attention(), MoE()
            self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(8), torch.nn.RMSNorm(8)

    class Titan(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(30, 8)
            self.layers = torch.nn.ModuleDict({"0": Block()})
            self.norm = torch.nn.RMSNorm(8)
            self.output = torch.nn.Linear(8, 30, bias=False)

    got = _labels(Titan())
    assert got == {
        "muon": [
            "layers.0.attention.wq.weight",
            "layers.0.attention.wk.weight",
            "layers.0.attention.wv.weight",
            "layers.0.attention.wo.weight",
            "layers.0.moe.experts.w1",
            "layers.0.moe.experts.w2",
            "layers.0.moe.router.gate.weight",
        ],
        "adam": [
            "tok_embeddings.weight",
            "layers.0.attention_norm.weight",
            "layers.0.ffn_norm.weight",
            "norm.weight",
            "output.weight",
        ],
    }
    # the same names one module deeper (a wrapper's "model." prefix) label alike
    wrapper = torch.nn.Module()
    wrapper.model = Titan()
    assert _labels(wrapper)["adam"][-1] == "model.output.weight"


def test_muon_trains_the_others_with_adamw():
    """The ``adam`` leaves take exactly ``adamw(learning_rate, weight_decay=weight_decay)``
    (or the transform given)."""
    gen = torch.Generator().manual_seed(3)
    params = {
        "embed": torch.randn(10, 4, generator=gen),
        "w": torch.randn(4, 4, generator=gen),
        "bias": torch.randn(4, generator=gen),
    }
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    for adam in (None, ft.sgd(0.5)):
        tx = ft.muon(1e-2, weight_decay=0.1, adam=adam)
        other = ft.adamw(1e-2, weight_decay=0.1) if adam is None else ft.sgd(0.5)
        u, _ = tx.update(grads, tx.init(params), params)
        sub = {k: params[k] for k in ("embed", "bias")}
        v, _ = other.update({k: grads[k] for k in sub}, other.init(sub), sub)
        for k in sub:
            assert torch.equal(u[k], v[k])


def test_errors_name_the_leaf_and_the_expectation():
    tx = ft.scale_by_muon()
    p = {"layers": {"bias": torch.zeros(3)}}
    with pytest.raises(ValueError, match=r"leaf 'layers.bias' has shape \(3,\).*muon_param"):
        tx.update(p, tx.init(p), p)
    c = {"w": torch.zeros(2, 2, dtype=torch.complex64)}
    with pytest.raises((ValueError, TypeError), match="complex"):
        tx.update(c, tx.init(c), c)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        ft.scale_by_muon(adjust_lr_fn="rms")
    with pytest.raises(ValueError, match="ns_steps"):
        ft.scale_by_muon(ns_steps=100)
    with pytest.raises(ValueError, match="ns_coefficients"):
        ft.scale_by_muon(ns_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="names no transform"):
        ft.muon(param_labels={"w": "sgd"}).init({"w": torch.zeros(2, 2)})


@pytest.mark.parametrize(
    "mesh_shape,placements",
    [
        ((2,), {"w": [Shard(0)], "t": [Shard(1)], "c": [Replicate()]}),
        ((3,), {"w": [Shard(1)], "t": [Shard(0)], "c": [Shard(0)]}),  # uneven and empty shards
        (
            (2, 2),
            {"w": [Shard(0), Shard(1)], "t": [Shard(1), Shard(0)], "c": [Replicate(), Shard(2)]},
        ),
    ],
)
def test_sharded_equals_unsharded_bit_for_bit(mesh_shape, placements):
    """Tensor-parallel placements on 1-D and 2-D simulated meshes, uneven and empty shards: each
    matrix's owner assembles it whole, so the result is the unsharded one bit for bit (bfloat16
    Newton-Schulz)."""
    gen = torch.Generator().manual_seed(4)
    params = {
        "w": torch.randn(7, 5, generator=gen),
        "t": torch.randn(2, 9, generator=gen),
        "c": torch.randn(4, 2, 3, generator=gen),
        "bias": torch.randn(5, generator=gen),
    }
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(3)]
    pl = dict(placements, bias=[Replicate()] * len(mesh_shape))
    assert_sharded_equivalent(
        ft.muon(1e-2, weight_decay=0.1),
        params,
        grads,
        mesh_shape=mesh_shape,
        placements=pl,
        rtol=0.0,
        atol=0.0,
    )


# stacked / batched leaves on simulated meshes: (shape, MuonDimensionNumbers or None, placements)
_CONV = MuonDimensionNumbers(reduction_axis=(1, 2, 3), output_axis=0)
_MIDDLE = MuonDimensionNumbers(reduction_axis=0, output_axis=-1)  # (in, batch, out)
BATCHED = {
    "experts on ep": ((2,), {"e": ((5, 6, 4), None, [Shard(0)])}),  # uneven: 3 + 2 experts
    "an empty expert shard": ((3,), {"e": ((2, 4, 7), None, [Shard(0)])}),
    "experts on a matrix dim": ((2,), {"e": ((5, 6, 4), None, [Shard(1)])}),
    "(ep, tp)": (
        (2, 2),
        {
            "e": ((5, 6, 4), None, [Shard(0), Shard(2)]),  # tp on d_in: at owners
            "f": ((3, 5, 4), None, [Shard(0), Shard(0)]),  # over both, on the experts only
            "g": ((4, 3, 7), None, [Replicate(), Shard(0)]),  # ep replicas of tp-split experts
        },
    ),
    "conv filters, (in, batch, out)": (
        (2,),
        {
            "conv": ((6, 2, 3, 3), _CONV, [Shard(0)]),  # the output axis split: at owners
            "conv_in": ((6, 2, 3, 3), _CONV, [Shard(2)]),  # a reduction axis split
            "mid": ((5, 4, 7), _MIDDLE, [Shard(1)]),  # the batch axis split: local
        },
    ),
}


@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_leaves_sharded_equal_unsharded_bit_for_bit(name):
    """Leaves of more than 2 dims split on their batch axes (stacked experts over ep, uneven
    and empty shards), on their matrix axes, or both, on 1-D and (ep, tp) simulated meshes,
    with default and given dimension numbers: 3 steps of ``ft.muon`` equal one process's bit
    for bit (each matrix goes through the same 2-D Newton-Schulz wherever it runs)."""
    mesh_shape, leaves = BATCHED[name]
    gen = torch.Generator().manual_seed(12)
    params = {k: torch.randn(s, generator=gen) for k, (s, _, _) in leaves.items()}
    params["w"] = torch.randn(7, 5, generator=gen)
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(3)]
    pl = {k: p for k, (_, _, p) in leaves.items()}
    pl["w"] = [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1)
    dims = {k: d for k, (_, d, _) in leaves.items()}
    dims["w"] = None
    assert_sharded_equivalent(
        ft.muon(1e-2, weight_decay=0.1, weight_dimension_numbers=dims),
        params,
        grads,
        mesh_shape=mesh_shape,
        placements=pl,
        rtol=0.0,
        atol=0.0,
    )


def test_leaves_split_on_batch_axes_only_need_no_collectives():
    """On a simulated (ep, tp) mesh, stacked experts split over ep (replicated over tp), over
    both dims, or an ``(in, batch, out)`` leaf split on its batch axis: every rank holds whole
    matrices and orthogonalises its own, with no collective, and gets the unsharded result's
    block bit for bit; a tensor parallel matrix in the same tree still goes to its owner (one
    all-to-all each way over the world)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from functional_train.testing import count_collectives, on_rank, simulate

    gen = torch.Generator().manual_seed(13)
    layout = {
        "experts": ((5, 6, 4), [Shard(0), Replicate()]),
        "both": ((6, 4, 5), [Shard(0), Shard(0)]),
        "mid": ((5, 4, 7), [Replicate(), Shard(1)]),
    }
    dims = {"experts": None, "both": None, "mid": _MIDDLE, "w": None}
    values = {k: torch.randn(s, generator=gen) for k, (s, _) in layout.items()}
    values["w"] = torch.randn(7, 5, generator=gen)
    tx = ft.scale_by_muon(weight_dimension_numbers=dims)
    want = tx.update(values, tx.init(values), values)[0]
    for tp_matrix in (False, True):
        tree_values = values if tp_matrix else {k: v for k, v in values.items() if k != "w"}
        tx = ft.scale_by_muon(weight_dimension_numbers={k: dims[k] for k in tree_values})
        with simulate(4):
            m = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
            pls = {k: pl for k, (_, pl) in layout.items()}
            pls["w"] = [Replicate(), Shard(1)]
            tree = {k: distribute_tensor(v, m, pls[k]) for k, v in tree_values.items()}
            state = tx.init(tree)
            with count_collectives() as c:
                got, _ = tx.update(tree, state, tree, mesh=ft.Mesh(m))
            full = {k: [on_rank(v.full_tensor(), r) for r in range(4)] for k, v in got.items()}
        assert c.counts == ({"all_to_all_single": 2} if tp_matrix else {}), c.counts
        for k, per_rank_values in full.items():
            for r, v in enumerate(per_rank_values):
                assert torch.equal(v, want[k]), (k, r)


def test_dimension_numbers_errors_name_the_leaf():
    """Bad axes are reported at ``init`` (and ``update``) with the leaf's path and shape; bad
    fields when the ``MuonDimensionNumbers`` is made; a tree without the params' structure or
    with another kind of leaf, naming the leaf."""
    with pytest.raises(TypeError, match="reduction_axis must be an int or a sequence of ints"):
        MuonDimensionNumbers(reduction_axis=1.5)
    with pytest.raises(TypeError, match="output_axis must be an int or a sequence of ints"):
        MuonDimensionNumbers(output_axis=True)
    with pytest.raises(ValueError, match="output_axis must name at least one axis"):
        MuonDimensionNumbers(output_axis=())
    assert MuonDimensionNumbers([1, 2], 0) == MuonDimensionNumbers((1, 2), (0,))
    p = {"moe": {"w1": torch.zeros(2, 3, 4)}, "w": torch.zeros(3, 3)}
    tx = ft.scale_by_muon(weight_dimension_numbers=MuonDimensionNumbers(reduction_axis=3))
    with pytest.raises(
        ValueError,
        match=r"leaf 'moe.w1' has shape \(2, 3, 4\); MuonDimensionNumbers\(reduction_axis=\(3,\), "
        r"output_axis=\(-2,\)\) names axis 3 in reduction_axis, which a 3-dim leaf does not have",
    ):
        tx.init(p)
    overlap = MuonDimensionNumbers(reduction_axis=(1, 2), output_axis=-1)
    for tx in (
        ft.scale_by_muon(weight_dimension_numbers={"moe": {"w1": overlap}, "w": None}),
        ft.muon(weight_dimension_numbers=lambda params: {"moe": {"w1": overlap}, "w": None}),
    ):
        with pytest.raises(ValueError, match=r"leaf 'moe.w1' .* names its axis 2 twice"):
            tx.init(p)
    tx = ft.scale_by_muon(weight_dimension_numbers={"moe": {"w1": None}, "w": None})
    state = tx.init(p)
    q = {"moe": {"w1": torch.zeros(2, 3)}, "w": torch.zeros(3, 3)}  # (at update too)
    with pytest.raises(ValueError, match=r"leaf 'moe.w1' has shape \(2, 3\)"):
        ft.scale_by_muon(weight_dimension_numbers=overlap).update(q, state, q)
    with pytest.raises(ValueError, match="weight_dimension_numbers does not have the structure"):
        ft.scale_by_muon(weight_dimension_numbers={"w": None}).init(p)
    with pytest.raises(TypeError, match="weight_dimension_numbers leaf 'w' must be a Muon"):
        ft.scale_by_muon(weight_dimension_numbers={"moe": {"w1": None}, "w": "last"}).init(p)


def test_dimension_numbers_function_through_torch_optimizer():
    """A function of the params as ``weight_dimension_numbers`` (the convolution flattened,
    the experts stacked) through :class:`TorchOptimizer`, whose ``inject_hyperparams`` must not
    take it for a schedule: 3 steps equal the functional ones bit for bit."""
    import optree

    def dims(params):
        return optree.tree_map(
            lambda x: _CONV if x is not None and x.ndim == 4 else None, params, none_is_leaf=True
        )

    gen = torch.Generator().manual_seed(14)
    model = torch.nn.Module()
    model.conv = torch.nn.Conv2d(2, 6, 3)
    model.experts = torch.nn.Parameter(torch.randn(3, 5, 4, generator=gen))
    p0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = ft.TorchOptimizer(
        model.named_parameters(), ft.muon(1e-2, weight_decay=0.1, weight_dimension_numbers=dims)
    )
    tx = ft.muon(1e-2, weight_decay=0.1, weight_dimension_numbers=dims)
    params, state = dict(p0), tx.init(p0)
    for _ in range(3):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in p0.items()}
        for k, p in model.named_parameters():
            p.grad = g[k].clone()
        opt.step()
        params, state = ft.step(tx, g, state, params)
    for k, p in model.named_parameters():
        assert torch.equal(p.detach(), params[k]), k
    assert not torch.equal(params["conv.weight"], p0["conv.weight"])


def test_collectives_constant_in_the_number_of_leaves():
    """Only all-to-alls, batched: the same count for 10 and 40 matrices of mixed placements on a
    simulated 2 x 2 (dp, tp) mesh (uneven, empty shards). The leaves live on three meshes (the
    2-D mesh, which is the world, and its tp and dp sub-meshes), each routed on its own: one
    all-to-all each way on each: 6."""
    from functional_train.testing import count_collectives, simulate
    from test_collective_counts import _KINDS, _leaf, _mesh

    kinds = [k for k in _KINDS if len(k[2]) == 2]
    counts = []
    for n in (10, 40):
        gen = torch.Generator().manual_seed(n)
        with simulate(4):
            m = _mesh()
            tree = {
                f"l{i:02d}": _leaf(
                    m, kinds[i % len(kinds)], torch.randn(kinds[i % len(kinds)][2], generator=gen)
                )
                for i in range(n)
            }
            tx = ft.scale_by_muon()
            state = tx.init(tree)
            with count_collectives() as c:
                tx.update(tree, state, tree, mesh=ft.Mesh(m))
        counts.append(c.counts)
    assert counts[0] == counts[1] == {"all_to_all_single": 6}, counts


@pytest.mark.parametrize(
    "mesh_shape,kind,flat,collectives,max_bytes",
    [
        ((4,), "tp", False, 2, 2.0),  # 1-D tensor parallel: one all-to-all each way
        ((4,), "replicated", False, 1, 1.0),  # data parallel: no gather, one all-to-all back
        ((2, 2), "tp", True, 2, 2.0),  # (dp, tp), the world: one each way over the world
        ((2, 2), "fsdp+tp", True, 2, 2.5),
        ((2, 2), "tp", False, 3, 2.0),  # a sub-mesh: gather over tp; scatter over tp,
        ((2, 2), "fsdp+tp", False, 4, 2.5),  # broadcast over dp; sharded over both: two each way
    ],
)
def test_owner_routing_balances_flops_and_bounds_bytes(
    mesh_shape, kind, flat, collectives, max_bytes
):
    """The routing of 42 matrices (a 6-layer model's, uneven shards): a constant number of
    all-to-alls (one over the whole mesh each way when the mesh is the world, else one per
    mesh dim); every rank's Newton-Schulz multiply-adds within 10% of 1/N of the total
    (against the whole total when every rank gathers every matrix); bytes every rank sends to
    others at most ``max_bytes`` x the bytes of its own blocks (its share)."""
    from functional_train.engine.owners import owner_plan
    from functional_train.muon import _ns_cost

    layer = [(33, 16)] * 3 + [(16, 33), (65, 16), (65, 16), (16, 65)]
    shapes = layer * 6
    tp = [Shard(1) if s[0] == 16 else Shard(0) for s in shapes]
    lead = {"tp": Replicate(), "fsdp+tp": Shard(0)}.get(kind)
    pls = [
        (Replicate(),) * len(mesh_shape)
        if kind == "replicated"
        else (t,)
        if len(mesh_shape) == 1
        else (lead, t)
        for t in tp
    ]
    costs = [_ns_cost(s) for s in shapes]
    plan = owner_plan(mesh_shape, shapes, pls, costs, flat)
    assert plan.collectives == collectives
    ranks = len(plan.coords)
    assert sum(plan.flops.values()) == pytest.approx(sum(costs))
    assert max(plan.flops.values()) <= 1.1 * sum(costs) / ranks
    for c in plan.coords:
        assert plan.sent[c] <= max_bytes * plan.held[c], (c, plan.sent[c] / plan.held[c])
    # every owner's blocks and results are whole: an owner holds the global matrix
    for c in plan.coords:
        for j, pieces, _placed in plan.computed[c]:
            assert plan.owners[j] == c
            assert sum(p[3] for p in pieces) == math.prod(shapes[j])


@pytest.mark.slow
def test_owners_on_4_gloo_ranks(ranks):
    """``ft.muon`` at dp=2 x tp=2 on 4 real gloo ranks, 3 steps (tests/_gloo_muon_worker.py),
    with tensor parallel, FSDP + tensor parallel and ``zero_redundancy`` layouts, uneven shards,
    and stacked experts (tensor parallel on a matrix axis; split on the expert axis only): the
    parameters equal one process's bit for bit, with Newton-Schulz at owner ranks and gathered
    onto every rank alike. At owners every rank runs about a quarter of the multiply-adds (each
    matrix once in all), where gathering runs all of them on every rank (but the experts split
    on their expert axis: each rank its own); the mesh is the world: one all-to-all each way
    over it (inside ZeRO its all-gather of the updates comes on top), and every rank sends at
    most 2.25x the mean share of a rank to others (the messages are padded to the longest)."""
    import _gloo_muon_worker as w

    res = ranks.run(4, "_gloo_muon_worker:main", timeout=600)[0]
    params, grads = w.problem()
    tx = w.make_tx()
    state = tx.init(params)
    for g in grads:
        params, state = ft.step(tx, g, state, params)
    total = sum(w.ns_cost(s) for s in w.SHAPES.values() if len(s) >= 2)
    own = w.ns_cost(w.SHAPES["routed"]) / 4  # one routed expert per rank, never gathered
    expected = {
        "tp": {"all_to_all_single": 2},
        "fsdp+tp": {"all_to_all_single": 2},
        "zero+tp": {"all_to_all_single": 2, "all_gather_into_tensor": 1},
    }
    for layout in w.LAYOUTS:
        for scheme in ("owners", "gather"):
            got = res[(layout, scheme)]
            for k in params:
                assert torch.equal(got["params"][k], params[k]), (layout, scheme, k)
        owners, gather = res[(layout, "owners")]["ranks"], res[(layout, "gather")]["ranks"]
        assert sum(r["flops"] for r in owners) == total
        assert all(r["flops"] == total - 3 * own for r in gather)
        assert max(r["flops"] for r in owners) <= 1.1 * total / 4
        share = sum(r["share"] for r in owners) / 4  # (uneven: ranks' shares differ)
        for r in owners:
            assert r["counts"] == expected[layout], (layout, r["counts"])
            # over the world of 4: 3/4 of each input goes to the other ranks
            assert r["bytes"]["all_to_all_single"] * 3 / 4 <= 2.25 * share, (layout, r)


def test_torch_optimizer_groups_and_a_scheduler():
    """As a ``TorchOptimizer``: one group per label, both holding ``lr`` (and the Muon group
    ``weight_decay`` and ``beta``), so a torch LR scheduler drives both; the steps equal the
    functional ones under the same schedule."""
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10)
    )
    labels = {
        "0.weight": "adam",
        "1.weight": "muon",
        "1.bias": "adam",
        "2.weight": "muon",
        "2.bias": "adam",
    }
    p0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = ft.TorchOptimizer(
        model.named_parameters(), ft.muon(1e-2, weight_decay=0.1, param_labels=labels)
    )
    assert sorted(g["label"] for g in opt.param_groups) == ["adam", "muon"]
    muon_group = next(g for g in opt.param_groups if g["label"] == "muon")
    assert muon_group["lr"] == 1e-2 and muon_group["weight_decay"] == 0.1
    assert muon_group["beta"] == 0.95
    adam_group = next(g for g in opt.param_groups if g["label"] == "adam")
    assert "beta" not in adam_group and adam_group["betas"] == (0.9, 0.999)  # (nothing leaks)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in p0.items()} for _ in range(3)]
    params = dict(p0)
    for t, g in enumerate(grads):
        for k, p in model.named_parameters():
            p.grad = g[k].clone()
        opt.step()
        sched.step()
        tx = ft.muon(1e-2 / (1 + t), weight_decay=0.1, param_labels=labels)
        if t == 0:
            state = tx.init(params)
        params, state = ft.step(tx, g, state, params)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), params[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("axis", ["pipeline", "expert"])
def test_pipeline_stages_and_expert_ranks_bit_for_bit(axis):
    """(2 pp x 2 tp) with ``Mesh(pipeline_axis="pp")``: each stage's ranks hold their own
    matrices (tensor parallel ``Shard(0)`` / ``Shard(1)`` on the stage's tp sub-mesh, uneven);
    (2 ep x 2 tp) with ``Mesh(expert_axis="ep", is_expert=...)``: each ep rank holds its own
    experts and the dense matrices are replicated over ep. 3 steps of ``ft.muon`` equal, bit for
    bit, one process running each stage's (each ep rank's) own tree; the owners route within
    each tp sub-mesh (one all-to-all each way)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from functional_train.testing import count_collectives, on_rank, per_rank, simulate

    gen = torch.Generator().manual_seed(7)
    shapes = {"a": ((7, 5), Shard(0)), "b": ((5, 9), Shard(1)), "c": ((3, 4), Replicate())}
    steps = 3

    def own():  # per pp stage / ep rank
        return [
            {k: torch.randn(s, generator=gen) for k, (s, _) in shapes.items()} for _ in range(2)
        ]

    P, G = own(), [own() for _ in range(steps)]
    tx = ft.muon(1e-2, weight_decay=0.1)
    want = []
    for s in range(2):
        p, state = dict(P[s]), tx.init(P[s])
        for g in G:
            p, state = ft.step(tx, g[s], state, p)
        want.append(p)
    name = "pp" if axis == "pipeline" else "ep"
    with simulate(4):
        m = init_device_mesh("cpu", (2, 2), mesh_dim_names=(name, "tp"))
        mesh = (
            ft.Mesh(m, pipeline_axis="pp")
            if axis == "pipeline"
            else ft.Mesh(m, expert_axis="ep", is_expert=lambda path: path.startswith("expert"))
        )

        def tree(per):
            out = {}
            for k, (_, pl) in shapes.items():
                v = per_rank(4, lambda r, k=k: per[r // 2][k])
                out[f"expert_{k}" if axis == "expert" else k] = distribute_tensor(
                    v, m["tp"], [pl], src_data_rank=None
                )
            if axis == "expert":  # a dense matrix, the same on every rank
                out["dense"] = distribute_tensor(
                    per_rank(4, lambda r: P[0]["a"]), m["tp"], [Shard(0)], src_data_rank=None
                )
            return out

        params = tree(P)
        state = tx.init(params)
        for t, g in enumerate(G):
            grads = tree(g)
            if axis == "expert":
                grads["dense"] = distribute_tensor(
                    per_rank(4, lambda r, t=t: G[t][0]["a"]),
                    m["tp"],
                    [Shard(0)],
                    src_data_rank=None,
                )
            with count_collectives() as c:
                params, state = ft.step(tx, grads, state, params, mesh=mesh)
            assert c.counts == {"all_to_all_single": 2}, c.counts
        got = [{k: on_rank(v.full_tensor(), r) for k, v in params.items()} for r in range(4)]
    for r in range(4):
        for k in shapes:
            key = f"expert_{k}" if axis == "expert" else k
            assert torch.equal(got[r][key], want[r // 2][k]), (r, k)
    if axis == "expert":  # the dense matrix: one process running it alone
        p, state = {"dense": P[0]["a"]}, tx.init({"dense": P[0]["a"]})
        for g in G:
            p, state = ft.step(tx, {"dense": g[0]["a"]}, state, p)
        for r in range(4):
            assert torch.equal(got[r]["dense"], p["dense"])


def test_default_treats_4d_leaves_as_convolution_filters():
    """Without dimension numbers a 4-D leaf ``(out, in, kh, kw)`` is one ``out x (in kh kw)``
    matrix (Keller Jordan's reference flattens conv filters so), equal to the same update of
    the 2-D reshaped leaf; a 3-D leaf is a stack of matrices."""
    gen = torch.Generator().manual_seed(5)
    conv = torch.randn(6, 3, 3, 3, generator=gen)
    flat = conv.reshape(6, -1).clone()
    tx = ft.muon(2e-2, weight_decay=0.0, ns_dtype=torch.float64)
    a, b = {"w": conv}, {"w": flat}
    sa, sb = tx.init(a), tx.init(b)
    for _ in range(3):
        g = torch.randn(6, 3, 3, 3, generator=gen)
        a, sa = ft.step(tx, {"w": g}, sa, a)
        b, sb = ft.step(tx, {"w": g.reshape(6, -1)}, sb, b)
    assert torch.equal(a["w"].reshape(6, -1), b["w"])


@pytest.mark.parametrize("n_leaves", [1, 2, 3])
def test_an_owner_whose_other_pieces_are_all_empty(n_leaves):
    """1 x 1 matrices split over 2 ranks: one rank holds the element, the other an empty block.
    Where the owner is the rank with the element every piece sent is empty; the routing still
    delivers the empty blocks (it raised "an owner misses blocks of its leaf": found by the
    sweep's drawn cases). Leaves 1, 2 or 3 move the owners between the ranks."""
    gen = torch.Generator().manual_seed(9)
    params = {f"w{i}": torch.randn(1, 1, generator=gen) for i in range(n_leaves)}
    grads = [{k: torch.randn(1, 1, generator=gen) for k in params} for _ in range(2)]
    assert_sharded_equivalent(
        ft.scale_by_muon(),
        params,
        grads,
        mesh_shape=(2,),
        placements={k: [Shard(0)] for k in params},
        rtol=0.0,
        atol=0.0,
    )
