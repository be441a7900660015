"""One rank of `cluster_bench.py --collectives` (bench stage: torchrun rank -> timings JSON).

Input: torchrun's environment, `--nodes/--per-node`, message sizes. Output: rank 0
writes `--out`: `{"links": {...}, "rows": [{"op", "algo", "bytes", "time_s", "algbw_MBps"}]}`.

1. Link check: rank 0 sends `--probe` bytes to rank 1 (same node) and to rank
   `per_node` (the next node) with point-to-point gloo send/recv; every node's local
   rank 0 reads its namespace's tx counters around each transfer. The intra transfer
   must run at loopback speed and leave the shaped NICs (v*) idle; the inter one must
   run at about the tc rate and cross v*.
2. all_gather / reduce_scatter over the whole mesh `node > gpu` with shardc's runtime
   collectives (RING = flat gloo ring over all ranks; HIERARCHICAL = per level;
   HO_RING = hierarchical stages pipelined over pieces), median of `--repeat` runs
   after one warm-up, a barrier before each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

from worker import nic_counters, split_counters

ALGOS = ("RING", "HIERARCHICAL", "HO_RING")


def parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "B": 1}
    t = text.strip().upper()
    for u, mult in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * mult)
    return int(t)


def probe(src: int, dst: int, nbytes: int, local_rank: int) -> dict:
    """Time one send src -> dst of nbytes; tx counters of this namespace around it."""
    rank = dist.get_rank()
    buf = torch.zeros(nbytes // 4)
    dist.barrier()
    before = nic_counters() if local_rank == 0 else None
    t0 = time.perf_counter()
    if rank == src:
        dist.send(buf, dst)
        dist.recv(buf[:1], dst)          # ack: the sender's clock sees the whole transfer
    elif rank == dst:
        dist.recv(buf, src)
        dist.send(buf[:1], src)
    dt = time.perf_counter() - t0
    dist.barrier()
    nic = split_counters(before, nic_counters()) if local_rank == 0 else None
    return {"seconds": dt if rank == src else None, "nic": nic}


def links(per_node: int, nbytes: int, local_rank: int) -> dict:
    out = {}
    for name, dst in (("intra", 1), ("inter", per_node)):
        r = probe(0, dst, nbytes, local_rank)
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, r)
        secs = got[0]["seconds"]
        out[name] = {"peer": dst, "bytes": nbytes, "seconds": secs,
                     "MBps": nbytes / secs / 1e6,
                     "nic_tx_by_node": [g["nic"] for g in got if g["nic"] is not None]}
    return out


def time_op(op: str, algo, nbytes: int, sm, repeat: int) -> float:
    from shardc.runtime.eager import collectives as C

    levels = sm.mesh.names
    n = nbytes // 4 // sm.world * sm.world
    full, shard = torch.ones(n), torch.ones(n // sm.world)
    times = []
    for i in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if op == "all_gather":
            C.all_gather(full, shard, sm, levels, algo=algo).wait()
        else:
            C.reduce_scatter(shard, full, sm, levels, algo=algo).wait()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--per-node", type=int, required=True)
    p.add_argument("--sizes", default="64KB,1MB,8MB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--probe", default="16MB")
    p.add_argument("--per-rank-links", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--progress", default=None)
    a = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if a.per_rank_links:
        os.environ["GLOO_SOCKET_IFNAME"] = f"v{local_rank}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from shardc.dsl.ir import Collectives, Level, Mesh
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh(Mesh((Level("node", a.nodes), Level("gpu", a.per_node))))
    doc = {"links": links(a.per_node, parse_size(a.probe), local_rank), "rows": []}
    for size in a.sizes.split(","):
        nbytes = parse_size(size)
        for op in ("all_gather", "reduce_scatter"):
            for algo in ALGOS:
                t = time_op(op, Collectives[algo], nbytes, sm, a.repeat)
                doc["rows"].append({"op": op, "algo": algo, "bytes": nbytes, "time_s": t,
                                    "algbw_MBps": nbytes / t / 1e6})
                if dist.get_rank() == 0 and a.progress:
                    with open(a.progress, "a") as f:
                        f.write(f"{op} {algo} {size}: {t * 1e3:.1f} ms\n")
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
