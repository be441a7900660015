"""The collective models against measured collectives (bench stage: profile JSONs -> one table).

    python bench/collective_models.py PROFILE.json [PROFILE.json ...] [--md OUT.md]

Input: `shardc profile` JSONs of one two-level mesh (`cluster_bench.py
--bandwidth-profile`). Each file checks the models with its own one-level entries,
against its own two-level entries (fp32):
- **composed**: `hierarchical` and `ho-ring` over both levels, composed by the cost
  model from the file's measured one-level rings alone (`Profile` without its
  two-level entries: [Note: staged algorithms] with measured stages, [Note: below the
  measured sizes] in analysis/costmodel/profile.py);
- **links**: every two-level algorithm from per-level links fitted to the file's
  one-level ring all-gathers (latency + bytes / rate, least squares per level) through
  analysis/costmodel/network.py; a flat reduce-scatter is the all-to-all shardc's
  runtime issues on gloo ([Note: reduce-scatter on gloo] in runtime/eager/collectives.py).
Output: per model, op, algorithm and size, model / measured as the median over the
files with its range. No timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from shardc.analysis.costmodel.links import FACTOR, flat_ring
from shardc.analysis.costmodel.network import LevelLinks
from shardc.analysis.costmodel.profile import Profile
from shardc.analysis.costmodel.timing import AlphaBeta
from shardc.dsl.ir import Collectives, Level, Mesh
from shardc.lowering import Op


def _fp32(e: dict) -> bool:
    return e.get("comm", "fp32") == "fp32"


def _fit_link(entries: list[dict], level: str, mesh: Mesh) -> tuple[float, float]:
    """(latency per ring step, bytes/s per rank) of `level` from its one-level ring
    all-gathers: t = (p-1)·latency + bytes per rank / rate, least squares."""
    sizes = [(level, mesh.size(level))]
    pts = [(flat_ring(Op.ALL_GATHER, sizes, e["bytes"])[level], e["seconds"]) for e in entries
           if Op(e["op"]) is Op.ALL_GATHER and e["levels"] == [level] and _fp32(e)]
    slope, intercept = statistics.linear_regression([b for b, _ in pts], [t for _, t in pts])
    steps = FACTOR[Op.ALL_GATHER] * (mesh.size(level) - 1)
    return max(0.0, intercept) / steps, 1.0 / slope


def _one_level_profile(doc: dict) -> Profile:
    """`doc` without its multi-level entries, read as `explain --bandwidth` reads a file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "one_level.json")
        with open(path, "w") as f:
            json.dump(dict(doc, entries=[e for e in doc["entries"] if len(e["levels"]) == 1]), f)
        return Profile.load(path)


def ratios(doc: dict) -> dict:
    """{(model, op, algo, bytes): model / measured} for one profile document."""
    mesh = Mesh(tuple(Level(m["name"], int(m["size"])) for m in doc["mesh"]))
    two = [e for e in doc["entries"] if len(e["levels"]) == 2 and _fp32(e) and Op(e["op"]) is not Op.ALL_TO_ALL]
    composed = _one_level_profile(doc)
    links = LevelLinks(tuple((l, w, a) for l in mesh.names for a, w in [_fit_link(doc["entries"], l, mesh)]),
                       AlphaBeta())
    out = {}
    for e in two:
        algo, levels, op = Collectives(e["algo"]), tuple(e["levels"]), Op(e["op"])
        if algo is not Collectives.RING:
            out[("composed", e["op"], e["algo"], e["bytes"])] = (
                composed.seconds(op, levels, e["bytes"], mesh, algo) / e["seconds"])
        wire = Op.ALL_TO_ALL if (op, algo) == (Op.REDUCE_SCATTER, Collectives.RING) else op
        out[("links", e["op"], e["algo"], e["bytes"])] = links.seconds(wire, levels, e["bytes"], mesh, algo) / e["seconds"]
    return out


def table(paths: list[str]) -> list[dict]:
    pooled: dict = {}
    for path in paths:
        with open(path) as f:
            for k, r in ratios(json.load(f)).items():
                pooled.setdefault(k, []).append(r)
    return [{"model": m, "op": op, "algo": algo, "bytes": b, "median": statistics.median(v), "min": min(v),
             "max": max(v), "files": len(v)} for (m, op, algo, b), v in sorted(pooled.items())]


def markdown(rows: list[dict]) -> str:
    sizes = sorted({r["bytes"] for r in rows})
    head = "| model | op | algorithm | " + " | ".join(f"{b // 1024} KiB" for b in sizes) + " |"
    lines = [head, "|---|---|---|" + "---:|" * len(sizes)]
    for key in dict.fromkeys((r["model"], r["op"], r["algo"]) for r in rows):
        cells = {r["bytes"]: f"{r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f})" for r in rows
                 if (r["model"], r["op"], r["algo"]) == key}
        lines.append(f"| {' | '.join(key)} | " + " | ".join(cells.get(b, "") for b in sizes) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profiles", nargs="+", help="shardc profile JSONs of one two-level mesh")
    p.add_argument("--md", help="also write the markdown table here")
    args = p.parse_args(argv)
    md = markdown(table(args.profiles))
    sys.stdout.write(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"model / measured, median (range) over {len(args.profiles)} profiles\n\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
