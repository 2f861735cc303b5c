"""Worker for tests/test_sweep.py::test_compile_dtensor_gloo: every transform of the sweep's
registry, ``torch.compile(step, fullgraph=True)`` on DTensor leaves over 2 real gloo ranks
(``Shard(0)`` / ``Shard(1)`` / ``Replicate`` leaves and a plain one, on a mesh dim named
``dp`` so that ``zero_redundancy`` has its axis), against
the eager ``ft.step``.

The optimizer aliases compile with inductor; the other transforms with the ``eager`` backend
(dynamo's tracing is what breaks, and inductor takes ~10-40 s per transform on 2 CPU cores).
No transform recompiles on its own outputs (3 steps, one graph; one per branch where a
documented CPU counter decides), a warmup-cosine schedule's changing learning rate included.
The compiled run's initial state gets placements objects of its own, as the params and
gradients do (see ``_own_placements``).
Every rank returns ``{name: None or an error message}``.
"""

import copy
import traceback

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import _sweep_registry as reg
import functional_train as ft

# inductor for the user-facing optimizers (and the main job's chain), eager for the rest
ALIASES = {
    "sgd",
    "adam",
    "adamw",
    "lamb",
    "adafactor",
    "came",
    "galore_adamw",
    "adamw[8bit]",
    "chain",
}


def problem(mesh):
    g = torch.Generator().manual_seed(0)
    shapes = {
        "w": ((6, 4), [Shard(0)]),
        "m": ((4, 6), [Shard(1)]),
        "v": ((5,), [Replicate()]),
        "p": ((3,), None),
    }
    params = {k: torch.randn(s, generator=g) for k, (s, _) in shapes.items()}
    grads = [{k: torch.randn(s, generator=g) for k, (s, _) in shapes.items()} for _ in range(3)]

    def dist_(tree):
        # placements objects of its own for every tree, as autograd gives gradients (a
        # Replicate() shared by a param and its gradient is an aliasing dynamo guards on)
        return {
            k: v
            if shapes[k][1] is None
            else distribute_tensor(v, mesh, copy.deepcopy(shapes[k][1]))
            for k, v in tree.items()
        }

    return dist_(params), [dist_(t) for t in grads]


def _own_placements(tree):
    """``tree`` with placements objects of its own for every DTensor leaf (and its local
    tensor cloned), as a compiled step's outputs have them: a state from ``init`` shares its
    params' placements objects, an aliasing dynamo guards on (``s.mu['m'].placements[0] is
    s.nu['m'].placements[0]``), which the outputs of the first compiled step no longer have;
    with the ``eager`` backend every transform then compiled a second graph at step 2."""
    import optree

    def own(x):
        if not isinstance(x, DTensor):
            return x
        return DTensor.from_local(
            x.to_local().clone(),
            x.device_mesh,
            copy.deepcopy(x.placements),
            run_check=False,
            shape=x.shape,
            stride=x.stride(),
        )

    return optree.tree_map(own, tree, none_is_leaf=True)


def check(name, mesh):
    import torch._dynamo

    tx = reg.all_entries()[name]()
    params, grads = problem(mesh)
    fmesh = ft.Mesh(mesh)
    torch._dynamo.reset()
    frames = []
    backend = "inductor" if name in ALIASES else "eager"

    def counting_backend(gm, inputs):
        frames.append(gm)
        if backend == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    step = torch.compile(
        lambda g, s, p: ft.step(tx, g, s, p, mesh=fmesh),
        backend=counting_backend,
        fullgraph=name not in reg.COMPILE_GRAPH_BREAKS,
    )
    se = tx.init(params)
    sc = _own_placements(se)
    pe = pc = params
    for t, g in enumerate(grads):
        pe, se = ft.step(tx, g, se, pe, mesh=fmesh)
        pc, sc = step(g, sc, pc)
        for k in params:
            a = pc[k].full_tensor() if isinstance(pc[k], DTensor) else pc[k]
            b = pe[k].full_tensor() if isinstance(pe[k], DTensor) else pe[k]
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                return f"step {t}, params['{k}']: compiled {a} != eager {b}"
    # no recompile on the step's own outputs: one graph for the 3 steps (multi_steps and
    # galore branch on their documented CPU counters: one graph per branch), a schedule's
    # changing learning rate included (a tensor)
    limit = 2 if reg.host_reads_allowed(name) else 1
    if name not in reg.COMPILE_GRAPH_BREAKS and len(frames) > limit:
        return f"{len(frames)} graphs for 3 steps (recompiled)"
    return None


def main(rank, world):
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    names = [n for n in reg.all_entries() if (n, "compile_dtensor") not in reg.NOT_APPLICABLE]
    result = {}
    for name in names:
        try:
            result[name] = check(name, mesh)
        except Exception:  # noqa: BLE001  (reported by name to the test)
            result[name] = traceback.format_exc()[-3000:]
    return result
