"""Bad input is refused with one line, and the engine keeps serving afterwards."""

import json
import shutil
import struct

import pytest
from support.checkpoints import TINY, random_weights, write_gguf, write_hf
from support.models import GOLDEN, model_path

import jaxinfer
from jaxinfer.cli import main


def one_line(excinfo):
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


def still_serves(engine):
    r = engine.generate([1], max_new_tokens=8, temperature=0, ignore_eos=True)
    assert r.token_ids == GOLDEN[:8]


@pytest.fixture
def hf_copy(tmp_path):
    folder = tmp_path / "stories"
    shutil.copytree(model_path("stories260K-hf-derived"), folder)
    return folder


def test_missing_path():
    with pytest.raises(jaxinfer.CheckpointError) as e:
        jaxinfer.load("/definitely/not/here")
    assert "does not exist" in one_line(e)


def test_folder_without_config(hf_copy):
    (hf_copy / "config.json").unlink()
    with pytest.raises(jaxinfer.CheckpointError) as e:
        jaxinfer.load(hf_copy)
    assert "config.json" in one_line(e)


def test_corrupt_config(hf_copy):
    (hf_copy / "config.json").write_text("{not json")
    with pytest.raises(jaxinfer.CheckpointError) as e:
        jaxinfer.load(hf_copy)
    one_line(e)


def test_corrupt_safetensors(hf_copy):
    (hf_copy / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(jaxinfer.CheckpointError) as e:
        jaxinfer.load(hf_copy)
    one_line(e)


def test_missing_tensor(tmp_path):
    config = TINY["llama"]
    weights = random_weights(config)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(jaxinfer.CheckpointError) as e:
        jaxinfer.load(write_hf(tmp_path / "m", config, weights))
    assert "model.layers.1.mlp.up_proj.weight" in one_line(e)


def test_unknown_architecture(hf_copy):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(jaxinfer.UnsupportedModelError) as e:
        jaxinfer.load(hf_copy)
    assert "gpt_neox" in one_line(e)


def test_truncated_gguf(tmp_path):
    data = model_path("stories260K-gguf/stories260K.gguf").read_bytes()
    for cut in (100, len(data) // 2, len(data) - 16):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(jaxinfer.CheckpointError) as e:
            jaxinfer.load(path)
        one_line(e)


def test_unknown_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv6")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(jaxinfer.UnsupportedModelError) as e:
        jaxinfer.load(path)
    assert "rwkv6" in one_line(e)


def test_unknown_quant_type(tmp_path):
    """A tensor stored as Q8_1 (a type with no dequantizer) is named in the refusal."""
    path = write_gguf(tmp_path / "m.gguf", TINY["llama"], random_weights(TINY["llama"]))
    data = bytearray(path.read_bytes())
    name = b"output_norm.weight"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 9)  # GGMLQuantizationType.Q8_1
    path.write_bytes(bytes(data))
    with pytest.raises(jaxinfer.UnsupportedModelError) as e:
        jaxinfer.load(path)
    assert "output_norm.weight" in one_line(e) and "Q8_1" in one_line(e)


@pytest.mark.parametrize(
    "prompt, kw, words",
    [
        ("", {}, "empty"),
        ([], {}, "empty"),
        ([1] * 600, {}, "context"),
        ([1, 99999], {}, "token ids"),
        ("Hi", {"temperature": -0.5}, "temperature"),
        ("Hi", {"top_p": 0.0}, "top_p"),
        ("Hi", {"top_p": 1.5}, "top_p"),
        ("Hi", {"top_k": -1}, "top_k"),
        ("Hi", {"min_p": 2.0}, "min_p"),
        ("Hi", {"max_new_tokens": -1}, "max_new_tokens"),
        ("Hi", {"repeat_penalty": 0.0}, "repeat_penalty"),
        ("Hi", {"stop": [""]}, "stop"),
        ("Hi", {"stop_tokens": list(range(3, 12))}, "at most 8 stop tokens"),
        ("Hi", {"stop_tokens": [2.5]}, "stop_tokens must be integers"),
        ("Hi", {"stop_tokens": [600]}, "stop_tokens must lie in [0, 512)"),
        (["Hi", ""], {}, "empty"),
    ],
)
def test_bad_requests_refused_engine_still_serves(stories_hf, prompt, kw, words):
    with pytest.raises(jaxinfer.RequestError) as e:
        stories_hf.generate(prompt, max_new_tokens=kw.pop("max_new_tokens", 4), **kw)
    assert words in one_line(e)
    still_serves(stories_hf)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(dtype="float8"), "dtype"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype 'int4'"),
        (dict(bogus=1), "unknown load option"),
        (dict(decode_chunk=0), "decode_chunk = 0"),
        (dict(stream_chunk=0), "stream_chunk = 0"),
        (dict(prefill_buckets=(0,)), "prefill_buckets"),
        (dict(prefill_buckets=()), "prefill_buckets"),
        (dict(batch_buckets=()), "batch_buckets"),
        (dict(batch_buckets=(0, 2)), "batch_buckets"),
        (dict(slots=0), "slots = 0"),
        (dict(slots=True), "slots = True"),
        (dict(kv_cache_tokens=0), "kv_cache_tokens = 0"),
        (dict(kv_cache_tokens=10**12), "the KV page pools need"),
        (dict(page_size=100), "page_size = 100"),
        (dict(compile_cache_size=0), "compile_cache_size = 0"),
        (dict(max_seq_len=1), "max_seq_len = 1"),
    ],
)
def test_bad_load_options(kw, words):
    with pytest.raises(jaxinfer.JaxinferError) as e:
        jaxinfer.load(model_path("stories260K-hf-derived"), **kw)
    assert words in one_line(e)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "-m", "/no/such/model"],
        ["info", "-m", "/no/such/model.gguf"],
        ["generate", "--temp", "-1", "-n", "2"],
        ["generate", "-p", "", "-n", "2"],
    ],
)
def test_cli_user_errors_are_one_line(capsys, argv):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ")
    assert not any("Traceback" in line for line in err)
