"""Emulated multi-node cluster on one Linux machine (bench stage: spec -> namespaces).

Input: a `ClusterSpec` (nodes, ranks per node, inter-node link rate/delay, one link per
node or per rank). Output: an `EmulatedCluster` context manager that owns one network
namespace per node plus one "switch" namespace holding a bridge, and that starts
commands inside a node's namespace. Everything it creates carries the prefix
`shardc-<pid>-` and is removed on exit, on error, on SIGINT/SIGTERM.

[Note: topology]
    node ns  shardc-<pid>-n<i>:  lo (up) + v0..v<k-1>   (k = 1, or ranks per node)
    switch   shardc-<pid>-sw:    br0 + n<i>v<j> (the veth peers), all enslaved to br0
Addresses are 10.213.0.<1 + i*k + j>/32, only ever configured inside these
namespaces, so parallel runs (different pids) reuse the same subnet without colliding.
Each node has a /32 host route to every remote address with the same link index j
through its own v<j> (per-rank links: local rank j talks to the other nodes over its
own NIC; per-node links: k = 1, everything uses v0). `arp_ignore=1` makes a node answer
ARP only on the interface that owns the address, so the bridge delivers to that NIC.

[Note: shaping]
The inter-node link is shaped in both directions with an htb class at `rate`: on the
node side of each veth (the node's upload) and on the switch side (the node's
download), so a node's NIC is full duplex at `rate` however many peers send to it.
The optional delay is a netem leaf on the node side only (one-way delay = `delay`).
Intra-node traffic never touches a veth: gloo binds every rank of a node to an
address of that node, and the kernel routes traffic between two local addresses
through `lo` (the `local` routing table), so it stays unshaped. `--collectives`
verifies both rates and the byte counters (bench/collectives_worker.py).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

SUBNET = "10.213.0"


class ClusterError(RuntimeError):
    """A clear, user-facing reason why the emulated cluster cannot be built."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    nodes: int
    per_node: int
    rate: str = "1gbit"            # tc rate syntax, e.g. "1gbit", "500mbit"
    delay: str | None = None       # tc time syntax, e.g. "0.1ms"; needs sch_netem
    per_rank_links: bool = False   # one shaped NIC per rank instead of one per node

    @property
    def links(self) -> int:
        return self.per_node if self.per_rank_links else 1

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


def require_root_and_tools() -> None:
    """Raise ClusterError with the reason when namespaces cannot be built here."""
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (network namespaces, tc); run as root")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"the emulated cluster needs iproute2; missing: {', '.join(missing)}")


def _run(argv: list[str]) -> None:
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {p.stderr.strip() or p.stdout.strip()}")


class EmulatedCluster:
    """Context manager: builds the namespaces on enter, tears them down on exit."""

    def __init__(self, spec: ClusterSpec, prefix: str | None = None):
        self.spec = spec
        self.prefix = prefix or f"shardc-{os.getpid()}"
        self._made: list[str] = []          # namespaces created, in order
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}

    # ---- names and addresses -------------------------------------------------
    def ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def addr(self, node: int, link: int = 0) -> str:
        return f"{SUBNET}.{1 + node * self.spec.links + link}"

    @staticmethod
    def ifname(link: int) -> str:
        return f"v{link}"

    @property
    def master_addr(self) -> str:
        return self.addr(0, 0)

    def namespaces(self) -> list[str]:
        return list(self._made)

    # ---- lifecycle -------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        require_root_and_tools()
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:          # not the main thread: rely on __exit__/finally
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        s = self.spec
        self._add_ns(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i in range(s.nodes):
            ns = self.ns(i)
            self._add_ns(ns)
            for key in ("arp_ignore=1", "arp_announce=2"):
                _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.all.{key}"])
            for j in range(s.links):
                self._add_link(i, j)
        for i in range(s.nodes):
            self._add_routes(i)

    def _add_link(self, node: int, link: int) -> None:
        ns, sw, dev, peer = self.ns(node), self.switch, self.ifname(link), f"n{node}v{link}"
        _run(["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", peer, "netns", sw])
        _run(["ip", "-n", ns, "addr", "add", f"{self.addr(node, link)}/32", "dev", dev])
        _run(["ip", "-n", ns, "link", "set", dev, "up"])
        _run(["ip", "-n", sw, "link", "set", peer, "master", "br0"])
        _run(["ip", "-n", sw, "link", "set", peer, "up"])
        self._shape(ns, dev, delay=self.spec.delay)      # node upload
        self._shape(sw, peer, delay=None)                # node download

    def _shape(self, ns: str, dev: str, delay: str | None) -> None:
        rate = self.spec.rate
        tc = ["ip", "netns", "exec", ns, "tc"]
        _run(tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
        _run(tc + ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                   "rate", rate, "ceil", rate, "burst", "256k", "cburst", "256k", "quantum", "200000"])
        if delay:
            p = subprocess.run(tc + ["qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:",
                                     "netem", "delay", delay, "limit", "100000"],
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise ClusterError(
                    f"cannot add the {delay} link delay: tc netem failed ({p.stderr.strip()}); "
                    "this kernel lacks sch_netem — run without --inter-delay")

    def _add_routes(self, node: int) -> None:
        s, ns = self.spec, self.ns(node)
        for other in range(s.nodes):
            if other == node:
                continue
            for j in range(s.links):
                _run(["ip", "-n", ns, "route", "add", f"{self.addr(other, j)}/32",
                      "dev", self.ifname(j), "src", self.addr(node, j)])

    # ---- processes -------------------------------------------------------------
    def popen(self, node: int, argv: list[str], env: dict[str, str] | None = None,
              **kw) -> subprocess.Popen:
        """Start `argv` inside node's namespace, in its own process group."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=env,
                             start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def kill_all(self) -> None:
        """SIGTERM then SIGKILL every process group this cluster started."""
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            _signal_group(p.pid, signal.SIGTERM)
        for p in live:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                p.wait()
        for p in self._procs:           # stragglers left in the group after the leader died
            _signal_group(p.pid, signal.SIGKILL)
        self._procs.clear()

    def teardown(self) -> None:
        """Kill what we started and delete every namespace we made (idempotent)."""
        try:
            self.kill_all()
        finally:
            for name in reversed(self._made):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            self._made.clear()
            self._restore_signal_handlers()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def remove_stale(prefix: str = "shardc-") -> list[str]:
    """Delete namespaces `<prefix><pid>-...` whose owning process is gone (a run that was
    SIGKILLed could not tear down); live runs' namespaces are left alone."""
    removed = []
    for name in leftover_namespaces(prefix):
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
        for p in pids.split():
            _kill(int(p))
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def leftover_namespaces(prefix: str) -> list[str]:
    """Namespaces whose name starts with `prefix` (for tests and sanity checks)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]
