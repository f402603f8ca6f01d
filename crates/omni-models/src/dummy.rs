//! Random weights from a config alone (`--load-format dummy`): deterministic for a seed and a
//! tensor name, so every tensor-parallel rank sees the same full tensor and slices its part.

use std::collections::BTreeMap;

use crate::weights::{HostTensor, WeightError, WeightSource};

/// Deterministic random weights for a fixed table of names and shapes.
///
/// Norm weights (`*norm.weight`) are near 1; everything else is uniform in
/// `[-1/sqrt(fan_in), 1/sqrt(fan_in)]` so activations stay finite through deep stacks.
#[derive(Debug, Clone)]
pub struct DummyWeights {
    shapes: BTreeMap<String, Vec<usize>>,
    seed: u64,
}

impl DummyWeights {
    /// A source holding exactly these tensors.
    pub fn new(shapes: impl IntoIterator<Item = (String, Vec<usize>)>, seed: u64) -> Self {
        Self {
            shapes: shapes.into_iter().collect(),
            seed,
        }
    }
}

/// SplitMix64: a tiny, well-mixed, stable generator (no dependency, same stream on every build).
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl WeightSource for DummyWeights {
    fn tensor_names(&self) -> Vec<String> {
        self.shapes.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, WeightError> {
        self.shapes
            .get(name)
            .cloned()
            .ok_or_else(|| WeightError::Missing { name: name.into() })
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let shape = self.shape(name)?;
        let n: usize = shape.iter().product();
        let mut state = self.seed ^ fnv1a(name);
        let unit = |s: &mut u64| (splitmix64(s) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        let data = if name.ends_with("norm.weight") {
            (0..n).map(|_| 1.0 + 0.1 * unit(&mut state)).collect()
        } else {
            let fan_in = shape.last().copied().unwrap_or(1).max(1);
            let a = 1.0 / (fan_in as f32).sqrt();
            (0..n).map(|_| a * unit(&mut state)).collect()
        };
        Ok(HostTensor { shape, data })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_name_give_same_values() {
        let a = DummyWeights::new([("w".to_string(), vec![3, 4])], 7);
        let b = DummyWeights::new([("w".to_string(), vec![3, 4])], 7);
        let c = DummyWeights::new([("w".to_string(), vec![3, 4])], 8);
        assert_eq!(a.load("w").unwrap(), b.load("w").unwrap());
        assert_ne!(a.load("w").unwrap(), c.load("w").unwrap());
        assert!(a.load("w").unwrap().data.iter().all(|v| v.abs() <= 0.5));
        assert!(a.load("nope").is_err());
    }
}
