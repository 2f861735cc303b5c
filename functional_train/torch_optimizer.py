"""``TorchOptimizer``: any transform as a ``torch.optim.Optimizer``, for the tools that accept
nothing else (HF ``Trainer``, Lightning, torch's LR schedulers)."""

from __future__ import annotations

import copy
import inspect
import pickle
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any, NamedTuple

import optree
import torch

from .base import GradientTransformation, chain
from .engine.elementwise import read_only_updates
from .hyperparams import InjectHyperparamsState, inject_hyperparams, set_hyperparams
from .leaves import copy_into
from .spec import transform_spec
from .tree import field_paths, leaves_of, tree_flatten, tree_unflatten

__all__ = ["TorchOptimizer"]

# this library's hyperparameter names -> torch.optim's param_group keys
_TORCH_NAMES = {"learning_rate": "lr"}

# torch.optim's hyperparameter keys: a param-group dict that sets one the transform does not have
# is refused (torch would read it; silently keeping it as metadata would train on without it)
_TORCH_HYPERPARAMETERS = frozenset(
    {"lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad"}
    | {"maximize", "decoupled_weight_decay"}
)
_INJECTED_FIELD = InjectHyperparamsState._fields.index("hyperparams")


class _TorchLayout(NamedTuple):
    """How an alias' state reads as the ``torch.optim`` optimizer it reimplements: ``fields``
    maps its per-parameter state fields to torch's keys; ``flags`` its non-float arguments to
    torch's group keys (``full arguments -> {key: value}``)."""

    name: str
    fields: dict
    flags: Any


def _torch_layouts() -> dict:
    """alias -> :class:`_TorchLayout` for the aliases that are torch.optim's optimizers."""
    from .optimizers import adam, adamw, sgd

    moments = {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"}

    def adam_flags(decoupled):
        return lambda a: {
            "amsgrad": bool(a["amsgrad"]),
            "maximize": bool(a["maximize"]),
            "decoupled_weight_decay": bool(decoupled(a)),
        }

    return {
        adamw: _TorchLayout("AdamW", moments, adam_flags(lambda a: True)),
        adam: _TorchLayout("Adam", moments, adam_flags(lambda a: a["decoupled_weight_decay"])),
        sgd: _TorchLayout(
            "SGD",
            {"trace": "momentum_buffer"},
            lambda a: {"nesterov": bool(a["nesterov"]), "maximize": bool(a["maximize"])},
        ),
    }


class _Alias(NamedTuple):
    """An alias of this library a transform was built by: its factory (the ``injectable``
    wrapper) and every argument, defaults filled in."""

    factory: Any
    arguments: dict

    @classmethod
    def of(cls, tx: GradientTransformation) -> _Alias | None:
        built = transform_spec(tx).built_with
        if built is None:
            return None
        factory, arguments = built
        bound = inspect.signature(factory).bind(**arguments)
        bound.apply_defaults()
        return cls(factory, dict(bound.arguments))

    def rebuilt(self, **changes) -> GradientTransformation:
        return self.factory(**{**self.arguments, **changes})


def _injected(tx: GradientTransformation):
    """``tx`` with its hyperparameters injected where it was built by one of this library's
    aliases (its spec's ``built_with``), its float parameters filled in from their defaults; in a
    ``chain``, the one part that can be. Returns ``(transform, path to its
    InjectHyperparamsState or None, the hyperparameters given as tensors, the _Alias or
    None)``."""
    spec = transform_spec(tx)
    if spec.inject is not None:
        return tx, (), spec.inject.given_as_tensors, None
    built = spec.built_with
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
        injected = transform_spec(t).inject
        assert injected is not None
        return t, (), injected.given_as_tensors, _Alias.of(tx)
    parts = spec.parts
    if parts:
        found = [(i, _injected(p)) for i, p in enumerate(parts)]
        found = [(i, *rest) for i, (*rest,) in found if rest[1] is not None]
        if len(found) == 1:
            i, t, _, tensors, alias = found[0]
            new = list(parts)
            new[i] = t
            return chain(*new), (i,), tensors, alias
    return tx, None, frozenset(), None


def _parts(tx: GradientTransformation) -> tuple[GradientTransformation, ...]:
    """The transforms of the ``chain`` ``tx`` (one ``_injected`` made)."""
    parts = transform_spec(tx).parts
    assert parts is not None
    return parts


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
    ...: :func:`~functional_train.tree.field_paths`). Other leaves get ``"ft/" + path``
    (``"ft/count"``, ``"ft/0.global_norm"``).
    """
    index = {n: i for i, n in enumerate(names)}
    nameset = set(names)
    out, seen = [], set()
    for path in field_paths(tree_flatten(state)[1])[0]:
        parts, owner = [], None
        for spec, entry in path:
            if (
                owner is None
                and spec.kind == optree.PyTreeKind.DICT
                and spec.num_children == len(nameset)
                and set(spec.entries()) == nameset
            ):
                owner = index[entry]
            else:
                parts.append(str(entry))
        key = ".".join(parts) or "<root>"
        if owner is None:
            key = _GLOBAL + key
        base, k = key, 1
        while (owner, key) in seen:  # (dict keys holding dots could make two paths alike)
            key, k = f"{base}#{k}", k + 1
        seen.add((owner, key))
        out.append((owner, key))
    return out


class _Group(NamedTuple):
    """One parameter group: ``label`` (its ``partition`` label; ``None`` for a single
    group), ``hyper_path`` (where its InjectHyperparamsState is in the state, ``None``: no
    hyperparameters), ``given`` (its hyperparameters given as tensors), ``flags`` (torch's
    non-float group keys, fixed when the transform was built), ``fields`` (the torch layout's
    ``field -> key``, ``None`` for the generic layout), ``indices`` (its parameters' positions
    in the order given) and ``options`` (the other entries of the group dict)."""

    label: Any
    hyper_path: tuple | None
    given: frozenset
    flags: dict
    fields: dict | None
    indices: list
    options: dict


def _parse_params(params) -> tuple[list, list, bool, list | None]:
    """``(names, tensors, named, groups)`` of what torch.optim accepts as ``params``: tensors,
    ``(name, tensor)`` pairs, or param-group dicts (``{"params": ..., option: value}``);
    ``groups`` is ``[(positions, options)]`` for dicts, else ``None``."""
    where = "TorchOptimizer"
    if isinstance(params, (torch.Tensor, dict)):
        raise TypeError(
            f"{where}: params argument given to the optimizer should be an iterable of "
            f"Tensors, (name, Tensor) pairs or dicts, but got {torch.typename(params)}"
        )
    items = list(params)
    if not items:
        raise ValueError(f"{where}: got no parameters")
    dicts = [isinstance(x, dict) for x in items]
    if any(dicts) and not all(dicts):
        raise TypeError(f"{where}: params mixes param-group dicts with parameters")
    specs = items if all(dicts) else [{"params": items}]
    names: list = []
    tensors: list = []
    given_names: list = []
    groups = []
    for gi, spec in enumerate(specs):
        if "params" not in spec:
            raise ValueError(f"{where}: param group {gi} has no 'params'")
        ps = spec["params"]
        if isinstance(ps, torch.Tensor):
            ps = [ps]
        elif isinstance(ps, set):
            raise TypeError(
                f"{where}: param group {gi}'s parameters are a set; give an ordered "
                f"collection (the order numbers them in state_dict)"
            )
        ps = list(ps)
        start = len(tensors)
        for x in ps:
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
                given_names.append(x[0])
                x = x[1]
            else:
                given_names.append(None)
            tensors.append(x)
        listed = spec.get("param_names")
        if listed is not None and all(n is None for n in given_names[start:]):
            listed = list(listed)
            if len(listed) != len(ps):
                raise ValueError(
                    f"{where}: param group {gi} has {len(listed)} param_names for "
                    f"{len(ps)} parameters"
                )
            given_names[start:] = listed
        options = {k: v for k, v in spec.items() if k not in ("params", "param_names")}
        groups.append((list(range(start, len(tensors))), options))
    named = given_names[0] is not None
    if any((n is not None) != named for n in given_names):
        raise ValueError(
            f"{where}: some parameters are named and some are not; name all of them "
            f"(model.named_parameters()) or none"
        )
    names = given_names if named else [str(i) for i in range(len(tensors))]
    for n, p in zip(names, tensors):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}: parameter '{n}' is a {type(p).__name__}, not a tensor")
        if not p.is_leaf:
            raise ValueError(f"{where}: parameter '{n}' is not a leaf tensor (can't optimize it)")
    if len({id(p) for p in tensors}) != len(tensors):
        raise ValueError(f"{where}: some parameters appear more than once (or in two groups)")
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: duplicate parameter names")
    return names, tensors, named, (groups if all(dicts) else None)


def _torch_keys(hs) -> set:
    """The group keys of an InjectHyperparamsState's hyperparameters (``"betas"`` for b1, b2)."""
    return set(_group_defaults(hs))


def _split_options(options: dict, alias: _Alias | None) -> tuple[dict, dict]:
    """A group dict's options as ``(static, other)``: ``static`` are the arguments of the
    alias' factory that are not injected hyperparameters (``amsgrad``, ``nesterov``,
    ``maximize``, ``mask``...: the group gets a transform built with them), ``other`` the rest
    (hyperparameter values, torch's implementation flags, metadata)."""
    static, other = {}, {}
    params = {} if alias is None else inspect.signature(alias.factory).parameters
    for k, v in options.items():
        ours = _REVERSE_NAMES.get(k, k)
        default = params[ours].default if ours in params else None
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        if ours in params and ours != "learning_rate" and not numeric:
            static[ours] = v
        else:
            other[k] = v
    return static, other


_REVERSE_NAMES = {v: k for k, v in _TORCH_NAMES.items()}


def _plan(tx: GradientTransformation, names: list, tensors: list, specs: list | None):
    """``(transform, [_Group])``: the transform the optimizer runs (hyperparameters injected,
    param-group dicts as a ``partition`` of the injected alias) and its parameter groups."""
    where = "TorchOptimizer"
    layouts = _torch_layouts()

    def layout_of(alias):
        lay = None if alias is None else layouts.get(alias.factory)
        if lay is None:
            return {}, None
        return lay.flags(alias.arguments), dict(lay.fields)

    spec = transform_spec(tx).partition
    everything = list(range(len(names)))
    if specs is None or len(specs) == 1:
        options = {} if specs is None else dict(specs[0][1])
        labelled = spec is not None and not (
            transform_spec(tx).built_with is not None
            and all(_injected(v)[1] is None for v in spec.transforms.values())
        )  # (galore_adamw: a partition whose labels have no hyperparameters: one group)
        if labelled:
            bad = sorted(set(options) & _TORCH_HYPERPARAMETERS)
            if bad:
                raise ValueError(
                    f"{where}: a partition's groups take their hyperparameters from its "
                    f"transforms; the param-group dict sets {bad}"
                )
            from .combine import partition

            done = {k: _injected(v) for k, v in spec.transforms.items()}
            t = partition({k: d[0] for k, d in done.items()}, spec.param_labels)
            tree = {n: p.detach() for n, p in zip(names, tensors)}
            keys = [path[0] for path in optree.tree_flatten_with_path(tree, none_is_leaf=True)[0]]
            t_partition = transform_spec(t).partition
            assert t_partition is not None
            by_name = dict(zip(keys, t_partition.labels_of(tree)))  # (optree sorts dict keys)
            groups = []
            for k, (_, path, given, alias) in done.items():
                idx = [i for i in everything if by_name[names[i]] == k]
                if idx:
                    flags, fields = layout_of(alias)
                    hp = None if path is None else (0, k, *path)
                    groups.append(_Group(k, hp, given, flags, fields, idx, dict(options)))
            return t, groups
        t, path, given, alias = _injected(tx)
        static, _ = _split_options(options, alias)
        if static:
            assert alias is not None
            t, path, given, alias = _injected(alias.rebuilt(**static))
        flags, fields = layout_of(alias)
        return t, [_Group(None, path, given, flags, fields, everything, options)]
    if spec is not None:
        raise TypeError(
            f"{where}: give either param-group dicts or a partition, not both (a partition "
            f"already makes one group per label)"
        )
    t, path, given, alias = _injected(tx)
    if path is None:
        for gi, (_, options) in enumerate(specs):
            bad = sorted(set(options) & _TORCH_HYPERPARAMETERS)
            if bad:
                raise ValueError(
                    f"{where}: param group {gi} sets {bad}, but the transform has no "
                    f"hyperparameters this optimizer can set (build it with one of this "
                    f"library's aliases or with inject_hyperparams)"
                )
        return t, [_Group(None, None, frozenset(), {}, None, idx, o) for idx, o in specs]
    from .combine import partition

    part = t if path == () else _parts(t)[path[0]]
    parts, groups = {}, []
    labels = {}
    for gi, (idx, options) in enumerate(specs):
        static, _ = _split_options(options, alias)
        label = str(gi)
        if static:  # (only an alias has arguments that are not injected)
            assert alias is not None
            part_g, _, given_g, alias_g = _injected(alias.rebuilt(**static))
        else:
            part_g, given_g, alias_g = part, given, alias
        parts[label] = part_g
        labels.update({names[i]: label for i in idx})
        flags, fields = layout_of(alias_g)
        groups.append(_Group(None, (*path, 0, label), given_g, flags, fields, idx, options))
    new_part = partition(parts, labels)
    if path == ():
        return new_part, groups
    new = list(_parts(t))
    new[path[0]] = new_part
    return chain(*new), groups


class _Slot(NamedTuple):
    """Where a leaf of the transform's state goes in ``state_dict``: its parameter (``None``:
    the optimizer's), its key, the generic key also accepted on load (``None``), its kind
    (``"leaf"``; ``"hyper"``: an injected hyperparameter, held by the param group; ``"count"``:
    a step count, torch's per-parameter ``"step"``) and its group (for ``"count"``)."""

    owner: int | None
    key: str
    alt: str | None
    kind: str
    group: int | None


def _as_step(value, where: str) -> int:
    """A torch.optim ``"step"`` (a 0-dim tensor or a number holding a whole number >= 0)."""
    v = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
        raise ValueError(f"{where}: 'step' must be a whole number >= 0, got {value!r}")
    return int(v)


class _ParamState(MutableMapping):
    """``optimizer.state[p]``: the parameter's entry of :meth:`TorchOptimizer.state_dict`, read
    from the transform's state at every access; writes go into it (a key of the transform's
    state: same kind and shape, as :meth:`~TorchOptimizer.load_state_dict` takes it; a new key:
    kept beside it, in ``state_dict`` too, as torch.optim keeps what its hooks put there)."""

    __slots__ = ("_opt", "_i")

    def __init__(self, opt: TorchOptimizer, i: int):
        self._opt, self._i = opt, i

    def _entry(self) -> dict:
        return self._opt._per_param()[self._i]

    def __getitem__(self, key):
        return self._entry()[key]

    def __setitem__(self, key, value) -> None:
        opt = self._opt
        entries = opt._per_param()
        if key == "step":  # (one count per group: the others' entries follow this one)
            group = opt._group_of[self._i]
            for i, e in enumerate(entries):
                if opt._group_of[i] == group:
                    e.pop("step", None)
        entries[self._i][key] = value
        self._opt._load_entries(entries, "error", "TorchOptimizer.state[p]")

    def __delitem__(self, key) -> None:
        extra = self._opt._extra[self._i]
        if key in extra:
            del extra[key]
        elif key in self._entry():
            raise TypeError(
                f"TorchOptimizer.state[p]: '{key}' is part of the transform's state and cannot "
                f"be deleted (assign a new value, or `del optimizer.state[p]` to reset it)"
            )
        else:
            raise KeyError(key)

    def __iter__(self):
        return iter(self._entry())

    def __len__(self) -> int:
        return len(self._entry())

    def __repr__(self) -> str:
        return repr(self._entry())


class _StateView(MutableMapping):
    """``optimizer.state``: parameter -> its :class:`_ParamState`. ``state[p] = {...}`` replaces
    the parameter's entry (what it leaves out starts afresh, as after ``init``), ``del
    state[p]`` resets it; the optimizer's own leaves (step counts...) stay unless given."""

    __slots__ = ("_opt",)

    def __init__(self, opt: TorchOptimizer):
        self._opt = opt

    def _index(self, param) -> int:
        for i, p in enumerate(self._opt._params):
            if p is param:
                return i
        raise KeyError(
            f"TorchOptimizer.state: {torch.typename(param)} of shape "
            f"{tuple(getattr(param, 'shape', ()))} is not one of the optimizer's parameters"
        )

    def __getitem__(self, param):
        return _ParamState(self._opt, self._index(param))

    def __setitem__(self, param, value) -> None:
        i = self._index(param)
        if not isinstance(value, Mapping):
            raise TypeError(
                f"TorchOptimizer.state[p] = ...: expected a mapping of state keys, got "
                f"{type(value).__name__}"
            )
        entries = self._opt._per_param()
        keep = {k: v for k, v in entries[i].items() if k.startswith(_GLOBAL)}
        self._opt._extra[i] = {}
        entries[i] = {**keep, **value}
        self._opt._load_entries(entries, "fresh", "TorchOptimizer.state[p]")

    def __delitem__(self, param) -> None:
        self[param] = {}

    def __iter__(self):
        return iter(self._opt._params)

    def __len__(self) -> int:
        return len(self._opt._params)

    def __contains__(self, param) -> bool:
        return any(p is param for p in self._opt._params)

    def __repr__(self) -> str:
        return f"TorchOptimizer.state({len(self)} parameters)"


class _Pickled:
    """A transform in a pickle: its functions are closures, which ``pickle`` cannot store by
    reference, so it goes by value through cloudpickle (https://github.com/cloudpipe/cloudpickle)
    and comes back with plain ``pickle.loads``."""

    def __init__(self, tx):
        self.tx = tx

    def __reduce__(self):
        import cloudpickle

        return pickle.loads, (cloudpickle.dumps(self.tx),)


# attributes a copy or a pickle keeps (torch.optim keeps defaults, state and param_groups, and
# drops the hooks)
_KEPT = ("defaults", "param_groups", "_tx", "_mesh", "_names", "_named", "_params")
_KEPT += ("_ft_state", "_groups", "_group_of", "_extra")


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
        params: what ``torch.optim`` takes: an iterable of parameters, of ``(name, parameter)``
            pairs (``model.named_parameters()``), or of param-group dicts
            (``{"params": ..., "weight_decay": 0.0}``, their ``"params"`` parameters or pairs);
            plain tensors or DTensors (``fully_shard``, tensor parallel). Names (given, or
            ``"0"``, ``"1"``... in order) are the keys of the params tree the transform sees
            (what ``mask`` callables such as :func:`~functional_train.decay_mask` read).
        tx: the transform. When it is one of this library's aliases (or a ``chain`` holding
            exactly one), its float hyperparameters are injected
            (:func:`~functional_train.inject_hyperparams`, defaults filled in), so that
            ``param_groups[i]`` holds them — ``"lr"`` for ``learning_rate`` (torch's name),
            ``"betas"`` for ``(b1, b2)``, the others by their own names (``eps``,
            ``weight_decay``, ``momentum``...) — and torch's LR schedulers (``LambdaLR``,
            ``OneCycleLR``, momentum cycling included, ``CosineAnnealingLR``...) drive them: the
            group's values are read at every ``step`` (and checked as the alias checks them at
            construction: a NaN, infinite or negative ``lr`` raises there). A hyperparameter given
            as a 0-dim (or one-element) tensor (``ft.adamw(torch.tensor(1e-3))``, torch.optim's
            convention for compiled steps) is a 0-dim float64 tensor in the group, which the
            schedulers update in place: a ``torch.compile``-d ``step`` then does not recompile
            when the learning rate changes (other hyperparameters than the learning rate are
            read on the host, and a change of theirs rebuilds the transform). A transform built
            with ``inject_hyperparams`` exposes what it injected. Any other transform runs as
            given, with no hyperparameter in the group.

            Param-group dicts become a :func:`~functional_train.partition` of the (injected)
            alias, one label per group: a group's hyperparameter values (``"lr"``,
            ``"weight_decay"``, ``"betas"``...) are its own from the start, and a non-float
            argument of the alias (``"amsgrad"``, ``"nesterov"``, ``"maximize"``, ``"mask"``)
            builds the group's own transform. In a ``chain`` only the alias is partitioned
            (``chain(clip_by_global_norm(1.0), adamw(...))`` still clips by the norm of every
            gradient). Other keys are kept in the group (torch's ``foreach`` / ``fused``...
            flags, your own metadata); one that names a torch.optim hyperparameter the
            transform does not have raises. A :func:`~functional_train.partition` given as
            ``tx`` gives one group per label (``"label"`` in the group, its parameters in model
            order), each with its own transform's hyperparameters.
        mesh: the :class:`~functional_train.Mesh` descriptor passed to every update.

    ``state_dict()`` follows torch.optim's layout, so that
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` /
    ``set_optimizer_state_dict`` (fully qualified names, DTensor parameters of ``fully_shard``
    and tensor parallel, ``dcp.save`` / ``dcp.load`` resharding) work on it:
    ``{"state": {i: {key: tensor}}, "param_groups": [{hyperparameters..., "params": [0, 1,
    ...], "param_names": [...]}]}`` (``"param_names"`` only when the parameters were named, as
    torch). Entries are matched to parameters by position, as torch.optim does, so a state
    saved from ``model.parameters()`` loads into an optimizer built from
    ``model.named_parameters()`` and the other way round.

    For ``adamw``, ``adam`` and ``sgd`` (alone, in a chain, per group) the entries are
    torch.optim's own: ``"step"`` (a 0-dim float32 tensor, the group's step count),
    ``"exp_avg"``, ``"exp_avg_sq"``, ``"max_exp_avg_sq"`` (amsgrad), ``"momentum_buffer"``,
    and the groups carry torch's ``amsgrad``, ``maximize``, ``decoupled_weight_decay``,
    ``nesterov``: a ``torch.optim.AdamW`` / ``Adam`` / ``SGD`` state dict loads into the
    equivalent ``TorchOptimizer`` and the other way round (a parameter torch never stepped,
    absent from its state, starts from zeros; per-parameter step counts must agree within a
    group, as this optimizer keeps one per group; an SGD state, which has no step count, loads
    as step 1 where a momentum buffer is present).

    For other transforms, a leaf under a params-shaped field (a dict keyed by the parameter
    names: moments, factored statistics, projectors, 8-bit codes...) goes to its parameter's
    entry under its path in the state with the parameter left out (``"inner_state.0.mu"``);
    the others (step counts, the clipping norm: replicated plain tensors) go to the first
    trainable parameter's entry as ``"ft/" + path`` (``"ft/count"``). Injected
    hyperparameters are not in ``"state"``: the groups hold them. Every parameter has an entry
    (maybe empty).

    ``optimizer.state`` maps each parameter to the same dicts, read from the transform's state
    at every access (no second copy of the tensors); it is never empty, so torch's
    ``_init_optim_state`` does not run a zero-gradient step on it. It is writable as torch's:
    ``state[p][key] = tensor`` replaces that leaf (same shape), a new key is kept beside the
    transform's state (saved and loaded with it), ``state[p] = {...}`` / ``del state[p]``
    reset the parameter's entry, ``optimizer.state = {}`` (or ``defaultdict(dict)``) resets
    the whole state as at construction.

    ``copy.deepcopy`` and ``pickle`` give an optimizer over copies of the parameters that
    steps on (the transform is pickled with cloudpickle; hooks are dropped, as torch.optim
    drops them). ``zero_grad`` is torch's. Gradients are donated to the step (the fused kernels
    may unscale them in place, as ``clip_grad_norm_`` scales ``.grad`` in place). ``None``
    gradients leave their parameter unchanged; a step where every gradient is ``None`` changes
    no parameter.

    Collectives: those of ``tx.update`` for the given mesh (none in one process).

    Raises:
        TypeError: ``tx`` is not a GradientTransformation; a parameter that is not a tensor;
            ``params`` a single tensor; param-group dicts and a ``partition`` together.
        ValueError: no parameters; duplicate names or parameters; a non-leaf tensor; a group
            setting a hyperparameter the transform does not have; ``add_param_group`` after
            construction (the transform's state was built for the parameters given then).
    """

    def __init__(self, params: Iterable[Any], tx: GradientTransformation, *, mesh=None):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"TorchOptimizer: tx must be a GradientTransformation, got {type(tx).__name__}"
            )
        names, tensors, named, specs = _parse_params(params)
        self._tx, groups = _plan(tx, names, tensors, specs)
        self._mesh = mesh
        self._named = named
        # parameters numbered group after group, as torch.optim numbers them in state_dict
        order = [i for g in groups for i in g.indices]
        self._names = [names[i] for i in order]
        self._params = [tensors[i] for i in order]
        start, self._group_of = 0, []
        kept = []
        for gi, g in enumerate(groups):
            n = len(g.indices)
            kept.append(g._replace(indices=list(range(start, start + n))))
            self._group_of += [gi] * n
            start += n
        self._groups = kept
        self._extra: list = [{} for _ in self._names]
        self._ft_state = self._tx.init(self._params_tree(self._params))
        self._layout = None  # (treedef, [_Slot]) of the transform's state
        param_groups = []
        for gi, g in enumerate(self._groups):
            hs = None if g.hyper_path is None else _hyper_state(self._ft_state, g.hyper_path)
            defaults = _group_defaults(hs, g.given)
            _, other = _split_options(g.options, None)
            bad = sorted(
                k
                for k in other
                if k in _TORCH_HYPERPARAMETERS and k not in defaults and k not in g.flags
            )
            if bad:
                raise ValueError(
                    f"TorchOptimizer: param group {gi} sets {bad}, which its transform does not "
                    f"have (its hyperparameters: {sorted(defaults) or 'none'})"
                )
            values = {k: other[k] for k in other if k in defaults}
            group = {"params": [self._params[i] for i in g.indices], **defaults, **g.flags}
            group.update({k: v for k, v in g.options.items() if k not in group or k in values})
            if g.label is not None:
                group["label"] = g.label
            if named:
                group["param_names"] = [self._names[i] for i in g.indices]
            param_groups.append(group)
        self._constructing = True
        # (schedulers read ``defaults``: OneCycleLR looks for "betas" / "momentum" there; the
        # keys every group has, as torch.optim.Optimizer fills each group's missing keys from
        # them: another group's hyperparameter would appear where nothing reads it)
        defaults = {
            k: v
            for k, v in param_groups[0].items()
            if k not in ("params", "label", "param_names") and all(k in g for g in param_groups)
        }
        super().__init__(param_groups, defaults)
        self._constructing = False
        self._sync_hyperparams()

    # ---------------------------------------------------------------- optimizer.state
    @property
    def state(self) -> MutableMapping:  # type: ignore[override]
        """parameter -> ``{key: tensor}``: the entries of :meth:`state_dict` (the same
        tensors), writable (see the class docstring)."""
        return _StateView(self)

    @state.setter
    def state(self, value) -> None:
        if getattr(self, "_constructing", True) or isinstance(value, _StateView):
            return  # (torch.optim.Optimizer.__init__ assigns an empty defaultdict)
        if not isinstance(value, Mapping):
            raise TypeError(
                f"TorchOptimizer.state = ...: expected a mapping parameter -> state, got "
                f"{type(value).__name__}"
            )
        index = {id(p): i for i, p in enumerate(self._params)}
        unknown = [k for k in value if id(k) not in index]
        if unknown:
            raise KeyError(
                f"TorchOptimizer.state = ...: {len(unknown)} key(s) are not parameters of "
                f"this optimizer"
            )
        self._ft_state = self._tx.init(self._params_tree(self._params))
        self._extra = [{} for _ in self._names]
        self._sync_hyperparams()
        if value:
            entries = self._per_param()
            for p, e in value.items():
                entries[index[id(p)]].update(e)
            self._load_entries(entries, "fresh", "TorchOptimizer.state = ...")

    def _slots(self):
        """``(leaves, treedef, [_Slot])`` of the current state."""
        leaves, treedef = tree_flatten(self._ft_state)
        if self._layout is None or self._layout[0] != treedef:
            self._layout = (treedef, self._classify())
        return leaves, treedef, self._layout[1]

    def _classify(self) -> list:
        paths = optree.tree_flatten_with_path(self._ft_state, none_is_leaf=True)[0]
        where = [g.hyper_path for g in self._groups]
        out = []
        for path, (owner, key) in zip(paths, _leaf_keys(self._ft_state, self._names)):
            if owner is not None:
                fields = self._groups[self._group_of[owner]].fields
                last = key.rsplit(".", 1)[-1]
                if fields and last in fields:
                    out.append(_Slot(owner, fields[last], key, "leaf", None))
                else:
                    out.append(_Slot(owner, key, None, "leaf", None))
                continue
            group = next(
                (
                    gi
                    for gi, hp in enumerate(where)
                    if hp is not None and tuple(path[: len(hp)]) == tuple(hp)
                ),
                None,
            )
            kind = "leaf"
            if group is not None:
                hp = where[group]
                if len(path) > len(hp) and path[len(hp)] == _INJECTED_FIELD:
                    kind = "hyper"
                elif self._groups[group].fields is not None and key.endswith("count"):
                    kind = "count"
            out.append(_Slot(None, key, None, kind, group))
        return out

    def _global_slot(self) -> int:
        """The entry that holds the leaves of no parameter: the first trainable parameter's
        (torch's ``set_optimizer_state_dict`` drops the entries of frozen parameters)."""
        for i, p in enumerate(self._params):
            if p.requires_grad:
                return i
        return 0

    def _per_param(self) -> list:
        """Each parameter's ``state_dict`` entry (new dicts, the state's tensors)."""
        leaves, _, slots = self._slots()
        out: list = [{} for _ in self._names]
        home = self._global_slot()
        steps: dict = {}
        for slot, leaf in zip(slots, leaves):
            if leaf is None or slot.kind == "hyper":
                continue
            if slot.kind == "count":
                first = steps.setdefault(slot.group, leaf)
                if (
                    first is leaf or first.item() == leaf.item()
                ):  # (counts live on CPU or the device)
                    continue  # (torch's per-parameter "step")
            out[home if slot.owner is None else slot.owner][slot.key] = leaf
        for i, e in enumerate(out):
            count = steps.get(self._group_of[i])
            if count is not None:  # (first, as torch's; copying an entry in order sets it
                # before the counts that differ from it)
                out[i] = e = {"step": count.detach().to("cpu", torch.float32), **e}
            e.update(self._extra[i])
        return out

    def _load_entries(self, entries: list, missing: str, where: str) -> None:
        """Replace the state by the per-parameter ``entries`` (``state_dict`` layout, by
        position). ``missing="error"``: a missing key raises (except torch's state for a
        parameter it never stepped, and frozen parameters' entries, which torch's loader drops);
        ``"fresh"``: a missing key takes its value after ``init``. Validated before anything is
        replaced; keys the state does not hold are kept beside it (torch.optim keeps them)."""
        leaves, treedef, slots = self._slots()
        globals_ = {}
        for e in entries:
            for k, v in (e or {}).items():
                if isinstance(k, str) and k.startswith(_GLOBAL):
                    globals_[k] = v
        steps: dict = {}
        loaded: set = set()  # groups with a torch field present
        stepped: set = set()  # parameters with one (torch has all of them or none)
        for i, e in enumerate(entries):
            g = self._group_of[i]
            fields = self._groups[g].fields
            if fields is None or not e:
                continue
            if any(k in e for k in fields.values()):
                loaded.add(g)
                stepped.add(i)
            if "step" in e:
                v = _as_step(e["step"], f"{where}: parameter '{self._names[i]}'")
                first = steps.setdefault(g, (v, i))
                if first[0] != v:
                    raise ValueError(
                        f"{where}: parameters '{self._names[first[1]]}' and "
                        f"'{self._names[i]}' have different step counts ({first[0]}, {v}); "
                        f"this optimizer keeps one per parameter group"
                    )
        fresh: list | None = None
        used: set = set()
        new = []
        for slot, old in zip(slots, leaves):
            if old is None:
                new.append(None)
                continue
            source = globals_ if slot.owner is None else (entries[slot.owner] or {})
            name = next((n for n in (slot.key, slot.alt) if n is not None and n in source), None)
            if name is not None:
                used.add((slot.owner, name))
            if slot.kind == "hyper":
                new.append(old)  # the group's value is set after loading
                continue
            if name is not None:
                new.append(self._conform(source[name], old, name, where))
                continue
            if slot.kind == "count" and slot.group in steps:
                value = steps[slot.group][0]
            elif slot.kind == "count" and missing == "error":
                value = 1 if slot.group in loaded else 0
            elif missing == "fresh" or (slot.alt is not None and slot.owner not in stepped):
                if fresh is None:
                    fresh = tree_flatten(self._tx.init(self._params_tree(self._params)))[0]
                new.append(fresh[len(new)])
                continue
            elif slot.owner is not None and not self._params[slot.owner].requires_grad:
                new.append(old)  # torch's loader leaves frozen parameters out
                continue
            else:
                what = (
                    "the optimizer"
                    if slot.owner is None
                    else f"parameter '{self._names[slot.owner]}'"
                )
                raise ValueError(
                    f"{where}: no '{slot.key}' for {what}: the state comes from another transform"
                )
            new.append(torch.full_like(old, value))
        stray = sorted(k for k in globals_ if (None, k) not in used)
        if stray:
            raise ValueError(
                f"{where}: unexpected state keys {stray[:4]}: the state comes from another "
                f"transform"
            )
        extra: list = [{} for _ in self._names]
        for i, e in enumerate(entries):
            fields = self._groups[self._group_of[i]].fields
            for k, v in (e or {}).items():
                if (i, k) in used or (isinstance(k, str) and k.startswith(_GLOBAL)):
                    continue
                if k == "step" and fields is not None:
                    continue
                extra[i][k] = v
        self._ft_state = tree_unflatten(treedef, new)
        self._extra = extra

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
                "create a new optimizer, or give every group at construction)"
            )
        super().add_param_group(param_group)

    def _sync_hyperparams(self) -> None:
        """Each group's values (as torch's schedulers left them) into its hyperparameters
        (checked by ``set_hyperparams`` as the alias checks them); the groups' fixed flags
        unchanged."""
        self._ft_state = self._synced(self._ft_state)

    def _synced(self, state):
        """``state`` with each group's values in its hyperparameters (see
        :meth:`_sync_hyperparams`; pure)."""
        for gi, (group, g) in enumerate(zip(self.param_groups, self._groups)):
            for k, v in g.flags.items():
                if group.get(k, v) != v:
                    raise ValueError(
                        f"TorchOptimizer: param_groups[{gi}]['{k}'] is {group[k]!r}, but the "
                        f"transform was built with {v!r} (build a new optimizer to change it)"
                    )
            if g.hyper_path is None:
                continue
            hs = _hyper_state(state, g.hyper_path)
            values = {}
            for k in hs.hyperparams:
                if k in ("b1", "b2") and "betas" in group:
                    v = group["betas"][0 if k == "b1" else 1]
                else:
                    v = group[_TORCH_NAMES.get(k, k)]
                # (a copy: the scheduler writes into the group's tensor in place)
                values[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
            try:
                new = set_hyperparams(hs, **values)
            except (TypeError, ValueError) as e:
                for k, v in values.items():  # (name the group's key: set them one by one)
                    try:
                        set_hyperparams(hs, **{k: v})
                    except (TypeError, ValueError) as one:
                        key = "betas" if k in ("b1", "b2") else _TORCH_NAMES.get(k, k)
                        raise type(e)(
                            f"TorchOptimizer: param_groups[{gi}]['{key}'] = {group[key]!r}: {one}"
                        ) from one
                raise type(e)(f"TorchOptimizer: param_groups[{gi}]: {e}") from e
            state = _replace_at(state, g.hyper_path, new)
        return state

    def _ft_step(self, grads: dict, state: Any, params: dict, compiling: bool) -> tuple:
        """``ft.step`` donated, under ``torch.compile`` with the gradients read only (the
        copies in ``step`` meet an inductor fault where the step's stage operator writes them,
        see ``elementwise.read_only_updates``; the flag is read by compiled stages only).
        (A function of its own: a graph break inside a ``try`` block makes dynamo run the
        rest of its frame eagerly, and ``step``'s write-back would then compile one frame per
        leaf's dtype and rank.)"""
        from .step import step as ft_step

        previous = read_only_updates(compiling)
        try:
            return ft_step(self._tx, grads, state, params, mesh=self._mesh, donate=True)
        finally:
            read_only_updates(previous)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on the parameters' ``.grad`` (the closure, when given, is called
        first with gradients enabled and its loss returned)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tensors = self._params
        # (read once, and under torch.compile never assigned: dynamo did not always give a
        # later read of the attribute the value assigned in the same traced call)
        held = self._ft_state
        state = self._synced(held)
        if all(p.grad is None for p in tensors):
            self._ft_state = state
            return loss  # (torch.optim's steps skip parameters without a gradient: a no-op)
        params = self._params_tree(tensors)
        grads = {n: p.grad for n, p in zip(self._names, tensors)}
        compiling = torch.compiler.is_compiling()
        new, new_state = self._ft_step(grads, state, params, compiling)
        if compiling:
            # dynamo takes an optimizer's tensors as static (as torch.optim updates its state
            # in place): a graph that assigned new state tensors would read the old ones at
            # the next call. Write the new state into the held tensors instead.
            for o, x in zip(leaves_of(held), leaves_of(new_state)):
                if isinstance(o, torch.Tensor) and o is not x:
                    copy_into(o, x)
        else:
            self._ft_state = new_state
        for n, p in zip(self._names, tensors):
            x = new[n]
            if x is not params[n]:
                copy_into(p, x)
        return loss

    def state_dict(self) -> dict:
        """torch.optim's layout: ``{"state": {parameter index: {key: tensor}}, "param_groups":
        [{hyperparameters..., "params": [0, 1, ...], "param_names": [...]}]}`` (see the class
        docstring for the keys; the state's tensors, not copies)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            group = {k: v for k, v in g.items() if k != "params"}
            group["params"] = list(range(start, start + n))
            groups.append(group)
            start += n
        out = {"state": dict(enumerate(self._per_param())), "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` returned (of this class, or of the torch.optim
        optimizer the alias reimplements), or what torch's ``set_optimizer_state_dict`` hands
        over (its ``"state"`` keyed by fully qualified names, ``"params"`` listing them in this
        optimizer's order): entries are matched to parameters by position in ``"params"``, as
        torch.optim does (names are not compared). The tensors are taken, not copied (as
        torch.optim does; moved to the state's device and dtype where they differ), and the
        steps update them in place. Entries of parameters that do not require a gradient may
        be missing (torch's loader drops them): their state is kept. The groups' values
        replace this optimizer's (call it after creating the LR schedulers, as with torch).
        Still reads the ``{"ft_state": ...}`` dicts of earlier versions.

        Raises:
            ValueError: another optimizer's state dict (another number of groups or of
                parameters in a group, a group without one of this optimizer's
                hyperparameters or with other fixed flags, missing or unexpected keys,
                other shapes, different step counts within a group), or a plain tensor where
                the state holds a DTensor or the other way round (reshard through
                ``torch.distributed.checkpoint``).
        """
        where = "TorchOptimizer.load_state_dict"
        if not isinstance(state_dict, dict) or not (
            "ft_state" in state_dict or ("state" in state_dict and "param_groups" in state_dict)
        ):
            raise ValueError(
                f"{where}: expected the dict of state_dict() (with 'state' and 'param_groups')"
            )
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = state_dict.get("param_groups") or [{}]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"{where}: {len(groups)} parameter groups; this optimizer has "
                f"{len(self.param_groups)}"
            )
        for gi, (mine, saved, g) in enumerate(zip(self.param_groups, groups, self._groups)):
            if "params" in saved and len(saved["params"]) != len(mine["params"]):
                raise ValueError(
                    f"{where}: param group {gi} has {len(saved['params'])} parameters, this "
                    f"optimizer's {len(mine['params'])}"
                )
            if "ft_state" in state_dict:
                continue
            hs = None if g.hyper_path is None else _hyper_state(self._ft_state, g.hyper_path)
            lacking = sorted(_torch_keys(hs) - set(saved))
            if lacking:
                raise ValueError(
                    f"{where}: param group {gi} has no {lacking}: the state comes from "
                    f"another optimizer (its group holds {sorted(set(saved) - {'params'})})"
                )
            for k, v in g.flags.items():
                if k in saved and saved[k] != v:
                    raise ValueError(
                        f"{where}: param group {gi} was saved with {k}={saved[k]!r}, this "
                        f"optimizer's transform was built with {k}={v!r}"
                    )
        if "ft_state" in state_dict:  # the layout of earlier versions
            if tree_flatten(state_dict["ft_state"])[1] != tree_flatten(self._ft_state)[1]:
                raise ValueError(
                    f"{where}: the 'ft_state' has another structure than this optimizer's "
                    f"state: it was saved for other parameters or by another transform"
                )
            self._ft_state = state_dict["ft_state"]
        else:
            saved_ids = (
                [k for g in groups for k in g["params"]]
                if all("params" in g for g in groups)
                else list(range(len(self._names)))
            )
            position = {k: i for i, k in enumerate(saved_ids)}
            unknown = [k for k in state_dict["state"] if k not in position]
            if unknown:
                raise ValueError(
                    f"{where}: state entries {unknown[:4]} name no parameter of the groups "
                    f"({saved_ids[:4]}...)"
                )
            entries: list = [None] * len(self._names)
            for k, v in state_dict["state"].items():
                entries[position[k]] = v
            self._load_entries(entries, "error", where)
        for mine, group, g in zip(self.param_groups, groups, self._groups):
            for k, v in group.items():
                if k not in ("params", "param_names", "label") and k not in g.flags:
                    mine[k] = _keep_kind(mine.get(k), v)
        self._sync_hyperparams()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    @staticmethod
    def _conform(value: Any, old: Any, key: str, where: str) -> Any:
        """``value`` in place of the state leaf ``old`` (same kind, global shape; moved to its
        placements, device and dtype)."""
        if not isinstance(old, torch.Tensor) or value is old:
            return value
        from torch.distributed.tensor import DTensor

        if not isinstance(value, torch.Tensor) or (
            isinstance(value, DTensor) != isinstance(old, DTensor)
        ):
            raise ValueError(
                f"{where}: '{key}' is a {type(value).__name__} where the state holds a "
                f"{type(old).__name__} (load DTensor states through "
                f"torch.distributed.checkpoint's set_optimizer_state_dict)"
            )
        if value.shape != old.shape:
            raise ValueError(
                f"{where}: '{key}' has shape {tuple(value.shape)}, the state {tuple(old.shape)}"
            )
        if isinstance(value, DTensor) and (
            value.device_mesh != old.device_mesh or value.placements != old.placements
        ):
            if value.device_mesh != old.device_mesh:
                raise ValueError(
                    f"{where}: '{key}' lives on {value.device_mesh}, the state on "
                    f"{old.device_mesh} (reshard through torch.distributed.checkpoint)"
                )
            value = value.redistribute(old.device_mesh, old.placements)
        if value.dtype != old.dtype or value.device != old.device:
            value = value.to(device=old.device, dtype=old.dtype)
        return value

    # ---------------------------------------------------------------- copies
    def __getstate__(self) -> dict:
        state = {k: self.__dict__[k] for k in _KEPT}
        state["_tx"] = _Pickled(self._tx)
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        self._constructing = True
        self._layout = None
        super().__setstate__(state)
        self._constructing = False

    def __deepcopy__(self, memo: dict) -> TorchOptimizer:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = {k: self.__dict__[k] for k in _KEPT if k != "_tx"}
        new.__setstate__({"_tx": self._tx, **copy.deepcopy(state, memo)})
        return new

    def __repr__(self) -> str:
        hp = [
            {k: v for k, v in g.items() if k not in ("params", "param_names")}
            for g in self.param_groups
        ]
        return f"TorchOptimizer({len(self._names)} parameters, {hp[0] if len(hp) == 1 else hp})"
