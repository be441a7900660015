"""Merging bandwidth profiles — several `shardc profile` JSON documents into one.

Input: the parsed documents of profiles measured on the same mesh at different times
(`explain/plan --bandwidth A.json B.json ...`). Output: one document of the same
format, read by `profile.Profile` as a single profile.

[Note: merged profiles]
A profile is one sample of a machine that drifts: on the emulated cluster
(docs/explain.md) entries of two profiles taken an hour apart differ by 8 % in the
median, and the compute rate by up to 6.6 %, which moves predictions of strategies 1 %
apart past one another. Profiles taken at different times are merged entry by entry:
each entry's `seconds` and `cpu_seconds` are the median over the files, as `shardc
profile` already takes the median over its runs and sweeps ([Note: a robust collective
time]). The compute record merges the same way:
the median `seconds` and `cpu_seconds`, and the rate is the traced FLOPs over the median
seconds. Every file must describe the same mesh, time the same entries and (when any
has one) the same compute run; otherwise the merge names the file and what differs
rather than mixing unlike measurements.
"""
from __future__ import annotations

from statistics import median

_KEY = ("op", "levels", "algo", "comm", "bytes")
_COMPUTE_SAME = ("model", "tokens", "seq", "dtype", "flops")


def _key(e: dict) -> tuple:
    return (e["op"], tuple(e["levels"]), e.get("algo", "ring"), e.get("comm", "fp32"), int(e["bytes"]))


def _entry_text(k: tuple) -> str:
    op, levels, algo, comm, nbytes = k
    return f"{op} over {', '.join(levels)} ({algo}, {comm}, {nbytes} bytes)"


def _med(values) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return median(vals) if vals else None


def _merge_entries(docs: list[dict], paths: list[str]) -> list[dict]:
    tables = [{_key(e): e for e in d["entries"]} for d in docs]
    for t, path in zip(tables[1:], paths[1:]):
        for k in tables[0].keys() ^ t.keys():
            where = paths[0] if k in t else path
            raise ValueError(f"{where} has no {_entry_text(k)} entry; merged profiles must time the same "
                             f"entries (the same `shardc profile` options)")
    out = []
    for k, first in tables[0].items():
        e = dict(first)
        e["seconds"] = _med(t[k]["seconds"] for t in tables)
        e["cpu_seconds"] = _med(t[k].get("cpu_seconds") for t in tables)
        out.append(e)
    return out


def _merge_compute(docs: list[dict], paths: list[str]) -> dict | None:
    recs = [d.get("compute") for d in docs]
    if all(r is None for r in recs):
        return None
    has = paths[next(i for i, r in enumerate(recs) if r is not None)]
    for r, path in zip(recs, paths):
        if r is None:
            raise ValueError(f"{path} has no compute record while {has} has one; profile every file "
                             f"with --model or none")
    for r, path in zip(recs[1:], paths[1:]):
        for f in _COMPUTE_SAME:
            if r.get(f) != recs[0].get(f):
                raise ValueError(f"{path} timed the compute with {f} {r.get(f)!r}, {paths[0]} with "
                                 f"{recs[0].get(f)!r}; merged profiles must time the same model")
    c = dict(recs[0])
    c["seconds"] = _med(r["seconds"] for r in recs)
    c["cpu_seconds"] = _med(r.get("cpu_seconds") for r in recs)
    c["flops_per_s"] = float(c["flops"]) / c["seconds"]
    return c


def merge(docs: list[dict], paths: list[str]) -> dict:
    """One profile document from `docs` (read from `paths`, named in errors): medians per
    entry and of the compute record ([Note: merged profiles]). Raises ValueError."""
    if len(docs) == 1:
        return docs[0]
    for d, path in zip(docs[1:], paths[1:]):
        if d.get("mesh") != docs[0].get("mesh"):
            raise ValueError(f"{path} was measured on mesh {_mesh_text(d)}, {paths[0]} on "
                             f"{_mesh_text(docs[0])}; merged profiles must share the mesh")
    out = dict(docs[0], entries=_merge_entries(docs, paths))
    compute = _merge_compute(docs, paths)
    if compute is not None:
        out["compute"] = compute
    return out


def _mesh_text(doc: dict) -> str:
    return " > ".join(f"{m['name']}({m['size']})" for m in doc.get("mesh") or []) or "(none)"
