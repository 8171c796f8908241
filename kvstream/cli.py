"""The ``kvstream`` command line (click): plan, nats, bench, demo, doctor, sidecar, proxy.

Argument errors and kvstream errors print one line and exit 2 / 1; no tracebacks.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click
import msgspec

from kvstream._exceptions import ConfigError, KVStreamError
from kvstream.quant.scheme import CODECS

__all__ = ["LOG_FORMAT", "OneLineFormatter", "app", "main"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OneLineFormatter(logging.Formatter):
    """One record, one line: a log file or collector reads records by line, so the line
    breaks of a message or a traceback are written as ``\\n``."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "").replace("\n", "\\n")


def _log_to_stderr(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])



@click.group(name="kvstream", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvstream")
def app() -> None:
    """KV-cache streaming for prefill/decode-disaggregated LLM serving."""


def _layout_from(model: str | None, layers: int | None, kv_heads: int | None,
                 head_dim: int | None, block_size: int, dtype: str) -> tuple[str, Any, Any]:
    from kvstream.layout import KVLayout
    from kvstream.presets import ModelSpec, get_model

    if model is not None:
        spec = get_model(model)
        spec = msgspec.structs.replace(
            spec, num_layers=layers or spec.num_layers,
            num_kv_heads=kv_heads or spec.num_kv_heads, head_dim=head_dim or spec.head_dim)
        return spec.name, spec, spec.layout(dtype=dtype, block_size=block_size)
    if not (layers and kv_heads and head_dim):
        raise ConfigError("give --model NAME, or all of --layers, --kv-heads and --head-dim")
    layout = KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype)
    return "custom", ModelSpec(name="custom", num_layers=layers, num_kv_heads=kv_heads,
                               head_dim=head_dim, hidden_size=0, params=0.0), layout


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@app.command()
@click.option("--model", help="model preset (see --list)")
@click.option("--tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="prompt tokens")
@click.option("--layers", type=click.IntRange(min=1), help="explicit: number of layers")
@click.option("--kv-heads", type=click.IntRange(min=1), help="explicit: KV heads")
@click.option("--head-dim", type=click.IntRange(min=1), help="explicit: head dimension")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--link", help="link preset (see --list)")
@click.option("--bandwidth", type=float, help="link bandwidth, GB/s (overrides the preset's)")
@click.option("--rtt-us", type=float, help="round-trip time, microseconds")
@click.option("--codec", type=click.Choice(["fp16", "bf16", "fp8", "int8"]), default="fp16",
              show_default=True)
@click.option("--prefill-ms", type=float, help="measured prefill time, ms")
@click.option("--gpu", default="h100", show_default=True, help="GPU preset to estimate prefill")
@click.option("--mfu", type=float, default=0.5, show_default=True,
              help="model FLOPs utilisation of the estimate")
@click.option("--first-decode-ms", type=float, help="first decode step, ms")
@click.option("--qps", type=float, help="peak requests per second")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--list", "list_presets", is_flag=True, help="list presets and exit")
def plan(
    model: str | None, tokens: int, layers: int | None, kv_heads: int | None,
    head_dim: int | None, block_size: int, link: str | None, bandwidth: float | None,
    rtt_us: float | None, codec: str, prefill_ms: float | None, gpu: str, mfu: float,
    first_decode_ms: float | None, qps: float | None, as_json: bool, list_presets: bool,
) -> None:
    """What moving one prompt's KV costs; does disaggregation pay?"""
    from kvstream.planner import estimate_decode_step_s, estimate_prefill_s, plan_transfer
    from kvstream.presets import GPUS, LINKS, MODELS, get_gpu, get_link

    if list_presets:
        for name, mspec in MODELS.items():
            lay = mspec.layout()
            click.echo(f"model {name:13s} {lay.kv_bytes_per_token:>9,} B/token  {lay.describe()}"
                       + (f"  [{mspec.note}]" if mspec.note else ""))
        for name, ln in LINKS.items():
            click.echo(f"link  {name:13s} {ln.gbytes_per_s:>7.2f} GB/s  RTT {ln.rtt_us:g} us"
                       f"  ({ln.note})")
        for name, g in GPUS.items():
            click.echo(f"gpu   {name:13s} {g.tflops_bf16:>7.0f} TFLOP/s bf16  "
                       f"{g.hbm_tbytes_per_s} TB/s HBM")
        return
    name, mspec, layout = _layout_from(model, layers, kv_heads, head_dim, block_size, "float16")
    if link is not None:
        ln = get_link(link)
        link_name, bw, rtt = ln.name, bandwidth or ln.gbytes_per_s, ln.rtt_us
        if rtt_us is not None:
            rtt = rtt_us
    elif bandwidth is not None:
        link_name, bw, rtt = f"{bandwidth:g} GB/s", bandwidth, rtt_us or 0.0
    else:
        raise ConfigError("give --link NAME or --bandwidth GB/s")
    g = get_gpu(gpu)
    if prefill_ms is not None:
        prefill_s, source = prefill_ms / 1e3, "given"
    elif mspec.params:
        prefill_s = estimate_prefill_s(mspec, tokens, g, mfu)
        source = f"estimated: {g.name} at {mfu:.0%} MFU"
    else:
        raise ConfigError("a custom model needs --prefill-ms (no parameter count to estimate from)")
    if first_decode_ms is not None:
        decode_s = first_decode_ms / 1e3
    else:
        decode_s = estimate_decode_step_s(mspec, g) if mspec.params else 0.0
    p = plan_transfer(model_name=name, layout=layout, prompt_tokens=tokens, codec=codec,
                      link_name=link_name, bandwidth_gbytes_per_s=bw, rtt_us=rtt,
                      prefill_s=prefill_s, prefill_source=source, first_decode_s=decode_s,
                      qps=qps)
    if as_json:
        out = msgspec.to_builtins(p)
        out["layout"]["fingerprint"] = layout.fingerprint
        click.echo(json.dumps(out))
        return
    rows = [
        ("model", f"{p.model} ({layout.describe()})"),
        ("KV per token", f"{p.kv_bytes_per_token:,} B ({_human_bytes(p.kv_bytes_per_token)})"),
        ("request", f"{p.prompt_tokens:,} tokens, codec {p.codec}: {p.request_bytes:,} B "
                    f"({_human_bytes(p.request_bytes)})"),
        ("link", f"{p.link}: {p.bandwidth_gbytes_per_s:g} GB/s, RTT {p.rtt_us:g} us"),
        ("transfer", f"{p.transfer_ms:.3f} ms"),
        ("prefill", f"{p.prefill_ms:.2f} ms ({p.prefill_source})"),
        ("first decode", f"{p.first_decode_ms:.2f} ms"),
        ("share of TTFT", f"{p.share_of_ttft:.1%} -> {p.verdict}"),
    ]
    if p.required_gbytes_per_s is not None:
        rows.append(("peak load", f"{p.qps:g} req/s needs {p.required_gbytes_per_s:.2f} GB/s "
                                  f"({p.required_gbits_per_s:.1f} Gb/s) of link"))
    for key, val in rows:
        click.echo(f"{key:<14} {val}")


@app.command()
@click.option("--port", type=click.IntRange(1, 65535), default=4222, show_default=True,
              help="loopback port")
def nats(port: int) -> None:
    """Run an embedded nats-server (JetStream, loopback).

    Prints its URL and runs until interrupted.
    """
    import signal
    import threading

    from kvstream.control.nats_server import EmbeddedNats

    server = EmbeddedNats(port=port).start()
    click.echo(server.url, err=False)
    sys.stdout.flush()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5) and server.running:
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def _bench_spec(model: str | None, layers: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: str, tokens: int, contiguous: bool, prefix_hit: float = 0.0) -> Any:
    from kvstream.bench.synthetic import BenchSpec
    from kvstream.layout import KVLayout

    if model is not None:
        _, _, layout = _layout_from(model, None, None, None, block_size, dtype)
    else:
        layout = KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                          block_size=block_size, dtype=dtype)
    if tokens <= 0:
        raise ConfigError("--tokens must be positive")
    return BenchSpec(layout=layout, tokens=tokens, scattered=not contiguous,
                     prefix_hit=prefix_hit)


@app.command()
@click.option("--model", help="model preset for the layout (overrides the dimensions)")
@click.option("--layers", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--head-dim", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]),
              default="float16", show_default=True)
@click.option("--tokens", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True,
              help="timed rounds; the best of each side is reported")
@click.option("--layer-compute-ms", type=click.FloatRange(min=0),
              help="simulated prefill compute per layer; reports exposed time pipelined vs eager")
@click.option("--contiguous", is_flag=True, help="block ids in one run instead of scattered")
@click.option("--sidecar", is_flag=True,
              help="also run with the agents in sidecar processes (engines in two more)")
@click.option("--mode", "modes", multiple=True,
              type=click.Choice(["push-pipelined", "push-eager", "pull-eager", "pull-lazy"]),
              help="transfer mode(s) to measure, each reported apart (repeatable)")
@click.option("--prefix-hit", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="share of the prompt's blocks already at the destination (incremental)")
@click.option("--codec", "codecs", multiple=True, type=click.Choice(list(CODECS)),
              help="wire codec(s) to compare with 'none' in the same run, on KV-like data "
                   "(repeatable)")
@click.option("--transport", default="",
              help="UCX transports of the benchmark processes (UCX_TLS), e.g. 'tcp' for a "
                   "slow link")
@click.option("--tracing", is_flag=True,
              help="also run with tracing on (spans exported to a file) and report the ratio")
@click.option("--accuracy", is_flag=True,
              help="report the codec's error (values and attention output) instead of speed")
@click.option("--nats-url", help="NATS URL (default: an embedded server)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench(
    model: str | None, layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: str,
    tokens: int, repeat: int, layer_compute_ms: float | None, contiguous: bool, sidecar: bool,
    modes: tuple[str, ...], prefix_hit: float, codecs: tuple[str, ...], transport: str,
    tracing: bool, accuracy: bool, nats_url: str | None, as_json: bool,
) -> None:
    """Time a synthetic KV transfer between two processes, vs raw ucxx.

    Every byte is verified; memcpy and raw ucxx are measured in the same run.
    """
    from kvstream.bench.runner import run_bench

    if accuracy:
        _accuracy([c for c in codecs if c != "none"] or ["fp8_e4m3", "int8"], dtype, as_json)
        return
    spec = _bench_spec(model, layers, kv_heads, head_dim, block_size, dtype, tokens, contiguous,
                       prefix_hit)
    spec = msgspec.structs.replace(spec, transport=transport)
    say = None if as_json else (lambda msg: click.echo(f"... {msg}", err=True))
    result = run_bench(spec, repeat=repeat, layer_compute_ms=layer_compute_ms,
                       nats_url=nats_url, sidecar=sidecar, modes=list(modes) or None,
                       codecs=list(codecs) or None, tracing=tracing, progress=say)
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(result)))
        return
    from kvstream.bench.report import print_bench

    print_bench(result)


def _configure_tracing(service: str, trace_file: str | None) -> Any:
    """The SDK for this process: OTLP when OTEL_* asks for it, and/or a span file."""
    from kvstream.otel import configure, otlp_requested

    if not trace_file and not otlp_requested():
        return lambda: None
    return configure(service, span_file=trace_file)


@app.command()
@click.argument("span_files", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--last", type=click.IntRange(min=1), default=3, show_default=True,
              help="show the last N transfers")
@click.option("--fold", type=click.IntRange(min=1), default=None,
              help="draw the layers in at most N groups (default: every layer)")
def trace(span_files: tuple[str, ...], last: int, fold: int | None) -> None:
    """Draw transfers from span files as text waterfalls.

    SPAN_FILES are JSON-lines span files, as written by --trace-file.
    """
    from kvstream.tracefile import load_spans, traces, waterfall

    spans = [s for path in span_files for s in load_spans(path)]
    found = sorted(traces(spans).values(), key=lambda ss: min(s["start_ns"] for s in ss))
    if not found:
        raise ConfigError("no kvstream transfer in those files")
    for ss in found[-last:]:
        click.echo(waterfall(ss, fold=fold))
        click.echo()


def _accuracy(codecs: list[str], dtype: str, as_json: bool) -> None:
    from kvstream.quant.accuracy import format_report, report

    reports = report(codecs=codecs, dtype=dtype)
    if as_json:
        click.echo(json.dumps({"accuracy": msgspec.to_builtins(reports)}))
    else:
        click.echo(format_report(reports))


@app.command()
@click.option("--model", default="llama-3-8b", show_default=True, help="model preset")
@click.option("--tokens", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--layer-compute-ms", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="simulated prefill compute per layer")
@click.option("--link", default="ib-400g", show_default=True,
              help="link preset for the planner's prediction")
@click.option("--nats-url", help="NATS URL (default: an embedded server)")
@click.option("--waterfall", "full_waterfall", is_flag=True,
              help="draw every layer of the pipelined transfer (default: 8 groups of layers)")
@click.option("--fault", type=click.Choice(["corrupt"]), default=None, hidden=True,
              help="corrupt a byte on the decode side (tests: the demo must fail)")
def demo(model: str, tokens: int, layer_compute_ms: float, link: str,
         nats_url: str | None, full_waterfall: bool, fault: str | None) -> None:
    """Stream one prompt's KV from a prefill to a decode process.

    Layer by layer, verified byte for byte, against raw ucxx and memcpy measured
    in the same run; ends with one verdict line (PASS or FAIL) and exits 1 on FAIL.
    """
    from kvstream.bench.report import run_demo

    spec = _bench_spec(model, 0, 0, 0, 16, "float16", tokens, False)
    result = run_demo(spec, model=model, layer_compute_ms=layer_compute_ms, link=link,
                      nats_url=nats_url, full_waterfall=full_waterfall, fault=fault or "")
    if not result.ok:
        sys.exit(1)


@app.command()
@click.option("--instance-id", required=True, help="this engine's instance id (NATS-safe)")
@click.option("--role", type=click.Choice(["prefill", "decode", "both"]), default="both",
              show_default=True)
@click.option("--socket", "socket_path", required=True, help="Unix socket the engine connects to")
@click.option("--nats-url", help="NATS URL (default: one on 127.0.0.1:4222, embedded if none)")
@click.option("--namespace", default="default", show_default=True)
@click.option("--ucx-tls", help="restrict UCX transports, e.g. 'tcp' or 'sm,self' (sets UCX_TLS)")
@click.option("--ucx-error-handling", is_flag=True,
              help="UCX endpoint error handling (RDMA fabrics; disables same-host shm)")
@click.option("--staging-bytes", type=click.IntRange(min=1), default=256 << 20, show_default=True)
@click.option("--max-inflight-layers", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-transfers", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--model", help="refuse KV memory of any layout but this preset's")
@click.option("--endpoint", default="",
              help="the engine's OpenAI HTTP base URL, announced for `kvstream proxy`")
@click.option("--trace-file", type=click.Path(dir_okay=False),
              help="append this sidecar's spans (JSON lines) here; OTEL_* variables select OTLP")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info",
              show_default=True)
def sidecar(instance_id: str, role: str, socket_path: str, nats_url: str | None, namespace: str,
            ucx_tls: str | None, ucx_error_handling: bool, staging_bytes: int,
            max_inflight_layers: int, max_transfers: int, model: str | None, endpoint: str,
            log_level: str, trace_file: str | None) -> None:
    """Run an agent next to one engine, served over a Unix socket."""
    import os
    import signal

    import anyio

    from kvstream.config import AgentConfig
    from kvstream.sidecar.server import Sidecar

    _log_to_stderr(log_level)
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    config = AgentConfig(instance_id=instance_id, role=role, namespace=namespace,  # type: ignore[arg-type]
                         nats_url=nats_url, ucx_error_handling=ucx_error_handling,
                         staging_bytes=staging_bytes, max_inflight_layers=max_inflight_layers,
                         max_transfers=max_transfers, endpoint=endpoint)
    layout = _layout_from(model, None, None, None, 16, "float16")[2] if model else None
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


@app.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--nats-url", help="NATS URL of the registry (default: nats://127.0.0.1:4222)")
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
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info",
              show_default=True)
def proxy(host: str, port: int, nats_url: str | None, no_nats: bool, namespace: str,
          prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...], peer_timeout: float,
          timeout: float, no_prefill: str, log_level: str) -> None:
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
    _log_to_stderr(log_level)  # one record per line, never wrapped at a terminal's width
    config = ProxyConfig(host=host, port=port, namespace=namespace,
                         nats_url=None if no_nats else (nats_url or DEFAULT_NATS_URL),
                         prefill=prefill_urls, decode=decode_urls, peer_timeout_s=peer_timeout,
                         prefill_timeout_s=timeout, decode_read_timeout_s=timeout,
                         no_prefill=no_prefill)  # type: ignore[arg-type]

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


def _register_doctor() -> None:
    from kvstream.doctor import doctor

    app.add_command(doctor)


_register_doctor()


def main(argv: list[str] | None = None) -> None:
    """Entry point: one-line errors instead of tracebacks."""
    try:
        app.main(args=argv, standalone_mode=False, prog_name="kvstream")
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"kvstream: error: {exc.format_message()}", err=True)
        sys.exit(2)
    except KVStreamError as exc:
        click.echo(f"kvstream: error: {exc}", err=True)
        sys.exit(1)
    except BaseException as exc:  # task groups wrap errors in exception groups
        found = _kvstream_error_in(exc)
        if found is None:
            raise
        click.echo(f"kvstream: error: {found}", err=True)
        sys.exit(1)


def _kvstream_error_in(exc: BaseException) -> KVStreamError | None:
    if isinstance(exc, KVStreamError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _kvstream_error_in(inner)
        if found is not None:
            return found
    return None


if __name__ == "__main__":
    main()
