"""Shared pieces of the example scripts: the torchrun setup, the main job's byte-level Llama
(``train_lm.py``) sharded tensor parallel, real-text batches split over data parallel ranks, and
gradients (``torch.func.grad_and_value`` in one process; ``torch.autograd`` under DTensor, see
``train_lm.grad_and_value``)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_lm as lm  # noqa: E402

ft = lm.ft


def setup(tp_default=2):
    """``(rank, dp, tp, device_mesh or None)`` from the torchrun environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 1, None
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    tp = tp_default if world % tp_default == 0 else 1
    dp = world // tp
    return dist.get_rank(), dp, tp, init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def model_and_params(args, device_mesh):
    torch.manual_seed(args.seed)
    model = lm.Transformer(
        args.d_model, args.n_layers, args.n_heads, 4 * args.d_model, args.seq_len
    )
    if device_mesh is not None and device_mesh["tp"].size() > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, device_mesh["tp"], lm.tensor_parallel_plan(args.n_layers))
    return model, {k: v.detach() for k, v in model.named_parameters()}


def batches(args, rank_in_dp, dp):
    """The global batch of each iteration (same on every rank), this dp rank's slice of it."""
    data = lm.load_bytes(None, args.max_bytes)
    gen = torch.Generator().manual_seed(args.seed + 1)
    local = args.batch // dp
    for _ in range(args.iters):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=gen)
        yield lm.windows(data, starts[rank_in_dp * local : (rank_in_dp + 1) * local], args.seq_len)


def loss_and_grads(model, world):
    def loss_fn(params, x, y):
        logits = torch.func.functional_call(model, params, (x,))
        return F.cross_entropy(logits.reshape(-1, lm.VOCAB), y.reshape(-1))

    return torch.func.grad_and_value(loss_fn) if world == 1 else lm.grad_and_value(loss_fn)


def lm_mean(loss, device_mesh):
    """The loss over the global batch: the mean of the data parallel ranks' losses."""
    if device_mesh is None or device_mesh["dp"].size() == 1:
        return loss
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=device_mesh.get_group("dp"))
    return loss / device_mesh["dp"].size()


def common_args(p):
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=0)
    return p
