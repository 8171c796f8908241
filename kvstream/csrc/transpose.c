/*
 * kvstream batched matrix transpose, CPU: n items, item k a `rows` x `cols`
 * matrix of `esize`-byte elements at src + src_off[k] (row stride `src_stride` elements,
 * elements contiguous in a row), written transposed, `cols` x `rows`, at dst + dst_off[k]
 * (row stride `dst_stride` elements).
 *
 * Why: vLLM's CPU attention keeps K per block and head as [head_dim, block_size], the wire
 * (kvstream/transfer/plan.py) as [tokens, heads, head_dim]. torch moves such a transposed
 * view one strided element at a time (2.2 GB/s unpacking 16 MiB of fp16 here); this moves
 * 8 x 8 tiles of 2-byte elements and 4 x 4 tiles of 4-byte ones through SSE2 registers.
 *
 * Built on first use by kvstream/transfer/transpose.py (cc -O3 -shared, -march=native on
 * x86-64) and called through ctypes, which releases the GIL. Every item is bounds-checked
 * before any byte is written: a bad offset fails the call and leaves dst untouched. Items
 * must not overlap between src and dst.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define KVS_SSE2 1
#else
#define KVS_SSE2 0
#endif

enum { KVS_OK = 0, KVS_EARG = -1, KVS_EDST = -2, KVS_ESRC = -3 };

static int in_bounds(int64_t off, int64_t extent, int64_t size) {
    return off >= 0 && extent >= 0 && off <= size - extent;
}

/* One element's bytes, for any esize (the compiler turns each size into one move). */
static inline void move_one(char *d, const char *s, int64_t esize) {
    switch (esize) {
    case 1: *d = *s; break;
    case 2: memcpy(d, s, 2); break;
    case 4: memcpy(d, s, 4); break;
    case 8: memcpy(d, s, 8); break;
    default: memcpy(d, s, (size_t)esize);
    }
}

/* Rows [r0, r1) x columns [c0, c1) element by element (edges, other sizes). */
static void transpose_plain(char *dst, const char *src, int64_t r0, int64_t r1, int64_t c0,
                            int64_t c1, int64_t ss, int64_t ds, int64_t esize) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++)
            move_one(dst + (c * ds + r) * esize, src + (r * ss + c) * esize, esize);
}

#if KVS_SSE2
/* One 8 x 8 tile of 16-bit elements. */
static inline void tile16(char *dst, const char *src, int64_t ss, int64_t ds) {
    __m128i a[8], b[8], c[8];
    for (int i = 0; i < 8; i++) a[i] = _mm_loadu_si128((const __m128i *)(src + i * ss * 2));
    for (int i = 0; i < 4; i++) {
        b[2 * i] = _mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]);
    }
    /* b0: r0r1 cols 0-3, b1: r0r1 cols 4-7, b2: r2r3 0-3, b3: r2r3 4-7, ... */
    c[0] = _mm_unpacklo_epi32(b[0], b[2]); c[1] = _mm_unpackhi_epi32(b[0], b[2]);
    c[2] = _mm_unpacklo_epi32(b[1], b[3]); c[3] = _mm_unpackhi_epi32(b[1], b[3]);
    c[4] = _mm_unpacklo_epi32(b[4], b[6]); c[5] = _mm_unpackhi_epi32(b[4], b[6]);
    c[6] = _mm_unpacklo_epi32(b[5], b[7]); c[7] = _mm_unpackhi_epi32(b[5], b[7]);
    /* c0: r0-3 cols 0,1; c1: r0-3 cols 2,3; c2: cols 4,5; c3: cols 6,7 (c4-7: r4-7) */
    for (int i = 0; i < 4; i++) {
        __m128i lo = _mm_unpacklo_epi64(c[i], c[i + 4]);
        __m128i hi = _mm_unpackhi_epi64(c[i], c[i + 4]);
        _mm_storeu_si128((__m128i *)(dst + (2 * i) * ds * 2), lo);
        _mm_storeu_si128((__m128i *)(dst + (2 * i + 1) * ds * 2), hi);
    }
}

/* One 4 x 4 tile of 32-bit elements. */
static inline void tile32(char *dst, const char *src, int64_t ss, int64_t ds) {
    __m128i r0 = _mm_loadu_si128((const __m128i *)(src));
    __m128i r1 = _mm_loadu_si128((const __m128i *)(src + ss * 4));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(src + 2 * ss * 4));
    __m128i r3 = _mm_loadu_si128((const __m128i *)(src + 3 * ss * 4));
    __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpackhi_epi32(r0, r1);
    __m128i t2 = _mm_unpacklo_epi32(r2, r3), t3 = _mm_unpackhi_epi32(r2, r3);
    _mm_storeu_si128((__m128i *)(dst), _mm_unpacklo_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(dst + ds * 4), _mm_unpackhi_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(dst + 2 * ds * 4), _mm_unpacklo_epi64(t1, t3));
    _mm_storeu_si128((__m128i *)(dst + 3 * ds * 4), _mm_unpackhi_epi64(t1, t3));
}
#endif

static void transpose_one(char *dst, const char *src, int64_t rows, int64_t cols, int64_t ss,
                          int64_t ds, int64_t esize) {
#if KVS_SSE2
    const int64_t t = esize == 2 ? 8 : esize == 4 ? 4 : 0;
    if (t) {
        const int64_t rt = rows - rows % t, ct = cols - cols % t;
        for (int64_t r = 0; r < rt; r += t)
            for (int64_t c = 0; c < ct; c += t) {
                const char *s = src + (r * ss + c) * esize;
                char *d = dst + (c * ds + r) * esize;
                if (t == 8) tile16(d, s, ss, ds); else tile32(d, s, ss, ds);
            }
        transpose_plain(dst, src, 0, rt, ct, cols, ss, ds, esize);
        transpose_plain(dst, src, rt, rows, 0, cols, ss, ds, esize);
        return;
    }
#endif
    transpose_plain(dst, src, 0, rows, 0, cols, ss, ds, esize);
}

/* 0, or a negative code: KVS_EARG (a bad shape), KVS_EDST / KVS_ESRC (an item outside that
 * buffer; nothing was written). */
int64_t kvs_transpose_items(char *dst, int64_t dst_size, const int64_t *dst_off,
                            const char *src, int64_t src_size, const int64_t *src_off,
                            int64_t n, int64_t rows, int64_t cols, int64_t src_stride,
                            int64_t dst_stride, int64_t esize) {
    if (n < 0 || rows < 0 || cols < 0 || esize < 1 || esize > 16 || src_stride < cols ||
        dst_stride < rows || dst_size < 0 || src_size < 0)
        return KVS_EARG;
    if (!n || !rows || !cols) return KVS_OK;
    /* Extents in bytes; the shapes are a layer's, far below 2^62 (checked in Python too). */
    const int64_t src_extent = ((rows - 1) * src_stride + cols) * esize;
    const int64_t dst_extent = ((cols - 1) * dst_stride + rows) * esize;
    for (int64_t k = 0; k < n; k++) {
        if (!in_bounds(dst_off[k], dst_extent, dst_size)) return KVS_EDST;
        if (!in_bounds(src_off[k], src_extent, src_size)) return KVS_ESRC;
    }
    for (int64_t k = 0; k < n; k++)
        transpose_one(dst + dst_off[k], src + src_off[k], rows, cols, src_stride, dst_stride,
                      esize);
    return KVS_OK;
}
