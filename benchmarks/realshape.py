"""Real shapes: jaxinfer and llama.cpp on random models at real models' per-layer shapes, quantized
by llama.cpp's own quantizer, side by side.

The shapes (SHAPES) are the models' own configs (Hugging Face config.json) with fewer layers
(`layers`, so that two engines and the files fit the machine and a round takes minutes), a
32k vocabulary and a 4096-token context (4352 here: room for tg128 at depth 4096):
Llama-3-8B, Qwen3-8B, Qwen3-30B-A3B (128 experts of 768, top-8) and Qwen3.5-35B-A3B (3 Gated
DeltaNet : 1 gated attention, 256 experts of 512, top-8, a shared expert). Each is written once
as a float16 GGUF (harness.write_random_gguf) and quantized to Q4_K_M, Q5_K_M, Q6_K and Q8_0
(workers/quantize.py: what `llama-quantize` does); the files are kept in `--work` for the next
run.

Per file:
- speed, interleaved rounds (medians after a dropped warm-up round): pp512, tg128 and tg128 at
  depth `--depth`, jaxinfer timed around `generate()` with the prefix cache off (workers/ours.py:
  every prompt token computed) and llama.cpp's C API run as llama-bench runs it (workers/peer.py:
  2 threads, flash attention, F16 K/V, n_batch = n_ubatch = 512, its own counters);
- decode MBU of both: bytes per token = the GGUF bytes one decode step reads (one row of the
  token embedding; of an expert tensor the k of E experts a token routes to; every other tensor
  whole) + the K/V read at the step's mean depth in each engine's own K/V dtype (+ the Gated
  DeltaNet states read and written) x tokens/s, over the bandwidth of a 2-thread copy of 1 GiB
  (read + write) measured at the start of the run;
- peak RSS (VmHWM) of a fresh process of each engine that loads the file, runs a 512-token
  prompt and 16 tokens (jaxinfer's programs read from its executable store, which the rounds
  filled): jaxinfer's less a bare `import jax` process's, over llama.cpp's (target <= 1.2);
- `jaxinfer.load()` wall time (no warmup, the file in the page cache) beside llama.cpp's model
  load + context creation and a bare jax import; a cold `warmup()` (an empty compile folder) in
  a fresh process (workers/startup_probe.py).

`--narrow` runs the narrow models instead (NARROW: F32, d 256, 40-48 layers of dense, hybrid
and MoE kinds): cold warmups at 4 and at 40-48 layers, with depth-shared layers (the default)
and with every layer traced on its own (`shared_layers=False`), then the deep file's speeds
beside llama.cpp; it writes benchmarks/results/realshape_depth.md. With `--layout layer
--devices 2` the warmups run under that layout (pipeline stages on fake CPU devices), without
the speed runs (write them elsewhere: `--out`).

Usage: python benchmarks/realshape.py [--shapes llama3-8b,...] [--formats Q4_K_M,...] [-r 3]
    [--depth 4096] [--layers N] [--variant avx2] [--work DIR] [--threads 2] [--narrow]
    [--layout layer --devices 2]
Writes benchmarks/results/realshape.md (or --out).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import harness

# The context both engines are sized for (llama.cpp's -c) in every run: the real shapes' 4096
# plus room for tg128 at depth 4096 (llama-bench sizes its context to depth + prompt + gen).
N_CTX = 4096 + 256


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's per-layer shape (its config.json) and the layers the benchmark keeps."""

    title: str
    layers: int  # kept here (the model has `full`)
    full: int
    gguf: dict  # harness.write_random_gguf's keywords but path, n_layers, vocab, name


VOCAB = 32000
SHAPES = {
    "llama3-8b": Shape("Llama-3-8B", 4, 32, dict(
        arch="llama", d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336,
        rope_theta=500000.0)),
    "qwen3-8b": Shape("Qwen3-8B", 4, 36, dict(
        arch="qwen3", d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, d_ff=12288,
        rope_theta=1000000.0)),
    "qwen3-30b-a3b": Shape("Qwen3-30B-A3B", 4, 48, dict(
        arch="qwen3moe", d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128, d_ff=6144,
        n_experts=128, n_experts_used=8, d_ff_expert=768, rope_theta=1000000.0)),
    "qwen3.5-35b-a3b": Shape("Qwen3.5-35B-A3B", 4, 40, dict(
        arch="qwen35moe", d_model=2048, n_heads=16, n_kv_heads=2, head_dim=256, d_ff=0,
        n_experts=256, n_experts_used=8, d_ff_expert=512, d_ff_shared=512,
        linear_heads=(16, 32), linear_dim=128, conv_kernel=4, attention_every=4)),
}  # fmt: skip
# Narrow models at depth (F32): what compile time does with the number of layers. Cold warmups
# at NARROW_DEPTHS layers, and the speeds at the deepest, beside llama.cpp.
NARROW = {
    "narrow-dense": Shape("qwen3 d256 (dense)", 48, 48, dict(
        arch="qwen3", d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=768)),
    "narrow-hybrid": Shape("qwen35 d256 (3 GDN : 1 attention)", 40, 40, dict(
        arch="qwen35", d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=768,
        linear_heads=(2, 4), linear_dim=64, attention_every=4)),
    "narrow-moe": Shape("qwen3moe d256 (128 experts, top-8)", 48, 48, dict(
        arch="qwen3moe", d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=768,
        n_experts=128, n_experts_used=8, d_ff_expert=128)),
}  # fmt: skip
NARROW_DEPTHS = (4, 48)  # the hybrid's 48 is 40 (a multiple of its unit of 4 that fits 48)

FORMATS = {
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
}


def files(work: Path, name: str, shape: Shape, layers: int, formats) -> dict[str, Path]:
    """The shape's quantized files, made (and kept in `work`) where missing."""
    source = work / f"{name}-L{layers}-F16.gguf"
    out = {f: work / f"{name}-L{layers}-{f}.gguf" for f in formats}
    if all(p.exists() for p in out.values()):
        return out
    if not source.exists():
        t0 = time.perf_counter()
        part = source.with_suffix(".part")
        harness.write_random_gguf(part, n_layers=layers, vocab=VOCAB, dtype="float16",
                                  name=f"{shape.title} shape (random)", **shape.gguf)  # fmt: skip
        part.rename(source)
        print(f"wrote {source.name} in {time.perf_counter() - t0:.0f} s", flush=True)
    for fmt, path in out.items():
        if not path.exists():
            part = path.with_suffix(".part")
            harness.once("quantize", source, part, FORMATS[fmt])
            part.rename(path)
            print(f"quantized {path.name}", flush=True)
    return out


def narrow_file(work: Path, name: str, shape: Shape, layers: int) -> Path:
    """A narrow F32 model's file, written where missing."""
    path = work / f"{name}-L{layers}-F32.gguf"
    if not path.exists():
        harness.write_random_gguf(path.with_suffix(".part"), n_layers=layers, vocab=VOCAB,
                                  name=f"{shape.title} (random)", **shape.gguf)  # fmt: skip
        path.with_suffix(".part").rename(path)
    return path


def step_bytes(path: Path, shape: Shape, depth: float, kv_bytes: int) -> float:
    """Bytes one decode step of one token reads: the GGUF tensors it touches (one embedding
    row, k of E experts, the rest whole) + K/V of `depth` positions at `kv_bytes` per value
    + each Gated DeltaNet layer's state read and written (float32)."""
    import gguf

    g = shape.gguf
    total = 0.0
    for t in gguf.GGUFReader(str(path)).tensors:
        n = float(t.n_bytes)
        if t.name == "token_embd.weight":
            n /= VOCAB
        elif re.search(r"_exps\.weight$", t.name):
            n *= g["n_experts_used"] / g["n_experts"]
        total += n
    layers = int(re.search(r"-L(\d+)-", path.name)[1])
    linear = layers - layers // g.get("attention_every", 1) if "linear_heads" in g else 0
    attends = layers - linear
    total += attends * 2 * g["n_kv_heads"] * g["head_dim"] * depth * kv_bytes
    if linear:
        nv, dim = g["linear_heads"][1], g["linear_dim"]
        total += linear * 2 * nv * dim * dim * 4
    return total


def probe(mode: str, path: Path, *extra, env=None) -> dict:
    return harness.once("startup_probe", mode, path, *extra, env=env)


def measure_file(args, shape: Shape, path: Path, tests: dict, env: dict) -> dict:
    """One file: the start probes (a cold warmup, loads), the peak RSS of a fresh process of
    each engine that loads, runs a 512-token prompt and 16 tokens (jaxinfer's programs read
    from its executable store: a first such process fills it), then the interleaved speed
    rounds."""
    options = json.dumps({"prefix_cache": False})
    info = {
        "bare": probe("bare", path, N_CTX, env=env),
        "ours_load": probe("ours", path, N_CTX, "cold", options, env=env),
        "peer_load": probe("peer", path, N_CTX, env=env),
    }
    probe("ours", path, N_CTX, "run", options, env=env)  # fills the store
    info["rss"] = {"ours": probe("ours", path, N_CTX, "run", options, env=env)["rss"],
                   "peer": probe("peer", path, N_CTX, "run", env=env)["rss"]}  # fmt: skip
    print(f"{path.name}: probes {json.dumps(info)}", flush=True)
    ours = harness.Worker("ours", path, N_CTX, options, env=env)
    peer = harness.peer_worker(path, args.threads, N_CTX)
    try:
        sides = (("ours", ours), ("peer", peer))
        calls = {(side, test): (lambda w=w, c=cmd: w(**c))
                 for test, cmd in tests.items() for side, w in sides}  # fmt: skip
        runs = harness.interleaved(calls, args.rounds, progress=True)
    finally:
        ours.close()
        peer.close()
    info["speed"] = {key: harness.stat(values) for key, values in runs.items()}
    for key, s in info["speed"].items():
        print(f"  {key}: {s.median:.2f} t/s (spread {s.spread:.0%})", flush=True)
    return info


def main():
    ap = harness.parser(__doc__, rounds=3, peer=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--layers", type=int, help="layers of every shape (default: each one's)")
    ap.add_argument("--depth", type=int, default=4096, help="tg128's depth run (0: none)")
    ap.add_argument("--variant", help="JAXINFER_CPU_KERNELS for jaxinfer (default: the best)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/jaxinfer-realshape"))
    ap.add_argument("--narrow", action="store_true", help="the narrow models at depth instead")
    ap.add_argument("--layout", help="with --narrow: warmups under this layout (e.g. layer)")
    ap.add_argument("--devices", type=int, default=2, help="with --layout: fake CPU devices")
    args = ap.parse_args()
    harness.require_llama_cpp()
    args.work.mkdir(parents=True, exist_ok=True)
    env = harness.worker_env(args.tree)
    if args.variant:
        env["JAXINFER_CPU_KERNELS"] = args.variant
    tests = {"pp512": dict(test="pp", n=512, depth=0), "tg128": dict(test="tg", n=128, depth=0)}
    if args.depth:
        tests[f"tg128@d{args.depth}"] = dict(test="tg", n=128, depth=args.depth)
    t_start = time.perf_counter()
    if args.narrow:
        harness.write_result("realshape_depth", narrow(args, tests, env), args.out)
        return
    bandwidth = probe("bandwidth", Path("-"), 1024, env=env)["bytes_per_s"]
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    results = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        made = files(args.work, name, shape, args.layers or shape.layers, args.formats.split(","))
        for fmt, path in made.items():
            results[name, fmt] = (path, measure_file(args, shape, path, tests, env))
    minutes = (time.perf_counter() - t_start) / 60
    harness.write_result("realshape", report(args, tests, bandwidth, results, minutes), args.out)


def narrow(args, tests, env) -> str:
    """Cold warmups of the narrow models at NARROW_DEPTHS (and with every layer traced on its
    own, shared_layers=False), then each one's deepest file beside llama.cpp."""
    t0 = time.perf_counter()
    staged = {"layout": args.layout, "devices": args.devices} if args.layout else {}
    if args.layout:  # fake CPU devices for the stages; warmups only (no speed beside llama.cpp)
        env = env | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
        tests = {}
    own = json.dumps({"prefix_cache": False, "shared_layers": False} | staged)
    where = f" under layout {args.layout!r} on {args.devices} devices" if args.layout else ""
    lines = [
        f"# Narrow models at depth{where} ({time.strftime('%Y-%m-%d')}): cold warmup"
        + ("" if args.layout else " and speed"),
        "",
        "Random F32 models, 32000 vocabulary, -c 4352; a cold warmup is `warmup()` of the "
        "default plan in a fresh process with an empty compile folder. Shared: layers of one "
        "kind share one traced body (the default); own: every layer traced on its own.",
        "",
        "| model | " + " | ".join(f"warmup {n} layers s (shared / own)" for n in NARROW_DEPTHS)
        + " | deep / shallow (shared) |" + "".join(f" {t} ours / llama.cpp |" for t in tests),
        "|---|" + "---:|" * (len(NARROW_DEPTHS) + 1 + len(tests)),
    ]  # fmt: skip
    for name, shape in NARROW.items():
        unit = shape.gguf.get("attention_every", 1) if "linear_heads" in shape.gguf else 1
        depths = [n // unit * unit for n in NARROW_DEPTHS]
        files = {n: narrow_file(args.work, name, shape, n) for n in depths}
        opts = json.dumps({"prefix_cache": False} | staged)
        warm = {n: (probe("ours", files[n], N_CTX, "cold", opts, env=env)["warmup_s"],
                    probe("ours", files[n], N_CTX, "cold", own, env=env)["warmup_s"])
                for n in depths}  # fmt: skip
        print(f"{name}: warmups {warm}", flush=True)
        sp = measure_file(args, shape, files[depths[-1]], tests, env)["speed"] if tests else {}
        cells = [f"{warm[n][0]:.0f} / {warm[n][1]:.0f}" for n in depths]
        cells.append(f"**{warm[depths[-1]][0] / warm[depths[0]][0]:.2f}x**")
        for t in tests:
            o, p = sp["ours", t].median, sp["peer", t].median
            cells.append(f"{o:.1f} / {p:.1f} = {o / p:.2f}x")
        lines.append(f"| {shape.title}, {depths[-1]} layers | " + " | ".join(cells) + " |")
    lines += ["", f"{(time.perf_counter() - t0) / 60:.0f} min in all."]
    return "\n".join(lines)


def report(args, tests, bandwidth, results, minutes) -> str:
    import jax

    kv_ours = 2  # both K/V caches F16 (jaxinfer's "auto" for a GGUF file in blocks)
    lines = [
        f"# Real shapes: jaxinfer vs llama.cpp ({time.strftime('%Y-%m-%d')}, {args.threads} "
        f"threads, medians of {args.rounds} interleaved rounds after a dropped warm-up round)",
        "",
        f"jax {jax.__version__}; jaxinfer's CPU kernels: {args.variant or 'the best variant'}; "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (2 threads, 1 GiB read + written); "
        f"{minutes:.0f} min in all. Random weights at each model's per-layer shapes, "
        f"{VOCAB} vocabulary, -c {N_CTX} (+ the depth for the depth run), quantized by "
        "llama.cpp's quantizer. Ratios: jaxinfer / llama.cpp.",
        "",
    ]
    head = [f"{t} ours / llama.cpp t/s" for t in tests]
    lines += [
        "| model (layers) | file | " + " | ".join(head) + " | MBU ours / llama.cpp (tg128) |",
        "|---|---|" + "---:|" * (len(head) + 1),
    ]
    for (name, fmt), (path, info) in results.items():
        shape, sp = SHAPES[name], info["speed"]
        cells = []
        for t in tests:
            o, p = sp["ours", t].median, sp["peer", t].median
            cells.append(f"{o:.1f} / {p:.1f} = **{o / p:.2f}x**")
        mbu = []
        for side, kv in (("ours", kv_ours), ("peer", 2)):
            bytes_ = step_bytes(path, shape, 64, kv)
            mbu.append(f"{bytes_ * sp[side, 'tg128'].median / bandwidth:.0%}")
        size = path.stat().st_size / 2**30
        layers = re.search(r"-L(\d+)-", path.name)[1]
        lines.append(f"| {shape.title} ({layers} of {shape.full}) | {fmt} ({size:.2f} GiB) | "
                     + " | ".join(cells) + f" | {' / '.join(mbu)} |")  # fmt: skip
    lines += [
        "",
        "| model | file | peak RSS ours (less bare jax) / llama.cpp GiB | ratio | load s: ours / "
        "llama.cpp + jax import | cold warmup s (programs) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (name, fmt), (_, info) in results.items():
        bare, ol, pl = info["bare"], info["ours_load"], info["peer_load"]
        ours_rss = (info["rss"]["ours"] - bare["rss"]) / 2**30
        peer_rss = info["rss"]["peer"] / 2**30
        lines.append(
            f"| {SHAPES[name].title} | {fmt} | {ours_rss:.2f} / {peer_rss:.2f} | "
            f"{ours_rss / peer_rss:.2f} | {ol['load_s']:.1f} / {pl['load_s']:.1f} + "
            f"{bare['import_s']:.1f} | {ol['warmup_s']:.0f} ({ol['programs']}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
