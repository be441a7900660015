"""Units, flat groups and their storages — stage: runtime (both executors read them).

Input: the plan's `GroupPlan`s. Output: `UnitState` (`unit.py`), `FlatGroup` (`flat_group.py`),
`FlatStorage` (`storage.py`), their asserted states (`transitions.py`), slot layouts
(`layout.py`) and reduce scratch (`workspace.py`).
"""
