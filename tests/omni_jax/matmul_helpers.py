"""Float64 reference GEMM, random operands and error checks shared by the matmul tests."""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np

from tests.reference import relative_error

# Relative error allowed for each output dtype (inputs are exact in float64: only
# the accumulation order and the final rounding differ from the reference).
TOLERANCE = {
    jnp.dtype(jnp.float32): 2e-5,
    jnp.dtype(jnp.float16): 2e-3,
    jnp.dtype(jnp.bfloat16): 1e-2,
}

# fp8 inputs: Hopper's tensor cores add fp8 products inside a wgmma chain with about 14
# mantissa bits (2e-4 to 3e-4 relative error measured at K 256 and 768), whatever the
# output dtype.
FP8_TOLERANCE = 2e-3

REFERENCE_ACTIVATIONS = {
    None: lambda x: x,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


def random_operands(m, n, k, dtype, *, transpose_a=False, transpose_b=False, batch=()):
    """Fresh random a, b (stored layouts), a float32 bias, and the seed that made them."""
    seed = secrets.randbits(31)
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    a_shape = (*batch, k, m) if transpose_a else (*batch, m, k)
    b_shape = (*batch, n, k) if transpose_b else (*batch, k, n)
    a = jax.random.normal(ka, a_shape, jnp.float32).astype(dtype)
    b = jax.random.normal(kb, b_shape, jnp.float32).astype(dtype)
    bias = jax.random.normal(kc, (n,), jnp.float32)
    return a, b, bias, seed


def reference(a, b, *, bias=None, activation=None, transpose_a=False, transpose_b=False,
              scale=1.0):
    """``activation(op(a) @ op(b) * scale + bias)`` in float64 (numpy arrays in and out)."""
    with jax.enable_x64(True):
        a64 = jnp.asarray(np.asarray(a, np.float64))
        b64 = jnp.asarray(np.asarray(b, np.float64))
        if transpose_a:
            a64 = jnp.swapaxes(a64, -1, -2)
        if transpose_b:
            b64 = jnp.swapaxes(b64, -1, -2)
        out = jnp.matmul(a64, b64) * scale
        if bias is not None:
            out = out + jnp.asarray(np.asarray(bias, np.float64))
        return np.asarray(REFERENCE_ACTIVATIONS[activation](out))


def assert_close(actual, expected, dtype, seed, tolerance=None, *, magnitude=None):
    """Relative error within the dtype's tolerance, no NaN, no unwritten (far-off) element.

    ``magnitude`` is what the error is relative to (default ``expected``): for an
    activation, its input (the product). gelu and silu pass an error of their input
    through at most 1.13x, but their output can be far smaller than the input (silu(-17)
    is -7e-7), and relative to it the product's rounding is amplified without bound.
    """
    dtype = jnp.dtype(dtype)
    tolerance = tolerance or TOLERANCE[dtype]
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"non-finite output (seed {seed})"
    error = relative_error(actual, expected)
    if magnitude is None:
        magnitude = expected
    else:  # ||actual - expected|| / ||magnitude||
        magnitude = np.asarray(magnitude, np.float64)
        error *= max(np.linalg.norm(expected), 1e-30) / max(np.linalg.norm(magnitude), 1e-30)
    assert error <= tolerance, f"relative error {error:.3g} > {tolerance:.3g} (seed {seed})"
    worst = np.max(np.abs(actual - expected), initial=0.0)
    scale = np.max(np.abs(magnitude), initial=0.0) + 1e-30
    assert worst <= 20 * tolerance * scale, (
        f"an element is off by {worst:.3g} (max |ref| {scale:.3g}, seed {seed})"
    )


def check_vectors_batched_apart(kernel_module, batched: str, m: int, n: int, k: int) -> None:
    """``kernel_module.matmul`` over a batch of 3 in ``a`` and in the epilogue vector named
    ``batched`` ("scale" or "bias"), with ``b`` and the other vector shared (batch 1): each
    vector must be read at its own batch index."""
    batch = 3
    a, b, _, seed = random_operands(m, n, k, jnp.bfloat16, batch=(batch,))
    scale_key, bias_key = jax.random.split(jax.random.key(seed + 1))
    vectors = {
        "scale": jax.random.uniform(scale_key, (batch, n), jnp.float32, 0.5, 2.0),
        "bias": jax.random.normal(bias_key, (batch, n), jnp.float32),
    }
    scale, bias = (v if name == batched else v[:1] for name, v in vectors.items())
    out = kernel_module.matmul(a, b[:1], scale, bias, out_dtype=jnp.float32)
    expected = reference(a, b[:1], bias=np.asarray(bias)[:, None],
                         scale=np.asarray(scale, np.float64)[:, None])
    assert_close(out, expected, jnp.float32, seed)
