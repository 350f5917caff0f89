"""Trace-time checks of the paged-cache arguments, with errors that say what is wrong.

Shapes and dtypes are always checked; lengths and page ids only when they are
concrete (outside ``jit``), where a bad value would otherwise read or write the wrong
tokens silently (under ``jit`` the kernels clamp and mask instead).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.validation import _shape_of

Array = Any
_FLOAT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32,
                                               jnp.float64))
PAGES_LAYOUT = "[num_pages, page_size, num_kv_heads, head_dim]"


def _check_rank(name: str, x: Array, layout: str) -> tuple[int, ...]:
    shape = _shape_of(name, x)
    if len(shape) != layout.count(",") + 1:
        raise ValueError(f"{name} must have rank {layout.count(',') + 1} {layout}, "
                         f"got shape {shape}")
    return shape


def _check_float(name: str, x: Array) -> None:
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {x.dtype}")


def _check_int(name: str, x: Array) -> Array:
    """``x`` as int32; wider integers must fit (concrete values are checked, traced ones
    saturate: an id or length past int32 stays out of range rather than wrapping onto a
    valid one)."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int32 array, got dtype {x.dtype}")
    int32, own = np.iinfo(np.int32), np.iinfo(x.dtype)
    if own.max > int32.max:
        values = _concrete(x)
        if values is None:
            x = jnp.clip(x, max(own.min, int32.min), int32.max)
        elif (outside := (values < int32.min) | (values > int32.max)).any():
            index = tuple(int(i) for i in np.argwhere(outside)[0])
            raise ValueError(f"{name}[{', '.join(map(str, index))}] = {values[index]} does not "
                             f"fit int32 [{int32.min}, {int32.max}]")
    return jnp.asarray(x, jnp.int32)


def check_cache(k_pages: Array, v_pages: Array, page_table: Array,
                kv_lens: Array) -> tuple[Array, Array]:
    """The pages, the table and the lengths agree; returns (page_table, kv_lens) as int32."""
    k_shape = _check_rank("k_pages", k_pages, PAGES_LAYOUT)
    v_shape = _check_rank("v_pages", v_pages, PAGES_LAYOUT.replace("head_dim", "head_dim_v"))
    _check_float("k_pages", k_pages)
    if v_pages.dtype != k_pages.dtype:
        raise TypeError(f"v_pages must have k_pages' dtype {k_pages.dtype}, got {v_pages.dtype}")
    if k_shape[:3] != v_shape[:3]:
        raise ValueError(f"k_pages and v_pages must agree on [num_pages, page_size, "
                         f"num_kv_heads], got {k_shape[:3]} and {v_shape[:3]}")
    if not k_shape[1] or not k_shape[2] or not k_shape[3] or not v_shape[3]:
        raise ValueError(f"pages need a page_size, heads and head dims of at least 1, got "
                         f"k_pages {k_shape} and v_pages {v_shape}")
    table_shape = _check_rank("page_table", page_table, "[batch, pages_per_seq]")
    lens_shape = _check_rank("kv_lens", kv_lens, "[batch]")
    if lens_shape != table_shape[:1]:
        raise ValueError(f"kv_lens must have shape [batch] = ({table_shape[0]},) as "
                         f"page_table's rows, got {lens_shape}")
    return _check_int("page_table", page_table), _check_int("kv_lens", kv_lens)


def _concrete(x: Array) -> np.ndarray | None:
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def check_lengths(page_table: Array, kv_lens: Array, *, num_pages: int, page_size: int,
                  appended: int = 0) -> None:
    """Concrete ``kv_lens`` (plus ``appended`` new tokens) fit their tables, whose pages in
    use are ids of the cache."""
    lens, table = _concrete(kv_lens), _concrete(page_table)
    if lens is None:
        return
    capacity = page_table.shape[1] * page_size
    ends = lens + appended
    bad = np.flatnonzero((lens < 0) | (ends > capacity))
    if bad.size:
        b = int(bad[0])
        what = f"kv_lens[{b}] = {lens[b]}" + (f" plus {appended} new tokens" if appended else "")
        raise ValueError(f"{what} must lie in [0, pages_per_seq * page_size] = [0, {capacity}] "
                         f"(page_table has {capacity // page_size} pages of {page_size} tokens)")
    if table is None:
        return
    used = np.arange(table.shape[1])[None, :] * page_size < ends[:, None]
    bad_ids = used & ((table < 0) | (table >= num_pages))
    if bad_ids.any():
        b, slot = (int(i) for i in np.argwhere(bad_ids)[0])
        raise ValueError(f"page_table[{b}, {slot}] = {table[b, slot]} holds tokens of sequence "
                         f"{b} but is not a page of the cache [0, {num_pages})")


def check_query(q: Array, k_pages: Array, v_pages: Array, batch: int) -> None:
    """q ``[batch, q_len, heads, head_dim]`` matches the cache (dtype, batch, GQA heads)."""
    shape = _check_rank("q", q, "[batch, q_len, num_heads, head_dim]")
    _check_float("q", q)
    if q.dtype != k_pages.dtype:
        raise TypeError(f"q must have the pages' dtype {k_pages.dtype}, got {q.dtype}")
    if shape[0] != batch:
        raise ValueError(f"q must have page_table's batch {batch}, got shape {shape}")
    num_kv_heads, head_dim = k_pages.shape[2:]
    if not shape[2] or shape[2] % num_kv_heads:
        raise ValueError(f"q heads must be a positive multiple of the pages' num_kv_heads "
                         f"{num_kv_heads} (GQA), got {shape[2]}")
    if shape[3] != head_dim:
        raise ValueError(f"q head_dim must equal k_pages' head_dim {head_dim}, got {shape[3]}")


def check_new_tokens(k_new: Array, v_new: Array, k_pages: Array, v_pages: Array,
                     batch: int) -> None:
    """k_new ``[batch, n, kv_heads, head_dim]`` and v_new fit the pages."""
    for name, new, pages in (("k_new", k_new, k_pages), ("v_new", v_new, v_pages)):
        shape = _check_rank(name, new, "[batch, num_new, num_kv_heads, head_dim]")
        expected = (batch, k_new.shape[1], *pages.shape[2:])
        if shape != expected:
            raise ValueError(f"{name} must have shape [batch, num_new, num_kv_heads, head_dim] "
                             f"= {expected}, got {shape}")
        if new.dtype != pages.dtype:
            raise TypeError(f"{name} must have the pages' dtype {pages.dtype}, got {new.dtype}")
