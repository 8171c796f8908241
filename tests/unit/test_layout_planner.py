from __future__ import annotations

import pytest

from kvstream import ConfigError, KVLayout
from kvstream.tools.planner import plan_transfer, verdict_for
from kvstream.tools.presets import LINKS, MODELS, get_link, get_model


def test_llama2_70b_reference_points():
    lay = get_model("llama-2-70b").layout()
    assert lay.kv_bytes_per_token == 327_680
    assert lay.kv_bytes_per_token * 4096 == 1_342_177_280


def test_llama2_13b_is_800_kib_per_token():
    assert get_model("llama-2-13b").layout().kv_bytes_per_token == 800 * 1024


def test_mla_latent_size_is_stated():
    ds = get_model("deepseek-v3")
    lay = ds.layout()
    assert lay.kv_factor == 1 and lay.head_dim == 576
    assert lay.kv_bytes_per_token == 61 * 576 * 2
    assert "576" in ds.note


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b",
                                  "llama-3-70b", "mistral-7b", "qwen2.5-72b", "deepseek-v3"])
def test_model_presets_exist(name):
    assert name in MODELS


@pytest.mark.parametrize("name", ["nvlink4", "ib-400g", "roce-200g", "100gbe", "10gbe", "pcie5"])
def test_link_presets_exist(name):
    assert name in LINKS


@pytest.mark.parametrize("bw,rtt", [(50.0, 5.0), (1.25, 50.0), (3.3, 0.0), (450.0, 2.0)])
def test_transfer_time_is_bytes_over_bandwidth_plus_rtt(bw, rtt):
    lay = get_model("llama-2-70b").layout()
    p = plan_transfer(model_name="m", layout=lay, prompt_tokens=4096, codec="fp16",
                      link_name="x", bandwidth_gbytes_per_s=bw, rtt_us=rtt, prefill_s=1.0,
                      prefill_source="given", first_decode_s=0.0)
    assert p.request_bytes == 1_342_177_280
    assert p.transfer_ms == pytest.approx((1_342_177_280 / (bw * 1e9) + rtt * 1e-6) * 1e3)
    share = p.transfer_ms / (1000.0 + p.transfer_ms)
    assert p.share_of_ttft == pytest.approx(share)


def test_fp8_halves_bytes_and_qps_needs_bandwidth():
    lay = get_model("llama-3-8b").layout()
    p = plan_transfer(model_name="m", layout=lay, prompt_tokens=1000, codec="fp8",
                      link_name=get_link("100gbe").name, bandwidth_gbytes_per_s=12.5, rtt_us=20,
                      prefill_s=0.1, prefill_source="given", first_decode_s=0.01, qps=10)
    assert p.request_bytes == 131_072 * 1000 // 2
    assert p.required_gbytes_per_s == pytest.approx(p.request_bytes * 10 / 1e9)
    assert p.required_gbits_per_s == pytest.approx(p.required_gbytes_per_s * 8)


def test_verdicts():
    assert verdict_for(0.05) == "fine"
    assert verdict_for(0.2) == "watch"
    assert verdict_for(0.31) == "does not pay"


def test_plan_rejects_nonsense():
    lay = get_model("llama-3-8b").layout()
    with pytest.raises(ConfigError):
        plan_transfer(model_name="m", layout=lay, prompt_tokens=0, codec="fp16", link_name="x",
                      bandwidth_gbytes_per_s=1, rtt_us=0, prefill_s=1, prefill_source="",
                      first_decode_s=0)
    with pytest.raises(ConfigError):
        plan_transfer(model_name="m", layout=lay, prompt_tokens=1, codec="int3", link_name="x",
                      bandwidth_gbytes_per_s=1, rtt_us=0, prefill_s=1, prefill_source="",
                      first_decode_s=0)
    with pytest.raises(ConfigError, match="unknown model"):
        get_model("gpt-9")


def test_layout_geometry_per_arrangement():
    kv = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16)
    assert kv.block_bytes == 65536 and kv.chunks_per_block == 2 and kv.chunk_bytes == 32768
    assert kv.tensor_shape(10) == (2, 10, 16, 8, 128)
    cpu = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, arrangement="cpu_hnbc")
    assert cpu.chunks_per_block == 1 and cpu.tensor_shape(10) == (10, 8, 16, 256)
    assert cpu.num_blocks_of((10, 8, 16, 256)) == 10
    assert kv.fingerprint != cpu.fingerprint


def test_layout_validation():
    with pytest.raises(ConfigError):
        KVLayout(num_layers=0, num_kv_heads=1, head_dim=1, block_size=1)
    with pytest.raises(ConfigError, match="dtype"):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype="float12")
    with pytest.raises(ConfigError, match="arrangement"):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, arrangement="zigzag")
    with pytest.raises(ConfigError, match="mla"):
        KVLayout(num_layers=1, num_kv_heads=2, head_dim=1, block_size=1, arrangement="mla")
