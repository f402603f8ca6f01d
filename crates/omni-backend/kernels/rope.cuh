// RoPE angles shared by the q/k norm + RoPE kernel (layers.cu) and the decode attention that
// does the same work inside (attention/decode.cu), so both turn a token by the same bits.
// Prepended by the Rust side after bf16.cuh.

// (sin, cos) of rotary frequency i at token t's position: angle position * inv_freq[i]. With
// M-RoPE (`mrope_axes` not null) frequency i turns by the temporal, height or width row
// mrope_axes[i] of the positions, rows `pos_stride` apart.
__device__ __forceinline__ void rope_sincos(const int* __restrict__ positions,
                                            const float* __restrict__ inv_freq,
                                            const unsigned char* __restrict__ mrope_axes,
                                            long long pos_stride, long long t, int i, float* s,
                                            float* c) {
    const long long axis = mrope_axes ? (long long)mrope_axes[i] : 0;
    const float p = (float)positions[axis * pos_stride + t];
    sincosf(p * inv_freq[i], s, c);
}
