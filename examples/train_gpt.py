"""Train the example GPT on a byte-level corpus under any shardc strategy (the README's main job).

    torchrun --nproc-per-node 4 examples/train_gpt.py \\
        --strategy examples/strategies/paro_iig.shard --mesh "node(2) > gpu(2)"

The model is built on the meta device (`--build whole` builds it with values on every rank):
each rank allocates only its shards and initializes them (GPT.init_module, per module, from
the seed), with the values one process would give whatever the world size. Each rank reads
its own slice of every micro-batch; `accumulate` micro-batches (from the
strategy) make one optimizer step, losses are divided by it (DDP semantics). Rank 0
shows a progress bar with the loss and prints, at the end, tokens/s, the model-state
memory per rank (`memory_report()`) and the communication per mesh level
(`comm_ledger()`, bytes of the logical collectives summed by the levels they span).
Runs on CPU with gloo (or CUDA with nccl when available). `SHARDC_EXAMPLE_STEPS` overrides
the default number of steps (CI uses it to shorten the run).

With `--checkpoint-dir DIR` it saves a DCP checkpoint (parameters, optimizer states, the
step) every `--checkpoint-every` steps to DIR/step_NNNNNN and, when started, resumes
from the latest complete one (the one with DCP's `.metadata`), so under
`torchrun --max-restarts 1` a job whose rank died continues where it was saved and
ends with the same parameters as a run that never stopped (the job runs inside
`shardc.distributed()`, which makes that safe). `TRAIN_GPT_KILL_AT=RANK:STEP`
SIGKILLs that rank in the middle of that step on the first attempt (a fault-injection
hook for tests/test_restart.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402  (examples/gpt.py)

import shardc  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")
CONFIGS = {"tiny": dataclasses.replace(gpt.TINY, vocab_size=256, block_size=32), "small": gpt.SMALL}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", required=True, help="a .shard file")
    p.add_argument("--mesh", default=None, help='mesh override, e.g. "node(2) > gpu(2)"; with --tp, the '
                   'data-parallel mesh (the world is its ranks times --tp)')
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: every block's attention (by heads) "
                   "and MLP split over this many ranks (torch's parallelize_module); needs --mesh")
    p.add_argument("--model", choices=sorted(CONFIGS), default="small")
    p.add_argument("--build", choices=("meta", "whole"), default="meta",
                   help="meta (default, as torchtitan): build the model on the meta device, each rank "
                   "initializing only its shards (GPT.init_module per module); whole: build it with values "
                   "on every rank, the first rank's scattered")
    p.add_argument("--steps", type=int, default=int(os.environ.get("SHARDC_EXAMPLE_STEPS", 20)))
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--capture", choices=("auto", "fx", "export"), default="auto")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the model trains (default: cuda when available, else cpu)")
    p.add_argument("--checkpoint-dir", default=None, help="save here and resume from the latest checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=1, help="steps between checkpoints")
    p.add_argument("--save-final", default=None, help="torch.save the final full state dict here (rank 0)")
    return p.parse_args(argv)


def load_corpus() -> torch.Tensor:
    with open(CORPUS, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()


def get_batch(data, cfg, n, step, micro, rank, world):
    """This rank's slice of micro-batch `micro` of step `step` (same on every run)."""
    g = torch.Generator().manual_seed(step * 1000 + micro)
    starts = torch.randint(0, len(data) - cfg.block_size - 1, (n * world,), generator=g)[rank * n:(rank + 1) * n]
    x = torch.stack([data[s:s + cfg.block_size] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + cfg.block_size] for s in starts])
    return x, y


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def comm_by_level(ledger) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ledger:
        key = ",".join(r.levels)
        out[key] = out.get(key, 0) + r.bytes * r.count
    return out


def report(sm, strategy, tokens, seconds, world, losses):
    mem = sm.memory_report()
    mems = [None] * world
    dist.all_gather_object(mems, mem)
    if dist.get_rank() != 0:
        return
    print(f"\nstrategy {strategy.name} on {strategy.mesh} (world {world}), collectives {strategy.collectives.value}")
    if losses:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    print(f"throughput {tokens / seconds:,.0f} tokens/s ({tokens:,} tokens in {seconds:.1f} s)")
    print("model-state memory per rank: " + ", ".join(
        f"rank {i}: {human(m['total'])} (params {human(m['params'])}, grads {human(m['grads'])}, "
        f"optim {human(m['optim'])})" for i, m in enumerate(mems)))
    print("communication (logical bytes, this rank, all steps):")
    for levels, nbytes in sorted(comm_by_level(sm.comm_ledger()).items()):
        print(f"  {levels or '-':<16} {human(nbytes):>12}  ({human(nbytes / len(losses))} per step)")


class Progress:
    """Rank 0's progress: a rich bar on a terminal, one plain line per step otherwise (CI logs)."""

    def __init__(self, total: int, enabled: bool, done: int = 0):
        """`total` steps of the run, `done` of them before it started (a resumed run)."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn
        self.total, self.enabled, self.step = total, enabled, done
        self.console = Console(stderr=False)
        self.bar = None
        if enabled and self.console.is_terminal:
            self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           TextColumn("loss {task.fields[loss]}"), console=self.console)
            self.task = self.bar.add_task("train", total=total, completed=done, loss="-")
            self.bar.start()

    def update(self, loss: float) -> None:
        self.step += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, loss=f"{loss:.4f}")
        elif self.enabled:
            print(f"step {self.step}/{self.total} loss {loss:.4f}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
def latest_checkpoint(root: str | None) -> tuple[str | None, int]:
    """The newest complete checkpoint under `root` and its step (None, 0 if none)."""
    if not root or not os.path.isdir(root):
        return None, 0
    done = sorted(d for d in os.listdir(root)
                  if d.startswith("step_") and os.path.exists(os.path.join(root, d, ".metadata")))
    return (os.path.join(root, done[-1]), int(done[-1][5:])) if done else (None, 0)


def save_checkpoint(root: str, sm, opt, step: int) -> None:
    """Parameters, optimizer states and the step: torch's recipe on the sharded model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(sm, opt)
    dcp.save({"model": msd, "optim": osd, "step": step},
             checkpoint_id=os.path.join(root, f"step_{step:06d}"))


def resume(root: str | None, sm, opt) -> int:
    """Load the latest checkpoint under `root` (if any); returns the step to start from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    path, _ = latest_checkpoint(root)
    if path is None:
        return 0
    msd, osd = get_state_dict(sm, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    try:
        with shardc.checkpoint_errors(path):  # every rank's traceback -> one sentence naming the first failure
            dcp.load(state, checkpoint_id=path)
    except shardc.ShardcError as e:
        raise shardc.ShardcError(f"cannot resume: {e} (start with another --checkpoint-dir)") from None
    set_state_dict(sm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if dist.get_rank() == 0:
        print(f"resumed from {path} (step {state['step']})", flush=True)
    return state["step"]


def maybe_die(step: int, rank: int) -> None:
    """TRAIN_GPT_KILL_AT=RANK:STEP: SIGKILL that rank mid-step, on the first attempt only."""
    spec = os.environ.get("TRAIN_GPT_KILL_AT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        r, s = (int(v) for v in spec.split(":"))
        if (r, s) == (rank, step):
            import signal
            os.kill(os.getpid(), signal.SIGKILL)


def data_parallel(args, model, dev):
    """(strategy, DeviceMesh or None, this rank's data-parallel index, data-parallel ranks).
    With --tp N the world is a DeviceMesh of the --mesh levels and a `tp` dim of N (innermost:
    a node's consecutive ranks); the model's blocks are split over tp and shardc shards over
    the rest, so the N ranks of a tp group read the same batch."""
    world = dist.get_world_size()
    if args.tp == 1:
        return shardc.load_strategy(args.strategy, world_size=world, mesh=args.mesh), None, dist.get_rank(), world
    if args.mesh is None or world % args.tp:
        raise shardc.ShardcError(f"--tp {args.tp} needs the data-parallel mesh as --mesh (e.g. --mesh "
                                 f"\"node(2) > gpu(2)\" for 8 ranks and --tp 2) and a world size it divides "
                                 f"(world {world})")
    from torch.distributed.device_mesh import init_device_mesh
    dp = shardc.load_strategy(args.strategy, world_size=world // args.tp, mesh=args.mesh)
    world_mesh = init_device_mesh(dev.type, (*[lv.size for lv in dp.mesh.levels], args.tp),
                                  mesh_dim_names=(*dp.mesh.names, "tp"))
    gpt.tensor_parallel(model, world_mesh["tp"])
    return dp, world_mesh[dp.mesh.names], dist.get_rank() // args.tp, world // args.tp


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("train_gpt.py runs one process per rank: launch it with torchrun, e.g. "
              "`torchrun --nproc-per-node 4 examples/train_gpt.py --strategy "
              "examples/strategies/paro_iig.shard --mesh \"node(2) > gpu(2)\"`", file=sys.stderr)
        return 2
    on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # the process group, made to survive `torchrun --max-restarts` (fresh rendezvous keys
    # after a restart, torn down in order); under torchrun the process ends with the block
    with shardc.distributed("nccl" if on_cuda else "gloo"):
        try:
            train(args)
        except shardc.ShardcError as e:
            if dist.get_rank() == 0:               # every rank has it; the first says it
                print(error_text(e), file=sys.stderr, flush=True)
            sys.exit(1)
    return 0


def error_text(e: shardc.ShardcError) -> str:
    """As the CLI prints it: a strategy's diagnostics are rendered already (`error: ...`)."""
    from shardc.dsl import StrategyError
    return str(e) if isinstance(e, StrategyError) else f"error: {e}"


def train(args) -> dict:
    """The training run on an initialised process group; returns losses and the report data."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = CONFIGS[args.model]
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    if args.build == "meta":                        # no rank ever holds the whole model
        with torch.device("meta"):
            model = gpt.GPT(cfg)
    else:
        model = gpt.GPT(cfg).to(dev)
    data = load_corpus()
    strategy, mesh, dp_rank, dp_world = data_parallel(args, model, dev)
    if rank == 0:
        for warning in strategy.warnings:           # the checker's advice (e.g. a degenerate level)
            print(warning, file=sys.stderr, flush=True)
    x0 = get_batch(data, cfg, args.batch, 0, 0, dp_rank, dp_world)[0].to(dev)
    t_compile = time.perf_counter()
    torch.manual_seed(0)                            # the meta model's values: a function of the seed only
    sm = shardc.compile(model, strategy if mesh is None else args.strategy, example_inputs=(x0,),
                        capture=args.capture, mesh=mesh, device=dev,
                        init=gpt.GPT.init_module if args.build == "meta" else None)
    strategy = sm.plan.strategy                     # `collectives auto` resolved by the cost model
    if rank == 0:
        print(f"compiled in {time.perf_counter() - t_compile:.1f} s: {len(sm.plan.units)} units, "
              f"capture {sm.plan.capture}", flush=True)
    opt = sm.optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    M = strategy.accumulate
    first = resume(args.checkpoint_dir, sm, opt)
    bar, losses = Progress(args.steps, rank == 0 and not args.quiet, done=first), []
    t0 = time.perf_counter()
    for step in range(first, args.steps):
        total = torch.zeros((), device=dev)
        for micro in range(M):
            x, y = (t.to(dev) for t in get_batch(data, cfg, args.batch, step, micro, dp_rank, dp_world))
            loss = F.cross_entropy(sm(x).flatten(0, 1), y.flatten()) / M
            maybe_die(step, rank)
            loss.backward()
            total += loss.detach()
        sm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)                      # for display only (not in the ledger)
        losses.append(total.item() / world)
        bar.update(losses[-1])
        if args.checkpoint_dir and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            save_checkpoint(args.checkpoint_dir, sm, opt, step + 1)
    seconds = time.perf_counter() - t0
    bar.close()
    if args.save_final:
        final = sm.full_state_dict(rank0_only=True)
        if rank == 0:
            torch.save(final, args.save_final)
    tokens = max(len(losses), 1) * M * args.batch * cfg.block_size * dp_world
    report(sm, strategy, tokens, seconds, world, losses)
    return dict(losses=losses, tokens_per_s=tokens / seconds, memory=sm.memory_report(),
                comm=comm_by_level(sm.comm_ledger()))


if __name__ == "__main__":
    sys.exit(main())
