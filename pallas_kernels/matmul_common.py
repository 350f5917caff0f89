"""Semantics shared by every GEMM backend: epilogue activations, tile order, batching.

The operands of a GEMM kernel here are batched: ``a`` is ``(*batch_a, M, K)``
(``(*batch_a, K, M)`` when ``transpose_a``), ``b`` is ``(*batch_b, K, N)``
(``(*batch_b, N, K)`` when ``transpose_b``), and the optional per-column
epilogue vectors ``scale`` (float32) and ``bias`` (float32 or a 16-bit float, widened
in the epilogue) are ``(*batch_scale, N)`` and ``(*batch_bias, N)``. Each batch
shape has the rank of the output batch shape, which is their broadcast: every
dimension either equals the output's or is 1 (broadcast, read at index 0).
Broadcasting is resolved by index arithmetic inside the kernel, never by copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat, runtime

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_HALF = math.sqrt(0.5)


# erf(x) ~ x P(x^2) / Q(x^2) on [-4, 4] (erf is +-1 to float32 precision beyond):
# the float32 rational approximation XLA itself uses, to within 4e-7 absolute.
# Written out because the Pallas Triton lowering has no erf.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)


def erf(x: jax.Array) -> jax.Array:
    """float32 erf from multiply, add, divide and clamp (ops every backend lowers)."""
    x = jnp.clip(x, -4.0, 4.0)
    x2 = x * x
    p = x2 * _ERF_P[0] + _ERF_P[1]
    for c in _ERF_P[2:]:
        p = p * x2 + c
    q = x2 * _ERF_Q[0] + _ERF_Q[1]
    for c in _ERF_Q[2:]:
        q = q * x2 + c
    return x * p / q


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, ``x * Phi(x)`` (``jax.nn.gelu(approximate=False)``)."""
    return 0.5 * x * (1.0 + erf(x * _SQRT_HALF))


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation (``jax.nn.gelu``'s default), from ops every backend lowers."""
    return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))))


def silu(x: jax.Array) -> jax.Array:
    """SiLU (swish), ``x * sigmoid(x)``, with the sigmoid from ``exp(-|x|)``: it never
    overflows, so the derivative autodiff takes is finite everywhere (that of
    ``x / (1 + exp(-x))`` is inf / inf below x = -88)."""
    e = jnp.exp(-jnp.abs(x))
    return x * jnp.where(x >= 0.0, 1.0, e) / (1.0 + e)


def relu(x: jax.Array) -> jax.Array:
    """``max(x, 0)``."""
    return jnp.maximum(x, 0.0)


# The epilogue activations, by the name ``omni_jax.matmul(activation=...)`` takes.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu, "relu": relu,
}


def _along_rows(vector: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``(..., N)`` broadcast to ``(..., M, N)`` in one step (the 1-D case lowers in
    Mosaic-GPU to the accumulator's column layout, with no (1, N) intermediate)."""
    batch_dims = tuple(range(vector.ndim - 1))
    return lax.broadcast_in_dim(vector, shape, (*batch_dims, len(shape) - 1))


def epilogue(
    acc: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    activation: str | None,
    out_dtype,
) -> jax.Array:
    """``cast(act(acc * scale + bias))`` of float32 ``(..., M, N)``; ``(..., N)`` vectors."""
    if scale is not None:
        acc = acc * _along_rows(scale, acc.shape)
    if bias is not None:
        acc = acc + _along_rows(bias.astype(jnp.float32), acc.shape)
    if activation is not None:
        acc = ACTIVATIONS[activation](acc)
    return acc.astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """Static description of one (batched) GEMM call, shared by the kernel wrappers."""

    m: int
    n: int
    k: int
    batch_shape: tuple[int, ...]
    a_batch: tuple[int, ...]
    b_batch: tuple[int, ...]
    scale_batch: tuple[int, ...]
    bias_batch: tuple[int, ...]
    transpose_a: bool
    transpose_b: bool
    has_scale: bool
    has_bias: bool
    activation: str | None
    in_dtype: jnp.dtype
    out_dtype: jnp.dtype

    @property
    def batch(self) -> int:
        return math.prod(self.batch_shape)


def problem_of(
    a: jax.Array,
    b: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    *,
    transpose_a: bool,
    transpose_b: bool,
    activation: str | None,
    out_dtype,
) -> GemmProblem:
    """Reads the GemmProblem off batched operands laid out as in this module's docstring."""
    rank = a.ndim - 2
    m, k = (a.shape[-1], a.shape[-2]) if transpose_a else a.shape[-2:]
    n = b.shape[-2] if transpose_b else b.shape[-1]
    scale_batch, bias_batch = (
        (1,) * rank if vector is None else tuple(vector.shape[:-1]) for vector in (scale, bias)
    )
    batch_shape = tuple(
        max(dims)
        for dims in zip(a.shape[:-2], b.shape[:-2], scale_batch, bias_batch, strict=True)
    )
    return GemmProblem(
        m=m,
        n=n,
        k=k,
        batch_shape=batch_shape,
        a_batch=tuple(a.shape[:-2]),
        b_batch=tuple(b.shape[:-2]),
        scale_batch=scale_batch,
        bias_batch=bias_batch,
        transpose_a=transpose_a,
        transpose_b=transpose_b,
        has_scale=scale is not None,
        has_bias=bias is not None,
        activation=activation,
        in_dtype=jnp.dtype(a.dtype),
        out_dtype=jnp.dtype(out_dtype),
    )


def fp8_k_major(a: jax.Array, b: jax.Array, transpose_a: bool,
                transpose_b: bool) -> tuple[jax.Array, jax.Array, bool, bool]:
    """fp8 operands laid out K-major, as Hopper's fp8 MMA reads them.

    Returns ``(a, b, transpose_a, transpose_b)``; other layouts of fp8 operands
    are transposed once by XLA (the one copy a kernel makes), others pass through.
    """
    if jnp.dtype(a.dtype) in FP8_DTYPES:
        if transpose_a:
            a, transpose_a = jnp.swapaxes(a, -1, -2), False
        if not transpose_b:
            b, transpose_b = jnp.swapaxes(b, -1, -2), True
    return a, b, transpose_a, transpose_b


def flatten_batch(x: jax.Array | None, trailing: int) -> jax.Array | None:
    """Merges the leading batch dims of ``x`` into one (a free reshape)."""
    if x is None:
        return None
    lead = x.shape[: x.ndim - trailing]
    return x.reshape(math.prod(lead), *x.shape[x.ndim - trailing :])


def operand_batch_index(
    flat: jax.Array, batch_shape: tuple[int, ...], operand_batch: tuple[int, ...]
) -> jax.Array:
    """Index into an operand's flattened batch for the output's flat batch index ``flat``.

    Dimensions where the operand has size 1 are broadcast (contribute 0). Integer
    arithmetic here and in `grouped_tile` is lax's (indices are non-negative): jnp's
    floor division is a jitted function, which Mosaic-GPU does not lower inside a
    warp (`plgpu.warp_map`) under jax 0.10.
    """
    index = 0
    stride = 1
    rem = flat
    for size, own in zip(reversed(batch_shape), reversed(operand_batch), strict=True):
        if size > 1:
            coord = lax.rem(rem, size)
            rem = lax.div(rem, size)
            if own > 1:
                index = index + coord * stride
        stride *= own
    return index


def grouped_tile(pid: jax.Array, m_tiles: int, n_tiles: int, group_m: int):
    """Maps a linear tile id to (m, n) tile coordinates, ``group_m`` M-tiles at a time.

    Consecutive ids sweep a band of ``group_m`` tile rows column by column, so the
    tiles in flight at once share A rows and B columns in L2.
    """
    group_m = max(1, min(group_m, m_tiles))
    per_group = group_m * n_tiles
    group = lax.div(pid, per_group)
    first_m = group * group_m
    rows = lax.min(m_tiles - first_m, group_m)
    within = lax.rem(pid, per_group)
    return first_m + lax.rem(within, rows), lax.div(within, rows)


# ------------------------------------------------- TMA staging of the Mosaic-GPU GEMMs
# Shared by the Hopper (wgmma) and Blackwell (tcgen05) kernels: both stage operands and
# output tiles through shared memory swizzled in 128-byte rows, moved by TMA.

# Shared-memory tiles are swizzled in 128-byte rows, (8 rows, 128 bytes) per tile. A TMA
# into the tiled view addresses the global array through that tiling, so its two minor
# dimensions must be multiples of (8, 128 bytes); `tma_staging` lifts the 8-row multiple
# where it can.
SWIZZLE_BYTES = 128
TMA_TILE_ROWS = 8
MOSAIC_IN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), *FP8_DTYPES)


def epilogue_vector_count(problem: GemmProblem) -> int:
    """How many epilogue vectors (scale, bias) ``problem`` has."""
    return int(problem.has_scale) + int(problem.has_bias)


def stored_layouts(problem: GemmProblem) -> tuple[bool, bool]:
    """(transpose_a, transpose_b) as a Mosaic kernel reads the operands (fp8: K-major,
    `fp8_k_major`)."""
    if problem.in_dtype in FP8_DTYPES:
        return False, True
    return problem.transpose_a, problem.transpose_b


def _tma_tiled_only(problem: GemmProblem) -> dict[str, bool]:
    """Which arrays TMA must move through the (8, 128-byte) tiled view (see `tma_staging`).

    Blocks one swizzle row (128 bytes) wide can go through a view tiled by single rows
    instead: a with K minor, b with K minor, the output's epilogue tiles. a read as
    (K, M) and b as (K, N) have blocks several swizzle rows wide.
    """
    transpose_a, transpose_b = stored_layouts(problem)
    return {"a": transpose_a, "b": not transpose_b, "out": False}


def tma_unsupported_reason(problem: GemmProblem) -> str | None:
    """Why a Mosaic GEMM's TMA staging cannot move ``problem``'s arrays (None when it can).

    Every stored array needs rows a multiple of 128 bytes (TMA views rows in swizzle
    rows); a read as (K, M) and b read as (K, N) also need a multiple of 8 rows. Any
    other size, M in particular, is free.
    """
    if problem.in_dtype not in MOSAIC_IN_DTYPES:
        return f"input dtype {problem.in_dtype} is not one of bf16, f16, fp8 (e4m3fn, e5m2)"
    transpose_a, transpose_b = stored_layouts(problem)
    tiled_only = _tma_tiled_only(problem)
    p = problem
    for name, shape, itemsize in (
        ("a", (p.k, p.m) if transpose_a else (p.m, p.k), p.in_dtype.itemsize),
        ("b", (p.n, p.k) if transpose_b else (p.k, p.n), p.in_dtype.itemsize),
        ("out", (p.m, p.n), p.out_dtype.itemsize),
    ):
        cols = SWIZZLE_BYTES // itemsize
        rows = TMA_TILE_ROWS if tiled_only[name] else 1
        if shape[0] % rows or shape[1] % cols:
            need = f"{rows} rows and of {cols} columns" if rows > 1 else f"{cols} columns"
            return (
                f"the Mosaic kernel's TMA tiles need {name} (stored as {shape}) to have a"
                f" multiple of {need}"
            )
    return None


def swizzled_smem(shape: tuple[int, ...], dtype):
    """A shared-memory buffer tiled and swizzled for the MMA and TMA along its minor
    dimension."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(shape[-1] * bits)
    transforms = (
        plgpu.TilingTransform((8, swizzle * 8 // bits)),
        plgpu.SwizzleTransform(swizzle),
    )
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def tma_staging(shape: tuple[int, ...], dtype, untiled_tma: bool):
    """A staging buffer: the tiled view alone, or (tiled view, plain swizzled view).

    The MMA and register stores use the tiled view. When the buffer's minor extent is
    one 128-byte swizzle row, the two views are the same bytes, and a TMA through the
    plain one addresses the global array untiled: no divisibility requirement on the
    array, TMA bounds handle every tail.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tiled = swizzled_smem(shape, dtype)
    if not untiled_tma:
        return tiled
    row_elements = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    plain = plgpu.SMEM(
        shape, dtype,
        transforms=(
            plgpu.TilingTransform((1, row_elements)), plgpu.SwizzleTransform(SWIZZLE_BYTES)
        ),
    )
    return plgpu.RefUnion(tiled, plain)


def untiled_tma_arrays(problem: GemmProblem, interpreted: bool) -> dict[str, bool]:
    """Per array: TMA through the row-tiled view (arrays whose rows 8 do not divide).

    The interpreter neither needs it (it does not tile global arrays) nor runs aliased
    views, so interpreted kernels always use the tiled view.
    """
    if interpreted:
        return {"a": False, "b": False, "out": False}
    p = problem
    rows = {"a": p.k if p.transpose_a else p.m, "b": p.n if p.transpose_b else p.k, "out": p.m}
    tiled_only = _tma_tiled_only(p)
    return {name: not tiled_only[name] and rows[name] % TMA_TILE_ROWS != 0 for name in rows}


def mosaic_problem(a: jax.Array, b: jax.Array, scale: jax.Array | None,
                   bias: jax.Array | None, *, transpose_a: bool, transpose_b: bool,
                   activation: str | None, out_dtype, mma: str,
                   unsupported_reason: Callable[[GemmProblem], str | None],
                   ) -> tuple[jax.Array, jax.Array, GemmProblem]:
    """A Mosaic GEMM wrapper's operands (fp8 made K-major) and problem; ValueError if the
    operand dtypes differ (``mma`` names the instruction) or ``unsupported_reason`` says
    the kernel cannot run it."""
    if jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
        raise ValueError(f"{mma} needs one operand dtype, got {a.dtype} and {b.dtype}")
    a, b, transpose_a, transpose_b = fp8_k_major(a, b, transpose_a, transpose_b)
    p = problem_of(a, b, scale, bias, transpose_a=transpose_a, transpose_b=transpose_b,
                   activation=activation, out_dtype=out_dtype)
    reason = unsupported_reason(p)
    if reason is not None:
        raise ValueError(reason)
    return a, b, p


def launch_mosaic_gemm(body: Callable, p: GemmProblem, epilogue_tile_n: int,
                       a: jax.Array, b: jax.Array, scale: jax.Array | None,
                       bias: jax.Array | None, *, num_programs: int, num_threads: int,
                       cluster: dict) -> jax.Array:
    """Runs a Mosaic GEMM kernel ``body`` (called with ``untiled_tma=``) on one program per
    persistent CTA (or cluster), compiled or interpreted; returns ``(*batch, M, N)``."""
    interpret = runtime.mosaic_interpret_params()
    if interpret is not None:
        interpret = compat.tma_faithful_interpret_params(interpret)
    untiled_tma = untiled_tma_arrays(p, interpreted=interpret is not None)
    if untiled_tma["out"] and epilogue_tile_n * p.out_dtype.itemsize != SWIZZLE_BYTES:
        raise ValueError(
            f"an output of shape {(p.m, p.n)} needs epilogue tiles one swizzle row"
            f" ({SWIZZLE_BYTES} bytes) wide; got epilogue_tile_n={epilogue_tile_n}"
        )
    kernel = compat.mosaic_kernel(
        functools.partial(body, untiled_tma=untiled_tma),
        jax.ShapeDtypeStruct((p.batch, p.m, p.n), p.out_dtype),
        grid=(num_programs,),
        grid_names=("sm",),
        **cluster,
        num_threads=num_threads,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
            # Hardware tanh/exp/division in the activation: their error (~2^-11)
            # is below a 16-bit output's rounding; float32 outputs keep exact math.
            approx_math=p.activation is not None and p.out_dtype.itemsize == 2,
        ),
        interpret=interpret,
    )
    operands = [flatten_batch(a, 2), flatten_batch(b, 2)]
    operands += [flatten_batch(v, 1) for v in (scale, bias) if v is not None]
    return kernel(*operands).reshape(*p.batch_shape, p.m, p.n)
