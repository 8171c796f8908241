"""``KVStreamConnector``: vLLM's KV connector (V1 API) on kvstream, pull mode.

Load it with ``--kv-transfer-config '{"kv_connector": "KVStreamConnector",
"kv_connector_module_path": "kvstream.adapters.vllm", "kv_role": "kv_producer" |
"kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}'``.

vLLM builds two instances that share nothing: the scheduler role (engine-core process)
decides, the worker role (each worker process) moves bytes; decisions reach workers only
through the pickled ``KVStreamMetadata`` of each step. The flow (docs/design/vllm-adapter.md):

* prefill (request with ``do_remote_decode``): the step that completes the prompt
  ``offer()``s its blocks from ``wait_for_save`` (after the forward wrote them), so the hold
  exists before ``request_finished`` hands out the ``kv_transfer_params``; the blocks go
  back to vLLM (``finished_sending``) when the pull completes, is aborted, or the lease
  expires;
* decode (request with ``do_remote_prefill``): keeps the prefill's lease alive while the
  request queues, then ``pull()``s the whole prompt into the blocks vLLM allocated, minus
  the blocks its own prefix cache already had (``have``); a pull that fails is reported in
  ``failed_recving`` with its blocks as load errors, so vLLM recomputes (with
  ``kv_load_failure_policy="recompute"``) instead of decoding garbage.

The scheduler role opens no connection; the worker role starts one ``Agent`` per worker
process on first ``register_kv_caches``. ``kv_transfer_params`` use NIXL's keys, so proxies
and routers written for ``NixlConnector`` work unchanged.

``kv_connector_extra_config`` keys: ``nats_url`` (default: the local server, embedded if
none), ``namespace``, ``instance_id`` (default ``vllm-<engine_id>``), ``codec`` ("none" or
"fp8_e4m3", asked for by the decode side; a request's ``kv_transfer_params["kvstream"]
["codec"]`` overrides it), ``lease_s``, ``peer_timeout_s``,
``transfer_timeout_s``, ``endpoint`` (the engine's HTTP URL, announced for ``kvstream
proxy``), ``arrangement`` (override the KV layout detection), ``mode`` ("pull"; push to
staging is not offered for vLLM yet).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvstream import otel
from kvstream._exceptions import AdapterError, ConfigError, KVStreamError
from kvstream.config import AgentConfig
from kvstream.layout import KVLayout
from kvstream.prefix import block_hashes

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise AdapterError("kvstream.adapters.vllm needs vLLM >= 0.32 (KVConnectorBase_V1 with "
                       f"the three-argument constructor): {exc}") from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvstream.adapters.runtime import AgentRuntime
    from kvstream.handles import ReceiveHandle, SendHandle
    from kvstream.transfer import TransferResult

__all__ = ["KVStreamConnector", "KVStreamMetadata", "layout_of_vllm_caches"]

log = logging.getLogger("kvstream.adapters.vllm")

EVENTS_ENV = "KVSTREAM_VLLM_EVENTS"
_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
             "remote_port")
_EXTRA_KEYS = frozenset({"nats_url", "namespace", "instance_id", "codec", "lease_s",
                         "peer_timeout_s", "transfer_timeout_s", "endpoint", "arrangement",
                         "mode", "host", "trace_file", "heartbeat_s", "request_timeout_s", "staging_bytes"})


@dataclass
class KVStreamMetadata(KVConnectorMetadata):
    """One step's decisions, scheduler to workers (pickled: plain data only)."""

    # prefill: request id -> (block ids, prefix hashes of its full blocks)
    offer: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    abort_offer: list[str] = field(default_factory=list)
    # decode: request id -> (source instance, its request id)
    keep: dict[str, tuple[str, str]] = field(default_factory=dict)
    # decode: request id -> (source, its request id, local blocks, have hashes, local hits,
    # wire codec)
    pull: dict[str, tuple[str, str, list[int], list[int], int, str]] = field(default_factory=dict)
    abort_pull: list[str] = field(default_factory=list)
    # decode: (source, its request id) holds to drop without pulling
    release: list[tuple[str, str, str]] = field(default_factory=list)


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", text)[:96] or "vllm"


def _flat(block_ids: Any) -> list[int]:
    """vLLM passes per-group lists (HMA) or one flat list; P/D here has one group."""
    if isinstance(block_ids, (list, tuple)) and block_ids and isinstance(block_ids[0], (list, tuple)):
        if len(block_ids) != 1:
            raise AdapterError(f"{len(block_ids)} KV cache groups: kvstream moves one group "
                               "(no hybrid/sliding-window models yet)")
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in (block_ids or ())]


class _Events:
    """JSON lines of connector decisions, for tests and debugging (``KVSTREAM_VLLM_EVENTS``)."""

    def __init__(self, role: str) -> None:
        self.path = os.environ.get(EVENTS_ENV, "")
        self.role = role
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"t": time.time(), "role": self.role, "pid": os.getpid(),
                           "event": event, **fields}) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)


def layout_of_vllm_caches(kv_caches: dict[str, torch.Tensor], *,
                          arrangement: str | None = None) -> tuple[KVLayout, list[torch.Tensor]]:
    """The kvstream layout of vLLM's per-layer KV tensors, and the tensors in layer order.

    vLLM 0.32 hands the CPU backend ``[num_blocks, num_kv_heads, block_size, 2*head_dim]``
    per layer (per block and head: block_size K rows, then block_size V rows); FlashAttention
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. Layers sharing one tensor (KV
    sharing) are registered once. Anything else needs an explicit ``arrangement``.
    """
    if not kv_caches:
        raise AdapterError("vLLM registered no KV cache tensors")

    def order(name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", name)) or (0,)

    layers: list[torch.Tensor] = []
    seen: set[int] = set()
    for name in sorted(kv_caches, key=lambda n: (order(n), n)):
        t = kv_caches[name]
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if not t.is_contiguous():
            raise AdapterError(f"KV cache of {name} is not contiguous (shape {tuple(t.shape)}, "
                               f"stride {t.stride()}): use a layer-outermost KV layout")
        layers.append(t)
    first = layers[0]
    shape = tuple(first.shape)
    if any(tuple(t.shape) != shape or t.dtype != first.dtype for t in layers):
        raise AdapterError("vLLM's KV layers differ in shape or dtype (hybrid models are not "
                           "supported yet)")
    dtype = str(first.dtype).removeprefix("torch.")
    if arrangement is None:
        if len(shape) == 4 and first.device.type == "cpu":
            arrangement = "cpu_hnbc"
        elif len(shape) == 5 and shape[0] == 2:
            arrangement = "flash_nhd"
        else:
            raise AdapterError(f"unknown vLLM KV layout {shape} on {first.device}; set "
                               "kv_connector_extra_config.arrangement")
    if arrangement == "cpu_hnbc":
        _, h, bs, d2 = shape
        d = d2 // 2
    elif arrangement == "flash_nhd":
        _, _, bs, h, d = shape
    elif arrangement == "flash_hnd":
        _, _, h, bs, d = shape
    else:
        raise AdapterError(f"arrangement {arrangement!r} is not supported for vLLM")
    layout = KVLayout(num_layers=len(layers), num_kv_heads=h, head_dim=d, block_size=bs,
                      dtype=dtype, arrangement=arrangement)
    return layout, layers


class KVStreamConnector(KVConnectorBase_V1):
    """vLLM KV connector moving KV over kvstream (NATS control plane, UCX data plane)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self._extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        unknown = set(self._extra) - _EXTRA_KEYS
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                              f"known: {sorted(_EXTRA_KEYS)}")
        if self._extra.get("mode", "pull") != "pull":
            raise ConfigError("KVStreamConnector supports mode 'pull' only (the prefill side "
                              "holds, the decode side fetches)")
        self._block_size = vllm_config.cache_config.block_size
        self._instance = self._extra.get("instance_id") or _sanitize(f"vllm-{ktc.engine_id}")
        self._namespace = self._extra.get("namespace", "default")
        self._codec = self._extra.get("codec", "none")
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        # Informational for NIXL-shaped routers; kvstream finds peers through NATS.
        self._host = str(self._extra.get("host") or socket.gethostname())
        self._events = _Events("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        # -- scheduler role ------------------------------------------------------------
        self._meta = KVStreamMetadata()
        self._producing: dict[str, Request] = {}   # prefill: awaiting the prompt's last chunk
        self._offered: set[str] = set()            # prefill: offered, blocks owned until sent
        self._kept: dict[str, tuple[str, str]] = {}     # decode: lease kept, not yet allocated
        self._loading: dict[str, tuple[str, str]] = {}  # decode: pull asked for, not finished
        # -- worker role -----------------------------------------------------------------
        self._runtime: AgentRuntime | None = None
        self._results: queue.SimpleQueue[tuple[str, str, bool, list[int]]] = queue.SimpleQueue()
        self._sent: set[str] = set()          # offers ended, waiting for vLLM to finish the request
        self._finished: set[str] = set()      # requests vLLM said finished
        self._load_errors: set[int] = set()
        self._pulls: dict[str, ReceiveHandle | None] = {}  # on the agent's loop only
        self._cancelled: set[str] = set()
        self._offers: dict[str, SendHandle] = {}
        self._otel_close: Callable[[], None] | None = None
        if role == KVConnectorRole.WORKER and self._tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._instance = f"{self._instance}-tp{get_tensor_model_parallel_rank()}"

    # ================================ scheduler role ================================
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Layer-outermost, block-contiguous per layer: both ends register one tensor per layer.
        return "LBHNC" if vllm_config.model_config is not None and \
            not vllm_config.model_config.use_mla else None

    def _remote(self, params: dict[str, Any]) -> tuple[str, str] | None:
        """(source instance, its request id) of complete prefill params, else None."""
        if any(params.get(k) is None for k in _REQUIRED):
            log.warning("incomplete kv_transfer_params (need %s): %s", ", ".join(_REQUIRED), params)
            return None
        ours = params.get("kvstream")
        if isinstance(ours, dict) and ours.get("block_size", self._block_size) != self._block_size:
            log.warning("prefill block_size %s != %s here: recomputing instead",
                        ours.get("block_size"), self._block_size)
            return None
        return str(params["remote_engine_id"]), str(params["remote_request_id"])

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or self._remote(params) is None:
            return 0, False
        # The whole prompt: vLLM itself recomputes the last token after the load.
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and (remote := self._remote(params)):
            # Keep the prefill's hold alive while this request waits for blocks.
            self._kept[request.request_id] = remote
            self._meta.keep[request.request_id] = remote
            self._events("keep_scheduled", request_id=request.request_id, src=remote[0],
                         remote_request_id=remote[1])

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if params.get("do_remote_decode"):
            self._producing[rid] = request
            return
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if called twice
        params["_remote_blocks_processed"] = True
        self._kept.pop(rid, None)
        remote = self._remote(params)
        if remote is None:
            return
        if num_external_tokens <= 0:  # the local prefix cache had everything
            self._meta.release.append((*remote, "the decode side had the prompt cached"))
            return
        prompt = list(request.prompt_token_ids or ())
        nblocks = math.ceil(len(prompt) / self._block_size)
        group = blocks.blocks[0] if blocks.blocks else []
        local = sum(1 for b in group[:nblocks] if b.block_hash is not None and not b.is_null)
        ids = _flat(blocks.get_block_ids())[:nblocks]
        have = block_hashes(prompt, self._block_size)[:local]
        ours = params.get("kvstream")
        codec = str(ours.get("codec") or self._codec) if isinstance(ours, dict) else self._codec
        self._meta.pull[rid] = (*remote, ids, have, local, codec)
        self._loading[rid] = remote
        self._events("pull_scheduled", request_id=rid, src=remote[0], remote_request_id=remote[1],
                     external_tokens=num_external_tokens, local_blocks=local, blocks=len(ids))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens or {}
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        for rid, req in list(self._producing.items()):
            n = scheduled.get(rid)
            if n is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue  # not scheduled, or a chunk short of the prompt's end
            ids = state.get_block_ids(rid) if state is not None else None
            if ids is None and self._kv_cache_manager is not None:
                ids = self._kv_cache_manager.get_block_ids(rid)
            if ids is None:
                log.warning("no block table for %s: it will not be offered", rid)
                del self._producing[rid]
                continue
            prompt = list(req.prompt_token_ids or ())
            nblocks = math.ceil(len(prompt) / self._block_size)
            self._meta.offer[rid] = (_flat(ids)[:nblocks], block_hashes(prompt, self._block_size))
            self._offered.add(rid)
            del self._producing[rid]
        meta, self._meta = self._meta, KVStreamMetadata()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.pop(rid, None)
        for rid in connector_output.finished_sending or ():
            self._offered.discard(rid)

    def request_finished(self, request: Request,
                         block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params or {}
        self._producing.pop(rid, None)
        # decode side
        kept = self._kept.pop(rid, None)
        if kept is not None:  # finished (aborted) before its blocks were allocated
            self._meta.release.append((*kept, "the decode request ended before loading"))
            params["do_remote_prefill"] = False
        elif params.get("do_remote_prefill") and (remote := self._remote(params)):
            self._meta.release.append((*remote, "the decode request ended before loading"))
            params["do_remote_prefill"] = False
        if rid in self._loading:  # vLLM keeps the blocks until finished_recving
            self._meta.abort_pull.append(rid)
            return False, None
        # prefill side
        if rid not in self._offered:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            self._meta.abort_offer.append(rid)
            return True, None
        blocks = _flat(block_ids)[:math.ceil(request.num_prompt_tokens / self._block_size)]
        pc = self._vllm_config.parallel_config
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._instance,
            "remote_request_id": rid,
            "remote_block_ids": [blocks],
            "remote_host": self._host,
            "remote_port": self._kv_transfer_config.kv_port,
            "tp_size": pc.tensor_parallel_size,
            "pp_size": pc.pipeline_parallel_size,
            "remote_num_tokens": request.num_prompt_tokens,
            "transfer_mode": "pull",
            "kvstream": {"instance": self._instance, "namespace": self._namespace,
                         "block_size": self._block_size, "blocks": len(blocks)},
        }
        self._events("offer_returned", request_id=rid, blocks=len(blocks))
        return True, out

    def has_pending_block_frees(self) -> bool:
        return bool(self._offered)

    # ================================= worker role ==================================
    def _agent_config(self) -> AgentConfig:
        ex = self._extra
        kw: dict[str, Any] = {k: ex[k] for k in ("lease_s", "peer_timeout_s", "transfer_timeout_s",
                                                 "heartbeat_s", "request_timeout_s",
                                                 "staging_bytes", "endpoint") if k in ex}
        role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(
            self._kv_transfer_config.kv_role or "", "both")
        try:
            return AgentConfig(instance_id=self._instance, role=role,  # type: ignore[arg-type]
                               namespace=self._namespace, nats_url=ex.get("nats_url"),
                               codec=self._codec, **kw)
        except TypeError as exc:
            raise ConfigError(f"bad kv_connector_extra_config: {exc}") from exc

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvstream.adapters.runtime import AgentRuntime

        if self._runtime is not None:
            raise AdapterError("register_kv_caches called twice")
        layout, layers = layout_of_vllm_caches(kv_caches, arrangement=self._extra.get("arrangement"))
        trace_file = self._extra.get("trace_file")
        if trace_file or otel.otlp_requested():
            # Spans of this worker's transfers: a JSON-lines file (``kvstream trace`` draws
            # it) and/or OTLP per the OTEL_* variables; the peer's spans join by traceparent.
            self._otel_close = otel.configure(f"vllm-{self._instance}", span_file=trace_file)
        self._runtime = AgentRuntime(self._agent_config(), layout, layers)
        self._events("registered", instance=self._instance, layout=layout.describe(),
                     fingerprint=layout.fingerprint)
        log.info("kvstream agent %s registered %s", self._instance, layout.describe())

    def _rt(self) -> AgentRuntime:
        if self._runtime is None:
            raise AdapterError("KV caches not registered with KVStreamConnector")
        return self._runtime

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStreamMetadata)
        rt = self._runtime
        if rt is None:
            for rid, job in meta.pull.items():
                self._results.put(("recv", rid, False, job[2][job[4]:]))
            return
        for src, rrid in meta.keep.values():
            rt.spawn(self._keep, self._src(src), rrid)
        for src, rrid, reason in meta.release:
            rt.spawn(self._release, self._src(src), rrid, reason)
        for rid, job in meta.pull.items():
            self._pulls[rid] = None
            rt.spawn(self._pull, rid, self._src(job[0]), *job[1:])
        for rid in meta.abort_pull:
            rt.spawn(self._abort_pull, rid)

    def _src(self, src: str) -> str:
        """D rank r pulls from P rank r (equal tensor parallelism on both sides)."""
        return f"{src}-tp{self._instance.rsplit('-tp', 1)[1]}" if self._tp_size > 1 else src

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # pulls finish before vLLM schedules the request (async loading)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # pull mode: offered once the step's forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStreamMetadata)
        if not (meta.offer or meta.abort_offer):
            return
        rt = self._rt()
        if meta.offer and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the forward wrote the blocks
        for rid, (blocks, hashes) in meta.offer.items():
            try:
                handle = rt.call(self._offer, rid, blocks, hashes)
            except KVStreamError as exc:
                log.error("offer of %s failed: %s", rid, exc)
                self._results.put(("send", rid, False, []))
                continue
            self._offers[rid] = handle
            rt.spawn(self._watch_offer, rid, handle)
        for rid in meta.abort_offer:
            handle = self._offers.get(rid)
            if handle is not None:
                rt.spawn(handle.abort, "the prefill request did not finish normally")

    # -- on the agent's loop --------------------------------------------------------------
    def _offer(self, rid: str, blocks: list[int], hashes: list[int]) -> SendHandle:
        agent = self._rt().agent
        assert agent is not None
        handle = agent.offer(rid, blocks, block_hashes=hashes, mode="eager",
                             lease_s=self._extra.get("lease_s"))
        handle.all_ready()
        self._events("offered", request_id=rid, blocks=len(blocks), instance=self._instance)
        return handle

    async def _watch_offer(self, rid: str, handle: SendHandle) -> None:
        res = await handle.result()
        self._events("offer_ended", request_id=rid, status=res.status, reason=res.reason,
                     bytes=res.bytes, skipped=res.bytes_skipped, codec=res.codec)
        self._results.put(("send", rid, res.ok, []))

    async def _keep(self, src: str, rrid: str) -> None:
        agent = self._runtime.agent if self._runtime else None
        if agent is None:
            return
        try:
            await agent.keep(rrid, src)
        except KVStreamError as exc:
            log.warning("keeping %s at %s failed (the pull will report it): %s", rrid, src, exc)

    async def _release(self, src: str, rrid: str, reason: str) -> None:
        agent = self._runtime.agent if self._runtime else None
        if agent is None:
            return
        lease = agent._wanted.get((src, rrid))
        from kvstream.leases import RemoteLease

        if isinstance(lease, RemoteLease):
            await lease.release(reason)
        else:
            await agent._request_abort(src, "", reason, request_id=rrid)
        self._events("released", src=src, remote_request_id=rrid, reason=reason)

    async def _pull(self, rid: str, src: str, rrid: str, blocks: list[int], have: list[int],
                    local: int, codec: str) -> None:
        agent = self._runtime.agent if self._runtime else None
        res: TransferResult | None = None
        why = ""
        try:
            if agent is None:
                raise AdapterError("agent closed")
            handle = await agent.pull(rrid, src, blocks, mode="eager", have=have, codec=codec)
            self._pulls[rid] = handle
            if rid in self._cancelled:
                await handle.abort("the decode request ended")
            res = await handle.result()
            why = res.reason
        except KVStreamError as exc:
            why = f"{type(exc).__name__}: {exc}"
        finally:
            self._pulls.pop(rid, None)
            cancelled = rid in self._cancelled
            self._cancelled.discard(rid)
        ok = res is not None and res.ok
        if cancelled:
            log.info("pull of %s from %s aborted: the decode request ended", rrid, src)
        elif not ok:
            log.warning("pull of %s from %s failed (%s): vLLM recomputes it", rrid, src, why)
        self._events("pull_ended", request_id=rid, src=src, remote_request_id=rrid, ok=ok,
                     reason=why, bytes=res.bytes if res else 0,
                     skipped=res.bytes_skipped if res else 0, codec=res.codec if res else "",
                     seconds=res.seconds if res else 0.0, blocks=len(blocks), local_blocks=local)
        self._results.put(("recv", rid, ok, blocks[local:]))

    async def _abort_pull(self, rid: str) -> None:
        if rid not in self._pulls:
            return
        self._cancelled.add(rid)
        handle = self._pulls.get(rid)
        if handle is not None:
            await handle.abort("the decode request ended")

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving, failed = self._drain(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._runtime is not None:
            rt, self._runtime = self._runtime, None
            rt.close()
        close, self._otel_close = self._otel_close, None
        if close is not None:
            close()
