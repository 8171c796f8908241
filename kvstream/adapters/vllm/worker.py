"""The worker role of ``KVStreamConnector`` (each vLLM worker process): registers the KV
tensors with an in-process Agent (on its own thread) and carries out the scheduler's
decisions: offers after the step's forward (or before it, for a push), the decode's loads
(``loads.py``: keeps, pulls, releases, aborts). Results flow back to vLLM through
``get_transfer_results`` exactly once per request.

Each rank is an instance of its own (``<instance>-tp<r>`` under TP) announcing its TP
share (``AgentConfig.tp``: rank, degree, the model's KV heads); a decode rank keeps,
pulls from or releases the prefill ranks ``ranks.py`` assigns it, one source or a gather
of several."""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvstream._exceptions import AdapterError, ConfigError, KVStreamError, LayoutError
from kvstream.adapters.vllm import ranks
from kvstream.adapters.vllm.attention import attention_of, cache_scales
from kvstream.adapters.vllm.caches import layer_indices, layout_of_vllm_caches
from kvstream.adapters.vllm.common import (
    PUSH_TOPIC,
    KVStreamMetadata,
    Offer,
    log,
)
from kvstream.adapters.vllm.load import LoadReport
from kvstream.adapters.vllm.loads import Loads
from kvstream.adapters.vllm.push import (
    DecodePushes,
    PrefillPushes,
    cuda_event,
    decode_note,
    send_note,
)
from kvstream.config import AgentConfig
from kvstream.control.auth import NatsAuth
from kvstream.layout import FP8_DTYPES, KVLayout
from kvstream.tools import otel
from kvstream.transfer.gathered import GatherHandle
from kvstream.transfer.plan import TpInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvstream.adapters.runtime import AgentRuntime
    from kvstream.adapters.vllm.kv_events import EventBridge
    from kvstream.transfer.handles import ReceiveHandle, SendHandle

__all__ = ["WorkerSide"]


class WorkerSide(Loads):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config, "worker")
        self._runtime: AgentRuntime | None = None
        self._results: queue.SimpleQueue[tuple[str, str, bool, list[int]]] = queue.SimpleQueue()
        self._sent: set[str] = set()          # offers ended, waiting for vLLM to finish the request
        self._finished: set[str] = set()      # requests vLLM said finished
        self._load_errors: set[int] = set()
        self._pulls: dict[str, ReceiveHandle | GatherHandle | None] = {}  # agent's loop only
        self._cancelled: set[str] = set()
        self._offers: dict[str, SendHandle] = {}
        self._otel_close: Callable[[], None] | None = None
        self._tp_rank = 0
        if self._tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._tp_rank = get_tensor_model_parallel_rank()
        self._instance = ranks.instance(self._instance, self._tp_rank, self._tp_size)
        self._tp = TpInfo(rank=self._tp_rank, size=self._tp_size)
        self._layout: KVLayout | None = None
        self._kv_bridge: EventBridge | None = None  # vLLM's KV events, rank 0 (kv_events.py)
        self._filled = 0  # blocks this step fills, noted for the bridge at its end
        # Pushes (push.py): the prefill's, on the agent's loop; the push ids of the step
        # being computed (engine thread); vLLM's layer names -> layer index
        self._pushes: PrefillPushes | None = None
        self._step: list[str] = []
        self._layer_of: dict[str, int] = {}
        self._incoming: DecodePushes | None = None  # the decode's awaited pushes (push.py)
        self._load: LoadReport | None = None  # the load announced for routers (load.py)

    def _tp_share(self, layout: KVLayout) -> TpInfo:
        """This rank's TP share as the engine announces it (which model heads it holds)."""
        tp = TpInfo(rank=self._tp_rank, size=self._tp_size, total_kv_heads=self._total_kv_heads)
        try:
            tp.shard(layout)
        except LayoutError as exc:
            # Announced without the head count, rank r of TP n holds heads [r*h, (r+1)*h):
            # right unless heads are replicated; pairing equal TP ranks works either way.
            log.warning("rank %d of TP %d registers %s, which does not fit the model's %d KV "
                        "heads (%s): announcing TP without the head count", self._tp_rank,
                        self._tp_size, layout.describe(), self._total_kv_heads, exc)
            return TpInfo(rank=self._tp_rank, size=self._tp_size)
        return tp

    def _agent_config(self) -> AgentConfig:
        ex = self._extra
        kw: dict[str, Any] = {k: ex[k] for k in ("lease_s", "peer_timeout_s", "transfer_timeout_s",
                                                 "heartbeat_s", "request_timeout_s",
                                                 "staging_bytes", "endpoint",
                                                 "reservation_timeout_s", "staging_wait_s")
                                    if k in ex}
        role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(
            self._kv_transfer_config.kv_role or "", "both")
        auth = ex.get("nats_auth") or {}
        if not isinstance(auth, dict):
            raise ConfigError("kv_connector_extra_config nats_auth: a mapping of NatsAuth "
                              "fields (user, password, token, nkey_seed, creds, tls_ca, ...)")
        try:
            return AgentConfig(instance_id=self._instance, role=role,  # type: ignore[arg-type]
                               namespace=self._namespace, nats_url=ex.get("nats_url"),
                               nats_auth=NatsAuth.from_env(auth), codec=self._codec,
                               tp=self._tp, **kw)
        except TypeError as exc:
            raise ConfigError(f"bad kv_connector_extra_config: {exc}") from exc

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvstream.adapters.runtime import AgentRuntime

        if self._runtime is not None:
            raise AdapterError("register_kv_caches called twice")
        arrangement = self._extra.get("arrangement")  # the operator's word wins
        attention = attention_of(self._vllm_config) if arrangement is None else None
        layout, layers = layout_of_vllm_caches(kv_caches, attention=attention,
                                               arrangement=arrangement)
        scales = cache_scales(self._vllm_config, kv_caches) if layout.dtype in FP8_DTYPES \
            else None
        trace_file = self._extra.get("trace_file")
        if trace_file or otel.otlp_requested():
            # Spans of this worker's transfers: a JSON-lines file (``kvstream trace`` draws
            # it) and/or OTLP per the OTEL_* variables; the peer's spans join by traceparent.
            self._otel_close = otel.configure(f"vllm-{self._instance}", span_file=trace_file)
        self._layout, self._tp = layout, self._tp_share(layout)
        self._layer_of = layer_indices(kv_caches)
        self._runtime = rt = AgentRuntime(self._agent_config(), layout, layers,
                                          cache_scales=scales)
        self._pushes = PrefillPushes(rt, self._tp_rank, self._tp_size, layout, self._events)
        self._incoming = DecodePushes(rt)
        self._load = LoadReport(rt)
        rt.spawn(self._load.watch)
        rt.call(self._listen)
        if self._tp_rank == 0:
            self._bridge_kv_events()
        self._events("registered", instance=self._instance, layout=layout.describe(),
                     fingerprint=layout.fingerprint, tp_rank=self._tp.rank,
                     tp_size=self._tp.size, total_kv_heads=self._tp.total_kv_heads)
        log.info("kvstream agent %s registered %s", self._instance, layout.describe())

    def _listen(self) -> None:
        agent = self._rt().agent
        if agent is not None:
            agent.on_note(PUSH_TOPIC, self._on_note)

    def _on_note(self, sender: str, body: bytes) -> None:
        """A push's notes (push.py): "failed" here, a decode rank, hurries the fallback
        pull; "declined" goes to this rank's pushes (a prefill rank)."""
        note = decode_note(body)
        if note is None:
            return
        if note.state == "declined":
            if self._pushes is not None:
                self._pushes.on_note(sender, body)
        elif self._incoming is not None:
            self._incoming.on_failed(sender, note)

    def _bridge_kv_events(self) -> None:
        """vLLM's KV cache events (``--kv-events-config``, zmq publisher) onto this agent's
        KV event log, for KV-aware routers, watched (``kv_events.py``)."""
        from kvstream.adapters.vllm.kv_events import start_bridge

        self._kv_bridge = start_bridge(self._vllm_config, self._rt(), self._block_size,
                                       self._instance)

    def _rt(self) -> AgentRuntime:
        if self._runtime is None:
            raise AdapterError("KV caches not registered with KVStreamConnector")
        return self._runtime

    def start_load_kv(self, meta: KVStreamMetadata | None) -> None:
        if meta is None:
            return
        rt = self._runtime
        if rt is None:
            for rid, job in meta.pull.items():
                log.warning("kvstream load %s failed: no KV caches registered with the "
                            "connector; vLLM %s", rid, self._on_load_failure())
                self._results.put(("recv", rid, False, job.blocks[job.local:]))
            return
        for remote in meta.keep.values():
            for src in self._owned(remote):
                rt.spawn(self._keep, src, remote.request_id, remote.secret)
        for remote, reason in meta.release:
            for src in self._owned(remote):
                rt.spawn(functools.partial(self._release, push=remote.push), src,
                         remote.request_id, reason, remote.secret)
        for rid, job in meta.pull.items():
            self._pulls[rid] = None
            rt.spawn(self._pull, rid, job)
        for rid in meta.abort_pull:
            rt.spawn(self._abort_pull, rid)

    def before_forward(self, meta: KVStreamMetadata | None) -> None:
        """vLLM binds each step's metadata before the step's forward (``start_load_kv``
        may run after it: vLLM 0.32 starts async loads once the forward is launched): the
        step's pushes are offered here, so ``save_kv_layer`` sends each layer as the
        forward writes it, and the step counts as busy for the announced load."""
        self._step = []
        if self._load is not None:
            self._load.begin(meta.load if meta is not None else None)
        # noted at the step's end (wait_for_save), as vLLM publishes the step's events
        self._filled = meta.filled if meta is not None else 0
        if meta is None or self._runtime is None:
            return
        for rid, off in meta.offer.items():
            if not off.push_to:
                continue
            # Offered before the forward (not ready yet) and pushed as layers are saved; in
            # mode "pull", offered after it. Either way the decode rank, which expects the
            # push, hears at once when none will come.
            if not self._push_ok:
                self._no_push(off, "the prefill engine runs in mode 'pull'")
            elif self._make_offer(rid, off, ready=False):
                self._step.append(off.offer_id)
            else:
                self._no_push(off, "the prefill engine could not offer it")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """vLLM wrote ``layer_name``'s KV this step: the step's pushes may send it."""
        if not self._step or self._runtime is None or self._pushes is None:
            return
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            self._runtime.spawn(self._pushes.mark, list(self._step), layer, cuda_event(kv_layer))

    def _no_push(self, off: Offer, why: str) -> None:
        rt = self._rt()
        if rt.agent is not None:
            rt.spawn(send_note, rt.agent, ranks.instance(off.push_to, self._tp_rank, self._tp_size),
                     off.offer_id, "failed", why)

    def _make_offer(self, rid: str, off: Offer, *, ready: bool) -> bool:
        try:
            handle = self._rt().call(self._offer, rid, off, ready)
        except KVStreamError as exc:
            log.error("offer of %s failed: %s", rid, exc)
            self._results.put(("send", rid, False, []))
            return False
        self._offers[rid] = handle
        self._rt().spawn(self._watch_offer, rid, handle)
        return True

    def wait_for_save(self, meta: KVStreamMetadata | None) -> None:
        step, self._step = self._step, []
        if self._kv_bridge is not None and self._filled:
            self._kv_bridge.filled(self._filled, time.monotonic())
        self._filled = 0
        if self._load is not None:
            self._load.end()
        if meta is None or not (meta.offer or meta.abort_offer):
            return
        rt = self._rt()
        if meta.offer and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the forward wrote the blocks
        for rid, off in meta.offer.items():
            if off.push_to and self._push_ok:  # offered before the forward, pushed as it ran
                if off.offer_id in step:
                    rt.call(self._ready, rid, off.offer_id)
                continue
            self._make_offer(rid, off, ready=True)
        for rid in meta.abort_offer:
            offered = self._offers.get(rid)
            if offered is not None:
                rt.spawn(offered.abort, "the prefill request did not finish normally")
                if self._pushes is not None:
                    rt.call(self._pushes.abort, offered.request_id,
                            "the prefill request did not finish normally")

    # -- on the agent's loop --------------------------------------------------------------
    def _offer(self, rid: str, off: Offer, ready: bool) -> SendHandle:
        agent = self._rt().agent
        if agent is None:
            raise AdapterError("the connector's agent is not running (shut down?)")
        handle = agent.offer(off.offer_id, off.blocks, block_hashes=off.hashes, mode="eager",
                             lease_s=self._extra.get("lease_s"), secret=off.secret)
        if ready:
            handle.all_ready()
        elif self._pushes is not None:
            self._pushes.begin(rid, off, handle)
        self._events("offered", request_id=rid, blocks=len(off.blocks), instance=self._instance,
                     offer_id=off.offer_id, push_to=off.push_to if not ready else "")
        return handle

    def _ready(self, rid: str, offer_id: str) -> None:
        handle = self._offers.get(rid)
        if handle is not None:
            handle.all_ready()
        if self._pushes is not None:
            self._pushes.all_ready(offer_id)

    async def _watch_offer(self, rid: str, handle: SendHandle) -> None:
        res = await handle.result()
        # Served or deliberately dropped: routine (the decode side logs each load). Expired
        # or failed: a decode engine never took the KV, and the blocks sat held until now.
        level = logging.DEBUG if res.ok or res.status == "aborted" else logging.WARNING
        log.log(level, "kvstream offer %s %s%s: to=%s bytes=%d ms=%.1f codec=%s", rid, res.status,
                f" ({res.reason})" if res.reason else "", res.peer or "-", res.bytes,
                res.seconds * 1e3, res.codec)
        self._events("offer_ended", request_id=rid, status=res.status, reason=res.reason,
                     bytes=res.bytes, skipped=res.bytes_skipped, codec=res.codec)
        if self._pushes is not None:  # its push reads the same blocks
            await self._pushes.ended(handle.request_id)
        self._results.put(("send", rid, res.ok, []))

    # -- results, polled every step ----------------------------------------------------
    def _drain(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str], set[str]]:
        # Only ours, or the set grows with every request the engine serves.
        self._finished.update(r for r in finished_req_ids if r in self._offers or r in self._sent)
        recving: set[str] = set()
        failed: set[str] = set()
        while True:
            try:
                kind, rid, ok, blocks = self._results.get_nowait()
            except queue.Empty:
                break
            if kind == "send":
                self._sent.add(rid)
                self._offers.pop(rid, None)
                continue
            recving.add(rid)
            if not ok:
                failed.add(rid)
                self._load_errors.update(blocks)
        # vLLM frees a prefill's blocks only for requests it has finished.
        sending = self._sent & self._finished
        self._sent -= sending
        self._finished -= sending
        return sending, recving, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._drain(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._drain(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        bridge, self._kv_bridge = self._kv_bridge, None
        if bridge is not None:
            bridge.close()
        if self._runtime is not None:
            rt, self._runtime = self._runtime, None
            rt.close()
        close, self._otel_close = self._otel_close, None
        if close is not None:
            close()
