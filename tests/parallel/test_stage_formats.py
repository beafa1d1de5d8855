"""Pipeline stage layers whose stages' layers hold a weight in different block formats (a
Q4_K_M file's Q6_K ffn_down and attn_v layers, parallel/pipeline.py's Mix): the weights stay
in blocks, one stack per format, and the model computes what one device computes (which reads
each layer's own blocks) and what llama.cpp computes on the same file."""

from pathlib import Path

import numpy as np
import pytest
from support.checkpoints import TINY, random_weights, write_gguf
from test_depth import LAYOUTS, Q4_K_M, q4_k_m_pattern

import jaxinfer
from jaxinfer import kernels

K_MIX = dict(TINY["llama"], hidden_size=256, intermediate_size=256, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
NOISE = 1e-4  # float32 noise against llama.cpp's logits (tests/ops/test_int8_activations.py)


def q4_k_m_file(path: Path) -> tuple[Path, list[str]]:
    """An 8-layer Q4_K file (random blocks, d 256) whose ffn_down and attn_v are Q6_K in the
    layers llama.cpp's Q4_K_M keeps so; and the ffn_down types, per layer."""
    pattern = q4_k_m_pattern(K_MIX["num_hidden_layers"])
    types = {f"blk.{i}.{t}.weight": "Q6_K" for i, q in enumerate(pattern) if q == "Q6"
             for t in ("ffn_down", "attn_v")}  # fmt: skip
    write_gguf(path, K_MIX, random_weights(K_MIX), qtype="Q4_K", qtypes=types)
    return path, [q + "_K" for q in pattern]


def stack_depths(pattern: list[str], stages: int) -> dict[str, int]:
    """Per format, the stack depth a layer split keeps: the most layers of that format any
    stage holds (stages hold contiguous layers, the first n % stages one longer)."""
    base, extra = divmod(len(pattern), stages)
    cuts = np.cumsum([0] + [base + (s < extra) for s in range(stages)])
    return {f: max(pattern[cuts[s] : cuts[s + 1]].count(f) for s in range(stages))
            for f in set(pattern)}  # fmt: skip


def block_matrices(engine) -> list:
    """The placed stage layers' matrices (a per-format stack's QArrays each)."""
    from jaxinfer.ops.quant import QArray

    leaves = []
    for unit in engine.params["runs"]:
        for entry in unit:
            for part in ("attn", "mlp"):
                for weight in entry[part].values():
                    if isinstance(weight, dict):  # one stack per format
                        leaves.extend(weight.values())
                    elif isinstance(weight, QArray) or weight.ndim >= 4:  # [pp, n, O, I]
                        leaves.append(weight)
    return leaves


def test_stage_layers_keep_each_format_in_blocks(caplog):
    """Under `layer`, the Q4_K_M fixture's stage layer holds layer 0's attn_v and ffn_down in
    Q4_K on stage 0 and layer 1's in Q6_K on stage 1: every matrix stays in the file's blocks
    (no float copy, no warning), and one-token prompts' logits follow llama.cpp's own."""
    from jaxinfer.ops.quant import QArray

    with caplog.at_level("WARNING", logger="jaxinfer.parallel.pipeline"):
        engine = jaxinfer.load(Q4_K_M, max_seq_len=64, compile_cache_dir=None,
                               kv_cache_dtype="float32", **LAYOUTS["layer-2"])  # fmt: skip
    assert not [r for r in caplog.records if "different formats" in r.getMessage()]
    matrices = block_matrices(engine)
    assert matrices and all(isinstance(w, QArray) and w.fmt in ("q4_k", "q6_k")
                            for w in matrices)  # fmt: skip
    assert "one stack per format: attn.wv (Q4_K/Q6_K), mlp.w_down (Q4_K/Q6_K)" in (
        engine.runner.description
    )
    fixtures = Q4_K_M.parent
    want = np.load(fixtures / "logits.npz")[Q4_K_M.name].astype(np.float64)  # [tokens, vocab]
    got = np.stack([np.asarray(engine.logits([t]), np.float64)[0] for t in range(len(want))])
    off = np.abs(got - want).max(axis=-1)  # per one-token prompt
    assert np.sum(off <= NOISE) >= 0.9 * len(off), np.array2string(off, precision=1)


@pytest.fixture(scope="module")
def k_mix(tmp_path_factory):
    """The 8-layer file, its ffn_down types, and one device's engine on it."""
    path, pattern = q4_k_m_file(tmp_path_factory.mktemp("k_mix") / "q4_k_m.gguf")
    return path, pattern, jaxinfer.load(path, max_seq_len=64, compile_cache_dir=None)


@pytest.mark.parametrize("stages", [2, *(pytest.param(n, marks=pytest.mark.slow) for n in (3, 4))])
def test_stages_mixing_formats_give_one_devices_logits(k_mix, stages):
    """An 8-layer Q4_K_M-pattern file (Q6_K ffn_down / attn_v in layers 0, 3, 6, 7) over 2, 3
    (uneven: 3 + 3 + 2) and 4 stages: each format's stack is as deep as the most layers of it
    that a stage holds, and logits and greedy ids are one device's (which reads each layer's
    own blocks)."""
    path, pattern, one = k_mix
    split = jaxinfer.load(path, max_seq_len=64, compile_cache_dir=None, layout="layer",
                          devices=stages)  # fmt: skip
    entries = [e for unit in split.params["runs"] for e in unit]
    if kernels.reads_stacked_layers():  # one run: each format's stack spans the stage's layers
        (entry,) = entries
        down = entry["mlp"]["w_down"]
        depth = {f.upper(): w.parts["d"].shape[1] for f, w in down.items()}
        assert depth == stack_depths(pattern, stages)
    else:  # a run per stage layer (the graph path)
        assert len(entries) == -(-len(pattern) // stages)
    ids = list(range(3, 40))
    # measured: equal with the CPU kernels, at most 1.5e-5 apart on the graph path (XLA's
    # float32 sums in another order in the two programs)
    np.testing.assert_allclose(split.logits(ids), one.logits(ids), rtol=0, atol=NOISE)
    greedy = dict(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert split.generate(ids, **greedy).token_ids == one.generate(ids, **greedy).token_ids


@pytest.mark.slow
def test_stage_stacks_in_plain_memory_give_one_devices_logits(k_mix, monkeypatch):
    """Without huge pages (THP off here; other platforms always) each device's slice of a
    stage stack is built in plain host memory and handed to device_put, not placed in an
    arena: the same logits and greedy ids as one device."""
    from jaxinfer.parallel.hugepages import Arena

    monkeypatch.setattr(Arena, "usable", staticmethod(lambda: False))
    path, _, one = k_mix
    split = jaxinfer.load(path, max_seq_len=64, compile_cache_dir=None, layout="layer",
                          devices=2)  # fmt: skip
    ids = list(range(5, 30))
    np.testing.assert_allclose(split.logits(ids), one.logits(ids), rtol=0, atol=NOISE)
    greedy = dict(max_new_tokens=8, temperature=0, ignore_eos=True)
    assert split.generate(ids, **greedy).token_ids == one.generate(ids, **greedy).token_ids


MOE_MIX = dict(TINY["qwen3_moe"], hidden_size=256, intermediate_size=256, num_hidden_layers=4,
               moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2)  # fmt: skip


@pytest.mark.slow
def test_stage_experts_mixing_formats_give_one_devices_logits(tmp_path):
    """A 4-layer MoE whose stacked ffn_down experts are Q6_K in layers 0 and 3, Q4_K in 1 and
    2 (gate and up Q4_K): over 2 stages each stage layer holds both, and the expert block
    picks the layer's format (moe.experts' branch per format); one device's logits and ids."""
    qtypes = {f"blk.{i}.ffn_{w}_exps.weight": "Q6_K" if w == "down" and i in (0, 3) else "Q4_K"
              for i in range(4) for w in ("gate", "up", "down")}  # fmt: skip
    path = write_gguf(tmp_path / "moe.gguf", MOE_MIX, random_weights(MOE_MIX), qtype="Q4_K",
                      qtypes=qtypes)  # fmt: skip
    one = jaxinfer.load(path, max_seq_len=64, compile_cache_dir=None)
    split = jaxinfer.load(path, max_seq_len=64, compile_cache_dir=None, **LAYOUTS["layer-2"])
    assert "moe.w_down (Q4_K/Q6_K)" in split.runner.description
    ids = list(range(3, 40))
    np.testing.assert_allclose(split.logits(ids), one.logits(ids), rtol=0, atol=NOISE)
    greedy = dict(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert split.generate(ids, **greedy).token_ids == one.generate(ids, **greedy).token_ids


@pytest.mark.slow
def test_hybrid_stages_mixing_formats_give_one_devices_logits(tmp_path):
    """A Qwen3.5 hybrid (3 Gated DeltaNet : 1 attention, 8 layers) in Q8_0 whose layers 0 and
    6 keep the linear attention's input and output projections, and layer 3 its attention
    output, in Q4_0: over 2 stages both kinds of stage layer hold both formats, and the
    layers' products pick theirs (linear.linears' branch); one device's logits and ids."""
    from support import hybrid_checkpoints as H

    cfg = H.hybrid_config("qwen3_5", num_hidden_layers=8)
    qtypes = {f"blk.{i}.{t}.weight": "Q4_0" for i in (0, 6) for t in ("attn_qkv", "ssm_out")}
    qtypes["blk.3.attn_output.weight"] = "Q4_0"
    path = H.write_hybrid_gguf(tmp_path / "hybrid.gguf", cfg, H.hybrid_random_weights(cfg, 3),
                               qtype="Q8_0", qtypes=qtypes)  # fmt: skip
    one = jaxinfer.load(path, max_seq_len=64, compile_cache_dir=None)
    split = jaxinfer.load(path, max_seq_len=64, compile_cache_dir=None, **LAYOUTS["layer-2"])
    for name in ("attn.wo (Q4_0/Q8_0)", "linear_attn.wo (Q4_0/Q8_0)"):
        assert name in split.runner.description, split.runner.description
    ids = list(range(3, 40))
    np.testing.assert_allclose(split.logits(ids), one.logits(ids), rtol=0, atol=NOISE)
    greedy = dict(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert split.generate(ids, **greedy).token_ids == one.generate(ids, **greedy).token_ids
