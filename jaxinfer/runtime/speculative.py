"""Speculative decoding: what proposes the drafts, and how the decode loop carries them.

A speculative engine decodes with `verify` (below) instead of `decode` (steps.py): each step of its
loop proposes up to K drafts per row, scores the row's input token and its drafts in one
forward of K + 1 tokens, and keeps the accepted prefix (sampling.accept). How many drafts a
row accepts is data, never shape: the program set is the plain one with `verify[B]` in place
of `decode[B]`.

Proposers, all on the device inside the loop:
- `ngram`: prompt lookup. The longest recent match (NGRAM_MIN .. NGRAM_MAX tokens) of the
  row's last tokens in its own history (prompt and output, the last NGRAM_HISTORY positions)
  proposes the tokens that followed it.
- `mtp`: the checkpoint's multi-token-prediction head (model.MTP), one layer with its own KV
  layer in the page pool: after each step it reads the model's hidden states of the kept
  tokens (writing their rows of its cache), then chains K - 1 steps on its own output. The
  model's hidden state of a row's last kept token waits in a per-request `HiddenState`.
- `draft`: a second, smaller model with the same vocabulary, on the same mesh, with its own
  KV layers and linear states in the same page pool and state indices; it runs K + 1 greedy decode
  steps per loop step (the last one only feeds its cache the last draft).

Rejected drafts need no undo. Attention KV past the accepted position is overwritten later;
linear-attention layers keep every token's state during the call ([B, K + 1, ...] per row,
`KVView.pick` / `keep_at`) and the next step starts from the accepted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..model import gdn
from ..model.kvcache import KVView
from ..ops.sampling import (
    Logprobs,
    SamplingRows,
    accept,
    argmax,
    constrained,
    logprobs,
    sample,
)
from .drafting import NGRAM_HISTORY, NGRAM_MAX, NGRAM_MIN
from .inputs import I32, DecodeState, ring_put
from .steps import (
    Setup,
    linear_pools,
    mtp_rows,
    page_end_ids,
    put_states,
    take_states,
)

METHODS = ("ngram", "draft", "mtp")
BACKOFF_LOG2 = 4  # a row that keeps missing drafts tries again every 2**4 = 16 steps


@dataclass(frozen=True)
class SpecConfig:
    method: str  # one of METHODS
    k: int  # draft tokens per step (K)
    vocab: int = 0  # a draft model proposes ids below this (the model's vocab_size); 0: any

    @property
    def history(self) -> int:
        """Width of the token history the decode state carries (0: none needed)."""
        return NGRAM_HISTORY if self.method == "ngram" else 0


def suffix_matches(history: jax.Array, pos: jax.Array) -> jax.Array:
    """history [B, H] token ids by position mod H (-1 = empty), holding positions up to pos [B]
    -> matches [B, H]: at each entry, how many tokens (capped at NGRAM_MAX) the window ending
    there shares with the window ending at pos. Computed once per call; `extend` keeps it."""
    B, H = history.shape
    rows = jnp.arange(B)[:, None]
    age = (pos[:, None] - jnp.arange(H)[None]) % H  # [B, H] how far back each entry lies
    length = jnp.zeros((B, H), jnp.int32)
    run = jnp.ones((B, H), jnp.bool_)
    for i in range(NGRAM_MAX):
        token = history[rows, (pos[:, None] - i) % H]  # [B, 1] the suffix's i-th last token
        earlier = jnp.roll(history, i, axis=1)  # [b, x] = history at x - i
        # entry x ends a candidate at position pos - age; its i-th token must exist
        run = run & (earlier == token) & (age + i <= pos[:, None])
        length = length + run
    return length


def extend(matches, history, pos, new, count) -> tuple[jax.Array, jax.Array]:
    """Each row appends its tokens new[b, :count[b]] (new [B, t]) after position pos [b] ->
    the matches [B, H] and history [B, H] of the window ending at its last one. A window
    ending at entry x grows by one where x holds the new token and the window before it
    matched, else it is 0: O(H) a token where `suffix_matches` is O(NGRAM_MAX x H), for the
    decode loop looks up every step and must cost a small model's step little."""
    entry = jnp.arange(history.shape[1])[None]
    for t in range(new.shape[1]):
        token, write = new[:, t, None], (t < count)[:, None]
        grown = jnp.minimum(jnp.roll(matches, 1, axis=1) + 1, NGRAM_MAX)
        matches = jnp.where(write, jnp.where(history == token, grown, 0), matches)
        at = entry == ((pos + 1 + t) % history.shape[1])[:, None]
        history = jnp.where(write & at, token, history)  # written after: its own entry is age 0
    return matches, history


def propose(matches: jax.Array, history: jax.Array, pos: jax.Array, k: int):
    """Prompt lookup from the matches [B, H] of the window ending at pos [B] -> drafts [B, k],
    count [B] real drafts. The longest match (at least NGRAM_MIN), the most recent among
    equals, proposes the tokens that followed it."""
    H = history.shape[1]
    age = (pos[:, None] - jnp.arange(H)[None]) % H  # [B, H]
    usable = (age >= 1) & (age <= H - NGRAM_MAX)  # earlier than pos, its window still held
    # One max: length * H - age orders by length, then recency, and encodes both.
    best = jnp.max(jnp.where(usable, matches * H - age, -H), axis=1)  # [B]
    length = (best + H - 1) // H
    best_age = length * H - best
    count = jnp.where(length >= NGRAM_MIN, jnp.minimum(k, best_age), 0)  # known followers
    follow = (pos[:, None] - best_age[:, None] + 1 + jnp.arange(k)[None]) % H  # [B, k]
    drafts = jnp.take_along_axis(history, follow, axis=1)
    drafts = jnp.where(jnp.arange(k)[None] < count[:, None], drafts, 0)
    return drafts.astype(jnp.int32), count.astype(jnp.int32)


def ngram(history: jax.Array, pos: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Prompt lookup. history [B, H] token ids by position mod H (-1 = empty), holding
    positions up to pos [B] (the row's input token) -> drafts [B, k], count [B] real drafts.

    The row's last n tokens (n up to NGRAM_MAX) are compared with every earlier window of its
    history; the longest match, the most recent among equals, proposes what followed it.
    """
    return propose(suffix_matches(history, pos), history, pos, k)


def backoff(state: jax.Array, count: jax.Array, n: jax.Array) -> jax.Array:
    """A row whose verified drafts were all refused waits 1, 3, 7, 15 ... steps before
    drafting again (speculation that never pays costs little); a kept draft resets.
    state [B, 2] (verify steps in a row that kept no draft, steps left without drafting),
    count [B] drafts the step verified, n [B] drafts it accepted -> the new state [B, 2]."""
    miss, wait = state[:, 0], state[:, 1]
    verified = count > 0
    miss = jnp.where(verified, jnp.where(n > 0, 0, miss + 1), miss)
    wait = jnp.where(verified, (1 << jnp.minimum(miss, BACKOFF_LOG2)) - 1, jnp.maximum(wait - 1, 0))
    return jnp.stack([miss, wait], axis=1)


def trust(backoff: jax.Array, guess, count, first, n) -> jax.Array:
    """n-gram's gate: backoff[:, 0] counts the lookup's proposals that came true in a row; a
    row drafts once it reaches backoff[:, 1] (the host's: more where a verify step costs more
    plain steps, drafting.StepCosts). guess [B] the first token the last lookup proposed (-1: none),
    drafted or not; count [B] drafts the step scored, n [B] kept; first [B] the token the step
    made after the input one -> the new backoff [B, 2]."""
    streak = backoff[:, 0]
    came = jnp.where(guess >= 0, jnp.where(first == guess, streak + 1, 0), streak)
    streak = jnp.where(count > 0, jnp.where(n == count, streak + n, 0), came)
    return jnp.stack([streak, backoff[:, 1]], axis=1)


def with_input(s: DecodeState) -> jax.Array:
    """The history [B, H] with each row's input token at its position (n-gram lookup)."""
    H = s.history.shape[1]
    return ring_put(s.history, s.pos, s.tokens[:, None], jnp.ones_like(s.pos)) if H else s.history


def advance(s: DecodeState, made, out, new, n, stops, window, history, lp: Logprobs):
    """Keep tokens new[:, :n + 1] of each live row (of ~s.done) up to its first stop token:
    made [B] tokens the call made so far, out (the call's tokens [B, decode_chunk + K], -1 =
    none, and their Logprobs), new [B, t] candidates and lp their Logprobs, n [B] accepted drafts,
    stops [B, S] stop ids (-1 = unused), window [B, W] and history [B, H] after the step ->
    made, out, the row's new state, n (what it kept of its drafts, 0 for done rows)."""
    B = new.shape[0]
    rows = jnp.arange(B)
    live = ~s.done
    at = jnp.arange(new.shape[1])[None]
    stop = jnp.any(new[..., None] == stops[:, None], axis=-1) & (at <= n[:, None])
    hit = jnp.any(stop, axis=1)
    n = jnp.where(live, jnp.where(hit, jnp.minimum(n, jnp.argmax(stop, axis=1)), n), 0)
    made_now = jnp.where(live, n + 1, 0)
    ids, out_lp = out
    ids = ring_put(ids, made, new, made_now)  # made + n + 1 <= decode_chunk + K: never wraps
    out_lp = jax.tree.map(lambda a, x: ring_put(a, made, x, made_now), out_lp, lp)
    budget = s.budget - made_now
    s = s.replace(
        tokens=jnp.where(live, new[rows, n], s.tokens),
        pos=s.pos + made_now,
        budget=budget,
        done=s.done | (live & hit) | (budget <= 0),
        window=window,
        history=history,
    )
    return made + made_now, (ids, out_lp), s, n


class Loop(NamedTuple):
    """What stays the same through one verify call."""

    setup: Setup
    params: Any  # the model's
    draft_params: Any  # the draft model's (None for n-gram and MTP)
    table: jax.Array  # [B, NB] block tables
    sampling: SamplingRows
    snaps: jax.Array | None = None  # [B, NB] per page its snapshot (prefix caching)


def mtp_drafts(loop: Loop, live, state_index, mtp_kv, hidden, tokens, start, length):
    """The MTP head reads the rows kept since its last proposal (the model's hidden states
    [B, t, D] and the tokens after them [B, t], from position start [B], length [B] of them),
    drafts from the last one, then chains K - 1 steps on its own output -> drafts [B, K],
    count [B], its kv."""
    setup, table = loop.setup, loop.table
    K, runner, params = setup.spec.k, setup.runner, loop.params
    rows = jnp.arange(tokens.shape[0])
    with jax.named_scope("draft"):
        view = KVView(table, start, length, None)
        g, mtp_kv = mtp_rows(setup, params, mtp_kv, hidden, tokens, view)  # [B, t, D]
        last = jnp.clip(length - 1, 0, tokens.shape[1] - 1)
        # The model's state of the last kept token: the next call starts from it.
        mtp_kv[1] = gdn.put(mtp_kv[1], (hidden[rows, last],), state_index)
        g = g[rows, last]  # [B, D]
        first = argmax(runner.head(params, g))
        drafts = jnp.where(jnp.arange(K)[None] == 0, first[:, None], 0)

        def chain(k, carry):  # row start + length - 1 + k: (its own output, draft k)
            g, token, drafts, mtp_kv = carry
            view = KVView(table, start + length - 1 + k, live.astype(I32), None)
            g, mtp_kv = mtp_rows(setup, params, mtp_kv, g[:, None], token[:, None], view)
            g = g[:, 0]
            token = argmax(runner.head(params, g))
            drafts = jnp.where(jnp.arange(K)[None] == k, token[:, None], drafts)
            return g, token, drafts, mtp_kv

        _, _, drafts, mtp_kv = jax.lax.fori_loop(1, K, chain, (g, first, drafts, mtp_kv))
    return drafts, jnp.full(live.shape, K, I32), mtp_kv


def model_drafts(loop: Loop, s: DecodeState, live, pick, draft_kv):
    """A draft model's K greedy steps from each row's input token (step K only feeds its
    cache the last draft) -> drafts [B, K], count [B], its kv. Its linear states start from
    the accepted token's (`pick` [B]) and keep every token's, index T = K + 1 being the state
    before the pending input token."""
    setup = loop.setup
    draft, K, axis = setup.draft, setup.spec.k, setup.runner.state_axis
    assert draft is not None  # called only with a draft model
    B, T = s.tokens.shape[0], K + 1

    def one(t, carry):  # the draft's greedy step t: input x_t at pos + t
        token, drafts, draft_kv = carry
        view = KVView(loop.table, s.pos + t, live.astype(I32), None, jnp.where(t == 0, T, t - 1), t)
        h, draft_kv = draft.forward(loop.draft_params, token[:, None], view, draft_kv)
        logits = draft.head(loop.draft_params, h[:, 0])[:, : setup.spec.vocab or None]
        new = argmax(logits)
        drafts = jnp.where(jnp.arange(K)[None] == t, new[:, None], drafts)
        return new, drafts, draft_kv

    drafts = jnp.zeros((B, K), I32)
    draft_kv = [  # the accepted state becomes the base the draft starts from
        tuple(
            jax.lax.dynamic_update_slice_in_dim(
                a, jnp.expand_dims(gdn.select(a, pick, axis), axis + 1), T, axis + 1
            )
            for a in c
        ) if lin else c
        for c, lin in zip(draft_kv, setup.linear("draft"), strict=True)
    ]  # fmt: skip
    # While every row backs off, the draft only reads the input token.
    steps = jnp.where(jnp.any(live & (s.backoff[:, 1] == 0)), T, 1)
    with jax.named_scope("draft"):
        _, drafts, draft_kv = jax.lax.fori_loop(0, steps, one, (s.tokens, drafts, draft_kv))
    return drafts, jnp.full((B,), K, I32), draft_kv


def next_drafts(loop: Loop, s: DecodeState, pick, draft_kv, catch, matches):
    """The coming step's drafts [B, K] and count [B] (0 for done rows, rows backing off and
    rows a grammar holds, and never past a row's budget), and the proposer's kv. `catch`:
    for the MTP head, the rows kept since its last proposal (their hidden states, next
    tokens, first position and count); `matches`: for n-gram, those of s.history (which holds
    the input tokens) at s.pos."""
    live = ~s.done
    method, K = loop.setup.spec.method, loop.setup.spec.k
    guess = jnp.full(live.shape, -1, I32)
    if method == "ngram":
        drafts, count = propose(matches, s.history, s.pos, K)
        guess = jnp.where(count > 0, drafts[:, 0], -1)
        count = jnp.where(s.backoff[:, 0] >= s.backoff[:, 1], count, 0)  # trusted enough
    else:
        if method == "mtp":
            drafts, count, draft_kv = mtp_drafts(loop, live, s.state_index, draft_kv, *catch)
        else:
            drafts, count, draft_kv = model_drafts(loop, s, live, pick, draft_kv)
        count = jnp.where(s.backoff[:, 1] > 0, 0, count)  # backing off
    count = jnp.where(constrained(loop.sampling), 0, count)
    return drafts, jnp.where(live, jnp.minimum(count, s.budget - 1), 0), draft_kv, guess


def score_drafts(loop: Loop, s: DecodeState, kv, window, drafts, count, pick):
    """One forward over each row's input token and its drafts (T = K + 1 tokens) and the
    acceptance rule -> candidates [B, T], accepted n [B], hidden [B, T, D], kv, the penalty
    windows [B, T, W] each position saw, the candidates' Logprobs [B, T]."""
    setup, sampling = loop.setup, loop.sampling
    runner, K = setup.runner, setup.spec.k
    live = ~s.done
    tokens = jnp.concatenate([s.tokens[:, None], drafts], axis=1)  # [B, T]
    view = KVView(loop.table, s.pos, jnp.where(live, 1 + count, 0), None, pick, jnp.int32(0))
    h, kv = runner.forward(loop.params, tokens, view, kv)  # [B, T, D]
    seen = [window]  # the penalty window each position sees: the input token's, + drafts
    for t in range(K):
        seen.append(ring_put(seen[-1], s.pos + 1 + t, drafts[:, t, None], live.astype(I32)))
    windows = jnp.stack(seen, axis=1)  # [B, T, W]
    positions = s.pos[:, None] + 1 + jnp.arange(K + 1)[None]  # [B, T] of the tokens predicted
    logits = runner.head(loop.params, h)  # [B, T, V]
    new, n = accept(logits, windows, sampling, positions, drafts, count)
    return new, n, h, kv, windows, logprobs(logits, new, sampling)


def keep_snapshots(loop: Loop, pools, kv, draft_kv, s: DecodeState, n, T: int):
    """The states at page ends among the tokens a step kept (positions s.pos .. s.pos + n of
    each live row, of the step's T) into their snapshots: the model's linear layers' (kept
    per token in kv) and a draft model's (kept in draft_kv). pools: (the model's, the
    draft's) linear pools -> pools."""
    setup = loop.setup
    page = setup.kv_config.page_size
    model_pools, draft_pools = pools
    for q in range(-(-T // page)):  # the page ends T tokens can hold
        t = page - 1 - s.pos % page + q * page  # [B] the q-th at or after pos
        ids = page_end_ids(setup, loop.snaps, s.pos + t, ~s.done & (t <= n))
        t = jnp.clip(t, 0, T - 1)
        model_pools = put_states(setup, model_pools, kv, ids, t, snapshot=True)
        if setup.draft:
            draft_pools = put_states(setup, draft_pools, draft_kv, ids, t, "draft", True)
    return model_pools, draft_pools


class Carry(NamedTuple):
    """What changes from step to step of the verify loop."""

    made: jax.Array  # [B] tokens each row made this call
    kv: Any  # the model's caches (per-token linear states for the call)
    draft_kv: Any  # the proposer's (a draft model's or the MTP head's)
    pools: tuple  # with snapshots, the linear pools they are written into
    s: DecodeState
    out: tuple  # the call's tokens [B, decode_chunk + K] and their Logprobs
    pick: jax.Array  # [B] the linear states' index of each row's last kept token
    counts: jax.Array  # [B, 4] per row: drafts scored, drafts accepted, steps, verify steps
    drafts: jax.Array  # [B, K] the coming step's
    n_drafts: jax.Array  # [B] real drafts among them
    matches: jax.Array  # [B, H] n-gram suffix matches (`extend`); H = 0 for other methods
    guess: jax.Array  # [B] the lookup's first proposed token, drafted or not (-1: none)


def step(loop: Loop, carry: Carry, speculating: bool) -> Carry:
    """One step of the verify loop: score the drafts (or, with none anywhere, the plain
    one-token forward), keep what is accepted, back off, propose the next drafts."""
    made, kv, draft_kv, pools, s, out, pick, counts, drafts, count, matches, guess = carry
    setup, sampling = loop.setup, loop.sampling
    B = s.tokens.shape[0]
    rows = jnp.arange(B)
    window = ring_put(s.window, s.pos, s.tokens[:, None], jnp.ones_like(s.pos))
    live = ~s.done
    if speculating:
        with jax.named_scope("verify"):
            new, n, h, kv, windows, lp = score_drafts(loop, s, kv, window, drafts, count, pick)
        window = windows[rows, n]
    else:  # the plain decode step
        view = KVView(loop.table, s.pos, live.astype(I32), None, pick, jnp.int32(0))
        h, kv = setup.runner.forward(loop.params, s.tokens[:, None], view, kv)  # [B, 1, D]
        logits = setup.runner.head(loop.params, h[:, 0])  # [B, V]
        new = sample(logits, window, sampling, s.pos + 1)
        lp = jax.tree.map(lambda x: x[:, None], logprobs(logits, new, sampling))
        new, n = new[:, None], jnp.zeros((B,), I32)
    made, out, s_new, n = advance(s, made, out, new, n, sampling.stops, window, s.history, lp)
    if s.history.shape[1]:  # the kept tokens join the n-gram history
        matches, history = extend(matches, s.history, s.pos, new, s_new.pos - s.pos)
        s_new = s_new.replace(history=history)
    if loop.snaps is not None:
        pools = keep_snapshots(loop, pools, kv, draft_kv, s, n, h.shape[1])
    counts = counts + jnp.stack([count, n, live, count > 0], axis=1).astype(I32)
    if setup.spec.method == "ngram":
        s_new = s_new.replace(backoff=trust(s.backoff, guess, count, new[:, 0], n))
    else:
        s_new = s_new.replace(backoff=backoff(s.backoff, count, n))
    catch = (h, new, s.pos, jnp.where(live, n + 1, 0))  # the rows kept now
    drafts, count, draft_kv, guess = next_drafts(loop, s_new, n, draft_kv, catch, matches)
    return Carry(made, kv, draft_kv, pools, s_new, out, n, counts, drafts, count, matches, guess)


def verify(
    setup: Setup, params, kv, state: DecodeState, table, sampling: SamplingRows, steps, snaps=None
):
    """Speculative decode: while every live row has made fewer than `steps` tokens, each
    row proposes up to K drafts, one forward scores its input token and the drafts
    (T = K + 1 tokens), and the accepted prefix plus one token of the model's own is
    kept. -> kv, state, out [B, decode_chunk + K] (-1 where no token), their Logprobs,
    counts [B, 4] (per row: drafts scored, drafts accepted, steps, verify steps). Steps where
    no row has a draft run the plain one-token forward. With snapshots (snaps [B, NB]), the
    states at page ends the rows keep go to their pages' snapshots."""
    K = setup.spec.k
    T = K + 1
    params, kv, draft_params, draft_kv = setup.split(params, kv)
    loop = Loop(setup, params, draft_params, table, sampling, snaps)
    B = state.tokens.shape[0]
    pools, draft_pools = kv, draft_kv
    carried: tuple = ()  # with snapshots, the linear pools they are written into
    if snaps is not None:
        carried = (linear_pools(setup, kv), linear_pools(setup, draft_kv, "draft"))
    # The draft keeps one more state: index T, its state before the pending input token.
    kv = take_states(setup, kv, state.state_index, T)
    draft_kv = take_states(setup, draft_kv, state.state_index, T + 1, "draft")

    def more(c: Carry):
        return jnp.any(~c.s.done) & (jnp.max(jnp.where(c.s.done, 0, c.made)) < steps)

    def drafted(c: Carry):
        return jnp.any(c.n_drafts > 0)

    def phases(carry: Carry) -> Carry:
        """Plain steps while no row has a draft, then verify steps while some row has.
        (Two loops, not a cond: XLA CPU copies every KV pool into a cond's branches.)"""
        plain = jax.lax.while_loop(
            lambda c: more(c) & ~drafted(c), lambda c: step(loop, c, False), carry
        )
        return jax.lax.while_loop(
            lambda c: more(c) & drafted(c), lambda c: step(loop, c, True), plain
        )

    width = setup.decode_chunk + K
    out = (jnp.full((B, width), -1, I32), Logprobs.empty((B, width), setup.vocab))
    pick = jnp.zeros((B,), I32)
    catch = None
    if setup.runner.mtp:  # the row of the input token's predecessor, from its state index
        (hidden,) = gdn.take(draft_kv[1], state.state_index)
        live = (~state.done).astype(I32)
        catch = (hidden[:, None], state.tokens[:, None], state.pos - 1, live)
    # From here on the history holds each row's input token; the lookup's matches are kept
    # up to date token by token (`extend`).
    state = state.replace(history=with_input(state))
    matches = suffix_matches(state.history, state.pos) if state.history.shape[1] else state.history
    drafts, count, draft_kv, guess = next_drafts(loop, state, pick, draft_kv, catch, matches)
    init = Carry(jnp.zeros((B,), I32), kv, draft_kv, carried, state, out, pick,
                 jnp.zeros((B, 4), I32), drafts, count, matches, guess)  # fmt: skip
    end = jax.lax.while_loop(more, phases, init)
    kv, draft_kv, state, pick = end.kv, end.draft_kv, end.s, end.pick
    if snaps is not None:
        pools, draft_pools = end.pools
    kv = put_states(setup, pools, kv, state.state_index, pick)
    # The draft's state before the pending input token (index T): the next call feeds it.
    draft_kv = put_states(
        setup, draft_pools, draft_kv, state.state_index, jnp.full_like(pick, T), "draft"
    )
    return kv + draft_kv, state, *end.out, end.counts
