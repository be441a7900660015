"""`shardc plan` — the planner's command line.

Input: a model factory (built on the meta device), a mesh, a memory budget per rank,
and a bandwidth model (`--intra/--inter` or `--bandwidth profile.json`). Output: the
top K fitting strategies in a table (or `--json`), and the best one written as a
`.shard` file (`-o`) that passes `shardc check`.
"""
from __future__ import annotations

import json

from shardc.analysis.costmodel.memory import OPTIMIZERS
from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import STATES, DType
from shardc.dsl.quantities import duration, human_bytes, parse_memory
from shardc.lowering.optimizers import DEFAULT_OPTIMIZER

from shardc.cli import predict_args
from shardc.cli.cmd_explain import (
    add_bandwidth_arguments, bandwidth_from_args, flops_from_args,
)

# why plan needs the traced graph (the activations), in predict_args.graph's errors
NEED = "plan keeps the strategies whose peak memory (activations included) fits --memory"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="PATH:FACTORY", help="model factory, e.g. examples/llama.py:llama_7b")
    predict_args.add_tp_argument(p)
    predict_args.add_ep_argument(p, plan=True)
    p.add_argument("--mesh", required=True, help='mesh, e.g. "node(8) > gpu(8)" (`*` needs --world)')
    p.add_argument("--world", type=int, help="world size (resolves `*` in the mesh)")
    p.add_argument("--memory", required=True, help="memory per rank the peak must fit, e.g. 80GiB")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--optimizer", default=DEFAULT_OPTIMIZER, choices=OPTIMIZERS)
    p.add_argument("--matrices", metavar="GLOB",
                   help="units whose 2-D parameters torch.optim.Muon steps whole, e.g. 'transformer.h.*' "
                        "(their states placed by tensor where optim is sharded; the rest: --optimizer)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="params/grads dtype and comm (bf16 = mixed precision, fp32 master in the optimizer)")
    p.add_argument("--objective", default="time", choices=("time", "comm"),
                   help="rank by predicted step time (default) or by summed communication time (Lins')")
    p.add_argument("--top", type=int, default=10, metavar="K", help="rows to print (default 10)")
    p.add_argument("-o", "--output", metavar="best.shard", help="write the best strategy here")
    p.add_argument("--json", action="store_true", help="print the ranking as JSON")
    add_bandwidth_arguments(p)


def base_strategy(mesh: str, world, ep=None, experts: str = "*.experts"):
    """A replicate-everything strategy on the resolved mesh (the DSL resolves `*`/`local`);
    with `ep`, an `experts` statement naming `experts` with that ep."""
    from shardc.dsl import StrategyError, load_strategy
    if "\n" in mesh or "#" in mesh:
        raise ShardcError("--mesh must be one line such as 'node(8) > gpu(8)'")
    if '"' in experts or "\n" in experts:
        raise ShardcError(f"--experts {experts!r}: a glob without quotes or newlines, e.g. '*.experts'")
    extra = f'experts "{experts}"\n' if ep is not None else ""
    try:
        return load_strategy(f"strategy planned\nmesh {mesh}\n{extra}", world_size=world, ep=ep)
    except StrategyError as e:
        msg = e.errors[0].message if e.errors else str(e).splitlines()[0]
        hint = "; pass --world" if world is None and "world size is unknown" in msg else ""
        raise ShardcError(f"--mesh {mesh!r}: {msg}{hint}") from None


def run(args) -> int:
    from shardc.cli.loader import load_model_units, meta_model
    from shardc.analysis.planner import plan, shard_text, why

    budget = parse_memory(args.memory)
    if args.top < 1:
        raise ShardcError(f"--top must be at least 1, got {args.top}")
    base = base_strategy(args.mesh, args.world, args.ep, args.experts)
    units = load_model_units(base, args.model, args.tp)
    bw = predict_args.links(args, bandwidth_from_args(args), base.mesh)
    cands = plan(base, units, budget, bandwidth=bw,
                 micro_batches=args.micro_batches, optimizer=args.optimizer, dtype=DType(args.precision),
                 tokens=args.tokens, flops=predict_args.achievable(args, flops_from_args(args, bw)),
                 graph=predict_args.graph(args, base, args.model, args.precision, need=NEED),
                 checkpoint=args.checkpoint,
                 peak_flops=predict_args.peak(args), objective=args.objective,
                 overhead=predict_args.overhead(args), matrices=args.matrices,
                 model=meta_model(args.model, base, args.tp) if args.matrices else None)
    fit = [c for c in cands if c.fits]
    if args.output and fit:
        write_best(fit[0], args.output)
    if args.json:
        print(json.dumps({"candidates": len(cands), "fit": len(fit), "best": shard_text(fit[0]) if fit else None,
                          "objective": args.objective, "why": why(fit[0], fit[1], args.objective) if len(fit) > 1 else None,
                          "ranking": [row(c) for c in fit[:args.top]],
                          # the first layout the budget rejects (the smallest peak over it)
                          "rejected": next((row(c) for c in cands if not c.fits), None)}, indent=2))
    else:
        render(cands, fit, args, budget)
    if not fit:
        smallest = cands[0]
        raise ShardcError(f"no strategy fits {args.memory} per rank; the smallest needs "
                          f"{human_bytes(smallest.memory)} ({describe(smallest)}){dominated(smallest, args)}")
    return 0


def dominated(c, args) -> str:
    """What the smallest candidate's peak is mostly made of, and the flag that shrinks it."""
    part = c.report.peak.get("dominant")
    if part is None:
        return ""
    hint = {"activations": "" if args.checkpoint else " (--checkpoint recomputes them)",
            "states": " (--precision bf16 halves params and grads)" if args.precision == "fp32" else ""}.get(part, "")
    return f", dominated by {part}{hint}"


def write_best(c, path: str) -> None:
    from shardc.analysis.planner import shard_text
    from shardc.dsl import load_strategy
    text = shard_text(c)
    load_strategy(text)      # the planner only writes what `shardc check` accepts
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise ShardcError(f"cannot write {path}: {e.strerror or e}") from None


def describe(c) -> str:
    from shardc.dsl.unparse import scope_text
    m = c.report.strategy.mesh
    sc = c.scopes
    return (f"params {scope_text(sc.params.levels, m)}; grads {scope_text(sc.grads.levels, m)}; "
            f"optim {scope_text(sc.optim.levels, m)}")


def row(c) -> dict:
    from shardc.analysis.planner import shard_text
    sc, r = c.scopes, c.report
    owned = [o.pattern for o in r.strategy.overrides if o.optim is not None and o.optim.owned]
    return {**{k: list(getattr(sc, k).levels) for k in STATES}, "optim_by_tensor": owned[0] if owned else None,
            "collectives": r.algo.value, "memory": c.memory, "model_states": r.memory["total"],
            "inter": round(r.inter), "intra": round(r.intra), "step_seconds": c.step_time,
            "comm_seconds": c.comm_time, "comm_by_phase": dict(r.time.comm), "peak": c.report.peak, "mfu": r.rates["mfu"],
            "tokens_per_s": r.rates["tokens_per_s"], "shard": shard_text(c)}


def render(cands, fit, args, budget) -> None:
    from rich.console import Console
    from rich.table import Table


    con = Console(width=max(Console().width, 150))
    mesh = cands[0].report.strategy.mesh
    con.print(f"{len(cands)} strategies obey the dependency rule on {mesh}; {len(fit)} fit "
              f"{human_bytes(budget)} per rank ({args.micro_batches} micro-batches, {args.precision})")
    if not fit:
        return                   # the error that follows names the smallest
    short = lambda levels: ",".join(levels) if levels else "replicate"
    by = "estimated step time" if args.objective == "time" else "summed communication time"
    t = Table(title=f"top {min(args.top, len(fit))} by {by} (levels each state is sharded over)")
    for col in ("#", *STATES, "collectives", "memory/rank", "inter/rank", "intra/rank", "step"):
        t.add_column(col, justify="right" if col in ("#", "memory/rank", "inter/rank", "intra/rank", "step") else "left",
                     no_wrap=True)
    for i, c in enumerate(fit[:args.top], 1):
        sc, r = c.scopes, c.report
        by = " (+ by tensor)" if any(o.optim is not None and o.optim.owned for o in r.strategy.overrides) else ""
        t.add_row(str(i), short(sc.params.levels), short(sc.grads.levels), short(sc.optim.levels) + by, r.algo.value,
                  human_bytes(c.memory), human_bytes(r.inter), human_bytes(r.intra), duration(c.step_time))
    con.print(t)
    if len(fit) > 1:
        from shardc.analysis.planner import why
        con.print(why(fit[0], fit[1], args.objective), markup=False)
    if args.output and fit:
        con.print(f"wrote the best strategy to {args.output}")
