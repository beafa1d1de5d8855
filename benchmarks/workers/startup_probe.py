"""One fresh process's start on a GGUF, timed: what realshape.py reports beside the speeds.

Modes (the file's pages are read once first, so every load finds them in the page cache):
- `bare`: `import jax` and a first array on the CPU -> {"import_s", "rss"} (peak bytes);
- `ours`: jax as in `bare`, then `jaxinfer.load(GGUF, max_seq_len=N_CTX)` without a warmup
  -> {"import_s", "load_s", "rss"}; with `cold`, then `engine.warmup()` into an empty compile
  folder (nothing compiled or stored) -> adds {"warmup_s", "programs"}; with `run`, the load
  and warmup use the default compile folder (the executable store), then a 512-token prompt
  and 16 tokens (the peak RSS of serving);
- `peer`: llama.cpp's model load and context creation as peer.py makes them -> {"load_s",
  "rss"}; with `run`, then a 512-token prompt and 16 tokens;
- `bandwidth`: a copy of `N_CTX` MiB by 2 threads (numpy's copy, each thread half), bytes
  read + written per second, median of 5 after a first copy that faults the pages in
  -> {"bytes_per_s"}.

Usage: startup_probe.py MODE GGUF N_CTX [cold | run] [OPTIONS_JSON]. Prints one JSON line.
"""

import json
import resource
import sys
import tempfile
import time


def warm(path: str):
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def rss() -> int:
    """Peak resident bytes of this process: VmHWM, whose mark starts afresh at exec (ru_maxrss
    keeps the parent's at fork: a benchmark that has just written a large file would lend its
    children its own peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def copy_bandwidth(n: int, threads: int = 2) -> float:
    import statistics
    import threading

    import numpy as np

    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    times = []
    for _ in range(6):
        part = [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]
        run = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in part]
        t0 = time.perf_counter()
        for t in run:
            t.start()
        for t in run:
            t.join()
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times[1:])


def main():
    mode, path, n_ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rest = sys.argv[4:]
    if mode != "bandwidth":
        warm(path)
    if mode == "peer":
        import ctypes

        import llama_cpp as L
        from peer import QUIET, context

        L.llama_log_set(QUIET, ctypes.c_void_p())
        t0 = time.perf_counter()
        ctx, n_vocab, _ = context(path, 2, n_ctx)
        loaded = time.perf_counter() - t0
        if "run" in rest:
            ids = (L.llama_token * 512)(*[1 + i * 7919 % (n_vocab - 1) for i in range(512)])
            assert L.llama_decode(ctx, L.llama_batch_get_one(ids, 512)) == 0  # ids kept alive
            for i in range(16):
                tok = (L.llama_token * 1)(3 + i)
                assert L.llama_decode(ctx, L.llama_batch_get_one(tok, 1)) == 0
            L.llama_synchronize(ctx)
        print(json.dumps({"load_s": loaded, "rss": rss()}))
        return
    if mode == "bandwidth":
        print(json.dumps({"bytes_per_s": copy_bandwidth(n_ctx << 20)}))
        return
    t0 = time.perf_counter()
    import jax

    jax.numpy.zeros(1).block_until_ready()
    imported = time.perf_counter() - t0
    if mode == "bare":
        print(json.dumps({"import_s": imported, "rss": rss()}))
        return
    import jaxinfer

    options = json.loads(rest[-1]) if rest and rest[-1].startswith("{") else {}
    with tempfile.TemporaryDirectory() as cache:
        if "cold" in rest:
            options["compile_cache_dir"] = cache
        t0 = time.perf_counter()
        engine = jaxinfer.load(path, max_seq_len=n_ctx, **options)
        out = {"import_s": imported, "load_s": time.perf_counter() - t0}
        if "cold" in rest or "run" in rest:
            t0 = time.perf_counter()
            engine.warmup(progress=False)
            out |= {"warmup_s": time.perf_counter() - t0, "programs": len(engine.compile_plan())}
        if "run" in rest:
            ids = [1 + i * 7919 % (engine.cfg.vocab_size - 1) for i in range(512)]
            engine.generate(ids, max_new_tokens=16, temperature=0, ignore_eos=True)
    print(json.dumps(out | {"rss": rss()}))


if __name__ == "__main__":
    main()
