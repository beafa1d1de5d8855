"""Hybrid linear attention speed: a random Qwen3.5 GGUF (Gated DeltaNet + gated attention) on
jaxinfer and llama.cpp side by side, against a dense model of the same size, and graph reuse
ON vs OFF under the layer split.

The hybrid: `qwen35`, dim 512, 8 layers = 6 Gated DeltaNet (4 key / 8 value heads of 64) + 2
gated attention (4 heads / 2 kv heads of 128), FFN 1536, vocab 4096, written by
tests/hybrid_checkpoints.py exactly as llama.cpp's converter writes. The dense model: `qwen3`
with the same width, layers, attention shape, FFN and vocab (every layer attends).

The workers are those of vs_llamacpp.py (the peer runs llama.cpp as llama-bench does; jaxinfer
is timed end to end around `generate()`; at a depth, the depth prompt's prefill is taken out).
Each round runs pp512, tg128, tg128 at depth 1024 and tg128 at depth 1536 on both models and
both engines, llama-bench once on the hybrid when it is found, and 16 decode tokens at one
token per call under `layer` on 2 fake CPU devices with graph reuse ON and OFF (OFF rebuilds
the decode program every call: re-trace, re-lower, compile). Medians over the rounds after a
dropped warm-up round.

Usage: python benchmarks/hybrid.py [-r 3] [--threads 2] [--llama-bench PATH]
Writes benchmarks/results/hybrid.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hybrid_checkpoints import hybrid_bench_gguf  # noqa: E402
from vs_llamacpp import (  # noqa: E402
    PEER,
    ROOT,
    Worker,
    jaxinfer_worker,
    llama_bench,
    run_rounds,
    write_random_gguf,
)

DENSE = dict(arch="qwen3", d_model=512, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=1536)
TESTS = {
    "pp512": dict(test="pp", n=512, depth=0),
    "tg128": dict(test="tg", n=128, depth=0),
    "tg128 @ d1024": dict(test="tg", n=128, depth=1024),
    "tg128 @ d1536": dict(test="tg", n=128, depth=1536),
}
REUSE = dict(test="tg", n=16, depth=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", default=shutil.which("llama-bench"), help="its binary")
    args = ap.parse_args()
    n_ctx, threads = 2048, str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        hybrid = hybrid_bench_gguf(Path(tmp) / "hybrid.gguf", arch="qwen35")
        dense = write_random_gguf(Path(tmp) / "dense.gguf", **DENSE, vocab=4096, name="qwen3")
        workers = {
            "llama.cpp hybrid": Worker(PEER, str(hybrid), threads, str(n_ctx)),
            "jaxinfer hybrid": jaxinfer_worker(hybrid, args.threads, n_ctx),
            "llama.cpp dense": Worker(PEER, str(dense), threads, str(n_ctx)),
            "jaxinfer dense": jaxinfer_worker(dense, args.threads, n_ctx),
        }
        split = dict(layout="layer", devices=2, decode_chunk=1, batch_buckets=[1])
        reuse = {
            "reuse ON": jaxinfer_worker(hybrid, args.threads, 256, **split),
            "reuse OFF": jaxinfer_worker(hybrid, args.threads, 256, graph_reuse=False, **split),
        }

        def bench():
            if not args.llama_bench:
                return {}
            found = llama_bench(args.llama_bench, hybrid, args.threads)
            return {("llama-bench hybrid", t): v for t, v in found.items() if t in TESTS}

        med = run_rounds([(workers, TESTS), (reuse, {"tg16": REUSE})], args.rounds, bench)
    head = " | ".join(f"{t} t/s" for t in TESTS)
    lines = [
        f"# Hybrid (Gated DeltaNet) vs llama.cpp and vs dense ({time.strftime('%Y-%m-%d')}, F32 "
        f"GGUF, {args.threads} threads, medians of {args.rounds} interleaved rounds after a "
        "dropped warm-up round)",
        "",
        "Hybrid: qwen35 dim 512, 8 layers = 6 Gated DeltaNet + 2 gated attention, FFN 1536, "
        "vocab 4096. Dense: qwen3 of the same shape, every layer attention.",
        "",
        f"| run | {head} |",
        "|---|" + "---:|" * len(TESTS),
    ]
    for name in [*workers, "llama-bench hybrid"]:
        cells = " | ".join(f"{med[name, t]:.1f}" for t in TESTS)
        lines.append(f"| {name} | {cells} |")
    lines += ["", f"| ratio | {' | '.join(TESTS)} |", "|---|" + "---:|" * len(TESTS)]
    ratios = [
        ("jaxinfer hybrid / llama.cpp hybrid (peer)", "jaxinfer hybrid", "llama.cpp hybrid"),
        ("jaxinfer hybrid / llama-bench hybrid", "jaxinfer hybrid", "llama-bench hybrid"),
        ("jaxinfer dense / llama.cpp dense", "jaxinfer dense", "llama.cpp dense"),
    ]
    for label, a, b in ratios:
        cells = [f"{med[a, t] / med[b, t]:.2f}x" for t in TESTS]
        lines.append(f"| {label} | {' | '.join(cells)} |")
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
    out = ROOT / "benchmarks" / "results" / "hybrid.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
