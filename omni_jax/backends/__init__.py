"""Attention backends and how one is chosen.

``implementation=None`` takes the first backend, in the device's order of
preference, that runs here and serves the call: on Hopper (sm90) "mosaic",
then "triton", then "xla"; on other sm80+ GPUs "triton", then "xla";
elsewhere "xla", which serves everything. The backward pass uses the same
backend when it can, else the next one in that order that can. Naming a
backend that cannot serve the call raises a ValueError that says why. The
choice is logged to the ``omni_jax`` logger (`plan_attention`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable, Iterable

from omni_jax.backends.base import AttentionBackend
from omni_jax.dispatch_log import log_once, warn_xla_on_a_gpu
from omni_jax.problem import AttentionProblem
from pallas_kernels import runtime

logger = logging.getLogger(__name__)

_BACKEND_CLASSES = {
    "xla": "omni_jax.backends.xla:XlaBackend",
    "triton": "omni_jax.backends.triton:TritonBackend",
    "mosaic": "omni_jax.backends.mosaic:MosaicBackend",
}


class _Missing(AttentionBackend):
    """Stands in for a backend whose module is not part of this installation."""

    def __init__(self, name: str, why: str):
        self.name = name
        self._why = why

    def unavailable_reason(self):
        return self._why

    def unsupported_reason(self, problem):
        return self._why

    def block_size(self, problem):
        raise NotImplementedError(self._why)

    def forward(self, *args):
        raise NotImplementedError(self._why)

    def backward(self, *args):
        raise NotImplementedError(self._why)


@functools.cache
def get_backend(name: str) -> AttentionBackend:
    """The backend registered under ``name``."""
    module_name, class_name = _BACKEND_CLASSES[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        return _Missing(name, f"the {name!r} attention backend is not part of this version")
    return getattr(module, class_name)()


def preference_order() -> tuple[str, ...]:
    """Backend names in order of preference for the default device."""
    return runtime.implementation_preference()


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The backends chosen for one call, and the problem with its block size set.

    Equal plans compile alike: a plan is the static key of `omni_jax.attention`'s jit.
    """

    problem: AttentionProblem
    forward: AttentionBackend
    backward: AttentionBackend


def _why_not(backend: AttentionBackend, problem: AttentionProblem) -> str | None:
    return backend.unavailable_reason() or backend.unsupported_reason(problem)


def plan_attention(implementation: str | None, problem: AttentionProblem, *,
                   retile: Callable[[tuple[int, int]], bool] | None = None) -> AttentionPlan:
    """Chooses the forward and backward backends for ``problem``.

    ``retile(block_size)``: whether the user's BlockMask can be re-tiled to that size
    (`omni_jax.masks.regroup`), so that a backend that declines its block size serves the
    call at its own block size; the plan's problem then names that size. A backend whose
    forward and backward both serve the mask's own block size keeps it (no re-tiling).

    Logged to the ``omni_jax`` logger (each distinct plan once): at DEBUG every plan
    with the reasons of the backends passed over, at INFO a backward that is not the
    forward's backend (a slower one, in the device's order).
    """
    order = preference_order()
    declined: dict[str, str] = {}
    if implementation is None:
        for name in order:
            served, reason = _served_problem(get_backend(name), problem, retile)
            if reason is None:
                forward, problem = get_backend(name), served
                break
            declined[name] = reason
        else:
            raise AssertionError(f"no attention backend serves this call: {declined}")
    else:
        forward = get_backend(implementation)
        problem, reason = _served_problem(forward, problem, retile)
        if reason is not None:
            raise ValueError(f"implementation={implementation!r} cannot serve this call: "
                             f"{reason}")
    if problem.block_size is None:
        problem = problem.with_block_size(forward.block_size(problem))
    fallbacks = [forward.name, *(name for name in order if name != forward.name), "xla"]
    backward, declined_backward = _first_serving(
        fallbacks, lambda b: b.unavailable_reason() or b.backward_unsupported_reason(problem))
    if implementation != "xla":
        _warn_if_xla_on_a_gpu(problem, forward, backward, declined, declined_backward)
    level = logging.DEBUG if backward is forward else logging.INFO
    if logger.isEnabledFor(level):  # Every eager call plans: no formatting while off.
        if backward is forward:
            choice = f"forward and backward {forward.name!r}" + (
                f" ({_reasons(declined)})" if declined else "")
        else:
            choice = (f"forward {forward.name!r}, backward {backward.name!r} "
                      f"({_reasons(declined_backward)})")
        log_once(logger, level, f"{_describe(problem)}: {choice}")
    return AttentionPlan(problem, forward, backward)


def _served_problem(backend: AttentionBackend, problem: AttentionProblem,
                    retile: Callable[[tuple[int, int]], bool] | None,
                    ) -> tuple[AttentionProblem, str | None]:
    """``problem`` as ``backend`` serves it (re-tiled to its block size where the mask's
    own declines it, forward or backward, and ``retile`` allows), or why it cannot."""
    reason = _why_not(backend, problem)
    if retile is None or problem.block_size is None or (
            reason is None and backend.backward_unsupported_reason(problem) is None):
        return problem, reason
    own = problem.with_block_size(backend.block_size(
        dataclasses.replace(problem, block_size=None)))
    if (own.block_size == problem.block_size or not retile(own.block_size)
            or _why_not(backend, own) is not None):
        return problem, reason
    if reason is None and backend.backward_unsupported_reason(own) is not None:
        return problem, None  # Re-tiling would not keep the backward here either.
    return own, None


def _warn_if_xla_on_a_gpu(problem: AttentionProblem, forward: AttentionBackend,
                          backward: AttentionBackend, declined: dict[str, str],
                          declined_backward: dict[str, str]) -> None:
    """The XLA backend on a GPU whose kernels declined the call is many times slower
    (it materialises every score tile in memory): a `UserWarning` says so, once."""
    if forward.name == "xla":
        what, reasons = "forward and backward", declined
    elif backward.name == "xla":
        what, reasons = "backward (gradients)", declined_backward
    else:
        return
    warn_xla_on_a_gpu(f"omni_jax.attention runs its {what} on the XLA backend",
                      _describe(problem), reasons)


def _first_serving(names: Iterable[str], reason_not_to: Callable[[AttentionBackend], str | None],
                   ) -> tuple[AttentionBackend, dict[str, str]]:
    """The first backend of ``names`` without a reason not to serve, and the reasons of
    those before it; "xla" serves every call."""
    declined = {}
    for name in names:
        backend = get_backend(name)
        reason = reason_not_to(backend)
        if reason is None:
            return backend, declined
        declined[name] = reason
    raise AssertionError(f"no attention backend serves this call: {declined}")


def _reasons(declined: dict[str, str]) -> str:
    return "; ".join(f"not {name}: {reason}" for name, reason in declined.items())


def _describe(problem: AttentionProblem) -> str:
    return (f"attention [batch {problem.batch}, {problem.q_len} x {problem.kv_len}, heads "
            f"{problem.num_q_heads}/{problem.num_kv_heads}, head dims {problem.head_dim}/"
            f"{problem.head_dim_v}, {problem.dtype}]")
