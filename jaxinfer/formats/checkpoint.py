"""Checkpoints: Hugging Face folders (config.json + safetensors) and GGUF files.

`open_checkpoint(path)` reads the config and tokenizer and returns a `Checkpoint` whose
`tensor(path)` yields one parameter at a time, already in jaxinfer's layout ([out, in],
rotate-half RoPE rows), so the loader never holds more than one weight on the host.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import HYBRID_ARCHS, ModelConfig, from_gguf, from_hf, hf_text_config
from ..errors import CheckpointError, UnsupportedModelError
from ..ops import quant
from ..ops.quant import HostQuant, NotRowOp
from .tokenizer import Tokenizer

log = logging.getLogger("jaxinfer")
ParamPath = tuple  # e.g. ("layers", 3, "attn", "wq")

# Per-layer parameter -> (HF name under model.layers.{i}., GGUF name under blk.{i}.)
LAYER_TENSORS = {
    ("attn_norm",): ("input_layernorm.weight", "attn_norm.weight"),
    ("attn", "wq"): ("self_attn.q_proj.weight", "attn_q.weight"),
    ("attn", "wgate"): ("self_attn.q_proj.weight", "attn_q.weight"),  # beside the query rows
    ("attn", "wk"): ("self_attn.k_proj.weight", "attn_k.weight"),
    ("attn", "wv"): ("self_attn.v_proj.weight", "attn_v.weight"),
    ("attn", "wo"): ("self_attn.o_proj.weight", "attn_output.weight"),
    ("attn", "bq"): ("self_attn.q_proj.bias", "attn_q.bias"),
    ("attn", "bk"): ("self_attn.k_proj.bias", "attn_k.bias"),
    ("attn", "bv"): ("self_attn.v_proj.bias", "attn_v.bias"),
    ("attn", "q_norm"): ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("attn", "k_norm"): ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("mlp_norm",): ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp", "w_gate"): ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp", "w_up"): ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp", "w_down"): ("mlp.down_proj.weight", "ffn_down.weight"),
}
GLOBAL_TENSORS = {
    ("embed",): ("model.embed_tokens.weight", "token_embd.weight"),
    ("norm",): ("model.norm.weight", "output_norm.weight"),
    ("lm_head",): ("lm_head.weight", "output.weight"),
}
# Expert block parameter -> (HF name under the block's prefix, GGUF name under blk.{i}.). The
# prefix is `mlp.` (Qwen) or `block_sparse_moe.` (Mixtral).
MOE_TENSORS = {
    ("moe", "router"): ("gate.weight", "ffn_gate_inp.weight"),
    ("moe", "shared", "w_gate"): ("shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("moe", "shared", "w_up"): ("shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    ("moe", "shared", "w_down"): ("shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
    ("moe", "shared_gate"): ("shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
}
# Stacked experts [E, ...] -> (HF per-expert name (Qwen, Mixtral), GGUF stacked name)
EXPERT_TENSORS = {
    ("moe", "w_gate"): (("gate_proj", "w1"), "ffn_gate_exps.weight"),
    ("moe", "w_up"): (("up_proj", "w3"), "ffn_up_exps.weight"),
    ("moe", "w_down"): (("down_proj", "w2"), "ffn_down_exps.weight"),
}


# Gated DeltaNet parameter -> (HF name(s) under linear_attn., GGUF name under blk.{i}.). Several
# parameters come out of one fused tensor; `_linear` says how.
LINEAR_TENSORS = {
    "wq": ("in_proj_qkv", "attn_qkv.weight"),
    "wk": ("in_proj_qkv", "attn_qkv.weight"),
    "wv": ("in_proj_qkv", "attn_qkv.weight"),
    "wz": ("in_proj_z", "attn_gate.weight"),
    "wb": ("in_proj_b", "ssm_beta.weight"),
    "wa": ("in_proj_a", "ssm_alpha.weight"),
    "conv_q": ("conv1d", "ssm_conv1d.weight"),
    "conv_k": ("conv1d", "ssm_conv1d.weight"),
    "conv_v": ("conv1d", "ssm_conv1d.weight"),
    "a": ("A_log", "ssm_a"),
    "dt_bias": ("dt_bias", "ssm_dt.bias"),
    "norm": ("norm.weight", "ssm_norm.weight"),
    "wo": ("out_proj.weight", "ssm_out.weight"),
}
# The multi-token-prediction head (Qwen3.5 / Qwen3-Next) -> (HF name, GGUF name under
# blk.{n_layers}.); its decoder layer is named like the others: HF mtp.layers.0., GGUF
# blk.{n_layers}.
MTP_TENSORS = {
    "fc": ("mtp.fc.weight", "nextn.eh_proj.weight"),
    "embed_norm": ("mtp.pre_fc_norm_embedding.weight", "nextn.enorm.weight"),
    "hidden_norm": ("mtp.pre_fc_norm_hidden.weight", "nextn.hnorm.weight"),
    "norm": ("mtp.norm.weight", "nextn.shared_head_norm.weight"),
}
# Zero-centred RMSNorms of the hybrid models: HF stores w, GGUF (and jaxinfer) 1 + w.
CENTRED_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "embed_norm", "hidden_norm")


def tensor_names(path: ParamPath, arch: str = "llama") -> tuple[str, str]:
    """(HF name, GGUF name) of a parameter path (for stacked experts: of expert 0, stacked)."""
    if path[0] != "layers":
        return GLOBAL_TENSORS[path]
    layer, key = path[1], path[2:]
    hf_block = "block_sparse_moe." if arch == "mixtral" else "mlp."
    if key in MOE_TENSORS:
        hf, gg = MOE_TENSORS[key]
        hf = hf_block + hf
    elif key in EXPERT_TENSORS:
        (qwen, mixtral), gg = EXPERT_TENSORS[key]
        hf = f"{hf_block}experts.0.{mixtral if arch == 'mixtral' else qwen}.weight"
    elif key[0] == "linear_attn":
        hf, gg = LINEAR_TENSORS[key[1]]
        hf = "linear_attn." + hf
    else:
        hf, gg = LAYER_TENSORS[key]
        if arch in HYBRID_ARCHS and key == ("mlp_norm",):
            gg = "post_attention_norm.weight"
    return f"model.layers.{layer}.{hf}", f"blk.{layer}.{gg}"


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k rows from Meta's interleaved-pair RoPE layout (GGUF `llama`) to rotate-half."""
    rows = w.shape[0]
    rest = w.shape[1:]
    w = w.reshape(n_heads, rows // n_heads // 2, 2, *rest)  # [N, H/2, 2, ...]
    return w.swapaxes(1, 2).reshape(rows, *rest)  # [N * H, ...]


@dataclass
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    format: str  # for display, e.g. "GGUF (Q8_0, F32)" or "safetensors (F32)"
    read: Callable[[str], np.ndarray]  # format-specific tensor name -> float array [out, in]
    names: set[str]  # tensor names the file holds
    gguf: bool
    prefix: str = "model."  # where a HF checkpoint keeps the language model
    # format-specific tensor name -> its block form (GGUF quantized types), or None
    blocks: Callable[[str], HostQuant | None] | None = None
    _keep: bool = field(default=False, repr=False)  # tensor(blocks=True) in progress

    def tensor(
        self, path: ParamPath, shape: tuple[int, ...], blocks: bool = False
    ) -> np.ndarray | HostQuant:
        """One parameter in jaxinfer layout, reshaped to `shape`. With `blocks`, a quantized
        tensor stays in block form (a HostQuant) when converting it only moves rows (RoPE
        row order, head splits); otherwise it is dequantized to float32."""
        if blocks and self.blocks is not None:
            self._keep = True
            try:
                return self._tensor(path, shape)
            except NotRowOp:
                pass
            finally:
                self._keep = False
        return self._tensor(path, shape)

    def _tensor(self, path: ParamPath, shape: tuple[int, ...]) -> np.ndarray | HostQuant:
        if path[0] == "mtp":  # the MTP layer reads as layer n_layers, its head on its own
            if path[1] == "layer":
                return self._tensor(("layers", self.config.n_layers, *path[2:]), shape)
            hf, gg = MTP_TENSORS[path[1]]
            name = f"blk.{self.config.n_layers}.{gg}" if self.gguf else hf
            w = self._read(name)
            return _shaped(name, w if self.gguf or path[1] == "fc" else w + 1.0, shape)
        arch = self.config.arch
        name = self._name(path)
        hybrid = arch in HYBRID_ARCHS
        if path[2:] in EXPERT_TENSORS:
            w = self._gguf_experts(name, shape) if self.gguf else self._hf_experts(path, shape)
        elif hybrid and path[2:3] == ("linear_attn",):
            w = self._linear(path[3], name)
        elif hybrid and path[2:] in (("attn", "wq"), ("attn", "wgate")):
            # q_proj rows per head: [query (H), gate (H)]
            N, H, D = self.config.n_heads, self.config.head_dim, self.config.d_model
            w = _shaped(name, self._read(name), (N, 2, H, D))
            w = w[:, 0 if path[-1] == "wq" else 1].reshape(N * H, D)
        else:
            w = self._read(name)
        if hybrid and not self.gguf and (path[-1] in CENTRED_NORMS or path == ("norm",)):
            w = w + 1.0
        if self.gguf and arch in ("llama", "mixtral") and path[-1] in ("wq", "wk", "bq", "bk"):
            heads = self.config.n_heads if path[-1] in ("wq", "bq") else self.config.n_kv_heads
            # shaped first: rows of the wrong count cannot be regrouped into heads
            w = interleaved_to_half(_shaped(name, w, shape), heads)
        return _shaped(name, w, shape)

    def _name(self, path: ParamPath) -> str:
        name = tensor_names(path, self.config.arch)[1 if self.gguf else 0]
        mtp = f"model.layers.{self.config.n_layers}."
        if not self.gguf and name.startswith(mtp):  # the MTP layer
            return "mtp.layers.0." + name.removeprefix(mtp)
        if not self.gguf and name.startswith("model."):
            name = self.prefix + name.removeprefix("model.")
        return name

    def _linear(self, key: str, name: str) -> np.ndarray:
        """A Gated DeltaNet parameter in jaxinfer's order: V heads grouped by key head, as HF
        stores them. Qwen3.5 GGUFs store V heads tiled (head r * HK + k for HF's k * R + r),
        which is undone here on the rows (on `wo`, the columns) of each V-head parameter."""
        cfg = self.config
        HK, HV, DV = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_v_dim
        w = self._linear_raw(key, name)
        # rows (on wo, columns) per V head of the parameters whose heads a GGUF tiles
        per_head = dict(wv=DV, wz=DV, conv_v=DV, wo=DV, wb=1, wa=1, a=1, dt_bias=1)
        if not self.gguf or cfg.arch == "qwen3_next" or key not in per_head:
            return w
        rows = w.T if key == "wo" else w  # wo [D, HV * DV]: V heads on the columns
        R, n = HV // HK, per_head[key]
        rows = rows.reshape(R, HK, n, *rows.shape[1:]).swapaxes(0, 1).reshape(rows.shape)
        return rows.T if key == "wo" else rows

    def _linear_raw(self, key: str, name: str) -> np.ndarray:
        """A Gated DeltaNet parameter as the file orders its heads, out of the fused tensors:
        [q | k | v] (in_proj_qkv, attn_qkv, the conv), Qwen3-Next HF's in_proj_qkvz grouped per
        key head [q | k | v | z], and in_proj_ba / ssm_ba grouped per key head [b | a];
        `a` = -exp(A_log) for HF."""
        cfg = self.config
        HK, HV, DK, DV = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
        R, KD, D = HV // HK, HK * DK, cfg.d_model
        base = name.rpartition("linear_attn.")[0] + "linear_attn."  # HF names
        next_hf = cfg.arch == "qwen3_next" and not self.gguf
        if key in ("wq", "wk", "wv", "wz") and next_hf:
            fused = f"{base}in_proj_qkvz.weight"
            w = _shaped(fused, self._read(fused), (HK, 2 * DK + 2 * R * DV, D))
            cuts = {"wq": 0, "wk": DK, "wv": 2 * DK, "wz": 2 * DK + R * DV}
            width = DK if key in ("wq", "wk") else R * DV
            return w[:, cuts[key] : cuts[key] + width].reshape(-1, D)
        if key in ("wb", "wa") and cfg.arch == "qwen3_next":
            fused = (
                f"{base}in_proj_ba.weight"
                if not self.gguf
                else name.replace("ssm_beta" if key == "wb" else "ssm_alpha", "ssm_ba")
            )
            w = _shaped(fused, self._read(fused), (HK, 2 * R, D))
            return (w[:, :R] if key == "wb" else w[:, R:]).reshape(HV, D)
        if key in ("wq", "wk", "wv", "conv_q", "conv_k", "conv_v"):
            fused = name if self.gguf else name + ".weight"
            w = self._read(fused)
            w = w.reshape(w.shape[0], -1)  # HF conv1d [C, 1, K] -> [C, K]
            conv = key.startswith("conv")
            want = (2 * KD + HV * DV, cfg.conv_kernel if conv else D)
            if w.shape != want:
                taps = f" and a {cfg.conv_kernel}-tap conv" if conv else ""
                raise CheckpointError(
                    f"tensor {fused!r} has shape {list(w.shape)} but the config's {HK} key heads "
                    f"x {DK} and {HV} value heads x {DV}{taps} imply {list(want)}; does the "
                    "config match the weights?"
                )
            return {"q": w[:KD], "k": w[KD : 2 * KD], "v": w[2 * KD :]}[key[-1]]
        if key == "a" and not self.gguf:
            # in float64, then rounded: float32 exp is an ulp off on some values
            return (-np.exp(self._read(f"{base}A_log").astype(np.float64))).astype(np.float32)
        return self._read(name + (".weight" if not self.gguf and key in ("wz", "wb", "wa") else ""))

    def _read(self, name: str) -> np.ndarray | HostQuant:
        if name not in self.names:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}; is the file complete?")
        kept = self.blocks(name) if self._keep and self.blocks else None
        return self.read(name) if kept is None else kept

    def _gguf_experts(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        w = self._read(name)  # [E, ...] already stacked
        if w.ndim != 3 or w.shape[0] != shape[0]:
            raise CheckpointError(
                f"tensor {name!r} holds {w.shape[0] if w.ndim == 3 else 'no'} experts "
                f"(shape {list(w.shape)}); the metadata declares {shape[0]}"
            )
        return w

    def _hf_experts(self, path: ParamPath, shape: tuple[int, ...]) -> np.ndarray:
        """Per-expert tensors stacked into [E, ...] one expert at a time, or the fused
        `experts.gate_up_proj [E, 2F, D]` / `experts.down_proj [E, D, F]` form."""
        first = self._name(path)
        prefix, _, leaf = first.partition("experts.0.")
        if first not in self.names:
            fused = prefix + (
                "experts.down_proj" if path[-1] == "w_down" else "experts.gate_up_proj"
            )
            if fused not in self.names:
                raise CheckpointError(f"checkpoint lacks tensor {first!r} (and {fused!r})")
            w = self.read(fused)
            if path[-1] != "w_down":  # gate rows first, then up (as vLLM and llama.cpp split)
                E, F, D = shape
                w = _shaped(fused, w, (E, 2, F, D))[:, 0 if path[-1] == "w_gate" else 1]
            return w
        extra = f"{prefix}experts.{shape[0]}.{leaf}"
        if extra in self.names:
            raise CheckpointError(
                f"checkpoint holds {extra!r}: more experts than the {shape[0]} config.json declares"
            )
        out = np.empty(shape, np.float32)
        for e in range(shape[0]):
            name = f"{prefix}experts.{e}.{leaf}"
            out[e] = _shaped(name, self._read(name), shape[1:])
        return out


def _shaped(name: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if w.size != math.prod(shape):  # exact: np.prod wraps around on a corrupt, huge shape
        raise CheckpointError(
            f"tensor {name!r} has shape {list(w.shape)}, the config implies {list(shape)}"
        )
    return w.reshape(shape)


def open_checkpoint(path: str | Path) -> Checkpoint:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"model path {str(p)!r} does not exist; pass a folder or a .gguf")
    if p.is_dir():
        return _open_hf(p)
    if p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
        return _open_gguf(p)
    raise CheckpointError(
        f"{str(p)!r} is neither a Hugging Face folder nor a GGUF file; pass one of those"
    )


def _has_gguf_magic(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


# GGUF metadata value types: the byte size of each scalar type; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4


def _check_gguf(file: Path) -> None:
    """Walk a GGUF header with `struct` before gguf-py's reader does: the reader trusts every
    count it reads (an array of 2**60 numbers loops it for ever) and maps tensors larger than
    the file without a word. Raises a one-line CheckpointError naming the first bad field
    (UnsupportedModelError for a tensor type id unknown to gguf-py)."""
    import gguf

    size = file.stat().st_size
    where = f"GGUF file {str(file)!r}"

    def corrupt(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}; the file is corrupt or truncated")

    if size < 24:
        raise corrupt(f"{size} bytes is shorter than a GGUF header")
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise CheckpointError(f"{where} does not start with 'GGUF'; is it a GGUF file?")
        # a version whose low half is zero: a big-endian file, which gguf-py reads too
        order = "<" if int.from_bytes(data[4:8], "little") & 0xFFFF else ">"
        (version,) = struct.unpack_from(order + "I", data, 4)
        if version not in (2, 3):
            raise corrupt(f"GGUF version {version} (jaxinfer reads versions 2 and 3)")
        pos = 24

        def take(fmt: str, what: str) -> tuple:
            nonlocal pos
            n = struct.calcsize(order + fmt)
            if pos + n > size:
                raise corrupt(f"the file ends inside {what}")
            pos += n
            return struct.unpack_from(order + fmt, data, pos - n)

        def skip(n: int, what: str) -> None:
            nonlocal pos
            if n > size - pos:
                raise corrupt(f"{what} declares {_human(n)} but {_human(size - pos)} remain")
            pos += n

        def string(what: str) -> bytes:
            (n,) = take("Q", what)
            skip(n, what)
            return data[pos - n : pos]

        def shown(text: bytes) -> str:  # quoted, escaped and cut: it may be garbage
            return repr(text[:80].decode("utf-8", "replace"))

        def value(vtype: int, what: str) -> None:
            if vtype in _GGUF_SCALARS:
                skip(_GGUF_SCALARS[vtype], what)
            elif vtype == _GGUF_STRING:
                string(what)
            elif vtype != _GGUF_ARRAY:
                raise corrupt(f"{what} has unknown value type {vtype}")
            else:
                itype, count = take("IQ", what)
                if itype in _GGUF_SCALARS:
                    skip(count * _GGUF_SCALARS[itype], f"{what} ({count} values)")
                elif itype == _GGUF_STRING:
                    if count * 8 > size - pos:  # their lengths alone would not fit
                        raise corrupt(f"{what} declares {count} strings")
                    for _ in range(count):
                        string(what)
                else:  # llama.cpp refuses arrays of arrays too
                    raise corrupt(f"{what} is an array of value type {itype}")

        n_tensors, n_kv = struct.unpack_from(order + "QQ", data, 8)
        # each metadata entry takes at least 13 bytes, each tensor's entry 28
        if 13 * n_kv + 28 * n_tensors > size:
            raise corrupt(
                f"the header declares {n_kv} metadata entries and {n_tensors} tensors, more "
                f"than its {_human(size)} can hold"
            )
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = string(f"the key of metadata entry {i}")
            (vtype,) = take("I", f"metadata {shown(key)}")
            start = pos
            value(vtype, f"metadata {shown(key)}")
            if key == b"general.alignment":
                alignment = int.from_bytes(data[start:pos], "little" if order == "<" else "big")
                if vtype != _GGUF_UINT32 or alignment & (alignment - 1) or not alignment:
                    raise corrupt("general.alignment is not a power of two (uint32)")
        table = []
        for i in range(n_tensors):
            name = shown(string(f"the name of tensor {i}"))
            (n_dims,) = take("I", f"tensor {name}")
            if not 1 <= n_dims <= 4:
                raise corrupt(f"tensor {name} has {n_dims} dims; GGUF tensors have 1 to 4")
            dims = take(f"{n_dims}Q", f"tensor {name}")
            table.append((name, dims, *take("IQ", f"tensor {name}")))
    start = -(-pos // alignment) * alignment  # the tensor data follows the table, aligned
    known = {t.value for t in gguf.GGMLQuantizationType}
    for name, dims, type_id, offset in table:
        if type_id not in known:
            raise UnsupportedModelError(
                f"{where}: tensor {name} has unknown GGUF type id {type_id}; the file is "
                "corrupt or newer than jaxinfer's gguf library"
            )
        qtype = gguf.GGMLQuantizationType(type_id)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if min(dims) == 0 or dims[0] % block:
            raise corrupt(
                f"tensor {name} has dims {list(dims)}: empty, or rows that are not whole "
                f"{qtype.name} blocks of {block}"
            )
        if offset % alignment:
            raise corrupt(f"tensor {name} starts at data offset {offset}, not {alignment}-aligned")
        n_bytes = math.prod(dims) // block * block_bytes
        if start + offset + n_bytes > size:
            raise corrupt(
                f"tensor {name} declares {math.prod(dims)} elements ({_human(n_bytes)} of "
                f"{qtype.name}) at data offset {offset}, past the end of the file "
                f"({_human(size)})"
            )


def _human(n: int) -> str:
    """A size in bytes for messages: 840 bytes, 1.131 MiB, 4 TiB."""
    k = min(max(n.bit_length() - 1, 0) // 10, 6)  # 1024**k <= n
    return f"{n} bytes" if not k else f"{n / 1024**k:.4g} {'KMGTPE'[k - 1]}iB"


def _open_hf(folder: Path) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(folder)!r} has no config.json; is it a Hugging Face model?")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file} is not a JSON object; fix or re-download it")
    text, multimodal = hf_text_config(raw)
    config = from_hf(text)

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed ({e!r})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f.name for f in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{str(folder)!r} holds no *.safetensors weights")
    handles = {}
    owner = {}
    for name in files:
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"shard {name!r} named in the index is missing from {folder}")
        try:
            handles[name] = safe_open(str(f), framework="numpy")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f} is not a readable safetensors file ({e})") from None
        for key in handles[name].keys():
            owner[key] = name
    dtypes = sorted({str(handles[owner[k]].get_slice(k).get_dtype()) for k in owner})
    prefix = "model.language_model." if multimodal else "model."
    # Checked now: a corrupt count would build a model of billions of layers before any
    # tensor is found missing.
    ids = {k[len(prefix) :].split(".")[1] for k in owner if k.startswith(prefix + "layers.")}
    if sum(i.isascii() and i.isdigit() and int(i) < config.n_layers for i in ids) < config.n_layers:
        raise CheckpointError(
            f"config.json declares {config.n_layers} layers but the weights hold {len(ids)} "
            f"({prefix}layers.N); fix config.json or the weights"
        )
    skipped = sorted(k for k in owner if not k.startswith((prefix, "lm_head.", "mtp.")))
    note = f"; {len(skipped)} vision tower tensors skipped" if multimodal and skipped else ""

    def read(name: str) -> np.ndarray:
        dtype = handles[owner[name]].get_slice(name).get_dtype()
        if dtype not in ("F32", "F16", "BF16", "F64"):  # FP8, int8/4-bit (quantized), complex
            raise UnsupportedModelError(
                f"tensor {name!r} is stored as {dtype}; jaxinfer reads F32, F16, BF16 and F64 "
                "safetensors weights, not quantized ones"
            )
        try:
            w = handles[owner[name]].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"cannot read tensor {name!r} ({e})") from None
        return np.asarray(w, dtype=np.float32)

    if not config.mtp_layers and "mtp.fc.weight" in owner:  # Qwen3-Next configs omit the count
        mtp = {k.split(".")[2] for k in owner if k.startswith("mtp.layers.")}
        config = dataclasses.replace(config, mtp_layers=len(mtp))
    return Checkpoint(
        config=config,
        tokenizer=Tokenizer.from_hf_dir(folder),
        format=f"safetensors ({', '.join(dtypes)}){note}",
        read=read,
        names=set(owner),
        gguf=False,
        prefix=prefix,
    )


def _open_gguf(file: Path) -> Checkpoint:
    import gguf
    from gguf.quants import dequantize

    _check_gguf(file)
    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:  # what the walk leaves to it: duplicate names, invalid UTF-8...
        why = " ".join(f"{type(e).__name__}: {e}".split())
        raise CheckpointError(
            f"{str(file)!r} is not a readable GGUF file ({why}); is it truncated?"
        ) from None
    meta = {}
    for key, entry in reader.fields.items():
        try:
            meta[key] = entry.contents()
        except Exception:  # a field the reader cannot decode is not one we need
            continue
    tensors = {t.name: t for t in reader.tensors}
    config = from_gguf(meta, set(tensors))
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(tensors["rope_freqs.weight"].data, np.float32).ravel()
        config = config.replace(rope_factors=tuple(float(x) for x in factors))

    supported = set(gguf.quants._type_traits) | {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
    }
    for t in reader.tensors:
        if t.tensor_type not in supported:
            raise UnsupportedModelError(
                f"tensor {t.name!r} has GGUF type {t.tensor_type.name}, which jaxinfer cannot "
                "dequantize; re-quantize to Q8_0, Q4_K or F16"
            )

    def release(t) -> None:
        """Drop the mapped file pages of a tensor that has been copied out: they would
        otherwise stay in the process's memory (RSS) for the whole load."""
        mapped = getattr(reader.data, "_mmap", None)
        if mapped is not None and hasattr(mapped, "madvise"):
            start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
            mapped.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            w = np.array(dequantize(t.data, t.tensor_type), np.float32)  # a copy
        except (NotImplementedError, ValueError) as e:
            raise UnsupportedModelError(
                f"cannot dequantize {name!r} ({t.tensor_type.name}): {e}"
            ) from None
        release(t)
        return w

    def blocks(name: str) -> HostQuant | None:
        t = tensors[name]
        fmt = quant.GGML_FORMATS.get(t.tensor_type.name)
        if fmt is None or len(t.shape) < 2 or int(t.shape[0]) % fmt.block:
            return None
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF ne [in, out, ...]
        try:
            kept = quant.from_gguf(fmt.ggml, np.array(t.data), shape)  # a copy
        except ValueError as e:
            raise CheckpointError(f"tensor {name!r} has malformed {fmt.ggml} data ({e})") from None
        release(t)
        return kept

    types = sorted({t.tensor_type.name for t in reader.tensors})
    unkept = sorted(set(types) - set(quant.GGML_FORMATS) - {"F32"})
    if unkept:
        log.warning(
            "%s: %s tensors are dequantized to float at load (kept compressed: %s)",
            file.name, ", ".join(unkept), ", ".join(sorted(quant.GGML_FORMATS)),
        )  # fmt: skip
    return Checkpoint(
        config=config,
        tokenizer=Tokenizer.from_gguf(reader),
        format=f"GGUF ({', '.join(types)})",
        read=read,
        names=set(tensors),
        gguf=True,
        blocks=blocks,
    )
