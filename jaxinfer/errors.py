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


class ContextError(RequestError):
    """A prompt longer than the context (llama-server's exceed_context_size_error);
    `at_least`: the count is a bound found without tokenizing (a huge text)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int, at_least: bool = False):
        count = f"more than {n_prompt_tokens}" if at_least else str(n_prompt_tokens)
        super().__init__(
            f"request ({count} tokens) exceeds the available context size ({n_ctx} "
            "tokens), try increasing it (-c)"
        )
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


class LayoutError(JaxinferError):
    """A device layout that does not fit the model or the devices."""


class RecompileError(JaxinferError):
    """Strict mode: a program was compiled after warmup()."""


class SetupError(JaxinferError):
    """A setting of the environment (a JAXINFER_* variable) this machine cannot honour."""
