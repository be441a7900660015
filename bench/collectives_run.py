"""`cluster_bench.py --collectives` driver side (bench stage: flags -> collectives rows).

Input: an entered EmulatedCluster and the parsed flags. Output: the worker's
`{"links", "rows"}` document (bench/collectives_worker.py), after printing the link
check and a table of flat vs hierarchical vs HO-Ring times per size.
"""
from __future__ import annotations

import json
import os

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from collectives_worker import ALGOS
from launch import progress_poller, run_job

HERE = os.path.dirname(os.path.abspath(__file__))


def run_collectives(cluster, a, logdir: str, console) -> dict:
    out, prog = os.path.join(logdir, "collectives.json"), os.path.join(logdir, "collectives.progress")
    flags = ["--nodes", str(a.nodes), "--per-node", str(a.per_node), "--sizes", a.sizes,
             "--out", out, "--progress", prog]
    if a.per_rank_links:
        flags.append("--per-rank-links")
    total = len(a.sizes.split(",")) * 2 * len(ALGOS)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("collectives: starting", total=total)

        job = run_job(cluster, os.path.join(HERE, "collectives_worker.py"), flags, logdir,
                      "collectives", port=29399, timeout=a.timeout,
                      poll=progress_poller(progress, task, prog, "collectives"))
    if not job.ok or not os.path.exists(out):
        return {"error": "timed out" if job.timed_out else f"exit codes {list(job.returncodes)}",
                "log_tail": job.tail()}
    with open(out) as f:
        doc = json.load(f)
    show(doc, console)
    return doc


def show(doc: dict, console) -> None:
    for name, l in doc["links"].items():
        console.print(f"{name}-node probe to rank {l['peer']}: {l['MBps']:.0f} MB/s; "
                      f"tx per node (shaped NICs, lo): "
                      + ", ".join(f"({n['inter'] / 1e6:.1f} MB, {n['intra'] / 1e6:.1f} MB)"
                                  for n in l["nic_tx_by_node"]))
    t = Table(title="time per collective over the whole cluster (ms)")
    t.add_column("op")
    t.add_column("bytes", justify="right")
    for algo in ALGOS:
        t.add_column(algo.lower(), justify="right")
    rows = {(r["op"], r["bytes"], r["algo"]): r["time_s"] for r in doc["rows"]}
    for op, nbytes in dict.fromkeys((r["op"], r["bytes"]) for r in doc["rows"]):
        t.add_row(op, f"{nbytes:,d}", *(f"{rows[(op, nbytes, a)] * 1e3:.1f}" for a in ALGOS))
    console.print(t)
