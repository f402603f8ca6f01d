//! The layers of configuration, merged once before clap parses: defaults < `--config FILE`
//! < environment < command line.
//!
//! As vLLM does with `--config`, the file's keys are the long flag names (`max-model-len`, or
//! `max_model_len`) and become flags placed before the command line; each environment variable
//! of [`ENV_FLAGS`] becomes its flag placed after the file's and before the command line. With
//! clap's `args_override_self` (see [`override_self`]) the last occurrence of a flag wins, so
//! the command line beats the environment, which beats the file, which beats the defaults.
//! Every value then goes through the same clap parser and the same validation.
//!
//! ```
//! # use omni_config::{layered_argv, EngineConfig};
//! # use clap::{Args, Command};
//! let cmd = EngineConfig::augment_args(Command::new("serve").arg(
//!     clap::Arg::new("config").long("config")));
//! let argv = layered_argv(
//!     ["serve".to_string(), "--max-model-len".into(), "512".into()].to_vec(),
//!     &cmd,
//!     [("VLLM_MQ_MAX_CHUNK_BYTES_MB".to_string(), "100".to_string())],
//! ).unwrap();
//! assert_eq!(argv, ["serve", "--mq-max-chunk-bytes-mb", "100", "--max-model-len", "512"]);
//! ```

use std::path::{Path, PathBuf};

use clap::{ArgAction, Command};

use crate::Error;

/// Environment variables that stand for a flag: (variable, long flag). This is the registry of
/// every variable the engine reads; nothing else reads the environment. `VLLM_*` keep vLLM's
/// names; our own are `OMNI_<AREA>_<NAME>`.
pub const ENV_FLAGS: &[(&str, &str)] = &[
    ("VLLM_MQ_MAX_CHUNK_BYTES_MB", "mq-max-chunk-bytes-mb"),
    ("OMNI_IPC_MAX_CHUNKS", "ipc-max-chunks"),
    ("OMNI_IPC_SPIN_US", "ipc-spin-us"),
    ("OMNI_IPC_WARN_INTERVAL_S", "ipc-warn-interval-s"),
    ("OMNI_CACHE_DIR", "cache-dir"),
    ("OMNI_CUDA_PROFILE", "cuda-profile-steps"),
    ("OMNI_STAGE_PROFILE_INTERVAL_S", "stage-profile-interval-s"),
    ("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "timeout-keep-alive"),
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "enable-multiprocessing"),
    ("VLLM_HOST_IP", "host-ip"),
    ("VLLM_IMAGE_FETCH_TIMEOUT", "image-fetch-timeout"),
    ("VLLM_AUDIO_FETCH_TIMEOUT", "audio-fetch-timeout"),
    ("VLLM_VIDEO_FETCH_TIMEOUT", "video-fetch-timeout"),
    (
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
        "media-url-allow-redirects",
    ),
    (
        "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB",
        "max-media-download-size-mb",
    ),
    (
        "VLLM_MEDIA_EGRESS_BLOCK_PRIVATE",
        "media-egress-block-private",
    ),
    ("VLLM_MAX_IMAGE_PIXELS", "max-image-pixels"),
    (
        "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB",
        "max-audio-clip-filesize-mb",
    ),
    (
        "VLLM_MAX_AUDIO_DECODE_DURATION_S",
        "max-audio-decode-duration-s",
    ),
];

/// `cmd` and all its subcommands with `args_override_self`: a flag given twice takes the last
/// value (what makes the layering of [`layered_argv`] work).
pub fn override_self(cmd: Command) -> Command {
    let names: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    let mut cmd = cmd.args_override_self(true);
    for n in names {
        cmd = cmd.mut_subcommand(n, override_self);
    }
    cmd
}

/// Rewrites `argv` (program name first, as `std::env::args` gives it) so that clap sees the
/// `--config` file's flags, then the environment's, then the command line's. `root` is the
/// program's clap command; `env` the process environment (only [`ENV_FLAGS`] are read, and only
/// for a flag the chosen subcommand has).
pub fn layered_argv(
    argv: Vec<String>,
    root: &Command,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Vec<String>, Error> {
    layered_argv_with(argv, root, env, &[])
}

/// [`layered_argv`] with one more layer between the `--config` file and the environment:
/// `stage_args`, the flags a deploy profile gives one stage ([`crate::StageDeployConfig`]).
pub fn layered_argv_with(
    argv: Vec<String>,
    root: &Command,
    env: impl IntoIterator<Item = (String, String)>,
    stage_args: &[String],
) -> Result<Vec<String>, Error> {
    let mut it = argv.into_iter();
    let mut prefix: Vec<String> = it.next().into_iter().collect();
    let mut rest: Vec<String> = it.collect();
    let mut leaf = root.clone();
    while let Some(first) = rest.first() {
        match leaf.find_subcommand(first).cloned() {
            Some(sub) => {
                prefix.push(rest.remove(0));
                leaf = sub;
            }
            None => break,
        }
    }
    let file_args = match config_path(&rest) {
        Some(path) => file_to_args(&path, &leaf)?,
        None => Vec::new(),
    };
    let env_args = env_to_args(env, &leaf)?;
    Ok(prefix
        .into_iter()
        .chain(file_args)
        .chain(stage_args.iter().cloned())
        .chain(env_args)
        .chain(rest)
        .collect())
}

/// The value of `--config FILE` / `--config=FILE` on the command line.
fn config_path(args: &[String]) -> Option<PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--" {
            return None;
        }
        if a == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(v) = a.strip_prefix("--config=") {
            return Some(PathBuf::from(v));
        }
    }
    None
}

pub(crate) fn find_long<'a>(cmd: &'a Command, name: &str) -> Option<&'a clap::Arg> {
    cmd.get_arguments().find(|a| {
        a.get_long() == Some(name) || a.get_all_aliases().is_some_and(|al| al.contains(&name))
    })
}

fn takes_value(arg: &clap::Arg) -> bool {
    !matches!(
        arg.get_action(),
        ArgAction::SetTrue | ArgAction::SetFalse | ArgAction::Count
    )
}

fn env_to_args(
    env: impl IntoIterator<Item = (String, String)>,
    leaf: &Command,
) -> Result<Vec<String>, Error> {
    let env: Vec<(String, String)> = env.into_iter().collect();
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (var, flag) in ENV_FLAGS {
        let Some((_, value)) = env.iter().find(|(k, _)| k == var) else {
            continue;
        };
        if find_long(leaf, flag).is_none() {
            continue;
        }
        let args = [format!("--{flag}"), value.clone()];
        // Checked alone first, so a bad value names the variable, not the flag.
        let mut probe = leaf.clone().no_binary_name(true).ignore_errors(false);
        if let Err(e) = probe.try_get_matches_from_mut(args.iter())
            && e.kind() != clap::error::ErrorKind::MissingRequiredArgument
        {
            problems.push(format!(
                "environment variable {var}={value:?}: {}",
                first_line(&e.to_string())
            ));
            continue;
        }
        out.extend(args);
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(Error::Invalid(problems))
    }
}

fn first_line(s: &str) -> &str {
    s.lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or(s)
        .trim_start_matches("error: ")
}

/// The flags a `--config` YAML file stands for.
fn file_to_args(path: &Path, leaf: &Command) -> Result<Vec<String>, Error> {
    let bad = |message: String| Error::ConfigFile {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let doc: serde_norway::Value = serde_norway::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = match doc {
        serde_norway::Value::Mapping(m) => m,
        serde_norway::Value::Null => return Ok(Vec::new()),
        _ => return Err(bad("expected a mapping of flag names to values".into())),
    };
    let (out, problems) = mapping_to_args(map, leaf, &|_| false);
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(bad(problems.join("; ")))
    }
}

/// The flags a mapping of long flag names (`max-model-len` or `max_model_len`) to values stands
/// for, and a problem per key that names no flag of `leaf` (unless `skip(key)`) or has a value
/// the flag cannot take.
pub(crate) fn mapping_to_args(
    map: serde_norway::Mapping,
    leaf: &Command,
    skip: &dyn Fn(&str) -> bool,
) -> (Vec<String>, Vec<String>) {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (k, v) in map {
        let Some(key) = k.as_str() else {
            problems.push(format!("key {k:?} is not a string"));
            continue;
        };
        if skip(key) {
            continue;
        }
        let name = key.replace('_', "-");
        if name == "config" {
            problems.push("a config file cannot name another (`config`)".into());
            continue;
        }
        let Some(arg) = find_long(leaf, &name) else {
            problems.push(format!(
                "unknown key `{key}`: `{}` has no flag --{name}",
                leaf.get_name()
            ));
            continue;
        };
        let flag = format!("--{}", arg.get_long().unwrap_or(&name));
        match value_args(&flag, arg, leaf, &v) {
            Ok(a) => out.extend(a),
            Err(m) => problems.push(format!("key `{key}`: {m}")),
        }
    }
    (out, problems)
}

fn scalar(v: &serde_norway::Value) -> Option<String> {
    match v {
        serde_norway::Value::String(s) => Some(s.clone()),
        serde_norway::Value::Number(n) => Some(n.to_string()),
        serde_norway::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn value_args(
    flag: &str,
    arg: &clap::Arg,
    leaf: &Command,
    v: &serde_norway::Value,
) -> Result<Vec<String>, String> {
    use serde_norway::Value;
    if !takes_value(arg) {
        return match v {
            Value::Bool(true) => Ok(vec![flag.to_string()]),
            // `false` for an on/off pair turns the feature off (`--no-<flag>`), else it is the
            // default already.
            Value::Bool(false) => {
                let no = format!("no-{}", flag.trim_start_matches("--"));
                Ok(find_long(leaf, &no)
                    .map(|_| vec![format!("--{no}")])
                    .unwrap_or_default())
            }
            _ => Err("expected true or false".into()),
        };
    }
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Sequence(items) => {
            let mut out = vec![flag.to_string()];
            for i in items {
                out.push(scalar(i).ok_or("list items must be scalars")?);
            }
            Ok(out)
        }
        Value::Mapping(_) => {
            // JSON-valued flags (vLLM takes dicts as JSON strings).
            let json = serde_json::to_string(v).map_err(|e| e.to_string())?;
            Ok(vec![flag.to_string(), json])
        }
        other => Ok(vec![
            flag.to_string(),
            scalar(other).ok_or("unsupported value")?,
        ]),
    }
}
