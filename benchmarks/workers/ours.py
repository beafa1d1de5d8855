"""jaxinfer timed end to end around `generate()`, beside peer.py (loaded with its defaults and
the given options, warmed up).

pp N = N over the wall time of a `max_new_tokens=1` call on an N-token prompt; tg N = N over
the wall time of a `max_new_tokens=N` call on a one-token prompt; at depth D the prompt is
1 + D tokens and its prefill time (the engine's own clock) is taken out of the wall time.

Usage: ours.py GGUF N_CTX OPTIONS_JSON (load()'s keywords). Prints {"ready": true}, then answers
each JSON line {"test": "pp" | "tg", "n": N, "depth": D} with {"ts": tokens/s}.
{"test": "rss"} answers the process's peak resident bytes so far (VmHWM) as "ts".
"""

import json
import sys
import time

import jaxinfer


def main():
    path, n_ctx, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    engine = jaxinfer.load(path, max_seq_len=n_ctx, **options)
    engine.warmup(progress=False)
    rng = [12345]

    def ids(n):
        out = []
        for _ in range(n):
            rng[0] = (1103515245 * rng[0] + 12345) % 2**31
            out.append(3 + rng[0] % (engine.cfg.vocab_size - 3))
        return [1] + out[: n - 1]

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["test"] == "rss":  # the process's peak resident bytes so far (VmHWM)
            hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")]
            print(json.dumps({"ts": int(hwm[0].split()[1]) * 1024}))
            sys.stdout.flush()
            continue
        kw = dict(temperature=0, ignore_eos=True)
        if cmd["test"] == "pp":
            p = ids(cmd["depth"] + cmd["n"])
            t0 = time.perf_counter()
            engine.generate(p, max_new_tokens=1, **kw)
            ts = cmd["n"] / (time.perf_counter() - t0) if not cmd["depth"] else None
        else:
            engine.reset_perf()
            t0 = time.perf_counter()
            r = engine.generate(ids(cmd["depth"] + 1), max_new_tokens=cmd["n"], **kw)
            wall = time.perf_counter() - t0
            if cmd["depth"]:  # the depth prompt's prefill (which also made the first token) is out
                ts = (len(r.token_ids) - 1) / (wall - engine.perf_stats().prompt_ms / 1e3)
            else:
                ts = len(r.token_ids) / wall
        print(json.dumps({"ts": ts}), flush=True)


if __name__ == "__main__":
    main()
