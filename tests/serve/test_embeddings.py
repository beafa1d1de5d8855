"""POST /v1/embeddings and /v1/rerank on a live server (--embedding --rerank), over a random
Qwen3 checkpoint written here with the tiny fixtures' Qwen tokenizer (single "yes" and "no"
tokens; its tokenizer_config asks for EOS, as Qwen3-Embedding's post-processor does).

Embeddings through the official openai client (its default base64 and float) equal
Engine.embed and the float64 reference's pooled final-normed hidden states; rerank scores
equal the reference's softmax over the "yes" and "no" logits of Qwen3-Reranker's prompt,
written and tokenized here from its model card; order, top_n and return_documents; bad bodies
are one-line 400s (a small hypothesis fuzz too); nothing compiles after warmup; --rerank
refuses a model without "yes" and "no" at start; the flags reach the server and /props."""

import base64
import copy
import http.client
import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import checkpoints as C
from support import reference as R
from support.models import client_of, live_server, model_path, wait_for
from tokenizers import Tokenizer as HFTokenizer

import jaxinfer
from jaxinfer import cli

openai = pytest.importorskip("openai")

QWEN_TOKENIZER = "tiny-random/qwen3_moe_e8k2_bpe"  # vocab 768: "yes" 690, "no" 662, EOS 765
EOS = 765
COSINE = 0.9999
PLAN = dict(max_seq_len=512, slots=1, prefill_buckets=(32,), batch_buckets=(1,))  # 5 programs
LIMITS = dict(max_choices=8, max_queue=6)
LONG = "The quick brown fox jumps over the lazy dog. " * 5  # over the largest chunk (32)
# Qwen3-Reranker's model card: format_instruction, prefix and suffix, copied here
SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
TASK = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder, config, weights, tokenizer): a random 2-layer Qwen3 of vocabulary 768."""
    config = copy.deepcopy(C.TINY["qwen3"])
    config.update(vocab_size=768, max_position_embeddings=512, bos_token_id=None,
                  eos_token_id=EOS)  # fmt: skip
    weights = C.random_weights(config, seed=11)
    folder = C.write_hf(tmp_path_factory.mktemp("rerank") / "hf", config, weights,
                        tokenizer=False)  # fmt: skip
    source = model_path(QWEN_TOKENIZER)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    tok_config["add_eos_token"] = True  # texts to embed end in <|endoftext|>
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder, config, weights, HFTokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def server(model):
    load = lambda: jaxinfer.load(model[0], embeddings=True, **PLAN)  # noqa: E731
    with live_server(load, embedding=True, rerank=True, **LIMITS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return client_of(server)


def send(server, method: str, path: str, data: bytes = b"") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def post(server, path: str, body) -> tuple[int, dict]:
    status, data = send(server, "POST", path, json.dumps(body).encode())
    return status, json.loads(data)


def reference_vector(model, ids, pooling: str = "last") -> np.ndarray:
    _, config, weights, _ = model
    _, hidden = R.forward(weights, config, ids, return_hidden=True)
    v = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[pooling]
    return v / np.linalg.norm(v)


def text_ids(model, text: str) -> list[int]:
    """The text's ids as the HF tokenizer gives them, with the EOS the config appends."""
    return model[3].encode(text, add_special_tokens=False).ids + [EOS]


def engine_embed(server, texts) -> np.ndarray:
    """Engine.embed on the engine thread (which owns the engine)."""
    return server.worker.call(lambda engine: engine.embed(texts)).result(60)


# ---- embeddings ---------------------------------------------------------------------------


def test_client_embeddings_equal_engine_embed_and_the_reference(server, client, model, compiles):
    """The openai client's default (base64, decoded by the client) and float formats; a batch
    of three strings, one longer than the largest chunk; nothing compiles after warmup."""
    texts = ["Once upon a time", LONG, "dog"]
    with compiles() as seen:
        got = client.embeddings.create(model="anything", input=texts)
        floats = client.embeddings.create(model="anything", input=texts, encoding_format="float")
        mine = engine_embed(server, texts)
    assert seen.n == 0
    vectors = np.array([d.embedding for d in got.data], np.float32)
    assert [d.index for d in got.data] == [0, 1, 2] and got.object == "list"
    assert np.array_equal(vectors, mine)  # base64 carries float32 exactly
    assert np.array_equal(np.array([d.embedding for d in floats.data], np.float32), mine)
    assert len(text_ids(model, LONG)) > 32
    for k, text in enumerate(texts):
        assert float(vectors[k] @ reference_vector(model, text_ids(model, text))) >= COSINE
    n = sum(len(text_ids(model, t)) for t in texts)
    assert (got.usage.prompt_tokens, got.usage.total_tokens) == (n, n)


def test_token_id_inputs(server, client, model):
    """Token ids are taken as given (no EOS appended), alone or as a list of lists."""
    ids = [[5, 300, 17, 690], [44] * 40]
    got = client.embeddings.create(model="m", input=ids)
    one = client.embeddings.create(model="m", input=ids[0])
    for k, i in enumerate(ids):
        assert float(np.array(got.data[k].embedding) @ reference_vector(model, i)) >= COSINE
    assert np.array_equal(one.data[0].embedding, got.data[0].embedding)
    assert got.usage.prompt_tokens == 44


def test_embeddings_base64_is_little_endian_float32(server):
    status, body = post(server, "/v1/embeddings", {"input": "a cat", "encoding_format": "base64"})
    raw = base64.b64decode(body["data"][0]["embedding"])
    vector = np.frombuffer(raw, "<f4")
    assert status == 200 and vector.shape == (48,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert body["model"] and body["object"] == "list" and body["data"][0]["object"] == "embedding"


@pytest.mark.parametrize(
    "body, words",
    [
        ({"input": ""}, "input is empty"),
        ({"input": ["ok", ""]}, "input[1] is empty"),
        ({"input": []}, "input must be a string"),
        ({"input": [[1, 768]]}, "input[0] token ids must lie in [0, 768)"),
        ({"input": [1.5]}, "input must be a string"),
        ({"input": [[1], "x", 3]}, "input must be a string"),
        ({}, "input is required"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format = 'int8' is invalid"),
        ({"input": "x", "dimensions": 16}, "leave dimensions out"),
        ({"input": ["x"] * 9}, "9 inputs are over this server's max_choices (8)"),
        ({"input": [[3] * 513]}, "exceeds the available context size (512 tokens)"),
        ({"input": "x", "model": 5}, "model must be a string"),
    ],
)  # fmt: skip
def test_embedding_refusals_are_one_line_400s(server, body, words):
    status, answer = post(server, "/v1/embeddings", body)
    message = answer["error"]["message"]
    assert status == 400 and words in message and "\n" not in message, message


# ---- rerank -------------------------------------------------------------------------------


def reference_scores(model, query: str, documents, task: str = TASK) -> list[float]:
    """Qwen3-Reranker's scoring written from its model card: prefix + the pair + suffix,
    P(yes) = softmax over the logits of "yes" and "no" at the last position."""
    _, config, weights, tok = model
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    out = []
    for doc in documents:
        pair = f"<Instruct>: {task}\n<Query>: {query}\n<Document>: {doc}"
        ids = [tok.encode(part, add_special_tokens=False).ids for part in (PREFIX, pair, SUFFIX)]
        logits = R.forward(weights, config, ids[0] + ids[1] + ids[2])[-1]
        pair_logits = np.array([logits[no], logits[yes]])
        p = np.exp(pair_logits - pair_logits.max())
        out.append(float(p[1] / p.sum()))
    return out


DOCS = ["The capital of China is Beijing.", "Gravity pulls apples down.", LONG, "yes"]


def test_rerank_scores_equal_the_reference_best_first(server, model, compiles):
    with compiles() as seen:
        status, body = post(server, "/v1/rerank", {"query": "capital of China?",
                                                   "documents": DOCS})  # fmt: skip
    assert status == 200 and seen.n == 0, body
    want = reference_scores(model, "capital of China?", DOCS)
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -want[i])
    for r in results:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-4 and "document" not in r
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 4 * 40


def test_rerank_top_n_documents_instruction_and_aliases(server, model):
    task = "Find the sentence about fruit"
    body = {"query": "apples", "documents": [{"text": d} for d in DOCS], "top_n": 2,
            "return_documents": True, "instruction": task}  # fmt: skip
    want = reference_scores(model, "apples", DOCS, task)
    best = sorted(range(4), key=lambda i: -want[i])[:2]
    for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
        status, answer = post(server, path, body)
        assert status == 200, answer
        assert [r["index"] for r in answer["results"]] == best
        assert [r["document"]["text"] for r in answer["results"]] == [DOCS[i] for i in best]
    status, answer = post(server, "/v1/rerank", {**body, "top_n": 10})
    assert len(answer["results"]) == 4


@pytest.mark.parametrize(
    "body, words",
    [
        ({"documents": ["a"]}, "query is required"),
        ({"query": "", "documents": ["a"]}, "query is required"),
        ({"query": "q", "documents": []}, "documents is required"),
        ({"query": "q", "documents": "a"}, "documents is required"),
        ({"query": "q", "documents": ["a", 3]}, "documents[1] must be a string"),
        ({"query": "q", "documents": ["a"] * 9}, "9 documents are over this server's max_choices"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n = 0 is invalid"),
        ({"query": "q", "documents": ["a"], "top_n": "2"}, "top_n = '2' is invalid"),
        ({"query": "q", "documents": ["a"], "return_documents": 1}, "return_documents = 1"),
        ({"query": "q", "documents": ["a " * 600]}, "exceeds the available context size"),
    ],
)  # fmt: skip
def test_rerank_refusals_are_one_line_400s(server, body, words):
    status, answer = post(server, "/v1/rerank", body)
    message = answer["error"]["message"]
    assert status == 400 and words in message and "\n" not in message, message


# ---- the server ---------------------------------------------------------------------------


def test_texts_waiting_for_the_engine_count_against_max_queue(server):
    """A pass's texts count against max_queue (6 here) until it is done: 429 past it."""
    for path, body in [("/v1/embeddings", {"input": ["x"] * 7}),
                       ("/v1/rerank", {"query": "q", "documents": ["d"] * 7})]:  # fmt: skip
        status, answer = post(server, path, body)
        assert status == 429 and "over this server's max_queue (6)" in answer["error"]["message"]


def test_props_and_a_stream_beside_a_pass(server):
    """/props reports what is served; a stream keeps going while embeddings are computed,
    and afterwards no page is held."""
    props = json.loads(send(server, "GET", "/props")[1])
    assert (props["embedding"], props["rerank"], props["pooling"]) == (True, True, "last")
    body = {"prompt": "Once", "max_tokens": 120, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body))
        stream = conn.getresponse()
        assert stream.readline().startswith(b"data: ")
        status, answer = post(server, "/v1/embeddings", {"input": [LONG] * 6})
        assert status == 200 and len(answer["data"]) == 6
        events = [ln for ln in stream.read().splitlines() if ln.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    finally:
        conn.close()

    def idle():
        stats = server.worker.call(lambda e: {**e.kv_stats(), **e.activity()}).result(30)
        return (stats["pages_in_use"], stats["running"]) == (0, 0)

    assert wait_for(idle)


FUZZ = settings(deadline=None, derandomize=True, database=None, max_examples=120,
                suppress_health_check=list(HealthCheck))  # fmt: skip
JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 2**70), st.floats(), st.text(max_size=8)),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=5,
)
TEXTS = st.one_of(st.text(max_size=10), st.lists(st.integers(-2, 770), max_size=5), JUNK)
BODIES = {
    "/v1/embeddings": st.fixed_dictionaries(
        {"input": st.one_of(TEXTS, st.lists(TEXTS, max_size=10))},
        optional={
            "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), JUNK),
            "dimensions": JUNK,
            "model": JUNK,
            "user": JUNK,
        },
    ),  # fmt: skip
    "/v1/rerank": st.fixed_dictionaries(
        {
            "query": st.one_of(st.text(max_size=10), JUNK),
            "documents": st.one_of(
                st.lists(st.one_of(st.text(max_size=10), JUNK), max_size=10), JUNK
            ),
        },
        optional={"top_n": JUNK, "return_documents": JUNK, "instruction": JUNK, "model": JUNK},
    ),  # fmt: skip
}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_fuzzed_bodies_get_a_200_or_a_one_line_4xx(server, path):
    @FUZZ
    @given(BODIES[path])
    def one(body):
        status, answer = send(server, "POST", path, json.dumps(body).encode())
        if status != 200:
            error = json.loads(answer)["error"]
            assert status in (400, 429) and "\n" not in error["message"], (body, error)

    one()


def test_rerank_refuses_a_model_without_yes_and_no_at_start(capsys):
    """The built-in stories260K splits "yes" and "no": `serve --rerank` stops with one line
    before warming up."""
    code = cli.main(["serve", "--port", "0", "--rerank", "-c", "64", "-ub", "32"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert code != 0 and len(lines) == 1 and '"yes" and "no"' in lines[0], lines


def test_flags_reach_the_server_and_the_plan(serve_options):
    o = serve_options("--embedding", "--pooling", "mean")
    assert (o.embedding, o.rerank, o.pooling) == (True, False, "mean")
    assert serve_options("--reranking").rerank
    args = cli._parser().parse_args(["serve", "--rerank"])
    assert cli._options(args).embeddings is True  # the pooled pass joins the compile plan
    assert cli._options(cli._parser().parse_args(["serve"])).embeddings is False


@pytest.mark.slow
def test_without_the_flags_the_routes_say_how_to_turn_them_on():
    opts = dict(slots=1, prefill_buckets=(32,), batch_buckets=(1,), max_seq_len=64)
    with live_server(lambda: jaxinfer.load(None, **opts)) as srv:
        for path, flag in (("/v1/embeddings", "--embedding"), ("/v1/rerank", "--rerank")):
            status, body = post(srv, path, {"input": "x", "query": "q", "documents": ["d"]})
            assert status == 400 and flag in body["error"]["message"], body
