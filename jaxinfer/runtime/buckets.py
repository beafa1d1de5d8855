"""Shape buckets: the few batch sizes and prompt-chunk lengths every program is compiled for.

A program's shapes never depend on the context length (rows reach their KV pages through block
tables), so the plan is small and known before serving: `cache`, `decode[B]` (with
speculation `verify[B]` in its place; n-gram speculation plans both) per batch bucket,
`prefill[B, T]` per batch bucket and chunk within the prompt token budget (B x T at most the
largest chunk, as llama.cpp's n_ubatch bounds the tokens of one prompt pass), `sample[R]` (the
token after a prompt, drawn from prefill's logits, padded to R, the most rows a prefill call
takes: one sampler in memory, not one per bucket), and
`score[1, T]` per chunk but the smallest (a short text pads to the next one: scoring is for
evaluation, not latency); when embeddings or rerank are served, `pool[B, T]` at prefill's
shapes, up to `pool` rows a call. `why()` says what each program is for (`jaxinfer info`
lists them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import JaxinferError


@dataclass(frozen=True)
class ShapePlan:
    chunks: tuple[int, ...]  # prompt chunk lengths T, ascending
    batches: tuple[int, ...]  # batch sizes B, ascending; the last is the most rows at once
    # the decode programs: ("decode",); with speculation ("verify",); with n-gram speculation
    # ("verify", "decode"), a call choosing (drafting.py)
    loops: tuple[str, ...] = ("decode",)
    pool: int = 0  # most rows of a pooled pass (embeddings, rerank) a call; 0: none planned

    @staticmethod
    def make(
        chunks, batches, slots: int | None, max_seq_len: int, loops=("decode",), pool: int = 0
    ) -> ShapePlan:
        """Chunks never longer than the context; batch buckets up to the rows served at once
        (the slots, else the largest batch bucket), that number itself included."""
        for name, values in (("prefill_buckets", chunks), ("batch_buckets", batches)):
            values = tuple(values) if isinstance(values, list | tuple) else ()
            if not values or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values
            ):
                raise JaxinferError(
                    f"{name} is invalid; it must be a non-empty list of integers >= 1"
                )
        rows = slots or max(batches)
        chunks = tuple(sorted({min(c, max_seq_len) for c in chunks}))
        batches = tuple(sorted({b for b in batches if b < rows} | {rows}))
        return ShapePlan(chunks, batches, tuple(loops), pool)

    @property
    def rows(self) -> int:
        return self.batches[-1]

    @property
    def prompt_budget(self) -> int:
        """Most prompt tokens (padding included) in one prefill call."""
        return self.chunks[-1]

    def rows_for(self, chunk: int) -> int:
        """Most rows one prefill call of `chunk` tokens each can take (a batch bucket): the
        largest within the prompt token budget, else the smallest bucket (one row at a time
        when 1 is a bucket)."""
        fits = [B for B in self.batches if B * chunk <= self.prompt_budget or B == 1]
        return max(fits, default=self.batches[0])

    @property
    def sample_rows(self) -> int:
        """R, the most rows a prefill call takes: the rows of its logits and of `sample`."""
        return self.rows_for(self.chunks[0])

    def chunk_for(self, remaining: int) -> int:
        """The prompt chunk for `remaining` tokens: the smallest that holds them, else the
        largest (a long prompt takes several)."""
        return bucket_for(remaining, self.chunks)

    @property
    def score_chunks(self) -> tuple[int, ...]:
        return self.chunks[1:] or self.chunks

    def score_chunk_for(self, remaining: int) -> int:
        return bucket_for(remaining, self.score_chunks)

    def batch_for(self, n: int) -> int:
        return bucket_for(n, self.batches)

    def jobs(self) -> list[tuple[str, int, int]]:
        """Every (program, B, T) serving can call."""
        jobs = [("cache", 0, 0)]
        jobs += [(loop, B, 0) for loop in self.loops for B in self.batches]
        jobs += [("prefill", B, T) for B in self.batches for T in self.chunks
                 if B <= self.rows_for(T)]  # fmt: skip
        jobs += [("sample", self.sample_rows, 0)]
        jobs += [("score", 1, T) for T in self.score_chunks]
        if self.pool:
            jobs += [("pool", B, T) for B in self.batches for T in self.chunks
                     if B <= self.rows_for(T) and B <= self.batch_for(self.pool)]  # fmt: skip
        return jobs

    def why(self, name: str, B: int, T: int) -> str:
        """What one program of the plan serves."""
        budget = self.prompt_budget
        return {
            "cache": "allocates the KV pools (and linear-layer states), zeroed, in their shardings",
            "decode": f"decodes {B} row(s) at once (batch bucket {B}), several steps a call",
            "verify": f"drafts and verifies {B} row(s) at once (speculative decoding)",
            "prefill": f"prompt chunks of up to {T} tokens for {B} row(s) ({B}x{T} <= {budget})",
            "sample": f"the token after a prompt, from prefill's logits (up to {B} rows)",
            "score": f"logits at every position, {T} tokens a pass (Engine.logits)",
            "pool": f"pooled hidden states of {B} text(s), {T} tokens a call (embed, rerank)",
        }[name]


def bucket_for(n: int, buckets) -> int:
    """Smallest bucket >= n, else the largest."""
    return next((x for x in buckets if x >= n), buckets[-1])
