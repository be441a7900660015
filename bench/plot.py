"""Plots for docs/BENCHMARKS.md (bench stage: cluster_bench JSON -> PNG).

    python bench/plot.py systems RESULTS.json docs/bench_systems.png
    python bench/plot.py collectives COLL.json docs/bench_collectives.png
    python bench/plot.py table RESULTS.json        # markdown results table on stdout
    python bench/plot.py pareto OUT.png RESULTS.json [RESULTS.json ...]   # one panel per file

`systems`: median step time per system (bars, seconds) and model-state bytes per rank
(after the step, and the peak during accumulation). `collectives`: time of one
all-gather / reduce-scatter over the whole emulated cluster against message size,
one line per algorithm. `pareto`: "at my memory budget, what is fastest?" — per results
file (e.g. one at 250 Mbit/s, one at 1 Gbit/s) every system's median step time against
its peak model-state MiB per rank, shardc and the PyTorch peers (FSDP2, DDP) in two
colours, each side's Pareto frontier drawn as a staircase.
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


def frontier(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The Pareto-optimal (memory, time, name) points: none other is at most as large in
    both and smaller in one. Sorted by memory (time then falls)."""
    out: list[tuple[float, float, str]] = []
    for m, t, n in sorted(points):
        if not out or t < out[-1][1]:
            if out and out[-1][0] == m:
                out.pop()
            out.append((m, t, n))
    return out


def _is_peer(name: str) -> bool:
    return name.startswith(("fsdp2", "ddp"))


def plot_pareto(docs: list[dict], out: str) -> None:
    fig, axes = plt.subplots(1, len(docs), figsize=(6.5 * len(docs), 4.8), squeeze=False)
    for ax, doc in zip(axes[0], docs):
        ok = {k: v for k, v in doc["systems"].items() if "error" not in v}
        for peer, color, label in ((True, "tab:orange", "PyTorch (FSDP2, DDP)"), (False, "tab:blue", "shardc")):
            pts = [(v["peak_model_state_bytes"] / 2**20, v["step_time_s"], k) for k, v in ok.items()
                   if _is_peer(k) == peer]
            if not pts:
                continue
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, label=label, zorder=3)
            for m, t, n in pts:
                ax.annotate(n.split(":", 1)[-1], (m, t), fontsize=7, xytext=(3, 3), textcoords="offset points")
            front = frontier(pts)
            ax.step([p[0] for p in front], [p[1] for p in front], where="post", color=color, alpha=0.7,
                    label=f"{label} frontier")
        c = doc["config"]
        ax.set_title(f"{c['nodes']}x{c['per_node']} ranks, {c['inter_rate']} inter-node, accumulate {c['accumulate']}")
        ax.set_xlabel("peak model-state MiB per rank")
        ax.set_ylabel("median step time (s)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "pareto":
        docs = []
        for path in argv[2:]:
            with open(path) as f:
                docs.append(json.load(f))
        plot_pareto(docs, argv[1])
        return 0
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
