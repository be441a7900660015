"""One rank of a benchmark run (bench stage: torchrun rank -> timings JSON).

Input: torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and the
flags below. Output: rank 0 writes `--out` (JSON: step times, its mean loss per step, state
bytes, ledger, NIC byte counters) and appends one line per finished step to `--progress`.

[Note: what one step is]
`accumulate` micro-batches (forward, loss / accumulate, backward) then `opt.step()`
and `opt.zero_grad()`. A barrier before and after brackets the step so rank 0's
wall time is the slowest rank's. The first `--warmup` steps are not timed. Rank r reads
batch r (a `+tp` system: r // tp, so a tp group reads one batch).

[Note: byte counters]
Local rank 0 of every node reads /proc/net/dev of its namespace before and after the
timed steps: tx bytes on v* (what left the node over its shaped NIC(s)) and on lo
(rank-to-rank traffic inside the node). These are measured on the wire, TCP/IP
headers included, to check bench/peers/ledgers.py's formulas and shardc's ledger.

[Note: memory figures]
Two kinds, per rank: `state_bytes` / `peak_state_bytes` count the model states the system
holds (params + grads + optimizer states, and FSDP2's unsharded gradients between
micro-batches), read from the tensors after each backward and after `opt.step()` — not
activations, not the allocator's view. `peak_rss_bytes` is the process's peak resident
set (`getrusage(RUSAGE_SELF).ru_maxrss`, read after the timed steps): everything the rank
ever held, torch and Python included, activations, gloo's buffers, and for the compiled
systems dynamo/Inductor's compile state (the compile runs in the warm-up step; Inductor's
compile workers are child processes and not counted). On this CPU both are host memory.

[Note: token all-to-all bytes]
`a2a_bytes`: the token bytes this rank sends into the experts' all-to-alls per timed step
(bench/peers/ep_systems.py `a2a_bytes`: the dispatch's and the combine's inputs, forward only,
this rank's own rows included), counted by examples/moe.py's ExpertParallel; 0 without EP.
They are not in shardc's ledger (the model's collectives, not the strategy's), and on the
wire they show up in the NIC counters.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from peers.ep_systems import a2a_bytes, reset_a2a
from models import batch, build_model, n_params
from peers.systems import build_system


def nic_counters() -> dict[str, int]:
    """tx bytes per interface of this network namespace."""
    out = {}
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            out[name.strip()] = int(data.split()[8])
    return out


def split_counters(before: dict, after: dict) -> dict[str, int]:
    d = {k: after[k] - before.get(k, 0) for k in after}
    return {"inter": sum(v for k, v in d.items() if re.fullmatch(r"v\d+", k)),
            "intra": d.get("lo", 0)}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True)
    p.add_argument("--model", default="bench")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--per-node", type=int, required=True)
    p.add_argument("--accumulate", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--per-rank-links", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--progress", default=None)
    p.add_argument("--profile", default=None,
                   help="rank 0 runs torch.profiler over the timed steps; table written here")
    return p.parse_args()


def run_step(sys_, model, step: int, args, rank: int, peak: bool = False) -> float:
    """One optimizer step; with `peak`, also the model-state bytes after every backward."""
    dist.barrier()
    t0 = time.perf_counter()
    marks = []      # seconds since t0 at the end of each micro-batch, of opt.step(), of the step
    losses = []
    for i in range(args.accumulate):
        x, y = batch(model, step, i, rank // sys_.tp, args.micro_batch)   # a tp group: one batch
        with sys_.micro(i, i == args.accumulate - 1):
            logits = sys_.model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            if sys_.backward is not None:     # DeepSpeed: engine.backward + engine.step
                sys_.backward(loss / args.accumulate)
            else:
                (loss / args.accumulate).backward()
        losses.append(loss.detach())
        marks.append(time.perf_counter() - t0)
        if peak:
            held = sys_.memory() + (sys_.pending() if sys_.pending else 0)
            sys_.extra["peak_state_bytes"] = max(held, sys_.extra.get("peak_state_bytes", 0))
    sys_.opt.step()
    marks.append(time.perf_counter() - t0)
    sys_.extra["state_bytes"] = sys_.memory()       # grads still held: the step's states
    if peak:
        sys_.extra["peak_state_bytes"] = max(sys_.extra["state_bytes"], sys_.extra["peak_state_bytes"])
    sys_.opt.zero_grad()
    dist.barrier()
    marks.append(time.perf_counter() - t0)
    sys_.extra["marks"] = marks
    sys_.extra["loss"] = float(sum(losses)) / len(losses)      # this rank's mean, after the timing
    return marks[-1]


def main() -> int:
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.per_rank_links:       # each rank binds gloo to its own shaped NIC
        os.environ["GLOO_SOCKET_IFNAME"] = f"v{local_rank}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"system": args.system}
    try:
        result.update(run_system(args, rank, local_rank))
    except Exception as e:     # reported per system; the harness goes on with the others
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        print(f"[rank {rank}] {result['traceback']}", file=sys.stderr, flush=True)
        _write(args.out, rank, result)
        os._exit(1)         # peers may be blocked in a collective; do not wait for them
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        merged = dict(gathered[0])
        merged["per_rank"] = [{k: g.get(k) for k in ("state_bytes", "peak_state_bytes", "peak_rss_bytes", "nic",
                                                     "a2a_bytes")}
                              for g in gathered]
        _write(args.out, rank, merged)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_system(args, rank: int, local_rank: int) -> dict:
    """Build `args.system` on the initialised process group and measure it (this rank's part)."""
    model = build_model(args.model)
    example = batch(model, 0, 0, 0, args.micro_batch)[0]
    import peers.systems as _systems
    _systems.MICRO_BATCH["value"] = args.micro_batch
    sys_ = build_system(args.system, model, args.nodes, args.per_node, example, args.accumulate)
    out = measure(sys_, model, args, rank, local_rank)
    out["params"] = n_params(build_model(args.model))
    # a tp group of sys_.tp ranks reads one batch ([Note: +tp systems] in systems.py)
    out["tokens_per_step"] = dist.get_world_size() // sys_.tp * args.accumulate * args.micro_batch * example.size(1)
    return out


def _write(out: str, rank: int, result: dict) -> None:
    path = out if rank == 0 else f"{out}.rank{rank}"
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def measure(sys_, model, args, rank: int, local_rank: int) -> dict:
    times, splits, losses, warmup_times = [], [], [], []
    for step in range(args.warmup):       # peak states are measured here too; compiled systems compile here
        warmup_times.append(run_step(sys_, model, step, args, rank, peak=True))
        losses.append(sys_.extra["loss"])
        _progress(args, rank, f"warmup {step + 1}/{args.warmup}")
    if sys_.reset_ledger:
        sys_.reset_ledger()
    reset_a2a(model)
    before = nic_counters() if local_rank == 0 else None
    prof = _profiler(args, rank)
    for step in range(args.warmup, args.warmup + args.steps):
        # the first timed step measures peaks too (optimizer state exists only after a step)
        times.append(run_step(sys_, model, step, args, rank, peak=step == args.warmup))
        m = sys_.extra["marks"]
        losses.append(sys_.extra["loss"])
        splits.append([b - a for a, b in zip([0.0] + m[:-1], m)])
        _progress(args, rank, f"step {step - args.warmup + 1}/{args.steps} {times[-1]:.3f}s")
    nic = split_counters(before, nic_counters()) if local_rank == 0 else None
    if prof is not None:
        prof.__exit__(None, None, None)
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    ledger = None
    if sys_.ledger:
        ledger = [dict(phase=r.phase, op=r.op, levels=list(r.levels), bytes=r.bytes,
                       count=r.count, over=r.over) for r in sys_.ledger()]
    keys = ("mesh", "collectives", "tp", "unit_numels", "backend", "ep", "expert_mesh", "expert_numels",
            "ds_config", "deepspeed", "memory_note")         # the last three: DeepSpeed systems
    return {**{k: sys_.extra[k] for k in keys if k in sys_.extra},
            "losses": losses, "step_times": times, "step_time_s": statistics.median(times),
            # per timed step, seconds of: each micro-batch (forward + backward), opt.step(),
            # zero_grad + the closing barrier
            "splits": splits,
            "warmup_times": warmup_times,
            "state_bytes": sys_.extra["state_bytes"],
            "peak_state_bytes": sys_.extra["peak_state_bytes"],
            # [Note: memory figures]; Linux reports ru_maxrss in KiB
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "nic": nic, "ledger": ledger,
            "a2a_bytes": a2a_bytes(model) / args.steps,       # [Note: token all-to-all bytes]
            "ledger_steps": args.steps}


def _profiler(args, rank: int):
    if rank != 0 or not args.profile:
        return None
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU])
    prof.__enter__()
    return prof


def _progress(args, rank: int, msg: str) -> None:
    if rank == 0 and args.progress:
        with open(args.progress, "a") as f:
            f.write(msg + "\n")


if __name__ == "__main__":
    sys.exit(main())
