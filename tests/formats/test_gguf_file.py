"""formats/gguf_file.py, the GGUF container reader, against gguf-py's GGUFReader (the reference):
the same metadata values and the same tensors, byte for byte, on the fixtures; and open_gguf's
refusal of block types it does not keep compressed, and the engine's memory figures."""

from pathlib import Path

import gguf
import numpy as np
import pytest
from support.models import STORIES, model_path

import jaxinfer
from jaxinfer.errors import UnsupportedModelError
from jaxinfer.formats import gguf_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FILES = [
    STORIES,
    "tiny-random/qwen3_5_moe_l3f1_e8k2_mtp/model-q8_0.gguf",
    FIXTURES / "llama_cpp_int8" / "model-Q4_K_M.gguf",
]


@pytest.mark.parametrize("name", FILES, ids=lambda f: Path(f).name)
def test_reads_what_gguf_py_reads(name):
    path = Path(name) if Path(name).is_absolute() else model_path(name)
    ours, theirs = gguf_file.read(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its own
    assert list(ours.fields) == list(fields)
    for key, field in fields.items():
        assert gguf_file.text(ours.fields[key]) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == [int(n) for n in b.shape]
        assert (a.data_offset, a.n_bytes) == (int(b.data_offset), int(b.n_bytes)), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name


def test_block_types_not_kept_compressed_are_refused_in_one_line(tmp_path):
    """A Q3_K tensor (a Q3_K_M file's) is neither widened to float nor half read: the load
    stops with one line naming the tensor and its type."""
    path = tmp_path / "q3k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q3_K]
    raw = np.zeros((4, 256 // block * size), np.uint8)
    w.add_tensor("blk.0.ffn_down.weight", raw, raw_shape=raw.shape,
                 raw_dtype=gguf.GGMLQuantizationType.Q3_K)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        jaxinfer.load(path)
    message = str(e.value)
    assert "\n" not in message and "'blk.0.ffn_down.weight'" in message and "Q3_K" in message


def test_memory_adds_up():
    """Engine.memory(): weights as weight_bytes(), the KV pool as kv_stats(), temporaries
    from the compiled programs (none before a warmup of a fresh engine), a total of the rest."""
    engine = jaxinfer.load(model_path(STORIES), max_seq_len=128, compile_cache_dir=None,
                           batch_buckets=(1,), prefill_buckets=(16,))  # fmt: skip
    before = engine.memory()
    assert before["temporaries"] is None and before["programs"] == 0
    engine.warmup(progress=False)
    m = engine.memory()
    assert m["programs"] == len(engine.compile_plan())
    assert (
        m["weights"] == engine.weight_bytes()
        and m["kv_pool"] == engine.kv_stats()["bytes_allocated"]
    )
    assert 0 < m["temporaries"] < m["weights"] + m["kv_pool"]
    parts = ("weights", "kv_pool", "linear_state", "snapshots", "temporaries")
    assert m["total"] == sum(m[k] for k in parts)
