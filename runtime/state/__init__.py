"""shardc.runtime.state — stage: runtime. A sharded model's state as torch's tools see it.

Modules: pieces (one rank's part of one parameter: where it lies, gathering the whole,
DCP-ready `ShardcPiece` DTensors), params (`ShardParam`/`ShardGrad`: `sm.parameters()` and
their gradients for torch's optimizers, clipping and counting), hooks (the model's own
state-dict machinery, hooks included), checkpoint (sharded state dicts for DCP and the
optimizer's), full (whole-tensor state dicts), dtensor_params (tensor-parallel DTensor
parameters inside shardc's units).
"""
