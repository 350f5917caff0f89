"""`omni_jax.paged_attention` on random valid calls (hypothesis) against float64.

The named cases of `test_paged_attention` and `test_paged_attention_mosaic` pin one
feature each; these draw them together: ragged lengths from 0 to a full table, prefill
chunks longer than a cache, GQA groups that do and do not divide the kernels' row tiles,
windows on one or both sides, softcap, scale, sinks and a value head dim of its own, on
pages shuffled through a cache with spare pages and garbage ids past each sequence's
tokens. The kernels run interpreted (`OMNI_JAX_PALLAS_INTERPRET=1`; the Mosaic-GPU
interpreter fails on a race, both fill unwritten outputs with NaN).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omni_jax
from pallas_kernels import runtime
from tests.mosaic_interpret import interpreted_mosaic
from tests.omni_jax.paged.paged_reference import dense_paged_reference, random_case
from tests.reference import relative_error

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


@dataclasses.dataclass(frozen=True)
class Backend:
    """What one implementation serves: the draws stay within it."""

    dtypes: tuple
    head_dims: tuple[int, ...]
    page_sizes: tuple[int, ...]
    examples: int


BACKENDS = {
    "xla": Backend((jnp.float32, jnp.bfloat16), (8, 24, 32), (1, 3, 8, 16), 8),
    # Rows gathered whole: power-of-two head dims only.
    "triton": Backend((jnp.float32, jnp.bfloat16, jnp.float16), (16, 32, 64), (4, 8, 16, 64),
                      6),
    # Pages that tile the forward's 64- or 128-key blocks, 16-bit types, the head dims it reads
    # unpadded.
    "mosaic": Backend((jnp.bfloat16, jnp.float16), (64, 96, 128), (16, 32, 64), 4),
}


@st.composite
def paged_calls(draw, backend: Backend):
    """(random_case arguments, paged_attention arguments, with sinks) of one valid call."""
    batch = draw(st.integers(1, 3))
    page_size = draw(st.sampled_from(backend.page_sizes))
    pages_per_seq = draw(st.integers(1, max(1, 192 // page_size)))
    capacity = page_size * pages_per_seq
    kv_lens = draw(st.lists(st.integers(0, capacity), min_size=batch, max_size=batch))
    kv_heads = draw(st.sampled_from((1, 2)))
    head_dim = draw(st.sampled_from(backend.head_dims))
    case = dict(kv_lens=kv_lens, q_len=draw(st.integers(1, 6)),
                heads=kv_heads * draw(st.sampled_from((1, 2, 3, 4))), kv_heads=kv_heads,
                head_dim=head_dim, head_dim_v=draw(st.sampled_from(backend.head_dims)),
                page_size=page_size, pages_per_seq=pages_per_seq,
                spare_pages=draw(st.integers(1, 3)), dtype=draw(st.sampled_from(backend.dtypes)))
    is_causal = draw(st.booleans())
    side = st.integers(0, capacity + 8)
    window = draw(st.none() | st.tuples(side, side if not is_causal else st.just(0)))
    call = dict(is_causal=is_causal, local_window_size=window,
                softcap=draw(st.none() | st.floats(1.0, 30.0)),
                scale=draw(st.none() | st.floats(0.05, 1.0)))
    return case, call, draw(st.booleans())


@pytest.fixture(params=[
    "xla",
    pytest.param("triton", marks=pytest.mark.interpreted),
    pytest.param("mosaic", marks=pytest.mark.interpreted),
])
def implementation(request, monkeypatch):
    """Each implementation, the kernels interpreted."""
    if request.param == "mosaic":
        for _ in interpreted_mosaic(monkeypatch):  # Fails the test on a race.
            yield "mosaic"
        runtime.reset_mosaic_interpreter()
    else:
        if request.param == "triton":
            monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
        yield request.param


def test_random_calls_match_float64(implementation, seed):
    backend = BACKENDS[implementation]

    @settings(max_examples=backend.examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(paged_calls(backend))
    def check(drawn):
        case_args, kwargs, with_sinks = drawn
        case = random_case(seed, **case_args)
        dtype = case_args["dtype"]
        sinks = (jax.random.normal(jax.random.key(seed + 1), (case_args["heads"],),
                                   jnp.float32) if with_sinks else None)
        out, lse = omni_jax.paged_attention(
            case.q, case.k_pages, case.v_pages, case.page_table, case.kv_lens, sinks=sinks,
            return_lse=True, implementation=implementation, **kwargs)
        assert out.dtype == dtype and lse.dtype == jnp.float32
        with jax.enable_x64(True):
            ref_out, ref_lse = dense_paged_reference(
                case, is_causal=kwargs["is_causal"], window=kwargs["local_window_size"],
                softcap=kwargs["softcap"], sinks=sinks, scale=kwargs["scale"])
        assert relative_error(out, ref_out) < TOLERANCE[dtype], drawn
        assert relative_error(lse, ref_lse) < TOLERANCE[dtype], drawn

    check()
