"""The whole-step compiled executor (`backend="inductor"`) — stage: runtime.

Input: the units' flat storages and plan rows. Output: `GraphRuntime` (`mode.py`), the compiled
micro-batch and its twins (`step.py`, `sync.py`, `update.py`), the step's sync and update as
compiled graphs (`boundary.py` `GraphStepOps`), the Inductor backend that follows the plan's
schedule (`backend.py`), the hpZ secondary (`secondary.py`), the plan's rows as functional
collectives (`funcol.py`) and the codecs as custom ops (`quant_ops.py`).
"""
