"""Pytree helpers on top of optree.

Every tree in functional_train is flattened with ``none_is_leaf=True`` so that a ``None`` gradient
(a frozen parameter) keeps its place next to the parameter it belongs to. Tensors and DTensors are
leaves. Paths are rendered as dotted strings (``layers.0.attn.wq``) in error messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import optree
import torch

__all__ = [
    "tree_flatten",
    "tensors_or_none",
    "plain_node",
    "tensors_into",
    "CONSTANT_TYPES",
    "tree_unflatten",
    "tree_paths",
    "tree_zeros_like",
    "state_zeros_like",
    "state_dtype",
    "tree_cast",
    "tree_get",
    "format_path",
    "field_paths",
    "contiguous_stride",
]

#: A pytree of tensors (``torch.Tensor`` / ``DTensor`` leaves, ``None`` for frozen leaves):
#: params, updates and optimizer states (optax's ``Params`` / ``Updates`` / ``OptState``).
#: Defined here once; every module that annotates a tree imports it.
PyTree = Any


def tree_flatten(tree: PyTree):
    """Flatten ``tree`` keeping ``None`` leaves; returns ``(leaves, treedef)``.

    A dict of tensors (or ``None``) under the keys of one seen before, in the same insertion
    order (``dict(model.named_parameters())``, the gradients and states shaped like it), takes
    the treedef of that call and ``flatten_up_to`` (a lookup per key, where optree's flatten
    sorts the keys every call: about 4 us against 28 us at 122 leaves); the same leaves and
    treedef either way. Under ``torch.compile`` a flat dict of string keys (seen before or
    not) gets a :class:`FlatDictDef`. Everything else is optree's."""
    if torch.compiler.is_compiling():
        leaves = flat_dict_leaves(tree)
        if leaves is not None:
            return leaves, FlatDictDef(tuple(tree))
        return optree.tree_flatten(tree, none_is_leaf=True)
    cacheable = type(tree) is dict
    key = tuple(tree) if cacheable else None
    if key is not None:
        hit = _DICT_DEFS.get(key)
        fast = None if hit is None else _up_to(hit, tree)
        if fast is not None:
            return fast, hit
    leaves, td = optree.tree_flatten(tree, none_is_leaf=True)
    if key is not None and td.num_nodes == len(key) + 1 and tensors_or_none(leaves):
        if len(_DICT_DEFS) >= 64:  # (a flat dict: its treedef for the next one of its keys)
            _DICT_DEFS.clear()
        _DICT_DEFS[key] = td
    return leaves, td


_DICT_DEFS: dict = {}  # a flat dict's keys in insertion order -> its treedef


class FlatDictDef:
    """The treedef :func:`tree_flatten` gives under ``torch.compile`` for a flat dict (string
    keys, tensor or ``None`` values: what :func:`flat_dict_leaves` takes): its keys in
    insertion order (``keys``) and sorted (``sorted_keys``, the leaves' order, as optree
    orders a dict). It answers ``num_leaves``, ``num_nodes``, ``type``, ``paths`` and
    ``entries`` itself, and :func:`tree_unflatten` and :func:`flatten_as` take it; any other
    attribute of optree's ``PyTreeSpec`` (``flatten_up_to``, ``children``, comparison with
    one) comes from the equal optree treedef, built on first use by :meth:`optree_def`.

    Why: dynamo runs optree as Python, and building a dict treedef there makes a treespec
    object per key (about 2,700 traced bytecodes for 7 keys, 17,000 for the 122 of the
    benchmark tree; each ``tree_flatten`` of a step's trees built one); this class takes 71
    for 7 keys."""

    __slots__ = ("keys", "sorted_keys", "num_leaves", "_optree")
    type = dict

    def __init__(self, keys: tuple):
        self.keys = keys
        self.sorted_keys = tuple(sorted(keys))
        self.num_leaves = len(keys)
        self._optree = None

    @property
    def num_nodes(self) -> int:
        return self.num_leaves + 1

    def unflatten(self, leaves: Sequence[Any]) -> dict:
        """The dict of ``leaves`` (in ``sorted_keys`` order) under ``keys``' order.

        Raises:
            ValueError: not ``num_leaves`` leaves."""
        leaves = list(leaves)
        if len(leaves) != self.num_leaves:
            raise ValueError(f"{len(leaves)} leaves given to a treedef of {self.num_leaves}")
        by_key = {k: x for k, x in zip(self.sorted_keys, leaves)}
        return {k: by_key[k] for k in self.keys}

    def paths(self) -> list:
        """Each leaf's path, optree's ``PyTreeSpec.paths``: ``[(key,), ...]``, sorted keys."""
        return [(k,) for k in self.sorted_keys]

    def entries(self) -> list:
        """The root's child keys, optree's ``PyTreeSpec.entries``: the sorted keys."""
        return list(self.sorted_keys)

    def optree_def(self):
        """The equal ``optree.PyTreeSpec`` (made once)."""
        if self._optree is None:
            leaf = optree.treespec_leaf(none_is_leaf=True)
            self._optree = optree.treespec_dict({k: leaf for k in self.keys}, none_is_leaf=True)
        return self._optree

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_optree":
            raise AttributeError(name)
        return getattr(self.optree_def(), name)

    def __eq__(self, other) -> bool:
        if isinstance(other, FlatDictDef):
            return self.sorted_keys == other.sorted_keys
        return self.optree_def() == other

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.sorted_keys)

    def __repr__(self) -> str:
        return f"FlatDictDef({self.keys!r})"


_NONE_TYPE = type(None)
_PLAIN_LEAF_TYPES = {torch.Tensor, _NONE_TYPE}


def plain_node(kind: type) -> bool:
    """Whether a node of this type is one the library's tree walks take apart themselves
    (a ``dict``, ``list`` or ``tuple``, not a subclass, or a NamedTuple: the states), each of
    which optree flattens as a node, its children in the same order (a dict's in insertion
    order: a walk that pairs or collects leaves, not one that lists them in optree's order).
    Any other node (a dict subclass, a ``deque``, a registered class) is optree's to flatten."""
    return kind is dict or kind is list or kind is tuple or optree.is_namedtuple_class(kind)


#: Leaf types of a state that hold no tensor (a walk passes them by).
CONSTANT_TYPES = frozenset({int, float, bool, complex, str, bytes})


def tensors_into(tree: PyTree, out: list) -> bool:
    """Append ``tree``'s tensor leaves (of any tensor type) to ``out`` without flattening it
    (in no particular order, and ``None`` among them where a node of tensors holds ``None``:
    for a caller that records or looks tensors up, not one that pairs them); ``True``. The
    :func:`plain_node` nodes walked here, a node of tensors by one C ``extend``; any other
    node by its leaves (:func:`leaves_of`, optree's)."""
    kind = type(tree)
    if issubclass(kind, torch.Tensor):
        out.append(tree)
    elif tree is None or kind in CONSTANT_TYPES:
        pass
    elif plain_node(kind):
        xs = tree.values() if kind is dict else tree
        if tensors_or_none(xs):
            out.extend(xs)
        else:
            for x in xs:
                tensors_into(x, out)
    else:
        out.extend(x for x in leaves_of(tree) if isinstance(x, torch.Tensor))
    return True


def tensors_or_none(leaves: Iterable[Any]) -> bool:
    """Every element a tensor (of any subclass) or ``None``: no structure below them (a C
    loop over their types; plain tensors and ``None`` by one set comparison)."""
    kinds = set(map(type, leaves))
    if kinds <= _PLAIN_LEAF_TYPES:
        return True
    return all(t is _NONE_TYPE or issubclass(t, torch.Tensor) for t in kinds)


def _up_to(treedef, tree: PyTree) -> list | None:
    """``tree``'s leaves by ``treedef`` when both are a flat ``dict`` (not a subclass: optree's
    ``flatten_up_to`` takes an ``OrderedDict`` for a dict, in another order) of the same keys
    with tensor (or ``None``) leaves, else ``None`` (the caller flattens it in full, and
    raises there)."""
    if (
        type(tree) is not dict
        or treedef.type is not dict
        or treedef.num_nodes != treedef.num_leaves + 1
    ):
        return None
    try:
        leaves = treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        return None
    return leaves if tensors_or_none(leaves) else None


def tree_unflatten(treedef, leaves: Sequence[Any]) -> PyTree:
    """Inverse of :func:`tree_flatten`. Under ``torch.compile``, a treedef dynamo built (its
    Python stand-in for optree's ``PyTreeSpec``) is unflattened by :func:`_traced_unflatten`;
    a :class:`FlatDictDef` by its own ``unflatten``."""
    if type(treedef) is FlatDictDef:
        return treedef.unflatten(leaves)
    if torch.compiler.is_compiling() and type(treedef) is not optree.PyTreeSpec:
        return _traced_unflatten(treedef, list(leaves))
    return optree.tree_unflatten(treedef, list(leaves))


def _traced_unflatten(treedef, leaves: list) -> PyTree:
    """``leaves`` unflattened into ``treedef``, a treespec built by dynamo's pytree polyfill
    (``torch._dynamo.polyfills.pytree.PyTreeSpec``), node by node: each dict node from the
    polyfill's metadata (its keys in insertion order and sorted), every other node by its own
    unflatten function.

    Works around torch 2.13's dynamo: the polyfill keeps, for a dict node, that metadata
    beside optree's own dict unflatten function (it substitutes its own only where it traces
    the call by name); where the treespec outlives a graph break (a transform that reads a
    value on the host, e.g. ``galore``'s refresh counter or a user's ``.item()``, inside
    ``partition``), the resumed frame calls optree's function with the polyfill's metadata,
    and ``ValueError: length mismatch`` is raised.

    Raises:
        ValueError: ``leaves`` not as many as ``treedef``'s leaves.
    """
    if len(leaves) != treedef.num_leaves:
        raise ValueError(f"{len(leaves)} leaves given to a treedef of {treedef.num_leaves}")
    meta = treedef._metadata
    if treedef.type is dict and isinstance(meta, tuple) and treedef.num_nodes == len(leaves) + 1:
        return FlatDictDef(tuple(meta[0])).unflatten(leaves)  # (a flat dict: no node to walk)
    it = iter(leaves)

    def build(node):
        if node.is_leaf():
            return next(it)
        children = [build(c) for c in node.children()]
        meta = node._metadata
        if node.type is dict and isinstance(meta, tuple):
            original, ordered = meta
            by_key = dict(zip(ordered, children))
            return {k: by_key[k] for k in original}
        return node._unflatten_func(meta, children)

    return build(treedef)


def format_path(path: tuple) -> str:
    """Render an optree path tuple as a dotted string; the root is ``<root>``."""
    return ".".join(str(p) for p in path) if path else "<root>"


def field_paths(treedef) -> tuple[list[tuple], list[tuple]]:
    """The paths of a treedef's leaves and of its containers, with the fields of NamedTuples
    (the optimizer states) by name, where optree's paths give their positions.

    Returns ``(leaves, containers)``: for each leaf in flatten order (``None`` leaves
    included), its path from the root as ``((container spec, entry), ...)`` pairs (a
    NamedTuple's field name, a dict's key, a sequence's index: the raw entry); and every
    container, empty ones (``EmptyState``) included, as ``(path, spec)`` in depth-first order.
    ``spec.kind``, ``spec.type`` and ``spec.entries()`` tell the containers apart. The keys of
    ``TorchOptimizer.state_dict`` and of the checkpoint manifests are built from these paths.
    """
    leaves: list[tuple] = []
    containers: list[tuple] = []

    def visit(spec, path: tuple) -> None:
        if spec.is_leaf():
            leaves.append(path)
            return
        containers.append((path, spec))
        named = spec.kind == optree.PyTreeKind.NAMEDTUPLE
        entries = spec.type._fields if named else spec.entries()
        for entry, child in zip(entries, spec.children()):
            visit(child, (*path, (spec, entry)))

    visit(treedef, ())
    return leaves, containers


def tree_paths(tree: PyTree) -> list[str]:
    """Dotted paths of the leaves of ``tree`` (``None`` leaves included), in flatten order."""
    paths, _, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    return [format_path(p) for p in paths]


def _first_mismatch(expected: PyTree, got: PyTree) -> str:
    """A human readable description of where ``got`` first differs from ``expected``."""
    ep, _, _ = optree.tree_flatten_with_path(expected, none_is_leaf=True)
    gp, _, _ = optree.tree_flatten_with_path(got, none_is_leaf=True)
    es, gs = [format_path(p) for p in ep], [format_path(p) for p in gp]
    missing = [p for p in es if p not in set(gs)]
    extra = [p for p in gs if p not in set(es)]
    if missing:
        return f"leaf '{missing[0]}' is missing ({len(es)} leaves expected, {len(gs)} given)"
    if extra:
        return f"leaf '{extra[0]}' is unexpected ({len(es)} leaves expected, {len(gs)} given)"
    for a, b in zip(es, gs):
        if a != b:
            return f"expected leaf '{a}' where '{b}' is"
    return "same leaf paths but different container types"


def flatten_as(
    tree: PyTree, treedef, what: str, reference: str = "params", reference_tree: PyTree = None
) -> list:
    """Flatten ``tree`` and check it has the structure ``treedef``.

    Raises:
        ValueError: naming the first leaf path where ``tree`` differs from ``reference``.
    """
    if torch.compiler.is_compiling():
        # dynamo cannot flatten a dict whose values are all constants (an all-None state
        # field) with optree.tree_flatten, nor compare its treedef with a real one; the
        # structure was checked by the eager calls (init builds the state), count the leaves
        leaves = flat_dict_leaves(tree, treedef)
        if leaves is None:
            leaves = _traced_leaves(tree)
        if len(leaves) != treedef.num_leaves:
            raise ValueError(f"{what} has {len(leaves)} leaves, {reference} {treedef.num_leaves}")
        return leaves
    fast = _up_to(treedef, tree)  # (the structure checked by the lookup: no sort, no compare)
    if fast is not None:
        return fast
    leaves, td = tree_flatten(tree)
    if td != treedef:
        expected = (
            reference_tree
            if reference_tree is not None
            else tree_unflatten(treedef, [0] * treedef.num_leaves)
        )
        raise ValueError(
            f"{what} does not have the structure of {reference}: {_first_mismatch(expected, tree)}"
        )
    return leaves


def flat_dict_leaves(tree: PyTree, treedef=None) -> list | None:
    """The leaves of ``tree`` in optree's order when it is a dict of tensors (or ``None``)
    under string keys (``dict(model.named_parameters())`` and the states shaped like it), by
    plain indexing in sorted key order, as optree orders a dict; else ``None``. For code that
    ``torch.compile`` traces: dynamo runs optree's flattening as Python, several inlined calls
    per node (0.3 to 0.6 s of tracing per flattened 122-leaf tree), and a dict's values in
    a loop cost a fraction of that. Where ``treedef``, the structure the caller holds ``tree``
    to, is a flat dict's of as many leaves (one node and a leaf per key), the values are not
    looked at; else they are by ``all(map(torch.is_tensor, ...))`` where none is ``None``
    (dynamo's ``all`` traces a few bytecodes a value: this function traced 98 bytecodes a call
    at 7 leaves and 673 at 122, where its loops over the keys and the values took 225 and
    2,985)."""
    if type(tree) is not dict:
        return None
    keys = _sorted_str_keys(tree)
    if keys is None:
        return None
    leaves = list(map(tree.__getitem__, keys))  # (no comprehension frame to trace)
    if treedef is not None and len(leaves) == treedef.num_leaves == treedef.num_nodes - 1:
        return leaves
    if None in leaves:  # (rare: a state field held for some leaves only)
        for x in leaves:
            if x is not None and not isinstance(x, torch.Tensor):
                return None
    elif not all(map(torch.is_tensor, leaves)):
        return None
    return leaves


def _sorted_str_keys(d: dict) -> list | None:
    """``d``'s keys sorted, where they are strings (sortable together, as optree sorts a
    dict's keys); else ``None``. One ``sorted``, which dynamo folds on a dict's constant keys
    (34 traced bytecodes whatever their number), not a check per key (89 at 7 keys, 1,239 at
    122): keys that sort together with a string are strings (or of a type that orders itself
    against them, which optree sorts the same way)."""
    try:
        keys = sorted(d)
    except TypeError:  # (keys of types that do not compare: optree's own order)
        return None
    return keys if not keys or type(keys[0]) is str else None


def indexed(first: Sequence, *rest: Iterable) -> Iterator[tuple]:
    """``(i, first[i], rest[0][i], ...)``: ``enumerate(zip(first, *rest))`` flattened, for
    loops ``torch.compile`` traces. It is ``zip(range(len(first)), first, *rest)``, which dynamo
    runs natively, where it runs ``enumerate`` as a Python generator: a 7-item comprehension
    over ``enumerate`` traced 202 bytecodes, over this 104."""
    return zip(range(len(first)), first, *rest)


def leaves_of(tree: PyTree) -> list:
    """``tree``'s leaves (``None`` leaves included), by :func:`flat_dict_leaves` under
    ``torch.compile`` where it takes the tree, else by :func:`_traced_leaves` there; eagerly
    a dict's by :func:`tree_flatten` (its treedef remembered by the keys), the rest by optree.
    Where only the leaves are wanted, this and not ``tree_flatten(tree)[0]``: under compile
    building a treedef is traced too."""
    if torch.compiler.is_compiling():
        leaves = flat_dict_leaves(tree)
        if leaves is not None:
            return leaves
        return _traced_leaves(tree)
    if type(tree) is dict:  # (tree_flatten's remembered treedef of a flat dict's keys)
        return tree_flatten(tree)[0]
    return optree.tree_leaves(tree, none_is_leaf=True)


def _traced_leaves(tree: PyTree) -> list:
    """``optree.tree_leaves(tree, none_is_leaf=True)`` for code ``torch.compile`` traces, the
    containers optree flattens by their built-in rules walked here: tuples, lists, dicts under
    string keys (in sorted key order), and this library's NamedTuples (its states; by field);
    anything else (a user's NamedTuple or registered node, a number) by optree. Dynamo runs
    optree's flattening as Python, a registry lookup and a treespec object per node: the
    state of ``TorchOptimizer(adafactor)`` on five leaves took about 9,000 traced bytecodes
    a flatten (a fifth of the compiled step's tracing), this walk a small part of that."""
    out: list = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if x is None or isinstance(x, torch.Tensor):
            out.append(x)
            continue
        t = type(x)
        if t is tuple or t is list or _own_namedtuple(t):
            stack.extend(x[::-1])
            continue
        if t is dict:
            keys = _sorted_str_keys(x)
            if keys is not None:
                stack.extend(map(x.__getitem__, reversed(keys)))
                continue
        out.extend(optree.tree_leaves(x, none_is_leaf=True))
    return out


def _own_namedtuple(t: type) -> bool:
    """A NamedTuple class of this library (its states: no optree registration of their own,
    so optree flattens them by field, as tuples)."""
    return issubclass(t, tuple) and hasattr(t, "_fields") and t.__module__.startswith(_PACKAGE)


_PACKAGE = __name__.rpartition(".")[0] + "."


def unflatten_like(tree: PyTree, treedef, leaves: Sequence[Any]) -> PyTree:
    """:func:`tree_unflatten` of ``leaves`` into ``treedef``, where ``tree`` has that
    structure: for a dict :func:`flat_dict_leaves` takes, a dict in ``tree``'s key order
    built by indexing (see there; under ``torch.compile`` only)."""
    if torch.compiler.is_compiling() and flat_dict_leaves(tree, treedef) is not None:
        return FlatDictDef(tuple(tree)).unflatten(leaves)
    return tree_unflatten(treedef, leaves)


def tree_zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """Zeros shaped like every tensor leaf (DTensors keep mesh and placements); ``None`` stays."""
    return optree.tree_map(
        lambda x: None if x is None else torch.zeros_like(x, dtype=dtype), tree, none_is_leaf=True
    )


def contiguous_stride(shape) -> tuple:
    """The strides of a contiguous (row-major) tensor of ``shape`` (as ``torch.empty(shape)``)."""
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def state_dtype(param_dtype: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """dtype of an optimizer state leaf: ``requested``, or by default (``None``) float32, or the
    parameter's dtype when it is a wider float (float64). Non-float params keep their dtype."""
    if requested is not None:
        return requested
    if not param_dtype.is_floating_point:
        return param_dtype
    return torch.promote_types(param_dtype, torch.float32)


def state_zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """Zeros shaped like every tensor leaf in the state dtype :func:`state_dtype` (DTensors keep
    mesh and placements); ``None`` stays ``None``."""
    return optree.tree_map(
        lambda x: None if x is None else torch.zeros_like(x, dtype=state_dtype(x.dtype, dtype)),
        tree,
        none_is_leaf=True,
    )


def first_device(tree: PyTree) -> torch.device:
    """Device of the first tensor leaf of ``tree`` (CPU when there is none)."""
    leaves = leaves_of(tree)
    return next((x.device for x in leaves if isinstance(x, torch.Tensor)), torch.device("cpu"))


def tree_cast(tree: PyTree, dtype: torch.dtype | None) -> PyTree:
    """Cast every floating tensor leaf to ``dtype`` (no-op for ``None`` dtype or ``None``
    leaves)."""
    if dtype is None:
        return tree
    return optree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        tree,
        none_is_leaf=True,
    )


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _namedtuples(node: Any):
    """Every NamedTuple nested in ``node`` (itself included), in pre-order, through tuples,
    lists, dicts and the NamedTuples' own fields."""
    if _is_namedtuple(node):
        yield node
    if isinstance(node, (list, tuple)):
        for child in node:
            yield from _namedtuples(child)
    elif isinstance(node, dict):
        for child in node.values():
            yield from _namedtuples(child)


def tree_get(tree: PyTree, key: str, default: Any = None) -> Any:
    """Find the field named ``key`` in the NamedTuple states nested in ``tree`` (optax
    ``tree_get``).

    Example: ``ft.tree_get(state, "global_norm")`` returns the pre-clip norm kept by
    ``clip_by_global_norm`` wherever it sits in a chain / ``multi_steps`` state.

    Returns ``default`` when no field has that name.

    Raises:
        KeyError: if several states have a field named ``key`` (the value would be ambiguous).
    """
    found = [getattr(n, key) for n in _namedtuples(tree) if key in n._fields]
    if len(found) > 1:
        raise KeyError(f"tree_get: {len(found)} states have a field named {key!r}; it is ambiguous")
    return found[0] if found else default


def find_state(tree: PyTree, cls: type, where: str) -> Any:
    """The one state of type ``cls`` (a NamedTuple) nested anywhere in ``tree`` (tuples, lists,
    dicts, NamedTuples).

    Raises:
        ValueError: naming ``where``, when there is none or more than one.
    """
    found = [n for n in _namedtuples(tree) if isinstance(n, cls)]
    if len(found) != 1:
        raise ValueError(f"{where}: expected one {cls.__name__} in the state, found {len(found)}")
    return found[0]


def tree_map(fn: Callable, tree: PyTree, *rests: PyTree) -> PyTree:
    """``optree.tree_map`` with ``None`` leaves passed to ``fn``."""
    return optree.tree_map(fn, tree, *rests, none_is_leaf=True)
