"""The contract between `omni_jax.attention` and the backends that compute it.

`omni_jax.attention` validates the arguments, turns every mask argument into
one `BlockMask`, hoists the arrays a score_mod captures, and owns the
custom_vjp. A backend only computes: `forward` returns (out, lse) and
`backward` the cotangents, for one `AttentionProblem`.

Array layouts (as the user passes them): ``q [B, Sq, Hq, D]``,
``k [B, Skv, Hkv, D]``, ``v [B, Skv, Hkv, Dv]``, ``out`` like q with ``Dv``,
``lse [B, Hq, Sq]`` float32 (natural log of the softmax denominator, sinks
included; -inf for a query that sees no key and has no sink).
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

from omni_jax.masks import BlockMask
from omni_jax.problem import AttentionProblem

Array = Any


class AttentionBackend(abc.ABC):
    """One way of computing attention (XLA, Pallas Triton, Pallas Mosaic-GPU, ...).

    Backends of one class with the same attributes are equal, so that equal plans of
    separate calls share a compiled computation (`omni_jax.attention`'s jit).
    """

    name: str

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), self.name))

    @abc.abstractmethod
    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run on this machine, or None when it can."""

    @abc.abstractmethod
    def unsupported_reason(self, problem: AttentionProblem) -> str | None:
        """Why the forward pass cannot serve ``problem``, or None when it can."""

    def backward_unsupported_reason(self, problem: AttentionProblem) -> str | None:
        """Why the backward pass cannot serve ``problem`` (default: as the forward)."""
        return self.unsupported_reason(problem)

    def trace_key(self, problem: AttentionProblem) -> Hashable:
        """What else ``forward``/``backward`` read while tracing (kernel configs, interpret
        mode). `omni_jax.attention` keys its compiled calls by it, so a new config (an
        autotune winner, a forced benchmark config) or mode traces afresh."""
        del problem
        return None

    @abc.abstractmethod
    def block_size(self, problem: AttentionProblem) -> tuple[int, int]:
        """(block_q, block_kv) for a BlockMask built from the mask arguments."""

    @abc.abstractmethod
    def forward(self, problem: AttentionProblem, q: Array, k: Array, v: Array,
                block_mask: BlockMask, sinks: Array | None,
                captured: Sequence[Array]) -> tuple[Array, Array]:
        """Returns (out, lse)."""

    @abc.abstractmethod
    def backward(self, problem: AttentionProblem, q: Array, k: Array, v: Array,
                 block_mask: BlockMask, sinks: Array | None, captured: Sequence[Array],
                 out: Array, lse: Array, dout: Array,
                 dlse: Array) -> tuple[Array, Array, Array, Array | None, tuple]:
        """Returns (dq, dk, dv, dsinks or None, cotangents of ``captured``)."""


def softmax_delta(out: Array, dout: Array, dlse: Array) -> Array:
    """``rowsum(dO * O) - dlse`` as float32 ``[B, Hq, Sq]``: the softmax VJP's row term.

    The rows are summed in the arrays' own ``[B, Sq, Hq, D]`` layout and only the
    small result is transposed. XLA fuses the two when it can, and its fused
    reduction into ``[B, Hq, Sq]`` order reads dO and O at a quarter of the
    bandwidth (237 us against 63 us for 16k tokens x 16 heads x 128 on an H100);
    the barrier keeps them apart.
    """
    rows = (dout.astype(jnp.float32) * out.astype(jnp.float32)).sum(axis=-1)
    rows = lax.optimization_barrier(rows)
    return jnp.swapaxes(rows, 1, 2) - dlse.astype(jnp.float32)


def sinks_cotangent(sinks: Array, lse: Array, delta: Array) -> Array:
    """d loss / d sinks from the forward's lse and ``delta = rowsum(dO * O) - dlse``.

    d lse / d sink is the sink's probability ``exp(sink - lse)``, so the
    cotangent sums ``-p_sink * delta`` over batch and queries.
    """
    # lse = -inf only where the sink is -inf too (a query that sees nothing): probability 0.
    sink_prob = jnp.exp(sinks.astype(jnp.float32)[None, :, None]
                        - jnp.where(lse == -jnp.inf, 0.0, lse))
    return -(sink_prob * delta).sum(axis=(0, 2)).astype(sinks.dtype)


def fold_sinks(out: Array, lse: Array, sinks: Array) -> tuple[Array, Array]:
    """``(out, lse)`` of a sink-free result with the sink logits ``[Hq]`` added to the
    softmax denominator (a backend whose kernels leave sinks out, packed query groups)."""
    with_sinks = jnp.logaddexp(lse, sinks.astype(lse.dtype)[None, :, None])
    # 0 for rows that saw no key (lse = -inf), those whose sink is -inf too included.
    weight = jnp.exp(lse - jnp.where(with_sinks == -jnp.inf, 0.0, with_sinks))
    out = (out.astype(lse.dtype) * jnp.swapaxes(weight, 1, 2)[..., None]).astype(out.dtype)
    return out, with_sinks
