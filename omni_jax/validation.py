"""Trace-time checks of `omni_jax.attention`'s arguments, with errors that say what is wrong.

Every message names the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from omni_jax.masks import BlockMask
from omni_jax.masks.mask_mods import segment_ids_as_int32

Array = Any

IMPLEMENTATIONS = (None, "xla", "triton", "mosaic")
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def _shape_of(name: str, x: Array) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


# Heads are axis 2: a [batch, heads, seq, dim] array shows its sequence length there.
_LAYOUT_HINT = (" (the layout is [batch, seq_len, num_heads, head_dim]; transpose "
                "[batch, num_heads, seq_len, head_dim] arrays with .swapaxes(1, 2))")


def check_qkv(query: Array, key: Array, value: Array) -> None:
    """Ranks, matching sizes, head grouping and dtypes of query / key / value."""
    layout = "[batch, seq_len, num_heads, head_dim]"
    for name, x in (("query", query), ("key", key), ("value", value)):
        shape = _shape_of(name, x)
        if len(shape) != 4:
            raise ValueError(f"{name} must have rank 4 {layout}, got shape {shape}")
        if not shape[2] or not shape[3]:  # batch and sequence lengths may be 0
            raise ValueError(f"{name} needs at least one head and a head_dim of at least 1, "
                             f"got shape {shape}")
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
            raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, "
                            f"got {x.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    (b, _, hq, d), (bk, skv, hk, dk), (bv, sv, hv, _) = query.shape, key.shape, value.shape
    if not b == bk == bv:
        raise ValueError(f"query, key and value must have one batch size, got {b}, {bk}, {bv}")
    if skv != sv:
        raise ValueError(f"key and value must have one sequence length, got key {skv} and "
                         f"value {sv}")
    if hk != hv:
        raise ValueError(f"key and value must have one number of heads, got key {hk} and "
                         f"value {hv}{_LAYOUT_HINT}")
    if hq % hk:
        raise ValueError(f"query heads must be a multiple of key/value heads (GQA), got query "
                         f"{hq} heads and key/value {hk} heads{_LAYOUT_HINT}")
    if dk != d:
        raise ValueError(f"key head_dim must equal query head_dim {d}, got {dk}")


def check_window(local_window_size: Any) -> tuple[int, int] | None:
    """``local_window_size`` as (left, right), or None."""
    if local_window_size is None:
        return None
    window = local_window_size
    if isinstance(window, numbers.Integral) and not isinstance(window, bool):
        window = (window, window)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 0
                   for w in window)):
        raise ValueError(f"local_window_size must be None, an int or a pair (left, right) of "
                         f"non-negative ints, got {local_window_size!r}")
    return int(window[0]), int(window[1])


def check_segment_ids(q_segment_ids: Array | None, kv_segment_ids: Array | None, *,
                      batch: int, q_len: int, kv_len: int) -> tuple[Array, Array] | None:
    """Segment ids as int32 ``[batch, q_len]`` and ``[batch, kv_len]``, or None."""
    if q_segment_ids is None and kv_segment_ids is None:
        return None
    if kv_segment_ids is None or q_segment_ids is None:
        if q_len != kv_len:
            given = "q_segment_ids" if kv_segment_ids is None else "kv_segment_ids"
            raise ValueError(f"only {given} was given, but q_len {q_len} != kv_len {kv_len}: "
                             f"pass both q_segment_ids and kv_segment_ids")
        q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
        kv_segment_ids = q_segment_ids
    for name, ids, length in (("q_segment_ids", q_segment_ids, q_len),
                              ("kv_segment_ids", kv_segment_ids, kv_len)):
        shape = _shape_of(name, ids)
        if shape != (batch, length):
            raise ValueError(f"{name} must have shape [batch, seq_len] = {(batch, length)}, "
                             f"got {shape}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {ids.dtype}")
    return segment_ids_as_int32(jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids))


def check_block_mask(mask: Any, *, batch: int, num_q_heads: int, q_len: int,
                     kv_len: int) -> None:
    if mask is None:
        return
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be an omni_jax.BlockMask (see create_block_mask) or None, "
                        f"got {type(mask).__name__}")
    extra = mask.kv_num_blocks.shape[:-3]
    if extra:
        raise ValueError(f"mask has leading axes {extra} besides (batch, heads): it was built "
                         f"under jax.vmap; pass it to attention under the same vmap, or index "
                         f"one mask out of it")
    mask_batch, mask_heads, mask_q, mask_kv = mask.shape
    if (mask_q, mask_kv) != (q_len, kv_len):
        raise ValueError(f"mask was built for (q_len, kv_len) = {(mask_q, mask_kv)}, but the "
                         f"inputs have {(q_len, kv_len)}")
    if mask_batch not in (1, batch):
        raise ValueError(f"mask batch size must be 1 or {batch}, got {mask_batch}")
    if mask_heads not in (1, num_q_heads):
        raise ValueError(f"mask heads must be 1 or the number of query heads {num_q_heads}, "
                         f"got {mask_heads}")


def check_scalar(name: str, value: Any, *, positive: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python float (static), got {type(value).__name__}")
    if not math.isfinite(value) or positive and not value > 0:
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} number, "
                         f"got {value}")
    return float(value)


def check_sinks(sinks: Array | None, num_q_heads: int) -> Array | None:
    if sinks is None:
        return None
    shape = _shape_of("sinks", sinks)
    if shape != (num_q_heads,):
        raise ValueError(f"sinks must have shape [num_q_heads] = ({num_q_heads},), got {shape}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be a float array, got dtype {sinks.dtype}")
    return sinks


def check_implementation(implementation: Any) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool (static: it selects the computation), "
                        f"got {type(value).__name__}")
    return bool(value)
