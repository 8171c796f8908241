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
  itself, without touching the buffer. That self endpoint is kept apart from
  the per-peer cache: a forged peer naming our own address and then being
  forgotten must not abort it.
* Peer addresses come from the network; UCX aborts the process on a malformed
  one, so ``endpoint`` passes each through ``check_worker_address`` first.
* Anyone holding our address can send tagged messages nobody will receive;
  UCX keeps them in its unexpected queue forever and hands them to the next
  receive on that tag. ``sweep`` discards those whose tag no transfer owns.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any, Final

from kvstream._exceptions import ConfigError, DataPlaneError, ProtocolError
from kvstream.config import PROGRESS_MODES
from kvstream.dataplane.address import (
    check_local_segments,
    check_worker_address,
    set_ucx_version,
    unknown_transports,
)

__all__ = ["PROGRESS_MODES", "PostedRecv", "UcxWorker", "as_ucx_buffer"]

log = logging.getLogger("kvstream.dataplane")


# UCX prints warnings for every UCX_* variable it does not use; ucxx warns when its
# futures pool runs dry, which is harmless. Both before ucxx is imported.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCXX_LOG_LEVEL", "ERROR")

_EMPTY: Any = None

# Discarded messages land here; a longer one is truncated, which UCX completes as an
# error after consuming the message, so a huge rendezvous send costs us nothing.
SWEEP_SCRATCH_BYTES: Final = 64 * 1024
# Discarded by receiving only up to this (one eager fragment on every transport here:
# already in our memory, nothing read from the sender); larger ones are dequeued unread.
SWEEP_RECEIVE_BYTES: Final = 8 * 1024


def _ucxx() -> Any:
    try:
        import ucxx
    except ImportError as exc:  # pragma: no cover - a hard dependency
        raise DataPlaneError("the ucxx package is missing: pip install 'kvstream[cpu]' on a "
                             "CPU-only host, 'kvstream[cu12]' or 'kvstream[cu13]' on a GPU host "
                             "(kvstream doctor says which)") from exc
    return ucxx


def _progress_thread_device(device: int) -> None:
    """Make ``device`` current on ucxx's progress thread when it starts (UCX copies device
    memory there). ucxx 0.52 makes device 0 current (``continuous_ucx_progress.
    _create_context``), which creates a context on GPU 0 in every TP rank's process."""
    try:
        from ucxx._lib_async import continuous_ucx_progress as progress
    except ImportError:  # another ucxx: its own choice stands
        return

    def current() -> None:
        from ucxx._cuda_context import ensure_cuda_context

        ensure_cuda_context(device)

    if hasattr(progress, "_create_context"):
        progress._create_context = current


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
    address = b""
    self_ep: Any = None  # drain's endpoint to ourselves; never in ``endpoints``
    endpoints: dict[bytes, Any] = {}
    scratch: Any = None  # SWEEP_SCRATCH_BYTES, alive while a discard may write into it
    discards: list[Any] = []  # sweep's receives not yet completed


def _unified_mode() -> bool:
    return os.environ.get("UCX_UNIFIED_MODE", "n").strip().lower() in ("y", "yes", "on", "1")


class UcxWorker:
    """Handle on the process's UCX worker; ``open`` inside the running event loop."""

    vectored = False  # UCX's own IOV paths measured slower than our gather (architecture.md)

    def __init__(self) -> None:
        self._open = False
        self.dropped_unread = 0  # swept messages too large to receive, dequeued unread

    @classmethod
    async def open(cls, *, progress_mode: str = "thread", error_handling: bool = False,
                   cuda_device: int | None = None) -> UcxWorker:
        if progress_mode not in PROGRESS_MODES:
            raise ConfigError(f"progress mode must be one of {PROGRESS_MODES}, got {progress_mode!r}")
        if _unified_mode():
            # Unified-mode addresses leave out what check_worker_address needs to walk them.
            raise ConfigError("UCX_UNIFIED_MODE is not supported: peer addresses could not be "
                              "validated; unset it")
        ucxx = _ucxx()
        loop = asyncio.get_running_loop()
        if _Shared.refs == 0:
            if cuda_device is not None:
                _progress_thread_device(cuda_device)
            try:
                ucxx.init(progress_mode=progress_mode,
                          enable_python_future=progress_mode == "thread")
            except Exception as exc:
                raise DataPlaneError(f"UCX worker setup failed: {exc}") from exc
            _Shared.loop, _Shared.mode, _Shared.error_handling = loop, progress_mode, error_handling
            _Shared.endpoints, _Shared.discards = {}, []
            _Shared.address = bytes(ucxx.get_worker_address().tobytes())
            set_ucx_version(tuple(ucxx.get_ucx_version()))
            try:
                # Peers configured like us send addresses like ours: refuse the setting now,
                # not every peer later.
                check_worker_address(_Shared.address)
            except ProtocolError as exc:
                _reset(ucxx)
                _Shared.loop = None
                raise ConfigError(f"this UCX configuration makes worker addresses kvstream "
                                  f"cannot validate: {exc}") from exc
            if unknown := unknown_transports(_Shared.address):
                log.warning("UCX transports %s are not known to kvstream's address check: "
                            "their peer addresses are checked for structure only",
                            ", ".join(f"{c:#06x}" for c in sorted(unknown)))
        elif _Shared.loop is not loop:
            raise DataPlaneError("every kvstream agent of a process must run on one event loop")
        _Shared.refs += 1
        worker = cls()
        worker._open = True
        return worker

    @property
    def address(self) -> bytes:
        return _Shared.address

    async def endpoint(self, peer_address: bytes) -> Any:
        """The cached endpoint to a peer, opened on first use.

        ``ProtocolError`` if ``peer_address`` is not a well-formed worker address, or
        names a shared-memory FIFO that is not one (it never reaches UCX then);
        ``DataPlaneError`` if UCX cannot open the endpoint.
        """
        ep = _Shared.endpoints.get(peer_address)
        if ep is not None:
            return ep
        ep = await _connect(self.check_address(peer_address))
        # Another task may have raced us to the same peer; keep the first.
        return _Shared.endpoints.setdefault(peer_address, ep)

    def check_address(self, peer_address: bytes) -> bytes:
        """``peer_address`` if UCX may be handed it, else ``ProtocolError``."""
        address = check_worker_address(peer_address)
        if address not in _Shared.endpoints:  # an open endpoint maps nothing again
            check_local_segments(address, _Shared.address)
        return address

    async def send(self, peer_address: bytes, buf: Any, tag: int) -> None:
        ep = await self.endpoint(peer_address)
        try:
            await ep.send(as_ucx_buffer(buf), tag=tag, force_tag=True)
        except Exception as exc:
            # A send fails only on a broken endpoint (the peer aborted its side, or died):
            # the next transfer opens a fresh one instead of failing on this one too.
            if _Shared.endpoints.get(peer_address) is ep:
                self.forget_peer(peer_address)
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
            ep = await _connect(_Shared.address)
            if _Shared.self_ep is None:  # a concurrent drain may have made one meanwhile
                _Shared.self_ep = ep
        if _EMPTY is None:
            import numpy as np

            _EMPTY = np.empty(0, dtype=np.uint8)
        try:
            await _Shared.self_ep.send(_EMPTY, tag=tag, force_tag=True)
        except Exception as exc:
            raise DataPlaneError(f"could not drain UCX tag {tag:#x}: {exc}") from exc

    def sweep(self, is_live: Callable[[int], bool], max_messages: int = 1024) -> int:
        """Discard unexpected tagged messages whose tag ``is_live`` says nobody owns.

        The engine calls it now and then, with a predicate that is true for every tag
        a transfer has a receive posted on or will post one on soon (a receive posted
        in "thread" mode reaches UCX a moment later, so its message may wait unexpected
        meanwhile). It looks at the oldest message no receive has claimed; if its
        64-bit tag is not live it removes exactly that message and receives it into a
        bounded scratch buffer (a longer one is truncated: consumed, never allocated
        for), and goes on. It stops at the first live tag (its receive will claim it),
        when the queue is empty, or after ``max_messages``. Returns how many it
        discarded. Never blocks; ``DataPlaneError`` if UCX refuses a probe.

        Safe while UCX progresses in its own thread: ucxx makes the worker UCX thread
        mode MULTI, so each probe holds the worker lock; a removed message is only ever
        received through the handle its removing probe returned, so no posted receive
        can match it; a receive that took the message between the two probes just
        makes the second find nothing.
        """
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMask, TagMaskFull

        worker = _ucxx().core._get_ctx().worker
        _Shared.discards = [req for req in _Shared.discards if not req.completed]
        if _Shared.scratch is None:
            import numpy as np

            _Shared.scratch = np.empty(SWEEP_SCRATCH_BYTES, dtype=np.uint8)
        discarded = 0
        for _ in range(max_messages):
            try:
                head = worker.tag_probe(Tag(0), TagMask(0), remove=False)
            except Exception as exc:
                raise DataPlaneError(f"UCX probe of unexpected messages failed: {exc}") from exc
            if not head.matched:
                break
            tag = int(head.sender_tag.value)
            if is_live(tag):
                break
            try:
                probe = worker.tag_probe(Tag(tag), TagMaskFull, remove=True)
                if not probe.matched:
                    continue
                if probe.length > SWEEP_RECEIVE_BYTES:
                    # Out of the queue, but not received: receiving a larger message (in
                    # fragments, or by rendezvous) reads from its sender, and one that has
                    # died with it pending crashed UCX (SIGSEGV). What UCX keeps of it is
                    # a descriptor; its sender's send never completes (it aborts or dies).
                    self.dropped_unread += 1
                    discarded += 1
                    continue
                buf = Array(_Shared.scratch[:max(probe.length, 0)])
                req = worker.tag_recv_with_handle(buf, probe)
            except Exception as exc:
                raise DataPlaneError(f"UCX discard of tag {tag:#x} failed: {exc}") from exc
            fut = getattr(req, "future", None)
            if fut is not None:  # a truncated discard fails it; nobody awaits it
                fut.add_done_callback(_consume)
            _Shared.discards.append(req)
            discarded += 1
        if discarded:
            log.debug("swept %d unexpected UCX messages", discarded)
        return discarded

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
        if _Shared.self_ep is not None:
            try:
                _Shared.self_ep.abort()
            except Exception as exc:
                log.debug("self endpoint abort at close: %s", exc)
        _Shared.endpoints = {}
        _Shared.self_ep = None
        # The discards' request objects go before UCX does (freed after its reset they
        # crashed at exit); the scratch they may write into stays until after the reset.
        _Shared.discards = []
        _reset(ucxx)
        _Shared.scratch = None
        _Shared.loop = None


async def _connect(address: bytes) -> Any:
    """A new endpoint to a worker address already checked."""
    ucxx = _ucxx()
    try:
        addr = ucxx.get_ucx_address_from_buffer(address)
        return await ucxx.create_endpoint_from_worker_address(
            addr, endpoint_error_handling=_Shared.error_handling
        )
    except Exception as exc:
        raise DataPlaneError(f"cannot open a UCX endpoint to the peer: {exc}") from exc


def _consume(fut: Any) -> None:
    """Retrieve a discard's outcome, so asyncio does not log an exception nobody awaited."""
    if not fut.cancelled():
        fut.exception()


def _reset(ucxx: Any) -> None:
    try:
        ucxx.stop_notifier_thread()
        ucxx.reset()
    except Exception as exc:
        log.debug("ucxx reset: %s", exc)
