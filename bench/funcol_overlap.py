"""Does a compiled graph overlap a functional collective with compute on CPU? (bench stage:
information only; docs/BENCHMARKS.md "After the hand-off and `early_sync` in the mode").

    torchrun --nproc-per-node 2 bench/funcol_overlap.py

Each rank all-reduces 64 MB (gloo) and, meanwhile, runs 20 matmuls of 768 x 768 with a
tanh between them, one torch thread. Prints the median of 5 runs of: the collective
alone and the compute alone (both compiled); the two in one function, issued first and
waited last, run eagerly (`dist.all_reduce(async_op=True)`; the functional ops
uncompiled), compiled with AOTAutograd's eager backend, compiled by Inductor, compiled
by Inductor with its peak-memory and locality reorderings off (what shardc's whole-step
mode compiles with: runtime/graph/backend.py), and by Inductor with its `raise_comms`
reordering pass. Overlap shows as a time below the sum of the first two.

[Note: why Inductor issued the collective late]
Inductor's scheduler re-sorts its nodes for the lowest estimated peak memory
(`reorder_for_peak_memory`, on by default): a collective's output is a fresh buffer, so
the chosen order issues it right before its wait, after the compute between them. In an
inference graph like this one `reorder_for_locality` also moves nodes toward their
users. With both off the generated code keeps the function's order.
"""
from __future__ import annotations

import time

import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist

FUNCOL = torch.ops._c10d_functional


def main() -> None:
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    torch.set_num_threads(1)
    big, a = torch.randn(16 << 20), torch.randn(768, 768)

    def comm(x):
        return FUNCOL.wait_tensor.default(FUNCOL.all_reduce.default(x, "sum", group))

    def work(m):
        for _ in range(20):
            m = torch.tanh(m @ m)
        return m

    def both(x, m):
        y = FUNCOL.all_reduce.default(x, "sum", group)
        m = work(m)
        return FUNCOL.wait_tensor.default(y), m

    def eager_c10d(x, m):
        w = dist.all_reduce(x.clone(), async_op=True)
        m = work(m)
        w.wait()
        return m

    def timed(name, fn, *args):
        fn(*args)
        runs = []
        for _ in range(5):
            dist.barrier()
            t = time.perf_counter()
            fn(*args)
            runs.append(time.perf_counter() - t)
        if rank == 0:
            print(f"{name:32s} {sorted(runs)[2] * 1e3:7.1f} ms", flush=True)

    compiled = lambda fn, **kw: torch.compile(fn, fullgraph=True, **kw)      # noqa: E731
    timed("collective alone (Inductor)", compiled(comm), big)
    timed("compute alone (Inductor)", compiled(work), a)
    timed("both, eager c10d async", eager_c10d, big, a)
    timed("both, functional ops uncompiled", both, big, a)
    timed("both, aot_eager", compiled(both, backend="aot_eager"), big, a)
    timed("both, Inductor", compiled(both), big, a)
    torch._dynamo.reset()
    with inductor_config.patch(reorder_for_peak_memory=False, reorder_for_locality=False):
        timed("both, Inductor, no re-sort", compiled(both), big, a)
    torch._dynamo.reset()
    with inductor_config.patch(reorder_for_compute_comm_overlap=True,
                               reorder_for_compute_comm_overlap_passes=["raise_comms"]):
        timed("both, Inductor + raise_comms", compiled(both), big, a)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
