"""Persistent, warp-specialized, TMA-pipelined GEMM for Hopper (sm90), in Pallas Mosaic-GPU.

Structure of one CTA (``num_consumers + 1`` warpgroups):

* the producer warpgroup (last one) walks this CTA's output tiles and, for each,
  streams the K loop's A and B tiles into a ``stages``-deep shared-memory ring
  with TMA. Slot ``s`` has a *full* barrier (TMA bytes landed) and an *empty*
  barrier (every consumer that reads it is done). The ring position is one
  counter running across tiles, so the producer prefetches the next tile's K
  loop while the consumers are still in this tile's epilogue.
* consumer warpgroups wait on *full*, issue wgmma into register accumulators
  (keeping one wgmma in flight) and release slots on *empty*. Cooperative
  schedule: they split each CTA tile by rows. Pingpong: they take alternate
  tiles, so one's epilogue overlaps the other's main loop; the ring is still
  one, filled in tile order, but each consumer has its own set of full/empty
  barriers (a barrier's phase parity is tracked by the threads that wait on it,
  so each barrier must see every phase of its waiters). The epilogue (scale,
  bias, activation, cast) goes through shared memory and TMA stores that are
  not waited for: they drain during the next tile's main loop.

Tiles are visited in a grouped order (``group_m`` M-tiles per band) for L2 reuse.
Tails need no padding: TMA zero-fills out-of-bounds loads (zeros add nothing to
the K sum) and clips out-of-bounds stores. Mosaic's TMA views global arrays in
128-byte swizzle rows, which limits the sizes this kernel takes (see
`unsupported_reason`); `omni_jax.matmul` sends the others to the Triton kernel.
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

# Usable dynamic shared memory per CTA on H100 (227 KiB), less room for barriers.
SMEM_BYTES = 227 * 1024 - 1024
# Register budget split (per thread): the producer only issues TMA.
_PRODUCER_REGISTERS = 40
_CONSUMER_REGISTERS = 232
# A consumer warpgroup (128 threads) holds its accumulator in registers: at
# most 192 float32 per thread, leaving room for addresses and the epilogue.
_MAX_ACC_ELEMENTS = 128 * 192


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiling and schedule of the Hopper GEMM.

    Each consumer warpgroup accumulates ``tile_m x tile_n`` in float32 registers.
    Cooperative (default): the consumers split one ``(num_consumers * tile_m,
    tile_n)`` CTA tile and share one ring of operand stages. ``pingpong``: each
    consumer takes every other ``tile_m x tile_n`` tile of the CTA; the producer
    fills the one ring in tile order, so one consumer's main loop runs while the
    other's epilogue does. ``cluster_n=2`` pairs CTAs on
    neighbouring tiles of one tile row: they multicast the A block they share,
    halving its traffic from L2.
    ``stages`` K steps are buffered in shared memory; ``wgmma_in_flight`` (0 or 1)
    products may still run while a consumer waits for the next step.
    ``group_m`` CTA rows of tiles form one band of the grouped order.
    ``num_programs`` persistent CTAs (default: one per SM) share the tiles.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 4
    num_consumers: int = 2
    epilogue_tile_m: int = 64
    epilogue_tile_n: int = 64
    group_m: int = 8
    wgmma_in_flight: int = 1
    pingpong: bool = False
    cluster_n: int = 1
    num_programs: int | None = None

    @property
    def barrier_sets(self) -> int:
        """Sets of full/empty ring barriers: one per consumer (pingpong) or one shared."""
        return self.num_consumers if self.pingpong else 1

    @property
    def parts(self) -> int:
        """Consumers whose A blocks one ring stage holds."""
        return 1 if self.pingpong else self.num_consumers

    @property
    def cta_tile_m(self) -> int:
        """Rows of the tiles the grid walks."""
        return self.parts * self.tile_m

    def smem_bytes(self, in_dtype, out_dtype, vectors: int = 0) -> int:
        """Shared memory the kernel allocates with this config and ``vectors`` epilogue
        vectors (scale, bias)."""
        in_bytes = jnp.dtype(in_dtype).itemsize
        ring = self.stages * (self.cta_tile_m + self.tile_n) * self.tile_k * in_bytes
        out = (
            self.num_consumers * 2 * self.epilogue_tile_m * self.epilogue_tile_n
            * jnp.dtype(out_dtype).itemsize
        )
        return ring + out + self.num_consumers * vectors * self.tile_n * 4

    def check(self, problem: GemmProblem) -> None:
        """Raises ValueError when this config cannot run ``problem``."""
        if self.tile_m % 64 or self.tile_n % 8 or not 8 <= self.tile_n <= 256:
            raise ValueError(
                f"wgmma needs tile_m % 64 == 0 and tile_n in 8..256 step 8; got {self}"
            )
        if self.tile_m * self.tile_n > _MAX_ACC_ELEMENTS:
            raise ValueError(
                f"a {self.tile_m}x{self.tile_n} float32 accumulator needs more than"
                f" {_MAX_ACC_ELEMENTS // 128} registers per thread: {self}"
            )
        in_bytes = problem.in_dtype.itemsize
        transpose_a, transpose_b = stored_layouts(problem)
        if self.tile_k * in_bytes != SWIZZLE_BYTES:
            raise ValueError(
                f"tile_k must span one {SWIZZLE_BYTES}-byte swizzle row; got {self.tile_k}"
            )
        minor_dims = {}  # other swizzled minor dims of the smem tiles
        if transpose_a:
            minor_dims["tile_m"] = self.tile_m
        if not transpose_b:
            minor_dims["tile_n"] = self.tile_n
        for name, size in minor_dims.items():
            if size * in_bytes % SWIZZLE_BYTES:
                raise ValueError(
                    f"{name} must span a multiple of {SWIZZLE_BYTES} bytes; got {size}"
                )
        if self.wgmma_in_flight not in (0, 1):
            raise ValueError(f"wgmma_in_flight must be 0 or 1; got {self}")
        if self.cluster_n not in (1, 2):
            raise ValueError(f"cluster_n must be 1 or 2; got {self}")
        if self.tile_m % self.epilogue_tile_m or self.tile_n % self.epilogue_tile_n:
            raise ValueError(f"epilogue tile must divide (tile_m, tile_n); got {self}")
        needed = self.smem_bytes(
            problem.in_dtype, problem.out_dtype, epilogue_vector_count(problem))
        if needed > SMEM_BYTES:
            raise ValueError(
                f"config needs {needed} bytes of shared memory, more than {SMEM_BYTES}: {self}"
            )


# Warpgroup tiles the defaults choose from, with the relative mainloop efficiency
# of their CTA tile (operand bytes per MAC: bigger tiles reuse more). 64x256
# warpgroup tiles (a 128x256 CTA tile, as CUTLASS's Hopper GEMMs) issue the
# widest wgmma, which reads the fewest shared-memory bytes per product.
_DEFAULT_TILES = (((64, 256), 1.0), ((128, 128), 1.0), ((64, 128), 0.9), ((64, 64), 0.75))
H100_SMS = 132


def default_config(
    m: int, n: int, k: int, in_dtype, out_dtype, *, vectors: int = 0, batch: int = 1,
    num_sms: int = H100_SMS,
) -> MatmulConfig:
    """Defaults per shape class, with the deepest ring that fits in shared memory.

    Big outputs take 128x256 CTA tiles (two 64x256 warpgroup tiles). Otherwise
    the CTA tile is the one that best fills the last wave of ``num_sms``
    persistent CTAs, weighed against a smaller tile's lower operand reuse.
    ``vectors`` counts the epilogue's scale and bias vectors.
    """
    del k
    tile_k = 128 // jnp.dtype(in_dtype).itemsize  # one 128-byte swizzle span

    def score(choice):
        (tile_m, tile_n), efficiency = choice
        tiles = batch * pl.cdiv(m, 2 * tile_m) * pl.cdiv(n, tile_n)
        filled = efficiency * tiles / (pl.cdiv(tiles, num_sms) * num_sms)
        # Ties (a single partial wave): the tile that computes the least padding.
        return filled, -tiles * 2 * tile_m * tile_n

    (tile_m, tile_n), _ = max(_DEFAULT_TILES, key=score)  # then: the earlier tile
    base = MatmulConfig(
        tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
        epilogue_tile_n=SWIZZLE_BYTES // jnp.dtype(out_dtype).itemsize,
    )
    for stages in range(6, 1, -1):
        config = dataclasses.replace(base, stages=stages)
        if config.smem_bytes(in_dtype, out_dtype, vectors) <= SMEM_BYTES:
            return config
    return dataclasses.replace(base, stages=2)


def unsupported_reason(problem: GemmProblem) -> str | None:
    """Why this kernel cannot run ``problem`` (None when it can); devices are not checked.

    The limits are those of the TMA staging (`matmul_common.tma_unsupported_reason`).
    """
    return tma_unsupported_reason(problem)


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
    cta_m = c.cta_tile_m
    m_tiles = pl.cdiv(p.m, cta_m)
    # The grid walks groups of cluster_n neighbouring tiles of one tile row (a
    # cluster's CTAs take one each); with an odd count the last CTA's tile lies
    # past N, where TMA loads zeros and stores nothing.
    n_groups = pl.cdiv(pl.cdiv(p.n, c.tile_n), c.cluster_n)
    k_iters = pl.cdiv(p.k, c.tile_k)
    num_tiles = p.batch * m_tiles * n_groups
    multicast = "cluster" if c.cluster_n > 1 else None
    epi_m, epi_n = c.epilogue_tile_m, c.epilogue_tile_n
    a_block = (c.tile_k, c.tile_m) if p.transpose_a else (c.tile_m, c.tile_k)
    b_block = (c.tile_n, c.tile_k) if p.transpose_b else (c.tile_k, c.tile_n)

    def tile_coords(lin):
        """(batch indices of a, b, the epilogue vectors (a tuple) and out; m offset;
        n offset) of linear tile ``lin``."""
        bi = lin // (m_tiles * n_groups)
        mi, gi = grouped_tile(lin % (m_tiles * n_groups), m_tiles, n_groups, c.group_m)
        ni = gi * c.cluster_n + (lax.axis_index("cluster") if multicast else 0)
        idx = (
            operand_batch_index(bi, p.batch_shape, p.a_batch),
            operand_batch_index(bi, p.batch_shape, p.b_batch),
            tuple(operand_batch_index(bi, p.batch_shape, own) for _, own in vectors),
            bi,
        )
        return idx, mi * cta_m, ni * c.tile_n

    def a_tile(ai, m0, ki, wg):
        rows = pl.ds(m0 + wg * c.tile_m, c.tile_m)
        cols = pl.ds(ki * c.tile_k, c.tile_k)
        return a_gmem.at[ai, cols, rows] if p.transpose_a else a_gmem.at[ai, rows, cols]

    def b_tile(bi, n0, ki):
        rows = pl.ds(ki * c.tile_k, c.tile_k)
        cols = pl.ds(n0, c.tile_n)
        return b_gmem.at[bi, cols, rows] if p.transpose_b else b_gmem.at[bi, rows, cols]

    def scoped(a_buf, b_buf, out_buf, vec_smems, full, empty, vec_bar):
        wg = lax.axis_index("wg")
        # (tiled view for wgmma and register stores, view that TMA addresses)
        a_smem, a_tma = a_buf if untiled_tma["a"] else (a_buf, a_buf)
        b_smem, b_tma = b_buf if untiled_tma["b"] else (b_buf, b_buf)
        out_smem, out_tma = out_buf if untiled_tma["out"] else (out_buf, out_buf)

        def bar(step):
            """Index of ring step ``step``'s full/empty barriers: slot, in the set of the
            consumer whose tile the step belongs to (steps run k_iters per tile)."""
            owner = lax.rem(step // k_iters, c.barrier_sets)
            return owner * c.stages + lax.rem(step, c.stages)

        def producer():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

            @plgpu.nd_loop((num_tiles,), collective_axes="sm")
            def _tile(info):
                (lin,) = info.index
                (ai, bi, _, _), m0, n0 = tile_coords(lin)

                @pl.loop(0, k_iters)
                def _k(ki):
                    step = info.local_index * k_iters + ki
                    slot = lax.rem(step, c.stages)

                    # The slot's previous contents (step - stages) must be consumed.
                    @pl.when(step >= c.stages)
                    def _():
                        plgpu.barrier_wait(empty.at[bar(step - c.stages)])

                    for part in range(c.parts):
                        # With a cluster, both CTAs issue this copy of their shared
                        # A block; each loads half and multicasts it to both.
                        plgpu.copy_gmem_to_smem(
                            a_tile(ai, m0, ki, part), a_tma.at[slot, part], full.at[bar(step)],
                            collective_axes=multicast,
                        )
                    plgpu.copy_gmem_to_smem(b_tile(bi, n0, ki), b_tma.at[slot], full.at[bar(step)])

            # Observe the releases of the last `stages` steps too, so that every
            # phase of every empty barrier is waited on before the CTA exits.
            local_tiles = pl.cdiv(num_tiles - lax.axis_index("sm"), num_programs)
            num_steps = local_tiles * k_iters

            @pl.loop(jnp.maximum(num_steps - c.stages, 0), num_steps)
            def _drain(step):
                plgpu.barrier_wait(empty.at[bar(step)])

        def consumer():
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")

            # Cooperative: every consumer reads its part of every stage. Pingpong:
            # consumer wg takes every barrier_sets-th tile, whole.
            part = 0 if c.pingpong else wg

            @plgpu.nd_loop((num_tiles,), collective_axes="sm")
            def _tile(info):
                (lin,) = info.index
                (_, _, vec_indices, oi), m0, n0 = tile_coords(lin)
                own_tile = info.local_index // c.barrier_sets  # among this consumer's tiles
                first_step = info.local_index * k_iters

                def compute_tile():
                    # Epilogue vectors for this tile; the copy overlaps the main loop.
                    for vec, vi, smem in zip(vec_gmems, vec_indices, vec_smems, strict=True):
                        plgpu.copy_gmem_to_smem(
                            vec.at[vi, pl.ds(n0, c.tile_n)], smem.at[wg], vec_bar.at[wg]
                        )
                    pl.run_scoped(main_loop, plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))

                def main_loop(acc_ref):
                    @pl.loop(0, k_iters)
                    def _k(ki):
                        slot = lax.rem(first_step + ki, c.stages)
                        plgpu.barrier_wait(full.at[bar(first_step + ki)])
                        a_op = a_smem.at[slot, part]
                        if p.transpose_a:
                            a_op = a_op.transpose((1, 0))
                        b_op = b_smem.at[slot]
                        if p.transpose_b:
                            b_op = b_op.transpose((1, 0))
                        plgpu.wgmma(acc_ref, a_op, b_op)
                        # Keep `wgmma_in_flight` products running while the next
                        # slot is awaited; the slot of the one that completed is free.
                        plgpu.wgmma_wait(c.wgmma_in_flight)
                        done = ki - c.wgmma_in_flight

                        @pl.when(done >= 0)
                        def _():
                            plgpu.barrier_arrive(empty.at[bar(first_step + done)])

                    plgpu.wgmma_wait(0)
                    for late in range(max(0, k_iters - c.wgmma_in_flight), k_iters):
                        plgpu.barrier_arrive(empty.at[bar(first_step + late)])

                    store_tile(acc_ref[...], m0 + part * c.tile_m, n0, oi, own_tile)

                if c.pingpong:
                    pl.when(lax.rem(info.local_index, c.barrier_sets) == wg)(compute_tile)
                else:
                    compute_tile()

            # The last TMA stores must finish reading shared memory before the CTA exits.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def store_tile(acc, row0, n0, oi, local_tile):
            if vec_gmems:
                plgpu.barrier_wait(vec_bar.at[wg])
            chunks_n = c.tile_n // epi_n
            for em in range(c.tile_m // epi_m):
                for en in range(chunks_n):
                    chunk_row, chunk_col = row0 + em * epi_m, n0 + en * epi_n
                    # Two staging slots alternate over this CTA's whole sequence of
                    # chunks; the store issued two chunks ago read this slot.
                    chunk = local_tile * (chunks_n * (c.tile_m // epi_m)) + em * chunks_n + en
                    slot = lax.rem(chunk, 2)

                    def store_chunk(em=em, en=en, chunk_row=chunk_row, chunk_col=chunk_col,
                                    slot=slot):
                        cols = slice(en * epi_n, (en + 1) * epi_n)
                        vecs = [smem[wg, cols] for smem in vec_smems]
                        scale = vecs.pop(0) if p.has_scale else None
                        bias = vecs.pop(0) if p.has_bias else None
                        rows = slice(em * epi_m, (em + 1) * epi_m)
                        tile = epilogue(acc[rows, cols], scale, bias, p.activation, p.out_dtype)
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        out_smem[wg, slot] = tile
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_tma.at[wg, slot],
                            out_gmem.at[oi, pl.ds(chunk_row, epi_m), pl.ds(chunk_col, epi_n)],
                        )

                    if p.m % c.cta_tile_m == 0 and p.n % c.tile_n == 0:
                        store_chunk()
                        continue
                    # A chunk wholly past the output's end is not stored: the hardware
                    # would clip it, but Mosaic takes a slice as wide as its dimension
                    # (an output one chunk wide) to start at 0, and the chunk's zeros
                    # would overwrite the first one. Skipping a store breaks the slot
                    # alternation's guarantee, so the next store waits for all reads.
                    in_bounds = (chunk_row < p.m) & (chunk_col < p.n)
                    pl.when(in_bounds)(store_chunk)
                    pl.when(~in_bounds)(
                        lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))

        lax.cond(wg == c.num_consumers, producer, consumer)

    pl.run_scoped(
        scoped,
        a_buf=tma_staging((c.stages, c.parts, *a_block), p.in_dtype, untiled_tma["a"]),
        b_buf=tma_staging((c.stages, *b_block), p.in_dtype, untiled_tma["b"]),
        out_buf=tma_staging((c.num_consumers, 2, epi_m, epi_n), p.out_dtype, untiled_tma["out"]),
        # Each epilogue vector in its own dtype (a 16-bit bias is widened in the epilogue).
        vec_smems=tuple(plgpu.SMEM((c.num_consumers, c.tile_n), v.dtype) for v in vec_gmems),
        # Per (barrier set, stage). full: one TMA arrival per A block and one for B.
        full=plgpu.Barrier(num_arrivals=c.parts + 1, num_barriers=c.barrier_sets * c.stages),
        # empty: one arrival per consumer warpgroup that reads the stage, in
        # every CTA of the cluster (a multicast writes the stage in all of them).
        empty=(
            plgpu.ClusterBarrier(
                collective_axes=(multicast,), num_arrivals=c.parts,
                num_barriers=c.barrier_sets * c.stages,
            )
            if multicast
            else plgpu.Barrier(num_arrivals=c.parts, num_barriers=c.barrier_sets * c.stages)
        ),
        vec_bar=plgpu.Barrier(num_arrivals=max(1, len(vec_gmems)), num_barriers=c.num_consumers),
        collective_axes="wg",
    )


def _num_sms() -> int:
    """SMs of the device (H100's count where there is no GPU)."""
    device = jax.devices()[0]
    return getattr(device, "core_count", None) if device.platform == "gpu" else H100_SMS


def _num_programs(config: MatmulConfig, num_tiles: int) -> int:
    """Persistent CTA clusters: one CTA per SM, at most one cluster per tile group."""
    if config.num_programs is not None:
        programs = config.num_programs
    elif runtime.interpret_requested():
        programs = 2 * config.cluster_n  # exercises the persistent loop, cheap to interpret
    else:
        programs = _num_sms()
    return max(1, min(programs // config.cluster_n, num_tiles))


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
    """Batched ``act(op(a) @ op(b) * scale + bias)`` on Hopper; operands as in ``matmul_common``.

    Returns ``(*batch_shape, M, N)``. Validation of user input lives in
    ``omni_jax.matmul``; this raises ValueError only for unsupported layouts or configs.
    """
    a, b, p = mosaic_problem(
        a, b, scale, bias, transpose_a=transpose_a, transpose_b=transpose_b,
        activation=activation, out_dtype=jnp.dtype(out_dtype or a.dtype), mma="wgmma",
        unsupported_reason=unsupported_reason)
    config = config or _TUNED.get(tuning_key(p)) or default_config(
        p.m, p.n, p.k, p.in_dtype, p.out_dtype, vectors=epilogue_vector_count(p),
        batch=p.batch, num_sms=_num_sms(),
    )
    config.check(p)
    n_groups = pl.cdiv(pl.cdiv(p.n, config.tile_n), config.cluster_n)
    num_tiles = p.batch * pl.cdiv(p.m, config.cta_tile_m) * n_groups
    num_programs = _num_programs(config, num_tiles)  # clusters, when cluster_n > 1
    cluster = (dict(cluster=(config.cluster_n,), cluster_names=("cluster",))
               if config.cluster_n > 1 else {})
    return launch_mosaic_gemm(
        functools.partial(_kernel, p=p, config=config, num_programs=num_programs), p,
        config.epilogue_tile_n, a, b, scale, bias, num_programs=num_programs,
        num_threads=config.num_consumers + 1, cluster=cluster)


# Autotuned winners (`set_tuned`), by `tuning_key`; `matmul` prefers them to the defaults.
_TUNED: dict[tuple, MatmulConfig] = {}


def tuned_configs() -> frozenset:
    """A hashable snapshot of the autotuned configs (read while tracing, so part of the
    key under which `omni_jax.matmul` caches its compiled calls)."""
    return frozenset(_TUNED.items())


def tuning_key(p: GemmProblem) -> tuple:
    """What the best config depends on: sizes, layouts and dtypes (not the epilogue)."""
    return (p.m, p.n, p.k, p.transpose_a, p.transpose_b, str(p.in_dtype), str(p.out_dtype))


def set_tuned(p: GemmProblem, config: MatmulConfig) -> None:
    """Makes ``config`` the one `matmul` uses for problems with ``p``'s `tuning_key`
    (an autotuner's winner: `benchmarks.matmul_autotune`)."""
    _TUNED[tuning_key(p)] = config


def config_candidates(in_dtype, out_dtype, vectors: int = 0) -> list[MatmulConfig]:
    """The autotuning search space: warpgroup tiles x the two deepest rings x grouping,
    cooperative and pingpong."""
    tile_k = 128 // jnp.dtype(in_dtype).itemsize
    configs = []
    for tile_m, tile_n in ((128, 128), (64, 256), (128, 192), (64, 128), (64, 64)):
        base = MatmulConfig(
            tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
            epilogue_tile_n=SWIZZLE_BYTES // jnp.dtype(out_dtype).itemsize,
        )
        fitting = [
            dataclasses.replace(base, stages=stages)
            for stages in range(8, 1, -1)
            if dataclasses.replace(base, stages=stages).smem_bytes(in_dtype, out_dtype, vectors)
            <= SMEM_BYTES
        ]
        for config in fitting[:2]:
            configs += [dataclasses.replace(config, group_m=g) for g in (8, 16)]
    configs.append(dataclasses.replace(configs[0], wgmma_in_flight=0))
    for tile_m, tile_n in ((128, 128), (64, 256)):
        pingpong = MatmulConfig(
            tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, pingpong=True,
            epilogue_tile_n=SWIZZLE_BYTES // jnp.dtype(out_dtype).itemsize,
        )
        for stages in range(6, 1, -1):
            config = dataclasses.replace(pingpong, stages=stages)
            if config.smem_bytes(in_dtype, out_dtype, vectors) <= SMEM_BYTES:
                configs += [dataclasses.replace(config, group_m=g) for g in (8, 16)]
                break
    # A multicast across CTA pairs, for 128x128 tiles with the deepest ring of
    # each schedule.
    deepest: dict[bool, MatmulConfig] = {}
    for config in configs:
        if (config.tile_m, config.tile_n, config.group_m, config.wgmma_in_flight) != (
            128, 128, 8, 1
        ):
            continue
        best = deepest.get(config.pingpong)
        if best is None or config.stages > best.stages:
            deepest[config.pingpong] = config
    configs += [dataclasses.replace(config, cluster_n=2) for config in deepest.values()]
    return configs


__all__ = [
    "MatmulConfig", "config_candidates", "default_config", "matmul", "set_tuned",
    "tuning_key", "unsupported_reason",
]
