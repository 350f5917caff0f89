"""Digests of the Mosaic-GPU kernels as lowered for CUDA: did a refactor change a kernel?

Lowers the attention (forward and backward), paged attention and GEMM cases of the
lowering tests without a GPU and prints one digest per case of the Mosaic-GPU modules it produced,
printed without debug locations (file paths and line numbers). Run it in two trees
and diff the outputs: equal digests mean the GPU runs the same kernels, so their
speed cannot have moved.

    PYTHONPATH=$PWD python scripts/kernel_digests.py > after.txt

Reads the modules at `jax.experimental.mosaic.gpu.core._run_serde_pass`, a JAX
internal: a JAX release that renames it fails here loudly.
"""

from __future__ import annotations

import functools
import hashlib
import re

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mosaic_core

import omni_jax
from pallas_kernels import runtime
from pallas_kernels.mosaic import matmul_sm90
from tests.pallas_kernels import gemm_lowering
from tests.pallas_kernels.mosaic import test_attention_lowering as attention_lowering

_modules: list[str] = []


def _recording(serde_pass):
    def run(module, **kwargs):
        result = serde_pass(module, **kwargs)
        text = result.operation.get_asm(enable_debug_info=False)
        # The dump name counts the kernels lowered so far: a case's digest must not
        # depend on the cases before it.
        _modules.append(re.sub(r'dump_basename = "[^"]*"', "dump_basename", text))
        return result

    return run


def _digest(lower) -> str:
    _modules.clear()
    try:
        lower()
    except Exception as error:  # noqa: BLE001 - a case that does not lower is a line too
        return f"error {type(error).__name__}"
    text = "\n".join(_modules)
    return f"{hashlib.sha256(text.encode()).hexdigest()[:16]} ({len(_modules)} kernels)"


# Paged calls (batch, q_len, query heads, kv heads, head dim, page size, pages a
# sequence, causal): decoding steps under GQA, a chunk of a prefill, one without causality.
PAGED_CASES = ((2, 1, 8, 2, 128, 16, 8, True), (2, 3, 8, 2, 128, 64, 4, True),
               (1, 128, 4, 4, 64, 32, 16, False))


def _lower_paged(batch, q_len, heads, kv_heads, head_dim, page_size, pages, causal) -> None:
    q = jax.ShapeDtypeStruct((batch, q_len, heads, head_dim), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((batch * pages + 1, page_size, kv_heads, head_dim),
                                 jnp.bfloat16)
    table = jax.ShapeDtypeStruct((batch, pages), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def call(q, k_pages, v_pages, page_table, kv_lens):
        return omni_jax.paged_attention(q, k_pages, v_pages, page_table, kv_lens,
                                        is_causal=causal, implementation="mosaic")

    jax.jit(call).trace(q, cache, cache, table, lengths).lower(lowering_platforms=("cuda",))


def main() -> None:
    mosaic_core._run_serde_pass = _recording(mosaic_core._run_serde_pass)
    runtime.can_run_mosaic_hopper = lambda: True  # lower as on an sm90 GPU
    for name in sorted(attention_lowering.VARIANTS):
        print(f"attention {name}:",
              _digest(lambda name=name: attention_lowering._lowered_backward(name)))
    for case in PAGED_CASES:
        print(f"paged {case}:", _digest(functools.partial(_lower_paged, *case)))
    for index, case in enumerate(gemm_lowering.LOWERING_CASES):
        options = dict(case)
        m, dtype = options.pop("m", 512), options.pop("dtype", jnp.bfloat16)
        lower = functools.partial(gemm_lowering.lower_gemm_for_cuda, matmul_sm90, m, 512, 512,
                                  dtype, **options)
        print(f"gemm sm90 {index} {case}:", _digest(lower))


if __name__ == "__main__":
    main()
