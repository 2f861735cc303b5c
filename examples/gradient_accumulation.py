"""Gradient accumulation without per-micro-step communication (Colossal-AI's gradient
accumulation guide and its ``booster.no_sync``, functionally).

``ft.multi_steps(ft.sgd(0.1, momentum=0.9, weight_decay=5e-4), every_k=GRADIENT_ACCUMULATION)``
adds each micro-step's gradient to a local accumulator and returns zero updates; the k-th
micro-step feeds the mean of the k gradients to SGD. Under ``torchrun`` (data parallel, or
dp x tp) the non-final micro-steps issue no collective at all: the gradients stay each rank's own
contribution until the k-th step reduces them once.

Each iteration prints, like the guide, the first elements of a parameter (unchanged for k-1
micro-steps, changed on the k-th), plus the loss and the collectives the update issued.

Usage::

    python examples/gradient_accumulation.py
    torchrun --standalone --nproc-per-node 2 examples/gradient_accumulation.py  # dp=2 (tp=2 with 4)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from _common import (  # noqa: E402
    batches,
    common_args,
    ft,
    lm_mean,
    loss_and_grads,
    model_and_params,
    setup,
)
from functional_train.testing import count_collectives


def main(argv=None):
    p = common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--accum", type=int, default=4, help="GRADIENT_ACCUMULATION")
    p.add_argument("--lr", type=float, default=0.1)
    p.set_defaults(iters=8)
    args = p.parse_args(argv)
    # data parallel with 2 processes, dp=2 x tp=2 with 4
    rank, dp, tp, device_mesh = setup(
        tp_default=2 if int(os.environ.get("WORLD_SIZE", "1")) >= 4 else 1
    )
    world = dp * tp
    model, params = model_and_params(args, device_mesh)
    mesh = None if device_mesh is None else ft.Mesh(device_mesh, data_axis="dp")
    dp_rank = 0 if device_mesh is None else device_mesh.get_local_rank("dp")
    grad_fn = loss_and_grads(model, world)

    tx = ft.multi_steps(ft.sgd(args.lr, momentum=0.9, weight_decay=5e-4), every_k=args.accum)
    state = tx.init(params)
    name = next(k for k in params if "wq" in k)
    values = []
    for it, (x, y) in enumerate(batches(args, dp_rank, dp)):
        grads, loss = grad_fn(params, x, y)
        with count_collectives() as c:  # update + apply_updates, in place (donate=True)
            params, state = ft.step(tx, grads, state, params, mesh=mesh, donate=True)
        loss = lm_mean(loss, device_mesh)
        w = params[name]
        # a copy: the donated step writes into the parameters' buffers
        first = (w.full_tensor() if isinstance(w, DTensor) else w).flatten()[:10].clone()
        values.append(first)
        if rank == 0:
            step = "update" if bool(ft.has_updated(state)) else "accumulate"
            print(
                f"iteration {it} ({step}), loss {float(loss):.4f}, collectives "
                f"{c.counts or 'none'}, first 10 elements of {name}: "
                f"{[round(v, 6) for v in first.tolist()]}",
                flush=True,
            )
    if rank == 0:
        changed = [i for i in range(1, len(values)) if not torch.equal(values[i], values[i - 1])]
        print(
            f"the parameter changed at iterations {changed}: only on every "
            f"{args.accum}-th micro-step",
            flush=True,
        )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
