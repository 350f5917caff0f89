"""The Pallas Mosaic-GPU backend: warp-specialized, TMA-pipelined kernels for Hopper and
Blackwell.

Runs on sm90 GPUs (wgmma kernels) and sm100 GPUs (the tcgen05/tensor-memory kernels,
`attention_fwd_sm100`, `attention_bwd_sm100`), or anywhere under
``OMNI_JAX_PALLAS_INTERPRET=1`` (``=sm100``) through the Mosaic-GPU interpreter (race
detection on; TMA bounds as on hardware). On sm100 the forward serves BlockMasks with
``block_kv`` 64 or 128, without kv splits; the backward ``block_kv`` 128 (the forward's
tile up to head dim 128); each configuration checks itself on first use on a real sm100
GPU (`omni_jax.first_use_check`), where no kernel of ours had run before.

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
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from omni_jax import first_use_check
from omni_jax.backends import xla
from omni_jax.backends.base import AttentionBackend
from omni_jax.dispatch_log import warn_slow_fallback
from omni_jax.masks import BlockMask, causal_mask, create_block_mask
from omni_jax.masks.mask_mods import includes_causal
from omni_jax.problem import AttentionProblem
from omni_jax.scores import primitive_names
from pallas_kernels import compat, kv_splits, runtime
from pallas_kernels.block_sparse import kernel_mask, walk_statistics
from pallas_kernels.captured import PackedCaptured, scalar_reads_reason, score_mod_on_packed
from pallas_kernels.mosaic import attention_bwd_sm90 as bwd
from pallas_kernels.mosaic import attention_bwd_sm100 as bwd100
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd
from pallas_kernels.mosaic import attention_fwd_sm100 as fwd100
from pallas_kernels.mosaic import attention_sm90_common as common
from pallas_kernels.mosaic.attention_sm90_common import SMEM_LIMIT
from pallas_kernels.softmax import fold_sinks, sinks_cotangent

_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# The most memory a deterministic sm100 backward's per-kv-block dQ sums may take; above
# it the next backend serves the backward (deterministic=False takes the kernel).
DETERMINISTIC_DQ_BYTES = 2**30
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
    """Pallas Mosaic-GPU kernels for Hopper (sm90) and Blackwell (sm100, forward only)."""

    name = "mosaic"

    def unavailable_reason(self) -> str | None:
        if runtime.mosaic_architecture() is not None:
            return None
        return ("the Mosaic-GPU kernels need an sm90 (Hopper) or sm100 (Blackwell) GPU, or "
                f"{runtime.INTERPRET_ENV_VAR}=1 (=sm100) for the interpreter")

    def unsupported_reason(self, problem: AttentionProblem) -> str | None:
        if np.dtype(problem.dtype) not in _DTYPES:
            return f"dtype {np.dtype(problem.dtype).name} (the kernels take bfloat16 or float16)"
        for name, dim in (("head_dim", problem.head_dim), ("head_dim_v", problem.head_dim_v)):
            if fwd.padded_head_dim(dim) is None:
                return f"{name}={dim} (at most {fwd.SUPPORTED_HEAD_DIMS[-1]})"
        if problem.block_size is not None:
            block_q, block_kv = problem.block_size
            if _blackwell() and (block_q, block_kv) not in ((fwd.BLOCK_Q, 64),
                                                            (fwd.BLOCK_Q, 128)):
                return (f"BlockMask block_size {problem.block_size}: the sm100 forward "
                        f"needs block_q={fwd.BLOCK_Q} and block_kv 64 or 128")
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
        if reason := score_mod_unsupported_reason(problem):
            return reason
        if reason := self._walk_reason(problem):
            return reason
        return (_first_use_reason("forward", problem, self._config(problem, causal=True))
                if _blackwell() else None)

    def _walk_reason(self, problem: AttentionProblem) -> str | None:
        """Why the forward's walk rows (held whole in shared memory, beside the tiles) do
        not fit: sequences of about 300k keys and more at head dim 128."""
        block_size = problem.block_size or self.block_size(problem)
        _, num_kv_blocks = _num_blocks(problem, block_size)
        for causal in (False, True):
            smem = self._smem(problem, self._config(problem.with_block_size(block_size), causal),
                              walk_blocks=num_kv_blocks)
            if smem > SMEM_LIMIT:
                return (f"kv_len={problem.kv_len}: the forward's walks over {num_kv_blocks} "
                        f"kv-blocks take {smem} bytes of shared memory with its tiles, "
                        f"over {SMEM_LIMIT} ({_SEQUENCE_LIMIT_HINT})")
        return None

    def backward_unsupported_reason(self, problem: AttentionProblem) -> str | None:
        reason = self.unsupported_reason(problem)
        if reason is None:
            config = self._backward_config(problem)
            reason = config if isinstance(config, str) else None
        if reason is None and _blackwell():
            reason = _first_use_reason("backward", problem, config)
        return reason

    def trace_key(self, problem: AttentionProblem) -> Hashable:
        # The configs also depend on the mask's walks: short or not and uniform or not (the
        # forward), long enough for the fused dQ or not (the backward). Those are the
        # mask's: of its arrays (a static mask is a static argument) or its walk_hint (aux
        # data of a traced one), so they are part of the jit's key already; the key holds
        # each case's config, so that configs forced for an A/B run trace afresh.
        forward = tuple(self._config(problem, causal, mean_walk, uniform_walks)
                        for causal in (False, True) for mean_walk in (None, 0.0)
                        for uniform_walks in (False, True))
        return (forward, self._backward_config(problem), runtime.interpret_requested(),
                runtime.mosaic_architecture())

    def block_size(self, problem: AttentionProblem) -> tuple[int, int]:
        config = self._config(problem, causal=False)
        return config.block_q, config.block_kv

    def forward(self, problem, q, k, v, block_mask: BlockMask, sinks, captured):
        if _blackwell() and compat.varying_axes(q, k, v):
            # The sm100 forward's warp-specialized map takes the kernel's refs, which jax
            # rejects where they vary along mesh axes (inside a shard_map).
            warn_slow_fallback(
                "omni_jax.attention runs its forward on the XLA backend inside "
                "jax.shard_map on a Blackwell GPU: the sm100 forward's warp map cannot "
                "take refs that vary along mesh axes. Outside a shard_map it runs the "
                "kernel.")
            return xla.XlaBackend().forward(problem, q, k, v, block_mask, sinks, captured)
        kmask, layout = kernel_mask(block_mask)
        causal = includes_causal(block_mask.mask_mod)
        walk = walk_statistics(kmask)
        uniform_walks = not _blackwell() and fwd.uniform_full_walks(kmask, layout,
                                                                     problem.has_user_mask)
        out, lse = _forward_module().attention_forward(
            q, k, v, kmask, layout, scale=problem.scale, softcap=problem.softcap,
            score_mod=problem.score_mod, has_partial=problem.has_user_mask,
            config=self._config(problem, causal, None if walk is None else walk.mean_kv_blocks,
                                uniform_walks),
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
        dq, dk, dv, delta = _backward_module().attention_backward(
            q, k, v, kmask, layout, out, lse, dout, dlse, scale=problem.scale,
            softcap=problem.softcap, score_mod=problem.score_mod,
            has_partial=problem.has_user_mask, config=config, captured=captured,
            mean_full_walk=None if walk is None else walk.mean_full_q_blocks,
            interpret_params=interpret_params())
        dsinks = None if sinks is None else sinks_cotangent(sinks, lse, delta)
        return dq, dk, dv, dsinks, xla.captured_cotangents(
            problem, q, k, v, block_mask, sinks, captured, out, lse, dout, dlse)

    def _backward_config(self, problem: AttentionProblem
                         ) -> bwd.BackwardConfig | bwd100.BackwardConfig | str:
        """The backward kernels' config for ``problem``, or why they cannot serve it."""
        if _blackwell():
            return self._sm100_backward_config(problem)
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
        # The fused dQ's reduce-adds are atomic. Deterministic, they go in a fixed order
        # where that beats the dQ kernel (the config's ``ordered_dq``) and the kernels can
        # order them (`bwd.orders_dq`); elsewhere the dQ kernel serves.
        num_q_blocks, num_kv_blocks = _num_blocks(problem, (fwd.BLOCK_Q, block_kv))
        walks = bwd.walk_bytes(num_q_blocks, num_kv_blocks, _walk_heads(problem))
        ordered = problem.deterministic and config.ordered_dq
        config = bwd.fit_config(dataclasses.replace(
            config.with_block_kv(block_kv), ordered_dq=ordered,
            fused_dq=config.fused_dq and (ordered or not problem.deterministic)),
            SMEM_LIMIT, *dims, np.dtype(problem.dtype).itemsize, problem.has_user_mask,
            walk_bytes=walks)
        if config is None:
            return (f"block_kv={block_kv} with head dims {dims} and walks over "
                    f"{num_q_blocks} q-blocks / {num_kv_blocks} kv-blocks (held in shared "
                    f"memory: {_SEQUENCE_LIMIT_HINT}) exceeds shared memory")
        return score_mod_unsupported_reason(problem, derivative=True) or config

    def _sm100_backward_config(self, problem: AttentionProblem
                               ) -> bwd100.BackwardConfig | str:
        dims = tuple(map(bwd100.kernel_head_dim, (problem.head_dim, problem.head_dim_v)))
        config = bwd100.backward_config(problem.head_dim, problem.head_dim_v, problem.dtype,
                                        causal=False)
        if config is None:
            return (f"head_dim={problem.head_dim}, head_dim_v={problem.head_dim_v}: the sm100 "
                    f"backward takes head dims up to {bwd100.KERNEL_HEAD_DIMS[-1]}")
        block_kv = (problem.block_size or self.block_size(problem))[1]
        if block_kv != bwd100.BLOCK_KV:
            return (f"BlockMask block_kv={block_kv}: the sm100 backward takes "
                    f"{bwd100.BLOCK_KV} (a kv row per tensor-memory lane)")
        # Deterministic: a float32 dQ sum per kv-block, added in a fixed order afterwards;
        # else one sum that TMA reduce-adds (atomic) add to.
        if problem.deterministic:
            sums = bwd100.deterministic_dq_bytes(problem.batch, problem.q_len, problem.kv_len,
                                                 problem.num_q_heads, problem.head_dim)
            if sums > DETERMINISTIC_DQ_BYTES:
                return (f"deterministic=True: the sm100 backward's per-kv-block dQ sums "
                        f"would take {sums / 2**30:.1f} GiB (at most "
                        f"{DETERMINISTIC_DQ_BYTES / 2**30:.0f}); deterministic=False sums "
                        f"dQ by atomic reduce-adds")
        num_q_blocks, _ = _num_blocks(problem, (fwd.BLOCK_Q, block_kv))
        config = bwd100.fit_config(
            dataclasses.replace(config, deterministic=problem.deterministic), SMEM_LIMIT,
            *dims, np.dtype(problem.dtype).itemsize, problem.has_user_mask,
            walk_bytes=_walk_heads(problem) * common.walk_row_bytes(num_q_blocks))
        if config is None:
            return (f"head dims {dims} and walks over {num_q_blocks} q-blocks (held in "
                    f"shared memory: {_SEQUENCE_LIMIT_HINT}) exceed the sm100 backward's "
                    f"shared memory")
        return score_mod_unsupported_reason(problem, derivative=True) or config

    @staticmethod
    def _config(problem: AttentionProblem, causal: bool, mean_walk: float | None = None,
                uniform_walks: bool = False) -> fwd.ForwardConfig | fwd100.ForwardConfig:
        """The forward's config, with the kv splits of ``problem``'s size (sm90);
        ``uniform_walks``: `fwd.uniform_full_walks` of the mask (sm90)."""
        config = _forward_module().forward_config(max(problem.head_dim, problem.head_dim_v),
                                                  problem.dtype, causal, mean_walk,
                                                  uniform_walks)
        if problem.block_size is not None and problem.block_size[1] != config.block_kv:
            config = dataclasses.replace(config, block_kv=problem.block_size[1])
        if _blackwell():
            return fwd100.fit_config(config, SMEM_LIMIT, *fwd.padded_head_dims(
                problem.head_dim, problem.head_dim_v), np.dtype(problem.dtype).itemsize,
                problem.has_user_mask)
        num_q_blocks = -(-problem.q_len // config.block_q)
        walk = (-(-problem.kv_len // config.block_kv) if mean_walk is None
                else mean_walk)  # a traced mask: at most every kv-block
        splits = kv_splits.num_splits(problem.batch * problem.num_q_heads * num_q_blocks, walk,
                                      runtime.num_sms())
        if splits > 1:  # (CTAs of three consumers take no splits)
            config = dataclasses.replace(config, kv_splits=splits, q_blocks_per_cta=1,
                                         num_consumers=2)
        if config.num_consumers > 2 and MosaicBackend._smem(
                problem, config, walk_blocks=-(-problem.kv_len // config.block_kv)) > SMEM_LIMIT:
            config = dataclasses.replace(config, num_consumers=2)  # their Q: 8 KiB more
        return config

    @staticmethod
    def _smem(problem: AttentionProblem, config: fwd.ForwardConfig | fwd100.ForwardConfig,
              walk_blocks: int = 0) -> int:
        return _forward_module().smem_bytes(
            config, *fwd.padded_head_dims(problem.head_dim, problem.head_dim_v),
            np.dtype(problem.dtype).itemsize, problem.has_user_mask, walk_blocks=walk_blocks)


def _first_use_reason(direction: str, problem: AttentionProblem, config) -> str | None:
    """On a Blackwell GPU, where the sm100 kernels were never executed before this
    process, why the ``direction`` ("forward" or "backward") kernel's ``config`` for
    ``problem`` is declined: checked once per configuration on a small causal problem of
    the same head dims, dtype, GQA group and softcap against the xla backend
    (`omni_jax.first_use_check`)."""
    if not first_use_check.unverified_hardware():
        return None
    key = (direction, config, problem.head_dim, problem.head_dim_v,
           np.dtype(problem.dtype).name, problem.group_size, problem.softcap)
    check = functools.partial(
        _small_causal_forward if direction == "forward" else _small_causal_backward,
        problem, config)
    return first_use_check.verified(
        key, f"the sm100 attention {direction} ({np.dtype(problem.dtype).name}, head dims "
             f"{problem.head_dim}/{problem.head_dim_v}, {config})",
        functools.partial(check, kernel=True), functools.partial(check, kernel=False))


# The first-use check's problem: two q-blocks of causal attention, one kv head.
_CHECK_LENGTH = 256


def _small_causal_forward(problem: AttentionProblem, config, *, kernel: bool):
    """(out, lse) of a small causal problem like ``problem``: by the sm100 forward with
    ``config`` (``kernel``), else by the xla backend in float32."""
    rng = np.random.default_rng(0)
    heads = problem.group_size
    shape = lambda dim, count: (1, _CHECK_LENGTH, count, dim)
    q, k, v = (jnp.asarray(rng.standard_normal(shape(dim, count)), jnp.float32)
               for dim, count in ((problem.head_dim, heads), (problem.head_dim, 1),
                                  (problem.head_dim_v, 1)))
    if not kernel:
        from omni_jax.attention import attention  # the public call imports the backends

        return attention(q, k, v, is_causal=True, scale=problem.scale,
                         softcap=problem.softcap, return_lse=True, implementation="xla")
    block_mask = create_block_mask(causal_mask, None, None, _CHECK_LENGTH, _CHECK_LENGTH,
                                   (config.block_q, config.block_kv))
    kmask, layout = kernel_mask(block_mask)
    cast = lambda x: x.astype(problem.dtype)
    return fwd100.attention_forward(
        cast(q), cast(k), cast(v), kmask, layout, scale=problem.scale,
        softcap=problem.softcap, score_mod=None, has_partial=False, config=config,
        captured=(), interpret_params=interpret_params())


def _small_causal_backward(problem: AttentionProblem, config, *, kernel: bool):
    """(dq, dk, dv) of a small causal problem like ``problem`` (`_small_causal_forward`'s),
    by the sm100 backward with ``config`` (``kernel``), else by the xla backend in
    float32; the forward's results and the output cotangent from the xla backend."""
    from omni_jax.attention import attention  # the public call imports the backends

    rng = np.random.default_rng(1)
    heads = problem.group_size
    shape = lambda dim, count: (1, _CHECK_LENGTH, count, dim)
    q, k, v, dout = (jnp.asarray(rng.standard_normal(shape(dim, count)), jnp.float32)
                     for dim, count in ((problem.head_dim, heads), (problem.head_dim, 1),
                                        (problem.head_dim_v, 1), (problem.head_dim_v, heads)))
    forward = functools.partial(attention, is_causal=True, scale=problem.scale,
                                softcap=problem.softcap, implementation="xla")
    if not kernel:
        return jax.vjp(forward, q, k, v)[1](dout)
    out, lse = forward(q, k, v, return_lse=True)
    block_mask = create_block_mask(causal_mask, None, None, _CHECK_LENGTH, _CHECK_LENGTH,
                                   (config.block_q, config.block_kv))
    kmask, layout = kernel_mask(block_mask)
    cast = lambda x: x.astype(problem.dtype)
    dq, dk, dv, _ = bwd100.attention_backward(
        cast(q), cast(k), cast(v), kmask, layout, cast(out), lse, cast(dout),
        jnp.zeros_like(lse), scale=problem.scale, softcap=problem.softcap, score_mod=None,
        has_partial=False, config=config, interpret_params=interpret_params())
    return dq, dk, dv


_SEQUENCE_LIMIT_HINT = ("the Mosaic kernels keep a block's whole walk in shared memory; "
                        "the next backend serves longer sequences, or split them with "
                        "context parallelism")


def _num_blocks(problem: AttentionProblem, block_size: tuple[int, int]) -> tuple[int, int]:
    """(q-blocks, kv-blocks) of ``problem`` tiled by ``block_size``."""
    return -(-problem.q_len // block_size[0]), -(-problem.kv_len // block_size[1])


def _walk_heads(problem: AttentionProblem) -> int:
    """Walk rows a dK/dV CTA holds: one per query head of its group when a user's mask may
    differ by head."""
    return problem.group_size if problem.has_user_mask else 1


def _blackwell() -> bool:
    """Whether the Mosaic kernels run (or are interpreted) as sm100."""
    return runtime.mosaic_architecture() == "sm100"


def _forward_module():
    """The forward kernel's module for the GPU the kernels run on."""
    return fwd100 if _blackwell() else fwd


def _backward_module():
    """The backward kernels' module for the GPU the kernels run on."""
    return bwd100 if _blackwell() else bwd


def interpret_params():
    """The Mosaic-GPU interpreter's parameters when interpreting (TMA bounds as on
    hardware), else None."""
    params = runtime.mosaic_interpret_params()
    return None if params is None else compat.tma_faithful_interpret_params(params)
