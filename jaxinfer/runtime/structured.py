"""Structured output: a request's JSON schema, grammar or regex as an llguidance matcher over
the model's vocabulary, which fills the token mask of each constrained token and follows the
tokens sampled under it.

The mask is a device input of the sampling step (sampling.SamplingRows.mask, one packed bit
per token), so a grammar compiles nothing: the host fills the row's mask before the call that
samples its next token and consumes that token after it. A constrained row therefore makes
one token per call. JSON is generated with bounded whitespace, llama.cpp's rule (one space, or
a newline and at most 20 spaces or tabs), so a weak model cannot spend its budget on blanks.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

import llguidance
import llguidance.gbnf_to_lark
import numpy as np

from ..errors import RequestError
from ..formats.tokenizer import Tokenizer
from ..ops.sampling import mask_words
from ..options import SamplingParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"(?: |\n[ \t]{0,20})?"}
LARK = "%llguidance"  # a grammar that starts so is llguidance's Lark, else GBNF (llama.cpp's rule)


class Vocabulary:
    """The model's tokens as llguidance sees them (built from the tokenizer's own JSON, once,
    on first use: ~1 s for a 150k vocabulary), and each token's bytes."""

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        self.tokenizer, self.vocab = tokenizer, vocab  # vocab: the logits' width
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # a server compiles grammars on its handlers' threads

    @property
    def ll(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            with self._lock:
                if self._ll is None:
                    tok = self.tokenizer
                    eos = list(tok.eos_ids) or None
                    self._ll = llguidance.LLTokenizer(
                        tok.backend.to_str(), n_vocab=self.vocab, eos_token=eos
                    )
        return self._ll

    def token_bytes(self, token: int) -> bytes:
        return self.ll.decode_bytes([token])


def grammar_key(params: SamplingParams) -> tuple | None:
    """What a request's constraint is compiled from (None: free): requests with equal keys can
    share one compiled grammar (`Constraint.copy`)."""
    if not params.constrained:
        return None
    return (params.json_schema, params.regex, params.grammar)


def grammar_text(params: SamplingParams) -> str | None:
    """The llguidance grammar of a request's constraint (None: free), or a RequestError."""
    if params.json_schema is not None:
        schema = json.loads(params.json_schema)
        if schema == {}:  # any JSON object (response_format json_object)
            schema = {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.grammar is not None:
        text = params.grammar
        if not text.lstrip().startswith(LARK):
            try:
                text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
            except Exception as e:  # GbnfToLarkError and whatever the parser trips on
                raise RequestError(f"the GBNF grammar is invalid: {_line(e)}") from None
        return llguidance.LLMatcher.grammar_from_lark(text)
    return None


class Constraint:
    """One request's matcher: `mask()` for its next token, `consume(token)` after it.

    Compiling a grammar (`of`) takes up to seconds for a large schema and a large vocabulary;
    `copy()` gives another request the same grammar in microseconds (llguidance shares the
    compiled grammar between copies), so n choices of one job compile it once."""

    def __init__(self, vocabulary: Vocabulary, matcher: llguidance.LLMatcher, key: tuple):
        self.vocabulary, self.matcher, self.key = vocabulary, matcher, key
        self.taken = False  # a request follows this matcher (Engine.submit sets it)
        self._mask = np.empty(mask_words(vocabulary.vocab), np.int32)

    @staticmethod
    def of(vocabulary: Vocabulary, params: SamplingParams) -> Constraint | None:
        """The request's constraint (None: free); a bad schema or grammar is a RequestError.
        Any thread may compile one (the engine's need not wait for it)."""
        key = grammar_key(params)
        grammar = grammar_text(params)
        if key is None or grammar is None:
            return None
        matcher = llguidance.LLMatcher(vocabulary.ll, grammar, log_level=0)
        if matcher.is_error():
            what = "json_schema" if params.json_schema is not None else (
                "regex" if params.regex is not None else "grammar"
            )  # fmt: skip
            raise RequestError(f"the {what} is invalid: {_line(matcher.get_error())}")
        return Constraint(vocabulary, matcher, key)

    def copy(self) -> Constraint:
        """A new constraint of the same grammar, at its start, for another request (a
        matcher that a token broke has broken copies)."""
        matcher = self.matcher.deep_copy()
        matcher.reset()  # at the start even if this one has consumed tokens
        return Constraint(self.vocabulary, matcher, self.key)

    def mask(self) -> np.ndarray:
        """[mask_words(V)] int32, the tokens the grammar allows next (EOS once complete)."""
        m = self._mask
        self.matcher.unsafe_compute_mask_ptr(m.ctypes.data, m.nbytes)
        return m.copy()

    def consume(self, token: int) -> bool:
        """Follow a sampled token; False when the grammar is over (complete, or broken)."""
        self.matcher.consume_token(token)
        return not (self.matcher.is_stopped() or self.matcher.is_error())


def _line(text) -> str:
    return " ".join(str(text).split())[:300]
