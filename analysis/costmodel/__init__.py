"""Cost model — predicts, without running anything, what a strategy costs on a model.

Stage: Strategy + the model's units (sizes per unit) -> memory per rank, the per-step
communication ledger (record for record what the runtime measures), bytes per link
level, an alpha-beta / per-level / profiled time estimate with FLOPs and activations
from the model's meta-device trace, and the peak memory per rank. Consumed by `shardc explain`,
`shardc plan` and the compiler (`choose_collectives`).

Names are imported lazily (PEP 562): importing the package costs nothing; a name loads
its submodule (and through `ledger`, torch and the runtime) on first use.
"""
from importlib import import_module

_WHERE = {
    "UnitSize": "sizes", "model_unit_sizes": "sizes",
    "LedgerRecord": "ledger", "predict_ledger": "ledger",
    "optimizer_state_bytes": "memory", "predict_memory": "memory",
    "inter_intra": "links", "link_bytes": "links",
    "AlphaBeta": "timing", "Profile": "profile", "StepTime": "timing",
    "choose_collectives": "timing", "step_time": "timing",
    "Explained": "report", "explain": "report",
    "LevelLinks": "network", "collective_seconds": "network",
    "GraphCost": "flops", "trace": "flops", "peak_memory": "activations",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
