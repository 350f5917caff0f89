"""User functions traced once on scalars (score_mod, mask_mod), compared by their jaxpr.

Such a function is traced to a jaxpr whose captured arrays become operands. Two traces
with the same jaxpr compute the same function of those operands, so they may share
compiled code (as a jit's static argument) even when the Python functions differ: a
loop that rebuilds the same closure, with new captured values, compiles once.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Any

import jax
from jax.extend import core as jex_core

from pallas_kernels import compat


def evaluate(jaxpr: Any, captured: Sequence[Any], *args: Any) -> Any:
    """The single output of ``jaxpr`` (consts: ``captured``) at ``args``."""
    axes = compat.varying_axes(captured, args)
    if not axes:
        return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, list(captured)))(*args)[0]
    return _evaluate_varying(jaxpr, list(captured), list(args), axes)[0]


def _evaluate_varying(jaxpr: Any, consts: list, args: list, axes: frozenset) -> list:
    """``jaxpr`` at ``args`` inside a `jax.shard_map`, its operands varying along ``axes``.

    The jaxpr was traced on scalars, so its equations (and calls: jit, custom_jvp,
    custom_vjp) were typed without the operands' mesh axes: each equation's operands
    first vary along ``axes`` (as ``jnp`` ops arrange for theirs), and calls are inlined.
    """
    env: dict = {}

    def read(var):
        if isinstance(var, jex_core.Literal):
            return compat.vary(jax.numpy.asarray(var.val, var.aval.dtype), axes)
        return env[var]

    env.update(zip(jaxpr.constvars, compat.vary(consts, axes), strict=True))
    env.update(zip(jaxpr.invars, compat.vary(args, axes), strict=True))
    for eqn in jaxpr.eqns:
        operands = compat.vary([read(v) for v in eqn.invars], axes)
        call = next((eqn.params[name] for name in _CALL_JAXPRS if name in eqn.params), None)
        if eqn.primitive.name in _VARYING_CASTS:  # Traced inside the shard_map: done above.
            outputs = operands
        elif call is not None:
            outputs = _evaluate_varying(call.jaxpr, list(call.consts), operands, axes)
        else:
            outputs = compat.bind_equation(eqn, operands)
        env.update(zip(eqn.outvars, outputs, strict=True))
    return [read(v) for v in jaxpr.outvars]


# The parameters holding the (closed) jaxpr of a call primitive: jit, custom_jvp/vjp.
_CALL_JAXPRS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Casts to varying that ``jnp`` records when the function is traced inside a shard_map.
_VARYING_CASTS = ("pvary", "pcast")


class ComparedByJaxpr:
    """Equality and hash by the type and the text of ``self.jaxpr`` (which declares the
    captured arrays' shapes and dtypes); by identity when ``jaxpr`` is None."""

    jaxpr: Any

    @functools.cached_property
    def _identity(self) -> Hashable:
        return (type(self), str(self.jaxpr))

    def __eq__(self, other: object) -> bool:
        if self.jaxpr is None or not isinstance(other, ComparedByJaxpr):
            return self is other
        return other.jaxpr is not None and self._identity == other._identity

    def __hash__(self) -> int:
        return id(self) if self.jaxpr is None else hash(self._identity)
