"""Split-KV helpers: the choice of splits, the shares of a walk, the combine."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import kv_splits
from pallas_kernels.softmax import fold_sinks
from tests.reference import relative_error


@pytest.mark.parametrize("num_programs,mean_walk,num_sms,splits", [
    (8, 1024, 132, 16),  # a decoding step of one sequence, 8 kv heads, a cache of 128k
    (64, 64, 132, 2),  # 8 sequences, 8k
    (64, 15, 132, 1),  # shares shorter than MIN_SPLIT_STEPS
    (1, 40, 132, 5),
    (2048, 32, 132, 1),  # prefill: the SMs are full
    (8, 1024, 108, 13),  # an A100
])
def test_splits_fill_the_sms_in_one_wave(num_programs, mean_walk, num_sms, splits):
    assert kv_splits.num_splits(num_programs, mean_walk, num_sms) == splits
    assert splits == 1 or num_programs * splits <= num_sms


def test_splits_fill_several_waves_when_asked():
    assert kv_splits.num_splits(64, 256, 132, waves=2) == 4
    assert kv_splits.num_splits(64, 24, 132, waves=2) == 3  # shares of MIN_SPLIT_STEPS


@settings(deadline=None)  # each share is a few eager jax ops
@given(count=st.integers(0, 200), data=st.data(), splits=st.integers(1, 20))
def test_shares_partition_the_walk_with_full_steps_first(count, data, splits):
    num_full = data.draw(st.integers(0, count))
    covered, full = [], 0
    for split in range(splits):
        begin, length, share_full = (int(x) for x in kv_splits.share(
            jnp.int32(count), jnp.int32(num_full), jnp.int32(split), splits))
        assert 0 <= share_full <= length
        # The share's FULL steps are its first ones, and exactly the walk's FULL ones.
        assert all((p < num_full) == (p < begin + share_full)
                   for p in range(begin, begin + length))
        covered += range(begin, begin + length)
        full += share_full
    assert covered == list(range(count))
    assert full == num_full


def _softmax_result(scores, values):
    """(out, lse) of ``scores [B, H, Sq, K]`` over ``values [B, K, H, D]`` in float64;
    rows with every score -inf give 0 and -inf."""
    peak = scores.max(axis=-1, keepdims=True)
    peak = np.where(np.isneginf(peak), 0.0, peak)
    weights = np.exp(scores - peak)
    total = weights.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", weights / np.where(total == 0, 1.0, total), values)
    with np.errstate(divide="ignore"):
        return out, (peak + np.log(total))[..., 0]


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_combine_then_sinks_equal_the_softmax_over_every_key(splits, with_sinks):
    rng = np.random.default_rng()
    batch, heads, q_len, keys, dim = 2, 3, 4, 10 * splits, 8
    scores = rng.standard_normal((batch, heads, q_len, keys)) * 3
    scores[0, 0, 0] = -np.inf  # a row that sees nothing
    scores[1, :, 1, : keys // 2] = -np.inf  # rows whose first shares see nothing
    values = rng.standard_normal((batch, keys, heads, dim))
    sinks = rng.standard_normal(heads) if with_sinks else None
    parts = [_softmax_result(scores[..., s::splits], values[:, s::splits])
             for s in range(splits)]
    out, lse = kv_splits.combine(jnp.asarray(np.stack([p[0] for p in parts]), jnp.float32),
                                 jnp.asarray(np.stack([p[1] for p in parts]), jnp.float32),
                                 jnp.bfloat16)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, jnp.asarray(sinks))
    if sinks is not None:  # a key of score `sink` and value 0
        scores = np.concatenate(
            [scores, np.broadcast_to(sinks[None, :, None, None], (batch, heads, q_len, 1))], -1)
        values = np.concatenate([values, np.zeros((batch, 1, heads, dim))], 1)
    ref_out, ref_lse = _softmax_result(scores, values)
    assert out.dtype == jnp.bfloat16
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert relative_error(out, ref_out) < 1e-2
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    if sinks is None:
        assert (np.asarray(out, np.float32)[0, 0, 0] == 0).all()
