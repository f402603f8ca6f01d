//! [`ShmAllReduce`]: tensor-parallel all-reduce between the worker processes of one engine, over
//! one shared-memory segment (`/dev/shm/omni.<instance>.allreduce`).
//!
//! The engine core creates the segment ([`omni_ipc::shm::ShmSegment`], zero-filled, so every
//! counter starts at 0) and removes it at shutdown, also when a worker was killed; each worker
//! maps it with [`ShmAllReduce::open`]. Offsets below are within the segment's region.
//!
//! # Layout
//!
//! ```text
//! offset 0                      64            64*(1+q)                 D = 64*(1+world)
//! ┌─────────────────────────────┬─────────────┬──────────────────────────┬───────────────────────────────┐
//! │ reserved (64 B)             │ arrive[0]   │ ... arrive[q] (AtomicU64, │ buf[0][0] buf[0][1] buf[1][0] │
//! │                             │ (own line)  │ one 64-byte line each)    │ ... buf[q][p]: chunk f32 each │
//! └─────────────────────────────┴─────────────┴──────────────────────────┴───────────────────────────────┘
//! ```
//!
//! `chunk = (len - D) / (world * 2 * 4)` floats (rounded down to 16); a longer buffer is reduced
//! chunk by chunk, one *round* per chunk. Each rank counts its rounds locally (`round`, starting
//! at 0); every rank makes the same calls with the same lengths, so round numbers agree.
//!
//! # Protocol of round `r` on rank `p` (parity `b = r % 2`)
//!
//! 1. write the chunk of its partial sums into `buf[p][b]`;
//! 2. `arrive[p].store(r + 1, Release)`;
//! 3. wait until `arrive[q].load(Acquire) >= r + 1` for every rank `q`;
//! 4. `x[chunk] = buf[0][b] + buf[1][b] + ... + buf[world-1][b]`, summed in rank order, so every
//!    rank gets bit-identical sums (the ranks must stay in lockstep: same sampled tokens).
//!
//! | `arrive[q]` | meaning                                                                 |
//! |-------------|-------------------------------------------------------------------------|
//! | `r`         | `q` finished reading round `r - 1`'s buffers (or has not started: `r=0`) |
//! | `r + 1`     | `q`'s partial of round `r` is in `buf[q][r % 2]`                         |
//!
//! **Ordering argument.** (a) *Readers see the data*: the data writes of step 1 are sequenced
//! before the Release store of step 2; a rank that observes `arrive[q] >= r + 1` with an Acquire
//! load in step 3 therefore sees `buf[q][b]` complete. (b) *Nobody overwrites a buffer that is
//! still being read*: `buf[p][b]` is next written in round `r + 2`. Rank `p` only gets there after
//! passing step 3 of round `r + 1`, i.e. after seeing `arrive[q] >= r + 2` for every `q`; rank
//! `q` stores `r + 2` (Release) only after finishing step 4 of round `r` (program order), so all
//! of `q`'s reads of `buf[p][b]` happen-before `p`'s overwrite. Double buffering is what lets one
//! barrier per round suffice. Counters only grow (u64 never wraps in practice).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use omni_backend::comm::AllReduce;
use omni_ipc::shm::ShmSegment;

/// Bytes per cache line (header granularity).
const LINE: usize = 64;

/// Errors opening the segment.
#[derive(Debug, thiserror::Error)]
pub enum ShmAllReduceError {
    /// The segment could not be opened or mapped.
    #[error("all-reduce segment: {0}")]
    Shm(#[from] omni_ipc::IpcError),
    /// The segment is too small for this world size.
    #[error("all-reduce segment of {len} bytes is too small for {world} ranks (need > {min})")]
    TooSmall {
        /// Its length.
        len: usize,
        /// World size.
        world: usize,
        /// Minimum useful length.
        min: usize,
    },
    /// `rank >= world`.
    #[error("rank {rank} out of world size {world}")]
    BadRank {
        /// The rank.
        rank: usize,
        /// World size.
        world: usize,
    },
}

/// Bytes of a segment that reduces `chunk_floats` floats per round among `world` ranks.
pub fn segment_len(world: usize, chunk_floats: usize) -> usize {
    data_offset(world) + world * 2 * chunk_floats.next_multiple_of(16) * 4
}

fn data_offset(world: usize) -> usize {
    LINE * (1 + world)
}

/// One rank's handle on the shared-memory all-reduce (see the module docs for the protocol).
#[derive(Debug)]
pub struct ShmAllReduce {
    seg: ShmSegment,
    rank: usize,
    world: usize,
    chunk: usize,
    /// Rounds done by this rank. A mutex because [`AllReduce`] takes `&self`; only the rank's own
    /// model thread calls it, so it is never contended.
    round: Mutex<u64>,
    timeout: Duration,
}

impl ShmAllReduce {
    /// Maps segment `name` (created zeroed by the engine core) as rank `rank` of `world`.
    pub fn open(name: &str, rank: usize, world: usize) -> Result<Self, ShmAllReduceError> {
        Self::from_segment(ShmSegment::open(name)?, rank, world)
    }

    fn from_segment(seg: ShmSegment, rank: usize, world: usize) -> Result<Self, ShmAllReduceError> {
        if rank >= world {
            return Err(ShmAllReduceError::BadRank { rank, world });
        }
        let len = seg.len();
        let min = segment_len(world, 16);
        if len < min {
            return Err(ShmAllReduceError::TooSmall { len, world, min });
        }
        let chunk = ((len - data_offset(world)) / (world * 2 * 4)) / 16 * 16;
        Ok(Self {
            seg,
            rank,
            world,
            chunk,
            round: Mutex::new(0),
            timeout: Duration::from_secs(120),
        })
    }

    /// Floats reduced per round.
    pub fn chunk_floats(&self) -> usize {
        self.chunk
    }

    fn arrive(&self, q: usize) -> &AtomicU64 {
        // SAFETY: `LINE * (1 + q)` with `q < world` lies inside the mapping (its length is at
        // least `data_offset(world)`), is 64-byte aligned (the region starts a page-aligned header page after the mapping), and this word
        // is only ever accessed atomically by every process; the mapping lives as long as `self`.
        unsafe { &*(self.seg.as_ptr().add(LINE * (1 + q)) as *const AtomicU64) }
    }

    fn buf(&self, q: usize, parity: usize) -> *mut f32 {
        let off = data_offset(self.world) + (q * 2 + parity) * self.chunk * 4;
        // SAFETY: `off + chunk * 4 <= len` by the construction of `chunk`, so the pointer stays
        // inside the mapping; it is 4-byte aligned since `data_offset` and `chunk * 4` are.
        unsafe { self.seg.as_ptr().add(off) as *mut f32 }
    }

    fn wait_all(&self, target: u64) -> omni_backend::Result<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        for q in 0..self.world {
            while self.arrive(q).load(Ordering::Acquire) < target {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(256) {
                    std::thread::yield_now();
                    if start.elapsed() > self.timeout {
                        return Err(omni_backend::Error::AllReduce(format!(
                            "rank {} waited {:?} for rank {q} (round {}): peer dead or hung",
                            self.rank,
                            self.timeout,
                            target - 1
                        )));
                    }
                } else {
                    std::hint::spin_loop();
                }
            }
        }
        Ok(())
    }
}

impl AllReduce for ShmAllReduce {
    fn all_reduce_sum(&self, x: &mut [f32]) -> omni_backend::Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        let mut round = self
            .round
            .lock()
            .map_err(|_| omni_backend::Error::AllReduce("all-reduce state poisoned".into()))?;
        for part in x.chunks_mut(self.chunk) {
            let r = *round;
            let parity = (r % 2) as usize;
            let n = part.len();
            // SAFETY: step 1. `buf(rank, parity)` has room for `chunk >= n` floats, and by the
            // ordering argument (b) of the module docs no other rank reads it now.
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), self.buf(self.rank, parity), n) };
            // Step 2: Release publishes the data written above (ordering argument (a)).
            self.arrive(self.rank).store(r + 1, Ordering::Release);
            // Step 3: Acquire loads pair with every peer's Release store of `r + 1`.
            self.wait_all(r + 1)?;
            // Step 4, in rank order so that every rank computes bit-identical sums.
            part.fill(0.0);
            for q in 0..self.world {
                // SAFETY: rank q published `buf(q, parity)` for round r (seen with Acquire in
                // step 3) and will not write it again before we store `r + 2` (argument (b)).
                let src = unsafe { std::slice::from_raw_parts(self.buf(q, parity), n) };
                part.iter_mut().zip(src).for_each(|(a, b)| *a += b);
            }
            *round = r + 1;
        }
        Ok(())
    }

    fn world_size(&self) -> usize {
        self.world
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_identical_sums_over_many_rounds_and_chunks() {
        let name = omni_ipc::shm::segment_name(&omni_ipc::shm::new_instance_id(), "allreduce");
        let world = 3;
        let _owner = ShmSegment::create(&name, segment_len(world, 32)).unwrap();
        let handles: Vec<ShmAllReduce> = (0..world)
            .map(|r| ShmAllReduce::open(&name, r, world).unwrap())
            .collect();
        assert_eq!(handles[0].chunk_floats(), 32);
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let joins: Vec<_> = handles
                .iter()
                .enumerate()
                .map(|(r, h)| {
                    s.spawn(move || {
                        (0..50)
                            .map(|round| {
                                // 100 floats = 4 chunks of 32 (the last partial).
                                let mut x: Vec<f32> =
                                    (0..100).map(|i| (r * 1000 + i + round) as f32).collect();
                                h.all_reduce_sum(&mut x).unwrap();
                                x
                            })
                            .collect()
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect()
        });
        for round in 0..50 {
            let want: Vec<f32> = (0..100)
                .map(|i| (0..world).map(|r| (r * 1000 + i + round) as f32).sum())
                .collect();
            for per_rank in &results {
                assert_eq!(per_rank[round], want);
            }
        }
    }

    #[test]
    fn open_rejects_missing_segment_and_bad_rank() {
        assert!(matches!(
            ShmAllReduce::open("omni.no-such-instance.allreduce", 0, 2),
            Err(ShmAllReduceError::Shm(_))
        ));
        let name = omni_ipc::shm::segment_name(&omni_ipc::shm::new_instance_id(), "badrank");
        let _owner = ShmSegment::create(&name, segment_len(2, 16)).unwrap();
        let r = ShmAllReduce::open(&name, 2, 2);
        assert!(matches!(r, Err(ShmAllReduceError::BadRank { .. })));
    }
}
