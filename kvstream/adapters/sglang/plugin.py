"""The ``sglang.srt.plugins`` entry point: ``kvstream`` as a transfer backend choice.

SGLang's backends are a closed enum (``disaggregation.utils.TransferBackend``) and
``get_kv_class`` an if/elif chain; its plugin hooks (``plugins.hook_registry``) let a
package extend both without editing SGLang, as Xinference's backend does: ``register``
(run by SGLang's ``load_plugins`` in every SGLang process, before its hooks are applied)
replaces the enum with one that also has ``KVSTREAM``, adds ``kvstream`` to the CLI's
choices, and wraps ``get_kv_class`` to return kvstream's classes for it, calling the
original for every other backend. Pinned against sglang 0.5.23.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["BACKEND", "register"]

BACKEND = "kvstream"
_TARGET = "sglang.srt.disaggregation.utils"


def _classes(class_type: Any) -> Any:
    from sglang.srt.disaggregation.base.conn import KVArgs

    from kvstream.adapters.sglang import conn

    return {"kvargs": KVArgs, "manager": conn.KVStreamKVManager, "sender": conn.KVStreamKVSender,
            "receiver": conn.KVStreamKVReceiver,
            "bootstrap_server": conn.KVStreamBootstrapServer}.get(
        getattr(class_type, "value", class_type))


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) == BACKEND:
        return _classes(class_type)
    return original(transfer_backend, class_type)


_registered = False


def register() -> None:
    """Idempotent: SGLang's loader runs it once per process; a second call adds nothing."""
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    current = utils.TransferBackend
    if BACKEND not in {m.value for m in current}:
        members = {m.name: m.value for m in current} | {BACKEND.upper(): BACKEND}
        extended = enum.Enum("TransferBackend", members, module=_TARGET)  # type: ignore[misc]
        HookRegistry.register(f"{_TARGET}.TransferBackend", extended, HookType.REPLACE)
    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])  # list.extend: a list, not a str
    HookRegistry.register(f"{_TARGET}.get_kv_class", _get_kv_class, HookType.AROUND)
