"""Mixture of experts: top-k routing and the expert FFNs, with expert choice as data.

Routing never changes a shape. A call's N tokens make N * k assignments (token, expert,
weight); they are sorted by expert and cut into tiles of C rows that each belong to one
expert, and a loop runs one tile per step, reading that expert's weights in place
(`dynamic_index` of the stacked [E, ...] weights inside the loop reads the slice without a
copy on XLA CPU, where gathering the k experts' weights copies them). So the memory a token
reads scales with the experts it uses, and the trip count, not a shape, follows the routing.
Padding rows and rows of idle slots make no assignment. Each tile's last rows may run past
its expert's rows into the next expert's; those rows are written again when that expert's
tile comes, so the result never depends on it.

Under an expert split (`ExpertSplit`, the `experts` logical axis on a mesh axis) each device
holds E / ep experts and the tokens: it computes the assignments of its own experts, and the
partial outputs are summed over the axis (the "replicate tokens, shard experts, psum" form of
tpu-inference and sglang-jax).

Tie rule: among equal router probabilities the lower expert index wins (`lax.top_k`, as
`torch.topk` in the HF models). Dimension letters as in transformer.py, plus N tokens, E experts,
k experts per token, A = N * k assignments, F expert width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .. import kernels
from ..ops.quant import QArray, QSwitch
from ..ops.vma import varying_like
from .linear import linear

MAX_TILE = 256  # rows per tile at most


@dataclass(frozen=True)
class ExpertSplit:
    """The experts split over one mesh axis."""

    mesh: Mesh
    axis: str

    @staticmethod
    def of(mesh: Mesh, rules: dict[str, str]) -> ExpertSplit | None:
        """The split a layout's rules ask for (the `experts` logical axis), or None."""
        return ExpertSplit(mesh, rules["experts"]) if "experts" in rules else None


def route(x: jax.Array, router: jax.Array, k: int, normalize: bool):
    """x [N, D], router [E, D] -> routing weights [N, k] float32 and expert ids [N, k] int32.

    Softmax over all experts in float32, the k largest (ties: lower index first), and the k
    weights renormalized to sum to 1 when `normalize` (Mixtral always; Qwen `norm_topk_prob`).
    """
    logits = jnp.einsum(
        "ND,ED->NE", x.astype(jnp.float32), router.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
    )  # fmt: skip
    probs = jax.nn.softmax(logits, axis=-1)  # [N, E]
    weights, ids = lax.top_k(probs, k)  # [N, k]
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def tile_rows(assignments: int, experts: int) -> int:
    """Rows per tile: one when a call has about one assignment per expert or fewer (decode,
    where a one-row product streams the weights fastest); else the expected rows per expert
    plus two standard deviations of a uniform routing, in multiples of 8, so that most
    experts take one tile and few rows are padding."""
    mean = assignments / experts
    if mean <= 1:
        return 1
    return min(MAX_TILE, -(-int(mean + 2 * mean**0.5) // 8) * 8)


def _sorted(ids, valid, experts: int, first: int):
    """The assignments (each token's k experts) sorted by expert, for the experts first ..
    first + experts - 1 held here: (mine [A] whether an assignment is one of them, order [A]
    the assignment at each sorted position, counts [experts] rows per expert)."""
    A = ids.size
    local = ids.reshape(A) - first  # [A]
    mine = (local >= 0) & (local < experts) & jnp.repeat(valid, ids.shape[1])
    key = jnp.where(mine, local, experts)  # no work here (another device's expert, padding)
    order = jnp.argsort(key, stable=True)  # [A]
    counts = jnp.zeros(experts + 1, jnp.int32).at[key].add(1)[:experts]  # [experts]
    return mine, order, counts


def _combined(ys, mine, order, weights) -> jax.Array:
    """Each token's weighted sum of its experts' outputs ys [>= A, D] (in sorted order)."""
    N, k = weights.shape
    A = N * k
    at = jnp.zeros(A, jnp.int32).at[order].set(jnp.arange(A, dtype=jnp.int32))  # sorted row
    w = jnp.where(mine, weights.reshape(A), 0.0)[:, None]  # [A, 1]
    out = jnp.where(w > 0, ys[at].astype(jnp.float32) * w, 0.0)  # [A, D]
    return out.reshape(N, k, -1).sum(axis=1)


def expert_ffn(x, ids, weights, valid, w_gate, w_up, w_down, first=0) -> jax.Array:
    """Sum over each token's experts of weight * SwiGLU_e(x), for the experts held here.

    x [N, D]; ids, weights [N, k]; valid [N] bool; w_gate, w_up [EL, F, D], w_down [EL, D, F]
    hold experts first .. first + EL - 1 (all of them without a split). -> [N, D] float32.
    """
    N, D = x.shape
    k = ids.shape[1]
    EL = w_gate.shape[0]
    A = N * k
    C = tile_rows(A, EL)
    mine, order, counts = _sorted(ids, valid, EL, first)
    # [T] each tile's expert, first sorted row, rows (0: unused, all after the used ones)
    tile_e, tile_row, used = kernels.tile_map(counts, A, C)
    n_tiles = jnp.sum(used > 0)

    xs = jnp.concatenate([x[order // k], jnp.zeros((C, D), x.dtype)])  # [A + C, D]

    def tile(i, ys):
        e, r = tile_e[i], tile_row[i]
        rows = lax.dynamic_slice_in_dim(xs, r, C)  # [C, D]
        gate = times(rows, expert(w_gate, e))  # [C, F]
        up = times(rows, expert(w_up, e))  # [C, F]
        y = times(jax.nn.silu(gate) * up, expert(w_down, e))  # [C, D]
        return lax.dynamic_update_slice_in_dim(ys, y.astype(ys.dtype), r, 0)  # [C, D] at r

    ys = varying_like(jnp.zeros((A + C, D), x.dtype), jax.tree.leaves(w_gate)[0])
    ys = lax.fori_loop(0, n_tiles, tile, ys)
    return _combined(ys, mine, order, weights)


def grouped_ffn(x, ids, weights, valid, w_gate, w_up, w_down, first=0, products=None) -> jax.Array:
    """`expert_ffn` as grouped products over the assignments sorted by expert, every expert's
    rows in one call: the accelerators' form (a GPU or TPU starves on the one-row tiles of the
    loop) and the CPU kernel's for quantized weights. `products(xs, ws, counts)` -> one output
    per weight: XLA's ragged dot (`ragged_products`) or a kernel's (kernels.grouped_product,
    kernels.expert_products). Rows sorted past the experts held here come out zero and weigh
    nothing."""
    products = products or ragged_products
    k = ids.shape[1]
    mine, order, counts = _sorted(ids, valid, w_gate.shape[0], first)
    xs = x[order // k]  # [A, D]
    gate, up = products(xs, [w_gate, w_up], counts)  # [A, F] each
    (ys,) = products((jax.nn.silu(gate) * up).astype(xs.dtype), [w_down], counts)  # [A, D]
    return _combined(ys, mine, order, weights)


# rows [A, in] sorted by group times the stacked weights [EL, out, in] as stored: no transpose
_BY_GROUP = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def ragged(xs, w, counts) -> jax.Array:
    """XLA's grouped product: xs [A, in] (rows sorted by group, counts [EL] per group) times
    w [EL, out, in] -> [A, out]; rows past sum(counts) are 0."""
    return lax.ragged_dot_general(xs, w, counts, _BY_GROUP)


def each_weight(product):
    """A one-weight grouped product (xs, w, counts) as grouped_ffn's `products`."""
    return lambda xs, ws, counts: [product(xs, w, counts) for w in ws]


ragged_products = each_weight(ragged)


def expert(w, e: jax.Array):
    """Expert e's weight [F, D] of stacked weights [E, F, D] (plain or quantized), read in
    place: a dynamic index, not a gather (gathering copies on XLA CPU)."""
    pick = lambda a: lax.dynamic_index_in_dim(a, e, keepdims=False)  # noqa: E731
    return w.rows(pick) if isinstance(w, QArray) else pick(w)


def times(x: jax.Array, w) -> jax.Array:
    """x [C, D] times one expert's weight [F, D]: `@` for a plain weight (on a dynamically
    indexed slice XLA CPU runs it 2.5x faster than the einsum form), else the seam."""
    return linear(x, w) if isinstance(w, QArray) else x @ w.T


def experts(x, ids, weights, valid, w_gate, w_up, w_down, split: ExpertSplit | None, whole=False):
    """The expert block over all experts, split over `split.axis` when given -> [N, D]
    float32: grouped products (`grouped_ffn`) where a kernel reads the stacked weights in
    place for weights `whole` on one device (kernels.expert_products for quantized ones,
    kernels.grouped_product for plain ones) or where the accelerators want them
    (kernels.uses_grouped_experts: XLA's ragged dot), else the tile loop (`expert_ffn`)."""
    ws = (w_gate, w_up, w_down)
    for i, w in enumerate(ws):
        if isinstance(w, QSwitch):  # a weight in one of several formats: a branch each

            def picked(q, i=i):
                one = [q if j == i else other for j, other in enumerate(ws)]
                return experts(x, ids, weights, valid, one[0], one[1], one[2], split, whole)

            return w.apply(picked)
    if isinstance(w_gate, QArray):
        products = kernels.expert_products((w_gate, w_up, w_down), whole)
    else:
        kernel = kernels.grouped_product(whole)
        grouped = kernel is not None or kernels.uses_grouped_experts()
        products = (each_weight(kernel) if kernel else ragged_products) if grouped else None
    ffn = partial(grouped_ffn, products=products) if products else expert_ffn
    if split is None:
        return ffn(x, ids, weights, valid, w_gate, w_up, w_down)

    def local(x, ids, weights, valid, w_gate, w_up, w_down):
        first = lax.axis_index(split.axis) * w_gate.shape[0]
        part = ffn(x, ids, weights, valid, w_gate, w_up, w_down, first)
        return lax.psum(part, split.axis)

    rep, held = P(), P(split.axis)
    context = jax.sharding.get_abstract_mesh()  # inside a pipeline stage: its manual mesh
    return jax.shard_map(
        local,
        mesh=context if split.axis in context.axis_names else split.mesh,
        in_specs=(rep, rep, rep, rep, held, held, held),
        out_specs=rep,
        axis_names=frozenset({split.axis}),
        check_vma=kernels.checks_vma(),
    )(x, ids, weights, valid, w_gate, w_up, w_down)
