"""Real multi-process runs on gloo (CPU): the core transforms against real collectives."""

import sys
from pathlib import Path

import pytest
import torch

import functional_train as ft

pytestmark = pytest.mark.slow  # starts processes

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _gloo_worker as worker  # noqa: E402


def test_dp_tp_chain_matches_one_process(ranks):
    res = ranks.run(4, "_gloo_worker:main")[0]
    params, grads = worker.problem()
    tx = worker.make_tx()
    state = tx.init(params)
    for step in grads:
        g = {k: (step[0][k] + step[1][k]) / 2 for k in params}  # DDP mean over the 2 replicas
        updates, state = tx.update(g, state, params)
        params = ft.apply_updates(params, updates)
    for k in params:
        torch.testing.assert_close(res["params"][k], params[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res["norm"], ft.tree_get(state, "global_norm"), rtol=1e-5, atol=1e-6)
    # non-final micro-steps: no collective; final: the presence agreement and one bucketed
    # data-axis mean (dp group), one Partial sum (tp group), the Shard(0) -> Replicate gather of
    # "n", and ONE norm all-reduce.
    assert res["counts"][0] == {} and res["counts"][2] == {}
    assert res["counts"][1] == res["counts"][3]
    assert res["counts"][1] == {"all_reduce": 4, "all_gather_into_tensor": 1}, res["counts"]


def test_zero_aliases_tp2_dp2_match_one_process(ranks):
    """Each optimizer alias as zero_redundancy(alias) at tp=2 x ZeRO dp=2 on real collectives
    equals the one-process run; one reduce-scatter in and one all-gather out per step. Its
    ``ft.step``, pure and donated (the inner's step on the zero view, the new parameter chunks
    all-gathered), gives ``update`` + ``apply_updates``' parameters with the same
    collectives; uncounted (eagerly, where each all-gather is one broadcast per rank of the
    dp group), the same parameters bit for bit."""
    import _gloo_zero_worker as zw

    res = ranks.run(4, "_gloo_zero_worker:main")[0]
    params0, grads = zw.problem()
    runs = [f"{n} step donate={d}" for n in zw.aliases() for d in (False, True)]
    eager = [f"{n} step eager" for n in zw.aliases()]
    assert set(res) == set(zw.aliases()) | set(runs) | set(eager)
    for name in zw.aliases():  # uncounted, eagerly: each all-gather as dp=2 broadcasts
        run = res[f"{name} step eager"]
        for k in params0:
            assert torch.equal(run["params"][k], res[f"{name} step donate=True"]["params"][k])
        counted = res[f"{name} step donate=True"]["counts"]
        assert run["broadcasts"] == [2 * c["all_gather_into_tensor"] for c in counted], (
            name,
            run["broadcasts"],
            counted,
        )
    for run in runs:  # ft.step: tx.update + apply_updates' parameters, the same collectives
        name = run.split(" ")[0]
        for k in params0:
            torch.testing.assert_close(
                res[run]["params"][k],
                res[name]["params"][k],
                rtol=1e-6,
                atol=1e-7,
                msg=lambda m: f"{run} {k}: {m}",
            )
        assert res[run]["counts"] == res[name]["counts"], (run, res[run]["counts"])
    for name, make in zw.aliases().items():
        tx = make()
        params = dict(params0)
        state = tx.init(params)
        for step in grads:
            g = {k: (step[0][k] + step[1][k]) / 2 for k in params}
            updates, state = tx.update(g, state, params)
            params = ft.apply_updates(params, updates)
        for k in params:
            torch.testing.assert_close(
                res[name]["params"][k],
                params[k],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m: f"{name} {k}: {m}",
            )
        for step, c in enumerate(res[name]["counts"]):
            assert c.get("reduce_scatter_tensor") == 1, (name, c)
            gathers = c.get("all_gather_into_tensor")
            if name == "galore_adamw" and step % 2 == 0:  # a projector refresh (gap 2)
                assert gathers > 1, (name, step, c)  # + the refresh's gathers of sharded leaves
            else:
                assert gathers == 1, (name, step, c)


def test_statistics_over_two_mesh_dims_take_one_all_reduce(ranks):
    """(pp=2, dp=2, tp=2) on 8 ranks: clip + lamb, whose trust-ratio norms are completed over
    dp x tp (every dim but the pipeline one), equal one process on the union of both stages'
    leaves with the dp mean of the gradients; each step takes 4 all-reduces (presence, dp mean,
    the clip's norm, lamb's norms): the statistics go through one cached process group of the
    stage's dp x tp ranks, not one all-reduce per dim (5 before)."""
    import _gloo_slice_worker as slice_worker

    res = ranks.run(8, "_gloo_slice_worker:main")[0]
    params, grads = slice_worker.problem()
    tx = slice_worker.make_tx()
    state = tx.init(params)
    for step in grads:
        g = {s: {k: (step[0][s][k] + step[1][s][k]) / 2 for k in params[s]} for s in params}
        params, state = ft.step(tx, g, state, params)
    for s in params:
        for k in params[s]:
            torch.testing.assert_close(res["params"][s][k], params[s][k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res["norm"], ft.tree_get(state, "global_norm"), rtol=1e-5, atol=1e-6)
    assert res["groups"] == 1
    assert res["counts"] == [{"all_reduce": 4}] * len(grads), res["counts"]
