"""GPU figures: jaxinfer bench on a ~1.5B random bf16 model (Qwen2.5-1.5B shape) with 1 and 8
rows, with MBU against the device's measured copy bandwidth (an H200 moves ~4.3 TB/s).

Needs a CUDA jax (pip install "jax[cuda12]"); never needed for the tests.
Writes OUT_DIR/gpu_<device kind>.md. Usage: python benchmarks/gpu.py [OUT_DIR] [-r 5]
"""

from pathlib import Path

import harness
import jax

import jaxinfer
from jaxinfer.cli.bench import measure_bandwidth, render, run_bench

QWEN25_15B = jaxinfer.ModelConfig(
    arch="qwen2", d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
    d_ff=8960, vocab_size=151936, qkv_bias=True, tie_embeddings=True, max_position=4096,
    name="qwen2.5-1.5B-shape (random)",
)  # fmt: skip


def main():
    ap = harness.parser(__doc__, 5)
    ap.add_argument("out_dir", nargs="?", type=Path, default=harness.RESULTS)
    args = ap.parse_args()
    kind = jax.devices()[0].device_kind
    bw = measure_bandwidth(1 << 30)
    print(f"{kind}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    def engine(layout, devices, slots, reuse, need):
        return jaxinfer.load(QWEN25_15B, dtype="bfloat16", max_seq_len=1024,
                             batch_buckets=(slots,), graph_reuse=reuse)  # fmt: skip

    rows = run_bench(
        engine,
        prompts=[512], gens=[128], repeats=args.rounds, layouts=["single"], devices=[None],
        slots=[1, 8], graph_reuse=[True, False], mem_bw=bw,
    )  # fmt: skip
    table = render(rows, "md")
    print(table)
    name = f"gpu_{kind.replace(' ', '_')}"
    text = f"{kind}, copy bandwidth {bw / 1e9:.0f} GB/s\n\n{table}"
    harness.write_result(name, text, args.out or args.out_dir / f"{name}.md")


if __name__ == "__main__":
    main()
