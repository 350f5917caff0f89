"""The GEMM implementations and how one is chosen.

Each implementation is a module with ``unsupported_reason(problem)`` and
``matmul(a, b, scale, bias, *, transpose_a, transpose_b, activation, out_dtype)``
over the batched operand layouts of `pallas_kernels.matmul_common`.
``implementation=None`` takes, in the device's order of preference, the first
one that runs here and serves the call: on Hopper (sm90) and datacenter
Blackwell (sm100) "mosaic", then "triton", then "xla"; on other sm80+ GPUs
"triton", then "xla"; elsewhere "xla", which serves everything. Naming one that
cannot serve raises ValueError. "mosaic" is the kernel of the GPU's architecture:
`pallas_kernels.mosaic.matmul_sm90` or `matmul_sm100`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Hashable
from types import ModuleType

import jax.numpy as jnp
import numpy as np

from omni_jax import first_use_check
from omni_jax.dispatch_log import log_once
from pallas_kernels import runtime
from pallas_kernels.matmul_common import GemmProblem

logger = logging.getLogger(__name__)

_MODULES = {
    "xla": "omni_jax.matmul.xla",
    "triton": "pallas_kernels.triton.matmul",
}
_MOSAIC_MODULES = {
    "sm90": "pallas_kernels.mosaic.matmul_sm90",
    "sm100": "pallas_kernels.mosaic.matmul_sm100",
}


def module(name: str) -> ModuleType | None:
    """The module of implementation ``name``, or None when this version lacks it.
    "mosaic" is the kernel of the architecture Mosaic kernels run on here (Hopper's
    where none does)."""
    if name == "mosaic":
        return _import(_MOSAIC_MODULES[runtime.mosaic_architecture() or "sm90"])
    return _import(_MODULES[name])


@functools.cache
def _import(path: str) -> ModuleType | None:
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as error:
        if error.name != path:
            raise
        return None


def unavailable_reason(name: str) -> str | None:
    """Why implementation ``name`` cannot run on this machine, or None when it can."""
    if module(name) is None:
        return f"the {name!r} matmul implementation is not part of this version"
    interpret = f"or {runtime.INTERPRET_ENV_VAR}=1 to run it interpreted"
    if name == "triton" and not runtime.can_run_triton():
        return (f"the Triton kernel needs a CUDA GPU of compute capability 8.0 or newer "
                f"({interpret})")
    if name == "mosaic" and runtime.mosaic_architecture() is None:
        capability = runtime.gpu_compute_capability()
        here = ("this device is not a CUDA GPU" if capability is None
                else f"this GPU has compute capability {capability[0]}.{capability[1]}")
        return (f"the Mosaic kernels need a Hopper (sm90) or datacenter Blackwell (sm100) "
                f"GPU ({interpret}, =sm100 as Blackwell); {here}")
    return None


def why_not(name: str, problem: GemmProblem) -> str | None:
    """Why ``name`` cannot serve ``problem`` here, or None when it can."""
    if name != "xla" and 0 in (problem.m, problem.n, problem.k):
        return "empty dimensions (M, N or K is 0) are served by the 'xla' implementation"
    return (unavailable_reason(name) or module(name).unsupported_reason(problem)
            or (_first_use_reason(problem) if name == "mosaic" else None))


# The first-use check's GEMM: one tile of the default configs in M and N, two K steps.
_CHECK_SIZE = 256


def _first_use_reason(problem: GemmProblem) -> str | None:
    """On a Blackwell GPU, where the sm100 kernel was never executed before this
    process, why its configuration for ``problem`` is declined: checked once per
    configuration on a small GEMM of the same kind against the xla implementation
    (`omni_jax.first_use_check`)."""
    if not first_use_check.unverified_hardware() or runtime.mosaic_architecture() != "sm100":
        return None
    kernel = module("mosaic")
    config = kernel.default_config(problem.m, problem.n, problem.k, problem.in_dtype,
                                   problem.out_dtype, vectors=problem.has_scale + problem.has_bias,
                                   batch=problem.batch)
    key = ("matmul", config, problem.transpose_a, problem.transpose_b, problem.activation,
           problem.has_scale, problem.has_bias, str(problem.in_dtype), str(problem.out_dtype))
    a, b, scale, bias = _check_operands(problem)
    options = dict(transpose_a=problem.transpose_a, transpose_b=problem.transpose_b,
                   activation=problem.activation)
    widen = lambda x: None if x is None else x.astype(jnp.float32)
    return first_use_check.verified(
        key, f"the sm100 GEMM ({problem.in_dtype} -> {problem.out_dtype}, {config})",
        lambda: kernel.matmul(a, b, scale, bias, out_dtype=problem.out_dtype, config=config,
                              **options),
        lambda: module("xla").matmul(widen(a), widen(b), scale, bias, out_dtype=jnp.float32,
                                     **options))


def _check_operands(problem: GemmProblem) -> tuple:
    """Random operands of ``problem``'s kind at `_CHECK_SIZE` (M = N = K)."""
    size = _CHECK_SIZE
    rng = np.random.default_rng(0)
    operand = lambda shape: jnp.asarray(rng.uniform(-1, 1, shape), jnp.float32).astype(
        problem.in_dtype)
    a = operand((size, size))
    b = operand((size, size))
    scale = jnp.asarray(rng.uniform(0.5, 1.5, (1, size)), jnp.float32) if problem.has_scale \
        else None
    bias = jnp.asarray(rng.uniform(-1, 1, (1, size)), jnp.float32) if problem.has_bias else None
    return a[None], b[None], scale, bias


def preference_order() -> tuple[str, ...]:
    """Implementation names in order of preference for the default device."""
    return runtime.implementation_preference()


def choose(implementation: str | None, problem: GemmProblem) -> str:
    """The implementation that computes ``problem``; logged at DEBUG to the ``omni_jax``
    logger (each distinct choice once) with the reasons of those passed over."""
    if implementation is None:
        return _first_serving(preference_order(), problem, logging.DEBUG)
    reason = why_not(implementation, problem)
    if reason is not None:
        raise ValueError(
            f"matmul: implementation={implementation!r} cannot serve this call: {reason}"
        )
    return implementation


def fallback(preferred: str, problem: GemmProblem) -> str:
    """``preferred`` if it serves ``problem`` (a backward GEMM), else the next that does
    (logged at INFO: a slower implementation than the forward's)."""
    return _first_serving((preferred, *preference_order(), "xla"), problem, logging.INFO)


def _first_serving(names: tuple[str, ...], problem: GemmProblem, passed_over_level: int) -> str:
    """The first of ``names`` that serves ``problem`` ("xla" serves every call); logged
    at ``passed_over_level`` if it is not the first, else at DEBUG."""
    declined = {}
    for name in names:
        reason = why_not(name, problem)
        if reason is None:
            break
        declined[name] = reason
    else:
        raise AssertionError(f"no matmul implementation serves this call: {declined}")
    level = passed_over_level if declined else logging.DEBUG
    if logger.isEnabledFor(level):
        sizes = " x ".join(map(str, (*problem.batch_shape, problem.m, problem.n, problem.k)))
        passed_over = "".join(f"; not {n}: {r}" for n, r in declined.items())
        log_once(logger, level, f"matmul [{sizes}, {problem.in_dtype} -> "
                 f"{problem.out_dtype}]: {name!r}{passed_over}")
    return name


def trace_state() -> Hashable:
    """What the kernels read while tracing besides the call itself (interpret mode and
    the architecture it stands in for, autotuned configs): part of `omni_jax.matmul`'s
    jit key, so that a change traces afresh instead of reusing a call compiled before
    it."""
    tuned = getattr(module("mosaic"), "tuned_configs", None)
    return runtime.interpreted_architecture(), None if tuned is None else tuned()
