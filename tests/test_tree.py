"""``functional_train.tree``'s flattening: a flat dict of tensors seen before is flattened by
its cached treedef (``flatten_up_to``); the leaves, the treedef and the errors are optree's
full flatten's, for every tree the cache must not take."""

import collections

import optree
import pytest
import torch

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
