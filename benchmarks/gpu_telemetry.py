"""SM clock and board power of the GPU while benchmark samples run, read from nvidia-smi.

Under sustained load an H100 holds its power limit (700 W here) by lowering its SM
clock: with random bf16 inputs our kernels and their peers ran at 1.3-1.9 GHz instead of
1.98, with the driver's "SW power cap" clock event active (benchmarks/RESULTS.md,
2026-11-26). Short samples see a partly boosted clock, long ones the capped clock, so the
two measure different things; ``--sustain`` samples report the clock and power each
implementation ran at: at the cap, a ratio of times is a ratio of energy per call.

`start` launches one background ``nvidia-smi --query-gpu ... -lms`` reader per process
(if nvidia-smi exists); `summary` averages its readings over the sample windows that
`benchmarks.timing` records.
"""

from __future__ import annotations

import atexit
import bisect
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence

POLL_MS = 100
QUERY = "clocks.sm,power.draw,power.draw.instant,clocks_event_reasons.sw_power_cap"

# (perf_counter, SM MHz, watts, whether the power cap held the clock), in time order.
_readings: list[tuple[float, float, float, bool]] = []
_lock = threading.Lock()
_process: subprocess.Popen | None = None


def _first_visible_gpu() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def _parse(line: str) -> tuple[float, float, bool] | None:
    """(SM MHz, watts, capped) of one line of `QUERY`; None if a field is not a number.
    The instantaneous power where the driver has it (the plain reading is a 1 s mean)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 4:
        return None
    clock, average, instant, cap = fields
    try:
        power = float(instant) if instant.replace(".", "", 1).isdigit() else float(average)
        return float(clock), power, cap == "Active"
    except ValueError:  # "[N/A]" or a header
        return None


def _read(process: subprocess.Popen) -> None:
    for line in process.stdout:
        parsed = _parse(line)
        if parsed is not None:
            record((time.perf_counter(), *parsed))


def start() -> bool:
    """Starts polling the first visible GPU (once per process); False without nvidia-smi."""
    global _process
    if _process is not None:
        return True
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return False
    try:
        _process = subprocess.Popen(
            [nvidia_smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             "-i", _first_visible_gpu(), "-lms", str(POLL_MS)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return False
    atexit.register(_process.terminate)
    threading.Thread(target=_read, args=(_process,), daemon=True).start()
    return True


def summary(windows: Sequence[tuple[float, float]]) -> str:
    """Mean SM clock and power over the readings inside ``windows`` (perf_counter start,
    end pairs), and how often the power cap held the clock, as ``"SM 1685 MHz, 688 W,
    power-capped 95%"``; empty when there is none."""
    with _lock:
        times = [reading[0] for reading in _readings]
        inside = [_readings[i] for start, end in windows
                  for i in range(bisect.bisect_left(times, start),
                                 bisect.bisect_right(times, end))]
    if not inside:
        return ""
    clock = sum(reading[1] for reading in inside) / len(inside)
    power = sum(reading[2] for reading in inside) / len(inside)
    capped = sum(reading[3] for reading in inside) / len(inside)
    return f"SM {clock:.0f} MHz, {power:.0f} W, power-capped {capped:.0%}"


def record(reading: tuple[float, float, float, bool]) -> None:
    """Adds one (perf_counter, SM MHz, watts, capped) reading, in time order."""
    with _lock:
        _readings.append(reading)
