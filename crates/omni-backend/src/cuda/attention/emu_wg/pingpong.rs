//! The ping-pong variant's synchronisation (`prefill_wg.cu` with `PP`): its mbarriers and
//! named barriers, counted exactly, and each warpgroup's program in the kernel's order, which
//! the CTA walk (`cta.rs`) runs under a random scheduler.

use super::*;

/// The ping-pong variant's mbarriers, one of each per stage (tile % 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Bar {
    FullK,
    FullV,
    EmptyK,
    EmptyV,
}

/// One step of a warpgroup's program in the ping-pong variant (as the kernel orders them).
#[derive(Clone, Copy, Debug)]
pub(super) enum Op {
    /// `bar.sync id` (the other warpgroup arrives on it).
    Sync(usize),
    /// `bar.arrive id` when the flag is set.
    Arrive(usize, bool),
    /// Warpgroup 0's own barrier before it reads the slot table.
    SlotBarrier,
    /// Waits for completion `k` (the kernel's parity is `k & 1`) of the mbarrier of tile `t`.
    Wait(Bar, usize, usize),
    /// An arrival on the mbarrier of tile `t` when the flag is set.
    MArrive(Bar, usize, bool),
    LoadK(usize),
    LoadV(usize),
    /// `cp.async.mbarrier.arrive.noinc`: the copies so far land later, then arrive.
    CpArrive(Bar, usize),
    Fill(usize),
    IssueS(usize),
    IssuePv(usize),
    WgWait(usize),
    Softmax(usize),
    RescalePack,
}

/// Copies in flight: (16-byte chunk, its bf16 values).
pub(super) type Copies = Vec<(usize, [u16; 8])>;

/// Barrier state of one ping-pong CTA: each warpgroup counts as one party (its 128 threads).
#[derive(Default)]
pub(super) struct PpSync {
    /// Named barriers 1 and 2 (index 0 unused): parties arrived, generations completed.
    pub(super) named: [(usize, u64); 3],
    /// Per mbarrier and stage: arrivals in the current phase, phases completed.
    mbar: std::collections::HashMap<(Bar, usize), (usize, usize)>,
    /// Copies issued before a `CpArrive`, not landed yet, with their barrier.
    pub(super) batches: Vec<(Bar, usize, Copies)>,
}

impl PpSync {
    pub(super) fn blocked(&self, op: Op, waiting: Option<u64>) -> bool {
        match op {
            Op::Sync(id) => waiting == Some(self.named[id].1),
            Op::Wait(bar, t, k) => {
                let done = self.mbar.get(&(bar, t % 3)).map_or(0, |m| m.1);
                // One more completed phase and the parity wait would never return.
                assert!(
                    done <= k + 1,
                    "{bar:?} of tile {t}: phase {k} lapped ({done} done)"
                );
                done < k + 1
            }
            _ => false,
        }
    }
    pub(super) fn arrive_named(&mut self, id: usize, pred: bool) {
        if pred {
            let b = &mut self.named[id];
            b.0 += 1;
            if b.0 == 2 {
                *b = (0, b.1 + 1);
            }
        }
    }
    /// `bar.sync id`: arrives once, then done when the generation moved on.
    pub(super) fn sync(&mut self, id: usize, waiting: &mut Option<u64>) -> bool {
        let g = *waiting.get_or_insert_with(|| {
            let g = self.named[id].1;
            self.arrive_named(id, true);
            g
        });
        let done = self.named[id].1 != g;
        if done {
            *waiting = None;
        }
        done
    }
    pub(super) fn arrive(&mut self, bar: Bar, t: usize, pred: bool) {
        if !pred {
            return;
        }
        let parties = if matches!(bar, Bar::FullK | Bar::FullV) {
            1
        } else {
            2
        };
        let m = self.mbar.entry((bar, t % 3)).or_default();
        m.0 += 1;
        if m.0 == parties {
            *m = (0, m.1 + 1);
        }
    }
    pub(super) fn cp_arrive(&mut self, sm: &mut Smem, bar: Bar, t: usize) {
        self.batches.push((bar, t, std::mem::take(&mut sm.open)));
    }
    /// Batch `i` lands (visible to wgmma: every reader waits on the mbarrier and fences) and
    /// arrives on its barrier.
    pub(super) fn land(&mut self, sm: &mut Smem, i: usize) {
        let (bar, t, copies) = self.batches.swap_remove(i);
        for (chunk, v) in copies {
            sm.data[chunk * 8..chunk * 8 + 8].copy_from_slice(&v);
            sm.landed[chunk] = Some(0);
            sm.owner[chunk] = Some((bar, t));
        }
        self.arrive(bar, t, true);
    }
}

/// Warpgroup `wg`'s program in the ping-pong kernel over `n` key tiles (`prefill_wg.cu`, `PP`).
pub(super) fn pp_program(wg: usize, n: usize, active: impl Fn(usize) -> bool) -> Vec<Op> {
    let (mine, other) = (1 + wg, 2 - wg);
    let mut p = Vec::new();
    if wg == 1 {
        p.push(Op::Arrive(1, true));
    }
    if n > 0 {
        p.push(Op::Wait(Bar::FullK, 0, 0));
    }
    if n > 0 && active(0) {
        p.extend([
            Op::Sync(mine),
            Op::IssueS(0),
            Op::Arrive(other, true),
            Op::WgWait(0),
        ]);
        p.extend([
            Op::MArrive(Bar::EmptyK, 0, true),
            Op::Softmax(0),
            Op::RescalePack,
        ]);
    } else {
        p.extend([Op::Sync(mine), Op::Arrive(other, wg == 0 || n > 0)]);
        p.push(Op::MArrive(Bar::EmptyK, 0, n > 0));
    }
    for j in 0..n {
        if wg == 0 {
            p.push(Op::SlotBarrier);
            if j + 1 < n {
                if j + 1 >= 3 {
                    p.push(Op::Wait(Bar::EmptyV, j + 1, (j + 1 - 3) / 3));
                }
                p.extend([Op::LoadV(j + 1), Op::CpArrive(Bar::FullV, j + 1)]);
            }
            if j + 2 < n {
                if j + 2 >= 3 {
                    p.push(Op::Wait(Bar::EmptyK, j + 2, (j + 2 - 3) / 3));
                }
                p.extend([Op::LoadK(j + 2), Op::CpArrive(Bar::FullK, j + 2)]);
            }
            if j + 3 < n {
                p.push(Op::Fill(j + 3));
            }
        }
        let more = j + 1 < n;
        if more {
            p.push(Op::Wait(Bar::FullK, j + 1, (j + 1) / 3));
        }
        p.push(Op::Wait(Bar::FullV, j, j / 3));
        let hand_over = wg == 0 || more;
        if more && active(j + 1) {
            assert!(active(j));
            p.extend([Op::Sync(mine), Op::IssueS(j + 1), Op::IssuePv(j)]);
            p.extend([Op::Arrive(other, hand_over), Op::WgWait(1)]);
            p.extend([Op::MArrive(Bar::EmptyK, j + 1, true), Op::Softmax(j + 1)]);
            p.extend([
                Op::WgWait(0),
                Op::MArrive(Bar::EmptyV, j, true),
                Op::RescalePack,
            ]);
        } else if active(j) {
            p.extend([Op::Sync(mine), Op::IssuePv(j), Op::Arrive(other, hand_over)]);
            p.extend([Op::WgWait(0), Op::MArrive(Bar::EmptyK, j + 1, more)]);
            p.push(Op::MArrive(Bar::EmptyV, j, true));
        } else {
            p.extend([Op::Sync(mine), Op::Arrive(other, hand_over)]);
            p.extend([
                Op::MArrive(Bar::EmptyK, j + 1, more),
                Op::MArrive(Bar::EmptyV, j, true),
            ]);
        }
    }
    p
}
