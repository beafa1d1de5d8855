"""What a grammar-constrained token costs, and what constrained rows cost the free rows beside
them.

Two models: stories260K (512-token vocabulary) and a random Llama of the 86M body with a
32,000-token SentencePiece-style vocabulary (harness.write_random_gguf: 259 byte and special
tokens and 31,741 `\u2581w<i>` words), each loaded with 4 slots. The constraint is a JSON
schema whose one string must run past the budget ({"text": string of 2,000..4,000
characters}), so a constrained request never ends early and nearly every token is allowed at
each step: a string's mask is llguidance's costliest (the whole token trie is walked).

Tests, interleaved round after round (medians over the rounds), greedy, ignore_eos, NEW tokens
per request:
- `1 free` / `1 json`: one request alone, ms per generated token (Result.decode_ms).
- `4 free` / `2 json + 2 free`: four requests in the 4 slots; aggregate tokens/s (all tokens /
  wall) and the free requests' own tokens/s (their tokens / their latency).
And, apart, the host's share of a constrained token: llguidance's mask fill and token consume
replayed over one constrained request's tokens (medians, microseconds).

Usage: python benchmarks/structured.py [-r 5]
Writes benchmarks/results/structured.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import harness

NEW = 64
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 2000, "maxLength": 4000}},
    "required": ["text"],
}
PROMPTS = ["Once upon a time", "The little dog", "Tom and Lily went", "One sunny day"]


def models(folder: Path) -> dict:
    llama = dict(harness.LLAMA_86M, vocab=32000, name="llama-86M-32k (random)")
    path = harness.write_random_gguf(folder / "llama-32k.gguf", **llama)
    return {"stories260K (V=512)": harness.STORIES, "llama-86M body (V=32000)": path}


def tests(engine) -> dict:
    free = dict(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    json_ = dict(free, json_schema=SCHEMA)

    def alone(params):
        r = engine.generate(PROMPTS[0], **params)
        return r.decode_ms / (len(r.token_ids) - 1)

    def four(kinds):
        t0 = time.perf_counter()
        pairs = zip(PROMPTS, kinds, strict=True)
        requests = [engine.submit(p, **(json_ if k else free)) for p, k in pairs]
        results = [r.result() for r in requests]
        wall = time.perf_counter() - t0
        total = sum(len(r.token_ids) for r in results)
        done = zip(results, requests, kinds, strict=True)
        free_rates = [len(r.token_ids) / q.latency for r, q, k in done if not k]
        return total / wall, statistics.mean(free_rates)

    return {
        "1 free": lambda: alone(free),
        "1 json": lambda: alone(json_),
        "4 free": lambda: four([False] * 4),
        "2 json + 2 free": lambda: four([True, True, False, False]),
    }


def host_cost(engine) -> tuple[float, float]:
    """Median microseconds of a mask fill and of a consume, over one constrained request's
    tokens replayed through a fresh matcher."""
    from jaxinfer.options import SamplingParams
    from jaxinfer.runtime.structured import Constraint

    params = SamplingParams(max_new_tokens=NEW, temperature=0, json_schema=SCHEMA)
    ids = engine.generate(PROMPTS[0], sampling=params).token_ids
    fills, consumes = [], []
    for _ in range(5):
        c = Constraint.of(engine.vocabulary, params)
        for t in ids:
            t0 = time.perf_counter()
            c.mask()
            t1 = time.perf_counter()
            c.consume(t)
            fills.append(t1 - t0)
            consumes.append(time.perf_counter() - t1)
    return statistics.median(fills) * 1e6, statistics.median(consumes) * 1e6


def main():
    args = harness.parser(__doc__, rounds=5).parse_args()
    import jaxinfer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models(Path(tmp)).items():
            engine = jaxinfer.load(path, slots=4, max_seq_len=1024, prefill_buckets=(32, 128))
            engine.warmup(progress=False)
            runs = harness.interleaved(tests(engine), args.rounds)
            fill, consume = host_cost(engine)
            med = {k: harness.stat(v if k.startswith("1") else [a for a, _ in v])
                   for k, v in runs.items()}  # fmt: skip
            free_rate = {k: harness.stat([b for _, b in runs[k]]) for k in runs if "free" in k
                         and not k.startswith("1")}  # fmt: skip
            rows.append((name, med, free_rate, fill, consume, engine.perf_stats()))
    lines = [
        "# Structured output: the cost of a constrained token",
        "",
        f"`python benchmarks/structured.py -r {args.rounds}`, interleaved rounds, medians "
        f"(spread = (max - min) / median). {NEW} greedy tokens per request (ignore_eos); "
        "constrained = a JSON schema whose one string outlasts the budget (the costliest mask: "
        "nearly every token allowed). 4 slots.",
        "",
        "| model | 1 free ms/token | 1 json ms/token | json / free | mask fill us | consume us |",
        "|---|---|---|---|---|---|",
    ]
    for name, med, _, fill, consume, _ in rows:
        a, b = med["1 free"], med["1 json"]
        lines.append(
            f"| {name} | {a.median:.2f} ({a.spread:.0%}) | {b.median:.2f} ({b.spread:.0%}) | "
            f"{b.median / a.median:.2f}x | {fill:.0f} | {consume:.0f} |"
        )
    lines += [
        "",
        "| model | 4 free t/s | 2 json + 2 free t/s | ratio | free rows' t/s: 4 free | "
        "beside 2 json | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, med, free_rate, *_ in rows:
        a, b = med["4 free"], med["2 json + 2 free"]
        fa, fb = free_rate["4 free"], free_rate["2 json + 2 free"]
        lines.append(
            f"| {name} | {a.median:.1f} ({a.spread:.0%}) | {b.median:.1f} ({b.spread:.0%}) | "
            f"{b.median / a.median:.2f}x | {fa.median:.1f} | {fb.median:.1f} | "
            f"{fb.median / fa.median:.2f}x |"
        )
    after = [f"{name}: {p.programs - p.warmup_programs} programs, {p.untracked_compiles} "
             "untracked" for name, *_, p in rows]  # fmt: skip
    lines += ["", f"Compiles after warmup: {'; '.join(after)}."]
    harness.write_result("structured", "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
