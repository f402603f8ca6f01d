//! The attention kernels' source: `kernels/attention/*.cu(h)` after the bf16 helpers, with the
//! `extern "C"` entry points instantiated per head dimension (and, for decode, per GQA tile);
//! and the Hopper module (sm_90a) of the warpgroup-MMA prefill (`prefill_wg.cu`) with its
//! generated `wgmma` wrappers.

use super::{
    ATTN_COUNTERS, DECODE_THREADS, GROUP_TILES, MAX_FUSED_PARTS, PrefillTile, SUPPORTED_HEAD_DIMS,
    TC_TILE, WGMMA_HEAD_DIM, WGMMA_PREFILL, prefill_cfg,
};
use crate::cuda::CudaResult;
use crate::cuda::kernels::{BF16_HELPERS, ROPE_HELPERS, kernel_file};

/// Device helpers shared by the attention sources (after [`BF16_HELPERS`]).
pub(super) const ATTN_COMMON: &str = kernel_file!("attention/common.cuh");
/// The q/k norm + RoPE of a decode token's head rows (`DecodeRope`; after [`ATTN_COMMON`]).
pub(super) const DECODE_ROPE: &str = kernel_file!("attention/decode_rope.cuh");
/// Flash-decoding kernel template (one query token per sequence).
const DECODE_TEMPLATE: &str = kernel_file!("attention/decode.cu");
/// Flash-attention 2 prefill kernel template (tensor cores).
const PREFILL_TEMPLATE: &str = kernel_file!("attention/prefill.cu");
/// Flash-decoding on tensor cores (the GQA group as the MMA's rows).
const DECODE_TC_TEMPLATE: &str = kernel_file!("attention/decode_tc.cu");
/// Flash-attention prefill on warpgroup MMA (sm_90a, head_dim 128).
const PREFILL_WG_TEMPLATE: &str = kernel_file!("attention/prefill_wg.cu");
/// Decode partial merge.
const REDUCE_BODY: &str = kernel_file!("attention/reduce.cu");

/// The decode reduce kernel's entry point (in [`reduce_source`]).
pub(super) const REDUCE_FN: &str = "attn_decode_reduce";

/// Kernel entry points of the source built for one head dimension.
pub(super) struct HdKernels {
    pub(super) source: fn() -> String,
    pub(super) decode: [&'static str; 4],
    /// The same tiles with the q/k norm + RoPE + cache write inside (`DecodeRope`).
    pub(super) decode_rope: [&'static str; 4],
    pub(super) decode_tc: &'static str,
    pub(super) prefill: &'static str,
}

macro_rules! hd_kernels {
    ($hd:literal, $src:ident) => {
        HdKernels {
            source: $src,
            decode: [
                concat!("attn_decode_hd", $hd, "_g1"),
                concat!("attn_decode_hd", $hd, "_g2"),
                concat!("attn_decode_hd", $hd, "_g4"),
                concat!("attn_decode_hd", $hd, "_g8"),
            ],
            decode_rope: [
                concat!("attn_decode_rope_hd", $hd, "_g1"),
                concat!("attn_decode_rope_hd", $hd, "_g2"),
                concat!("attn_decode_rope_hd", $hd, "_g4"),
                concat!("attn_decode_rope_hd", $hd, "_g8"),
            ],
            decode_tc: concat!("attn_decode_tc_hd", $hd, "_g8"),
            prefill: concat!("attn_prefill_hd", $hd),
        }
    };
}

fn attn_source_hd16() -> String {
    attn_source(16)
}
fn attn_source_hd32() -> String {
    attn_source(32)
}
fn attn_source_hd64() -> String {
    attn_source(64)
}
fn attn_source_hd128() -> String {
    attn_source(128)
}
fn attn_source_hd256() -> String {
    attn_source(256)
}

/// The kernels for `head_dim`, or a metadata error naming the supported sizes.
pub(super) fn hd_kernels(head_dim: usize) -> CudaResult<HdKernels> {
    Ok(match head_dim {
        16 => hd_kernels!(16, attn_source_hd16),
        32 => hd_kernels!(32, attn_source_hd32),
        64 => hd_kernels!(64, attn_source_hd64),
        128 => hd_kernels!(128, attn_source_hd128),
        256 => hd_kernels!(256, attn_source_hd256),
        _ => {
            return Err(crate::Error::Metadata(format!(
                "cuda paged attention: head_dim {head_dim} is not supported (one of {SUPPORTED_HEAD_DIMS:?})"
            ))
            .into());
        }
    })
}

/// The decode and prefill kernels for one head dimension (entry points named as in
/// [`hd_kernels`]).
pub(crate) fn attn_source(hd: usize) -> String {
    let mut src = format!(
        "{BF16_HELPERS}{ROPE_HELPERS}{ATTN_COMMON}#define ATTN_COUNTERS {ATTN_COUNTERS}\n\
         #define ATTN_FUSED_PARTS {MAX_FUSED_PARTS}\n{DECODE_ROPE}{DECODE_TEMPLATE}{PREFILL_TEMPLATE}\
         {DECODE_TC_TEMPLATE}"
    );
    let decode_args = "const u16* q, const u16* kc, const u16* vc, u16* out, const int* qsl, \
        const int* seq_lens, const int* bt, float* ws, int num_tokens, int num_heads, int nkv, \
        int bs, int num_blocks, int mbps, int part_size, int max_parts, int head_chunks, \
        int fused, int balanced, float scale_log2";
    let decode_call = "q, kc, vc, out, qsl, seq_lens, bt, ws, num_tokens, num_heads, nkv, bs, \
        num_blocks, mbps, part_size, max_parts, head_chunks, fused, balanced, scale_log2";
    for gm in GROUP_TILES {
        src.push_str(&format!(
            "extern \"C\" __global__ void __launch_bounds__({DECODE_THREADS}) \
             attn_decode_hd{hd}_g{gm}({decode_args}) {{ const DecodeRope none{{}}; \
             attn_decode<{hd}, {gm}, false>({decode_call}, none); }}\n\
             extern \"C\" __global__ void __launch_bounds__({DECODE_THREADS}) \
             attn_decode_rope_hd{hd}_g{gm}({decode_args}, DecodeRope rope) {{ \
             attn_decode<{hd}, {gm}, true>({decode_call}, rope); }}\n"
        ));
    }
    src.push_str(&format!(
        "extern \"C\" __global__ void __launch_bounds__({DECODE_THREADS}) \
         attn_decode_tc_hd{hd}_g{TC_TILE}({decode_args}) {{ \
         attn_decode_tc<{hd}, {TC_TILE}>({decode_call}); }}\n"
    ));
    src.push_str(&prefill_entry(
        hd,
        &prefill_cfg(hd),
        &format!("attn_prefill_hd{hd}"),
    ));
    #[cfg(test)]
    if hd == 128 {
        for (tile, name) in super::PREFILL_CANDIDATES {
            src.push_str(&prefill_entry(hd, &tile, name));
        }
    }
    src
}

/// The `extern "C"` entry point `name` instantiating `attn_prefill` with `tile`.
fn prefill_entry(hd: usize, tile: &PrefillTile, name: &str) -> String {
    let PrefillTile {
        warps,
        bn,
        qreg,
        min_ctas,
        ..
    } = *tile;
    let threads = 32 * warps;
    let bounds = if min_ctas > 0 {
        format!("{threads}, {min_ctas}")
    } else {
        threads.to_string()
    };
    format!(
        "extern \"C\" __global__ void __launch_bounds__({bounds}) {name}(\
         const u16* q, const u16* kc, const u16* vc, u16* out, const int* qsl, \
         const int* seq_lens, const int* bt, int num_tokens, int num_heads, int nkv, int bs, \
         int num_blocks, int mbps, float scale_log2) {{ \
         attn_prefill<{hd}, {warps}, {bn}, {qreg}>(q, kc, vc, out, qsl, seq_lens, bt, \
         num_tokens, num_heads, nkv, bs, num_blocks, mbps, scale_log2); }}\n"
    )
}

/// The decode reduce kernel.
pub(crate) fn reduce_source() -> String {
    format!("{BF16_HELPERS}{ATTN_COMMON}{REDUCE_BODY}")
}

/// The wgmma prefill tilings this build compiles: in test builds every one of
/// [`WGMMA_PREFILL`] (the timing compares them), else the one
/// [`PREFILL_WGMMA_ENV`](super::PREFILL_WGMMA_ENV) selects (by default
/// [`WGMMA_PREFILL_PICK`](super::WGMMA_PREFILL_PICK)), which keeps start-up compiles short.
fn wg_tiles() -> Vec<(PrefillTile, &'static str)> {
    if cfg!(test) {
        WGMMA_PREFILL.to_vec()
    } else {
        let i = super::wgmma_prefill_enabled().unwrap_or(super::WGMMA_PREFILL_PICK);
        vec![WGMMA_PREFILL[i]]
    }
}

/// `apw_qk<n>(d, da, db, first)`: one `wgmma.mma_async` m64n{n}k16, bf16 in, f32 into the
/// `n / 2` floats of `d` (overwriting them when `first`: scale-d 0 and write-only operands, so
/// the compiler moves no stale values into them while another wgmma is in flight; else added),
/// A and B from shared memory, both K-major. `first` must be a compile-time constant.
fn wgmma_qk_wrapper(n: usize) -> String {
    let (first, acc) = (
        crate::cuda::wgmma::ss_asm(n, true),
        crate::cuda::wgmma::ss_asm(n, false),
    );
    format!(
        "\ntemplate <> __device__ __forceinline__ void apw_qk<{n}>(float* d, unsigned long long da, unsigned long long db, bool first) {{\n    if (first) {{\n        {first}\n    }} else {{\n        {acc}\n    }}\n}}\n"
    )
}

/// `apw_pv(d, a, db)`: one `wgmma.mma_async` m64n{hd}k16 accumulating into the `hd / 2` floats of
/// `d`, A from the four bf16x2 registers `a`, B from shared memory MN-major (transpose-B 1).
fn wgmma_pv_wrapper(hd: usize) -> String {
    let asm = crate::cuda::wgmma::rs_asm_tnsp_b(hd);
    format!(
        "\n__device__ __forceinline__ void apw_pv(float* d, const u32* a, unsigned long long db) {{\n    {asm}\n}}\n"
    )
}

/// The `extern "C"` entry point `name` instantiating `attn_prefill_wg` with `tile` (the
/// arguments of [`prefill_entry`]'s).
fn prefill_wg_entry(tile: &PrefillTile, name: &str) -> String {
    let wgs = tile.warps / 4;
    let (bn, threads, min_ctas) = (tile.bn, 32 * tile.warps, tile.min_ctas.max(1));
    let pp = tile.pingpong;
    format!(
        "extern \"C\" __global__ void __launch_bounds__({threads}, {min_ctas}) {name}(\
         const u16* q, const u16* kc, const u16* vc, u16* out, const int* qsl, \
         const int* seq_lens, const int* bt, int num_tokens, int num_heads, int nkv, int bs, \
         int num_blocks, int mbps, float scale_log2) {{ \
         attn_prefill_wg<{wgs}, {bn}, {pp}>(q, kc, vc, out, qsl, seq_lens, bt, num_tokens, num_heads, \
         nkv, bs, num_blocks, mbps, scale_log2); }}\n"
    )
}

/// The Hopper prefill module (compiled for `sm_90a`): `prefill_wg.cu` after the common helpers
/// and the generated wrappers, with the entry points of [`wg_tiles`].
pub(crate) fn attn_wgmma_source() -> String {
    let tiles = wg_tiles();
    let mut src = format!(
        "{BF16_HELPERS}{ATTN_COMMON}\
         template <int N> __device__ __forceinline__ void apw_qk(float* d, unsigned long long da, \
         unsigned long long db, bool first);\n"
    );
    let mut widths: Vec<usize> = tiles.iter().map(|(t, _)| t.bn).collect();
    widths.sort_unstable();
    widths.dedup();
    for n in widths {
        src.push_str(&wgmma_qk_wrapper(n));
    }
    src.push_str(&wgmma_pv_wrapper(WGMMA_HEAD_DIM));
    src.push_str(PREFILL_WG_TEMPLATE);
    for (tile, name) in tiles {
        src.push_str(&prefill_wg_entry(&tile, name));
    }
    src
}
