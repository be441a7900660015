"""Placements at run time — stage: runtime (construction). Where each placement kind's flat
groups run.

Input: the strategy's placement kinds besides the units' own (`shardc.lowering.kinds_of`:
the `experts` statement's, the registered ones), the strategy's `Comm` and the model's
parameters. Output: `Placed`: the Comm of each placement (`Over` -> Comm), the DTensor
parameters a kind places itself (the experts'), and the sentence refusing shardc's init
where a kind's values cannot come from it yet; and the process groups of every placement,
created up front (`warm_groups`).

[Note: a kind on a mesh of its own]
A kind whose placement is on the strategy's mesh runs its groups on the strategy's Comm:
it needs nothing here. A kind on a mesh of its own has a runtime file, named in `OWN_MESH`,
that makes that mesh's `ShardMesh` from the strategy's and validates the parameters it
places (the experts': runtime/transport/experts.py, with ep 1 on the strategy's mesh). Its
groups get a Comm of their own on that mesh, recording into the module's one ledger, so a
row's ledger record carries its placement's `Over` and the ledger and the cost model add
it up over that mesh (lowering/placements.py [Note: placement kinds]).
"""
from __future__ import annotations

from typing import NamedTuple

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Strategy
from shardc.lowering import Over, RankPlan

from ..eager.comm import Comm
from ..transport import experts

# kind -> its runtime: (kind, the strategy's ShardMesh, canonical name -> parameter) -> an
# object with `smesh` (its mesh), `params` (name -> TPParam) and `no_init` (why shardc cannot
# initialize it on meta), or None where it runs on the strategy's mesh after all
OWN_MESH = {Over.EXPERTS: experts.expert_runtime}


class Placed(NamedTuple):
    comms: dict                        # Over -> the Comm its groups' rows run on
    params: dict                       # canonical name -> TPParam: the kinds' DTensor parameters
    no_init: str | None                # why shardc's init cannot give the values (None: it can)


def placed(kinds, comm: Comm, strategy: Strategy, params: dict) -> Placed:
    """Each placement's Comm and the kinds' DTensor parameters ([Note: a kind on a mesh of its own])."""
    comms, dtensors, no_init = {Over.DENSE: comm}, {}, None
    for k in kinds:
        make = OWN_MESH.get(k.over)
        rt = make(comm.smesh, k, params) if make is not None else None
        if rt is None:
            comms[k.over] = comm
            continue
        comms[k.over] = Comm(rt.smesh.mesh, strategy.collectives, comm.ledger, rt.smesh)
        dtensors |= rt.params
        no_init = no_init or rt.no_init
    return Placed(comms, dtensors, no_init)


def refuse_graph(kinds, strategy: Strategy, backend: str) -> None:
    """A placement kind besides the units' own does not run in the whole-step mode yet: one
    sentence, located at the statement that makes it."""
    k = next(iter(kinds), None)
    if k is None or backend != "inductor":
        return
    where = "" if k.line is None else (f"{strategy.file}:{k.line}: " if k.line else f"{strategy.file}: ")
    raise ShardcError(f"{where}backend='inductor' does not take {k.named} yet; use the eager runtime "
                      f"(backend='eager')")


def warm_groups(comms: dict, kinds, mesh, specs) -> None:
    """Create every process group up front, in the same order on every rank: each unit's own
    scopes' on the strategy's mesh (`mesh`), then each kind's placement of each unit's."""
    scopes = [(spec.scopes, comms[Over.DENSE]) for spec in specs]
    scopes += [(k.placement(mesh, spec.scopes).scopes, comms[k.over]) for k in kinds for spec in specs]
    for sc, c in scopes:
        plan = RankPlan(c.smesh.mesh, sc, c.rank)
        for lv in plan.groups():
            if lv and plan.s(lv) > 1:
                c.smesh.group(lv)
