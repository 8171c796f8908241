"""C kernels from csrc/, compiled on first use with the system C compiler and cached.

Shared by the CPU codec kernel (``kvstream.quant.cpu``) and the batched block copy
(``kvstream.dataplane.blockcopy``). A build lands in kvstream's cache dir under a name
keyed by the source, the flags, the compiler's version and this CPU's model and feature
flags, so a changed kernel, another compiler or a cache shared across machines never
loads a mismatched library. Builds go to a private file that is renamed into place:
processes starting together never load half a file.

Imports nothing of kvstream but the exception tree, so any layer may use it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from kvstream._exceptions import KVStreamError

__all__ = ["Once", "build", "cache_dir", "compiler", "cpu_id", "csrc_path"]

T = TypeVar("T")


def csrc_path(name: str) -> Path:
    """A kernel source of the package's csrc/ (shipped in the wheel, compiled on first use)."""
    return Path(__file__).resolve().parent / "csrc" / name


def cache_dir() -> Path:
    """kvstream's build cache (kernels, the test model): ``$KVSTREAM_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/kvstream`` (``~/.cache/kvstream``)."""
    base = os.environ.get("KVSTREAM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvstream")
    return Path(base)


def cpu_id() -> str:
    """This CPU's model and feature flags (part of every build's cache key)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc`` or ``gcc`` on PATH (None when there is none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(src: Path, flags: Sequence[str], *, libs: Sequence[str] = (),
          error: type[KVStreamError] = KVStreamError, what: str = "") -> Path:
    """The shared library of ``src`` built with ``flags`` (``-shared -fPIC`` among them),
    from the cache when it is there. Raises ``error`` when there is no compiler or the build
    fails (``what`` names the kernel in the message)."""
    cc = compiler()
    what = what or src.name
    if cc is None:
        raise error(f"no C compiler (cc/gcc) to build {what}")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(src.read_bytes() + " ".join(flags).encode() + version.encode()
                         + cpu_id().encode())
    out = cache_dir() / f"{src.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(src), *libs],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise error(f"building {src.name} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class Once(Generic[T]):
    """A kernel built and loaded at most once per process: ``make``'s value, or None (and
    one warning, ``warning % exc``) where one of ``errors`` says it cannot be had here."""

    def __init__(self, make: Callable[[], T], errors: tuple[type[BaseException], ...],
                 warning: str, log: logging.Logger) -> None:
        self._make, self._errors, self._warning, self._log = make, errors, warning, log
        self._lock = threading.Lock()
        self._tried = False
        self._value: T | None = None

    def __call__(self) -> T | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self._value = self._make()
                except self._errors as exc:
                    self._log.warning(self._warning, exc)
            return self._value
