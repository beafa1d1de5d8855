"""jaxinfer: a JAX/XLA compiled inference stack for Llama- and Qwen-family decoders."""

from .compile import RecompileError, RecompileEvent
from .config import ModelConfig
from .engine import Engine
from .errors import (
    CheckpointError,
    JaxinferError,
    LayoutError,
    RequestError,
    UnsupportedModelError,
)
from .loader import generate, load
from .perf import PerfStats
from .request import Result, StreamPiece
from .scheduler import Request

__all__ = [
    "CheckpointError",
    "Engine",
    "JaxinferError",
    "LayoutError",
    "ModelConfig",
    "PerfStats",
    "RecompileError",
    "RecompileEvent",
    "Request",
    "RequestError",
    "Result",
    "StreamPiece",
    "UnsupportedModelError",
    "generate",
    "load",
]
__version__ = "0.1.0"
