"""Gloo ranks that stay up for the whole test session, so that the multi-process tests pay for
starting Python and importing torch once per world size instead of once per test.

``RankPool(world)`` starts ``world`` processes (this file, run as a script). Each imports torch
and the library once, joins a gloo process group of ``world`` ranks (none for ``world == 1``),
and then runs jobs until told to stop. A job is ``"module:function"`` plus arguments: every rank
imports ``module`` (``tests/`` and the repository root are on its path) and calls
``function(rank, world, *args)``; :meth:`RankPool.run` returns the list of the ranks' return
values (sent back with ``torch.save``). Each job's stdout and stderr go to ``log`` (one file per
rank, ``log`` with ``.rank{r}`` appended), whose tails an error message includes.

A job that raises on any rank, a rank that dies and a job past its timeout end the pool (its
ranks may be stuck in a collective with the failed one): the error names the rank and carries
its traceback, and the next :meth:`Ranks.run` starts a new pool. The tests reach the pools
through the session fixture ``ranks`` of ``tests/conftest.py``.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class RankError(AssertionError):
    """A job failed on a rank (its traceback and the tail of its log are in the message)."""


def _log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class RankPool:
    """``world`` gloo ranks that run jobs; see the module docstring."""

    def __init__(self, world: int, timeout: float = 180.0):
        self.world = world
        self._dir = Path(tempfile.mkdtemp(prefix=f"ft-ranks{world}-"))
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
        )
        self._procs, self._send, self._recv = [], [], []
        for rank in range(world):
            log = open(self._dir / f"start.rank{rank}", "wb")  # the child's, while it starts
            proc = subprocess.Popen(
                [sys.executable, __file__, str(rank), str(world), str(self._dir / "init")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
            log.close()
            self._procs.append(proc)
            self._send.append(Connection(os.dup(proc.stdin.fileno()), readable=False))
            self._recv.append(Connection(os.dup(proc.stdout.fileno()), writable=False))
            proc.stdin.close()
            proc.stdout.close()
        start_logs = [self._dir / f"start.rank{r}" for r in range(world)]
        self._collect(start_logs, timeout, f"starting {world} ranks")

    def run(self, target: str, *args, log: str | os.PathLike | None = None, timeout=300.0):
        """Run ``target`` (``"module:function"``) on every rank; returns the ranks' results."""
        log = Path(log) if log is not None else self._dir / "job"
        logs = [log.with_name(f"{log.name}.rank{r}") for r in range(self.world)]
        for conn, path in zip(self._send, logs):
            conn.send((target, args, str(path)))
        return self._collect(logs, timeout, target)

    def _collect(self, logs, timeout, what):
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._recv))
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close(kill=True)
                raise RankError(
                    f"{what}: ranks {sorted(pending)} of {self.world} did not finish within "
                    f"{timeout:.0f} s\n" + self._tails(logs, pending)
                )
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    status, payload = pending.pop(rank).recv()
                except (EOFError, OSError):
                    status, payload = "error", f"rank {rank} died"
                if status != "ok":
                    self.close(kill=True)
                    raise RankError(
                        f"{what} failed on rank {rank} of {self.world}:\n{payload}\n"
                        + self._tails(logs, [rank])
                    )
                results[rank] = payload
        import torch

        return [
            None if results[r] is None else torch.load(io.BytesIO(results[r]), weights_only=False)
            for r in range(self.world)
        ]

    @staticmethod
    def _tails(logs, ranks) -> str:
        return "".join(f"--- log of rank {r} ---\n{_log_tail(logs[r])}\n" for r in ranks)

    @property
    def threads(self) -> int:
        """The most threads a rank has (0 where ``/proc`` is not there to count them)."""
        try:
            return max(len(os.listdir(f"/proc/{p.pid}/task")) for p in self._procs)
        except OSError:
            return 0

    @property
    def alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: told to finish, or killed (``kill``: after a failed job, when some
        may wait in a collective for the failed one)."""
        for conn in self._send:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + (0 if kill else 10)
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self._send + self._recv:
            conn.close()
        self._send, self._recv = [], []
        if not kill:  # (a failed pool's logs stay for the error message and for a look)
            shutil.rmtree(self._dir, ignore_errors=True)


class Ranks:
    """One :class:`RankPool` per world size, started on first use and kept for the session
    (those of at most ``MAX_KEPT_WORLD`` ranks, while their ranks hold at most ``MAX_THREADS``
    threads after a job; the others are closed after it)."""

    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    # Every process group a job makes (a device mesh's dims, a test's sub-group) keeps gloo
    # threads (a TCP loop and workers) that wake while the pool idles. At ~200 threads per
    # rank (the 4-rank pool after the main job's pipeline tests) the idle pool slowed the
    # processes the other pytest worker started: tests/test_resume.py's two 4-process runs of
    # the main job took 250-325 s in the full suite, 35 s alone; one such run beside an idle
    # pool of 185 threads a rank and two busy processes, 101 s (25 s with those two and no
    # pool). Destroying a job's groups is not enough (DTensor's sharding cache keeps specs
    # whose meshes, equal to the next job's, name them), so a pool whose ranks have more
    # threads than this after a job is closed then (the next job starts a new one: ~8 s).
    MAX_THREADS = 48
    # Idle ranks cost even without a leak: each of the 8-rank pool's, at 16 threads, took about
    # 0.6% of a core while it waited (gloo's loops), 5% for the pool, for the rest of the
    # suite; one test uses a pool that large, so pools of more ranks than this are closed
    # after their job.
    MAX_KEPT_WORLD = 4

    def run(self, world: int, target: str, *args, **kw) -> list:
        pool = self._pools.get(world)
        if pool is None or not pool.alive:
            if pool is not None:  # a rank died between jobs
                pool.close(kill=True)
            pool = self._pools[world] = RankPool(world)
        try:
            result = pool.run(target, *args, **kw)
        except RankError:
            self._pools.pop(world, None)
            raise
        if world > self.MAX_KEPT_WORLD or pool.threads > self.MAX_THREADS:
            self._pools.pop(world).close()
        return result

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _redirect(path: str) -> None:
    """Send this process's stdout and stderr (the file descriptors) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _serve(rank: int, world: int, init_file: str) -> None:
    """A rank's loop: join the group, then run jobs until ``None`` arrives."""
    import importlib

    send = Connection(os.dup(1), readable=False)  # the protocol keeps the pipes; prints go
    recv = Connection(os.dup(0), writable=False)  # to the start log (stderr), then the job's
    os.dup2(2, 1)
    try:
        import torch
        import torch.distributed as dist

        import functional_train  # noqa: F401  (imported once, before the first job)

        if world > 1:
            dist.init_process_group(
                "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
            )
    except BaseException:
        send.send(("error", traceback.format_exc()))
        raise
    send.send(("ok", None))
    while True:
        job = recv.recv()
        if job is None:
            break
        target, args, log = job
        _redirect(log)
        try:
            module, function = target.split(":")
            result = getattr(importlib.import_module(module), function)(rank, world, *args)
            buf = io.BytesIO()
            torch.save(result, buf)
            reply = ("ok", buf.getvalue())
        except BaseException:
            reply = ("error", traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        send.send(reply)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
