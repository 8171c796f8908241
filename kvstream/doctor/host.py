"""Facts about this host and its Python packages: versions, CPUs, memory, GPUs, /dev/shm.

Imports torch (and cupy when installed) to ask about CUDA; nothing here starts UCX.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

from kvstream.doctor.report import Hardware, SharedMemory, Versions

__all__ = ["THP_PATH", "cuda_packages", "hardware_and_versions", "shared_memory"]

THP_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
# ucxx ships as one wheel per CUDA major version.
_UCXX_DISTS = ("ucxx-cu12", "ucxx-cu13", "ucxx-cu11", "ucxx")


_PER_CUDA = ("ucxx-cu11", "ucxx-cu12", "ucxx-cu13", "libucx-cu12", "libucx-cu13",
             "cupy-cuda11x", "cupy-cuda12x", "cupy-cuda13x")


def cuda_packages() -> dict[str, str]:
    """The installed packages that exist once per CUDA major version, with versions."""
    found = {}
    for dist in _PER_CUDA:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return ""


def _memory_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0


def _torch_facts() -> tuple[str, bool, int, tuple[str, ...]]:
    """(torch.version.cuda, cuda available, device count, device names)."""
    try:
        import torch
    except Exception:  # not installed, or a broken install: the versions line says so
        return "", False, 0, ()
    cuda = getattr(torch.version, "cuda", None) or ""
    try:
        available = bool(torch.cuda.is_available())
        count = int(torch.cuda.device_count()) if available else 0
        names = tuple(torch.cuda.get_device_name(i) for i in range(count))
    except Exception:  # a driver that torch cannot talk to is "no CUDA" here
        return cuda, False, 0, ()
    return cuda, available, count, names


def _cupy_facts() -> tuple[str, bool]:
    try:
        import cupy
    except Exception:
        return "", False
    try:
        available = bool(cupy.cuda.is_available())
    except Exception:
        available = False
    return str(getattr(cupy, "__version__", "")), available


def _kvstream_version() -> str:
    import kvstream

    return str(getattr(kvstream, "__version__", ""))


def hardware_and_versions() -> tuple[Hardware, Versions]:
    """What is installed and which devices it sees; ``ucxx``/``ucx`` are filled in from
    the UCX probe (so that this process never loads UCX)."""
    torch_cuda, available, count, names = _torch_facts()
    cupy_version, cupy_available = _cupy_facts()
    hardware = Hardware(cpu_count=os.cpu_count() or 0, memory_total_bytes=_memory_total(),
                        cuda_available=available, gpu_count=count, gpu_names=names,
                        cupy_cuda_available=cupy_available)
    versions = Versions(
        kvstream=_version("kvstream") or _kvstream_version(), python=platform.python_version(),
        ucxx=_version(*_UCXX_DISTS), ucx="", torch=_version("torch"), torch_cuda=torch_cuda,
        nats_py=_version("nats-py"), msgspec=_version("msgspec"), numpy=_version("numpy"),
        cupy=cupy_version or _version("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"),
        cuda_packages=cuda_packages())
    return hardware, versions


def _thp(path: str = THP_PATH) -> str:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    # "always [madvise] never": the bracketed word is the one in force.
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()


def shared_memory(path: str = "/dev/shm") -> SharedMemory:
    thp = _thp()
    try:
        st = os.statvfs(path)
    except OSError:
        return SharedMemory(path=path, exists=False, transparent_hugepages=thp)
    return SharedMemory(path=path, exists=True, total_bytes=st.f_blocks * st.f_frsize,
                        free_bytes=st.f_bavail * st.f_frsize, transparent_hugepages=thp)
