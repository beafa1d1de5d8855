"""Varying manual axes: loop carries inside shard_map vary over the axes of what they fold in,
and a Pallas kernel's operands and outputs over the axes of its inputs."""

from __future__ import annotations

import jax


def varying_like(tree, ref):
    """Inside shard_map (a pipeline stage, an expert shard), a loop carry must vary over the
    same manual mesh axes as the values folded into it: those of `ref`."""
    want = _vma(ref)
    return jax.tree.map(lambda x: _cast(x, want), tree)


def agreed(*arrays):
    """A Pallas kernel inside shard_map: its operands must vary over the same manual mesh axes
    and its outputs declare them. -> (arrays cast to the union of their axes, that axis type
    for the outputs' `jax.ShapeDtypeStruct(..., manual_axis_type=)`)."""
    want = frozenset().union(*(_vma(a) for a in jax.tree.leaves(arrays)))
    out = jax.tree.map(lambda x: _cast(x, want), arrays)
    return out, jax.typeof(jax.tree.leaves(out)[0]).manual_axis_type


def _cast(x, want: frozenset):
    axes = tuple(sorted(want - _vma(x)))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _vma(x) -> frozenset:
    """The manual mesh axes `x` varies over (jax 0.10: manual_axis_type; later: vma)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())
