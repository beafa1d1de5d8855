"""Continuous batching: aggregate decode tokens/s with 1, 2 and 4 requests decoding at once on a
4-slot engine (one-token prompts, so the figure is decode), and time to first token under load
(16 requests with mixed prompt lengths submitted at once).

The request counts take turns, round after round; medians over the rounds (the first round is a
warm-up and dropped). Writes benchmarks/results/slots.md.
Usage: python benchmarks/slots.py [-r 5]
"""

import functools
import random
import statistics
import time

import harness

import jaxinfer


def decode_rate(engine, k: int, n: int) -> float:
    """New tokens per second with k requests decoding together."""
    t0 = time.perf_counter()
    requests = [
        engine.submit([1, 3 + i], max_new_tokens=n, temperature=0, ignore_eos=True)
        for i in range(k)
    ]
    tokens = sum(len(r.result().token_ids) for r in requests)
    return tokens / (time.perf_counter() - t0)


def first_token(engine, prompts, n) -> tuple[float, float]:
    requests = [engine.submit(p, max_new_tokens=n, temperature=0, ignore_eos=True) for p in prompts]
    for r in requests:
        r.result()
    ttft = sorted(r.time_to_first_token for r in requests)
    return statistics.median(ttft), ttft[int(0.95 * (len(ttft) - 1))]


def main():
    args = harness.parser(__doc__, 5).parse_args()
    rng = random.Random(0)
    rows = [
        "| model | requests decoding | aggregate t/s | vs 1 | TTFT p50 / p95 s (16 mixed) |",
        "|---|---:|---:|---:|---|",
    ]
    for label, n in [("stories260K", 128), ("llama-86M", 32)]:
        engine = jaxinfer.load(harness.model(label), max_seq_len=512, slots=4)
        engine.warmup(progress=False)
        tests = {k: functools.partial(decode_rate, engine, k, n) for k in (1, 2, 4)}
        runs = harness.interleaved(tests, args.rounds)
        prompts = [[1] + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 120))]
                   for _ in range(16)]  # fmt: skip
        p50, p95 = first_token(engine, prompts, n // 4)
        base = statistics.median(runs[1])
        for k, rates in runs.items():
            rate, spread = harness.stat(rates)
            ttft = f"{p50:.3f} / {p95:.3f}" if k == 4 else ""
            rows.append(f"| {label} | {k} | {rate:.1f} | {rate / base:.2f}x | {ttft} |")
            print(rows[-1], f"(spread {spread:.0%})", flush=True)
        del engine
    harness.write_result(
        "slots",
        f"jaxinfer {jaxinfer.__version__} ({time.strftime('%Y-%m-%d')}), float32, greedy, 4-slot "
        f"engines, medians of {args.rounds} interleaved rounds\n\n" + "\n".join(rows),
        args.out,
    )


if __name__ == "__main__":
    main()
