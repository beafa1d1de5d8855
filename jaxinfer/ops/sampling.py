"""Sampling: per-request values checked on the host, tokens drawn on the device.

Every sampling value travels as an array row, never as a static argument, so changing the
temperature or the seed between requests compiles nothing. The chain is llama.cpp's default
(common/common.h): penalties over the last `PENALTY_WINDOW` tokens, then top-k, top-p and
min-p on the untempered logits, then temperature on the survivors, then the draw.

Two per-row inputs ride along: a token mask (structured output: a packed bitmask the host's
grammar matcher fills, all ones for free rows) applied before everything, and the number of
log-probabilities a row wants back (`logprobs`: the log-softmax of the model's raw logits at
the chosen token and its MAX_LOGPROBS best, computed only when some row asks).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..errors import RequestError
from ..options import MAX_LOGPROBS, SamplingParams

PENALTY_WINDOW = 64  # llama.cpp's --repeat-last-n default; the prompt tail counts too
N_STOP_IDS = 8  # stop-token slots per row (EOS ids + user stop tokens)
# A draw picks from the CANDIDATES highest logits of its row (lax.top_k: one pass over the
# vocabulary) wherever they hold every token the filters keep: always under top-k <= 128
# (llama.cpp's default is 40), and wherever top-p's nucleus or min-p's cut ends among them.
# Other rows sort the vocabulary and draw over all of it, the same distribution. Over a 32k
# vocabulary on this 2-core CPU, per row: the sort 5.8 ms, a draw over all of it 0.7 ms
# (a Gumbel number per token), top-k 0.04 ms.
CANDIDATES = 128

# Columns of the float and int rows packed for the device (one array each keeps the number of
# arguments of a compiled call small).
FLOATS = (
    "temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
)  # fmt: skip
# logprobs: how many best ones a row wants (-1 = none); grammar: 1 where a grammar holds the
# row (its mask is then set each call, and it makes one token a call, without drafts)
INTS = ("top_k", "seed", "logprobs", "grammar")
_C = {name: i for i, name in enumerate(FLOATS)} | {name: i for i, name in enumerate(INTS)}


def recent_window(ids: list[int], width: int = PENALTY_WINDOW) -> np.ndarray:
    """The penalty window [W] of a context: its last W ids, each at (position mod W), -1 where
    empty. The decode step keeps it up to date by writing each new token at its position."""
    window = np.full(width, -1, np.int32)
    tail = range(max(0, len(ids) - width), len(ids))
    window[[p % width for p in tail]] = [ids[p] for p in tail]
    return window


@struct.dataclass
class SamplingRows:
    """The sampling values of B rows; padding rows sample greedily."""

    floats: jax.Array  # [B, len(FLOATS)] float32
    ints: jax.Array  # [B, len(INTS)] int32
    stops: jax.Array  # [B, N_STOP_IDS] int32 stop ids, -1 = unused
    # [B, mask_words(V)] int32: bit t % 32 of word t // 32 allows token t (-1 = every token);
    # None: no masks (the programs always pass one)
    mask: jax.Array | None = None

    if TYPE_CHECKING:  # added by flax.struct.dataclass, which the type checker cannot see

        def replace(self, **updates: Any) -> SamplingRows: ...

    @staticmethod
    def row(params: SamplingParams, seed: int, stop_ids: list[int], guided: bool = False) -> tuple:
        """One request's packed row; checked here, so a bad request fails at submit. A row
        under a grammar (or `guided`: by a reasoning budget) is given no speculative drafts:
        the host looks at each of its tokens, or counts them."""
        if len(stop_ids) > N_STOP_IDS:
            raise RequestError(
                f"at most {N_STOP_IDS} stop tokens per request (EOS ids included), got "
                f"{len(stop_ids)}; pass fewer stop_tokens or ignore_eos=True"
            )
        stops = np.full(N_STOP_IDS, -1, np.int32)
        stops[: len(stop_ids)] = stop_ids
        return (
            np.array([getattr(params, name) for name in FLOATS], np.float32),
            np.array([params.top_k, seed, -1 if params.logprobs is None else params.logprobs,
                      params.constrained or guided], np.int32),
            stops,
        )  # fmt: skip

    @staticmethod
    def abstract(batch: int, vocab: int | None = None) -> SamplingRows:
        def spec(width, dtype):
            return jax.ShapeDtypeStruct((batch, width), dtype)

        mask = spec(mask_words(vocab), np.int32) if vocab else None
        return SamplingRows(
            spec(len(FLOATS), np.float32),
            spec(len(INTS), np.int32),
            spec(N_STOP_IDS, np.int32),
            mask,
        )

    @staticmethod
    def stack(rows: list[tuple], batch: int) -> SamplingRows:
        """Host rows for `batch` rows: `rows` first, then greedy padding (no masks: the
        caller sets `mask`, `free_mask` where nothing is constrained)."""
        floats = np.zeros((batch, len(FLOATS)), np.float32)
        floats[:, _C["top_p"]] = floats[:, _C["repeat_penalty"]] = 1.0
        ints = np.zeros((batch, len(INTS)), np.int32)
        ints[:, _C["logprobs"]] = -1
        stops = np.full((batch, N_STOP_IDS), -1, np.int32)
        for b, (f, i, s) in enumerate(rows):
            floats[b], ints[b], stops[b] = f, i, s
        return SamplingRows(floats, ints, stops)  # type: ignore[arg-type]  # host rows, put later


def free_mask(batch: int, vocab: int) -> np.ndarray:
    """[batch, mask_words(vocab)] int32: every token allowed."""
    return np.full((batch, mask_words(vocab)), -1, np.int32)


def mask_words(vocab: int) -> int:
    """int32 words of a packed token mask over `vocab` tokens."""
    return -(-vocab // 32)


def _masked(logits, mask):
    """logits [N, V] with the tokens `mask` [N, W] does not allow at -inf; batches whose
    masks allow everything skip the pass."""
    if mask is None:
        return logits
    V = logits.shape[-1]

    def apply(_):
        bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [N, W, 32]
        allowed = bits.reshape(mask.shape[0], -1)[:, :V] > 0
        return jnp.where(allowed, logits, -jnp.inf)

    return jax.lax.cond(jnp.all(mask == -1), lambda _: logits, apply, None)


def constrained(rows: SamplingRows) -> jax.Array:
    """[B] whether a grammar holds the row."""
    return rows.ints[:, _C["grammar"]] > 0


@struct.dataclass
class Logprobs:
    """Log-probabilities of chosen tokens under the model's raw logits (before penalties,
    filters and masks, vLLM's default): the token's, and the MAX_LOGPROBS best, descending."""

    token: jax.Array  # [...] float32
    ids: jax.Array  # [..., K] int32
    values: jax.Array  # [..., K] float32

    @staticmethod
    def empty(shape: tuple, vocab: int) -> Logprobs:
        k = min(MAX_LOGPROBS, vocab)
        return Logprobs(
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, k), jnp.int32),
            jnp.zeros((*shape, k), jnp.float32),
        )


def logprobs(logits, tokens, rows: SamplingRows) -> Logprobs:
    """logits [B, ..., V] float32, tokens [B, ...] (negative: none) -> their Logprobs [B, ...];
    zeros unless some row wants them (so a batch without such rows pays nothing)."""
    return token_logprobs(logits, tokens, jnp.any(rows.ints[:, _C["logprobs"]] >= 0))


LOGPROB_ROWS = 64  # positions whose log-softmax is taken at once (token_logprobs)


def token_logprobs(logits, tokens, want) -> Logprobs:
    """logits [..., V] float32, tokens [...] (negative: none) -> their Logprobs [...] where
    `want` (a traced bool), else zeros. Always the MAX_LOGPROBS best: one static width, so
    that the k a caller shows (a host slice) compiles nothing. More than LOGPROB_ROWS
    positions (a scoring chunk's) go LOGPROB_ROWS at a time: the log-softmax and top-k
    temporaries are [LOGPROB_ROWS, V], not [T, V] (125 MiB at 512 x 32k)."""
    V = logits.shape[-1]

    def row(lt):  # (logits [V], token []) -> Logprobs []
        lp = jax.nn.log_softmax(lt[0])
        values, ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, V))
        return Logprobs(lp[jnp.maximum(lt[1], 0)], ids.astype(jnp.int32), values)

    def compute(_):
        flat = (logits.reshape(-1, V), tokens.reshape(-1))
        if flat[1].shape[0] <= LOGPROB_ROWS:
            out = jax.vmap(row)(flat)
        else:  # a loop over blocks of LOGPROB_ROWS rows (the last one ragged)
            out = jax.lax.map(row, flat, batch_size=LOGPROB_ROWS)
        return jax.tree.map(lambda a: a.reshape(*tokens.shape, *a.shape[1:]), out)

    empty = Logprobs.empty(tokens.shape, V)
    return jax.lax.cond(want, compute, lambda _: empty, None)


def _col(rows: jax.Array, name: str) -> jax.Array:
    return rows[:, _C[name], None]  # [B, 1]


def _penalize(logits, window, f):
    """llama.cpp penalties over the recent-token window [B, W] (-1 = empty). Batches whose
    rows all have them off skip the pass over the vocabulary (25 us per row at 32k)."""
    B, V = logits.shape
    rp, presence = _col(f, "repeat_penalty"), _col(f, "presence_penalty")
    frequency = _col(f, "frequency_penalty")

    def apply(_):
        rows = jnp.arange(B)[:, None]
        counts = (
            jnp.zeros((B, V), jnp.float32)
            .at[rows, window]
            .add((window >= 0).astype(jnp.float32), mode="drop")
        )  # [B, V]
        seen = counts > 0
        out = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
        return out - counts * frequency - seen * presence

    off = jnp.all((rp == 1) & (frequency == 0) & (presence == 0))
    return jax.lax.cond(off, lambda _: logits, apply, None)


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis as int32 (the first maximum; the first NaN if any) in
    two plain reductions: XLA CPU's arg-reduce took 137 us per row over a 32k vocabulary,
    these 12 us (2.4 against 0.8 us over stories260K's 512)."""
    best = jnp.max(x, axis=-1, keepdims=True)  # XLA CPU's max may skip NaNs
    nan = jnp.isnan(x)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == best)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _cut(desc, f, top_k, V, lse):
    """top-k, then top-p, then min-p on untempered logits, as llama.cpp's samplers do: each
    filter with its "off" value (k <= 0, p >= 1, min_p <= 0) is skipped, and the best token
    always survives. From desc [B, K], the K highest of each row's V logits in descending
    order, and lse [B, 1], the log-sum-exp of all V: the lowest logit kept [B, 1], and whether
    those K settle it [B] (always when K = V)."""
    K = desc.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[:, None]  # [B, 1]
    at = jnp.arange(K)[None]  # [1, K]
    # Reductions, not slices or gathers, read desc: XLA CPU turned top_k followed by a slice
    # of its last value into a 5 ms sort (32k vocabulary).
    kth = jnp.min(jnp.where(at < k, desc, jnp.inf), axis=-1, keepdims=True)
    kth = jnp.where(k < V, kth, -jnp.inf)  # top-k off keeps everything
    top = jnp.where(at < k, desc, -jnp.inf)  # the top-k survivors among the K
    # top-p's probabilities are over the top-k survivors: all V when top-k is off
    norm = jnp.where(k <= K, jax.nn.logsumexp(top, axis=-1, keepdims=True), lse)
    probs = jnp.exp(top - norm)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    top_p = _col(f, "top_p")
    keep = (before < top_p) | (at == 0)
    p_cut = jnp.where(
        top_p < 1, jnp.min(jnp.where(keep, top, jnp.inf), axis=-1, keepdims=True), -jnp.inf
    )
    min_p = _col(f, "min_p")
    best, last = (r(desc, axis=-1, keepdims=True) for r in (jnp.max, jnp.min))
    min_cut = jnp.where(min_p > 0, best + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
    others = jnp.maximum(kth, min_cut)
    # Settled: top-p's sums are known (k <= K, or top-k off) and its nucleus ends among the K
    # (or cuts no deeper than the other two filters, or the K are the whole vocabulary).
    nucleus = (top_p >= 1) | ~jnp.all(keep, axis=-1, keepdims=True) | (others >= last)
    nucleus |= K == V
    settled = ((k <= K) | (k == V)) & nucleus
    return jnp.maximum(others, p_cut), settled[:, 0]


def _filter(logits, f, top_k, active):
    """The cuts of `_cut` for logits [B, V] f32 (rows not `active` [B] are left alone):
    cut [B, 1], the candidates (the CANDIDATES highest logits [B, K], descending, and their
    ids), and whether the candidates hold every logit >= cut [B]. Rows the candidates do not
    settle take a sort of the vocabulary."""
    V = logits.shape[-1]
    desc, ids = jax.lax.top_k(logits, min(CANDIDATES, V))
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    cut, settled = _cut(desc, f, top_k, V, lse)
    settled |= ~active

    def sort(_):
        full, _ = _cut(-jnp.sort(-logits, axis=-1), f, top_k, V, lse)
        return jnp.where(settled[:, None], cut, full)

    cut = jax.lax.cond(jnp.all(settled), lambda _: cut, sort, None)
    inside = jnp.sum(logits >= cut, axis=-1) == jnp.sum(desc >= cut, axis=-1)
    return cut, desc, ids, inside | ~active


def _draw(keys, logits, cut, candidates, inside, temperature, drop=None):
    """One token per row from softmax(logits / temperature) over the logits >= cut (and not
    `drop` [B], where given), by the Gumbel-max trick with the row's key (jax.random.
    categorical's draw): over the candidates where they hold every such logit, else over the
    vocabulary."""
    desc, ids = candidates

    def gumbel_max(x):  # [B, N] -> [B]
        noise = jax.vmap(lambda key, row: jax.random.gumbel(key, row.shape, row.dtype))(keys, x)
        return argmax(x + noise)

    def kept(x, at):
        ok = x >= cut if drop is None else (x >= cut) & (at != drop[:, None])
        return jnp.where(ok, x, -jnp.inf) / temperature

    small = gumbel_max(kept(desc, ids))
    small = jnp.take_along_axis(ids, small[:, None], axis=-1)[:, 0]

    def full(_):
        at = jnp.arange(logits.shape[-1])[None]
        return jnp.where(inside, small, gumbel_max(kept(logits, at)))

    return jax.lax.cond(jnp.all(inside), lambda _: small, full, None).astype(jnp.int32)


def _key(seed, position, salt=None):
    key = jax.random.fold_in(jax.random.key(seed), position)
    return key if salt is None else jax.random.fold_in(key, salt)


@jax.jit  # traced once per batch size, shared by the prefill and decode programs
def sample(logits, window, rows: SamplingRows, positions):
    """logits [B, V] f32, window [B, W], the rows' values, positions [B] of the new tokens
    -> tokens [B].

    The key of each draw is (seed, position): the same seed gives the same text however the
    decode is split into calls.
    """
    f = rows.floats
    logits = _penalize(_masked(logits, rows.mask), window, f)
    greedy = argmax(logits)
    temperature = _col(f, "temperature")

    def draw(_):
        active = temperature[:, 0] > 0
        cut, *candidates, inside = _filter(logits, f, rows.ints[:, _C["top_k"]], active)
        keys = jax.vmap(_key)(rows.ints[:, _C["seed"]], positions)
        drawn = _draw(keys, logits, cut, candidates, inside, jnp.maximum(temperature, 1e-6))
        return jnp.where(active, drawn, greedy)

    # All-greedy batches skip the draw.
    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)


@jax.jit
def accept(logits, windows, rows: SamplingRows, positions, drafts, count):
    """Speculative verification: the target's logits [B, T, V] at a row's input token and its
    T - 1 drafts, the penalty window [B, T, W] each position sees, positions [B, T] of the
    tokens they predict, drafts [B, T - 1] of which the first count [B] are real ->
    tokens [B, T] (-1 past the last), accepted drafts n [B].

    Greedy rows accept while the draft is the target's argmax. Sampling rows use the standard
    rejection rule for a deterministic draft (llama.cpp's and vLLM's drafts are one-hot too):
    draft d is kept with probability p(d); at the first rejection the token is drawn from p
    without d, renormalized; with every draft kept, the next token is drawn from p. The
    result is distributed exactly as sampling without speculation; with no drafts it is the
    same token (the same key).
    """
    B, T, V = logits.shape
    flat = jax.tree.map(lambda a: jnp.repeat(a, T, axis=0), rows)  # [B*T, ...]
    f = flat.floats
    logits = _masked(logits.reshape(B * T, V), flat.mask)
    logits = _penalize(logits, windows.reshape(B * T, -1), f)
    greedy = argmax(logits).reshape(B, T)
    temperature = rows.floats[:, _C["temperature"]]  # [B]
    steps = jnp.arange(T)[None]  # [1, T]
    real = steps[:, :-1] < count[:, None]  # [B, T - 1]

    def kept(n_kept):  # drafts accepted: the run of leading kept ones
        return jnp.sum(jnp.cumprod(n_kept & real, axis=1), axis=1).astype(jnp.int32)

    def draw(_):
        sampled = temperature > 0
        t = jnp.maximum(_col(f, "temperature"), 1e-6)  # [B*T, 1]
        top_k = flat.ints[:, _C["top_k"]]
        cut, desc, ids, inside = _filter(logits, f, top_k, jnp.repeat(sampled, T))
        tempered = (jnp.where(logits >= cut, logits, -jnp.inf) / t).reshape(B, T, V)
        seeds = jnp.broadcast_to(rows.ints[:, _C["seed"], None], (B, T))
        p = jax.nn.softmax(tempered, axis=-1)
        p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
        keys = jax.vmap(jax.vmap(partial(_key, salt=1)))(seeds[:, :-1], positions[:, :-1])
        u = jax.vmap(jax.vmap(jax.random.uniform))(keys)  # [B, T - 1]
        n = kept(jnp.where(sampled[:, None], u < p_draft, drafts == greedy[:, :-1]))
        rows_ = jnp.arange(B)
        at = rows_ * T + n  # each row's first unkept position, in the flat rows
        rejected = n < count
        d = jnp.take_along_axis(drafts, jnp.minimum(n, T - 2)[:, None], axis=1)[:, 0]
        pos, seed = positions[rows_, n], rows.ints[:, _C["seed"]]
        salted = jax.vmap(partial(_key, salt=2))(seed, pos)
        plain = jax.vmap(_key)(seed, pos)
        keys = jax.vmap(lambda r, a, b: jax.lax.select(r, a, b))(rejected, salted, plain)
        # drawn from p at that position, without d after a rejection
        candidates = (desc[at], ids[at])
        drop = jnp.where(rejected, d, -1)
        drawn = _draw(keys, logits[at], cut[at], candidates, inside[at], t[at], drop)
        return n, jnp.where(sampled, drawn, greedy[rows_, n])

    def take_greedy(_):
        n = kept(drafts == greedy[:, :-1])
        return n, greedy[jnp.arange(B), n]

    n, final = jax.lax.cond(jnp.any(temperature > 0), draw, take_greedy, None)
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)  # [B, T]
    tokens = jnp.where(
        steps < n[:, None], padded, jnp.where(steps == n[:, None], final[:, None], -1)
    )
    return tokens, n
