//! [`OmniPipeline`]: an omni model's stages (Thinker -> Talker -> Code2Wav, or a text LLM ->
//! TTS), each replica a process of its own ([`StageClient`]), behind one [`EngineCoreClient`].
//!
//! ```text
//!  add_request ─▶ dispatcher ─Add──────────────▶ thinker[r0] ─text──────────────▶ request stream
//!                     │                              └─ThinkerToTalker─▶ talker[r1]
//!                     └─Add (voice, sampling)──────────────────────────▶ talker[r1] ─CodecChunk─▶ code2wav[r2]
//!                                                                        code2wav[r2] ─audio──▶ request stream
//!
//!  add_request ─▶ dispatcher ─Add (prompt, seed)─▶ tts[r1]
//!                     └─Add─▶ thinker[r0] ─text──▶ request stream
//!                                 └─TextDelta (new token ids)─▶ tts[r1] ─audio──▶ request stream
//! ```
//!
//! * The topology comes from the stages' kinds: `[Thinker, Talker, Code2Wav]` (Qwen3-Omni) or
//!   `[Thinker, Tts]` (a text model and a voice).
//! * Each request is bound to one replica per stage for its life, the least loaded at
//!   admission. The dispatcher thread sends the later stages' `Add` before the Thinker's, so
//!   they know the request before the Thinker's first chunk reaches them.
//! * The readers of the stages' output queues route what they receive: Thinker text to the
//!   request's stream (when audio follows, the Thinker's finish reason moves to
//!   `text_finish_reason` and the stream stays open), Thinker states to the request's Talker,
//!   codec windows to its Code2Wav, Thinker tokens to its TTS replica, audio to the stream; the
//!   audio stage's last output ends the request.
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
    StageSpec, TextDelta, ThinkerToTalker,
};

use crate::engine_core_client::{EngineCoreClient, Frontend, RequestError, RequestStream};
use crate::mp_client::{EngineCoreStartError, MpClientConfig};
use crate::stage_client::StageClient;

/// How to start a pipeline.
#[derive(Debug, Clone)]
pub struct OmniPipelineConfig {
    /// The binary and arguments of a stage process (e.g. `omni-engine stage`), queue sizes.
    pub client: MpClientConfig,
    /// Per stage (Thinker, Talker, Code2Wav, or Thinker, TTS, in order), the spec of each
    /// replica.
    pub stages: Vec<Vec<StageSpec>>,
}

/// Most stages in a pipeline.
const MAX_STAGES: usize = 3;

/// The pipelines that exist: Qwen3-Omni's, and a text stage before a TTS stage.
const TOPOLOGIES: [&[StageKind]; 2] = [
    &[StageKind::Thinker, StageKind::Talker, StageKind::Code2Wav],
    &[StageKind::Thinker, StageKind::Tts],
];

/// Where one request lives.
#[derive(Debug, Clone, Copy)]
struct Route {
    /// Replica index per stage.
    replicas: [usize; MAX_STAGES],
    /// Whether the stages after the Thinker take part.
    audio: bool,
    /// Text deltas sent to its TTS replica so far.
    text_chunks: u32,
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
    /// What each stage runs, in order (one of [`TOPOLOGIES`]).
    kinds: Vec<StageKind>,
    /// Each replica's default sampling per stage (a request without `sampling_params_list`).
    stage_defaults: Vec<Vec<omni_protocol::SamplingParams>>,
    table: Mutex<Table>,
    /// The last scheduler state each (stage, replica) reported.
    stats: Mutex<Vec<Vec<SchedulerStats>>>,
    /// Bytes sent stage 0 -> 1 and 1 -> 2 (headers' tensors, text token ids, codes).
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
    /// The position of the stage of this kind, if the pipeline has one.
    fn index(&self, kind: StageKind) -> Option<usize> {
        self.kinds.iter().position(|&k| k == kind)
    }

    fn stage(&self, kind: StageKind, replica: usize) -> Option<&StageClient> {
        let index = self.index(kind)?;
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
        for (i, &kind) in self.kinds.iter().enumerate() {
            if Some(kind) == except || (!route.audio && kind != StageKind::Thinker) {
                continue;
            }
            if let Some(s) = self.stage(kind, route.replicas[i]) {
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

    /// Admits a request: picks its replicas, registers it with the Talker or TTS stage
    /// (audio), starts it in the Thinker.
    fn admit(&self, mut req: EngineCoreRequest) {
        let audio = req.omni.as_ref().is_some_and(|o| o.wants_audio());
        let Some(stages) = self.stages.get() else {
            return;
        };
        let route = {
            let mut t = lock(&self.table);
            let mut replicas = [0usize; MAX_STAGES];
            // The least-loaded replica of each stage the request uses, counted at once.
            for (s, slot) in replicas.iter_mut().enumerate() {
                if let Some(load) = t.load.get_mut(s).filter(|_| audio || s == 0)
                    && let Some(r) = (0..load.len()).min_by_key(|&r| load[r])
                {
                    load[r] += 1;
                    *slot = r;
                }
            }
            let route = Route {
                replicas,
                audio,
                text_chunks: 0,
            };
            t.routes.insert(req.request_id.clone(), route);
            route
        };
        let id = req.request_id.clone();
        // The Thinker stage encodes the media: the items' tensors go with its Add as the
        // message's buffers; the later stages take no media. The Talker builds its own prompt;
        // a TTS stage keeps the prompt ids to detokenize the first tokens in context.
        for (i, &kind) in self.kinds.iter().enumerate().skip(1) {
            let Some(stage) = stages.get(i).and_then(|s| s.get(route.replicas[i])) else {
                continue;
            };
            if !audio || !matches!(kind, StageKind::Talker | StageKind::Tts) {
                continue;
            }
            let mut t = req.clone();
            if kind == StageKind::Talker {
                t.prompt_token_ids.clear();
            }
            t.mm_features.clear();
            t.mm_buffers = Default::default();
            if let Some(p) = t.omni.as_ref().and_then(|o| o.stage_sampling.get(i - 1)) {
                t.sampling_params = p.clone();
            } else if let Some(p) = self.stage_defaults[i].get(route.replicas[i]) {
                t.sampling_params = p.clone();
            }
            if let Err(e) = stage.send(&StageInput::Add(Box::new(t)), &[]) {
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

    /// Sends the Thinker's new tokens of audio requests to their TTS replicas, one message
    /// per replica.
    fn forward_text(&self, outputs: &[EngineCoreOutput]) {
        let Some(stage) = self.index(StageKind::Tts) else {
            return;
        };
        let mut groups: Vec<(usize, Vec<TextDelta>)> = Vec::new();
        for o in outputs {
            let delta = {
                let mut t = lock(&self.table);
                let Some(route) = t.routes.get_mut(&o.request_id).filter(|r| r.audio) else {
                    continue;
                };
                let finished = o.finish_reason.is_some() || o.text_finish_reason.is_some();
                if o.new_token_ids.is_empty() && !finished {
                    continue;
                }
                route.text_chunks += 1;
                let delta = TextDelta {
                    request_id: o.request_id.clone(),
                    chunk_id: route.text_chunks - 1,
                    token_ids: o.new_token_ids.clone(),
                    finished,
                };
                (route.replicas[stage], delta)
            };
            let bytes = delta.1.token_ids.len() * std::mem::size_of::<u32>();
            // A statistic: no ordering with anything else.
            self.connector_bytes[0].fetch_add(bytes as u64, Ordering::Relaxed);
            match groups.iter_mut().find(|(r, _)| *r == delta.0) {
                Some((_, g)) => g.push(delta.1),
                None => groups.push((delta.0, vec![delta.1])),
            }
        }
        for (replica, deltas) in groups {
            let Some(tts) = self.stage(StageKind::Tts, replica) else {
                continue;
            };
            let ids: Vec<RequestId> = deltas.iter().map(|d| d.request_id.clone()).collect();
            if let Err(e) = tts.send(&StageInput::Text(deltas), &[]) {
                for id in dedup(ids) {
                    self.fail(&id, e.clone());
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
        self.forward_text(&outputs);
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
            let Some(replica) = self.index(StageKind::Code2Wav).map(|i| route.replicas[i]) else {
                continue;
            };
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

    /// Audio (Code2Wav's or a TTS stage's) to the requests' streams; an output with a finish
    /// reason ends its request.
    fn on_audio(&self, kind: StageKind, mut outs: StageOutputs) {
        self.stage_failures(kind, &mut outs);
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

fn final_output(id: &str, reason: FinishReason) -> EngineCoreOutput {
    EngineCoreOutput::bare(id, Some(reason), None)
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
        let kinds: Vec<StageKind> = cfg
            .stages
            .iter()
            .filter_map(|s| s.first().map(|r| r.kind))
            .collect();
        let uniform = cfg
            .stages
            .iter()
            .all(|s| !s.is_empty() && s.iter().all(|r| Some(r.kind) == s.first().map(|f| f.kind)));
        if !uniform || !TOPOLOGIES.contains(&kinds.as_slice()) {
            return Err(EngineCoreStartError::Spawn(format!(
                "an omni pipeline is Thinker -> Talker -> Code2Wav or Thinker -> TTS with a \
                 replica each, of one kind per stage; got {:?}",
                cfg.stages
                    .iter()
                    .map(|s| s.iter().map(|r| r.kind.as_str()).collect::<Vec<_>>())
                    .collect::<Vec<_>>()
            )));
        }
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            frontend: Arc::new(Frontend::new(tx)),
            stages: OnceLock::new(),
            kinds,
            stage_defaults: cfg
                .stages
                .iter()
                .map(|s| s.iter().map(|r| r.default_sampling.clone()).collect())
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
        for (index, specs) in cfg.stages.iter().enumerate() {
            let mut replicas = Vec::new();
            for spec in specs {
                let weak = Arc::downgrade(&shared);
                let kind = spec.kind;
                let replica = replicas.len();
                let on_output = Box::new(move |outs: StageOutputs, buffers: Vec<Vec<u8>>| {
                    let Some(s) = weak.upgrade() else { return };
                    s.note_stats(index, replica, outs.scheduler_stats);
                    match kind {
                        StageKind::Thinker => s.on_thinker(outs, buffers),
                        StageKind::Talker => s.on_talker(outs),
                        StageKind::Code2Wav | StageKind::Tts => s.on_audio(kind, outs),
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
            connector_bytes: (1..self.shared.kinds.len())
                .map(|to| (to as u32 - 1, to as u32, c[to - 1].load(Ordering::Relaxed)))
                .collect(),
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
