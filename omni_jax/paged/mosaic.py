"""Paged attention on the Mosaic-GPU (sm90) forward: the block-sparse kernel with paged K/V.

A paged call is the contiguous forward (`pallas_kernels.mosaic.attention_fwd_sm90`) with
two differences, both outside its kernel body's attention code: its producer TMA-loads
each K/V tile through the sequence's page table (``page_table`` there), and its mask is
`PagedKeys`, a structured BlockMask of the call's visibility rules
(`pallas_kernels.paged.PagedScores`: per-sequence ``kv_lens``, bottom-right causal,
windows) plus the keys of page ids outside the cache. Its walk skips the kv-blocks no
query of a q-block sees, FULL tiles take the kernel's mask-free loop, and split-KV
comes with the forward. Grouped query heads are packed into rows (`omni_jax.query_groups`)
when the group divides the kernel's 128-row q tile, else each head is its own CTA row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax import query_groups
from omni_jax.backends.mosaic import interpret_params
from omni_jax.masks import BlockGrid, MaskMod, create_block_mask
from pallas_kernels import kv_splits, runtime
from pallas_kernels.block_sparse import kernel_mask
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd
from pallas_kernels.mosaic.attention_sm90_common import SMEM_LIMIT
from pallas_kernels.paged import PagedScores

Array = Any
_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# The forward's block_kv is 64 or 128: page sizes that tile it one way or the other.
PAGE_SIZES = (16, 32, 64, 128, 256)
_MAX_BLOCK_KV = 256


@jax.tree_util.register_pytree_node_class
class PagedKeys(MaskMod):
    """Query ``t`` of sequence ``b`` sees key ``j`` when ``scores.visible`` says so for
    position ``kv_lens[b] - q_len + t`` and the key's page is one of the cache
    (``real[b, j]`` = 1; its K/V rows are then never read by the kernel either)."""

    def __init__(self, kv_lens: Array, real: Array, scores: PagedScores):
        self.kv_lens = kv_lens
        self.real = real
        self.scores = scores

    def tree_flatten(self):
        return (self.kv_lens, self.real), self.scores

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, aux)

    def predicate(self, q_idx, kv_idx):
        q_pos = self.scores.query_position(self.kv_lens, q_idx)
        return (self.real != 0) & self.scores.visible(q_pos, kv_idx, self.kv_lens)

    def classify(self, grid: BlockGrid):
        q_start, q_end = grid.q_bounds()
        kv_start, kv_end = grid.kv_bounds()
        kv_len = self.kv_lens[:, None, None, None]
        lo, hi = self.scores.key_range(kv_len, q_start, q_end)
        blocks = -(-grid.kv_len // grid.block_kv)
        real = jnp.pad(self.real, ((0, 0), (0, blocks * grid.block_kv - grid.kv_len)),
                       constant_values=1)  # the ragged tail: kv_len hides it
        real = real.reshape(real.shape[0], blocks, grid.block_kv)
        all_real = real.min(axis=-1)[:, None, None, :] != 0
        any_real = real.max(axis=-1)[:, None, None, :] != 0
        empty = (kv_end < lo) | (kv_start >= hi) | ~any_real
        full = all_real & (kv_end < kv_len)
        first_pos = self.scores.query_position(kv_len, q_start)
        last_pos = self.scores.query_position(kv_len, q_end)
        if self.scores.is_causal:
            full &= kv_end <= first_pos
        if self.scores.window is not None:
            left, right = self.scores.window
            full &= kv_start >= last_pos - left
            if not self.scores.is_causal:
                full &= kv_end <= first_pos + right
        return full, empty

    def leaf_kinds(self):
        return ("batch", "kv")


@dataclasses.dataclass(frozen=True)
class _Call:
    """What decides the kernel's config for a call."""

    head_dim: int
    head_dim_v: int
    dtype: Any
    is_causal: bool


def _config(call: _Call, programs: int, kv_len: int) -> fwd.ForwardConfig:
    """The forward's tuned config, with kv splits when ``programs`` CTAs walking up to
    ``kv_len`` keys each leave SMs idle."""
    config = fwd.forward_config(max(call.head_dim, call.head_dim_v), call.dtype,
                                call.is_causal)
    splits = kv_splits.num_splits(programs, kv_len / config.block_kv, runtime.num_sms())
    if splits > 1:
        config = dataclasses.replace(config, kv_splits=splits, q_blocks_per_cta=1)
    return config


def unsupported_reason(dtype: Any, head_dim: int, head_dim_v: int, page_size: int,
                       pages_per_seq: int) -> str | None:
    """Why the Mosaic paged kernel cannot serve these operands here, or None."""
    if not runtime.can_run_mosaic_hopper():
        return ("the Mosaic-GPU kernels need an sm90 (Hopper) GPU, or "
                f"{runtime.INTERPRET_ENV_VAR}=1 for the interpreter")
    if np.dtype(dtype) not in _DTYPES:
        return f"dtype {np.dtype(dtype).name} (the kernel takes bfloat16 or float16)"
    if fwd.padded_head_dims(head_dim, head_dim_v) != (head_dim, head_dim_v):
        return (f"head_dim={head_dim}, head_dim_v={head_dim_v}: the kernel reads the cache "
                f"unpadded, so it takes head dims {fwd.SUPPORTED_HEAD_DIMS} (equal above 128)")
    if page_size not in PAGE_SIZES:
        return f"page_size={page_size} (the kernel tiles pages of {PAGE_SIZES} tokens)"
    # The kernel's table also lists the pages of the last kv-block past the table's end.
    table_pages = -(-pages_per_seq * page_size // _MAX_BLOCK_KV) * _MAX_BLOCK_KV // page_size
    for causal in (False, True):
        config = _config(_Call(head_dim, head_dim_v, np.dtype(dtype), causal), 1, 0)
        smem = fwd.smem_bytes(config, head_dim, head_dim_v, np.dtype(dtype).itemsize,
                              False, pages_per_seq=table_pages)
        if smem > SMEM_LIMIT:
            return (f"a page table row of {pages_per_seq} pages needs {smem} bytes of shared "
                    f"memory with the K/V ring, over the {SMEM_LIMIT} the kernel may use")
    return None


def paged_attention_mosaic(q: Array, k_pages: Array, v_pages: Array, page_table: Array,
                           kv_lens: Array, scores: PagedScores) -> tuple[Array, Array]:
    """Sink-free (out ``[B, Sq, Hq, Dv]``, lse ``[B, Hq, Sq]`` float32) of a paged call."""
    batch, q_len, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, head_dim_v = v_pages.shape
    pages_per_seq = page_table.shape[1]
    group = num_heads // num_kv_heads
    if fwd.BLOCK_Q % group:  # repeat_queries needs whole groups in a q tile
        group = 1
    call = _Call(head_dim, head_dim_v, np.dtype(q.dtype), scores.is_causal)
    rows = q_len * group
    programs = batch * (num_heads // group) * -(-rows // fwd.BLOCK_Q)
    kv_len = pages_per_seq * page_size
    config = _config(call, programs, kv_len)
    # 1 where a token's page is one of the cache; the kernel clamps the others' reads.
    real = (page_table >= 0) & (page_table < num_pages)
    real = jnp.repeat(real.astype(jnp.int32), page_size, axis=1)
    mask = create_block_mask(PagedKeys(kv_lens, real, scores), batch, None, q_len, kv_len,
                             block_size=(config.block_q, config.block_kv))
    if group > 1:
        q, mask = query_groups.pack_queries(q, group), mask.repeat_queries(group)
    kmask, layout = kernel_mask(mask)
    out, lse = fwd.attention_forward(
        q, k_pages, v_pages, kmask, layout, scale=scores.scale, softcap=scores.softcap,
        score_mod=None, has_partial=False, config=config,
        interpret_params=interpret_params(), page_table=page_table)
    return query_groups.unpack(out, lse, group) if group > 1 else (out, lse)
