"""examples/serve.py: continuous batching on a paged cache gives what the contiguous
KV-cache decode of examples/train_lm.py gives each request alone, and frees every page."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import runtime

pytest.importorskip("optax")
pytest.importorskip("tqdm")
import optax  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_serve():
    """examples/serve.py as a module (it imports examples/train_lm.py as ``train_lm``)."""
    spec = importlib.util.spec_from_file_location("serve", EXAMPLES / "serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def greedy_contiguous(train_lm, model, prompt: bytes, num_new: int) -> list[int]:
    """Greedy bytes through the layer's own contiguous cache (train_lm's decode path)."""
    model.init_cache(1, len(prompt) + num_new)
    logits = train_lm.prefill(model, jnp.asarray(np.frombuffer(prompt, np.uint8)[None],
                                                 jnp.int32))
    tokens = []
    for _ in range(num_new):
        tokens.append(int(jnp.argmax(logits[0])))
        logits = model(jnp.asarray([[tokens[-1]]], jnp.int32), decode=True)[:, -1]
    return tokens


@pytest.mark.parametrize("implementation", [
    "xla", pytest.param("triton", marks=pytest.mark.interpreted)])
def test_greedy_serving_matches_decoding_each_request_alone(implementation, tmp_path, seed,
                                                            monkeypatch):
    if implementation == "triton":
        monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    serve = load_serve()
    train_lm = serve.train_lm
    config = SimpleNamespace(d_model=64, layers=2, heads=4, kv_heads=2, implementation="xla",
                             dtype=jnp.float32, context_parallel=1)
    model = train_lm.LanguageModel(config, nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    checkpoint = tmp_path / "checkpoint.npz"
    train_lm.save_checkpoint(checkpoint, model, optimizer, 0, {"train": [], "eval": []})

    stats, requests = serve.main([
        "--checkpoint", str(checkpoint), "--requests", "5", "--slots", "3", "--page-size", "4",
        "--prompt-lengths", "3", "21", "--new-tokens", "2", "9", "--arrivals-per-step", "2",
        "--temperature", "0", "--implementation", implementation, "--seed", str(seed % 1000),
        "--quiet"])
    assert stats["output_tokens"] == sum(r.max_new for r in requests)
    assert stats["tokens_per_second"] > 0
    assert stats["free_pages"] == 3 * -(-(21 + 9) // 4)  # every page back in the pool
    reference = serve.load_model(checkpoint, "float32", "xla")
    for request in requests:
        assert request.output == greedy_contiguous(train_lm, reference, request.prompt,
                                                   request.max_new), request.number
