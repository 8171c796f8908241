"""kvstream as an SGLang disaggregation transfer backend (sglang 0.5.23's base classes).

SGLang's schedulers call these from their own thread, never awaiting: every call here is
short (a table update, or one hop to the agent's loop: ``AgentRuntime``), and ``poll()``
reads state the agent's loop wrote. The flow (``notes.py``): decode's ``send_metadata``
sends ``Want``; the prefill's ``poll`` says ``WaitingForInput`` once it has one (SGLang
computes only then); the last ``send`` offers the pages and answers ``Ready`` with the aux
row; the decode pulls, and its ``poll`` writes the aux row (the room last) once every page
landed, then says ``Success``. The prefill's ``Success`` is the offer's completion (the
pull read every page), so SGLang frees its pages only after the last byte left.

Failures are the backend's own: a kvstream transfer that fails, a peer the registry lost,
a ``Drop`` from the other side, a request waiting past SGLang's own timeouts: the poll
latches ``Failed``. ``abort()`` returns only once the request's stream stopped (SGLang
frees the pages when it returns). One agent per scheduler process (``KVStreamKVManager``);
NATS is the bootstrap, so the bootstrap server is a no-op.

v1 limits (``docs/architecture.md``, "SGLang"): the same TP degree and page size on both
sides (the pools are described by their bytes: ``memory.py``), no side state (FP8 block
scales, SWA/Mamba state), no speculative draft KV, one data-parallel rank per engine.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

import anyio
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
)

from kvstream._exceptions import AdapterError, KVStreamError
from kvstream.adapters.runtime import AgentRuntime
from kvstream.adapters.sglang import notes
from kvstream.adapters.sglang.memory import AuxRows, kv_buffers, kvs_layout
from kvstream.config import AgentConfig
from kvstream.control.auth import NatsAuth
from kvstream.transfer.plan import TpInfo

__all__ = ["KVStreamBootstrapServer", "KVStreamKVManager", "KVStreamKVReceiver",
           "KVStreamKVSender", "instance_for"]

log = logging.getLogger("kvstream.sglang")

MAX_EARLY_WANTS = 1 << 14  # Wants that arrived before their prefill request (bounded, FIFO)


def _timeout(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@functools.lru_cache(maxsize=256)
def _host_ip(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def instance_for(bootstrap_addr: str, rank: int) -> str:
    """The kvstream instance id of prefill rank ``rank`` behind ``host:port`` (the address
    SGLang's router gives decode, and the prefill knows itself by)."""
    host, _, port = bootstrap_addr.rpartition(":")
    host = _host_ip(host.strip("[]"))
    token = "".join(c if c.isalnum() else "_" for c in f"{host}_{port}")
    return f"sglang-{token}-tp{rank}"


class _PrefillInfo:
    """What SGLang's decode reads of ``prefill_info_table[addr]``: one DP rank."""

    def __init__(self, tp_size: int) -> None:
        self.dp_size = 1
        self.follow_bootstrap_room = False
        self.tp_size = tp_size


class KVStreamBootstrapServer(BaseKVBootstrapServer):
    """Nothing to serve: decode finds the prefill ranks in kvstream's NATS registry."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port


class KVStreamKVManager(BaseKVManager):
    """One scheduler process's agent: its KV pools and aux rows registered, the notes of
    both roles handled, the requests in flight by bootstrap room."""

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False, **_: Any) -> None:
        self.kv_args = args
        self.server_args = server_args
        self.role = "prefill" if getattr(disaggregation_mode, "value", "") == "prefill" \
            else "decode"
        self.is_mla = bool(is_mla_backend)
        self.prefill_info_table: dict[str, _PrefillInfo] = {}
        self.req_to_decode_prefix_len: dict[int, int] = {}
        if getattr(args, "num_draft_entries", 0):
            raise AdapterError("kvstream's SGLang backend does not move speculative draft KV "
                               "yet")
        if getattr(args, "state_types", None):
            raise AdapterError(f"kvstream's SGLang backend does not move side state "
                               f"({list(args.state_types)}) yet")
        for knob in ("pp_size", "dp_size", "attn_cp_size"):
            if int(getattr(server_args, knob, 1) or 1) != 1:
                raise AdapterError(f"kvstream's SGLang backend runs one pipeline stage and one "
                                   f"data-parallel rank per server (for now): {knob} = "
                                   f"{getattr(server_args, knob)}")
        if getattr(server_args, "enable_dp_attention", False):
            raise AdapterError("kvstream's SGLang backend does not support DP attention yet")
        self.rank = int(args.engine_rank)
        self.tp_size = max(1, int(getattr(server_args, "tp_size", 1) or 1))
        device = str(getattr(server_args, "device", "cuda") or "cuda")
        self.device = "cpu" if device == "cpu" else "cuda"
        layout, pages = kvs_layout(list(args.kv_data_lens), list(args.kv_item_lens),
                                   int(args.page_size), self.is_mla)
        tensors = kv_buffers(list(args.kv_data_ptrs), list(args.kv_data_lens), layout, pages,
                             self.device, int(getattr(args, "gpu_id", 0) or 0))
        self.aux = AuxRows(list(args.aux_data_ptrs), list(args.aux_data_lens),
                           list(args.aux_item_lens))
        if self.role == "prefill":
            host = os.environ.get("KVSTREAM_SGLANG_HOST") or str(
                getattr(server_args, "host", "") or "")
            if host in ("", "0.0.0.0", "::"):
                host = socket.gethostname()
            port = int(getattr(server_args, "disaggregation_bootstrap_port", 8998))
            self.instance = instance_for(f"{host}:{port}", self.rank)
        else:
            token = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:40]
            self.instance = f"sglang-d-{token}-{os.getpid()}-tp{self.rank}"
        tp = TpInfo(rank=self.rank, size=self.tp_size,
                    total_kv_heads=0 if self.is_mla else self.tp_size)
        config = AgentConfig(
            instance_id=self.instance, role=self.role,  # type: ignore[arg-type]
            namespace=os.environ.get("KVSTREAM_NAMESPACE", "default"),
            nats_url=os.environ.get("KVSTREAM_NATS_URL") or None,
            nats_auth=NatsAuth.from_env({}), tp=tp,
            peer_timeout_s=_timeout("KVSTREAM_PEER_TIMEOUT_S", 10.0),
            transfer_timeout_s=_timeout("KVSTREAM_TRANSFER_TIMEOUT_S", 120.0),
            lease_s=_timeout("KVSTREAM_LEASE_S", 60.0))
        self.bootstrap_timeout_s = _timeout("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)
        # How long abort() waits for a request's stream to stop: it always does within the
        # agent's own bounds (a pull's negotiation, the stream's abort handshake).
        self.drain_timeout_s = 4 * config.request_timeout_s + 10.0
        self.waiting_timeout_s = _timeout("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
        self._lock = threading.Lock()
        self.senders: dict[int, KVStreamKVSender] = {}
        self.receivers: dict[int, KVStreamKVReceiver] = {}
        # Notes for rooms whose prefill request is not here yet: a Want, or the Drop of it.
        self._early: OrderedDict[int, tuple[str, notes.Want | notes.Drop]] = OrderedDict()
        self.dropped = 0  # notes ignored: garbage, unknown rooms, a peer not the request's
        self.rt = AgentRuntime(config, layout, tensors)
        _dispatch(self)
        log.info("kvstream SGLang backend: %s %s, %s", self.role, self.instance,
                 layout.describe())

    @property
    def agent(self) -> Any:
        if self.rt.agent is None:
            raise AdapterError("the kvstream agent is closed")
        return self.rt.agent

    def register_to_bootstrap(self) -> None:
        """NATS is the bootstrap: the agent announced itself when it started."""

    def teardown(self) -> None:
        self.rt.close()

    # -- decode: where the prefill ranks are ---------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        if bootstrap_addr in self.prefill_info_table:
            return True
        first = instance_for(bootstrap_addr, 0)
        ann = self.rt.call(self.agent.registry.announced, first)
        if ann is None:
            log.info("kvstream: prefill %s (%s) is not in the registry yet", bootstrap_addr,
                     first)
            return False
        self.prefill_info_table[bootstrap_addr] = _PrefillInfo(ann.tp.size if ann.tp else 1)
        return True

    def alive(self, instance: str) -> bool:
        return bool(self.agent.registry.alive(instance))

    # -- notes, on the agent's loop ------------------------------------------------------
    def on_want(self, sender: str, want: notes.Want) -> None:
        ann = self.agent.registry.announced(sender)
        if ann is None or ann.role not in ("decode", "both") or not self.alive(sender):
            self.dropped += 1  # only a live decode instance allocates pages
            return
        with self._lock:
            s = self.senders.get(want.room)
            if s is None:
                self._early.setdefault(want.room, (sender, want))  # the first one's
                while len(self._early) > MAX_EARLY_WANTS:
                    self._early.popitem(last=False)
                return
        s.wanted(sender, want)

    def on_ready(self, sender: str, ready: notes.Ready) -> None:
        with self._lock:
            r = self.receivers.get(ready.room)
        if r is None or r.src != sender:
            self.dropped += 1
            return
        r.readied(ready)

    def on_drop(self, sender: str, drop: notes.Drop) -> None:
        with self._lock:
            s = self.senders.get(drop.room)
            r = self.receivers.get(drop.room)
            early = self._early.get(drop.room)
            if s is None and (early is None or early[0] == sender):
                # Its request is not here yet: it fails as soon as it is.
                self._early[drop.room] = (sender, drop)
                while len(self._early) > MAX_EARLY_WANTS:
                    self._early.popitem(last=False)
        for side in (s, r):
            if side is not None and side.peer == sender:
                side.dropped(drop.reason)

    def claim_want(self, room: int) -> tuple[str, notes.Want | notes.Drop] | None:
        with self._lock:
            return self._early.pop(room, None)

    def send_note(self, peer: str, note: notes.Want | notes.Ready | notes.Drop) -> None:
        topic = {notes.Want: notes.WANT, notes.Ready: notes.READY, notes.Drop: notes.DROP}[
            type(note)]
        body = notes.encode(note)

        async def send() -> None:
            try:
                await self.agent.note(peer, topic, body)
            except KVStreamError as exc:
                log.warning("kvstream: %s to %s failed: %s", topic, peer, exc)

        self.rt.spawn(send)


def _dispatch(mgr: KVStreamKVManager) -> None:
    """Per-topic handlers that decode the body first (a peer's garbage is dropped)."""
    def handler(topic: str) -> Any:
        def on(sender: str, body: bytes) -> None:
            note = notes.decode(topic, body)
            if note is None:
                mgr.dropped += 1
            elif isinstance(note, notes.Want):
                mgr.on_want(sender, note)
            elif isinstance(note, notes.Ready):
                mgr.on_ready(sender, note)
            else:
                mgr.on_drop(sender, note)
        return on

    for topic in (notes.WANT, notes.READY, notes.DROP):
        mgr.rt.call(mgr.agent.on_note, topic, handler(topic))


class _Side:
    """What a sender and a receiver share: the latched failure, the peer, and the rule
    that ``Failed`` is reported only once nothing of the request moves any more (SGLang
    frees the pages when it sees ``Failed``): a failure first stops the request's stream
    (``_stop``, on the agent's loop), then tells the peer (``Drop``), then reports."""

    kv_mgr: KVStreamKVManager
    room: int
    peer: str = ""

    def _init_side(self) -> None:
        self.failure: str | None = None
        self.conclude_state: int | None = None
        self.stopped = threading.Event()  # set once nothing of the request moves any more
        self.started = time.monotonic()
        self._told = False

    def fail(self, why: str, *, tell: bool = True) -> None:
        """Latch the failure (the first reason wins; a concluded success stays one) and
        stop what runs for it, from either thread."""
        with self.kv_mgr._lock:
            if self.failure is not None or self.conclude_state == KVPoll.Success:
                return
            self.failure = why
        log.warning("kvstream: room %s failed: %s", self.room, why)
        self._told = not tell
        rt = self.kv_mgr.rt
        if rt.on_loop():
            self._failed_on_loop()
        else:
            try:
                rt.call(self._failed_on_loop)
            except Exception as exc:  # the agent is gone: nothing of ours moves
                log.warning("kvstream: stopping room %s: %r", self.room, exc)
                self.stopped.set()

    def _failed_on_loop(self) -> None:
        if self._streaming():
            self.kv_mgr.rt.spawn(self._stop_then_tell)
        else:
            self.stopped.set()
            self._drop()

    async def _stop_then_tell(self) -> None:
        try:
            await self._stop()
        finally:
            self.stopped.set()
            self._drop()

    def _drop(self) -> None:
        if not self._told and self.peer:
            self._told = True
            self.kv_mgr.send_note(self.peer, notes.Drop(room=self.room,
                                                        reason=(self.failure or "")[:1024]))

    def _streaming(self) -> bool:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    def _failed_poll(self, in_flight: int) -> int:
        """``Failed`` once stopped; until then what the request was (its stream stops)."""
        if self.stopped.is_set():
            self.conclude_state = KVPoll.Failed
            self.clear()
            return KVPoll.Failed
        return in_flight

    def _wait_stopped(self) -> None:
        if not self.stopped.wait(self.kv_mgr.drain_timeout_s):
            log.error("kvstream: room %s still moving after %s s", self.room,
                      self.kv_mgr.drain_timeout_s)

    def dropped(self, reason: str) -> None:
        self.fail(f"{self.peer} gave the request up: {reason}", tell=False)

    def failure_exception(self) -> None:
        """SGLang calls this for a ``Failed`` poll, before it frees the pages. A ``Failed``
        another rank decided (the polls are min-all-reduced) stops this rank's transfer
        first."""
        own = self.failure is not None
        if not own:
            self.fail("another rank of this request failed")
        self._wait_stopped()
        self.clear()
        exc = AdapterError(f"kvstream transfer of room {self.room} failed: {self.failure}")
        exc.is_from_another_rank = not own  # type: ignore[attr-defined]  # SGLang reads it
        raise exc

    def clear(self) -> None:
        raise NotImplementedError


def _rid(room: int) -> str:
    return f"sgl-{room}"


class KVStreamKVSender(_Side, BaseKVSender):
    def __init__(self, mgr: KVStreamKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False, **_: Any) -> None:
        self.kv_mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, int(bootstrap_room)
        self._init_side()
        self.want: notes.Want | None = None
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.pages: list[int] = []
        self.tokens = 0
        self.handle: Any = None
        self.result: Any = None
        self.inited_at = 0.0
        with mgr._lock:
            mgr.senders[self.room] = self
        early = mgr.claim_want(self.room)
        if early is not None:
            peer, note = early
            if isinstance(note, notes.Drop):
                self.peer = peer
                self.dropped(note.reason)
            else:
                self.wanted(peer, note)

    def wanted(self, sender: str, want: notes.Want) -> None:
        if self.want is not None:  # the first decode rank's; another is not this request's
            self.kv_mgr.dropped += 1
            return
        self.want, self.peer = want, sender
        mgr = self.kv_mgr
        if want.tp_size != mgr.tp_size or want.tp_rank != mgr.rank:
            why = (f"decode rank {want.tp_rank} of TP {want.tp_size} against prefill rank "
                   f"{mgr.rank} of TP {mgr.tp_size}: kvstream's SGLang backend moves between "
                   "equal TP degrees only (for now)")
            self.fail(why)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index
        self.inited_at = time.monotonic()
        if self.num_pages < 0:
            self.fail(f"{self.num_pages} pages to send (the decode's prefix is longer than "
                      "the prompt?)")

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # a last chunk of no pages still sends the aux row

    def pop_decode_prefix_len(self) -> int:
        return self.want.prefix_len if self.want is not None else 0

    def send(self, kv_indices: Any, state_indices: Any = None,
             num_kv_tokens: int | None = None, **_: Any) -> None:
        if self.failure is not None:
            return
        if self.num_pages is None or self.want is None:
            self.fail("send() before init() or before the decode side asked")
            return
        self.pages += [int(i) for i in kv_indices]
        self.tokens += int(num_kv_tokens or 0)
        last = state_indices is not None  # SGLang passes the state list on the last chunk
        if len(self.pages) > self.num_pages or (last and len(self.pages) != self.num_pages):
            self.fail(f"{len(self.pages)} pages sent for {self.num_pages}")
        elif last:
            self._offer()

    def _offer(self) -> None:
        mgr, want = self.kv_mgr, self.want
        if want is None:  # send() checked it
            raise AdapterError("offering before the decode side asked")
        if mgr.device == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()  # the forward wrote the pages
        try:
            aux = mgr.aux.read(int(self.aux_index if self.aux_index is not None else -1))
        except AdapterError as exc:
            self.fail(str(exc))
            return
        if not self.pages:  # everything was cached at the decode: only the aux row moves
            mgr.send_note(self.peer, notes.Ready(room=self.room, secret=secrets.token_urlsafe(16),
                                                 tokens=0, pages=0, aux=aux))
            self.result = True
            return
        if want.pages != len(self.pages):
            why = f"{len(self.pages)} pages here, {want.pages} allocated at the decode"
            self.fail(why)
            return
        try:
            self.handle = mgr.rt.call(self._offer_on_loop, aux)
        except KVStreamError as exc:
            self.fail(f"offering the pages failed: {exc}")

    def _offer_on_loop(self, aux: list[bytes]) -> Any:
        mgr = self.kv_mgr
        if self.failure is not None:  # dropped while SGLang computed: nothing to offer
            return None
        handle = mgr.agent.offer(_rid(self.room), self.pages, mode="eager")
        handle.all_ready()
        self.handle = handle

        async def watch() -> None:
            res = await handle.result()
            if res.ok:
                self.result = res
            else:
                self.fail(f"the pull of the pages ended {res.status}: {res.reason}")

        mgr.rt.spawn(watch)
        mgr.send_note(self.peer, notes.Ready(room=self.room, secret=handle.secret,
                                             tokens=self.tokens, pages=len(self.pages),
                                             aux=aux))
        return handle

    def _streaming(self) -> bool:
        return self.handle is not None and not self.handle.done

    async def _stop(self) -> None:
        if self.handle is not None:
            await self.handle.abort(f"room {self.room}: {self.failure}")

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.failure is not None:
            before = KVPoll.WaitingForInput if self.num_pages is None else KVPoll.Transferring
            return self._failed_poll(before)
        if self.result is not None:
            self.conclude_state = KVPoll.Success
            return KVPoll.Success
        if self.num_pages is not None and \
                time.monotonic() - self.inited_at > self.kv_mgr.waiting_timeout_s:
            self.fail(f"not sent within {self.kv_mgr.waiting_timeout_s} s of its start")
            return self.poll()
        if self.num_pages is None:
            if self.want is not None:
                return KVPoll.WaitingForInput
            if time.monotonic() - self.started > self.kv_mgr.bootstrap_timeout_s:
                self.fail(f"no decode engine asked for it within "
                          f"{self.kv_mgr.bootstrap_timeout_s} s")
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        return KVPoll.Transferring if self.handle is not None else KVPoll.WaitingForInput

    def get_transfer_metric(self) -> Any:
        from sglang.srt.disaggregation.base.conn import KVTransferMetric

        res = self.result
        if res is None or res is True:
            return KVTransferMetric()
        return KVTransferMetric(transfer_latency_s=res.seconds, transfer_total_bytes=res.bytes)

    def abort(self) -> None:
        self.fail("the prefill request was aborted")
        self._wait_stopped()  # SGLang frees the pages when this returns

    def clear(self) -> None:
        with self.kv_mgr._lock:
            if self.kv_mgr.senders.get(self.room) is self:
                del self.kv_mgr.senders[self.room]


class KVStreamKVReceiver(_Side, BaseKVReceiver):
    require_staging = False

    def __init__(self, mgr: KVStreamKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None, **_: Any) -> None:
        self.kv_mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.room = int(bootstrap_room or 0)
        self._init_side()
        self.abort_notified = False
        self.src = ""
        self.inited = False
        self.pages: list[int] | None = None
        self.aux_index: int | None = None
        self.sent_at = 0.0
        self.ready: notes.Ready | None = None
        self.handle: Any = None
        self.result: Any = None
        self._starting: anyio.Event | None = None
        with mgr._lock:
            mgr.receivers[self.room] = self

    def init(self, prefill_dp_rank: int = 0) -> None:
        mgr = self.kv_mgr
        info = mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is not None and info.tp_size != mgr.tp_size:
            self.fail(f"prefill TP {info.tp_size}, decode TP {mgr.tp_size}: kvstream's SGLang "
                      "backend moves between equal TP degrees only (for now)")
        self.src = self.peer = instance_for(self.bootstrap_addr, mgr.rank)
        self.inited = True

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None,
                      state_indices: Any = None, decode_prefix_len: int | None = None,
                      **_: Any) -> None:
        if self.failure is not None:
            return
        if state_indices:
            self.fail("side state (state_indices) is not moved by kvstream yet")
            return
        mgr = self.kv_mgr
        self.pages = [int(i) for i in kv_indices]
        self.aux_index = aux_index
        self.sent_at = time.monotonic()
        mgr.send_note(self.src, notes.Want(room=self.room, pages=len(self.pages),
                                           prefix_len=int(decode_prefix_len or 0),
                                           tp_rank=mgr.rank, tp_size=mgr.tp_size))

    def readied(self, ready: notes.Ready) -> None:
        """On the agent's loop: the prefill offered the pages; pull them."""
        if self.failure is not None or self.ready is not None or self.pages is None:
            return
        if ready.pages != len(self.pages):
            self.fail(f"the prefill offers {ready.pages} pages for {len(self.pages)} allocated")
            return
        self.ready = ready
        if ready.pages:
            self._starting = anyio.Event()
            self.kv_mgr.rt.spawn(self._pull)

    async def _pull(self) -> None:
        mgr, ready = self.kv_mgr, self.ready
        if ready is None or self.pages is None or self._starting is None:  # readied() set them
            raise AdapterError("a pull before the prefill's Ready")
        try:
            self.handle = await mgr.agent.pull(_rid(self.room), self.src, self.pages,
                                               mode="eager", secret=ready.secret)
        except KVStreamError as exc:
            self.fail(f"the pull from {self.src} failed: {exc}")
            return
        finally:
            self._starting.set()
        if self.failure is not None:  # aborted while it started
            await self.handle.abort("the decode request was aborted")
        res = await self.handle.result()
        if res.ok:
            self.result = res
        else:
            self.fail(f"the pull from {self.src} ended {res.status}: {res.reason}")

    def _streaming(self) -> bool:
        return self._starting is not None and (self.handle is None or not self.handle.done)

    async def _stop(self) -> None:
        await self._drain()

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.failure is not None:
            before = KVPoll.Transferring if self.pages is not None else (
                KVPoll.WaitingForInput if self.inited else KVPoll.Bootstrapping)
            return self._failed_poll(before)
        if not self.inited:
            return KVPoll.Bootstrapping
        if self.pages is None:
            return KVPoll.WaitingForInput
        ready = self.ready
        if ready is not None and (self.result is not None or not ready.pages):
            try:
                self.kv_mgr.aux.write(int(self.aux_index if self.aux_index is not None else -1),
                                      ready.aux, self.room)
            except AdapterError as exc:
                self.fail(f"the aux row does not fit: {exc}")
                return self.poll()
            self.conclude_state = KVPoll.Success
            return KVPoll.Success
        if self.src and not self.kv_mgr.alive(self.src) and self.result is None:
            self.fail(f"the prefill rank {self.src} is gone")
            return self.poll()
        if time.monotonic() - self.sent_at > self.kv_mgr.waiting_timeout_s:
            self.fail(f"no KV from {self.src} within {self.kv_mgr.waiting_timeout_s} s")
            return self.poll()
        return KVPoll.Transferring

    def abort(self) -> None:
        self.fail("the decode request was aborted")
        self._wait_stopped()  # SGLang frees the pages when this returns

    async def _drain(self) -> None:
        """Until nothing of this request can write into its pages any more."""
        if self._starting is not None:
            await self._starting.wait()
        if self.handle is not None and not self.handle.done:
            await self.handle.abort("the decode request was aborted")

    def clear(self) -> None:
        with self.kv_mgr._lock:
            if self.kv_mgr.receivers.get(self.room) is self:
                del self.kv_mgr.receivers[self.room]

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang's deferred-release hook: kvstream releases nothing late."""
