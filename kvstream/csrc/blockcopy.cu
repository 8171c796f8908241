/*
 * kvstream batched block copy, CUDA path: n items of `nbytes` each, item i from
 * src + src_off[i] to dst + dst_off[i], in one launch. The same-host "one copy" path opens the
 * source's KV through CUDA IPC and copies its scattered blocks straight into scattered blocks
 * of the destination's KV with this: one copy, no staging, one launch per layer.
 *
 * Compiled at run time by cupy's RawModule (NVRTC) and launched by kvstream/dataplane/
 * blockcopy.py (CudaBlockCopy), which checks every item against both sizes on the host before
 * the launch. CI compile-checks it with nvcc (sm_80, sm_90). No #include, as NVRTC has none.
 *
 * Grid: 1-D, one CUDA block per tile; an item is ceil(nbytes / TILE) tiles with TILE =
 * blockDim.x * KVS_TILE_PER_THREAD bytes (16 KiB at 256 threads), so tile t is tile t % tiles
 * of item t / tiles. The launcher sizes the grid to every tile of every item; a smaller grid
 * (past 2^31 - 1 tiles) strides over the rest.
 *
 * Width: an item whose source and destination addresses agree modulo 16 (torch's allocations
 * and whole-chunk offsets always do) moves as 16-byte vectors, each thread with four loads in
 * flight before its stores; one agreeing modulo 8, 4 or 2 with that word, others byte by byte.
 * The bytes before the destination's first aligned word and after the last whole one (under
 * the width each) are copied by the item's first tile.
 *
 * Guard: an item outside either buffer (which the launcher refuses before launching) is
 * skipped here too, never written, and counted in *bad when bad is not null.
 */

#define KVS_THREADS 256
/* Bytes of an item one thread moves per tile: four 16-byte vectors. */
#define KVS_TILE_PER_THREAD 64

typedef long long kvs_i64;
typedef unsigned long long kvs_u64;
/* Our own 16- and 8-byte words (not uint4 / uint2: the emulation and any NVRTC see the same). */
struct alignas(16) kvs_w16 { unsigned int x, y, z, w; };
struct alignas(8) kvs_w8 { unsigned int x, y; };

/* Units [lo, hi) of the item, blockDim.x threads apart, four loads in flight per thread. */
template <typename T>
__device__ __forceinline__ void copy_units(T* __restrict__ d, const T* __restrict__ s, kvs_i64 lo,
                                           kvs_i64 hi) {
    const kvs_i64 step = blockDim.x;
    kvs_i64 u = lo + threadIdx.x;
    for (; u + 3 * step < hi; u += 4 * step) {
        const T a = s[u];
        const T b = s[u + step];
        const T c = s[u + 2 * step];
        const T e = s[u + 3 * step];
        d[u] = a;
        d[u + step] = b;
        d[u + 2 * step] = c;
        d[u + 3 * step] = e;
    }
    for (; u < hi; u += step) d[u] = s[u];
}

/* Tile `tile` of one item, in words of type T (the addresses agree modulo sizeof(T)). */
template <typename T>
__device__ __forceinline__ void copy_tile(unsigned char* __restrict__ d,
                                          const unsigned char* __restrict__ s, kvs_i64 nbytes,
                                          kvs_i64 tile, kvs_i64 tile_bytes) {
    const kvs_i64 w = (kvs_i64)sizeof(T);
    kvs_i64 head = (kvs_i64)((0 - (kvs_u64)d) & (kvs_u64)(w - 1));
    if (head > nbytes) head = nbytes;
    const kvs_i64 words = (nbytes - head) / w;
    const kvs_i64 tail = nbytes - head - words * w;
    const kvs_i64 per_tile = tile_bytes / w;
    const kvs_i64 lo = tile * per_tile;
    const kvs_i64 hi = lo + per_tile < words ? lo + per_tile : words;
    if (lo < hi) copy_units<T>((T*)(d + head), (const T*)(s + head), lo, hi);
    if (tile == 0) {
        for (kvs_i64 k = threadIdx.x; k < head + tail; k += blockDim.x) {
            const kvs_i64 at = k < head ? k : nbytes - tail + (k - head);
            d[at] = s[at];
        }
    }
}

extern "C" __global__ void __launch_bounds__(KVS_THREADS)
kvs_copy_blocks(unsigned char* __restrict__ dst, kvs_i64 dst_size, const kvs_i64* __restrict__ dst_off,
                const unsigned char* __restrict__ src, kvs_i64 src_size,
                const kvs_i64* __restrict__ src_off, kvs_i64 n, kvs_i64 nbytes,
                kvs_u64* __restrict__ bad) {
    const kvs_i64 tile_bytes = (kvs_i64)blockDim.x * KVS_TILE_PER_THREAD;
    const kvs_i64 tiles = nbytes > 0 ? (nbytes + tile_bytes - 1) / tile_bytes : 1;
    for (kvs_i64 t = blockIdx.x; t < n * tiles; t += gridDim.x) {
        const kvs_i64 item = t / tiles;
        const kvs_i64 tile = t - item * tiles;
        const kvs_i64 doff = dst_off[item];
        const kvs_i64 soff = src_off[item];
        /* nbytes, dst_size, src_size >= 0 (the launcher's checks): no overflow here. */
        if (doff < 0 || doff > dst_size - nbytes || soff < 0 || soff > src_size - nbytes) {
            if (tile == 0 && threadIdx.x == 0 && bad) atomicAdd(bad, 1ull);
            continue;
        }
        unsigned char* d = dst + doff;
        const unsigned char* s = src + soff;
        const kvs_u64 x = (kvs_u64)d ^ (kvs_u64)s;
        if ((x & 15) == 0) copy_tile<kvs_w16>(d, s, nbytes, tile, tile_bytes);
        else if ((x & 7) == 0) copy_tile<kvs_w8>(d, s, nbytes, tile, tile_bytes);
        else if ((x & 3) == 0) copy_tile<unsigned int>(d, s, nbytes, tile, tile_bytes);
        else if ((x & 1) == 0) copy_tile<unsigned short>(d, s, nbytes, tile, tile_bytes);
        else copy_tile<unsigned char>(d, s, nbytes, tile, tile_bytes);
    }
}
