"""shardc's peak against FSDP2's, per phase, in the same run (bench stage: a small Hugging
Face Llama on 8 gloo ranks -> torch's MemTracker peak per phase; information only).

    python bench/peak_fsdp2.py --json bench/results/systems_100gbit_DATE_peak-fsdp2.json   # torchrun x 8
    python bench/peak_fsdp2.py --table FILE.json     # docs/BENCHMARKS.md rows
    python bench/peak_fsdp2.py --simulate bench/results/simulate_DATE_peak-fsdp2.json   # LLaMA-65B, 1024 ranks

Input: a `LlamaForCausalLM` (hidden 256, intermediate 704, 4 layers, 8 heads, 4 KV heads,
vocab 8192, untied head, fp32; `llama_small` is its factory), batch 2 x 64 random tokens per
rank, AdamW (foreach, lr 1e-3). Four systems run one after the other in each of the 8
processes of one `torchrun` (gloo, CPU, mesh node(2) > gpu(4)), each on the same units — a
unit (FSDP2: a `fully_shard`) per decoder layer, the embedding and the head each on their
own, the rest the root:

- `shardc:zero3`: bench/llama_zero3_units.shard (every state over the world, a flat ring);
- `fsdp2:zero3`: `fully_shard` on a 1-D mesh of 8;
- `shardc:hsdp`: the same units, every state sharded over gpu, replicated over node (MiCS);
- `fsdp2:hsdp`: `fully_shard` on the 2-D mesh (replicate 2, shard 4): FSDP2's HSDP.

Each system runs one step unmeasured (the optimizer's states are made), then one step under
torch's `MemTracker` (tensor level: every tensor an operator makes, every storage resize,
the modules' parameters and gradients and the optimizer's states registered as external;
shardc: the runtime's storages, runtime/memory.py `held_tensors`; the same subclass
`shardc simulate` uses, which leaves out MemTracker's per-module bookkeeping). The peak is
read and reset at each phase's end, so each phase's figure is its own maximum: `forward`,
`backward` (FSDP2's reduce-scatters and HSDP's all-reduces are waited there), `sync`
(shardc's step-end sync, completed as opt.step() would complete it; FSDP2 has none here),
`step` (the optimizer step and the update all-gathers), `zero_grad`. Output: per system the
peak per phase (rank 0's and the max over ranks) and the states held before the step.

`--layers N`: the same four systems on bench/bigmodel.py's Llama of TinyLlama's width (hidden
2048, vocabulary 32000, untied head; 16 layers: the 836M model) with N layers, batch 1 x 128
tokens per rank, each system in a `torchrun` of its own under bigmodel.py's watchdog (a run
that leaves the machine under 0.75 GiB is stopped; its ranks are the OOM killer's first
pick). The model is built on meta and its start-up is tracked too (`startup`: shardc's
`compile(init=_init_weights)`, the exact init of every unit whole; FSDP2's `fully_shard`,
`to_empty` and `apply(_init_weights)` on each rank's shards), then the step as above
(`--cold`: the first step is the tracked one, its optimizer states made in `step`).

    flock /work/locks/big.lock python bench/peak_fsdp2.py --layers 16 --json bench/results/systems_100gbit_DATE_peak-fsdp2-l16.json

`--simulate`: the same comparison at LLaMA-65B's shapes (examples/llama.py `llama_65b`) as
rank 0 of 1024 (`node(128) > gpu(8)`), under torch's fake process group, one process per
system (`sim_worker`), one 2048-token sequence, AdamW, the second step tracked by the same
MemTracker subclass per phase (forward, backward, step). shardc: `shardc simulate`'s engine
(shardc/simulate.py `simulate_rank`, meta tensors) on zero3 and mics in the papers'
precision (bench/simulate_papers.py `bf16_text`: bf16 params, grads and collectives, an
fp32 master; `collectives auto`, which picks HO-Ring at 1024). FSDP2, as torchtitan's
memory estimator runs it: the model built on meta, `fully_shard` on each block and on the
root (the embedding, the final norm and the head: shardc's units), then `to_empty` under
`FakeTensorMode`, with `MixedPrecisionPolicy(bf16, bf16)`; `fully_shard` on a 1-D mesh of
1024 against zero3, HSDP (replicate 128 x shard 8) against mics.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
UNITS = os.path.join(HERE, "llama_zero3_units.shard")
MESH = "node(2) > gpu(4)"
WORLD = 8
SYSTEMS = ("shardc:zero3", "fsdp2:zero3", "shardc:hsdp", "fsdp2:hsdp")
PHASES = ("forward", "backward", "sync", "step", "zero_grad")
BATCH, SEQ = 2, 64


def llama_small():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=False,
                      max_position_embeddings=SEQ, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def hsdp_text() -> str:
    with open(UNITS) as f:
        text = f.read()
    return text.replace("shard over world", "shard over gpu").replace("collectives ring\n", "")


def optimizer():
    """(class, kwargs) of the step's optimizer: AdamW, or with `--sgd` (which sets
    PEAK_FSDP2_SGD for the ranks it starts) SGD without momentum, which holds no state: the
    836M model's 8 ranks fit this machine's memory only without AdamW's 2 x 418 MB per rank."""
    if os.environ.get("PEAK_FSDP2_SGD"):
        return torch.optim.SGD, {"lr": 1e-3}
    return torch.optim.AdamW, {"lr": 1e-3}


def build(system: str, x: torch.Tensor, layers: int = 0, phases: dict | None = None, load: str | None = None):
    """(the model to call, its optimizer, its states' tensors for the tracker, sync()).
    `layers` > 0: bench/bigmodel.py's Llama of TinyLlama's width with that many layers, built
    on meta and initialized as each system starts (shardc: `compile(init=_init_weights)`;
    FSDP2: `fully_shard`, `to_empty`, `apply(_init_weights)`), the start-up tracked by the
    same MemTracker into `phases["startup"]` (with the by-kind split under "startup_kinds").
    `load`: a DCP checkpoint directory the values are loaded from instead (both systems: the
    non-persistent rotary cache computed, then `get_model_state_dict`, `dcp.load`,
    `set_model_state_dict`: bench/bigmodel.py `load_dcp`)."""
    import contextlib
    torch.manual_seed(0)
    tracker = None
    if layers:
        sys.path.insert(0, HERE)
        import bigmodel
        from shardc.simulate import _step_tracker
        with torch.device("meta"):
            model = bigmodel.llama(layers)
        tracker = _step_tracker()
    else:
        model = llama_small()
    track = tracker.phase("startup") if tracker is not None else contextlib.nullcontext()
    if system.startswith("shardc"):
        import shardc
        from shardc.runtime.memory import held_tensors
        text = UNITS if system.endswith("zero3") else hsdp_text()
        with tracker if tracker is not None else contextlib.nullcontext(), track:
            init = shardc.buffers_only(model._init_weights) if load else model._init_weights
            sm = shardc.compile(model, text, example_inputs=(x,), mesh=MESH, **({"init": init} if layers else {}))
            if load:
                bigmodel.load_dcp(sm, load)
        cls, kw = optimizer()
        opt = sm.optimizer(cls, **kw)
        out = (sm, opt, lambda: [*held_tensors(sm.runtime, sm.params), opt],
               lambda: sm.runtime.boundary.wait_sync("the benchmark's sync phase"))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        with tracker if tracker is not None else contextlib.nullcontext(), track:
            mesh = (init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",)) if system.endswith("zero3") else
                    init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard")))
            for mod in [model.model.embed_tokens, *model.model.layers, model.lm_head]:
                fully_shard(mod, mesh=mesh)
            fully_shard(model, mesh=mesh)
            if layers:
                model.to_empty(device="cpu")
                model.apply(bigmodel.rotary_only(model._init_weights) if load else model._init_weights)
                if load:
                    bigmodel.load_dcp(model, load)
        cls, kw = optimizer()
        opt = cls(model.parameters(), **kw)
        out = (model, opt, lambda: [model, opt], lambda: None)
    if tracker is not None and phases is not None:
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY
        snap = tracker.__dict__.get("phases", {}).get("startup", {})
        # the CPU's peak (shardc's placeholders are meta tensors, a device of their own that
        # may come first in the tracker's snapshots)
        phases["startup"] = int(tracker._peak_mem.get(torch.device("cpu"), snap.get(_TOTAL_KEY, 0)))
        phases["startup_kinds"] = {getattr(k, "value", str(k)): int(v) for k, v in snap.items()}
        phases["startup_rss"] = bigmodel.proc_status()     # this process's VmHWM etc. since it began: start-up's
    return out


def loss_of(model, x):
    out = model(x)
    logits = out if torch.is_tensor(out) else out.logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), x.flatten())


def measure(system: str, x: torch.Tensor, layers: int = 0, warm: bool = True, load: str | None = None,
            step: bool = True) -> dict:
    """One system's peaks per phase; `warm`: after one unmeasured step (the optimizer's
    states made before the tracked step), else the first step is the tracked one. With
    `load` (a DCP load of `load`) or not `step`: the start-up only."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    from shardc.simulate import _step_tracker
    sys.path.insert(0, HERE)
    from bigmodel import proc_status
    start: dict = {}
    model, opt, external, sync = build(system, x, layers, start, load)
    if load or not step:
        k = {getattr(k, "value", str(k)): int(v) for k, v in start["startup_kinds"].items()}
        return {"states": 0, "peaks": {"startup": start["startup"]}, "peak": 0, "by_kind": {"startup": k},
                "rss": start["startup_rss"]}
    if warm:
        loss_of(model, x).backward()            # a first step: the optimizer's states are made
        sync()
        opt.step()
        opt.zero_grad()
    gc.collect()
    tracker = _step_tracker()
    tracker.track_external(*external())
    peaks: dict[str, int] = {}
    kinds: dict[str, dict] = {}

    def end(phase: str) -> None:
        peaks[phase] = int(max(tracker._peak_mem.values(), default=0))
        snap = next(iter(tracker._peak_mem_snap.values()), {})
        kinds[phase] = {getattr(k, "value", str(k)): int(v) for k, v in snap.items()}
        for dev, snap in tracker._curr_mem_snap.items():
            tracker._peak_mem[dev] = snap[_TOTAL_KEY]
            tracker._peak_mem_snap[dev] = dict(snap)
    with tracker:
        begin = int(sum(s[_TOTAL_KEY] for s in tracker._curr_mem_snap.values()))
        loss = loss_of(model, x)
        end("forward")
        loss.backward()
        del loss
        end("backward")
        sync()
        end("sync")
        opt.step()
        end("step")
        opt.zero_grad()
        end("zero_grad")
    del model, opt, tracker
    gc.collect()
    if "startup" in start:
        peaks["startup"], kinds["startup"] = start["startup"], start["startup_kinds"]
    return {"states": begin, "peaks": peaks, "peak": max(v for k, v in peaks.items() if k != "startup"),
            "by_kind": kinds, "rss": proc_status()}    # VmHWM: the process's peak, start-up and step


def worker(out: str, layers: int = 0, warm: bool = True, systems=SYSTEMS, load: str | None = None,
           save: str | None = None, step: bool = True) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    if layers:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")                 # if the machine runs out, the kernel kills a rank, not a neighbour
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if layers:
        sys.path.insert(0, HERE)
        import bigmodel
        x = bigmodel.batch(rank)
    else:
        x = torch.randint(0, 8192, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    phases = ("startup",) if load or not step else PHASES + (("startup",) if layers else ())
    if save:                                # the values the `load` runs read: FSDP2's init, saved
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        model = build("fsdp2:zero3", x, layers)[0]
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=save)
        return dist.destroy_process_group()
    results = {}
    for system in systems:
        r = measure(system, x, layers, warm, load, step)
        got = [None] * WORLD
        dist.all_gather_object(got, r)
        results[system] = {"rank0": got[0], "max_over_ranks": {
            "states": max(g["states"] for g in got), "peak": max(g["peak"] for g in got),
            "peaks": {p: max(g["peaks"][p] for g in got) for p in phases}}}
        if "rss" in got[0]:                 # every rank's tracker peaks and /proc figures
            results[system]["ranks"] = [{"startup": g["peaks"].get("startup"), "peak": g["peak"], **g["rss"]}
                                        for g in got]
        if rank == 0:                       # each system's figures kept as they come
            if layers:
                meta = {"model": f"bench/bigmodel.py:llama_{layers} (TinyLlama's width, fp32)",
                        "params": bigmodel.n_params(layers), "batch": 1, "seq": bigmodel.TOKENS,
                        "warm": warm, "step": step, "start-up": "meta build to values ready (shardc: compile with "
                        "init=_init_weights; FSDP2: fully_shard, to_empty, apply(_init_weights))" if not load else
                        "meta build to values loaded from a DCP checkpoint of FSDP2's init (no step)"}
            else:
                meta = {"model": "LlamaForCausalLM h256 i704 L4 v8192 fp32", "params": sum(
                    p.numel() for p in llama_small().parameters()), "batch": BATCH, "seq": SEQ}
            meta.update({"world": WORLD, "mesh": MESH, "torch": torch.__version__, "optimizer": "{} {}".format(
                             optimizer()[0].__name__, optimizer()[1]),
                         "tracker": "torch.distributed._tools.mem_tracker.MemTracker (shardc.simulate's)"})
            with open(out, "w") as f:
                json.dump({"meta": meta, "systems": results}, f, indent=1)
        dist.barrier()
    dist.destroy_process_group()


def table(path: str) -> str:
    with open(path) as f:
        r = json.load(f)["systems"]
    mib = 1 << 20
    phases = [p for p in (*PHASES, "startup") if any(p in v.get("max_over_ranks", {}).get("peaks", {})
                                                      for v in r.values())]
    rows = ["| system | states | " + " | ".join(phases) + " | step peak |", "|---" * (len(phases) + 3) + "|"]
    for system, v in r.items():
        if "max_over_ranks" not in v:
            why = "stopped by the watchdog" if v["run"].get("stopped") else f"exit {v['run']['rc']}"
            rows.append(f"| {system} | did not finish ({why}) |")
            continue
        m = v["max_over_ranks"]
        rows.append(f"| {system} | {m['states'] / mib:.2f} | " + " | ".join(
            f"{m['peaks'][p] / mib:.2f}" for p in phases) + f" | {m['peak'] / mib:.2f} |")
    return "\n".join(rows) + "\n\n(MiB per rank, the max over the 8 ranks of torch's MemTracker)"


SIM_SYSTEMS = ("shardc:zero3", "fsdp2:zero3", "shardc:mics", "fsdp2:hsdp")
SIM_NODES, SIM_SEQ = 128, 2048


def fsdp2_fake_step(model, seq: int, logits_of, vocab: int = 32000) -> dict:
    """FSDP2's side of `--simulate` / `--simulate-836m`: the `fully_shard`ed meta `model` made
    fake (FakeTensorMode) under the fake group, 1 x `seq` tokens, AdamW, one step unmeasured
    (the optimizer's states are made), the next under simulate's MemTracker subclass per
    phase, as shardc's simulated rank runs. `logits_of`: the model's output -> its logits."""
    import contextlib

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardc.analysis.costmodel.flops import flash_sdpa_mode
    from shardc.simulate import _step_tracker
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, vocab, (1, seq))

        def step(phase):
            with phase("forward"):
                loss = F.cross_entropy(logits_of(model(x)).flatten(0, -2).float(), x.flatten())
            with phase("backward"):
                loss.backward()
            del loss
            with phase("step"):
                opt.step()
                opt.zero_grad()
        with flash_sdpa_mode():
            step(lambda name: contextlib.nullcontext())
        tracker = _step_tracker()
        tracker.track_external(model, opt)
        with tracker, flash_sdpa_mode():
            step(tracker.phase)
    dist.destroy_process_group()
    peaks = tracker.phase_peaks()
    return {"peaks": peaks, "peak": max(peaks.values()), "by_kind": tracker.peak_by_kind(),
            "states": sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())}


def sim_836m(system: str, factory=None, seq: int = 0) -> dict:
    """One system's simulated rank 0 at the 836M Llama (`--simulate-836m`): bench/bigmodel.py's
    16 layers of TinyLlama's width in fp32, 8 ranks, shardc's systems as the gloo run has them
    (`bench/llama_zero3_units.shard`, `hsdp_text`), FSDP2's `fully_shard` per unit, 1 x 128
    tokens, AdamW, the second step tracked per phase. The config keeps HF's `use_cache`
    (both systems alike): without it HF's packed-sequence check reads a meta value.
    `factory`, `seq`: another HF Llama of the same units and its tokens (a test's small one;
    the process must have no default process group: each side makes its fake one)."""
    sys.path.insert(0, HERE)
    import bigmodel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torch.distributed._tools.fake_collectives  # noqa: F401  (the collectives' fake kernels)
    import shardc
    from shardc.simulate import init_fake, simulate_rank

    if factory is None:
        from peak_models import llama_836m as factory
    seq = seq or bigmodel.TOKENS
    if system.startswith("shardc"):
        with open(UNITS) as f:
            text = f.read() if system.endswith("zero3") else hsdp_text()
        s = shardc.load_strategy(text, mesh=MESH, world_size=WORLD)
        rep = simulate_rank(s, factory, 0, spec="llama_16", micro_batches=1, batch=1, seq=seq, peak=True)
        return {"peaks": rep["peak"]["phases"], "peak": rep["peak"]["measured"], "by_kind": rep["peak"]["by_kind"],
                "states": rep["memory"]["total"], "explain": rep["peak"]["explain"],
                "explain_phases": rep["peak"]["explain_phases"]}
    init_fake(0, WORLD)
    with torch.device("meta"):
        model = factory()
    mesh = (init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",)) if system.endswith("zero3") else
            init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard")))
    for mod in [model.model.embed_tokens, *model.model.layers, model.lm_head]:
        fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return fsdp2_fake_step(model, seq, lambda out: out.logits, model.config.vocab_size)


def sim_worker(system: str) -> dict:
    """One system's simulated rank 0 (see `--simulate`): MemTracker's peak per phase, bytes."""
    if system.startswith("836m:"):
        return sim_836m(system[len("836m:"):])
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import simulate_papers as P
    from shardc.simulate import init_fake, simulate_rank
    factory = P._factory("examples/llama.py:llama_65b")
    if system.startswith("shardc"):
        import shardc
        s = shardc.load_strategy(P.bf16_text(system.split(":")[1]), mesh=f"node({SIM_NODES}) > gpu(8)")
        rep = simulate_rank(s, factory, 0, spec="llama_65b", micro_batches=1, batch=1, seq=SIM_SEQ, peak=True)
        return {"peaks": rep["peak"]["phases"], "peak": rep["peak"]["measured"], "by_kind": rep["peak"]["by_kind"],
                "states": rep["memory"]["total"]}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import torch.distributed._tools.fake_collectives  # noqa: F401  (the collectives' fake kernels)
    world = SIM_NODES * 8
    init_fake(0, world)
    with torch.device("meta"):
        model = factory()
    mesh = (init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)) if system.endswith("zero3") else
            init_device_mesh("cpu", (SIM_NODES, 8), mesh_dim_names=("replicate", "shard")))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return fsdp2_fake_step(model, SIM_SEQ, lambda out: out)


def simulate(out: str, small: bool = False) -> None:
    """`--simulate` (LLaMA-65B, 1024 ranks) or, `small`, `--simulate-836m` (8 ranks)."""
    results = {}
    for system in (SYSTEMS if small else SIM_SYSTEMS):   # a fresh process each: each makes its own fake group
        got = subprocess.run([sys.executable, sys.argv[0], "--sim-worker", ("836m:" if small else "") + system],
                             check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results[system] = json.loads(got)
        print(system, round(results[system]["peak"] / 2**20, 2), "MiB", flush=True)
    meta = {"model": "examples/llama.py:llama_65b (bf16 params, grads, collectives; fp32 master, AdamW)",
            "mesh": f"node({SIM_NODES}) > gpu(8)", "rank": 0, "seq": SIM_SEQ, "torch": torch.__version__,
            "tracker": "torch.distributed._tools.mem_tracker.MemTracker (shardc.simulate's)"}
    if small:
        meta.update(model="bench/bigmodel.py:llama_16 (836M, TinyLlama's width, fp32, AdamW)", mesh=MESH, seq=128)
    with open(out, "w") as f:
        json.dump({"meta": meta, "systems": results}, f, indent=1)


def sim_table(r: dict) -> str:
    rows = ["| system | forward | backward | step | peak | by kind at the peak |", "|---|---|---|---|---|---|"]
    for system, v in r.items():
        kinds = ", ".join(f"{k} {b / 1e9:.2f}" for k, b in v["by_kind"].items() if b and k != "Total")
        rows.append(f"| {system} | " + " | ".join(f"{v['peaks'].get(p, 0) / 1e9:.2f}" for p in ("forward", "backward", "step"))
                    + f" | {v['peak'] / 1e9:.2f} | {kinds} |")
    return "\n".join(rows) + "\n\n(GB = 10^9 bytes, rank 0 of 1024 under torch's fake process group)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="driver: run the 8 ranks, write the results here")
    ap.add_argument("--table", help="print docs/BENCHMARKS.md's rows from a result file")
    ap.add_argument("--simulate", help="LLaMA-65B at 1024 simulated ranks: write the results here")
    ap.add_argument("--simulate-836m", help="the 836M Llama at 8 simulated ranks: write the results here")
    ap.add_argument("--layers", type=int, default=0, help="bench/bigmodel.py's Llama with this many layers "
                    "(16: 836M), built on meta, its start-up tracked too (default: the small Llama)")
    ap.add_argument("--cold", action="store_true", help="track the first step (no unmeasured step before)")
    ap.add_argument("--sgd", action="store_true", help="SGD without momentum instead of AdamW (no optimizer states)")
    ap.add_argument("--load", metavar="DIR", help="--layers: the start-up only, a DCP load of DIR/dcp (saved "
                    "there first from FSDP2's init when absent)")
    ap.add_argument("--no-step", action="store_true", help="--layers: the start-up only")
    ap.add_argument("--save", help=argparse.SUPPRESS)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of " + ", ".join(SYSTEMS))
    ap.add_argument("--need-gib", type=float, default=20, help="--layers: wait for this much available memory")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--sim-worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.sgd:
        os.environ["PEAK_FSDP2_SGD"] = "1"          # for the ranks this run starts (`optimizer`)
    if a.worker:
        return worker(a.worker, a.layers, not a.cold, tuple(a.systems.split(",")), a.load, a.save, not a.no_step)
    if a.sim_worker:
        return print(json.dumps(sim_worker(a.sim_worker)))
    if a.simulate or a.simulate_836m:
        simulate(a.simulate or a.simulate_836m, small=bool(a.simulate_836m))
        with open(a.simulate or a.simulate_836m) as f:
            return print(sim_table(json.load(f)["systems"]))
    if a.table:
        with open(a.table) as f:
            r = json.load(f)
        return print(table(a.table) if "rank0" in next(iter(r["systems"].values())) else sim_table(r["systems"]))
    if a.layers:
        return print(table(big(a)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                    "--master-port", "29641", sys.argv[0], "--worker", os.path.abspath(a.json)],
                   check=True, env=env)
    print(table(a.json))


def big(a) -> str:
    """`--layers N`: one `torchrun` per system (a system's freed memory is not always given
    back to the OS in the process), in SYSTEMS' order, under bench/bigmodel.py's watchdog (a
    run that leaves the machine under 0.75 GiB is stopped; its ranks are the OOM killer's
    first pick). The systems' results are merged into `a.json`."""
    import threading
    import time
    sys.path.insert(0, HERE)
    import bigmodel
    import bigmodel_driver
    merged: dict = {"meta": {}, "systems": {}}
    load = os.path.join(os.path.abspath(a.load), "dcp") if a.load else None
    if load and not os.path.exists(load):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
                        "29641", sys.argv[0], "--worker", "-", "--layers", str(a.layers), "--save", load],
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    for system in a.systems.split(","):
        part = os.path.abspath(a.json) + "." + system.replace(":", "-")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
               "29641", sys.argv[0], "--worker", part, "--layers", str(a.layers), "--systems", system]
        have = bigmodel_driver.wait_for_memory(int(a.need_gib * bigmodel.GIB), 600)
        print(f"{system}: {have / bigmodel.GIB:.1f} GiB available", flush=True)
        seen: dict = {}
        load0, t0 = os.getloadavg(), time.perf_counter()
        proc = subprocess.Popen(cmd + (["--cold"] if a.cold else []) + (["--load", load] if load else []) +
                                (["--no-step"] if a.no_step else []), env=dict(os.environ, OMP_NUM_THREADS="1"),
                                start_new_session=True)
        threading.Thread(target=bigmodel_driver.watch, args=(proc, int(0.75 * bigmodel.GIB), seen), daemon=True).start()
        rc = proc.wait()
        run = dict(torchrun_s=round(time.perf_counter() - t0, 1), loadavg_before=load0, loadavg_after=os.getloadavg(),
                   max_sum_rss=seen.get("max_sum_rss"), min_available=seen.get("min_available"),
                   stopped=seen.get("killed"), rc=rc)
        if os.path.exists(part):
            with open(part) as f:
                got = json.load(f)
            os.remove(part)
            merged["meta"] = got["meta"]
            merged["systems"][system] = dict(got["systems"][system], run=run)
        else:
            merged["systems"][system] = {"run": run}
        with open(a.json, "w") as f:
            json.dump(merged, f, indent=1)
    return a.json


if __name__ == "__main__":
    main()
