"""What both roles of ``KVStreamConnector`` share: settings, the per-step metadata, events."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvstream._exceptions import AdapterError, ConfigError
from kvstream.control.push_notes import PUSH_TOPIC

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise AdapterError("kvstream.adapters.vllm needs vLLM >= 0.32 (KVConnectorBase_V1 with "
                       f"the three-argument constructor): {exc}") from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["CPU_CONVERTS", "CPU_REFUSAL", "EVENTS_ENV", "PUSH_TOPIC", "KVStreamMetadata", "Offer",
           "PullJob", "Remote", "Side", "flat", "instance_id_ok", "push_request",
           "total_kv_heads", "use_vllm_logging"]

log = logging.getLogger("kvstream.adapters.vllm")

EVENTS_ENV = "KVSTREAM_VLLM_EVENTS"
REQUIRED = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
            "remote_port")
EXTRA_KEYS = frozenset({"nats_url", "namespace", "instance_id", "codec", "lease_s",
                        "peer_timeout_s", "transfer_timeout_s", "endpoint", "arrangement",
                        "mode", "host", "trace_file", "heartbeat_s", "request_timeout_s",
                        "staging_bytes", "nats_auth", "reservation_timeout_s",
                        "staging_wait_s"})
_PUSH_ID = re.compile(r"[A-Za-z0-9_-]{8,128}")
_INSTANCE = re.compile(r"[A-Za-z0-9_-]{1,128}")


def instance_id_ok(value: str) -> bool:
    """Whether a client-writable param can name a kvstream instance (a subject token)."""
    return bool(_INSTANCE.fullmatch(value))


def push_request(ours: Any) -> tuple[str, str, str] | None:
    """``(push_to, push_id, secret)`` when a prefill request's ``kv_transfer_params
    ["kvstream"]`` ask for a layer-pipelined push (the proxy wrote them), else None. A
    client may write these params: only well-formed ids pass, and the push goes only to an
    instance this engine's registry holds with an equal layout (the worker checks)."""
    if not isinstance(ours, dict):
        return None
    dst, pid, secret = ours.get("push_to"), ours.get("push_id"), ours.get("secret", "")
    if not (isinstance(dst, str) and _INSTANCE.fullmatch(dst) and isinstance(pid, str)
            and _PUSH_ID.fullmatch(pid) and isinstance(secret, str) and len(secret) <= 128):
        return None
    return dst, pid, secret


@dataclass(frozen=True)
class Remote:
    """Where a decode request's prompt KV is held, read from the prefill's kv_transfer_params."""

    instance: str           # the prefill engine's instance id (its TP ranks add "-tp<r>")
    request_id: str         # the request id its offers are under
    secret: str = ""        # the offers' secret (every prefill rank offers under one)
    tp_size: int = 1        # the prefill engine's tensor-parallel degree
    block_size: int = 0     # the prefill engine's block size
    device: str = ""        # where the prefill engine keeps its KV ("cpu", "cuda"; "": not said)
    push: bool = False      # the prefill pushes under ``request_id`` (the proxy's push id)
    by: str = ""            # the proxy that planned the push (its "failed" note counts too)


@dataclass(frozen=True)
class PullJob:
    """One decode request's load: the worker pulls the prompt's KV into ``blocks``."""

    remote: Remote
    blocks: list[int]       # every prompt block here, the local prefix-cache hits first
    have: list[int]         # kvstream hashes of those hits (an equal-layout source skips them)
    local: int              # how many of ``blocks`` the local prefix cache supplied
    codec: str              # on the wire ("none" between unequal layouts)
    tokens: int             # the prompt tokens the blocks are to hold


@dataclass(frozen=True)
class Offer:
    """One prefill request's hold: its prompt blocks, offered for a pull under ``offer_id``
    (the request's id, or the proxy's push id: then also pushed to ``push_to``)."""

    blocks: list[int]
    hashes: list[int]       # prefix hashes of its full blocks
    secret: str
    offer_id: str
    push_to: str = ""       # the decode engine's instance id ("": pull only)


@dataclass
class KVStreamMetadata(KVConnectorMetadata):
    """One step's decisions, scheduler to workers (pickled: plain data only)."""

    # prefill: request id -> its hold, made in the step that completes the prompt (before
    # that step's forward when it is pushed too: layers leave as vLLM saves them)
    offer: dict[str, Offer] = field(default_factory=dict)
    abort_offer: list[str] = field(default_factory=list)
    # decode: request id -> the prefill holds to keep alive while it waits for blocks
    keep: dict[str, Remote] = field(default_factory=dict)
    # decode: request id -> its load
    pull: dict[str, PullJob] = field(default_factory=dict)
    abort_pull: list[str] = field(default_factory=list)
    # decode: (holds, reason) to drop without pulling
    release: list[tuple[Remote, str]] = field(default_factory=list)
    # the engine's load for routers: (requests it holds, KV blocks in use), every step
    load: tuple[int, int] | None = None
    # blocks this step fills (each one a BlockStored event vLLM publishes): the bridge
    # expects its events (kv_events.py); 0 when vLLM publishes none
    filled: int = 0


# vLLM's CPU attention (0.32, "vec" ISA: float32/float16 on x86) keeps K transposed in
# each block and head, [head_dim, block_size], and V as [block_size, head_dim]; kvstream's
# cpu_hnbc arrangement reads exactly that (transfer/plan.py plane_views). Other ISAs (AMX
# for bfloat16, NEON) may pack blocks otherwise: a conversion to another block size is
# made only for the dtypes whose layout was probed. Verbatim blocks are exact either way.
CPU_CONVERTS: Final = frozenset({"float32", "float16"})
CPU_REFUSAL: Final = ("vLLM's CPU attention may pack a bfloat16 block otherwise than the "
                      "float32/float16 layout kvstream reads (probed on vLLM 0.32's x86 "
                      "kernels): converting it would scramble it")


class _ToVllmLogger(logging.Handler):
    """Hands each record to vLLM's ``vllm`` logger, which passes it to the handlers vLLM
    configured there *at that moment* (vLLM reconfigures logging per process, and a
    ``VLLM_LOGGING_CONFIG_PATH`` file or ``--logging-config.formatter json`` may replace
    its handler): the record comes out in vLLM's format, stream and handler level."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.handle(record)


def use_vllm_logging() -> None:
    """Make the ``kvstream`` loggers of this process log the way vLLM's do.

    vLLM (0.32, ``vllm/logger.py``) configures only its own ``vllm`` logger (a
    ``StreamHandler`` named "vllm", ``NewLineFormatter`` with process name, pid, level,
    time and file:line; ``propagate=False``), in each process before it builds the
    connector; ``init_logger`` configures nothing. Records of ``kvstream.*`` would reach
    only the root logger, which has no handler there: bare lines from ``lastResort``,
    warnings and errors only. So, unless vLLM configured no handler
    (``VLLM_CONFIGURE_LOGGING=0``: then whoever configured logging owns ours too) or
    someone gave ``kvstream`` handlers of its own, ``kvstream`` forwards to ``vllm``, does
    not propagate (no line twice if the root has a handler too), and takes vLLM's level
    unless its own is set. Idempotent (both roles may share a process).
    """
    theirs = logging.getLogger("vllm")
    ours = logging.getLogger("kvstream")
    if not theirs.handlers or ours.handlers:
        return
    ours.addHandler(_ToVllmLogger(theirs))
    ours.propagate = False
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


def sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", text)[:96] or "vllm"


def flat(block_ids: Any) -> list[int]:
    """vLLM passes per-group lists (HMA) or one flat list; P/D here has one group."""
    if isinstance(block_ids, (list, tuple)) and block_ids and isinstance(block_ids[0], (list, tuple)):
        if len(block_ids) != 1:
            raise AdapterError(f"{len(block_ids)} KV cache groups: kvstream moves one group "
                               "(no hybrid/sliding-window models yet)")
        return [int(b) for b in block_ids[0]]
    return [int(b) for b in (block_ids or ())]


def total_kv_heads(vllm_config: VllmConfig) -> int:
    """The model's KV head count over all TP ranks (0: unknown; rank-to-rank pairing with
    equal TP still works without it)."""
    mc = vllm_config.model_config
    try:
        return int(mc.get_total_num_kv_heads()) if mc is not None else 0
    except (AttributeError, TypeError, ValueError):  # no head count in this config
        return 0


class Events:
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



class Side:
    """Settings of one role, read once from vLLM's config (``kv_connector_extra_config``)."""

    def __init__(self, vllm_config: VllmConfig, role_name: str) -> None:
        self._vllm_config = vllm_config
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise AdapterError("KVStreamConnector needs vLLM's kv_transfer_config "
                               "(--kv-transfer-config)")
        self._kv_transfer_config = ktc
        self._extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        unknown = set(self._extra) - EXTRA_KEYS
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                              f"known: {sorted(EXTRA_KEYS)}")
        if self._extra.get("mode", "pull") not in ("pull", "push"):
            raise ConfigError("KVStreamConnector's mode is 'pull' (the default: the decode side "
                              "fetches) or 'push' (the prefill side also pushes when a "
                              "request's params name the decode engine)")
        self._push_ok = self._extra.get("mode", "pull") == "push"
        self._block_size = vllm_config.cache_config.block_size
        self._instance = self._extra.get("instance_id") or sanitize(f"vllm-{ktc.engine_id}")
        self._namespace = self._extra.get("namespace", "default")
        self._codec = self._extra.get("codec", "none")
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._total_kv_heads = total_kv_heads(vllm_config)
        device = getattr(vllm_config, "device_config", None)
        self._device = str(getattr(device, "device_type", "") or "")
        # Informational for NIXL-shaped routers; kvstream finds peers through NATS.
        self._host = str(self._extra.get("host") or socket.gethostname())
        self._events = Events(role_name)
