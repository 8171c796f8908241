"""pytest plugin (``-p kvstream_nixl_alias``): vLLM's "NixlConnector" becomes KVStreamConnector.

vLLM's connector unit tests build their configs with ``utils.create_vllm_config``, whose
``kv_connector`` defaults to ``"NixlConnector"``, and the test modules bind that helper
at import. Rather than patching the tests, this plugin swaps one entry of
``KVConnectorFactory._registry`` (``vllm/distributed/kv_transfer/kv_connector/factory.py``):
``get_connector_class`` and ``get_connector_class_by_name`` call the registered loader
for a name without a ``kv_connector_module_path``, so the swapped loader makes every
``"NixlConnector"`` lookup (``create_connector``, ``supports_hma_config``) return
``kvstream.adapters.vllm.KVStreamConnector``. Nothing else in vLLM is touched; the
NIXL classes stay importable under their other names. The original loader is put back
at ``pytest_unconfigure``.

With ``KVSTREAM_ALIAS_OFF=1`` the plugin does nothing at all (not even import vLLM),
so the same runner gives a baseline against vLLM's own NIXL scheduler code.
"""

from __future__ import annotations

import importlib
import os

import pytest

ALIASED_NAME = "NixlConnector"
TARGET_MODULE = "kvstream.adapters.vllm"
TARGET_CLASS = "KVStreamConnector"

_stash_key = pytest.StashKey[object]()


def alias_enabled() -> bool:
    return os.environ.get("KVSTREAM_ALIAS_OFF", "") != "1"


def _load_target() -> type:
    return getattr(importlib.import_module(TARGET_MODULE), TARGET_CLASS)


def pytest_configure(config: pytest.Config) -> None:
    if not alias_enabled():
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    # Resolve now, so that a broken adapter is one clear error, not one per test.
    try:
        cls = _load_target()
    except Exception as e:
        raise pytest.UsageError(
            f"kvstream_nixl_alias: cannot load {TARGET_MODULE}.{TARGET_CLASS}: {e!r}"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise pytest.UsageError(f"kvstream_nixl_alias: {cls!r} is not a KVConnectorBase_V1 subclass")

    config.stash[_stash_key] = KVConnectorFactory._registry.get(ALIASED_NAME)
    KVConnectorFactory._registry[ALIASED_NAME] = _load_target


def pytest_unconfigure(config: pytest.Config) -> None:
    original = config.stash.get(_stash_key, None)
    if original is None:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    KVConnectorFactory._registry[ALIASED_NAME] = original


def pytest_report_header(config: pytest.Config) -> str:
    if _stash_key in config.stash:
        return f"kvstream_nixl_alias: {ALIASED_NAME} -> {TARGET_MODULE}.{TARGET_CLASS}"
    return f"kvstream_nixl_alias: off (KVSTREAM_ALIAS_OFF=1), {ALIASED_NAME} is vLLM's own"
