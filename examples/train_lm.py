"""Train a small byte-level language model on the Python standard library.

A decoder-only transformer built from `omni_jax.flax.Attention`, trained on
the ``.py`` files of the running interpreter's standard library (present on
every machine, no download). Files are packed back to back into fixed-length
rows; each token carries its file's segment id, so attention never crosses a
file boundary (a document mask) and RoPE positions restart in every file.

    python examples/train_lm.py                     # ~1 minute on 2 CPU cores
    python examples/train_lm.py --preset gpu        # a bigger model; fast kernels on a GPU
    python examples/train_lm.py --context-parallel 2  # each row's sequence over 2 devices

``--context-parallel N`` shards every row's sequence over N devices (context
parallelism, `omni_jax.context_parallel`, zigzag layout) with RoPE at global positions;
on a CPU, make N host devices with XLA_FLAGS=--xla_force_host_platform_device_count=N.

Writes to ``--out-dir``: ``checkpoint.npz`` (parameters, optimizer state and
step; ``--resume`` continues from it), ``loss.png`` (train/eval loss curves)
and ``metrics.json``. Ends by sampling text through the KV-cache decode path.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

try:
    from omni_jax.flax import Attention
except ModuleNotFoundError:  # Run from a source checkout without `pip install -e .`.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from omni_jax.flax import Attention
from omni_jax.context_parallel import zigzag
from omni_jax.flax.rope import segment_positions

Array = Any
VOCAB = 256  # bytes


# -- data ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackedData:
    """Rows of ``seq_len + 1`` bytes and the segment id (file number, from 1) of each byte."""

    tokens: np.ndarray  # [rows, seq_len + 1] uint8
    segments: np.ndarray  # [rows, seq_len + 1] int32


def stdlib_files() -> list[Path]:
    """The standard library's .py files (sorted, so every run sees the same order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        raise SystemExit(f"no .py files found under {root}")
    return files


def pack(files: list[Path], seq_len: int, max_bytes: int) -> PackedData:
    """Concatenates files (up to ``max_bytes``) and cuts the stream into rows."""
    chunks, ids, total = [], [], 0
    for number, path in enumerate(files, start=1):
        data = np.frombuffer(path.read_bytes(), np.uint8)
        if total + data.size > max_bytes:
            data = data[: max_bytes - total]
        chunks.append(data)
        ids.append(np.full(data.size, number, np.int32))
        total += data.size
        if total >= max_bytes:
            break
    row = seq_len + 1
    rows = total // row
    if rows == 0:
        raise SystemExit(f"only {total} bytes of text: fewer than one row of {row}")
    tokens = np.concatenate(chunks)[: rows * row].reshape(rows, row)
    segments = np.concatenate(ids)[: rows * row].reshape(rows, row)
    return PackedData(tokens, segments)


def split_files(files: list[Path], eval_fraction: float = 0.05,
                seed: int = 0) -> tuple[list[Path], list[Path]]:
    """A fixed random split by file, so eval text is never trained on."""
    order = np.random.default_rng(seed).permutation(len(files))
    num_eval = max(1, int(len(files) * eval_fraction))
    return ([files[i] for i in order[num_eval:]], [files[i] for i in order[:num_eval]])


def batches(data: PackedData, batch: int, rng: np.random.Generator):
    """Endless random batches of rows."""
    while True:
        index = rng.integers(0, data.tokens.shape[0], batch)
        yield data.tokens[index], data.segments[index]


# -- model --------------------------------------------------------------------------------


class Block(nnx.Module):
    """Pre-norm transformer block: attention then a GELU MLP, both residual."""

    def __init__(self, cfg: argparse.Namespace, rngs: nnx.Rngs):
        d = cfg.d_model
        self.attention_norm = nnx.RMSNorm(d, rngs=rngs)
        context = {} if cfg.context_parallel == 1 else dict(context_axis=SEQ_AXIS,
                                                             context_layout="zigzag")
        self.attention = Attention(cfg.heads, d, num_kv_heads=cfg.kv_heads, qk_norm=True,
                                   implementation=cfg.implementation, dtype=cfg.dtype,
                                   rngs=rngs, **context)
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, dtype=cfg.dtype, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, x: Array, segment_ids: Array | None, decode: bool,
                 positions: Array | None) -> Array:
        h = self.attention_norm(x)
        if decode:
            return self._mlp(x + self.attention(h, decode=True))
        return self._mlp(x + self.attention(h, is_causal=True, segment_ids=segment_ids,
                                            positions=positions))

    def decode_paged(self, x: Array, k_pages: Array, v_pages: Array, page_table: Array,
                     kv_lens: Array) -> tuple[Array, Array, Array]:
        """A decode step on this block's pages of a paged cache (examples/serve.py)."""
        attended, k_pages, v_pages = self.attention.decode_paged(
            self.attention_norm(x), k_pages, v_pages, page_table, kv_lens)
        return self._mlp(x + attended), k_pages, v_pages

    def _mlp(self, x: Array) -> Array:
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class LanguageModel(nnx.Module):
    """Byte embedding, blocks, final norm, tied output projection."""

    def __init__(self, cfg: argparse.Namespace, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)

    def __call__(self, tokens: Array, segment_ids: Array | None = None,
                 decode: bool = False, positions: Array | None = None) -> Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, segment_ids, decode, positions)
        return self._logits(x)

    def decode_paged(self, tokens: Array, pages: list[tuple[Array, Array]], page_table: Array,
                     kv_lens: Array) -> tuple[Array, list[tuple[Array, Array]]]:
        """Logits of ``tokens [batch, n]`` appended after each sequence's ``kv_lens``
        tokens of a paged cache, and every block's updated ``(k_pages, v_pages)``."""
        x = self.embed(tokens)
        updated = []
        for block, (k_pages, v_pages) in zip(self.blocks, pages, strict=True):
            x, k_pages, v_pages = block.decode_paged(x, k_pages, v_pages, page_table, kv_lens)
            updated.append((k_pages, v_pages))
        return self._logits(x), updated

    def _logits(self, x: Array) -> Array:
        return self.embed.attend(self.norm(x)).astype(jnp.float32)

    def init_cache(self, batch: int, max_len: int) -> None:
        for block in self.blocks:
            block.attention.init_cache(batch, max_len)


SEQ_AXIS = "seq"  # the mesh axis of --context-parallel


def loss_fn(model: LanguageModel, tokens: Array, segments: Array,
            context_parallel: int = 1) -> Array:
    """Mean next-byte cross-entropy, not counting predictions across a file boundary.

    With ``context_parallel`` N > 1 each row's sequence is split over N devices (zigzag
    order, which balances the causal work); RoPE positions (within each file) are
    computed on the whole row first, so they stay global.
    """
    inputs, targets = tokens[:, :-1].astype(jnp.int32), tokens[:, 1:].astype(jnp.int32)
    same_file = (segments[:, 1:] == segments[:, :-1]).astype(jnp.float32)
    if context_parallel == 1:
        logits = model(inputs, segments[:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return (losses * same_file).sum() / jnp.maximum(same_file.sum(), 1.0)
    graphdef, state = nnx.split(model)

    def shard_loss(state, inputs, segments, positions, targets, weights):
        logits = nnx.merge(graphdef, state)(inputs, segments, positions=positions)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return (jax.lax.psum((losses * weights).sum(), SEQ_AXIS),
                jax.lax.psum(weights.sum(), SEQ_AXIS))

    mesh = jax.make_mesh((context_parallel,), (SEQ_AXIS,),
                         axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:context_parallel])
    rows = [inputs, segments[:, :-1], segment_positions(segments[:, :-1]), targets, same_file]
    seq = P(None, SEQ_AXIS)
    total, count = jax.shard_map(shard_loss, mesh=mesh, in_specs=(P(), *[seq] * len(rows)),
                                 out_specs=(P(), P()))(
        state, *(zigzag(row, context_parallel) for row in rows))
    return total / jnp.maximum(count, 1.0)


@functools.partial(nnx.jit, static_argnames="context_parallel")
def train_step(model: LanguageModel, optimizer: nnx.Optimizer, tokens: Array,
               segments: Array, context_parallel: int = 1) -> Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, segments, context_parallel)
    optimizer.update(model, grads)
    return loss


@functools.partial(nnx.jit, static_argnames="context_parallel")
def eval_step(model: LanguageModel, tokens: Array, segments: Array,
              context_parallel: int = 1) -> Array:
    return loss_fn(model, tokens, segments, context_parallel)


def evaluate(model: LanguageModel, data: PackedData, batch: int, max_batches: int,
             context_parallel: int = 1) -> float:
    """Mean loss over eval rows spread evenly through the eval files (same rows every time);
    batches of all the rows when there are fewer than ``batch``."""
    batch = min(batch, data.tokens.shape[0])
    count = min(max_batches, data.tokens.shape[0] // batch)
    rows = np.linspace(0, data.tokens.shape[0] - 1, count * batch).astype(int)
    losses = [eval_step(model, data.tokens[part], data.segments[part], context_parallel)
              for part in np.split(rows, count)]
    return float(np.mean(jax.device_get(losses)))


# -- sampling through the KV cache --------------------------------------------------------


@nnx.jit
def prefill(model: LanguageModel, tokens: Array) -> Array:
    """Appends ``tokens [batch, n]`` to every layer's cache; logits of the last one."""
    return model(tokens, decode=True)[:, -1]


@functools.partial(nnx.jit, static_argnames="num_tokens")
def sample(model: LanguageModel, logits: Array, key: Array, num_tokens: int,
           temperature: float) -> Array:
    """Samples ``num_tokens`` bytes, one decode step each, in one compiled loop."""
    graphdef, state = nnx.split(model)

    def step(carry, step_key):
        state, logits = carry
        model = nnx.merge(graphdef, state)
        token = jax.random.categorical(step_key, logits / temperature)
        logits = model(token[:, None], decode=True)[:, -1]
        return (nnx.state(model), logits), token

    (state, _), tokens = jax.lax.scan(step, (state, logits),
                                      jax.random.split(key, num_tokens))
    nnx.update(model, state)
    return tokens.T


def generate(model: LanguageModel, prompt: bytes, num_tokens: int, temperature: float,
             seed: int) -> bytes:
    """Prefills the prompt in one decode step, then samples through the KV cache. An empty
    prompt starts from a newline (the prefill needs a byte)."""
    prompt = prompt or b"\n"
    model.init_cache(1, len(prompt) + num_tokens)
    logits = prefill(model, jnp.asarray(np.frombuffer(prompt, np.uint8)[None], jnp.int32))
    tokens = sample(model, logits, jax.random.key(seed), num_tokens, temperature)
    return bytes(np.asarray(tokens[0], np.uint8))


# -- checkpoints --------------------------------------------------------------------------


def save_checkpoint(path: Path, model: LanguageModel, optimizer: nnx.Optimizer, step: int,
                    curves: dict[str, list[tuple[int, float]]]) -> None:
    """Parameters, optimizer state, step and loss curves as one .npz (nnx paths as keys)."""
    arrays = {"step": np.asarray(step)}
    arrays |= {f"curve/{name}": np.asarray(points, np.float64).reshape(-1, 2)
               for name, points in curves.items()}
    for prefix, node in (("model", model), ("optimizer", optimizer)):
        state = nnx.state(node, nnx.Param if node is model else nnx.optimizer.OptState)
        for key, value in nnx.to_flat_state(state):
            arrays["/".join([prefix, *map(str, key)])] = np.asarray(value[...])
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def restore_checkpoint(path: Path, model: LanguageModel, optimizer: nnx.Optimizer,
                       curves: dict[str, list[tuple[int, float]]]) -> int:
    """Loads `save_checkpoint`'s file into model, optimizer and curves; returns the step."""
    with np.load(path) as saved:
        load_state(saved, "model", model, nnx.Param, path)
        load_state(saved, "optimizer", optimizer, nnx.optimizer.OptState, path)
        for name, points in curves.items():
            points[:] = [(int(step), float(loss)) for step, loss in saved[f"curve/{name}"]]
        return int(saved["step"])


def load_state(saved: Any, prefix: str, node: nnx.Module, kind: type, path: Path) -> None:
    """Loads the ``kind`` variables of ``node`` from ``saved`` (an opened checkpoint)."""
    flat = nnx.to_flat_state(nnx.state(node, kind))
    for key, value in flat:
        name = "/".join([prefix, *map(str, key)])
        if name not in saved or saved[name].shape != value[...].shape:
            raise SystemExit(f"{path} does not match this model at {name} "
                             f"(different flags?)")
        value[...] = jnp.asarray(saved[name], value[...].dtype)
    nnx.update(node, nnx.from_flat_state(flat))


# -- plot ---------------------------------------------------------------------------------


def plot_losses(path: Path, train: list[tuple[int, float]], evals: list[tuple[int, float]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train, strict=True), label="train", alpha=0.7)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title("byte-level LM on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------

PRESETS = {
    # Finishes in about a minute on 2 CPU cores.
    "cpu": dict(steps=200, batch=8, seq_len=128, d_model=64, layers=2, heads=4, kv_heads=2,
                lr=3e-3, max_bytes=2_000_000, eval_every=50, dtype="float32"),
    # A real run for one GPU (a few minutes on an H100).
    "gpu": dict(steps=3000, batch=32, seq_len=1024, d_model=512, layers=8, heads=8,
                kv_heads=2, lr=1e-3, max_bytes=60_000_000, eval_every=250, dtype="bfloat16"),
}


def _checked(kind: type, requirement: str, valid: Callable[[Any], bool]):
    """An argparse type: ``kind(text)``, rejected unless ``valid``."""

    def parse(text: str):
        value = kind(text)
        if not valid(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type when the conversion fails
    return parse


positive_int = _checked(int, ">= 1", lambda value: value >= 1)
non_negative_int = _checked(int, ">= 0", lambda value: value >= 0)
positive_float = _checked(float, "> 0", lambda value: value > 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="cpu",
                        help="default sizes (flags below override them; default: cpu)")
    for name, kind, what in (
            ("steps", positive_int, "training steps"), ("batch", positive_int, "rows per step"),
            ("seq_len", positive_int, "tokens (bytes) per row"),
            ("d_model", positive_int, "model width"), ("layers", positive_int, "blocks"),
            ("heads", positive_int, "query heads (--d-model / --heads: an even head dim)"),
            ("kv_heads", positive_int, "key/value heads (must divide --heads)"),
            ("lr", positive_float, "peak learning rate"),
            ("max_bytes", positive_int, "training bytes read (eval reads a tenth of it)"),
            ("eval_every", positive_int, "steps between evaluations"),
            ("dtype", str, "computation dtype")):
        defaults = ", ".join(f"{preset} {values[name]}" for preset, values in PRESETS.items())
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"{what} (default: {defaults})")
    parser.add_argument("--eval-batches", type=positive_int, default=4,
                        help="batches per evaluation (default: %(default)s)")
    parser.add_argument("--implementation", default=None, choices=("xla", "triton", "mosaic"),
                        help="omni_jax.attention backend (default: best available; mosaic "
                             "takes --dtype bfloat16 or float16)")
    parser.add_argument("--out-dir", type=Path, default=Path("train_lm_out"),
                        help="checkpoint, loss curve and metrics (default: %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    parser.add_argument("--prompt", default="def ",
                        help="text to continue (empty: start from a newline; default: "
                             "%(default)r)")
    parser.add_argument("--sample-tokens", type=non_negative_int, default=200,
                        help="bytes sampled at the end (default: %(default)s)")
    parser.add_argument("--temperature", type=positive_float, default=0.8,
                        help="sampling temperature (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--context-parallel", type=positive_int, default=1, metavar="N",
                        help="split each row's sequence over N devices (default: %(default)s)")
    args = parser.parse_args(argv)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.dtype = jnp.dtype(args.dtype)
    except TypeError:
        parser.error(f"argument --dtype: not a dtype: {args.dtype!r}")
    if not jnp.issubdtype(args.dtype, jnp.floating):
        parser.error(f"argument --dtype: must be a float dtype, got {args.dtype}")
    if args.d_model % args.heads or args.d_model // args.heads % 2:
        parser.error(f"argument --heads: the head dim --d-model / --heads must be an even "
                     f"integer (RoPE rotates pairs of features), got {args.d_model} / "
                     f"{args.heads}")
    if args.heads % args.kv_heads:
        parser.error(f"argument --kv-heads: must divide --heads {args.heads}, got "
                     f"{args.kv_heads}")
    if args.seq_len % (2 * args.context_parallel):
        parser.error(f"argument --context-parallel: the zigzag layout needs --seq-len to be a "
                     f"multiple of 2 * {args.context_parallel}, got {args.seq_len}")
    if args.context_parallel > len(jax.devices()):
        parser.error(f"argument --context-parallel: {args.context_parallel} devices asked, "
                     f"{len(jax.devices())} present (on a CPU: XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={args.context_parallel})")
    # The eval split packs a tenth of --max-bytes into rows of seq_len + 1 bytes.
    if args.max_bytes // 10 < args.seq_len + 1:
        parser.error(f"argument --max-bytes: {args.max_bytes} leaves the eval split (a tenth) "
                     f"less than one row of --seq-len + 1 = {args.seq_len + 1} bytes; use "
                     f"--max-bytes >= {10 * (args.seq_len + 1)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind} "
          f"({jax.default_backend()}), attention implementation "
          f"{args.implementation or 'best available'}")
    train_files, eval_files = split_files(stdlib_files())
    train_data = pack(train_files, args.seq_len, args.max_bytes)
    eval_data = pack(eval_files, args.seq_len, args.max_bytes // 10)
    print(f"data: {train_data.tokens.size:,} train bytes in {train_data.tokens.shape[0]} rows, "
          f"{eval_data.tokens.size:,} eval bytes")

    model = LanguageModel(args, nnx.Rngs(args.seed))
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads "
          f"({args.kv_heads} kv), {num_params:,} parameters")
    warmup = min(max(1, args.steps // 20), args.steps - 1)  # the decay needs a step or more
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.out_dir / "checkpoint.npz"
    train_curve: list[tuple[int, float]] = []
    eval_curve: list[tuple[int, float]] = []
    curves = {"train": train_curve, "eval": eval_curve}
    first_step = 0
    if args.resume and checkpoint.exists():
        first_step = restore_checkpoint(checkpoint, model, optimizer, curves)
        print(f"resumed from {checkpoint} at step {first_step}")

    rng = np.random.default_rng(args.seed + first_step)
    data = batches(train_data, args.batch, rng)
    if first_step == 0:
        eval_curve.append((0, evaluate(model, eval_data, args.batch, args.eval_batches,
                                       args.context_parallel)))
        print(f"step 0: eval loss {eval_curve[-1][1]:.3f}")
    progress = tqdm(range(first_step, args.steps), initial=first_step, total=args.steps,
                    disable=args.no_progress, file=sys.stdout, dynamic_ncols=True)
    for step in progress:
        loss = float(train_step(model, optimizer, *next(data), args.context_parallel))
        if not math.isfinite(loss):
            raise SystemExit(f"loss became {loss} at step {step}")
        train_curve.append((step + 1, loss))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            eval_curve.append((step + 1, evaluate(model, eval_data, args.batch,
                                                  args.eval_batches, args.context_parallel)))
            save_checkpoint(checkpoint, model, optimizer, step + 1, curves)
            progress.write(f"step {step + 1}: train loss {loss:.3f}, "
                           f"eval loss {eval_curve[-1][1]:.3f}")
        progress.set_postfix(loss=f"{loss:.3f}")
    progress.close()

    if train_curve:
        plot_losses(args.out_dir / "loss.png", train_curve, eval_curve)
    if args.context_parallel > 1:  # decode on one device: the same weights, no context axis
        single = LanguageModel(argparse.Namespace(**{**vars(args), "context_parallel": 1}),
                               nnx.Rngs(args.seed))
        nnx.update(single, nnx.state(model, nnx.Param))
        model = single
    sample = generate(model, args.prompt.encode(), args.sample_tokens, args.temperature,
                      args.seed)
    print("sample:\n" + (args.prompt.encode() + sample).decode("utf-8", errors="replace"))
    metrics = {"train": train_curve, "eval": eval_curve, "seconds": time.perf_counter() - start,
               "parameters": num_params, "sample": sample.decode("utf-8", errors="replace")}
    (args.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"done in {metrics['seconds']:.0f} s; wrote {args.out_dir}/"
          f"{{checkpoint.npz,loss.png,metrics.json}}")
    return metrics


if __name__ == "__main__":
    main()
