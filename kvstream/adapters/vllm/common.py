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
from typing import TYPE_CHECKING, Any

from kvstream._exceptions import AdapterError, ConfigError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise AdapterError("kvstream.adapters.vllm needs vLLM >= 0.32 (KVConnectorBase_V1 with "
                       f"the three-argument constructor): {exc}") from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["EVENTS_ENV", "KVStreamMetadata", "Side", "flat", "use_vllm_logging"]

log = logging.getLogger("kvstream.adapters.vllm")

EVENTS_ENV = "KVSTREAM_VLLM_EVENTS"
REQUIRED = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
            "remote_port")
EXTRA_KEYS = frozenset({"nats_url", "namespace", "instance_id", "codec", "lease_s",
                        "peer_timeout_s", "transfer_timeout_s", "endpoint", "arrangement",
                        "mode", "host", "trace_file", "heartbeat_s", "request_timeout_s",
                        "staging_bytes", "nats_auth"})


@dataclass
class KVStreamMetadata(KVConnectorMetadata):
    """One step's decisions, scheduler to workers (pickled: plain data only)."""

    # prefill: request id -> (block ids, prefix hashes of its full blocks, offer secret)
    offer: dict[str, tuple[list[int], list[int], str]] = field(default_factory=dict)
    abort_offer: list[str] = field(default_factory=list)
    # decode: request id -> (source instance, its request id, the offer's secret)
    keep: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    # decode: request id -> (source, its request id, local blocks, have hashes, local hits,
    # wire codec, the offer's secret)
    pull: dict[str, tuple[str, str, list[int], list[int], int, str, str]] = field(
        default_factory=dict)
    abort_pull: list[str] = field(default_factory=list)
    # decode: (source, its request id, reason, secret) holds to drop without pulling
    release: list[tuple[str, str, str, str]] = field(default_factory=list)


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
        if self._extra.get("mode", "pull") != "pull":
            raise ConfigError("KVStreamConnector supports mode 'pull' only (the prefill side "
                              "holds, the decode side fetches)")
        self._block_size = vllm_config.cache_config.block_size
        self._instance = self._extra.get("instance_id") or sanitize(f"vllm-{ktc.engine_id}")
        self._namespace = self._extra.get("namespace", "default")
        self._codec = self._extra.get("codec", "none")
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        # Informational for NIXL-shaped routers; kvstream finds peers through NATS.
        self._host = str(self._extra.get("host") or socket.gethostname())
        self._events = Events(role_name)
