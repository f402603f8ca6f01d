//! The attention kernels' source: `kernels/attention/*.cu(h)` after the bf16 helpers, with the
//! `extern "C"` entry points instantiated per head dimension (and, for decode, per GQA tile).

use super::{
    ATTN_COUNTERS, DECODE_THREADS, GROUP_TILES, MAX_FUSED_PARTS, PrefillTile, SUPPORTED_HEAD_DIMS,
    TC_TILE, prefill_cfg,
};
use crate::cuda::CudaResult;
use crate::cuda::kernels::{BF16_HELPERS, kernel_file};

/// Device helpers shared by the attention sources (after [`BF16_HELPERS`]).
const ATTN_COMMON: &str = kernel_file!("attention/common.cuh");
/// Flash-decoding kernel template (one query token per sequence).
const DECODE_TEMPLATE: &str = kernel_file!("attention/decode.cu");
/// Flash-attention 2 prefill kernel template (tensor cores).
const PREFILL_TEMPLATE: &str = kernel_file!("attention/prefill.cu");
/// Flash-decoding on tensor cores (the GQA group as the MMA's rows).
const DECODE_TC_TEMPLATE: &str = kernel_file!("attention/decode_tc.cu");
/// Decode partial merge.
const REDUCE_BODY: &str = kernel_file!("attention/reduce.cu");

/// The decode reduce kernel's entry point (in [`reduce_source`]).
pub(super) const REDUCE_FN: &str = "attn_decode_reduce";

/// Kernel entry points of the source built for one head dimension.
pub(super) struct HdKernels {
    pub(super) source: fn() -> String,
    pub(super) decode: [&'static str; 4],
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
        "{BF16_HELPERS}{ATTN_COMMON}#define ATTN_COUNTERS {ATTN_COUNTERS}\n\
         #define ATTN_FUSED_PARTS {MAX_FUSED_PARTS}\n{DECODE_TEMPLATE}{PREFILL_TEMPLATE}\
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
             attn_decode_hd{hd}_g{gm}({decode_args}) {{ attn_decode<{hd}, {gm}>({decode_call}); }}\n"
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
