"""Trace-time checks of sparse_mla_prefill arguments, with messages naming the argument."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = (None, "ffi", "xla")


@dataclass(frozen=True)
class ProblemShape:
    """Sizes of one (unbatched) sparse MLA prefill problem."""

    s_q: int
    h_q: int
    d_qk: int
    s_kv: int
    h_kv: int
    topk: int
    d_v: int


def _check_array(name: str, value: object, rank: int, layout: str) -> None:
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name} must be a jax or numpy array {layout}, got {type(value).__name__}")
    if value.ndim != rank:
        raise ValueError(
            f"{name} must have rank {rank} {layout}, got shape {tuple(value.shape)}"
        )


def _static_number(name: str, value: object, kind: type, expected: str) -> numbers.Number:
    """``value`` when it is a Python or numpy scalar of ``kind`` (bools excluded)."""
    if isinstance(value, kind) and not isinstance(value, bool):
        return value
    got = (f"{type(value).__name__} of shape {tuple(value.shape)}" if hasattr(value, "shape")
           else f"{type(value).__name__} {value!r}")
    raise TypeError(f"{name} must be a static {expected} (a Python or numpy scalar, not a jax "
                    f"array or tracer: it is compiled into the computation), got {got}")


def validate(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    *,
    sm_scale: float,
    d_v: int,
    return_scores: bool,
    implementation: str | None,
) -> ProblemShape:
    """Raises TypeError/ValueError for malformed arguments; returns the problem sizes
    (``d_v`` as a Python int, though it may be given as a numpy integer)."""
    _check_array("q", q, 3, "[s_q, h_q, d_qk]")
    _check_array("kv", kv, 3, "[s_kv, h_kv, d_qk]")
    _check_array("indices", indices, 3, "[s_q, h_kv, topk]")
    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, kv_d = kv.shape
    idx_s_q, idx_h_kv, topk = indices.shape

    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q must have a floating dtype (bfloat16 for the kernel), got {q.dtype}")
    if kv.dtype != q.dtype:
        raise TypeError(f"kv must have the dtype of q ({q.dtype}), got {kv.dtype}")
    if indices.dtype != np.int32:
        raise TypeError(f"indices must have dtype int32, got {indices.dtype}")
    if h_kv != 1:
        raise ValueError(f"kv must have h_kv = 1 head (MLA shares one latent kv), got h_kv={h_kv}")
    if kv_d != d_qk:
        raise ValueError(
            f"kv feature size must equal q's d_qk={d_qk}, got kv.shape={tuple(kv.shape)}"
        )
    if idx_s_q != s_q:
        raise ValueError(
            f"indices must have s_q={s_q} rows like q, got indices.shape={tuple(indices.shape)}"
        )
    if idx_h_kv != h_kv:
        raise ValueError(
            f"indices must have h_kv={h_kv} heads like kv, got indices.shape={tuple(indices.shape)}"
        )
    if topk < 1:
        raise ValueError(f"indices must list topk >= 1 entries per row, got topk={topk}")
    if s_kv < 1:
        raise ValueError(f"kv must have s_kv >= 1 rows, got kv.shape={tuple(kv.shape)}")
    d_v = int(_static_number("d_v", d_v, numbers.Integral, "integer"))
    if not 1 <= d_v <= d_qk:
        raise ValueError(f"d_v must satisfy 1 <= d_v <= d_qk={d_qk}, got d_v={d_v}")
    sm_scale = float(_static_number("sm_scale", sm_scale, numbers.Real, "real number"))
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a finite positive float, got {sm_scale}")
    if not isinstance(return_scores, bool):
        raise TypeError(f"return_scores must be a bool, got {type(return_scores).__name__}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    return ProblemShape(s_q=s_q, h_q=h_q, d_qk=d_qk, s_kv=s_kv, h_kv=h_kv, topk=topk, d_v=d_v)
