"""Peak host memory while loading the ~110M Llama from a safetensors folder, against the size
of its weights: loading streams one tensor at a time into its (sharded) device arrays.

On the CPU backend device arrays live in host memory too, so one copy of the weights is the
floor. Writes a random checkpoint to a temp dir, then loads it in fresh processes under each
layout (workers/load_rss.py) and reports peak RSS growth (ru_maxrss) during jaxinfer.load.
Usage: python benchmarks/load_memory.py
"""

import json
import tempfile
from pathlib import Path

import harness


def write_checkpoint(folder: Path) -> int:
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxinfer.formats.hf import tensor_name
    from jaxinfer.model.transformer import abstract_model

    cfg = harness.model("llama-110M")
    rng = np.random.default_rng(0)
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract_model(cfg))):
        shape = var.get_value().shape
        name = tensor_name(path, cfg)
        value = rng.standard_normal(shape, dtype=np.float32) * 0.02
        tensors[name] = value.reshape(shape[0], -1) if value.ndim > 1 else value
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "model_type": "llama", "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.d_ff, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(_tokenizer_json(cfg.vocab_size))
    return sum(t.nbytes for t in tensors.values())


def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return tok.to_str()


def main():
    args = harness.parser(__doc__).parse_args()
    rows = ["| layout | devices | peak RSS growth | weights | ratio |", "|---|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        weights = write_checkpoint(Path(tmp))
        for layout, devices in [("single", 1), ("tensor", 4), ("layer", 4)]:
            env = harness.worker_env(devices=4)
            grown = harness.once("load_rss", tmp, layout, devices, env=env)
            rows.append(
                f"| {layout} | {devices} | {grown / 2**20:.0f} MiB | {weights / 2**20:.0f} MiB | "
                f"{grown / weights:.2f}x |"
            )
            print(rows[-1], flush=True)
    text = "llama-110M random, float32 safetensors, fresh process per layout\n\n" + "\n".join(rows)
    harness.write_result("load_memory", text, args.out)


if __name__ == "__main__":
    main()
