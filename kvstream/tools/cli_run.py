"""``kvstream sidecar``, ``kvstream proxy`` and ``kvstream router``: the long-running services.

Both run until SIGTERM or SIGINT. Registered on the group by ``kvstream.tools.cli``.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import click

from kvstream._exceptions import ConfigError
from kvstream.tools.cli_common import layout_from, log_to_stderr, nats_auth_options

if TYPE_CHECKING:
    from kvstream.control.auth import NatsAuth

__all__ = ["proxy", "router", "sidecar"]


def _configure_tracing(service: str, trace_file: str | None) -> Any:
    """The SDK for this process: OTLP when OTEL_* asks for it, and/or a span file."""
    from kvstream.tools.otel import configure, otlp_requested

    if not trace_file and not otlp_requested():
        return lambda: None
    return configure(service, span_file=trace_file)


@click.command()
@click.option("--instance-id", required=True, help="this engine's instance id (NATS-safe)")
@click.option("--role", type=click.Choice(["prefill", "decode", "both"]), default="both",
              show_default=True)
@click.option("--socket", "socket_path", required=True, help="Unix socket the engine connects to")
@click.option("--nats-url", help="NATS URL (default: one on 127.0.0.1:4222, embedded if none)")
@nats_auth_options
@click.option("--namespace", default="default", show_default=True)
@click.option("--ucx-tls", help="restrict UCX transports, e.g. 'tcp' or 'sm,self' (sets UCX_TLS)")
@click.option("--ucx-error-handling", is_flag=True,
              help="UCX endpoint error handling (RDMA fabrics; disables same-host shm)")
@click.option("--staging-bytes", type=click.IntRange(min=1), default=256 << 20, show_default=True)
@click.option("--max-inflight-layers", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-transfers", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--whole-frame-bytes", type=click.IntRange(min=0), default=8 << 20,
              show_default=True,
              help="transfers up to this size go eager, as one data-plane frame (0: never)")
@click.option("--model", help="refuse KV memory of any layout but this preset's")
@click.option("--tp-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="the engine's tensor-parallel rank (its layout holds this rank's KV heads)")
@click.option("--tp-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--total-kv-heads", type=click.IntRange(min=0), default=0,
              help="the model's KV heads (default: the layout's times --tp-size)")
@click.option("--endpoint", default="",
              help="the engine's OpenAI HTTP base URL, announced for `kvstream proxy`")
@click.option("--trace-file", type=click.Path(dir_okay=False),
              help="append this sidecar's spans (JSON lines) here; OTEL_* variables select OTLP")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info",
              show_default=True)
def sidecar(instance_id: str, role: str, socket_path: str, nats_url: str | None,
            nats_auth: NatsAuth, namespace: str,
            ucx_tls: str | None, ucx_error_handling: bool, staging_bytes: int,
            max_inflight_layers: int, max_transfers: int, whole_frame_bytes: int,
            model: str | None, tp_rank: int,
            tp_size: int, total_kv_heads: int, endpoint: str, log_level: str,
            trace_file: str | None) -> None:
    """Run an agent next to one engine, served over a Unix socket."""
    import os
    import signal

    import anyio
    import msgspec

    from kvstream.config import AgentConfig
    from kvstream.sidecar.server import Sidecar
    from kvstream.transfer.plan import TpInfo

    log_to_stderr(log_level)
    if tp_rank >= tp_size:
        raise click.BadParameter(f"rank {tp_rank} of TP {tp_size}", param_hint="--tp-rank")
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    layout = layout_from(model, None, None, None, 16, "float16")[2] if model else None
    if layout is not None and tp_size > 1:  # the preset is the whole model: this rank's share
        total_kv_heads = total_kv_heads or layout.num_kv_heads
        layout = msgspec.structs.replace(layout, num_kv_heads=max(1, total_kv_heads // tp_size))
    config = AgentConfig(instance_id=instance_id, role=role, namespace=namespace,  # type: ignore[arg-type]
                         nats_url=nats_url, nats_auth=nats_auth,
                         ucx_error_handling=ucx_error_handling,
                         staging_bytes=staging_bytes, max_inflight_layers=max_inflight_layers,
                         max_transfers=max_transfers, whole_frame_bytes=whole_frame_bytes,
                         endpoint=endpoint,
                         tp=TpInfo(rank=tp_rank, size=tp_size, total_kv_heads=total_kv_heads))
    server = Sidecar(config, socket_path, layout=layout)
    shutdown_tracing = _configure_tracing(f"kvstream-sidecar-{instance_id}", trace_file)

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    logging.getLogger("kvstream.sidecar").info(
                        "%s: aborting in-flight transfers and exiting", signal.Signals(signum).name)
                    tg.cancel_scope.cancel()
                    return

    try:
        anyio.run(run)
    finally:
        shutdown_tracing()


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--nats-url", help="NATS URL of the registry (default: nats://127.0.0.1:4222)")
@nats_auth_options
@click.option("--no-nats", is_flag=True,
              help="static --prefill/--decode URLs only: no discovery, no early release")
@click.option("--namespace", default="default", show_default=True)
@click.option("--prefill", "prefill_urls", multiple=True, metavar="URL",
              help="a prefill engine that does not announce itself (repeatable)")
@click.option("--decode", "decode_urls", multiple=True, metavar="URL",
              help="a decode engine that does not announce itself (repeatable)")
@click.option("--peer-timeout", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds without a heartbeat before an instance is not routed to")
@click.option("--timeout", type=click.FloatRange(min=1.0), default=600.0, show_default=True,
              help="seconds for the prefill leg, and the longest silence of the decode leg")
@click.option("--no-prefill", type=click.Choice(["decode", "reject"]), default="decode",
              show_default=True,
              help="no live prefill instance, or its engine cannot be reached: run the request "
                   "whole on a decode instance (decode), or answer 503 (reject)")
@click.option("--ready-decode-only", is_flag=True,
              help="/ready answers 200 with a decode instance alone (requests are then "
                   "served decode-only); by default readiness needs a prefill and a decode")
@click.option("--routing", type=click.Choice(["load", "kv"]), default="load", show_default=True,
              help="place the legs least-loaded here (load), or ask the routers of the "
                   "namespace (`kvstream router`), which weigh each engine's cached prefix "
                   "against its load (kv; least-loaded when none answers)")
@click.option("--transfer", type=click.Choice(["pull", "push"]), default="pull",
              show_default=True,
              help="pull: the prefill leg first, then the decode engine pulls its KV; push: "
                   "both legs at once, the prefill engine pushes each layer into the decode "
                   "engine as it computes it (equal engines in connector mode 'push'; others "
                   "pull)")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info",
              show_default=True)
def proxy(host: str, port: int, nats_url: str | None, nats_auth: NatsAuth, no_nats: bool,
          namespace: str,
          prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], peer_timeout: float,
          timeout: float, no_prefill: str, ready_decode_only: bool, routing: str,
          transfer: str, log_level: str) -> None:
    """OpenAI-compatible prefill/decode proxy over the registry.

    Engines are found in the kvstream registry on NATS (or given with --prefill and
    --decode).
    """
    import signal

    import anyio

    from kvstream.control.nats_server import DEFAULT_NATS_URL
    from kvstream.proxy import Proxy, ProxyConfig

    if no_nats and nats_url:
        raise ConfigError("--no-nats and --nats-url contradict each other")
    log_to_stderr(log_level)  # one record per line, never wrapped at a terminal's width
    config = ProxyConfig(host=host, port=port, namespace=namespace,
                         nats_url=None if no_nats else (nats_url or DEFAULT_NATS_URL),
                         nats_auth=nats_auth,
                         prefill=prefill_urls, decode=decode_urls, peer_timeout_s=peer_timeout,
                         prefill_timeout_s=timeout, decode_read_timeout_s=timeout,
                         no_prefill=no_prefill,  # type: ignore[arg-type]
                         ready_decode_only=ready_decode_only,
                         routing=routing,  # type: ignore[arg-type]
                         transfer=transfer)  # type: ignore[arg-type]

    async def run() -> None:
        async with Proxy(config) as server:
            click.echo(f"kvstream proxy {server.proxy_id} listening on {server.url}"
                       + ("" if no_nats else f" (registry {config.nats_url}, "
                          f"namespace {namespace})"))
            sys.stdout.flush()
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    return

    anyio.run(run)



@click.command()
@click.option("--nats-url", help="NATS URL (default: nats://127.0.0.1:4222); needs JetStream")
@nats_auth_options
@click.option("--namespace", default="default", show_default=True)
@click.option("--router-id", default="", help="this router's id (default: router-<8 hex>)")
@click.option("--peer-timeout", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds without a heartbeat before an instance is not routed to")
@click.option("--prefill-load-weight", type=click.FloatRange(min=0.0), default=0.5,
              show_default=True,
              help="cost = blocks to compute + weight * requests in flight * prompt blocks")
@click.option("--decode-load-weight", type=click.FloatRange(min=0.0), default=0.5,
              show_default=True, help="the same for the decode leg (blocks to receive)")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info",
              show_default=True)
def router(nats_url: str | None, nats_auth: NatsAuth, namespace: str, router_id: str,
           peer_timeout: float, prefill_load_weight: float, decode_load_weight: float,
           log_level: str) -> None:
    """KV-aware router for `kvstream proxy --routing kv`.

    Follows every instance's KV events (kept in JetStream, so a router that starts late
    or restarts rebuilds its view) and serves `kvstream proxy --routing kv` in a NATS
    queue group: run as many as you like side by side.
    """
    import signal

    import anyio

    from kvstream.control.nats_server import DEFAULT_NATS_URL
    from kvstream.routing.service import Router, RouterConfig

    log_to_stderr(log_level)
    config = RouterConfig(nats_url=nats_url or DEFAULT_NATS_URL, nats_auth=nats_auth,
                          namespace=namespace, router_id=router_id,
                          peer_timeout_s=peer_timeout,
                          prefill_load_weight=prefill_load_weight,
                          decode_load_weight=decode_load_weight)

    async def run() -> None:
        async with Router(config) as server:
            click.echo(f"kvstream router {server.router_id} serving {server.subjects.route} "
                       f"({config.nats_url})")
            sys.stdout.flush()
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    return

    anyio.run(run)
