"""Host KV in sealed shared memory: mapped by the engine's sidecar, and read by same-host
peers in one copy (``dataplane/peermem.py``).

The engine allocates its KV cache here: one ``memfd`` for all layers (layer i at
``i * layer_bytes``), sealed against shrinking and growing, so that no process that maps
it can be killed by ``SIGBUS`` because the owner truncated it. Another process of the
same user reaches it through ``/proc/<pid>/fd/<fd>`` (the kernel checks that it may);
the file has no name, so nothing is left behind when the processes are gone.

Every segment this process created or mapped is listed (``find``), so registering
tensors that live in one tells the agent it may export them to same-host peers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import itertools
import mmap
import os
import secrets
import stat
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import msgspec

from kvstream._exceptions import LayoutError
from kvstream.layout import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = ["SEALS", "Segment", "SharedExport", "SharedKV", "SharedKVSpec", "export", "find",
           "open_segment", "proof_context", "proofs_of", "read_only", "segment_proof"]

# Sealed against size changes (a shrink would turn a peer's read into SIGBUS).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MAX_SEGMENTS = 64
# After the KV, one page holding the segment's secret: 32 random bytes that never leave
# the processes mapping the segment. The export is announced to everyone, so a manifest
# proves its sender holds the segment with HMAC(secret, sender | destination | transfer)
# (``Manifest.src_secrets``): not another tenant naming someone else's KV for a
# destination to copy, nor a destination replaying a proof to a third agent.
SECRET_BYTES = 32
TRAILER = 4096
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """One sealed memfd as its owner holds it: the fd number in the owner, its inode
    (a reused fd number then names another file and is refused) and its size."""

    fd: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
    inode: Count
    size: Count


class SharedExport(msgspec.Struct, frozen=True, kw_only=True):
    """Where a process's registered KV lives, for a same-host peer to map read-only:
    layer i is ``segments[layers[i][0]]`` from byte ``layers[i][1]``."""

    pid: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]  # per layer, as registered
    segments: Annotated[list[Segment], msgspec.Meta(max_length=MAX_SEGMENTS)]
    layers: Annotated[list[tuple[Annotated[int, msgspec.Meta(ge=0, lt=MAX_SEGMENTS)], Count]],
                      msgspec.Meta(max_length=4096)]


class SharedKVSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What another process needs to map the same KV: where, which layout, how many blocks."""

    layout: KVLayout
    num_blocks: int
    pid: int
    fd: int
    inode: int

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    @property
    def size(self) -> int:
        """The file's size: every layer, then the trailer with the segment's secret."""
        return self.layer_bytes * self.layout.num_layers + TRAILER


class _Mapped(msgspec.Struct):
    address: int
    segment: Segment
    secret: bytes


_lock = threading.Lock()
_mapped: dict[int, _Mapped] = {}  # a token per mapping -> where its memory is
_tokens = itertools.count()


def _unmapped(token: int, fd: int) -> None:
    """The mapping is gone (closed, or no tensor uses it any more): so is its entry."""
    with _lock:
        _mapped.pop(token, None)
    with contextlib.suppress(OSError):
        os.close(fd)


def open_segment(pid: int, seg: Segment, *, writable: bool) -> int:
    """Open another process's sealed segment; the fd, after checking it is the file it
    was said to be (inode, size, seals). ``LayoutError`` if not."""
    path = f"/proc/{pid}/fd/{seg.fd}"
    try:
        # What it names, before opening it: a FIFO or device could block the open.
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != seg.inode or st.st_size != seg.size:
            raise LayoutError(f"{path} is not the segment announced")
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
                     | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise LayoutError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != seg.inode or st.st_size != seg.size:
            raise LayoutError(f"{path} is not the segment announced (inode {st.st_ino}, "
                              f"{st.st_size} bytes; expected {seg.inode}, {seg.size})")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise LayoutError(f"{path} cannot be sealed: not a kvstream segment") from exc
        if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != \
                fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
            raise LayoutError(f"{path} is not sealed against resizing")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_spec(spec: SharedKVSpec) -> None:
    if spec.num_blocks <= 0:
        raise LayoutError(f"num_blocks must be positive, got {spec.num_blocks}")


class SharedKV:
    """Per-layer KV tensors in one sealed shared-memory segment."""

    def __init__(self, spec: SharedKVSpec, fd: int, mm: mmap.mmap) -> None:
        import numpy as np
        import torch

        self.spec = spec
        self._fd = fd
        self._map = mm
        dtype = getattr(torch, spec.layout.dtype)
        shape = spec.layout.tensor_shape(spec.num_blocks)
        per = spec.layout.tensors_per_layer  # a split layout: K of every layer, then V
        step = spec.layer_bytes // per
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        self.layers: list[torch.Tensor] = [
            flat[i * step:(i + 1) * step].view(dtype).view(shape)
            for i in range(spec.layout.num_layers * per)
        ]
        address = int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)
        self._token = next(_tokens)
        start = spec.size - TRAILER
        secret = bytes(mm[start:start + SECRET_BYTES])
        with _lock:
            _mapped[self._token] = _Mapped(address, Segment(fd, os.fstat(fd).st_ino, spec.size),
                                           secret)
        # Tensors keep the mapping alive after this object is gone; the fd and the entry
        # (what peers open, what ``export`` finds) live exactly as long as the mapping.
        self._finalizer = weakref.finalize(mm, _unmapped, self._token, fd)

    @classmethod
    def create(cls, layout: KVLayout, num_blocks: int) -> SharedKV:
        """Allocate zeroed shared KV for ``num_blocks`` blocks per layer."""
        if num_blocks <= 0:
            raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
        size = num_blocks * layout.block_bytes * layout.num_layers + TRAILER
        fd = os.memfd_create("kvstream-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, secrets.token_bytes(SECRET_BYTES), size - TRAILER)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            spec = SharedKVSpec(layout=layout, num_blocks=num_blocks, pid=os.getpid(), fd=fd,
                                inode=os.fstat(fd).st_ino)
            return cls(spec, fd, mmap.mmap(fd, size))
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, spec: SharedKVSpec) -> SharedKV:
        """Map, writable, the KV another process created (the sidecar's side)."""
        _check_spec(spec)
        fd = open_segment(spec.pid, Segment(spec.fd, spec.inode, spec.size), writable=True)
        try:
            return cls(spec, fd, mmap.mmap(fd, spec.size))
        except BaseException:
            os.close(fd)
            raise

    def allow_attach(self) -> None:
        """Let this user's sidecar open the segment writable once more (``attach``; a
        registration exports it read-only again)."""
        os.fchmod(self._fd, 0o600)

    def unlink(self) -> None:
        """Kept for callers of the named-segment version: a memfd has no name to remove."""

    def close(self) -> None:
        """Drop this process's tensors and mapping (views must not be used after); peers
        can no longer open the segment."""
        self.layers = []
        # A view still alive somewhere keeps its mapping; it goes when the view does.
        with contextlib.suppress(BufferError):
            self._map.close()
        self._finalizer()

def find(address: int, nbytes: int) -> tuple[Segment, int] | None:
    """The segment of this process holding ``[address, address + nbytes)``, and the offset."""
    with _lock:
        for m in _mapped.values():
            if m.address <= address and address + nbytes <= m.address + m.segment.size:
                return m.segment, address - m.address
    return None


def segment_proof(secret: bytes, context: bytes) -> bytes:
    return hmac.new(secret, context, hashlib.sha256).digest()


def proof_context(src: str, dst: str, transfer_id: str) -> bytes:
    """What a proof is bound to: one sender, one destination, one transfer."""
    return "\0".join((src, dst, transfer_id)).encode()


def proofs_of(shared: SharedExport, context: bytes) -> list[bytes]:
    """Proofs that this process holds the segments of ``shared`` (``segment_proof``)."""
    with _lock:
        known = {m.segment: m.secret for m in _mapped.values()}
    return [segment_proof(known[seg], context) if seg in known else b""
            for seg in shared.segments]


def export(layers: Sequence[torch.Tensor], num_blocks: int) -> SharedExport | None:
    """Where these host tensors live in shared segments; None when any does not."""
    segments: list[Segment] = []
    where: list[tuple[int, int]] = []
    for t in layers:
        if t.device.type != "cpu":
            return None
        found = find(t.data_ptr(), t.numel() * t.element_size())
        if found is None:
            return None
        seg, offset = found
        if seg not in segments:
            if len(segments) == MAX_SEGMENTS:
                return None
            segments.append(seg)
        where.append((segments.index(seg), offset))
    for seg in segments:
        read_only(seg.fd)
    return SharedExport(pid=os.getpid(), num_blocks=num_blocks, segments=segments, layers=where)


def read_only(fd: int) -> None:
    """Let later openers of this segment (through ``/proc/<pid>/fd``) read it only: an
    exported segment is read by peers, never written by them. Mappings and fds already
    open keep their access (the owner's, its sidecar's). Root is not held back by it, and
    any process of the same user may read (or ptrace) the owner's memory anyway: this
    takes away writes through a stray open, not what the user itself can do."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o400)
