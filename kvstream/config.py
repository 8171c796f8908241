"""Agent configuration: one frozen struct, passed whole."""

from __future__ import annotations

import math
from typing import Final, Literal
from urllib.parse import urlsplit

import msgspec

from kvstream._exceptions import ConfigError
from kvstream.control.auth import NatsAuth
from kvstream.control.subjects import Subjects
from kvstream.transfer.plan import TpInfo

__all__ = ["PATHS", "PROGRESS_MODES", "AgentConfig", "check_endpoint", "check_timeout"]

# How the UCX worker makes progress (dataplane/ucx.py says why "thread" is the default).
PROGRESS_MODES: Final = ("thread", "blocking", "polling")
# Data-plane paths (dataplane/paths.py says what each is).
PATHS: Final = ("shm", "cuda_ipc", "tcp", "ucx")

MiB = 1 << 20


def check_timeout(seconds: float | None) -> float | None:
    """A per-transfer deadline: None (the agent's ``transfer_timeout_s``) or a positive,
    finite number of seconds (NaN or inf would never pass, so the transfer never ends)."""
    if seconds is not None and not (isinstance(seconds, int | float) and 0 < seconds < math.inf):
        raise ConfigError(f"timeout must be a positive number of seconds, got {seconds!r}")
    return seconds


def check_endpoint(url: str) -> str:
    """An engine's HTTP base URL: "" (none) or ``http(s)://host[:port][/prefix]``; the proxy
    appends the client's path (``/v1/completions``), so no trailing '/'."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or url.endswith("/") \
            or parts.query or parts.fragment:
        raise ConfigError(f"endpoint {url!r} must look like http://host:port (no trailing '/')")
    return url


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of one Agent. Times are seconds, sizes bytes."""

    instance_id: str
    role: Literal["prefill", "decode", "both"] = "both"
    namespace: str = "default"
    # None: use a NATS server already on the default URL, else start an embedded one.
    nats_url: str | None = None
    # Credentials and TLS for that server (control/auth.py; NatsAuth.from_env() reads them
    # from KVSTREAM_NATS_* variables).
    nats_auth: NatsAuth = NatsAuth()
    # "thread" (UCX progress thread + futures, no idle spin) is right for most hosts;
    # "blocking"/"polling" trade a busy event loop for slightly lower latency.
    progress_mode: str = "thread"
    # True on RDMA networks; False lets same-host peers use shared memory (PERF.md).
    ucx_error_handling: bool = False
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 2.0
    request_timeout_s: float = 2.0
    transfer_timeout_s: float = 60.0
    # How long an expect() reservation waits for the prefill side's manifest.
    reservation_timeout_s: float = 60.0
    # Bounded host/GPU staging: scattered layers in flight, and pushes that arrive before
    # their reservation (held whole until expect() claims them or reservation_timeout_s).
    staging_bytes: int = 256 * MiB
    # How long a sender keeps retrying a destination that answers "busy" (staging full).
    staging_wait_s: float = 5.0
    # Pushes nobody reserved for yet ("unsolicited": anyone with a key may send them) are
    # bounded apart from what this agent expects, so that strangers never take the staging
    # or the table room of reservations, pulls and pushes (docs/architecture.md, "Limits on
    # unsolicited pushes"). All of them together hold at most this share of staging_bytes
    # (the rest stays for expected transfers) ...
    unsolicited_staging_share: float = 0.5
    # ... and one sender at most this share (its first push may be larger, within the
    # share of all), so a single flooder is refused "busy", not everyone.
    unsolicited_sender_share: float = 0.125
    # They count apart from max_transfers, at most this share of it (at least 1); one
    # sender holds at most unsolicited_sender_share / unsolicited_staging_share of those.
    unsolicited_transfers_share: float = 0.25
    # How long an offer() is held for a pull without a renewal from the puller, which
    # renews every lease_s / 4 while it still wants the blocks.
    lease_s: float = 30.0
    # Layers in flight per transfer (each staged layer holds one staging buffer).
    max_inflight_layers: int = 8
    # A transfer of at most this many bytes between host memories goes eager and as one
    # data-plane frame: one header, one credit and one copy job per side, whatever the
    # layer count (per-layer streaming of a short prompt costs more than it hides).
    # Larger ones stream layer by layer. 0: always layer by layer. At most a quarter of
    # staging_bytes counts (a whole frame takes one staging slot of its size).
    whole_frame_bytes: int = 8 << 20
    max_transfers: int = 1024
    # Wire codec of push() and pull() unless the call names one ("none": bytes verbatim;
    # "int8" or "fp8_e4m3": half the bytes, dequantized here into the engine dtype; int8
    # is the more accurate of the two, docs/architecture.md).
    codec: str = "none"
    # Codecs this agent receives (a manifest with another one is refused).
    accept_codecs: tuple[str, ...] = ("none", "fp8_e4m3", "int8")
    # HTTP base URL of the engine's OpenAI server (e.g. "http://10.0.0.5:8100"), announced
    # so that ``kvstream proxy`` can route requests here; "" = not routable by the proxy.
    endpoint: str = ""
    # Data-plane paths this agent uses, in the destination's order of preference
    # (dataplane/paths.py): "shm" and "cuda_ipc" between processes of one host (one copy),
    # "tcp" between hosts without RDMA (kvstream's socket streams), "ucx" always.
    paths: tuple[str, ...] = ("shm", "cuda_ipc", "tcp", "ucx")
    # Where the TCP data path listens, "host:port" ("" = every interface, a free port, and
    # the address that reaches NATS advertised); "off" = no TCP data path.
    tcp_listen: str = ""
    tcp_lanes: int = 4  # connections per peer
    # This host's identity for same-host paths ("" = the boot id and PID namespace); set
    # one per instance to make peers on one machine act as if on two.
    host_id: str = ""
    # This instance's share of its engine's tensor parallelism (which KV heads its layout
    # holds); peers with other layouts or shares move KV through a plan (transfer/plan.py).
    tp: TpInfo = msgspec.field(default_factory=TpInfo)

    def __post_init__(self) -> None:
        Subjects.check_instance_id(self.instance_id)
        Subjects(self.namespace)
        if self.progress_mode not in PROGRESS_MODES:
            raise ConfigError(f"progress_mode must be one of {PROGRESS_MODES}")
        for name in ("heartbeat_s", "peer_timeout_s", "request_timeout_s", "transfer_timeout_s",
                     "reservation_timeout_s", "staging_wait_s", "lease_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:  # NaN too: a deadline that never passes
                raise ConfigError(f"{name} must be a positive, finite number of seconds")
        if self.peer_timeout_s < 2 * self.heartbeat_s:
            raise ConfigError("peer_timeout_s must be at least two heartbeats")
        from kvstream.quant.scheme import check_codec

        for codec in (self.codec, *self.accept_codecs):
            check_codec(codec)
        check_endpoint(self.endpoint)
        if "ucx" not in self.paths or set(self.paths) - set(PATHS):
            raise ConfigError(f"paths must be taken from {PATHS} and include 'ucx'")
        if self.tcp_listen not in ("", "off"):
            host, sep, port = self.tcp_listen.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
                raise ConfigError(f"tcp_listen must be 'host:port', '' or 'off', "
                                  f"got {self.tcp_listen!r}")
        if not 1 <= self.tcp_lanes <= 64:
            raise ConfigError("tcp_lanes must be between 1 and 64")
        if self.staging_bytes <= 0 or self.max_inflight_layers < 1 or self.max_transfers < 1:
            raise ConfigError("staging_bytes, max_inflight_layers and max_transfers must be positive")
        if self.whole_frame_bytes < 0:
            raise ConfigError("whole_frame_bytes must be 0 or more")
        for name in ("unsolicited_staging_share", "unsolicited_sender_share",
                     "unsolicited_transfers_share"):
            if not 0 < getattr(self, name) <= 1:  # NaN too
                raise ConfigError(f"{name} must be a fraction in (0, 1]")
        if self.unsolicited_sender_share > self.unsolicited_staging_share:
            raise ConfigError("unsolicited_sender_share cannot exceed unsolicited_staging_share")
