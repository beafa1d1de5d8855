"""One table of the tiny test families (dense, MoE and hybrid) and one way to write them."""

from pathlib import Path

import numpy as np

from . import checkpoints as C
from . import hybrid_checkpoints as H

FAMILIES: dict[str, dict] = {**C.TINY, **H.HYBRID_TINY}  # family -> HF config.json dict
HYBRID = tuple(H.HYBRID_TINY)


def random_weights(family: str, seed: int = 0, **kw) -> dict[str, np.ndarray]:
    """Float32 weights with HF names (hybrids take `mtp=True` for the MTP head)."""
    config = FAMILIES[family]
    if family in HYBRID:
        return H.hybrid_random_weights(config, seed, **kw)
    return C.random_weights(config, seed)


def write(path: Path, family: str, weights: dict, fmt: str = "hf", **kw) -> Path:
    """An HF folder (fmt "hf") or a GGUF file ("gguf") of `family` with `weights`; `kw` goes
    to the writer (shards, dtype, qtype, ...)."""
    config = FAMILIES[family]
    hybrid = family in HYBRID
    if fmt == "hf":
        return (H.write_hybrid_hf if hybrid else C.write_hf)(path, config, weights, **kw)
    if fmt == "gguf":
        return (H.write_hybrid_gguf if hybrid else C.write_gguf)(path, config, weights, **kw)
    raise ValueError(f"unknown format {fmt!r}")
