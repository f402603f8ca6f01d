//! The built-in default model (SmolLM2-135M-Instruct, Q4_1 GGUF) answers a factual question
//! through the chat template. Skipped, with a printed reason, when the model is not cached
//! (fetch it with `scripts/fetch-default-model.sh`).

#![allow(clippy::unwrap_used)]

#[path = "engine_common.rs"]
mod common;

use common::*;

#[test]
fn default_model_says_paris_is_the_capital_of_france() {
    let Some(path) = omni_gguf::default_model::locate() else {
        println!(
            "SKIPPED: default model not cached at {} (run scripts/fetch-default-model.sh)",
            omni_gguf::default_model::cached_path().display()
        );
        return;
    };
    let mut args = s(&["--model"]);
    args.push(path.display().to_string());
    args.extend(s(&[
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
    ]));
    let (gens, stderr) = generate(&args);
    assert!(
        gens[0].text.contains("Paris"),
        "{:?}\n{stderr}",
        gens[0].text
    );
}
