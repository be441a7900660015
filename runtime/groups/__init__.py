"""Units, flat groups and their storages — stage: runtime (both executors read them).

Input: the plan's `GroupPlan`s. Output: `UnitState` (`unit.py`), `FlatGroup` (`flat_group.py`),
`FlatStorage` (`storage.py`), their asserted states (`transitions.py`), slot layouts
(`layout.py`), reduce scratch (`workspace.py`) and the Comm each placement's groups run on
(`placed.py`).
"""
