"""Grouped-query attention with few queries (decoding), each group's heads packed into rows.

Below a kernel tile of queries, GQA leaves most rows of every q tile empty, and each
query head of a group reads the group's K/V again. Packed, ``q [B, Sq, Hkv * G, D]``
becomes ``[B, Sq * G, Hkv, D]`` (row ``t * G + g`` is query t of head ``kv_head * G + g``):
one query head per kv head, G rows per query, so a decode step fills G rows of one tile
per kv head and reads its K/V once. The mask is the call's with every query position
repeated G times (`BlockMask.repeat_queries`); sinks, one per query head, join after
unpacking (`omni_jax.backends.base.fold_sinks`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omni_jax.masks import BlockMask
from omni_jax.problem import AttentionProblem

Array = Any

# Calls with fewer queries than this are packed (a kernel tile holds 128 rows).
PACK_BELOW_Q_LEN = 128


def packing_group(problem: AttentionProblem, mask: BlockMask | None) -> int:
    """The group size to pack ``problem`` with, or 1 to leave it as it is.

    Not packed: a score_mod (it reads the head and the query index) or a mask that
    differs between heads (rows of one tile would belong to several).
    """
    group = problem.group_size
    if group == 1 or problem.q_len >= PACK_BELOW_Q_LEN or problem.score_mod is not None:
        return 1
    if mask is not None and mask.shape[1] != 1:
        return 1
    return group


def packed_problem(problem: AttentionProblem, group: int) -> AttentionProblem:
    """The problem the backends see: Sq * G rows of Hkv heads, sinks folded in later."""
    if group == 1:
        return problem
    return dataclasses.replace(problem, q_len=problem.q_len * group,
                               num_q_heads=problem.num_kv_heads, has_sinks=False)


def pack_queries(query: Array, group: int, heads_first: bool = False) -> Array:
    """``[B, Sq, Hkv * G, D]`` -> ``[B, Sq * G, Hkv, D]``; with ``heads_first``
    ``[B, Hkv, Sq * G, D]`` (for one query, a decoding step, a view: no copy)."""
    batch, q_len, heads, dim = query.shape
    grouped = query.reshape(batch, q_len, heads // group, group, dim)
    if heads_first:
        return grouped.swapaxes(1, 2).reshape(batch, heads // group, q_len * group, dim)
    return grouped.swapaxes(2, 3).reshape(batch, q_len * group, heads // group, dim)


def unpack(out: Array, lse: Array, group: int,
           heads_first: bool = False) -> tuple[Array, Array]:
    """The packed call's ``out [B, Sq * G, Hkv, Dv]`` (with ``heads_first``
    ``[B, Hkv, Sq * G, Dv]``) and ``lse [B, Hkv, Sq * G]`` in the caller's layout:
    ``[B, Sq, Hkv * G, Dv]`` and ``[B, Hkv * G, Sq]``."""
    # One reshape and one transpose per layout: swapping a heads-first output into the
    # sequence-major one first leaves XLA a transpose pair it copies, where this keeps a
    # decoding step's output a view of the kernel's (the paged decoding-step test).
    if heads_first:
        batch, kv_heads, rows, dim_v = out.shape
        q_len = rows // group
        out = out.reshape(batch, kv_heads, q_len, group, dim_v).swapaxes(1, 2)
    else:
        batch, rows, kv_heads, dim_v = out.shape
        q_len = rows // group
        out = out.reshape(batch, q_len, group, kv_heads, dim_v).swapaxes(2, 3)
    lse = lse.reshape(batch, kv_heads, q_len, group).swapaxes(2, 3)
    return (out.reshape(batch, q_len, kv_heads * group, dim_v),
            lse.reshape(batch, kv_heads * group, q_len))
