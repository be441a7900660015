"""The simulation switch — stage: runtime (construction reads it; nothing else changes).

Input: `with simulation():` around `shardc.compile` / `shard_module` and the step, in a
process whose default group is torch's `fake` process group (one process as rank r of N:
every collective completes at once and moves nothing). Output: `active()`, which the
builder (runtime/build.py) reads.

[Note: a simulated rank]
Under the switch the runtime runs as it does for a real rank, with three differences, all
in construction:
  * the shards, the full buffers, the gradients and every communication buffer are meta
    tensors (shape, dtype and bytes, no storage), so a rank of a 65B model on few ranks
    allocates nothing; the groups are still those of the process group's device (`cpu`);
  * the model (built on the meta device) gets no values and needs none: there is no value
    source to agree on (a fake group's all-reduce sums nothing), and the checks that
    refuse a forward before a load (`ParamSet.require`) have nothing to refuse;
  * nothing else: the plan, the groups, the engine, the collectives and their ledger, and
    the optimizer's states are the real ones, and `memory_report()` measures the meta
    tensors' bytes as it measures real ones. One step follows from the meta tensors, not
    from the switch: a quantized collective codes only its first batch of rows, the
    largest, whose temporaries are its codec peak (runtime/transport/quant.py [Note: codec batches on
    meta]), since there are no values to code.
Outside the switch nothing of this applies: a user's meta model without init or load is
refused at its first forward as before.
"""
from __future__ import annotations

import contextlib
import contextvars

# scoped to the block and its context (a thread or task of its own does not see it), not a
# process-wide flag: torch's own modes are scoped the same way
_SIMULATING: contextvars.ContextVar[bool] = contextvars.ContextVar("shardc_simulating", default=False)


@contextlib.contextmanager
def simulation():
    """Within the block, models sharded are simulated ranks (see the module note)."""
    token = _SIMULATING.set(True)
    try:
        yield
    finally:
        _SIMULATING.reset(token)


def active() -> bool:
    """Whether a model sharded now is a simulated rank."""
    return _SIMULATING.get()
