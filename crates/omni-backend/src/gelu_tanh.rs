//! GELU with the tanh approximation (PyTorch `gelu(approximate='tanh')`, transformers'
//! `gelu_pytorch_tanh`): `x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))`, in f64.

use rayon::prelude::*;

/// Element counts from which [`gelu_tanh_inplace`] runs on the rayon pool.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

/// The tanh-approximated GELU of one value.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let x = f64::from(x);
    let inner = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    (0.5 * x * (1.0 + inner.tanh())) as f32
}

/// [`gelu_tanh`] on every element, in place.
pub fn gelu_tanh_inplace(x: &mut [f32]) {
    if x.len() >= PARALLEL_MIN_ELEMENTS {
        x.par_chunks_mut(PARALLEL_MIN_ELEMENTS / 4)
            .for_each(|c| c.iter_mut().for_each(|v| *v = gelu_tanh(*v)));
    } else {
        x.iter_mut().for_each(|v| *v = gelu_tanh(*v));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_pytorch_values() {
        // torch.nn.functional.gelu(torch.tensor([-3., -1., 0., 0.5, 2.]), approximate='tanh')
        let want = [-0.0036374, -0.158_808, 0.0, 0.345_714, 1.9545977];
        for (x, w) in [-3.0f32, -1.0, 0.0, 0.5, 2.0].iter().zip(want) {
            assert!(
                (gelu_tanh(*x) - w).abs() < 1e-6,
                "{x}: {} vs {w}",
                gelu_tanh(*x)
            );
        }
    }
}
