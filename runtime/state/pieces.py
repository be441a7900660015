"""Pieces — stage: runtime (state). One rank's part of one parameter, as torch's tools see it.

Input: a flat group's layout and its chunk of the flat buffer (the fp32 master of a
trainable group, over the optim levels; the params shard of a frozen one, over the
params levels), and this rank's tensor holding that chunk.
Output: `PieceSpec` (where the piece lies: elements [lo, hi) of the parameter, and the
chunk every other rank of the group holds), `gather` (the whole parameter from every
rank's piece, a collective), `wrap` (a piece as a DCP-ready `ShardcPiece` DTensor),
`local_piece` (this rank's elements of a loaded value).

[Note: uneven pieces as DCP chunks]
A rank's chunk of a unit's flat buffer covers an arbitrary element range [lo, hi) of a
parameter, not whole rows. `boxes` splits that range of a row-major tensor into at most
2·ndim−1 rectangular boxes, each a contiguous run of the range. A piece is a DTensor
(global shape = the parameter's) whose local tensor is a `_Flat` holding the range; DTensor
forwards DCP's `__create_write_items__` / `__create_chunk_list__` / `__get_tensor_shard__`
to its local tensor (the hook Megatron-FSDP's uneven DTensors use), and `_Flat` answers
with one chunk per box. Replicas write the same boxes and DCP's planner dedups them.
A parameter's piece is a view of the live shard, as FSDP2's DTensors are: `dcp.load` fills
the shard itself (runtime/state/checkpoint.py [Note: the recipe loads in place]); an
optimizer state's piece views the live state tensor the same way.

[Note: the padding rides on the last piece]
A flat group's buffer is padded to a multiple of its factors (shardc.lowering); the
padding sits after its last parameter, and the optimizer states cover it, as `explain`
counts them (N·K/s_OS per rank). So the last parameter's tensor on a rank whose chunk holds
padding is its piece followed by that padding (`pad` elements, zero gradients, never
saved): an optimizer over the parameters holds exactly the planned state. Everything
that reads a piece's values takes its first `hi - lo` elements.

[Note: torch's full-state-dict recipes]
torch's `get_model_state_dict(..., full_state_dict=True)` (and the optimizer's) turns each
DTensor into a whole tensor by `redistribute(placements=[Replicate()...]).to_local()`, and
`set_state_dict(..., broadcast_from_rank0=True)` writes a broadcast whole tensor into
`value.to_local()` with `copy_`. A piece's DTensor placements say Replicate (each rank's
piece is where DCP's chunks say, not where `Shard` would put it), so DTensor's own
redistribute would hand back the bare piece. `ShardcPiece` is the DTensor subclass that
answers both recipes for itself: `full_tensor()` / `redistribute(Replicate...)` gather the
whole parameter from every rank's piece (`gather`, over the group's own levels, replicas
not asked twice), and `copy_` of a whole tensor into its `_Flat` local keeps this rank's
elements of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from shardc.lowering import Over

from ..errors import RuntimeUsageError


@dataclass(frozen=True, slots=True)
class PieceSpec:
    """Where one rank's piece of one parameter lies (see the module notes)."""
    name: str                        # canonical FQN
    shape: tuple[int, ...]           # the parameter's shape on this rank (a DTensor's local shard)
    offset: int                      # the parameter's first element in the group's flat buffer
    chunk: int                       # elements per rank's chunk of the flat buffer
    levels: tuple[str, ...]          # the levels the chunks are spread over (mesh order)
    order: tuple[str, ...]           # their digit order (shardc.lowering)
    ranks: int                       # how many chunks: the ranks over `levels`
    index: int                       # this rank's chunk index over `levels`
    tp: object = None                # its TPParam (runtime/state/dtensor_params.py), or None
    pad: int = 0                     # padding elements after the piece in this rank's tensor (see Note)
    comm: object = None              # its group's Comm where not the module's (the experts' mesh)
    over: Over = Over.DENSE          # the mesh its group is placed over (its Comm's)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def range_of(self, c: int) -> tuple[int, int]:
        """Elements [a, b) of the parameter in chunk c (a == b when they do not meet)."""
        a = max(c * self.chunk, self.offset) - self.offset
        b = min((c + 1) * self.chunk, self.offset + self.numel) - self.offset
        return (a, b) if a < b else (0, 0)

    @property
    def lo(self) -> int:
        return self.range_of(self.index)[0]

    @property
    def hi(self) -> int:
        return self.range_of(self.index)[1]

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.tp.shape) if self.tp is not None else self.shape


def gather(comm, spec: PieceSpec, local: torch.Tensor) -> torch.Tensor:
    """The whole parameter (global shape) from every rank's piece: one all-gather over the
    piece's levels, each rank's piece padded to the longest, then a tp all-gather for a
    DTensor parameter. Collective (every rank of the mesh); not recorded in the ledger."""
    comm = spec.comm or comm
    ranges = [spec.range_of(c) for c in range(spec.ranks)]
    local = local.detach().reshape(-1)[:spec.hi - spec.lo]
    if spec.ranks == 1:
        full = local.clone()
    else:
        longest = max(1, max(b - a for a, b in ranges))
        send = torch.zeros(longest, dtype=local.dtype, device=local.device)
        send[:local.numel()].copy_(local)
        out = torch.empty(spec.ranks * longest, dtype=local.dtype, device=local.device)
        comm.gather(out, send, spec.levels, spec.order)
        full = torch.cat([out[c * longest:c * longest + b - a] for c, (a, b) in enumerate(ranges)])
    full = full.view(spec.shape)
    return spec.tp.full(full.contiguous()) if spec.tp is not None else full


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple, int, int]]:
    """(offsets, sizes, flat_lo, flat_hi) boxes covering elements [lo, hi) of `shape`."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), lo, hi)]
    inner = prod(shape[1:])
    r0, r1 = lo // inner, (hi - 1) // inner
    if lo % inner == 0 and hi % inner == 0:
        return [((r0,) + (0,) * (len(shape) - 1), (r1 - r0 + 1,) + tuple(shape[1:]), lo, hi)]
    if r0 == r1:
        base = r0 * inner
        return [((r0,) + o, (1,) + s, a + base, b + base)
                for o, s, a, b in boxes(tuple(shape[1:]), lo - base, hi - base)]
    head, tail = -(-lo // inner) * inner, (hi // inner) * inner
    return boxes(shape, lo, head) + boxes(shape, head, tail) + boxes(shape, tail, hi)


class _Flat(torch.Tensor):
    """A rank's elements [lo, hi) of a parameter-shaped tensor, flattened (DCP hooks; see
    [Note: uneven pieces as DCP chunks] and [Note: torch's full-state-dict recipes])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(args[0], _Flat) and not isinstance(args[1], _Flat):
            dst, src = args[0], args[1]
            if src.numel() != dst.numel() and src.numel() == prod(dst._shardc_shape):
                spec = dst._shardc_spec           # a whole tensor: keep this rank's elements
                src = local_piece(src, spec.shape, spec.lo, spec.hi, repr(spec.name), spec.tp)
            with torch._C.DisableTorchFunctionSubclass():
                torch.Tensor.copy_(dst, src.reshape(dst.shape), **{k: v for k, v in kwargs.items()
                                                                   if k == "non_blocking"})
            return dst
        return super().__torch_function__(func, types, args, kwargs)

    def __deepcopy__(self, memo):
        new = self.as_subclass(torch.Tensor).clone().as_subclass(_Flat)
        new._shardc_boxes, new._shardc_shape = list(self._shardc_boxes), self._shardc_shape
        new._shardc_spec, new._shardc_comm = self._shardc_spec, self._shardc_comm
        new._shardc_values = getattr(self, "_shardc_values", None)
        memo[id(self)] = new
        return new

    def _chunks(self):
        for off, size, a, b in self._shardc_boxes:
            yield ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)), a, b

    def __create_chunk_list__(self):
        return [c for c, _, _ in self._chunks()]

    def __create_write_items__(self, fqn, obj):
        values = getattr(self, "_shardc_values", None)    # a save (a load plans reads, not writes)
        if values is not None:
            values.require("dcp.save of state_dict()", (self._shardc_spec.name,))
        props = TensorProperties.create_from_tensor(self.as_subclass(torch.Tensor))
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props,
                                                      size=self._shardc_shape))
                for c, _, _ in self._chunks()]

    def __get_tensor_shard__(self, index):
        plain = self.as_subclass(torch.Tensor)
        for c, a, b in self._chunks():
            if c.offsets == torch.Size(index.offset):
                return plain[a:b].view(c.sizes)
        raise ValueError(f"no local chunk of {index.fqn!r} at offset {tuple(index.offset)}")

    def whole(self) -> torch.Tensor:
        """The whole parameter from every rank's piece (a collective, see `gather`)."""
        return gather(self._shardc_comm, self._shardc_spec, self.as_subclass(torch.Tensor))


class ShardcPiece(DTensor):
    """A state-dict entry: one rank's piece of a parameter (or of an optimizer state of its
    shape) as a DTensor of the global shape; see [Note: torch's full-state-dict recipes]."""

    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        return self._local_tensor

    def __deepcopy__(self, memo):
        import copy
        new = ShardcPiece(copy.deepcopy(self._local_tensor, memo), self._spec, requires_grad=False)
        memo[id(self)] = new
        return new

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        return self._local_tensor.whole()

    def redistribute(self, device_mesh=None, placements=None, *, async_op=False,
                     forward_dtype=None, backward_dtype=None) -> DTensor:
        mesh = device_mesh or self.device_mesh
        if placements is None or any(not isinstance(p, Replicate) for p in placements) \
                or mesh != self.device_mesh:
            raise RuntimeUsageError(f"a shardc state-dict entry ({self._local_tensor._shardc_spec.name!r}) "
                                    f"redistributes only to Replicate on its own mesh (the whole tensor); "
                                    f"got {placements}")
        return DTensor.from_local(self.full_tensor(), mesh, list(placements), run_check=False)


def wrap(local: torch.Tensor, spec: PieceSpec, device_mesh, comm, values=None) -> ShardcPiece:
    """`local` (this rank's piece: elements [spec.lo, spec.hi) of a tensor of the parameter's
    shape on this rank) as a `ShardcPiece` of the global shape; a DTensor parameter's local
    shard is placed at its offset in the global tensor. `values`: the parameter set whose
    `require` a save of the piece passes first (a parameter no init or load gave a value
    holds garbage: its shard is allocated empty)."""
    flat = local.detach().reshape(-1)[:spec.hi - spec.lo].as_subclass(_Flat)
    lo = spec.lo
    bx = boxes(spec.shape, lo, lo + flat.numel())
    if spec.tp is not None:
        bx = [(tuple(o + t for o, t in zip(off, spec.tp.offset)), size, a, b) for off, size, a, b in bx]
    shape = spec.global_shape
    flat._shardc_boxes = [(o, s, a - lo, b - lo) for o, s, a, b in bx]
    flat._shardc_shape = torch.Size(shape)
    flat._shardc_spec, flat._shardc_comm, flat._shardc_values = spec, comm, values
    stride = torch.empty(shape, device="meta").stride()
    dspec = DTensorSpec(device_mesh, (Replicate(),) * device_mesh.ndim,
                        tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    return ShardcPiece(flat, dspec, requires_grad=False)


def local_piece(value, shape: tuple[int, ...], lo: int, hi: int, what: str, tp=None) -> torch.Tensor:
    """This rank's flat elements [lo, hi) of `what` (of local `shape`; a DTensor parameter's
    local shard when `tp` is its TPParam) from a loaded value: a piece made by `wrap` for
    the same range, or a whole tensor of the parameter's global shape."""
    local_shape, shape = shape, (tp.shape if tp is not None else shape)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, _Flat):
        local = value._local_tensor.as_subclass(torch.Tensor)
        if tuple(value.shape) != tuple(shape):
            raise RuntimeUsageError(f"{what} has shape {tuple(value.shape)} in the checkpoint, "
                                    f"but this model's is {tuple(shape)}")
        if local.numel() != hi - lo:
            raise RuntimeUsageError(f"{what}: the loaded piece has {local.numel()} elements, this "
                                    f"rank holds {hi - lo}; load through get_state_dict/dcp.load")
        return local
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise RuntimeUsageError(f"{what} is {got} in the checkpoint, but this model's shape "
                                f"is {tuple(shape)}")
    if tp is not None:
        value = tp.local_of(value)
    return value.detach().reshape(local_shape).reshape(-1)[lo:hi]
