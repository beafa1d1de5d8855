"""jaxinfer: a JAX/XLA compiled inference stack for Llama- and Qwen-family decoders."""

from .config import ModelConfig
from .engine import Engine, PlannedProgram
from .errors import (
    CheckpointError,
    JaxinferError,
    LayoutError,
    RecompileError,
    RequestError,
    UnsupportedModelError,
)
from .loader import generate, load
from .options import EngineOptions, SamplingParams
from .runtime.compile import RecompileEvent
from .runtime.perf import PerfStats
from .runtime.request import Request, Result, StreamPiece

__all__ = [
    "CheckpointError",
    "Engine",
    "EngineOptions",
    "JaxinferError",
    "LayoutError",
    "ModelConfig",
    "PerfStats",
    "PlannedProgram",
    "RecompileError",
    "RecompileEvent",
    "Request",
    "RequestError",
    "Result",
    "SamplingParams",
    "StreamPiece",
    "UnsupportedModelError",
    "generate",
    "load",
]
__version__ = "0.1.0"
