// Host (g++) emulation of the CUDA features csrc/fp8.cu and csrc/blockcopy.cu use, so that
// tests/unit/test_cuda_emulated.py can run the REAL kernel text on a CPU and compare it bit for
// bit with kvstream/quant/reference.py (fp8.cu) and a torch reference (blockcopy.cu). The test
// builds one translation unit per source:
//     #include "prelude.h" / fp8.cu with its PTX asm() rewritten to kvs_emu_cvt_*() / "tail.h"
//     #include "prelude.h" / blockcopy.cu
//
// Emulated:
//   - every CUDA thread of a block is a fiber (ucontext) with its own stack; threadIdx,
//     blockIdx, blockDim and gridDim are globals the scheduler sets before resuming a fiber;
//   - __syncthreads() and __shfl_xor_sync() are barriers (the block's, the warp's) at which a
//     fiber yields; fibers are resumed round-robin, so a run is deterministic. A barrier that
//     can never complete (a lane skips a shuffle, a thread returns before __syncthreads) ends
//     the launch with an error instead of hanging;
//   - __shared__ is a function-local static (blocks run one after another);
//   - float arithmetic: the __f*_rn intrinsics are plain IEEE float32 operations, built with
//     -ffp-contract=off and without fast-math (as NVRTC gets --fmad=false --ftz=false);
//     __float2int_rn is PTX cvt.rni.s32.f32 (half to even, saturating, NaN -> 0); the
//     f16 / bf16 conversions are the PTX cvt instructions (round to nearest even).
// Not emulated:
//   - real warp timing: between two barriers a fiber runs alone, so a race that needs lanes to
//     interleave differently (a missing __syncwarp, say) can go unseen; blocks never overlap;
//   - the memory model: everything is sequentially consistent, there are no caches,
//     __restrict__ aliasing is not checked, and out-of-bounds accesses are not trapped (the
//     test checks that bytes outside the expected output stay untouched instead);
//   - launch limits beyond "blockDim.x is whole warps, at most 1024" (__launch_bounds__ is
//     dropped), streams, and concurrent launches (the library is not thread safe).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>

#ifndef __FLT16_MAX__
#error "the CUDA emulation needs _Float16 (g++ >= 12 or clang >= 15 on x86-64 / aarch64)"
#endif

struct kvs_emu_dim3 { unsigned x, y, z; };
// Globals (not static): the compiler must assume a context switch changes them.
kvs_emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(n)
#define __shared__ static

// ---- fibers and barriers ----
struct KvsEmuBarrier { unsigned expected, arrived, generation; };
struct KvsEmuFiber { ucontext_t ctx; bool done; };

static const size_t kvs_emu_stack = 128 * 1024;
static ucontext_t kvs_emu_main;
static KvsEmuFiber* kvs_emu_fibers;
static char* kvs_emu_stacks;
static unsigned kvs_emu_capacity, kvs_emu_current;
static bool kvs_emu_progress;
static KvsEmuBarrier kvs_emu_block_bar, kvs_emu_warp_bar[32];
static unsigned kvs_emu_lanes[1024];   // __shfl_xor_sync's exchange slots, one per thread
static void (*kvs_emu_body)();          // runs the kernel with the launch's arguments

static void kvs_emu_yield() {
    swapcontext(&kvs_emu_fibers[kvs_emu_current].ctx, &kvs_emu_main);
}

static void kvs_emu_wait(KvsEmuBarrier& b) {
    const unsigned gen = b.generation;
    kvs_emu_progress = true;
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        b.generation++;
        return;
    }
    while (b.generation == gen) kvs_emu_yield();
}

inline void __syncthreads() { kvs_emu_wait(kvs_emu_block_bar); }

inline unsigned __shfl_xor_sync(unsigned mask, unsigned v, int lane_mask) {
    if (mask != 0xffffffffu) std::abort();  // fp8.cu only shuffles whole warps
    KvsEmuBarrier& warp = kvs_emu_warp_bar[threadIdx.x >> 5];
    kvs_emu_lanes[threadIdx.x] = v;
    kvs_emu_wait(warp);                     // every lane has published its value
    const unsigned r = kvs_emu_lanes[(threadIdx.x ^ (unsigned)lane_mask) & 1023u];
    kvs_emu_wait(warp);                     // every lane has read before any overwrites
    return r;
}

inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    const unsigned long long old = *p;     // fibers never run at the same time
    *p = old + v;
    return old;
}

// ---- float intrinsics and the PTX conversions fp8.cu writes as asm() ----
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

inline int __float2int_rn(float f) {         // cvt.rni.s32.f32
    if (f != f) return 0;
    if (f >= 2147483648.0f) return 2147483647;
    if (f <= -2147483648.0f) return (int)0x80000000u;
    return (int)std::nearbyint(f);          // the default rounding mode: half to even
}

inline float kvs_emu_cvt_f32_f16(unsigned short h) {           // cvt.f32.f16
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}

inline unsigned short kvs_emu_cvt_rn_f16_f32(float f) {        // cvt.rn.f16.f32
    const _Float16 x = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &x, 2);
    return h;
}

inline unsigned short kvs_emu_cvt_rn_bf16_f32(float f) {       // cvt.rn.bf16.f32 (sm_80+)
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;        // canonical NaN
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ---- the launcher ----
static void kvs_emu_entry() {
    kvs_emu_body();
    kvs_emu_fibers[kvs_emu_current].done = true;
    kvs_emu_progress = true;
}

static long long kvs_emu_args[16];
static void* kvs_emu_kernel;

// Every parameter of fp8.cu's and blockcopy.cu's kernels is 64 bits wide (a pointer or kvs_i64
// / kvs_u64), so a kernel is
// called as a function of N long longs (the same registers / stack slots on LP64).
// A fresh fiber for thread t (out of line: getcontext "returns twice" to the compiler).
__attribute__((noinline)) static void kvs_emu_start(unsigned t) {
    KvsEmuFiber& f = kvs_emu_fibers[t];
    f.done = false;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = kvs_emu_stacks + (size_t)t * kvs_emu_stack;
    f.ctx.uc_stack.ss_size = kvs_emu_stack;
    f.ctx.uc_link = &kvs_emu_main;
    makecontext(&f.ctx, kvs_emu_entry, 0);
}

template <int N, int... I> struct KvsEmuCall;
template <int... I> struct KvsEmuCall<0, I...> {
    static void run() {
        typedef void (*fn)(decltype((void)I, 0LL)...);
        ((fn)kvs_emu_kernel)(kvs_emu_args[I]...);
    }
};
template <int N, int... I> struct KvsEmuCall : KvsEmuCall<N - 1, N - 1, I...> {};

// Runs kernel(args[0..nargs)) on a grid of `grid` blocks of `block` threads.
// Returns 0, -1 for an unsupported launch, -2 when a block deadlocks at a barrier.
extern "C" int kvs_emu_launch(void* kernel, unsigned grid, unsigned block,
                              const long long* args, int nargs) {
    static void (*const bodies[])() = {
        KvsEmuCall<0>::run, KvsEmuCall<1>::run, KvsEmuCall<2>::run, KvsEmuCall<3>::run,
        KvsEmuCall<4>::run, KvsEmuCall<5>::run, KvsEmuCall<6>::run, KvsEmuCall<7>::run,
        KvsEmuCall<8>::run, KvsEmuCall<9>::run, KvsEmuCall<10>::run, KvsEmuCall<11>::run,
        KvsEmuCall<12>::run, KvsEmuCall<13>::run, KvsEmuCall<14>::run, KvsEmuCall<15>::run};
    if (block == 0 || block % 32 || block > 1024 || nargs < 0 || nargs > 15) return -1;
    if (block > kvs_emu_capacity) {
        std::free(kvs_emu_fibers);
        std::free(kvs_emu_stacks);
        kvs_emu_fibers = (KvsEmuFiber*)std::calloc(block, sizeof(KvsEmuFiber));
        kvs_emu_stacks = (char*)std::malloc(block * kvs_emu_stack);
        kvs_emu_capacity = block;
    }
    std::memcpy(kvs_emu_args, args, sizeof(long long) * (size_t)nargs);
    kvs_emu_kernel = kernel;
    kvs_emu_body = bodies[nargs];
    blockDim = {block, 1, 1};
    gridDim = {grid, 1, 1};
    for (unsigned b = 0; b < grid; b++) {
        blockIdx = {b, 0, 0};
        kvs_emu_block_bar = {block, 0, 0};
        for (unsigned w = 0; w < block / 32; w++) kvs_emu_warp_bar[w] = {32, 0, 0};
        for (unsigned t = 0; t < block; t++) kvs_emu_start(t);
        for (unsigned live = block; live;) {
            kvs_emu_progress = false;
            live = 0;
            for (unsigned t = 0; t < block; t++) {
                KvsEmuFiber& f = kvs_emu_fibers[t];
                if (f.done) continue;
                kvs_emu_current = t;
                threadIdx = {t, 0, 0};
                swapcontext(&kvs_emu_main, &f.ctx);
                live += !f.done;
            }
            if (live && !kvs_emu_progress) return -2;  // every live thread waits for ever
        }
    }
    return 0;
}
