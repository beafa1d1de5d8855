"""The Gated DeltaNet Pallas kernels (jaxinfer/kernels/pallas/delta.py) against a float64 NumPy
reference written here: the plain token-by-token recurrence, nothing of model/gdn.py's code.

Tolerance: float32 noise, scaled by what the XLA path makes of the same inputs. Each case runs
model/gdn.py's float32 function (the path these kernels replace) on the same float32 inputs,
measures its error against the float64 reference (max |error| / max |reference|, o and S
apart), and allows the kernel RATIO times that or FLOOR (16 float32 ulps of the largest
value), whichever is larger. At these sizes both paths land at 0.5 to 7 ulps (1e-7 to 7e-7),
so the floor binds in most cases; a 1e-4 relative slip in the kernel (a decay, beta, the
mask, one row of the inverse) fails them. Both errors are printed (pytest -s -n0).

The kernels run interpreted on a CPU backend and compiled on a GPU (the same tests)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels.pallas import delta
from jaxinfer.model import gdn

INTERPRET = jax.default_backend() == "cpu"
RATIO = 4.0  # the kernel may be this many times the XLA path's float32 error
FLOOR = 16 * float(np.finfo(np.float32).eps)  # ~2e-6, relative to the largest value


def reference(q, k, v, g, beta, S):
    """float64, token by token: q, k [B, T, H, DK], v [B, T, H, DV], g, beta [B, T, H], S
    [B, H, DK, DV] -> o [B, T, H, DV], final S."""
    q, k, v, g, beta, S = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, S))
    S = S.copy()
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        S = S * np.exp(g[:, t])[..., None, None]
        kS = np.einsum("bhk,bhkv->bhv", k[:, t], S)  # what the state predicts for k
        delta_ = (v[:, t] - kS) * beta[:, t][..., None]
        S = S + k[:, t][..., :, None] * delta_[..., None, :]
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


def inputs(seed, B, T, H, DK, DV):
    """float32 q, k (L2-normed, q scaled by DK^-1/2), v, g (log decay in [-2, 0]; the last head
    near 0, [-1e-3, 0]: little decay, the state keeps growing), beta in (0, 1), S (non-zero)."""
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit((B, T, H, DK)) * DK**-0.5
    k = unit((B, T, H, DK))
    v = rng.standard_normal((B, T, H, DV))
    g = rng.uniform(-2.0, 0.0, (B, T, H))
    g[..., -1] = rng.uniform(-1e-3, 0.0, (B, T))
    beta = rng.uniform(0.01, 0.99, (B, T, H))
    S = 0.5 * rng.standard_normal((B, H, DK, DV))
    return tuple(np.asarray(a, np.float32) for a in (q, k, v, g, beta, S))


def error(got, want) -> float:
    got = np.asarray(got, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def check(name, got, xla, want):
    """got (kernel), xla (gdn's float32 path), want (float64): pairs of (o, S)."""
    for part, g_, x_, w_ in zip(("o", "S"), got, xla, want, strict=True):
        e_kernel, e_xla = error(g_, w_), error(x_, w_)
        bound = max(RATIO * e_xla, FLOOR)
        print(f"{name} {part}: kernel {e_kernel:.2e}, xla {e_xla:.2e}, bound {bound:.2e}")
        assert e_kernel <= bound, (name, part, e_kernel, e_xla)


@pytest.mark.parametrize(
    "B, H, DK, DV, block_v",
    [
        (2, 4, 16, 16, None),
        (3, 2, 32, 64, None),  # DK != DV, two DV tiles (BV = 32)
        (2, 2, 64, 32, 16),  # DK > DV, two DV tiles
        (1, 2, 128, 128, None),  # Qwen3-Next's head widths, four tiles
    ],
)
def test_recurrent_step(B, H, DK, DV, block_v):
    """Six decode steps, each from the state the last one returned (errors accumulate as in a
    decode loop); every step's o and the final state against the float64 recurrence."""
    T = 6
    q, k, v, g, beta, S0 = inputs(B * 1000 + DK + DV, B, T, H, DK, DV)
    want = reference(q, k, v, g, beta, S0)
    step = jax.jit(
        lambda *a: delta.recurrent_step(*a, interpret=INTERPRET, block_v=block_v),
        donate_argnums=5,  # the state is written in place
    )
    xla_step = jax.jit(gdn.recurrent_step)
    S, S_xla, o, o_xla = jnp.asarray(S0), jnp.asarray(S0), [], []
    for t in range(T):
        x = (q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        out, S = step(*x, S)
        out_xla, S_xla = xla_step(*x, S_xla)
        o.append(out)
        o_xla.append(out_xla)
    got = (np.stack(o, axis=1), S)
    xla = (np.stack(o_xla, axis=1), S_xla)
    assert got[0].shape == (B, T, H, DV) and S.shape == S0.shape and S.dtype == jnp.float32
    check(f"step B={B} H={H} DK={DK} DV={DV}", got, xla, want)


@pytest.mark.parametrize(
    "T, B, H, DK, DV, block_v",
    [
        (1, 1, 2, 16, 32, None),  # L = 16, 15 padded tokens
        (5, 2, 3, 32, 16, None),  # L = 16
        (20, 1, 2, 32, 32, 16),  # L = 32, two DV tiles
        (64, 1, 2, 128, 128, 64),  # one full sub-chunk, Qwen3-Next's widths, two DV tiles of 64
        (100, 2, 2, 32, 64, 32),  # two sub-chunks, the second ragged
        (130, 2, 2, 64, 32, None),  # three sub-chunks, the last with two tokens
    ],
)
def test_chunked(T, B, H, DK, DV, block_v):
    q, k, v, g, beta, S0 = inputs(T * 100 + DK + DV, B, T, H, DK, DV)
    want = reference(q, k, v, g, beta, S0)
    xla = jax.jit(gdn.chunked)(q, k, v, g, beta, S0)
    run = jax.jit(lambda *a: delta.chunked(*a, interpret=INTERPRET, block_v=block_v))
    got = run(q, k, v, g, beta, S0)
    assert got[0].shape == (B, T, H, DV) and got[1].shape == S0.shape
    check(f"chunked T={T} B={B} H={H} DK={DK} DV={DV}", got, xla, want)


def test_state_is_aliased():
    """Both kernels write the new state over the input state's buffer (a pool updates in
    place): the pallas_call aliases input 5 (S) to output 1."""
    q, k, v, g, beta, S = inputs(0, 1, 3, 2, 16, 16)
    for fn, args in (
        (delta.recurrent_step, (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)),
        (delta.chunked, (q, k, v, g, beta, S)),
    ):
        jaxpr = jax.make_jaxpr(lambda *a, fn=fn: fn(*a, interpret=INTERPRET))(*args)
        calls = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
        assert len(calls) == 1
        assert tuple(calls[0].params["input_output_aliases"]) == ((5, 1),)


def test_bad_shapes_are_refused():
    q, k, v, g, beta, S = inputs(0, 1, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="power of two"):
        delta.recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S, block_v=12)
    q, k, v, g, beta, S = inputs(0, 1, 1, 1, 24, 16)
    with pytest.raises(ValueError, match="DK = 24 must be a power of two"):
        delta.chunked(q, k, v, g, beta, S)
