"""Checkpoints: Hugging Face folders (config.json + safetensors) and GGUF files.

`open_checkpoint(path)` reads the config and tokenizer and returns a `Checkpoint` whose
`tensor(path)` yields one parameter at a time, already in jaxinfer's layout ([out, in],
rotate-half RoPE rows), so the loader never holds more than one weight on the host.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import HYBRID_ARCHS, ModelConfig, from_gguf, from_hf, hf_text_config
from .errors import CheckpointError, UnsupportedModelError
from .tokenizer import Tokenizer

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

    def tensor(self, path: ParamPath, shape: tuple[int, ...]) -> np.ndarray:
        """One parameter in jaxinfer layout, reshaped to `shape`."""
        if path[0] == "mtp":  # the MTP layer reads as layer n_layers, its head on its own
            if path[1] == "layer":
                return self.tensor(("layers", self.config.n_layers, *path[2:]), shape)
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
            w = interleaved_to_half(w, heads)
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

    def _read(self, name: str) -> np.ndarray:
        if name not in self.names:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}; is the file complete?")
        return self.read(name)

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
    if w.size != int(np.prod(shape)):
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


def _open_hf(folder: Path) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(folder)!r} has no config.json; is it a Hugging Face model?")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e})") from None
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
    skipped = sorted(k for k in owner if not k.startswith((prefix, "lm_head.", "mtp.")))
    note = f"; {len(skipped)} vision tower tensors skipped" if multimodal and skipped else ""

    def read(name: str) -> np.ndarray:
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

    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors...
        raise CheckpointError(
            f"{str(file)!r} is not a readable GGUF file ({type(e).__name__}: {e}); is it truncated?"
        ) from None
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
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

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            return np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        except (NotImplementedError, ValueError) as e:
            raise UnsupportedModelError(
                f"cannot dequantize {name!r} ({t.tensor_type.name}): {e}"
            ) from None

    types = sorted({t.tensor_type.name for t in reader.tensors})
    return Checkpoint(
        config=config,
        tokenizer=Tokenizer.from_gguf(reader),
        format=f"GGUF ({', '.join(types)})",
        read=read,
        names=set(tensors),
        gguf=True,
    )
