"""``functional_train.tree``'s flattening: a flat dict of tensors seen before is flattened by
its cached treedef (``flatten_up_to``); the leaves, the treedef and the errors are optree's
full flatten's, for every tree the cache must not take."""

import collections

import optree
import pytest
import torch

import functional_train as ft
from functional_train.tree import flatten_as, tree_flatten, tree_unflatten


def _dict(keys, none=()):
    return {k: None if k in none else torch.full((2,), float(i)) for i, k in enumerate(keys)}


TREES = {
    "flat": _dict(["w", "b", "a.c"]),
    "flat_none": _dict(["w", "b", "a.c"], none=("b",)),
    "other_order": _dict(["a.c", "w", "b"]),
    "nested": {"w": torch.ones(2), "b": {"x": torch.ones(1)}},
    "ordered": collections.OrderedDict(_dict(["w", "b", "a.c"])),
    "default": collections.defaultdict(int, _dict(["w", "b", "a.c"])),
    "tuple": (torch.ones(1), _dict(["w", "b"])),
    "non_tensor_leaf": {"w": torch.ones(2), "b": 3.0},
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_flatten_equals_optree(name):
    """Twice (the second call takes the cache where it applies): optree's leaves (the same
    objects, in its order), an equal treedef, and an unflatten in the tree's own key order."""
    tree = TREES[name]
    want_leaves, want_def = optree.tree_flatten(tree, none_is_leaf=True)
    defs = []
    for _ in range(2):
        leaves, td = tree_flatten(tree)
        defs.append(td)
        assert td == want_def
        assert len(leaves) == len(want_leaves)
        assert all(a is b for a, b in zip(leaves, want_leaves))
        back = tree_unflatten(td, leaves)
        assert type(back) is type(tree)
        if isinstance(tree, dict):
            assert list(back) == list(tree)
    if name.startswith(("flat", "other")):  # (the second call took the first's treedef)
        assert defs[1] is defs[0]


def test_same_keys_other_insertion_order_keeps_its_own():
    """Two dicts of the same keys in different insertion orders: each unflattens in its own
    order (the cache is keyed by the keys in insertion order)."""
    a, b = _dict(["w", "b"]), _dict(["b", "w"])
    for tree in (a, b, a, b):
        leaves, td = tree_flatten(tree)
        assert list(tree_unflatten(td, leaves)) == list(tree)


@pytest.mark.parametrize(
    "bad",
    [
        collections.OrderedDict(_dict(["w", "b"])),  # (flatten_up_to would take it, reordered)
        collections.defaultdict(int, _dict(["w", "b"])),
        _dict(["w"]),
        _dict(["w", "b", "c"]),
        _dict(["w", "x"]),
        {"w": torch.ones(2), "b": {"x": torch.ones(1)}},
        {"w": torch.ones(2), "b": [torch.ones(1)]},
    ],
)
def test_flatten_as_refuses_another_structure(bad):
    """``flatten_as`` against a flat dict's treedef raises (naming a leaf) for any other
    structure: a dict subclass, missing, extra or other keys, a container under a key."""
    _, td = tree_flatten(_dict(["w", "b"]))
    with pytest.raises(ValueError, match="does not have the structure"):
        flatten_as(bad, td, "state")


def test_flatten_as_takes_the_same_structure():
    """The same keys in any insertion order, ``None`` where a tensor was: the leaves in the
    treedef's order."""
    _, td = tree_flatten(_dict(["w", "b"]))
    got = flatten_as({"w": torch.zeros(1), "b": None}, td, "state")
    want = optree.tree_flatten({"w": torch.zeros(1), "b": None}, none_is_leaf=True)[0]
    assert [x is None for x in got] == [x is None for x in want]
    assert len(got) == 2


class _UsersState(collections.namedtuple("_UsersState", ["mu", "count"])):
    """A NamedTuple of a user's (optree flattens it by field; the traced walk leaves it to
    optree)."""


TRACED_TREES = {
    **TREES,
    "states": (
        ft.ScaleByAdamState(
            torch.zeros((), dtype=torch.int64), _dict(["w", "b"]), _dict(["w", "b"])
        ),
        ft.EmptyState(),
        [_UsersState(_dict(["z", "y"], none=("y",)), torch.ones(()))],
    ),
    "int_keys": {1: torch.ones(1), 0: torch.zeros(1)},
    "none": None,
}


@pytest.mark.parametrize("name", sorted(TRACED_TREES))
def test_traced_flattening_equals_optree(name):
    """The flattening the library traces under ``torch.compile`` (``tree._traced_leaves``, a
    walk of the built-in containers and the library's states; ``tree._traced_unflatten``,
    node by node) gives optree's leaves, the same objects in its order, eagerly; compiled
    (``fullgraph``), ``leaves_of`` and ``tree_flatten`` + ``tree_unflatten`` give them and the
    tree back, dicts in their own key order."""
    from functional_train.tree import _traced_leaves, leaves_of

    tree = TRACED_TREES[name]
    want = optree.tree_leaves(tree, none_is_leaf=True)
    got = _traced_leaves(tree)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))

    def both(t):
        leaves, td = tree_flatten(t)
        return leaves_of(t), tree_unflatten(
            td, [x + 1 if isinstance(x, torch.Tensor) else x for x in leaves]
        )

    torch._dynamo.reset()  # (one code object, a new tree each case: no recompile limit)
    leaves, back = torch.compile(both, backend="eager", fullgraph=True)(tree)
    assert len(leaves) == len(want)
    for a, b in zip(leaves, want):
        assert (a is None and b is None) or (isinstance(b, float) and a == b) or torch.equal(a, b)
    assert optree.tree_structure(back, none_is_leaf=True) == optree.tree_structure(
        tree, none_is_leaf=True
    )
    for a, b in zip(optree.tree_leaves(back, none_is_leaf=True), want):
        assert (
            (a is None and b is None) or (isinstance(b, float) and a == b) or torch.equal(a, b + 1)
        )
    if isinstance(tree, dict):
        assert list(back) == list(tree)


def test_flat_dict_def_stands_for_optrees_treedef():
    """``FlatDictDef`` (what ``tree_flatten`` gives a flat dict under ``torch.compile``) is
    equal to optree's treedef of the dict either way round and not to another's; it unflattens
    the leaves of optree's (sorted-key) order into the dict's own key order; what it does not
    answer itself comes from optree's treedef; eager ``flatten_as`` takes it (code after a
    graph break runs eagerly with the treedefs the traced part made)."""
    from functional_train.tree import FlatDictDef

    tree = _dict(["w", "b", "a"], none=("b",))
    leaves, want = optree.tree_flatten(tree, none_is_leaf=True)
    td = FlatDictDef(tuple(tree))
    assert td == want and want == td and not td != want and not want != td
    assert td == FlatDictDef(("a", "b", "w")) and hash(td) == hash(FlatDictDef(("a", "w", "b")))
    other = optree.tree_structure(_dict(["w", "c"]), none_is_leaf=True)
    assert td != other and other != td and td != FlatDictDef(("w", "c"))
    assert (td.num_leaves, td.num_nodes, td.type) == (want.num_leaves, want.num_nodes, dict)
    assert td.paths() == want.paths() and td.entries() == want.entries()
    back = tree_unflatten(td, leaves)
    assert list(back) == ["w", "b", "a"] and all(back[k] is tree[k] for k in tree)
    got = flatten_as({"a": torch.ones(2), "w": torch.ones(1), "b": None}, td, "state")
    assert [None if x is None else tuple(x.shape) for x in got] == [(2,), None, (1,)]
    with pytest.raises(ValueError, match="does not have the structure of params"):
        flatten_as({"a": torch.ones(2), "w": torch.ones(1)}, td, "state")
    with pytest.raises(ValueError, match="2 leaves given to a treedef of 3"):
        tree_unflatten(td, leaves[:2])
    assert tree_unflatten(FlatDictDef(()), []) == {}


def test_compiled_tree_flatten_of_a_flat_dict_builds_no_optree_treedef():
    """Under ``torch.compile`` a flat dict's treedef is a ``FlatDictDef`` (dynamo would run
    optree's treespec construction as Python: a treespec object per key), and the round trip
    gives the dict back in its key order; an empty dict too."""
    from functional_train.tree import FlatDictDef

    seen = []

    def f(t):
        leaves, td = tree_flatten(t)
        seen.append(type(td))
        return tree_unflatten(td, [None if x is None else x * 2 for x in leaves])

    tree = _dict(["w", "b", "a"], none=("b",))
    torch._dynamo.reset()
    out = torch.compile(f, backend="eager", fullgraph=True)(tree)
    assert seen == [FlatDictDef] and list(out) == ["w", "b", "a"] and out["b"] is None
    assert torch.equal(out["w"], tree["w"] * 2) and torch.equal(out["a"], tree["a"] * 2)
    torch._dynamo.reset()
    assert torch.compile(f, backend="eager", fullgraph=True)({}) == {}
