"""The Pallas Mosaic-GPU backend: warp-specialized, TMA-pipelined kernels for Hopper.

Runs on sm90 GPUs, or anywhere under ``OMNI_JAX_PALLAS_INTERPRET=1`` through
the Mosaic-GPU interpreter (race detection on; TMA bounds as on hardware).

Serves bf16/fp16 inputs with head dims up to 256 (zero-padded to 64, 96, 128, 192 or 256), any
lengths, GQA/MQA, every BlockMask with ``block_q = 128`` (the kernel's q tile),
softcap, sinks and score_mods that use only elementwise operations and read
captured float arrays (at most 1024 elements) by element at indices of the
batch and head alone (ALiBi slopes ``x[h]``, tables ``x[b, h]``, 0-d arrays;
`pallas_kernels.captured`; their gradients come from the XLA backward). The
backward pass (dK/dV and dQ kernels) serves the same, except: head dims above
128 (after padding), BlockMasks with ``block_kv`` other than 64 or 128, and
score_mods whose derivative uses non-elementwise operations.
For those `backward_unsupported_reason` says why and `omni_jax` takes the
backward from the next backend that can (Triton on GPUs, else XLA).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from omni_jax.backends import xla
from omni_jax.backends.base import AttentionBackend
from omni_jax.masks import BlockMask
from omni_jax.masks.mask_mods import includes_causal
from omni_jax.problem import AttentionProblem
from omni_jax.scores import primitive_names
from pallas_kernels import compat, kv_splits, runtime
from pallas_kernels.block_sparse import kernel_mask, walk_statistics
from pallas_kernels.captured import PackedCaptured, scalar_reads_reason, score_mod_on_packed
from pallas_kernels.mosaic import attention_bwd_sm90 as bwd
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd
from pallas_kernels.mosaic.attention_sm90_common import SMEM_LIMIT
from pallas_kernels.softmax import fold_sinks, sinks_cotangent

_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# Primitives a score_mod may use: elementwise math the Mosaic-GPU lowering
# handles on register tiles (no gathers, no reductions, no control flow).
_ELEMENTWISE_PRIMITIVES = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "exp", "exp2", "log",
    "tanh", "logistic", "sqrt", "rsqrt", "integer_pow", "square", "convert_element_type",
    "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "rem",
    "broadcast_in_dim", "pjit", "jit", "copy", "copy_p",
})


def score_mod_unsupported_reason(problem: AttentionProblem,
                                 derivative: bool = False) -> str | None:
    """Why the kernels cannot lower ``problem.score_mod`` (or, for the backward, also
    its derivative), or None."""
    score_mod = problem.score_mod
    if score_mod is None:
        return None
    layout = None
    if score_mod.num_captured:
        reason = scalar_reads_reason(score_mod)
        if reason is not None:
            return reason
        layout = PackedCaptured.layout_of([v.aval for v in score_mod.jaxpr.constvars])
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    index = jax.ShapeDtypeStruct((), jnp.int32)
    def apply(score, b, h, *indices):
        mod = score_mod
        if layout is not None:
            # The kernels read the captured elements from smem; a stand-in gives values.
            mod = score_mod_on_packed(score_mod, _StandInRef(), layout, b, h)
        if not derivative:
            return mod(score, b, h, *indices, ())
        return jax.jvp(lambda x: mod(x, b, h, *indices, ()), (score,), (jnp.ones_like(score),))

    closed = jax.make_jaxpr(apply)(scalar, index, index, index, index)
    unsupported = primitive_names(closed.jaxpr) - _ELEMENTWISE_PRIMITIVES
    if unsupported:
        return f"score_mod uses operations the Mosaic lowering lacks: {sorted(unsupported)}"
    return None


class _StandInRef:
    """Stands in for the kernels' smem buffer of captured elements when checking what a
    score_mod lowers to: reading it is the kernels' scalar smem load."""

    def __getitem__(self, index):
        return lax.convert_element_type(index[0], jnp.float32)


class MosaicBackend(AttentionBackend):
    """Pallas Mosaic-GPU kernels for Hopper (sm90)."""

    name = "mosaic"

    def unavailable_reason(self) -> str | None:
        if runtime.can_run_mosaic_hopper():
            return None
        return ("the Mosaic-GPU kernels need an sm90 (Hopper) GPU, or "
                f"{runtime.INTERPRET_ENV_VAR}=1 for the interpreter")

    def unsupported_reason(self, problem: AttentionProblem) -> str | None:
        if np.dtype(problem.dtype) not in _DTYPES:
            return f"dtype {np.dtype(problem.dtype).name} (the kernels take bfloat16 or float16)"
        for name, dim in (("head_dim", problem.head_dim), ("head_dim_v", problem.head_dim_v)):
            if fwd.padded_head_dim(dim) is None:
                return f"{name}={dim} (at most {fwd.SUPPORTED_HEAD_DIMS[-1]})"
        if problem.block_size is not None:
            block_q, block_kv = problem.block_size
            if block_q != fwd.BLOCK_Q or block_kv % 64 or not 64 <= block_kv <= 256:
                return (f"BlockMask block_size {problem.block_size}: the kernels need "
                        f"block_q={fwd.BLOCK_Q} and block_kv a multiple of 64 up to 256")
            smem = self._smem(problem, self._config(problem, causal=False))
            if smem > SMEM_LIMIT:
                smaller = problem.with_block_size((block_q, 64))
                hint = (" (a BlockMask with block_kv=64 fits)" if block_kv > 64
                        and self._smem(smaller, self._config(smaller, causal=False))
                        <= SMEM_LIMIT else "")
                return (f"BlockMask block_kv={block_kv} with head_dim={problem.head_dim}, "
                        f"head_dim_v={problem.head_dim_v} needs {smem} bytes of shared "
                        f"memory, over the {SMEM_LIMIT} the kernels may use{hint}")
        return score_mod_unsupported_reason(problem)

    def backward_unsupported_reason(self, problem: AttentionProblem) -> str | None:
        reason = self.unsupported_reason(problem)
        if reason is None:
            config = self._backward_config(problem)
            reason = config if isinstance(config, str) else None
        return reason

    def trace_key(self, problem: AttentionProblem) -> Hashable:
        # The configs also depend on the mask's walk lengths: short or not (the forward),
        # long enough for the fused dQ or not (the backward). Those are the mask's: of its
        # arrays (a static mask is a static argument) or its walk_hint (aux data of a
        # traced one), so they are part of the jit's key already.
        forward = tuple(self._config(problem, causal, mean_walk)
                        for causal in (False, True) for mean_walk in (None, 0.0))
        return forward, self._backward_config(problem), runtime.interpret_requested()

    def block_size(self, problem: AttentionProblem) -> tuple[int, int]:
        config = self._config(problem, causal=False)
        return config.block_q, config.block_kv

    def forward(self, problem, q, k, v, block_mask: BlockMask, sinks, captured):
        kmask, layout = kernel_mask(block_mask)
        causal = includes_causal(block_mask.mask_mod)
        walk = walk_statistics(kmask)
        out, lse = fwd.attention_forward(
            q, k, v, kmask, layout, scale=problem.scale, softcap=problem.softcap,
            score_mod=problem.score_mod, has_partial=problem.has_user_mask,
            config=self._config(problem, causal, None if walk is None else walk.mean_kv_blocks),
            captured=captured, interpret_params=interpret_params())
        if sinks is None:
            return out, lse
        return fold_sinks(out, lse, sinks)

    def backward(self, problem, q, k, v, block_mask, sinks, captured, out, lse, dout, dlse):
        config = self._backward_config(problem)
        if isinstance(config, str):
            raise NotImplementedError(config)
        kmask, layout = kernel_mask(block_mask)
        walk = walk_statistics(kmask)
        dq, dk, dv, delta = bwd.attention_backward(
            q, k, v, kmask, layout, out, lse, dout, dlse, scale=problem.scale,
            softcap=problem.softcap, score_mod=problem.score_mod,
            has_partial=problem.has_user_mask, config=config, captured=captured,
            mean_full_walk=None if walk is None else walk.mean_full_q_blocks,
            interpret_params=interpret_params())
        dsinks = None if sinks is None else sinks_cotangent(sinks, lse, delta)
        return dq, dk, dv, dsinks, xla.captured_cotangents(
            problem, q, k, v, block_mask, sinks, captured, out, lse, dout, dlse)

    def _backward_config(self, problem: AttentionProblem) -> bwd.BackwardConfig | str:
        """The backward kernels' config for ``problem``, or why they cannot serve it."""
        dims = fwd.padded_head_dims(problem.head_dim, problem.head_dim_v)
        config = bwd.backward_config(*dims, problem.dtype, causal=False)
        if config is None:
            return (f"head_dim={problem.head_dim}, head_dim_v={problem.head_dim_v} (padded "
                    f"to {dims}) has no backward config")
        block_kv = (problem.block_size or self.block_size(problem))[1]
        if block_kv not in bwd.SUPPORTED_BLOCK_KV:
            return (f"BlockMask block_kv={block_kv}: the Mosaic backward takes "
                    f"{' or '.join(map(str, bwd.SUPPORTED_BLOCK_KV))} (one dK/dV consumer "
                    f"warpgroup per 64 kv rows)")
        config = bwd.fit_config(dataclasses.replace(config, block_kv=block_kv), SMEM_LIMIT,
                                *dims, np.dtype(problem.dtype).itemsize,
                                problem.has_user_mask)
        if config is None:
            return f"block_kv={block_kv} with head dims {dims} exceeds shared memory"
        return score_mod_unsupported_reason(problem, derivative=True) or config

    @staticmethod
    def _config(problem: AttentionProblem, causal: bool,
                mean_walk: float | None = None) -> fwd.ForwardConfig:
        """The forward's config, with the kv splits of ``problem``'s size."""
        config = fwd.forward_config(max(problem.head_dim, problem.head_dim_v), problem.dtype,
                                    causal, mean_walk)
        if problem.block_size is not None and problem.block_size[1] != config.block_kv:
            config = dataclasses.replace(config, block_kv=problem.block_size[1])
        num_q_blocks = -(-problem.q_len // config.block_q)
        walk = (-(-problem.kv_len // config.block_kv) if mean_walk is None
                else mean_walk)  # a traced mask: at most every kv-block
        splits = kv_splits.num_splits(problem.batch * problem.num_q_heads * num_q_blocks, walk,
                                      runtime.num_sms())
        if splits > 1:
            config = dataclasses.replace(config, kv_splits=splits, q_blocks_per_cta=1)
        return config

    @staticmethod
    def _smem(problem: AttentionProblem, config: fwd.ForwardConfig) -> int:
        return fwd.smem_bytes(config, *fwd.padded_head_dims(problem.head_dim,
                                                            problem.head_dim_v),
                              np.dtype(problem.dtype).itemsize, problem.has_user_mask)


def interpret_params():
    """The Mosaic-GPU interpreter's parameters when interpreting (TMA bounds as on
    hardware), else None."""
    params = runtime.mosaic_interpret_params()
    return None if params is None else compat.tma_faithful_interpret_params(params)
