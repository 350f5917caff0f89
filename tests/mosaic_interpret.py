"""Running Mosaic-GPU kernels under the interpreter in tests: interpret mode on, races fail.

`interpreted_mosaic` (a pytest fixture body) switches ``OMNI_JAX_PALLAS_INTERPRET`` on
and fails the test when the interpreter's race detector reported a data race in any
kernel the test ran: the interpreter records races instead of raising.
"""

from __future__ import annotations

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
    """Interpreted kernels run on every device of a `jax.shard_map` at once, and the
    interpreter keeps its state in memory all devices share. Two of its steps assume one
    device runs at a time, so they wait here for every device:
    - at a kernel's end each device checks that no barrier is left allocated, and would
      see another device's barriers of the same kernel still in use (jax 0.10-0.12 raise
      "Barrier remains allocated");
    - at a cluster's end (jax 0.12) the interpreter resets its per-cluster state, the
      counters naming wgmma accumulators among it: another device, mid-cluster, would
      then name a new accumulator as one it still holds (seen as a 64 x 64 product added
      to a 64 x 128 accumulator, and as a KeyError on a `HostAllocationKey`). Every
      device finishes its cluster, one resets, then all go on (shard_map gives each
      device the same grid). Its vector clocks are per-cluster state too: before this
      wait the race detector reported races on two devices that one device never shows.
    """
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    check = gpu_callbacks._assert_no_barriers_allocated

    def check_after_every_device(token):
        gpu_callbacks._get_shared_memory().barrier.wait()
        return check(token)

    monkeypatch.setattr(gpu_callbacks, "_assert_no_barriers_allocated", check_after_every_device)

    if hasattr(gpu_callbacks, "cluster_finished"):
        finish = gpu_callbacks.cluster_finished

        def finish_with_every_device(*, token):
            barrier = gpu_callbacks._get_shared_memory().barrier
            if barrier.wait() == 0:
                finish(token=token)
            barrier.wait()
            return token

        monkeypatch.setattr(gpu_callbacks, "cluster_finished", finish_with_every_device)
