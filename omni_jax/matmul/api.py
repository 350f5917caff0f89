"""The public ``matmul``: validation, backend choice, gradients and batching.

Layering: ``matmul`` validates and picks an implementation, then calls a
``custom_vjp`` function whose forward and backward GEMMs all go through
``_gemm``, a ``custom_vmap`` function (its JVP stated in GEMMs, for forward-mode
derivatives of those rules: `jax.hessian`). Under ``jax.vmap`` the batching rule
adds the mapped axis as a leading batch dimension of every operand (size 1
for unmapped ones, a free reshape) and calls the implementation once: the
result's batch is the broadcast of all operands' (the epilogue vectors' too),
the kernels run it as a grid axis of a single launch and broadcast size-1
operands by index arithmetic, never by copies.

The backward pass reuses the forward kernel with transposed-operand layouts
(``dA = dC B^T``, ``dB = A^T dC``); no transpose is materialised.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from omni_jax import explicit_sharding
from omni_jax.matmul import implementations
from omni_jax.matmul import validation as check
from pallas_kernels import compat
from pallas_kernels.matmul_common import ACTIVATIONS, problem_of

# Bias dtypes every GEMM kernel reads as given (widening in its epilogue); others are
# converted to float32 first.
_BIAS_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

Array = Any
IMPLEMENTATIONS = check.IMPLEMENTATIONS


def matmul(
    a: Array,
    b: Array,
    *,
    bias: Array | None = None,
    activation: str | None = None,
    out_dtype: Any = None,
    transpose_a: bool = False,
    transpose_b: bool = False,
    a_scale: Array | None = None,
    b_scale: Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """``activation(op(a) @ op(b) * a_scale * b_scale + bias)`` cast to ``out_dtype``.

    Args:
      a: ``(M, K)``, or ``(K, M)`` with ``transpose_a=True``; bfloat16, float16,
        float32 (served by "xla" only) or fp8 (float8_e4m3fn / float8_e5m2).
      b: ``(K, N)``, or ``(N, K)`` with ``transpose_b=True``; a's dtype (any pair of
        fp8 dtypes may mix). Batch dimensions: through ``jax.vmap``.
      bias: optional ``(N,)`` vector added to every row (in float32).
      activation: None, "gelu" (exact, erf), "gelu_tanh", "silu" or "relu".
      out_dtype: bfloat16, float16 or float32; default the input dtype
        (bfloat16 for fp8 inputs).
      transpose_a, transpose_b: read the operand transposed, without copying it.
      a_scale, b_scale: per-tensor scales of fp8 (e4m3fn / e5m2) operands.
      implementation: None (best for the device), "mosaic" (the Hopper or
        Blackwell kernel), "triton" (portable Pallas kernel) or "xla" (``jnp.dot``).

    Products accumulate in float32, except that in the Mosaic kernel Hopper's tensor
    cores add fp8 products at their own precision (about 14 mantissa bits: relative
    errors near 3e-4). Differentiable (not for fp8 operands), jittable, and batched
    by ``jax.vmap`` in one kernel launch. With an activation, differentiation keeps
    the pre-activation (M x N, in out_dtype; float32 for float16, whose range it may
    exceed) for the backward pass. The default
    implementation takes the best kernel that serves the call: the Mosaic kernel
    needs rows of a multiple of 128 bytes in every stored array (and a multiple of 8
    rows for ``a`` read as (K, M) or ``b`` as (K, N)); other sizes go to the Triton
    kernel, which takes any.
    """
    _, n, _ = check.check_operands(a, b, transpose_a, transpose_b)
    fp8 = jnp.dtype(a.dtype) in check.FP8_DTYPES
    check.check_bias(bias, n)
    check.check_scales(a_scale, b_scale, a.dtype)
    check.check_activation(activation)
    out_dtype = check.check_out_dtype(out_dtype, a.dtype)
    check.check_implementation(implementation)

    scale = None
    if fp8 and (a_scale is not None or b_scale is not None):
        one = jnp.ones((), jnp.float32)
        product = jnp.asarray(one if a_scale is None else a_scale, jnp.float32).reshape(())
        b_factor = jnp.asarray(one if b_scale is None else b_scale, jnp.float32)
        product = product * b_factor.reshape(())
        scale = jnp.broadcast_to(product, (n,))
    if bias is not None and jnp.dtype(bias.dtype) not in _BIAS_DTYPES:
        bias = jnp.asarray(bias, jnp.float32)  # 16-bit and float32 biases stay as given

    spec = _Spec(bool(transpose_a), bool(transpose_b), activation, out_dtype, "xla")
    problem = spec.problem(a, b, scale, bias)
    spec = dataclasses.replace(spec, implementation=implementations.choose(implementation, problem),
                               trace_state=implementations.trace_state())
    # Inside a jax.shard_map the custom_vjp's operands vary alike: autodiff then sums the
    # gradients of replicated ones (weights) over the devices.
    operands = (a, b, scale, bias)
    call = lambda *x: _differentiable(spec)(*compat.vary_alike(x))
    return explicit_sharding.call(call, operands, lambda: _out_spec(spec, a, b))


def _out_spec(spec: _Spec, a: jax.Array, b: jax.Array):
    """Where the (M, N) result lies: rows as a's M, columns as b's N."""
    a_rows, a_cols = explicit_sharding.dims(explicit_sharding.spec_of(a), 2)
    b_rows, b_cols = explicit_sharding.dims(explicit_sharding.spec_of(b), 2)
    return explicit_sharding.unique((a_cols if spec.transpose_a else a_rows,
                                     b_rows if spec.transpose_b else b_cols))


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static part of one GEMM call."""

    transpose_a: bool
    transpose_b: bool
    activation: str | None
    out_dtype: jnp.dtype
    implementation: str
    # `implementations.trace_state()`: a new state gets its own jitted function.
    trace_state: Any = None

    def problem(self, a, b, scale, bias):
        return problem_of(
            a, b, scale, bias,
            transpose_a=self.transpose_a, transpose_b=self.transpose_b,
            activation=self.activation, out_dtype=self.out_dtype,
        )


def _gemm(spec: _Spec, a, b, scale=None, bias=None) -> jax.Array:
    """One GEMM through ``spec.implementation``, batched by vmap as a kernel grid axis."""
    operands = [x for x in (a, b, scale, bias) if x is not None]
    return _batchable(spec, scale is not None, bias is not None)(*operands)


@functools.cache
def _batchable(spec: _Spec, has_scale: bool, has_bias: bool):
    implementation = implementations.module(spec.implementation)

    @jax.custom_batching.custom_vmap
    def batched(a, b, *vectors):
        vectors = list(vectors)
        scale = vectors.pop(0) if has_scale else None
        bias = vectors.pop(0) if has_bias else None
        return implementation.matmul(
            a, b, scale, bias,
            transpose_a=spec.transpose_a, transpose_b=spec.transpose_b,
            activation=spec.activation, out_dtype=spec.out_dtype,
        )

    @batched.def_vmap
    def _batched(axis_size, in_batched, *operands):
        # Mapped operands carry the new axis first; the others get a size-1 axis
        # there, which the implementations broadcast without copying.
        del axis_size
        operands = [
            x if mapped else x[None] for x, mapped in zip(operands, in_batched, strict=True)
        ]
        return gemm(*operands), True

    # JAX's JVP of a custom_vmap function re-enters its batching rule without end when
    # only tangents are batched (jax.hessian of the backward GEMMs): the JVP is stated
    # here instead, in GEMMs of the same kind.
    gemm = jax.custom_jvp(batched)

    @functools.partial(gemm.defjvp, symbolic_zeros=True)
    def _jvp(primals, tangents):
        a, b, *vectors = primals
        da, db, *d_vectors = tangents
        scale = vectors[0] if has_scale else None
        bias, d_bias = (vectors[-1], d_vectors[-1]) if has_bias else (None, None)
        # With an activation, its input (one float32 GEMM) gives the output too.
        linear = None if spec.activation is None else _tangent_gemm(spec, a, b, scale, bias)
        out = gemm(*primals) if linear is None else None
        # d(op(a) op(b) * scale + bias) = (op(da) op(b) + op(a) op(db)) * scale
        #                                 + op(a) op(b) * d_scale + d_bias
        terms = [(da, (da, b, scale)), (db, (a, db, scale))]
        if has_scale:
            terms.append((d_vectors[0], (a, b, d_vectors[0])))
        d_linear = jnp.zeros((out if linear is None else linear).shape, jnp.float32)
        for tangent, operands in terms:
            if not _is_zero(tangent):
                d_linear = d_linear + _tangent_gemm(spec, *operands)
        if has_bias and not _is_zero(d_bias):
            d_linear = d_linear + d_bias.astype(jnp.float32)[..., None, :]
        if linear is not None:
            out, d_linear = jax.jvp(ACTIVATIONS[spec.activation], (linear,), (d_linear,))
            out = out.astype(spec.out_dtype)
        return out, d_linear.astype(out.dtype)

    return gemm


def _is_zero(tangent) -> bool:
    return isinstance(tangent, jax.custom_derivatives.SymbolicZero)


def _tangent_gemm(spec: _Spec, a, b, scale, bias=None) -> jax.Array:
    """``op(a) op(b) * scale + bias`` in float32, without the activation."""
    linear_spec = dataclasses.replace(spec, activation=None, out_dtype=jnp.dtype(jnp.float32))
    linear_spec = dataclasses.replace(linear_spec, implementation=implementations.fallback(
        spec.implementation, linear_spec.problem(a, b, scale, bias)))
    return _gemm(linear_spec, a, b, scale, bias)


@functools.cache
def _differentiable(spec: _Spec):
    """``custom_vjp`` of the fused GEMM for one static spec, jitted: an eager call compiles
    once per spec and shapes, not at every call."""

    @jax.custom_vjp
    def fused(a, b, scale, bias):
        return _gemm(spec, a, b, scale, bias)

    def forward(a, b, scale, bias):
        # The bias (an N-vector) stays a residual for its dtype, which its gradient takes.
        if spec.activation is None:
            return _gemm(spec, a, b, scale, bias), (a, b, None, bias)
        # The pre-activation, kept for the activation's derivative, is stored in out_dtype,
        # except float16: its range ends at 65504, and at inf the activations' values and
        # derivatives are NaN. (Recomputing it in the backward pass would cost a GEMM;
        # jax.checkpoint offers that trade to the caller.)
        stored = jnp.float32 if spec.out_dtype == jnp.float16 else spec.out_dtype
        linear_spec = dataclasses.replace(spec, activation=None, out_dtype=jnp.dtype(stored))
        linear = _gemm(linear_spec, a, b, scale, bias)
        out = ACTIVATIONS[spec.activation](linear.astype(jnp.float32)).astype(spec.out_dtype)
        return out, (a, b, linear, bias)

    def backward(residuals, d_out):
        a, b, linear, bias = residuals
        if jnp.dtype(a.dtype) in check.FP8_DTYPES:
            raise TypeError("matmul: gradients through fp8 operands are not supported")
        d_linear = d_out.astype(jnp.float32)
        if spec.activation is not None:
            _, activation_vjp = jax.vjp(ACTIVATIONS[spec.activation],
                                        linear.astype(jnp.float32))
            (d_linear,) = activation_vjp(d_linear)
        d_a, d_b = _operand_gradients(spec, a, b, d_linear.astype(a.dtype))
        d_bias = None if bias is None else d_linear.sum(axis=0).astype(bias.dtype)
        return d_a, d_b, None, d_bias

    fused.defvjp(forward, backward)
    return jax.jit(fused)


def _operand_gradients(spec: _Spec, a, b, d_c):
    """(dA, dB) in the stored layouts of a and b: GEMMs on a, b and dC, read transposed.

    With ``op(A)`` (M, K), ``op(B)`` (K, N): ``d op(A) = dC op(B)^T`` and
    ``d op(B) = op(A)^T dC``; each case picks the operand order and transpose
    flags that yield the gradient directly in the layout the operand is stored in.
    """
    ta, tb = spec.transpose_a, spec.transpose_b
    if ta:  # A stored (K, M): dA = op(B) dC^T
        d_a = _backward_gemm(spec, b, d_c, transpose_a=tb, transpose_b=True, out_dtype=a.dtype)
    else:  # dA = dC op(B)^T
        d_a = _backward_gemm(spec, d_c, b, transpose_a=False, transpose_b=not tb, out_dtype=a.dtype)
    if tb:  # B stored (N, K): dB = dC^T op(A)
        d_b = _backward_gemm(spec, d_c, a, transpose_a=True, transpose_b=ta, out_dtype=b.dtype)
    else:  # dB = op(A)^T dC
        d_b = _backward_gemm(spec, a, d_c, transpose_a=not ta, transpose_b=False, out_dtype=b.dtype)
    return d_a, d_b


def _backward_gemm(spec: _Spec, x, y, *, transpose_a, transpose_b, out_dtype):
    grad_spec = _Spec(transpose_a, transpose_b, None, jnp.dtype(out_dtype), spec.implementation)
    problem = grad_spec.problem(x, y, None, None)
    grad_spec = dataclasses.replace(
        grad_spec, implementation=implementations.fallback(spec.implementation, problem)
    )
    return _gemm(grad_spec, x, y)
