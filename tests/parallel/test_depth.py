"""Depth-shared layers (parallel/runs.py, parallel/depth.py): the runs a layer sequence is cut
into, written from the rule; a program whose size does not grow with depth; and the same
tokens as every layer traced on its own (the float64 references and the fixtures' golden ids
run through the shared path by default: tests/model/test_model.py, test_hybrid.py, test_moe.py)."""

from pathlib import Path

import numpy as np
import pytest
from support.models import model_path

import jaxinfer
from jaxinfer.kernels import cpu as kernels
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


@pytest.mark.parametrize("kind", ["dense", *(pytest.param(k, marks=pytest.mark.slow)
                                             for k in ("moe", "hybrid"))])  # fmt: skip
def test_the_decode_program_does_not_grow_with_depth(kind):
    """4 and 48 layers trace as many layer bodies (the hybrid's: the linear layers, looped,
    and the attention layer) and compile to programs of about one size."""
    (small, bodies), (deep, deep_bodies) = decode_size(kind, 4), decode_size(kind, 48)
    assert bodies == deep_bodies == ("2" if kind == "hybrid" else "1")
    assert deep <= 1.2 * small, (small, deep)


@pytest.mark.slow  # 18 s here; the one-device decode's depth test is in the default tier
@pytest.mark.parametrize("kind", ["dense", "moe", "hybrid"])
def test_pipeline_stages_do_not_grow_with_depth(kind):
    """Under the `layer` layout (2 stages), each stage loops over its stage layers: 4 and 48
    layers trace as many bodies and compile to programs of about one size. (By default the
    hybrid: its stages hold both kinds of body.)"""
    layout = LAYOUTS["layer-2"]
    small, bodies = decode_size(kind, 4, **layout)
    deep, deep_bodies = decode_size(kind, 48, **layout)
    assert bodies == deep_bodies == ("2" if kind == "hybrid" else "1")
    assert deep <= 1.2 * small, (small, deep)


HYBRID_MOE = "tiny-random/qwen3_5_moe_l3f1_e8k2_mtp"


@pytest.mark.parametrize(
    "path, layout",
    [pytest.param(path, name, marks=pytest.mark.slow)
     for path in (Q4_K_M, HYBRID_MOE) for name in ("single", "layer-2")],
)  # fmt: skip  # in the default run the shared layers meet the references in every model test
def test_shared_layers_give_the_unshared_logits(path, layout):
    """A Q4_K_M file (its ffn_down and attn_v in Q6_K in some layers: several runs, and stage
    layers whose stages hold different formats) and the hybrid MoE fixture: the shared path's
    logits are the per-layer path's, on one device and in pipeline stages (against the same
    stages unshared). The hybrid's shared stages over 3 and 4: test_hybrid's every-layout
    tokens."""
    path, layout = path if isinstance(path, Path) else model_path(path), LAYOUTS[layout]
    shared = jaxinfer.load(path, max_seq_len=128, compile_cache_dir=None, **layout)
    own = jaxinfer.load(path, max_seq_len=128, compile_cache_dir=None, shared_layers=False,
                        **layout)  # fmt: skip
    assert "traced layer bodies" in shared.runner.description
    ids = list(range(3, 40))
    np.testing.assert_allclose(shared.logits(ids), own.logits(ids), rtol=0, atol=2e-4)
    greedy = dict(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert shared.generate(ids, **greedy).token_ids == own.generate(ids, **greedy).token_ids


@pytest.mark.skipif(not kernels.runnable(), reason="no CPU kernels here")
def test_a_layers_stacked_weights_share_their_kernel_calls():
    """A shared layer's weights reach its jitted body with one layer index (quant.layers_apart),
    so that they group as an unshared layer's do: on the Q4_K_M file's 16-token prompt chunk,
    gate/up one call that makes silu(gate) * up, and no more kernel calls in the program
    than the per-layer program's."""
    calls = {}
    for shared in (True, False):
        engine = jaxinfer.load(Q4_K_M, max_seq_len=64, batch_buckets=(1,), prefill_buckets=(16,),
                               compile_cache_dir=None, shared_layers=shared)  # fmt: skip
        ex = engine.executor
        engine.compile_cache.compile_planned(
            [ex.job(*shape) for shape in engine.shapes.jobs() if shape[0] == "prefill"]
        )
        (prefill,) = engine.compile_cache.executables("prefill")
        text = prefill.as_text()
        assert "glu = 1" in text, shared
        calls[shared] = text.count('custom_call_target="jaxinfer_qmatmul_')
    assert calls[True] <= calls[False], calls
