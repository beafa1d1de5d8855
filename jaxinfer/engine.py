"""Engine: owns the parameters, the compiled programs and the KV cache; serves generate().

A batch of prompts is prefilled chunk by chunk (chunk sizes from `prefill_buckets`), then
decoded `decode_chunk` tokens per compiled call. The host wakes once per call to detokenize,
stream and check stop strings. Batch sizes, chunk sizes and cache lengths all come from small
bucket lists, so the set of compiled programs is small and known.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from flax import nnx

from .compile import CompileCache
from .config import ModelConfig
from .errors import RequestError
from .model import init_cache
from .sampling import PENALTY_WINDOW, SamplingParams, pack
from .steps import make_steps
from .tokenizer import Tokenizer

DEFAULT_PREFILL_BUCKETS = (32, 128, 512)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
MIN_CACHE = 128  # smallest cache length; lengths double from here up to max_seq_len


@dataclass
class Result:
    text: str
    token_ids: list[int]  # generated ids only (a final EOS / stop token included)
    prompt_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    prompt_ms: float = 0.0  # prefill time of the batch this request was in
    decode_ms: float = 0.0  # decode time of the batch this request was in


@dataclass(frozen=True)
class StreamPiece:
    text: str  # newly completed text (held back while it could start a stop string)
    token_ids: list[int]  # ids produced since the previous piece
    finish_reason: str | None = None  # set on the last piece


@dataclass
class PerfStats:
    load_ms: float = 0.0
    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    eval_tokens: int = 0
    eval_ms: float = 0.0
    eval_device_ms: float = 0.0  # part of eval_ms inside compiled decode calls
    total_ms: float = 0.0
    compiles: int = 0
    compile_seconds: float = 0.0
    graphs_reused: int = 0

    def host_share(self) -> float:
        return 1.0 - self.eval_device_ms / self.eval_ms if self.eval_ms else 0.0

    def __str__(self) -> str:
        def rate(n, ms):
            per = ms / n if n else 0.0
            tps = 1000.0 * n / ms if ms else 0.0
            return (
                f"{ms:10.2f} ms / {n:5d} tokens "
                f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)"
            )

        return "\n".join(
            [
                f"perf:        load time = {self.load_ms:10.2f} ms",
                f"perf: prompt eval time = {rate(self.prompt_tokens, self.prompt_ms)}",
                f"perf:        eval time = {rate(self.eval_tokens, self.eval_ms)}",
                f"perf:   eval host time = {self.host_share():.1%} of eval (outside compiled code)",
                f"perf:       total time = {self.total_ms:10.2f} ms",
                f"perf:    graphs reused = {self.graphs_reused}",
                f"perf:         compiles = {self.compiles} ({self.compile_seconds:.2f} s)",
            ]
        )


@dataclass
class _Row:
    """One request inside a running batch."""

    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: list[int]
    stop_strings: list[str]
    budget: int  # new tokens allowed (max_new_tokens clipped to the context)
    decoder: object
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    finish: str | None = None
    prompt_ms: float = 0.0
    decode_ms: float = 0.0


def _bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n, else the largest."""
    return next((b for b in buckets if b >= n), buckets[-1])


class Engine:
    def __init__(
        self,
        cfg: ModelConfig,
        tokenizer: Tokenizer,
        graphdef: nnx.GraphDef,
        params: dict,
        *,
        dtype,
        max_seq_len: int,
        name: str = "",
        source: str = "",
        prefill_buckets: Sequence[int] = DEFAULT_PREFILL_BUCKETS,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        decode_chunk: int = 16,
        compile_cache_size: int = 64,
        load_ms: float = 0.0,
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.params = params
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.name = name
        self.source = source  # e.g. "GGUF (Q8_0, F32)"
        self.prefill_buckets = tuple(sorted({min(b, max_seq_len) for b in prefill_buckets}))
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.cache_buckets = self._cache_lengths(max_seq_len)
        self.decode_chunk = decode_chunk
        self.compile_cache = CompileCache(capacity=compile_cache_size)
        self._steps = make_steps(graphdef, decode_chunk)
        self._static = (cfg, str(np.dtype(dtype)), decode_chunk)
        self._cache = None  # the KV cache of the last batch, reused when the shape fits
        self._perf = PerfStats(load_ms=load_ms)

    @staticmethod
    def _cache_lengths(max_seq_len: int) -> tuple[int, ...]:
        lengths, n = [], MIN_CACHE
        while n < max_seq_len:
            lengths.append(n)
            n *= 2
        return (*lengths, max_seq_len)

    # ---- text ---------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # ---- programs -----------------------------------------------------------------------

    def _run(self, name: str, *args, donate=(1,)):
        return self.compile_cache.run(
            name, self._steps[name], args, static=self._static, donate=donate
        )

    def _take_cache(self, batch: int, length: int):
        """A cache of [batch, length]; stale entries need no zeroing since attention masks
        every position past the query."""
        shape = (batch, self.cfg.n_kv_heads, length, self.cfg.head_dim)
        if self._cache is None or self._cache[0][0].shape != shape:
            self._cache = None  # free the old one first
            self._cache = init_cache(self.cfg, batch, length, self.dtype)
        cache, self._cache = self._cache, None
        return cache

    def _clock(self) -> float:
        """Wall seconds minus compile seconds: phase timings leave compiles out, as
        llama.cpp's do (compiles are reported on their own)."""
        return time.perf_counter() - self.compile_cache.compile_seconds()

    def _prefill(self, rows: list[_Row], batch: int, cache):
        """Run every row's prompt through the model; returns the cache and first tokens."""
        longest = max(len(r.prompt) for r in rows)
        window = np.full((batch, PENALTY_WINDOW), -1, np.int32)
        for b, r in enumerate(rows):
            tail = range(max(0, len(r.prompt) - PENALTY_WINDOW), len(r.prompt))
            window[b, [p % PENALTY_WINDOW for p in tail]] = [r.prompt[p] for p in tail]
        sp = pack(
            [r.params for r in rows], [r.seed for r in rows], [r.stop_ids for r in rows], batch
        )
        first = np.zeros(batch, np.int32)
        picks = []  # (rows ending in this chunk, their sampled tokens)
        offset = 0
        while offset < longest:
            T = _bucket(longest - offset, self.prefill_buckets)
            tokens = np.zeros((batch, T), np.int32)
            lengths = np.zeros(batch, np.int32)
            ending = []
            for b, r in enumerate(rows):
                seg = r.prompt[offset : offset + T]
                tokens[b, : len(seg)] = seg
                lengths[b] = len(seg)
                if seg and offset + T >= len(r.prompt):
                    ending.append(b)
            start = np.full(batch, offset, np.int32)
            cache, sampled = self._run(
                "prefill", self.params, cache, tokens, start, lengths, window, sp
            )
            picks.append((ending, sampled))
            offset += T
        for ending, sampled in picks:
            first[ending] = np.asarray(sampled)[ending]
        return cache, first, sp

    def _generate_batch(self, rows: list[_Row]) -> Iterator[tuple[int, StreamPiece]]:
        """Prefill and decode one batch, yielding (row index, piece) as text is produced."""
        batch = _bucket(len(rows), self.batch_buckets)
        need = max(len(r.prompt) + r.budget for r in rows)
        length = _bucket(need, self.cache_buckets)
        cache = self._take_cache(batch, length)
        clock = self._clock
        t0 = clock()
        cache, first, sp = self._prefill(rows, batch, cache)
        t1 = clock()
        self._perf.prompt_tokens += sum(len(r.prompt) for r in rows)
        self._perf.prompt_ms += (t1 - t0) * 1e3

        done = np.ones(batch, bool)
        for b, r in enumerate(rows):
            yield from self._accept(b, r, [int(first[b])])
            done[b] = r.finish is not None
        carry = {
            "tokens": first,
            "pos": np.array([len(r.prompt) for r in rows] + [0] * (batch - len(rows)), np.int32),
            "budget": np.array([r.budget - 1 for r in rows] + [0] * (batch - len(rows)), np.int32),
            "done": done,
            "window": np.full((batch, PENALTY_WINDOW), -1, np.int32),
        }
        for b, r in enumerate(rows):  # decode refills the window from positions; seed it
            for p in range(max(0, len(r.prompt) - PENALTY_WINDOW + 1), len(r.prompt)):
                carry["window"][b, p % PENALTY_WINDOW] = r.prompt[p]
        generated = 0
        while not all(r.finish for r in rows):
            n = np.int32(self.decode_chunk)
            d0 = clock()
            cache, carry, out = self._run("decode", self.params, cache, carry, sp, n)
            out = np.asarray(out)  # waits for the device
            self._perf.eval_device_ms += (clock() - d0) * 1e3
            host_done = np.asarray(carry["done"]).copy()
            changed = False
            for b, r in enumerate(rows):
                if r.finish:
                    continue
                ids = [int(t) for t in out[b] if t >= 0]
                generated += len(ids)
                yield from self._accept(b, r, ids)
                if r.finish and not host_done[b]:  # a stop string the device cannot see
                    host_done[b] = True
                    changed = True
            if changed:
                carry = {k: np.asarray(v) for k, v in carry.items()}
                carry["done"] = host_done
        self._cache = cache
        t2 = clock()
        self._perf.eval_tokens += generated
        self._perf.eval_ms += (t2 - t1) * 1e3
        for r in rows:
            r.prompt_ms, r.decode_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3

    def _accept(self, b: int, r: _Row, ids: list[int]) -> Iterator[tuple[int, StreamPiece]]:
        """Append new ids to a row: detokenize, apply stops and the budget, stream text."""
        if r.finish or not ids:
            return
        new_ids = []
        for tok in ids:
            new_ids.append(tok)
            r.token_ids.append(tok)
            if tok in r.stop_ids:
                r.finish = "stop"
                break
            r.text += r.decoder.push([tok])
            if self._cut_stop_string(r):
                break
            if len(r.token_ids) >= r.budget:
                r.finish = "length"
                r.text += r.decoder.flush()
                break
        if r.finish == "stop" and tok in r.stop_ids:
            r.text += r.decoder.flush()
        hold = 0 if r.finish else max((len(s) for s in r.stop_strings), default=1) - 1
        upto = max(r.emitted, len(r.text) - hold)
        piece = r.text[r.emitted : upto]
        r.emitted = upto
        yield b, StreamPiece(piece, new_ids, r.finish)

    @staticmethod
    def _cut_stop_string(r: _Row) -> bool:
        for s in r.stop_strings:
            at = r.text.find(s, max(0, r.emitted - len(s)))
            if at >= 0:
                r.text = r.text[:at]
                r.finish = "stop"
                return True
        return False

    # ---- requests -----------------------------------------------------------------------

    def _row(self, prompt, max_new_tokens, params, stop, stop_tokens, ignore_eos) -> _Row:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty; pass some text or token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            if any(t < 0 or t >= self.cfg.vocab_size for t in ids):
                raise RequestError(
                    f"prompt token ids must lie in [0, {self.cfg.vocab_size}); got "
                    f"{min(ids)}..{max(ids)}"
                )
        if not ids:
            raise RequestError("the prompt is empty; pass some text or token ids")
        if len(ids) >= self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but the context holds {self.max_seq_len}; "
                "shorten it or load with a larger max_seq_len (-c)"
            )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise RequestError(f"max_new_tokens = {max_new_tokens!r} is invalid; it must be >= 0")
        stop_strings = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise RequestError("stop strings must be non-empty strings")
        stop_ids = list(stop_tokens or [])
        if not ignore_eos:
            stop_ids += [t for t in self.tokenizer.eos_ids if t not in stop_ids]
        return _Row(
            prompt=ids,
            params=params,
            seed=params.resolved_seed(),
            stop_ids=stop_ids,
            stop_strings=stop_strings,
            budget=min(max_new_tokens, self.max_seq_len - len(ids)),
            decoder=self.tokenizer.stream(),
        )

    def generate(
        self,
        prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_tokens: Sequence[int] | None = None,
        ignore_eos: bool = False,
        stream: bool = False,
    ):
        """Generate from one prompt (text or token ids) or a list of prompts.

        Returns a Result (a list of them for a list of prompts), or with stream=True an
        iterator of StreamPiece for a single prompt.
        """
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            seed=seed,
        )
        many = isinstance(prompt, list | tuple) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = list(prompt) if many else [prompt]
        # Every request is checked before any device work: a bad one changes nothing.
        rows = [
            self._row(p, max_new_tokens, params, stop, stop_tokens, ignore_eos) for p in prompts
        ]
        if stream:
            if many:
                raise RequestError("stream=True takes a single prompt; call it once per prompt")
            return self._stream(rows[0])
        self._drive(rows)
        results = [self._result(r) for r in rows]
        return results if many else results[0]

    def _stream(self, row: _Row) -> Iterator[StreamPiece]:
        t0 = time.perf_counter()
        for _, piece in self._batches([row]):
            if piece.text or piece.token_ids:
                yield piece
        self._perf.total_ms += (time.perf_counter() - t0) * 1e3

    def _drive(self, rows: list[_Row]) -> None:
        t0 = time.perf_counter()
        for _ in self._batches(rows):
            pass
        self._perf.total_ms += (time.perf_counter() - t0) * 1e3

    def _batches(self, rows: list[_Row]) -> Iterator[tuple[int, StreamPiece]]:
        """Serve rows in batches of at most the largest batch bucket."""
        live = [r for r in rows if r.budget > 0]
        for r in rows:
            if r.budget <= 0:
                r.finish = "length"
        step = self.batch_buckets[-1]
        for i in range(0, len(live), step):
            yield from self._generate_batch(live[i : i + step])

    @staticmethod
    def _result(r: _Row) -> Result:
        return Result(
            text=r.text,
            token_ids=list(r.token_ids),
            prompt_ids=list(r.prompt),
            finish_reason=r.finish or "length",
            prompt_ms=r.prompt_ms,
            decode_ms=r.decode_ms,
        )

    # ---- evaluation ---------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Float32 logits [T, V] at every position of `token_ids` (one full forward)."""
        row = self._row(list(token_ids), 0, SamplingParams(), None, None, True)
        ids = row.prompt
        cache = self._take_cache(1, _bucket(len(ids), self.cache_buckets))
        out = []
        offset = 0
        while offset < len(ids):
            T = _bucket(len(ids) - offset, self.prefill_buckets)
            tokens = np.zeros((1, T), np.int32)
            seg = ids[offset : offset + T]
            tokens[0, : len(seg)] = seg
            cache, logits = self._run(
                "score", self.params, cache, tokens, np.array([offset], np.int32)
            )
            out.append(np.asarray(logits[0, : len(seg)]))
            offset += T
        self._cache = cache
        return np.concatenate(out, axis=0)

    def perf_stats(self) -> PerfStats:
        stats = PerfStats(**{k: getattr(self._perf, k) for k in self._perf.__dataclass_fields__})
        stats.compiles = sum(s.compiles for s in self.compile_cache.stats.values())
        stats.compile_seconds = self.compile_cache.compile_seconds()
        stats.graphs_reused = sum(s.calls for s in self.compile_cache.stats.values())
        return stats

    def reset_perf(self) -> None:
        self._perf = PerfStats(load_ms=self._perf.load_ms)
        for s in self.compile_cache.stats.values():
            s.calls = 0
