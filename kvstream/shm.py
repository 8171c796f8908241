"""Host KV tensors in POSIX shared memory, so a sidecar can send them without a copy.

The engine allocates its KV cache here (or copies an existing cache in once); the
sidecar maps the same segments by name. Segments are unlinked as soon as the
sidecar has mapped them, so the memory goes away with the last process that maps
it: an engine that crashes leaks nothing once its sidecar drops the mapping.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from typing import TYPE_CHECKING

import msgspec

from kvstream._exceptions import LayoutError
from kvstream.layout import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["SHM_DIR", "SharedKV", "SharedKVSpec"]

SHM_DIR = "/dev/shm"


class SharedKVSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What another process needs to map the same KV: names, layout, block count."""

    layout: KVLayout
    num_blocks: int
    names: list[str]

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes


def _path(name: str) -> str:
    if "/" in name or not name.startswith("kvstream-"):
        raise LayoutError(f"not a kvstream shared-memory name: {name!r}")
    return os.path.join(SHM_DIR, name)


def _map(path: str, size: int, *, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size != size:
            raise LayoutError(f"{path} holds {os.fstat(fd).st_size} bytes, the layout needs {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class SharedKV:
    """Per-layer KV tensors backed by shared-memory segments (one per layer)."""

    def __init__(self, spec: SharedKVSpec, maps: list[mmap.mmap], owner: bool) -> None:
        import torch

        self.spec = spec
        self._maps = maps
        self._owner = owner
        dtype = getattr(torch, spec.layout.dtype)
        shape = spec.layout.tensor_shape(spec.num_blocks)
        self.layers: list[torch.Tensor] = [
            torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape) for mm in maps
        ]

    @classmethod
    def create(cls, layout: KVLayout, num_blocks: int) -> SharedKV:
        """Allocate zeroed shared KV for ``num_blocks`` blocks per layer."""
        if num_blocks <= 0:
            raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
        token = secrets.token_hex(6)
        names = [f"kvstream-{os.getpid()}-{token}-{i}" for i in range(layout.num_layers)]
        spec = SharedKVSpec(layout=layout, num_blocks=num_blocks, names=names)
        maps: list[mmap.mmap] = []
        try:
            for name in names:
                maps.append(_map(_path(name), spec.layer_bytes, create=True))
        except BaseException:
            for mm in maps:
                mm.close()
            for name in names:
                if os.path.exists(_path(name)):
                    os.unlink(_path(name))
            raise
        return cls(spec, maps, owner=True)

    @classmethod
    def attach(cls, spec: SharedKVSpec) -> SharedKV:
        """Map segments another process created (the sidecar's side)."""
        if len(spec.names) != spec.layout.num_layers:
            raise LayoutError(f"{len(spec.names)} segments for {spec.layout.num_layers} layers")
        maps: list[mmap.mmap] = []
        try:
            for name in spec.names:
                maps.append(_map(_path(name), spec.layer_bytes, create=False))
        except FileNotFoundError as exc:
            for mm in maps:
                mm.close()
            raise LayoutError(f"shared KV segment missing: {exc.filename}") from exc
        return cls(spec, maps, owner=False)

    def unlink(self) -> None:
        """Remove the names; the memory lives on while any process maps it."""
        for name in self.spec.names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_path(name))

    def close(self) -> None:
        """Drop this process's tensors and mappings (views must not be used after)."""
        self.layers = []
        for mm in self._maps:
            # A view still alive somewhere keeps its mapping; it goes when the view does.
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps = []
        if self._owner:
            self.unlink()
