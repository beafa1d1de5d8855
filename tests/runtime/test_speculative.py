"""Speculative decoding: greedy output equal to the references (HF's greedy ids, the published
stories260K ids) with n-gram lookup and draft models, on every architecture, with slots and
under layouts; the rejection rule's distribution against plain sampling (chi-square); the
n-gram lookup against a brute-force search; compiles in a storm of requests; bad input."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from scipy.stats import chi2_contingency
from support.compiles import CompileCounter
from support.lookup import NGRAM_MAX, NGRAM_MIN, ngram_reference
from support.models import GOLDEN, model_path

import jaxinfer
from jaxinfer.cli import main
from jaxinfer.errors import JaxinferError, RequestError, UnsupportedModelError
from jaxinfer.model.kvcache import KVView
from jaxinfer.ops.sampling import Logprobs, recent_window
from jaxinfer.runtime import speculative
from jaxinfer.runtime.drafting import StepCosts
from jaxinfer.runtime.inputs import DecodeState

STORIES = "stories260K-gguf/stories260K.gguf"
FIXTURES = {
    "mixtral": "tiny-random/mixtral_e8k2",
    "qwen3_moe": "tiny-random/qwen3_moe_e8k2_bpe",
    "qwen3_next": "tiny-random/qwen3_next_l3f1_e8k2_mtp",
    "qwen3_5": "tiny-random/qwen3_5_l3f1_dense_mtp",
    "qwen3_5_moe": "tiny-random/qwen3_5_moe_l3f1_e8k2_mtp",
}
SMALL = dict(max_seq_len=512, prefill_buckets=(32, 128), batch_buckets=(1,))


def _reference(kind: str):
    root = model_path(FIXTURES[kind])
    return root, json.loads((root / "reference.json").read_text())["prompts"]


def _greedy(engine, ids, n=32):
    return engine.generate(ids, max_new_tokens=n, temperature=0, ignore_eos=True).token_ids


def perturbed(root, dest, noise=0.05, seed=0):
    """A draft that agrees with the model often but not always: the same checkpoint with
    noise added to two layers' weights (so drafts are accepted in part, and linear states
    are rolled back to every position)."""
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns("*.gguf"))
    weights = load_file(dest / "model.safetensors")
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if "layers.1." in name or "layers.3." in name:
            weights[name] = (w + noise * w.std() * rng.standard_normal(w.shape)).astype(w.dtype)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


# ---- the loop's pieces, alone ----------------------------------------------------------


def test_backoff_doubles_the_wait_after_each_refused_step_and_resets_on_a_kept_draft():
    """Written from the rule itself: after m refused verify steps in a row a row waits
    2**min(m, BACKOFF_LOG2) - 1 steps; an accepted draft clears it; a step without drafts
    counts the wait down."""
    cap = (1 << speculative.BACKOFF_LOG2) - 1
    state = jnp.zeros((1, 2), jnp.int32)
    waits = []
    for _ in range(6):  # six refused steps in a row
        state = speculative.backoff(state, jnp.array([3]), jnp.array([0]))
        waits.append(int(state[0, 1]))
    assert waits == [1, 3, 7, 15, cap, cap]
    state = speculative.backoff(state, jnp.array([0]), jnp.array([0]))  # no drafts: waits
    assert state.tolist() == [[6, cap - 1]]
    state = speculative.backoff(state, jnp.array([2]), jnp.array([1]))  # one kept: reset
    assert state.tolist() == [[0, 0]]


def test_advance_keeps_the_accepted_prefix_up_to_a_stop_token_and_the_budget():
    """Three rows: one keeps its 2 accepted drafts and the model's token, one stops at a
    stop token inside its drafts, one is done and keeps nothing; expectations by hand."""
    B, C = 3, 8
    s = DecodeState(
        tokens=jnp.array([5, 6, 7]),
        pos=jnp.array([10, 20, 30]),
        budget=jnp.array([10, 10, 10]),
        done=jnp.array([False, False, True]),
        window=jnp.zeros((B, 4), jnp.int32),
        state_index=jnp.zeros(B, jnp.int32),
        history=jnp.zeros((B, 0), jnp.int32),
        backoff=jnp.zeros((B, 2), jnp.int32),
    )
    new = jnp.array([[11, 12, 13, 14], [21, 99, 23, 24], [31, 32, 33, 34]])
    n = jnp.array([2, 3, 3])  # accepted drafts: row 1's stop token 99 is its second token
    stops = jnp.array([[99, -1], [99, -1], [99, -1]])
    # each candidate's logprob rides along: here its own id, to see where it lands
    lp = Logprobs(new.astype(jnp.float32), new[..., None], new[..., None].astype(jnp.float32))
    out = (jnp.full((B, C), -1), Logprobs.empty((B, C), 1))
    made, (out, out_lp), s2, n2 = speculative.advance(
        s, jnp.array([1, 0, 0]), out, new, n, stops, s.window, s.history, lp
    )
    assert made.tolist() == [4, 2, 0] and n2.tolist() == [2, 1, 0]
    assert out[0].tolist() == [-1, 11, 12, 13, -1, -1, -1, -1]  # after its earlier token
    assert out[1].tolist() == [21, 99, -1, -1, -1, -1, -1, -1]
    assert out[2].tolist() == [-1] * C
    for lp_out in (out_lp.token, out_lp.ids[..., 0], out_lp.values[..., 0]):
        assert np.array_equal(np.where(out >= 0, lp_out, -1), out)
    assert s2.tokens.tolist() == [13, 99, 7] and s2.pos.tolist() == [13, 22, 30]
    assert s2.budget.tolist() == [7, 8, 10] and s2.done.tolist() == [False, True, True]


# ---- the lookup against a brute-force search ----------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_ngram_lookup_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    K, H = 4, 256
    rows = []
    for _ in range(8):
        n = int(rng.integers(3, 200))
        vocab = int(rng.integers(3, 12))  # small vocabularies: many matches of every length
        context = [int(t) for t in rng.integers(0, vocab, n)]
        if rng.random() < 0.5:  # a planted copy
            at = int(rng.integers(0, n))
            context += context[at : at + int(rng.integers(1, 12))]
        rows.append(context)
    history = np.stack([recent_window(c, H) for c in rows])
    pos = np.array([len(c) - 1 for c in rows], np.int32)
    assert (speculative.NGRAM_MIN, speculative.NGRAM_MAX) == (NGRAM_MIN, NGRAM_MAX)
    drafts, count = speculative.ngram(jnp.asarray(history), jnp.asarray(pos), K)
    for b, context in enumerate(rows):
        want = ngram_reference(context, K)
        assert int(count[b]) == len(want), (b, context)
        assert [int(t) for t in drafts[b, : len(want)]] == want


@pytest.mark.parametrize("seed", range(3))
def test_ngram_matches_kept_token_by_token(seed):
    """The decode loop looks up from matches it extends as rows keep tokens (1 to K + 1 a
    step, rows apart), in a history that wraps: each lookup equals the brute-force search."""
    rng = np.random.default_rng(seed)
    K, H, B = 4, 32, 3
    contexts = [[int(t) for t in rng.integers(0, 4, int(rng.integers(2, 20)))] for _ in range(B)]
    history = jnp.asarray(np.stack([recent_window(c, H) for c in contexts]))
    pos = jnp.asarray([len(c) - 1 for c in contexts], jnp.int32)
    matches = speculative.suffix_matches(history, pos)
    for _ in range(40):  # every context outgrows the history
        new = rng.integers(0, 4, (B, K + 1)).astype(np.int32)
        kept = rng.integers(0, K + 2, B).astype(np.int32)  # 0: a row that is done
        matches, history = speculative.extend(
            matches, history, pos, jnp.asarray(new), jnp.asarray(kept)
        )
        pos = pos + kept
        drafts, count = speculative.propose(matches, history, pos, K)
        for b in range(B):
            contexts[b] += [int(t) for t in new[b, : kept[b]]]
            want = ngram_reference(contexts[b], K, held=H)
            assert int(count[b]) == len(want), (b, contexts[b])
            assert [int(t) for t in drafts[b, : len(want)]] == want


# ---- greedy output equals the references ----------------------------------------------


@pytest.fixture(scope="module")
def stories_ngram():
    # Calls of 16 tokens: the first is plain (BOS repeats nothing), the next ones draft.
    return jaxinfer.load(model_path(STORIES), speculative="ngram", decode_chunk=16, **SMALL)


@pytest.mark.slow  # 19 s here: the default tier's time budget
def test_ngram_greedy_equals_the_published_ids(stories_ngram):
    # Plain calls and verify calls (whose lookups keep proposing words the model does not
    # repeat) make the published ids.
    assert _greedy(stories_ngram, [1], len(GOLDEN)) == GOLDEN
    stats = stories_ngram.perf_stats()
    assert 0 < stats.spec_steps < len(GOLDEN)  # some steps in verify calls, not all
    assert stats.recompiles_same == stats.recompiles_diff == 0


@pytest.mark.slow
def test_ngram_on_a_copy_accepts_most_drafts(engines):
    engine = jaxinfer.load(model_path(STORIES), speculative="ngram", **SMALL)  # its own stats
    plain = engines(model_path(STORIES), **SMALL)
    # A passage, then its first sentence again: the continuation can be looked up.
    passage = _greedy(plain, [1], 96)
    prompt = [1, *passage, 1, *passage[:12]]
    assert _greedy(engine, prompt, 48) == _greedy(plain, prompt, 48)
    stats = engine.perf_stats()
    assert stats.accepted_tokens >= 0.5 * stats.draft_tokens > 0
    assert (stats.spec_steps + stats.accepted_tokens) / stats.spec_steps > 2.0  # tokens per step
    text = str(stats)
    assert "perf:      speculative: ngram, K = 4, drafted = " in text
    assert "tokens per step = " in text


@pytest.mark.slow  # speculation on a hybrid: test_mtp_greedy_equals_hf in the default run
@pytest.mark.parametrize("kind", ["qwen3_5", "mixtral"])  # Qwen3-Next: MTP and the draft below
def test_ngram_greedy_equals_hf_on_the_fixtures(kind):
    root, prompts = _reference(kind)
    engine = jaxinfer.load(root, speculative="ngram", draft_tokens=3, **SMALL)
    for p in prompts:
        # The prompt again after its greedy ids: the lookup proposes, the model disagrees
        # or agrees; either way the ids are HF's.
        assert _greedy(engine, p["ids"]) == p["greedy_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe"])
def test_ngram_greedy_equals_hf_on_the_moe_fixtures(kind):
    test_ngram_greedy_equals_hf_on_the_fixtures(kind)


@pytest.mark.slow  # the draft path: the model as its own draft, in the default run
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_moe"])  # Qwen3-Next's rollback: MTP's test
def test_draft_model_greedy_equals_hf(kind, tmp_path):
    """A perturbed copy drafts: some drafts are accepted, some rejected, and for the hybrid
    models every rejection rolls the linear states of the model and the draft back."""
    root, prompts = _reference(kind)
    draft = perturbed(root, tmp_path / "draft")
    engine = jaxinfer.load(root, speculative=str(draft), **SMALL)
    for p in prompts:
        assert _greedy(engine, p["ids"]) == p["greedy_ids"]
    stats = engine.perf_stats()
    assert 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.mark.slow
def test_the_model_as_its_own_draft_accepts_everything():
    path = model_path(STORIES)
    engine = jaxinfer.load(path, speculative=str(path), draft_tokens=5, **SMALL)
    assert _greedy(engine, [1], len(GOLDEN)) == GOLDEN
    stats = engine.perf_stats()
    # Every draft is accepted but those past the budget (the last step drafts fewer).
    assert stats.accepted_tokens == stats.draft_tokens > 0
    assert "speculative: draft, K = 5" in str(stats)


def _slots_keep_hf_greedy(draft, layout, devices):
    """Each slot speculates on its own in the N-row program: rows accept different numbers
    of drafts; under `layer` the model and the draft are split into 2 stages."""
    root, prompts = _reference("qwen3_5")
    engine = jaxinfer.load(
        root, speculative=draft, slots=2, layout=layout, devices=devices,
        max_seq_len=512, prefill_buckets=(32, 128),
    )  # fmt: skip
    requests = [
        engine.submit(p["ids"], max_new_tokens=32, temperature=0, ignore_eos=True) for p in prompts
    ]
    for r, p in zip(requests, prompts, strict=True):
        assert r.result().token_ids == p["greedy_ids"], layout


@pytest.mark.slow
def test_a_draft_with_a_padded_embedding_table_drafts_within_the_vocabulary():
    """Same tokenizer, a larger (padded) table, as Qwen2.5 0.5B drafting for 7B: accepted, and
    its drafts stay below the model's vocab_size."""
    padded = jaxinfer.ModelConfig(
        arch="llama", d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=128,
        vocab_size=600, max_position=512,
    )  # fmt: skip
    engine = jaxinfer.load(model_path(STORIES), speculative=padded, **SMALL)
    assert _greedy(engine, [1], len(GOLDEN)) == GOLDEN
    assert engine.perf_stats().draft_tokens > 0


@pytest.mark.slow
def test_slots_under_the_layer_split_keep_hf_greedy(tmp_path):
    root, _ = _reference("qwen3_5")
    _slots_keep_hf_greedy(str(perturbed(root, tmp_path / "draft")), "layer", 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, devices, how", [("single", None, "draft"), ("tensor", 2, "ngram")]
)
def test_slots_keep_hf_greedy(tmp_path, layout, devices, how):
    root, _ = _reference("qwen3_5")
    draft = str(perturbed(root, tmp_path / "draft")) if how == "draft" else how
    _slots_keep_hf_greedy(draft, layout, devices)


# ---- MTP: the head against transformers' layers, then decoding with it ---------------


def _mtp_rows(engine, ctx):
    """The MTP head's logits [len(ctx) - 1, V] on every row p of ctx (h_p with token p + 1),
    after one forward of the model over ctx, on fresh caches."""
    runner, kvc = engine.runner, engine.kv_config
    T = len(ctx) - 1
    table = jnp.arange(1, kvc.table_width + 1, dtype=jnp.int32)[None]
    one = lambda v: jnp.array([v], jnp.int32)  # noqa: E731

    @jax.jit
    def rows(params, tokens, following):
        kv = runner.init_kv(kvc)
        h, _ = runner.forward(params, tokens, KVView(table, one(0), one(T), one(1)), kv)
        pools = runner.mtp_caches[0].init(kvc)
        g, _ = runner.mtp(params, following, h, KVView(table, one(0), one(T), None), pools)
        return runner.head(params, g[0])

    ctx = jnp.asarray(ctx, jnp.int32)[None]
    return np.asarray(rows(engine.params, ctx[:, :-1], ctx[:, 1:]))


@pytest.mark.parametrize(
    "kind, fmt",
    [
        ("qwen3_5", "hf"),
        pytest.param("qwen3_next", "gguf", marks=pytest.mark.slow),
        pytest.param("qwen3_5", "gguf", marks=pytest.mark.slow),
        pytest.param("qwen3_next", "hf", marks=pytest.mark.slow),
        pytest.param("qwen3_5_moe", "hf", marks=pytest.mark.slow),
        pytest.param("qwen3_5_moe", "gguf", marks=pytest.mark.slow),
    ],
)
def test_mtp_head_matches_the_reference(kind, fmt):
    """Row p's logits (for token p + 2) at the last prompt position against the float64
    reference, and every row's argmax against its drafts (fixtures/README.md: the reference
    runs transformers' decoder-layer classes and matches llama.cpp's MTP graph)."""
    root, prompts = _reference(kind)
    path = root / "model-f32.gguf" if fmt == "gguf" else root
    engine = jaxinfer.load(path, speculative="mtp", **SMALL)
    for p in prompts:
        ctx = p["ids"] + p["greedy_ids"]
        logits = _mtp_rows(engine, ctx)
        last = len(p["ids"]) - 1
        want = np.array(p["mtp"]["logits_row_last_prompt_pos_f64"])
        assert np.abs(logits[last] - want).max() < 5e-4
        assert logits.argmax(-1).tolist() == p["mtp"]["draft_ids_f64"]


@pytest.mark.slow  # the head itself: test_mtp_head_matches_the_reference, in the default run
@pytest.mark.parametrize("kind", ["qwen3_next"])  # Qwen3.5's MTP head: the slots tests below
def test_mtp_greedy_equals_hf(kind):
    root, prompts = _reference(kind)
    engine = jaxinfer.load(root, speculative="mtp", draft_tokens=3, **SMALL)
    for p in prompts:
        assert _greedy(engine, p["ids"]) == p["greedy_ids"]
    stats = engine.perf_stats()
    assert stats.draft_tokens > 0 and "speculative: mtp, K = 3" in str(stats)


@pytest.mark.slow
def test_mtp_with_slots_under_the_layer_split_keeps_hf_greedy():
    _slots_keep_hf_greedy("mtp", "layer", 2)


# ---- sampling keeps the distribution --------------------------------------------------


def _draws(engine, prompt, n, seed0):
    """The first four sampled tokens of n requests with seeds seed0 .. seed0 + n - 1."""
    opts = dict(max_new_tokens=4, temperature=2.0, top_k=5, top_p=1.0, min_p=0.0)
    out = []
    for start in range(0, n, 8):
        requests = [
            engine.submit(prompt, seed=seed0 + i, **opts) for i in range(start, min(n, start + 8))
        ]
        out += [tuple(r.result().token_ids) for r in requests]
    return out


class _Unmeasured(StepCosts):
    """Step costs that take no measurement: a verify step counts as one plain step."""

    def timed(self, seconds: float, steps: int, verifies: int) -> None:
        pass


@pytest.mark.slow  # the rule alone: test_sampling.py, in the default run
def test_rejection_sampling_keeps_the_distribution():
    """Two-sample chi-square, speculative vs plain, on the 2nd to 4th tokens: those are the
    tokens verify steps decide (accepted drafts, draws from the residual, bonus draws). Top-k
    = 5 makes the vocabulary tiny; temperature 2 makes rejections common."""
    path = model_path(STORIES)
    opts = dict(max_seq_len=256, prefill_buckets=(32,), slots=8)
    spec = jaxinfer.load(path, speculative="ngram", **opts)
    # The rows draft by the steps' measured costs (drafting.py): on a loaded machine a verify
    # step can measure dear enough that they hardly draft (CI once drafted 16 tokens here).
    # Unmeasured costs make the choice the lookup's alone; what is tested is the sampling.
    spec._scheduler.costs = _Unmeasured()
    plain = jaxinfer.load(path, **opts)
    plain_ids = plain.tokenize("Once upon a time, there was a little")
    # A repeated phrase: the lookup proposes what followed it the first time.
    prompt = [1, *plain_ids, *plain_ids[:4]]
    n = 2000
    a, b = _draws(spec, prompt, n, 0), _draws(plain, prompt, n, 10**6)
    stats = spec.perf_stats()
    assert stats.draft_tokens - stats.accepted_tokens > 300 and stats.accepted_tokens > 300
    for position in (1, 2, 3):
        cells = sorted({s[position] for s in a + b})
        table = np.array([[sum(s[position] == c for s in x) for c in cells] for x in (a, b)])
        table = table[:, table.sum(0) >= 10]  # chi-square needs populated cells
        assert chi2_contingency(table).pvalue > 1e-3, (position, table)


# ---- compiles: the storm, gone --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ngram", "draft"])
def test_a_storm_of_speculative_requests_compiles_nothing_after_warmup(how):
    """100 requests: repetitive prompts (long accepted runs), random ones (hardly any), cancels;
    n-gram lookup or a draft model (the model itself), in strict mode."""
    path = model_path(STORIES)
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(100):
        if i % 2:
            prompts.append([1, *(int(t) for t in rng.integers(3, 512, int(rng.integers(2, 60))))])
        else:
            phrase = [int(t) for t in rng.integers(3, 512, int(rng.integers(3, 9)))]
            prompts.append([1, *(phrase * int(rng.integers(2, 6)))])
    for spec in ("ngram",) if how == "ngram" else (str(path),):
        engine = jaxinfer.load(
            path, speculative=spec, slots=4, strict=True, max_seq_len=256, prefill_buckets=(16, 64)
        )
        engine.warmup(progress=False)
        with CompileCounter() as counter:
            requests = [
                engine.submit(p, max_new_tokens=int(rng.integers(1, 40)), temperature=0.0 if i % 3
                              else 0.8, seed=i)
                for i, p in enumerate(prompts)
            ]  # fmt: skip
            for i, r in enumerate(requests):
                if i % 7 == 3:
                    r.cancel()
            results = [r.result() for r in requests]
        assert counter.n == 0
        stats = engine.perf_stats()
        assert stats.recompiles_same == stats.recompiles_diff == stats.untracked_compiles == 0
        assert stats.draft_tokens > stats.accepted_tokens > 0
        assert sum(r.finish_reason == "cancelled" for r in results) == len(range(3, 100, 7))


# ---- bad input -------------------------------------------------------------------------


def test_bad_speculative_options_are_one_line_errors(tmp_path, capsys):
    path = model_path(STORIES)
    for k in (0, 17, 2.5, True):
        with pytest.raises(JaxinferError, match="draft_tokens .* must be an integer in 1..16"):
            jaxinfer.load(path, speculative="ngram", draft_tokens=k)
    other, _ = _reference("qwen3_5")
    with pytest.raises(JaxinferError, match="vocabulary .* a draft must share"):
        jaxinfer.load(path, speculative=str(other))
    with pytest.raises(UnsupportedModelError, match="mtp"):
        jaxinfer.load(path, speculative="mtp")
    with pytest.raises(JaxinferError, match="speculative = 3 is invalid"):
        jaxinfer.load(path, speculative=3)
    with pytest.raises(JaxinferError, match="does not exist"):
        jaxinfer.load(path, speculative=str(tmp_path / "missing.gguf"))
    # The CLI: one line, no traceback.
    for argv in (
        ["--spec-type", "ngram", "--spec-draft-n-max", "0"],
        ["--spec-type", "draft"],
        ["--spec-type", "ngram", "-md", str(path)],
        ["-md", str(other)],
    ):
        assert main(["generate", "-m", str(path), "-p", "Once", "-n", "4", *argv]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err


def test_a_refused_request_leaves_the_speculative_engine_usable(stories_ngram):
    with pytest.raises(RequestError):
        stories_ngram.generate([1] * 600, max_new_tokens=4)
    assert _greedy(stories_ngram, [1], 16) == GOLDEN[:16]


@pytest.mark.slow
def test_cli_prints_the_speculative_line(capsys):
    path = model_path(STORIES)
    argv = ["generate", "-m", str(path), "-p", "Once upon a time", "-n", "24", "--temp", "0",
            "--spec-type", "ngram", "--spec-draft-n-max", "3", "-c", "256"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "speculative: ngram, K = 3, drafted = " in err
