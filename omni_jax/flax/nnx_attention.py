"""`Attention`: a `flax.nnx` self-attention layer computed by `omni_jax.attention`.

q/k/v/out projections, grouped-query attention (``num_kv_heads``), rotary
position embeddings, optional qk-norm (RMSNorm over head_dim, as Gemma 3 /
OLMo 2), softcap, optional learnable attention sinks (gpt-oss), any mask of
`omni_jax.attention` given at call time, and a KV-cache decode step (on the layer's
own contiguous cache, or on a paged cache the caller owns: `decode_paged`). The
layer only prepares q/k/v; the kernel choice stays with ``implementation``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import omni_jax
from omni_jax import context_parallel, explicit_sharding
from omni_jax.context_parallel.layout import shard_positions
from omni_jax.flax.cache import as_pages, decode_mask, write_cache
from omni_jax.flax.rope import apply_rope, segment_positions
from omni_jax.masks import BlockMask
from omni_jax.validation import check_flag, check_implementation, check_window

Array = Any
Initializer = Callable[..., Array]

# Flax's defaults for attention projections (nnx.MultiHeadAttention uses the same).
DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
DEFAULT_BIAS_INIT = nnx.initializers.zeros_init()


@dataclasses.dataclass(frozen=True)
class AxisNames:
    """Mesh axis names for the kernels' dimensions (`nnx.with_partitioning` metadata).

    The default shards heads over a ``"model"`` axis (Megatron-style tensor
    parallelism); None leaves a dimension replicated. Flax creates annotated
    variables already sharded (eager sharding, its default), which needs a mesh
    with these axes: build the layer under ``jax.set_mesh(mesh)``, or under
    ``nnx.use_eager_sharding(False)`` for the metadata alone. Otherwise Flax
    raises "An auto mesh context or metadata is required".
    """

    embed: str | None = None
    heads: str | None = "model"
    head_dim: str | None = None


class Attention(nnx.Module):
    """Multi-head self-attention on `omni_jax.attention`.

    Args:
      num_heads: query heads.
      in_features: input (and, by default, output) feature size.
      num_kv_heads: key/value heads (GQA/MQA); default ``num_heads``.
      head_dim: per-head size; default ``in_features // num_heads``.
      out_features: output feature size; default ``in_features``.
      use_bias: biases on the q/k/v/out projections.
      qk_norm: RMSNorm on queries and keys (per head, over head_dim), before RoPE.
      rope_base: RoPE base frequency; None disables rotary embeddings.
      softcap: attention logit softcap (Gemma 2).
      learnable_sinks: a learnable sink logit per query head (gpt-oss).
      implementation: `omni_jax.attention` backend: None (best available),
        "xla", "triton" or "mosaic".
      dtype: computation dtype (default: inferred from inputs and params).
      param_dtype: parameter dtype.
      kernel_init, bias_init: initialisers of the projections.
      axis_names: shard the projection kernels over these mesh axes (None: no
        sharding metadata); see `AxisNames` for the mesh this needs.
      deterministic_gradients: `omni_jax.attention`'s ``deterministic`` (gradients the
        same bit for bit in every run; False allows atomic sums, faster on Hopper).
      context_axis, context_strategy, context_layout: context parallelism, as
        `omni_jax.attention` (inside `jax.shard_map`, ``x`` is this device's shard of
        the sequence); default RoPE positions are then global.
      rngs: flax.nnx random streams (``params``).
    """

    def __init__(self, num_heads: int, in_features: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, out_features: int | None = None,
                 use_bias: bool = False, qk_norm: bool = False,
                 rope_base: float | None = 10_000.0, softcap: float | None = None,
                 learnable_sinks: bool = False, implementation: str | None = None,
                 deterministic_gradients: bool = True, dtype: Any = None,
                 param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = DEFAULT_KERNEL_INIT,
                 bias_init: Initializer = DEFAULT_BIAS_INIT,
                 axis_names: AxisNames | None = None, context_axis: str | None = None,
                 context_strategy: str | None = None, context_layout: str = "contiguous",
                 rngs: nnx.Rngs) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if head_dim is None:
            if in_features % num_heads:
                raise ValueError(f"in_features ({in_features}) is not divisible by num_heads "
                                 f"({num_heads}): pass head_dim")
            head_dim = in_features // num_heads
        if rope_base is not None and head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of features, so head_dim must be even, got "
                             f"{head_dim}; choose an even head_dim or pass rope_base=None")
        check_implementation(implementation)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_base = rope_base
        self.softcap = softcap
        self.implementation = implementation
        self.deterministic_gradients = check_flag("deterministic_gradients",
                                                  deterministic_gradients)
        self.dtype = dtype
        self.context = {} if context_axis is None else dict(
            context_axis=context_axis, context_strategy=context_strategy,
            context_layout=context_layout)

        def sharded(init: Initializer, names: tuple[str | None, ...]) -> Initializer:
            return init if axis_names is None else nnx.with_partitioning(init, names)

        a = axis_names or AxisNames()
        in_heads = (a.embed, a.heads, a.head_dim)

        def projection(in_axes, out_axes, kernel_names, bias_names, **kwargs):
            return nnx.LinearGeneral(
                in_axes, out_axes, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                kernel_init=sharded(kernel_init, kernel_names),
                bias_init=sharded(bias_init, bias_names), rngs=rngs, **kwargs)

        self.query = projection(in_features, (num_heads, head_dim), in_heads, in_heads[1:])
        self.key = projection(in_features, (num_kv_heads, head_dim), in_heads, in_heads[1:])
        self.value = projection(in_features, (num_kv_heads, head_dim), in_heads, in_heads[1:])
        self.out = projection((num_heads, head_dim), out_features or in_features,
                              (a.heads, a.head_dim, a.embed), (a.embed,), axis=(-2, -1))
        norm = lambda: nnx.RMSNorm(head_dim, dtype=dtype, param_dtype=param_dtype,
                                   scale_init=sharded(nnx.initializers.ones_init(),
                                                      (a.head_dim,)), rngs=rngs)
        self.query_norm = norm() if qk_norm else None
        self.key_norm = norm() if qk_norm else None
        sinks_init = sharded(nnx.initializers.zeros_init(), (a.heads,))
        self.sinks = (nnx.Param(sinks_init(rngs.params(), (num_heads,), param_dtype))
                      if learnable_sinks else None)
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cached_segment_ids: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> None:
        """Allocates an empty KV cache ``[batch, max_len, num_kv_heads, head_dim]`` of
        ``dtype`` (default: the layer's ``dtype``, else its ``param_dtype``), replacing
        any cache the layer had."""
        dtype = dtype or self.dtype or self.query.param_dtype
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_segment_ids = nnx.Cache(jnp.zeros((batch, max_len), jnp.int32))
        self.cache_index = nnx.Cache(jnp.zeros((batch,), jnp.int32))

    def __call__(self, x: Array, *, positions: Array | None = None,
                 mask: BlockMask | None = None, is_causal: bool = False,
                 local_window_size: int | tuple[int, int] | None = None,
                 segment_ids: Array | None = None, score_mod: Callable | None = None,
                 decode: bool = False) -> Array:
        """Attends ``x [batch, seq, in_features]`` to itself.

        Args:
          positions: int ``[batch|1, seq]`` RoPE positions. Default: the position
            inside each document when ``segment_ids`` is given (counted over the
            cache when decoding), else the token's index (its cache slot when
            decoding).
          mask, is_causal, local_window_size, score_mod: as `omni_jax.attention`.
          segment_ids: int ``[batch, seq]`` packed-document ids: a token sees only
            tokens of its own document (cached ones too when decoding).
          decode: append ``x``'s keys/values to the cache (see `init_cache`) and
            attend to everything cached so far, causally; one token or several
            (a prompt, a chunk) per call, at each sequence's own cache length.
            ``local_window_size`` (its left side) and ``segment_ids`` combine
            with it; ``mask`` and ``score_mod`` (whose indices would be the
            step's, not the cache's) do not. A step past the cache's
            ``max_len`` raises when the cache index is concrete (eager calls);
            under jit, where it is traced, the outputs of the positions past
            the end are NaN, no cached token is overwritten, and
            ``cache_index`` keeps counting, so every later step is NaN too.
            Without ``segment_ids`` the step is an `omni_jax.paged_attention` call on
            the cache viewed as pages (`omni_jax.flax.cache.as_pages`), which, serving
            inference, has no derivative.

        Returns:
          ``[batch, seq, out_features]``.
        """
        in_features = self.query.in_features[0]
        if jnp.ndim(x) != 3 or x.shape[-1] != in_features:
            raise ValueError(f"x must be [batch, seq, in_features] with in_features="
                             f"{in_features}, got shape {jnp.shape(x)}")
        query, key, value = self._project_qkv(x)
        common = self._attention_options()
        window = check_window(local_window_size)
        if decode and self.context:
            raise ValueError("decode=True does not take context parallelism (context_axis="
                             f"{self.context['context_axis']!r}): decode with a layer without it")
        if decode:
            out = self._decode(query, key, value, positions, segment_ids, mask, score_mod,
                               window, common)
            return _project(self.out, out, 2)
        if positions is None:
            positions = self._default_positions(x.shape[1], segment_ids)
        query, key = self._rotate(query, key, positions)
        out = omni_jax.attention(query, key, value, mask=mask, is_causal=is_causal,
                                 local_window_size=window, q_segment_ids=segment_ids,
                                 score_mod=score_mod, deterministic=self.deterministic_gradients,
                                 **common, **self.context)
        return _project(self.out, out, 2)

    def decode_paged(self, x: Array, k_pages: Array, v_pages: Array, page_table: Array,
                     kv_lens: Array, *, positions: Array | None = None,
                     local_window_size: int | tuple[int, int] | None = None,
                     ) -> tuple[Array, Array, Array]:
        """A decode step on a paged KV cache that the caller owns (continuous batching).

        Appends ``x [batch, n, in_features]``'s keys and values after each sequence's
        ``kv_lens[b]`` tokens in this layer's ``k_pages``/``v_pages`` (laid out as
        `omni_jax.paged_attention` reads them, through the shared ``page_table``) and
        attends causally over everything cached. ``kv_lens`` are the lengths before the
        step: the caller advances them by n once every layer has run. ``positions``
        (RoPE) default to the tokens' cache positions; the cache computes in the pages'
        dtype. Returns ``(out [batch, n, out_features], k_pages, v_pages)``; donate the
        pages to a jitted step to update them in place.
        """
        query, key, value = self._project_qkv(x)
        if positions is None:
            positions = kv_lens[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)
        query, key = self._rotate(query, key, positions)
        k_pages, v_pages = omni_jax.paged_cache_write(
            k_pages, v_pages, page_table, kv_lens, key.astype(k_pages.dtype),
            value.astype(v_pages.dtype))
        out = omni_jax.paged_attention(query.astype(k_pages.dtype), k_pages, v_pages,
                                       page_table, kv_lens + x.shape[1],
                                       local_window_size=check_window(local_window_size),
                                       **self._attention_options())
        return _project(self.out, out.astype(query.dtype), 2), k_pages, v_pages

    def _project_qkv(self, x: Array) -> tuple[Array, Array, Array]:
        """Queries, keys and values ``[batch, seq, heads, head_dim]`` (qk-normed), unrotated."""
        query, key, value = (_project(linear, x, 1) for linear in (self.query, self.key,
                                                                     self.value))
        if self.query_norm is not None:
            query, key = self.query_norm(query), self.key_norm(key)
        return query, key, value

    def _attention_options(self) -> dict:
        sinks = None if self.sinks is None else self.sinks[...]
        return dict(softcap=self.softcap, sinks=sinks, implementation=self.implementation)

    def _default_positions(self, length: int, segment_ids: Array | None) -> Array:
        """RoPE positions ``[1|batch, length]`` of this call's tokens in their sequence
        (the global one under context parallelism) or their document."""
        if not self.context:
            return (jnp.arange(length, dtype=jnp.int32)[None] if segment_ids is None
                    else segment_positions(segment_ids))
        axis = self.context["context_axis"]
        if segment_ids is not None:
            raise ValueError(f"with context_axis={axis!r} and segment_ids, pass positions: "
                             f"positions within each document need the whole sequence "
                             f"(compute them before sharding)")
        num_shards = context_parallel.mesh_axis.axis_size(axis)  # names an unknown axis
        return shard_positions(self.context["context_layout"], jax.lax.axis_index(axis),
                               num_shards, length)[None]

    def _rotate(self, query: Array, key: Array, positions: Array) -> tuple[Array, Array]:
        if self.rope_base is None:
            return query, key
        return (apply_rope(query, positions, base=self.rope_base),
                apply_rope(key, positions, base=self.rope_base))

    def _decode(self, query: Array, key: Array, value: Array, positions: Array | None,
                segment_ids: Array | None, mask: BlockMask | None, score_mod: Callable | None,
                window: tuple[int, int] | None, common: dict) -> Array:
        """Writes the step into the cache at its index and attends over the whole cache."""
        if self.cache_index is None:
            raise ValueError("decode=True needs a KV cache: call init_cache(batch, max_len) "
                             "first")
        if mask is not None or score_mod is not None:
            raise ValueError("decode=True attends causally over the cache; mask and score_mod "
                             "are not supported with it (segment_ids and local_window_size "
                             "are)")
        batch, num_new = query.shape[:2]
        index = self.cache_index[...]
        max_len = self.cached_key.shape[1]
        if self.cached_key.shape[0] != batch:
            raise ValueError(f"decode: x has batch {batch}, the cache was made for batch "
                             f"{self.cached_key.shape[0]}")
        if num_new == 0:
            raise ValueError("decode: the step has no tokens (x has sequence length 0); "
                             "give at least one")
        if num_new > max_len:
            raise ValueError(f"decode: {num_new} new tokens do not fit a cache of {max_len}")
        _check_cache_room(index, num_new, max_len)
        slots = index[:, None] + jnp.arange(num_new, dtype=jnp.int32)
        kv_segments = None
        if segment_ids is not None:
            segment_ids = jnp.broadcast_to(jnp.asarray(segment_ids, jnp.int32),
                                           (batch, num_new))
            kv_segments = write_cache(self.cached_segment_ids[...], segment_ids, slots)
            self.cached_segment_ids[...] = kv_segments
        if positions is None:
            positions = (slots if kv_segments is None else
                         jnp.take_along_axis(segment_positions(kv_segments), slots, axis=1))
        query, key = self._rotate(query, key, positions)
        keys = write_cache(self.cached_key[...], key, slots)
        values = write_cache(self.cached_value[...], value, slots)
        self.cached_key[...], self.cached_value[...] = keys, values
        self.cache_index[...] = index + num_new
        window_left = None if window is None else window[0]
        keys, values = keys.astype(query.dtype), values.astype(query.dtype)
        pages = None if segment_ids is not None else as_pages(
            keys, values, mosaic_only=common["implementation"] == "mosaic")
        if pages is not None:
            out = omni_jax.paged_attention(
                query, *pages, index + num_new,
                local_window_size=None if window_left is None else (window_left, 0), **common)
        else:
            out = omni_jax.attention(query, keys, values,
                                     mask=decode_mask(index, num_new, max_len, window_left),
                                     q_segment_ids=segment_ids, kv_segment_ids=kv_segments,
                                     **common)
        # Past the end under jit: the step's tokens there were dropped, so poison them.
        return jnp.where((slots < max_len)[:, :, None, None], out, jnp.nan)


def _check_cache_room(index: Array, num_new: int, max_len: int) -> None:
    """Raises when a concrete cache ``index [batch]`` leaves no room for ``num_new`` tokens
    (a traced one cannot be checked; the step then poisons what does not fit)."""
    if isinstance(index, jax.core.Tracer):
        return
    index = np.asarray(index)
    overflowing = np.flatnonzero(index + num_new > max_len)
    if overflowing.size:
        b = overflowing[0]
        raise ValueError(f"decode: the KV cache has max_len={max_len} slots, but sequence {b} "
                         f"is at index {index[b]} + {num_new} new tokens = "
                         f"{index[b] + num_new}: call init_cache with a larger max_len")


def _project(linear: nnx.LinearGeneral, inputs: Array, num_contracted: int) -> Array:
    """``linear(inputs)``, contracting the last ``num_contracted`` axes. Under explicit
    sharding (`jax.sharding.AxisType.Explicit`) the result's sharding is named: the
    inputs' leading axes, then the kernel's output axes (a contraction over a sharded
    axis is ambiguous there)."""
    kernel = linear.kernel[...]
    if not explicit_sharding.any_sharded(inputs, kernel):
        return linear(inputs)
    leading = explicit_sharding.dims(explicit_sharding.spec_of(inputs), inputs.ndim)
    outputs = explicit_sharding.dims(explicit_sharding.spec_of(kernel), kernel.ndim)
    spec = explicit_sharding.unique((*leading[:-num_contracted], *outputs[num_contracted:]))
    return linear(inputs, out_sharding=spec)
