"""Mask array functions compiled whole, and run at once where eager ops would be.

Masks known at trace time are built eagerly: outside jit, and while a jit traces an
attention call (`pallas_kernels.tile_classes.trace_time_eval`, under
`jax.ensure_compile_time_eval`). Op by op, each new shape compiles every op: dozens of
compiles, seconds on a CPU. A `jax.jit` function called there runs op by op too; its
ahead-of-time compiled executable does not, and what it returns is concrete inside a
trace as well. So where an op on concrete inputs would be evaluated, they take the
executable, compiled once per signature; elsewhere (traced inputs, or a trace that stages
constants) the jitted function, staged like any op.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pallas_kernels import compat

# Executables kept per function (hypothesis tests build masks of hundreds of shapes).
_CACHED_SIGNATURES = 256


def compiled_when_concrete(static_argnames: Sequence[str] = ()) -> Callable[[Callable],
                                                                             Callable]:
    """Decorates ``fn`` (arrays and pytrees of them as arguments, ``static_argnames`` by
    keyword) as described in the module docstring."""

    def decorate(fn: Callable) -> Callable:
        jitted = jax.jit(fn, static_argnames=tuple(static_argnames))
        executables: collections.OrderedDict = collections.OrderedDict()

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            statics = {name: kwargs.pop(name) for name in static_argnames if name in kwargs}
            leaves, treedef = jax.tree.flatten((args, kwargs))
            signature = tuple(map(_signature, leaves))
            # Under a mesh (inside a shard_map, or `jax.set_mesh`) an executable's results
            # would carry that mesh into later traces: op by op there, as before.
            if (None in signature or not compat.evaluates_eagerly()
                    or not jax.sharding.get_abstract_mesh().empty):
                return jitted(*args, **kwargs, **statics)
            key = (treedef, signature,
                   tuple(sorted(statics.items())), bool(jax.config.jax_enable_x64),
                   str(jax.config.jax_default_device))
            executable = executables.get(key)
            if executable is None:
                with compat.staging_constants():
                    executable = jitted.lower(*args, **kwargs, **statics).compile()
                executables[key] = executable
                if len(executables) > _CACHED_SIGNATURES:
                    executables.popitem(last=False)
            return executable(*args, **kwargs)

        # As `functools.lru_cache`'s: the executables held, and dropping them (tests).
        call.cache_size = lambda: len(executables)
        call.cache_clear = executables.clear
        return call

    return decorate


def _signature(leaf: Any) -> tuple | None:
    """What an executable compiled for ``leaf`` fixes (shape, dtype, weak type, device);
    None for a tracer or an array over several devices, which the jitted function takes
    (an executable's results would carry their mesh into later traces)."""
    if isinstance(leaf, jax.core.Tracer):
        return None
    if isinstance(leaf, jax.Array):
        if not compat.is_single_device_sharding(leaf.sharding):
            return None
        return leaf.shape, leaf.dtype, leaf.weak_type, leaf.sharding
    return np.shape(leaf), np.result_type(leaf), isinstance(leaf, (bool, int, float)), None
