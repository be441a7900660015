"""shardc.lowering — stage 3 of the pipeline (after the DSL's parse, 1, and resolve, 2): a
Strategy and its units lowered to the one plan.

Input: a resolved `Strategy` (from `shardc.dsl`) and per-unit element counts.
Output: a `Lowering` (per-unit scopes, factors, padded flat groups, their collectives
with payload bytes = the ledger rows, storage bytes, and the forward/backward
schedule). It imports only the DSL's IR; the runtime executes the plan, the cost model
adds it up and codegen prints it (docs/internals.md "The plan").
"""
from shardc.lowering.ir import (Factors, GroupPlan, LedgerRecord, Lowering, Op, Over, Per, Phase, Placement, Row,
                                Schedule, Stage, UnitPlan)
from shardc.lowering.layout import RankPlan, coords, factors, mixed_index, pad_multiple, padded
from shardc.lowering.lower import UnitSize, lower, lower_unit, placement, unit_sizes
from shardc.lowering.rows import (BLOCK, CLIP_BYTES, PHASE_ORDER, code_bytes, elem_bytes, ledger_key, master_is_params, merged,
                                  payload_bytes, shard_payload_bytes)
from shardc.lowering.schedule import schedule
from shardc.lowering.transients import (A2A_RS_BACKENDS, REDUCE_IN_FLIGHT, RELEASE_GRADS, RS_RECV_BYTES,
                                        RS_RECV_FLOOR, STAGING_BYTES, STAGING_OVER, SYNC_IN_FLIGHT,
                                        recv_block_bytes, recv_bytes, staging_block)
from shardc.lowering.experts import ExpertGroup, expert_group, is_expert
from shardc.lowering.placements import PlacementKind
from shardc.lowering.scopes import (kind_for, kinds_of, over_of, placement_meshes, row_mesh, unit_scopes,
                                    unused_override)

__all__ = ["A2A_RS_BACKENDS", "BLOCK", "CLIP_BYTES", "ExpertGroup", "expert_group",
           "is_expert", "kind_for", "kinds_of", "over_of", "PlacementKind", "placement_meshes", "row_mesh", "Factors", "ledger_key", "GroupPlan", "LedgerRecord", "Lowering", "Op", "Over", "Per", "Phase", "Placement", "placement", "RankPlan",
           "Row", "Schedule", "Stage", "UnitPlan", "UnitSize", "code_bytes", "coords", "elem_bytes", "factors", "lower",
           "lower_unit", "master_is_params", "merged", "mixed_index", "PHASE_ORDER", "pad_multiple", "RS_RECV_BYTES", "RS_RECV_FLOOR", "recv_block_bytes", "recv_bytes", "padded", "payload_bytes", "schedule",
           "shard_payload_bytes", "STAGING_BYTES", "STAGING_OVER", "staging_block", "SYNC_IN_FLIGHT", "REDUCE_IN_FLIGHT", "RELEASE_GRADS", "unit_scopes", "unit_sizes", "unused_override"]
