"""Start-up of a big model on one machine (bench stage: systems x a Llama's depth -> start-up
time, peak RSS per rank, model states per rank, the first step's loss; information only).

    python bench/bigmodel.py --layers 16 --no-step --workdir /tmp/bigmodel-16 --json OUT.json
    python bench/bigmodel.py --layers 1 --workdir /tmp/bigmodel-1 --json OUT.json \
        --systems shardc:init@ring,shardc:dcp@ring,shardc:safetensors@ring,fsdp2:init,fsdp2:dcp,shardc:init
    python bench/bigmodel.py --table OUT.json ...        # docs/BENCHMARKS.md's rows

Input: `--layers N`, the depth of a Hugging Face `LlamaForCausalLM` of TinyLlama's width
(hidden 2048, intermediate 5632, vocab 32000, 32 heads, 4 KV heads, untied head, fp32;
`llama_N` below is its factory, e.g. `shardc explain ... --model bench/bigmodel.py:llama_16`),
and `--systems`, each run by this script (the driver) in its own `torchrun --nproc-per-node 8`
(gloo, CPU, OMP_NUM_THREADS=1) so that every figure comes from fresh processes:

- `shardc:init`: built on the meta device, `shardc.compile(model, zero3.shard, mesh
  "node(2) > gpu(4)", init=model._init_weights)` after `torch.manual_seed`; the first
  `shardc:init*` of a run also saves the initial values as a DCP checkpoint (`WORKDIR/dcp`,
  torch's recipe: `dcp.save` of `get_model_state_dict`; the model only, as torchtitan's
  seed checkpoint), after its start-up figures are taken and before its step;
- `shardc:dcp`: meta, `init=shardc.buffers_only(model._init_weights)` (the rotary cache),
  then torch's recipe: `get_model_state_dict`, `dcp.load`, `set_model_state_dict`;
- `shardc:safetensors`: meta, the same buffers-only init, `shardc.load_safetensors` of
  `WORKDIR/hf`: a `save_pretrained`-layout directory (config.json, safetensors files of
  at most 1 GiB, their index) that the driver writes from the DCP checkpoint in one
  process, a file's tensors at a time (preparation, not measured: `prepare_hf`);
- `fsdp2:init`: FSDP2's meta recipe: meta build, `fully_shard` per decoder layer and the
  root on a 1-D mesh of 8 (`--fsdp2-wrap units`: the embedding and the head each on their
  own too, as `bench/llama_zero3_units.shard` makes them shardc's units), `model.to_empty(device="cpu")`, `model.apply(model._init_weights)`;
- `fsdp2:dcp`: the same without the init (only the rotary cache recomputed), then the
  recipe above from `WORKDIR/dcp`.

A shardc system may end in `@ring|@hierarchical|@ho-ring|@auto` (bench/peers/systems.py's
suffix): the strategy with that `collectives` line (zero3 on this 2-level mesh is `auto`,
which resolves to HO-Ring); `--strategy FILE` replaces zero3.shard.

`--rounds N` runs the systems N times in turn (shardc and FSDP2 interleaved on a loaded
machine; the file keeps every round, the summaries add the medians); `--plan-cache DIR`
is `$SHARDC_PLAN_CACHE` for the shardc systems, emptied before each round, so each round's
first shardc system captures and lowers and the others read its plan (a restart's
start-up, shardc/handoff.py). The driver is bench/bigmodel_driver.py, the start-up paths
bench/bigmodel_startup.py; `--table FILE --phases` prints the start-up per phase.

Then, unless `--no-step`, one training step (with `--no-step`, the first forward alone; with
`--no-forward` too, nothing after start-up, and the seed checkpoint only if a system loads it): batch 1 x 128 random tokens per rank (seeded
by rank), forward, the next-token cross-entropy from the logits, backward, AdamW (lr 3e-4)
`step()`, `zero_grad()`.

Output: per system and per rank, the start-up wall time (the meta build to values ready,
after a barrier: the slowest rank's), its CPU seconds (`time.process_time`, the rank's
threads too) and its phases (shardc: build, capture and lowering on the rank that compiled,
the plan's wait, groups, allocation, values, load; FSDP2: build, groups, `fully_shard`,
`to_empty`, init or load; both: the first forward; the init's own time inside
`_init_weights`), the peak RSS of start-up and of the first step (Linux `VmHWM`
from /proc/self/status, reset by writing 5 to /proc/self/clear_refs after the start-up
figure is read, so the step's peak is its own; `ru_maxrss` of the whole process beside it),
the RSS after importing torch, transformers and shardc and after start-up (`VmRSS`), the
model states per rank at start-up and after `opt.step()` (shardc: `sm.memory_report()`;
FSDP2: the local shards of parameters, gradients and optimizer states), the parameter norm
(float64 over every rank's pieces: equal loads give equal norms), the step's time and its
loss (every rank's, and their mean); plus `shardc explain ... --json`'s `memory` (`startup`,
`total`), the whole-build arithmetic (8 ranks x parameters x 4 bytes), and the init's cost
per parameter in one process on one thread (`init_rate`). `--json` writes it all (result
files: `systems_100gbit_DATE_bigmodel-lN-{startup,step}.json`, docs/BENCHMARKS.md "Result
files": 8 ranks of one machine over loopback, unshaped; no MODEL field, this model is not a
preset).

Memory: before each torchrun the driver waits (up to `--wait` seconds) until /proc/meminfo's
MemAvailable holds `--need-gib` (default: an estimate, at most the machine's memory less
1 GiB); while it runs, a watchdog kills the job when MemAvailable falls below `--floor-gib`
(the run is recorded as not fitting, with the ranks' RSS then and the start-up figures
written before the step), and every rank sets its oom_score_adj to 1000, so that a job that
does not fit never makes the kernel kill another one. A machine that never frees the memory
is one sentence, as is any other bad input (a system, a depth, a strategy file, a load with
no checkpoint saved), and a failed torchrun names its log.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGY = os.path.join(ROOT, "examples", "strategies", "zero3.shard")
MESH = "node(2) > gpu(4)"
WORLD = 8
SEED = 1234
TOKENS = 128
LR = 3e-4
SYSTEMS = ("shardc:init", "shardc:dcp", "shardc:safetensors", "fsdp2:init", "fsdp2:dcp")
ALGOS = ("ring", "hierarchical", "ho-ring", "auto")     # `shardc:HOW@ALGO`: zero3 with `collectives ALGO`
WIDTH = dict(hidden_size=2048, intermediate_size=5632, vocab_size=32000, num_attention_heads=32,
             num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
             tie_word_embeddings=False, use_cache=False)
if os.environ.get("BIGMODEL_TINY"):     # a check of the script itself in seconds (no figure from it is reported)
    WIDTH = dict(WIDTH, hidden_size=64, intermediate_size=128, vocab_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
GIB = 2 ** 30
HF_FILE_BYTES = GIB                 # the largest safetensors file prepare_hf writes


class BadInput(Exception):
    """One sentence for the user (printed without a traceback)."""


# ---------------------------------------------------------------------------- the model

def config(layers: int):
    from transformers import LlamaConfig
    return LlamaConfig(num_hidden_layers=layers, **WIDTH)


def llama(layers: int):
    """TinyLlama's width with `layers` decoder layers (values as the device context makes them)."""
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM(config(layers))


def n_params(layers: int) -> int:
    """Parameters of `llama(layers)`, by arithmetic (no model is built)."""
    h, i, v = WIDTH["hidden_size"], WIDTH["intermediate_size"], WIDTH["vocab_size"]
    kv = h // WIDTH["num_attention_heads"] * WIDTH["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h          # q, o; k, v; gate, up, down; 2 norms
    return 2 * v * h + h + layers * layer                       # embedding, head, final norm


def __getattr__(name: str):
    """`llama_N` is the factory of `llama(N)` (for `shardc explain --model bench/bigmodel.py:llama_N`)."""
    m = re.fullmatch(r"llama_(\d+)", name)
    if m:
        def factory():
            return llama(int(m.group(1)))
        factory.__name__ = name
        return factory
    raise AttributeError(name)


# ---------------------------------------------------------------------------- measuring

STATUS_KEYS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon and RssFile of this process, in bytes (/proc/self/status): the
    bench's one reader of them (peak_fsdp2.py, startup_rss.py, load_peak.py read it here)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in STATUS_KEYS:
                out[key] = int(line.split()[1]) * 1024
    return out


def trace(what: str) -> None:
    """With BIGMODEL_TRACE=1: this rank's RSS and peak at `what`, on stderr (the torchrun log)."""
    if os.environ.get("BIGMODEL_TRACE"):
        st = proc_status()
        print(f"[rank {os.environ.get('RANK', 0)}] {what}: RSS {st['VmRSS'] / GIB:.2f} GiB, peak {st['VmHWM'] / GIB:.2f} GiB",
              file=sys.stderr, flush=True)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                       # resets VmHWM to the current RSS (Linux >= 4.0)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise BadInput("/proc/meminfo has no MemAvailable: this script measures a Linux machine")


def local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor
    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------- one rank

def parse_algo(system: str) -> str | None:
    return system.split("@")[1] if "@" in system else None


def batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1 + rank)
    return torch.randint(0, WIDTH["vocab_size"], (1, TOKENS), generator=g)


def model_states(system: str, model, opt=None) -> dict[str, int]:
    """Bytes of model states this rank holds (after `opt.step()`, gradients still there)."""
    if system.startswith("shardc"):
        return model.memory_report()
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters())
    optim = 0 if opt is None else sum(local_bytes(v) for st in opt.state.values() for v in st.values()
                                      if torch.is_tensor(v) and v.dim() > 0)
    return dict(params=params, grads=grads, optim=optim, total=params + grads + optim)


def param_norm(model) -> float:
    """The whole model's parameter norm, from every rank's pieces summed in float64 (equal
    values give equal norms: a check of the loads). Both systems' parameters give their
    piece by `to_local()` (`p.detach()` of a shardc parameter is its piece too, and
    `vector_norm` of a DTensor sums in fp32: 161.88 for 161.92 on the 65 M-element head)."""
    import torch.distributed as dist
    with torch.no_grad():
        sq = sum(p.to_local().double().pow(2).sum() for p in model.parameters())
    dist.all_reduce(sq)
    return float(sq) ** 0.5


def worker(args) -> None:
    """One rank of `args.worker` under torchrun: start up, one step, figures to args.out."""
    from datetime import timedelta

    from bigmodel_startup import start_fsdp2, start_shardc

    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM  # noqa: F401  (imported before the baseline: every system needs it)

    import shardc  # noqa: F401  (shardc.compile's own imports, runtime and export, are start-up: in capture_s)
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")                    # if the machine runs out, the kernel kills a rank, not a neighbour
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != WORLD:
        raise BadInput(f"bench/bigmodel.py runs on {WORLD} ranks (mesh {MESH}), not {world}: "
                       f"torchrun --nproc-per-node {WORLD}")
    system, (kind, how), algo = args.worker, args.worker.split("@")[0].split(":"), parse_algo(args.worker)
    x = batch(rank)
    gc.collect()
    dist.barrier()
    r = dict(rank=rank, rss_imported=proc_status()["VmRSS"])
    trace("imported")
    t0, c0 = time.perf_counter(), time.process_time()
    r["phases"] = {}
    if kind == "shardc":
        model = start_shardc(how, args.layers, args.workdir, x, r["phases"], algo, args.strategy)
        r["plan_origin"] = model.plan_origin           # compiled, received (from rank 0) or cache
    else:
        model = start_fsdp2(how, args.layers, args.workdir, r["phases"], args.fsdp2_wrap)
    r["startup_rank_s"] = time.perf_counter() - t0
    r["startup_cpu_s"] = time.process_time() - c0     # this process's CPU seconds (its threads too)
    dist.barrier()
    r["startup_s"] = time.perf_counter() - t0
    st = proc_status()
    r["hwm_startup"], r["rss_ready"] = st["VmHWM"], st["VmRSS"]
    r["states_ready"] = model_states(system, model)
    trace("values ready")
    r["param_norm"] = param_norm(model)
    if args.save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        t = time.perf_counter()
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(args.workdir, "dcp"))
        dist.barrier()
        r["save_s"] = time.perf_counter() - t
        r["hwm_save"] = proc_status()["VmHWM"]
    write_ranks(r, args.out)               # the start-up figures survive a step that does not fit
    if not args.step and args.forward:     # the first forward alone (the step's times it too)
        dist.barrier()
        t = time.perf_counter()
        logits = model(x).logits
        r["phases"]["first_forward_s"] = time.perf_counter() - t
        del logits
    if args.step:
        gc.collect()
        reset_peak()
        r["rss_before_step"] = proc_status()["VmRSS"]
        t = time.perf_counter()
        if kind == "shardc":
            opt = model.optimizer(torch.optim.AdamW, lr=LR)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
        t1 = time.perf_counter()
        logits = model(x).logits
        r["phases"]["first_forward_s"] = time.perf_counter() - t1
        trace("forward")
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        del logits
        loss.backward()
        trace("backward")
        opt.step()
        trace("opt.step")
        r["states"] = model_states(system, model, opt)
        opt.zero_grad()
        r["step_rank_s"] = time.perf_counter() - t
        dist.barrier()
        r["step_s"] = time.perf_counter() - t
        r["hwm_step"] = proc_status()["VmHWM"]
        r["loss"] = float(loss)
    r["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # KiB on Linux
    write_ranks(r, args.out)
    dist.barrier()
    dist.destroy_process_group()


def write_ranks(r: dict, out: str) -> None:
    """Every rank's figures, gathered to rank 0, written to `out` (JSON list by rank)."""
    import torch.distributed as dist
    everyone = [None] * dist.get_world_size()
    dist.gather_object(r, everyone if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() == 0:
        with open(out + ".tmp", "w") as f:
            json.dump(everyone, f)
        os.replace(out + ".tmp", out)



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workdir", default="/tmp/bigmodel")
    ap.add_argument("--json")
    ap.add_argument("--strategy", default=STRATEGY, help="the shardc systems' strategy (default zero3.shard)")
    ap.add_argument("--fsdp2-wrap", choices=("layers", "units"), default="layers",
                    help="FSDP2's fully_shard calls: each decoder layer and the root (layers), or also "
                         "the embedding and the head each on its own (units: bench/llama_zero3_units.shard's)")
    ap.add_argument("--no-step", dest="step", action="store_false", help="start-up only, no training step")
    ap.add_argument("--no-forward", dest="forward", action="store_false",
                    help="with --no-step: no first forward either, and no seed checkpoint unless a system loads it")
    ap.add_argument("--need-gib", type=float, help="memory to wait for before each torchrun (default: estimated)")
    ap.add_argument("--wait", type=float, default=3600, help="seconds to wait for that memory")
    ap.add_argument("--floor-gib", type=float, default=0.75,
                    help="stop a run when the machine's available memory falls below this")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds for each torchrun and each collective")
    ap.add_argument("--no-explain", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times, in turn (interleaved); summaries are the medians")
    ap.add_argument("--plan-cache", metavar="DIR",
                    help="$SHARDC_PLAN_CACHE for the shardc systems: the first compiles and writes the plan, "
                         "the others read it (a restart's start-up)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the docs' table rows of these result files")
    ap.add_argument("--phases", action="store_true", help="with --table: the start-up per phase table")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.modules.setdefault("bigmodel", sys.modules[__name__])     # the driver's `import bigmodel` is this module
    try:
        if args.worker:
            worker(args)
        else:
            import bigmodel_driver as d
            d.phase_table(args.table) if args.table and args.phases else d.table(args.table) if args.table \
                else d.driver(args)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
