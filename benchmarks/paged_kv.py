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

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_llamacpp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260K-gguf" / "stories260K.gguf"

WORKER = r"""
import json, os, sys, time, resource
sys.path.insert(0, sys.argv[1])
import jaxinfer
options = json.loads(sys.argv[3])
cache = options.pop("cache_dir", None)
engine = jaxinfer.load(sys.argv[2], compile_cache_dir=cache, **options)
kw = dict(temperature=0, ignore_eos=True)

def prompt(n):
    return [1] + [(7 * i) % 250 + 3 for i in range(n - 1)]

def tg(depth, n):
    p = prompt(depth + 1)
    engine.reset_perf(); engine.generate(p, max_new_tokens=n, **kw); s = engine.perf_stats()
    return 1e3 * s.eval_tokens / s.eval_ms

def pp(n):
    engine.reset_perf(); engine.generate(prompt(n), max_new_tokens=1, **kw); s = engine.perf_stats()
    return 1e3 * s.prompt_tokens / s.prompt_ms

def warmup():
    t0 = time.perf_counter(); engine.warmup(progress=False)
    return time.perf_counter() - t0, engine.perf_stats().programs

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20

def soak(n):
    import random
    rng = random.Random(0)
    rss, kv, live = [], [], []
    for i in range(n):
        ids = [1] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 1500))]
        live.append(engine.submit(ids, max_new_tokens=rng.randrange(1, 48), temperature=0))
        while len(live) > 8:  # keep 8 in flight; finished ones are dropped, as a server would
            engine.step()
            live = [r for r in live if not r.done]
            s = engine.kv_stats(); kv.append((s["bytes_in_use"], s["bytes_allocated"]))
        if (i + 1) % 50 == 0:
            rss.append(rss_mib())
    for r in live:
        r.result()
    return {"rss_mib": rss, "kv_in_use_max": max(k[0] for k in kv),
            "kv_in_use_mean": sum(k[0] for k in kv) / len(kv), "kv_allocated": kv[0][1]}

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    out = {"tg": lambda: tg(cmd["depth"], cmd["n"]), "pp": lambda: pp(cmd["n"]),
           "warmup": warmup, "soak": lambda: soak(cmd["n"])}[cmd["op"]]()
    print(json.dumps({"out": out}), flush=True)
"""


def worker_on(tree: Path, options: dict) -> vs_llamacpp.Worker:
    """A worker process on `tree`'s jaxinfer with load options `options`."""
    return vs_llamacpp.Worker(WORKER, str(tree), str(STORIES), json.dumps(options), key="out")


def warmups(tree: Path, cache_dir: str | None) -> tuple[float, int]:
    """(warmup seconds, programs) of a fresh process."""
    worker = worker_on(tree, {"cache_dir": cache_dir})
    try:
        return worker(op="warmup")
    finally:
        worker.close()


def speed(workers: dict[str, vs_llamacpp.Worker], rounds: int) -> dict[str, dict[str, float]]:
    tests = [
        ("tg0", dict(op="tg", depth=0, n=128)),
        ("tg512", dict(op="tg", depth=512, n=128)),
        ("tg1536", dict(op="tg", depth=1536, n=128)),
        ("pp512", dict(op="pp", n=512)),
    ]
    for w in workers.values():  # one untimed round: first calls of every program
        for _, cmd in tests:
            w(**cmd)
    runs = {name: {t: [] for t, _ in tests} for name in workers}
    for _ in range(rounds):
        for t, cmd in tests:
            for name, w in workers.items():
                runs[name][t].append(w(**cmd))
    return {name: {t: statistics.median(v) for t, v in r.items()} for name, r in runs.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--main", type=Path, required=True, help="checkout of main before this work")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--pages", action="store_true", help="also sweep the page size")
    ap.add_argument("--soak", type=int, default=0, help="requests of the RSS soak (0 = skip)")
    args = ap.parse_args()
    trees = {"main": args.main, "paged": ROOT}
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

    workers = {name: worker_on(tree, {}) for name, tree in trees.items()}
    try:
        fig = speed(workers, args.rounds)
    finally:
        for w in workers.values():
            w.close()
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
        workers = {f"page {s}": worker_on(ROOT, {"page_size": s}) for s in sizes}
        try:
            fig = speed(workers, args.rounds)
        finally:
            for w in workers.values():
                w.close()
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
        worker = worker_on(ROOT, {"slots": 4, "max_seq_len": 1600})
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

    out = ROOT / "benchmarks" / "results" / "paged_kv.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
