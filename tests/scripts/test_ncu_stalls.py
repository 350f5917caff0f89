"""scripts/ncu_stalls.py reads ncu's per-instruction samples: kernels, loops, reasons."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ncu_stalls", ROOT / "scripts" / "ncu_stalls.py")
ncu_stalls = sys.modules["ncu_stalls"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_stalls)

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb",'
          '"stall_short_sb","stall_long_sb (Not Issued)"')


def _csv(name: str, rows: list[tuple[int, str, int, int, int]]) -> list[str]:
    lines = [f'"Kernel Name","{name}",', HEADER]
    lines += [f'"{hex(a)}","  {src}","{n}","{long_sb}","{short_sb}","0"'
              for a, src, n, long_sb, short_sb in rows]
    return lines


def test_kernels_loops_and_reasons():
    rows = [(0x10, "MOV R1, R2", 1, 0, 1),
            (0x20, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R0", 2, 0, 0),
            (0x30, "@!P1 BRA 0x80", 40, 40, 0),       # to an out-of-line wait stub
            (0x40, "FFMA R3, R3, R4, -R5", 30, 0, 24),  # 6 samples of no listed reason
            (0x50, "@P0 BRA 0x20", 7, 0, 7),           # the loop's branch back
            (0x60, "EXIT", 0, 0, 0),
            (0x80, "@!P1 BRA 0x80", 0, 0, 0),
            (0x90, "BRA 0x20", 0, 0, 0)]               # unpredicated: not a loop
    kernels = list(ncu_stalls.read_kernels(_csv("first", rows) + _csv("second", rows[:2])))
    assert [k.name for k in kernels] == ["first", "second"]
    first = kernels[0]
    assert first.samples == 80
    assert first.loops() == [(1, 4), (6, 6)]
    assert first.instructions[3].reasons == {"long_sb": 0, "short_sb": 24, "unlisted": 6}
    assert ncu_stalls.reason_totals(first.instructions) == {
        "long_sb": 40, "short_sb": 32, "unlisted": 8}
    text = ncu_stalls.report(first, top=2)
    assert "loop [1, 4] (4 instructions): 98.8% of samples" in text
    assert "loop [6, 6]" not in text  # no samples
    assert "@!P1 BRA 0x80" in text and "FFMA" in text and "MOV" not in text
