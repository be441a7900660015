"""ShardMesh: coordinates, group membership and positions, caching (4 and 8 gloo ranks)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from shardc.dsl.ir import Level, Mesh
from tests.harness import dist_run

pytestmark = pytest.mark.distributed

M22 = Mesh((Level("node", 2), Level("gpu", 2)))
M24 = Mesh((Level("node", 2), Level("gpu", 4)))
M222 = Mesh((Level("a", 2), Level("b", 2), Level("c", 2)))
M2x1x4 = Mesh((Level("node", 2), Level("socket", 1), Level("gpu", 4)))


def _expected(mesh: Mesh, rank: int, order: tuple[str, ...]):
    """Group members by position, from the definition (not from the code under test)."""
    sizes = [l.size for l in mesh.levels]
    coords = lambda r: [(r // prod_after(sizes, i)) % sizes[i] for i in range(len(sizes))]
    mine = coords(rank)
    members = [r for r in range(mesh.world)
               if all(coords(r)[i] == mine[i] for i, n in enumerate(mesh.names) if n not in order)]
    def pos(r):
        c = dict(zip(mesh.names, coords(r)))
        idx = 0
        for n in order:
            idx = idx * mesh.size(n) + c[n]
        return idx
    return sorted(members, key=pos), pos(rank)


def prod_after(sizes, i):
    p = 1
    for s in sizes[i + 1:]:
        p *= s
    return p


def _check_mesh(rank, world, mesh):
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh.get(mesh)
    assert ShardMesh.get(mesh) is sm and ShardMesh(mesh) is sm
    checked = []
    for k in range(1, len(mesh.names) + 1):
        for levels in itertools.combinations(mesh.names, k):
            for order in itertools.permutations(levels):
                pg = sm.group(levels, order)
                members, pos = _expected(mesh, rank, order)
                if len(members) == 1:
                    assert pg is None
                    continue
                assert sm.group(tuple(reversed(levels)), order) is pg    # cached, levels in any order
                assert sm.index(levels, order) == pos
                assert dist.get_rank(pg) == pos
                assert dist.get_world_size(pg) == len(members)
                assert sm.group_ranks(levels, order) == members
                got = [torch.zeros(1, dtype=torch.long) for _ in members]
                dist.all_gather(got, torch.tensor([rank]), group=pg)
                assert [int(g) for g in got] == members, (levels, order)
                checked.append(order)
    coords = tuple(sm.coord(n) for n in mesh.names)
    return coords, len(checked)


@pytest.mark.parametrize("mesh", [M22, M24, M222, M2x1x4], ids=str)
def test_groups_match_definition(mesh):
    out = dist_run(mesh.world, _check_mesh, mesh)
    sizes = [l.size for l in mesh.levels]
    for r, (coords, n) in enumerate(out):
        assert coords == tuple((r // prod_after(sizes, i)) % sizes[i] for i in range(len(sizes)))
        assert n > 0


def _rank6_coords(rank, world):
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh.get(M24)
    return sm.coord("node"), sm.coord("gpu"), sm.index(("node", "gpu"), ("gpu", "node"))


def test_innermost_fastest():
    # node(2) > gpu(4): rank 6 is node 1, gpu 2; over order (gpu, node) it sits at 2*2+1 = 5
    assert dist_run(8, _rank6_coords)[6] == (1, 2, 5)


def _no_group_leak(rank, world):
    from shardc.runtime.transport.mesh import ShardMesh

    for _ in range(50):
        sm = ShardMesh(M22)
        sm.group(("node", "gpu"), ("gpu", "node"))
        sm.group(("node", "gpu"))
    return len(dist.distributed_c10d._world.pg_map)


def test_groups_are_cached_across_calls():
    before = dist_run(4, _no_group_leak)
    after = dist_run(4, _no_group_leak)
    assert before == after


def _wrong_world(rank, world):
    from shardc.dsl.errors import ShardcError
    from shardc.runtime.transport.mesh import ShardMesh

    try:
        ShardMesh(M24)
    except ShardcError as e:
        return str(e)
    return None


def test_world_mismatch_is_a_clear_error():
    msgs = dist_run(4, _wrong_world)
    assert all(m and "8 ranks but the job has 4" in m for m in msgs)
