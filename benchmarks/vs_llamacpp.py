"""The same GGUF through jaxinfer and through llama.cpp, side by side in one run.

llama.cpp comes from the `llama-cpp-python` package (`pip install jaxinfer[llamacpp]`) or a
`llama-bench` found on PATH. Tests: ppP (prompt tokens/s) and tgN (decode tokens/s after a
one-token prompt), medians of R repeats, 2 threads for llama.cpp (this machine's cores).
Models: stories260K (../shared/models) and a ~110M random Llama written as a GGUF.
Writes benchmarks/results/vs_llamacpp.md.
Usage: python benchmarks/vs_llamacpp.py [-p 512] [-n 128] [-r 3] [--threads 2]
"""

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from speed import LLAMA_110M, STORIES

import jaxinfer

ROOT = Path(__file__).resolve().parents[1]


def write_random_gguf(path: Path, cfg) -> Path:
    """A float32 llama GGUF of `cfg` with random weights and a SentencePiece-style vocab."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(cfg.name)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(cfg.vocab_size - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (cfg.vocab_size - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(cfg.vocab_size - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    D, F, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    NH, KH = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    w.add_tensor("token_embd.weight", rand(V, D))
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    w.add_tensor("output.weight", rand(V, D))
    for i in range(cfg.n_layers):
        for name, shape in [("attn_q", (NH, D)), ("attn_k", (KH, D)), ("attn_v", (KH, D)),
                            ("attn_output", (D, NH)), ("ffn_gate", (F, D)), ("ffn_up", (F, D)),
                            ("ffn_down", (D, F))]:  # fmt: skip
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(D, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(D, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llamacpp_python(path: Path, p: int, n: int, repeats: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=p + n + 8, n_batch=max(p, 8), n_threads=threads,
                n_threads_batch=threads, verbose=False)  # fmt: skip
    prompt = [1] + [3 + (7 * i) % 250 for i in range(p - 1)]
    pp, tg = [], []
    for _ in range(repeats + 1):  # the first run warms up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        pp.append(p / (time.perf_counter() - t0))
        llm.reset()
        llm.eval([1])
        t0 = time.perf_counter()
        for i in range(n):
            llm.eval([3 + i % 250])
        tg.append(n / (time.perf_counter() - t0))
    return {"pp": statistics.median(pp[1:]), "tg": statistics.median(tg[1:])}


def llama_bench(path: Path, p: int, n: int, repeats: int, threads: int) -> dict:
    out = subprocess.run(
        ["llama-bench", "-m", str(path), "-p", str(p), "-n", str(n), "-r", str(repeats),
         "-t", str(threads), "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = json.loads(out.stdout)
    return {
        "pp": next(r["avg_ts"] for r in rows if r["n_prompt"] > 0),
        "tg": next(r["avg_ts"] for r in rows if r["n_gen"] > 0),
    }


def jaxinfer_rates(path: Path, p: int, n: int, repeats: int) -> dict:
    engine = jaxinfer.load(path, max_seq_len=p + n + 8, batch_buckets=(1,))
    prompt = [1] + [3 + (7 * i) % 250 for i in range(p - 1)]
    kw = dict(temperature=0, ignore_eos=True)
    pp, tg = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        engine.generate(prompt, max_new_tokens=1, **kw)
        pp.append(p / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        r = engine.generate([1], max_new_tokens=n, **kw)
        tg.append(len(r.token_ids) / (time.perf_counter() - t0))
    return {"pp": statistics.median(pp[1:]), "tg": statistics.median(tg[1:])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401

        peer, name = llamacpp_python, "llama-cpp-python"
    except ImportError:
        if not shutil.which("llama-bench"):
            raise SystemExit(
                "llama.cpp not found: pip install llama-cpp-python, or put llama-bench on PATH"
            ) from None
        peer, name = llama_bench, "llama-bench"
    rows = [f"| model | test | llama.cpp ({name}) t/s | jaxinfer t/s | jaxinfer / llama.cpp |",
            "|---|---|---:|---:|---:|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        models = [
            ("stories260K F32", STORIES),
            ("llama-110M F32", write_random_gguf(Path(tmp) / "llama110m.gguf", LLAMA_110M)),
        ]
        for label, path in models:
            theirs = peer(path, args.p, args.n, args.r, args.threads)
            ours = jaxinfer_rates(path, args.p, args.n, args.r)
            for test, size in [("pp", args.p), ("tg", args.n)]:
                rows.append(f"| {label} | {test}{size} | {theirs[test]:.1f} | {ours[test]:.1f} | "
                            f"{ours[test] / theirs[test]:.2f}x |")  # fmt: skip
                print(rows[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "vs_llamacpp.md"
    out.write_text(f"side by side in one run, medians of {args.r}, {args.threads} threads for "
                   f"llama.cpp, float32\n\n" + "\n".join(rows) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
