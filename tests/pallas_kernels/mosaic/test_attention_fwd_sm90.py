"""The Mosaic-GPU attention forward kernel, interpreted: tails, blind rows, poison, dims.

Run through the Mosaic-GPU interpreter (a race found fails the test), compared
with the XLA backend on the same inputs (which the shared suite checks against
float64).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax.backends import mosaic as mosaic_backend
from omni_jax.masks import BlockGrid, BlockMask, Causal
from omni_jax.masks.construct import structured_tile_flags
from pallas_kernels import compat, runtime
from pallas_kernels.block_sparse import kernel_mask
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd
from pallas_kernels.mosaic import attention_sm90_common as common
from tests.forced_configs import force_config_fields, record_configs
from tests.mosaic_interpret import interpreted_mosaic
from tests.reference import reference_attention, relative_error

TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3}
pytestmark = pytest.mark.interpreted


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    yield from interpreted_mosaic(monkeypatch)


def _inputs(rng, dtype, batch, q_len, kv_len, heads, kv_heads, head_dim, head_dim_v=None):
    shapes = ((batch, q_len, heads, head_dim), (batch, kv_len, kv_heads, head_dim),
              (batch, kv_len, kv_heads, head_dim_v or head_dim))
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _compare(dtype, q, k, v, **kwargs):
    out, lse = omni_jax.attention(q, k, v, return_lse=True, implementation="mosaic", **kwargs)
    as32 = lambda x: x.astype(jnp.float32)
    ref_out, ref_lse = omni_jax.attention(as32(q), as32(k), as32(v), return_lse=True,
                                          implementation="xla", **kwargs)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
    finite = np.isfinite(np.asarray(ref_lse))
    assert (np.isfinite(np.asarray(lse)) == finite).all()
    assert relative_error(np.asarray(lse)[finite], np.asarray(ref_lse)[finite]) < 1e-3
    return out, lse


@pytest.mark.parametrize("dtype,head_dim,q_len,kv_len,causal", [
    ("bfloat16", 64, 70, 200, True),   # q tail, kv tail, q_len != kv_len, 2 kv blocks
    ("float16", 128, 130, 60, False),  # two q blocks, kv shorter than one block
    ("bfloat16", 256, 40, 40, True),   # the widest head dim
    ("float16", 80, 64, 64, False),    # head dim padded to 96 (a 64-byte swizzle)
    ("bfloat16", 160, 40, 70, True),   # head dim padded to 192 (rows of 384 bytes)
])
def test_lengths_dims_dtypes(dtype, head_dim, q_len, kv_len, causal):
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, dtype, 1, q_len, kv_len, 2, 1, head_dim)
    _compare(dtype, q, k, v, is_causal=causal)


def test_blind_rows_get_zeros_and_minus_inf_lse():
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 1, 64, 64, 1, 1, 64)
    q_ids = jnp.asarray(np.r_[np.zeros(40), np.full(24, 7)][None].astype(np.int32))
    kv_ids = jnp.zeros((1, 64), jnp.int32)
    out, lse = _compare("bfloat16", q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    assert (np.asarray(out, np.float32)[0, 40:] == 0).all()
    assert np.isneginf(np.asarray(lse)[0, :, 40:]).all()


def test_score_mod_without_captures():
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 1, 64, 64, 2, 2, 64)
    _compare("bfloat16", q, k, v, is_causal=True,
             score_mod=lambda s, b, h, i, j: s - 0.05 * (h + 1) * jnp.abs(i - j))


@pytest.mark.parametrize("pipelined,staggered,kv_splits", [
    (True, False, 1), (True, True, 1), (False, False, 1), (True, True, 3)])
def test_poisoned_outputs_are_all_written(pipelined, staggered, kv_splits):
    """Memory the kernel never writes reads as NaN: every output row must be written,
    the rows of q-blocks with no active kv-block included (zeros, lse -inf), under
    either consumer schedule, and by every kv split (here each walk has one step: two
    of three shares are empty)."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 1, 256, 128, 2, 2, 64)
    block_mask = omni_jax.create_block_mask(lambda b, h, i, j: i < 128, None, None, 256, 128,
                                            (128, 128))
    kmask, layout = kernel_mask(block_mask)
    params = compat.tma_faithful_interpret_params(runtime.mosaic_interpret_params())
    out, lse = fwd.attention_forward(
        q, k, v, kmask, layout, scale=0.125, softcap=None, score_mod=None, has_partial=True,
        config=fwd.ForwardConfig(block_kv=128, num_stages=2, pipelined=pipelined,
                                 staggered=staggered, kv_splits=kv_splits),
        interpret_params=dataclasses.replace(params, uninitialized_memory="nan"))
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[:, 128:] == 0).all() and np.isneginf(lse[:, :, 128:]).all()
    ref = omni_jax.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32), mask=block_mask, implementation="xla")
    assert relative_error(out[:, :128], ref[:, :128]) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("q_len,kv_splits", [(4, 1), (4, 3), (12, 1)])
def test_heads_first_layout_writes_what_sequence_major_does(q_len, kv_splits):
    """q and out ``[B, H, Sq, D]`` (`attention_forward`'s heads_first, a packed decoding
    step's layout): the sequence-major call's result, transposed, with every row written
    (outputs poisoned); 4 rows reach the kernel unpadded (the TMA box clips them), 12
    padded to 16."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 2, q_len, 300, 4, 2, 64)
    block_mask = omni_jax.create_block_mask(lambda b, h, i, j: j <= i + 200, None, None,
                                            q_len, 300, (128, 128))
    kmask, layout = kernel_mask(block_mask)
    params = dataclasses.replace(
        compat.tma_faithful_interpret_params(runtime.mosaic_interpret_params()),
        uninitialized_memory="nan")
    config = fwd.ForwardConfig(block_kv=128, num_stages=2, pipelined=True, kv_splits=kv_splits)
    call = lambda q, heads_first: fwd.attention_forward(
        q, k, v, kmask, layout, scale=0.125, softcap=None, score_mod=None, has_partial=True,
        config=config, interpret_params=params, heads_first=heads_first)
    out, lse = call(q.swapaxes(1, 2), True)
    ref_out, ref_lse = call(q, False)
    assert out.shape == (2, 4, q_len, 64) and lse.shape == (2, 4, q_len)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_array_equal(np.asarray(out.swapaxes(1, 2)), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
    ref = omni_jax.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32), mask=block_mask, implementation="xla")
    assert relative_error(out.swapaxes(1, 2), ref) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("fields,message", [
    (dict(block_kv=96), "block_kv"), (dict(num_stages=1), "num_stages"),
    (dict(q_blocks_per_cta=0), "q_blocks_per_cta"), (dict(kv_splits=0), "kv_splits"),
    (dict(kv_splits=2, q_blocks_per_cta=2), "kv_splits"),
    (dict(num_consumers=4), "num_consumers must be one of")])
def test_config_rejects_what_the_kernel_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        fwd.ForwardConfig(**{"block_kv": 128, "num_stages": 2, **fields})


@pytest.mark.parametrize("head_dim_v", fwd.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("head_dim", fwd.SUPPORTED_HEAD_DIMS)
def test_default_configs_fit_shared_memory(head_dim, head_dim_v):
    """Calls without a BlockMask take the default config unchecked: it must fit for every
    pair of served head dims, stored tiles or not (192 beside 256 did not, padded apart)."""
    for causal in (False, True):
        config = fwd.forward_config(max(head_dim, head_dim_v), jnp.bfloat16, causal)
        dims = fwd.padded_head_dims(head_dim, head_dim_v)
        for has_partial in (False, True):
            assert fwd.smem_bytes(config, *dims, 2, has_partial) <= common.SMEM_LIMIT


@pytest.mark.parametrize("head_dim,mean_walk,expected", [
    (128, None, 1), (128, 40.0, 1), (128, fwd.SHORT_WALK, 2), (128, 3.0, 2),
    (256, 3.0, 1), (64, None, 1), (64, 3.0, 2)])
def test_short_walks_take_two_q_blocks_per_cta(head_dim, mean_walk, expected):
    config = fwd.forward_config(head_dim, jnp.bfloat16, False, mean_walk)
    assert config.q_blocks_per_cta == expected
    base = fwd.forward_config(head_dim, jnp.bfloat16, False)
    assert dataclasses.replace(config, q_blocks_per_cta=base.q_blocks_per_cta) == base


@pytest.mark.parametrize("q_len,kv_len,kv_splits", [(4, 16384, 16), (4, 1024, 1), (2048, 2048, 2)])
def test_forward_splits_walks_of_calls_with_few_q_blocks(q_len, kv_len, kv_splits, monkeypatch):
    """A decoding step (packed: 4 query heads of a kv head, 4 rows) over a long cache
    walks its kv-blocks in splits; a short cache does not; nor does a prefill with enough
    q-blocks... unless it has too few to fill the SMs."""
    import jax

    configs = record_configs(monkeypatch, fwd, "attention_forward")
    q = jax.ShapeDtypeStruct((1, q_len, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, kv_len, 1, 128), jnp.bfloat16)
    jax.eval_shape(lambda q, k, v: omni_jax.attention(q, k, v, implementation="mosaic"),
                   q, kv, kv)
    assert [c.kv_splits for c in configs] == [kv_splits]


@pytest.mark.parametrize("kwargs,traced_mask,expected", [
    (dict(local_window_size=(256, 0)), False, 2),  # 2-3 kv-blocks per q-block
    (dict(), False, 1),  # 16 (dense)
    (dict(is_causal=True), False, 2),  # 8.5 on average
    (dict(local_window_size=(256, 0)), True, 1),  # walks unknown at trace time
])
def test_forward_picks_q_blocks_per_cta_by_walk_length(kwargs, traced_mask, expected,
                                                       monkeypatch):
    """The backend passes a concrete mask's mean walk to `forward_config`; traced only."""
    import jax

    configs = record_configs(monkeypatch, fwd, "attention_forward")
    q = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)
    if traced_mask:
        def attend(q, k, v, q_ids):
            return omni_jax.attention(q, k, v, q_segment_ids=q_ids, implementation="mosaic",
                                      **kwargs)
        jax.eval_shape(attend, q, q, q, jax.ShapeDtypeStruct((1, 2048), jnp.int32))
    else:
        jax.eval_shape(lambda q, k, v: omni_jax.attention(q, k, v, implementation="mosaic",
                                                          **kwargs), q, q, q)
    assert [c.q_blocks_per_cta for c in configs] == [expected]


@pytest.mark.parametrize("head_dim,fields", [
    (128, {"q_blocks_per_cta": 1}),  # forced for short walks only
    (64, {"num_consumers": 2}),  # dense head dim 64's consumer count
])
def test_trace_key_covers_forced_configs(head_dim, fields, monkeypatch):
    """A config forced for a benchmark's A/B must trace afresh: the compiled calls are
    keyed by the backend's trace key."""
    from omni_jax.backends.mosaic import MosaicBackend
    from omni_jax.problem import AttentionProblem

    problem = AttentionProblem(
        batch=2, q_len=2048, kv_len=2048, num_q_heads=8, num_kv_heads=8, head_dim=head_dim,
        head_dim_v=head_dim, dtype=np.dtype(jnp.bfloat16), scale=0.1, softcap=None,
        score_mod=None, has_sinks=False, has_user_mask=False)
    default_key = MosaicBackend().trace_key(problem)
    force_config_fields(monkeypatch, fwd, "forward_config", **fields)
    assert MosaicBackend().trace_key(problem) != default_key


def test_declines_what_it_cannot_serve():
    """What the kernels cannot take, named. Concrete masks of other block sizes are
    re-tiled (`omni_jax.masks.regroup`); masks traced inside a jit are not."""
    q = jnp.ones((1, 64, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        omni_jax.attention(q, q, q, implementation="mosaic")

    def traced_mask(bits, q_len, block_size):
        return omni_jax.create_block_mask(lambda b, h, i, j: bits[i, j], None, None, q_len,
                                          q_len, block_size)

    def attend(bits, q, k, v, block_size):
        mask = traced_mask(bits, q.shape[1], block_size)
        return omni_jax.attention(q, k, v, mask=mask, implementation="mosaic")

    q = jnp.ones((1, 64, 1, 64), jnp.bfloat16)
    causal = jnp.tril(jnp.ones((64, 64), bool))
    with pytest.raises(ValueError, match="block_q=128"):
        jax.eval_shape(lambda bits, q: attend(bits, q, q, q, (32, 32)), causal, q)
    # Stored tiles of 128 kv columns beside a value head dim of 192: the ring of K/V
    # stages would not fit, and the message says what would.
    bits = (jnp.arange(128)[:, None] + jnp.arange(128)[None, :]) % 3 != 0
    q, v = jnp.ones((1, 128, 1, 32), jnp.bfloat16), jnp.ones((1, 128, 1, 192), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"block_kv=128 with head_dim=32, head_dim_v=192 "
                                         r"needs \d+ bytes.*block_kv=64 fits"):
        jax.eval_shape(lambda bits, q, v: attend(bits, q, q, v, (128, 128)), bits, q, v)


@pytest.mark.parametrize("pipelined", [True, False])
def test_kv_leaves_after_full_tiles(pipelined, monkeypatch):
    """Segment ids make the q-block's first kv-blocks FULL and the later ones COMPUTED:
    the later ones must read their own kv leaves, not a stale slot's."""
    force_config_fields(monkeypatch, fwd, "forward_config", pipelined=pipelined)
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 1, 128, 512, 2, 1, 64)
    kv_ids = np.zeros((1, 512), np.int32)
    kv_ids[0, 256:] = rng.integers(0, 2, 256)  # blocks 2 and 3 mixed, 0 and 1 all visible
    _compare("bfloat16", q, k, v, q_segment_ids=jnp.zeros((1, 128), jnp.int32),
             kv_segment_ids=jnp.asarray(kv_ids))


@pytest.mark.parametrize("q_blocks_per_cta,pipelined,staggered,head_dim,head_dim_v", [
    (2, True, False, 64, 64),     # two Q buffers; 5 q-blocks: the last CTA computes one
    (3, False, False, 64, 32),    # output buffer apart from Q's (head dims differ)
    (4, True, False, 256, 256),   # one Q buffer (two exceed shared memory)
    (3, True, True, 128, 128),    # staggered once per CTA, empty walks among its q-blocks
])
def test_several_q_blocks_per_cta(q_blocks_per_cta, pipelined, staggered, head_dim,
                                  head_dim_v, monkeypatch):
    """CTAs computing q-blocks in turn (one kv ring across them; walks, q leaves and Q
    double-buffered) give what one CTA per q-block gives, under documents (q and kv
    leaves, FULL and COMPUTED tiles) and with a fully masked q-block and head in it."""
    force_config_fields(monkeypatch, fwd, "forward_config", pipelined=pipelined,
                        staggered=staggered, q_blocks_per_cta=q_blocks_per_cta)
    rng = np.random.default_rng()
    seq = 5 * 128 - 24
    q, k, v = _inputs(rng, "bfloat16", 1, seq, seq, 2, 1, head_dim, head_dim_v)
    ids = np.sort(rng.integers(0, 3, seq)).astype(np.int32)[None]
    kv_ids = ids.copy()
    kv_ids[0, 128:256] = 9  # q-block 1 sees no key
    _compare("bfloat16", q, k, v, is_causal=True, q_segment_ids=jnp.asarray(ids),
             kv_segment_ids=jnp.asarray(kv_ids))


def test_several_q_blocks_per_cta_write_every_row():
    """Poisoned outputs: every row of every q-block of a multi-q-block CTA is written,
    with a PARTIAL mask whose second q-block sees nothing."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 1, 384, 256, 2, 2, 64)
    block_mask = omni_jax.create_block_mask(
        lambda b, h, i, j: ((i < 128) | (i >= 256)) & ((i + j) % 3 != 0), None, None, 384,
        256, (128, 128))
    kmask, layout = kernel_mask(block_mask)
    params = compat.tma_faithful_interpret_params(runtime.mosaic_interpret_params())
    out, lse = fwd.attention_forward(
        q, k, v, kmask, layout, scale=0.125, softcap=None, score_mod=None, has_partial=True,
        config=fwd.ForwardConfig(block_kv=128, num_stages=2, pipelined=True,
                                 q_blocks_per_cta=3),
        interpret_params=dataclasses.replace(params, uninitialized_memory="nan"))
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[:, 128:256] == 0).all() and np.isneginf(lse[:, :, 128:256]).all()
    ref = omni_jax.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32), mask=block_mask, implementation="xla")
    assert relative_error(out, ref) < TOLERANCE["bfloat16"]


def test_captured_arrays_read_by_element():
    """A score_mod capturing slopes (by head), a bf16 table (by batch and head) and a 0-d
    temperature: the kernel reads their elements from the packed smem buffer."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 2, 130, 130, 4, 2, 64)
    slopes = jnp.asarray(rng.uniform(0.01, 0.1, 4), jnp.float32)
    table = jnp.asarray(rng.standard_normal((2, 4)), jnp.bfloat16)
    temperature = jnp.float32(rng.uniform(0.5, 1.5))
    _compare("bfloat16", q, k, v, is_causal=True,
             score_mod=lambda s, b, h, i, j: (s - slopes[h] * (i - j) + table[b, h])
             * temperature)


def _poisoned_interpreter(monkeypatch) -> None:
    """The backend's interpreted kernels start with every buffer NaN (HBM outputs too):
    a row the kernel never writes reads as NaN."""
    params = mosaic_backend.interpret_params
    monkeypatch.setattr(mosaic_backend, "interpret_params", lambda: dataclasses.replace(
        params(), uninitialized_memory="nan"))


@pytest.mark.parametrize("batch,q_len,kv_len,heads,kv_heads", [
    (1, 384, 256, 1, 1),  # two CTAs of 192 rows: the second starts inside q-block 1
    (2, 200, 256, 4, 2),  # ragged: consumers 1 and 2 of the second CTA lie past q_len; GQA
    # Ragged inside the second CTA's consumer 1; its consumer 2, past q_len, only releases
    # the K/V tiles of 5 kv steps through a ring of 3.
    (1, 320, 640, 2, 2),
])
def test_three_consumers_dense_head_dim_64(batch, q_len, kv_len, heads, kv_heads,
                                           monkeypatch):
    """Dense head dim 64 runs CTAs of three consumers (192 rows, spanning q-blocks):
    against float64, every row written (buffers poisoned with NaN), lse included."""
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    _poisoned_interpreter(monkeypatch)
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", batch, q_len, kv_len, heads, kv_heads, 64)
    out, lse = omni_jax.attention(q, k, v, return_lse=True, implementation="mosaic")
    assert [(c.num_consumers, c.staggered) for c in configs] == [(3, True)]
    out, lse = np.asarray(out, np.float64), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    with jax.enable_x64(True):
        ref_out, ref_lse = reference_attention(q, k, v, None)
    assert relative_error(out, ref_out) < TOLERANCE["bfloat16"]
    assert relative_error(lse, ref_lse) < 1e-3


@pytest.mark.parametrize("staggered,kv_splits", [(True, 1), (False, 3)])
def test_consumer_past_q_len_only_releases_its_walk(staggered, kv_splits, monkeypatch):
    """40 query rows (a decoding step's packed rows): the second consumer's rows all lie
    past q_len, so it releases each K/V tile and kv leaf (document ids) once loaded and
    computes nothing; against float64, every row written (buffers poisoned)."""
    force_config_fields(monkeypatch, fwd, "forward_config", staggered=staggered,
                        kv_splits=kv_splits, q_blocks_per_cta=1)
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    _poisoned_interpreter(monkeypatch)
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 2, 40, 640, 4, 2, 128)
    kv_ids = jnp.asarray(rng.integers(0, 2, (2, 640)), jnp.int32)
    q_ids = jnp.ones((2, 40), jnp.int32)
    out, lse = _compare("bfloat16", q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    assert [(c.num_consumers, c.pipelined, c.kv_splits) for c in configs] == [
        (2, True, kv_splits)]
    assert not np.isnan(np.asarray(lse)).any()


def test_three_consumers_unstaggered(monkeypatch):
    """Without the stagger barriers the three consumers start together."""
    force_config_fields(monkeypatch, fwd, "forward_config", staggered=False)
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, "bfloat16", 1, 200, 256, 2, 1, 64)
    _compare("bfloat16", q, k, v)
    assert [c.num_consumers for c in configs] == [3]


@pytest.mark.parametrize("head_dim,kwargs,expected", [
    (64, dict(), 3),  # dense
    (48, dict(), 3),  # padded to 64
    (64, dict(is_causal=True), 2),
    (64, dict(local_window_size=(256, 0)), 2),
    (64, dict(kv_len=1000), 2),  # ragged kv: the last kv-block is COMPUTED
    (64, dict(segments=True), 2),  # mask_mod leaves (documents)
    (64, dict(user_mask=True), 2),  # a BlockMask of the caller's (stored tiles), even dense
    (64, dict(batch=1, heads=1, q_len=256, kv_len=4096), 2),  # few q-blocks: kv splits
    (128, dict(), 2),
])
def test_backend_picks_three_consumers_for_dense_head_dim_64(head_dim, kwargs, expected,
                                                             monkeypatch):
    """Traced only: the backend's choice of consumers per mask and head dim."""
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    kwargs = dict(kwargs)
    batch, heads = kwargs.pop("batch", 2), kwargs.pop("heads", 8)
    q_len = kwargs.pop("q_len", 2048)
    kv_len = kwargs.pop("kv_len", q_len)
    if kwargs.pop("segments", False):
        kwargs["q_segment_ids"] = kwargs["kv_segment_ids"] = jnp.zeros((batch, q_len), jnp.int32)
    if kwargs.pop("user_mask", False):
        kwargs["mask"] = omni_jax.create_block_mask(lambda b, h, i, j: i >= 0, None, None,
                                                    q_len, kv_len, (128, 128))
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, kv_len, heads, head_dim), jnp.bfloat16)
    jax.eval_shape(lambda q, k, v: omni_jax.attention(q, k, v, implementation="mosaic",
                                                      **kwargs), q, kv, kv)
    assert [c.num_consumers for c in configs] == [expected]
    assert all(c.kv_splits == 1 for c in configs if c.num_consumers == 3)


@pytest.mark.parametrize("causal,fields,message", [
    # q-blocks walking different kv-blocks
    (True, dict(), "num_consumers=3 needs a mask known at trace time"),
    (False, dict(pipelined=False), "needs pipelined=True.*got pipelined=False"),
    (False, dict(q_blocks_per_cta=2), "q_blocks_per_cta=2"),
    (False, dict(kv_splits=2), "kv_splits=2"),
    (False, dict(block_kv=256), "block_kv=256"),
])
def test_three_consumers_decline_what_they_cannot_run(causal, fields, message):
    """Forced where they cannot serve, three consumers are refused at trace time."""
    block_kv = fields.get("block_kv", 128)
    mask_mod = Causal() if causal else None
    block_mask = BlockMask.from_tile_flags(
        structured_tile_flags(mask_mod, BlockGrid(512, 512, 128, block_kv)), mask_mod=mask_mod,
        q_len=512, kv_len=512, block_size=(128, block_kv))
    kmask, layout = kernel_mask(block_mask)
    q = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    config = dataclasses.replace(fwd.forward_config(64, jnp.bfloat16, False), num_consumers=3,
                                 **fields)
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda q: fwd.attention_forward(
            q, q, q, kmask, layout, scale=0.125, softcap=None, score_mod=None,
            has_partial=False, config=config), q)


def test_three_consumers_shared_memory_counts_the_third_q_buffer():
    two = fwd.forward_config(64, jnp.bfloat16, False)
    three = fwd.forward_config(64, jnp.bfloat16, False, uniform_walks=True)
    assert (two.num_consumers, three.num_consumers) == (2, 3)
    assert fwd.smem_bytes(three, 64, 64, 2, False) - fwd.smem_bytes(two, 64, 64, 2, False) \
        == common.ROWS_PER_CONSUMER * 64 * 2
