"""Measured bandwidth model — a `shardc profile` JSON as seconds per collective.

Input: one or several profile files of one mesh (`shardc profile`, merged by
`profile_merge.py`). Output: `Profile`, a bandwidth model like `AlphaBeta` and
`LevelLinks` (`seconds`, `cost`, `key`) that reads each collective's time off the
measured group, interpolating between measured sizes and composing staged algorithms
from measured rings where the group itself was not measured (each of the algorithm's
stages, shardc.algorithms; HO-Ring: `pieces` rings per stage, on a piece's share).

[Note: below the measured sizes]
Between and above its measured sizes a profile interpolates bandwidth (linear in
log bytes, clamped above). Below the smallest, clamping the bandwidth would make a
collective's time shrink with its bytes to nothing, but a small collective still pays
its latency: there it is the line through the two smallest points, latency + bytes /
rate, the latency kept within [0, the smallest's time]. HO-Ring's pieces of a 128 KiB
collective are 32 KiB: composed from one-level entries (128 KiB and up) they came out
at 0.22–0.26 of the measured HO-Ring on the emulated cluster with the clamp, 0.79–0.92
with the line (docs/explain.md, "Collective models against measured collectives").

[Note: CPU share of a collective]
On CPU ranks (gloo) a collective is partly work on the same cores that compute: the
loopback copies between ranks of a node, the reductions, gloo's threads; the rest is
waiting for a shaped link, which other ranks' compute fills. `shardc profile` records
each collective's process CPU seconds u next to its wall seconds T, and the compute
run's wall/CPU ratio r (how many ranks share a core while all compute). Under the same
contention u CPU seconds cost u·r wall seconds of the shared cores, so the occupied part
is k = min(T, u·r); only T − k can overlap compute. A profile without CPU seconds (CUDA)
has k = 0.
"""
from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import dataclass
from math import prod

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Collectives, Level, Mesh
from shardc.dsl.quantities import flop_rate

import shardc.algorithms as algorithms
from shardc.lowering import Op
from shardc.analysis.costmodel.network import in_node_link
from shardc.analysis.costmodel.network import combine as _combine, stage_sizes as _stage_sizes
from shardc.analysis.costmodel.profile_merge import merge


@dataclass(frozen=True, slots=True)
class Profile:
    """Measured collectives: `{(Op, levels, algo, comm): ((bytes, seconds, cpu seconds), ...)}`
    sorted by bytes (the file spells the op: its value), and the measured compute record (`compute`, or None)."""
    entries: dict
    compute: dict | None = None
    files: int = 1                       # > 1: merged, the median of each entry
    mesh: Mesh | None = None             # the mesh it was measured on; None if unrecorded

    def __str__(self) -> str:
        rate = "" if self.flops is None else f", compute {flop_rate(self.flops)} per rank"
        merged = "" if self.files == 1 else f"median of {self.files} files, "
        return f"bandwidth profile ({merged}{len(self.entries)} measured groups{rate})"

    @classmethod
    def load(cls, *paths: str) -> "Profile":
        """One profile file, or several of one mesh merged entry by entry ([Note: merged
        profiles] in profile_merge.py)."""
        docs = []
        for path in paths:
            try:
                with open(path) as f:
                    docs.append(json.load(f))
            except (OSError, ValueError) as e:
                raise ShardcError(f"cannot read bandwidth profile {path}: {e}") from None
        what = f" {paths[0]}" if len(paths) == 1 else "s " + ", ".join(paths)
        try:
            data = merge(docs, list(paths))
            table: dict = {}
            for e in data["entries"]:
                key = (Op(e["op"]), tuple(e["levels"]), e.get("algo", "ring"), e.get("comm", "fp32"))
                cpu = e.get("cpu_seconds")
                table.setdefault(key, []).append((float(e["bytes"]), float(e["seconds"]),
                                                  0.0 if cpu is None else float(cpu)))
            compute = data.get("compute")
            if compute is not None and float(compute["flops_per_s"]) <= 0:
                raise ValueError("compute.flops_per_s must be positive")
            levels = tuple(Level(m["name"], int(m["size"])) for m in data.get("mesh") or ())
        except (ValueError, KeyError, TypeError) as e:
            raise ShardcError(f"cannot read bandwidth profile{what}: {e}") from None
        return cls({k: tuple(sorted(v)) for k, v in table.items()}, compute, len(paths),
                   Mesh(levels) if levels else None)

    def check(self, mesh: Mesh) -> None:
        """A measured collective's time is its group's: refuse a profile of another mesh."""
        if self.mesh is not None and self.mesh != mesh:
            raise ShardcError(f"the bandwidth profile was measured on mesh {self.mesh}, the strategy runs on {mesh}; "
                              f"profile that mesh (`shardc profile --mesh`) or describe its links with --link")

    @property
    def flops(self) -> float | None:
        """Measured achievable FLOP/s per rank ([Note: measured compute rate]), or None."""
        return None if self.compute is None else float(self.compute["flops_per_s"])

    @property
    def cpu_share(self) -> float:
        """Wall seconds per CPU second while every rank computes (0: no CPU measurement)."""
        c = self.compute or {}
        return c["seconds"] / c["cpu_seconds"] if c.get("cpu_seconds") else 0.0

    def _lookup(self, op: Op, levels: tuple[str, ...], algo: str, nbytes: float, comm: str = "fp32"):
        """(seconds, occupied seconds) of one measured group at `nbytes` (payload bytes), or
        None. A quantized collective uses its own entries when profiled (codec work
        included), else the fp32 ones at its payload size."""
        pts = None
        for c in dict.fromkeys((comm, "fp32")):
            pts = self.entries.get((op, levels, algo, c))
            if pts is None and len(levels) == 1:   # one level: every algorithm is the same ring
                pts = next((v for (o, l, _, c2), v in self.entries.items() if o == op and l == levels
                            and c2 == c), None)
            if pts is not None:
                break
        if pts is None:
            return None
        if nbytes <= 0:
            return 0.0, 0.0
        t = _below(pts, nbytes) if nbytes < pts[0][0] else nbytes / _interp([(b, b / s) for b, s, _ in pts], nbytes)
        return t, t * _interp([(b, min(1.0, u * self.cpu_share / s)) for b, s, u in pts], nbytes)

    def key(self, mesh: Mesh, level: str) -> str:
        """The level whose links carry `level`'s traffic: measured groups inside a node
        share its one in-node link too ([Note: one in-node link])."""
        return in_node_link(mesh, level)

    def seconds(self, op: Op, levels, nbytes: float, mesh: Mesh, algo: Collectives) -> float:
        return self.cost(op, levels, nbytes, mesh, algo)[0]

    def cost(self, op: Op, levels, nbytes: float, mesh: Mesh, algo: Collectives,
             comm: str = "fp32") -> tuple[float, float]:
        """(seconds, seconds that occupy the cores) of one collective whose payload is
        `nbytes` in wire dtype `comm` ([Note: CPU share of a collective])."""
        sizes = _stage_sizes(mesh, levels)
        if not sizes:
            return 0.0, 0.0
        names = tuple(l for l, _ in sizes)
        if op is Op.ALL_TO_ALL:   # qgZ: one flat all-to-all; `shardc profile` does not time it, and a
            algo = Collectives.RING          # ring reduce-scatter sends the same (p−1)/p·V per rank
            t = self._lookup(op, names, "ring", nbytes, comm)
            op = Op.REDUCE_SCATTER if t is None else op
        t = self._lookup(op, names, algo.value, nbytes, comm)
        if t is not None:
            return t
        algo_ = algorithms.resolve(algo, names)
        if len(sizes) > 1 and algo_.name != "ring":     # compose the stages from measured rings
            # a piece of a pipelined algorithm is a measured ring on its share, `pieces` times
            stages, busy = [], 0.0
            for sop, slv, v in algo_.stages(op.value, names, mesh.ordered, mesh.size, nbytes):
                st = self._lookup(Op(sop), tuple(slv), "ring", v / algo_.pieces, comm)
                if st is None:
                    break
                stages.append((self.key(mesh, slv[0]), algo_.pieces * st[0]))
                busy += algo_.pieces * st[1]
            else:
                return _combine(stages, algo, names), busy
        raise ShardcError(f"the bandwidth profile has no {op.value} entry over {', '.join(names)} "
                          f"({algo.value}); profile that group or pass --intra/--inter")


def _below(pts, nbytes: float) -> float:
    """Seconds of a collective smaller than any measured ([Note: below the measured
    sizes]): the line through the two smallest measured points, latency + bytes / rate,
    with the latency at least 0."""
    b0, t0, _ = pts[0]
    slope = (pts[1][1] - t0) / (pts[1][0] - b0) if len(pts) > 1 else t0 / b0
    slope = min(max(0.0, slope), t0 / b0)          # the latency within [0, t0]
    return t0 - slope * b0 + slope * nbytes


def _interp(pts, nbytes: float) -> float:
    """A measured quantity (bandwidth, occupied share) at `nbytes`: linear in log(bytes)
    between the measured sizes `pts = ((bytes, value), ...)`, clamped outside them."""
    sizes = [b for b, _ in pts]
    vals = [v for _, v in pts]
    i = bisect_left(sizes, nbytes)
    if i == 0:
        return vals[0]
    if i == len(sizes):
        return vals[-1]
    x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
    t = (math.log(nbytes) - x0) / (x1 - x0) if x1 > x0 else 0.0
    return vals[i - 1] + t * (vals[i] - vals[i - 1])
