"""Distributed test harness: run a function on every rank of a CPU gloo world.

    from tests.harness import dist_run
    results = dist_run(world_size, fn, *args)   # [fn(0, W, *args), ..., fn(W-1, W, *args)]

`fn` must be a module-level function (it is pickled by reference), its arguments and
return value picklable (outside pytest, call it under `if __name__ == "__main__":`, as
multiprocessing requires). Any rank raising makes `dist_run` raise AssertionError with that
rank's traceback; a job that does not finish within `timeout` seconds raises too.

[Note: generous limits]
Tests bound a job or a subprocess only to catch a hang, never to measure speed: a busy
2-core machine shared by several test runs can be ten times slower than an idle one.
`HANG_S` is that one generous bound; the suite's subprocesses use it too. Only tests of
the timeout machinery itself pass a short `timeout`.

[Note: persistent pools]
Spawning W fresh Python processes that import torch and rendezvous costs seconds per
test on a 2-core machine, so each world size keeps one pool of worker processes for the
whole pytest session: torch is imported once (the workers are forked from a
forkserver that preloads torch and shardc), the default process group is initialised once, and
jobs are dispatched over pipes. Each job ends with a barrier, so all ranks leave it
together and the next job starts from a quiet process group. Workers are reused, so a
job must not rely on fresh global state: seed RNGs itself, and leave the default
process group initialised (never destroy it). After a failure or a
timeout the ranks may disagree about which collectives ran, so the pool is killed and
the next call builds a fresh one. At most `MAX_POOLS` pools live at a time (least
recently used goes first); `shutdown()` (atexit and the session fixture in
tests/conftest.py) closes them all.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import sys
import time
import traceback
from collections import OrderedDict

MAX_POOLS = 3
# SHARDC_FULL_SWEEPS=1: the sweeps that are too slow for the suite's budget on 2 cores run in
# full (every named strategy, every order); otherwise each runs the cases named in its test
FULL_SWEEPS = os.environ.get("SHARDC_FULL_SWEEPS") == "1"
HANG_S = 1800.0         # see [Note: generous limits]
_GRACE_S = 3.0          # how long the other ranks get to report after one rank failed
# what every worker imports before it forks (see [Note: persistent pools]): shardc too, so a
# pool rebuilt after a failing job does not import it again on each rank
PRELOAD = ["torch", "torch.distributed", "shardc", "shardc.runtime", "shardc.compiler"]
_pools: "OrderedDict[int, _Pool]" = OrderedDict()
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn, path: list[str]) -> None:
    """One rank: join the gloo world, then run jobs until told to stop (None)."""
    sys.path[:0] = [p for p in path if p not in sys.path]
    # the forkserver's environment is the pytest process's when the first pool started: a
    # test that had set LOCAL_WORLD_SIZE then (monkeypatch) would leak it into every rank
    # after (`gpu(local)` meshes; found running the suite under pytest-xdist)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=HANG_S))
    conn.send(("ready", None))
    while True:
        job = conn.recv()
        if job is None:
            dist.barrier()          # nobody closes its connections while a peer still uses them
            break
        fn, args = job
        try:
            value = fn(rank, world, *args)
            dist.barrier()
            conn.send(("ok", value))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
    conn.close()


class _Pool:
    def __init__(self, world: int, timeout: float):
        ctx = _context()
        port = _free_port()
        self.world = world
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world, port, child, list(sys.path)),
                            name=f"dist_run-{world}-{r}", daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        replies = self._collect(timeout, what="start-up")
        bad = [(r, v) for r, (k, v) in replies.items() if k != "ready"]
        if bad:
            self.kill()
            raise AssertionError(f"rank {bad[0][0]} failed to start:\n{bad[0][1]}")

    def _collect(self, timeout: float, what: str) -> dict[int, tuple[str, object]]:
        """Replies by rank; kills the pool and raises on timeout or a dead rank."""
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple[str, object]] = {}
        pending = {c: r for r, c in enumerate(self.conns)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for c in mpc.wait(list(pending), timeout=left):
                r = pending.pop(c)
                try:
                    replies[r] = c.recv()
                except (EOFError, OSError):
                    code = self.procs[r].exitcode
                    replies[r] = ("error", f"rank {r} died (exit code {code})")
                if replies[r][0] == "error":     # the others may be stuck waiting for it
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
        if pending:
            self.kill()
            if any(k == "error" for k, _ in replies.values()):
                return replies
            raise AssertionError(
                f"dist_run: {what} timed out after {timeout:.0f}s on world {self.world}; "
                f"ranks {sorted(pending.values())} did not finish (pool killed)")
        return replies

    def run(self, fn, args: tuple, timeout: float) -> list:
        for c in self.conns:
            c.send((fn, args))
        replies = self._collect(timeout, what=f"{getattr(fn, '__qualname__', fn)}")
        errors = sorted((r, v) for r, (k, v) in replies.items() if k == "error")
        if errors:
            self.kill()
            rank, tb = errors[0]
            raise AssertionError(f"rank {rank}/{self.world} failed:\n{tb}")
        return [replies[r][1] for r in range(self.world)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=5)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        if _pools.get(self.world) is self:
            del _pools[self.world]


def failure(fn) -> str | None:
    """What `fn()` raised, as "Type: message" (None if it returned): for tests whose result
    is the error a rank gets."""
    try:
        fn()
    except Exception as e:                          # noqa: BLE001 — the message is the result
        return f"{type(e).__name__}: {e}"
    return None


def dist_run(world_size: int, fn, *args, timeout: float = HANG_S) -> list:
    """Run `fn(rank, world_size, *args)` on every rank; return the results by rank."""
    pool = _pools.get(world_size)
    if pool is not None and not pool.alive:
        pool.kill()
        pool = None
    if pool is None:
        while len(_pools) >= MAX_POOLS:
            next(iter(_pools.values())).close()
        pool = _Pool(world_size, timeout)
        _pools[world_size] = pool
    _pools.move_to_end(world_size)
    return pool.run(fn, args, timeout)


def shutdown() -> None:
    """Close every pool (idempotent)."""
    for pool in list(_pools.values()):
        pool.close()


atexit.register(shutdown)
