"""The XLA GEMM: ``jnp.matmul`` with float32 accumulation and the epilogue as fused XLA ops.

Serves every problem on every device; the reference the kernels are measured against.
Operand layouts are those of `pallas_kernels.matmul_common` (batched, broadcastable).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.matmul_common import GemmProblem, epilogue, problem_of


def unsupported_reason(problem: GemmProblem) -> str | None:
    """XLA serves every GEMM."""
    del problem
    return None


def matmul(
    a: jax.Array,
    b: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
    activation: str | None = None,
    out_dtype=None,
) -> jax.Array:
    """Batched ``act(op(a) @ op(b) * scale + bias)``; transposes fold into the dot's layout."""
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    p = problem_of(a, b, scale, bias, transpose_a=transpose_a, transpose_b=transpose_b,
                   activation=activation, out_dtype=out_dtype)
    if transpose_a:
        a = jnp.swapaxes(a, -1, -2)
    if transpose_b:
        b = jnp.swapaxes(b, -1, -2)
    # float32 (and wider) operands multiply in full precision: XLA's default on GPUs
    # would round them to TF32. 16-bit operands are unaffected.
    precision = lax.Precision.HIGHEST if jnp.dtype(a.dtype).itemsize >= 4 else None
    acc = jnp.matmul(a, b, precision=precision, preferred_element_type=jnp.float32)
    # The batch may come from the epilogue vectors alone (vmap over the bias, say);
    # XLA fuses this broadcast into the epilogue.
    acc = jnp.broadcast_to(acc, (*p.batch_shape, p.m, p.n))
    return epilogue(acc, scale, bias, activation, out_dtype)
