//! [`CudaContext::paged_attention_bf16`]: checks, then the decode (and reduce) or prefill launch.

use std::ffi::c_void;

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::rope::DecodeRopeArgs;
use super::source::{REDUCE_FN, attn_wgmma_source, hd_kernels, reduce_source};
use super::{
    ATTN_COUNTERS, AttnShape, DECODE_THREADS, DecodePlan, GROUP_TILES, MAX_FUSED_PARTS,
    MAX_PARTITION, PrefillTile, REDUCE_THREADS, TC_TILE, WGMMA_HEAD_DIM, decode_plan,
    decode_workspace_len, group_size, prefill_cfg, tc_smem_bytes, wgmma_prefill_enabled,
    wgmma_prefill_for,
};
use crate::cuda::launch::{aligned16, at_least, grid_yz, max_dynamic_smem, narrow, shape_err};
use crate::cuda::moe::source::WGMMA_ARCH;
use crate::cuda::{CudaContext, CudaResult, bf16};

impl CudaContext {
    /// Paged attention of `q` (`[num_tokens, num_heads, head_dim]` bf16) over the caches
    /// (`[num_blocks, block_size, num_kv_heads, head_dim]`) into `out` (same shape as `q`): the
    /// GPU twin of [`crate::attention::paged_attention`], f32 math.
    ///
    /// Metadata lives on the device: `query_start_loc` (`[num_seqs + 1]` i32), `seq_lens`
    /// (`[num_seqs]` i32, context length including the new tokens) and `block_tables`
    /// (`[num_seqs, max_blocks_per_seq]` i32). Host scalars come in `shape`; the decode path runs
    /// when `shape.max_query_len == 1` (then every sequence has 0 or 1 query tokens), else the
    /// tensor-core prefill path. `workspace` must hold [`paged_attention_workspace_len`](super::paged_attention_workspace_len) f32
    /// (any buffer when that is 0).
    ///
    /// Launch-only: no allocation, no synchronization and no host reads of device memory, so it
    /// can be captured in a CUDA graph (the kernels must have been loaded by an earlier call).
    /// Buffers may be longer than `shape` needs; `q`, `out` and the caches must start 16-byte
    /// aligned. Rows of `out` that belong to no sequence are left untouched.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_bf16(
        &self,
        q: &impl DevicePtr<bf16>,
        k_cache: &impl DevicePtr<bf16>,
        v_cache: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        query_start_loc: &impl DevicePtr<i32>,
        seq_lens: &impl DevicePtr<i32>,
        block_tables: &impl DevicePtr<i32>,
        workspace: &mut impl DevicePtrMut<f32>,
        shape: &AttnShape,
    ) -> CudaResult<()> {
        let plan = decode_plan(shape);
        self.paged_attention_planned(
            q,
            k_cache,
            v_cache,
            out,
            query_start_loc,
            seq_lens,
            block_tables,
            workspace,
            shape,
            plan,
        )
    }

    /// [`Self::paged_attention_bf16`] with the decode path launched as `plan` says (the tests
    /// compare plans; every plan gives the same answer up to f32 rounding).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn paged_attention_planned(
        &self,
        q: &impl DevicePtr<bf16>,
        k_cache: &impl DevicePtr<bf16>,
        v_cache: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        query_start_loc: &impl DevicePtr<i32>,
        seq_lens: &impl DevicePtr<i32>,
        block_tables: &impl DevicePtr<i32>,
        workspace: &mut impl DevicePtrMut<f32>,
        shape: &AttnShape,
        plan: DecodePlan,
    ) -> CudaResult<()> {
        let kernels = hd_kernels(shape.head_dim)?;
        let prefill = wgmma_prefill_for(
            shape.head_dim,
            self.info.compute_capability,
            wgmma_prefill_enabled(),
        )
        .unwrap_or((prefill_cfg(shape.head_dim), kernels.prefill));
        self.paged_attention_tiled(
            q,
            k_cache,
            v_cache,
            out,
            query_start_loc,
            seq_lens,
            block_tables,
            workspace,
            shape,
            plan,
            prefill,
            None,
        )
    }

    /// [`Self::paged_attention_planned`] with the prefill path on `prefill` (a tiling and the
    /// entry point instantiating it: the prefill timing compares tilings), and with `rope` the
    /// decode path's `attn_decode_rope_*` entries, which take the q/k norm + RoPE + cache write
    /// inside (`q` is then the QKV rows the arguments also point at;
    /// [`Self::paged_attention_rope_bf16`] checked them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn paged_attention_tiled(
        &self,
        q: &impl DevicePtr<bf16>,
        k_cache: &impl DevicePtr<bf16>,
        v_cache: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        query_start_loc: &impl DevicePtr<i32>,
        seq_lens: &impl DevicePtr<i32>,
        block_tables: &impl DevicePtr<i32>,
        workspace: &mut impl DevicePtrMut<f32>,
        shape: &AttnShape,
        plan: DecodePlan,
        (tile, prefill_fn): (PrefillTile, &'static str),
        rope: Option<&mut DecodeRopeArgs>,
    ) -> CudaResult<()> {
        let sh = *shape;
        let kernels = hd_kernels(sh.head_dim)?;
        if sh.num_kv_heads == 0 || !sh.num_heads.is_multiple_of(sh.num_kv_heads) {
            return Err(crate::Error::Metadata(format!(
                "cuda paged attention: {} query heads over {} KV heads",
                sh.num_heads, sh.num_kv_heads
            ))
            .into());
        }
        if sh.block_size == 0 || sh.max_blocks_per_seq == 0 {
            return Err(crate::Error::Metadata(format!(
                "cuda paged attention: block_size {} and max_blocks_per_seq {} must be positive",
                sh.block_size, sh.max_blocks_per_seq
            ))
            .into());
        }
        if !sh.scale.is_finite() {
            return Err(crate::Error::Metadata(format!(
                "cuda paged attention: softmax scale {} is not finite",
                sh.scale
            ))
            .into());
        }
        let q_len = sh.num_tokens * sh.num_heads * sh.head_dim;
        at_least("cuda paged attention query", q.len(), q_len)?;
        at_least("cuda paged attention out", out.len(), q_len)?;
        at_least(
            "cuda paged attention query_start_loc",
            query_start_loc.len(),
            sh.num_seqs + 1,
        )?;
        at_least("cuda paged attention seq_lens", seq_lens.len(), sh.num_seqs)?;
        at_least(
            "cuda paged attention block_tables",
            block_tables.len(),
            sh.num_seqs * sh.max_blocks_per_seq,
        )?;
        let block_elems = sh.block_size * sh.num_kv_heads * sh.head_dim;
        crate::check_len(
            "cuda paged attention value cache (same as key cache)",
            v_cache.len(),
            k_cache.len(),
        )?;
        if k_cache.len() < block_elems || !k_cache.len().is_multiple_of(block_elems) {
            return Err(shape_err(
                "cuda paged attention cache (a positive multiple of block_size * num_kv_heads * head_dim)",
                block_elems,
                k_cache.len(),
            ));
        }
        let num_blocks = k_cache.len() / block_elems;
        // Slots are int on the device.
        narrow::<i32>("cache slots", num_blocks * sh.block_size)?;
        let decode = sh.max_query_len == 1;
        if rope.is_some() && (!decode || plan.tc) {
            return Err(crate::Error::Metadata(format!(
                "cuda paged attention: the q/k norm + RoPE form needs a decode step on the \
                 CUDA-core kernel, not max_query_len {} with plan {plan:?}",
                sh.max_query_len
            ))
            .into());
        }
        if decode {
            let chunks = group_size(&sh).div_ceil(plan.tile.max(1));
            let groups = sh.num_kv_heads * chunks * sh.num_seqs;
            if !GROUP_TILES.contains(&plan.tile)
                || (plan.tc && plan.tile != TC_TILE)
                || plan.part == 0
                || plan.part > MAX_PARTITION
                || plan.parts * plan.part < sh.max_seq_len
                || (plan.fused && (groups > ATTN_COUNTERS || plan.parts > MAX_FUSED_PARTS))
            {
                return Err(crate::Error::Metadata(format!(
                    "cuda paged attention: decode plan {plan:?} does not fit {groups} groups of \
                     {} tokens",
                    sh.max_seq_len
                ))
                .into());
            }
            at_least(
                "cuda paged attention workspace",
                workspace.len(),
                decode_workspace_len(&sh, plan.parts),
            )?;
        }
        if sh.num_seqs == 0 || sh.num_tokens == 0 || sh.max_query_len == 0 {
            return Ok(());
        }

        let num_tokens = narrow::<i32>("num_tokens", sh.num_tokens)?;
        let num_heads = narrow::<i32>("num_heads", sh.num_heads)?;
        let nkv = narrow::<i32>("num_kv_heads", sh.num_kv_heads)?;
        let bs = narrow::<i32>("block_size", sh.block_size)?;
        let num_blocks_i = narrow::<i32>("num_blocks", num_blocks)?;
        let mbps = narrow::<i32>("max_blocks_per_seq", sh.max_blocks_per_seq)?;
        let scale_log2 = sh.scale * std::f32::consts::LOG2_E;
        let seqs = grid_yz("num_seqs", sh.num_seqs)?;

        let (qp, _gq) = q.device_ptr(&self.stream);
        let (kp, _gk) = k_cache.device_ptr(&self.stream);
        let (vp, _gv) = v_cache.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let (qslp, _gqsl) = query_start_loc.device_ptr(&self.stream);
        let (slp, _gsl) = seq_lens.device_ptr(&self.stream);
        let (btp, _gbt) = block_tables.device_ptr(&self.stream);
        let (wsp, _gws) = workspace.device_ptr_mut(&self.stream);
        for (what, p) in [
            ("cuda paged attention query", qp),
            ("cuda paged attention key cache", kp),
            ("cuda paged attention value cache", vp),
            ("cuda paged attention out", op),
        ] {
            aligned16(what, p)?;
        }

        if decode {
            let DecodePlan {
                tile,
                part,
                parts,
                fused,
                pdl,
                tc,
                balanced,
            } = plan;
            let chunks = group_size(&sh).div_ceil(tile);
            let tile_idx = GROUP_TILES.iter().position(|&t| t == tile).unwrap_or(0);
            let mut part_i = narrow::<i32>("decode partition", part)?;
            let mut parts_i = narrow::<i32>("decode partitions", parts)?;
            let mut chunks_i = narrow::<i32>("head chunks", chunks)?;
            let mut fused_i = i32::from(fused);
            let mut balanced_i = i32::from(balanced);
            let grid = (
                narrow::<u32>("num_kv_heads * head chunks", sh.num_kv_heads * chunks)?,
                seqs,
                grid_yz("decode partitions", parts)?,
            );
            let (f, smem) = if tc {
                let f = self.function(kernels.source, kernels.decode_tc)?;
                let smem =
                    max_dynamic_smem(&f, "decode shared memory", tc_smem_bytes(sh.head_dim))?;
                (f, smem)
            } else if rope.is_some() {
                (
                    self.function(kernels.source, kernels.decode_rope[tile_idx])?,
                    0,
                )
            } else {
                (self.function(kernels.source, kernels.decode[tile_idx])?, 0)
            };
            let (mut qp, mut kp, mut vp, mut op2, mut qslp, mut slp, mut btp, mut wsp) =
                (qp, kp, vp, op, qslp, slp, btp, wsp);
            let (mut num_tokens, mut num_heads, mut nkv, mut bs, mut num_blocks_i, mut mbps) =
                (num_tokens, num_heads, nkv, bs, num_blocks_i, mbps);
            let mut scale = scale_log2;
            let mut args: Vec<*mut c_void> = vec![
                (&raw mut qp).cast(),
                (&raw mut kp).cast(),
                (&raw mut vp).cast(),
                (&raw mut op2).cast(),
                (&raw mut qslp).cast(),
                (&raw mut slp).cast(),
                (&raw mut btp).cast(),
                (&raw mut wsp).cast(),
                (&raw mut num_tokens).cast(),
                (&raw mut num_heads).cast(),
                (&raw mut nkv).cast(),
                (&raw mut bs).cast(),
                (&raw mut num_blocks_i).cast(),
                (&raw mut mbps).cast(),
                (&raw mut part_i).cast(),
                (&raw mut parts_i).cast(),
                (&raw mut chunks_i).cast(),
                (&raw mut fused_i).cast(),
                (&raw mut balanced_i).cast(),
                (&raw mut scale).cast(),
            ];
            if let Some(r) = rope {
                args.push(std::ptr::from_mut(r).cast());
            }
            // SAFETY: `args` points at the arguments of `attn_decode_hd*_g*` (or
            // `attn_decode_tc_hd*_g8`, the same list) `(const u16* x3, u16*,
            // const int* x3, float*, int x11, float)` in order, with those types (device
            // pointers are CUdeviceptr = u64). q/out hold num_tokens rows of num_heads *
            // head_dim and the kernel only touches rows qsl[s] < num_tokens; the metadata
            // buffers hold num_seqs (+1) entries and num_seqs * max_blocks_per_seq table entries
            // (grid y = num_seqs); block-table indices are clamped below max_blocks_per_seq and
            // block ids into 0..num_blocks, the size of both caches (checked). The workspace
            // holds num_seqs * num_heads * parts * (head_dim + 2) f32 when parts > 1 (checked)
            // and is not touched otherwise. A fused launch has at most ATTN_COUNTERS groups
            // (grid x * grid y, checked), the size of the module's counter array, and at most
            // MAX_FUSED_PARTS = ATTN_MAXPART partitions, the per-head room of the merge's
            // weights in shared memory (checked). All bf16 pointers are 16-byte aligned
            // (checked). With `pdl` the kernel reads only host-written metadata before its
            // `griddepcontrol.wait`. The tensor-core instance (tile TC_TILE, checked) gets the
            // dynamic shared memory `tc_smem_bytes` says it uses, and the limit is raised to it.
            // With `rope` the entry is `attn_decode_rope_hd*_g*`: the same list and a
            // `DecodeRope` by value, whose layout `DecodeRopeArgs` repeats (#[repr(C)]); its
            // pointers were checked by `paged_attention_rope_bf16` (q is its QKV buffer, longer
            // than num_tokens rows of num_heads heads), the caches it writes are the ones read
            // here, at slots the caller keeps inside them as for `qkv_rope_cache_bf16`, and
            // before the wait it reads only the positions, the M-RoPE axes and inv_freq
            // (host-written, as for that kernel).
            unsafe { self.launch_ex(&f, grid, (DECODE_THREADS, smem), pdl, &mut args) }?;
            if parts > 1 && !fused {
                let hd_i = narrow::<i32>("head_dim", sh.head_dim)?;
                let cfg = LaunchConfig {
                    grid_dim: (narrow::<u32>("num_heads", sh.num_heads)?, seqs, 1),
                    block_dim: (REDUCE_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let f = self.function(reduce_source, REDUCE_FN)?;
                let mut launch = self.stream.launch_builder(&f);
                launch
                    .arg(&wsp)
                    .arg(&op)
                    .arg(&qslp)
                    .arg(&slp)
                    .arg(&num_tokens)
                    .arg(&num_heads)
                    .arg(&hd_i)
                    .arg(&part_i)
                    .arg(&parts_i)
                    .arg(&balanced_i);
                // SAFETY: the arguments match `attn_decode_reduce(const float*, u16*, const
                // int*, const int*, int x6)`; the workspace holds the num_seqs * num_heads *
                // parts rows (and their max / sum) written by the decode launch above on the
                // same stream; out rows are only written for qsl[s] < num_tokens, and the
                // kernel reads at most `parts` partitions per row.
                unsafe { launch.launch(cfg) }?;
            }
        } else {
            let bm = 16 * tile.warps;
            let f = if tile.wgmma {
                if sh.head_dim != WGMMA_HEAD_DIM || self.info.compute_capability != (9, 0) {
                    return Err(crate::Error::Metadata(format!(
                        "cuda paged attention: the wgmma prefill kernel needs head_dim \
                         {WGMMA_HEAD_DIM} on compute capability 9.0, not head_dim {} on {:?}",
                        sh.head_dim, self.info.compute_capability
                    ))
                    .into());
                }
                self.function_for(attn_wgmma_source, prefill_fn, WGMMA_ARCH)?
            } else {
                self.function(kernels.source, prefill_fn)?
            };
            let smem = max_dynamic_smem(
                &f,
                "attention prefill shared memory",
                tile.smem_bytes(sh.head_dim),
            )?;
            let cfg = LaunchConfig {
                grid_dim: (
                    narrow::<u32>("query tiles", sh.max_query_len.div_ceil(bm))?,
                    grid_yz("num_heads", sh.num_heads)?,
                    seqs,
                ),
                block_dim: (32 * tile.warps as u32, 1, 1),
                shared_mem_bytes: smem,
            };
            let mut launch = self.stream.launch_builder(&f);
            launch
                .arg(&qp)
                .arg(&kp)
                .arg(&vp)
                .arg(&op)
                .arg(&qslp)
                .arg(&slp)
                .arg(&btp)
                .arg(&num_tokens)
                .arg(&num_heads)
                .arg(&nkv)
                .arg(&bs)
                .arg(&num_blocks_i)
                .arg(&mbps)
                .arg(&scale_log2);
            // SAFETY: the arguments match `attn_prefill_hd*(const u16* x3, u16*, const int* x3,
            // int x6, float)` (the wgmma entries `attn_prefill_wg_hd128_*` take the same list)
            // of the instance of `tile`; the block has 32 * warps threads and the dynamic shared
            // memory `tile.smem_bytes` gives, as that instance assumes (limit raised above; the
            // wgmma kernel only runs at head_dim 128 on sm_90, checked). q/out rows are read and
            // written only below num_tokens, metadata entries only for s < num_seqs (grid z),
            // table indices are clamped below max_blocks_per_seq and block ids into the caches'
            // num_blocks (checked); all bf16 pointers are 16-byte aligned (checked).
            unsafe { launch.launch(cfg) }?;
        }
        Ok(())
    }
}
