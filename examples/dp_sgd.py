"""DP-SGD (Abadi et al. 2016): per-example gradients by ``vmap(grad)``, then
``ft.differentially_private_aggregate`` and SGD.

A small MLP classifies two overlapping Gaussian clouds. Each step computes the gradient of
every example of the batch separately (``torch.func.vmap(torch.func.grad(loss))``), and the
chain ``ft.chain(ft.differentially_private_aggregate(C, sigma, seed), ft.sgd(lr, momentum))``
clips each example's gradient to L2 norm ``C``, sums them, adds Gaussian noise of standard
deviation ``sigma * C`` and divides by the batch size before the SGD step. The script trains
the same model without privacy (``sigma = 0``, no clipping) for comparison and prints the test
accuracies. (The privacy budget, epsilon, needs an accountant such as Opacus' RDP accountant,
with the sampling rate, ``sigma`` and the number of steps: not computed here.)

Usage::

    python examples/dp_sgd.py
    python examples/dp_sgd.py --noise-multiplier 1.1 --clip 1.0 --steps 300
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import functional_train as ft


def init(gen: torch.Generator, sizes=(2, 32, 2)) -> dict:
    return {
        **{
            f"w{i}": torch.randn(a, b, generator=gen) / a**0.5
            for i, (a, b) in enumerate(zip(sizes, sizes[1:]))
        },
        **{f"b{i}": torch.zeros(b) for i, b in enumerate(sizes[1:])},
    }


def logits(params: dict, x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ params["w0"] + params["b0"])
    return h @ params["w1"] + params["b1"]


def example_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of ONE example (``x``: (2,), ``y``: a 0-dim label)."""
    return F.cross_entropy(logits(params, x[None]), y[None])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="l2_norm_clip C")
    p.add_argument("--noise-multiplier", type=float, default=1.1, help="sigma")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # (small tensors: threads cost more than they give)
    gen = torch.Generator().manual_seed(args.seed)
    n = 4000
    y_all = torch.randint(0, 2, (n,), generator=gen)
    x_all = torch.randn(n, 2, generator=gen) + 1.5 * (2 * y_all[:, None].float() - 1)
    train_x, train_y, test_x, test_y = x_all[:3000], y_all[:3000], x_all[3000:], y_all[3000:]
    per_example_grads = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0, 0))

    def train(tx, per_example: bool) -> tuple[float, float]:
        params = init(torch.Generator().manual_seed(args.seed + 1))
        state = tx.init(params)
        order = torch.Generator().manual_seed(args.seed + 2)
        for _ in range(args.steps):
            idx = torch.randint(0, len(train_x), (args.batch,), generator=order)
            x, y = train_x[idx], train_y[idx]
            if per_example:  # (B, ...) per leaf: what the aggregation takes
                grads = per_example_grads(params, x, y)
            else:
                grads = torch.func.grad(lambda p: F.cross_entropy(logits(p, x), y))(params)
            # (update + apply_updates: ft.step checks that the gradients have the
            # parameters' shapes, which per-example gradients do not)
            updates, state = tx.update(grads, state, params)
            params = ft.apply_updates(params, updates)
        accuracy = float((logits(params, test_x).argmax(1) == test_y).float().mean())
        loss = float(F.cross_entropy(logits(params, test_x), test_y))
        return accuracy, loss

    sgd = ft.sgd(args.lr, momentum=0.9)
    private = ft.chain(
        ft.differentially_private_aggregate(args.clip, args.noise_multiplier, seed=args.seed),
        ft.sgd(args.lr, momentum=0.9),
    )
    acc_dp, loss_dp = train(private, per_example=True)
    acc, loss = train(sgd, per_example=False)
    print(
        f"DP-SGD (C={args.clip}, sigma={args.noise_multiplier}, batch {args.batch}, "
        f"{args.steps} steps): test accuracy {acc_dp:.3f}, loss {loss_dp:.3f}"
    )
    print(f"SGD without privacy, same steps: test accuracy {acc:.3f}, loss {loss:.3f}")
    return {"accuracy_dp": acc_dp, "accuracy": acc}


if __name__ == "__main__":
    main()
