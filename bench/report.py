"""Per-system summaries (bench stage: rank 0's worker JSON -> the `systems` entry).

Input: the JSON a worker's rank 0 wrote, the cluster shape, the model name. Output:
`{"step_time_s", "tokens_per_s", "model_state_bytes", "peak_model_state_bytes",
"level_bytes", "measured_bytes", "tp", "ep", "a2a_bytes", "losses", ...}`; with `--rounds`,
one such summary per round merged into one (`merge_rounds`, [Note: rounds]).
`model_state_bytes`: params + grads + optimizer states held after `opt.step()` (max over
ranks); `peak_...`: the most held at any point of the step, measured in the warm-up
(FSDP2's unsharded gradients between micro-batches when gradient sync is off count here).
`peak_rss_bytes`: the largest peak resident set of any rank's process, compile state
included; `warmup_times`: rank 0's untimed steps, where a compiled system compiles
([Note: memory figures] in worker.py; with `--rounds`, `round_warmup_s` per round).

[Note: level bytes]
`level_bytes[level]` = bytes one rank sends over that level's links per optimizer step,
averaged over ranks (shardc.analysis.costmodel.links' definition; `node` = the
shaped inter-node NICs, `gpu` = loopback inside a node). For shardc it comes from the
runtime's measured ledger (counts divided by the timed steps) and the strategy's
collective algorithm; for the peers from bench/peers/ledgers.py's formulas, as gloo rings.
`measured_bytes` is the same quantity read from the namespaces' NIC counters
(tx bytes of every node's v* summed, resp. of lo, / steps / world): on-the-wire, so
it includes TCP/IP headers, the rendezvous store and barriers, and it shows what gloo
really does (its reduce_scatter_tensor is an all-reduce followed by a slice, so it
moves twice the ring bytes).
"""
from __future__ import annotations

import statistics

from shardc.analysis.costmodel import link_bytes
from shardc.dsl.ir import Collectives, Level, Mesh
from shardc.lowering import Over

from models import build_model
from peers.ledgers import Rec, fsdp2_ep_ledger, peer_ledger


def cluster_mesh(nodes: int, per_node: int) -> Mesh:
    return Mesh((Level("node", nodes), Level("gpu", per_node)))


def _mesh(levels) -> Mesh | None:
    return None if levels is None else Mesh(tuple(Level(n, s) for n, s in levels))


def level_bytes(system: str, res: dict, model_name: str, nodes: int, per_node: int,
                accumulate: int) -> dict[str, float]:
    # an expert group's records are over the experts' mesh (`expert_mesh`: the ranks EP leaves)
    if res.get("ledger") is not None:
        steps = res["ledger_steps"]
        recs = [Rec(r["phase"], r["op"], tuple(r["levels"]), r["bytes"], r["count"] / steps,
                    over=r.get("over", "experts" if r.get("experts") else "dense")) for r in res["ledger"]]
        return link_bytes(recs, _mesh(res["mesh"]), Collectives(res["collectives"]),
                          meshes={Over.EXPERTS: _mesh(res.get("expert_mesh"))})
    if res.get("ep", 1) > 1:       # fsdp2+epN: dense and expert units (peers.py)
        recs = fsdp2_ep_ledger(res["unit_numels"], res["expert_numels"], accumulate)
        return link_bytes(recs, _mesh(res["mesh"]), Collectives.RING, meshes={Over.EXPERTS: _mesh(res["expert_mesh"])})
    if res.get("tp", 1) > 1:       # the dp mesh and the TP-local unit sizes (peers.py)
        mesh = Mesh(tuple(Level(n, s) for n, s in res["mesh"]))
        recs = peer_ledger(system, None, mesh.levels[-1].size, accumulate, sizes=res["unit_numels"])
        return link_bytes(recs, mesh, Collectives.RING)
    recs = peer_ledger(system, build_model(model_name), per_node, accumulate)
    return link_bytes(recs, cluster_mesh(nodes, per_node), Collectives.RING)


def measured_bytes(res: dict, world: int) -> dict[str, float] | None:
    nics = [r["nic"] for r in res.get("per_rank", []) if r.get("nic")]
    if not nics:
        return None
    steps = res["ledger_steps"]
    return {"node": sum(n["inter"] for n in nics) / steps / world,
            "gpu": sum(n["intra"] for n in nics) / steps / world}


def summarize(system: str, res: dict, model_name: str, nodes: int, per_node: int,
              accumulate: int) -> dict:
    world = nodes * per_node
    out = {
        "step_time_s": res["step_time_s"],
        "tokens_per_s": res["tokens_per_step"] / res["step_time_s"],
        "model_state_bytes": max(r["state_bytes"] for r in res["per_rank"]),
        "peak_model_state_bytes": max(r["peak_state_bytes"] for r in res["per_rank"]),
        # the process's peak resident set, max over ranks ([Note: memory figures] in worker.py)
        "peak_rss_bytes": max((r.get("peak_rss_bytes") or 0 for r in res["per_rank"]), default=0) or None,
        "level_bytes": level_bytes(system, res, model_name, nodes, per_node, accumulate),
        "measured_bytes": measured_bytes(res, world),
        "step_times": res["step_times"],
        "warmup_times": res.get("warmup_times"),   # rank 0: the untimed steps (a compiled system compiles here)
        "splits": res.get("splits"),          # rank 0: per step, each micro-batch, opt.step(), the rest
        "params": res["params"],
        "tp": res.get("tp", 1),
        "ep": res.get("ep", 1),
        # token all-to-all bytes per rank per step, forward only ([Note: token all-to-all
        # bytes] in worker.py): the mean and the largest over ranks
        "a2a_bytes": statistics.mean(r.get("a2a_bytes") or 0 for r in res["per_rank"]),
        "a2a_bytes_max": max(r.get("a2a_bytes") or 0 for r in res["per_rank"]),
        "losses": res.get("losses"),           # rank 0's mean loss per step, warm-up included
    }
    if res.get("ledger") is not None:
        out["ledger"] = res["ledger"]
        out["collectives"] = res["collectives"]
    if res.get("backend"):
        out["backend"] = res["backend"]
    return out


# [Note: rounds]
# `cluster_bench.py --rounds R` runs the system list R times, one system after the other
# in each round, so that the machine's drift over the minutes of a run (its compute rate
# moves by several per cent) falls on every system alike instead of on whichever ran
# last. A system's rounds merge into one summary: every timed step of every round in
# `step_times` and `splits`, the median over all of them as `step_time_s`, each round's
# median in `round_step_s`; the byte counts are the first round's (the ledger is the
# same every round; the NIC counters differ by a few packets of TCP). A round that
# failed makes the system failed, with that round's error.
def merge_rounds(rounds: list[dict]) -> dict:
    """One system's per-round summaries (`summarize`'s, or `{"error": ...}`) -> one."""
    failed = next((r for r in rounds if "error" in r), None)
    if failed is not None or len(rounds) == 1:
        return failed or rounds[0]
    out = dict(rounds[0])
    times = [t for r in rounds for t in r["step_times"]]
    out["step_times"] = times
    out["splits"] = None if any(r.get("splits") is None for r in rounds) else [s for r in rounds for s in r["splits"]]
    out["step_time_s"] = statistics.median(times)
    if "tokens_per_s" in out:
        out["tokens_per_s"] = rounds[0]["tokens_per_s"] * rounds[0]["step_time_s"] / out["step_time_s"]
    out["round_step_s"] = [r["step_time_s"] for r in rounds]
    out["round_warmup_s"] = [r.get("warmup_times") for r in rounds]
    rss = [r.get("peak_rss_bytes") for r in rounds]
    out["peak_rss_bytes"] = None if None in rss else max(rss)
    return out
