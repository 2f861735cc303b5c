"""The whole update + apply step is traceable by torch.compile (fullgraph) and gives eager's
numbers (plain tensors, one process)."""

import torch

import functional_train as ft


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
