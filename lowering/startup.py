"""Start-up memory — stage: lowering. A `Lowering` -> what a rank holds while its shards
get their values (explain's start-up peak; the runtime reads `LOAD_BLOCK`).

Input: the plan (`Lowering`: per group its persistent bytes, factors and rows).
Output: `startup_bytes(plan)` (bytes per rank: the shards plus the largest of the value
sources' staging), its parts `shards_bytes`, `unit_values_bytes`, `load_staging_bytes`,
and `LOAD_BLOCK`, the bound on a load's cast staging.

[Note: start-up peak]
While a model is sharded (runtime/build.py) a rank holds its shards: params, the hpZ
secondary and the fp32 master, all allocated before any value is given (a gathered group's
full buffer is made at its first gather: runtime/groups/storage.py [Note: nothing whole at
build]); the grad
shards come at the first backward and the optimizer's moments at its first step. Beside
them, the values being given, one source per start-up:
  * init on the meta device: the first rank runs it into one unit's padded buffer at a
    time and scatters it (runtime/state/init_first.py; on CPU no rank holds more than its
    shards and a round of the generator states its draws start from, 5 KB each, world + 4
    of them, but on the first rank the parameters an op other than a whole draw or fill
    read, until their group is sent), or, where it cannot send (runtime/build.py), every rank holds one
    module's whole parameters at a time; scatter: one unit's buffer. All are bounded by
    the largest unit's whole parameters (params dtype, padded): `unit_values_bytes`;
  * a load (`shardc.load_safetensors`, runtime/state/checkpoint.py [Note: loads in place]):
    reads go straight into the shards (runtime/state/hf_reader.py [Note: reads straight
    into the shard]); a cast read stages at most `LOAD_BLOCK` bytes (no more than the
    largest params chunk, read from an fp32 file); a group whose master is separate (params not fp32) and whose
    params shard holds more than its master (s_P < s_OS, an update all-gather) re-makes the
    shard from the master: its OS chunk sent (params dtype) and the gather's output (the
    params shard), one group at a time;
  * torch's recipe (`dcp.load(sm.state_dict())`, then `sm.load_state_dict` / `set_state_dict`:
    runtime/state/checkpoint.py [Note: the recipe loads in place]): the pieces DCP fills are
    views of the shards; torch's reader loads each saved chunk whole (torch.load of the
    item, then a copy of the overlap into the piece) and holds the previous item's tensor
    while it loads the next, so two saved chunks: at most two parameters of an fp32
    checkpoint, bounded by the two largest groups' φ·4 bytes (the plan knows groups, not
    parameters); then the re-make of a params shard as above, one group at a time.
`load_staging_bytes` is the largest of these.
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
    return max((sum(g.gathered_bytes or g.params_bytes * g.factors.p for g in u.groups) for u in plan.units),
               default=0)


def load_staging_bytes(plan: Lowering) -> int:
    """A load's largest staging (see [Note: start-up peak])."""
    chunk = max((g.n // g.factors.p * 4 for u in plan.units for g in u.groups), default=0)   # fp32 file
    staging = min(LOAD_BLOCK, chunk)
    phis = sorted((g.phi for u in plan.units for g in u.groups), reverse=True)
    staging = max(staging, sum(phis[:2]) * 4)           # torch's DCP reader: two saved chunks (see Note)
    for u in plan.units:
        for g in u.groups:
            f = g.factors
            if g.trainable and g.master_bytes and f.p < f.os and g.row(Phase.UPDATE, Op.ALL_GATHER) is not None:
                staging = max(staging, g.params_bytes * f.p // f.os + g.params_bytes)
    return staging


def startup_bytes(plan: Lowering) -> int:
    """The start-up peak per rank (see [Note: start-up peak])."""
    return shards_bytes(plan) + max(unit_values_bytes(plan), load_staging_bytes(plan))
