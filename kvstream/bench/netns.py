"""Two network namespaces joined by a veth pair: a "two hosts" link on one machine.

Loopback shares one socket path and a 64 KiB MTU; a veth pair between namespaces goes
through a real device with an MTU of 1500 and, optionally, a token-bucket rate limit
(``tc tbf``), so TCP benchmarks and tests see something closer to a NIC. Needs root
(``ip netns``); ``available()`` says whether it works here. Usage::

    with netns_pair(rate_gbit=10) as pair:
        subprocess.run([*exec_prefix(pair.b.name), "python", "server.py", pair.b.address])

Every namespace created is deleted on exit, error or not (deleting a namespace deletes
its end of the veth, and with it the other end).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvstream._exceptions import ConfigError

__all__ = ["Netns", "NetnsPair", "available", "enter", "exec_prefix", "netns_pair"]

_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Netns:
    name: str  # for ``ip netns exec``
    device: str  # its end of the veth
    address: str  # the device's IPv4 address (no prefix length)


@dataclass(frozen=True)
class NetnsPair:
    a: Netns
    b: Netns
    rate_gbit: float | None


def exec_prefix(name: str) -> list[str]:
    """The argv prefix that runs a command inside namespace ``name``."""
    return ["ip", "netns", "exec", name]


def _ip(*args: str) -> str:
    try:
        return subprocess.run(["ip", *args], check=True, capture_output=True, text=True,
                              timeout=_TIMEOUT_S).stdout
    except subprocess.CalledProcessError as exc:
        raise ConfigError(f"ip {' '.join(args)} failed: {exc.stderr.strip()}") from exc
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"ip {' '.join(args)} failed: {exc}") from exc


def _wait_carrier(ns: Netns) -> None:
    """Until the veth end has carrier: a process started before (UCX's tcp transport
    does this) leaves a device that is not running out of its interface list."""
    deadline = time.monotonic() + _TIMEOUT_S
    while "LOWER_UP" not in _ip("-n", ns.name, "-o", "link", "show", "dev", ns.device):
        if time.monotonic() > deadline:
            raise ConfigError(f"{ns.device} in {ns.name} has no carrier after {_TIMEOUT_S} s")
        time.sleep(0.02)


@functools.cache
def available() -> bool:
    """Can this process create namespaces (root, ``ip`` installed, not forbidden)?
    Probed once by creating and deleting one."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"kvs-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except ConfigError:
        return False
    with contextlib.suppress(ConfigError):
        _ip("netns", "del", name)
    return True


@contextlib.contextmanager
def netns_pair(rate_gbit: float | None = None, *, mtu: int | None = None,
               latency_ms: float = 50.0) -> Iterator[NetnsPair]:
    """Namespaces ``kvs-<pid>-<hex>-a`` / ``-b`` with 198.18.<k>.1/24 and .2/24 (from
    the benchmarking range 198.18.0.0/15) on a veth pair, loopback up in each; with
    ``rate_gbit`` a tbf qdisc shapes both directions. ``ConfigError`` if a step fails."""
    if rate_gbit is not None and not rate_gbit > 0:
        raise ConfigError(f"rate_gbit must be positive, got {rate_gbit}")
    token = secrets.token_hex(3)
    octets = f"198.{18 + secrets.randbelow(2)}.{secrets.randbelow(256)}"
    a = Netns(f"kvs-{os.getpid()}-{token}-a", f"kv{token}a", f"{octets}.1")
    b = Netns(f"kvs-{os.getpid()}-{token}-b", f"kv{token}b", f"{octets}.2")
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns.name)
            made.append(ns.name)
        _ip("link", "add", a.device, "netns", a.name, "type", "veth",
            "peer", "name", b.device, "netns", b.name)
        for ns in (a, b):
            _ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", ns.device)
            if mtu is not None:
                _ip("-n", ns.name, "link", "set", ns.device, "mtu", str(mtu))
            _ip("-n", ns.name, "link", "set", ns.device, "up")
            _ip("-n", ns.name, "link", "set", "lo", "up")
            if rate_gbit is not None:
                # The bucket holds 1 ms at the rate (at least 64 KiB): enough for the
                # kernel's timer granularity, small enough to shape.
                burst = max(64 * 1024, int(rate_gbit * 1e9 / 8 / 1000))
                _ip("netns", "exec", ns.name, "tc", "qdisc", "add", "dev", ns.device, "root",
                    "tbf", "rate", f"{rate_gbit}gbit", "burst", str(burst),
                    "latency", f"{latency_ms}ms")
        for ns in (a, b):
            _wait_carrier(ns)
        yield NetnsPair(a, b, rate_gbit)
    finally:
        for name in reversed(made):
            with contextlib.suppress(ConfigError):
                _ip("netns", "del", name)


def enter(name: str) -> None:
    """Move this process into namespace ``name`` (call it before any thread or socket
    exists: threads started later inherit it, earlier ones stay where they were)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise ConfigError(f"cannot enter network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
