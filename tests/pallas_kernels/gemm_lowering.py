"""Lowering a GEMM kernel for CUDA on any machine: catches what interpreters cannot.

``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`` runs the Pallas
lowering (Mosaic-GPU: layout inference down to LLVM/NVVM; Triton: TTIR) without
a GPU; only the final compilation to machine code is left to the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lower_gemm_for_cuda(kernel_module, m, n, k, dtype, *, transpose_a=False, transpose_b=False,
                        activation=None, out_dtype=None, config=None) -> str:
    """The lowered text of ``kernel_module.matmul`` with scale and bias on (1, ...) operands."""
    a = jax.ShapeDtypeStruct((1, k, m) if transpose_a else (1, m, k), dtype)
    b = jax.ShapeDtypeStruct((1, n, k) if transpose_b else (1, k, n), dtype)
    vector = jax.ShapeDtypeStruct((1, n), jnp.float32)

    def gemm(a, b, scale, bias):
        return kernel_module.matmul(a, b, scale, bias, transpose_a=transpose_a,
                                    transpose_b=transpose_b, activation=activation,
                                    out_dtype=out_dtype, config=config)

    return jax.jit(gemm).trace(a, b, vector, vector).lower(lowering_platforms=("cuda",)).as_text()


LOWERING_CASES = [
    *(dict(transpose_a=ta, transpose_b=tb) for ta in (False, True) for tb in (False, True)),
    *(dict(activation=act) for act in ("gelu", "gelu_tanh", "silu", "relu")),
    dict(dtype=jnp.float16, out_dtype=jnp.float32),
    dict(dtype=jnp.float8_e4m3fn, transpose_b=True),
    dict(dtype=jnp.float8_e5m2, transpose_a=True, out_dtype=jnp.float16),
    # M not a multiple of 8: Mosaic's row-tiled TMA views for a and the output
    dict(m=1003, activation="gelu"),
    dict(m=1003, transpose_b=True, out_dtype=jnp.float32),
    dict(m=1003, dtype=jnp.float8_e4m3fn, transpose_b=True, out_dtype=jnp.bfloat16),
]
