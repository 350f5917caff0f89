"""The shared attention suite on the XLA backend, plus what only the reference backend does."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import omni_jax
from omni_jax.scores import primitive_names
from tests.omni_jax.attention_suite import AttentionSuite, Case, check_case
from tests.reference import dense_mask, reference_attention, relative_error


class TestXlaAttention(AttentionSuite):
    implementation = "xla"


def test_float64_is_exact():
    with jax.enable_x64(True):
        for case in (Case("causal_ragged", q_len=45, kv_len=77, is_causal=True, sinks=True),
                     Case("documents", q_len=80, kv_len=80, segments="packed",
                          score_mod="alibi")):
            check_case("xla", case, "float64", (32, 32))


@settings(max_examples=12, deadline=None)
@given(q_len=st.integers(1, 70), kv_len=st.integers(1, 70), causal=st.booleans(),
       window=st.none() | st.tuples(st.integers(0, 20), st.integers(0, 20)),
       num_q_segments=st.integers(1, 4), num_kv_segments=st.integers(1, 4))
def test_property_masks_and_blind_rows(q_len, kv_len, causal, window, num_q_segments,
                                       num_kv_segments):
    """Random mask combinations, many with queries that see no key: zeros, lse -inf, no NaN."""
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, n, 2, 16)) for n in (q_len, kv_len, kv_len))
    q_ids = np.sort(rng.integers(0, num_q_segments, (1, q_len)), axis=1).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, num_kv_segments, (1, kv_len)), axis=1).astype(np.int32)
    out, lse = omni_jax.attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), is_causal=causal,
        local_window_size=window, q_segment_ids=jnp.asarray(q_ids),
        kv_segment_ids=jnp.asarray(kv_ids), return_lse=True, implementation="xla")
    mask = dense_mask(1, 2, q_len, kv_len, is_causal=causal, window=window,
                      q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    with jax.enable_x64(True):
        expected_out, expected_lse = reference_attention(q, k, v, mask)
    blind = ~mask.any(-1)  # [B, H, Sq]
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    np.testing.assert_array_equal(np.asarray(lse)[blind], -np.inf)
    np.testing.assert_array_equal(np.asarray(out).transpose(0, 2, 1, 3)[blind], 0.0)
    assert relative_error(out, expected_out) < 1e-5
    assert relative_error(lse, expected_lse) < 1e-5


def test_masks_of_static_arguments_are_built_at_trace_time():
    """is_causal / windows need no traced array: their BlockMask walks are constants of
    the jitted call, not sorted again on the device at every call; segment ids are traced."""
    q = jnp.ones((1, 512, 2, 32), jnp.float32)
    causal = jax.make_jaxpr(lambda q: omni_jax.attention(
        q, q, q, is_causal=True, local_window_size=(100, 0), implementation="xla"))(q)
    assert "sort" not in primitive_names(causal.jaxpr)
    segments = jnp.zeros((1, 512), jnp.int32)
    documents = jax.make_jaxpr(lambda q, s: omni_jax.attention(
        q, q, q, q_segment_ids=s, implementation="xla"))(q, segments)
    assert "sort" in primitive_names(documents.jaxpr)


def test_segment_ids_differing_above_bit_31_are_other_documents():
    """int64 ids (jax_enable_x64) are not truncated to int32, traced or not."""
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 40, 2, 16)), jnp.float32) for _ in range(3))
    small = np.sort(rng.integers(0, 3, (2, 40)), axis=1)
    expected = omni_jax.attention(q, k, v, q_segment_ids=jnp.asarray(small, jnp.int32),
                                  implementation="xla")
    with jax.enable_x64(True):
        ids = jnp.asarray(small * 2**32, jnp.int64)
        call = lambda ids: omni_jax.attention(q, k, v, q_segment_ids=ids, implementation="xla")
        for out in (call(ids), jax.jit(call)(ids)):
            np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-6)
