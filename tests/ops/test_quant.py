"""Quantized weights kept compressed (quant.py): every block format against gguf-py's own
dequantize; models in block form against the same files dequantized at load by gguf-py
(greedy ids exact, logits within float32 noise); device bytes against the file's tensor
bytes; per-channel int8 against a float64 reference; layouts, slots, strict mode, bad input.
"""

import json
import os
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from safetensors.numpy import load_file
from support import reference
from support.checkpoints import TINY, random_k_blocks, random_weights, write_gguf
from support.models import F32_LOGITS_ATOL, model_path

import jaxinfer
from jaxinfer.errors import JaxinferError, LayoutError
from jaxinfer.formats.gguf import split_blocks
from jaxinfer.kernels import cpu as qkernel
from jaxinfer.model import linear
from jaxinfer.ops import quant

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]
Q8 = "stories260K-gguf-quant-derived/stories260K-Q8_0.gguf"
MIXED = "stories260K-gguf-quant-derived/stories260K-mixed-quants.gguf"
PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376]


def test_the_kernels_build_where_they_can():
    """A variant that fails to build sends every product to the in-graph path (correct but
    slow) and test_cpu.py skips it: where a compiler is, the scalar variant builds on every
    machine, and the best variant the CPU runs (build.VARIANTS' order) is the one in use."""
    from jaxinfer.kernels.cpu import build

    if shutil.which(build.COMPILER) is None or jax.default_backend() != "cpu":
        pytest.skip("no C++ compiler or no CPU backend here: the kernels cannot build")
    if os.environ.get(qkernel.ENV, "") not in ("", "auto"):
        pytest.skip(f"{qkernel.ENV} forces a variant")
    assert "scalar" in qkernel.runnable()
    best = next(v.name for v in build.VARIANTS if qkernel.missing(v) is None)
    assert qkernel.status().variant == best, qkernel.status().describe()


def gguf_data(name: str, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF data of a type for a [rows, width] tensor, as gguf-py reads it."""
    rng = np.random.default_rng(seed)
    if name.endswith("_K"):
        return random_k_blocks((rows, width), name, 0.05, seed)
    return gguf.quants.quantize(rng.standard_normal((rows, width)).astype(np.float32), T[name])


def qarray(name: str, data: np.ndarray, shape, kernel: bool = False) -> quant.QArray:
    host = split_blocks(name, data, shape)
    parts = {k: jnp.asarray(v) for k, v in host.take().items()}
    return quant.QArray(parts, host.fmt, host.width, kernel)


def file_tensor_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("name", TYPES)
def test_each_format_dequantizes_as_gguf_py_does(name):
    rows, width = 12, 512
    data = gguf_data(name, rows, width)
    want = gguf_dequantize(data, T[name]).reshape(rows, width)  # float32
    w = qarray(name, data, (rows, width))
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.dequantize)(w)), want)
    # device bytes: the file's block bytes, K-quants' unpacked 6-bit scales aside (+3%)
    block, size = GGML_QUANT_SIZES[T[name]]
    assert w.nbytes <= 1.03 * (rows * width // block * size)
    # the matmul seam, in-graph and (where it builds) through the CPU kernel, against
    # float64; rows of a stacked [2, O, I] weight read like an expert's
    x = np.random.default_rng(1).standard_normal((3, width)).astype(np.float32)
    ref = x.astype(np.float64) @ want.astype(np.float64).T
    # measured: at most 3.6e-7 of sum |x||w| over every format, 1-64 rows, both paths
    bound = 1e-5 * (np.abs(x) @ np.abs(want).T) + 1e-6
    kernels = [False, True] if qkernel.available() else [False]
    for kernel in kernels:
        w = qarray(name, data, (rows, width), kernel)
        got = np.asarray(jax.jit(linear.linear)(jnp.asarray(x), w))
        assert np.all(np.abs(got - ref) <= bound), (kernel, np.abs(got - ref).max())
    stacked = w.rows(lambda a: jnp.stack([a, a[::-1]]))
    got = np.asarray(linear.linear(jnp.asarray(x), stacked.rows(lambda a: a[1])))
    assert np.all(np.abs(got - ref[:, ::-1]) <= bound)
    # embedding lookups dequantize the rows they gather
    rows_got = np.asarray(linear.embed(w, jnp.asarray([3, 0, 3])))
    np.testing.assert_array_equal(rows_got, want[[3, 0, 3]])


def both(engines, path, **kw):
    """The file in block form, and dequantized to float32 at load by gguf-py (the reference).
    At stories260K's own context (512), the dequantized model has the shapes of the float
    stories engines elsewhere: its programs come from the session's compilation cache."""
    opts = {"max_seq_len": 512, **kw}
    # the dequantized model's K/V cache is float32 (a file in blocks defaults to float16)
    return (engines(path, activations="float", kv_cache_dtype="float32", **opts),
            engines(path, quantize="none", **opts))  # fmt: skip


def assert_same_model(q, f, prompts, n: int = 16):
    for ids in prompts:
        np.testing.assert_allclose(q.logits(ids), f.logits(ids), rtol=0, atol=F32_LOGITS_ATOL)
    gq = q.generate(prompts, max_new_tokens=n, temperature=0, ignore_eos=True)
    gf = f.generate(prompts, max_new_tokens=n, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in gq] == [r.token_ids for r in gf]


@pytest.fixture(scope="module")
def stories_q8(engines):
    return both(engines, model_path(Q8))


def test_stories_q8_0_equals_the_dequantized_model(stories_q8):
    q, f = stories_q8
    np.testing.assert_allclose(q.logits(PROMPT), f.logits(PROMPT), rtol=0, atol=F32_LOGITS_ATOL)
    a = q.generate([1], max_new_tokens=64, temperature=0, ignore_eos=True)
    b = f.generate([1], max_new_tokens=64, temperature=0, ignore_eos=True)
    assert a.token_ids == b.token_ids
    # Q8_0 and F16 tensors stay as the file holds them: device bytes = tensor bytes
    assert q.weight_bytes() == file_tensor_bytes(model_path(Q8))
    assert f.weight_bytes() > 2.5 * q.weight_bytes()


@pytest.mark.slow  # its greedy ids: test_golden; its formats: the dequantization tests
def test_mixed_quants_fixture_loads_and_generates(engines):
    path = model_path(MIXED)
    q, f = both(engines, path)
    assert_same_model(q, f, [PROMPT, [1, 300, 301]])
    assert q.weight_bytes() == file_tensor_bytes(path)


K_CONFIG = dict(TINY["llama"], hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=2)  # fmt: skip


@pytest.mark.slow  # the formats' values: test_each_format_dequantizes_as_gguf_py_does
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_models_equal_their_dequantized_form(engines, tmp_path, qtype):
    path = write_gguf(tmp_path / "k.gguf", K_CONFIG, random_weights(K_CONFIG), qtype=qtype)
    q, f = both(engines, path, max_seq_len=128)
    assert_same_model(q, f, [[1, 5, 9, 200], [1, 7]])
    assert q.weight_bytes() <= 1.03 * file_tensor_bytes(path)


def test_a_split_that_would_cut_a_block_is_refused(tmp_path):
    """A tensor split would cut the attention output's single 256-value block of columns."""
    path = write_gguf(tmp_path / "k.gguf", K_CONFIG, random_weights(K_CONFIG), qtype="Q4_K")
    with pytest.raises(LayoutError, match="would cut"):
        jaxinfer.load(path, layout="tensor", devices=2, max_seq_len=64)


FIXTURES = {
    "qwen3_moe": "tiny-random/qwen3_moe_e8k2_bpe",
    "qwen3_5_moe": "tiny-random/qwen3_5_moe_l3f1_e8k2_mtp",  # Gated DeltaNet, tiled V heads
    "qwen3_next": "tiny-random/qwen3_next_l3f1_e8k2_mtp",
    "qwen3_5": "tiny-random/qwen3_5_l3f1_dense_mtp",
    "mixtral": "tiny-random/mixtral_e8k2",
}
SLOW_FIXTURES = tuple(FIXTURES)  # quantized experts in the default run: the expert split test


# Qwen3.5 dense: its layers are Qwen3.5-MoE's, but for the experts; Qwen3-MoE: Qwen3's attention
# and Mixtral's kind of expert block, both here in other fixtures (its Q8_0 file's greedy ids:
# test_int8_activations and test_kernel_variants)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow)
        for n in SLOW_FIXTURES
        if n not in ("qwen3_5", "qwen3_moe")
    ],
)
def test_q8_0_fixtures_equal_their_dequantized_form(engines, name):
    root = model_path(FIXTURES[name])
    prompts = [p["ids"][:40] for p in json.loads((root / "reference.json").read_text())["prompts"]]
    q, f = both(engines, root / "model-q8_0.gguf", max_seq_len=128)
    assert_same_model(q, f, prompts[:3], n=12)
    assert q.weight_bytes() < 0.5 * f.weight_bytes()


@pytest.mark.slow
def test_quantized_layouts_keep_the_tokens(engines, stories_q8):
    q, _ = stories_q8
    want = q.generate([PROMPT, [1, 300]], max_new_tokens=12, temperature=0, ignore_eos=True)
    # layer: 5 layers over 2 stages (uneven, slots stacking Q8_0 and F16 layers alike);
    # the mixed file's stage layers mix five block formats (one stack per format)
    for path, layout, devices in ((Q8, "layer", 2), (Q8, "tensor", 2), (MIXED, "layer", 4)):
        engine = jaxinfer.load(model_path(path), layout=layout, devices=devices, max_seq_len=128,
                               activations="float")  # fmt: skip
        ref = (
            want
            if path == Q8
            else both(engines, model_path(MIXED))[0].generate(
                [PROMPT, [1, 300]], max_new_tokens=12, temperature=0, ignore_eos=True
            )
        )
        got = engine.generate([PROMPT, [1, 300]], max_new_tokens=12, temperature=0, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref], (path, layout)


@pytest.mark.slow
def test_quantized_experts_under_the_expert_split(engines):
    path = model_path(FIXTURES["qwen3_moe"]) / "model-q8_0.gguf"
    single = engines(path, max_seq_len=128)
    split = engines(path, layout="expert", devices=2, max_seq_len=128)
    prompts = [[1, 20, 30, 40], [1, 50]]
    a = single.generate(prompts, max_new_tokens=10, temperature=0, ignore_eos=True)
    b = split.generate(prompts, max_new_tokens=10, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@pytest.mark.slow
def test_slots_and_strict_mode_compile_nothing_after_warmup():
    engine = jaxinfer.load(model_path(Q8), max_seq_len=128, slots=3, strict=True)
    engine.warmup(progress=False)
    alone = [engine.generate(p, max_new_tokens=8, temperature=0) for p in (PROMPT, [1, 300])]
    handles = [engine.submit(p, max_new_tokens=8, temperature=0) for p in (PROMPT, [1, 300])]
    together = [h.result() for h in handles]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    stats = engine.perf_stats()
    assert (stats.recompiles_same, stats.recompiles_diff, stats.untracked_compiles) == (0, 0, 0)


def test_int8_matches_a_float64_reference_of_the_rounded_weights():
    root = model_path("stories260K-hf-derived")
    config = json.loads((root / "config.json").read_text())
    weights = load_file(str(root / "model.safetensors"))
    rounded = {}
    for name, w in weights.items():  # symmetric per-row int8, written from its definition
        if w.ndim == 2:
            s = np.abs(w).max(axis=1, keepdims=True) / 127.0
            w = np.clip(np.rint(w / s), -127, 127) * s
        rounded[name] = w
    want = reference.forward(rounded, config, PROMPT)  # [T, V]
    engine = jaxinfer.load(root, quantize="int8", max_seq_len=64)
    np.testing.assert_allclose(engine.logits(PROMPT), want, rtol=0, atol=F32_LOGITS_ATOL)
    plain = jaxinfer.load(root, max_seq_len=64)
    assert engine.weight_bytes() < 0.3 * plain.weight_bytes()


def test_bad_quantize_option_is_one_line():
    with pytest.raises(JaxinferError, match="quantize = 'int4' is not supported"):
        jaxinfer.load(model_path(Q8), quantize="int4")


def test_the_kernel_source_declares_the_parts_of_FORMATS():
    """The C++ kernel's part table (the SPEC lines of src/q_*.cc: each format's part dtypes and
    values per entry, in FORMATS order) and its weight limit agree with quant.FORMATS and
    MAX_WEIGHTS, read from the source so every machine checks it, built or not."""
    import re

    source = "".join(
        f.read_text() for f in sorted((Path(qkernel.__file__).parent / "src").iterdir())
    )
    handlers = dict(re.findall(r"^QMATMUL_HANDLER\((\w+), ([\w<>]+)\)", source, re.M))
    lists = r"(LIST\(([^)]*)\)|[\w:]+)"
    specs = {
        m.group(1): (m.group(2), m.group(4))
        for m in re.finditer(rf"SPEC\(([\w<>]+),\s*{lists},\s*{lists},", source)
    }
    dtypes = {"S8": "int8", "U8": "uint8", "F16": "float16", "BF16": "bfloat16", "F32": "float32"}

    def items(text: str) -> list[str]:
        inner = text[5:-1] if text.startswith("LIST(") else text
        return [x.strip() for x in inner.split(",")]

    assert set(handlers) == set(quant.FORMATS)
    for fmt, struct in handlers.items():
        types, per = specs[struct]
        parts = quant.FORMATS[fmt].parts
        assert [dtypes[t.removeprefix("DataType::")] for t in items(types)] == [
            p.dtype for p in parts
        ], fmt
        assert [int(x) for x in items(per)] == [p.per for p in parts], fmt
    (limit,) = re.findall(r"constexpr size_t kMaxWeights = (\d+);", source)
    assert int(limit) == qkernel.MAX_WEIGHTS
