"""A tour of `omni_jax.attention` in under a minute on a CPU.

Packs three documents into one sequence, builds a causal document block mask,
shows its block diagram, runs attention with GQA, a softcap and an ALiBi
score_mod, checks it against plain dense attention, and takes a gradient.

    python examples/quickstart.py [--implementation xla|triton|mosaic]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import omni_jax


def dense_attention(q, k, v, allowed, score_mod_bias, softcap):
    """Textbook attention with a dense [q_len, kv_len] mask, for comparison."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = softcap * jnp.tanh(scores / softcap) + score_mod_bias
    scores = jnp.where(allowed, scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--implementation", default=None, choices=("xla", "triton", "mosaic"),
                        help="attention backend (default: the best one for this device; "
                             "mosaic runs bfloat16 inputs, the others float32)")
    parser.add_argument("--seq", type=int, default=512,
                        help="sequence length (>= 3: three documents of a token or more)")
    args = parser.parse_args(argv)
    if args.seq < 3:
        parser.error(f"argument --seq: must be >= 3 (three documents of a token or more), "
                     f"got {args.seq}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    rng = np.random.default_rng(0)
    seq, q_heads, kv_heads, head_dim = args.seq, 8, 2, 64
    lengths = np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, seq), 2, replace=False)), seq])
    segment_ids = jnp.asarray(np.repeat(np.arange(3), lengths)[None], jnp.int32)

    mask = omni_jax.create_block_mask(
        omni_jax.and_masks(omni_jax.causal_mask, omni_jax.document_mask(segment_ids)),
        batch=1, heads=None, q_len=seq, kv_len=seq)  # block_size 128 suits every backend
    print(f"documents of lengths {lengths.tolist()} -> {mask.sparsity():.0%} of tiles skipped")
    print(mask)

    slopes = jnp.asarray(2.0 ** -np.arange(1, q_heads + 1), jnp.float32)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    # The Mosaic kernels take 16-bit inputs only.
    dtype = jnp.bfloat16 if args.implementation == "mosaic" else jnp.float32
    q = jnp.asarray(rng.standard_normal((1, seq, q_heads, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((1, seq, kv_heads, head_dim)), dtype)
            for _ in range(2))

    @jax.jit
    def run(q, k, v):
        return omni_jax.attention(q, k, v, mask=mask, score_mod=alibi, softcap=30.0,
                                  implementation=args.implementation)

    out = run(q, k, v)
    positions = np.arange(seq)
    allowed = (positions[:, None] >= positions[None, :]) & (
        segment_ids[0][:, None] == segment_ids[0][None, :])
    bias = -slopes[:, None, None] * (positions[:, None] - positions[None, :])
    expected = dense_attention(*(x.astype(jnp.float32) for x in (q, k, v)), allowed, bias, 30.0)
    error = float(jnp.linalg.norm(out - expected) / jnp.linalg.norm(expected))
    print(f"relative error vs dense attention: {error:.2e}")

    grad_q = jax.jit(jax.grad(lambda q: run(q, k, v).sum()))(q)
    print(f"gradient w.r.t. query: shape {grad_q.shape}, finite {bool(jnp.isfinite(grad_q).all())}")
    # float32 matmuls run as TF32 on GPUs by default (about 3e-4); bfloat16 outputs keep
    # 8 bits of mantissa.
    if error > (2e-3 if dtype == jnp.float32 else 2e-2):
        raise SystemExit(f"relative error {error} too large")


if __name__ == "__main__":
    main()
