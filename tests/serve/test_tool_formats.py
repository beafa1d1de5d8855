"""Tool-call formats (serve/tool_formats.py), each row against the real chat templates that
teach it (tests/fixtures/templates): the template picks its row; an assistant turn with two
typed calls, rendered by transformers' Jinja renderer, reads back to the same calls and
content, whole and fed to the stream reader cut at every character, no tag ever in the
streamed content; hand-written answers (content around calls, a call inside <think>, broken
and cut-off calls, a forced answer stopped at every byte); the forcing grammars through
llguidance (a call in the format's layout accepted, invented keys refused, random answers
valid under jsonschema); end to end, stories260K and a tiny-random byte-level model, each
served with the format's templates and forced to call through the official openai client,
streamed and not; and Mistral's tags as special tokens (as its tokenizers have them), which
chat answers keep for the parser and completions skip."""

import json
import random
import re
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest
from support.byte_grammar import BYTES, sample
from support.models import STORIES_HF, client_of, live_server, model_path, with_chat_template

import jaxinfer
from jaxinfer.errors import JaxinferError
from jaxinfer.formats.tokenizer import Tokenizer
from jaxinfer.options import TOOL_CALL_FORMATS, ServerOptions
from jaxinfer.serve.chat import ChatTemplate
from jaxinfer.serve.openai_api import chat_job, completion_job
from jaxinfer.serve.tool_formats import TABLE
from jaxinfer.serve.tools import ToolStream, check_tools, grammar, parse, tool_format

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
QWEN3_MOE = "tiny-random/qwen3_moe_e8k2_bpe"  # byte-level BPE: any text is some token path

# ---- the formats as the templates document them (written here, not by the code under test) --


def _bare(value) -> str:
    """A value in an XML format, as Qwen3.5's and GLM-4.6's templates write it."""
    return value if isinstance(value, str) else json.dumps(value)


BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
WRITE = {  # one call (name, arguments) in each format's layout
    "hermes": lambda n, a: (
        f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>'
    ),
    "llama3_json": lambda n, a: f'{{"name": "{n}", "parameters": {json.dumps(a)}}}',
    "qwen3_coder": lambda n, a: (
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{_bare(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
    ),
    "glm45": lambda n, a: (
        f"<tool_call>{n}\n"
        + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{_bare(v)}</arg_value>\n" for k, v in a.items()
        )
        + "</tool_call>"
    ),
    "mistral": lambda n, a: json.dumps({"name": n, "arguments": a}),
    "mistral_v11": lambda n, a: f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}",
    "deepseek_v3": lambda n, a: f"{CALL}function{SEP}{n}\n```json\n{json.dumps(a)}\n```{CALL_END}",
    "deepseek_v31": lambda n, a: f"{CALL}{n}{SEP}{json.dumps(a)}{CALL_END}",
}
FRAME = {  # several calls: before, between, after
    "hermes": ("", "\n", ""),
    "llama3_json": ("", "; ", ""),
    "qwen3_coder": ("", "\n", ""),
    "glm45": ("", "\n", ""),
    "mistral": ("[TOOL_CALLS][", ", ", "]"),
    "mistral_v11": ("", "", ""),
    "deepseek_v3": (BEGIN, "\n", END),
    "deepseek_v31": (BEGIN, "", END),
}
TAGS = {  # what no streamed content may hold once the answer calls
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ('{"name"', "<|python_tag|>"),
    "qwen3_coder": ("<tool_call>", "<function=", "<parameter=", "</tool_call>"),
    "glm45": ("<tool_call>", "<arg_key>", "<arg_value>"),
    "mistral": ("[TOOL_CALLS]",),
    "mistral_v11": ("[TOOL_CALLS]", "[ARGS]"),
    "deepseek_v3": ("<｜tool", "```json"),
    "deepseek_v31": ("<｜tool",),
}


def _write(fmt: str, calls) -> str:
    before, between, after = FRAME[fmt]
    return before + between.join(WRITE[fmt](name, args) for name, args in calls) + after


def _shape(calls, fmt: str) -> list[tuple[str, str]]:
    """(name, arguments as sorted JSON: 5 and 5.0, true and 1 differ) of OpenAI tool_calls;
    ids as the format's templates want them back, each different."""
    want_id = r"[0-9a-zA-Z]{9}" if fmt.startswith("mistral") else r"call_[0-9a-f]{24}"
    for call in calls:
        assert re.fullmatch(want_id, call["id"]) and call["type"] == "function"
    assert len({call["id"] for call in calls}) == len(calls)
    return [
        (c["function"]["name"], json.dumps(json.loads(c["function"]["arguments"]), sort_keys=True))
        for c in calls
    ]


def _sorted(calls) -> list[tuple[str, str]]:
    return [(name, json.dumps(args, sort_keys=True)) for name, args in calls]


def _splits(text: str, seed: int) -> list[list[str]]:
    """The text a character at a time, cut in two at every place, and cut at random."""
    rng = random.Random(seed)
    out = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 9))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def _check_stream(fmt: str, answer: str, request=None, every_cut: bool = True) -> None:
    """Streamed at every cut (or a character at a time and at random cuts), the reader gives
    parse's content and calls; nothing it sends is taken back, and with calls no sent piece
    holds any tag of the format."""
    want_content, want_calls = parse(answer, fmt, request)
    want = want_content or ""
    clean = want_calls and not any(tag in want for tag in TAGS[fmt])
    splits = _splits(answer, len(answer))
    for pieces in splits if every_cut else splits[:1] + splits[len(answer) + 2 :]:
        stream, sent = ToolStream(fmt, request), ""
        for piece in pieces:
            out = stream.feed(piece)
            sent += out
            assert want.startswith(sent), (pieces, sent)
            assert not (clean and any(tag in out for tag in TAGS[fmt]))
        rest, calls = stream.finish()
        assert sent + rest == want
        assert _shape(calls, fmt) == _shape(want_calls, fmt)


# ---- the real templates --------------------------------------------------------------------

# file: (its row, where the assistant's turn starts and ends in the rendered text (None: the
# text's end), whether it writes the turn's content beside calls, how many calls it writes)
TEMPLATES = {
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": (
        "hermes",
        "<|im_start|>assistant\n",
        "<|im_end|>",
        False,
        2,
    ),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": (
        "llama3_json",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
        False,
        1,
    ),
    "Qwen3-Coder.jinja": ("qwen3_coder", "<|im_start|>assistant\n", "<|im_end|>", True, 2),
    "Qwen3.5-4B.jinja": ("qwen3_coder", "<|im_start|>assistant\n", "<|im_end|>", True, 2),
    "GLM-4.6.jinja": ("glm45", "<|assistant|>", None, True, 2),
    "glm_4_5.jinja": ("glm45", "<|assistant|>", None, True, 2),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", "[/INST]", "</s>", False, 2),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral_v11", "[/INST]", "</s>", False, 2),
    "unsloth-mistral-Devstral-Small-2507.jinja": ("mistral_v11", "[/INST]", "</s>", True, 2),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": (
        "deepseek_v3",
        "<｜Assistant｜>",
        "<｜end▁of▁sentence｜>",
        False,
        2,
    ),
    "deepseek-ai-DeepSeek-V3.1.jinja": (
        "deepseek_v31",
        "<｜Assistant｜></think>",
        "<｜end▁of▁sentence｜>",
        True,
        2,
    ),
}
NO_TOOLS = "microsoft-Phi-3.5-mini-instruct.jinja"
QUESTION = "What is the weather in Paris, and can you plan the trip?"


def _function(name: str, properties: dict, required=(), **more) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(required), **more}
    return {
        "type": "function",
        "function": {"name": name, "description": f"The {name}.", "parameters": parameters},
    }


def _described(**properties) -> dict:
    return {k: {**v, "description": k} for k, v in properties.items()}


RENDERED_TOOLS = [
    _function(
        "get_weather",
        _described(city={"type": "string"}, days={"type": "integer"}, code={"type": "string"}),
        ["city"],
    ),
    _function(
        "plan",
        _described(
            budget={"type": "number"},
            train={"type": "boolean"},
            who={"type": "object"},
            note={"anyOf": [{"type": "string"}, {"type": "null"}]},
        ),
    ),
]
# typed arguments: a string with a newline, an integer, a string of digits (stays a string), a
# number, a boolean, an object, a null
WEATHER_ARGS = {"city": "Paris\nNord", "days": 5, "code": "007"}
PLAN_ARGS = {"budget": 12.5, "train": True, "who": {"adults": 2, "kids": [1]}, "note": None}


def _render(template: str, messages, tools) -> str:
    """transformers' renderer (not the code under test)."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    if not hasattr(utils, "render_jinja_template"):
        pytest.skip("this transformers has no render_jinja_template")
    rendered, _ = utils.render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=template,
        add_generation_prompt=False,
        bos_token="<s>",
        eos_token="</s>",
    )
    return rendered[0]


def _visible(content: str | None) -> str | None:
    """Content less the (empty) reasoning block GLM's templates write before it."""
    if content is None:
        return None
    return content.split("</think>")[-1].strip() or None


def test_each_real_template_picks_its_row():
    for name, (fmt, *_) in TEMPLATES.items():
        assert tool_format((FIXTURES / name).read_text()) == fmt, name
    assert tool_format((FIXTURES / NO_TOOLS).read_text()) is None
    assert set(fmt for fmt, *_ in TEMPLATES.values()) == set(TABLE)  # every row has a template
    assert tuple(TABLE) == TOOL_CALL_FORMATS  # the names serve --tool-call-format takes


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_templates_own_calls_read_back(name):
    fmt, start, stop, keeps_content, n = TEMPLATES[name]
    calls = [("get_weather", WEATHER_ARGS), ("plan", PLAN_ARGS)][:n]
    as_text = name.startswith("deepseek")  # its templates concatenate the arguments' JSON text
    tool_calls = [
        {
            "id": f"abcdefgh{k}",
            "type": "function",
            "function": {"name": c, "arguments": json.dumps(a) if as_text else a},
        }
        for k, (c, a) in enumerate(calls)
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Let me look.", "tool_calls": tool_calls},
    ]
    full = _render((FIXTURES / name).read_text(), messages, RENDERED_TOOLS)
    at = full.index(start, full.rindex(QUESTION)) + len(start)
    end = full.find(stop, at) if stop else -1
    answer = full[at : end if end >= 0 else len(full)]
    request = check_tools({"tools": RENDERED_TOOLS})
    content, got = parse(answer, fmt, request)
    assert _shape(got, fmt) == _sorted(calls), answer
    assert _visible(content) == ("Let me look." if keeps_content else None), answer
    _check_stream(fmt, answer, request)


# ---- hand-written answers ------------------------------------------------------------------

SUNNY = ("get_weather", {"city": "Zürich", "days": 2})
# a string value may hold the tags that end other parts of a call (the grammars allow it)
TAGGED = (
    "get_weather",
    {"city": "a</tool_call>b</function><parameter=x>[TOOL_CALLS][ARGS]</think>", "days": 3},
)
TRAIN = ("plan", {"train": False, "who": {"adults": 1}})
BROKEN = {  # a call that does not read: bad JSON, a missing tag or value
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    "</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": 5}]',
    "mistral_v11": "[TOOL_CALLS]get_weather[ARGS]{oops}",
    "deepseek_v3": f"{BEGIN}{CALL}function{SEP}get_weather\n```json\n{{oops}}\n```{CALL_END}{END}",
    "deepseek_v31": f"{BEGIN}{CALL}get_weather{SEP}{{oops}}{CALL_END}{END}",
}
ANYWHERE = [fmt for fmt in TABLE if fmt != "llama3_json"]  # calls may follow content


def _answers(fmt: str):
    """(what, answer, content, calls) in format `fmt`."""
    one, two = _write(fmt, [SUNNY]), _write(fmt, [TRAIN])
    both = _write(fmt, [SUNNY, TRAIN])
    partial = FRAME[fmt][0] + WRITE[fmt](*SUNNY)
    partial = partial[: len(partial) // 2]
    return [
        ("alone", both, None, [SUNNY, TRAIN]),
        ("tags in a value", _write(fmt, [TAGGED, TRAIN]), None, [TAGGED, TRAIN]),
        ("around", "Sure.\n\n" + both + "\nDone. ", "Sure.\nDone.", [SUNNY, TRAIN]),
        ("think only", f"<think>Maybe {one} no.</think>\nNo need.", None, []),
        (
            "think then",
            f"<think>Maybe {one}</think>\n\nOK.\n{two}",
            f"<think>Maybe {one}</think>\n\nOK.",
            [TRAIN],
        ),
        ("broken", "Sure. " + BROKEN[fmt], None, []),
        ("cut off", both[: -len(WRITE[fmt](*TRAIN)) // 2], None, [SUNNY]),  # max_tokens
        ("cut in a tag", both + "\n" + partial[:4], None, [SUNNY, TRAIN]),
        ("cut before any", "Let me see. " + partial, None, []),
        ("a partial tag", "Use " + partial[:5], None, []),
    ]


@pytest.mark.parametrize("fmt", ANYWHERE)
def test_hand_written_answers(fmt):
    request = check_tools({"tools": RENDERED_TOOLS})  # types the XML formats' values
    for what, answer, content, calls in _answers(fmt):
        got_content, got = parse(answer, fmt, request)
        assert _shape(got, fmt) == _sorted(calls), (what, answer)
        assert got_content == (content if calls else answer), what  # no call: the text as is
        _check_stream(fmt, answer, request)


@pytest.mark.parametrize("fmt", list(TABLE))
def test_a_forced_answer_stopped_at_any_byte_keeps_its_tags_out_of_content(fmt):
    """A forced answer (the grammar's layout) that max_tokens stopped at any byte, decoded as
    decoding writes a character it stopped inside (U+FFFD): once its first call is written the
    calls read, and whenever calls read no piece of a tag is content, whole or streamed (the
    call it stopped in, taken as it is, may lack arguments). Served on the byte-level fixture
    ("required"), DeepSeek V3.1 stopped inside the "▁" of a fourth call's
    <｜tool▁call▁begin｜> and "<｜tool▁call\ufffd" reached content; so did a stop inside
    <｜tool▁calls▁end｜> or a block's </tool_call>, or before Mistral's closing "]", and GLM
    took a name it stopped inside for the call's."""
    request = check_tools({"tools": RENDERED_TOOLS})
    calls = [SUNNY, TRAIN][: 1 if fmt == "llama3_json" else 2]
    text = _write(fmt, calls)
    answer, first = text.encode(), len((FRAME[fmt][0] + WRITE[fmt](*calls[0])).encode())
    # stopped inside the answer's closing tag, past its "<" (which may begin GLM's
    # <arg_key>), the last call stands too
    closing = next((tag for tag in ("</tool_call>", END) if text.endswith(tag)), "")
    whole = len(answer) - len(closing.encode()) + 2 if closing else len(answer)
    for n in range(1, len(answer) + 1):
        cut = answer[:n].decode(errors="replace")
        content, got = parse(cut, fmt, request)
        assert content is None if got else n < first, cut
        assert n < whole or _shape(got, fmt) == _sorted(calls), cut
        assert [c["function"]["name"] for c in got] == [name for name, _ in calls][: len(got)]
        assert _shape(got, fmt)[:-1] == _sorted(calls)[: len(got)][:-1], cut
        if got:
            stream = ToolStream(fmt, request)
            assert "".join(stream.feed(char) for char in cut) == "", cut
            assert stream.finish()[0] == "", cut


def test_llama3_json_calls_only_as_the_whole_answer():
    both = _write("llama3_json", [SUNNY, TRAIN])
    assert _shape(parse(both, "llama3_json")[1], "llama3_json") == _sorted([SUNNY, TRAIN])
    for answer in (both, "Sure. " + both, "<think>x</think>" + both, both + " and more"):
        _check_stream("llama3_json", answer)
    assert parse("Sure. " + both, "llama3_json") == ("Sure. " + both, [])


def test_xml_values_are_typed_by_the_schema():
    """Bare XML values: a string is the text, anything else JSON, or the Python literal that
    Jinja's `string` filter writes, else the text (vLLM's qwen3_coder rule)."""
    props = {
        "n": {"type": "integer"},
        "x": {"type": "number"},
        "b": {"type": "boolean"},
        "s": {"type": "string"},
        "o": {"type": "object"},
        "a": {"type": "array"},
        "z": {"type": "null"},
        "u": {},
        "e": {"enum": [1, 2]},
        "m": {"type": ["integer", "string"]},
        "r": {"$ref": "#/$defs/count"},
        "bad": {"type": "integer"},
    }
    tool = _function("f", props, **{"$defs": {"count": {"type": "integer"}}})
    request = check_tools({"tools": [tool]})
    written = {
        "n": "5",
        "x": "2.5",
        "b": "True",
        "s": "5",
        "o": "{'k': [1, None]}",
        "a": "[1, 2]",
        "z": "null",
        "u": "5",
        "e": "2",
        "m": "7",
        "r": "3",
        "bad": "five",
        "extra": "8",
    }
    want = {
        "n": 5,
        "x": 2.5,
        "b": True,
        "s": "5",
        "o": {"k": [1, None]},
        "a": [1, 2],
        "z": None,
        "u": "5",
        "e": 2,
        "m": 7,
        "r": 3,
        "bad": "five",
        "extra": "8",
    }
    for fmt in ("qwen3_coder", "glm45"):
        answer = WRITE[fmt]("f", written)
        _, calls = parse(answer, fmt, request)
        assert _shape(calls, fmt) == _sorted([("f", want)])
        _, untyped = parse(answer, fmt)  # no schemas: every value is text
        assert json.loads(untyped[0]["function"]["arguments"]) == written


# ---- forcing calls -------------------------------------------------------------------------


WEATHER = _function(
    "get_weather",
    {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 30},
    },
    ["city"],
)
PLAN = _function(
    "plan",
    {  # no additionalProperties, here and in "who"
        "budget": {"type": "number", "minimum": 0, "maximum": 1000},
        "train": {"type": "boolean"},
        "who": {
            "type": "object",
            "properties": {"adults": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["adults"],
        },
        "note": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
    },
    ["train", "who"],
)
NOW = {"type": "function", "function": {"name": "now"}}
OPEN = _function(
    "tag",
    {"tag": {"type": "string", "maxLength": 5}},
    additionalProperties={"type": "integer", "minimum": 0, "maximum": 9},
)
FORCE_TOOLS = [WEATHER, PLAN, NOW, OPEN]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {}) for t in FORCE_TOOLS}


def _accepts(grammar_text: str, answer: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar_text, log_level=0)
    data = list(answer.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("fmt", list(TABLE))
def test_grammar_takes_the_call_and_refuses_invented_keys(fmt):
    def text(name):
        request = check_tools({"tools": FORCE_TOOLS, "tool_choice": _named(name)})
        return grammar(request, fmt)

    weather, plan = {"city": "Rome", "days": 3}, {"train": True, "who": {"adults": 2}}
    assert _accepts(text("get_weather"), _write(fmt, [("get_weather", weather)]))
    assert _accepts(text("plan"), _write(fmt, [("plan", plan)]))
    assert _accepts(text("now"), _write(fmt, [("now", {})]))
    assert _accepts(text("get_weather"), _write(fmt, [("get_weather", {"city": "</function>"})]))
    # additionalProperties absent: no other keys, at the top and inside "who"
    assert not _accepts(text("get_weather"), _write(fmt, [("get_weather", {**weather, "x": 1})]))
    assert not _accepts(
        text("plan"), _write(fmt, [("plan", {**plan, "who": {"adults": 2, "x": 1}})])
    )
    assert not _accepts(text("now"), _write(fmt, [("now", {"x": 1})]))
    # explicit additionalProperties: kept
    assert _accepts(text("tag"), _write(fmt, [("tag", {"tag": "a", "more": 5})]))
    assert not _accepts(text("tag"), _write(fmt, [("tag", {"tag": "a", "more": "b"})]))
    # a required parameter must be there; the named function only
    assert not _accepts(text("plan"), _write(fmt, [("plan", {"train": True})]))
    assert not _accepts(text("plan"), _write(fmt, [("get_weather", weather)]))


@pytest.mark.parametrize("fmt", list(TABLE))
def test_forced_answers_are_valid_calls(fmt):
    """Random answers through each forcing grammar parse to calls whose arguments validate
    against the tool's schema and hold no key it does not list (unless it says
    additionalProperties)."""
    rng = np.random.default_rng(len(fmt))
    choices = [
        ("required", True),
        ("required", False),
        (_named("plan"), True),
        (_named("tag"), True),
    ]
    several = 0
    for choice, parallel in choices:
        body = {"tools": FORCE_TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
        request = check_tools(body)
        text = grammar(request, fmt)
        assert llguidance.LLMatcher.validate_grammar(text, BYTES) == ""
        for _ in range(3):
            answer = sample(text, rng)
            content, calls = parse(answer, fmt, request)
            assert content is None and calls, answer
            if request.name or not parallel or fmt == "llama3_json":
                assert len(calls) == 1, answer
            several += len(calls) > 1
            for name, args in [
                (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
            ]:
                assert name == request.name if request.name else name in SCHEMAS
                schema = SCHEMAS[name] if name != "now" else {"type": "object"}
                jsonschema.validate(args, schema)
                if name != "tag":
                    assert set(args) <= set(schema.get("properties", {})), answer
            _check_stream(fmt, answer, request, every_cut=False)
    assert several or fmt == "llama3_json"  # "required" with parallel calls does make several


def test_tool_call_format_option_and_flag(monkeypatch, capsys):
    """`serve --tool-call-format NAME` reaches ServerOptions (a stand-in Server records them);
    a name outside the table is refused by the flag and by the options."""
    import jaxinfer.serve.server as server_module
    from jaxinfer.cli import main

    seen = []

    class Recorder:
        url = "http://127.0.0.1:0"

        def __init__(self, load, options, on_ready=None, join=None):
            seen.append(options)

        def run(self):
            pass

    monkeypatch.setattr(server_module, "Server", Recorder)
    assert main(["serve", "--port", "0", "--tool-call-format", "glm45"]) == 0
    assert main(["serve", "--port", "0"]) == 0
    assert [o.tool_call_format for o in seen] == ["glm45", "auto"]
    with pytest.raises(SystemExit):
        main(["serve", "--tool-call-format", "xml"])
    assert "invalid choice: 'xml'" in capsys.readouterr().err
    with pytest.raises(JaxinferError, match="--tool-call-format 'xml' is not supported"):
        ServerOptions(tool_call_format="xml")


# ---- end to end ----------------------------------------------------------------------------

CALL_TOOLS = [  # small bounds: a tiny model's free text and numbers end
    _function(
        "get_weather",
        {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        ["city"],
    ),
    _function(
        "plan",
        {"budget": {"type": "number", "minimum": 0, "maximum": 100}, "train": {"type": "boolean"}},
        ["train"],
    ),
]
# case (its format, then a name): (template, extra body). Thinking templates are asked not to
# think (a tiny model never stops).
SERVED = {
    "hermes": ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", {}),
    "llama3_json": ("meta-llama-Llama-3.2-3B-Instruct.jinja", {}),
    "qwen3_coder": ("Qwen3-Coder.jinja", {}),
    "qwen3_coder-qwen3.5": (
        "Qwen3.5-4B.jinja",
        {"chat_template_kwargs": {"enable_thinking": False}},
    ),
    "glm45": ("GLM-4.6.jinja", {}),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", {}),
    "mistral_v11": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", {}),
    "deepseek_v3": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", {"thinking_budget": 0}),
    "deepseek_v31": ("deepseek-ai-DeepSeek-V3.1.jinja", {}),
}
# Each case runs on two models. stories260K: a SentencePiece vocabulary (byte fallback) that
# writes every tag piece by piece; DeepSeek's tags hold "▁" (U+2581), which it decodes as a
# space, so not DeepSeek's rows. And the tiny-random Qwen3-MoE: its byte-level BPE vocabulary
# (the Qwen fixtures share it; mixtral_e8k2 has stories260K's very one) spells every tag
# exactly, and a byte at a time where it likes. In the real models' tokenizers most of these
# tags are special tokens (GLM's <tool_call> and <arg_key>, Mistral's [TOOL_CALLS] and [ARGS],
# DeepSeek's <｜tool▁…｜>, Qwen's and Hermes's <tool_call>); this fixture's only specials are
# <|endoftext|>, <|im_start|> and <|im_end|> (the ChatML turns of the Hermes and Qwen
# templates), so the grammar writes every tag as text.
SERVED_ON = {
    STORIES_HF: [case for case in SERVED if not case.startswith("deepseek")],
    QWEN3_MOE: list(SERVED),
}
PLAN_OPTIONS = dict(slots=1, max_seq_len=2048, prefill_buckets=(128,), batch_buckets=(1,))


def _serve_and_force(fmt: str, template: str, model: str, extra: dict, **options) -> None:
    """The model served with a real template: /props names the format, and forced calls
    (required, a named function; streamed and not) reach the openai client valid under the
    tool's schema, with no content at all (so no tag in any chunk)."""
    import urllib.request

    source = (FIXTURES / template).read_text()
    path = model_path(model)
    with live_server(
        lambda: jaxinfer.load(path, **PLAN_OPTIONS), chat_template=source, **options
    ) as srv:
        with urllib.request.urlopen(srv.url + "/props", timeout=60) as response:
            assert json.load(response)["tool_call_format"] == fmt
        client = client_of(srv)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in CALL_TOOLS}
        ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
        for choice in ("required", _named("plan")):
            kw = dict(
                model="m",
                messages=ask,
                tools=CALL_TOOLS,
                tool_choice=choice,
                max_tokens=300,
                temperature=1.0,
                seed=0,
                extra_body=extra or None,
            )
            answer = client.chat.completions.create(**kw).choices[0]
            assert answer.finish_reason == "tool_calls" and answer.message.content is None
            made = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
            streamed: dict[int, list[str]] = {}
            finish = None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for delta in chunk.choices:
                    assert not delta.delta.content, delta.delta.content  # not a tag, nor text
                    for call in delta.delta.tool_calls or ():
                        entry = streamed.setdefault(call.index, ["", ""])
                        entry[0] += call.function.name or ""
                        entry[1] += call.function.arguments or ""
                    finish = delta.finish_reason or finish
            assert finish == "tool_calls" and streamed
            for name, arguments in made + [tuple(streamed[i]) for i in sorted(streamed)]:
                assert name == "plan" if choice != "required" else name in schemas
                jsonschema.validate(json.loads(arguments), schemas[name])
            assert made


@pytest.mark.parametrize(
    ("case", "model"),
    [
        pytest.param(
            case,
            model,
            id=f"{case}-{model.split('/')[-1]}",
            # stories260K's qwen3_coder in the default tier; its other formats are slow
            marks=() if model != STORIES_HF or case == "qwen3_coder" else pytest.mark.slow,
        )
        for model, cases in SERVED_ON.items()
        for case in cases
    ],
)
def test_served_formats_force_valid_calls(case, model):
    template, extra = SERVED[case]
    _serve_and_force(case.split("-")[0], template, model, extra)


@pytest.mark.slow
def test_tool_call_format_names_the_format_of_a_template_without_one():
    """--tool-call-format: a template that shows no tools (Phi-3.5) still gets GLM's calls."""
    _serve_and_force("glm45", NO_TOOLS, STORIES_HF, {}, tool_call_format="glm45")


@pytest.mark.parametrize("name", ["deepseek-ai-DeepSeek-V3.1.jinja", "Qwen3-Coder.jinja"])
def test_a_call_sent_back_renders_whether_the_template_wants_text_or_an_object(name):
    """DeepSeek's templates add a call's arguments to a string (OpenAI's JSON text), Qwen's
    read them as an object: a conversation that sends a call back renders with both."""
    from jaxinfer.formats.tokenizer import Tokenizer
    from jaxinfer.serve.chat import ChatTemplate, check_messages

    template = ChatTemplate((FIXTURES / name).read_text(), Tokenizer.byte_level())
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = check_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ])  # fmt: skip
    text = template.render(messages)
    assert "get_weather" in text and "Paris" in text and "sunny" in text


# ---- tags that are special tokens ----------------------------------------------------------

# Mistral's tokenizers (tokenizer.json, GGUF) make its tags control tokens, which decoding
# skips. Five characters of stories260K's vocabulary that no merge makes or uses become those
# tags here, special, so that the model can write them.
MISTRAL_TAGS = {"™": "[TOOL_CALLS]", "\u200a": "[ARGS]", "€": "[CALL_ID]", "â": "[THINK]",
                "\xa0": "[/THINK]"}  # fmt: skip
MISTRAL_V11 = "Mistral-Small-3.2-24B-Instruct-2506.jinja"
WEATHER = _function("get_weather", {"city": {"type": "string"}}, ["city"])
ASK_WEATHER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
SAID = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'  # a free answer that calls


def _mistral_vocabulary(folder: Path, template: str) -> Path:
    """stories260K's HF folder with `template`, its vocabulary holding Mistral's tags as
    special tokens."""
    with_chat_template(STORIES_HF, folder, template)
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    for char, tag in MISTRAL_TAGS.items():
        vocab[tag] = vocab.pop(char)
        spec["added_tokens"].append({"id": vocab[tag], "content": tag, "special": True,
                                     "normalized": False, "single_word": False,
                                     "lstrip": False, "rstrip": False})  # fmt: skip
    path.write_text(json.dumps(spec))
    return folder


def test_special_tags_reach_the_parser_of_chat_answers_only(tmp_path):
    """A chat job keeps the special tokens that its format's parser (and its reasoning) reads:
    its answer's ids, decoded whole and one id at a time, give the call; a completion, and a
    chat without tools, still skip them (and then nothing is a call)."""
    folder = _mistral_vocabulary(tmp_path / "m", (FIXTURES / MISTRAL_V11).read_text())
    tok = Tokenizer.from_hf_dir(folder)
    tag = {name: tok.backend.token_to_id(name) for name in MISTRAL_TAGS.values()}
    assert {tag["[TOOL_CALLS]"], tag["[ARGS]"]} <= tok.special_ids
    template = ChatTemplate(tok.chat_template or "", tok)
    body = {"messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "auto"}
    chat = chat_job(body, template, 512, "m")
    calls = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    assert chat.tool_format == "mistral_v11"
    assert chat.sampling.preserved_tokens == tuple(sorted(tag[name] for name in calls))
    plain = chat_job({"messages": ASK_WEATHER}, template, 512, "m")
    completion = completion_job({"prompt": QUESTION}, tok, 512, "m")
    assert plain.sampling.preserved_tokens == completion.sampling.preserved_tokens == ()
    ids = tok.encode(SAID)[1:]  # (less BOS) the tags' text encodes as their special ids
    assert tag["[TOOL_CALLS]"] in ids and tag["[ARGS]"] in ids

    def decoded(job) -> list[str]:
        keep = job.sampling.preserved_tokens
        stream = tok.stream(context=job.prompts[0][-4:], keep=keep)  # as Engine.submit's
        one_by_one = "".join(stream.push([i]) for i in ids) + stream.flush()
        return [tok.decode(ids, keep), one_by_one]

    request = check_tools(body)
    for text in decoded(chat):
        content, made = parse(text, "mistral_v11", request)
        # (after the prompt the stream keeps the space of SentencePiece's "▁Sure"; whole, not)
        assert content is not None and content.strip() == "Sure."
        assert _shape(made, "mistral_v11") == _sorted([("get_weather", {"city": "Paris"})])
    for job in (plain, completion):
        for text in decoded(job):
            assert "[TOOL_CALLS]" not in text and "get_weather" in text
            assert parse(text, "mistral_v11", request) == (text, [])
    # a thinking template's tags too (Magistral thinks in [THINK]...[/THINK])
    thinker = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'assistant' %}[THINK]{{ m.reasoning_content }}"
        "[/THINK]{{ m.content }}{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}[THINK]{% endif %}",
        tok,
    )
    thinks = chat_job({"messages": ASK_WEATHER}, thinker, 512, "m")
    assert thinks.reasoning is not None and thinks.reasoning.opened
    assert thinks.sampling.preserved_tokens == tuple(sorted((tag["[THINK]"], tag["[/THINK]"])))


def test_served_mistral_tags_that_are_special_tokens_make_calls(tmp_path):
    """End to end: a model that writes Mistral's special tags itself (tool_choice auto; a
    grammar by token id stands in for a trained model) gets its call read, whole and
    streamed, with the text before it as content; /v1/completions skips the tags."""
    folder = _mistral_vocabulary(tmp_path / "m", (FIXTURES / MISTRAL_V11).read_text())
    tok = Tokenizer.from_hf_dir(folder)
    calls, args = (tok.backend.token_to_id(name) for name in ("[TOOL_CALLS]", "[ARGS]"))
    arguments = json.dumps({"city": "Paris"})
    grammar = (f'%llguidance {{}}\nstart: "Sure." <[{calls}]> "get_weather" <[{args}]> '
               f"{json.dumps(arguments)}")  # fmt: skip
    plan = dict(slots=1, max_seq_len=512, prefill_buckets=(128,), batch_buckets=(1,))
    with live_server(lambda: jaxinfer.load(folder, **plan)) as srv:
        client = client_of(srv)
        kw = dict(model="m", messages=ASK_WEATHER, tools=[WEATHER], tool_choice="auto",
                  max_tokens=64, temperature=0, extra_body={"grammar": grammar})  # fmt: skip
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
        made = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        assert made == [("get_weather", arguments)]
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw)]
        assert "".join(c.delta.content or "" for c in chunks) == "Sure."
        deltas = [call for c in chunks for call in c.delta.tool_calls or ()]
        assert [(d.function.name, d.function.arguments) for d in deltas] == made
        assert chunks[-1].finish_reason == "tool_calls"
        text = client.completions.create(model="m", prompt=QUESTION, max_tokens=64,
                                         temperature=0, extra_body={"grammar": grammar}
                                         ).choices[0].text  # fmt: skip
        assert "[TOOL_CALLS]" not in text and "get_weather" in text
