"""The docs' tables of simulated ranks (docs/simulate.md) from `bench/simulate_papers.py`'s
JSON lines: `render(paths) -> markdown`. GB = 10^9 bytes, as in docs/explain.md.

- explain's peak over the measured one (the first rank's, torch's MemTracker), at the peak
  and per phase, lowest and highest over every setting, and any outside 3 %.
- PaRO's Table 1 (LLaMA-65B, N = 128 in 16 groups of M = 8): P, G, OS and their sum per
  GPU, simulated beside the paper's formulas in mixed precision (2Ψ, 2Ψ, KΨ with K = 12;
  PaRO §3.1), and the step's peak beside explain's, at the peak and per phase.
- Per-GPU memory against the GPU count, one table per model (Lins' Fig. 10 layout): the
  model states, the step's peak and explain's over it at each N.
- GPT-NeoX-20B on ZeRO-topo's 3-level mesh, and on its 16-GCD setting beside the paper's
  largest models.
- Seconds per simulated rank.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict

GB = 1e9
K = 12
TABLE1 = {   # PaRO Table 1 in mixed precision: (P, G, OS) as functions of (Ψ, N, M)
    "zero1": lambda p, n, m: (2 * p, 2 * p, K * p / n),
    "zero2": lambda p, n, m: (2 * p, 2 * p / n, K * p / n),
    "zero3": lambda p, n, m: (2 * p / n, 2 * p / n, K * p / n),
    "mics": lambda p, n, m: (2 * p / m, 2 * p / m, K * p / m),
    "zeropp": lambda p, n, m: (2 * p / n + 2 * p / m, 2 * p / n, K * p / n),
    "paro_igg": lambda p, n, m: (2 * p / m, 2 * p / n, K * p / n),
    "paro_iig": lambda p, n, m: (2 * p / m, 2 * p / m, K * p / n),
    "paro_nig": lambda p, n, m: (2 * p, 2 * p / m, K * p / n),
}
ORDER = ["ddp", "zero1", "zero2", "zero3", "mics", "hsdp_zero2", "zeropp", "paro_igg", "paro_iig", "paro_nig",
         "lins_7b", "zero_topo"]
TITLES = {"llama_7b": "LLaMA-7B", "llama_13b": "LLaMA-13B", "llama_30b": "LLaMA-30B", "llama_65b": "LLaMA-65B",
          "neox_20b": "GPT-NeoX-20B"}


def load(paths) -> list[dict]:
    """Every file's ranks; a rank in a later file replaces the same rank (model, strategy,
    mesh, rank) in an earlier one: a re-run after a runtime change is given last."""
    out: dict = {}
    for p in paths:
        with open(p) as f:
            for r in (json.loads(line) for line in f if line.strip()):
                out[(r["model"], r["strategy"], r["mesh"], r["rank"])] = r
    return list(out.values())


def _g(b: float) -> str:
    return f"{b / GB:,.2f}"


def _configs(reps):
    """(model, strategy, mesh) -> the ranks' reports."""
    by = defaultdict(list)
    for r in reps:
        by[(r["model"], r["strategy"], r["mesh"])].append(r)
    return by


def _equal(ranks) -> str:
    ok = all(r["memory_equal"] and r["ledger_equal"] for r in ranks)
    return ("yes" if ok else "NO") + f" ({', '.join(str(r['rank']) for r in sorted(ranks, key=lambda r: r['rank']))})"


def _same(ranks, key):
    if key == "peak":                     # measured on the first rank (the others: states and ledger)
        ranks = [r for r in ranks if r["peak"]["measured"] is not None]
    vals = {json.dumps(r[key], sort_keys=True) for r in ranks}
    assert len(vals) == 1, (ranks[0]["strategy"], key, vals)     # every rank holds the same
    return ranks[0][key]


def _ratio(pk) -> str:
    """explain's peak over the measured one, and the phase of each."""
    return f"{pk['explain'] / pk['measured']:.3f}"


def _phases(pk) -> str:
    """explain over measured per phase (forward, backward, step); one outside 3 % in bold."""
    out = []
    for ph in ("forward", "backward", "step"):
        r = pk["explain_phases"][ph] / pk["phases"][ph]
        out.append(f"**{r:.3f}**" if abs(r - 1) > TOLERANCE else f"{r:.3f}")
    return " / ".join(out)


TOLERANCE = 0.03         # shardc/simulate.py PEAK_TOLERANCE, read both ways here


def _secs(ranks) -> str:
    wall = statistics.median(r["wall"] for r in ranks)
    cpu = statistics.median(sum(v["cpu"] for v in r["seconds"].values()) for r in ranks)
    return f"{wall:.0f} ({cpu:.0f})"


def paro_table(by, model="llama_65b", mesh="node(16) > gpu(8)", m=8) -> str:
    rows = ["| strategy | P (+ secondary) | Table 1 P | G | Table 1 G | OS | Table 1 OS | states | Table 1 total "
            "| peak | explain's peak | explain / measured (phase) | forward / backward / step "
            "| states, ledger = explain (ranks) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for name in ORDER:
        ranks = by.get((model, name, mesh))
        if not ranks:
            continue
        mem, pk = _same(ranks, "memory"), _same(ranks, "peak")
        psi, n = ranks[0]["params"], ranks[0]["world"]
        p = mem["params"] + mem["params_secondary"]
        p_txt = _g(p) if not mem["params_secondary"] else f"{_g(mem['params'])} + {_g(mem['params_secondary'])}"
        f = TABLE1.get(name)
        t = f(psi, n, m) if f else None
        cell = (lambda i: _g(t[i])) if t else (lambda i: "—")
        rows.append(f"| {name} | {p_txt} | {cell(0)} | {_g(mem['grads'])} | {cell(1)} | {_g(mem['optim'])} | {cell(2)} "
                    f"| {_g(mem['total'])} | {_g(sum(t)) if t else '—'} | {_g(pk['measured'])} | {_g(pk['explain'])} "
                    f"| {_ratio(pk)} ({pk['explain_phase']}) | {_phases(pk)} | {_equal(ranks)} |")
    return "\n".join(rows)


def per_gpu_table(by, model, meshes) -> str:
    head = "| strategy | " + " | ".join(f"N = {_world(mesh)}: states | peak | explain / measured"
                                         for mesh in meshes) + \
           " | states, ledger = explain (ranks, every N) | s per rank, wall (CPU) |"
    rows = [head, "|---|" + "---:|---:|---:|" * len(meshes) + "---|---:|"]
    for name in ORDER:
        cells, all_ranks = [], []
        for mesh in meshes:
            ranks = by.get((model, name, mesh))
            if not ranks:
                cells.append("— | — | —")
                continue
            all_ranks += ranks
            pk = _same(ranks, "peak")
            cells.append(f"{_g(_same(ranks, 'memory')['total'])} | {_g(pk['measured'])} | {_ratio(pk)}")
        if not all_ranks:
            continue
        ok = all(r["memory_equal"] and r["ledger_equal"] for r in all_ranks)
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if ok else 'NO'} ({len(all_ranks)} ranks) "
                    f"| {_secs(all_ranks)} |")
    return "\n".join(rows)


def neox_table(by, mesh="node(48) > gpu(4) > gcd(2)") -> str:
    rows = ["| strategy | P (+ secondary) | G | OS | states | peak | explain's peak | explain / measured (phase) "
            "| forward / backward / step | states, ledger = explain (ranks) | s per rank, wall (CPU) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for name in ORDER:
        ranks = by.get(("neox_20b", name, mesh))
        if not ranks:
            continue
        mem, pk = _same(ranks, "memory"), _same(ranks, "peak")
        p_txt = _g(mem["params"]) + (f" + {_g(mem['params_secondary'])}" if mem["params_secondary"] else "")
        rows.append(f"| {name} | {p_txt} | {_g(mem['grads'])} | {_g(mem['optim'])} | {_g(mem['total'])} "
                    f"| {_g(pk['measured'])} | {_g(pk['explain'])} | {_ratio(pk)} ({pk['explain_phase']}) "
                    f"| {_phases(pk)} | {_equal(ranks)} | {_secs(ranks)} |")
    return "\n".join(rows)


def topo16_table(by, mesh="node(2) > gpu(4) > gcd(2)") -> str:
    paper = {"zero3": 68e9, "zero_topo": 36e9}
    rows = ["| strategy | states per rank | bytes per parameter | largest model in 64 GiB | ZeRO-topo's figure |",
            "|---|---:|---:|---:|---:|"]
    for name in ("zero3", "zero_topo"):
        ranks = by.get(("neox_20b", name, mesh))
        if not ranks:
            continue
        mem = _same(ranks, "memory")
        per = mem["total"] / ranks[0]["params"]
        rows.append(f"| {name} | {_g(mem['total'])} GB | {per:.3f} | {64 * 2**30 / per / 1e9:.1f} B "
                    f"| ≈{paper[name] / 1e9:.0f} B |")
    return "\n".join(rows)


def _world(mesh: str) -> int:
    import re
    out = 1
    for k in re.findall(r"\((\d+)\)", mesh):
        out *= int(k)
    return out


def summary(reps) -> str:
    """Every measured setting: explain over measured at the peak and per phase, lowest and
    highest, and the settings outside 3 % (none is the goal)."""
    pks = [(r["model"], r["strategy"], r["mesh"], r["peak"]) for r in reps if r["peak"]["measured"] is not None]
    rows = ["| | settings | lowest (setting) | highest (setting) | outside 3 % |", "|---|---:|---|---|---|"]
    name = lambda m, s, mesh: f"{TITLES.get(m, m)} {s} N = {_world(mesh)}"     # noqa: E731
    for what in ("peak", "forward", "backward", "step"):
        val = (lambda pk: pk["explain"] / pk["measured"]) if what == "peak" else \
              (lambda pk, ph=what: pk["explain_phases"][ph] / pk["phases"][ph])
        vs = sorted((val(pk), name(m, s, mesh)) for m, s, mesh, pk in pks)
        out = [f"{n} ({v:.3f})" for v, n in vs if abs(v - 1) > TOLERANCE]
        rows.append(f"| {what} | {len(vs)} | {vs[0][0]:.3f} ({vs[0][1]}) | {vs[-1][0]:.3f} ({vs[-1][1]}) "
                    f"| {', '.join(out) or 'none'} |")
    return "\n".join(rows)


def render(paths) -> str:
    reps = load(paths)
    by = _configs(reps)
    meshes = sorted({r["mesh"] for r in reps if r["model"].startswith("llama")}, key=_world)
    parts = ["### explain's peak against the measured one, every setting below\n", summary(reps),
             "\n### PaRO's Table 1: LLaMA-65B, N = 128 (16 nodes x 8), GB per GPU\n", paro_table(by)]
    for model in ("llama_7b", "llama_13b", "llama_30b", "llama_65b"):
        if any(k[0] == model for k in by):
            parts += [f"\n### {TITLES[model]}: GB per GPU against the GPU count\n", per_gpu_table(by, model, meshes)]
    if any(k[0] == "neox_20b" for k in by):
        parts += ["\n### GPT-NeoX-20B on node(48) > gpu(4) > gcd(2), 384 GCDs: GB per GCD\n", neox_table(by)]
    if any(k[0] == "neox_20b" and k[2] == "node(2) > gpu(4) > gcd(2)" for k in by):
        parts += ["\n### GPT-NeoX-20B on 16 GCDs (node(2) > gpu(4) > gcd(2)): the largest model\n", topo16_table(by)]
    return "\n".join(parts) + "\n"
