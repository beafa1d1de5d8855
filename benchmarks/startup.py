"""Start-up: how soon a new process gives its first tokens, with the executable store and
without it (jax's persistent cache alone, as before the store), interleaved round by round.

Every figure is the wall time of a whole command, as a user starts it from the shell:
- the jax floor, `python -c "import jax; jax.numpy.ones(1)"`: what no jaxinfer command beats;
- `jaxinfer --help`;
- a second `jaxinfer generate -n 32` (its cache dir filled by the warm-up round) on the
  built-in stories260K and on the random 86M Llama GGUF (float32);
- a second `jaxinfer serve`, from the start to /health answering 200 (serve loads or compiles
  the whole plan first);
- a cold warmup of stories260K's default plan (an empty cache dir; Engine.warmup() alone).
Each configuration runs once per round, in turn; the first round is a warm-up and dropped;
medians and spreads over the rest. Writes benchmarks/results/startup.md.
Usage: python benchmarks/startup.py [-r 5]
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

CLI = [sys.executable, "-m", "jaxinfer.cli"]
FLOOR = [sys.executable, "-c", "import jax; jax.numpy.ones(1)"]
WARMUP = """
import sys, time, jaxinfer
engine = jaxinfer.load(compile_cache_dir=sys.argv[1])
t0 = time.perf_counter()
engine.warmup(progress=False)
print(time.perf_counter() - t0)
"""


def wall(argv, env) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def serve_up(argv, env, port: int) -> float:
    """Seconds from starting the server to /health 200."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        harness.wait_up(port, "/health", proc, poll=0.02)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait()


def cold_warmup(env) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-c", WARMUP, d], env=env, check=True,
                             capture_output=True, text=True)  # fmt: skip
        return float(out.stdout.split()[-1])


def main() -> None:
    args = harness.parser(__doc__, rounds=5).parse_args()
    env = harness.worker_env()
    work = Path(tempfile.mkdtemp(prefix="jaxinfer-startup-"))
    m86 = harness.write_random_gguf(work / "llama-86M.gguf", **harness.LLAMA_86M)
    dirs = {
        "store": ["--compile-cache-dir", str(work / "store")],
        "no store": ["--compile-cache-dir", str(work / "xla"), "--executable-store-mib", "0"],
    }
    gen = ["generate", "-n", "32", "--temp", "0", "-p", "Once upon a time"]
    tests = {("jax floor", ""): lambda: wall(FLOOR, env),
             ("jaxinfer --help", ""): lambda: wall([*CLI, "--help"], env)}  # fmt: skip
    for how, flags in dirs.items():
        tests[("generate -n 32, stories260K", how)] = lambda f=flags: wall([*CLI, *gen, *f], env)
        tests[("generate -n 32, llama-86M F32", how)] = lambda f=flags: wall(
            [*CLI, *gen, "-m", str(m86), *f], env
        )
        port = 18000 + len(tests)
        serve = [*CLI, "serve", "--port", str(port), *flags]
        tests[("serve: start to /health 200", how)] = lambda s=serve, p=port: serve_up(s, env, p)
    tests[("cold warmup, stories260K default plan", "")] = lambda: cold_warmup(env)
    runs = harness.interleaved(tests, args.rounds, progress=True)
    med = {k: harness.stat(v) for k, v in runs.items()}
    floor = med[("jax floor", "")].median
    rows = [
        "| figure | executable store | jaxinfer store off (persistent cache) | store off / on |"
        " store minus jax floor |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(k[0] for k in med):
        on, off = med.get((name, "store")), med.get((name, "no store"))
        if on is None:
            one = med[(name, "")]
            rows.append(f"| {name} | {one.median:.2f} s (±{one.spread:.0%}) | | | |")
            continue
        rows.append(
            f"| {name} | {on.median:.2f} s (±{on.spread:.0%}) | {off.median:.2f} s "
            f"(±{off.spread:.0%}) | {off.median / on.median:.2f}x | {on.median - floor:.2f} s |"
        )
    text = "\n".join([
        "# Start-up (benchmarks/startup.py)", "",
        f"Medians of {args.rounds} interleaved rounds (a warm-up round dropped); ± is the spread "
        "(max - min) / median. Wall times of whole commands; the 'second' runs find their "
        "cache dir filled by the warm-up round.", "", *rows,
    ])  # fmt: skip
    harness.write_result("startup", text, args.out)
    print(text)


if __name__ == "__main__":
    main()
