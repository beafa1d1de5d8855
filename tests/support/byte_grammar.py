"""A byte-level vocabulary for llguidance, and random answers a grammar allows: how the tool
tests sample forcing grammars without a model."""

import llguidance
import numpy as np


class _Bytes:
    """Tokens 0..255 are the bytes, 256 is EOS."""

    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
ENDS = np.frombuffer(b'"}],\n<', np.uint8).astype(np.int64)  # bytes that close things
EOS = 256


def sample(grammar_text: str, rng: np.random.Generator, limit: int = 4000) -> str:
    """A random answer the grammar allows: a uniformly drawn allowed byte at each step, or,
    half the time, an allowed closing byte (so that strings and numbers end)."""
    matcher = llguidance.LLMatcher(BYTES, grammar_text, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    out = []
    while not matcher.is_stopped():
        words = np.frombuffer(matcher.compute_bitmask(), np.uint32)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: EOS + 1])
        closing = np.intersect1d(allowed, np.append(ENDS, EOS))
        pool = closing if len(closing) and rng.random() < 0.5 else allowed
        token = int(rng.choice(pool))
        if token == EOS:
            break
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
        assert len(out) < limit, bytes(out)
    assert matcher.is_accepting()
    return bytes(out).decode()
