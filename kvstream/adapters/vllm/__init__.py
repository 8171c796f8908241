"""``KVStreamConnector``: vLLM's KV connector (V1 API) on kvstream: pull, or push.

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
* unequal engines: the prefill may use another block size or TP degree (its params say
  which). Each decode rank pulls from the prefill rank(s) holding its KV heads (several:
  one gather; one shared by several decode ranks: a reader of its offer; ``ranks.py``)
  and the engine converts the blocks (``tokens=``). Declined, visibly, with the prefill's
  hold released and the prompt computed here: decode TP above prefill TP but not a
  multiple of it, a decode-side prefix hit between unequal
  layouts (the engine would rewrite shared cached blocks), a conversion of vLLM CPU
  attention's blocks in bfloat16 (their layout there was not probed: ``common.CPU_CONVERTS``).

The scheduler role opens no connection; the worker role starts one ``Agent`` per worker
process on first ``register_kv_caches``. ``kv_transfer_params`` use NIXL's keys, so proxies
and routers written for ``NixlConnector`` work unchanged.

``kv_connector_extra_config`` keys: ``nats_url`` (default: the local server, embedded if
none), ``nats_auth`` (NATS credentials and TLS: a mapping of ``kvstream.NatsAuth`` fields,
e.g. ``{"creds": "/etc/kvstream/prefill.creds", "tls_ca": "/etc/ssl/nats-ca.pem"}``; unset
fields come from ``KVSTREAM_NATS_*`` variables), ``namespace``, ``instance_id`` (default
``vllm-<engine_id>``), ``codec`` ("none",
"int8" or "fp8_e4m3", asked for by the decode side; a request's ``kv_transfer_params["kvstream"]
["codec"]`` overrides it), ``lease_s``, ``peer_timeout_s``,
``transfer_timeout_s``, ``endpoint`` (the engine's HTTP URL, announced for ``kvstream
proxy``), ``arrangement`` (override the KV layout detection), ``mode`` ("pull", the
default; "push": the prefill engine also pushes a request layer by layer when its params
name the decode engine, as ``kvstream proxy --transfer push`` does: ``push.py``),
``reservation_timeout_s`` (the longest a decode rank waits for a push), ``staging_bytes``
and ``staging_wait_s`` (a push that arrives before its blocks are allocated).

Logging: kvstream's loggers come out through vLLM's handler, in its format
(``use_vllm_logging``). The decode side logs one INFO line per completed load and one
WARNING per failed one; the prefill side one WARNING per offer nobody pulled (expired,
failed), DEBUG for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstream._exceptions import AdapterError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise AdapterError("kvstream.adapters.vllm needs vLLM >= 0.32 (KVConnectorBase_V1 with "
                       f"the three-argument constructor): {exc}") from exc

from kvstream.adapters.vllm.caches import layout_of_vllm_caches
from kvstream.adapters.vllm.common import EVENTS_ENV, KVStreamMetadata, use_vllm_logging
from kvstream.adapters.vllm.scheduler import SchedulerSide
from kvstream.adapters.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["EVENTS_ENV", "KVStreamConnector", "KVStreamMetadata", "layout_of_vllm_caches"]


class KVStreamConnector(KVConnectorBase_V1):
    """vLLM KV connector moving KV over kvstream; each role delegates to its side."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        use_vllm_logging()  # vLLM has configured this process's logging by now
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(vllm_config)
        else:
            self._worker = WorkerSide(vllm_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Layer-outermost, block-contiguous per layer: both ends register one tensor per layer.
        mc = vllm_config.model_config
        return "LBHNC" if mc is not None and not mc.use_mla else None

    # -- scheduler role ------------------------------------------------------------------
    def _s(self) -> SchedulerSide:
        if self._sched is None:
            raise AdapterError("a scheduler-role method of KVStreamConnector was called on a "
                               "worker-role connector")
        return self._sched

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s()._kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self._s().on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStreamMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._s().update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def has_pending_block_frees(self) -> bool:
        return self._sched is not None and self._sched.has_pending_block_frees()

    # -- worker role ---------------------------------------------------------------------
    def _w(self) -> WorkerSide:
        if self._worker is None:
            raise AdapterError("a worker-role method of KVStreamConnector was called on a "
                               "scheduler-role connector")
        return self._worker

    def _meta(self) -> KVStreamMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStreamMetadata):
            raise AdapterError(f"connector metadata is a {type(meta).__name__}, not "
                               "KVStreamMetadata: another connector's scheduler built it")
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Before every forward, in both of vLLM 0.32's model runners (start_load_kv is not).
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.before_forward(self._meta())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._w().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # pulls finish before vLLM schedules the request (async loading)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Pulls are offered once the step's forward is done (wait_for_save); pushes send
        # each layer as it is saved (push.py).
        self._w().save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._w().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._w().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self._w().get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
