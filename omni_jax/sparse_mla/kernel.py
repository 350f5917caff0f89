"""The SM90 sparse MLA prefill CUDA kernel, called through XLA FFI.

Shape limits of the kernel and the ``jax.ffi.ffi_call`` that launches it. Under
``jax.vmap`` the call uses ``vmap_method="broadcast_all"``: the handler receives the
batch as leading dimensions and launches one grid with a batch axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.sparse_mla.validation import ProblemShape
from pallas_kernels import compat

KERNEL_D_QK = 576
KERNEL_D_V = 512
HEADS_PER_TILE = 64
TOPK_PER_TILE = 64

TARGET_NAME = "omni_jax_sparse_mla_prefill_sm90"
SCORES_TARGET_NAME = "omni_jax_sparse_mla_prefill_scores_sm90"


def unsupported_reason(shape: ProblemShape, dtype: jnp.dtype) -> str | None:
    """Why the kernel cannot take this problem, or None when it can."""
    if dtype != jnp.bfloat16:
        return f"the kernel needs bfloat16 q/kv, got {dtype}"
    if shape.d_qk != KERNEL_D_QK:
        return f"the kernel needs d_qk={KERNEL_D_QK}, got {shape.d_qk}"
    if shape.d_v != KERNEL_D_V:
        return f"the kernel needs d_v={KERNEL_D_V}, got {shape.d_v}"
    if shape.h_q % HEADS_PER_TILE:
        return f"the kernel needs h_q to be a multiple of {HEADS_PER_TILE}, got {shape.h_q}"
    if shape.topk % TOPK_PER_TILE:
        return f"the kernel needs topk to be a multiple of {TOPK_PER_TILE}, got {shape.topk}"
    return None


def forward(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    *,
    sm_scale: float,
    return_scores: bool,
) -> tuple[jax.Array, ...]:
    """(out, max_logits, lse[, scores]) from the CUDA kernel; the library must be registered."""
    s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    axes = compat.varying_axes(q, kv, indices)  # Inside a jax.shard_map.
    out_types = [
        compat.result_type((s_q, h_q, KERNEL_D_V), q.dtype, axes),
        compat.result_type((s_q, h_q), jnp.float32, axes),
        compat.result_type((s_q, h_q), jnp.float32, axes),
    ]
    if return_scores:
        out_types.append(compat.result_type((s_q, h_q, topk), jnp.float32, axes))
    call = jax.ffi.ffi_call(
        SCORES_TARGET_NAME if return_scores else TARGET_NAME,
        out_types,
        vmap_method="broadcast_all",
    )
    # FFI attributes must be hashable host scalars (a numpy float32 becomes an f32
    # attribute); a jax array, even a concrete one, is rejected by ffi_call.
    return tuple(call(q, kv, indices, sm_scale=np.float32(sm_scale)))
