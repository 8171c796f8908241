"""The ``kvstream`` command line (click): plan, nats, bench, demo, doctor, sidecar, proxy.

Here: the group, ``plan``, ``nats``, ``trace`` and ``main``. ``cli_bench`` (bench, demo),
``cli_run`` (sidecar, proxy) and ``kvstream.doctor`` define the others, registered here;
none of them imports this module. Argument errors and kvstream errors print one line and
exit 2 / 1; no tracebacks.
"""

from __future__ import annotations

import json
import sys

import click
import msgspec

from kvstream._exceptions import ConfigError, KVStreamError
from kvstream.tools.cli_bench import bench, demo
from kvstream.tools.cli_common import LOG_FORMAT, OneLineFormatter, layout_from
from kvstream.tools.cli_run import proxy, router, sidecar

__all__ = ["LOG_FORMAT", "OneLineFormatter", "app", "main"]


@click.group(name="kvstream", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvstream")
def app() -> None:
    """KV-cache streaming for prefill/decode-disaggregated LLM serving."""


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
    from kvstream.tools.planner import estimate_decode_step_s, estimate_prefill_s, plan_transfer
    from kvstream.tools.presets import GPUS, LINKS, MODELS, get_gpu, get_link

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
    name, mspec, layout = layout_from(model, layers, kv_heads, head_dim, block_size, "float16")
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
    from kvstream.tools.tracefile import load_spans, traces, waterfall

    spans = [s for path in span_files for s in load_spans(path)]
    found = sorted(traces(spans).values(), key=lambda ss: min(s["start_ns"] for s in ss))
    if not found:
        raise ConfigError("no kvstream transfer in those files")
    for ss in found[-last:]:
        click.echo(waterfall(ss, fold=fold))
        click.echo()


def _register_commands() -> None:
    """The commands defined in the sibling modules (``kvstream.doctor`` included)."""
    from kvstream.doctor import doctor

    for command in (bench, demo, sidecar, proxy, router, doctor):
        app.add_command(command)


_register_commands()


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
