"""The options: how a request samples (`SamplingParams`) and how an engine serves
(`EngineOptions`). Both are frozen, hold every default once and check every value once, here;
`load()`, `generate()`, the CLI and the server read them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ModelConfig
from .errors import JaxinferError, RequestError

DTYPES = ("float32", "bfloat16", "float16")  # compute and KV cache dtypes
# a KV pool's dtype: a float one, or llama.cpp's Q8_0 (int8 values, one float16 scale per block
# of min(32, head_dim) values along the head dimension)
KV_DTYPES = (*DTYPES, "q8_0")
# llama.cpp's names for them (-ctk / -ctv), accepted as well
KV_DTYPE_ALIASES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
# keep: quantized GGUF tensors stay in block form; int8: float weights too become per-channel
# int8; none: every weight dequantized to the compute dtype at load (the reference)
QUANTIZE = ("keep", "int8", "none")
ACTIVATIONS = ("int8", "float")  # what GGUF block weights multiply (EngineOptions.activations)
PAGE_SIZES = (16, 32, 64, 128, 256)  # 128 measured fastest: benchmarks/results/paged_kv.md
SPECULATIVE = ("ngram", "mtp")  # or a draft model: a path, or a ModelConfig (random weights)
MAX_DRAFT_TOKENS = 16
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # top log-probabilities per token (vLLM's cap, OpenAI's limit)
MAX_STOP_LENGTH = 256  # characters of one stop string a server request may give
# the rows of serve/tool_formats.py's table: how a chat template's model writes tool calls
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "qwen3_coder", "glm45", "mistral", "mistral_v11",
                     "deepseek_v3", "deepseek_v31")  # fmt: skip
REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")  # llama-server's
POOLING = ("last", "mean", "cls")  # how Engine.embed pools a text's hidden states


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    """A finite number within float32's range (sampling values travel as float32)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and abs(value) <= FLOAT32_MAX
    except OverflowError:  # an int past a float's range
        return False


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (llama.cpp's defaults: temperature 0.8,
    top-k 40, top-p 0.95, min-p 0.05). Values travel to the device as arrays: changing them
    compiles nothing. A bad value raises RequestError when the params are made."""

    max_new_tokens: int = 128  # tokens to generate at most (the context may end it sooner)
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off; divides positive logits of recent tokens
    presence_penalty: float = 0.0  # subtracted once from every recent token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence in the recent window
    seed: int | None = None  # None (or < 0) = a fresh random seed per request
    stop: tuple[str, ...] = ()  # stop strings (a single string is taken as one)
    stop_tokens: tuple[int, ...] = ()  # stop token ids, besides the tokenizer's EOS
    ignore_eos: bool = False  # keep generating past EOS
    # special token ids the text keeps (others are skipped): the tags a chat format's parser
    # reads, which a vocabulary may mark special (llama.cpp's preserved_tokens)
    preserved_tokens: tuple[int, ...] = ()
    # prefix caching: requests share cached prompt pages only under the same salt (tenants);
    # cache_prompt=False neither reads nor fills the cache (llama-server's field)
    cache_salt: str | None = None
    cache_prompt: bool = True
    # log-probabilities: None = none; k = each generated token's and its k best (0..20)
    logprobs: int | None = None
    # structured output (at most one): a JSON schema (a dict or its JSON text; {} = any JSON
    # object), a grammar (GBNF, or llguidance's Lark when it starts with %llguidance) or a
    # regular expression the generated text must match
    json_schema: Any = None
    grammar: str | None = None
    regex: str | None = None

    def __post_init__(self):
        def bad(name, want):
            value = f"{getattr(self, name)!r:.40}"  # a 400-digit number stays one short line
            raise RequestError(f"{name} = {value} is invalid; it must be {want}")

        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"):  # fmt: skip
            if not _number(getattr(self, name)):
                bad(name, "a finite number (within float32's range)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            bad("max_new_tokens", ">= 0")
        if self.temperature < 0:
            bad("temperature", ">= 0 (0 = greedy)")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            bad("top_k", f"an integer in 0..{INT32_MAX} (0 = off)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if self.repeat_penalty <= 0:
            bad("repeat_penalty", "> 0 (1 = off)")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "an integer or None")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            bad("cache_salt", "a string or None")
        if not isinstance(self.cache_prompt, bool):
            bad("cache_prompt", "true or false")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"an integer in 0..{MAX_LOGPROBS} or None")
        constraints = [n for n in ("json_schema", "grammar", "regex")
                       if getattr(self, n) is not None]  # fmt: skip
        if len(constraints) > 1:
            raise RequestError(f"pass one of {' / '.join(constraints)}, not several")
        for name in ("grammar", "regex"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                bad(name, "a string")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise RequestError("stop strings must be non-empty strings")
        for name in ("stop_tokens", "preserved_tokens"):
            try:  # numpy integers too; the engine checks them against its vocabulary
                tokens = tuple(_index(t) for t in getattr(self, name) or ())
            except TypeError:
                raise RequestError(
                    f"{name} must be integers; got {list(getattr(self, name))!r:.60}"
                ) from None
            object.__setattr__(self, name, tokens)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))

    @staticmethod
    def make(sampling: SamplingParams | None = None, **overrides) -> SamplingParams:
        """`sampling`, or the defaults with `overrides` (keywords named like the fields);
        both at once, or an unknown keyword, is a RequestError."""
        return _given_or_made(
            SamplingParams, sampling, overrides, "sampling", "sampling", RequestError
        )

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    @property
    def constrained(self) -> bool:
        """Whether a JSON schema, grammar or regex holds the output."""
        return any(v is not None for v in (self.json_schema, self.grammar, self.regex))

    def resolved_seed(self) -> int:
        """The seed the sampler keys take (int31): a fresh random one without a seed."""
        if self.seed is None or self.seed < 0:
            return secrets.randbelow(2**31 - 1)
        return self.seed % (2**31 - 1)


def _given_or_made(cls, given, overrides: dict, name: str, what: str, error: type[JaxinferError]):
    """`given` (a `cls`), or `cls(**overrides)`: both at once, something else, or an unknown
    keyword is an `error` naming the argument `name` (and `what` options they are)."""
    if given is not None and overrides:
        raise error(
            f"pass {name}={cls.__name__}(...) or its keywords, not both "
            f"(got {', '.join(sorted(overrides))} beside it)"
        )
    if given is not None:
        if not isinstance(given, cls):
            raise error(f"{name} must be a {cls.__name__}, got {given!r:.60}")
        return given
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise error(f"unknown {what} option(s): {', '.join(sorted(unknown))}")
    return cls(**overrides)


def json_object(value, what: str) -> dict:
    """A JSON object given as a dict or as JSON text, as the dict; what names it in the error."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RequestError(f"{what} is not valid JSON ({e.msg} at {e.pos})") from None
        except RecursionError:
            raise RequestError(f"{what} is nested too deeply") from None
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _schema_text(schema) -> str:
    """A JSON schema as compact JSON text (a dict, or text that parses to an object)."""
    schema = json_object(schema, "json_schema")
    try:
        return json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise RequestError(f"json_schema cannot be written as JSON ({e})") from None
    except RecursionError:
        raise RequestError("json_schema is nested too deeply") from None


def default_compile_cache_dir() -> Path | None:
    """$JAXINFER_COMPILE_CACHE_DIR ("", "off" or "0" disables), else the per-user cache dir."""
    env = os.environ.get("JAXINFER_COMPILE_CACHE_DIR")
    if env is not None:
        return None if env in ("", "off", "0") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxinfer" / "xla"


def _strict_from_env() -> bool:
    return os.environ.get("JAXINFER_STRICT", "") not in ("", "0")


@dataclass(frozen=True)
class EngineOptions:
    """Everything `load()` takes besides the model: how the weights are held and placed, the
    context, the shape plan, the KV pool, compiles and speculation. Frozen; each value is
    checked here, once (a one-line JaxinferError)."""

    # the weights and where they live
    dtype: str = "float32"  # compute dtype (norms, softmax and logits stay float32)
    quantize: str = "keep"  # one of QUANTIZE
    # GGUF block weights (Q4_K, Q8_0, ...) multiply activations quantized to 8 bits as
    # llama.cpp does ("int8": integer products, its numerics) or float32 ones ("float")
    activations: str = "int8"
    layout: str | Path = "single"  # a built-in layout name or a .toml path
    devices: Any = None  # None: all devices; N: the first N; or a sequence of devices
    # the context and the shape plan (every program is compiled for these shapes)
    max_seq_len: int | None = None  # prompt + generated tokens; None: what the model declares
    slots: int | None = None  # requests decoded together (continuous batching); None: batches
    prefill_buckets: tuple[int, ...] = (8, 32, 128, 512)  # prompt chunk lengths (-ub)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8)  # rows per call (without slots)
    decode_chunk: int = 64  # most decode steps in one compiled call
    stream_chunk: int = 16  # steps per call while streaming, with stop strings or slots
    # fairness: a request decodes this long (or 4x its prefill, if longer) before another
    # client's waiting request may take its row; it resumes later where it was (0: never)
    time_slice_ms: int = 150
    # the KV page pool
    kv_cache_tokens: int | None = None  # pool size; None: max_seq_len x max(slots, 1)
    page_size: int = 128  # one of PAGE_SIZES
    kv_cache_dtype: str = "auto"  # "auto" (kv_dtypes()) or one of KV_DTYPES
    # the K and the V pools apart (llama.cpp's -ctk / -ctv); None: kv_cache_dtype
    kv_cache_dtype_k: str | None = None
    kv_cache_dtype_v: str | None = None
    # prefix caching: full pages shared between requests by content (chain hashes)
    prefix_cache: bool = True
    # hybrid models: snapshots of the linear layers' state at page ends, for prefix hits
    # (None: as many as the KV pool's bytes hold, at most one a page; 0: none, and no hits)
    prefix_snapshots: int | None = None
    # host-RAM tier of the prefix cache (llama-server's --cache-ram): full cached pages evicted
    # from the device pool move to a host store of at most this many MiB (LRU); 0: off
    cache_ram_mib: int = 0
    # fit (llama.cpp's --fit): size the page pool, the snapshots and, where not given, the
    # context and the slots to the memory there is (fit_memory_mib; None: what the backend
    # reports), leaving fit_target_mib free; the context is not cut below fit_ctx
    fit: bool = False
    fit_target_mib: int = 1024
    fit_memory_mib: int | None = None
    fit_ctx: int = 4096
    # compiles
    compile_cache_size: int | None = None  # executables kept (LRU); None: max(64, the plan)
    compile_cache_dir: str | Path | None = field(default_factory=default_compile_cache_dir)
    # compiled executables saved in compile_cache_dir/executables, loaded by the next process
    # without tracing or compiling; the store's size cap in MiB (0: no store)
    executable_store_mib: int = 2048
    strict: bool = field(default_factory=_strict_from_env)  # compiles after warmup() raise
    graph_reuse: bool = True  # False rebuilds every program on every call (benchmarks)
    # layers of one run (a repeated unit of layer kinds and weight formats) share one traced
    # body, so compile time does not grow with depth (parallel/depth.py: one CPU device,
    # float32 compute, the CPU kernels); False: every layer traced on its own
    shared_layers: bool = True
    # speculative decoding: "ngram", "mtp", or a draft model (a path or a ModelConfig)
    speculative: Any = None
    draft_tokens: int = 4  # K drafts per step, 1..MAX_DRAFT_TOKENS
    # the pooled pass of Engine.embed and rerank (serve --embedding / --rerank) in the compile
    # plan: pool[B, T] at prefill's shapes (without it, its first call compiles)
    embeddings: bool = False

    def __post_init__(self):
        def bad(name, want):
            value = getattr(self, name)
            raise JaxinferError(f"{name} = {value!r} is invalid; it must be {want}")

        def one_of(name, allowed):
            if getattr(self, name) not in allowed:
                raise JaxinferError(
                    f"{name} {getattr(self, name)!r} is not supported; use one of "
                    f"{', '.join(allowed)}"
                )

        one_of("dtype", DTYPES)
        for name in ("kv_cache_dtype", "kv_cache_dtype_k", "kv_cache_dtype_v"):
            value = getattr(self, name)
            object.__setattr__(self, name, KV_DTYPE_ALIASES.get(value, value))
            if value is not None or name == "kv_cache_dtype":
                one_of(name, ("auto", *KV_DTYPES))
        one_of("activations", ACTIVATIONS)
        if self.quantize not in QUANTIZE:
            raise JaxinferError(
                f"quantize = {self.quantize!r} is not supported; use one of {', '.join(QUANTIZE)}"
            )
        if not isinstance(self.layout, str | Path):
            bad("layout", "a layout name or a .toml path")
        if self.devices is not None and not _is_int(self.devices):
            if isinstance(self.devices, str) or not isinstance(self.devices, Sequence):
                bad("devices", "a device count or a list of devices")
            object.__setattr__(self, "devices", tuple(self.devices))
        elif self.devices is not None and self.devices < 1:
            bad("devices", "an integer >= 1")
        if self.max_seq_len is not None and (not _is_int(self.max_seq_len) or self.max_seq_len < 2):
            bad("max_seq_len", ">= 2")
        for name in ("slots", "kv_cache_tokens", "compile_cache_size", "fit_memory_mib"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                bad(name, "an integer >= 1")
        snapshots = self.prefix_snapshots
        if snapshots is not None and (not _is_int(snapshots) or snapshots < 0):
            bad("prefix_snapshots", "an integer >= 0 (0: prefix hits only on models without state)")
        if not _is_int(self.executable_store_mib) or self.executable_store_mib < 0:
            bad("executable_store_mib", "an integer >= 0 (0: no store)")
        for name in ("decode_chunk", "stream_chunk"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                bad(name, "an integer >= 1")
        for name in ("cache_ram_mib", "fit_target_mib"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, "an integer >= 0 (MiB)")
        if not _is_int(self.fit_ctx) or self.fit_ctx < 2:
            bad("fit_ctx", "an integer >= 2 (tokens)")
        if not _is_int(self.time_slice_ms) or self.time_slice_ms < 0:
            bad("time_slice_ms", "an integer >= 0 (0: a request keeps its row to the end)")
        for name in ("prefill_buckets", "batch_buckets"):
            values = getattr(self, name)
            values = tuple(values) if isinstance(values, list | tuple) else ()
            if not values or any(not _is_int(v) or v < 1 for v in values):
                raise JaxinferError(
                    f"{name} is invalid; it must be a non-empty list of integers >= 1"
                )
            object.__setattr__(self, name, values)
        if self.page_size not in PAGE_SIZES:
            raise JaxinferError(
                f"page_size = {self.page_size!r} is invalid; use one of "
                f"{', '.join(map(str, PAGE_SIZES))}"
            )
        for name in ("strict", "graph_reuse", "prefix_cache", "shared_layers", "embeddings", "fit"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "True or False")
        spec = self.speculative
        if (
            spec is not None
            and not isinstance(spec, str | Path)
            and not isinstance(spec, ModelConfig)
        ):
            bad("speculative", "'ngram', 'mtp' or a draft model's path")
        if not _is_int(self.draft_tokens) or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            bad("draft_tokens", f"an integer in 1..{MAX_DRAFT_TOKENS}")

    @staticmethod
    def make(options: EngineOptions | None = None, **short) -> EngineOptions:
        """`options`, or the defaults with the keyword short form (`slots=4`); both at once,
        or an unknown keyword, is a JaxinferError."""
        known = [f.name for f in dataclasses.fields(EngineOptions)]
        unknown = sorted(set(short) - set(known))
        if unknown:
            raise JaxinferError(
                f"unknown load option(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        if options is not None and short:
            raise JaxinferError(
                "pass options=EngineOptions(...) or load keywords, not both "
                f"(got {', '.join(sorted(short))} beside it)"
            )
        if options is not None and not isinstance(options, EngineOptions):
            raise JaxinferError(f"options must be an EngineOptions, got {options!r:.60}")
        return options if options is not None else EngineOptions(**short)

    def replace(self, **changes) -> EngineOptions:
        return dataclasses.replace(self, **changes)

    def kv_dtypes(self, narrow_weights: bool = False) -> tuple[str, str]:
        """The K and V pools' dtypes (KV_DTYPES). "auto" is the compute dtype, but float16
        under float32 compute when the checkpoint stores its weights in fewer bits
        (`narrow_weights`: GGUF blocks or 16-bit floats), as llama.cpp's default cache is:
        half the KV memory and the bytes attention reads, at the weights' own precision."""

        def pick(d: str) -> str:
            if d != "auto":
                return d
            return "float16" if narrow_weights and self.dtype == "float32" else self.dtype

        both = pick(self.kv_cache_dtype)
        return (both if self.kv_cache_dtype_k is None else pick(self.kv_cache_dtype_k),
                both if self.kv_cache_dtype_v is None else pick(self.kv_cache_dtype_v))  # fmt: skip


def _index(value) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)


@dataclass(frozen=True)
class ServerOptions:
    """What `jaxinfer serve` (serve.server.Server) takes besides the model and the engine's
    options: where it listens, who may call it and what it shows. Frozen; each value is
    checked here, once (a one-line JaxinferError)."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (Server.port tells which)
    api_key: str | None = None  # every route but /health and /metrics asks "Bearer <key>"
    alias: str | None = None  # the model's name in answers and /v1/models (default: its own)
    chat_template: str | None = None  # Jinja source in place of the model's
    # how tool calls are written and read (TOOL_CALL_FORMATS); "auto": as the template teaches
    tool_call_format: str = "auto"
    # defaults of a request's chat_template_kwargs (the request's own win), e.g.
    # {"enable_thinking": false} or {"preserve_thinking": true}
    chat_template_kwargs: Any = None
    # thinking models, as llama-server's --reasoning-format / --reasoning-budget: how answers
    # are split into reasoning_content and content (serve.thinking.FORMATS), and the tokens a
    # request may think unless it says (thinking_budget; -1: no limit, 0: no thinking)
    reasoning_format: str = "auto"
    reasoning_budget: int = -1
    slots_endpoint: bool = True  # GET /slots (it shows the prompts being served)
    progress: bool = False  # warmup progress on stderr
    # retrieval, as llama-server's --embedding / --rerank / --pooling (chat stays on): POST
    # /v1/embeddings pooled `pooling` way (POOLING), and POST /v1/rerank (a model whose
    # vocabulary has single "yes" and "no" tokens: Qwen3-Reranker)
    embedding: bool = False
    rerank: bool = False
    pooling: str = "last"
    # Limits: what one request may ask, so that it never costs another more than a bounded
    # delay (each refusal a one-line error naming the limit; /props lists them).
    max_body_mib: int = 16  # a request body (413); a 128k-token prompt as JSON is ~1 MiB
    max_choices: int = 128  # prompts x n of one request (400)
    max_stop_strings: int = 16  # stop strings of one request, each <= MAX_STOP_LENGTH (400)
    max_grammar_kib: int = 256  # a JSON schema, grammar or the tools' schemas (400)
    max_queue: int = 256  # choices waiting for a slot, all requests together (429)
    n_predict: int = -1  # most tokens a choice generates (-1: no cap), as llama-server's -n
    timeout: float = 600.0  # seconds a body may take to arrive or a stream wait for its reader

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise JaxinferError(f"--host {self.host!r} is invalid; give a host name or address")
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise JaxinferError(
                f"--port {self.port!r} is invalid; use 0..65535 (0 = any free port)"
            )
        for name in ("api_key", "alias", "chat_template"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise JaxinferError(f"{name} must be a non-empty string or None, not {value!r:.40}")
        kwargs = self.chat_template_kwargs
        if kwargs is not None and not isinstance(kwargs, dict):
            raise JaxinferError("--chat-template-kwargs must be a JSON object")
        object.__setattr__(self, "chat_template_kwargs", dict(kwargs or {}))
        if self.reasoning_format not in REASONING_FORMATS:
            raise JaxinferError(
                f"--reasoning-format {self.reasoning_format!r} is not supported; use one of "
                f"{', '.join(REASONING_FORMATS)}"
            )
        if not _is_int(self.reasoning_budget) or self.reasoning_budget < -1:
            raise JaxinferError(
                f"--reasoning-budget {self.reasoning_budget!r} is invalid; use -1 (no limit), 0 "
                "(no thinking) or a number of tokens"
            )
        if self.tool_call_format not in ("auto", *TOOL_CALL_FORMATS):
            raise JaxinferError(
                f"--tool-call-format {self.tool_call_format!r:.40} is not supported; use auto or "
                f"one of {', '.join(TOOL_CALL_FORMATS)}"
            )
        if self.api_key is not None and not self.api_key.isascii():
            raise JaxinferError(
                "--api-key must be ASCII (an HTTP header carries it; no client could send this one)"
            )
        for name in ("max_body_mib", "max_choices", "max_stop_strings", "max_grammar_kib",
                     "max_queue"):  # fmt: skip
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise JaxinferError(f"--{name.replace('_', '-')} {value!r} is invalid; use >= 1")
        if not _is_int(self.n_predict) or self.n_predict < -1:
            raise JaxinferError(f"-n {self.n_predict!r} is invalid; use -1 (no cap) or >= 0")
        if not isinstance(self.timeout, int | float) or not self.timeout > 0:
            raise JaxinferError(f"--timeout {self.timeout!r} is invalid; use seconds > 0")
        if self.pooling not in POOLING:
            raise JaxinferError(
                f"--pooling {self.pooling!r} is not supported; use one of {', '.join(POOLING)}"
            )
        object.__setattr__(self, "slots_endpoint", bool(self.slots_endpoint))
        object.__setattr__(self, "embedding", bool(self.embedding))
        object.__setattr__(self, "rerank", bool(self.rerank))
        object.__setattr__(self, "progress", bool(self.progress))

    def limits(self) -> dict:
        """The limits as /props reports them."""
        names = ("max_body_mib", "max_choices", "max_stop_strings", "max_grammar_kib",
                 "max_queue", "n_predict", "timeout")  # fmt: skip
        return {name: getattr(self, name) for name in names} | {"max_stop_length": MAX_STOP_LENGTH}

    @staticmethod
    def make(options: ServerOptions | None = None, **overrides) -> ServerOptions:
        """`options`, or the defaults with `overrides` (keywords named like the fields); both
        at once, or an unknown keyword, is a JaxinferError."""
        return _given_or_made(ServerOptions, options, overrides, "options", "server", JaxinferError)
