"""``TorchOptimizer``: any transform as a ``torch.optim.Optimizer``, for the tools that accept
nothing else (HF ``Trainer``, Lightning, torch's LR schedulers)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import optree
import torch

from .base import GradientTransformation, chain
from .hyperparams import InjectHyperparamsState, inject_hyperparams, set_hyperparams
from .tree import tree_flatten, tree_unflatten

__all__ = ["TorchOptimizer"]

# this library's hyperparameter names -> torch.optim's param_group keys
_TORCH_NAMES = {"learning_rate": "lr"}


def _injected_groups(tx: GradientTransformation):
    """``(transform, {label: (path of its InjectHyperparamsState or None, names given as
    tensors)})``: for a ``partition``, each label's transform injected (:func:`_injected`), one
    parameter group per label; otherwise one group, label ``None``."""
    spec = getattr(tx.update, "partition", None)
    done = None if spec is None else {k: _injected(v) for k, v in spec[0].items()}
    if done is None or (
        getattr(tx.update, "built_with", None) is not None
        and all(path is None for _, path, _ in done.values())
    ):
        # (an alias made of a partition whose labels have no hyperparameters of their own,
        # galore_adamw: one group, the alias' hyperparameters injected)
        t, path, tensors = _injected(tx)
        return t, {None: (path, tensors)}
    from .combine import partition

    labels = spec[1]
    paths = {
        k: (None if path is None else (0, k, *path), tensors)
        for k, (_, path, tensors) in done.items()
    }
    return partition({k: t for k, (t, _, _) in done.items()}, labels), paths


def _injected(tx: GradientTransformation):
    """``tx`` with its hyperparameters injected where it was built by one of this library's
    aliases (``update.built_with``), its float parameters filled in from their defaults; in a
    ``chain``, the one part that can be. Returns ``(transform, path to its
    InjectHyperparamsState or None, the hyperparameters given as tensors)``."""
    if getattr(tx.update, "resolve", None) is not None:
        return tx, (), getattr(tx.update, "given_as_tensors", frozenset())
    built = getattr(tx.update, "built_with", None)
    if built is not None:
        factory, arguments = built
        sig = inspect.signature(factory)
        kw = {
            n: p.default
            for n, p in sig.parameters.items()
            if isinstance(p.default, float) and n not in arguments
        }
        kw.update(arguments)
        t = inject_hyperparams(factory)(**kw)
        return t, (), t.update.given_as_tensors
    parts = getattr(tx.update, "parts", None)
    if parts:
        found = [(i, _injected(p)) for i, p in enumerate(parts)]
        found = [(i, t, tensors) for i, (t, path, tensors) in found if path is not None]
        if len(found) == 1:
            i, t, tensors = found[0]
            new = list(parts)
            new[i] = t
            return chain(*new), (i,), tensors
    return tx, None, frozenset()


# state_dict keys of the state leaves that belong to no parameter (step counts, the clipping
# norm, injected hyperparameters): kept in the first trainable parameter's entry
_GLOBAL = "ft/"


def _leaf_keys(state, names: list) -> list:
    """Where each leaf of ``state`` (``tree_flatten`` order, ``None`` leaves included) goes in
    the per-parameter layout: ``(parameter index or None, key)``.

    A leaf belongs to parameter ``i`` when its path crosses a dict keyed by exactly the
    parameter names (a params-shaped field: moments, factored statistics, projectors, 8-bit
    codes...) at ``names[i]``; its key is its path with that entry left out, NamedTuple fields
    by name (``"inner_state.0.mu"``, ``"1.inner_state.0.trace"``, ``"inner_state.0.mu.codes"``
    ...). Other leaves get ``"ft/" + path`` (``"ft/count"``, ``"ft/hyperparams.learning_rate"``).
    """
    index = {n: i for i, n in enumerate(names)}
    nameset = set(names)
    params_shaped: dict = {}

    def is_params_dict(node) -> bool:
        hit = params_shaped.get(id(node))
        if hit is None:
            hit = params_shaped[id(node)] = (
                isinstance(node, dict) and len(node) == len(nameset) and set(node) == nameset
            )
        return hit

    paths, _, _ = optree.tree_flatten_with_path(state, none_is_leaf=True)
    out, seen = [], set()
    for path in paths:
        node, parts, owner = state, [], None
        for entry in path:
            if owner is None and is_params_dict(node):
                owner = index[entry]
            elif isinstance(node, tuple) and hasattr(node, "_fields") and isinstance(entry, int):
                parts.append(node._fields[entry])
            else:
                parts.append(str(entry))
            try:
                node = node[entry]
            except Exception:  # a custom pytree node: no params-shaped dict found below it
                node = None
        key = ".".join(parts) or "<root>"
        if owner is None:
            key = _GLOBAL + key
        base, k = key, 1
        while (owner, key) in seen:  # (dict keys holding dots could make two paths alike)
            key, k = f"{base}#{k}", k + 1
        seen.add((owner, key))
        out.append((owner, key))
    return out


class _StateView(Mapping):
    """``optimizer.state``: parameter -> ``{key: tensor}``, read from the transform's state at
    every access (the same tensors, never a copy)."""

    __slots__ = ("_opt",)

    def __init__(self, opt: TorchOptimizer):
        self._opt = opt

    def _params(self) -> list:
        return self._opt._params

    def __getitem__(self, param):
        for i, p in enumerate(self._params()):
            if p is param:
                return self._opt._per_param()[i]
        if isinstance(param, torch.Tensor):  # torch's defaultdict(dict): {} for the others
            return {}
        raise KeyError(param)

    def __iter__(self):
        return iter(self._params())

    def __len__(self) -> int:
        return len(self._params())

    def __contains__(self, param) -> bool:
        return any(p is param for p in self._params())

    def __repr__(self) -> str:
        return f"TorchOptimizer.state({len(self)} parameters)"


def _hyper_state(state, path):
    for i in path:
        state = state[i]
    assert isinstance(state, InjectHyperparamsState)
    return state


def _replace_at(state, path, value):
    """``state`` with the node at ``path`` (tuple indices, NamedTuple positions, dict keys)
    replaced by ``value`` (a new tree; nothing is modified)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(state, dict):
        out = dict(state)
        out[head] = _replace_at(state[head], rest, value)
        return out
    items = list(state)
    items[head] = _replace_at(state[head], rest, value)
    return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)


def _group_defaults(hs, tensors=frozenset()) -> dict:
    """A group's torch-named hyperparameters from an InjectHyperparamsState (``{}`` for None):
    Python floats, or 0-dim float64 tensors for the names in ``tensors`` (given as tensors:
    torch's schedulers then ``fill_`` them in place, and a compiled step reads them without
    recompiling)."""
    if hs is None:
        return {}
    out = {
        _TORCH_NAMES.get(k, k): v.detach().clone() if k in tensors else float(v)
        for k, v in hs.hyperparams.items()
    }
    if "b1" in out and "b2" in out:  # torch's "betas" (OneCycleLR cycles it)
        out["betas"] = (out.pop("b1"), out.pop("b2"))
    return out


def _keep_kind(old, new):
    """A loaded group value in the kind the group holds (a tensor stays a tensor, so that a
    compiled step does not recompile after ``load_state_dict``)."""
    if isinstance(old, torch.Tensor) and not isinstance(new, torch.Tensor):
        return torch.tensor(float(new), dtype=old.dtype)
    if isinstance(old, tuple) and isinstance(new, (tuple, list)) and len(old) == len(new):
        return tuple(_keep_kind(o, n) for o, n in zip(old, new))
    return new


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
            ``OneCycleLR``, momentum cycling included, ``CosineAnnealingLR``...) drive them: the
            group's values are read at every ``step``. A hyperparameter given as a 0-dim tensor
            (``ft.adamw(torch.tensor(1e-3))``, torch.optim's convention for compiled steps)
            is a 0-dim float64 tensor in the group, which the schedulers update in place: a
            ``torch.compile``-d ``step`` then does not recompile when the learning rate
            changes (other hyperparameters than the learning rate are read on the host, and a
            change of theirs rebuilds the transform). A transform built with ``inject_hyperparams``
            exposes what it injected. Any other transform runs as given, with no hyperparameter in
            the group.
            A :func:`~functional_train.partition` gives one group per label (``"label"`` in
            the group, its parameters in model order), each with its own transform's
            hyperparameters: ``partition({"decay": adamw(1e-3, weight_decay=0.1),
            "no_decay": adamw(1e-3, weight_decay=0.0)}, labels)`` is torch's usual two groups.
        mesh: the :class:`~functional_train.Mesh` descriptor passed to every update.

    ``state_dict()`` follows torch.optim's layout, so that
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` /
    ``set_optimizer_state_dict`` (fully qualified names, DTensor parameters of ``fully_shard``
    and tensor parallel, ``dcp.save`` / ``dcp.load`` resharding) work on it:
    ``{"state": {i: {key: tensor}}, "param_groups": [{hyperparameters..., "params": [0, 1,
    ...], "param_names": [...]}]}``. The transform's state is split by parameter: a leaf
    under a params-shaped field (a dict keyed by the parameter names: moments, factored
    statistics...) goes to its parameter's entry under its path in the state with the
    parameter left out (``"inner_state.0.mu"``); the others (step counts, the clipping norm,
    injected hyperparameters: replicated plain tensors) go to the first trainable
    parameter's entry as ``"ft/" + path`` (``"ft/count"``). Every parameter has an entry
    (maybe empty). ``optimizer.state`` maps each parameter to the same dicts, read from the
    transform's state at every access (no second copy of the tensors); it is never empty, so
    torch's ``_init_optim_state`` does not run a zero-gradient step on it.
    ``zero_grad`` is torch's. Gradients are donated to the step (the fused kernels may unscale
    them in place, as ``clip_grad_norm_`` scales ``.grad`` in place). ``None`` gradients leave
    their parameter unchanged.

    Collectives: those of ``tx.update`` for the given mesh (none in one process).

    Raises:
        TypeError: ``tx`` is not a GradientTransformation; a parameter that is not a tensor.
        ValueError: no parameters; duplicate names; ``add_param_group`` after construction (the
            groups come from the transform: partition it, see
            :func:`~functional_train.partition`).
    """

    def __init__(self, params: Iterable[Any], tx: GradientTransformation, *, mesh=None):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"TorchOptimizer: tx must be a GradientTransformation, got {type(tx).__name__}"
            )
        items = list(params)
        if not items:
            raise ValueError("TorchOptimizer: got no parameters")
        if all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in items):
            names, tensors = [n for n, _ in items], [p for _, p in items]
        else:
            names, tensors = [str(i) for i in range(len(items))], items
        for n, p in zip(names, tensors):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"TorchOptimizer: parameter '{n}' is a {type(p).__name__}, not a tensor"
                )
        if len(set(names)) != len(names):
            raise ValueError("TorchOptimizer: duplicate parameter names")
        self._tx, paths = _injected_groups(tx)
        self._mesh = mesh
        if None in paths:  # one group
            groups = {None: list(range(len(names)))}
        else:  # one group per partition label (labels resolved on the params tree)
            labels_of = self._tx.update.labels_of
            tree = {n: p.detach() for n, p in zip(names, tensors)}
            by_name = dict(
                zip(
                    [pth[0] for pth in optree.tree_flatten_with_path(tree, none_is_leaf=True)[0]],
                    labels_of(tree),
                )
            )
            groups = {k: [i for i, n in enumerate(names) if by_name[n] == k] for k in paths}
            groups = {k: v for k, v in groups.items() if v}
        # parameters numbered group after group, as torch.optim numbers them in state_dict
        order = [i for idx in groups.values() for i in idx]
        self._names = [names[i] for i in order]
        self._params = [tensors[i] for i in order]
        self._ft_state = self._tx.init(self._params_tree(self._params))
        self._hyper_paths = [paths[k][0] for k in groups]
        param_groups = []
        for k, idx in groups.items():
            path, given = paths[k]
            hs = None if path is None else _hyper_state(self._ft_state, path)
            g = {"params": [tensors[i] for i in idx], **_group_defaults(hs, given)}
            if k is not None:
                g["label"] = k
            param_groups.append(g)
        self._layout = None  # (treedef, _leaf_keys) of the transform's state
        self._constructing = True
        # (schedulers read ``defaults``: OneCycleLR looks for "betas" / "momentum" there; the
        # keys every group has, as torch.optim.Optimizer fills each group's missing keys from
        # them: another group's hyperparameter would appear where nothing reads it)
        defaults = {
            k: v
            for k, v in param_groups[0].items()
            if k not in ("params", "label") and all(k in g for g in param_groups)
        }
        super().__init__(param_groups, defaults)
        self._constructing = False

    # torch.optim.Optimizer.__init__ assigns ``self.state = defaultdict(dict)``: ignored, the
    # per-parameter state is a view of the transform's state
    @property
    def state(self) -> Mapping:  # type: ignore[override]
        """parameter -> ``{key: tensor}``: the entries of :meth:`state_dict` (the same
        tensors, read-only view)."""
        return _StateView(self)

    @state.setter
    def state(self, value) -> None:
        del value

    def _keys(self):
        """``(leaves, treedef, [(parameter index or None, key)])`` of the current state."""
        leaves, treedef = tree_flatten(self._ft_state)
        if self._layout is None or self._layout[0] != treedef:
            self._layout = (treedef, _leaf_keys(self._ft_state, self._names))
        return leaves, treedef, self._layout[1]

    def _global_slot(self) -> int:
        """The entry that holds the leaves of no parameter: the first trainable parameter's
        (torch's ``set_optimizer_state_dict`` drops the entries of frozen parameters)."""
        for i, p in enumerate(self._params):
            if p.requires_grad:
                return i
        return 0

    def _per_param(self) -> list:
        leaves, _, keys = self._keys()
        out: list = [{} for _ in self._names]
        slot = self._global_slot()
        for (owner, key), leaf in zip(keys, leaves):
            if leaf is not None:
                out[slot if owner is None else owner][key] = leaf
        return out

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
        if not getattr(self, "_constructing", False):
            raise ValueError(
                "TorchOptimizer: add_param_group is not supported (the transform's "
                "state was built for the parameters given at construction; "
                "create a new optimizer, or give every parameter at once and "
                "use ft.partition for per-group settings)"
            )
        super().add_param_group(param_group)

    def _sync_hyperparams(self) -> None:
        """Each group's values (as torch's schedulers left them) into its hyperparameters."""
        state = self._ft_state
        for group, path in zip(self.param_groups, self._hyper_paths):
            if path is None:
                continue
            hs = _hyper_state(state, path)
            values = {}
            for k in hs.hyperparams:
                if k in ("b1", "b2") and "betas" in group:
                    v = group["betas"][0 if k == "b1" else 1]
                else:
                    v = group[_TORCH_NAMES.get(k, k)]
                # (a copy: the scheduler writes into the group's tensor in place)
                values[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
            state = _replace_at(state, path, set_hyperparams(hs, **values))
        self._ft_state = state

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on the parameters' ``.grad`` (the closure, when given, is called
        first with gradients enabled and its loss returned)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tensors = self._params
        self._sync_hyperparams()
        params = self._params_tree(tensors)
        grads = {n: p.grad for n, p in zip(self._names, tensors)}
        from .step import step as ft_step

        old_state = self._ft_state
        new, self._ft_state = ft_step(
            self._tx, grads, old_state, params, mesh=self._mesh, donate=True
        )
        if torch.compiler.is_compiling():
            # dynamo takes an optimizer's tensors as static (as torch.optim updates its state
            # in place): a graph that assigned new state tensors would read the old ones at
            # the next call. Write the new state into the old tensors instead.
            for o, x in zip(optree.tree_leaves(old_state), optree.tree_leaves(self._ft_state)):
                if isinstance(o, torch.Tensor) and o is not x:
                    o.copy_(x)
            self._ft_state = old_state
        for n, p in zip(self._names, tensors):
            x = new[n]
            if x is not params[n]:
                p.copy_(x)
        return loss

    def state_dict(self) -> dict:
        """torch.optim's layout: ``{"state": {parameter index: {key: tensor}}, "param_groups":
        [{hyperparameters..., "params": [0, 1, ...], "param_names": [...]}]}`` (see the class
        docstring for the keys; tensors are not copied)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            group = {k: v for k, v in g.items() if k != "params"}
            group["params"] = list(range(start, start + n))
            group["param_names"] = self._names[start : start + n]
            groups.append(group)
            start += n
        out = {"state": dict(enumerate(self._per_param())), "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned, or what torch's
        ``set_optimizer_state_dict`` hands over (its ``"state"`` keyed by fully qualified names,
        ``"params"`` listing them in this optimizer's order): entries are matched to parameters
        by position in ``"params"``, as torch.optim does. The tensors are taken, not copied
        (as torch.optim does; moved to the state's device and dtype where they differ), and the
        steps update them in place. Entries of parameters that do not require a gradient may
        be missing (torch's loader drops them): their state is kept. Still reads the
        ``{"ft_state": ...}`` dicts of earlier versions.

        Raises:
            ValueError: another optimizer's state dict (other parameter names or count,
                missing or unexpected keys, other shapes), or a plain tensor where the state
                holds a DTensor or the other way round (reshard through
                ``torch.distributed.checkpoint``).
        """
        if not isinstance(state_dict, dict) or not (
            "ft_state" in state_dict or ("state" in state_dict and "param_groups" in state_dict)
        ):
            raise ValueError(
                "TorchOptimizer.load_state_dict: expected the dict of "
                "TorchOptimizer.state_dict() (with 'state' and 'param_groups')"
            )
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = state_dict.get("param_groups") or [{}]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"TorchOptimizer.load_state_dict: {len(groups)} parameter groups; "
                f"this optimizer has {len(self.param_groups)}"
            )
        names = (
            [n for g in groups for n in g["param_names"]]
            if all("param_names" in g for g in groups)
            else self._names
        )
        if list(names) != self._names:
            raise ValueError(
                f"TorchOptimizer.load_state_dict: the state was saved for "
                f"parameters {list(names)[:4]}..., this optimizer has "
                f"{self._names[:4]}..."
            )
        if "ft_state" in state_dict:  # the layout of earlier versions
            self._ft_state = state_dict["ft_state"]
        else:
            self._ft_state = self._rebuild(state_dict["state"], groups)
        for mine, group in zip(self.param_groups, groups):
            for k, v in group.items():
                if k not in ("params", "param_names"):
                    mine[k] = _keep_kind(mine.get(k), v)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _rebuild(self, state: dict, groups: list) -> Any:
        """The transform's state from the per-parameter entries, on the current one as
        template (validated before anything is replaced)."""
        where = "TorchOptimizer.load_state_dict"
        saved = (
            [k for g in groups for k in g["params"]]
            if all("params" in g for g in groups)
            else list(range(len(self._names)))
        )
        if len(saved) != len(self._names):
            raise ValueError(
                f"{where}: the state was saved for {len(saved)} parameters, this "
                f"optimizer has {len(self._names)}"
            )
        position = {k: i for i, k in enumerate(saved)}
        unknown = [k for k in state if k not in position]
        if unknown:
            raise ValueError(
                f"{where}: state entries {unknown[:4]} name no parameter of the "
                f"group ({saved[:4]}...)"
            )
        entries: list = [None] * len(saved)
        for k, v in state.items():
            entries[position[k]] = v
        globals_ = {}
        for e in entries:
            for k, v in (e or {}).items():
                if isinstance(k, str) and k.startswith(_GLOBAL):
                    globals_[k] = v
        leaves, treedef, keys = self._keys()
        params = self._params
        used: set = set()
        new = []
        for (owner, key), old in zip(keys, leaves):
            if old is None:
                new.append(None)
                continue
            source = globals_ if owner is None else (entries[owner] or {})
            if key not in source:
                if owner is not None and not params[owner].requires_grad:
                    new.append(old)  # torch's loader leaves frozen parameters out
                    continue
                what = "the optimizer" if owner is None else f"parameter '{self._names[owner]}'"
                raise ValueError(
                    f"{where}: no '{key}' for {what}: the state comes from another transform"
                )
            used.add((owner, key))
            new.append(self._conform(source[key], old, key))
        extra = [
            k
            for i, e in enumerate(entries)
            for k in (e or {})
            if (None if isinstance(k, str) and k.startswith(_GLOBAL) else i, k) not in used
        ]
        if extra:
            raise ValueError(
                f"{where}: unexpected state keys {sorted(map(str, extra))[:4]}: "
                f"the state comes from another transform"
            )
        return tree_unflatten(treedef, new)

    @staticmethod
    def _conform(value: Any, old: Any, key: str) -> Any:
        """``value`` in place of the state leaf ``old`` (same kind, global shape; moved to its
        placements, device and dtype)."""
        if not isinstance(old, torch.Tensor) or value is old:
            return value
        from torch.distributed.tensor import DTensor

        if not isinstance(value, torch.Tensor) or (
            isinstance(value, DTensor) != isinstance(old, DTensor)
        ):
            raise ValueError(
                f"TorchOptimizer.load_state_dict: '{key}' is a "
                f"{type(value).__name__} where the state holds a "
                f"{type(old).__name__} (load DTensor states through "
                f"torch.distributed.checkpoint's set_optimizer_state_dict)"
            )
        if value.shape != old.shape:
            raise ValueError(
                f"TorchOptimizer.load_state_dict: '{key}' has shape "
                f"{tuple(value.shape)}, the state {tuple(old.shape)}"
            )
        if isinstance(value, DTensor) and (
            value.device_mesh != old.device_mesh or value.placements != old.placements
        ):
            if value.device_mesh != old.device_mesh:
                raise ValueError(
                    f"TorchOptimizer.load_state_dict: '{key}' lives on "
                    f"{value.device_mesh}, the state on {old.device_mesh} (reshard "
                    f"through torch.distributed.checkpoint)"
                )
            value = value.redistribute(old.device_mesh, old.placements)
        if value.dtype != old.dtype or value.device != old.device:
            value = value.to(device=old.device, dtype=old.dtype)
        return value

    def __repr__(self) -> str:
        hp = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return f"TorchOptimizer({len(self._names)} parameters, {hp[0] if len(hp) == 1 else hp})"
