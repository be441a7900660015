"""Cost model — predicts, without running anything, what a strategy costs on a model.

Stage: Strategy + the model's units (sizes per unit) -> memory per rank, the per-step
communication ledger (record for record what the runtime measures), bytes per link
level, and an alpha-beta / profiled time estimate. Consumed by `shardc explain`,
`shardc plan` and the compiler (`choose_collectives`).
"""
from shardc.compiler.costmodel.sizes import UnitSize, unit_sizes, padded
from shardc.compiler.costmodel.ledger import PHASES, LedgerRecord, predict_ledger
from shardc.compiler.costmodel.memory import optimizer_state_bytes, predict_memory
from shardc.compiler.costmodel.links import inter_intra, link_bytes
from shardc.compiler.costmodel.timing import (
    AlphaBeta, Profile, StepTime, choose_collectives, step_time,
)

__all__ = [
    "UnitSize", "unit_sizes", "padded", "PHASES", "LedgerRecord", "predict_ledger",
    "optimizer_state_bytes", "predict_memory", "inter_intra", "link_bytes",
    "AlphaBeta", "Profile", "StepTime", "choose_collectives", "step_time",
]
