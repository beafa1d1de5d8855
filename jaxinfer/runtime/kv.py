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

The host tier (`host_bytes` > 0, host_cache.py): cached pages evicted from the pool are listed
as they go (`spill` hands them out, `keep` stores their copied contents), and a lookup goes on
past the pool's hits into the host store: those pages get fresh pages of the lease, registered
at once, and the lease's `restore` says what the scheduler copies into them (and, for hybrid
models, into a snapshot the prefill starts from) before any other call runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import RequestError
from ..model.kvcache import NULL_PAGE, KVConfig, KVView
from .host_cache import HostCache, HostPage
from .pages import PagePool, Snapshots, chain_hash, root_hash


@dataclass(frozen=True, eq=False)
class Restore:
    """Host-tier pages a lease hit: the device pages they go to, their contents, and the
    snapshot that takes the state at the last one's end (-1: none to write)."""

    pages: list[int]
    entries: list[HostPage]
    snap: int = -1

    def contents(self) -> list[np.ndarray]:
        """[n, ...] per paged leaf of the pools."""
        return [np.stack(leaf) for leaf in zip(*(e.pages for e in self.entries), strict=True)]

    def state(self) -> list[np.ndarray] | None:
        """[1, ...] per copied state leaf: the state at the last page's end (None: none)."""
        last = self.entries[-1].state
        return None if self.snap < 0 or last is None else [a[None] for a in last]


@dataclass(frozen=True, eq=False)
class Spill:
    """Cached pages evicted from the pool whose contents the host tier wants: the pages, their
    hashes and their snapshots (-1: none)."""

    pages: list[int]
    hashes: list[bytes]
    snaps: list[int]


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
    restore: Restore | None = None  # host-tier hits to copy in before its first chunk


class KVManager:
    def __init__(self, config: KVConfig, page_bytes: int, *, prefix_cache: bool, model_id: str,
                 mtp: bool = False, carries_state: bool = False,
                 host_bytes: int = 0):  # fmt: skip
        """`page_bytes`: one page of every layer's pools; `model_id` roots every chain hash;
        `mtp`: a position's row is complete one token late (the MTP head writes it then);
        `carries_state`: a prefix leaves a state besides its pages, so a hit needs a snapshot
        (with none kept, such a model, or one with an MTP head, takes no hit); `host_bytes`:
        the host tier's capacity (0: none; none either where no hit could come of it)."""
        self.config = config
        self.carries_state = carries_state
        snapshots = Snapshots(config.first_snapshot, config.snapshots) if config.snapshots else None
        tiered = self.tiered(config, prefix_cache, host_bytes, mtp, carries_state)
        self.host = HostCache(host_bytes) if tiered else None
        self.pool = PagePool(config, page_bytes, snapshots, spill=self.host is not None)
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

    @staticmethod
    def tiered(config: KVConfig, prefix_cache: bool, host_bytes: int, mtp: bool,
               carries_state: bool) -> bool:  # fmt: skip
        """Whether a host tier serves: one is asked for, and a hit can come of it (a model
        whose prefixes leave a state, or with an MTP head, hits only with snapshots)."""
        hits = config.snapshots > 0 or not (carries_state or mtp)
        return prefix_cache and host_bytes > 0 and hits

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
        hashes, hits, host = (
            self._lookup(prompt, salt) if cache and self.prefix_cache else (None, [], [])
        )  # fmt: skip
        if hashes is not None and self._filling(prompt, hashes, len(hits) + len(host)):
            return None
        need = self.pages_for(tokens) - len(hits)
        if not self.pool.admit(hits, need):
            return None
        snapshots, snap = self.pool.snapshots, -1
        if host and snapshots and snapshots.find(host[-1]) is None:
            taken = snapshots.take()  # for the state at the host hits' end
            if taken is None:  # every snapshot is being written or read: wait for one
                self.pool.release(list(hits), need)
                return None
            snap = taken
        cached = (len(hits) + len(host)) * self.page_size
        lease = Lease(need, list(hits), cached, salt, hashes, len(hits))
        if host:
            self._restore(lease, host, snap)
        elif hits and snapshots:
            assert hashes is not None  # hits come from a lookup
            lease.source = snapshots.pin(hashes[len(hits) - 1])
        if hashes is not None:
            self.pool.queries += len(prompt)
            self.pool.hits += lease.cached_tokens
        self._leases.append(lease)
        return lease

    def _lookup(
        self, prompt: Sequence[int], salt: str | None
    ) -> tuple[list[bytes], list[int], list[bytes]]:
        """The chain hashes of the prompt's full pages, the pages of its longest cached prefix
        in the pool, and the hashes of the host tier's pages that continue it: together a
        prefix that leaves the prompt's last token to compute and, where the model needs one,
        ends at a page with a kept snapshot (the pool's, or a host entry's state)."""
        page, parent, hashes = self.page_size, root_hash(self.model_id, salt), []
        for j in range(len(prompt) // page):
            parent = chain_hash(parent, prompt[j * page : (j + 1) * page])
            hashes.append(parent)
        limit = (len(prompt) - 1) // page
        hits = self.pool.lookup(hashes[:limit])
        host: list[bytes] = []  # and whether each keeps a state:
        stated: list[bool] = []
        if self.host is not None:
            for h in hashes[len(hits) : limit]:
                entry = self.host.find(h)
                if entry is None:
                    break
                host.append(h)
                stated.append(entry.state is not None)
        snapshots = self.pool.snapshots
        if (self.carries_state or self.mtp) and snapshots is None:
            return hashes, [], []  # no state to start from (the MTP head's row: steps.py)
        if snapshots is not None:
            while host and not stated[len(host) - 1]:
                host.pop()
            while not host and hits and snapshots.find(hashes[len(hits) - 1]) is None:
                hits.pop()
        return hashes, hits, host

    def _restore(self, lease: Lease, host: list[bytes], snap: int) -> None:
        """Give the lease's host-tier hits fresh pages, registered at once (the scheduler copies
        their contents in before any other call runs), and, for hybrid models, the snapshot
        its prefill starts from: `snap` (the state copied in) or one the pool kept."""
        assert self.host is not None  # host hits come from the host tier
        start = len(lease.pages)
        lease.reserved = self.pool.grow(lease.pages, (start + len(host)) * self.page_size,
                                        lease.reserved)  # fmt: skip
        pages = lease.pages[start:]
        entries = [self.host.get(h) for h in host]
        for page, h in zip(pages, host, strict=True):
            self.pool.register(page, h)
        lease.registered = len(lease.pages)
        self.host.hits += len(host) * self.page_size
        snapshots = self.pool.snapshots
        if snapshots is not None:
            if snap >= 0:
                snapshots.keep(host[-1], snap)
            lease.source = snapshots.pin(host[-1])
        lease.restore = Restore(pages, entries, snap)

    def spill(self) -> Spill | None:
        """The cached pages evicted since the last spill whose contents the host tier wants
        (not held yet, or held without the state a snapshot brings): the caller copies them
        out (and `keep`s them) before the next call writes them; None: nothing to copy."""
        evicted = self.pool.evicted
        if not evicted:
            return None
        assert self.host is not None  # only a host tier lists evicted pages
        wanted = [(p, h, s) for p, h, s in evicted if self.host.wants(h, s is not None)]
        evicted.clear()
        if not wanted:
            return None
        pages, hashes, snaps = zip(*wanted, strict=True)
        return Spill(list(pages), list(hashes), [-1 if s is None else s for s in snaps])

    def keep(self, spill: Spill, contents: list[np.ndarray], states: list[np.ndarray]) -> None:
        """Store spilled pages in the host tier from their copies: contents [n, ...] per paged
        leaf, states [n, ...] per copied state leaf (rows of pages without a snapshot unused)."""
        assert self.host is not None  # spills come from the host tier
        for i, (h, snap) in enumerate(zip(spill.hashes, spill.snaps, strict=True)):
            state = tuple(a[i].copy() for a in states) if snap >= 0 else None
            self.host.put(h, HostPage(tuple(a[i].copy() for a in contents), state))

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
        """Forget every cached prefix, the host tier's too (running requests keep their
        pages)."""
        self.pool.clear()
        if self.host is not None:
            self.host.clear()

    def stats(self) -> dict:
        """The pool's counts (PagePool.stats), with snapshots theirs (Snapshots.stats), and the
        host tier's (HostCache.stats; zeros without one)."""
        snapshots = self.pool.snapshots
        empty = {"snapshots_total": 0, "snapshots_in_use": 0, "snapshots_cached": 0}
        host = HostCache(0).stats() if self.host is None else self.host.stats()
        return {**self.pool.stats(), **(snapshots.stats() if snapshots else empty), **host}
