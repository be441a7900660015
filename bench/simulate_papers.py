"""The papers' settings as simulated ranks (`shardc simulate`'s engine, shardc/simulate.py):
memory per rank, the ledger against explain's, and the seconds each takes (information and
the docs' tables; no asserts).

    # docs/simulate.md's runs (DATE: the day; a stopped run resumes, skipping the ranks done):
    python bench/simulate_papers.py sweep --out bench/results/simulate_DATE_llama.jsonl   # LLaMA-7B..65B, 64/128/1024
    python bench/simulate_papers.py neox --out bench/results/simulate_DATE_neox.jsonl     # node(48) > gpu(4) > gcd(2)
    python bench/simulate_papers.py neox --meshes "node(2) > gpu(4) > gcd(2)" --strategies zero3,zero_topo \
        --out bench/results/simulate_DATE_neox.jsonl                                      # ZeRO-topo's 16 GCDs
    python bench/simulate_papers.py timing --out bench/results/simulate_DATE_timing.json  # planning vs world, compile vs depth
    python bench/simulate_papers.py table bench/results/simulate_DATE_{llama,neox}.jsonl --out OUT.md   # the tables
    python bench/simulate_papers.py reexplain --out FILE.jsonl   # explain's peak again after a timeline change
    python bench/simulate_papers.py sweep --models llama_7b --nodes 8 --skip-first --peak-all \
        --out bench/results/simulate_DATE_last-ranks.jsonl                               # other ranks' peaks

Settings: every named strategy (examples/strategies/*.shard) in the papers' precision —
`dtype bf16` added to its params and grads lines (bf16 parameters, gradients and
collectives; an fp32 master and AdamW's m, v: K = 12, PaRO's Table 1 and Lins §IV-D) —
and `accumulate 1`; one step of one micro-batch of one 2048-token sequence (Lins' B = 1),
AdamW, no clipping. LLaMA-7B/13B/30B/65B on `node(N) > gpu(8)` (every named strategy but
zero_topo, whose mesh is Frontier's); GPT-NeoX-20B on ZeRO-topo's node(48) > gpu(4) >
gcd(2) (every named strategy). Ranks: the first and the last, and for PaRO-IGG one inside
its gpu-major chunk order (node N/2, gpu 3); the peak (two steps, the second tracked) on
the first rank (`--peak-all`: on every rank simulated), states and ledger (one step) on every
rank. Each model's graph is traced
once per unit split (bf16, 1 x 2048; `bucket auto` merges blocks at 1024 ranks) for
explain's peak. One process runs a model's simulations one after
another.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMED = sorted(os.path.basename(p)[:-6] for p in glob.glob(os.path.join(ROOT, "examples/strategies/*.shard")))
NEOX_MESH = "node(48) > gpu(4) > gcd(2)"
SEQ = 2048


def bf16_text(name: str) -> str:
    """The named strategy in mixed precision, planning one micro-batch (see the docstring)."""
    with open(os.path.join(ROOT, "examples/strategies", name + ".shard")) as f:
        lines = []
        for line in f:
            code = line.split("#")[0].rstrip()
            if re.match(r"\s*(params|grads)\s", code):
                code += " dtype bf16"
            elif re.match(r"\s*accumulate\s", code):
                code = "accumulate 1"
            lines.append(code)
    text = "\n".join(lines) + "\n"
    if "accumulate" not in text:
        text += "accumulate 1\n"
    return f"strategy {name}\n" + text if "strategy " not in text else text


def _factory(spec: str):
    sys.path.insert(0, ROOT)
    from shardc.cli.loader import load_factory
    return load_factory(os.path.join(ROOT, spec))


def _graph(strategy, factory, cache: dict, name: str):
    """The model's trace for explain's peak, one per unit split: `bucket auto` merges blocks
    at 1024 ranks (LLaMA-7B: 17 units, 33 at 64), and a trace of other units has no saved
    tensors per unit to free in the backward (analysis/costmodel/timeline.py keeps them all)."""
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.analysis.costmodel.flops import trace
    from shardc.simulate import meta_model
    from shardc.units import find_units
    model = meta_model(factory, "")
    units = find_units(model, resolve_bucket(model, strategy))
    key = (name, tuple(tuple(u.modules) for u in units))
    if key not in cache:
        cache[key] = trace(model, units, batch=1, seq=SEQ, dtype="bf16")
    return cache[key]


def _ranks(name: str, mesh) -> list[int]:
    last = mesh.world - 1
    if name != "paro_igg":
        return [0, last]
    sizes = {l.name: l.size for l in mesh.levels}
    inner = (sizes["node"] // 2) * (mesh.world // sizes["node"]) + 3
    return [0, inner, last]


def simulate_all(model: str, meshes: list[str], names: list[str], out: str, first_only: bool = False,
                 peak_all: bool = False, skip_first: bool = False) -> None:
    """Append one JSON line per simulated rank to `out` (a run that stopped resumes: the
    ranks already there are skipped). `first_only`: the first rank only (the peak's);
    `peak_all`: the peak on every rank simulated, not on the first only; `skip_first`: the
    ranks but the first (a run of other ranks' peaks beside one that has the first's)."""
    import shardc
    from shardc.simulate import simulate_rank
    done = set()
    if os.path.exists(out):
        with open(out) as f:
            done = {(r["model"], r["strategy"], r["mesh"], r["rank"]) for r in map(json.loads, f)}
    factory = _factory(f"examples/{'gpt_neox' if 'neox' in model else 'llama'}.py:{model}")
    graphs: dict = {}
    for mesh in meshes:
        for name in names:
            s = shardc.load_strategy(bf16_text(name), mesh=mesh)
            for r in _ranks(name, s.mesh)[1 if skip_first else 0:1 if first_only else None]:
                if (model, name, str(s.mesh), r) in done:
                    continue
                graph = _graph(s, factory, graphs, model)
                t = time.perf_counter()
                rep = simulate_rank(s, factory, r, spec=model, micro_batches=1, batch=1, seq=SEQ, graph=graph,
                                    peak=r == 0 or peak_all)   # the peak: measured on the first (see main)
                rep["model"] = model
                rep.pop("explain_ledger")
                rep["wall"] = time.perf_counter() - t
                with open(out, "a") as f:
                    f.write(json.dumps(rep) + "\n")
                print(f"{model} {name} {mesh} rank {r}: states {rep['memory']['total'] / 2**30:.2f} GiB "
                      f"peak {(rep['peak']['measured'] or 0) / 2**30:.2f} GiB equal {rep['memory_equal']}/"
                      f"{rep['ledger_equal']} {rep['wall']:.1f} s", flush=True)


def reexplain(path: str) -> None:
    """explain's peak fields of `path`'s measured ranks again, in place, from the current
    timeline (the measured side is the runtime's and stays: use it after a change to
    analysis/costmodel/timeline.py only). One trace per model and unit split."""
    import shardc
    from shardc.analysis.costmodel.report import explain, model_units
    from shardc.simulate import DEVICE, _explain_phases, _phases_within, meta_model, peak_within
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    graphs, units = {}, {}
    for r in rows:
        pk = r["peak"]
        if pk["measured"] is None:
            continue
        model = r["model"]
        factory = _factory(f"examples/{'gpt_neox' if 'neox' in model else 'llama'}.py:{model}")
        s = shardc.load_strategy(bf16_text(r["strategy"]), mesh=r["mesh"])
        key = (model, r["strategy"], r["mesh"])
        if key not in units:
            units[key] = model_units(s, meta_model(factory, ""))
        e = explain(s, units[key], micro_batches=r["step"]["micro_batches"], optimizer=r["step"]["optimizer"],
                    clip_grad_norm=r["step"]["clip"], graph=_graph(s, factory, graphs, model), device=DEVICE).peak
        phases = _explain_phases(e["timeline"])
        pk.update(explain=e["peak"] - e["overhead"], explain_phase=e["phase"], explain_buffers=e["buffers"],
                  explain_timeline=e["timeline"], explain_phases=phases,
                  phases_within=_phases_within(pk["phases"], phases),
                  within=peak_within(pk["measured"], e["peak"] - e["overhead"]))
        print(f"{model} {r['strategy']} {r['mesh']}: explain / measured {pk['explain'] / pk['measured']:.3f}",
              flush=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def timing(out: dict) -> None:
    """Lowering and `shardc plan` against the world size (LLaMA-30B), `shardc.compile` on a
    simulated rank against the depth (LLaMA-65B's width, 1024 ranks)."""
    import subprocess
    import shardc
    from shardc.analysis.costmodel.report import model_units
    from shardc.lowering import lower
    from shardc.simulate import meta_model, simulate_rank
    f30 = _factory("examples/llama.py:llama_30b")
    rows = []
    for nodes in (8, 32, 128):
        mesh = f"node({nodes}) > gpu(8)"
        s = shardc.load_strategy(bf16_text("paro_igg"), mesh=mesh)
        units = model_units(s, meta_model(f30, ""))
        t = time.perf_counter()
        lower(s.mesh, units, s.prefetch)
        low = time.perf_counter() - t
        row = {"world": 8 * nodes, "lowering": low}
        for what, extra in (("plan", ["--memory", "80GiB", "--precision", "bf16"]), ("explain", [])):
            strat = [] if what == "plan" else [os.path.join(ROOT, "examples/strategies/paro_igg.shard")]
            cmd = [sys.executable, "-m", "shardc.cli", what, *strat, "--model", "examples/llama.py:llama_30b",
                   "--mesh", mesh, *extra, "--json"]
            _children_cpu()
            t = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            row[what] = {"wall": time.perf_counter() - t, "cpu": _children_cpu(), "rc": proc.returncode}
        rows.append(row)
        print(rows[-1], flush=True)
    out["world"] = rows
    rows = []
    for depth in (2, 10, 20, 40, 80):
        def factory(depth=depth):
            sys.path.insert(0, os.path.join(ROOT, "examples"))
            from llama import Llama, LlamaConfig
            return Llama(LlamaConfig(dim=8192, n_layers=depth, n_heads=64, ffn_dim=22016))
        s = shardc.load_strategy(bf16_text("paro_igg"), mesh="node(128) > gpu(8)")
        rep = simulate_rank(s, factory, 1023, micro_batches=1, batch=1, seq=SEQ)
        rows.append({"depth": depth, **{k: v for k, v in rep["seconds"].items()},
                     "equal": rep["memory_equal"] and rep["ledger_equal"]})
        print(rows[-1], flush=True)
    out["depth"] = rows
    out["groups"] = groups()


def groups() -> list[dict]:
    """Seconds (wall, CPU) to build a ShardMesh and every group a strategy's plan uses, on
    the fake process group, from 64 to 65,536 ranks (LLaMA-65B's 2-block units)."""
    import shardc
    import torch.distributed as dist
    from shardc.analysis.costmodel.report import model_units
    from shardc.lowering import RankPlan
    from shardc.runtime.transport.mesh import ShardMesh
    from shardc.simulate import init_fake, meta_model
    f = _factory("examples/llama.py:llama_65b_2l")
    rows = []
    for name, meshes in (("paro_igg", [f"node({n}) > gpu(8)" for n in (8, 128, 1024, 8192)]),
                         ("zero_topo", [f"node({n}) > gpu(4) > gcd(2)" for n in (8, 128, 1024, 8192)])):
        for mesh in meshes:
            s = shardc.load_strategy(bf16_text(name), mesh=mesh)
            units = model_units(s, meta_model(f, ""))
            init_fake(s.mesh.world - 1, s.mesh.world)
            t, c = time.perf_counter(), time.process_time()
            sm = ShardMesh(s.mesh, "cpu")
            t1, c1 = time.perf_counter(), time.process_time()
            for u in units:
                plan = RankPlan(s.mesh, u.scopes, sm.rank)
                for lv in plan.groups():
                    if lv and plan.s(lv) > 1:
                        sm.group(lv)
            t2, c2 = time.perf_counter(), time.process_time()
            rows.append({"strategy": name, "world": s.mesh.world, "mesh_wall": t1 - t, "mesh_cpu": c1 - c,
                         "groups_wall": t2 - t1, "groups_cpu": c2 - c1, "process_groups": len(sm.process_groups())})
            dist.destroy_process_group()
            print(rows[-1], flush=True)
    return rows


_cpu_seen = [0.0]


def _children_cpu() -> float:
    import resource
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = ru.ru_utime + ru.ru_stime
    delta, _cpu_seen[0] = total - _cpu_seen[0], total
    return delta


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("sweep", "neox", "timing", "table", "reexplain"))
    p.add_argument("inputs", nargs="*")
    p.add_argument("--models", default="llama_7b,llama_13b,llama_30b,llama_65b")
    p.add_argument("--nodes", default="8,128,16")
    p.add_argument("--meshes", default=NEOX_MESH, help="neox: meshes, ';'-separated")
    p.add_argument("--strategies", default=None)
    p.add_argument("--first-only", action="store_true", help="sweep, neox: the first rank only (the peak's)")
    p.add_argument("--peak-all", action="store_true", help="sweep, neox: the peak on every rank simulated")
    p.add_argument("--skip-first", action="store_true", help="sweep, neox: every rank simulated but the first")
    p.add_argument("--out", required=True, help="JSON lines (sweep, neox; appended) or JSON (timing); table: the markdown")
    a = p.parse_args()
    if a.what == "reexplain":
        reexplain(a.out)
        return
    if a.what == "table":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from simulate_tables import render           # bench/simulate_tables.py
        with open(a.out, "w") as f:
            f.write(render(a.inputs))
        return
    if a.what == "timing":
        out: dict = {}
        timing(out)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    elif a.what == "neox":
        names = a.strategies.split(",") if a.strategies else NAMED
        simulate_all("neox_20b", a.meshes.split(";"), names, a.out, a.first_only, a.peak_all, a.skip_first)
    else:
        names = a.strategies.split(",") if a.strategies else [n for n in NAMED if n != "zero_topo"]
        for model in a.models.split(","):
            simulate_all(model, [f"node({n}) > gpu(8)" for n in a.nodes.split(",")], names, a.out, a.first_only,
                         a.peak_all, a.skip_first)


if __name__ == "__main__":
    main()
