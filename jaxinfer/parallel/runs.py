"""Layer runs: a model's layers cut into runs of a repeated unit, so that the layers of one run
share traced bodies (a loop over the unit's repetitions, depth.py): one per segment of the
unit (its positions of one signature, a loop of their own).

A layer's signature is its kind (attention or linear attention, MLP or experts) and the format
of each weight: the layers of a unit position are stacked into one array per weight, so they
must agree. A Q4_K_M file keeps some layers' ffn_down and attn_v in Q6_K (the first and last
eighth of the layers, and every third one between): its runs are [Q6_K layers] [a unit of
three, repeated] [Q6_K layers]; a hybrid model's 3 linear : 1 attention pattern is a unit of
four, whose segments are three linear layers (one body, looped) and the attention layer.
Pipeline stages (pipeline.py) cut their stage layers into runs the same way.

`repeat` is the loop, and `layer_params` one layer's parameters out of the stacks: QArrays
marked with the layer's index, which the CPU kernels read in place.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from ..ops.quant import QArray

MAX_UNIT = 8  # the longest unit looked for (Qwen3.5's is 4, a Q4_K_M pattern over it 12)

Sig = TypeVar("Sig", bound=Hashable)  # a layer's signature (depth.py: its kind and formats)


@dataclass(frozen=True)
class Segment(Generic[Sig]):
    """Positions offset .. offset + repeat - 1 of a unit, all of one signature: one traced
    body, run `repeat` times in a row (Qwen3.5's unit: 3 linear layers, then attention)."""

    signature: Sig
    offset: int
    repeat: int


@dataclass(frozen=True)
class Run(Generic[Sig]):
    """Layers first .. first + len(unit) * count - 1: `unit` (one signature per position)
    `count` times."""

    first: int
    unit: tuple[Sig, ...]
    count: int

    @property
    def width(self) -> int:
        return len(self.unit)

    def layer(self, i: int, j: int) -> int:
        """The layer at position j of repetition i."""
        return self.first + i * self.width + j

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.width * self.count)

    @property
    def segments(self) -> tuple[Segment[Sig], ...]:
        """The unit's runs of one signature."""
        out: list[Segment[Sig]] = []
        for j, sig in enumerate(self.unit):
            if out and out[-1].signature == sig:
                last = out[-1]
                out[-1] = Segment(sig, last.offset, last.repeat + 1)
            else:
                out.append(Segment(sig, j, 1))
        return tuple(out)

    def stacked(self, segment: Segment[Sig]) -> list[int]:
        """A segment's layers in stack order: entry i * repeat + k is repetition i's k-th."""
        return [self.layer(i, segment.offset + k) for i in range(self.count)
                for k in range(segment.repeat)]  # fmt: skip


def layer_runs(signatures: Sequence[Sig], max_unit: int = MAX_UNIT) -> tuple[Run[Sig], ...]:
    """The layers cut into runs, greedily from the first: at each layer the unit (up to
    `max_unit` layers) whose repetitions cover the most layers, the shorter unit on a tie; a
    layer that starts no repetition is a run of one."""
    n, at, runs = len(signatures), 0, []
    while at < n:
        best = (1, 1)  # (unit width, count): covers width * count layers
        for width in range(1, min(max_unit, n - at) + 1):
            unit = tuple(signatures[at : at + width])
            count = 1
            while at + (count + 1) * width <= n and (
                tuple(signatures[at + count * width : at + (count + 1) * width]) == unit
            ):
                count += 1
            if count > 1 and width * count > best[0] * best[1]:
                best = (width, count)
        width, count = best
        runs.append(Run(at, tuple(signatures[at : at + width]), count))
        at += width * count
    return tuple(runs)


def repeat(body, n: int, carry):
    """body(i, carry) for i in range(n): a loop (one traced body), or one call when n = 1."""
    if n == 1:
        return body(jnp.int32(0), carry)
    return lax.fori_loop(0, n, body, carry)


def describe(runs: tuple[Run, ...], what: str = "layers") -> str:
    """Which layers (or pipeline stage layers: `what`) share a traced body, for `jaxinfer info`."""
    parts = []
    for run in runs:
        last = run.first + run.width * run.count - 1
        one = what.removesuffix("s")
        span = f"{what} {run.first}-{last}" if last > run.first else f"{one} {run.first}"
        unit = " + ".join(f"{s.repeat}" for s in run.segments)
        parts.append(f"{span}: ({unit}) x {run.count}")
    bodies = sum(len(r.segments) for r in runs)
    return f"{bodies} traced layer bodies ({'; '.join(parts)})"


def layer_params(tree, i: jax.Array):
    """A stack's layer i as the layer's own parameters: QArrays marked (read in place),
    other arrays sliced."""

    def one(leaf):
        if isinstance(leaf, QArray):
            return QArray(leaf.parts, leaf.fmt, leaf.width, leaf.kernel, leaf.acts, i)
        return lax.dynamic_index_in_dim(leaf, i, keepdims=False)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, QArray))
