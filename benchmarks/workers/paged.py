"""jaxinfer on one GGUF for paged_kv.py: warmup time, decode and prompt speed, and a soak of
host RSS and KV bytes (its tree on PYTHONPATH: this checkout or main before the paged cache).

Usage: paged.py GGUF OPTIONS_JSON (load()'s keywords, plus cache_dir: the persistent compile
cache). Prints {"ready": true}, then answers each JSON line {"op": "warmup"} / {"op": "tg",
"depth", "n"} / {"op": "pp", "n"} / {"op": "soak", "n"} with {"out": ...}.
"""

import json
import os
import random
import sys
import time

import jaxinfer

KW = dict(temperature=0, ignore_eos=True)


def prompt(n):
    return [1] + [(7 * i) % 250 + 3 for i in range(n - 1)]


def tg(engine, depth, n):
    engine.reset_perf()
    engine.generate(prompt(depth + 1), max_new_tokens=n, **KW)
    s = engine.perf_stats()
    return 1e3 * s.eval_tokens / s.eval_ms


def pp(engine, n):
    engine.reset_perf()
    engine.generate(prompt(n), max_new_tokens=1, **KW)
    s = engine.perf_stats()
    return 1e3 * s.prompt_tokens / s.prompt_ms


def warmup(engine):
    t0 = time.perf_counter()
    engine.warmup(progress=False)
    return time.perf_counter() - t0, engine.perf_stats().programs


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def soak(engine, n):
    rng = random.Random(0)
    rss, kv, live = [], [], []
    for i in range(n):
        ids = [1] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 1500))]
        live.append(engine.submit(ids, max_new_tokens=rng.randrange(1, 48), temperature=0))
        while len(live) > 8:  # keep 8 in flight; finished ones are dropped, as a server would
            engine.step()
            live = [r for r in live if not r.done]
            s = engine.kv_stats()
            kv.append((s["bytes_in_use"], s["bytes_allocated"]))
        if (i + 1) % 50 == 0:
            rss.append(rss_mib())
    for r in live:
        r.result()
    return {
        "rss_mib": rss,
        "kv_in_use_max": max(k[0] for k in kv),
        "kv_in_use_mean": sum(k[0] for k in kv) / len(kv),
        "kv_allocated": kv[0][1],
    }


def main():
    options = json.loads(sys.argv[2])
    cache = options.pop("cache_dir", None)
    engine = jaxinfer.load(sys.argv[1], compile_cache_dir=cache, **options)
    ops = {
        "tg": lambda cmd: tg(engine, cmd["depth"], cmd["n"]),
        "pp": lambda cmd: pp(engine, cmd["n"]),
        "warmup": lambda cmd: warmup(engine),
        "soak": lambda cmd: soak(engine, cmd["n"]),
    }
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        print(json.dumps({"out": ops[cmd["op"]](cmd)}), flush=True)


if __name__ == "__main__":
    main()
