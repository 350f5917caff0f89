"""A user's score_mod made kernel-ready, and helpers of the score pipeline's users.

The pipeline itself (scale, softcap, score_mod, mask) is `pallas_kernels.score_pipeline`.
A user's score_mod may close over arrays (ALiBi slopes, bias tables). Kernels
cannot capture arrays and custom_vjp must see every differentiable input, so
`convert_score_mod` hoists every captured array into an explicit argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from omni_jax import explicit_sharding
from pallas_kernels.score_pipeline import ConvertedScoreMod
from pallas_kernels.traced_functions import evaluate

Array = Any


def convert_score_mod(score_mod: Callable, lengths: tuple[int, int] | None = None,
                      ) -> tuple[ConvertedScoreMod, list[Array]]:
    """Traces ``score_mod`` on scalars and hoists the arrays it captures.

    ``lengths`` (q_len, kv_len): the converted function clamps q_idx and kv_idx below
    them. Backends evaluate scores on whole tiles, past the sequences' ends too, where
    the results are masked; a score_mod that is NaN there (``jnp.take`` of a table
    out of range) would still reach the gradients (0 * NaN), so it only ever sees
    indices of the sequences.

    Raises TypeError when it is not callable or does not map a float32 scalar
    score (and int32 scalar indices) to a float scalar.
    """
    if not callable(score_mod):
        raise TypeError(f"score_mod must be callable as score_mod(score, batch_idx, head_idx, "
                        f"q_idx, kv_idx), got {type(score_mod).__name__}")
    index = jax.ShapeDtypeStruct((), jnp.int32)
    example = (jax.ShapeDtypeStruct((), jnp.float32), index, index, index, index)
    traced = score_mod
    if lengths is not None:
        last_q, last_kv = (max(length - 1, 0) for length in lengths)

        def traced(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, jnp.minimum(q_idx, last_q),
                             jnp.minimum(kv_idx, last_kv))
    try:
        with explicit_sharding.tracing_without_explicit_mesh():
            closed = jax.make_jaxpr(traced)(*example)
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
