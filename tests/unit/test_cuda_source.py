"""kvstream/csrc/*.cu compile cleanly with nvcc (PTX only, so no GPU is needed).

Where the CUDA toolkit is missing these skip; the kernels are then only compiled at run
time by cupy's NVRTC, on a GPU machine.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvstream.native import csrc_path
from kvstream.quant.cuda import KERNEL_NAMES, source_path

SOURCES = sorted(csrc_path("").glob("*.cu"))
assert SOURCES, "no CUDA sources found in the package"  # they ship in kvstream/csrc/
ARCHS = ("sm_80", "sm_90")


def _nvcc_ptx(src: Path, arch: str, out: Path) -> subprocess.CompletedProcess[str]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH: CUDA sources are compile-checked where the CUDA toolkit is")
    return subprocess.run([nvcc, "--ptx", f"-arch={arch}", "-o", str(out), str(src)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_compiles_without_warnings(src: Path, arch: str, tmp_path: Path) -> None:
    proc = _nvcc_ptx(src, arch, tmp_path / "out.ptx")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr


def test_kernel_names_cover_every_codec_and_dtype() -> None:
    """What the loader asks for: both codecs (fp8_e4m3, int8), both directions, three dtypes."""
    assert len(KERNEL_NAMES) == len(set(KERNEL_NAMES)) == 12
    assert set(KERNEL_NAMES) == {f"kvs_{c}_{op}_{s}" for c in ("fp8", "i8")
                                 for op in ("quantize", "dequantize") for s in ("f16", "bf16", "f32")}


def test_fp8_exports_what_the_loader_asks_for(tmp_path: Path) -> None:
    """kvstream.quant.cuda finds the kernels of both codecs by these (unmangled, extern "C") names."""
    out = tmp_path / "fp8.ptx"
    proc = _nvcc_ptx(source_path(), "sm_90", out)
    assert proc.returncode == 0, proc.stderr
    entries = {line.split()[2].rstrip("(") for line in out.read_text().splitlines()
               if line.startswith(".visible .entry")}
    assert entries == set(KERNEL_NAMES)
