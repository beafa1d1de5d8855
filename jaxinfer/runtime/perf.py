"""Perf stats, llama.cpp style: phase timings, graph reuse, recompiles, compiles, KV pages."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class PerfStats:
    load_ms: float = 0.0
    prompt_tokens: int = 0
    prompt_ms: float = 0.0  # compile time excluded, as llama.cpp's timings exclude setup
    eval_tokens: int = 0
    eval_ms: float = 0.0
    eval_device_ms: float = 0.0  # part of eval_ms inside compiled decode calls
    total_ms: float = 0.0
    graphs_reused: int = 0  # calls served by a cached executable
    recompiles_same: int = 0  # same-shape recompiles: something should have been reused
    recompiles_diff: int = 0  # changed-shape recompiles: new buckets
    recompiles_sharding: int = 0  # after a layout change; expected, not counted above
    programs: int = 0  # executables compiled: the warmup plan, initial compiles, recompiles
    compile_seconds: float = 0.0
    warmup_programs: int = 0  # of `programs`, compiled by warmup() (the plan)
    warmup_seconds: float = 0.0  # wall time of warmup() compiles (they run in parallel)
    untracked_compiles: int = 0  # compiles outside the CompileCache (jax.monitoring)
    persistent_hits: int = 0  # executables loaded from the persistent compilation cache
    persistent_misses: int = 0
    loaded: int = 0  # executables loaded from the executable store (not compiled)
    load_seconds: float = 0.0
    kv_pages_in_use: int = 0  # at the time of the snapshot
    kv_pages_total: int = 0
    kv_page_size: int = 0
    kv_bytes_in_use: int = 0
    kv_bytes_allocated: int = 0
    spec_method: str = ""  # speculative decoding: "ngram", "draft", "mtp"; "" = off
    spec_k: int = 0  # drafts proposed per step at most
    draft_tokens: int = 0  # drafts proposed
    accepted_tokens: int = 0  # of them, accepted
    spec_steps: int = 0  # verify steps, summed over rows (each makes 1 + its accepted drafts)
    preempted: int = 0  # requests sent back to the queue after their time slice

    def host_share(self) -> float:
        """Share of decode wall time spent on the host outside compiled code."""
        return 1.0 - self.eval_device_ms / self.eval_ms if self.eval_ms else 0.0

    def copy(self) -> PerfStats:
        return PerfStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __str__(self) -> str:
        def rate(n, ms):
            per = ms / n if n else 0.0
            tps = 1000.0 * n / ms if ms else 0.0
            return (
                f"{ms:10.2f} ms / {n:5d} tokens "
                f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)"
            )

        lazy = self.programs - self.warmup_programs
        mib = 2.0**20
        spec = []
        if self.spec_method:
            share = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
            per = (
                (self.spec_steps + self.accepted_tokens) / self.spec_steps if self.spec_steps else 0
            )
            spec = [
                f"perf:      speculative: {self.spec_method}, K = {self.spec_k}, drafted = "
                f"{self.draft_tokens}, accepted = {self.accepted_tokens} ({share:.1%}), "
                f"tokens per step = {per:.2f}"
            ]
        return "\n".join(
            [
                f"perf:        load time = {self.load_ms:10.2f} ms",
                f"perf: prompt eval time = {rate(self.prompt_tokens, self.prompt_ms)}",
                f"perf:        eval time = {rate(self.eval_tokens, self.eval_ms)}",
                f"perf:   eval host time = {self.host_share():.1%} of eval (outside compiled code)",
                f"perf:       total time = {self.total_ms:10.2f} ms",
                f"perf:    graphs reused = {self.graphs_reused}",
                f"perf:       recompiles = {self.recompiles_same} / {self.recompiles_diff} "
                f"(same shape) / (changed shape), {self.recompiles_sharding} after resharding",
                f"perf:         compiles = {self.warmup_programs} programs (warmup, "
                f"{self.warmup_seconds:.2f} s) + {lazy} outside warmup "
                f"({self.compile_seconds:.2f} s compiling in all); untracked = "
                f"{self.untracked_compiles}; persistent cache hits = {self.persistent_hits}, "
                f"misses = {self.persistent_misses}",
                f"perf:           loaded = {self.loaded} executables from the store "
                f"({self.load_seconds:.2f} s)",
                f"perf:         kv cache = {self.kv_pages_in_use} / {self.kv_pages_total} pages "
                f"of {self.kv_page_size} tokens in use ({self.kv_bytes_in_use / mib:.2f} / "
                f"{self.kv_bytes_allocated / mib:.2f} MiB)",
                *spec,
            ]
        )
