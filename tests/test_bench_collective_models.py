"""bench/collective_models.py: the collective models against measured collectives.

A profile written here from α–β links by hand (node 1 ms + 5 MB/s, gpu 0.1 ms + 300 MB/s
per rank on node(2) > gpu(4)): one-level ring all-gathers, and two-level all-gathers by
the formulas of analysis/costmodel/network.py's notes, computed here. Both of the
script's models must then give model / measured = 1 for every two-level entry: the
links it fits from the one-level entries are the ones written, and what it composes
from them is what the formulas say.
"""
from __future__ import annotations

import json

import pytest

from tests.bench_modules import load_bench

LINK = {"node": (1e-3, 5e6, 2), "gpu": (1e-4, 3e8, 4)}     # latency per step, bytes/s, size


def ring(level: str, v: float) -> float:
    a, w, s = LINK[level]
    return (s - 1) * a + (s - 1) / s * v / w


def _doc() -> dict:
    one = [{"op": "all_gather", "levels": [l], "algo": "ring", "bytes": v, "seconds": ring(l, v)}
           for l in LINK for v in (1e6, 4e6, 16e6)]
    two = []
    for v in (4e6, 16e6):
        node, gpu = 4 * ring("node", v / 16), 4 * ring("gpu", v / 4)   # ho-ring: 4 pieces per stage
        flat = 7 * 1e-3 + max(2 / 8 * 7 / 8 * v / 5e6, 6 / 8 * 7 / 8 * v / 3e8)
        two += [{"algo": "hierarchical", "seconds": ring("node", v / 4) + ring("gpu", v)},
                {"algo": "ho-ring", "seconds": max(node, gpu) + min(node, gpu) / 4},
                {"algo": "ring", "seconds": flat}]
        for e in two[-3:]:
            e.update(op="all_gather", levels=["node", "gpu"], bytes=v)
    return {"mesh": [{"name": "node", "size": 2}, {"name": "gpu", "size": 4}], "device": "cpu",
            "entries": one + two}


def test_both_models_reproduce_a_profile_written_from_their_formulas(tmp_path):
    cm = load_bench("collective_models")
    got = cm.ratios(_doc())
    assert sorted({(m, a) for m, _, a, _ in got}) == [("composed", "hierarchical"), ("composed", "ho-ring"),
                                                      ("links", "hierarchical"), ("links", "ho-ring"), ("links", "ring")]
    assert all(r == pytest.approx(1.0, rel=1e-6) for r in got.values()), got
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_doc()))
    rows = cm.table([str(path), str(path)])
    assert {r["files"] for r in rows} == {2}
    md = cm.markdown(rows)
    assert "| links | all_gather | ring | 1.00 (1.00–1.00) | 1.00 (1.00–1.00) |" in md
