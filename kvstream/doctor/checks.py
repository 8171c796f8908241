"""``run_checks``: gather every fact, then judge each one (ok / warn / fail / skip)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

import msgspec

from kvstream.control.auth import NatsAuth
from kvstream.doctor.report import (
    Check,
    DoctorReport,
    Hardware,
    NatsReport,
    SharedMemory,
    UcxReport,
    Versions,
)
from kvstream.doctor.ucx_log import DEVICE_TRANSPORTS, SHM_TRANSPORTS

__all__ = ["LINK_BYTES", "SHM_MIN_FREE", "SLOW_LINK_RATIO", "judge", "run_checks"]

LINK_BYTES: Final = 64 << 20
SHM_MIN_FREE: Final = 1 << 30  # below this, /dev/shm is a warning (Docker gives 64 MiB)
# A same-host link under this share of memcpy is not using shared memory well.
SLOW_LINK_RATIO: Final = 0.25  # measured here: cma 0.75x, UCX over TCP 0.15x

# Short words for the text line; the report's nats.detail has the long ones.
_NATS_WORDS: Final = {"refused": "nothing listens", "timeout": "no answer", "dns": "unknown host",
                      "auth": "credentials refused", "tls": "TLS handshake failed"}
_NATS_HINTS: Final = {"auth": "nats://user:pass@host:port", "tls": "use a tls:// URL",
                      "dns": "check the host name, or `kvstream nats`",
                      "timeout": "a firewall? or `kvstream nats` on this host"}

T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run``, also from a thread that already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, name="kvstream-doctor-nats")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.0f} B"  # pragma: no cover


def _versions_checks(v: Versions, hw: Hardware) -> list[Check]:
    line = (f"kvstream {v.kvstream or '?'}, python {v.python}, nats-py {v.nats_py or '?'}, "
            f"msgspec {v.msgspec or '?'}, numpy {v.numpy or '?'}")
    torch = f"torch {v.torch} ({'CUDA ' + v.torch_cuda if v.torch_cuda else 'CPU build'})" \
        if v.torch else "torch not installed"
    cuda = "CUDA available" if hw.cuda_available else "no CUDA"
    cupy = (f"cupy {v.cupy}" + (" (CUDA)" if hw.cupy_cuda_available else " (no CUDA)")) \
        if v.cupy else "cupy not installed"
    return [Check(name="versions", status="ok", message=line),
            Check(name="cuda", status="ok", message=f"{torch}, {cuda}, {cupy}")]


def install_check(v: Versions, hw: Hardware) -> Check:
    """Whether UCX and cupy are the builds for this host's CUDA (torch's), and what to
    install when not: ucxx and cupy are built per CUDA major, one extra each."""
    pkgs = v.cuda_packages
    ucxx = sorted(n for n in pkgs if n.startswith("ucxx-cu"))
    cupy = sorted(n for n in pkgs if n.startswith("cupy-cuda"))
    major = v.torch_cuda.split(".")[0] if v.torch_cuda and hw.cuda_available else ""
    extra = f"cu{major}" if major else "cpu"
    if len(ucxx) > 1:
        return Check(name="install", status="fail", message=(
            f"{' and '.join(ucxx)} are both installed and overwrite each other: uninstall "
            f"them (and their libucx/libucxx), then pip install 'kvstream[{extra}]'"))
    if not ucxx:
        return Check(name="install", status="fail",
                     message=f"UCX (ucxx) is missing: pip install 'kvstream[{extra}]'")
    if not major:
        return Check(name="install", status="ok",
                     message=f"{ucxx[0]} {pkgs[ucxx[0]]} (no GPU here: host memory only)")
    if ucxx[0] != f"ucxx-cu{major}":
        return Check(name="install", status="fail", message=(
            f"{ucxx[0]} is installed but torch runs CUDA {v.torch_cuda}: uninstall it (and its "
            f"libucx/libucxx), then pip install 'kvstream[{extra}]'"))
    if len(cupy) > 1 or (cupy and cupy[0] != f"cupy-cuda{major}x"):
        return Check(name="install", status="fail", message=(
            f"{', '.join(cupy)} installed but torch runs CUDA {v.torch_cuda}: keep only "
            f"cupy-cuda{major}x (pip install 'kvstream[{extra}]')"))
    if not cupy:
        return Check(name="install", status="warn", message=(
            f"cupy-cuda{major}x is missing: CUDA IPC between processes and the CUDA codec "
            f"kernels are off (pip install 'kvstream[{extra}]')"))
    return Check(name="install", status="ok", message=(
        f"{ucxx[0]} {pkgs[ucxx[0]]} and {cupy[0]} {pkgs[cupy[0]]} match torch's CUDA "
        f"{v.torch_cuda}"))


def _host_checks(hw: Hardware, shm: SharedMemory) -> list[Check]:
    gpus = (f"{hw.gpu_count} GPU" + ("s" if hw.gpu_count > 1 else "")
            + (f" ({hw.gpu_names[0]})" if hw.gpu_names else "")) if hw.gpu_count else "no GPU"
    out = [Check(name="hardware", status="ok",
                 message=f"{hw.cpu_count} CPUs, {_size(hw.memory_total_bytes)} memory, {gpus}")]
    if not shm.exists:
        out.append(Check(name="shm", status="warn",
                         message=f"{shm.path} missing: sidecar KV mappings and UCX posix need it"))
    elif shm.free_bytes < SHM_MIN_FREE:
        out.append(Check(name="shm", status="warn", message=(
            f"{shm.path} has {_size(shm.free_bytes)} free of {_size(shm.total_bytes)}: small "
            "(Docker: --shm-size=8g or --ipc=host)")))
    else:
        out.append(Check(name="shm", status="ok", message=(
            f"{shm.path} {_size(shm.total_bytes)}, {_size(shm.free_bytes)} free")))
    out.append(Check(name="thp", status="ok",
                     message=f"transparent huge pages: {shm.transparent_hugepages or 'unknown'}"))
    return out


def _ucx_checks(v: Versions, ucx: UcxReport, link_check: bool) -> list[Check]:
    # A missing ucxx fails ucx.host (with the import error); not counted twice.
    lib = f"ucxx {v.ucxx}, UCX {v.ucx or '?'}" if v.ucxx else "ucxx not installed"
    tls = ucx.env.get("UCX_TLS")
    out = [Check(name="ucx", status="warn", message=(
        f"{lib}; UCX_TLS={tls} restricts UCX to those transports")) if tls is not None else
        Check(name="ucx", status="ok", message=f"{lib}; UCX_TLS not set (UCX picks)")]
    host = ", ".join(ucx.host_transports)
    shm_avail = sorted(SHM_TRANSPORTS.intersection(ucx.available_transports or ()))
    if ucx.error or not ucx.host_transports:
        out.append(Check(name="ucx.host", status="fail",
                         message=f"UCX probe failed: {ucx.error or 'UCX reported no transport'}"))
    elif not SHM_TRANSPORTS.intersection(ucx.host_transports):
        why = (f"no shared memory used (UCX has {', '.join(shm_avail)})" if shm_avail
               else "no shared-memory transport on this host")
        out.append(Check(name="ucx.host", status="warn", message=f"host memory: {host}; {why}"))
    else:
        lanes = " (endpoint lanes; UCX printed no usage)" if ucx.source == "endpoint lanes" else ""
        out.append(Check(name="ucx.host", status="ok", message=f"host memory: {host}{lanes}"))
    out.append(_device_check(ucx))
    link = ucx.link
    if not link_check:
        out.append(Check(name="link", status="skip", message="skipped (--no-link-check)"))
    elif link is None:
        out.append(Check(name="link", status="skip",
                         message="not measured: the UCX probe did not get that far"))
    else:
        line = (f"{_size(link.nbytes)} host->host {link.gbps:.2f} GB/s over "
                f"{', '.join(link.transports) or '?'} (memcpy {link.memcpy_gbps:.2f} GB/s, "
                f"{link.ratio:.2f}x)")
        slow = link.ratio < SLOW_LINK_RATIO
        out.append(Check(name="link", status="warn" if slow else "ok",
                         message=line + (": slow for one host" if slow else "")))
    if ucx.log_warnings:
        worst = next((w for w in ucx.log_warnings if w.startswith("ERROR")), ucx.log_warnings[0])
        out.append(Check(name="ucx.log", status="warn", message=f"UCX said: {worst}"))
    return out


def _device_check(ucx: UcxReport) -> Check:
    device = ", ".join(ucx.device_transports or ())
    if ucx.device_transports is None:
        return Check(name="ucx.device", status="skip",
                     message=f"skipped: {ucx.device_skipped or 'not probed'}")
    if ucx.device_error:
        return Check(name="ucx.device", status="fail", message=f"device memory: {ucx.device_error}")
    if not ucx.device_transports:
        return Check(name="ucx.device", status="skip" if ucx.error else "fail",
                     message="not measured: the UCX probe failed" if ucx.error
                     else "device memory: UCX reported no transport")
    if not DEVICE_TRANSPORTS.intersection(ucx.device_transports):
        return Check(name="ucx.device", status="warn", message=(
            f"device memory: {device}; no cuda_copy/cuda_ipc/rc/dc: GPU KV would go over TCP"))
    return Check(name="ucx.device", status="ok", message=f"device memory: {device}")


def _nats_check(n: NatsReport) -> Check:
    if n.connected:
        info = next((s for s in n.servers if s.reachable), None)
        server = f"NATS {info.version}" if info and info.version else "NATS"
        extras = [x for x, on in (("jetstream", info and info.jetstream),
                                  ("auth", info and info.auth_required),
                                  ("tls", info and info.tls_required)) if on]
        return Check(name="nats", status="ok", message=(
            f"{n.url}: {server}{' (' + ', '.join(extras) + ')' if extras else ''}, "
            f"connect {n.connect_ms:.1f} ms, rtt {n.flush_ms:.1f} ms"))
    words = _NATS_WORDS.get(n.cause, n.detail)
    hint = _NATS_HINTS.get(n.cause, "start one: `kvstream nats`")
    return Check(name="nats", status="fail", message=f"{n.url}: {n.cause} ({words}); {hint}")


def judge(versions: Versions, hardware: Hardware, shm: SharedMemory, ucx: UcxReport,
          nats: NatsReport, *, link_check: bool = True) -> tuple[Check, ...]:
    """The checks, in print order, from the facts ``run_checks`` gathered. Pure."""
    return (*_versions_checks(versions, hardware), install_check(versions, hardware),
            *_host_checks(hardware, shm),
            *_ucx_checks(versions, ucx, link_check), _nats_check(nats))


def run_checks(nats_url: str | None, *, link_check: bool = True, timeout: float = 2.0,
               ucx_timeout: float = 30.0, auth: NatsAuth | None = None) -> DoctorReport:
    """Every check of ``kvstream doctor``; never raises for what it finds.

    ``nats_url``: None for ``DEFAULT_NATS_URL``. ``timeout``: seconds for each NATS step
    (the plain look, the client connect, the flush). ``ucx_timeout``: the whole UCX probe
    (two local processes; about 3 s on a healthy host). Starts no NATS server. Runs an
    event loop of its own (in a thread when the caller's thread already runs one).
    """
    from kvstream.control.nats_server import DEFAULT_NATS_URL
    from kvstream.doctor.host import hardware_and_versions, shared_memory
    from kvstream.doctor.nats_check import check_nats
    from kvstream.doctor.ucx_check import start_probe

    t0 = time.perf_counter()
    url = nats_url or DEFAULT_NATS_URL
    hardware, versions = hardware_and_versions()
    shm = shared_memory()
    device = ("torch" if hardware.cuda_available else
              "cupy" if hardware.cupy_cuda_available else "")
    probe = start_probe(link_bytes=LINK_BYTES if link_check else 0, device=device,
                        timeout=ucx_timeout)
    try:  # while the probe runs (mostly waiting for its two processes to start)
        nats = _run(check_nats(url, timeout, auth))
    finally:
        ucx, result = probe.finish()
    if result.ucxx or result.ucx:
        versions = msgspec.structs.replace(versions, ucxx=result.ucxx or versions.ucxx,
                                           ucx=result.ucx)
    checks = judge(versions, hardware, shm, ucx, nats, link_check=link_check)
    return DoctorReport(
        checks=checks, versions=versions, hardware=hardware, shm=shm, ucx=ucx, nats=nats,
        warnings=sum(c.status == "warn" for c in checks),
        failures=sum(c.status == "fail" for c in checks),
        seconds=round(time.perf_counter() - t0, 3))
