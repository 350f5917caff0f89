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
