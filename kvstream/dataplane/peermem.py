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
from collections.abc import Callable
from typing import Final

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

__all__ = ["PeerKV", "PeerMaps"]

log = logging.getLogger("kvstream.transfer")

MAX_MAPPED_BYTES: Final = 1 << 40  # address space: the pages are the peer's


class PeerKV:
    """One peer's registered KV, mapped read-only; ``layer(i)`` is where layer i starts."""

    def __init__(self, export: SharedExport, layer_bytes: int, maps: list[mmap.mmap]) -> None:
        self.export = export
        self.layer_bytes = layer_bytes
        self._maps = maps
        bases = [int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data) for mm in maps]
        self._layers = [bases[seg] + offset for seg, offset in export.layers]
        self.users = 0
        self.dropped = False

    @property
    def nbytes(self) -> int:
        return sum(len(mm) for mm in self._maps)

    def layer(self, i: int) -> int:
        return self._layers[i]

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


def _key(export: SharedExport) -> tuple[object, ...]:
    # The whole export: two that name the same segments with other layer offsets are two
    # mappings (one must not hand its offsets to the other's transfers).
    return (export.pid, export.num_blocks, tuple(export.segments), tuple(export.layers))


class PeerMaps:
    """The mappings of same-host peers' KV, shared by their transfers, bounded in total."""

    def __init__(self, max_bytes: int = MAX_MAPPED_BYTES, max_peers: int = 256) -> None:
        self.max_bytes = max_bytes
        self.max_peers = max_peers
        self._lock = threading.Lock()  # never held across a system call that may block
        self._maps: dict[tuple[object, ...], PeerKV] = {}
        self._live: set[PeerKV] = set()  # mapped, cached or retired but still read

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for p in self._live)

    def acquire(self, export: SharedExport, layer_bytes: int, num_layers: int,
                proofs: list[bytes] | None = None, context: bytes = b"") -> PeerKV:
        """The peer's KV mapped (made now if need be: blocking, run it off the event loop),
        counted as used until ``release``. With ``proofs``: only if the sender holds the
        segments (``PeerKV.holds``). ``LayoutError`` if it cannot be mapped, is not the
        sender's, or does not hold ``num_layers`` layers of ``layer_bytes``."""
        if len(export.layers) != num_layers or export.num_blocks <= 0:
            raise LayoutError(f"the peer's shared KV has {len(export.layers)} layers, "
                              f"the transfer {num_layers}")
        used = {seg for seg, _ in export.layers}
        if used != set(range(len(export.segments))):
            raise LayoutError("the peer's shared KV names segments no layer uses")
        for seg, offset in export.layers:
            if seg >= len(export.segments) or \
                    offset + layer_bytes > export.segments[seg].size - TRAILER:
                raise LayoutError("the peer's shared KV names a layer outside its segments")
        key = _key(export)
        size = sum(s.size for s in export.segments)
        with self._lock:
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
        if proofs is not None and not kv.holds(proofs, context):
            self.release(kv)
            with self._lock:
                if self._maps.get(key) is kv and kv.users == 0:
                    self._retire(self._maps.pop(key))  # never kept for a forger
            raise LayoutError("the sender does not hold the shared KV it names")
        return kv

    def _fresh(self, export: SharedExport, layer_bytes: int, key: tuple[object, ...]) -> PeerKV:
        maps: list[mmap.mmap] = []
        try:
            for seg in export.segments:
                maps.append(self._map(export.pid, seg))
        except BaseException:
            for mm in maps:
                mm.close()
            raise
        kv = PeerKV(export, layer_bytes, maps)
        with self._lock:
            current = self._maps.get(key)
            if current is not None and current.layer_bytes == layer_bytes:
                kv.close()  # mapped meanwhile by another transfer: share that one
                current.users += 1
                return current
            if current is not None:
                self._retire(self._maps.pop(key))
            self._maps[key] = kv
            self._live.add(kv)
            kv.users += 1
            return kv

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

    def release(self, kv: PeerKV) -> None:
        with self._lock:
            kv.users -= 1
            if kv.users == 0 and kv.dropped:
                self._close(kv)

    def drop(self, pid: int | None = None) -> None:
        """Forget the mappings of that process (all, if None): unmapped once unused."""
        with self._lock:
            for key in [k for k, kv in self._maps.items() if pid is None or kv.export.pid == pid]:
                self._retire(self._maps.pop(key))

    def drop_except(self, pids: set[int]) -> None:
        with self._lock:
            for key in [k for k, kv in self._maps.items() if kv.export.pid not in pids]:
                self._retire(self._maps.pop(key))

    def _retire(self, kv: PeerKV) -> None:
        kv.dropped = True
        if kv.users == 0:
            self._close(kv)

    def _close(self, kv: PeerKV) -> None:
        self._live.discard(kv)
        kv.close()

    def _evict_idle(self) -> None:
        for key in [k for k, kv in self._maps.items() if kv.users == 0]:
            self._retire(self._maps.pop(key))


class MappedSource:
    """One transfer's reads from a mapped peer: its source blocks, copied per layer
    straight into destination rows (``[planes, num_blocks, chunk]`` on both ends)."""

    def __init__(self, maps: PeerMaps, kv: PeerKV, src_ids: list[int], *, planes: int,
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
        from kvstream.dataplane.blockcopy import copy_blocks

        if self._released or not alive():
            raise LayoutError("the transfer ended before its layer was read")
        copy_blocks(dst_ptr, dst_size, dst_off, self.kv.layer(layer), self.kv.layer_bytes,
                    self._src_off, self.chunk)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._maps.release(self.kv)
