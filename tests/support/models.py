"""The shared tiny models (../shared/models, outside the repository) and what they publish."""

import contextlib
import http.client
import json
import shutil
import time
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[3] / "shared" / "models"
STORIES = "stories260K-gguf/stories260K.gguf"
STORIES_HF = "stories260K-hf-derived"
STORIES_Q8 = "stories260K-gguf-quant-derived/stories260K-Q8_0.gguf"
# Float32 logits (|logit| <= 22 here) move by up to ~2e-4 with the matmul shapes and summation
# order (batch and chunk buckets, layouts, another CPU: a fresh clone measured 1.5e-5 where
# 1e-5 had been assumed). Logit tolerances use this; greedy ids stay exact.
F32_LOGITS_ATOL = 2e-4
# A quantized file under 8-bit activations (the CPU kernels' default, as llama.cpp computes)
# and under float activations (XLA's graph, the Pallas kernels) gives logits up to ~0.2 apart:
# one rounding flip in an early token's keys moves every later position (tests/ops/
# test_int8_activations.py); measured on the Q8_0 fixtures, up to 0.16 in log-probabilities.
# Greedy ids on such a file may part only where the two best are nearer than this.
INT8_NEAR_TIE = 0.3

# Greedy ids from [BOS] published with stories260K (../shared/models/README.md).
GOLDEN = [
    403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396,
    267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394,
    261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432, 398, 312,
    286, 267, 414, 270, 333, 415, 426, 13, 438, 310,
]  # fmt: skip


def model_path(rel: str) -> Path:
    path = MODELS / rel
    if not path.exists():
        pytest.skip(f"{path} is missing (the shared tiny models are not checked out)")
    return path


def with_chat_template(rel: str, folder: Path, template: str) -> Path:
    """A writable copy of the HF folder `rel` in `folder` (its GGUF files left out) with
    `template` as its tokenizer_config.json chat_template."""
    shutil.copytree(model_path(rel), folder, ignore=shutil.ignore_patterns("*.gguf"))
    for f in folder.iterdir():
        f.chmod(0o644)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def stories_chat(tmp_path_factory, template: str) -> Path:
    """stories260K's HF folder with `template` in its tokenizer_config.json (a module
    fixture's copy), so chat bodies reach the model."""
    folder = tmp_path_factory.mktemp("chat") / "stories260K-chat"
    return with_chat_template(STORIES_HF, folder, template)


@contextlib.contextmanager
def live_server(load, **options):
    """A started Server on a free port over `load()` with ServerOptions `options`, ready;
    stopped on leaving (a module fixture yields it from inside)."""
    from jaxinfer.serve.server import Server

    srv = Server(load, port=0, **options).start()
    try:
        assert srv.worker.wait_ready(600), srv.worker.error
        yield srv
    finally:
        srv.stop()


def client_of(srv):
    """The openai client of a live server (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def http_json(srv, method: str, path: str, body=None) -> tuple[int, object]:
    """(status, decoded JSON or text) of one plain HTTP request to a live server."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode())
        response = conn.getresponse()
        text = response.read().decode()
    finally:
        conn.close()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, text


def wait_for(predicate, timeout: float = 30.0) -> bool:
    """Whether `predicate()` turns true within `timeout` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
