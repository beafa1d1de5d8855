"""Tool calls (serve/tools.py, and chat.py's tool messages): format detection on faithful copies
of Qwen 2.5's and Llama 3.1's templates, rendering with tools against transformers' renderer,
the parser on hand-written answers and the stream reader on every cut of them, and the forcing
grammars sampled at random through llguidance, each call checked with jsonschema."""

import copy
import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest
from support.byte_grammar import BYTES, sample
from support.templates import LLAMA31, QWEN25

from jaxinfer.errors import RequestError
from jaxinfer.formats.tokenizer import Tokenizer
from jaxinfer.serve.chat import ChatTemplate, check_messages
from jaxinfer.serve.tools import ToolStream, check_tools, grammar, parse, tool_format

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12, "description": "e.g. {Paris}"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: arguments are {}
PLAN = {  # nesting, arrays, numbers, $ref into its own $defs, anyOf
    "type": "function",
    "function": {
        "name": "trip.plan-v2",
        "parameters": {
            "type": "object",
            "$defs": {"stop": {"type": "string", "pattern": "^[A-Z][a-z]{0,5}$"}},
            "properties": {
                "stops": {"type": "array", "items": {"$ref": "#/$defs/stop"}, "maxItems": 3},
                "days": {"type": "integer", "minimum": 1, "maximum": 30},
                "budget": {"type": "number", "minimum": -1.5, "maximum": 1000},
                "train": {"type": "boolean"},
                "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
                "who": {
                    "type": "object",
                    "properties": {"adults": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["adults"],
                    "additionalProperties": False,
                },
            },
            "required": ["stops", "days", "who"],
            "additionalProperties": False,
        },
    },
}
# names where one begins another
GET = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
GET_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, NOW]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "Thanks."},
]  # fmt: skip


# ---- formats and rendering ---------------------------------------------------------------


def test_tool_format_of_templates():
    assert tool_format(QWEN25) == "hermes"
    assert tool_format(LLAMA31) == "llama3_json"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    # XML arguments inside <tool_call> (Qwen3-Coder) and Mistral's [TOOL_CALLS]: their own rows
    # (tests/serve/test_tool_formats.py reads the real templates)
    assert tool_format("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}") == (
        "qwen3_coder"
    )
    assert tool_format('{{- "[TOOL_CALLS]" }}{{- \'"parameters": \' }}') == "mistral"


def _reference(template: str, messages, tools, bos: str, eos: str) -> str:
    """transformers' renderer, given the messages as vLLM passes them: arguments decoded."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    if not hasattr(utils, "render_jinja_template"):
        pytest.skip("this transformers has no render_jinja_template")
    decoded = copy.deepcopy(messages)
    for message in decoded:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    rendered, _ = utils.render_jinja_template(
        conversations=[decoded], tools=tools, chat_template=template,
        add_generation_prompt=True, bos_token=bos, eos_token=eos,
    )  # fmt: skip
    return rendered[0]


@pytest.mark.parametrize("template", [QWEN25, LLAMA31], ids=["qwen25", "llama31"])
def test_render_with_tools_matches_transformers(template):
    tok = Tokenizer.byte_level()
    ours = ChatTemplate(template, tok)
    messages = check_messages(CONVERSATION)
    text = ours.render(messages, tools=TOOLS)
    want = _reference(template, CONVERSATION, TOOLS, "<s>", "</s>")
    assert text == want
    assert ours.encode(messages, tools=TOOLS) == tok.encode(text.removeprefix("<s>"))
    assert '"name": "get_weather"' in text and '"city": "Paris"' in text  # the decoded call
    if template is QWEN25:
        assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) in text
        assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    # without tools the template gets None, as from transformers
    plain = [m for m in CONVERSATION if m["role"] in ("system", "user")][:2]
    assert ours.render(check_messages(plain)) == _reference(template, plain, None, "<s>", "</s>")


def test_check_messages_tool_calls():
    messages = check_messages(CONVERSATION)
    call = messages[2]["tool_calls"][0]
    assert call["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert call["id"] == "call_1" and messages[2]["content"] == ""
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # untouched
    unset = check_messages([{"role": "user", "content": "x", "tool_calls": None}])[0]
    assert "tool_calls" not in unset  # templates test `'tool_calls' in message`
    for bad, words in [
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
         "messages[0].tool_calls[0].function.arguments is not valid JSON"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
         "messages[0].tool_calls[0].function.arguments must be a JSON object"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
         "messages[0].tool_calls[0].function.name is missing"),
        ([{"role": "assistant", "tool_calls": [{"id": "c"}]}], "tool_calls[0].function is missing"),
        ([{"role": "assistant", "tool_calls": {"id": "c"}}], "messages[0].tool_calls must be"),
        ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
         "only assistant messages make tool calls"),
        ([{"role": "tool", "content": "21"}], "messages[0].tool_call_id is missing"),
        ([{"role": "tool", "content": None, "tool_call_id": "c"}], "messages[0].content"),
    ]:  # fmt: skip
        with pytest.raises(RequestError, match=re.escape(words)):
            check_messages(bad)


# ---- checking the request ----------------------------------------------------------------


def test_check_tools():
    assert check_tools({}) is None and check_tools({"tools": [], "tool_choice": "none"}) is None
    request = check_tools({"tools": TOOLS})
    assert (request.choice, request.name, request.parallel) == ("auto", None, True)
    assert request.tools is TOOLS and request.names == ["get_weather", "now"]
    named = {"type": "function", "function": {"name": "now"}}
    request = check_tools({"tools": TOOLS, "parallel_tool_calls": False, "tool_choice": named})
    assert (request.choice, request.name, request.parallel) == ("required", "now", False)
    assert check_tools({"tools": TOOLS, "tool_choice": "none"}).choice == "none"


def _tool(**function):
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "body, words",
    [
        ({"tools": "get_weather"}, "tools must be a list"),
        ({"tools": [WEATHER, _tool()]}, "tools[1].function.name is missing"),
        ({"tools": [{"type": "function"}]}, "tools[0].function is missing"),
        ({"tools": [{"function": WEATHER["function"]}]}, "tools[0].type is missing"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type = 'retrieval' is invalid"),
        ({"tools": [_tool(name="a b")]}, "tools[0].function.name = 'a b' is invalid"),
        ({"tools": [_tool(name="x" * 65)]}, "tools[0].function.name"),
        ({"tools": [_tool(name="f", description=3)]}, "tools[0].function.description"),
        ({"tools": [_tool(name="f", parameters=[])]}, "tools[0].function.parameters must be"),
        ({"tools": [_tool(name="f", parameters={"type": "string"})]},
         "tools[0].function.parameters.type = 'string' is invalid"),
        ({"tools": [NOW, NOW]}, "tools[1].function.name = 'now' is given twice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice = 'always' is invalid"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name = 'nope' is not in tools (get_weather, now)"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name is"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls = 'yes' is invalid"),
        ({"functions": [WEATHER["function"]]}, "functions is not supported; use tools"),
    ],
)  # fmt: skip
def test_check_tools_refuses(body, words):
    with pytest.raises(RequestError, match=re.escape(words)):
        check_tools(body)


# ---- parsing -----------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
NOW_CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
PARIS = {"city": "Zürich"}
# (format, answer, content, [(name, arguments)])
ANSWERS = [
    ("hermes", CALL, None, [("get_weather", PARIS)]),
    ("hermes", CALL + "\n" + NOW_CALL, None, [("get_weather", PARIS), ("now", {})]),
    ("hermes", "Let me check.\n\n" + CALL, "Let me check.", [("get_weather", PARIS)]),
    ("hermes", "  Two:" + CALL + " \n" + NOW_CALL + "\nDone. ", "  Two:\nDone.",
     [("get_weather", PARIS), ("now", {})]),
    ("hermes", CALL[: -len("</tool_call>")], None, [("get_weather", PARIS)]),  # stopped early
    ("hermes", CALL + "\n" + NOW_CALL[:-13], None, [("get_weather", PARIS), ("now", {})]),
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}\n</tool_call>', None, []),  # bad JSON
    ("hermes", 'x <tool_call>\n{"arguments": {}}\n</tool_call>', None, []),  # no name
    ("hermes", CALL + "\n<tool_call>\n{oops}\n</tool_call>", None, []),  # one bad call: no calls
    ("hermes", "Use <tool_ca and <b>tags</b>, <tool\n", None, []),
    ("hermes", "", None, []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Zürich"}}', None,
     [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "now", "arguments": {}}', None, [("now", {})]),
    ("llama3_json", ' {"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": '
     '{"city": "Zürich"}};', None, [("now", {}), ("get_weather", PARIS)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', None, []),  # cut
    ("llama3_json", '{"name": "now", "parameters": {}} and more', None, []),
    ("llama3_json", '{"answer": 42}', None, []),
    ("llama3_json", "The weather is {sunny}.", None, []),
    ("llama3_json", "<|python_tag|>brave_search.call(query=\"x\")", None, []),
    ("llama3_json", "  <b>bold</b>", None, []),
]  # fmt: skip


def _calls(calls):
    for call in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["type"] == "function"
    assert len({call["id"] for call in calls}) == len(calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt, answer, content, calls", ANSWERS)
def test_parse(fmt, answer, content, calls):
    got_content, got_calls = parse(answer, fmt)
    assert _calls(got_calls) == calls
    assert got_content == (content if calls else answer)  # no call: the text as it is
    if calls and "Zürich" in answer:
        assert any("Zürich" in c["function"]["arguments"] for c in got_calls)  # not \u-escaped


@pytest.mark.parametrize("fmt, answer, content, calls", ANSWERS)
def test_tool_stream_matches_parse(fmt, answer, content, calls):
    want_content, want_calls = parse(answer, fmt)
    want = want_content or ""
    cuts = [[answer[:i], answer[i:]] for i in range(len(answer) + 1)]
    for pieces in [list(answer), *cuts]:  # every character alone, and every cut in two
        stream, sent = ToolStream(fmt), ""
        for piece in pieces:
            sent += stream.feed(piece)
            assert want.startswith(sent)  # nothing sent is taken back: no part of a call
        rest, got_calls = stream.finish()
        assert sent + rest == want and _calls(got_calls) == _calls(want_calls)
    if calls and fmt == "hermes":
        assert "<" not in sent  # not even the start of <tool_call>


# ---- forcing calls -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
@pytest.mark.parametrize(
    "tools", [[WEATHER], [WEATHER, NOW, PLAN], [GET, GET_TIME, PLAN]], ids=["1", "3", "prefix"]
)
def test_grammar_forces_valid_calls(fmt, tools):
    rng = np.random.default_rng(len(tools) + len(fmt))
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    choices = [("required", True), ("required", False)]
    choices += [({"type": "function", "function": {"name": name}}, True) for name in schemas]
    several = 0
    for choice, parallel in choices:
        body = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
        request = check_tools(body)
        text = grammar(request, fmt)
        assert text.startswith("%llguidance {}")
        assert llguidance.LLMatcher.validate_grammar(text, BYTES) == ""
        for _ in range(4):
            answer = sample(text, rng)
            content, calls = parse(answer, fmt)
            assert content is None and calls, answer
            if request.name or not parallel or fmt == "llama3_json":
                assert len(calls) == 1, answer
            several += len(calls) > 1
            for name, arguments in _calls(calls):
                assert name == request.name if request.name else name in schemas
                jsonschema.validate(arguments, schemas[name])
            if fmt == "hermes":
                assert answer.startswith("<tool_call>\n{") and answer.endswith("}\n</tool_call>")
    assert several or fmt == "llama3_json"  # "required" with parallel calls does make several


def test_grammar_refuses_other_calls():
    named = {"type": "function", "function": {"name": "now"}}
    text = grammar(check_tools({"tools": TOOLS, "tool_choice": named}), "hermes")
    for answer, ok in [
        (NOW_CALL, True),
        (CALL, False),  # not the named function
        ('<tool_call>\n{"name": "now", "arguments": {"x": 1}}\n</tool_call>', False),
        ("Sure! " + NOW_CALL, False),
        # JSON whitespace is bounded: one space, or a newline and up to 20 spaces or tabs
        (NOW_CALL.replace("{}", "{\n" + " " * 20 + "}"), True),
        (NOW_CALL.replace("{}", "{\n" + " " * 21 + "}"), False),
        (NOW_CALL.replace("{}", "{  }"), False),
    ]:
        matcher = llguidance.LLMatcher(BYTES, text, log_level=0)
        data = list(answer.encode())
        assert (matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()) == ok
    text = grammar(check_tools({"tools": TOOLS, "tool_choice": "required"}), "llama3_json")
    matcher = llguidance.LLMatcher(BYTES, text, log_level=0)
    call = b'{"name": "get_weather", "parameters": {"city": "Rome", "unit": "kelvin"}}'
    assert matcher.try_consume_tokens(list(call)) < len(call)


def test_grammar_is_none_for_free_answers():
    assert grammar(None, "hermes") is None
    for choice in ("auto", "none"):
        assert grammar(check_tools({"tools": TOOLS, "tool_choice": choice}), "hermes") is None


def test_grammar_names_the_schema_it_cannot_enforce():
    when = {"when": {"type": "string", "format": "stardate"}}
    odd = _tool(name="f", parameters={"type": "object", "properties": when})
    request = check_tools({"tools": [NOW, odd], "tool_choice": "required"})
    with pytest.raises(RequestError, match=re.escape("tools[1].function.parameters cannot be")):
        grammar(request, "hermes")
