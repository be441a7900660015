"""Where a rank's start-up memory goes, per phase (bench stage: one system's start-up of
bench/bigmodel.py's Llama on 8 gloo ranks -> each rank's VmRSS, VmHWM, RssAnon and RssFile
at the start-up's phases; information only, issue 47).

    flock /work/locks/big.lock torchrun --nproc-per-node 8 bench/startup_rss.py shardc 16 [STRATEGY]
    flock /work/locks/big.lock torchrun --nproc-per-node 8 bench/startup_rss.py fsdp2 16

Input: the system (`shardc`: bench/bigmodel_startup.py's `start_shardc("init", ...)` under
STRATEGY, default bench/llama_zero3_units.shard; `fsdp2`: `start_fsdp2("init", ...)`, a
`fully_shard` per unit), the depth (16: the 836M model). Output, printed by rank 0: ranks 0
and 1's /proc/self/status figures (MiB) at each marked point — for shardc the plan's
hand-off (`job_plan`, rank 0's capture), the emitted module's load, the storages' build
(`_units`), the values (`_values`, and inside it init_pieces.py's `drain` and `_draw`),
the buffers' broadcast —, every rank's VmHWM, RssAnon and RssFile once values are ready,
and with `--files` rank 1's resident KiB per mapped file (a JSON beside the printout,
`startup_rss_SYSTEM_files.json` in the working directory) to diff between systems: RssFile
is shared code, the same pages in every process. glibc's allocator settings
(MALLOC_MMAP_THRESHOLD_, ...) come from the environment, the same for both systems.
"""
from __future__ import annotations

import gc
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LOG: list = []


def status() -> dict[str, int]:
    """bigmodel.py's `proc_status` in MiB."""
    from bigmodel import proc_status
    return {k: v >> 20 for k, v in proc_status().items()}


def mark(what: str) -> None:
    LOG.append((what, status()))


def _wrap(owner, name: str) -> None:
    fn = getattr(owner, name)

    def wrapped(*a, **k):
        mark("> " + name)
        try:
            return fn(*a, **k)
        finally:
            mark("< " + name)
    setattr(owner, name, wrapped)


def instrument() -> None:
    import shardc.api as api
    import shardc.runtime.build as build
    import shardc.runtime.state.init_first as first
    import shardc.runtime.state.init_pieces as pieces
    _wrap(api, "job_plan")
    _wrap(api, "load_emitted")
    _wrap(build, "_units")
    _wrap(build, "_values")
    _wrap(first, "broadcast")
    _wrap(pieces.Pieces, "_draw")
    _wrap(pieces.Pieces, "drain")


def mapped_files() -> dict[str, int]:
    """Resident KiB per mapped file (/proc/self/smaps)."""
    out, cur = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:
                cur = parts[5] if len(parts) > 5 else None
            elif parts and parts[0] == "Rss:" and cur and cur.startswith("/"):
                out[cur] = out.get(cur, 0) + int(parts[1])
    return out


def main() -> None:
    import torch.distributed as dist
    from transformers import LlamaForCausalLM  # noqa: F401  (imported before the baseline, as bigmodel.py)

    import bigmodel
    import shardc  # noqa: F401
    from bigmodel_startup import start_fsdp2, start_shardc
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    system, layers = args[0], int(args[1])
    strategy = args[2] if len(args) > 2 else os.path.join(HERE, "llama_zero3_units.shard")
    instrument()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = bigmodel.batch(rank)
    gc.collect()
    dist.barrier()
    mark("imported")
    if system == "shardc":
        start_shardc("init", layers, "/tmp", x, {}, None, strategy)
    else:
        start_fsdp2("init", layers, "/tmp", {}, "units")
    dist.barrier()
    mark("ready")
    if "--files" in sys.argv and rank == 1:
        with open(f"startup_rss_{system}_files.json", "w") as f:
            json.dump(mapped_files(), f)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, LOG)
    if rank == 0:
        for r in (0, 1):
            print(f"--- rank {r} (MiB)")
            for what, s in every[r]:
                print(f"{what:18s} " + " ".join(f"{k} {s[k]:6d}" for k in s))
        for k in ("VmHWM", "RssAnon", "RssFile"):
            print(f"{k} at ready per rank:", [log[-1][1][k] for log in every])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
