"""One request cannot hurt another: the server's limits (ServerOptions, `serve` flags, /props)
refuse what would cost other clients more than a bounded delay, each with a one-line error
naming the limit; bodies are capped while they arrive and must arrive within `timeout`; a
template's own runtime error and a schema nested too deeply are 400s, not 500s."""

import http.client
import json
import socket
import time

import pytest
from support.models import STORIES, live_server, model_path, stories_chat, wait_for

import jaxinfer
from jaxinfer.serve.tools import check_tools
from jaxinfer.serve.worker import QueueFull, Task

PLAN = dict(slots=2, prefill_buckets=(32, 128), batch_buckets=(1,))
# a template that adds a message's name to text: name 5 is a TypeError inside jinja
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.name %}{{ m.name + ': ' }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %} "
    "{{ m['content'] }}{% endif %}{% endfor %}"
)
LIMITS = dict(max_body_mib=1, max_choices=8, max_stop_strings=4, max_grammar_kib=32, max_queue=4,
              n_predict=5, timeout=2.0)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = stories_chat(tmp_path_factory, TEMPLATE)
    with live_server(lambda: jaxinfer.load(model, **PLAN), **LIMITS) as srv:
        yield srv


def post(server, path: str, body, headers=None) -> tuple[int, dict, dict]:
    """(status, headers, JSON answer) of one POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, body=data, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        conn.close()


def refused(server, body, path="/v1/completions") -> tuple[int, str]:
    status, _, answer = post(server, path, body)
    message = answer["error"]["message"]
    assert "\n" not in message and answer["error"]["code"] == status
    return status, message


def test_a_body_over_max_body_mib_is_a_413_by_length_or_while_it_arrives(server):
    big = json.dumps({"prompt": "a " * (600 << 10)}).encode()  # 1.2 MiB
    status, message = refused(server, big)
    assert status == 413 and "max_body_mib (1)" in message
    # chunked: no Content-Length, the running count refuses it
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    sock.sendall(head)
    try:
        for k in range(0, len(big), 64 << 10):
            piece = big[k : k + (64 << 10)]
            sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
    except OSError:
        pass  # the server answered and closed while the body was still coming
    answer = sock.recv(4096)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_a_body_that_trickles_in_is_a_408_within_the_timeout(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    answer = sock.recv(4096)  # the server gives up after `timeout` (2 s)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - t0 < 2.0 + 5


def test_choices_stops_and_grammars_over_their_limits_are_400s(server):
    cases = [
        ({"prompt": ["x"] * 9}, "9 choices, over this server's max_choices (8)"),
        ({"prompt": ["x"] * 3, "n": 3}, "max_choices (8)"),
        (
            {"prompt": "x", "stop": list("abcde")},
            "stop has 5 strings, over this server's max_stop_strings (4)",
        ),
        ({"prompt": "x", "stop": ["y" * 257]}, "stop string of 257 characters"),
        ({"prompt": "x", "grammar": 'root ::= "' + "a" * 40_000 + '"'}, "max_grammar_kib (32)"),
        ({"prompt": "x", "json_schema": {"enum": ["a" * 40_000]}}, "json_schema is 39 KiB"),
    ]
    for body, words in cases:
        status, message = refused(server, body)
        assert status == 400 and words in message, (str(body)[:80], message)
    tools = [{"type": "function", "function": {"name": f"f{k}", "description": "d" * 1000}}
             for k in range(50)]  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    status, message = refused(server, chat, "/v1/chat/completions")
    assert status == 400 and "tools is" in message and "max_grammar_kib (32)" in message


def test_n_predict_caps_max_tokens_and_props_lists_the_limits(server):
    body = {"prompt": "Once upon a time", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    status, _, answer = post(server, "/v1/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 5
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/props")
    limits = json.loads(conn.getresponse().read())["limits"]
    conn.close()
    assert limits == {**LIMITS, "max_stop_length": 256}


def test_template_runtime_errors_and_deep_schemas_are_400s(server):
    chat = {"messages": [{"role": "user", "content": "hi", "name": 5}]}
    status, message = refused(server, chat, "/v1/chat/completions")
    assert status == 400 and "chat template failed" in message
    deep = '{"type": "array", "items": ' * 970 + "{}" + "}" * 970
    status, message = refused(server, b'{"prompt": "x", "json_schema": ' + deep.encode() + b"}")
    assert status == 400 and ("nested too deeply" in message or "recursion limit" in message)
    ok = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
    assert post(server, "/v1/completions", ok)[0] == 200  # and the server goes on


def test_duplicate_tool_names_are_found_in_linear_time():
    tools = [{"type": "function", "function": {"name": f"f{k}"}} for k in range(60_000)]
    t0 = time.perf_counter()
    check_tools({"tools": tools})  # quadratic: minutes
    assert time.perf_counter() - t0 < 10
    with pytest.raises(jaxinfer.RequestError, match=r"tools\[2\]\.function\.name = 'f0' is given"):
        check_tools({"tools": tools[:2] + tools[:1]})


def test_a_non_ascii_api_key_is_refused_at_start():
    with pytest.raises(jaxinfer.JaxinferError, match="--api-key must be ASCII"):
        jaxinfer.ServerOptions(api_key="clé")
    with pytest.raises(jaxinfer.JaxinferError, match="--max-queue 0 is invalid"):
        jaxinfer.ServerOptions(max_queue=0)


def test_over_max_queue_is_a_429_with_retry_after(server):
    status, headers, answer = post(server, "/v1/completions", {"prompt": "x", "n": 5})
    assert status == 429 and headers["retry-after"] == "1"
    assert "over this server's max_queue (4)" in answer["error"]["message"]


def test_a_task_is_refused_when_the_engine_queue_is_full():
    """Choices already queued on the engine (submitted, not yet admitted) count: a task
    that would pass max_queue is refused whole, and nothing of it is submitted."""
    import asyncio

    engine = jaxinfer.load(model_path(STORIES), max_seq_len=64, slots=1)
    waiting = [engine.submit([1, 2, 3], max_new_tokens=2) for _ in range(3)]

    async def task(n):
        return Task([([1, 2], jaxinfer.SamplingParams(max_new_tokens=2))] * n, stream=False,
                    max_queue=4)  # fmt: skip

    with pytest.raises(QueueFull, match=r"3 choices wait .* adds 2, over .* max_queue \(4\)"):
        asyncio.run(task(2)).submit(engine)
    assert engine.activity()["queued"] == 3
    made = asyncio.run(task(1)).submit(engine)
    assert len(made) == 1 and engine.activity()["queued"] == 4
    for r in [*waiting, *made]:
        r.cancel()


@pytest.mark.slow
def test_with_every_abusive_request_at_once_health_answers_within_a_second(tmp_path_factory):
    """Each abusive request of issue 47 in a loop on its own thread, all at once, for 20 s:
    /health answers within 1 s throughout (but for one stalled answer); afterwards nothing is
    held (metrics and kv_stats) and a greedy completion is what it was before."""
    import threading

    model = stories_chat(tmp_path_factory, TEMPLATE)
    with live_server(lambda: jaxinfer.load(model, slots=4), timeout=3.0) as srv:
        port = srv.port
        quiet = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
        before = post(srv, "/v1/completions", quiet)[2]["choices"][0]["text"]

        def raw(head: bytes, wait: float) -> None:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(head)
            time.sleep(wait)  # a trickle that stops, or a stream never read
            sock.close()

        stream = json.dumps({"prompt": "Once", "max_tokens": 400, "n": 4, "stream": True,
                             "ignore_eos": True}).encode()  # fmt: skip
        abusive = [
            lambda: post(srv, "/v1/completions", {"prompt": list(range(3, 503)), "echo": True,
                                                  "logprobs": 5, "max_tokens": 1}),
            lambda: post(srv, "/v1/completions", {"prompt": ["Once"] * 8, "n": 16,
                                                  "max_tokens": 16}),
            lambda: post(srv, "/v1/completions", {"prompt": "{", "n": 32, "max_tokens": 8,
                                                  "json_schema": {"type": "object", "properties":
                                                  {f"p{k}": {"type": "string"}
                                                   for k in range(100)}}}),
            lambda: post(srv, "/v1/completions", {"prompt": "Once", "max_tokens": 64,
                                                  "stop": ["z" * 256] * 16}),
            lambda: post(srv, "/v1/completions", {"prompt": "Once", "max_tokens": 300,
                                                  "grammar": "root ::= [\\x80-\\xbf]*"}),
            lambda: post(srv, "/tokenize", {"content": "Once upon a time. " * (800 << 10)}),
            lambda: post(srv, "/v1/completions", {"prompt": ["x"] * 100, "n": 128}),
            lambda: post(srv, "/v1/completions", b'{"prompt": ' + b"[" * 10**5 + b"]" * 10**5
                         + b"}"),
            lambda: raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n"
                        b"\r\n{", 4),
            lambda: raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                        % len(stream) + stream, 4),
        ]  # fmt: skip
        stop, failures = threading.Event(), []

        def loop(fn):
            while not stop.is_set():
                try:
                    fn()
                except Exception as e:  # a refusal is an answer; an exception is not
                    failures.append(repr(e))

        threads = [threading.Thread(target=loop, args=(fn,), daemon=True) for fn in abusive]
        for t in threads:
            t.start()
        answers, start = [], time.monotonic()  # (seconds into the run, seconds to answer)
        while time.monotonic() < start + 20:
            t0 = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            conn.close()
            answers.append((round(t0 - start, 1), round(time.monotonic() - t0, 2)))
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(120)
        assert not failures, failures[:3]
        # Each abusive request repeats for the whole run, so one that blocked the event loop
        # would delay answer after answer. A loaded 2-core machine may stall any one answer
        # (one of 150 took 5.3 s once, beside the multi-process server tests): one may.
        slow = [a for a in answers if a[1] >= 1.0]
        assert len(slow) <= 1, slow

        def idle() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            conn.close()
            values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                      if line and not line.startswith("#")}  # fmt: skip
            names = ("jaxinfer:slots_busy", "jaxinfer:requests_deferred",
                     "jaxinfer:kv_cache_pages_used")  # fmt: skip
            return all(values[n] == 0 for n in names)

        assert wait_for(idle, 60)
        stats = srv.worker.call(lambda engine: engine.kv_stats()).result(60)
        assert stats.get("snapshots_in_use", 0) == 0 and stats["pages_in_use"] == 0
        assert post(srv, "/v1/completions", quiet)[2]["choices"][0]["text"] == before


def test_an_echoed_prompt_is_scored_one_chunk_at_a_time():
    """A task's echo runs in pieces (Task.steps), one prompt chunk each, so that the worker
    steps other requests between them; the pieces' answer equals prompt_logprobs'."""
    import asyncio

    engine = jaxinfer.load(model_path(STORIES), max_seq_len=512, prefill_buckets=(32, 128))
    ids = list(range(3, 400))  # 397 tokens: four chunks of at most 128

    async def task():
        return Task([(ids, jaxinfer.SamplingParams(max_new_tokens=1))], stream=False,
                    echo=[ids], logprobs=3)  # fmt: skip

    t = asyncio.run(task())
    steps, pieces = t.steps(engine), 0
    while True:
        try:
            next(steps)
            pieces += 1
        except StopIteration as done:
            made = done.value
            break
    assert pieces >= 4 and len(made) == 1
    assert t.echoed[0][1] == engine.prompt_logprobs(ids, 3)
    made[0].cancel()


def test_a_stream_whose_reader_stops_ends_and_closes_its_events():
    """A send that never completes (a client that stopped reading, its socket full) ends the
    stream after `timeout` and closes its events generator, whose `finally` cancels the
    stream's requests in the server."""
    import asyncio

    from jaxinfer.serve.server import _Stream

    closed = []

    async def events():
        try:
            while True:
                yield "data: {}\n\n"
        finally:
            closed.append(True)

    async def stalled(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)

    async def main():
        t0 = time.monotonic()
        await _Stream(events(), 0.3, media_type="text/event-stream").stream_response(stalled)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5 and closed == [True]
