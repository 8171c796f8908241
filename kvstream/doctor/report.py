"""What ``kvstream doctor`` found: frozen structs, the same as its ``--json`` output.

Evolution: new fields get defaults and go last; a field never changes type; a check
keeps its name (scripts grep for ``ucx.host``).
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvstream.control.reach import ServerProbe

__all__ = [
    "STATUSES",
    "Check",
    "DoctorReport",
    "Hardware",
    "LinkCheck",
    "NatsReport",
    "SharedMemory",
    "UcxReport",
    "Versions",
]

# "skip": the check did not apply here (no CUDA device, --no-link-check); it counts as
# neither a warning nor a failure.
STATUSES: Final = ("ok", "warn", "fail", "skip")


class Check(msgspec.Struct, frozen=True, kw_only=True):
    """One line of the report."""

    name: str  # "versions", "ucx.host", "nats", ...
    status: str  # one of STATUSES
    message: str


class Versions(msgspec.Struct, frozen=True, kw_only=True):
    """Installed versions; "" where the package is not installed or could not be read."""

    kvstream: str
    python: str
    ucxx: str
    ucx: str  # the UCX library ucxx loaded, as ucxx.get_ucx_version() says
    torch: str
    torch_cuda: str  # torch.version.cuda: "" for a CPU build
    nats_py: str
    msgspec: str
    numpy: str
    cupy: str
    # packages built per CUDA major that are installed (ucxx-cu12, cupy-cuda13x, ...)
    cuda_packages: dict[str, str] = {}


class Hardware(msgspec.Struct, frozen=True, kw_only=True):
    cpu_count: int
    memory_total_bytes: int  # 0 when /proc/meminfo cannot be read
    cuda_available: bool  # torch.cuda.is_available()
    gpu_count: int
    gpu_names: tuple[str, ...] = ()
    cupy_cuda_available: bool = False  # cupy installed and cupy.cuda.is_available()


class SharedMemory(msgspec.Struct, frozen=True, kw_only=True):
    """``/dev/shm`` (sidecar KV mappings, UCX's posix transport) and huge pages."""

    path: str
    exists: bool
    total_bytes: int = 0
    free_bytes: int = 0
    # The selected value of /sys/kernel/mm/transparent_hugepage/enabled
    # ("always", "madvise", "never"); "" when it cannot be read.
    transparent_hugepages: str = ""


class LinkCheck(msgspec.Struct, frozen=True, kw_only=True):
    """Host memory moved between two local UCX workers, against a memcpy of the same bytes."""

    nbytes: int
    gbps: float  # best of the timed sends, 1e9 bytes/s
    gbps_runs: tuple[float, ...]
    memcpy_gbps: float  # single-thread copy of the same bytes, best of as many runs
    ratio: float  # gbps / memcpy_gbps
    transports: tuple[str, ...]  # what UCX used for a message of nbytes


class UcxReport(msgspec.Struct, frozen=True, kw_only=True):
    """What two UCX workers in two local processes selected, endpoints made the way the
    agent makes them (worker addresses, error handling off, tagged sends)."""

    error: str = ""  # the probe failed: why ("" when it ran)
    # UCX_* / UCXX_* variables of the environment the probe inherited (UCX_TLS among them).
    env: dict[str, str] = {}
    # Transports UCX used, in order of message size; from its usage tables
    # (UCX_PROTO_INFO=used), or from the endpoint's tag lanes where those are missing.
    host_transports: tuple[str, ...] = ()
    # None: not probed (device_skipped says why).
    device_transports: tuple[str, ...] | None = None
    device_skipped: str = ""
    device_error: str = ""
    source: str = ""  # "protocol usage" or "endpoint lanes"
    tag_lanes: tuple[str, ...] = ()  # the endpoint's tag lanes (UCX's INFO line)
    # Transports UCX can open on this host (`ucx_info -d`); None when ucx_info is absent.
    available_transports: tuple[str, ...] | None = None
    link: LinkCheck | None = None
    log_warnings: tuple[str, ...] = ()  # UCX's own WARN/ERROR lines during the probe
    seconds: float = 0.0


class NatsReport(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    servers: tuple[ServerProbe, ...]  # a plain TCP look at each server (its INFO line)
    connected: bool  # a real nats-py client connected (through ControlBus.connect)
    connect_ms: float | None = None
    flush_ms: float | None = None  # one round trip through the server
    cause: str = ""  # when not connected: refused, timeout, dns, auth, tls or other
    detail: str = ""
    seconds: float = 0.0  # how long finding all this out took


class DoctorReport(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``kvstream doctor`` found; ``checks`` is what it prints, one per line."""

    checks: tuple[Check, ...]
    versions: Versions
    hardware: Hardware
    shm: SharedMemory
    ucx: UcxReport
    nats: NatsReport
    warnings: int
    failures: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.failures == 0
