"""Plots for docs/BENCHMARKS.md (bench stage: cluster_bench JSON -> PNG).

    python bench/plot.py systems RESULTS.json docs/bench_systems.png
    python bench/plot.py collectives COLL.json docs/bench_collectives.png
    python bench/plot.py table RESULTS.json        # markdown results table on stdout

`systems`: median step time per system (bars, seconds) and model-state bytes per rank
(after the step, and the peak during accumulation). `collectives`: time of one
all-gather / reduce-scatter over the whole emulated cluster against message size,
one line per algorithm.
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_systems(doc: dict, out: str) -> None:
    ok = {k: v for k, v in doc["systems"].items() if "error" not in v}
    names = list(ok)
    colors = ["tab:orange" if n.startswith(("fsdp2", "ddp")) else "tab:blue" for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.bar(names, [ok[n]["step_time_s"] for n in names], color=colors)
    a.set_ylabel("median step time (s)")
    c = doc["config"]
    a.set_title(f"{c['nodes']}x{c['per_node']} ranks, {c['inter_rate']} inter-node, "
                f"model {c['model']}, accumulate {c['accumulate']}")
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [ok[n]["model_state_bytes"] / 2**20 for n in names], 0.4,
          color=colors, label="after the step")
    b.bar([i + 0.2 for i in x], [ok[n]["peak_model_state_bytes"] / 2**20 for n in names], 0.4,
          color=colors, alpha=0.45, hatch="//", label="peak during accumulation")
    b.set_xticks(list(x), names)
    b.set_ylabel("model-state MiB per rank")
    b.set_title("params + grads + AdamW states per rank")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=40)
        for lbl in ax.get_xticklabels():
            lbl.set_ha("right")
    fig.text(0.01, 0.01, "orange: PyTorch peers, blue: shardc", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_collectives(doc: dict, out: str) -> None:
    rows = doc["collectives"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, op in zip(axes, ("all_gather", "reduce_scatter")):
        for algo in ("RING", "HIERARCHICAL", "HO_RING"):
            pts = sorted((r["bytes"], r["time_s"]) for r in rows if r["op"] == op and r["algo"] == algo)
            ax.plot([p[0] / 2**20 for p in pts], [p[1] * 1e3 for p in pts], marker="o",
                    label=algo.lower().replace("_", "-"))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message (full buffer) MiB")
        ax.set_ylabel("ms")
        c = doc["config"]
        ax.set_title(f"{op} over {c['nodes']}x{c['per_node']}, {c['inter_rate']} inter-node")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(doc: dict) -> str:
    """Markdown: one row per system; speed-up against fsdp2:full where it ran."""
    sysd = doc["systems"]
    base = sysd.get("fsdp2:full", {}).get("step_time_s")
    head = ("| system | collectives | step (s) | vs fsdp2:full | tokens/s | states MiB (after step / peak) "
            "| node MB/rank/step: model / wire | gpu MB/rank/step: model / wire |")
    rows = [head, "|" + "---|" * 8]
    for name, r in sysd.items():
        if "error" in r:
            rows.append(f"| {name} | | error: {r['error'][:80]} | | | | | |")
            continue
        lb, mb = r["level_bytes"], r.get("measured_bytes") or {}
        speed = f"{base / r['step_time_s']:.2f}x" if base else "-"
        rows.append(
            f"| {name} | {r.get('collectives', 'gloo ring')} | {r['step_time_s']:.2f} | {speed} | {r['tokens_per_s']:.0f} "
            f"| {r['model_state_bytes'] / 2**20:.1f} / {r['peak_model_state_bytes'] / 2**20:.1f} "
            f"| {lb.get('node', 0) / 1e6:.1f} / {mb.get('node', 0) / 1e6:.1f} "
            f"| {lb.get('gpu', 0) / 1e6:.1f} / {mb.get('gpu', 0) / 1e6:.1f} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "table":
        with open(argv[1]) as f:
            print(table(json.load(f)))
        return 0
    if len(argv) != 3 or argv[0] not in ("systems", "collectives"):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        doc = json.load(f)
    (plot_systems if argv[0] == "systems" else plot_collectives)(doc, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
