"""The Triton paged kernel's own knobs: kv splits, tiles smaller or larger than a page,
row tiles, and its lowering for CUDA (what the interpreter cannot check)."""

import jax
import jax.numpy as jnp
import pytest

from omni_jax import query_groups
from pallas_kernels import compat
from pallas_kernels.paged import PagedScores
from pallas_kernels.triton import paged_attention as triton_paged
from tests.omni_jax.paged.paged_reference import dense_paged_reference, random_case
from tests.reference import relative_error


def _causal(q_len, head_dim, **changes):
    return PagedScores(**{**dict(q_len=q_len, is_causal=True, window=None, softcap=None,
                                 scale=head_dim ** -0.5), **changes})


def _call(q, k_pages, v_pages, page_table, kv_lens, *, scores, config, interpret=True):
    """(out, lse) in the caller's layout, the queries packed for the kernel."""
    group = q.shape[2] // k_pages.shape[2]
    out, lse = triton_paged.paged_attention(
        query_groups.pack_queries(q, group), k_pages, v_pages, page_table, kv_lens,
        scores=scores, group=group, interpret=interpret, config=config)
    return query_groups.unpack(out, lse, group)


@pytest.mark.interpreted
@pytest.mark.parametrize("config,page_size,q_len", [
    (triton_paged.PagedConfig(block_kv=16, kv_splits=3), 16, 1),  # some shares empty
    (triton_paged.PagedConfig(block_kv=32, kv_splits=2), 64, 3),  # tiles inside a page
    (triton_paged.PagedConfig(block_rows=16, block_kv=64, kv_splits=1), 8, 9),  # 3 row tiles
])
def test_configs_match_the_reference(config, page_size, q_len, seed):
    case = random_case(seed, kv_lens=[150, 0, 77], q_len=q_len, heads=4, kv_heads=1,
                       page_size=page_size)
    out, lse = _call(case.q, case.k_pages, case.v_pages, case.page_table, case.kv_lens,
                     scores=_causal(q_len, case.q.shape[3]), config=config)
    with jax.enable_x64(True):
        ref_out, ref_lse = dense_paged_reference(case)
    assert relative_error(out, ref_out) < 2e-5
    assert relative_error(lse, ref_lse) < 2e-5


def test_default_config_splits_long_caches_of_few_sequences():
    few = triton_paged.choose_config(batch=1, rows=4, num_kv_heads=8, pages_per_seq=2048,
                                     page_size=16)
    many = triton_paged.choose_config(batch=256, rows=4, num_kv_heads=8, pages_per_seq=32,
                                      page_size=16)
    assert few.kv_splits == 49 and many.kv_splits == 1  # 3 programs on each of 132 SMs
    one_per_sm = triton_paged.PagedConfig(programs_per_sm=1)
    assert triton_paged.choose_config(batch=1, rows=4, num_kv_heads=8, pages_per_seq=2048,
                                      page_size=16, base=one_per_sm).kv_splits == 16
    forced = triton_paged.PagedConfig(kv_splits=5)
    assert triton_paged.choose_config(batch=1, rows=4, num_kv_heads=8, pages_per_seq=2048,
                                      page_size=16, base=forced) is forced


@pytest.mark.parametrize("bad", [dict(block_kv=48), dict(block_rows=8), dict(kv_splits=0),
                                 dict(programs_per_sm=0)])
def test_bad_configs_raise(bad):
    with pytest.raises(ValueError, match="must be"):
        triton_paged.PagedConfig(**bad)


@pytest.mark.skipif(not compat.triton_lowers_without_gpu(),
                    reason="this jax's Triton lowering asks the GPU for its capability")
@pytest.mark.parametrize("dtype,page_size,window", [(jnp.bfloat16, 16, None),
                                                    (jnp.float16, 64, (128, 0))])
def test_lowers_for_cuda(dtype, page_size, window):
    case = random_case(0, kv_lens=[100, 300], q_len=2, heads=8, kv_heads=2, head_dim=128,
                       page_size=page_size, dtype=dtype)
    scores = _causal(2, 128, window=window, softcap=30.0)
    call = lambda *a: _call(*a, scores=scores, interpret=False,
                            config=triton_paged.PagedConfig(kv_splits=2))
    lowered = jax.jit(call).trace(
        case.q, case.k_pages, case.v_pages, case.page_table, case.kv_lens).lower(
        lowering_platforms=("cuda",))
    assert "omni_paged_attention" in lowered.as_text()

