"""One process of a scripted group (examples/multihost.py's way): it joins jax.distributed and
loads the engine exactly as `jaxinfer serve` with the same flags would (the CLI's own parser,
options and load), warms it up, and then drives it itself: no leader, no lockstep channel;
every process submits the same requests in the same order, so the device calls agree.

Usage: group_script.py FLAGS_JSON (the `serve` flags, --coordinator and --process-id included).
Prints {"ready": true}, then answers each JSON line {"prompts": [[ids]...], "n": N} (greedy,
ignore_eos, all submitted before any is driven) with {"ts": tokens/s, "texts": [...]}, the
wall time taken from the first submit to the last result. Exits at the end of its input.
"""

import json
import sys
import time

from jaxinfer import cli
from jaxinfer.cli import group


def main():
    args = cli._parser().parse_args(["serve", *json.loads(sys.argv[1])])
    args.grouped = group.join(args)  # before any device, as cli.main does
    engine = cli._load(args)  # load(args.model, options=cli._options(args)), as serve does
    engine.warmup()  # its report goes to stderr (the log)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        kw = dict(max_new_tokens=cmd["n"], temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        requests = [engine.submit(p, **kw) for p in cmd["prompts"]]
        results = [r.result() for r in requests]
        wall = time.perf_counter() - t0
        tokens = sum(len(r.token_ids) for r in results)
        print(json.dumps({"ts": tokens / wall, "texts": [r.text for r in results]}), flush=True)
    import jax

    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
