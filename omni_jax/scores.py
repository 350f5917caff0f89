"""The score pipeline every backend applies to a tile of ``q @ k^T``.

``s = scale * q.k``; then ``softcap * tanh(s / softcap)`` (if softcap); then
``score_mod(s, b, h, q_idx, kv_idx)`` (if given); then masked keys get -inf.
`transform_scores` is plain jnp, usable in the XLA backend and inside kernels.

A user's score_mod may close over arrays (ALiBi slopes, bias tables). Kernels
cannot capture arrays and custom_vjp must see every differentiable input, so
`convert_score_mod` hoists every captured array into an explicit argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from omni_jax import explicit_sharding
from omni_jax.traced_functions import ComparedByJaxpr, evaluate

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


def convert_score_mod(score_mod: Callable) -> tuple[ConvertedScoreMod, list[Array]]:
    """Traces ``score_mod`` on scalars and hoists the arrays it captures.

    Raises TypeError when it is not callable or does not map a float32 scalar
    score (and int32 scalar indices) to a float scalar.
    """
    if not callable(score_mod):
        raise TypeError(f"score_mod must be callable as score_mod(score, batch_idx, head_idx, "
                        f"q_idx, kv_idx), got {type(score_mod).__name__}")
    index = jax.ShapeDtypeStruct((), jnp.int32)
    example = (jax.ShapeDtypeStruct((), jnp.float32), index, index, index, index)
    try:
        with explicit_sharding.tracing_without_explicit_mesh():
            closed = jax.make_jaxpr(score_mod)(*example)
    except Exception as error:  # noqa: BLE001 - reported with context below
        raise TypeError(f"score_mod failed when called as score_mod(score, batch_idx, head_idx, "
                        f"q_idx, kv_idx) on scalars: {error}") from error
    outputs = closed.out_avals
    if (len(outputs) != 1 or outputs[0].shape != ()
            or not jnp.issubdtype(outputs[0].dtype, jnp.floating)):
        raise TypeError(f"score_mod must return one float scalar per score, got "
                        f"{[(o.shape, str(o.dtype)) for o in outputs]}")
    jaxpr = closed.jaxpr

    def fn(score, b, h, q_idx, kv_idx, *captured):
        return evaluate(jaxpr, captured, score, b, h, q_idx, kv_idx)

    return ConvertedScoreMod(fn, len(closed.consts), jaxpr), list(closed.consts)


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


def primitive_names(jaxpr: Any) -> set[str]:
    """Names of every primitive in ``jaxpr`` and its sub-jaxprs (pjit, custom_jvp, ...)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jex_core.jaxprs_in_params(eqn.params):
            names |= primitive_names(sub)
    return names


def zero_cotangent(x: Array) -> Array:
    """The zero cotangent of ``x``: float0 for integer and boolean arrays."""
    x = jnp.asarray(x) if not hasattr(x, "dtype") else x
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)
