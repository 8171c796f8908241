"""The UCX boundary (ucxx): one worker per process, endpoints cached per peer.

Why it looks like this (measured, see PERF.md and docs/architecture.md):

* Endpoints are made from exchanged *worker addresses* with UCX error handling
  off by default, because only then does UCX use its shared-memory transports
  (sysv, cma) between two processes on one host. Dead peers are then detected
  by the control plane (heartbeats), not by UCX. ``error_handling=True`` is the
  setting for RDMA networks where fast transports and error handling coexist.
* Progress runs in UCX's own thread with Python futures ("thread" mode plus
  the notifier): ucxx's other modes spin the event loop at 100 % CPU while a
  request is pending, and kvstream always has a few pending.
* ucxx's context is global to a process, so it is reference counted here and
  shared by every agent in the process; tag prefixes are per process too.
* A posted receive cannot be cancelled one by one through ucxx, so
  ``drain(tag)`` completes it with a zero-byte message from this worker to
  itself, without touching the buffer.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from kvstream._exceptions import ConfigError, DataPlaneError
from kvstream.config import PROGRESS_MODES

__all__ = ["PROGRESS_MODES", "PostedRecv", "UcxWorker", "as_ucx_buffer"]

log = logging.getLogger("kvstream.dataplane")


# UCX prints warnings for every UCX_* variable it does not use; ucxx warns when its
# futures pool runs dry, which is harmless. Both before ucxx is imported.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCXX_LOG_LEVEL", "ERROR")

_EMPTY: Any = None


def _ucxx() -> Any:
    try:
        import ucxx
    except ImportError as exc:  # pragma: no cover - a hard dependency
        raise DataPlaneError("the ucxx package is missing: pip install ucxx-cu12") from exc
    return ucxx


def as_ucx_buffer(obj: Any) -> Any:
    """Something ucxx accepts: numpy arrays and CUDA tensors as is, CPU tensors as numpy views."""
    if hasattr(obj, "__cuda_array_interface__") or not hasattr(obj, "numpy"):
        return obj
    return obj.detach().numpy()


class PostedRecv:
    """A receive already posted to the worker."""

    def __init__(self, req: Any, tag: int) -> None:
        self._req = req
        self.tag = tag

    @property
    def completed(self) -> bool:
        return bool(self._req.completed)

    async def wait(self) -> None:
        try:
            await self._req.wait()
        except Exception as exc:
            raise DataPlaneError(f"UCX receive (tag {self.tag:#x}) failed: {exc}") from exc


class _Shared:
    refs = 0
    loop: asyncio.AbstractEventLoop | None = None
    mode: str | None = None
    error_handling = False
    self_ep: Any = None
    endpoints: dict[bytes, Any] = {}


class UcxWorker:
    """Handle on the process's UCX worker; ``open`` inside the running event loop."""

    def __init__(self) -> None:
        self._open = False

    @classmethod
    async def open(cls, *, progress_mode: str = "thread", error_handling: bool = False) -> UcxWorker:
        if progress_mode not in PROGRESS_MODES:
            raise ConfigError(f"progress mode must be one of {PROGRESS_MODES}, got {progress_mode!r}")
        ucxx = _ucxx()
        loop = asyncio.get_running_loop()
        if _Shared.refs == 0:
            try:
                ucxx.init(progress_mode=progress_mode,
                          enable_python_future=progress_mode == "thread")
            except Exception as exc:
                raise DataPlaneError(f"UCX worker setup failed: {exc}") from exc
            _Shared.loop, _Shared.mode, _Shared.error_handling = loop, progress_mode, error_handling
            _Shared.endpoints = {}
        elif _Shared.loop is not loop:
            raise DataPlaneError("every kvstream agent of a process must run on one event loop")
        _Shared.refs += 1
        worker = cls()
        worker._open = True
        return worker

    @property
    def address(self) -> bytes:
        return bytes(_ucxx().get_worker_address().tobytes())

    async def endpoint(self, peer_address: bytes) -> Any:
        ep = _Shared.endpoints.get(peer_address)
        if ep is not None:
            return ep
        ucxx = _ucxx()
        try:
            addr = ucxx.get_ucx_address_from_buffer(peer_address)
            ep = await ucxx.create_endpoint_from_worker_address(
                addr, endpoint_error_handling=_Shared.error_handling
            )
        except Exception as exc:
            raise DataPlaneError(f"cannot open a UCX endpoint to the peer: {exc}") from exc
        # Another task may have raced us to the same peer; keep the first.
        return _Shared.endpoints.setdefault(peer_address, ep)

    async def send(self, peer_address: bytes, buf: Any, tag: int) -> None:
        ep = await self.endpoint(peer_address)
        try:
            await ep.send(as_ucx_buffer(buf), tag=tag, force_tag=True)
        except Exception as exc:
            raise DataPlaneError(f"UCX send (tag {tag:#x}) failed: {exc}") from exc

    async def recv(self, buf: Any, tag: int) -> None:
        ctx = _ucxx().core._get_ctx()
        try:
            await ctx.recv(as_ucx_buffer(buf), tag=tag)
        except Exception as exc:
            raise DataPlaneError(f"UCX receive (tag {tag:#x}) failed: {exc}") from exc

    def post_recv(self, buf: Any, tag: int) -> PostedRecv:
        """Post a tagged receive now (so a credit can follow); await ``.wait()`` later."""
        ucxx = _ucxx()
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        try:
            req = ucxx.core._get_ctx().worker.tag_recv(Array(as_ucx_buffer(buf)), Tag(tag))
        except Exception as exc:
            raise DataPlaneError(f"could not post UCX receive (tag {tag:#x}): {exc}") from exc
        return PostedRecv(req, tag)

    async def drain(self, tag: int) -> None:
        """Complete a receive posted on ``tag`` without writing into its buffer."""
        global _EMPTY
        if _Shared.self_ep is None:
            _Shared.self_ep = await self.endpoint(self.address)
        if _EMPTY is None:
            import numpy as np

            _EMPTY = np.empty(0, dtype=np.uint8)
        try:
            await _Shared.self_ep.send(_EMPTY, tag=tag, force_tag=True)
        except Exception as exc:
            raise DataPlaneError(f"could not drain UCX tag {tag:#x}: {exc}") from exc

    def forget_peer(self, peer_address: bytes) -> None:
        """Drop a dead peer's endpoint, cancelling what is in flight to it."""
        ep = _Shared.endpoints.pop(peer_address, None)
        if ep is not None:
            try:
                ep.abort()
            except Exception as exc:  # already closed by UCX
                log.debug("endpoint abort: %s", exc)

    async def close(self) -> None:
        if not self._open:
            return
        self._open = False
        _Shared.refs -= 1
        if _Shared.refs > 0:
            return
        ucxx = _ucxx()
        for ep in list(_Shared.endpoints.values()):
            try:
                ep.abort()
            except Exception as exc:
                log.debug("endpoint abort at close: %s", exc)
        _Shared.endpoints = {}
        _Shared.self_ep = None
        try:
            ucxx.stop_notifier_thread()
            ucxx.reset()
        except Exception as exc:
            log.debug("ucxx reset: %s", exc)
        _Shared.loop = None
