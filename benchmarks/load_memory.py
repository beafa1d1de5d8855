"""Peak host memory while loading the ~110M Llama from a safetensors folder, against the size
of its weights: loading streams one tensor at a time into its (sharded) device arrays.

On the CPU backend device arrays live in host memory too, so one copy of the weights is the
floor. Writes a random checkpoint to a temp dir, then loads it in fresh processes under each
layout and reports peak RSS growth (ru_maxrss) during jaxinfer.load.
Usage: python benchmarks/load_memory.py
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import os, resource, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jaxinfer
jax.numpy.zeros(1).block_until_ready()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
engine = jaxinfer.load(sys.argv[1], layout=sys.argv[2], devices=int(sys.argv[3]),
                       compile_cache_dir=None)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - base) * 1024)
"""


def write_checkpoint(folder: Path) -> int:
    import numpy as np
    from safetensors.numpy import save_file
    from speed import LLAMA_110M

    from jaxinfer.formats.hf import tensor_name

    cfg = LLAMA_110M
    rng = np.random.default_rng(0)
    tensors = {}
    from flax import nnx

    from jaxinfer.model.transformer import abstract_model

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
    rows = ["| layout | devices | peak RSS growth | weights | ratio |", "|---|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        weights = write_checkpoint(Path(tmp))
        for layout, devices in [("single", 1), ("tensor", 4), ("layer", 4)]:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, tmp, layout, str(devices)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            grown = int(out.stdout.strip().splitlines()[-1])
            rows.append(
                f"| {layout} | {devices} | {grown / 2**20:.0f} MiB | {weights / 2**20:.0f} MiB | "
                f"{grown / weights:.2f}x |"
            )
            print(rows[-1], flush=True)
    path = ROOT / "benchmarks" / "results" / "load_memory.md"
    path.write_text("llama-110M random, float32 safetensors, fresh process per layout\n\n"
                    + "\n".join(rows) + "\n")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
