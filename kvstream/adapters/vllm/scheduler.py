"""The scheduler role of ``KVStreamConnector`` (vLLM's engine-core process): decides, per
step, which blocks the worker offers (prefill) or pulls into (decode). No connection: it
only knows its worker's instance id, which goes out in ``remote_engine_id``."""

from __future__ import annotations

import math
import secrets
from typing import TYPE_CHECKING, Any

from kvstream.adapters.vllm.common import REQUIRED, KVStreamMetadata, Side, flat, log
from kvstream.prefix import block_hashes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]


class SchedulerSide(Side):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config, "scheduler")
        self._kv_cache_manager: KVCacheManager | None = None
        self._meta = KVStreamMetadata()
        self._producing: dict[str, Request] = {}   # prefill: awaiting the prompt's last chunk
        # prefill: offered, blocks owned until sent; the offer's secret, for the params
        self._offered: dict[str, str] = {}
        self._kept: dict[str, tuple[str, str, str]] = {}  # decode: lease kept, not allocated
        self._loading: dict[str, tuple[str, str, str]] = {}  # decode: pull asked, not finished

    def _remote(self, params: dict[str, Any]) -> tuple[str, str, str] | None:
        """(source instance, its request id, the offer's secret) of complete prefill params,
        else None."""
        if any(params.get(k) is None for k in REQUIRED):
            shown = {k: v for k, v in params.items() if k != "kvstream"}  # it holds the secret
            log.warning("incomplete kv_transfer_params (need %s): %s", ", ".join(REQUIRED), shown)
            return None
        ours = params.get("kvstream")
        if isinstance(ours, dict) and ours.get("block_size", self._block_size) != self._block_size:
            log.warning("prefill block_size %s != %s here: recomputing instead",
                        ours.get("block_size"), self._block_size)
            return None
        secret = ours.get("secret", "") if isinstance(ours, dict) else ""
        return (str(params["remote_engine_id"]), str(params["remote_request_id"]),
                secret if isinstance(secret, str) else "")

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
            self._meta.release.append((*remote[:2], "the decode side had the prompt cached",
                                       remote[2]))
            return
        prompt = list(request.prompt_token_ids or ())
        nblocks = math.ceil(len(prompt) / self._block_size)
        group = blocks.blocks[0] if blocks.blocks else []
        local = sum(1 for b in group[:nblocks] if b.block_hash is not None and not b.is_null)
        ids = flat(blocks.get_block_ids())[:nblocks]
        have = block_hashes(prompt, self._block_size)[:local]
        ours = params.get("kvstream")
        codec = str(ours.get("codec") or self._codec) if isinstance(ours, dict) else self._codec
        self._meta.pull[rid] = (remote[0], remote[1], ids, have, local, codec, remote[2])
        self._loading[rid] = remote
        self._events("pull_scheduled", request_id=rid, src=remote[0], remote_request_id=remote[1],
                     external_tokens=num_external_tokens, local_blocks=local, blocks=len(ids))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStreamMetadata:
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
            # Every rank offers under one secret; it goes out in the params, and only a
            # decode that was handed them can pull (the router passes them along).
            secret = secrets.token_urlsafe(16)
            self._meta.offer[rid] = (flat(ids)[:nblocks], block_hashes(prompt, self._block_size),
                                     secret)
            self._offered[rid] = secret
            del self._producing[rid]
        meta, self._meta = self._meta, KVStreamMetadata()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.pop(rid, None)
        for rid in connector_output.finished_sending or ():
            self._offered.pop(rid, None)

    def request_finished(self, request: Request,
                         block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        params = request.kv_transfer_params or {}
        self._producing.pop(rid, None)
        # decode side
        kept = self._kept.pop(rid, None)
        if kept is not None:  # finished (aborted) before its blocks were allocated
            self._meta.release.append((*kept[:2], "the decode request ended before loading",
                                       kept[2]))
            params["do_remote_prefill"] = False
        elif params.get("do_remote_prefill") and (remote := self._remote(params)):
            self._meta.release.append((*remote[:2], "the decode request ended before loading",
                                       remote[2]))
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
        blocks = flat(block_ids)[:math.ceil(request.num_prompt_tokens / self._block_size)]
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
                         "block_size": self._block_size, "blocks": len(blocks),
                         "secret": self._offered.get(rid, "")},
        }
        self._events("offer_returned", request_id=rid, blocks=len(blocks))
        return True, out

    def has_pending_block_frees(self) -> bool:
        return bool(self._offered)
