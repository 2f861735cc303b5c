"""The whole update + apply step is traceable by torch.compile (fullgraph) and gives eager's
numbers (plain tensors, one process)."""

import pytest
import torch

import functional_train as ft


@pytest.mark.slow
def test_compiled_step_matches_eager():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 8, generator=gen), "b": torch.randn(8, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(3)]
    schedule = ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-2, 1, 10)
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(schedule, weight_decay=0.1))

    def step(g, state, p):
        updates, state = tx.update(g, state, p)
        return ft.apply_updates(p, updates), state

    compiled = torch.compile(step, fullgraph=True)
    pe, se = params, tx.init(params)
    pc, sc = params, tx.init(params)
    for g in grads:
        pe, se = step(g, se, pe)
        pc, sc = compiled(g, sc, pc)
    for k in params:
        torch.testing.assert_close(pc[k], pe[k], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ft.tree_get(sc, "global_norm"), ft.tree_get(se, "global_norm"))
    assert int(sc[1][0].count) == int(se[1][0].count) == 3


@pytest.mark.slow
def test_import_does_not_load_dynamo_and_its_marker_is_dynamos():
    """Importing the library does not import ``torch._dynamo`` (0.4 s of every process's
    start), and ``engine.owners.assume_constant_result`` marks a function as
    ``torch._dynamo.assume_constant_result`` does."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, functional_train; print('torch._dynamo' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "False"
    from functional_train.engine.owners import assume_constant_result

    def a():
        return 1

    def b():
        return 1

    assert vars(torch._dynamo.assume_constant_result(a)) == vars(assume_constant_result(b)) != {}
