"""Structured output: JSON schemas, GBNF and Lark grammars and regexes hold on stories260K and
a random-weight fixture, greedy and sampled (checked with jsonschema and re, not with the
matcher); constrained and free requests share 4 slots with nothing compiled after warmup and
the free ones' tokens unchanged; bad schemas and grammars are one-line errors that leave the
engine serving. Through the server with the openai client: response_format, tool calls
forced by tool_choice (streamed and not), logprobs and echo."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
from support.models import STORIES_HF, client_of, live_server, model_path, with_chat_template
from support.schemas import PERSON
from support.templates import QWEN25
from test_logprobs import LOGPROB_ATOL, log_softmax64

import jaxinfer
from jaxinfer.errors import RequestError
from jaxinfer.options import SamplingParams

openai = pytest.importorskip("openai")

OPTS = dict(max_seq_len=512, prefill_buckets=(32, 128), batch_buckets=(1, 4))
QWEN3_MOE = "tiny-random/qwen3_moe_e8k2_bpe"  # byte-level BPE: any text is some token path
SAMPLED = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)  # the whole distribution


@pytest.mark.parametrize("model", [STORIES_HF, QWEN3_MOE])
def test_json_schema_output_validates_greedy_and_sampled(engines, model):
    engine = engines(model_path(model), **OPTS)
    for seed, params in enumerate([dict(temperature=0)] + [dict(SAMPLED)] * 3):
        r = engine.generate("Tell me about a person.", max_new_tokens=120, json_schema=PERSON,
                            seed=seed, **params)  # fmt: skip
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), PERSON)
        assert r.token_ids[-1] not in engine.tokenizer.eos_ids or r.text.endswith("}")


def test_grammars_and_regexes_hold(engines):
    engine = engines(model_path(STORIES_HF), **OPTS)
    gbnf = 'root ::= "The " animal " is " ("big" | "small") "."\nanimal ::= "cat" | "dog"'
    lark = '%llguidance {}\nstart: "n=" /[0-9]{1,3}/ ";"'
    cases = [(gbnf, None, r"The (cat|dog) is (big|small)\."), (lark, None, r"n=[0-9]{1,3};"),
             (None, r"[a-z]{2,5}-[0-9]{2}", r"[a-z]{2,5}-[0-9]{2}")]  # fmt: skip
    for grammar, regex, pattern in cases:
        for seed in range(3):
            r = engine.generate("Once", max_new_tokens=40, grammar=grammar, regex=regex,
                                seed=seed, **SAMPLED)  # fmt: skip
            assert re.fullmatch(pattern, r.text), r.text
            assert r.finish_reason == "stop"


def test_json_object_means_any_object_and_whitespace_is_bounded(engines):
    """`{}`: any JSON object; a weak model cannot spend the budget on blanks (llama.cpp's
    bound: one space, or a newline and up to 20 spaces or tabs, between tokens)."""
    engine = engines(model_path(STORIES_HF), **OPTS)
    for seed in range(4):
        r = engine.generate("Once", max_new_tokens=60, json_schema={}, seed=seed, **SAMPLED)
        assert r.text.lstrip().startswith("{")
        assert not re.search(r"[ \t]{22}|\n[ \t]*\n|  \n", r.text), repr(r.text)
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)


@pytest.mark.slow
def test_constrained_and_free_requests_share_slots_without_compiles(compiles):
    """4 slots, 2 constrained and 2 free, after warmup: no compile, every schema holds, and
    the free requests' greedy tokens equal a run alone (masks are per row)."""
    engine = jaxinfer.load(model_path(STORIES_HF), slots=4, **OPTS)
    engine.warmup(progress=False)
    prompts = ["Once upon a time", "The cat sat", "Lily and Tom", "One day"]
    alone = [engine.generate(p, max_new_tokens=24, temperature=0).token_ids for p in prompts[2:]]
    with compiles() as seen:
        requests = [engine.submit(p, max_new_tokens=120, json_schema=PERSON, seed=i, **SAMPLED)
                    for i, p in enumerate(prompts[:2])]  # fmt: skip
        requests += [engine.submit(p, max_new_tokens=24, temperature=0) for p in prompts[2:]]
        results = [r.result() for r in requests]
    assert seen.n == 0
    for r in results[:2]:
        jsonschema.validate(json.loads(r.text), PERSON)
    assert [r.token_ids for r in results[2:]] == alone
    stats = engine.kv_stats()
    assert stats["pages_in_use"] == 0


@pytest.mark.slow
def test_constrained_rows_do_not_draft_and_match_a_plain_engine(engines):
    """Under n-gram speculation a constrained request makes the same greedy tokens as
    without it (its row never drafts: each token passes the matcher), while a free request
    beside it still drafts."""
    plain = engines(model_path(STORIES_HF), **OPTS)
    spec = engines(model_path(STORIES_HF), speculative="ngram", draft_tokens=4, **OPTS)
    copy = "Once upon a time, there was a little girl. Once upon a time, there was a little"
    grammar = 'root ::= "The " ("cat " | "dog " | "sun ")+ "."'
    for engine in (plain, spec):
        engine.reset_perf()
    want = plain.generate(copy, max_new_tokens=30, temperature=0, grammar=grammar).token_ids
    free = spec.submit(copy, max_new_tokens=30, temperature=0)
    held = spec.submit(copy, max_new_tokens=30, temperature=0, grammar=grammar)
    assert held.result().token_ids == want
    assert re.fullmatch(r"The ((cat|dog|sun) )+\.?", held.result().text)
    free.result()
    assert spec.perf_stats().accepted_tokens > 0


def test_a_compiled_schema_serves_many_requests_through_copies(engines, compiled):
    """engine.constraint compiles once (on any thread); each request gets its copy, and every
    output holds the schema. The same copy twice, or one of another grammar, is refused."""
    engine = engines(model_path(STORIES_HF), **OPTS)
    params = SamplingParams(max_new_tokens=120, json_schema=PERSON, **SAMPLED)
    with ThreadPoolExecutor(1, thread_name_prefix="handler") as pool:  # as a server's
        constraint = pool.submit(engine.constraint, params).result()
    requests = [
        engine.submit("Tell me about a person.", sampling=params.replace(seed=i),
                      constraint=constraint.copy())
        for i in range(6)
    ]  # fmt: skip
    results = [r.result() for r in requests]
    assert compiled == ["handler_0"]
    for r in results:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), PERSON)
    taken = requests[0].state.constraint
    with pytest.raises(RequestError, match="already serves a request"):
        engine.submit("Once", sampling=params, constraint=taken)
    with pytest.raises(RequestError, match="another grammar"):
        engine.submit("Once", regex="[a-z]+", constraint=constraint.copy())
    with pytest.raises(RequestError, match="another grammar"):
        engine.submit("Once", max_new_tokens=4, constraint=constraint.copy())
    assert engine.generate("Once", max_new_tokens=30, regex="[a-z]{2,5}", seed=0).text
    assert len(compiled) == 2  # without a constraint, submit compiles its own as before
    many = engine.generate(["Once", "The dog", "A cat"], max_new_tokens=30, regex="[a-z]{2,5}")
    assert len(compiled) == 3  # a generate() list compiles its grammar once
    assert all(re.fullmatch("[a-z]{2,5}", r.text) for r in many)


def test_bad_schemas_and_grammars_are_one_line_errors(engines):
    engine = engines(model_path(STORIES_HF), **OPTS)
    bad = [
        (dict(json_schema={"type": "nonsense"}), "json_schema is invalid"),
        (dict(json_schema="{not json"), "json_schema is not valid JSON"),
        (dict(json_schema=[1, 2]), "JSON object"),
        (dict(grammar='root ::= ("a"'), "GBNF grammar is invalid"),
        (dict(grammar="%llguidance {}\nstart: nowhere"), "grammar is invalid"),
        (dict(regex="(unclosed"), "regex is invalid"),
        (dict(regex="a", grammar='root ::= "a"'), "not several"),
    ]
    for kwargs, words in bad:
        with pytest.raises(RequestError, match=words) as e:
            engine.generate("Once", **kwargs)
        assert "\n" not in str(e.value)
    assert engine.generate("Once", max_new_tokens=4, temperature=0).token_ids  # still serves


# ---- through the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    """The Qwen3-MoE fixture with Qwen2.5's chat template (Hermes tool calls)."""
    folder = tmp_path_factory.mktemp("tools") / "qwen3-moe-tools"
    with_chat_template(QWEN3_MOE, folder, QWEN25)
    opts = dict(slots=4, max_seq_len=1024, prefill_buckets=(32, 128), batch_buckets=(1,))
    with live_server(lambda: jaxinfer.load(folder, **opts)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(qwen_server):
    return client_of(qwen_server)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: arguments {}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_response_format_json_schema_through_the_client(client):
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for stream in (False, True):
        for seed in range(2):
            kw = dict(model="m", messages=ASK, max_tokens=150, response_format=form, seed=seed)
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in
                               client.chat.completions.create(stream=True, **kw))  # fmt: skip
            else:
                text = client.chat.completions.create(**kw).choices[0].message.content
            jsonschema.validate(json.loads(text), PERSON)


def test_constrained_and_free_clients_share_the_slots_without_compiles(client, qwen_server):
    """2 json_schema and 2 free chat requests at once in the 4 slots: every schema holds and
    the server compiled nothing after warmup (its own counter, from the engine thread)."""
    from concurrent.futures import ThreadPoolExecutor

    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(k):
        extra = {"response_format": form} if k < 2 else {"extra_body": {"ignore_eos": True}}
        return client.chat.completions.create(
            model="m", messages=ASK, max_tokens=150, seed=k, **extra
        )

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    for answer in answers[:2]:
        jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    assert all(a.usage.completion_tokens == 150 for a in answers[2:])
    worker = qwen_server.worker
    stats = worker.call(lambda e: e.perf_stats()).result()
    assert stats.programs + stats.untracked_compiles == worker.compiles_at_ready


def _calls_from_stream(chunks):
    calls, finish = {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_forces_a_valid_call(client, choice):
    tool_choice = choice if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}
    }  # fmt: skip
    for seed in range(2):  # one call (parallel calls: as many as a random model likes)
        kw = dict(
            model="m",
            messages=ASK,
            tools=[WEATHER, NOW],
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=200,
            seed=seed,
            temperature=1.0,
        )
        answer = client.chat.completions.create(**kw).choices[0]
        assert answer.finish_reason == "tool_calls"
        calls = [{"name": c.function.name, "arguments": c.function.arguments, "id": c.id}
                 for c in answer.message.tool_calls]  # fmt: skip
        streamed, finish = _calls_from_stream(client.chat.completions.create(stream=True, **kw))
        assert finish == "tool_calls"
        for made in (calls, streamed):
            assert len(made) == 1 and made[0]["id"].startswith("call_")
            for call in made:
                tool = {"get_weather": WEATHER, "now": NOW}[call["name"]]
                args = json.loads(call["arguments"])
                jsonschema.validate(args, tool["function"]["parameters"])
            if choice == "named":
                assert [c["name"] for c in made] == ["get_weather"]


def test_tool_results_go_back_in_and_auto_may_answer_in_text(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER], max_tokens=8, temperature=0
    ).choices[0]
    # random weights: an answer in text (a call would have to parse, and then be listed)
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content is not None or answer.message.tool_calls


def test_logprobs_through_the_client_match_the_fixture(client, qwen_server):
    """The first generated token's logprobs, chat and completions, streamed and not, against
    the fixture's float64 logits; echo gives the prompt's tokens first."""
    ref = json.loads((model_path(QWEN3_MOE) / "reference.json").read_text())
    prompt = ref["prompts"][1]
    want = log_softmax64(prompt["last_logits_f64"])
    best = np.argsort(-want, kind="stable")[:5].tolist()
    completion = client.completions.create(
        model="m", prompt=prompt["ids"], max_tokens=3, temperature=0, logprobs=5
    ).choices[0]
    lp = completion.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert lp.token_logprobs[0] == pytest.approx(want[prompt["greedy_ids"][0]], abs=LOGPROB_ATOL)
    assert sorted(lp.top_logprobs[0].values(), reverse=True) == pytest.approx(
        sorted(want[best], reverse=True), abs=LOGPROB_ATOL
    )
    assert "".join(lp.tokens) == completion.text
    assert lp.text_offset[0] == 0

    chat = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    ).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy
    joined = b"".join(bytes(c.bytes) for c in content).decode(errors="replace")
    assert joined.replace("\ufffd", "") == chat.message.content.replace("\ufffd", "")
    streamed = [
        c for chunk in client.chat.completions.create(
            model="m", messages=ASK, max_tokens=4, temperature=0, logprobs=True,
            top_logprobs=3, stream=True)
        for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content
    ]  # fmt: skip
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [
        (c.token, round(c.logprob, 4)) for c in content
    ]

    echo = client.completions.create(
        model="m", prompt=prompt["ids"], max_tokens=2, temperature=0, logprobs=2, echo=True
    ).choices[0]
    n = len(prompt["ids"])
    assert echo.logprobs.token_logprobs[0] is None and len(echo.logprobs.tokens) == n + 2
    assert echo.logprobs.token_logprobs[n] == pytest.approx(lp.token_logprobs[0], abs=2e-4)
    assert echo.logprobs.tokens[n:] == lp.tokens[:2]  # the same greedy tokens after it
    assert echo.logprobs.text_offset[n] == len("".join(echo.logprobs.tokens[:n]))
    assert qwen_server.worker.engine.kv_stats()["pages_in_use"] == 0
