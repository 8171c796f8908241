"""Control plane on NATS: messages, subjects, registry, the embedded server."""

from kvstream.control.aborts import release_offer as release_offer
from kvstream.control.bus import ControlBus as ControlBus
from kvstream.control.messages import PROTOCOL_VERSION as PROTOCOL_VERSION
from kvstream.control.nats_server import DEFAULT_NATS_URL as DEFAULT_NATS_URL
from kvstream.control.nats_server import EmbeddedNats as EmbeddedNats
from kvstream.control.registry import Registry as Registry
from kvstream.control.subjects import Subjects as Subjects

__all__ = ("DEFAULT_NATS_URL", "PROTOCOL_VERSION", "ControlBus", "EmbeddedNats", "Registry",
           "Subjects", "release_offer")
