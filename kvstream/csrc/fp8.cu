/*
 * kvstream 8-bit wire codecs, CUDA path: fused gather + quantize, dequantize + scatter, for
 * fp8_e4m3 (kvs_fp8_*) and int8 (kvs_i8_*).
 *
 * Compiled at run time by cupy's RawModule (NVRTC) and loaded by kvstream/quant/cuda.py; CI
 * compile-checks it with nvcc. The scheme is the one of csrc/fp8_cpu.c (kvstream/quant/scheme.py
 * describes it, reference.py is the torch reference every kernel must match bit for bit):
 *   - a layer tensor is viewed as [planes, num_blocks, chunk]; a chunk is [P, Q, R, S];
 *   - one scale per (plane, block, p, r), from the group's absmax (a group holding inf or NaN
 *     is counted in `bad` and not encoded);
 *   - fp8_e4m3: scale = 2^e, the smallest power of two with absmax <= 448 * 2^e;
 *     q = float8_e4m3fn(x * 2^-e) rounded as torch rounds; decode y = dtype(float(q) * 2^e);
 *   - int8: a = max(absmax, 2^-119), scale = a / 127, inv = 127 / a (two IEEE divisions),
 *     q = clamp(rint(x * inv), -127, 127) as a two's complement byte (rint: half to even);
 *     decode y = dtype(float(q) * scale).
 * Output layout: q[(plane * n + j) * chunk + i], scales[((plane * n + j) * P + p) * R + r].
 *
 * One CUDA block per scale group; blockIdx.x is the group's index in `scales`. The launcher picks
 * blockDim.x, a multiple of 32 and at most KVS_THREADS. Element offsets inside a chunk are 32-bit
 * (the launcher refuses chunks of 2^31 elements or more); block bases are 64-bit.
 *
 * No #include: NVRTC has no standard headers and cuda_fp16.h is not always on its include path,
 * so half conversions are the PTX instructions __half2float / __float2half_rn compile to.
 * Compiled without fast-math: subnormals must survive (torch does not flush them either), and
 * every multiply and divide is __fmul_rn / __fdiv_rn so none is contracted or approximated.
 */

#define KVS_THREADS 256

typedef unsigned int kvs_u32;
typedef long long kvs_i64;
typedef unsigned long long kvs_u64;

__device__ __forceinline__ kvs_u32 f2u(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float u2f(kvs_u32 u) { return __uint_as_float(u); }

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

/* Round to nearest even. sm_80+ has the instruction torch itself uses there (NaN -> 0x7fff);
 * older GPUs get torch's (and fp8_cpu.c's) bit version, which agrees on every non-NaN. */
__device__ __forceinline__ unsigned short f2bf(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return b;
#else
    const kvs_u32 u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

/* c10's fp8e4m3fn_from_fp32_value: round to nearest even, >= 480 (and NaN) -> NaN (0x7f). (torch
 * 2.13's .to(float8_e4m3fn) saturates there instead; scaled KV never exceeds 448, so the codes agree.)
 * Unsigned 32-bit arithmetic wraps exactly as in fp8_cpu.c's f2e4m3. */
__device__ __forceinline__ unsigned char f2e4m3(float f) {
    const kvs_u32 fp8_max = 1087u << 20;
    const kvs_u32 denorm_mask = 141u << 23;
    kvs_u32 fb = f2u(f);
    const kvs_u32 sign = fb & 0x80000000u;
    kvs_u32 r;
    fb ^= sign;
    if (fb >= fp8_max) {
        r = 0x7fu;
    } else if (fb < (121u << 23)) {
        /* Adding 2^14 leaves the value rounded to e4m3's subnormal step (2^-9) in the low bits. */
        fb = f2u(__fadd_rn(u2f(fb), u2f(denorm_mask)));
        r = fb - denorm_mask;
    } else {
        const kvs_u32 odd = (fb >> 20) & 1u;
        fb += ((kvs_u32)(7 - 127) << 23) + 0x7ffffu;
        fb += odd;
        r = fb >> 20;
    }
    return (unsigned char)((r & 0xffu) | (sign >> 24));
}

__device__ __forceinline__ float e4m32f(kvs_u32 b) {
    const kvs_u32 sign = (b & 0x80u) << 24;
    const kvs_u32 em = b & 0x7fu;
    if (em == 0x7fu) return u2f(sign | 0x7fc00000u);
    if (em < 8u) return u2f(sign | f2u(__fmul_rn((float)em, 0.001953125f)));  /* em * 2^-9 */
    return u2f(sign | ((em << 20) + (120u << 23)));
}

/* e of the scale for a finite absmax given as fp32 bits: frexpf(amax) = (m, k),
 * e = k - 9 + (m > 0.875), clamped to [-126, 126]; done on the bits so it is exact. */
__device__ __forceinline__ int scale_exponent(kvs_u32 amax) {
    if (amax == 0u) return -9;                 /* frexpf(0) = (0, 0) */
    const int biased = (int)(amax >> 23);
    if (biased == 0) return -126;              /* subnormal: k <= -126, so e clamps */
    /* k = biased - 126; m > 0.875 <=> mantissa > 0.75 * 2^23 */
    const int e = biased - 126 - 9 + ((amax & 0x7fffffu) > 0x600000u ? 1 : 0);
    return e < -126 ? -126 : (e > 126 ? 126 : e);
}

/* A wire codec: the group's scale and the factor that maps x to code units (from the finite
 * absmax, as fp32 bits), one element's code from x * inv, and a code's value before the scale. */
struct KvsFp8 {
    static __device__ __forceinline__ void scale_of(kvs_u32 amax, float* scale, float* inv) {
        const int e = scale_exponent(amax);
        *scale = u2f((kvs_u32)(e + 127) << 23);
        *inv = u2f((kvs_u32)(127 - e) << 23);
    }
    static __device__ __forceinline__ unsigned char encode(float v) { return f2e4m3(v); }
    static __device__ __forceinline__ float decode(kvs_u32 b) { return e4m32f(b); }
};

/* reference.INT8_FLOOR, 2^-119, as float32 bits: for every a >= it 127 / a is finite and
 * a / 127 normal (flush-to-zero never turns a scale into 0). */
#define KVS_I8_FLOOR 0x04000000u

struct KvsInt8 {
    /* a = max(absmax, 2^-119); scale = a / 127 and inv = 127 / a, each one IEEE division (the
     * reference divides tensor by tensor so that torch does the same on every device). */
    static __device__ __forceinline__ void scale_of(kvs_u32 amax, float* scale, float* inv) {
        const float a = u2f(amax < KVS_I8_FLOOR ? KVS_I8_FLOOR : amax);
        *scale = __fdiv_rn(a, 127.0f);
        *inv = __fdiv_rn(127.0f, a);
    }
    /* clamp(rint(v), -127, 127) as a two's complement byte; rounding half to even. v = x * inv
     * is finite (|x| <= a, inv finite), and clamping first is the same (+-127 are integers). */
    static __device__ __forceinline__ unsigned char encode(float v) {
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        return (unsigned char)__float2int_rn(v);
    }
    static __device__ __forceinline__ float decode(kvs_u32 b) { return (float)(signed char)b; }
};

/* Decode saturates at the destination dtype's largest finite value (a code rounded up near
 * the top of the range must not become inf); NaN stays NaN, as in fp8_cpu.c. */
__device__ __forceinline__ float kvs_saturate(float v, float m) {
    return v > m ? m : (v < -m ? -m : v);
}

struct KvsF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(const T* p) { return h2f(*p); }
    static __device__ __forceinline__ void store(T* p, float v) { *p = f2h(kvs_saturate(v, 65504.0f)); }
};

struct KvsBf16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float load(const T* p) { return u2f((kvs_u32)*p << 16); }
    static __device__ __forceinline__ void store(T* p, float v) {
        *p = f2bf(kvs_saturate(v, u2f(0x7f7f0000u)));
    }
};

struct KvsF32 {
    typedef float T;
    static __device__ __forceinline__ float load(const T* p) { return *p; }
    static __device__ __forceinline__ void store(T* p, float v) { *p = kvs_saturate(v, u2f(0x7f7fffffu)); }
};

/* Max over the block; every thread gets it. blockDim.x must be a multiple of 32. */
__device__ __forceinline__ kvs_u32 block_max(kvs_u32 v) {
    __shared__ kvs_u32 warp_max[32];
    __shared__ kvs_u32 result;
    const kvs_u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const kvs_u32 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    if (lane == 0u) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0u) {
        v = lane < (blockDim.x >> 5) ? warp_max[lane] : 0u;
        for (int o = 16; o > 0; o >>= 1) {
            const kvs_u32 w = __shfl_xor_sync(0xffffffffu, v, o);
            v = w > v ? w : v;
        }
        if (lane == 0u) result = v;
    }
    __syncthreads();
    return result;
}

/* Where group blockIdx.x = ((plane * n + j) * P + p) * R + r lives. */
struct KvsGroup {
    kvs_i64 pj;     /* plane * n + j: the chunk's row in the wire buffer */
    kvs_i64 kv;     /* plane * num_blocks + ids[j]: the chunk's row in the layer tensor */
    kvs_u32 off;    /* (p * Q * R + r) * S: the group's first element in the chunk */
};

__device__ __forceinline__ KvsGroup locate(kvs_i64 g, kvs_i64 num_blocks, const kvs_i64* ids,
                                           kvs_i64 n, kvs_i64 P, kvs_i64 Q, kvs_i64 R, kvs_i64 S) {
    KvsGroup grp;
    const kvs_i64 r = g % R, p = (g / R) % P;
    grp.pj = g / (R * P);
    grp.kv = (grp.pj / n) * num_blocks + ids[grp.pj % n];
    grp.off = (kvs_u32)((p * Q * R + r) * S);
    return grp;
}

template <class C, class D>
__device__ __forceinline__ void quantize_group(const typename D::T* __restrict__ src, kvs_i64 num_blocks,
                                               const kvs_i64* __restrict__ ids, kvs_i64 n,
                                               kvs_i64 P, kvs_i64 Q, kvs_i64 R, kvs_i64 S,
                                               unsigned char* __restrict__ out,
                                               float* __restrict__ scales, kvs_u64* __restrict__ bad) {
    const kvs_i64 g = blockIdx.x;
    const KvsGroup grp = locate(g, num_blocks, ids, n, P, Q, R, S);
    const kvs_i64 chunk = P * Q * R * S;
    const typename D::T* in = src + grp.kv * chunk + grp.off;
    unsigned char* o = out + grp.pj * chunk + grp.off;
    const kvs_u32 s_len = (kvs_u32)S, stride = (kvs_u32)(R * S), count = (kvs_u32)(Q * S);

    /* |x| as fp32 bits orders like |x| (inf and NaN above every finite value). */
    kvs_u32 m = 0u;
    for (kvs_u32 t = threadIdx.x; t < count; t += blockDim.x) {
        const kvs_u32 q = t / s_len, i = q * stride + (t - q * s_len);
        const kvs_u32 a = f2u(D::load(in + i)) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    m = block_max(m);
    if (m >= 0x7f800000u) {
        if (threadIdx.x == 0) {
            scales[g] = 1.0f;
            atomicAdd(bad, 1ull);
        }
        return;
    }
    float scale, inv;
    C::scale_of(m, &scale, &inv);
    if (threadIdx.x == 0) scales[g] = scale;
    for (kvs_u32 t = threadIdx.x; t < count; t += blockDim.x) {
        const kvs_u32 q = t / s_len, i = q * stride + (t - q * s_len);
        o[i] = C::encode(__fmul_rn(D::load(in + i), inv));
    }
}

/* Scales were checked (finite, > 0) by the launcher before this runs: a bad one writes nothing. */
template <class C, class D>
__device__ __forceinline__ void dequantize_group(const unsigned char* __restrict__ codes,
                                                 const float* __restrict__ scales, kvs_i64 n,
                                                 kvs_i64 P, kvs_i64 Q, kvs_i64 R, kvs_i64 S,
                                                 typename D::T* __restrict__ dst, kvs_i64 num_blocks,
                                                 const kvs_i64* __restrict__ ids) {
    const kvs_i64 g = blockIdx.x;
    const KvsGroup grp = locate(g, num_blocks, ids, n, P, Q, R, S);
    const kvs_i64 chunk = P * Q * R * S;
    const unsigned char* x = codes + grp.pj * chunk + grp.off;
    typename D::T* y = dst + grp.kv * chunk + grp.off;
    const kvs_u32 s_len = (kvs_u32)S, stride = (kvs_u32)(R * S), count = (kvs_u32)(Q * S);
    const float scale = scales[g];
    for (kvs_u32 t = threadIdx.x; t < count; t += blockDim.x) {
        const kvs_u32 q = t / s_len, i = q * stride + (t - q * s_len);
        D::store(y + i, __fmul_rn(C::decode(x[i]), scale));
    }
}

/* Entry points, one per codec and engine dtype (extern "C": cupy finds them by name). Grid: one
 * block per scale group, planes * n * P * R of them. `bad` counts groups holding inf or NaN (their
 * codes are not written; the caller must zero it first and fail the encode when it is not 0). */
#define KVS_QUANTIZE(NAME, C, D)                                                                   \
    extern "C" __global__ void __launch_bounds__(KVS_THREADS) NAME(                                \
        const D::T* __restrict__ src, kvs_i64 num_blocks, const kvs_i64* __restrict__ ids,         \
        kvs_i64 n, kvs_i64 P, kvs_i64 Q, kvs_i64 R, kvs_i64 S, unsigned char* __restrict__ out,    \
        float* __restrict__ scales, kvs_u64* __restrict__ bad) {                                   \
        quantize_group<C, D>(src, num_blocks, ids, n, P, Q, R, S, out, scales, bad);               \
    }

#define KVS_DEQUANTIZE(NAME, C, D)                                                                 \
    extern "C" __global__ void __launch_bounds__(KVS_THREADS) NAME(                                \
        const unsigned char* __restrict__ codes, const float* __restrict__ scales, kvs_i64 n,      \
        kvs_i64 P, kvs_i64 Q, kvs_i64 R, kvs_i64 S, D::T* __restrict__ dst, kvs_i64 num_blocks,    \
        const kvs_i64* __restrict__ ids) {                                                         \
        dequantize_group<C, D>(codes, scales, n, P, Q, R, S, dst, num_blocks, ids);                \
    }

KVS_QUANTIZE(kvs_fp8_quantize_f16, KvsFp8, KvsF16)
KVS_QUANTIZE(kvs_fp8_quantize_bf16, KvsFp8, KvsBf16)
KVS_QUANTIZE(kvs_fp8_quantize_f32, KvsFp8, KvsF32)
KVS_DEQUANTIZE(kvs_fp8_dequantize_f16, KvsFp8, KvsF16)
KVS_DEQUANTIZE(kvs_fp8_dequantize_bf16, KvsFp8, KvsBf16)
KVS_DEQUANTIZE(kvs_fp8_dequantize_f32, KvsFp8, KvsF32)

KVS_QUANTIZE(kvs_i8_quantize_f16, KvsInt8, KvsF16)
KVS_QUANTIZE(kvs_i8_quantize_bf16, KvsInt8, KvsBf16)
KVS_QUANTIZE(kvs_i8_quantize_f32, KvsInt8, KvsF32)
KVS_DEQUANTIZE(kvs_i8_dequantize_f16, KvsInt8, KvsF16)
KVS_DEQUANTIZE(kvs_i8_dequantize_bf16, KvsInt8, KvsBf16)
KVS_DEQUANTIZE(kvs_i8_dequantize_f32, KvsInt8, KvsF32)
