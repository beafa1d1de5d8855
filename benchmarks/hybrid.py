"""Hybrid linear attention speed: a random Qwen3.5 GGUF (Gated DeltaNet + gated attention) on
jaxinfer and llama.cpp side by side, against a dense model of the same size, and graph reuse
ON vs OFF under the layer split.

The hybrid: `qwen35`, dim 512, 8 layers = 6 Gated DeltaNet (4 key / 8 value heads of 64) + 2
gated attention (4 heads / 2 kv heads of 128), FFN 1536, vocab 4096, written by
harness.write_random_gguf with the keys and tensors llama.cpp's converter writes. The dense
model: `qwen3` with the same width, layers, attention shape, FFN and vocab (every layer attends).

The workers are those of vs_llamacpp.py (workers/peer.py runs llama.cpp as llama-bench does;
workers/ours.py times jaxinfer end to end around `generate()`; at a depth, the depth prompt's
prefill is taken out). Each round runs pp512, tg128, tg128 at depth 1024 and tg128 at depth 1536
on both models and both engines, llama-bench once on the hybrid when it is found, and 16 decode
tokens at one token per call under `layer` on 2 fake CPU devices with graph reuse ON and OFF
(OFF rebuilds the decode program every call: re-trace, re-lower, compile). Medians over the
rounds after a dropped warm-up round.

Usage: python benchmarks/hybrid.py [-r 3] [--threads 2] [--llama-bench PATH] [--tree DIR]
Writes benchmarks/results/hybrid.md.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import harness

SHAPE = dict(d_model=512, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=1536, vocab=4096)
TESTS = {
    "pp512": dict(test="pp", n=512, depth=0),
    "tg128": dict(test="tg", n=128, depth=0),
    "tg128 @ d1024": dict(test="tg", n=128, depth=1024),
    "tg128 @ d1536": dict(test="tg", n=128, depth=1536),
}
REUSE = dict(test="tg", n=16, depth=0)


def main():
    args = harness.parser(__doc__, 3, peer=True).parse_args()
    harness.require_llama_cpp()
    n_ctx, threads, tree = 2048, args.threads, args.tree
    with tempfile.TemporaryDirectory() as tmp:
        hybrid = harness.write_random_gguf(
            Path(tmp) / "hybrid.gguf", **SHAPE, arch="qwen35", name="bench-qwen35"
        )
        dense = harness.write_random_gguf(Path(tmp) / "dense.gguf", **SHAPE, arch="qwen3",
                                          name="qwen3")  # fmt: skip
        workers = {
            "llama.cpp hybrid": harness.peer_worker(hybrid, threads, n_ctx),
            "jaxinfer hybrid": harness.jaxinfer_worker(hybrid, n_ctx, tree),
            "llama.cpp dense": harness.peer_worker(dense, threads, n_ctx),
            "jaxinfer dense": harness.jaxinfer_worker(dense, n_ctx, tree),
        }
        split = dict(layout="layer", devices=2, decode_chunk=1, batch_buckets=[1])
        reuse = {
            "reuse ON": harness.jaxinfer_worker(hybrid, 256, tree, **split),
            "reuse OFF": harness.jaxinfer_worker(hybrid, 256, tree, graph_reuse=False, **split),
        }
        bench = harness.llama_bench_rounds(
            args.llama_bench, threads, {"llama-bench hybrid": hybrid}, TESTS
        )
        med = harness.run_rounds([(workers, TESTS), (reuse, {"tg16": REUSE})], args.rounds, bench)
    lines = [
        f"# Hybrid (Gated DeltaNet) vs llama.cpp and vs dense ({time.strftime('%Y-%m-%d')}, F32 "
        f"GGUF, {args.threads} threads, medians of {args.rounds} interleaved rounds after a "
        "dropped warm-up round)",
        "",
        "Hybrid: qwen35 dim 512, 8 layers = 6 Gated DeltaNet + 2 gated attention, FFN 1536, "
        "vocab 4096. Dense: qwen3 of the same shape, every layer attention.",
        "",
        f"| run | {' | '.join(f'{t} t/s' for t in TESTS)} |",
        "|---|" + "---:|" * len(TESTS),
        *harness.run_rows(med, [*workers, "llama-bench hybrid"], TESTS),
        "",
        f"| ratio | {' | '.join(TESTS)} |",
        "|---|" + "---:|" * len(TESTS),
    ]
    ratios = [
        ("jaxinfer hybrid / llama.cpp hybrid (peer)", "jaxinfer hybrid", "llama.cpp hybrid"),
        ("jaxinfer hybrid / llama-bench hybrid", "jaxinfer hybrid", "llama-bench hybrid"),
        ("jaxinfer dense / llama.cpp dense", "jaxinfer dense", "llama.cpp dense"),
    ]
    lines += harness.ratio_rows(med, ratios, TESTS)
    lines += ["", "| decode at depth 1536 / depth 0 | hybrid | dense |", "|---|---:|---:|"]
    for engine in ("jaxinfer", "llama.cpp"):
        cells = [
            f"{med[f'{engine} {m}', 'tg128 @ d1536'] / med[f'{engine} {m}', 'tg128']:.2f}x"
            for m in ("hybrid", "dense")
        ]
        lines.append(f"| {engine} | {' | '.join(cells)} |")
    on, off = med["reuse ON", "tg16"], med["reuse OFF", "tg16"]
    lines += [
        "",
        "Graph reuse under `layer` on 2 fake CPU devices (the same 2 cores), one token per "
        f"decode call: ON {on:.1f} t/s, OFF {off:.2f} t/s: ON / OFF = {on / off:.1f}x "
        "(llama.cpp lost 16% turning its graph reuse off for this split).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    harness.write_result("hybrid", text, args.out)


if __name__ == "__main__":
    main()
