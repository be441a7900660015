"""The eager executor — stage: runtime.

Input: the plan's schedule and rows, the units' flat groups. Output: the `Engine` that follows
the schedule (`engine.py`), the step's collectives issued unit by unit (`step_ops.py`
`EagerStepOps`), the collective algorithms as async ops (`collectives.py`), the interface a flat
group talks to (`comm.py` `UnitCollectives`, `Comm`) and its fault guard (`faults.py`).
"""
