"""Start-up memory — stage: lowering. A `Lowering` -> what a rank holds while its shards
get their values (explain's start-up peak; the runtime reads `LOAD_BLOCK`).

Input: the plan (`Lowering`: per group its persistent bytes, factors and rows).
Output: `startup_bytes(plan)` (bytes per rank: the shards plus the largest of the value
sources' staging), its parts `shards_bytes`, `unit_values_bytes`, `load_staging_bytes`,
and `LOAD_BLOCK`, the bound on a load's cast staging.

[Note: start-up peak]
While a model is sharded (runtime/build.py) a rank holds its shards: params, the hpZ
secondary and the fp32 master, all allocated before any value is given (a gathered group's
full buffer is never touched: runtime/storage.py [Note: nothing whole at build]); the grad
shards come at the first backward and the optimizer's moments at its first step. Beside
them, the values being given, one source per start-up:
  * init on the meta device: one module's whole parameters at a time; scatter: one unit's
    chunk. Both are bounded by the largest unit's whole parameters (params dtype, padded):
    `unit_values_bytes`;
  * a load (`shardc.load_safetensors`, runtime/state/checkpoint.py [Note: loads in place]):
    reads go straight into the shards (runtime/state/hf_reader.py [Note: reads straight
    into the shard]); a cast read stages at most `LOAD_BLOCK` bytes (no more than the
    largest params chunk, read from an fp32 file); a group whose master is separate (params not fp32) and whose
    params shard holds more than its master (s_P < s_OS, an update all-gather) re-makes the
    shard from the master: its OS chunk sent (params dtype) and the gather's output (the
    params shard), one group at a time. `load_staging_bytes` is the largest of these.
`startup_bytes` = the shards + the larger of the two, so a model whose figure fits starts
whichever way it gets its values. The mesh's first rank on the scatter path also holds the
model it was built with. Measured on the 124.7M Llama, 4 gloo ranks (docs/checkpoints.md):
a load grows a rank by 1 MiB under ZeRO-3, hpZ and PaRO-IIG (fp32).
"""
from __future__ import annotations

from shardc.lowering.ir import Lowering, Op, Phase

LOAD_BLOCK = 8 * 2 ** 20            # bytes: a load's cast (or off-CPU) read goes through one block this size


def shards_bytes(plan: Lowering) -> int:
    """params + hpZ secondary + separate fp32 master per rank (no grads before the first backward)."""
    return sum(g.params_bytes + g.secondary_bytes + g.master_bytes for u in plan.units for g in u.groups)


def unit_values_bytes(plan: Lowering) -> int:
    """The largest unit's whole parameters (params dtype, padded): init's and scatter's bound."""
    return max((sum(g.gathered_bytes or g.params_bytes * u.factors_of(g).p for g in u.groups) for u in plan.units),
               default=0)


def load_staging_bytes(plan: Lowering) -> int:
    """A load's largest staging (see [Note: start-up peak])."""
    chunk = max((g.n // u.factors_of(g).p * 4 for u in plan.units for g in u.groups), default=0)   # fp32 file
    staging = min(LOAD_BLOCK, chunk)
    for u in plan.units:
        for g in u.groups:
            f = u.factors_of(g)
            if g.trainable and g.master_bytes and f.p < f.os and g.row(Phase.UPDATE, Op.ALL_GATHER) is not None:
                staging = max(staging, g.params_bytes * f.p // f.os + g.params_bytes)
    return staging


def startup_bytes(plan: Lowering) -> int:
    """The start-up peak per rank (see [Note: start-up peak])."""
    return shards_bytes(plan) + max(unit_values_bytes(plan), load_staging_bytes(plan))
