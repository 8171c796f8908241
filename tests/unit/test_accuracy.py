"""kvstream.bench.accuracy: the 8-bit codecs against their documented bounds and on attention."""

from __future__ import annotations

import math

import pytest
import torch

from kvstream._exceptions import ConfigError
from kvstream.bench import accuracy
from kvstream.bench.accuracy import (
    AccuracyReport,
    format_report,
    measure,
    random_with_outliers,
    tiny_llama_kv,
)
from kvstream.layout import KVLayout
from kvstream.quant.scheme import wire_layer_bytes

BENCH = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16)
SMALL = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16)
REL = 2.0 ** -4
NEEDS_DEV = "needs transformers: pip install -e '.[dev]' (README command 2)"

# The bounds below, and their margins. What the codecs guarantee is the element bound
# (``within_bound``: every decoded value within ``scheme.error_bound``); every test checks it
# exactly. Attention cosines are not a codec guarantee but a property of the KV, so they are
# stated against fixed data: seeded synthetic KV, the committed trained tiny Llama
# (kvstream/bench/tiny_llama.py: the same weights on every machine) and a random-init one
# drawn from one seeded CPU generator. Those inputs are identical everywhere; what can still
# differ between machines is float rounding in the model's forward pass. Measured on the
# committed weights under three CPU kernel sets (ATEN_CPU_CAPABILITY default/avx2/avx512,
# MKL and oneDNN limited to AVX2) and 1 and 2 threads, the cosines moved by at most 2e-5
# (means) and 3e-5 (minimums); rounding every weight of the model to float16 moved them by
# 2e-5 / 2e-3. Each bound sits at least 7e-4 (means: 35x the largest shift seen) or 0.02
# (minimums: 10x) below the value on these inputs; the margin of each is noted with it.
# Values (``python -m kvstream bench --accuracy``, docs/architecture.md): trained tiny Llama
# int8 0.99970 / min 0.952, e4m3 0.99503 / 0.437, vLLM-style fp8 cache 0.99374; random-init
# int8 0.99809, e4m3 0.97688, fp8 cache 0.97700.
TRAINED_INT8_MEAN = 0.999  # issue 5's bar; measured 0.99970 (margin 7e-4 = 35x)
TRAINED_INT8_MIN = 0.93  # measured 0.952
TRAINED_FP8_MEAN = 0.994  # measured 0.99503
INIT_FP8_MEAN = 0.975  # measured 0.97688 (margin 1.9e-3)
INIT_INT8_MEAN = 0.997  # measured 0.99809


@pytest.fixture(scope="module")
def random_report() -> AccuracyReport:
    return measure(BENCH, random_with_outliers(BENCH, 64), None, source="random+outliers")


@pytest.fixture(scope="module")
def llama_kv() -> tuple[KVLayout, list[torch.Tensor], torch.Tensor]:
    """The random-init (harsh) tiny Llama."""
    pytest.importorskip("transformers", reason=NEEDS_DEV)
    return tiny_llama_kv(trained=False)


@pytest.fixture(scope="module")
def llama_report(llama_kv: tuple[KVLayout, list[torch.Tensor], torch.Tensor]) -> AccuracyReport:
    layout, layers, queries = llama_kv
    return measure(layout, layers, queries, source="tiny-llama-init0.5")


@pytest.fixture(scope="module")
def trained_kv() -> tuple[KVLayout, list[torch.Tensor], torch.Tensor]:
    """The trained tiny Llama (kvstream.bench.tiny_llama: committed weights)."""
    pytest.importorskip("transformers", reason=NEEDS_DEV)
    return tiny_llama_kv()


def test_random_outliers_within_documented_bound(random_report: AccuracyReport) -> None:
    r = random_report
    assert r.within_bound
    assert r.max_rel_err <= REL + 1e-6
    assert 0 < r.mean_rel_err < r.max_rel_err
    assert 0 < r.rmse_over_rms < 0.03
    assert r.values == 4 * 64 * 2 * 16 * 8 * 128
    assert r.raw_bytes == 2 * r.values
    assert r.wire_bytes == 4 * wire_layer_bytes(BENCH, "fp8_e4m3", 64)


def test_spread_attention_keeps_its_output() -> None:
    layers = accuracy.random_kv(BENCH, 64)
    r = measure(BENCH, layers, None, source="random")
    assert r.within_bound and r.attn_logit_std < 1.5
    # Seeded data, no model: only the attention's own rounding differs between machines
    # (< 1e-6). Measured: e4m3 0.99927 / min 0.99862, int8 0.99993 / min 0.99984.
    assert r.attn_cosine_mean >= 0.999
    assert r.attn_cosine_min >= 0.998
    i8 = measure(BENCH, layers, None, source="random", codec="int8")
    assert i8.within_bound and i8.wire_bytes == r.wire_bytes
    assert i8.attn_cosine_mean >= 0.9998 and i8.attn_cosine_min >= 0.9995
    assert i8.rmse_over_rms < 0.01


def test_int8_within_its_bound_where_outliers_stretch_the_scale(
        random_report: AccuracyReport) -> None:
    """Spikes of 100 sigma widen int8's step for their whole group: still within the bound
    (half a step), and e4m3 is the better codec for such data (the docs say so)."""
    layers = random_with_outliers(BENCH, 64)
    i8 = measure(BENCH, layers, None, source="random+outliers", codec="int8")
    assert i8.within_bound
    assert i8.max_abs_err <= max(float(t.float().abs().max()) for t in layers) / 254 * 1.01
    assert i8.attn_cosine_mean < random_report.attn_cosine_mean


def test_test_transformer_attention_with_int8(
        trained_kv: tuple[KVLayout, list[torch.Tensor], torch.Tensor]) -> None:
    """The issue's bar: attention-output cosine >= 0.999 on the test transformer's real KV.
    int8 reaches it; e4m3 cannot at any scale granularity (3 mantissa bits), so it is held
    to its own measured level and to the fp8 cache users already accept."""
    layout, layers, queries = trained_kv
    i8 = measure(layout, layers, queries, source="tiny-llama", codec="int8")
    fp8 = measure(layout, layers, queries, source="tiny-llama")
    vllm = measure(layout, layers, queries, source="tiny-llama",
                   yardstick="fp8 per-tensor (vLLM cache)")
    assert i8.within_bound and fp8.within_bound
    assert 5 < i8.attn_logit_std < 30  # sharp heads, as a trained model has
    assert i8.attn_cosine_mean >= TRAINED_INT8_MEAN
    assert i8.attn_cosine_min >= TRAINED_INT8_MIN
    assert fp8.attn_cosine_mean >= TRAINED_FP8_MEAN
    assert fp8.attn_cosine_mean >= vllm.attn_cosine_mean  # measured 1.3e-3 above it
    assert i8.attn_cosine_mean > fp8.attn_cosine_mean
    assert i8.wire_bytes == fp8.wire_bytes < 0.51 * fp8.raw_bytes


def test_tiny_llama_within_documented_bound(llama_report: AccuracyReport) -> None:
    assert llama_report.within_bound
    assert llama_report.max_rel_err <= REL + 1e-6
    assert llama_report.values == 4 * 2 * 256 * 2 * 32


def test_tiny_llama_attention_no_worse_than_an_fp8_cache(
        llama_kv: tuple[KVLayout, list[torch.Tensor], torch.Tensor],
        llama_report: AccuracyReport) -> None:
    layout, layers, queries = llama_kv
    vllm = measure(layout, layers, queries, source="tiny-llama",
                   yardstick="fp8 per-tensor (vLLM cache)")
    assert llama_report.attn_logit_std > 30  # the harsh case: near one-hot attention
    assert llama_report.attn_cosine_mean >= INIT_FP8_MEAN
    assert llama_report.attn_cosine_mean >= vllm.attn_cosine_mean - 2e-3  # measured -1.2e-4
    assert llama_report.rmse_over_rms <= vllm.rmse_over_rms + 1e-3
    i8 = measure(layout, layers, queries, source="tiny-llama-init0.5", codec="int8")
    assert i8.attn_cosine_mean >= INIT_INT8_MEAN


def test_tiny_llama_queries_are_the_models_own() -> None:
    """The captured queries against the cached K/V reproduce the model's attention output
    for the last token (where attending to every token is exactly causal). float32: this
    model's attention is so peaked that float16 K/V alone move some outputs by 0.1."""
    pytest.importorskip("transformers", reason=NEEDS_DEV)
    layout, layers, queries = tiny_llama_kv(dtype="float32", trained=False)
    assert queries.shape == (4, 8, accuracy.QUERY_TOKENS, 32)
    model = accuracy._tiny_llama(0, 256)
    seen: dict[int, torch.Tensor] = {}
    hooks = [m.self_attn.o_proj.register_forward_pre_hook(
        lambda _m, args, i=i: seen.__setitem__(i, args[0][0, -1])) for i, m in enumerate(model.model.layers)]
    ids = torch.randint(0, 1000, (1, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    for i in range(4):
        out = accuracy._attention(queries[i][:, -1:], *accuracy._kv_heads(layout, layers[i]))
        torch.testing.assert_close(out[:, 0].reshape(-1), seen[i], rtol=1e-3, atol=1e-3)


def test_lossless_codec_scores_perfect() -> None:
    layers = random_with_outliers(SMALL, 8)
    r = measure(SMALL, layers, None, codec="none", source="none")
    assert r.within_bound and r.max_abs_err == 0 and r.rmse_over_rms == 0
    assert r.attn_max_abs_dev == 0
    assert r.attn_cosine_min == pytest.approx(1.0, abs=1e-6)
    assert r.wire_bytes == r.raw_bytes


def _zero_head(layer: int, t: torch.Tensor) -> None:
    if layer == 0:
        t[:, :, :, 0] = 0  # flash_nhd [2, nb, bs, h, d]: K and V of head 0


def test_metrics_fail_when_a_head_is_lost() -> None:
    layers = random_with_outliers(SMALL, 8)
    good = measure(SMALL, layers, None, source="good")
    bad = measure(SMALL, layers, None, source="bad", _tamper=_zero_head)
    assert good.within_bound and not bad.within_bound
    assert bad.attn_cosine_min < 0.5 < good.attn_cosine_min
    assert bad.max_rel_err == pytest.approx(1.0)


def test_bound_catches_a_small_error() -> None:
    """One element off by 20 % (the bound allows 6.25 %) fails the bound."""
    layers = random_with_outliers(SMALL, 8)

    def nudge(layer: int, t: torch.Tensor) -> None:
        if layer == 1:
            t[1, 3, 5, 2, 7] = layers[1][1, 3, 5, 2, 7] * 1.2 + 0.1

    assert not measure(SMALL, layers, None, source="nudged", _tamper=nudge).within_bound


def test_unwritten_blocks_cannot_pass() -> None:
    layers = random_with_outliers(SMALL, 8)

    def forget(layer: int, t: torch.Tensor) -> None:
        t[:, 2] = math.nan

    r = measure(SMALL, layers, None, source="forgot", _tamper=forget)
    assert not r.within_bound
    assert r.attn_cosine_min == -1.0


def _rearrange(nhd: torch.Tensor, arrangement: str) -> torch.Tensor:
    """A flash_nhd layer ``[2, nb, bs, h, d]`` in another arrangement (layout.py's shapes)."""
    return {
        "flash_hnd": lambda: nhd.transpose(2, 3),
        "blocks_first_nhd": lambda: nhd.transpose(0, 1),
        # [nb, h, bs, 2*d] holding, per block and head, K as [d, bs] then V as [bs, d]
        # (vLLM CPU)
        "cpu_hnbc": lambda: torch.cat(
            [nhd[0].permute(0, 2, 3, 1).reshape(*nhd.shape[1:2], nhd.shape[3], -1),
             nhd[1].permute(0, 2, 1, 3).reshape(*nhd.shape[1:2], nhd.shape[3], -1)],
            dim=2).reshape(nhd.shape[1], nhd.shape[3], nhd.shape[2], 2 * nhd.shape[4]),
    }[arrangement]().contiguous()


@pytest.mark.parametrize("arrangement", ["flash_hnd", "blocks_first_nhd", "cpu_hnbc"])
def test_other_arrangements_hold_the_same_kv(arrangement: str) -> None:
    nhd = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32",
                   arrangement=arrangement)
    x = random_with_outliers(nhd, 4)[0]
    k, v = accuracy._kv_heads(nhd, x)
    k2, v2 = accuracy._kv_heads(lay, _rearrange(x, arrangement))
    assert torch.equal(k, k2) and torch.equal(v, v2)
    ko, vo = accuracy._kv_heads(lay, random_with_outliers(lay, 4)[0])
    med = [t.abs().median(dim=1).values.amax() for t in (ko, vo)]  # robust to the spikes
    assert med[0] > 10 > med[1]  # channel outliers are in K
    assert measure(lay, random_with_outliers(lay, 4), None, source=arrangement).within_bound


def test_mla_has_no_attention_to_measure() -> None:
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, arrangement="mla")
    with pytest.raises(ConfigError):
        measure(lay, random_with_outliers(lay, 2), None, source="mla")


def test_format_report_names_every_source(random_report: AccuracyReport) -> None:
    text = format_report([random_report])
    assert "random+outliers" in text and "fp8_e4m3" in text and "cos min" in text
    assert len(text.splitlines()) == 2
