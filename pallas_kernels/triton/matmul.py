"""Portable GEMM for sm80+ GPUs, in Pallas with the Triton lowering.

One program per ``(block_m, block_n)`` output tile and batch index. Tiles are
numbered in a grouped order (``group_m`` tile rows per band) so that programs
running together share A rows and B columns in L2. The K loop is a
``fori_loop`` that Triton software-pipelines over ``num_stages`` stages.
Operands are whole-array refs read through masked loads: M/N/K tails need no
padding copies, transposed layouts are a ``dot_general`` contracting dimension
(Triton transposes the tile in registers/shared memory, not in HBM), and
size-1 batch dimensions are broadcast by index arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, runtime
from pallas_kernels.matmul_common import (
    FP8_DTYPES,
    GemmProblem,
    epilogue,
    flatten_batch,
    fp8_k_major,
    grouped_tile,
    operand_batch_index,
    problem_of,
)

_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), *FP8_DTYPES)


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiling of the Triton GEMM (block sizes are powers of two, at least 16)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4

    def check(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16; got {size}")


def _fit(size: int, block: int) -> int:
    """``block``, or the smallest power of two >= 16 covering a smaller ``size``."""
    return min(block, max(16, pl.next_power_of_2(size)))


def default_config(m: int, n: int, k: int, in_dtype) -> MatmulConfig:
    """Defaults per shape class; blocks shrink to cover small problems in one tile."""
    fp8 = jnp.dtype(in_dtype) in FP8_DTYPES
    if m * n >= 4096 * 4096:
        base = MatmulConfig(block_m=128, block_n=256, block_k=128 if fp8 else 64,
                            num_warps=8, num_stages=3)
    else:
        base = MatmulConfig(block_k=128 if fp8 else 64)
    return dataclasses.replace(
        base,
        block_m=_fit(m, base.block_m),
        block_n=_fit(n, base.block_n),
        block_k=_fit(k, base.block_k),
    )


def unsupported_reason(problem: GemmProblem) -> str | None:
    """Why this kernel cannot run ``problem`` (None when it can); devices are not checked."""
    if problem.in_dtype not in _IN_DTYPES:
        return f"input dtype {problem.in_dtype} is not one of bf16, f16, fp8 (e4m3fn, e5m2)"
    return None


def _mask(rows_ok: jax.Array | None, cols_ok: jax.Array | None, shape) -> jax.Array:
    """The mask of a ``shape`` tile from its row and column masks (None: all in bounds)."""
    if rows_ok is None:
        return jnp.broadcast_to(cols_ok[None, :], shape)
    if cols_ok is None:
        return jnp.broadcast_to(rows_ok[:, None], shape)
    return rows_ok[:, None] & cols_ok[None, :]


def _kernel(a_ref, b_ref, *refs, p: GemmProblem, config: MatmulConfig):
    """One output tile: refs are [scale], [bias], out."""
    refs = list(refs)
    scale_ref = refs.pop(0) if p.has_scale else None
    bias_ref = refs.pop(0) if p.has_bias else None
    (out_ref,) = refs
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    m_tiles, n_tiles = pl.cdiv(p.m, bm), pl.cdiv(p.n, bn)

    mi, ni = grouped_tile(pl.program_id(0), m_tiles, n_tiles, config.group_m)
    batch = pl.program_id(1)
    a_index, b_index, scale_index, bias_index = (
        jnp.asarray(operand_batch_index(batch, p.batch_shape, own), jnp.int32)
        for own in (p.a_batch, p.b_batch, p.scale_batch, p.bias_batch)
    )
    m0, n0 = mi * bm, ni * bn
    rows_ok = (m0 + lax.broadcasted_iota(jnp.int32, (bm,), 0)) < p.m
    cols_ok = (n0 + lax.broadcasted_iota(jnp.int32, (bn,), 0)) < p.n
    k_tail = p.k % bk != 0

    def step(ki, acc):
        k0 = ki * bk
        # Full K blocks (known statically) need no K mask.
        k_ok = (k0 + lax.broadcasted_iota(jnp.int32, (bk,), 0)) < p.k if k_tail else None
        if p.transpose_a:  # stored (K, M): the tile is (bk, bm), contracted on dim 0
            a_tile = a_ref.at[a_index, pl.ds(k0, bk), pl.ds(m0, bm)]
            a_mask = _mask(k_ok, rows_ok, (bk, bm))
        else:
            a_tile = a_ref.at[a_index, pl.ds(m0, bm), pl.ds(k0, bk)]
            a_mask = _mask(rows_ok, k_ok, (bm, bk))
        if p.transpose_b:  # stored (N, K): the tile is (bn, bk), contracted on dim 1
            b_tile = b_ref.at[b_index, pl.ds(n0, bn), pl.ds(k0, bk)]
            b_mask = _mask(cols_ok, k_ok, (bn, bk))
        else:
            b_tile = b_ref.at[b_index, pl.ds(k0, bk), pl.ds(n0, bn)]
            b_mask = _mask(k_ok, cols_ok, (bk, bn))
        a = compat.triton_load(a_tile, mask=a_mask, other=0.0)
        b = compat.triton_load(b_tile, mask=b_mask, other=0.0)
        contract = ((0 if p.transpose_a else 1,), (1 if p.transpose_b else 0,))
        return acc + lax.dot_general(
            a, b, (contract, ((), ())), preferred_element_type=jnp.float32
        )

    acc = lax.fori_loop(0, pl.cdiv(p.k, bk), step, jnp.zeros((bm, bn), jnp.float32))
    vectors = [
        None if ref is None
        else compat.triton_load(ref.at[index, pl.ds(n0, bn)], mask=cols_ok, other=0.0)
        for ref, index in ((scale_ref, scale_index), (bias_ref, bias_index))
    ]
    out = epilogue(acc, *vectors, p.activation, p.out_dtype)
    compat.triton_store(
        out_ref.at[batch, pl.ds(m0, bm), pl.ds(n0, bn)], out, mask=_mask(rows_ok, cols_ok, (bm, bn))
    )


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
    config: MatmulConfig | None = None,
) -> jax.Array:
    """Batched ``act(op(a) @ op(b) * scale + bias)``; operands as in ``matmul_common``.

    Returns ``(*batch_shape, M, N)``. Validation of user input lives in ``omni_jax.matmul``.
    """
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    a, b, transpose_a, transpose_b = fp8_k_major(a, b, transpose_a, transpose_b)
    p = problem_of(
        a, b, scale, bias,
        transpose_a=transpose_a, transpose_b=transpose_b,
        activation=activation, out_dtype=out_dtype,
    )
    reason = unsupported_reason(p)
    if reason is not None:
        raise ValueError(reason)
    config = config or default_config(p.m, p.n, p.k, p.in_dtype)
    config.check()
    operands = [flatten_batch(a, 2), flatten_batch(b, 2)]
    operands += [flatten_batch(v, 1) for v in (scale, bias) if v is not None]
    tiles = pl.cdiv(p.m, config.block_m) * pl.cdiv(p.n, config.block_n)
    out = pl.pallas_call(
        functools.partial(_kernel, p=p, config=config),
        out_shape=compat.result_type((p.batch, p.m, p.n), out_dtype,
                                     compat.varying_axes(operands)),
        grid=(tiles, p.batch),
        compiler_params=compat.triton_compiler_params(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        interpret=runtime.interpret_requested(),
        name="omni_jax_matmul",
    )(*operands)
    return out.reshape(*p.batch_shape, p.m, p.n)


__all__ = ["MatmulConfig", "default_config", "matmul", "unsupported_reason"]
