//! The omni-engine binary. One executable for every process role: the subcommand picks it
//! (`serve`, `generate`, `bench ...`; hidden: `engine-core` and `worker`, spawned by the
//! engine itself).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

mod bench_cmd;
mod bench_code2wav;
mod bench_latency;
mod bench_talker;
mod bench_thinker;
mod engine_adapter;
mod engine_core_cmd;
mod generate_cmd;
mod headless;
mod serve_cmd;
mod serve_omni;
mod signals;
mod stage_cmd;
mod worker_cmd;

/// omni-engine: an LLM and omni-model serving engine.
#[derive(Debug, Parser)]
#[command(name = "omni-engine", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmarks: `bench ipc` (the broadcast queue), `bench serve` (an OpenAI server).
    Bench(BenchArgs),
    /// Offline inference: generate continuations for prompts (vLLM's `LLM.generate`).
    Generate(generate_cmd::Args),
    /// The OpenAI-compatible API server (vLLM's `vllm serve`).
    Serve(serve_cmd::Args),
    /// The engine-core process (spawned by `serve --enable-multiprocessing`, not by hand).
    #[command(hide = true)]
    EngineCore(engine_core_cmd::Args),
    /// A stage of an omni pipeline (spawned by `serve --omni`, not by hand).
    #[command(hide = true)]
    Stage(stage_cmd::Args),
    /// A tensor-parallel worker process (spawned by the engine core, not by hand).
    #[command(hide = true)]
    Worker(worker_cmd::Args),
}

#[derive(Debug, Args)]
struct BenchArgs {
    #[command(subcommand)]
    which: bench_cmd::BenchCommand,
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn main() -> anyhow::Result<()> {
    init_logging();
    // defaults < --config FILE < environment < command line (omni-config's layering), then one
    // parse: every value goes through the same parser and the same validation.
    let argv = generate_cmd::normalize_args(std::env::args());
    let argv = omni_config::layered_argv(argv, &Cli::command(), std::env::vars())?;
    let matches = omni_config::override_self(Cli::command()).get_matches_from(argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Bench(b) => {
            signals::remove_segments_on_signals()?;
            bench_cmd::run(b.which)
        }
        Command::Generate(a) => {
            signals::remove_segments_on_signals()?;
            generate_cmd::run(a)
        }
        Command::Serve(a) => serve_cmd::run(a),
        Command::EngineCore(a) => engine_core_cmd::run(a),
        Command::Stage(a) => stage_cmd::run(a),
        Command::Worker(a) => worker_cmd::run(a),
    }
}

/// This executable's path, for spawning child processes of other roles.
/// `serve`'s clap command (the flags a deploy profile's stage keys name).
pub fn serve_command() -> clap::Command {
    Cli::command()
        .find_subcommand("serve")
        .cloned()
        .unwrap_or_else(|| clap::Command::new("serve"))
}

/// This `serve` process's engine config with one deploy-profile stage's keys as a layer
/// between the `--config` file and the environment (omni-config's `layered_argv_with`).
pub fn stage_engine_config(stage_args: &[String]) -> anyhow::Result<omni_config::EngineConfig> {
    let argv = generate_cmd::normalize_args(std::env::args());
    let argv = omni_config::layered_argv_with(argv, &Cli::command(), std::env::vars(), stage_args)?;
    let matches = omni_config::override_self(Cli::command()).try_get_matches_from(argv)?;
    match Cli::from_arg_matches(&matches)?.command {
        Command::Serve(a) => {
            let mut e = a.engine;
            if let Some(m) = a.model_tag {
                e.model.model = Some(m);
            }
            Ok(e)
        }
        _ => anyhow::bail!("a stage's engine config is resolved only under `serve`"),
    }
}

pub fn current_exe() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("locating the omni-engine executable")
}
