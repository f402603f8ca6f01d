//! Time of SmolLM2-135M's linear layers on this CPU, per call, for several row counts `m`:
//! f32 weights resident (the old CPU path), the integer Q8 x Q4_1 / Q8_0 kernels, and f32 tiles
//! dequantized on the fly. What `quant::F32_MIN_ROWS` is chosen from.
//!
//! `cargo run --release -p omni-backend --example quant_bench [m,m,...]`
//!
//! `quant_bench --variants [KERNEL,KERNEL,...]` (default: every kernel this CPU runs but the
//! scalar one) instead compares the integer kernels in one run, batch 1, in thread CPU time
//! (what the shared machine's preemption does not change): per block at each shape in cache,
//! then one whole decode step of distinct weights (96 MB, streamed from memory as in the model)
//! on one thread, then the same step split over the rayon pool, and the pool's fork-join cost.

use std::time::Instant;

use half::f16;
use omni_backend::quant::q8::Q8Rows;
use omni_backend::quant::{Kernel, QMatrix, QuantType};

/// `(name, rows, cols, type, uses per decode step)` of one SmolLM2-135M step (30 layers).
const SHAPES: &[(&str, usize, usize, QuantType, usize)] = &[
    ("qkv", 960, 576, QuantType::Q4_1, 30),
    ("o", 576, 576, QuantType::Q4_1, 30),
    ("gate_up", 3072, 576, QuantType::Q4_1, 30),
    ("down", 576, 1536, QuantType::Q4_1, 30),
    ("q8_0 in cache", 960, 576, QuantType::Q8_0, 0),
    ("lm_head", 49152, 576, QuantType::Q8_0, 1),
];

fn random_matrix(ty: QuantType, rows: usize, cols: usize, seed: &mut u64) -> QMatrix {
    let mut next = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    };
    let mut data = Vec::with_capacity(rows * cols / 32 * ty.block_bytes());
    for _ in 0..rows * cols / 32 {
        data.extend(f16::from_f32(0.01).to_le_bytes());
        match ty {
            QuantType::Q4_1 => {
                data.extend(f16::from_f32(-0.08).to_le_bytes());
                data.extend((0..16).map(|_| next() as u8));
            }
            QuantType::Q8_0 => data.extend((0..32).map(|_| next() as u8)),
        }
    }
    QMatrix::new(ty, rows, cols, data).expect("sizes match")
}

/// This thread's CPU seconds: what a kernel costs when the shared machine preempts it.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux has.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Best of 5 of the thread CPU seconds per call over about 30 ms.
fn cpu_time(mut f: impl FnMut()) -> f64 {
    f();
    let t = thread_cpu_s();
    f();
    let once = (thread_cpu_s() - t).max(1e-7);
    let iters = ((0.03 / once) as usize).clamp(1, 10_000);
    (0..5)
        .map(|_| {
            let t = thread_cpu_s();
            for _ in 0..iters {
                f();
            }
            (thread_cpu_s() - t) / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// Best of 3 of the mean seconds per call over about 60 ms.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    f();
    let once = t.elapsed().as_secs_f64().max(1e-7);
    let iters = ((0.06 / once) as usize).clamp(1, 10_000);
    (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(at) = args.iter().position(|a| a == "--variants") {
        let names = args.get(at + 1).map(String::as_str);
        variants(names);
        return;
    }
    let ms: Vec<usize> = std::env::args()
        .nth(1)
        .map(|s| s.split(',').filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 4, 8, 16, 32, 64, 512]);
    let kernel = Kernel::detect();
    println!(
        "kernel {}, {} rayon threads; microseconds per call",
        kernel.name(),
        rayon::current_num_threads()
    );
    println!("| layer | m | f32 resident | integer | f32 tiles | integer, 1 thread CPU time |");
    println!("|---|---|---|---|---|---|");
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut step = vec![[0.0f64; 3]; ms.len()];
    for &(name, n, k, ty, uses) in SHAPES {
        let q = random_matrix(ty, n, k, &mut seed);
        let wf = q.dequantize();
        for (mi, &m) in ms.iter().enumerate() {
            if name == "lm_head" && m > 64 {
                continue; // the head runs on the output rows only
            }
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let mut out = vec![0.0f32; m * n];
            let f32_s = time(|| {
                omni_backend::linalg::matmul_nt(&a, &wf, &mut out, m, k, n).expect("shapes");
            });
            let int_s = time(|| q.matmul_nt_with(&a, &mut out, m, kernel).expect("shapes"));
            let tile_s = time(|| q.matmul_nt_f32_tiles(&a, &mut out, m).expect("shapes"));
            let acts = Q8Rows::quantize(&a, m, k);
            let rb = q.row_bytes();
            let kernel_s = cpu_time(|| kernel.fill(ty, q.bytes(), rb, &acts, &mut out));
            for (acc, s) in step[mi].iter_mut().zip([f32_s, int_s, tile_s]) {
                *acc += s * uses as f64;
            }
            println!(
                "| {name} | {m} | {:.1} | {:.1} | {:.1} | {:.1} ({:.1} ns/block) |",
                f32_s * 1e6,
                int_s * 1e6,
                tile_s * 1e6,
                kernel_s * 1e6,
                kernel_s * 1e9 / (m * n * k / 32) as f64
            );
        }
    }
    println!("\nall linear layers of one step (30 layers + lm_head where m <= 64), ms:");
    println!("| m | f32 resident | integer | f32 tiles |");
    println!("|---|---|---|---|");
    for (m, s) in ms.iter().zip(&step) {
        println!(
            "| {m} | {:.2} | {:.2} | {:.2} |",
            s[0] * 1e3,
            s[1] * 1e3,
            s[2] * 1e3
        );
    }
}

/// This process's CPU seconds (all threads: the pool's spinning and waking included).
fn process_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux has.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// One layer's weights (as `SHAPES`' first four) and the head.
struct StepWeights {
    layers: Vec<[QMatrix; 4]>,
    head: QMatrix,
}

impl StepWeights {
    fn new(seed: &mut u64) -> Self {
        let layers = (0..30)
            .map(|_| {
                [0, 1, 2, 3].map(|i| {
                    let (_, n, k, ty, _) = SHAPES[i];
                    random_matrix(ty, n, k, seed)
                })
            })
            .collect();
        let (_, n, k, ty, _) = SHAPES[5];
        Self {
            layers,
            head: random_matrix(ty, n, k, seed),
        }
    }

    /// The step's linear layers at batch 1, as the decoder calls them (the head against the
    /// f32 activations).
    fn run(&self, kernel: Kernel, a: &[f32], out: &mut [f32]) {
        self.run_layers(kernel, a, out);
        self.run_head(kernel, a, out);
    }

    fn run_layers(&self, kernel: Kernel, a: &[f32], out: &mut [f32]) {
        for layer in &self.layers {
            for q in layer {
                let (n, k) = (q.rows(), q.cols());
                q.matmul_nt_with(&a[..k], &mut out[..n], 1, kernel)
                    .expect("shapes");
            }
        }
    }

    fn run_head(&self, kernel: Kernel, a: &[f32], out: &mut [f32]) {
        let (n, k) = (self.head.rows(), self.head.cols());
        self.head
            .matmul_nt_head_with(&a[..k], &mut out[..n], 1, kernel)
            .expect("shapes");
    }
}

/// Best of `reps` of `f`'s (thread CPU, process CPU, wall) seconds per call, each over `iters`.
fn clocks(reps: usize, iters: usize, mut f: impl FnMut()) -> [f64; 3] {
    f();
    let mut best = [f64::INFINITY; 3];
    for _ in 0..reps {
        let (t, p, w) = (thread_cpu_s(), process_cpu_s(), Instant::now());
        for _ in 0..iters {
            f();
        }
        let got = [
            thread_cpu_s() - t,
            process_cpu_s() - p,
            w.elapsed().as_secs_f64(),
        ];
        for (b, g) in best.iter_mut().zip(got) {
            *b = b.min(g / iters as f64);
        }
    }
    best
}

/// Rounds of [`interleaved`].
const ROUNDS: usize = 7;

/// Per kernel, the best over [`ROUNDS`] rounds of `f(kernel)`'s (thread CPU, process CPU, wall)
/// seconds per call over `iters` calls, every kernel taking its turn in each round (so the
/// shared machine's slow moments fall on all of them alike).
fn interleaved(kernels: &[Kernel], iters: usize, mut f: impl FnMut(Kernel)) -> Vec<[f64; 3]> {
    let mut best = vec![[f64::INFINITY; 3]; kernels.len()];
    for _ in 0..ROUNDS {
        for (b, &k) in best.iter_mut().zip(kernels) {
            let got = clocks(1, iters, || f(k));
            for (b, g) in b.iter_mut().zip(got) {
                *b = b.min(g);
            }
        }
    }
    best
}

fn variants(names: Option<&str>) {
    let kernels: Vec<Kernel> = match names {
        Some(list) => list
            .split(',')
            .map(|n| Kernel::by_name(n).unwrap_or_else(|| panic!("this CPU does not run {n}")))
            .collect(),
        None => Kernel::available()
            .into_iter()
            .filter(|k| *k != Kernel::SCALAR)
            .collect(),
    };
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    let threads = rayon::current_num_threads();
    println!(
        "kernels {}; chosen by detect: {}; {threads} rayon threads; load {}",
        kernels
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", "),
        Kernel::detect().name(),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let mut seed = 0x1234_5678_9abc_def0u64;
    let a: Vec<f32> = (0..1536)
        .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let mut out = vec![0.0f32; 49152];

    println!(
        "\nbatch 1, one thread, in cache: thread CPU ns per block (best of {ROUNDS} rounds of \
         ~10 ms, the kernels taking turns in each round)"
    );
    let head = kernels.iter().map(|k| k.name()).collect::<Vec<_>>();
    println!("| layer | blocks | {} |", head.join(" | "));
    println!("|---|---|{}", "---|".repeat(kernels.len()));
    for &(name, n, k, ty, _) in SHAPES {
        let q = random_matrix(ty, n, k, &mut seed);
        let acts = Q8Rows::quantize(&a[..k], 1, k);
        let blocks = (n * k / 32) as f64;
        let iters = ((0.01 / (blocks * 3e-9)) as usize).max(1);
        let best = one.install(|| {
            interleaved(&kernels, iters, |kernel| {
                if name == "lm_head" {
                    q.matmul_nt_head_with(&a[..k], &mut out[..n], 1, kernel)
                        .expect("shapes")
                } else {
                    kernel.fill(ty, q.bytes(), q.row_bytes(), &acts, &mut out[..n])
                }
            })
        });
        let cells: Vec<String> = best
            .iter()
            .map(|[t, _, _]| format!("{:.2}", t * 1e9 / blocks))
            .collect();
        let label = if name == "lm_head" {
            "lm_head (f32 acts)"
        } else {
            name
        };
        println!("| {label} | {blocks} | {} |", cells.join(" | "));
    }

    let w = StepWeights::new(&mut seed);
    let q4_blocks: usize = w.layers[0]
        .iter()
        .map(|q| q.rows() * q.cols() / 32)
        .sum::<usize>()
        * 30;
    let head_blocks = w.head.rows() * w.head.cols() / 32;
    println!(
        "\none decode step's linear layers, distinct weights ({q4_blocks} Q4_1 + {head_blocks} \
         Q8_0 blocks, {:.0} MB), ms per step (best of {ROUNDS} rounds of 3 steps, the kernels taking turns)",
        (w.layers
            .iter()
            .flatten()
            .map(|q| q.bytes().len())
            .sum::<usize>()
            + w.head.bytes().len()) as f64
            / 1e6
    );
    println!(
        "| kernel | 1 thread: CPU (Q4_1 layers + head) | {threads} threads: wall | \
         {threads} threads: process CPU | {threads} threads: ideal (1-thread CPU / {threads}) |"
    );
    println!("|---|---|---|---|---|");
    let layers = one.install(|| interleaved(&kernels, 3, |k| w.run_layers(k, &a, &mut out)));
    let heads = one.install(|| interleaved(&kernels, 3, |k| w.run_head(k, &a, &mut out)));
    let pooled = interleaved(&kernels, 3, |k| w.run(k, &a, &mut out));
    for (i, kernel) in kernels.iter().enumerate() {
        let (l1, h1) = (layers[i][0], heads[i][0]);
        let [_, pn, wn] = pooled[i];
        let t1 = l1 + h1;
        println!(
            "| {} | {:.2} ({:.2} + {:.2}) | {:.2} | {:.2} | {:.2} |",
            kernel.name(),
            t1 * 1e3,
            l1 * 1e3,
            h1 * 1e3,
            wn * 1e3,
            pn * 1e3,
            t1 * 1e3 / threads as f64
        );
    }

    // The pool's cost per parallel product: as many tasks as a batch-1 product makes (4 per
    // thread) or one per thread, each doing nothing but touching its piece; back to back, and
    // after 20 us of work on the calling thread alone (the norms and attention between two
    // products, when the other threads may have gone to sleep).
    println!("\nrayon fork-join per parallel product, us (best of 5 x 2000)");
    println!(
        "| tasks | back to back: wall | process CPU | after 20 us alone: wall - 20 us | process CPU - 20 us |"
    );
    println!("|---|---|---|---|---|");
    for tasks in [4 * threads, threads] {
        let n = 960usize;
        let chunk = n.div_ceil(tasks);
        let mut buf = vec![0.0f32; n];
        let mut fork = |gap: f64| {
            use rayon::prelude::*;
            if gap > 0.0 {
                let t = Instant::now();
                while t.elapsed().as_secs_f64() < gap {
                    std::hint::spin_loop();
                }
            }
            buf.par_chunks_mut(chunk).for_each(|c| c[0] += 1.0);
        };
        let [_, p0, w0] = clocks(5, 2000, || fork(0.0));
        let [_, p1, w1] = clocks(5, 2000, || fork(20e-6));
        println!(
            "| {tasks} | {:.1} | {:.1} | {:.1} | {:.1} |",
            w0 * 1e6,
            p0 * 1e6,
            (w1 - 20e-6) * 1e6,
            (p1 - 20e-6) * 1e6
        );
    }
}
