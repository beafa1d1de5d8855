"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens,
serve/anthropic.py) on a live server over stories260K with Qwen 2.5's tool-calling template,
driven by the real `anthropic` SDK: a tool-use round trip (inputs checked with jsonschema),
streams the SDK assembles into the non-streamed answer, token counts against transformers'
rendering of the equivalent chat, an assistant prefill continued (and chat completions'
continue_final_message) as the engine continues the prompt rendered by hand, stop sequences,
Anthropic-shaped errors and a dropped stream's cancellation; thinking blocks and budgets under
DeepSeek-R1's template. A thinking answer with split tool calls (which this model does not
write) goes through the SDK's own parser from a stubbed transport. Then an `openai-agents`
agent calls one function tool and finishes, over chat completions."""

import asyncio
import http.client
import json
import socket
from pathlib import Path

import jinja2
import jsonschema
import pytest
from support.models import live_server, stories_chat, wait_for
from support.templates import QWEN25

import jaxinfer
from jaxinfer.errors import RequestError
from jaxinfer.serve.anthropic import MessageStream, chat_body, message

anthropic = pytest.importorskip("anthropic")

KEY = "messages-test-key"
# the prompt with Qwen 2.5's tool preamble is ~600 tokens: past stories260K's own 512
PLAN = dict(slots=2, max_seq_len=1024, prefill_buckets=(128,), batch_buckets=(1,))
GREEDY = {"temperature": 0}  # through extra_body: this SDK has no sampling parameters
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city, now.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}
NOW = {"name": "now", "input_schema": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
STORY = [{"role": "user", "content": "Tell me a story about a cat."}]
FORCED = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return stories_chat(tmp_path_factory, QWEN25)  # Hermes tool calls


@pytest.fixture(scope="module")
def server(chat_model):
    with live_server(lambda: jaxinfer.load(chat_model, **PLAN), api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _reference_count(chat_model, messages, tools=None) -> int:
    """The prompt's tokens as transformers renders the equivalent chat (OpenAI's messages and
    function tools, written out here) and the tokenizer encodes it (with its BOS)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_model))
    functions = [{"type": "function", "function": {
        "name": t["name"], **({"description": t["description"]} if "description" in t else {}),
        "parameters": t["input_schema"],
    }} for t in tools or ()]  # fmt: skip
    text = hf.apply_chat_template(
        messages, tools=functions or None, add_generation_prompt=True, tokenize=False
    )
    return len(hf(text)["input_ids"])


def _prompt_tokens(answer) -> int:
    return answer.usage.input_tokens + answer.usage.cache_read_input_tokens


# ---- through the SDK ----------------------------------------------------------------------


def test_tool_use_round_trip(client, chat_model):
    """A forced call gives one tool_use whose input fits the schema; sent back with its
    tool_result, the next answer (tools off) is text; the prompt holds both, token for token
    as transformers renders the same chat."""
    for seed in range(2):  # sampled: the grammar, not a lucky greedy path, keeps it valid
        sampled = {"temperature": 1.0, "seed": seed}
        forced = client.messages.create(
            model="m", max_tokens=150, messages=ASK, tools=[WEATHER, NOW], tool_choice=FORCED,
            extra_body=sampled,
        )  # fmt: skip
        assert forced.stop_reason == "tool_use" and forced.stop_sequence is None
        calls = [b for b in forced.content if b.type == "tool_use"]
        assert len(calls) == 1 and calls[0].name == "get_weather"
        assert calls[0].id.startswith("toolu_") and forced.id.startswith("msg_")
        jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    call = calls[0]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees, sunny"}
    conversation = [*ASK, forced.to_param(), {"role": "user", "content": [result]}]
    final = client.messages.create(
        model="m", max_tokens=12, messages=conversation, tools=[WEATHER, NOW],
        tool_choice={"type": "none"}, extra_body=GREEDY,
    )  # fmt: skip
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"] and final.content[0].text
    equivalent = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": call.input}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]  # fmt: skip
    want = _reference_count(chat_model, equivalent, [WEATHER, NOW])
    assert _prompt_tokens(final) == want
    counted = client.messages.count_tokens(model="m", messages=conversation, tools=[WEATHER, NOW])
    assert counted.input_tokens == want


def test_a_stream_assembles_the_non_streamed_message(client):
    kw = dict(model="m", max_tokens=24, messages=STORY, system="Be kind.", extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert [(b.type, b.text) for b in streamed.content] == [("text", whole.content[0].text)]
    assert streamed.stop_reason == whole.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == whole.usage.output_tokens == 24
    assert _prompt_tokens(streamed) == _prompt_tokens(whole)
    # a forced call streamed: the SDK reads its input_json_delta into the same input
    kw = dict(model="m", max_tokens=150, messages=ASK, tools=[WEATHER], tool_choice=FORCED,
              extra_body=GREEDY)  # fmt: skip
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    calls = [[(b.name, b.input) for b in m.content if b.type == "tool_use"]
             for m in (streamed, whole)]  # fmt: skip
    assert calls[0] == calls[1] and len(calls[0]) == 1


def test_count_tokens_is_the_prompt(client, chat_model):
    system = [{"type": "text", "text": "Be kind."}, {"type": "text", "text": "Be brief."}]
    counted = client.messages.count_tokens(model="m", system=system, messages=STORY)
    answer = client.messages.create(model="m", max_tokens=2, system=system, messages=STORY)
    chat = [{"role": "system", "content": "Be kind.\nBe brief."}, *STORY]
    assert counted.input_tokens == _prompt_tokens(answer) == _reference_count(chat_model, chat)
    with_tools = client.messages.count_tokens(model="m", messages=STORY, tools=[WEATHER])
    assert with_tools.input_tokens == _reference_count(chat_model, STORY, [WEATHER])


PREFILL = [*STORY, {"role": "assistant", "content": "Once upon"}]


def _continued(stories_hf, max_tokens: int):
    """The reference: the engine's greedy Result from the chat rendered by hand (jinja2, as
    transformers renders it) and cut after the prefill, before its end of turn."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    rendered = env.from_string(QWEN25).render(messages=PREFILL, add_generation_prompt=False)
    assert rendered.endswith("<|im_start|>assistant\nOnce upon<|im_end|>\n")
    prompt = rendered.removesuffix("<|im_end|>\n")
    return stories_hf.generate(prompt, max_new_tokens=max_tokens, temperature=0)


def test_an_assistant_prefill_is_continued(client, stories_hf):
    """A last assistant message is a prefill: the answer continues it (greedy: the engine's
    continuation of the same prompt, token for token) and does not repeat it; streamed
    alike; count_tokens counts that prompt."""
    want = _continued(stories_hf, 16)
    kw = dict(model="m", max_tokens=16, messages=PREFILL, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    for answer in (whole, streamed):
        assert [(b.type, b.text) for b in answer.content] == [("text", want.text)]
        assert answer.usage.output_tokens == len(want.token_ids)
        assert _prompt_tokens(answer) == len(want.prompt_ids)
    assert client.messages.count_tokens(model="m", messages=PREFILL).input_tokens == len(
        want.prompt_ids
    )


def test_chat_continue_final_message(server, stories_hf):
    """Chat completions take vLLM's continue_final_message: the same continuation (each
    token's bytes from its logprobs), with add_generation_prompt false or left out; both true
    is a one-line 400."""
    openai = pytest.importorskip("openai")
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).chat
    want = _continued(stories_hf, 12)
    token_bytes = [list(stories_hf.vocabulary.token_bytes(i)) for i in want.token_ids]
    for generation in ({"add_generation_prompt": False}, {}):
        answer = chat.completions.create(
            model="m", messages=PREFILL, max_tokens=12, temperature=0, logprobs=True,
            extra_body={"continue_final_message": True, **generation},
        ).choices[0]  # fmt: skip
        assert answer.message.content == want.text
        assert [t.bytes for t in answer.logprobs.content] == token_bytes
    with pytest.raises(openai.BadRequestError) as e:
        chat.completions.create(
            model="m", messages=PREFILL, max_tokens=4,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )  # fmt: skip
    said = e.value.body["message"]
    assert "continue_final_message and add_generation_prompt" in said and "\n" not in said


def test_stop_sequences(client, server):
    kw = dict(model="m", max_tokens=24, messages=STORY, extra_body=GREEDY)
    text = client.messages.create(**kw).content[0].text
    words = text.split()
    stop = words[len(words) // 2]
    kw["stop_sequences"] = ["never written here", stop]
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    for answer in (whole, streamed):
        assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == stop
        assert answer.content[0].text == text[: text.index(stop)]
    # chat completions tell it too, as vLLM's stop_reason
    openai = pytest.importorskip("openai")
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).chat
    kw = dict(model="m", messages=STORY, max_tokens=24, temperature=0, stop=kw["stop_sequences"])
    whole = chat.completions.create(**kw).choices[0]
    last = list(chat.completions.create(stream=True, **kw))[-1].choices[0]
    for choice in (whole, last):
        assert choice.finish_reason == "stop" and choice.stop_reason == stop


def test_errors_in_anthropics_shape(client, server, monkeypatch):
    def refused(cls, call) -> str:
        with pytest.raises(cls) as e:
            call()
        body = e.value.body
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert "\n" not in body["error"]["message"]
        return body["error"]["message"]

    bad = anthropic.BadRequestError
    missing = refused(bad, lambda: client.post(
        "/v1/messages", cast_to=object, body={"model": "m", "messages": ASK}
    ))  # fmt: skip
    assert "max_tokens is required" in missing
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    said = refused(bad, lambda: client.messages.create(
        model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}]
    ))  # fmt: skip
    assert "'image'" in said and "not supported" in said
    search = {"type": "web_search_20250305", "name": "web_search"}
    said = refused(bad, lambda: client.messages.create(
        model="m", max_tokens=4, messages=ASK, tools=[search]
    ))  # fmt: skip
    assert "web_search_20250305" in said
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for headers in ({"X-Api-Key": "wrong"}, {"Authorization": "Bearer wrong"}):
        c = anthropic.Anthropic(base_url=server.url, default_headers=headers, max_retries=0)
        count = lambda c=c: c.messages.count_tokens(model="m", messages=ASK)  # noqa: E731
        assert refused(anthropic.AuthenticationError, count) == "Invalid API Key"
    c = anthropic.Anthropic(base_url=server.url, default_headers={"X-Api-Key": KEY}, max_retries=0)
    assert c.messages.count_tokens(model="m", messages=ASK).input_tokens > 0
    status, answer = _raw(server, "GET", "/v1/messages")  # a route's wrong method
    assert status == 405 and json.loads(answer)["error"]["type"] == "invalid_request_error"


def _raw(server, method: str, path: str, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        conn.request(method, path, json.dumps(body) if body else None, headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_sse_frames_and_a_dropped_stream(server):
    """Each frame is `event: NAME` then `data: {"type": NAME, ...}`, in Anthropic's order;
    a client that leaves mid-stream cancels its request and frees its slot."""
    body = {"model": "m", "max_tokens": 8, "messages": STORY, "stream": True, "temperature": 0}
    status, answer = _raw(server, "POST", "/v1/messages", body)
    assert status == 200
    frames = [f.split("\n") for f in answer.decode().strip().split("\n\n")]
    names = [f[0].removeprefix("event: ") for f in frames]
    data = [json.loads(f[1].removeprefix("data: ")) for f in frames]
    assert [d["type"] for d in data] == names
    assert names[:2] == ["message_start", "content_block_start"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]

    def cancelled() -> float:
        lines = _raw(server, "GET", "/metrics")[1].decode().splitlines()
        name = 'jaxinfer:requests_total{finish_reason="cancelled"}'
        return sum(float(x.split()[-1]) for x in lines if x.startswith(name))

    before = cancelled()
    long = {**body, "max_tokens": 900, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/messages", json.dumps(long), {"x-api-key": KEY})
    response = conn.getresponse()
    assert response.status == 200 and response.readline() == b"event: message_start\n"
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert wait_for(lambda: cancelled() == before + 1)
    assert wait_for(lambda: b"jaxinfer:slots_busy 0.0" in _raw(server, "GET", "/metrics")[1])


def test_an_agent_calls_its_tool_and_finishes(server):
    """openai-agents over chat completions: tool_choice "required" makes the one call (the
    tool records it), then reset_tool_choice frees the next turn, which answers in text."""
    agents = pytest.importorskip("agents")
    openai = pytest.importorskip("openai")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city, now."""
        calls.append(city)
        return "18 degrees, sunny"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    settings = agents.ModelSettings(
        tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0
    )
    agent = agents.Agent(
        name="weather", instructions="Answer briefly.", tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model="m", openai_client=client),
        model_settings=settings,
    )  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert isinstance(result.final_output, str) and result.final_output


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A client of stories260K with DeepSeek-R1's template, which opens <think> in the prompt:
    the answer reasons until the model (or the budget) closes it."""
    fixture = Path(__file__).parents[1] / "fixtures" / "templates"
    template = (fixture / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    folder = stories_chat(tmp_path_factory, template)
    with live_server(lambda: jaxinfer.load(folder, **PLAN)) as srv:
        yield anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)


@pytest.mark.slow  # a second server: the default tier's time budget
def test_thinking_blocks_and_budgets(thinker):
    """The reasoning comes back as a thinking block, streamed (thinking_delta) as whole;
    budget_tokens N cuts it short (greedy: a prefix of the unbounded one) and the answer goes
    on in text; disabled thinks nothing."""
    kw = dict(model="m", max_tokens=20, messages=STORY, extra_body=GREEDY)
    answers = {}
    for name, thinking in [("free", None), ("budget", {"type": "enabled", "budget_tokens": 6}),
                           ("off", {"type": "disabled"})]:  # fmt: skip
        more = {"thinking": thinking} if thinking else {}
        whole = thinker.messages.create(**kw, **more)
        with thinker.messages.stream(**kw, **more) as stream:
            streamed = stream.get_final_message()
        answers[name] = _blocks(whole)
        assert _blocks(streamed) == answers[name], name
    free, budget, off = answers["free"], answers["budget"], answers["off"]
    assert free[0]["type"] == budget[0]["type"] == "thinking" and budget[0]["signature"] == ""
    cut, full = budget[0]["thinking"].rstrip(), free[0]["thinking"]
    assert cut and full.startswith(cut) and len(cut) < len(full.rstrip())
    assert budget[1]["type"] == "text" and budget[1]["text"]
    assert all(b["type"] != "thinking" or not b["thinking"].strip() for b in off)


# ---- the translation, read by the SDK -------------------------------------------------------

try:  # the HTTP library this anthropic SDK is built on (httpx2 in the 2.x line)
    import httpx2 as httpx
except ImportError:
    import httpx  # type: ignore[no-redef]


def _stubbed(body: bytes, stream: bool):
    """An SDK client whose every request is answered with `body`."""
    kind = "text/event-stream" if stream else "application/json"
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"content-type": kind})
    )
    return anthropic.Anthropic(base_url="http://stub", api_key="k", max_retries=0,
                               http_client=httpx.Client(transport=transport))  # fmt: skip


def _chunk(delta: dict | None = None, finish=None, **extra) -> dict:
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish, **extra}
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "choices": [choice]}


USAGE = {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39,
         "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip
ARGS = '{"city": "Paris"}'
# what a thinking model's chat stream holds: reasoning, text, two calls (one sent in pieces)
CHUNKS = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "It is "}),
    _chunk({"reasoning_content": "sunny there."}),
    _chunk({"content": "Let me "}),
    _chunk({"content": "check."}),
    _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": ARGS[:7]}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ARGS[7:]}}]}),
    _chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                            "function": {"name": "now", "arguments": "{}"}}]}),
    _chunk(finish="tool_calls", stop_reason=None),
    {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "choices": [], "usage": USAGE},
]  # fmt: skip
ANSWER = {  # the same answer whole
    "id": "chatcmpl-abc", "object": "chat.completion", "model": "m", "usage": USAGE,
    "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None, "message": {
        "role": "assistant", "content": "Let me check.", "reasoning_content": "It is sunny there.",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ARGS}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    }}],
}  # fmt: skip
WANT = [  # Anthropic's blocks, written out
    {"type": "thinking", "thinking": "It is sunny there.", "signature": ""},
    {"type": "text", "text": "Let me check."},
    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}},
]


def _blocks(answer) -> list[dict]:
    keep = {"type", "thinking", "signature", "text", "id", "name", "input"}
    return [{k: v for k, v in b.to_dict().items() if k in keep} for b in answer.content]


def test_the_sdk_reads_translated_answers_and_streams():
    whole = _stubbed(json.dumps(message(ANSWER)).encode(), stream=False)
    answer = whole.messages.create(model="m", max_tokens=9, messages=ASK)
    stream = MessageStream("chatcmpl-abc", "m", 30)
    frames = stream.start() + [f for c in CHUNKS for f in stream.feed(c)] + stream.close()
    streamed = _stubbed("".join(frames).encode(), stream=True)
    with streamed.messages.stream(model="m", max_tokens=9, messages=ASK) as events:
        kinds = [e.type for e in events if e.type.startswith("content_block")]
        final = events.get_final_message()
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4
    for got in (answer, final):
        assert _blocks(got) == WANT and got.id == "msg_abc"
        assert got.stop_reason == "tool_use" and got.stop_sequence is None
        assert (got.usage.input_tokens, got.usage.cache_read_input_tokens) == (14, 16)
        assert got.usage.output_tokens == 9
    # a stop string, and an engine failure mid-stream (an error event the SDK raises)
    stopped = {**ANSWER["choices"][0], "finish_reason": "stop", "stop_reason": "The end",
               "message": {"role": "assistant", "content": "Once"}}  # fmt: skip
    said = message({**ANSWER, "choices": [stopped]})
    assert (said["stop_reason"], said["stop_sequence"]) == ("stop_sequence", "The end")
    stream = MessageStream("chatcmpl-abc", "m", 30)
    failed = {"error": {"code": 500, "message": "generation failed: boom", "type": "server_error"}}
    frames = stream.start() + stream.feed(CHUNKS[3]) + stream.feed(failed) + stream.close()
    with pytest.raises(anthropic.APIStatusError, match="generation failed: boom"):
        with _stubbed("".join(frames).encode(), stream=True).messages.stream(
            model="m", max_tokens=9, messages=ASK
        ) as events:
            events.get_final_message()


# ---- the request's translation ------------------------------------------------------------


def test_chat_body_translates_a_conversation():
    body = {
        "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 20, "stream": True,
        "metadata": {"user_id": "u"},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "A tool knows.", "signature": "x"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "18"}, {"type": "text", "text": "sunny"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city",
                 "is_error": True},
                {"type": "text", "text": "And now?"},
            ]},
        ],
        "tools": [WEATHER, {**NOW, "type": "custom"}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 256},
    }  # fmt: skip
    assert chat_body(body) == {
        "model": "m", "max_tokens": 64, "temperature": 0.5, "top_k": 20, "stream": True,
        "stream_options": {"include_usage": True}, "stop": ["\n\n"],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "A tool knows.",
             "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18\nsunny"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
            {"role": "user", "content": "And now?"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "description":
             WEATHER["description"], "parameters": WEATHER["input_schema"]}},
            {"type": "function", "function": {"name": "now", "parameters":
             NOW["input_schema"]}},
        ],
        "tool_choice": "required", "parallel_tool_calls": False, "thinking_budget": 256,
    }  # fmt: skip
    short = {"model": "m", "max_tokens": 8, "messages": ASK}
    named = chat_body({**short, "tools": [WEATHER], "tool_choice": FORCED})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    off = chat_body({**short, "thinking": {"type": "disabled"}})
    assert off["thinking_budget"] == 0
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    assert "thinking_budget" not in chat_body({**short, "thinking": {"type": "adaptive"}})
    counted = chat_body({"model": "m", "messages": ASK}, count=True)  # no max_tokens needed
    assert counted == {"model": "m", "messages": ASK}
    prefill = {**short, "messages": [*ASK, {"role": "assistant", "content": "It is"}]}
    assert chat_body(prefill)["continue_final_message"] is True


@pytest.mark.parametrize("change, words", [
    ({"max_tokens": None}, "max_tokens is required"),
    ({"max_tokens": 0}, "max_tokens = 0 is invalid"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role = 'system'"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "messages[0].content[0] is of type 'document', which is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use"}]}]},
     "only assistant messages hold"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"system": 5}, "system must be a string or a list of text blocks"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type = 'bash_20250124'"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema is missing"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name = 'nope' is not in tools (get_weather)"),
    ({"tool_choice": "auto"}, "tool_choice = 'auto' is invalid"),
    ({"stop_sequences": "x"}, "stop_sequences must be a list of strings"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens = None is invalid"),
    ({"thinking": {"type": "sometimes"}}, "thinking = "),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers is not supported"),
])  # fmt: skip
def test_chat_body_refuses_with_one_line(change, words):
    body = {"model": "m", "max_tokens": 8, "messages": ASK, **change}
    with pytest.raises(RequestError) as e:
        chat_body({k: v for k, v in body.items() if v is not None})
    assert words in str(e.value) and "\n" not in str(e.value)
