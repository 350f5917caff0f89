"""The Mosaic-GPU attention kernels lower for CUDA on any machine (no GPU needed).

Lowering runs the whole Pallas -> Mosaic-GPU translation (layouts, TMA
descriptors, smem budget), which the interpreter skips: what fails here would
fail on the H100 before the first launch.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omni_jax
from omni_jax.flax.cache import decode_mask
from pallas_kernels import compat, runtime
from tests.forced_configs import force_config_fields, record_configs

_MASK_CACHE = {}
_SLOPES = 2.0 ** -jnp.arange(1, 5, dtype=jnp.float32)
_TABLE = jnp.arange(8, dtype=jnp.bfloat16).reshape(2, 4) / 8
_TEMPERATURE = jnp.float32(0.9)


def _generic_mask(length, block_kv, heads=None):
    """A stored-tile mask, the same for every head or (``heads``) one per head."""
    key = (length, block_kv, heads)
    if key not in _MASK_CACHE:
        _MASK_CACHE[key] = omni_jax.create_block_mask(
            lambda b, h, i, j: (i * 7 + j * 3 + h) % 5 != 0, None, heads, length, length,
            (128, block_kv))
    return _MASK_CACHE[key]


VARIANTS = {
    "causal_ragged_hd64": dict(shape=(1, 300, 2, 64), kv_heads=1, is_causal=True),
    "documents_window_hd128": dict(shape=(2, 200, 2, 128), kv_heads=2,
                                   q_segment_ids=jnp.zeros((2, 200), jnp.int32),
                                   local_window_size=(30, 0)),
    "window_ragged_hd128": dict(shape=(2, 300, 4, 128), kv_heads=2, local_window_size=(100, 0)),
    "partial_tiles_hd128": dict(shape=(1, 300, 2, 128), kv_heads=2, mask=128),
    # Index tiles are built only where read (`tile_indices`): here neither the mask (segment
    # ids, kv a whole number of blocks) nor the score_mod reads them.
    "documents_score_mod_without_indices": dict(
        shape=(1, 256, 2, 128), kv_heads=1,
        q_segment_ids=(jnp.arange(256, dtype=jnp.int32) >= 100).astype(jnp.int32)[None],
        score_mod=lambda s, b, h, i, j: s * 0.5),
    "partial_tiles_block_kv_64": dict(shape=(1, 300, 2, 64), kv_heads=1, mask=64),
    # Per-head tiles under GQA: a dK/dV CTA walks the mask of each head of its group.
    "partial_tiles_per_head_gqa": dict(shape=(1, 300, 4, 64), kv_heads=2, mask=128,
                                       mask_heads=4),
    "softcap_score_mod_sinks_fp16": dict(
        shape=(1, 256, 2, 128), kv_heads=1, dtype=jnp.float16, softcap=5.0,
        score_mod=lambda s, b, h, i, j: s - 0.1 * jnp.abs(i - j),
        sinks=jnp.zeros((2,), jnp.float32)),
    # Head dim 96 (and 80, served at 96): smem rows of 192 bytes take the 64-byte swizzle.
    "causal_ragged_hd96_value_dim_64": dict(shape=(1, 300, 2, 96), kv_heads=1, head_dim_v=64,
                                            is_causal=True),
    "dense_hd96": dict(shape=(1, 256, 2, 96), kv_heads=1),
    # Head dim 80 (served at 96) under the value head dim's config (128).
    "dense_hd80_value_dim_128": dict(shape=(1, 256, 2, 80), kv_heads=1, head_dim_v=128),
    # The same with one dK/dV consumer (kv blocks of 64): a fused dQ there reads dS^T
    # beside K, both in K's 64-byte swizzle.
    "partial_tiles_hd80_value_dim_128_block_kv_64": dict(shape=(1, 256, 2, 80), kv_heads=1,
                                                          head_dim_v=128, mask=64),
    # DeepSeek's head dims (query-key 192, value 128): no padding to 256; dK and dV in one
    # launch (both fit a consumer's registers).
    "hd192_value_dim_128": dict(shape=(1, 256, 2, 192), kv_heads=1, head_dim_v=128,
                                is_causal=True),
    # 192 beside 256 pads to 256 (`padded_head_dims`): with a separate O buffer the
    # stored tiles' kv blocks of 64 would not fit shared memory.
    "hd192_value_dim_256_stored_tiles": dict(shape=(1, 256, 2, 192), kv_heads=1,
                                             head_dim_v=256, mask=64),
    "hd256_value_dim_64": dict(shape=(1, 256, 2, 256), kv_heads=1, head_dim_v=64,
                               is_causal=True),
    # Head dim 64, pipelined (not causal): QK^T takes Q from registers (`q_in_registers`;
    # `causal_ragged_hd64` covers the serial schedule's).
    "dense_hd64_q_in_registers": dict(shape=(1, 256, 2, 64), kv_heads=2),
    # 128 kv-blocks a head, more than half of an H100's SMs: the ordered dQ in two groups.
    "dense_long_hd64": dict(shape=(1, 16384, 2, 64), kv_heads=1),
    # Long walks under a causal mask: the backward's fused dQ, the FULL steps in one
    # launch, the masked steps in a second.
    "long_walk": dict(shape=(1, 16384, 1, 128), kv_heads=1, is_causal=True),
    # No masked tile at head dim 128: the dK/dV kernel computes dQ too (a ref inside).
    "dense_fused_dq_hd128": dict(shape=(1, 256, 2, 128), kv_heads=1),
    # Captured arrays read by element from smem: ALiBi slopes by head, a bf16 table by
    # (batch, head) and a 0-d temperature.
    "captured_arrays_hd64": dict(
        shape=(2, 200, 4, 64), kv_heads=2, is_causal=True,
        score_mod=lambda s, b, h, i, j: (s - _SLOPES[h] * (i - j) + _TABLE[b, h]) * _TEMPERATURE),
    # A decoding step of 3 queries per sequence over a cache of 4096 (`q_len`), GQA:
    # packed, 4 heads of a group per query (`omni_jax.query_groups`), the cache mask
    # computed in the kernels from query rows divided by the group; 4 CTAs walk 24.5
    # kv-blocks on average, in 3 splits (`ForwardConfig.kv_splits`).
    "decode_step_gqa_hd128": dict(shape=(2, 4096, 8, 128), kv_heads=2, q_len=3,
                                  decode_offsets=(2000, 4090)),
}


BACKWARD_VARIANTS = sorted(VARIANTS)


def _arguments(name):
    kwargs = dict(VARIANTS[name])
    batch, length, heads, head_dim = kwargs.pop("shape")
    kv_heads = kwargs.pop("kv_heads")
    dtype = kwargs.pop("dtype", jnp.bfloat16)
    head_dim_v = kwargs.pop("head_dim_v", head_dim)
    q_len = kwargs.pop("q_len", length)
    if "mask" in kwargs:
        kwargs["mask"] = _generic_mask(length, kwargs.pop("mask"), kwargs.pop("mask_heads", None))
    if "decode_offsets" in kwargs:
        offsets = jnp.asarray(kwargs.pop("decode_offsets"), jnp.int32)
        kwargs["mask"] = decode_mask(offsets, q_len, length)
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), dtype)
    k = jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), dtype)
    v = jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim_v), dtype)
    return (q, k, v), kwargs


@pytest.fixture
def _compiled_mosaic(monkeypatch):
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    monkeypatch.setattr(runtime, "can_run_mosaic_hopper", lambda: True)


@pytest.fixture
def _compiled_mosaic_sm100(monkeypatch):
    """Lowering as on a Blackwell GPU: the backend picks the sm100 forward, and Mosaic
    stamps sm100 on the module and takes its arch-specific paths."""
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    monkeypatch.setattr(runtime, "can_run_mosaic_hopper", lambda: False)
    monkeypatch.setattr(runtime, "can_run_mosaic_blackwell", lambda: True)
    with compat.mosaic_lowering_arch(10, 0):
        yield


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_sm100_forward_lowers_for_cuda(name, _compiled_mosaic_sm100, monkeypatch):
    """The sm100 forward (tcgen05, tensor memory) lowers for every variant: layout
    inference and every op's lowering, which the interpreter skips."""
    from pallas_kernels.mosaic import attention_fwd_sm100 as fwd100

    configs = record_configs(monkeypatch, fwd100, "attention_forward")
    (q, k, v), kwargs = _arguments(name)

    def run(q, k, v):
        return omni_jax.attention(q, k, v, implementation="mosaic", return_lse=True, **kwargs)

    text = jax.jit(run).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and configs


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forward_lowers_for_cuda(name, _compiled_mosaic):
    (q, k, v), kwargs = _arguments(name)

    def run(q, k, v):
        return omni_jax.attention(q, k, v, implementation="mosaic", return_lse=True, **kwargs)

    text = jax.jit(run).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _lowered_backward(name, deterministic: bool = True) -> str:
    (q, k, v), kwargs = _arguments(name)

    def loss(q, k, v):
        out, lse = omni_jax.attention(q, k, v, implementation="mosaic", return_lse=True,
                                      deterministic=deterministic, **kwargs)
        return out.astype(jnp.float32).sum() + lse.sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))
    return jax.jit(grads).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name", BACKWARD_VARIANTS)
def test_backward_lowers_for_cuda(name, _compiled_mosaic):
    """Forward and both backward kernels (dK/dV, dQ) lower; no Triton kernel is involved."""
    text = _lowered_backward(name)
    assert text.count("mosaic_gpu") >= 3 and "triton" not in text


@pytest.mark.parametrize("name,fields,launches,fused", [
    ("dense_fused_dq_hd128", {}, 2, True),  # the forward, the dK/dV kernel adding dQ
    # The fused step's serial order and its unfolded scale (`BackwardConfig.overlapped_step`,
    # `fold_scale`), kept for A/B runs.
    ("dense_fused_dq_hd128", {"overlapped_step": False}, 2, True),
    ("long_walk", {"fold_scale": False}, 3, True),
    # The fused dQ's reductions issued by each consumer (`BackwardConfig.dq_reducer_warp`).
    ("dense_fused_dq_hd128", {"dq_reducer_warp": False}, 2, True),
    ("long_walk", {"dq_reducer_warp": False}, 3, True),
    ("dense_hd64_q_in_registers", {"dq_reducer_warp": False}, 2, True),
    # dS^T published by a commit of its own (`one_commit_a_step`).
    ("dense_fused_dq_hd128", {"one_commit_a_step": False}, 2, True),
    # The serial order with dQ issued beside dV and dK (`serial_dq_with_dkdv`).
    ("dense_fused_dq_hd128", {"overlapped_step": False, "serial_dq_with_dkdv": True}, 2, True),
    ("long_walk", {"overlapped_step": False, "serial_dq_with_dkdv": True}, 3, True),
    # Head dim 128's fused step on q-major score tiles (the default) with softcap and
    # score_mod, and on transposed ones (`BackwardConfig.q_major_scores`): dense, and the
    # masked steps' launch under causal and window masks.
    ("softcap_score_mod_sinks_fp16", {}, 2, True),
    ("dense_fused_dq_hd128", {"q_major_scores": False}, 2, True),
    ("long_walk", {"q_major_scores": False}, 3, True),
    ("window_ragged_hd128", {"q_major_scores": False, "fused_dq_min_full_walk": 0.0}, 3, True),
    ("window_ragged_hd128", {}, 3, False),  # short walks: the forward, dK/dV, dQ
    ("long_walk", {}, 3, True),  # the forward, fused launches for FULL and masked steps
    # The split at any walk length: stored tiles, and a ragged window under GQA.
    ("partial_tiles_hd128", {"fused_dq_min_full_walk": 0.0}, 3, True),
    ("window_ragged_hd128", {"fused_dq_min_full_walk": 0.0}, 3, True),
    # Query-key head dims 64 and 96 take the dQ kernel under a config with the fused dQ
    # (128's: head dim 96, or a value head dim of 128): their dQ columns do not split
    # between two consumers (`fused_dq_splits`). One consumer adds all of them.
    ("dense_hd96", {}, 3, False),
    ("dense_hd80_value_dim_128", {}, 3, False),
    ("partial_tiles_hd80_value_dim_128_block_kv_64", {"fused_dq_min_full_walk": 0.0}, 3, True),
    # Head dim 64 walks whole q-blocks, its fused dQ split by rows: dense in one launch,
    # stored tiles under GQA split in two; short causal walks keep the dQ kernel, and so
    # do 64-row steps (the dQ columns do not split).
    ("dense_hd64_q_in_registers", {}, 2, True),
    ("partial_tiles_per_head_gqa", {"fused_dq_min_full_walk": 0.0}, 3, True),
    ("causal_ragged_hd64", {}, 3, False),
    ("dense_hd64_q_in_registers", {"q_step": 64}, 3, False),
    # Above head dim 128: the forward, one dK/dV launch (paired consumers:
    # `paired_consumers`) and the dQ kernel; unpaired, dK and dV by launches of their own
    # (`split_dkdv`) where together they exceed a consumer's registers, else by one.
    ("hd192_value_dim_256_stored_tiles", {}, 3, False),
    ("hd192_value_dim_256_stored_tiles", {"paired_consumers": False}, 4, False),
    ("hd256_value_dim_64", {}, 3, False),
    ("hd256_value_dim_64", {"paired_consumers": False}, 3, False),
    ("hd192_value_dim_128", {}, 3, False),
])
def test_backward_launches(name, fields, launches, fused, _compiled_mosaic, monkeypatch):
    """Which kernels a gradient with ``deterministic=False`` launches, by its head dim,
    its mask's walks and the backward's config (``fields`` replaced); ``fused``: whether
    dQ comes from the dK/dV kernel."""
    launched, chosen = _launches(name, fields, False, monkeypatch)
    assert (launched, bool(chosen)) == (launches, fused)


@pytest.mark.parametrize("name,fields,launches", [
    # Head dim 64 without masked tiles: the ordered fused dQ (`ordered_dq`) in one launch,
    # the kv-blocks of long walks in groups (`ordered_dq_group`).
    ("dense_hd64_q_in_registers", {}, 2),
    ("dense_long_hd64", {}, 2),
    ("dense_long_hd64", {"ordered_dq_max_groups": 1}, 3),  # more groups than sums allowed
    # Head dim 128 and masked tiles: the dQ kernel.
    ("dense_fused_dq_hd128", {}, 3),
    ("causal_ragged_hd64", {"fused_dq_min_full_walk": 0.0}, 3),
    # The ordered fused dQ forced at 128 lowers too; it orders the reducer warp's adds,
    # so without that warp the dQ kernel serves.
    ("dense_fused_dq_hd128", {"ordered_dq": True}, 2),
    ("dense_hd64_q_in_registers", {"dq_reducer_warp": False}, 3),
])
def test_deterministic_backward_never_adds_atomically(name, fields, launches,
                                                      _compiled_mosaic, monkeypatch):
    """By default (deterministic) no launch adds dQ by atomic reduce-adds: either the
    fused dQ orders its adds, or the dK/dV kernel and the dQ kernel serve."""
    launched, chosen = _launches(name, fields, True, monkeypatch)
    assert launched == launches
    assert all(config.ordered_dq for configs in chosen for config in configs)
    assert bool(chosen) == (launches == 2)


def test_ordered_dq_groups_sum_apart(_compiled_mosaic, monkeypatch):
    """Past half of the SMs a head's kv-blocks order their dQ adds in groups, each into a
    float32 sum of its own ([groups, batch, q, heads, head dim]), added afterwards."""
    from pallas_kernels.mosaic import attention_bwd_sm90 as bwd

    monkeypatch.setattr(runtime, "num_sms", lambda: 132)
    assert bwd.ordered_dq_group(128) == 64
    text = _lowered_backward("dense_long_hd64")
    assert "tensor<2x1x16384x2x64xf32>" in text


def _launches(name, fields, deterministic, monkeypatch) -> tuple[int, list]:
    """(Mosaic launches, the fused dQ's configs chosen) of ``name``'s gradient."""
    from pallas_kernels.mosaic import attention_bwd_sm90 as bwd

    force_config_fields(monkeypatch, bwd, "backward_config", **fields)
    chosen = []
    fused_configs = bwd._fused_configs
    monkeypatch.setattr(bwd, "_fused_configs",
                        lambda *args: chosen.append(fused_configs(*args)) or chosen[-1])
    jax.clear_caches()  # an earlier test's trace of the same call would skip the choice
    kernels = re.findall(r"custom_call @(\w+)", _lowered_backward(name, deterministic))
    assert set(kernels) == {"mosaic_gpu_v2"}, kernels
    return len(kernels), [[c for c in configs if c is not None]
                          for configs in chosen if configs is not None]


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(head_dim=st.integers(1, 256), head_dim_v=st.integers(1, 256),
       mask=st.sampled_from([None, "causal", 64, 128]), backward=st.booleans())
def test_any_head_dims_lower_or_decline(head_dim, head_dim_v, mask, backward,
                                        _compiled_mosaic):
    """Any pair of head dims up to 256, under any mask, either lowers (shared-memory
    budget included) or is declined at trace time for its shared memory: never a kernel
    that fails to build on the GPU (192 beside 256 did, 2026-11-27)."""
    kwargs = {"is_causal": True} if mask == "causal" else {}
    if isinstance(mask, int):
        kwargs["mask"] = _generic_mask(256, mask)
    q = jax.ShapeDtypeStruct((1, 256, 2, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, 1, head_dim), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 256, 1, head_dim_v), jnp.bfloat16)

    def forward(q, k, v):
        return omni_jax.attention(q, k, v, implementation="mosaic", **kwargs)

    fn = (jax.grad(lambda *a: forward(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
          if backward else forward)
    try:
        text = jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    except ValueError as error:
        assert "bytes of shared memory" in str(error), str(error)
        return
    assert "mosaic_gpu" in text


def test_a_variant_lowers_the_register_q_path():
    """`dense_hd64_q_in_registers` covers QK^T with Q from registers (the interpreter never
    takes it)."""
    from pallas_kernels.mosaic import attention_fwd_sm90 as fwd

    assert fwd.forward_config(64, jnp.bfloat16, causal=False).q_in_registers
    assert fwd.forward_config(64, jnp.bfloat16, causal=True).q_in_registers


@pytest.mark.parametrize("kv_len,consumers", [
    (256, 3),  # dense: CTAs of three consumers (192 rows)
    (300, 2),  # the ragged kv-block is COMPUTED: two consumers, as before
])
def test_dense_head_dim_64_lowers_with_its_consumer_count(kv_len, consumers, _compiled_mosaic,
                                                          monkeypatch):
    """The dense head-dim-64 forward (pipelined, staggered, Q in registers) lowers with
    three consumers, and with two where it falls back."""
    from pallas_kernels.mosaic import attention_fwd_sm90 as fwd

    configs = record_configs(monkeypatch, fwd, "attention_forward")
    q = jax.ShapeDtypeStruct((2, 320, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, kv_len, 2, 64), jnp.bfloat16)

    def run(q, k, v):
        return omni_jax.attention(q, k, v, implementation="mosaic", return_lse=True)

    text = jax.jit(run).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and [c.num_consumers for c in configs] == [consumers]


@pytest.mark.parametrize("head_dim,page_size,q_len,heads,kwargs", [
    (64, 16, 1, 8, {}),  # pages of 16: eight TMAs fill a K (V) tile of 128 rows
    (128, 64, 4, 4, dict(local_window_size=(100, 0))),  # two TMAs per tile
    (128, 128, 1, 4, dict(softcap=5.0)),  # one TMA per tile
    (256, 128, 2, 3, dict(is_causal=False)),  # tiles of 64 rows inside one page
])
def test_paged_forward_lowers_for_cuda(head_dim, page_size, q_len, heads, kwargs,
                                       _compiled_mosaic):
    """The paged forward (`omni_jax.paged_attention`'s "mosaic"), a decoding batch over a
    cache of 8192 tokens per sequence: TMA copies per page, the page table row in smem."""
    pages_per_seq = 8192 // page_size
    q = jax.ShapeDtypeStruct((2, q_len, heads, head_dim), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((2 * pages_per_seq, page_size, 1, head_dim), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, pages_per_seq), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)

    def run(q, k, v, table, lens):
        return omni_jax.paged_attention(q, k, v, table, lens, implementation="mosaic",
                                        return_lse=True, **kwargs)

    lowered = jax.jit(run).trace(q, pages, pages, table, lens).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
