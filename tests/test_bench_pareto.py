"""The Pareto plot's frontier (bench/plot.py `pareto`): at every memory budget, the fastest.

Hand-made points: a point is on the frontier iff no other is at most as large in memory
and in step time and smaller in one; ties in memory keep the faster; the plot renders
real cluster_bench JSON (the shipped 250 Mbit/s results) to a PNG.
"""
from __future__ import annotations

import os

from tests.bench_modules import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plot():
    return load_bench("plot")


def test_frontier_keeps_only_undominated_points():
    pts = [(24.0, 12.0, "zero3"), (36.0, 7.2, "zeropp"), (48.0, 7.3, "mics"), (73.0, 6.8, "paro_nig"),
           (85.0, 6.3, "hsdp_zero2"), (85.0, 6.9, "slower_same_memory"), (110.0, 6.0, "zero1"),
           (195.0, 6.1, "ddp")]
    front = _plot().frontier(pts)
    assert [n for _, _, n in front] == ["zero3", "zeropp", "paro_nig", "hsdp_zero2", "zero1"]
    assert all(a[1] > b[1] and a[0] < b[0] for a, b in zip(front, front[1:]))


def test_pareto_plot_renders_shipped_results(tmp_path):
    import json
    with open(os.path.join(ROOT, "bench", "results", "systems_250mbit_bench_2026-11-22.json")) as f:
        doc = json.load(f)
    out = tmp_path / "pareto.png"
    _plot().plot_pareto([doc, doc], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
