"""What sampling costs: `sampling.sample` per decode step over vocabularies of 512, 32k and
152k tokens (in a compiled loop, as the decode program runs it), and decode tokens/s of a
~110M random Llama (32k vocabulary) greedy against llama.cpp's default sampler chain.

Sampler settings: greedy; llama.cpp's defaults (temperature 0.8, top-k 40, top-p 0.95, min-p
0.05); top-p 0.95 alone; no filter at temperature 1. Logits are N(0, 3^2) (over 32k, top-p
0.95's nucleus holds 3237 tokens: more than the 128 candidates, so that row sorts) or
N(0, 8^2) (peaked: 7 tokens). Medians of R repeats after a warm-up; the decode modes take
turns. Writes benchmarks/results/sampler.md.
Usage: python benchmarks/sampler.py [-r 5]
"""

import functools
import itertools
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer import SamplingParams
from jaxinfer.ops.sampling import PENALTY_WINDOW, SamplingRows, sample

LLAMA_110M = harness.model("llama-110M")
MODES = {
    "greedy": dict(temperature=0.0),
    "llama.cpp defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "top-p 0.95": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
    "no filter": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
}
STEPS = 16


def per_step(V: int, B: int, scale: float, mode: dict, repeats: int) -> float:
    """Microseconds per call of `sample` on [B, V] logits, in a loop of STEPS calls."""
    rows = SamplingRows.stack(
        [SamplingRows.row(SamplingParams(seed=b, **mode), b, []) for b in range(B)], B
    )
    logits = np.random.default_rng(0).normal(size=(B, V)).astype(np.float32) * scale
    window = np.full((B, PENALTY_WINDOW), -1, np.int32)

    @jax.jit
    def loop(logits):
        def step(i, carry):
            x, total = carry
            t = sample(x, window, rows, jnp.full((B,), i, jnp.int32))
            return x.at[:, 0].add(1e-6 * t[0]), total + t  # a dependency between the steps

        return jax.lax.fori_loop(0, STEPS, step, (logits, jnp.zeros(B, jnp.int32)))

    return harness.timed(lambda: jax.block_until_ready(loop(logits)), repeats).median / STEPS * 1e6


def decode_rates(repeats: int, n: int = 64) -> dict[str, float]:
    engine = jaxinfer.load(LLAMA_110M, max_seq_len=512)

    def rate(mode: dict, seeds):  # seeded with the round's number
        engine.reset_perf()
        engine.generate([1], max_new_tokens=n, ignore_eos=True, seed=next(seeds), **mode)
        s = engine.perf_stats()
        return 1e3 * s.eval_tokens / s.eval_ms

    names = ("greedy", "llama.cpp defaults")
    tests = {name: functools.partial(rate, MODES[name], itertools.count()) for name in names}
    runs = harness.interleaved(tests, repeats)  # the first round compiles
    return {name: harness.stat(r).median for name, r in runs.items()}


def main():
    args = harness.parser(__doc__, 5).parse_args()
    rows = [
        "| vocabulary | rows | logits | " + " | ".join(MODES) + " |",
        "|---:|---:|---|" + "---:|" * len(MODES),
    ]
    for V, B, scale in [(512, 1, 3.0), (512, 4, 3.0), (32000, 1, 3.0), (32000, 1, 8.0),
                        (32000, 4, 3.0), (151936, 1, 3.0)]:  # fmt: skip
        cells = [f"{per_step(V, B, scale, m, args.rounds):.0f}" for m in MODES.values()]
        rows.append(f"| {V} | {B} | N(0, {scale:g}^2) | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    rates = decode_rates(args.rounds)
    decode = [
        "| model | greedy t/s | llama.cpp defaults t/s |",
        "|---|---:|---:|",
        f"| {LLAMA_110M.name} | {rates['greedy']:.1f} | {rates['llama.cpp defaults']:.1f} |",
    ]
    print("\n".join(decode))
    harness.write_result(
        "sampler",
        f"jaxinfer {jaxinfer.__version__} ({time.strftime('%Y-%m-%d')}), "
        f"{jax.devices()[0].platform}, medians of {args.rounds}\n\n"
        "Microseconds per `sample` call (one decode step's draw for every row):\n\n"
        + "\n".join(rows)
        + "\n\nDecode, one request (64 new tokens):\n\n"
        + "\n".join(decode),
        args.out,
    )


if __name__ == "__main__":
    main()
