"""Graph reuse ON vs OFF: decode tokens/s when every step reuses its compiled program vs when
every step rebuilds it (re-trace + re-lower + compile; XLA may still serve the executable
from the persistent compilation cache), like llama.cpp with graph reuse disabled.

Runs stories260K and the ~110M random Llama, at 1 token per compiled call (a step per token,
as llama.cpp) and at 16. Medians of R repeats of wall time over N new tokens, in one run.
Writes benchmarks/results/graph_reuse.md. Usage: python benchmarks/graph_reuse.py [-n 64] [-r 3]
"""

import argparse
import statistics
import time
from pathlib import Path

from speed import LLAMA_110M, STORIES

import jaxinfer

ROOT = Path(__file__).resolve().parents[1]


def decode_rate(engine, n: int, repeats: int) -> tuple[float, float]:
    """(median decode tokens/s by wall clock, median host share with reuse on)."""
    kw = dict(max_new_tokens=n, temperature=0, ignore_eos=True)
    engine.generate([1], **kw)  # warm-up
    rates, host = [], []
    for _ in range(repeats):
        engine.reset_perf()
        t0 = time.perf_counter()
        r = engine.generate([1], **kw)
        rates.append(len(r.token_ids) / (time.perf_counter() - t0))
        host.append(engine.perf_stats().host_share())
    return statistics.median(rates), statistics.median(host)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    args = ap.parse_args()
    rows = [
        "| model | tokens per call | reuse ON t/s | reuse OFF t/s | ON / OFF | host share (ON) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, model in [("stories260K", STORIES), ("llama-110M", LLAMA_110M)]:
        for chunk in (1, 16):
            on = jaxinfer.load(model, max_seq_len=256, decode_chunk=chunk, batch_buckets=(1,))
            off = jaxinfer.load(
                model, max_seq_len=256, decode_chunk=chunk, batch_buckets=(1,), graph_reuse=False
            )
            n = args.n if chunk > 1 or label == "stories260K" else min(args.n, 16)
            (r_on, host), (r_off, _) = decode_rate(on, n, args.r), decode_rate(off, n, args.r)
            rows.append(
                f"| {label} | {chunk} | {r_on:.1f} | {r_off:.2f} | {r_on / r_off:.1f}x | "
                f"{host:.1%} |"
            )
            print(rows[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "graph_reuse.md"
    note = (
        f"jaxinfer {jaxinfer.__version__}, float32, 1 slot, {args.n} new tokens "
        f"(16 for llama-110M at 1 token per call), median of {args.r}; OFF = program rebuilt "
        "every call (persistent XLA cache on)\n\n"
    )
    out.write_text(note + "\n".join(rows) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
