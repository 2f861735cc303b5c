"""Optimizer states checkpoint and reshard with torch.distributed.checkpoint.

States are DTensors with global shapes (row statistics sharded like the rows, column statistics
like the columns, projectors replicated, 8-bit codes like the parameter, ZeRO shards over dp), so
a checkpoint written by 4 gloo ranks at tp=2 x ZeRO dp=2 loads into the state of a one-process
run, leaf by leaf, and equals the state that run computes itself.
"""

import sys
from pathlib import Path

import optree
import pytest
import torch
import torch.distributed.checkpoint as dcp

import functional_train as ft

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _gloo_ckpt_worker as worker  # noqa: E402


@pytest.mark.slow
def test_states_saved_sharded_load_unsharded(tmp_path, ranks):
    ranks.run(4, "_gloo_ckpt_worker:main", str(tmp_path))
    params0, grads = worker.problem()
    for name, make in worker.optimizers().items():
        tx = ft.zero_redundancy(make())  # one process: the inner transform on whole tensors
        state = tx.init(params0)
        p = dict(params0)
        for g in grads:
            updates, state = tx.update(g, state, p)
            p = ft.apply_updates(p, updates)
        template = optree.tree_map(
            lambda x: torch.full_like(x, -7) if x.is_floating_point() else torch.zeros_like(x),
            worker.flat(state),
        )
        dcp.load(template, checkpoint_id=str(tmp_path / name), no_dist=True)
        want = worker.flat(state)
        assert set(template) == set(want)
        for k in want:
            torch.testing.assert_close(
                template[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}"
            )
