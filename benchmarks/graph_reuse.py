"""Graph reuse ON vs OFF: decode tokens/s when every step reuses its compiled program vs when
every step rebuilds it (re-trace + re-lower + compile; XLA may still serve the executable
from the persistent compilation cache), like llama.cpp with graph reuse disabled.

Runs stories260K and the ~110M random Llama, at 1 token per compiled call (a step per token,
as llama.cpp) and at 16. Medians of R repeats of wall time over N new tokens, in one run.
Writes benchmarks/results/graph_reuse.md. Usage: python benchmarks/graph_reuse.py [-n 64] [-r 3]
"""

import statistics
import time

import harness

import jaxinfer


def decode_rate(engine, n: int, repeats: int) -> tuple[float, float]:
    """(median decode tokens/s by wall clock, median host share with reuse on)."""
    kw = dict(max_new_tokens=n, temperature=0, ignore_eos=True)

    def once():
        engine.reset_perf()
        t0 = time.perf_counter()
        r = engine.generate([1], **kw)
        return len(r.token_ids) / (time.perf_counter() - t0), engine.perf_stats().host_share()

    runs = harness.repeated(once, repeats)  # after a warm-up call
    return statistics.median(r for r, _ in runs), statistics.median(h for _, h in runs)


def main():
    ap = harness.parser(__doc__, 3)
    ap.add_argument("-n", type=int, default=64)
    args = ap.parse_args()
    models = [(name, harness.model(name)) for name in ("stories260K", "llama-110M")]
    rows = [
        "| model | tokens per call | reuse ON t/s | reuse OFF t/s | ON / OFF | host share (ON) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, model in models:
        for chunk in (1, 16):
            on = jaxinfer.load(model, max_seq_len=256, decode_chunk=chunk, batch_buckets=(1,))
            off = jaxinfer.load(
                model, max_seq_len=256, decode_chunk=chunk, batch_buckets=(1,), graph_reuse=False
            )
            n = args.n if chunk > 1 or label == "stories260K" else min(args.n, 16)
            (r_on, host), (r_off, _) = (
                decode_rate(on, n, args.rounds),
                decode_rate(off, n, args.rounds),
            )
            rows.append(
                f"| {label} | {chunk} | {r_on:.1f} | {r_off:.2f} | {r_on / r_off:.1f}x | "
                f"{host:.1%} |"
            )
            print(rows[-1], flush=True)
    note = (
        f"jaxinfer {jaxinfer.__version__}, float32, 1 slot, {args.n} new tokens "
        f"(16 for llama-110M at 1 token per call), median of {args.rounds}; OFF = program rebuilt "
        "every call (persistent XLA cache on)\n\n"
    )
    harness.write_result("graph_reuse", note + "\n".join(rows), args.out)


if __name__ == "__main__":
    main()
