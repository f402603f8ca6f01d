//! `--enable-multiprocessing` (the engine core in its own process) from the command line, the
//! environment (`VLLM_ENABLE_V1_MULTIPROCESSING`, vLLM's name and values) and a config file.
#![allow(clippy::unwrap_used)]

mod common;

use common::resolve;
use omni_config::EngineConfig;

fn mp(cli: &[&str], env: &[(&str, &str)]) -> bool {
    resolve(cli, env).unwrap().parallel.enable_multiprocessing
}

#[test]
fn the_engine_core_runs_on_a_thread_unless_asked() {
    assert!(!EngineConfig::default().parallel.enable_multiprocessing);
    assert!(!mp(&[], &[]));
}

#[test]
fn the_flag_alone_or_with_a_value_turns_it_on_or_off() {
    assert!(mp(&["--enable-multiprocessing"], &[]));
    assert!(mp(
        &["--enable-multiprocessing", "--max-model-len", "64"],
        &[]
    ));
    assert!(mp(&["--enable-multiprocessing=true"], &[]));
    assert!(!mp(&["--enable-multiprocessing=0"], &[]));
    assert!(!mp(&["--enable-multiprocessing", "false"], &[]));
}

#[test]
fn vllms_environment_variable_sets_it_and_the_command_line_wins() {
    let on = [("VLLM_ENABLE_V1_MULTIPROCESSING", "1")];
    let off = [("VLLM_ENABLE_V1_MULTIPROCESSING", "0")];
    assert!(mp(&[], &on));
    assert!(!mp(&[], &off));
    assert!(mp(&["--enable-multiprocessing"], &off));
    assert!(!mp(&["--enable-multiprocessing=false"], &on));
    let err = resolve(&[], &[("VLLM_ENABLE_V1_MULTIPROCESSING", "maybe")]).unwrap_err();
    assert!(
        err.to_string().contains("VLLM_ENABLE_V1_MULTIPROCESSING"),
        "{err}"
    );
}

#[test]
fn a_config_file_sets_it() {
    let dir = std::env::temp_dir().join(format!("omni-config-mp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("cfg.yaml");
    std::fs::write(&file, "enable-multiprocessing: true\n").unwrap();
    let path = file.display().to_string();
    let on = mp(&["--config", &path], &[]);
    std::fs::write(&file, "enable_multiprocessing: false\n").unwrap();
    let off = mp(
        &["--config", &path],
        &[("VLLM_ENABLE_V1_MULTIPROCESSING", "0")],
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(on);
    assert!(!off);
}
