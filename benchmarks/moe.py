"""MoE speed: a random Qwen3-MoE GGUF on jaxinfer and llama.cpp side by side, against a dense
model with the same active parameters, and under the expert split.

The MoE model: `qwen3moe`, dim 512, 8 layers, 8 heads / 4 kv heads, 64 experts of width 256,
top-8, stories vocabulary (512). The dense model: `qwen3` of the same shape with one FFN of
width 8 x 256 = 2048, so a token reads the same parameters (the MoE's router aside).

The workers are those of vs_llamacpp.py (workers/peer.py runs llama.cpp as llama-bench does;
workers/ours.py times jaxinfer end to end around `generate()`). Each round runs pp512 and tg128
on: llama.cpp and jaxinfer on the MoE, both on the dense model, jaxinfer with the `expert`
layout on 2 and 4 fake CPU devices (the same 2 cores: this measures what the split costs, not a
speed-up), and llama-bench once on the MoE when it is found. Medians over the rounds after a
dropped warm-up.

Usage: python benchmarks/moe.py [-r 5] [--threads 2] [--llama-bench PATH] [--tree DIR]
Writes benchmarks/results/moe.md.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import harness

SHAPE = dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab=512)
MOE = dict(arch="qwen3moe", d_ff=2048, n_experts=64, n_experts_used=8, d_ff_expert=256)
DENSE = dict(arch="qwen3", d_ff=8 * 256)
TESTS = {"pp512": dict(test="pp", n=512, depth=0), "tg128": dict(test="tg", n=128, depth=0)}


def main():
    args = harness.parser(__doc__, 5, peer=True).parse_args()
    harness.require_llama_cpp()
    n_ctx, threads, tree = 1024, args.threads, args.tree
    write = harness.write_random_gguf
    with tempfile.TemporaryDirectory() as tmp:
        moe = write(Path(tmp) / "moe.gguf", **SHAPE, **MOE, name="qwen3moe-rand")
        dense = write(Path(tmp) / "dense.gguf", **SHAPE, **DENSE, name="qwen3-rand")
        workers = {
            "llama.cpp MoE": harness.peer_worker(moe, threads, n_ctx),
            "jaxinfer MoE": harness.jaxinfer_worker(moe, n_ctx, tree),
            "llama.cpp dense": harness.peer_worker(dense, threads, n_ctx),
            "jaxinfer dense": harness.jaxinfer_worker(dense, n_ctx, tree),
            "jaxinfer MoE, expert x2": harness.jaxinfer_worker(
                moe, n_ctx, tree, layout="expert", devices=2
            ),
            "jaxinfer MoE, expert x4": harness.jaxinfer_worker(
                moe, n_ctx, tree, layout="expert", devices=4
            ),
        }
        bench = harness.llama_bench_rounds(
            args.llama_bench, threads, {"llama-bench MoE": moe}, TESTS
        )
        med = harness.run_rounds([(workers, TESTS)], args.rounds, bench)
    lines = [
        f"# MoE vs llama.cpp and vs dense ({time.strftime('%Y-%m-%d')}, F32 GGUF, "
        f"{args.threads} threads, medians of {args.rounds} interleaved rounds after a dropped "
        "warm-up round)",
        "",
        "MoE: qwen3moe dim 512, 8 layers, 64 experts of width 256, top-8, vocab 512. Dense: "
        "qwen3 of the same shape with FFN 2048 (the same active parameters).",
        "",
        "| run | pp512 t/s | tg128 t/s |",
        "|---|---:|---:|",
        *harness.run_rows(med, [*workers, "llama-bench MoE"], TESTS),
        "",
        "| ratio | pp512 | tg128 |",
        "|---|---:|---:|",
    ]
    ratios = [
        ("jaxinfer MoE / llama.cpp MoE (peer)", "jaxinfer MoE", "llama.cpp MoE"),
        ("jaxinfer MoE / llama-bench MoE", "jaxinfer MoE", "llama-bench MoE"),
        ("jaxinfer MoE / jaxinfer dense (same active params)", "jaxinfer MoE", "jaxinfer dense"),
        ("llama.cpp MoE / llama.cpp dense", "llama.cpp MoE", "llama.cpp dense"),
        ("jaxinfer dense / llama.cpp dense", "jaxinfer dense", "llama.cpp dense"),
        ("expert x2 / single", "jaxinfer MoE, expert x2", "jaxinfer MoE"),
        ("expert x4 / single", "jaxinfer MoE, expert x4", "jaxinfer MoE"),
    ]
    lines += harness.ratio_rows(med, ratios, TESTS)
    text = "\n".join(lines) + "\n"
    print(text)
    harness.write_result("moe", text, args.out)


if __name__ == "__main__":
    main()
