"""shardc.runtime — what emitted code calls: sharded units, the step engine, the
sharded optimizer, the communication ledger, memory reports and state dicts."""
from .errors import RuntimeUsageError
from .ledger import LedgerRecord, payload
from .module import ShardedModule, shard_module
from .optimizer import ELEMENTWISE
from .units import UnitSpec

from .mesh import ShardMesh

__all__ = ["ShardedModule", "shard_module", "UnitSpec", "LedgerRecord", "ShardMesh",
           "RuntimeUsageError", "ELEMENTWISE", "payload"]
