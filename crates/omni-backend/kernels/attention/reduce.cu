// Merges the partial results of a multi-partition decode.
// Prepended by the Rust side: bf16.cuh, attention/common.cuh.

// One CTA per (head, sequence): merges the partitions' normalized partials with weights
// sum_p * exp2(max_p - max) (log2 domain, as written by attn_decode).
extern "C" __global__ void __launch_bounds__(128) attn_decode_reduce(
    const float* __restrict__ ws, u16* __restrict__ out, const int* __restrict__ qsl,
    const int* __restrict__ seq_lens, int num_tokens, int num_heads, int hd, int part_size,
    int max_parts, int balanced)
{
    const int s = blockIdx.y, h = blockIdx.x;
    const int qs = qsl[s];
    if (qsl[s + 1] - qs != 1 || qs < 0 || qs >= num_tokens) return;
    const int seq_len = seq_lens[s];
    const int plen = attn_part_len(seq_len, part_size, max_parts, balanced);
    const int np = seq_len > 0 ? min((seq_len + plen - 1) / plen, max_parts) : 0;
    const size_t nrows = (size_t)gridDim.y * num_heads * max_parts;
    const size_t row0 = ((size_t)s * num_heads + h) * max_parts;
    const float* wm = ws + nrows * hd + row0;
    const float* wl = ws + nrows * hd + nrows + row0;
    float mx = ATTN_NEG_INF;
    for (int p = 0; p < np; ++p) mx = fmaxf(mx, wm[p]);
    float den = 0.f;
    for (int p = 0; p < np; ++p) den += wl[p] * exp2f(wm[p] - mx);
    const float inv = den > 0.f ? 1.f / den : 0.f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < np; ++p) acc += wl[p] * exp2f(wm[p] - mx) * ws[(row0 + p) * hd + d];
        out[((size_t)qs * num_heads + h) * hd + d] = f2bf(acc * inv);
    }
}
