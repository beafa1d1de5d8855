"""`jaxinfer serve` against a live server on 127.0.0.1, driven by the official openai client
and raw HTTP: greedy texts equal `Engine.generate()`, streams join to the same text, chat
renders the template as transformers' apply_chat_template does, 16 clients share 4 slots, a
dropped client frees its slot, bad requests get 400s while the others complete, nothing
compiles after warmup, and /health goes 503 -> 200."""

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.models import client_of, live_server, stories_chat, wait_for

import jaxinfer
from jaxinfer.cli import main
from jaxinfer.errors import RequestError
from jaxinfer.formats import gguf_file
from jaxinfer.formats.tokenizer import Tokenizer
from jaxinfer.serve.chat import ChatTemplate, check_messages
from jaxinfer.serve.thinking import opened, thinking_tags

openai = pytest.importorskip("openai")

# A Llama-2 style template: bos_token, roles, eos_token between turns, a generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}"
    "<</SYS>>{% elif m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]{% else %} "
    "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %} "
    "Once upon a time{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be kind."},
    {"role": "user", "content": "Tell me a story about a cat."},
    {"role": "assistant", "content": "Once upon a time, there was a cat."},
    {"role": "user", "content": [{"type": "text", "text": "More!"}]},
]
PROMPTS = [
    f"Once upon a time, {who} {what}"
    for who in ("there was a little girl", "a big dog", "Tim and Sue", "a tiny bird")
    for what in ("who loved", "went to the park", "saw a", "said")
]  # 16


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return stories_chat(tmp_path_factory, TEMPLATE)  # Llama-2 style


@pytest.fixture(scope="module")
def server(chat_model):
    opts = dict(slots=4, prefill_buckets=(32, 128), batch_buckets=(1,))  # a small plan
    with live_server(lambda: jaxinfer.load(chat_model, **opts)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return client_of(server)


def metrics(server) -> dict:
    """{(name, labels...): value} from /metrics."""
    status, text = raw(server, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.values()))] = s.value
    return out


def raw(server, method: str, path: str, body=None, headers=None, port=None):
    """(status, text) of one plain HTTP request; `body` may be a dict or raw bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", port or server.port, timeout=120)
    data = json.dumps(body).encode() if isinstance(body, dict | list) else body
    conn.request(method, path, body=data, headers=headers or {})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, text


# ---- completions -------------------------------------------------------------------------


def test_greedy_completion_equals_engine_generate(client, stories_hf):
    for prompt in PROMPTS[:3]:
        want = stories_hf.generate(prompt, max_new_tokens=48, temperature=0).text
        r = client.completions.create(model="x", prompt=prompt, max_tokens=48, temperature=0)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
        ids = stories_hf.tokenize(prompt)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 48)
        stream = client.completions.create(
            model="x", prompt=prompt, max_tokens=48, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "length"


def test_token_prompts_batches_and_n(client, stories_hf):
    """Token-id prompts (stories260K's published greedy ids from BOS), a list of prompts, and
    n choices: greedy choices agree; seeded sampled choices follow their seeds."""
    from support.models import GOLDEN

    r = client.completions.create(model="x", prompt=[1], max_tokens=64, temperature=0)
    assert r.choices[0].text == stories_hf.detokenize(GOLDEN)
    r = client.completions.create(model="x", prompt=PROMPTS[:2], max_tokens=8, temperature=0, n=2)
    want = [stories_hf.generate(p, max_new_tokens=8, temperature=0).text for p in PROMPTS[:2]]
    assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    sampled = [stories_hf.generate(PROMPTS[0], seed=7 + i, **kw).text for i in range(2)]
    r = client.completions.create(
        model="x", prompt=PROMPTS[0], max_tokens=16, n=2, seed=7, temperature=1.0,
        top_p=1.0, extra_body={"top_k": 0, "min_p": 0.0},
    )  # fmt: skip
    assert [c.text for c in r.choices] == sampled and sampled[0] != sampled[1]


def test_stop_strings_and_raw_sse(server, stories_hf):
    want = stories_hf.generate(PROMPTS[0], max_new_tokens=48, temperature=0, stop=["park"])
    body = {"prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0, "stop": ["park"],
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    status, text = raw(server, "POST", "/v1/completions", body)
    assert status == 200
    events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want.text
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == want.finish_reason == "stop" and set(finals[:-1]) == {None}
    assert chunks[-1]["usage"]["completion_tokens"] == len(want.token_ids)


# ---- chat --------------------------------------------------------------------------------


def test_chat_template_matches_transformers(chat_model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_model))
    ours = ChatTemplate(TEMPLATE, Tokenizer.from_hf_dir(chat_model))
    messages = check_messages(MESSAGES)
    for generation in (True, False):
        kw = dict(add_generation_prompt=generation)
        text = hf.apply_chat_template(messages, tokenize=False, **kw)
        assert ours.render(messages, **kw) == text
        ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
        assert ours.encode(messages, **kw) == list(ids)
        assert ids.count(1) == 1  # one BOS: the template's (the tokenizer adds none twice)


def test_continue_final_message_cuts_as_transformers(chat_model):
    """continue_final_message ends the text after the last message's content as transformers
    cuts it (trailing blanks kept where the template keeps them); content the template does
    not write as given is a one-line RequestError."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_model))
    ours = ChatTemplate(TEMPLATE, Tokenizer.from_hf_dir(chat_model))
    for role, content in [("assistant", "Once upon"), ("assistant", "Once upon  "),
                          ("user", "  More!  "), ("assistant", "")]:  # fmt: skip
        messages = check_messages([*MESSAGES[:2], {"role": role, "content": content}])
        kw = dict(add_generation_prompt=False, continue_final_message=True)
        text = hf.apply_chat_template(messages, tokenize=False, **kw)
        assert ours.render(messages, **kw) == text and text.rstrip().endswith(content.strip())
    # thinking templates: the prefill continues the answer (the prompt opens no reasoning)
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    messages = check_messages([*MESSAGES[1:2], {"role": "assistant", "content": "Once upon"}])
    for name in ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "Qwen3.5-4B.jinja"):
        source = (Path(__file__).parents[1] / "fixtures" / "templates" / name).read_text()
        ours = ChatTemplate(source, Tokenizer.byte_level())
        (text,), _ = utils.render_jinja_template(
            conversations=[messages], chat_template=source, bos_token="<s>", eos_token="</s>",
            **kw,
        )  # fmt: skip
        assert ours.render(messages, **kw) == text and text.endswith("Once upon")
        tags = thinking_tags(source)
        assert tags is not None and not opened(text, tags)
    messages = check_messages([{"role": "assistant", "content": "Once"}])
    for source in ("{{ messages[-1].content | upper }}", "{{ messages[-1].role }}"):
        with pytest.raises(RequestError) as e:
            ChatTemplate(source, ours.tokenizer).render(messages, **kw)
        assert "does not write the final message's content" in str(e.value)
        assert "\n" not in str(e.value)


def test_chat_completion(client, chat_model, stories_hf):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_model))
    ids = hf.apply_chat_template(check_messages(MESSAGES), add_generation_prompt=True,
                                 tokenize=True, return_dict=False)  # fmt: skip
    want = stories_hf.generate(list(ids), max_new_tokens=40, temperature=0).text
    r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.object == "chat.completion"
    stream = client.chat.completions.create(
        model="x", messages=MESSAGES, max_completion_tokens=40, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_gguf_chat_template_is_read(tmp_path):
    from support.checkpoints import TINY, random_weights, write_gguf

    config = TINY["llama"]
    path = write_gguf(tmp_path / "t.gguf", config, random_weights(config), chat_template=TEMPLATE)
    assert Tokenizer.from_gguf(gguf_file.read(path).fields, path).chat_template == TEMPLATE


def test_check_messages_refuses_bad_messages():
    for bad, words in [
        ([], "non-empty list"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
        ("hello", "non-empty list"),
    ]:
        with pytest.raises(jaxinfer.RequestError, match=re.escape(words)):
            check_messages(bad)


# ---- concurrency, cancellation, errors ---------------------------------------------------


def test_sixteen_streaming_clients_on_four_slots(server, client, stories_hf):
    want = [r.text for r in stories_hf.generate(PROMPTS, max_new_tokens=40, temperature=0)]
    before = metrics(server)
    got: dict[int, str] = {}
    deferred = []

    def one(k):
        stream = client.completions.create(
            model="x", prompt=PROMPTS[k], max_tokens=40, temperature=0, stream=True
        )
        got[k] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        deferred.append(metrics(server)[("jaxinfer:requests_deferred",)])
    for t in threads:
        t.join()
    assert [got[k] for k in range(16)] == want
    after = metrics(server)
    assert max(deferred) > 0  # requests queued behind the 4 slots
    assert after[("jaxinfer:requests_total", "length")] - before.get(
        ("jaxinfer:requests_total", "length"), 0) == 16  # fmt: skip
    assert after[("jaxinfer:compiles_after_warmup_total",)] == 0
    # the plan was compiled, or loaded from the session's executable store, once
    built = [after[(f"jaxinfer:{n}_total",)] for n in ("programs_compiled", "executables_loaded")]
    assert sum(built) == len(server.worker.engine.compile_plan())
    for kind in ("same_shape", "changed_shape"):
        assert after[("jaxinfer:recompiles_total", kind)] == 0
    assert after[("jaxinfer:slots_busy",)] == 0 and after[("jaxinfer:kv_cache_pages_used",)] == 0


def _cancelled(server) -> float:
    return metrics(server).get(("jaxinfer:requests_total", "cancelled"), 0)


def test_dropped_clients_free_their_slots(server):
    body = {"prompt": PROMPTS[1], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    for stream in (True, False):
        cancelled, predicted = (
            _cancelled(server),
            metrics(server)[("jaxinfer:tokens_predicted_total",)],
        )
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": stream}))
        if stream:
            response = conn.getresponse()
            assert response.status == 200 and response.readline().startswith(b"data: ")
        else:
            assert wait_for(lambda: metrics(server)[("jaxinfer:slots_busy",)] == 1)
        _drop(conn)  # the client goes away mid-generation
        assert wait_for(lambda c=cancelled: _cancelled(server) == c + 1)
        m = metrics(server)
        assert m[("jaxinfer:slots_busy",)] == 0 and m[("jaxinfer:kv_cache_pages_used",)] == 0
        assert m[("jaxinfer:tokens_predicted_total",)] - predicted < 1000  # stopped early


def _open_stream(server, body) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
    return conn


def _drop(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_dropped_queued_client_leaves_the_queue(server):
    """Four long streams hold the slots; a fifth waits in the queue; dropping it removes it
    from the queue (it never runs), then dropping the four frees every slot."""
    body = {"prompt": PROMPTS[4], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    cancelled = _cancelled(server)
    running = [_open_stream(server, body) for _ in range(4)]
    for conn in running:
        assert conn.getresponse().readline().startswith(b"data: ")
    queued = _open_stream(server, body)
    assert wait_for(lambda: metrics(server)[("jaxinfer:requests_deferred",)] == 1)
    _drop(queued)
    assert wait_for(lambda: metrics(server)[("jaxinfer:requests_deferred",)] == 0)
    assert wait_for(lambda: _cancelled(server) >= cancelled + 1)
    for conn in running:
        _drop(conn)
    assert wait_for(lambda: metrics(server)[("jaxinfer:slots_busy",)] == 0)
    assert metrics(server)[("jaxinfer:kv_cache_pages_used",)] == 0


def test_bad_requests_get_400s_while_others_complete(server, client, stories_hf):
    want = stories_hf.generate(PROMPTS[2], max_new_tokens=300, temperature=0, ignore_eos=True)
    got = []

    def long():
        stream = client.completions.create(model="x", prompt=PROMPTS[2], max_tokens=300,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        got.append("".join(c.choices[0].text for c in stream))

    worker = threading.Thread(target=long)
    worker.start()
    long_prompt = "Once upon a time " * 600
    bad = [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n = 0"),
        ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": [5, 99999]}, "token ids must lie in [0, 512)"),
        ("/v1/completions", {"prompt": ""}, "empty"),
        ("/v1/completions", {"max_tokens": 3}, "prompt is required"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs = 21 is invalid"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix is not supported"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, "stop must be"),
        ("/v1/completions", {"prompt": long_prompt}, "exceeds the available context size"),
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", [1, 2], "JSON object"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages must be"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/detokenize", {"tokens": ["a"]}, "integer token ids"),
    ]
    for path, body, words in bad:
        status, text = raw(server, "POST", path, body)
        error = json.loads(text)["error"]
        assert status == 400 and error["code"] == 400, (body, text)
        assert words in error["message"] and "\n" not in error["message"], (body, error)
    status, text = raw(server, "POST", "/v1/completions", {"prompt": long_prompt})
    error = json.loads(text)["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 512
    assert error["n_prompt_tokens"] == len(stories_hf.tokenize(long_prompt))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="x", prompt="x", temperature=-1)
    assert raw(server, "GET", "/v1/nothing")[0] == 404
    worker.join()
    assert got == [want.text]
    r = client.completions.create(model="x", prompt=PROMPTS[3], max_tokens=8, temperature=0)
    assert r.choices[0].text == stories_hf.generate(PROMPTS[3], max_new_tokens=8,
                                                    temperature=0).text  # fmt: skip


def test_models_tokenize_detokenize(server, client, stories_hf):
    (card,) = client.models.list().data
    assert card.id == server.worker.engine.name and card.owned_by == "jaxinfer"
    text = "Once upon a time"
    ids = stories_hf.tokenize(text)
    status, out = raw(server, "POST", "/tokenize", {"content": text})
    assert status == 200 and json.loads(out)["tokens"] == ids[1:]  # no BOS by default
    _, out = raw(server, "POST", "/tokenize", {"content": text, "add_special": True,
                                               "with_pieces": True})  # fmt: skip
    pieces = json.loads(out)["tokens"]
    assert [p["id"] for p in pieces] == ids and pieces[0]["piece"] == "<s>"
    _, out = raw(server, "POST", "/detokenize", {"tokens": ids})
    assert json.loads(out)["content"] == stories_hf.detokenize(ids)


def test_chat_turns_hit_the_prefix_cache(server, client):
    """A repeated conversation is served from its cached pages: the same answer, its cached
    tokens in usage (streamed too) and llama-server's timings.cache_n; cache_salt and
    cache_prompt=false miss; /reset_prefix_cache empties the cache; /metrics counts tokens."""
    system = "Once upon a time, there was a little girl named Lily who loved to play. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "A story?"}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    first = json.loads(raw(server, "POST", "/v1/chat/completions", body)[1])
    before = metrics(server)
    page = server.worker.engine.kv_stats()["page_size"]
    n = first["usage"]["prompt_tokens"]
    hit = (n - 1) // page * page
    assert hit >= page  # the system prompt alone spans more than a page
    again = json.loads(raw(server, "POST", "/v1/chat/completions", body)[1])
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
    assert again["timings"]["cache_n"] == hit and again["timings"]["prompt_n"] == n - hit
    after = metrics(server)
    queries = after[("jaxinfer:prefix_cache_queries_total",)]
    assert queries - before[("jaxinfer:prefix_cache_queries_total",)] == n
    assert (
        after[("jaxinfer:prefix_cache_hits_total",)] - before[("jaxinfer:prefix_cache_hits_total",)]
        == hit
    )
    stream = client.chat.completions.create(
        model="x", messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    *_, last = list(stream)
    assert last.usage.prompt_tokens_details.cached_tokens == hit
    for extra in ({"cache_salt": "another tenant"}, {"cache_prompt": False}):
        status, text = raw(server, "POST", "/v1/chat/completions", {**body, **extra})
        assert status == 200 and json.loads(text)["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0
        }, extra
    assert raw(server, "POST", "/v1/chat/completions", {**body, "cache_salt": 7})[0] == 400
    assert raw(server, "POST", "/reset_prefix_cache")[0] == 200
    cold = json.loads(raw(server, "POST", "/v1/chat/completions", body)[1])
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["message"] == first["choices"][0]["message"]


# ---- the command ---------------------------------------------------------------------------


@pytest.mark.slow  # a fresh interpreter
def test_serve_command_health_key_and_shutdown():
    """The CLI on the built-in model: /health 503 while loading, then 200; the API key; a
    model without a chat template; SIGINT stops it cleanly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", "--api-key", "sekret",
         "-np", "1", "-c", "128", "-ub", "32"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))
        first = raw(None, "GET", "/health", port=port)
        assert first[0] == 503 and json.loads(first[1])["error"]["type"] == "unavailable_error"
        assert wait_for(lambda: raw(None, "GET", "/health", port=port)[0] == 200, 300)
        key = {"Authorization": "Bearer sekret"}
        assert raw(None, "GET", "/v1/models", port=port)[0] == 401
        assert raw(None, "GET", "/v1/models", headers={"Authorization": "Bearer x"},
                   port=port)[0] == 401  # fmt: skip
        status, text = raw(None, "GET", "/v1/models", headers=key, port=port)
        assert status == 200 and "stories260K" in json.loads(text)["data"][0]["id"]
        body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
        status, text = raw(None, "POST", "/v1/completions", body, headers=key, port=port)
        assert status == 200 and json.loads(text)["choices"][0]["text"].startswith(", there")
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        status, text = raw(None, "POST", "/v1/chat/completions", chat, headers=key, port=port)
        assert status == 400 and "no chat template" in json.loads(text)["error"]["message"]
        assert raw(None, "GET", "/metrics", port=port)[0] == 200  # public, as in vLLM
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.stderr.close()


def test_serve_command_errors(capsys, tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    cases = [
        (["serve", "--port", "99999"], "--port 99999 is invalid"),
        (["serve", "--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
        (["serve", "--port", "0", "-np", "0"], "--parallel 0 is invalid"),
        (["serve", "--port", "0", "-m", str(tmp_path / "none.gguf")], "none.gguf"),
        (["serve", "--port", "0", "--chat-template-file", str(tmp_path / "t")], "cannot read"),
    ]
    for argv, words in cases:
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("error: ") and words in err, err
    busy.close()


def test_tools_on_a_template_without_a_call_format_and_a_bad_schema_are_clear_400s(client):
    """This server's template (Llama 2 style) writes no tool calls; structured output and
    plain chat still work beside the refusals (tests/runtime/test_structured.py has the rest)."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="no tool-call format"):
        client.chat.completions.create(model="m", messages=ask, tools=[tool], max_tokens=4)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match="json_schema is invalid"):
        client.chat.completions.create(model="m", messages=ask, max_tokens=4, response_format=bad)
    ok = client.chat.completions.create(
        model="m", messages=ask, max_tokens=30, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert ok.choices[0].message.content.lstrip().startswith("{")
