"""The host's bookkeeping of the KV page pool: pages held by requests, reservations, and the
prefix cache that shares full pages between requests by content.

A request reserves the pages it can ever need when it is admitted, then takes them as it
grows; finishing or cancelling returns both, so a running request never runs out of pages.
Page ids are shared by every layer's pool.

Prefix caching (after vLLM's automatic prefix caching):
- A full page is named by a chain hash: its parent page's hash and its tokens, the first
  page's parent being the request's `root` (the model's identity and the request's cache
  salt). A page a request filled is registered under its hash; pages are reference counted.
- When a request ends, its registered pages stay as cached: they count as free (any request
  may take them) but stay findable until taken. Taking a page for new tokens uses an empty
  page first, then evicts the least recently used cached chain, its last page first.
- A new request maps its longest cached prefix into its block table and prefills after it.
- Hybrid models also need the state a prefix leaves (their linear layers'): `Snapshots`
  hands out snapshots, written at page ends, kept per page hash and evicted least
  recently used; a hit ends at the last page whose snapshot is kept, so an evicted snapshot
  means a shorter hit, never a wrong state.
- A cached page is never written again: a hit leaves the prompt's last token to compute,
  and what a request writes past its hit goes to pages of its own.
- With a host tier (host_cache.py), an evicted cached page is listed in `evicted` with its
  snapshot, for its contents to be copied out before the page is written again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..model.kvcache import NULL_PAGE, KVConfig


def root_hash(model: str, salt: str | None) -> bytes:
    """The parent of a request's first page: the model's identity and its cache salt."""
    text = f"{model}\0{'' if salt is None else 'salt:' + salt}"
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def chain_hash(parent: bytes, tokens) -> bytes:
    """A full page's name: its parent's hash and its tokens (16 bytes of BLAKE2b: no tenant
    can make another's page collide with one of its own)."""
    data = parent + np.asarray(tokens, dtype="<i4").tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


class Snapshots:
    """Snapshots (state indices past the requests' ones) of the states at page ends. A snapshot
    is free, being written (taken by a running request for a page it will fill), or cached
    under the hash of the page it ends (least recently used first). A cached snapshot that
    requests start from is pinned: it is not evicted until they have read it."""

    def __init__(self, first: int, count: int):
        self.first, self.total = first, count
        self._free = list(range(first + count - 1, first - 1, -1))  # a stack: lowest first
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # page hash -> snap
        self._readers: dict[int, int] = {}  # pinned snap -> requests about to read it
        self._orphans: set[int] = set()  # pinned snaps cleared from the cache
        self._writing = 0

    def find(self, page_hash: bytes) -> int | None:
        return self._cached.get(page_hash)

    def take(self) -> int | None:
        """A snapshot to write (until `keep` or `give`): a free one, else the least recently used
        unpinned cached one; None when there is none."""
        if self._free:
            snap = self._free.pop()
        else:
            victim = next((h for h, s in self._cached.items() if s not in self._readers), None)
            if victim is None:
                return None
            snap = self._cached.pop(victim)
        self._writing += 1
        return snap

    def keep(self, page_hash: bytes, snap: int) -> None:
        """A snapshot taken for writing now holds the state at the end of page `page_hash` (most
        recently used); a second snapshot of the same page is given back."""
        self._writing -= 1
        if page_hash in self._cached:
            self._free.append(snap)
        else:
            self._cached[page_hash] = snap

    def give(self, snap: int) -> None:
        """A snapshot taken for writing that holds nothing worth keeping."""
        self._writing -= 1
        self._free.append(snap)

    def pin(self, page_hash: bytes) -> int:
        """The cached snapshot of `page_hash`, held (and made most recent) until `unpin`."""
        snap = self._cached[page_hash]
        self._cached.move_to_end(page_hash)
        self._readers[snap] = self._readers.get(snap, 0) + 1
        return snap

    def unpin(self, snap: int) -> None:
        self._readers[snap] -= 1
        if not self._readers[snap]:
            del self._readers[snap]
            if snap in self._orphans:
                self._orphans.discard(snap)
                self._free.append(snap)

    def forget(self, page_hash: bytes) -> None:
        """The page is gone from the cache: its snapshot cannot be reached any more."""
        snap = self._cached.pop(page_hash, None)
        if snap in self._readers:
            self._orphans.add(snap)
        elif snap is not None:
            self._free.append(snap)

    def clear(self) -> None:
        for page_hash in list(self._cached):
            self.forget(page_hash)

    def stats(self) -> dict:
        return {
            "snapshots_total": self.total,
            "snapshots_in_use": self._writing + len(self._readers),
            "snapshots_cached": len(self._cached),
        }


class PagePool:
    """Free pages, reservations, reference counts and the prefix cache of one KV pool."""

    def __init__(self, kv: KVConfig, page_bytes: int, snapshots: Snapshots | None = None,
                 spill: bool = False):  # fmt: skip
        """`spill`: list the cached pages evicted (`evicted`), for a host tier."""
        self.kv = kv
        self.page_bytes = page_bytes  # all layers, K and V
        self.snapshots = snapshots  # hybrid models: the states prefixes leave
        self._free = list(range(kv.n_pages - 1, NULL_PAGE, -1))  # empty; a stack, lowest first
        self._cached: OrderedDict[int, bytes] = OrderedDict()  # unheld registered pages, LRU
        self._refs = np.zeros(kv.n_pages, np.int32)
        self._hash_of: dict[int, bytes] = {}  # registered pages
        self._page_of: dict[bytes, int] = {}
        self._reserved = 0  # pages promised to admitted requests but not yet taken
        self.queries = self.hits = 0  # prompt tokens looked up, and found (prefix cache)
        # (page, its hash, its snapshot or None) of each cached page evicted since the host
        # tier last copied them out; None: no host tier
        self.evicted: list[tuple[int, bytes, int | None]] | None = [] if spill else None

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.kv.page_size)

    def available(self) -> int:
        """Pages a new reservation may promise: empty and cached ones, less earlier promises."""
        return len(self._free) + len(self._cached) - self._reserved

    # ---- prefix cache -------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The pages of the longest cached prefix of a chain of page hashes."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def admit(self, hits: list[int], pages: int) -> bool:
        """Hold the prefix pages `hits` and promise `pages` more, if the pool has them (an
        unheld cached page that becomes held leaves the free count)."""
        unheld = sum(1 for p in hits if self._refs[p] == 0)
        if pages + unheld > self.available():
            return False
        for p in hits:
            if self._refs[p] == 0:
                del self._cached[p]
            self._refs[p] += 1
        self._reserved += pages
        return True

    def register(self, page: int, page_hash: bytes) -> bool:
        """Name a page a request has filled, unless that content is cached already (the
        page then stays unnamed and is emptied when released)."""
        if page_hash in self._page_of or page in self._hash_of:
            return False
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        return True

    def clear(self) -> None:
        """Forget every cached prefix (held pages stay held, unnamed)."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._hash_of.clear()
        self._page_of.clear()
        if self.evicted is not None:
            self.evicted.clear()
        if self.snapshots:
            self.snapshots.clear()

    # ---- pages of running requests ------------------------------------------------------

    def reserve(self, pages: int) -> bool:
        """Promise `pages` to a request if they are free (beyond earlier promises)."""
        return self.admit([], pages)

    def grow(self, held: list[int], tokens: int, reserved: int) -> int:
        """Extend `held` (in place) to cover `tokens` positions, from a reservation of
        `reserved` pages not yet taken; returns the reservation left."""
        want = max(min(self.pages_for(tokens) - len(held), reserved), 0)
        for _ in range(want):
            page = self._take()
            self._refs[page] = 1
            held.append(page)
        self._reserved -= want
        return reserved - want

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        page, page_hash = self._cached.popitem(last=False)  # the least recently used
        del self._hash_of[page], self._page_of[page_hash]
        if self.evicted is not None:  # its contents are intact until the next compiled call
            snap = self.snapshots.find(page_hash) if self.snapshots else None
            self.evicted.append((page, page_hash, snap))
        if self.snapshots:
            self.snapshots.forget(page_hash)
        return page

    def release(self, held: list[int], reserved: int) -> None:
        """Give back a request's pages and what is left of its reservation. Its registered
        pages stay cached, last page first in line for eviction (it names the most tokens)."""
        for page in reversed(held):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._cached[page] = self._hash_of[page]
                else:
                    self._free.append(page)
        held.clear()
        self._reserved -= reserved

    def stats(self) -> dict:
        in_use = int(np.count_nonzero(self._refs))
        return {
            "page_size": self.kv.page_size,
            "pages_total": self.kv.usable_pages,
            "pages_free": self.available(),
            "pages_in_use": in_use,
            "pages_reserved": self._reserved,
            "cached_pages": len(self._cached),
            "prefix_queries": self.queries,
            "prefix_hits": self.hits,
            "bytes_allocated": self.kv.n_pages * self.page_bytes,
            "bytes_in_use": in_use * self.page_bytes,
        }
