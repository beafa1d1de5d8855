"""Noisy neighbours: what one abusive client costs a steady one on the same `jaxinfer serve`.

A steady client sends greedy 16-token completions one after another (at least 20 per phase)
to a server with 4 slots over a 2-layer random model with a 32k vocabulary (its per-token
vocabulary work is a real model's). Phases: quiet (the steady client alone), then each
abusive request of the list below running in a loop beside it, then all of them at once. For
each phase: the steady client's p50 and p99 latency, and the server's peak RSS (VmHWM) growth
over its size after the quiet phase. Each abusive request is one a careless or hostile client
can send within the server's default limits (the refused ones are refused within them):

- echo + logprobs of a 3,000-token prompt (logprobs 5), the whole prompt scored;
- 128 choices (8 prompts x n 16), 16 tokens each: the most max_choices allows;
- n 32 under a large JSON schema (200 properties): the grammar compiled per job;
- 16 stop strings of 256 characters that never match;
- a grammar that forces runs of incomplete UTF-8 (byte tokens) for 400 tokens;
- a 15 MiB /tokenize body (just under max_body_mib; 400: past what the context holds), and
  a 17 MiB one (413);
- a body that trickles in (1 byte a second), and a stream that is never read;
- 100 prompts x n 128 and a JSON body nested 100,000 deep (both refused: 400).

Targets (issue 47): steady p99 with everything at once <= 3x its quiet p99 + 0.5 s; server
peak RSS growth < 500 MB. A last phase runs all but the two bodies of 15 and 17 MiB, whose
JSON parsing (the GIL's) weighs most. Writes benchmarks/results/noisy.md.
Usage: python benchmarks/noisy.py [--requests 20] [--phases "all at once;echo"]
    [--serve-args "--time-slice-ms 50"]
"""

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness

SLOTS = 4
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
SCHEMA = {"type": "object", "properties": {f"p{k}": {"type": "string", "maxLength": 8}
                                           for k in range(200)}}  # fmt: skip


def call(port: int, method: str, path: str, body=None, timeout=600) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    try:
        conn.request(method, path, body=data)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def steady(port: int, count: int) -> list[float]:
    """Seconds of `count` greedy 16-token completions, one after another."""
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        status, answer = call(port, "POST", "/v1/completions", body)
        assert status == 200, answer[:300]
        out.append(time.perf_counter() - t0)
    return out


def abusive(port: int, vocab_text: str) -> dict:
    """name -> a function that sends one abusive request and returns its status."""
    long_prompt = list(range(100, 3100))  # 3,000 token ids

    def post(body, path="/v1/completions"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()  # encoded once
        return lambda: call(port, "POST", path, data)[0]

    def trickle():
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n")
        for _ in range(5):  # 5 s of 1 byte a second, then the client leaves
            time.sleep(1)
            sock.sendall(b"{")
        sock.close()
        return 0

    def unread():
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"prompt": "Once", "max_tokens": 256, "n": 4, "stream": True,
                           "ignore_eos": True}).encode()  # fmt: skip
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)  # fmt: skip
        time.sleep(5)  # never reads
        sock.close()
        return 0

    return {
        "echo + logprobs, 3,000 tokens": post(
            {"prompt": long_prompt, "echo": True, "logprobs": 5, "max_tokens": 1}
        ),
        "128 choices": post({"prompt": ["Once upon a time"] * 8, "n": 16, "max_tokens": 16}),
        "n 32, large schema": post(
            {"prompt": "{", "n": 32, "max_tokens": 16, "json_schema": SCHEMA}
        ),
        "16 stop strings of 256": post(
            {
                "prompt": "Once",
                "max_tokens": 64,
                "ignore_eos": True,
                "stop": [f"{k:02d}" + "z" * 254 for k in range(16)],
            }
        ),
        "incomplete UTF-8 runs": post(
            {"prompt": "Once", "max_tokens": 400, "grammar": "root ::= [\\x80-\\xbf]*"}
        ),
        "15 MiB /tokenize (400)": post(
            {"content": vocab_text * ((15 << 20) // len(vocab_text))}, "/tokenize"
        ),
        "17 MiB body (413)": post(b'{"content": "' + b"a " * (17 << 19) + b'"}', "/tokenize"),
        "trickled body": trickle,
        "unread stream": unread,
        "100 prompts x n 128 (400)": post({"prompt": ["x"] * 100, "n": 128}),
        "nested 100,000 deep (400)": post(b'{"prompt": ' + b"[" * 10**5 + b"]" * 10**5 + b"}"),
    }


def vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM")


def phase(port: int, count: int, loads: list) -> tuple[list[float], list]:
    """The steady client's latencies while each of `loads` runs in a loop on its own thread."""
    stop, statuses = threading.Event(), []

    def loop(fn):
        while not stop.is_set():
            statuses.append(fn())

    threads = [threading.Thread(target=loop, args=(fn,), daemon=True) for fn in loads]
    for t in threads:
        t.start()
    time.sleep(0.5 if loads else 0)
    try:
        return steady(port, count), statuses
    finally:
        stop.set()
        for t in threads:
            t.join(120)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--requests", type=int, default=20, help="steady requests per phase")
    ap.add_argument(
        "--phases",
        help="only the phases whose names hold one of these (separated by ';'); "
        "the quiet one always runs",
    )
    ap.add_argument("--serve-args", default="", help="more `jaxinfer serve` flags (one string)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = harness.write_random_gguf(
            Path(tmp) / "m.gguf", d_model=256, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=768,
            vocab=32000, name="2-layer, 32k vocabulary (random)", chat_template=TEMPLATE,
        )  # fmt: skip
        port = 18000 + os.getpid() % 1000
        server = subprocess.Popen(
            [sys.executable, "-m", "jaxinfer.cli", "serve", "-m", str(model), "--port", str(port),
             "-np", str(SLOTS), "-c", "4096", *args.serve_args.split()],
            env=harness.worker_env(), stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            harness.wait_up(port, "/health", server)
            vocab_text = "Once upon a time there was a little girl. "
            loads = abusive(port, vocab_text)
            steady(port, 5)  # warm
            rows, all_lat = [], {}
            quiet, _ = phase(port, args.requests, [])
            base_rss = vm_hwm(server.pid)
            all_lat["quiet"] = quiet
            small = [fn for name, fn in loads.items() if "MiB" not in name]
            phases = [*((name, [fn]) for name, fn in loads.items()),
                      ("all at once", list(loads.values())),
                      ("all at once but the MiB bodies", small)]  # fmt: skip
            if args.phases:
                wanted = [w.strip() for w in args.phases.split(";") if w.strip()]
                phases = [p for p in phases if any(w in p[0] for w in wanted)]
            for name, chosen in phases:
                lat, statuses = phase(port, args.requests, chosen)
                all_lat[name] = lat
                grew = (vm_hwm(server.pid) - base_rss) / 2**20
                codes = sorted({s for s in statuses if s})
                rows.append((name, lat, grew, codes))
                print(name, f"p99 {max(lat):.2f}", f"+{grew:.0f} MiB", codes, flush=True)
        finally:
            server.terminate()
            server.wait(60)

    def pct(values, q):
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1]

    q50, q99 = pct(quiet, 50), pct(quiet, 99)
    lines = [
        "# Noisy neighbours: a steady client's latency beside abusive requests "
        f"({time.strftime('%Y-%m-%d')})",
        "",
        f"`jaxinfer serve`, {SLOTS} slots, a 2-layer random model with a 32k vocabulary, "
        "default limits; the steady client sends greedy 16-token completions one after "
        f"another, {args.requests} per phase. Quiet: p50 {q50:.3f} s, p99 {q99:.3f} s.",
        "",
        "| abusive request (in a loop) | its statuses | steady p50 s | steady p99 s | "
        "p99 / (3 x quiet p99 + 0.5 s) | server VmHWM growth MiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, lat, grew, codes in rows:
        p99 = pct(lat, 99)
        lines.append(f"| {name} | {', '.join(map(str, codes)) or '-'} | {pct(lat, 50):.3f} | "
                     f"{p99:.3f} | {p99 / (3 * q99 + 0.5):.2f} | {grew:.0f} |")  # fmt: skip
    harness.write_result("noisy", "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
