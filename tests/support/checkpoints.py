"""Tiny random checkpoints (HF safetensors directories and GGUF files) for tests.

Independent of ``jaxinfer``: only numpy, safetensors, tokenizers, gguf and ml_dtypes.

* ``TINY``: tiny HF ``config.json`` dicts (llama, llama3, mistral, qwen2, qwen3, mqa)
* ``random_weights(config, seed)``: float32 weights with HF names
* ``write_hf(dirpath, config, weights, ...)``: config.json + (sharded) safetensors + tokenizer
* ``write_gguf(path, config, weights, ...)``: llama.cpp-style GGUF (permuted q/k for arch llama,
  ``rope_freqs`` for llama3 scaling, optional quantization, gpt2 tokenizer metadata)
* ``permute_hf_to_gguf`` / ``unpermute_gguf_to_hf``: llama.cpp q/k row permutation + inverse
* ``llama3_rope_factors(config)``: the per-frequency divisors llama.cpp's converter writes
"""

from __future__ import annotations

import copy
import json
import math
import zlib
from pathlib import Path

import numpy as np

__all__ = [
    "TINY",
    "random_weights",
    "write_hf",
    "write_gguf",
    "build_tokenizer",
    "byte_level_vocab_and_merges",
    "permute_hf_to_gguf",
    "unpermute_gguf_to_hf",
    "llama3_rope_factors",
    "gguf_arch",
    "HF_TO_GGUF_LAYER_NAMES",
    "hf_to_gguf_name",
]


# ----------------------------------------------------------------------------
# tiny configs
# ----------------------------------------------------------------------------


def _base(model_type: str, arch: str, **kw) -> dict:
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    cfg.update(kw)
    return cfg


# Data: one config per family (they share the shape of their entries, not their values).
TINY: dict[str, dict] = {
    # Llama with GQA (4 q heads, 2 kv heads), untied lm_head, head_dim 16.
    "llama": _base("llama", "LlamaForCausalLM"),
    # Llama 3.x style rope scaling. head_dim 16, theta 5e5 -> rotation wavelengths
    # 2*pi*theta^(i/8) = 6.3, 32.4, 167, 862, ...; with original_max_position_embeddings 64
    # (high_freq_wavelen 16, low_freq_wavelen 64) frequency 0 is kept, frequency 1 falls in
    # the smoothed band and frequencies 2..7 are divided by 8: all three branches are used.
    "llama3": _base(
        "llama",
        "LlamaForCausalLM",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        num_hidden_layers=3,
    ),
    # Mistral with a small sliding window (key j visible to query i iff i - j < 8).
    "mistral": _base(
        "mistral",
        "MistralForCausalLM",
        sliding_window=8,
        head_dim=None,
        vocab_size=320,
    ),
    # Qwen2: q/k/v biases always on, tied embeddings, no sliding window.
    "qwen2": _base(
        "qwen2",
        "Qwen2ForCausalLM",
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
    ),
    # Qwen3: q_norm/k_norm, explicit head_dim (16) != hidden/heads (48/4 = 12).
    "qwen3": _base(
        "qwen3",
        "Qwen3ForCausalLM",
        hidden_size=48,
        head_dim=16,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
    ),
    # Mixtral: 8 experts, top-2, renormalized, every layer MoE (block_sparse_moe.* names).
    "mixtral": _base(
        "mixtral",
        "MixtralForCausalLM",
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=48,
        rope_theta=1000000.0,
        sliding_window=None,
    ),
    # Qwen2-MoE: q/k/v biases, 6 experts top-2 without renormalization, a sigmoid-gated shared
    # expert, and dense layers from both decoder_sparse_step (layer 0, 2) and mlp_only_layers (3).
    "qwen2_moe": _base(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        num_hidden_layers=4,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=4,
    ),
    # Qwen3-MoE: q/k norm, 8 experts top-3, renormalized.
    "qwen3_moe": _base(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=16,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
    ),
    # Multi-query attention: a single kv head, head_dim 8, 3 layers.
    "mqa": _base(
        "llama",
        "LlamaForCausalLM",
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_hidden_layers=3,
    ),
}


def gguf_arch(config: dict) -> str:
    """llama.cpp architecture name for a config: llama (llama/mistral), qwen2, qwen3."""
    mt = config["model_type"]
    if mt in ("llama", "mistral", "mixtral"):
        return "llama"
    if mt in ("qwen2", "qwen3"):
        return mt
    if mt in ("qwen2_moe", "qwen3_moe"):
        return mt.replace("_", "")
    raise ValueError(f"unsupported model_type {mt!r}")


def n_experts(config: dict) -> int:
    return int(config.get("num_local_experts") or config.get("num_experts") or 0)


def is_moe_layer(config: dict, layer: int) -> bool:
    """HF's rule: Mixtral always; Qwen MoE unless in mlp_only_layers or off the sparse step."""
    if not n_experts(config):
        return False
    if config["model_type"] == "mixtral":
        return True
    if layer in (config.get("mlp_only_layers") or []):
        return False
    return (layer + 1) % int(config.get("decoder_sparse_step") or 1) == 0


def moe_prefix(config: dict, layer: int) -> str:
    block = "block_sparse_moe" if config["model_type"] == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}."


def expert_names(config: dict) -> tuple[str, str, str]:
    """(gate, up, down) per-expert weight names."""
    if config["model_type"] == "mixtral":
        return "w1", "w3", "w2"
    return "gate_proj", "up_proj", "down_proj"


def _dims(config: dict) -> tuple[int, int, int, int]:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = config.get("num_key_value_heads")
    kv = heads if kv is None else int(kv)
    hd = config.get("head_dim")
    hd = hidden // heads if hd is None else int(hd)
    return hidden, heads, kv, hd


# ----------------------------------------------------------------------------
# random weights
# ----------------------------------------------------------------------------


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights with Hugging Face names for ``config``.

    Scales are chosen so that attention is far from uniform and logits are O(1):
    q/k ~ N(0, 1/in), other projections ~ N(0, 0.5/in) (std 0.06-0.1 at these sizes),
    embedding std 0.2, lm_head std 0.15, norm weights 1 + N(0, 0.1), biases N(0, 0.1).
    """
    rng = np.random.default_rng(seed)
    hidden, heads, kv, hd = _dims(config)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    mt = config["model_type"]
    qkv_bias = mt in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False))
    o_bias = mt in ("llama", "mistral") and bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    qk_norm = mt in ("qwen3", "qwen3_moe")

    def mat(out: int, inp: int, gain: float) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * (gain / math.sqrt(inp))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n)).astype(np.float32)

    w: dict[str, np.ndarray] = {}
    w["model.embed_tokens.weight"] = (0.2 * rng.standard_normal((vocab, hidden))).astype(np.float32)
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = mat(heads * hd, hidden, 1.0)
        w[p + "self_attn.k_proj.weight"] = mat(kv * hd, hidden, 1.0)
        w[p + "self_attn.v_proj.weight"] = mat(kv * hd, hidden, 0.7)
        w[p + "self_attn.o_proj.weight"] = mat(hidden, heads * hd, 0.5)
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = bias(heads * hd)
            w[p + "self_attn.k_proj.bias"] = bias(kv * hd)
            w[p + "self_attn.v_proj.bias"] = bias(kv * hd)
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = bias(hidden)
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        if is_moe_layer(config, i):
            w.update(random_experts(config, moe_prefix(config, i), mat))
            continue
        w[p + "mlp.gate_proj.weight"] = mat(inter, hidden, 1.0)
        w[p + "mlp.up_proj.weight"] = mat(inter, hidden, 0.7)
        w[p + "mlp.down_proj.weight"] = mat(hidden, inter, 0.5)
        if mlp_bias:
            w[p + "mlp.gate_proj.bias"] = bias(inter)
            w[p + "mlp.up_proj.bias"] = bias(inter)
            w[p + "mlp.down_proj.bias"] = bias(hidden)
    w["model.norm.weight"] = norm(hidden)
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = (0.15 * rng.standard_normal((vocab, hidden))).astype(np.float32)
    return w


def random_experts(config: dict, p: str, mat) -> dict[str, np.ndarray]:
    """The expert block under prefix `p` (e.g. model.layers.1.mlp.), weights from
    `mat(rows, cols, gain)`: router (gain 3: clearly separated routing), experts, and the
    shared expert and its gate where the config has one (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)."""
    hidden = int(config["hidden_size"])
    E = n_experts(config)
    width = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    gate, up, down = expert_names(config)
    w = {p + "gate.weight": mat(E, hidden, 3.0)}
    for e in range(E):
        w[f"{p}experts.{e}.{gate}.weight"] = mat(width, hidden, 1.0)
        w[f"{p}experts.{e}.{up}.weight"] = mat(width, hidden, 0.7)
        w[f"{p}experts.{e}.{down}.weight"] = mat(hidden, width, 0.5)
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    if shared:
        w[p + "shared_expert.gate_proj.weight"] = mat(shared, hidden, 1.0)
        w[p + "shared_expert.up_proj.weight"] = mat(shared, hidden, 0.7)
        w[p + "shared_expert.down_proj.weight"] = mat(hidden, shared, 0.5)
        w[p + "shared_expert_gate.weight"] = mat(1, hidden, 2.0)
    return w


def fuse_experts(config: dict, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fused form some checkpoints store (Qwen3.5, transformers 5): per layer
    `experts.gate_up_proj [E, 2F, D]` (gate rows first) and `experts.down_proj [E, D, F]`."""
    out = dict(weights)
    gate, up, down = expert_names(config)
    for i in range(int(config["num_hidden_layers"])):
        if not is_moe_layer(config, i):
            continue
        p = moe_prefix(config, i)
        E = n_experts(config)
        g, u, d = (
            np.stack([out.pop(f"{p}experts.{e}.{n}.weight") for e in range(E)])
            for n in (gate, up, down)
        )
        out[p + "experts.down_proj"] = d
        out[p + "experts.gate_up_proj"] = np.concatenate([g, u], axis=1)
    return out


# ----------------------------------------------------------------------------
# tokenizer (byte-level BPE, GPT-2 style)
# ----------------------------------------------------------------------------

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]

_CORPUS = """\
Once upon a time, there was a little girl named Lily. She loved to play outside in the park.
One day, she saw a big, red ball. She wanted to play with it, but it was too high.
Lily asked her mom for help. Her mom smiled and said, "Let's get the ball together!"
They played all day in the sun. The birds were singing and the flowers were pretty.
Tom had a small dog named Max. Max liked to run and jump and bark at the cat.
The cat was not happy. It ran up the tree and sat there until the dog went home.
In the morning the sun was warm and the sky was blue. The children went to school.
def main(): print("hello world") # 1 2 3 4 5 6 7 8 9 10 100 1000
The quick brown fox jumps over the lazy dog. THE END.
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char map (same as tokenizers' ByteLevel)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_level_vocab_and_merges(vocab_size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Deterministic byte-level BPE: returns (tokens in id order, merges in rank order).

    ids 0,1,2 = <unk>, <s>, </s>; ids 3..258 = the 256 byte chars in byte order (byte b has
    id 3 + b); then one token per merge until ``vocab_size`` tokens exist. Merges are learned
    on a small built-in corpus (most frequent pair first, ties broken lexicographically);
    if the corpus runs out, filler merges of existing tokens are appended.
    """
    n_base = len(SPECIAL_TOKENS) + 256
    if vocab_size < n_base:
        raise ValueError(f"vocab_size must be >= {n_base} for a byte-level BPE")
    b2u = _bytes_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [b2u[b] for b in range(256)]
    known = set(tokens)
    merges: list[tuple[str, str]] = []

    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    word_counts: dict[tuple[str, ...], int] = {}
    for line in _CORPUS.splitlines(keepends=True):
        for piece, _ in pre.pre_tokenize_str(line):
            key = tuple(piece)
            word_counts[key] = word_counts.get(key, 0) + 1
    words = list(word_counts.items())

    while len(tokens) < vocab_size:
        pair_counts: dict[tuple[str, str], int] = {}
        for word, c in words:
            for a, b in zip(word, word[1:], strict=False):
                pair_counts[(a, b)] = pair_counts.get((a, b), 0) + c
        candidates = [(c, p) for p, c in pair_counts.items() if p[0] + p[1] not in known]
        if not candidates:
            break
        best_count = max(c for c, _ in candidates)
        best = min(p for c, p in candidates if c == best_count)
        merged = best[0] + best[1]
        merges.append(best)
        tokens.append(merged)
        known.add(merged)
        new_words = []
        for word, c in words:
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words.append((tuple(out), c))
        words = new_words

    # filler merges (only needed for vocabularies larger than the corpus supports)
    if len(tokens) < vocab_size:
        letters = [b2u[b] for b in range(ord("a"), ord("z") + 1)]
        base = letters + [t for t in tokens[n_base:]]
        for a in base:
            for b in letters:
                if len(tokens) >= vocab_size:
                    break
                if a + b not in known:
                    merges.append((a, b))
                    tokens.append(a + b)
                    known.add(a + b)
            if len(tokens) >= vocab_size:
                break
    if len(tokens) != vocab_size:
        raise ValueError(f"could not build a byte-level BPE with {vocab_size} tokens")
    return tokens, merges


def _adds_bos(config: dict) -> bool:
    return config["model_type"] in ("llama", "mistral")


def build_tokenizer(config: dict):
    """A ``tokenizers.Tokenizer`` (byte-level BPE) whose vocab size equals config vocab_size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens, merges = byte_level_vocab_and_merges(int(config["vocab_size"]))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if _adds_bos(config):
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.get_vocab_size() == int(config["vocab_size"]), tok.get_vocab_size()
    return tok


def _tokenizer_config(config: dict) -> dict:
    return {
        "add_bos_token": _adds_bos(config),
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(config.get("max_position_embeddings", 256)),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# ----------------------------------------------------------------------------
# HF writer
# ----------------------------------------------------------------------------


def _np_dtype(dtype: str):
    if dtype in ("float32", "f32", "F32"):
        return np.float32
    if dtype in ("float16", "f16", "F16"):
        return np.float16
    if dtype in ("bfloat16", "bf16", "BF16"):
        import ml_dtypes

        return ml_dtypes.bfloat16
    raise ValueError(f"unsupported dtype {dtype!r}")


_DTYPE_NAMES = {
    "f32": "float32",
    "F32": "float32",
    "f16": "float16",
    "F16": "float16",
    "bf16": "bfloat16",
    "BF16": "bfloat16",
}


def write_hf(
    dirpath,
    config: dict,
    weights: dict[str, np.ndarray],
    *,
    shards: int = 1,
    dtype: str = "float32",
    tokenizer: bool = True,
) -> Path:
    """Write a Hugging Face checkpoint directory; returns its path.

    Files: config.json (torch_dtype set to ``dtype``), model.safetensors or
    model-0000k-of-0000n.safetensors + model.safetensors.index.json, and (if ``tokenizer``)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json.
    """
    from safetensors.numpy import save_file

    d = Path(dirpath)
    d.mkdir(parents=True, exist_ok=True)
    np_dtype = _np_dtype(dtype)
    dtype_name = _DTYPE_NAMES.get(dtype, dtype)

    cfg = copy.deepcopy(config)
    cfg["torch_dtype"] = dtype_name
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(np_dtype)) for k, v in weights.items()}
    names = list(tensors)
    shards = max(1, min(int(shards), len(names)))
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        per = math.ceil(len(names) / shards)
        groups = [names[i * per : (i + 1) * per] for i in range(shards)]
        groups = [g for g in groups if g]
        n = len(groups)
        weight_map: dict[str, str] = {}
        total = 0
        for k, group in enumerate(groups, start=1):
            fname = f"model-{k:05d}-of-{n:05d}.safetensors"
            part = {name: tensors[name] for name in group}
            save_file(part, str(d / fname), metadata={"format": "pt"})
            for name in group:
                weight_map[name] = fname
                total += tensors[name].nbytes
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    if tokenizer:
        tok = build_tokenizer(config)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(
            json.dumps(_tokenizer_config(config), indent=2) + "\n"
        )
        stm = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        (d / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")
    return d


# ----------------------------------------------------------------------------
# GGUF writer
# ----------------------------------------------------------------------------

# HF per-layer suffix -> llama.cpp per-layer name
HF_TO_GGUF_LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}

_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


_HF_TO_GGUF_MOE = {
    "gate.weight": "ffn_gate_inp.weight",
    "shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def hf_to_gguf_name(name: str) -> str:
    if name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[name]
    parts = name.split(".")
    if len(parts) >= 5 and parts[3] in ("mlp", "block_sparse_moe"):
        suffix = ".".join(parts[4:])
        if suffix in _HF_TO_GGUF_MOE:
            return f"blk.{int(parts[2])}.{_HF_TO_GGUF_MOE[suffix]}"
    if len(parts) >= 4 and parts[0] == "model" and parts[1] == "layers":
        suffix = ".".join(parts[3:])
        if suffix in HF_TO_GGUF_LAYER_NAMES:
            return f"blk.{int(parts[2])}.{HF_TO_GGUF_LAYER_NAMES[suffix]}"
    raise KeyError(f"no GGUF name for {name!r}")


def permute_hf_to_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp ``LlamaModel.permute``: HF rotate_half rows -> Meta interleaved rows."""
    out = w.shape[0]
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_gguf_to_hf(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_hf_to_gguf`` (transformers' convert_llama_weights_to_hf permute)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """Per-frequency divisors (float32 [head_dim/2]) as convert_hf_to_gguf.py writes to
    ``rope_freqs.weight`` for llama3 rope scaling; None when the config has no llama3 scaling.
    llama.cpp uses theta_i = pos * base**(-2i/d) / factor_i.
    """
    rs = config.get("rope_scaling") or {}
    if rs.get("rope_type", rs.get("type", "")) != "llama3":
        return None
    _, _, _, dim = _dims(config)
    base = float(config.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = float(rs.get("factor", 8.0))
    low_freq_factor = float(rs.get("low_freq_factor", 1.0))
    high_freq_factor = float(rs.get("high_freq_factor", 4.0))
    old_context_len = float(rs.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            factors.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def write_gguf(
    path,
    config: dict,
    weights: dict[str, np.ndarray],
    *,
    arch: str | None = None,
    qtype: str = "F32",
    tokenizer: bool = True,
    chat_template: str | None = None,
    qtypes: dict[str, str] | None = None,
) -> Path:
    """Write a llama.cpp-style GGUF; returns its path.

    * ``arch``: defaults to ``gguf_arch(config)`` (llama for llama/mistral, qwen2, qwen3).
    * For arch ``llama`` q/k rows (and q/k biases) are permuted to the Meta interleaved
      layout exactly like convert_hf_to_gguf.py; qwen2/qwen3 are written as-is.
    * llama3 rope scaling -> an F32 ``rope_freqs.weight`` tensor of per-frequency divisors.
    * ``qtype`` ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", ...): applied to
      2-D weight matrices whose row length is divisible by the type's block size; everything
      else (norms, biases, rope_freqs, non-divisible matrices) stays F32. K-quants ("Q4_K",
      "Q5_K", "Q6_K"), which gguf-py cannot quantize, get random valid blocks of about the
      weights' scale instead: the file's weights are then unrelated to ``weights``.
    * ``qtypes``: GGUF tensor name -> its type where it is not ``qtype`` (a Q4_K_M file's
      Q6_K ffn_down and attn_v layers); stacked experts are quantized only when named here.
    * Mistral's sliding window is recorded as ``{arch}.attention.sliding_window``.
    """
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arch = arch or gguf_arch(config)
    hidden, heads, kv, hd = _dims(config)
    qt = GGMLQuantizationType[qtype.upper()]

    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{config['model_type']}")
    w.add_context_length(int(config.get("max_position_embeddings", 2048)))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    if config.get("head_dim") is not None or arch == "qwen3":
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(int(config["vocab_size"]))
    if n_experts(config):
        w.add_expert_count(n_experts(config))
        w.add_expert_used_count(int(config["num_experts_per_tok"]))
        if config.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        if config.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))
    sw = config.get("sliding_window")
    if (
        sw is not None
        and config["model_type"] not in ("qwen2", "qwen3")
        and config.get("use_sliding_window") is not False
    ):
        w.add_sliding_window(int(sw))
    if qt == GGMLQuantizationType.F32:
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
    else:
        ft = getattr(gguf.LlamaFileType, f"MOSTLY_{qt.name}", None)
        if ft is not None:
            w.add_file_type(ft)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if tokenizer:
        tokens, merges = byte_level_vocab_and_merges(int(config["vocab_size"]))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        ttypes = [
            gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens
        ]
        w.add_token_types(ttypes)
        w.add_token_merges([f"{a} {b}" for a, b in merges])
        if config.get("bos_token_id") is not None:
            w.add_bos_token_id(int(config["bos_token_id"]))
        if config.get("eos_token_id") is not None:
            w.add_eos_token_id(int(config["eos_token_id"]))
        w.add_add_bos_token(_adds_bos(config))
        if chat_template is not None:
            w.add_chat_template(chat_template)

    def add(name: str, arr: np.ndarray, quantizable: bool) -> None:
        arr = np.ascontiguousarray(np.asarray(arr, dtype=np.float32))
        qt = GGMLQuantizationType[(qtypes or {}).get(name, qtype).upper()]
        block_size = GGML_QUANT_SIZES[qt][0]
        named = name in (qtypes or {})  # stacked experts too
        if (
            (quantizable and arr.ndim == 2 or named)
            and qt != GGMLQuantizationType.F32
            and arr.shape[-1] % block_size == 0
        ):
            if qt.name.endswith("_K"):
                seed = zlib.crc32(name.encode())  # each tensor its own blocks
                rows = (int(np.prod(arr.shape[:-1])), arr.shape[-1])
                data = random_k_blocks(rows, qt.name, float(np.abs(arr).mean()), seed)
                data = data.reshape(*arr.shape[:-1], -1)
            else:
                data = gguf.quants.quantize(arr, qt)
            if qt == GGMLQuantizationType.F16:
                w.add_tensor(name, data)
            else:
                w.add_tensor(name, data, raw_dtype=qt)
        else:
            w.add_tensor(name, arr)

    factors = llama3_rope_factors(config)
    if factors is not None:
        add("rope_freqs.weight", factors, quantizable=False)

    weights = dict(weights)
    for i in range(int(config["num_hidden_layers"])):
        if is_moe_layer(config, i):
            p = moe_prefix(config, i)
            for hf, gg in zip(expert_names(config), ("gate", "up", "down"), strict=True):
                names = [f"{p}experts.{e}.{hf}.weight" for e in range(n_experts(config))]
                stacked = [weights.pop(n) for n in names if n in weights]  # tests drop some
                add(f"blk.{i}.ffn_{gg}_exps.weight", np.stack(stacked), quantizable=False)
    for hf_name, arr in weights.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings", False):
            continue
        name = hf_to_gguf_name(hf_name)
        arr = np.asarray(arr, dtype=np.float32)
        if arch == "llama":
            if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                arr = permute_hf_to_gguf(arr, heads)
            elif hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                arr = permute_hf_to_gguf(arr, kv)
        add(name, arr, quantizable=not name.endswith(".bias") and "norm" not in name)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_k_blocks(shape: tuple[int, int], qtype: str, scale: float, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks (uint8 [rows, bytes per row]) whose values are about `scale`:
    random bytes, with the f16 super-block scales (d, and dmin where the type has one) set so
    that sub-block scale 63 (Q6_K: 127) times the largest value gives ~4 * scale."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rows, width = shape
    rng = np.random.default_rng(seed + rows * 7919 + width)
    raw = rng.integers(0, 256, (rows, width // block, size), dtype=np.uint8)
    top = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 127 * 32}[qtype]
    d = (rng.uniform(1.0, 4.0, raw.shape[:2]) * scale / top).astype(np.float16)
    at = (208,) if qtype == "Q6_K" else (0, 2)  # d (and dmin) offsets in the block
    for offset in at:
        raw[..., offset : offset + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)
