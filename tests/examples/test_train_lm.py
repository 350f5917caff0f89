"""A short run of examples/train_lm.py: the loss goes down, artefacts are written, resume works."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"
TINY = ["--steps", "30", "--eval-every", "15", "--batch", "8", "--seq-len", "64",
        "--d-model", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
        "--max-bytes", "300000", "--eval-batches", "2", "--sample-tokens", "8",
        "--implementation", "xla", "--no-progress"]


def load_script():
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_run_learns_and_resumes(tmp_path, capsys):
    train_lm = load_script()
    metrics = train_lm.main(TINY + ["--out-dir", str(tmp_path)])
    train = np.array(metrics["train"])
    evals = np.array(metrics["eval"])
    assert evals[0, 0] == 0 and evals[-1, 0] == 30
    assert evals[-1, 1] < 0.75 * evals[0, 1], evals  # from ~ln(256) = 5.5 to well below
    assert train[-5:, 1].mean() < 0.75 * train[:3, 1].mean()
    for name in ("checkpoint.npz", "loss.png", "metrics.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert len(metrics["sample"]) > 0
    assert "sample:" in capsys.readouterr().out

    resumed = train_lm.main(TINY + ["--out-dir", str(tmp_path), "--resume", "--steps", "32"])
    steps = [step for step, _ in resumed["train"]]
    assert steps == list(range(1, 33))  # the saved curve continued, not restarted
    assert json.loads((tmp_path / "metrics.json").read_text())["train"][-1][0] == 32


def test_one_step_with_little_eval_data_and_an_empty_prompt(tmp_path):
    # --max-bytes 6500: 650 eval bytes, 10 rows of 65, fewer than --batch 16.
    argv = TINY + ["--steps", "1", "--batch", "16", "--max-bytes", "6500", "--prompt", "",
                   "--out-dir", str(tmp_path)]
    metrics = load_script().main(argv)
    assert [step for step, _ in metrics["eval"]] == [0, 1]
    assert np.isfinite(np.array(metrics["eval"])[:, 1]).all()
    assert len(metrics["sample"]) > 0


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--eval-every", "0"], "argument --eval-every: must be >= 1, got 0"),
    (["--batch", "-1"], "argument --batch: must be >= 1, got -1"),
    (["--temperature", "0"], "argument --temperature: must be > 0, got 0"),
    (["--sample-tokens", "-1"], "argument --sample-tokens: must be >= 0, got -1"),
    (["--dtype", "float99"], "argument --dtype: not a dtype: 'float99'"),
    (["--max-bytes", "100"], "use --max-bytes >= 1290"),
    (["--dtype", "int32"], "argument --dtype: must be a float dtype, got int32"),
    (["--heads", "3"], "argument --heads: the head dim --d-model / --heads must be an even "
                       "integer (RoPE rotates pairs of features), got 64 / 3"),
    (["--d-model", "4", "--heads", "4", "--kv-heads", "1", "--max-bytes", "2000"],
     "got 4 / 4"),
    (["--kv-heads", "3"], "argument --kv-heads: must divide --heads 4, got 3"),
    (["--implementation", "Triton"], "argument --implementation: invalid choice: 'Triton'"),
])
def test_bad_arguments_are_rejected_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script().parse_args(argv + ["--out-dir", "/nonexistent/unused"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_context_parallel_loss_and_gradients_match(tmp_path):
    """--context-parallel 2: the loss and its gradients are those of one device, and a
    short run (train, eval, decode on one device) completes."""
    import jax
    from flax import nnx

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    train_lm = load_script()
    args = train_lm.parse_args(TINY + ["--context-parallel", "2"])
    model = train_lm.LanguageModel(args, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, 65)).astype(np.uint8)
    segments = np.sort(rng.integers(1, 4, (2, 65)), axis=1).astype(np.int32)
    single = train_lm.LanguageModel(train_lm.parse_args(TINY), nnx.Rngs(0))  # same weights
    grad = nnx.jit(nnx.value_and_grad(train_lm.loss_fn), static_argnums=3)
    loss, grads = grad(model, tokens, segments, 2)
    want_loss, want_grads = grad(single, tokens, segments, 1)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    metrics = train_lm.main(TINY + ["--steps", "2", "--eval-every", "2", "--eval-batches", "1",
                                    "--out-dir", str(tmp_path), "--context-parallel", "2"])
    assert np.isfinite(metrics["train"][-1][1])
