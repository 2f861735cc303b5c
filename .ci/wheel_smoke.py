"""The built wheel, installed (not editable) in a fresh virtual environment, from outside the
source tree: the package and its data files are there, one ``ft.step`` of
``chain(clip_by_global_norm, adamw)`` equals torch's ``clip_grad_norm_`` + ``AdamW``, its clip's
norm ran the native kernel built from the wheel's ``engine/_kernels.c`` (with its
``engine/_sumsq.h``), and its stage ran a
kernel generated and compiled in this environment (``engine/fuse.py``).

Run by ``.ci/run`` as ``python .ci/wheel_smoke.py`` with the wheel's environment active and the
working directory outside the repository."""

import os
import tempfile
from pathlib import Path

import torch

import functional_train as ft
from functional_train.engine import fuse, native

here = Path(ft.__file__).resolve().parent
assert "site-packages" in here.parts, f"imported from {here}, not from the installed wheel"
for data in ("py.typed", "engine/_kernels.c", "engine/_sumsq.h"):
    assert (here / data).is_file(), f"the wheel lacks functional_train/{data}"

os.environ["FT_CACHE_DIR"] = tempfile.mkdtemp()  # build the kernel from the wheel's source
assert native.available(torch.float32), "the native kernel did not build from the wheel"
calls, stages = [], []
real = native.sum_squares
native.sum_squares = lambda xs: calls.append(len(xs)) or real(xs)
real_stage = fuse.Kernel.__call__
fuse.Kernel.__call__ = lambda self, *a, **k: stages.append(self) or real_stage(self, *a, **k)

g = torch.Generator().manual_seed(0)
params = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}
grads = {k: torch.randn(v.shape, generator=g) * 3 for k, v in params.items()}
tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1))
new, state = ft.step(tx, grads, tx.init(params), params)
assert calls, "the clip's norm did not run the native kernel"
assert stages, "the step did not run a generated kernel"

ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
for k, p in ref.items():
    p.grad = grads[k].clone()
torch.nn.utils.clip_grad_norm_(list(ref.values()), 1.0)
torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.1).step()
for k in params:
    torch.testing.assert_close(new[k], ref[k].detach(), rtol=1e-6, atol=1e-7)
print(f"wheel smoke test passed: functional_train {ft.__version__} from {here}")
