"""The sidecar: an Agent in its own process, serving one engine over a Unix socket.

The engine keeps its process lean (no NATS, no UCX, no event loop of ours); it
maps its KV into shared memory once, registers it here, and drives transfers
with a few small messages. When the engine's connection drops (clean exit or
crash) the sidecar aborts that engine's transfers, telling their peers, and
drops the mapping, so nothing stays held.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from kvstream import telemetry
from kvstream._exceptions import ConfigError, KVStreamError, LayoutError, MessageDecodeError
from kvstream.config import AgentConfig
from kvstream.engine.agent import Agent
from kvstream.layout import KVLayout
from kvstream.shm import SharedKV
from kvstream.sidecar import protocol as lp
from kvstream.sidecar.protocol import read_frame
from kvstream.transfer.gathered import GatherHandle
from kvstream.transfer.handles import ReceiveHandle, SendHandle

if TYPE_CHECKING:
    from anyio.abc import SocketStream

__all__ = ["Sidecar", "read_frame"]  # read_frame: re-exported from the protocol

log = logging.getLogger("kvstream.sidecar")

_RECEIVES = (ReceiveHandle, GatherHandle)


class _Session:
    """One engine connection: its memory registration and its transfer handles."""

    def __init__(self, sidecar: Sidecar, stream: SocketStream) -> None:
        self.sidecar = sidecar
        self.agent = sidecar.agent
        self.stream = stream
        self.lock = anyio.Lock()
        self.handles: dict[int, SendHandle | ReceiveHandle | GatherHandle] = {}
        self.ids = itertools.count(1)
        self.shared: SharedKV | None = None
        self.cuda = False  # device KV mapped through CUDA IPC

    async def send(self, msg: lp.LocalMessage) -> None:
        """Best effort: a gone engine is noticed by the reader, which cleans up."""
        async with self.lock:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self.stream.send(lp.frame(msg))

    async def reply_error(self, req_id: int, exc: Exception) -> None:
        fields = exc.fields() if isinstance(exc, KVStreamError) else {}
        await self.send(lp.Error(id=req_id, kind=type(exc).__name__, message=str(exc),
                                 fields=fields))

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    try:
                        msg = await read_frame(self.stream)
                    except (MessageDecodeError, anyio.BrokenResourceError,
                            anyio.ClosedResourceError, anyio.EndOfStream) as exc:
                        log.warning("engine connection dropped: %s", exc)
                        break
                    if msg is None:
                        break
                    await self.dispatch(msg, tg)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.cleanup()

    async def dispatch(self, msg: lp.LocalUnion, tg: anyio.abc.TaskGroup) -> None:
        match msg:
            case lp.LayerReady() | lp.Fetch():
                # The per-layer hot path, no reply: only a bad handle or layer is answered.
                kind = SendHandle if isinstance(msg, lp.LayerReady) else _RECEIVES
                handle = self.handles.get(msg.handle)
                if isinstance(handle, kind) and 0 <= msg.layer < handle.num_layers:
                    if isinstance(handle, SendHandle):
                        handle.layer_ready(msg.layer)
                    else:
                        handle.fetch(msg.layer)
                else:
                    await self.reply_error(0, ConfigError(
                        f"no {'send' if kind is SendHandle else 'receive'} handle "
                        f"{msg.handle} with layer {msg.layer}"))
            case lp.Offer():
                try:
                    sent = self.agent.offer(msg.request_id, msg.src_blocks, mode=msg.mode,
                                            block_hashes=msg.block_hashes, lease_s=msg.lease_s,
                                            secret=msg.secret, readers=msg.readers)
                except KVStreamError as exc:
                    await self.reply_error(msg.id, exc)
                    return
                hid = self._track(sent)
                await self.send(lp.Ok(id=msg.id, handle=hid, num_layers=sent.num_layers,
                                      secret=sent.secret))
                tg.start_soon(self._finished, hid, sent)
            case lp.Pull():
                tg.start_soon(self._pull, msg, tg)
            case lp.Hello():
                await self.send(lp.Ok(id=msg.id, instance_id=self.agent.instance_id))
            case lp.RegisterKV():
                await self.register(msg)
            case lp.Expect():
                try:
                    handle = self.agent.expect(msg.request_id, msg.blocks, have=msg.have,
                                               src=msg.src)
                except KVStreamError as exc:
                    await self.reply_error(msg.id, exc)
                    return
                hid = self._track(handle)
                await self.send(lp.Ok(id=msg.id, handle=hid,
                                      num_layers=handle.num_layers))
                tg.start_soon(self._watch_receive, hid, handle)
            case lp.Push():
                tg.start_soon(self._push, msg, tg)
            case lp.Abort():
                tg.start_soon(self._abort, msg)
            case lp.Stats():
                await self.send(lp.Ok(id=msg.id, stats=self.agent.statistics().counts()))
            case _:
                await self.reply_error(msg.id, ConfigError(f"{type(msg).__name__} is not a request"))

    def _track(self, handle: SendHandle | ReceiveHandle | GatherHandle) -> int:
        hid = next(self.ids)
        self.handles[hid] = handle
        return hid

    async def register(self, msg: lp.RegisterKV) -> None:
        try:
            if self.agent.memory is not None:
                raise ConfigError("this sidecar already serves registered KV memory")
            layout = msg.shared.layout if msg.shared is not None else msg.layout
            if layout is None or (msg.shared is None and not msg.cuda):
                raise LayoutError("register shared host memory, or CUDA IPC handles with a layout")
            expected = self.sidecar.layout
            if expected is not None and layout != expected:
                raise LayoutError(f"this sidecar serves {expected.describe()}; the engine "
                                  f"registered {layout.describe()}")
            if msg.shared is not None:
                shared = SharedKV.attach(msg.shared)
                try:
                    self.agent.register_kv(layout, shared.layers, cache_scales=msg.cache_scales)
                except KVStreamError:
                    shared.close()
                    raise
                self.shared = shared
            else:
                from kvstream.cuda_ipc import import_cuda

                self.agent.register_kv(layout, [import_cuda(h) for h in msg.cuda],
                                       cache_scales=msg.cache_scales)
                self.cuda = True
        except KVStreamError as exc:
            await self.reply_error(msg.id, exc)
            return
        await self.send(lp.Ok(id=msg.id, num_layers=layout.num_layers))

    async def _push(self, msg: lp.Push, tg: anyio.abc.TaskGroup) -> None:
        await self._start(msg.id, self.agent.push(
            msg.request_id, msg.dst, msg.src_blocks, dst_blocks=msg.dst_blocks, mode=msg.mode,
            block_hashes=msg.block_hashes, codec=msg.codec, timeout=msg.timeout,
            trace_context=telemetry.context_from({"traceparent": msg.traceparent}),
            tokens=msg.tokens), self._finished)

    async def _pull(self, msg: lp.Pull, tg: anyio.abc.TaskGroup) -> None:
        await self._start(msg.id, self.agent.pull(
            msg.request_id, msg.src, msg.dst_blocks, mode=msg.mode, have=msg.have,
            lookahead=msg.lookahead, codec=msg.codec, timeout=msg.timeout,
            trace_context=telemetry.context_from({"traceparent": msg.traceparent}),
            secret=msg.secret, tokens=msg.tokens, readers=msg.readers), self._watch_receive)

    async def _start(self, rid: int, begin: Any, follow: Any) -> None:
        """Await a transfer's start, answer the engine with its handle, then follow it."""
        try:
            handle = await begin
        except KVStreamError as exc:
            await self.reply_error(rid, exc)
            return
        hid = self._track(handle)
        await self.send(lp.Ok(id=rid, handle=hid, num_layers=handle.num_layers))
        await follow(hid, handle)

    async def _watch_receive(self, hid: int, handle: ReceiveHandle | GatherHandle) -> None:
        for layer in range(handle.num_layers):
            try:
                await handle.wait_landed(layer)
            except KVStreamError:
                break
            await self.send(lp.LayerLanded(handle=hid, layer=layer))
        await self._finished(hid, handle)

    async def _finished(self, hid: int,
                        handle: SendHandle | ReceiveHandle | GatherHandle) -> None:
        result = await handle.result()
        self.handles.pop(hid, None)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self.send(lp.Finished(handle=hid, result=result))

    async def _abort(self, msg: lp.Abort) -> None:
        handle = self.handles.get(msg.handle)
        if handle is None:
            await self.reply_error(msg.id, ConfigError(f"no handle {msg.handle}"))
            return
        await handle.abort(msg.reason)
        await self.send(lp.Ok(id=msg.id, handle=msg.handle))

    async def cleanup(self) -> None:
        """The engine is gone or done: end its transfers, drop its memory."""
        reason = "engine disconnected from its sidecar"
        for handle in list(self.handles.values()):
            if not handle.done:
                await handle.abort(reason)
        self.handles.clear()
        if self.shared is not None or self.cuda:
            await self.agent.unregister_kv(reason)
            if self.shared is not None:
                self.shared.close()
            self.shared, self.cuda = None, False
            log.info("engine memory released")
        with contextlib.suppress(Exception):
            await self.stream.aclose()


class Sidecar:
    """``await Sidecar(config, socket_path).serve()`` runs until cancelled."""

    def __init__(self, config: AgentConfig, socket_path: str, *,
                 layout: KVLayout | None = None) -> None:
        self.config = config
        self.socket_path = socket_path
        self.layout = layout  # when set, memory of any other layout is refused
        self.agent = Agent(config)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        import torch

        # The sidecar's only torch work is its block copies; idle intra-op threads spinning
        # beside them would only take CPU from the copies and the engine (architecture.md).
        torch.set_num_threads(1)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        async with self.agent:
            # Bound and listening under a private name, then renamed into place: an engine
            # that sees the path can connect (between bind and listen it would be refused).
            staged = f"{self.socket_path}.{os.getpid()}.tmp"
            try:
                listener = await anyio.create_unix_listener(staged)
            except OSError as exc:
                raise ConfigError(f"cannot listen on {self.socket_path}: {exc}") from exc
            try:
                os.chmod(staged, 0o600)
                os.replace(staged, self.socket_path)
            except OSError as exc:
                await listener.aclose()
                with contextlib.suppress(OSError):
                    os.unlink(staged)
                raise ConfigError(f"cannot listen on {self.socket_path}: {exc}") from exc
            try:
                async with listener:
                    log.info("kvstream sidecar %s ready: socket %s, NATS %s, role %s",
                             self.config.instance_id, self.socket_path, self.agent.nats_url,
                             self.config.role)
                    task_status.started()
                    await listener.serve(self._session)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.socket_path)

    async def _session(self, stream: SocketStream) -> None:
        try:
            await _Session(self, stream).run()
        except Exception:  # one engine's session must not stop the sidecar serving others
            log.exception("engine session ended with an unexpected error")
