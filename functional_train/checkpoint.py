"""Resumable training: atomic checkpoints of parameters and optimizer state.

``save`` writes a parameter tree and an optimizer state (pytrees of ``torch.Tensor`` / ``DTensor``
leaves, ``None`` leaves allowed, any optree structure: dicts, tuples, NamedTuples) with
``torch.distributed.checkpoint`` (DCP), plus the step number and a small ``extra`` dict (data
RNG state, metric history...). ``load`` reads them back into trees shaped like templates built on
the *current* layout: DCP reshards, so a checkpoint written by 4 ranks at tp=2 x dp=2 loads into
plain tensors in one process and the other way round.

Layout of a checkpoint directory::

    <directory>/.metadata, *.distcp   DCP's files: every tensor leaf, under the key
                                      "params/<path>" or "state/<path>" (<path>: the leaf's dotted
                                      optree path, NamedTuple fields by name: "state/1.0.mu.w" is
                                      the "w" entry of the "mu" field of the first state of the
                                      second chained part; version 1 wrote the field's position)
    <directory>/extra.pt              torch.save(extra) by rank 0 (only when extra is not None)
    <directory>/meta.json             the manifest, written LAST: format, version, a unique token,
                                      step, every key with its global shape and dtype, the None
                                      leaves, the trees' structure (the type of every container by
                                      its path: NamedTuple states by name, mappings as "dict"; it
                                      does not depend on the mesh), and the size and SHA-256 of the
                                      files rank 0 wrote (DCP's .metadata, extra.pt)

Atomicity: everything is written into a sibling ``<directory>.tmp-<token>``; when every rank has
finished (a barrier when a process group is initialised) rank 0 writes the manifest and renames
the directory into place (an older checkpoint at that path is renamed to
``<directory>.old-<token>`` first and deleted only after the new one is in place). A crash at any
point leaves either the old or the new checkpoint complete: a directory without ``meta.json`` is
never loaded, and ``load`` falls back to the ``.old-<token>`` sibling if a crash fell between the
two renames. Stale ``.tmp-*`` / ``.old-*`` siblings are removed after the next successful save.

Damage: before DCP reads anything, ``load`` checks the files: the size and SHA-256 of
``.metadata`` and ``extra.pt`` against the manifest, and that every ``.distcp`` file DCP's
metadata points into exists and is long enough; what it finds, an invalid manifest, and what DCP
raises (its ``CheckpointException`` derives from ``BaseException``) raise :class:`CheckpointError`
naming the checkpoint and the file. Not detected: altered bytes inside a ``.distcp`` file that
leave it readable (DCP keeps no checksum of the tensor data, and ``torch.load`` does not check the
CRC-32 that ``torch.save`` writes).

Concurrent saves: loading while another process saves to the same path reads ONE checkpoint.
``load`` reads the manifest, then everything else by path, then the manifest again; a save puts a
checkpoint at a path once (renamed in from its temporary directory, then renamed away and
deleted), so the same unique token at both reads means every file read in between was that
checkpoint's. When it changed (or a file vanished with it) the load starts again, up to
``LOAD_ATTEMPTS`` times, then raises :class:`CheckpointError`.

All ranks of the default process group must call ``save`` and ``load`` together (DCP's
collectives: a gather of the local plans and a scatter of the global plan, plus a gather of the
write results when saving; ``load`` adds two ``all_gather_object`` of every rank's outcome per
attempt, so that all ranks start again, or raise, together), and must see the same file system.
Without a process group both run in one process (DCP's ``no_dist=True``).

See https://pytorch.org/docs/stable/distributed.checkpoint.html for DCP itself.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import shutil
import time
import uuid
import warnings
from contextlib import contextmanager
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from .tree import field_paths, tree_paths

__all__ = [
    "save",
    "load",
    "read_manifest",
    "PendingSave",
    "CheckpointError",
    "MANIFEST",
    "FORMAT_VERSION",
    "LOAD_ATTEMPTS",
]

MANIFEST = "meta.json"
EXTRA = "extra.pt"
DCP_METADATA = ".metadata"  # the index torch.distributed.checkpoint's FileSystemWriter writes
FORMAT = "functional_train.checkpoint"
#: 2: keys name NamedTuple fields (1: their positions); the manifest records a token, the trees'
#: structure and the files rank 0 wrote. Version 1 checkpoints still load (without those checks).
FORMAT_VERSION = 2
#: how many times ``load`` starts again when the checkpoint was replaced while it read it
LOAD_ATTEMPTS = 10
_TREES = ("params", "state")
_LIST_AT_MOST = 10  # key paths listed in an error message
_MAPPINGS = (optree.PyTreeKind.DICT, optree.PyTreeKind.ORDEREDDICT, optree.PyTreeKind.DEFAULTDICT)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it was written: a file missing, truncated or altered
    (DCP's ``.metadata`` or a ``.distcp`` data file, ``extra.pt``), a manifest (``meta.json``) that
    is not valid JSON, of another format or a newer version, or with a field of the wrong type, or
    a checkpoint replaced by another save during every one of ``LOAD_ATTEMPTS`` loads.

    The message names the checkpoint and the file (and the manifest field); the error it comes
    from, if any, is chained (``__cause__``). A ``ValueError`` (what :func:`read_manifest` raised
    for a bad manifest before), so ``except ValueError`` and ``except Exception`` catch it; DCP's
    own ``CheckpointException`` derives from ``BaseException`` and is never let through.
    """


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _distributed() -> bool:
    """A real process group (the ``fake`` one of a one-process simulation, which
    ``functional_train.testing.simulate`` leaves initialised, has no other ranks to write)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _normalise(directory) -> str:
    path = os.path.normpath(os.fspath(directory))
    if path in (os.curdir, os.sep, ""):
        raise ValueError(f"checkpoint directory {directory!r}: give a directory of its own")
    return path


def _paths(name: str, tree, by_name: bool) -> tuple[list, list[str], dict[str, str], Any]:
    """``(leaves, keys, nodes, treedef)`` of one tree: its leaves (``None`` included) in flatten
    order, their keys ``"<name>/<dotted path>"`` (NamedTuple fields by name; by position, as
    :func:`functional_train.tree.tree_paths` renders them, unless ``by_name``: format version 1),
    and every container by its path (``"<name>/<root>"`` for the tree itself) with its type: a
    NamedTuple's (or custom node's) class name, ``"dict"`` for any mapping, ``"tuple"``,
    ``"list"``."""
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)
    leaf_paths, containers = field_paths(treedef)

    def render(path) -> str:
        return f"{name}/{'.'.join(str(entry) for _, entry in path) or '<root>'}"

    keys = [render(path) for path in leaf_paths]
    nodes = {
        render(path): "dict" if spec.kind in _MAPPINGS else spec.type.__qualname__
        for path, spec in containers
    }
    if not by_name:
        keys = [f"{name}/{p}" for p in tree_paths(tree)]
    return leaves, keys, nodes, treedef


def _flatten(
    params, state, by_name: bool = True
) -> tuple[dict[str, torch.Tensor], list[str], list, dict[str, str]]:
    """``({key: tensor leaf}, [keys of None leaves], [(treedef, keys)] per tree, {container
    path: type})`` (see :func:`_paths`; ``by_name=False``: version 1's positional keys)."""
    tensors: dict[str, torch.Tensor] = {}
    nones: list[str] = []
    structure = []
    nodes: dict[str, str] = {}
    for name, tree in zip(_TREES, (params, state)):
        leaves, keys, tree_nodes, treedef = _paths(name, tree, by_name)
        nodes.update(tree_nodes)
        seen = set()
        for key, leaf in zip(keys, leaves):
            if key in seen:
                raise ValueError(
                    f"two leaves of {name} have the same path {key!r} (a dict key "
                    "containing '.' next to a nested dict?): cannot name them apart"
                )
            seen.add(key)
            if leaf is None:
                nones.append(key)
            elif isinstance(leaf, torch.Tensor):
                tensors[key] = leaf
            else:
                raise TypeError(
                    f"leaf {key!r} is a {type(leaf).__name__}: checkpoint trees hold "
                    "tensors, DTensors and None only"
                )
        structure.append((treedef, keys))
    return tensors, nones, structure, nodes


def _describe(x: torch.Tensor) -> dict:
    return {
        "shape": list(x.shape),
        "dtype": str(x.dtype).removeprefix("torch."),
        "dtensor": isinstance(x, DTensor),
    }


def _listing(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:_LIST_AT_MOST])
    return shown + (f" (and {len(keys) - _LIST_AT_MOST} more)" if len(keys) > _LIST_AT_MOST else "")


@contextmanager
def _single_process_quiet(on: bool):
    """Silence DCP's warning that it runs in one process, which ``no_dist=True`` asks for."""
    with warnings.catch_warnings():
        if not on:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: str, obj) -> None:
    part = path + ".partial"
    with open(part, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _siblings(directory: str, kind: str) -> list[str]:
    """Existing ``<directory>.<kind>-<token>`` paths (kind: "tmp" or "old"), sorted."""
    parent, base = os.path.split(directory)
    prefix = f"{base}.{kind}-"
    try:
        names = os.listdir(parent or os.curdir)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(parent, n) for n in names if n.startswith(prefix))


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def _gather(obj) -> list:
    """``obj`` of every rank (``all_gather_object`` on the default group; ``[obj]`` without)."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _file_record(path: str) -> dict:
    """``{"size": bytes, "sha256": hex digest}`` of a file (read whole: used for small files)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        size = f.tell()
    return {"size": size, "sha256": digest.hexdigest()}


def _one_line(e: BaseException, at_most: int = 300) -> str:
    """``"<type>: <first line of the message>"``, at most ``at_most`` characters."""
    lines = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return line if len(line) <= at_most else line[: at_most - 3] + "..."


# --------------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------------


class PendingSave:
    """A checkpoint being written in the background (``save(..., async_save=True)``).

    The tensors were copied (staged) before ``save`` returned, so the caller may modify or donate
    them at once. The checkpoint is NOT in place until ``result()`` has returned: it waits for
    DCP's upload future, then (on every rank, so call it on every rank at the same point of the
    program: it issues a barrier when a process group is initialised) writes the manifest and
    renames the directory into place. ``done()`` says whether the upload finished (``result()``
    is then quick). ``result()`` re-raises a failed upload, leaving any older checkpoint at the
    path untouched; it returns the checkpoint directory and is idempotent. Start the next save of
    the same directory only after ``result()``.
    """

    def __init__(self, future, commit):
        self._future = future
        self._commit = commit
        self._directory: str | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        if self._error is not None:
            raise self._error
        if self._directory is None:
            try:
                self._future.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                raise  # still uploading: call result() again
            except BaseException as e:
                self._error = e
                self._commit(failed=True)
                raise
            try:
                self._directory = self._commit(failed=False)
            except BaseException as e:
                self._error = e
                raise
        return self._directory


_ASYNC_GROUPS: dict = {}


def _async_group():
    """A gloo group of all ranks for DCP's background thread, so that its collectives never
    interleave with the training loop's on the default group (created once, on every rank)."""
    default = dist.distributed_c10d._get_default_group()
    if id(default) not in _ASYNC_GROUPS:
        _ASYNC_GROUPS.clear()
        _ASYNC_GROUPS[id(default)] = dist.new_group(backend="gloo")
    return _ASYNC_GROUPS[id(default)]


def save(
    directory, *, params, state, step: int, extra: dict | None = None, async_save: bool = False
):
    """Write ``params``, ``state``, ``step`` and ``extra`` to ``directory``, atomically.

    Args:
        directory: the checkpoint's path (a directory, created; its parent must exist or is
            created). An existing checkpoint there (one with a ``meta.json``) is replaced once the
            new one is complete; an existing directory that is not a checkpoint raises
            ``FileExistsError`` before anything is written.
        params, state: pytrees whose leaves are ``torch.Tensor``, ``DTensor`` (any mesh and
            placements: DCP stores the global tensor once, each rank writing its shards; plain
            tensors are taken as replicated across ranks and written once, by one rank) or
            ``None``. Every tensor leaf is stored under ``"params/<path>"`` /
            ``"state/<path>"`` (NamedTuple fields by name) with its global shape and dtype.
            State that differs per rank in plain tensors (``multi_steps``'s accumulated
            unreduced gradients under a data axis, mid-cycle) is therefore not saved whole:
            save at a cycle boundary (``ft.has_updated(state)``), where those accumulators are
            zeros on every rank. The manifest also records the type of every container (which
            states, in what chain), so that ``load`` refuses another optimizer's state.
        step: the step number (an int) returned by ``load``.
        extra: ``None`` or a small dict, serialised by rank 0 with ``torch.save`` when ``save``
            is called and written next to the tensors (``load`` reads it
            with ``weights_only=True``: tensors, numbers, strings, lists, tuples and dicts of
            them, e.g. ``torch.Generator.get_state()`` or a metric history).
        async_save: ``False`` (default): return once the checkpoint is in place on every rank,
            returning the directory. ``True``: stage (copy) the tensors, start
            ``torch.distributed.checkpoint.async_save`` in a background thread (over a dedicated
            gloo group when a process group is initialised) and return a :class:`PendingSave`,
            whose ``result()`` every rank must call to finish the checkpoint.

    Collectives: when a process group is initialised, all its ranks must call ``save`` with the
    same ``directory`` and trees of the same structure: a broadcast of the temporary directory's
    name from rank 0, DCP's (gather of the local plans, scatter of the global plan, gather of
    the write results), a barrier before rank 0 writes ``extra.pt`` and the manifest and
    renames, and a broadcast of its outcome after (so that no rank returns before the
    checkpoint is in place, and all raise if it failed). Without one, DCP runs with
    ``no_dist=True``.

    Raises:
        TypeError: a leaf that is neither a tensor nor ``None``; ``step`` not an int; ``extra``
            not a dict.
        ValueError: two leaves with the same path; ``extra`` that ``torch.save`` cannot
            serialise (checked by rank 0 before anything is written; every rank raises).
        FileExistsError: ``directory`` exists and is not a checkpoint.
        Whatever DCP raises while writing (on every rank, as DCP reports a failed write to all),
        and ``RuntimeError`` on every rank when rank 0 fails to write the manifest or to rename:
        the temporary directory is removed (by rank 0) and an older checkpoint at
        ``directory`` stays as it was.
    """
    directory = _normalise(directory)
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, not {type(extra).__name__}")
    tensors, nones, _, nodes = _flatten(params, state)
    on = _distributed()

    # rank 0 names the temporary directory, checks the destination and serialises extra; one
    # broadcast, so that every rank raises together instead of waiting in a collective
    msg: list[Any] = [uuid.uuid4().hex[:12], None, None]
    extra_bytes = None
    if _rank() == 0:
        if (
            os.path.lexists(directory)
            and not _is_checkpoint(directory)
            and (not os.path.isdir(directory) or os.listdir(directory))
        ):
            msg[1:] = [
                FileExistsError,
                f"checkpoint directory {directory!r} exists and is not a "
                f"checkpoint (no {MANIFEST}): refusing to replace it",
            ]
        elif extra is not None:
            try:
                buf = io.BytesIO()
                torch.save(extra, buf)
                extra_bytes = buf.getvalue()
            except Exception as e:  # pickling errors come in many types
                msg[1:] = [ValueError, f"extra cannot be saved with torch.save: {e!r}"]
    if on:
        dist.broadcast_object_list(msg, src=0)
    token, error_type, error = msg
    if error_type is not None:
        raise error_type(error)
    tmp = f"{directory}.tmp-{token}"
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "token": token,
        "step": step,
        "keys": {k: _describe(v) for k, v in tensors.items()},
        "none": nones,
        "extra": extra is not None,
        "world_size": dist.get_world_size() if on else 1,
        "structure": nodes,
        "files": {},  # filled by rank 0 once they are written
    }

    def discard():
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def commit(failed: bool = False) -> str:
        if failed:
            discard()
            return directory
        _barrier()  # every rank's shards are written
        status: list[Any] = [None]
        if _rank() == 0:
            try:
                if extra_bytes is not None:
                    with open(os.path.join(tmp, EXTRA), "wb") as f:
                        f.write(extra_bytes)
                        f.flush()
                        os.fsync(f.fileno())
                # rank 0's own files (DCP's coordinator writes .metadata): sizes and digests are
                # exact here; the ranks' .distcp files are checked against .metadata when loading
                manifest["files"] = {
                    name: _file_record(os.path.join(tmp, name))
                    for name in [DCP_METADATA] + ([EXTRA] if extra_bytes is not None else [])
                }
                _write_json(os.path.join(tmp, MANIFEST), manifest)  # last: marks it complete
                _fsync_dir(tmp)
                _swap_in(tmp, directory, token)
            except BaseException as e:
                discard()
                if not on:
                    raise
                status[0] = repr(e)
        if on:  # also the barrier: no rank returns before the checkpoint is in place
            dist.broadcast_object_list(status, src=0)
        if status[0] is not None:
            raise RuntimeError(f"rank 0 could not finish checkpoint {directory!r}: {status[0]}")
        return directory

    try:
        with _single_process_quiet(on):
            if not async_save:
                dcp.save(tensors, checkpoint_id=tmp, no_dist=not on)
            else:
                response = dcp.async_save(
                    tensors,
                    checkpoint_id=tmp,
                    no_dist=not on,
                    process_group=_async_group() if on else None,
                )
                future = getattr(response, "upload_completion", response)
    except BaseException:
        discard()
        raise
    if async_save:
        return PendingSave(future, commit)
    return commit()


def _swap_in(tmp: str, directory: str, token: str) -> None:
    """Rename ``tmp`` to ``directory``; an older checkpoint there is deleted only afterwards."""
    old = None
    if os.path.lexists(directory):
        old = f"{directory}.old-{token}"
        os.rename(directory, old)
    os.rename(tmp, directory)
    _fsync_dir(os.path.dirname(directory) or os.curdir)
    # the new checkpoint is in place: drop the old one and what crashed saves left behind
    for stale in ([old] if old else []) + _siblings(directory, "old") + _siblings(directory, "tmp"):
        shutil.rmtree(stale, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------------


def _resolve(directory: str) -> str:
    """``directory``, or the ``.old-<token>`` sibling a save left when it crashed between its two
    renames (the previous checkpoint, complete)."""
    if os.path.isdir(directory):
        if not _is_checkpoint(directory):
            raise FileNotFoundError(
                f"checkpoint {directory!r} has no {MANIFEST}: it is incomplete (a save that did "
                "not finish) or not a functional_train checkpoint"
            )
        return directory
    old = [p for p in _siblings(directory, "old") if _is_checkpoint(p)]
    if old:
        return old[-1]
    raise FileNotFoundError(f"no checkpoint at {directory!r}")


# the manifest's fields: (JSON type, how an error names it, the first version that has it)
_FIELDS: dict[str, tuple[type, str, int]] = {
    "step": (int, "an integer", 1),
    "keys": (dict, "an object", 1),
    "none": (list, "a list", 1),
    "extra": (bool, "true or false", 1),
    "world_size": (int, "an integer", 1),
    "token": (str, "a string", 2),
    "structure": (dict, "an object", 2),
    "files": (dict, "an object", 2),
}


def _is(value, kind: type) -> bool:
    """``isinstance`` for a JSON value, where ``true`` is not an integer."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _shown(value, at_most: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= at_most else text[: at_most - 3] + "..."


def _check_manifest(file: str, m) -> None:
    """Raise :class:`CheckpointError` naming ``file`` and the field unless ``m`` is a manifest
    of a version this module reads, every field of that version present with its JSON type."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: {what} (a damaged or hand-edited manifest)")

    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} manifest")
    version = m.get("version")
    if not _is(version, int) or version < 1:
        raise bad(f"field 'version' must be a positive integer, not {_shown(version)}")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: format version {version}; this functional_train reads versions up to "
            f"{FORMAT_VERSION}"
        )
    for field, (kind, what, since) in _FIELDS.items():
        if since > version:
            continue
        if field not in m:
            raise bad(f"field {field!r} is missing")
        if not _is(m[field], kind):
            raise bad(f"field {field!r} must be {what}, not {_shown(m[field])}")
    for key, d in m["keys"].items():
        shape = d.get("shape") if isinstance(d, dict) else None
        if not (
            isinstance(shape, list)
            and all(_is(n, int) and n >= 0 for n in shape)
            and _is(d.get("dtype"), str)
        ):
            raise bad(
                f'field \'keys\' entry {key!r} must be {{"shape": [sizes], "dtype": name}}, '
                f"not {_shown(d)}"
            )
    if not all(_is(k, str) for k in m["none"]):
        raise bad(f"field 'none' must list key paths, not {_shown(m['none'])}")
    if version >= 2:
        if not all(_is(t, str) for t in m["structure"].values()):
            raise bad(
                f"field 'structure' must map paths to type names, not {_shown(m['structure'])}"
            )
        for name, f in m["files"].items():
            if not (isinstance(f, dict) and _is(f.get("size"), int) and _is(f.get("sha256"), str)):
                raise bad(
                    f'field \'files\' entry {name!r} must be {{"size": bytes, "sha256": hex}}, '
                    f"not {_shown(f)}"
                )


def _read_manifest(directory: str) -> tuple[dict, tuple]:
    """``(manifest, identity)`` of the checkpoint at the normalised path ``directory``;
    ``identity`` (its path, the SHA-256 of the manifest's bytes, their inode and mtime) tells
    this checkpoint from any a later save puts there (the manifest holds a unique token)."""
    path = _resolve(directory)
    file = os.path.join(path, MANIFEST)
    with open(file, "rb") as f:
        raw = f.read()
        st = os.fstat(f.fileno())
    identity = (path, hashlib.sha256(raw).hexdigest(), st.st_ino, st.st_mtime_ns)
    try:
        manifest = json.loads(raw)
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(
            f"{file} is not valid JSON ({e}): a damaged or hand-edited manifest"
        ) from e
    _check_manifest(file, manifest)
    manifest["path"] = path
    return manifest, identity


def read_manifest(directory) -> dict:
    """The manifest (``meta.json``) of the checkpoint at ``directory``: ``step`` (int),
    ``keys`` (key -> global ``shape``, ``dtype``, ``dtensor``), ``none`` (keys of ``None``
    leaves), ``extra`` (bool), ``world_size``, ``version``, and from version 2 ``token`` (unique
    to this save), ``structure`` (container path -> type name) and ``files`` (name -> ``size``,
    ``sha256`` of the files rank 0 wrote); ``path`` is where it was read (``directory``, or the
    ``.old-<token>`` sibling a save crashed between its renames left).

    Raises:
        FileNotFoundError: no checkpoint at ``directory``, or one without its manifest.
        CheckpointError: a manifest that is not valid JSON, of another format, of a newer
            version, or with a missing field or one of the wrong type (a ``step`` that is not an
            integer: ``"seven"``, ``2.9``, ``true``), naming the file and the field.
    """
    return _read_manifest(_normalise(directory))[0]


def _match_templates(path: str, manifest: dict, tensors: dict, nones: list, nodes: dict) -> None:
    """Raise ``ValueError`` listing every way the templates differ from the checkpoint."""
    saved, saved_none = manifest["keys"], set(manifest["none"])
    t_tensor, t_none = set(tensors), set(nones)
    problems = []
    saved_nodes = manifest.get("structure")  # version 1 did not record it
    if saved_nodes is not None:
        absent = "absent"
        differ = [
            f"{p} (saved {saved_nodes.get(p, absent)}, template {nodes.get(p, absent)})"
            for p in set(saved_nodes) | set(nodes)
            if saved_nodes.get(p) != nodes.get(p)
        ]
        if differ:
            problems.append(
                "a different structure (another optimizer's state?), container types by path: "
                + _listing(differ)
            )
    missing = (t_tensor | t_none) - set(saved) - saved_none
    unexpected = (set(saved) | saved_none) - t_tensor - t_none
    if missing:
        problems.append(f"missing from the checkpoint: {_listing(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the templates: {_listing(unexpected)}")
    if t_tensor & saved_none:
        problems.append(
            f"None in the checkpoint, a tensor in the templates: {_listing(t_tensor & saved_none)}"
        )
    if t_none & set(saved):
        problems.append(
            f"a tensor in the checkpoint, None in the templates: {_listing(t_none & set(saved))}"
        )
    wrong = []
    for k, x in tensors.items():
        if k in saved:
            want = saved[k]
            got = _describe(x)
            if want["shape"] != got["shape"] or want["dtype"] != got["dtype"]:
                wrong.append(
                    f"{k} (saved {tuple(want['shape'])} {want['dtype']}, template "
                    f"{tuple(got['shape'])} {got['dtype']})"
                )
    if wrong:
        problems.append(f"global shape or dtype mismatches: {_listing(wrong)}")
    if problems:
        raise ValueError(
            f"checkpoint {path!r} does not match the templates: " + "; ".join(problems)
        )


def _verify_files(path: str, manifest: dict) -> list[str]:
    """Check the files of the checkpoint at ``path`` before DCP reads them: the size and SHA-256
    of those the manifest records (``.metadata``, ``extra.pt``), and that every data file DCP's
    ``.metadata`` points into exists and reaches the end of its last item. Returns the data
    files' names.

    Raises:
        CheckpointError: naming the checkpoint and each missing, truncated or altered file.
    """
    problems = []
    for name, want in sorted(manifest.get("files", {}).items()):
        try:
            have = _file_record(os.path.join(path, name))
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if have != want:
            problems.append(
                f"{name} has {have['size']} bytes with SHA-256 {have['sha256'][:16]}..., the "
                f"manifest records {want['size']} bytes with {want['sha256'][:16]}... (altered "
                "or truncated)"
            )
    ends: dict[str, int] = {}
    if not problems:
        try:
            metadata = dcp.FileSystemReader(path).read_metadata()
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {path!r} is damaged: DCP's {DCP_METADATA} cannot be read: "
                f"{_one_line(e)}"
            ) from e
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            name = getattr(info, "relative_path", None)
            if isinstance(name, str):
                ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
        for name, end in sorted(ends.items()):
            try:
                size = os.path.getsize(os.path.join(path, name))
            except FileNotFoundError:
                problems.append(f"{name} is missing")
                continue
            if size < end:
                problems.append(f"{name} has {size} bytes, its data runs to byte {end} (truncated)")
    if problems:
        raise CheckpointError(f"checkpoint {path!r} is damaged: " + "; ".join(problems))
    return sorted(ends)


def _read_failure(path: str, data_files: list[str], e: BaseException) -> CheckpointError:
    """What DCP raised while reading (a ``CheckpointException``: a ``BaseException`` holding
    rank -> (error, traceback)), as a :class:`CheckpointError` naming the checkpoint and the
    file: the one the error names, else the data files."""
    failures = getattr(e, "failures", None) or {}
    cause = next(iter(failures.values()))[0] if failures else e
    name = getattr(cause, "filename", None)
    where = os.path.basename(name) if isinstance(name, str) else ", ".join(data_files)
    ranks = f" (rank {', '.join(map(str, sorted(failures)))})" if _distributed() else ""
    return CheckpointError(
        f"checkpoint {path!r}: reading {where or 'its data'} failed{ranks} (a damaged file?): "
        f"{_one_line(cause)}"
    )


def _read_extra(path: str):
    try:
        return torch.load(os.path.join(path, EXTRA), weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path!r}: {EXTRA} cannot be read: {_one_line(e)}") from e


def _settle(directory: str, start, error: Exception | None) -> bool:
    """End one phase of an attempt of :func:`load`, on every rank together. ``True``: every
    rank finished it without an error, all on the same checkpoint, still at ``directory``;
    ``False``: the checkpoint was replaced meanwhile (or the ranks read different ones): start
    again. Otherwise raise, on every rank: its own ``error``, or ``RuntimeError`` naming the
    ranks that failed. One ``all_gather_object`` when a process group is initialised."""
    try:
        now = _read_manifest(directory)[1]
    except Exception:
        now = None
    reports = _gather(
        (
            None if start is None else start[1],
            now == start,
            None if error is None else _one_line(error),
        )
    )
    read = {digest for digest, _, _ in reports if digest is not None}  # (None: could not read)
    if not all(same for _, same, _ in reports) or len(read) > 1:
        return False
    failed = [f"rank {r}: {msg}" for r, (_, _, msg) in enumerate(reports) if msg is not None]
    if not failed:
        return True
    if error is not None:
        raise error
    raise RuntimeError(f"checkpoint {directory!r} could not be loaded: " + "; ".join(failed))


def _load_once(directory: str, params, state):
    """One attempt of :func:`load`: its result, or ``None`` when the checkpoint was replaced
    while it was read."""
    start = None
    try:
        manifest, start = _read_manifest(directory)
        path = manifest["path"]
        tensors, nones, structure, nodes = _flatten(params, state, by_name=manifest["version"] > 1)
        _match_templates(path, manifest, tensors, nones, nodes)
        data_files = _verify_files(path, manifest)
        error = None
    except Exception as e:
        error = e
    if not _settle(directory, start, error):
        return None

    # every rank read the same manifest, the templates match it and its files are whole
    try:
        out = {k: torch.empty_like(x, requires_grad=False) for k, x in tensors.items()}
        with _single_process_quiet(_distributed()):
            try:
                dcp.load(out, checkpoint_id=path, no_dist=not _distributed())
            except (Exception, CheckpointException) as e:
                raise _read_failure(path, data_files, e) from e
        extra = _read_extra(path) if manifest["extra"] else None
        error = None
    except Exception as e:
        error = e
    if not _settle(directory, start, error):
        return None

    for k, x in tensors.items():
        if x.requires_grad:
            out[k].requires_grad_(True)
    trees = [
        optree.tree_unflatten(treedef, [out.get(k) for k in keys]) for treedef, keys in structure
    ]
    return trees[0], trees[1], manifest["step"], extra


def load(directory, params, state):
    """Read the checkpoint at ``directory`` into new trees shaped like ``params`` and ``state``.

    Args:
        directory: a path ``save`` wrote.
        params, state: templates with the structure that was saved (same tree structure and
            container types: the same optimizer's state; key paths, global shapes and dtypes),
            built by the caller on the *current* layout, e.g. the freshly initialised
            parameters and ``tx.init(params)``. Each tensor leaf may be
            a plain tensor or a DTensor with any mesh and placements, whatever the saved leaf
            was: DCP reads the slices each rank needs (resharding). The templates' values are
            not read and the templates are not modified.

    Returns:
        ``(params, state, step, extra)``: new trees with the templates' structure, each tensor
        leaf a fresh tensor (``torch.empty_like`` of the template leaf: same layout, device,
        mesh and placements; ``requires_grad`` as the template's) holding the saved values;
        ``None`` leaves stay ``None``. ``step`` is the saved int, ``extra`` the saved dict (or
        ``None``).

    Version 1 checkpoints load too (positional keys; no structure or file digests to check).

    Consistency: what is returned comes from one checkpoint, even while another process
    replaces it by saving to the same ``directory``: the manifest is read before and after
    everything else, and a load that saw it change starts again (after a short pause), at most
    ``LOAD_ATTEMPTS`` times.

    Collectives: all ranks of an initialised default process group call ``load`` together:
    per attempt, two ``all_gather_object`` (every rank's outcome: the checkpoint it read, its
    error) and DCP's plan gather and scatter; without one, DCP runs with ``no_dist=True``.

    Raises:
        FileNotFoundError: no checkpoint at ``directory``, or one without its manifest (a save
            that did not finish), naming the directory.
        ValueError: the templates do not match the checkpoint: a different structure (the type
            of a container differs, or one is absent: another optimizer's state, or the same
            optimizer chained with other transforms), key paths missing from the checkpoint,
            key paths the templates lack, ``None`` where a tensor was saved or the reverse, or
            different global shapes or dtypes, each listed by path (``"params/<path>"`` /
            ``"state/<path>"``, with the saved and the template's type) with the directory.
        CheckpointError: (a ``ValueError``) a damaged checkpoint: an invalid manifest (see
            :func:`read_manifest`), a missing, truncated or altered file, or DCP failing to
            read it, naming the checkpoint and the file, chained from the original error; or a
            checkpoint replaced during every one of ``LOAD_ATTEMPTS`` attempts.
        RuntimeError: on the ranks that did not fail, when others did (each of those raises its
            own error), naming them.
    """
    directory = _normalise(directory)
    for attempt in range(LOAD_ATTEMPTS):
        if attempt:  # let the save that replaced it finish
            time.sleep(min(0.002 * 2**attempt, 0.1))
        loaded = _load_once(directory, params, state)
        if loaded is not None:
            return loaded
    raise CheckpointError(
        f"checkpoint {directory!r} was replaced by another save during each of {LOAD_ATTEMPTS} "
        "attempts to load it (something saves there faster than a load takes: load a copy)"
    )
