"""The compiled programs: pure functions of arrays, and the registry that describes them.

  cache()                                            -> kv                 zeroed page pools
  prefill(params, kv, chunk, window, sampling)       -> kv, tokens [B]     one prompt chunk per row
  decode(params, kv, state, table, sampling, steps)  -> kv, state, out [B, C]
  verify(params, kv, state, table, sampling, steps)  -> kv, state, out [B, C + K], counts [3]
  score(params, kv, chunk)                           -> kv, logits [B, T, V]

The page pools and linear-layer states `kv` are donated. `decode` runs up to C steps inside
one `while_loop` and leaves early when every row is done, so the host only wakes to stream
and check stops. No program depends on the context length: rows reach their pages through
block tables. Each program's per-call inputs are typed structs, described once here for both
warmup and serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..model import gdn
from ..model.gdn import RecurrentState
from ..model.kvcache import KVConfig, KVView
from ..ops.sampling import PENALTY_WINDOW, SamplingRows, accept, argmax, sample
from ..parallel.placement import Runner
from . import speculative
from .speculative import SpecConfig

I32 = np.int32
BACKOFF_LOG2 = 4  # a row that keeps missing drafts tries again every 2**4 = 16 steps


def _spec(*shape, dtype=I32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


@struct.dataclass
class Chunk:
    """A prompt chunk of B rows: tokens at positions view.start + t, the first view.length real."""

    tokens: jax.Array  # [B, T] int32, padding 0
    view: KVView
    next: jax.Array  # [B] int32 the prompt token after the chunk (-1: the prompt ends in it)

    @staticmethod
    def abstract(B: int, T: int, NB: int) -> Chunk:
        return Chunk(_spec(B, T), KVView(_spec(B, NB), _spec(B), _spec(B), _spec(B)), _spec(B))


@struct.dataclass
class DecodeState:
    """The decode loop's carry: what each row feeds next and how far it may go."""

    tokens: jax.Array  # [B] int32, the next input token
    pos: jax.Array  # [B] int32, its position
    budget: jax.Array  # [B] int32, tokens still allowed
    done: jax.Array  # [B] bool, padding rows start done
    window: jax.Array  # [B, W] int32, recent tokens by position mod W (-1 = empty)
    slot: jax.Array  # [B] int32, the row's state slot (linear layers; 0 = padding)
    history: jax.Array  # [B, H] int32, tokens by position mod H for n-gram lookup (H may be 0)
    # [B, 2] int32 speculation back-off: verify steps in a row that kept no draft, and steps
    # left without drafting (each miss doubles the wait, up to 2 ** BACKOFF_LOG2 - 1)
    backoff: jax.Array

    @staticmethod
    def abstract(B: int, history: int = 0) -> DecodeState:
        return DecodeState(
            _spec(B),
            _spec(B),
            _spec(B),
            _spec(B, dtype=np.bool_),
            _spec(B, PENALTY_WINDOW),
            _spec(B),
            _spec(B, history),
            _spec(B, 2),
        )


@dataclass(frozen=True)
class Program:
    fn: Callable  # the pure function
    inputs: Callable[[int, int, int], tuple]  # (B, T, NB) -> abstract per-call inputs
    outputs: tuple[str, ...]  # per output: "kv" (the pools' shardings) or "rep" (replicated)
    donate: tuple[str, ...] = ("kv",)  # argument names donated to the call


def programs(
    runner: Runner,
    kv_config: KVConfig,
    tokens_per_call: int,
    spec: SpecConfig | None = None,
    draft: Runner | None = None,
) -> dict[str, Program]:
    """The programs of one model on one mesh; `tokens_per_call` = C, most decode steps a call.
    With a draft model, `params` is (the model's, the draft's) and `kv` lists the model's
    layers then the draft's (one page pool, one set of slots)."""
    n_model = len(runner.caches)
    # What proposes drafts keeps its caches after the model's: a draft model's layers, or the
    # MTP head's (its attention pools, then the per-slot hidden state).
    caches = runner.caches + (draft.caches if draft else runner.mtp_caches)
    linear = [isinstance(c, RecurrentState) for c in caches]
    flags = {"model": linear[:n_model], "draft": linear[n_model:]}
    axis = runner.state_axis

    def split(params, kv):
        """(model params, model kv, draft params, the proposer's kv)."""
        if draft is None:
            return params, kv[:n_model], None, kv[n_model:]
        return params[0], kv[:n_model], params[1], kv[n_model:]

    def cache():
        extra = draft.init_kv(kv_config) if draft else [c.init(kv_config) for c in caches[n_model:]]
        return runner.init_kv(kv_config) + extra

    def mtp_rows(params, mtp_kv, hidden, tokens, view: KVView):
        """The MTP head over rows view.start + t (hidden [B, T, D] the model's at those
        positions, tokens [B, T] the tokens after them) -> its outputs [B, T, D], its kv."""
        g, pools = runner.mtp(params, jnp.maximum(tokens, 0), hidden, view, mtp_kv[0])
        return g, [pools, *mtp_kv[1:]]

    def prefill(params, kv, chunk: Chunk, window, sampling: SamplingRows):
        """window [B, W] of the whole prompt; samples after each row's last real token."""
        params, kv, draft_params, draft_kv = split(params, kv)
        B, T = chunk.tokens.shape
        h, kv = runner.forward(params, chunk.tokens, chunk.view, kv)  # [B, T, D]
        if draft:
            _, draft_kv = draft.forward(draft_params, chunk.tokens, chunk.view, draft_kv)
        last = jnp.clip(chunk.view.length - 1, 0, T - 1)  # [B]
        if runner.mtp:  # rows p pair h_p with token p + 1: the chunk's next, or the prompt's
            following = jnp.concatenate([chunk.tokens[:, 1:], chunk.tokens[:, :1]], axis=1)
            at_last = jnp.arange(T)[None] == last[:, None]
            following = jnp.where(at_last, chunk.next[:, None], following)
            rows = chunk.view.length - (chunk.next < 0)  # the prompt's last row waits
            view = KVView(chunk.view.table, chunk.view.start, rows, None)
            _, draft_kv = mtp_rows(params, draft_kv, h, following, view)
            hidden = (h[jnp.arange(B), last],)  # the model's state of the last prompt token
            draft_kv[1] = gdn.put(draft_kv[1], hidden, chunk.view.slot)
        logits = runner.head(params, h[jnp.arange(B), last])  # [B, V]
        return kv + draft_kv, sample(logits, window, sampling, chunk.view.start + chunk.view.length)

    def take_states(kv, slot, keep: int = 0, of: str = "model"):
        """Linear layers' states out of their slots for a loop: [B, ...] per row, or with
        `keep` = T, T copies [B, T, ...] (speculation keeps every token's state)."""

        def one(c, lin):
            if not lin:
                return c
            states = gdn.take(c, slot, axis)
            if keep:
                states = tuple(jnp.repeat(jnp.expand_dims(s, axis + 1), keep, axis + 1)
                               for s in states)  # fmt: skip
            return states

        return [one(c, lin) for c, lin in zip(kv, flags[of], strict=True)]

    def put_states(pools, kv, slot, pick=None, of: str = "model"):
        def one(p, c, lin):
            if not lin:
                return c
            if pick is not None:  # the accepted token's state
                c = tuple(gdn.select(a, pick, axis) for a in c)
            return gdn.put(p, c, slot, axis)

        return [one(p, c, lin) for p, c, lin in zip(pools, kv, flags[of], strict=True)]

    def decode(params, kv, state: DecodeState, table, sampling: SamplingRows, steps):
        """Up to `steps` (<= C) tokens per row; table [B, NB] covers every position written.
        Linear layers' states leave their slots for the loop and return after it."""
        params, kv, draft_params, draft_kv = split(params, kv)
        B = state.tokens.shape[0]
        rows = jnp.arange(B)
        pools = kv
        kv = take_states(kv, state.slot)

        def step(carry):
            i, kv, s, out = carry
            # The input token joins the penalty context of the token it predicts.
            window = s.window.at[rows, s.pos % PENALTY_WINDOW].set(s.tokens)
            live = ~s.done
            # Done rows write the null page and leave their linear state as it is.
            view = KVView(table, s.pos, live.astype(I32), None)
            h, kv = runner.forward(params, s.tokens[:, None], view, kv)  # [B, 1, D]
            new = sample(runner.head(params, h[:, 0]), window, sampling, s.pos + 1)  # [B]
            stop = jnp.any(new[:, None] == sampling.stops, axis=-1)
            budget = s.budget - live
            out = out.at[:, i].set(jnp.where(live, new, -1))
            s = s.replace(
                tokens=jnp.where(live, new, s.tokens),
                pos=s.pos + live,
                budget=budget,
                done=s.done | stop | (budget <= 0),
                window=window,
            )
            return i + 1, kv, s, out

        def more(carry):
            i, _, s, _ = carry
            return (i < steps) & ~jnp.all(s.done)

        out = jnp.full((B, tokens_per_call), -1, I32)
        _, kv, state, out = jax.lax.while_loop(more, step, (jnp.int32(0), kv, state, out))
        return put_states(pools, kv, state.slot) + draft_kv, state, out

    def verify(params, kv, state: DecodeState, table, sampling: SamplingRows, steps):
        """Speculative decode: while every live row has made fewer than `steps` tokens, each
        row proposes up to K drafts, one forward scores its input token and the drafts
        (T = K + 1 tokens), and the accepted prefix plus one token of the model's own is
        kept. -> kv, state, out [B, C + K] (-1 where no token), counts [3] (drafts scored,
        drafts accepted, row steps). Steps where no row has a draft run the plain one-token
        forward."""
        K = spec.k
        T = K + 1
        params, kv, draft_params, draft_kv = split(params, kv)
        B = state.tokens.shape[0]
        rows = jnp.arange(B)
        at = jnp.arange(T)[None]  # [1, T]
        pools, draft_pools = kv, draft_kv
        # The draft keeps one more state: index T, its state before the pending input token.
        kv, draft_kv = (
            take_states(kv, state.slot, T),
            take_states(draft_kv, state.slot, T + 1, "draft"),
        )
        zero = jnp.int32(0)

        def propose(s: DecodeState, history, live, pick, draft_kv, catch):
            """drafts [B, K], count [B], the proposer's kv. `catch`: the model's hidden
            states [B, t, D] of the tokens kept since the last proposal and the tokens after
            them [B, t] (the MTP head reads them), their first position and count."""
            if spec.method == "ngram":
                drafts, count = speculative.ngram(history, s.pos, K)
                return drafts, count, draft_kv
            if spec.method == "mtp":
                return mtp_drafts(live, draft_kv, *catch)

            def one(t, carry):  # the draft's greedy step t: input x_t at pos + t
                token, drafts, draft_kv = carry
                view = KVView(
                    table, s.pos + t, live.astype(I32), None, jnp.where(t == 0, T, t - 1), t
                )
                h, draft_kv = draft.forward(draft_params, token[:, None], view, draft_kv)
                logits = draft.head(draft_params, h[:, 0])[:, : spec.vocab or None]
                new = argmax(logits)
                # (step K only feeds the draft's cache its last draft: nothing is written)
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
                for c, lin in zip(draft_kv, flags["draft"], strict=True)
            ]  # fmt: skip
            # While every row backs off, the draft only reads the input token.
            steps = jnp.where(jnp.any(live & (s.backoff[:, 1] == 0)), T, 1)
            with jax.named_scope("draft"):
                _, drafts, draft_kv = jax.lax.fori_loop(0, steps, one, (s.tokens, drafts, draft_kv))
            return drafts, jnp.full((B,), K, I32), draft_kv

        def advance(s: DecodeState, made, out, new, n, window, history, live):
            """Keep tokens new[:, :n + 1] ([B, t] candidates) of each live row, up to a stop
            token -> made, out, state, n (the row's accepted drafts)."""
            at = jnp.arange(new.shape[1])[None]
            stop = jnp.any(new[..., None] == sampling.stops[:, None], axis=-1) & (at <= n[:, None])
            hit = jnp.any(stop, axis=1)
            n = jnp.where(live, jnp.where(hit, jnp.minimum(n, jnp.argmax(stop, axis=1)), n), 0)
            made_now = jnp.where(live, n + 1, 0)
            kept = (at <= n[:, None]) & live[:, None]
            out = out.at[rows[:, None], made[:, None] + at].set(
                jnp.where(kept, new, -1), mode="drop"
            )
            budget = s.budget - made_now
            s = s.replace(
                tokens=jnp.where(live, new[rows, n], s.tokens),
                pos=s.pos + made_now,
                budget=budget,
                done=s.done | (live & hit) | (budget <= 0),
                window=window,
                history=history,
            )
            return made + made_now, out, s, n

        def mtp_drafts(live, mtp_kv, hidden, tokens, start, length):
            """The MTP head reads the kept rows (their hidden states and next tokens), drafts
            from the last one, then chains K - 1 steps on its own output."""
            with jax.named_scope("draft"):
                view = KVView(table, start, length, None)
                g, mtp_kv = mtp_rows(params, mtp_kv, hidden, tokens, view)  # [B, t, D]
                last = jnp.clip(length - 1, 0, tokens.shape[1] - 1)
                # The model's state of the last kept token: the next call starts from it.
                mtp_kv[1] = gdn.put(mtp_kv[1], (hidden[rows, last],), state.slot)
                g = g[rows, last]  # [B, D]
                first = argmax(runner.head(params, g))
                drafts = jnp.where(jnp.arange(K)[None] == 0, first[:, None], 0)

                def chain(k, carry):  # row start + length - 1 + k: (its own output, draft k)
                    g, token, drafts, mtp_kv = carry
                    view = KVView(table, start + length - 1 + k, live.astype(I32), None)
                    g, mtp_kv = mtp_rows(params, mtp_kv, g[:, None], token[:, None], view)
                    g = g[:, 0]
                    token = argmax(runner.head(params, g))
                    drafts = jnp.where(jnp.arange(K)[None] == k, token[:, None], drafts)
                    return g, token, drafts, mtp_kv

                _, _, drafts, mtp_kv = jax.lax.fori_loop(1, K, chain, (g, first, drafts, mtp_kv))
            return drafts, jnp.full((B,), K, I32), mtp_kv

        def backoff(state, count, n):
            """A row whose verified drafts were all refused waits 1, 3, 7, 15 ... steps before
            drafting again (speculation that never pays costs little); a kept draft resets."""
            miss, wait = state[:, 0], state[:, 1]
            verified = count > 0
            miss = jnp.where(verified, jnp.where(n > 0, 0, miss + 1), miss)
            wait = jnp.where(
                verified, (1 << jnp.minimum(miss, BACKOFF_LOG2)) - 1, jnp.maximum(wait - 1, 0)
            )
            return jnp.stack([miss, wait], axis=1)

        def with_input(s: DecodeState):
            """The history with the row's input token (n-gram lookup)."""
            H = s.history.shape[1]
            return s.history.at[rows, s.pos % H].set(s.tokens) if H else s.history

        def next_drafts(s: DecodeState, pick, draft_kv, catch):
            """The coming step's drafts [B, K] and count [B] (0 for done rows, and never past
            a row's budget), and the proposer's kv."""
            live = ~s.done
            drafts, count, draft_kv = propose(s, with_input(s), live, pick, draft_kv, catch)
            count = jnp.where(s.backoff[:, 1] > 0, 0, count)
            return drafts, jnp.where(live, jnp.minimum(count, s.budget - 1), 0), draft_kv

        def step(carry, speculating: bool):
            made, kv, draft_kv, s, out, pick, counts, drafts, count = carry
            window = s.window.at[rows, s.pos % PENALTY_WINDOW].set(s.tokens)
            history = with_input(s)
            H = history.shape[1]
            live = ~s.done
            if speculating:
                with jax.named_scope("verify"):
                    tokens = jnp.concatenate([s.tokens[:, None], drafts], axis=1)  # [B, T]
                    view = KVView(table, s.pos, jnp.where(live, 1 + count, 0), None, pick, zero)
                    h, kv = runner.forward(params, tokens, view, kv)  # [B, T, D]
                    # The penalty window each position sees: the input token's, plus drafts.
                    windows = [window]
                    for t in range(K):
                        at_t = (s.pos + 1 + t) % PENALTY_WINDOW
                        windows.append(windows[-1].at[rows, at_t].set(drafts[:, t]))
                    windows = jnp.stack(windows, axis=1)  # [B, T, W]
                    positions = s.pos[:, None] + 1 + at  # [B, T] of the tokens predicted
                    logits = runner.head(params, h)  # [B, T, V]
                    new, n = accept(logits, windows, sampling, positions, drafts, count)
                if H:  # accepted drafts join the history
                    follow = (s.pos[:, None] + 1 + at[:, :K]) % H  # [B, K]
                    old = jnp.take_along_axis(history, follow, axis=1)
                    history = history.at[rows[:, None], follow].set(
                        jnp.where(at[:, :K] < n[:, None], drafts, old)
                    )
                made, out, s_new, n = advance(s, made, out, new, n, windows[rows, n], history, live)
            else:  # the plain decode step
                view = KVView(table, s.pos, live.astype(I32), None, pick, zero)
                h, kv = runner.forward(params, s.tokens[:, None], view, kv)  # [B, 1, D]
                new = sample(runner.head(params, h[:, 0]), window, sampling, s.pos + 1)
                n = jnp.zeros((B,), I32)
                new = new[:, None]
                made, out, s_new, n = advance(s, made, out, new, n, window, history, live)
            counts = counts + jnp.stack([count.sum(), n.sum(), live.sum()])
            s_new = s_new.replace(backoff=backoff(s.backoff, count, n))
            catch = (h, new, s.pos, jnp.where(live, n + 1, 0))  # the rows kept now
            drafts, count, draft_kv = next_drafts(s_new, n, draft_kv, catch)
            s = s_new
            return made, kv, draft_kv, s, out, n, counts, drafts, count

        def more(carry):
            made, _, _, s, *_ = carry
            return jnp.any(~s.done) & (jnp.max(jnp.where(s.done, 0, made)) < steps)

        def drafted(carry):
            return jnp.any(carry[-1] > 0)

        def phases(carry):
            """Plain steps while no row has a draft, then verify steps while some row has.
            (Two loops, not a cond: XLA CPU copies every KV pool into a cond's branches.)"""
            carry = jax.lax.while_loop(
                lambda c: more(c) & ~drafted(c), partial(step, speculating=False), carry
            )
            return jax.lax.while_loop(
                lambda c: more(c) & drafted(c), partial(step, speculating=True), carry
            )

        out = jnp.full((B, tokens_per_call + K), -1, I32)
        pick = jnp.zeros((B,), I32)
        catch = None
        if runner.mtp:  # the row of the input token's predecessor, from its slot
            (hidden,) = gdn.take(draft_kv[1], state.slot)
            live = (~state.done).astype(I32)
            catch = (hidden[:, None], state.tokens[:, None], state.pos - 1, live)
        drafts, count, draft_kv = next_drafts(state, pick, draft_kv, catch)
        init = (jnp.zeros((B,), I32), kv, draft_kv, state, out, pick, jnp.zeros((3,), I32),
                drafts, count)  # fmt: skip
        _, kv, draft_kv, state, out, pick, counts, *_ = jax.lax.while_loop(more, phases, init)
        kv = put_states(pools, kv, state.slot, pick)
        # The draft's state before the pending input token (index T): the next call feeds it.
        draft_kv = put_states(draft_pools, draft_kv, state.slot, jnp.full_like(pick, T), "draft")
        return kv + draft_kv, state, out, counts

    def score(params, kv, chunk: Chunk):
        params, kv, _, draft_kv = split(params, kv)
        h, kv = runner.forward(params, chunk.tokens, chunk.view, kv)
        return kv + draft_kv, runner.head(params, h)  # [B, T, V]

    def loop_inputs(B: int, T: int, NB: int) -> tuple:
        history = spec.history if spec else 0
        return DecodeState.abstract(B, history), _spec(B, NB), SamplingRows.abstract(B), _spec()

    return {
        "cache": Program(cache, lambda B, T, NB: (), ("kv",), donate=()),
        "prefill": Program(
            prefill,
            lambda B, T, NB: (
                Chunk.abstract(B, T, NB),
                _spec(B, PENALTY_WINDOW),
                SamplingRows.abstract(B),
            ),
            ("kv", "rep"),
        ),
        "decode": Program(decode, loop_inputs, ("kv", "rep", "rep")),
        "verify": Program(verify, loop_inputs, ("kv", "rep", "rep", "rep")),
        "score": Program(score, lambda B, T, NB: (Chunk.abstract(B, T, NB),), ("kv", "rep")),
    }
