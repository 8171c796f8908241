"""csrc/fp8.cu's kernels run on the CPU by a small CUDA emulation (tests/unit/cuda_emu/), checked
bit for bit against kvstream.quant.reference: both codecs, the three engine dtypes, the scale
groups of every arrangement, hard values, blockDim 32 to 256. And csrc/blockcopy.cu's
kvs_copy_blocks, launched through kvstream.dataplane.blockcopy.CudaBlockCopy, against the torch
reference dst[dst_idx] = src[src_idx]: aligned and unaligned items of every width.

The kernels are launched through kvstream.quant.cuda.CudaBackend (its grid, block size, argument
order and error paths) with a stand-in for cupy whose RawModule compiles the REAL kernel text
with g++: each CUDA thread is a fiber, so block_max's shuffles and barriers run.
cuda_emu/prelude.h says what is emulated and what is not. The build takes about a second and is
cached under kvstream's cache dir, keyed by the sources, the flags and the compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstream._exceptions import InvalidBlockError, QuantizationError
from kvstream.dataplane import blockcopy
from kvstream.layout import KVLayout
from kvstream.memory import RegisteredKV
from kvstream.quant import cuda, reference
from kvstream.quant.codec import LayerCodec
from kvstream.quant.cpu import cache_dir
from kvstream.quant.scheme import scale_groups

EMU_DIR = Path(__file__).with_name("cuda_emu")
# The kernel source under test; None is csrc/fp8.cu (point it at a mutated copy to see this fail).
SOURCE: Path | None = None
# __CUDA_ARCH__ of the emulated device: fp8.cu converts to bf16 with cvt.rn.bf16.f32 from sm_80
# on (what GPUs in use run), and with the bit version below that (None: no __CUDA_ARCH__).
ARCH = 800
_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")

CODECS = ("fp8_e4m3", "int8")
DTYPES = ("float16", "bfloat16", "float32")
ARRANGEMENTS = ("flash_nhd", "flash_hnd", "blocks_first_nhd", "cpu_hnbc", "mla")
NB = 10
ENC_IDS = [7, 1, 2, 9, 0, 5, 3, 4, 6]  # every special block of hard_values, scattered
DEC_IDS = [3, 8, 0, 6, 4, 1, 9, 2, 5]  # block 7 of the destination must stay untouched

# asm("cvt.X %0, %1;" : "=r"(out) : "r"(in));  ->  out = kvs_emu_cvt_X(in);  (prelude.h)
_PTX_CVT = re.compile(r'asm\("(cvt(?:\.\w+)+) %0, %1;"\s*:\s*"=\w"\((\w+)\)\s*:\s*"\w"\((\w+)\)\);')


# Headers included after a kernel source (tail.h reaches into fp8.cu's codec structs).
_TAILS = {"fp8.cu": '#include "tail.h"\n'}


def emulated_source(code: str, name: str = "fp8.cu") -> str:
    """The translation unit g++ compiles: the kernel source ``name`` after prelude.h (fp8.cu
    before tail.h), its PTX conversions replaced by the prelude's emulations (g++ rejects any
    other asm())."""
    body = _PTX_CVT.sub(lambda m: f"{m[2]} = kvs_emu_{m[1].replace('.', '_')}({m[3]});", code)
    return f'#include "prelude.h"\n#line 1 "{name}"\n{body}\n{_TAILS.get(name, "")}'


def build(code: str, arch: int | None = ARCH, name: str = "fp8.cu") -> Path:
    """The emulation library of kernel text ``code`` (built once, then cached)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/c++): the emulated CUDA kernels cannot be built")
    flags = [*_FLAGS, *([f"-D__CUDA_ARCH__={arch}"] if arch else [])]
    tu = emulated_source(code, name)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    parts = [tu, *(p.read_text() for p in sorted(EMU_DIR.glob("*.h"))), *flags, cxx, version]
    out = cache_dir() / f"cuda_emu-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built in a private directory and renamed: concurrent runs never load half a file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        cpp, so = Path(tmp) / "emu.cpp", Path(tmp) / "emu.so"
        cpp.write_text(tu)
        proc = subprocess.run([cxx, *flags, f"-I{EMU_DIR}", "-o", str(so), str(cpp)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"building the CUDA emulation failed:\n{proc.stderr}"
        os.replace(so, out)
    return out


class EmuModule:
    """cupy.RawModule's stand-in: ``code`` compiled by the emulation."""

    def __init__(self, *, code: str, options: tuple[str, ...] = (), arch: int | None = ARCH,
                 name: str = "fp8.cu") -> None:
        if name == "fp8.cu":
            # The emulation's float semantics are NVRTC's under these options (prelude.h).
            assert {"--ftz=false", "--fmad=false"} <= set(options), options
        self.lib = ctypes.CDLL(str(build(code, arch, name)))
        self.lib.kvs_emu_launch.restype = ctypes.c_int
        self.lib.kvs_emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint,
                                            ctypes.c_void_p, ctypes.c_int]
        self.launches: list[tuple[str, int, int]] = []

    def get_function(self, name: str) -> EmuKernel:
        return EmuKernel(self, name)


class EmuKernel:
    def __init__(self, module: EmuModule, name: str) -> None:
        self.module, self.name = module, name
        self.ptr = ctypes.cast(getattr(module.lib, name), ctypes.c_void_p).value

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[int, ...]) -> None:
        assert len(grid) == len(block) == 1 and grid[0] > 0, (grid, block)
        assert 0 < block[0] <= cuda.MAX_THREADS, block  # fp8.cu's __launch_bounds__
        assert all(type(a) is int for a in args), args  # cupy passes Python ints as int64
        self.module.launches.append((self.name, grid[0], block[0]))
        argv = (ctypes.c_longlong * len(args))(*args)
        rc = self.module.lib.kvs_emu_launch(self.ptr, grid[0], block[0], argv, len(args))
        assert rc == 0, f"emulated {self.name}<<<{grid[0]}, {block[0]}>>>: " + (
            "a block deadlocked at a barrier" if rc == -2 else "unsupported launch")


@functools.cache
def _module(code: str, arch: int | None) -> EmuModule:
    return EmuModule(code=code, options=cuda._OPTIONS, arch=arch)


def emulated_kernels(source: Path | None = None, arch: int | None = ARCH) -> cuda.Kernels:
    """cuda.Kernels of ``source`` (default ``SOURCE``, else csrc/fp8.cu), on the emulation."""
    return cuda.Kernels(_module((source or SOURCE or cuda.source_path()).read_text(), arch))


def emulation(source: Path | None = None, arch: int | None = ARCH) -> ctypes.CDLL:
    """The emulation library itself (for tail.h's element-wise entry points)."""
    return _module((source or SOURCE or cuda.source_path()).read_text(), arch).lib


def _raw_module(*, code: str, options: tuple[str, ...] = ()) -> EmuModule:
    """cupy.RawModule(code=...) on the emulation, for either kernel source."""
    name = "blockcopy.cu" if "kvs_copy_blocks" in code else "fp8.cu"
    return EmuModule(code=code, options=options, name=name)


class _Stream(contextlib.nullcontext):
    cuda_stream = 0

    def synchronize(self) -> None:
        pass


class _HostArray:
    """cupy.asarray's stand-in: "device" memory is host memory to the emulation."""

    def __init__(self, a: object) -> None:
        self.host = np.ascontiguousarray(a)
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data)


@pytest.fixture(scope="module", autouse=True)
def fake_cupy():
    """The cupy and torch stream calls of cuda._launch and CudaBlockCopy, for CPU tensors."""
    cupy = types.ModuleType("cupy")
    cupy.RawModule = _raw_module
    cupy.asarray = _HostArray
    cupy.cuda = types.SimpleNamespace(Device=lambda *a: contextlib.nullcontext(),
                                      ExternalStream=lambda *a: _Stream(),
                                      get_current_stream=_Stream)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", cupy)
        mp.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
        yield


def emu_codec(mem: RegisteredKV, codec: str, kernels: cuda.Kernels,
              threads: int | None = None) -> LayerCodec:
    """A LayerCodec on the (emulated) CUDA backend; ``threads`` overrides its blockDim."""
    lc = LayerCodec(mem, codec, backend="torch")
    backend = cuda.CudaBackend(lc.geo, kernels, codec)
    if threads is not None:
        backend.threads = threads
    lc.backend = backend
    return lc


def layout(arrangement: str, dtype: str) -> KVLayout:
    # A group is 7 x 44 = 308 values (the launcher picks 256 threads and they loop), or for mla
    # 7 x 12 = 84 (96 threads: the last 12 hold no value but take part in block_max).
    mla = arrangement == "mla"
    return KVLayout(num_layers=1, num_kv_heads=1 if mla else 3, head_dim=12 if mla else 44,
                    block_size=7, dtype=dtype, arrangement=arrangement)


def _e4m3_values() -> torch.Tensor:
    return torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def hard_values(lay: KVLayout, seed: int) -> torch.Tensor:
    """Log-normal values with zeros, -0, subnormals and +-max sprinkled, and special blocks:
    1 half-integers with group max 127 (int8: inv = 1, so ties; fp8: ties after * 2),
    2 the dtype's subnormals only, 3 up to +-the dtype's max, 4 all zero (and -0),
    5 group maxima around the int8 floor (around float16's smallest values for float16),
    6 int8 rounding edges (x * inv on, or an ulp off, k + 0.5), 7 fp8 ties (midpoints of e4m3
    values at power-of-two scales)."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, lay.dtype)
    fi = torch.finfo(dt)
    planes, (p, q, r, s) = lay.chunks_per_block, scale_groups(lay)
    shape = (planes, NB, p, q, r, s)
    gshape = (planes, p, 1, r, 1)  # one value per scale group of a block

    def rand(*shp: int) -> torch.Tensor:
        return torch.rand(shp, generator=gen)

    def sign(*shp: int) -> torch.Tensor:
        return torch.where(rand(*shp) < 0.5, -1.0, 1.0)

    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 4)
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=gen)
    k = flat.numel() // 20
    flat[idx[:k]] = 0.0
    flat[idx[k:2 * k]] = -0.0
    flat[idx[2 * k:3 * k]] = torch.randn(k, generator=gen) * fi.tiny / 8
    flat[idx[3 * k:3 * k + 4]] = torch.tensor([fi.max, -fi.max, fi.max, -fi.max])
    x.clamp_(-fi.max, fi.max)

    x[:, 1] = torch.randint(-254, 255, x[:, 1].shape, generator=gen) / 2
    x[:, 1, :, 0, :, 0] = 127.0
    x[:, 2] = torch.randn(x[:, 2].shape, generator=gen) * fi.tiny / 3
    x[:, 3] = (rand(*x[:, 3].shape) * 2 - 1) * fi.max
    x[:, 3, :, 0, :, 0] = fi.max
    x[:, 3, :, -1, :, -1] = -fi.max
    x[:, 4] = 0.0
    x[:, 4, ..., ::3] = -0.0

    if lay.dtype == "float16":
        maxima = torch.tensor([2.0 ** -24, 3 * 2.0 ** -24, 2.0 ** -15, 2.0 ** -14, 1e-3])
    else:
        floor = torch.tensor(reference.INT8_FLOOR)
        maxima = torch.stack([floor, floor.nextafter(torch.tensor(0.0)), floor.nextafter(floor * 2),
                              floor / 3, floor * 2, torch.tensor(2.0 ** -126), torch.tensor(1e-45)])
    amax = maxima[torch.randint(0, len(maxima), gshape, generator=gen)]
    x[:, 5] = (rand(*x[:, 5].shape) * 2 - 1) * amax
    x[:, 5, :, 0, :, 0] = (amax * sign(*gshape))[:, :, 0, :, 0]

    top = min(fi.max, 2.0 ** 100)
    amax = torch.exp(torch.randn(gshape, generator=gen) * 8).clamp(fi.smallest_normal, top).to(dt).float()
    inv = torch.full_like(amax, 127.0) / amax  # the reference's: one true division
    edge = (torch.randint(-127, 127, x[:, 6].shape, generator=gen) + 0.5) / inv
    edge = torch.where(rand(*edge.shape) < 0.3, edge.nextafter(edge * 2), edge)
    edge = torch.where(rand(*edge.shape) < 0.3, edge.nextafter(torch.zeros_like(edge)), edge)
    x[:, 6] = torch.minimum(torch.maximum(edge, -amax), amax)
    x[:, 6, :, 0, :, 0] = amax[:, :, 0, :, 0]

    e4m3 = _e4m3_values()
    ties = torch.cat([e4m3, (e4m3[1:] + e4m3[:-1]) / 2])
    pick = ties[torch.randint(0, len(ties), x[:, 7].shape, generator=gen)]
    lo, hi = (-10, 5) if lay.dtype == "float16" else (-40, 40)
    scale = torch.exp2(torch.randint(lo, hi, gshape, generator=gen).float())
    x[:, 7] = pick * sign(*pick.shape) * scale
    x[:, 7, :, 0, :, 0] = (448.0 * scale)[:, :, 0, :, 0]
    return x.to(dt).view(lay.tensor_shape(NB))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    a, b = got.contiguous().view(torch.uint8).view(-1), want.contiguous().view(torch.uint8).view(-1)
    if not torch.equal(a, b):
        at = (a != b).nonzero().flatten()
        pytest.fail(f"{what}: {at.numel()} of {a.numel()} bytes differ; first at {at[:6].tolist()}: "
                    f"got {a[at[:6]].tolist()}, want {b[at[:6]].tolist()}", pytrace=False)


def assert_same_wire(lc: LayerCodec, got: torch.Tensor, want: torch.Tensor, n: int) -> None:
    g_codes, g_scales = lc._split(got, n)
    w_codes, w_scales = lc._split(want, n)
    assert_same_bits(g_scales, w_scales, "scales")
    assert_same_bits(g_codes, w_codes, "codes")
    assert_same_bits(got, want, "wire buffer (padding)")


# blockDim: the launcher's choice (256, or 96 for mla), or 32 or 256 forced, rotating over cases.
_THREADS = (None, 32, 256, None, 32)


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", CODECS)
def test_kernels_match_reference_bit_for_bit(codec: str, dtype: str, arrangement: str) -> None:
    i = ARRANGEMENTS.index(arrangement) + DTYPES.index(dtype) + CODECS.index(codec)
    threads = _THREADS[i % len(_THREADS)]
    lay = layout(arrangement, dtype)
    t = hard_values(lay, seed=i)
    mem = RegisteredKV(lay, [t])
    emu = emu_codec(mem, codec, emulated_kernels(), threads)
    ref = LayerCodec(mem, codec, backend="torch")
    n = len(ENC_IDS)
    got = torch.full((emu.layer_bytes(n),), 0xA5, dtype=torch.uint8)
    want = got.clone()
    emu.encode(0, mem.block_map(ENC_IDS), got)
    ref.encode(0, mem.block_map(ENC_IDS), want)
    assert_same_wire(emu, got, want, n)
    if codec == "int8" and dtype != "float16":  # groups below the floor got scale 2^-119 / 127
        scales = emu._split(got, n)[1]
        assert bool((scales == torch.tensor(reference.INT8_FLOOR) / 127).any())

    out_emu, out_ref = torch.full_like(t, 7.0), torch.full_like(t, 7.0)
    mem_emu, mem_ref = RegisteredKV(lay, [out_emu]), RegisteredKV(lay, [out_ref])
    emu_codec(mem_emu, codec, emulated_kernels(), threads).decode(0, mem_emu.block_map(DEC_IDS), want)
    LayerCodec(mem_ref, codec, backend="torch").decode(0, mem_ref.block_map(DEC_IDS), want)
    assert_same_bits(out_emu, out_ref, "decoded values")  # block 7 untouched in both
    assert bool(torch.isfinite(out_emu).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", CODECS)
def test_non_finite_groups_are_counted_and_skipped(codec: str, dtype: str) -> None:
    """A group holding inf or NaN counts once, gets scale 1 and keeps its code bytes; the
    other groups are exact; the backend then fails the encode."""
    lay = layout("flash_nhd", dtype)
    t = hard_values(lay, seed=40)
    v = t.view(2, NB, *scale_groups(lay))
    v[0, 4, 0, 2, 1, 3] = float("nan")  # K, block 4, head 1 ...
    v[0, 4, 0, 6, 1, 43] = float("inf")  # ... the same group again
    v[1, 0, 0, 0, 2, 0] = float("-inf")  # V, block 0, head 2
    ids = [4, 0, 6]
    mem = RegisteredKV(lay, [t])
    emu = emu_codec(mem, codec, emulated_kernels(), threads=(None, 32, 256)[DTYPES.index(dtype)])
    got = torch.full((emu.layer_bytes(3),), 0xA5, dtype=torch.uint8)
    with pytest.raises(QuantizationError, match=f"inf or NaN in 2 scale groups: {codec}"):
        emu.encode(0, mem.block_map(ids), got)

    codes, scales = emu._split(got, 3)
    p, q, r, s = scale_groups(lay)
    codes, scales = codes.view(2, 3, p, q, r, s), scales.view(2, 3, p, r)
    want_codes, want_scales = reference.quantize(
        t.nan_to_num(0.0, 0.0, 0.0).view(2, NB, p, q, r, s)[:, ids], codec)
    good = torch.ones(scales.shape, dtype=torch.bool)
    for grp in [(0, 0, 0, 1), (1, 1, 0, 2)]:
        good[grp] = False
        assert scales[grp].item() == 1.0
        assert bool((codes[grp[:3]][:, grp[3]] == 0xA5).all())
    assert_same_bits(scales[good], want_scales[good], "scales")
    good_codes = good.unsqueeze(-2).unsqueeze(-1).expand(codes.shape)
    assert_same_bits(codes[good_codes], want_codes[good_codes], "codes")


@pytest.mark.parametrize("codec", CODECS)
def test_bad_scales_fail_the_decode_before_any_launch(codec: str) -> None:
    lay = layout("blocks_first_nhd", "bfloat16")
    mem = RegisteredKV(lay, [hard_values(lay, seed=41)])
    buf = torch.zeros(LayerCodec(mem, codec).layer_bytes(3), dtype=torch.uint8)
    LayerCodec(mem, codec, backend="torch").encode(0, mem.block_map([1, 2, 3]), buf)
    kernels = emulated_kernels()
    launches = kernels.dequantize[codec]["bfloat16"].module.launches
    for bad in (float("nan"), float("inf"), 0.0, -0.0, -0.5):
        wire = buf.clone()
        scales = LayerCodec(mem, codec)._split(wire, 3)[1]
        scales[scales.numel() // 2] = bad
        dst = torch.full_like(mem.layers[0], 1.5)
        mem_dst = RegisteredKV(lay, [dst])
        before = len(launches)
        with pytest.raises(QuantizationError, match=f"1 {codec} scales from the peer"):
            emu_codec(mem_dst, codec, kernels).decode(0, mem_dst.block_map([4, 0, 8]), wire)
        assert len(launches) == before
        assert bool((dst == 1.5).all())


@pytest.mark.parametrize("arch", [ARCH, None], ids=["sm80", "pre-sm80"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", CODECS)
def test_every_code_decodes_like_the_reference(codec: str, dtype: str, arch: int | None) -> None:
    """All 256 codes at awkward scales (the int8 floor's, subnormal, not powers of two, ones
    that overflow the dtype and must saturate), on both of fp8.cu's bf16 conversions. fp8's
    two NaN codes decode to NaN (whose bits are the device's own)."""
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=263, block_size=1, dtype=dtype,
                   arrangement="mla")
    f32max = torch.finfo(torch.float32).max
    scale_list = [reference.INT8_FLOOR / 127, 2.0 ** -140, 1e-30, 0.1, 1.0 / 127, 3.0, 515.77,
                  1e36, f32max / 127, f32max]
    n = len(scale_list)
    codes = torch.cat([torch.arange(256), torch.tensor([0x80, 0x7F, 0x81, 1, 0xFF, 0, 0x40])])
    codes = codes.to(torch.uint8).repeat(n)
    scales = torch.tensor(scale_list, dtype=torch.float32)
    mem = RegisteredKV(lay, [torch.full(lay.tensor_shape(n + 2), 7.0, dtype=getattr(torch, dtype))])
    lc = emu_codec(mem, codec, emulated_kernels(arch=arch))
    wire = torch.zeros(lc.layer_bytes(n), dtype=torch.uint8)
    w_codes, w_scales = lc._split(wire, n)
    w_codes.copy_(codes)
    w_scales.copy_(scales)
    ids = [n + 1, *range(n - 1, -1, -1)][:n]
    lc.decode(0, mem.block_map(ids), wire)
    got = mem.layers[0][ids].view(n, 1, 1, 1, 1, 263)
    want = reference.dequantize(codes.view(n, 1, 1, 1, 1, 263), scales.view(n, 1, 1, 1), got.dtype,
                                codec)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert_same_bits(got[~nan], want[~nan], "decoded values")
    assert int(nan.sum()) == (0 if codec == "int8" else 4 * n)  # 0x7f and 0xff, twice each
    assert bool((mem.layers[0][n] == 7.0).all())  # never in ids


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


@pytest.mark.parametrize("codec", CODECS)
def test_scale_of_sampled_sweep(codec: str) -> None:
    """The group scale (and code factor) of random float32 absmax bit patterns and edges
    against the reference: int8's true divisions a / 127 and 127 / a, fp8's powers of two."""
    gen = torch.Generator().manual_seed(7)
    floor = int(_bits(torch.tensor(reference.INT8_FLOOR)))
    edges = [0, 1, 2, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7F7FFFFE, 0x3F800000, 0x43E00000,
             0x43E00001, 0x43DFFFFF, 0x43600000, 0x435FFFFF, 0x43600001, *range(floor - 4, floor + 5)]
    powers = [e << 23 for e in range(1, 255)]
    amax = torch.cat([torch.tensor(edges + powers, dtype=torch.int64),
                      torch.randint(0, 0x7F800000, (1 << 18,), generator=gen)]).to(torch.int32)
    got_scale, got_inv = torch.empty(len(amax)), torch.empty(len(amax))
    emulation().kvs_emu_scale_of(CODECS.index(codec), _ptr(amax), _ptr(got_scale), _ptr(got_inv),
                                 ctypes.c_longlong(len(amax)))
    a = amax.view(torch.float32)
    if codec == "int8":
        # reference.quantize's scales of single-value groups, and its 127 / a (one division)
        want_scale = reference.quantize(a.view(-1, 1, 1, 1, 1), codec)[1].view(-1)
        clamped = a.clamp_min(reference.INT8_FLOOR)
        want_inv = torch.full_like(clamped, 127.0) / clamped
    else:
        want_scale, want_inv = reference.pow2_scales(a)
    assert_same_bits(got_scale, want_scale, "scale")
    assert_same_bits(got_inv, want_inv, "inv")


@pytest.mark.parametrize("codec", CODECS)
def test_encode_sampled_sweep(codec: str) -> None:
    """code = encode(x * inv) against the reference's rounding: random float32 bit patterns,
    half-integer ties and their neighbours, every e4m3 midpoint and its neighbours, random
    (x, inv) pairs. fp8 only where quantize_group can call it, |x * inv| <= 448 (above that,
    torch 2.13's float8_e4m3fn conversion saturates to 448, f2e4m3 returns NaN from 480)."""
    gen = torch.Generator().manual_seed(8)
    m = 1 << 17

    def around(v: torch.Tensor) -> torch.Tensor:
        v = torch.cat([v, -v])
        return torch.cat([v, v.nextafter(v * 2), v.nextafter(torch.zeros_like(v))])

    e4m3 = _e4m3_values()
    top = int(_bits(torch.tensor(130.0 if codec == "int8" else 480.0)))
    x = torch.cat([
        torch.randint(0, top + 1, (m,), generator=gen).to(torch.int32).view(torch.float32)
        * torch.where(torch.rand(m, generator=gen) < 0.5, -1.0, 1.0),
        around(torch.arange(-128, 128) + 0.5),
        around(torch.cat([e4m3, (e4m3[1:] + e4m3[:-1]) / 2])),
        torch.tensor([0.0, -0.0, 127.0, -127.0, 127.5, 448.0, -448.0, 464.0, 1e30, -1e30]),
    ])
    inv = torch.ones_like(x)
    exp2 = torch.exp2(torch.randint(-140, 130, (2, m), generator=gen).float())
    x = torch.cat([x, torch.randn(m, generator=gen) * exp2[0] / 2 ** 40])
    inv = torch.cat([inv, (exp2[1] * (torch.rand(m, generator=gen) + 0.5)).clamp(2.0 ** -50, 3e38)])
    if codec == "fp8_e4m3":
        raw = torch.randint(-(2 ** 31), 2 ** 31, (m,), generator=gen, dtype=torch.int64)
        x, inv = torch.cat([x, raw.to(torch.int32).view(torch.float32)]), torch.cat([inv, torch.ones(m)])
        keep = (x * inv).abs() <= 448.0
        x, inv = x[keep], inv[keep]
    got = torch.empty(len(x), dtype=torch.uint8)
    emulation().kvs_emu_encode(CODECS.index(codec), _ptr(x), _ptr(inv), _ptr(got), ctypes.c_longlong(len(x)))
    v = x * inv
    if codec == "int8":
        want = v.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        want = v.to(torch.float8_e4m3fn).view(torch.uint8)
    assert_same_bits(got, want, f"{codec} codes of x * inv")


# ---- csrc/blockcopy.cu: kvs_copy_blocks through CudaBlockCopy ----

@functools.cache
def _blockcopy_module() -> EmuModule:
    return EmuModule(code=blockcopy.cuda_source_path().read_text(), name="blockcopy.cu")


def emu_blockcopy(threads: int) -> blockcopy.CudaBlockCopy:
    return blockcopy.CudaBlockCopy(_blockcopy_module(), threads=threads)


def copy_reference(dst: torch.Tensor, src: torch.Tensor, dst_off: np.ndarray, src_off: np.ndarray,
                   nbytes: int) -> torch.Tensor:
    """dst[dst_idx] = src[src_idx] with the items' byte indices."""
    out = dst.clone()
    k = torch.arange(nbytes)
    out[torch.from_numpy(dst_off)[:, None] + k] = src[torch.from_numpy(src_off)[:, None] + k]
    return out


def _items(n: int, nbytes: int, dst_mod: list[int], xor: list[int], seed: int):
    """Buffers (64-byte aligned, as torch's are) and n scattered items whose destination
    address is dst_mod[i % len] modulo 16 and whose source address differs from it by
    xor[i % len] in the low four bits: 0 moves 16-byte words, 8, 4, 2, 1 narrower ones."""
    gen = np.random.default_rng(seed)
    slot = -(-(nbytes + 16) // 16) * 16
    d_slots, s_slots = gen.permutation(n + 2)[:n], gen.permutation(n + 5)[:n]
    dmod = np.array([dst_mod[i % len(dst_mod)] for i in range(n)])
    smod = dmod ^ np.array([xor[i % len(xor)] for i in range(n)])
    dst_off, src_off = (d_slots * slot + dmod).astype(np.int64), (s_slots * slot + smod).astype(np.int64)
    src = torch.from_numpy(gen.integers(0, 256, (n + 5) * slot, dtype=np.uint8))
    dst = torch.from_numpy(gen.integers(0, 256, (n + 2) * slot, dtype=np.uint8))
    assert src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0
    return dst, dst_off, src, src_off


# (items, bytes each, destination address mod 16, source xor): whole aligned tiles, partial
# tiles, the same misalignment on both sides (16-byte words after a head), every narrower width,
# an item shorter than its head, items of several 16 KiB tiles at 256 threads.
BLOCKCOPY_CASES = {
    "aligned": (10, 4096, [0], [0]),
    "aligned_partial_tile": (7, 3200, [0], [0]),
    "same_misalignment": (9, 1000, [5, 13, 1], [0]),
    "every_width": (20, 777, [0, 3, 7, 12, 9], [0, 8, 4, 2, 1, 6, 12, 3]),
    "shorter_than_head": (6, 3, [1, 14, 15], [0, 1]),
    "many_tiles": (3, 40000, [0, 4], [0, 4]),
}


@pytest.mark.parametrize("threads", [32, 96, 256])
@pytest.mark.parametrize("case", BLOCKCOPY_CASES)
def test_block_copy_matches_torch_reference(case: str, threads: int) -> None:
    n, nbytes, dst_mod, xor = BLOCKCOPY_CASES[case]
    dst, dst_off, src, src_off = _items(n, nbytes, dst_mod, xor, seed=len(case) * threads)
    want = copy_reference(dst, src, dst_off, src_off, nbytes)
    bc = emu_blockcopy(threads)
    bc.copy(dst.data_ptr(), dst.nbytes, dst_off, src.data_ptr(), src.nbytes, src_off, nbytes)
    assert_same_bits(dst, want, f"{case} copied with {threads} threads")
    tiles = -(-nbytes // (threads * blockcopy.TILE_PER_THREAD))
    assert _blockcopy_module().launches[-1] == ("kvs_copy_blocks", n * tiles, threads)


def test_block_copy_compiles_its_own_module_through_cupy() -> None:
    """CudaBlockCopy() builds csrc/blockcopy.cu with cupy.RawModule (here the emulation's)."""
    dst, dst_off, src, src_off = _items(4, 100, [0, 3], [0, 1], seed=4)
    want = copy_reference(dst, src, dst_off, src_off, 100)
    bc = blockcopy.CudaBlockCopy()
    bc.copy(dst.data_ptr(), dst.nbytes, dst_off, src.data_ptr(), src.nbytes, src_off, 100, stream=7)
    assert_same_bits(dst, want, "CudaBlockCopy()")


def test_block_copy_grid_strides_past_its_cap(monkeypatch) -> None:
    """A grid smaller than the tiles (past 2^31 - 1 of them): every block strides on."""
    monkeypatch.setattr(blockcopy, "_MAX_GRID", 5)
    dst, dst_off, src, src_off = _items(9, 5000, [0, 6], [0, 2], seed=5)
    want = copy_reference(dst, src, dst_off, src_off, 5000)
    emu_blockcopy(32).copy(dst.data_ptr(), dst.nbytes, dst_off, src.data_ptr(), src.nbytes, src_off, 5000)
    assert_same_bits(dst, want, "strided grid")
    assert _blockcopy_module().launches[-1] == ("kvs_copy_blocks", 5, 32)


def test_block_copy_refuses_out_of_bounds_before_any_launch() -> None:
    dst, dst_off, src, src_off = _items(4, 256, [0], [0], seed=6)
    before, launches = dst.clone(), _blockcopy_module().launches
    count = len(launches)
    bc = emu_blockcopy(32)
    for d_last, s_last in ((dst.nbytes - 255, 0), (0, -1)):
        d, s = dst_off.copy(), src_off.copy()
        d[3], s[3] = d_last, s_last
        with pytest.raises(InvalidBlockError, match="outside the"):
            bc.copy(dst.data_ptr(), dst.nbytes, d, src.data_ptr(), src.nbytes, s, 256)
    none = np.zeros(0, dtype=np.int64)
    bc.copy(dst.data_ptr(), dst.nbytes, none, src.data_ptr(), src.nbytes, none, 256)
    bc.copy(dst.data_ptr(), dst.nbytes, dst_off, src.data_ptr(), src.nbytes, src_off, 0)
    assert len(launches) == count and torch.equal(dst, before)


def test_block_copy_kernel_skips_and_counts_items_out_of_bounds() -> None:
    """The kernel's own guard (for callers past the host checks): bad items are skipped, never
    written, and counted once each; the others are copied."""
    dst, dst_off, src, src_off = _items(5, 3000, [0], [0], seed=7)
    dst_off[1], src_off[3] = dst.nbytes - 2999, -16
    keep = np.array([0, 2, 4])
    want = copy_reference(dst, src, dst_off[keep], src_off[keep], 3000)
    offsets = np.concatenate([dst_off, src_off])
    bad = np.zeros(1, dtype=np.uint64)
    kernel = _blockcopy_module().get_function("kvs_copy_blocks")
    kernel((5 * 2,), (32,), (dst.data_ptr(), dst.nbytes, offsets.ctypes.data, src.data_ptr(), src.nbytes,
                             offsets.ctypes.data + 8 * 5, 5, 3000, bad.ctypes.data))
    assert_same_bits(dst, want, "copy with two bad items")
    assert int(bad[0]) == 2
