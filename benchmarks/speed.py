"""Prompt and decode speed of jaxinfer on stories260K and a ~110M random Llama (float32).

Measures, llama-bench style, pp (prompt tokens/s over a P-token prompt) and tg (decode
tokens/s over N new tokens) as the median of R repeats after one warm-up, plus the share of
decode time spent on the host outside compiled code. Writes a markdown table to
benchmarks/results/speed.md. Usage: python benchmarks/speed.py [-p 512] [-n 128] [-r 5]
"""

import statistics
import time

import harness

import jaxinfer


def measure(engine, p: int, n: int, repeats: int) -> dict:
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(p - 1)]
    kw = dict(temperature=0, ignore_eos=True)

    def pp():
        engine.reset_perf()
        engine.generate(prompt, max_new_tokens=1, **kw)
        s = engine.perf_stats()
        return 1e3 * s.prompt_tokens / s.prompt_ms

    def tg():
        engine.reset_perf()
        engine.generate([1], max_new_tokens=n, **kw)
        s = engine.perf_stats()
        return 1e3 * s.eval_tokens / s.eval_ms, s.host_share()

    # the first round compiles every program used
    runs = harness.interleaved({"pp": pp, "tg": tg}, repeats)
    tg_rate = harness.stat(rate for rate, _ in runs["tg"])
    print(f"spread over the rounds: pp {harness.stat(runs['pp']).spread:.0%}, "
          f"tg {tg_rate.spread:.0%}")  # fmt: skip
    return {
        "pp": statistics.median(runs["pp"]),
        "tg": tg_rate.median,
        "host": statistics.median(host for _, host in runs["tg"]),
        "compiles": engine.perf_stats().programs,
    }


def main():
    ap = harness.parser(__doc__, 5)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--decode-chunk", type=int, default=64)
    args = ap.parse_args()
    models = [
        ("stories260K (GGUF F32)", harness.model("stories260K")),
        ("llama-110M random F32", harness.model("llama-110M")),
    ]
    rows = [
        f"| model | pp{args.p} t/s | tg{args.n} t/s | host share of decode | decode chunk |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, model in models:
        t0 = time.perf_counter()
        engine = jaxinfer.load(model, max_seq_len=args.p + args.n, decode_chunk=args.decode_chunk)
        r = measure(engine, args.p, args.n, args.rounds)
        rows.append(
            f"| {label} | {r['pp']:.1f} | {r['tg']:.1f} | {r['host']:.1%} | {args.decode_chunk} |"
        )
        print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    header = (
        f"jaxinfer {jaxinfer.__version__}, medians of {args.rounds} repeats, float32, 1 slot\n\n"
    )
    harness.write_result("speed", header + "\n".join(rows), args.out)


if __name__ == "__main__":
    main()
