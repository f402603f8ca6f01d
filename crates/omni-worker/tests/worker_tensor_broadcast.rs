//! Tensors on the wire: the multi-process executor broadcasts a `SchedulerOutput` carrying one
//! tensor to 3 worker processes at 16 MiB ring slots, 11 MiB (ring path) and 33 MiB (overflow
//! path). Every worker checks every byte and where the bytes lie: on the ring path inside its
//! mapping of the broadcast segment (read in place, 64-byte aligned), on the overflow path
//! outside it. Rank 0 answers with a tensor of its own, which comes back through the response
//! queue's buffers.
//!
//! This file is its own harness (`harness = false`): with `--omni-test-worker` it is the worker
//! process ([`omni_worker::process::serve`] around a checking worker); otherwise it runs the
//! tests, speaking just enough of libtest's command line for `cargo test` and nextest.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use omni_core::{Executor, MultiprocConfig, MultiprocExecutor, StartupSpec};
use omni_protocol::{
    DType, ModelRunnerOutput, SchedulerOutput, TensorRef, WorkerBase, WorkerCommand,
    WorkerHandshake, WorkerResponse,
};

const WORKER_FLAG: &str = "--omni-test-worker";
const MIB: usize = 1 << 20;

/// Byte `i` of a test tensor: a pattern that no shifted or truncated copy matches.
fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 7) as u8 ^ (i >> 20) as u8
}

/// The `[start, end)` ranges this process has mapped from `/dev/shm/omni.<instance>.bcast`.
fn broadcast_mappings(instance: &str) -> Vec<(usize, usize)> {
    let suffix = format!("/omni.{instance}.bcast");
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.trim_end().ends_with(&suffix))
        .filter_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect()
}

/// A worker that checks the step's tensors instead of running a model.
struct CheckingWorker {
    rank: u32,
    instance: String,
}

impl CheckingWorker {
    fn check(&self, so: &SchedulerOutput, buffers: &[&[u8]]) -> Result<Vec<u64>, String> {
        let views = so.tensor_views(buffers).map_err(|e| e.to_string())?;
        if views.is_empty() {
            return Err("no tensor in the batch".into());
        }
        let mut report = Vec::new();
        for v in views {
            if let Some(i) = (0..v.bytes.len()).find(|&i| v.bytes[i] != pattern(i)) {
                return Err(format!("{}: byte {i} differs", v.meta.name));
            }
            let start = v.bytes.as_ptr() as usize;
            let end = start + v.bytes.len();
            let maps = broadcast_mappings(&self.instance);
            let in_segment = maps.iter().any(|&(a, b)| a <= start && end <= b);
            let want_in_segment = v.meta.name == "ring";
            if in_segment != want_in_segment {
                return Err(format!(
                    "{}: bytes at {start:#x}..{end:#x}, broadcast segment mapped at {maps:x?}",
                    v.meta.name
                ));
            }
            if in_segment && !start.is_multiple_of(64) {
                return Err(format!("{}: slot view not 64-byte aligned", v.meta.name));
            }
            report.extend([v.bytes.len() as u64, in_segment as u64]);
        }
        Ok(report)
    }
}

impl WorkerBase for CheckingWorker {
    fn handle(&mut self, cmd: &WorkerCommand) -> Option<WorkerResponse> {
        Some(match cmd {
            WorkerCommand::LoadModel(_) => WorkerResponse::ModelLoaded {
                kv_bytes_per_block: 1,
                available_memory_bytes: 1 << 20,
            },
            WorkerCommand::ExecuteModel(so) => self.execute_model(so, &[]),
            WorkerCommand::InitCache { .. } | WorkerCommand::Health => {
                WorkerResponse::Ready { rank: self.rank }
            }
            WorkerCommand::Shutdown => return None,
        })
    }

    fn execute_model(&mut self, so: &SchedulerOutput, buffers: &[&[u8]]) -> WorkerResponse {
        match self.check(so, buffers) {
            Err(message) => WorkerResponse::Error {
                rank: self.rank,
                message,
            },
            Ok(_) if self.rank != 0 => WorkerResponse::Ready { rank: self.rank },
            Ok(report) => {
                let bytes: Vec<u8> = report.iter().flat_map(|x| x.to_le_bytes()).collect();
                WorkerResponse::ModelRunnerOutput(ModelRunnerOutput {
                    tensors: vec![TensorRef {
                        name: "check".into(),
                        request_id: None,
                        dtype: DType::I64,
                        shape: vec![report.len() as u64],
                        buffer_index: 0,
                    }],
                    buffers: vec![bytes],
                    ..ModelRunnerOutput::default()
                })
            }
        }
    }
}

fn executor() -> MultiprocExecutor {
    let startup = StartupSpec {
        load: omni_protocol::LoadModelSpec::default(),
        kv_cache_memory_bytes: None,
        num_blocks_override: Some(1),
    };
    let mut cfg = MultiprocConfig::new(std::env::current_exe().unwrap(), 3, startup);
    cfg.worker_args = vec![WORKER_FLAG.into()];
    cfg.ipc.max_chunk_bytes = 16 * MIB;
    cfg.ipc.max_chunks = 2;
    cfg.startup_timeout = Duration::from_secs(60);
    cfg.execute_timeout = Duration::from_secs(60);
    MultiprocExecutor::start(cfg).unwrap()
}

fn segments_of(instance: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("omni.{instance}.")))
        .collect()
}

/// Broadcasts one tensor of `len` bytes named `path` ("ring" or "overflow") twice and checks
/// rank 0's report of it.
fn broadcast_tensor(len: usize, path: &str) {
    let mut ex = executor();
    let instance = ex.instance().to_string();
    let bytes: Vec<u8> = (0..len).map(pattern).collect();
    let so = SchedulerOutput {
        tensors: vec![TensorRef {
            name: path.into(),
            request_id: None,
            dtype: DType::F32,
            shape: vec![(len / 4) as u64],
            buffer_index: 0,
        }],
        ..SchedulerOutput::default()
    };
    for _ in 0..2 {
        let out = ex
            .execute_model(&so, &[&bytes])
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        let view = out.tensors[0].view(&[&out.buffers[0]]).unwrap();
        let report: Vec<u64> = view
            .bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(report, vec![len as u64, (path == "ring") as u64]);
    }
    ex.shutdown();
    drop(ex);
    assert_eq!(segments_of(&instance), Vec::<String>::new());
}

fn eleven_mib_tensor_is_read_in_place_by_three_workers() {
    broadcast_tensor(11 * MIB, "ring");
}

fn thirty_three_mib_tensor_reaches_three_workers_over_the_overflow_path() {
    broadcast_tensor(33 * MIB, "overflow");
}

fn a_tensor_that_does_not_match_its_buffer_fails_the_step_naming_it() {
    let mut ex = executor();
    let so = SchedulerOutput {
        tensors: vec![TensorRef {
            name: "ring".into(),
            request_id: None,
            dtype: DType::F32,
            shape: vec![1024],
            buffer_index: 0,
        }],
        ..SchedulerOutput::default()
    };
    let err = ex.execute_model(&so, &[&[0u8; 100]]).unwrap_err();
    assert!(err.to_string().contains("needs 4096 bytes"), "{err}");
}

const TESTS: &[(&str, fn())] = &[
    (
        "eleven_mib_tensor_is_read_in_place_by_three_workers",
        eleven_mib_tensor_is_read_in_place_by_three_workers,
    ),
    (
        "thirty_three_mib_tensor_reaches_three_workers_over_the_overflow_path",
        thirty_three_mib_tensor_reaches_three_workers_over_the_overflow_path,
    ),
    (
        "a_tensor_that_does_not_match_its_buffer_fails_the_step_naming_it",
        a_tensor_that_does_not_match_its_buffer_fails_the_step_naming_it,
    ),
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(WORKER_FLAG) {
        let result = omni_worker::process::serve(|hs: &WorkerHandshake, _links| CheckingWorker {
            rank: hs.rank,
            instance: hs.instance.clone(),
        });
        if let Err(e) = result {
            eprintln!("test worker: {e}");
            std::process::exit(1);
        }
        return;
    }
    // libtest's interface, as far as cargo test and nextest use it.
    if args.iter().any(|a| a == "--list") {
        if !args.iter().any(|a| a == "--ignored") {
            for (name, _) in TESTS {
                println!("{name}: test");
            }
        }
        return;
    }
    let exact = args.iter().any(|a| a == "--exact");
    // Name filters: the arguments that are neither flags nor the value of a flag that takes one.
    let takes_value = [
        "--test-threads",
        "--format",
        "--color",
        "--skip",
        "--logfile",
        "-Z",
    ];
    let filters: Vec<&String> = args
        .iter()
        .enumerate()
        .filter(|(i, a)| {
            !a.starts_with('-') && (*i == 0 || !takes_value.contains(&args[i - 1].as_str()))
        })
        .map(|(_, a)| a)
        .collect();
    let selected: Vec<_> = TESTS
        .iter()
        .filter(|(name, _)| {
            filters.is_empty()
                || filters.iter().any(|f| {
                    if exact {
                        name == f
                    } else {
                        name.contains(f.as_str())
                    }
                })
        })
        .collect();
    println!("running {} tests", selected.len());
    let mut failed = 0;
    for (name, test) in selected {
        match std::panic::catch_unwind(test) {
            Ok(()) => println!("test {name} ... ok"),
            Err(_) => {
                println!("test {name} ... FAILED");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        std::process::exit(101);
    }
}
