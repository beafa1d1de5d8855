"""Varying manual axes: loop carries inside shard_map vary over the axes of what they fold in."""

from __future__ import annotations

import jax


def varying_like(tree, ref):
    """Inside shard_map (a pipeline stage, an expert shard), a loop carry must vary over the
    same manual mesh axes as the values folded into it: those of `ref`."""
    want = _vma(ref)

    def cast(x):
        axes = tuple(sorted(want - _vma(x)))
        return jax.lax.pcast(x, axes, to="varying") if axes else x

    return jax.tree.map(cast, tree)


def _vma(x) -> frozenset:
    """The manual mesh axes `x` varies over (jax 0.10: manual_axis_type; later: vma)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())
