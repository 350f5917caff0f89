"""``sparse_mla_prefill``: DeepSeek-style sparse MLA prefill with optional score output.

Dispatch: ``implementation=None`` runs the SM90 CUDA kernel (XLA FFI) when the
default backend is an sm90 GPU, the shapes fit the kernel and the FFI library
loads; otherwise the portable JAX path. The kernel forward pairs with the portable
backward through ``jax.custom_vjp``, so the op trains under ``jax.grad`` either way.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import jax

from omni_jax import explicit_sharding, ffi
from omni_jax.dispatch_log import log_once, warn_slow_fallback
from omni_jax.sparse_mla import kernel, xla
from omni_jax.sparse_mla.validation import ProblemShape, validate
from pallas_kernels import compat

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Config:
    """Static (non-differentiable) parameters of one call."""

    sm_scale: float
    d_v: int
    return_scores: bool
    use_kernel: bool


def kernel_platform_reason() -> str | None:
    """Why this process cannot run the SM90 kernel (device or FFI library), or None."""
    device_reason = ffi.device_reason()
    if device_reason is not None:
        return device_reason
    loaded = ffi.load()
    return None if loaded.loaded else loaded.reason


def _use_kernel(implementation: str | None, shape: ProblemShape, dtype) -> bool:
    """Whether the SM90 kernel serves the call; with ``implementation=None`` the choice is
    logged at DEBUG to the ``omni_jax`` logger (each distinct one once), with the reason
    the kernel declined."""
    if implementation == "xla":
        return False
    shape_reason = kernel.unsupported_reason(shape, dtype)
    if shape_reason is not None:
        if implementation == "ffi":
            raise ValueError(f"implementation='ffi' cannot run this problem: {shape_reason}")
        log_once(logger, logging.DEBUG, "sparse_mla_prefill %s: the portable path (%s)",
                 shape, shape_reason)
        return False
    platform_reason = kernel_platform_reason()
    if platform_reason is not None:
        if implementation == "ffi":
            raise RuntimeError(f"implementation='ffi' is unavailable: {platform_reason}")
        log_once(logger, logging.DEBUG, "sparse_mla_prefill %s: the portable path (%s)",
                 shape, platform_reason)
        if ffi.device_reason() is None:  # An sm90 GPU without the library: 25x slower.
            warn_slow_fallback(
                f"sparse_mla_prefill runs its portable path on this sm90 GPU, about 25x "
                f"slower than the kernel: {platform_reason}. Install the build inputs with "
                f"pip install \"omni-jax[ffi]\" (nvcc must be on PATH), then "
                f"`python -m omni_jax.ffi build`; `python -m omni_jax info` shows the state. "
                f"implementation='xla' asks for the portable path without this warning.")
        return False
    log_once(logger, logging.DEBUG, "sparse_mla_prefill %s: the SM90 kernel", shape)
    return True


def _forward(q, kv, indices, config: _Config) -> tuple[jax.Array, ...]:
    if config.use_kernel:
        return kernel.forward(
            q, kv, indices, sm_scale=config.sm_scale, return_scores=config.return_scores
        )
    result = xla.forward(
        q, kv[:, 0], indices[:, 0],
        sm_scale=config.sm_scale, d_v=config.d_v, return_scores=config.return_scores,
    )
    return tuple(x for x in result if x is not None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _prefill(q, kv, indices, config: _Config):
    return _forward(q, kv, indices, config)


def _prefill_fwd(q, kv, indices, config: _Config):
    outputs = _forward(q, kv, indices, config)
    out, _, lse = outputs[:3]
    return outputs, (q, kv, indices, out, lse)


def _prefill_bwd(config: _Config, residuals, cotangents):
    q, kv, indices, out, lse = residuals
    d_out, _, d_lse = cotangents[:3]
    d_scores = cotangents[3] if config.return_scores else None
    dq, dkv = xla.backward(
        q, kv[:, 0], indices[:, 0], out, lse, d_out, d_lse, d_scores,
        sm_scale=config.sm_scale, d_v=config.d_v,
    )
    return dq, dkv[:, None, :], None


_prefill.defvjp(_prefill_fwd, _prefill_bwd)
# Eager calls compile once per config and shapes, not at every call.
_jitted_prefill = jax.jit(_prefill, static_argnums=(3,))


def sparse_mla_prefill(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    *,
    sm_scale: float,
    d_v: int = 512,
    return_scores: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, ...]:
    """Sparse MLA prefill: each query row attends to the kv rows its indices list.

    Args:
      q: [s_q, h_q, d_qk] queries (bfloat16 for the kernel).
      kv: [s_kv, 1, d_qk] shared latent keys; the first ``d_v`` features are the values.
      indices: [s_q, 1, topk] int32 kv rows per query row; entries < 0 or >= s_kv are
        invalid and masked. Duplicates count once per occurrence.
      sm_scale: softmax scale applied to the dot products; a static Python or numpy
        number (it is compiled in), not a jax array.
      d_v: value width (512 for the kernel), at most d_qk; a static integer.
      return_scores: also return the raw (unscaled) scores.
      implementation: None (kernel when possible, else portable), "ffi" (kernel or
        error) or "xla" (portable JAX).

    Returns:
      ``(out, max_logits, lse)`` and, with ``return_scores``, ``scores``:
      out [s_q, h_q, d_v] (q dtype); max_logits, lse [s_q, h_q] float32 of the scaled
      scores (natural log); scores [s_q, h_q, topk] float32 q . kv[index], -inf where
      invalid. Rows without a valid index give out = 0, lse = max_logits = -inf.
      Gradients flow to q and kv through out, lse and scores (max_logits is treated as
      constant). Works under jit, vmap (batched kernel launch) and grad.
    """
    shape = validate(
        q, kv, indices, sm_scale=sm_scale, d_v=d_v,
        return_scores=return_scores, implementation=implementation,
    )
    config = _Config(
        sm_scale=float(sm_scale),
        d_v=shape.d_v,
        return_scores=return_scores,
        use_kernel=_use_kernel(implementation, shape, q.dtype),
    )
    # Inside a jax.shard_map the custom_vjp's operands vary alike (see omni_jax.attention).
    q, kv, indices = compat.vary_alike((q, kv, indices))
    return explicit_sharding.call(lambda *x: _jitted_prefill(*x, config), (q, kv, indices),
                                  lambda: _out_specs(q, return_scores))


def _out_specs(q: jax.Array, return_scores: bool) -> tuple:
    """Where the results lie: their (row, head) axes as q's."""
    rows, heads, _ = explicit_sharding.dims(explicit_sharding.spec_of(q), 3)
    per_row = explicit_sharding.unique((rows, heads))
    per_feature = explicit_sharding.unique((rows, heads, None))
    return (per_feature, per_row, per_row, *((per_feature,) if return_scores else ()))
