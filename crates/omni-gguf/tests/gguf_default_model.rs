//! Reads the real default model (SmolLM2-135M-Instruct Q4_1) and checks values against an
//! independent reference (Python `gguf` dequantization + numpy un-permutation).
//! Skips, with a printed reason, when the model has not been fetched
//! (`scripts/fetch-default-model.sh`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic on failure

use omni_gguf::{GgmlType, GgufFile, default_model};

fn open_default() -> Option<GgufFile> {
    match default_model::locate() {
        Some(path) => Some(GgufFile::open(path).expect("default model parses")),
        None => {
            eprintln!(
                "SKIP: default model not at {} (run scripts/fetch-default-model.sh)",
                default_model::cached_path().display()
            );
            None
        }
    }
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * (1.0 + b.abs())
}

/// Values printed by numpy to 8 significant digits.
fn assert_near(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!(close(f64::from(*g), *w, 1e-6), "{got:?} vs {want:?}");
    }
}

fn row_weighted_sum(data: &[f32], cols: usize) -> f64 {
    data.chunks(cols)
        .enumerate()
        .map(|(r, row)| r as f64 * row.iter().map(|&v| f64::from(v)).sum::<f64>())
        .sum()
}

#[test]
fn default_model_header_and_config_match_smollm2() {
    let Some(f) = open_default() else { return };
    assert_eq!(f.version(), 3);
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(
        f.tensor("token_embd.weight").unwrap().ggml_type,
        GgmlType::Q8_0
    );
    assert_eq!(
        f.tensor("blk.0.attn_q.weight").unwrap().ggml_type,
        GgmlType::Q4_1
    );
    let c = f.hf_config().unwrap();
    assert_eq!(c["architectures"][0], "LlamaForCausalLM");
    assert_eq!(c["hidden_size"], 576);
    assert_eq!(c["intermediate_size"], 1536);
    assert_eq!(c["num_hidden_layers"], 30);
    assert_eq!(c["num_attention_heads"], 9);
    assert_eq!(c["num_key_value_heads"], 3);
    assert_eq!(c["head_dim"], 64);
    assert_eq!(c["rms_norm_eps"], 1e-5);
    assert_eq!(c["rope_theta"], 100000.0);
    assert_eq!(c["max_position_embeddings"], 8192);
    assert_eq!(c["vocab_size"], 49152);
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["bos_token_id"], 1);
    assert_eq!(c["eos_token_id"], 2);
    let names = f.hf_tensor_names();
    assert_eq!(names.len(), 272);
    assert!(names.contains(&"model.layers.29.mlp.down_proj.weight".to_string()));
}

#[test]
fn default_model_tensors_match_reference_dequantization() {
    let Some(f) = open_default() else { return };
    let e = f.load_hf_tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(e.shape, [49152, 576]);
    assert_near(
        &e.data[..4],
        &[-0.10654449, 0.03297806, 0.0481987, -0.02283096],
    );
    let total: f64 = e.data.iter().map(|&v| f64::from(v)).sum();
    assert!(close(total, -15353.04449415207, 1e-6), "{total}");

    let q = f
        .load_hf_tensor("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(q.shape, [576, 576]);
    let col0: Vec<f32> = (0..3).map(|r| q.data[r * 576]).collect();
    assert_near(&col0, &[-0.09631348, -0.15917969, -0.109375]);
    assert!(close(
        row_weighted_sum(&q.data, 576),
        25876.190353393555,
        1e-6
    ));

    let k = f
        .load_hf_tensor("model.layers.5.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(k.shape, [192, 576]);
    assert_near(
        &k.data[33 * 576..33 * 576 + 3],
        &[0.08666992, 0.19094849, 0.15618896],
    );
    assert!(close(
        row_weighted_sum(&k.data, 576),
        -8739.433166503906,
        1e-6
    ));

    let down = f
        .load_hf_tensor("model.layers.29.mlp.down_proj.weight")
        .unwrap();
    assert_eq!(down.shape, [576, 1536]);
    assert_near(
        &down.data[7 * 1536..7 * 1536 + 3],
        &[0.30670166, 0.043396, -0.21990967],
    );
    let norm = f.load_hf_tensor("model.norm.weight").unwrap();
    assert_near(&norm.data[..3], &[1.7578125, 1.8203125, 1.78125]);
}
