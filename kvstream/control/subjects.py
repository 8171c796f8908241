"""NATS subject names: every subject kvstream uses is built here, under one namespace."""

from __future__ import annotations

import re
from typing import Final

from kvstream._exceptions import ConfigError

__all__ = ["Subjects"]

_TOKEN: Final = re.compile(r"^[A-Za-z0-9_-]+$")


def _check(kind: str, value: str) -> str:
    if not _TOKEN.match(value):
        raise ConfigError(
            f"{kind} {value!r} must be letters, digits, '_' or '-' (it becomes a NATS subject token)"
        )
    return value


class Subjects:
    """``kvs.<ns>.inst.<id>.ctl`` (per-instance control: manifests, aborts, done),
    ``kvs.<ns>.registry.<id>`` (announcements and heartbeats)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = _check("namespace", namespace)
        self.prefix = f"kvs.{namespace}"

    def control(self, instance_id: str) -> str:
        return f"{self.prefix}.inst.{_check('instance id', instance_id)}.ctl"

    def registry(self, instance_id: str) -> str:
        return f"{self.prefix}.registry.{_check('instance id', instance_id)}"

    @property
    def registry_prefix(self) -> str:
        return f"{self.prefix}.registry."

    @property
    def registry_all(self) -> str:
        return f"{self.prefix}.registry.*"

    @property
    def control_all(self) -> str:
        return f"{self.prefix}.inst.*.ctl"

    def kv_events(self, instance_id: str) -> str:
        """Where an instance publishes its KV events (kept in ``kv_events_stream``)."""
        return f"{self.prefix}.kvev.{_check('instance id', instance_id)}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.prefix}.kvev.*"

    @property
    def kv_events_stream(self) -> str:
        """The JetStream stream that keeps every instance's KV events of this namespace."""
        return f"KVS_{self.namespace}_KVEVENTS"

    @property
    def route(self) -> str:
        """Where proxies ask the routers (a queue group: ``ROUTERS``) where a request goes."""
        return f"{self.prefix}.route"

    def inbox(self, instance_id: str) -> str:
        """The prefix of an instance's reply subjects: its own, so that NATS permissions
        can keep every other client from reading its answers (accepts carry data-plane
        tags)."""
        return f"_INBOX.kvs.{self.namespace}.{_check('instance id', instance_id)}"

    def permissions(self, instance_id: str) -> dict[str, list[str]]:
        """The least an instance needs on NATS (docs/architecture.md, "NATS credentials and
        permissions"): publish to control subjects, its own registry subject and reply
        inboxes; subscribe to its own control subject, the registry and its own inboxes."""
        stream = self.kv_events_stream  # looked up, and made if missing: this one only
        return {"publish": [self.control_all, self.registry(instance_id),
                            self.kv_events(instance_id), "_INBOX.>",
                            f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}"],
                "subscribe": [self.control(instance_id), self.registry_all,
                              f"{self.inbox(instance_id)}.>"]}

    @staticmethod
    def check_instance_id(instance_id: str) -> str:
        return _check("instance id", instance_id)
