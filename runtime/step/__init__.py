"""The step both executors share — stage: runtime.

Input: the units and an executor's step ops. Output: `StepBoundary` (`boundary.py`), torch
optimizers adopted (`optimizer.py`), `clip_grad_norm_` (`clip.py`) and tensor-owned steps
(`owned.py`).
"""
