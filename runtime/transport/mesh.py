"""Mesh and process groups — runtime layer under the collectives.

Input: a `shardc.dsl.ir.Mesh` and the default process group (torchrun / `dist_run`).
Output: `ShardMesh`, which answers "which ranks share my chunk over these levels, and
where am I among them" with cached `ProcessGroup`s built from a `DeviceMesh`.

[Note: rank layout]
Rank r's coordinates are the mixed-radix digits of r over the level sizes in mesh
order, the innermost (last) level varying fastest: on mesh node(2) > gpu(4), rank 6 is
node 1, gpu 2. `group(levels, order)` holds the ranks agreeing with this rank on every
level outside `levels`; a member's position is the mixed-radix number of its coords
over `order` (first digit most significant). Size-1 levels never change a position, so
they are dropped before the cache lookup.

[Note: where the groups come from]
`device_mesh` is the DeviceMesh the user gave (`mesh=`: the world's or a sub-mesh such as
`world_mesh["node", "gpu"]`, whose dims are the strategy's levels: `check_device_mesh`),
or else one shardc builds over the rank tensor arange(world).reshape(sizes) with the
level names as mesh_dim_names. Either is of the tensors' device type (its groups run on
the default group's backend for that type: NCCL for CUDA, gloo for CPU;
runtime/transport/device.py) and has one group per level. `rank` is this rank's position in the
mesh (its coordinates' mixed-radix number), `global_rank` its rank in the world: with a
sub-mesh the two differ, and the mesh's ranks are the global ranks its tensor lists. A multi-level group in mesh order is
`device_mesh[levels]._flatten(name)` — DeviceMesh's own flattening. A group whose
`order` is not mesh order cannot come from DeviceMesh: c10d sorts a group's ranks
unless asked not to, and DeviceMesh always creates sorted groups, so positions would
follow mesh order. Those groups (and only those) are made with
`dist.new_group(ranks, sort_ranks=False)`, one per subgroup of the whole root mesh (every
sub-mesh like this one, so every rank of the world makes the same calls), so the group
rank equals the `order` index and a flat collective places chunks by `order` directly.
Nothing shardc issues runs on the default group: rank-0 broadcasts and object gathers
run on `dp_group()`, the group of every rank of this mesh.

[Note: collective creation order]
Per-level groups are created eagerly in `__init__`; flattened and reordered groups
lazily, on first use, and cached per (levels, order). Creating a group is collective
over the world, so every rank must ask for the same new groups in the same order. The
runtime guarantees it (all ranks run the same program over the same strategy), and
`ShardMesh(mesh)` (alias `ShardMesh.get`) returns one cached instance per (Mesh,
device_type) and default process group in the process, so sharding many models in one
worker reuses the groups instead of leaking new gloo groups.
"""
from __future__ import annotations

from math import prod

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Mesh
from shardc.lowering import coords, mixed_index

from . import device

_CACHE: dict[tuple, "ShardMesh"] = {}


class ShardMesh:
    """A Mesh bound to the running world: coordinates, cached process groups.

    [Note: one ShardMesh per mesh, process-wide]
    `ShardMesh(mesh, device_type, device_mesh)` returns the same object for the same mesh,
    device type and DeviceMesh while the default process group is the same (`__new__`
    caches it in `_CACHE`): every ShardedModule of a process on one mesh shares its process
    groups, which are collective to create and costly to make twice. A new default group
    (a test's fresh world, a restarted job) makes a new one and evicts every entry of the
    old group (they can never be returned again). Meshes derived from one (the experts'
    mesh, runtime/transport/experts.py) are kept on it (`derived`), so they live and die with it."""

    def __new__(cls, mesh: Mesh, device_type: str = "cpu", device_mesh: DeviceMesh | None = None):
        default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        key = (mesh, device_type, None if device_mesh is None else id(device_mesh))
        cached = _CACHE.get(key)
        if cached is not None and cached._default is default and cached._given is device_mesh:
            return cached
        self = super().__new__(cls)
        self._init(mesh, device_type, device_mesh)
        self._default, self._given = default, device_mesh
        for k in [k for k, v in _CACHE.items() if v._default is not default]:
            del _CACHE[k]                   # an old world's: never returned again
        _CACHE[key] = self
        return self

    def derived(self, key: tuple, make):
        """The mesh(es) `make()` derives from this one, made once per `key` (runtime/transport/experts.py)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def _init(self, mesh: Mesh, device_type: str, given: DeviceMesh | None) -> None:
        if not dist.is_initialized():
            raise ShardcError("the default process group is not initialized; "
                              "run under torchrun or call torch.distributed.init_process_group first")
        device.check_backend(device_type)           # a clear error before DeviceMesh fails
        self.mesh = mesh
        self.device_type = device_type
        self.global_rank = dist.get_rank()
        if given is None:
            world = dist.get_world_size()
            if world != mesh.world:
                raise ShardcError(f"mesh {mesh} has {mesh.world} ranks but the job has {world}; "
                                  f"launch with --nproc-per-node/--nnodes matching the mesh")
            sizes = tuple(l.size for l in mesh.levels)
            given = DeviceMesh(device_type, torch.arange(world, dtype=torch.int).reshape(sizes),
                               mesh_dim_names=mesh.names)
        else:
            check_device_mesh(mesh, given, device_type)
        self.device_mesh = given
        self.world = given.size()
        coord = given.get_coordinate()
        if coord is None:
            raise ShardcError(f"rank {self.global_rank} is not in the DeviceMesh it was given "
                              f"({given.mesh.flatten().tolist()}); pass each rank the sub-mesh it belongs to")
        self.rank = _linear(mesh, coord)            # this rank's position in the mesh
        self._root = given._get_root_mesh()
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._derived: dict[tuple, object] = {}     # `derived`: meshes made from this one

    @classmethod
    def get(cls, mesh: Mesh, device_type: str = "cpu", device_mesh: DeviceMesh | None = None) -> "ShardMesh":
        """The process-wide ShardMesh for `mesh` (same as `ShardMesh(mesh)`, which is cached)."""
        return cls(mesh, device_type, device_mesh)

    def __repr__(self) -> str:
        return f"ShardMesh({self.mesh!r}, device_type={self.device_type!r})"

    # -- coordinates -------------------------------------------------------------------
    def coord(self, level: str) -> int:
        return self.coords_of(self.rank)[self.mesh.names.index(level)]

    def coords_of(self, rank: int) -> tuple[int, ...]:
        """Mixed-radix digits of `rank` over the mesh sizes, outermost first."""
        return coords(self.mesh, rank)

    def digits(self, levels, order=None) -> tuple[str, ...]:
        """Validated digit order with size-1 levels dropped (they never move a position)."""
        lv = self.mesh.ordered(levels)
        unknown = set(levels) - set(self.mesh.names)
        if unknown:
            raise ShardcError(f"unknown mesh level(s) {sorted(unknown)}; the mesh has {list(self.mesh.names)}")
        order = lv if order is None else tuple(order)
        if sorted(order) != sorted(lv):
            raise ValueError(f"order {order} must be a permutation of levels {lv}")
        return tuple(l for l in order if self.mesh.size(l) > 1)

    def index(self, levels, order=None) -> int:
        """This rank's position in `group(levels, order)`."""
        return self.index_of(self.rank, levels, order)

    def index_of(self, rank: int, levels, order=None) -> int:
        return mixed_index(self.mesh, rank, self.digits(levels, order))

    def group_ranks(self, levels, order=None) -> list[int]:
        """Global ranks of this rank's group, listed by position."""
        return self._subgroups(self.digits(levels, order))[self._mine(self.digits(levels, order))]

    # -- groups ------------------------------------------------------------------------
    def group(self, levels, order=None) -> dist.ProcessGroup | None:
        """Ranks agreeing on every level outside `levels`, positioned by `order`; None when factor 1."""
        key = self.digits(levels, order)
        if not key:
            return None
        pg = self._groups.get(key)
        if pg is None:
            pg = self._groups[key] = self._build(key)
        return pg

    def process_groups(self) -> list[dist.ProcessGroup]:
        """Every process group this mesh has made: its DeviceMesh's per-level groups and the
        flattened or reordered groups built so far."""
        dm = self.device_mesh
        made = [g for g in self._groups.values() if g is not None]
        return [dm.get_group(name) for name in dm.mesh_dim_names or ()] + made

    def _build(self, key: tuple[str, ...]) -> dist.ProcessGroup:
        if len(key) == 1:
            return self.device_mesh.get_group(key[0])
        if key == self.mesh.ordered(key):
            return self.device_mesh[key]._flatten("+".join(key)).get_group()
        mine = None
        for ranks in self._subgroups(key):          # same list, same order, on every rank
            pg = dist.new_group(ranks=ranks, sort_ranks=False, group_desc="shardc_" + "+".join(key))
            if self.global_rank in ranks:
                mine = pg
        return mine

    def _subgroups(self, key: tuple[str, ...]) -> list[list[int]]:
        """Every group for digit order `key` in the whole root mesh (every sub-mesh like this
        one: the same list on every rank of the world, see [Note: collective creation order]),
        each listed by position (global ranks), in rank order of its first member."""
        names = tuple(self._root.mesh_dim_names or ())
        if not set(key) <= set(names):              # a given mesh without named root dims
            names, ranks = self.mesh.names, self.device_mesh.mesh
        else:
            ranks = self._root.mesh
        outside = [n for n in names if n not in key]
        perm = [names.index(n) for n in outside] + [names.index(n) for n in key]
        t = ranks.permute(perm).reshape(-1, prod(self.mesh.size(n) for n in key))
        return [row.tolist() for row in t]

    def _mine(self, key: tuple[str, ...]) -> int:
        return next(i for i, g in enumerate(self._subgroups(key)) if self.global_rank in g)

    def dp_group(self) -> dist.ProcessGroup | None:
        """Every rank of this mesh (None for one rank): where rank-0 broadcasts and object
        gathers run, never on the default group (a tensor-parallel peer is not a replica)."""
        return self.group(self.mesh.names)

    def factor(self, levels) -> int:
        return self.mesh.factor(tuple(levels))


def _linear(mesh: Mesh, coord) -> int:
    """The rank index whose mixed-radix digits (mesh order) are `coord`."""
    idx = 0
    for level, c in zip(mesh.levels, coord):
        idx = idx * level.size + int(c)
    return idx


def check_device_mesh(mesh: Mesh, dm: DeviceMesh, device_type: str) -> None:
    """A DeviceMesh given as the mesh must be the strategy's mesh: its dims the levels (names,
    order, sizes) and its device type the model's; one sentence naming both sides otherwise."""
    names = tuple(dm.mesh_dim_names or ())
    sizes = tuple(dm.mesh.shape)
    if names != mesh.names:
        raise ShardcError(f"the DeviceMesh's dims are {', '.join(names) or '(unnamed)'} but the strategy's mesh "
                          f"levels are {', '.join(mesh.names)}; pass the sub-mesh of those levels, e.g. "
                          f"world_mesh[{', '.join(repr(n) for n in mesh.names)}]")
    if sizes != tuple(l.size for l in mesh.levels):
        shown = " > ".join(f"{n}({k})" for n, k in zip(names, sizes))
        raise ShardcError(f"the DeviceMesh is {shown} but the strategy's mesh is {mesh}; compile for the "
                          f"DeviceMesh (mesh=the DeviceMesh) or pass one of the strategy's sizes")
    if dm.device_type != device_type:
        raise ShardcError(f"the DeviceMesh is a {dm.device_type} mesh but the model's parameters are on "
                          f"{device_type}; build the mesh with init_device_mesh({device_type!r}, ...) or move "
                          f"the model")
