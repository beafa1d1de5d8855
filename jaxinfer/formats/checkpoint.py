"""The Checkpoint: one parameter at a time, already in jaxinfer's layout.

A format module (`hf.py`, `gguf.py`) opens the files and names the tensors; `Checkpoint.tensor`
turns the named tensor into the parameter ([out, in], rotate-half RoPE rows, 1 + w norms) by
the family's row conversion in `CONVERSIONS`, so the loader never holds more than one weight on
the host and a new family's quirks are rows of one table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import overload

import numpy as np

from ..config import ARCHS, HYBRID_ARCHS, ModelConfig
from ..errors import CheckpointError
from ..ops.quant import HostQuant, NotRowOp
from .tokenizer import Tokenizer

ParamPath = tuple  # e.g. ("layers", 3, "attn", "wq")
Tensor = np.ndarray | HostQuant


def param_key(path: ParamPath) -> str:
    """The name tables' and CONVERSIONS' key of a parameter: its path without the layer index,
    dotted ("attn.wq", "linear_attn.wv", "moe.w_up", "norm", "mtp.fc")."""
    return ".".join(path[2:] if path[0] == "layers" else path)


@dataclass
class Checkpoint:
    config: ModelConfig
    tokenizer: Tokenizer
    kind: str  # "hf" or "gguf": the format column of CONVERSIONS
    format: str  # for display, e.g. "GGUF (Q8_0, F32)" or "safetensors (F32)"
    read: Callable[[str], np.ndarray]  # the file's tensor name -> float32 array
    names: set[str]  # tensor names the file holds
    # parameter path -> the file's tensor name; for stacked experts the tensor holding all of
    # them, and with an expert index appended (HF) the tensor of that expert
    name: Callable[[ParamPath], str]
    # the file's tensor name -> its block form (GGUF quantized types), or None
    blocks: Callable[[str], HostQuant | None] | None = None
    # the file's mapped pages out of resident memory (once the weights are placed: tensors
    # read as views of the file, copied on several threads, stay resident until then)
    release: Callable[[], None] | None = None
    # the file's tensor name -> the type it is stored in (GGUF's "Q4_K", "F32", ...), or None
    types: Callable[[str], str] | None = None
    _keep: bool = field(default=False, repr=False)  # tensor(blocks=True) in progress

    def tensor(self, path: ParamPath, shape: tuple[int, ...], blocks: bool = False) -> Tensor:
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

    def _tensor(self, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
        if path[:2] == ("mtp", "layer"):  # the MTP layer reads as layer n_layers
            path = ("layers", self.config.n_layers, *path[2:])
        convert = CONVERSIONS.get((self.config.arch, self.kind, param_key(path)), _as_stored)
        return _shaped(self.name(path), convert(self, path, shape), shape)

    def stored_type(self, path: ParamPath) -> str:
        """The type the file stores a parameter in (needs `types`)."""
        assert self.types is not None  # the caller's checkpoint has types (GGUF)
        return self.types(self.name(path))

    def stored(self, name: str) -> Tensor:
        """The file's tensor `name` as stored (a HostQuant while tensor(blocks=True) runs)."""
        if name not in self.names:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}; is the file complete?")
        kept = self.blocks(name) if self._keep and self.blocks else None
        return self.read(name) if kept is None else kept


def _stored_array(ck: Checkpoint, name: str) -> np.ndarray:
    """A tensor as stored by a format without block forms (HF): always an array."""
    w = ck.stored(name)
    assert isinstance(w, np.ndarray), name  # only GGUF checkpoints have `blocks`
    return w


@overload
def _shaped(name: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray: ...
@overload
def _shaped(name: str, w: Tensor, shape: tuple[int, ...]) -> Tensor: ...
def _shaped(name: str, w: Tensor, shape: tuple[int, ...]) -> Tensor:
    if w.size != math.prod(shape):  # exact: np.prod wraps around on a corrupt, huge shape
        raise CheckpointError(
            f"tensor {name!r} has shape {list(w.shape)}, the config implies {list(shape)}"
        )
    return w.reshape(shape)


# ---------------------------------------------------------------------------------------------
# Row conversions: (checkpoint, parameter path, shape) -> the parameter in jaxinfer's layout

Conversion = Callable[[Checkpoint, ParamPath, tuple], Tensor]


def _as_stored(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
    return ck.stored(ck.name(path))


def interleaved_to_half(w: Tensor, n_heads: int) -> Tensor:
    """Reorder q/k rows from Meta's interleaved-pair RoPE layout (GGUF `llama`) to rotate-half."""
    rows = w.shape[0]
    rest = w.shape[1:]
    w = w.reshape(n_heads, rows // n_heads // 2, 2, *rest)  # [N, H/2, 2, ...]
    return w.swapaxes(1, 2).reshape(rows, *rest)  # [N * H, ...]


def _rope_half(heads: str):
    """q/k rows (and biases) of `heads` heads from Meta's interleaved RoPE order."""

    def convert(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
        name = ck.name(path)
        # shaped first: rows of the wrong count cannot be regrouped into heads
        return interleaved_to_half(_shaped(name, ck.stored(name), shape), getattr(ck.config, heads))

    return convert


def _query_or_gate(half: int):
    """The query (0) or output-gate (1) rows of a gated-attention q_proj: [query H, gate H]
    per head."""

    def convert(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
        N, H, D = ck.config.n_heads, ck.config.head_dim, ck.config.d_model
        name = ck.name(path)
        return _shaped(name, ck.stored(name), (N, 2, H, D))[:, half].reshape(N * H, D)

    return convert


def _centred(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
    """A zero-centred RMSNorm: HF stores w, GGUF (and jaxinfer) 1 + w."""
    return _stored_array(ck, ck.name(path)) + 1.0


def _gguf_experts(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
    name = ck.name(path)
    w = ck.stored(name)  # [E, ...] already stacked
    if w.ndim != 3 or w.shape[0] != shape[0]:
        raise CheckpointError(
            f"tensor {name!r} holds {w.shape[0] if w.ndim == 3 else 'no'} experts "
            f"(shape {list(w.shape)}); the metadata declares {shape[0]}"
        )
    return w


def _hf_experts(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
    """Per-expert tensors stacked into [E, ...] one expert at a time, or the fused
    `experts.gate_up_proj [E, 2F, D]` / `experts.down_proj [E, D, F]` form."""
    first = ck.name((*path, 0))
    if first not in ck.names:
        fused = ck.name(path)
        if fused not in ck.names:
            raise CheckpointError(f"checkpoint lacks tensor {first!r} (and {fused!r})")
        w = ck.read(fused)
        if path[-1] != "w_down":  # gate rows first, then up (as vLLM and llama.cpp split)
            E, F, D = shape
            w = _shaped(fused, w, (E, 2, F, D))[:, 0 if path[-1] == "w_gate" else 1]
        return w
    extra = ck.name((*path, shape[0]))
    if extra in ck.names:
        raise CheckpointError(
            f"checkpoint holds {extra!r}: more experts than the {shape[0]} config.json declares"
        )
    out = np.empty(shape, np.float32)
    for e in range(shape[0]):
        name = ck.name((*path, e))
        out[e] = _shaped(name, _stored_array(ck, name), shape[1:])
    return out


def _qkv(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
    """Gated DeltaNet q, k or v rows (of the projection or the conv) out of one fused [q | k | v]
    tensor (in_proj_qkv, attn_qkv, conv1d)."""
    cfg = ck.config
    HK, HV, DK, DV = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    KD = HK * DK
    name = ck.name(path)
    w = ck.stored(name)
    w = w.reshape(w.shape[0], -1)  # HF conv1d [C, 1, K] -> [C, K]
    conv = path[-1].startswith("conv")
    want = (2 * KD + HV * DV, cfg.conv_kernel if conv else cfg.d_model)
    if w.shape != want:
        taps = f" and a {cfg.conv_kernel}-tap conv" if conv else ""
        raise CheckpointError(
            f"tensor {name!r} has shape {list(w.shape)} but the config's {HK} key heads "
            f"x {DK} and {HV} value heads x {DV}{taps} imply {list(want)}; does the "
            "config match the weights?"
        )
    return {"q": w[:KD], "k": w[KD : 2 * KD], "v": w[2 * KD :]}[path[-1][-1]]


def _qkvz(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
    """Qwen3-Next HF: q, k, v or z rows of in_proj_qkvz, grouped per key head [q | k | v | z]."""
    cfg = ck.config
    HK, DK, D = cfg.linear_k_heads, cfg.linear_k_dim, cfg.d_model
    RDV = cfg.linear_v_heads // HK * cfg.linear_v_dim  # value rows per key head
    fused = ck.name((*path[:-1], "qkvz"))
    w = _shaped(fused, ck.stored(fused), (HK, 2 * DK + 2 * RDV, D))
    cut = {"wq": 0, "wk": DK, "wv": 2 * DK, "wz": 2 * DK + RDV}[path[-1]]
    return w[:, cut : cut + (DK if path[-1] in ("wq", "wk") else RDV)].reshape(-1, D)


def _ba(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
    """Qwen3-Next: b or a rows of in_proj_ba / ssm_ba, grouped per key head [b | a]."""
    cfg = ck.config
    R = cfg.linear_v_heads // cfg.linear_k_heads
    fused = ck.name((*path[:-1], "ba"))
    w = _shaped(fused, ck.stored(fused), (cfg.linear_k_heads, 2 * R, cfg.d_model))
    return (w[:, :R] if path[-1] == "wb" else w[:, R:]).reshape(cfg.linear_v_heads, cfg.d_model)


def _minus_exp(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
    """HF stores A_log; the decay is a = -exp(A_log), in float64 then rounded: float32 exp is an
    ulp off on some values."""
    return (-np.exp(_stored_array(ck, ck.name(path)).astype(np.float64))).astype(np.float32)


def _untiled(per_head: str | int, rows: Conversion = _as_stored):
    """Qwen3.5 GGUFs tile V heads (head r * HK + k for HF's k * R + r): regroup them by key head
    on the rows, `per_head` rows each (a config field, or 1). wo's columns stay tiled
    (ModelConfig.linear_out_tiled)."""

    def convert(ck: Checkpoint, path: ParamPath, shape: tuple[int, ...]) -> Tensor:
        cfg = ck.config
        w = rows(ck, path, shape)
        R = cfg.linear_v_heads // cfg.linear_k_heads
        n = getattr(cfg, per_head) if isinstance(per_head, str) else per_head
        return w.reshape(R, cfg.linear_k_heads, n, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)

    return convert


# (families, formats, parameters) -> conversion: space-separated lists, "*" every family,
# "a.{b,c}" for a.b a.c. A parameter without a row is its tensor as stored. Rows may not
# overlap (checked at import).
HYBRID, QWEN35 = " ".join(HYBRID_ARCHS), "qwen3_5 qwen3_5_moe"
EXPERTS = "moe.w_gate moe.w_up moe.w_down"
_ROWS = {
    ("llama mixtral", "gguf", "attn.wq attn.bq"): _rope_half("n_heads"),
    ("llama mixtral", "gguf", "attn.wk attn.bk"): _rope_half("n_kv_heads"),
    ("*", "hf", EXPERTS): _hf_experts,
    ("*", "gguf", EXPERTS): _gguf_experts,
    # gated attention and zero-centred norms (Qwen3-Next, Qwen3.5); the MTP head only
    # exists in these families
    (HYBRID, "hf gguf", "attn.wq"): _query_or_gate(0),
    (HYBRID, "hf gguf", "attn.wgate"): _query_or_gate(1),
    (HYBRID, "hf", "attn_norm mlp_norm attn.q_norm attn.k_norm norm"): _centred,
    ("*", "hf", "mtp.embed_norm mtp.hidden_norm mtp.norm"): _centred,
    # Gated DeltaNet: q, k, v split out of the fused projection and conv
    (HYBRID, "hf gguf", "linear_attn.{conv_q,conv_k}"): _qkv,
    (HYBRID, "hf", "linear_attn.conv_v"): _qkv,
    (HYBRID, "hf", "linear_attn.a"): _minus_exp,
    ("qwen3_next", "gguf", "linear_attn.{wq,wk,wv,conv_v}"): _qkv,
    ("qwen3_next", "hf", "linear_attn.{wq,wk,wv,wz}"): _qkvz,
    ("qwen3_next", "hf gguf", "linear_attn.{wb,wa}"): _ba,
    (QWEN35, "hf", "linear_attn.{wq,wk,wv}"): _qkv,
    (QWEN35, "gguf", "linear_attn.{wq,wk}"): _qkv,
    (QWEN35, "gguf", "linear_attn.{wv,conv_v}"): _untiled("linear_v_dim", _qkv),
    (QWEN35, "gguf", "linear_attn.wz"): _untiled("linear_v_dim"),
    (QWEN35, "gguf", "linear_attn.{wb,wa,a,dt_bias}"): _untiled(1),
}


def _expand(rows: dict[tuple[str, str, str], Conversion]) -> dict[tuple[str, str, str], Conversion]:
    """(arch, format, parameter) -> conversion, one key per row entry."""
    table = {}
    for (families, formats, params), convert in rows.items():
        for arch in ARCHS if families == "*" else families.split():
            for fmt in formats.split():
                for param in _words(params):
                    if (arch, fmt, param) in table:
                        raise ValueError(f"two row conversions for {(arch, fmt, param)}")
                    table[arch, fmt, param] = convert
    return table


def _words(spec: str):
    for word in spec.split():
        head, _, rest = word.partition("{")
        yield from (head + leaf for leaf in rest.rstrip("}").split(",")) if rest else [word]


CONVERSIONS = _expand(_ROWS)
