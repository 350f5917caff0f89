"""Block-sparse flash-attention backward pass, Pallas with Triton lowering (sm80+)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tile sizes and launch parameters of the dK/dV and dQ kernels.

    ``block_q``/``block_kv`` are upper bounds, as in `ForwardConfig`.
    """

    block_q: int = 64
    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 1
