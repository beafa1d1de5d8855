"""The program registry: each compiled program of one model on one mesh, with its typed
per-call inputs (for warmup and serving alike), output shardings and donated arguments.

The functions are pure functions of arrays: the plain ones in steps.py (`cache`, `prefill`,
`decode`, `score`, `pool`), speculative decoding's `verify` in speculative.py. A speculative engine
serves `verify[B]` where a plain one serves `decode[B]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from ..model.kvcache import KVConfig
from ..ops.sampling import PENALTY_WINDOW, SamplingRows
from ..parallel.placement import Runner
from . import steps
from .inputs import Chunk, DecodeState, abstract
from .speculative import SpecConfig, verify


@dataclass(frozen=True)
class Program:
    fn: Callable  # the pure function
    inputs: Callable[[int, int, int], tuple]  # (B, T, NB) -> abstract per-call inputs
    outputs: tuple[str, ...]  # per output: "kv" (the pools' shardings) or "rep" (replicated)
    donate: tuple[str, ...] = ("kv",)  # argument names donated to the call


def programs(
    runner: Runner,
    kv_config: KVConfig,
    decode_chunk: int,
    vocab: int,
    spec: SpecConfig | None = None,
    draft: Runner | None = None,
) -> dict[str, Program]:
    """The programs of one model on one mesh; `decode_chunk`, most decode steps a call,
    `vocab` = V, the logits' width (the sampling rows carry token masks over it).
    With a draft model, `params` is (the model's, the draft's) and `kv` lists the model's
    layers then the draft's (one page pool, one set of state indices)."""
    setup = steps.Setup(runner, kv_config, decode_chunk, vocab, spec, draft)

    snaps = setup.snapshots  # prefix snapshots: prefill and the loops take snapshot tables

    def loop_inputs(B: int, T: int, NB: int) -> tuple:
        history = spec.history if spec else 0
        state = DecodeState.abstract(B, history)
        fixed = (state, abstract(B, NB), SamplingRows.abstract(B, vocab), abstract())
        return (*fixed, abstract(B, NB)) if snaps else fixed

    def prefill_inputs(B: int, T: int, NB: int) -> tuple:
        chunk = Chunk.abstract(B, T, NB, snaps, snaps)
        return chunk, abstract(B, PENALTY_WINDOW), SamplingRows.abstract(B, vocab)

    return {
        "cache": Program(partial(steps.cache, setup), lambda B, T, NB: (), ("kv",), donate=()),
        "prefill": Program(partial(steps.prefill, setup), prefill_inputs, ("kv", "rep", "rep")),
        "decode": Program(partial(steps.decode, setup), loop_inputs, ("kv", "rep", "rep", "rep")),
        "verify": Program(partial(verify, setup), loop_inputs, ("kv",) + ("rep",) * 4),
        "score": Program(
            partial(steps.score, setup),
            lambda B, T, NB: (Chunk.abstract(B, T, NB, snaps), abstract(B, T)),
            ("kv", "rep", "rep"),
        ),
        "pool": Program(
            partial(steps.pool, setup),
            lambda B, T, NB: (Chunk.abstract(B, T, NB, snaps), abstract(steps.PICK)),
            ("kv", "rep", "rep"),
        ),
    }
