"""Persistent, warp-specialized tcgen05 GEMM for datacenter Blackwell (sm100), in Pallas
Mosaic-GPU.

Structure of one CTA (two warpgroups):

* warpgroup 0 is split into warps. Warp 0 (TMA) walks this CTA's output tiles and
  streams each tile's K loop of A and B blocks into a ``stages``-deep shared-memory
  ring. Warp 1 (MMA) issues the tcgen05 MMAs (one thread issues each) that
  accumulate a tile in tensor memory (TMEM). Warps 2 and 3 idle.
* warpgroup 1 (epilogue) reads a finished accumulator out of TMEM in
  ``epilogue_tile_n``-column chunks, applies scale, bias, activation and the output
  cast in registers, and stores each chunk through shared memory with TMA.

Three pipelines connect them, each a ring whose position is one running count
(`RingPosition`), never re-aligned per tile:

* operand stages (A and B blocks), counted in K steps over all of this CTA's tiles:
  *full* (TMA bytes landed; the MMA warp waits) and *empty* (the MMAs that read the
  stage completed: a tcgen05 commit arrives; the TMA warp waits). The TMA warp runs
  ahead into the next tile's K loop while the MMAs of this one drain.
* two TMEM accumulators, counted in tiles: *tmem_full* (the tile's last MMA
  completed: a tcgen05 commit; the epilogue waits) and *tmem_empty* (the epilogue
  read every chunk; the MMA warp waits before overwriting). The epilogue of tile t
  overlaps the MMAs of tile t + 1.
* two output staging buffers, counted in chunks: a TMA store's read of its buffer
  is awaited (bulk async group) before the buffer two chunks later overwrites it.

Mosaic tracks each barrier's phase parity per waiting thread, so a ring position
only needs its slot; a waiter must see every phase, so the TMA and MMA warps wait
out the last releases of their rings before the CTA exits, and the epilogue waits
for its last TMA stores: every asynchronous operation is complete when the kernel
ends.

``collective=True`` pairs the CTAs of a cluster of two on one ``2 tile_m x tile_n``
tile: each loads half the A rows and half the B columns (TMA partitioned over
the pair, arrivals tracked by the leader), and the leader's MMA warp issues
2-CTA MMAs that read both CTAs' shared memory, so each B block crosses L2 once per
pair instead of once per CTA. Commits arrive on both CTAs' barriers; each CTA's
epilogue stores its own rows; the leader waits for both epilogues
(a cluster barrier) before reusing an accumulator.

Tiles are visited in a grouped order (``group_m`` M-tiles per band) for L2 reuse.
Tails need no padding: TMA zero-fills out-of-bounds loads and clips out-of-bounds
stores. The sizes the TMA staging takes are those of the Hopper kernel
(`matmul_common.tma_unsupported_reason`); fp8 operands are read K-major as there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import runtime
from pallas_kernels.matmul_common import (
    SWIZZLE_BYTES,
    GemmProblem,
    epilogue,
    epilogue_vector_count,
    grouped_tile,
    launch_mosaic_gemm,
    mosaic_problem,
    operand_batch_index,
    stored_layouts,
    tma_staging,
    tma_unsupported_reason,
)

# Usable dynamic shared memory per CTA on B200 (227 KiB, as on H100), less room for
# barriers.
SMEM_BYTES = 227 * 1024 - 1024
# Tensor memory per SM: 128 lanes x 512 columns of 32 bits.
TMEM_COLUMNS = 512
B200_SMS = 148
_TMA_WARP, _MMA_WARP = 0, 1
_CONTROL_WG, _EPILOGUE_WG = 0, 1
_PAIR = "cluster"  # the cluster axis of the 2-CTA configuration


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiling and schedule of the Blackwell GEMM.

    A CTA accumulates ``tile_m x tile_n`` (``tile_m`` = 128 TMEM lanes) in float32
    TMEM, twice over (two accumulators: ``2 * tile_n`` of the 512 columns).
    ``collective``: a cluster of two CTAs computes one ``2 tile_m x tile_n`` tile with
    2-CTA MMAs, each CTA staging its A rows and half of the B columns.
    ``stages`` K steps of ``tile_k`` are buffered in shared memory; the epilogue moves
    ``epilogue_tile_n`` columns at a time. ``group_m`` tile rows form one band of the
    grouped order. ``num_programs`` persistent CTAs (default: one per SM) share the
    tiles.
    """

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    stages: int = 4
    epilogue_tile_n: int = 64
    group_m: int = 8
    collective: bool = False
    num_programs: int | None = None

    @property
    def cluster_size(self) -> int:
        return 2 if self.collective else 1

    @property
    def cluster_tile_m(self) -> int:
        """Rows of the tiles the grid walks (both CTAs' rows when collective)."""
        return self.cluster_size * self.tile_m

    @property
    def b_block_n(self) -> int:
        """Columns of B one CTA stages per K step."""
        return self.tile_n // self.cluster_size

    def smem_bytes(self, in_dtype, out_dtype, vectors: int = 0) -> int:
        """Shared memory the kernel allocates with this config and ``vectors`` epilogue
        vectors (scale, bias)."""
        in_bytes = jnp.dtype(in_dtype).itemsize
        ring = self.stages * (self.tile_m + self.b_block_n) * self.tile_k * in_bytes
        out = 2 * self.tile_m * self.epilogue_tile_n * jnp.dtype(out_dtype).itemsize
        return ring + out + vectors * self.tile_n * 4

    def check(self, problem: GemmProblem) -> None:
        """Raises ValueError when this config cannot run ``problem``."""
        if self.tile_m != 128:
            raise ValueError(f"tile_m must be 128 (the TMEM lanes); got {self.tile_m}")
        n_step = 16 * self.cluster_size
        if self.tile_n % n_step or not n_step <= self.tile_n <= 256:
            raise ValueError(
                f"tcgen05 needs tile_n a multiple of {n_step} in {n_step}..256; got {self}"
            )
        if 2 * self.tile_n > TMEM_COLUMNS:
            raise ValueError(f"two {self.tile_n}-column accumulators exceed TMEM: {self}")
        in_bytes = problem.in_dtype.itemsize
        if self.tile_k * in_bytes != SWIZZLE_BYTES:
            raise ValueError(
                f"tile_k must span one {SWIZZLE_BYTES}-byte swizzle row; got {self.tile_k}"
            )
        transpose_a, transpose_b = stored_layouts(problem)
        minor_dims = {}  # other swizzled minor dims of the smem blocks
        if transpose_a:
            minor_dims["tile_m"] = self.tile_m
        if not transpose_b:
            minor_dims["tile_n per CTA"] = self.b_block_n
        for name, size in minor_dims.items():
            if size * in_bytes % SWIZZLE_BYTES:
                raise ValueError(
                    f"{name} must span a multiple of {SWIZZLE_BYTES} bytes; got {size}"
                )
        if self.tile_n % self.epilogue_tile_n or self.epilogue_tile_n % 8:
            raise ValueError(
                f"epilogue_tile_n must divide tile_n and be a multiple of 8; got {self}")
        if self.stages < 2:
            raise ValueError(f"stages must be at least 2; got {self.stages}")
        needed = self.smem_bytes(
            problem.in_dtype, problem.out_dtype, epilogue_vector_count(problem))
        if needed > SMEM_BYTES:
            raise ValueError(
                f"config needs {needed} bytes of shared memory, more than {SMEM_BYTES}: {self}"
            )


# Tile widths the defaults choose from, with their relative main-loop efficiency: a
# 128x256 MMA reads 96 bytes of shared memory per cycle at the full tcgen05 rate, a
# 128x128 one 128 (all of it), so it is taken only where it fills the last wave better.
_DEFAULT_TILE_N = ((256, 1.0), (128, 0.75))


def default_config(
    m: int, n: int, k: int, in_dtype, out_dtype, *, vectors: int = 0, batch: int = 1,
    num_sms: int = B200_SMS,
) -> MatmulConfig:
    """Single-CTA tiles 128 rows high and 256 (or, where that fills the last of the waves of
    ``num_sms`` persistent CTAs better, 128) columns wide, with the deepest operand ring
    that fits in shared memory. ``vectors`` counts the epilogue's scale and bias vectors."""
    del k

    def score(choice):
        tile_n, efficiency = choice
        tiles = batch * pl.cdiv(m, 128) * pl.cdiv(n, tile_n)
        filled = efficiency * tiles / (pl.cdiv(tiles, num_sms) * num_sms)
        return filled, -tiles * tile_n  # ties: the least padding

    tile_n, _ = max(_DEFAULT_TILE_N, key=score)
    base = MatmulConfig(
        tile_n=tile_n,
        tile_k=SWIZZLE_BYTES // jnp.dtype(in_dtype).itemsize,
        epilogue_tile_n=SWIZZLE_BYTES // jnp.dtype(out_dtype).itemsize,
    )
    for stages in range(8, 2, -1):
        config = dataclasses.replace(base, stages=stages)
        if config.smem_bytes(in_dtype, out_dtype, vectors) <= SMEM_BYTES:
            return config
    return dataclasses.replace(base, stages=2)


def unsupported_reason(problem: GemmProblem) -> str | None:
    """Why this kernel cannot run ``problem`` (None when it can); devices are not checked.

    The limits are those of the TMA staging (`matmul_common.tma_unsupported_reason`).
    """
    return tma_unsupported_reason(problem)


@dataclasses.dataclass(frozen=True)
class RingPosition:
    """Where the ``count``-th use of a ring of ``depth`` slots falls: its ``slot``, and
    ``lap``, how many times the ring went round before it (lap > 0: the slot holds an
    earlier use, whose release must be awaited; the parity of lap is the phase)."""

    slot: jax.Array
    lap: jax.Array

    @classmethod
    def of(cls, count: jax.Array, depth: int) -> RingPosition:
        return cls(slot=lax.rem(count, depth), lap=lax.div(count, depth))


def _kernel(
    *refs, p: GemmProblem, config: MatmulConfig, num_programs: int, untiled_tma: dict[str, bool]
):
    """Kernel body; ``refs`` are a, b, [scale], [bias], out."""
    a_gmem, b_gmem, *rest = refs
    scale_gmem = rest.pop(0) if p.has_scale else None
    bias_gmem = rest.pop(0) if p.has_bias else None
    (out_gmem,) = rest
    # The epilogue vectors present, each with its own batch shape.
    vectors = [(v, own) for v, own in ((scale_gmem, p.scale_batch), (bias_gmem, p.bias_batch))
               if v is not None]
    vec_gmems = [v for v, _ in vectors]

    c = config
    m_tiles = pl.cdiv(p.m, c.cluster_tile_m)
    n_tiles = pl.cdiv(p.n, c.tile_n)
    k_iters = pl.cdiv(p.k, c.tile_k)
    num_tiles = p.batch * m_tiles * n_tiles
    epi_n = c.epilogue_tile_n
    chunks = c.tile_n // epi_n
    pair = _PAIR if c.collective else None
    a_block = (c.tile_k, c.tile_m) if p.transpose_a else (c.tile_m, c.tile_k)
    b_block = (c.b_block_n, c.tile_k) if p.transpose_b else (c.tile_k, c.b_block_n)

    def tile_coords(lin):
        """(batch indices of a, b, the epilogue vectors (a tuple) and out; m offset of
        the cluster's tile; n offset) of linear tile ``lin``."""
        bi = lax.div(lin, m_tiles * n_tiles)
        mi, ni = grouped_tile(lax.rem(lin, m_tiles * n_tiles), m_tiles, n_tiles, c.group_m)
        idx = (
            operand_batch_index(bi, p.batch_shape, p.a_batch),
            operand_batch_index(bi, p.batch_shape, p.b_batch),
            tuple(operand_batch_index(bi, p.batch_shape, own) for _, own in vectors),
            bi,
        )
        return idx, mi * c.cluster_tile_m, ni * c.tile_n

    def scoped(a_buf, b_buf, out_buf, vec_smems, acc_tmem, full, empty, tmem_full,
               tmem_empty, vec_bar):
        # (tiled view for the MMA and register stores, view that TMA addresses)
        a_smem, a_tma = a_buf if untiled_tma["a"] else (a_buf, a_buf)
        b_smem, b_tma = b_buf if untiled_tma["b"] else (b_buf, b_buf)
        out_smem, out_tma = out_buf if untiled_tma["out"] else (out_buf, out_buf)
        leader = lax.axis_index(_PAIR) == 0 if pair else True
        # The persistent grid strides over the tiles. Axis indices are read here, in
        # warpgroup context (jax 0.10 names no grid axis inside `warp_map`).
        program = lax.axis_index("sm")
        local_tiles = pl.cdiv(num_tiles - program, num_programs)

        def for_each_tile(body):
            """Runs ``body(local_index, linear_tile)`` over this CTA's (cluster's) tiles."""
            pl.loop(0, local_tiles)(lambda local: body(local, program + local * num_programs))

        def copy_operands(ai, bi, m0, n0, ki, slot):
            """Starts the TMA loads of K step ``ki``'s A and B blocks into ``slot``. A pair
            loads the cluster's whole blocks, each CTA its half (arrivals on the leader)."""
            rows = pl.ds(m0, c.cluster_tile_m)
            ks = pl.ds(ki * c.tile_k, c.tile_k)
            cols = pl.ds(n0, c.tile_n)
            a_src = a_gmem.at[ai, ks, rows] if p.transpose_a else a_gmem.at[ai, rows, ks]
            b_src = b_gmem.at[bi, cols, ks] if p.transpose_b else b_gmem.at[bi, ks, cols]
            for src, dst, m_or_n_axis in ((a_src, a_tma, 1 if p.transpose_a else 0),
                                          (b_src, b_tma, 0 if p.transpose_b else 1)):
                partition = dict(collective_axes=pair,
                                 leader_tracked=plgpu.CopyPartition.PARTITIONED(m_or_n_axis))
                plgpu.copy_gmem_to_smem(src, dst.at[slot], full.at[slot],
                                        **(partition if pair else {}))

        def tma_warp():
            @for_each_tile
            def _tile(local, lin):
                (ai, bi, _, _), m0, n0 = tile_coords(lin)

                @pl.loop(0, k_iters)
                def _k(ki):
                    stage = RingPosition.of(local * k_iters + ki, c.stages)

                    @pl.when(stage.lap > 0)
                    def _():
                        plgpu.barrier_wait(empty.at[stage.slot])

                    copy_operands(ai, bi, m0, n0, ki, stage.slot)

            # The MMAs of the last `stages` steps release their stages too: observe
            # them, so that every phase of every empty barrier is waited on.
            num_steps = local_tiles * k_iters

            @pl.loop(lax.max(num_steps - c.stages, 0), num_steps)
            def _drain(step):
                plgpu.barrier_wait(empty.at[RingPosition.of(step, c.stages).slot])

        def mma_warp():
            @for_each_tile
            def _tile(local, lin):
                acc = RingPosition.of(local, 2)

                @pl.when(acc.lap > 0)
                def _():  # The epilogue has read the tile this accumulator held before.
                    plgpu.barrier_wait(tmem_empty.at[acc.slot])

                acc_ref = acc_tmem.at[:, pl.ds(acc.slot * c.tile_n, c.tile_n)]

                @pl.loop(0, k_iters)
                def _k(ki):
                    stage = RingPosition.of(local * k_iters + ki, c.stages)
                    plgpu.barrier_wait(full.at[stage.slot])
                    a_op = a_smem.at[stage.slot]
                    if p.transpose_a:
                        a_op = a_op.transpose((1, 0))
                    b_op = b_smem.at[stage.slot]
                    if p.transpose_b:
                        b_op = b_op.transpose((1, 0))
                    # Releases the stage when this MMA completes.
                    plgpu.tcgen05_mma(acc_ref, a_op, b_op, empty.at[stage.slot],
                                      accumulate=ki > 0, collective_axis=pair)

                plgpu.tcgen05_commit_arrive(tmem_full.at[acc.slot], collective_axis=pair)

            # Observe the epilogue's release of the last two accumulators as well.
            @pl.loop(lax.max(local_tiles - 2, 0), local_tiles)
            def _drain(t):
                plgpu.barrier_wait(tmem_empty.at[RingPosition.of(t, 2).slot])

        def control_warpgroup():
            @plgpu.warp_map
            def _per_warp(warp):
                pl.when(warp == _TMA_WARP)(tma_warp)
                pl.when((warp == _MMA_WARP) & leader)(mma_warp)

        def epilogue_warpgroup():
            @for_each_tile
            def _tile(local, lin):
                (_, _, vec_indices, oi), m0, n0 = tile_coords(lin)
                row0 = m0 + (lax.axis_index(_PAIR) * c.tile_m if pair else 0)
                # This tile's epilogue vectors; the copy overlaps the tile's MMAs.
                for vec, vi, smem in zip(vec_gmems, vec_indices, vec_smems, strict=True):
                    plgpu.copy_gmem_to_smem(vec.at[vi, pl.ds(n0, c.tile_n)], smem, vec_bar)
                acc = RingPosition.of(local, 2)
                plgpu.barrier_wait(tmem_full.at[acc.slot])
                if vec_gmems:
                    plgpu.barrier_wait(vec_bar)
                for chunk in range(chunks):
                    store_chunk(acc, chunk, local * chunks + chunk, row0, n0, oi)
                # Every TMEM load of the accumulator done: the MMA warp may overwrite it.
                plgpu.wait_load_tmem()
                plgpu.barrier_arrive(tmem_empty.at[acc.slot])

            # The last TMA stores must finish reading shared memory before the CTA exits.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def store_chunk(acc, chunk, count, row0, n0, oi):
            cols = pl.ds(chunk * epi_n, epi_n)
            chunk_col = n0 + chunk * epi_n
            staging = RingPosition.of(count, 2)

            def store():
                values = plgpu.async_load_tmem(
                    acc_tmem.at[:, pl.ds(acc.slot * c.tile_n + chunk * epi_n, epi_n)])
                vecs = [smem[cols] for smem in vec_smems]
                scale = vecs.pop(0) if p.has_scale else None
                bias = vecs.pop(0) if p.has_bias else None
                tile = epilogue(values, scale, bias, p.activation, p.out_dtype)
                # The store issued two chunks ago read this buffer.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_smem[staging.slot] = tile
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_tma.at[staging.slot],
                    out_gmem.at[oi, pl.ds(row0, c.tile_m), pl.ds(chunk_col, epi_n)],
                )

            if p.m % c.cluster_tile_m == 0 and p.n % c.tile_n == 0:
                store()
                return
            # A chunk wholly past the output's end is not stored: the hardware would
            # clip it, but Mosaic takes a slice as wide as its dimension (an output one
            # chunk wide) to start at 0, and the chunk's zeros would overwrite the first
            # one. Skipping a store breaks the buffer alternation's guarantee, so the
            # next store waits for all reads.
            in_bounds = (row0 < p.m) & (chunk_col < p.n)
            pl.when(in_bounds)(store)
            pl.when(~in_bounds)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))

        wg = lax.axis_index("wg")
        pl.when(wg == _CONTROL_WG)(control_warpgroup)
        pl.when(wg == _EPILOGUE_WG)(epilogue_warpgroup)

    cluster_barrier = functools.partial(plgpu.ClusterBarrier, collective_axes=(_PAIR,))
    pl.run_scoped(
        scoped,
        a_buf=tma_staging((c.stages, *a_block), p.in_dtype, untiled_tma["a"]),
        b_buf=tma_staging((c.stages, *b_block), p.in_dtype, untiled_tma["b"]),
        out_buf=tma_staging((2, c.tile_m, epi_n), p.out_dtype, untiled_tma["out"]),
        # Each epilogue vector in its own dtype (a 16-bit bias is widened in the epilogue).
        vec_smems=tuple(plgpu.SMEM((c.tile_n,), v.dtype) for v in vec_gmems),
        acc_tmem=plgpu.TMEM((c.tile_m, 2 * c.tile_n), jnp.float32, collective=c.collective),
        # full: one TMA arrival for A and one for B (on the leader of a pair).
        full=plgpu.Barrier(num_arrivals=2, num_barriers=c.stages),
        # empty, tmem_full: a tcgen05 commit (to both CTAs of a pair).
        empty=plgpu.Barrier(num_barriers=c.stages, orders_tensor_core=True),
        tmem_full=plgpu.Barrier(num_barriers=2, orders_tensor_core=True),
        # tmem_empty: the epilogue warpgroup of every CTA that reads the accumulator.
        tmem_empty=(cluster_barrier if pair else plgpu.Barrier)(
            num_barriers=2, orders_tensor_core=True),
        vec_bar=plgpu.Barrier(num_arrivals=max(1, len(vec_gmems))),
        collective_axes="wg",
    )


def _num_programs(config: MatmulConfig, num_tiles: int) -> int:
    """Persistent clusters: one CTA per SM, at most one cluster per tile."""
    if config.num_programs is not None:
        programs = config.num_programs
    elif runtime.interpret_requested():
        programs = 2 * config.cluster_size  # exercises the persistent loop, cheap to interpret
    else:
        programs = runtime.num_sms()
    return max(1, min(programs // config.cluster_size, num_tiles))


def matmul(
    a: jax.Array,
    b: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
    activation: str | None = None,
    out_dtype=None,
    config: MatmulConfig | None = None,
) -> jax.Array:
    """Batched ``act(op(a) @ op(b) * scale + bias)`` on Blackwell; operands as in
    ``matmul_common``.

    Returns ``(*batch_shape, M, N)``. Validation of user input lives in
    ``omni_jax.matmul``; this raises ValueError only for unsupported layouts or configs.
    """
    a, b, p = mosaic_problem(
        a, b, scale, bias, transpose_a=transpose_a, transpose_b=transpose_b,
        activation=activation, out_dtype=jnp.dtype(out_dtype or a.dtype), mma="tcgen05",
        unsupported_reason=unsupported_reason)
    config = config or default_config(
        p.m, p.n, p.k, p.in_dtype, p.out_dtype, vectors=epilogue_vector_count(p),
        batch=p.batch, num_sms=runtime.num_sms())
    config.check(p)
    num_tiles = p.batch * pl.cdiv(p.m, config.cluster_tile_m) * pl.cdiv(p.n, config.tile_n)
    num_programs = _num_programs(config, num_tiles)  # clusters, when collective
    return launch_mosaic_gemm(
        functools.partial(_kernel, p=p, config=config, num_programs=num_programs), p,
        config.epilogue_tile_n, a, b, scale, bias, num_programs=num_programs, num_threads=2,
        cluster=dict(cluster=(2,), cluster_names=(_PAIR,)) if config.collective else {})


__all__ = ["MatmulConfig", "RingPosition", "default_config", "matmul", "unsupported_reason"]
