"""Composed chains against the torch code a user writes for the same math (issue 29).

DESIGN.md section 4: "Composition is measured, not only the aliases: a chain wrapped in
``multi_steps``, ``apply_if_finite``, ``masked``, ``ema_params``, or written from primitives,
against the torch code a user writes for the same math." bench_engine.py measures the one chain
the fused path recognises (clip + adamw); this script measures what is composed around it.

The problem is bench_engine's (its helpers are imported, not copied): the GPT-like tree of
13,650,176 float32 parameters in 122 leaves (``gpt_shapes``, ``make_problem``: matrices ~0.02
randn, norms 1, biases 0; gradients ~1e-2 randn), ``torch.set_num_threads(--threads)`` (default
1). ``--tree conv``: ResNet-18's parameters instead (``conv_shapes``: 11,689,512 in 62 leaves),
its 4-d convolution weights and their gradients ``channels_last``, as convolutional training
keeps them (the torch code's parameters and gradients too); ``--tree small``: the small-leaf
tree. Hyper-parameters everywhere: clip max_norm 1.0, lr 1e-3, betas (0.9, 0.999), eps 1e-8,
weight decay 0.1. Before each timed unit every system gets freshly written gradients, untimed
(``p.grad.copy_(g)`` for torch.optim, a fresh clone of the tree for functional_train, which
``donate=True`` may write into). Systems are interleaved round by round in one process
(bench_engine's ``run_rounds``: ``--warmup`` untimed rounds, then ``--rounds`` timed ones, every
system once per round, in order).

Rows (``--rows`` picks a subset by name), one chain each, ``clip = clip_by_global_norm(1.0)``:

  adamw            chain(clip, adamw(1e-3, weight_decay=0.1))
                   torch code: clip_grad_norm_(foreach) + AdamW(foreach)
  primitives       chain(clip, scale_by_adam(0.9, 0.999, 1e-8), add_decayed_weights(0.1),
                   scale_by_learning_rate(1e-3)): AdamW written from primitives
                   torch code: clip_grad_norm_(foreach) + AdamW(foreach)
  multi_steps      multi_steps(chain(clip, adamw), every_k=4); one timed unit is one cycle of
                   4 calls, each with its own fresh gradient (4 different gradient trees)
                   torch code: the first micro-gradient is in .grad (untimed, as backward writes
                   it), the other 3 are added with torch._foreach_add_ (autograd's accumulation,
                   timed here because functional_train's accumulation is), then
                   torch._foreach_div_(grads, 4) (the mean, as multi_steps feeds its inner
                   transform the sum divided by every_k), clip, AdamW(foreach); with --dtype
                   bfloat16 / float16 the sum and mean in float32 buffers kept from unit
                   to unit (multi_steps' accumulators are float32), copied into .grad
  multi_steps_groups partition({"decay": multi_steps(chain(clip, adamw(1e-3, weight_decay=0.1)),
                   every_k=4), "no_decay": the same with weight_decay=0.0}, labels from
                   ft.decay_mask): gradient accumulation per parameter group, each group
                   clipped by its own norm; a unit is a cycle of 4 calls
                   torch code: multi_steps' accumulation, then partition_clips' step
  apply_if_finite  apply_if_finite(chain(clip, adamw), max_consecutive_errors=5)
                   torch code: total = clip_grad_norm_(foreach); ``if torch.isfinite(total):
                   opt.step()`` (AdamW foreach; a host read of the norm, as users write it).
                   All gradients are finite here: this times the guard's cost on the hot path
                   (functional_train runs the inner step and selects with torch.where, no host
                   read)
  ema_params       chain(clip, adamw, ema_params(0.999))
                   torch code: clip + AdamW(foreach) step, then the EMA of the parameters: the
                   first update copies them (``e.copy_(p)`` per leaf, as ema_params' first
                   update does), later ones torch._foreach_lerp_(ema, params, 1 - 0.999). The check
                   compares the EMA too (ft.averaged_params(state))
  masked           chain(clip, adamw(1e-3, weight_decay=0.1, mask=ft.decay_mask)): decay only
                   the weight matrices (not embed, norms, biases)
                   torch code: clip + AdamW(foreach) with two parameter groups, weight_decay 0.1
                   for the leaves where ft.decay_mask(params) is True and 0 for the others
  masked_primitives chain(clip, scale_by_adam(0.9, 0.999, 1e-8), masked(add_decayed_weights(0.1),
                   ft.decay_mask), scale_by_learning_rate(1e-3)): optax's way of writing it
                   torch code: as masked
  partition        chain(clip, partition({"decay": adamw(1e-3, weight_decay=0.1), "no_decay":
                   adamw(1e-3, weight_decay=0.0)}, labels from ft.decay_mask))
                   torch code: as masked
  partition_clips  partition({"decay": chain(clip, adamw(1e-3, weight_decay=0.1)), "no_decay":
                   chain(clip, adamw(1e-3, weight_decay=0.0))}, labels from ft.decay_mask):
                   each group clipped by its own norm
                   torch code: clip_grad_norm_(foreach) of each parameter group, then AdamW
                   (foreach) with the two groups of masked
  schedule         chain(clip, adamw(ft.schedules.warmup_cosine_decay_schedule(0.0, 1e-3,
                   warmup_steps=3, decay_steps=12), weight_decay=0.1))
                   torch code: clip + AdamW(foreach, lr=1e-3) + LambdaLR whose lambda computes the
                   same schedule divided by the peak (in Python floats), sched.step() after each
                   opt.step() (optax counts: the first update uses the schedule at 0, as LambdaLR)
  inject           chain(clip, inject_hyperparams(adamw)(learning_rate=<schedule's>,
                   weight_decay=0.1)): optax's idiom, the learning rate in the state
                   torch code: as schedule
  inject_groups    chain(clip, partition({"decay": inject_hyperparams(adamw)(learning_rate=
                   <schedule's>, weight_decay=0.1), "no_decay": the same with weight_decay=0.0},
                   labels from ft.decay_mask)): what ft.TorchOptimizer makes of two param groups
                   of a clipped adamw, with a scheduler
                   torch code: the two groups of masked, with schedule's LambdaLR
  loss_scale       dynamic_loss_scale(chain(clip, adamw)): the gradients as given are the scaled
                   ones (scale 2**16, GradScaler's default; every step finite)
                   torch code: torch.amp.GradScaler(init_scale=2**16): scaler.unscale_(opt),
                   clip, scaler.step(opt) (AdamW(foreach); a host read of its inf flag),
                   scaler.update()
  zero_nans        chain(zero_nans(), clip, adamw): NaNs in the gradients zeroed first (none
                   here: the math is then the plain step's), the per-leaf flags kept
                   torch code: torch.nan_to_num_(g, nan=0.0, posinf=inf, neginf=-inf) per
                   gradient (no flags), clip, AdamW(foreach) step
  sgd_primitives   chain(clip, add_decayed_weights(0.1), trace(0.9, nesterov=True),
                   scale_by_learning_rate(1e-2)): SGD with Nesterov momentum and (coupled)
                   weight decay written from primitives, in torch's order (the decay before
                   the momentum)
                   torch code: clip_grad_norm_(foreach) + SGD(lr=1e-2, momentum=0.9,
                   nesterov=True, weight_decay=0.1, foreach) (its first step's buffer is the
                   gradient itself, as trace's from zeros)
  lamb             chain(clip, lamb(1e-3, 0.9, 0.999, 1e-6, weight_decay=0.1)): a per-leaf trust
                   ratio from per-leaf norms, between two elementwise passes
                   torch code: clip + LAMB in torch._foreach operations (TorchCode.lamb_step:
                   Adam's moments, the update with decay, _foreach_norm of the parameters and
                   of the update, the ratios as tensors, _foreach_mul_ and _foreach_add_)

Systems per row:

  (a) base       torch.optim.AdamW(fused=True) + clip_grad_norm_(foreach=True): the plain step,
                 the fastest thing a torch user picks, the same in every row (so the ratio
                 column ``x base`` is on one scale across rows); only the multi_steps rows'
                 baseline accumulates and averages the 4 gradients first like (b) (otherwise it
                 would time a quarter of the gradients). Its parameters are compared with (b)'s
                 only where its math is the row's (not in masked, schedule, inject, loss_scale
                 and lamb: "other")
  (b) torch      the torch code for the row's math (above); the reference of the check
  (c) donate     params, state = ft.step(tx, grads, state, params, donate=True)
  (d) pure       params, state = ft.step(tx, grads, state, params) (donate=False; nothing is
                 modified, the loop drops the old trees)
  (e) eager      updates, state = tx.update(grads, state, params);
                 params = ft.apply_updates(params, updates)
  (f) compiled   with --compile: torch.compile(lambda g, s, p: ft.step(tx, g, s, p),
                 fullgraph=True), pure (every round runs the systems in an order of its
                 own: bench_engine.run_rounds); its ratio to (d), the eager step of its kind, and
                 its warm-up units (the first one compiles) and the number of graphs inductor
                 compiled for it over all rounds (1: no recompile) are printed below the table;
  (g) compiled   with --compile: the same with donate=True, after (f); its ratio to (c) and
      donated    its warm-up units below the table. torch._dynamo.reset() before each row;
                 ``--cold-cache`` gives the process an empty inductor cache (a temporary
                 TORCHINDUCTOR_CACHE_DIR; the
                 process's later rows reuse what its earlier rows compiled: the dynamo reset
                 leaves inductor's caches, and the kernels of ft's fused step are shared). A
                 system that raises is dropped with a note (fullgraph=True refuses graph breaks)

Columns: ``ms/unit`` the median ms per unit over the timed rounds, ``min ms`` the minimum,
``x base`` and ``x torch`` the ratio of the median to (a)'s and to (b)'s, ``faults`` the median
minor page faults during one unit (see bench_engine), ``MiB`` the peak extra memory of one unit
(below), ``rel diff`` the largest difference of the final parameters from (b)'s, relative to the
leaf's largest |value| (max over leaves of max|p - p_torch| / max|p_torch|, the EMA included in
the ema_params row; after the memory unit every system has taken the same steps with the same
gradients); ``other`` where the system's math is not the row's (the baseline in masked,
schedule, inject, loss_scale and lamb). A row is flagged FAILED (and the script exits 1) when any
system's relative difference exceeds 1e-5 or its results (or the torch code's) are not
finite; in float32, a system further than that from the torch code is judged instead against
the torch code replayed in float64 for as many steps (untimed), and the line gives both and
the torch code's own difference from the replay (on a leaf that starts at zero the foreach
code's rounding is a large share of the leaf's largest value: ResNet-18's normalisation
weights under SGD, about 2e-5, where functional_train's results are within 2e-7 of the
replay). The replay excuses nothing: in the ``multi_steps`` rows every float32 system, the
torch code included, is about 2.5e-5 from it on the small-leaf tree (float32 sums of four
gradients, read by Adam's normalised step; not looked into further), so a system off the
torch code fails there as before. ``--dtype
bfloat16`` casts the parameters and gradients (made in float32) to bfloat16 for every system,
torch's included; the bound is then 4 units in bfloat16's last place (the generated kernels
round each result once, torch's foreach code every operation). Not float16: torch.optim's
AdamW keeps float16 moments, its eps (1e-8) is 0 there, and its parameters go to inf on these
gradients.

Peak extra memory (``MiB``): one more unit per system after the timed rounds, untimed. On
CUDA, ``torch.cuda.max_memory_allocated`` minus the allocated bytes before it. On CPU, the unit
runs under ``torch.autograd.profiler.profile(profile_memory=True)``: the profiler records every
allocation and free of the CPU allocator as a ``[memory]`` event with its size (the per-operator
sums of ``function_events`` hide allocations freed within an operator, so the raw kineto events
are read); their running sum in time order, maximum, is the peak of (allocated - freed) during the
unit. It counts tensors of the torch CPU allocator, not Python objects; for a pure step it
includes the new params and state it returns (the old ones are freed after the unit when the loop
drops them) -- except where functional_train's pure fused step takes its results from its buffer
pool (functional_train/engine/pool.py: on CPU it keeps up to two sets of result buffers per plan,
one of them the set the loop dropped, as a caching allocator would), which allocates nothing
during the step: its 0.0 means no allocation in the step, not that no memory is held (the pool
holds about one more set of params and moments, 156 MiB here, between steps). On CUDA the
caching allocator's reuse is not counted either. "n/a" where the profiler's events cannot be
read.

Part B (--dtensor): FSDP2-style DTensors on 2 gloo ranks (spawned on a free port of 127.0.0.1
with bench_engine's helper, or torchrun's ranks), 1 thread per rank, the GPT-like tree
(``--tree small``: bench_engine's small-leaf tree, 534,336 parameters in 242 leaves), every
parameter and gradient leaf ``distribute_tensor(t, mesh, [Shard(0)])`` on a 1-D "dp" mesh,
the parameters ``nn.Parameter``s holding them (as FSDP2's ``fully_shard`` makes a model's;
plain DTensors before session 70, which hid the cost of detaching them each step),
functional_train given ``mesh=ft.Mesh(device_mesh, data_axis="dp")``. The rows as above; the
baseline is (b), the torch code for the row's math with AdamW(foreach) on nn.Parameter(DTensor)
(torch's fused AdamW is not the baseline there, as in bench_engine's Part B), then (c), (d), (e).
A unit's time is the slowest rank's; rank 0 prints. No compiled system in Part B.

    python benchmarks/bench_compose.py [--rounds 7] [--warmup 2] [--threads 1] [--rows a,b]
                                       [--device cpu|cuda] [--compile [--cold-cache]]
                                       [--dtype float32|bfloat16] [--tree gpt|small|conv]
    python benchmarks/bench_compose.py --dtensor [--rounds 7] [--warmup 2] [--rows a,b]
                                       [--tree gpt|small]
    python benchmarks/bench_compose.py --host [--rounds 9] [--rows a,b]

(Run with ``PYTHONPATH`` naming the checkout whose functional_train is to be measured; the header
prints where it was imported from.)

The measured numbers are in the README's "Composed chains" section (kept current there; the
tables this docstring held described the engine before its elementwise specs).

``--host`` instead measures each system's host time per leaf: trees of 122 and 244 leaves of 4
elements, ``(t(244) - t(122)) / 122`` per row and system.
"""

import argparse
import math
import os
import shlex
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine as be  # noqa: E402 - benchmarks/ is not a package
import functional_train as ft  # noqa: E402

LR, WD, MAX_NORM = be.LR, be.WD, be.MAX_NORM
BETAS, EPS = (0.9, 0.999), 1e-8
EVERY_K = 4
EMA_DECAY = 0.999
LAMB_EPS = 1e-6  # lamb's default (optax's, Colossal-AI's)
MAX_ERRORS = 5
LOSS_SCALE = 2.0**16  # GradScaler's default
WARMUP_STEPS, DECAY_STEPS = 3, 12
SGD_LR, MOMENTUM = 1e-2, 0.9
ROWS = [
    "adamw",
    "primitives",
    "multi_steps",
    "multi_steps_groups",
    "apply_if_finite",
    "ema_params",
    "masked",
    "masked_primitives",
    "partition",
    "partition_clips",
    "schedule",
    "inject",
    "inject_groups",
    "loss_scale",
    "zero_nans",
    "sgd_primitives",
    "lamb",
]
# the math of two param groups
MASKED_ROWS = (
    "masked",
    "masked_primitives",
    "partition",
    "partition_clips",
    "multi_steps_groups",
    "inject_groups",
)
# the rows whose unit is a cycle of EVERY_K calls
CYCLE_ROWS = ("multi_steps", "multi_steps_groups")
# the rows whose groups are each clipped by their own norm
GROUP_CLIP_ROWS = ("partition_clips", "multi_steps_groups")
# the baseline (a) is not the row's math
OTHER_MATH_ROWS = (*MASKED_ROWS, "schedule", "inject", "loss_scale", "lamb", "sgd_primitives")
RTOL = 1e-5


def clip():
    return ft.clip_by_global_norm(MAX_NORM)


def schedule_lambda(t):
    """warmup_cosine_decay_schedule(0.0, LR, WARMUP_STEPS, DECAY_STEPS) / LR, in floats."""
    if t < WARMUP_STEPS:
        return t / WARMUP_STEPS
    c = min(t - WARMUP_STEPS, DECAY_STEPS - WARMUP_STEPS)
    return 0.5 * (1.0 + math.cos(math.pi * c / (DECAY_STEPS - WARMUP_STEPS)))


def make_tx(row):
    if row == "adamw":
        return ft.chain(clip(), ft.adamw(LR, weight_decay=WD))
    if row == "primitives":
        return ft.chain(
            clip(),
            ft.scale_by_adam(*BETAS, EPS),
            ft.add_decayed_weights(WD),
            ft.scale_by_learning_rate(LR),
        )
    if row == "multi_steps":
        return ft.multi_steps(ft.chain(clip(), ft.adamw(LR, weight_decay=WD)), every_k=EVERY_K)
    if row == "apply_if_finite":
        return ft.apply_if_finite(
            ft.chain(clip(), ft.adamw(LR, weight_decay=WD)), max_consecutive_errors=MAX_ERRORS
        )
    if row == "ema_params":
        return ft.chain(clip(), ft.adamw(LR, weight_decay=WD), ft.ema_params(EMA_DECAY))
    if row == "masked":
        return ft.chain(clip(), ft.adamw(LR, weight_decay=WD, mask=ft.decay_mask))
    if row == "masked_primitives":
        return ft.chain(
            clip(),
            ft.scale_by_adam(*BETAS, EPS),
            ft.masked(ft.add_decayed_weights(WD), ft.decay_mask),
            ft.scale_by_learning_rate(LR),
        )
    if row in ("partition", "partition_clips", "multi_steps_groups"):

        def labels(params):
            return {k: "decay" if v else "no_decay" for k, v in ft.decay_mask(params).items()}

        def group(wd):
            opt = ft.adamw(LR, *BETAS, EPS, weight_decay=wd)
            if row == "multi_steps_groups":
                return ft.multi_steps(ft.chain(clip(), opt), every_k=EVERY_K)
            return ft.chain(clip(), opt) if row == "partition_clips" else opt

        groups = ft.partition({"decay": group(WD), "no_decay": group(0.0)}, labels)
        return ft.chain(clip(), groups) if row == "partition" else groups
    if row == "schedule":
        sched = ft.schedules.warmup_cosine_decay_schedule(0.0, LR, WARMUP_STEPS, DECAY_STEPS)
        return ft.chain(clip(), ft.adamw(sched, weight_decay=WD))
    if row == "inject":  # (optax's idiom: the schedule's value in the state, at every update)
        sched = ft.schedules.warmup_cosine_decay_schedule(0.0, LR, WARMUP_STEPS, DECAY_STEPS)
        return ft.chain(
            clip(), ft.inject_hyperparams(ft.adamw)(learning_rate=sched, weight_decay=WD)
        )
    if row == "inject_groups":  # (TorchOptimizer's param groups with a scheduler)
        sched = ft.schedules.warmup_cosine_decay_schedule(0.0, LR, WARMUP_STEPS, DECAY_STEPS)

        def labels(params):
            return {k: "decay" if v else "no_decay" for k, v in ft.decay_mask(params).items()}

        def group(wd):
            return ft.inject_hyperparams(ft.adamw)(learning_rate=sched, weight_decay=wd)

        return ft.chain(clip(), ft.partition({"decay": group(WD), "no_decay": group(0.0)}, labels))
    if row == "loss_scale":
        return ft.dynamic_loss_scale(
            ft.chain(clip(), ft.adamw(LR, weight_decay=WD)), init_scale=LOSS_SCALE
        )
    if row == "zero_nans":
        return ft.chain(ft.zero_nans(), clip(), ft.adamw(LR, weight_decay=WD))
    if row == "lamb":
        return ft.chain(clip(), ft.lamb(LR, *BETAS, LAMB_EPS, weight_decay=WD))
    if row == "sgd_primitives":
        return ft.chain(
            clip(),
            ft.add_decayed_weights(WD),
            ft.trace(MOMENTUM, nesterov=True),
            ft.scale_by_learning_rate(SGD_LR),
        )
    raise ValueError(f"unknown row {row!r}; rows: {', '.join(ROWS)}")


def ref_name(row):
    if row == "loss_scale":
        return "(b) torch code, GradScaler + AdamW(foreach)"
    if row == "sgd_primitives":
        return "(b) torch code, SGD(nesterov, foreach)"
    return "(b) torch code, " + ("LAMB (foreach)" if row == "lamb" else "AdamW(foreach)")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- systems ----------------------------------------------------------------------------------
class TorchCode:
    """The torch code for a row's math on nn.Parameters (see the module docstring)."""

    def __init__(self, name, row, params0, grads, device, *, fused, plain=False):
        self.name, self.device = name, device
        self.row = "plain" if plain else row
        self.k = EVERY_K if row in CYCLE_ROWS else 1  # the baseline accumulates too there
        self.acc = None  # float32 accumulators of half-precision gradients (multi_steps)
        self.keys = list(params0)
        self.ps = [torch.nn.Parameter(v.clone()) for v in params0.values()]
        self.gsrc = [list(g.values()) for g in grads[: self.k]]
        for p, g in zip(self.ps, self.gsrc[0]):
            p.grad = g.clone()
        kind = {"fused": True} if fused else {"foreach": True}
        groups = self.ps
        if self.row in MASKED_ROWS:
            mask = ft.decay_mask(params0)  # a dict of bools, params0's keys
            groups = [
                {"params": [p for k, p in zip(self.keys, self.ps) if mask[k]]},
                {
                    "params": [p for k, p in zip(self.keys, self.ps) if not mask[k]],
                    "weight_decay": 0.0,
                },
            ]
        if self.row == "sgd_primitives":
            self.opt: torch.optim.Optimizer = torch.optim.SGD(
                groups, lr=SGD_LR, momentum=MOMENTUM, nesterov=True, weight_decay=WD, **kind
            )
        else:
            self.opt = torch.optim.AdamW(
                groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kind
            )
        self.units = 0  # (steps taken: a float64 replay takes as many, see exact_check)
        self.scaler = None
        if self.row == "loss_scale":
            self.scaler = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE)
            self.scaler.scale(torch.ones((), device=device))  # (its scale made, as a loop's)
        self.sched = None
        if self.row in ("schedule", "inject", "inject_groups"):
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule_lambda)
        self.ema = None
        if self.row == "ema_params":
            self.ema = [p.detach().clone() for p in self.ps]
            self.ema_steps = 0
        if self.row == "lamb":
            # (the moments of half-precision parameters in float32, as lamb keeps them: in
            # float16, v = (1 - b2) g^2 underflows and a leaf's update blows up)
            half = self.ps[0].dtype in (torch.bfloat16, torch.float16)
            kw = {"dtype": torch.float32} if half else {}
            self.m = [torch.zeros_like(p.detach(), **kw) for p in self.ps]
            self.v = [torch.zeros_like(p.detach(), **kw) for p in self.ps]
            self.g32 = [torch.empty_like(p.detach(), **kw) for p in self.ps] if half else None
            self.t = 0

    def prepare(self):
        with torch.no_grad():
            for p, g in zip(self.ps, self.gsrc[0]):
                p.grad.copy_(g)
        sync(self.device)

    def step(self):
        ps = self.ps
        if self.k > 1:  # micro-gradients 2..k accumulate in .grad, then the mean
            gs = [p.grad for p in ps]
            if gs[0].dtype in (torch.bfloat16, torch.float16):
                # (in float32, as multi_steps' accumulators: half-precision sums of 4 random
                # gradients lose the bits that decide Adam's direction where they nearly
                # cancel, and the parameters drift apart by the learning rate per step)
                if self.acc is None:  # (float32 buffers kept from unit to unit)
                    self.acc = [torch.empty_like(g, dtype=torch.float32) for g in gs]
                acc = self.acc
                torch._foreach_copy_(acc, gs)
                for more in self.gsrc[1:]:
                    torch._foreach_add_(acc, more)
                torch._foreach_div_(acc, float(self.k))
                torch._foreach_copy_(gs, acc)
            else:
                for more in self.gsrc[1:]:
                    torch._foreach_add_(gs, more)
                torch._foreach_div_(gs, float(self.k))
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.row == "zero_nans":
            with torch.no_grad():
                for p in ps:
                    torch.nan_to_num_(p.grad, nan=0.0, posinf=math.inf, neginf=-math.inf)
        if self.row in GROUP_CLIP_ROWS:  # (each group by its own norm)
            for group in self.opt.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], MAX_NORM, foreach=True)
            total = None
        else:
            total = torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True)
        if self.row == "lamb":
            self.lamb_step()
        elif self.row == "apply_if_finite":
            if torch.isfinite(total):
                self.opt.step()
        elif self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        if self.sched is not None:
            self.sched.step()
        if self.ema is not None:
            with torch.no_grad():
                cur = [p.detach() for p in ps]
                if self.ema_steps == 0:  # once (copy_ per leaf: DTensor has no _foreach_copy_)
                    for e, c in zip(self.ema, cur):
                        e.copy_(c)
                else:
                    torch._foreach_lerp_(self.ema, cur, 1.0 - EMA_DECAY)
            self.ema_steps += 1
        self.units += 1
        sync(self.device)

    def lamb_step(self):
        """LAMB in torch's foreach operations, as a torch.optim-style implementation writes
        it: Adam's moments, ``r = m_hat / (sqrt(v_hat) + eps) + wd * p``, the per-leaf norms of
        the parameters and of ``r``, ``ratio = ||p|| / ||r||`` (1 where either is 0), ``p -=
        lr * ratio * r``; the ratios stay tensors (no host read)."""
        b1, b2 = BETAS
        self.t += 1
        with torch.no_grad():
            gs = [p.grad for p in self.ps]
            ps = [p.detach() for p in self.ps]
            if self.g32 is not None:  # (half-precision gradients, read in float32)
                torch._foreach_copy_(self.g32, gs)
                gs = self.g32
            torch._foreach_lerp_(self.m, gs, 1.0 - b1)
            torch._foreach_mul_(self.v, b2)
            torch._foreach_addcmul_(self.v, gs, gs, 1.0 - b2)
            den = torch._foreach_div(self.v, 1.0 - b2**self.t)
            torch._foreach_sqrt_(den)
            torch._foreach_add_(den, LAMB_EPS)
            r = torch._foreach_div(self.m, 1.0 - b1**self.t)
            torch._foreach_div_(r, den)
            del den
            torch._foreach_add_(r, ps, alpha=WD)
            pn = torch.stack(torch._foreach_norm(ps))
            rn = torch.stack(torch._foreach_norm(r))
            ratio = torch.where((pn == 0) | (rn == 0), torch.ones_like(pn), pn / rn)
            torch._foreach_mul_(r, list((ratio * -LR).unbind()))
            torch._foreach_add_(ps, r)

    def params(self):
        return [be.local(p.detach()) for p in self.ps]

    def averaged(self):
        return None if self.ema is None else [be.local(e) for e in self.ema]


class FtLoop(be.PureLoop):
    """A functional_train step run as a training loop, ``params, state = fn(grads, state,
    params)``, once per gradient tree of the unit (k of them for multi_steps). ``parameters``:
    the parameters are ``nn.Parameter``s, as a model's (FSDP2's ``fully_shard`` makes each one
    an ``nn.Parameter`` holding a DTensor)."""

    def __init__(self, name, fn, tx, params0, grads, device, k, parameters=False):
        super().__init__(name, fn, tx, params0, grads[:k])
        if parameters:
            self.p = {n: torch.nn.Parameter(v.clone()) for n, v in params0.items()}
            self.s = tx.init(self.p)
        self.device = device

    def fresh_gradients(self):
        return [be.clone_tree(g) for g in self.gsrc]

    def prepare(self):
        super().prepare()
        sync(self.device)

    def step(self):
        gs, self.g = self.g, None
        for g in gs:  # (held in self.spent until prepare: see PureLoop)
            self.p, self.s = self.fn(g, self.s, self.p)
        self.spent.append(gs)
        sync(self.device)

    def averaged(self):
        try:
            ema = ft.averaged_params(self.s)
        except ValueError:
            return None
        return [be.local(v) for v in ema.values()]


def ft_systems(row, tx, params0, grads, device, mesh=None, compiled=False, parameters=False):
    k = EVERY_K if row in CYCLE_ROWS else 1

    def eager(g, s, p):
        u, s = tx.update(g, s, p, mesh=mesh)
        return ft.apply_updates(p, u), s

    systems = [
        FtLoop(
            "(c) ft.step(donate=True)",
            lambda g, s, p: ft.step(tx, g, s, p, mesh=mesh, donate=True),
            tx,
            params0,
            grads,
            device,
            k,
            parameters,
        ),
        FtLoop(
            "(d) ft.step(donate=False), pure",
            lambda g, s, p: ft.step(tx, g, s, p, mesh=mesh, donate=False),
            tx,
            params0,
            grads,
            device,
            k,
            parameters,
        ),
        FtLoop(
            "(e) eager tx.update + apply_updates", eager, tx, params0, grads, device, k, parameters
        ),
    ]
    if compiled:
        from torch._dynamo.testing import CompileCounterWithBackend

        torch._dynamo.reset()  # each row compiles its own step from scratch
        # (inductor, counting the graphs it is handed: one per system is no recompile)
        cp, cd = CompileCounterWithBackend("inductor"), CompileCounterWithBackend("inductor")
        fn = torch.compile(lambda g, s, p: ft.step(tx, g, s, p), backend=cp, fullgraph=True)
        fd = torch.compile(
            lambda g, s, p: ft.step(tx, g, s, p, donate=True), backend=cd, fullgraph=True
        )
        systems[:0] = [
            FtLoop(COMPILED_PURE, fn, tx, params0, grads, device, k),
            FtLoop(COMPILED_DONATED, fd, tx, params0, grads, device, k),
        ]
        systems[0].compiles, systems[1].compiles = cp, cd
    return systems


COMPILED_PURE = "(f) compile(ft.step, fullgraph), pure"
COMPILED_DONATED = "(g) compile(ft.step, fullgraph), donated"
# each compiled system and the eager step of its kind, its denominator
COMPILED_OF = {
    COMPILED_PURE: "(d) ft.step(donate=False), pure",
    COMPILED_DONATED: "(c) ft.step(donate=True)",
}


# -- measurements -----------------------------------------------------------------------------
def peak_extra_bytes(fn, device):
    """Runs ``fn()`` once; returns the peak of (allocated - freed) bytes during it, or None."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.autograd.profiler import profile

    try:
        prof = profile(profile_memory=True)
        prof.__enter__()
    except Exception:  # noqa: BLE001 - no profiler here: time the unit without it
        fn()
        return None
    try:
        fn()
    finally:
        prof.__exit__(None, None, None)
    try:
        events = [e for e in prof.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
    except Exception:  # noqa: BLE001 - private profiler API changed: report n/a
        return None
    cur = peak = 0
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU:
            cur += e.nbytes()
            peak = max(peak, cur)
    return peak


def memory_unit(systems, device, reduce_max=None):
    """One more unit per system, untimed, its peak extra memory measured: {name: MiB or None}."""
    out = {}
    for s in systems:
        s.prepare()
        b = peak_extra_bytes(s.step, device)
        if reduce_max is not None:
            b = reduce_max(-1.0 if b is None else float(b))
            b = None if b < 0 else b
        out[s.name] = None if b is None else b / 2**20
    return out


def rel_diff(xs, refs):
    """max over leaves of max|x - ref| / max|ref| (inf if x or ref is not finite)."""
    worst = 0.0
    for x, r in zip(xs, refs):
        if x.numel() == 0:
            continue
        x, r = x.double(), r.double()
        if not bool(torch.isfinite(x).all()) or not bool(torch.isfinite(r).all()):
            return math.inf
        scale = float(r.abs().max()) or 1.0
        worst = max(worst, float((x - r).abs().max()) / scale)
    return worst


def checks(systems, ref, same_math, reduce_max=None):
    """{name: relative difference from ref's params (and EMA), or None where not comparable}."""
    p_ref, e_ref = ref.params(), ref.averaged()
    out = {}
    for s in systems:
        if s is ref:
            out[s.name] = 0.0
            continue
        if not same_math(s):
            out[s.name] = None
            continue
        d = rel_diff(s.params(), p_ref)
        e = s.averaged()
        if e_ref is not None and e is not None:
            d = max(d, rel_diff(e, e_ref))
        if reduce_max is not None:
            d = reduce_max(d)
        out[s.name] = d
    return out


def exact_check(row, ref, systems, params0, grads, device, diffs, rtol):
    """Where a float32 system is further than ``rtol`` from the torch code, the torch code's
    own float32 rounding may be what differs (a leaf near zero, where each foreach operation's
    rounding is a large share of the leaf's largest value): the torch code replayed in float64
    for as many units as it took (untimed), and ``{name: (difference from that replay, the
    torch code's own)}`` for those systems; ``{}`` where none is further than ``rtol``."""
    far = [n for n, d in diffs.items() if d is not None and math.isfinite(d) and d > rtol]
    if not far:
        return {}
    exact = TorchCode(
        "float64 replay",
        row,
        {k: v.double() for k, v in params0.items()},
        [{k: v.double() for k, v in g.items()} for g in grads],
        device,
        fused=False,
    )
    for _ in range(ref.units):
        exact.prepare()
        exact.step()
    judged = [s for s in systems if s.name in far]
    off = checks([*judged, ref], exact, lambda s: True)
    return {s.name: (off[s.name], off[ref.name]) for s in judged}


def row_table(
    title, times, faults, mem, diffs, base, torch_name, warm, compiles, rtol=RTOL, exact=None
):
    lines = [
        title,
        f"  {'system':<37s} {'ms/unit':>7s} {'min ms':>7s} {'x base':>6s} {'x torch':>7s} "
        f"{'faults':>6s} {'MiB':>6s}  rel diff",
    ]
    t_base = statistics.median(times[base]) if base in times else math.nan
    t_torch = statistics.median(times[torch_name]) if torch_name in times else math.nan
    failed = []
    for name, ts in times.items():
        med = statistics.median(ts)
        d = diffs.get(name, math.nan)
        if d is None:
            ds = "other"
        else:
            ds = f"{d:.1e}"
            d64, own = (exact or {}).get(name, (math.nan, math.nan))
            if not math.isnan(d64):  # (judged against the float64 replay: see exact_check)
                ds += f" (float64 replay: {d64:.1e}; the torch code's own: {own:.1e})"
                d = d64
            if not d <= rtol:
                ds += "   FAILED" if math.isfinite(d) else "   NOT FINITE"
                failed.append(name)
        m = mem.get(name)
        ms = "n/a" if m is None else f"{m:.1f}"
        lines.append(
            f"  {name:<37s} {med * 1e3:7.2f} {min(ts) * 1e3:7.2f} {med / t_base:6.2f} "
            f"{med / t_torch:7.2f} {statistics.median(faults[name]):6.0f} {ms:>6s}  {ds}"
        )
    for name, eager in COMPILED_OF.items():
        if name in times and eager in times:
            ratio = statistics.median(times[name]) / statistics.median(times[eager])
            first = ", ".join(f"{t:.2f} s" for t in warm.get(name, ()))
            lines.append(
                f"  {name[:3]} x {eager[:3]} (compiled x eager of its kind): {ratio:.2f}; "
                f"warm-up units (the first compiles): {first}; graphs compiled: "
                f"{compiles.get(name, '?')}"
            )
    if failed:
        lines.append(
            f"  FAILED: {', '.join(failed)} disagree with the torch code (and with its float64 "
            "replay, where that was run)"
        )
    return "\n".join(lines), not failed


# (not float16: torch.optim's AdamW keeps float16 moments, its eps 1e-8 is 0 there, and on
# these gradients its parameters go to inf, so there is no torch code to compare with)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def problem(shapes, row, device, dtype=torch.float32, conv=False):
    """The row's parameters and gradient trees (``EVERY_K`` of them for multi_steps), made in
    float32 and cast to ``dtype``; ``conv``: their 4-d leaves ``channels_last``."""
    params0, g0 = be.make_problem(shapes, seed=0)
    grads = [g0]
    if row in CYCLE_ROWS:
        grads += [be.make_problem(shapes, seed=i)[1] for i in range(1, EVERY_K)]
    params0 = {k: v.to(device, dtype) for k, v in params0.items()}
    grads = [{k: v.to(device, dtype) for k, v in g.items()} for g in grads]
    if conv:
        params0, grads = be.channels_last(params0), [be.channels_last(g) for g in grads]
    return params0, grads


def tolerance(dtype) -> float:
    """The agreement every system must reach with the row's torch code, relative to the
    largest parameter: ``RTOL`` in float32; in bfloat16 4 units in the last place (the
    generated kernels round each result once, torch's foreach code every operation)."""
    return RTOL if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


# -- host time per leaf -----------------------------------------------------------------------
def tiny_shapes(n):
    """``n`` leaves of 4 elements (a 2 x 2 weight, so decay_mask decays it): the step's time is
    its host work."""
    return {f"layer{i}.weight": (2, 2) for i in range(n)}


def part_host(args, rows):
    """Per row and system, the host time per leaf: the median unit on trees of 122 and 244
    leaves of 4 elements, ``(t(244) - t(122)) / 122`` (what one more leaf costs, the per-step
    constant removed)."""
    device = torch.device(args.device)
    torch.set_num_threads(1)
    sizes = (122, 244)
    print(
        f"Host time per leaf (--host): trees of {sizes[0]} and {sizes[1]} leaves of 4 "
        f"elements on {device}, 1 thread; us per leaf = (t({sizes[1]}) - t({sizes[0]})) / "
        f"{sizes[1] - sizes[0]} (a multi_steps unit is 4 calls)"
    )
    for row in rows:
        per: dict = {}
        for n in sizes:
            params0, grads = problem(tiny_shapes(n), row, device)
            tx = make_tx(row)
            base = TorchCode(
                "(a) AdamW(fused) + clip [base]",
                row,
                params0,
                grads,
                device,
                fused=True,
                plain=True,
            )
            ref = TorchCode(ref_name(row), row, params0, grads, device, fused=False)
            systems = [base, ref] + ft_systems(row, tx, params0, grads, device)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*donated buffers.*")
                times, _, _ = be.run_rounds(systems, args.rounds, args.warmup)
            for name, ts in times.items():
                per.setdefault(name, {})[n] = statistics.median(ts)
        print(f"\nrow {row}: {describe(row)}")
        print(f"  {'system':<40} {'us/leaf':>8} {'ms at ' + str(sizes[1]):>10}")
        for name, t in per.items():
            us = (t[sizes[1]] - t[sizes[0]]) / (sizes[1] - sizes[0]) * 1e6
            print(f"  {name:<40} {us:8.2f} {t[sizes[1]] * 1e3:10.2f}")


# -- Part A -----------------------------------------------------------------------------------
def part_a(args, rows):
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    shapes, name = {
        "gpt": (be.gpt_shapes(), "GPT-like tree"),
        "small": (be.small_shapes(), "small-leaf tree"),
        "conv": (be.conv_shapes(), "ResNet-18 tree (channels_last convolutions)"),
    }[args.tree]
    print(
        f"Part A: plain tensors on {device}, one process, {torch.get_num_threads()} thread(s); "
        f"{name} {be.n_params(shapes):,} {args.dtype} params in {len(shapes)} leaves; "
        f"every system within {tolerance(dtype):.1e} of the torch code (relative to the "
        f"largest parameter)"
    )
    ok = True
    for row in rows:
        params0, grads = problem(shapes, row, device, dtype, conv=args.tree == "conv")
        tx = make_tx(row)
        base = TorchCode(
            "(a) AdamW(fused) + clip [base]", row, params0, grads, device, fused=True, plain=True
        )
        ref = TorchCode(ref_name(row), row, params0, grads, device, fused=False)
        fts = ft_systems(row, tx, params0, grads, device, compiled=args.compile)
        systems = [base] + fts[:2] + [ref] + fts[2:] if args.compile else [base, ref] + fts
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*donated buffers.*")
            times, faults, warm = be.run_rounds(systems, args.rounds, args.warmup)
            alive = [s for s in systems if s.name in times]
            mem = memory_unit(alive, device)
        other_math = {base.name} if row in OTHER_MATH_ROWS else set()
        diffs = checks(alive, ref, lambda s: s.name not in other_math)
        exact = (
            exact_check(row, ref, alive, params0, grads, device, diffs, tolerance(dtype))
            if dtype == torch.float32
            else {}
        )
        unit = f" (unit: a cycle of {EVERY_K} calls)" if row in CYCLE_ROWS else ""
        text, good = row_table(
            f"\nrow {row}{unit}: {describe(row)}",
            times,
            faults,
            mem,
            diffs,
            base.name,
            ref.name,
            warm,
            {s.name: s.compiles.frame_count for s in fts if hasattr(s, "compiles")},
            tolerance(dtype),
            exact,
        )
        print(text, flush=True)
        ok &= good
        del systems, alive, base, ref, fts
    return ok


def describe(row):
    return {
        "adamw": "chain(clip, adamw)",
        "primitives": "chain(clip, scale_by_adam, add_decayed_weights, scale_by_learning_rate)",
        "multi_steps": f"multi_steps(chain(clip, adamw), every_k={EVERY_K})",
        "apply_if_finite": f"apply_if_finite(chain(clip, adamw), {MAX_ERRORS})",
        "ema_params": f"chain(clip, adamw, ema_params({EMA_DECAY}))",
        "masked": "chain(clip, adamw(mask=decay_mask))",
        "masked_primitives": "chain(clip, scale_by_adam, masked(add_decayed_weights, "
        "decay_mask), scale_by_learning_rate)",
        "partition": "chain(clip, partition({decay: adamw(wd), no_decay: adamw(0)}))",
        "partition_clips": "partition({decay: chain(clip, adamw(wd)), no_decay: chain(clip, "
        "adamw(0))})",
        "multi_steps_groups": f"partition({{decay: multi_steps(chain(clip, adamw(wd)), "
        f"{EVERY_K}), no_decay: multi_steps(chain(clip, adamw(0)), {EVERY_K})}})",
        "schedule": f"chain(clip, adamw(warmup_cosine_decay_schedule(0, {LR}, {WARMUP_STEPS}, "
        f"{DECAY_STEPS})))",
        "inject": f"chain(clip, inject_hyperparams(adamw)(learning_rate=warmup_cosine_decay_"
        f"schedule(0, {LR}, {WARMUP_STEPS}, {DECAY_STEPS})))",
        "inject_groups": "chain(clip, partition({decay: inject_hyperparams(adamw)(schedule, wd), "
        "no_decay: ...(schedule, 0)}))",
        "loss_scale": "dynamic_loss_scale(chain(clip, adamw), init_scale=2**16)",
        "zero_nans": "chain(zero_nans(), clip, adamw)",
        "lamb": f"chain(clip, lamb({LR}, weight_decay={WD}))",
        "sgd_primitives": f"chain(clip, add_decayed_weights({WD}), trace({MOMENTUM}, "
        f"nesterov=True), scale_by_learning_rate({SGD_LR}))",
    }[row]


# -- Part B -----------------------------------------------------------------------------------
def dtensor_row(row, shapes, dm, fmesh, args, device, reduce_max, log):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    p_full, g_full = problem(shapes, row, device)
    params0 = {k: distribute_tensor(v, dm, [Shard(0)]) for k, v in p_full.items()}
    grads = [{k: distribute_tensor(v, dm, [Shard(0)]) for k, v in g.items()} for g in g_full]
    del p_full, g_full
    tx = make_tx(row)
    ref = TorchCode(
        ref_name(row) + " [base]",
        row,
        params0,
        grads,
        device,
        fused=False,
    )
    systems = [ref] + ft_systems(row, tx, params0, grads, device, mesh=fmesh, parameters=True)
    times, faults, _ = be.run_rounds(
        systems,
        args.rounds,
        args.warmup,
        barrier=dist.barrier,
        reduce_max=reduce_max,
        log=log,
    )
    mem = memory_unit(systems, device, reduce_max=reduce_max)
    diffs = checks(systems, ref, lambda s: True, reduce_max=reduce_max)
    unit = f" (unit: a cycle of {EVERY_K} calls)" if row in CYCLE_ROWS else ""
    text, _ = row_table(
        f"\nrow {row}{unit}: {describe(row)}",
        times,
        faults,
        mem,
        diffs,
        ref.name,
        ref.name,
        {},
        {},
    )
    log(text, flush=True)


def dtensor_worker(rank, args, rows, world, port):
    with be.gloo_dp(rank, world, port) as (dm, fmesh, log, reduce_max):
        device = torch.device("cpu")
        shapes = be.gpt_shapes() if args.tree == "gpt" else be.small_shapes()
        name = "GPT-like" if args.tree == "gpt" else "small-leaf"
        log(
            f"Part B: DTensor Shard(0) over {world} gloo ranks (FSDP2-style), 1 thread per rank; "
            f"{name} tree {be.n_params(shapes):,} params in {len(shapes)} leaves; a unit's "
            f"time is the slowest rank's"
        )
        for row in rows:
            try:
                dtensor_row(row, shapes, dm, fmesh, args, device, reduce_max, log)
            except Exception as e:  # noqa: BLE001 - every rank raises alike: go on with the next
                msg = " | ".join(line[:200] for line in str(e).strip().splitlines()[:2])
                log(f"\nrow {row}: FAILED with {type(e).__name__}: {msg}", flush=True)


def part_b(args, rows):
    if "RANK" in os.environ:
        dtensor_worker(int(os.environ["RANK"]), args, rows, int(os.environ["WORLD_SIZE"]), None)
        return
    import torch.multiprocessing as mp

    mp.spawn(
        dtensor_worker, args=(args, rows, args.world, be._free_port()), nprocs=args.world, join=True
    )


# -- main -------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, Part A")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: %(default)s")
    ap.add_argument("--device", default="cpu", help="Part A: cpu (default) or cuda")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=list(DTYPES),
        help="Part A: the parameters' and gradients' dtype (default float32)",
    )
    ap.add_argument("--compile", action="store_true", help="Part A: also torch.compile(ft.step)")
    ap.add_argument(
        "--cold-cache",
        action="store_true",
        help="with --compile: an empty inductor cache (first-compile time)",
    )
    ap.add_argument("--dtensor", action="store_true", help="run Part B (DTensors, gloo) instead")
    ap.add_argument(
        "--host", action="store_true", help="instead: host time per leaf (tiny-leaf trees)"
    )
    ap.add_argument("--world", type=int, default=2, help="Part B: ranks to spawn")
    ap.add_argument(
        "--tree",
        default="gpt",
        choices=["gpt", "small", "conv"],
        help="the GPT-like tree (default), the small-leaf tree (242 leaves of 64 x 68 and 64: "
        "bench_engine.small_shapes) or, Part A only, ResNet-18's parameters with channels_last "
        "convolutions (bench_engine.conv_shapes)",
    )
    args = ap.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in rows:
        if r not in ROWS:
            ap.error(f"unknown row {r!r}; rows: {', '.join(ROWS)}")

    if os.environ.get("RANK", "0") == "0":
        print("command: " + shlex.join(["python"] + sys.argv))
        print(
            f"torch {torch.__version__}; {args.rounds} timed rounds after {args.warmup} warm-up, "
            f"systems interleaved per round, each round in its own shuffled order; "
            f"median over rounds; "
            f"functional_train from "
            f"{Path(ft.__file__).parent}"
        )
    if args.dtensor:
        if args.tree == "conv":
            ap.error("--tree conv: Part A only")
        part_b(args, rows)
        return
    if args.host:
        part_host(args, rows)
        return
    if args.cold_cache:  # read by inductor when it first looks for a cached kernel
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_compose_inductor_")
        print(f"inductor cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']} (empty)")
    if not part_a(args, rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
