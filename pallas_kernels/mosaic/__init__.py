"""Pallas Mosaic-GPU kernels for Hopper (sm90): TMA, wgmma, warp specialization."""
