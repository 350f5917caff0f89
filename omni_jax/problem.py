"""`AttentionProblem`: the static description of one attention call.

Backends receive it with the arrays; it holds everything known at trace time
(shapes, dtype, scale, softcap, score_mod, sinks, block size) so a backend can
say whether it serves a call and pick its kernel configuration.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.score_pipeline import ConvertedScoreMod


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: np.dtype
    scale: float
    softcap: float | None
    score_mod: ConvertedScoreMod | None
    has_sinks: bool
    has_user_mask: bool
    # (block_q, block_kv) of the BlockMask the backend walks; a user's BlockMask
    # fixes it, otherwise the chosen backend's preference sets it.
    block_size: tuple[int, int] | None = None
    # Gradients the same bit for bit in every run: no atomic sums in the backward.
    deterministic: bool = True

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1: MHA; num_q_heads: MQA)."""
        return self.num_q_heads // self.num_kv_heads

    def with_block_size(self, block_size: tuple[int, int]) -> AttentionProblem:
        return dataclasses.replace(self, block_size=tuple(block_size))
