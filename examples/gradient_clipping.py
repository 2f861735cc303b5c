"""Gradient clipping that stays right under tensor parallelism (Colossal-AI's gradient clipping
guide, functionally).

A small byte-level Llama (``train_lm.py``'s model, on real text: the Python standard library's
sources) is trained for a few iterations with
``ft.chain(ft.clip_by_global_norm(1.0), ft.sgd(...))``. Under ``torchrun`` the model is tensor
parallel (q/k/v/gate/up column-wise, o/down row-wise, the rest replicated) on a ``dp x tp``
mesh. Each iteration prints:

* the global gradient norm before clipping, as ``clip_by_global_norm`` computed it (its state keeps
  it: one scalar all-reduce for the whole model);
* the norm after clipping (``ft.global_norm`` of the clipped updates: ``<= max_norm``);
* what a naive clip would have used on each rank: the norm of the rank's local shards only, which
  differs between tensor parallel ranks and from the true norm;
* the loss (over the global batch) and the first element of a tensor parallel weight, like
  the guide.

Usage::

    python examples/gradient_clipping.py                                    # one process
    torchrun --standalone --nproc-per-node 2 examples/gradient_clipping.py  # tp=2
    torchrun --standalone --nproc-per-node 4 examples/gradient_clipping.py  # dp=2 x tp=2
"""

from __future__ import annotations

import argparse

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


def main(argv=None):
    p = common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument("--max-norm", type=float, default=1.0, help="GRADIENT_CLIPPING")
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args(argv)
    rank, dp, tp, device_mesh = setup()
    world = dp * tp
    model, params = model_and_params(args, device_mesh)
    mesh = None if device_mesh is None else ft.Mesh(device_mesh, data_axis="dp")
    dp_rank = 0 if device_mesh is None else device_mesh.get_local_rank("dp")
    grad_fn = loss_and_grads(model, world)

    clip = ft.clip_by_global_norm(args.max_norm)
    tx = ft.chain(clip, ft.sgd(args.lr, momentum=0.9))
    state = tx.init(params)
    first = next(k for k in params if "wq" in k)  # a tensor parallel weight
    for it, (x, y) in enumerate(batches(args, dp_rank, dp)):
        grads, loss = grad_fn(params, x, y)
        # what a hand-written clip would see on this rank: its local shards only
        naive = torch.sqrt(
            sum(
                (g.to_local() if isinstance(g, DTensor) else g).float().square().sum()
                for g in grads.values()
            )
        )
        new_params, state = ft.step(tx, grads, state, params, mesh=mesh)  # pure: grads kept
        before = ft.tree_get(state, "global_norm")
        # the clipped gradients themselves: clip alone on the same (reduced) gradients
        clipped, _ = clip.update(grads, clip.init(params), params, mesh=mesh)
        after = ft.global_norm(clipped, mesh=None if mesh is None else mesh.reduced())
        params = new_params
        naive_all = [naive]
        loss = lm_mean(loss, device_mesh)
        if world > 1:
            naive_all = [torch.zeros(()) for _ in range(world)]
            dist.all_gather(naive_all, naive.reshape(()))
        ele = params[first]
        ele = (ele.full_tensor() if isinstance(ele, DTensor) else ele).flatten()[0]
        if rank == 0:
            naive_txt = ", ".join(f"{float(v):.4f}" for v in naive_all)
            print(
                f"iteration {it}, loss: {float(loss):.4f}, grad norm before clipping: "
                f"{float(before):.4f}, after: {float(after):.4f} (max_norm {args.max_norm}); "
                f"naive per-rank local norms: [{naive_txt}]; "
                f"1st element of parameters: {float(ele):.6f}",
                flush=True,
            )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
