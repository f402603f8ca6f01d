//! The command and the layering both config tests parse through: `serve` with `--config` and
//! every `EngineConfig` flag, argv from `layered_argv`, one clap parse.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;

use clap::{Args, Command, FromArgMatches};
use omni_config::{EngineConfig, Error, layered_argv, override_self};

pub fn command() -> Command {
    override_self(EngineConfig::augment_args(
        Command::new("serve").arg(
            clap::Arg::new("config")
                .long("config")
                .value_parser(clap::value_parser!(PathBuf)),
        ),
    ))
}

pub fn resolve(cli: &[&str], env: &[(&str, &str)]) -> Result<EngineConfig, Error> {
    let argv = std::iter::once("serve")
        .chain(cli.iter().copied())
        .map(String::from)
        .collect();
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    let argv = layered_argv(argv, &command(), env)?;
    let m = command()
        .try_get_matches_from(argv)
        .map_err(|e| Error::Invalid(vec![e.to_string()]))?;
    Ok(EngineConfig::from_arg_matches(&m).unwrap())
}

/// A temporary directory removed on drop (no extra dependency for one test file).
pub mod tempdir {
    pub struct Dir(std::path::PathBuf);
    impl Dir {
        pub fn new() -> Self {
            let p = std::env::temp_dir().join(format!(
                "omni-config-test-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
        pub fn path(&self) -> &std::path::Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
