"""What torch alone costs per compiled call with a step's inputs: the floor under ``--compile``.

Issue 29's compiled target is ``torch.compile(ft.step)`` <= 1.2x the eager step of its kind.
A compiled call costs torch something per tensor crossing it whatever the function does with
them: dynamo's guards (a ``TENSOR_MATCH`` and a ``NO_TENSOR_ALIASING`` entry per tensor),
AOTAutograd's runtime wrapper, inductor's ``assert_size_stride`` of every graph input an
operator reads, the dispatcher boxing the tensors into an operator's arguments. After a step's
pass over the trees the tensors' metadata is out of the caches, so each tensor costs a few
cache misses there too. This script measures that cost for each row of
``bench_compose.py`` (its trees, its transform's state) with nothing of functional_train in
the call, and from it the best ratio any compiled step of those inputs could reach.

Per row (``--rows``), all in one process, every system once per round in
``bench_engine.run_rounds``' shuffled order (Python's collector off while timing):

  (a) direct       a Python function reading the address of every tensor the step takes
                   (the gradients', the state's, the parameters' leaves, flattened before the
                   call): the least any step does with them
  (b) compiled     ``torch.compile(fullgraph=True)`` of a function handing the same two lists
                   to a ``torch.library.custom_op`` operator whose body is (a)'s; for the donated
                   kind the operator is declared to mutate the state's and parameters' arrays
                   (as ``functional_train::fused_stage_donated`` is; their 0-dim values are
                   read only), for the pure kind it mutates nothing and returns a 0-dim tensor
  ft.step          ``bench_compose.py``'s systems: donated and pure, eager and compiled, a unit
                   being the row's calls (a cycle of ``EVERY_K`` for the ``multi_steps`` rows)

(a) and (b) are one call each, after a write of 128 MiB (more than this machine's last-level
cache: each call starts with cold caches, as each of a step's calls does after the pass before
it). ``(b) - (a)`` is torch's cost per compiled call for these inputs, and ``calls x ((b) -
(a)) / eager unit`` *torch's share*: what the ratio of a compiled step to its eager step has
to add to 1 for torch alone, when the compiled step's own host work equals the eager step's.
While the ft systems step, the library's CPU kernels are timed (:class:`KernelClock`): the
*floor*, ``(kernels + calls x ((b) - (a))) / eager unit``, is the ratio of a compiled step
that had no host work of its own at all, its kernels' time and torch's cost per call only.
Both are low, not high: (b) takes two flat lists, where the compiled step takes the nested
dicts and states dynamo guards entry by entry, and returns nothing, where a pure step returns
its new tensors. (b)'s page faults are printed: in some rows (b)'s donated call took one
fault per array it is declared to mutate, every call, and ~2.5 ms more than the other rows'
(b) with as many tensors (not understood; the compiled ft steps of those rows take none), so
torch's share and the floor are overstated there. Where torch's share is above 0.2, a
compiled step meets the target only with less host work of its own than the eager step; where
the floor is, not at all.

The same (a) and (b) once more with the state flat: the parameters and gradients as they are,
the state's arrays one 1-d buffer per dtype and its 0-dim values one vector per dtype (as many
elements): torch's share if the library kept optimizer state in flat buffers whose leaves
were views of them, as apex's multi-tensor optimizers and FSDP's flat parameters do. Not
built (the optax-style state holds a tensor per leaf); this says what it would buy.

Printed per row: the tensors a call takes, torch's cost per call by kind, and per kind the
eager and compiled units (with their kernels' time), the compiled unit's ratio to the eager
one, torch's share and the floor; at the end, a table of them. 1 thread (``--threads``), CPU.

    python benchmarks/bench_compile_floor.py [--rows adamw,multi_steps,multi_steps_groups]
        [--rounds 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import optree
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_compose as bc  # noqa: E402
import bench_engine as be  # noqa: E402
from functional_train.engine import fuse, native  # noqa: E402

_EVICT_FLOATS = 32 << 20  # (128 MiB of float32)


def _touch(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
    for t in xs:
        t.data_ptr()
    for t in ys:
        t.data_ptr()


@torch.library.custom_op("ft_bench_floor::touch_donated", mutates_args=("xs",))
def _touch_donated(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
    _touch(xs, ys)


@_touch_donated.register_fake
def _(xs, ys):
    return None


@torch.library.custom_op("ft_bench_floor::touch_pure", mutates_args=())
def _touch_pure(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    _touch(xs, ys)
    return torch.zeros(())


@_touch_pure.register_fake
def _(xs, ys):
    return torch.empty(())


def _donated(state_and_params, grads):
    _touch_donated(state_and_params, grads)


def _pure(state_and_params, grads):
    return _touch_pure(state_and_params, grads)


def _donated_flat(state_and_params, grads):  # (a code object of its own: a cache of its own)
    _touch_donated(state_and_params, grads)


def _pure_flat(state_and_params, grads):
    return _touch_pure(state_and_params, grads)


def _flat(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``xs`` as one 1-d buffer per dtype, holding as many elements (the what-if of a state
    kept in flat buffers: the leaves would be views of these, not inputs of their own)."""
    by_dtype: dict = {}
    for x in xs:
        by_dtype.setdefault(x.dtype, []).append(x.reshape(-1))
    return [torch.cat(group) for group in by_dtype.values()]


class FloorCall:
    """One call of ``fn(state_and_params, grads)`` on the row's tensors, after a write of
    128 MiB (untimed, in ``prepare``)."""

    def __init__(self, name, fn, state_and_params, grads, evict):
        self.name, self.fn, self.sp, self.g, self.evict = name, fn, state_and_params, grads, evict

    def prepare(self):
        self.evict.fill_(1.0)

    def step(self):
        self.fn(self.sp, self.g)


class KernelClock:
    """Seconds spent in the library's CPU kernels (its generated stage kernels, the foreach
    kernels it runs a stage with, its sums of squares: each call's own argument handling
    included) while ``clocked`` systems step: the step's work that no host overhead can take
    away, whether it runs eagerly or inside a compiled graph's operators."""

    def __init__(self):
        self.total = 0.0
        self.depth = 0  # (a kernel called inside another is counted once, in the outer)
        for owner, name in (
            (fuse.Kernel, "__call__"),
            (fuse.ForeachKernel, "__call__"),
            (native, "_sums"),
        ):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if not self.depth:
                    self.total += time.perf_counter() - t

        return timed

    def clocked(self, system):
        """``system`` whose ``kernel`` list gets each unit's kernel seconds."""
        step, system.kernel = system.step, []

        def clocked_step():
            self.total = 0.0
            step()
            system.kernel.append(self.total)

        system.step = clocked_step
        return system


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors of ``tree``, each once (a state may hold one tensor in two fields: a
    compiled step takes it as one input)."""
    return list(
        {id(x): x for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor)}.values()
    )


def row_floor(row, rounds, warmup, evict, clock, log=print):
    """Runs one row's systems; returns its summary (a dict) after printing it."""
    cpu = torch.device("cpu")
    params0, grads = bc.problem(be.gpt_shapes(), row, cpu)
    tx = bc.make_tx(row)
    k = bc.EVERY_K if row in bc.CYCLE_ROWS else 1
    fts = bc.ft_systems(row, tx, params0, grads, cpu, compiled=True)  # (resets dynamo)
    # (update + apply_updates: no compiled kind)
    fts = [clock.clocked(s) for s in fts if "update" not in s.name]
    params = be.clone_tree(params0)
    # (the donated operator is declared to mutate what a donated step writes in place, the
    # state's and parameters' arrays; their 0-dim values, counters and flags, are read like
    # the gradients: the step's scalar programs make them anew. The arrays are copies, written
    # memory as a step's state is; (b)'s page faults, where it takes them, come with or
    # without the copies and with or without the 0-dim values declared mutated)
    init = tx.init(params)
    state_and_params = _tensors((init, params))
    sp = [x.clone() for x in state_and_params if x.dim() > 0]
    g = _tensors(grads[0]) + [x for x in state_and_params if x.dim() == 0]
    # (the what-if of a state in flat buffers: the parameters and gradients as they are, the
    # state's arrays one buffer per dtype, its 0-dim values one vector per dtype)
    p_ids = {id(x) for x in _tensors(params)}
    state = _tensors(init)
    sp_flat = [x.clone() for x in _tensors(params)]
    sp_flat += _flat([x for x in state if x.dim() > 0 and id(x) not in p_ids])
    g_flat = _tensors(grads[0]) + _flat([x for x in state if x.dim() == 0])
    floors = [
        FloorCall("(a) direct", _touch, sp, g, evict),
        FloorCall("(b) compiled, donated", torch.compile(_donated, fullgraph=True), sp, g, evict),
        FloorCall("(b) compiled, pure", torch.compile(_pure, fullgraph=True), sp, g, evict),
        FloorCall("(a) direct, state flat", _touch, sp_flat, g_flat, evict),
        FloorCall(
            "(b) compiled, donated, state flat",
            torch.compile(_donated_flat, fullgraph=True),
            sp_flat,
            g_flat,
            evict,
        ),
        FloorCall(
            "(b) compiled, pure, state flat",
            torch.compile(_pure_flat, fullgraph=True),
            sp_flat,
            g_flat,
            evict,
        ),
    ]
    times, faults, _ = be.run_rounds(fts + floors, rounds, warmup, log=log)
    ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    kernel_ms = {s.name: statistics.median(s.kernel[-rounds:]) * 1e3 for s in fts}
    by_name = {s.name: s for s in fts}
    direct = ms["(a) direct"]
    n, n_flat = len(sp) + len(g), len(sp_flat) + len(g_flat)
    unit = f"a cycle of {k} calls" if k > 1 else "one call"
    log(f"\nrow {row} ({unit}): {bc.describe(row)}")
    out = {"row": row, "tensors": n, "tensors_flat": n_flat}
    for kind, eager_name, compiled_name in (
        ("donated", "(c) ft.step(donate=True)", bc.COMPILED_DONATED),
        ("pure", "(d) ft.step(donate=False), pure", bc.COMPILED_PURE),
    ):
        b_name = f"(b) compiled, {kind}"
        cost, b_faults = ms[b_name] - direct, statistics.median(faults[b_name])
        eager, compiled = ms[eager_name], ms[compiled_name]
        kernels = kernel_ms[eager_name]
        share, floor = k * cost / eager, (kernels + k * cost) / eager
        cost_flat = ms[f"{b_name}, state flat"] - ms["(a) direct, state flat"]
        out[kind] = (cost, compiled / eager, share, floor, b_faults, k * cost_flat / eager)
        # (both took the same steps with the same gradients: the compiled step is the eager one)
        diff = max(
            float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            for a, b in zip(by_name[compiled_name].params(), by_name[eager_name].params())
        )
        log(
            f"  {kind:8s} torch per compiled call with these {n} tensors: +{cost:.2f} ms "
            f"((b) {ms[b_name]:.2f} - (a) {direct:.2f}; (b)'s page faults {b_faults:.0f}); "
            f"eager unit {eager:.2f} ms ({kernels:.2f} in kernels), compiled {compiled:.2f} ms "
            f"({kernel_ms[compiled_name]:.2f} in kernels) = {compiled / eager:.2f}x eager; "
            f"torch's share {share:.2f}; floor {floor:.2f}x; compiled parameters against "
            f"eager's: largest relative difference {diff:.1e}; the state flat ({n_flat} "
            f"tensors): +{cost_flat:.2f} ms a call, torch's share {k * cost_flat / eager:.2f}"
        )
    return out


def _faulted(donated, pure) -> str:
    """A note where (b) took page faults (its time then is not torch's cost alone)."""
    n = max(donated[4], pure[4])
    return f" ((b): {n:.0f} page faults a call)" if n > 8 else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rows",
        default="adamw,multi_steps,multi_steps_groups",
        help="comma-separated rows of bench_compose.py, or 'all' (default: %(default)s)",
    )
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    rows = bc.ROWS if args.rows == "all" else args.rows.split(",")
    for row in rows:
        if row not in bc.ROWS:
            ap.error(f"unknown row {row!r}; rows: {', '.join(bc.ROWS)}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*donated buffers.*")
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), CPU; medians of {args.rounds} "
        "rounds; (b) - (a): torch's cost per compiled call; torch's share: calls x that / "
        "the eager unit; floor: (the eager unit's kernels + calls x that) / the eager unit"
    )
    evict = torch.empty(_EVICT_FLOATS)
    clock = KernelClock()
    summary = [row_floor(row, args.rounds, args.warmup, evict, clock) for row in rows]
    print(
        "\n| row | tensors a call | torch per compiled call, donated / pure (ms) | compiled "
        "donated x eager (torch's share, floor) | compiled pure x eager (torch's share, floor) "
        "| the state flat: tensors a call, torch's share donated / pure |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for s in summary:
        d, p = s["donated"], s["pure"]
        print(
            f"| {s['row']} | {s['tensors']} | {d[0]:.2f} / {p[0]:.2f}{_faulted(d, p)} | "
            f"{d[1]:.2f} (+{d[2]:.2f}, "
            f"{d[3]:.2f}) | {p[1]:.2f} (+{p[2]:.2f}, {p[3]:.2f}) | {s['tensors_flat']}, "
            f"{d[5]:.2f} / {p[5]:.2f} |"
        )


if __name__ == "__main__":
    main()
