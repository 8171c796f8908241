/*
 * kvstream batched block copy, CPU path: n items of `nbytes` each, item i from
 * src + src_off[i] to dst + dst_off[i], in one call. The same-host "one copy" path maps the
 * source's KV read-only and copies its scattered blocks straight into scattered destination
 * blocks with this: one copy, no staging buffer.
 *
 * Built on first use by kvstream/dataplane/blockcopy.py (cc -O3 -shared, -march=native on
 * x86-64) and called through ctypes, which releases the GIL for the call. No threads here:
 * the caller splits the items across its own threads when it wants more than one core.
 *
 * Every item is bounds-checked before any byte is copied (off >= 0, off + nbytes <= size,
 * computed without overflow), so a bad offset fails the call and leaves dst untouched.
 * Items must not overlap between src and dst (as memcpy); with repeated dst offsets the
 * last item wins.
 *
 * Strategies (kvs_copy_blocks_with; kvs_copy_blocks is KVS_AUTO): memcpy per item, or
 * non-temporal stores (the widest of SSE2 / AVX / AVX-512 the build has: unaligned loads,
 * aligned streaming stores, one sfence per call). AUTO streams once the batch is at least
 * this core's L2 cache and the items at least four vectors: the stores then skip the
 * read-for-ownership of every destination line (a third of memcpy's memory traffic) and
 * leave the caches to the engine. Below that, src and dst are cache-resident and memcpy
 * (glibc's rep movsb) is faster. Software prefetches (of the next item, or ahead in this
 * one) measured slower with either store, so there are none; csrc/README.md has the numbers.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__SSE2__)
#include <immintrin.h>
#define KVS_STREAMING 1
#if defined(__AVX512F__)
#define KVS_VEC 64
#elif defined(__AVX__)
#define KVS_VEC 32
#else
#define KVS_VEC 16
#endif
#else
#define KVS_STREAMING 0
#define KVS_VEC 0
#endif

enum { KVS_OK = 0, KVS_EARG = -1, KVS_EDST = -2, KVS_ESRC = -3 };
enum { KVS_AUTO = 0, KVS_MEMCPY = 1, KVS_STREAM = 2 };

/* Width of the streaming stores this build uses (0: none), for the loader's report. */
int kvs_copy_blocks_vector_bytes(void) { return KVS_VEC; }

/* AUTO streams batches of at least this core's L2 (1 MiB where sysconf does not say), read
 * once when the library is loaded. */
static int64_t kvs_stream_threshold = (int64_t)1 << 20;

__attribute__((constructor)) static void kvs_read_cache_size(void) {
#ifdef _SC_LEVEL2_CACHE_SIZE
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 > 0) kvs_stream_threshold = (int64_t)l2;
#endif
}

/* The batch size at which AUTO starts to stream (bytes). */
int64_t kvs_copy_blocks_stream_threshold(void) { return kvs_stream_threshold; }

static int in_bounds(int64_t off, int64_t nbytes, int64_t size) {
    /* size >= 0 and nbytes >= 0 are checked first, so size - nbytes cannot overflow. */
    return off >= 0 && off <= size - nbytes;
}

#if KVS_STREAMING
#if KVS_VEC == 64
typedef __m512i kvs_vec;
#define KVS_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define KVS_STORE(p, v) _mm512_stream_si512((void *)(p), (v))
#elif KVS_VEC == 32
typedef __m256i kvs_vec;
#define KVS_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define KVS_STORE(p, v) _mm256_stream_si256((__m256i *)(p), (v))
#else
typedef __m128i kvs_vec;
#define KVS_LOAD(p) _mm_loadu_si128((const __m128i *)(p))
#define KVS_STORE(p, v) _mm_stream_si128((__m128i *)(p), (v))
#endif

/* memcpy with streaming stores: the head up to dst's vector alignment and the tail by memcpy,
 * the body four vectors (a cache line or more) at a time. */
static void copy_streaming(uint8_t *d, const uint8_t *s, size_t n) {
    const size_t head = (size_t)(-(uintptr_t)d) & (KVS_VEC - 1);
    if (n < head + 4 * KVS_VEC) {
        memcpy(d, s, n);
        return;
    }
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 4 * KVS_VEC; n -= 4 * KVS_VEC, d += 4 * KVS_VEC, s += 4 * KVS_VEC) {
        const kvs_vec a = KVS_LOAD(s), b = KVS_LOAD(s + KVS_VEC);
        const kvs_vec c = KVS_LOAD(s + 2 * KVS_VEC), e = KVS_LOAD(s + 3 * KVS_VEC);
        KVS_STORE(d, a);
        KVS_STORE(d + KVS_VEC, b);
        KVS_STORE(d + 2 * KVS_VEC, c);
        KVS_STORE(d + 3 * KVS_VEC, e);
    }
    for (; n >= KVS_VEC; n -= KVS_VEC, d += KVS_VEC, s += KVS_VEC) KVS_STORE(d, KVS_LOAD(s));
    memcpy(d, s, n);
}
#endif

/* The batch with an explicit strategy (KVS_AUTO, KVS_MEMCPY, KVS_STREAM; streaming without
 * SSE2 is memcpy). Returns 0, KVS_EARG for negative counts or sizes or a null
 * pointer, KVS_EDST / KVS_ESRC when some item falls outside dst / src (nothing copied). */
int64_t kvs_copy_blocks_with(uint8_t *dst, int64_t dst_size, const int64_t *dst_off,
                             const uint8_t *src, int64_t src_size, const int64_t *src_off,
                             int64_t n, int64_t nbytes, int strategy) {
    if (n < 0 || nbytes < 0 || dst_size < 0 || src_size < 0) return KVS_EARG;
    if (n == 0) return KVS_OK;
    if (!dst_off || !src_off || (nbytes > 0 && (!dst || !src))) return KVS_EARG;
    for (int64_t i = 0; i < n; i++) {
        if (!in_bounds(dst_off[i], nbytes, dst_size)) return KVS_EDST;
        if (!in_bounds(src_off[i], nbytes, src_size)) return KVS_ESRC;
    }
    if (nbytes == 0) return KVS_OK;
    if (strategy == KVS_AUTO) {
        const int big = nbytes >= 4 * KVS_VEC && n >= (kvs_stream_threshold + nbytes - 1) / nbytes;
        strategy = KVS_VEC && big ? KVS_STREAM : KVS_MEMCPY;
    }
#if KVS_STREAMING
    if (strategy == KVS_STREAM) {
        for (int64_t i = 0; i < n; i++)
            copy_streaming(dst + dst_off[i], src + src_off[i], (size_t)nbytes);
        _mm_sfence();  /* streaming stores are weakly ordered: visible before we return */
        return KVS_OK;
    }
#endif
    for (int64_t i = 0; i < n; i++) memcpy(dst + dst_off[i], src + src_off[i], (size_t)nbytes);
    return KVS_OK;
}

/* The batch, the fastest measured way (KVS_AUTO). */
int64_t kvs_copy_blocks(uint8_t *dst, int64_t dst_size, const int64_t *dst_off,
                        const uint8_t *src, int64_t src_size, const int64_t *src_off,
                        int64_t n, int64_t nbytes) {
    return kvs_copy_blocks_with(dst, dst_size, dst_off, src, src_size, src_off, n, nbytes,
                                KVS_AUTO);
}
