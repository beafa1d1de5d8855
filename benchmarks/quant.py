"""Quantized GGUF: jaxinfer and llama.cpp on the random 86M Llama in F32, Q8_0, Q4_K_M, Q5_K_M.

The F32 file is the harness's random 86M Llama, vs_llamacpp.py's (dim 768, 12 layers, 12 heads,
ffn 2048, vocab 512); the Q8_0, Q4_K_M and Q5_K_M files are made from it by llama.cpp's own
quantizer through its C API (workers/quantize.py: `llama_model_quantize` with its default
parameters but the file type, what `llama-quantize` does), in a temporary folder.

Speed: the workers of vs_llamacpp.py (workers/peer.py runs llama.cpp's C API as llama-bench runs
it; workers/ours.py times jaxinfer end to end around `generate()`), pp512 and tg128 on each
file, all six in turn each round, llama-bench itself once per file and round when found; medians
over the rounds after a dropped warm-up round. Before the rounds, a one-shot jaxinfer process
per file (workers/probe.py) reads its peak host RSS growth over `load()` (resident memory
sampled every 2 ms during the load against before it, jax already initialized: on the CPU
backend the device weights are host memory too), the device weight bytes
(`engine.weight_bytes()`, where the Engine has it) and its first 64 greedy tokens, which are
compared with llama.cpp's on the same file (workers/greedy.py, same context settings as the
peer) under jaxinfer's default 8-bit activations (llama.cpp's numerics), and under float
activations with jaxinfer's on the same file loaded dequantized at load (`quantize="none"`).
The quantized files also run with `activations="float"` in the rounds ("jaxinfer Q8_0 float"):
what 8-bit activations gain, measured beside the rest.

Usage: python benchmarks/quant.py [-r 5] [--threads 2] [--llama-bench PATH] [--quick] [--tree DIR]
Writes benchmarks/results/quant.md (--quick: 1 round, fewer tokens, prints only unless --out).
"""

from __future__ import annotations

import collections
import json
import os
import re
import tempfile
import time
from pathlib import Path

import harness

# label -> llama.cpp file type (None: the F32 file as written)
FILES = {
    "F32": None,
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
}
QUANTIZED = ("Q8_0", "Q4_K", "Q5_K")
N_CTX = 1024
LLAMA_86M = harness.LLAMA_86M


def tensor_types(path: Path, n_layers: int) -> tuple[str, int]:
    """('Q4_K: attn_q, ..., attn_v (blk 2,3,...); Q6_K: ...', the tensors' bytes)."""
    import gguf

    where = collections.defaultdict(lambda: collections.defaultdict(list))  # type -> kind -> blk
    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        total += int(t.n_bytes)
        m = re.fullmatch(r"blk\.(\d+)\.(.+)\.weight", t.name)
        kind, layer = (m[2], int(m[1])) if m else (t.name.removesuffix(".weight"), None)
        where[t.tensor_type.name][kind].append(layer)
    parts = []
    for type_, kinds in sorted(where.items()):
        names = [
            k if None in blks or len(blks) == n_layers else f"{k} (blk {','.join(map(str, blks))})"
            for k, blks in kinds.items()
        ]
        parts.append(f"{type_}: {', '.join(names)}")
    return "; ".join(parts), total


def leading(a: list[int], b: list[int]) -> int:
    """How many leading tokens agree."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure(args, tests: dict, prompt: list[int], n_greedy: int):
    """The files, then per file its types, sizes and one-shot probes (`info`), then the timed
    rounds (`med`, medians by (run, test))."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {"F32": harness.write_random_gguf(Path(tmp) / "86m-f32.gguf", **LLAMA_86M)}
        for label, ftype in FILES.items():
            if ftype:
                files[label] = Path(tmp) / f"86m-{label}.gguf"
                harness.once("quantize", files["F32"], files[label], ftype)
        info, greedy, env = {}, (json.dumps(prompt), n_greedy), harness.worker_env(args.tree)
        for label, path in files.items():
            types, tensor_bytes = tensor_types(path, LLAMA_86M["n_layers"])
            probe = ("probe", path, N_CTX, *greedy)
            quantized = label in QUANTIZED
            deq = harness.once(*probe, "none", env=env) if quantized else None
            flt = harness.once(*probe, "keep", "float", env=env) if quantized else None
            info[label] = dict(
                types=types, tensor_bytes=tensor_bytes, size=path.stat().st_size, deq=deq,
                flt=flt, ours=harness.once(*probe, "keep", env=env),
                peer=harness.once("greedy", path, args.threads, N_CTX, *greedy),
            )  # fmt: skip
            print(f"{label} probed: {types}", flush=True)

        workers = {}
        for label, path in files.items():
            workers[f"llama.cpp {label}"] = harness.peer_worker(path, args.threads, N_CTX)
            workers[f"jaxinfer {label}"] = harness.jaxinfer_worker(path, N_CTX, args.tree)
            if label in QUANTIZED:
                workers[f"jaxinfer {label} float"] = harness.jaxinfer_worker(
                    path, N_CTX, args.tree, activations="float"
                )
        runs = {f"llama-bench {label}": path for label, path in files.items()}
        bench = harness.llama_bench_rounds(args.llama_bench, args.threads, runs, tests)
        med = harness.run_rounds([(workers, tests)], args.rounds, bench)
    return info, med


def report(args, info, med, pp_test, tg_test, prompt, n_greedy, minutes, load) -> str:
    import jax
    import llama_cpp

    # Still only float32 parameters for a quantized file: it was loaded dequantized.
    dequantized = [q for q in QUANTIZED if set(info[q]["ours"]["leaves"]) == {"float32"}]

    def ratio(a: str, b: str, test: str = tg_test) -> float:
        return med[a, test] / med[b, test]

    def met(ok: bool | None, *files: str) -> str:
        if any(f in dequantized for f in files):
            return "not yet (loaded dequantized)"
        return "n/a" if ok is None else ("yes" if ok else "no")

    q8_f32 = ratio("jaxinfer Q8_0", "jaxinfer F32")
    q8_peer = ratio("jaxinfer Q8_0", "llama.cpp Q8_0")
    wb = {q: info[q]["ours"]["weight_bytes"] for q in QUANTIZED}
    wb = {q: None if b is None else b / info[q]["tensor_bytes"] for q, b in wb.items()}
    wb_cell = ", ".join(f"{q} {'n/a' if r is None else f'{r:.2f}'}" for q, r in wb.items())
    wb_ok = None if None in wb.values() else max(wb.values()) <= 1.1

    def agreement(q: str) -> str:
        ours, flt, deq = info[q]["ours"]["ids"], info[q]["flt"]["ids"], info[q]["deq"]["ids"]
        return (f"{q}: int8 {leading(ours, info[q]['peer']['ids'])}/{n_greedy} vs llama.cpp, "
                f"float {leading(flt, deq)}/{n_greedy} vs dequantized")  # fmt: skip

    title = "Quantized GGUF: jaxinfer vs llama.cpp" + (" (--quick smoke run)" if args.quick else "")
    lines = [
        f"# {title} ({time.strftime('%Y-%m-%d')}, random 86M Llama, {args.threads} threads, "
        f"medians of {args.rounds} interleaved rounds after a dropped warm-up round)",
        "",
        f"Load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (the machine: the "
        f"CPU line at the end). jax {jax.__version__}, llama-cpp-python "
        f"{llama_cpp.__version__}; {minutes:.1f} min in all.",
        "",
        "The peer is llama.cpp's C API run as llama-bench runs it (vs_llamacpp.py): flash "
        f"attention on, F16 K/V cache, n_batch = n_ubatch = 512, {args.threads} threads for "
        f"batch and generation, n_ctx {N_CTX}, CPU only, one token per decode, cache cleared "
        "between runs, timed by llama.cpp's own counters (llama_perf_context). Each round runs "
        f"{pp_test} and {tg_test} on the peer and on jaxinfer for each file in turn"
        + (", then llama-bench itself once per file." if args.llama_bench else
           "; llama-bench was not run (not found, or --quick).")
        + " jaxinfer is timed end to end around `generate()`.",
        "",
    ]  # fmt: skip
    if dequantized:
        lines += [
            f"**Not a result for compressed weights**: jaxinfer loaded {' and '.join(dequantized)} "
            "dequantized (its parameters are all float32 arrays).",
            "",
        ]
    lines += [
        "| figure | target | measured | met |",
        "|---|---|---:|---|",
        f"| Q8_0 decode tok/s / our own F32 | >= 1.8x | {q8_f32:.2f}x | "
        f"{met(q8_f32 >= 1.8, 'Q8_0')} |",
        f"| Q8_0 decode vs llama.cpp Q8_0 | >= 1.0x | {q8_peer:.2f}x | "
        f"{met(q8_peer >= 1.0, 'Q8_0')} |",
        f"| Q4_K decode vs llama.cpp Q4_K | recorded | "
        f"{ratio('jaxinfer Q4_K', 'llama.cpp Q4_K'):.2f}x | |",
        f"| device weight bytes / file tensor bytes | <= 1.1 | {wb_cell} | "
        f"{met(wb_ok, *QUANTIZED)} |",
        f"| Q5_K decode vs llama.cpp Q5_K | recorded | "
        f"{ratio('jaxinfer Q5_K', 'llama.cpp Q5_K'):.2f}x | |",
        f"| Q4_K decode tok/s / our own F32 | recorded | "
        f"{ratio('jaxinfer Q4_K', 'jaxinfer F32'):.2f}x | |",
        f"| F32 decode vs llama.cpp F32 | recorded | "
        f"{ratio('jaxinfer F32', 'llama.cpp F32'):.2f}x | |",
        f"| {pp_test} vs llama.cpp ({', '.join(FILES)}) | recorded | "
        + ", ".join(f"{ratio(f'jaxinfer {f}', f'llama.cpp {f}', pp_test):.2f}x" for f in FILES)
        + " | |",
        f"| 8-bit / float activations, decode tok/s ({', '.join(QUANTIZED)}) | recorded | "
        + ", ".join(f"{ratio(f'jaxinfer {q}', f'jaxinfer {q} float'):.2f}x" for q in QUANTIZED)
        + " | |",
        f"| greedy: leading tokens of {n_greedy} matching (8-bit activations vs llama.cpp, "
        "float vs dequantized) | recorded | " + "; ".join(agreement(q) for q in QUANTIZED) + " | |",
        f"| greedy F32: jaxinfer vs llama.cpp | recorded | "
        f"{leading(info['F32']['ours']['ids'], info['F32']['peer']['ids'])}/{n_greedy} | |",
        "",
        f"| run | {pp_test} t/s | {tg_test} t/s |",
        "|---|---:|---:|",
    ]
    for side in ["llama.cpp", "jaxinfer"] + (["llama-bench"] if args.llama_bench else []):
        for label in FILES:
            modes = ("", " float") if side == "jaxinfer" and label in QUANTIZED else ("",)
            for name in (f"{side} {label}{mode}" for mode in modes):
                lines.append(f"| {name} | {med[name, pp_test]:.1f} | {med[name, tg_test]:.1f} |")
    lines += [
        "",
        "| file | tensor types (llama.cpp's quantizer) | file MiB | tensor MiB | "
        "jaxinfer params held as (MiB) | weight_bytes() MiB | load peak RSS growth MiB | "
        "growth / file |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    mib = 2**20
    for label, i in info.items():
        ours = i["ours"]
        held = ", ".join(f"{k} {v / mib:.1f}" for k, v in sorted(ours["leaves"].items()))
        wbytes = "n/a" if ours["weight_bytes"] is None else f"{ours['weight_bytes'] / mib:.1f}"
        lines.append(
            f"| {label} | {i['types']} | {i['size'] / mib:.1f} | {i['tensor_bytes'] / mib:.1f} | "
            f"{held} | {wbytes} | {ours['rss'] / mib:.0f} | {ours['rss'] / i['size']:.2f} |"
        )
    lines += [
        "",
        f"Greedy prompt: {prompt} ({n_greedy} new tokens); the dequantized reference is "
        + 'jaxinfer on the same file with `quantize="none"`.'
        + " Load RSS growth: the peak resident memory of a fresh process during "
        "`jaxinfer.load()` (sampled every 2 ms) minus before it (jax initialized, nothing "
        "compiled yet); on the CPU backend the device weights are host memory, so 1.0 is the "
        "floor.",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main():
    ap = harness.parser(__doc__, 5, peer=True)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 round, fewer tokens")
    args = ap.parse_args()
    harness.require_llama_cpp()
    pp, tg, n_greedy = (512, 128, 64) if not args.quick else (64, 16, 16)
    if args.quick:
        args.rounds, args.llama_bench = 1, None
    pp_test, tg_test = f"pp{pp}", f"tg{tg}"
    tests = {pp_test: dict(test="pp", n=pp, depth=0), tg_test: dict(test="tg", n=tg, depth=0)}
    prompt = [1] + [3 + (7919 * i) % (LLAMA_86M["vocab"] - 3) for i in range(1, 16)]

    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    info, med = measure(args, tests, prompt, n_greedy)
    minutes, load = (time.perf_counter() - t0) / 60, (load0, os.getloadavg()[0])
    text = report(args, info, med, pp_test, tg_test, prompt, n_greedy, minutes, load)
    print(text)
    if args.out or not args.quick:
        harness.write_result("quant", text, args.out)


if __name__ == "__main__":
    main()
