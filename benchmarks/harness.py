"""What the benchmark scripts share: the models, the common flags, interleaved rounds with their
medians and spreads, the worker processes, llama-bench, and the results writer.

A script run as `python benchmarks/<script>.py` has benchmarks/ first on sys.path, so `import
harness` finds this file. Workers are files in benchmarks/workers/, run in their own processes;
those that load jaxinfer get the tree to run (`--tree`, default this checkout) on PYTHONPATH.
This module imports neither jax nor jaxinfer (a script may set XLA_FLAGS after importing it).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORKERS = ROOT / "benchmarks" / "workers"

# The models. stories260K: the GGUF the package ships (byte for byte the copy in
# ../shared/models/stories260K-gguf). The random Llamas, as shapes: the keywords of
# write_random_gguf, and through model() a ModelConfig that jaxinfer.load fills at random.
STORIES = ROOT / "jaxinfer" / "data" / "stories260K.gguf"
# The random 86M Llama: dim 768, 12 layers, 12 heads, ffn 2048, vocab 512.
LLAMA_86M = dict(
    d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048, vocab=512,
    name="llama-86M (random)",
)  # fmt: skip
# The same body with a Llama-2-sized vocabulary: ~110M parameters.
LLAMA_110M = {**LLAMA_86M, "vocab": 32000, "name": "llama-110M (random)"}
MODELS = {"stories260K": STORIES, "llama-86M": LLAMA_86M, "llama-110M": LLAMA_110M}

# The CPU features the kernels are built for or picked by (x86 and Arm names in /proc/cpuinfo).
ISA_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "amx_tile", "asimd", "fphp", "asimddp", "sve",
)  # fmt: skip


def model(name: str):
    """What jaxinfer.load takes for one of MODELS: stories260K's path, or a random Llama's
    ModelConfig (jaxinfer.load fills it with random weights)."""
    shape = MODELS[name]
    if isinstance(shape, Path):
        return shape
    import jaxinfer

    return jaxinfer.ModelConfig(
        arch="llama", d_model=shape["d_model"], n_layers=shape["n_layers"],
        n_heads=shape["n_heads"], n_kv_heads=shape["n_kv_heads"],
        head_dim=shape["d_model"] // shape["n_heads"], d_ff=shape["d_ff"],
        vocab_size=shape["vocab"], max_position=2048, name=shape["name"],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# flags, results


def parser(doc: str, rounds: int | None = None, *, peer: bool = False) -> argparse.ArgumentParser:
    """The common flags: `-r/--rounds` (timed rounds, medians over them) when `rounds` is a
    default, `--out` (the results file; None: the script's own default), and with `peer` those
    of the scripts that run workers beside llama.cpp: `--threads`, `--llama-bench`, `--tree`."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    if rounds is not None:
        ap.add_argument("-r", "--rounds", type=int, default=rounds, help="timed rounds")
    ap.add_argument("--out", type=Path, help="results file (default benchmarks/results/NAME.md)")
    if peer:
        ap.add_argument("--threads", type=int, default=2)
        ap.add_argument("--llama-bench", default=shutil.which("llama-bench"), help="its binary")
        ap.add_argument("--tree", type=Path, default=ROOT, help="the jaxinfer checkout to run")
    return ap


def cpu() -> str:
    """The CPU that results were measured on: model name, CPU count and ISA flags (from
    /proc/cpuinfo, else lscpu)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
        if shutil.which("lscpu"):
            lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("flags", "features"):
            flags |= set(value.split())
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "none of " + " ".join(ISA_FLAGS[:3])
    return f"{model}, {os.cpu_count()} CPUs (nproc); ISA flags: {isa}"


def write_result(name: str, text: str, out: Path | None = None) -> Path:
    """Write `text` to benchmarks/results/<name>.md (or `out`), with the CPU line last (and
    before it, where PEER_REPACK=0 took llama.cpp's repacked weights away, a line that says
    so: workers/peer.py)."""
    path = out or RESULTS / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    peer = ""
    if os.environ.get("PEER_REPACK") == "0":
        peer = (
            "llama.cpp ran without its extra buffer types (PEER_REPACK=0: no repacked weights)\n\n"
        )
    path.write_text(f"{text.rstrip()}\n\n{peer}CPU: {cpu()}\n")
    print(f"wrote {path}")
    return path


def require_llama_cpp():
    """Exit with one line when llama-cpp-python is missing (the peer workers need it)."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit('llama-cpp-python is not installed: pip install ".[llamacpp]"')


# ---------------------------------------------------------------------------------------------
# rounds, medians, spreads


class Stat(NamedTuple):
    median: float
    spread: float  # (max - min) / median: 0.06 = the values lie within 6% of the median


def stat(values) -> Stat:
    values = list(values)
    mid = statistics.median(values)
    return Stat(mid, (max(values) - min(values)) / mid if mid else float("nan"))


def interleaved(tests: dict, rounds: int, extra=None, progress=False) -> dict[object, list]:
    """Round after round, each of `tests` ({key: fn()}) once in turn; the first round is a
    warm-up and dropped. After each timed round `extra()` may add {key: value} (a llama-bench
    run). The values by key, in the order they came."""
    runs = collections.defaultdict(list)
    for round_ in range(rounds + 1):
        for key, fn in tests.items():
            value = fn()
            if round_:
                runs[key].append(value)
        if extra is not None and round_:
            for key, value in extra().items():
                runs[key].append(value)
        if progress:
            print(f"round {round_} done", flush=True)
    return runs


def wait_up(port: int, path: str, proc, timeout=600, poll=0.5) -> float:
    """Seconds until GET `path` on a local server answers 200 (SystemExit when `proc`
    exits first or `timeout` passes), asking every `poll` seconds."""
    import http.client

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server on port {port} exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(poll)
    raise SystemExit(f"server on port {port} did not come up")


def repeated(fn: Callable, repeats: int) -> list:
    """`repeats` values of fn() after a warm-up call."""
    return interleaved({None: fn}, repeats)[None]


def seconds(fn: Callable) -> float:
    """Wall seconds of one fn() call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed(fn: Callable, repeats: int) -> Stat:
    """Seconds per fn() call over `repeats` calls after a warm-up call."""
    return stat(repeated(functools.partial(seconds, fn), repeats))


# ---------------------------------------------------------------------------------------------
# workers


def worker_env(tree: Path | None = ROOT, devices: int | None = None) -> dict:
    """The environment of a worker process: `tree` first on PYTHONPATH (the jaxinfer to run),
    `devices` fake CPU devices."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    if devices is not None:
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return env


class Worker:
    """benchmarks/workers/<name>.py run with `args`: one JSON command per line in, one JSON
    reply per line out, whose `key` field is the answer."""

    def __init__(self, name: str, *args, key: str = "ts", env: dict | None = None):
        self.name, self.key = name, key
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKERS / f"{name}.py"), *map(str, args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {name}.py exited before it was ready ({self.proc.wait()})")
        assert json.loads(line)["ready"]

    def __call__(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())[self.key]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def once(name: str, *args, env: dict | None = None):
    """Run benchmarks/workers/<name>.py to the end; its last line of output as JSON (None when
    it prints nothing). Exits with its error output when it fails."""
    done = subprocess.run(
        [sys.executable, str(WORKERS / f"{name}.py"), *map(str, args)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if done.returncode:
        sys.exit(f"{name}.py {' '.join(map(str, args))[:200]} failed ({done.returncode}):\n"
                 f"{done.stderr[-3000:]}")  # fmt: skip
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def peer_worker(path: Path, threads: int, n_ctx: int, kv_type: str = "f16") -> Worker:
    """llama.cpp through its C API, run as llama-bench runs it (workers/peer.py), with its
    K/V cache in `kv_type` (f16, its default, or q8_0)."""
    return Worker("peer", path, threads, n_ctx, kv_type)


def jaxinfer_worker(path: Path, n_ctx: int, tree: Path = ROOT, **options) -> Worker:
    """jaxinfer from `tree` loaded with `options` (load()'s keywords), on as many fake CPU
    devices as they name, timed around generate() (workers/ours.py)."""
    env = worker_env(tree, options.get("devices", 1))
    return Worker("ours", path, n_ctx, json.dumps(options), env=env)


def run_rounds(groups, rounds: int, extra=None) -> dict:
    """Interleaved rounds over workers: each round sends every test of a group to each of its
    workers in turn; `groups` is [(workers {name: Worker}, tests {test: command})]. The first
    round is a warm-up and dropped; `extra` as in interleaved(). Closes the workers. Medians by
    (name, test), nan where nothing ran; prints each one's spread."""
    calls = {
        (name, test): functools.partial(worker, **cmd)
        for workers, tests in groups
        for test, cmd in tests.items()
        for name, worker in workers.items()
    }
    try:
        runs = interleaved(calls, rounds, extra, progress=True)
    finally:
        for workers, _ in groups:
            for worker in workers.values():
                worker.close()
    stats = {key: stat(values) for key, values in runs.items()}
    for (name, test), s in stats.items():
        print(f"{name} {test}: median {s.median:.4g}, spread {s.spread:.0%}")
    medians = {key: s.median for key, s in stats.items()}
    return collections.defaultdict(lambda: float("nan"), medians)


def run_rows(med: dict, names, tests) -> list[str]:
    """Table rows `| name | median per test |` of run_rounds' medians."""
    return [f"| {n} | " + " | ".join(f"{med[n, t]:.1f}" for t in tests) + " |" for n in names]


def ratio_rows(med: dict, ratios, tests) -> list[str]:
    """Table rows `| label | a / b per test |` for each (label, a, b) of `ratios`."""
    return [
        f"| {label} | " + " | ".join(f"{med[a, t] / med[b, t]:.2f}x" for t in tests) + " |"
        for label, a, b in ratios
    ]


# ---------------------------------------------------------------------------------------------
# llama-bench


def llama_bench(exe: str, path: Path, threads: int, depths=(512,)) -> dict[str, float]:
    """One round of llama-bench itself (its warm-up, then one timed run of each test), with its
    defaults but flash attention forced on (auto picks it on CPU too): pp512, tg128 and
    "tg128 @ d<depth>" for each of `depths`."""
    ds = ",".join(str(d) for d in (0, *depths))
    out = subprocess.run(
        [exe, "-m", str(path), "-p", "512", "-n", "128", "-d", ds, "-t", str(threads),
         "-r", "1", "-fa", "1", "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    get = {(r["n_prompt"], r["n_gen"], r["n_depth"]): r["avg_ts"] for r in json.loads(out.stdout)}
    return {
        "pp512": get[(512, 0, 0)],
        "tg128": get[(0, 128, 0)],
        **{f"tg128 @ d{d}": get[(0, 128, d)] for d in depths},
    }


def llama_bench_rounds(exe: str | None, threads: int, runs: dict, tests):
    """run_rounds' `extra`: llama-bench once per round on each {name: path} of `runs`, its
    figures for `tests` under (name, test); None without a llama-bench."""
    if not exe:
        return None
    depths = sorted({int(t.split("@ d")[1]) for t in tests if "@ d" in t})

    def extra():
        return {
            (name, test): value
            for name, path in runs.items()
            for test, value in llama_bench(exe, path, threads, depths).items()
            if test in tests
        }

    return extra


# ---------------------------------------------------------------------------------------------
# random GGUF files


def write_random_gguf(
    path: Path, d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab, arch="llama",
    n_experts=0, n_experts_used=0, d_ff_expert=0, name="llama-86M (random)", vocab_from=None,
    attention_every=4, linear_heads=(4, 8), linear_dim=64, conv_kernel=4, chat_template=None,
    head_dim=None, d_ff_shared=0, rope_theta=None, dtype="float32", context=4096,
) -> Path:  # fmt: skip
    """A GGUF with random weights (`dtype` float32, or float16 for real shapes: half the
    bytes, and what llama.cpp's quantizer takes as well) and a SentencePiece-style vocabulary
    (or the one of the GGUF `vocab_from`, e.g. stories260K's, so that it can draft): `llama`,
    `qwen3` / `qwen3moe` (q/k norms; with `n_experts`, stacked experts and a router), or
    `qwen35` / `qwen35moe` (every `attention_every`-th layer gated attention, the others Gated
    DeltaNet with `linear_heads` (key, value) heads of `linear_dim`; qwen35moe's experts on
    every layer, with a sigmoid-gated shared expert of width `d_ff_shared`; the keys and
    tensors llama.cpp's converter writes); `head_dim` (default d_model / n_heads) as Qwen3's
    and Qwen3.5's configs set it; with `chat_template`, that jinja template in its metadata.
    Tensors are written one at a time as they are drawn: a file of many GiB never sits in
    memory."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(context)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layers)
    if d_ff:
        w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    H = head_dim or d_model // n_heads
    hybrid = arch in ("qwen35", "qwen35moe")
    w.add_rope_dimension_count(H // 4 if hybrid else H)
    w.add_layer_norm_rms_eps(1e-6 if hybrid else 1e-5)
    if arch != "llama":
        w.add_key_length(H)
        w.add_value_length(H)
    if rope_theta or arch != "llama":
        w.add_rope_freq_base(rope_theta or (1e7 if hybrid else 1e6))
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(n_experts_used)
        w.add_expert_feed_forward_length(d_ff_expert)
    if d_ff_shared:
        w.add_expert_shared_feed_forward_length(d_ff_shared)
    attends = [not hybrid or (i + 1) % attention_every == 0 for i in range(n_layers)]
    nk, nv = linear_heads
    kd, vd = nk * linear_dim, nv * linear_dim
    if hybrid:
        w.add_rope_dimension_sections([11, 11, 10, 0])
        w.add_ssm_conv_kernel(conv_kernel)
        w.add_ssm_state_size(linear_dim)
        w.add_ssm_group_count(nk)
        w.add_ssm_time_step_rank(nv)
        w.add_ssm_inner_size(vd)
        w.add_array(f"{arch}.attention.recurrent_layers", [not a for a in attends])
        w.add_full_attention_interval(attention_every)
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
    if chat_template:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(0)
    big = np.dtype(dtype)

    # name -> (numpy shape, dtype, fn() -> the values); drawn when written
    tensors: dict[str, tuple[tuple[int, ...], np.dtype, Callable]] = {}

    def rand(name, *shape, std=0.02, kind=None):
        kind = kind or big
        tensors[name] = (shape, kind, lambda: (rng.standard_normal(shape, dtype=np.float32)
                                               * std).astype(kind))  # fmt: skip

    def fixed(name, fn, shape):
        tensors[name] = (shape, np.dtype(np.float32), fn)

    f32 = np.dtype(np.float32)
    rand("token_embd.weight", vocab, d_model)
    fixed("output_norm.weight", lambda: np.ones(d_model, np.float32), (d_model,))
    rand("output.weight", vocab, d_model)
    gate = 2 if hybrid else 1  # qwen35's q projection carries the output gate
    attention = {
        "attn_q": (gate * n_heads * H, d_model),
        "attn_k": (n_kv_heads * H, d_model),
        "attn_v": (n_kv_heads * H, d_model),
        "attn_output": (d_model, n_heads * H),
    }

    def delta_net(i):  # numpy order; ssm_a = -exp(A_log), A_log = log U(0.05, 1)
        b = f"blk.{i}."
        rand(b + "attn_qkv.weight", 2 * kd + vd, d_model)
        rand(b + "attn_gate.weight", vd, d_model)
        rand(b + "ssm_alpha.weight", nv, d_model, kind=f32)
        rand(b + "ssm_beta.weight", nv, d_model, kind=f32)
        fixed(b + "ssm_a", lambda: -rng.uniform(0.05, 1.0, nv).astype(np.float32), (nv,))
        rand(b + "ssm_dt.bias", nv, std=0.5, kind=f32)
        rand(b + "ssm_conv1d.weight", 2 * kd + vd, conv_kernel, std=0.3, kind=f32)
        fixed(b + "ssm_norm.weight", lambda: np.ones(linear_dim, np.float32), (linear_dim,))
        rand(b + "ssm_out.weight", d_model, vd)

    if n_experts:
        E, F = n_experts, d_ff_expert
        mlp = dict(ffn_gate_exps=(E, F, d_model), ffn_up_exps=(E, F, d_model),
                   ffn_down_exps=(E, d_model, F))  # fmt: skip
        if d_ff_shared:
            S = d_ff_shared
            mlp |= dict(ffn_gate_shexp=(S, d_model), ffn_up_shexp=(S, d_model),
                        ffn_down_shexp=(d_model, S))  # fmt: skip
    else:
        mlp = dict(ffn_gate=(d_ff, d_model), ffn_up=(d_ff, d_model), ffn_down=(d_model, d_ff))
    qk_norms = ["attn_q_norm", "attn_k_norm"] if arch != "llama" else []
    for i in range(n_layers):
        shapes = {**attention, **mlp} if attends[i] else mlp
        for kind, shape in shapes.items():
            rand(f"blk.{i}.{kind}.weight", *shape)
        if n_experts:  # routers stay float32, as llama.cpp's converter keeps them
            rand(f"blk.{i}.ffn_gate_inp.weight", n_experts, d_model, kind=f32)
            if d_ff_shared:
                rand(f"blk.{i}.ffn_gate_inp_shexp.weight", 1, d_model, kind=f32)
        if not attends[i]:
            delta_net(i)
        norms = ["attn_norm", "post_attention_norm" if hybrid else "ffn_norm"]
        for kind in norms + (qk_norms if attends[i] else []):
            size = H if kind in qk_norms else d_model
            fixed(f"blk.{i}.{kind}.weight", lambda size=size: np.ones(size, np.float32), (size,))
    for tname, (shape, kind, _) in tensors.items():
        w.add_tensor_info(tname, shape, kind, int(np.prod(shape)) * kind.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for shape, _, fn in tensors.values():
        values = fn()
        assert values.shape == shape, (values.shape, shape)
        w.write_tensor_data(values)
    w.close()
    return path
