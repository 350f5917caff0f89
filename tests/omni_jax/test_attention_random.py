"""Random problems on the compiled GPU kernels.

The shared suite's cases are small (one or two tiles). These draw sizes up to 1200
rows, every head dim, GQA ratio and mask combination at random (fresh each run;
a failure names the whole problem and the input seed), and check each block of 32
rows of the output and the gradients against float64 on its own, so a wrong tile
at a ragged tail cannot hide in the norm of the whole tensor.

``OMNI_JAX_RANDOM_DRAWS`` sets the number of problems per backend (default 4, so that the
GPU suite fits one device call): a larger soak on a GPU machine is one environment
variable away.
"""

import dataclasses
import os

import numpy as np
import pytest

from pallas_kernels import runtime
from pallas_kernels.mosaic import attention_bwd_sm90 as bwd
from tests.forced_configs import force_config_fields
from tests.omni_jax.attention_suite import check_case, random_case

_CAPABILITY = runtime.gpu_compute_capability()
_DRAWS = int(os.environ.get("OMNI_JAX_RANDOM_DRAWS", "4"))

# (dtypes, head dims, mask block sizes, needs sm90) per implementation. "mosaic-split":
# the Mosaic backward's fused dQ in two launches (FULL steps, masked steps) at every walk
# length; by default only masks of thousands of rows (long walks) take it. Head dim 96
# takes it with kv blocks of 64 (one dK/dV consumer) only (`bwd.fused_dq_splits`); head
# dim 64 with kv blocks of 128 splits dQ by rows (128-row steps).
_BACKENDS = {
    # Block sizes other than the kernels' own ((64, 64), (256, 128)) are re-tiled.
    "mosaic": (("bfloat16", "float16"), (64, 80, 96, 128, 192, 256),
               ((128, 64), (128, 128), (64, 64), (256, 128)), True),
    "mosaic-split": (("bfloat16", "float16"), (64, 96, 128), ((128, 64), (128, 128)), True),
    "triton": (("float32", "bfloat16", "float16"), (32, 64, 96, 128, 256),
               ((32, 32), (64, 64), (128, 64)), False),
    None: (("bfloat16", "float16"), (64, 96, 128, 192),
           ((32, 32), (64, 64), (128, 64), (128, 128)), False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("draw", range(_DRAWS))
@pytest.mark.parametrize("implementation", list(_BACKENDS), ids=str)
def test_random_problem(implementation, draw, monkeypatch):
    dtypes, head_dims, block_sizes, needs_sm90 = _BACKENDS[implementation]
    if runtime.interpret_requested() or _CAPABILITY is None:
        pytest.skip("needs a CUDA GPU (compiled kernels)")
    if needs_sm90 and _CAPABILITY != (9, 0):
        pytest.skip("needs an sm90 GPU")
    split = implementation == "mosaic-split"
    if split:
        implementation = "mosaic"
        force_config_fields(monkeypatch, bwd, "backward_config", fused_dq=True,
                            fused_dq_min_full_walk=0.0)
    rng = np.random.default_rng()
    case = random_case(rng, head_dims)
    dtype = dtypes[int(rng.integers(len(dtypes)))]
    block_size = block_sizes[int(rng.integers(len(block_sizes)))]
    if implementation == "mosaic" and max(case.head_dim, case.head_dim_v or 0) > 128:
        block_size = (128, 64)  # K and V tiles of 128 x 256 do not fit shared memory.
    if split:  # the fused dQ's atomic adds
        case = dataclasses.replace(case, deterministic=False)
    check_case(implementation, case, dtype, block_size, block_rows=32)
