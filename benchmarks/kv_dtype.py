"""The KV cache's dtype at depth: jaxinfer with float32, float16 and q8_0 K/V against llama.cpp
(its C API run as llama-bench runs it, F16 K/V, and with -ctk q8_0 -ctv q8_0), side by side.

Two random 86M Llamas (harness.LLAMA_86M: 12 layers, d 768, 12 heads of 64): the F32 file at
depth 1536 (jaxinfer with its default options beside llama.cpp's default F16 cache: the
question behind `kv_cache_dtype="auto"`), and its Q8_0 quantization (llama.cpp's quantizer) at
depth 4096, where the K/V read per token outweighs the weights. tg128 at depth d: 128 new tokens
after a prompt of d (jaxinfer: its prefill time taken out, as workers/ours.py does; llama.cpp:
its own counters). Interleaved rounds, the first dropped, medians.

Usage: python benchmarks/kv_dtype.py [-r 5] [--threads 2] [--work DIR]
Writes benchmarks/results/kv_dtype.md.
"""

from __future__ import annotations

import time
from pathlib import Path

import harness

RUNS = {  # file -> (test, n_ctx, workers: name -> (engine, KV dtype))
    "F32": ("tg128 @ d1536", 2048, {"llama.cpp f16": ("peer", "f16"),
                                    "ours default": ("ours", None),
                                    "ours float16": ("ours", "float16"),
                                    "ours q8_0": ("ours", "q8_0")}),
    # llama.cpp's own Q8_0 products stop on an illegal instruction on this VM (its native
    # build's AMX tiles): the Q8_0 file's rows are ours alone
    "Q8_0": ("tg128 @ d4096", 4352, {"ours float16": ("ours", "float16"),
                                     "ours q8_0": ("ours", "q8_0")}),
}  # fmt: skip


def main():
    ap = harness.parser(__doc__, 5, peer=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/jaxinfer-kv-dtype"))
    args = ap.parse_args()
    harness.require_llama_cpp()
    args.work.mkdir(parents=True, exist_ok=True)
    f32 = args.work / "86m-F32.gguf"
    if not f32.exists():
        harness.write_random_gguf(f32, **harness.LLAMA_86M)
    q8 = args.work / "86m-Q8_0.gguf"
    if not q8.exists():
        harness.once("quantize", f32, q8, "LLAMA_FTYPE_MOSTLY_Q8_0")
    lines = [
        f"# KV cache dtype at depth ({time.strftime('%Y-%m-%d')}, random 86M Llama, "
        f"{args.threads} threads, medians of {args.rounds} interleaved rounds after a dropped "
        "warm-up round)",
        "",
        "| file | test | engine, K/V | t/s | vs llama.cpp f16 | vs ours float16 |",
        "|---|---|---|---:|---:|---:|",
    ]
    for label, path in (("F32", f32), ("Q8_0", q8)):
        test, n_ctx, who = RUNS[label]
        depth = int(test.split("@ d")[1])
        workers = {}
        for name, (engine, kv) in who.items():
            if engine == "peer":
                workers[name] = harness.peer_worker(path, args.threads, n_ctx, kv)
            else:
                options = {} if kv is None else {"kv_cache_dtype": kv}
                workers[name] = harness.jaxinfer_worker(path, n_ctx, args.tree, **options)
        med = harness.run_rounds([(workers, {test: dict(test="tg", n=128, depth=depth)})],
                                 args.rounds)  # fmt: skip
        for name in who:
            ts = med[name, test]
            peer, ours16 = med["llama.cpp f16", test], med["ours float16", test]
            vs_peer = f"{ts / peer:.2f}x" if "llama.cpp f16" in who else "-"
            lines.append(f"| {label} | {test} | {name} | {ts:.1f} | {vs_peer} | "
                         f"{ts / ours16:.2f}x |")  # fmt: skip
            print(lines[-1], flush=True)
    harness.write_result("kv_dtype", "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
