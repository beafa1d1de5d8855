"""Quantized GGUF: jaxinfer and llama.cpp on the random 86M Llama in F32, Q8_0, Q4_K_M, Q5_K_M.

The F32 file is vs_llamacpp.py's random 86M Llama (dim 768, 12 layers, 12 heads, ffn 2048,
vocab 512); the Q8_0, Q4_K_M and Q5_K_M files are made from it by llama.cpp's own quantizer
through its C API (`llama_model_quantize` with its default parameters but the file type: what
`llama-quantize` does), in a temporary folder.

Speed: the workers of vs_llamacpp.py (the peer runs llama.cpp's C API as llama-bench runs it;
jaxinfer is timed end to end around `generate()`), pp512 and tg128 on each file, all six in
turn each round, llama-bench itself once per file and round when found; medians over the rounds
after a dropped warm-up round. Before the rounds, a one-shot jaxinfer process per file reads
its peak host RSS growth over `load()` (resident memory sampled every 2 ms during the load
against before it, jax already initialized: on the CPU backend the device weights are host
memory too), the device weight bytes
(`engine.weight_bytes()`, where the Engine has it) and its first 64 greedy tokens, which are
compared with llama.cpp's on the same file (same context settings as the peer; llama.cpp
quantizes activations to Q8 for Q8_0/Q4_K dots, so exact agreement is not expected) and with
jaxinfer's on the same file loaded dequantized at load (`quantize="none"`).

Usage: python benchmarks/quant.py [-r 5] [--threads 2] [--llama-bench PATH] [--quick] [--tree DIR]
Writes benchmarks/results/quant.md (--quick: 1 round, fewer tokens, prints only unless --out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_llamacpp import (  # noqa: E402
    LLAMA_86M,
    OURS,
    PEER,
    ROOT,
    Worker,
    llama_bench,
    run_rounds,
    write_random_gguf,
)

# label -> llama.cpp file type (None: the F32 file as written)
FILES = {
    "F32": None,
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
}
QUANTIZED = ("Q8_0", "Q4_K", "Q5_K")
N_CTX = 1024

QUANTIZE = r"""
import ctypes, sys
import llama_cpp as L
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
params = L.llama_model_quantize_default_params()
params.ftype = getattr(L, ftype)
sys.exit(L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))
"""

# The peer's own setup (model, context with llama-bench's settings), then greedy decoding.
PEER_SETUP = PEER[: PEER.index("print(json.dumps")]
GREEDY = r"""
import numpy as np
prompt, n = json.loads(sys.argv[4]), int(sys.argv[5])
toks, out = (L.llama_token * len(prompt))(*prompt), []
assert L.llama_decode(ctx, L.llama_batch_get_one(toks, len(prompt))) == 0
for _ in range(n):
    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
    out.append(int(logits.argmax()))
    tok = (L.llama_token * 1)(out[-1])
    assert L.llama_decode(ctx, L.llama_batch_get_one(tok, 1)) == 0
print(json.dumps({"ids": out}))
"""
PEER_GREEDY = PEER_SETUP + GREEDY

PROBE = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[2])
import jax, jaxinfer
path, n_ctx, prompt, n = sys.argv[1], int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
jax.numpy.zeros(1).block_until_ready()

def now():  # resident bytes now (ru_maxrss would hold import's peak, above a small load)
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

base, peak, loading = now(), [0], [True]
def sample():
    while loading[0]:
        peak[0] = max(peak[0], now())
        time.sleep(0.002)
watcher = threading.Thread(target=sample)
watcher.start()
engine = jaxinfer.load(path, max_seq_len=n_ctx, quantize=sys.argv[6])
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
"""


def quantize(src: Path, dst: Path, ftype: str) -> Path:
    done = subprocess.run(
        [sys.executable, "-c", QUANTIZE, str(src), str(dst), ftype], capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"llama_model_quantize({ftype}) failed, {done.returncode}:\n{done.stderr[-3000:]}")
    return dst


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


def one_shot(code: str, *args: str, env: dict | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env
    )
    if done.returncode:
        sys.exit(f"a one-shot worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def leading(a: list[int], b: list[int]) -> int:
    """How many leading tokens agree."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def machine() -> str:
    model = platform.processor() or "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"{os.cpu_count()} CPUs (nproc), {model}"


def measure(args, tests: dict, prompt: list[int], n_greedy: int):
    """The files, then per file its types, sizes and one-shot probes (`info`), then the timed
    rounds (`med`, medians by (run, test))."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {"F32": write_random_gguf(Path(tmp) / "86m-f32.gguf", **LLAMA_86M)}
        for label, ftype in FILES.items():
            if ftype:
                files[label] = quantize(files["F32"], Path(tmp) / f"86m-{label}.gguf", ftype)
        info, greedy = {}, (json.dumps(prompt), str(n_greedy))
        for label, path in files.items():
            types, tensor_bytes = tensor_types(path, LLAMA_86M["n_layers"])
            probe = (PROBE, str(path), str(args.tree), str(N_CTX), *greedy)
            deq = one_shot(*probe, "none") if label in QUANTIZED else None
            info[label] = dict(
                types=types, tensor_bytes=tensor_bytes, size=path.stat().st_size, deq=deq,
                ours=one_shot(*probe, "keep"),
                peer=one_shot(PEER_GREEDY, str(path), str(args.threads), str(N_CTX), *greedy),
            )  # fmt: skip
            print(f"{label} probed: {types}", flush=True)

        workers = {}
        for label, path in files.items():
            common = (str(path), str(args.threads), str(N_CTX))
            workers[f"llama.cpp {label}"] = Worker(PEER, *common)
            workers[f"jaxinfer {label}"] = Worker(OURS, *common, str(args.tree), "{}")

        def bench():
            found = {}
            for label, path in files.items():
                for test, value in llama_bench(args.llama_bench, path, args.threads).items():
                    if test in tests:
                        found[f"llama-bench {label}", test] = value
            return found

        med = run_rounds([(workers, tests)], args.rounds, bench if args.llama_bench else None)
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
        ours, deq = info[q]["ours"]["ids"], info[q]["deq"]
        vs_deq = "n/a" if deq is None else f"{leading(ours, deq['ids'])}/{n_greedy}"
        return f"{q}: {vs_deq} vs dequantized, {leading(ours, info[q]['peer']['ids'])}/{n_greedy}"

    title = "Quantized GGUF: jaxinfer vs llama.cpp" + (" (--quick smoke run)" if args.quick else "")
    lines = [
        f"# {title} ({time.strftime('%Y-%m-%d')}, random 86M Llama, {args.threads} threads, "
        f"medians of {args.rounds} interleaved rounds after a dropped warm-up round)",
        "",
        f"Machine: {machine()}; load average {load[0]:.1f} at the start, {load[1]:.1f} at the "
        f"end. jax {jax.__version__}, llama-cpp-python {llama_cpp.__version__}; {minutes:.1f} "
        "min in all.",
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
        f"| greedy: leading tokens of {n_greedy} matching (jaxinfer vs dequantized, vs "
        "llama.cpp) | recorded | " + "; ".join(agreement(q) for q in QUANTIZED) + " | |",
        f"| greedy F32: jaxinfer vs llama.cpp | recorded | "
        f"{leading(info['F32']['ours']['ids'], info['F32']['peer']['ids'])}/{n_greedy} | |",
        "",
        f"| run | {pp_test} t/s | {tg_test} t/s |",
        "|---|---:|---:|",
    ]
    for side in ["llama.cpp", "jaxinfer"] + (["llama-bench"] if args.llama_bench else []):
        for label in FILES:
            name = f"{side} {label}"
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", default=shutil.which("llama-bench"), help="its binary")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 round, fewer tokens")
    ap.add_argument("--out", type=Path, help="results file (default results/quant.md)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the jaxinfer checkout to run")
    args = ap.parse_args()
    pp, tg, n_greedy = (512, 128, 64) if not args.quick else (64, 16, 16)
    if args.quick:
        args.rounds, args.llama_bench = 1, None
    elif args.out is None:
        args.out = ROOT / "benchmarks" / "results" / "quant.md"
    pp_test, tg_test = f"pp{pp}", f"tg{tg}"
    tests = {pp_test: dict(test="pp", n=pp, depth=0), tg_test: dict(test="tg", n=tg, depth=0)}
    prompt = [1] + [3 + (7919 * i) % (LLAMA_86M["vocab"] - 3) for i in range(1, 16)]

    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    info, med = measure(args, tests, prompt, n_greedy)
    minutes, load = (time.perf_counter() - t0) / 60, (load0, os.getloadavg()[0])
    text = report(args, info, med, pp_test, tg_test, prompt, n_greedy, minutes, load)
    print(text)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
