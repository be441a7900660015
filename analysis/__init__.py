"""shardc.analysis — what a strategy costs, predicted without running anything.

`costmodel`: Strategy + the model's unit sizes -> memory per rank, the communication
ledger, bytes per link level, a step-time estimate (read by `shardc explain`, the
planner, and the compiler when it resolves `collectives auto`). `planner`: every
dependency-rule-respecting scope assignment on a mesh, ranked by that cost model
(read by `shardc plan`). Imports: the DSL's IR (and the lowering's plan), never the CLI.
"""
