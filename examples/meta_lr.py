"""Learn a learning rate by ``torch.func.grad`` through unrolled optimizer steps.

The inner problem: ``UNROLL`` steps of ``ft.sgd(lr, momentum=0.9)`` (``ft.step``) on a linear
regression's training batches. The outer objective: the validation loss after those steps, a
function of ``log(lr)``. ``torch.func.grad`` differentiates it through every update (the
learning rate is a tensor the library keeps as one), and ``ft.adam`` -- the library again --
updates ``log(lr)``. Each outer step starts the inner problem afresh from the same
initialisation, so the printed learning rate converges to the best one for ``UNROLL`` steps; the
script checks the first meta-gradient against central finite differences.

Usage::

    python examples/meta_lr.py
    python examples/meta_lr.py --unroll 20 --outer 60
"""

from __future__ import annotations

import argparse
import math

import torch

import functional_train as ft

F64 = torch.float64  # (float64: the meta-gradient is checked against finite differences)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--unroll", type=int, default=10, help="inner steps differentiated through")
    p.add_argument("--outer", type=int, default=40, help="meta steps")
    p.add_argument("--lr0", type=float, default=1e-3, help="initial inner learning rate")
    p.add_argument("--meta-lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # (small tensors: threads cost more than they give)
    gen = torch.Generator().manual_seed(args.seed)
    d = 20
    w_true = torch.randn(d, 1, generator=gen, dtype=F64)
    xs = torch.randn(
        args.unroll, 32, d, generator=gen, dtype=F64
    )  # one training batch per inner step
    ys = xs @ w_true + 0.1 * torch.randn(args.unroll, 32, 1, generator=gen, dtype=F64)
    xv = torch.randn(256, d, generator=gen, dtype=F64)
    yv = xv @ w_true
    init = {"w": torch.zeros(d, 1, dtype=F64), "b": torch.zeros(1, dtype=F64)}

    def mse(params, x, y):
        return ((x @ params["w"] + params["b"] - y) ** 2).mean()

    def validation_after(log_lr):
        """The validation loss after ``unroll`` sgd steps at ``exp(log_lr)``."""
        tx = ft.sgd(torch.exp(log_lr), momentum=0.9)
        params, state = init, tx.init(init)
        for x, y in zip(xs, ys):
            grads = torch.func.grad(mse)(params, x, y)
            params, state = ft.step(tx, grads, state, params)
        return mse(params, xv, yv)

    meta = {"log_lr": torch.tensor(math.log(args.lr0), dtype=F64)}
    meta_tx = ft.adam(args.meta_lr, b1=0.5)
    meta_state = meta_tx.init(meta)
    meta_grad = torch.func.grad(validation_after)
    h = 1e-6
    fd = (validation_after(meta["log_lr"] + h) - validation_after(meta["log_lr"] - h)) / (2 * h)
    g0 = meta_grad(meta["log_lr"])
    print(
        f"d validation / d log(lr) at lr={args.lr0:g}: torch.func.grad {float(g0):.6g}, "
        f"central differences {float(fd):.6g}"
    )
    history = []
    for step in range(args.outer):
        loss = float(validation_after(meta["log_lr"]))
        g = {"log_lr": meta_grad(meta["log_lr"])}
        meta, meta_state = ft.step(meta_tx, g, meta_state, meta)
        history.append((float(torch.exp(meta["log_lr"])), loss))
        if step % max(1, args.outer // 8) == 0 or step == args.outer - 1:
            print(
                f"meta step {step:3d}: validation loss after {args.unroll} steps {loss:.5f}, "
                f"learning rate -> {history[-1][0]:.4g}"
            )
    return {"grad": float(g0), "fd": float(fd), "history": history}


if __name__ == "__main__":
    main()
