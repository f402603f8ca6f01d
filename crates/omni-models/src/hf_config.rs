//! Pieces of HF `config.json` that several architectures share: RoPE settings in both the
//! transformers 4 form (`rope_theta` + `rope_scaling`) and the transformers 5 form
//! (`rope_parameters`).

use omni_backend::rope::RopeScaling;
use serde_json::Value;

use crate::error::ModelError;

fn num(v: &Value, key: &str) -> Result<f32, ModelError> {
    v.get(key)
        .and_then(Value::as_f64)
        .map(|x| x as f32)
        .ok_or_else(|| ModelError::Config(format!("rope settings lack numeric `{key}`")))
}

/// RoPE base and scaling from the config's fields; `default_theta` when neither form gives one.
pub fn rope_settings(
    rope_theta: Option<f64>,
    rope_scaling: Option<&Value>,
    rope_parameters: Option<&Value>,
    default_theta: f64,
) -> Result<(f32, RopeScaling), ModelError> {
    let params = rope_parameters.or(rope_scaling).filter(|v| !v.is_null());
    let theta = params
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .or(rope_theta)
        .unwrap_or(default_theta) as f32;
    let Some(p) = params else {
        return Ok((theta, RopeScaling::None));
    };
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num(p, "factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num(p, "factor")?,
            low_freq_factor: num(p, "low_freq_factor")?,
            high_freq_factor: num(p, "high_freq_factor")?,
            original_max_position_embeddings: num(p, "original_max_position_embeddings")?,
        },
        other => {
            return Err(ModelError::Config(format!(
                "rope type `{other}` is not supported"
            )));
        }
    };
    Ok((theta, scaling))
}

/// Rejects activations other than SiLU.
pub fn require_silu(hidden_act: &str) -> Result<(), ModelError> {
    if hidden_act == "silu" {
        Ok(())
    } else {
        Err(ModelError::Config(format!(
            "hidden_act `{hidden_act}` is not supported (silu is)"
        )))
    }
}

pub(crate) fn default_theta() -> f64 {
    10000.0
}

pub(crate) fn default_act() -> String {
    "silu".into()
}

pub(crate) fn default_eps() -> f64 {
    1e-6
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn both_config_generations_give_the_same_rope() {
        let v4 = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let mut v5 = v4.clone();
        v5["rope_theta"] = serde_json::json!(500000.0);
        let a = rope_settings(Some(500000.0), Some(&v4), None, 1.0).unwrap();
        let b = rope_settings(None, None, Some(&v5), 1.0).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            rope_settings(None, None, None, 10000.0).unwrap(),
            (10000.0, RopeScaling::None)
        );
        let bad = serde_json::json!({"rope_type": "yarn", "factor": 2.0});
        assert!(rope_settings(None, Some(&bad), None, 1.0).is_err());
    }
}
