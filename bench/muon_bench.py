"""Muon under four data-parallel layouts (bench stage: systems -> one table; issue 51).

Input: the bench GPT (bench/models.py `bench`: 4 blocks of d = 512, 16 block matrices),
`--world` gloo ranks, on this machine's loopback or with `--cluster RATE` on the emulated
cluster (bench/netns.py, root: one torchrun per node), mesh node(2) > gpu(world/2);
`--steps` timed steps after one warm-up. Output: per system, the median step time and
optimizer-step time (the slowest rank's), each rank's Newton–Schulz seconds (wall and
CPU), the model-state bytes per rank after the optimizer step (params + grads + optimizer
states; the largest rank's and the mean), the bytes per rank per level of one step, and
for shardc's tensor-owned scope each owner's Newton–Schulz seconds against explain's
FLOPs per owner; JSON to `--out`. `--owners-alone` times the owners' matrices in one
process instead.

[Note: Newton–Schulz in fp32]
torch.optim.Muon casts each matrix to bfloat16 for Newton–Schulz. On a CPU without a bf16
matrix unit (this one) that matmul is ~30x slower than fp32 (five iterations on 512x2048:
20.3 s against 0.68 s, one thread), which no GPU shows. `ns_in` makes Muon's one cast a
cast to `--ns-dtype` (default float32) for every system alike, and times each call.

[Note: the systems]
Muon (torch.optim.Muon's update, lr 0.02) on the blocks' matrices, AdamW on the rest,
against AdamW on everything, on the same layouts:
  - `shardc:owned`: params, grads, optim over the world, the blocks' optimizer states by
    tensor (`override "transformer.h.*" { optim shard over world by tensor }`); with
    AdamW `shardc:zero3` (the same without `by tensor`).
  - `fsdp2`: `fully_shard` per block and the root; Muon as its users write it
    (hao-ai-lab/FastVideo#1519): the momentum sharded like the parameter, the update
    matrix gathered whole on every rank (`full_tensor()`), Newton–Schulz on every rank,
    each rank keeping its own rows. Bytes: bench/peers/ledgers.py's FSDP2 records plus one
    all-gather of the matrices (fp32) per step.
  - `ddp`: DistributedDataParallel with torch.optim.Muon (every rank every matrix).
  - `shardc:replicate`: params, grads and optim replicate (DDP's layout; Muon steps views
    of the whole pieces on every rank).
Systems run interleaved, one step each per round, so the machine's load hits them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import batch, block_modules, build_model, n_params  # noqa: E402

MUON_LR, ADAMW_LR = 0.02, 3e-4
BLOCKS = "transformer.h."

OWNED = """\
mesh node(2) > gpu({g})
params shard over world
grads  shard over world
optim  shard over world
override "transformer.h.*" {{ optim shard over world by tensor }}
"""
ZERO3 = "mesh node(2) > gpu({g})\nparams shard over world\ngrads  shard over world\noptim  shard over world\n"
REPLICATE = "mesh node(2) > gpu({g})\nparams replicate\ngrads  replicate\noptim  replicate\n"


def ns_in(dtype: torch.dtype) -> None:
    """torch.optim.Muon's Newton–Schulz, run in `dtype` for every system ([Note: Newton–Schulz in fp32])."""
    import torch.optim._muon as m
    bf16 = m._zeropower_via_newtonschulz

    def ns(grad, coefficients, steps, eps):
        real, t, c = torch.Tensor.bfloat16, time.perf_counter(), time.thread_time()
        if dtype != torch.bfloat16:
            torch.Tensor.bfloat16 = lambda t: t.to(dtype)      # its one cast, made to `dtype`
        try:
            return bf16(grad, coefficients, steps, eps)
        finally:
            torch.Tensor.bfloat16 = real
            NS_SECONDS[0] += time.perf_counter() - t           # this rank's Newton–Schulz, summed
            NS_SECONDS[1] += time.thread_time() - c            # and its CPU seconds
    m._zeropower_via_newtonschulz = ns


NS_SECONDS = [0.0, 0.0]


def is_muon(name: str, p) -> bool:
    return name.startswith(BLOCKS) and p.dim() == 2


def optimizers(named, muon: bool):
    named = list(named)
    if not muon:
        return [torch.optim.AdamW([p for _, p in named], lr=ADAMW_LR, weight_decay=0.1)]
    return [torch.optim.Muon([p for n, p in named if is_muon(n, p)], lr=MUON_LR, weight_decay=0.1),
            torch.optim.AdamW([p for n, p in named if not is_muon(n, p)], lr=ADAMW_LR, weight_decay=0.1)]


class FullTensorMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update on FSDP2's DTensor parameters, the `full_tensor()` recipe
    ([Note: the systems])."""

    def __init__(self, params, lr=MUON_LR, weight_decay=0.1, momentum=0.95):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import distribute_tensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = st["momentum_buffer"]
                buf.lerp_(p.grad, 1 - g["momentum"])
                update = p.grad.lerp(buf, g["momentum"])                         # nesterov
                whole = _zeropower_via_newtonschulz(update.full_tensor(), (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                                                    DEFAULT_NS_STEPS, EPS)
                mine = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(mine, alpha=-_adjust_lr(g["lr"], None, p.shape))


def state_bytes(model, opts) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            total += g.numel() * g.element_size()
    for o in opts:
        for st in o.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    v = v.to_local() if hasattr(v, "to_local") else v
                    total += v.numel() * v.element_size()
    return total


def build(kind: str, muon: bool, world: int):
    """(module, optimizers, memory(), ledger records of one step or None, shardc module or None)."""
    import shardc
    model = build_model(_CFG.get("name", "bench"))
    g = world // 2
    if kind in ("shardc:owned", "shardc:zero3", "shardc:replicate"):
        text = {"shardc:owned": OWNED if muon else ZERO3,           # AdamW: the same layout, flat chunks
                "shardc:zero3": ZERO3, "shardc:replicate": REPLICATE}[kind].format(g=g)
        s = shardc.load_strategy(text)
        x, _ = batch(model, 0, 0, 0, 2)
        sm = shardc.compile(model, s, example_inputs=(x,))
        opts = optimizers(sm.named_parameters(), muon)
        return sm, opts, lambda: int(sm.memory_report()["total"]), sm
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        for b in block_modules(model):
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        named = list(model.named_parameters())
        if muon:
            opts = [FullTensorMuon([p for n, p in named if is_muon(n, p)]),
                    torch.optim.AdamW([p for n, p in named if not is_muon(n, p)], lr=ADAMW_LR, weight_decay=0.1)]
        else:
            opts = optimizers(named, False)
        return model, opts, lambda: state_bytes(model, opts), None
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(model)
        opts = optimizers(wrapped.module.named_parameters(), muon)
        return wrapped, opts, lambda: state_bytes(wrapped, opts), None
    raise ValueError(kind)


def peer_records(kind: str, muon: bool, model, world: int):
    from peers.ledgers import ddp_ledger, fsdp2_ledger, unit_numels
    from shardc.lowering import LedgerRecord as Rec
    sizes = unit_numels(model)
    if kind == "ddp":
        return ddp_ledger(sizes)
    recs = fsdp2_ledger(sizes, world // 2, 1, hybrid=False)
    if muon:       # the full_tensor() of every matrix's update, fp32, once per step
        phi = sum(p.numel() for n, p in model.named_parameters() if is_muon(n, p))
        recs.append(Rec("update", "all_gather", ("node", "gpu"), 4 * phi, 1))
    return recs


def step(module, opts, rank, k, micro_batch, measure=None):
    """(step seconds, each optimizer's step() seconds + this rank's Newton–Schulz seconds,
    `measure()` taken after the optimizers' steps, before zero_grad: the grads still held)."""
    x, y = batch(_CFG["model"], k, 0, rank, micro_batch)
    t0 = time.perf_counter()
    logits = module(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    each, NS_SECONDS[:] = [], [0.0, 0.0]
    for o in opts:
        t = time.perf_counter()
        o.step()
        each.append(time.perf_counter() - t)
    t = time.perf_counter()
    held = measure() if measure is not None else None
    t0 += time.perf_counter() - t                             # not timed
    for o in opts:
        o.zero_grad()
    return time.perf_counter() - t0, each + NS_SECONDS, held


_CFG = {}


def worker(rank, world, args, port=None):
    """One rank; `port` None: launched by torchrun (the emulated cluster), env:// rendezvous."""
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.environ.get("MUON_BENCH_STACKS"):       # a hang's stacks after that many seconds
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["MUON_BENCH_STACKS"]), exit=True)
    torch.set_num_threads(1)
    ns_in(getattr(torch, args.ns_dtype))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from shardc.analysis.costmodel import link_bytes
    import shardc
    _CFG["name"] = args.model
    _CFG["model"] = build_model(args.model)
    mesh = shardc.load_strategy(ZERO3.format(g=world // 2)).mesh
    systems = [(k, m) for m in (True, False) if ("muon" if m else "adamw") in args.optimizers for k in args.systems]
    built = {s: build(s[0], s[1], world) for s in systems}
    times = {s: [] for s in systems}
    opt_times = {s: [] for s in systems}
    mems = {}
    for r in range(args.steps + 1):
        for s in systems:
            if args.verbose and rank == 0:
                print(f"round {r} {s}", flush=True)
            module, opts, memory, sm = built[s]
            if sm is not None and r == args.steps:
                sm.reset_comm_ledger()
            dist.barrier()
            t, each, mems[s] = step(module, opts, rank, r, args.micro_batch, memory if r == args.steps else None)
            if r:                                 # round 0 is the warm-up
                times[s].append(t)
                opt_times[s].append(each)
    out = {}
    for s in systems:
        module, opts, memory, sm = built[s]
        mem = mems[s]                             # the last step's, grads held
        recs = sm.comm_ledger() if sm is not None else peer_records(s[0], s[1], _CFG["model"], world)
        links = link_bytes(recs, mesh)
        first = statistics.median(e[0] for e in opt_times[s])      # Muon's (or AdamW-only) step
        ns = statistics.median(e[-2] for e in opt_times[s])         # its Newton–Schulz alone, wall
        ns_cpu = statistics.median(e[-1] for e in opt_times[s])     # and CPU
        t = torch.tensor([statistics.median(times[s]), statistics.median(sum(e[:-2]) for e in opt_times[s]),
                          float(mem), first, ns, ns_cpu])
        allt = [torch.zeros(6) for _ in range(world)]
        dist.all_gather(allt, t)
        out[f"{s[0]} {'muon' if s[1] else 'adamw'}"] = dict(
            step_s=max(float(a[0]) for a in allt), opt_step_s=max(float(a[1]) for a in allt),
            state_bytes_max=max(int(a[2]) for a in allt),
            state_bytes_mean=sum(int(a[2]) for a in allt) / world, link_bytes=links,
            first_opt_step_s_per_rank=[float(a[3]) for a in allt],
            step_s_per_rank=[float(a[0]) for a in allt], ns_s_per_rank=[float(a[4]) for a in allt],
            ns_cpu_s_per_rank=[float(a[5]) for a in allt])
    # each owner's Muon step in the run above, against the plan's cost per owner
    sm = built[("shardc:owned", True)][3] if ("shardc:owned", True) in built else None
    if sm is not None:
        grp = next(g for g in _owned_plan_of(sm).groups if g.matrices)        # the remainder: no NS
        from shardc.analysis.costmodel.owned import ns_step_flops
        per_owner = [sum(ns_step_flops(t.shape) for t in grp.tensors if t.owner == r) for r in range(world)]
        out["owners"] = dict(measured_s=out["shardc:owned muon"]["ns_s_per_rank"],
                             cpu_s=out["shardc:owned muon"]["ns_cpu_s_per_rank"],
                             explain_flops=per_owner,
                             matrices=[sum(1 for t in grp.tensors if t.owner == r) for r in range(world)])
    if rank == 0:
        out["meta"] = dict(world=world, steps=args.steps, micro_batch=args.micro_batch, model=args.model,
                           params=n_params(_CFG["model"]), torch=torch.__version__, loaded_machine=True,
                           ns_dtype=args.ns_dtype, link=args.link or "loopback",
                           muon_params=sum(p.numel() for n, p in _CFG["model"].named_parameters() if is_muon(n, p)))
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


def _owned_plan_of(sm):
    for p in sm.parameters():                     # the plan lives on the parameter set
        return p._shardc_set.owned_plan


def owners_alone(model_name: str, worlds, rounds: int, ns_steps: int = 5) -> dict:
    """Each owner's Newton–Schulz time (wall and this thread's CPU) measured alone, one process,
    one thread: per world,
    the plan's owners (lowering/owned.py, as explain prints them) under the tensor-owned
    zero3 layout, the owners timed in turn each round (interleaved), medians."""
    import shardc
    from shardc.analysis.costmodel.owned import owned_of, ns_step_flops
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz
    torch.set_num_threads(1)
    model = build_model(model_name)
    out = {}
    for world in worlds:
        grp = next(g for g in owned_of(shardc.load_strategy(OWNED.format(g=world // 2)), model).plan.groups
                   if g.matrices)
        mats = {r: [torch.randn(t.shape) for t in grp.tensors if t.owner == r] for r in range(world)}
        times = {r: [] for r in range(world)}
        cpu = {r: [] for r in range(world)}
        for _ in range(rounds):
            for r in range(world):
                t, c = time.perf_counter(), time.thread_time()
                for m in mats[r]:
                    _zeropower_via_newtonschulz(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), ns_steps, EPS)
                times[r].append(time.perf_counter() - t)
                cpu[r].append(time.thread_time() - c)
        out[str(world)] = dict(measured_s=[statistics.median(times[r]) for r in range(world)],
                               cpu_s=[statistics.median(cpu[r]) for r in range(world)],
                               explain_flops=[sum(ns_step_flops(t.shape) for t in grp.tensors if t.owner == r)
                                              for r in range(world)],
                               matrices=[len(mats[r]) for r in range(world)],
                               plan_cost_imbalance=grp.imbalance())
    return out


def table(doc: dict) -> str:
    """The JSON as the markdown table docs/BENCHMARKS.md shows."""
    mib = 2 ** 20
    rows = ["| system | optimizer | step (s) | opt.step() (s) | Newton–Schulz, max over ranks: wall (s) | CPU (s) "
            "| model states / rank, max (bytes) | mean (bytes) | node link / rank (MiB) | gpu link / rank (MiB) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for k, v in doc.items():
        if k in ("owners", "meta"):
            continue
        system, opt = k.rsplit(" ", 1)
        if system == "shardc:owned" and opt == "adamw":
            system = "shardc:zero3 (flat)"
        ns, cpu = max(v.get("ns_s_per_rank", [0.0])), max(v.get("ns_cpu_s_per_rank", [0.0]))
        wall_cpu = f"{ns:.3f} | {cpu:.3f}" if ns else "— | —"
        rows.append(f"| {system} | {opt} | {v['step_s']:.3f} | {v['opt_step_s']:.3f} | {wall_cpu} | "
                    f"{v['state_bytes_max']:,} | {v['state_bytes_mean']:,.0f} | "
                    f"{v['link_bytes'].get('node', 0) / mib:.1f} | {v['link_bytes'].get('gpu', 0) / mib:.1f} |")
    o = doc.get("owners")
    if o:
        cpu = o.get("cpu_s") or [float("nan")] * len(o["measured_s"])
        mean_t, mean_c = (sum(v) / len(v) for v in (o["measured_s"], cpu))
        mean_f = sum(o["explain_flops"]) / len(o["explain_flops"])
        rows.append("")
        rows.append("| owner | matrices | explain: Newton–Schulz FLOPs (vs mean) | Newton–Schulz in the run, median "
                    "(s, vs mean) | its CPU s (vs mean) |")
        rows.append("|---|---|---|---|---|")
        for r, (n, f, t, c) in enumerate(zip(o["matrices"], o["explain_flops"], o["measured_s"], cpu)):
            rows.append(f"| {r} | {n} | {f:.3g} ({100 * (f / mean_f - 1):+.1f} %) | "
                        f"{t:.3f} ({100 * (t / mean_t - 1):+.1f} %) | {c:.3f} ({100 * (c / mean_c - 1):+.1f} %) |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--systems", nargs="+", default=["shardc:owned", "fsdp2", "ddp", "shardc:replicate"])
    ap.add_argument("--optimizers", nargs="+", choices=("muon", "adamw"), default=["muon", "adamw"],
                    help="Muon + AdamW, AdamW alone, or both (default)")
    ap.add_argument("--out", default="muon_bench.json")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--model", default="bench", help="a bench/models.py preset (default bench)")
    ap.add_argument("--owners-alone", type=int, nargs="*", metavar="WORLD",
                    help="only time each owner's Newton-Schulz alone at these world sizes (one process)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ns-steps", type=int, default=5,
                    help="Newton-Schulz iterations timed per matrix (each is the same work; default Muon's 5)")
    ap.add_argument("--table", metavar="JSON", help="print a result file as docs/BENCHMARKS.md's table and exit")
    ap.add_argument("--ns-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="Newton-Schulz's dtype for every system ([Note: Newton–Schulz in fp32]; torch's is bfloat16)")
    ap.add_argument("--cluster", metavar="RATE", help="run on the emulated cluster (bench/netns.py, root), "
                    "node(2) > gpu(world/2), inter-node links at RATE (e.g. 250mbit); default loopback")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the --cluster job")
    ap.add_argument("--from-env", action="store_true", help=argparse.SUPPRESS)   # a torchrun rank
    ap.add_argument("--link", help=argparse.SUPPRESS)                              # its cluster's rate
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return
    if args.from_env:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    if args.owners_alone:
        ns_in(getattr(torch, args.ns_dtype))
        doc = {"owners_alone": owners_alone(args.model, args.owners_alone, args.rounds, args.ns_steps),
               "meta": dict(model=args.model, rounds=args.rounds, threads=1, torch=torch.__version__,
                            ns_steps=args.ns_steps, ns_dtype=args.ns_dtype, loaded_machine=True)}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        return
    port = 29500 + os.getpid() % 1000
    if not args.cluster:
        mp.spawn(worker, args=(args.world, args, port), nprocs=args.world, join=True)
        return
    from launch import run_job
    from netns import ClusterSpec, EmulatedCluster, require_root_and_tools
    require_root_and_tools()
    flags = [a for a in (argv if argv is not None else sys.argv[1:])]
    i = flags.index("--cluster")
    flags = flags[:i] + flags[i + 2:] + ["--from-env", "--link", args.cluster, "--out", args.out]
    with EmulatedCluster(ClusterSpec(2, args.world // 2, args.cluster)) as cluster:
        job = run_job(cluster, os.path.abspath(__file__), flags, os.path.dirname(args.out),
                      "muon_bench", port, args.timeout)
    print(f"{'ok' if job.ok else 'FAILED'} in {job.seconds:.0f} s; logs {', '.join(job.logs)}")
    if not job.ok:
        print(job.tail())
        sys.exit(1)


if __name__ == "__main__":
    main()
