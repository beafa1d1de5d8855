"""jaxinfer against llama.cpp on the same GGUF, run the way llama-bench runs it, side by side.

The peer is a worker process (workers/peer.py) on llama.cpp's C API (through llama-cpp-python's
ctypes bindings, `pip install ".[llamacpp]"`), doing what llama-bench's `test_prompt` /
`test_gen` do: flash attention on, F16 K/V cache, n_batch = n_ubatch = 512, the same threads
for batch and generation, prompt batches through `llama_batch_get_one` (logits of the last token
only), one token per decode for generation, the cache cleared between runs, a depth prompt first
for `-d`. It is timed by llama.cpp's own counters (`llama_perf_context`).

jaxinfer runs in a second worker (workers/ours.py: loaded with its defaults, warmed up), timed
end to end around `generate()`, which is what a user gets: pp512 = 512 over the wall time of a
`max_new_tokens=1` call on a 512-token prompt; tg128 = 128 over the wall time of a
`max_new_tokens=128` call on a one-token prompt (128 forward passes, as llama-bench's 128
decodes); at depth d, the prompt is 1 + d tokens and its prefill time (the engine's own clock)
is taken out of the wall time, leaving 127 decodes for 127 tokens.

The parent sends both workers the same tests in turn, round after round (the first round is a
warm-up and dropped), and runs llama-bench itself once per round when it is found (on PATH or
`--llama-bench PATH`, e.g. built from llama-cpp-python's vendored llama.cpp with cmake): the
table shows all three, medians over the rounds, and jaxinfer's ratio to each. A third worker
runs jaxinfer with `kv_cache_dtype="float16"`, the K/V cache llama.cpp keeps.

Usage: python benchmarks/vs_llamacpp.py [-r 5] [--threads 2] [--llama-bench PATH] [--tree DIR]
Writes benchmarks/results/vs_llamacpp.md.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import harness

TESTS = {
    "pp512": dict(test="pp", n=512, depth=0),
    "tg128": dict(test="tg", n=128, depth=0),
    "tg128 @ d512": dict(test="tg", n=128, depth=512),
    "tg128 @ d1536": dict(test="tg", n=128, depth=1536),
}


def main():
    args = harness.parser(__doc__, 5, peer=True).parse_args()
    harness.require_llama_cpp()
    n_ctx = 2048  # depth 1536 + 128 new tokens
    bench = args.llama_bench
    lines = [
        f"# jaxinfer vs llama.cpp ({time.strftime('%Y-%m-%d')}, F32 GGUF, {args.threads} threads, "
        f"medians of {args.rounds} interleaved rounds after a dropped warm-up round)",
        "",
        "Each round runs every test on the C-API peer and on jaxinfer, then llama-bench itself "
        "once" + (" (`-r 1`)." if bench else " (not found: its column is empty)."),
        "",
        "| model | test | llama-bench t/s | peer t/s | jaxinfer t/s | vs llama-bench | vs peer "
        "| jaxinfer KV f16 t/s | KV f16 vs llama-bench |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        llama86 = harness.write_random_gguf(Path(tmp) / "86m.gguf", **harness.LLAMA_86M)
        for label, path in [("stories260K", harness.STORIES), ("llama-86M (random)", llama86)]:
            workers = {
                "peer": harness.peer_worker(path, args.threads, n_ctx),
                "ours": harness.jaxinfer_worker(path, n_ctx, args.tree),
                "f16": harness.jaxinfer_worker(path, n_ctx, args.tree, kv_cache_dtype="float16"),
            }
            tool = harness.llama_bench_rounds(bench, args.threads, {"llama-bench": path}, TESTS)
            med = harness.run_rounds([(workers, TESTS)], args.rounds, tool)
            for name in TESTS:
                t, m, h = (med[w, name] for w in ("peer", "ours", "f16"))
                b = med["llama-bench", name]
                lines.append(f"| {label} | {name} | {b:.1f} | {t:.1f} | {m:.1f} | {m / b:.2f}x | "
                             f"{m / t:.2f}x | {h:.1f} | {h / b:.2f}x |")  # fmt: skip
                print(lines[-1], flush=True)
    harness.write_result("vs_llamacpp", "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
