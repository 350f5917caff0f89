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

from jax.extend import core as jex_core


def evaluate(jaxpr: Any, captured: Sequence[Any], *args: Any) -> Any:
    """The single output of ``jaxpr`` (consts: ``captured``) at ``args``."""
    return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, list(captured)))(*args)[0]


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
