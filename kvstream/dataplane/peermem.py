"""Same-host peers' KV, mapped read-only: what the one-copy path reads from.

The destination of a same-host transfer maps the source's sealed segments
(``kvstream.shm``) through ``/proc/<pid>/fd`` and copies the source's blocks straight
into its own (one copy, no staging on either side). Reading, not writing: no peer ever
holds a writable view of another's KV, and the destination writes only into blocks it
validated itself. A mapping is checked before use (inode, size, seals: a segment that
could shrink could kill the reader with SIGBUS) and the sender's proof that it holds the
segment, counted while transfers use it, and unmapped once the peer is gone and nothing
uses it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, Generic, Protocol, TypeVar

import msgspec
import numpy as np

from kvstream._exceptions import LayoutError
from kvstream.shm import (
    SECRET_BYTES,
    TRAILER,
    Segment,
    SharedExport,
    open_segment,
    segment_proof,
)

__all__ = ["MapCache", "Mapped", "MappedSource", "PeerKV", "PeerMaps"]

log = logging.getLogger("kvstream.transfer")

MAX_MAPPED_BYTES: Final = 1 << 40  # address space: the pages are the peer's


class Export(Protocol):
    """What a peer names its KV with (``shm.SharedExport``, ``cuda_ipc.DeviceExport``)."""

    @property
    def pid(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def layers(self) -> Sequence[Any]: ...


class Mapped:
    """One peer's KV as this process sees it (mapped or opened), shared by its transfers:
    ``layer(i)`` is where layer i starts, ``layer_bytes`` how far it reaches."""

    def __init__(self, export: Export, layer_bytes: int) -> None:
        self.export = export
        self.layer_bytes = layer_bytes
        self.users = 0
        self.dropped = False

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def layer(self, i: int) -> int:
        raise NotImplementedError

    def copy(self, layer: int, src_off: np.ndarray, dst_ptr: int, dst_size: int,
             dst_off: np.ndarray, nbytes: int) -> None:
        """Blocking: items of ``nbytes`` from the layer at ``src_off`` to ``dst_ptr + dst_off``,
        done when it returns (nothing of the peer's is read after)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class PeerKV(Mapped):
    """One peer's registered host KV, mapped read-only."""

    def __init__(self, export: SharedExport, layer_bytes: int, maps: list[mmap.mmap]) -> None:
        super().__init__(export, layer_bytes)
        self._maps = maps
        bases = [int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data) for mm in maps]
        self._layers = [bases[seg] + offset for seg, offset in export.layers]

    @property
    def nbytes(self) -> int:
        return sum(len(mm) for mm in self._maps)

    def layer(self, i: int) -> int:
        return self._layers[i]

    def copy(self, layer: int, src_off: np.ndarray, dst_ptr: int, dst_size: int,
             dst_off: np.ndarray, nbytes: int) -> None:
        from kvstream.dataplane.blockcopy import copy_blocks

        copy_blocks(dst_ptr, dst_size, dst_off, self.layer(layer), self.layer_bytes, src_off,
                    nbytes)

    def holds(self, proofs: list[bytes], context: bytes) -> bool:
        """Does the sender hold these segments? Each proof is HMAC(the segment's secret,
        ``context``): bound to one sender, destination and transfer, so a destination that
        saw one cannot use it to name the segments to anyone else."""
        if len(proofs) != len(self._maps):
            return False
        for mm, proof in zip(self._maps, proofs, strict=True):
            start = len(mm) - TRAILER
            want = segment_proof(bytes(mm[start:start + SECRET_BYTES]), context)
            if not hmac.compare_digest(want, proof):
                return False
        return True

    def close(self) -> None:
        for mm in self._maps:
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps = []


M = TypeVar("M", bound=Mapped)


class MapCache(Generic[M]):
    """Peers' mapped KV, shared by their transfers, bounded in total, keyed by the whole
    export (two that name the same memory with other layer offsets are two mappings: one
    must not hand its offsets to the other's transfers). Subclasses say how an export is
    checked, sized and mapped."""

    def __init__(self, max_bytes: int, max_peers: int) -> None:
        self.max_bytes = max_bytes
        self.max_peers = max_peers
        self._lock = threading.Lock()  # never held across a system call that may block
        self._maps: dict[object, M] = {}
        self._live: set[M] = set()  # mapped, cached or retired but still read
        self._doomed: list[M] = []  # unused and dropped: closed once the lock is let go

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock; what was doomed under it is closed after (``_dispose``)."""
        with self._lock:
            yield
            doomed, self._doomed = self._doomed, []
        for kv in doomed:
            self._dispose(kv)

    def _dispose(self, kv: M) -> None:
        """Unmap (a subclass may hand it to a thread: closing may block)."""
        kv.close()

    def _check(self, export: Any, layer_bytes: int, num_layers: int) -> None:
        raise NotImplementedError

    def _size(self, export: Any) -> int:
        raise NotImplementedError

    def _open(self, export: Any, layer_bytes: int) -> M:
        raise NotImplementedError

    @property
    def mapped_bytes(self) -> int:
        with self._locked():
            return sum(p.nbytes for p in self._live)

    def _acquire(self, export: Any, layer_bytes: int, num_layers: int,
                 verify: Callable[[M], bool] | None = None) -> M:
        """The peer's KV mapped (made now if need be: blocking, run it off the event loop),
        counted as used until ``release``; with ``verify``, only if it says yes (a mapping
        that fails it is never kept). ``LayoutError`` if it cannot be mapped, fails
        ``verify``, or does not hold ``num_layers`` layers of ``layer_bytes``."""
        if len(export.layers) != num_layers or export.num_blocks <= 0:
            raise LayoutError(f"the peer's KV has {len(export.layers)} layers, "
                              f"the transfer {num_layers}")
        self._check(export, layer_bytes, num_layers)
        key = msgspec.msgpack.encode(export)  # the whole export, canonical
        size = self._size(export)
        with self._locked():
            kv = self._maps.get(key)
            if kv is not None and kv.layer_bytes == layer_bytes:
                kv.users += 1
            else:
                kv = None
                if len(self._maps) >= self.max_peers or \
                        sum(p.nbytes for p in self._live) + size > self.max_bytes:
                    self._evict_idle()
                if len(self._maps) >= self.max_peers or \
                        sum(p.nbytes for p in self._live) + size > self.max_bytes:
                    raise LayoutError("too much peer KV mapped already")
        if kv is None:
            kv = self._fresh(export, layer_bytes, key)
        if verify is not None and not verify(kv):
            self.release(kv)
            with self._locked():
                if self._maps.get(key) is kv and kv.users == 0:
                    self._retire(self._maps.pop(key))  # never kept for a forger
            raise LayoutError("the sender does not hold the KV it names")
        return kv

    def _fresh(self, export: Any, layer_bytes: int, key: object) -> M:
        kv = self._open(export, layer_bytes)
        with self._locked():
            current = self._maps.get(key)
            if current is not None and current.layer_bytes == layer_bytes:
                self._doomed.append(kv)  # mapped meanwhile by another transfer: share that one
                current.users += 1
                return current
            if current is not None:
                self._retire(self._maps.pop(key))
            self._maps[key] = kv
            self._live.add(kv)
            kv.users += 1
            return kv

    def release(self, kv: M) -> None:
        with self._locked():
            kv.users -= 1
            if kv.users == 0 and kv.dropped:
                self._close(kv)

    def drop(self, pid: int | None = None) -> None:
        """Forget the mappings of that process (all, if None): unmapped once unused."""
        with self._locked():
            for key in [k for k, kv in self._maps.items() if pid is None or kv.export.pid == pid]:
                self._retire(self._maps.pop(key))

    def drop_if(self, which: Callable[[Any], bool]) -> None:
        """Forget the mappings of the exports ``which`` says yes to."""
        with self._locked():
            for key in [k for k, kv in self._maps.items() if which(kv.export)]:
                self._retire(self._maps.pop(key))

    def drop_except(self, pids: set[int]) -> None:
        with self._locked():
            for key in [k for k, kv in self._maps.items() if kv.export.pid not in pids]:
                self._retire(self._maps.pop(key))

    def _retire(self, kv: M) -> None:
        kv.dropped = True
        if kv.users == 0:
            self._close(kv)

    def _close(self, kv: M) -> None:
        self._live.discard(kv)
        self._doomed.append(kv)

    def _evict_idle(self) -> None:
        for key in [k for k, kv in self._maps.items() if kv.users == 0]:
            self._retire(self._maps.pop(key))


class PeerMaps(MapCache[PeerKV]):
    """Same-host peers' host KV: sealed shared segments mapped read-only."""

    def __init__(self, max_bytes: int = MAX_MAPPED_BYTES, max_peers: int = 256) -> None:
        super().__init__(max_bytes, max_peers)

    def _check(self, export: SharedExport, layer_bytes: int, num_layers: int) -> None:
        used = {seg for seg, _ in export.layers}
        if used != set(range(len(export.segments))):
            raise LayoutError("the peer's shared KV names segments no layer uses")
        for seg, offset in export.layers:
            if seg >= len(export.segments) or \
                    offset + layer_bytes > export.segments[seg].size - TRAILER:
                raise LayoutError("the peer's shared KV names a layer outside its segments")

    def _size(self, export: SharedExport) -> int:
        return sum(s.size for s in export.segments)

    def _open(self, export: SharedExport, layer_bytes: int) -> PeerKV:
        maps: list[mmap.mmap] = []
        try:
            for seg in export.segments:
                maps.append(self._map(export.pid, seg))
        except BaseException:
            for mm in maps:
                mm.close()
            raise
        return PeerKV(export, layer_bytes, maps)

    @staticmethod
    def _map(pid: int, seg: Segment) -> mmap.mmap:
        if seg.size <= TRAILER:
            raise LayoutError(f"a peer segment of {seg.size} bytes holds no KV")
        fd = open_segment(pid, seg, writable=False)
        try:
            # No MAP_POPULATE: it would allocate the source's untouched pages (charged to
            # us); a transfer faults in only the blocks it reads, once per mapping.
            return mmap.mmap(fd, seg.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise LayoutError(f"cannot map the peer's KV: {exc}") from exc
        finally:
            os.close(fd)

    def acquire(self, export: SharedExport, layer_bytes: int, num_layers: int,
                proofs: list[bytes] | None = None, context: bytes = b"") -> PeerKV:
        """The peer's segments mapped (``MapCache._acquire``); with ``proofs``, only if the
        sender holds them (``PeerKV.holds``)."""
        verify = None if proofs is None else (lambda kv: kv.holds(proofs, context))
        return self._acquire(export, layer_bytes, num_layers, verify)


class MappedSource:
    """One transfer's reads from a mapped peer (host or device KV): its source blocks,
    copied per layer straight into destination rows (``[planes, num_blocks, chunk]`` on
    both ends)."""

    def __init__(self, maps: MapCache[Any], kv: Mapped, src_ids: list[int], *, planes: int,
                 chunk_bytes: int) -> None:
        bad = [b for b in src_ids if not 0 <= b < kv.export.num_blocks]
        if bad:  # the source's own ids, checked here: they steer our reads
            raise LayoutError(f"source block ids {bad[:8]} outside the peer's "
                              f"{kv.export.num_blocks} shared blocks")
        self._maps, self.kv = maps, kv
        self.planes, self.chunk = planes, chunk_bytes
        ids = np.asarray(src_ids, dtype=np.int64)
        nb = kv.export.num_blocks
        self._src_off = ((np.arange(planes, dtype=np.int64)[:, None] * nb + ids[None, :])
                         * chunk_bytes).reshape(-1)
        self._released = False

    def dst_offsets(self, dst_num_blocks: int, dst_ids: list[int] | None) -> np.ndarray:
        """Where each item lands in a ``[planes, dst_num_blocks, chunk]`` destination
        (``dst_ids`` None: a staging buffer in wire order)."""
        n = self._src_off.size // self.planes
        ids = np.arange(n, dtype=np.int64) if dst_ids is None else \
            np.asarray(dst_ids, dtype=np.int64)
        return ((np.arange(self.planes, dtype=np.int64)[:, None] * dst_num_blocks + ids[None, :])
                * self.chunk).reshape(-1)

    def copy_layer(self, layer: int, dst_ptr: int, dst_size: int, dst_off: np.ndarray,
                   alive: Callable[[], bool] = lambda: True) -> None:
        """Blocking (a copy thread): the layer's source blocks into the destination, unless
        the transfer ended while this copy waited for a thread (the source may have its
        blocks back by now: never read them then)."""
        if self._released or not alive():
            raise LayoutError("the transfer ended before its layer was read")
        self.kv.copy(layer, self._src_off, dst_ptr, dst_size, dst_off, self.chunk)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._maps.release(self.kv)
