"""`cluster_bench.py --bandwidth-profile OUT.json` driver side (bench stage: flags -> profile JSON).

Input: an entered EmulatedCluster and the parsed flags. Output: the `shardc profile`
JSON (shardc/cli/cmd_profile.py) measured inside the cluster with every rank of the
training runs at once: collectives per level set, op, algorithm and size over the mesh
`node(NODES) > gpu(PER_NODE)`, and (`--model`) the model's forward+backward on one
micro-batch of `--micro-batch` sequences, so that `shardc explain --bandwidth OUT.json`
predicts the systems' step times under the same contention (bench/predict.py).
"""
from __future__ import annotations

import json
import os

from launch import ROOT, run_job
from models import PRESETS

PROFILE = os.path.join(ROOT, "shardc", "cli", "cmd_profile.py")


def model_flags(a) -> list[str]:
    """`--model/--tokens/--seq` of one training micro-batch of the `bench` preset (sequences of
    its context length); another model is profiled without its compute rate."""
    if a.model != "bench":
        return []
    seq = PRESETS["bench"]["block_size"]
    return ["--model", "bench/models.py:bench", "--tokens", str(a.micro_batch * seq), "--seq", str(seq)]


def run_profile(cluster, a, logdir: str, console) -> dict:
    flags = ["-o", a.bandwidth_profile, "--mesh", f"node({a.nodes}) > gpu({a.per_node})",
             "--sizes", *a.profile_sizes.split(","), "--iters", str(a.steps), "--warmup", str(a.warmup),
             "--sweeps", str(a.rounds),
             "--comm", *a.profile_comm.split(","), "--device", "cpu", *model_flags(a)]
    console.print(f"shardc profile {' '.join(flags)}")
    job = run_job(cluster, PROFILE, flags, logdir, "profile", port=29398, timeout=a.timeout)
    if not job.ok or not os.path.exists(a.bandwidth_profile):
        return {"error": "timed out" if job.timed_out else f"exit codes {list(job.returncodes)}",
                "log_tail": job.tail()}
    with open(a.bandwidth_profile) as f:
        doc = json.load(f)
    c = doc.get("compute") or {}
    console.print(f"{len(doc['entries'])} collectives timed; compute {c.get('flops_per_s', 0) / 1e9:.2f} "
                  f"GFLOP/s per rank ({c.get('seconds', 0):.3f} s per micro-batch)")
    return {"profile": a.bandwidth_profile, "entries": len(doc["entries"]), "compute": c}
