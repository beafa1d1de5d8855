"""The CPU kernels' variants (kernels/cpu/build.py, kernels/cpu/): the choice and its errors,
the same greedy tokens under every variant this CPU runs, and the NEON variant's routines
against the scalar ones under qemu-aarch64 (where Debian's cross tools are installed)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from support.models import GOLDEN, INT8_NEAR_TIE, STORIES, STORIES_Q8, model_path

import jaxinfer
from jaxinfer.errors import SetupError
from jaxinfer.kernels import backend
from jaxinfer.kernels import cpu as kernels
from jaxinfer.kernels.cpu import build


def test_a_bad_choice_is_one_line(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "sse9")
    with pytest.raises(SetupError, match=r"JAXINFER_CPU_KERNELS='sse9' is not one of avx512vnni, "
                       r"avx512, avx2, neon, scalar, off$"):  # fmt: skip
        kernels._choose()
    monkeypatch.setenv(kernels.ENV, "off")
    assert kernels._choose().variant is None
    cannot = [v.name for v in build.VARIANTS if kernels.missing(v)]  # neon on x86, x86 on Arm
    monkeypatch.setenv(kernels.ENV, cannot[0])
    with pytest.raises(SetupError, match=rf"^{kernels.ENV}={cannot[0]}: (not for|the CPU lacks)"):
        kernels._choose()


def test_jaxinfer_kernels_xla_turns_every_kernel_off(monkeypatch):
    """JAXINFER_KERNELS=xla: the graph path, whatever JAXINFER_CPU_KERNELS names (interpret:
    the Pallas kernels, the CPU's off too); any other value than auto / xla / interpret is a
    one-line error, also from load()."""
    for mode in ("xla", "interpret"):
        monkeypatch.setenv(backend.ENV, mode)
        for forced in ("", "scalar", "off"):
            monkeypatch.setenv(kernels.ENV, forced)
            assert kernels._choose().variant is None
    monkeypatch.setenv(backend.ENV, "auto")
    monkeypatch.setenv(kernels.ENV, "off")
    assert kernels._choose().variant is None
    monkeypatch.setenv(backend.ENV, "triton")
    with pytest.raises(SetupError, match=r"^JAXINFER_KERNELS='triton' is not one of auto, xla, "):
        jaxinfer.load(model_path(STORIES))


GREEDY = """
import json, sys, jaxinfer
from jaxinfer import kernels
assert kernels.status().variant is None, kernels.status()
engines = [jaxinfer.load(p, max_seq_len=128, **json.loads(sys.argv[1])) for p in sys.argv[2:]]
out = [[e.generate([1], max_new_tokens=24, temperature=0, ignore_eos=True).token_ids,
        all("paged_attention" in c.as_text() for c in e.compile_cache.executables("decode"))]
       for e in engines]
print(json.dumps(out))
"""
HYBRID = "tiny-random/qwen3_next_l3f1_e8k2_mtp"  # GDN, gated attention (head_dim 32), MoE
OTHERS = (
    "qwen3_moe_e8k2_bpe",
    "qwen3_5_l3f1_dense_mtp",
    "qwen3_5_moe_l3f1_e8k2_mtp",
    "mixtral_e8k2",
)
# by default xla on stories Q8_0 (quantized products, attention); slow: interpret on the hybrid
# MoE (attention, the delta rule, the expert block), every other fixture in each, and under
# interpret the quantized product (stories Q8_0) and two quantized fixtures (experts in the
# tile loop of quantized products). The slow cases share a process per group: each process
# starts jax and compiles afresh, which is most of a case's time.
FIXTURES = tuple(f"tiny-random/{name}" for name in OTHERS)
CASES = [
    pytest.param(mode, models, marks=pytest.mark.slow)
    for mode, models in [("xla", (STORIES_Q8,)), ("interpret", (HYBRID,))]
] + [
    pytest.param(mode, models, marks=pytest.mark.slow)
    for mode, models in [
        ("xla", (STORIES, HYBRID)),
        ("interpret", (STORIES, STORIES_Q8, *(f"{m}/model-q8_0.gguf" for m in FIXTURES[:2]))),
        ("xla", FIXTURES),
        ("interpret", FIXTURES),
    ]
]


@pytest.mark.parametrize(("mode", "models"), CASES)
def test_xla_and_interpret_modes_give_the_default_greedy_ids(engines, models, mode):
    """A process under JAXINFER_KERNELS=xla (no kernel at all) or =interpret (the accelerator
    path: Pallas attention, quantized products and delta rule, grouped experts, interpreted)
    against this one's default (its best CPU variant): the same greedy ids, up to a near tie
    on a quantized file (INT8_NEAR_TIE: their activations differ). Under interpret
    the decode programs hold the Pallas attention wherever its tiles fit (stories260K's
    head_dim 8 does not: XLA's attention there)."""
    expect_same_ids(engines, mode, models, {})


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["layer", "expert", "tensor"])
def test_interpreted_kernels_inside_layouts(engines, layout):
    """The kernels inside shard_map (pipeline stages, expert shards) and beside a tensor split
    (whose split pools take XLA's attention): the default's single-device ids."""
    expect_same_ids(engines, "interpret", (HYBRID,), dict(layout=layout, devices=2))


def expect_same_ids(engines, mode, models, options):
    paths = [model_path(m) for m in models]
    env = {**os.environ, backend.ENV: mode}
    argv = [sys.executable, "-c", GREEDY, json.dumps(options), *map(str, paths)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    whole = options.get("layout") != "tensor"  # the kernels take whole pools only
    for model, path, (ids, pallas) in zip(models, paths, got, strict=True):
        assert pallas == (mode == "interpret" and "stories" not in model and whole), model
        engine = engines(path, max_seq_len=128)
        want = engine.generate([1], max_new_tokens=24, temperature=0, ignore_eos=True).token_ids
        step = next((j for j, (a, b) in enumerate(zip(ids, want, strict=True)) if a != b), None)
        if step is None:
            continue
        # The default multiplies a quantized file's weights by 8-bit activations, xla and
        # interpret by float ones: their ids may part at a near tie of the default's logits.
        assert engine.options.activations == "int8" and "q8_0" in model.lower(), (model, step)
        last = np.asarray(engine.logits([1, *want[:step]]), np.float64)[-1]  # [vocab]
        best, second = np.argsort(last)[::-1][:2]
        margin = last[best] - last[second]
        assert ids[step] == second and margin < INT8_NEAR_TIE, (
            f"{model} left the default's ids at step {step}: {ids[step]} for {want[step]}, "
            f"the default's margin {margin:.3g}"
        )


def test_every_variant_this_cpu_runs_loads():
    """An unforced variant that fails to build is skipped for the next one (kernels.status):
    here none may fail, so that a source error in one variant's code is a red test rather
    than a silent fall back to a slower variant."""
    if not kernels.available():
        pytest.skip(f"no CPU kernels here: {kernels.status().describe()}")
    failed = {v.name: why for v in build.VARIANTS if kernels.missing(v) is None
              for why in [kernels._load(v)] if why is not None}  # fmt: skip
    assert not failed, failed


def test_the_cpu_flags_decide():
    avx2 = next(v for v in build.VARIANTS if v.name == "avx2")
    if build.machine() not in avx2.machines:
        pytest.skip("not an x86 machine")
    assert kernels.missing(avx2, frozenset({"avx2", "fma", "f16c"})) is None
    assert kernels.missing(avx2, frozenset({"avx2", "fma"})) == "the CPU lacks f16c"
    scalar = next(v for v in build.VARIANTS if v.name == "scalar")
    assert kernels.missing(scalar, frozenset()) is None


def greedy(path, n, **options) -> list[int]:
    """Greedy ids from [BOS], from an engine whose decode programs call the variant in use."""
    engine = jaxinfer.load(path, max_seq_len=128, **options)
    ids = engine.generate([1], max_new_tokens=n, temperature=0, ignore_eos=True).token_ids
    variant = kernels._in_use()
    decode = [c.as_text() for c in engine.compile_cache.executables("decode")]
    assert decode and all(f"_{variant}" in text for text in decode), variant
    return ids


@pytest.mark.skipif(not kernels.runnable(), reason="no CPU kernels here")
def test_every_variant_has_its_crossovers():
    """Each variant routes products by its own measured row counts (kernels.cpu.CROSSOVERS),
    and serves() follows the variant in use: GGUF block formats at every row count, per-row
    int8 and 16-bit floats up to max_rows, float32 from 2 to float_rows rows (and at one row
    only from one_row_values)."""
    assert set(kernels.CROSSOVERS) == set(build.NAMES)
    for name in kernels.runnable():
        c = kernels.CROSSOVERS[name]
        with kernels.using(name):
            assert all(kernels.serves(m, f) for m in (1, 4096) for f in kernels.BLOCK_FORMATS)
            assert kernels.serves(c.max_rows, "int8") and not kernels.serves(c.max_rows + 1, "f16")
            assert kernels.serves(2, "f32") and kernels.serves(c.float_rows, "f32")
            assert not kernels.serves(c.float_rows + 1, "f32")
            assert kernels.serves(1, "f32", 1 << 30) == (c.one_row_values is not None), name


def variant_pairs():
    """The best variant against each other one, in the slow tier (13 s a pair here; the
    default tier's kernel tests compare every variant's products with float64 references)."""
    runnable = kernels.runnable()
    return [pytest.param(runnable[0], v, marks=pytest.mark.slow) for v in runnable[1:]]


@pytest.mark.parametrize("best, other", variant_pairs())
def test_stories_q8_0_greedy_is_the_same_under_every_variant(best, other):
    """Q8_0 products and float32 attention in each variant's kernels: the same tokens."""
    got = {}
    for variant in (best, other):
        with kernels.using(variant):
            got[variant] = greedy(model_path(STORIES_Q8), 24)
    assert len(set(map(tuple, got.values()))) == 1, got


@pytest.mark.slow
@pytest.mark.skipif(not kernels.runnable(), reason="no CPU kernels here")
@pytest.mark.parametrize(
    "model, options",
    [
        (STORIES, {}),  # float32: its golden ids
        (STORIES, {"kv_cache_dtype": "float16"}),
        ("tiny-random/qwen3_moe_e8k2_bpe/model-q8_0.gguf", {}),
        ("tiny-random/qwen3_5_l3f1_dense_mtp/model-q8_0.gguf", {}),
    ],
)
def test_greedy_is_the_same_under_every_variant(model, options):
    """stories260K (float32, and over float16 KV pools) and the tiny-random MoE and hybrid
    fixtures in Q8_0: the same greedy tokens under every variant."""
    got = {}
    for variant in kernels.runnable():
        with kernels.using(variant):
            got[variant] = tuple(greedy(model_path(model), 32, **options))
    assert len(set(got.values())) == 1, got
    if model == STORIES and not options:
        assert list(next(iter(got.values()))) == GOLDEN[:32]


CROSS = "aarch64-linux-gnu-g++"


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which(CROSS) and shutil.which("qemu-aarch64")),
                    reason="no aarch64 cross compiler or qemu-aarch64 here")  # fmt: skip
def test_neon_equals_scalar_under_qemu(tmp_path):
    """tests/kernels/variants.cc (every format's dequantized weights and products at 1-13
    rows, attention over f32, f16 and bf16 pools) built as the NEON and as the scalar variant
    for aarch64: the weights bit for bit, the sums within float32 rounding (FMA against
    multiply-then-add). Built at -O1 (gcc's -O3 took 4x as long here): the numerics are the
    source's (-ffp-contract=off), not the optimizer's."""
    builds = {}  # both at once
    for variant in ("neon", "scalar"):
        flags = next(v.flags for v in build.VARIANTS if v.name == variant)
        builds[variant] = subprocess.Popen(
            [CROSS, *build.FLAGS, *flags, "-O1", "-static", f"-I{jax.ffi.include_dir()}",
             f"-I{build.SOURCES}", str(Path(__file__).parent / "variants.cc"),
             "-o", str(tmp_path / variant)],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    out = {}
    for variant, job in builds.items():
        _, errors = job.communicate()
        assert job.returncode == 0, errors[-2000:]
        files = tmp_path / f"{variant}.exact", tmp_path / f"{variant}.sums"
        subprocess.run(["qemu-aarch64", str(tmp_path / variant), *map(str, files)], check=True)
        out[variant] = [np.fromfile(f, np.float32) for f in files]
    (neon_w, neon_y), (scalar_w, scalar_y) = out["neon"], out["scalar"]
    assert neon_w.size == scalar_w.size > 0 and neon_y.size == scalar_y.size > 0
    np.testing.assert_array_equal(neon_w.view(np.uint32), scalar_w.view(np.uint32))
    np.testing.assert_allclose(neon_y, scalar_y, rtol=1e-5, atol=1e-5 * np.abs(scalar_y).max())
