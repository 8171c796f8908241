"""kvstream: KV-cache streaming for prefill/decode-disaggregated LLM serving.

Control plane on NATS, data plane on UCX. ``import kvstream`` stays light:
torch and ucxx are imported by the modules that use them, when they use them.
"""

from kvstream._exceptions import AdapterError as AdapterError
from kvstream._exceptions import CapacityError as CapacityError
from kvstream._exceptions import ClosedError as ClosedError
from kvstream._exceptions import ConfigError as ConfigError
from kvstream._exceptions import ControlPlaneError as ControlPlaneError
from kvstream._exceptions import DataPlaneError as DataPlaneError
from kvstream._exceptions import DuplicateRequestError as DuplicateRequestError
from kvstream._exceptions import ForbiddenError as ForbiddenError
from kvstream._exceptions import IncompatiblePeerError as IncompatiblePeerError
from kvstream._exceptions import InvalidBlockError as InvalidBlockError
from kvstream._exceptions import KVStreamError as KVStreamError
from kvstream._exceptions import LayoutError as LayoutError
from kvstream._exceptions import LeaseExpiredError as LeaseExpiredError
from kvstream._exceptions import MessageDecodeError as MessageDecodeError
from kvstream._exceptions import NatsConnectError as NatsConnectError
from kvstream._exceptions import NoPeerError as NoPeerError
from kvstream._exceptions import PeerLostError as PeerLostError
from kvstream._exceptions import ProtocolError as ProtocolError
from kvstream._exceptions import ProxyError as ProxyError
from kvstream._exceptions import QuantizationError as QuantizationError
from kvstream._exceptions import TransferAbortedError as TransferAbortedError
from kvstream._exceptions import TransferError as TransferError
from kvstream._exceptions import TransferTimeout as TransferTimeout
from kvstream.blocking import BlockingClient as BlockingClient
from kvstream.client import Client as Client
from kvstream.client import SidecarLostError as SidecarLostError
from kvstream.config import AgentConfig as AgentConfig
from kvstream.control.auth import NatsAuth as NatsAuth
from kvstream.control.nats_server import EmbeddedNats as EmbeddedNats
from kvstream.engine.agent import Agent as Agent
from kvstream.engine.agent import AgentStatistics as AgentStatistics
from kvstream.engine.keeper import RemoteLease as RemoteLease
from kvstream.layout import KVLayout as KVLayout
from kvstream.prefix import block_hashes as block_hashes
from kvstream.shm import SharedKV as SharedKV
from kvstream.sidecar.server import Sidecar as Sidecar
from kvstream.tools.planner import Plan as Plan
from kvstream.tools.planner import plan_transfer as plan_transfer
from kvstream.transfer import EndCause as EndCause
from kvstream.transfer import Side as Side
from kvstream.transfer import TransferResult as TransferResult
from kvstream.transfer import TransferState as TransferState
from kvstream.transfer.handles import ReceiveHandle as ReceiveHandle
from kvstream.transfer.handles import SendHandle as SendHandle
from kvstream.transfer.plan import TpInfo as TpInfo

__version__ = "0.1.0"

__all__ = (
    "AdapterError",
    "Agent",
    "AgentConfig",
    "AgentStatistics",
    "BlockingClient",
    "CapacityError",
    "Client",
    "ClosedError",
    "ConfigError",
    "ControlPlaneError",
    "DataPlaneError",
    "DuplicateRequestError",
    "EmbeddedNats",
    "EndCause",
    "ForbiddenError",
    "IncompatiblePeerError",
    "InvalidBlockError",
    "KVLayout",
    "KVStreamError",
    "LayoutError",
    "LeaseExpiredError",
    "MessageDecodeError",
    "NatsAuth",
    "NatsConnectError",
    "NoPeerError",
    "PeerLostError",
    "Plan",
    "ProtocolError",
    "ProxyError",
    "QuantizationError",
    "ReceiveHandle",
    "RemoteLease",
    "SendHandle",
    "SharedKV",
    "Side",
    "Sidecar",
    "SidecarLostError",
    "TpInfo",
    "TransferAbortedError",
    "TransferError",
    "TransferResult",
    "TransferState",
    "TransferTimeout",
    "block_hashes",
    "plan_transfer",
)
