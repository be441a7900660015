"""Faults and timeouts — stage: runtime.

Input: the shardc timeout (`shardc.compile(..., timeout=...)`, `shard_module(..., timeout=...)`
or the `SHARDC_TIMEOUT` environment variable, in seconds; default `DEFAULT_TIMEOUT_S`),
the default process group's store.
Output: `Faults`, one per ShardedModule: `enter(name)`, a bounded rendezvous before the
collective APIs users call outside the training step (`full_state_dict()`,
`load_state_dict()`, ...), so that a rank calling one alone gets an error naming it instead
of a silent hang; the timeout on every process group; `guard`, a unit's `GuardedComm`,
whose failed or timed-out collectives become a `PeerFailure` naming the collective, the
unit and, where known, the peer; `timeout_s()`.

[Note: entry rendezvous]
Each ShardedModule gets a key prefix from a per-process counter (every rank shards the
same models in the same order, so the prefixes agree). Entering API `name` for the k-th
time adds 1 to the store counter `<prefix>/<name>/<k>` and polls it until it reaches the
world size or the timeout passes; on a timeout the rank takes its 1 back and raises, so a
later, correct call by all ranks still meets.
"""
from __future__ import annotations

import itertools
import os
import time

import torch.distributed as dist

from shardc.lowering import Op, Phase, Row

from .comm import UnitCollectives
from ..errors import RuntimeUsageError

DEFAULT_TIMEOUT_S = 600.0
ENV = "SHARDC_TIMEOUT"
_ids = itertools.count()


def timeout_s(explicit: float | None = None) -> float:
    """The shardc timeout in seconds: `explicit`, else $SHARDC_TIMEOUT, else the default."""
    if explicit is not None:
        value, where = explicit, "timeout"
    else:
        value, where = os.environ.get(ENV, DEFAULT_TIMEOUT_S), f"${ENV}"
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RuntimeUsageError(f"{where} must be a number of seconds, got {value!r}") from None
    if value <= 0:
        raise RuntimeUsageError(f"{where} must be positive, got {value}")
    return value


class Faults:
    """One ShardedModule's fault handling: its timeout, its key prefix in the store and how
    often each collective API was entered (see [Note: entry rendezvous])."""

    def __init__(self, timeout: float | None = None):
        self.timeout = timeout_s(timeout)
        self.prefix = f"shardc/{next(_ids)}"
        self._entries: dict[str, int] = {}
        self._members: tuple[int, ...] = ()

    def bind(self, smesh) -> None:
        """The ranks that meet at an entry: every rank of the mesh (a sub-mesh of a bigger
        DeviceMesh meets apart from its tensor-parallel peers' sub-meshes)."""
        self._members = tuple(sorted(int(r) for r in smesh.device_mesh.mesh.flatten().tolist()))

    def enter(self, name: str) -> None:
        """Wait (bounded by the shardc timeout) until every rank of the mesh has entered `name`."""
        world = len(self._members) or dist.get_world_size()
        if world == 1:
            return
        store = dist.distributed_c10d._get_default_store()
        seq = self._entries.get(name, 0)
        key = f"{self.prefix}/{self._members[:1]}/{name}/{seq}"
        deadline = time.monotonic() + self.timeout
        count, pause = store.add(key, 1), 0.001
        while count < world:
            if time.monotonic() > deadline:
                store.add(key, -1)
                raise RuntimeUsageError(
                    f"{name} is a collective: every rank must call it, but only {count} of {world} "
                    f"ranks did within {self.timeout:g}s (rank {dist.get_rank()} waited; set the shardc "
                    f"timeout or ${ENV} to wait longer)")
            time.sleep(pause)
            pause = min(0.05, pause * 2)
            count = store.add(key, 0)
        self._entries[name] = seq + 1

    def apply_timeout(self, smesh) -> None:
        """Set the shardc timeout on the default process group and on every group of `smesh`."""
        from datetime import timedelta
        if _fake():                                 # torch sets no timeout there (and warns)
            return
        for g in [None, *smesh.process_groups()]:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.timeout), g)

    def set_timeout(self, seconds: float, smesh) -> None:
        """Change the shardc timeout (and that of the process groups)."""
        self.timeout = timeout_s(seconds)
        self.apply_timeout(smesh)

    def register(self) -> None:
        """Publish this rank's host and pid, so survivors can tell which peer died."""
        import socket
        if dist.get_world_size() > 1 and not _fake():     # a fake group's store may not store
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{self.prefix}/pid/{dist.get_rank()}", f"{socket.gethostname()}:{os.getpid()}")

    def guard(self, comm: UnitCollectives, unit: str) -> "GuardedComm":
        return GuardedComm(comm, unit, self.prefix)


def _fake() -> bool:
    """Whether the default group is torch's `fake` one (one process simulating a rank of N:
    its peers do not exist, so there is no peer to time out or to find dead)."""
    return dist.get_backend() == "fake"


# -- process-group timeout and failed peers ---------------------------------------------------
class PeerFailure(RuntimeUsageError):
    """A collective of the training step failed or timed out (a peer died or stopped)."""


def _dead_peers(prefix: str) -> list[str]:
    """Peers on this host whose process is gone (only what can be known from here)."""
    import socket
    try:
        store = dist.distributed_c10d._get_default_store()
        out = []
        for r in range(dist.get_world_size()):
            key = f"{prefix}/pid/{r}"
            if not store.check([key]):
                continue
            host, pid = store.get(key).decode().rsplit(":", 1)
            if host == socket.gethostname():
                if not _alive(int(pid)):
                    out.append(f"rank {r} (pid {pid}) has exited")
        return out
    except Exception:                               # noqa: BLE001 — the store itself may be gone
        return []


def _settled_dead_peers(prefix: str, grace: float = 2.0) -> list[str]:
    """`_dead_peers`, polled for up to `grace` seconds while none is found: a killed peer's
    sockets close (the reset a survivor sees) before the kernel marks it exited."""
    end = time.monotonic() + grace
    dead = _dead_peers(prefix)
    while not dead and time.monotonic() < end:
        time.sleep(0.1)
        dead = _dead_peers(prefix)
    return dead


def _alive(pid: int) -> bool:
    """False once `pid` is gone or a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError, PermissionError, IndexError):
        return False
    except OSError:
        return True


class GuardedWork:
    """A work handle whose failure (a peer died, or the timeout passed) becomes a
    `PeerFailure` naming the collective, the unit and, where known, the peer."""

    __slots__ = ("work", "what", "prefix", "start")

    def __init__(self, work, what: str, prefix: str):
        self.work, self.what, self.prefix, self.start = work, what, prefix, time.monotonic()

    def wait(self) -> bool:
        try:
            return self.work.wait()
        except RuntimeError as e:
            dead = _settled_dead_peers(self.prefix)
            peer = "; ".join(dead) if dead else "the peer is unknown (it may have raised, hung or died on another host)"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerFailure(
                f"{self.what} failed on rank {dist.get_rank()} after "
                f"{time.monotonic() - self.start:.1f}s: {peer} [{first}]") from None


class GuardedComm(UnitCollectives):
    """A unit's collectives: those of `inner`, each work handle guarded (see GuardedWork)."""

    def __init__(self, inner: UnitCollectives, unit: str, prefix: str):
        self.inner, self.unit, self.prefix = inner, unit, prefix

    def _guard(self, op: Op, row: Row | None, phase: Phase | None, work):
        if row is None:
            return work
        what = f"{op.value} over {', '.join(row.levels)} ({(phase or row.phase).value}) of unit {self.unit!r}"
        return GuardedWork(work, what, self.prefix)

    def all_gather(self, row, out, inp, *, phase=None, record=True):
        return self._guard(Op.ALL_GATHER, row, phase,
                           self.inner.all_gather(row, out, inp, phase=phase, record=record))

    def reduce_scatter(self, row, out, inp, *, scratch=None):
        return self._guard(Op.REDUCE_SCATTER, row, None,
                           self.inner.reduce_scatter(row, out, inp, scratch=scratch))

    def all_reduce(self, row, t):
        return self._guard(Op.ALL_REDUCE, row, None, self.inner.all_reduce(row, t))
