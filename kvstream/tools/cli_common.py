"""What the ``kvstream`` commands share: one-line logging and a layout from the options.

Imported by ``kvstream.tools.cli`` (the group) and by its command modules; it imports
none of them.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from kvstream._exceptions import ConfigError

__all__ = ["LOG_FORMAT", "OneLineFormatter", "layout_from", "log_to_stderr"]

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
