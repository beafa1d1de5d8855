"""Speculative decoding: decode tok/s with and without it, side by side in one process.

Engines are loaded once and warmed up; every round runs each (model, workload, method) once,
interleaved, and the table reports medians over the rounds (the first round is dropped).
Decode tok/s is the eval phase of `perf_stats()` (the prompt is left out), greedy, one row.

Workloads:
- copy: a passage (the model's own 96 greedy tokens from BOS), then BOS and its first 12
  tokens again, so that the continuation can be looked up (if the model copies);
- plain: "Once upon a time" prompts for stories260K, random ids for the random 86M;
- long: the plain prompt, 256 new tokens (four calls: an n-gram engine starts a prompt that
  does not end in a repeat with a plain call, then tries drafting; runtime/drafting.py);
- draft (86M only): stories260K drafting for the 86M random model (same vocabulary): the
  drafts are hardly ever accepted, so this is the mechanism's overhead;
- self: the model as its own draft: acceptance must be ~100% (a check of the accept logic).

    python benchmarks/speculative.py [-r 5] [--out benchmarks/results/speculative.md]

Prints the table; writes it only to --out.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from pathlib import Path

import harness
import numpy as np

import jaxinfer

N_NEW = 64


def _run(engine, prompt, n_new=N_NEW) -> tuple[float, float, float]:
    """(decode tok/s, acceptance, tokens per step) of one greedy request."""
    engine.reset_perf()
    engine.generate(prompt, max_new_tokens=n_new, temperature=0, ignore_eos=True)
    s = engine.perf_stats()
    rate = 1e3 * s.eval_tokens / s.eval_ms
    accept = s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0
    per = (s.spec_steps + s.accepted_tokens) / s.spec_steps if s.spec_steps else 1.0
    return rate, accept, per


def main() -> None:
    args = harness.parser(__doc__, 5).parse_args()
    stories = harness.STORIES
    tmp = Path(tempfile.mkdtemp())
    big = harness.write_random_gguf(tmp / "86m.gguf", **harness.LLAMA_86M, vocab_from=stories)
    opts = dict(max_seq_len=512, batch_buckets=(1,), prefill_buckets=(32, 128, 512))
    rng = np.random.default_rng(0)
    cases = {}  # (model, workload, method) -> a timed run
    for label, path in (("stories260K", stories), ("llama-86M (random)", big)):
        base = jaxinfer.load(path, **opts)
        ngram = jaxinfer.load(path, speculative="ngram", draft_tokens=4, **opts)
        self_draft = jaxinfer.load(path, speculative=str(path), draft_tokens=4, **opts)
        passage = base.generate([1], max_new_tokens=96, temperature=0, ignore_eos=True).token_ids
        copy = [1, *passage, 1, *passage[:12]]
        if label == "stories260K":
            plain = base.tokenize("Once upon a time, there was a little girl who")
        else:
            plain = [1, *(int(t) for t in rng.integers(3, 512, 40))]
        runs = [
            ("copy", "none", base, copy),
            ("copy", "ngram K=4", ngram, copy),
            ("plain", "none", base, plain),
            ("plain", "ngram K=4", ngram, plain),
            ("long", "none", base, plain),
            ("long", "ngram K=4", ngram, plain),
            ("plain", "self draft K=4", self_draft, plain),
        ]
        if label != "stories260K":
            draft = jaxinfer.load(path, speculative=str(stories), draft_tokens=4, **opts)
            runs.append(("plain", "stories260K draft K=4", draft, plain))
        for work, method, engine, prompt in runs:
            engine.warmup(progress=False)
            n_new = 4 * N_NEW if work == "long" else N_NEW
            cases[label, work, method] = functools.partial(_run, engine, prompt, n_new)
    runs = harness.interleaved(cases, args.rounds, progress=True)
    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in runs.items()}
    lines = [
        "| model | workload | method | decode tok/s | vs none | accepted | tokens per step |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for (label, work, method), (rate, accept, per) in med.items():
        none = med[label, work, "none"][0]
        lines.append(
            f"| {label} | {work} | {method} | {rate:.1f} | {rate / none:.2f}x | "
            f"{accept:.0%} | {per:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        harness.write_result("speculative", table, args.out)


if __name__ == "__main__":
    main()
