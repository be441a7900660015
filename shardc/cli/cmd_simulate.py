"""`shardc simulate` — ranks of a big job, each run in one process under torch's fake
process group, beside explain's prediction.

Input: a `.shard` file, a model factory (`PATH.py:FACTORY`, built on the meta device),
the world size / mesh override, `--ep` (as explain's), the ranks to simulate, the step (micro-batches, tokens
per micro-batch in sequences of `--seq`, optimizer, `--clip`). Output: per rank, the
model-state memory by state and the step's ledger beside explain's (equal or not), the
ledger's bytes by mesh level set, the step's peak (torch's MemTracker) beside explain's
peak less the framework overhead, and the seconds spent building groups, lowering,
compiling and stepping; or `--json` (a list, one object per rank). Exit status 1 when
a rank's states or ledger differ from explain's, or its peak misses explain's by more than
3 % either way (shardc/simulate.py PEAK_TOLERANCE; one sentence on stderr names the phases
and both figures).

The ranks run one after the other in this process, each on a fake default group of its
own (made and destroyed by `simulate_rank`), so this command must be the process's only
user of torch.distributed. The model's graph is traced once, for explain's peak
(`--no-graph` skips it). See shardc/simulate.py for what a simulated rank runs.
"""
from __future__ import annotations

import json
import sys

from shardc.cli import predict_args
from shardc.cli.argtypes import positive_int
from shardc.dsl.errors import ShardcError
from shardc.dsl.quantities import human_bytes
from shardc.lowering.optimizers import DEFAULT_OPTIMIZER


def add_arguments(p) -> None:
    p.add_argument("file", help="strategy file (.shard)")
    p.add_argument("--model", required=True, metavar="PATH:FACTORY", help="model factory, built on the meta device")
    p.add_argument("--world", type=int, help="world size (resolves `*` in the mesh)")
    p.add_argument("--mesh", help='mesh override, e.g. "node(128) > gpu(8)"')
    p.add_argument("--rank", default="0,last", metavar="R[,R...]",
                   help="ranks to simulate, comma-separated; `last` is the world's last (default: 0,last)")
    p.add_argument("--micro-batches", type=positive_int, help="micro-batches in the step (default: the strategy's accumulate)")
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens per micro-batch (default 2048)")
    p.add_argument("--seq", type=positive_int, help="sequence length (default: --tokens, one sequence)")
    p.add_argument("--optimizer", default=DEFAULT_OPTIMIZER, help=f"torch.optim class (default {DEFAULT_OPTIMIZER})")
    p.add_argument("--clip", action="store_true", help="run clip_grad_norm_(1.0) before the step")
    p.add_argument("--passes", default=None, metavar="NAMES", help="plan passes, as for `shardc compile --passes`")
    p.add_argument("--no-graph", action="store_true", help="do not trace the model: no predicted peak")
    p.add_argument("--no-peak", action="store_true",
                   help="one untracked step: states and ledger only (no measured peak; half the time)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    predict_args.add_ep_argument(p)


def ranks_of(text: str, world: int) -> list[int]:
    from shardc.simulate import check_rank
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            r = world - 1 if part == "last" else int(part)
        except ValueError:
            raise ShardcError(f"--rank takes rank numbers or `last`, comma-separated, not {part!r}") from None
        check_rank(r, world)
        out.append(r)
    return list(dict.fromkeys(out))


def run(args) -> int:
    from shardc.cli.cmd_explain import load
    from shardc.cli.loader import load_factory
    from shardc.lowering.passes import parse_passes
    from shardc.simulate import meta_model, peak_miss

    strategy = load(args.file, args.world, args.mesh, args.ep)
    ranks = ranks_of(args.rank, strategy.mesh.world)
    seq = args.seq or args.tokens
    if args.tokens % seq:
        raise ShardcError(f"--tokens {args.tokens} must be a whole number of --seq {seq} sequences")
    factory = load_factory(args.model)
    meta_model(factory, args.model)                          # a factory that cannot build on meta: one sentence
    graph = None
    if not args.no_graph:
        args.checkpoint, args.tp = False, 1
        graph = predict_args.graph(args, strategy, args.model, strategy.scopes.params.dtype.value)
    job = dict(strategy=strategy, factory=factory, spec=args.model, micro_batches=args.micro_batches, optimizer=args.optimizer,
               clip=args.clip, batch=args.tokens // seq, seq=seq, graph=graph, passes=parse_passes(args.passes), peak=not args.no_peak)
    reports = [_one(job, r) for r in ranks]
    if args.json:
        print(json.dumps(reports, indent=2))
    else:
        for rep in reports:
            render(rep)
    for r in reports:                   # a peak that misses: one sentence each, on stderr
        if (miss := peak_miss(r)) is not None:
            print(f"error: {miss}", file=sys.stderr)
    return 0 if all(r["memory_equal"] and r["ledger_equal"] and r["peak"]["within"] is not False
                    for r in reports) else 1


def _one(job: dict, rank: int) -> dict:
    from shardc.simulate import simulate_rank
    return simulate_rank(job["strategy"], job["factory"], rank, spec=job["spec"], micro_batches=job["micro_batches"],
                         optimizer=job["optimizer"], clip=job["clip"], batch=job["batch"], seq=job["seq"],
                         graph=job["graph"], passes=job["passes"], peak=job["peak"])


def render(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    at = ", ".join(f"{k} {v}" for k, v in rep["coords"].items())
    st = rep["step"]
    con.print(f"[bold]{rep['strategy']}[/bold] on {rep['mesh']}: rank {rep['rank']} of {rep['world']} ({at}), "
              f"{rep['params']:,} parameters; one step of {st['micro_batches']} micro-batch(es) of "
              f"{st['batch']} x {st['seq']} tokens, {st['optimizer']}{', clip' if st['clip'] else ''}", highlight=False)
    mem = Table(title="model states per rank (memory_report() / explain)")
    for c in ("state", "simulated", "explain", ""):
        mem.add_column(c, justify="left" if c == "state" else "right")
    for k, v in rep["memory"].items():
        e = rep["explain_memory"][k]
        mem.add_row(k, f"{v:,}", f"{e:,}", "equal" if v == e else f"differs by {v - e:+,}")
    con.print(mem)
    led = Table(title=f"the step's collectives by mesh level set (ledger {'equal to' if rep['ledger_equal'] else 'DIFFERS FROM'} explain's)")
    led.add_column("levels")
    led.add_column("bytes", justify="right")
    led.add_column("", justify="right")
    for lv, b in rep["ledger_by_levels"].items():
        led.add_row(lv, f"{b:,}", human_bytes(b))
    con.print(led)
    pk = rep["peak"]
    predicted = "not predicted (no trace)" if pk["explain"] is None else human_bytes(pk["explain"])
    kinds = ", ".join(f"{k} {human_bytes(v)}" for k, v in pk["by_kind"].items() if v)
    measured = "not measured (--no-peak)" if pk["measured"] is None else f"{human_bytes(pk['measured'])} ({kinds})"
    con.print(f"peak during the step (torch's MemTracker): {measured}; explain: "
              f"{predicted} (the memory timeline's maximum, at {pk.get('explain_phase')}, without the framework "
              f"overhead)", highlight=False)
    if pk.get("phases"):
        ex = pk.get("explain_phases") or {}
        con.print("peak by phase, measured (explain): " + ", ".join(
            f"{k} {human_bytes(v)}" + (f" ({human_bytes(ex[k])})" if k in ex else "") for k, v in pk["phases"].items())
                  + f" (the largest: {pk['phase']})", highlight=False)
    sec = rep["seconds"]
    con.print("seconds (wall / CPU): " + ", ".join(f"{k} {v['wall']:.2f} / {v['cpu']:.2f}" for k, v in sec.items()),
              highlight=False)
