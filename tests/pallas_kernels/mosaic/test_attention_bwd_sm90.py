"""The Mosaic-GPU attention backward kernels (dK/dV, dQ) against float64 and XLA.

Run through the Mosaic-GPU interpreter (a race found fails the test). The
forward's out and lse come from the float64 reference, so only the backward
kernels run. Poisoned cases fill memory the kernels never write with NaN:
every gradient row must be written, those of blocks with nothing to walk
included (zeros). On an sm90 GPU, long sequences (many ring laps, every
tuned config) run compiled against the XLA backend.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omni_jax
from omni_jax.masks import BlockMask
from omni_jax.masks.block_mask import BlockGrid
from omni_jax.masks.construct import structured_tile_flags
from pallas_kernels import compat, runtime
from pallas_kernels.block_sparse import kernel_mask
from pallas_kernels.mosaic import attention_bwd_sm90 as bwd
from pallas_kernels.mosaic.attention_sm90_common import SMEM_LIMIT, padded_head_dims
from tests.mosaic_interpret import interpreted_mosaic
from tests.reference import dense_mask, reference_attention, relative_error

TOLERANCE = {"bfloat16": 6e-2, "float16": 1.2e-2}


@pytest.fixture
def _interpreted(monkeypatch):
    yield from interpreted_mosaic(monkeypatch)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    batch: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    block_kv: int
    # Poisoned cases need block-aligned shapes: NaN would also fill the TMA's
    # out-of-bounds reads, which hardware (and the unpoisoned interpreter) zero-fills.
    poisoned: bool
    mask: str
    softcap: float | None = None
    score_mod: bool = False
    scale: float | None = None


CASES = (
    # Per-head stored tiles under GQA (walks of 2 query heads per CTA), a q-block
    # that sees nothing and a kv-block nobody sees, more steps than ring stages.
    Case("partial_gqa_blind_blocks", "bfloat16", 1, 256, 256, 4, 2, 64, 64, 128, True,
         "partial"),
    # Documents (q and kv mask leaves) and causal; ragged q and kv, q_len != kv_len,
    # head dim 96 (64-byte swizzle) with a value head dim of 40 (padded to 64), one dK/dV
    # consumer (block_kv 64).
    Case("documents_causal_ragged", "bfloat16", 2, 100, 150, 2, 1, 96, 40, 64, False,
         "documents"),
    # Softcap and score_mod chain rule, fp16, causal (COMPUTED diagonal tiles).
    Case("softcap_score_mod_fp16", "float16", 1, 128, 128, 2, 2, 64, 64, 128, True,
         "causal", softcap=5.0, score_mod=True, scale=0.2),
    # Dense (FULL tiles only), GQA at head dim 128: the fused dQ splits its columns
    # between the two consumers, and each CTA walks two heads' steps.
    Case("dense_gqa_d128", "bfloat16", 1, 256, 256, 4, 2, 128, 128, 128, True, "dense"),
    # The wide head dims' tiles (64 kv rows, paired consumers by default): 256, and
    # DeepSeek's query-key 192 with value 128 under GQA, ragged and causal.
    Case("causal_d256", "bfloat16", 1, 256, 256, 2, 1, 256, 256, 64, True, "causal"),
    Case("causal_ragged_gqa_d192_v128", "float16", 1, 150, 200, 4, 2, 192, 128, 64, False,
         "causal"),
    # Paired consumers on stored tiles, ragged, under GQA, with the softcap and score_mod
    # slope passed from one consumer to the other.
    Case("partial_softcap_score_mod_d192", "bfloat16", 1, 200, 200, 4, 2, 192, 192, 64,
         False, "partial", softcap=5.0, score_mod=True),
    # Head dim 64's 128-row steps: dense under GQA (FULL tiles only: one fused launch),
    # and causal with ragged q and kv and a value head dim of 40 (the masked steps'
    # second launch).
    Case("dense_gqa_d64", "bfloat16", 1, 256, 256, 4, 2, 64, 64, 128, True, "dense"),
    Case("causal_ragged_d64_v40", "bfloat16", 1, 200, 250, 2, 1, 64, 40, 128, False,
         "causal"),
)
# How dK, dV and dQ are summed: one dK/dV launch and the dQ kernel (the scale folded
# into the sums or, "_scaled_ds", into dS), dQ fused into the
# dK/dV launch (in the overlapped step order, with the scale folded into the sums or
# not, or in the serial one, dQ issued after dV and dK or with them; its reductions
# issued by the producer or, "_consumer_adds", by each consumer; "_two_commits": dS^T
# published apart from the dQ stage), or dK and dV in launches
# of their own (with the dQ kernel's V-first order, as the wide head dims' config has
# it); "_q128": the dK/dV kernel walking whole q-blocks (head dim 64's steps), where the
# fused dQ splits dQ's rows; "_unseeded": the score accumulators start at zero
# (`BackwardConfig.seeded_stats`); "_dv_first": the fused step issuing dV before the
# previous step's dQ; "paired": dK and dV summed by two consumers sharing 64 kv rows;
# "_ordered": the fused dQ's adds in a fixed order (interpreted: the rotated walks and
# their add turns; no semaphores there), for walks of FULL tiles only; "_q_major": the
# fused step's score tiles q-major (`BackwardConfig.q_major_scores`; stored tiles keep
# the transposed step).
VARIANTS = {"dq_kernel": {}, "dq_kernel_scaled_ds": {"fold_scale": False},
            "fused_dq": {"fused_dq": True},
            "fused_dq_scaled_ds": {"fused_dq": True, "fold_scale": False},
            "fused_dq_serial_step": {"fused_dq": True, "overlapped_step": False},
            "fused_dq_serial_dq_with_dkdv": {"fused_dq": True, "overlapped_step": False,
                                             "serial_dq_with_dkdv": True},
            "fused_dq_two_commits": {"fused_dq": True, "one_commit_a_step": False},
            "fused_dq_consumer_adds": {"fused_dq": True, "dq_reducer_warp": False},
            "fused_dq_serial_consumer_adds": {"fused_dq": True, "overlapped_step": False,
                                              "dq_reducer_warp": False},
            "split_dkdv": {"split_dkdv": True, "dq_v_first": True},
            "paired": {"paired_consumers": True, "dq_v_first": True},
            "dq_kernel_q128": {"q_step": 128}, "fused_dq_q128": {"fused_dq": True, "q_step": 128},
            "fused_dq_q128_consumer_adds": {"fused_dq": True, "q_step": 128,
                                            "dq_reducer_warp": False},
            "unseeded": {"seeded_stats": False},
            "fused_dq_dv_first": {"fused_dq": True, "dq_before_dv": False},
            "fused_dq_q128_dv_first": {"fused_dq": True, "q_step": 128,
                                       "dq_before_dv": False},
            "fused_dq_ordered": {"fused_dq": True, "ordered_dq": True},
            "fused_dq_q128_ordered": {"fused_dq": True, "q_step": 128, "ordered_dq": True},
            "fused_dq_q_major": {"fused_dq": True, "q_major_scores": True},
            "fused_dq_q_major_consumer_adds": {"fused_dq": True, "q_major_scores": True,
                                               "dq_reducer_warp": False}}

# The variants each case runs under by default: every variant and every case at least
# once, in about a third of the product; the rest of the product (each variant on every
# case it applies to) runs under ``-m slow``.
DEFAULT_RUNS = {
    "partial_gqa_blind_blocks": ("dq_kernel", "fused_dq_q128", "unseeded"),
    "documents_causal_ragged": ("dq_kernel", "fused_dq", "fused_dq_serial_dq_with_dkdv",
                                "fused_dq_two_commits", "paired", "fused_dq_q_major"),
    "softcap_score_mod_fp16": ("dq_kernel_scaled_ds", "dq_kernel_q128",
                               "fused_dq_q128_consumer_adds"),
    "dense_gqa_d128": ("fused_dq_scaled_ds", "fused_dq_serial_step",
                       "fused_dq_serial_consumer_adds", "fused_dq_consumer_adds",
                       "fused_dq_ordered", "fused_dq_q_major",
                       "fused_dq_q_major_consumer_adds"),
    "causal_d256": ("dq_kernel", "split_dkdv"),
    "causal_ragged_gqa_d192_v128": ("paired", "fused_dq_dv_first"),
    "partial_softcap_score_mod_d192": ("paired",),
    "dense_gqa_d64": ("fused_dq_q128", "fused_dq_q128_dv_first", "fused_dq_q128_ordered"),
    "causal_ragged_d64_v40": ("dq_kernel", "fused_dq_q128_dv_first", "split_dkdv"),
}


def _declined(case: Case, variant: str) -> str | None:
    """Why ``variant``'s config does not serve ``case`` (None: it does)."""
    fields = VARIANTS[variant]
    if fields.get("paired_consumers") and case.block_kv != bwd.ROWS_PER_CONSUMER:
        return "paired consumers share kv tiles of 64 rows"
    q_step = fields.get("q_step", bwd.ROWS_PER_CONSUMER)
    head_dim = bwd.padded_head_dim(case.head_dim)
    if q_step == bwd.BLOCK_Q and (case.block_kv != 128 or head_dim > 64):
        return "128-row steps serve head dim 64 with two dK/dV consumers"
    if fields.get("ordered_dq") and case.mask != "dense":
        return "the ordered dQ serves walks of FULL tiles only"
    if fields.get("fused_dq") and not bwd.fused_dq_splits(
            head_dim, case.block_kv // bwd.ROWS_PER_CONSUMER, q_step):
        return "the fused dQ declines this head dim (the dQ kernel serves it)"
    return None


def _runs():
    for case in CASES:
        for variant in VARIANTS:
            if _declined(case, variant) is None:
                marks = [] if variant in DEFAULT_RUNS[case.name] else [pytest.mark.slow]
                yield pytest.param(case, variant, marks=marks, id=f"{case.name}-{variant}")


def test_default_runs_cover_every_variant_and_case():
    """The default runs are variants that serve their case, and cover each variant and
    each case."""
    assert set(DEFAULT_RUNS) == {case.name for case in CASES}
    for case in CASES:
        for variant in DEFAULT_RUNS[case.name]:
            assert _declined(case, variant) is None, (case.name, variant)
    assert {v for runs in DEFAULT_RUNS.values() for v in runs} == set(VARIANTS)


def _score_mod(s, b, h, i, j):
    return s - 0.05 * (h + 1) * jnp.abs(i - j).astype(s.dtype)


def _dense_block_mask(q_len: int, kv_len: int, block_size: tuple[int, int]):
    grid = BlockGrid(q_len, kv_len, *block_size)
    return BlockMask.from_tile_flags(structured_tile_flags(None, grid), mask_mod=None,
                                     q_len=q_len, kv_len=kv_len, block_size=block_size)


def _mask(case: Case, rng):
    """(mask_mod for create_block_mask, its mask heads, numpy predicate f(b, h, i, j))."""
    if case.mask == "dense":
        return None, None, lambda b, h, i, j: i >= 0
    if case.mask == "partial":
        def fn(b, h, i, j):
            return (i >= 128) & (j < 128) & ((i * 7 + j * 3 + h) % 5 != 0)

        return fn, case.heads, fn
    if case.mask == "documents":
        q_ids = np.sort(rng.integers(0, 3, (case.batch, case.q_len)), axis=-1)
        kv_ids = np.sort(rng.integers(0, 3, (case.batch, case.kv_len)), axis=-1)
        mask_mod = omni_jax.and_masks(omni_jax.causal_mask,
                                      omni_jax.document_mask(q_ids.astype(np.int32),
                                                             kv_ids.astype(np.int32)))
        return mask_mod, None, lambda b, h, i, j: (j <= i) & (q_ids[b, i] == kv_ids[b, j])
    return omni_jax.causal_mask, None, lambda b, h, i, j: j <= i


@pytest.mark.interpreted
@pytest.mark.parametrize("case,variant", list(_runs()))
def test_gradients_match_float64(case: Case, variant: str, _interpreted):
    fields = VARIANTS[variant]
    score_mod = _score_mod if case.score_mod else None

    def run(q, k, v, kmask, layout, out, lse, dout, dlse, scale, params):
        # Few stages, so that the producers wait for consumed slots before refilling them.
        config = bwd.BackwardConfig(block_kv=case.block_kv, dkv_stages=2, dq_stages=1,
                                    **fields)
        return bwd.attention_backward(
            q, k, v, kmask, layout, out, lse, dout, dlse, scale=scale, softcap=case.softcap,
            score_mod=None if score_mod is None else _converted(score_mod),
            has_partial=case.mask == "partial", config=config,
            # Masked masks take the fused dQ however short their walks (split launches).
            mean_full_walk=np.inf, interpret_params=params)[:3]

    check_kernel_gradients(case, score_mod, run)


def check_kernel_gradients(case: Case, score_mod, run) -> None:
    """``run(q, k, v, kmask, layout, out, lse, dout, dlse, scale, interpret_params)``'s
    (dq, dk, dv) for ``case`` against float64, on fresh random inputs (the seed is in
    every failure's message); blocks that walk nothing must write zeros."""
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    shapes = ((case.batch, case.q_len, case.heads, case.head_dim),
              (case.batch, case.kv_len, case.kv_heads, case.head_dim),
              (case.batch, case.kv_len, case.kv_heads, case.head_dim_v))
    q, k, v = (jnp.asarray(rng.standard_normal(s), case.dtype) for s in shapes)
    mask_mod, mask_heads, fn = _mask(case, rng)
    mask_batch = case.batch if case.mask == "documents" else None
    block_mask = (_dense_block_mask(case.q_len, case.kv_len, (128, case.block_kv))
                  if mask_mod is None else
                  omni_jax.create_block_mask(mask_mod, mask_batch, mask_heads, case.q_len,
                                             case.kv_len, (128, case.block_kv)))
    visible = dense_mask(case.batch, case.heads, case.q_len, case.kv_len, mask_fn=fn)
    dout = rng.standard_normal((case.batch, case.q_len, case.heads, case.head_dim_v))
    dlse = rng.standard_normal((case.batch, case.heads, case.q_len))
    with jax.enable_x64(True):
        def reference(q, k, v):
            return reference_attention(q, k, v, visible, scale=case.scale,
                                       softcap=case.softcap, score_mod=score_mod)

        as64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        (out, lse), vjp = jax.vjp(reference, as64(q), as64(k), as64(v))
        expected = [np.asarray(g) for g in vjp((jnp.asarray(dout), jnp.asarray(dlse)))]
        out, lse = np.asarray(out), np.asarray(lse)

    kmask, layout = kernel_mask(block_mask)
    params = compat.tma_faithful_interpret_params(runtime.mosaic_interpret_params())
    if case.poisoned:
        params = dataclasses.replace(params, uninitialized_memory="nan")
    scale = case.scale if case.scale is not None else 1.0 / np.sqrt(case.head_dim)
    grads = run(q, k, v, kmask, layout, jnp.asarray(out, case.dtype),
                jnp.asarray(lse, jnp.float32), jnp.asarray(dout, case.dtype),
                jnp.asarray(dlse, jnp.float32), scale, params)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        grad = np.asarray(grad, np.float64)
        context = (case.name, name, seed)
        assert grad.shape == ref.shape, context
        assert not np.isnan(grad).any(), context
        assert relative_error(grad, ref) < TOLERANCE[case.dtype], (context,
                                                                  relative_error(grad, ref))
    if case.mask == "partial":  # Blocks with nothing to walk still write zeros.
        assert (np.asarray(grads[0], np.float32)[:, :128] == 0).all()
        assert (np.asarray(grads[1], np.float32)[:, 128:] == 0).all()
        assert (np.asarray(grads[2], np.float32)[:, 128:] == 0).all()

@pytest.mark.interpreted
def test_fused_dq_under_vmap_takes_the_dq_kernel(_interpreted):
    """The fused dQ's in-place sum cannot be batched: `jax.vmap` gets the dQ kernel,
    and each example's gradients are those of a call of its own."""
    rng = np.random.default_rng()
    shape = (2, 1, 128, 2, 128)  # [vmapped, batch, seq, heads, head dim]
    q, k, v, dout = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    lse = jnp.asarray(rng.standard_normal((2, 1, 2, 128)), jnp.float32) + 5.0
    out = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    kmask, layout = kernel_mask(_dense_block_mask(128, 128, (128, 128)))
    config = bwd.BackwardConfig(block_kv=128, dkv_stages=2, dq_stages=1, fused_dq=True)
    params = compat.tma_faithful_interpret_params(runtime.mosaic_interpret_params())

    def backward(q, k, v, out, lse, dout):
        return bwd.attention_backward(q, k, v, kmask, layout, out, lse, dout,
                                      jnp.zeros_like(lse), scale=0.1, softcap=None,
                                      score_mod=None, has_partial=False, config=config,
                                      interpret_params=params)[:3]

    batched = jax.vmap(backward)(q, k, v, out, lse, dout)
    for i in range(2):
        single = backward(q[i], k[i], v[i], out[i], lse[i], dout[i])
        for got, want in zip(batched, single, strict=True):
            assert relative_error(np.asarray(got[i], np.float64),
                                  np.asarray(want, np.float64)) < 1e-2


def _converted(score_mod):
    from omni_jax.scores import convert_score_mod

    converted, captured = convert_score_mod(score_mod)
    assert not captured
    return converted


@pytest.mark.parametrize("head_dim,consumers,q_step,splits", [
    (128, 2, 64, True), (96, 2, 64, False), (64, 2, 64, False), (96, 1, 64, True),
    (64, 1, 64, True), (64, 2, 128, True), (96, 2, 128, False), (128, 2, 128, False)])
def test_fused_dq_serves_where_columns_or_rows_split(head_dim, consumers, q_step, splits):
    assert bwd.fused_dq_splits(head_dim, consumers, q_step) == splits


@pytest.mark.parametrize("head_dim,head_dim_v,q_step,fused", [
    (64, 64, 128, True), (64, 40, 128, True), (128, 128, 64, True), (96, 96, 64, False),
    (64, 128, 64, False)])
def test_head_dim_64_fuses_dq_by_rows(head_dim, head_dim_v, q_step, fused):
    """Head dim 64 walks whole q-blocks and fuses dQ split by rows, in shared memory at
    two stages (one with stored tiles); wider head dims keep 64-row steps."""
    dims = padded_head_dims(head_dim, head_dim_v)
    config = bwd.backward_config(*dims, jnp.bfloat16, causal=True)
    assert config.q_step == q_step
    assert (config.fused_dq and bwd.fused_dq_splits(dims[0], config.dkv_consumers,
                                                    config.q_step)) == fused
    if q_step == bwd.BLOCK_Q:
        for has_partial, stages in ((False, 2), (True, 1)):
            fitted = bwd.fit_config(config, SMEM_LIMIT, *dims, 2, has_partial, fused_dq=True)
            assert fitted.dkv_stages == stages
        # One dK/dV consumer (kv tiles of 64) walks 64-row steps.
        assert config.with_block_kv(64).q_step == bwd.ROWS_PER_CONSUMER
        assert config.with_block_kv(128) == config


@pytest.mark.parametrize("head_dim,head_dim_v,block_kv", [
    (64, 64, 128), (96, 96, 128), (128, 128, 128), (192, 128, 64), (192, 192, 64),
    (256, 256, 64)])
def test_configs_fit_shared_memory(head_dim, head_dim_v, block_kv):
    config = bwd.backward_config(head_dim, head_dim_v, jnp.bfloat16, causal=True)
    # dK and dV apart where both exceed a consumer's registers.
    assert config.split_dkdv == (head_dim + head_dim_v > 320)
    for has_partial in (False, True):
        fitted = bwd.fit_config(config, 219 * 1024, head_dim, head_dim_v, 2, has_partial)
        assert fitted is not None and fitted.block_kv == block_kv


@settings(max_examples=60, deadline=None)
@given(head_dim=st.integers(1, 256), head_dim_v=st.integers(1, 256), has_partial=st.booleans())
def test_every_head_dim_pair_has_a_config_that_fits(head_dim, head_dim_v, has_partial):
    """Any pair of head dims the forward takes gets a backward config that fits shared
    memory at the forward's kv tiles, split exactly where dK and dV exceed a consumer."""
    dims = padded_head_dims(head_dim, head_dim_v)
    config = bwd.backward_config(*dims, jnp.bfloat16, causal=False)
    assert config is not None
    assert config.split_dkdv == (sum(dims) > bwd.MAX_UNSPLIT_DKDV_WIDTH)
    assert not (config.split_dkdv and config.fused_dq)
    block_kv = 128 if max(dims) <= 128 else 64  # the forward's tiles
    fitted = bwd.fit_config(dataclasses.replace(config, block_kv=block_kv), SMEM_LIMIT,
                            *dims, 2, has_partial)
    assert fitted is not None


@pytest.mark.parametrize("num_q_blocks,walk_heads,q_major", [
    (32, 1, True), (800, 1, True), (1024, 1, False), (128, 8, False)])
def test_fused_dq_at_head_dim_128_keeps_its_stages(num_q_blocks, walk_heads, q_major):
    """Head dim 128's fused launch takes q-major score tiles unless their P tiles would
    cost it a stage: walks over 1024 q-blocks (131072 queries), or per-head masks over 8
    query heads a CTA, keep their rows in the shared memory the P tiles need."""
    config = bwd.backward_config(128, 128, jnp.bfloat16, causal=False)
    walks = bwd.walk_bytes(num_q_blocks, num_q_blocks, walk_heads)
    fitted = bwd._fit_fused(config, 128, 128, 2, False, walk_bytes=walks)
    assert fitted.dkv_stages == config.dkv_stages
    assert fitted.q_major_scores == q_major


def test_configs_reject_bad_fields():
    assert bwd.backward_config(320, 320, jnp.bfloat16, causal=False) is None
    with pytest.raises(ValueError, match="block_kv"):
        bwd.BackwardConfig(block_kv=192, dkv_stages=2, dq_stages=2)
    with pytest.raises(ValueError, match="q_step"):
        bwd.BackwardConfig(block_kv=128, dkv_stages=2, dq_stages=2, q_step=32)
    with pytest.raises(ValueError, match="block_kv=64"):
        bwd.BackwardConfig(block_kv=64, dkv_stages=2, dq_stages=2, q_step=128)
    with pytest.raises(ValueError, match="split_dkdv"):
        bwd.BackwardConfig(block_kv=64, dkv_stages=2, dq_stages=2, fused_dq=True,
                           split_dkdv=True)
    for registers in (236, 248):  # not a multiple of 8; more than the producer can give
        with pytest.raises(ValueError, match="dq_consumer_registers"):
            bwd.BackwardConfig(block_kv=64, dkv_stages=2, dq_stages=2,
                               dq_consumer_registers=registers)


@pytest.mark.gpu
@pytest.mark.skipif(runtime.interpret_requested() or runtime.gpu_compute_capability() != (9, 0),
                    reason="needs an sm90 GPU (compiled Mosaic-GPU kernels)")
@pytest.mark.parametrize("dtype,head_dim,seq,mask", [
    ("bfloat16", 128, 1000, "causal"),
    ("float16", 64, 2048, "documents"),
    ("bfloat16", 96, 777, "dense"),
    ("bfloat16", 256, 1000, "causal"),
    ("float16", 192, 900, "documents"),
])
def test_long_sequences_compiled(dtype, head_dim, seq, mask):
    rng = np.random.default_rng()
    q = jnp.asarray(rng.standard_normal((2, seq, 4, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, seq, 2, head_dim)), dtype) for _ in range(2))
    kwargs = {"is_causal": mask == "causal"}
    if mask == "documents":
        ids = np.sort(rng.integers(0, 5, (2, seq)), axis=-1).astype(np.int32)
        kwargs = {"q_segment_ids": jnp.asarray(ids), "is_causal": True}
    dout = jnp.asarray(rng.standard_normal((2, seq, 4, head_dim)), dtype)

    def grads(implementation, *args):
        def run(q, k, v):
            return omni_jax.attention(q, k, v, implementation=implementation, **kwargs)

        out, vjp = jax.vjp(run, *args)
        return vjp(dout.astype(out.dtype))

    as32 = lambda x: x.astype(jnp.float32)
    actual = jax.jit(lambda *a: grads("mosaic", *a))(q, k, v)
    expected = jax.jit(lambda *a: grads("xla", *a))(as32(q), as32(k), as32(v))
    for name, grad, ref in zip(("dq", "dk", "dv"), actual, expected, strict=True):
        assert not np.isnan(np.asarray(grad, np.float32)).any(), name
        assert relative_error(grad, ref) < TOLERANCE[dtype], (name, relative_error(grad, ref))


@pytest.mark.parametrize("num_kv_blocks,masked_tiles,ordered", [
    (32, False, True), (2 * runtime.num_sms(), False, True),
    (2 * runtime.num_sms() + 1, False, False), (32, True, False)])
def test_ordered_dq_serves_full_walks_in_groups_that_fit_half_the_sms(num_kv_blocks,
                                                                      masked_tiles, ordered):
    """The ordered dQ serves walks of FULL tiles (the rest of the deterministic default
    takes the dQ kernel). Its CTAs wait on CTAs of their group launched after them: a
    head's kv-blocks order their adds in even groups of at most half of the SMs, each
    into a sum of its own, four sums at most."""
    layout = types.SimpleNamespace(num_kv_blocks=num_kv_blocks)
    assert bwd.orders_dq(layout, masked_tiles, max_groups=4) == ordered
    group, groups = bwd.ordered_dq_group(num_kv_blocks), bwd.ordered_dq_groups(num_kv_blocks)
    assert group <= runtime.num_sms() // 2 and 0 <= groups * group - num_kv_blocks < groups
    assert groups == -(-num_kv_blocks // (runtime.num_sms() // 2))
