// Flash-attention prefill on Hopper's warpgroup MMA (sm_90a), head_dim 128: the semantics and
// arguments of `attn_prefill` (prefill.cu). Its `extern "C"` entry points are instantiated by the
// Rust side (src/cuda/attention/source.rs, `attn_wgmma_source`), which prepends bf16.cuh,
// attention/common.cuh and the generated `apw_qk<N>` / `apw_pv` wgmma wrappers.
//
// One CTA: WGS warpgroups (4 warps each) own 64 query rows each (BM = 64 WGS rows) of sequence
// blockIdx.z, query head blockIdx.y; query tiles in reverse order (the longest causal tiles
// start first). Key tiles of BN keys: S = Q K^T with `wgmma m64nBNk16` (A = Q and B = K from
// shared memory, both K-major), causal/length mask, online softmax in the log2 domain, then
// O += P V with `wgmma m64n128k16` (A = P from registers, rounded to bf16; B = V from shared
// memory, MN-major: transpose-B).
//
// Shared memory (dynamic, rounded up to a 1024-byte boundary): Q as two [BM][64] halves
// (dims 0-63, 64-127), two stages of K as two [BN][64] halves each, two stages of V alike, then
// int slots[3][BN] (the cache slot of each key of three upcoming tiles). Every tile row is 128
// bytes, stored with the 128-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8),
// so 8 rows are one 1024-byte swizzle atom.
//
// Pipeline (all threads copy, with cp.async; one commit group per K tile and per V tile):
//   prologue: slots of tiles 0-2; copies of Q + K_0, V_0, K_1; wait Q + K_0, barrier;
//             S_0 = Q K_0^T, softmax, P_0.
//   tile j:   wait V_j and K_{j+1}, barrier (every warpgroup is also done with K_j, V_{j-1});
//             copies of V_{j+1} (into V_{j-1}'s stage) and K_{j+2} (into K_j's stage), slots of
//             tile j + 3 (into tile j's);
//             issue S_{j+1} = Q K_{j+1}^T, then O += P_j V_j; wait S_{j+1} (wait_group 1) and
//             mask + softmax it while PV_j runs; wait PV_j; O *= alpha; P_{j+1} = bf16(p).
// Each copy has one tile's compute to land; a wgmma group never stays in flight across the
// loop's back edge or a branch (ptxas serializes every wgmma when it cannot tell which group
// a wait retires). A warpgroup whose rows see no key of a tile (the causal diagonal of the CTA's
// other warpgroup, or rows past the chunk) skips its MMAs for it but keeps the barriers.
//
// Ping-pong variant (PP, two warpgroups): no CTA-wide barrier per key tile. Warpgroup 0 alone
// copies K and V, into three stages each (V_{j+1} and K_{j+2} at the top of its tile j, as
// above), each copy handed over with mbarriers: full_k / full_v[stage] complete when its 128
// threads' cp.async landed (cp.async.mbarrier.arrive.noinc), empty_k / empty_v[stage] when all
// 256 threads released the tile (after the wgmma wait that retires its reads); readers fence
// the async proxy after the full wait, since the writes came from other threads. The slot
// table is warpgroup 0's own (named barrier 3 of 128 threads). Both warpgroups run the same
// key loop, but take turns issuing their MMAs: warpgroup w does bar.sync 1 + w before a
// phase's wgmmas and bar.arrive 2 - w after them (FlashAttention-3's warpgroup ping-pong), so
// one's softmax runs under the other's MMAs. The third stage is the slack that lets
// warpgroup 0 refill a stage while warpgroup 1, half a tile behind, still reads the previous
// one. Every warpgroup keeps every barrier, including inactive ones; the arrivals inside a
// wgmma group's flight are predicated instructions, never branches.

// Makes this thread's landed cp.async writes visible to the async proxy (wgmma's operand reads).
__device__ __forceinline__ void apw_fence_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void apw_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void apw_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void apw_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Pins a register at this point of the program (after a wgmma wait, before its reads), so the
// compiler cannot move reads of an asynchronously written accumulator above the wait, nor
// retire a register an in-flight wgmma still reads.
__device__ __forceinline__ void apw_keep(float& x) { asm volatile("" : "+f"(x) :: "memory"); }
__device__ __forceinline__ void apw_keep(u32& x) { asm volatile("" : "+r"(x) :: "memory"); }

// Ping-pong variant (PP): mbarriers (shared::cta) and named barriers.
__device__ __forceinline__ void apw_mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
// One arrival on `bar` when `pred` (a predicated instruction, not a branch: safe while a wgmma
// group is in flight).
__device__ __forceinline__ void apw_mbar_arrive(u32 bar, bool pred) {
    asm volatile("{\n.reg .pred p;\n.reg .b64 st;\nsetp.ne.b32 p, %1, 0;\n"
                 "@p mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(bar), "r"((int)pred) : "memory");
}
// One arrival on `bar` once every cp.async this thread issued so far has landed (counted in
// the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void apw_mbar_cp_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
// Waits until the phase of parity `parity` of `bar` completed (a loop: never with a wgmma group
// in flight).
__device__ __forceinline__ void apw_mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
// Named barrier `id` of `count` threads: wait for it, or arrive without waiting (when `pred`).
__device__ __forceinline__ void apw_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void apw_bar_arrive(int id, int count, bool pred) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p bar.arrive %0, %1;\n}\n"
                 :: "r"(id), "r"(count), "r"((int)pred) : "memory");
}

// Descriptor of a K-major operand with 128-byte rows and the 128-byte swizzle (as in the MoE
// kernel): start address >> 4 in bits 0-13, leading byte offset unused (0), stride byte offset
// (the next 8 rows) 1024 >> 4 in bits 32-45, base offset 0 (atoms 1024-aligned), 128-byte
// swizzle (1) in bits 62-63. A k16 step starts 32 bytes further into the rows.
__device__ __forceinline__ unsigned long long apw_desc_k(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (64ull << 32) | (1ull << 62);
}
// Descriptor of the MN-major V operand (B of P V, transpose-B): rows are keys (the K dimension
// of this MMA), each 128 bytes of 64 contiguous head dims (the N dimension). The 128-byte-swizzle
// MN-major canonical layout is, in 16-byte units, ((8,n),(8,k)):((1,LBO),(8,SBO)) (PTX ISA
// "Shared Memory Matrix Layout", canonical layouts; CUTLASS make_gmma_desc, Major::MN, B128):
// 8 chunks of N contiguous, the next 64 N elements LBO away; 8 K rows 128 bytes apart, the next
// 8 K rows SBO away. Here LBO = the bytes between the two 64-dim halves of the tile (BN * 128)
// and SBO = 1024 (8 keys); a k16 step (16 keys) starts 2048 bytes further.
__device__ __forceinline__ unsigned long long apw_desc_mn(u32 addr, u32 lbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo & 0x3FFFFu) >> 4) << 16) |
           (64ull << 32) | (1ull << 62);
}

template <int WGS, int BN, bool PP>
__device__ __forceinline__ void attn_prefill_wg(
    const u16* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    u16* __restrict__ out, const int* __restrict__ qsl, const int* __restrict__ seq_lens,
    const int* __restrict__ bt, int num_tokens, int num_heads, int nkv, int bs, int num_blocks,
    int mbps, float scale_log2)
{
    constexpr int HD = 128, BM = 64 * WGS, NT = 128 * WGS;
    constexpr u32 QH = BM * 128;         // bytes of one Q half
    constexpr u32 KH = BN * 128;         // bytes of one K (or V) half
    constexpr u32 STAGE = 2 * KH;        // one K (or V) tile
    constexpr int NS = PP ? 3 : 2;       // stages of K and of V
    constexpr int CT = PP ? 128 : NT;    // threads that copy K and V (PP: warpgroup 0)
    constexpr int RSTEP = NT / 16;       // Q rows per copy pass (16 chunks of 16 bytes per row)
    constexpr int KRSTEP = CT / 16;      // K / V rows per copy pass
    constexpr int QPT = BM / RSTEP, KPT = BN / KRSTEP;
    static_assert(BN == 64 || BN == 128, "key tile: 64 or 128");
    static_assert(KRSTEP % 8 == 0, "a thread's rows share their row % 8 (one swizzle offset)");
    static_assert(BN <= CT, "one copying thread per key computes the slots");
    static_assert(!PP || WGS == 2, "ping-pong: two warpgroups");

    extern __shared__ __align__(1024) unsigned char apw_smem_raw[];
    const u32 raw = smem_u32(apw_smem_raw);
    const u32 sQ = (raw + 1023u) & ~1023u;
    const u32 sK = sQ + 2 * QH;
    const u32 sV = sK + NS * STAGE;
    // PP: mbarriers full_k[3], full_v[3] (a stage's copies landed), empty_k[3], empty_v[3] (both
    // warpgroups are done reading it), 8 bytes each, then the slots.
    const u32 sBar = sV + NS * STAGE;
    constexpr u32 BARS = PP ? 12 * 8 : 0;
    int* s_slot = reinterpret_cast<int*>(apw_smem_raw + (sBar + BARS - raw));
    auto full_k = [&](int t) { return sBar + (u32)(t % 3) * 8; };
    auto full_v = [&](int t) { return sBar + 24 + (u32)(t % 3) * 8; };
    auto empty_k = [&](int t) { return sBar + 48 + (u32)(t % 3) * 8; };
    auto empty_v = [&](int t) { return sBar + 72 + (u32)(t % 3) * 8; };
    auto stage = [](int t) { return PP ? (u32)(t % 3) : (u32)(t & 1); };

    const int s = blockIdx.z, h = blockIdx.y;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int qs = qsl[s], qlen = qsl[s + 1] - qs;
    const int q0 = qt * BM;
    if (q0 >= qlen) return;  // CTA-uniform, before any barrier
    const int seq_len = seq_lens[s];
    const int ctx0 = seq_len - qlen;
    const int kvh = h / (num_heads / nkv);
    const int kv_end = min(seq_len, ctx0 + min(q0 + BM, qlen));
    const int n_tiles = kv_end > 0 ? (kv_end + BN - 1) / BN : 0;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wq = warp & 3;
    const int* btab = bt + (size_t)s * mbps;
    const size_t tok_stride = (size_t)nkv * HD;

    // Copies: thread tid moves chunk ch (16 bytes, dims 8 ch ..) of rows r0 + k RSTEP, all
    // congruent mod 8, so one swizzled offset serves every row.
    const int ch = tid & 15, r0 = tid >> 4;
    const size_t head_off = (size_t)kvh * HD + ch * 8;
    const u32 half_q = (ch >> 3) * QH, half_k = (ch >> 3) * KH;
    const u32 swz = (u32)(((ch & 7) ^ (r0 & 7)) * 16);

    auto fill_slots = [&](int t) {
        if (tid < BN) {
            const int key = t * BN + tid;
            s_slot[(t % 3) * BN + tid] = key < kv_end ? kv_slot(btab, key, bs, mbps, num_blocks) : -1;
        }
    };
    // K or V tile t of `cache` into stage t % NS of `dst` (zero rows past kv_end).
    auto load_tile = [&](const u16* cache, u32 dst, int t) {
        const int* sl = s_slot + (t % 3) * BN;
        const u32 d = dst + stage(t) * STAGE + half_k + swz;
#pragma unroll
        for (int k = 0; k < KPT; ++k) {
            const int r = r0 + k * KRSTEP;
            const int slot = sl[r];
            const u16* src = slot >= 0 ? cache + (size_t)slot * tok_stride + head_off : cache;
            cp_async16(d + r * 128, src, slot >= 0 ? 16 : 0);
        }
    };

    if (PP && tid == 0) {
        for (int i = 0; i < 3; ++i) {
            apw_mbar_init(full_k(i), 128);
            apw_mbar_init(full_v(i), 128);
            apw_mbar_init(empty_k(i), NT);
            apw_mbar_init(empty_v(i), NT);
        }
    }
    fill_slots(0);
    fill_slots(1);
    fill_slots(2);
    __syncthreads();
    // Q tile (rows past the chunk or the batch are zero-filled).
#pragma unroll
    for (int k = 0; k < QPT; ++k) {
        const int r = r0 + k * RSTEP;
        const int tok = qs + q0 + r;
        const bool ok = (q0 + r < qlen) && tok >= 0 && tok < num_tokens;
        const u16* src = ok ? q + ((size_t)tok * num_heads + h) * HD + ch * 8 : q;
        cp_async16(sQ + half_q + r * 128 + swz, src, ok ? 16 : 0);
    }
    if constexpr (PP) {
        // Q is one commit group; warpgroup 0's K / V copies are tracked by the mbarriers.
        cp_async_commit();
        if (wg == 0) {
            if (n_tiles > 0) { load_tile(kc, sK, 0); apw_mbar_cp_arrive(full_k(0)); }
            if (n_tiles > 0) { load_tile(vc, sV, 0); apw_mbar_cp_arrive(full_v(0)); }
            if (n_tiles > 1) { load_tile(kc, sK, 1); apw_mbar_cp_arrive(full_k(1)); }
        }
    } else {
        if (n_tiles > 0) load_tile(kc, sK, 0);
        cp_async_commit();
        if (n_tiles > 0) load_tile(vc, sV, 0);
        cp_async_commit();
        if (n_tiles > 1) load_tile(kc, sK, 1);
        cp_async_commit();
    }

    // Accumulator element 4 nb + e of thread (warp wq of the warpgroup, lane): row
    // 16 wq + g + 8 (e / 2), column 8 nb + 2 c + e % 2 (the m16n8 layout per warp).
    const int g = lane >> 2, c = lane & 3;
    const int row_w = q0 + 64 * wg + 16 * wq;           // the warp's first row
    const int pos_a = ctx0 + row_w + g, pos_b = pos_a + 8;
    // Whether this warpgroup has rows inside the chunk, and the last position they attend to.
    const bool wg_rows = q0 + 64 * wg < qlen;
    const int wg_last = ctx0 + min(q0 + 64 * wg + 64, qlen) - 1;
    const u32 qa = sQ + wg * 64 * 128;
    // Warpgroup-uniform: a key of tile t is visible to a row of this warpgroup (monotone: false
    // from some tile on).
    auto active = [&](int t) { return wg_rows && t * BN <= wg_last; };

    float o[HD / 2];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
    float sacc[BN / 2];
    u32 p[BN / 16][4];
    float m_run[2] = {ATTN_NEG_INF, ATTN_NEG_INF}, l_run[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};

    // S_t = Q K_t^T (K_t in stage t % 2), issued and committed.
    auto issue_s = [&](int t) {
        apw_wg_fence();
        const u32 kb = sK + stage(t) * STAGE;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) {
            const u32 off = (u32)(ks & 3) * 32;  // k16 step within the 64-dim half
            apw_qk<BN>(sacc, apw_desc_k(qa + (ks >> 2) * QH + off),
                       apw_desc_k(kb + (ks >> 2) * KH + off), ks == 0);
        }
        apw_wg_commit();
    };
    // Mask and online softmax of S_t in place (sacc becomes p); O is left alone (a PV may be in
    // flight): its rescale factors go to alpha. The running max is of the raw scores (the scale
    // is positive), so each p is one FFMA into the log2 domain and one ex2: p = 2^(s scale -
    // m scale).
    auto softmax = [&](int t) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) apw_keep(sacc[i]);
        const int kbase = t * BN;
        // Mask keys past the row's position or the context.
        const bool need_mask = (kbase + BN - 1 > ctx0 + row_w) || (kbase + BN > kv_end);
        if (need_mask) {
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kbase + nb * 8 + 2 * c + (e & 1);
                    const int pos = e < 2 ? pos_a : pos_b;
                    if (key > pos || key >= kv_end) sacc[4 * nb + e] = ATTN_NEG_INF;
                }
            }
        }
        // A row lives in the 4 lanes of a quad.
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
            float tmax = ATTN_NEG_INF;
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb)
                tmax = fmaxf(tmax, fmaxf(sacc[4 * nb + 2 * rh], sacc[4 * nb + 2 * rh + 1]));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
            const float m_new = fmaxf(m_run[rh], tmax);
            const float m_base = m_new == ATTN_NEG_INF ? 0.f : m_new * scale_log2;
            alpha[rh] = attn_ex2(m_run[rh] * scale_log2 - m_base);
            m_run[rh] = m_new;
            float rs = 0.f;
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb) {
                const float p0 = attn_ex2(fmaf(sacc[4 * nb + 2 * rh], scale_log2, -m_base));
                const float p1 = attn_ex2(fmaf(sacc[4 * nb + 2 * rh + 1], scale_log2, -m_base));
                sacc[4 * nb + 2 * rh] = p0;
                sacc[4 * nb + 2 * rh + 1] = p1;
                rs += p0 + p1;
            }
            l_run[rh] = l_run[rh] * alpha[rh] + rs;
        }
    };
    // After every wgmma completed: O *= alpha, and P = bf16(p) as the A operand of k16 step kk
    // (keys 16 kk ..): the m64k16 A fragment is the m16n8k16 one per warp, so it is the
    // accumulator of columns 16 kk .. 16 kk + 15.
    auto rescale_pack = [&]() {
#pragma unroll
        for (int i = 0; i < HD / 2; ++i) apw_keep(o[i]);
#pragma unroll
        for (int nb = 0; nb < HD / 8; ++nb) {
            o[4 * nb + 0] *= alpha[0]; o[4 * nb + 1] *= alpha[0];
            o[4 * nb + 2] *= alpha[1]; o[4 * nb + 3] *= alpha[1];
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            p[kk][0] = pack_bf16x2(sacc[8 * kk + 0], sacc[8 * kk + 1]);
            p[kk][1] = pack_bf16x2(sacc[8 * kk + 2], sacc[8 * kk + 3]);
            p[kk][2] = pack_bf16x2(sacc[8 * kk + 4], sacc[8 * kk + 5]);
            p[kk][3] = pack_bf16x2(sacc[8 * kk + 6], sacc[8 * kk + 7]);
        }
    };

    // O += P_t V_t (V_t in stage t % 2), issued and committed.
    auto issue_pv = [&](int t) {
        apw_wg_fence();
        const u32 vb = sV + stage(t) * STAGE;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) apw_pv(o, p[kk], apw_desc_mn(vb + kk * 2048, KH));
        apw_wg_commit();
    };
    // P stays in its registers until the PV reading it completed.
    auto keep_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            apw_keep(p[kk][0]); apw_keep(p[kk][1]); apw_keep(p[kk][2]); apw_keep(p[kk][3]);
        }
    };

    if constexpr (PP) {
        // Q landed (its own commit group), for every thread.
        cp_async_wait<0>();
        apw_fence_proxy();
        __syncthreads();
        // GEMM turns: warpgroup w waits on named barrier 1 + w before it issues a phase's
        // wgmmas and then arrives on the other's (2 - w), so the two warpgroups' MMAs alternate
        // on the tensor cores and one's softmax runs under the other's MMAs. Warpgroup 1 opens
        // the first turn and leaves out its last arrival (each barrier sees n_tiles + 1 pairs).
        const int my_turn = 1 + wg, other_turn = 2 - wg;
        if (wg == 1) apw_bar_arrive(1, NT, true);
        // Tile 0's scores.
        if (n_tiles > 0) apw_mbar_wait(full_k(0), 0);
        apw_fence_proxy();
        if (n_tiles > 0 && active(0)) {
            apw_bar_sync(my_turn, NT);
            issue_s(0);
            apw_bar_arrive(other_turn, NT, true);
            apw_wg_wait<0>();
            apw_mbar_arrive(empty_k(0), true);
            softmax(0);
            rescale_pack();
        } else {
            apw_bar_sync(my_turn, NT);
            apw_bar_arrive(other_turn, NT, wg == 0 || n_tiles > 0);
            apw_mbar_arrive(empty_k(0), n_tiles > 0);
        }

        for (int j = 0; j < n_tiles; ++j) {
            // Warpgroup 0 copies V_{j+1} (into V_{j-2}'s stage) and K_{j+2} (into K_{j-1}'s)
            // once both warpgroups released those, and the slots of tile j + 3 (into tile j's:
            // a barrier of warpgroup 0 alone orders the slot table, only it reads it).
            if (wg == 0) {
                apw_bar_sync(3, 128);
                if (j + 1 < n_tiles) {
                    if (j + 1 >= 3) apw_mbar_wait(empty_v(j + 1), (u32)((j + 1) / 3 - 1) & 1u);
                    load_tile(vc, sV, j + 1);
                    apw_mbar_cp_arrive(full_v(j + 1));
                }
                if (j + 2 < n_tiles) {
                    if (j + 2 >= 3) apw_mbar_wait(empty_k(j + 2), (u32)((j + 2) / 3 - 1) & 1u);
                    load_tile(kc, sK, j + 2);
                    apw_mbar_cp_arrive(full_k(j + 2));
                }
                if (j + 3 < n_tiles) fill_slots(j + 3);
            }
            // V_j and K_{j+1} landed (copies by other threads: the proxy fence on this side).
            if (j + 1 < n_tiles) apw_mbar_wait(full_k(j + 1), (u32)((j + 1) / 3) & 1u);
            apw_mbar_wait(full_v(j), (u32)(j / 3) & 1u);
            apw_fence_proxy();
            const bool more = j + 1 < n_tiles;
            const bool hand_over = wg == 0 || more;
            // As in the lockstep kernel, each branch is straight-line while a wgmma group is in
            // flight; the barrier arrivals in it are predicated instructions.
            if (more && active(j + 1)) {
                apw_bar_sync(my_turn, NT);
                issue_s(j + 1);
                issue_pv(j);
                apw_bar_arrive(other_turn, NT, hand_over);
                apw_wg_wait<1>();  // S_{j+1}: K_{j+1} read
                apw_mbar_arrive(empty_k(j + 1), true);
                softmax(j + 1);
                apw_wg_wait<0>();  // PV_j: V_j read
                keep_p();
                apw_mbar_arrive(empty_v(j), true);
                rescale_pack();
            } else if (active(j)) {
                apw_bar_sync(my_turn, NT);
                issue_pv(j);
                apw_bar_arrive(other_turn, NT, hand_over);
                apw_wg_wait<0>();
                keep_p();
                apw_mbar_arrive(empty_k(j + 1), more);
                apw_mbar_arrive(empty_v(j), true);
            } else {
                apw_bar_sync(my_turn, NT);
                apw_bar_arrive(other_turn, NT, hand_over);
                apw_mbar_arrive(empty_k(j + 1), more);
                apw_mbar_arrive(empty_v(j), true);
            }
        }
    } else {
        // Tile 0's scores (its K landed with Q: only V_0 and K_1 may pend).
        cp_async_wait<2>();
        apw_fence_proxy();
        __syncthreads();
        if (n_tiles > 0 && active(0)) {
            issue_s(0);
            apw_wg_wait<0>();
            softmax(0);
            rescale_pack();
        }

        for (int j = 0; j < n_tiles; ++j) {
            cp_async_wait<0>();  // V_j and K_{j+1} landed
            apw_fence_proxy();
            __syncthreads();   // ... for every thread; every warpgroup is done with K_j and V_{j-1}
            if (j + 1 < n_tiles) load_tile(vc, sV, j + 1);  // into V_{j-1}'s stage
            cp_async_commit();
            if (j + 2 < n_tiles) load_tile(kc, sK, j + 2);  // into K_j's stage
            cp_async_commit();
            if (j + 3 < n_tiles) fill_slots(j + 3);          // into tile j's slots

            // S_{j+1} first, then O += P_j V_j: the softmax of S_{j+1} runs while PV_j does. Each
            // branch is straight-line, so ptxas sees which group each wait retires (with the
            // issues under separate conditions it serializes every wgmma).
            if (j + 1 < n_tiles && active(j + 1)) {  // implies active(j)
                issue_s(j + 1);
                issue_pv(j);
                apw_wg_wait<1>();  // S_{j+1}
                softmax(j + 1);
                apw_wg_wait<0>();  // PV_j
                keep_p();
                rescale_pack();
            } else if (active(j)) {
                issue_pv(j);
                apw_wg_wait<0>();
                keep_p();
            }
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) apw_keep(o[i]);

#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        float l = l_run[rh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = row_w + g + 8 * rh;
        const int tok = qs + row;
        if (row < qlen && tok >= 0 && tok < num_tokens) {
            u16* dst = out + ((size_t)tok * num_heads + h) * HD + 2 * c;
#pragma unroll
            for (int nb = 0; nb < HD / 8; ++nb) {
                *reinterpret_cast<u32*>(dst + nb * 8) =
                    pack_bf16x2(o[4 * nb + 2 * rh] * inv, o[4 * nb + 2 * rh + 1] * inv);
            }
        }
    }
}
