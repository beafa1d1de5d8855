"""Fuzzed checkpoints: every malformed GGUF or safetensors file opens and reads, or is refused
with a one-line CheckpointError, quickly and without allocating the sizes its header declares.

Seeds are a tiny random model written by tests/checkpoints.py and the real stories260K files;
the byte positions to mutate come from a GGUF walker written here with `struct`, independent
of gguf-py and of jaxinfer.
"""

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import struct
import time
import tracemalloc
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.checkpoints import TINY, random_weights, write_gguf, write_hf
from support.models import model_path

from jaxinfer.errors import CheckpointError
from jaxinfer.formats import open_checkpoint
from jaxinfer.model.transformer import abstract_model

# d_model 16, 2 layers, vocab 300; d_ff 32 makes ffn_down's rows one Q8_0 block each, so the
# tiny GGUF holds a quantized tensor beside F32 ones.
CONFIG = {
    **TINY["llama"],
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 300,
}
FUZZ = settings(
    deadline=2000,  # ms per case: a hang or a slow path over a declared size fails here
    derandomize=True,  # the same cases on every run and in CI
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HANG_S = 10  # a case still running after this long is a hang: fail it instead of waiting
# Mutated weights dequantize to inf and NaN; numpy's warnings about them are expected.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")


# ---- the property ----


@functools.cache
def parameters(cfg) -> list[tuple[tuple, tuple[int, ...]]]:
    """(path, shape) of every parameter the model builds, as the loader enumerates them."""
    state = nnx.state(abstract_model(cfg))
    return [(path, tuple(var.shape)) for path, var in nnx.to_flat_state(state)]


@contextlib.contextmanager
def no_hang(seconds: float = HANG_S):
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def opens_or_refuses(path: Path) -> CheckpointError | None:
    """Open `path` and read every tensor it holds and every parameter the model needs; only a
    one-line CheckpointError may stop that (returned). Any other exception fails the test."""
    try:
        with no_hang():
            ckpt = open_checkpoint(path)
            for name in sorted(ckpt.names):
                ckpt.read(name)
            for param, shape in parameters(ckpt.config):
                ckpt.tensor(param, shape)
    except CheckpointError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        return e
    return None


def write_case(folder: Path, name: str, data: bytes) -> Path:
    # A new inode each case: the previous case's checkpoint may still map the old file.
    tmp = folder / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, folder / name)
    return folder / name


# ---- GGUF layout, walked independently ----

SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


@dataclass
class GGUFLayout:
    slots: dict[str, list[tuple[int, int]]]  # field kind -> [(byte offset, width)]
    values: dict[str, tuple[int, int]]  # metadata key -> (offset of its value type, end)
    dims: dict[str, list[int]]  # tensor name -> offsets of its dims
    n_kv: int
    table_end: int  # end of the tensor table
    data_start: int
    alignment: int


def gguf_layout(data: bytes) -> GGUFLayout:
    """The byte positions of every count, length, type id and offset of a valid little-endian
    GGUF (v3): the fields a corrupt file gets wrong."""
    slots = defaultdict(list)
    pos = 0

    def uint(width: int, kind: str) -> int:
        nonlocal pos
        slots[kind].append((pos, width))
        pos += width
        return int.from_bytes(data[pos - width : pos], "little")

    def string(kind: str) -> bytes:
        nonlocal pos
        n = uint(8, kind)
        pos += n
        return data[pos - n : pos]

    def value(vtype: int, kind: str = "number") -> None:
        nonlocal pos
        if vtype == STRING:
            string("string length")
        elif vtype == ARRAY:
            itype = uint(4, "array item type")
            for _ in range(uint(8, "array count")):
                value(itype, "number in an array")
        else:  # mutated as an unsigned integer of the same width: any bit pattern
            uint(SCALAR_SIZE[vtype], kind)

    pos = 4  # magic
    uint(4, "version")
    n_tensors, n_kv = uint(8, "tensor count"), uint(8, "kv count")
    values, dims, alignment = {}, {}, 32
    for _ in range(n_kv):
        key = string("key length").decode()
        start = pos
        value(uint(4, "value type"))
        values[key] = (start, pos)
        if key == "general.alignment":
            alignment = int.from_bytes(data[pos - 4 : pos], "little")
    for _ in range(n_tensors):
        name = string("tensor name length").decode()
        dims[name] = [pos + 8 * i for i in range(uint(4, "n_dims"))]
        for _ in dims[name]:
            uint(8, "dim")
        uint(4, "tensor type")
        uint(8, "tensor offset")
    data_start = -(-pos // alignment) * alignment
    return GGUFLayout(dict(slots), values, dims, n_kv, pos, data_start, alignment)


def splice_value(data: bytes, layout: GGUFLayout, key: str, new: bytes | None) -> bytes:
    """The file with metadata `key`'s type and value replaced by `new` (None: the key removed),
    the tensor data kept aligned."""
    start, end = layout.values[key]
    n_kv = layout.n_kv
    if new is None:  # the whole entry goes, key string included
        start, new, n_kv = start - 8 - len(key.encode()), b"", n_kv - 1
    head = data[:16] + struct.pack("<Q", n_kv) + data[24:start] + new
    head += data[end : layout.table_end]
    return head + bytes(-len(head) % layout.alignment) + data[layout.data_start :]


def typed(vtype: int, payload: bytes) -> bytes:
    return struct.pack("<I", vtype) + payload


def gguf_str(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


# Values of the wrong type or range for any key; None removes the key.
RETYPED = {
    "absent": None,
    "string": typed(STRING, gguf_str(b"seven")),
    "empty string": typed(STRING, gguf_str(b"")),
    "invalid utf-8": typed(STRING, gguf_str(b"\xff\xfe")),
    "u32 0": typed(4, struct.pack("<I", 0)),
    "i32 -1": typed(5, struct.pack("<i", -1)),
    "u32 3": typed(4, struct.pack("<I", 3)),
    "u64 2**63": typed(10, struct.pack("<Q", 2**63)),
    "i64 -2**40": typed(11, struct.pack("<q", -(2**40))),
    "f32 nan": typed(6, struct.pack("<f", math.nan)),
    "f32 0.5": typed(6, struct.pack("<f", 0.5)),
    "f64 inf": typed(12, struct.pack("<d", math.inf)),
    "bool": typed(7, b"\x01"),
    "strings": typed(ARRAY, struct.pack("<IQ", STRING, 2) + gguf_str(b"a b") + gguf_str(b"c")),
    "u32s": typed(ARRAY, struct.pack("<IQ3I", 4, 3, 16, 16, 16)),
    "empty array": typed(ARRAY, struct.pack("<IQ", 4, 0)),
    "f32s": typed(ARRAY, struct.pack("<IQ2f", 6, 2, 0.5, math.nan)),
    "nested": typed(ARRAY, struct.pack("<IQIQI", ARRAY, 1, 4, 1, 7)),
}


def interesting(original: int, width: int) -> st.SearchStrategy[int]:
    top = 2 ** (8 * width) - 1
    special = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 36, 41, 42, 255, 2**31, top]
    special += [original - 1, original + 1, original * 2, original // 2]
    if width == 8:
        special += [2**32, 2**40, 2**50, 2**60, 2**62, 2**63]
    return st.sampled_from([v & top for v in special]) | st.integers(0, top)


# ---- seeds ----


class Seed:
    """A valid file to mutate: GGUF bytes and their layout, or a safetensors file's bytes, its
    JSON header and a folder with the rest of the model."""

    def __init__(self, data: bytes, layout=None, header=None, folder=None) -> None:
        self.data, self.layout, self.header, self.folder = data, layout, header, folder

    def __repr__(self) -> str:  # short in hypothesis' report of a failing case
        return f"Seed({len(self.data)} bytes)"


@pytest.fixture(scope="module")
def tiny_weights():
    return random_weights(CONFIG, seed=3)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def gguf_seeds(work, tiny_weights) -> dict[str, Seed]:
    tiny = write_gguf(work / "seed.gguf", CONFIG, tiny_weights, qtype="Q8_0").read_bytes()
    stories = model_path("stories260K-gguf/stories260K.gguf").read_bytes()
    seeds = {"tiny": Seed(tiny, gguf_layout(tiny)), "stories": Seed(stories, gguf_layout(stories))}
    for seed in seeds.values():  # warm the cache of parameter lists with the seed's config
        assert opens_or_refuses(write_case(work, "warm.gguf", seed.data)) is None
    return seeds


@pytest.fixture(scope="module")
def st_seeds(work, tiny_weights) -> dict[str, Seed]:
    seeds = {}
    sources = {
        "tiny": write_hf(work / "tiny-hf", CONFIG, tiny_weights),
        "stories": model_path("stories260K-hf-derived"),
    }
    for name, source in sources.items():
        folder = work / f"case-{name}"
        shutil.copytree(source, folder)
        data = (folder / "model.safetensors").read_bytes()
        (n,) = struct.unpack_from("<Q", data)
        seeds[name] = Seed(data, header=json.loads(data[8 : 8 + n]), folder=folder)
        assert opens_or_refuses(folder) is None
    return seeds


def test_seeds_load_the_weights_written(work, gguf_seeds, st_seeds, tiny_weights):
    """The harness is not vacuous: the unmutated tiny seeds hold the weights written."""
    gguf = open_checkpoint(write_case(work, "seed.gguf", gguf_seeds["tiny"].data))
    hf = open_checkpoint(st_seeds["tiny"].folder)
    for ckpt in (gguf, hf):
        assert len(parameters(ckpt.config)) == 3 + 9 * 2
        np.testing.assert_array_equal(
            ckpt.tensor(("embed",), (300, 16)), tiny_weights["model.embed_tokens.weight"]
        )
        np.testing.assert_array_equal(
            ckpt.tensor(("layers", 1, "attn", "wk"), (8, 16)),
            tiny_weights["model.layers.1.self_attn.k_proj.weight"],
        )


# ---- GGUF ----

SEEDS = st.sampled_from(["tiny", "tiny", "tiny", "stories"])  # the real file is 20x larger


@settings(FUZZ, max_examples=150)
@given(seed=SEEDS, data=st.data())
def test_gguf_truncated(work, gguf_seeds, seed, data):
    seed = gguf_seeds[seed]
    header = st.integers(0, seed.layout.data_start)  # most cuts where the structure is
    cut = data.draw(header | header | st.integers(0, len(seed.data) - 1), label="cut")
    assert opens_or_refuses(write_case(work, "case.gguf", seed.data[:cut])) is not None


@settings(FUZZ, max_examples=350)
@given(seed=SEEDS, data=st.data())
def test_gguf_header_fields(work, gguf_seeds, seed, data):
    """A count, length, type id, dim or offset of the header set to another value."""
    seed = gguf_seeds[seed]
    kind = data.draw(st.sampled_from(sorted(seed.layout.slots)), label="field")
    at, width = data.draw(st.sampled_from(seed.layout.slots[kind]), label="slot")
    original = int.from_bytes(seed.data[at : at + width], "little")
    value = data.draw(interesting(original, width), label="value")
    case = bytearray(seed.data)
    case[at : at + width] = value.to_bytes(width, "little")
    opens_or_refuses(write_case(work, "case.gguf", bytes(case)))


@settings(FUZZ, max_examples=200)
@given(seed=SEEDS, data=st.data())
def test_gguf_random_bytes(work, gguf_seeds, seed, data):
    """A few bytes overwritten, mostly in the header (magic, metadata, tensor table)."""
    seed = gguf_seeds[seed]
    where = st.integers(0, seed.layout.data_start - 1) | st.integers(0, len(seed.data) - 1)
    edits = data.draw(st.lists(st.tuples(where, st.integers(0, 255)), min_size=1, max_size=8))
    case = bytearray(seed.data)
    for at, byte in edits:
        case[at] = byte
    opens_or_refuses(write_case(work, "case.gguf", bytes(case)))


@settings(FUZZ, max_examples=200)
@given(seed=SEEDS, data=st.data())
def test_gguf_metadata_retyped(work, gguf_seeds, seed, data):
    """A metadata value replaced by one of another type or range, or removed."""
    seed = gguf_seeds[seed]
    key = data.draw(st.sampled_from(sorted(seed.layout.values)), label="key")
    new = data.draw(st.sampled_from(sorted(RETYPED)), label="value")
    case = splice_value(seed.data, seed.layout, key, RETYPED[new])
    opens_or_refuses(write_case(work, "case.gguf", case))


@settings(FUZZ, max_examples=150)
@given(seed=SEEDS, data=st.data())
def test_gguf_wrong_shapes(work, gguf_seeds, seed, data):
    """A tensor declaring another shape of its rank: a dim off by one, halved, doubled or 1,
    or the dims swapped (its data may then overlap the next tensor's, or pass the end)."""
    seed = gguf_seeds[seed]
    name = data.draw(st.sampled_from(sorted(seed.layout.dims)), label="tensor")
    at = seed.layout.dims[name]
    dims = [int.from_bytes(seed.data[i : i + 8], "little") for i in at]
    how = data.draw(st.sampled_from(["swap", "+1", "-1", "/2", "*2", "1"]), label="how")
    i = data.draw(st.integers(0, len(dims) - 1), label="dim")
    new = {"+1": dims[i] + 1, "-1": dims[i] - 1, "/2": dims[i] // 2, "*2": 2 * dims[i], "1": 1}
    dims = dims[::-1] if how == "swap" else [*dims[:i], new[how], *dims[i + 1 :]]
    case = bytearray(seed.data)
    for offset, dim in zip(at, dims, strict=True):
        case[offset : offset + 8] = dim.to_bytes(8, "little")
    opens_or_refuses(write_case(work, "case.gguf", bytes(case)))


# ---- Hugging Face ----


def with_header(seed: Seed, header: dict | bytes) -> bytes:
    (n,) = struct.unpack_from("<Q", seed.data)
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + seed.data[8 + n :]


def write_st(seed: Seed, data: bytes) -> Path:
    write_case(seed.folder, "model.safetensors", data)
    return seed.folder


CONFIG_VALUES = [None, "x", "", -1, 0, 1, 3, 2**40, 1.5, math.inf, [], [1], {}, True]
CONFIG_VALUES += [{"rope_type": "llama3"}, {"type": "yarn"}, ["full_attention"]]
DROP = "(removed)"


@pytest.fixture(scope="module")
def hf_config(work, st_seeds) -> Path:
    """A copy of the tiny HF model whose config.json the cases rewrite."""
    folder = work / "case-config"
    shutil.copytree(st_seeds["tiny"].folder, folder)
    return folder


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_hf_config_values(hf_config, data):
    """One config.json value replaced by one of another type or range, or removed; keys it
    lacks set too (head_dim, sliding_window, the expert and hybrid fields)."""
    config = dict(CONFIG)
    extra = ["head_dim", "sliding_window", "num_local_experts", "text_config", "layer_types"]
    key = data.draw(st.sampled_from(sorted(config) + extra), label="key")
    value = data.draw(st.sampled_from([DROP, *CONFIG_VALUES]), label="value")
    if value == DROP:
        config.pop(key, None)
    else:
        config[key] = value
    top = data.draw(st.sampled_from([config] * 20 + [[config], "config", 3]), label="config.json")
    write_case(hf_config, "config.json", json.dumps(top).encode())
    opens_or_refuses(hf_config)


@settings(FUZZ, max_examples=80)
@given(seed=SEEDS, data=st.data())
def test_safetensors_truncated(st_seeds, seed, data):
    seed = st_seeds[seed]
    (n,) = struct.unpack_from("<Q", seed.data)
    cut = data.draw(st.integers(0, 8 + n) | st.integers(0, len(seed.data) - 1), label="cut")
    assert opens_or_refuses(write_st(seed, seed.data[:cut])) is not None


@settings(FUZZ, max_examples=50)
@given(seed=SEEDS, data=st.data())
def test_safetensors_length_prefix(st_seeds, seed, data):
    seed = st_seeds[seed]
    (n,) = struct.unpack_from("<Q", seed.data)
    value = data.draw(interesting(n, 8) | st.sampled_from([len(seed.data), len(seed.data) - 8]))
    opens_or_refuses(write_st(seed, struct.pack("<Q", value) + seed.data[8:]))


SHAPES = st.sampled_from(
    [[], [0], [-1, 16], [2**40, 16], [2**62, 2**62], [2**64], [16, 2**40], [1.5], ["16"], None]
)
OFFSETS = st.sampled_from([[], [0], [-8, 0], [0, 2**62], [2**64, 2**64 + 4], "0", None]) | (
    st.lists(st.integers(0, 10**6), min_size=2, max_size=3)
)
DTYPES = st.sampled_from(
    ["F32", "F16", "BF16", "F64", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL"]
    + ["F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "C64", "Q8", "f32", "", 0, None]
)
BYTE_SIZES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2}
BYTE_SIZES |= {"BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1}
BYTE_SIZES |= {"F8_E5M2": 1, "F8_E8M0": 1}


@settings(FUZZ, max_examples=250)
@given(seed=SEEDS, data=st.data())
def test_safetensors_header_entries(st_seeds, seed, data):
    """One tensor entry of the JSON header with another dtype, shape or data_offsets (alone,
    or the dtype with a shape that keeps the byte size), removed, or renamed."""
    seed = st_seeds[seed]
    header = json.loads(json.dumps(seed.header))
    name = data.draw(st.sampled_from(sorted(header)), label="tensor")
    entry = header[name]
    how = data.draw(st.sampled_from(["dtype", "shape", "offsets", "resized", "drop", "rename"]))
    if how == "drop":
        del header[name]
    elif how == "rename":
        header[name + "x"] = header.pop(name)
    elif name == "__metadata__":
        header[name] = data.draw(st.sampled_from([{"format": 1}, [], "pt", None, {"a": "b"}]))
    elif how == "dtype":
        entry["dtype"] = data.draw(DTYPES)
    elif how == "shape":
        swapped = entry["shape"][::-1]
        flat = [math.prod(entry["shape"])]
        entry["shape"] = data.draw(SHAPES | st.sampled_from([swapped, flat, entry["shape"] + [1]]))
    elif how == "offsets":
        start, end = entry["data_offsets"]
        near = st.sampled_from([[end, start], [start, end + 4], [start + 4, end], [0, end - start]])
        entry["data_offsets"] = data.draw(OFFSETS | near)
    else:  # same bytes, read as another dtype: the first dim rescaled
        dtype = data.draw(st.sampled_from(sorted(BYTE_SIZES)))
        old = BYTE_SIZES[entry["dtype"]] * entry["shape"][0]
        if old % BYTE_SIZES[dtype] == 0:
            entry["dtype"] = dtype
            entry["shape"] = [old // BYTE_SIZES[dtype], *entry["shape"][1:]]
    opens_or_refuses(write_st(seed, with_header(seed, header)))


@settings(FUZZ, max_examples=100)
@given(seed=SEEDS, data=st.data())
def test_safetensors_header_bytes(st_seeds, seed, data):
    """A few bytes of the JSON header text overwritten (the length prefix kept)."""
    seed = st_seeds[seed]
    (n,) = struct.unpack_from("<Q", seed.data)
    where = st.integers(8, 8 + n - 1)
    edits = data.draw(st.lists(st.tuples(where, st.integers(0, 255)), min_size=1, max_size=4))
    case = bytearray(seed.data)
    for at, byte in edits:
        case[at] = byte
    opens_or_refuses(write_st(seed, bytes(case)))


# ---- huge declarations are refused before anything is allocated ----


def gguf_key_slot(seed: Seed, key: str, kind: str) -> int:
    """Offset of the first `kind` field inside metadata `key`'s value."""
    start, end = seed.layout.values[key]
    return next(at for at, _ in seed.layout.slots[kind] if start <= at < end)


HUGE_GGUF = {  # field kind -> (where: a metadata key, else the first such field; the value)
    "a 2**62-byte string": ("string length", "general.name", 2**62),
    "2**50 tensors": ("tensor count", None, 2**50),
    "2**50 metadata keys": ("kv count", None, 2**50),
    "2**60 token strings": ("array count", "tokenizer.ggml.tokens", 2**60),
    "2**60 token types": ("array count", "tokenizer.ggml.token_type", 2**60),
    "2**31 dims": ("n_dims", None, 2**31),
    "2**32 - 1 layers": ("number", "llama.block_count", 2**32 - 1),
    "a 2**62-byte key": ("key length", None, 2**62),
    "a 2**62-byte tensor name": ("tensor name length", None, 2**62),
}


@pytest.mark.parametrize("what", ["a 2**40-element tensor", *sorted(HUGE_GGUF)])
def test_huge_gguf_declarations_do_not_allocate(work, gguf_seeds, what):
    seed = gguf_seeds["tiny"]
    case = bytearray(seed.data)
    if what == "a 2**40-element tensor":  # token_embd [2**20, 2**20]
        edits = [(at, 8, 2**20) for at in seed.layout.dims["token_embd.weight"]]
    else:
        kind, key, value = HUGE_GGUF[what]
        at, width = seed.layout.slots[kind][0]
        edits = [(gguf_key_slot(seed, key, kind) if key else at, width, value)]
    for at, width, value in edits:
        case[at : at + width] = value.to_bytes(width, "little")
    error = assert_refused_small_and_fast(write_case(work, "huge.gguf", bytes(case)))
    if what == "a 2**40-element tensor":
        assert "token_embd.weight" in str(error)


def huge_tensor(seed: Seed, entry: dict) -> tuple[str, bytes]:
    return "model.safetensors", with_header(seed, {**seed.header, "model.norm.weight": entry})


HUGE_HF = {  # -> (file, its new bytes)
    "a 2**62-byte header": lambda seed: (
        "model.safetensors",
        struct.pack("<Q", 2**62) + seed.data[8:],
    ),
    "a 2**40-element tensor": lambda seed: huge_tensor(
        seed, {**seed.header["model.norm.weight"], "shape": [2**40]}
    ),
    "2**62 data bytes": lambda seed: huge_tensor(
        seed, {"dtype": "U8", "shape": [2**62], "data_offsets": [0, 2**62]}
    ),
    "2**40 layers": lambda seed: (
        "config.json",
        json.dumps({**CONFIG, "num_hidden_layers": 2**40}).encode(),
    ),
}


@pytest.mark.parametrize("what", sorted(HUGE_HF))
def test_huge_hf_declarations_do_not_allocate(hf_config, st_seeds, what):
    seed = st_seeds["tiny"]
    write_case(hf_config, "config.json", json.dumps(CONFIG).encode())
    write_case(hf_config, "model.safetensors", seed.data)
    write_case(hf_config, *HUGE_HF[what](seed))
    assert_refused_small_and_fast(hf_config)


def assert_refused_small_and_fast(path: Path) -> CheckpointError:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        error = opens_or_refuses(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert error is not None, "a checkpoint declaring a huge size opened"
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB allocated before refusing: {error}"
    assert time.perf_counter() - t0 < 1.0, f"refused only after {time.perf_counter() - t0} s"
    return error
