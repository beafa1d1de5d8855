"""The retrieval endpoints' requests and answers, as plain dicts: POST /v1/embeddings in
OpenAI's shape and POST /v1/rerank in Jina's (llama-server's), scored as Qwen3-Reranker is.

`embeddings_job` / `rerank_job` check a body (one-line RequestErrors naming the field) and
tokenize it; the engine's pooled pass does the work (Engine.embed_steps,
Engine.yes_probability_steps) and the job shapes the answer.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from ..errors import ContextError, JaxinferError, RequestError
from ..formats.tokenizer import Tokenizer
from ..options import ServerOptions
from .openai_api import _get, _is_int, _object, token_ids

# Qwen3-Reranker's prompt (its model card's format_instruction, prefix and suffix): a query
# and a document judged by the chat model, whose answer is "yes" or "no".
RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
RERANK_PREFIX = f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class EmbeddingJob:
    """A checked /v1/embeddings request: each input's token ids."""

    inputs: tuple[tuple[int, ...], ...]
    base64: bool  # encoding_format "base64": little-endian float32 bytes; else float lists
    model: str

    def response(self, vectors: np.ndarray) -> dict:
        """OpenAI's answer for vectors [N, D] (float32), one per input."""
        data = [
            {"object": "embedding", "index": i, "embedding": self._encoded(v)}
            for i, v in enumerate(vectors)
        ]
        n = sum(len(ids) for ids in self.inputs)
        usage = {"prompt_tokens": n, "total_tokens": n}
        return {"object": "list", "data": data, "model": self.model, "usage": usage}

    def _encoded(self, vector: np.ndarray) -> list[float] | str:
        if self.base64:
            return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return vector.astype(np.float32).tolist()


@dataclass(frozen=True)
class RerankJob:
    """A checked /v1/rerank request: each document's prompt (ids), and how to answer."""

    prompts: tuple[tuple[int, ...], ...]
    documents: tuple[str, ...]
    top_n: int
    return_documents: bool
    model: str

    def response(self, scores: np.ndarray) -> dict:
        """The answer for scores [N] (P(yes) per document): the top_n best first (among
        equals, the earlier document), with their text when return_documents."""
        order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
        results = []
        for i in order[: self.top_n]:
            result: dict = {"index": i, "relevance_score": float(scores[i])}
            if self.return_documents:
                result["document"] = {"text": self.documents[i]}
            results.append(result)
        n = sum(len(ids) for ids in self.prompts)
        usage = {"prompt_tokens": n, "total_tokens": n}
        return {"model": self.model, "object": "list", "results": results, "usage": usage}


def embeddings_job(
    body, tokenizer: Tokenizer, n_ctx: int, dims: int, model: str, limits: ServerOptions
) -> EmbeddingJob:
    """POST /v1/embeddings: input is a string, a list of strings, token ids or a list of
    those, at most max_choices of them, each within the context (strings get the EOS their
    tokenizer appends, add_eos_token; ids are taken as given). `dims`: the model's width."""
    body = _object(body)
    if "input" not in body:
        raise RequestError("input is required: a string, a list of strings or token ids")
    given = body["input"]
    texts: list
    if isinstance(given, str) or (isinstance(given, list) and given and _is_int(given[0])):
        texts = [given]
    elif isinstance(given, list) and given and all(isinstance(t, str | list) for t in given):
        texts = given
    else:
        raise RequestError(
            "input must be a string, a list of strings, token ids or a list of token-id lists"
        )
    _most(len(texts), "inputs", limits)
    kind = _get(body, "encoding_format", str, "float")
    if kind not in ("float", "base64"):
        raise RequestError(f"encoding_format = {kind!r:.40} is invalid; use float or base64")
    if body.get("dimensions") is not None:
        raise RequestError(
            f"dimensions is for models trained with Matryoshka dimensions; this one's "
            f"embeddings have {dims} and cannot be cut: leave dimensions out"
        )
    _model(body)
    where = "input" if len(texts) == 1 and given is texts[0] else "input[{}]"
    ids = [_text_ids(t, tokenizer, n_ctx, where.format(k)) for k, t in enumerate(texts)]
    return EmbeddingJob(tuple(map(tuple, ids)), kind == "base64", model)


def rerank_job(body, tokenizer: Tokenizer, n_ctx: int, model: str, limits: ServerOptions):
    """POST /v1/rerank: a query and its documents (strings, or {"text": ...} objects), at
    most max_choices of them; top_n (default all) and return_documents (default false) shape
    the answer; `instruction` (llama-server's) replaces Qwen3-Reranker's default task.
    Each document's prompt must fit the context."""
    body = _object(body)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise RequestError("query is required: a non-empty string")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise RequestError("documents is required: a non-empty list of strings")
    _most(len(documents), "documents", limits)
    texts = [_document(d, k) for k, d in enumerate(documents)]
    top_n = _get(body, "top_n", int, len(texts))
    if top_n < 1:
        raise RequestError(f"top_n = {top_n} is invalid; it must be at least 1")
    keep = _get(body, "return_documents", bool, False)
    instruction = _get(body, "instruction", str, None) or RERANK_INSTRUCTION
    _model(body)
    prompts = []
    for text in (query, instruction, *texts):  # one far past the context is not tokenized
        if at_least := tokenizer.too_long(text, n_ctx):
            raise ContextError(at_least, n_ctx, at_least=True)
    for text in texts:
        ids = rerank_ids(tokenizer, query, text, instruction)
        if len(ids) > n_ctx:
            raise ContextError(len(ids), n_ctx)
        prompts.append(tuple(ids))
    return RerankJob(tuple(prompts), tuple(texts), top_n, keep, model)


def rerank_ids(tokenizer: Tokenizer, query: str, document: str, instruction: str) -> list[int]:
    """A query and document in Qwen3-Reranker's prompt, tokenized as its model card does:
    the prefix, the pair (its <Instruct>, <Query>, <Document> lines) and the suffix apart."""
    pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    plain = tokenizer.backend.encode  # no BOS inside the prompt
    return (
        tokenizer.encode(RERANK_PREFIX)
        + plain(pair, add_special_tokens=False).ids
        + plain(RERANK_SUFFIX, add_special_tokens=False).ids
    )


def rerank_tokens(tokenizer: Tokenizer, vocab: int) -> tuple[int, int]:
    """The ids of the single tokens "yes" and "no" (as Qwen3-Reranker's card finds them),
    or a one-line error: a model without them cannot be scored this way."""
    yes, no = (tokenizer.backend.token_to_id(word) for word in ("yes", "no"))
    if yes is None or no is None or max(yes, no) >= vocab:
        raise JaxinferError(
            '--rerank needs a vocabulary with the single tokens "yes" and "no" (as '
            "Qwen3-Reranker's); this model's has none: serve a reranker model"
        )
    return yes, no


def _text_ids(text, tokenizer: Tokenizer, n_ctx: int, where: str) -> list[int]:
    """One input's ids: a non-empty string (with the EOS its tokenizer appends) or token ids
    in the vocabulary, within the context."""
    if isinstance(text, str):
        if not text:
            raise RequestError(f"{where} is empty; pass some text or token ids")
        if at_least := tokenizer.too_long(text, n_ctx):
            raise ContextError(at_least, n_ctx, at_least=True)
        ids = tokenizer.encode(text, add_eos=True)
    else:
        ids = token_ids(text, tokenizer.vocab_size, where)
    if not ids:
        raise RequestError(f"{where} is empty; pass some text or token ids")
    if len(ids) > n_ctx:
        raise ContextError(len(ids), n_ctx)
    return ids


def _document(document, k: int) -> str:
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return document["text"]
    if not isinstance(document, str):
        raise RequestError(f'documents[{k}] must be a string (or {{"text": "..."}})')
    return document


def _most(n: int, what: str, limits: ServerOptions) -> None:
    """Refuse more than max_choices inputs or documents in one request."""
    if n > limits.max_choices:
        raise RequestError(
            f"{n} {what} are over this server's max_choices ({limits.max_choices}); send fewer"
        )


def _model(body: dict) -> None:
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise RequestError("model must be a string")
