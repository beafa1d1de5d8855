"""Echo's prompt logprobs (Engine.prompt_logprobs): the log-softmax, each token's value and
the top k taken per chunk in the scoring program, against a float64 NumPy log-softmax of the
model's full logits (Engine.logits, which returns them without that path); the host memory
they take on a 32k vocabulary; no compile after warmup for any k or prompt length."""

import copy
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support import checkpoints
from support.models import STORIES_HF, model_path

import jaxinfer

ATOL = 1e-4  # float32 on the device against float64 from the same float32 logits
OPTS = dict(max_seq_len=512, prefill_buckets=(128,), batch_buckets=(1, 4))
MB = 2**20


def log_softmax64(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def check(scored, ids, want: np.ndarray, k: int) -> None:
    """prompt_logprobs(ids, k) against want [T, V], the float64 log-softmax of the logits."""
    assert len(scored) == len(ids) and scored[0] is None
    for t, lp in enumerate(scored[1:]):
        ref = want[t]  # the logits at t predict ids[t + 1]
        assert lp.id == ids[t + 1]
        assert abs(lp.logprob - ref[lp.id]) <= ATOL, (t, lp.logprob, ref[lp.id])
        assert len(lp.top) == k
        order = np.argsort(-ref, kind="stable")
        ranked = ref[order]
        top = [i for i, _ in lp.top]
        for rank, (i, v) in enumerate(lp.top):
            assert abs(v - ref[i]) <= ATOL, (t, rank, v, ref[i])
            # the first rank + 1 are the reference's wherever it separates them from the next
            if ranked[rank] - ranked[rank + 1] > ATOL:
                assert set(top[: rank + 1]) == set(order[: rank + 1].tolist()), (t, rank)


def stories_prompt(engine) -> list[int]:
    text = (
        "Once upon a time, there was a little girl named Lily. She loved to play outside in "
        "the park with her friends. One day, she saw a big red ball under a tree. "
    )
    return engine.tokenize(text * 4)  # 218 tokens: two 128-token chunks


@pytest.mark.parametrize(
    "model",
    [STORIES_HF, "tiny-random/qwen3_moe_e8k2_bpe",
     pytest.param("tiny-random/qwen3_5_l3f1_dense_mtp", marks=pytest.mark.slow)],
)  # fmt: skip
def test_prompt_logprobs_equal_a_float64_log_softmax_of_the_logits(engines, model):
    """Every position's logprob and top k (k = 0, 5, 20) over a prompt of several chunks."""
    engine = engines(model_path(model), **OPTS)
    if model == STORIES_HF:
        ids = stories_prompt(engine)
    else:
        rng = np.random.default_rng(0)
        ids = rng.integers(3, engine.cfg.vocab_size, 300).tolist()
    assert len(ids) > 128
    want = log_softmax64(engine.logits(ids))[:-1]  # [T - 1, V]
    for k in (0, 5, 20):
        check(engine.prompt_logprobs(ids, k), ids, want, k)
    assert engine.prompt_logprobs(ids[:1], 3) == [None]


@pytest.mark.slow  # 12 s here: the default tier's time budget
def test_prompt_logprobs_compile_nothing_after_warmup(compiles):
    """Scoring is in the warmup plan (score[1, T] per chunk past the smallest); the top k
    always come back MAX_LOGPROBS wide and are cut on the host, so two k and two prompt
    lengths (one 32-token chunk; two of 128) compile nothing in strict mode."""
    engine = jaxinfer.load(
        model_path(STORIES_HF), max_seq_len=512, prefill_buckets=(8, 32, 128),
        batch_buckets=(1,), strict=True,
    )  # fmt: skip
    engine.warmup(progress=False)
    ids = stories_prompt(engine)
    with compiles() as seen:
        for n in (20, len(ids)):
            for k in (1, 20):
                scored = engine.prompt_logprobs(ids[:n], k)
                assert len(scored) == n and all(len(lp.top) == k for lp in scored[1:])
    assert seen.n == 0
    stats = engine.perf_stats()
    assert (stats.recompiles_same, stats.recompiles_diff) == (0, 0)


# Run in a process of its own, so that VmHWM (the peak RSS) is this work's: the engine
# warms up (every program compiled, the pools allocated), the peak is reset to the current
# RSS (clear_refs 5), and one prompt_logprobs call of 3,000 tokens runs.
MEASURE = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jaxinfer

    def peak():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

    path, n = sys.argv[1], int(sys.argv[2])
    engine = jaxinfer.load(path, max_seq_len=4096, batch_buckets=(1,))
    engine.warmup(progress=False)
    ids = np.random.default_rng(0).integers(3, engine.cfg.vocab_size, n).tolist()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    before = peak()
    scored = engine.prompt_logprobs(ids, 5)
    after = peak()
    assert len(scored) == n and len(scored[-1].top) == 5
    print(json.dumps({"growth": after - before, "reset": reset, "vocab": engine.cfg.vocab_size}))
    """
)


@pytest.mark.slow
def test_echo_logprobs_of_a_long_prompt_take_little_host_memory(tmp_path):
    """A 3,000-token prompt on a 32,000-token vocabulary (2 layers, width 64) grows the peak
    RSS by less than 500 MiB. The code before (the whole [T, V] logits gathered on the host,
    then float64 copies of them) failed this: one float64 copy alone is 3000 x 32000 x 8
    bytes = 768 MB, and it measured a growth of 2,939 MiB here. The device path brings back
    [T] and [T, 20]; what remains (190 MiB measured) is the largest chunk's (512) logits and
    log-softmax on the device, which on CPU is host memory: O(chunk x V), not O(T x V)."""
    cfg = copy.deepcopy(checkpoints.TINY["llama"])
    cfg.update(vocab_size=32000, max_position_embeddings=4096)
    path = checkpoints.write_hf(tmp_path / "hf", cfg, checkpoints.random_weights(cfg),
                                tokenizer=False)  # fmt: skip
    # a word-level vocabulary of the right size (the byte-level BPE writer stops short of 32k)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32000)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.ByteLevel()  # the tokens are ASCII: their bytes are themselves
    words.save(str(path / "tokenizer.json"))
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), "3000"],
        capture_output=True, text=True, env=os.environ.copy(), timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["vocab"] == 32000
    print(f"peak RSS growth {out['growth'] / MB:.0f} MB (peak reset: {out['reset']})")
    assert out["growth"] < 500 * MB, out
