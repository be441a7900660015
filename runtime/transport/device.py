"""Device helpers — stage: runtime (under the collectives and the mesh).

Input: a model (its parameters), a process group, the device of a collective's tensors.
Output: the device the runtime allocates on (`model_device`), the c10d backend that
runs a group's collectives on that device (`backend_name`, `check_backend`), whether
that backend has a true reduce-scatter (`native_reduce_scatter`), and the
communication streams a collective runs on (`launch` -> `OnStream`).

[Note: where the runtime's tensors live]
Every persistent tensor (parameter, secondary and gradient shards, fp32 masters,
optimizer state) and every communication buffer is allocated on the device of the
model's parameters, read once by `model_device` when the model is sharded: a model on
`cuda:k` trains on `cuda:k`, a model on `cpu` on the CPU. Parameters split over several
devices, or left on `meta` (no values), are refused with one sentence.

[Note: backend per device]
`init_process_group` is the user's (or torchrun's); shardc only checks that the
default group has a backend for the model's device type (NCCL for CUDA, gloo for CPU
are torch's defaults, `default_backend`). Sub-groups come from a DeviceMesh of that
device type (runtime/transport/mesh.py), so they run on the same backend. gloo's reduce_scatter
is an all-reduce followed by a slice (twice a ring's bytes), so on gloo a
reduce-scatter is an all-to-all plus a local sum (runtime/eager/collectives.py); every other
backend (NCCL, ...) uses its native `reduce_scatter_single`. `prefer_native_reduce_scatter`
overrides that choice (tests compare both paths on gloo, whose native op is correct).

[Note: communication streams]
On a device with streams (CUDA) a collective runs on a side stream of its kind
(all-gather, reduce-scatter, all-reduce: one each per device, like FSDP2's
`_fsdp_param_group.py`), so it overlaps the compute stream:
  * issue: the comm stream first waits the issuing (current) stream, since the inputs
    were written there; casts, copies, quantization and the c10d ops are then issued
    with the comm stream current (an NCCL op waits its current stream and, on
    `work.wait()`, makes the current stream wait for it; no host sync);
  * later stages (multi-level algorithms) and the local post-processing run in
    `Work.wait()`, again with the comm stream current;
  * join: at the end of `Work.wait()` the caller's current stream waits an event
    recorded on the comm stream, so results are read after they are written.
Allocator safety without `record_stream`: `OnStream` keeps the caller's tensors (inputs
and outputs, allocated on the compute stream) alive until the join, so their blocks
cannot be handed to a new compute-stream allocation while the comm stream still uses
them; once the compute stream has waited the event, freeing them is ordered after the
communication. Buffers allocated inside a collective are allocated on the comm stream
and only used there (each stage's handle is waited on the comm stream before the next
stage reads them). A collective on a device without streams (CPU) uses `NO_STREAM`,
whose methods do nothing: gloo's own threads give the overlap there.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from shardc.dsl.errors import ShardcError
from shardc.lowering import A2A_RS_BACKENDS, Op

# backends whose reduce_scatter is an all-to-all plus a sum (see [Note: backend per device]; the
# lowering owns the set: explain's timeline counts their receive blocks)
ALLREDUCE_RS_BACKENDS = A2A_RS_BACKENDS
STREAM_KINDS = (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE)

_native_rs_override: bool | None = None
_stream_modules: dict[str, object] = {}      # device type -> module with Stream/current_stream/stream
_pools: dict[torch.device, "CommStreams"] = {}


# -- devices and backends ---------------------------------------------------------------
def model_device(model: nn.Module) -> torch.device:
    """The one device of `model`'s parameters (CPU when it has none)."""
    devices = sorted({str(p.device) for p in model.parameters()})
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        raise ShardcError(f"the model has parameters on {' and '.join(devices)}; move it to one "
                          f"device (model.to(device)) before sharding it")
    dev = torch.device(devices[0])
    if dev.type == "meta":
        raise ShardcError("the model's parameters are on the meta device and have no values; "
                          "materialise it (model.to_empty(device=...) and initialise) before sharding it")
    return dev


def default_backend(device_type: str) -> str:
    """torch's default c10d backend for a device type: 'nccl' for cuda, 'gloo' for cpu."""
    return dist.Backend.default_device_backend_map.get(device_type, "gloo")


def backend_name(pg: dist.ProcessGroup, device_type: str) -> str:
    """Name of the backend that runs `pg`'s collectives on `device_type` tensors."""
    try:
        return pg._get_backend(torch.device(device_type)).name()
    except RuntimeError:
        raise ShardcError(
            f"the process group has no backend for {device_type} tensors (it was initialised as "
            f"{dist.get_backend_config(pg)!r}); move the model to a device it serves, or initialise "
            f"it with init_process_group({default_backend(device_type)!r}) for a model on {device_type}") from None


def check_backend(device_type: str) -> str:
    """The default group's backend for `device_type`; a clear error when it has none."""
    return backend_name(dist.distributed_c10d._get_default_group(), device_type)


def native_reduce_scatter(pg: dist.ProcessGroup, device_type: str) -> bool:
    """True when a reduce-scatter over `pg` should use the backend's own op."""
    if _native_rs_override is not None:
        return _native_rs_override
    if device_type == "meta":                # a simulated rank's tensors (runtime/simulation.py)
        return True
    return backend_name(pg, device_type) not in ALLREDUCE_RS_BACKENDS


@contextlib.contextmanager
def prefer_native_reduce_scatter(flag: bool | None):
    """Within the block, reduce-scatters use the native op (True), all-to-all + sum (False)
    or what the backend calls for (None)."""
    global _native_rs_override
    old, _native_rs_override = _native_rs_override, flag
    try:
        yield
    finally:
        _native_rs_override = old


# -- communication streams ----------------------------------------------------------------
def _stream_module(device_type: str):
    mod = _stream_modules.get(device_type)
    if mod is None and device_type == "cuda" and torch.cuda.is_available():
        mod = _stream_modules[device_type] = torch.cuda
    return mod or None                       # False: streams turned off (use_stream_module)


@contextlib.contextmanager
def use_stream_module(device_type: str, module):
    """Run collectives on `device_type` tensors on streams of `module` (an object with
    `Stream(device=, priority=)`, `current_stream(device)` and `stream(s)`, like
    torch.cuda); None turns streams off. For tests (fake streams on CPU)."""
    old = _stream_modules.get(device_type)
    _stream_modules[device_type] = module if module is not None else False
    _drop_pools(device_type)
    try:
        yield
    finally:
        _stream_modules.pop(device_type)
        if old is not None:
            _stream_modules[device_type] = old
        _drop_pools(device_type)


def _drop_pools(device_type: str) -> None:
    for dev in [d for d in _pools if d.type == device_type]:
        del _pools[dev]


class CommStreams:
    """One high-priority side stream per collective kind on one device, made on first use."""

    def __init__(self, device: torch.device, module):
        self.device, self.module = device, module
        self._streams: dict[Op, object] = {}

    def stream(self, kind: Op):
        s = self._streams.get(kind)
        if s is None:
            s = self._streams[kind] = self.module.Stream(device=self.device, priority=-1)
        return s

    def current(self):
        return self.module.current_stream(self.device)


def comm_streams(device: torch.device) -> CommStreams | None:
    """The stream pool of `device`, or None where collectives run without streams (CPU)."""
    mod = _stream_module(device.type)
    if mod is None:
        return None
    if device.index is None:
        device = torch.device(device.type, mod.current_device()) if hasattr(mod, "current_device") else device
    pool = _pools.get(device)
    if pool is None:
        pool = _pools[device] = CommStreams(device, mod)
    return pool


class OnStream:
    """Where one collective runs: its comm stream, ordered after the issuing stream
    (see [Note: communication streams]); keeps `keep` alive until `join()`."""

    __slots__ = ("_pool", "_stream", "_keep")

    def __init__(self, pool: CommStreams, kind: Op, keep: tuple):
        self._pool, self._stream, self._keep = pool, pool.stream(kind), keep
        self._stream.wait_stream(pool.current())

    def active(self):
        """Context in which the comm stream is the current stream."""
        return self._pool.module.stream(self._stream)

    def join(self) -> None:
        """The current stream waits for everything issued so far; the tensors are released."""
        if self._keep is None:
            return
        self._pool.current().wait_event(self._stream.record_event())
        self._keep = None


class _NoStream:
    """Collectives on a device without streams: nothing to order, nothing to keep."""

    __slots__ = ()
    _null = contextlib.nullcontext()

    def active(self):
        return self._null

    def join(self) -> None:
        return None


NO_STREAM = _NoStream()


def launch(kind: Op, *tensors: torch.Tensor) -> OnStream | _NoStream:
    """Where a collective of `kind` over `tensors` (its inputs and outputs) runs."""
    pool = comm_streams(tensors[0].device)
    return NO_STREAM if pool is None else OnStream(pool, kind, tensors)
