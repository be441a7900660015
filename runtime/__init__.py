"""shardc.runtime — what emitted code calls: sharded units, the step engine, the
sharded optimizer, the communication ledger, memory reports and state dicts.

    sm = shard_module(model, strategy, units, mesh=None, hooks=True)   # ShardedModule
    opt = sm.optimizer(torch.optim.AdamW, param_groups=None, lr=...)  # a torch.optim instance
    loss = f(sm(x)); loss.backward(); sm.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Modules: layout (parameter slots in a flat buffer; padding and chunks come from
shardc.lowering), storage (a flat group's stored states: shards, full buffer, grads,
master), flat_group (the collectives that move them, one plan row each), unit (a unit's
state), engine (schedule, hooks) and boundary (the step's accumulation state machine),
optimizer (any torch optimizer over the module's parameters, adopted through torch's step
hooks), memory (the memory report), state/ (the model's state as torch's tools see it:
parameters, state dicts with the model's own hooks, DCP pieces, whole tensors, DTensor
parameters), buffers (`buffers broadcast|local`), faults (timeouts, failed peers,
guarded collectives), ledger, comm (the communication interface: plan rows issued on
mesh/collectives and recorded), dtypes (the DType -> torch.dtype table), device (the
model's device, the backend per device type, communication streams), compile (what
torch.compile must run eagerly; compile-then-shard), graph_mode/graph_step/graph_boundary/
graph_backend/graph_secondary/funcol/quant_ops (the whole-step compiled mode,
`backend="inductor"`: each micro-batch one Inductor graph, the plan's collectives in it as
functional collectives, and the step boundary one more), build (construction: the
shards, their values, the engine), module (the API).
`sm.module` keeps no registered parameters: `sm.parameters()` are the model's parameters
(this rank's pieces, runtime/state/params.py); read whole values with `full_state_dict()`.
"""
from .errors import RuntimeUsageError
from .ledger import LedgerRecord
from .module import ShardedModule, shard_module
from .step.optimizer import ELEMENTWISE
from shardc.units import UnitSpec     # re-exported: emitted modules before shardc.units imported it here

from .transport.mesh import ShardMesh

__all__ = ["ShardedModule", "shard_module", "UnitSpec", "LedgerRecord", "ShardMesh",
           "RuntimeUsageError", "ELEMENTWISE"]
