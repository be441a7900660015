"""Predicted vs measured step time (bench stage: profile JSON + systems JSON -> one table).

    python bench/predict.py PROFILE.json SYSTEMS.json [SYSTEMS.json ...] [--profile MORE.json ...]
                            [--md OUT.md] [--json OUT.json]

Input: a `shardc profile` JSON measured on the cluster (`cluster_bench.py
--bandwidth-profile`) and a `cluster_bench.py` systems JSON from the same cluster.
Output: per shardc system (`shardc:NAME[@ALGO]`) the step time `shardc explain`
predicts for `examples/strategies/NAME.shard` on the cluster's mesh
`node(NODES) > gpu(PER_NODE)`, with the run's accumulation, micro-batch shape, AdamW,
the collective algorithm the run used (the system's `collectives`) and the profile
(`--bandwidth`: its collectives, its measured compute rate; with `--profile`, several
profiles of the cluster merged, the median of each entry) — beside the measured
step time (several systems JSON of the same cluster and run settings pool their steps,
as rounds do: `pool`): ratio predicted/measured, whether it is within `--tolerance`, and the rank
of each among the systems by predicted and by measured time, and whether the measured
order of the top three is resolved by the steps (`order_p`). The peers (FSDP2, DDP)
are not shardc strategies and are left out; a shardc system whose runs failed is named
under the table ("Left out"), and a failed run among pooled ones is dropped, with a
line. Exit code 0 even when a row misses: the table is the result.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from math import sqrt
from statistics import NormalDist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def explain_argv(system: str, run: dict, config: dict, profiles: list[str]) -> list[str]:
    """The `shardc explain` command line that predicts `system` as it ran."""
    name = system.split(":", 1)[1].split("@")[0]
    seq = PRESETS[config["model"]]["block_size"]
    return ["explain", os.path.join(ROOT, "examples", "strategies", f"{name}.shard"),
            "--model", os.path.join(ROOT, "bench", "models.py") + ":bench",
            "--mesh", f"node({config['nodes']}) > gpu({config['per_node']})",
            "--micro-batches", str(config["accumulate"]), "--collectives", run["collectives"],
            "--tokens", str(config["micro_batch"] * seq), "--seq", str(seq),
            *(a for f in profiles for a in ("--bandwidth", f)), "--json"]


def predict(system: str, run: dict, config: dict, profiles: list[str]) -> dict:
    from shardc.cli import main as shardc_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = shardc_main(explain_argv(system, run, config, profiles))
    if code != 0:
        raise SystemExit(f"error: shardc explain failed for {system} (exit {code})")
    return json.loads(out.getvalue())["time"]


def ranks(values: dict) -> dict:
    """1 = fastest."""
    return {k: i + 1 for i, k in enumerate(sorted(values, key=values.get))}


def table(profiles: str | list[str], systems_doc: dict, tolerance: float = 0.15) -> list[dict]:
    """One row per shardc system of `systems_doc`, predicted with `profiles` (one path, or
    several merged)."""
    profiles = [profiles] if isinstance(profiles, str) else list(profiles)
    cfg = systems_doc["config"]
    if cfg["model"] != "bench":
        raise SystemExit(f"error: predict.py knows the `bench` model only, the run used {cfg['model']!r}")
    runs = {k: v for k, v in systems_doc["systems"].items() if k.startswith("shardc:") and "error" not in v}
    rows = {k: {"system": k, "collectives": v["collectives"], "measured_s": v["step_time_s"],
                "step_times": v["step_times"], "time": predict(k, v, cfg, profiles)} for k, v in runs.items()}
    for r in rows.values():
        r["predicted_s"] = r["time"]["total"]
        r["ratio"] = r["predicted_s"] / r["measured_s"]
        r["within"] = abs(r["ratio"] - 1) <= tolerance
    pr = ranks({k: r["predicted_s"] for k, r in rows.items()})
    mr = ranks({k: r["measured_s"] for k, r in rows.items()})
    for k, r in rows.items():
        r["predicted_rank"], r["measured_rank"] = pr[k], mr[k]
    return sorted(rows.values(), key=lambda r: r["measured_rank"])


def top_order_matches(rows: list[dict], n: int = 3) -> bool:
    """The n fastest by prediction, in order, are the n fastest measured, in order."""
    by_pred = [r["system"] for r in sorted(rows, key=lambda r: r["predicted_rank"])][:n]
    by_meas = [r["system"] for r in sorted(rows, key=lambda r: r["measured_rank"])][:n]
    return by_pred == by_meas


def order_p(faster: list[float], slower: list[float]) -> float:
    """One-sided p-value that `faster`'s steps are not shorter than `slower`'s: the
    Mann–Whitney U test in its normal approximation (steps are continuous, so no tie
    correction). Small = the measured order is resolved."""
    n1, n2 = len(faster), len(slower)
    u = sum((x < y) + 0.5 * (x == y) for x in faster for y in slower)
    z = (u - n1 * n2 / 2) / sqrt(n1 * n2 * (n1 + n2 + 1) / 12)
    return 1 - NormalDist().cdf(z)


def measured_order(rows: list[dict], n: int = 3, alpha: float = 0.05) -> tuple[bool, str]:
    """(every adjacent pair of the n fastest measured is resolved at `alpha`, one line)."""
    top = sorted(rows, key=lambda r: r["measured_rank"])[:n]
    parts, ok = [], True
    for a, b in zip(top, top[1:]):
        p = order_p(a["step_times"], b["step_times"])
        ok &= p < alpha
        parts.append(f"{a['system'].split(':', 1)[1]} < {b['system'].split(':', 1)[1]} "
                     f"p = {p:.3g}{'' if p < alpha else ' (not resolved)'}")
    return ok, "; ".join(parts)


def markdown(rows: list[dict], tolerance: float, missing: list[str] = ()) -> str:
    lines = ["| strategy | collectives | predicted (s) | compute (s) | measured (s) | predicted / measured "
             f"| within {tolerance:.0%} | rank predicted | rank measured |", "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system'].split(':', 1)[1]} | {r['collectives']} | {r['predicted_s']:.2f} "
                     f"| {r['time']['compute']:.2f} | {r['measured_s']:.2f} | {r['ratio']:.2f} "
                     f"| {'yes' if r['within'] else 'no'} | {r['predicted_rank']} | {r['measured_rank']} |")
    n_in = sum(r["within"] for r in rows)
    lines.append("")
    lines.append(f"{n_in} of {len(rows)} within {tolerance:.0%}; order of the top three "
                 f"{'equal' if top_order_matches(rows) else 'NOT equal'} (predicted vs measured).")
    resolved, pairs = measured_order(rows)
    steps = sorted({len(r["step_times"]) for r in rows})
    lines.append(f"Measured order of the top three {'resolved' if resolved else 'NOT resolved'} at 5 % "
                 f"(one-sided Mann-Whitney U over {'/'.join(map(str, steps))} steps each): {pairs}.")
    lines += [f"Left out: {m}." for m in missing]
    return "\n".join(lines)


# the settings every pooled systems JSON must share (a step of each is the same step)
SAME = ("nodes", "per_node", "inter_rate", "per_rank_links", "model", "accumulate", "micro_batch")


def pool(docs: list[dict]) -> dict:
    """Several systems JSON of one cluster -> one: each system's runs merged as rounds
    (bench/report.py `merge_rounds`, [Note: rounds]); a setting that differs is an error."""
    from report import merge_rounds

    first = docs[0]["config"]
    for d in docs[1:]:
        diff = [k for k in SAME if d["config"].get(k) != first.get(k)]
        if diff:
            raise SystemExit(f"error: the systems JSON differ in {', '.join(diff)}; pool runs of one setting only")
    runs: dict = {}
    for d in docs:
        for name, r in d["systems"].items():
            runs.setdefault(name, []).append(r)
    systems, failed = {}, []
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        systems[name] = merge_rounds(ok) if ok else rs[0]
        if ok and len(ok) < len(rs):
            failed.append(f"{name}: {len(rs) - len(ok)} of its {len(rs)} runs failed "
                          f"({next(r['error'] for r in rs if 'error' in r)}); its other runs are pooled")
    return {"config": first, "systems": systems, "failed_runs": failed}


def left_out(doc: dict) -> list[str]:
    """One line per shardc system not in the table (every run failed) or pooled without a
    failed run, so that a table never drops a system silently."""
    lines = [f"{n}: not predicted, its run failed ({v['error']})"
             for n, v in doc["systems"].items() if n.startswith("shardc:") and "error" in v]
    return lines + list(doc.get("failed_runs", ()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile", help="shardc profile JSON (cluster_bench.py --bandwidth-profile)")
    p.add_argument("systems", nargs="+", help="cluster_bench.py systems JSON (several: their steps are pooled)")
    p.add_argument("--profile", dest="profile_more", action="append", default=[], metavar="MORE.json",
                   help="a further profile of the same cluster, merged with the first (median of each entry)")
    p.add_argument("--tolerance", type=float, default=0.15, help="relative error counted as a match (0.15)")
    p.add_argument("--md", help="also write the markdown table here")
    p.add_argument("--json", dest="json_out", help="also write the rows as JSON here")
    a = p.parse_args(argv)
    docs = []
    for path in a.systems:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            return 1
    doc = pool(docs)
    rows = table([a.profile, *a.profile_more], doc, a.tolerance)
    md = markdown(rows, a.tolerance, left_out(doc))
    print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
