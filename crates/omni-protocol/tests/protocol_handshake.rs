//! The worker and engine-core handshakes survive the one JSON line each travels as, in both
//! directions.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use omni_ipc::{Handle, MessageQueueConfig};
use omni_protocol::{
    Device, EngineCoreHandshake, EngineCoreReady, EngineCoreStartup, PROTOCOL_VERSION,
    ParallelLayout, PeerQueues, WorkerHandshake, WorkerHello,
};

fn handle() -> Handle {
    Handle {
        version: 1,
        ring: Some("omni.1x2.bcast".into()),
        n_local_readers: 3,
        n_remote_readers: 0,
        local_endpoint: Some("ipc://@omni.1x2.bcast".into()),
        remote_endpoint: None,
        writer_pid: 1,
        config: MessageQueueConfig::default(),
    }
}

#[test]
fn handshake_and_hello_survive_one_json_line_each() {
    let hs = WorkerHandshake {
        protocol_version: PROTOCOL_VERSION,
        instance: "1x2".into(),
        rank: 2,
        layout: ParallelLayout::across_nodes(2, 2, 2),
        host_ip: Some("10.0.0.2".parse().unwrap()),
        parent_pid: 1,
        broadcast: handle(),
        broadcast_reader: omni_ipc::ReaderId::Remote(0),
        response_queue: MessageQueueConfig {
            max_chunk_bytes: 2 << 20,
            ..MessageQueueConfig::default()
        },
        all_reduce_segment: Some("omni.1x2.allreduce".into()),
        ready_timeout: Duration::from_secs(300),
    };
    let line = serde_json::to_string(&hs).unwrap();
    assert!(!line.contains('\n'));
    assert_eq!(serde_json::from_str::<WorkerHandshake>(&line).unwrap(), hs);

    let hello = WorkerHello {
        protocol_version: PROTOCOL_VERSION,
        rank: 2,
        pid: 42,
        response: handle(),
        peers: PeerQueues {
            pp_send: None,
            tp_gather: Some(handle()),
        },
    };
    let line = serde_json::to_string(&hello).unwrap();
    assert!(!line.contains('\n'));
    assert_eq!(serde_json::from_str::<WorkerHello>(&line).unwrap(), hello);
}

#[test]
fn engine_core_handshake_and_startup_survive_one_json_line_each() {
    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Config {
        max_model_len: u32,
    }
    let hs = EngineCoreHandshake {
        protocol_version: PROTOCOL_VERSION,
        parent_pid: 1,
        input: handle(),
        output_queue: MessageQueueConfig::default(),
        ready_timeout: Duration::from_secs(300),
        config: Config { max_model_len: 512 },
    };
    let line = serde_json::to_string(&hs).unwrap();
    assert!(!line.contains('\n'));
    assert_eq!(
        serde_json::from_str::<EngineCoreHandshake<Config>>(&line).unwrap(),
        hs
    );

    for startup in [
        EngineCoreStartup::Ready(EngineCoreReady {
            protocol_version: PROTOCOL_VERSION,
            pid: 42,
            output: handle(),
            num_gpu_blocks: 1024,
            model: "/models/tiny".into(),
            device: Device::Cpu,
        }),
        EngineCoreStartup::Failed {
            message: "no such model".into(),
        },
    ] {
        let line = serde_json::to_string(&startup).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(
            serde_json::from_str::<EngineCoreStartup>(&line).unwrap(),
            startup
        );
    }
}
