"""Reasoning over HTTP: a thinking template's answer split into reasoning_content (and
`reasoning`) and content, whole and streamed, by --reasoning-format; a thinking budget per
request (thinking_budget / reasoning_budget) and per server, counted in usage and compiling
nothing on 4 slots at once; budget 0 renders the template without thinking.

The model is stories260K, served with Qwen3.5's real chat template (it opens `<think>` in the
prompt unless enable_thinking is false): the tiny model never closes its reasoning itself, so
every end tag in these answers is the budget's. Each split is checked against the same
request's raw text (reasoning_format "none") and the splitter's own rules are tested on
hand-written answers cut at every character."""

import concurrent.futures
from pathlib import Path

import pytest
from support.models import STORIES, client_of, http_json, live_server, model_path

import jaxinfer
from jaxinfer.serve.thinking import ReasoningSplit, split, thinking_tags

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
QWEN35 = (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
TAGS = ("<think>", "</think>")
# The served cases start a 4-slot server (about 40 s of the default tier's budget): slow tier;
# the default tier keeps the splitter's cases here and the engine's budgets
# (tests/runtime/test_reasoning_budget.py).
SERVED = pytest.mark.slow
HELLO = [{"role": "user", "content": "Tell me a story."}]


def _load():
    return jaxinfer.load(model_path(STORIES), max_seq_len=512, slots=4)


@pytest.fixture(scope="module")
def srv():
    with live_server(_load, chat_template=QWEN35) as s:
        yield s


def _post(srv, **body):
    status, answer = http_json(srv, "POST", "/v1/chat/completions", {"messages": HELLO, **body})
    assert status == 200, answer
    return answer


def test_thinking_tags_of_templates():
    assert thinking_tags(QWEN35) == TAGS
    r1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    assert thinking_tags(r1) == TAGS
    llama = (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text()
    assert thinking_tags(llama) is None


ANSWERS = [  # (answer, opened by the prompt) -> (reasoning, content)
    ("<think>\nplan it\n</think>\n\nThe answer.", False, ("\nplan it\n", "The answer.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("No thinking <think>here</think>", False, (None, "No thinking <think>here</think>")),
    ("weighing it</think>\n\n Done", True, ("weighing it", "Done")),
    ("cut short", True, ("cut short", "")),
    ("<thi", False, (None, "<thi")),
]


@pytest.mark.parametrize("answer, opened, want", ANSWERS)
def test_split_whole_and_at_every_cut(answer, opened, want):
    assert split(answer, TAGS, opened, "deepseek") == want
    assert split(answer, TAGS, opened, "deepseek-legacy") == (want[0], answer)
    for cut in range(len(answer) + 1):
        reader = ReasoningSplit(TAGS, opened)
        parts = [reader.feed(answer[:cut]), reader.feed(answer[cut:]), reader.finish()]
        reasoning, content = ("".join(p[k] for p in parts) for k in (0, 1))
        assert (reasoning, content) == (want[0] or "", want[1]), cut
        assert all(t not in p[1] for p in parts for t in TAGS if want[0] is not None)


@SERVED
def test_budget_splits_the_answer_and_is_counted(srv):
    raw = _post(srv, max_tokens=40, temperature=0, thinking_budget=6, reasoning_format="none")
    text = raw["choices"][0]["message"]["content"]
    assert "reasoning_content" not in raw["choices"][0]["message"]
    got = _post(srv, max_tokens=40, temperature=0, thinking_budget=6)
    message = got["choices"][0]["message"]
    reasoning, content = text.split("</think>", 1)
    assert message["reasoning_content"] == message["reasoning"] == reasoning
    assert message["content"] == content.lstrip()
    assert got["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
    legacy = _post(srv, max_tokens=40, temperature=0, thinking_budget=6,
                   reasoning_format="deepseek-legacy")  # fmt: skip
    assert legacy["choices"][0]["message"]["content"] == text
    assert legacy["choices"][0]["message"]["reasoning_content"] == reasoning


@SERVED
def test_streamed_reasoning_equals_the_whole_answer(srv):
    """The official client's stream: reasoning deltas, then content deltas without a tag."""
    client = client_of(srv)
    whole = _post(srv, max_tokens=40, temperature=0, reasoning_budget=9)["choices"][0]["message"]
    stream = client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=40, temperature=0, stream=True,
        extra_body={"reasoning_budget": 9},
    )  # fmt: skip
    reasoning, content = [], []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            reasoning.append(extra["reasoning_content"])
        if delta.content:
            assert not any(t in delta.content for t in ("<think", "</think", "think>"))
            content.append(delta.content)
    assert "".join(reasoning) == whole["reasoning_content"]
    assert "".join(content) == whole["content"]


@SERVED
def test_budget_zero_renders_without_thinking(srv):
    got = _post(srv, max_tokens=12, temperature=0, thinking_budget=0)
    message = got["choices"][0]["message"]
    assert got["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert "reasoning_content" not in message  # the prompt closed an empty reasoning
    off = _post(srv, max_tokens=12, temperature=0,
                chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert off["choices"][0]["message"]["content"] == message["content"]


@SERVED
def test_budgets_on_four_slots_at_once_compile_nothing(srv):
    def metric(name: str) -> float:
        text = http_json(srv, "GET", "/metrics")[1]
        line = next(x for x in text.splitlines() if x.startswith(f"jaxinfer:{name}"))
        return float(line.split()[-1])

    before = metric("compiles_after_warmup")
    budgets = [1, 4, 11, 23]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(
            lambda n: _post(srv, max_tokens=48, temperature=0.8, seed=n, thinking_budget=n),
            budgets,
        ))  # fmt: skip
    for n, got in zip(budgets, answers, strict=True):
        assert got["usage"]["completion_tokens_details"]["reasoning_tokens"] == n
    assert metric("compiles_after_warmup") == before


@SERVED
@pytest.mark.parametrize(
    "body, words",
    [
        ({"thinking_budget": -2}, "thinking_budget = -2 is invalid"),
        ({"reasoning_budget": "x"}, "reasoning_budget"),
        ({"thinking_budget": 3, "reasoning_budget": 3}, "not both"),
        ({"reasoning_format": "gpt"}, "reasoning_format 'gpt' is not supported"),
    ],
)
def test_bad_reasoning_fields_are_refused(srv, body, words):
    status, answer = http_json(srv, "POST", "/v1/chat/completions", {"messages": HELLO, **body})
    assert status == 400 and words in answer["error"]["message"]


@pytest.mark.slow  # a second server: the default tier's time budget
def test_server_defaults():
    """--reasoning-budget and --chat-template-kwargs are defaults under the request's (the
    same engine as `srv`'s: its programs come from the executable store)."""
    with live_server(_load, chat_template=QWEN35, reasoning_budget=3,
                     chat_template_kwargs={"enable_thinking": True}) as s:  # fmt: skip
        got = _post(s, max_tokens=16, temperature=0)
        assert got["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
        off = _post(s, max_tokens=16, temperature=0,
                    chat_template_kwargs={"enable_thinking": False})  # fmt: skip
        assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
        props = http_json(s, "GET", "/props")[1]
        assert props["reasoning"] == {"format": "auto", "budget": 3, "tags": list(TAGS)}
