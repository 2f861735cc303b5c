"""Worker for tests/test_resume.py: ft.checkpoint on 4 gloo ranks (dp=2 x tp=2).

1. loads the plain-tensor checkpoint the test wrote in one process (``<root>/plain``) into
   DTensor templates sharded over tp (the ZeRO state over dp);
2. per optimizer, trains 4 donated ``ft.step``s on tensor parallel DTensors, saving after step 2
   (``<root>/dt-<name>``), then loads that checkpoint into fresh templates, redoes steps 3-4 and
   checks the local shards bitwise against the uninterrupted run;
3. an asynchronous save whose tensors are donated to a step before ``result()``.

Every rank returns what the test checks (rank 0's is read); checkpoints go under ``root``.
"""

import optree
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import _gloo_ckpt_worker as ckpt_worker
import functional_train as ft
from functional_train.tree import tree_paths

PLACE = {"wq": [Shard(0)], "wo": [Shard(1)], "b": [Shard(0)], "n": [Replicate()], "e": None}
SAVE_AT = 2


def optimizers():
    return {
        "adamw_zero": lambda: ft.zero_redundancy(
            ft.chain(ft.clip_by_global_norm(1.0), ft.adamw(1e-2, weight_decay=0.1))
        ),
        "adafactor_accum": lambda: ft.multi_steps(
            ft.chain(ft.clip_by_global_norm(1.0), ft.adafactor(beta1=0.9)), every_k=2
        ),
    }


def problem(steps=4):
    """tests/_gloo_ckpt_worker.py's parameters and gradients, 4 steps."""
    return ckpt_worker.problem(steps)


def full(tree):
    """Flat {path: whole tensor} of a tree's tensor leaves (DTensors gathered: collectives)."""
    leaves = optree.tree_leaves(tree, none_is_leaf=True)
    return {
        p: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
        for p, v in zip(tree_paths(tree), leaves)
        if isinstance(v, torch.Tensor)
    }


def local(tree):
    leaves = optree.tree_leaves(tree, none_is_leaf=True)
    return {
        p: v.to_local() if isinstance(v, DTensor) else v
        for p, v in zip(tree_paths(tree), leaves)
        if isinstance(v, torch.Tensor)
    }


def mismatches(a, b):
    la, lb = local(a), local(b)
    assert set(la) == set(lb)
    return [k for k in la if not torch.equal(la[k], lb[k])]


def main(rank, world, root):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    fmesh = ft.Mesh(mesh, data_axis="dp")
    params0, grads = problem()

    def place(tree):
        return {
            k: v.clone() if PLACE[k] is None else distribute_tensor(v, mesh["tp"], PLACE[k])
            for k, v in tree.items()
        }

    results = {}

    # 1. a one-process checkpoint of plain tensors into DTensor templates
    tx = optimizers()["adamw_zero"]()
    p_t = place({k: torch.zeros_like(v) for k, v in params0.items()})
    p, (s, none), step, extra = ft.checkpoint.load(f"{root}/plain", p_t, (tx.init(p_t), None))
    assert none is None and isinstance(p["wq"], DTensor) and p["wq"].placements == (Shard(0),)
    results["from_plain"] = {"params": full(p), "state": full(s), "step": step, "extra": extra}

    # 2. save at step 2 of a donated run, resume from it, compare bitwise
    for name, make in optimizers().items():
        tx = make()
        p = place(params0)
        s = tx.init(p)
        saved = None
        for i, g in enumerate(grads):
            if i == SAVE_AT:
                ft.checkpoint.save(
                    f"{root}/dt-{name}", params=p, state=s, step=i, extra={"rank0": rank}
                )
                saved = {"params": full(p), "state": full(s)}
            p, s = ft.step(tx, place(g), s, p, mesh=fmesh, donate=True)  # overwrites p, s
        p_t = place({k: torch.zeros_like(v) for k, v in params0.items()})
        p2, s2, step, extra = ft.checkpoint.load(f"{root}/dt-{name}", p_t, tx.init(p_t))
        assert step == SAVE_AT and extra == {"rank0": 0}, (step, extra)
        for g in grads[step:]:
            p2, s2 = ft.step(tx, place(g), s2, p2, mesh=fmesh, donate=True)
        results[name] = {
            "saved": saved,
            "params_mismatch": mismatches(p, p2),
            "state_mismatch": mismatches(s, s2),
        }

    # 3. asynchronous save: the tensors are staged before save returns, then donated
    want = {"params": full(p), "state": full(s)}
    pending = ft.checkpoint.save(f"{root}/async", params=p, state=s, step=9, async_save=True)
    p, s = ft.step(tx, place(grads[0]), s, p, mesh=fmesh, donate=True)
    assert pending.result() == f"{root}/async"
    p_t = place({k: torch.zeros_like(v) for k, v in params0.items()})
    p3, s3, step, _ = ft.checkpoint.load(f"{root}/async", p_t, tx.init(p_t))
    got = {"params": full(p3), "state": full(s3)}
    results["async"] = {
        "step": step,
        "mismatch": [
            f"{t}/{k}" for t in want for k in want[t] if not torch.equal(want[t][k], got[t][k])
        ],
    }

    return results
