"""The plain programs, as pure functions of arrays over a `Setup` (the model on one mesh):

  cache()                                            -> kv                 zeroed page pools
  prefill(params, kv, chunk)                         -> kv, logits [R, V]  one prompt chunk per row
  sample_first(params, kv, logits, window, sampling, pos) -> kv, tokens [R], lp  (program `sample`)
  decode(params, kv, state, table, sampling, steps[, snaps]) -> kv, state, out [B, decode_chunk], lp
  score(params, kv, chunk, following)                -> kv, logits [B, T, V], lp [B, T]
  pool(params, kv, chunk, pick)                      -> kv, pooled [B, 3, D], picked [B, P]

The page pools and linear-layer states `kv` are donated. With prefix snapshots (hybrid models
under prefix caching), the state indices past the requests' ones are snapshots: the linear
layers' states at page ends, which prefill and decode write where the host's snapshot table
says (`snaps` [B, NB], per page) and a prompt chunk starts from after a prefix hit
(`view.source`). `decode` runs up to decode_chunk steps inside
one `while_loop` and leaves early when every row is done, so the host only wakes to stream
and check stops. No program depends on the context length: rows reach their pages through
block tables. `lp` holds the log-probabilities of the tokens made (zeros unless a row asked
for them, sampling.Logprobs). Speculative decoding's `verify` is in speculative.py;
programs.py binds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ..model import gdn
from ..model.gdn import RecurrentState
from ..model.kvcache import KVConfig, KVView
from ..ops.sampling import (
    Logprobs,
    SamplingRows,
    constrained,
    logprobs,
    sample,
    token_logprobs,
)
from ..parallel.placement import Runner
from .inputs import I32, Chunk, DecodeState, ring_put


@dataclass(frozen=True)
class Setup:
    """What every program of one model on one mesh is built over: the model's runner, what
    proposes drafts (a draft model's runner, the MTP head, n-gram lookup or nothing), the KV
    geometry and decode_chunk, the most decode steps in one call. With a draft model, `params`
    is (the model's, the draft's) and `kv` lists the model's layers then the draft's (one page pool,
    one set of state indices); the MTP head keeps its caches after the model's (its attention pools,
    then the per-request hidden state)."""

    runner: Runner
    kv_config: KVConfig
    decode_chunk: int
    vocab: int  # V, the width of the logits
    spec: Any = None  # speculative.SpecConfig; None: no speculation
    draft: Runner | None = None
    rows: int = 1  # R: the rows of prefill's logits (B of them real) and of `sample`'s call

    @property
    def snapshots(self) -> bool:
        return self.kv_config.snapshots > 0

    @property
    def n_model(self) -> int:
        return len(self.runner.caches)

    @property
    def caches(self) -> tuple:
        return self.runner.caches + (self.draft.caches if self.draft else self.runner.mtp_caches)

    def linear(self, of: str) -> list[bool]:
        """Per cache of the model (`of` = "model") or of the proposer ("draft"): whether it is
        a linear layer's state."""
        flags = [isinstance(c, RecurrentState) for c in self.caches]
        return flags[: self.n_model] if of == "model" else flags[self.n_model :]

    def split(self, params, kv):
        """(model params, model kv, draft params, the proposer's kv)."""
        if self.draft is None:
            return params, kv[: self.n_model], None, kv[self.n_model :]
        return params[0], kv[: self.n_model], params[1], kv[self.n_model :]


def cache(setup: Setup):
    kv, draft = setup.kv_config, setup.draft
    extra = draft.init_kv(kv) if draft else [c.init(kv) for c in setup.caches[setup.n_model :]]
    return setup.runner.init_kv(kv) + extra


def mtp_rows(setup: Setup, params, mtp_kv, hidden, tokens, view: KVView):
    """The MTP head over rows view.start + t (hidden [B, T, D] the model's at those
    positions, tokens [B, T] the tokens after them) -> its outputs [B, T, D], its kv."""
    assert setup.runner.mtp is not None  # called only with an MTP head
    g, pools = setup.runner.mtp(params, jnp.maximum(tokens, 0), hidden, view, mtp_kv[0])
    return g, [pools, *mtp_kv[1:]]


def take_states(setup: Setup, kv, state_index, keep: int = 0, of: str = "model"):
    """Linear layers' states out of their pools for a loop: [B, ...] per row, or with
    `keep` = T, T copies [B, T, ...] (speculation keeps every token's state)."""
    axis = setup.runner.state_axis

    def one(c, lin):
        if not lin:
            return c
        states = gdn.take(c, state_index, axis)
        if keep:
            states = tuple(jnp.repeat(jnp.expand_dims(s, axis + 1), keep, axis + 1)
                           for s in states)  # fmt: skip
        return states

    return [one(c, lin) for c, lin in zip(kv, setup.linear(of), strict=True)]


def page_end_ids(setup: Setup, snaps, pos, ok):
    """[B] the snapshot that takes a row's state after its token at pos [B]: its page's entry
    of snaps [B, NB] where ok [B] and the token ends a page; out of range (none) elsewhere."""
    page, skip = setup.kv_config.page_size, setup.kv_config.n_states
    at = jnp.clip(pos // page, 0, snaps.shape[1] - 1)
    ends = ok & ((pos + 1) % page == 0)
    return jnp.where(ends, jnp.take_along_axis(snaps, at[:, None], axis=1)[:, 0], skip)


def linear_pools(setup: Setup, kv, of: str = "model") -> list:
    """The linear layers' pools of `kv` (None for the others): what a loop that writes
    snapshots carries besides the rows' own states."""
    return [c if lin else None for c, lin in zip(kv, setup.linear(of), strict=True)]


def put_states(setup: Setup, pools, kv, state_index, pick=None, of: str = "model", snapshot=False):
    """The loop's linear states back into their pools (with `pick` [B], each row's state
    at that index: the accepted token's). With `snapshot`, into the snapshots `state_index` [B]
    instead (out of range: none), the other entries of `pools` passing through."""
    axis = setup.runner.state_axis

    def one(p, c, lin):
        if not lin:
            return p if snapshot else c
        if pick is not None:
            c = tuple(gdn.select(a, pick, axis) for a in c)
        return gdn.put(p, c, state_index, axis, skip=snapshot)

    return [one(p, c, lin) for p, c, lin in zip(pools, kv, setup.linear(of), strict=True)]


def prefill(setup: Setup, params, kv, chunk: Chunk):
    """-> kv, the logits after each row's last real token, float32 [R, V] (rows past B
    zero). The token after a prompt is drawn from them by `sample_first`, one program for
    every prefill bucket: the sampler is about 40% of a prefill program's instructions, and
    XLA keeps each loaded executable's HLO in memory (about 5 KB an instruction)."""
    runner, draft = setup.runner, setup.draft
    params, kv, draft_params, draft_kv = setup.split(params, kv)
    B, T = chunk.tokens.shape
    view = chunk.view
    if view.snaps is not None:
        view = view.replace(page=setup.kv_config.page_size)
    h, kv = runner.forward(params, chunk.tokens, view, kv)  # [B, T, D]
    if draft:
        _, draft_kv = draft.forward(draft_params, chunk.tokens, view, draft_kv)
    last = jnp.clip(view.length - 1, 0, T - 1)  # [B]
    if runner.mtp:
        draft_kv = mtp_prefill(setup, params, draft_kv, h, chunk.tokens, view)
    logits = runner.head(params, h[jnp.arange(B), last])  # [B, V]
    return kv + draft_kv, jnp.pad(logits, ((0, setup.rows - B), (0, 0)))  # [R, V]


def sample_first(setup: Setup, params, kv, logits, window, sampling: SamplingRows, positions):
    """The token after a prompt: logits [R, V] (prefill's), the prompt's penalty window
    [R, W], positions [R] of the new tokens -> kv (untouched; the programs share their
    leading arguments), tokens [R], lp."""
    tokens = sample(logits, window, sampling, positions)
    return kv, tokens, logprobs(logits, tokens, sampling)


def mtp_prefill(setup: Setup, params, mtp_kv, h, tokens, view: KVView):
    """The MTP head's rows of a prompt chunk (h [B, T, D] the model's, tokens [B, T]). Row p
    pairs h_p with token p + 1 at cache position p, so a chunk holds rows start - 1 ..
    start + length - 2: the first pairs the hidden state waiting at the state index (the previous
    chunk's last) with the chunk's first token, and the chunk's last hidden state waits for
    the token after it (the next chunk's or the first generated one). A prompt's first chunk,
    and the first after a prefix hit, start at row start: a cached page is never written
    (its last row, paired with the token after the page, was written before the page was
    cached: the scheduler registers an MTP model's pages one position late)."""
    B, T = tokens.shape
    assert view.state_index is not None  # a prompt chunk's rows have state indices
    (waiting,) = gdn.take(mtp_kv[1], view.state_index)  # [B, D]
    first = view.start == 0  # no row before: the prompt's first token, or a hit
    if view.source is not None:
        first = first | (view.source != view.state_index)
    earlier = jnp.concatenate([waiting[:, None].astype(h.dtype), h[:, :-1]], axis=1)
    hidden = jnp.where(first[:, None, None], h, earlier)
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    following = jnp.where(first[:, None], shifted, tokens)
    rows = jnp.maximum(view.length - first, 0)
    mtp_view = KVView(view.table, view.start - 1 + first, rows, None)
    _, mtp_kv = mtp_rows(setup, params, mtp_kv, hidden, following, mtp_view)
    last = jnp.clip(view.length - 1, 0, T - 1)
    mtp_kv[1] = gdn.put(mtp_kv[1], (h[jnp.arange(B), last],), view.state_index)
    return mtp_kv


def decode(
    setup: Setup, params, kv, state: DecodeState, table, sampling: SamplingRows, steps, snaps=None
):
    """Up to `steps` (<= decode_chunk) tokens per row, one for a row a grammar guides (the host
    fills its mask for each token: it rests for the rest of the call while the others go on);
    table [B, NB] covers every position written. Linear layers' states leave their pools for
    the loop and return after it; with snapshots (snaps [B, NB]), a state at a page end also
    goes to its page's snapshot."""
    runner = setup.runner
    params, kv, _, draft_kv = setup.split(params, kv)
    B = state.tokens.shape[0]
    pools = linear_pools(setup, kv) if snaps is not None else kv
    kv = take_states(setup, kv, state.state_index)
    guided = constrained(sampling)  # [B]

    def step(carry):
        i, kv, pools, s, out, lp, ended = carry
        # The input token joins the penalty context of the token it predicts.
        window = ring_put(s.window, s.pos, s.tokens[:, None], jnp.ones_like(s.pos))
        live = ~s.done
        # Done rows write the null page and leave their linear state as it is.
        view = KVView(table, s.pos, live.astype(I32), None)
        h, kv = runner.forward(params, s.tokens[:, None], view, kv)  # [B, 1, D]
        if snaps is not None:
            ids = page_end_ids(setup, snaps, s.pos, live)
            pools = put_states(setup, pools, kv, ids, snapshot=True)
        logits = runner.head(params, h[:, 0])  # [B, V]
        new = sample(logits, window, sampling, s.pos + 1)  # [B]
        stop = jnp.any(new[:, None] == sampling.stops, axis=-1)
        budget = s.budget - live
        out = out.at[:, i].set(jnp.where(live, new, -1))
        lp = jax.tree.map(lambda a, x: a.at[:, i].set(x), lp, logprobs(logits, new, sampling))
        ended = ended | (live & (stop | (budget <= 0)))
        s = s.replace(
            tokens=jnp.where(live, new, s.tokens),
            pos=s.pos + live,
            budget=budget,
            done=s.done | ended | (live & guided),  # a guided row rests after its token
            window=window,
        )
        return i + 1, kv, pools, s, out, lp, ended

    def more(carry):
        i, _, _, s, *_ = carry
        return (i < steps) & ~jnp.all(s.done)

    chunk = setup.decode_chunk
    out = jnp.full((B, chunk), -1, I32)
    lp = Logprobs.empty((B, chunk), setup.vocab)
    init = (jnp.int32(0), kv, pools if snaps is not None else (), state, out, lp, state.done)
    _, kv, carried, state, out, lp, ended = jax.lax.while_loop(more, step, init)
    state = state.replace(done=ended)  # a rested row goes on in the next call
    pools = carried if snaps is not None else pools
    return put_states(setup, pools, kv, state.state_index) + draft_kv, state, out, lp


def score(setup: Setup, params, kv, chunk: Chunk, following):
    """following [B, T]: the token after each position (negative: none) -> kv, logits
    [B, T, V] and the Logprobs [B, T] of `following` under them (the log-softmax and its
    MAX_LOGPROBS best, per chunk on the device: echo's prompt logprobs never bring [T, V]
    to the host); zeros when no position has one (Engine.logits pays nothing for them)."""
    params, kv, _, draft_kv = setup.split(params, kv)
    h, kv = setup.runner.forward(params, chunk.tokens, chunk.view, kv)
    logits = setup.runner.head(params, h)  # [B, T, V]
    lp = token_logprobs(logits, following, jnp.any(following >= 0))
    return kv + draft_kv, logits, lp


PICK = 2  # P: the tokens whose logits a pooled pass returns (rerank's "yes" and "no")


def pool(setup: Setup, params, kv, chunk: Chunk, pick):
    """The pooled pass of embeddings and rerank: a prompt chunk per row, whose final-normed
    hidden states leave pooled three ways, float32 -> kv, pooled [B, 3, D] (each row's
    state at its last real token, their sum over its real tokens, and at the chunk's first
    token) and picked [B, P], the logits of the tokens `pick` [P] at its last real token.
    The head runs on one position per row: no [T, V] logits are made. The host adds the
    chunks' sums of a text longer than one chunk; its KV pages are given back after."""
    params, kv, _, draft_kv = setup.split(params, kv)
    B, T = chunk.tokens.shape
    h, kv = setup.runner.forward(params, chunk.tokens, chunk.view, kv)  # [B, T, D]
    last = h[jnp.arange(B), jnp.clip(chunk.view.length - 1, 0, T - 1)]  # [B, D]
    real = jnp.arange(T)[None, :] < chunk.view.length[:, None]  # [B, T]
    total = jnp.sum(jnp.where(real[..., None], h.astype(jnp.float32), 0.0), axis=1)  # [B, D]
    pooled = jnp.stack([last.astype(jnp.float32), total, h[:, 0].astype(jnp.float32)], axis=1)
    logits = setup.runner.head(params, last)  # [B, V]
    return kv + draft_kv, pooled, jnp.take(logits, pick, axis=1)  # [B, 3, D], [B, P]
