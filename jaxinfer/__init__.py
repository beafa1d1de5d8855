"""jaxinfer: a JAX/XLA compiled inference stack for Llama- and Qwen-family decoders."""

from .config import ModelConfig
from .engine import Engine, PerfStats, Result, StreamPiece
from .errors import (
    CheckpointError,
    JaxinferError,
    LayoutError,
    RequestError,
    UnsupportedModelError,
)
from .loader import generate, load

__all__ = [
    "CheckpointError",
    "Engine",
    "JaxinferError",
    "LayoutError",
    "ModelConfig",
    "PerfStats",
    "RequestError",
    "Result",
    "StreamPiece",
    "UnsupportedModelError",
    "generate",
    "load",
]
__version__ = "0.1.0"
