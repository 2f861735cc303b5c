"""``torch.func`` with the library's trees: :func:`vmap` where a tree holds ``None``.

Every transform and ``ft.step`` runs under ``torch.func.vmap``, ``grad``, ``vjp`` and ``jvp`` (see
:mod:`functional_train.autograd` for what changes under them). One difference from JAX remains
in torch itself: ``torch.func.vmap`` takes only tensors as batched inputs and outputs, where
``jax.vmap`` treats ``None`` as an empty subtree. The states of ``partition``, ``masked``,
``galore``, ``muon`` and 8-bit Adam hold ``None`` for the leaves a part does not own, and a
frozen parameter's update is ``None``: :func:`vmap` is ``torch.func.vmap`` with those ``None``
leaves passed through unbatched, in and out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["vmap"]


def vmap(
    func: Callable,
    in_dims: Any = 0,
    out_dims: int = 0,
    *,
    randomness: str = "error",
    chunk_size: int | None = None,
) -> Callable:
    """``torch.func.vmap(func, in_dims, out_dims, randomness=..., chunk_size=...)``, where the
    arguments and results may hold ``None`` leaves (and other non-tensor leaves in the results,
    such as Python numbers): those are passed through unbatched, as ``jax.vmap`` passes ``None``.

    Args:
        func: any function of trees of tensors (``tx.init``, ``tx.update``, ``ft.step``, a
            training step).
        in_dims: an int or ``None`` for every positional argument, or a tuple of them (one per
            argument); the ``None`` leaves of an argument are given ``None``.
        out_dims: the batch dimension of every tensor of the result (an int; a result that
            does not depend on the batch is broadcast, as ``torch.func.vmap`` does).
        randomness, chunk_size: as ``torch.func.vmap``'s.

    Returns:
        the batched function. Examples: ``states = ft.vmap(tx.init)(params)``,
        ``params, states = ft.vmap(lambda g, s, p: ft.step(tx, g, s, p))(grads, states,
        params)`` with every tree carrying a leading model axis (an ensemble).

    Raises:
        TypeError: ``out_dims`` that is not an int, an ``in_dims`` entry that is not an int or
            ``None`` (give ``torch.func.vmap`` trees of dims yourself).
        DTensor leaves: ``torch.func.vmap`` has no batching rule for them (the library's
        transforms raise a ``TypeError`` naming the leaf under any ``torch.func`` transform).
    """
    if isinstance(out_dims, bool) or not isinstance(out_dims, int):
        raise TypeError(
            f"ft.vmap: out_dims must be an int (every tensor of the result batched along it), "
            f"got {out_dims!r}"
        )

    @functools.wraps(func)
    def batched(*args, **kwargs):
        dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
        if len(dims) != len(args):
            raise ValueError(
                f"ft.vmap: in_dims has {len(dims)} entries for {len(args)} positional arguments"
            )
        full = tuple(_dims_for(a, d) for a, d in zip(args, dims))
        spec: list = []
        constants: dict = {}

        def inner(*xs):
            out = func(*xs, **kwargs)
            leaves, treespec = pytree.tree_flatten(out)
            spec.append(treespec)
            tensors = []
            for k, x in enumerate(leaves):
                if isinstance(x, torch.Tensor):
                    tensors.append(x)
                else:
                    constants[k] = x
            return tuple(tensors)

        tensors = torch.func.vmap(
            inner, full, out_dims, randomness=randomness, chunk_size=chunk_size
        )(*args)
        treespec = spec[-1]
        it = iter(tensors)
        leaves = [constants[k] if k in constants else next(it) for k in range(treespec.num_leaves)]
        return pytree.tree_unflatten(leaves, treespec)

    return batched


def _dims_for(arg: Any, dim: Any) -> Any:
    """``dim`` (an int or ``None``) as a full tree of ``arg``'s leaves: ``None`` at its ``None``
    and other non-tensor leaves.

    Raises:
        TypeError: ``dim`` that is not an int or ``None``.
    """
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise TypeError(
            f"ft.vmap: each in_dims entry must be an int or None (one per positional "
            f"argument), got {dim!r}; give torch.func.vmap a tree of in_dims yourself"
        )
    leaves, treespec = pytree.tree_flatten(arg)
    per = [dim if isinstance(x, torch.Tensor) else None for x in leaves]
    return pytree.tree_unflatten(per, treespec)
