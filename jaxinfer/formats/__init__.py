"""Checkpoint formats: Hugging Face folders (`hf.py`) and GGUF files (`gguf.py`) -> config,
tokenizer and tensors, as a `Checkpoint` (`checkpoint.py`) that yields parameters in jaxinfer's
layout."""

from pathlib import Path

from ..errors import CheckpointError
from .checkpoint import Checkpoint
from .gguf import open_gguf
from .hf import open_hf

__all__ = ["Checkpoint", "open_checkpoint"]


def open_checkpoint(path: str | Path) -> Checkpoint:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"model path {str(p)!r} does not exist; pass a folder or a .gguf")
    if p.is_dir():
        return open_hf(p)
    if p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
        return open_gguf(p)
    raise CheckpointError(
        f"{str(p)!r} is neither a Hugging Face folder nor a GGUF file; pass one of those"
    )


def _has_gguf_magic(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"
