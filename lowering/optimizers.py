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

[Note: step temporaries]
What `opt.step()` allocates beyond its states, fp32, for the implementation torch runs
(`step_impl`: `fused=True`, `foreach=True/False`, else torch's default: foreach on CUDA,
the per-tensor loop on CPU and meta). One rule, `step_temporary_bytes`, read by explain's
memory timeline (analysis/costmodel/timeline.py [Note: timeline: optimizer step]); the
factors are `OptimizerKind.temps`, measured once with torch's MemTracker around
`opt.step()` with the states existing (torch 2.13 CPU, 8 fp32 tensors of 1-2 M elements;
tests/test_step_temporaries.py measures them again): `foreach` holds `temps[0]` x the
stepped tensors' bytes at once (AdamW, Adam: 1.00, the `_foreach_sqrt` of every exp_avg_sq;
SGD: 0, with momentum or not, 1.00 with weight_decay: the `_foreach_add` of the grads),
the loop `temps[1]` x the tensor it steps plus `temps[2]` x the one before it, at most
over the tensors in step order (AdamW, Adam: 2.00 and 1.00: `denom`'s sqrt and quotient,
while the previous tensor's `denom` is still bound; SGD 0, with weight_decay 1.00 and 0:
its `grad` is rebound first), `fused` none. A kind not measured (`temps` None) gets
AdamW's, a bound for every element-wise kind torch ships.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_OPTIMIZER", "OWNED_OPTIMIZER", "OPTIMIZER_KINDS", "OptimizerKind", "optimizer_kind", "step_impl",
           "step_temporary_bytes"]

DEFAULT_OPTIMIZER = "adamw"
OWNED_OPTIMIZER = "muon"      # the whole-tensor optimizer explain assumes for tensor-owned matrices


@dataclass(frozen=True, slots=True)
class OptimizerKind:
    name: str                                  # the torch.optim class name
    elementwise: bool = True                   # each element's update reads only its own grad and state
    state_bytes: int | None = None             # K_state with default kwargs; None: not predicted
    flags: tuple[tuple[str, int], ...] = ()    # (kwarg, bytes per element it adds when set)
    # [Note: step temporaries]: (foreach x the stepped bytes, loop x a tensor, loop x the one
    # before it), and the same with weight_decay set; None: not measured
    temps: tuple[float, float, float] | None = None
    temps_decay: tuple[float, float, float] | None = None

    def k_state(self, **kw) -> int | None:
        """K_state for these kwargs ([Note: K_state]); None when not predicted."""
        if self.state_bytes is None:
            return None
        return self.state_bytes + sum(n for key, n in self.flags if kw.get(key))


# The cost model's kinds first, in the order its option lists them.
OPTIMIZER_KINDS = {k.name: k for k in (
    OptimizerKind("AdamW", state_bytes=8, flags=(("amsgrad", 4),), temps=(1.0, 2.0, 1.0)),
    OptimizerKind("Adam", state_bytes=8, flags=(("amsgrad", 4),), temps=(1.0, 2.0, 1.0)),
    OptimizerKind("SGD", state_bytes=0, flags=(("momentum", 4),), temps=(0.0, 0.0, 0.0),
                  temps_decay=(1.0, 1.0, 0.0)),
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


# the device a job's tensors are on, by its process groups' backend: what torch picks an
# optimizer's implementation by (explain knows the backend, not the device)
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


def step_impl(kw: dict | None = None, device: str = "cuda") -> str:
    """The `opt.step()` implementation torch runs for these kwargs on `device`: "fused",
    "foreach" or "loop" ([Note: step temporaries])."""
    kw = kw or {}
    if kw.get("fused"):
        return "fused"
    if kw.get("foreach") is not None:
        return "foreach" if kw["foreach"] else "loop"
    return "foreach" if device in ("cuda", "xpu") else "loop"


def step_temporary_bytes(name: str, kw: dict | None, stepped: int, tensors, device: str = "cuda") -> int:
    """Bytes `opt.step()` of `name` (with `kw`) allocates stepping tensors of `stepped` fp32
    bytes at once, `tensors` their bytes in the order it steps them (one rank's: the loop's
    rule reads consecutive pairs; a bound where not known: the largest, alone) ([Note: step
    temporaries])."""
    impl = step_impl(kw, device)
    if impl == "fused":
        return 0
    kind = optimizer_kind(name)
    temps = None if kind is None else (kind.temps_decay if (kw or {}).get("weight_decay") and kind.temps_decay
                                       else kind.temps)
    foreach, loop, carry = temps or OPTIMIZER_KINDS["AdamW"].temps
    if impl == "foreach":
        return int(foreach * stepped)
    tensors = list(tensors)
    return int(max((loop * t + carry * prev for prev, t in zip([0] + tensors, tensors)), default=0))
