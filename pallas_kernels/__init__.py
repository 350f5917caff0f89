"""Pallas GPU kernels behind omni_jax's backends.

`triton/` holds the portable Triton-lowered kernels (sm80+), `mosaic/` the
Mosaic-GPU kernels for Hopper. `runtime` decides whether kernels run compiled
or in Pallas interpret mode (``OMNI_JAX_PALLAS_INTERPRET=1``), and `compat`
hides the JAX API differences (Pallas, `jax.shard_map` types) between the releases
we support.
"""
