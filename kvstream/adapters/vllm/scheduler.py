"""The scheduler role of ``KVStreamConnector`` (vLLM's engine-core process): decides, per
step, which blocks the worker offers (prefill) or pulls into (decode). No connection: it
only knows its worker's instance id, which goes out in ``remote_engine_id``.

The prefill and decode engines may differ in block size and TP degree (the params say
the prefill's: ``kvstream.block_size``, ``tp_size``): the decode side counts its blocks
with its own block size and asks for the prompt's tokens; the engine converts between
the layouts (``Agent.pull(..., tokens=)``) and each decode rank pulls from the prefill
ranks holding its heads (``ranks.py``). Between unequal layouts the engine moves whole
prompts, so a decode-side prefix-cache hit declines the load (see ``_refusal``).
"""

from __future__ import annotations

import logging
import math
import secrets
from typing import TYPE_CHECKING, Any

from kvstream.adapters.vllm import ranks
from kvstream.adapters.vllm.common import (
    REQUIRED,
    KVStreamMetadata,
    Offer,
    PullJob,
    Remote,
    Side,
    flat,
    instance_id_ok,
    log,
    push_request,
)
from kvstream.adapters.vllm.kv_events import events_expected
from kvstream.prefix import block_hashes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["MAX_TP", "SchedulerSide", "blocks_filled"]

MAX_TP = 1024  # prefill TP degrees a request's params may name


class SchedulerSide(Side):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config, "scheduler")
        self._kv_cache_manager: KVCacheManager | None = None
        self._meta = KVStreamMetadata()
        self._producing: dict[str, Request] = {}   # prefill: awaiting the prompt's last chunk
        # prefill: offered, blocks owned until sent; the offer's id and secret, for the params
        self._offered: dict[str, tuple[str, str]] = {}
        self._kept: dict[str, Remote] = {}     # decode: lease kept, not allocated
        self._loading: dict[str, Remote] = {}  # decode: pull asked, not finished
        self._declined: dict[str, str] = {}    # decode: not loaded, and why (logged once)
        self._warned: set[str] = set()         # configuration warnings given (once each)
        # Requests vLLM holds (added, not finished): with the blocks in use, the load each
        # rank announces for KV-aware routers (``Agent.report_load``).
        self._live: set[str] = set()
        self._events_expected = events_expected(vllm_config)

    def _remote(self, params: dict[str, Any]) -> Remote | None:
        """Where complete prefill params say the prompt's KV is held, else None."""
        if any(params.get(k) is None for k in REQUIRED):
            shown = {k: v for k, v in params.items() if k != "kvstream"}  # it holds the secret
            log.warning("incomplete kv_transfer_params (need %s): %s", ", ".join(REQUIRED), shown)
            return None
        ours = params.get("kvstream")
        ours = ours if isinstance(ours, dict) else {}
        # Params without them (NIXL-shaped, from elsewhere) mean an engine like this one.
        block_size = ours.get("block_size", self._block_size)
        tp_size = params.get("tp_size", self._tp_size)
        # Bounded: a client may write kv_transfer_params, and the rank arithmetic, the keeps
        # and the releases all count prefill ranks.
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= limit
                   for v, limit in ((block_size, 1 << 16), (tp_size, MAX_TP))):
            log.warning("kv_transfer_params with block_size %r and tp_size %r: recomputing "
                        "instead", block_size, tp_size)
            return None
        secret, device = ours.get("secret", ""), ours.get("device", "")
        # Decode-first (the proxy sent both legs at once): the prefill pushes into the blocks
        # allocated here, under the proxy's push id, and offers it too for a pull if not.
        push = params.get("transfer_mode") == "push" and ours.get("push") is True
        by = ours.get("by", "")
        return Remote(instance=str(params["remote_engine_id"]),
                      request_id=str(params["remote_request_id"]),
                      secret=secret if isinstance(secret, str) else "",
                      tp_size=tp_size, block_size=block_size,
                      device=device if isinstance(device, str) else "", push=push,
                      by=by if push and isinstance(by, str) and instance_id_ok(by) else "")

    def _unequal(self, remote: Remote) -> str:
        """How the prefill's KV blocks differ from this engine's, as its params tell ("": not)."""
        diff = []
        if remote.block_size != self._block_size:
            diff.append(f"block size {remote.block_size} -> {self._block_size}")
        if remote.tp_size != self._tp_size:
            diff.append(f"TP {remote.tp_size} -> {self._tp_size}")
        return ", ".join(diff)

    def _refusal(self, remote: Remote, local_tokens: int) -> tuple[str, bool] | None:
        """Why this request's prompt is not loaded from ``remote``, and whether that is the
        deployment's (every request from such a prefill engine), or None: it is loaded."""
        if remote.tp_size != self._tp_size:
            if self._total_kv_heads <= 0:
                return (f"prefill TP {remote.tp_size}, decode TP {self._tp_size}, and the "
                        "model's KV head count is unknown"), True
            why = ranks.refusal(remote.tp_size, self._tp_size, self._total_kv_heads)
            if why is not None:
                return why, True
        unequal = self._unequal(remote)
        if unequal and remote.push:
            # The proxy pushes only between equal engines (it reads their announcements):
            # params that say otherwise were written by someone else.
            return f"a push between unequal engines ({unequal})", True
        if unequal and local_tokens > 0:
            # Between unequal layouts the engine converts whole prompts from token 0 (it
            # skips no `have` blocks when it converts), so loading would rewrite the
            # blocks this engine's prefix cache supplied. Those are shared with other
            # running requests and stay cached under their hashes: rewriting them with a
            # transfer's values (a float rounding apart from theirs at best, another
            # prompt's KV if the params are wrong, half-written if the pull fails) could
            # change other requests' tokens and poison the cache. Computing the uncached
            # rest here costs compute, never correctness.
            return (f"this engine's prefix cache holds {local_tokens} of the prompt's tokens, "
                    f"and between unequal layouts ({unequal}) kvstream moves whole prompts: "
                    "the load would rewrite blocks other requests share"), False
        return None

    def _decline(self, rid: str, remote: Remote, why: str, deployment: bool) -> None:
        if rid in self._declined:
            return
        self._declined[rid] = why
        # What every request from such a prefill engine meets is the deployment's problem:
        # one WARNING per kind, then INFO per request (each still says why).
        key = f"{remote.block_size} {remote.tp_size} {remote.device}"
        level = logging.WARNING if deployment and key not in self._warned else logging.INFO
        if deployment:
            self._warned.add(key)
        log.log(level, "kvstream load %s from %s (request %s) declined: %s; vLLM computes the "
                "prompt here", rid, remote.instance, remote.request_id, why)
        self._events("load_declined", request_id=rid, src=remote.instance,
                     remote_request_id=remote.request_id, reason=why)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote = self._remote(params)
        if remote is None:
            return 0, False
        refused = self._refusal(remote, num_computed_tokens)
        if refused is not None:  # update_state_after_alloc releases the prefill's hold
            self._decline(request.request_id, remote, *refused)
            return 0, False
        prompt_len = len(request.prompt_token_ids or ())
        if prompt_len - 1 <= num_computed_tokens:
            # vLLM recomputes a prompt's last token whatever was loaded (it samples the first
            # new token from it), so this load would bring nothing vLLM keeps.
            self._decline(request.request_id, remote, "nothing to load: vLLM computes the "
                          "prompt's last token itself and holds the rest", False)
            return 0, False
        self._declined.pop(request.request_id, None)  # asked again, now without local hits
        # The whole prompt: vLLM itself recomputes the last token after the load.
        return prompt_len - num_computed_tokens, True

    def on_new_request(self, request: Request) -> None:
        self._live.add(request.request_id)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and (remote := self._remote(params)) \
                and not remote.push:  # a push's offer is made when the prefill computes it
            # Keep the prefill's hold alive while this request waits for blocks.
            self._kept[request.request_id] = remote
            self._meta.keep[request.request_id] = remote
            self._events("keep_scheduled", request_id=request.request_id, src=remote.instance,
                         remote_request_id=remote.request_id)

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
        declined = self._declined.pop(rid, None)
        remote = self._remote(params)
        if remote is None:
            return
        if num_external_tokens <= 0:  # the local prefix cache had everything, or declined
            self._meta.release.append(
                (remote, f"the decode side declined the load: {declined}" if declined
                 else "the decode side had the prompt cached"))
            return
        prompt = list(request.prompt_token_ids or ())
        # Counted in this engine's blocks; the prefill offered ceil(len / its block size)
        # of its own, and both hold len(prompt) tokens: the engine checks that they agree.
        nblocks = math.ceil(len(prompt) / self._block_size)
        group = blocks.blocks[0] if blocks.blocks else []
        local = sum(1 for b in group[:nblocks] if b.block_hash is not None and not b.is_null)
        ids = flat(blocks.get_block_ids())[:nblocks]
        # The tokens the blocks are to hold: the prompt's across block sizes; whole blocks
        # when they agree (only the heads differ, TP): then every block's bytes of a head
        # land as they lay, whatever a backend keeps inside a block (vLLM's CPU attention
        # keeps K transposed), and the slots past the prompt are vLLM's to overwrite.
        same_blocks = remote.block_size == self._block_size
        tokens = nblocks * self._block_size if same_blocks else len(prompt)
        have = block_hashes(prompt, self._block_size)[:local]
        ours = params.get("kvstream")
        codec = str(ours.get("codec") or self._codec) if isinstance(ours, dict) else self._codec
        unequal = self._unequal(remote)
        if unequal and codec != "none":
            # The engine converts layouts in the source's dtype only (no codec with a
            # reshape): verbatim beats recomputing.
            if f"codec {unequal}" not in self._warned:
                self._warned.add(f"codec {unequal}")
                log.warning("codec %r is not applied between unequal layouts (%s): loading "
                            "the KV verbatim", codec, unequal)
            codec = "none"
        self._meta.pull[rid] = PullJob(remote=remote, blocks=ids, have=have, local=local,
                                       codec=codec, tokens=tokens)
        self._loading[rid] = remote
        self._events("pull_scheduled", request_id=rid, src=remote.instance,
                     remote_request_id=remote.request_id, external_tokens=num_external_tokens,
                     local_blocks=local, blocks=len(ids), tokens=tokens, unequal=unequal)

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
            # decode that was handed them can pull (the router passes them along). A push
            # (the proxy sent the decode leg at once, naming its engine): the offer is under
            # the proxy's push id and secret, which the decode engine was given, so it can
            # pull if the push fails.
            push = push_request((req.kv_transfer_params or {}).get("kvstream"))
            secret = push[2] if push else secrets.token_urlsafe(16)
            self._meta.offer[rid] = Offer(
                blocks=flat(ids)[:nblocks], hashes=block_hashes(prompt, self._block_size),
                secret=secret, offer_id=push[1] if push else rid,
                push_to=push[0] if push else "")
            self._offered[rid] = (push[1] if push else rid, secret)
            del self._producing[rid]
        self._meta.load = (len(self._live), self._blocks_in_use())
        if self._events_expected:
            self._meta.filled = blocks_filled(scheduler_output, self._block_size)
        meta, self._meta = self._meta, KVStreamMetadata()
        return meta

    def _blocks_in_use(self) -> int:
        """vLLM's KV blocks not free (held by requests; cached blocks nobody holds are
        free to vLLM; its null block is never free), 0 when its block pool does not say."""
        pool = getattr(self._kv_cache_manager, "block_pool", None)
        try:
            total = int(pool.num_gpu_blocks) - 1  # type: ignore[union-attr]  # the null block
            return max(0, total - int(pool.get_num_free_blocks()))  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError):
            return 0

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
        self._live.discard(rid)
        self._producing.pop(rid, None)
        # decode side
        self._declined.pop(rid, None)
        kept = self._kept.pop(rid, None)
        if kept is not None:  # finished (aborted) before its blocks were allocated
            self._meta.release.append((kept, "the decode request ended before loading"))
            params["do_remote_prefill"] = False
        elif params.get("do_remote_prefill") and (remote := self._remote(params)):
            self._meta.release.append((remote, "the decode request ended before loading"))
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
        offer_id, secret = self._offered[rid]
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._instance,
            "remote_request_id": offer_id,
            "remote_block_ids": [blocks],
            "remote_host": self._host,
            "remote_port": self._kv_transfer_config.kv_port,
            "tp_size": pc.tensor_parallel_size,
            "pp_size": pc.pipeline_parallel_size,
            "remote_num_tokens": request.num_prompt_tokens,
            "transfer_mode": "pull",
            "kvstream": {"instance": self._instance, "namespace": self._namespace,
                         "block_size": self._block_size, "blocks": len(blocks),
                         "device": self._device,
                         "secret": secret},
        }
        self._events("offer_returned", request_id=rid, blocks=len(blocks))
        return True, out

    def has_pending_block_frees(self) -> bool:
        return bool(self._offered)


def blocks_filled(scheduler_output: SchedulerOutput, block_size: int) -> int:
    """The blocks this step's scheduled tokens complete (vLLM's prefix cache stores each)."""
    scheduled = scheduler_output.num_scheduled_tokens or {}
    computed: dict[str, int] = {r.req_id: r.num_computed_tokens
                                for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    return sum((c + scheduled.get(rid, 0)) // block_size - c // block_size
               for rid, c in computed.items())
