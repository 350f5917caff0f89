"""The score pipeline every backend applies to a tile of ``q @ k^T``.

``s = scale * q.k``; then ``softcap * tanh(s / softcap)`` (if softcap); then
``score_mod(s, b, h, q_idx, kv_idx)`` (if given); then masked keys get -inf.
`transform_scores` is plain jnp, usable in the XLA backend and inside kernels.
A user's score_mod arrives here converted (`omni_jax.scores.convert_score_mod`):
a function of scalars whose captured arrays are explicit operands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.traced_functions import ComparedByJaxpr

Array = Any


@dataclasses.dataclass(frozen=True, eq=False)
class ConvertedScoreMod(ComparedByJaxpr):
    """A score_mod as ``fn(score, b, h, q_idx, kv_idx, *captured)`` on scalars.

    ``jaxpr`` is its trace on scalars: ``constvars`` are the captured arrays (in the
    order of ``captured``), ``invars`` the five scalars. Kernels that pass captured
    arrays as refs evaluate it themselves (`pallas_kernels.captured`). Conversions
    with the same jaxpr are equal (`ComparedByJaxpr`).
    """

    fn: Callable[..., Array]
    num_captured: int
    jaxpr: Any = None

    def __call__(self, score, b, h, q_idx, kv_idx, captured: Sequence[Array]):
        return self.fn(score, b, h, q_idx, kv_idx, *captured)


def apply_score_mod(score_mod: ConvertedScoreMod, captured: Sequence[Array], scores: Array,
                    b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
    """``score_mod`` elementwise over ``scores``; indices broadcast against it.

    Scalar indices (a kernel tile's batch and head) stay unbatched, so that a captured
    array indexed by them is read as one dynamic slice rather than gathered per score.
    """
    shape = scores.shape
    indices = [jnp.asarray(x, jnp.int32) for x in (b, h, q_idx, kv_idx)]
    in_axes = (0, *(None if x.ndim == 0 else 0 for x in indices))
    args = [x if x.ndim == 0 else jnp.broadcast_to(x, shape) for x in indices]
    fn = lambda s, bi, hi, qi, ki: score_mod(s, bi, hi, qi, ki, captured).astype(scores.dtype)
    for _ in shape:
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn(scores, *args)


def transform_scores(scores: Array, *, softcap: float | None,
                     score_mod: ConvertedScoreMod | None, captured: Sequence[Array],
                     b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Array:
    """Softcap then score_mod on already-scaled scores (masking is the caller's)."""
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if score_mod is not None:
        scores = apply_score_mod(score_mod, captured, scores, b, h, q_idx, kv_idx)
    return scores
