"""KVManager: the one owner of an engine's KV page pool, between the scheduler and the executor.

It plans the pool (`plan`), admits a request's KV (`admit`: the prefix-cache lookup, then the
reservation of every page it can need), grows it page by page (`grow`), names its full pages
by chain hash as they fill (`register`), builds the block and snapshot tables the programs read
(`view`, `tables`), and takes everything back (`release`). The scheduler sees a `Lease` per
request and never a hash, a pin or a snapshot. vLLM's `KVCacheManager` is the shape;
pages.py holds the pool's data structures (free pages, reference counts, the LRU of cached
pages and of snapshots).

Prefix caching: an admitted request maps the longest cached prefix of its prompt's full pages
into its table (the prompt's last token is always computed, for its logits); hybrid models
start the prefill after it from the snapshot of the linear layers' state at the prefix's end,
so a hit ends at the last page whose snapshot is kept. Pages a request fills are registered as
they fill, prompt and generated tokens alike, each with the snapshot written at its end (an
MTP model's one position late, once the MTP head's row there is written too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import RequestError
from ..model.kvcache import NULL_PAGE, KVConfig, KVView
from .pages import PagePool, Snapshots, chain_hash, root_hash


@dataclass(eq=False)
class Lease:
    """One request's hold on the pool: its pages in position order and the pages promised to
    it and not yet taken; with the prefix cache, the prompt tokens its hit supplied, the chain
    hashes of its full pages so far, how many are registered (or were hits), the snapshot its
    next prompt chunk starts from (-1: its own state index) and the snapshots taken for
    pages it has not filled yet (page index -> snapshot)."""

    reserved: int
    pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    salt: str | None = None
    hashes: list[bytes] | None = None  # None: the request neither reads nor fills the cache
    registered: int = 0
    source: int = -1
    pending: dict[int, int] = field(default_factory=dict)


class KVManager:
    def __init__(self, config: KVConfig, page_bytes: int, *, prefix_cache: bool, model_id: str,
                 mtp: bool = False, carries_state: bool = False):  # fmt: skip
        """`page_bytes`: one page of every layer's pools; `model_id` roots every chain hash;
        `mtp`: a position's row is complete one token late (the MTP head writes it then);
        `carries_state`: a prefix leaves a state besides its pages, so a hit needs a snapshot
        (with none kept, such a model, or one with an MTP head, takes no hit)."""
        self.config = config
        self.carries_state = carries_state
        snapshots = Snapshots(config.first_snapshot, config.snapshots) if config.snapshots else None
        self.pool = PagePool(config, page_bytes, snapshots)
        self.prefix_cache = prefix_cache
        self.model_id = model_id
        self.mtp = mtp
        self._leases: list[Lease] = []

    @staticmethod
    def plan(tokens: int, max_seq_len: int, page_size: int, rows: int, *,
             snapshots: int | None, carries_state: bool, page_bytes: int = 0,
             state_bytes: int = 0) -> KVConfig:  # fmt: skip
        """The pool for `tokens` positions and `rows` requests at once. Models whose prefixes
        leave a state besides their pages (`carries_state`) and serve a prefix cache keep
        `snapshots` of it; None: as many as the pages' bytes hold (`page_bytes` a page,
        `state_bytes` a snapshot), at most one a page. Others keep none."""
        kept = 0
        if carries_state and snapshots != 0:
            pages = -(-tokens // page_size)
            kept = snapshots if snapshots is not None else (
                min(pages, pages * page_bytes // state_bytes) if state_bytes else pages
            )  # fmt: skip
        return KVConfig.plan(tokens, max_seq_len, page_size, rows, kept)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def snapshots(self) -> bool:
        """Whether prefix hits start from state snapshots (and page ends write them)."""
        return self.pool.snapshots is not None

    def pages_for(self, tokens: int) -> int:
        return self.pool.pages_for(tokens)

    def check(self, tokens: int, what: str, fix: str) -> None:
        """Refuse work that could never get its pages, with the numbers."""
        need, total = self.pages_for(tokens), self.config.usable_pages
        if need > total:
            raise RequestError(
                f"{what} needs {need} KV pages ({tokens} positions, {self.page_size} per page) "
                f"but the pool holds {total}; {fix}"
            )

    # ---- a request's lease --------------------------------------------------------------

    def admit(self, prompt: Sequence[int], tokens: int, *, cache: bool = False,
              salt: str | None = None) -> Lease | None:  # fmt: skip
        """A lease of every page `tokens` positions need, its prompt's longest cached prefix
        mapped in when `cache` (and the prefix cache is on); None while the pool lacks the
        pages, or while a running prompt fills the next page this one could hit (it waits to
        hit it rather than compute it twice)."""
        hashes, hits = self._lookup(prompt, salt) if cache and self.prefix_cache else (None, [])
        if hashes is not None and self._filling(prompt, hashes, len(hits)):
            return None
        need = self.pages_for(tokens) - len(hits)
        if not self.pool.admit(hits, need):
            return None
        lease = Lease(need, list(hits), len(hits) * self.page_size, salt, hashes, len(hits))
        if hits and self.pool.snapshots:
            assert hashes is not None  # hits come from a lookup
            lease.source = self.pool.snapshots.pin(hashes[len(hits) - 1])
        if hashes is not None:
            self.pool.queries += len(prompt)
            self.pool.hits += lease.cached_tokens
        self._leases.append(lease)
        return lease

    def _lookup(self, prompt: Sequence[int], salt: str | None) -> tuple[list[bytes], list[int]]:
        """The chain hashes of the prompt's full pages and the pages of its longest cached
        prefix: one that leaves the prompt's last token to compute and, where the model needs
        one, ends at a page with a kept snapshot."""
        page, parent, hashes = self.page_size, root_hash(self.model_id, salt), []
        for j in range(len(prompt) // page):
            parent = chain_hash(parent, prompt[j * page : (j + 1) * page])
            hashes.append(parent)
        hits = self.pool.lookup(hashes[: (len(prompt) - 1) // page])
        snapshots = self.pool.snapshots
        if (self.carries_state or self.mtp) and snapshots is None:
            hits = []  # no state to start from (the MTP head's row before the hit: steps.py)
        while snapshots and hits and snapshots.find(hashes[len(hits) - 1]) is None:
            hits.pop()
        return hashes, hits

    def _filling(self, prompt: Sequence[int], hashes: list[bytes], hits: int) -> bool:
        """Whether the page after a prompt's cached prefix, one it could hit, is one a running
        request is filling now (the same prompt's other choices, or another sharing it)."""
        if hits >= (len(prompt) - 1) // self.page_size:
            return False
        return any(
            a.hashes is not None and hashes[hits] in a.hashes[a.registered :] for a in self._leases
        )

    def grow(self, lease: Lease, tokens: int) -> None:
        """Take pages from the lease's reservation until they cover `tokens` positions."""
        lease.reserved = self.pool.grow(lease.pages, tokens, lease.reserved)

    def started(self, lease: Lease) -> None:
        """The lease's first prompt chunk ran: the snapshot it started from is read."""
        if lease.source >= 0:
            assert self.pool.snapshots is not None  # a source is a pinned snapshot
            self.pool.snapshots.unpin(lease.source)
            lease.source = -1

    def register(self, lease: Lease, filled: int, tokens: Callable[[], list[int]]) -> None:
        """Name the lease's pages wholly below position `filled` (written, prompt or
        generated), each with the snapshot taken for it; `tokens()` gives the request's
        tokens so far (prompt and generated) for pages of generated tokens."""
        if lease.hashes is None:
            return
        if self.mtp:  # its row at position p waits for token p + 1
            filled -= 1
        page, known = self.page_size, None
        while lease.registered < filled // page:
            j = lease.registered
            if j == len(lease.hashes):  # a page of generated tokens: hashed once filled
                known = tokens() if known is None else known
                parent = lease.hashes[-1] if j else root_hash(self.model_id, lease.salt)
                lease.hashes.append(chain_hash(parent, known[j * page : (j + 1) * page]))
            self.pool.register(lease.pages[j], lease.hashes[j])
            snap = lease.pending.pop(j, None)
            if snap is not None:
                assert self.pool.snapshots is not None  # pending slots are snapshots
                self.pool.snapshots.keep(lease.hashes[j], snap)
            lease.registered += 1

    def release(self, lease: Lease) -> None:
        """Give back the lease's pages, its reservation, its unread snapshot and the
        snapshots it took for pages it never filled."""
        self.pool.release(lease.pages, lease.reserved)
        lease.reserved = 0
        self.started(lease)  # cancelled before its first chunk: the snapshot is unread
        for snap in lease.pending.values():
            assert self.pool.snapshots is not None  # pending slots are snapshots
            self.pool.snapshots.give(snap)
        lease.pending.clear()
        if lease in self._leases:
            self._leases.remove(lease)

    # ---- what the programs read ---------------------------------------------------------

    def table(self, leases: Sequence[Lease], batch: int) -> np.ndarray:
        """The block table [batch, NB]: each lease's pages, the null page elsewhere."""
        table = np.full((batch, self.config.table_width), NULL_PAGE, np.int32)
        for b, lease in enumerate(leases):
            table[b, : len(lease.pages)] = lease.pages
        return table

    def snaps(self, leases: Sequence[Lease], batch: int, upto: Sequence[int]) -> np.ndarray:
        """The snapshot table [batch, NB]: per row, for each page it may fill in this call
        (pages ending below position upto[b]), the snapshot taken for it (taken now if
        need be); out of range (none) elsewhere."""
        kv, snapshots = self.config, self.pool.snapshots
        assert snapshots is not None  # only models with snapshots have a snapshot table
        table = np.full((batch, kv.table_width), kv.n_states, np.int32)
        for b, lease in enumerate(leases):
            if lease.hashes is None:
                continue
            for j in range(lease.registered, upto[b] // kv.page_size):
                if j not in lease.pending:
                    known = j < len(lease.hashes) and snapshots.find(lease.hashes[j]) is not None
                    snap = None if known else snapshots.take()
                    if snap is None:
                        continue
                    lease.pending[j] = snap
                table[b, j] = lease.pending[j]
        return table

    def tables(self, leases: Sequence[Lease], batch: int, upto: Sequence[int]) -> tuple:
        """A decode call's tables: the block table, and with snapshots the snapshot table."""
        table = (self.table(leases, batch),)
        return table + (self.snaps(leases, batch, upto),) if self.snapshots else table

    def view(self, leases: Sequence[Lease], batch: int, start, length, state_index,
             upto: Sequence[int] | None = None) -> KVView:  # fmt: skip
        """A prompt chunk's view: rows at positions start [B], length [B] tokens, with
        state indices state_index [B]; with snapshots, where each row's linear states start
        from (a prefix hit's snapshot, else its own state) and, given `upto`, the snapshot
        table of the pages the chunk fills."""
        table = self.table(leases, batch)
        view = KVView(table, start, length, state_index)  # type: ignore[arg-type]  # host rows, put later
        if not self.snapshots:
            return view
        source = np.array(state_index, np.int32)
        for b, lease in enumerate(leases):
            if lease.source >= 0:
                source[b] = lease.source
        view = view.replace(source=source)
        return view if upto is None else view.replace(snaps=self.snaps(leases, batch, upto))

    # ---- the cache as a whole -----------------------------------------------------------

    def clear(self) -> None:
        """Forget every cached prefix (running requests keep their pages)."""
        self.pool.clear()

    def stats(self) -> dict:
        """The pool's counts (PagePool.stats) and, with snapshots, theirs (Snapshots.stats)."""
        snapshots = self.pool.snapshots
        empty = {"snapshots_total": 0, "snapshots_in_use": 0, "snapshots_cached": 0}
        return {**self.pool.stats(), **(snapshots.stats() if snapshots else empty)}
