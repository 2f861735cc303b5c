"""Distributed Adafactor, CAME, LAMB and GaLore (and AdamW) under tensor parallelism + ZeRO
(Colossal-AI's distributed optimizers guide, functionally).

Each optimizer trains the main job's byte-level Llama on real text (the Python standard library's
sources) as ``ft.zero_redundancy(ft.chain(ft.clip_by_global_norm(1.0), optimizer))``: the model is
tensor parallel over ``tp`` and the optimizer state is sharded over ``dp`` (ZeRO-2: gradients are
reduce-scattered into the shards, updates all-gathered back). The statistics the optimizers need
(Adafactor's and CAME's row/column means, LAMB's trust-ratio norms, GaLore's SVD) are computed on
the global tensors, so the run equals one process up to floating point order. There is no
``DistributedAdaFactor`` class to swap in: the same transform runs sharded or not.

For each optimizer the script prints the loss falling, the optimizer state bytes held per rank
against the unsharded state, and the collectives of one update.

Usage::

    torchrun --standalone --nproc-per-node 4 examples/distributed_optimizers.py   # tp=2 x ZeRO dp=2
    python examples/distributed_optimizers.py --iters 10                         # one process
"""

from __future__ import annotations

import argparse

import optree
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from _common import (  # noqa: E402
    batches,
    common_args,
    ft,
    lm,
    lm_mean,
    loss_and_grads,
    model_and_params,
    setup,
)
from functional_train.testing import count_collectives


def state_bytes(state, local: bool) -> int:
    total = 0
    for x in optree.tree_leaves(state):
        if isinstance(x, torch.Tensor):
            t = x.to_local() if (local and isinstance(x, DTensor)) else x
            total += t.numel() * t.element_size()
    return total


def main(argv=None):
    p = common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    p.add_argument(
        "--optimizers", nargs="+", default=list(lm.OPTIMIZERS), choices=list(lm.OPTIMIZERS)
    )
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--no-zero", dest="zero", action="store_false", help="tensor parallel only")
    p.set_defaults(iters=30, batch=16, seq_len=128)
    args = p.parse_args(argv)
    rank, dp, tp, device_mesh = setup()
    world = dp * tp
    mesh = None if device_mesh is None else ft.Mesh(device_mesh, data_axis="dp")
    dp_rank = 0 if device_mesh is None else device_mesh.get_local_rank("dp")
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"mesh: dp={dp} x tp={tp}, ZeRO over dp: {args.zero and dp > 1}", flush=True)
    for name in args.optimizers:
        model, params = model_and_params(args, device_mesh)
        grad_fn = loss_and_grads(model, world)
        opt = lm.build_optimizer(
            name, lm.OPTIMIZERS[name], args.weight_decay, params, galore_rank=8, galore_gap=10
        )
        tx = ft.chain(ft.clip_by_global_norm(1.0), opt)
        full_bytes = state_bytes(
            tx.init(
                {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in params.items()}
            ),
            local=False,
        )
        if args.zero:
            tx = ft.zero_redundancy(tx, axis="dp")
        state = tx.init(params)
        losses = []
        for it, (x, y) in enumerate(batches(args, dp_rank, dp)):
            grads, loss = grad_fn(params, x, y)
            with count_collectives() as c:  # update + apply_updates, in place
                params, state = ft.step(tx, grads, state, params, mesh=mesh, donate=True)
            losses.append(float(lm_mean(loss, device_mesh)))
            if it == 1:
                counts = c.counts
        mine = state_bytes(state, local=True)
        trace = " ".join(f"{v:.3f}" for v in losses[:: max(1, len(losses) // 6)])
        log(
            f"{name:>9}: loss {losses[0]:.3f} -> {losses[-1]:.3f}  [{trace}]  state/rank "
            f"{mine / 1024:.0f} KiB of {full_bytes / 1024:.0f} KiB unsharded "
            f"({mine / full_bytes:.2f}); collectives per update {counts}",
            flush=True,
        )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
