"""Where kernels run: interpret mode's CPU threads (the Mosaic-GPU interpreter deadlocks
without enough), the GPU's SMs."""

import os
import subprocess
import sys
import textwrap

import pytest

from pallas_kernels import runtime

FEW_CORES = (os.cpu_count() or 1) < runtime.INTERPRETER_THREADS


def _run(script: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NPROC"}
    env[runtime.INTERPRET_ENV_VAR] = "1"
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    return result.stdout.strip()


def test_importing_omni_jax_first_raises_the_thread_count():
    printed = _run("""
        import os, omni_jax, jax
        jax.numpy.ones(1).block_until_ready()
        print(os.environ.get("NPROC"))
    """)
    assert printed == (str(runtime.INTERPRETER_THREADS) if FEW_CORES else "None")


@pytest.mark.skipif(not FEW_CORES, reason="one thread per core is enough here")
def test_a_backend_started_too_early_gets_a_warning():
    printed = _run("""
        import warnings, jax
        jax.numpy.ones(1).block_until_ready()
        from pallas_kernels import runtime
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runtime.mosaic_interpret_params()
            runtime.mosaic_interpret_params()
        print(len(caught), "NPROC" in str(caught[0].message))
    """)
    assert printed == "1 True"


def test_num_sms_is_the_gpus_or_the_default_without_one():
    if runtime.gpu_compute_capability() is None:
        assert runtime.num_sms() == runtime.DEFAULT_NUM_SMS
    else:
        assert runtime.num_sms() >= 1


@pytest.mark.parametrize("setting, architecture", [
    ("1", "sm90"), ("sm90", "sm90"), ("sm100", "sm100"), ("SM100", "sm100"), ("", None),
    ("0", None)])
def test_interpret_setting_picks_the_simulated_architecture(monkeypatch, setting,
                                                            architecture):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, setting)
    assert runtime.interpreted_architecture() == architecture
    assert runtime.interpret_requested() == (architecture is not None)
    if architecture is not None:
        assert runtime.mosaic_architecture() == architecture
        assert runtime.can_run_mosaic_hopper() == (architecture == "sm90")
        assert runtime.can_run_mosaic_blackwell() == (architecture == "sm100")
