/*
 * kvstream 8-bit wire codecs, CPU path: gather + quantize, dequantize + scatter, for
 * fp8_e4m3 (kvs_fp8_*) and int8 (kvs_i8_*), with the same arguments, groups and layout.
 *
 * Built on first use by kvstream/quant/cpu.py (gcc/cc -O3 -shared, with -march=native where
 * the CPU has AVX2 and F16C) and called through ctypes, which releases the GIL for the call.
 *
 * The scheme (kvstream/quant/scheme.py is the normative description, reference.py the torch
 * reference every kernel must match bit for bit):
 *   - a layer tensor is viewed as [planes, num_blocks, chunk]; a chunk is [P, Q, R, S];
 *   - one scale per (plane, block, p, r): the absmax over (q, s), in float32; a group
 *     holding inf or NaN is counted (the call's result) and gets scale 1, no codes;
 *   - fp8_e4m3: the scale is a power of two, 2^e with the smallest e such that
 *     absmax <= 448 * 2^e (frexp: absmax = m * 2^k, m in [0.5, 1): e = k - 9 + (m > 0.875)),
 *     clamped to [-126, 126], so scaling and unscaling are exact multiplications;
 *     q = float8_e4m3fn(x * 2^-e), rounded to nearest even exactly as torch rounds;
 *   - int8: a = max(absmax, 2^-119), scale = a / 127, inv = 127 / a (two IEEE divisions;
 *     the floor keeps inv finite), q = int8(clamp(rint(x * inv), +-127));
 *   - decode: y = engine_dtype(clamp(float(q) * scale, +-max of the dtype)), round to nearest
 *     even: a code rounded up near the top of the range saturates instead of becoming inf.
 *     Scales come off the wire: one not finite and positive fails the call, nothing written.
 * Output layout: q[(plane * n + j) * chunk + i], scales[((plane * n + j) * P + p) * R + r].
 * Every float step is a single IEEE float32 operation with no add next to a multiply, so
 * gcc's default -ffp-contract=fast has nothing to fuse; never build with -ffast-math.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define KVS_AVX2 1
#else
#define KVS_AVX2 0
#endif

enum { KVS_F16 = 0, KVS_BF16 = 1, KVS_F32 = 2 };

#if defined(__GNUC__) && !defined(__clang__)
#define KVS_NOIPA __attribute__((noipa))
#else
#define KVS_NOIPA __attribute__((noinline))
#endif

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float h2f(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t f2h(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }

static inline uint16_t f2bf(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* c10's fp8e4m3fn_from_fp32_value: round to nearest even, >= 480 (and NaN) -> NaN (0x7f). (torch
 * 2.13's .to(float8_e4m3fn) saturates there instead; scaled KV never exceeds 448, so the codes agree.) */
static inline uint8_t f2e4m3(float f) {
    const uint32_t fp8_max = 1087u << 20;
    const uint32_t denorm_mask = 141u << 23;
    uint32_t fb = f2u(f);
    const uint32_t sign = fb & 0x80000000u;
    uint8_t r;
    fb ^= sign;
    if (fb >= fp8_max) {
        r = 0x7f;
    } else if (fb < (121u << 23)) {
        fb = f2u(u2f(fb) + u2f(denorm_mask));
        r = (uint8_t)(fb - denorm_mask);
    } else {
        const uint32_t odd = (fb >> 20) & 1u;
        fb += ((uint32_t)(7 - 127) << 23) + 0x7ffffu;
        fb += odd;
        r = (uint8_t)(fb >> 20);
    }
    return (uint8_t)(r | (uint8_t)(sign >> 24));
}

static inline float e4m32f(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    const uint32_t em = b & 0x7fu;
    if (em == 0x7fu) return u2f(sign | 0x7fc00000u);
    if (em < 8u) return u2f(sign | f2u((float)em * 0x1p-9f));
    return u2f(sign | ((em << 20) + (120u << 23)));
}

static inline int scale_exponent(uint32_t amax_bits) {
    int k;
    const float m = frexpf(u2f(amax_bits), &k);
    int e = k - 9 + (m > 0.875f);
    if (e < -126) e = -126;
    if (e > 126) e = 126;
    return e;
}

static inline float load1(const void* base, int dtype, int64_t i) {
    if (dtype == KVS_F16) return h2f(((const uint16_t*)base)[i]);
    if (dtype == KVS_BF16) return u2f((uint32_t)((const uint16_t*)base)[i] << 16);
    return ((const float*)base)[i];
}

static inline void store1(void* base, int dtype, int64_t i, float v) {
    if (dtype == KVS_F16) ((uint16_t*)base)[i] = f2h(v);
    else if (dtype == KVS_BF16) ((uint16_t*)base)[i] = f2bf(v);
    else ((float*)base)[i] = v;
}

/* Largest finite value of the destination dtype (decode saturates there). */
static inline float dtype_max(int dtype) {
    if (dtype == KVS_F16) return 65504.0f;
    if (dtype == KVS_BF16) return u2f(0x7f7f0000u);
    return u2f(0x7f7fffffu);
}

static inline float saturate(float v, float m) { return v > m ? m : (v < -m ? -m : v); }

/* int8: x * inv (finite, |.| <= ~127) -> the code's byte. rintf: nearest even. */
static inline uint8_t f2i8(float v) {
    float r = rintf(v);
    r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
    return (uint8_t)(int8_t)r;
}

/* reference.INT8_FLOOR, 2^-119, as float32 bits: for every a >= it 127 / a is finite and
 * a / 127 normal (flush-to-zero never turns a scale into 0). */
#define KVS_I8_FLOOR 0x04000000u

static inline uint32_t abs_bits1(const void* base, int dtype, int64_t i) {
    if (dtype == KVS_F32) return ((const uint32_t*)base)[i] & 0x7fffffffu;
    return ((const uint16_t*)base)[i] & 0x7fffu;
}

#if KVS_AVX2
static inline __m256 load8(const void* base, int dtype, int64_t i) {
    if (dtype == KVS_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)base + i)));
    if (dtype == KVS_BF16) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)base + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    return _mm256_loadu_ps((const float*)base + i);
}

static inline void store8(void* base, int dtype, int64_t i, __m256 v) {
    if (dtype == KVS_F16) {
        _mm_storeu_si128((__m128i*)((uint16_t*)base + i),
                         _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else if (dtype == KVS_BF16) {
        __m256i u = _mm256_castps_si256(v);
        __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
        __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
        __m256i nan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7f800000));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i*)((uint16_t*)base + i), packed);
    } else {
        _mm256_storeu_ps((float*)base + i, v);
    }
}

/* Eight scaled floats -> eight e4m3 codes in the low byte of each 32-bit lane. */
static inline __m256i e4m3_8(__m256 v) {
    const __m256i denorm_mask = _mm256_set1_epi32((int)(141u << 23));
    __m256i fb = _mm256_castps_si256(v);
    const __m256i sign = _mm256_and_si256(fb, _mm256_set1_epi32((int)0x80000000u));
    fb = _mm256_xor_si256(fb, sign);
    const __m256i big = _mm256_cmpgt_epi32(fb, _mm256_set1_epi32((int)((1087u << 20) - 1)));
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(121u << 23)), fb);
    const __m256 dn = _mm256_add_ps(_mm256_castsi256_ps(fb), _mm256_castsi256_ps(denorm_mask));
    const __m256i rd = _mm256_sub_epi32(_mm256_castps_si256(dn), denorm_mask);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(fb, 20), _mm256_set1_epi32(1));
    __m256i rn = _mm256_add_epi32(fb, _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7ffffu)));
    rn = _mm256_srli_epi32(_mm256_add_epi32(rn, odd), 20);
    __m256i r = _mm256_blendv_epi8(rn, rd, small);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7f), big);
    return _mm256_or_si256(_mm256_and_si256(r, _mm256_set1_epi32(0xff)), _mm256_srli_epi32(sign, 24));
}

static inline __m256 e4m3_to_f32_8(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    const __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    const __m256i nrm = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32((int)(120u << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0x1p-9f));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em);
    const __m256i is_nan = _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7f));
    __m256i v = _mm256_blendv_epi8(nrm, _mm256_castps_si256(sub), is_sub);
    v = _mm256_blendv_epi8(v, _mm256_set1_epi32(0x7fc00000), is_nan);
    return _mm256_castsi256_ps(_mm256_or_si256(v, sign));
}

/* Eight values -> eight int8 codes as int32 (|.| <= 127, or -128 the caller clamps). */
static inline __m256i i8_8(__m256 x, __m256 vinv) {
    return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

/* Largest |x| over a group's Q rows of S elements (row stride `stride`), as fp32 bits. */
static uint32_t group_amax(const void* base, int dtype, int64_t off, int64_t Q, int64_t stride, int64_t S) {
    uint32_t m = 0;
#if KVS_AVX2
    /* One vector accumulator for the whole group; one horizontal reduction at the end. */
    __m256i acc = _mm256_setzero_si256();
    const int half = dtype != KVS_F32;
    const int64_t width = half ? 16 : 8;
    const int64_t vec_end = S - S % width;
    for (int64_t q = 0; q < Q; q++) {
        const int64_t row = off + q * stride;
        if (half) {
            const __m256i mask = _mm256_set1_epi16(0x7fff);
            for (int64_t s = 0; s < vec_end; s += 16) {
                __m256i v = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + row + s));
                acc = _mm256_max_epu16(acc, _mm256_and_si256(v, mask));
            }
        } else {
            const __m256i mask = _mm256_set1_epi32(0x7fffffff);
            for (int64_t s = 0; s < vec_end; s += 8) {
                __m256i v = _mm256_loadu_si256((const __m256i*)((const uint32_t*)base + row + s));
                acc = _mm256_max_epu32(acc, _mm256_and_si256(v, mask));
            }
        }
        for (int64_t s = vec_end; s < S; s++) {
            const uint32_t a = abs_bits1(base, dtype, row + s);
            m = a > m ? a : m;
        }
    }
    if (half) {
        uint16_t lanes[16];
        _mm256_storeu_si256((__m256i*)lanes, acc);
        for (int i = 0; i < 16; i++) m = lanes[i] > m ? lanes[i] : m;
    } else {
        uint32_t lanes[8];
        _mm256_storeu_si256((__m256i*)lanes, acc);
        for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    }
#else
    for (int64_t q = 0; q < Q; q++) {
        const int64_t row = off + q * stride;
        for (int64_t s = 0; s < S; s++) {
            const uint32_t a = abs_bits1(base, dtype, row + s);
            m = a > m ? a : m;
        }
    }
#endif
    /* Half-width bits to fp32 bits (exact; inf/NaN stay non-finite). */
    if (dtype == KVS_F16) return f2u(h2f((uint16_t)m));
    if (dtype == KVS_BF16) return m << 16;
    return m;
}

static void quantize_rows(const void* base, int dtype, int64_t off, int64_t Q, int64_t stride, int64_t S,
                          float inv, uint8_t* out) {
    for (int64_t q = 0; q < Q; q++) {
        const int64_t row = off + q * stride;
        uint8_t* o = out + q * stride;
        int64_t s = 0;
#if KVS_AVX2
        const __m256 vinv = _mm256_set1_ps(inv);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (; s + 32 <= S; s += 32) {
            __m256i a = e4m3_8(_mm256_mul_ps(load8(base, dtype, row + s), vinv));
            __m256i b = e4m3_8(_mm256_mul_ps(load8(base, dtype, row + s + 8), vinv));
            __m256i c = e4m3_8(_mm256_mul_ps(load8(base, dtype, row + s + 16), vinv));
            __m256i d = e4m3_8(_mm256_mul_ps(load8(base, dtype, row + s + 24), vinv));
            __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
            _mm256_storeu_si256((__m256i*)(o + s), _mm256_permutevar8x32_epi32(bytes, order));
        }
#endif
        for (; s < S; s++) o[s] = f2e4m3(load1(base, dtype, row + s) * inv);
    }
}

/* Not specialised per call site: gcc's constant propagation into build_lut16's call raises
 * false -Waggressive-loop-optimizations warnings, and the function is per group anyway. */
KVS_NOIPA static void dequantize_rows(const uint8_t* in, int64_t Q, int64_t stride, int64_t S, float scale,
                            void* base, int dtype, int64_t off) {
    const float top = dtype_max(dtype);
    for (int64_t q = 0; q < Q; q++) {
        const uint8_t* x = in + q * stride;
        const int64_t row = off + q * stride;
        int64_t s = 0;
#if KVS_AVX2
        const __m256 vs = _mm256_set1_ps(scale);
        const __m256 hi = _mm256_set1_ps(top), lo = _mm256_set1_ps(-top);
        for (; s + 8 <= S; s += 8) {
            __m256 v = _mm256_mul_ps(e4m3_to_f32_8(x + s), vs);
            v = _mm256_blendv_ps(v, hi, _mm256_cmp_ps(v, hi, _CMP_GT_OQ));  /* NaN stays NaN */
            v = _mm256_blendv_ps(v, lo, _mm256_cmp_ps(v, lo, _CMP_LT_OQ));
            store8(base, dtype, row + s, v);
        }
#endif
        for (; s < S; s++) store1(base, dtype, row + s, saturate(e4m32f(x[s]) * scale, top));
    }
}

/* int8 rows: inv is finite (the floor), so x * inv is too. */
static void i8_quantize_rows(const void* base, int dtype, int64_t off, int64_t Q, int64_t stride,
                             int64_t S, float inv, uint8_t* out) {
    for (int64_t q = 0; q < Q; q++) {
        const int64_t row = off + q * stride;
        uint8_t* o = out + q * stride;
        int64_t s = 0;
#if KVS_AVX2
        const __m256 vinv = _mm256_set1_ps(inv);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256i lo = _mm256_set1_epi8(-127);
#define KVS_I8_8(k) i8_8(load8(base, dtype, row + s + (k)), vinv)
        for (; s + 32 <= S; s += 32) {
            /* Signed saturating packs clamp at +127 (and -128); the max makes it -127. */
            const __m256i ab = _mm256_packs_epi32(KVS_I8_8(0), KVS_I8_8(8));
            const __m256i cd = _mm256_packs_epi32(KVS_I8_8(16), KVS_I8_8(24));
            const __m256i bytes = _mm256_max_epi8(_mm256_packs_epi16(ab, cd), lo);
            _mm256_storeu_si256((__m256i*)(o + s), _mm256_permutevar8x32_epi32(bytes, order));
        }
        for (; s + 8 <= S; s += 8) {
            const __m256i v = KVS_I8_8(0);
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64((__m128i*)(o + s), _mm_max_epi8(_mm_packs_epi16(w, w), _mm_set1_epi8(-127)));
        }
#undef KVS_I8_8
#endif
        for (; s < S; s++) o[s] = f2i8(load1(base, dtype, row + s) * inv);
    }
}

/* `clamp`: whether 128 * scale can pass the dtype's max (else no product can: codes are in
 * [-128, 127] and a rounded product is monotonic in the code). */
static inline void i8_dequantize_rows_(const uint8_t* in, int64_t Q, int64_t stride, int64_t S,
                                       float scale, void* base, int dtype, int64_t off, int clamp) {
    const float top = dtype_max(dtype);
    for (int64_t q = 0; q < Q; q++) {
        const uint8_t* x = in + q * stride;
        const int64_t row = off + q * stride;
        int64_t s = 0;
#if KVS_AVX2
        const __m256 vs = _mm256_set1_ps(scale);
        const __m256 hi = _mm256_set1_ps(top), lo = _mm256_set1_ps(-top);
        for (; s + 8 <= S; s += 8) {
            const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(x + s)));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(c), vs);
            /* Never NaN (finite codes, finite positive scale): min/max saturate +-inf. */
            if (clamp) v = _mm256_max_ps(_mm256_min_ps(v, hi), lo);
            store8(base, dtype, row + s, v);
        }
#else
        (void)clamp;  /* the scalar path always saturates: one compare */
#endif
        for (; s < S; s++) store1(base, dtype, row + s, saturate((float)(int8_t)x[s] * scale, top));
    }
}

static void i8_dequantize_rows(const uint8_t* in, int64_t Q, int64_t stride, int64_t S, float scale,
                               void* base, int dtype, int64_t off) {
    if (scale * 128.0f > dtype_max(dtype))
        i8_dequantize_rows_(in, Q, stride, S, scale, base, dtype, off, 1);
    else
        i8_dequantize_rows_(in, Q, stride, S, scale, base, dtype, off, 0);
}

#if KVS_AVX2 && defined(__AVX512BW__)
#define KVS_LUT 1
/* 16-bit destinations with AVX-512BW: a scale has only 256 possible outputs, so decode
 * them once (with dequantize_rows itself, hence bit for bit the same) and look each code up:
 * 32 codes per 4 two-source permutes and 3 blends, against ~16 operations per 8 codes.
 * Groups with the same scale (powers of two repeat) reuse the table. */
typedef union { uint16_t h[256]; float f[256]; } kvs_lut;  /* sized for any dtype's store */

static void build_lut16(float scale, int dtype, kvs_lut* lut) {
    uint8_t codes[256];
    for (int i = 0; i < 256; i++) codes[i] = (uint8_t)i;
    dequantize_rows(codes, 1, 0, 256, scale, lut->f, dtype, 0);
}

static void lut_rows(const uint8_t* in, int64_t Q, int64_t stride, int64_t S, const uint16_t* lut,
                     uint16_t* base, int64_t off) {
    __m512i t[8];
    for (int i = 0; i < 8; i++) t[i] = _mm512_loadu_si512((const void*)(lut + 32 * i));
    const __m512i bit6 = _mm512_set1_epi16(0x40), bit7 = _mm512_set1_epi16(0x80);
    for (int64_t q = 0; q < Q; q++) {
        const uint8_t* x = in + q * stride;
        uint16_t* o = base + off + q * stride;
        int64_t s = 0;
        for (; s + 32 <= S; s += 32) {
            const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(x + s)));
            const __m512i r0 = _mm512_permutex2var_epi16(t[0], idx, t[1]);
            const __m512i r1 = _mm512_permutex2var_epi16(t[2], idx, t[3]);
            const __m512i r2 = _mm512_permutex2var_epi16(t[4], idx, t[5]);
            const __m512i r3 = _mm512_permutex2var_epi16(t[6], idx, t[7]);
            const __mmask32 b6 = _mm512_test_epi16_mask(idx, bit6);
            const __mmask32 b7 = _mm512_test_epi16_mask(idx, bit7);
            const __m512i lo = _mm512_mask_blend_epi16(b6, r0, r1);
            const __m512i hi = _mm512_mask_blend_epi16(b6, r2, r3);
            _mm512_storeu_si512((void*)(o + s), _mm512_mask_blend_epi16(b7, lo, hi));
        }
        for (; s < S; s++) o[s] = lut[x[s]];
    }
}
#else
#define KVS_LUT 0
#endif

int kvs_fp8_has_simd(void) { return KVS_AVX2 + KVS_LUT; }

enum { KVS_FP8 = 0, KVS_I8 = 1 };

/* Gather the blocks `ids` of one layer tensor and quantize them into `out` / `scales`.
 * Returns the number of groups holding inf or NaN (the output is then not usable). */
static inline int64_t quantize_layer(int codec, const void* src, int dtype, int64_t num_blocks,
                                     int64_t planes, const int64_t* ids, int64_t n, int64_t P,
                                     int64_t Q, int64_t R, int64_t S, uint8_t* out, float* scales) {
    const int64_t chunk = P * Q * R * S, stride = R * S;
    const int esize = dtype == KVS_F32 ? 4 : 2;
    int64_t bad = 0;
    for (int64_t pl = 0; pl < planes; pl++) {
        for (int64_t j = 0; j < n; j++) {
            const int64_t c = (pl * num_blocks + ids[j]) * chunk;
            const char* blk = (const char*)src + c * esize;
            uint8_t* o = out + (pl * n + j) * chunk;
            float* sc = scales + (pl * n + j) * P * R;
            for (int64_t p = 0; p < P; p++) {
                for (int64_t r = 0; r < R; r++) {
                    const int64_t off = (p * Q * R + r) * S;
                    const uint32_t amax = group_amax(blk, dtype, off, Q, stride, S);
                    if (amax >= 0x7f800000u) {
                        bad++;
                        sc[p * R + r] = 1.0f;
                        continue;
                    }
                    if (codec == KVS_I8) {
                        const float a = u2f(amax < KVS_I8_FLOOR ? KVS_I8_FLOOR : amax);
                        sc[p * R + r] = a / 127.0f;
                        i8_quantize_rows(blk, dtype, off, Q, stride, S, 127.0f / a, o + off);
                        continue;
                    }
                    const int e = scale_exponent(amax);
                    sc[p * R + r] = u2f((uint32_t)(e + 127) << 23);
                    quantize_rows(blk, dtype, off, Q, stride, S, u2f((uint32_t)(127 - e) << 23), o + off);
                }
            }
        }
    }
    return bad;
}

int64_t kvs_fp8_quantize(const void* src, int dtype, int64_t num_blocks, int64_t planes,
                         const int64_t* ids, int64_t n, int64_t P, int64_t Q, int64_t R, int64_t S,
                         uint8_t* out, float* scales) {
    return quantize_layer(KVS_FP8, src, dtype, num_blocks, planes, ids, n, P, Q, R, S, out, scales);
}

int64_t kvs_i8_quantize(const void* src, int dtype, int64_t num_blocks, int64_t planes,
                        const int64_t* ids, int64_t n, int64_t P, int64_t Q, int64_t R, int64_t S,
                        uint8_t* out, float* scales) {
    return quantize_layer(KVS_I8, src, dtype, num_blocks, planes, ids, n, P, Q, R, S, out, scales);
}

/* Scales come off the wire: the number not finite and positive (tested on the bits). */
static int64_t bad_scales(const float* scales, int64_t groups) {
    int64_t bad = 0;
    for (int64_t g = 0; g < groups; g++) {
        const uint32_t u = f2u(scales[g]);
        bad += (u & 0x80000000u) || u >= 0x7f800000u || u == 0;
    }
    return bad;
}

/* Dequantize `in` / `scales` into the blocks `ids` of one layer tensor. Scales come off the
 * wire: any that is not finite and positive fails the call before a byte is written. */
int64_t kvs_fp8_dequantize(const uint8_t* in, const float* scales, int64_t n, int64_t planes,
                           int64_t P, int64_t Q, int64_t R, int64_t S,
                           void* dst, int dtype, int64_t num_blocks, const int64_t* ids) {
    const int64_t chunk = P * Q * R * S, stride = R * S;
    const int esize = dtype == KVS_F32 ? 4 : 2;
    const int64_t bad = bad_scales(scales, planes * n * P * R);
    if (bad) return bad;
#if KVS_LUT
    kvs_lut lut;
    uint32_t lut_scale = 0;  /* 0 is never a valid scale: no table yet */
#endif
    for (int64_t pl = 0; pl < planes; pl++) {
        for (int64_t j = 0; j < n; j++) {
            char* blk = (char*)dst + (pl * num_blocks + ids[j]) * chunk * esize;
            const uint8_t* x = in + (pl * n + j) * chunk;
            const float* sc = scales + (pl * n + j) * P * R;
            for (int64_t p = 0; p < P; p++)
                for (int64_t r = 0; r < R; r++) {
                    const int64_t off = (p * Q * R + r) * S;
#if KVS_LUT
                    if (dtype != KVS_F32) {
                        if (f2u(sc[p * R + r]) != lut_scale) {
                            lut_scale = f2u(sc[p * R + r]);
                            build_lut16(sc[p * R + r], dtype, &lut);
                        }
                        lut_rows(x + off, Q, stride, S, lut.h, (uint16_t*)blk, off);
                        continue;
                    }
#endif
                    dequantize_rows(x + off, Q, stride, S, sc[p * R + r], blk, dtype, off);
                }
        }
    }
    return 0;
}

/* int8: the same, codes are int8 and scales arbitrary floats (no table: each group's differs). */
int64_t kvs_i8_dequantize(const uint8_t* in, const float* scales, int64_t n, int64_t planes,
                          int64_t P, int64_t Q, int64_t R, int64_t S,
                          void* dst, int dtype, int64_t num_blocks, const int64_t* ids) {
    const int64_t chunk = P * Q * R * S, stride = R * S;
    const int esize = dtype == KVS_F32 ? 4 : 2;
    const int64_t bad = bad_scales(scales, planes * n * P * R);
    if (bad) return bad;
    for (int64_t pl = 0; pl < planes; pl++) {
        for (int64_t j = 0; j < n; j++) {
            char* blk = (char*)dst + (pl * num_blocks + ids[j]) * chunk * esize;
            const uint8_t* x = in + (pl * n + j) * chunk;
            const float* sc = scales + (pl * n + j) * P * R;
            for (int64_t p = 0; p < P; p++)
                for (int64_t r = 0; r < R; r++) {
                    const int64_t off = (p * Q * R + r) * S;
                    i8_dequantize_rows(x + off, Q, stride, S, sc[p * R + r], blk, dtype, off);
                }
        }
    }
    return 0;
}
