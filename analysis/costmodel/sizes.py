"""Unit sizes — the cost model's view of the model.

Input: a model (any device, `meta` included) and its units (`UnitSpec`s from
`find_units`, root first). Output: one `UnitSize` per unit (trainable and frozen
element counts plus the unit's resolved scopes), and the padding rule of
docs/internals.md. Nothing here allocates or touches parameter data.

[Note: padding]
A group of Φ elements is stored as N = round_up(Φ, L) elements, with
L = lcm(s_P, s_G, s_OS, s_Q) for the trainable group and lcm(s_P, s_Q) for the frozen
group (s_Q = 1 without a secondary copy). Every chunk size N/s is then an integer and
every rank holds the same sizes; all ledger and memory figures use N, not Φ.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import lcm

from shardc.dsl.ir import Mesh, Scopes


@dataclass(frozen=True, slots=True)
class Factors:
    """Shard factors of one unit's scopes on a mesh."""
    p: int
    g: int
    os: int
    q: int          # secondary factor (1 without secondary)

    @classmethod
    def of(cls, scopes: Scopes, mesh: Mesh) -> "Factors":
        sec = scopes.params.secondary
        return cls(
            p=mesh.factor(scopes.params.levels),
            g=mesh.factor(scopes.grads.levels),
            os=mesh.factor(scopes.optim.levels),
            q=mesh.factor(sec.levels) if sec is not None else 1,
        )


@dataclass(frozen=True, slots=True)
class UnitSize:
    """Element counts of one unit (before padding) and its resolved scopes."""
    name: str
    trainable: int
    frozen: int
    scopes: Scopes
    root: bool = False

    def groups(self, mesh: Mesh) -> list[tuple[int, bool]]:
        """`(N, trainable)` for each non-empty flat group, padded."""
        f = Factors.of(self.scopes, mesh)
        out = []
        if self.trainable:
            out.append((padded(self.trainable, lcm(f.p, f.g, f.os, f.q)), True))
        if self.frozen:
            out.append((padded(self.frozen, lcm(f.p, f.q)), False))
        return out


def padded(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def unit_sizes(model, units) -> list[UnitSize]:
    """Sizes of `units` (UnitSpecs, root first) read from `model`'s parameters.

    Parameters are looked up by canonical FQN (tied aliases are excluded by the unit
    finder, so each element is counted once); only `numel()` and `requires_grad` are
    read, so a meta-device model works.
    """
    params = dict(model.named_parameters())
    out = []
    for i, u in enumerate(units):
        trainable = frozen = 0
        for fqn in u.params:
            p = params[fqn]
            if p.requires_grad:
                trainable += p.numel()
            else:
                frozen += p.numel()
        out.append(UnitSize(u.name, trainable, frozen, u.scopes, root=(i == 0)))
    return out


def payload_bytes(n: int, s: int, dtype) -> int:
    """Bytes of one collective's payload (docs/internals.md), from the runtime.

    The formula lives in the runtime (`shardc.runtime.quant.payload_bytes`); it is
    imported lazily so the cost model does not duplicate it and `explain` loads no
    torch.distributed machinery it does not need.
    """
    from shardc.runtime.quant import payload_bytes as _payload
    return _payload(n, s, dtype)
