"""``TorchOptimizer``: any transform as a ``torch.optim.Optimizer``, for the tools that accept
nothing else (HF ``Trainer``, Lightning, torch's LR schedulers)."""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from .base import GradientTransformation, chain
from .hyperparams import InjectHyperparamsState, inject_hyperparams, set_hyperparams

__all__ = ["TorchOptimizer"]

# this library's hyperparameter names -> torch.optim's param_group keys
_TORCH_NAMES = {"learning_rate": "lr"}


def _injected(tx: GradientTransformation):
    """``tx`` with its hyperparameters injected where it was built by one of this library's
    aliases (``update.built_with``), its float parameters filled in from their defaults; in a
    ``chain``, the one part that can be. Returns ``(transform, path to its
    InjectHyperparamsState or None)``."""
    if getattr(tx.update, "resolve", None) is not None:
        return tx, ()
    built = getattr(tx.update, "built_with", None)
    if built is not None:
        factory, arguments = built
        sig = inspect.signature(factory)
        kw = {n: p.default for n, p in sig.parameters.items()
              if isinstance(p.default, float) and n not in arguments}
        kw.update(arguments)
        return inject_hyperparams(factory)(**kw), ()
    parts = getattr(tx.update, "parts", None)
    if parts:
        found = [(i, _injected(p)) for i, p in enumerate(parts)]
        found = [(i, t) for i, (t, path) in found if path is not None]
        if len(found) == 1:
            i, t = found[0]
            new = list(parts)
            new[i] = t
            return chain(*new), (i,)
    return tx, None


def _hyper_state(state, path):
    for i in path:
        state = state[i]
    assert isinstance(state, InjectHyperparamsState)
    return state


class TorchOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that runs a transform: ``step()`` hands the parameters'
    ``.grad`` to ``ft.step(tx, grads, state, params, mesh=mesh, donate=True)`` and writes the
    new values into the parameters in place.

    ``TorchOptimizer(model.named_parameters(), ft.adamw(1e-3, weight_decay=0.1))``.

    Args:
        params: an iterable of parameters, of ``(name, parameter)`` pairs, or
            ``model.named_parameters()``; plain tensors or DTensors (``fully_shard``, tensor
            parallel). Names (given, or ``"0"``, ``"1"``... in order) are the keys of the
            params tree the transform sees (what ``mask`` callables such as
            :func:`~functional_train.decay_mask` read).
        tx: the transform. When it is one of this library's aliases (or a ``chain`` holding
            exactly one), its float hyperparameters are injected
            (:func:`~functional_train.inject_hyperparams`, defaults filled in), so that
            ``param_groups[0]`` holds them — ``"lr"`` for ``learning_rate`` (torch's name),
            ``"betas"`` for ``(b1, b2)``, the others by their own names (``eps``,
            ``weight_decay``, ``momentum``...) — and torch's LR schedulers (``LambdaLR``,
            ``OneCycleLR``, momentum cycling included, ``CosineAnnealingLR``...) drive them: the group's values
            are read at every ``step`` (the learning rate as a tensor: no rebuild, no
            recompile). A transform built with ``inject_hyperparams`` exposes what it injected.
            Any other transform runs as given, with no hyperparameter in the group.
        mesh: the :class:`~functional_train.Mesh` descriptor passed to every update.

    ``state_dict()`` / ``load_state_dict()`` round-trip the transform's state (a pytree of
    tensors / DTensors, under ``"ft_state"``) and the group's hyperparameters.
    ``zero_grad`` is torch's. Gradients are donated to the step (the fused kernels may unscale
    them in place, as ``clip_grad_norm_`` scales ``.grad`` in place). ``None`` gradients leave
    their parameter unchanged.

    Collectives: those of ``tx.update`` for the given mesh (none in one process).

    Raises:
        TypeError: ``tx`` is not a GradientTransformation; a parameter that is not a tensor.
        ValueError: no parameters; duplicate names; ``add_param_group`` after construction (one
            group: partition the transform instead, see :func:`~functional_train.partition`).
    """

    def __init__(self, params: Iterable[Any], tx: GradientTransformation, *, mesh=None):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"TorchOptimizer: tx must be a GradientTransformation, "
                            f"got {type(tx).__name__}")
        items = list(params)
        if not items:
            raise ValueError("TorchOptimizer: got no parameters")
        if all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in items):
            names, tensors = [n for n, _ in items], [p for _, p in items]
        else:
            names, tensors = [str(i) for i in range(len(items))], items
        for n, p in zip(names, tensors):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"TorchOptimizer: parameter '{n}' is a {type(p).__name__}, "
                                f"not a tensor")
        if len(set(names)) != len(names):
            raise ValueError("TorchOptimizer: duplicate parameter names")
        self._names = names
        self._tx, self._hyper_path = _injected(tx)
        self._mesh = mesh
        self._ft_state = self._tx.init(self._params_tree(tensors))
        hp = ({} if self._hyper_path is None else
              _hyper_state(self._ft_state, self._hyper_path).hyperparams)
        defaults = {_TORCH_NAMES.get(k, k): float(v) for k, v in hp.items()}
        if "b1" in defaults and "b2" in defaults:  # torch's "betas" (OneCycleLR cycles it)
            defaults["betas"] = (defaults.pop("b1"), defaults.pop("b2"))
        self._constructing = True
        super().__init__(tensors, defaults)
        self._constructing = False

    def _params_tree(self, tensors) -> dict:
        return {n: p.detach() for n, p in zip(self._names, tensors)}

    @property
    def transform(self) -> GradientTransformation:
        """The transform the optimizer runs (with its hyperparameters injected)."""
        return self._tx

    @property
    def ft_state(self) -> Any:
        """The transform's current state (read-only use: logging, ``ft.tree_get``)."""
        return self._ft_state

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_constructing", False) or self.param_groups:
            raise ValueError("TorchOptimizer: add_param_group is not supported (the transform's "
                             "state was built for the parameters given at construction; "
                             "create a new optimizer, or give every parameter at once and "
                             "use ft.partition for per-group settings)")
        super().add_param_group(param_group)

    def _sync_hyperparams(self) -> None:
        if self._hyper_path is None:
            return
        group = self.param_groups[0]
        hs = _hyper_state(self._ft_state, self._hyper_path)
        values = {}
        for k in hs.hyperparams:
            if k in ("b1", "b2") and "betas" in group:
                values[k] = group["betas"][0 if k == "b1" else 1]
            else:
                values[k] = group[_TORCH_NAMES.get(k, k)]
        self._ft_state = set_hyperparams(self._ft_state, **values)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on the parameters' ``.grad`` (the closure, when given, is called
        first with gradients enabled and its loss returned)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tensors = self.param_groups[0]["params"]
        self._sync_hyperparams()
        params = self._params_tree(tensors)
        grads = {n: p.grad for n, p in zip(self._names, tensors)}
        from .step import step as ft_step

        new, self._ft_state = ft_step(self._tx, grads, self._ft_state, params, mesh=self._mesh,
                                      donate=True)
        for n, p in zip(self._names, tensors):
            x = new[n]
            if x is not params[n]:
                p.copy_(x)
        return loss

    def state_dict(self) -> dict:
        """``{"ft_state": the transform's state, "param_groups": [group without params,
        with "param_names"]}`` (tensors are not copied)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        groups[0]["param_names"] = list(self._names)
        return {"ft_state": self._ft_state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned (the same parameter names in the same
        order).

        Raises:
            ValueError: another optimizer's state dict, or other parameter names.
        """
        if not isinstance(state_dict, dict) or "ft_state" not in state_dict:
            raise ValueError("TorchOptimizer.load_state_dict: expected the dict of "
                             "TorchOptimizer.state_dict() (with 'ft_state')")
        groups = state_dict.get("param_groups", [{}])
        names = groups[0].get("param_names", self._names)
        if list(names) != self._names:
            raise ValueError(f"TorchOptimizer.load_state_dict: the state was saved for "
                             f"parameters {list(names)[:4]}..., this optimizer has "
                             f"{self._names[:4]}...")
        self._ft_state = state_dict["ft_state"]
        for k, v in groups[0].items():
            if k not in ("params", "param_names"):
                self.param_groups[0][k] = v

    def __repr__(self) -> str:
        hp = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return f"TorchOptimizer({len(self._names)} parameters, {hp})"
