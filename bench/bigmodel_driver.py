"""The driver of bench/bigmodel.py (bench stage: flags -> one torchrun per system and round
-> the result JSON and docs/BENCHMARKS.md's rows).

Input: bench/bigmodel.py's parsed flags. Output: `driver(args)` runs every system of
`--systems` in its own `torchrun --nproc-per-node 8`, `--rounds` times in turn (so shardc
and FSDP2 are measured interleaved on a loaded machine: the file keeps every round and
the summaries are the rounds' medians), waiting for memory before each and watching it
while it runs; `prepare_hf` writes the safetensors copy of the checkpoint; `table` and
`phase_table` print the docs' rows from result files.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

import torch

import bigmodel as B
from bigmodel import (GIB, HF_FILE_BYTES, MESH, ROOT, SEED, STRATEGY, SYSTEMS, ALGOS, TOKENS, WIDTH, WORLD,
                      BadInput, config, llama, mem_available, n_params, parse_algo)

# ---------------------------------------------------------------------------- preparation

def prepare_hf(layers: int, workdir: str) -> dict:
    """WORKDIR/hf from WORKDIR/dcp in this one process: the checkpoint's `model.` entries
    in files of at most HF_FILE_BYTES (save_pretrained's names, its index, config.json),
    each file's tensors read by DCP (no process group) and written, then dropped."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    src, dst = os.path.join(workdir, "dcp"), os.path.join(workdir, "hf")
    t0 = time.perf_counter()
    meta = dcp.FileSystemReader(src).read_metadata().state_dict_metadata
    keys = [k for k in meta if k.startswith("model.")]
    files, cur, size = [], [], 0
    for k in keys:
        nbytes = meta[k].size.numel() * meta[k].properties.dtype.itemsize
        if cur and size + nbytes > HF_FILE_BYTES:
            files.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += nbytes
    files.append(cur)
    os.makedirs(dst, exist_ok=True)
    weight_map, total = {}, 0
    for i, group in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        sd = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in group}
        dcp.load(sd, checkpoint_id=src, no_dist=True)
        save_file({k[len("model."):]: v for k, v in sd.items()}, os.path.join(dst, name), metadata={"format": "pt"})
        for k, v in sd.items():
            weight_map[k[len("model."):]] = name
            total += v.numel() * v.element_size()
        del sd
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config(layers).save_pretrained(dst)
    return dict(files=len(files), bytes=total, seconds=time.perf_counter() - t0,
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


# ---------------------------------------------------------------------------- the driver

def init_rate(layers: int = 1) -> dict:
    """`model.apply(model._init_weights)` on `llama(layers)` materialized whole, in this one
    process on one thread (a rank's OMP_NUM_THREADS=1): the init's cost per parameter on an
    idle core, what every rank pays per parameter of the whole model under a meta init."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.device("meta"):
            model = llama(layers)
        model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        w, c = time.perf_counter(), time.process_time()
        model.apply(model._init_weights)
        wall, cpu = time.perf_counter() - w, time.process_time() - c
    finally:
        torch.set_num_threads(threads)
    p = n_params(layers)
    return dict(layers=layers, params=p, wall_s=wall, cpu_s=cpu, loadavg=os.getloadavg(),
                s_per_param=wall / p, derived_7b_s=wall / p * 6.7e9)


def mem_total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def need_bytes(layers: int, step: bool) -> int:
    """What 8 ranks need, estimated (only to wait for a quiet machine: the watchdog decides).
    Per rank: torch and transformers (0.3 GiB); at start-up the parameter and gradient
    shards (8 bytes a parameter over 8 ranks) and the largest unit whole (the root:
    embedding and head); in the step the AdamW moments too (16 bytes a parameter over 8)
    and the root's transient (gathered, its gradient, the reduce-scatter's buffers: 4x).
    Plus 1 GiB for the OS; at most the machine's memory less 1 GiB."""
    root = 2 * WIDTH["vocab_size"] * WIDTH["hidden_size"] * 4
    rank = int(0.3 * GIB) + n_params(layers) * (16 if step else 8) // WORLD + (4 if step else 1) * root
    return min(WORLD * rank + GIB, mem_total() - GIB)


def wait_for_memory(need: int, wait: float) -> int:
    deadline = time.time() + wait
    while True:
        have = mem_available()
        if have >= need:
            return have
        if time.time() >= deadline:
            raise BadInput(f"the machine has {have / GIB:.1f} GiB available, {need / GIB:.1f} GiB needed "
                           f"(waited {wait:.0f}s): wait for other jobs, or pass fewer --layers or --need-gib")
        print(f"  {have / GIB:.1f} GiB available, {need / GIB:.1f} GiB needed: waiting", flush=True)
        time.sleep(min(10, max(1, deadline - time.time())))


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it. torchrun starts each worker in a session
    of its own (torch's elastic SubprocessHandler: `start_new_session=True`), so killing
    torchrun's process group left its workers running (FSDP2's 8 held 15 GB for 1.5 min
    after a stop): the tree is listed first, torchrun killed (it restarts nothing), then
    each worker by its pid."""
    import signal
    tree = descendants(pid)
    for p in [pid, *tree]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def watch(proc, floor: int, seen: dict) -> None:
    """Kill `proc` and its workers (`kill_tree`) when MemAvailable falls below `floor`
    (before the kernel's OOM killer, which might pick another job); record the ranks' RSS then."""
    while proc.poll() is None:
        ranks = [rss_of(p) for p in descendants(proc.pid)]
        seen["max_sum_rss"] = max(seen.get("max_sum_rss", 0), sum(ranks))
        have = mem_available()
        seen["min_available"] = min(seen.get("min_available", have), have)
        if have < floor:
            seen["killed"] = dict(available=have, ranks_rss=ranks)
            kill_tree(proc.pid)
            return
        time.sleep(0.05)


def run_system(system: str, args, need: int, save: bool) -> dict:
    import threading
    have = wait_for_memory(need, args.wait)
    name = system.replace(":", "-") + ("" if args.step else "-startup")
    out, log = (os.path.join(args.workdir, f"{name}.{ext}") for ext in ("json", "log"))
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           os.path.abspath(B.__file__), "--worker", system, "--layers", str(args.layers), "--workdir", args.workdir,
           "--out", out, "--timeout", str(args.timeout), "--strategy", os.path.abspath(args.strategy),
           "--fsdp2-wrap", args.fsdp2_wrap] + \
        (["--save"] if save else []) + ([] if args.step else ["--no-step"]) + ([] if args.forward else ["--no-forward"])
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDC_TIMEOUT=str(args.timeout))
    if args.plan_cache and system.startswith("shardc"):
        env["SHARDC_PLAN_CACHE"] = args.plan_cache
    print(f"{system}: torchrun ({have / GIB:.1f} GiB available), log {log}", flush=True)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    seen: dict = {}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        threading.Thread(target=watch, args=(proc, int(args.floor_gib * GIB), seen), daemon=True).start()
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            raise BadInput(f"{system} ran past --timeout {args.timeout}s: see {log}") from None
    wall = time.perf_counter() - t0
    common = dict(system=system, torchrun_s=wall, mem_available_before=have, loadavg_before=load0,
                  loadavg_after=os.getloadavg(), max_sum_rss=seen.get("max_sum_rss"),
                  min_available=seen.get("min_available"))
    if "killed" in seen:
        k = seen["killed"]
        print(f"  {system}: stopped, {k['available'] / GIB:.2f} GiB left on the machine with the ranks at "
              f"{sum(k['ranks_rss']) / GIB:.1f} GiB (does not fit)", flush=True)
        part = {}
        if os.path.exists(out):                # the start-up figures, written before the step
            with open(out) as f:
                part = summarize(json.load(f))
        return dict(common, fits=False, killed=k, **part)
    if rc != 0:
        raise BadInput(f"{system} failed (exit {rc}): see {log}")
    with open(out) as f:
        ranks = json.load(f)
    return dict(common, fits=True, **summarize(ranks))


def summarize(ranks: list[dict]) -> dict:
    def top(k):
        vals = [r[k] for r in ranks if k in r]
        return max(vals) if vals else None
    out = dict(startup_s=top("startup_s"), startup_cpu_max=top("startup_cpu_s"),
               startup_cpu_sum=sum(r.get("startup_cpu_s", 0) for r in ranks), plan_origin=ranks[0].get("plan_origin"), hwm_startup_max=top("hwm_startup"), rss_ready_max=top("rss_ready"),
               rss_imported_max=top("rss_imported"), states_ready_max=max(r["states_ready"]["total"] for r in ranks),
               param_norm=ranks[0]["param_norm"], ru_maxrss_max=top("ru_maxrss"), save_s=top("save_s"),
               hwm_save_max=top("hwm_save"))
    if "loss" in ranks[0]:
        losses = [r["loss"] for r in ranks]
        out.update(step_s=top("step_s"), hwm_step_max=top("hwm_step"),
                   states_max=max(r["states"]["total"] for r in ranks), loss_mean=sum(losses) / len(losses))
    names = dict.fromkeys(k for r in ranks for k in r.get("phases", {}))
    out["phases_max"] = {k: max(r["phases"][k] for r in ranks if k in r["phases"]) for k in names}
    return dict(out, ranks=ranks)


# the start-up breakdown, per phase (the slowest rank's wall seconds): shardc's capture and
# lowering run on rank 0 only (plan_s on the others: the wait for it), construct_s holds the
# groups, the allocation and an init's values; FSDP2's groups, fully_shard and to_empty
PHASES = ("build_s", "capture_s", "lowering_s", "plan_s", "groups_s", "shard_s", "allocation_s", "construct_s",
          "values_s", "init_s", "load_s", "first_forward_s")


def medians(rounds: list[dict]) -> dict:
    """The rounds' medians: start-up (wall, the slowest rank), its CPU seconds over the
    ranks, and each phase's slowest rank."""
    def med(vals):
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None
    names = dict.fromkeys(k for r in rounds for k in r.get("phases_max", {}))
    return dict(startup_s_median=med([r.get("startup_s") for r in rounds]),
                startup_cpu_sum_median=med([r.get("startup_cpu_sum") for r in rounds]),
                phases_median={k: med([r.get("phases_max", {}).get(k) for r in rounds]) for k in names})


# docs/BENCHMARKS.md's start-up per phase: (row, shardc's phase, FSDP2's phase), slowest rank's seconds
PHASE_ROWS = (("meta build", "build_s", "build_s"),
              ("capture (rank 0)", "capture_s", None),
              ("lowering, passes, codegen (rank 0)", "lowering_s", None),
              ("the plan on every rank (compiled / received / cache)", "plan_s", None),
              ("group construction", "groups_s", "groups_s"),
              ("fully_shard", None, "fully_shard_s"),
              ("allocation (shards; FSDP2's to_empty)", "allocation_s", "allocation_s"),
              ("values: init (shardc: incl. buffers-only init before a load)", "values_s", "init_s"),
              ("values: load", "load_s", "load_s"),
              ("first forward", "first_forward_s", "first_forward_s"))


def phase_table(paths: list[str]) -> None:
    """The start-up per phase (medians over the rounds) of result files, a column per system."""
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        systems = list(res["systems"])
        n = min(len(r.get("rounds", [r])) for r in res["systems"].values())       # rounds that ran
        print(f"| phase ({res['layers']} layers, {res['params'] / 1e6:.0f} M; median of {n}) | "
              + " | ".join(systems) + " |")
        print("|---|" + "---:|" * len(systems))
        for row, sk, fk in PHASE_ROWS:
            cells = []
            for s in systems:
                r = res["systems"][s]
                ph = dict(r.get("phases_median") or r.get("phases_max") or {})
                if "shard_s" in ph and "allocation_s" in ph:
                    ph["fully_shard_s"] = ph["shard_s"] - ph["allocation_s"]
                k = sk if s.startswith("shardc") else fk
                cells.append("—" if k is None or ph.get(k) is None else f"{ph[k]:.2f}")
            print(f"| {row} | " + " | ".join(cells) + " |")
        wall = [res["systems"][s].get("startup_s_median", res["systems"][s].get("startup_s")) for s in systems]
        cpu = [res["systems"][s].get("startup_cpu_sum_median", res["systems"][s].get("startup_cpu_sum")) for s in systems]
        print("| **start-up** (meta build to values ready, after a barrier) | "
              + " | ".join(f"**{w:.2f}**" for w in wall) + " |")
        print("| CPU seconds of start-up, 8 ranks together | "
              + " | ".join("-" if c is None else f"{c:.1f}" for c in cpu) + " |")
        print("| plan (rank 0) | " + " | ".join(str(res["systems"][s].get("plan_origin") or "—") for s in systems)
              + " |")


def phase_line(r: dict) -> str:
    ph = r.get("phases_max") or {}
    return ", ".join(f"{k[:-2]} {ph[k]:.2f}s" for k in PHASES if k in ph)


def explain(layers: int, algo: str | None = None, path: str = STRATEGY) -> dict:
    """`shardc explain --json` of zero3 on this model: its memory (`startup`, `total`, ...),
    its peak, and the note it prints (on stderr) when it cannot trace the model."""
    cmd = [sys.executable, "-m", "shardc.cli", "explain", os.path.relpath(path, ROOT),
           "--model", f"{os.path.relpath(B.__file__, ROOT)}:llama_{layers}", "--mesh", MESH, "--json",
           "--micro-batches", "1", "--tokens", str(TOKENS)] + (["--collectives", algo] if algo else [])
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise BadInput(f"shardc explain failed: {p.stderr.strip().splitlines()[-1:]}")
    rep = json.loads(p.stdout)
    return dict(command="shardc " + " ".join(cmd[3:]), memory=rep["memory"], peak=rep.get("peak"),
                collectives=rep.get("collectives"), note=p.stderr.strip())


def gib(b) -> str:
    return "-" if b is None else f"{b / GIB:.2f} GiB"


def driver(args) -> None:
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s.split("@")[0] not in SYSTEMS or
           ("@" in s and (not s.startswith("shardc") or parse_algo(s) not in ALGOS))]
    if bad:
        raise BadInput(f"unknown system {bad[0]!r}: use some of {','.join(SYSTEMS)}, a shardc one "
                       f"optionally @{'|@'.join(ALGOS)}")
    if args.layers < 1:
        raise BadInput(f"--layers must be at least 1, not {args.layers}")
    if not os.path.isfile(args.strategy):
        raise BadInput(f"--strategy {args.strategy}: no such file")
    ckpt = os.path.join(args.workdir, "dcp", ".metadata")
    loads = [s for s in systems if s.split("@")[0].endswith((":dcp", ":safetensors"))]
    saver = next((s for s in systems if s.startswith("shardc:init")), None)
    if loads and saver is None and not os.path.exists(ckpt):
        raise BadInput(f"{loads[0]} loads {args.workdir}/dcp, which no run saved: add shardc:init to --systems")
    need = int(args.need_gib * GIB) if args.need_gib else need_bytes(args.layers, args.step)
    p = n_params(args.layers)
    os.makedirs(args.workdir, exist_ok=True)
    res = dict(layers=args.layers, params=p, rounds=args.rounds, plan_cache=bool(args.plan_cache), world=WORLD, mesh=MESH, strategy=os.path.relpath(args.strategy, ROOT),
               fsdp2_wrap=args.fsdp2_wrap,
               step=args.step, tokens_per_rank=TOKENS, dtype="float32", torch=torch.__version__,
               machine=dict(mem_total=mem_total(), cpus=os.cpu_count()),
               whole_build=dict(bytes_per_rank=p * 4, bytes_all_ranks=WORLD * p * 4),
               need_estimate=need, floor=int(args.floor_gib * GIB), systems={})
    print(f"llama_{args.layers}: {p:,} parameters; built whole on {WORLD} ranks: "
          f"{WORLD} x {p * 4 / GIB:.2f} GiB = {WORLD * p * 4 / GIB:.1f} GiB of fp32 parameters "
          f"(the machine: {mem_total() / GIB:.1f} GiB)", flush=True)
    for rnd in range(args.rounds):
        if args.plan_cache:                    # each round's first shardc system compiles, the rest read its plan
            shutil.rmtree(args.plan_cache, ignore_errors=True)
        for s in systems:
            if s.split("@")[0].endswith(":safetensors") and not os.path.isdir(os.path.join(args.workdir, "hf")):
                if not os.path.exists(ckpt):
                    raise BadInput(f"{s} needs {args.workdir}/hf, made from the checkpoint shardc:init saves, "
                                   "but it saved none")
                res["prepare_hf"] = prepare_hf(args.layers, args.workdir)
                print(f"  prepared {args.workdir}/hf: {res['prepare_hf']}", flush=True)
            save = s == saver and rnd == 0 and (args.forward or bool(loads))
            if save:                           # it saves WORKDIR/dcp anew: the safetensors copy goes with the old one
                shutil.rmtree(os.path.join(args.workdir, "hf"), ignore_errors=True)
            r = run_system(s, args, need, save=save)
            r["round"] = rnd
            prev = res["systems"].get(s)
            rounds = (prev["rounds"] if prev else []) + [r]
            res["systems"][s] = dict(r, rounds=rounds, **medians(rounds))
            print(f"  {s} (round {rnd + 1}): start-up {r.get('startup_s') or 0:.1f}s ({r.get('startup_cpu_sum') or 0:.1f} "
                  f"CPU s over the ranks), plan {r.get('plan_origin')}, peak RSS start-up "
                  f"{gib(r.get('hwm_startup_max'))}, step {gib(r.get('hwm_step_max'))}, states "
                  f"{gib(r.get('states_max', r.get('states_ready_max')))}, norm {r.get('param_norm') or 0:.4f}, "
                  f"loss {r.get('loss_mean') or 0:.4f}", flush=True)
            print(f"    phases: {phase_line(r)}", flush=True)
            if args.json:                      # after every system: a later one that fails keeps these
                dump(res, args.json)
    res["init_rate"] = init_rate()
    print(f"  init in one process, one thread: {res['init_rate']['s_per_param'] * 1e9:.2f} s per 1e9 parameters "
          f"(a 7B model's 6.7e9: {res['init_rate']['derived_7b_s']:.0f} s)", flush=True)
    if not args.no_explain:
        algos = sorted({parse_algo(s) or "" for s in systems if s.startswith("shardc")})
        name = os.path.splitext(os.path.basename(args.strategy))[0]
        res["explain"] = {name + ("@" + a if a else ""): explain(args.layers, a or None, args.strategy) for a in algos}
        for a, e in res["explain"].items():
            print(f"  explain {a}: {e['memory']}", flush=True)
    if args.json:
        dump(res, args.json)


def table(paths: list[str]) -> None:
    """docs/BENCHMARKS.md's rows ("Start-up of big models") from result files."""
    print("| layers (params) | system | start-up (s) | peak RSS start-up (GiB) | peak RSS step (GiB) "
          "| model states (GiB) | explain start-up + import (GiB) | step-1 loss |")
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        for s, r in res["systems"].items():
            e = res.get("explain", {})
            name = os.path.splitext(os.path.basename(res["strategy"]))[0] + ("@" + parse_algo(s) if parse_algo(s) else "")
            e = e.get(name, {}) if s.startswith("shardc") else {}
            start = e.get("memory", {}).get("startup")
            step = (f"{r['hwm_step_max'] / GIB:.2f}" if r.get("hwm_step_max") else
                    f"stopped at {sum(r['killed']['ranks_rss']) / GIB:.1f} (8 ranks)" if r.get("killed") else "-")
            states = r.get("states_max") if res["step"] and r.get("states_max") else r.get("states_ready_max")
            states = f"{states / GIB:.2f}" + (" (start-up)" if res["step"] and not r.get("states_max") else "")
            told = "-" if start is None else f"{start / GIB:.2f} + {r['rss_imported_max'] / GIB:.2f}"
            loss = "-" if r.get("loss_mean") is None else f"{r['loss_mean']:.6f}"
            print(f"| {res['layers']} ({res['params'] / 1e6:.0f} M) | {s} | {r['startup_s']:.1f} "
                  f"| {r['hwm_startup_max'] / GIB:.2f} | {step} | {states} | {told} | {loss} |")


def dump(res: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


