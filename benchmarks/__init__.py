"""Benchmarks: our kernels timed beside their peers (cuDNN, cuBLAS, XLA, JAX's Pallas ops)."""
