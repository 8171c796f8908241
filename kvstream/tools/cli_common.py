"""What the ``kvstream`` commands share: one-line logging and a layout from the options.

Imported by ``kvstream.tools.cli`` (the group) and by its command modules; it imports
none of them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import click
import msgspec

from kvstream._exceptions import ConfigError

__all__ = ["LOG_FORMAT", "OneLineFormatter", "layout_from", "log_to_stderr", "nats_auth_options"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OneLineFormatter(logging.Formatter):
    """One record, one line: a log file or collector reads records by line, so the line
    breaks of a message or a traceback are written as ``\\n``."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "").replace("\n", "\\n")


def log_to_stderr(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def layout_from(model: str | None, layers: int | None, kv_heads: int | None,
                head_dim: int | None, block_size: int, dtype: str) -> tuple[str, Any, Any]:
    from kvstream.layout import KVLayout
    from kvstream.tools.presets import ModelSpec, get_model

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


_AUTH_OPTIONS = [
    ("user", "NATS user (with --nats-password)", False),
    ("password", "NATS password (better: KVSTREAM_NATS_PASSWORD)", False),
    ("token", "NATS token (better: KVSTREAM_NATS_TOKEN)", False),
    ("nkey-seed", "file with a user NKEY seed", True),
    ("creds", "a .creds file (JWT + seed)", True),
    ("tls-ca", "CA bundle for the server's certificate (turns TLS on)", True),
    ("tls-cert", "client certificate (mutual TLS, with --nats-tls-key)", True),
    ("tls-key", "the client certificate's key", True),
    ("tls-hostname", "name to verify when the URL names an IP", False),
]


def nats_auth_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--nats-user`` ... ``--nats-tls-key``, handed to the command as one ``nats_auth``
    (a ``NatsAuth``; what is not given comes from ``KVSTREAM_NATS_*`` variables)."""
    names = [name.replace("-", "_") for name, _, _ in _AUTH_OPTIONS]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from kvstream.control.auth import NatsAuth

        given = {n: kwargs.pop(f"nats_{n}") or "" for n in names}
        return fn(*args, nats_auth=NatsAuth.from_env(given), **kwargs)

    for name, text, is_file in reversed(_AUTH_OPTIONS):
        kind = click.Path(exists=True, dir_okay=False) if is_file else None
        wrapper = click.option(f"--nats-{name}", type=kind, help=text)(wrapper)
    return wrapper
