"""The exact init's two paths on the same ranks (bench stage: a 1-layer bench/bigmodel.py
Llama on 2 gloo ranks -> CPU and wall seconds per rank and path, printed as JSON).

    SHARDC_PLAN_CACHE=/tmp/plans OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/init_paths.py

`every`: every rank runs the whole init and keeps its part (runtime/state/init.py, what
shardc did before issue 50; patched in for the comparison); `first`: the first rank runs
it and scatters (runtime/state/init_first.py). Two rounds, interleaved; the plan is read
from the cache after the first compile, so the CPU seconds are construction and values.
The parameter norm (float64, every rank's pieces) is printed per path: equal values give
equal norms.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist

import shardc
import shardc.runtime.build as RB
from shardc.runtime.state import init as state_init

import bigmodel as B  # noqa: E402

def every_rank(model, fn, storages, params, dev, smesh, rng):
    """init.py's loop on every rank (the path before issue 50)."""
    where = {s.fqn: (st, s) for st in storages for s in st.layout.slots}
    places = {id(p): [lambda v, w=where[n]: w[0].write_param(w[1], v)] for n, p in params.items()}
    names = {id(p): n for n, p in params.items()}
    return state_init.initialize(model, fn, places, names, dev, rng)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    new_fn = RB.initialize_first
    x = B.batch(rank)
    res = {"every": [], "first": []}
    norms = {}
    for rnd in range(2):
        for kind in ("every", "first"):
            RB.initialize_first = every_rank if kind == "every" else new_fn
            with torch.device("meta"):
                m = B.llama(1)
            torch.manual_seed(B.SEED)
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            sm = shardc.compile(m, os.path.join(B.ROOT, "bench", "llama_zero3_units.shard"), example_inputs=(x,),
                                mesh="node(1) > gpu(2)", init=m._init_weights)
            cpu = time.process_time() - c
            vals = sm.startup_seconds["values_s"]
            dist.barrier()
            wall = time.perf_counter() - t
            with torch.no_grad():
                sq = sum(p.to_local().double().pow(2).sum() for p in sm.parameters())
            dist.all_reduce(sq)
            norms[kind] = float(sq) ** 0.5
            res[kind].append(dict(values_s=vals, cpu_s=cpu, wall_s=wall))
            del sm, m
    out = [None, None]
    dist.all_gather_object(out, res)
    if rank == 0:
        print(json.dumps(dict(ranks=out, norms=norms), indent=None))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
