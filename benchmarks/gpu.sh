#!/usr/bin/env bash
# GPU figures: jaxinfer bench on a ~1.5B random bf16 model (Qwen2.5-1.5B shape) with 1 and 8
# rows, with MBU against the device's measured copy bandwidth (an H200 moves ~4.3 TB/s).
# Needs a CUDA jax (pip install "jax[cuda12]"); never needed for the tests.
# Usage: bash benchmarks/gpu.sh [OUT_DIR]   (default benchmarks/results)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
mkdir -p "$out"
python - "$out" <<'PY'
import sys, json, jax
import jaxinfer
from jaxinfer.bench import measure_bandwidth, render, run_bench

cfg = jaxinfer.ModelConfig(
    arch="qwen2", d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
    d_ff=8960, vocab_size=151936, qkv_bias=True, tie_embeddings=True, max_position=4096,
    name="qwen2.5-1.5B-shape (random)",
)
bw = measure_bandwidth(1 << 30)
print(f"{jax.devices()[0].device_kind}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
rows = run_bench(
    lambda layout, dev, slots, reuse, need: jaxinfer.load(
        cfg, dtype="bfloat16", max_seq_len=1024, batch_buckets=(slots,), graph_reuse=reuse),
    prompts=[512], gens=[128], repeats=5, layouts=["single"], devices=[None],
    slots=[1, 8], graph_reuse=[True, False], mem_bw=bw,
)
table = render(rows, "md")
print(table)
with open(f"{sys.argv[1]}/gpu_{jax.devices()[0].device_kind.replace(' ', '_')}.md", "w") as f:
    f.write(f"{jax.devices()[0].device_kind}, copy bandwidth {bw / 1e9:.0f} GB/s\n\n{table}\n")
PY
