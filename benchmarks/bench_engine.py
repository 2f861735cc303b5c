"""Optimizer step engine: functional_train (eager update + apply, ft.step pure / donating)
against torch.optim, optax under jax.jit and a memory-bandwidth floor.

Every system runs the same problem: ``clip_by_global_norm(1.0)`` then AdamW (lr 1e-3, betas
(0.9, 0.999), eps 1e-8, weight decay 0.1), float32, from the same initial parameters with the
same gradients (random, ~1e-2 scale). Systems are interleaved round by round in one process
(each round runs every system once, after ``--warmup`` untimed rounds, in an order of its own:
a shuffle seeded by the round's number, so that no system always runs after the same other
one, see ``run_rounds``); the table gives
the median ms/step over ``--rounds`` rounds (and the minimum), the ratio of the median to the
first (baseline) system, the median number of minor page faults during one step (``faults``:
4 KiB pages the kernel had to map and zero, part of the time; glibc malloc hands large freed
blocks back to the OS, so a step that allocates its results can pay them every round, see
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in mallopt(3) to take them out), and the largest
parameter difference from the baseline after all rounds (every system has taken the same steps,
so this is a correctness check; results are also checked finite).

Before each timed step every system gets freshly written gradients, untimed, as after a backward
pass: ``p.grad.copy_(g)`` for torch.optim (``clip_grad_norm_`` scales them in place), a fresh
clone for the pure systems (``donate=True`` may write into it). The pure systems run as a
training loop, ``params, state = ft.step(tx, grads, state, params)``: the result replaces the
input, so the allocator reuses the freed buffers of the previous round.

Part A (default): plain tensors, one process, ``torch.set_num_threads(--threads)`` (default 1).
The GPT-like tree has 13,650,176 float32 parameters in 122 leaves: ``embed`` 4096 x 256,
``final_norm`` (256), and 12 layers of 10 leaves each: ``attn_norm`` (256), ``wq``, ``wk``,
``wv``, ``wo`` (256 x 256), ``mlp_norm`` (256), ``w1`` (1024 x 256) with its bias ``b1`` (1024),
``w3`` (1024 x 256), ``w2`` (256 x 1024). Systems:

  1. torch.optim.AdamW(fused=True) + clip_grad_norm_(foreach=True)      (baseline)
  2. torch.optim.AdamW(foreach=True) + clip_grad_norm_(foreach=True)
  3. optax chain(clip_by_global_norm, adamw) + apply_updates under one jax.jit (params and state
     donated; CPU, single-threaded XLA when --threads 1; skipped if jax/optax are missing)
  4. functional_train eager: tx.update + ft.apply_updates
  5. ft.step(donate=False)
  6. ft.step(donate=True)
  7. ft.TorchOptimizer(chain(clip, adamw)).step(): the torch.optim adapter on nn.Parameters with
     ``.grad`` set (the learning rate and betas injected as hyperparameters, read every step)
  8. with --compile: torch.compile(lambda g, s, p: ft.step(tx, g, s, p), fullgraph=True), pure
     (its first calls, compilation included, are printed separately). It runs second in each
     round, before the eager ft.step, so that its first call also builds the out-of-place
     kernels that its fused operator shares with the eager pure step; ``--cold-cache`` gives
     it an empty inductor cache (a temporary TORCHINDUCTOR_CACHE_DIR), so that the printed
     time is a first compile's, not one served from an earlier run's cache
  9. with --compile: torch.compile(opt.step) of 7's optimizer (as torch.optim's steps are
     compiled; its ratio to 7 is printed too)

plus floor lines: the time to move 8 x 4 bytes per parameter (read the gradient for the norm,
read gradient, parameter and both moments, write parameter and both moments) at the bandwidth of
a float32 triad ``a = b + s * c`` (12 bytes per element as STREAM counts them, 32 Mi-element
arrays, same thread count; measured every round, median), and at the bandwidth of the in-place
form ``b += s * c``, which does not pay the write-allocate read of a fresh output and is the
traffic pattern of an in-place optimizer (the first floor can be beaten by in-place updates).

Part B (--dtensor): FSDP2-style DTensors on 2 gloo ranks (spawned by this script on a free port
of 127.0.0.1, or the ranks of torchrun when RANK is set), 1 thread per rank. Every parameter and
gradient leaf is ``distribute_tensor(t, mesh, [Shard(0)])`` on ``init_device_mesh("cpu", (2,),
mesh_dim_names=("dp",))``, each parameter an ``nn.Parameter`` holding its DTensor, as FSDP2's
``fully_shard`` makes a model's (plain DTensors before session 70); functional_train gets
``mesh=ft.Mesh(device_mesh, data_axis="dp")``.
Two trees: the GPT-like tree above, and a small-leaf tree of 534,336 parameters in 242 leaves
(121 linear layers, weight 64 x 68 and bias 64). Systems: torch.optim.AdamW(foreach=True) +
clip_grad_norm_(foreach=True) on nn.Parameter(DTensor) with DTensor .grad (baseline),
functional_train eager update + apply, ft.step pure, ft.step donate. A step's time is the slowest
rank's; rank 0 prints.

ft.step(tx, grads, state, params, *, mesh=None, donate=False) is used when the library has it;
otherwise a local update + apply_updates stands in for it (a note is printed, and the ft.step
rows then time that fallback).

    python benchmarks/bench_engine.py [--rounds 10] [--warmup 2] [--threads 1]
                                      [--compile [--cold-cache]] [--no-jax]
    python benchmarks/bench_engine.py --dtensor [--rounds 10] [--warmup 2] [--world 2]
"""

import argparse
import contextlib
import gc
import math
import os
import random
import shlex
import socket
import statistics
import sys
import time
import warnings

import torch

import functional_train as ft

LR, WD, MAX_NORM = 1e-3, 0.1, 1.0


# -- the step under test ----------------------------------------------------------------------
def _fallback_step(tx, grads, state, params, *, mesh=None, donate=False):
    """Stand-in for ft.step while the library does not have it: update, then apply."""
    del donate
    updates, state = tx.update(grads, state, params, mesh=mesh)
    return ft.apply_updates(params, updates), state


FT_STEP = getattr(ft, "step", None)
STEP_IS_FALLBACK = FT_STEP is None
if FT_STEP is None:
    FT_STEP = _fallback_step


def make_tx():
    return ft.chain(ft.clip_by_global_norm(MAX_NORM), ft.adamw(LR, weight_decay=WD))


# -- trees ------------------------------------------------------------------------------------
def gpt_shapes(layers=12, d=256, ff=1024, vocab=4096):
    """13,650,176 parameters in 122 leaves (see the module docstring)."""
    shapes = {"embed": (vocab, d)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "attn_norm": (d,),
                p + "wq": (d, d),
                p + "wk": (d, d),
                p + "wv": (d, d),
                p + "wo": (d, d),
                p + "mlp_norm": (d,),
                p + "w1": (ff, d),
                p + "b1": (ff,),
                p + "w3": (ff, d),
                p + "w2": (d, ff),
            }
        )
    shapes["final_norm"] = (d,)
    return shapes


def small_shapes(n=121, rows=64, cols=68):
    """534,336 parameters in 242 leaves: n linear layers, weight rows x cols and bias rows."""
    shapes = {}
    for i in range(n):
        shapes[f"lin.{i}.weight"] = (rows, cols)
        shapes[f"lin.{i}.bias"] = (rows,)
    return shapes


def conv_shapes():
    """ResNet-18's parameters (11,689,512 in 62 leaves): its 3 x 3 and 1 x 1 convolution
    weights (out, in, kh, kw), the batch norms' weights and biases, the classifier. Meant to be
    made ``channels_last`` (:func:`channels_last`), as convolutional training runs them."""
    shapes = {"conv1.weight": (64, 3, 7, 7), "bn1.norm.weight": (64,), "bn1.norm.bias": (64,)}
    c_in = 64
    for stage, c in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            p = f"layer{stage}.{block}."
            first_in = c_in if block == 0 else c
            shapes.update(
                {
                    p + "conv1.weight": (c, first_in, 3, 3),
                    p + "bn1.norm.weight": (c,),
                    p + "bn1.norm.bias": (c,),
                    p + "conv2.weight": (c, c, 3, 3),
                    p + "bn2.norm.weight": (c,),
                    p + "bn2.norm.bias": (c,),
                }
            )
            if block == 0 and c != c_in:
                shapes[p + "downsample.weight"] = (c, c_in, 1, 1)
                shapes[p + "downsample.norm.weight"] = (c,)
                shapes[p + "downsample.norm.bias"] = (c,)
        c_in = c
    shapes.update({"fc.weight": (1000, 512), "fc.bias": (1000,)})
    return shapes


def channels_last(tree: dict) -> dict:
    """``tree`` with its 4-d leaves in ``torch.channels_last`` memory order."""
    return {
        k: v.to(memory_format=torch.channels_last) if v.ndim == 4 else v for k, v in tree.items()
    }


def make_problem(shapes, seed=0):
    """Initial parameters (matrices ~0.02 randn, norms 1, biases 0) and gradients (~1e-2 randn)."""
    g = torch.Generator().manual_seed(seed)
    params, grads = {}, {}
    for k, s in shapes.items():
        leaf = k.rsplit(".", 1)[-1]
        if len(s) > 1:
            params[k] = torch.randn(s, generator=g) * 0.02
        elif "norm" in leaf:
            params[k] = torch.ones(s)
        else:
            params[k] = torch.zeros(s)
        grads[k] = torch.randn(s, generator=g) * 1e-2
    return params, grads


def n_params(shapes):
    return sum(math.prod(s) for s in shapes.values())


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def clone_tree(tree):
    return {k: v.clone() for k, v in tree.items()}


# -- systems ----------------------------------------------------------------------------------
class TorchOptim:
    """torch.optim.AdamW + clip_grad_norm_(foreach=True), in place on nn.Parameters."""

    def __init__(self, name, params0, grads0, **opt_kwargs):
        self.name = name
        self.ps = [torch.nn.Parameter(v.clone()) for v in params0.values()]
        self.gsrc = list(grads0.values())
        for p, g in zip(self.ps, self.gsrc):
            p.grad = g.clone()
        self.opt = torch.optim.AdamW(self.ps, lr=LR, weight_decay=WD, **opt_kwargs)

    def prepare(self):
        with torch.no_grad():
            for p, g in zip(self.ps, self.gsrc):
                p.grad.copy_(g)

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.ps, MAX_NORM, foreach=True)
        self.opt.step()

    def params(self):
        return [local(p.detach()) for p in self.ps]


class TorchOptimizerSys(TorchOptim):
    """ft.TorchOptimizer(chain(clip, adamw)) on nn.Parameters: the torch.optim adapter's step
    (``.grad`` in, ``ft.step(..., donate=True)``, results written into the parameters)."""

    def __init__(self, name, params0, grads0, tx):
        self.name = name
        self.ps = [torch.nn.Parameter(v.clone()) for v in params0.values()]
        self.gsrc = list(grads0.values())
        for p, g in zip(self.ps, self.gsrc):
            p.grad = g.clone()
        self.opt = ft.TorchOptimizer(list(zip(params0, self.ps)), tx)

    def step(self):
        self.opt.step()


class CompiledTorchOptimizerSys(TorchOptimizerSys):
    """torch.compile(opt.step) of a TorchOptimizerSys's optimizer (inductor)."""

    def __init__(self, name, params0, grads0, tx):
        super().__init__(name, params0, grads0, tx)
        self.compiled = torch.compile(self.opt.step)

    def step(self):
        self.compiled()


class PureLoop:
    """A pure step run as a training loop: ``params, state = fn(grads, state, params)``.
    ``parameters``: the parameters are ``nn.Parameter``s, as a model's (FSDP2's
    ``fully_shard`` makes each one an ``nn.Parameter`` holding a DTensor).

    The gradients a unit stepped with are dropped in the next ``prepare``, untimed, not in
    ``step``: freeing them is the training loop's work, not the step's (a loop drops them
    when the next backward's replace them, as ``zero_grad`` does torch's), and on CPU it is
    the kernel unmapping their pages, 2 to 3 ms a call on the GPT-like tree, which the torch
    systems (their ``.grad`` buffers written in place) never pay. Before session 76 the
    functional_train loops paid it inside their timed step."""

    def __init__(self, name, fn, tx, params0, grads0, parameters=False):
        self.name, self.fn = name, fn
        self.p = clone_tree(params0)
        if parameters:
            self.p = {k: torch.nn.Parameter(v) for k, v in self.p.items()}
        self.s = tx.init(self.p)
        self.gsrc = grads0
        self.g = None
        self.spent: list = []  # (the last unit's gradients, dropped by prepare)

    def prepare(self):
        self.g = None
        self.spent.clear()  # (free last unit's gradients before writing new ones)
        self.g = self.fresh_gradients()

    def fresh_gradients(self):
        """The next unit's gradients, new buffers (a donated step may write into them)."""
        return clone_tree(self.gsrc)

    def step(self):
        g, self.g = self.g, None
        self.spent.append(g)
        self.p, self.s = self.fn(g, self.s, self.p)

    def params(self):
        return [local(v) for v in self.p.values()]


class OptaxJit:
    """optax chain(clip_by_global_norm, adamw) + apply_updates in one jax.jit, donating."""

    def __init__(self, name, params0, grads0):
        import jax
        import jax.numpy as jnp
        import optax

        self.name, self.jax = name, jax
        tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, weight_decay=WD))
        self.p = {k: jnp.array(v.numpy(), copy=True) for k, v in params0.items()}
        self.g = {k: jnp.array(v.numpy(), copy=True) for k, v in grads0.items()}
        self.s = tx.init(self.p)
        self.keys = list(params0)  # jax returns dicts with sorted keys

        def f(g, s, p):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        self.f = jax.jit(f, donate_argnums=(1, 2))

    def prepare(self):
        pass

    def step(self):
        self.p, self.s = self.f(self.g, self.s, self.p)
        self.jax.block_until_ready((self.p, self.s))

    def params(self):
        import numpy as np

        return [torch.from_numpy(np.array(self.p[k])) for k in self.keys]


def triad_seconds(n, reps=3):
    """Best of ``reps`` float32 triads on n elements: ``a = b + s * c`` into a third array, and
    in place, ``b += s * c`` (both 12 bytes per element as counted; the first also pays the
    write-allocate read of ``a`` on most CPUs, which in-place optimizer updates do not)."""
    b, c = torch.rand(n), torch.rand(n)
    a = torch.empty(n)
    best_out = best_in = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.add(b, c, alpha=0.5, out=a)
        best_out = min(best_out, time.perf_counter() - t)
        t = time.perf_counter()
        b.add_(c, alpha=1e-3)
        best_in = min(best_in, time.perf_counter() - t)
    assert math.isfinite(float(a[-1])) and math.isfinite(float(b[-1]))
    return best_out, best_in


# -- the interleaved loop ---------------------------------------------------------------------
def minor_faults():
    """Minor page faults of this process so far (0 where getrusage is not available)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, AttributeError):
        return 0


def run_rounds(systems, rounds, warmup, barrier=None, reduce_max=None, extra=None, log=print):
    """Runs every system once per round; returns {name: [seconds per timed round]},
    {name: [minor page faults per timed round]} and {name: [seconds per warm-up round]}. A system
    that raises is dropped with a note (one process only).

    Round ``r`` runs the systems in the order ``random.Random(r)`` shuffles them into (the same
    on every rank): what ran just before a system moves its time, whatever the system (session
    75: on the GPT-like tree any functional_train step run right after torch's fused AdamW took
    1 to 1.5 ms more than the same step run after another functional_train step, ~15%), so one
    order for every round favours some systems over others; rotating it would not help (each
    system would still follow the same one)."""
    times = {s.name: [] for s in systems}
    faults = {s.name: [] for s in systems}
    warm = {s.name: [] for s in systems}
    alive = list(systems)
    gc.collect()
    gc.disable()
    try:
        for r in range(warmup + rounds):
            gc.collect()
            order = list(alive)
            random.Random(r).shuffle(order)
            for s in order:
                s.prepare()
                if barrier is not None:
                    barrier()
                f0 = minor_faults()
                t0 = time.perf_counter()
                try:
                    s.step()
                except Exception as e:  # noqa: BLE001 - report and go on with the others
                    if reduce_max is not None:
                        raise
                    msg = " | ".join(line[:200] for line in str(e).strip().splitlines()[:2])
                    log(f"note: {s.name} failed and is dropped: {type(e).__name__}: {msg}")
                    alive.remove(s)
                    continue
                dt = time.perf_counter() - t0
                nf = minor_faults() - f0
                if reduce_max is not None:
                    dt, nf = reduce_max(dt), reduce_max(nf)
                if r >= warmup:
                    times[s.name].append(dt)
                    faults[s.name].append(nf)
                else:
                    warm[s.name].append(dt)
            if extra is not None:
                extra(r >= warmup)
    finally:
        gc.enable()
    return {k: v for k, v in times.items() if v}, faults, warm


def check(systems, times, reduce_max=None):
    """Largest |param - baseline param| per system (all ranks), and whether all are finite."""
    base = systems[0].params()
    out = {}
    for s in systems:
        if s.name not in times:
            continue
        ps = s.params()
        diff = max(
            float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
            for a, b in zip(ps, base)
        )
        finite = all(bool(torch.isfinite(a).all()) for a in ps)
        if reduce_max is not None:
            diff = reduce_max(diff if finite else float("inf"))
            finite = math.isfinite(diff)
        out[s.name] = (diff, finite)
    return out


def table(title, times, faults, checks, baseline, floor=None):
    lines = [
        title,
        f"  {'system':<58s} {'ms/step':>9s} {'min ms':>8s} {'ratio':>6s} "
        f"{'faults':>7s}  max|p-p_base|",
    ]
    base = statistics.median(times[baseline])
    for name, ts in times.items():
        med = statistics.median(ts)
        diff, finite = checks.get(name, (float("nan"), True))
        flag = "" if finite else "   NOT FINITE"
        if finite and diff > 1e-5:
            flag = "   LARGE DIFFERENCE"
        nf = statistics.median(faults[name])
        lines.append(
            f"  {name:<58s} {med * 1e3:9.2f} {min(ts) * 1e3:8.2f} {med / base:6.2f} "
            f"{nf:7.0f}  {diff:.1e}{flag}"
        )
    for label, sec in floor or ():
        lines.append(f"  {label:<58s} {sec * 1e3:9.2f} {'':>8s} {sec / base:6.2f}")
    return "\n".join(lines)


def step_label(donate):
    tag = " [fallback: update+apply]" if STEP_IS_FALLBACK else ""
    return f"ft.step(donate={donate}){tag}"


# -- Part A -----------------------------------------------------------------------------------
def part_a(args):
    torch.set_num_threads(args.threads)
    shapes = gpt_shapes()
    params0, grads0 = make_problem(shapes)
    tx = make_tx()
    print(
        f"Part A: plain tensors, one process, {torch.get_num_threads()} thread(s); GPT-like tree "
        f"{n_params(shapes):,} float32 params in {len(shapes)} leaves"
    )
    systems = [
        TorchOptim(
            "torch.optim.AdamW(fused) + clip_grad_norm_(foreach)", params0, grads0, fused=True
        ),
        TorchOptim(
            "torch.optim.AdamW(foreach) + clip_grad_norm_(foreach)", params0, grads0, foreach=True
        ),
    ]
    if args.no_jax:
        print("note: optax skipped (--no-jax)")
    else:
        try:
            systems.append(
                OptaxJit("optax clip+adamw+apply_updates, jax.jit donated", params0, grads0)
            )
        except ImportError as e:
            print(f"note: optax skipped ({e})")

    def eager(g, s, p):
        u, s = tx.update(g, s, p)
        return ft.apply_updates(p, u), s

    opt_names = ("ft.TorchOptimizer(chain(clip, adamw)).step()", "torch.compile(opt.step) of 7")
    systems += [
        PureLoop("functional_train eager tx.update + ft.apply_updates", eager, tx, params0, grads0),
        PureLoop(
            step_label(False),
            lambda g, s, p: FT_STEP(tx, g, s, p, donate=False),
            tx,
            params0,
            grads0,
        ),
        PureLoop(
            step_label(True), lambda g, s, p: FT_STEP(tx, g, s, p, donate=True), tx, params0, grads0
        ),
        TorchOptimizerSys(opt_names[0], params0, grads0, make_tx()),
    ]
    compiled_name = None
    if args.compile:  # second, before the eager ft.step builds the kernels they share
        compiled_name = "torch.compile(ft.step, fullgraph=True), pure"
        fn = torch.compile(lambda g, s, p: FT_STEP(tx, g, s, p), fullgraph=True)
        systems.insert(1, PureLoop(compiled_name, fn, tx, params0, grads0))
        systems.append(CompiledTorchOptimizerSys(opt_names[1], params0, grads0, make_tx()))

    n_triad = 1 << 25
    triad = []

    def measure_triad(timed):
        if timed:
            triad.append(triad_seconds(n_triad))

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        times, faults, warm = run_rounds(systems, args.rounds, args.warmup, extra=measure_triad)
    checks = check(systems, times)
    floors = []
    for i, what in enumerate(["triad a = b + s*c", "in-place b += s*c"]):
        bw = 3 * 4 * n_triad / statistics.median(t[i] for t in triad)
        floors.append(
            (f"floor: 32 B/param at {what} {bw / 1e9:.1f} GB/s", 8 * 4 * n_params(shapes) / bw)
        )
    print(table("", times, faults, checks, systems[0].name, floor=floors))
    if compiled_name is not None and warm.get(compiled_name):
        print(
            f"  {compiled_name}: warm-up calls (compilation in the first) "
            + ", ".join(f"{t:.2f} s" for t in warm[compiled_name])
        )
    if args.compile and times.get(opt_names[1]):
        ratio = statistics.median(times[opt_names[1]]) / statistics.median(times[opt_names[0]])
        print(f"  {opt_names[1]}: {ratio:.2f}x the eager opt.step() (medians)")
    return checks


# -- Part B -----------------------------------------------------------------------------------
def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_dp(rank, world, port):
    """A gloo process group of ``world`` ranks (torchrun's when ``port`` is ``None``), 1 thread,
    a 1-D "dp" mesh: yields ``(device mesh, ft.Mesh with data_axis "dp", log (rank 0 prints),
    reduce_max(x): the ranks' maximum of a float)``; the group is destroyed on exit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    if port is None:  # torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    try:
        dm = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))

        def reduce_max(x):
            t = torch.tensor([x], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t[0])

        yield dm, ft.Mesh(dm, data_axis="dp"), print if rank == 0 else _quiet, reduce_max
    finally:
        dist.destroy_process_group()


def _quiet(*args, **kwargs):
    pass


def dtensor_worker(rank, args, world, port):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_dp(rank, world, port) as (dm, fmesh, log, reduce_max):

        def barrier():
            dist.barrier()

        tx = make_tx()
        log(f"Part B: DTensor Shard(0) over {world} gloo ranks (FSDP2-style), 1 thread per rank")
        for tree_name, shapes in [("GPT-like", gpt_shapes()), ("small-leaf", small_shapes())]:
            p_full, g_full = make_problem(shapes)
            params0 = {k: distribute_tensor(v, dm, [Shard(0)]) for k, v in p_full.items()}
            grads0 = {k: distribute_tensor(v, dm, [Shard(0)]) for k, v in g_full.items()}
            del p_full, g_full

            def eager(g, s, p):
                u, s = tx.update(g, s, p, mesh=fmesh)
                return ft.apply_updates(p, u), s

            systems = [
                TorchOptim(
                    "torch.optim.AdamW(foreach) + clip_grad_norm_(foreach)",
                    params0,
                    grads0,
                    foreach=True,
                ),
                PureLoop(
                    "functional_train eager tx.update + ft.apply_updates",
                    eager,
                    tx,
                    params0,
                    grads0,
                    parameters=True,
                ),
                PureLoop(
                    step_label(False),
                    lambda g, s, p: FT_STEP(tx, g, s, p, mesh=fmesh, donate=False),
                    tx,
                    params0,
                    grads0,
                    parameters=True,
                ),
                PureLoop(
                    step_label(True),
                    lambda g, s, p: FT_STEP(tx, g, s, p, mesh=fmesh, donate=True),
                    tx,
                    params0,
                    grads0,
                    parameters=True,
                ),
            ]
            times, faults, _ = run_rounds(
                systems, args.rounds, args.warmup, barrier=barrier, reduce_max=reduce_max, log=log
            )
            checks = check(systems, times, reduce_max=reduce_max)
            log(
                table(
                    f"\n{tree_name} tree: {n_params(shapes):,} params in {len(shapes)} leaves "
                    f"(slowest rank per step)",
                    times,
                    faults,
                    checks,
                    systems[0].name,
                )
            )
            del systems, params0, grads0
            gc.collect()


def part_b(args):
    if "RANK" in os.environ:
        dtensor_worker(int(os.environ["RANK"]), args, int(os.environ["WORLD_SIZE"]), None)
        return
    import torch.multiprocessing as mp

    mp.spawn(dtensor_worker, args=(args, args.world, _free_port()), nprocs=args.world, join=True)


# -- main -------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--threads", type=int, default=1, help="torch (and XLA) threads, Part A")
    ap.add_argument(
        "--compile", action="store_true", help="Part A: also time torch.compile(ft.step)"
    )
    ap.add_argument(
        "--cold-cache",
        action="store_true",
        help="with --compile: an empty inductor cache (first-compile time)",
    )
    ap.add_argument("--no-jax", action="store_true", help="Part A: skip optax")
    ap.add_argument(
        "--dtensor", action="store_true", help="run Part B (DTensors, gloo) instead of A"
    )
    ap.add_argument("--world", type=int, default=2, help="Part B: ranks to spawn")
    args = ap.parse_args()

    if os.environ.get("RANK", "0") == "0":
        where = (
            f" (under torchrun, WORLD_SIZE={os.environ['WORLD_SIZE']})"
            if "RANK" in os.environ
            else ""
        )
        print("command: " + shlex.join(["python"] + sys.argv) + where)
        print(
            f"torch {torch.__version__}; {args.rounds} timed rounds after {args.warmup} warm-up, "
            f"systems interleaved per round, each round in its own shuffled order; "
            f"median over rounds"
        )
        if STEP_IS_FALLBACK:
            print(
                "note: ft.step is not in functional_train yet: the ft.step rows time a local "
                "update + apply_updates fallback (donate ignored)"
            )
    if args.dtensor:
        part_b(args)
        return
    if args.cold_cache:  # read by inductor when it first looks for a cached kernel
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_engine_inductor_")
        print(f"inductor cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']} (empty)")
    if args.threads == 1 and "jax" not in sys.modules:
        os.environ.setdefault(
            "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    part_a(args)


if __name__ == "__main__":
    main()
