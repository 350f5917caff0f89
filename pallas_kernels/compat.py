"""JAX API differences between the releases we support, wrapped in one place: Pallas
(Triton and Mosaic GPU) and the types of arrays inside `jax.shard_map`.

Supported: jax 0.10.x (the CPU machines, where kernels run interpreted),
0.11.x (the GPU machines) and 0.12.x (Python 3.12's newest). Kernels import
whatever moved between releases from here instead of guarding imports
themselves, so a rename is fixed once.
Append new wrappers; keep existing signatures stable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = Any

# --------------------------------------------------------------------------- Triton lowering


def _triton_module():
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton


def triton_compiler_params(*, num_warps: int, num_stages: int) -> Any:
    """Triton compiler parameters (``CompilerParams``; ``TritonCompilerParams`` before 0.6)."""
    pl_triton = _triton_module()
    params = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return params(num_warps=num_warps, num_stages=num_stages)


def triton_overhanging_start() -> Array:
    """Start 0 as a traced value, for a window that runs past the end of a ref's axis
    under a mask (a power-of-two tile over a head dim of 40, 80 or 96): jax 0.12 rejects
    a static window that overhangs while tracing, whatever the mask; a traced start
    leaves the bounds to the mask (a zero staged into the kernel, not a Python constant;
    Triton folds it back into one)."""
    return jnp.zeros((), jnp.int32)


def triton_lowers_without_gpu() -> bool:
    """Whether Triton-lowered kernels lower for CUDA on a machine without a GPU: from jax
    0.11 on, the Triton lowering asks the (absent) device for its compute capability."""
    import jax

    return jax.__version_info__ < (0, 11)


def triton_load(ref, *, mask=None, other=None):
    """Masked load of a whole (sliced) ref in a Triton-lowered kernel."""
    load = getattr(_triton_module(), "load", None) or pl.load
    return load(ref, mask=mask, other=other)


def triton_store(ref, value, *, mask=None) -> None:
    """Masked store of a whole (sliced) ref in a Triton-lowered kernel."""
    store = getattr(_triton_module(), "store", None) or pl.store
    store(ref, value, mask=mask)


@functools.cache
def triton_lowerable_primitives() -> frozenset | None:
    """Primitives the Pallas Triton lowering handles, or None when JAX hides the table.

    The table is private to JAX; backends use it to decline user code (a
    score_mod) that would fail to lower, instead of failing inside the compiler.
    """
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return None
    rules = getattr(lowering, "triton_lowering_rules", None)
    return None if rules is None else frozenset(rules)


# --------------------------------------------------------------------------- Mosaic GPU


def bind_equation(eqn: Any, values: Sequence[Any]) -> list:
    """Binds a jaxpr equation's primitive to ``values``; its outputs as a list.

    ``Primitive.get_bind_params`` returns the params (current JAX) or, in older
    releases, a pair (sub-functions, params).
    """
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    outs = eqn.primitive.bind(*subfuns, *values, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _mosaic_module():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


@functools.cache
def _kernel_output_keyword() -> str:
    """``plgpu.kernel`` took ``out_shape`` before it took ``out_type``."""
    parameters = inspect.signature(_mosaic_module().kernel).parameters
    return "out_type" if "out_type" in parameters else "out_shape"


def mosaic_kernel(body: Callable[..., None], out_type: Any, **kwargs: Any) -> Callable:
    """``plgpu.kernel(body, out_type=...)`` under either keyword.

    Inside a `jax.shard_map` its results vary along the operands' mesh axes, typed so in
    ``out_type`` and cast after the call: jax 0.10's ``plgpu.kernel`` traces with the
    check of those axes off and types them invariant.
    """

    def call(*operands):
        axes = varying_axes(operands)
        kernel = _mosaic_module().kernel(
            body, **{_kernel_output_keyword(): _results_varying(out_type, axes)}, **kwargs)
        return vary(kernel(*operands), axes)

    return call


def mosaic_kernel_accumulating(body: Callable[..., None], out_type: Any, *,
                               scratch_types: Sequence[Any], grid: tuple[int, ...],
                               grid_names: tuple[str, ...], num_threads: int,
                               thread_name: str, compiler_params: Any = None,
                               interpret: Any = None) -> Callable:
    """`mosaic_kernel` whose last operand is a buffer the kernel adds into in place.

    ``fn(*operands, init) -> (outputs, accumulated)``: the body sees the buffer
    as a global-memory ref right after the inputs (for TMA stores with
    ``reduction_op="add"``). ``plgpu.kernel`` cannot alias an operand to a
    result, so this binds the map under it (``mpmd_map``, the same internal name and
    signature in jax 0.10, 0.11 and 0.12) with ``init`` aliased to the last result:
    an array in, an array out, no ref, so it runs under `jax.jit`, eagerly and inside
    a `jax.shard_map` (where jax 0.11 and later reject a ref operand that varies along
    the mesh axes, as a per-device sum does). It cannot be batched by `jax.vmap`
    (``mpmd_map`` batches size-1 axes only): callers take another path there.
    """
    from jax._src.pallas import mpmd

    plgpu = _mosaic_module()
    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=num_threads,
                      thread_name=thread_name)
    num_outputs = len(out_type)

    def call(*operands):
        *inputs, init = operands
        axes = varying_axes(operands)

        def kernel_body(*refs):
            # The aliased pair (input ``init``, last result) is one buffer; the body
            # gets it once, as the result's ref.
            inputs_refs, results = refs[:len(inputs)], refs[len(inputs) + 1:]
            pl.run_scoped(functools.partial(body, *inputs_refs, results[-1],
                                            *results[:-1]),
                          *scratch_types, collective_axes=thread_name)

        result_types = (*_results_varying(tuple(out_type), axes),
                        result_type(init.shape, init.dtype, axes))
        *outputs, accumulated = mpmd._mpmd_map(
            [(mesh, kernel_body)], result_types,
            input_output_aliases={len(inputs): num_outputs},
            compiler_params=compiler_params,
            interpret=False if interpret is None else interpret,
        )(*inputs, vary(init, axes))
        return vary(tuple(outputs), axes), vary(accumulated, axes)

    return call


def wgmma_row_layout() -> Any:
    """The layout of a row reduction (``axis=1``) of a WGMMA-layout array."""
    layout = _mosaic_module().Layout
    return layout.WGMMA.reduce(1) if hasattr(layout.WGMMA, "reduce") else layout.WGMMA_ROW


def wgmma_col_layout() -> Any:
    """The layout of a column reduction (``axis=0``) of a WGMMA-layout array."""
    layout = _mosaic_module().Layout
    return layout.WGMMA.reduce(0) if hasattr(layout.WGMMA, "reduce") else layout.WGMMA_COL


def wgmma_accumulate(acc: Array, a: Any, b: Any, *, interpret: bool) -> Array:
    """Returns ``acc + a @ b`` computed by wgmma (acc float32 in the WGMMA layout).

    Compiled, the product accumulates in place into ``acc``'s registers
    (``pl.run_state`` over an initialised accumulator: no extra registers and
    no extra adds). The Mosaic-GPU interpreter cannot run ``run_state``, so
    interpreted kernels take the product in a fresh zeroed accumulator and add
    it: the same value, the same operands, the same smem reads.
    """
    return wgmma_accumulate_all((acc,), ((a, b),), interpret=interpret)[0]


def wgmma_accumulate_all(accs: tuple, operands: tuple, *, interpret: bool) -> tuple:
    """`wgmma_accumulate` of several ``(a, b)`` into their ``accs`` with one wait.

    An entry of ``operands`` may also be a list of ``(a, b)``, all added to its
    accumulator. Compiled, every product is issued before the results are
    read, so the tensor cores run them back to back.
    """
    plgpu = _mosaic_module()
    pairs = [entry if isinstance(entry, list) else [entry] for entry in operands]

    def issue(acc_refs):
        for acc_ref, acc_pairs in zip(acc_refs, pairs, strict=True):
            for a, b in acc_pairs:
                plgpu.wgmma(acc_ref, a, b)

    if not interpret:
        return tuple(pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs)))

    def products(*acc_refs):
        issue(acc_refs)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    added = pl.run_scoped(products, *(plgpu.ACC(acc.shape, jnp.float32) for acc in accs))
    return tuple(acc + product for acc, product in zip(accs, added, strict=True))


def tma_faithful_interpret_params(params):
    """Mosaic-GPU interpreter params under which TMA copies behave as on hardware.

    Hardware TMA zero-fills out-of-bounds loads and clips out-of-bounds stores;
    the 0.10 interpreter instead raises on such loads and drops such stores
    whole, and it cannot read transposed wgmma operands. This reads
    out-of-bounds as zeros and installs (once) the store and wgmma shims below
    where the interpreter lacks them (0.11's clips and transposes itself).
    """
    _install_interpreter_shims()
    return dataclasses.replace(
        params, out_of_bounds_reads="uninitialized", uninitialized_memory="zero"
    )


@functools.cache
def _install_interpreter_shims() -> None:
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
        from jax._src.state.types import TransposeTransform
    except ImportError:  # pragma: no cover - interpreter internals moved
        return
    if getattr(getattr(cb, "AsyncCopySmemToGmemTask", None),
               "clips_out_of_bounds_destination", False):
        # jax 0.11's interpreter clips TMA stores and reads transposed operands itself.
        _register_layout_cast_on_cpu()
        _cache_thread_compilation()
        return
    if not hasattr(cb, "_get_shared_memory") or not hasattr(cb, "HostAllocationKey"):
        return  # pragma: no cover - interpreter internals moved

    import jax
    import numpy as np
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils

    def split_transforms(transforms):
        """(index range, axes permutation or None) of an interpreter transform chain."""
        transforms = cb._remove_noop_transforms(transforms)
        indexers = tuple(t for t in transforms if not isinstance(t, TransposeTransform))
        perms = [t.permutation for t in transforms if isinstance(t, TransposeTransform)]
        perm = None
        for p in perms:
            perm = p if perm is None else tuple(perm[i] for i in p)
        return interpret_utils.to_range(jax.tree.map(int, indexers)), perm

    def read(shared_memory, key_array, transforms, thread):
        rnge, perm = split_transforms(transforms)
        key = cb.HostAllocationKey.from_array(key_array)
        value, _, _ = shared_memory.get_buffer_content(key, rnge, thread)
        return value if perm is None else np.transpose(value, perm)

    original_wgmma = cb.wgmma

    def wgmma(**kw):
        transforms = (*kw["a_transforms"], *kw["b_transforms"])
        if not any(isinstance(t, TransposeTransform) for t in transforms):
            return original_wgmma(**kw)
        shared_memory = cb._get_shared_memory()
        thread = shared_memory.get_global_thread_id(int(kw["device_id"]), int(kw["thread_id"]))
        a = read(shared_memory, kw["a_allocation_key_as_array"], kw["a_transforms"], thread)
        b = read(shared_memory, kw["b_allocation_key_as_array"], kw["b_transforms"], thread)
        acc_key = cb.HostAllocationKey.from_array(kw["acc_allocation_key_as_array"])
        acc_range, _ = split_transforms(kw["acc_transforms"])
        acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, thread)
        result = acc + np.matmul(a, b, dtype=kw["acc_dtype"])
        shared_memory.store_buffer_content(acc_key, acc_range, result, thread)
        return kw["token"]

    original_store = cb.copy_smem_to_gmem

    def copy_smem_to_gmem(**kw):
        shared_memory = cb._get_shared_memory()
        dst_key = cb.HostAllocationKey.from_array(kw["dst_allocation_key_as_array"])
        dst_range, _ = split_transforms(kw["dst_transforms"])
        shape = shared_memory.mem[dst_key].logical_shape
        clipped = _clip_range(dst_range, shape)
        if clipped is None:  # in bounds: the interpreter's own copy is exact
            return original_store(**kw)
        dst_range, keep = clipped
        thread = shared_memory.get_global_thread_id(int(kw["device_id"]), int(kw["thread_id"]))
        value = read(shared_memory, kw["src_allocation_key_as_array"], kw["src_transforms"], thread)
        if keep is not None:
            shared_memory.store_buffer_content(dst_key, dst_range, value[keep], thread)
        return kw["token"]

    cb.wgmma = wgmma
    cb.copy_smem_to_gmem = copy_smem_to_gmem
    _register_layout_cast_on_cpu()
    _cache_thread_compilation()


def _register_layout_cast_on_cpu() -> None:
    """The interpreter evaluates ``plgpu.layout_cast`` (also inside ``plgpu.load`` and
    ``plgpu.broadcasted_iota`` with a layout) on the CPU, where it has no rule: there a
    register layout means nothing, so it is the identity."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.pallas.mosaic_gpu.core import layout_cast_p
    except ImportError:  # pragma: no cover - internals moved
        return
    mlir.register_lowering(layout_cast_p, lambda ctx, x, **params: [x], platform="cpu")


def _cache_thread_compilation() -> None:
    """Compiles each interpreted thread body once, not once per grid point.

    The interpreter lowers and compiles the body of every simulated thread at
    every grid point (seconds each); a jit keyed on the (same) body jaxpr
    reuses the executable, which makes multi-CTA kernels affordable in tests.
    """
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover - internals moved
        return
    if not hasattr(thread_map, "_run_jaxpr"):
        return  # pragma: no cover - internals moved
    import threading

    import jax
    import numpy as np
    from jax import core as jax_core

    def run(jaxpr, consts, *args):
        jax_core.eval_jaxpr(jaxpr, consts, *args)

    executables: dict = {}
    lock = threading.Lock()

    def run_jaxpr(jaxpr, consts, *args):
        avals = tuple((np.shape(x), np.asarray(x).dtype) for x in jax.tree.leaves((consts, args)))
        key = (id(jaxpr), avals)
        with lock:
            entry = executables.get(key)
        if entry is None:
            traced = jax.jit(run, static_argnums=(0,)).trace(jaxpr, consts, *args)
            entry = (jaxpr, traced.lower().compile())  # Holding jaxpr keeps its id unique.
            with lock:
                entry = executables.setdefault(key, entry)
        entry[1](consts, *args)

    thread_map._run_jaxpr = run_jaxpr


def _clip_range(rnge, shape):
    """None if ``rnge`` is in bounds, else (clipped range, slices of the value to keep).

    The slices are None when nothing is in bounds. A range shorter than ``shape``
    (a whole-ref copy has no indexers) covers the remaining dims whole.
    """
    rnge = (*rnge, *(slice(0, d) for d in shape[len(rnge):]))
    if all(isinstance(r, int) or r.stop <= d for r, d in zip(rnge, shape, strict=True)):
        return None
    clipped, keep = [], []
    for r, d in zip(rnge, shape, strict=True):
        if isinstance(r, int):
            clipped.append(r)
            continue
        stop = min(r.stop, d)
        if stop <= r.start:
            return rnge, None
        clipped.append(slice(r.start, stop))
        keep.append(slice(0, stop - r.start))
    return tuple(clipped), tuple(keep)


def mosaic_load(ref: Any, layout: Any, *, interpret: bool, optimized: bool = True) -> Array:
    """``plgpu.load(ref, (), layout=layout)``: a whole smem ref into registers of ``layout``
    (``optimized=False``: with bank conflicts where no conflict-free plan exists).

    The interpreter cannot evaluate ``plgpu.load``; there a plain read is the same.
    """
    if interpret:
        return ref[...]
    load = _mosaic_module().load
    return load(ref, *_load_index_argument(), layout=layout, optimized=optimized)


@functools.cache
def _load_index_argument() -> tuple:
    """``plgpu.load`` took a separate index (here: none, ``()``) before it read the index
    from the ref alone (passing one is deprecated since)."""
    idx = inspect.signature(_mosaic_module().load).parameters.get("idx")
    return ((),) if idx is not None and idx.default is inspect.Parameter.empty else ()


# --------------------------------------------------------------------------- shard_map types


def varying_axes(*trees: Any) -> frozenset:
    """The `jax.shard_map` mesh axes along which some array in ``trees`` varies (none
    outside a shard_map). Arrays carried this in ``aval.vma`` before
    ``aval.manual_axis_type.varying``."""
    import jax

    axes: set = set()
    for leaf in jax.tree.leaves(trees):
        if not isinstance(leaf, jax.core.Tracer):  # Concrete values vary along no axis.
            continue
        aval = jax.typeof(leaf)
        manual = getattr(aval, "manual_axis_type", None)
        axes |= manual.varying if manual is not None else getattr(aval, "vma", frozenset())
    return frozenset(axes)


def vary(tree: Any, axes: frozenset) -> Any:
    """``tree`` with every array varying along ``axes``: a custom_vjp whose inputs all
    vary alike returns cotangents of one type, and autodiff sums those of the arrays
    that were replicated over an axis (the transpose of this cast)."""
    import jax
    from jax import lax

    def one(x):
        missing = tuple(axes - varying_axes(x))
        if not missing:
            return x
        if hasattr(lax, "pcast"):
            return lax.pcast(x, missing, to="varying")
        return lax.pvary(x, missing)

    return jax.tree.map(one, tree) if axes else tree


def vary_alike(tree: Any) -> Any:
    """``tree`` with every array varying along every axis some array of it varies along."""
    return vary(tree, varying_axes(tree))


def result_type(shape: Sequence[int], dtype: Any, axes: frozenset) -> Any:
    """``jax.ShapeDtypeStruct(shape, dtype)`` of a kernel's result that varies along the
    shard_map axes ``axes``: ``pallas_call`` and ``ffi_call`` ask for it inside a
    shard_map (``vma=`` before ``manual_axis_type=``)."""
    import jax

    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    if "manual_axis_type" in inspect.signature(jax.ShapeDtypeStruct).parameters:
        manual = jax.sharding.ManualAxisType(varying=frozenset(axes))
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)
    return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset(axes))


def _results_varying(out_type: Any, axes: frozenset) -> Any:
    """``out_type`` (ShapeDtypeStructs) varying along ``axes`` (`result_type`)."""
    import jax

    return jax.tree.map(lambda s: result_type(s.shape, s.dtype, axes), out_type)


def inputs_read(jaxpr: Any) -> tuple[bool, ...]:
    """Whether each input of ``jaxpr`` reaches its outputs, dead code left out
    (`dce_jaxpr`: a jax internal, the same in 0.10 and 0.11)."""
    from jax._src.interpreters import partial_eval as pe

    _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return tuple(used)


@contextlib.contextmanager
def mosaic_lowering_arch(major: int, minor: int):
    """Mosaic-GPU lowerings in this block target compute capability ``major.minor``.

    Mosaic stamps the architecture on the module it lowers and picks arch-specific
    code paths from it; it takes it from the default device, and without a GPU
    assumes Hopper (9.0). Tests that lower Blackwell kernels for CUDA on a CPU
    machine set it here (the inference lived in ``mosaic.gpu.core`` up to jax 0.10,
    in ``mosaic.gpu.utils`` after).
    """
    from jax.experimental.mosaic.gpu import core, utils

    owner = core if hasattr(core, "_infer_arch") else utils
    inferred = owner._infer_arch
    owner._infer_arch = lambda: (major, minor)
    try:
        yield
    finally:
        owner._infer_arch = inferred


# --------------------------------------------------------------------------- eager evaluation


def evaluates_eagerly() -> bool:
    """Whether a JAX op on concrete inputs returns a concrete array here: outside any
    trace, or inside one under `jax.ensure_compile_time_eval` (which sets
    ``eager_constant_folding`` in 0.10-0.12). False where those internals moved: callers
    then stage, which is always correct."""
    try:
        from jax._src import config, core

        return (isinstance(core.trace_ctx.trace, core.EvalTrace)
                or bool(config.eager_constant_folding.value))
    except (ImportError, AttributeError):
        return False


def staging_constants() -> contextlib.AbstractContextManager:
    """Undoes `jax.ensure_compile_time_eval` inside: for tracing a function to compile it,
    whose ops on constants would otherwise each be compiled and run while it is traced."""
    try:
        from jax._src import config

        return config.eager_constant_folding(False)
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


def is_single_device_sharding(sharding: Any) -> bool:
    """Whether ``sharding`` places an array on one device (jax 0.12 deprecates the
    isinstance check against `jax.sharding.SingleDeviceSharding`)."""
    check = getattr(jax.sharding, "is_single_device_sharding", None)
    if check is not None:
        return check(sharding)
    return isinstance(sharding, jax.sharding.SingleDeviceSharding)
