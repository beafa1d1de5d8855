"""Prompt and decode speed of jaxinfer on stories260K and a ~110M random Llama (float32).

Measures, llama-bench style, pp (prompt tokens/s over a P-token prompt) and tg (decode
tokens/s over N new tokens) as the median of R repeats after one warm-up, plus the share of
decode time spent on the host outside compiled code. Writes a markdown table to
benchmarks/results/speed.md. Usage: python benchmarks/speed.py [-p 512] [-n 128] [-r 5]
"""

import argparse
import statistics
import time
from pathlib import Path

import jaxinfer

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260K-gguf" / "stories260K.gguf"
LLAMA_110M = jaxinfer.ModelConfig(
    arch="llama", d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64,
    d_ff=2048, vocab_size=32000, max_position=2048, name="llama-110M (random)",
)  # fmt: skip


def measure(engine, p: int, n: int, repeats: int) -> dict:
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(p - 1)]
    kw = dict(temperature=0, ignore_eos=True)
    engine.generate(prompt, max_new_tokens=n, **kw)  # warm-up: compiles every program used
    engine.generate([1], max_new_tokens=n, **kw)
    pp, tg, host = [], [], []
    for _ in range(repeats):
        engine.reset_perf()
        engine.generate(prompt, max_new_tokens=1, **kw)
        s = engine.perf_stats()
        pp.append(1e3 * s.prompt_tokens / s.prompt_ms)
        engine.reset_perf()
        engine.generate([1], max_new_tokens=n, **kw)
        s = engine.perf_stats()
        tg.append(1e3 * s.eval_tokens / s.eval_ms)
        host.append(s.host_share())
    return {
        "pp": statistics.median(pp),
        "tg": statistics.median(tg),
        "host": statistics.median(host),
        "compiles": engine.perf_stats().programs,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--decode-chunk", type=int, default=64)
    args = ap.parse_args()
    models = [("stories260K (GGUF F32)", STORIES), ("llama-110M random F32", LLAMA_110M)]
    rows = [
        f"| model | pp{args.p} t/s | tg{args.n} t/s | host share of decode | decode chunk |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, model in models:
        t0 = time.perf_counter()
        engine = jaxinfer.load(model, max_seq_len=args.p + args.n, decode_chunk=args.decode_chunk)
        r = measure(engine, args.p, args.n, args.r)
        rows.append(
            f"| {label} | {r['pp']:.1f} | {r['tg']:.1f} | {r['host']:.1%} | {args.decode_chunk} |"
        )
        print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    out = ROOT / "benchmarks" / "results" / "speed.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = f"jaxinfer {jaxinfer.__version__}, medians of {args.r} repeats, float32, 1 slot\n\n"
    out.write_text(header + "\n".join(rows) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
