//! The attention block of a one-token decode step in one launch (`kernels/attention/block1.cu`):
//! what the staged QKV GEMV with the input norm inside ([`CudaContext::gemv_staged_norm_bf16`]),
//! [`CudaContext::qkv_rope_cache_bf16`], [`CudaContext::paged_attention_bf16`] and the staged
//! o_proj GEMV ([`CudaContext::gemv_staged_f32`]) do for one sequence's one token, on a grid of
//! one CTA per SM that meets at two grid barriers (the pattern of the one-launch MoE block).
//!
//! At batch 1 those four launches are ~45 µs of a Qwen3-30B-A3B layer (H200, CUDA graphs) for
//! ~38 MB of weights (~9 µs at the card's copy rate): each GEMV starts its weight stream only
//! when it launches, and the q/k norm + RoPE and the attention leave the memory bus idle. Here
//! every CTA has the copy engine bring its share of the QKV rows into shared memory as the
//! launch starts (before the dependency wait: weights are never written by a step), and its
//! share of the o_proj rows right after the QKV GEMV, so they land under the grid barrier and
//! the attention. The attention splits the context over up to `sms / kv_heads` partitions of
//! each KV head (one CTA each: 33 a head for Qwen3-30B-A3B on 132 SMs) of at least
//! [`ATTN_ONE_LAUNCH_KEYS_ENV`] keys, and the last partition of a head to finish merges (a counter per head in `barrier`, left at zero); a partition longer than
//! [`PLEN_MAX`] keys (contexts past ~17K on 132 SMs) goes in tiles with the online softmax.
//!
//! Results: `qkv` and the values written to the cache are the separate kernels' bits, the new
//! key theirs up to a bf16 rounding (the q/k norm's sum of squares in another order, as in the
//! decode attention with the RoPE inside); `attn` (different partitions) equals theirs up to
//! f32 rounding; `proj` is the staged GEMV's bits on this `attn`. Opt-in ([`ATTN_ONE_LAUNCH_ENV`]) until measured on a GPU.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};

use super::rope::DecodeRopeArgs;
use super::source::{ATTN_COMMON, DECODE_ROPE};
use crate::cuda::gemv::GEMV_COMMON;
use crate::cuda::kernels::{BF16_HELPERS, GRID_SYNC, ROPE_HELPERS, kernel_file};
use crate::cuda::launch::{aligned16, at_least, max_dynamic_smem, narrow, shape_err};
use crate::cuda::{CudaContext, CudaResult, MropeAxes, bf16};

/// Set to `1`, one-token decode steps run a layer's attention block in one launch where
/// [`CudaContext::attn_block1_fits`] (`omni_models::cuda_decoder`). Off by default until
/// measured on a GPU. Read once per process.
pub const ATTN_ONE_LAUNCH_ENV: &str = "OMNI_CUDA_ATTN_ONE_LAUNCH";

/// The fewest keys of a partition of the one-launch block's attention (default
/// [`DEFAULT_MIN_KEYS`]): short contexts then take fewer CTAs and the merge fewer partials.
/// Read once per process.
pub const ATTN_ONE_LAUNCH_KEYS_ENV: &str = "OMNI_CUDA_ATTN_ONE_LAUNCH_KEYS";

/// [`ATTN_ONE_LAUNCH_KEYS_ENV`]'s default (not measured yet: 1088 keys of 4 KV heads make 17
/// partitions a head).
pub const DEFAULT_MIN_KEYS: usize = 64;

fn min_keys() -> usize {
    static KEYS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *KEYS.get_or_init(|| {
        std::env::var(ATTN_ONE_LAUNCH_KEYS_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map_or(DEFAULT_MIN_KEYS, |k: usize| k.clamp(1, 1 << 20))
    })
}

/// Whether [`ATTN_ONE_LAUNCH_ENV`] asks for the one-launch attention block.
pub fn attn_one_launch_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::cuda::switch_opt_in(ATTN_ONE_LAUNCH_ENV))
}

const BLOCK1: &str = kernel_file!("attention/block1.cu");
const BLOCK1_FN: &str = "attn_block1";
/// Threads per CTA (`AB1_THREADS`).
const THREADS: u32 = 512;
/// The head dimension the kernel is written for (`AB1_HD`).
pub(crate) const HEAD_DIM: usize = 128;
/// The most query heads per KV head (`AB1_GM`).
pub(crate) const MAX_GROUP: usize = 8;
/// Keys of a partition's tile (`AB1_PLEN_MAX`): longer partitions take several, with the
/// online softmax.
pub(crate) const PLEN_MAX: usize = 512;
/// Weight rows per mbarrier (`AB1_GROUP_ROWS`) and mbarriers per matrix (`AB1_MAX_GROUPS`).
const GROUP_ROWS: usize = 16;
const MAX_GROUPS: usize = 8;
/// The dynamic shared memory a CTA may have on compute capability 9.0 (227 KiB less the
/// kernel's ~4.9 KiB of static shared memory, rounded down).
const SMEM_MAX: usize = 222 * 1024;
/// Per-CTA timestamps a stamped launch records (`AB1_STAMPS`).
#[cfg(test)]
pub(crate) const STAMPS: usize = 8;

/// Full source of the one-launch attention module.
pub(crate) fn attn_block1_source() -> String {
    format!(
        "{BF16_HELPERS}{GRID_SYNC}{GEMV_COMMON}{ROPE_HELPERS}{ATTN_COMMON}{DECODE_ROPE}{BLOCK1}"
    )
}

/// The host scalars of [`CudaContext::attn_block1`] (one layer on one rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnBlock1Shape {
    /// The residual width (o_proj's outputs, QKV's inputs).
    pub hidden: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads (dividing `num_heads`).
    pub num_kv_heads: usize,
    /// Elements per head ([`HEAD_DIM`] only).
    pub head_dim: usize,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Block-table entries of the sequence (its row's length).
    pub max_blocks_per_seq: usize,
    /// Epsilon of the input norm and of the q/k norms.
    pub eps: f32,
    /// The attention scale (`1 / sqrt(head_dim)`).
    pub scale: f32,
}

/// A layer's weights for [`CudaContext::attn_block1`].
#[derive(Debug, Clone, Copy)]
pub struct AttnBlock1Weights<'a> {
    /// The input norm's weight `[hidden]`.
    pub input_norm: &'a CudaSlice<bf16>,
    /// The fused QKV projection `[(num_heads + 2 num_kv_heads) * head_dim, hidden]` (no bias).
    pub qkv: &'a CudaSlice<bf16>,
    /// Qwen3's per-head RMSNorm weights of queries and keys (`[head_dim]` each), or `None`.
    pub qk_norm: Option<(&'a CudaSlice<bf16>, &'a CudaSlice<bf16>)>,
    /// o_proj `[hidden, num_heads * head_dim]` (no bias).
    pub o: &'a CudaSlice<bf16>,
}

/// The activations, cache and step inputs of [`CudaContext::attn_block1`].
#[derive(Debug)]
pub struct AttnBlock1Buffers<'a> {
    /// The f32 residual stream `[hidden]`: normalised (not changed), or set from `init`.
    pub residual: &'a mut CudaSlice<f32>,
    /// The embedding row `[hidden]` bf16 the residual starts from (the first layer), or `None`.
    pub init: Option<CudaView<'a, bf16>>,
    /// One layer's K cache `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub k_cache: &'a mut CudaSlice<bf16>,
    /// Its V cache, the same layout.
    pub v_cache: &'a mut CudaSlice<bf16>,
    /// The token's position (`[1]`, or three rows `row_stride` apart with M-RoPE).
    pub positions: &'a CudaSlice<i32>,
    /// The token's cache slot (`[1]`; negative: not written).
    pub slot_mapping: &'a CudaSlice<i64>,
    /// The sequence's context length including the token (`[1]`).
    pub seq_lens: &'a CudaSlice<i32>,
    /// The sequence's block-table row (`[max_blocks_per_seq]`).
    pub block_table: &'a CudaSlice<i32>,
    /// RoPE inverse frequencies `[head_dim / 2]`.
    pub inv_freq: &'a CudaSlice<f32>,
    /// M-RoPE axes, when the positions hold three rows.
    pub mrope: Option<MropeAxes<'a>>,
    /// Out: the QKV projection `[(num_heads + 2 num_kv_heads) * head_dim]` (unrotated).
    pub qkv: &'a mut CudaSlice<bf16>,
    /// Out: the attention output `[num_heads * head_dim]`.
    pub attn: &'a mut CudaSlice<bf16>,
    /// Out: o_proj's output `[hidden]` in f32.
    pub proj: &'a mut CudaSlice<f32>,
    /// Scratch: [`CudaContext::attn_block1_workspace_len`] f32.
    pub workspace: &'a mut CudaSlice<f32>,
    /// The grid barrier and the merge counters: `1 + num_kv_heads` entries, zero before the
    /// first call (`alloc_zeros`), left at zero. Not shared by launches that may run at once.
    pub barrier: &'a mut CudaSlice<i32>,
}

/// The launch of one shape on a device of `sms` SMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block1Plan {
    /// QKV output rows per CTA (CTA c: rows c * rows_qkv ..).
    pub(crate) rows_qkv: usize,
    /// o_proj output rows per CTA.
    pub(crate) rows_o: usize,
    /// Context partitions per KV head (CTA c: KV head c / parts, partition c % parts).
    pub(crate) parts: usize,
    /// Dynamic shared bytes.
    pub(crate) smem: usize,
}

/// The plan of `s` on `sms` SMs (the kernel derives the same layout from its arguments).
pub(crate) fn block1_plan(s: &AttnBlock1Shape, sms: usize) -> Block1Plan {
    let sms = sms.max(1);
    let nq = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim;
    let ko = s.num_heads * s.head_dim;
    let rows_qkv = nq.div_ceil(sms);
    let rows_o = s.hidden.div_ceil(sms);
    let xin = (s.hidden.max(ko) * 2).next_multiple_of(128);
    let weights = (rows_qkv * s.hidden * 2).max(rows_o * ko * 2);
    let smem = 16 * MAX_GROUPS + xin + MAX_GROUP * PLEN_MAX * 4 + PLEN_MAX * 4 + weights;
    Block1Plan {
        rows_qkv,
        rows_o,
        parts: sms / s.num_kv_heads.max(1),
        smem,
    }
}

/// Partition length and count of a context of `seq_len` keys split over `parts`, at least
/// `min_keys` keys each (the kernel's `ab1_plen` and `np`); `(0, 0)` for an empty context.
#[cfg(test)]
pub(crate) fn partitions(seq_len: usize, parts: usize, min_keys: usize) -> (usize, usize) {
    if seq_len == 0 || parts == 0 {
        return (0, 0);
    }
    let plen = seq_len.div_ceil(parts).max(min_keys.max(1));
    (plen, seq_len.div_ceil(plen))
}

/// `struct Ab1Args` of `block1.cu`, field for field (a kernel argument by value): its
/// `DecodeRope` first (#[repr(C)] nests it with the same size, 88 bytes, and alignment).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Ab1Args {
    rope: DecodeRopeArgs,
    // the block
    residual: u64,
    init: u64,
    norm_w: u64,
    w_qkv: u64,
    qkv: u64,
    seq_lens: u64,
    block_table: u64,
    ws: u64,
    bar: u64,
    attn: u64,
    w_o: u64,
    proj: u64,
    stamps: u64,
    hidden: i32,
    num_heads: i32,
    nkv: i32,
    bs: i32,
    num_blocks: i32,
    mbps: i32,
    rows_qkv: i32,
    rows_o: i32,
    parts: i32,
    min_keys: i32,
    set: i32,
    scale_log2: f32,
}

impl CudaContext {
    /// Whether [`CudaContext::attn_block1`] takes `shape` on this device (compute capability
    /// 9.0, head_dim [`HEAD_DIM`], at most [`MAX_GROUP`] query heads per KV head, the weight
    /// shares within the mbarriers and shared memory of one CTA per SM).
    pub fn attn_block1_fits(&self, shape: &AttnBlock1Shape) -> bool {
        self.check_attn_block1(shape).is_ok()
    }

    /// f32 elements of [`AttnBlock1Buffers::workspace`] for `shape` on this device.
    pub fn attn_block1_workspace_len(&self, shape: &AttnBlock1Shape) -> usize {
        let p = block1_plan(shape, self.info.sm_count);
        shape.num_heads * p.parts * (shape.head_dim + 2)
    }

    fn check_attn_block1(&self, s: &AttnBlock1Shape) -> CudaResult<Block1Plan> {
        if self.info.compute_capability != (9, 0) {
            return Err(crate::Error::Metadata(format!(
                "the one-launch attention block needs compute capability 9.0, not {:?}",
                self.info.compute_capability
            ))
            .into());
        }
        if s.head_dim != HEAD_DIM {
            return Err(shape_err(
                "one-launch attention head_dim",
                HEAD_DIM,
                s.head_dim,
            ));
        }
        if s.num_kv_heads == 0 || !s.num_heads.is_multiple_of(s.num_kv_heads) {
            return Err(shape_err(
                "one-launch attention heads (a multiple of the KV heads)",
                s.num_kv_heads,
                s.num_heads,
            ));
        }
        let group = s.num_heads / s.num_kv_heads;
        if group == 0 || group > MAX_GROUP {
            return Err(shape_err(
                "one-launch attention query heads per KV head",
                MAX_GROUP,
                group,
            ));
        }
        if s.hidden == 0 || !s.hidden.is_multiple_of(8) {
            return Err(shape_err(
                "one-launch attention hidden (a multiple of 8)",
                8,
                s.hidden,
            ));
        }
        let p = block1_plan(s, self.info.sm_count);
        if p.parts == 0 {
            return Err(shape_err(
                "one-launch attention KV heads",
                self.info.sm_count,
                s.num_kv_heads,
            ));
        }
        let most_rows = GROUP_ROWS * MAX_GROUPS;
        if p.rows_qkv > most_rows || p.rows_o > most_rows {
            return Err(shape_err(
                "one-launch attention weight rows per CTA",
                most_rows,
                p.rows_qkv.max(p.rows_o),
            ));
        }
        if p.smem > SMEM_MAX {
            return Err(shape_err(
                "one-launch attention shared bytes",
                SMEM_MAX,
                p.smem,
            ));
        }
        Ok(p)
    }

    /// The attention block of one sequence's one decode token in one launch: `residual`
    /// (first set from `init` when given) normed with `input_norm` (not changed otherwise),
    /// `qkv` = the QKV projection, the q/k norm + RoPE of the token's heads, its key and value
    /// written to the caches at its slot, the attention over the sequence's `seq_lens[0]` keys
    /// into `attn`, and `proj` = o_proj(attn) in f32 (before any all-reduce). `qkv` and the
    /// value are bit for bit what the separate kernels write, the key up to a bf16 rounding,
    /// `attn` up to f32 rounding, `proj` bit for bit the staged o_proj GEMV of this `attn`. The positions, slot, M-RoPE
    /// axes and block table are read before the dependency wait (host-written, as for
    /// [`CudaContext::qkv_rope_cache_bf16`]). Errors: a shape [`CudaContext::attn_block1_fits`]
    /// refuses, short buffers.
    pub fn attn_block1(
        &self,
        shape: AttnBlock1Shape,
        w: AttnBlock1Weights<'_>,
        b: AttnBlock1Buffers<'_>,
    ) -> CudaResult<()> {
        self.launch_attn_block1(shape, w, b, 0)
    }

    /// [`CudaContext::attn_block1`] recording each CTA's [`STAMPS`] timestamps (ns) into
    /// `stamps` (`sm_count * STAMPS`).
    #[cfg(test)]
    pub(crate) fn attn_block1_stamped(
        &self,
        shape: AttnBlock1Shape,
        w: AttnBlock1Weights<'_>,
        b: AttnBlock1Buffers<'_>,
        stamps: &mut CudaSlice<u64>,
    ) -> CudaResult<()> {
        at_least(
            "attention block stamps",
            stamps.len(),
            self.info.sm_count * STAMPS,
        )?;
        let (sp, _g) = stamps.device_ptr_mut(&self.stream);
        self.launch_attn_block1(shape, w, b, sp)
    }

    fn launch_attn_block1(
        &self,
        shape: AttnBlock1Shape,
        w: AttnBlock1Weights<'_>,
        b: AttnBlock1Buffers<'_>,
        stamps: u64,
    ) -> CudaResult<()> {
        let p = self.check_attn_block1(&shape)?;
        let AttnBlock1Shape {
            hidden: h,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            block_size: bs,
            max_blocks_per_seq: mbps,
            ..
        } = shape;
        let nq = (nh + 2 * nkv) * hd;
        let ko = nh * hd;
        crate::check_len("attention block input norm", w.input_norm.len(), h)?;
        crate::check_len("attention block qkv weight", w.qkv.len(), nq * h)?;
        crate::check_len("attention block o weight", w.o.len(), h * ko)?;
        if let Some((qn, kn)) = &w.qk_norm {
            crate::check_len("attention block q_norm", qn.len(), hd)?;
            crate::check_len("attention block k_norm", kn.len(), hd)?;
        }
        at_least("attention block residual", b.residual.len(), h)?;
        if let Some(i) = &b.init {
            at_least("attention block init", i.len(), h)?;
        }
        let row = bs * nkv * hd;
        if bs == 0 || b.k_cache.len() < row || !b.k_cache.len().is_multiple_of(row) {
            return Err(shape_err("attention block k cache", row, b.k_cache.len()));
        }
        crate::check_len("attention block v cache", b.v_cache.len(), b.k_cache.len())?;
        let num_blocks = b.k_cache.len() / row;
        match &b.mrope {
            None => at_least("attention block positions", b.positions.len(), 1)?,
            Some(m) => {
                crate::check_len("attention block M-RoPE axes", m.axes.len(), hd / 2)?;
                at_least("attention block M-RoPE row stride", m.row_stride, 1)?;
                at_least(
                    "attention block positions",
                    b.positions.len(),
                    2 * m.row_stride + 1,
                )?;
            }
        }
        at_least("attention block slot", b.slot_mapping.len(), 1)?;
        at_least("attention block seq_lens", b.seq_lens.len(), 1)?;
        at_least("attention block block table", b.block_table.len(), mbps)?;
        crate::check_len("attention block inv_freq", b.inv_freq.len(), hd / 2)?;
        at_least("attention block qkv", b.qkv.len(), nq)?;
        at_least("attention block attn", b.attn.len(), ko)?;
        at_least("attention block proj", b.proj.len(), h)?;
        at_least(
            "attention block workspace",
            b.workspace.len(),
            self.attn_block1_workspace_len(&shape),
        )?;
        at_least("attention block barrier", b.barrier.len(), 1 + nkv)?;
        let s = &self.stream;
        let (res, _g0) = b.residual.device_ptr_mut(s);
        let (init, _g1) = match &b.init {
            Some(v) => {
                let (p, g) = v.device_ptr(s);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (kc, _g2) = b.k_cache.device_ptr_mut(s);
        let (vc, _g3) = b.v_cache.device_ptr_mut(s);
        let (pos, _g4) = b.positions.device_ptr(s);
        let (slots, _g5) = b.slot_mapping.device_ptr(s);
        let (sl, _g6) = b.seq_lens.device_ptr(s);
        let (bt, _g7) = b.block_table.device_ptr(s);
        let (inv, _g8) = b.inv_freq.device_ptr(s);
        let (qkv, _g9) = b.qkv.device_ptr_mut(s);
        let (attn, _g10) = b.attn.device_ptr_mut(s);
        let (proj, _g11) = b.proj.device_ptr_mut(s);
        let (ws, _g12) = b.workspace.device_ptr_mut(s);
        let (bar, _g13) = b.barrier.device_ptr_mut(s);
        let (nw, _g14) = w.input_norm.device_ptr(s);
        let (wq, _g15) = w.qkv.device_ptr(s);
        let (wo, _g16) = w.o.device_ptr(s);
        let (q_norm, k_norm, _g17) = match &w.qk_norm {
            Some((qn, kn)) => {
                let (a, ga) = qn.device_ptr(s);
                let (c, gc) = kn.device_ptr(s);
                (a, c, Some((ga, gc)))
            }
            None => (0, 0, None),
        };
        let (mrope_axes, pos_stride, _g18) = match &b.mrope {
            Some(m) => {
                let (a, g) = m.axes.device_ptr(s);
                (
                    a,
                    narrow::<i64>("M-RoPE row stride", m.row_stride)?,
                    Some(g),
                )
            }
            None => (0, 0, None),
        };
        for (what, ptr) in [
            ("attention block residual", res),
            ("attention block init", init),
            ("attention block k cache", kc),
            ("attention block v cache", vc),
            ("attention block qkv", qkv),
            ("attention block attn", attn),
            ("attention block workspace", ws),
            ("attention block q_norm", q_norm),
            ("attention block k_norm", k_norm),
            ("attention block qkv weight", wq),
            ("attention block o weight", wo),
        ] {
            aligned16(what, ptr)?;
        }
        let mut args = Ab1Args {
            rope: DecodeRopeArgs {
                qkv,
                kc_w: kc,
                vc_w: vc,
                positions: pos,
                slots,
                inv_freq: inv,
                q_norm,
                k_norm,
                mrope_axes,
                pos_stride,
                eps: shape.eps,
            },
            residual: res,
            init,
            norm_w: nw,
            w_qkv: wq,
            qkv,
            seq_lens: sl,
            block_table: bt,
            ws,
            bar,
            attn,
            w_o: wo,
            proj,
            stamps,
            hidden: narrow("hidden", h)?,
            num_heads: narrow("num_heads", nh)?,
            nkv: narrow("num_kv_heads", nkv)?,
            bs: narrow("block_size", bs)?,
            num_blocks: narrow("num_blocks", num_blocks)?,
            mbps: narrow("max_blocks_per_seq", mbps)?,
            rows_qkv: narrow("attention block qkv rows", p.rows_qkv)?,
            rows_o: narrow("attention block o rows", p.rows_o)?,
            parts: narrow("attention block partitions", p.parts)?,
            min_keys: narrow("attention block partition keys", min_keys())?,
            set: i32::from(init != 0),
            scale_log2: shape.scale * std::f32::consts::LOG2_E,
        };
        let f = self.function(attn_block1_source, BLOCK1_FN)?;
        let smem = max_dynamic_smem(&f, "attention block shared bytes", p.smem)?;
        let grid = narrow::<u32>("attention block CTAs", self.info.sm_count)?;
        let mut params = [std::ptr::from_mut(&mut args).cast::<std::ffi::c_void>()];
        // SAFETY: the one parameter is `Ab1Args` by value, whose C layout `Ab1Args` repeats
        // field for field (pointers as CUdeviceptr = u64). Every buffer was checked against the
        // shape above: weights of nq * h and h * ko bf16, the norm weights, residual / init / proj
        // of h, qkv of nq, attn of ko, the caches of num_blocks whole blocks (block ids from the
        // table are clamped into them by kv_slot, table indices below mbps), positions (three
        // rows with M-RoPE), one slot (negative: no write; else the caller keeps it inside the
        // caches, as for qkv_rope_cache_bf16), the workspace of nh * parts * (hd + 2) f32 and
        // 1 + nkv barrier words. Vector-accessed pointers are 16-byte aligned (checked), h and
        // ko are multiples of 8. The grid is the SM count of CTAs of 512 threads (one per SM by
        // the launch bound and `p.smem` bytes of dynamic shared memory, within the limit just
        // set); CTA c's QKV rows c * rows_qkv .. and o rows c * rows_o .. are clipped to nq and
        // h, at most 128 each (the kernel's mbarriers, checked), and CTAs c < nkv * parts take
        // one (KV head, partition) each, in tiles of at most PLEN_MAX keys (its shared
        // scores and slots). The grid barriers need every CTA resident: the kernel triggers its
        // dependents only after the first, and a barrier that waits for seconds traps.
        unsafe { self.launch_programmatic(&f, (grid, THREADS, smem), &mut params) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_30b() -> AttnBlock1Shape {
        AttnBlock1Shape {
            hidden: 2048,
            num_heads: 32,
            num_kv_heads: 4,
            head_dim: 128,
            block_size: 16,
            max_blocks_per_seq: 256,
            eps: 1e-6,
            scale: 128f32.powf(-0.5),
        }
    }

    /// The C layout of the kernel's `Ab1Args`: `DecodeRope` (nine pointers, a 64-bit stride and
    /// a float, padded to 88 bytes), then 13 pointers from byte 88, then 11 ints and a float
    /// from byte 192 (240 bytes).
    #[test]
    fn argument_layout_is_the_kernels() {
        assert_eq!(std::mem::size_of::<DecodeRopeArgs>(), 88);
        assert_eq!(std::mem::offset_of!(Ab1Args, residual), 88);
        assert_eq!(std::mem::offset_of!(Ab1Args, stamps), 88 + 12 * 8);
        assert_eq!(std::mem::offset_of!(Ab1Args, hidden), 192);
        assert_eq!(std::mem::offset_of!(Ab1Args, scale_log2), 192 + 11 * 4);
        assert_eq!(std::mem::size_of::<Ab1Args>(), 240);
    }

    /// Qwen3-30B-A3B on 132 SMs: 39 QKV rows and 16 o_proj rows a CTA, 33 partitions a KV head,
    /// ~182 KiB of shared memory (the QKV share), within the limit, and on the 114 SMs of an
    /// H100 PCIe 45 rows, ~206 KiB, still within it; a 4096-token context is ~125 keys a
    /// partition, 1088 keys 17 partitions of 64 at the default fewest keys.
    #[test]
    fn plan_of_the_30b_attention_block() {
        let p = block1_plan(&qwen3_30b(), 132);
        assert_eq!((p.rows_qkv, p.rows_o, p.parts), (39, 16, 33));
        assert_eq!(p.smem, 128 + 8192 + 16384 + 2048 + 39 * 2048 * 2);
        assert!(p.smem <= SMEM_MAX);
        let p = block1_plan(&qwen3_30b(), 114);
        assert_eq!((p.rows_qkv, p.rows_o, p.parts), (45, 18, 28));
        assert!(p.smem <= SMEM_MAX);
        assert_eq!(partitions(4096, 33, 64), (125, 33));
        assert_eq!(partitions(1088, 33, 1), (33, 33));
        assert_eq!(partitions(1088, 33, 64), (64, 17));
        assert_eq!(partitions(5, 33, 1), (1, 5));
        assert_eq!(partitions(5, 33, 64), (64, 1));
        assert_eq!(partitions(0, 33, 64), (0, 0));
    }
}
