"""``ft.TorchOptimizer`` with torch.distributed.checkpoint: ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` on DTensor parameters (FSDP2 ``fully_shard`` with uneven shards,
tensor parallel ``parallelize_module``) on 2 gloo ranks equal one process, and a ``dcp.save``
written on 2 ranks loads into a one-process plain model + TorchOptimizer that continues as the
2 ranks do; in one process the round trip is bitwise and never steps a fresh optimizer."""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import functional_train as ft
from functional_train.tree import tree_flatten

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _gloo_torch_optimizer_worker as worker  # noqa: E402

# DCP in this process: no simulated process group left over by earlier tests
pytestmark = pytest.mark.usefixtures("no_fake_process_group")

STEPS, MORE = worker.STEPS, worker.MORE


def _close_change(got: dict, want: dict, start: dict, what: str) -> None:
    """The parameter change since ``start`` agrees to float tolerance (rtol 1e-5)."""
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(
            got[n] - start[n],
            want[n] - start[n],
            rtol=1e-5,
            atol=1e-7,
            msg=lambda m: f"{what} {n}: {m}",
        )


@pytest.fixture(scope="session")  # once per session (see test_sweep's _compiled_on_gloo)
def two_ranks(tmp_path_factory, ranks):
    tmp = tmp_path_factory.mktemp("torch_optimizer_dist")
    return ranks.run(2, "_gloo_torch_optimizer_worker:main", str(tmp))[0], tmp


@pytest.mark.slow
@pytest.mark.parametrize("layout", worker.LAYOUTS)
def test_two_ranks_train_and_checkpoint_like_one_process(two_ranks, layout):
    res, tmp = two_ranks
    r = res[layout]
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    # get_optimizer_state_dict on a fresh optimizer ran no zero-gradient step
    assert r["fresh"] == {"count": 0, "grads": [True] * 4, "same": True, "keys": sorted(names)}
    # torch's layout and torch.optim.AdamW's keys, keyed by fully qualified names; the states
    # are DTensors laid out like their parameters, "step" a plain 0-dim tensor
    assert r["params"] == names
    assert set(r["state_keys"]) == set(names)
    assert all(r["state_keys"][n] == ["exp_avg", "exp_avg_sq", "step"] for n in names)
    want_mu = (
        {n: "(Shard(dim=0),)" for n in names}
        if layout == "fsdp"
        else {
            "0.weight": "(Shard(dim=0),)",
            "0.bias": "(Shard(dim=0),)",
            "2.weight": "(Shard(dim=1),)",
            "2.bias": "(Replicate(),)",
        }
    )
    assert r["mu_placements"] == want_mu

    # one process, the same global batches
    data = worker.batches()
    m = worker.model(layout)
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    for n in start:
        assert torch.equal(r["start"][n], start[n])
    opt = ft.TorchOptimizer(m.named_parameters(), worker.make_tx())
    worker.train(m, opt, data[:STEPS])
    ref_steps = worker.full(m)
    ref_osd = copy.deepcopy(opt.state_dict())
    worker.train(m, opt, data[STEPS:])
    _close_change(r["steps"], ref_steps, start, f"{layout} {STEPS} steps")
    _close_change(r["more"], worker.full(m), start, f"{layout} {STEPS + MORE} steps")

    # the 2-rank checkpoint resharded into a plain model + TorchOptimizer in one process
    m1 = worker.model(layout, seed=5)
    o1 = ft.TorchOptimizer(m1.named_parameters(), worker.make_tx())
    sd = {"model": get_model_state_dict(m1), "optim": get_optimizer_state_dict(m1, o1)}
    dcp.load(sd, checkpoint_id=str(tmp / f"ckpt_{layout}"))
    set_model_state_dict(m1, sd["model"])
    set_optimizer_state_dict(m1, o1, optim_state_dict=sd["optim"])
    assert int(o1.ft_state.count) == STEPS
    for n, p in m1.named_parameters():
        assert torch.equal(p.detach(), r["steps"][n])
    got_osd = o1.state_dict()
    for i, entry in ref_osd["state"].items():
        assert set(got_osd["state"][i]) == set(entry)
        for k, v in entry.items():
            torch.testing.assert_close(
                got_osd["state"][i][k],
                v,
                rtol=1e-5,
                atol=1e-7,
                msg=lambda msg: f"{layout} state {i} {k}: {msg}",
            )
    worker.train(m1, o1, data[STEPS:])
    _close_change(worker.full(m1), r["more"], r["steps"], f"{layout} resumed in one process")
    if layout == "fsdp":  # and back on 2 ranks (the worker reloaded it there)
        assert r["reloaded_count"] == STEPS
        for n in names:
            assert torch.equal(r["reloaded_more"][n], r["more"][n]), n
        # full_state_dict=True: gathered to the global tensor, and scattered back exactly
        assert not isinstance(r["full_mu"], torch.distributed.tensor.DTensor)
        assert r["full_mu"].shape == (15, 8)
        assert r["full_round_trip"]


def _clip_adamw():
    return ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1))


@pytest.mark.parametrize("flatten", [False, True])
def test_one_process_round_trip_is_bitwise(tmp_path, flatten):
    data = worker.batches(STEPS + MORE)
    a = worker.model("fsdp")
    oa = ft.TorchOptimizer(a.named_parameters(), _clip_adamw())
    worker.train(a, oa, data[:STEPS])
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    saved = copy.deepcopy(get_optimizer_state_dict(a, oa, options=options))
    if not flatten:
        assert sorted(saved["state"]) == sorted(n for n, _ in a.named_parameters())
        assert "ft/0.global_norm" in saved["state"]["0.weight"]
        assert saved["state"]["0.weight"]["step"] == STEPS
        assert saved["param_groups"][0]["lr"] == 1e-2
    # optimizer.state: the same entries, the transform's own tensors
    view = oa.state[a[0].bias]
    assert set(view) == {"step", "exp_avg", "exp_avg_sq"}
    assert view["exp_avg"] is oa.ft_state[1].inner_state[0].mu["0.bias"]
    assert len(oa.state) == 4 and a[0].bias in oa.state

    b = worker.model("fsdp", seed=3)
    ob = ft.TorchOptimizer(b.named_parameters(), _clip_adamw())
    before = {n: p.detach().clone() for n, p in b.named_parameters()}
    # through dcp.save / dcp.load in one process, into the state dicts of the fresh pair
    dcp.save({"model": get_model_state_dict(a), "optim": saved}, checkpoint_id=str(tmp_path))
    sd = {
        "model": get_model_state_dict(b),
        "optim": get_optimizer_state_dict(b, ob, options=options),
    }
    assert int(ob.ft_state[1].count) == 0 and all(p.grad is None for p in b.parameters())
    assert all(torch.equal(p, before[n]) for n, p in b.named_parameters())  # no init step
    dcp.load(sd, checkpoint_id=str(tmp_path))
    set_model_state_dict(b, sd["model"])
    set_optimizer_state_dict(b, ob, optim_state_dict=sd["optim"], options=options)
    for x in (oa, ob):
        x.param_groups[0]["lr"] = 5e-3  # the group's hyperparameters still drive the steps
    worker.train(a, oa, data[STEPS:])
    worker.train(b, ob, data[STEPS:])
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    for x, y in zip(tree_flatten(oa.ft_state)[0], tree_flatten(ob.ft_state)[0]):
        assert torch.equal(x, y)


def test_state_dict_torch_layout_and_errors():
    m = worker.model("fsdp")
    m[0].bias.requires_grad_(False)
    opt = ft.TorchOptimizer(m.named_parameters(), ft.adamw(1e-2))
    worker.train(m, opt, worker.batches(2))
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sd["param_groups"][0]["betas"] == (0.9, 0.999)
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} == set(sd["state"][2])
    assert "hyperparams" not in str(sd["state"])  # (the groups hold them)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only
    # torch's set_optimizer_state_dict drops the entries of frozen parameters: kept
    del loaded["state"][1]
    other = ft.TorchOptimizer(m.named_parameters(), ft.adamw(1e-2))
    other.load_state_dict(loaded)
    for x, y in zip(*(tree_flatten(o.ft_state)[0] for o in (opt, other))):
        assert torch.equal(x, y)
    bad = copy.deepcopy(sd)
    del bad["state"][2]["exp_avg_sq"]
    with pytest.raises(ValueError, match="no 'exp_avg_sq' for parameter '2.weight'"):
        other.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][0]["ft/nope"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected state keys \['ft/nope'\]"):
        other.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][2]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict(bad)
    kept = copy.deepcopy(sd)  # a key of no transform is kept beside the state, as torch keeps it
    kept["state"][2]["note"] = torch.zeros(1)
    other.load_state_dict(kept)
    assert torch.equal(other.state_dict()["state"][2]["note"], torch.zeros(1))
    with pytest.raises(ValueError, match="another optimizer"):
        ft.TorchOptimizer(m.named_parameters(), ft.sgd(0.1, momentum=0.9)).load_state_dict(sd)
