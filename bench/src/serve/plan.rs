//! What `bench serve`'s options resolve to: the protocol (completions, chat, or vLLM-Omni's
//! `openai-chat-omni`), the body template of every request, the sections of the result block,
//! and the dataset's samples.

use omni_tokenizer::Tokenizer;

use super::{
    Backend, DatasetName, PERCENTILE_METRICS, RequestSpec, SampleRequest, ServeBenchArgs,
    ServeBenchError, dataset, random_mm, seed_tts,
};

/// `--percentile-metrics` unless given (vLLM's default; vLLM-Omni's block with `--omni`).
const DEFAULT_METRICS: &str = "ttft,tpot,itl";
const DEFAULT_OMNI_METRICS: &str = "ttft,tpot,itl,e2el,audio_ttfp,audio_rtf";

/// What the options resolve to: the protocol, the body template and the sections to print.
#[derive(Debug)]
pub(super) struct Plan {
    pub endpoint: String,
    pub spec: RequestSpec,
    pub metrics: Vec<String>,
}

pub(super) fn plan(args: &ServeBenchArgs) -> Result<Plan, ServeBenchError> {
    if args.request_rate.is_nan() || args.request_rate <= 0.0 {
        return Err(ServeBenchError::Args("--request-rate must be > 0".into()));
    }
    if args.max_concurrency == Some(0) {
        return Err(ServeBenchError::Args(
            "--max-concurrency must be >= 1".into(),
        ));
    }
    let omni = args.omni || args.backend == Some(Backend::OpenaiChatOmni);
    let chat = omni
        || match args.backend {
            Some(Backend::OpenaiChat) => true,
            Some(_) => false,
            None => args.endpoint.as_deref().is_some_and(|e| e.contains("chat")),
        };
    let endpoint = args.endpoint.clone().unwrap_or_else(|| {
        if chat {
            "/v1/chat/completions".into()
        } else {
            "/v1/completions".into()
        }
    });
    if args.dataset == DatasetName::RandomMm && (!chat || omni) {
        return Err(ServeBenchError::Args(
            "--dataset-name random-mm needs the chat backend (--backend openai-chat)".into(),
        ));
    }
    if chat != endpoint.contains("chat") {
        return Err(ServeBenchError::Args(format!(
            "--endpoint {endpoint} does not fit the {} protocol",
            if chat { "chat" } else { "completions" }
        )));
    }
    let extra_body = match &args.extra_body {
        None => serde_json::Map::new(),
        Some(text) => match serde_json::from_str(text) {
            Ok(serde_json::Value::Object(m)) => m,
            Ok(_) => {
                return Err(ServeBenchError::Args(
                    "--extra-body must be a JSON object".into(),
                ));
            }
            Err(e) => return Err(ServeBenchError::Args(format!("--extra-body: {e}"))),
        },
    };
    let fixed_lengths = match args.omni_fixed_lengths.as_deref() {
        None => None,
        Some(&[tokens, frames]) if omni && tokens > 0 && frames > 0 => Some((tokens, frames)),
        Some(_) => {
            return Err(ServeBenchError::Args(
                "--omni-fixed-lengths takes THINKER_TOKENS,TALKER_FRAMES (both >= 1) with --omni"
                    .into(),
            ));
        }
    };
    let metrics: Vec<String> = match &args.percentile_metrics {
        Some(m) => m.iter().map(|x| x.trim().to_string()).collect(),
        None => {
            let d = if omni {
                DEFAULT_OMNI_METRICS
            } else {
                DEFAULT_METRICS
            };
            d.split(',').map(String::from).collect()
        }
    };
    if let Some(bad) = metrics
        .iter()
        .find(|m| !PERCENTILE_METRICS.contains(&m.as_str()))
    {
        return Err(ServeBenchError::Args(format!(
            "--percentile-metrics: unknown {bad:?}; known: {}",
            PERCENTILE_METRICS.join(",")
        )));
    }
    Ok(Plan {
        endpoint,
        spec: RequestSpec {
            model: String::new(),
            chat,
            omni,
            ignore_eos: args.ignore_eos,
            fixed_lengths,
            extra_body,
        },
        metrics,
    })
}

pub(super) fn samples(
    args: &ServeBenchArgs,
    tokenizer: Option<&Tokenizer>,
) -> Result<Vec<SampleRequest>, ServeBenchError> {
    match args.dataset {
        DatasetName::RandomMm => {
            let buckets = random_mm::parse_buckets(&args.random_mm_bucket_config)?;
            let mut samples = dataset::random(
                tokenizer,
                args.num_prompts,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                args.random_prefix_len,
                args.seed,
            )?;
            for (i, s) in samples.iter_mut().enumerate() {
                s.images = random_mm::request_images(
                    &buckets,
                    args.random_mm_base_items_per_request,
                    args.seed,
                    i,
                )?;
            }
            Ok(samples)
        }
        DatasetName::Random => dataset::random(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        ),
        DatasetName::Sharegpt => {
            let path = args.dataset_path.as_deref().ok_or_else(|| {
                ServeBenchError::Args("--dataset sharegpt needs --dataset-path".into())
            })?;
            dataset::sharegpt(path, tokenizer, args.num_prompts, args.seed)
        }
        DatasetName::SeedTts => match args.dataset_path.as_deref() {
            Some(path) => seed_tts::from_meta(
                path,
                tokenizer,
                args.num_prompts,
                args.seed_tts_output_len,
                args.seed,
            ),
            None => seed_tts::generated(
                tokenizer,
                args.num_prompts,
                args.seed_tts_prompt_len,
                args.seed_tts_output_len,
                args.seed,
            ),
        },
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeBenchArgs,
    }

    fn plan_of(argv: &[&str]) -> Result<Plan, ServeBenchError> {
        let mut all = vec!["bench"];
        all.extend_from_slice(argv);
        plan(&Cli::try_parse_from(all).unwrap().serve)
    }

    #[test]
    fn omni_flags_pick_chat_and_the_audio_sections() {
        let p = plan_of(&["--omni"]).unwrap();
        assert_eq!(p.endpoint, "/v1/chat/completions");
        assert!(p.spec.omni && p.spec.chat);
        assert_eq!(
            p.metrics,
            DEFAULT_OMNI_METRICS.split(',').collect::<Vec<_>>()
        );
        let p = plan_of(&[
            "--backend",
            "openai-chat-omni",
            "--endpoint",
            "/v1/chat/completions",
            "--percentile-metrics",
            "ttft,audio_ttfp,audio_rtf,audio_duration",
            "--omni-fixed-lengths",
            "64,144",
            "--extra-body",
            r#"{"speaker": "chelsie"}"#,
            "--dataset-name",
            "seed-tts",
        ])
        .unwrap();
        assert!(p.spec.omni);
        assert_eq!(p.spec.fixed_lengths, Some((64, 144)));
        assert_eq!(p.spec.extra_body["speaker"], "chelsie");
        let p = plan_of(&["--backend", "openai"]).unwrap();
        assert_eq!(p.endpoint, "/v1/completions");
        assert!(!p.spec.chat && !p.spec.omni);
        assert_eq!(p.metrics, ["ttft", "tpot", "itl"]);
        let p = plan_of(&["--dataset-name", "random-mm", "--backend", "openai-chat"]).unwrap();
        assert!(p.spec.chat && !p.spec.omni);
        assert!(
            plan_of(&["--endpoint", "/v1/chat/completions"])
                .unwrap()
                .spec
                .chat
        );
        for bad in [
            &["--omni", "--endpoint", "/v1/completions"][..],
            &["--omni", "--extra-body", "[1]"],
            &["--omni", "--omni-fixed-lengths", "64"],
            &["--omni-fixed-lengths", "64,144"],
            &["--percentile-metrics", "ttft,audio_ttft"],
            &["--dataset-name", "random-mm"],
            &["--dataset-name", "random-mm", "--omni"],
        ] {
            assert!(plan_of(bad).is_err(), "{bad:?}");
        }
    }
}
