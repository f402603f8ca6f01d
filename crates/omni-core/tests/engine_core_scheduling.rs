//! EngineCore + Scheduler + KvCacheManager driven by a fake worker that follows the
//! `SchedulerOutput` contract: it keeps each request's tokens and block table, writes the tokens
//! of the scheduled positions into a fake paged KV cache, checks that earlier positions are
//! already there, and "samples" a deterministic function of the context it reads back from the
//! cache. A wrong block table, a bad prefix-cache hit or a lost token changes the output.

#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, VecDeque};

use omni_core::{EngineCore, EngineDeadError, Executor, SchedulerConfig};
use omni_protocol::{
    BlockId, EngineCoreOutput, EngineCoreRequest, FinishReason, Logprob, ModelRunnerOutput,
    SamplingParams, SchedulerOutput, TokenId, TokenLogprobs,
};

const VOCAB: u64 = 1000;

/// The fake model: next token as a function of the whole context.
fn next_token(context: &[TokenId]) -> TokenId {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in context {
        h ^= u64::from(t);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % VOCAB) as TokenId + 10 // never 0..10, so EOS (0) and stop ids stay out of the way
}

struct FakeReq {
    tokens: Vec<TokenId>,
    blocks: Vec<BlockId>,
    logprobs: Option<u32>,
}

struct FakeWorker {
    block_size: usize,
    kv: Vec<Vec<Option<TokenId>>>,
    reqs: HashMap<String, FakeReq>,
    history: Vec<SchedulerOutput>,
    fail_at_step: Option<usize>,
    /// Takes batches ahead (async scheduling): a position the scheduler sends no token for is
    /// the one this worker sampled there. Submitted batches run at once; outputs wait here.
    ahead: Option<VecDeque<ModelRunnerOutput>>,
}

impl FakeWorker {
    fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            block_size,
            kv: vec![vec![None; block_size]; num_blocks],
            reqs: HashMap::new(),
            history: Vec::new(),
            fail_at_step: None,
            ahead: None,
        }
    }

    fn slot(&self, req: &FakeReq, pos: usize) -> (usize, usize) {
        (
            req.blocks[pos / self.block_size] as usize,
            pos % self.block_size,
        )
    }
}

impl Executor for FakeWorker {
    fn execute_model(
        &mut self,
        so: &SchedulerOutput,
        _buffers: &[&[u8]],
    ) -> Result<ModelRunnerOutput, EngineDeadError> {
        if self.fail_at_step == Some(self.history.len()) {
            return Err(EngineDeadError::Worker {
                rank: 0,
                cause: "killed by test".into(),
            });
        }
        self.history.push(so.clone());
        for id in &so.finished_req_ids {
            self.reqs.remove(id);
        }
        let mut work: Vec<(String, usize, Vec<TokenId>)> = Vec::new();
        for new in &so.scheduled_new_reqs {
            assert!(
                !self.reqs.contains_key(&new.req_id),
                "new request seen twice"
            );
            self.reqs.insert(
                new.req_id.clone(),
                FakeReq {
                    tokens: new.prompt_token_ids.clone(),
                    blocks: new.block_ids.clone(),
                    logprobs: new.sampling_params.logprobs,
                },
            );
            let c = new.num_computed_tokens as usize;
            let n = so.num_scheduled_tokens[&new.req_id] as usize;
            work.push((
                new.req_id.clone(),
                c,
                new.prompt_token_ids[c..c + n].to_vec(),
            ));
        }
        for cached in &so.scheduled_cached_reqs {
            let req = self
                .reqs
                .get_mut(&cached.req_id)
                .expect("cached request unknown");
            if cached.resumed_from_preemption {
                req.blocks = cached.new_block_ids.clone();
            } else {
                req.blocks.extend_from_slice(&cached.new_block_ids);
            }
            let n = so.num_scheduled_tokens[&cached.req_id] as usize;
            let start = cached.num_computed_tokens as usize;
            let mut tokens = cached.new_token_ids.clone();
            if self.ahead.is_none() {
                assert_eq!(tokens.len(), n);
            } else {
                // The rest are positions this worker sampled (it must have).
                tokens.extend_from_slice(&req.tokens[start + tokens.len()..start + n]);
            }
            work.push((cached.req_id.clone(), start, tokens));
        }
        assert_eq!(work.len(), so.num_scheduled_tokens.len());

        // Compute in reverse batch order: the contract says order must not matter.
        let mut out = ModelRunnerOutput::default();
        for (id, start, tokens) in work.into_iter().rev() {
            let req = self.reqs.get(&id).expect("request");
            // Earlier positions must already be in the cache.
            for p in 0..start {
                let (b, s) = self.slot(req, p);
                assert_eq!(
                    self.kv[b][s],
                    Some(req.tokens[p]),
                    "{id}: KV of position {p} missing"
                );
            }
            let mut writes = Vec::new();
            for (k, &t) in tokens.iter().enumerate() {
                writes.push((self.slot(req, start + k), t));
            }
            let req = self.reqs.get_mut(&id).expect("request");
            for (k, &t) in tokens.iter().enumerate() {
                let p = start + k;
                if p < req.tokens.len() {
                    assert_eq!(req.tokens[p], t, "{id}: token at {p} changed");
                } else {
                    req.tokens.push(t);
                }
            }
            for ((b, s), t) in writes {
                self.kv[b][s] = Some(t);
            }
            let end = start + tokens.len();
            let req = &self.reqs[&id];
            let mut sampled = Vec::new();
            let mut logprobs = Vec::new();
            if end == req.tokens.len() {
                let context: Vec<TokenId> = (0..end)
                    .map(|p| {
                        let (b, s) = self.slot(req, p);
                        self.kv[b][s].expect("context in cache")
                    })
                    .collect();
                let t = next_token(&context);
                sampled.push(t);
                if let Some(k) = req.logprobs {
                    let lp = Logprob {
                        token_id: t,
                        logprob: -0.5,
                    };
                    logprobs.push(TokenLogprobs {
                        sampled: lp,
                        rank: 1,
                        top: vec![lp; k as usize],
                    });
                }
                self.reqs.get_mut(&id).expect("request").tokens.push(t);
            }
            out.req_ids.push(id);
            out.sampled_token_ids.push(sampled);
            out.logprobs.push(logprobs);
        }
        Ok(out)
    }

    fn supports_async_scheduling(&self) -> bool {
        self.ahead.is_some()
    }

    fn submit(&mut self, so: &SchedulerOutput, buffers: &[&[u8]]) -> Result<(), EngineDeadError> {
        let out = self.execute_model(so, buffers)?;
        self.ahead.as_mut().expect("async worker").push_back(out);
        Ok(())
    }

    fn collect(&mut self) -> Result<ModelRunnerOutput, EngineDeadError> {
        Ok(self
            .ahead
            .as_mut()
            .and_then(VecDeque::pop_front)
            .expect("a submitted batch"))
    }
}

fn config(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: 64,
        max_num_seqs: 8,
        max_model_len: 128,
        block_size,
        num_blocks,
        enable_prefix_caching: true,
        enable_chunked_prefill: true,
        async_scheduling: false,
    }
}

fn core(cfg: SchedulerConfig) -> EngineCore<FakeWorker> {
    let mut worker = FakeWorker::new(cfg.num_blocks, cfg.block_size);
    if cfg.async_scheduling {
        worker.ahead = Some(VecDeque::new());
    }
    EngineCore::new(cfg, worker).unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32)
        .map(|i| (seed * 7919 + i * 31) % 500 + 10)
        .collect()
}

fn request(id: &str, prompt: Vec<TokenId>, max_tokens: u32, arrival: f64) -> EngineCoreRequest {
    let mut r = EngineCoreRequest::new(id, prompt, SamplingParams::greedy(max_tokens), Some(0));
    r.arrival_time = arrival;
    r
}

/// Steps until every request finished; returns tokens and final output per request.
fn run_to_completion<E: Executor>(
    core: &mut EngineCore<E>,
) -> HashMap<String, (Vec<TokenId>, EngineCoreOutput)> {
    let mut tokens: HashMap<String, Vec<TokenId>> = HashMap::new();
    let mut done = HashMap::new();
    let mut steps = 0;
    while core.has_unfinished_requests() {
        steps += 1;
        assert!(steps < 10_000, "engine does not make progress");
        for out in core.step().unwrap() {
            assert!(!done.contains_key(&out.request_id), "output after finish");
            tokens
                .entry(out.request_id.clone())
                .or_default()
                .extend(&out.new_token_ids);
            if out.finished() {
                let t = tokens.remove(&out.request_id).unwrap_or_default();
                done.insert(out.request_id.clone(), (t, out));
            }
        }
    }
    done
}

/// Twenty requests of 3 to 72 prompt tokens and 1 to 17 output tokens; what each would get
/// alone.
fn add_mixed_requests<E: Executor>(core: &mut EngineCore<E>) -> HashMap<String, Vec<TokenId>> {
    let mut expected = HashMap::new();
    for i in 0..20u32 {
        let p = prompt(i, 3 + (i as usize * 13) % 70);
        let max_tokens = 1 + (i * 5) % 17;
        expected.insert(format!("r{i}"), reference(&p, max_tokens as usize));
        core.add_request(request(&format!("r{i}"), p, max_tokens, f64::from(i)))
            .unwrap();
    }
    expected
}

/// Four requests that grow from 6 to 20 tokens (5 blocks of 4 each, in a cache of 12 blocks
/// without prefix caching: preemption is certain); what each would get alone.
fn add_growing_requests<E: Executor>(core: &mut EngineCore<E>) -> HashMap<String, Vec<TokenId>> {
    let mut expected = HashMap::new();
    for i in 0..4u32 {
        let p = prompt(i, 6);
        expected.insert(format!("r{i}"), reference(&p, 14));
        core.add_request(request(&format!("r{i}"), p, 14, f64::from(i)))
            .unwrap();
    }
    expected
}

fn tight_config() -> SchedulerConfig {
    let mut cfg = config(12, 4);
    cfg.max_model_len = 48;
    cfg.enable_prefix_caching = false;
    cfg
}

/// What the fake model generates for `prompt` with nothing else running.
fn reference(prompt: &[TokenId], max_tokens: usize) -> Vec<TokenId> {
    let mut ctx = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let t = next_token(&ctx);
        ctx.push(t);
        out.push(t);
    }
    out
}

#[test]
fn every_request_completes_with_the_tokens_it_would_get_alone() {
    let mut core = core(config(64, 16));
    let expected = add_mixed_requests(&mut core);
    let done = run_to_completion(&mut core);
    assert_eq!(done.len(), 20);
    for (id, (tokens, last)) in &done {
        assert_eq!(tokens, &expected[id], "{id}");
        assert_eq!(last.finish_reason, Some(FinishReason::Length));
    }
    let kv = core.scheduler().kv_cache_manager();
    assert_eq!(kv.num_free_blocks(), 64, "every block returned");
    assert_eq!(core.stats().num_running_reqs, 0);
}

#[test]
fn each_step_respects_token_budget_and_max_num_seqs() {
    let mut cfg = config(128, 16);
    cfg.max_num_batched_tokens = 40;
    cfg.max_num_seqs = 3;
    let mut core = core(cfg);
    for i in 0..10u32 {
        core.add_request(request(&format!("r{i}"), prompt(i, 25), 6, f64::from(i)))
            .unwrap();
    }
    let done = run_to_completion(&mut core);
    assert_eq!(done.len(), 10);
    for so in &core.executor().history {
        let sum: u32 = so.num_scheduled_tokens.values().sum();
        assert_eq!(sum, so.total_num_scheduled_tokens);
        assert!(so.total_num_scheduled_tokens <= 40);
        assert!(so.num_scheduled_tokens.len() <= 3);
    }
    // The budget is actually used: some step batches more than one request.
    assert!(
        core.executor()
            .history
            .iter()
            .any(|so| so.num_scheduled_tokens.len() > 1)
    );
}

#[test]
fn chunked_prefill_splits_a_long_prompt_across_steps() {
    let mut cfg = config(64, 16);
    cfg.max_num_batched_tokens = 32;
    let mut core = core(cfg);
    let p = prompt(1, 100);
    let expected = reference(&p, 3);
    core.add_request(request("long", p, 3, 0.0)).unwrap();

    let mut first_token_step = None;
    let mut step = 0;
    let mut tokens = Vec::new();
    while core.has_unfinished_requests() {
        for out in core.step().unwrap() {
            first_token_step.get_or_insert(step);
            tokens.extend(out.new_token_ids);
        }
        step += 1;
    }
    let chunks: Vec<u32> = core
        .executor()
        .history
        .iter()
        .map(|so| so.num_scheduled_tokens["long"])
        .collect();
    assert_eq!(chunks, vec![32, 32, 32, 4, 1, 1]);
    assert_eq!(first_token_step, Some(3), "no token before the last chunk");
    assert_eq!(tokens, expected);
}

#[test]
fn prompt_waits_for_a_full_budget_without_chunked_prefill() {
    let mut cfg = config(64, 16);
    cfg.enable_chunked_prefill = false;
    cfg.max_num_batched_tokens = 128;
    let mut core = core(cfg);
    core.add_request(request("a", prompt(1, 100), 4, 0.0))
        .unwrap();
    core.add_request(request("b", prompt(2, 100), 4, 1.0))
        .unwrap();
    core.step().unwrap();
    let first = &core.executor().history[0];
    assert_eq!(first.num_scheduled_tokens.len(), 1, "b must not be split");
    assert_eq!(first.num_scheduled_tokens["a"], 100);
    let done = run_to_completion(&mut core);
    assert_eq!(done.len(), 2);
}

#[test]
fn preemption_when_blocks_run_out_recomputes_to_identical_tokens() {
    // 12 blocks of 4 tokens; each request grows to 6 + 14 = 20 tokens = 5 blocks.
    let mut core = core(tight_config());
    let expected = add_growing_requests(&mut core);
    let done = run_to_completion(&mut core);
    let stats = core.stats();
    assert!(stats.num_preemptions > 0, "the test must preempt");
    for (id, (tokens, _)) in &done {
        assert_eq!(tokens, &expected[id], "{id}");
    }
    // The victims are the latest arrivals: r0 (earliest) is never preempted.
    let history = &core.executor().history;
    assert!(
        history
            .iter()
            .all(|so| !so.preempted_req_ids.contains(&"r0".to_string()))
    );
    assert!(history.iter().any(|so| {
        so.scheduled_cached_reqs
            .iter()
            .any(|c| c.resumed_from_preemption)
    }));
    assert_eq!(core.scheduler().kv_cache_manager().num_free_blocks(), 12);
}

#[test]
fn preemption_with_prefix_caching_resumes_from_cached_blocks() {
    let mut cfg = config(12, 4);
    cfg.max_model_len = 48;
    let mut core = core(cfg);
    let mut expected = HashMap::new();
    for i in 0..4u32 {
        let p = prompt(i, 9);
        expected.insert(format!("r{i}"), reference(&p, 11));
        core.add_request(request(&format!("r{i}"), p, 11, f64::from(i)))
            .unwrap();
    }
    let done = run_to_completion(&mut core);
    let stats = core.stats();
    assert!(stats.num_preemptions > 0);
    // Prompts share nothing, so every hit is a resumed request finding its own old blocks.
    assert!(stats.prefix_cache_hits > 0, "{stats:?}");
    for (id, (tokens, _)) in &done {
        assert_eq!(tokens, &expected[id], "{id}");
    }
}

#[test]
fn abort_frees_blocks_immediately_and_tells_workers() {
    let mut core = core(config(32, 16));
    core.add_request(request("a", prompt(1, 40), 50, 0.0))
        .unwrap();
    core.add_request(request("b", prompt(2, 10), 50, 1.0))
        .unwrap();
    core.step().unwrap();
    core.step().unwrap();
    let kv = core.scheduler().kv_cache_manager();
    assert_eq!(kv.block_ids("a").len(), 3);
    let free_before = kv.num_free_blocks();

    assert_eq!(core.abort(&["a", "nope"]), vec!["a".to_string()]);
    let kv = core.scheduler().kv_cache_manager();
    assert!(kv.block_ids("a").is_empty());
    assert_eq!(kv.num_free_blocks(), free_before + 3);
    assert!(core.scheduler().request("a").is_none());

    let outs = core.step().unwrap();
    assert!(outs.iter().all(|o| o.request_id == "b"));
    let last = core.executor().history.last().unwrap();
    assert_eq!(last.finished_req_ids, vec!["a".to_string()]);
    assert!(!last.num_scheduled_tokens.contains_key("a"));
    core.abort(&["b"]);
    assert_eq!(core.scheduler().kv_cache_manager().num_free_blocks(), 32);
    // The next step delivers the abort to the workers even with nothing to run.
    assert!(core.step().unwrap().is_empty());
    assert_eq!(
        core.executor().history.last().unwrap().finished_req_ids,
        vec!["b".to_string()]
    );
    assert!(core.executor().reqs.is_empty());
}

#[test]
fn shared_prefix_hits_the_prefix_cache_and_shares_blocks() {
    let mut core = core(config(32, 16));
    let shared = prompt(3, 32);
    let mut pa = shared.clone();
    pa.extend([901, 902, 903, 904, 905]);
    let mut pb = shared.clone();
    pb.extend([777, 778]);
    core.add_request(request("a", pa.clone(), 20, 0.0)).unwrap();
    core.step().unwrap(); // a's prefill computed: its two full prompt blocks are cached
    core.add_request(request("b", pb.clone(), 5, 1.0)).unwrap();
    core.step().unwrap();

    let so = core.executor().history.last().unwrap();
    let new_b = so
        .scheduled_new_reqs
        .iter()
        .find(|r| r.req_id == "b")
        .unwrap();
    assert_eq!(new_b.num_computed_tokens, 32);
    assert_eq!(so.num_scheduled_tokens["b"], 2);
    let kv = core.scheduler().kv_cache_manager();
    assert_eq!(&kv.block_ids("b")[..2], &kv.block_ids("a")[..2]);
    assert_eq!(kv.block_pool().ref_cnt(kv.block_ids("a")[0]), 2);
    let stats = core.stats();
    assert_eq!(stats.prefix_cache_queries, (pa.len() + pb.len()) as u64);
    assert_eq!(stats.prefix_cache_hits, 32);

    let done = run_to_completion(&mut core);
    assert_eq!(done["a"].0, reference(&pa, 20)[2..].to_vec());
    assert_eq!(done["b"].0, reference(&pb, 5)[1..].to_vec());
    assert_eq!(done["b"].1.num_cached_tokens, 32);
}

#[test]
fn max_model_len_stops_with_length() {
    let mut cfg = config(32, 16);
    cfg.max_model_len = 20;
    let mut core = core(cfg);
    let mut r = request("r", prompt(1, 15), 1, 0.0);
    r.sampling_params.max_tokens = None;
    core.add_request(r).unwrap();
    let done = run_to_completion(&mut core);
    let (tokens, last) = &done["r"];
    assert_eq!(tokens.len(), 5);
    assert_eq!(last.finish_reason, Some(FinishReason::Length));

    let too_long = request("x", prompt(1, 21), 1, 0.0);
    assert!(core.add_request(too_long).is_err());
}

#[test]
fn stop_token_ends_request_and_logprobs_pass_through() {
    let mut core = core(config(32, 16));
    let p = prompt(5, 10);
    let expected = reference(&p, 10);
    let mut r = request("r", p, 10, 0.0);
    r.sampling_params.stop_token_ids = vec![expected[3]];
    r.sampling_params.logprobs = Some(2);
    core.add_request(r).unwrap();
    let done = run_to_completion(&mut core);
    let (tokens, last) = &done["r"];
    assert_eq!(tokens, &expected[..4]);
    assert_eq!(last.finish_reason, Some(FinishReason::Stop));
    assert_eq!(
        last.stop_reason,
        Some(omni_protocol::StopReason::TokenId(expected[3]))
    );
    assert_eq!(last.new_logprobs.len(), 1);
    assert_eq!(last.new_logprobs[0].top.len(), 2);
}

#[test]
fn dead_worker_fails_every_request_and_frees_blocks() {
    let mut core = core(config(32, 16));
    core.executor_mut().fail_at_step = Some(2);
    core.add_request(request("a", prompt(1, 20), 10, 0.0))
        .unwrap();
    core.add_request(request("b", prompt(2, 20), 10, 1.0))
        .unwrap();
    core.step().unwrap();
    core.step().unwrap();
    let err = core.step().unwrap_err();
    assert!(matches!(err, EngineDeadError::Worker { rank: 0, .. }));
    let outs = core.fail_all();
    assert_eq!(outs.len(), 2);
    assert!(
        outs.iter()
            .all(|o| o.finish_reason == Some(FinishReason::Error))
    );
    assert!(!core.has_unfinished_requests());
    assert_eq!(core.scheduler().kv_cache_manager().num_free_blocks(), 32);
}

#[test]
fn duplicate_and_empty_requests_are_refused() {
    let mut core = core(config(32, 16));
    core.add_request(request("a", prompt(1, 5), 2, 0.0))
        .unwrap();
    assert!(
        core.add_request(request("a", prompt(1, 5), 2, 0.0))
            .is_err()
    );
    assert!(core.add_request(request("e", vec![], 2, 0.0)).is_err());
    let mut bad = request("t", prompt(1, 5), 2, 0.0);
    bad.sampling_params.top_p = 0.0;
    assert!(core.add_request(bad).is_err());
}

#[test]
fn waiting_requests_are_admitted_first_come_first_served() {
    let mut cfg = config(32, 16);
    cfg.max_num_seqs = 1;
    let mut core = core(cfg);
    for i in 0..3u32 {
        core.add_request(request(&format!("r{i}"), prompt(i, 5), 2, f64::from(i)))
            .unwrap();
    }
    let mut finish_order = Vec::new();
    while core.has_unfinished_requests() {
        assert!(core.stats().num_running_reqs <= 1);
        for out in core.step().unwrap() {
            if out.finished() {
                finish_order.push(out.request_id);
            }
        }
    }
    assert_eq!(finish_order, vec!["r0", "r1", "r2"]);
    let stats = core.stats();
    assert_eq!((stats.num_running_reqs, stats.num_waiting_reqs), (0, 0));
    assert_eq!(stats.kv_cache_usage, 0.0);
}

#[test]
fn request_waiting_behind_a_full_batch_reports_a_positive_queue_time() {
    let mut cfg = config(32, 16);
    cfg.max_num_seqs = 1;
    let mut core = core(cfg);
    for id in ["first", "second"] {
        let params = SamplingParams::greedy(3);
        core.add_request(EngineCoreRequest::new(id, prompt(1, 5), params, Some(0)))
            .unwrap();
    }
    let mut outputs: Vec<EngineCoreOutput> = core.step().unwrap();
    assert_eq!(core.stats().num_waiting_reqs, 1, "the batch is full");
    let wait = std::time::Duration::from_millis(20);
    std::thread::sleep(wait);
    while core.has_unfinished_requests() {
        outputs.extend(core.step().unwrap());
    }
    for id in ["first", "second"] {
        let mine: Vec<&EngineCoreOutput> = outputs.iter().filter(|o| o.request_id == id).collect();
        assert!(mine.len() >= 2, "{id}");
        assert!(mine[0].queue_time.is_some(), "{id}: first output has it");
        assert!(
            mine[1..].iter().all(|o| o.queue_time.is_none()),
            "{id}: reported once"
        );
    }
    let queued = |id: &str| {
        outputs
            .iter()
            .find_map(|o| (o.request_id == id).then_some(o.queue_time).flatten())
            .unwrap()
    };
    assert!(queued("first") >= 0.0);
    assert!(
        queued("second") >= wait.as_secs_f64(),
        "second waited out the first's whole run: {}",
        queued("second")
    );
}

/// Deterministic pseudo-random numbers for the randomized test.
struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

#[test]
fn random_arrivals_aborts_and_tight_caches_keep_every_invariant() {
    let mut rng = Lcg(7);
    let (mut preemptions, mut hits, mut aborts) = (0, 0, 0);
    let mut ahead_preemptions = 0;
    for round in 0..40 {
        let block_size = [1, 2, 4, 16][rng.below(4) as usize];
        let max_model_len = 24 + rng.below(40) as usize;
        let num_blocks = max_model_len.div_ceil(block_size) + rng.below(20) as usize;
        let cfg = SchedulerConfig {
            max_num_batched_tokens: 8 + rng.below(64) as usize,
            max_num_seqs: 1 + rng.below(6) as usize,
            max_model_len,
            block_size,
            num_blocks,
            enable_prefix_caching: rng.below(2) == 0,
            enable_chunked_prefill: true,
            // Every other round schedules a step ahead.
            async_scheduling: round % 2 == 1,
        };
        let mut core = core(cfg.clone());
        let mut expected: HashMap<String, Vec<TokenId>> = HashMap::new();
        let mut got: HashMap<String, Vec<TokenId>> = HashMap::new();
        let mut aborted = Vec::new();
        let mut next_id = 0;
        let mut steps = 0;
        while next_id < 12 || core.has_unfinished_requests() {
            steps += 1;
            assert!(steps < 5000, "round {round}: no progress");
            if next_id < 12 && rng.below(3) == 0 {
                let id = format!("r{next_id}");
                // Shared prefixes make prefix-cache hits likely.
                let mut p = prompt(rng.below(3) as u32, 1 + rng.below(20) as usize);
                p.push(rng.below(400) as TokenId + 10);
                let max_tokens = 1 + rng.below(20) as u32;
                let room = max_model_len - p.len();
                expected.insert(id.clone(), reference(&p, (max_tokens as usize).min(room)));
                core.add_request(request(&id, p, max_tokens, f64::from(next_id)))
                    .unwrap();
                next_id += 1;
            }
            if rng.below(25) == 0 && next_id > 0 {
                let id = format!("r{}", rng.below(next_id as u64));
                if core.abort(&[id.as_str()]) == vec![id.clone()] {
                    aborted.push(id);
                }
            }
            for out in core.step().unwrap() {
                got.entry(out.request_id.clone())
                    .or_default()
                    .extend(&out.new_token_ids);
            }
            let stats = core.stats();
            assert!(stats.num_running_reqs as usize <= cfg.max_num_seqs);
            assert!(stats.kv_cache_usage <= 1.0);
        }
        for so in &core.executor().history {
            assert!(so.total_num_scheduled_tokens as usize <= cfg.max_num_batched_tokens);
        }
        for (id, want) in &expected {
            let have = got.get(id).cloned().unwrap_or_default();
            if aborted.contains(id) {
                assert!(want.starts_with(&have), "round {round} {id}");
            } else {
                assert_eq!(&have, want, "round {round} {id} ({cfg:?})");
            }
        }
        assert_eq!(
            core.scheduler().kv_cache_manager().num_free_blocks(),
            cfg.num_blocks,
            "round {round}: blocks leaked"
        );
        preemptions += core.stats().num_preemptions;
        if cfg.async_scheduling {
            ahead_preemptions += core.stats().num_preemptions;
        }
        hits += core.stats().prefix_cache_hits;
        aborts += aborted.len();
    }
    // The rounds must exercise what they claim to.
    assert!(
        preemptions > 0 && ahead_preemptions > 0 && hits > 0 && aborts > 0,
        "{preemptions} {ahead_preemptions} {hits} {aborts}"
    );
}

/// A blocked running request (an omni stage waiting for upstream rows) gets no tokens and no
/// batch slot but keeps its blocks; unblocked, it resumes where it stopped.
#[test]
fn a_blocked_request_sits_out_steps_keeps_its_blocks_and_resumes() {
    use omni_core::Scheduler;
    let mut s = Scheduler::new(config(64, 4)).unwrap();
    s.add_request(request("a", prompt(1, 6), 8, 0.0)).unwrap();
    s.add_request(request("b", prompt(2, 6), 8, 1.0)).unwrap();
    let sampled = |so: &omni_protocol::SchedulerOutput| omni_protocol::ModelRunnerOutput {
        req_ids: so.num_scheduled_tokens.keys().cloned().collect(),
        sampled_token_ids: so.num_scheduled_tokens.keys().map(|_| vec![7]).collect(),
        logprobs: so.num_scheduled_tokens.keys().map(|_| Vec::new()).collect(),
        ..Default::default()
    };
    let first = s.schedule();
    assert_eq!(first.num_scheduled_tokens.len(), 2);
    s.update_from_output(&first, &sampled(&first));
    let usage = s.stats().kv_cache_usage;
    s.set_blocked("a", true);
    assert!(s.is_blocked("a"));
    // Both need a decode token; only b gets one while a is blocked.
    let second = s.schedule();
    assert_eq!(
        second.num_scheduled_tokens.keys().collect::<Vec<_>>(),
        ["b"]
    );
    s.update_from_output(&second, &sampled(&second));
    assert!(
        s.stats().kv_cache_usage >= usage,
        "a blocked request keeps its blocks"
    );
    s.set_blocked("a", false);
    assert!(!s.is_blocked("a"));
    let third = s.schedule();
    assert_eq!(third.num_scheduled_tokens.get("a"), Some(&1));
    // Unknown ids are ignored; an aborted request leaves the blocked set.
    s.set_blocked("nobody", true);
    assert!(!s.is_blocked("nobody"));
    s.set_blocked("a", true);
    s.abort_requests(["a"]);
    assert!(!s.is_blocked("a"));
}

/// The fake worker behind a pipeline of `depth` batches, as a pipeline-parallel executor: a
/// submitted batch runs at once (ranks run batches in order), its output waits to be collected.
struct Pipelined {
    inner: FakeWorker,
    depth: usize,
    queue: VecDeque<Result<ModelRunnerOutput, EngineDeadError>>,
    most_in_flight: usize,
}

impl Executor for Pipelined {
    fn execute_model(
        &mut self,
        _so: &SchedulerOutput,
        _buffers: &[&[u8]],
    ) -> Result<ModelRunnerOutput, EngineDeadError> {
        panic!("a pipelined engine core submits and collects");
    }

    fn max_concurrent_batches(&self) -> usize {
        self.depth
    }

    fn submit(&mut self, so: &SchedulerOutput, buffers: &[&[u8]]) -> Result<(), EngineDeadError> {
        assert!(
            self.queue.len() < self.depth,
            "more batches in flight than the depth"
        );
        let out = self.inner.execute_model(so, buffers);
        self.queue.push_back(out);
        self.most_in_flight = self.most_in_flight.max(self.queue.len());
        Ok(())
    }

    fn collect(&mut self) -> Result<ModelRunnerOutput, EngineDeadError> {
        self.queue
            .pop_front()
            .expect("collect without a batch in flight")
    }
}

fn pipelined(cfg: SchedulerConfig, depth: usize) -> EngineCore<Pipelined> {
    let inner = FakeWorker::new(cfg.num_blocks, cfg.block_size);
    let ex = Pipelined {
        inner,
        depth,
        queue: VecDeque::new(),
        most_in_flight: 0,
    };
    EngineCore::new(cfg, ex).unwrap()
}

#[test]
fn two_batches_in_flight_give_every_request_the_tokens_it_would_get_alone() {
    let mut core = pipelined(config(64, 16), 2);
    let expected = add_mixed_requests(&mut core);
    let done = run_to_completion(&mut core);
    assert_eq!(done.len(), 20);
    for (id, (tokens, _)) in &done {
        assert_eq!(tokens, &expected[id], "{id}");
    }
    assert_eq!(core.executor().most_in_flight, 2, "the pipeline must fill");
    // Batches in flight together never compute the same position of a request twice (a
    // decode waits for its token; a prefill's next chunk starts where the last one ended).
    let history = &core.executor().inner.history;
    for pair in history.windows(2) {
        for c in &pair[1].scheduled_cached_reqs {
            let again = pair[0]
                .scheduled_cached_reqs
                .iter()
                .any(|p| p.req_id == c.req_id && p.num_computed_tokens == c.num_computed_tokens);
            assert!(
                !again,
                "{} scheduled twice from position {}",
                c.req_id, c.num_computed_tokens
            );
        }
    }
    assert_eq!(core.scheduler().kv_cache_manager().num_free_blocks(), 64);
}

#[test]
fn preemption_with_batches_in_flight_recomputes_to_identical_tokens() {
    let mut core = pipelined(tight_config(), 2);
    let expected = add_growing_requests(&mut core);
    let done = run_to_completion(&mut core);
    assert!(core.stats().num_preemptions > 0, "the test must preempt");
    for (id, (tokens, _)) in &done {
        assert_eq!(tokens, &expected[id], "{id}");
    }
    assert_eq!(core.scheduler().kv_cache_manager().num_free_blocks(), 12);
}
