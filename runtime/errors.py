"""Runtime misuse errors (stage: runtime; raised to the user, never a traceback in the CLI)."""
from __future__ import annotations

from shardc.dsl.errors import ShardcError


class RuntimeUsageError(ShardcError):
    """A training loop used a ShardedModule out of order (e.g. a forward with gradients after opt.step() without zero_grad())."""


class AccumulationWarning(UserWarning):
    """A step ran after a number of micro-batches other than the strategy's `accumulate`
    (exact, but the sync the plan overlaps with the last backward ran unoverlapped)."""
