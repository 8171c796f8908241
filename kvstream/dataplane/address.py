"""Refuse a peer's UCP worker address before UCX parses it.

A peer's worker address arrives inside control messages, and UCX trusts it
completely: ``ucp_address_unpack`` is handed a pointer, never a length, and
aborts the process (``ucs_assertv_always``) on an unknown address version, so
one flipped header byte kills the agent. ``check_worker_address`` walks the
packed format as UCX 1.21 (``src/ucp/wireup/address.c``, tag v1.21.0) writes
it and refuses anything that UCX's own packer could not have produced for a
worker address, so what reaches UCX is well formed and ends where it should.

The layout, as ``ucp_address_do_pack`` writes it for ``ucp_worker_get_address``
(worker UUID, worker name and device / iface addresses; never endpoint
addresses, never a client id; non-unified mode)::

    v1  header   1 byte: version 0 (low nibble) | header flags (high nibble)
    v2  header   2 bytes: version 1 | release (high nibble); header flags
        uuid     8 bytes (header flag WORKER_UUID, always set)
        name     1 length byte + bytes (header flag DEBUG_INFO)
        0xff     (only byte after the header) when there are no devices
    per device:
        md       byte: EMPTY_DEV 0x80 | md index (v2: 0x7f means "next byte")
        dev len  byte: LAST 0x80 | NUM_PATHS 0x40 | SYS_DEVICE 0x20 | length
                 (v2: 0x1f means "next byte")
        paths    1 byte if NUM_PATHS, sys dev 1 byte if SYS_DEVICE
        address  dev len bytes
        per iface (none if EMPTY_DEV):
            tl name checksum 2 bytes, attributes (v1: 3 floats + u32; v2: 8),
            iface len byte: LAST 0x80 | HAS_EP_ADDR 0x40 | length (v2: 0x3f
            means "next byte"), then the iface address
    v1 ends with a pseudo device carrying the release version: 0x80|rel, 0x80.

Beyond the walk, UCX hands each entry's device and iface address, as bare
pointers, to the local transport with that name checksum, which reads the struct
it would have written: so entries of the transports this wheel ships must have
exactly the lengths those write (the table at the end). ``check_local_segments``
then looks at the kernel objects posix and sysv entries name, which UCX maps
unverified. What stays unchecked: the values inside (an IP and port, a pid, a
segment that is some other process's live FIFO) name other endpoints that UCX
fails to reach or reaches wrongly without crashing us; held by
``tests/unit/test_worker_address.py``, which feeds every single-bit flip of real
addresses to UCX in a child process. ``UCX_UNIFIED_MODE`` addresses leave the
lengths out altogether; ``UcxWorker.open`` refuses that mode.
"""

from __future__ import annotations

import math
import os
import re
import stat
import struct
from collections.abc import Callable
from typing import Final

from kvstream._exceptions import ProtocolError

__all__ = ["MAX_ADDRESS_BYTES", "check_local_segments", "check_worker_address",
           "set_ucx_version", "ucx_namespace_bytes", "unknown_transports"]

# Real addresses are ~40-300 bytes; 128 resources of ~300 bytes each stay below this.
MAX_ADDRESS_BYTES: Final = 64 * 1024

_V1: Final = 0
_V2: Final = 1

# Header flags (UCP_ADDRESS_HEADER_FLAG_*).
_HDR_DEBUG_INFO: Final = 0x01
_HDR_WORKER_UUID: Final = 0x02
_HDR_CLIENT_ID: Final = 0x04
_HDR_AM_ONLY: Final = 0x08

_NULL_RESOURCE: Final = 0xFF
_FLAG_LAST: Final = 0x80
_MD_EMPTY_DEV: Final = 0x80
_MD_MASK: Final = 0x7F
_DEV_NUM_PATHS: Final = 0x40
_DEV_SYS_DEVICE: Final = 0x20
_DEV_LEN_MASK: Final = 0x1F
_IFACE_HAS_EP_ADDR: Final = 0x40
_IFACE_LEN_MASK: Final = 0x3F
_SYS_DEVICE_UNKNOWN: Final = 0xFF

# UCP_MAX_MDS: wireup indexes a UCP_MAX_MDS array with the remote md index.
_MAX_MDS: Final = 64
# UCP_MAX_RESOURCES: the most iface entries (and devices) an address may hold.
_MAX_RESOURCES: Final = 128
# The worker name: UCP_WORKER_ADDRESS_NAME_MAX (32) with its terminating NUL.
_MAX_NAME: Final = 31

_V1_ATTRS: Final = struct.Struct("<fffI")  # overhead, bandwidth, lat_ovh, prio|caps
_V2_ATTRS_SIZE: Final = 8  # fp8 overhead, bandwidth, latency; prio; u16 seg size, flags


class _Reader:
    """A cursor that refuses to step outside the buffer."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def fail(self, reason: str) -> ProtocolError:
        return ProtocolError(
            f"peer UCX worker address refused ({len(self.data)} bytes): {reason} at byte {self.pos}"
        )

    def byte(self, what: str) -> int:
        if self.pos >= len(self.data):
            raise self.fail(f"truncated before the {what}")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise self.fail(f"truncated inside the {what} ({n} bytes)")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def extended(self, low: int, mask: int, version: int, what: str) -> int:
        """A value packed in ``low & mask`` or, in v2, in the next byte when it is all ones."""
        value = low & mask
        if version == _V2 and value == mask:
            value = self.byte(what)
            if value < mask:  # the packer extends only values that do not fit
                raise self.fail(f"non-canonical extended {what} {value}")
        return value


def check_worker_address(data: bytes) -> bytes:
    """``data`` as immutable bytes if it is a well-formed UCP worker address.

    Called by ``UcxWorker.endpoint`` on every address a peer announced, before
    ucxx or UCX sees it. Raises ``ProtocolError`` naming the first fault: a
    length outside 1 .. ``MAX_ADDRESS_BYTES``, a version or header flag UCX's
    worker-address packer does not write, a record running past the end,
    bytes after the last device, or a field value the packer never produces.
    """
    data = bytes(data)
    _walk(data)
    return data


def unknown_transports(data: bytes) -> frozenset[int]:
    """Name checksums in a valid address whose transport addresses are not checked here.

    ``UcxWorker.open`` asks this of its own address: a transport the bundled UCX does not
    ship (InfiniBand, from another UCX build) would be matched by peers' entries that
    were checked for structure only.
    """
    return frozenset(csum for csum, _, _ in _walk(bytes(data)) if csum not in _TRANSPORTS)


def _walk(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """Check ``data`` whole; its (name checksum, device address, iface address) entries."""
    if not data:
        raise ProtocolError("peer UCX worker address refused: empty")
    if len(data) > MAX_ADDRESS_BYTES:
        raise ProtocolError(
            f"peer UCX worker address refused: {len(data)} bytes, more than {MAX_ADDRESS_BYTES}"
        )
    r = _Reader(data)
    version = _header(r)
    entries: list[tuple[int, bytes, bytes]] = []
    if r.data[r.pos:r.pos + 1] == bytes([_NULL_RESOURCE]):
        r.pos += 1  # a worker with no transport able to connect
    else:
        _devices(r, version, entries)
    if r.pos != len(data):
        raise r.fail(f"{len(data) - r.pos} bytes after the last device")
    return entries


def _header(r: _Reader) -> int:
    first = r.byte("header")
    version = first & 0x0F
    if version == _V1:
        flags = first >> 4
    elif version == _V2:
        flags = r.byte("header flags")
    else:
        # UCX aborts the process on this (ucp_address_unpack_header).
        raise r.fail(f"unknown address version {version}")
    if flags & ~(_HDR_DEBUG_INFO | _HDR_WORKER_UUID | _HDR_CLIENT_ID | _HDR_AM_ONLY):
        raise r.fail(f"unknown header flags {flags:#x}")
    if not flags & _HDR_WORKER_UUID:
        raise r.fail("no worker UUID (every worker address has one)")
    if flags & (_HDR_CLIENT_ID | _HDR_AM_ONLY):
        raise r.fail(f"header flags {flags:#x} belong to connection-manager addresses")
    r.take(8, "worker UUID")
    if flags & _HDR_DEBUG_INFO:
        n = r.byte("worker name length")
        if n > _MAX_NAME:
            raise r.fail(f"worker name of {n} bytes (at most {_MAX_NAME})")
        r.take(n, "worker name")
    return version


def _devices(r: _Reader, version: int, out: list[tuple[int, bytes, bytes]]) -> None:
    devices = 0
    while True:
        devices += 1
        if devices > _MAX_RESOURCES:
            raise r.fail(f"more than {_MAX_RESOURCES} devices")
        md_byte = r.byte("md index")
        empty = bool(md_byte & _MD_EMPTY_DEV)
        md_index = r.extended(md_byte, _MD_MASK, version, "md index")
        dev_byte = r.byte("device address length")
        last = bool(dev_byte & _FLAG_LAST)
        dev_len = r.extended(dev_byte, _DEV_LEN_MASK, version, "device address length")
        if dev_byte & _DEV_NUM_PATHS and r.byte("number of paths") < 2:
            # The packer writes the count only when it is above 1; 0 would divide by zero.
            raise r.fail("device number of paths below 2")
        if dev_byte & _DEV_SYS_DEVICE and r.byte("system device") == _SYS_DEVICE_UNKNOWN:
            raise r.fail("system device 'unknown' packed explicitly")
        if empty:
            # Only the v1 release-version pseudo device is empty: it ends the address.
            if (version != _V1 or not last or dev_len
                    or dev_byte & (_DEV_NUM_PATHS | _DEV_SYS_DEVICE)):
                raise r.fail("an empty device that is not the closing release-version record")
            return
        if md_index >= _MAX_MDS:
            raise r.fail(f"md index {md_index} (at most {_MAX_MDS - 1})")
        dev_addr = r.take(dev_len, "device address")
        while True:
            if len(out) == _MAX_RESOURCES:
                raise r.fail(f"more than {_MAX_RESOURCES} transport entries")
            csum = int.from_bytes(r.take(2, "transport name checksum"), "little")
            _iface_attrs(r, version)
            len_byte = r.byte("iface address length")
            if len_byte & _IFACE_HAS_EP_ADDR:
                raise r.fail("an endpoint address (worker addresses carry none)")
            iface_len = r.extended(len_byte, _IFACE_LEN_MASK, version, "iface address length")
            iface_addr = r.take(iface_len, "iface address")
            check = _TRANSPORTS.get(csum)
            if check is not None and (fault := check[1](dev_addr, iface_addr)):
                raise r.fail(f"{check[0]} entry: {fault}")
            out.append((csum, dev_addr, iface_addr))
            if len_byte & _FLAG_LAST:
                break
        if last:
            return


def _iface_attrs(r: _Reader, version: int) -> None:
    if version == _V2:
        r.take(_V2_ATTRS_SIZE, "iface attributes")
        return
    overhead, bandwidth, lat_ovh, _ = _V1_ATTRS.unpack(r.take(_V1_ATTRS.size, "iface attributes"))
    # UCX refuses bandwidth <= 0 but lets NaN through into lane selection.
    if not all(math.isfinite(v) for v in (overhead, bandwidth, lat_ovh)):
        raise r.fail("non-finite iface performance figures")
    if bandwidth <= 0 or overhead < 0 or lat_ovh < 0:
        raise r.fail("iface bandwidth not positive, or a negative overhead or latency")


# --- transport addresses -------------------------------------------------------------
#
# UCX hands an entry's device and iface address to the local transport whose name
# checksum matches, as bare pointers: the transport reads the struct it would have
# written and trusts flags inside it for how much follows (a zero length is a NULL
# pointer, which tcp dereferences). So for every transport the bundled UCX can load
# (libuct: self, tcp, sysv, posix; libuct_cma: cma; libuct_cuda: cuda_copy, cuda_ipc)
# the lengths must be the ones its get_address functions write. Entries naming any
# other transport match no local resource, and UCX skips them.

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_LOCAL_ADDR_FLAG_NS: Final = 1 << 63  # UCT_IFACE_LOCAL_ADDR_FLAG_NS

# The size of a namespace id (ucs_sys_ns_t) in the addresses the loaded UCX writes: an
# 8-byte inode up to 1.21; UCX 1.22 packs 4 bytes (so its shared-memory, cma and TCP
# loopback addresses are shorter inside namespaces, and cuda_ipc adds the pid namespace).
_ns_bytes = 8


def set_ucx_version(version: tuple[int, ...]) -> None:
    """The lengths to expect are those of the UCX loaded here (``ucxx.get_ucx_version()``):
    the peers of one deployment run one UCX (an entry with another release's lengths is
    refused, never handed to UCX)."""
    global _ns_bytes
    _ns_bytes = 4 if tuple(version[:2]) >= (1, 22) else 8


def ucx_namespace_bytes() -> int:
    return _ns_bytes
_TCP_FLAG_LOOPBACK: Final = 0x01  # UCT_TCP_DEVICE_ADDR_FLAG_LOOPBACK
_AF_INET: Final = 2  # Linux values, as UCX packs sa_family
_AF_INET6: Final = 10
_POSIX_PROCFS: Final = 1 << 63  # UCT_POSIX_SEG_FLAG_*
_POSIX_SHM_OPEN: Final = 1 << 62
_POSIX_PID_NS: Final = 1 << 60
_CMA_PID_NS: Final = 1 << 31  # UCT_CMA_IFACE_ADDR_FLAG_PID_NS
_CUDA_IPC_MNNVL: Final = 0x01


def _length(what: str, got: int, want: int) -> str:
    return "" if got == want else f"{what} of {got} bytes, {want} expected"


def _sm_device(dev: bytes) -> str:
    """uct_iface_local_addr_ns_t: an 8-byte host id, + a namespace id iff its top bit."""
    if len(dev) < 8:
        return _length("device address", len(dev), 8)
    return _length("device address", len(dev),
                   8 + _ns_bytes if _U64.unpack_from(dev)[0] & _LOCAL_ADDR_FLAG_NS else 8)


def _self(dev: bytes, iface: bytes) -> str:
    return _length("device address", len(dev), 0) or _length("iface address", len(iface), 8)


def _tcp(dev: bytes, iface: bytes) -> str:
    if len(iface) != 2:  # the listening port
        return _length("iface address", len(iface), 2)
    if len(dev) < 2:
        return _length("device address", len(dev), 2)
    flags, family = dev[0], dev[1]
    if flags & ~_TCP_FLAG_LOOPBACK or family not in (_AF_INET, _AF_INET6):
        return f"device address flags {flags:#x} family {family}"
    # Loopback carries a uct_iface_local_addr_ns_t, others the IPv4 / IPv6 address.
    tail = 8 + _ns_bytes if flags & _TCP_FLAG_LOOPBACK else 16 if family == _AF_INET6 else 4
    return _length("device address", len(dev), 2 + tail)


def _sysv(dev: bytes, iface: bytes) -> str:
    return _sm_device(dev) or _length("iface address", len(iface), 8)  # the FIFO shmid


def _posix(dev: bytes, iface: bytes) -> str:
    if fault := _sm_device(dev):
        return fault
    if len(iface) < 8:
        return _length("iface address", len(iface), 8)
    seg_id, extra = _U64.unpack_from(iface)[0], iface[8:]
    if seg_id & _POSIX_PROCFS:  # /proc/<pid>/fd/<fd>, + the pid namespace if flagged
        return _length("iface address", len(iface),
                       8 + _ns_bytes if seg_id & _POSIX_PID_NS else 8)
    if seg_id & _POSIX_PID_NS:
        return "a pid namespace without procfs mode"
    if seg_id & _POSIX_SHM_OPEN:
        return _length("iface address", len(iface), 8)
    # open() mode: the directory follows as a C string, read up to its NUL.
    if len(extra) < 2 or extra[-1] != 0 or 0 in extra[:-1]:
        return "a posix directory that is not one NUL-terminated string"
    return ""


def _cma(dev: bytes, iface: bytes) -> str:
    if fault := _sm_device(dev):
        return fault
    if len(iface) < 4:
        return _length("iface address", len(iface), 4)
    # pid_t, or {pid_t; pid_ns} (UCX 1.21: an ino_t, 16 bytes with padding; 1.22: 8) when
    # the pid's top bit says so.
    return _length("iface address", len(iface),
                   (16 if _ns_bytes == 8 else 8) if _U32.unpack_from(iface)[0] & _CMA_PID_NS
                   else 4)


_cuda_copy = _self  # the same layout: no device address, an 8-byte iface address


def _cuda_ipc(dev: bytes, iface: bytes) -> str:
    # pid_t; UCX 1.22 adds the pid namespace outside the host's own
    if len(iface) != 4 and not (_ns_bytes == 4 and len(iface) == 8):
        return _length("iface address", len(iface), 4)
    if len(dev) == 9 and not dev[8] & ~_CUDA_IPC_MNNVL:  # {system uuid; flags}, packed
        return ""
    return _length("device address", len(dev), 8)  # the system uuid


def _crc16(name: str) -> int:
    """ucs_crc16_string: CRC-16-CCITT (reflected 0x8408), how UCX names a transport."""
    crc = 0xFFFF
    for b in name.encode():
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x8408 if crc & 1 else 0)
    return ~crc & 0xFFFF


_TRANSPORTS: Final[dict[int, tuple[str, Callable[[bytes, bytes], str]]]] = {
    _crc16(name): (name, check)
    for name, check in (("self", _self), ("tcp", _tcp), ("sysv", _sysv), ("posix", _posix),
                        ("cma", _cma), ("cuda_copy", _cuda_copy), ("cuda_ipc", _cuda_ipc))
}


# --- shared-memory FIFOs ----------------------------------------------------------------

_POSIX: Final = _crc16("posix")
_SYSV: Final = _crc16("sysv")
_POSIX_FILE = re.compile(r"/ucx_shm_posix_[0-9a-f]+(?: \(deleted\))?$")
_PID_BITS: Final = 30  # UCT_POSIX_PROCFS_MMID_PID_BITS
_MMID_MASK: Final = (1 << 60) - 1  # below UCT_POSIX_SEG_FLAGS_MASK


def check_local_segments(data: bytes, own: bytes) -> None:
    """Refuse a checked peer address whose shared-memory FIFO is not a FIFO like ours.

    A posix or sysv entry names the peer's receive FIFO by a kernel object: an fd of
    the peer reached through /proc, a /dev/shm name, a file, a SysV shmid. UCX maps it
    with its *own* FIFO size and writes into it, never looking at what it mapped: a
    shorter file is a SIGBUS, another UCX segment is memory corruption. So for each such
    entry UCX would use (same host and namespace as our own entry of that transport,
    ``own`` being this worker's address), an object that exists must be a UCX posix
    file or a SysV segment exactly as long as our own FIFO. One that does not exist, or
    that we may not open, UCX cannot map either, so it passes. Raises ``ProtocolError``.

    What this cannot rule out: the named object changing between this check and UCX's
    attach, or a segment exactly that long that is not the peer's (another process's
    live FIFO: the kernel cannot tell us whose FIFO a segment is). The first can still
    SIGBUS us, the second writes into that other FIFO; both take a local process of
    the same user, which UCX's shared memory trusts anyway.
    """
    mine = {csum: (dev, iface) for csum, dev, iface in _walk(bytes(own))
            if csum in (_POSIX, _SYSV)}
    for csum, dev, iface in _walk(bytes(data)):
        if csum not in mine or dev != mine[csum][0]:
            continue  # no local transport to match it, or another host: UCX skips it
        size = _segment_size(csum, iface)
        if size is not None and size != _segment_size(csum, mine[csum][1]):
            name = "posix" if csum == _POSIX else "sysv"
            raise ProtocolError(f"peer UCX worker address refused: its {name} FIFO names a "
                                f"kernel object that is not a FIFO like ours ({size} bytes)")


def _segment_size(csum: int, iface: bytes) -> int | None:
    """The size of the FIFO object an entry names; -1 if it is not a UCX segment at all,
    None if it cannot be found or opened."""
    seg_id = _U64.unpack_from(iface)[0]
    if csum == _SYSV:
        return _sysv_sizes().get(seg_id)
    mmid = seg_id & _MMID_MASK
    if seg_id & _POSIX_PROCFS:
        path = f"/proc/{mmid & ((1 << _PID_BITS) - 1)}/fd/{mmid >> _PID_BITS}"
    elif seg_id & _POSIX_SHM_OPEN:
        path = f"/dev/shm/ucx_shm_posix_{mmid:x}"
    else:
        path = f"{iface[8:-1].decode(errors='replace')}/ucx_shm_posix_{mmid:x}"
    try:
        target = os.readlink(path) if seg_id & _POSIX_PROCFS else path
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode) or not _POSIX_FILE.search(target):
        return -1
    return st.st_size


def _sysv_sizes() -> dict[int, int]:
    try:
        with open("/proc/sysvipc/shm") as f:
            head, *rows = (line.split() for line in f)
    except (OSError, ValueError):
        return {}
    shmid, size = head.index("shmid"), head.index("size")
    return {int(row[shmid]): int(row[size]) for row in rows}
