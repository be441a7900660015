"""Predicted memory per rank — what `ShardedModule.memory_report()` will measure.

Input: a Strategy's mesh, the model's `UnitSize`s, the optimizer class name and its
kwargs. Output: `{"params", "params_secondary", "grads", "optim", "total",
"transient"}` in bytes per rank (docs/internals.md, "Memory"). `total` is the sum of
the four persistent states, as the runtime reports it; `transient` is extra.

[Note: transient window]
The root unit stays gathered through forward and backward; every other unit is held
gathered from the moment its all-gather is issued until it is released. With
`prefetch k`, unit i+k is issued before unit i runs, so at most k+1 non-root units
are gathered at once. `transient` = the root's full size + the largest sum over k+1
consecutive non-root units, counting only units whose params are sharded (s_P > 1),
in the params dtype, padded. It is an estimate the runtime does not report.
"""
from __future__ import annotations

from math import ceil

from shardc.dsl.ir import Mesh

from shardc.analysis.costmodel.ledger import nbytes
from shardc.analysis.costmodel.sizes import Factors, UnitSize

ELEMENTWISE = {"adam", "adamw", "sgd", "adagrad", "rmsprop"}


def optimizer_state_bytes(optimizer: str = "adamw", **kw) -> int:
    """K_state: bytes of optimizer state per element (fp32 moments), by class name."""
    name = optimizer.lower()
    if name in ("adam", "adamw"):
        return 8 + (4 if kw.get("amsgrad") else 0)
    if name == "sgd":
        return 4 if kw.get("momentum", 0) else 0
    if name == "adagrad":
        return 4
    if name == "rmsprop":
        return 4 + (4 if kw.get("momentum", 0) else 0) + (4 if kw.get("centered") else 0)
    from shardc.dsl.errors import ShardcError
    raise ShardcError(f"unknown optimizer {optimizer!r}; the cost model knows {', '.join(sorted(ELEMENTWISE))}")


def _secondary_bytes(n: int, q: int, quant, dtype) -> int:
    per = n // q
    if quant is None:
        return per * nbytes(dtype)
    return ceil(per * quant.bits / 8) + ceil(per / 256) * 4


def predict_memory(mesh: Mesh, units: list[UnitSize], *, optimizer: str = "adamw",
                   optimizer_kwargs: dict | None = None, prefetch: int = 1) -> dict[str, int]:
    """Bytes per rank of each model state, as `memory_report()` measures it."""
    k_state = optimizer_state_bytes(optimizer, **(optimizer_kwargs or {}))
    mem = dict(params=0, params_secondary=0, grads=0, optim=0)
    for u in units:
        sc = u.scopes
        f = Factors.of(sc, mesh)
        pb = nbytes(sc.params.dtype)
        for n, trainable in u.groups(mesh):
            mem["params"] += n // f.p * pb
            sec = sc.params.secondary
            if sec is not None and not u.root:
                mem["params_secondary"] += _secondary_bytes(n, f.q, sec.quant, sc.params.dtype)
            if trainable:
                mem["grads"] += n // f.g * nbytes(sc.grads.dtype)
                master = 4 if pb != 4 else 0
                mem["optim"] += n // f.os * (k_state + master)
    mem["total"] = sum(mem.values())
    mem["transient"] = transient_bytes(mesh, units, prefetch)
    return mem


def _gathered(u: UnitSize, mesh: Mesh) -> int:
    f = Factors.of(u.scopes, mesh)
    if f.p == 1:
        return 0
    return sum(n for n, _ in u.groups(mesh)) * nbytes(u.scopes.params.dtype)


def transient_bytes(mesh: Mesh, units: list[UnitSize], prefetch: int = 1) -> int:
    """Peak bytes of gathered (full) unit params held at once; see [Note: transient window]."""
    if not units:
        return 0
    root = _gathered(units[0], mesh) if units[0].root else 0
    rest = [_gathered(u, mesh) for u in units if not u.root]
    w = max(prefetch, 0) + 1
    window = max((sum(rest[i:i + w]) for i in range(max(len(rest) - w + 1, 1))), default=0)
    return root + window
