"""The server's front door, fuzzed: hypothesis sends 2,000 generated requests (1,450+
distinct: wrong types, missing and extra fields, huge and negative numbers, NaN, bad UTF-8,
lone surrogates, deep nesting, non-object JSON, empty bodies, wrong methods, bodies at and
just past each limit) to every route as
raw HTTP, and a sweep sets every field of both completion routes to each of 24 extreme values.
Each answer is a 200 or a 4xx OpenAI-style error with a one-line message, within a timeout;
after them the same greedy completion comes back and no slot or KV page is held. Then
llama-server's GET /props and GET /slots (busy slots show their prompts; `?fail_on_no_slot=1`),
`--no-slots` and the API key in front of /slots."""

import http.client
import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.models import live_server, stories_chat, wait_for

import jaxinfer
from jaxinfer.options import SamplingParams
from jaxinfer.serve.server import Server

PLAN = dict(slots=4, prefill_buckets=(32, 128), batch_buckets=(1,))  # a small plan
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
    "{{ m['content'] }} [/INST]{% else %} {{ m['content'] }}{% endif %}{% endfor %}"
)
PROMPT = "Once upon a time, there was a little girl"
TIMEOUT_S = 60  # an answer later than this is a hang
FUZZ = settings(
    deadline=None,  # the client timeout catches hangs; shrinking a slow case is not wanted
    derandomize=True,  # the same requests on every run and in CI
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return stories_chat(tmp_path_factory, TEMPLATE)  # a small chat template


@pytest.fixture(scope="module")
def server(chat_model):
    load = lambda: jaxinfer.load(chat_model, **PLAN, embeddings=True)  # noqa: E731
    with live_server(load, embedding=True) as srv:  # rerank off: stories has no "yes" token
        srv.reference = greedy(srv)  # what the fuzz must leave unchanged
        yield srv


def send(port: int, method: str, path: str, data: bytes = b"", headers=None):
    """(status, content type, body bytes) of one raw HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=data, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.getheader("content-type", ""), response.read()
    finally:
        conn.close()


def greedy(server) -> str:
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    status, _, data = send(server.port, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 200, data
    return json.loads(data)["choices"][0]["text"]


# ---- what the fuzz sends ------------------------------------------------------------------

ODD_TEXT = [
    "\ud800", "a\udfffb", "\udc00\ud800", "\ud83d\ude00", "\x00", "\u2028", "\ufffe", "<s>",
    "</s>", "[INST]", "{{ 7 * 7 }}", "{% raw %}", "Once upon a time", "x" * 3000, "🙂" * 40,
]  # fmt: skip


def weighted(*choices):
    """One of the strategies, each `weight` times in sum(weights): one_of picks by its own
    branches, and would favour the recursive JUNK's many."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


SURROGATES = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1)
TEXT = weighted((8, st.text(max_size=12)), (1, st.sampled_from(ODD_TEXT)), (1, SURROGATES))
INTS = st.one_of(
    st.integers(-3, 8),
    st.sampled_from([-1, 2**31 - 1, 2**31, 2**63, 2**70, -(2**70), 10**400]),
)
NUMBERS = st.one_of(
    INTS,
    st.floats(),  # NaN and infinities too: json.dumps writes them as NaN / Infinity
    st.sampled_from([1e308, -1e308, 5e-324, -0.0, 0.5, 1.5, 3.5]),
)
NANISH = st.sampled_from(["NaN", "nan", "Infinity", "-Infinity", "1e999", "-1", "4", "", "null"])
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, NANISH, TEXT)
JUNK = st.recursive(
    SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=6
)


def either(*good, junk: int = 3):
    """A field's sensible values, or (`junk` times in 12) junk of any type."""
    return weighted((12 - junk, st.one_of(*good)), (junk, JUNK))


COUNTS = either(
    st.integers(0, 4), st.sampled_from([-1, -2, 0, 2**31, 2**70, 3.5, 4.0, "4", True, 1e308])
)
SCHEMAS = st.sampled_from([
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    {"enum": ["yes", "no"]}, {"type": "string", "maxLength": 3}, {}, {"type": "nonsense"},
    {"$ref": "#/nowhere"}, {"type": "object", "properties": {"a": {"$ref": "#"}}},
])  # fmt: skip
GRAMMARS = st.sampled_from([
    'root ::= "yes" | "no"', "root ::= [a-z]+", 'root ::= "a" root?', "root ::=", "::= nonsense",
    "root ::= undefined", 'root ::= "\\', "",
])  # fmt: skip
FUNCTION = st.fixed_dictionaries(
    {"name": either(st.sampled_from(["get_weather", "f", ""]))},
    optional={"parameters": either(SCHEMAS), "description": TEXT, "strict": JUNK},
)
TOOL = either(st.fixed_dictionaries({"type": either(st.just("function")), "function": FUNCTION}))
FORMATS = either(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}]),
    st.fixed_dictionaries({"type": st.just("json_object")}, optional={"schema": either(SCHEMAS)}),
    st.fixed_dictionaries({
        "type": st.just("json_schema"),
        "json_schema": either(st.fixed_dictionaries(
            {"name": either(st.just("answer"))},
            optional={"schema": either(SCHEMAS), "strict": either(st.booleans())},
        )),
    }),
)  # fmt: skip
NAMED = st.fixed_dictionaries({"name": either(st.sampled_from(["get_weather", "nope"]))})
TOOL_CHOICE = either(
    st.sampled_from(["auto", "none", "required"]),
    st.fixed_dictionaries({"type": st.just("function"), "function": either(NAMED)}),
)
FIELDS = {  # every field the completion routes read (or are gaining), with sensible values
    "max_tokens": COUNTS,
    "max_completion_tokens": COUNTS,
    "n": either(st.integers(1, 3), st.sampled_from([0, -1, 129, 2**70, 1.0, "2", True])),
    "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries({"include_usage": either(st.booleans())})),
    "stop": either(TEXT, st.lists(TEXT, max_size=3)),
    "seed": either(INTS),
    "temperature": either(st.sampled_from([0, 0.7, 1.0]), NUMBERS),
    "top_p": either(NUMBERS),
    "top_k": either(INTS),
    "min_p": either(NUMBERS),
    "repeat_penalty": either(NUMBERS),
    "presence_penalty": either(NUMBERS),
    "frequency_penalty": either(NUMBERS),
    "ignore_eos": either(st.booleans()),
    "cache_prompt": either(st.booleans()),
    "cache_salt": either(TEXT),
    "logprobs": either(st.booleans(), st.integers(-1, 25)),
    "top_logprobs": either(st.integers(-1, 25)),
    "echo": either(st.booleans()),
    "response_format": FORMATS,
    "json_schema": either(SCHEMAS),
    "grammar": either(GRAMMARS, TEXT),
    "tools": either(st.lists(TOOL, max_size=3)),
    "tool_choice": TOOL_CHOICE,
    "parallel_tool_calls": either(st.booleans()),
    "model": either(TEXT),
    "best_of": either(INTS),
    "suffix": either(TEXT),
    "logit_bias": either(st.dictionaries(st.sampled_from(["5", "x", "-1"]), NUMBERS, max_size=2)),
    "user": either(TEXT),
}
CHAT_FIELDS = {
    **FIELDS,
    "add_generation_prompt": either(st.booleans()),
    "chat_template_kwargs": either(st.dictionaries(st.sampled_from(["a", "messages"]), JUNK)),
}
TOKENS = weighted((4, st.lists(st.integers(0, 511), min_size=1, max_size=6)),
                  (1, st.lists(st.integers(-2, 520), max_size=6)))  # fmt: skip
WORDS = weighted((3, st.text(min_size=1, max_size=12)), (1, TEXT))  # mostly not empty
PROMPTS = either(weighted(
    (3, WORDS), (2, TOKENS), (1, st.lists(weighted((3, WORDS), (3, TOKENS), (1, JUNK)), max_size=3))
))  # fmt: skip
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
CONTENT = either(TEXT, st.lists(either(PART, junk=1), max_size=2), junk=1)
ROLE = either(
    st.sampled_from(["system", *["user"] * 3, *["assistant"] * 2, "tool", "wizard"]), junk=1
)
MESSAGE = either(weighted(
    (4, st.fixed_dictionaries({"role": ROLE, "content": CONTENT})),
    (1, st.fixed_dictionaries({"role": ROLE, "content": CONTENT},
                              optional={"name": TEXT, "tool_calls": JUNK, "tool_call_id": TEXT})),
), junk=1)  # fmt: skip
# Anthropic's /v1/messages: its blocks, messages, tools and fields (plain one_of inside: each
# `either` level multiplies the strategies' repr, which hypothesis builds, by 12)
BLOCK = st.one_of(
    PART,
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": TEXT,
            "name": st.sampled_from(["get_weather", ""]),
            "input": st.one_of(st.dictionaries(TEXT, SCALARS), SCALARS),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": TEXT},
        optional={"content": st.one_of(TEXT, st.lists(PART, max_size=2)), "is_error": SCALARS},
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["thinking", "redacted_thinking", "image"])},
        optional={"thinking": TEXT, "source": SCALARS},
    ),
    SCALARS,
)
TURN = weighted((6, st.fixed_dictionaries({
    "role": st.sampled_from(["user"] * 6 + ["assistant"] * 3 + ["system"]),
    "content": st.one_of(TEXT, st.lists(BLOCK, min_size=1, max_size=3)),
})), (1, SCALARS))  # fmt: skip
CLIENT_TOOL = either(st.fixed_dictionaries(
    {"name": either(st.sampled_from(["get_weather", "f", ""]))},
    optional={"input_schema": either(SCHEMAS), "description": TEXT,
              "type": either(st.sampled_from(["custom", "web_search_20250305"]))},
))  # fmt: skip
MESSAGES_FIELDS = {
    "model": either(TEXT),
    "max_tokens": COUNTS,
    "system": either(TEXT, st.lists(either(PART, junk=1), max_size=2)),
    "stop_sequences": either(st.lists(TEXT, max_size=3)),
    "temperature": either(st.sampled_from([0, 0.7, 1.0]), NUMBERS),
    "top_p": either(NUMBERS),
    "top_k": either(INTS),
    "stream": either(st.booleans()),
    "metadata": JUNK,
    "tools": either(st.lists(CLIENT_TOOL, max_size=2)),
    "tool_choice": either(st.fixed_dictionaries(
        {"type": either(st.sampled_from(["auto", "any", "tool", "none"]))},
        optional={"name": either(st.sampled_from(["get_weather", "nope"])),
                  "disable_parallel_tool_use": either(st.booleans())},
    )),
    "thinking": either(st.fixed_dictionaries(
        {"type": either(st.sampled_from(["enabled", "disabled", "adaptive"]))},
        optional={"budget_tokens": COUNTS},
    )),
    "output_config": either(st.fixed_dictionaries({}, optional={"format": either(
        st.fixed_dictionaries({"type": st.just("json_schema"), "schema": either(SCHEMAS)}))})),
    "seed": either(INTS),
    "ignore_eos": either(st.booleans()),
}  # fmt: skip
MESSAGES_ROUTES = ["/v1/messages", "/v1/messages/count_tokens"]
DEPTHS = [10, 500, 900, 990, 1000, 2000, 100_000]
MIB = 1 << 20  # the default limits: 16 MiB bodies, 128 choices, 16 stop strings of 256, 256 KiB


def _near_limits() -> list[bytes]:
    """Bodies at and just past each default limit (ServerOptions): the big ones padded with
    JSON whitespace, so that they cost the server reading, not tokenizing."""

    def body(fields: dict, pad: int = 0) -> bytes:
        return json.dumps(fields).encode()[:-1] + b" " * pad + b"}"

    schema = lambda kib: {"enum": ["a" * (kib * 1024 - 16)]}  # noqa: E731
    return [
        body({"prompt": "x", "max_tokens": 1}, 16 * MIB - 64),
        body({"prompt": "x", "max_tokens": 1}, 16 * MIB + 1),
        body({"prompt": ["x"] * 128, "max_tokens": 1}),
        body({"prompt": ["x"] * 129}),
        body({"prompt": ["x"] * 64, "n": 2, "max_tokens": 1}),
        body({"prompt": "x", "n": 129}),
        body({"prompt": "x", "stop": ["y" * 256] * 16, "max_tokens": 1}),
        body({"prompt": "x", "stop": ["y"] * 17}),
        body({"prompt": "x", "stop": ["y" * 257]}),
        body({"prompt": "x", "json_schema": schema(255), "max_tokens": 1}),
        body({"prompt": "x", "json_schema": schema(257)}),
        body({"prompt": "x", "grammar": 'root ::= "' + "a" * (257 << 10) + '"'}),
    ]


RAW = st.one_of(
    st.sampled_from([
        b"", b"{", b"null", b"[]", b'"x"', b"1e999", b"NaN", b"\xff\xfe{}", "{}".encode("utf-16"),
        b'{"prompt": "\xed\xa0\x80"}', b'{"content": "caf\xe9"}', b'\xef\xbb\xbf{"prompt": "x"}',
        b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", b'{"prompt": "x"} trailing',
        b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
    ]),
    st.binary(max_size=24),
    st.sampled_from(DEPTHS).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}"),
    st.sampled_from(DEPTHS).map(
        lambda d: b'{"messages": [{"role": "user", "content": ' + b"[" * d + b"]" * d + b"}]}"
    ),
    st.sampled_from(DEPTHS).map(lambda d: b'{"content": ' + b'{"a": ' * d + b"1" + b"}" * d + b"}"),
    st.sampled_from(_near_limits()),
)  # fmt: skip


def bodies(base: dict, fields: dict):
    """A small valid body with up to 4 fields set from `fields`, up to 2 unknown fields, and
    maybe one of its own fields dropped; or junk JSON of any type; or raw bytes."""
    chosen = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)
    extra = (chosen if fields else st.just([])).flatmap(
        lambda names: st.fixed_dictionaries({k: fields[k] for k in names})
    )
    unknown = weighted((3, st.just({})), (1, st.dictionaries(TEXT, JUNK, max_size=2)))
    drop = st.sampled_from([None] * 10 + list(base))
    structured = st.builds(
        lambda b, e, u, d: {k: v for k, v in {**u, **b, **e}.items() if k != d},
        st.fixed_dictionaries(base), extra, unknown, drop,
    )  # fmt: skip
    return weighted((4, structured.map(_encode)), (1, JUNK.map(_encode)), (1, RAW))


def _encode(body) -> bytes:
    return json.dumps(body).encode()  # ASCII: a lone surrogate goes as its \ud800 escape


POST_ROUTES = {
    "/v1/completions": bodies(
        {"prompt": PROMPTS, "max_tokens": st.integers(0, 4), "temperature": st.just(0)}, FIELDS
    ),
    "/v1/chat/completions": bodies(
        {"messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(0, 4)},
        CHAT_FIELDS,
    ),
    "/tokenize": bodies(
        {"content": either(TEXT)},
        {"add_special": either(st.booleans()), "with_pieces": either(st.booleans())},
    ),  # fmt: skip
    "/detokenize": bodies({"tokens": either(st.lists(st.integers(-3, 520), max_size=8))}, {}),
    "/reset_prefix_cache": bodies({}, {}),
    "/v1/messages": bodies(
        {"messages": st.lists(TURN, min_size=1, max_size=3), "max_tokens": st.integers(1, 4)},
        MESSAGES_FIELDS,
    ),
}
POST_ROUTES["/completions"] = POST_ROUTES["/v1/completions"]
POST_ROUTES["/chat/completions"] = POST_ROUTES["/v1/chat/completions"]
POST_ROUTES["/v1/embeddings"] = bodies({"input": PROMPTS}, {
    "encoding_format": either(st.sampled_from(["float", "base64"])), "dimensions": either(INTS),
    "model": either(TEXT), "user": either(TEXT),
})  # fmt: skip
POST_ROUTES["/v1/rerank"] = bodies(
    {"query": either(WORDS), "documents": either(st.lists(WORDS, max_size=4))},
    {"top_n": COUNTS, "return_documents": either(st.booleans()), "instruction": either(TEXT)},
)  # fmt: skip
POST_ROUTES["/v1/messages/count_tokens"] = POST_ROUTES["/v1/messages"]
GET_ROUTES = ["/v1/models", "/models", "/health", "/v1/health", "/metrics", "/props", "/slots"]
QUERIES = st.sampled_from(["", "", "?fail_on_no_slot=1", "?fail_on_no_slot=x", "?a=%ff%fe&a"])


def requests(paths):
    """(method, path, body bytes): mostly the route's own method, sometimes the other one."""

    def one(path):
        own = ["POST"] * 9 + ["GET"] if path in POST_ROUTES else ["GET"] * 4 + ["POST", "DELETE"]
        method = st.sampled_from(own)
        data = POST_ROUTES[path] if path in POST_ROUTES else st.one_of(st.just(b""), RAW)
        return st.tuples(method, QUERIES.map(lambda q: path + q), data)

    return st.sampled_from(paths).flatmap(one)


def check(method: str, path: str, data: bytes, status: int, kind: str, answer: bytes) -> None:
    """A 200 with a well-formed answer, or a 4xx OpenAI-style error with a one-line message
    (Anthropic's on its routes)."""
    case = f"{method} {path} {data[:400]!r} -> {status} {answer[:600]!r}"
    anthropic = path.split("?")[0] in MESSAGES_ROUTES
    if status == 200:
        if kind.startswith("text/event-stream") and anthropic:
            frames = [f.split("\n") for f in answer.decode().strip().split("\n\n")]
            names = [f[0].removeprefix("event: ") for f in frames]
            assert names[0] == "message_start" and names[-1] == "message_stop", case
            assert all(json.loads(f[1].removeprefix("data: "))["type"] == n
                       for f, n in zip(frames, names, strict=True)), case  # fmt: skip
        elif kind.startswith("text/event-stream"):
            events = [e[6:] for e in answer.decode().split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]", case
            assert all("error" not in json.loads(e) for e in events[:-1]), case
        elif not path.startswith("/metrics"):
            json.loads(answer)
        return
    no_slot = status == 503 and path.startswith("/slots?fail_on_no_slot")
    assert 400 <= status < 500 or no_slot, case
    if anthropic:
        shaped = json.loads(answer)
        assert shaped["type"] == "error" and shaped["error"]["type"].endswith("_error"), case
        assert shaped["error"]["message"] and "\n" not in shaped["error"]["message"], case
        return
    error = json.loads(answer)["error"]
    assert error["code"] == status and error["message"] and "\n" not in error["message"], case


def fuzz(server, paths, examples: int) -> set:
    """Send `examples` generated requests to `paths`; the distinct ones sent (hypothesis
    repeats some)."""
    sent = set()

    @settings(FUZZ, max_examples=examples)
    @given(requests(paths))
    def one(request):
        method, path, data = request
        sent.add(request)
        status, kind, answer = send(server.port, method, path, data)
        check(method, path, data, status, kind, answer)

    one()
    return sent


# ---- the fuzz -----------------------------------------------------------------------------


def test_fuzzed_completions(server):
    assert len(fuzz(server, ["/v1/completions", "/completions"], 800)) >= 600


def test_fuzzed_chat(server):
    assert len(fuzz(server, ["/v1/chat/completions", "/chat/completions"], 700)) >= 500


def test_fuzzed_other_routes(server):
    paths = ["/tokenize", "/detokenize", "/reset_prefix_cache", *GET_ROUTES]
    assert len(fuzz(server, paths, 500)) >= 350


def test_fuzzed_messages(server):
    assert len(fuzz(server, MESSAGES_ROUTES, 500)) >= 350


def test_fuzzed_embeddings_and_rerank(server):
    assert len(fuzz(server, ["/v1/embeddings", "/v1/rerank"], 300)) >= 200


EXTREMES = [
    None, True, False, 0, -1, -2, 3.5, 2**31, 2**63, 2**70, -(2**70), 10**400, -(10**400), 1e308,
    -1e308, float("nan"), float("-inf"), "NaN", "", "\ud800", [], {}, [[[]]], {"a": {"b": 1}},
]  # fmt: skip


def test_every_field_with_every_extreme(server):
    """Not left to chance: each field of both completion routes set to each extreme value."""
    failures = []
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for path, base, fields in [("/v1/completions", {"prompt": PROMPT}, FIELDS),
                               ("/v1/chat/completions", chat, CHAT_FIELDS)]:  # fmt: skip
        for name in fields:
            for value in EXTREMES:
                body = {**base, "max_tokens": 1, "temperature": 0, name: value}
                data = _encode(body)
                status, kind, answer = send(server.port, "POST", path, data)
                try:
                    check("POST", path, data, status, kind, answer)
                except AssertionError:
                    shown = repr(value) if len(repr(value)) < 24 else f"<{len(repr(value))} chars>"
                    failures.append(f"{path} {name}={shown}: {status} {answer[:120]!r}")
    assert not failures, "\n".join(failures)


def engine_state(server) -> dict:
    def read(engine):  # engine state is read on the engine thread only
        return {**engine.kv_stats(), **engine.activity()}

    return server.worker.call(read).result(30)


def test_after_the_fuzz_nothing_is_held_and_answers_are_unchanged(server):
    def idle():
        s = engine_state(server)
        return (s["pages_in_use"], s["pages_reserved"], s["running"], s["queued"]) == (0, 0, 0, 0)

    assert wait_for(idle), engine_state(server)
    assert greedy(server) == server.reference
    slots = json.loads(send(server.port, "GET", "/slots")[2])
    assert [s["is_processing"] for s in slots] == [False] * 4
    assert server.worker.ready


# ---- what the fuzz asked for ---------------------------------------------------------------


def refusal(server, path: str, body) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, answer = send(server.port, "POST", path, data)
    return status, json.loads(answer)["error"]["message"]


def test_lone_surrogates_bad_json_and_non_booleans_are_400s(server):
    """JSON may escape half a UTF-16 pair, which no tokenizer can encode: refused wherever it
    is, by name; /tokenize's flags are JSON booleans, not anything truthy."""
    chat = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'
    cases = [
        ("/tokenize", b'{"content": "a\\ud800b"}', "content holds a lone UTF-16 surrogate"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udc00"]}', "prompt[1] holds a lone"),
        ("/v1/chat/completions", chat, "messages[0].content[0].text holds a lone"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop[0] holds a lone"),
        ("/v1/completions", b'{"prompt": "x", "cache_salt": "\\udfff"}', "cache_salt holds"),
        ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', "a key of the request body"),
        ("/tokenize", {"content": "x", "with_pieces": {"a": 1}}, "with_pieces = {'a': 1} is"),
        ("/tokenize", {"content": "x", "add_special": 1e308}, "add_special = 1e+308 is invalid"),
        ("/tokenize", {"content": "x", "add_special": 1}, "it must be true or false"),
        ("/v1/completions", b'{"prompt": ' + b"[" * 10**5 + b"]" * 10**5 + b"}", "too deeply"),
        ("/v1/completions", b'{"prompt": "x", "n": 1' + b"0" * 5000 + b"}", "not valid JSON"),
        ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', "not valid JSON ('utf-8' codec"),
    ]
    for path, body, words in cases:
        status, message = refusal(server, path, body)
        assert status == 400 and words in message and "\n" not in message, (body[:80], message)
    status, _, answer = send(server.port, "POST", "/tokenize", b'{"content": "\\ud83d\\ude00"}')
    assert status == 200 and json.loads(answer)["tokens"]  # a whole pair is a character


def test_max_tokens_is_a_count_or_minus_one(server):
    """max_tokens / max_completion_tokens: an integer in 0..2**31-1 or llama-server's -1
    (until the context ends); floats, strings, booleans, huge and other negative values are
    400s with one line."""
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    routes = [
        ("/v1/completions", {"prompt": PROMPT}, ["max_tokens"]),
        ("/v1/chat/completions", chat, ["max_tokens", "max_completion_tokens"]),
    ]
    for path, base, names in routes:
        for name in names:
            for value in (3.5, 4.0, "4", True, 2**31, 2**70, -2, -(2**70)):
                status, message = refusal(server, path, {**base, name: value})
                assert status == 400 and message.startswith(f"{name} = "), (name, value, message)
                assert "\n" not in message and len(message) < 200
    body = {"prompt": PROMPT, "max_tokens": -1, "temperature": 0, "ignore_eos": True}
    status, _, answer = send(server.port, "POST", "/v1/completions", json.dumps(body).encode())
    usage = json.loads(answer)["usage"]
    assert status == 200 and usage["completion_tokens"] == 512 - usage["prompt_tokens"]
    body = {**chat, "max_completion_tokens": 0}
    status, _, answer = send(server.port, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 0


# ---- /props and /slots ---------------------------------------------------------------------


def test_props(server, chat_model):
    status, _, data = send(server.port, "GET", "/props")
    props = json.loads(data)
    assert status == 200 and props["total_slots"] == 4 and props["model_path"] == str(chat_model)
    assert props["chat_template"] == TEMPLATE and props["bos_token"] == "<s>"
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["is_sleeping"] is False and jaxinfer.__version__ in props["build_info"]
    shown = props["default_generation_settings"]
    assert shown["n_ctx"] == server.worker.engine.max_seq_len == 512
    defaults = SamplingParams()
    params = shown["params"]
    for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                 "presence_penalty", "frequency_penalty"):  # fmt: skip
        assert params[name] == getattr(defaults, name), name
    assert params["seed"] == -1 and params["n_predict"] == params["max_tokens"] == -1


def _open_stream(server, prompt: str) -> http.client.HTTPConnection:
    body = {"prompt": prompt, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True, "seed": 5}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body))
    return conn


def test_slots_show_running_requests(server):
    status, _, data = send(server.port, "GET", "/slots?fail_on_no_slot=1")
    assert status == 200
    idle = json.loads(data)
    assert [s["id"] for s in idle] == [0, 1, 2, 3] and not any(s["is_processing"] for s in idle)
    assert idle[0]["next_token"] == {"has_next_token": False, "n_remain": -1, "n_decoded": 0}
    prompts = [f"{PROMPT} number {k}" for k in range(4)]
    streams = [_open_stream(server, p) for p in prompts]
    try:
        for conn in streams:
            assert conn.getresponse().readline().startswith(b"data: ")
        slots = json.loads(send(server.port, "GET", "/slots")[2])
        assert all(s["is_processing"] for s in slots)
        assert sorted(s["prompt"].strip() for s in slots) == prompts
        tokenize = server.worker.engine.tokenize  # the tokenizer only: safe off the engine thread
        budget = {p: 512 - len(tokenize(p)) for p in prompts}  # the rest of the context
        for s in slots:
            assert s["params"]["temperature"] == 0 and s["params"]["seed"] == 5
            assert s["params"]["n_predict"] == 2000 and s["params"]["ignore_eos"] is True
            progress = s["next_token"]
            assert progress["has_next_token"] and progress["n_decoded"] >= 1
            assert progress["n_decoded"] + progress["n_remain"] == budget[s["prompt"].strip()]
        status, _, data = send(server.port, "GET", "/slots?fail_on_no_slot=1")
        error = json.loads(data)["error"]
        assert status == 503 and error["type"] == "unavailable_error", data
    finally:
        for conn in streams:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
    assert wait_for(lambda: engine_state(server)["running"] == 0)
    slots = json.loads(send(server.port, "GET", "/slots?fail_on_no_slot=1")[2])
    assert not any(s["is_processing"] for s in slots)


def test_no_slots_flag_and_api_key(chat_model, serve_options):
    """Server(slots_endpoint=False) answers /slots with llama-server's 501 (its prompts stay
    private) and still serves /props; the API key guards /slots and /props. `--no-slots`
    reaches Server."""
    srv = Server(lambda: jaxinfer.load(chat_model, **PLAN), port=0, api_key="sekret",
                 slots_endpoint=False).start()  # fmt: skip
    try:
        assert send(srv.port, "GET", "/slots")[0] == 401  # the key comes first, even loading
        assert srv.worker.wait_ready(600), srv.worker.error
        key = {"Authorization": "Bearer sekret"}
        for path in ("/slots", "/props"):
            assert send(srv.port, "GET", path)[0] == 401
            assert send(srv.port, "GET", path, headers={"Authorization": "Bearer x"})[0] == 401
        status, _, data = send(srv.port, "GET", "/slots", headers=key)
        error = json.loads(data)["error"]
        assert status == 501 and "--no-slots" in error["message"], data
        status, _, data = send(srv.port, "GET", "/props", headers=key)
        assert status == 200 and json.loads(data)["endpoint_slots"] is False
    finally:
        srv.stop()

    assert serve_options("--no-slots").slots_endpoint is False
    assert serve_options().slots_endpoint is True


def test_server_options_are_checked_once_in_one_line():
    """ServerOptions (frozen, exported like EngineOptions) refuses a bad value when made, and
    Server takes either it or its keywords, never both and never an unknown one."""
    import dataclasses

    with pytest.raises(jaxinfer.JaxinferError, match=r"--port 70000 is invalid; use 0\.\.65535"):
        jaxinfer.ServerOptions(port=70000)
    with pytest.raises(jaxinfer.JaxinferError, match="api_key must be a non-empty string"):
        jaxinfer.ServerOptions(api_key="")
    with pytest.raises(jaxinfer.JaxinferError, match="unknown server option.*prot"):
        Server(lambda: None, prot=0)
    with pytest.raises(jaxinfer.JaxinferError, match="not both"):
        Server(lambda: None, jaxinfer.ServerOptions(), port=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        jaxinfer.ServerOptions().port = 1  # type: ignore[misc]
