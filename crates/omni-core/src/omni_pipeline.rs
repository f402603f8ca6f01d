//! [`OmniPipeline`]: an omni model's stages (Thinker -> Talker -> Code2Wav), each replica a
//! process of its own ([`StageClient`]), behind one [`EngineCoreClient`].
//!
//! ```text
//!  add_request ─▶ dispatcher ─Add──────────────▶ thinker[r0] ─text──────────────▶ request stream
//!                     │                              └─ThinkerToTalker─▶ talker[r1]
//!                     └─Add (voice, sampling)──────────────────────────▶ talker[r1] ─CodecChunk─▶ code2wav[r2]
//!                                                                        code2wav[r2] ─audio──▶ request stream
//! ```
//!
//! * Each request is bound to one replica per stage for its life, the least loaded at
//!   admission. The dispatcher thread sends a Talker's `Add` before the Thinker's, so the
//!   Talker knows the request before the Thinker's first chunk reaches it.
//! * The readers of the stages' output queues route what they receive: Thinker text to the
//!   request's stream (when audio follows, the Thinker's finish reason moves to
//!   `text_finish_reason` and the stream stays open), Thinker states to the request's Talker,
//!   codec windows to its Code2Wav, audio to the stream; Code2Wav's output for the last window
//!   ends the request.
//! * Dropping a stream (client gone) or [`EngineCoreClient::abort`] aborts the request in every
//!   stage it is bound to. A request that fails in one stage is aborted in the others and ends
//!   with `FinishReason::Error`.
//! * A stage replica that dies fails every live request at once with
//!   `EngineDeadError::Stage` naming it, and [`EngineCoreClient::health`] reports it from then
//!   on (its segments are removed by its [`StageClient`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::JoinHandle;

use omni_protocol::{
    CodecChunk, EngineCoreInput, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
    EngineDeadError, FinishReason, RequestId, SchedulerStats, StageInput, StageKind, StageOutputs,
    StageSpec, ThinkerToTalker,
};

use crate::engine_core_client::{EngineCoreClient, Frontend, RequestError, RequestStream};
use crate::mp_client::{EngineCoreStartError, MpClientConfig};
use crate::stage_client::StageClient;

/// How to start a pipeline.
#[derive(Debug, Clone)]
pub struct OmniPipelineConfig {
    /// The binary and arguments of a stage process (e.g. `omni-engine stage`), queue sizes.
    pub client: MpClientConfig,
    /// Per stage (Thinker, Talker, Code2Wav, in order), the spec of each replica.
    pub stages: Vec<Vec<StageSpec>>,
}

/// Where one request lives.
#[derive(Debug, Clone, Copy)]
struct Route {
    /// Replica index per stage.
    replicas: [usize; 3],
    /// Whether the Talker and Code2Wav take part.
    audio: bool,
}

#[derive(Debug, Default)]
struct Table {
    routes: HashMap<RequestId, Route>,
    /// Live requests per (stage, replica).
    load: Vec<Vec<u32>>,
}

impl Table {
    fn remove(&mut self, id: &str) -> Option<Route> {
        let route = self.routes.remove(id)?;
        for (s, &r) in route.replicas.iter().enumerate() {
            if let Some(n) = self.load.get_mut(s).and_then(|l| l.get_mut(r)) {
                *n = n.saturating_sub(1);
            }
        }
        Some(route)
    }
}

#[derive(Debug)]
struct Shared {
    frontend: Arc<Frontend>,
    stages: OnceLock<Vec<Vec<StageClient>>>,
    /// Each Talker replica's default sampling (a request without `sampling_params_list`).
    talker_defaults: Vec<omni_protocol::SamplingParams>,
    table: Mutex<Table>,
    /// The last scheduler state each (stage, replica) reported.
    stats: Mutex<Vec<Vec<SchedulerStats>>>,
    /// Bytes sent Thinker -> Talker and Talker -> Code2Wav (headers' tensors and codes).
    connector_bytes: [AtomicU64; 2],
}

/// `ids` without repeats, in first-seen order.
fn dedup(ids: Vec<RequestId>) -> Vec<RequestId> {
    let mut seen = std::collections::HashSet::new();
    ids.into_iter()
        .filter(|id| seen.insert(id.clone()))
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn stage(&self, kind: StageKind, replica: usize) -> Option<&StageClient> {
        let index = stage_index(kind);
        self.stages.get()?.get(index)?.get(replica)
    }

    fn note_stats(&self, stage: usize, replica: usize, s: Option<SchedulerStats>) {
        if let Some(s) = s
            && let Some(slot) = lock(&self.stats)
                .get_mut(stage)
                .and_then(|v| v.get_mut(replica))
        {
            *slot = s;
        }
    }

    fn route(&self, id: &str) -> Option<Route> {
        lock(&self.table).routes.get(id).copied()
    }

    /// Aborts `id` in every stage of its route but `except`, forgets it, and ends its stream
    /// with `reason` (a failure) unless the stream already ended.
    fn end_request(&self, id: &str, except: Option<StageKind>, reason: Option<FinishReason>) {
        let Some(route) = lock(&self.table).remove(id) else {
            return;
        };
        for kind in [StageKind::Thinker, StageKind::Talker, StageKind::Code2Wav] {
            if Some(kind) == except || (!route.audio && kind != StageKind::Thinker) {
                continue;
            }
            if let Some(s) = self.stage(kind, route.replicas[stage_index(kind)]) {
                let _ = s.send(&StageInput::Abort(vec![id.to_string()]), &[]);
            }
        }
        if let Some(reason) = reason {
            self.frontend.dispatch(EngineCoreOutputs {
                outputs: vec![final_output(id, reason)],
                ..EngineCoreOutputs::default()
            });
        }
    }

    /// Admits a request: picks its replicas, registers it with the Talker (audio), starts it
    /// in the Thinker.
    fn admit(&self, mut req: EngineCoreRequest) {
        let audio = req.omni.as_ref().is_some_and(|o| o.wants_audio());
        let Some(stages) = self.stages.get() else {
            return;
        };
        let route = {
            let mut t = lock(&self.table);
            let mut replicas = [0usize; 3];
            // The least-loaded replica of each stage the request uses, counted at once.
            for (s, slot) in replicas.iter_mut().enumerate() {
                if let Some(load) = t.load.get_mut(s).filter(|_| audio || s == 0)
                    && let Some(r) = (0..load.len()).min_by_key(|&r| load[r])
                {
                    load[r] += 1;
                    *slot = r;
                }
            }
            let route = Route { replicas, audio };
            t.routes.insert(req.request_id.clone(), route);
            route
        };
        let id = req.request_id.clone();
        // The Thinker stage encodes the media: the items' tensors go with its Add as the
        // message's buffers; the Talker takes no media.
        if audio && let Some(talker) = stages.get(1).and_then(|s| s.get(route.replicas[1])) {
            let mut t = req.clone();
            t.prompt_token_ids.clear();
            t.mm_features.clear();
            t.mm_buffers = Default::default();
            if let Some(p) = t.omni.as_ref().and_then(|o| o.stage_sampling.first()) {
                t.sampling_params = p.clone();
            } else if let Some(p) = self.talker_defaults.get(route.replicas[1]) {
                t.sampling_params = p.clone();
            }
            if let Err(e) = talker.send(&StageInput::Add(Box::new(t)), &[]) {
                self.fail(&id, e);
                return;
            }
        }
        let Some(thinker) = stages.first().and_then(|s| s.get(route.replicas[0])) else {
            return;
        };
        let buffers = std::mem::take(&mut req.mm_buffers);
        if let Err(e) = thinker.send(&StageInput::Add(Box::new(req)), &buffers.as_slices()) {
            self.fail(&id, e);
        }
    }

    /// A stage the request is bound to cannot take its input: its stream ends with `e` (which
    /// names the stage) and the other stages drop it.
    fn fail(&self, id: &str, e: EngineDeadError) {
        tracing::warn!(request = id, "{e}");
        self.end_request(id, None, None);
        self.frontend.fail_request(id, e);
    }

    /// Failures and refusals a stage reported.
    fn stage_failures(&self, kind: StageKind, outs: &mut StageOutputs) {
        for (id, e) in std::mem::take(&mut outs.rejected) {
            lock(&self.table).remove(&id);
            if kind != StageKind::Thinker {
                self.end_request(&id, Some(kind), Some(FinishReason::Error));
            }
            self.frontend.dispatch(EngineCoreOutputs {
                rejected: vec![(id, e)],
                ..EngineCoreOutputs::default()
            });
        }
        for (id, cause) in std::mem::take(&mut outs.failed) {
            tracing::warn!(
                request = id,
                stage = kind.as_str(),
                "request failed: {cause}"
            );
            self.end_request(&id, Some(kind), Some(FinishReason::Error));
        }
    }

    /// Forwards a Thinker message's chunks to their Talker replicas: per replica, in order, as
    /// few packed messages as stay within a ring slot (one per Thinker step as a rule).
    fn forward_thinker_chunks(&self, chunks: Vec<ThinkerToTalker>, buffers: &[Vec<u8>]) {
        let mut groups: Vec<(usize, Vec<ThinkerToTalker>)> = Vec::new();
        for chunk in chunks {
            let Some(route) = self.route(&chunk.request_id) else {
                continue;
            };
            let mut own = Vec::new();
            omni_protocol::rebase_buffers(&mut chunk.clone(), &mut own);
            if own.iter().any(|&i| i >= buffers.len()) {
                self.fail(
                    &chunk.request_id,
                    EngineDeadError::EngineCore {
                        cause: "a Thinker chunk names a buffer its message lacks".into(),
                    },
                );
                continue;
            }
            let replica = route.replicas[1];
            match groups.iter_mut().find(|(r, _)| *r == replica) {
                Some((_, g)) => g.push(chunk),
                None => groups.push((replica, vec![chunk])),
            }
        }
        let size = |i: usize| buffers.get(i).map_or(0, Vec::len);
        for (replica, chunks) in groups {
            let Some(talker) = self.stage(StageKind::Talker, replica) else {
                continue;
            };
            for (pack, picked) in
                omni_protocol::pack_thinker_chunks(chunks, size, omni_protocol::STAGE_PACK_BYTES)
            {
                let bufs: Vec<&[u8]> = picked.iter().map(|&i| buffers[i].as_slice()).collect();
                let bytes: usize = bufs.iter().map(|b| b.len()).sum();
                // A statistic: no ordering with anything else.
                self.connector_bytes[0].fetch_add(bytes as u64, Ordering::Relaxed);
                let ids: Vec<RequestId> = pack.iter().map(|c| c.request_id.clone()).collect();
                if let Err(e) = talker.send(&StageInput::Thinker(pack), &bufs) {
                    for id in dedup(ids) {
                        self.fail(&id, e.clone());
                    }
                }
            }
        }
    }

    fn on_thinker(&self, mut outs: StageOutputs, buffers: Vec<Vec<u8>>) {
        self.stage_failures(StageKind::Thinker, &mut outs);
        self.forward_thinker_chunks(std::mem::take(&mut outs.thinker_chunks), &buffers);
        let mut outputs = Vec::with_capacity(outs.outputs.len());
        for mut o in std::mem::take(&mut outs.outputs) {
            let Some(route) = self.route(&o.request_id) else {
                continue;
            };
            match o.finish_reason {
                Some(r @ (FinishReason::Stop | FinishReason::Length)) if route.audio => {
                    o.text_finish_reason = Some(r);
                    o.finish_reason = None;
                }
                Some(_) if route.audio => {
                    self.end_request(&o.request_id, Some(StageKind::Thinker), None);
                }
                Some(_) => {
                    lock(&self.table).remove(&o.request_id);
                }
                None => {}
            }
            outputs.push(o);
        }
        self.frontend.dispatch(EngineCoreOutputs {
            outputs,
            scheduler_stats: outs.scheduler_stats,
            ..EngineCoreOutputs::default()
        });
    }

    /// Forwards a Talker step's codec windows, one message per Code2Wav replica.
    fn on_talker(&self, mut outs: StageOutputs) {
        self.stage_failures(StageKind::Talker, &mut outs);
        let mut groups: Vec<(usize, Vec<CodecChunk>)> = Vec::new();
        for chunk in std::mem::take(&mut outs.codec_chunks) {
            let Some(route) = self.route(&chunk.request_id) else {
                continue;
            };
            let bytes = chunk.codes.len() * std::mem::size_of::<u32>();
            // A statistic: no ordering with anything else.
            self.connector_bytes[1].fetch_add(bytes as u64, Ordering::Relaxed);
            let replica = route.replicas[2];
            match groups.iter_mut().find(|(r, _)| *r == replica) {
                Some((_, g)) => g.push(chunk),
                None => groups.push((replica, vec![chunk])),
            }
        }
        for (replica, windows) in groups {
            let Some(c2w) = self.stage(StageKind::Code2Wav, replica) else {
                continue;
            };
            let ids: Vec<RequestId> = windows.iter().map(|c| c.request_id.clone()).collect();
            if let Err(e) = c2w.send(&StageInput::Codec(windows), &[]) {
                for id in dedup(ids) {
                    self.fail(&id, e.clone());
                }
            }
        }
    }

    fn on_code2wav(&self, mut outs: StageOutputs) {
        self.stage_failures(StageKind::Code2Wav, &mut outs);
        let outputs: Vec<EngineCoreOutput> = std::mem::take(&mut outs.outputs)
            .into_iter()
            .filter(|o| self.route(&o.request_id).is_some())
            .collect();
        for o in outputs.iter().filter(|o| o.finished()) {
            lock(&self.table).remove(&o.request_id);
        }
        self.frontend.dispatch(EngineCoreOutputs {
            outputs,
            ..EngineCoreOutputs::default()
        });
    }
}

fn stage_index(kind: StageKind) -> usize {
    match kind {
        StageKind::Thinker => 0,
        StageKind::Talker => 1,
        StageKind::Code2Wav => 2,
    }
}

fn final_output(id: &str, reason: FinishReason) -> EngineCoreOutput {
    EngineCoreOutput {
        request_id: id.to_string(),
        new_token_ids: Vec::new(),
        new_logprobs: Vec::new(),
        finish_reason: Some(reason),
        stop_reason: None,
        num_cached_tokens: 0,
        queue_time: None,
        text_finish_reason: None,
        audio: None,
    }
}

/// The pipeline; see the module docs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct OmniPipeline {
    shared: Arc<Shared>,
    dispatcher: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl OmniPipeline {
    /// Starts every replica of every stage (in order; a failure stops those already started)
    /// and the dispatcher.
    pub fn start(cfg: &OmniPipelineConfig) -> Result<Self, EngineCoreStartError> {
        if cfg.stages.len() != 3 || cfg.stages.iter().any(Vec::is_empty) {
            return Err(EngineCoreStartError::Spawn(format!(
                "an omni pipeline needs Thinker, Talker and Code2Wav with a replica each, got {:?}",
                cfg.stages.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            frontend: Arc::new(Frontend::new(tx)),
            stages: OnceLock::new(),
            talker_defaults: cfg.stages[1]
                .iter()
                .map(|s| s.default_sampling.clone())
                .collect(),
            table: Mutex::new(Table {
                routes: HashMap::new(),
                load: cfg.stages.iter().map(|s| vec![0; s.len()]).collect(),
            }),
            connector_bytes: [AtomicU64::new(0), AtomicU64::new(0)],
            stats: Mutex::new(
                cfg.stages
                    .iter()
                    .map(|s| vec![SchedulerStats::default(); s.len()])
                    .collect(),
            ),
        });
        let mut stages: Vec<Vec<StageClient>> = Vec::new();
        for specs in &cfg.stages {
            let mut replicas = Vec::new();
            for spec in specs {
                let weak = Arc::downgrade(&shared);
                let kind = spec.kind;
                let replica = replicas.len();
                let on_output = Box::new(move |outs: StageOutputs, buffers: Vec<Vec<u8>>| {
                    let Some(s) = weak.upgrade() else { return };
                    s.note_stats(stage_index(kind), replica, outs.scheduler_stats);
                    match kind {
                        StageKind::Thinker => s.on_thinker(outs, buffers),
                        StageKind::Talker => s.on_talker(outs),
                        StageKind::Code2Wav => s.on_code2wav(outs),
                    }
                });
                let weak = Arc::downgrade(&shared);
                let on_death = Box::new(move |e: EngineDeadError| {
                    if let Some(s) = weak.upgrade() {
                        s.frontend.die(e);
                    }
                });
                match StageClient::start(&cfg.client, spec, on_output, on_death) {
                    Ok((client, _ready)) => replicas.push(client),
                    Err(e) => {
                        for c in stages.iter().flatten().chain(&replicas) {
                            c.shutdown();
                        }
                        return Err(e);
                    }
                }
            }
            stages.push(replicas);
        }
        let _ = shared.stages.set(stages);
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        let dispatcher = std::thread::Builder::new()
            .name("omni-pipeline".into())
            .spawn(move || dispatch_inputs(&weak, &rx))
            .map_err(|e| EngineCoreStartError::Spawn(format!("starting the dispatcher: {e}")))?;
        Ok(Self {
            shared,
            dispatcher: Arc::new(Mutex::new(Some(dispatcher))),
        })
    }

    /// The last scheduler state of every replica, per stage (vLLM's gauges with a `stage`
    /// label).
    pub fn stage_stats(&self) -> Vec<Vec<SchedulerStats>> {
        lock(&self.shared.stats).clone()
    }

    /// Every stage replica, per stage.
    pub fn stages(&self) -> &[Vec<StageClient>] {
        self.shared.stages.get().map_or(&[], Vec::as_slice)
    }
}

/// The dispatcher thread: requests and aborts from the frontend's channel to the stages.
fn dispatch_inputs(shared: &Weak<Shared>, rx: &mpsc::Receiver<EngineCoreInput>) {
    while let Ok(input) = rx.recv() {
        let Some(s) = shared.upgrade() else { return };
        match input {
            EngineCoreInput::Add(req) => s.admit(*req),
            EngineCoreInput::Abort(ids) => {
                for id in ids {
                    s.end_request(&id, None, None);
                }
            }
            EngineCoreInput::Shutdown => return,
        }
    }
}

impl EngineCoreClient for OmniPipeline {
    fn add_request(&self, req: EngineCoreRequest) -> Result<RequestStream, RequestError> {
        self.shared.frontend.add_request(req)
    }

    fn abort(&self, request_ids: Vec<RequestId>) {
        self.shared.frontend.abort(request_ids);
    }

    /// The Thinker's scheduler state (the last replica that reported).
    fn stats(&self) -> SchedulerStats {
        self.shared.frontend.stats()
    }

    fn pipeline_stats(&self) -> Option<omni_protocol::PipelineStats> {
        let stages = self
            .stage_stats()
            .into_iter()
            .enumerate()
            .flat_map(|(s, replicas)| {
                replicas
                    .into_iter()
                    .enumerate()
                    .map(move |(r, st)| (s as u32, r as u32, st))
            })
            .collect();
        let c = &self.shared.connector_bytes;
        Some(omni_protocol::PipelineStats {
            stages,
            connector_bytes: vec![
                (0, 1, c[0].load(Ordering::Relaxed)),
                (1, 2, c[1].load(Ordering::Relaxed)),
            ],
        })
    }

    fn health(&self) -> Result<(), EngineDeadError> {
        self.shared.frontend.health()?;
        for s in self.stages().iter().flatten() {
            s.health()?;
        }
        Ok(())
    }

    fn shutdown(&self) {
        self.shared.frontend.begin_shutdown();
        if let Some(t) = lock(&self.dispatcher).take() {
            let _ = t.join();
        }
        for s in self.stages().iter().flatten() {
            s.shutdown();
        }
    }
}
