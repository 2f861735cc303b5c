"""An ensemble of K small MLPs trained in lock step: one chain, ``ft.vmap`` over a model axis.

Each model has its own initialisation and its own bootstrap batches of a regression task (a
random teacher network); the training step -- ``torch.func.grad`` of the loss, then
``ft.step(chain(clip_by_global_norm, adamw))`` -- is written for ONE model and batched with
``ft.vmap``: global norms, Adam moments and step counts are per model, as under ``jax.vmap``.
The script checks that the vmapped ensemble equals K separate ``ft.step`` loops and prints
the time per ensemble step of both, and their ratio.

Usage::

    python examples/ensemble.py            # K = 8, 200 steps
    python examples/ensemble.py --models 16 --steps 100
"""

from __future__ import annotations

import argparse
import time

import torch

import functional_train as ft


def mlp_params(gen: torch.Generator, sizes=(16, 64, 64, 1)) -> dict:
    """A tanh MLP's parameters (``w{i}`` of shape (in, out), ``b{i}``), LeCun-normal."""
    out = {}
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        out[f"w{i}"] = torch.randn(a, b, generator=gen) / a**0.5
        out[f"b{i}"] = torch.zeros(b)
    return out


def mlp(params: dict, x: torch.Tensor) -> torch.Tensor:
    n = len(params) // 2
    for i in range(n):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            x = torch.tanh(x)
    return x


def loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((mlp(params, x) - y) ** 2).mean()


def stack(trees: list) -> dict:
    return {k: torch.stack([t[k] for t in trees]) for k in trees[0]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    K = args.models
    gen = torch.Generator().manual_seed(args.seed)
    teacher = mlp_params(gen)
    data_x = torch.randn(4096, 16, generator=gen)
    data_y = mlp(teacher, data_x) + 0.05 * torch.randn(4096, 1, generator=gen)
    params0 = stack([mlp_params(torch.Generator().manual_seed(100 + k)) for k in range(K)])
    idx = torch.randint(0, 4096, (args.steps, K, args.batch), generator=gen)  # bootstrap

    tx = ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(args.lr, weight_decay=1e-4))

    def train_step(params, state, x, y):  # ONE model
        grads = torch.func.grad(loss)(params, x, y)
        return ft.step(tx, grads, state, params)

    ensemble_step = ft.vmap(train_step)

    # the ensemble: one vmapped step for all K models
    params, state = params0, ft.vmap(tx.init)(params0)
    t_vmap = []
    for t in range(args.steps):
        x, y = data_x[idx[t]], data_y[idx[t]]  # (K, batch, ...)
        start = time.perf_counter()
        params, state = ensemble_step(params, state, x, y)
        t_vmap.append(time.perf_counter() - start)

    # the same K models, each with its own ft.step, in a Python loop
    singles = [{k: v[m].clone() for k, v in params0.items()} for m in range(K)]
    states = [tx.init(s) for s in singles]
    t_loop = []
    for t in range(args.steps):
        start = time.perf_counter()
        for m in range(K):
            x, y = data_x[idx[t, m]], data_y[idx[t, m]]
            singles[m], states[m] = train_step(singles[m], states[m], x, y)
        t_loop.append(time.perf_counter() - start)

    worst = max(float((params[k][m] - singles[m][k]).abs().max()) for k in params for m in range(K))
    losses = [float(loss({k: v[m] for k, v in params.items()}, data_x, data_y)) for m in range(K)]
    start_losses = [
        float(loss({k: v[m] for k, v in params0.items()}, data_x, data_y)) for m in range(K)
    ]
    warm = max(1, args.steps // 10)  # (the first steps build the plans)
    vm = sorted(t_vmap[warm:])[len(t_vmap[warm:]) // 2]
    lp = sorted(t_loop[warm:])[len(t_loop[warm:]) // 2]
    print(f"{K} MLPs, {args.steps} steps of chain(clip_by_global_norm(1.0), adamw)")
    print(f"loss per model: {' '.join(f'{a:.3f}->{b:.3f}' for a, b in zip(start_losses, losses))}")
    print(f"vmapped ensemble == {K} separate ft.step loops: max |difference| {worst:.2e}")
    print(
        f"time per ensemble step (median): ft.vmap {vm * 1e3:.2f} ms, loop of {K} ft.step "
        f"{lp * 1e3:.2f} ms: vmap is {lp / vm:.2f}x faster"
    )
    return {"ratio": lp / vm, "max_diff": worst, "losses": losses, "start": start_losses}


if __name__ == "__main__":
    main()
