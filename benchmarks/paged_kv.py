"""Paged KV cache and one scheduler loop, measured against main before it (side by side).

Two worker processes, one per checkout (this tree, and `--main`: a checkout of the commit
before the paged cache, e.g. `git worktree add /tmp/jaxinfer-main ed8c8da`), load the same GGUF
(stories260K, default settings: context 2048). The parent sends them the same measurements in
turn, round after round, so both run in the same minutes; figures are medians over rounds.

- programs in the plan, cold warmup (no persistent cache), warm warmup (a second process on
  the persistent cache the first one filled);
- decode tok/s at depths 0, 512, 1536 (128 new tokens after a prompt of that length);
- pp512 (prompt tokens/s over 512 tokens);
- with `--pages`: the same for each page size, this tree only (the page-size choice);
- with `--soak N`: host RSS and KV bytes over N requests through 4 slots (this tree).

Writes benchmarks/results/paged_kv.md. Usage:
    python benchmarks/paged_kv.py --main /tmp/jaxinfer-main [-r 5] [--pages] [--soak 400]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import harness

TESTS = {
    "tg0": dict(op="tg", depth=0, n=128),
    "tg512": dict(op="tg", depth=512, n=128),
    "tg1536": dict(op="tg", depth=1536, n=128),
    "pp512": dict(op="pp", n=512),
}


def worker_on(tree: Path, options: dict) -> harness.Worker:
    """A worker process (workers/paged.py) on `tree`'s jaxinfer with load options `options`."""
    env = harness.worker_env(tree)
    return harness.Worker("paged", harness.STORIES, json.dumps(options), key="out", env=env)


def warmups(tree: Path, cache_dir: str | None) -> tuple[float, int]:
    """(warmup seconds, programs) of a fresh process."""
    worker = worker_on(tree, {"cache_dir": cache_dir})
    try:
        return worker(op="warmup")
    finally:
        worker.close()


def speed(workers: dict[str, harness.Worker], rounds: int) -> dict[str, dict[str, float]]:
    """Medians by worker and test over interleaved rounds (the first one dropped: first calls
    of every program). Closes the workers."""
    med = harness.run_rounds([(workers, TESTS)], rounds)
    return {name: {t: med[name, t] for t in TESTS} for name in workers}


def main():
    ap = harness.parser(__doc__, 5)
    ap.add_argument("--main", type=Path, required=True, help="checkout of main before this work")
    ap.add_argument("--pages", action="store_true", help="also sweep the page size")
    ap.add_argument("--soak", type=int, default=0, help="requests of the RSS soak (0 = skip)")
    args = ap.parse_args()
    trees = {"main": args.main, "paged": harness.ROOT}
    lines = [
        f"# Paged KV cache vs main ({time.strftime('%Y-%m-%d')}, stories260K GGUF F32, "
        f"context 2048, 2 cores; medians of {args.rounds} interleaved rounds)",
        "",
    ]

    warm = {}
    for name, tree in trees.items():
        cold_s, programs = warmups(tree, None)
        with tempfile.TemporaryDirectory() as d:
            warmups(tree, d)  # fills the persistent cache
            warm_s, _ = warmups(tree, d)
        warm[name] = (programs, cold_s, warm_s)
        print(name, warm[name], flush=True)

    fig = speed({name: worker_on(tree, {}) for name, tree in trees.items()}, args.rounds)
    m, p = fig["main"], fig["paged"]
    lines += [
        "| figure | main | paged | paged / main |",
        "|---|---:|---:|---:|",
        f"| programs in the plan | {warm['main'][0]} | {warm['paged'][0]} | |",
        f"| cold warmup (s) | {warm['main'][1]:.1f} | {warm['paged'][1]:.1f} | "
        f"{warm['paged'][1] / warm['main'][1]:.2f}x |",
        f"| warm warmup, second process (s) | {warm['main'][2]:.1f} | {warm['paged'][2]:.1f} | "
        f"{warm['paged'][2] / warm['main'][2]:.2f}x |",
    ]
    for t in ("tg0", "tg512", "tg1536", "pp512"):
        lines.append(f"| {t} tok/s | {m[t]:.0f} | {p[t]:.0f} | {p[t] / m[t]:.2f}x |")
    lines.append(
        f"| decode at depth 1536 / depth 0 | {m['tg1536'] / m['tg0']:.2f} | "
        f"{p['tg1536'] / p['tg0']:.2f} | |"
    )
    print("\n".join(lines), flush=True)

    if args.pages:
        sizes = (16, 32, 64, 128, 256)
        workers = {f"page {s}": worker_on(harness.ROOT, {"page_size": s}) for s in sizes}
        fig = speed(workers, args.rounds)
        lines += [
            "",
            "Page size (this tree only, interleaved the same way):",
            "",
            "| page size | tg0 | tg512 | tg1536 | pp512 |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, f in fig.items():
            lines.append(
                f"| {name.split()[1]} | {f['tg0']:.0f} | {f['tg512']:.0f} | "
                f"{f['tg1536']:.0f} | {f['pp512']:.0f} |"
            )
        print("\n".join(lines[-len(sizes) - 2 :]), flush=True)

    if args.soak:
        worker = worker_on(harness.ROOT, {"slots": 4, "max_seq_len": 1600})
        try:
            s = worker(op="soak", n=args.soak)
        finally:
            worker.close()
        mib = 2**20
        lines += [
            "",
            f"Soak ({args.soak} requests, prompts 1..1500, 4 slots, greedy): host RSS "
            f"every 50 requests (MiB): {s['rss_mib']}; KV bytes in use: mean "
            f"{s['kv_in_use_mean'] / mib:.2f} MiB, max {s['kv_in_use_max'] / mib:.2f} MiB, "
            f"of {s['kv_allocated'] / mib:.2f} MiB allocated.",
        ]
        print(lines[-1], flush=True)

    harness.write_result("paged_kv", "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
