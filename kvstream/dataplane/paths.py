"""Which data-plane path a transfer takes, decided once per transfer by its destination.

    shm       same host, host KV: the destination reads the source's shared segments
              (``peermem``) and copies blocks into its own, one copy; UCX carries only
              the per-layer "ready" headers and credits
    cuda_ipc  same host, device KV: the same through CUDA IPC handles (the batched
              block-copy kernel, ``csrc/blockcopy.cu``)
    tcp       other hosts without RDMA: kvstream's own socket streams (``tcp``), since
              UCX's tcp transport moves a fraction of what a plain socket does
    ucx       everything else: UCX picks shared memory, RDMA or TCP itself

The destination chooses (it posts the receives, so it must know the transport); the
source checks that the path is one it offers to that peer, or refuses the transfer.
``label`` names what was used, for results, statistics and traces.
"""

from __future__ import annotations

import functools
import os
from typing import Final

from kvstream.config import PATHS

__all__ = ["PATHS", "choose", "host_identity", "label", "rdma_present", "ucx_tls_has_shm"]

_SHM_TLS: Final = ("sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "all")


def host_identity(override: str = "") -> str:
    """This machine and PID namespace (same value: same-host paths may be tried): the boot
    id and the PID namespace, so ``/proc/<pid>`` of a peer names that peer."""
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{pidns}"


@functools.cache
def rdma_present() -> bool:
    """Does this host have RDMA devices (then UCX, not our sockets, goes between hosts)?"""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def ucx_tls_has_shm() -> bool:
    """Would UCX use shared memory between two processes here (``UCX_TLS``)?"""
    tls = os.environ.get("UCX_TLS", "").strip()
    if not tls:
        return True
    has = any(t.strip() in _SHM_TLS for t in tls.lstrip("^").split(","))
    return not has if tls.startswith("^") else has


def choose(allowed: tuple[str, ...], *, same_host: bool, device: str, codec: str,
           can_map: bool, peer_tcp: bool, own_tcp: bool) -> str:
    """The path for a transfer into this destination. ``can_map``: the source's KV is
    mapped here (shm) or opened (cuda_ipc); ``peer_tcp``/``own_tcp``: both ends have a
    TCP data address."""
    if same_host and codec == "none" and can_map:
        mapped = "cuda_ipc" if device == "cuda" else "shm"
        if mapped in allowed:
            return mapped
    if not same_host and "tcp" in allowed and peer_tcp and own_tcp and not rdma_present():
        return "tcp"
    return "ucx"


def label(path: str, *, same_host: bool) -> str:
    """What a transfer's result, statistics and span call its path."""
    if path != "ucx":
        return path
    if same_host and ucx_tls_has_shm():
        return "ucx_shm"
    return "ucx_rdma" if rdma_present() else "ucx_tcp"
