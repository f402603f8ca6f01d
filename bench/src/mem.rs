//! `omni-engine bench mem`: this machine's memory bandwidth, the ceiling for CPU decode (which
//! streams every weight once per step). Read bandwidth is measured with all cores reading
//! disjoint parts of a buffer much larger than the caches, as the model's matmuls do.

use std::time::Instant;

use serde::Serialize;

/// Measured bandwidths, GB/s (1e9 B/s).
#[derive(Debug, Clone, Serialize)]
pub struct MemBandwidth {
    /// Threads used for the read test.
    pub threads: usize,
    /// Bytes of the buffer.
    pub bytes: usize,
    /// Read bandwidth, all threads together (best of the repetitions).
    pub read_gbps: f64,
    /// Single-threaded memcpy (bytes copied per second, best of the repetitions).
    pub copy_gbps: f64,
}

/// Measures read and copy bandwidth over a `bytes`-sized buffer.
pub fn measure(bytes: usize, reps: usize) -> MemBandwidth {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let buf: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let part = bytes / threads;
    let mut read_gbps: f64 = 0.0;
    for _ in 0..reps {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for t in 0..threads {
                let chunk = &buf[t * part..(t + 1) * part];
                s.spawn(move || std::hint::black_box(crate::ipc::checksum(chunk)));
            }
        });
        read_gbps = read_gbps.max((part * threads) as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    let half = bytes / 2;
    let (src, _) = buf.split_at(half);
    let mut dst = vec![0u8; half];
    let mut copy_gbps: f64 = 0.0;
    for _ in 0..reps {
        let t0 = Instant::now();
        dst.copy_from_slice(src);
        std::hint::black_box(&dst);
        copy_gbps = copy_gbps.max(half as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    MemBandwidth {
        threads,
        bytes,
        read_gbps,
        copy_gbps,
    }
}
