"""A score_mod's captured arrays read inside a kernel through refs.

A kernel receives the captured arrays (ALiBi slopes, per-head tables) as refs.
Loading a whole array and letting the score_mod index it would make
``slopes[h]`` a ``dynamic_slice`` of a loaded value, which the Triton lowering
lacks. `score_mod_on_refs` evaluates the score_mod's jaxpr instead, turning a
dynamic slice of a captured array into a load of just that slice; any other use
loads the whole array. Indexing by the per-score ``q_idx``/``kv_idx`` stays a
gather, which the backends decline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

from omni_jax.scores import ConvertedScoreMod
from pallas_kernels import compat


class _CapturedRef:
    """A captured array as a kernel ref, with its shape before the kernel's ``atleast_1d``."""

    def __init__(self, ref: Any, shape: tuple[int, ...]):
        self.ref, self.shape = ref, shape

    def load(self):
        return self.ref[...].reshape(self.shape)

    def load_slice(self, starts: Sequence[Any], sizes: Sequence[int]):
        # dynamic_slice clamps its starts into range; so do we.
        index = tuple(pl.ds(jnp.clip(start, 0, dim - size), size)
                      for start, dim, size in zip(starts, self.shape, sizes, strict=True))
        return self.ref[index]


def _evaluate(jaxpr: Any, captured: Sequence[_CapturedRef], *args: Any) -> list[Any]:
    """Evaluates ``jaxpr`` on (score, b, h, q_idx, kv_idx); b and h are a tile's scalars.

    A dynamic slice of a captured array at starts that depend on b and h only
    becomes a load of that slice; starts that vary per score (q_idx, kv_idx) need
    the whole array, and the slice becomes a gather.
    """
    env: dict[Any, Any] = {}
    varying = {jaxpr.invars[i] for i in (0, 3, 4)}  # score, q_idx, kv_idx

    def read(var):
        return var.val if isinstance(var, jex_core.Literal) else env[var]

    def varies(vars_):
        return any(not isinstance(var, jex_core.Literal) and var in varying for var in vars_)

    env.update(zip(jaxpr.constvars, captured, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        values = [read(var) for var in eqn.invars]
        if varies(eqn.invars):
            varying.update(eqn.outvars)
        if (eqn.primitive is lax.dynamic_slice_p and isinstance(values[0], _CapturedRef)
                and not varies(eqn.invars[1:])):
            outs = [values[0].load_slice(values[1:], eqn.params["slice_sizes"])]
        else:
            outs = compat.bind_equation(
                eqn, [v.load() if isinstance(v, _CapturedRef) else v for v in values])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(var) for var in jaxpr.outvars]


def score_mod_on_refs(score_mod: ConvertedScoreMod, refs: Sequence[Any],
                      shapes: Sequence[tuple[int, ...]]) -> ConvertedScoreMod:
    """``score_mod`` with its captured arrays read from ``refs`` (of arrays of ``shapes``).

    The result captures nothing: call it with ``captured=()``.
    """
    captured = [_CapturedRef(ref, tuple(shape)) for ref, shape in zip(refs, shapes, strict=True)]

    def fn(score, b, h, q_idx, kv_idx):
        return _evaluate(score_mod.jaxpr, captured, score, b, h, q_idx, kv_idx)[0]

    return ConvertedScoreMod(fn, 0)


__all__ = ["score_mod_on_refs"]
