"""The host-RAM tier of the prefix cache (llama-server's --cache-ram): full cached pages evicted
from the device's KV pool keep their contents here, named by the same chain hash, so that a
prefix the device pool no longer holds is copied back instead of computed again.

An entry is one page: its slice of every attention layer's pools (every array leaf, K and V,
whatever its dtype) and, for hybrid models, the linear layers' state at the page's end when a
snapshot of it was kept. The store is a least-recently-used map bounded in bytes: a new entry
evicts the oldest until it fits, so the bytes it holds never pass the capacity. The copies
themselves are compiled programs (programs.py: `gather` out of the pools, `scatter` back in),
whose page counts come in the buckets of `copy_buckets`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

MAX_COPY = 64  # most pages one copy program moves (more go in several calls)


def copy_buckets(pages: int) -> tuple[int, ...]:
    """The page counts the copy programs are compiled for: powers of two up to the pool's
    usable `pages` rounded up, at most MAX_COPY."""
    top = min(MAX_COPY, 1 << max(pages - 1, 0).bit_length())
    return tuple(1 << i for i in range(top.bit_length()))


@dataclass(frozen=True, eq=False)
class HostPage:
    """One page's contents on the host: per paged leaf of the pools (in the pools' leaf order)
    the page's slice, and per state leaf the state at the page's end (None: no snapshot kept)."""

    pages: tuple[np.ndarray, ...]
    state: tuple[np.ndarray, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.pages) + sum(a.nbytes for a in self.state or ())


class HostCache:
    """Pages by chain hash, least recently used first, within `capacity` bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.bytes = 0  # what the entries hold
        self.hits = 0  # prompt tokens served from here
        self.evictions = 0  # entries dropped to make room
        self._entries: OrderedDict[bytes, HostPage] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, page_hash: bytes) -> HostPage | None:
        """The entry of a page, if held (its place in line unchanged)."""
        return self._entries.get(page_hash)

    def get(self, page_hash: bytes) -> HostPage:
        """A held entry, made the most recently used."""
        self._entries.move_to_end(page_hash)
        return self._entries[page_hash]

    def wants(self, page_hash: bytes, state: bool) -> bool:
        """Whether a page's contents are worth copying here: it is not held yet, or held
        without the state a copy would bring (a held entry is made the most recent)."""
        held = self._entries.get(page_hash)
        if held is None:
            return True
        self._entries.move_to_end(page_hash)
        return state and held.state is None

    def put(self, page_hash: bytes, entry: HostPage) -> bool:
        """Hold `entry` as the most recently used (replacing an older copy of the page),
        evicting the least recently used entries until it fits; an entry larger than the
        whole capacity is not held (False)."""
        old = self._entries.pop(page_hash, None)
        if old is not None:
            self.bytes -= old.nbytes
        size = entry.nbytes
        if size > self.capacity:
            return False
        while self.bytes + size > self.capacity:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.nbytes
            self.evictions += 1
        self._entries[page_hash] = entry
        self.bytes += size
        return True

    def clear(self) -> None:
        """Forget every entry (not counted as evictions)."""
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict:
        return {
            "host_bytes": self.bytes,
            "host_capacity": self.capacity,
            "host_hits": self.hits,
            "host_evictions": self.evictions,
            "host_pages": len(self._entries),
        }
