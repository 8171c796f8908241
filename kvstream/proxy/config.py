"""The proxy's settings and statistics, and the bodies of its two legs (no aiohttp here).

The legs are vLLM's toy P/D proxy's (see ``kvstream.proxy``): the P leg asks the prefill
engine to keep the KV for a remote decode, the D leg carries what it answered.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from kvstream._exceptions import ConfigError
from kvstream.control.auth import NatsAuth
from kvstream.control.nats_server import DEFAULT_NATS_URL
from kvstream.control.subjects import Subjects

__all__ = ["PREFILL_PARAMS", "ROUTE_HEADER", "Mode", "NoPrefill", "ProxyConfig", "ProxyStatistics",
           "Routing",
           "decode_body", "decode_only_body", "prefill_body"]

# What the P leg asks of the prefill engine: keep the KV for a remote decode (vLLM's keys).
PREFILL_PARAMS: Final = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_request_id": None, "remote_host": None,
    "remote_port": None,
}
# Dropped from the P leg: streaming options, and minimums a one-token prefill cannot meet.
_NOT_FOR_PREFILL: Final = ("stream_options", "min_tokens", "min_completion_tokens")
# Which response header says how a completion was served.
ROUTE_HEADER: Final = "X-KVStream-Route"
NoPrefill = Literal["decode", "reject"]
# How legs are placed: "load" (least loaded, by the proxy itself), "kv" (the routers' queue
# group weighs each candidate's cached prefix against its load; least loaded if none answers).
Routing = Literal["load", "kv"]
# How the KV moves: "pull" (the P leg first; the decode engine pulls what it returned),
# "push" (both legs at once; the prefill pushes each layer into the decode as it computes:
# kvstream.proxy.push; pull between engines that cannot take a push).
Transfer = Literal["pull", "push"]
# How the proxy serves requests now (``/ready``, ``/health``): both legs, the decode leg
# alone (no live prefill instance), or not at all (no decode instance, or "reject").
Mode = Literal["prefill-decode", "decode-only", "unavailable"]


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of one proxy. Times are seconds."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (``Proxy.url`` says which)
    # The registry's NATS; None: static instances only, and no early release of offers.
    nats_url: str | None = DEFAULT_NATS_URL
    nats_auth: NatsAuth = NatsAuth()  # credentials and TLS for it (control/auth.py)
    namespace: str = "default"
    prefill: tuple[str, ...] = ()  # static engine URLs, for engines that do not announce
    decode: tuple[str, ...] = ()
    proxy_id: str = ""  # "" -> "proxy-<8 hex>"; names the sender of its aborts
    peer_timeout_s: float = 2.0  # an instance silent this long is not routed to
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 600.0  # the whole P leg (a long prompt's prefill)
    decode_read_timeout_s: float = 600.0  # longest silence of the D leg (first token included)
    abort_timeout_s: float = 2.0  # how long a release waits for the prefill side's ack
    max_body_bytes: int = 64 << 20  # client request bodies (token-id prompts can be large)
    # No live prefill instance, or the P leg could not reach its engine: "decode" sends the
    # request whole to a decode instance (it prefills itself), "reject" answers 503 (502).
    no_prefill: NoPrefill = "decode"
    # Readiness (``/ready``, ``/health``'s "ready") means a prefill and a decode instance are
    # live; True: a decode instance alone is ready too (decode-only serving is acceptable).
    ready_decode_only: bool = False
    routing: Routing = "load"
    route_timeout_s: float = 0.5  # a router's answer (then: least loaded)
    transfer: Transfer = "pull"

    def __post_init__(self) -> None:
        Subjects(self.namespace)
        if self.no_prefill not in ("decode", "reject"):
            raise ConfigError(f"no_prefill must be 'decode' or 'reject', not {self.no_prefill!r}")
        if self.routing not in ("load", "kv"):
            raise ConfigError(f"routing must be 'load' or 'kv', not {self.routing!r}")
        if self.transfer not in ("pull", "push"):
            raise ConfigError(f"transfer must be 'pull' or 'push', not {self.transfer!r}")
        if self.transfer == "push" and self.nats_url is None:
            raise ConfigError("transfer 'push' reads the engines' layouts from the registry: "
                              "it needs a NATS URL")
        if self.routing == "kv" and self.nats_url is None:
            raise ConfigError("routing 'kv' asks the routers on NATS: it needs a NATS URL")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is not a TCP port")
        if self.proxy_id:
            Subjects.check_instance_id(self.proxy_id)
            if len(self.proxy_id) > 128:  # engines take at most that from the push params
                raise ConfigError(f"proxy_id is at most 128 characters, not "
                                  f"{len(self.proxy_id)}")
        for name in ("peer_timeout_s", "connect_timeout_s", "prefill_timeout_s",
                     "decode_read_timeout_s", "abort_timeout_s", "route_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.nats_url is None and not (self.prefill and self.decode):
            raise ConfigError("without NATS the proxy needs static --prefill and --decode URLs")


class ProxyStatistics(msgspec.Struct, frozen=True, kw_only=True):
    requests: int  # completion requests received
    prefill_errors: int  # P legs that failed (502, or decode-only if the engine was unreachable)
    decode_errors: int  # D legs that failed (before or while streaming)
    offers_released: int  # prefill offers dropped early on a D failure (acknowledged)
    inflight: dict[str, int]  # legs in flight per engine URL
    decode_only: int = 0  # requests sent whole to a decode instance (no usable prefill)
    # routing "kv": requests a router placed, those placed least-loaded instead (no router
    # answered, no tokens), and per leg the prompt blocks and those the chosen engine held
    kv_routed: int = 0
    kv_fallbacks: int = 0
    prompt_blocks: dict[str, int] = {}
    hit_blocks: dict[str, int] = {}
    # transfer "push": requests sent to both legs at once, those pulled instead (the two
    # engines are not equal, or one does not announce every rank), and pushes whose
    # prefill leg failed (the decode ranks were told: they recompute)
    pushed: int = 0
    push_declined: int = 0
    push_failed: int = 0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The P leg's body: one token, no streaming, KV kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The D leg's body: the client's, plus what the prefill engine returned (if anything)."""
    out = dict(body)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def decode_only_body(body: dict[str, Any]) -> dict[str, Any]:
    """A decode-only request's body: the client's, minus ``kv_transfer_params`` (those are
    the proxy's business; a client's could make the engine wait for KV nobody holds)."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}

