"""`omni_jax.paged_attention` on every implementation that runs here, against float64.

The Triton kernel runs interpreted (`OMNI_JAX_PALLAS_INTERPRET=1`); the interpreter
fills outputs with NaN before the kernel runs, so a row no program writes fails the
comparison (`relative_error` is inf on NaN).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from pallas_kernels import runtime
from tests.omni_jax.paged.paged_reference import dense_paged_reference, random_case
from tests.reference import reference_attention, relative_error

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# name: (random_case arguments, paged_attention arguments)
CASES = {
    "decode_ragged": (dict(kv_lens=[37, 64, 1, 50]), {}),
    "decode_empty_sequence": (dict(kv_lens=[0, 21]), {}),
    "prefill_chunk_mqa": (dict(kv_lens=[40, 29], q_len=5, heads=4, kv_heads=1), {}),
    "prefill_chunk_longer_than_cache": (dict(kv_lens=[3, 33], q_len=6), {}),
    "mha_not_causal": (dict(kv_lens=[30, 17], q_len=3, heads=2), dict(is_causal=False)),
    "window": (dict(kv_lens=[70, 45], q_len=4), dict(local_window_size=(9, 0))),
    "window_both_sides_not_causal": (dict(kv_lens=[70, 45], q_len=4),
                                     dict(is_causal=False, local_window_size=(5, 2))),
    # Sides past int32 (a window wider than any cache) must not overflow positions.
    "window_beyond_int32": (dict(kv_lens=[70, 45], q_len=4), dict(local_window_size=(2**40, 0))),
    "window_beyond_int32_not_causal": (dict(kv_lens=[70, 45], q_len=4),
                                       dict(is_causal=False, local_window_size=(2**40, 2**40))),
    "softcap_scale": (dict(kv_lens=[33, 48]), dict(softcap=3.0, scale=0.4)),
    "small_pages": (dict(kv_lens=[35, 7, 90], page_size=4, heads=8, kv_heads=2), {}),
    "large_pages_spare_table": (dict(kv_lens=[70, 130], page_size=64, pages_per_seq=5), {}),
    "head_dim_v": (dict(kv_lens=[20, 41], head_dim=16, head_dim_v=64, q_len=2), {}),
}


_ON_GPU = runtime.gpu_compute_capability() is not None


@pytest.fixture(params=[
    "xla",
    pytest.param("triton", marks=pytest.mark.interpreted),
    pytest.param("triton_compiled", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")]),
])
def implementation(request, monkeypatch):
    """Each implementation; "triton" interpreted on any machine, compiled on a GPU."""
    if request.param == "triton":
        monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    return request.param.removesuffix("_compiled")


def _check(case, kwargs, implementation, *, sinks=None, dtype=jnp.float32):
    out, lse = omni_jax.paged_attention(case.q, case.k_pages, case.v_pages, case.page_table,
                                        case.kv_lens, sinks=sinks, return_lse=True,
                                        implementation=implementation, **kwargs)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    with jax.enable_x64(True):
        window = kwargs.get("local_window_size")
        ref_out, ref_lse = dense_paged_reference(
            case, is_causal=kwargs.get("is_causal", True), window=window,
            softcap=kwargs.get("softcap"), sinks=sinks, scale=kwargs.get("scale"))
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
    assert relative_error(lse, ref_lse) < TOLERANCE[dtype]


@pytest.mark.parametrize("name", CASES)
def test_matches_dense_reference(name, implementation, seed):
    case_args, kwargs = CASES[name]
    _check(random_case(seed, **case_args), kwargs, implementation)


def test_bfloat16_gqa_with_sinks(implementation, seed):
    case = random_case(seed, kv_lens=[0, 75, 19], q_len=2, heads=8, kv_heads=2,
                       dtype=jnp.bfloat16)
    sinks = jax.random.normal(jax.random.key(seed + 1), (8,), jnp.float32)
    _check(case, {}, implementation, sinks=sinks, dtype=jnp.bfloat16)


def test_a_sequence_without_tokens_gets_zeros_and_its_sink(seed):
    case = random_case(seed, kv_lens=[0, 12])
    sinks = jnp.arange(4.0)
    out, lse = omni_jax.paged_attention(case.q, case.k_pages, case.v_pages, case.page_table,
                                        case.kv_lens, sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(lse[0], np.broadcast_to(np.arange(4.0)[:, None], (4, 1)))
    out = omni_jax.paged_attention(case.q, case.k_pages, case.v_pages, case.page_table,
                                   case.kv_lens)
    assert np.all(np.isfinite(out)) and np.all(out[0] == 0)


def test_bad_page_ids_under_jit_are_masked_not_read(implementation, seed):
    """Ids outside the cache for tokens in use, under jit (no concrete check), contribute
    nothing: each sequence gets the reference over its other tokens."""
    case = random_case(seed, kv_lens=[40, 40], spare_pages=0)
    bad_table = case.page_table.at[0, 1].set(10_000).at[1, 0].set(-7)
    out = jax.jit(lambda *a: omni_jax.paged_attention(*a, implementation=implementation))(
        case.q, case.k_pages, case.v_pages, bad_table, case.kv_lens)
    for b, bad_slot in ((0, 1), (1, 0)):
        assert relative_error(out[b], _reference_without_slot(case, b, bad_slot)) < 2e-5


@pytest.mark.parametrize("window", [None, 30])
def test_lengths_past_the_table_under_jit_keep_their_positions(implementation, window, seed):
    """A length past the table's pages (garbage under jit, unchecked) reads nothing past
    the table, and the query keeps its position: it sees the table's tokens within its
    window (with none, all of them)."""
    case = random_case(seed, kv_lens=[40, 48], spare_pages=0)  # a table of 48 tokens
    too_long = [58, 70]
    out = jax.jit(lambda *a: omni_jax.paged_attention(
        *a, local_window_size=None if window is None else (window, 0),
        implementation=implementation))(
        case.q, case.k_pages, case.v_pages, case.page_table, jnp.array(too_long, jnp.int32))
    for b, length in enumerate(too_long):
        # The same keys as a query at the table's end with a window reaching as far back.
        one = case.__class__(case.q[b:b + 1], case.k_pages, case.v_pages,
                             case.page_table[b:b + 1], jnp.array([48], jnp.int32))
        with jax.enable_x64(True):
            ref_out, _ = dense_paged_reference(
                one, window=None if window is None else (48 - length + window, 0))
        assert relative_error(out[b:b + 1], ref_out) < 2e-5


def test_a_length_of_int32_max_under_jit_walks_the_table_alone(implementation, seed):
    """The largest garbage length neither overflows a walk's tile count nor walks 2^31
    keys: the query, at its position, sees the table's tokens (as with any length past
    the table)."""
    case = random_case(seed, kv_lens=[40, 48], spare_pages=0)  # a table of 48 tokens
    lengths = jnp.array([jnp.iinfo(jnp.int32).max, 48], jnp.int32)
    out = jax.jit(lambda *a: omni_jax.paged_attention(*a, implementation=implementation))(
        case.q, case.k_pages, case.v_pages, case.page_table, lengths)
    with jax.enable_x64(True):
        ref_out, _ = dense_paged_reference(case.__class__(
            case.q, case.k_pages, case.v_pages, case.page_table, jnp.array([48, 48])))
    assert relative_error(out, ref_out) < 2e-5


def test_int64_ids_past_int32_under_jit_saturate_rather_than_wrap(seed):
    """A traced int64 id 2^32 past a valid one stays out of the cache (masked), rather
    than wrapping onto that page."""
    case = random_case(seed, kv_lens=[40, 40], spare_pages=0)
    with jax.enable_x64(True):
        table = jnp.asarray(case.page_table, jnp.int64).at[0, 1].add(2**32)
        out = jax.jit(lambda *a: omni_jax.paged_attention(*a, implementation="xla"))(
            case.q, case.k_pages, case.v_pages, table, case.kv_lens)
    assert relative_error(out[0], _reference_without_slot(case, 0, 1)) < 2e-5


def _reference_without_slot(case, b, slot):
    """Float64 output of sequence ``b`` (one query, which sees every token) with the tokens
    of its table slot ``slot`` left out."""
    page_size = case.k_pages.shape[1]
    table = np.asarray(case.page_table)[b]
    k, v = (np.asarray(p)[table].reshape(-1, *p.shape[2:]) for p in (case.k_pages,
                                                                         case.v_pages))
    keep = np.arange(k.shape[0]) < int(case.kv_lens[b])
    keep[slot * page_size:(slot + 1) * page_size] = False
    with jax.enable_x64(True):
        out, _ = reference_attention(case.q[b:b + 1], k[None, keep], v[None, keep], None)
    return out[0]


def test_vmap_over_query_sets_sharing_a_cache(implementation, seed):
    """Two sets of queries (two sampling candidates, say) against one cache."""
    case = random_case(seed, kv_lens=[19, 44])
    queries = jnp.stack([case.q, -case.q])
    attend = lambda q, lens: omni_jax.paged_attention(
        q, case.k_pages, case.v_pages, case.page_table, lens, implementation=implementation)
    lens = jnp.stack([case.kv_lens, case.kv_lens - 3])
    out = jax.jit(jax.vmap(attend))(queries, lens)
    for i in range(2):
        np.testing.assert_allclose(out[i], attend(queries[i], lens[i]), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="GPUs prefer the kernels")
def test_default_implementation_on_the_cpu_is_xla(seed):
    case = random_case(seed, kv_lens=[9])
    out = omni_jax.paged_attention(case.q, case.k_pages, case.v_pages, case.page_table,
                                   case.kv_lens)
    xla = omni_jax.paged_attention(case.q, case.k_pages, case.v_pages, case.page_table,
                                   case.kv_lens, implementation="xla")
    np.testing.assert_array_equal(out, xla)
