// Element-wise entry points into fp8.cu's codec structs (included after it), for sampled
// sweeps that would take too long one CUDA block per value: `codec` 0 is KvsFp8, 1 KvsInt8.
#pragma once

extern "C" void kvs_emu_scale_of(int codec, const unsigned* amax, float* scale, float* inv,
                                 long long n) {
    for (long long i = 0; i < n; i++) {
        if (codec) KvsInt8::scale_of(amax[i], &scale[i], &inv[i]);
        else KvsFp8::scale_of(amax[i], &scale[i], &inv[i]);
    }
}

// code = encode(x * inv), as quantize_group computes it.
extern "C" void kvs_emu_encode(int codec, const float* x, const float* inv, unsigned char* code,
                               long long n) {
    for (long long i = 0; i < n; i++) {
        const float v = __fmul_rn(x[i], inv[i]);
        code[i] = codec ? KvsInt8::encode(v) : KvsFp8::encode(v);
    }
}
