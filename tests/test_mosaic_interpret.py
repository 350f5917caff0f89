"""`tests.mosaic_interpret` fails a test whose kernel races (the detector is live)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat, runtime
from tests.mosaic_interpret import interpreted_mosaic


def _racy_kernel(out_ref, smem):
    # Two warpgroups write the same smem with no barrier between them: a race.
    smem[...] = jnp.full(smem.shape, lax.axis_index("wg"), jnp.float32)
    plgpu.commit_smem()

    @pl.when(lax.axis_index("wg") == 0)
    def _():
        plgpu.copy_smem_to_gmem(smem, out_ref)
        plgpu.wait_smem_to_gmem(0)


@pytest.mark.interpreted
def test_a_race_fails_the_test(monkeypatch):
    fixture = interpreted_mosaic(monkeypatch)
    next(fixture)
    params = compat.tma_faithful_interpret_params(runtime.mosaic_interpret_params())
    kernel = compat.mosaic_kernel(
        _racy_kernel, jax.ShapeDtypeStruct((128,), jnp.float32),
        scratch_types=[plgpu.SMEM((128,), jnp.float32)], num_threads=2, thread_name="wg",
        interpret=params)
    try:
        jax.block_until_ready(kernel())
    except Exception as error:  # jax 0.11 and later: the interpreter raises at the race.
        runtime.reset_mosaic_interpreter()
        assert "RACE DETECTED" in str(error)
        return
    with pytest.raises(AssertionError, match="data race"):  # jax 0.10: it records races.
        next(fixture)
