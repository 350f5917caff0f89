"""A plain-JAX float64 attention layer computed from an `omni_jax.flax.Attention`'s parameters.

Written from the math (einsum projections, RMSNorm, rotate-half RoPE) and the
dense float64 reference attention, sharing no code with the layer under test.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tests.reference import reference_attention

RMS_EPS = 1e-6  # nnx.RMSNorm's default epsilon.


def layer_params(layer) -> dict:
    """The layer's parameters as float64 numpy arrays, keyed like ``query/kernel``."""
    params = {}
    for name in ("query", "key", "value", "out"):
        projection = getattr(layer, name)
        params[f"{name}/kernel"] = np.asarray(projection.kernel[...], np.float64)
        if projection.bias is not None:
            params[f"{name}/bias"] = np.asarray(projection.bias[...], np.float64)
    if layer.query_norm is not None:
        params["query_norm/scale"] = np.asarray(layer.query_norm.scale[...], np.float64)
        params["key_norm/scale"] = np.asarray(layer.key_norm.scale[...], np.float64)
    if layer.sinks is not None:
        params["sinks"] = np.asarray(layer.sinks[...], np.float64)
    return params


def _rms_norm(x, scale):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * scale


def _rope(x, positions, base):
    half = x.shape[-1] // 2
    freq = 1.0 / base ** (np.arange(half) * 2.0 / x.shape[-1])
    angle = jnp.asarray(positions, jnp.float64)[:, :, None, None] * freq
    real, imag = x[..., :half], x[..., half:]
    return jnp.concatenate([real * jnp.cos(angle) - imag * jnp.sin(angle),
                            real * jnp.sin(angle) + imag * jnp.cos(angle)], axis=-1)


def reference_layer(params: dict, x, *, positions, mask, rope_base: float | None,
                    softcap: float | None = None):
    """Self-attention output ``[batch, seq, out]`` in float64 (call under enable_x64)."""
    x = jnp.asarray(x, jnp.float64)

    def project(name):
        y = jnp.einsum("bse,ehd->bshd", x, params[f"{name}/kernel"])
        return y + params[f"{name}/bias"] if f"{name}/bias" in params else y

    q, k, v = project("query"), project("key"), project("value")
    if "query_norm/scale" in params:
        q = _rms_norm(q, params["query_norm/scale"])
        k = _rms_norm(k, params["key_norm/scale"])
    if rope_base is not None:
        q, k = _rope(q, positions, rope_base), _rope(k, positions, rope_base)
    out, _ = reference_attention(q, k, v, mask, softcap=softcap, sinks=params.get("sinks"))
    y = jnp.einsum("bshd,hde->bse", out, params["out/kernel"])
    return y + params["out/bias"] if "out/bias" in params else y
