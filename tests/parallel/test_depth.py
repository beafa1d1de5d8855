"""Depth-shared layers (parallel/runs.py, parallel/depth.py): the runs a layer sequence is cut
into, written from the rule; a program whose size does not grow with depth; and the same
tokens as every layer traced on its own (the float64 references and the fixtures' golden ids
run through the shared path by default: tests/model/test_model.py, test_hybrid.py, test_moe.py)."""

from pathlib import Path

import numpy as np
import pytest
from support.checkpoints import TINY, random_weights, write_gguf
from support.models import model_path

import jaxinfer
from jaxinfer import kernels
from jaxinfer.parallel.runs import Run, layer_runs

Q4_K_M = Path(__file__).resolve().parents[1] / "fixtures" / "llama_cpp_int8" / "model-Q4_K_M.gguf"


def q4_k_m_pattern(n: int) -> list[str]:
    """llama.cpp's use_more_bits: the layers whose ffn_down a Q4_K_M file keeps in Q6_K."""
    return ["Q6" if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2 else "Q4"
            for i in range(n)]  # fmt: skip


def test_runs_cover_the_layers_with_the_longest_repetitions():
    assert layer_runs(["a"] * 48) == (Run(0, ("a",), 48),)
    hybrid = ["L", "L", "L", "A"] * 10
    assert layer_runs(hybrid) == (Run(0, ("L", "L", "L", "A"), 10),)
    assert layer_runs(["a", "b", "c"]) == tuple(Run(i, (x,), 1) for i, x in enumerate("abc"))
    runs = layer_runs(q4_k_m_pattern(32))
    assert [(r.first, r.width, r.count) for r in runs] == [(0, 1, 4), (4, 3, 8), (28, 1, 4)]
    for pattern in (q4_k_m_pattern(48), hybrid + ["L", "L"], ["a", "b"] * 3 + ["c"]):
        runs = layer_runs(pattern)
        assert [n for r in runs for n in r.layers] == list(range(len(pattern)))
        assert all(pattern[r.layer(i, j)] == r.unit[j] for r in runs for i in range(r.count)
                   for j in range(r.width))  # fmt: skip


SHAPES = {  # narrow models of each kind, random weights
    "dense": dict(arch="qwen3", d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                  qk_norm=True),
    "moe": dict(arch="qwen3_moe", d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                qk_norm=True, n_experts=16, n_experts_used=4, d_ff_expert=32),
    "hybrid": dict(arch="qwen3_5", d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                   qk_norm=True, attn_gate=True, linear_k_heads=2, linear_v_heads=4,
                   linear_k_dim=16, linear_v_dim=16, conv_kernel=4, rotary_dim=4),
}  # fmt: skip


LAYOUTS = {"single": {}, "layer-2": dict(layout="layer", devices=2),
           "layer-3": dict(layout="layer", devices=3)}  # fmt: skip


def decode_size(kind: str, layers: int, **layout) -> tuple[int, str]:
    """Instructions of the compiled decode program of a `layers`-layer model of `kind` (under
    `layout`: load()'s layout and devices), and how many layer bodies it traced."""
    linear = tuple(i for i in range(layers) if (i + 1) % 4)  # 3 Gated DeltaNet : 1 attention
    extra = {"linear_layers": linear} if kind == "hybrid" else {}
    cfg = jaxinfer.ModelConfig(n_layers=layers, vocab_size=300, max_position=256,
                               **SHAPES[kind], **extra)  # fmt: skip
    engine = jaxinfer.load(cfg, max_seq_len=64, batch_buckets=(1,), prefill_buckets=(16,),
                           compile_cache_dir=None, **layout)  # fmt: skip
    ex = engine.executor  # the decode program alone (warmup() would compile the whole plan)
    jobs = [ex.job(*shape) for shape in engine.shapes.jobs() if shape[0] == "decode"]
    engine.compile_cache.compile_planned(jobs)
    (decode,) = engine.compile_cache.executables("decode")
    bodies = engine.runner.description.split(" traced")[0].split("; ")[-1]
    return sum(" = " in line for line in decode.as_text().splitlines()), bodies


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.slow),
                                  "hybrid"])  # fmt: skip
def test_the_decode_program_does_not_grow_with_depth(kind):
    """4 and 48 layers trace as many layer bodies (the hybrid's: the linear layers, looped,
    and the attention layer) and compile to programs of about one size."""
    (small, bodies), (deep, deep_bodies) = decode_size(kind, 4), decode_size(kind, 48)
    assert bodies == deep_bodies == ("2" if kind == "hybrid" else "1")
    assert deep <= 1.2 * small, (small, deep)


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.slow),
                                  "hybrid"])  # fmt: skip
def test_pipeline_stages_do_not_grow_with_depth(kind):
    """Under the `layer` layout (2 stages), each stage loops over its stage layers: 4 and 48
    layers trace as many bodies and compile to programs of about one size."""
    layout = LAYOUTS["layer-2"]
    small, bodies = decode_size(kind, 4, **layout)
    deep, deep_bodies = decode_size(kind, 48, **layout)
    assert bodies == deep_bodies == ("2" if kind == "hybrid" else "1")
    assert deep <= 1.2 * small, (small, deep)


HYBRID_MOE = "tiny-random/qwen3_5_moe_l3f1_e8k2_mtp"


@pytest.mark.parametrize(
    "path, layout",
    [(Q4_K_M, "single"), (Q4_K_M, "layer-2"),
     *(pytest.param(HYBRID_MOE, name, marks=pytest.mark.slow) for name in LAYOUTS)],
)  # fmt: skip
def test_shared_layers_give_the_unshared_logits(path, layout):
    """A Q4_K_M file (its ffn_down and attn_v in Q6_K in some layers: several runs, and stage
    layers whose stages hold different formats) and the hybrid MoE fixture: the shared path's
    logits are the per-layer path's, on one device and in pipeline stages (against the same
    stages unshared)."""
    path, layout = path if isinstance(path, Path) else model_path(path), LAYOUTS[layout]
    shared = jaxinfer.load(path, max_seq_len=128, compile_cache_dir=None, **layout)
    own = jaxinfer.load(path, max_seq_len=128, compile_cache_dir=None, shared_layers=False,
                        **layout)  # fmt: skip
    assert "traced layer bodies" in shared.runner.description
    ids = list(range(3, 40))
    np.testing.assert_allclose(shared.logits(ids), own.logits(ids), rtol=0, atol=2e-4)
    greedy = dict(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert shared.generate(ids, **greedy).token_ids == own.generate(ids, **greedy).token_ids


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


@pytest.mark.parametrize("stages", [2, pytest.param(3, marks=pytest.mark.slow), 4])
def test_stages_mixing_formats_give_one_devices_logits(tmp_path, stages):
    """An 8-layer Q4_K_M-pattern file (Q6_K ffn_down / attn_v in layers 0, 3, 6, 7) over 2, 3
    (uneven: 3 + 3 + 2) and 4 stages: each format's stack is as deep as the most layers of it
    that a stage holds, and logits and greedy ids are one device's (which reads each layer's
    own blocks)."""
    path, pattern = q4_k_m_file(tmp_path / "q4_k_m.gguf")
    one = jaxinfer.load(path, max_seq_len=64, compile_cache_dir=None)
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


MOE_MIX = dict(TINY["qwen3_moe"], hidden_size=256, intermediate_size=256, num_hidden_layers=4,
               moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2)  # fmt: skip


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
