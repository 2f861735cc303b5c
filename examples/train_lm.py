"""Train a small Llama-style byte-level language model with functional_train.

The model is an ordinary ``nn.Module`` (RMSNorm, rotary embeddings, causal attention through
``F.scaled_dot_product_attention``, SwiGLU MLP). Training is functional: the parameters are a plain
``dict`` of tensors, the loss is computed with ``torch.func.functional_call``, gradients with
``grad_and_value`` and the update with a pure functional_train chain::

    tx = ft.chain(ft.clip_by_global_norm(clip),
                  ft.adamw(schedule, weight_decay=wd, mask=ft.decay_mask))  # not norms, embedding
    tx = ft.zero_redundancy(tx, axis="dp")          # --zero: optimizer state sharded over dp
    tx = ft.multi_steps(tx, every_k=accum)          # --accum > 1
    params, state = ft.step(tx, grads, state, params, mesh=mesh, donate=True)
    # = updates, state = tx.update(grads, state, params, mesh=mesh)
    #   params = ft.apply_updates(params, updates)       (fused kernels where they apply)

Under ``torchrun`` the same script runs data parallel x tensor parallel on CPU (gloo): the model is
sharded with ``parallelize_module`` (q/k/v/gate/up column-wise, o/down row-wise; embeddings, norms
and the LM head stay replicated plain tensors), each data-parallel rank takes its contiguous slice
of the global batch, and the optimizer chain reduces gradients over the ``dp`` mesh axis itself.
Given the same ``--seed`` and global batch, one process and N processes train the same model (up to
floating point reduction order).

With ``--pp N`` the layers are split into N pipeline stages (``torch.distributed.pipelining``,
``Schedule1F1B`` or ``--schedule gpipe`` over ``--microbatches``), on a ("pp", "dp", "tp") mesh:
each rank's parameters are its stage's own leaves, the stage module computes the gradients
through the schedule, and the same chain receives ``ft.Mesh(mesh, data_axis="dp",
pipeline_axis="pp")``: the clip's norm is over every stage (the job logs each stage's own norm
beside it, and the step's collectives once).

With ``--moe E`` every MLP is ``E`` routed SwiGLU experts (``MoE``: top-``--top-k`` softmax
gating, the Switch load-balancing loss, dropless); ``--ep N`` spreads them over an "ep" mesh
dim (E / N experts per rank, tokens dispatched by all-to-all, attention and the router
replicated), whose ranks are data parallel too (each takes its own slice of the batch). The
experts reach the optimizer as DTensors ``Shard(0)`` over "ep" (``--experts stacked``) or as
their own modules declared with ``is_expert`` (``--experts separate``), and the chain receives
``ft.Mesh(mesh, data_axis="dp", pipeline_axis=..., expert_axis="ep", is_expert=...)``; the job
logs each ep rank's own gradient norm beside the global one at the first step.

Data: bytes (vocabulary 256) of real text. By default the Python standard library's own ``*.py``
sources (``sysconfig.get_paths()["stdlib"]``, third-party ``site-packages`` excluded), read in
sorted order up to ``--max-bytes``; ``--data PATH`` takes a text file or a directory instead. The
last ``--val-fraction`` of the bytes is held out; the validation loss is the mean next-byte
cross-entropy (nats per byte) over ``--eval-windows`` fixed, evenly spaced windows of it.

``--optimizer {adamw,adafactor,came,lamb,galore,muon}`` picks the optimizer after clipping (see
``build_optimizer``; ``--lr`` defaults per optimizer), ``--8bit`` gives adamw / galore 8-bit
block-wise moments.

Usage::

    python examples/train_lm.py  # defaults: ~4.5 min on 2 idle CPU cores, val loss ~1.33 nats/byte
    python examples/train_lm.py --steps 3 --eval-every 0 --out /tmp/run1
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py # dp=2 x tp=2 on gloo
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py --dp 1 --tp 4
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py --optimizer adafactor --zero
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py --pp 2 --tp 2  # 2 stages, 1F1B
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py --pp 2 --dp 2 --tp 1
    python examples/train_lm.py --moe 4 --top-k 2  # routed experts in one process
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py --moe 4 --ep 2 --dp 2 --tp 1
    python examples/train_lm.py --steps 200 --8bit  # 8-bit AdamW moments
    python examples/train_lm.py --checkpoint-every 50 --out runs/a   # resumable: runs/a/checkpoint
    python examples/train_lm.py --resume runs/a/checkpoint --out runs/b  # continue it to --steps

Outputs (``--out DIR``, default ``runs/<timestamp>``): ``metrics.json`` (per-step loss, gradient
norm, learning rate and throughput, validation losses and the summary), ``loss.png`` and
``params.pt`` (the final unsharded parameters, a flat name -> tensor dict). The last line printed
on stdout is the summary as one JSON object.

Resuming (``--checkpoint-every N``, ``--resume DIR``): every N optimizer steps the run writes
``<out>/checkpoint`` with ``ft.checkpoint.save`` (atomically replacing the previous one): the
parameters and the optimizer state (counts included, so the schedule continues), the step, the
batch sampler's generator state, torch's global RNG state, the metric history and the settings
that shape the trajectory. ``--resume DIR`` loads it into the parameters and state built for the
current layout (DCP reshards: a checkpoint of 4 processes resumes in one and the other way
round) and continues to ``--steps``; with the same layout the parameters are bitwise those of
the uninterrupted run. Resuming with other model, data or optimizer settings is refused (a
different ``--steps`` only warns: the schedule then differs). ``metrics.json`` holds the whole
history; the times of the resumed steps are measured by the resumed run.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

try:
    import functional_train as ft
except (
    ImportError
):  # a source checkout without `pip install -e .`: use the package beside examples/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import functional_train as ft
from functional_train.testing import count_collectives

VOCAB = 256  # byte-level tokens


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0):
    """cos/sin tables of shape (seq_len, head_dim) for rotate-half rotary embeddings."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x, cos, sin):
    """Rotate (B, H, T, head_dim) queries or keys by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings.

    Under tensor parallelism wq/wk/wv are column-sharded, so each rank holds n_heads // tp heads;
    the local head count is read off the local output shape, never from the configuration.
    """

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, local heads, T, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """w_down(silu(w_gate x) * w_up x)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class AddAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also gives ``aux`` (a scalar loss term) the gradient 1:
    the auxiliary loss joins the gradient of whatever loss ``x`` flows into, without being
    returned through the model (as Megatron-LM's ``MoEAuxLossAutoScaler``), so it works
    through a pipeline schedule too. Written with ``setup_context`` for ``torch.func``."""

    @staticmethod
    def forward(x, aux):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.aux_dtype = inputs[1].dtype

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (Switch Transformer / Mixtral style), dropless.

    forward(x (B, T, d)) -> (B, T, d). A router ``nn.Linear(d, E, bias=False)`` gives each
    token softmax probabilities over the ``E`` experts; the token goes to its ``top_k``
    experts, whose outputs are summed weighted by the chosen probabilities renormalised to sum
    to 1. No capacity limit: every assignment is computed, so the output does not depend on
    how tokens are batched or spread over ranks.

    Experts are stacked (``stacked=True``: parameters ``w_gate``, ``w_up`` (E, d_ff, d) and
    ``w_down`` (E, d, d_ff)) or separate modules (``experts.<e>.w_gate.weight`` ...). With
    :meth:`keep_experts` a rank keeps a contiguous block of E / ep of them (expert
    parallelism): tokens go to the rank holding their expert with an all-to-all over
    ``ep_group`` (and come back with another), both differentiable
    (``all_to_all_single_autograd``), after one all-to-all of the per-expert token counts.

    Load balancing: with ``aux_loss > 0`` the auxiliary loss ``aux_loss * E * sum_e f_e P_e``
    (Switch Transformer, Fedus et al. 2021, eq. 4; ``f_e`` the fraction of the sequence's
    assignments that go to expert ``e``, ``P_e`` its mean router probability) is computed per
    sequence and averaged over the sequences, as DeepSeek-V3's sequence-wise balance loss: a
    mean over sequences, so micro-batches and data-parallel ranks add up to the batch's. It is
    added to the training loss's gradient through :class:`AddAuxLoss` (not to the logged loss).
    """

    def __init__(
        self, d_model: int, d_ff: int, n_experts: int, top_k: int, aux_loss: float, stacked: bool
    ):
        super().__init__()
        self.n_experts, self.top_k, self.aux_loss, self.stacked = (
            n_experts,
            top_k,
            aux_loss,
            stacked,
        )
        self.router = nn.Linear(d_model, n_experts, bias=False)
        if stacked:
            self.w_gate = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
            self.w_up = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
            self.w_down = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        else:
            self.experts = nn.ModuleDict({str(e): SwiGLU(d_model, d_ff) for e in range(n_experts)})
        self.local = range(n_experts)  # the experts this rank holds
        self.ep_group = None

    def keep_experts(self, ep_rank: int, ep: int, group) -> None:
        """Keep only experts ``ep_rank * E / ep ... (ep_rank + 1) * E / ep - 1`` (their global
        indices stay their names), the others being held by the other ranks of ``group``."""
        per = self.n_experts // ep
        self.local = range(ep_rank * per, (ep_rank + 1) * per)
        self.ep, self.ep_group = ep, group
        if self.stacked:
            for name in ("w_gate", "w_up", "w_down"):
                mine = getattr(self, name).detach()[self.local.start : self.local.stop]
                setattr(self, name, nn.Parameter(mine.clone()))
        else:
            for e in range(self.n_experts):
                if e not in self.local:
                    del self.experts[str(e)]

    def _weights(self, j: int):
        """(w_gate, w_up, w_down) of this rank's ``j``-th expert."""
        if self.stacked:
            return self.w_gate[j], self.w_up[j], self.w_down[j]
        m = self.experts[str(self.local[j])]
        return m.w_gate.weight, m.w_up.weight, m.w_down.weight

    def _run_experts(self, xs, counts):
        """Rows of ``xs`` grouped by this rank's experts (``counts``: rows per expert)."""
        ys = []
        for j, part in enumerate(xs.split(counts)):
            w_gate, w_up, w_down = self._weights(j)
            ys.append(F.linear(F.silu(F.linear(part, w_gate)) * F.linear(part, w_up), w_down))
        return torch.cat(ys)

    def _dispatch(self, xs, counts):
        """Expert parallel: send the rows of ``xs`` (grouped by global expert, ``counts`` (E,)
        rows each) to the ranks holding their experts, run them, send the results back."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, per = self.ep, len(self.local)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        recv_counts = recv_counts.view(ep, per)  # [source rank, local expert]
        send_splits = counts.view(ep, per).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = all_to_all_single_autograd(xs, recv_splits, send_splits, self.ep_group)
        # regroup the received rows (source-major) by local expert, and back afterwards
        expert_of = torch.arange(per).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
        order = expert_of.argsort(stable=True)
        ys = self._run_experts(received.index_select(0, order), recv_counts.sum(0).tolist())
        ys = ys.index_select(0, order.argsort())
        return all_to_all_single_autograd(ys, send_splits, recv_splits, self.ep_group)

    def forward(self, x):
        if x.is_meta:  # the pipeline stage's shape inference: same shape, nothing to route
            return torch.empty_like(x)
        B, T, d = x.shape
        h = x.reshape(B * T, d)
        probs = F.softmax(self.router(h), dim=-1, dtype=torch.float32)  # (N, E)
        top_p, top_e = probs.topk(self.top_k, dim=-1)
        gates = (top_p / top_p.sum(-1, keepdim=True)).to(x.dtype)
        expert = top_e.reshape(-1)  # (N * k,) assignments, token-major
        order = expert.argsort(stable=True)  # grouped by expert
        token = order // self.top_k
        counts = torch.bincount(expert, minlength=self.n_experts)
        xs = h.index_select(0, token)
        if self.ep_group is None:
            ys = self._run_experts(xs, counts.tolist())
        else:
            ys = self._dispatch(xs, counts)
        ys = ys * gates.reshape(-1).index_select(0, order)[:, None]
        out = torch.zeros_like(h).index_add(0, token, ys).view(B, T, d)
        if self.aux_loss and torch.is_grad_enabled():
            assigned = F.one_hot(top_e, self.n_experts).sum(1).view(B, T, -1)
            f = assigned.to(probs.dtype).mean(1) / self.top_k  # (B, E)
            p = probs.view(B, T, -1).mean(1)
            aux = self.aux_loss * self.n_experts * (f * p).sum(-1).mean()
            out = AddAuxLoss.apply(out, aux.to(out.dtype))
        return out


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, moe: dict | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, d_ff) if moe is None else MoE(d_model, d_ff, **moe)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Pre-norm Llama-style decoder over bytes; forward(tokens (B, T)) -> logits (B, T, 256).
    ``moe``: :class:`MoE`'s keyword arguments (``n_experts``, ``top_k``, ``aux_loss``,
    ``stacked``) to make every MLP routed experts; ``None``: dense SwiGLU MLPs."""

    def __init__(
        self,
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_ff: int,
        max_seq_len: int,
        moe: dict | None = None,
    ):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads, d_ff, moe) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB, bias=False)
        cos, sin = rotary_tables(max_seq_len, d_model // n_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int):
        # GPT-2 style: N(0, 0.02), residual output projections scaled down by depth.
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            residual_out = name.endswith(("wo.weight", "w_down.weight", "w_down"))
            std = 0.02 / math.sqrt(2 * n_layers) if residual_out else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens):
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class Stage(nn.Module):
    """A pipeline stage of a :class:`Transformer`: its layers ``layer_ids`` (the same modules,
    so the same parameters and names: ``layers.<i>....``), with the embedding on the first
    stage and the final norm and LM head on the last. forward(tokens (B, T) on the first stage,
    else hidden states (B, T, d)) -> hidden states, or logits (B, T, 256) on the last."""

    def __init__(self, model: Transformer, layer_ids, first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x):
        T = x.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def tensor_parallel_plan(layers, moe: bool = False) -> dict:
    """q/k/v/gate/up column-wise, o/down row-wise; everything else stays replicated. ``layers``:
    the number of layers, or the indices of a pipeline stage's layers. ``moe``: the MLPs are
    routed experts, which stay whole (replicated over tp; spread over ep instead)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    mlp = () if moe else ("mlp.w_gate", "mlp.w_up")
    for i in range(layers) if isinstance(layers, int) else layers:
        for name in ("attn.wq", "attn.wk", "attn.wv") + mlp:
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo",) + (() if moe else ("mlp.w_down",)):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


class Pipeline:
    """This rank's pipeline stage (``torch.distributed.pipelining``) of ``model`` on the
    ("pp", "dp", "tp") ``device_mesh``: stage ``s`` of ``--pp`` holds layers
    ``s * L / pp ... (s + 1) * L / pp - 1`` (the embedding on the first, the norm and the LM head
    on the last), tensor parallel over "tp" like the whole model, driven by a real schedule
    (``Schedule1F1B`` or ``ScheduleGPipe``) over ``--microbatches`` micro-batches.

    The parameters are the stage module's own; ``params`` trees are their detached views, so
    an ``ft.step(..., donate=True)`` that updates in place updates the module, and
    :meth:`load` copies other results in."""

    def __init__(self, args, model: Transformer, device_mesh, experts: ExpertParallel | None):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        from torch.distributed.tensor.parallel import parallelize_module

        self.pp, self.stage_index = args.pp, device_mesh.get_local_rank("pp")
        per = args.n_layers // args.pp
        ids = list(range(self.stage_index * per, (self.stage_index + 1) * per))
        self.first, self.last = self.stage_index == 0, self.stage_index == args.pp - 1
        self.module = Stage(model, ids, self.first, self.last)
        if args.tp > 1:
            parallelize_module(
                self.module, device_mesh["tp"], tensor_parallel_plan(ids, moe=bool(args.moe))
            )
        self.group = device_mesh.get_group("pp")
        self.last_rank = dist.get_global_rank(self.group, args.pp - 1)
        stage = PipelineStage(
            self.module, self.stage_index, args.pp, torch.device("cpu"), group=self.group
        )
        kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
        # mean cross-entropy per micro-batch; the schedule divides the summed gradients by the
        # number of micro-batches (scale_grads): the gradient of the batch mean
        self.schedule = kind(
            stage, n_microbatches=args.microbatches, loss_fn=self._loss, scale_grads=True
        )
        self.microbatches = args.microbatches
        self.experts = experts
        self.views = {k: p.detach() for k, p in self.module.named_parameters()}
        if experts is not None:
            self.views = experts.views(self.views)

    @staticmethod
    def _loss(logits, y):
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def _run(self, x, y, losses, *, train: bool):
        run = self.schedule.step if train else self.schedule.eval
        if self.first:
            run(x)
        elif self.last:
            run(target=y, losses=losses)
        else:
            run()

    def _from_last(self, value: torch.Tensor) -> torch.Tensor:
        """The last stage's ``value`` on every stage of this pipeline."""
        value = value.detach().clone()
        dist.broadcast(value, src=self.last_rank, group=self.group)
        return value

    def grad_and_value(self, params, x, y):
        """``(grads, loss)`` of the batch ``(x, y)`` (mean cross-entropy) for this stage's
        parameters, through the schedule; ``params`` must be :attr:`views` (see :meth:`load`)."""
        losses = []
        with torch.enable_grad():
            self._run(x, y, losses, train=True)
        grads = {}
        for k, p in self.module.named_parameters():
            grads[k], p.grad = p.grad, None
        if self.experts is not None:
            grads = self.experts.views(grads)
        loss = torch.stack(losses).mean() if self.last else torch.zeros(())
        return grads, self._from_last(loss)

    @torch.no_grad()
    def loss_sum(self, x, y) -> torch.Tensor:
        """The summed cross-entropy of ``(x, y)`` (float64), forward only, on every stage."""
        losses = []
        self._run(x, y, losses, train=False)
        total = torch.zeros((), dtype=torch.float64)
        if self.last:  # micro-batch means weighted by their sizes (torch.tensor_split's)
            sizes = [len(c) for c in torch.tensor_split(torch.arange(len(x)), self.microbatches)]
            for loss, n in zip(losses, [n for n in sizes if n]):
                total += loss.double() * n * x.shape[1]
        return self._from_last(total)

    def stage_norms(self, grads, mesh: ft.Mesh) -> list:
        """Per stage, the norm of its own (data-parallel mean) gradients alone: what a stage
        would clip by if it did not know the others (``ft.global_norm`` on the sub-mesh of
        its own stage's ranks), on every rank."""
        alone = ft.Mesh(
            without(mesh.device_mesh, "pp"),
            data_axis=mesh.data_axis,
            expert_axis=mesh.expert_axis,
            is_expert=mesh.is_expert,
        )
        return norms_of_ranks(grads, alone, self.group)

    @torch.no_grad()
    def load(self, params) -> dict:
        """Make the stage module's parameters hold ``params``; returns :attr:`views`."""
        for k, view in self.views.items():
            if params[k] is not view:
                view.copy_(params[k])
        return self.views


class ExpertParallel:
    """Expert parallelism over the "ep" dim of ``device_mesh``: each rank keeps experts
    ``r * E / ep ... (r + 1) * E / ep - 1`` of every :class:`MoE` layer (``MoE.keep_experts``;
    tokens reach them by all-to-all) and, like a dp rank, trains on its own slice of the batch.

    How the optimizer learns which leaves are experts (``--experts``):
    stacked: the (E / ep, ...) local expert tensors are presented as one DTensor of global shape
    (E, ...) ``Shard(0)`` over ``device_mesh["ep"]`` (:meth:`views`; the model computes on
    their local tensors, :meth:`local`); separate: each rank's own expert modules keep their
    global names (``layers.0.mlp.experts.5.w_up.weight``) and :meth:`mesh_args` declares them
    with ``is_expert``."""

    STACKED = ("mlp.w_gate", "mlp.w_up", "mlp.w_down")

    def __init__(self, args, model: Transformer, device_mesh):
        self.ep, self.rank = args.ep, device_mesh.get_local_rank("ep")
        self.mesh, self.group = device_mesh["ep"], device_mesh.get_group("ep")
        self.stacked = args.experts == "stacked"
        for module in model.modules():
            if isinstance(module, MoE):
                module.keep_experts(self.rank, self.ep, self.group)

    def mesh_args(self) -> dict:
        """``ft.Mesh`` keyword arguments for the experts."""
        if self.stacked:  # the DTensors' Shard(0) over "ep" says it
            return {"expert_axis": "ep"}
        return {"expert_axis": "ep", "is_expert": is_expert_path}

    def views(self, tree: dict) -> dict:
        """``tree`` (parameters or their gradients) with each stacked expert tensor (local
        (E / ep, ...)) wrapped as a DTensor (E, ...) ``Shard(0)`` over "ep", sharing storage."""
        if not self.stacked:
            return tree
        from torch.distributed.tensor import Shard

        out = {}
        for k, v in tree.items():
            if k.endswith(self.STACKED) and v is not None:
                shape = (v.shape[0] * self.ep, *v.shape[1:])
                v = DTensor.from_local(
                    v,
                    self.mesh,
                    [Shard(0)],
                    run_check=False,
                    shape=shape,
                    stride=torch.empty(shape, device="meta").stride(),
                )
            out[k] = v
        return out

    def local(self, params: dict) -> dict:
        """``params`` with the stacked expert DTensors as their local tensors (differentiably),
        for ``functional_call`` on the rank's own experts."""
        return {
            k: v.to_local() if k.endswith(self.STACKED) and isinstance(v, DTensor) else v
            for k, v in params.items()
        }

    def rank_norms(self, grads: dict, mesh: ft.Mesh) -> list:
        """Per ep rank, the norm of what it would clip by if it took the ep axis for more
        model replicas: its own dense gradients (the dp mean of its tokens' only) and its own
        experts' (``ft.global_norm`` on the sub-mesh of the ranks sharing its ep coordinate),
        on every rank."""
        own = {
            k: (g.to_local() if isinstance(g, DTensor) and k.endswith(self.STACKED) else g)
            / (self.ep if is_expert_path(k) or k.endswith(self.STACKED) else 1)
            for k, g in grads.items()
        }
        alone = ft.Mesh(
            without(mesh.device_mesh, "ep"),
            data_axis=mesh.data_axis,
            pipeline_axis=mesh.pipeline_axis,
        )
        return norms_of_ranks(own, alone, self.group)


def without(device_mesh, name: str):
    """The sub-mesh of ``device_mesh`` over its other dims: this rank's slice along ``name``
    (a norm on it reduces over those ranks only)."""
    return device_mesh[tuple(n for n in device_mesh.mesh_dim_names if n != name)]


def norms_of_ranks(grads: dict, alone: ft.Mesh, group) -> list:
    """``ft.global_norm(grads)`` on the sub-mesh descriptor ``alone`` (this rank's own part of
    the model), from every rank of ``group`` in rank order, on every rank."""
    norm = ft.global_norm(grads, mesh=alone).reshape(1).float()
    every = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, norm, group=group)
    return [float(t) for t in every]


def is_expert_path(path: str) -> bool:
    """The separate experts' parameters: ``layers.<i>.mlp.experts.<e>.*``."""
    return ".experts." in path


def full_params(params: dict, groups) -> dict:
    """The unsharded parameters of the whole model, on every rank: ``name -> tensor``. DTensors
    are gathered; ``groups``: process groups whose ranks hold other leaves (the expert-parallel
    group with separate experts, the pipeline group), gathered over in turn."""
    mine = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in params.items()
    }
    for group in groups:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        mine = {k: v for part in every for k, v in part.items()}
    return mine


# --------------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------------


def grad_and_value(loss_fn):
    """``torch.func.grad_and_value(loss_fn)`` (argnums=0, dict params) built on ``torch.autograd``.

    Why: under ``parallelize_module`` the forward goes through DTensor's ``from_local`` /
    ``to_local``, which are ``autograd.Function``s without ``setup_context``; functorch transforms
    refuse them ("In order to use an autograd.Function with functorch transforms ... must override
    setup_context"). Ordinary reverse-mode autograd over ``functional_call`` computes the same
    gradients, so the multi-process path uses this instead. Returns ``(grads, loss)`` with
    ``grads`` a dict shaped like ``params``; neither argument is modified.
    """

    def wrapped(params, *args, **kwargs):
        with torch.enable_grad():
            leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
            loss = loss_fn(leaves, *args, **kwargs)
            grads = torch.autograd.grad(loss, list(leaves.values()))
        return dict(zip(leaves.keys(), grads)), loss.detach()

    return wrapped


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def list_files(path: str | None) -> list[str]:
    """Files to read, in deterministic (sorted) order."""
    if path is None:
        root = sysconfig.get_paths()["stdlib"]
        files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
        # site-packages / dist-packages hold third-party code that differs between machines.
        files = [f for f in files if not {"site-packages", "dist-packages"} & set(f.split(os.sep))]
        return sorted(files)
    if os.path.isdir(path):
        files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        return sorted(f for f in files if os.path.isfile(f))
    if os.path.isfile(path):
        return [path]
    raise FileNotFoundError(f"--data {path!r} is neither a file nor a directory")


def load_bytes(path: str | None, max_bytes: int) -> torch.Tensor:
    """Concatenate the files' bytes (up to max_bytes, 0 = no cap) into a uint8 tensor."""
    chunks, total = [], 0
    for f in list_files(path):
        with open(f, "rb") as fh:
            data = fh.read()
        if max_bytes and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    data = b"".join(chunks)
    if not data:
        raise ValueError(f"no data found under {path or 'the Python standard library'}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int):
    """Inputs and next-byte targets, (len(starts), seq_len) int64 each."""
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


# optimizer -> default peak learning rate on this model (sweeps at the default size; adamw and muon
# over 1e-3 ... 3e-2 at the default 600 steps, see the README)
OPTIMIZERS = {
    "adamw": 3e-3,
    "adafactor": 3e-3,
    "came": 3e-3,
    "lamb": 5e-2,
    "galore": 1e-2,
    "muon": 1e-2,
}


def build_optimizer(
    name: str,
    lr,
    weight_decay: float,
    params: dict,
    *,
    eight_bit: bool = False,
    galore_rank: int = 32,
    galore_gap: int = 50,
) -> ft.GradientTransformation:
    """The ``--optimizer`` transform (``lr``: a float or a schedule).

    adamw: ``ft.adamw``; adafactor: ``ft.adafactor`` with an explicit lr (no relative step, no
    parameter scaling); came: ``ft.came``; lamb: ``ft.lamb``, each decaying only the weight
    matrices (``mask=ft.decay_mask``: not the norms, nor the embedding); galore:
    ``ft.galore_adamw`` on the 2-D weights that ``ft.galore_param_labels`` selects (embeddings and
    the LM head included), plain AdamW on the rest, no decay on norms; muon: ``ft.muon`` on the
    hidden weight matrices (``ft.muon_param_labels``: not the embedding, the LM head, norms) with
    Moonlight's ``adjust_lr_fn="match_rms_adamw"``, so that it shares AdamW's learning rate, and
    that AdamW (decay mask as above) on the rest. ``eight_bit``: 8-bit block-wise Adam moments
    (adamw and galore only).
    """
    bits = {"optim_bits": 8} if eight_bit else {}
    if eight_bit and name not in ("adamw", "galore"):
        raise SystemExit(f"--8bit applies to adamw and galore, not {name}")
    mask = ft.decay_mask  # no decay on norms and embeddings (the usual recipe)
    if name == "adamw":
        return ft.adamw(lr, weight_decay=weight_decay, mask=mask, **bits)
    if name == "adafactor":
        return ft.adafactor(
            lr, relative_step=False, scale_parameter=False, weight_decay=weight_decay, mask=mask
        )
    if name == "came":
        return ft.came(lr, weight_decay=weight_decay, mask=mask)
    if name == "lamb":
        return ft.lamb(lr, weight_decay=weight_decay, mask=mask)
    if name == "galore":
        return ft.galore_adamw(
            lr,
            weight_decay=weight_decay,
            rank=galore_rank,
            update_proj_gap=galore_gap,
            labels=ft.galore_param_labels(params),
            **bits,
        )
    if name == "muon":
        return ft.muon(
            lr,
            weight_decay=weight_decay,
            adjust_lr_fn="match_rms_adamw",
            adam=ft.adamw(lr, weight_decay=weight_decay, mask=mask),
        )
    raise SystemExit(f"unknown optimizer {name!r}")


def state_bytes(state) -> int:
    """Bytes of optimizer state held by this rank (local shards of DTensors)."""
    import optree

    total = 0
    for x in optree.tree_leaves(state):
        if isinstance(x, torch.Tensor):
            t = x.to_local() if isinstance(x, DTensor) else x
            total += t.numel() * t.element_size()
    return total


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=128, help="residual stream width")
    g.add_argument("--n-layers", type=int, default=4, help="number of transformer blocks")
    g.add_argument("--n-heads", type=int, default=4, help="attention heads (divisible by --tp)")
    g.add_argument(
        "--d-ff",
        type=int,
        default=0,
        help="SwiGLU hidden width; 0 = 8/3 * d-model rounded up to a multiple of 64",
    )
    g.add_argument("--seq-len", type=int, default=256, help="context length in bytes")
    g.add_argument(
        "--moe",
        type=int,
        default=0,
        metavar="E",
        help="E routed SwiGLU experts in every MLP (0 = dense MLPs; see MoE)",
    )
    g.add_argument("--top-k", type=int, default=2, help="experts per token (with --moe)")
    g.add_argument(
        "--aux-loss", type=float, default=0.01, help="load-balancing loss coefficient (with --moe)"
    )
    g.add_argument(
        "--experts",
        choices=["stacked", "separate"],
        default="stacked",
        help="expert parameters: stacked (E, ...) tensors, a DTensor Shard(0) over "
        "the ep axis under --ep; or one module per expert, declared to the "
        "optimizer with Mesh(expert_axis='ep', is_expert=...)",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=600, help="optimizer steps")
    g.add_argument(
        "--batch", type=int, default=32, help="global batch: sequences per optimizer step"
    )
    g.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-steps per optimizer step (the global batch is split into this many)",
    )
    g.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="adamw",
        help="the optimizer after clipping (see build_optimizer)",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: per optimizer, see OPTIMIZERS)",
    )
    g.add_argument(
        "--zero",
        action="store_true",
        help="ZeRO-1/2: ft.zero_redundancy over the dp axis (optimizer state 1/dp)",
    )
    g.add_argument(
        "--8bit",
        dest="eight_bit",
        action="store_true",
        help="8-bit block-wise Adam moments (adamw, galore; leaves >= 4096 elements)",
    )
    g.add_argument("--galore-rank", type=int, default=32, help="GaLore projection rank")
    g.add_argument("--galore-gap", type=int, default=50, help="GaLore update_proj_gap")
    g.add_argument(
        "--warmup",
        type=int,
        default=50,
        help="linear warmup steps (at most half of --steps, so short runs still train)",
    )
    g.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled (AdamW) weight decay")
    g.add_argument("--seed", type=int, default=0, help="seeds initialisation and batch sampling")
    g.add_argument(
        "--step",
        choices=["donate", "pure", "update"],
        default="donate",
        help="optimizer step: ft.step(..., donate=True) (default), ft.step pure, or "
        "tx.update + ft.apply_updates",
    )
    g = p.add_argument_group("data and evaluation")
    g.add_argument(
        "--data",
        default=None,
        help="text file or directory (all files under it, sorted); "
        "default: the Python standard library sources",
    )
    g.add_argument(
        "--max-bytes", type=int, default=0, help="read at most this many bytes (0 = all)"
    )
    g.add_argument("--val-fraction", type=float, default=0.05, help="held-out tail of the data")
    g.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="also evaluate every N steps (0 = only at the end)",
    )
    g.add_argument(
        "--eval-windows",
        type=int,
        default=128,
        help="number of fixed, evenly spaced validation windows of --seq-len bytes",
    )
    g = p.add_argument_group("parallelism and output")
    g.add_argument("--dp", type=int, default=0, help="data-parallel size (0 = world size // tp)")
    g.add_argument(
        "--tp",
        type=int,
        default=0,
        help="tensor-parallel size (0 = 2 if the world size is even, else 1)",
    )
    g.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages (torch.distributed.pipelining; the layers split evenly)",
    )
    g.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (with --moe): each rank of the ep axis holds E / ep "
        "experts and its own slice of the batch (data parallel over dp x ep)",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=0,
        help="pipeline micro-batches per (accumulation) step (0 = the most, up to "
        "2 x --pp, that divide it evenly)",
    )
    g.add_argument(
        "--schedule",
        choices=["1f1b", "gpipe"],
        default="1f1b",
        help="pipeline schedule: Schedule1F1B or ScheduleGPipe",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per process (0 = all cores in one process, 1 under torchrun)",
    )
    g.add_argument("--out", default=None, help="output directory (default runs/<timestamp>)")
    g = p.add_argument_group("checkpoints")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="save <out>/checkpoint every N optimizer steps (0 = never)",
    )
    g.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue from the checkpoint in DIR (e.g. runs/<timestamp>/checkpoint)",
    )
    return p.parse_args(argv)


def setup_parallel(args):
    """Returns (world_size, rank, device_mesh or None); device_mesh has dims ("dp", "tp"), with
    "pp" in front under --pp > 1 and "ep" after "dp" under --ep > 1. Joins the gloo process
    group of torchrun's environment, or takes the one a caller has already started."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.ep > 1 and not args.moe:
        raise SystemExit("--ep needs routed experts (--moe E)")
    if world == 1:
        if args.dp not in (0, 1) or args.tp not in (0, 1) or args.pp != 1 or args.ep != 1:
            raise SystemExit(
                "--dp/--tp/--pp/--ep > 1 need several processes (launch with torchrun)"
            )
        args.dp, args.tp = 1, 1
        return 1, 0, None
    from torch.distributed.device_mesh import init_device_mesh

    if args.pp < 1 or args.ep < 1 or world % (args.pp * args.ep):
        raise SystemExit(f"--pp {args.pp} x --ep {args.ep} does not divide the world size {world}")
    rest = world // (args.pp * args.ep)
    tp = args.tp or (2 if rest % 2 == 0 else 1)
    dp = args.dp or rest // tp
    if args.pp * dp * args.ep * tp != world:
        raise SystemExit(
            f"--pp {args.pp} x --dp {dp} x --ep {args.ep} x --tp {tp} != world size {world}"
        )
    args.dp, args.tp = dp, tp
    check_sizes(args)  # before any process group: a bad layout stops every rank at once
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = (
        [("pp", args.pp)] * (args.pp > 1)
        + [("dp", dp)]
        + [("ep", args.ep)] * (args.ep > 1)
        + [("tp", tp)]
    )
    return (
        world,
        rank,
        init_device_mesh(
            "cpu", tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims)
        ),
    )


def check_sizes(args):
    if args.lr is None:
        args.lr = OPTIMIZERS[args.optimizer]
    if args.d_ff == 0:
        args.d_ff = 64 * math.ceil(8 * args.d_model / 3 / 64)
    if args.d_model % args.n_heads or (args.d_model // args.n_heads) % 2:
        raise SystemExit("--d-model must be a multiple of --n-heads with an even head size")
    if args.n_heads % args.tp or args.d_ff % args.tp:
        raise SystemExit(
            f"--n-heads {args.n_heads} and --d-ff {args.d_ff} must be divisible by --tp {args.tp}"
        )
    if args.steps < 1 or args.eval_windows < 1:
        raise SystemExit("--steps and --eval-windows must be at least 1")
    data = args.dp * args.ep  # ranks with their own slice of the batch
    if args.batch % (data * args.accum):
        raise SystemExit(
            f"--batch {args.batch} must be divisible by --dp {args.dp} x --ep {args.ep}"
            f" x --accum {args.accum}"
        )
    if args.moe:
        if args.moe % args.ep:
            raise SystemExit(f"--moe {args.moe} experts must be divisible by --ep {args.ep}")
        if not 1 <= args.top_k <= args.moe:
            raise SystemExit(f"--top-k {args.top_k} must be between 1 and --moe {args.moe}")
    if args.ep > 1 and args.eval_windows % data:  # every ep rank runs the same forwards
        raise SystemExit(
            f"--eval-windows {args.eval_windows} must be divisible by --dp {args.dp} "
            f"x --ep {args.ep}"
        )
    if args.ep > 1 and (args.checkpoint_every or args.resume):
        raise SystemExit("--checkpoint-every / --resume are not supported with --ep yet")
    if args.checkpoint_every < 0:
        raise SystemExit("--checkpoint-every must be >= 0")
    if args.pp > 1:
        if args.n_layers % args.pp:
            raise SystemExit(f"--n-layers {args.n_layers} must be divisible by --pp {args.pp}")
        micro = args.batch // (data * args.accum)
        # default: the most micro-batches up to 2 per stage that split the micro-step evenly
        args.microbatches = args.microbatches or max(
            n for n in range(1, 2 * args.pp + 1) if micro % n == 0
        )
        if micro % args.microbatches:
            raise SystemExit(
                f"the per-rank micro-step batch {micro} (--batch / (--dp x --ep x --accum)) "
                f"must be divisible by --microbatches {args.microbatches}"
            )
        if args.checkpoint_every or args.resume:
            raise SystemExit("--checkpoint-every / --resume are not supported with --pp yet")


# the settings that shape the trajectory: a checkpoint resumes only with the same ones
# (--steps too, but it only warns: the learning rate schedule decays over --steps)
TRAJECTORY = (
    "d_model",
    "n_layers",
    "n_heads",
    "d_ff",
    "seq_len",
    "moe",
    "top_k",
    "aux_loss",
    "experts",
    "batch",
    "accum",
    "optimizer",
    "lr",
    "zero",
    "eight_bit",
    "galore_rank",
    "galore_gap",
    "warmup",
    "clip",
    "weight_decay",
    "seed",
    "data",
    "max_bytes",
    "val_fraction",
    "steps",
)


def check_resume(args, saved: dict, log) -> None:
    """Refuse to resume a checkpoint written with other trajectory settings (``TRAJECTORY``)."""
    now = {k: getattr(args, k) for k in TRAJECTORY}
    saved = {"moe": 0, "top_k": 2, "aux_loss": 0.01, "experts": "stacked"} | saved  # older runs
    diff = [k for k in TRAJECTORY if k != "steps" and saved.get(k) != now[k]]
    if diff:
        raise SystemExit(
            f"--resume {args.resume}: the checkpoint was written with other settings: "
            + ", ".join(
                f"--{k.replace('_', '-')} {saved.get(k)} (checkpoint) vs {now[k]} (now)"
                for k in diff
            )
        )
    if saved.get("steps") != args.steps:
        log(
            f"warning: the checkpoint's run had --steps {saved.get('steps')}, this one "
            f"{args.steps}: the learning rate schedule differs from both"
        )


def main(argv=None):
    args = parse_args(argv)
    owns_group = not dist.is_initialized()  # else the caller's, left to the caller
    world, rank, device_mesh = setup_parallel(args)
    check_sizes(args)
    torch.set_num_threads(args.threads or (len(os.sched_getaffinity(0)) if world == 1 else 1))
    is_main = rank == 0
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if is_main else (lambda *a: None)
    if args.checkpoint_every:  # every rank writes its shards to <out>/checkpoint: agree on <out>
        out = [args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))]
        if world > 1:
            dist.broadcast_object_list(out, src=0)
        args.out = out[0]

    # ---- data: identical on every rank -----------------------------------------------------------
    data = load_bytes(args.data, args.max_bytes)
    n_val = max(int(len(data) * args.val_fraction), args.seq_len + 1)
    train_data, val_data = data[:-n_val], data[-n_val:]
    if len(train_data) <= args.seq_len + 1:
        raise SystemExit("not enough data for one training window")
    val_starts = torch.linspace(0, len(val_data) - args.seq_len - 1, args.eval_windows).long()
    log(f"data: {len(train_data):,} train bytes, {len(val_data):,} validation bytes")

    # ---- model: the full model initialised identically everywhere, then sharded ------------------
    torch.manual_seed(args.seed)
    moe = (
        dict(
            n_experts=args.moe,
            top_k=args.top_k,
            aux_loss=args.aux_loss,
            stacked=args.experts == "stacked",
        )
        if args.moe
        else None
    )
    model = Transformer(args.d_model, args.n_layers, args.n_heads, args.d_ff, args.seq_len, moe)
    n_params = sum(p.numel() for p in model.parameters())
    mesh, data_rank, data_groups, pipe, experts = None, 0, [], None, None
    if device_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        if args.ep > 1:  # this rank's experts only
            experts = ExpertParallel(args, model, device_mesh)
        if args.pp > 1:  # this rank's stage: its own leaves
            pipe = Pipeline(args, model, device_mesh, experts)
        elif args.tp > 1:
            parallelize_module(
                model, device_mesh["tp"], tensor_parallel_plan(args.n_layers, moe=bool(args.moe))
            )
        mesh = ft.Mesh(
            device_mesh,
            data_axis="dp",
            pipeline_axis="pp" if args.pp > 1 else None,
            **(experts.mesh_args() if experts else {}),
        )
        # ranks with their own slice of the batch: dp, and ep (its ranks are data parallel too)
        data_rank = device_mesh.get_local_rank("dp") * args.ep + (
            device_mesh.get_local_rank("ep") if experts else 0
        )
        data_groups = [
            device_mesh.get_group(d)
            for d in ("dp", "ep")
            if d in device_mesh.mesh_dim_names
            and device_mesh.size(device_mesh.mesh_dim_names.index(d)) > 1
        ]
    if pipe is not None:
        params = pipe.views
    else:
        params = {k: v.detach() for k, v in model.named_parameters()}
        if experts is not None:  # stacked experts: DTensor views over the ep axis
            params = experts.views(params)
    n_data = args.dp * args.ep
    log(
        f"model: {n_params / 1e6:.2f}M parameters"
        + (f" ({args.moe} experts, top-{args.top_k})" if args.moe else "")
        + f"; world {world}"
        + (
            " = "
            + " x ".join(f"{d} {n}" for d, n in zip(device_mesh.mesh_dim_names, device_mesh.shape))
            if world > 1
            else ""
        )
    )

    def loss_fn(params, x, y):
        if experts is not None:
            params = experts.local(params)
        logits = torch.func.functional_call(model, params, (x,))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    # torch.func.grad_and_value cannot see through DTensor (see grad_and_value above).
    grad_fn = torch.func.grad_and_value(loss_fn) if world == 1 else grad_and_value(loss_fn)
    if pipe is not None:  # through the pipeline schedule
        grad_fn = pipe.grad_and_value

    def data_sum(t):
        """``t`` summed over the ranks with their own data (dp, and ep)."""
        t = t.clone()
        for group in data_groups:
            dist.all_reduce(t, group=group)
        return t

    @torch.no_grad()
    def evaluate(params):
        # dp (x ep) ranks split the fixed windows; tp ranks of a group evaluate the same ones.
        per_rank = math.ceil(len(val_starts) / n_data)
        mine = val_starts[data_rank * per_rank : (data_rank + 1) * per_rank]
        total = torch.zeros((), dtype=torch.float64)
        for chunk in mine.split(32):
            x, y = windows(val_data, chunk, args.seq_len)
            if pipe is not None:
                total += pipe.loss_sum(x, y)
                continue
            logits = torch.func.functional_call(
                model, experts.local(params) if experts else params, (x,)
            )
            total += F.cross_entropy(
                logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum"
            ).double()
        return (data_sum(total) / (len(val_starts) * args.seq_len)).item()

    # ---- optimizer -------------------------------------------------------------------------------
    warmup = min(args.warmup, args.steps // 2)
    schedule = ft.schedules.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=args.lr,
        warmup_steps=warmup,
        decay_steps=args.steps,
        end_value=args.lr * 0.1,
    )
    opt = build_optimizer(
        args.optimizer,
        schedule,
        args.weight_decay,
        params,
        eight_bit=args.eight_bit,
        galore_rank=args.galore_rank,
        galore_gap=args.galore_gap,
    )
    tx = ft.chain(ft.clip_by_global_norm(args.clip), opt)
    if args.zero:  # clipping runs on the dp shards too: one scalar all-reduce either way
        tx = ft.zero_redundancy(tx, axis="dp", device_mesh=device_mesh)
    if args.accum > 1:  # (with one micro-step its accumulator would only cost memory)
        tx = ft.multi_steps(tx, every_k=args.accum)
    state = tx.init(params)

    # ---- training loop ---------------------------------------------------------------------------
    from tqdm import tqdm

    batch_gen = torch.Generator().manual_seed(args.seed + 1)  # same global batches on every rank
    local_batch = args.batch // n_data
    micro = local_batch // args.accum
    tokens_per_step = args.batch * args.seq_len
    history, val_history = [], []
    train_time = 0.0
    t_start = time.perf_counter()
    start = 0
    if args.resume:  # templates: the parameters and state just built for this layout
        params, state, start, extra = ft.checkpoint.load(args.resume, params, state)
        check_resume(args, extra["args"], log)
        if start > args.steps:
            raise SystemExit(
                f"--resume {args.resume}: checkpoint at step {start} > --steps {args.steps}"
            )
        batch_gen.set_state(extra["batch_gen"])
        torch.set_rng_state(extra["torch_rng"])  # unused by this job; restored for extensions
        history, val_history = extra["history"], extra["val_history"]
        train_time = extra["train_time"]
        t_start -= extra["elapsed"]
        log(f"resumed from {args.resume} at step {start}")

    def save_checkpoint(done):
        t0 = time.perf_counter()
        path = ft.checkpoint.save(
            os.path.join(args.out, "checkpoint"),
            params=params,
            state=state,
            step=done,
            extra={
                "batch_gen": batch_gen.get_state(),
                "torch_rng": torch.get_rng_state(),
                "history": history,
                "val_history": val_history,
                "train_time": train_time,
                "elapsed": time.perf_counter() - t_start,
                "args": {k: getattr(args, k) for k in TRAJECTORY},
            },
        )
        if is_main:
            bar.write(
                f"step {done}: checkpoint {path} ({time.perf_counter() - t0:.2f} s)",
                file=sys.stderr,
            )

    bar = tqdm(
        range(start, args.steps),
        initial=start,
        total=args.steps,
        disable=not is_main,
        desc="train",
        dynamic_ncols=True,
    )
    for step in bar:
        starts = torch.randint(
            0, len(train_data) - args.seq_len - 1, (args.batch,), generator=batch_gen
        )
        starts = starts[
            data_rank * local_batch : (data_rank + 1) * local_batch
        ]  # this rank's slice
        t0 = time.perf_counter()
        loss_sum = torch.zeros(())
        mean_grads = None  # with pipe / experts: the step's mean gradient, summed over micro-steps
        for m in range(args.accum):
            x, y = windows(train_data, starts[m * micro : (m + 1) * micro], args.seq_len)
            grads, loss = grad_fn(params, x, y)
            if pipe is not None or experts is not None:  # the step's mean gradient, for what
                # each stage / expert-parallel rank alone sees
                mean_grads = (
                    {k: g / args.accum for k, g in grads.items()}
                    if mean_grads is None
                    else {k: mean_grads[k] + g / args.accum for k, g in grads.items()}
                )
            counting = (
                count_collectives() if step == start and m == args.accum - 1 else nullcontext()
            )
            with counting as counted:
                if args.step == "update":  # the two calls ft.step makes one of
                    updates, state = tx.update(grads, state, params, mesh=mesh)
                    params = ft.apply_updates(params, updates)
                else:  # fused kernels where they apply; --step donate writes into the old buffers
                    params, state = ft.step(
                        tx, grads, state, params, mesh=mesh, donate=args.step == "donate"
                    )
            if counted is not None and world > 1 and is_main:
                bar.write(
                    "optimizer step collectives per update: "
                    + (", ".join(f"{k} {v}" for k, v in sorted(counted.counts.items())) or "none"),
                    file=sys.stderr,
                )
            if pipe is not None:  # the stage module runs on its own parameters
                params = pipe.load(params)
            loss_sum += loss.detach()
        loss = (data_sum(loss_sum) / (args.accum * n_data)).item()  # mean over the global batch
        dt = time.perf_counter() - t0
        train_time += dt
        if args.accum > 1:
            assert bool(ft.has_updated(state)), "multi_steps did not update on the last micro-step"
        grad_norm = float(ft.tree_get(state, "global_norm"))
        lr = float(schedule(torch.tensor(step)))
        history.append(
            {
                "step": step + 1,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens_per_s": tokens_per_step / dt,
                "time_s": time.perf_counter() - t_start,
            }
        )
        reports = []  # what each ep rank / stage alone would clip by, beside the global norm
        if experts is not None:
            reports.append(
                (
                    "ep_rank_grad_norms",
                    experts.rank_norms(mean_grads, mesh),
                    "rank",
                    "each expert-parallel rank's own norm (its own tokens' gradients "
                    "for the dense leaves, its own experts)",
                    lambda norms: "",
                )
            )
        if pipe is not None:
            reports.append(
                (
                    "stage_grad_norms",
                    pipe.stage_norms(mean_grads, mesh),
                    "stage",
                    "each stage's own norm",
                    lambda norms: (
                        f" (their root sum of squares {math.hypot(*norms):.4f}: a stage "
                        f"clipping by its own norm would scale its gradients "
                        f"differently)"
                    ),
                )
            )
        for key, norms, who, what, tail in reports:
            history[-1][key] = norms
            if step == start and is_main:
                bar.write(
                    f"step {step + 1}: global gradient norm {grad_norm:.4f} (what every "
                    f"{who} clips by); {what}: "
                    + ", ".join(f"{n:.4f}" for n in norms)
                    + tail(norms),
                    file=sys.stderr,
                )
        bar.set_postfix(
            loss=f"{loss:.3f}", gnorm=f"{grad_norm:.2f}", tok_s=f"{tokens_per_step / dt:,.0f}"
        )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            val_history.append({"step": step + 1, "val_loss": evaluate(params)})
            if is_main:
                bar.write(
                    f"step {step + 1}: val loss {val_history[-1]['val_loss']:.4f}", file=sys.stderr
                )
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(step + 1)  # dcp.save has written every byte when it returns
    bar.close()
    val_loss = evaluate(params)
    val_history.append({"step": args.steps, "val_loss": val_loss})
    wall = time.perf_counter() - t_start

    # ---- outputs ---------------------------------------------------------------------------------
    # separate experts: each ep rank holds its own names (stacked ones gather as DTensors)
    full = full_params(
        params,
        ([experts.group] if experts and not experts.stacked else [])
        + ([pipe.group] if pipe else []),
    )
    summary = {
        "initial_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "val_loss": val_loss,
        "steps": args.steps,
        "tokens": args.steps * tokens_per_step,
        "tokens_per_s": args.steps * tokens_per_step / train_time if train_time else None,
        "train_time_s": train_time,
        "wall_time_s": wall,
        "n_params": n_params,
        "world_size": world,
        "mesh": (dict(zip(device_mesh.mesh_dim_names, device_mesh.shape)) if world > 1 else None),
        "moe": (
            {
                "experts": args.moe,
                "top_k": args.top_k,
                "aux_loss": args.aux_loss,
                "stacked": args.experts == "stacked",
            }
            if args.moe
            else None
        ),
        "optimizer": args.optimizer,
        "zero": args.zero,
        "8bit": args.eight_bit,
        "state_bytes_per_rank": state_bytes(state),
        "out": None,
    }
    if is_main:
        out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
        os.makedirs(out, exist_ok=True)
        summary["out"] = os.path.abspath(out)
        torch.save(full, os.path.join(out, "params.pt"))
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(
                {"args": vars(args), "steps": history, "val": val_history, "summary": summary},
                f,
                indent=1,
            )
        plot(history, val_history, os.path.join(out, "loss.png"))
        print(json.dumps(summary), flush=True)
    if world > 1:
        dist.barrier()
        if owns_group:
            dist.destroy_process_group()
    return summary


def plot(history, val_history, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8, label="train")
    ax.plot(
        [v["step"] for v in val_history],
        [v["val_loss"] for v in val_history],
        "o-",
        label="validation",
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
