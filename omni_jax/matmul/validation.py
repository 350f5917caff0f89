"""Trace-time checks of `omni_jax.matmul`'s arguments; every message names the argument."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul_common import ACTIVATIONS

Array = Any

IMPLEMENTATIONS = ("xla", "triton", "mosaic")
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
IN_DTYPES = (*_HALF_DTYPES, jnp.dtype(jnp.float32), *FP8_DTYPES)
OUT_DTYPES = (*_HALF_DTYPES, jnp.dtype(jnp.float32))


def _names(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def _array(name: str, x: Array) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"matmul: {name} must be an array, got {type(x).__name__}")


def check_operands(
    a: Array, b: Array, transpose_a: bool, transpose_b: bool
) -> tuple[int, int, int]:
    """Ranks, dtypes and the shared contraction size of ``a`` and ``b``; returns (M, N, K)."""
    for name, flag in (("transpose_a", transpose_a), ("transpose_b", transpose_b)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"matmul: {name} must be a bool, got {flag!r}")
    a_layout = "(K, M)" if transpose_a else "(M, K)"
    b_layout = "(N, K)" if transpose_b else "(K, N)"
    for name, x, layout in (("a", a, a_layout), ("b", b, b_layout)):
        _array(name, x)
        if x.ndim != 2:
            raise ValueError(
                f"matmul: {name} must be 2-D {layout}, got shape {tuple(x.shape)};"
                " batch with jax.vmap"
            )
        if jnp.dtype(x.dtype) not in IN_DTYPES:
            raise TypeError(f"matmul: {name} must have dtype {_names(IN_DTYPES)}; got {x.dtype}")
    a_dtype, b_dtype = jnp.dtype(a.dtype), jnp.dtype(b.dtype)
    if a_dtype != b_dtype and not (a_dtype in FP8_DTYPES and b_dtype in FP8_DTYPES):
        raise TypeError(f"matmul: a and b must have one dtype, got a {a_dtype} and b {b_dtype}")
    m, k = (a.shape[1], a.shape[0]) if transpose_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if transpose_b else b.shape
    if k != kb:
        raise ValueError(
            f"matmul: contraction sizes differ: a is {a_layout} = {tuple(a.shape)} (K={k}) but"
            f" b is {b_layout} = {tuple(b.shape)} (K={kb})"
        )
    return int(m), int(n), int(k)


def check_bias(bias: Array | None, n: int) -> None:
    """``bias`` is None or a floating ``(N,)`` vector."""
    if bias is None:
        return
    _array("bias", bias)
    if tuple(bias.shape) != (n,):
        raise ValueError(f"matmul: bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"matmul: bias must be a floating array, got {bias.dtype}")


def check_scales(a_scale: Array | None, b_scale: Array | None, in_dtype) -> None:
    """Per-tensor scales: real scalars, and only for fp8 operands (of dtype ``in_dtype``)."""
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        if s is None:
            continue
        if jnp.dtype(in_dtype) not in FP8_DTYPES:
            raise ValueError(
                f"matmul: {name} is for fp8 operands ({_names(FP8_DTYPES)}) only;"
                f" a and b are {jnp.dtype(in_dtype)}"
            )
        if not isinstance(s, (int, float)) and not hasattr(s, "dtype"):
            raise TypeError(
                f"matmul: {name} must be a real number or a scalar array, got"
                f" {type(s).__name__} {s!r}"
            )
        shape = tuple(np.shape(s))
        if shape not in ((), (1,)):
            raise ValueError(
                f"matmul: {name} must be a scalar (per-tensor scale), got shape {shape}"
            )
        dtype = jnp.result_type(s)
        if not jnp.issubdtype(dtype, jnp.floating) and not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(f"matmul: {name} must be a real number, got {dtype}")


def check_activation(activation: str | None) -> None:
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(
            f"matmul: activation must be None or one of {sorted(ACTIVATIONS)}, got {activation!r}"
        )


def check_out_dtype(out_dtype: Any, in_dtype) -> jnp.dtype:
    """The output dtype: given, else the input dtype (bfloat16 for fp8 inputs)."""
    if out_dtype is None:
        in_dtype = jnp.dtype(in_dtype)
        return jnp.dtype(jnp.bfloat16) if in_dtype in FP8_DTYPES else in_dtype
    try:
        dtype = jnp.dtype(out_dtype)
    except TypeError as error:
        raise TypeError(f"matmul: out_dtype must be a dtype, got {out_dtype!r}") from error
    if dtype not in OUT_DTYPES:
        raise TypeError(f"matmul: out_dtype must be one of {_names(OUT_DTYPES)}; got {dtype}")
    return dtype


def check_implementation(implementation: str | None) -> None:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"matmul: implementation must be None or one of {IMPLEMENTATIONS},"
            f" got {implementation!r}"
        )
