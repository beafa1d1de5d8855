"""Continuous batching: aggregate decode tokens/s with 1, 2, 4 and 8 slots, and time to first
token under load (16 requests with mixed prompt lengths submitted at once).

Side by side in one run, medians of R repeats. Writes benchmarks/results/slots.md.
Usage: python benchmarks/slots.py [-r 3]
"""

import argparse
import random
import statistics
import time
from pathlib import Path

from speed import LLAMA_110M, STORIES

import jaxinfer

ROOT = Path(__file__).resolve().parents[1]


def run(engine, prompts, n):
    t0 = time.perf_counter()
    requests = [engine.submit(p, max_new_tokens=n, temperature=0, ignore_eos=True) for p in prompts]
    results = [r.result() for r in requests]
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    ttft = sorted(r.time_to_first_token for r in requests)
    return tokens / wall, statistics.median(ttft), ttft[int(0.95 * (len(ttft) - 1))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    rows = ["| model | slots | requests | new tokens each | aggregate t/s | vs 1 slot | "
            "TTFT p50 s | TTFT p95 s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label, model, n, count in [
        ("stories260K", STORIES, 64, 16),
        ("llama-110M", LLAMA_110M, 16, 8),
    ]:
        prompts = [[1] + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 120))]
                   for _ in range(count)]  # fmt: skip
        base = None
        for slots in (1, 2, 4, 8):
            engine = jaxinfer.load(model, max_seq_len=256, slots=slots, prefill_buckets=(32, 128))
            run(engine, prompts[:slots], n)  # warm-up: compiles every program it needs
            rates, p50s, p95s = zip(*[run(engine, prompts, n) for _ in range(args.r)], strict=True)
            rate = statistics.median(rates)
            base = base or rate
            p50, p95 = statistics.median(p50s), statistics.median(p95s)
            rows.append(f"| {label} | {slots} | {count} | {n} | {rate:.1f} | {rate / base:.2f}x | "
                        f"{p50:.3f} | {p95:.3f} |")  # fmt: skip
            print(rows[-1], flush=True)
            del engine
    out = ROOT / "benchmarks" / "results" / "slots.md"
    out.write_text(f"jaxinfer {jaxinfer.__version__}, float32, greedy, medians of {args.r}; all "
                   "requests submitted at once\n\n" + "\n".join(rows) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
