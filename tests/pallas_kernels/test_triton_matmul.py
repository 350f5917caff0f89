"""The portable Triton GEMM lowers for CUDA (to TTIR) for every layout, epilogue and dtype.

Its numerics are tested through ``omni_jax.matmul`` (tests/omni_jax/test_matmul.py), except
for operand batches that call cannot make; those run here, interpreted where there is no GPU.
"""

import jax.numpy as jnp
import pytest

from pallas_kernels import runtime
from pallas_kernels.triton import matmul as triton_matmul
from tests.jax_releases import skip_unless_triton_lowers_here
from tests.omni_jax.matmul_helpers import check_vectors_batched_apart
from tests.pallas_kernels.gemm_lowering import LOWERING_CASES, lower_gemm_for_cuda


@pytest.fixture
def _compiling(monkeypatch):
    skip_unless_triton_lowers_here()
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)


@pytest.mark.parametrize("case", LOWERING_CASES, ids=str)
def test_lowers_for_cuda(case, _compiling):
    case = dict(case)
    m = case.pop("m", 1000)
    text = lower_gemm_for_cuda(triton_matmul, m, 776, 1096, case.pop("dtype", jnp.bfloat16),
                               **case)
    assert "triton" in text


def test_big_tiles_lower(_compiling):
    config = triton_matmul.default_config(8192, 8192, 8192, jnp.bfloat16)
    assert (config.block_m, config.block_n) == (128, 256)
    lower_gemm_for_cuda(triton_matmul, 8192, 8192, 8192, jnp.bfloat16, config=config)


@pytest.mark.usefixtures("interpret_pallas_without_gpu")
@pytest.mark.parametrize("batched", ["scale", "bias"])
def test_epilogue_vectors_are_read_at_their_own_batch(batched):
    check_vectors_batched_apart(triton_matmul, batched, 40, 24, 40)
