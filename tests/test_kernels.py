"""The CPU kernels outside the generated stages: the native sums of squares of a clip's norm
(functional_train/engine/native.py) and 8-bit Adam's inductor kernel
(functional_train/engine/kernels.py): their numbers, and a clean fallback where compiling
fails."""

import concurrent.futures
import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import functional_train as ft
from functional_train.engine import fuse, kernels, native


@pytest.fixture
def native_on(monkeypatch):
    """The native kernels on (and built: a C compiler is there)."""
    monkeypatch.setattr(native, "ENABLED", True)
    assert native.available(torch.float32), "no C compiler: the native kernels are untested"


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


def _step_warns_and_equals_the_chain(match):
    """A pure clipped adamw step that warns (``match``) and still equals update +
    apply_updates."""
    tx = ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1))
    p0 = _tree(torch.float32)
    g = {k: torch.randn_like(v) for k, v in p0.items()}
    with pytest.warns(RuntimeWarning, match=match):
        p1, _ = ft.step(tx, g, tx.init(p0), p0)
    u, _ = tx.update(g, tx.init(p0), p0)
    q1 = ft.apply_updates(p0, u)
    for k in p0:
        torch.testing.assert_close(p1[k], q1[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_sum_squares(native_on, dtype):
    """``native.sum_squares``: each tensor's sum of squares in float64, within float64
    roundings of the exact sum (computed in float64 from the exactly squared elements); a
    tensor's sum is the same bits wherever it starts in memory, read in its memory order
    (a tensor dense in another order, ``channels_last``, transposed: where it lies; one with
    gaps: copied contiguous first); half-precision, subclass and non-float tensors are
    declined (``None``)."""
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
    # (channels_last and transposed leaves among contiguous ones and one with gaps: each read
    # in its memory order, where it lies, the one with gaps copied; to float64 rounding the
    # logical order's sums)
    cl = torch.randn(6, 5, 3, 3, generator=g, dtype=dtype).to(memory_format=torch.channels_last)
    t = xs[6].t()
    mixed_order = [xs[5], cl, xs[7], strided, t]
    in_memory = [xs[5], cl.permute(0, 2, 3, 1), xs[7], strided.contiguous(), xs[6]]
    got = native.sum_squares(mixed_order)
    assert torch.equal(got, native.sum_squares(in_memory))
    torch.testing.assert_close(
        got, native.sum_squares([x.contiguous() for x in mixed_order]), rtol=1e-14, atol=0
    )
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_sums_with_nans_zeroed(native_on, dtype, monkeypatch):
    """``native.sum_squares(xs, zeroed=True)``: each tensor's sum of squares (NaN where it
    holds a NaN, as ``sum_squares``'), then, from the same read, the sum with its NaNs taken as
    zeros: bit for bit ``sum_squares`` of ``zero_nans``' result, for NaNs in the vector chunks
    and in the remainder, at every length around a chunk, contiguous, transposed, with gaps,
    of mixed dtypes; the operator's eager body and torch's fallback (no native kernels) give
    the same numbers (the fallback to float64 rounding)."""
    g = torch.Generator().manual_seed(5)
    sizes = [(0,), (1,), (15,), (16,), (17,), (33, 7), (64, 68), (4099,)]
    xs = [torch.randn(s, generator=g, dtype=dtype) for s in sizes]
    xs[1].fill_(float("nan"))
    xs[3].view(-1)[[0, 9]] = float("nan")  # (in a chunk of 16)
    xs[4].view(-1)[16] = float("nan")  # (in the remainder)
    xs[6].view(-1)[::97] = float("nan")
    xs[7].view(-1)[4096:] = float("nan")
    ys = [
        *xs,
        xs[6].t(),
        xs[6][:, ::3],
        xs[5].to(torch.float64 if dtype == torch.float32 else torch.float32),
    ]
    clean = [torch.where(y.isnan(), 0, y) for y in ys]
    n = len(ys)
    both = native.sum_squares(ys, zeroed=True)
    plain = native.sum_squares(ys)
    assert both.shape == (2 * n,) and both.dtype == torch.float64
    assert torch.equal(both[:n].isnan(), plain.isnan())
    assert [bool(v) for v in plain.isnan()] == [bool(y.isnan().any()) for y in ys]
    assert torch.equal(both[:n].nan_to_num(-1.0), plain.nan_to_num(-1.0))
    assert torch.equal(both[n:], native.sum_squares(clean))
    assert torch.equal(
        native.sums_of_squares(ys, zeroed=True).nan_to_num(-1.0), both.nan_to_num(-1.0)
    )
    monkeypatch.setattr(native, "ENABLED", False)
    fallback = native.sums_of_squares(ys, zeroed=True)
    torch.testing.assert_close(fallback.nan_to_num(-1.0), both.nan_to_num(-1.0), rtol=1e-13, atol=0)


_X86_AVX2_FMA = {"avx2", "fma"} <= set(native._cpu().split())


@pytest.mark.skipif(not _X86_AVX2_FMA, reason="compares this CPU's AVX2 sums with its plain C ones")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_sums_are_the_same_bits_without_avx2(native_on, dtype, monkeypatch, tmp_path):
    """``_sumsq.h`` adds in the same order on every machine with fused multiply-adds: the
    native sums (plain and NaN-zeroed) and a generated stage's sums of its results, compiled
    without AVX2 (``-mno-avx2``: its 16 lanes in plain C, as on CPUs without AVX2 and on ARM),
    are the bits of this CPU's AVX2 ones, at every length around a chunk of 16."""
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, generator=g, dtype=dtype) * 3 for n in (0, 1, 15, 16, 17, 47, 4099)]
    xs[5][[3, 40]] = float("nan")

    sc = fuse.scalar_pointers([0.5])

    def sums():
        def fn(ins, sc):  # (a new function: a kernel of its own, built with the flags now)
            return (ins[0] * sc[0],)

        k = fuse.kernel_for(fn, (dtype,), sc[1], sumsq=True)
        assert k is not None, "the stage did not compile"
        out, stage = [torch.empty_like(x) for x in xs], torch.empty(len(xs), dtype=torch.float64)
        k([xs], [out], sc[0], sums=stage)
        return native.sum_squares(xs, zeroed=True), stage

    want = sums()
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_CFLAGS", [*native._CFLAGS, "-mno-avx2"])
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(fuse, "_CFLAGS", [*fuse._CFLAGS, "-mno-avx2"])
    got = sums()
    assert native._lib is not None and len(list(tmp_path.glob("*.so"))) == 2
    for a, b in zip(got, want):
        assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))
    assert [bool(v) for v in want[0][: len(xs)].isnan()] == [bool(x.isnan().any()) for x in xs]


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


def _multi_steps_groups():
    def group(p):
        return {k: "a" if v.ndim >= 2 else "b" for k, v in p.items()}

    clipped = ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1))
    return ft.partition(
        {"a": ft.multi_steps(clipped, 2), "b": ft.multi_steps(ft.sgd(0.1, momentum=0.9), 2)},
        group,
    )


_SIMULATED = {
    "zero_nans": lambda: ft.chain(
        ft.zero_nans(), ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)
    ),
    "multi_steps_groups": _multi_steps_groups,
}


@pytest.mark.parametrize("name", list(_SIMULATED))
@pytest.mark.parametrize("how", ["update", "step"])
def test_kernels_take_plain_leaves_under_simulated_ranks(native_on, how, name):
    """Plain (not DTensor) leaves under ``testing.simulate``, whose ``LocalTensorMode`` makes
    every new tensor a simulated rank's: the native sums and the generated stages make their
    buffers and results outside the mode (before, they were the mode's, without a data
    pointer: ``clip_by_global_norm``, ``zero_nans`` and a ``partition`` of ``multi_steps``
    raised a RuntimeError), and three steps give every rank the plain run's parameters bit
    for bit."""
    from torch.distributed._local_tensor import LocalTensor

    from functional_train.testing import simulate

    tx = _SIMULATED[name]()
    p0 = _tree(torch.float32)
    grads = [_gradients_and_inputs(i, p0, None)[0] for i in range(3)]

    def run():
        p, s = p0, tx.init(p0)
        for g in grads:
            if how == "update":
                u, s = tx.update(g, s, p)
                p = ft.apply_updates(p, u)
            else:
                p, s = ft.step(tx, g, s, p)
        return p

    want = run()
    with simulate(2):
        sums = native.sum_squares(list(p0.values()))
        got = run()
    assert type(sums) is torch.Tensor
    assert torch.equal(sums, native.sum_squares(list(p0.values())))
    for k, x in got.items():
        ranks = list(x._local_tensors.values()) if isinstance(x, LocalTensor) else [x]
        assert len(ranks) in (1, 2)
        for r in ranks:
            assert torch.equal(r, want[k]), k


def test_native_fallback_when_the_compiler_is_missing(monkeypatch, tmp_path):
    """Where the C compiler is missing (or fails), the clip's norm warns once and torch sums
    the squares, with the primitives' numbers."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    # (the stages this step fails to build are remembered for the process: a memo of this
    # test's own, so that a later test in this worker builds them)
    monkeypatch.setattr(fuse, "_kernels", {})
    monkeypatch.setattr(fuse, "_warned", [])
    monkeypatch.setattr(native, "ENABLED", True)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    _step_warns_and_equals_the_chain("native sums of squares are off")
    assert not native.available(torch.float32)
    assert not list((tmp_path / "cache").glob("*.so"))


def test_concurrent_builds_compile_once(monkeypatch, tmp_path):
    """Callers that ask for the same library at once (threads here; ranks and test workers
    alike) run the compiler once: the others wait on its lock and load its file, and no lock
    file is left beside it."""
    calls = tmp_path / "calls"
    # (the compiler the library would take, counting its runs that write a library: a
    # compiler driver may run $CC itself to probe, as zig cc does for the C library's paths)
    cc = tmp_path / "cc"
    cc.write_text(
        f'#!/bin/sh\ncase " $* " in *" -o "*) echo x >> {calls};; esac\nsleep 0.5\n'
        f'exec {native._compiler()} "$@"\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    source = b"long ft_answer(void) { return 42; }\n"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        paths = list(
            pool.map(lambda _: native.build_library(source, "t", ["-shared", "-fPIC"]), range(4))
        )
    assert len(set(paths)) == 1 and calls.read_text() == "x\n"
    assert ctypes.CDLL(str(paths[0])).ft_answer() == 42
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [paths[0].name]


def test_sanitizer_flags(monkeypatch, tmp_path):
    """``FT_SANITIZE`` builds the libraries with the sanitizer (their loads call its checks)
    under cache keys of their own, beside the plain builds; a malformed value is refused,
    naming the variable."""
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    source = b"float ft_at(const float *x, long i) { return x[i]; }\n"
    flags = ["-O1", "-shared", "-fPIC"]
    monkeypatch.delenv("FT_SANITIZE", raising=False)
    assert native.sanitizer_flags() == []
    plain = native.build_library(source, "t", flags)
    monkeypatch.setenv("FT_SANITIZE", "address")
    assert native.sanitizer_flags() == ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]
    checked = native.build_library(source, "t", flags)
    assert checked != plain and plain.exists()
    assert b"__asan_report_load4" in checked.read_bytes()
    assert b"__asan" not in plain.read_bytes()
    monkeypatch.setenv("FT_SANITIZE", "address -shared")
    with pytest.raises(ValueError, match="FT_SANITIZE='address -shared'"):
        native.build_library(source, "t", flags)


def _runtime(cc: str, name: str) -> str | None:
    """The path of the compiler's ``name`` runtime library, or ``None`` where it has none."""
    out = subprocess.run(
        [*cc.split(), f"-print-file-name={name}"], capture_output=True, text=True
    ).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


@pytest.mark.slow
def test_sanitized_kernels_report_an_out_of_bounds_write(tmp_path):
    """The README's AddressSanitizer recipe catches what it is for: in a process started as
    the README starts the test suite under it, a library built with ``FT_SANITIZE=address``
    that writes one float past the end of a torch tensor is stopped with a
    heap-buffer-overflow report; the same write inside the tensor runs."""
    cc = native._compiler()
    asan, cxx = _runtime(cc, "libasan.so"), _runtime(cc, "libstdc++.so")
    if asan is None or cxx is None:
        pytest.skip(f"{cc} has no AddressSanitizer runtime")
    script = tmp_path / "oob.py"
    script.write_text(
        textwrap.dedent(
            """
            import ctypes, sys, torch
            from functional_train.engine import native
            path = native.build_library(
                b"void ft_put(float *x, long i) { x[i] = 1.0f; }\\n", "oob", ["-shared", "-fPIC"]
            )
            put = ctypes.CDLL(str(path)).ft_put
            x = torch.zeros(1000)
            put(ctypes.c_void_p(x.data_ptr()), ctypes.c_long(int(sys.argv[1])))
            print("written", float(x.sum()))
            """
        )
    )
    env = dict(
        os.environ,
        FT_SANITIZE="address",
        FT_CACHE_DIR=str(tmp_path / "cache"),
        LD_PRELOAD=f"{asan} {cxx}",
        ASAN_OPTIONS="detect_leaks=0:verify_asan_link_order=0",
    )

    def run(i):
        return subprocess.run(
            [sys.executable, str(script), str(i)], env=env, capture_output=True, text=True
        )

    inside = run(999)
    assert inside.returncode == 0 and "written 1.0" in inside.stdout, inside.stderr[-2000:]
    past = run(1000)
    assert past.returncode != 0 and "written" not in past.stdout
    assert "heap-buffer-overflow" in past.stderr and "ft_put" in past.stderr, past.stderr[-2000:]


def test_a_caller_that_finds_the_library_built_under_the_lock_leaves_no_lock(monkeypatch, tmp_path):
    """A caller that missed the library at its first check, and took the lock after the
    builder had removed its lock file (so made a fresh one), finds the library, compiles
    nothing and removes that lock file too."""
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    source = b"long ft_answer(void) { return 42; }\n"
    built = native.build_library(source, "t", ["-shared", "-fPIC"])
    monkeypatch.setattr(native, "_compile", lambda *a: pytest.fail("compiled again"))
    real_exists, misses = Path.exists, [built]

    def exists(self, **kw):  # (the first check misses the library: the builder not yet done)
        if self == built and misses:
            misses.pop()
            return False
        return real_exists(self, **kw)

    monkeypatch.setattr(Path, "exists", exists)
    assert native.build_library(source, "t", ["-shared", "-fPIC"]) == built and not misses
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [built.name]


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
