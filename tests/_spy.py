"""Test helpers that watch the engine: the generated kernels' calls."""

from functional_train.engine import fuse


def kernel_calls(monkeypatch) -> list:
    """A list that receives ``(kernel, number of leaves)`` for every call of a generated
    kernel (``functional_train.engine.fuse.Kernel``) for the rest of the test."""
    seen: list = []
    real = fuse.Kernel.__call__

    def spy(self, inputs, outputs, scalars, **kw):
        seen.append((self, len(inputs[0])))
        return real(self, inputs, outputs, scalars, **kw)

    monkeypatch.setattr(fuse.Kernel, "__call__", spy)
    return seen
