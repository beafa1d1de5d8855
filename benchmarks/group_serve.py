"""The cost of staying in step: `jaxinfer serve` over two processes (process 0 serves HTTP and
sends each device call to process 1 over its lockstep socket) against the same two processes
driven by a script, as examples/multihost.py does (each process loads the engine and submits
the same requests in the same order; nothing is sent between them but jax's collectives).

Both groups: 2 processes on jax.distributed (127.0.0.1), 2 fake CPU devices each
(JAX_NUM_CPU_DEVICES=2, XLA_FLAGS unset), the same `serve` flags (-np 4 -c 256 -ub 32, the
layout over all 4 devices; the script builds its engine with the CLI's own parser and options)
and one compile cache dir per (model, layout), so the second group loads what the first
compiled. A round: 4 requests of 16 prompt tokens (token ids), 128 greedy tokens each with
ignore_eos, all at once; server: 4 concurrent non-streaming /v1/completions (threads,
http.client), wall from the first send to the last response; script: process 0's wall from the
first submit to the last result. tokens/s = 512 / wall. Both groups stay up; one untimed round
each (their texts must agree), then the two take turns (-r rounds each, 3x for stories260K,
the first of a pair alternating); medians. Each round waits for idle CPUs and is run again if
another process took a quarter of a core during it (this machine is shared). /metrics before
and after each server round gives the lockstep calls and bytes (per follower; heartbeats not
counted): bytes per call and per generated token. Every process runs a copy of --tree's
jaxinfer/ taken at the start (edits during the run change neither the code nor the store's
keys). Writes benchmarks/results/group_serve.md.

Usage: python benchmarks/group_serve.py [-r 5] [--models stories260K,86M] [--layouts layer,tensor]
"""

import contextlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import harness

F32_86M = Path("/tmp/jaxinfer-kv-dtype/86m-F32.gguf")  # what benchmarks/kv_dtype.py writes
FLAGS = ["-np", "4", "-c", "256", "-ub", "32"]
N_PROMPT, N_NEW, N_REQUESTS = 16, 128, 4
ROUNDS_X = {"stories260K": 3}  # its rounds take ~1 s and vary by 50%: 3x as many
PROMPTS = [[1] + [3 + (37 * i + 11 * k) % 509 for k in range(N_PROMPT - 1)] for i in range(4)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet(limit=0.25, patience=900.0) -> float:
    """Wait until the CPUs were busy for less than `limit` of one core over a second (at most
    `patience` seconds): another job on a 2-core machine would skew the round. The cores busy."""
    t0 = time.monotonic()
    while True:
        a = _jiffies()
        time.sleep(1)
        b = _jiffies()
        busy = (b[0] - a[0]) / max(b[1] - a[1], 1) * os.cpu_count()
        if busy < limit or time.monotonic() - t0 > patience:
            return busy


def _jiffies(mine=()) -> tuple[int, int]:
    """(busy, total) CPU ticks since boot, from /proc: busy but for the processes `mine`."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    for pid in mine:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            busy -= int(stat[11]) + int(stat[12])  # its utime and stime
    return busy, sum(ticks)


def clean(fn, mine, limit=0.25, tries=10):
    """fn() after quiet(), again while other processes than `mine` took `limit` of a core
    during it (at most `tries` times): (its value, the tries it took)."""
    n = 0
    while n < tries:
        n += 1
        quiet(limit)
        a = _jiffies(mine)
        value = fn()
        b = _jiffies(mine)
        if (b[0] - a[0]) / max(b[1] - a[1], 1) * os.cpu_count() < limit:
            break
    return value, n


def snapshot(tree: Path, work: Path) -> None:
    """A copy of `tree`'s jaxinfer/ (built kernels included) that every process of the run
    imports: edits to the checkout during the run change neither the code nor the executable
    store's key (its sources digest)."""
    shutil.copytree(tree / "jaxinfer", work / "tree" / "jaxinfer",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip


def env(tree: Path) -> dict:
    out = {k: v for k, v in harness.worker_env(tree).items() if k != "XLA_FLAGS"}
    return {**out, "JAX_NUM_CPU_DEVICES": "2"}


def group(model, layout, run: Path, log: str, argv, **popen) -> list[subprocess.Popen]:
    """Two processes `argv(flags)`, the same `serve` flags but --process-id (a fresh
    coordinator port per group), compile cache run/cache, stderr to run/logs/LOG{i}.log; they
    run the code of the snapshot beside `run` (../tree)."""
    flags = [*FLAGS, "--layout", layout, "--compile-cache-dir", str(run / "cache")]
    flags += (["-m", str(model)] if model else []) + ["--coordinator", f"127.0.0.1:{free_port()}"]
    procs, tree = [], run.parent / "tree"
    for i in range(2):
        with open(run / "logs" / f"{log}{i}.log", "w") as err:
            cmd = argv([*flags, "--num-processes", "2", "--process-id", str(i)])
            procs.append(subprocess.Popen(cmd, env=env(tree), cwd=tree, stderr=err, text=True,
                                          **popen))  # fmt: skip
    return procs


@contextlib.contextmanager
def server(model, layout, run: Path):
    """The `jaxinfer serve` group; yields process 0's port and the pids."""
    port = free_port()

    def argv(flags):
        return [sys.executable, "-m", "jaxinfer.cli", "serve", *flags, "--port", str(port)]

    procs = group(model, layout, run, "serve", argv, stdout=subprocess.DEVNULL)
    try:
        harness.wait_up(port, "/health", procs[0], timeout=900)
        yield port, [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


def reply(proc) -> dict | None:
    """A worker's next JSON line (None at its end), past the lines gloo prints to stdout."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    return None


@contextlib.contextmanager
def script(model, layout, run: Path):
    """The scripted group (workers/group_script.py); yields go(prompts) -> (tokens/s,
    texts) and the pids."""

    def argv(flags):
        return [sys.executable, str(harness.WORKERS / "group_script.py"), json.dumps(flags)]

    procs = group(model, layout, run, "script", argv, stdin=subprocess.PIPE,
                  stdout=subprocess.PIPE)  # fmt: skip
    try:
        for i, p in enumerate(procs):
            if reply(p) is None:
                log = (run / "logs" / f"script{i}.log").read_text()
                raise SystemExit(f"script process {i} exited:\n{log[-3000:]}")

        def run(prompts):
            for p in reversed(procs):  # process 1 first: process 0's clock starts last
                p.stdin.write(json.dumps({"prompts": prompts, "n": N_NEW}) + "\n")
                p.stdin.flush()
            replies = [reply(p) for p in procs]
            return replies[0]["ts"], replies[0]["texts"]

        yield run, [p.pid for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def complete(port, prompt) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": "m", "prompt": prompt, "max_tokens": N_NEW, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    out = json.loads(response.read())
    conn.close()
    return out


def lockstep(port) -> tuple[float, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    got = dict(line.rsplit(" ", 1) for line in lines if line.startswith("jaxinfer:lockstep_"))
    return float(got["jaxinfer:lockstep_calls_total"]), float(got["jaxinfer:lockstep_bytes_total"])


def serve_round(port, prompts, counts: list):
    """4 concurrent completions: (tokens/s, texts); appends (calls, bytes, tokens) to counts."""
    out: list = [None] * len(prompts)

    def one(k):
        out[k] = complete(port, prompts[k])

    calls0, bytes0 = lockstep(port)
    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    calls1, bytes1 = lockstep(port)
    tokens = sum(o["usage"]["completion_tokens"] for o in out)
    counts.append((calls1 - calls0, bytes1 - bytes0, tokens))
    return tokens / wall, [o["choices"][0]["text"] for o in out]


def measure(name, model, layout, rounds, run: Path) -> dict:
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        port, mine = stack.enter_context(server(model, layout, run))
        up_server = time.perf_counter() - t0
        run_script, procs = stack.enter_context(script(model, layout, run))
        mine = [os.getpid(), *mine, *procs]
        up_script = time.perf_counter() - t0 - up_server
        counts: list = []
        sides = {"server": lambda: serve_round(port, PROMPTS, counts),
                 "script": lambda: run_script(PROMPTS)}  # fmt: skip
        warm = {side: fn()[1] for side, fn in sides.items()}
        assert warm["server"] == warm["script"], "the two groups generated different texts"
        counts.clear()
        ts: dict = {side: [] for side in sides}
        redone = 0
        for r in range(rounds):
            for side in list(sides)[:: 1 if r % 2 == 0 else -1]:
                (value, _), tries = clean(sides[side], mine)
                ts[side].append(value)
                redone += tries - 1
                print(f"{name} {layout} round {r + 1} {side}: {value:.1f} t/s ({tries} tries)",
                      flush=True)  # fmt: skip
    calls, sent, tokens = (sum(c[i] for c in counts) for i in range(3))
    print(f"{name} {layout}: server up in {up_server:.0f} s, script group in {up_script:.0f} s, "
          f"{time.perf_counter() - t0:.0f} s in all", flush=True)  # fmt: skip
    return dict(
        server=harness.stat(ts["server"]), script=harness.stat(ts["script"]),
        calls_per_token=calls / tokens, bytes_per_call=sent / calls, bytes_per_token=sent / tokens,
        rounds=rounds, redone=redone,
    )  # fmt: skip


def main():
    ap = harness.parser(__doc__, 5)
    ap.add_argument("--models", default="stories260K,86M", help="stories260K and/or 86M")
    ap.add_argument("--layouts", default="layer,tensor")
    ap.add_argument("--tree", type=Path, default=harness.ROOT, help="the jaxinfer checkout to run")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()), help="runs go here")
    args = ap.parse_args()
    models = {"stories260K": None, "86M": F32_86M}
    if "86M" in args.models.split(",") and not F32_86M.exists():
        F32_86M.parent.mkdir(parents=True, exist_ok=True)
        harness.write_random_gguf(F32_86M, **harness.LLAMA_86M)
    t0 = time.perf_counter()
    rows = []
    run = Path(tempfile.mkdtemp(prefix="jaxinfer-group-serve-", dir=args.work)).resolve()
    snapshot(args.tree.resolve(), run)
    print(f"run folder (code snapshot, compile caches, logs): {run}", flush=True)
    for name in args.models.split(","):
        for layout in args.layouts.split(","):
            where = run / f"{name}-{layout}"
            (where / "logs").mkdir(parents=True)
            rounds = args.rounds * ROUNDS_X.get(name, 1)
            m = measure(name, models[name], layout, rounds, where)
            s, b = m["server"], m["script"]
            rows.append(
                f"| {name} | {layout} | {s.median:.1f} ({s.spread:.0%}) | {b.median:.1f} "
                f"({b.spread:.0%}) | {s.median / b.median:.2f}x | {m['calls_per_token']:.3f} | "
                f"{m['bytes_per_call']:.0f} | {m['bytes_per_token']:.0f} | {m['rounds']} "
                f"({m['redone']}) |"
            )
    minutes = (time.perf_counter() - t0) / 60
    lines = [
        f"# The cost of staying in step ({time.strftime('%Y-%m-%d')}, 2 processes x 2 CPU "
        f"devices, -np 4, {N_REQUESTS} requests of {N_PROMPT} + {N_NEW} tokens, medians of "
        "interleaved rounds after a warm-up round)",
        "",
        "`jaxinfer serve` over 2 processes (process 0 sends each device call to process 1) "
        "against the same 2 processes driven by a script (each submits the same requests). "
        "t/s: generated tokens / wall (spread: (max - min) / median). Lockstep calls and bytes "
        "per follower, from /metrics around the timed server rounds (heartbeats not counted). "
        "Rounds: timed rounds per side (redone: rounds run again because another process "
        "took a quarter of a core or more during them).",
        "",
        "| model | layout | server t/s | script t/s | server / script | calls / token | "
        "bytes / call | bytes / token | rounds (redone) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Full run: {minutes:.0f} min. Command: `python benchmarks/group_serve.py "
        f"-r {args.rounds} --models {args.models} --layouts {args.layouts}`",
    ]
    harness.write_result("group_serve", "\n".join(lines), args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
