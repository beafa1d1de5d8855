"""OpenAI-compatible servers side by side: `jaxinfer serve` against llama-cpp-python's server
(`python -m llama_cpp.server`) on the same GGUF and 2 threads, driven by one client script.

1, 4 and 16 concurrent streaming clients, 128 greedy tokens each (prompts whose greedy
continuation runs 128 tokens without EOS, so every request makes the same number of tokens).
Aggregate tokens/s (all tokens / wall time from the first request to the last token) and time
to first token (send to the first text chunk) p50 / p95. Both servers stay up; the
(server, clients) cells take turns round after round; the first round is a warm-up and dropped;
medians over the rest. Every streamed text is checked against jaxinfer's `Engine.generate`.

The peer: llama-cpp-python 0.3.x's server, its defaults apart from n_threads = n_threads_batch,
n_ctx = 2048 and `--interrupt_requests False` (by default a request that arrives ends the
running stream early, which would hand the peer shorter answers). It serves one request at a
time: that is how it is built. It runs twice: with 2 threads, as asked, and with 1 thread, its
steadier setting on 2 cores (its OpenMP threads, called from whichever worker thread serves the
request, slow down badly once requests have overlapped). The ratio is against the faster of
the two in each cell. jaxinfer runs 4 slots.
Writes benchmarks/results/serve.md.
Usage: python benchmarks/serve.py [-r 3] [--model PATH]
"""

import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import harness

import jaxinfer

PROMPTS = [
    "Once upon a time", "One day", "Tom and Lily", "The little dog", "Sara had a",
    "There was a big", "Ben liked to", "In the park", "The sun was", "Mom said", "A cat",
    "The girl", "Tim was", "Lucy loved", "The bird", "Max and",
]  # fmt: skip
N_TOKENS = 128
CLIENTS = (1, 4, 16)
PEERS = ("llama-cpp-python -t 2", "llama-cpp-python -t 1")


def request(port: int, prompt: str) -> tuple[float, float, float, str]:
    """(start, first text, end, text) of one streamed greedy completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    # repeat_penalty 1 (off) for both: llama-cpp-python's own default is 1.1
    body = {"model": "m", "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0,
            "repeat_penalty": 1.0, "stream": True}  # fmt: skip
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    first, text = None, []
    for line in response:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            if line == b"data: [DONE]":
                break
            continue
        piece = json.loads(line[6:])["choices"][0].get("text") or ""
        if piece and first is None:
            first = time.perf_counter()
        text.append(piece)
    end = time.perf_counter()
    conn.close()
    return start, first or end, end, "".join(text)


def run(port: int, clients: int, offset: int) -> tuple[float, list[float], list[str]]:
    """Aggregate tokens/s, every client's TTFT and texts for `clients` at once."""
    out: list = [None] * clients
    prompts = [PROMPTS[(offset + k) % len(PROMPTS)] for k in range(clients)]

    def one(k):
        out[k] = request(port, prompts[k])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(o[2] for o in out) - min(o[0] for o in out)
    return (
        clients * N_TOKENS / wall,
        [o[1] - o[0] for o in out],
        list(zip(prompts, (o[3] for o in out), strict=True)),
    )


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def main():
    ap = harness.parser(__doc__, 3)
    ap.add_argument("--model", default=str(harness.STORIES))
    args = ap.parse_args()
    harness.require_llama_cpp()

    engine = jaxinfer.load(args.model, max_seq_len=2048)
    want = {p: engine.generate(p, max_new_tokens=N_TOKENS, temperature=0) for p in PROMPTS}
    assert all(len(r.token_ids) == N_TOKENS for r in want.values()), "a prompt hit EOS early"
    del engine

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def peer(port, threads):
        return (port, "/v1/models", [sys.executable, "-m", "llama_cpp.server", "--model",
                args.model, "--port", str(port), "--n_threads", threads, "--n_threads_batch",
                threads, "--n_ctx", "2048", "--interrupt_requests", "False", "--verbose",
                "False"])  # fmt: skip

    servers = {
        "jaxinfer": (8431, "/health", [sys.executable, "-m", "jaxinfer.cli", "serve", "-m",
                     args.model, "--port", "8431", "-np", "4", "-c", "2048"]),
        PEERS[0]: peer(8432, "2"),
        PEERS[1]: peer(8433, "1"),
    }  # fmt: skip
    procs = {}
    try:
        for name, (port, path, cmd) in servers.items():
            procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL)  # fmt: skip
            harness.wait_up(port, path, procs[name])
        results = {(s, c): {"agg": [], "p50": [], "p95": []} for s in servers for c in CLIENTS}
        agree = {s: [0, 0] for s in servers}
        for round_ in range(args.rounds + 1):
            names = list(servers)
            order = names[round_ % 3 :] + names[: round_ % 3]  # each leads in turn
            for clients in CLIENTS:
                for name in order:
                    agg, ttft, texts = run(servers[name][0], clients, round_)
                    for prompt, text in texts:
                        agree[name][0] += text == want[prompt].text
                        agree[name][1] += 1
                    if round_ == 0:
                        continue
                    cell = results[(name, clients)]
                    cell["agg"].append(agg)
                    cell["p50"].append(pct(ttft, 50))
                    cell["p95"].append(pct(ttft, 95))
                    p50, p95 = pct(ttft, 50), pct(ttft, 95)
                    print(f"round {round_} {name:22s} {clients:2d} clients: {agg:8.1f} t/s, "
                          f"TTFT p50 {p50:.3f} s p95 {p95:.3f} s", flush=True)  # fmt: skip
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)

    med = {k: {m: statistics.median(v) for m, v in cell.items()} for k, cell in results.items()}
    rows = [
        "| clients | jaxinfer t/s | peer -t 2 t/s | peer -t 1 t/s | ratio (vs the faster) | "
        "jaxinfer TTFT p50 / p95 s | peer -t 2 TTFT p50 / p95 s | peer -t 1 TTFT p50 / p95 s |",
        "|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for c in CLIENTS:
        j, p2, p1 = (med[(name, c)] for name in servers)
        best = max(p2["agg"], p1["agg"])
        rows.append(
            f"| {c} | {j['agg']:.0f} | {p2['agg']:.0f} | {p1['agg']:.0f} | "
            f"{j['agg'] / best:.2f}x | "
            + " | ".join(f"{x['p50']:.3f} / {x['p95']:.3f}" for x in (j, p2, p1))
            + " |"
        )
    import llama_cpp

    lines = [
        "# OpenAI-compatible servers: jaxinfer serve vs llama-cpp-python's server",
        "",
        f"`python benchmarks/serve.py -r {args.rounds}` on {platform.node()} ({os.cpu_count()} "
        f"cores), {time.strftime('%Y-%m-%d')}; model `{Path(args.model).name}`; "
        f"llama-cpp-python {llama_cpp.__version__}, jaxinfer {jaxinfer.__version__}.",
        "Streaming completions of 128 greedy tokens per client; medians of "
        f"{args.rounds} interleaved rounds after a warm-up round. jaxinfer: `-np 4 -c 2048`; "
        "peer (llama-cpp-python's server): `--n_threads T --n_threads_batch T --n_ctx 2048 "
        "--interrupt_requests False`, T = 2 and 1 (one request at a time, as it is built).",
        "",
        *rows,
        "",
        "Texts equal to jaxinfer's `Engine.generate` greedy output: "
        + ", ".join(f"{s} {a}/{n}" for s, (a, n) in agree.items())
        + ".",
    ]
    print("\n".join(lines))
    harness.write_result("serve", "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
