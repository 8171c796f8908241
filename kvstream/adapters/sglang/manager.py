"""The manager SGLang builds once per scheduler process: one kvstream agent.

Its KV pools and aux rows registered (``memory.py``), the notes of both roles handled on
the agent's loop (``notes.py``), the requests in flight by bootstrap room. NATS is the
bootstrap (decode finds the prefill ranks in kvstream's registry), so the bootstrap server
is a no-op. SGLang's schedulers call from their own thread, never awaiting: every call
here is a table update or one hop to the agent's loop (``AgentRuntime``).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from collections import Counter, OrderedDict
from typing import Any, Protocol

import anyio
from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer, BaseKVManager, KVArgs

from kvstream._exceptions import AdapterError, KVStreamError
from kvstream.adapters.runtime import AgentRuntime
from kvstream.adapters.sglang import notes
from kvstream.adapters.sglang.memory import AuxRows, kv_buffers, kvs_layout
from kvstream.adapters.sglang.state import SideState, side_groups
from kvstream.config import AgentConfig
from kvstream.control.auth import NatsAuth
from kvstream.transfer import ranks
from kvstream.transfer.plan import TpInfo

__all__ = ["MAX_EARLY_NOTES", "MAX_EARLY_PER_SENDER", "Early", "KVStreamBootstrapServer",
           "KVStreamKVManager", "instance_for"]

log = logging.getLogger("kvstream.sglang")

MAX_EARLY_NOTES = 1 << 14  # notes that arrived before their prefill request (bounded, FIFO)
MAX_EARLY_PER_SENDER = 1 << 12  # of those, from any one decode instance
NOTE_FLUSH_S = 2.0  # how long teardown waits for the notes on their way

Early = tuple[str, notes.Want | notes.Drop, bytes]  # (sender, note, the key it signed with)


def _timeout(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _sglang_env(name: str) -> Any:
    """One of SGLang's own settings (``sglang.srt.environ.envs``: its overrides apply),
    read when called; ``LookupError`` if this SGLang version has no such setting."""
    try:
        from sglang.srt.environ import envs

        return getattr(envs, name).get()
    except Exception as exc:
        raise LookupError(name) from exc


def sglang_timeout(name: str, default: float) -> float:
    """One of SGLang's own timeout knobs, read when called."""
    try:
        return float(_sglang_env(name))
    except (LookupError, TypeError, ValueError):  # the environment variable itself
        return _timeout(name, default)


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


def _kv_heads(args: KVArgs, server_args: Any, tp_size: int) -> tuple[int, int]:
    """(heads per rank, model-wide KV heads), 0 if unknown. SGLang 0.5.23 tells the
    prefill's manager (``kv_head_num``), not the decode's: there, SGLang's own model config
    answers, read as its scheduler read it (a local config file by now)."""
    heads = int(getattr(args, "kv_head_num", 0) or 0)
    total = int(getattr(args, "total_kv_head_num", 0) or 0)
    if heads > 0:
        return heads, total
    if not getattr(server_args, "model_path", None):
        return 0, 0
    try:
        from sglang.srt.configs.model_config import ModelConfig

        config = ModelConfig.from_server_args(server_args)
        return int(config.get_num_kv_heads(tp_size)), int(config.get_total_num_kv_heads())
    except Exception as exc:  # no head count: equal TP degrees only (refused otherwise)
        log.warning("kvstream: the model's KV head count is unknown (%r): this rank moves "
                    "KV only to and from an engine of its own TP degree", exc)
        return 0, 0


def _pages_not_nhd() -> str:
    """How SGLang lays out its MHA pages if not as NHD token rows ("": NHD), which the
    head-sliced plans assume: heads first (``SGLANG_USE_HND_KVCACHE``), or AITER's
    shuffled ``vectorized_5d`` (ROCm)."""
    def env(name: str, default: str) -> str:
        try:
            return str(_sglang_env(name))
        except LookupError:  # another SGLang version: the environment variable itself
            return os.environ.get(name, default)

    if env("SGLANG_USE_HND_KVCACHE", "false").lower() in ("1", "true", "yes"):
        return "HND (SGLANG_USE_HND_KVCACHE)"
    if env("SGLANG_AITER_KV_CACHE_LAYOUT", "nhd").lower() == "vectorized_5d":
        return "vectorized_5d (SGLANG_AITER_KV_CACHE_LAYOUT)"
    return ""


class _Sender(Protocol):
    """What the manager hands a prefill request (``sender.py``)."""

    def heard(self, sender: str, note: notes.Want | notes.Drop, key: bytes) -> None: ...


class _Receiver(Protocol):
    """What the manager hands a decode request (``receiver.py``)."""

    srcs: list[str]

    def peers(self) -> list[str]: ...

    def readied(self, sender: str, ready: notes.Ready) -> None: ...

    def dropped(self, peer: str, reason: str) -> None: ...


class PrefillInfo:
    """What SGLang's decode reads of ``prefill_info_table[addr]`` (one DP rank), and what
    its receivers plan by: the prefill's TP degree, KV heads and pages, as its rank 0
    announced them."""

    def __init__(self, tp_size: int, total_kv_heads: int, page_size: int, mla: bool) -> None:
        self.dp_size = 1
        self.follow_bootstrap_room = False
        self.tp_size, self.total_kv_heads = tp_size, total_kv_heads
        self.page_size, self.mla = page_size, mla


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
        # A hybrid pool (linear attention beside MLA) is not an MLA pool to SGLang's check,
        # but its pages are MLA's: one latent buffer per layer, the same on every rank.
        self.is_mla = bool(is_mla_backend) or bool(getattr(args, "is_hybrid_mla_backend", False))
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self.req_to_decode_prefix_len: dict[int, int] = {}
        for knob in ("pp_size", "dp_size", "attn_cp_size", "dcp_size"):
            if int(getattr(server_args, knob, 1) or 1) != 1:
                raise AdapterError(f"kvstream's SGLang backend runs one pipeline stage, one "
                                   f"data-parallel rank and no context parallelism per server "
                                   f"(for now): {knob} = {getattr(server_args, knob)}")
        for flag, what in (("enable_dp_attention", "DP attention"),
                           ("enable_kv_cache_sharding", "KV cache sharding (each rank would "
                            "hold a part of the MLA pages and side state, not all)")):
            if getattr(server_args, flag, False) is True:
                raise AdapterError(f"kvstream's SGLang backend does not support {what} yet")
        self.rank = int(args.engine_rank)
        self.tp_size = max(1, int(getattr(server_args, "tp_size", 1) or 1))
        self.page_size = int(args.page_size)
        device = str(getattr(server_args, "device", "cuda") or "cuda")
        self.device = "cpu" if device == "cpu" else "cuda"
        # The heads this rank holds (MHA): with them, a peer of another TP degree takes its
        # heads through transfer plans. Without them the pages are opaque bytes and only
        # an equal TP degree moves (``opaque`` says why). Speculative draft KV rides in the
        # same pages (SGLang appends the draft's buffers, same page ids): byte for byte.
        heads, total = (0, 0) if self.is_mla else _kv_heads(args, server_args, self.tp_size)
        self.opaque: str | None = None
        if getattr(args, "num_draft_entries", 0):
            heads, self.opaque = 0, "the pages carry speculative draft KV too"
        elif not self.is_mla and int(args.page_size) > 1 and (order := _pages_not_nhd()):
            heads, self.opaque = 0, f"its pages are {order}, not NHD rows"
        elif not self.is_mla and heads == 0:
            self.opaque = "SGLang told this rank no KV head count (kv_head_num)"
        self.total_kv_heads = 0 if self.is_mla else total or max(1, heads) * self.tp_size
        self.kv_dtype = "/".join(str(getattr(server_args, k, None) or "auto")
                                 for k in ("kv_cache_dtype", "dtype"))[:64]
        layout, pages = kvs_layout(list(args.kv_data_lens), list(args.kv_item_lens),
                                   int(args.page_size), self.is_mla, heads=max(1, heads))
        tensors = kv_buffers(list(args.kv_data_ptrs), list(args.kv_data_lens), layout, pages,
                             self.device, int(getattr(args, "gpu_id", 0) or 0))
        self.aux = AuxRows(list(args.aux_data_ptrs), list(args.aux_data_lens),
                           list(args.aux_item_lens))
        # Side state (Mamba, SWA, block scales, ...): refused by kind before anything starts
        kinds, groups = side_groups(args, self.device, int(getattr(args, "gpu_id", 0) or 0),
                                    mla=self.is_mla, heads=heads)
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
        # Opaque pages: one "head" per rank, so ranks of one engine never look alike.
        total = self.total_kv_heads if heads else self.tp_size
        tp = TpInfo(rank=self.rank, size=self.tp_size, total_kv_heads=0 if self.is_mla else total)
        config = AgentConfig(
            instance_id=self.instance, role=self.role,  # type: ignore[arg-type]
            namespace=os.environ.get("KVSTREAM_NAMESPACE", "default"),
            nats_url=os.environ.get("KVSTREAM_NATS_URL") or None,
            nats_auth=NatsAuth.from_env({}), tp=tp,
            peer_timeout_s=_timeout("KVSTREAM_PEER_TIMEOUT_S", 10.0),
            transfer_timeout_s=_timeout("KVSTREAM_TRANSFER_TIMEOUT_S", 120.0),
            lease_s=_timeout("KVSTREAM_LEASE_S", 60.0))
        self.bootstrap_timeout_s = sglang_timeout("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0)
        # How long abort() waits for a request's stream to stop: it always does within the
        # agent's own bounds (a pull's negotiation, the stream's abort handshake).
        self.drain_timeout_s = 4 * config.request_timeout_s + 10.0
        self.waiting_timeout_s = sglang_timeout("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0)
        self._lock = threading.Lock()
        self._notes_out = 0  # notes on their way (teardown waits for them, bounded)
        self.senders: dict[int, _Sender] = {}
        self.receivers: dict[int, _Receiver] = {}
        # Notes for rooms whose prefill request is not here yet: Wants, or a Drop, with the
        # key their sender signed them with.
        self._early: OrderedDict[int, list[Early]] = OrderedDict()
        self._early_count = 0
        self._early_by: Counter[str] = Counter()  # of those, per sender (bounded apart)
        self.dropped = 0  # notes ignored: garbage, unknown rooms, a peer not the request's
        # Notes are heard from the moment the agent announces itself (a decode that sees
        # it asks at once), and held until this manager is whole, then handled in order.
        self._held: list[tuple[str, str, bytes]] | None = []
        self._handlers = _dispatch(self)
        self.rt = AgentRuntime(config, layout, tensors, notes=self._handlers)
        self.side: SideState | None = None
        try:
            self.side = SideState(self.rt, config, kinds, groups) if kinds else None
        except BaseException:
            self.rt.close()
            raise
        self.rt.call(self._hear_held)
        log.info("kvstream SGLang backend: %s %s, %s%s", self.role, self.instance,
                 layout.describe(), f"; side state {self.side.describe()}" if self.side else "")

    @property
    def agent(self) -> Any:
        if self.rt.agent is None:
            raise AdapterError("the kvstream agent is closed")
        return self.rt.agent

    supports_host_destination = False  # SGLang's host-KV decode destinations: not yet
    # abort() returns once nothing writes into the pages: SGLang need not defer the release
    enable_deferred_decode_kv_release = False

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """SGLang's KV checksum covers the prefill rank's heads: comparable only when this
        rank holds the same ones (equal TP degrees)."""
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is None or info.tp_size == self.tp_size

    def register_to_bootstrap(self) -> None:
        """NATS is the bootstrap: the agent announced itself when it started."""

    def teardown(self) -> None:
        """Stop the agent once the notes on their way left (bounded): a Drop sent just
        before must still reach its peer, which would otherwise wait out its timeout."""
        if self.rt.agent is not None:
            try:
                self.rt.call(self._flush_notes, NOTE_FLUSH_S)
            except Exception as exc:  # closing must not raise into SGLang's shutdown
                log.warning("kvstream: notes not flushed: %r", exc)
        self.rt.close()

    async def _flush_notes(self, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            while self._notes_out:
                await anyio.sleep(0.01)

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
        # Every rank: a rank this one reads must be announced before its Ready (a pull
        # plans from its layout). Its side-state agents are waited for at the pull: a
        # prefill without side state must be told so (its Drop), not waited for.
        size = ann.tp.size if ann.tp else 1
        for rank in range(1, min(size, ranks.MAX_TP)):
            other = instance_for(bootstrap_addr, rank)
            if self.rt.call(self.agent.registry.announced, other) is None:
                log.info("kvstream: prefill rank %s (%s) is not in the registry yet", rank,
                         other)
                return False
        tp, lay = ann.tp or TpInfo(), ann.layout
        mla = lay is not None and lay.arrangement == "mla"
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(
            tp.size, 0 if mla else tp.total_kv_heads or tp.size,
            lay.block_size if lay is not None else 0, mla)
        return True

    def alive(self, instance: str) -> bool:
        return bool(self.agent.registry.alive(instance))

    # -- notes, on the agent's loop ------------------------------------------------------
    def is_decode(self, sender: str) -> bool | None:
        """Only a live decode instance allocates pages (asks, or gives a request up); None:
        not announced yet (its first notes can overtake its announcement: kept)."""
        ann = self.agent.registry.announced(sender)
        if ann is None:
            return None
        return ann.role in ("decode", "both") and self.alive(sender)

    def decode_role(self, sender: str) -> bool | None:
        """Whether ``sender`` announced itself as a decode instance (None: not yet), alive
        or not: a note ``on_want`` took from a live decode still counts once its request
        is here, even if that decode has left since (a rank it does not read succeeds
        once computed; one it reads fails when its offer's lease ends)."""
        ann = self.agent.registry.announced(sender)
        if ann is None:
            return None
        return ann.role in ("decode", "both")

    def key_of(self, sender: str) -> bytes:
        """The key ``sender``'s notes are signed with now (a note kept until its sender
        announced itself counts only if the announced key is the one it came with)."""
        info = self.agent.registry.get(sender)
        return info.key if info is not None else b""

    def rank_of(self, sender: str) -> tuple[int, int] | None:
        """(TP rank, TP size) ``sender`` announced, None if it announced none."""
        ann = self.agent.registry.announced(sender)
        tp = ann.tp if ann is not None else None
        return (tp.rank, tp.size) if tp is not None else None

    def on_want(self, sender: str, note: notes.Want | notes.Drop) -> None:
        """A Want or Drop for this prefill rank's sender of the room (kept for it if the
        request is not here yet; the sender checks who sent it). A Drop counts from a
        decode that has left since (it may have been held while this manager started)."""
        if (self.decode_role(sender) if isinstance(note, notes.Drop)
                else self.is_decode(sender)) is False:
            self.dropped += 1
            return
        key = self.key_of(sender)
        with self._lock:
            s = self.senders.get(note.room)
            if s is None:
                # Bounded in all and per sender: one peer's flood of rooms that never come
                # cannot push out the notes of the decode ranks that asked for real ones.
                if self._early_by[sender] >= MAX_EARLY_PER_SENDER:
                    self._drop_oldest_early(sender)  # stale: a room that never came here
                self._early.setdefault(note.room, []).append((sender, note, key))
                self._early.move_to_end(note.room)
                self._early_count += 1
                self._early_by[sender] += 1
                while self._early_count > MAX_EARLY_NOTES:
                    _, gone = self._early.popitem(last=False)
                    self._forget_early(gone)
                return
        s.heard(sender, note, key)

    def on_ready(self, sender: str, ready: notes.Ready) -> None:
        with self._lock:
            r = self.receivers.get(ready.room)
        if r is None or sender not in r.srcs:
            self.dropped += 1
            return
        r.readied(sender, ready)

    def on_drop(self, sender: str, drop: notes.Drop) -> None:
        if self.role == "prefill":
            self.on_want(sender, drop)
            return
        with self._lock:
            r = self.receivers.get(drop.room)
        if r is None or sender not in r.peers():
            self.dropped += 1
            return
        r.dropped(sender, drop.reason)

    def _hear_held(self) -> None:
        """On the agent's loop, once the manager is whole: the notes that came first."""
        held, self._held = self._held or [], None
        for topic, sender, body in held:
            self._handlers[topic](sender, body)

    def claim_early(self, room: int) -> list[Early]:
        with self._lock:
            got = self._early.pop(room, [])
            self._forget_early(got)
            return got

    def _drop_oldest_early(self, sender: str) -> None:
        """Under the lock: ``sender``'s oldest early note goes."""
        for room, kept in self._early.items():
            for k, early in enumerate(kept):
                if early[0] == sender:
                    del kept[k]
                    if not kept:
                        del self._early[room]
                    self._forget_early([early])
                    self.dropped += 1
                    return

    def _forget_early(self, gone: list[Early]) -> None:
        """Under the lock: ``gone`` left the early notes."""
        self._early_count -= len(gone)
        for sender, _, _ in gone:
            self._early_by[sender] -= 1
            if self._early_by[sender] <= 0:
                del self._early_by[sender]

    def send_note(self, peer: str, note: notes.Want | notes.Ready | notes.Drop) -> None:
        topic = {notes.Want: notes.WANT, notes.Ready: notes.READY, notes.Drop: notes.DROP}[
            type(note)]
        body = notes.encode(note)
        agent = self.agent
        with self._lock:
            self._notes_out += 1

        async def send() -> None:
            try:
                await agent.note(peer, topic, body)
            except KVStreamError as exc:
                log.warning("kvstream: %s to %s failed: %s", topic, peer, exc)
            finally:
                with self._lock:
                    self._notes_out -= 1

        try:
            self.rt.spawn(send)
        except BaseException:
            with self._lock:
                self._notes_out -= 1
            raise


def _dispatch(mgr: KVStreamKVManager) -> dict[str, Any]:
    """Per-topic handlers that decode the body first (a peer's garbage is dropped)."""
    def handler(topic: str) -> Any:
        def on(sender: str, body: bytes) -> None:
            held = mgr._held
            if held is not None:  # the manager is still starting (on the agent's loop too)
                if len(held) < MAX_EARLY_NOTES:
                    held.append((topic, sender, body))
                else:
                    mgr.dropped += 1
                return
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

    return {topic: handler(topic) for topic in (notes.WANT, notes.READY, notes.DROP)}
