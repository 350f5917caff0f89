"""Test-wide setup: two virtual CPU devices so sharding tests run on any machine."""

import os
import secrets

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
# The Mosaic-GPU interpreter runs every simulated warpgroup as an XLA CPU execution that
# blocks on barriers; XLA's CPU pool has one thread per core unless NPROC says more, so a
# three-warpgroup kernel can deadlock on a two-core machine.
os.environ.setdefault("NPROC", "16")
# pytest-xdist workers share one GPU: none may take most of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402 (after the XLA environment above)

# float32 references and float32 model code compute in IEEE float32 on GPUs too (XLA's
# default there is TF32), so the tests' float32 tolerances hold on every backend. The
# kernels pass their own precisions and are unaffected.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_generate_tests(metafunc):
    """Parametrizes `AttentionSuite` subclasses from their class attributes."""
    from tests.omni_jax.attention_suite import AttentionSuite, suite_parameters

    cls = metafunc.cls
    if cls is None or not issubclass(cls, AttentionSuite):
        return
    names, combos = suite_parameters(cls, metafunc.fixturenames)
    if names:
        metafunc.parametrize(names, combos)


@pytest.fixture(autouse=True)
def _interpreted_on_the_cpu(request):
    """Tests marked ``interpreted`` compute on the CPU on a GPU machine too: the
    interpreter compiles and runs each simulated thread's body per grid point, which
    costs seconds per kernel on the CPU and minutes as GPU executables."""
    if request.node.get_closest_marker("interpreted") is None or jax.default_backend() == "cpu":
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def seed() -> int:
    """A fresh random seed for each test, printed so that a failure's report names it."""
    value = secrets.randbits(31)
    print(f"seed = {value}")
    return value


@pytest.fixture
def interpret_pallas_without_gpu(monkeypatch):
    """Pallas kernels run interpreted where there is no GPU (a Mosaic-GPU race fails the
    test, as with `tests.mosaic_interpret`); interpreter state is reset after."""
    import jax

    from pallas_kernels import runtime
    from tests.mosaic_interpret import interpreted_mosaic

    if jax.default_backend() == "gpu":
        yield
        return
    yield from interpreted_mosaic(monkeypatch)
    runtime.reset_mosaic_interpreter()
