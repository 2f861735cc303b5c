"""The pure step's out-of-place kernels: the native ones (functional_train/engine/native.py,
C with streaming stores) and the inductor-generated ones (functional_train/engine/kernels.py)
they replace where they are unavailable. The primitives' numbers, inputs untouched, compiled
once per configuration, elementwise (a shard computes what the whole tensor computes, split
across threads or not, streamed or not), and a clean fallback where compiling fails."""

import itertools

import pytest
import torch

import functional_train as ft
from functional_train.engine import kernels, native

# the recognised chains' path (CUDA and torch.compile take it; eagerly on CPU ft.step runs a
# fusable chain as generated stages, functional_train/engine/fuse.py)
pytestmark = pytest.mark.usefixtures("recognised_path")


@pytest.fixture
def compiled(monkeypatch):
    """The inductor kernels: the native ones off, every leaf of 64 elements or more on the
    compiled path, whatever the tree's size."""
    monkeypatch.setattr(native, "ENABLED", False)
    monkeypatch.setattr(kernels, "MIN_BYTES", 0)
    monkeypatch.setattr(kernels, "MIN_LEAF_NUMEL", 64)
    monkeypatch.setattr(kernels, "ENABLED", True)
    monkeypatch.setattr(kernels, "_failed", False)


@pytest.fixture
def native_calls(monkeypatch):
    """The native kernels on (the leaves they ran on, per call, recorded)."""
    monkeypatch.setattr(native, "ENABLED", True)
    assert native.available(torch.float32), "no C compiler: the native kernels are untested"
    calls = []
    real = native._call
    monkeypatch.setattr(
        native,
        "_call",
        lambda kind, lists, *a: (
            calls.append([x.numel() for x in lists[0]]) or real(kind, lists, *a)
        ),
    )
    return calls


@pytest.fixture(params=["native", pytest.param("inductor", marks=pytest.mark.slow)])
def out_of_place(request):
    """Either out-of-place path; a callable telling whether it ran."""
    if request.param == "native":
        calls = request.getfixturevalue("native_calls")
        return lambda: bool(calls)
    request.getfixturevalue("compiled")
    return lambda: bool(kernels._compiled)


def _tree(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "emb": (37, 20),
        "w": (20, 20),
        "w2": (13, 11),
        "bias": (20,),
        "scale": (3,),
        "tall": (65, 3),
    }  # uneven sizes; bias and scale stay on torch's kernel
    return {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}


CONFIGS = {
    "clip+adamw": lambda: ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)),
    "adam l2 amsgrad maximize": lambda: ft.adam(
        1e-2, b1=0.8, weight_decay=0.1, amsgrad=True, maximize=True
    ),
    "adamw mask schedule": lambda: ft.adamw(
        ft.schedules.linear_schedule(1e-2, 1e-3, 10),
        weight_decay=0.1,
        mask=lambda p: {k: v.ndim > 1 for k, v in p.items()},
    ),
    "clip+sgd nesterov wd": lambda: ft.chain(
        ft.clip_by_global_norm(0.5), ft.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.1)
    ),
}


def _gradients_and_inputs(i, p, s, exact_norm=False):
    """Step ``i``'s gradients (seeded, scaled by ``i + 1``), every tensor a step on them, ``p``
    and ``s`` receives, and copies of those (to check that a pure step modifies none).
    ``exact_norm``: multiples of 1/4 of magnitude at most 2 (i + 1), whose squares sum exactly
    in float32 in any order."""
    gen = torch.Generator().manual_seed(100 + i)
    if exact_norm:
        g = {
            k: torch.randint(-8, 9, v.shape, generator=gen).float() * (i + 1) / 4
            for k, v in p.items()
        }
    else:
        g = {k: torch.randn(v.shape, generator=gen) * (i + 1) for k, v in p.items()}
    inputs = [x for x in torch.utils._pytree.tree_leaves((g, p, s)) if isinstance(x, torch.Tensor)]
    return g, inputs, [x.clone() for x in inputs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pure_step_equals_the_primitives(out_of_place, monkeypatch, name):
    """Five steps of ``ft.step(donate=False)`` through the out-of-place kernels equal
    ``tx.update`` + ``apply_updates`` (rtol 1e-5 on the parameter change, states to float
    rounding); gradients, parameters and state are not modified; no recompilation across
    steps; the large leaves (native: every leaf) do not go through torch's in-place kernels."""
    torch._dynamo.reset()
    kernels._compiled.clear()
    tx = CONFIGS[name]()
    p0 = _tree(torch.float32)
    p, s = p0, tx.init(p0)
    q, r = p0, tx.init(p0)
    sizes = []
    for kernel in ("_fused_adamw_", "_fused_adam_", "_fused_sgd_"):
        real = getattr(torch, kernel)
        monkeypatch.setattr(
            torch,
            kernel,
            lambda *a, _r=real, **k: sizes.extend(x.numel() for x in a[0]) or _r(*a, **k),
        )
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(5):
            g, inputs, before = _gradients_and_inputs(i, p, s)
            p, s = ft.step(tx, g, s, p)
            assert all(torch.equal(a, b) for a, b in zip(before, inputs))
            u, r = tx.update(g, r, q)
            q = ft.apply_updates(q, u)
    assert out_of_place(), "the out-of-place path did not run"
    if kernels._compiled:
        assert sizes and max(sizes) < 64  # only the small leaves went through torch's kernels
    else:
        assert not sizes  # native: every leaf out of place
    for k in p0:
        change = (q[k] - p0[k]).abs().max()
        assert (p[k] - q[k]).abs().max() <= 1e-5 * change, k
    for a, b in zip(torch.utils._pytree.tree_leaves(s), torch.utils._pytree.tree_leaves(r)):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            # float rounding relative to the state's scale: a moment that cancels to near 0
            # (b1 m + (1 - b1) g of opposite signs) keeps the absolute rounding of its terms
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b)


def test_inputs_untouched_and_float64(out_of_place):
    """float64 trees (their own compiled configuration) agree with the primitives to 1e-12 of
    the change, and a pure step leaves every input as it was."""
    torch._dynamo.reset()
    kernels._compiled.clear()
    tx = ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1))
    p0 = _tree(torch.float64)
    s0 = tx.init(p0)
    g = {k: torch.randn_like(v) for k, v in p0.items()}
    copies = [x.clone() for x in (*g.values(), *p0.values())]
    p1, s1 = ft.step(tx, g, s0, p0)
    p2, s2 = ft.step(tx, g, s1, p1)
    assert all(torch.equal(a, b) for a, b in zip(copies, (*g.values(), *p0.values())))
    u, r = tx.update(g, s0, p0)
    q1 = ft.apply_updates(p0, u)
    u, r = tx.update(g, r, q1)
    q2 = ft.apply_updates(q1, u)
    for k in p0:
        assert (p2[k] - q2[k]).abs().max() <= 1e-12 * (q2[k] - p0[k]).abs().max(), k
    assert out_of_place()
    assert not kernels._compiled or any(key[-1] == torch.float64 for key in kernels._compiled)


def test_a_shard_computes_what_the_whole_tensor_computes(out_of_place):
    """Elementwise to the bit: the kernel on slices of a leaf at any offset and length (the
    vectorised body and the tail of each differ; native: unaligned results are not streamed)
    equals the kernel on the whole leaf, so sharded equals unsharded as for torch's kernels."""
    n = 1001
    gen = torch.Generator().manual_seed(1)
    p, g, m, v = (torch.randn(n, generator=gen) for _ in range(4))
    v = v.abs()
    kw = dict(
        coef=torch.tensor(0.7),
        lr=1e-2,
        weight_decay=0.1,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        count=torch.tensor(3),
        decoupled=True,
        amsgrad=False,
        maximize=False,
    )
    whole = [torch.empty(n) for _ in range(3)]
    assert kernels.adam_pure([p], [g], [m], [v], None, *[[w] for w in whole], None, **kw)
    parts = [(0, 333), (333, 334), (334, 999), (999, 1001)]
    outs = [torch.full((n,), float("nan")) for _ in range(3)]
    sl = [[x[a:b] for a, b in parts] for x in (p, g, m, v, *outs)]
    assert kernels.adam_pure(*sl[:4], None, *sl[4:], None, **kw)
    for a, b in zip(whole, outs):
        assert torch.equal(a, b)


def test_fallback_when_compiling_fails(compiled, monkeypatch):
    """Where inductor cannot compile (no C++ compiler...), the step warns once and takes the
    copy + in-place path, with the same numbers."""
    kernels._compiled.clear()

    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    _step_warns_and_equals_the_chain("no compiler here")
    assert kernels._failed


def _step_warns_and_equals_the_chain(match):
    """A pure adamw step that warns (``match``) and still equals update + apply_updates."""
    tx = ft.adamw(1e-2, weight_decay=0.1)
    p0 = _tree(torch.float32)
    g = {k: torch.randn_like(v) for k, v in p0.items()}
    with pytest.warns(RuntimeWarning, match=match):
        p1, _ = ft.step(tx, g, tx.init(p0), p0)
    u, _ = tx.update(g, tx.init(p0), p0)
    q1 = ft.apply_updates(p0, u)
    for k in p0:
        torch.testing.assert_close(p1[k], q1[k], rtol=1e-6, atol=1e-7)


def test_off_below_the_size_threshold(monkeypatch):
    """Without the native kernels, small trees (the default ``MIN_BYTES``: 16 MiB of large
    leaves) keep torch's kernels: nothing is compiled for them. The native kernels take every
    float32 / float64 leaf; half-precision ones keep the thresholds."""
    if native.available(torch.float32):
        assert kernels.large_leaves([torch.zeros(100), torch.zeros(3, 3)]) == [0, 1]
    assert kernels.large_leaves([torch.zeros(100, dtype=torch.bfloat16)]) == []
    monkeypatch.setattr(native, "ENABLED", False)
    assert kernels.large_leaves([torch.zeros(1000, 1000)]) == []
    assert kernels.large_leaves([torch.zeros(100)]) == []


def _leaves(sizes, n_in, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ins = [[torch.randn(n, generator=gen, dtype=dtype) for n in sizes] for _ in range(n_in)]
    return [[x.abs() for x in L] if j in (3, 4) else L for j, L in enumerate(ins)]


ADAM_FLAGS = {
    "adam l2 amsgrad maximize clip": dict(
        decoupled=False, amsgrad=True, maximize=True, weight_decay=0.1, coef=0.7
    ),
    "adamw": dict(decoupled=True, amsgrad=False, maximize=False, weight_decay=0.1, coef=None),
}
SGD_FLAGS = {
    "sgd nesterov wd clip maximize": dict(
        momentum=0.9, nesterov=True, maximize=True, weight_decay=0.1, coef=0.7
    ),
    "sgd": dict(momentum=0.0, nesterov=False, maximize=False, weight_decay=0.0, coef=None),
}


def _run_pure(kind, flags, sizes, dtype=torch.float32):
    """``kernels.adam_pure`` / ``sgd_pure`` on seeded leaves of ``sizes``: the results."""
    f = dict(flags)
    if f["coef"] is not None:
        f["coef"] = torch.tensor(f["coef"], dtype=dtype)
    if kind == "adam":
        p, g, m, v, nm = _leaves(sizes, 5, dtype)
        outs = [[torch.full_like(x, float("nan")) for x in p] for _ in range(4)]
        if not f["amsgrad"]:
            nm, outs[3] = None, None
        assert kernels.adam_pure(
            p, g, m, v, nm, *outs, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, count=torch.tensor(3), **f
        )
    else:
        p, g, buf = _leaves(sizes, 3, dtype)
        outs = [[torch.full_like(x, float("nan")) for x in p] for _ in range(2)]
        if not f["momentum"]:
            buf, outs[1] = None, None
        assert kernels.sgd_pure(p, g, buf, *outs, lr=1e-2, **f)
    return [x for L in outs if L is not None for x in L]


CASES = [("adam", n, f) for n, f in ADAM_FLAGS.items()] + [
    ("sgd", n, f) for n, f in SGD_FLAGS.items()
]


@pytest.mark.parametrize("kind,name,flags", CASES, ids=[c[1] for c in CASES])
def test_native_equals_the_primitives_math(monkeypatch, kind, name, flags):
    """The native kernels on float32 leaves against the primitives' equations (the inductor
    kernels' expressions, ``kernels._adam_math`` / ``_sgd_math``) computed in float64 from
    the same inputs: each result within a few float32 roundings of the leaf's scale
    (moments) or of the parameter and its change (parameters)."""
    sizes = [1, 17, 1000, 4099]
    monkeypatch.setattr(native, "ENABLED", True)
    got = _run_pure(kind, flags, sizes)
    f = dict(flags)
    clip, maximize = f["coef"] is not None, f["maximize"]
    if kind == "adam":
        ins = [[x.double() for x in L] for L in _leaves(sizes, 5)]
        bc1, bc2 = kernels._bias_corrections(0.9, 0.999, torch.tensor(3))
        s = torch.tensor(
            [f["coef"] or 1.0, f["weight_decay"], 0.1, 0.999, 0.001, 1e-8, bc1, bc2, 1e-2],
            dtype=torch.float64,
        )
        wd = bool(f["weight_decay"])
        res = [
            kernels._adam_math(
                *[L[k] for L in ins],
                s,
                clip,
                maximize,
                wd and not f["decoupled"],
                wd and f["decoupled"],
                f["amsgrad"],
            )
            for k in range(len(sizes))
        ]
    else:
        ins = [[x.double() for x in L] for L in _leaves(sizes, 3)]
        s = torch.tensor(
            [f["coef"] or 1.0, f["weight_decay"], f["momentum"], 1e-2], dtype=torch.float64
        )
        res = [
            kernels._sgd_math(
                *[L[k] for L in ins],
                s,
                clip,
                maximize,
                bool(f["weight_decay"]),
                bool(f["momentum"]),
                f["nesterov"],
            )
            for k in range(len(sizes))
        ]
    want = [r[j] for j in range(len(res[0])) if res[0][j] is not None for r in res]
    assert len(got) == len(want)
    eps = torch.finfo(torch.float32).eps
    for j, (a, b) in enumerate(zip(got, want)):
        if j < len(sizes):  # parameters: an ulp of the parameter, a few of the change
            p = ins[0][j]
            tol = eps * (p.abs() + 4 * (b - p).abs())
        else:  # moments: the leaf's scale (the lerp's terms may cancel)
            tol = 4 * eps * b.abs().max()
        assert ((a.double() - b).abs() <= tol).all(), (name, j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_threads_and_streaming_change_nothing(native_calls, monkeypatch, dtype):
    """A native step split across threads (leaves cut at 1024-element blocks), with streaming
    stores or without, gives the same bits; every element is written."""
    sizes = [5000, 1, 70001, 3, 2048, 1025]
    want = None
    for threads, stream in itertools.product((1, 3), (False, True)):
        monkeypatch.setattr(native, "PARALLEL_MIN_NUMEL", 0 if threads > 1 else 2**62)
        monkeypatch.setattr(native, "STREAM_MIN_BYTES", 0 if stream else 2**62)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = [_run_pure(k, f, sizes, dtype) for k, _, f in CASES]
        finally:
            torch.set_num_threads(old)
        assert not any(x.isnan().any() for r in got for x in r)
        if want is None:
            want = got
        for a, b in zip(got, want):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    parts = native._parts(sizes, 3)
    assert len(parts) == 3
    for k, n in enumerate(sizes):  # each leaf covered once, cut at block multiples
        runs = sorted((a, c) for part in parts for j, a, c in part if j == k)
        assert runs[0][0] == 0 and sum(c for _, c in runs) == n
        assert all(a % 1024 == 0 and a == b + c for (a, _), (b, c) in zip(runs[1:], runs))


def test_native_declines_what_it_does_not_take(native_calls):
    """Strided leaves, mixed dtypes and tensor subclasses are left to the other paths
    (``False``, nothing written)."""
    p, g, m, v = _leaves([64], 4)
    out = [[torch.full((64,), float("nan"))] for _ in range(3)]
    kw = dict(
        coef=1.0,
        weight_decay=0.0,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        bc1=0.1,
        bc2_sqrt=0.1,
        lr=1e-3,
        decoupled=True,
        amsgrad=False,
    )
    strided = [torch.zeros(128)[::2]]
    assert not native.adam(strided, g, m, v, None, *out, None, **kw)
    assert not native.adam(p, [g[0].double()], m, v, None, *out, None, **kw)
    assert not native.adam(p, g, m, v, None, [torch.nn.Parameter(out[0][0])], *out[1:], None, **kw)
    assert all(x[0].isnan().all() for x in out)
    assert native.adam(p, g, m, v, None, *out, None, **kw)
    assert not any(x[0].isnan().any() for x in out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_sum_squares(native_calls, dtype):
    """``native.sum_squares``: each tensor's sum of squares in float64, within float64
    roundings of the exact sum (computed in float64 from the exactly squared elements); a
    tensor's sum is the same bits wherever it starts in memory and whatever its strides;
    half-precision, subclass and non-float tensors are declined (``None``)."""
    g = torch.Generator().manual_seed(3)
    sizes = [(0,), (1,), (15,), (16,), (17,), (33, 7), (64, 68), (4099,)]
    xs = [torch.randn(s, generator=g, dtype=dtype) * 3 for s in sizes]
    got = native.sum_squares(xs)
    assert got.dtype == torch.float64 and got.shape == (len(xs),)
    for x, s in zip(xs, got):
        exact = (x.double() * x.double()).sum()  # (exact squares: float32 ones in float64)
        assert abs(float(s) - float(exact)) <= 4 * x.numel() * 2.0**-53 * float(exact)
    assert float(got[0]) == 0.0
    base = torch.randn(5000, generator=g, dtype=dtype)
    for start in (0, 1, 3, 7):  # unaligned starts: the same order of additions
        a = native.sum_squares([base[start : start + 4099]])
        assert torch.equal(a, native.sum_squares([base[start : start + 4099].clone()]))
    strided = base[:4000].view(40, 100).t()[3:, 1:]  # a non-contiguous view: copied first
    assert torch.equal(native.sum_squares([strided]), native.sum_squares([strided.contiguous()]))
    other = torch.float64 if dtype == torch.float32 else torch.float32
    mixed = native.sum_squares([xs[5], xs[6].to(other), xs[7]])  # one call per dtype
    assert torch.equal(
        mixed,
        torch.cat(
            [
                native.sum_squares([xs[5]]),
                native.sum_squares([xs[6].to(other)]),
                native.sum_squares([xs[7]]),
            ]
        ),
    )
    assert native.sum_squares([xs[1], xs[2].half()]) is None
    assert native.sum_squares([torch.nn.Parameter(xs[1])]) is None
    assert native.sum_squares([torch.ones(3, dtype=torch.int32)]) is None


def test_clip_norm_native_and_foreach_agree(monkeypatch):
    """``clip_by_global_norm``'s norm from the native float64 sums against the
    ``_foreach_norm`` path (native kernels off): the same norm to float32 rounding, a float32
    state; three steps of ``ft.step``, pure and donated, give the same parameters to two
    float32 roundings per step."""
    tx = ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1))
    results = {}
    for on in (True, False):
        monkeypatch.setattr(native, "ENABLED", on)
        p = _tree(torch.float32)
        s = tx.init(p)
        norms = []
        for i in range(3):
            g, _, _ = _gradients_and_inputs(i, p, s)
            norms.append(ft.global_norm(g))
            p, s = ft.step(tx, g, s, p, donate=bool(i % 2))
            assert s[0].global_norm.dtype == torch.float32
        results[on] = (p, norms, s[0].global_norm)
    (p1, n1, s1), (p0, n0, s0) = results[True], results[False]
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(n1 + [s1], n0 + [s0]):
        assert a.dtype == b.dtype == torch.float32
        assert abs(float(a) - float(b)) <= 8 * eps * float(b)
    p_0 = _tree(torch.float32)
    for k in p1:  # (the kernels differ too: native FMA against torch's or inductor's order)
        change = (p0[k] - p_0[k]).abs().max()
        assert ((p1[k] - p0[k]).abs() <= 1e-5 * change + 6 * eps * p0[k].abs()).all(), k


def test_native_fallback_when_the_compiler_is_missing(monkeypatch, tmp_path):
    """Where the C compiler is missing (or fails), the step warns once and takes the other
    paths, with the primitives' numbers."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "ENABLED", True)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    _step_warns_and_equals_the_chain("native out-of-place optimizer kernels are off")
    assert not native.available(torch.float32)
    assert not list((tmp_path / "cache").glob("*.so"))


CONFIGS_8BIT = {
    "adamw": lambda: ft.adamw(1e-2, weight_decay=0.1, optim_bits=8),
    "adamw mask schedule": lambda: ft.adamw(
        ft.schedules.linear_schedule(1e-2, 1e-3, 10),
        weight_decay=0.1,
        optim_bits=8,
        mask=lambda p: {k: k != "v" for k in p},
    ),
    "adam l2 maximize": lambda: ft.adam(
        1e-2, b1=0.8, weight_decay=0.1, optim_bits=8, maximize=True
    ),
    "injected adamw": lambda: ft.inject_hyperparams(ft.adamw)(
        learning_rate=1e-2, b1=0.9, weight_decay=0.1, optim_bits=8
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,donate",
    [  # each configuration, pure and donated alternately
        ("adamw", False),
        ("adamw mask schedule", True),
        ("adam l2 maximize", False),
        ("injected adamw", True),
    ],
)
def test_8bit_step_through_the_compiled_kernel(monkeypatch, name, donate):
    """``ft.step`` of 8-bit Adam / AdamW: the quantised leaves whose last dim is a multiple of
    the block size, or below it (96: each row one block), go through the compiled kernel (one
    call each, leaves of four sizes, no recompilation), the others (float moments, a
    300-wide leaf) through the chain. Over 4
    steps the codes, block maxima and float moments equal ``update`` + ``apply_updates`` bit
    for bit; the parameters to float rounding: per step, an ulp of the update for each of its
    two last roundings (the kernel's square root and division round once each, torch's
    vectorised ones may not: they differ on AVX-512 by one or two ulps) and one of the
    parameter for the sum, accumulated over the steps; a pure step leaves its inputs alone."""
    from functional_train.engine import kernels

    monkeypatch.setattr(kernels, "ENABLED", True)
    monkeypatch.setattr(kernels, "_failed", False)
    calls = []
    real = kernels.adam8bit
    monkeypatch.setattr(
        kernels,
        "adam8bit",
        lambda ins, *a, **k: calls.append([tuple(x[0].shape) for x in ins]) or real(ins, *a, **k),
    )
    gen = torch.Generator().manual_seed(3)
    p0 = {
        "w": torch.randn(40, 512, generator=gen),
        "v": torch.randn(24, 256, generator=gen),
        "u": torch.randn(5120, generator=gen),
        "b": torch.randn(300, generator=gen),
        "narrow": torch.randn(50, 96, generator=gen),
        "odd": torch.randn(15, 300, generator=gen),
    }
    tx = CONFIGS_8BIT[name]()
    p, s = {k: v.clone() for k, v in p0.items()}, tx.init(p0)
    q, r = p0, tx.init(p0)
    eps = torch.finfo(torch.float32).eps
    tol = {k: torch.zeros_like(v) for k, v in p0.items()}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(4):
            g = {k: torch.randn(v.shape, generator=gen) * (i + 1) for k, v in p0.items()}
            inputs = [
                x for x in torch.utils._pytree.tree_leaves((g, p, s)) if isinstance(x, torch.Tensor)
            ]
            before = [x.clone() for x in inputs]
            p, s = ft.step(tx, g, s, p, donate=donate)
            if not donate:
                assert all(torch.equal(a, b) for a, b in zip(before, inputs))
            u, r = tx.update(g, r, q)
            q_new = ft.apply_updates(q, u)
            for k in p0:  # per step: an ulp of the update's two roundings, one of the sum's
                tol[k] = tol[k] + eps * (2 * u[k].abs() + torch.maximum(q[k].abs(), q_new[k].abs()))
            q = q_new
    assert not kernels._failed
    assert [sorted(c) for c in calls] == [[(24, 256), (40, 512), (50, 96), (5120,)]] * 4
    for a, b in zip(torch.utils._pytree.tree_leaves(s), torch.utils._pytree.tree_leaves(r)):
        assert (a is None and b is None) or torch.equal(a, b)
    for k in p0:
        assert ((p[k] - q[k]).abs() <= tol[k]).all(), k
        if k in ("b", "odd"):  # the chain's own leaves
            assert torch.equal(p[k], q[k]), k


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,path", [(n, "native") for n in CONFIGS] + [("clip+adamw", "inductor")]
)
def test_compiled_step_runs_the_eager_kernels(request, monkeypatch, name, path):
    """``torch.compile(ft.step, fullgraph=True)`` of sgd / adam / adamw (after a clip, with a
    mask and a schedule) calls the eager pure step through one operator
    (``functional_train::pure_fused_step``): four steps equal the eager pure step bit for bit,
    parameters and state; the inputs are untouched; the schedule's changing learning rate
    recompiles nothing, neither the step nor the kernels inside the operator. (The clip's norm
    is the graph's own, summed in inductor's order, which may round otherwise than eager's on
    some CPUs: the gradients here sum exactly in any order.)"""
    ran = request.getfixturevalue("native_calls" if path == "native" else "compiled")
    torch._dynamo.reset()
    kernels._compiled.clear()
    import sys

    mod = sys.modules["functional_train.step"]
    calls = []
    real = mod._pure
    monkeypatch.setattr(mod, "_pure", lambda *a, **k: calls.append(1) or real(*a, **k))
    tx = CONFIGS[name]()
    p0 = _tree(torch.float32)
    fn = torch.compile(lambda g, s, p: ft.step(tx, g, s, p), fullgraph=True)
    p, s = p0, tx.init(p0)
    q, r = p0, tx.init(p0)
    for i in range(4):
        g, inputs, before = _gradients_and_inputs(i, p, s, exact_norm=True)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            p, s = fn(g, s, p)
        assert all(torch.equal(a, b) for a, b in zip(before, inputs))
        q, r = ft.step(tx, g, r, q)
    assert len(calls) == 8  # 4 compiled, 4 eager
    assert ran if path == "native" else kernels._compiled, "the out-of-place kernels did not run"
    for k in p0:
        assert torch.equal(p[k], q[k]), k
    for a, b in zip(torch.utils._pytree.tree_leaves(s), torch.utils._pytree.tree_leaves(r)):
        assert torch.equal(a, b)
    torch._dynamo.reset()
