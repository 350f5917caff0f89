"""Paged attention on the Mosaic-GPU (sm90) forward: the block-sparse kernel with paged K/V.

A paged call is the contiguous forward (`pallas_kernels.mosaic.attention_fwd_sm90`) with
two differences, both outside its kernel body's attention code: its producer TMA-loads
each K/V tile through the sequence's page table (``page_table`` there), and its mask is
`PagedKeys`, the call's visibility rules (`pallas_kernels.paged.PagedScores`:
per-sequence ``kv_lens``, bottom-right causal, windows) plus the keys of page ids
outside the cache. The kernel computes the walks itself, per CTA in closed form from
its sequence's length (`pallas_kernels.paged.PagedWalk`: no BlockMask construction,
which costs a dozen small kernels around a decoding step): each q-block walks the
kv-blocks its queries may see, the FULL ones (the kernel's mask-free loop) first, and
split-KV comes with the forward. Grouped query
heads are packed into rows (`omni_jax.query_groups`), heads first (the forward's
``heads_first``), when the group divides the kernel's 128-row q tile, else each head is
its own CTA row.

Each XLA kernel around a decoding step's 0.1 ms costs 2-4 us and a launch gap, so the
call computes one line per sequence before the kernel, in one reduction
(`pallas_kernels.paged.walk_seeds`: its length and whether it uses a page id outside
the cache); the kernel's producer computes the mask's one leaf (each key's sequence
length) from the page table. K, V, the page table (whole 128-id lines, or one
shorter row) and, for one query per sequence, the packed queries reach the kernel as
views (its producer clamps the ids; a TMA box clips query rows fewer than 8), and the
output comes back as a view too (with split-KV, combined elementwise). A test pins
this (`test_decoding_step_computes_little_around_the_kernel`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax import query_groups
from omni_jax.backends.mosaic import interpret_params
from omni_jax.masks import BlockGrid, MaskMod
from omni_jax.masks.mask_mods import RepeatedQueries
from pallas_kernels import kv_splits, runtime
from pallas_kernels.block_sparse import MaskLayout
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd
from pallas_kernels.mosaic.attention_sm90_common import SMEM_LIMIT
from pallas_kernels.paged import PagedScores, PagedWalk

Array = Any
_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# The forward's block_kv is 64 or 128: page sizes that tile it one way or the other.
PAGE_SIZES = (16, 32, 64, 128, 256)
_MAX_BLOCK_KV = 256
# Waves of CTAs that a batch's kv splits fill (`kv_splits.num_splits`): its sequences'
# lengths are known only on the device, and one wave of CTAs waits for its longest
# sequence where two waves of shorter shares even out (H100, 8 x 32768 ragged: 0.203
# ms against 0.239 for one wave; uniform within 1%; four waves cost uniform batches
# 3%: benchmarks/RESULTS.md, 2026-12-07 13:35).
RAGGED_WAVES = 2


@jax.tree_util.register_pytree_node_class
class PagedKeys(MaskMod):
    """Query ``t`` of sequence ``b`` sees key ``j`` when ``scores.visible`` says so for
    position ``kv_lens[b] - q_len + t``, with ``key_lens[b, j]``: ``kv_lens[b]`` when
    the key's page is one of the cache, -1 (no key visible) when it is not (its K/V rows
    are then never read by the kernel either).

    One kv leaf carries both the length and the page check. A paged call builds no
    array for it: the forward's producer computes its values per tile from the page
    table and ``kv_lens`` (`attention_forward`'s kv_lens); the call flattens a
    placeholder for the mask's structure (`_kernel_mask`)."""

    def __init__(self, key_lens: Array, scores: PagedScores):
        self.key_lens = key_lens
        self.scores = scores

    def tree_flatten(self):
        return (self.key_lens,), self.scores

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, aux)

    def predicate(self, q_idx, kv_idx):
        q_pos = self.scores.query_position(self.key_lens, q_idx)
        return self.scores.visible(q_pos, kv_idx, self.key_lens)

    def classify(self, grid: BlockGrid):
        raise NotImplementedError("PagedKeys is evaluated in the paged kernel only, whose "
                                  "walks come from PagedWalk, never from a BlockMask")

    def leaf_kinds(self):
        return ("kv",)


@dataclasses.dataclass(frozen=True)
class _Call:
    """What decides the kernel's config for a call."""

    head_dim: int
    head_dim_v: int
    dtype: Any
    is_causal: bool


def _config(call: _Call, programs: int, kv_len: int,
            overrides: Mapping[str, int] | None = None, *, batch: int = 1
            ) -> fwd.ForwardConfig:
    """The forward's tuned config, with kv splits when ``programs`` CTAs walking up to
    ``kv_len`` keys each leave SMs idle (`RAGGED_WAVES` waves of them for a ``batch`` of
    several sequences); ``overrides`` (`ForwardConfig` fields, for a benchmark's A/B of
    configs) replace fields of it, the kv splits chosen by their block_kv."""
    config = fwd.forward_config(max(call.head_dim, call.head_dim_v), call.dtype,
                                call.is_causal)
    overrides = dict(overrides or {})
    if "block_kv" in overrides:
        config = dataclasses.replace(config, block_kv=overrides["block_kv"])
    splits = kv_splits.num_splits(programs, kv_len / config.block_kv, runtime.num_sms(),
                                  waves=RAGGED_WAVES if batch > 1 else 1)
    splits = overrides.get("kv_splits", splits)
    if splits > 1:
        config = dataclasses.replace(config, kv_splits=splits, q_blocks_per_cta=1)
    return dataclasses.replace(config, **{name: type(getattr(config, name))(value)
                                          for name, value in overrides.items()})


def _kernel_mask(page_table: Array, scores: PagedScores, *, group: int, rows: int,
                 page_size: int, block_kv: int) -> tuple[MaskLayout, PagedWalk]:
    """The kernel's mask of a paged call: its layout and the walks' rule (`PagedWalk`).
    The kernel computes the walks and the mask's one leaf from the sequences' lengths
    and the page table, so no mask array is built."""
    kv_len = page_table.shape[1] * page_size
    walk = PagedWalk(scores, group=group, rows=rows, block_q=fwd.BLOCK_Q, block_kv=block_kv,
                     table_tokens=kv_len)
    mask_mod = PagedKeys(np.zeros((1, 1), np.int32), scores)  # its structure only
    if group > 1:
        mask_mod = RepeatedQueries.of(mask_mod, group)
    layout = MaskLayout(q_len=rows, kv_len=kv_len, block_q=fwd.BLOCK_Q, block_kv=block_kv,
                        num_q_blocks=-(-rows // fwd.BLOCK_Q),
                        num_kv_blocks=-(-kv_len // block_kv),
                        mask_mod_treedef=jax.tree.structure(mask_mod),
                        leaf_kinds=mask_mod.leaf_kinds(), contiguous_full=False)
    return layout, walk


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
                           kv_lens: Array, scores: PagedScores,
                           overrides: Mapping[str, int] | None = None) -> tuple[Array, Array]:
    """Sink-free (out ``[B, Sq, Hq, Dv]``, lse ``[B, Hq, Sq]`` float32) of a paged call;
    ``overrides``: `ForwardConfig` fields forced over the chosen config (benchmarks)."""
    batch, q_len, num_heads, head_dim = q.shape
    page_size, num_kv_heads, head_dim_v = v_pages.shape[1:]
    pages_per_seq = page_table.shape[1]
    group = num_heads // num_kv_heads
    if fwd.BLOCK_Q % group:  # packed rows need whole groups in a q tile
        group = 1
    call = _Call(head_dim, head_dim_v, np.dtype(q.dtype), scores.is_causal)
    rows = q_len * group
    programs = batch * (num_heads // group) * -(-rows // fwd.BLOCK_Q)
    config = _config(call, programs, pages_per_seq * page_size, overrides, batch=batch)
    layout, walk = _kernel_mask(page_table, scores, group=group, rows=rows,
                                page_size=page_size, block_kv=config.block_kv)
    # Packed rows go heads first: for a decoding step a view of q, and the output one of
    # the kernel's (no transposing kernel on either side).
    packed = group > 1
    if packed:
        q = query_groups.pack_queries(q, group, heads_first=True)
    out, lse = fwd.attention_forward(
        q, k_pages, v_pages, None, layout, scale=scores.scale, softcap=scores.softcap,
        score_mod=None, has_partial=False, config=config,
        interpret_params=interpret_params(), page_table=page_table, heads_first=packed,
        kv_lens=kv_lens, paged_walk=walk)
    return query_groups.unpack(out, lse, group, heads_first=True) if packed else (out, lse)
