//! Qwen3-Omni's Talker and code predictor on the device (`kernels/talker.cu`):
//!
//! - [`CudaContext::gated_shared_add_f32`]: `proj += sigmoid(x . gate) * shared_out` per row,
//!   the Talker's gated shared expert added to the routed sum;
//! - [`CudaContext::codec_input_bf16`]: the next Talker input, `codec_sum + text` in bf16;
//! - [`CudaContext::cp_begin`]: the code predictor's first step of a frame (inputs
//!   `[h, E(c0)]` per row, `codec_sum = E(c0)`, the step's metadata);
//! - [`CudaContext::talker_choose_c0`]: layer 0 under the repetition penalty and the suppressed
//!   control range, then argmax or top-k / top-p;
//! - [`CudaContext::cp_choose`]: group `g`'s code, its embedding added to `codec_sum` and
//!   written as the next step's input, and the next step's metadata.
//!
//! The code predictor's metadata (row `r` owns KV block `r`; step 1 is the 2-token prefill at
//! positions 0, 1; step `g >= 2` one token at position `g`) is written by these kernels, so a
//! whole frame (15 group steps) is one CUDA graph with no host work; [`cp_step_metadata`] is the
//! host mirror of that indexing. Draws are `u = hash(seed, frame * groups + group)`
//! ([`talker_uniform`] on the host), fed to the CPU's `top_k_top_p` rule.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use super::kernels::{BF16_HELPERS, kernel_file};
use super::launch::{at_least, block_threads, elementwise_cfg, narrow, shape_err};
use super::{CudaContext, CudaResult};

const TALKER: &str = kernel_file!("talker.cu");

const GATED_ADD_FN: &str = "gated_shared_add_f32";
const CODEC_INPUT_FN: &str = "codec_input_bf16";
const CP_BEGIN_FN: &str = "cp_begin";
const CHOOSE_C0_FN: &str = "talker_choose_c0";
const CP_CHOOSE_FN: &str = "cp_choose";

/// Threads of a choosing block (`CHOOSE_THREADS` in the kernel).
const CHOOSE_THREADS: u32 = 1024;
/// The largest vocabulary a choosing block holds in shared memory (`CHOOSE_MAX_VOCAB`).
pub const CHOOSE_MAX_VOCAB: usize = 4096;

/// Full source of the talker module.
pub(super) fn talker_source() -> String {
    format!("{BF16_HELPERS}{TALKER}")
}

pub use crate::ops::talker_uniform;

/// How one row chooses a code (uploaded once per request, read by every frame's kernels).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CodeSampling {
    /// `<= 0`: argmax (lowest id among equals); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the `top_k` largest (`<= 0`: all).
    pub top_k: i32,
    /// Then the smallest prefix holding `top_p` of the mass (`>= 1`: all of the top-k).
    pub top_p: f32,
    /// The row's random stream.
    pub seed: u64,
}

impl CodeSampling {
    /// Argmax.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// The six words the kernels read per row.
    pub fn words(&self) -> [u32; 6] {
        [
            self.temperature.to_bits(),
            self.top_k as u32,
            self.top_p.to_bits(),
            0,
            self.seed as u32,
            (self.seed >> 32) as u32,
        ]
    }
}

/// One code-predictor step's metadata as the kernels write it for `rows` rows at group step
/// `g` (1-based) with KV blocks of `block_size`: (positions, slots, query_start_loc, seq_lens,
/// block-table first entries, output rows). The host mirror of `cp_meta` in `kernels/talker.cu`.
#[allow(clippy::type_complexity)]
pub fn cp_step_metadata(
    rows: usize,
    g: usize,
    block_size: usize,
) -> (Vec<i32>, Vec<i64>, Vec<i32>, Vec<i32>, Vec<i32>, Vec<i32>) {
    let (mut pos, mut slots, mut qsl, mut lens, mut tables, mut out) = (
        Vec::new(),
        Vec::new(),
        vec![0],
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for r in 0..rows {
        let base = (r * block_size) as i64;
        if g == 1 {
            pos.extend([0, 1]);
            slots.extend([base, base + 1]);
            qsl.push(2 * (r as i32 + 1));
            lens.push(2);
            out.push(2 * r as i32 + 1);
        } else {
            pos.push(g as i32);
            slots.push(base + g as i64);
            qsl.push(r as i32 + 1);
            lens.push(g as i32 + 1);
            out.push(r as i32);
        }
        tables.push(r as i32);
    }
    (pos, slots, qsl, lens, tables, out)
}

/// The code predictor's per-step metadata buffers (the decoder's step inputs), which
/// [`CudaContext::cp_begin`] and [`CudaContext::cp_choose`] write.
#[derive(Debug)]
pub struct CpMetadata<'a> {
    /// `[tokens]` positions.
    pub positions: &'a mut CudaSlice<i32>,
    /// `[tokens]` cache slots.
    pub slots: &'a mut CudaSlice<i64>,
    /// `[rows + 1]`.
    pub query_start_loc: &'a mut CudaSlice<i32>,
    /// `[rows]`.
    pub seq_lens: &'a mut CudaSlice<i32>,
    /// `[rows, max_blocks_per_seq]`.
    pub block_tables: &'a mut CudaSlice<i32>,
    /// `[rows]` the rows whose final-norm state is gathered.
    pub out_rows: &'a mut CudaSlice<i32>,
}

/// The shape of the code predictor's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpShape {
    /// Rows (requests, padded to the graph's batch size).
    pub rows: usize,
    /// Width (the Talker's and the code predictor's).
    pub dim: usize,
    /// Codes per frame (16): layer 0 and the predicted groups.
    pub groups_total: usize,
    /// The code predictor's codes per group (its heads' width).
    pub vocab: usize,
    /// Tokens per KV block (at least `groups_total`: one block per row).
    pub block_size: usize,
    /// Block-table entries per row.
    pub max_blocks_per_seq: usize,
}

impl CpShape {
    fn check_meta(&self, m: &CpMetadata<'_>) -> CudaResult<()> {
        let r = self.rows;
        at_least("cp positions", m.positions.len(), 2 * r)?;
        at_least("cp slots", m.slots.len(), 2 * r)?;
        at_least("cp query_start_loc", m.query_start_loc.len(), r + 1)?;
        at_least("cp seq_lens", m.seq_lens.len(), r)?;
        at_least(
            "cp block_tables",
            m.block_tables.len(),
            r * self.max_blocks_per_seq,
        )?;
        at_least("cp out_rows", m.out_rows.len(), r)?;
        if self.block_size < self.groups_total || self.max_blocks_per_seq == 0 {
            return Err(shape_err(
                "cp block_size (one block per row)",
                self.groups_total,
                self.block_size,
            ));
        }
        Ok(())
    }

    fn ints(&self) -> CudaResult<[i32; 5]> {
        Ok([
            narrow::<i32>("cp dim", self.dim)?,
            narrow::<i32>("cp groups", self.groups_total)?,
            narrow::<i32>("cp vocab", self.vocab)?,
            narrow::<i32>("cp block_size", self.block_size)?,
            narrow::<i32>("cp max_blocks_per_seq", self.max_blocks_per_seq)?,
        ])
    }
}

/// The buffers of [`CudaContext::talker_choose_c0`].
#[derive(Debug)]
pub struct ChooseC0<'a> {
    /// `[rows, vocab]` the Talker's logits.
    pub logits: &'a CudaSlice<f32>,
    /// `[rows, vocab]` bytes: 1 where the row chose that code before (updated).
    pub seen: &'a mut CudaSlice<u8>,
    /// `[rows * 6]` words of [`CodeSampling::words`].
    pub params: &'a CudaSlice<u32>,
    /// `[rows]` frames done per row (the draw's offset; advanced by one).
    pub frame: &'a mut CudaSlice<i64>,
    /// `[rows]` the chosen code.
    pub c0: &'a mut CudaSlice<i32>,
    /// `[rows, groups_total]` frames; column 0 is written.
    pub codes: &'a mut CudaSlice<i32>,
    /// Teacher forcing ([`Forced`]): column 0 of the codes to continue with, the kernel's own
    /// choice recorded beside them.
    pub forced: Option<Forced<'a>>,
}

/// Teacher forcing of the choosing kernels: each row continues with `codes[r, g]` (clamped into
/// the vocabulary) and records what it would have chosen in `chosen[r, g]`, so the device
/// follows a given trajectory (a reference's frames) while its own choices can be checked.
#[derive(Debug)]
pub struct Forced<'a> {
    /// `[rows, groups_total]` the codes to continue with.
    pub codes: &'a CudaSlice<i32>,
    /// `[rows, groups_total]` the kernel's own choices (the forced columns are written).
    pub chosen: &'a mut CudaSlice<i32>,
}

impl Forced<'_> {
    fn check(&self, rows: usize, groups_total: usize) -> CudaResult<()> {
        at_least("forced codes", self.codes.len(), rows * groups_total)?;
        at_least("forced chosen", self.chosen.len(), rows * groups_total)
    }
}

/// Layer-0 constraints of [`CudaContext::talker_choose_c0`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct C0Rules {
    /// Rows.
    pub rows: usize,
    /// The Talker's codec vocabulary.
    pub vocab: usize,
    /// Repetition penalty over the row's earlier codes (1: off).
    pub penalty: f32,
    /// The one id of the suppressed range that stays (the stop code).
    pub eos: u32,
    /// Ids `[suppress_from, vocab)` are never chosen (but `eos`); `vocab`: none.
    pub suppress_from: usize,
    /// Codes per frame (the stride of `codes`).
    pub groups_total: usize,
}

/// The raw pointers of an optional [`Forced`] (null when off) and the guard of the mutable one.
fn forced_ptrs<'a>(
    s: &'a cudarc::driver::CudaStream,
    forced: Option<Forced<'a>>,
) -> CudaResult<(u64, u64, Option<cudarc::driver::SyncOnDrop<'a>>)> {
    Ok(match forced {
        None => (0, 0, None),
        Some(f) => {
            let (c, _g) = f.codes.device_ptr(s);
            let (ch, g) = f.chosen.device_ptr_mut(s);
            (c, ch, Some(g))
        }
    })
}

fn choose_cfg(rows: usize) -> CudaResult<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (narrow::<u32>("rows", rows)?, 1, 1),
        block_dim: (CHOOSE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl CudaContext {
    /// `proj[r] += sigmoid(x32[r] . gate) * shared_out[r]` for `rows` rows of width `dim`.
    pub fn gated_shared_add_f32(
        &self,
        proj: &mut CudaSlice<f32>,
        x32: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        shared_out: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
    ) -> CudaResult<()> {
        let n = rows * dim;
        at_least("gated add proj", proj.len(), n)?;
        at_least("gated add x32", x32.len(), n)?;
        at_least("gated add shared_out", shared_out.len(), n)?;
        crate::check_len("gated add gate", gate.len(), dim)?;
        if n == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (narrow::<u32>("rows", rows)?, 1, 1),
            block_dim: (block_threads(dim, 1024), 1, 1),
            shared_mem_bytes: 0,
        };
        let dim_i = narrow::<i32>("dim", dim)?;
        let f = self.function(talker_source, GATED_ADD_FN)?;
        let s = &self.stream;
        let (p, _g1) = proj.device_ptr_mut(s);
        let (x, _g2) = x32.device_ptr(s);
        let (g, _g3) = gate.device_ptr(s);
        let (o, _g4) = shared_out.device_ptr(s);
        let mut launch = s.launch_builder(&f);
        launch.arg(&p).arg(&x).arg(&g).arg(&o).arg(&dim_i);
        // SAFETY: the arguments match `gated_shared_add_f32(float*, const float*, const float*,
        // const float*, int)`; proj, x32 and shared_out hold rows * dim and gate dim elements
        // (checked above); one block per row with a multiple of 32 threads (at most 1024), as
        // the block reduction requires.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// `out[..n] = bf16(codec_sum + text)`.
    pub fn codec_input_bf16(
        &self,
        out: &mut CudaSlice<bf16>,
        codec_sum: &CudaSlice<f32>,
        text: &CudaSlice<f32>,
        n: usize,
    ) -> CudaResult<()> {
        at_least("codec input out", out.len(), n)?;
        at_least("codec input sum", codec_sum.len(), n)?;
        at_least("codec input text", text.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n_i = narrow::<i64>("n", n)?;
        let f = self.function(talker_source, CODEC_INPUT_FN)?;
        let s = &self.stream;
        let (o, _g1) = out.device_ptr_mut(s);
        let (c, _g2) = codec_sum.device_ptr(s);
        let (t, _g3) = text.device_ptr(s);
        let mut launch = s.launch_builder(&f);
        launch.arg(&o).arg(&c).arg(&t).arg(&n_i);
        // SAFETY: the arguments match `codec_input_bf16(u16*, const float*, const float*, long
        // long)`; all three buffers hold at least n elements (checked above).
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// The code predictor's first step of a frame: `cp_in` rows `2r, 2r + 1` = `hidden[r]`,
    /// `talker_embed[c0[r]]`; `codec_sum[r] = talker_embed[c0[r]]`; `codes[r, 0] = c0[r]`; the
    /// step-1 metadata. `c0` must be below the Talker's vocabulary (`talker_embed` rows): the
    /// choosing kernel guarantees it.
    #[allow(clippy::too_many_arguments)]
    pub fn cp_begin(
        &self,
        shape: CpShape,
        hidden: &CudaSlice<bf16>,
        c0: &CudaSlice<i32>,
        talker_embed: &CudaSlice<bf16>,
        cp_in: &mut CudaSlice<bf16>,
        codec_sum: &mut CudaSlice<f32>,
        codes: &mut CudaSlice<i32>,
        meta: CpMetadata<'_>,
    ) -> CudaResult<()> {
        shape.check_meta(&meta)?;
        let (r, d) = (shape.rows, shape.dim);
        at_least("cp_begin hidden", hidden.len(), r * d)?;
        at_least("cp_begin c0", c0.len(), r)?;
        at_least("cp_begin cp_in", cp_in.len(), 2 * r * d)?;
        at_least("cp_begin codec_sum", codec_sum.len(), r * d)?;
        at_least("cp_begin codes", codes.len(), r * shape.groups_total)?;
        if r == 0 {
            return Ok(());
        }
        let [dim, groups, _, bs, mbps] = shape.ints()?;
        let f = self.function(talker_source, CP_BEGIN_FN)?;
        let s = &self.stream;
        let (h, _g1) = hidden.device_ptr(s);
        let (c, _g2) = c0.device_ptr(s);
        let (e, _g3) = talker_embed.device_ptr(s);
        let (ci, _g4) = cp_in.device_ptr_mut(s);
        let (cs, _g5) = codec_sum.device_ptr_mut(s);
        let (co, _g6) = codes.device_ptr_mut(s);
        let (m1, _m1) = meta.positions.device_ptr_mut(s);
        let (m2, _m2) = meta.slots.device_ptr_mut(s);
        let (m3, _m3) = meta.query_start_loc.device_ptr_mut(s);
        let (m4, _m4) = meta.seq_lens.device_ptr_mut(s);
        let (m5, _m5) = meta.block_tables.device_ptr_mut(s);
        let (m6, _m6) = meta.out_rows.device_ptr_mut(s);
        let mut launch = s.launch_builder(&f);
        launch
            .arg(&h)
            .arg(&c)
            .arg(&e)
            .arg(&ci)
            .arg(&cs)
            .arg(&co)
            .arg(&m1)
            .arg(&m2)
            .arg(&m3)
            .arg(&m4)
            .arg(&m5)
            .arg(&m6)
            .arg(&dim)
            .arg(&groups)
            .arg(&bs)
            .arg(&mbps);
        let cfg = LaunchConfig {
            grid_dim: (narrow::<u32>("rows", r)?, 1, 1),
            block_dim: (block_threads(d, 1024), 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `cp_begin`'s parameter list; every buffer holds what its
        // row count needs (checked above: 2 rows of cp_in and metadata per row, block tables of
        // max_blocks_per_seq per row); c0 values index talker_embed by the caller's contract
        // (they come from talker_choose_c0, below its vocabulary). One block per row.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// Chooses each row's layer-0 code (see the module docs).
    pub fn talker_choose_c0(&self, rules: C0Rules, b: ChooseC0<'_>) -> CudaResult<()> {
        let (r, v) = (rules.rows, rules.vocab);
        if v == 0 || v > CHOOSE_MAX_VOCAB || rules.eos as usize >= v {
            return Err(shape_err(
                "talker vocab (at most 4096)",
                CHOOSE_MAX_VOCAB,
                v,
            ));
        }
        at_least("choose_c0 logits", b.logits.len(), r * v)?;
        at_least("choose_c0 seen", b.seen.len(), r * v)?;
        at_least("choose_c0 params", b.params.len(), r * 6)?;
        at_least("choose_c0 frame", b.frame.len(), r)?;
        at_least("choose_c0 c0", b.c0.len(), r)?;
        at_least("choose_c0 codes", b.codes.len(), r * rules.groups_total)?;
        if let Some(fc) = &b.forced {
            fc.check(r, rules.groups_total)?;
        }
        if r == 0 {
            return Ok(());
        }
        let (vi, eos, sup, groups) = (
            narrow::<i32>("vocab", v)?,
            narrow::<i32>("eos", rules.eos as usize)?,
            narrow::<i32>("suppress_from", rules.suppress_from.min(v))?,
            narrow::<i32>("groups", rules.groups_total)?,
        );
        let f = self.function(talker_source, CHOOSE_C0_FN)?;
        let s = &self.stream;
        let (l, _g1) = b.logits.device_ptr(s);
        let (sn, _g2) = b.seen.device_ptr_mut(s);
        let (p, _g3) = b.params.device_ptr(s);
        let (fr, _g4) = b.frame.device_ptr_mut(s);
        let (c, _g5) = b.c0.device_ptr_mut(s);
        let (co, _g6) = b.codes.device_ptr_mut(s);
        let (fc, ch, _g7) = forced_ptrs(s, b.forced)?;
        let mut launch = s.launch_builder(&f);
        launch
            .arg(&l)
            .arg(&sn)
            .arg(&p)
            .arg(&fr)
            .arg(&c)
            .arg(&co)
            .arg(&fc)
            .arg(&ch)
            .arg(&vi)
            .arg(&rules.penalty)
            .arg(&eos)
            .arg(&sup)
            .arg(&groups);
        // SAFETY: the arguments match `talker_choose_c0`'s parameter list; logits and seen hold
        // rows * vocab, params 6 words per row, frame / c0 one per row and codes (and the
        // forced / chosen codes, or null) rows * groups_total (checked above); forced codes are
        // clamped into the vocabulary before they index anything; vocab <= CHOOSE_MAX_VOCAB, the kernel's shared-memory
        // row; one block of CHOOSE_THREADS per row, as its __launch_bounds__ says.
        unsafe { launch.launch(choose_cfg(r)?) }?;
        Ok(())
    }

    /// Chooses code `g` (1-based) of each row from the code predictor's head logits and
    /// prepares step `g + 1` (see the module docs). `embed` is `[groups_total - 1, vocab, dim]`.
    /// With `forced`, each row continues with the forced code of group `g` (see [`Forced`]).
    #[allow(clippy::too_many_arguments)]
    pub fn cp_choose(
        &self,
        shape: CpShape,
        g: usize,
        logits: &CudaSlice<f32>,
        params: &CudaSlice<u32>,
        frame: &mut CudaSlice<i64>,
        embed: &CudaSlice<bf16>,
        cp_in: &mut CudaSlice<bf16>,
        codec_sum: &mut CudaSlice<f32>,
        codes: &mut CudaSlice<i32>,
        meta: CpMetadata<'_>,
        forced: Option<Forced<'_>>,
    ) -> CudaResult<()> {
        shape.check_meta(&meta)?;
        let (r, v, d) = (shape.rows, shape.vocab, shape.dim);
        if v == 0 || v > CHOOSE_MAX_VOCAB || g == 0 || g >= shape.groups_total {
            return Err(shape_err(
                "cp vocab (at most 4096) / group",
                CHOOSE_MAX_VOCAB,
                v,
            ));
        }
        at_least("cp_choose logits", logits.len(), r * v)?;
        at_least("cp_choose params", params.len(), r * 6)?;
        at_least("cp_choose frame", frame.len(), r)?;
        crate::check_len(
            "cp_choose embed",
            embed.len(),
            (shape.groups_total - 1) * v * d,
        )?;
        at_least("cp_choose cp_in", cp_in.len(), r * d)?;
        at_least("cp_choose codec_sum", codec_sum.len(), r * d)?;
        at_least("cp_choose codes", codes.len(), r * shape.groups_total)?;
        if let Some(fc) = &forced {
            fc.check(r, shape.groups_total)?;
        }
        if r == 0 {
            return Ok(());
        }
        let [dim, groups, vocab, bs, mbps] = shape.ints()?;
        let gi = narrow::<i32>("group", g)?;
        let f = self.function(talker_source, CP_CHOOSE_FN)?;
        let s = &self.stream;
        let (l, _g1) = logits.device_ptr(s);
        let (p, _g2) = params.device_ptr(s);
        let (fr, _g3) = frame.device_ptr_mut(s);
        let (e, _g4) = embed.device_ptr(s);
        let (ci, _g5) = cp_in.device_ptr_mut(s);
        let (cs, _g6) = codec_sum.device_ptr_mut(s);
        let (co, _g7) = codes.device_ptr_mut(s);
        let (m1, _m1) = meta.positions.device_ptr_mut(s);
        let (m2, _m2) = meta.slots.device_ptr_mut(s);
        let (m3, _m3) = meta.query_start_loc.device_ptr_mut(s);
        let (m4, _m4) = meta.seq_lens.device_ptr_mut(s);
        let (m5, _m5) = meta.block_tables.device_ptr_mut(s);
        let (m6, _m6) = meta.out_rows.device_ptr_mut(s);
        let (fc, ch, _g8) = forced_ptrs(s, forced)?;
        let mut launch = s.launch_builder(&f);
        launch
            .arg(&l)
            .arg(&p)
            .arg(&fr)
            .arg(&e)
            .arg(&ci)
            .arg(&cs)
            .arg(&co)
            .arg(&m1)
            .arg(&m2)
            .arg(&m3)
            .arg(&m4)
            .arg(&m5)
            .arg(&m6)
            .arg(&fc)
            .arg(&ch)
            .arg(&vocab)
            .arg(&dim)
            .arg(&gi)
            .arg(&groups)
            .arg(&bs)
            .arg(&mbps);
        // SAFETY: the arguments match `cp_choose`'s parameter list; every buffer holds what the
        // row count needs (checked above, the forced / chosen codes too, or null), embed is
        // exactly the groups' tables, the chosen code is below vocab (an id of the row, or a
        // forced code clamped into the vocabulary) so its table row is inside embed; vocab <=
        // CHOOSE_MAX_VOCAB; one block of CHOOSE_THREADS per row.
        unsafe { launch.launch(choose_cfg(r)?) }?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn cp_metadata_matches_the_batches_of_growing_sequences() {
        // Step 1: two tokens per row at positions 0, 1; later steps one token at position g.
        let (pos, slots, qsl, lens, tables, rows) = cp_step_metadata(3, 1, 16);
        assert_eq!(pos, [0, 1, 0, 1, 0, 1]);
        assert_eq!(slots, [0, 1, 16, 17, 32, 33]);
        assert_eq!(qsl, [0, 2, 4, 6]);
        assert_eq!(lens, [2, 2, 2]);
        assert_eq!(tables, [0, 1, 2]);
        assert_eq!(rows, [1, 3, 5]);
        let (pos, slots, qsl, lens, _, rows) = cp_step_metadata(2, 15, 16);
        assert_eq!((pos, slots), (vec![15, 15], vec![15, 31]));
        assert_eq!((qsl, lens, rows), (vec![0, 1, 2], vec![16, 16], vec![0, 1]));
    }

    #[test]
    fn the_draw_is_a_stateless_hash() {
        let a = talker_uniform(7, 3);
        assert_eq!(a, talker_uniform(7, 3));
        assert_ne!(a, talker_uniform(7, 4));
        assert!((0.0..1.0).contains(&a));
        let words = CodeSampling {
            temperature: 1.0,
            top_k: 50,
            top_p: 0.8,
            seed: 0x1_0000_0002,
        }
        .words();
        assert_eq!(words[1], 50);
        assert_eq!((words[4], words[5]), (2, 1));
    }
}
