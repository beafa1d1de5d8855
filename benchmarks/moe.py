"""MoE speed: a random Qwen3-MoE GGUF on jaxinfer and llama.cpp side by side, against a dense
model with the same active parameters, and under the expert split.

The MoE model: `qwen3moe`, dim 512, 8 layers, 8 heads / 4 kv heads, 64 experts of width 256,
top-8, stories vocabulary (512). The dense model: `qwen3` of the same shape with one FFN of
width 8 x 256 = 2048, so a token reads the same parameters (the MoE's router aside).

The workers are those of vs_llamacpp.py (the peer runs llama.cpp as llama-bench does; jaxinfer
is timed end to end around `generate()`). Each round runs pp512 and tg128 on: llama.cpp and
jaxinfer on the MoE, both on the dense model, jaxinfer with the `expert` layout on 2 and 4
fake CPU devices (the same 2 cores: this measures what the split costs, not a speed-up), and
llama-bench once on the MoE when it is found. Medians over the rounds after a dropped warm-up.

Usage: python benchmarks/moe.py [-r 5] [--threads 2] [--llama-bench PATH]
Writes benchmarks/results/moe.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_llamacpp import (  # noqa: E402
    PEER,
    ROOT,
    Worker,
    jaxinfer_worker,
    llama_bench,
    run_rounds,
    write_random_gguf,
)

SHAPE = dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab=512)
MOE = dict(arch="qwen3moe", d_ff=2048, n_experts=64, n_experts_used=8, d_ff_expert=256)
DENSE = dict(arch="qwen3", d_ff=8 * 256)
TESTS = {"pp512": dict(test="pp", n=512, depth=0), "tg128": dict(test="tg", n=128, depth=0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", default=shutil.which("llama-bench"), help="its binary")
    args = ap.parse_args()
    n_ctx, threads = 1024, str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        moe = write_random_gguf(Path(tmp) / "moe.gguf", **SHAPE, **MOE, name="qwen3moe-rand")
        dense = write_random_gguf(Path(tmp) / "dense.gguf", **SHAPE, **DENSE, name="qwen3-rand")
        workers = {
            "llama.cpp MoE": Worker(PEER, str(moe), threads, str(n_ctx)),
            "jaxinfer MoE": jaxinfer_worker(moe, args.threads, n_ctx),
            "llama.cpp dense": Worker(PEER, str(dense), threads, str(n_ctx)),
            "jaxinfer dense": jaxinfer_worker(dense, args.threads, n_ctx),
            "jaxinfer MoE, expert x2": jaxinfer_worker(
                moe, args.threads, n_ctx, layout="expert", devices=2
            ),
            "jaxinfer MoE, expert x4": jaxinfer_worker(
                moe, args.threads, n_ctx, layout="expert", devices=4
            ),
        }

        def bench():
            if not args.llama_bench:
                return {}
            found = llama_bench(args.llama_bench, moe, args.threads)
            return {("llama-bench MoE", t): v for t, v in found.items() if t in TESTS}

        med = run_rounds([(workers, TESTS)], args.rounds, bench)
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
    ]
    for name in [*workers, "llama-bench MoE"]:
        lines.append(f"| {name} | {med[name, 'pp512']:.1f} | {med[name, 'tg128']:.1f} |")
    lines += ["", "| ratio | pp512 | tg128 |", "|---|---:|---:|"]
    ratios = [
        ("jaxinfer MoE / llama.cpp MoE (peer)", "jaxinfer MoE", "llama.cpp MoE"),
        ("jaxinfer MoE / llama-bench MoE", "jaxinfer MoE", "llama-bench MoE"),
        ("jaxinfer MoE / jaxinfer dense (same active params)", "jaxinfer MoE", "jaxinfer dense"),
        ("llama.cpp MoE / llama.cpp dense", "llama.cpp MoE", "llama.cpp dense"),
        ("jaxinfer dense / llama.cpp dense", "jaxinfer dense", "llama.cpp dense"),
        ("expert x2 / single", "jaxinfer MoE, expert x2", "jaxinfer MoE"),
        ("expert x4 / single", "jaxinfer MoE, expert x4", "jaxinfer MoE"),
    ]
    for label, a, b in ratios:
        cells = [f"{med[a, t] / med[b, t]:.2f}x" for t in TESTS]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results" / "moe.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
