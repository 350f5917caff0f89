"""Paged-attention forward, Pallas with Triton lowering (sm80+): decoding and chunked prefill.

One program per (row tile, kv head, sequence x kv split). The queries of one kv head's
group come packed into rows (row ``t * group + g`` is query t of head
``kv_head * group + g``), so a decoding step fills ``group`` rows of a tile and reads
each K/V tile once for the whole group. A K/V tile of ``tile_kv`` tokens is gathered
row by row: each token's page id comes from the page table (ids outside the cache
clamped, their keys masked) and its row from the flattened ``[pages * page_size]``
cache, so a tile spans several small pages (16) or part of a large one. A program
walks only the tiles its queries may see (`PagedScores.key_range`); with
``kv_splits`` > 1 that walk is cut into even shares, one program each, combined by lse
(`pallas_kernels.kv_splits`). Sinks join after the combine (the API does it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, kv_splits, runtime
from pallas_kernels.paged import PagedScores, page_rows
from pallas_kernels.triton import tiles

Array = Any
_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    """Tile sizes and launch parameters of the paged kernel.

    ``block_rows``: packed query rows per program at most (fewer when the call has
    fewer); ``block_kv``: tokens per K/V tile, gathered from as many pages as it spans.
    """

    block_rows: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Programs per row tile, each walking an even share of its K/V tiles; None: enough
    # to fill ``programs_per_sm`` programs on each of the GPU's SMs
    # (`pallas_kernels.kv_splits.num_splits`). A program holds little in flight (two
    # K/V stages of 64 tokens, 64 KB of shared memory: three fit an H100/H200 SM), so
    # one per SM leaves bandwidth unused: H200, 2026-11-28 05:23-06:38, K/V read at
    # 1.7-2.1 TB/s with 128 programs (8 x 8192, 1 x 131072) and 2.7-2.9 TB/s with
    # 512-1024 (64 x 4096, 128 x 2048).
    kv_splits: int | None = None
    programs_per_sm: int = 3

    def __post_init__(self):
        for name in ("block_rows", "block_kv"):
            size = getattr(self, name)
            if size < tiles.MIN_TILE or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= {tiles.MIN_TILE}; "
                                 f"got {size}")
        if self.kv_splits is not None and self.kv_splits < 1:
            raise ValueError(f"kv_splits must be None or >= 1; got {self.kv_splits}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1; got {self.programs_per_sm}")


def unsupported_reason(dtype: Any, head_dim: int, head_dim_v: int) -> str | None:
    """Why the kernel cannot serve these operands, or None."""
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not bfloat16, float16 or float32"
    for name, dim in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        # Rows are gathered whole: no column mask for head dims between powers of two.
        if dim != tiles.padded_head_dim(dim) or dim > tiles.MAX_HEAD_DIM:
            return (f"{name}={dim} is not a power of two in [{tiles.MIN_TILE}, "
                    f"{tiles.MAX_HEAD_DIM}]")
    return None


def _kernel(q_ref, k_ref, v_ref, table_ref, lens_ref, out_ref, lse_ref, *,
            scores: PagedScores, group: int, tile_rows: int, tile_kv: int, page_size: int,
            splits: int, ptx: bool) -> None:
    num_pages = k_ref.shape[0] // page_size
    pages_per_seq = table_ref.shape[1]
    rows = q_ref.shape[1]
    r0 = pl.program_id(0) * tile_rows
    h = pl.program_id(1)
    b, split = lax.div(pl.program_id(2), splits), lax.rem(pl.program_id(2), splits)
    kv_len = lens_ref[b]
    q = tiles.load_rows(q_ref, b, r0, tile_rows, h, padded_seq=pl.cdiv(rows, tile_rows)
                        * tile_rows)
    q_pos = scores.query_position(kv_len, tiles.positions(r0, tile_rows, 0) // group)
    last_row = jnp.minimum(r0 + tile_rows, rows) - 1
    lo, hi = scores.key_range(kv_len, r0 // group, last_row // group,
                              pages_per_seq * page_size)
    first = lo // tile_kv
    begin, length, _ = kv_splits.share(pl.cdiv(hi, tile_kv) - first, jnp.int32(0), split,
                                       splits)

    def body(step, carry):
        acc, row_max, row_sum = carry
        k_pos = tiles.positions((first + step) * tile_kv, tile_kv, 1)[0]
        cache_rows, real = page_rows(k_pos, page_size=page_size, num_pages=num_pages,
                                     pages_per_seq=pages_per_seq,
                                     load_ids=lambda slots: table_ref[b, slots])
        k = k_ref[cache_rows, h, :]
        s = scores.scores(tiles.dot_nt(q, k)) * tiles.LOG2E
        seen = real[None, :] & scores.visible(q_pos, k_pos[None, :], kv_len)
        s = jnp.where(seen, s, -jnp.inf)
        new_max = jnp.maximum(row_max, s.max(axis=1))
        # Rows with nothing visible yet keep max -inf: shift by 0 so exp2 gives 0, not NaN.
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        p = tiles.exp2(s, shift, scale=1.0, ptx=ptx)
        alpha = tiles.exp2(row_max, shift, scale=1.0, ptx=ptx)
        v = v_ref[cache_rows, h, :]
        acc = acc * alpha[:, None] + tiles.dot_nn(p.astype(v.dtype), v)
        return acc, new_max, row_sum * alpha + p.sum(axis=1)

    init = (jnp.zeros((tile_rows, v_ref.shape[2]), jnp.float32),
            jnp.full((tile_rows,), -jnp.inf, jnp.float32), jnp.zeros((tile_rows,), jnp.float32))
    acc, row_max, row_sum = lax.fori_loop(begin, begin + length, body, init)
    seen = row_sum > 0
    safe_sum = jnp.where(seen, row_sum, 1.0)
    lse2 = jnp.where(seen, row_max + jnp.log2(safe_sum), -jnp.inf)
    tiles.store_rows(out_ref, (acc / safe_sum[:, None]).astype(out_ref.dtype), r0, length=rows)
    tiles.store_rows(lse_ref, lse2 * tiles.LN2, r0, length=rows)


def choose_config(batch: int, rows: int, num_kv_heads: int, pages_per_seq: int,
                  page_size: int, base: PagedConfig | None = None) -> PagedConfig:
    """``base`` (default `PagedConfig()`) with its kv splits chosen, unless it has them:
    as many as fill ``programs_per_sm`` programs on every SM in one wave."""
    config = PagedConfig() if base is None else base
    if config.kv_splits is not None:
        return config
    tile_rows = min(config.block_rows, max(tiles.MIN_TILE, pl.next_power_of_2(rows)))
    programs = batch * num_kv_heads * pl.cdiv(rows, tile_rows)
    walk = pages_per_seq * page_size / config.block_kv
    return dataclasses.replace(config, kv_splits=kv_splits.num_splits(
        programs, walk, runtime.num_sms() * config.programs_per_sm))


def paged_attention(q: Array, k_pages: Array, v_pages: Array, page_table: Array,
                    kv_lens: Array, *, scores: PagedScores, group: int, interpret: bool,
                    config: PagedConfig | None = None) -> tuple[Array, Array]:
    """(out ``[B, R, Hkv, Dv]``, lse ``[B, Hkv, R]`` float32) of packed queries
    ``q [B, R = q_len * group, Hkv, D]`` over the paged cache, without sinks."""
    batch, rows, num_kv_heads, _ = q.shape
    num_pages, page_size, _, head_dim_v = v_pages.shape
    if config is None:
        config = choose_config(batch, rows, num_kv_heads, page_table.shape[1], page_size)
    splits = config.kv_splits or 1
    tile_rows = min(config.block_rows, max(tiles.MIN_TILE, pl.next_power_of_2(rows)))
    num_row_tiles = pl.cdiv(rows, tile_rows)
    kernel = functools.partial(_kernel, scores=scores, group=group, tile_rows=tile_rows,
                               tile_kv=config.block_kv, page_size=page_size, splits=splits,
                               ptx=tiles.inline_ptx(interpret))
    operands = (q, k_pages.reshape(num_pages * page_size, num_kv_heads, -1),
                v_pages.reshape(num_pages * page_size, num_kv_heads, head_dim_v),
                page_table, kv_lens)
    axes = compat.varying_axes(operands)  # Inside a jax.shard_map.
    # Outputs carry a leading axis of splits; the shares of one row tile are neighbours
    # on the last grid axis. The last row tile's block overhangs rows past R.
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_row_tiles, num_kv_heads, batch * splits),
        in_specs=tiles.whole_array_specs(operands),
        out_specs=[
            pl.BlockSpec((None, None, tile_rows, None, head_dim_v),
                         lambda r, h, bs: (lax.rem(bs, splits), lax.div(bs, splits), r, h, 0)),
            pl.BlockSpec((None, None, None, tile_rows),
                         lambda r, h, bs: (lax.rem(bs, splits), lax.div(bs, splits), h, r)),
        ],
        out_shape=[compat.result_type((splits, batch, rows, num_kv_heads, head_dim_v),
                                      q.dtype if splits == 1 else jnp.float32, axes),
                   compat.result_type((splits, batch, num_kv_heads, rows), jnp.float32, axes)],
        compiler_params=compat.triton_compiler_params(num_warps=config.num_warps,
                                                      num_stages=config.num_stages),
        interpret=interpret,
        name="omni_paged_attention",
    )(*operands)
    return kv_splits.combine(out, lse, q.dtype)
