"""Optimizer kinds — stage: lowering (facts about torch.optim classes, pure data).

Input: a `torch.optim` class name (any case where a user types it) and its kwargs.
Output: what the plan needs to know about it: whether its update is element-wise (so
its state can be sharded: the runtime's `ELEMENTWISE` is read from here) and K_state,
the bytes of optimizer state it keeps per element (the cost model's `optim` memory).
`DEFAULT_OPTIMIZER` is the one default every signature and option uses. No torch here:
the runtime turns names into classes.

[Note: K_state]
Bytes of every non-scalar state tensor per element, fp32 (what `memory_report()`
measures): `state_bytes` with default kwargs, plus each `flags` entry's bytes when that
kwarg is set (non-zero or true): Adam/AdamW 8 (+4 amsgrad), SGD momentum≠0: 4 else 0,
Adagrad 4, RMSprop 4 (+4 momentum≠0, +4 centered), Muon 4 (its momentum, whole, on each
matrix's owner: dsl/ir.py [Note: tensor-owned scopes]). A kind with `state_bytes=None` runs
(sharded, when element-wise) but the cost model does not predict its memory.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_OPTIMIZER", "OWNED_OPTIMIZER", "OPTIMIZER_KINDS", "OptimizerKind", "optimizer_kind"]

DEFAULT_OPTIMIZER = "adamw"
OWNED_OPTIMIZER = "muon"      # the whole-tensor optimizer explain assumes for tensor-owned matrices


@dataclass(frozen=True, slots=True)
class OptimizerKind:
    name: str                                  # the torch.optim class name
    elementwise: bool = True                   # each element's update reads only its own grad and state
    state_bytes: int | None = None             # K_state with default kwargs; None: not predicted
    flags: tuple[tuple[str, int], ...] = ()    # (kwarg, bytes per element it adds when set)

    def k_state(self, **kw) -> int | None:
        """K_state for these kwargs ([Note: K_state]); None when not predicted."""
        if self.state_bytes is None:
            return None
        return self.state_bytes + sum(n for key, n in self.flags if kw.get(key))


# The cost model's kinds first, in the order its option lists them.
OPTIMIZER_KINDS = {k.name: k for k in (
    OptimizerKind("AdamW", state_bytes=8, flags=(("amsgrad", 4),)),
    OptimizerKind("Adam", state_bytes=8, flags=(("amsgrad", 4),)),
    OptimizerKind("SGD", state_bytes=0, flags=(("momentum", 4),)),
    OptimizerKind("Adagrad", state_bytes=4),
    OptimizerKind("RMSprop", state_bytes=4, flags=(("momentum", 4), ("centered", 4))),
    OptimizerKind("Adamax"),
    OptimizerKind("NAdam"),
    OptimizerKind("RAdam"),
    OptimizerKind("ASGD"),
    OptimizerKind("Rprop"),
    OptimizerKind("Adadelta"),
    OptimizerKind("LBFGS", elementwise=False),
    # whole-matrix updates (Newton–Schulz): its state only under `optim ... by tensor`
    OptimizerKind("Muon", elementwise=False, state_bytes=4),
)}
_BY_LOWER = {name.lower(): k for name, k in OPTIMIZER_KINDS.items()}


def optimizer_kind(name: str) -> OptimizerKind | None:
    """The kind named `name` in any case (`adamw`, `AdamW`), or None when unknown."""
    return _BY_LOWER.get(name.lower())
