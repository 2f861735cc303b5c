"""``ft.TorchOptimizer`` with real clients: torch's LR schedulers (the learning rate and the
momentum they set are the ones the transform uses), ``clip_grad_norm_``-equivalent chains,
``state_dict`` round trips through ``torch.save``, and HF ``transformers.Trainer`` training a
tiny Llama built from a config on text from the Python standard library."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import functional_train as ft


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)) for _ in range(n)
    ]


def _train(model, opt, sched, batches, clip=None, log=None):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if log is not None:
            log.append(opt)
        sched.step()


def _close(model, ref, start):
    for (n, p), q, s in zip(model.named_parameters(), ref.parameters(), start.parameters()):
        torch.testing.assert_close(
            p.detach() - s.detach(),
            q.detach() - s.detach(),
            rtol=1e-5,
            atol=1e-7,
            msg=lambda m: f"{n}: {m}",
        )


@pytest.mark.parametrize("sched", ["one_cycle", "lambda", "cosine"])
def test_schedulers_drive_adamw_as_they_drive_torch(sched):
    start = _model()
    model, ref = copy.deepcopy(start), copy.deepcopy(start)
    opt = ft.TorchOptimizer(model.named_parameters(), ft.adamw(1e-2, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999) and opt.param_groups[0]["lr"] == 1e-2

    def make(o):
        if sched == "one_cycle":  # cycles the learning rate and beta1
            return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=12)
        if sched == "lambda":
            return torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1 + t))
        return torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12)

    s, rs = make(opt), make(ref_opt)
    batches = _batches(12)
    seen = []
    for x, y in batches:
        lr, betas = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        hp = ft.get_hyperparams(opt.ft_state)  # what the transform used in this step
        seen.append((float(hp["learning_rate"]), float(hp["b1"])))
        assert seen[-1] == (lr, betas[0])
        s.step()
        rs.step()
    assert len({lr for lr, _ in seen}) > 5
    _close(model, ref, start)


def test_clip_chain_and_sgd_momentum_with_lambda_lr():
    start = _model()
    model, ref = copy.deepcopy(start), copy.deepcopy(start)
    opt = ft.TorchOptimizer(
        model.parameters(),
        ft.chain(ft.clip_by_global_norm(0.5), ft.sgd(0.1, momentum=0.9, nesterov=True)),
    )
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    batches = _batches(8)
    _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.9**t), batches)
    _train(
        ref,
        ref_opt,
        torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda t: 0.9**t),
        batches,
        clip=0.5,
    )
    _close(model, ref, start)


@pytest.mark.parametrize("path", ["generated", "recognised"])
def test_clipped_alias_takes_the_fused_step(path, monkeypatch, request):
    """chain(clip, adamw) as a TorchOptimizer (the alias injected after the clip) runs
    ft.step's fused path on every step, as the alias alone does (it used to fall back to
    the primitives: 4.1x torch's fused AdamW on the benchmark tree, against 0.8x): on CPU the
    chain's generated stage (the chain's fused form, chosen per step from the injected
    values), or (``recognised``: as on CUDA) torch's fused kernel; and trains as
    torch.optim.AdamW after clip_grad_norm_ under OneCycleLR (learning rate and beta1
    cycled)."""
    import sys

    if path == "recognised":
        request.getfixturevalue("recognised_path")
    step_mod = sys.modules["functional_train.step"]  # (ft.step is the function)
    fused = []
    real = step_mod._run_fused if path == "recognised" else step_mod._run_spec

    def spy(*args):
        out = real(*args)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(step_mod, real.__name__, spy)
    start = _model()
    model, ref = copy.deepcopy(start), copy.deepcopy(start)
    opt = ft.TorchOptimizer(
        model.named_parameters(),
        ft.chain(ft.clip_by_global_norm(0.5), ft.adamw(1e-2, weight_decay=0.1)),
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    batches = _batches(8)
    cycle = dict(max_lr=2e-2, total_steps=8)
    _train(model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, **cycle), batches)
    _train(ref, ref_opt, torch.optim.lr_scheduler.OneCycleLR(ref_opt, **cycle), batches, clip=0.5)
    _close(model, ref, start)
    assert fused == [True] * 8
    assert float(ft.tree_get(opt.ft_state, "global_norm")) > 0.5  # the clip did clip


def test_closure_state_dict_round_trip_and_errors():
    start = _model()
    a, b = copy.deepcopy(start), copy.deepcopy(start)
    oa = ft.TorchOptimizer(a.named_parameters(), ft.adam(1e-2))
    batches = _batches(6)
    for x, y in batches[:3]:

        def closure():
            oa.zero_grad()
            loss = torch.nn.functional.mse_loss(a(x), y)
            loss.backward()
            return loss

        assert isinstance(oa.step(closure), torch.Tensor)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)  # weights_only=True: the states are registered safe globals
    b.load_state_dict(saved["model"])
    ob = ft.TorchOptimizer(b.named_parameters(), ft.adam(1e-2))
    ob.load_state_dict(saved["opt"])
    for x, y in batches[3:]:
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="add_param_group"):
        oa.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    with pytest.raises(ValueError, match="another structure"):
        ft.TorchOptimizer(_model(1).named_parameters(), ft.adam()).load_state_dict(
            {"ft_state": None, "param_groups": [{"param_names": ["x"]}]}
        )
    with pytest.raises(TypeError, match="GradientTransformation"):
        ft.TorchOptimizer(a.parameters(), torch.optim.SGD)
    with pytest.raises(ValueError, match="no parameters"):
        ft.TorchOptimizer([], ft.sgd())


def test_none_gradients_and_frozen_parameters():
    model = _model()
    model[0].weight.requires_grad_(False)
    before = model[0].weight.detach().clone()
    opt = ft.TorchOptimizer(model.named_parameters(), ft.adamw(1e-2))
    x, y = _batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert torch.equal(model[0].weight, before) and model[0].weight.grad is None
    assert not torch.equal(model[2].weight, _model()[2].weight)


def _stdlib_text(n_bytes: int) -> bytes:
    import json

    return open(json.__file__, "rb").read()[:n_bytes]


def test_hf_trainer_trains_a_tiny_llama(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    data = torch.tensor(list(_stdlib_text(16_000)), dtype=torch.long)
    seq = 32
    windows = data[: len(data) // seq * seq].view(-1, seq)

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(windows)

        def __getitem__(self, i):
            return {"input_ids": windows[i], "labels": windows[i]}

    opt = ft.TorchOptimizer(
        model.named_parameters(), ft.adamw(3e-3, weight_decay=0.1, mask=ft.decay_mask)
    )
    steps = 40
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=16,
        logging_steps=5,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Windows(), optimizers=(opt, sched))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 6, trainer.state.log_history
    assert losses[-1] < 0.75 * losses[0], losses  # ln(256) = 5.5 at the start
    # the scheduler drove the transform: the learning rate it used last is the schedule's end
    assert float(ft.get_hyperparams(opt.ft_state)["learning_rate"]) < 1e-4


def test_partition_gives_one_group_per_label_driven_by_schedulers():
    """``partition`` -> torch's usual decay / no-decay groups, each with its hyperparameters;
    a scheduler scales each group's lr (LambdaLR), and the result equals torch's AdamW with
    the same two groups; the state dict round-trips through a fresh optimizer."""
    start = _model()
    model, ref = copy.deepcopy(start), copy.deepcopy(start)

    def labels(params):
        return {k: "decay" if v.ndim == 2 else "no_decay" for k, v in params.items()}

    tx = ft.partition(
        {"decay": ft.adamw(1e-2, weight_decay=0.1), "no_decay": ft.adamw(2e-2, weight_decay=0.0)},
        labels,
    )
    opt = ft.TorchOptimizer(model.named_parameters(), tx)
    assert [g["label"] for g in opt.param_groups] == ["decay", "no_decay"]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 2e-2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    names = [n for n, _ in start.named_parameters()]
    ref_opt = torch.optim.AdamW(
        [
            {
                "params": [p for n, p in ref.named_parameters() if p.ndim == 2],
                "lr": 1e-2,
                "weight_decay": 0.1,
            },
            {
                "params": [p for n, p in ref.named_parameters() if p.ndim != 2],
                "lr": 2e-2,
                "weight_decay": 0.0,
            },
        ]
    )
    batches = _batches(6)
    _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.8**t), batches[:3])
    _train(ref, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda t: 0.8**t), batches[:3])
    _close(model, ref, start)
    sd = opt.state_dict()
    assert [g["param_names"] for g in sd["param_groups"]] == [
        [n for n in names if "weight" in n],
        [n for n in names if "bias" in n],
    ]
    fresh_model = copy.deepcopy(model)
    fresh = ft.TorchOptimizer(fresh_model.named_parameters(), tx)
    fresh.load_state_dict(copy.deepcopy(sd))
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in opt.param_groups]
    for m, o in ((model, opt), (fresh_model, fresh)):
        x, y = batches[3]
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p, q)


COMPILED_ALIASES = {  # every float hyperparameter injected (defaults too): all read as tensors
    "adamw": (lambda lr: ft.adamw(lr, weight_decay=0.1), "inductor"),
    "sgd": (lambda lr: ft.sgd(lr), "aot_eager"),  # (momentum, dampening, weight decay: 0)
    "adafactor": (lambda lr: ft.adafactor(lr, relative_step=False), "aot_eager"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED_ALIASES))
def test_compiled_step_with_a_tensor_learning_rate_does_not_recompile(name):
    """torch.optim's convention for compiled steps: a learning rate given as a tensor
    (``ft.adamw(torch.tensor(1e-2))``) is a 0-dim tensor in ``param_groups``, which
    ``LambdaLR`` updates in place; ``torch.compile(opt.step)`` then runs 5 steps of a changing
    learning rate without recompiling, in one graph (every injected hyperparameter, the
    defaults included, is read as a tensor), and its parameters equal the eager optimizer's
    (float lr) to float rounding (the compiled step writes the new state into the old
    tensors: dynamo takes an optimizer's tensors as static), and so do the hyperparameters
    its state records (until session 59 the compiled step's record kept the first learning
    rate: torch lost its write into the 0-dim float64 tensor, see ``leaves.copy_into``). The
    tensor survives ``state_dict`` / ``load_state_dict``."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    build, backend = COMPILED_ALIASES[name]

    def run(lr, compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        opt = ft.TorchOptimizer(model.named_parameters(), build(lr))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        step = torch.compile(opt.step, backend=backend) if compiled else opt.step
        lrs = []
        with torch._dynamo.config.patch(error_on_recompile=compiled):
            for _ in range(5):
                opt.zero_grad()
                model(x).pow(2).sum().backward()
                step()
                sched.step()
                lrs.append(float(opt.param_groups[0]["lr"]))
        return opt, [p.detach().clone() for p in model.parameters()], lrs

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    opt, compiled, lrs = run(torch.tensor(1e-2), True)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    # one graph: the hyperparameters are all read as tensors; the only break is dynamo
    # skipping the scheduler's wrapper around step (as for torch.optim.AdamW)
    assert counters["stats"]["unique_graphs"] == 1
    assert all("lr_scheduler.py" in reason for reason in counters["graph_break"])
    eager_opt, eager, eager_lrs = run(1e-2, False)
    assert lrs == pytest.approx(eager_lrs) and lrs[-1] == pytest.approx(1e-2 / 6)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    recorded = ft.get_hyperparams(opt._ft_state)
    assert set(recorded) == set(ft.get_hyperparams(eager_opt._ft_state))
    for k, v in ft.get_hyperparams(eager_opt._ft_state).items():
        assert float(recorded[k]) == pytest.approx(float(v), rel=1e-6), k
    assert float(recorded["learning_rate"]) == pytest.approx(1e-2 / 5)  # (the last step's)
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 / 6)


def test_copy_into_writes_a_0dim_float64_input_under_compile():
    """``leaves.copy_into`` (the compiled ``TorchOptimizer.step``'s write of its new state)
    writes a 0-dim float64 CPU graph input under aot_eager, every call: torch 2.13 loses a
    plain ``copy_`` there, which kept a compiled step's recorded learning rate at its first
    value. Other shapes as ``copy_``."""
    from functional_train.leaves import copy_into

    lr = torch.tensor(0.01, dtype=torch.float64)
    w = torch.zeros(2, 3)

    def f(x):
        copy_into(lr, x * 2)
        copy_into(w, (x * 3).float().expand(2, 3))

    torch._dynamo.reset()
    try:
        g = torch.compile(f, backend="aot_eager", fullgraph=True)
        for i in range(3):
            g(torch.tensor(float(i + 1), dtype=torch.float64))
            assert lr.item() == 2.0 * (i + 1)
            assert torch.equal(w, torch.full((2, 3), 3.0 * (i + 1)))
    finally:
        torch._dynamo.reset()


def test_galore_adamw_is_one_group_a_scheduler_drives():
    """``galore_adamw`` is a partition inside (GaLore and plain AdamW leaves) whose labels have
    no hyperparameters of their own: it makes ONE group holding the alias' (``lr``, ``betas``,
    ``eps``, ``weight_decay``, ``scale``), so torch's schedulers take it; LambdaLR's learning
    rate is the one the transform uses (equal to the alias with that schedule, 5 steps across
    two projector refreshes)."""
    start = _model()
    model = copy.deepcopy(start)
    kw = dict(weight_decay=0.1, rank=2, update_proj_gap=3)
    opt = ft.TorchOptimizer(model.named_parameters(), ft.galore_adamw(1e-2, **kw))
    assert len(opt.param_groups) == 1
    group = {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "param_names")}
    assert group == {
        "lr": 1e-2,
        "betas": (0.9, 0.999),
        "eps": 1e-6,
        "weight_decay": 0.1,
        "scale": 0.25,
    }
    batches = _batches(5)
    _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.8**t), batches)
    tx = ft.galore_adamw(
        lambda count: 1e-2 * 0.8 ** torch.as_tensor(count, dtype=torch.float64), **kw
    )
    ref = copy.deepcopy(start)
    params = dict(ref.named_parameters())
    state = tx.init({k: v.detach() for k, v in params.items()})
    for x, y in batches:
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        new, state = ft.step(
            tx,
            {k: v.grad for k, v in params.items()},
            state,
            {k: v.detach() for k, v in params.items()},
        )
        with torch.no_grad():
            for k, v in params.items():
                v.copy_(new[k])
    _close(model, ref, start)
