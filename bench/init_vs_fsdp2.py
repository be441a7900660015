"""shardc's exact init against FSDP2's init on 8 gloo ranks of one machine, without the big
model (bench stage: a narrow Hugging Face Llama -> each system's start-up wall and CPU
seconds, shardc's phases and where its values phase goes, printed and written as JSON).

    OMP_NUM_THREADS=1 python bench/init_vs_fsdp2.py --layers 4 --hidden 1024 --rounds 3 --json OUT.json

Input: the depth and width of a `LlamaForCausalLM` (vocab 32000, 16 heads, 4 KV heads,
intermediate 11/4 of the width, untied head, fp32) built on the meta device on every rank.
Each round runs both systems in turn on the same 8 ranks (tests/harness.py's pool: one
process per rank, forked from a server that imported torch and shardc once, so the memory
of 8 imports is shared and the run stays far below bench/bigmodel.py's; rounds after the
first run in warm processes, the first includes each process's first `torch.export`):
- `shardc`: `shardc.compile(model, bench/llama_zero3_units.shard, mesh "node(2) > gpu(4)",
  init=model._init_weights)` after `torch.manual_seed` (capture and lowering on rank 0, the
  exact init: runtime/state/init_first.py);
- `fsdp2`: `fully_shard` of the embedding, every decoder layer, the head and the root on a
  1-D mesh of 8, `to_empty`, `model.apply(model._init_weights)` (its own, non-exact values).
Output: per round and system, the wall seconds from a barrier before to a barrier after
(the slowest rank), the CPU seconds of every rank (`time.process_time`), the parameter
norm (float64 over every rank's pieces), shardc's `startup_seconds` on rank 0 and the wall
seconds inside its values phase on ranks 0 and 5 (the first rank's loop, the sends, the
walk of its segment, the all-gather, the draws, the buffers); the medians per system.
bench/bigmodel.py measures the 836 M model the same way in fresh processes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
STRATEGY = os.path.join(ROOT, "bench", "llama_zero3_units.shard")


def build(layers: int, hidden: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      vocab_size=32000, num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
                      use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def _timed(clock: dict, obj, name: str) -> None:
    """obj.name summing its wall seconds into clock[name] (this worker only)."""
    f = getattr(obj, name)
    f = getattr(f, "_bench_orig", f)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - t
    g._bench_orig = f
    setattr(obj, name, g)


def job(rank: int, world: int, system: str, layers: int, hidden: int) -> dict:
    import torch
    import torch.distributed as dist
    model = build(layers, hidden)
    clock: dict = {}
    if system == "shardc":
        import shardc.runtime.state.init_first as first
        import shardc.runtime.state.draws as draws
        import shardc.runtime.state.init_pieces as pieces
        for obj, name in ((first, "_run_first"), (first, "broadcast"), (pieces.Pieces, "_receive"),
                          (draws, "advance"), (pieces.dist, "all_gather_single"), (pieces, "apply_pieces")):
            _timed(clock, obj, name)
    dist.barrier()
    c, w = time.process_time(), time.perf_counter()
    torch.manual_seed(1234)
    phases = {}
    if system == "shardc":
        import shardc
        x = torch.randint(0, 32000, (1, 16))
        sm = shardc.compile(model, STRATEGY, example_inputs=(x,), mesh="node(2) > gpu(4)", init=model._init_weights)
        phases, params = dict(sm.startup_seconds), list(sm.parameters())
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for mod in [model.model.embed_tokens, *model.model.layers, model.lm_head]:
            fully_shard(mod, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.apply(model._init_weights)
        params = list(model.parameters())
    cpu = time.process_time() - c
    dist.barrier()
    wall = time.perf_counter() - w
    sq = sum(float(p.to_local().detach().double().pow(2).sum()) for p in params)
    return dict(cpu=cpu, wall=wall, sq=sq, phases=phases, values=clock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    from tests.harness import dist_run, shutdown
    res = {"layers": args.layers, "hidden": args.hidden, "world": 8, "rounds": {"shardc": [], "fsdp2": []}}
    try:
        for rnd in range(args.rounds):
            for system in ("shardc", "fsdp2"):
                out = dist_run(8, job, system, args.layers, args.hidden)
                row = dict(wall=max(o["wall"] for o in out), cpu=[round(o["cpu"], 3) for o in out],
                           norm=sum(o["sq"] for o in out) ** 0.5,
                           phases0={k: round(v, 3) for k, v in out[0]["phases"].items()},
                           values0={k: round(v, 3) for k, v in out[0]["values"].items()},
                           values5={k: round(v, 3) for k, v in out[5]["values"].items()})
                res["rounds"][system].append(row)
                print(system, rnd, json.dumps(row), flush=True)
    finally:
        shutdown()
    res["medians"] = {s: dict(wall=statistics.median(r["wall"] for r in rows),
                              cpu_max=statistics.median(max(r["cpu"]) for r in rows),
                              cpu_sum=statistics.median(sum(r["cpu"]) for r in rows))
                      for s, rows in res["rounds"].items()}
    res["load_average"] = os.getloadavg()
    print(json.dumps(res["medians"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
