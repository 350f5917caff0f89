"""`Attention` for `flax.linen`: the nnx layer wrapped by `flax.nnx.bridge`.

One implementation serves both APIs, so the linen module computes exactly
what `omni_jax.flax.Attention` does; its parameters live in the ``params``
collection under the nnx layer's names, in a submodule ``attention``
(``attention/query/kernel``, ``attention/out/kernel``, ...), its KV cache in
the ``cache`` collection (``attention/cached_key``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax.nnx import bridge

from omni_jax.flax.nnx_attention import (
    DEFAULT_BIAS_INIT,
    DEFAULT_KERNEL_INIT,
    AxisNames,
    Initializer,
)
from omni_jax.flax.nnx_attention import Attention as NnxAttention
from omni_jax.masks import BlockMask

Array = Any


class Attention(nn.Module):
    """Linen self-attention on `omni_jax.attention`; fields as `omni_jax.flax.Attention`
    (``axis_names`` needs a mesh with those axes, or ``nnx.use_eager_sharding(False)``
    around ``init``).

    KV-cache decoding, the linen way: ``init`` with ``decode=True`` and ``x`` of shape
    ``[batch, max_len, in_features]`` allocates an empty cache of that batch and length
    in the ``cache`` collection (that call computes as without ``decode``); then each
    ``apply(variables, x_step, is_causal=True, decode=True, mutable=["cache"])`` appends
    the step's tokens and returns ``(out, {"cache": ...})`` for the next step.
    """

    num_heads: int
    in_features: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    use_bias: bool = False
    qk_norm: bool = False
    rope_base: float | None = 10_000.0
    softcap: float | None = None
    learnable_sinks: bool = False
    implementation: str | None = None
    deterministic_gradients: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = DEFAULT_KERNEL_INIT
    bias_init: Initializer = DEFAULT_BIAS_INIT
    axis_names: AxisNames | None = None
    context_axis: str | None = None
    context_strategy: str | None = None
    context_layout: str = "contiguous"

    @nn.compact
    def __call__(self, x: Array, *, positions: Array | None = None,
                 mask: BlockMask | None = None, is_causal: bool = False,
                 local_window_size: int | tuple[int, int] | None = None,
                 segment_ids: Array | None = None,
                 score_mod: Callable | None = None, decode: bool = False) -> Array:
        """Attends ``x [batch, seq, in_features]`` to itself (see the nnx layer's __call__)."""
        cached_key = self.variables.get("cache", {}).get("attention", {}).get("cached_key")
        initializing = self.is_initializing()
        if decode and not initializing:
            if cached_key is None:
                raise ValueError("decode=True needs a KV cache: init the module with decode=True "
                                 "and x of shape [batch, max_len, in_features], and pass the "
                                 "'cache' collection to apply")
            if not self.is_mutable_collection("cache"):
                raise ValueError("decode=True appends to the KV cache: call apply with "
                                 "mutable=['cache'] and keep the returned cache for the next step")
        if cached_key is not None:
            cache_shape = tuple(cached_key.shape[:2])
        else:
            cache_shape = tuple(x.shape[:2]) if decode and initializing else None
        layer = bridge.to_linen(
            _layer_with_cache, self.num_heads, self.in_features, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, out_features=self.out_features, use_bias=self.use_bias,
            qk_norm=self.qk_norm, rope_base=self.rope_base, softcap=self.softcap,
            learnable_sinks=self.learnable_sinks, implementation=self.implementation,
            deterministic_gradients=self.deterministic_gradients, dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_init=self.kernel_init,
            bias_init=self.bias_init, axis_names=self.axis_names,
            context_axis=self.context_axis, context_strategy=self.context_strategy,
            context_layout=self.context_layout, cache_shape=cache_shape,
            name="attention")
        return layer(x, positions=positions, mask=mask, is_causal=is_causal,
                     local_window_size=local_window_size, segment_ids=segment_ids,
                     score_mod=score_mod, decode=decode and not initializing)


def _layer_with_cache(*args: Any, cache_shape: tuple[int, int] | None,
                      **kwargs: Any) -> NnxAttention:
    """The nnx layer, with an empty KV cache of ``cache_shape = (batch, max_len)`` if given.

    The bridge rebuilds the layer at every ``apply`` before loading its variables, so
    the cache must exist from construction on for the ``cache`` collection to load.
    """
    layer = NnxAttention(*args, **kwargs)
    if cache_shape is not None:
        layer.init_cache(*cache_shape)
    return layer
