"""Test helpers that watch the engine: the generated kernels' calls."""

import pytest
import torch

from functional_train.engine import fuse, fuse_triton


def kernel_calls(monkeypatch) -> list:
    """A list that receives ``(kernel, number of leaves)`` for every call of a generated
    kernel (``functional_train.engine.fuse.Kernel``, C, called or run by rows;
    ``fuse_triton.TritonKernel``, CUDA; ``fuse.ForeachKernel``, a CUDA stage that is exactly
    one of torch's foreach operations, and the generated kernel it calls where it is not)
    for the rest of the test."""
    seen: list = []
    for cls in (fuse.Kernel, fuse_triton.TritonKernel, fuse.ForeachKernel):

        def spy(self, inputs, outputs, scalars, *, _real=cls.__call__, **kw):
            seen.append((self, len(inputs[0])))
            return _real(self, inputs, outputs, scalars, **kw)

        monkeypatch.setattr(cls, "__call__", spy)

    for cls in (fuse.Kernel, fuse_triton.TritonKernel):

        def by_rows(self, inputs, outputs, scalars, kinds, *, _real=cls.by_rows, **kw):
            seen.append((self, len(inputs[0])))
            return _real(self, inputs, outputs, scalars, kinds, **kw)

        monkeypatch.setattr(cls, "by_rows", by_rows)

    def results(self, inputs, *, _real=fuse.ForeachKernel.results):
        made = _real(self, inputs)
        if made is not None:  # (the stage's results made by torch's foreach operation)
            seen.append((self, len(inputs[0])))
        return made

    monkeypatch.setattr(fuse.ForeachKernel, "results", results)
    return seen


def kernels_run_on(device) -> bool:
    """Whether the engine's generated kernels run on ``device`` (CPU: C; CUDA: Triton, where
    it is importable)."""
    return device.type == "cpu" or fuse_triton.available(device)


def torch_fused_calls(monkeypatch) -> list:
    """A list that receives the name of every call of torch's fused optimizer kernels
    (``torch._fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``) for the rest of the test."""
    seen: list = []

    def spy_of(name):
        real = getattr(torch, name)

        def spy(*args, **kw):
            seen.append(name)
            return real(*args, **kw)

        return spy

    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_"):
        monkeypatch.setattr(torch, name, spy_of(name))
    return seen


def took_torch_fused(device, torch_fused: list, seen: list) -> bool:
    """Whether a step on CUDA ran torch's fused optimizer kernel (``torch_fused``: from
    :func:`torch_fused_calls`), as ``ft.step`` does for the chains it recognises there; if
    so, no generated kernel ran (``seen``: from :func:`kernel_calls`)."""
    if device.type == "cuda" and torch_fused:
        assert not seen, "a recognised chain runs torch's fused kernel, not a generated one"
        return True
    return False


def triton_interpreted(monkeypatch) -> None:
    """For the rest of the test, the generated Triton kernels (``fuse_triton``'s stages and
    sums of squares) are loaded anew and run by Triton's interpreter (``TRITON_INTERPRET=1``:
    numpy on the host, so CPU tensors stand for the GPU's; each kernel a module of its own,
    since on a CUDA machine the same source may be jitted for the GPU already, which takes no
    CPU addresses; CUDA's ``libdevice.pow``, which the interpreter does not run, as
    ``exp2(b * log2(a))``). Skips where Triton is not installed (the test extras install it on
    Linux x86_64)."""
    pytest.importorskip("triton")
    import triton.language as tl

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fuse_triton, "_sumsq_kernels", {})

    class libdevice:
        @staticmethod
        def pow(a, b):
            return tl.exp2(tl.log2(a) * b)

    real_load = fuse_triton._load_source

    def load(source, fn_name):
        fn = real_load(source + "# run by Triton's interpreter\n", fn_name)
        if "libdevice" in fn.fn.__globals__:
            fn.fn.__globals__["libdevice"] = libdevice
        return fn

    monkeypatch.setattr(fuse_triton, "_load_source", load)


def compiled_code_of_steps(make, params, grads, donate: bool) -> str:
    """``torch.compile(ft.step)`` of the transform ``make()`` over ``grads`` (a fresh copy of
    each), checked step by step to equal the eager step of another ``make()`` bit for bit
    (parameters and every tensor of the state); returns the code inductor generated for the
    first call (the graph's operators, to count)."""
    from torch._inductor.utils import run_and_get_code

    import functional_train as ft

    tx, ref = make(), make()
    torch._dynamo.reset()
    step = torch.compile(lambda g, s, p: ft.step(tx, g, s, p, donate=donate), fullgraph=True)
    pc, sc = {k: v.clone() for k, v in params.items()}, tx.init(params)
    pe, se = {k: v.clone() for k, v in params.items()}, ref.init(params)
    codes: list = []
    for i, g in enumerate(grads):
        if i == 0:
            (pc, sc), codes = run_and_get_code(step, {k: v.clone() for k, v in g.items()}, sc, pc)
        else:
            pc, sc = step({k: v.clone() for k, v in g.items()}, sc, pc)
        pe, se = ft.step(ref, {k: v.clone() for k, v in g.items()}, se, pe, donate=donate)
        got, want = ft.tree.tree_flatten((pc, sc))[0], ft.tree.tree_flatten((pe, se))[0]
        assert len(got) == len(want), i
        for x, y in zip(got, want):
            assert not isinstance(x, torch.Tensor) or torch.equal(x, y), i
    return "\n".join(codes)


def general_updates(monkeypatch) -> None:
    """Every wrapper's and chain's ``update`` by its general path for the rest of the context
    (the transforms inside by their own updates, one after another): ``base.run_fused``,
    which runs a fused form chosen per call, turned off where the library calls it. The
    reference a test compares a fused step with."""
    from functional_train import accumulation, base, nonfinite

    for module in (base, accumulation, nonfinite):
        monkeypatch.setattr(module, "run_fused", lambda *a: None)
