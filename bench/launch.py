"""torchrun on the emulated cluster (bench stage: script + flags -> one job's outcome).

Input: an entered `EmulatedCluster`, a worker script and its flags. Output: a `JobResult`
after torchrun has run once per node namespace (`--nnodes/--node-rank`, static
rendezvous on node 0's address, gloo bound to the namespace's veth by
`GLOO_SOCKET_IFNAME`). If any node's torchrun fails or the job runs past its
timeout, every process of the job is killed at once (a rank blocked in a collective
on another node would otherwise wait for gloo's 30-minute timeout).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from netns import EmulatedCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True, slots=True)
class JobResult:
    ok: bool
    returncodes: tuple[int | None, ...]
    logs: tuple[str, ...]          # one log file per node
    seconds: float
    timed_out: bool = False

    def tail(self, n: int = 25) -> str:
        """The last lines of every node's log (for error reports)."""
        out = []
        for path in self.logs:
            try:
                with open(path) as f:
                    lines = [l for l in f.read().splitlines() if "Warning" not in l]
            except OSError:
                continue
            out.append(f"--- {os.path.basename(path)}\n" + "\n".join(lines[-n:]))
        return "\n".join(out)


def node_env(cluster: EmulatedCluster) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME=cluster.ifname(0), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PYTHONUNBUFFERED="1")
    return env


def progress_poller(progress, task, path: str, label: str):
    """A `poll` for run_job: rank 0 appends one line per finished item to `path`; show the
    count and the last line on the rich `progress` bar."""
    def poll():
        if os.path.exists(path):
            with open(path) as f:
                lines = f.read().splitlines()
            if lines:
                progress.update(task, completed=len(lines), description=f"{label}: {lines[-1]}")
    return poll


def run_job(cluster: EmulatedCluster, script: str, flags: list[str], logdir: str, tag: str,
            port: int, timeout: float, poll=None) -> JobResult:
    """Run `script flags` on every rank; `poll()` is called about 4 times a second."""
    s = cluster.spec
    os.makedirs(logdir, exist_ok=True)
    procs, logs = [], []
    t0 = time.monotonic()
    for node in range(s.nodes):
        argv = [sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={s.nodes}", f"--node-rank={node}", f"--nproc-per-node={s.per_node}",
                f"--master-addr={cluster.master_addr}", f"--master-port={port}",
                "--max-restarts=0", "--monitor-interval=0.2", script, *flags]
        log = os.path.join(logdir, f"{tag}.node{node}.log")
        logs.append(log)
        with open(log, "w") as fh:
            procs.append(cluster.popen(node, argv, env=node_env(cluster), stdout=fh,
                                       stderr=subprocess.STDOUT, cwd=ROOT))
    timed_out = False
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            break                       # one node failed: stop the others now
        if time.monotonic() - t0 > timeout:
            timed_out = True
            break
        if poll:
            poll()
        time.sleep(0.25)
    if poll:
        poll()
    cluster.kill_all()
    codes = tuple(p.returncode for p in procs)
    ok = not timed_out and all(c == 0 for c in codes)
    return JobResult(ok, codes, tuple(logs), time.monotonic() - t0, timed_out)
