"""Decode tokens/s under single and layer split (2 and 4 stages) on 4 fake CPU devices, with
1 and 4 rows decoding together, and graph reuse ON vs OFF under layer split.

Side by side in one run, medians of R repeats; aggregate tokens/s = all rows' new tokens over
the decode wall time. Writes benchmarks/results/layouts.md.
Usage: python benchmarks/layouts.py [-n 64] [-r 3]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import statistics  # noqa: E402
import time  # noqa: E402

import harness  # noqa: E402

import jaxinfer  # noqa: E402


def rate(engine, rows: int, n: int, repeats: int) -> float:
    prompts = [[1, 3 + i] for i in range(rows)] if rows > 1 else [1, 3]
    kw = dict(max_new_tokens=n, temperature=0, ignore_eos=True)

    def once():
        t0 = time.perf_counter()
        results = engine.generate(prompts, **kw)
        seconds = time.perf_counter() - t0
        total = sum(len(r.token_ids) for r in results) if rows > 1 else len(results.token_ids)
        return total / seconds

    return statistics.median(harness.repeated(once, repeats))  # after a warm-up call


def main():
    ap = harness.parser(__doc__, 3)
    ap.add_argument("-n", type=int, default=64)
    args = ap.parse_args()
    models = [(name, harness.model(name)) for name in ("stories260K", "llama-110M")]
    rows = ["| model | layout | devices | rows | graph reuse | t/s | vs single |",
            "|---|---|---:|---:|---|---:|---:|"]  # fmt: skip
    for label, model in models:
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
                r = rate(engine, slots, n, args.rounds)
                base.setdefault(slots, r)
                rows.append(
                    f"| {label} | {layout} | {devices} | {slots} | {'on' if reuse else 'off'} | "
                    f"{r:.1f} | {r / base[slots]:.2f}x |"
                )
                print(rows[-1], flush=True)
                del engine
    note = (f"jaxinfer {jaxinfer.__version__}, float32, 4 fake CPU devices on a 2-core machine "
            f"(the devices share the cores: this measures overheads, not scaling), "
            f"{args.n} new tokens (32 for llama-110M), median of {args.rounds}\n\n")  # fmt: skip
    harness.write_result("layouts", note + "\n".join(rows), args.out)


if __name__ == "__main__":
    main()
