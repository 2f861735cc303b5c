"""The engine fuses what the user composed: consecutive elementwise transforms run as one
generated kernel per stage (``functional_train.engine.fuse``), with the numbers of the same
per-leaf definitions run leaf by leaf in torch.

Tolerance: the generated C rounds every operation as IEEE does (no contraction beyond ATen's
own fused multiply-adds, correctly rounded ``sqrt`` and division); torch's CPU ``sqrt`` of
float32 is not always correctly rounded (1 ulp off on about 1 element in 10^4 here), and a
chain amplifies such a difference (two Adams in a row divide by the square root of a small
second moment). Tested: float32 parameters within 1e-5 of the largest parameter change over
the steps, states within 1e-5 of their largest element; float64 within 1e-12. For scale:
torch's own fused and foreach AdamW, on this problem, differ by up to 3e-6 of the parameter
change after 4 steps.
"""

import contextlib
import re
import sys

import optree
import pytest
import torch

import functional_train as ft
from _layouts import params_close, step_by_mode
from _spy import (
    compiled_code_of_steps,
    kernel_calls,
    kernels_run_on,
    took_torch_fused,
    torch_fused_calls,
)
from functional_train.engine import elementwise as E
from functional_train.engine import fuse

STEPS = 4


def _problem(dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (17, 33), "b": (33,), "e": (5, 4, 3), "s": ()}
    params = {k: torch.randn(s, generator=g, dtype=dtype).to(device) for k, s in shapes.items()}
    grads = [
        {k: (torch.randn(s, generator=g, dtype=dtype) * 0.1).to(device) for k, s in shapes.items()}
        for _ in range(STEPS)
    ]
    return params, grads


def _run(tx, params, grads, mode):
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        p, state = step_by_mode(tx, {k: v.clone() for k, v in g.items()}, state, p, mode)
    return p, state


def _unfused(monkeypatch):
    monkeypatch.setattr(fuse, "ENABLED", False)


def _user_rms():
    def leaf(u, p, v, *, beta):
        v = beta * v + (1 - beta) * u * u
        return u / (torch.sqrt(v) + 1e-8), v

    return ft.elementwise(leaf, name="rms", fields=("v",), hyperparams={"beta": 0.99})


CHAINS = {
    "adamw": lambda: ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1)),
    "primitives": lambda: ft.chain(
        ft.clip_by_global_norm(1.0),
        ft.scale_by_adam(0.9, 0.99, 1e-8),
        ft.add_decayed_weights(0.1),
        ft.scale_by_learning_rate(1e-2),
    ),
    "amsgrad_eps_before": lambda: ft.chain(
        ft.scale_by_adam(amsgrad=True), ft.scale_by_adam(eps_before_correction=True), ft.scale(0.5)
    ),
    "sgd_nesterov": lambda: ft.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "trace_dampening": lambda: ft.chain(ft.trace(0.9, dampening=0.3), ft.scale(-0.1)),
    "masked_decay": lambda: ft.adamw(1e-2, weight_decay=0.1, mask=ft.decay_mask),
    "schedule": lambda: ft.adamw(ft.schedules.cosine_decay_schedule(1e-2, 10)),
    "user": lambda: ft.chain(ft.clip_by_global_norm(0.5), _user_rms(), ft.scale(-1e-2)),
    # a per-leaf scalar (the trust ratio) fed from a per-leaf reduction; masked: its key
    "lamb": lambda: ft.lamb(1e-2, weight_decay=0.1),
    "masked_trust_ratio": lambda: ft.chain(
        ft.scale_by_adam(),
        ft.masked(ft.scale_by_trust_ratio(min_norm=0.1, eps=1e-3), ft.decay_mask),
        ft.scale_by_learning_rate(1e-2),
    ),
    "adafactor_tail": lambda: ft.adafactor(weight_decay=0.1, mask=ft.decay_mask),
    # (the update from the factored statistics: a value per row and one per column, by rows)
    "factored_momentum": lambda: ft.adafactor(beta1=0.9, weight_decay=0.1, mask=ft.decay_mask),
    # (half-precision gradients into float32 accumulators: fused too)
    "multi_steps": lambda: ft.multi_steps(
        ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1)), every_k=2
    ),
    "block_rms": lambda: ft.chain(
        ft.scale_by_adam(), ft.clip_by_block_rms(0.5), ft.scale_by_param_block_rms(), ft.scale(-0.1)
    ),
}


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_equals_unfused(name, mode, dtype, monkeypatch, device):
    """The generated kernels give the per-leaf definitions' numbers (see the tolerance in
    the module's docstring), states included. On ``--device cuda``: the generated Triton
    kernels (where Triton is importable; ``fuse_triton``), within the same tolerance: ATen's
    CUDA kernels contract ``a * b + c`` into one rounding where the generated one may round
    twice; a chain ``ft.step`` recognises runs torch's fused kernel there instead."""
    params, grads = _problem(dtype, device=device)
    seen = kernel_calls(monkeypatch)
    torch_fused = torch_fused_calls(monkeypatch)
    got, got_state = _run(CHAINS[name](), params, grads, mode)
    if took_torch_fused(device, torch_fused, seen):
        assert mode != "update"
    else:
        assert bool(seen) == kernels_run_on(device), "generated kernels run where they can"
    _unfused(monkeypatch)
    want, want_state = _run(CHAINS[name](), params, grads, mode)
    params_close(got, want, params, dtype, rtol32=1e-5)  # (see the module's docstring)
    for x, y in zip(ft.tree.tree_flatten(got_state)[0], ft.tree.tree_flatten(want_state)[0]):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            assert (x - y).abs().max() <= tol * y.abs().max() + 1e-30
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y)


HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize(
    "dtype, name",
    [(d, n) for d in HALF for n in sorted(CHAINS) if not (n == "user" and d == torch.float16)],
)
def test_half_precision_computes_in_float(name, mode, dtype, monkeypatch, device):
    """Half-precision leaves take the generated kernels too: loaded into float, computed
    there, rounded once where a result is stored (ATen's ``opmath``, as torch's fused
    optimizer kernels and inductor compute). The definitions run leaf by leaf in torch round
    every operation on a half tensor instead, so the two differ by the roundings in between:
    after 4 steps the parameters agree within 2 units in the last place of the half dtype
    (bfloat16: 2^-7 relative; float16: 2^-10), states (float32 for Adam's moments of half
    parameters, which see the updates rounded to half several times in the reference) within
    4 units of the half dtype's last place of their largest element. The user's primitive
    keeps its second moment in float16, where the reference's ``sqrt(v) + 1e-8`` underflows to
    a division by zero: not compared. On ``--device cuda``: the Triton kernels, the same
    bounds."""
    params, grads = _problem(dtype, device=device)
    seen = kernel_calls(monkeypatch)
    torch_fused = torch_fused_calls(monkeypatch)
    got, got_state = _run(CHAINS[name](), params, grads, mode)
    if took_torch_fused(device, torch_fused, seen):
        assert mode != "update"
    else:
        assert bool(seen) == kernels_run_on(device), "half-precision leaves take the kernels"
    _unfused(monkeypatch)
    want, want_state = _run(CHAINS[name](), params, grads, mode)
    for k in params:
        assert got[k].dtype == dtype
        ulp = torch.finfo(dtype).eps * want[k].float().abs().clamp_min(1.0)
        err = (got[k].float() - want[k].float()).abs()
        assert (err <= 2 * ulp).all(), (k, float((err / ulp).max()))
    for x, y in zip(ft.tree.tree_flatten(got_state)[0], ft.tree.tree_flatten(want_state)[0]):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            assert x.dtype == y.dtype
            tol = 4 * torch.finfo(dtype).eps
            assert (x.float() - y.float()).abs().max() <= tol * y.float().abs().max() + 1e-30


# (float64 and float16 in the slow tier: each dtype takes about 5 s, and the default tier's
# 5 minutes are nearly spent; float32 and bfloat16 cover full and half precision there)
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(torch.float64, marks=pytest.mark.slow),
        torch.bfloat16,
        pytest.param(torch.float16, marks=pytest.mark.slow),
    ],
)
def test_triton_writer_writes_every_generated_stage(dtype, monkeypatch):
    """Every stage the C writer generates for the chains above (their CPU steps, every mode),
    the Triton writer (``fuse_triton``: the CUDA kernels) writes too, as Python that parses,
    with scalars read by address and by value: what a CUDA step runs, checked where no GPU
    (and no Triton) is. Its numbers are checked on CUDA by the tests above (``--device
    cuda``, and under Triton's interpreter by tests/test_fused_wrappers.py -k interpreter).
    A stage run by rows (values per row and per column) is written ``indexed``: every per-leaf
    input read per element through its leaf's index triple."""
    from functional_train.engine import fuse_triton

    stages: dict = {}
    real = fuse.kernel_for

    def spy(fn, in_dtypes, scalar_dtypes, n_per_leaf=0, device_type="cpu", sumsq=False, **kw):
        k = real(fn, in_dtypes, scalar_dtypes, n_per_leaf, device_type, sumsq, **kw)
        if k is not None:
            stages[(fn, in_dtypes, scalar_dtypes, n_per_leaf, any(kw.get("vectors", ())))] = k
        return k

    monkeypatch.setattr(fuse, "kernel_for", spy)
    params, grads = _problem(dtype)
    for name in sorted(CHAINS):
        if name == "user" and dtype == torch.float16:
            continue
        for mode in ("update", "pure", "donate"):
            _run(CHAINS[name](), params, grads, mode)
    assert len(stages) >= 10
    for (fn, in_dtypes, scalar_dtypes, n_per_leaf, indexed), k in stages.items():
        for by_address in (True, False):
            kinds = tuple((d, by_address) for d in scalar_dtypes)
            source, out_dtypes = fuse_triton.source_of(fn, in_dtypes, kinds, n_per_leaf, indexed)
            compile(source, "<triton stage>", "exec")
            assert "def ft_stage(" in source and list(out_dtypes) == list(k.out_dtypes)
            assert source.count("tl.store(") == len(out_dtypes)


def _graph_ops(graph) -> list:
    """A graph as ``(op, target, args, kwargs, dtype and shape)`` per node, nodes numbered."""
    number: dict = {}

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return ("node", number[a])
        if isinstance(a, torch.device):  # (the 3-element tensors' device: CPU either way)
            return "device"
        return a

    ops = []
    for node in graph.nodes:
        number[node] = len(number)
        val = node.meta.get("val")
        val = (val.dtype, tuple(val.shape)) if isinstance(val, torch.Tensor) else None
        if node.op == "placeholder":
            ops.append(("placeholder", val))
            continue
        args, kwargs = optree.tree_map(arg, (node.args, node.kwargs), none_is_leaf=True)
        ops.append((node.op, str(node.target), args, kwargs, val))
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trace_records_the_graph_make_fx_records(dtype, monkeypatch):
    """``fuse.trace`` records a stage's ATen operations with a dispatch mode on small real
    tensors; for every stage of the chains above (every mode), the graph is the one
    ``make_fx`` (fake tensors) records, operation for operation: targets, arguments, dtypes and
    shapes (the factories' results included, which torch's binding would hand back detached
    from a mode that kept them). Traced as in an eager step, and below autograd, as inside a
    custom operator (the compiled step's ``fused_stage``), where composite operations reach
    the mode whole. (``make_fx`` runs once per distinct recorded graph: the chains' stages
    repeat from mode to mode.)"""
    from torch.fx.experimental.proxy_tensor import make_fx

    stages: dict = {}
    real = fuse.kernel_for

    def spy(fn, in_dtypes, scalar_dtypes, n_per_leaf=0, device_type="cpu", sumsq=False, **kw):
        stages[(fn, in_dtypes, scalar_dtypes, n_per_leaf, tuple(kw.get("vectors", ())))] = 1
        return real(fn, in_dtypes, scalar_dtypes, n_per_leaf, device_type, sumsq, **kw)

    monkeypatch.setattr(fuse, "kernel_for", spy)
    params, grads = _problem(dtype)
    for name in sorted(CHAINS):
        for mode in ("update", "pure", "donate"):
            _run(CHAINS[name](), params, grads, mode)
    assert len(stages) >= 10
    compared: set = set()
    for below in (contextlib.nullcontext, torch._C._AutoDispatchBelowAutograd):
        for fn, in_dtypes, scalar_dtypes, n_per_leaf, vectors in stages:
            with below():
                got = _graph_ops(fuse.trace(fn, in_dtypes, scalar_dtypes, n_per_leaf, vectors))
            if repr(got) in compared:
                continue
            compared.add(repr(got))
            first = len(in_dtypes) - n_per_leaf
            vec = (*([True] * first), *(vectors or [False] * n_per_leaf))
            ins = [torch.zeros(3 if v else (), dtype=d) for v, d in zip(vec, in_dtypes)]
            scs = [torch.ones((), dtype=d) for d in scalar_dtypes]

            def flat(*args, fn=fn, n=first + n_per_leaf):
                return tuple(fn(args[:n], args[n:]))

            with torch.no_grad(), below():
                want = make_fx(flat, tracing_mode="fake")(*ins, *scs).graph
            assert got == _graph_ops(want), (fn, below)


def test_a_stage_that_reads_a_value_or_a_captured_tensor_runs_leaf_by_leaf(monkeypatch):
    """A user's primitive that captures a tensor (no input of the stage) or branches on a
    tensor's value (a host read) cannot be generated: the trace says so (``Unsupported``),
    the stage runs leaf by leaf in torch, and the numbers are the definition's."""
    scale = torch.tensor(0.5, dtype=torch.float64)

    def captured(u, p):
        return u * scale

    def branches(u, p):
        return u * 0.5 if bool((u.abs() < 1e3).all()) else u

    params, grads = _problem(torch.float64)
    want = {k: v - 0.1 * 0.5 * sum(g[k] for g in grads) for k, v in params.items()}
    seen = kernel_calls(monkeypatch)
    for leaf in (captured, branches):
        with pytest.raises(fuse.Unsupported):
            fuse.trace(lambda ins, sc, leaf=leaf: (leaf(ins[0], None),), (torch.float64,), (), 0)
        tx = ft.chain(ft.elementwise(leaf, name=leaf.__name__), ft.scale(-0.1))
        got, _ = _run(tx, params, grads, "pure")
        assert not seen, "the stage runs leaf by leaf"
        params_close(got, want, params, torch.float64)


@pytest.mark.parametrize("dtype", HALF)
def test_half_conversions_round_as_torch(dtype, device):
    """The generated conversions: every half value to float exactly; floats (a sample of bit
    patterns across the range, the boundaries, subnormals, infinities and NaN) to half rounded
    to nearest even, as torch's ``.to(dtype)``, bit for bit (C on CPU, Triton on CUDA)."""
    if not kernels_run_on(device):
        pytest.fail(f"no generated kernels on {device} (Triton is not importable)")
    none, kinds, _ = fuse.scalar_pointers((), device)
    halves = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    halves = halves.to(device)
    up = fuse.kernel_for(lambda ins, sc: (ins[0].float(),), (dtype,), kinds, 0, device.type)
    assert up is not None
    got = torch.empty(halves.shape, device=device)
    up([[halves]], [[got]], none)
    want = halves.float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))
    bits = torch.arange(0, 2**32, 4099, dtype=torch.int64).to(torch.int32)
    special = [0.0, -0.0, 65504.0, 65519.99, 65520.0, 6.1e-5, 6.09e-5, 5.96e-8, 2.98e-8, 1e-45]
    special += [3.3895e38, float("inf"), -float("inf"), float("nan")]
    floats = torch.cat([bits.view(torch.float32), torch.tensor(special)]).to(device)
    down = fuse.kernel_for(
        lambda ins, sc: (ins[0].to(dtype),), (torch.float32,), kinds, 0, device.type
    )
    assert down is not None
    got = torch.empty(floats.shape, dtype=dtype, device=device)
    down([[floats]], [[got]], none)
    want = floats.to(dtype)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


@pytest.mark.parametrize("target", ["native", "baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_streamed_results_equal_stored_ones(dtype, target, monkeypatch):
    """Fresh results of a large call are written with non-temporal stores, a block at a time
    from a buffer in L1 (``fuse.STREAM_MIN_BYTES``, lowered here to stream every call): the
    same bits as ordinary stores, for leaves of every size around the block (empty, shorter
    than a block, a block and one more, odd tails), destinations aligned or not, and a pure
    ``ft.step`` equals the donated one bit for bit. ``baseline``: the kernel compiled for the
    compiler's default target instead of this CPU (x86-64 without AVX: the stores a plain
    copy, as on CPUs without AVX)."""
    if target == "baseline":
        monkeypatch.setattr(fuse, "_CFLAGS", [f for f in fuse._CFLAGS if f != "-march=native"])
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, 5, 127, 128, 129, 300, 1000, 4099]

    def fn(ins, sc):
        u, m = ins
        m2 = m * sc[0] + u * u
        return (u / (m2.sqrt() + 1e-8), m2)

    sc = fuse.scalar_pointers([0.9])
    k = fuse.kernel_for(fn, (dtype, dtype), sc[1])
    assert k is not None, "the stage did not compile"
    ins = [[torch.randn(n, generator=g).to(dtype) for n in sizes] for _ in range(2)]
    ins[1] = [x.abs() for x in ins[1]]
    stored = [[torch.empty(n, dtype=dtype) for n in sizes] for _ in range(2)]
    k(ins, stored, sc[0], fresh=False)
    monkeypatch.setattr(fuse, "STREAM_MIN_BYTES", 0)
    for offset in (0, 1, 3):  # destinations offset from the allocator's alignment
        streamed = [
            [torch.empty(n + offset, dtype=dtype)[offset:] for n in sizes] for _ in range(2)
        ]
        k(ins, streamed, sc[0], fresh=True)
        for a, b in zip(sum(stored, []), sum(streamed, [])):
            assert torch.equal(a, b)
    params, grads = _problem(dtype)
    got, got_state = _run(CHAINS["adamw"](), params, grads, "pure")
    want, want_state = _run(CHAINS["adamw"](), params, grads, "donate")
    for x, y in zip(
        ft.tree.tree_flatten((got, got_state))[0], ft.tree.tree_flatten((want, want_state))[0]
    ):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_flag_selects_specialise_the_loops(dtype, monkeypatch):
    """A stage that selects per-element values by flags (a ``where`` whose condition is the
    same for the whole call: ``multi_steps``' "first micro-step" and "last micro-step") has
    its loops written once per combination of the flags' values, the flag a constant in each
    (``fuse.unswitched``), so that the C compiler drops the loads only the other side reads:
    a first micro-step reads no accumulator. The same bits as torch for every combination,
    stored and streamed, signed zeros and NaNs included; with more flags than
    ``fuse.MAX_SWITCHES`` the loops are written once."""

    def fn(ins, sc):
        acc, g = ins
        a = torch.where(sc[0] != 0, g.to(acc.dtype), acc + g.to(acc.dtype))
        return a / 4.0, torch.where(sc[1] != 0, torch.zeros_like(a), a)

    gen = torch.Generator().manual_seed(0)
    sizes = [0, 1, 7, 129, 1000]
    acc = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    g = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    g[2][:3] = torch.tensor([-0.0, float("nan"), float("-inf")])
    acc[2][:3] = torch.tensor([0.0, 1.0, float("inf")])
    for first in (False, True):
        for final in (False, True):
            flags = [torch.tensor(first), torch.tensor(final)]
            sc = fuse.scalar_pointers(flags)
            k = fuse.kernel_for(fn, (dtype, dtype), sc[1])
            assert k is not None
            # (two flags, each shadowed by its value: 4 copies of the loops)
            assert len(re.findall(r"const _Bool v[0-9]+ = [01];", k.source)) == 6
            for stream in (None, 0):
                if stream is not None:
                    monkeypatch.setattr(fuse, "STREAM_MIN_BYTES", stream)
                outs = [[torch.empty(n, dtype=dtype) for n in sizes] for _ in range(2)]
                k([acc, g], outs, sc[0], fresh=stream is not None)
                for j in range(len(sizes)):
                    ref = fn((acc[j], g[j]), flags)
                    for got, exp in zip((outs[0][j], outs[1][j]), ref):
                        assert torch.equal(got.isnan(), exp.isnan())
                        bits = {torch.float32: torch.int32, torch.float64: torch.int64}
                        view = bits.get(dtype, torch.int16)
                        ok = ~exp.isnan()  # (the bits of every value but a NaN's payload)
                        assert torch.equal(got[ok].view(view), exp[ok].view(view)), (first, final)

    def three(ins, sc):
        x = ins[0]
        return (
            torch.where(
                sc[0] != 0, x, torch.where(sc[1] != 0, -x, torch.where(sc[2] != 0, 2 * x, x + 1))
            ),
        )

    sc = fuse.scalar_pointers([torch.tensor(True)] * 3)
    k = fuse.kernel_for(three, (dtype,), sc[1])
    assert k is not None and not re.findall(r"const _Bool v[0-9]+ = [01];", k.source)


def test_a_user_primitive_fuses_and_is_exact(monkeypatch):
    """``ft.elementwise`` in a chain with the library's primitives: ``ft.step`` runs the clip's
    reduction, then ONE kernel call for every leaf (clip scale, the user's math, the scale and
    the parameter's update in one pass), and equals the same math written optax-style
    (``tree_map`` over the leaves), to float rounding."""
    params, grads = _problem(torch.float64)
    tx = CHAINS["user"]()
    seen = kernel_calls(monkeypatch)
    got, state = _run(tx, params, grads, "donate")
    assert len(seen) == STEPS and all(n == len(params) for _, n in seen)
    assert len({id(k) for k, _ in seen}) == 1

    # the same math by hand
    p = {k: v.clone() for k, v in params.items()}
    v = {k: torch.zeros_like(x) for k, x in params.items()}
    for g in grads:
        norm = torch.sqrt(sum((x * x).sum() for x in g.values()))
        coef = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
        for k in p:
            u = g[k] * coef
            v[k] = 0.99 * v[k] + 0.01 * u * u
            p[k] = p[k] + (-1e-2) * (u / (torch.sqrt(v[k]) + 1e-8))
    params_close(got, p, params, torch.float64)
    for k in params:
        torch.testing.assert_close(state[1].fields[0][k], v[k], rtol=1e-12, atol=1e-15)
    assert int(state[1].count) == STEPS


def test_a_foreign_transform_breaks_the_pass_and_composes(monkeypatch):
    """An optax-style transform (no spec) between two elementwise runs: two kernels, one on
    each side, and the numbers of the same chain with the user's math fused."""
    import optree

    def foreign():
        def init(params):
            return ft.EmptyState()

        def update(updates, state, params=None, **kw):
            return optree.tree_map(lambda u: u * 2.0, updates), state

        return ft.GradientTransformation(init, update)

    params, grads = _problem(torch.float64)
    seen = kernel_calls(monkeypatch)
    tx = ft.chain(ft.scale_by_adam(), foreign(), ft.scale(-1e-2))
    got, _ = _run(tx, params, grads, "pure")
    assert len(seen) == 2 * STEPS
    want, _ = _run(
        ft.chain(ft.scale_by_adam(), ft.scale(2.0), ft.scale(-1e-2)), params, grads, "pure"
    )
    params_close(got, want, params, torch.float64)


@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_the_elementwise_run_after_a_foreign_transform_ends_the_step(mode, monkeypatch):
    """``ft.step`` of ``chain(foreign, adamw)`` (``adamw`` itself a chain: taken apart) runs the
    optax-style transform by its update, then AdamW and ``apply_updates`` as ONE kernel call
    (no separate ``p + u``), pure and donated: bit for bit update + apply_updates for float64,
    the state nested as the chain's."""
    import optree

    def foreign():
        def update(updates, state, params=None, **kw):
            return optree.tree_map(lambda u: u * 2.0, updates), state

        return ft.GradientTransformation(lambda params: ft.EmptyState(), update)

    params, grads = _problem(torch.float64)
    tx = ft.chain(foreign(), ft.adamw(1e-2, weight_decay=0.1))
    want, want_state = _run(tx, params, grads, "update")
    step_module = sys.modules["functional_train.step"]

    def no_separate_add(*a, **k):
        raise AssertionError("p + u ran apart from the elementwise pass")

    monkeypatch.setattr(step_module, "_apply", no_separate_add)
    seen = kernel_calls(monkeypatch)
    got, got_state = _run(tx, params, grads, mode)
    assert len(seen) == STEPS
    for k in params:
        assert torch.equal(got[k], want[k]), k
    assert optree.tree_structure(got_state) == optree.tree_structure(want_state)
    for x, y in zip(optree.tree_leaves(got_state), optree.tree_leaves(want_state)):
        assert torch.equal(x, y)


def test_elementwise_bad_input():
    with pytest.raises(TypeError, match="leaf cannot be called"):
        ft.elementwise(lambda u, p: u, fields=("v",))
    tx = ft.elementwise(lambda u, p, v: u, name="bad", fields=("v",))
    params, grads = _problem()
    with pytest.raises(ValueError, match="bad: leaf returned 1 values"):
        tx.update(grads[0], tx.init(params), params)
    with pytest.raises(ValueError, match="ElementwiseState"):
        tx.update(grads[0], ft.EmptyState(), params)


def _compiled_equals_eager(tx, donate, graphs=None):
    """``torch.compile(ft.step, fullgraph=True)`` of ``tx`` over the problem's steps, each
    step's parameters bit for bit the eager step's, one graph in all, the stage operator in it:
    the final ``(compiled state, eager state)``; dynamo's graphs appended to ``graphs``."""
    from torch._dynamo.testing import CompileCounterWithBackend

    params, grads = _problem()
    graphs = [] if graphs is None else graphs

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    step = torch.compile(
        lambda g, s, p: ft.step(tx, g, s, p, donate=donate), backend=counter, fullgraph=True
    )
    se, sc = tx.init(params), tx.init(params)
    pe = {k: v.clone() for k, v in params.items()}
    pc = {k: v.clone() for k, v in params.items()}
    for g in grads:
        before = pc
        pc, sc = step({k: v.clone() for k, v in g.items()}, sc, pc)
        pe, se = ft.step(tx, {k: v.clone() for k, v in g.items()}, se, pe, donate=donate)
        for k in params:
            assert torch.equal(pc[k], pe[k]), k
            # donated: the parameters written where they are, as the eager donated step
            assert (pc[k] is before[k]) == donate, k
    assert counter.frame_count == 1
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    # donated: every stage by the operator that writes over its inputs (no copy back)
    op = "fused_stage_donated" if donate else "fused_stage"
    assert any(o.split(".")[:2] == ["functional_train", op] for o in ops), ops
    assert not any("copy_" in o for o in ops), ops
    return sc, se


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_stage_operators_go_straight_to_their_function(donate, monkeypatch):
    """The stage operators' Autograd kernel (``engine.operators``) calls the
    operator's function itself where nothing asks for autograd and plain CPU tensors are all
    there is below it: a compiled step's calls (one trip down the dispatcher, not three).
    Where an input requires grad under grad mode, or under a fake-tensor mode, the call goes
    down the dispatcher as ``torch.library.custom_op`` sends it: the results then require
    grad (custom_op's ``autograd.Function``, whose backward has no formula), or are fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from functional_train.engine import elementwise as E

    op = E._stage_op_donated if donate else E._stage_op
    real = op._init_fn
    calls = []

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(op, "_init_fn", counted)
    params, grads = _problem()
    tx = CHAINS["primitives"]()
    torch._dynamo.reset()
    step = torch.compile(lambda g, s, p: ft.step(tx, g, s, p, donate=donate), fullgraph=True)
    pc, sc = {k: v.clone() for k, v in params.items()}, tx.init(params)
    for i, g in enumerate(grads):
        n = len(calls)
        pc, sc = step({k: v.clone() for k, v in g.items()}, sc, pc)
        # (the compiled step's one stage, straight to the function; inductor's first run
        # of a new graph goes under a Python mode: down the dispatcher)
        assert len(calls) == n + (i > 0), i
    want, _ = _run(CHAINS["primitives"](), params, grads, "donate" if donate else "pure")
    for k in params:
        assert torch.equal(pc[k], want[k]), k
    args = list(calls[-1])
    calls.clear()
    at = 4 if donate else 3  # (the donated operator's list of inputs it writes)
    flat = args[at]
    args[at] = [flat[0].detach().requires_grad_(True), *flat[1:]]
    opov = getattr(torch.ops.functional_train, "fused_stage_donated" if donate else "fused_stage")
    if not donate:
        with torch.enable_grad():
            res = opov.default(*args)
        assert not calls and res[0].requires_grad  # (custom_op's autograd.Function)
        with pytest.raises(RuntimeError, match="no autograd formula"):
            res[0].sum().backward()
    with FakeTensorMode() as mode:

        def fake(x):
            if isinstance(x, list):
                return [fake(y) for y in x]
            return mode.from_tensor(x) if isinstance(x, torch.Tensor) else x

        opov.default(*[fake(a) for a in [*args[:at], flat, *args[at + 1 :]]])
    assert not calls  # (down the dispatcher to the fake kernel)


def _clip_adamw():
    return ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1))


# chains whose compiled step on plain CPU tensors leaves inductor nothing to generate (the rows
# of benchmarks/bench_compose.py): the passes are the stage operators, the scalar arithmetic
# around them functional_train::scalars (engine.scalars)
OPERATORS_ONLY = {
    "multi_steps": CHAINS["multi_steps"],
    "apply_if_finite": lambda: ft.apply_if_finite(_clip_adamw(), max_consecutive_errors=2),
    "ema_params": lambda: ft.chain(_clip_adamw(), ft.ema_params(0.9)),
    "ema_params_warmup": lambda: ft.chain(_clip_adamw(), ft.ema_params(0.9, warmup=True)),
    "schedule": lambda: ft.chain(
        ft.clip_by_global_norm(1.0),
        ft.adamw(ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.1),
    ),
    "loss_scale": lambda: ft.dynamic_loss_scale(_clip_adamw(), init_scale=2.0**4),
    "zero_nans": lambda: ft.chain(ft.zero_nans(), _clip_adamw()),
    "lamb": lambda: ft.chain(ft.clip_by_global_norm(1.0), ft.lamb(1e-2, weight_decay=0.1)),
    "partition": lambda: ft.partition(
        {"a": _clip_adamw(), "b": ft.chain(ft.clip_by_global_norm(0.5), ft.sgd(0.1, 0.9))},
        {"w": "a", "b": "b", "e": "a", "s": "b"},
    ),
    # (optax's idiom: the schedule's value in the state, read as a tensor at every update)
    "inject": lambda: ft.chain(
        ft.clip_by_global_norm(1.0),
        ft.inject_hyperparams(ft.adamw)(
            learning_rate=ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10),
            weight_decay=0.1,
        ),
    ),
    # (multi_steps' traced form and apply_if_finite's guarded parts over the parts
    # inject_hyperparams declares under compile)
    "multi_steps_inject": lambda: ft.multi_steps(OPERATORS_ONLY["inject"](), every_k=2),
    "apply_if_finite_inject": lambda: ft.apply_if_finite(
        OPERATORS_ONLY["inject"](), max_consecutive_errors=2
    ),
    # (masked's and partition's restricted parts over the parts inject_hyperparams declares
    # under compile; TorchOptimizer's param groups are such a partition)
    "masked_inject": lambda: ft.masked(
        OPERATORS_ONLY["inject"](), {"w": True, "b": False, "e": True, "s": False}
    ),
    "partition_inject": lambda: ft.partition(
        {
            "a": OPERATORS_ONLY["inject"](),
            "b": ft.chain(ft.clip_by_global_norm(0.5), ft.sgd(0.1, 0.9)),
        },
        {"w": "a", "b": "b", "e": "a", "s": "b"},
    ),
    # (the restricted clip reads the accumulation's sums of squares for its own leaves)
    "multi_steps_partition_inject": lambda: ft.multi_steps(
        OPERATORS_ONLY["partition_inject"](), every_k=2
    ),
    # (multi_steps' traced form on the leaves its combinator gives it, None elsewhere)
    "masked_multi_steps": lambda: ft.masked(
        CHAINS["multi_steps"](), {"w": True, "b": False, "e": True, "s": False}
    ),
    "partition_multi_steps_inject": lambda: ft.partition(
        {
            "a": ft.multi_steps(OPERATORS_ONLY["inject"](), every_k=2),
            "b": ft.chain(ft.clip_by_global_norm(0.5), ft.sgd(0.1, 0.9)),
        },
        {"w": "a", "b": "b", "e": "a", "s": "b"},
    ),
    # (dynamic_loss_scale's parts over the parts inject_hyperparams declares)
    "loss_scale_inject": lambda: ft.dynamic_loss_scale(
        OPERATORS_ONLY["inject"](), init_scale=2.0**4
    ),
    # (no leading clip: the per-leaf non-finite flags decide, a scalar program)
    "apply_if_finite_without_clip": lambda: ft.apply_if_finite(
        ft.adamw(1e-2, weight_decay=0.1), max_consecutive_errors=2
    ),
    # (a user's own primitive, a schedule among its hyperparameters)
    "user_elementwise": lambda: ft.chain(
        ft.clip_by_global_norm(1.0),
        ft.elementwise(
            _rms_leaf,
            name="rms",
            fields=("v",),
            hyperparams={"beta": ft.schedules.linear_schedule(0.5, 0.9, 3), "eps": 1e-8},
        ),
        ft.scale_by_learning_rate(1e-2),
    ),
}
# (a 0-dim float64 CPU tensor among the inputs, inject_hyperparams' values: torch's dynamo
# restarts its first analysis once, as it cannot tell the symbol it made for the value's
# item() is unused (pytorch/pytorch#140346): two backend calls for the first step, none after)
_RESTARTS = (
    "inject",
    "multi_steps_inject",
    "apply_if_finite_inject",
    "masked_inject",
    "partition_inject",
    "multi_steps_partition_inject",
    "partition_multi_steps_inject",
    "loss_scale_inject",
)


def _rms_leaf(u, p, v, *, beta, eps):
    v = beta * v + (1 - beta) * u * u
    return u / (torch.sqrt(v) + eps), v


# (the operations inductor makes no kernel for: views of a result, taking a list's items)
_VIEWS = {
    "<built-in function getitem>",
    "aten.unbind.int",
    "aten.slice.Tensor",
    "aten.split.Tensor",
    "aten.view.default",
    "aten.alias.default",
    "aten.detach.default",
}


# (donated: the chains whose donated graphs differ most, to keep the slow tier's time)
_DONATED = (
    "apply_if_finite",
    "multi_steps",
    "partition",
    "inject",
    "partition_inject",
    "partition_multi_steps_inject",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, donate",
    [(name, False) for name in sorted(OPERATORS_ONLY)] + [(name, True) for name in _DONATED],
)
def test_compiled_step_leaves_inductor_no_arithmetic(name, donate):
    """``torch.compile(ft.step)`` of plain CPU tensors: the graph inductor gets (after AOT's
    decompositions) holds the library's operators and views only. Its scalar arithmetic
    (counters, bias corrections, the norm's root and the clip factor, the wrappers' flags and
    selects, a schedule, the trust ratios) is ``functional_train::scalars`` calls, so inductor
    builds no C++ kernel, and starts no probe of the CPU's vector instruction sets, which
    took about 8 of the 20 s a cold first call of ``multi_steps`` took. The results are the
    eager step's bit for bit, its counters included, over several steps, with one graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.testing import CompileCounterWithBackend

    targets: set = set()

    def forward(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function":
                # (a mutating operator's functional form: the operator it wraps)
                functional = str(n.target).startswith("auto_functionalized")
                targets.add(str(n.args[0] if functional else n.target))
        return gm

    tx = OPERATORS_ONLY[name]()
    counter = CompileCounterWithBackend(aot_autograd(fw_compiler=forward))
    torch._dynamo.reset()
    step = torch.compile(
        lambda g, s, p: ft.step(tx, g, s, p, donate=donate), backend=counter, fullgraph=True
    )
    params, grads = _problem()
    pc, sc = {k: v.clone() for k, v in params.items()}, tx.init(params)
    pe, se = {k: v.clone() for k, v in params.items()}, tx.init(params)
    for t, g in enumerate(grads):
        with torch._dynamo.config.patch(error_on_recompile=t > 0):
            pc, sc = step({k: v.clone() for k, v in g.items()}, sc, pc)
        pe, se = ft.step(tx, {k: v.clone() for k, v in g.items()}, se, pe, donate=donate)
    assert counter.frame_count == 1 or (name in _RESTARTS and counter.frame_count == 2)
    got, want = optree.tree_leaves((pc, sc)), optree.tree_leaves((pe, se))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.dtype == b.dtype, (a, b)
    assert "functional_train.scalars.default" in targets, targets
    assert {t for t in targets if not t.startswith("functional_train.")} <= _VIEWS, targets


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["multi_steps", "apply_if_finite"])
def test_compiled_guarded_parts_skip_their_scalar_programs_where_their_flag_is_false(
    wrapper, monkeypatch
):
    """A compiled step's guarded parts (``multi_steps``' inner parts, used on the cycle's last
    micro-step only; ``apply_if_finite``'s, on a finite step only) run their scalar programs
    (Adam's next count and bias corrections, ``multi_steps``' clip factor, the stage's
    hyperparameters as tensors) only where their flag holds, as the eager step does: a real
    call where it is false returns zeros without running the function (but the first, which
    learns their shapes). The parameters are the eager step's bit for bit."""
    from functional_train.engine import scalars as S

    real = S._call
    runs: list = []

    def counting(name, template, xs):  # (the functions' real runs, not the fake ones)
        if not S._faking():
            runs.append(name.rsplit(".", 1)[-1])
        return real(name, template, xs)

    monkeypatch.setattr(S, "_call", counting)
    inner = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1))
    skipped = ["_adam_next", "_as_tensors"]
    if wrapper == "multi_steps":
        tx, n, used = ft.multi_steps(inner, every_k=3), 9, [False, False, True] * 3
        skipped.append("_clip_factor")
    else:  # (the clip's factor comes before the flag, which reads the clip's norm)
        tx, n, used = ft.apply_if_finite(inner, max_consecutive_errors=5), 6, [True] * 6
        used[1] = used[2] = used[4] = False  # (non-finite gradients on these steps)
    params, _ = _problem()
    g0 = torch.Generator().manual_seed(1)
    grads = [
        {k: torch.randn(v.shape, generator=g0) * 0.1 for k, v in params.items()} for _ in range(n)
    ]
    for t, ok in enumerate(used):
        if not ok and wrapper == "apply_if_finite":
            grads[t]["w"][3, 4] = float("nan")
    torch._dynamo.reset()
    step = torch.compile(lambda g, s, p: ft.step(tx, g, s, p), fullgraph=True)
    pc, sc = {k: v.clone() for k, v in params.items()}, tx.init(params)
    pe, se = {k: v.clone() for k, v in params.items()}, tx.init(params)
    first_off = None
    for t, g in enumerate(grads):
        runs.clear()
        pc, sc = step({k: v.clone() for k, v in g.items()}, sc, pc)
        pe, se = ft.step(tx, {k: v.clone() for k, v in g.items()}, se, pe)
        for k in params:
            assert torch.equal(pc[k], pe[k]), (t, k)
        if first_off is None and not used[t]:
            first_off = t
            continue  # (the first call where the flag is false learns the results' shapes)
        for name in skipped:
            assert runs.count(name) == (1 if used[t] else 0), (t, name, runs)
    assert first_off is not None


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_compiled_step_runs_the_stage_operator(donate):
    """``torch.compile(ft.step, fullgraph=True)`` of a chain of primitives with a schedule:
    each stage is the operator ``functional_train::fused_stage`` (the eager kernels, so the
    eager step's numbers bit for bit), and the schedule moving does not recompile."""
    tx = ft.chain(
        ft.clip_by_global_norm(0.5),
        ft.scale_by_adam(),
        ft.add_decayed_weights(0.1),
        ft.scale_by_learning_rate(ft.schedules.cosine_decay_schedule(1e-2, 10)),
    )
    _compiled_equals_eager(tx, donate)


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_compiled_partition_runs_the_stage_operator(donate):
    """A compiled ``partition`` (two transforms, each restricted to its leaves; their absent
    state leaves ``None``) runs as the stage operator, bit for bit the eager step, its state's
    ``None`` leaves kept."""
    labels = {"w": "adam", "b": "sgd", "e": "adam", "s": "sgd"}
    tx = ft.chain(
        ft.clip_by_global_norm(0.5),
        ft.partition(
            {"adam": ft.adamw(1e-2, weight_decay=0.1), "sgd": ft.sgd(1e-1, momentum=0.9)}, labels
        ),
    )
    graphs: list = []
    sc, se = _compiled_equals_eager(tx, donate, graphs)
    got = ft.tree.tree_flatten(sc)[0]
    want = ft.tree.tree_flatten(se)[0]
    assert [x is None for x in got] == [x is None for x in want]
    # the leaves' static keys (and, donated, the absent state leaves' positions) reach the
    # operator as text: the dispatcher converts a list argument element by element on every
    # call (a 122-leaf stage's 1,098 keys as ints: about 0.1 ms a call), a string once
    stages = [
        n
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function" and "fused_stage" in str(n.target)
    ]
    assert stages
    texts = [n.args[2] for n in stages] + [n.args[6] for n in stages if donate]
    assert all(isinstance(t, str) for t in texts), texts
    assert all(t for t in texts), texts  # (restricted parts and absent leaves: every one set)
    for n in stages:  # (the labels' keys: some not None)
        assert any(int(x) != E._NONE_KEY for x in n.args[2].split(",")), n.args[2]
    for x, y in zip(got, want):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)


@pytest.mark.slow
def test_compiled_mask_keeps_its_keys():
    """A mask's per-leaf keys reach the compiled operator as bools (a decoded 0 taken for a
    key other than False decayed the masked-out leaves, and the eager step that then reused
    the cached per-leaf function did too)."""
    params, grads = _problem()
    params = {"layer.w": params["w"], "layer.bias": params["b"], "embed": params["e"]}
    grads = [{"layer.w": g["w"], "layer.bias": g["b"], "embed": g["e"]} for g in grads]

    def tx():
        return ft.adamw(1e-2, weight_decay=0.5, mask=ft.decay_mask)

    torch._dynamo.reset()
    t = tx()
    step = torch.compile(lambda g, s, p: ft.step(t, g, s, p), backend="eager", fullgraph=True)
    s, p = t.init(params), {k: v.clone() for k, v in params.items()}
    for g in grads:
        p, s = step({k: v.clone() for k, v in g.items()}, s, p)
    want, _ = _run(tx(), params, grads, "update")
    again, _ = _run(tx(), params, grads, "pure")
    for k in params:
        torch.testing.assert_close(p[k], want[k], rtol=0, atol=0)
        torch.testing.assert_close(again[k], want[k], rtol=0, atol=0)


def _ordered_problem(contiguous: bool = False):
    """Leaves in another memory order than contiguous, their gradients in the same one:
    ``channels_last`` convolution weights, a transposed weight (:data:`ORDERED`); a bias; a
    weight whose gradient is in another order and one whose gradient is a slice (gaps in its
    memory: the first stage of a step runs them in torch). ``contiguous``: the same values,
    the :data:`ORDERED` leaves contiguous."""
    gen = torch.Generator().manual_seed(1)
    cl = torch.channels_last

    def made(scale):
        out = {
            "conv": (torch.randn(8, 3, 3, 3, generator=gen) * scale).to(memory_format=cl),
            "conv3d": (torch.randn(4, 2, 2, 3, 3, generator=gen) * scale).to(
                memory_format=torch.channels_last_3d
            ),
            "t": (torch.randn(6, 5, generator=gen) * scale).t(),
            "b": torch.randn(8, generator=gen) * scale,
        }
        other = torch.randn(4, 3, 2, 2, generator=gen) * scale
        gaps = torch.randn(5, 7, generator=gen) * scale
        out["other"] = other.to(memory_format=cl) if scale == 1.0 else other
        out["gaps"] = gaps[:, :4] if scale != 1.0 else gaps[:, :4].contiguous()
        if contiguous:
            out.update({k: out[k].contiguous() for k in ORDERED})
        return out

    return made(1.0), [made(0.1) for _ in range(STEPS)]


ORDERED = ("conv", "conv3d", "t")


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("name", ["adamw", "primitives", "sgd_nesterov", "user", "multi_steps"])
def test_leaves_in_one_memory_order_take_the_kernels(name, mode, monkeypatch):
    """Leaves that are not contiguous but lie in one memory order with their gradients and
    states (``channels_last`` convolution weights; a transposed weight) run in the generated
    kernels, which read each leaf's memory in order (as many leaves through kernels as the
    same leaves contiguous, in as many calls: one group with the contiguous leaves), with the
    numbers of the per-leaf definitions, and keep their memory order (new parameters,
    updates, states); a leaf whose gradient lies in another order, or has gaps, runs in torch.
    (They once all ran in torch.)"""
    params, grads = _ordered_problem()
    assert not any(params[k].is_contiguous() or grads[0][k].is_contiguous() for k in ORDERED)
    seen = kernel_calls(monkeypatch)
    tx = CHAINS[name]()
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        g = {k: v.clone() for k, v in g.items()}
        if mode == "update":
            u, state = tx.update(g, state, p)
            for k in ORDERED:  # (multi_steps' zero updates: one zero, expanded)
                assert u[k].stride() in (g[k].stride(), (0,) * g[k].ndim), (k, u[k].stride())
            p = ft.apply_updates(p, u)
        else:
            p, state = ft.step(tx, g, state, p, donate=mode == "donate")
    leaves_through_kernels, calls = sum(n for _, n in seen), len(seen)
    for k in ORDERED:
        assert p[k].stride() == params[k].stride(), (k, p[k].stride())
    for x in ft.tree.tree_flatten(state)[0]:  # (the states made like their parameters)
        for k in ORDERED:
            if isinstance(x, torch.Tensor) and x.shape == params[k].shape:
                assert x.stride() == params[k].stride(), (k, x.stride())
    seen.clear()
    _run(CHAINS[name](), *_ordered_problem(contiguous=True), mode)
    assert leaves_through_kernels == sum(n for _, n in seen) > 0
    assert calls == len(seen)  # (with the contiguous leaves in one call, as when contiguous)
    _unfused(monkeypatch)
    want, _ = _run(CHAINS[name](), params, grads, mode)
    params_close(p, want, params, torch.float32, rtol32=1e-5)  # (see the module's docstring)


@pytest.mark.parametrize("mode", ["pure", "donate"])
@pytest.mark.parametrize(
    "name", ["adamw", "sgd_nesterov", "bare_adamw"]
)  # (chains torch's fused kernels run)
def test_leaves_torch_fused_kernels_refuse_take_the_stages(name, mode, monkeypatch):
    """Where ``ft.step`` keeps torch's fused kernels for a recognised chain (on CUDA;
    ``SPEC_FIRST`` off stands for it here) and the leaves are some torch's kernels do not
    take (``channels_last`` and other non-contiguous leaves), the step runs the chain's
    generated stages, as on the CPU: donated in place, no ``update`` (which made every
    result fresh, the updates and the states: three gradient-sized buffers per leaf on a
    ResNet-18 on CUDA), the numbers of the per-leaf definitions."""
    from functional_train.engine import elementwise as E

    monkeypatch.setattr(sys.modules["functional_train.step"], "SPEC_FIRST", False)
    applies = []
    real_run = E.run

    def run(*a, **k):
        applies.append(k.get("apply"))
        return real_run(*a, **k)

    monkeypatch.setattr(E, "run", run)
    build = (lambda: ft.adamw(1e-2, weight_decay=0.1)) if name == "bare_adamw" else CHAINS[name]
    params, grads = _ordered_problem()
    tx = build()
    state = tx.init(params)
    p = {k: v.clone() for k, v in params.items()}
    for g in grads:
        before = dict(p)
        p, state = ft.step(
            tx, {k: v.clone() for k, v in g.items()}, state, p, donate=mode == "donate"
        )
        if mode == "donate":
            assert all(p[k] is before[k] for k in p)
    assert applies == [mode] * len(grads), applies
    monkeypatch.setattr(E, "run", real_run)
    _unfused(monkeypatch)
    want, _ = _run(build(), params, grads, "update")
    params_close(p, want, params, torch.float32, rtol32=1e-5)  # (see the module's docstring)


@pytest.mark.parametrize("no_grad", [False, True])
@pytest.mark.parametrize("mode", ["pure", "donate"])
def test_parameters_take_the_generated_kernel(mode, no_grad, monkeypatch):
    """``nn.Parameter`` leaves (``dict(model.named_parameters())``) run the generated stage as
    plain tensors do (it writes their memory when donated), with the same numbers; the pure
    step's results require grad as the parameters did. So under ``torch.no_grad()`` (where a
    loop often steps, as ``torch.optim`` does), which once left the fused path."""
    params, grads = _problem()
    want, _ = _run(CHAINS["adamw"](), params, grads, mode)
    seen = kernel_calls(monkeypatch)
    tx = CHAINS["adamw"]()
    p = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    state = tx.init(p)
    for g in grads:
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            p, state = step_by_mode(tx, {k: v.clone() for k, v in g.items()}, state, p, mode)
    assert len(seen) == STEPS and all(n == len(params) for _, n in seen)
    for k in params:
        assert p[k].requires_grad
        torch.testing.assert_close(p[k].detach(), want[k], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_compiled_multi_steps_runs_the_stage_operator(donate):
    """``torch.compile(ft.step, fullgraph=True)`` of ``multi_steps`` (two cycles of 2): its
    counters are not read on the host, so every micro-step runs one fused form, the inner
    parts guarded by the tensor "this is the cycle's last" (``elementwise.guarded``) and the
    updates zeroed elsewhere: the stage operator in one graph, no recompile from one
    micro-step to the next, and the eager step's parameters and state bit for bit."""
    tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)), 2)
    sc, se = _compiled_equals_eager(tx, donate)
    for x, y in zip(ft.tree.tree_flatten(sc)[0], ft.tree.tree_flatten(se)[0]):
        assert not isinstance(x, torch.Tensor) or torch.equal(x, y)


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_compiled_multi_steps_first_micro_step_copies_the_gradients(donate):
    """Under inductor, a compiled ``multi_steps`` first micro-step takes ``g`` into the
    accumulators (its kernel, specialised per value of the flag, does not read them:
    ``fuse.unswitched``), as the eager first micro-step copies it: the parameters and the
    accumulators bit for bit the eager step's over two cycles, a gradient's negative zeros
    included (``0 + -0`` is ``+0``, which the compiled step gave before)."""
    params, grads = _problem()
    grads = [
        {k: torch.where(v.abs() < 0.3, torch.full_like(v, -0.0), v) for k, v in g.items()}
        for g in grads
    ]
    tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), 2)
    torch._dynamo.reset()
    step = torch.compile(lambda g, s, p: ft.step(tx, g, s, p, donate=donate), fullgraph=True)
    pc, sc = {k: v.clone() for k, v in params.items()}, tx.init(params)
    pe, se = {k: v.clone() for k, v in params.items()}, tx.init(params)
    for i, g in enumerate(grads):
        pc, sc = step({k: v.clone() for k, v in g.items()}, sc, pc)
        pe, se = ft.step(tx, {k: v.clone() for k, v in g.items()}, se, pe, donate=donate)
        got = ft.tree.tree_flatten((pc, sc.acc_grads))[0]
        want = ft.tree.tree_flatten((pe, se.acc_grads))[0]
        for x, y in zip(got, want):
            assert torch.equal(x, y) and torch.equal(x.signbit(), y.signbit()), i
        if i % 2 == 0:  # (a first micro-step: the accumulators hold the gradients' zeros)
            assert any(bool((x == 0).logical_and(x.signbit()).any()) for x in got)


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_inductor_multi_steps_compiles_once(donate):
    """Under inductor (not only a backend that runs the traced graph), a compiled
    ``multi_steps`` compiles once for a whole cycle and the next: its per-leaf ``seen`` flags
    come back as distinct tensors. Inductor merged 122 copies of one flag into one output
    tensor, dynamo then guarded against the state's duplicate tensors, and the second call
    recompiled (7 s on the benchmark tree)."""
    params, grads = _problem()
    tx = ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), 2)

    def distinct_flags(sc):
        ids = [id(f) for f in sc.seen]
        assert len(set(ids)) == len(ids)

    _compiled_once(tx, params, grads, donate, distinct_flags)


def _compiled_once(tx, params, grads, donate, each=lambda state: None):
    """``tx`` stepped on ``grads`` (two cycles of a 2-step ``multi_steps``) by a step compiled
    by inductor: one graph, and the parameters of the eager step bit for bit; ``each(state)``
    after every compiled call. Returns both states, compiled and eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    step = torch.compile(
        lambda g, s, p: ft.step(tx, g, s, p, donate=donate), backend=counter, fullgraph=True
    )
    pc, sc = {k: v.clone() for k, v in params.items()}, tx.init(params)
    for g in grads:
        pc, sc = step({k: v.clone() for k, v in g.items()}, sc, pc)
        each(sc)
    assert counter.frame_count == 1
    want, want_state = _run(tx, params, grads, "donate" if donate else "pure")
    for k in params:
        assert torch.equal(pc[k], want[k]), k
    return sc, want_state


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_inductor_partition_of_multi_steps_with_an_empty_group_compiles_once(donate):
    """A ``partition`` of ``multi_steps`` groups one of which holds no leaf (``decay_mask`` on
    a model without biases): that group takes the traced form too, whose counter is a
    tensor, so the graph is not specialised on the cycle's position (the general path read
    the empty group's counter on the host, and the first final micro-step recompiled)."""
    params, grads = _problem()

    def group(wd):
        return ft.multi_steps(
            ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=wd)), 2
        )

    tx = ft.partition({"decay": group(0.1), "no_decay": group(0.0)}, {k: "decay" for k in params})
    sc, want_state = _compiled_once(tx, params, grads, donate)
    assert int(sc.inner_states["no_decay"].mini_step) == int(
        want_state.inner_states["no_decay"].mini_step
    )


@pytest.mark.slow
def test_compiled_donated_step_writes_its_inputs():
    """Under inductor, a compiled donated step runs the operator on the step's own inputs: no
    buffer of a leaf's size is allocated and nothing is copied back (a copy of every leaf
    after the operator made it 2.4x the eager donated step on the benchmark tree); bit for
    bit the eager donated step, the parameters' version counters bumped (autograd's record
    of an in-place write: ``engine.operators``)."""
    from torch._inductor.utils import run_and_get_code

    params, grads = _problem()
    tx = CHAINS["adamw"]()
    torch._dynamo.reset()
    step = torch.compile(lambda g, s, p: ft.step(tx, g, s, p, donate=True), fullgraph=True)
    pc, sc = {k: v.clone() for k, v in params.items()}, tx.init(params)
    inputs = dict(pc)
    versions = {k: v._version for k, v in pc.items()}
    (pc, sc), codes = run_and_get_code(step, grads[0], sc, pc)
    want, _ = _run(CHAINS["adamw"](), params, grads[:1], "donate")
    for k in params:
        assert torch.equal(pc[k], want[k]), k
        # (written in place, and autograd told so: the operator bumps the versions)
        assert pc[k] is inputs[k] and pc[k]._version > versions[k], k
    code = "\n".join(codes)
    assert "fused_stage_donated.default(" in code
    # (no copy kernel, copy_ or clone: what inductor makes of a result copied back)
    assert not any(w in code for w in ("fused_copy_", ".copy_(", "clone")), code
    sizes = {tuple(v.shape) for v in params.values() if v.dim()}
    assert not any(f"empty_strided_cpu({s}" in code for s in sizes), code


@pytest.mark.slow
def test_compiled_donated_multi_steps_skips_the_inner_stage(monkeypatch):
    """A compiled donated ``multi_steps`` non-final micro-step runs its accumulation only: the
    inner stage (guarded by "this is the cycle's last", its flag false) leaves every buffer
    as it was, so the operator skips it (``elementwise._idle``) and calls no kernel for it,
    the accumulation's updates are not written (``_discarded``) and the clip's norm is not
    computed (``Elementwise.flags``); the final micro-step runs them all, its accumulation's
    kernel taking the sums of squares the clip reads (no pass of their own, as eagerly).
    Parameters and state bit for bit the eager step's."""
    params, grads = _problem()

    def tx():
        return ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), 2)

    torch._dynamo.reset()
    t = tx()
    step = torch.compile(
        lambda g, s, p: ft.step(t, g, s, p, donate=True), backend="eager", fullgraph=True
    )
    pc, sc = {k: v.clone() for k, v in params.items()}, t.init(params)
    step({k: v.clone() for k, v in grads[0].items()}, sc, pc)  # (compiles)
    pc, sc = {k: v.clone() for k, v in params.items()}, t.init(params)
    seen = kernel_calls(monkeypatch)
    from functional_train.engine import native

    norms = []
    real = native.sum_squares
    monkeypatch.setattr(native, "sum_squares", lambda xs: norms.append(len(xs)) or real(xs))
    calls, clipped = [], []
    for g in grads[:4]:
        g = {k: v.clone() for k, v in g.items()}
        g0 = {k: v.clone() for k, v in g.items()}
        pc, sc = step(g, sc, pc)
        calls.append(len(seen))
        clipped.append(len(norms))
        # a non-final micro-step writes no updates over the gradients (no one reads them)
        assert all(torch.equal(g[k], g0[k]) for k in g) == (len(calls) % 2 == 1)
    per_step = [b - a for a, b in zip([0, *calls], calls)]
    assert per_step == [1, 2, 1, 2], per_step  # the accumulation; and the inner stage at the end
    # the clip's sums of squares only where they are used, taken by the accumulation's kernel
    assert [k.sumsq for k, _ in seen] == [False, True, False, False, True, False]
    assert clipped == [0, 0, 0, 0], clipped
    want, want_state = _run(tx(), params, grads[:4], "donate")
    for k in params:
        assert torch.equal(pc[k], want[k]), k
    for x, y in zip(ft.tree.tree_flatten(sc)[0], ft.tree.tree_flatten(want_state)[0]):
        assert not isinstance(x, torch.Tensor) or torch.equal(x, y)


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_compiled_multi_steps_without_a_reduction_passes_over_its_accumulators_only(
    donate, monkeypatch
):
    """``multi_steps(adamw)``: no reduction between the accumulation and AdamW, so compiled
    they are one stage, which a non-final micro-step cannot skip (the accumulators change).
    The stage operators run its accumulation part only there (``elementwise._held_from``:
    the parts after it guarded by "this is the cycle's last", its flag false, and the last
    zeroing the updates): its kernel reads the gradients and the accumulators, not the
    parameters and AdamW's moments (1.94x the eager donated cycle on the benchmark tree
    before, 1.14x after). The pure step returns the parameters and moments as they were
    (lazy clones). Parameters and state bit for bit the eager step's, every micro-step."""
    params, grads = _problem()

    def tx():
        return ft.multi_steps(ft.adamw(1e-2, weight_decay=0.1), 2)

    torch._dynamo.reset()
    t = tx()
    step = torch.compile(lambda g, s, p: ft.step(t, g, s, p, donate=donate), fullgraph=True)
    widths: list = []  # (per generated kernel call, its number of input lists)
    real = fuse.Kernel.__call__

    def spy(self, inputs, outputs, scalars, **kw):
        widths.append(len(inputs))
        return real(self, inputs, outputs, scalars, **kw)

    monkeypatch.setattr(fuse.Kernel, "__call__", spy)
    te = tx()
    pc, sc = {k: v.clone() for k, v in params.items()}, t.init(params)
    pe, se = {k: v.clone() for k, v in params.items()}, te.init(params)
    per_step = []
    for i, g in enumerate(grads[:4]):
        before = len(widths)
        pc, sc = step({k: v.clone() for k, v in g.items()}, sc, pc)
        per_step.append(widths[before:])
        pe, se = ft.step(te, {k: v.clone() for k, v in g.items()}, se, pe, donate=donate)
        for k in params:
            assert torch.equal(pc[k], pe[k]), (i, k)
        for x, y in zip(ft.tree.tree_flatten(sc)[0], ft.tree.tree_flatten(se)[0]):
            assert not isinstance(x, torch.Tensor) or torch.equal(x, y), i
    # a non-final micro-step: one kernel over (gradients, accumulators); the final one: the
    # whole stage (gradients, parameters, accumulators, mu, nu)
    assert per_step[0] == per_step[2] == [2], per_step
    assert per_step[1] == per_step[3] and per_step[1][0] > 2, per_step


def _two_multi_steps():
    """``partition`` of two ``multi_steps`` (each clipped by its own norm)."""
    return ft.partition(
        {
            "a": ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), 2),
            "b": ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.3), ft.sgd(0.1, 0.9)), 2),
        },
        {"w": "a", "b": "b", "e": "a", "s": "b"},
    )


def _stage_runs(monkeypatch) -> list:
    """A list that receives one entry per stage the engine runs (eagerly, or inside the
    compiled stage operators) for the rest of the test."""
    runs: list = []
    real = E._execute_local
    monkeypatch.setattr(E, "_execute_local", lambda *a, **k: runs.append(1) or real(*a, **k))
    return runs


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_partition_of_multi_steps_runs_stage_by_stage(compiled, monkeypatch):
    """``partition`` runs its transforms' parts stage by stage (``engine.elementwise.
    by_stages``: the parts of one label commute with another's, which act on other leaves):
    a cycle's last micro-step of two ``multi_steps`` is two stages, both accumulations then
    both inner transforms (three before: the second label's accumulation waited for the
    first label's inner transform). Compiled and donated, a non-final micro-step runs the
    accumulation stage only: the inner stage's restricted parts keep their guards on their
    own leaves and each leaf's last part zeroes (``elementwise._guards_of``), so the stage
    operator skips it. Bit for bit the eager step (compiled) and the general ``update``'s
    numbers (every step)."""
    params, grads = _problem()
    tx = _two_multi_steps()
    step = lambda g, s, p: ft.step(tx, g, s, p, donate=True)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step, backend="eager", fullgraph=True)
        step({k: v.clone() for k, v in grads[0].items()}, tx.init(params), dict(params))
    pc, sc = {k: v.clone() for k, v in params.items()}, tx.init(params)
    runs = _stage_runs(monkeypatch)
    per_step = []
    for g in grads[:4]:
        del runs[:]
        pc, sc = step({k: v.clone() for k, v in g.items()}, sc, pc)
        per_step.append(len(runs))
    assert per_step == [1, 2, 1, 2], per_step
    monkeypatch.undo()
    want, want_state = _run(_two_multi_steps(), params, grads[:4], "donate")
    ref, _ = _run(_two_multi_steps(), params, grads[:4], "update")
    for k in params:
        assert torch.equal(pc[k], want[k]) or not compiled, k
        torch.testing.assert_close(pc[k], ref[k], rtol=1e-6, atol=1e-7)
    for x, y in zip(ft.tree.tree_flatten(sc)[0], ft.tree.tree_flatten(want_state)[0]):
        assert not isinstance(x, torch.Tensor) or torch.equal(x, y)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_partition_of_one_wrapper_object_keeps_each_label_s_flag(compiled):
    """``partition`` given one ``apply_if_finite`` object for two labels: its parts publish
    their flag under one run-context key, so the labels are chained in label order, not
    stage by stage (each label's guard reads its own label's flag). A non-finite gradient
    in one label skips that label's step only, over 4 steps, as the general ``update``."""
    params, grads = _problem()
    grads[2]["w"][0, 1] = float("nan")  # (label a's leaf)
    # (two runs per label, the clip's reduction between them: interleaved, label b's flag
    # would be published before label a's second run reads its own)
    inner = ft.chain(ft.scale_by_adam(), ft.clip_by_global_norm(0.5), ft.scale(-1e-2))
    guard = ft.apply_if_finite(inner, 3)
    tx = ft.partition({"a": guard, "b": guard}, {"w": "a", "b": "b", "e": "a", "s": "b"})
    step = lambda g, s, p: ft.step(tx, g, s, p)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step, backend="eager", fullgraph=True)
    p, s = {k: v.clone() for k, v in params.items()}, tx.init(params)
    for g in grads:
        p, s = step({k: v.clone() for k, v in g.items()}, s, p)
    want, want_state = _run(tx, params, grads, "update")
    for k in params:
        torch.testing.assert_close(p[k], want[k], rtol=1e-6, atol=1e-7)
    assert int(s.inner_states["a"].total_notfinite) == 1
    assert int(s.inner_states["b"].total_notfinite) == 0


@pytest.mark.slow
def test_compiled_pure_multi_steps_hands_back_lazy_clones(monkeypatch):
    """A compiled pure ``multi_steps`` non-final micro-step makes no pass over the parameters
    and moments it leaves as they were: the stage operator, reading the flag "this is the
    cycle's last" false, returns copy-on-write lazy clones of them (``_held``: no copy until
    one side is written) and does not compute the accumulation's unused updates. Value
    semantics hold: the results equal the inputs; writing a returned tensor (an eager donated
    step, or in place) leaves the tree the caller passed in as it was and the other way
    round; the final micro-step's fresh results do not take a pooled buffer a live clone
    still reads (``pool.lazy_clones``). Parameters and state bit for bit the eager step's."""
    params, grads = _problem()

    def tx():
        return ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), 2)

    torch._dynamo.reset()
    t = tx()
    step = torch.compile(lambda g, s, p: ft.step(t, g, s, p), backend="eager", fullgraph=True)
    pc, sc = {k: v.clone() for k, v in params.items()}, t.init(params)
    held = []  # the results of each cycle's first (non-final) micro-step
    for i, g in enumerate(grads[:4]):
        before = {k: v.clone() for k, v in pc.items()}
        new_p, new_s = step({k: v.clone() for k, v in g.items()}, sc, pc)
        if i % 2 == 0:  # (non-final: the parameters and moments as they were, lazily)
            assert all(torch._C._is_cow_tensor(new_p[k]) for k in params)
            mu = new_s.inner_state[1][0].mu
            assert all(torch._C._is_cow_tensor(mu[k]) for k in mu)
            assert all(torch.equal(new_p[k], before[k]) for k in params)
            held.append({k: (v, v.clone()) for k, v in new_p.items()})
        pc, sc = new_p, new_s
    for clones in held:  # (alive through the final micro-steps: still their values)
        assert all(torch.equal(v, want) for v, want in clones.values())
    want, want_state = _run(tx(), params, grads[:4], "pure")
    for k in params:
        assert torch.equal(pc[k], want[k]), k
    for x, y in zip(ft.tree.tree_flatten(sc)[0], ft.tree.tree_flatten(want_state)[0]):
        assert not isinstance(x, torch.Tensor) or torch.equal(x, y)
    # writing one side of a lazy clone leaves the other as it was, either way round
    p1, s1 = step({k: v.clone() for k, v in grads[0].items()}, sc, pc)
    p2, _ = ft.step(t, {k: v.clone() for k, v in grads[1].items()}, s1, p1, donate=True)
    assert all(torch.equal(pc[k], want[k]) for k in params)  # (the donated step wrote p1's)
    assert not all(torch.equal(p2[k], want[k]) for k in params)
    p3, _ = step({k: v.clone() for k, v in grads[0].items()}, sc, pc)
    for k in params:
        pc[k].add_(1.0)
        assert torch.equal(p3[k], want[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_updates_runs_the_stage_add(dtype, monkeypatch):
    """``apply_updates`` on plain CPU tensors is the engine's ``p + u`` (the last stage's), one
    generated kernel call for the tree: torch's ``p + u.to(p.dtype)`` bit for bit (one rounding
    either way), float32 updates of bfloat16 parameters included, the inputs untouched."""
    params, grads = _problem(dtype)
    updates = {k: v.float() for k, v in grads[0].items()}
    before = {k: v.clone() for k, v in params.items()}
    seen = kernel_calls(monkeypatch)
    new = ft.apply_updates(params, updates)
    assert len(seen) == 1
    for k in params:
        assert torch.equal(new[k], params[k] + updates[k].to(dtype)), k
        assert torch.equal(params[k], before[k])


def test_trust_ratio_is_read_once_per_leaf(monkeypatch):
    """``lamb`` is two passes: Adam and the weight decay, then (after the per-leaf norms of
    the parameters and of those updates) the trust ratio, the learning rate and
    ``apply_updates``, in one kernel call each over every leaf. The second kernel reads each
    leaf's own ratio once per leaf (a 0-dim input, not a scalar of the call), and a leaf
    whose parameter is zero takes the ratio 1, as optax's."""
    params, grads = _problem()
    params["b"] = torch.zeros_like(params["b"])
    seen = kernel_calls(monkeypatch)
    tx = ft.lamb(1e-2, weight_decay=0.1)
    state = tx.init(params)
    p, _ = ft.step(tx, {k: v.clone() for k, v in grads[0].items()}, state, params)
    assert [n for _, n in seen] == [4, 4]
    trust = seen[1][0]
    assert "x2 = *p2;" in trust.source  # the ratio: loaded per leaf, outside the element loop
    # the ratio is 1 where the parameter is zero: the update is Adam's first step
    g = grads[0]["b"]
    want_b = -1e-2 * (g / (g.abs() + 1e-6))
    torch.testing.assert_close(p["b"], want_b, rtol=1e-6, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_compiled_lamb_runs_the_stage_operator(donate):
    """A compiled ``lamb`` (per-leaf trust ratios, inputs of the stage operator) is the eager
    step bit for bit, donated in place."""
    _compiled_equals_eager(ft.lamb(1e-2, weight_decay=0.1), donate)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_half_precision_step_is_the_eager_one(dtype):
    """With half-precision leaves too a compiled ``chain(clip, adamw)``, its
    ``apply_if_finite`` and its ``multi_steps`` are the eager step bit for bit, parameters and
    states (the stages are the eager kernels; the clip's norm, ``_foreach_norm`` traced for
    inductor, agrees here). ``multi_steps`` adds half-precision gradients into its float32
    accumulators in its fused form (its general path, compiled by inductor, ended a cycle an
    ulp of the half dtype apart)."""
    import optree

    params, grads = _problem(dtype)
    for tx in (
        ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)),
        ft.apply_if_finite(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), 3),
        ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), every_k=2),
    ):
        torch._dynamo.reset()
        step = torch.compile(lambda g, s, p, tx=tx: ft.step(tx, g, s, p), fullgraph=True)
        pe, pc = dict(params), dict(params)
        se, sc = tx.init(pe), tx.init(pc)
        for g in grads:
            pe, se = ft.step(tx, g, se, pe)
            pc, sc = step(g, sc, pc)
        for x, y in zip(optree.tree_leaves((pe, se)), optree.tree_leaves((pc, sc))):
            assert torch.equal(x, y)


@pytest.mark.parametrize("mode", ["update", "pure", "donate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_multi_steps_is_fused_and_exact(dtype, mode, monkeypatch):
    """``multi_steps`` over half-precision gradients with its default float32 accumulators
    takes its fused form: a non-final micro-step is ONE kernel call (``acc + g.float()``),
    and over two cycles the parameters, updates' dtypes and states are its general path's bit
    for bit (the mean and the inner transform in float32, the update rounded to the
    gradient's dtype once, as the general path returns it)."""
    import optree

    acc_mod = sys.modules["functional_train.accumulation"]
    params, grads = _problem(dtype)

    def tx():
        return ft.multi_steps(ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2)), every_k=2)

    seen = kernel_calls(monkeypatch)
    t = tx()
    state = t.init(params)
    assert ft.tree.tree_flatten(state.acc_grads)[0][0].dtype == torch.float32
    step_by_mode(t, {k: v.clone() for k, v in grads[0].items()}, state, params, mode)
    assert len(seen) == 1  # the accumulation only
    got, got_state = _run(tx(), params, grads, mode)
    with monkeypatch.context() as m:
        m.setattr(acc_mod, "_alike", lambda *a: False)  # the general path
        want, want_state = _run(tx(), params, grads, mode)
    for k in params:
        assert got[k].dtype == dtype
        assert torch.equal(got[k], want[k]), k
    for x, y in zip(optree.tree_leaves(got_state), optree.tree_leaves(want_state)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sums_of_squares_by_generated_kernels(dtype, device):
    """The clip's (and the trust ratio's) per-leaf sums of squares: on CPU the native C
    kernel, on CUDA the generated Triton kernels (``fuse_triton.sum_squares``: two launches
    for every leaf, float64 accumulation); the float64 sums of the leaves within float64
    rounding, the same bits on a second call (a fixed order), empty leaves 0."""
    from functional_train.engine import fuse_triton, native

    g = torch.Generator().manual_seed(0)
    sizes = (0, 1, 5, 1023, 1024, 1025, 70_000, 3 * 1024 + 7)
    xs = [torch.randn(n, generator=g).to(dtype).to(device) for n in sizes]
    xs.append(torch.randn(33, 17, generator=g).to(dtype).to(device))
    got = native.local_sum_squares(xs)
    if dtype == torch.bfloat16 and device.type == "cpu":
        assert got is None  # (the C kernels take float32 / float64: torch's norm then)
        return
    assert got is not None and got.dtype == torch.float64 and got.device == xs[0].device
    want = torch.stack([x.double().square().sum() for x in xs])
    assert (got - want).abs().max() <= 1e-14 * want.max()
    assert torch.equal(got, native.local_sum_squares(xs))
    if device.type == "cuda" and fuse_triton.available(device):
        assert fuse_triton.sum_squares(xs) is not None
    if device.type == "cpu":
        assert fuse_triton.sum_squares(xs) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["pure", "donate", "update"])
@pytest.mark.parametrize(
    "chain",
    [
        "multi_steps",  # (the last micro-step's mean, then the clip)
        "adam_then_clip",  # (scale_by_adam's stage, then the clip)
        "lamb",  # (the trust ratio: the updates' and the params' sums from the stage)
        "lamb_no_decay",  # (the updates' from the stage; the params' its own: not read there)
        "lamb_masked",  # (its decay mask: two kernel calls, by key, their sums gathered)
        "masked_adam_then_clip",  # (two calls: with and without the moments, as absent)
    ],
)
def test_a_stage_sums_the_squares_a_clip_reads(chain, mode, dtype, monkeypatch):
    """A clip after a stage (``multi_steps``' last micro-step: its mean; a chain with the clip
    after ``scale_by_adam``), and lamb's trust ratio, read the sums of squares the stage's
    kernel took as it wrote the updates (``Elementwise.reads_sum_squares``): no pass of their
    own over them (``native.sum_squares`` not called for them), and the same bits as the
    native sums of the updates in memory: parameters and states equal to the step whose
    reduction sums them itself, over whole cycles, with leaves of 0, 1, 16, 17 and 700
    elements. The trust ratio's parameter norms likewise, where the stage reads the
    parameters (its weight decay: ``Elementwise.reads_params_sum_squares``); without weight
    decay it sums them itself. A stage run by more than one kernel call (lamb's decay mask: a
    call per key) gives the sums its calls took, gathered in leaf order."""
    from functional_train.engine import native

    g = torch.Generator().manual_seed(3)
    shapes = {"w": (35, 20), "b": (17,), "c": (16,), "s": (), "e": (0, 4)}
    params = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}
    grads = [
        {k: torch.randn(s, generator=g, dtype=dtype) * 0.3 for k, s in shapes.items()}
        for _ in range(6)
    ]

    def make():
        if chain == "multi_steps":
            return ft.multi_steps(ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2)), 3)
        if chain == "lamb":
            return ft.lamb(1e-2, weight_decay=0.1)
        if chain == "lamb_no_decay":
            return ft.lamb(1e-2, weight_decay=0.0)
        if chain == "masked_adam_then_clip":
            mask = {"w": True, "b": False, "c": True, "s": False, "e": True}
            return ft.chain(
                ft.masked(ft.scale_by_adam(), mask),
                ft.clip_by_global_norm(0.5),
                ft.scale(-1e-2),
            )
        if chain == "lamb_masked":
            mask = {"w": True, "b": False, "c": True, "s": False, "e": True}
            return ft.lamb(1e-2, weight_decay=0.1, mask=mask)
        return ft.chain(ft.scale_by_adam(), ft.clip_by_global_norm(0.5), ft.scale(-1e-2))

    calls = []
    real = native.sum_squares

    def counted(xs):
        calls.append(len(xs))
        return real(xs)

    monkeypatch.setattr(native, "sum_squares", counted)
    got, got_state = _run(make(), params, grads, mode)
    fused_calls = list(calls)
    calls.clear()
    real_kernel_for = fuse.kernel_for

    def without_sums(
        fn, in_dtypes, scalar_dtypes, n_per_leaf=0, device_type="cpu", sumsq=False, **kw
    ):
        return (
            None
            if sumsq
            else real_kernel_for(fn, in_dtypes, scalar_dtypes, n_per_leaf, device_type, **kw)
        )

    monkeypatch.setattr(fuse, "kernel_for", without_sums)
    want, want_state = _run(make(), params, grads, mode)
    n = len(shapes)
    steps = 2 if chain == "multi_steps" else 6  # (the steps whose reduction reads the sums)
    if chain in ("lamb", "lamb_masked"):  # (no pass: both from the stage; without, both)
        assert fused_calls == [] and calls == [2 * n] * steps
    elif chain == "lamb_no_decay":  # (the parameters' sums, then both)
        assert fused_calls == [n] * steps and calls == [2 * n] * steps
    else:
        assert fused_calls == [] and calls == [n] * steps
    for k in params:
        assert torch.equal(got[k], want[k]), k
    a, b = ft.tree.tree_flatten(got_state)[0], ft.tree.tree_flatten(want_state)[0]
    assert len(a) == len(b)
    assert all(x is y if x is None else torch.equal(x, y) for x, y in zip(a, b))
    if not chain.startswith("lamb"):  # (the clip's norm, kept in its state)
        norm = ft.tree.tree_flatten(got_state)[0]
        norm = [x for x in norm if x is not None]
        assert any(x.ndim == 0 and x.dtype.is_floating_point and x > 0 for x in norm)


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True])
def test_compiled_lamb_takes_its_norms_from_the_stages(donate):
    """Under inductor, ``chain(clip, lamb(weight_decay))``'s trust ratio reads the updates' and
    the parameters' sums of squares that its first stage's operator took as it wrote the one
    and read the other (``Elementwise.reads_params_sum_squares``): the graph's only native
    sums are the clip's of the gradients, and it holds two stage operators. Parameters and
    state bit for bit the eager step's over six steps."""
    params, grads = _problem()

    def make():
        return ft.chain(ft.clip_by_global_norm(0.5), ft.lamb(1e-2, weight_decay=0.1))

    code = compiled_code_of_steps(make, params, grads, donate)
    op = "fused_stage_donated" if donate else "fused_stage"
    assert code.count(f"functional_train.{op}.default(") == 2, code
    assert code.count("functional_train.sum_squares.default(") == 1, code
