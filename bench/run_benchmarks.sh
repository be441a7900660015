#!/usr/bin/env bash
# Every run behind docs/BENCHMARKS.md, in order, then the plots and the table.
# Needs root (network namespaces). Usage: bash bench/run_benchmarks.sh [OUTDIR]
# OUTDIR defaults to bench/results; the PNGs go to docs/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results}
DATE=$(date -u +%F)   # result names: KIND_LINK_MODEL_DATE[_RUN] (docs/BENCHMARKS.md, "Result files")
mkdir -p "$OUT"
SYSTEMS=fsdp2:full,fsdp2:hsdp,ddp,shardc:zero3,shardc:zero3@hierarchical,shardc:zero1,shardc:zero2,shardc:mics,shardc:hsdp_zero2,shardc:paro_nig,shardc:paro_iig,shardc:paro_igg,shardc:ddp,shardc:zeropp

# 1. the main comparison: 2 nodes x 4 ranks, 250 Mbit/s between nodes
time python bench/cluster_bench.py --nodes 2 --per-node 4 --inter-rate 250mbit --model bench \
    --micro-batch 2 --accumulate 4 --steps 3 --warmup 1 --systems "$SYSTEMS" \
    --json "$OUT/systems_250mbit_bench_$DATE.json" --logdir "$OUT/logs_250mbit"

# 2. collectives over the whole cluster: flat ring vs hierarchical vs HO-Ring
python bench/cluster_bench.py --collectives --nodes 2 --per-node 4 --inter-rate 250mbit \
    --sizes 64KB,1MB,8MB,32MB --json "$OUT/collectives_250mbit_$DATE.json" --logdir "$OUT/logs_coll"
python bench/cluster_bench.py --collectives --per-rank-links --nodes 2 --per-node 4 --inter-rate 250mbit \
    --sizes 8MB,32MB --json "$OUT/collectives_250mbit_${DATE}_per-rank-links.json" --logdir "$OUT/logs_coll_pr"

# 3. the communication share of the zero3 step: the same step with the link unshaped
python bench/cluster_bench.py --nodes 2 --per-node 4 --inter-rate 100gbit --model bench \
    --micro-batch 2 --accumulate 4 --steps 3 --warmup 1 --systems shardc:zero3,fsdp2:full \
    --json "$OUT/systems_100gbit_bench_$DATE.json" --logdir "$OUT/logs_unshaped"

python bench/plot.py systems "$OUT/systems_250mbit_bench_$DATE.json" docs/bench_systems.png
python bench/plot.py collectives "$OUT/collectives_250mbit_$DATE.json" docs/bench_collectives.png
python bench/plot.py table "$OUT/systems_250mbit_bench_$DATE.json"

# 4. predicted vs measured (docs/explain.md): `shardc profile` inside the cluster (collectives,
#    quantized ones, the compute rate), the named strategies' steps (3 alternating rounds of
#    6 timed steps: [Note: rounds] in bench/report.py; the profile: 3 runs x 3 sweeps per
#    entry), then the table
python bench/cluster_bench.py --nodes 2 --per-node 4 --inter-rate 250mbit --model bench \
    --micro-batch 2 --steps 3 --warmup 1 --rounds 3 --bandwidth-profile "$OUT/profile_250mbit_bench_${DATE}_predicted.json" \
    --json /tmp/profile_run.json --logdir "$OUT/logs_profile"
python bench/cluster_bench.py --nodes 2 --per-node 4 --inter-rate 250mbit --model bench \
    --micro-batch 2 --accumulate 4 --steps 6 --warmup 1 --rounds 3 \
    --systems shardc:zero1,shardc:paro_nig,shardc:hsdp_zero2,shardc:mics,shardc:paro_iig,shardc:zeropp,shardc:zero3 \
    --json "$OUT/systems_250mbit_bench_${DATE}_predicted.json" --logdir "$OUT/logs_predict"
python bench/predict.py "$OUT/profile_250mbit_bench_${DATE}_predicted.json" "$OUT/systems_250mbit_bench_${DATE}_predicted.json" --md "$OUT/predict_250mbit_bench_${DATE}_predicted.md"

# 5. tensor parallelism (docs/BENCHMARKS.md "Tensor parallelism"): the +tp systems, tp pairs inside
#    a node, data parallelism over (node, gpu); the same strategies without TP for reference
python bench/cluster_bench.py --nodes 2 --per-node 4 --inter-rate 250mbit --model medium \
    --micro-batch 2 --accumulate 2 --steps 2 --warmup 1 --rounds 3 \
    --systems fsdp2+tp,shardc:zero3+tp,shardc:paro_iig+tp,shardc:paro_nig+tp,fsdp2:full,shardc:zero3,shardc:paro_iig,shardc:paro_nig \
    --json "$OUT/systems_250mbit_medium_${DATE}_tp.json" --logdir "$OUT/logs_tp"

# 6. the whole-step compiled mode (docs/BENCHMARKS.md "The whole-step compiled mode"): shardc's
#    backend="inductor" against its eager runtime and FSDP2 full shard with and without
#    torch.compile per block; the compile happens in the warm-up step (round 1 with an empty Inductor cache)
TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python bench/cluster_bench.py --nodes 2 --per-node 4 --inter-rate 250mbit --model bench \
    --micro-batch 2 --accumulate 4 --steps 3 --warmup 1 --rounds 2 \
    --systems fsdp2:full,fsdp2:full+compile,shardc:zero3,shardc:zero3+inductor,shardc:paro_iig,shardc:paro_iig+inductor,shardc:paro_nig,shardc:paro_nig+inductor \
    --json "$OUT/systems_250mbit_bench_${DATE}_inductor.json" --logdir "$OUT/logs_inductor"

# 7. start-up of big models (docs/BENCHMARKS.md "Start-up of big models"): 8 ranks over loopback, no
#    namespaces. A 16-layer Llama of TinyLlama's width (836 M parameters, too big for 8 whole builds)
#    starts from the meta device (initialize, DCP, safetensors; FSDP2's recipe with the same units)
#    and takes its first training step. Checkpoints (~7 GB) go to a scratch directory.
BIG=$(mktemp -d)
python bench/bigmodel.py --layers 16 --workdir "$BIG/l16" --need-gib 21 \
    --strategy bench/llama_zero3_units.shard --fsdp2-wrap units \
    --systems shardc:init,shardc:dcp,shardc:safetensors,fsdp2:init,fsdp2:dcp \
    --json "$OUT/systems_100gbit_${DATE}_bigmodel-l16-step.json"
rm -rf "$BIG"
python bench/bigmodel.py --table "$OUT/systems_100gbit_${DATE}_bigmodel-l16-step.json"

# 8. The papers' settings as simulated ranks (docs/simulate.md, issue 38): one process, torch's fake
#    process group, no namespaces. LLaMA-7B..65B on 64/128/1024 GPUs and GPT-NeoX-20B on ZeRO-topo's
#    meshes under every named strategy (about an hour of one core), then planning/compile timings.
python bench/simulate_papers.py sweep --out "$OUT/simulate_${DATE}_llama.jsonl"
python bench/simulate_papers.py neox --out "$OUT/simulate_${DATE}_neox.jsonl"
python bench/simulate_papers.py neox --meshes "node(2) > gpu(4) > gcd(2)" --strategies zero3,zero_topo \
    --out "$OUT/simulate_${DATE}_neox.jsonl"
python bench/simulate_papers.py timing --out "$OUT/simulate_${DATE}_timing.json"
python bench/simulate_papers.py table "$OUT"/simulate_"${DATE}"_{llama,neox}.jsonl --out /dev/stdout

# 9. expert parallelism (docs/BENCHMARKS.md "Expert parallelism"): the moe preset (examples/moe.py),
#    +ep2 (two contiguous gpus of a node) and +epgpu (the node's 4 gpus); fsdp2+epN in torchtitan's
#    layout, shardc's examples/strategies/moe files; FSDP2 and shardc without EP for reference
python bench/cluster_bench.py --nodes 2 --per-node 4 --inter-rate 250mbit --model moe \
    --micro-batch 2 --accumulate 2 --steps 2 --warmup 1 --rounds 2 \
    --systems fsdp2:full,fsdp2+ep2,fsdp2+epgpu,shardc:zero3,shardc:paro_iig,shardc:moe/ep2_zero3+ep2,shardc:moe/ep_zero3+epgpu,shardc:moe/hpz_ep2+ep2,shardc:moe/paro_iig_ep_zero1+epgpu \
    --json "$OUT/systems_250mbit_moe_${DATE}_ep.json" --logdir "$OUT/logs_ep"
