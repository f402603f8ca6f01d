//! `omni-engine stage`: one replica of an omni pipeline's stage (`omni-stage-<id>`), started by
//! `serve --omni`, never by hand. Like the engine-core process it reads its whole
//! configuration (a `StageSpec`) from one JSON line on stdin, answers one line on stdout, then
//! serves the two queues that line names; logs go to stderr; it dies with its parent.

/// `omni-engine stage` takes no flags: its spec comes in the handshake.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Args {}

/// Serves the stage until the pipeline stops it (or dies).
pub fn run(_args: Args) -> anyhow::Result<()> {
    omni_stage::run_stage_process()?;
    Ok(())
}
