"""Unit membership — stage: units (a unit table + the model's parameter names -> each
unit's canonical parameters, or the error that says which rule fails).

Input: a unit table (root first) and `canonical`, every FQN a parameter of the model is
reachable under -> its canonical name (`canonical_names`, units/spec.py). Output: per
unit, the canonical names it holds, in its listed order. The compiler's `check` pass
(on the captured unit table) and `shard_module` (on whatever units it is given) both
apply this rule; each passes the error class it raises.

[Note: unit membership]
- the table starts with the root unit "<root>";
- every listed name is a parameter of the model (a tied alias counts as its canonical
  name: listing both in one unit is one entry);
- no parameter lies in two units: listed twice under one name, or tied and listed under
  two names in different units (tied parameters must share one unit);
- every parameter lies in some unit.
"""
from __future__ import annotations

from collections.abc import Mapping

from shardc.dsl.errors import ShardcError
from shardc.units.spec import ROOT

__all__ = ["unit_members"]


def unit_members(units, canonical: Mapping[str, str], error: type[Exception] = ShardcError) -> list[tuple[str, ...]]:
    """Each unit's canonical parameter names under [Note: unit membership]; raises `error`."""
    if not units or units[0].name != ROOT:
        raise error(f"the unit list must start with the root unit '{ROOT}'")
    seen: dict[str, tuple[str, str]] = {}           # canonical -> (unit, name it was listed as)
    out = []
    for u in units:
        names = []
        for name in u.params:
            canon = canonical.get(name)
            if canon is None:
                raise error(f"unit {u.name!r} lists {name!r}, which is not a parameter of the model")
            if canon in seen and seen[canon][0] != u.name:
                first_unit, first_name = seen[canon]
                if first_name == name:
                    raise error(f"parameter {name!r} is listed in more than one unit ({first_unit!r} and {u.name!r})")
                raise error(f"parameter {canon!r} is in units {first_unit!r} and {u.name!r}; "
                            f"tied parameters must share one unit")
            if canon not in seen:
                seen[canon] = (u.name, name)
                names.append(canon)
        out.append(tuple(names))
    missing = [n for n in dict.fromkeys(canonical.values()) if n not in seen]
    if missing:
        raise error(f"parameter {missing[0]!r} is in no unit (every parameter needs one)")
    return out
