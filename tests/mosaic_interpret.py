"""Running Mosaic-GPU kernels under the interpreter in tests: interpret mode on, races fail.

`interpreted_mosaic` (a pytest fixture body) switches ``OMNI_JAX_PALLAS_INTERPRET`` on
and fails the test when the interpreter's race detector reported a data race in any
kernel the test ran: the interpreter records races instead of raising.
"""

from __future__ import annotations

import dataclasses

import pytest

from pallas_kernels import runtime


def interpreted_mosaic(monkeypatch: pytest.MonkeyPatch, architecture: str = "sm90"):
    """Generator for a fixture: interpret mode (standing in for ``architecture``, "sm90"
    or "sm100"), and no race in any interpreted kernel."""
    from jax._src.pallas.mosaic.interpret import race_detection_state

    races: list[str] = []
    state = race_detection_state.RaceDetectionState
    base_setattr = state.__setattr__

    def recording_setattr(self, name, value):
        """Remembers every race past the next kernel (which replaces the state). Patched on
        the base class: jax 0.10 instantiates it, later releases a GPU subclass."""
        if name == "races_found" and value:
            races.append("race")
        base_setattr(self, name, value)

    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1" if architecture == "sm90" else architecture)
    monkeypatch.setattr(state, "__setattr__", recording_setattr)
    try:
        yield
    except Exception:
        runtime.reset_mosaic_interpreter()
        raise
    assert not races, "the Mosaic-GPU interpreter detected a data race"


def devices_share_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interpreted kernels run on every device of a `jax.shard_map` at once. Each device
    checks at its kernel's end that no barrier is left allocated, in the memory all
    devices share, and would see another device's barriers of the same kernel still in
    use (jax 0.10-0.12 raise "Barrier remains allocated"): the check waits here for every
    device to finish its kernel first. Race detection is off: on two devices the
    detector of jax 0.12 reports races the same kernels show on none on one device (a
    warpgroup's own smem write and read in the sm90 forward, a tensor-memory read in the
    sm100 backward under a causal mask); the kernels' single-device interpreted tests
    detect races."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    params = runtime.mosaic_interpret_params
    monkeypatch.setattr(runtime, "mosaic_interpret_params", lambda: (
        None if params() is None else dataclasses.replace(params(), detect_races=False)))

    check = gpu_callbacks._assert_no_barriers_allocated

    def check_after_every_device(token):
        gpu_callbacks._get_shared_memory().barrier.wait()
        return check(token)

    monkeypatch.setattr(gpu_callbacks, "_assert_no_barriers_allocated", check_after_every_device)
