"""jaxinfer against llama.cpp on the same GGUF, run the way llama-bench runs it, side by side.

The peer is a worker process on llama.cpp's C API (through llama-cpp-python's ctypes bindings,
`pip install ".[llamacpp]"`), doing what llama-bench's `test_prompt` / `test_gen` do:
flash attention on, F16 K/V cache, n_batch = n_ubatch = 512, the same threads for batch and
generation, prompt batches through `llama_batch_get_one` (logits of the last token only), one
token per decode for generation, the cache cleared between runs, a depth prompt first for
`-d`. It is timed by llama.cpp's own counters (`llama_perf_context`).

jaxinfer runs in a second worker (loaded with its defaults, warmed up), timed end to end around
`generate()`, which is what a user gets: pp512 = 512 over the wall time of a
`max_new_tokens=1` call on a 512-token prompt; tg128 = 128 over the wall time of a
`max_new_tokens=128` call on a one-token prompt (128 forward passes, as llama-bench's 128
decodes); at depth d, the prompt is 1 + d tokens and its prefill time (the engine's own clock)
is taken out of the wall time, leaving 127 decodes for 127 tokens.

The parent sends both workers the same tests in turn, round after round (the first round is a
warm-up and dropped), and runs llama-bench itself once per round when it is found (on PATH or
`--llama-bench PATH`, e.g. built from llama-cpp-python's vendored llama.cpp with cmake): the
table shows all three, medians over the rounds, and jaxinfer's ratio to each. A third worker
runs jaxinfer with `kv_cache_dtype="float16"`, the K/V cache llama.cpp keeps.

Usage: python benchmarks/vs_llamacpp.py [-r 5] [--threads 2] [--llama-bench PATH]
Writes benchmarks/results/vs_llamacpp.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260K-gguf" / "stories260K.gguf"
# The 86M Llama of DESIGN.md section 1 (dim 768, 12 layers, 12 heads, ffn 2048, vocab 512).
LLAMA_86M = dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048, vocab=512)

PEER = r"""
import ctypes, json, sys
import llama_cpp as L

path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
quiet = L.llama_log_callback(lambda level, text, data: None)  # kept alive: C holds it
L.llama_log_set(quiet, ctypes.c_void_p())
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.n_gpu_layers = 0
model = L.llama_model_load_from_file(path.encode(), mp)
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, 512, 512
cp.n_threads = cp.n_threads_batch = threads
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
cp.type_k = cp.type_v = 1  # GGML_TYPE_F16
cp.no_perf = False
ctx = L.llama_init_from_model(model, cp)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
bos = L.llama_vocab_bos(vocab) if L.llama_vocab_get_add_bos(vocab) else None
state = [12345]

def rand():  # llama-bench draws std::rand() % n_vocab; any fixed stream will do
    state[0] = (1103515245 * state[0] + 12345) % 2**31
    return state[0] % n_vocab

def prompt(n):
    done = 0
    while done < n:
        k = min(n - done, 512)
        toks = [bos if done == 0 and bos is not None else rand()] + [rand() for _ in range(k - 1)]
        arr = (L.llama_token * k)(*toks)
        assert L.llama_decode(ctx, L.llama_batch_get_one(arr, k)) == 0
        done += k
    L.llama_synchronize(ctx)

def gen(n):
    tok = (L.llama_token * 1)(bos if bos is not None else rand())
    for _ in range(n):
        assert L.llama_decode(ctx, L.llama_batch_get_one(tok, 1)) == 0
        L.llama_synchronize(ctx)
        tok[0] = rand()

print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    L.llama_memory_clear(L.llama_get_memory(ctx), False)
    if cmd["depth"]:
        prompt(cmd["depth"])
    L.llama_perf_context_reset(ctx)
    if cmd["test"] == "pp":
        prompt(cmd["n"])
    else:
        gen(cmd["n"])
    perf = L.llama_perf_context(ctx)
    if cmd["test"] == "pp":
        n, ms = perf.n_p_eval, perf.t_p_eval_ms
    else:
        n, ms = perf.n_eval, perf.t_eval_ms
    print(json.dumps({"ts": 1e3 * n / ms}), flush=True)
"""

OURS = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])
import jaxinfer
path, n_ctx, options = sys.argv[1], int(sys.argv[3]), json.loads(sys.argv[5])
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
"""


class Worker:
    """A Python process running `code` with `args`: one JSON command per line in, one JSON
    reply per line out, whose `key` field is the answer."""

    def __init__(self, code: str, *args: str, key: str = "ts"):
        self.key = key
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert json.loads(self.proc.stdout.readline())["ready"]

    def __call__(self, **cmd) -> float:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())[self.key]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def run_rounds(groups, rounds: int, extra=None) -> dict:
    """Interleaved rounds: each round sends every test of a group to each of its workers in
    turn; `groups` is [(workers {name: Worker}, tests {test: command})]. The first round is a
    warm-up and dropped; after each timed round `extra()` may add {(name, test): value} (a
    llama-bench run). Closes the workers. Medians by (name, test); nan where nothing ran."""
    runs = collections.defaultdict(list)
    try:
        for round_ in range(rounds + 1):
            for workers, tests in groups:
                for test, cmd in tests.items():
                    for name, worker in workers.items():
                        value = worker(**cmd)
                        if round_:
                            runs[name, test].append(value)
            if extra is not None and round_:
                for key, value in extra().items():
                    runs[key].append(value)
            print(f"round {round_} done", flush=True)
    finally:
        for workers, _ in groups:
            for worker in workers.values():
                worker.close()
    medians = {key: statistics.median(values) for key, values in runs.items()}
    return collections.defaultdict(lambda: float("nan"), medians)


def jaxinfer_worker(path: Path, threads: int, n_ctx: int, **options) -> Worker:
    """jaxinfer loaded with `options` (load()'s keywords), on as many fake CPU devices as they
    name."""
    env = os.environ.get("XLA_FLAGS", "")
    fake = options.get("devices", 1)
    os.environ["XLA_FLAGS"] = f"{env} --xla_force_host_platform_device_count={fake}".strip()
    try:
        return Worker(OURS, str(path), str(threads), str(n_ctx), str(ROOT), json.dumps(options))
    finally:
        os.environ["XLA_FLAGS"] = env


def write_random_gguf(
    path: Path, d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab, arch="llama",
    n_experts=0, n_experts_used=0, d_ff_expert=0, name="llama-86M (random)", vocab_from=None,
) -> Path:  # fmt: skip
    """A float32 GGUF with random weights and a SentencePiece-style vocabulary (or the one of
    the GGUF `vocab_from`, e.g. stories260K's, so that it can draft): `llama`, or
    `qwen3` / `qwen3moe` (q/k norms; with `n_experts`, stacked experts and a router)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(4096)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    H = d_model // n_heads
    w.add_rope_dimension_count(H)
    w.add_layer_norm_rms_eps(1e-5)
    if arch != "llama":
        w.add_key_length(H)
        w.add_value_length(H)
        w.add_rope_freq_base(1e6)
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(n_experts_used)
        w.add_expert_feed_forward_length(d_ff_expert)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(vocab - len(tokens))]
    scores = [0.0] * 259 + [-float(i) for i in range(vocab - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 259)
    if vocab_from is not None:
        fields = gguf.GGUFReader(str(vocab_from)).fields
        tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode()
                  for i in fields["tokenizer.ggml.tokens"].data]  # fmt: skip
        scores = [float(fields["tokenizer.ggml.scores"].parts[i][0])
                  for i in fields["tokenizer.ggml.scores"].data]  # fmt: skip
        types = [int(fields["tokenizer.ggml.token_type"].parts[i][0])
                 for i in fields["tokenizer.ggml.token_type"].data]  # fmt: skip
        assert len(tokens) == vocab, (len(tokens), vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, d_model))
    w.add_tensor("output_norm.weight", np.ones(d_model, np.float32))
    w.add_tensor("output.weight", rand(vocab, d_model))
    shapes = {
        "attn_q": (n_heads * H, d_model),
        "attn_k": (n_kv_heads * H, d_model),
        "attn_v": (n_kv_heads * H, d_model),
        "attn_output": (d_model, n_heads * H),
    }
    if n_experts:
        E, F = n_experts, d_ff_expert
        shapes.update(ffn_gate_inp=(E, d_model), ffn_gate_exps=(E, F, d_model),
                      ffn_up_exps=(E, F, d_model), ffn_down_exps=(E, d_model, F))  # fmt: skip
    else:
        shapes.update(ffn_gate=(d_ff, d_model), ffn_up=(d_ff, d_model), ffn_down=(d_model, d_ff))
    norms = ["attn_norm", "ffn_norm"] + (["attn_q_norm", "attn_k_norm"] if arch != "llama" else [])
    for i in range(n_layers):
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        for name in norms:
            size = H if name.startswith("attn_") and name != "attn_norm" else d_model
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(size, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_bench(exe: str, path: Path, threads: int) -> dict[str, float]:
    """One round of llama-bench itself (its warm-up, then one timed run of each test), with its
    defaults but flash attention forced on (auto picks it on CPU too)."""
    out = subprocess.run(
        [exe, "-m", str(path), "-p", "512", "-n", "128", "-d", "0,512", "-t", str(threads),
         "-r", "1", "-fa", "1", "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    get = {(r["n_prompt"], r["n_gen"], r["n_depth"]): r["avg_ts"] for r in json.loads(out.stdout)}
    return {
        "pp512": get[(512, 0, 0)],
        "tg128": get[(0, 128, 0)],
        "tg128 @ d512": get[(0, 128, 512)],
    }


TESTS = {
    "pp512": dict(test="pp", n=512, depth=0),
    "tg128": dict(test="tg", n=128, depth=0),
    "tg128 @ d512": dict(test="tg", n=128, depth=512),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", default=shutil.which("llama-bench"), help="its binary")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the jaxinfer checkout to run")
    args = ap.parse_args()
    n_ctx = 1024
    bench = args.llama_bench
    lines = [
        f"# jaxinfer vs llama.cpp ({time.strftime('%Y-%m-%d')}, F32 GGUF, {args.threads} threads, "
        f"medians of {args.rounds} interleaved rounds after a dropped warm-up round)",
        "",
        "Each round runs every test on the C-API peer and on jaxinfer, then llama-bench itself "
        "once" + (" (`-r 1`)." if bench else " (not found: its column is empty)."),
        "",
        "| model | test | llama-bench t/s | peer t/s | jaxinfer t/s | vs llama-bench | vs peer "
        "| jaxinfer KV f16 t/s | KV f16 vs llama-bench |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        llama86 = write_random_gguf(Path(tmp) / "86m.gguf", **LLAMA_86M)
        for label, path in [("stories260K", STORIES), ("llama-86M (random)", llama86)]:
            peer = Worker(PEER, str(path), str(args.threads), str(n_ctx))
            ours = Worker(OURS, str(path), str(args.threads), str(n_ctx), str(args.tree), "{}")
            f16 = json.dumps({"kv_cache_dtype": "float16"})
            half = Worker(OURS, str(path), str(args.threads), str(n_ctx), str(args.tree), f16)
            runs = {name: ([], [], [], []) for name in TESTS}
            try:
                for round_ in range(args.rounds + 1):
                    for name, cmd in TESTS.items():
                        theirs, mine, mine16 = peer(**cmd), ours(**cmd), half(**cmd)
                        if round_:
                            runs[name][0].append(theirs)
                            runs[name][1].append(mine)
                            runs[name][3].append(mine16)
                    if bench and round_:
                        for name, value in llama_bench(bench, path, args.threads).items():
                            runs[name][2].append(value)
            finally:
                peer.close()
                ours.close()
                half.close()
            for name, (theirs, mine, tool, mine16) in runs.items():
                t, m, h = (statistics.median(x) for x in (theirs, mine, mine16))
                b = statistics.median(tool) if tool else float("nan")
                lines.append(f"| {label} | {name} | {b:.1f} | {t:.1f} | {m:.1f} | {m / b:.2f}x | "
                             f"{m / t:.2f}x | {h:.1f} | {h / b:.2f}x |")  # fmt: skip
                print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "vs_llamacpp.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
