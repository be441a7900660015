"""`shardc.distributed()` — stage: public API (launch: a training script's process group).

Input: a torchrun worker's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...) and an
optional backend. Output: a context manager whose block runs on the default process
group, made so that the job survives `torchrun --max-restarts N`:

    with shardc.distributed("gloo"):          # "nccl" on GPUs; None: torch's default
        model = shardc.compile(...)
        ...                                   # the whole job

On entry it calls `init_process_group` (with fresh rendezvous keys after a restart,
[Note: restarts and the agent's store]); at the end of the block it collects garbage and
destroys the group ([Note: teardown]); under torchrun the process then ends there, with
the block's exit status ([Note: exit without interpreter teardown]). A default group
that already exists (made by the caller, or a test harness) is used as it is and left
alone: nothing is made, destroyed or ended.
"""
from __future__ import annotations

import gc
import os
import sys

import torch.distributed as dist

from shardc.dsl.errors import ShardcError

__all__ = ["distributed"]

NO_LAUNCHER = ("shardc.distributed() runs one process per rank: launch the script with torchrun "
               "(e.g. `torchrun --nproc-per-node 4 train.py`)")


def distributed(backend: str | None = None, **init_kwargs) -> "_Distributed":
    """A context manager for a torchrun worker's job (see the module docstring).
    `backend` and `init_kwargs` (e.g. `timeout=`, `device_id=`) go to `init_process_group`."""
    return _Distributed(backend, init_kwargs)


class _Distributed:
    def __init__(self, backend: str | None, init_kwargs: dict):
        self.backend, self.init_kwargs = backend, init_kwargs
        self.owned = False

    def __enter__(self) -> "_Distributed":
        if dist.is_initialized():                 # the caller's group: used, left alone
            return self
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ShardcError(NO_LAUNCHER)
        init_process_group(self.backend, **self.init_kwargs)
        self.owned = True
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if not self.owned:
            return False
        # [Note: teardown]
        # The sharded module, its engine and their process-group handles form reference
        # cycles; collect them while the interpreter is fully alive, so the groups' gloo
        # threads are joined here and not during interpreter shutdown (seen to abort a
        # restarted rank at exit, after its training had finished).
        gc.collect()
        dist.destroy_process_group()
        self.owned = False
        if "TORCHELASTIC_RESTART_COUNT" not in os.environ:      # not a torchrun worker
            return False
        if exc is None:
            _exit_now(0)
        if isinstance(exc, SystemExit):
            _exit_now(_status(exc))
        return False          # an error: its traceback, and the job fails (torchrun restarts it)


def _status(e: SystemExit) -> int:
    """The exit status `sys.exit(e.code)` gives: None 0, an int itself, else printed and 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _exit_now(status: int) -> None:
    """[Note: exit without interpreter teardown]
    The block has closed everything the job owns: the process group is destroyed, its
    checkpoints are written and closed. Interpreter teardown would then destroy what
    torch.distributed keeps behind (a restarted attempt's store client and its threads)
    in an order that aborted a restarted rank at exit twice ("terminate called without an
    active exception", after its training had finished), failing the job torchrun had
    just restarted. So a torchrun worker flushes and leaves without it: code after the
    block does not run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def init_process_group(backend: str | None = None, **init_kwargs) -> None:
    """`dist.init_process_group`, with fresh rendezvous keys after a torchrun restart.

    [Note: restarts and the agent's store]
    torchrun (c10d rendezvous) keeps one TCPStore across restart rounds and its workers
    use it unprefixed, so a restarted rank can read a dead peer's address that the
    previous attempt left there and hang or fail connecting (seen under load). After a
    restart the workers' keys go under a per-attempt prefix instead."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, **init_kwargs)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"/shardc/attempt_{attempt}", store),
                            rank=rank, world_size=world, **init_kwargs)
