"""The Mosaic-GPU Blackwell (sm100) attention forward, interpreted as sm100 (jax 0.11+).

Through the Mosaic-GPU interpreter with race detection on (a race fails the test) and
uninitialized memory poisoned with NaN (an unwritten output row fails), against the
float64 reference: lengths and tails, masks with FULL, COMPUTED and PARTIAL tiles, GQA,
softcap, score_mod, head dims 64-256 and value head dims of their own, bf16 and fp16;
one and two q tiles per CTA, the conditional rescale of O both taken and skipped, the
exp2 polynomial on none, part and all of the columns.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from pallas_kernels import compat, runtime
from pallas_kernels.block_sparse import kernel_mask
from pallas_kernels.mosaic import attention_fwd_sm100 as fwd
from pallas_kernels.mosaic import attention_sm100_common as common100
from tests.jax_releases import skip_unless_blackwell_interpreter
from tests.mosaic_interpret import interpreted_mosaic
from tests.reference import dense_mask, reference_attention, relative_error

TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3}
pytestmark = pytest.mark.interpreted


@pytest.fixture
def _interpreted(monkeypatch):
    skip_unless_blackwell_interpreter()
    yield from interpreted_mosaic(monkeypatch, "sm100")


def _inputs(rng, dtype, batch, q_len, kv_len, heads, kv_heads, head_dim, head_dim_v=None,
            q_offset=0.0):
    shapes = ((batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim),
              (batch, kv_len, kv_heads, head_dim_v or head_dim))
    q, k, v = (rng.standard_normal(s) for s in shapes)
    return tuple(jnp.asarray(x, dtype) for x in (q + q_offset, k, v))


def _run(q, k, v, block_mask, config, *, scale=None):
    """(out, lse) of the kernel called directly, uninitialized memory NaN."""
    kmask, layout = kernel_mask(block_mask)
    params = compat.tma_faithful_interpret_params(runtime.mosaic_interpret_params())
    out, lse = fwd.attention_forward(
        q, k, v, kmask, layout, scale=scale or 1 / np.sqrt(q.shape[-1]), softcap=None,
        score_mod=None, has_partial=True, config=config,
        interpret_params=dataclasses.replace(params, uninitialized_memory="nan"))
    return np.asarray(out, np.float32), np.asarray(lse)


def _check(dtype, q, k, v, out, lse, visible, **reference_kwargs):
    with jax.enable_x64(True):
        ref_out, ref_lse = (np.asarray(x) for x in reference_attention(
            q, k, v, visible, **reference_kwargs))
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == finite).all()
    assert relative_error(lse[finite], ref_lse[finite]) < 1e-3


def _mask(mask_fn, batch, heads, q_len, kv_len, block_kv, per_head=False):
    block_mask = omni_jax.create_block_mask(
        mask_fn, batch if per_head else None, heads if per_head else None, q_len, kv_len,
        (fwd.BLOCK_Q, block_kv))
    visible = dense_mask(batch, heads, q_len, kv_len, mask_fn=mask_fn)
    return block_mask, visible


def _causal(b, h, i, j):
    return j <= i


@pytest.mark.usefixtures("_interpreted")
@pytest.mark.parametrize("dtype,head_dim,head_dim_v,q_len,kv_len,causal,q_tiles", [
    ("bfloat16", 64, None, 300, 200, True, 2),    # tails, q_len != kv_len, odd q-block count
    ("float16", 64, None, 128, 256, False, 2),    # one q-block: the second q tile is empty
    ("bfloat16", 128, None, 256, 300, True, 2),   # TMEM full: 2 x (128 + 128) columns
    ("float16", 128, 64, 200, 130, False, 2),     # value head dim of its own
    ("bfloat16", 256, None, 130, 140, True, 1),   # the widest head dim, one q tile
    ("float16", 80, 192, 140, 100, True, 1),      # both padded (96, 192), O beside Q
])
def test_lengths_dims_dtypes(dtype, head_dim, head_dim_v, q_len, kv_len, causal, q_tiles):
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, dtype, 1, q_len, kv_len, 2, 1, head_dim, head_dim_v)
    config = dataclasses.replace(
        fwd.forward_config(max(head_dim, head_dim_v or 0), dtype, causal), q_tiles=q_tiles)
    mask_fn = _causal if causal else (lambda b, h, i, j: j >= 0)
    block_mask, visible = _mask(mask_fn, 1, 2, q_len, kv_len, config.block_kv)
    out, lse = _run(q, k, v, block_mask, config)
    _check(dtype, q, k, v, out, lse, visible)


@pytest.mark.usefixtures("_interpreted")
@pytest.mark.parametrize("emulated_exp2", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("rescale_threshold", [0.0, 8.0])
def test_exp2_share_and_rescale_threshold(emulated_exp2, rescale_threshold):
    """Queries with a large offset make the running max grow over the walk (causal: the
    later keys score higher), so rows rescale O at threshold 0 on every growth and at 8
    only past 2^8; the exp2 polynomial computes none, half or all of each row."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 1, 256, 384, 2, 2, 64)
    k = k + jnp.linspace(0.0, 3.0, 384, dtype=jnp.float32)[None, :, None, None].astype(k.dtype)
    config = fwd.ForwardConfig(block_kv=128, num_stages=2, emulated_exp2=emulated_exp2,
                               rescale_threshold=rescale_threshold)
    block_mask, visible = _mask(lambda b, h, i, j: j <= i + 128, 1, 2, 256, 384, 128)
    out, lse = _run(q, k, v, block_mask, config, scale=0.5)
    _check("bfloat16", q, k, v, out, lse, visible, scale=0.5)


@pytest.mark.usefixtures("_interpreted")
def test_partial_tiles_blind_rows_and_gqa():
    """A stored-tile (PARTIAL) mask over 4 heads sharing 2 kv heads, whose second q-block
    sees nothing: poisoned rows come back as zeros with lse -inf."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 2, 384, 256, 4, 2, 64)

    def mask_fn(b, h, i, j):
        return ((i < 128) | (i >= 256)) & ((i + j + h) % 3 != 0)

    block_mask, visible = _mask(mask_fn, 2, 4, 384, 256, 128, per_head=True)
    out, lse = _run(q, k, v, block_mask, fwd.forward_config(64, "bfloat16", False))
    assert (out[:, 128:256] == 0).all() and np.isneginf(lse[:, :, 128:256]).all()
    _check("bfloat16", q, k, v, out, lse, visible)


# Head dim 128 with stored tiles in the ring at block_kv 128: one q tile per CTA.
@pytest.mark.usefixtures("_interpreted")
@pytest.mark.parametrize("block_kv,head_dim", [(64, 128), (128, 64), (128, 128)])
def test_computed_tiles_by_index_and_leaves(block_kv, head_dim):
    """Documents (segment ids: mask leaves) under a causal sliding window, through the
    public call: FULL, COMPUTED and skipped tiles in one walk."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "float16", 1, 280, 280, 2, 1, head_dim)
    ids = np.repeat(np.arange(3), [90, 120, 70])[None].astype(np.int32)
    block_mask = omni_jax.create_block_mask(_causal, None, None, 280, 280,
                                            (fwd.BLOCK_Q, block_kv))
    out, lse = omni_jax.attention(
        q, k, v, mask=block_mask, local_window_size=(150, 0), q_segment_ids=jnp.asarray(ids),
        kv_segment_ids=jnp.asarray(ids), return_lse=True, implementation="mosaic")
    visible = dense_mask(1, 2, 280, 280, is_causal=True, window=(150, 0),
                         q_segment_ids=ids, kv_segment_ids=ids)
    _check("float16", q, k, v, np.asarray(out, np.float32), np.asarray(lse), visible)


@pytest.mark.usefixtures("_interpreted")
def test_softcap_and_score_mod():
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 1, 200, 200, 4, 2, 64)
    slopes = jnp.asarray(rng.uniform(0.01, 0.1, 4), jnp.float32)

    def score_mod(s, b, h, i, j):
        return s - slopes[h] * jnp.abs(i - j)

    out, lse = omni_jax.attention(q, k, v, is_causal=True, softcap=5.0, score_mod=score_mod,
                                  return_lse=True, implementation="mosaic")
    visible = dense_mask(1, 4, 200, 200, is_causal=True)
    _check("bfloat16", q, k, v, np.asarray(out, np.float32), np.asarray(lse), visible,
           softcap=5.0, score_mod=score_mod)


def test_exp2_polynomial_accuracy():
    x = jnp.asarray(np.r_[np.linspace(-140.0, 20.0, 40001), -np.inf], jnp.float32)
    approx = np.asarray(common100.exp2_polynomial(x), np.float64)
    exact = np.exp2(np.asarray(x, np.float64))
    normal = exact >= 2.0 ** -125
    assert np.max(np.abs(approx[normal] / exact[normal] - 1)) < 1.5e-4
    assert (approx[~normal] == 0).all()


@pytest.mark.parametrize("fields,message", [
    (dict(block_kv=96), "block_kv"), (dict(num_stages=0), "num_stages"),
    (dict(q_tiles=3), "q_tiles"), (dict(emulated_exp2=1.5), "emulated_exp2"),
    (dict(rescale_threshold=-1.0), "rescale_threshold"), (dict(block_q=64), "block_q"),
])
def test_bad_config_is_named(fields, message):
    with pytest.raises(ValueError, match=message):
        fwd.ForwardConfig(**{"block_kv": 128, "num_stages": 2, **fields})


@pytest.mark.usefixtures("_interpreted")
def test_tensor_memory_overflow_is_named():
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 1, 128, 128, 1, 1, 256)
    block_mask, _ = _mask(_causal, 1, 1, 128, 128, 128)
    with pytest.raises(ValueError, match="tensor-memory columns"):
        _run(q, k, v, block_mask, fwd.ForwardConfig(block_kv=128, num_stages=1, q_tiles=2))


def test_paired_walk_unites_the_q_blocks_of_a_group():
    """Per group of two q-blocks: the union of their kv walks, the kv-blocks FULL for both
    first, and each q-block's own flags (MASKED where only the other is active) and
    stored-tile ids; an odd q-block count leaves the last group's second tile MASKED."""
    rng = np.random.default_rng()
    table = jnp.asarray(rng.integers(0, 4, (5, 6)))  # 0: masked, 1: full, 2-3: partial

    def mask_fn(b, h, i, j):
        kind = table[i // 128, j // 64]
        return (kind == 1) | ((kind >= 2) & ((i + j) % kind != 0))

    block_mask = omni_jax.create_block_mask(mask_fn, None, None, 5 * 128, 6 * 64, (128, 64))
    kmask, layout = kernel_mask(block_mask)
    walk = np.asarray(common100.paired_walk(kmask, layout, 2)).reshape(1, 1, 3, -1)
    index_offset, flags_offsets, id_offsets = common100.paired_walk_offsets(6, 2)
    dense = np.full((6, 6), -1)
    ids = np.zeros((6, 6), int)
    for q in range(5):
        count = int(kmask.kv_num_blocks[0, 0, q])
        columns = np.asarray(kmask.kv_indices[0, 0, q, :count])
        dense[q, columns] = np.asarray(kmask.kv_tile_flags[0, 0, q, :count])
        ids[q, columns] = np.asarray(kmask.kv_partial_ids[0, 0, q, :count])
    for group in range(3):
        row = walk[0, 0, group]
        count, num_full = row[0], row[1]
        blocks = row[index_offset:index_offset + count]
        pair = dense[2 * group:2 * group + 2]
        assert sorted(blocks) == list(np.flatnonzero((pair >= 0).any(axis=0)))
        assert (pair[:, blocks[:num_full]] == 0).all()
        assert not (pair[:, blocks[num_full:]] == 0).all(axis=0).any()
        for t in range(2):
            assert (row[flags_offsets[t]:flags_offsets[t] + count] == pair[t, blocks]).all()
            partial = pair[t, blocks] == 2
            assert (row[id_offsets[t]:id_offsets[t] + count][partial]
                    == ids[2 * group + t, blocks][partial]).all()
