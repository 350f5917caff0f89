"""Portable Pallas kernels lowered through Triton (sm80+: Ampere, Ada, Hopper)."""
