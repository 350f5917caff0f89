"""The benchmarks' peers (FlashAttention-3 and -4 for JAX) for a GPU machine without internet.

    python scripts/peers.py download          # here: wheels for Python 3.12, in carry parts
    python scripts/peers.py install           # there, once every part has been carried

``download`` fetches the wheels (`PEERS`, no dependencies resolved: the list is the set)
into ``.peers/carry1``, ``.peers/carry2``, ... (git-ignored), each part under
``--part-mib`` so that it travels in one device call beside the working tree. A wheel
larger than a part (the CuTe DSL's CUDA 13 libraries, 92 MB) is unpacked and repacked as
an xz tar. Carry the parts in calls made back to back (a warm machine keeps what earlier
calls carried), then ``install`` puts every wheel in ``.peers/site`` with one ``pip
install --no-deps --target`` (a second pip command would skip the packages whose folder
exists, and the DSL's wheels share ``nvidia_cutlass_dsl/``), unpacks the tars over it and
prints the ``PYTHONPATH`` to use: the site and what its ``.pth`` files add (pip does
not run those under ``--target``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / ".peers"
PEERS = ("flash_attn3_jax", "einops", "fa4-jax", "cutejax", "jax-tvm-ffi!=0.1.3",
         "apache-tvm-ffi", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
         "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu13",
         "cuda-bindings>=13,<14", "cuda-pathfinder", "jaxtyping", "wadler-lindig")
# A device call carries 64 MiB, the working tree (about 3 MiB) included; the CUDA 13
# libraries' tar takes 61.
PART_MIB = 61
MIB = 1 << 20


def repack_as_tar(wheel: pathlib.Path) -> pathlib.Path:
    """The wheel's files as an xz tar beside it (the wheel removed): what `install`
    unpacks over the site."""
    tar_path = wheel.with_name(wheel.name.removesuffix(".whl") + ".tar.xz")
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(tmp)
        with tarfile.open(tar_path, "w:xz", preset=9) as tar:
            for entry in sorted(pathlib.Path(tmp).iterdir()):
                tar.add(entry, arcname=entry.name)
    wheel.unlink()
    return tar_path


def plan_parts(sizes: dict[str, int], part_bytes: int) -> list[list[str]]:
    """Files grouped into parts of at most ``part_bytes`` each, largest first (first fit);
    a file larger than a part raises."""
    parts: list[list[str]] = []
    room: list[int] = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        if sizes[name] > part_bytes:
            raise ValueError(f"{name} is {sizes[name] / MIB:.1f} MiB, more than a part "
                             f"({part_bytes / MIB:.1f} MiB)")
        fit = next((i for i, free in enumerate(room) if sizes[name] <= free), None)
        if fit is None:
            parts.append([])
            room.append(part_bytes)
            fit = len(parts) - 1
        parts[fit].append(name)
        room[fit] -= sizes[name]
    return parts


def download(part_mib: float, python_version: str) -> list[pathlib.Path]:
    """Fetches `PEERS` and lays them out in ``.peers/carryN``; returns those folders."""
    part_bytes = int(part_mib * MIB)
    with tempfile.TemporaryDirectory() as tmp:
        fetched = pathlib.Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--only-binary=:all:", "--python-version", python_version,
                        "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "-d", str(fetched), *PEERS], check=True)
        files = [repack_as_tar(f) if f.stat().st_size > part_bytes else f
                 for f in sorted(fetched.iterdir())]
        parts = plan_parts({f.name: f.stat().st_size for f in files}, part_bytes)
        for old in PEERS_DIR.glob("carry*"):
            shutil.rmtree(old)
        folders = []
        for index, names in enumerate(parts, start=1):
            folder = PEERS_DIR / f"carry{index}"
            folder.mkdir(parents=True)
            for name in names:
                shutil.move(fetched / name, folder / name)
            folders.append(folder)
    return folders


def site_path(site: pathlib.Path) -> list[str]:
    """``site`` and the folders its ``.pth`` files add, as Python's `site.addsitedir`
    runs them (the CuTe DSL's is an import line)."""
    script = ("import site, sys; before = set(sys.path); site.addsitedir(sys.argv[1]); "
              "print('\\n'.join(p for p in sys.path if p not in before))")
    added = subprocess.run([sys.executable, "-c", script, str(site.resolve())], check=True,
                           capture_output=True, text=True).stdout.split()
    return added


def install(site: pathlib.Path, folders: list[pathlib.Path]) -> list[str]:
    """Installs the carried parts into ``site``; returns its ``PYTHONPATH`` entries."""
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing or not folders:
        raise SystemExit(f"carried parts missing: {missing or 'none found'} (carry every "
                         ".peers/carryN in calls made back to back)")
    wheels = sorted(str(w) for f in folders for w in f.glob("*.whl"))
    tars = sorted(t for f in folders for t in f.glob("*.tar.xz"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                        "--upgrade", "--quiet", "--target", str(site), *wheels], check=True)
    for tar_path in tars:
        with tarfile.open(tar_path) as tar:
            tar.extractall(site, filter="tar")
    return site_path(site)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("download", help="fetch the wheels into .peers/carryN")
    fetch.add_argument("--part-mib", type=float, default=PART_MIB)
    fetch.add_argument("--python-version", default="3.12")
    put = commands.add_parser("install", help="install the carried parts; print PYTHONPATH")
    put.add_argument("--site", type=pathlib.Path, default=PEERS_DIR / "site")
    put.add_argument("parts", nargs="*", type=pathlib.Path,
                     help="carried folders (default: every .peers/carryN)")
    args = parser.parse_args(argv)
    if args.command == "download":
        for folder in download(args.part_mib, args.python_version):
            size = sum(f.stat().st_size for f in folder.iterdir()) / MIB
            print(f"{folder.relative_to(ROOT)}: {size:.1f} MiB")
    else:
        parts = args.parts or sorted(PEERS_DIR.glob("carry*"))
        print(os.pathsep.join(install(args.site, parts)))


if __name__ == "__main__":
    main()
