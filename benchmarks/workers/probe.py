"""One jaxinfer load of a GGUF, probed: peak host RSS growth over `load()` (resident memory
sampled every 2 ms against before it, jax already initialized), the device weight bytes
(`engine.weight_bytes()`, where the Engine has it), what the parameters are held as, and the
first N greedy tokens.

Usage: probe.py GGUF N_CTX PROMPT_JSON N QUANTIZE [ACTIVATIONS]. Prints one JSON line
{"rss", "weight_bytes", "leaves": {dtype: bytes}, "ids"}.
"""

import json
import os
import sys
import threading
import time

import jax

import jaxinfer


def now():  # resident bytes now (ru_maxrss would hold import's peak, above a small load)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main():
    path, n_ctx, prompt, n = (
        sys.argv[1],
        int(sys.argv[2]),
        json.loads(sys.argv[3]),
        int(sys.argv[4]),
    )
    jax.numpy.zeros(1).block_until_ready()
    base, peak, loading = now(), [0], [True]

    def sample():
        while loading[0]:
            peak[0] = max(peak[0], now())
            time.sleep(0.002)

    watcher = threading.Thread(target=sample)
    watcher.start()
    acts = {"activations": sys.argv[6]} if len(sys.argv) > 6 else {}
    engine = jaxinfer.load(path, max_seq_len=n_ctx, quantize=sys.argv[5], **acts)
    loading[0] = False
    watcher.join()
    rss = max(peak[0], now()) - base
    weight_bytes = engine.weight_bytes() if hasattr(engine, "weight_bytes") else None
    leaves = {}  # what the parameters are held as: dtype -> bytes
    for x in jax.tree_util.tree_leaves(engine.params):
        kind = str(getattr(x, "dtype", type(x).__name__))
        leaves[kind] = leaves.get(kind, 0) + int(getattr(x, "nbytes", 0))
    r = engine.generate(prompt, max_new_tokens=n, temperature=0, ignore_eos=True)
    ids = [int(i) for i in r.token_ids]
    print(json.dumps(dict(rss=rss, weight_bytes=weight_bytes, leaves=leaves, ids=ids)))


if __name__ == "__main__":
    main()
