"""shardc.runtime.state — stage: runtime. A sharded model's state as torch's tools see it.

Modules: pieces (one rank's part of one parameter: where it lies, gathering the whole,
DCP-ready `ShardcPiece` DTensors), params (`ShardParam`/`ShardGrad`: `sm.parameters()` and
their gradients for torch's optimizers, clipping and counting), hooks (the model's own
state-dict machinery, hooks included), checkpoint (sharded state dicts for DCP and the
optimizer's), full (whole-tensor state dicts), dtensor_params (tensor-parallel DTensor
parameters inside shardc's units).
"""
from __future__ import annotations

from typing import NamedTuple


class StateView(NamedTuple):
    """What the state-dict code reads of a sharded model, handed to it by the ShardedModule
    (which it never reads itself)."""
    module: object           # the original model (its modules keep their state-dict hooks)
    params: object           # the ParamSet (params.py): each parameter's piece
    targets: dict            # canonical name -> [(module, attr)] where it was registered
    names_of: dict           # canonical name -> every name of it
    comm: object             # the unit collectives' Comm (gathers of whole tensors)
    units: list              # the engine's units (their flat groups' storages)
    release: object          # release(i): free unit i's gathered buffer before a load writes it
    tp: dict                 # canonical name -> TPParam (DTensor parameters)
    buffer_sync: object      # buffers.Buffers: rank 0's buffers before a read
    faults: object           # faults.Faults: the entry rendezvous of collective APIs
