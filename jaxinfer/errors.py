"""User-facing errors: each says in one line what is wrong and what to do.

Everything a user can get wrong (a path, a file, a request value) raises a subclass of
`JaxinferError`; the CLI prints its message on one line and exits non-zero.
"""


class JaxinferError(Exception):
    """Base class of every error caused by user input."""


class CheckpointError(JaxinferError):
    """A model path, file or tensor that cannot be loaded."""


class UnsupportedModelError(CheckpointError):
    """An architecture, tensor type or tokenizer jaxinfer does not implement."""


class RequestError(JaxinferError):
    """A generation request with invalid values (prompt, sampling, lengths)."""


class LayoutError(JaxinferError):
    """A device layout that does not fit the model or the devices."""


class RecompileError(JaxinferError):
    """Strict mode: a program was compiled after warmup()."""


class SetupError(JaxinferError):
    """A setting of the environment (a JAXINFER_* variable) this machine cannot honour."""
