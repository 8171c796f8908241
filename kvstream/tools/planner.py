"""The transfer planner: DESIGN.md's size arithmetic, and a verdict.

Pure arithmetic, no I/O, so the CLI, the demo and the adapters share one answer:

    request_bytes    = kv_bytes_per_token x prompt_tokens (x codec ratio)
    transfer_seconds = request_bytes / bandwidth + rtt
    share_of_ttft    = transfer / (prefill + transfer + first_decode_step)
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from kvstream._exceptions import ConfigError
from kvstream.layout import KVLayout
from kvstream.tools.presets import GPUSpec, ModelSpec

__all__ = ["CODEC_RATIO", "Plan", "estimate_decode_step_s", "estimate_prefill_s", "plan_transfer"]

Verdict = Literal["fine", "watch", "does not pay"]

# Wire bytes relative to the engine's 16-bit cache. FP8's per-(block, head) fp32
# scales add under 1 % at block_size >= 16 and are left out here.
CODEC_RATIO: Final[dict[str, float]] = {"fp16": 1.0, "bf16": 1.0, "fp8": 0.5, "int8": 0.5}

DEFAULT_MFU: Final = 0.5


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    layout: KVLayout
    prompt_tokens: int
    codec: str
    kv_bytes_per_token: int
    request_bytes: int
    link: str
    bandwidth_gbytes_per_s: float
    rtt_us: float
    transfer_ms: float
    prefill_ms: float
    prefill_source: str
    first_decode_ms: float
    share_of_ttft: float
    verdict: Verdict
    qps: float | None = None
    required_gbytes_per_s: float | None = None
    required_gbits_per_s: float | None = None


def estimate_prefill_s(model: ModelSpec, tokens: int, gpu: GPUSpec, mfu: float = DEFAULT_MFU) -> float:
    """Prefill time from FLOPs: 2*N*T for the weights plus causal attention."""
    weight_flops = 2.0 * model.params * tokens
    # QK^T and AV over a causal mask: 2 matmuls x 2 FLOP x T^2/2 x hidden per layer.
    attn_flops = 2.0 * model.num_layers * tokens * tokens * model.hidden_size
    return (weight_flops + attn_flops) / (gpu.tflops_bf16 * 1e12 * mfu)


def estimate_decode_step_s(model: ModelSpec, gpu: GPUSpec) -> float:
    """One decode step is bound by reading the 16-bit weights from HBM once."""
    return 2.0 * model.params / (gpu.hbm_tbytes_per_s * 1e12)


def verdict_for(share: float) -> Verdict:
    if share < 0.10:
        return "fine"
    if share <= 0.30:
        return "watch"
    return "does not pay"


def plan_transfer(
    *,
    model_name: str,
    layout: KVLayout,
    prompt_tokens: int,
    codec: str,
    link_name: str,
    bandwidth_gbytes_per_s: float,
    rtt_us: float,
    prefill_s: float,
    prefill_source: str,
    first_decode_s: float,
    qps: float | None = None,
) -> Plan:
    if prompt_tokens <= 0:
        raise ConfigError(f"prompt tokens must be positive, got {prompt_tokens}")
    if bandwidth_gbytes_per_s <= 0:
        raise ConfigError(f"bandwidth must be positive, got {bandwidth_gbytes_per_s} GB/s")
    if rtt_us < 0 or prefill_s < 0 or first_decode_s < 0:
        raise ConfigError("rtt, prefill time and decode step time cannot be negative")
    if codec not in CODEC_RATIO:
        raise ConfigError(f"unknown codec {codec!r}; known: {', '.join(CODEC_RATIO)}")
    if qps is not None and qps <= 0:
        raise ConfigError(f"qps must be positive, got {qps}")

    per_token = layout.kv_bytes_per_token
    request_bytes = round(per_token * prompt_tokens * CODEC_RATIO[codec])
    transfer_s = request_bytes / (bandwidth_gbytes_per_s * 1e9) + rtt_us * 1e-6
    share = transfer_s / (prefill_s + transfer_s + first_decode_s)
    required = request_bytes * qps / 1e9 if qps is not None else None
    return Plan(
        model=model_name,
        layout=layout,
        prompt_tokens=prompt_tokens,
        codec=codec,
        kv_bytes_per_token=per_token,
        request_bytes=request_bytes,
        link=link_name,
        bandwidth_gbytes_per_s=bandwidth_gbytes_per_s,
        rtt_us=rtt_us,
        transfer_ms=transfer_s * 1e3,
        prefill_ms=prefill_s * 1e3,
        prefill_source=prefill_source,
        first_decode_ms=first_decode_s * 1e3,
        share_of_ttft=share,
        verdict=verdict_for(share),
        qps=qps,
        required_gbytes_per_s=required,
        required_gbits_per_s=required * 8 if required is not None else None,
    )
