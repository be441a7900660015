"""torchtitan's DeepSeek-V3 MoE with torchtitan's own expert parallelism under shardc, end to end (information; torchtitan is no test dependency).

    PY=/tmp/tt-venv/bin/python   # torch 2.13 CPU + torchtitan 0.3.0; shardc: pip install --no-deps -e .
    $PY -m torch.distributed.run --nproc-per-node 4 bench/clients/torchtitan_moe_check.py --check all
    $PY -m torch.distributed.run --nproc-per-node 4 bench/clients/torchtitan_moe_check.py --check parity --experts-dtype fp32
    $PY -m torch.distributed.run --nproc-per-node 4 bench/clients/torchtitan_moe_check.py --check parity --micro 2 --buffers local
    $PY -m torch.distributed.run --nproc-per-node 8 bench/clients/torchtitan_moe_check.py --check parity --global-batch 16
    $PY -m torch.distributed.run --nproc-per-node 8 bench/clients/torchtitan_moe_check.py --check bias   --global-batch 16
    $PY -m torch.distributed.run --nproc-per-node 8 bench/clients/torchtitan_moe_check.py --check ledger --global-batch 16
    $PY -m torch.distributed.run --nproc-per-node 4 bench/clients/torchtitan_moe_check.py --check ledger --entry compile
    (`--json OUT` appends the run to OUT's "runs"; at 8 ranks run the checks apart: every
    ShardedModule built and dropped keeps ~150 MiB per rank alive, and `all` ran out of 23 GiB)

Stage: torchrun ranks (gloo, CPU) -> one line per check on rank 0 (and `--json OUT`). The
model is torchtitan's DeepSeek-V3 `debugmodel` (graph_trainer's model registry, SDPA, fp32;
layer 0 dense, layers 1-5 MoE: 8 routed experts, top-3, a shared expert, the auxiliary-
loss-free load balancing buffers `moe.expert_bias_E` and `moe.tokens_per_expert_E`).
`--layers N` keeps the first N layers. torchtitan's own EP: `ParallelDims(dp_shard=-1,
ep=EP, spmd_backend="partial_dtensor")` (gloo needs that backend: spmd_types' all-to-all
takes equal splits only) with `parallel_dims.device_type = "cpu"`, the model config's
`update_from_config(ParallelismConfig(expert_parallel_degree=EP))` and `model.parallelize
(pd)` (EP only, no FSDP): the experts `layers.N.moe.routed_experts.inner_experts.w1_EFD /
w2_EDF / w3_EFD` become DTensors Shard(0) on the 1-D ('ep',) mesh, a slice of torchtitan's
('world',) mesh whose innermost EP ranks form each ep group; the tokens go through its
AllToAllTokenDispatcher. shardc gets `mesh=` that world mesh unflattened into
(node, gpu) = "node(2) > gpu(W/2)", and the strategies of examples/strategies/moe/ with
the experts' pattern "*.inner_experts" (dataclasses.replace on `Strategy.experts`) and
`accumulate` = `--micro`: `shard_module(model, s, find_units(model, resolve_bucket(model,
s)), mesh=dp)`. Every run starts from the reference's initial values (torchtitan's
`init_weights` on the plain model, seed 0: the EP model's local experts are copied in).

The experts compute in bf16: torchtitan's GroupedExperts casts x and w1/w2/w3 to bf16 for
`torch._grouped_mm` whatever the model's dtype, with no flag to turn it off.
`--experts-dtype bf16` (default) keeps that; `fp32` patches GroupedExperts.forward to skip
the casts (a diagnostic, on both sides). The reference is one process on the concatenated
batch, with torchtitan's load-balancing hook on its optimizer (no mesh: its own counts).
Errors are relative: max over entries of ||a - b|| / ||b||. The floor is the same error
between the reference and one process that accumulates the gradient over `world` x
`--micro` chunks of each batch (what data parallelism sums, in another order: with bf16
experts each chunk's expert gradient is rounded to bf16 on its own); a check passes at
max(1e-5, 3 x floor). References are computed by ranks 0 and 1 (one optimizer each) and
compared there.

parity  the four strategies (ep2_zero3 and hpz_ep2: ep 2; ep_zero3 and
        paro_iig_ep_zero1: ep = gpu) x AdamW and SGD+momentum, `--steps` steps of
        `--micro` micro-batches, `sm.clip_grad_norm_(--clip)`, torchtitan's load-balancing
        hook on `sm.optimizer(...)` (model_parts [sm.module], torchtitan's ParallelDims):
        the mean loss per step (pass mark max(1e-6, 3 x floor)), the parameters of
        `sm.full_state_dict()` (keys equal and in order), the counts the hook
        all-reduces each step and every layer's expert_bias_E on every rank (exact)
        against the reference.
bias    the load-balancing state under shardc: ep2_zero3, SGD, 2 micro-batches (and 1),
        `buffers broadcast` (the default: rank 0's buffers before every training forward)
        and `buffers local`, torchtitan's hook on `sm.optimizer(...)` or none: per step,
        the counts the hook all-reduces (the sum over ranks of each rank's
        tokens_per_expert_E just before it) against the reference's, and expert_bias_E on
        every rank against the reference's. Also: which model_parts the hook takes, and
        that `register_step_pre_hook` fires on the optimizer `sm.optimizer` returns.
ledger  each strategy, one SGD step (`--micro` micro-batches, clip): `sm.comm_ledger()`
        equal to `predict_ledger(strategy, model_units(strategy, meta_model),
        micro_batches, clip_grad_norm=True)` on the plain model built on the meta device
        (global expert shapes; explain cuts them by ep), and `sm.memory_report()` against
        `predict_memory` (reported). torchtitan's own all-to-alls and the hook's
        all-reduce are not shardc's and are in neither.
all     parity, bias and ledger in one launch.
`--entry compile` builds with `shardc.compile(model, s, example_inputs, mesh=dp)` instead.

Found (2026-11-27, bench/results/systems_100gbit_2026-11-27_torchtitan-moe-check.json): torchtitan's
load-balancing state is right under shardc when its hook is registered on the optimizer
`sm.optimizer(...)` returns (a plain torch optimizer: `register_step_pre_hook` fires) with
model_parts `[sm.module]` (`[sm]` raises AttributeError at registration) and torchtitan's
ParallelDims, and the strategy says `buffers local`, or `accumulate 1`. Under the default
`buffers broadcast` with two or more micro-batches a step, rank 0's tokens_per_expert_E
overwrites every rank's before each micro-batch after the first, so the counts the hook
all-reduces are wrong and expert_bias_E leaves the one-process run's (the same on every
rank, no error). Without the hook the counts only grow and the bias stays 0.

Every check ends with a line `CHECK: all ok` or `CHECK: FAILED` and exits 0 or 1.
Without torchtitan every check prints one sentence saying so and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import gc  # noqa: E402

from titan_common import (OPTIMS, error, gather, get_world, jsonable, plain, say, tol,  # noqa: E402
                          two_level, verdict)
from titan_moe import (ROOT, STRATEGIES, Refs, biases, build, compare_state, counts, hook,  # noqa: E402
                       loss_tol, setup_titan, sharded, strategy, train_sharded)
sys.path[:0] = [ROOT]

CHECKS = ("parity", "bias", "ledger", "all")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", choices=CHECKS, required=True)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps")
    p.add_argument("--micro", type=int, default=1, help="micro-batches per step (the strategies' accumulate)")
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm (0: none)")
    p.add_argument("--layers", type=int, default=6, help="keep the first N layers of the debug model (6)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    p.add_argument("--experts-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: torchtitan's GroupedExperts as is; fp32: its casts patched out (both sides)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="parity, ledger: which")
    p.add_argument("--buffers", choices=("broadcast", "local"), default=None,
                   help="parity, ledger: the strategies' `buffers` (default: theirs, broadcast)")
    p.add_argument("--entry", choices=("shard_module", "compile"), default="shard_module",
                   help="shard_module(model, s, find_units(...), mesh=dp) or shardc.compile(model, s, mesh=dp)")
    p.add_argument("--json", dest="json_out", default=None, help="append this run to OUT's runs (rank 0)")
    return p.parse_args(argv)


def bias_report(per_rank: list, ref: list) -> dict:
    """per_rank[r][step]: (layers, E) biases; the largest difference to the reference, and
    whether every rank holds the same."""
    import torch
    same = all(torch.equal(a, b) for pr in per_rank for a, b in zip(pr, per_rank[0]))
    diff = max(float((b - ref[i]).abs().max()) for pr in per_rank for i, b in enumerate(pr))
    per_step = [max(float((pr[i] - ref[i]).abs().max()) for pr in per_rank) for i in range(len(ref))]
    return dict(bias_same_on_all_ranks=same, bias_max_abs_diff=diff, bias_diff_per_step=per_step)


def counts_report(per_rank: list, ref: list) -> dict:
    """per_rank[r][step]: (layers, E) tokens_per_expert_E just before torchtitan's hook; their
    sum over ranks (what the hook all-reduces) against the reference's, in tokens per step."""
    summed = [sum(pr[i] for pr in per_rank) for i in range(len(ref))]
    per_step = [int((summed[i] - ref[i]).abs().max()) for i in range(len(ref))]
    return dict(counts_diff_per_step=per_step, counts_equal=not any(per_step))


def check_parity(args, init_model) -> dict:
    world = get_world()
    init = {n: p.detach() for n, p in init_model.named_parameters()}
    refs = Refs(args, init_model, {kind: (kind, args.micro) for kind in OPTIMS})
    out = {}
    for kind in OPTIMS:
        f = refs.fig[kind]
        out[f"floor/{kind}"] = dict(params=f["floor"], loss=f["floor_loss"], bias=f["floor_bias"],
                                    ref_loss=f["loss"], ref_grad_norm=f["grad_norm"], ok=True)
        say(f"parity floor {kind}: one process accumulating {world}x{args.micro} chunks vs the concatenated batch, "
            f"{args.steps} steps, experts {args.experts_dtype}, buffers {args.buffers or 'broadcast'}, {args.entry}: "
            f"params max rel err {f['floor']:.2e} (pass mark "
            f"{tol(f['floor']):.1e}), loss {f['floor_loss']:.1e}, bias {f['floor_bias']:.1e}; reference loss "
            f"{', '.join(f'{x:.4f}' for x in f['loss'])}, grad norm {', '.join(f'{x:.3f}' for x in f['grad_norm'])} "
            f"(clip {args.clip}) (references {refs.seconds:.0f} s)")
    for name in args.strategies.split(","):
        for kind in OPTIMS:
            f = refs.fig[kind]
            try:
                t0 = time.perf_counter()
                s = strategy(name, args.micro, args.buffers)
                sm, pd = sharded(args, s, init)
                opt = sm.optimizer(_cls(kind), **OPTIMS[kind][1])
                seen, bias = [], []
                opt.register_step_pre_hook(lambda *a: seen.append(counts(sm.module)))    # before torchtitan's
                hook(opt, sm.module, pd)
                t1 = time.perf_counter()
                losses = train_sharded(args, sm, opt, args.micro, on_step=lambda: bias.append(biases(sm.module)))
                t2 = time.perf_counter()
                keys, err, where, n = compare_state(refs, kind, plain(sm.full_state_dict()), params_only=True)
                br = bias_report(gather(bias), f["bias"]) | counts_report(gather(seen), f["counts"])
                lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, f["loss"]))
                r = dict(mesh=two_level(world), ep=s.experts.ep, keys_equal=keys, max_rel_err=err, worst=where,
                         loss=losses, loss_rel_err=lerr, **br, compile_s=t1 - t0, train_s=t2 - t1)
                r["bias_equal"] = br["bias_max_abs_diff"] <= max(1e-7, f["floor_bias"])
                r["ok"] = keys and err <= tol(f["floor"]) and lerr <= loss_tol(f["floor_loss"]) and \
                    br["bias_same_on_all_ranks"] and r["bias_equal"] and br["counts_equal"]
                del sm, opt
                gc.collect()
            except Exception as e:                      # noqa: BLE001 — reported, the others go on
                r = error(e, every_rank=True)
            out[f"{name}/{kind}"] = r
            if "error" in r:
                say(f"parity {name:<17} {kind:<5}: {r['error']}  FAIL")
                continue
            say(f"parity {name:<17} {kind:<5} ep {r['ep']} on {r['mesh']} ({world} ranks): keys equal {keys} ({n}), "
                f"params max rel err {err:.2e} ({where.removeprefix('layers.')}), loss rel err {lerr:.1e}, counts "
                f"the hook all-reduces minus the reference's {br['counts_diff_per_step']} tokens, expert_bias same on "
                f"all ranks {br['bias_same_on_all_ranks']}, max |diff| to the reference {br['bias_max_abs_diff']:.1e}"
                f"; "
                f"compile {r['compile_s']:.1f} s, {args.steps} steps {r['train_s']:.1f} s  {verdict(r['ok'])}")
    return out


def _cls(kind: str):
    import torch
    return getattr(torch.optim, OPTIMS[kind][0])


def check_bias(args, init_model) -> dict:
    """The load-balancing buffers under `buffers broadcast` / `local`, with and without
    torchtitan's hook (see the module docstring)."""
    import torch
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    world = get_world()
    init = {n: p.detach() for n, p in init_model.named_parameters()}
    refs = Refs(args, init_model, {2: ("sgd", 2), 1: ("sgd", 1)})
    out = {}
    # which model_parts the hook takes, and whether it fires on sm.optimizer's optimizer
    s = strategy("ep2_zero3", 1)
    sm, pd = sharded(args, s, init)
    opt = sm.optimizer(_cls("sgd"), **OPTIMS["sgd"][1])
    try:
        register_moe_load_balancing_hook(opt, [sm], pd)
        on_sm = "registered"
    except Exception as e:                              # noqa: BLE001
        on_sm = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    fired = []
    opt.register_step_pre_hook(lambda *a: fired.append(1))
    train_sharded(args, sm, opt, 1, steps=1)
    bufs = {n: (tuple(b.shape), str(b.dtype), b.numel() * b.element_size()) for n, b in sm.module.named_buffers()}
    r = dict(optimizer_type=f"{type(opt).__module__}.{type(opt).__qualname__}",
             is_torch_optimizer=isinstance(opt, torch.optim.Optimizer), pre_hook_fired=len(fired),
             hook_with_model_parts_sm=on_sm, buffer_bytes_broadcast_per_forward=sum(v[2] for v in bufs.values()),
             buffers=len(bufs), ok=bool(fired))
    out["hook"] = r
    del sm, opt
    gc.collect()
    say(f"bias hook: sm.optimizer(SGD) is {r['optimizer_type']} (a torch.optim.Optimizer: {r['is_torch_optimizer']}), "
        f"a register_step_pre_hook fired {r['pre_hook_fired']}x in 1 step; register_moe_load_balancing_hook(opt, "
        f"[sm], pd): {on_sm} (use [sm.module]); `buffers broadcast` moves {len(bufs)} buffers, "
        f"{r['buffer_bytes_broadcast_per_forward'] / 2**20:.2f} MiB, before every training forward  "
        f"{verdict(r['ok'])}")
    for micro, buffers, with_hook in ((2, "broadcast", True), (2, "local", True), (1, "broadcast", True),
                                      (1, "local", True), (2, "broadcast", False)):
        tag = f"micro{micro}/{buffers}/{'hook' if with_hook else 'no-hook'}"
        f = refs.fig[micro]
        try:
            s = strategy("ep2_zero3", micro, buffers)
            sm, pd = sharded(args, s, init)
            opt = sm.optimizer(_cls("sgd"), **OPTIMS["sgd"][1])
            seen, bias = [], []
            opt.register_step_pre_hook(lambda *a: seen.append(counts(sm.module)))    # before torchtitan's
            if with_hook:
                hook(opt, sm.module, pd)
            losses = train_sharded(args, sm, opt, micro, on_step=lambda: bias.append(biases(sm.module)))
            keys, err, where, n = compare_state(refs, micro, plain(sm.full_state_dict()), params_only=True)
            per_rank_counts = gather(seen)
            summed = [sum(pr[i] for pr in per_rank_counts) for i in range(args.steps)]
            cdiff = max(float((summed[i] - f["counts"][i]).abs().max()) for i in range(args.steps))
            br = bias_report(gather(bias), f["bias"])
            lerr = max(abs(a - b) / abs(b) for a, b in zip(losses, f["loss"]))
            r = dict(micro=micro, buffers=buffers, hook=with_hook, counts_allreduced_max_abs_diff=cdiff,
                     counts_equal=cdiff == 0.0, **br, loss_rel_err=lerr, max_rel_err=err, worst=where,
                     floor=f["floor"], floor_bias=f["floor_bias"])
            r["bias_equal"] = br["bias_same_on_all_ranks"] and br["bias_max_abs_diff"] <= max(1e-7, f["floor_bias"])
            r["ok"] = True                   # information: which setting agrees is the finding
            del sm, opt
            gc.collect()
        except Exception as e:                          # noqa: BLE001
            r = error(e, every_rank=True)
        out[tag] = r
        if "error" in r:
            say(f"bias {tag}: {r['error']}")
            continue
        say(f"bias {tag:<26} ({world} ranks, ep2_zero3, SGD): counts the hook all-reduces = the reference's "
            f"{r['counts_equal']} (max |diff| {cdiff:.0f} tokens); expert_bias same on all ranks "
            f"{br['bias_same_on_all_ranks']}, = the reference's {r['bias_equal']} (max |diff| per step "
            f"{', '.join(f'{x:.1e}' for x in br['bias_diff_per_step'])}); parameters max rel err {err:.2e} "
            f"({where.removeprefix('layers.')}; floor {f['floor']:.1e}), loss rel err {lerr:.1e}")
    good = out["micro2/local/hook"].get("bias_equal") and out["micro1/broadcast/hook"].get("bias_equal")
    out["ok"] = bool(good) and out["hook"]["ok"]
    return out


def check_ledger(args, init_model) -> dict:
    import torch
    from shardc.analysis.costmodel import predict_ledger, predict_memory
    from shardc.analysis.costmodel.report import model_units
    world = get_world()
    init = {n: p.detach() for n, p in init_model.named_parameters()}
    out = {}
    for name in args.strategies.split(","):
        try:
            s = strategy(name, args.micro, args.buffers)
            sm, pd = sharded(args, s, init)
            opt = sm.optimizer(_cls("sgd"), **OPTIMS["sgd"][1])
            hook(opt, sm.module, pd)
            train_sharded(args, sm, opt, args.micro, steps=1)
            ledger = list(sm.comm_ledger())
            memory = dict(sm.memory_report())
            units = model_units(s, build(args, device="meta"))
            predicted = predict_ledger(s, units, micro_batches=args.micro, clip_grad_norm=bool(args.clip))
            p_mem = predict_memory(s.mesh, units, optimizer="sgd", optimizer_kwargs={"momentum": 0.9})
            keys = ("params", "params_secondary", "grads", "optim", "total")
            mem_eq = {k: p_mem[k] for k in keys} == {k: memory[k] for k in keys}
            ok = ledger == predicted
            extra = [r for r in ledger if r not in predicted]
            missing = [r for r in predicted if r not in ledger]
            r = dict(ep=s.experts.ep, records=len(ledger), expert_records=sum(x.over == "experts" for x in ledger),
                     bytes=sum(x.bytes * x.count for x in ledger), equal=ok, memory_equal=mem_eq,
                     measured_not_predicted=[str(x) for x in extra[:5]],
                     predicted_not_measured=[str(x) for x in missing[:5]],
                     memory={k: memory[k] for k in keys}, predicted_memory={k: p_mem[k] for k in keys}, ok=ok)
            del sm, opt
            gc.collect()
        except Exception as e:                          # noqa: BLE001
            r = error(e, every_rank=True)
        out[name] = r
        if "error" in r:
            say(f"ledger {name:<17}: {r['error']}  FAIL")
            continue
        say(f"ledger {name:<17} ep {r['ep']} on {two_level(world)}: sm.comm_ledger() after 1 step "
            f"({args.micro} micro-batches, clip) = predict_ledger: {ok} ({r['records']} records, "
            f"{r['expert_records']} experts', {r['bytes'] / 2**20:.1f} MiB); memory_report = predict_memory "
            f"{mem_eq}  {verdict(ok)}" + ("" if ok else f"; measured only {extra[:3]}, predicted only {missing[:3]}"))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        print("torchtitan_moe_check: needs torchtitan (pip install torchtitan; it is no test dependency), "
              "and it is not importable here", flush=True)
        return 2
    import warnings
    import torch
    import torch.distributed as dist
    import shardc
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="In CPU autocast")          # the router's fp32 autocast
    warnings.filterwarnings("ignore", message="DTensor random operators")  # init_weights on the ep mesh
    t0 = time.perf_counter()
    with shardc.distributed("gloo"):
        rank, world = dist.get_rank(), dist.get_world_size()
        if world % 2 or args.global_batch % (world * max(args.micro, 2)):
            say(f"torchtitan_moe_check: needs an even world and --global-batch a multiple of world x "
                f"max(micro, 2) ({args.global_batch} on {world})")
            sys.exit(2)
        setup_titan(args)
        init_model = build(args, seed=0)
        res = {}
        checks = ("parity", "bias", "ledger") if args.check == "all" else (args.check,)
        for c in checks:
            res[c] = {"parity": check_parity, "bias": check_bias, "ledger": check_ledger}[c](args, init_model)
        ok = all((v["ok"] if "ok" in v else all(x.get("ok", False) for x in v.values() if isinstance(x, dict)))
                 for v in res.values())
        run = dict(check=args.check, entry=args.entry, buffers=args.buffers or "broadcast", world=world,
                   mesh=two_level(world), layers=args.layers, seq=args.seq,
                   global_batch=args.global_batch, steps=args.steps, micro=args.micro, clip=args.clip,
                   experts_dtype=args.experts_dtype, torch=torch.__version__,
                   torchtitan=getattr(__import__("torchtitan"), "__version__", "?"), results=res, ok=ok,
                   seconds=time.perf_counter() - t0)
        say(f"CHECK: {'all ok' if ok else 'FAILED'} ({args.check}, {world} ranks) in {run['seconds']:.0f} s")
        if args.json_out and rank == 0:
            doc = {"runs": []}
            if os.path.exists(args.json_out):
                with open(args.json_out) as f:
                    doc = json.load(f)
            doc["runs"].append(run)
            with open(args.json_out, "w") as f:
                json.dump(doc, f, indent=1, default=jsonable)
        dist.barrier()
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
