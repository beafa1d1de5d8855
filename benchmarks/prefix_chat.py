"""Prefix caching on a multi-turn chat, through the servers: `jaxinfer serve` with the prefix
cache on and off (`--no-prefix-cache`), and llama-cpp-python's server with its prompt cache on.

The load: 4 clients, 6 turns each, every conversation opening with the same 1,000-token system
prompt; each turn adds a 6-word user message, asks for 48 greedy tokens (ignore_eos) and sends
the answer back as the assistant's message in the next turn, within a 2,048-token context.
The chat template is the benchmark's own (CHATML below), written into each model's GGUF so
both servers apply the same one. Time to first token per request (send to the first streamed
text) and aggregate tokens/s (all generated tokens / wall time of the load).

A second load shares nothing (each of 24 requests a fresh 600-token prompt, 48 tokens, 4
clients): what the cache costs when it never hits.

Models: the random 86M Llama (harness.LLAMA_86M) and a random qwen35 hybrid of the hybrid
benchmark's shape (hybrid.SHAPE), float32 GGUFs. The servers stay up; the cells take turns
round after round after a warm-up load each; medians over the rounds.

The peer: llama-cpp-python's server (`python -m llama_cpp.server`, its own benchmark-free
setup), `--n_threads 2 --n_threads_batch 2 --n_ctx 2048 --cache True` (its RAM prompt cache)
`--interrupt_requests False`. It serves one request at a time: that is how it is built. Pass
`--peer-python` for an interpreter that has it (pip install ".[llamacpp]").

Usage: python benchmarks/prefix_chat.py [-r 3] [--peer-python PATH]
Writes benchmarks/results/prefix_chat.md.

`--host-tier MIB`: the host-RAM tier of the prefix cache instead (`--cache-ram`). The chat load
with a 1,000-token system prompt of each client's own (an agent's or a RAG client's document:
with one shared prompt, the pool keeps the shared pages and a tier has little to do) on two
jaxinfer servers whose KV pool holds about one conversation (`--kv-cache-tokens` = the
context): with the prefix cache alone, the 4 conversations evict each other's pages between
turns; with `--cache-ram MIB` besides, evicted pages wait in host RAM and the next turn copies
them back. Turns 2+ TTFT, the servers taking turns round after round; medians. Writes
benchmarks/results/prefix_chat_host.md. `--small` shrinks the load (a 200-token system prompt,
3 turns, 16 tokens, a 512-token context and pool) to check the script runs.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
import numpy as np
from hybrid import SHAPE as HYBRID

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CLIENTS, TURNS, NEW = 4, 6, 48
# (6-word user turns: with 10, a round whose random answers retokenize long passed the
# 2,048-token context at turn 6; with 6 it still can, and that round's turn 6 fails for
# jaxinfer, which refuses a prompt past the context: a known gap of this load)
SYSTEM_WORDS, USER_WORDS, FRESH_WORDS = 1000, 6, 600


def vocabulary_words() -> list[str]:
    """The whole words of stories260K's vocabulary (each one token), which both models use."""
    import gguf

    field = gguf.GGUFReader(str(harness.STORIES)).fields["tokenizer.ggml.tokens"]
    pieces = [bytes(field.parts[i]).decode() for i in field.data]
    return [p[1:] for p in pieces if p.startswith("\u2581") and p[1:].isalpha()]


def words(rng, n: int, vocab: list[str]) -> str:
    """n random words, about one token each."""
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), n))


def chat(port: int, messages: list[dict]) -> tuple[float, str, int]:
    """(TTFT, answer text, tokens) of one streamed greedy chat completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    body = {"model": "m", "messages": messages, "max_tokens": NEW, "temperature": 0,
            "repeat_penalty": 1.0, "ignore_eos": True, "stream": True}  # fmt: skip
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200, response.read()[:300]
    first, text, pieces = None, [], 0
    for line in response:
        line = line.strip()
        if line == b"data: [DONE]":
            break
        if not line.startswith(b"data: "):
            continue
        delta = json.loads(line[6:])["choices"]
        content = delta[0]["delta"].get("content") if delta else None
        if content:
            first = first or time.perf_counter()
            text.append(content)
            pieces += 1
    conn.close()
    return (first or time.perf_counter()) - start, "".join(text), NEW


def conversation_load(port: int, system: str | list[str], users: list[list[str]]):
    """The chat load (`system`: one prompt for every client, or one each) -> (turn-1 TTFTs,
    turn-2+ TTFTs, aggregate tokens/s)."""
    first, later, tokens = [], [], [0]
    lock = threading.Lock()

    def client(k: int):
        messages = [{"role": "system", "content": system if isinstance(system, str) else system[k]}]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": users[k][turn]})
            ttft, answer, n = chat(port, messages)
            messages.append({"role": "assistant", "content": answer})
            with lock:
                (first if turn == 0 else later).append(ttft)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return first, later, tokens[0] / (time.perf_counter() - t0)


def fresh_load(port: int, prompts: list[str]) -> float:
    """Requests that share nothing, 4 at a time -> aggregate tokens/s."""
    queue = list(prompts)
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            chat(port, [{"role": "user", "content": prompt}])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(prompts) * NEW / (time.perf_counter() - t0)


CONTEXT = 2048  # -c of the servers (the host-tier load's pool too)


def shrink() -> None:
    """The small load of `--small`: a quick check that the script runs."""
    global TURNS, NEW, SYSTEM_WORDS, CONTEXT
    TURNS, NEW, SYSTEM_WORDS, CONTEXT = 3, 16, 200, 512


def main():
    ap = harness.parser(__doc__, 3)
    ap.add_argument("--peer-python", default=sys.executable)
    ap.add_argument("--models", default="llama-86M,qwen35", help="which of the two to run")
    ap.add_argument("--host-tier", type=int, default=0, metavar="MIB",
                    help="the prefix cache with and without a host tier of MIB")  # fmt: skip
    ap.add_argument("--small", action="store_true", help="a small load (the host-tier mode)")
    args = ap.parse_args()
    if args.host_tier:
        host_tier(args)
        return
    # Both with stories260K's 512-token vocabulary (the 86M's own size), so that chat text
    # tokenizes to about a token a word; the hybrid otherwise of the hybrid benchmark's shape.
    shapes = {"llama-86M": dict(harness.LLAMA_86M), "qwen35": dict(
        HYBRID, vocab=512, arch="qwen35", name="bench-qwen35 (random)")}  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    lines = [
        "# Prefix caching on a multi-turn chat, through the servers",
        "",
        f"`python benchmarks/prefix_chat.py -r {args.rounds}` on {harness.cpu()}, "
        f"{time.strftime('%Y-%m-%d')}. {CLIENTS} clients x {TURNS} turns, a {SYSTEM_WORDS}-token "
        f"shared system prompt, {USER_WORDS}-word user turns, {NEW} greedy tokens per turn "
        "(ignore_eos), streamed; the answers go back as assistant messages. No-sharing load: "
        f"{CLIENTS * TURNS} fresh {FRESH_WORDS}-token prompts, {NEW} tokens, {CLIENTS} at a "
        f"time. Medians of {args.rounds} interleaved rounds after a warm-up load per server.",
        "jaxinfer: `serve -np 4 -c 2048` (prefix cache on, the default; off: "
        "`--no-prefix-cache`). Peer: llama-cpp-python's server, `--n_threads 2 "
        "--n_threads_batch 2 --n_ctx 2048 --cache True --interrupt_requests False`: it serves "
        "one request at a time (that is how it is built), keeping prompts in its RAM cache.",
        "",
    ]
    lines += each_model(args, shapes, env, run_model)
    text = "\n".join(lines)
    print(text)
    harness.write_result("prefix_chat", text, args.out)


def each_model(args, shapes: dict, env, rows) -> list[str]:
    """`rows(name, path, vocabulary, args, env)` of each of --models, on its random GGUF (the
    stories260K vocabulary, a ChatML template)."""
    lines = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = harness.write_random_gguf(Path(tmp) / f"{name}.gguf", **shapes[name],
                                             vocab_from=harness.STORIES,
                                             chat_template=CHATML)  # fmt: skip
            lines += rows(name, path, vocabulary_words(), args, env)
    return lines


def run_model(name: str, path: Path, vocab: list[str], args, env) -> list[str]:
    rng = np.random.default_rng(0)
    system = words(rng, SYSTEM_WORDS, vocab)
    users = [[words(rng, USER_WORDS, vocab) for _ in range(TURNS)] for _ in range(CLIENTS)]
    fresh = [words(rng, FRESH_WORDS, vocab) for _ in range(CLIENTS * TURNS)]
    jax_cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "-m", str(path), "-np", "4",
               "-c", str(CONTEXT)]  # fmt: skip
    servers = {
        "cache on": (8441, "/health", jax_cmd + ["--port", "8441"]),
        "cache off": (8442, "/health", jax_cmd + ["--port", "8442", "--no-prefix-cache"]),
        "llama-cpp-python": (8443, "/v1/models", [
            args.peer_python, "-m", "llama_cpp.server", "--model", str(path), "--port", "8443",
            "--n_threads", "2", "--n_threads_batch", "2", "--n_ctx", "2048", "--cache", "True",
            "--interrupt_requests", "False", "--verbose", "False"]),
    }  # fmt: skip
    cells: dict = {(s, m): [] for s in servers for m in ("ttft1", "ttft2", "chat", "fresh")}
    procs = {}
    try:
        for server, (port, probe, cmd) in servers.items():
            procs[server] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL)  # fmt: skip
            harness.wait_up(port, probe, procs[server], timeout=900)
        names = list(servers)
        for server in names:  # first touches: pools, caches, the peer's buffers
            fresh_load(servers[server][0], [f"warm-up {p}" for p in fresh[:CLIENTS]])
        for round_ in range(1, args.rounds + 1):
            order = names[round_ % 3 :] + names[: round_ % 3]  # each leads in turn
            for server in order:
                port = servers[server][0]
                salt = f"round {round_}"  # a fresh conversation set per round: no stale hits
                sys_prompt = f"{salt}. {system}"
                first, later, agg = conversation_load(port, sys_prompt, users)
                fresh_tps = fresh_load(port, [f"{salt} {p}" for p in fresh])
                print(f"{name} round {round_} {server:18s}: turn 1 TTFT p50 "
                      f"{statistics.median(first):.3f} s, turns 2+ p50 "
                      f"{statistics.median(later):.3f} s, chat {agg:.1f} t/s, no sharing "
                      f"{fresh_tps:.1f} t/s", flush=True)  # fmt: skip
                cells[(server, "ttft1")].append(statistics.median(first))
                cells[(server, "ttft2")].append(statistics.median(later))
                cells[(server, "chat")].append(agg)
                cells[(server, "fresh")].append(fresh_tps)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    med = {k: statistics.median(v) for k, v in cells.items()}
    rows = [
        f"## {name}",
        "",
        "| server | turn 1 TTFT p50 s | turns 2-6 TTFT p50 s | chat tokens/s "
        "| no-sharing tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for server in servers:
        rows.append(
            f"| {server} | {med[(server, 'ttft1')]:.3f} | {med[(server, 'ttft2')]:.3f} | "
            f"{med[(server, 'chat')]:.1f} | {med[(server, 'fresh')]:.1f} |"
        )
    on, off, peer = "cache on", "cache off", "llama-cpp-python"
    rows += [
        "",
        f"- Turns 2-6 TTFT p50, cache off / on: "
        f"{med[(off, 'ttft2')] / med[(on, 'ttft2')]:.2f}x faster with the cache.",
        "- No-sharing throughput, cache on / off: "
        f"{med[(on, 'fresh')] / med[(off, 'fresh')]:.3f}x.",
        f"- Against llama-cpp-python (one request at a time): turns 2-6 TTFT p50 "
        f"{med[(peer, 'ttft2')] / med[(on, 'ttft2')]:.2f}x lower, chat tokens/s "
        f"{med[(on, 'chat')] / med[(peer, 'chat')]:.2f}x.",
        "",
    ]
    return rows


def host_tier(args) -> None:
    """Turns 2+ TTFT with the host tier on and off, over a pool of about one conversation."""
    if args.small:
        shrink()
    shapes = {"llama-86M": dict(harness.LLAMA_86M), "qwen35": dict(
        HYBRID, vocab=512, arch="qwen35", name="bench-qwen35 (random)")}  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    lines = [
        "# The prefix cache's host tier (--cache-ram) on a multi-turn chat",
        "",
        f"`python benchmarks/prefix_chat.py --host-tier {args.host_tier} -r {args.rounds}"
        f"{' --small' if args.small else ''}` on {harness.cpu()}, {time.strftime('%Y-%m-%d')}. "
        f"{CLIENTS} clients x {TURNS} turns, a {SYSTEM_WORDS}-token system prompt of each "
        "client's own (new each round), "
        f"{USER_WORDS}-word user turns, {NEW} greedy tokens per turn. Both servers: `serve -np "
        f"4 -c {CONTEXT} --kv-cache-tokens {CONTEXT}` (a pool of about one conversation); "
        f"`tier` adds `--cache-ram {args.host_tier}`. Medians of {args.rounds} interleaved "
        "rounds after a warm-up load per server.",
        "",
        "| model | server | turn 1 TTFT p50 s | turns 2+ TTFT p50 s | chat tokens/s |",
        "|---|---|---:|---:|---:|",
    ]
    lines += each_model(args, shapes, env, tier_rows)
    text = "\n".join(lines)
    print(text)
    harness.write_result("prefix_chat_host", text, args.out)


def tier_rows(name: str, path: Path, vocab: list[str], args, env) -> list[str]:
    rng = np.random.default_rng(0)
    systems = [words(rng, SYSTEM_WORDS, vocab) for _ in range(CLIENTS)]  # a document each
    users = [[words(rng, USER_WORDS, vocab) for _ in range(TURNS)] for _ in range(CLIENTS)]
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "-m", str(path), "-np", "4",
           "-c", str(CONTEXT), "--kv-cache-tokens", str(CONTEXT)]  # fmt: skip
    servers = {
        "tier": (8444, cmd + ["--port", "8444", "--cache-ram", str(args.host_tier)]),
        "no tier": (8445, cmd + ["--port", "8445"]),
    }
    cells: dict = {(s, m): [] for s in servers for m in ("ttft1", "ttft2", "chat")}
    procs = {}
    try:
        for server, (port, command) in servers.items():
            procs[server] = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL)  # fmt: skip
            harness.wait_up(port, "/health", procs[server], timeout=900)
        for port, _ in servers.values():  # first touches
            conversation_load(port, [f"warm-up. {text}" for text in systems], users)
        for round_ in range(1, args.rounds + 1):
            order = list(servers) if round_ % 2 else list(servers)[::-1]  # each leads in turn
            for server in order:
                salt = f"round {round_}"  # a fresh conversation set per round: no stale hits
                first, later, agg = conversation_load(
                    servers[server][0], [f"{salt}. {text}" for text in systems], users
                )
                print(f"{name} round {round_} {server:8s}: turn 1 TTFT p50 "
                      f"{statistics.median(first):.3f} s, turns 2+ p50 "
                      f"{statistics.median(later):.3f} s, chat {agg:.1f} t/s",
                      flush=True)  # fmt: skip
                cells[(server, "ttft1")].append(statistics.median(first))
                cells[(server, "ttft2")].append(statistics.median(later))
                cells[(server, "chat")].append(agg)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    med = {k: statistics.median(v) for k, v in cells.items()}
    rows = [
        f"| {name} | {server} | {med[(server, 'ttft1')]:.3f} | {med[(server, 'ttft2')]:.3f} | "
        f"{med[(server, 'chat')]:.1f} |"
        for server in servers
    ]
    ratio = med[("no tier", "ttft2")] / med[("tier", "ttft2")]
    return rows + [f"| {name} | no tier / tier, turns 2+ TTFT | | {ratio:.2f}x | |"]


if __name__ == "__main__":
    main()
