"""`jaxinfer serve` over two processes on jax.distributed (127.0.0.1, 2 CPU devices each, the
mesh over all 4): the official openai client gets the greedy texts and logprobs of one
process on the same layout, with concurrent streams, a cancel and prefix hits;
nothing compiles after warmup on either process; refused requests never reach the follower;
a follower killed mid-stream ends the stream with an error event, /health turns 503, and
both processes exit; a group started again loads every process's programs from the store."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
from support.models import http_json, live_server

import jaxinfer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # two processes warm up (~1 min on 2 cores)

FLAGS = ["-np", "4", "-c", "512", "-ub", "64"]  # a small plan, the same on every server
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went", "One day, a bird"]
BAD = [  # (path, body, words of its 400), as on one process (tests/serve/test_server.py)
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n = 0"),
    ("/v1/completions", {"prompt": [5, 99999]}, "token ids must lie in [0, 512)"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs = 21 is invalid"),
    ("/v1/completions", {"prompt": "Once upon a time " * 600}, "exceeds the available context"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages must be"),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """The processes of one `jaxinfer serve` group, process 0's URL, their stderr files."""

    def __init__(self, procs, url, logs):
        self.procs, self.url, self.logs, self.port = procs, url, logs, int(url.rsplit(":", 1)[1])

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")


@contextmanager
def group(tmp_path, cache, layout: str = "tensor", flags=tuple(FLAGS), n: int = 2):
    coordinator, port = f"127.0.0.1:{_port()}", _port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_NUM_CPU_DEVICES"] = "2"
    procs, logs = [], []
    for i in range(n):
        logs.append(tmp_path / f"process{i}.log")
        cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--coordinator", coordinator,
               "--num-processes", str(n), "--process-id", str(i), "--layout", layout,
               "--port", str(port), "--compile-cache-dir", str(cache), *flags]  # fmt: skip
        with open(logs[-1], "w") as err:
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))
    g = Group(procs, f"http://127.0.0.1:{port}", logs)
    try:
        deadline = time.monotonic() + 400
        while not _healthy(g.url):
            assert time.monotonic() < deadline, g.log(0)[-3000:]
            assert all(p.poll() is None for p in procs), g.log(0)[-3000:] + g.log(1)[-3000:]
            time.sleep(0.5)
        yield g
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


def _healthy(url: str) -> bool:
    return _status(url + "/health") == 200


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("jaxinfer:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _complete(client, prompt: str) -> tuple[str, list[float]]:
    """A greedy completion streamed: its text and each token's logprob."""
    text, lps = "", []
    stream = client.completions.create(
        model="m", prompt=prompt, max_tokens=24, temperature=0, logprobs=2, stream=True
    )
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            lps += choice.logprobs.token_logprobs
    return text, lps


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("group-store")  # the second group loads what the first saved


@pytest.fixture(scope="module", params=["tensor", "layer"])
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def reference(layout):
    """The texts and logprobs one process makes: the same layout and shapes over 4 devices
    (what its server answers, tests/serve/test_server.py; no plan to warm up here)."""
    engine = jaxinfer.load(None, layout=layout, devices=4, slots=4, max_seq_len=512,
                           prefill_buckets=(64,))  # fmt: skip
    results = engine.generate(PROMPTS, max_new_tokens=24, temperature=0, logprobs=2)
    return [(r.text, [lp.logprob for lp in r.logprobs]) for r in results]


def test_two_processes_serve_as_one(tmp_path, cache, layout, reference):
    with group(tmp_path, cache, layout) as g:
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="-", max_retries=0)
        # four concurrent streams, each the one-process server's text and logprobs
        got: dict[int, tuple] = {}
        threads = [
            threading.Thread(target=lambda i=i: got.__setitem__(i, _complete(client, PROMPTS[i])))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, (text, lps) in enumerate(reference):
            assert got[i][0] == text
            assert len(got[i][1]) == len(lps)
            assert max(abs(a - b) for a, b in zip(got[i][1], lps, strict=True)) < 2e-3
        # a stream cancelled after its first piece frees its slot; the next requests run
        stream = client.completions.create(
            model="m", prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True
        )
        next(iter(stream))
        stream.close()
        # prefix hits: a long prompt twice, the second served from the cache
        long = " ".join(PROMPTS * 14)  # ~300 tokens: two full 128-token pages
        first = client.completions.create(model="m", prompt=long, max_tokens=4, temperature=0)
        again = client.completions.create(model="m", prompt=long, max_tokens=4, temperature=0)
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens >= 128
        # refused requests never reach the follower: no device call goes out for them
        calls = _metrics(g.url)["jaxinfer:lockstep_calls_total"]
        for path, body, words in BAD:
            status, error = http_json(g, "POST", path, body)
            assert status == 400 and words in error["error"]["message"], (body, error)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="m", prompt="x", temperature=-1)
        assert _metrics(g.url)["jaxinfer:lockstep_calls_total"] == calls
        # /props lists both processes and their devices; nothing compiled after warmup
        _, props = http_json(g, "GET", "/props")
        assert [p["process"] for p in props["processes"]] == [0, 1]
        assert [len(set(p["devices"])) for p in props["processes"]] == [2, 2]
        metrics = _metrics(g.url)
        assert metrics["jaxinfer:processes"] == 2
        assert metrics["jaxinfer:compiles_after_warmup_total"] == 0
        # Ctrl-C on process 0 stops the group: every process exits cleanly
        g.procs[0].send_signal(signal.SIGINT)
        for p in g.procs:
            assert p.wait(60) == 0, g.log(0)[-2000:] + g.log(1)[-2000:]
        for i in (0, 1):
            assert f"process {i}: compiles after warmup = 0" in g.log(i)
            assert f"process {i} of 2: " in g.log(i)  # its share of the weights


def _long_stream(url: str):
    """A stream of 480 tokens, its first piece read: the rest of its chunks."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    stream = client.completions.create(
        model="m", prompt=PROMPTS[1], max_tokens=480, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    return chunks


def test_a_killed_follower_ends_the_group(tmp_path, cache, stories_gguf):
    with group(tmp_path, cache) as g:
        # the group of the first test started again: every process loads its programs from
        # the executable store the first one filled, and none compiles
        metrics = _metrics(g.url)
        assert metrics["jaxinfer:programs_compiled_total"] == 0
        assert metrics["jaxinfer:executables_loaded_total"] > 0
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="-", max_retries=0)
        loaded = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=16,
                                           temperature=0)  # fmt: skip
        want = stories_gguf.generate(PROMPTS[0], max_new_tokens=16, temperature=0)
        assert loaded.choices[0].text == want.text
        failed: list = []

        def whole() -> None:  # a non-streaming request running through the kill
            try:
                client.completions.create(model="m", prompt=PROMPTS[3], max_tokens=480,
                                          extra_body={"ignore_eos": True})  # fmt: skip
            except openai.APIStatusError as e:
                failed.append(e)

        chunks = _long_stream(g.url)
        waiting = threading.Thread(target=whole)
        waiting.start()
        time.sleep(0.5)
        g.procs[1].kill()
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match="process group ended"):
            for _ in chunks:
                pass
        waiting.join(30)
        assert time.monotonic() - t0 < 30
        assert [e.status_code for e in failed] == [503]
        assert "process group ended" in failed[0].message
        # /health says 503 at once (until the server stops), then every process exits
        assert _status(g.url + "/health") in (503, None)
        for p in g.procs:
            p.wait(60 - (time.monotonic() - t0))
        assert g.procs[0].returncode != 0


def test_a_killed_leader_takes_the_followers_down(tmp_path, cache):
    with group(tmp_path, cache) as g:
        _long_stream(g.url)
        g.procs[0].kill()
        t0 = time.monotonic()
        assert g.procs[1].wait(60) != 0
        assert time.monotonic() - t0 < 60


def _run_group(tmp_path, cache, *command: str, each=((), ())) -> tuple[str, str]:
    """A CLI command over two processes (`each`: flags of one process), to the end: process
    0's stdout (jax's gloo lines left out), and both processes' stderr."""
    coordinator = f"127.0.0.1:{_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_NUM_CPU_DEVICES"] = "2"
    procs = []
    for i in (0, 1):
        cmd = [sys.executable, "-m", "jaxinfer.cli", *command, "--coordinator", coordinator,
               "--num-processes", "2", "--process-id", str(i), "--compile-cache-dir", str(cache),
               *each[i]]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    return re.sub(r"\[Gloo\][^\n]*\n", "", outs[0][0]), outs[0][1] + outs[1][1]


def test_generate_with_one_fit_plan_and_bench_over_two_processes(tmp_path, cache, stories_gguf):
    """generate's greedy text is one process's; process 1 has less memory (--fit-memory) and
    both plan with the least, so the context is cut on both (one process with process 0's
    memory keeps the whole 2048). bench gives its rows over the group."""
    want = stories_gguf.generate("Once upon a time", max_new_tokens=16, temperature=0).text
    generate = ("generate", "-v", "-p", "Once upon a time", "-n", "16", "--temp", "0", "--layout",
                "layer", "-np", "2", "-ub", "64", "--fit", "--fit-ctx", "256")  # fmt: skip
    memory = (("--fit-memory", "4096"), ("--fit-memory", "1030"))
    out, err = _run_group(tmp_path, cache, *generate, each=memory)
    assert out.strip() == "Once upon a time" + want
    plans = re.findall(r"fit: context (\d+) x 2 slots", err)
    assert len(plans) == 2 and plans[0] == plans[1] and int(plans[0]) < 2048, err[-3000:]
    out, _ = _run_group(tmp_path, cache, "bench", "-p", "16", "-n", "8", "-r", "2",
                        "--layout", "tensor", "--mem-bw", "10", "-o", "json")  # fmt: skip
    rows = json.loads(out[out.index("[") :])
    assert [(r["layout"], r["test"], r["devices"]) for r in rows] == [
        ("tensor", "pp16", 4), ("tensor", "tg8", 4)
    ]  # fmt: skip
    assert all(r["avg_ts"] > 0 for r in rows)


# ---- every feature as on one process --------------------------------------------------------

FEATURES = ["-np", "2", "-c", "1024", "-ub", "128", "--spec-type", "ngram", "--embedding",
            "--cache-ram", "64", "--kv-cache-tokens", "1536"]  # fmt: skip
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside. "
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
          "required": ["name"], "additionalProperties": False}  # fmt: skip
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city, now.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                     "required": ["city"], "additionalProperties": False},
}  # fmt: skip


def _features(url: str) -> dict:
    """What one server answers to: speculative greedy text, a json_schema chat, a forced tool
    call through Anthropic's SDK, embeddings, and prefix hits that come back from the host
    tier (the pool holds 12 pages: the long prompts between evict the first one's)."""
    import anthropic

    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    out: dict = {}
    out["ngram"] = (
        client.completions.create(model="m", prompt=STORY * 3, max_tokens=48, temperature=0)
        .choices[0]
        .text
    )
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Name a cat."}], max_tokens=24,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "cat", "schema": SCHEMA}},
    )  # fmt: skip
    out["json"] = json.loads(chat.choices[0].message.content)
    claude = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    answer = claude.messages.create(
        model="m", max_tokens=32, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "The weather in Paris?"}],
        extra_body={"temperature": 0},
    )  # fmt: skip
    out["tool"] = [(b.name, b.input) for b in answer.content if b.type == "tool_use"]
    vectors = client.embeddings.create(model="m", input=["a cat", STORY])
    out["embeddings"] = [d.embedding for d in vectors.data]
    prompts = [f"{i} {STORY * 20}" for i in range(6)]  # ~4 pages each
    for p in prompts:
        client.completions.create(model="m", prompt=p, max_tokens=2, temperature=0)
    again = client.completions.create(model="m", prompt=prompts[0], max_tokens=8, temperature=0)
    out["again"] = again.choices[0].text
    out["host_hits"] = _metrics(url)["jaxinfer:host_cache_hits_total"]
    return out


def test_every_feature_as_on_one_process(tmp_path, tmp_path_factory, cache):
    from support.models import stories_chat
    from support.templates import QWEN25

    model = stories_chat(tmp_path_factory, QWEN25)  # Hermes tool calls
    opts = dict(layout="tensor", devices=4, slots=2, max_seq_len=1024, prefill_buckets=(128,),
                speculative="ngram", embeddings=True, cache_ram_mib=64,
                kv_cache_tokens=1536)  # fmt: skip
    with live_server(lambda: jaxinfer.load(model, **opts), embedding=True) as srv:
        want = _features(srv.url)
    with group(tmp_path, cache, flags=[*FEATURES, "--model", str(model)]) as g:
        got = _features(g.url)
        assert _metrics(g.url)["jaxinfer:compiles_after_warmup_total"] == 0
    assert want["host_hits"] > 0 and got["host_hits"] > 0
    for key in ("ngram", "json", "tool", "again"):
        assert got[key] == want[key], key
    for a, b in zip(got["embeddings"], want["embeddings"], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
