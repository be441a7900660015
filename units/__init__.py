"""shardc.units — stage: units (Strategy + model -> the unit table), below the compiler and
the cost model, read by both and by the runtime.

Input: an `nn.Module` and a `Strategy` with its bucket size decided. Output: the unit
table, `UnitSpec`s root first (units/spec.py), which parameters each unit gathers
(units/find.py), consecutive small units merged (units/bucket.py), and the membership
rule every table obeys (units/members.py). It imports `torch.nn`, the DSL's IR and the
lowering's `unit_scopes`; the cost model (which sizes buckets) and the compiler import
it, never the other way.
"""
from shardc.units.bucket import bucket_runs, merge
from shardc.units.find import find_units, reorder, unit_bytes
from shardc.units.members import unit_members
from shardc.units.spec import ROOT, UnitSpec, canonical_names, local_params, param_owners

__all__ = ["ROOT", "UnitSpec", "bucket_runs", "canonical_names", "find_units", "local_params", "merge", "param_owners", "reorder",
           "unit_bytes", "unit_members"]
