"""The systems under test (bench stage: system name + model -> a trainable wrapper).

Input: a system name (`fsdp2:full`, `fsdp2:hsdp`, `ddp`, `shardc:<name>` or
`shardc:<path.shard>`, optionally `@ring|@hierarchical|@ho-ring|@auto` to
override the strategy's `collectives`), then suffixes ([Note: system suffixes]): any but
`ddp` optionally `+tp` or `+tpN` for tensor parallelism, [Note: +tp systems]; `fsdp2:full`
and shardc `+epN` for expert parallelism, [Note: +ep systems] in bench/peers/ep_systems.py; a peer
`+compile` for torch.compile, a shardc system `+inductor` for shardc's whole-step compiled
mode; `fsdp2+SUFFIX` is `fsdp2:full+SUFFIX`), the model, the cluster shape. Output: a `System` whose `micro(i)` context does what a user would write for gradient
accumulation, plus the model-state bytes each rank holds and the step's ledger (shardc) or
the peer's collectives derived from its known algorithm (bench/peers/ledgers.py).

[Note: +tp systems]
`NAME+tpN` (`+tp`: N = 2) runs NAME's data parallelism over the world's ranks divided by N,
with every block split over a `tp` dim of N by torch's `parallelize_module`
(`tensor_parallel` below). The world mesh is (node, gpu, tp) with tp innermost, so a tp
group is N consecutive ranks of one node and its traffic stays on loopback; the
data-parallel mesh is (node, gpu) of sizes (nodes, per_node / N). The N ranks of a tp group
read the same batch (`System.tp`: the worker picks batch `rank // tp`). FSDP2 is
`fully_shard` over the dp ranks (full: their flattened 1-D mesh; HSDP: (replicate=node,
shard=gpu)) on the TP model, torchtitan's DP x TP recipe; shardc is
`shardc.compile(model, strategy, mesh=world_mesh["node", "gpu"])`.
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from models import ROOT, block_list, block_modules
from peers.system import LR, System, adamw, fsdp2_pending_grad_bytes, state_bytes
import shardc.algorithms as algorithms
from shardc.dsl.ir import Collectives, MeshDims, Strategy

ALGOS = ("auto", *algorithms.names())     # `shardc:NAME@ALGO` overrides `collectives`




PEERS = ("fsdp2:full", "fsdp2:hsdp", "ddp",
         "deepspeed:zero1", "deepspeed:zero2", "deepspeed:zero3", "deepspeed:zeropp", "deepspeed:mics")   # bench/peers/ds_systems.py
TP_SUFFIX = re.compile(r"tp(\d*)")
EP_SUFFIX = re.compile(r"ep(\d*|gpu)")


# [Note: system suffixes]
# A system name is BASE[+SUFFIX...], the suffixes in any order, each at most once:
#   +tp, +tpN   tensor parallelism over N ranks of a node (+tp: N = 2), fsdp2 and shardc
#               systems ([Note: +tp systems]);
#   +ep, +epN, +epgpu  expert parallelism over N ranks of a node (+ep, +epgpu: all of them),
#               `fsdp2:full` and shardc systems on an MoE model, not with +tp, +compile or
#               +inductor ([Note: +ep systems] in bench/peers/ep_systems.py);
#   +compile    the peer under torch.compile as its users compile it: `fsdp2:*+compile`
#               compiles each block (`torch.compile(block, fullgraph=True)` put in its
#               place in the block list) and then applies `fully_shard` to the compiled
#               blocks and the root (torchtitan's order: apply_compile, then apply_fsdp);
#               `ddp+compile` is `torch.compile(DDP(model))` (DDPOptimizer splits the
#               graph at the buckets; run once on the tiny model, not benchmarked yet). Not for shardc systems: the whole-step mode is
#               +inductor, and `torch.compile` of a ShardedModule is bench/overhead.py's
#               `shardc+compile`.
#   +inductor   shardc only: `shardc.compile(..., backend="inductor")`, each micro-batch's
#               forward and backward one Inductor graph with the plan's collectives in it,
#               the step boundary one more (docs/compiler.md). It does not take DTensor
#               parameters (so no +tp) and already compiles the whole step (so no +compile).
# The compile happens in the first step, so a run's `--warmup` must be at least 1 for the
# timed steps to exclude it; the worker reports the warm-up steps' times (`warmup_times`).
# A bare `fsdp2` with a suffix is `fsdp2:full` (`fsdp2+tp`, `fsdp2+compile`).
@dataclass(frozen=True)
class SystemName:
    base: str                 # `fsdp2:full`, `ddp`, `shardc:zero3@ring`, ...
    tp: int = 1
    compile: bool = False     # +compile (peers)
    inductor: bool = False    # +inductor (shardc)
    ep: str = ""              # +epN: "N"; +ep, +epgpu: "gpu"; "" without EP


def parse_system(name: str) -> SystemName:
    """`shardc:zero3@ring+tp` -> SystemName(`shardc:zero3@ring`, tp=2); ValueError naming what
    is wrong ([Note: system suffixes])."""
    base, *suffixes = name.split("+")
    tp, flags, ep = None, set(), ""
    for suf in suffixes:
        m = TP_SUFFIX.fullmatch(suf)
        if m:
            if tp is not None:
                raise ValueError(f"system {name!r}: +tp given twice")
            tp = int(m.group(1) or 2)
        elif EP_SUFFIX.fullmatch(suf):
            if ep:
                raise ValueError(f"system {name!r}: +ep given twice")
            ep = EP_SUFFIX.fullmatch(suf).group(1) or "gpu"
        elif suf in ("compile", "inductor"):
            if suf in flags:
                raise ValueError(f"system {name!r}: +{suf} given twice")
            flags.add(suf)
        else:
            raise ValueError(f"system {name!r}: unknown suffix +{suf}: use +tp, +tpN, +epN, +epgpu, "
                             f"+compile (fsdp2, ddp) or +inductor (shardc)")
    if base == "fsdp2" and suffixes:
        base = "fsdp2:full"
    if base not in PEERS and not base.startswith("shardc:"):
        raise ValueError(f"unknown system {name!r}: use {', '.join(PEERS)}, shardc:<strategy>, "
                         f"optionally +tp or +tpN (fsdp2+tp = fsdp2:full+tp), +compile (fsdp2, ddp), "
                         f"+inductor (shardc)")
    tp = 1 if tp is None else tp
    if tp < 1 or (tp > 1 and base == "ddp"):
        raise ValueError(f"system {name!r}: +tpN takes N >= 1 and a fsdp2 or shardc system")
    shardc_ = base.startswith("shardc:")
    if "compile" in flags and shardc_:
        raise ValueError(f"system {name!r}: +compile is the peers' torch.compile recipe; a shardc system "
                         f"compiles the whole step with +inductor")
    if "inductor" in flags and not shardc_:
        raise ValueError(f"system {name!r}: +inductor is shardc's whole-step compiled mode; a peer takes +compile")
    if "inductor" in flags and tp > 1:
        raise ValueError(f"system {name!r}: the whole-step mode (+inductor) does not take tensor-parallel "
                         f"(DTensor) parameters yet")
    if ep and ((base != "fsdp2:full" and not shardc_) or tp > 1 or flags or ep == "0"):
        raise ValueError(f"system {name!r}: +epN takes N >= 1 and a fsdp2:full or shardc system, "
                         f"without +tp, +compile or +inductor")
    return SystemName(base, tp, compile="compile" in flags, inductor="inductor" in flags, ep=ep)


def compile_blocks(model: nn.Module) -> nn.Module:
    """torchtitan's `apply_compile`: each block replaced in its block list by
    `torch.compile(block, fullgraph=True)` ([Note: system suffixes])."""
    blocks = block_list(model)
    if blocks is None:
        raise ValueError("+compile compiles each block of the model's block list (its largest ModuleList); "
                         "the model has none")
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, fullgraph=True)
    return model


def fsdp2(model: nn.Module, nodes: int, per_node: int, hybrid: bool, tp: int = 1, compiled: bool = False) -> System:
    """FSDP2 `fully_shard` on each block, then the root (torchtitan's recipe); with `tp` > 1
    on the model split by `tensor_parallel` ([Note: +tp systems]); with `compiled`, each block
    compiled first ([Note: system suffixes])."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dp = per_node // tp
    shape, names = ((nodes, dp), ("replicate", "shard")) if hybrid else ((nodes * dp,), ("shard",))
    # HSDP's (replicate, shard): shard inside a node, replicate across nodes
    extra = {}
    if tp == 1:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    else:
        world = init_device_mesh("cpu", (*shape, tp), mesh_dim_names=(*names, "tp"))
        mesh = world[names]
        tensor_parallel(model, world["tp"])
        extra = {"mesh": [["node", nodes], ["gpu", dp]], "tp": tp, "unit_numels": local_unit_numels(model)}
    if compiled:
        compile_blocks(model)
    for block in block_modules(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def micro(i: int, last: bool):
        # The user's accumulation idiom: no reduce-scatter / all-reduce until the last.
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    opt = adamw(model.parameters())
    name = ("fsdp2:hsdp" if hybrid else "fsdp2:full") + (f"+tp{tp}" if tp > 1 else "") + ("+compile" if compiled else "")
    return System(name, model, opt, micro, memory=lambda: state_bytes(model, opt),
                  pending=lambda: fsdp2_pending_grad_bytes(model), tp=tp, extra=extra)


def ddp(model: nn.Module, compiled: bool = False) -> System:
    """DDP; with `compiled`, `torch.compile(DDP(model))` ([Note: system suffixes])."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(model)

    def micro(i: int, last: bool):
        return contextlib.nullcontext() if last else wrapped.no_sync()

    opt = adamw(wrapped.parameters())
    run = torch.compile(wrapped) if compiled else wrapped
    return System("ddp+compile" if compiled else "ddp", run, opt, micro, memory=lambda: state_bytes(wrapped, opt))


def strategy_path(spec: str) -> str:
    """`zero3` -> examples/strategies/zero3.shard; a path is returned as given."""
    if spec.endswith(".shard"):
        return spec
    return os.path.join(ROOT, "examples", "strategies", f"{spec}.shard")


def for_bench(strategy: Strategy, accumulate: int, algo: str | None = None) -> Strategy:
    """The strategy with the benchmark's `accumulate` (same for all systems), and with
    `collectives` set to `algo` when the system name asked for one (`NAME@ALGO`)."""
    return replace(strategy, accumulate=accumulate, collectives=Collectives(algo) if algo else strategy.collectives)


def shardc_system(model: nn.Module, spec: str, example, accumulate: int, nodes: int = 1,
                  per_node: int = 1, tp: int = 1, inductor: bool = False, ep: int = 1) -> System:
    import shardc

    spec, _, algo = spec.partition("@")
    if algo and algo not in ALGOS:
        raise ValueError(f"unknown collectives {algo!r} in shardc:{spec}@{algo}: use {', '.join(ALGOS)}")
    path = strategy_path(spec)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no strategy file {path}")
    mesh = None
    if tp > 1:      # [Note: +tp systems]
        from torch.distributed.device_mesh import init_device_mesh
        world = init_device_mesh("cpu", (nodes, per_node // tp, tp), mesh_dim_names=("node", "gpu", "tp"))
        tensor_parallel(model, world["tp"])
        mesh = world["node", "gpu"]
        strategy = shardc.load_strategy(path, mesh=MeshDims(("node", "gpu"), (nodes, per_node // tp)))
    elif ep > 1:    # [Note: +ep systems] in ep_systems.py
        from peers.ep_systems import ep_meshes, place_experts
        mesh, _, ep_mesh, _ = ep_meshes(nodes, per_node, ep)
        place_experts(model, ep_mesh)
        strategy = shardc.load_strategy(path, mesh=MeshDims(("node", "gpu"), (nodes, per_node)))
    else:
        strategy = shardc.load_strategy(path, world_size=dist.get_world_size())
    strategy = for_bench(strategy, accumulate, algo or None)
    sm = shardc.compile(model, strategy, example_inputs=(example,), mesh=mesh,
                        backend="inductor" if inductor else "eager")
    plan = getattr(sm, "plan", None)          # the resolved strategy (`collectives auto` decided)
    strategy = plan.strategy if plan is not None else strategy
    opt = sm.optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.1)

    def micro(i: int, last: bool):
        return contextlib.nullcontext()    # shardc does partial sync per its strategy

    def memory():
        return int(sm.memory_report()["total"])

    name = f"shardc:{spec}" + (f"@{algo}" if algo else "") + (f"+tp{tp}" if tp > 1 else "") + \
        ("+inductor" if inductor else "") + (f"+ep{ep}" if ep > 1 else "")
    return System(name, sm, opt, micro, ledger=sm.comm_ledger, reset_ledger=sm.reset_comm_ledger,
                  memory=memory, strategy=strategy, tp=tp,
                  extra={"mesh": [[l.name, l.size] for l in strategy.mesh.levels],
                         "expert_mesh": [[l.name, l.size] for l in strategy.expert_mesh.levels],
                         "collectives": strategy.collectives.value, "tp": tp, "ep": ep,
                         "backend": "inductor" if inductor else "eager"})


MICRO_BATCH = {}          # the worker's --micro-batch, which DeepSpeed's config must name


def build_system(name: str, model: nn.Module, nodes: int, per_node: int, example, accumulate: int) -> System:
    n = parse_system(name)
    if per_node % n.tp:
        raise ValueError(f"system {name!r}: tp {n.tp} does not divide the {per_node} ranks of a node")
    ep = 1
    if n.ep:
        from peers.ep_systems import ep_degree, fsdp2_ep
        ep = ep_degree(n.ep, per_node)
        if per_node % ep:
            raise ValueError(f"system {name!r}: ep {ep} does not divide the {per_node} ranks of a node")
        if n.base == "fsdp2:full":
            return fsdp2_ep(model, nodes, per_node, ep)
    if n.base in ("fsdp2:full", "fsdp2:hsdp"):
        return fsdp2(model, nodes, per_node, hybrid=n.base == "fsdp2:hsdp", tp=n.tp, compiled=n.compile)
    if n.base == "ddp":
        return ddp(model, compiled=n.compile)
    if n.base.startswith("deepspeed:"):
        from peers.ds_systems import deepspeed_system
        return deepspeed_system(n.base, model, nodes, per_node, accumulate, MICRO_BATCH.get("value", 1), adamw)
    return shardc_system(model, n.base.split(":", 1)[1], example, accumulate, nodes, per_node, n.tp, n.inductor, ep)


def tp_plan(block: nn.Module) -> dict[str, str]:
    """The TP plan of one block ([Note: the plan --tp assumes] in analysis/costmodel/tp.py):
    in each direct child holding two or more `nn.Linear`s, the last `rowwise`, the others
    `colwise`; {fqn inside the block: kind}."""
    plan = {}
    for cname, child in block.named_children():
        linears = [n for n, m in child.named_modules() if isinstance(m, nn.Linear)]
        if len(linears) >= 2:
            for k, lname in enumerate(linears):
                plan[".".join(p for p in (cname, lname) if p)] = "rowwise" if k == len(linears) - 1 else "colwise"
    return plan


def tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """Every block split over `tp_mesh` by `parallelize_module` with `tp_plan`; a split that
    would cut a head or a row unevenly is refused."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    heads = getattr(getattr(model, "cfg", None), "n_head", None)
    if heads is not None and heads % tp:
        raise ValueError(f"tensor parallelism over {tp} ranks needs the heads to split evenly; the model has {heads}")
    for block in block_modules(model):
        plan = tp_plan(block)
        for fqn, kind in plan.items():
            n = block.get_submodule(fqn).weight.shape[1 if kind == "rowwise" else 0]
            if n % tp:
                raise ValueError(f"tensor parallelism over {tp} ranks: {fqn} has {n} "
                                 f"{'inputs' if kind == 'rowwise' else 'outputs'}, which do not split evenly")
        parallelize_module(block, tp_mesh, {f: ColwiseParallel() if k == "colwise" else RowwiseParallel()
                                            for f, k in plan.items()})
    return model


def local_unit_numels(model: nn.Module) -> list[int]:
    """[Φ_root, Φ_block1, ...]: elements this rank holds per FSDP2 unit (DTensors: the local
    shard; tied parameters once) — bench/peers/ledgers.py's unit sizes on a TP model."""
    def numel(mod, skip=()):
        seen, n = set(skip), 0
        for p in mod.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        return n
    blocks = block_modules(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    return [numel(model, in_blocks)] + [numel(b) for b in blocks]
