"""The `jaxinfer` command: llama.cpp-style `generate`, `serve`, `bench` and `info`.

User errors print one line to stderr and exit 1 (`-v` adds the traceback). Generated text goes
to stdout as it is produced; perf stats go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
import traceback
from pathlib import Path

from ..errors import JaxinferError
from ..options import (
    ACTIVATIONS,
    DTYPES,
    KV_DTYPE_ALIASES,
    KV_DTYPES,
    MAX_STOP_LENGTH,
    POOLING,
    QUANTIZE,
    REASONING_FORMATS,
    TOOL_CALL_FORMATS,
    EngineOptions,
    SamplingParams,
    ServerOptions,
)
from ..shardings import BUILTIN
from . import group

SAMPLING = SamplingParams()  # the defaults of every sampling flag
ENGINE = EngineOptions()  # the defaults of every engine flag
SERVER = ServerOptions()  # the defaults of every server flag


def _ints(text: str, minimum: int = 1) -> tuple[int, ...]:
    """Comma-separated integers >= minimum."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def _int_list(text: str) -> tuple[int, ...]:
    return _ints(text, 1)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, not {text!r:.60}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r:.60}")
    return value


def _int_list0(text: str) -> tuple[int, ...]:
    """Integers >= 0 (0 skips a test, as in llama-bench)."""
    return _ints(text, 0)


def _devices(text: str):
    """An int, or for bench a comma list of ints."""
    values = _ints(text, 1)
    return values[0] if len(values) == 1 else values


def _common(p: argparse.ArgumentParser) -> None:
    """The engine's flags: one declaration each (their like shapes are boilerplate)."""
    p.add_argument(
        "-m", "--model",
        help="HF folder or .gguf file (default: the built-in stories260K; builtin-random: "
        "the random model)",
    )  # fmt: skip
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length (max_seq_len)")
    p.add_argument("--dtype", default=ENGINE.dtype, choices=DTYPES)
    p.add_argument(
        "--quantize", default=ENGINE.quantize, choices=QUANTIZE,
        help="keep: GGUF quantized tensors stay in their blocks (default); int8: float weights "
        "too, per-channel int8; none: dequantize everything at load",
    )  # fmt: skip
    p.add_argument(
        "--activations", default=ENGINE.activations, choices=ACTIVATIONS,
        help="int8: GGUF block weights multiply activations quantized to 8 bits, as llama.cpp "
        "does (default); float: float32 activations (the dequantized model's products)",
    )  # fmt: skip
    p.add_argument(
        "--layout", default=ENGINE.layout,
        help=f"{', '.join(BUILTIN)}, or a layout .toml file",
    )  # fmt: skip
    p.add_argument("--devices", type=_devices, default=None, help="use the first N devices")
    p.add_argument(
        "--kv-cache-tokens", type=int, default=None,
        help="KV page pool size in tokens (default: context x max(parallel, 1))",
    )  # fmt: skip
    p.add_argument(
        "--page-size", type=int, default=ENGINE.page_size,
        help=f"KV page size in tokens ({ENGINE.page_size})",
    )  # fmt: skip
    kv_names = ["auto", *KV_DTYPES, *KV_DTYPE_ALIASES]
    p.add_argument(
        "--kv-cache-dtype", default=ENGINE.kv_cache_dtype, choices=kv_names, metavar="TYPE",
        help="KV cache dtype of K and V: auto (the compute dtype; float16 for a GGUF file in "
        "blocks or 16-bit floats, as llama.cpp), float32, float16, bfloat16 "
        "(or llama.cpp's f32, f16, bf16) or q8_0 (int8 with a float16 scale per 32 values)",
    )  # fmt: skip
    for short, side in (("-ctk", "k"), ("-ctv", "v")):
        p.add_argument(
            f"--cache-type-{side}", short, dest=f"kv_cache_dtype_{side}", default=None,
            choices=kv_names, metavar="TYPE",
            help=f"the {side.upper()} pools' dtype alone, as llama.cpp's {short} (default: "
            "--kv-cache-dtype)",
        )  # fmt: skip
    p.add_argument(
        "--cache-ram", type=int, default=ENGINE.cache_ram_mib, metavar="MIB", dest="cache_ram",
        help="host-RAM tier of the prefix cache: cached pages evicted from the KV pool move to "
        "a host store of at most MIB (least recently used go first; default 0: off)",
    )  # fmt: skip
    p.add_argument(
        "--fit", action="store_true",
        help="size the KV pool, the snapshots and, where not given, the context (-c) and "
        "slots (-np) to the memory there is, leaving --fit-target MiB free",
    )  # fmt: skip
    p.add_argument(
        "--fit-target", type=int, default=ENGINE.fit_target_mib, metavar="MIB",
        help=f"--fit: memory to leave free (default {ENGINE.fit_target_mib})",
    )  # fmt: skip
    p.add_argument(
        "--fit-memory", type=int, default=None, metavar="MIB",
        help="--fit: the memory to plan in (default: what the backend reports; on CPU the "
        "smaller of MemAvailable and the cgroup limit)",
    )  # fmt: skip
    p.add_argument(
        "--fit-ctx", type=int, default=ENGINE.fit_ctx, metavar="N",
        help=f"--fit: never cut the context below N tokens (default {ENGINE.fit_ctx}, or the "
        "model's context if smaller)",
    )  # fmt: skip
    p.add_argument(
        "--no-prefix-cache", action="store_true",
        help="do not share prompt pages between requests (prefix caching is on by default)",
    )  # fmt: skip
    p.add_argument(
        "--prefix-snapshots", type=int, default=None, metavar="N",
        help="hybrid models: state snapshots kept for prefix hits (default: as many as the KV "
        "pool's bytes hold, at most one per page; 0: none, and no prefix hits)",
    )  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs and tracebacks")
    p.add_argument(
        "--compile-cache-dir", default=None,
        help="where compiled programs are kept: the executable store (in its executables/ "
        "folder) and jax's persistent cache (default: ~/.cache/jaxinfer/xla)",
    )  # fmt: skip
    p.add_argument(
        "--no-compile-cache", action="store_true",
        help="neither the executable store nor jax's persistent cache: compile everything",
    )  # fmt: skip
    p.add_argument(
        "--executable-store-mib", type=int, default=ENGINE.executable_store_mib, metavar="MIB",
        help="size cap of the executable store, least recently used go first (0: no store; "
        f"default {ENGINE.executable_store_mib})",
    )  # fmt: skip
    p.add_argument(
        "--clear-executable-store", action="store_true",
        help="delete the stored executables before loading",
    )  # fmt: skip


def _serving(p: argparse.ArgumentParser) -> None:
    """Options of the commands that serve requests: prompt chunks and speculative decoding."""
    p.add_argument(
        "-ub", "--ubatch-size", type=_int_list, default=None,
        help="prompt chunk sizes, comma-separated (default "
        f"{','.join(map(str, ENGINE.prefill_buckets))})",
    )  # fmt: skip
    p.add_argument(
        "--spec-type", choices=["ngram", "draft", "mtp"], default=None,
        help="speculative decoding: prompt lookup, a draft model (-md) or the MTP layer",
    )  # fmt: skip
    p.add_argument(
        "--spec-draft-n-max",
        type=int,
        default=ENGINE.draft_tokens,
        metavar="K",
        help=f"drafts per step ({ENGINE.draft_tokens})",
    )
    p.add_argument("-md", "--model-draft", default=None, help="draft model: HF folder or .gguf")
    p.add_argument(
        "--time-slice-ms", type=int, default=ENGINE.time_slice_ms, metavar="MS",
        help="with every slot busy, a request decodes this long before another client's "
        f"waiting request takes its slot; it resumes later (0: never; {ENGINE.time_slice_ms})",
    )  # fmt: skip


def _limits(p: argparse.ArgumentParser) -> None:
    """The server's limits (ServerOptions), one flag each (their like shapes are boilerplate)."""
    o = SERVER
    p.add_argument("--max-body-mib", type=int, default=o.max_body_mib, metavar="MIB",
                   help=f"largest request body (413 above; {o.max_body_mib})")  # fmt: skip
    p.add_argument("--max-choices", type=int, default=o.max_choices, metavar="N",
                   help=f"most choices (prompts x n) in one request ({o.max_choices})")  # fmt: skip
    p.add_argument("--max-stop-strings", type=int, default=o.max_stop_strings, metavar="N",
                   help=f"most stop strings in one request ({o.max_stop_strings}, each at most "
                   f"{MAX_STOP_LENGTH} characters)")  # fmt: skip
    p.add_argument("--max-grammar-kib", type=int, default=o.max_grammar_kib, metavar="KIB",
                   help="largest JSON schema, grammar or tool list of a request "
                   f"({o.max_grammar_kib})")  # fmt: skip
    p.add_argument("--max-queue", type=int, default=o.max_queue, metavar="N",
                   help=f"most choices waiting for a slot (429 above; {o.max_queue})")  # fmt: skip
    p.add_argument("-n", "--n-predict", type=int, default=o.n_predict, metavar="N",
                   help="most tokens a choice generates: caps max_tokens (-1: none)")  # fmt: skip
    p.add_argument("-to", "--timeout", type=float, default=o.timeout, metavar="S",
                   help="seconds a request body may take to arrive, and a stream may wait for "
                   f"its reader ({o.timeout:g})")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _common(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None, help="prompt text")
    src.add_argument("-f", "--file", default=None, help="file with one prompt per line")
    d = SAMPLING
    g.add_argument("-n", "--n-predict", type=int, default=d.max_new_tokens, help="max new tokens")
    g.add_argument("--temp", type=float, default=d.temperature, help="temperature (0 = greedy)")
    g.add_argument("--top-k", type=int, default=d.top_k)
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--min-p", type=float, default=d.min_p)
    g.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty)
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    g.add_argument("-s", "--seed", type=int, default=-1, help="random seed (-1 = random)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    rule = g.add_mutually_exclusive_group()  # structured output, llama.cpp's flags
    rule.add_argument(
        "--grammar", default=None, help="GBNF grammar (llguidance Lark after %%llguidance)"
    )
    rule.add_argument("--grammar-file", default=None, metavar="FILE", help="--grammar from a file")
    rule.add_argument(
        "-j", "--json-schema", default=None, metavar="SCHEMA",
        help="JSON schema the output follows ({} = any JSON object)",
    )  # fmt: skip
    g.add_argument("--profile", default=None, metavar="DIR", help="write a jax profiler trace")
    g.add_argument(
        "-np", "--parallel", type=int, default=None,
        help="slots: requests decoded together with continuous batching",
    )  # fmt: skip
    _serving(g)
    group.add_flags(g)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the slots")
    _common(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port (8080; 0 = any free port)")
    s.add_argument(
        "-np", "--parallel", type=int, default=4, help="slots: requests decoded together (4)"
    )
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--alias", default=None, help="the model name the API reports")
    s.add_argument(
        "--no-slots", dest="slots_endpoint", action="store_false",
        help="turn off GET /slots (it shows the prompts being served)",
    )  # fmt: skip
    s.add_argument(
        "--chat-template-file", default=None, metavar="FILE",
        help="a jinja chat template in place of the model's",
    )  # fmt: skip
    s.add_argument("--tool-call-format", choices=("auto", *TOOL_CALL_FORMATS),
                   default=SERVER.tool_call_format, metavar="FORMAT",
                   help="how the model writes tool calls: auto (as its chat template teaches), "
                   f"or one of {', '.join(TOOL_CALL_FORMATS)} (auto)")  # fmt: skip
    s.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='defaults of requests\' chat_template_kwargs, e.g. '
                   '\'{"enable_thinking": false}\'')  # fmt: skip
    s.add_argument("--reasoning-format", choices=REASONING_FORMATS,
                   default=SERVER.reasoning_format,
                   help="thinking models: auto/deepseek put the reasoning in "
                   "reasoning_content, deepseek-legacy keeps it in content too, none splits "
                   "nothing (auto)")  # fmt: skip
    s.add_argument("--reasoning-budget", type=int, default=SERVER.reasoning_budget, metavar="N",
                   help="tokens a request may think unless it says (thinking_budget): -1 no "
                   "limit, 0 no thinking (-1)")  # fmt: skip
    s.add_argument("--embedding", "--embeddings", action="store_true",
                   help="serve POST /v1/embeddings too (chat stays on)")  # fmt: skip
    s.add_argument("--rerank", "--reranking", action="store_true",
                   help="serve POST /v1/rerank too, scored as Qwen3-Reranker (a model with "
                   'single "yes" and "no" tokens)')  # fmt: skip
    s.add_argument("--pooling", choices=POOLING, default=SERVER.pooling,
                   help="how /v1/embeddings pools a text's hidden states: at its last token "
                   f"(Qwen3-Embedding), their mean or at its first ({SERVER.pooling})")  # fmt: skip
    _limits(s)
    _serving(s)
    group.add_flags(s)

    b = sub.add_parser("bench", help="llama-bench style throughput")
    _common(b)
    b.add_argument("-p", "--n-prompt", type=_int_list0, default=(512,), help="prompt lengths")
    b.add_argument("-n", "--n-gen", type=_int_list0, default=(128,), help="generated lengths")
    b.add_argument("-d", "--n-depth", type=_int_list0, default=(0,),
                   help="tokens already in the context before each test")  # fmt: skip
    b.add_argument("-r", "--repetitions", type=int, default=5)
    b.add_argument("--parallel", type=_int_list, default=(1,), help="rows decoded together")
    b.add_argument("--graph-reuse", default="on", help="on, off or on,off")
    b.add_argument("-o", "--output", default="md", choices=["md", "json", "csv"])
    b.add_argument("--mem-bw", type=float, default=None, help="memory bandwidth in GB/s")
    b.add_argument("--profile", default=None, metavar="DIR", help="write a jax profiler trace")
    group.add_flags(b)

    i = sub.add_parser("info", help="describe a model")
    _common(i)
    return parser


def _prefix_row(engine, kv: dict) -> str:
    if not engine.options.prefix_cache:
        return "off (--no-prefix-cache)"
    text = f"on: full pages of {kv['page_size']} tokens shared by content"
    if kv["snapshots_total"]:
        text += (
            f"; {kv['snapshots_total']} state snapshots at page ends "
            f"({kv['snapshot_bytes'] / 2**20:.2f} MiB)"
        )
    return text


def _host_row(engine, kv: dict) -> str:
    if not kv["host_capacity"]:
        why = "--cache-ram 0" if not engine.options.cache_ram_mib else "no prefix hits to serve"
        return f"off ({why})"
    per_page = engine.executor.page_bytes + (
        engine.executor.bytes_per_state if kv["snapshots_total"] else 0
    )
    return (
        f"{kv['host_capacity'] / 2**20:.0f} MiB of host RAM for pages evicted from the pool "
        f"(about {kv['host_capacity'] // max(per_page, 1)} pages of {per_page / 2**10:.1f} KiB), "
        f"{kv['host_bytes'] / 2**20:.2f} MiB held"
    )


def _options(args, **overrides) -> EngineOptions:
    """The engine options the flags give (each checked by EngineOptions)."""
    kw = dict(
        dtype=args.dtype, quantize=args.quantize, activations=args.activations,
        layout=args.layout, devices=args.devices,
        max_seq_len=args.ctx_size, kv_cache_tokens=args.kv_cache_tokens,
        page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_dtype_k=args.kv_cache_dtype_k, kv_cache_dtype_v=args.kv_cache_dtype_v,
        cache_ram_mib=args.cache_ram, fit=args.fit, fit_target_mib=args.fit_target,
        fit_memory_mib=args.fit_memory, fit_ctx=args.fit_ctx,
        prefix_cache=not args.no_prefix_cache, prefix_snapshots=args.prefix_snapshots,
    )  # fmt: skip
    if getattr(args, "ubatch_size", None):
        kw["prefill_buckets"] = args.ubatch_size
    if getattr(args, "parallel", None) and args.command in ("generate", "serve"):
        kw["slots"] = args.parallel
    if getattr(args, "time_slice_ms", None) is not None:
        kw["time_slice_ms"] = args.time_slice_ms
    if getattr(args, "embedding", False) or getattr(args, "rerank", False):
        kw["embeddings"] = True  # the pooled pass in the compile plan
    if args.no_compile_cache:
        kw["compile_cache_dir"] = None
    elif args.compile_cache_dir:
        kw["compile_cache_dir"] = args.compile_cache_dir
    kw["executable_store_mib"] = args.executable_store_mib
    return EngineOptions(**{**kw, **_spec_options(args), **overrides})


def _load(args):
    from ..loader import load

    return load(args.model, options=_options(args))


def _clear_store(args) -> None:
    """--clear-executable-store, before any command loads a model."""
    from ..runtime.store import ExecutableStore

    cache_dir = _options(args).compile_cache_dir
    if cache_dir is None:
        raise JaxinferError("--clear-executable-store: there is no compile cache dir")
    store = ExecutableStore.inside(cache_dir)
    n = store.clear()
    print(f"cleared {n} executables from {store.directory}", file=sys.stderr)


def _spec_options(args) -> dict:
    """--spec-type / -md as load options (-md alone means a draft model, as in llama.cpp)."""
    how, draft = getattr(args, "spec_type", None), getattr(args, "model_draft", None)
    if how is None and draft is None:
        return {}
    if how in (None, "draft"):
        if draft is None:
            raise JaxinferError("--spec-type draft needs a draft model: pass -md PATH")
        how = draft
    elif draft is not None:
        raise JaxinferError(f"-md is for --spec-type draft; --spec-type {how} uses no draft model")
    return {"speculative": how, "draft_tokens": args.spec_draft_n_max}


def _sampling(args) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=args.n_predict,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=None if args.seed < 0 else args.seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
        grammar=_read(args.grammar_file, "--grammar-file") if args.grammar_file else args.grammar,
        json_schema=args.json_schema,
    )


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e  # a UnicodeDecodeError has no strerror
        raise JaxinferError(f"{flag} {path}: cannot read it ({why})") from None


def _generate(args) -> None:
    from ..runtime.profiler import profile

    with profile(args.profile):
        _generate_run(args)
    if args.profile:
        print(f"profile written to {args.profile}", file=sys.stderr)


def _bench(args) -> None:
    from ..runtime.profiler import profile
    from .bench import render, run_bench

    reuse = {"on": [True], "off": [False], "on,off": [True, False], "off,on": [False, True]}
    if args.graph_reuse not in reuse:
        raise JaxinferError(f"--graph-reuse {args.graph_reuse!r}: use on, off or on,off")
    devices = args.devices if isinstance(args.devices, tuple) else (args.devices,)

    leader = group.lead_engines(args) if args.grouped else None

    def make_engine(*made):
        if leader is not None:
            leader.engine(*made)  # the followers make the same
        engine = _bench_engine(args, *made)
        if leader is not None:
            group.spanned(engine)
            engine.lead(leader)
        return engine

    def progress(row):
        if args.verbose:
            print(f"bench: {row.layout} {row.test} {row.ts} t/s", file=sys.stderr)

    with profile(args.profile), contextlib.ExitStack() as done:
        done.callback(group.finish, leader)
        rows = run_bench(
            make_engine, prompts=list(args.n_prompt), gens=list(args.n_gen),
            depths=list(args.n_depth), repeats=args.repetitions, layouts=args.layout.split(","),
            devices=list(devices),
            slots=list(args.parallel), graph_reuse=reuse[args.graph_reuse],
            mem_bw=args.mem_bw * 1e9 if args.mem_bw else None, progress=progress,
        )  # fmt: skip
    if args.output == "md":  # the table's machine: which kernels ran it
        print(f"cpu kernels: {_kernels()}\n")
    print(render(rows, args.output))


def _bench_engine(args, layout, dev, slots: int, graph_reuse: bool, need: int):
    """The engine of one bench configuration."""
    from ..loader import load

    ctx = args.ctx_size or max(need, 128)
    options = _options(
        args, layout=layout, devices=dev, max_seq_len=ctx, batch_buckets=(slots,),
        graph_reuse=graph_reuse, kv_cache_tokens=ctx * slots,
    )  # fmt: skip
    return load(args.model, options=options)


def _kernels() -> str:
    """One line: the CPU kernel variant in use and why better ones were skipped (off CPU: the
    kernel family in use, JAXINFER_KERNELS)."""
    import jax

    from .. import kernels

    if jax.default_backend() != "cpu":
        return f"- (the {jax.default_backend()} backend: {kernels.family()} kernels)"
    return kernels.status().describe()


def _generate_run(args) -> None:
    params = _sampling(args)  # a bad flag fails before the model loads
    engine = _load(args)
    leader = group.lead(engine) if args.grouped else None
    try:
        _generate_with(args, engine, params)
    finally:
        group.finish(leader)


def _generate_with(args, engine, params: SamplingParams) -> None:
    print(f"model: {engine.name} [{engine.source}]", file=sys.stderr)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise JaxinferError(f"cannot read prompt file {args.file!r}: {e.strerror}") from None
        if not prompts:
            raise JaxinferError(f"prompt file {args.file!r} holds no prompts")
        t0 = time.perf_counter()
        requests = [engine.submit(p, sampling=params) for p in prompts] if engine.slots else None
        results = (
            [r.result() for r in requests]
            if requests
            else engine.generate(prompts, sampling=params)
        )
        wall = time.perf_counter() - t0
        for n, result in enumerate(results):
            print(f"--- [{n}] {prompts[n]}{result.text}  ({result.finish_reason})")
        if requests:
            lat = sorted(r.latency for r in requests)
            ttft = sorted(r.time_to_first_token for r in requests if r.time_to_first_token)
            total = sum(len(r.token_ids) for r in results)
            print(
                f"slots: {engine.slots}, {len(requests)} requests, {total} tokens in {wall:.2f} s "
                f"({total / wall:.1f} tokens/s); latency p50 {_pct(lat, 50):.3f} s, "
                f"p95 {_pct(lat, 95):.3f} s; first token p50 {_pct(ttft, 50):.3f} s",
                file=sys.stderr,
            )
    else:
        prompt = args.prompt if args.prompt is not None else "Once upon a time"
        pieces = engine.generate(prompt, stream=True, sampling=params)  # checked here
        sys.stdout.write(prompt)
        for piece in pieces:
            sys.stdout.write(piece.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    print(engine.perf_stats(), file=sys.stderr)


def _serve(args) -> None:
    from ..serve.server import Server

    template = None
    if args.chat_template_file:
        try:
            with open(args.chat_template_file, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise JaxinferError(f"cannot read --chat-template-file: {e}") from None
    _positive_flag("--parallel", args.parallel)

    def ready(server):
        e = server.worker.engine
        print(f"jaxinfer serve: ready on {server.url}/v1: {e.name} [{e.source}], "
              f"{e.slots} slots, context {e.max_seq_len}", file=sys.stderr, flush=True)  # fmt: skip

    options = ServerOptions(
        host=args.host, port=args.port, api_key=args.api_key, alias=args.alias,
        chat_template=template, tool_call_format=args.tool_call_format,
        slots_endpoint=args.slots_endpoint, progress=True,
        max_body_mib=args.max_body_mib, max_choices=args.max_choices,
        max_stop_strings=args.max_stop_strings, max_grammar_kib=args.max_grammar_kib,
        max_queue=args.max_queue, n_predict=args.n_predict, timeout=args.timeout,
        embedding=args.embedding, rerank=args.rerank, pooling=args.pooling,
        chat_template_kwargs=args.chat_template_kwargs, reasoning_format=args.reasoning_format,
        reasoning_budget=args.reasoning_budget,
    )  # fmt: skip
    leader = []  # process 0 of a group: its Leader, once the engine warmed up

    def join(engine) -> None:
        leader.append(group.lead(engine, on_lost=server.lost))

    server = Server(lambda: _load(args), options, on_ready=ready,
                    join=join if args.grouped else None)  # fmt: skip
    print(f"jaxinfer serve: listening on {server.url}; loading {args.model or 'stories260K'} "
          "(/health answers 503 until it is ready)", file=sys.stderr, flush=True)  # fmt: skip
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised Ctrl-C
        print("jaxinfer serve: stopped", file=sys.stderr)
    finally:
        if args.grouped:
            made = server.worker.engine
            at_ready = server.worker.compiles_at_ready
            after = None if made is None else group.compiles(made) - at_ready
            group.finish(leader[0] if leader else None, after)


def _positive_flag(flag: str, value: int) -> None:
    if value < 1:
        raise JaxinferError(f"{flag} {value} is invalid; it must be >= 1")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def _info(args) -> None:
    import jax

    engine = _load(args)
    cfg, tok = engine.cfg, engine.tokenizer
    scaled = cfg.rope_scaling is not None or cfg.rope_factors is not None
    features = [f for f in ("qkv_bias", "qk_norm", "tie_embeddings") if getattr(cfg, f)]
    rows = [
        ("model", engine.name),
        ("format", engine.source),
        ("architecture", cfg.arch),
        ("parameters", f"{cfg.n_params():,}"),
        ("dtype", args.dtype),
        ("layers", cfg.n_layers),
        ("d_model", cfg.d_model),
        ("heads / kv heads", f"{cfg.n_heads} / {cfg.n_kv_heads} (head_dim {cfg.head_dim})"),
        ("ffn", cfg.d_ff if cfg.dense_layers or not cfg.moe else "- (experts in every layer)"),
        *_experts_rows(cfg),
        *_linear_rows(cfg),
        ("vocab", cfg.vocab_size),
        ("rope", f"theta {cfg.rope_theta:g}" + (", llama3 scaling" if scaled else "")
         + (f", on {cfg.rope_dims} of {cfg.head_dim} dims" if cfg.rope_dims < cfg.head_dim
            else "")),
        ("features", ", ".join(features) or "-"),
        ("sliding window", cfg.sliding_window or "-"),
        ("context", f"{engine.max_seq_len} (model declares {cfg.max_position})"),
        ("tokenizer", f"{tok.kind}; bos {tok.bos_id}, eos {list(tok.eos_ids)}"),
        ("adds BOS", tok.add_bos),
        ("chat template", f"{len(tok.chat_template)} characters" if tok.chat_template else "-"),
        ("cpu kernels", _kernels()),
    ]  # fmt: skip
    mesh = ", ".join(f"{a}={n}" for a, n in engine.mesh.shape.items())
    devices = engine.mesh.devices.size
    rows.append(("layout", f"{engine.layout}: mesh {mesh}, {devices} device(s)"))
    if engine.runner.description:
        rows.append(("stages", engine.runner.description))
    if cfg.moe:
        rows.append(("experts live", _expert_placement(engine)))
    kv = engine.kv_stats()
    rows.append((
        "kv cache",
        f"{kv['pages_total']} pages of {kv['page_size']} tokens, {kv['dtype']} "
        f"({kv['pages_total'] * kv['page_size']} tokens, {kv['bytes_allocated'] / 2**20:.2f} MiB); "
        f"{len(engine.compile_plan())} programs in the compile plan",
    ))  # fmt: skip
    rows.append(("executable store", _store_row(engine)))
    rows.append(("weights", _weight_rows(engine)))
    rows.append(("activations", _activations_row(engine)))
    if kv.get("state_bytes_per_slot"):
        rows.append((
            "linear state",
            f"{kv['state_bytes_per_slot'] / 2**20:.3f} MiB per request (float32 conv + delta-rule "
            f"state of the linear layers), {kv['state_slots']} slots, "
            f"{kv['state_bytes_allocated'] / 2**20:.2f} MiB allocated",
        ))  # fmt: skip
    rows.append(("prefix cache", _prefix_row(engine, kv)))
    rows.append(("host cache", _host_row(engine, kv)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:>{width}} : {value}")
    memory = engine.memory()
    programs, plan = memory.pop("programs"), len(engine.compile_plan())
    print(f"memory (temporaries: XLA's memory_analysis() of {programs} of the {plan} programs, "
          "those compiled or in the executable store):")  # fmt: skip
    for key, value in memory.items():
        shown = "-" if value is None else f"{value / 2**20:.2f} MiB"
        print(f"  {key.replace('_', ' '):>12} : {shown}")
    if engine.fit_plan is not None:
        _print_fit(engine.fit_plan)
    plan = engine.compile_plan()
    print(f"compile plan ({len(plan)} programs; warmup() and serve build them all):")
    for p in plan:
        shape = ", ".join(f"{k}={v}" for k, v in (("B", p.batch), ("T", p.tokens)) if v)
        print(f"  {p.program}[{shape}]: {p.why}" if shape else f"  {p.program}: {p.why}")
    print("sharding plan (parameter: shape, partition spec):")
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.params)[0]:
        keys = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
        name = ".".join(str(k) for k in keys).replace(".parts.w", "")  # a one-part QArray
        print(f"  {name}: {list(leaf.shape)} {leaf.sharding.spec}")


def _print_fit(plan) -> None:
    """--fit: what the plan chose and the bytes of each part (runtime/fit.py)."""
    print(plan.summary())
    for key, value in plan.rows():
        print(f"  {key.replace('_', ' '):>12} : {value / 2**20:.2f} MiB")


def _store_row(engine) -> str:
    """Where the executable store is, what it holds and its cap."""
    store = engine.compile_cache.store
    if store is None:
        return "off (no compile cache dir, --executable-store-mib 0, or several processes)"
    use = store.usage()
    return (
        f"{store.directory}: {use.files} executables, {use.bytes / 2**20:.1f} of "
        f"{store.capacity / 2**20:.0f} MiB"
    )


def _weight_rows(engine) -> str:
    """Device bytes of the weights, by type (quantized formats and float dtypes)."""
    import jax

    from ..engine import device_bytes
    from ..ops.quant import QArray

    by_type: dict[str, list[int]] = {}
    leaves = jax.tree.leaves(engine.params, is_leaf=lambda x: isinstance(x, QArray))
    for leaf in leaves:
        if isinstance(leaf, QArray):  # a float32 weight placed for the kernel is float32
            kind = "float32" if leaf.fmt == "f32" else leaf.fmt.upper()
        else:
            kind = str(leaf.dtype)
        count, nbytes = by_type.get(kind, [0, 0])
        by_type[kind] = [count + 1, nbytes + device_bytes(leaf)]
    parts = ", ".join(
        f"{kind} {n / 2**20:.2f} MiB in {c} tensors" for kind, (c, n) in sorted(by_type.items())
    )
    return f"{engine.weight_bytes() / 2**20:.2f} MiB on the devices ({parts})"


def _activations_row(engine) -> str:
    """What the GGUF block weights multiply: both modes, the one in use first."""
    import jax

    from ..ops.quant import INT8_ACTIVATIONS, QArray

    leaves = jax.tree.leaves(engine.params, is_leaf=lambda x: isinstance(x, QArray))
    fmts = sorted({x.fmt.upper() for x in leaves if isinstance(x, QArray)
                   and x.fmt in INT8_ACTIVATIONS})  # fmt: skip
    if not fmts:
        return "float32 (no GGUF block weights; --activations applies to Q4_K, Q8_0, ...)"
    modes = {
        "int8": "quantized to 8 bits per block as llama.cpp does, integer products",
        "float": "float32, the dequantized weights' products",
    }
    mode = engine.options.activations
    other = next(m for m in modes if m != mode)
    return f"{mode} ({modes[mode]}) for {', '.join(fmts)}; --activations {other}: {modes[other]}"


def _linear_rows(cfg) -> list[tuple[str, str]]:
    if not cfg.linear_layers:
        return []
    attention = [i for i in range(cfg.n_layers) if not cfg.is_linear(i)]
    return [
        ("linear attention", (
            f"Gated DeltaNet in {len(cfg.linear_layers)} of {cfg.n_layers} layers (attention in "
            f"{attention}); {cfg.linear_k_heads} key / {cfg.linear_v_heads} value heads of "
            f"{cfg.linear_k_dim} / {cfg.linear_v_dim}, conv {cfg.conv_kernel} taps"
        )),
        ("attention gate", "sigmoid output gate" if cfg.attn_gate else "-"),
    ]  # fmt: skip


def _experts_rows(cfg) -> list[tuple[str, str]]:
    if not cfg.moe:
        return []
    text = f"{cfg.n_experts}, {cfg.n_experts_used} per token, width {cfg.d_ff_expert}"
    text += ", renormalized" if cfg.norm_topk_prob else ""
    if cfg.d_ff_shared:
        text += f"; shared expert width {cfg.d_ff_shared}" + (" (gated)" if cfg.shared_gate else "")
    if cfg.dense_layers:
        text += f"; dense layers {list(cfg.dense_layers)}"
    return [("experts", text), ("active parameters", f"{cfg.n_active_params():,} per token")]


def _expert_placement(engine) -> str:
    """Which experts each device holds, read from the placed weights' shardings."""
    import jax

    params = engine.params  # per layer, per pipeline stage layer, or per depth-shared unit
    layers = (
        params.get("layers") or params.get("stage_layers") or [u for r in params["runs"] for u in r]
    )
    layers = layers.values() if isinstance(layers, dict) else layers
    # a plain weight, or a quantized one's first part: both lead with [..., E, F]
    leaf = jax.tree.leaves(next(layer["moe"]["w_gate"] for layer in layers if "moe" in layer))[0]
    axis = leaf.ndim - 3  # [..., E, F, D] (pipeline slots lead with [pp], shared units [L])
    held: dict[tuple[int, int], list[int]] = {}
    for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
        span = index[axis].indices(leaf.shape[axis])[:2]
        held.setdefault(span, []).append(device.id)
    if len(held) == 1:
        return "every device holds every expert"
    return "; ".join(
        f"experts {a}-{b - 1} on devices {', '.join(map(str, sorted(ids)))}"
        for (a, b), ids in sorted(held.items())
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(name)s: %(message)s",
    )
    for noisy in ("jax", "absl"):  # -v is for jaxinfer's own debug lines (recompiles...)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        commands = {"generate": _generate, "serve": _serve, "info": _info, "bench": _bench}
        if args.clear_executable_store:
            _clear_store(args)
        args.grouped = args.command != "info" and group.join(args)  # before any device
        if args.grouped and not group.leader():  # follow process 0 until it stops the group
            if args.command == "bench":
                group.follow_engines(args, lambda *made: _bench_engine(args, *made))
            else:
                group.follow(_load(args), warm=args.command == "serve")
            return 0
        commands[args.command](args)
    except JaxinferError as e:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0
