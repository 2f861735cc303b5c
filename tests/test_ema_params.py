"""``ema_params``: bit for bit torch's ``AveragedModel(get_ema_multi_avg_fn(decay))`` fed the
same parameters, the warmup ramp in closed form, sharded == unsharded, and the evaluation
helper."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import functional_train as ft
from functional_train.testing import assert_sharded_equivalent


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("decay", [0.9, 0.999])
def test_equals_torch_averaged_model_bitwise(decay):
    model = _mlp()
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=False)
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(0.05), ft.ema_params(decay))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = tx.init(params)
    # before any update the average is the parameters themselves (AveragedModel's deepcopy)
    for k, v in ft.averaged_params(state).items():
        assert torch.equal(v, params[k])
    gen = torch.Generator().manual_seed(1)
    for t in range(8):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        if t % 3 == 1:
            grads["2.bias"] = None  # frozen this step: averaged at its current value
        updates, state = tx.update(grads, state, params)
        params = ft.apply_updates(params, updates)
        with torch.no_grad():
            for k, v in model.named_parameters():
                v.copy_(params[k])
        avg.update_parameters(model)
        ema = ft.averaged_params(state)
        for k, v in avg.module.named_parameters():
            assert torch.equal(ema[k], v), (t, k)
        assert int(state[2].count) == t + 1


def test_warmup_ramp():
    x = {"w": torch.zeros(3, dtype=torch.float64)}
    tx = ft.ema_params(0.99, warmup=True)
    state = tx.init(x)
    ema, p = torch.zeros(3, dtype=torch.float64), x["w"]
    for n in range(40):
        u = {"w": torch.full((3,), float(n + 1), dtype=torch.float64)}
        _, state = tx.update(u, state, x)
        new = p + u["w"]
        d = min(0.99, (1 + n) / (10 + n))
        ema = new.clone() if n == 0 else ema + (1 - d) * (new - ema)
        torch.testing.assert_close(state.ema["w"], ema, rtol=1e-14, atol=0)


def test_updates_pass_through_and_dtypes():
    params = {"w": torch.randn(4, 3, dtype=torch.bfloat16), "s": None}
    tx = ft.ema_params(0.5)
    state = tx.init(params)
    assert state.ema["w"].dtype == torch.float32 and state.ema["s"] is None
    u = {"w": torch.randn(4, 3, dtype=torch.bfloat16), "s": None}
    out, state = tx.update(u, state, params)
    assert torch.equal(out["w"], u["w"])
    with pytest.raises(ValueError, match="needs params"):
        tx.update(u, state)
    with pytest.raises(ValueError, match="decay"):
        ft.ema_params(1.5)
    with pytest.raises(ValueError, match="one EmaParamsState"):
        ft.averaged_params(ft.adamw().init({"w": torch.zeros(2)}))


@pytest.mark.parametrize("warmup", [False, True])
def test_sharded_equals_unsharded(warmup):
    gen = torch.Generator().manual_seed(2)
    params = {
        "a": torch.randn(7, 5, generator=gen),
        "b": torch.randn(3, 6, generator=gen),
        "c": torch.randn(4, generator=gen),
    }
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(4)]
    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2), ft.ema_params(0.8, warmup=warmup))
    assert_sharded_equivalent(
        tx,
        params,
        grads,
        mesh_shape=(2, 2),
        placements={"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(1)], "c": None},
    )
