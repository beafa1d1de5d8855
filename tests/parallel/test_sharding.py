"""Layouts: every layout gives the single-device tokens and logits; layer split is one
pipelined program with each device holding only its stage; bad layouts are refused."""

import jax
import numpy as np
import pytest
from support.checkpoints import TINY, random_weights, write_hf
from support.compiles import CompileCounter
from support.models import F32_LOGITS_ATOL, GOLDEN, model_path

import jaxinfer
from jaxinfer.ops.quant import QArray

LAYOUTS = [
    ("layer", 2), ("layer", 3), ("layer", 4), ("tensor", 2), ("tensor", 4),
    ("layer-tensor", 4), ("layer-tensor", 8),
]  # fmt: skip
FAST = [("layer", 2)]  # a pipeline; the rest (the tensor split too: 12 s here): slow
# One set of shapes for every stories260K engine here, so that engines share compiled programs
# (the session's executable store) and the strict tests' plans stay small.
OPTS = dict(max_seq_len=128, prefill_buckets=(16,), batch_buckets=(1, 2))
STORIES = "stories260K-gguf/stories260K.gguf"


def tiered(layouts):
    return [x if x in FAST else pytest.param(*x, marks=pytest.mark.slow) for x in layouts]


CUSTOM = """# four pipeline stages, nothing else split
[mesh]
pp = 4

[rules]
layers = "pp"
"""
PROMPTS = ["Once upon a time", "The dog ran", [1, 203, 207]]


@pytest.fixture(scope="module")
def custom_layout(tmp_path_factory):
    path = tmp_path_factory.mktemp("layouts") / "four-stages.toml"
    path.write_text(CUSTOM)
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    config = dict(TINY["qwen3"], num_hidden_layers=5)
    return write_hf(tmp_path_factory.mktemp("qwen3"), config, random_weights(config, seed=3))


def run_all(engine):
    single = engine.generate([1], max_new_tokens=40, temperature=0, ignore_eos=True).token_ids
    batch = [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=10, temperature=0)]
    return single, batch, engine.logits([1, 5, 9, 33, 17, 250, 2, 77])


@pytest.fixture(scope="module")
def reference(engines):
    return run_all(engines(model_path(STORIES), **OPTS))


@pytest.mark.parametrize(
    "layout, devices", [*tiered(LAYOUTS), pytest.param("custom", None, marks=pytest.mark.slow)]
)
def test_stories_same_tokens_under_every_layout(reference, custom_layout, engines, layout, devices):
    spec = custom_layout if layout == "custom" else layout
    engine = engines(model_path(STORIES), layout=spec, devices=devices, **OPTS)
    single, batch, logits = run_all(engine)
    ref_single, ref_batch, ref_logits = reference
    assert single == ref_single == GOLDEN[:40]
    assert batch == ref_batch
    np.testing.assert_allclose(logits, ref_logits, atol=F32_LOGITS_ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout, devices", LAYOUTS)
def test_qwen3_same_tokens_under_every_layout(qwen3_dir, engines, layout, devices):
    """Qwen3's q/k norms and explicit head_dim split like the rest."""
    ref = run_all(engines(qwen3_dir, **OPTS))
    single, batch, logits = run_all(engines(qwen3_dir, layout=layout, devices=devices, **OPTS))
    assert single == ref[0] and batch == ref[1], (layout, devices)
    np.testing.assert_allclose(logits, ref[2], atol=F32_LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize(
    "layout, devices", [("layer", 2), pytest.param("tensor", 2, marks=pytest.mark.slow)]
)
def test_steady_decoding_compiles_nothing(layout, devices):
    engine = jaxinfer.load(
        model_path(STORIES), layout=layout, devices=devices, strict=True, **OPTS
    )  # its own: strict mode after warmup
    engine.warmup(progress=False)
    with CompileCounter() as seen:
        r = engine.generate([1], max_new_tokens=100, temperature=0, ignore_eos=True)
        engine.generate(["Once upon", "a dog"], max_new_tokens=30, temperature=0.8, seed=4)
    assert seen.n == 0 and r.token_ids[:64] == GOLDEN[:64]
    assert engine.perf_stats().graphs_reused >= 7


def weight(w):
    """A float32 weight's array (placed for the CPU kernel, it is an "f32" QArray)."""
    return w.parts["w"] if isinstance(w, QArray) else w


def test_pipeline_is_one_program_and_devices_hold_their_stage(engines):
    path = model_path(STORIES)
    dense = engines(path, shared_layers=False, **OPTS)  # one array per layer and weight
    engine = engines(path, layout="layer", devices=3, **OPTS)
    engine.generate([1], max_new_tokens=20, temperature=0)
    (decode,) = engine.compile_cache.executables("decode")  # one serves every decode call
    assert "collective-permute" in decode.as_text()
    assert engine.runner.stages == 3
    # 5 layers on 3 stages: [0, 1], [2, 3], [4, padding]; the two stage layers share one
    # traced body, their weights stacked [pp, 2, ...]
    layer_of = [[0, 1], [2, 3], [4, None]]
    [[unit]] = engine.params["runs"]
    wq = weight(unit["attn"]["wq"])
    assert wq.shape[:2] == (3, 2) and len(wq.addressable_shards) == 3
    for shard in wq.addressable_shards:
        assert shard.data.shape == (1, *wq.shape[1:])  # one stage's layers per device
        stage = shard.index[0].start or 0
        assert shard.device == engine.mesh.devices.flat[stage]
        for j, layer in enumerate(layer_of[stage]):
            want = 0 if layer is None else weight(dense.params["layers"][layer]["attn"]["wq"])
            np.testing.assert_array_equal(np.asarray(shard.data[0, j]), np.asarray(want))


@pytest.mark.slow
def test_reshard_keeps_tokens_and_reports_sharding_changes():
    # its own (it is resharded), without an executable store: its recompiles are watched
    engine = jaxinfer.load(model_path(STORIES), **OPTS, compile_cache_dir=None)
    before = engine.generate([1], max_new_tokens=30, temperature=0).token_ids
    events = []
    engine.on_recompile(events.append)
    engine.reshard("layer", devices=2)
    assert engine.layout == "layer" and dict(engine.mesh.shape) == {"pp": 2}
    assert engine.generate([1], max_new_tokens=30, temperature=0).token_ids == before
    assert events and all(e.sharding_changed for e in events)
    assert all(e.stages == 2 for e in events)  # the programs now span two pipeline stages
    assert "layout changed: single" in events[0].reason
    stats = engine.perf_stats()
    assert (stats.recompiles_same, stats.recompiles_diff) == (0, 0)
    assert stats.recompiles_sharding == len(events)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(layout="layer", devices=8), "5 layers"),
        (dict(layout="tensor", devices=3), "n_heads (8) divisible by tp (3)"),
        (dict(layout="single", devices=9), "9 devices requested but 8 exist"),
        (dict(layout="no-such-layout"), "neither a built-in"),
    ],
)
def test_layouts_that_do_not_fit_are_refused(kw, words):
    with pytest.raises(jaxinfer.LayoutError) as e:
        jaxinfer.load(model_path("stories260K-gguf/stories260K.gguf"), **kw)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, words",
    [
        ('[mesh]\npp = 2\n[rules]\nlayerz = "pp"\n', "unknown logical axis 'layerz'"),
        ('[mesh]\npp = 2\n[rules]\nlayers = "xx"\n', "names no mesh axis"),
        ("[mesh]\npp = -1\ntp = -1\n", "only one mesh axis may be -1"),
        ("[mesh\n", "not valid TOML"),
    ],
)
def test_bad_layout_files_are_refused(tmp_path, text, words):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(jaxinfer.LayoutError) as e:
        jaxinfer.load(None, layout=path)
    assert words in str(e.value)


def test_cli_prints_the_plan(capsys):
    from jaxinfer.cli import main

    path = str(model_path("stories260K-gguf/stories260K.gguf"))
    assert main(["info", "-m", path, "--layout", "layer", "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "mesh pp=2" in out and "stage 0: layers 0-2; stage 1: layers 3-4" in out
    assert "runs.0.0.attn.wq: [2, 3, 64, 64] P('pp', None, None, None)" in out


def test_devices_list_and_count_select_devices():
    from jaxinfer.parallel.sharding import select_devices

    assert select_devices(2) == jax.devices()[:2]
    assert select_devices(jax.devices()[3:5]) == jax.devices()[3:5]
    with pytest.raises(jaxinfer.LayoutError):  # `--devices 1,2` on generate: numbers, not devices
        select_devices((1, 2))
