"""Which implementation serves a paged_attention call, as a Hopper GPU would see it."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import omni_jax
from omni_jax import dispatch_log
from omni_jax.paged import backends
from pallas_kernels import runtime


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(dispatch_log, "_warned", set())
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    monkeypatch.setattr(runtime, "gpu_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(runtime, "can_run_triton", lambda: True)
    monkeypatch.setattr(runtime, "implementation_preference", lambda: ("mosaic", "triton", "xla"))


def _problem(head_dim=128, dtype=jnp.bfloat16, page_size=16, pages_per_seq=256, **shape):
    return backends.PagedProblem(jnp.dtype(dtype), head_dim, head_dim, page_size,
                                 pages_per_seq, **shape)


def test_hopper_takes_the_mosaic_kernel(hopper):
    assert backends.choose(None, _problem()) == "mosaic"


@pytest.mark.parametrize("shape", [
    dict(batch=8, num_kv_heads=8, group=4),  # 64 programs: kv splits fill the SMs
    dict(batch=1, num_kv_heads=8, group=4),
    dict(batch=64, num_kv_heads=8, group=4),  # 512 programs
    dict(batch=256, num_kv_heads=8, group=4),
    dict(batch=64, q_len=512, num_kv_heads=8, group=4),  # a prefill chunk
])
def test_every_shape_takes_mosaic_first(hopper, shape):
    assert backends.choose(None, _problem(**shape)) == "mosaic"


@pytest.mark.parametrize("page_size, pages_per_seq, q_len, head_dim, expected", [
    (16, 64, 1, 128, "triton"),  # a table of 1024 tokens (`SHORT_CACHE_TOKENS`)
    (64, 4, 1, 128, "triton"),
    (16, 65, 1, 128, "mosaic"),  # 1040 tokens
    (16, 64, 2, 128, "mosaic"),  # two queries a sequence: a prefill chunk
    (16, 64, 1, 96, "mosaic"),  # the Triton kernel declines head dim 96
])
def test_decoding_steps_over_short_caches_take_triton_first(hopper, page_size, pages_per_seq,
                                                             q_len, head_dim, expected):
    problem = _problem(head_dim=head_dim, page_size=page_size, pages_per_seq=pages_per_seq,
                       batch=256, q_len=q_len, num_kv_heads=8, group=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.choose(None, problem) == expected


@pytest.mark.parametrize("problem, reason", [
    (_problem(dtype=jnp.float32), "dtype float32"),
    (_problem(head_dim=32), "head_dim=32"),
    (_problem(page_size=8), "page_size=8"),
    (_problem(pages_per_seq=1 << 15), "a page table row of 32768 pages"),
])
def test_what_mosaic_declines_goes_to_triton_quietly(hopper, problem, reason):
    assert reason in backends.unsupported_reason("mosaic", problem)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.choose(None, problem) == "triton"


def test_a_head_dim_the_kernel_declines_falls_back_to_xla_with_a_warning(hopper):
    with pytest.warns(UserWarning, match="paged_attention runs on the XLA reference.*"
                                         "not triton: head_dim=80 is not a power of two"):
        assert backends.choose(None, _problem(head_dim=80)) == "xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.choose("xla", _problem(head_dim=80)) == "xla"


def test_naming_a_kernel_that_declines_raises(hopper):
    with pytest.raises(ValueError, match="implementation='triton' cannot serve.*float64"):
        backends.choose("triton", _problem(dtype=jnp.float64))


def test_float64_runs_on_the_reference(seed):
    with jax.enable_x64(True):
        q = jax.random.normal(jax.random.key(seed), (1, 1, 2, 16), jnp.float64)
        pages = jax.random.normal(jax.random.key(seed + 1), (2, 4, 1, 16), jnp.float64)
        out, lse = omni_jax.paged_attention(q, pages, pages, jnp.array([[1, 0]]),
                                            jnp.array([6]), return_lse=True)
        assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
