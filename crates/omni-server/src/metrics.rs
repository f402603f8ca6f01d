//! `/metrics`: Prometheus exposition with vLLM's metric names and `model_name` label, so the
//! Gateway API inference extension and existing Grafana dashboards work unchanged.
//!
//! Counters render with the `_total` suffix on samples (`vllm:prompt_tokens_total`), as vLLM's
//! exposition does. Gauges and the engine's cumulative counters (preemptions, prefix cache) are
//! refreshed from [`EngineClient::stats`] at scrape time; per-request latencies are observed by
//! the server as outputs arrive (it sees the request arrive and every token leave). The one
//! interval only the engine sees, queued -> first scheduled, comes on the request's first
//! output (`EngineCoreOutput::queue_time`); prefill time is then time to first token minus queue
//! time, decode time first token to last, as vLLM computes them. A finished request's time per
//! output token (`vllm:request_time_per_output_token_seconds`) is its decode time over its
//! output tokens after the first, 0 with fewer than two (vLLM's `mean_time_per_output_token`).
//!
//! Omni requests add vLLM-Omni's audio families (`vllm_omni/metrics/definitions.py`, same names
//! and buckets, so its dashboards read them): `vllm_omni:audio_ttfp_s` (arrival -> first audio
//! output), `vllm_omni:audio_rtf` (arrival -> last audio output, over the audio's seconds),
//! `vllm_omni:audio_duration_s` (seconds of audio per request; its `_sum` is the audio generated)
//! and `vllm_omni:audio_frames_total` (PCM sample frames, counted as they arrive). vLLM-Omni
//! labels them with the serving `stage` and `replica` as well; the API process does not know
//! those (an [`omni_protocol::AudioOutput`] does not say), so they carry `model_name` only.
//! Per-stage engine gauges (running / waiting / KV usage with a `stage` label) and connector
//! bytes belong in [`Metrics::render`] beside the engine's other gauges, read from the engine
//! client's stats at scrape time.

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::engine::EngineClient;

type Labels = Vec<(String, String)>;

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `vllm:inter_token_latency_seconds` buckets, also those of
/// `vllm:request_time_per_output_token_seconds`.
pub const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request-latency buckets (e2e, queue, prefill, decode).
pub const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM-Omni's `SECONDS_BUCKETS` (audio time to first packet, audio duration).
pub const AUDIO_SECONDS_BUCKETS: [f64; 13] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
];
/// vLLM-Omni's `RTF_BUCKETS` (the real-time factor; above 1.0 audio is slower than playback).
pub const AUDIO_RTF_BUCKETS: [f64; 11] =
    [0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0, 5.0, 10.0];

/// Cumulative engine counters already exported, to turn totals into increments.
#[derive(Debug, Default)]
struct Exported {
    preemptions: u64,
    prefix_queries: u64,
    prefix_hits: u64,
    /// The `omni:` engine counters, in [`ENGINE_COUNTERS`] order.
    engine: [u64; ENGINE_COUNTERS.len()],
    /// Per `(from_stage, to_stage)` connector.
    connector_bytes: std::collections::HashMap<(u32, u32), u64>,
}

/// omni-engine's own cumulative engine counters (vLLM has none of these, hence `omni:`): name,
/// help, and the field of [`omni_protocol::SchedulerStats`] it reads.
type EngineCounter = (
    &'static str,
    &'static str,
    fn(&omni_protocol::SchedulerStats) -> u64,
);
const ENGINE_COUNTERS: [EngineCounter; 5] = [
    (
        "omni:engine_steps",
        "Batches the engine core ran on its executor",
        |s| s.engine_steps,
    ),
    (
        "omni:mq_broadcast_messages",
        "Messages the broadcast queue sent to the workers",
        |s| s.mq_broadcast_messages,
    ),
    (
        "omni:mq_overflow_messages",
        "Broadcast messages larger than a ring chunk (VLLM_MQ_MAX_CHUNK_BYTES_MB), sent over the overflow socket",
        |s| s.mq_overflow_messages,
    ),
    (
        "omni:mq_ring_bytes",
        "Broadcast payload bytes through the shared-memory ring",
        |s| s.mq_ring_bytes,
    ),
    (
        "omni:mq_overflow_bytes",
        "Broadcast payload bytes through the overflow socket",
        |s| s.mq_overflow_bytes,
    ),
];

/// Every metric the server exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    model: Labels,
    running: Family<Labels, Gauge>,
    waiting: Family<Labels, Gauge>,
    kv_usage: Family<Labels, Gauge<f64, AtomicU64>>,
    cache_config: Family<Labels, Gauge>,
    prompt_tokens: Family<Labels, Counter>,
    generation_tokens: Family<Labels, Counter>,
    request_success: Family<Labels, Counter>,
    preemptions: Family<Labels, Counter>,
    prefix_queries: Family<Labels, Counter>,
    prefix_hits: Family<Labels, Counter>,
    /// `vllm:mm_cache_queries` and `vllm:mm_cache_hits` (the processor cache, in items).
    mm_cache: [Family<Labels, Counter>; 2],
    ttft: HistogramFamily,
    itl: HistogramFamily,
    /// `vllm:request_time_per_output_token_seconds`: one observation per finished request.
    tpot: HistogramFamily,
    e2e: HistogramFamily,
    queue: HistogramFamily,
    prefill: HistogramFamily,
    decode: HistogramFamily,
    audio_ttfp: HistogramFamily,
    audio_rtf: HistogramFamily,
    audio_duration: HistogramFamily,
    audio_frames: Family<Labels, Counter>,
    connector_bytes: Family<Labels, Counter>,
    engine_counters: [Family<Labels, Counter>; ENGINE_COUNTERS.len()],
    exported: Mutex<Exported>,
}

type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

fn ttft_histogram() -> Histogram {
    Histogram::new(TTFT_BUCKETS)
}

fn itl_histogram() -> Histogram {
    Histogram::new(ITL_BUCKETS)
}

fn request_latency_histogram() -> Histogram {
    Histogram::new(REQUEST_LATENCY_BUCKETS)
}

fn audio_seconds_histogram() -> Histogram {
    Histogram::new(AUDIO_SECONDS_BUCKETS)
}

fn audio_rtf_histogram() -> Histogram {
    Histogram::new(AUDIO_RTF_BUCKETS)
}

impl Metrics {
    /// Registers every metric for `model_name`.
    pub fn new(model_name: &str) -> Self {
        let mut registry = Registry::default();
        let model = vec![("model_name".to_string(), model_name.to_string())];
        let running = Family::<Labels, Gauge>::default();
        let waiting = Family::<Labels, Gauge>::default();
        let kv_usage = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        let cache_config = Family::<Labels, Gauge>::default();
        let prompt_tokens = Family::<Labels, Counter>::default();
        let generation_tokens = Family::<Labels, Counter>::default();
        let request_success = Family::<Labels, Counter>::default();
        let preemptions = Family::<Labels, Counter>::default();
        let prefix_queries = Family::<Labels, Counter>::default();
        let prefix_hits = Family::<Labels, Counter>::default();
        let mm_cache: [Family<Labels, Counter>; 2] = Default::default();
        let ttft = HistogramFamily::new_with_constructor(ttft_histogram);
        let itl = HistogramFamily::new_with_constructor(itl_histogram);
        let tpot = HistogramFamily::new_with_constructor(itl_histogram);
        let e2e = HistogramFamily::new_with_constructor(request_latency_histogram);
        let queue = HistogramFamily::new_with_constructor(request_latency_histogram);
        let prefill = HistogramFamily::new_with_constructor(request_latency_histogram);
        let decode = HistogramFamily::new_with_constructor(request_latency_histogram);
        let audio_ttfp = HistogramFamily::new_with_constructor(audio_seconds_histogram);
        let audio_rtf = HistogramFamily::new_with_constructor(audio_rtf_histogram);
        let audio_duration = HistogramFamily::new_with_constructor(audio_seconds_histogram);
        let audio_frames = Family::<Labels, Counter>::default();
        let r = &mut registry;
        r.register(
            "vllm:num_requests_running",
            "Number of requests in model execution batches",
            running.clone(),
        );
        r.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed",
            waiting.clone(),
        );
        r.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage",
            kv_usage.clone(),
        );
        r.register(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            cache_config.clone(),
        );
        r.register(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed",
            prompt_tokens.clone(),
        );
        r.register(
            "vllm:generation_tokens",
            "Number of generation tokens processed",
            generation_tokens.clone(),
        );
        r.register(
            "vllm:request_success",
            "Count of successfully processed requests",
            request_success.clone(),
        );
        r.register(
            "vllm:num_preemptions",
            "Cumulative number of preemptions from the engine",
            preemptions.clone(),
        );
        r.register(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
            prefix_queries.clone(),
        );
        r.register(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens",
            prefix_hits.clone(),
        );
        r.register(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items",
            mm_cache[0].clone(),
        );
        r.register(
            "vllm:mm_cache_hits",
            "Multi-modal cache hits, in terms of number of cached items",
            mm_cache[1].clone(),
        );
        r.register(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            ttft.clone(),
        );
        r.register(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            itl.clone(),
        );
        r.register(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request",
            tpot.clone(),
        );
        r.register(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds",
            e2e.clone(),
        );
        r.register(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request",
            queue.clone(),
        );
        r.register(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request",
            prefill.clone(),
        );
        r.register(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request",
            decode.clone(),
        );
        r.register(
            "vllm_omni:audio_ttfp_s",
            "Time from request arrival to first audio packet, in seconds",
            audio_ttfp.clone(),
        );
        r.register(
            "vllm_omni:audio_rtf",
            "Audio real-time factor (generation time / audio duration); SLO red line < 1",
            audio_rtf.clone(),
        );
        r.register(
            "vllm_omni:audio_duration_s",
            "Generated audio content duration, in seconds (audio_frames / sample_rate)",
            audio_duration.clone(),
        );
        r.register(
            "vllm_omni:audio_frames",
            "Total audio frames generated; throughput recovered via rate()",
            audio_frames.clone(),
        );
        let connector_bytes = Family::<Labels, Counter>::default();
        r.register(
            "vllm_omni:connector_bytes",
            "Bytes an omni pipeline's connector carried between two stages",
            connector_bytes.clone(),
        );
        // Touch the unlabelled-by-request series so they render as 0 before the first request.
        for c in [
            &prompt_tokens,
            &generation_tokens,
            &preemptions,
            &prefix_queries,
            &prefix_hits,
            &mm_cache[0],
            &mm_cache[1],
        ] {
            let _ = c.get_or_create(&model);
        }
        for h in [&ttft, &itl, &tpot, &e2e, &queue, &prefill, &decode] {
            let _ = h.get_or_create(&model);
        }
        let engine_counters: [Family<Labels, Counter>; ENGINE_COUNTERS.len()] =
            std::array::from_fn(|_| Family::default());
        for (c, (name, help, _)) in engine_counters.iter().zip(ENGINE_COUNTERS) {
            registry.register(name, help, c.clone());
            let _ = c.get_or_create(&model);
        }
        Self {
            registry,
            model,
            running,
            waiting,
            kv_usage,
            cache_config,
            prompt_tokens,
            generation_tokens,
            request_success,
            preemptions,
            prefix_queries,
            prefix_hits,
            mm_cache,
            ttft,
            itl,
            tpot,
            e2e,
            queue,
            prefill,
            decode,
            audio_ttfp,
            audio_rtf,
            audio_duration,
            audio_frames,
            connector_bytes,
            engine_counters,
            exported: Mutex::new(Exported::default()),
        }
    }

    /// The processor cache was asked for one item (and had it, when `hit`).
    pub fn mm_cache_query(&self, hit: bool) {
        self.mm_cache[0].get_or_create(&self.model).inc();
        if hit {
            self.mm_cache[1].get_or_create(&self.model).inc();
        }
    }

    /// A request was admitted with this many prompt tokens.
    pub fn observe_prompt(&self, tokens: usize) {
        self.prompt_tokens
            .get_or_create(&self.model)
            .inc_by(tokens as u64);
    }

    /// `tokens` output tokens arrived; the first of a request with its TTFT, later ones with
    /// the gap since the previous output (inter-token latency).
    pub fn observe_tokens(&self, tokens: usize, ttft: Option<f64>, itl: Option<f64>) {
        self.generation_tokens
            .get_or_create(&self.model)
            .inc_by(tokens as u64);
        if let Some(t) = ttft {
            self.ttft.get_or_create(&self.model).observe(t);
        }
        if let Some(t) = itl {
            self.itl.get_or_create(&self.model).observe(t);
        }
    }

    /// A request finished after `e2e` seconds.
    pub fn observe_finished(&self, finished_reason: &str, e2e: f64) {
        let mut labels = self.model.clone();
        labels.push(("finished_reason".into(), finished_reason.into()));
        self.request_success.get_or_create(&labels).inc();
        self.e2e.get_or_create(&self.model).observe(e2e);
    }

    /// A request waited `seconds` before it was first scheduled (the engine reports it on the
    /// request's first output).
    pub fn observe_queue_time(&self, seconds: f64) {
        self.queue.get_or_create(&self.model).observe(seconds);
    }

    /// A request's prefill took `seconds`: from its first scheduling to its first token.
    pub fn observe_prefill_time(&self, seconds: f64) {
        self.prefill.get_or_create(&self.model).observe(seconds);
    }

    /// A request's decode took `seconds`, from its first token to its last, over
    /// `output_tokens` tokens in all: its decode time and its time per output token.
    pub fn observe_decode_time(&self, seconds: f64, output_tokens: usize) {
        self.decode.get_or_create(&self.model).observe(seconds);
        let per_token = if output_tokens > 1 {
            seconds / (output_tokens - 1) as f64
        } else {
            0.0
        };
        self.tpot.get_or_create(&self.model).observe(per_token);
    }

    /// A request's first audio output arrived `seconds` after the request.
    pub fn observe_audio_first_packet(&self, seconds: f64) {
        self.audio_ttfp.get_or_create(&self.model).observe(seconds);
    }

    /// `samples` audio samples (frames of mono audio) arrived.
    pub fn observe_audio_samples(&self, samples: usize) {
        self.audio_frames
            .get_or_create(&self.model)
            .inc_by(samples as u64);
    }

    /// A request ended with `seconds` of audio at real-time factor `rtf`.
    pub fn observe_audio_finished(&self, seconds: f64, rtf: f64) {
        self.audio_duration
            .get_or_create(&self.model)
            .observe(seconds);
        self.audio_rtf.get_or_create(&self.model).observe(rtf);
    }

    /// An omni pipeline's per-stage gauges (vLLM's names with `stage` and `replica` labels
    /// beside the unlabelled series, which are the Thinker's) and its connectors' bytes.
    fn render_pipeline(&self, p: &omni_protocol::PipelineStats) {
        for (stage, replica, st) in &p.stages {
            let mut l = self.model.clone();
            l.push(("stage".into(), stage.to_string()));
            l.push(("replica".into(), replica.to_string()));
            self.running
                .get_or_create(&l)
                .set(i64::from(st.num_running_reqs));
            self.waiting
                .get_or_create(&l)
                .set(i64::from(st.num_waiting_reqs));
            self.kv_usage
                .get_or_create(&l)
                .set(f64::from(st.kv_cache_usage));
        }
        if let Ok(mut ex) = self.exported.lock() {
            for &(from, to, bytes) in &p.connector_bytes {
                let last = ex.connector_bytes.entry((from, to)).or_insert(0);
                let mut l = self.model.clone();
                l.push(("from_stage".into(), from.to_string()));
                l.push(("to_stage".into(), to.to_string()));
                let c = self.connector_bytes.get_or_create(&l);
                if bytes > *last {
                    c.inc_by(bytes - *last);
                    *last = bytes;
                }
            }
        }
    }

    /// Refreshes engine-side values and renders the exposition text.
    pub fn render(&self, engine: &dyn EngineClient) -> String {
        let stats = engine.stats();
        let m = &self.model;
        self.running
            .get_or_create(m)
            .set(i64::from(stats.num_running_reqs));
        self.waiting
            .get_or_create(m)
            .set(i64::from(stats.num_waiting_reqs));
        self.kv_usage
            .get_or_create(m)
            .set(f64::from(stats.kv_cache_usage));
        let cache = engine.cache_info();
        let mut labels = m.clone();
        labels.push(("block_size".into(), cache.block_size.to_string()));
        labels.push(("num_gpu_blocks".into(), cache.num_gpu_blocks.to_string()));
        self.cache_config.get_or_create(&labels).set(1);
        if let Ok(mut ex) = self.exported.lock() {
            let inc = |c: &Family<Labels, Counter>, last: &mut u64, now: u64| {
                if now > *last {
                    c.get_or_create(m).inc_by(now - *last);
                    *last = now;
                }
            };
            inc(
                &self.preemptions,
                &mut ex.preemptions,
                stats.num_preemptions,
            );
            inc(
                &self.prefix_queries,
                &mut ex.prefix_queries,
                stats.prefix_cache_queries,
            );
            inc(
                &self.prefix_hits,
                &mut ex.prefix_hits,
                stats.prefix_cache_hits,
            );
            for ((c, (_, _, read)), last) in self
                .engine_counters
                .iter()
                .zip(ENGINE_COUNTERS)
                .zip(ex.engine.iter_mut())
            {
                inc(c, last, read(&stats));
            }
        }
        if let Some(p) = engine.pipeline_stats() {
            self.render_pipeline(&p);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
