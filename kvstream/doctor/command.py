"""The ``kvstream doctor`` command (click); the CLI registers it with ``add_command``."""

from __future__ import annotations

import sys

import click

from kvstream.control.auth import NatsAuth
from kvstream.tools.cli_common import nats_auth_options

__all__ = ["doctor"]


@click.command()
@click.option("--nats-url", help="NATS URL to check (default: nats://127.0.0.1:4222)")
@nats_auth_options
@click.option("--json", "as_json", is_flag=True,
              help="print one JSON object (only that, on stdout)")
@click.option("--no-link-check", is_flag=True,
              help="skip the 64 MiB transfer between two local UCX workers")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds for each NATS step")
def doctor(nats_url: str | None, nats_auth: NatsAuth, as_json: bool, no_link_check: bool,
           timeout: float) -> None:
    """Check this host: versions, UCX transports, NATS, /dev/shm.

    Run it first on a new host, or when transfers are slow: one line per check (ok,
    WARN, FAIL, skip), the transports two local UCX workers actually use, and a 64 MiB
    transfer between them against a memcpy. Exits 1 when a check failed (an unreachable
    NATS is a failure), else 0. Starts no NATS server.
    """
    import msgspec

    from kvstream.doctor.checks import run_checks
    from kvstream.doctor.text import format_report

    report = run_checks(nats_url, link_check=not no_link_check, timeout=timeout,
                        auth=nats_auth)
    if as_json:
        click.echo(msgspec.json.encode(msgspec.to_builtins(report)).decode())
    else:
        click.echo(format_report(report))
    sys.stdout.flush()
    if report.failures:
        sys.exit(1)
