"""``kvstream bench`` and ``kvstream demo``: synthetic transfers between processes, timed.

Registered on the group by ``kvstream.tools.cli``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import msgspec

from kvstream._exceptions import ConfigError
from kvstream.quant.scheme import CODECS
from kvstream.tools.cli_common import layout_from

__all__ = ["bench", "demo"]


def _bench_spec(model: str | None, layers: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: str, tokens: int, contiguous: bool, prefix_hit: float = 0.0) -> Any:
    from kvstream.bench.synthetic import BenchSpec
    from kvstream.layout import KVLayout

    if model is not None:
        _, _, layout = layout_from(model, None, None, None, block_size, dtype)
    else:
        layout = KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                          block_size=block_size, dtype=dtype)
    if tokens <= 0:
        raise ConfigError("--tokens must be positive")
    return BenchSpec(layout=layout, tokens=tokens, scattered=not contiguous,
                     prefix_hit=prefix_hit)


@click.command()
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
@click.option("--path", type=click.Choice(["auto", "shm", "tcp", "ucx"]), default="auto",
              show_default=True,
              help="data-plane path of the agents (auto: the one a deployment's would take)")
@click.option("--two-hosts", is_flag=True,
              help="give each side its own host id, as if on two machines (no same-host path)")
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
    path: str, two_hosts: bool, tracing: bool, accuracy: bool, nats_url: str | None,
    as_json: bool,
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
    spec = msgspec.structs.replace(spec, transport=transport,
                                   path="" if path == "auto" else path, host_ids=two_hosts)
    say = None if as_json else (lambda msg: click.echo(f"... {msg}", err=True))
    result = run_bench(spec, repeat=repeat, layer_compute_ms=layer_compute_ms,
                       nats_url=nats_url, sidecar=sidecar, modes=list(modes) or None,
                       codecs=list(codecs) or None, tracing=tracing, progress=say)
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(result)))
        return
    from kvstream.bench.report import print_bench

    print_bench(result)


def _accuracy(codecs: list[str], dtype: str, as_json: bool) -> None:
    from kvstream.bench.accuracy import format_report, report

    reports = report(codecs=codecs, dtype=dtype)
    if as_json:
        click.echo(json.dumps({"accuracy": msgspec.to_builtins(reports)}))
    else:
        click.echo(format_report(reports))


@click.command()
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
