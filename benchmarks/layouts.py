"""Decode tokens/s under single and layer split (2 and 4 stages) on 4 fake CPU devices, with
1 and 4 rows decoding together, and graph reuse ON vs OFF under layer split.

Side by side in one run, medians of R repeats; aggregate tokens/s = all rows' new tokens over
the decode wall time. Writes benchmarks/results/layouts.md.
Usage: python benchmarks/layouts.py [-n 64] [-r 3]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from speed import LLAMA_110M, STORIES  # noqa: E402

import jaxinfer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def rate(engine, rows: int, n: int, repeats: int) -> float:
    prompts = [[1, 3 + i] for i in range(rows)] if rows > 1 else [1, 3]
    kw = dict(max_new_tokens=n, temperature=0, ignore_eos=True)
    engine.generate(prompts, **kw)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = engine.generate(prompts, **kw)
        seconds = time.perf_counter() - t0
        total = sum(len(r.token_ids) for r in results) if rows > 1 else len(results.token_ids)
        out.append(total / seconds)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    args = ap.parse_args()
    rows = ["| model | layout | devices | rows | graph reuse | t/s | vs single |",
            "|---|---|---:|---:|---|---:|---:|"]  # fmt: skip
    for label, model in [("stories260K", STORIES), ("llama-110M", LLAMA_110M)]:
        n = args.n if label == "stories260K" else min(args.n, 32)
        base = {}
        for slots in (1, 4):
            for layout, devices, reuse in [
                ("single", 1, True), ("layer", 2, True), ("layer", 4, True),
                ("layer", 4, False),
            ]:  # fmt: skip
                engine = jaxinfer.load(
                    model, layout=layout, devices=devices, max_seq_len=256,
                    batch_buckets=(slots,), graph_reuse=reuse,
                )  # fmt: skip
                r = rate(engine, slots, n, args.r)
                base.setdefault(slots, r)
                rows.append(
                    f"| {label} | {layout} | {devices} | {slots} | {'on' if reuse else 'off'} | "
                    f"{r:.1f} | {r / base[slots]:.2f}x |"
                )
                print(rows[-1], flush=True)
                del engine
    out = ROOT / "benchmarks" / "results" / "layouts.md"
    note = (f"jaxinfer {jaxinfer.__version__}, float32, 4 fake CPU devices on a 2-core machine "
            f"(the devices share the cores: this measures overheads, not scaling), "
            f"{args.n} new tokens (32 for llama-110M), median of {args.r}\n\n")  # fmt: skip
    out.write_text(note + "\n".join(rows) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
