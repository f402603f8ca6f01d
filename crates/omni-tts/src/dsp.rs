//! The signal path after the acoustic model: spectral parameters per 12.5 ms frame to 24 kHz audio.
//!
//! The model predicts, per frame and per bin of a 1200-point spectrum (601 bins), five parts: a
//! harmonic gain `lh` and phase shift `theta` applied to the spectrum of a pulse train made from
//! the pitch curve `f0`, a noise gain `ln`, and a free-phase branch (`lr` magnitude, `phi` phase):
//!
//! ```text
//! S = e^min(lh,7) * e^(i*pi*tanh(theta)) * STFT(pulses(f0)) + e^min(ln,7) * Z + e^min(lr,7) * e^(i*phi)
//! ```
//!
//! with `Z` complex Gaussian noise (unit variance per component, [`NumpyRng`]). The waveform is the
//! inverse STFT of `S` (Hann window, n_fft 1200, hop 300, centred, `F * 300` samples).
//!
//! Arithmetic follows the reference's float32 steps one for one (each product and sum rounded to
//! f32 in the same order); the FFTs run in f64 and are rounded to f32, as numpy's are. The only
//! differences left are the last bits of f32 `sin`/`cos`/`tanh`/`exp` (libm's here, numpy's SIMD
//! ones there; `tanh` through `exp`, which is several times faster than libm's): about 1e-7 in
//! the audio, where the contract is 1e-4.

use std::sync::Arc;

use realfft::num_complex::Complex;
use realfft::{ComplexToReal, RealFftPlanner, RealToComplex};

use crate::rng::NumpyRng;

/// FFT size of the synthesis STFT.
pub const N_FFT: usize = 1200;
/// Samples per frame (12.5 ms at 24 kHz).
pub const HOP: usize = 300;
/// Output sample rate in Hz.
pub const SAMPLE_RATE: u32 = 24_000;
/// Spectral bins per frame (`N_FFT / 2 + 1`).
pub const BINS: usize = N_FFT / 2 + 1;
/// Pitch below this (Hz) is unvoiced.
const VOICED_HZ: f32 = 40.0;
/// Highest harmonic frequency of the pulse train (Hz).
const F_MAX: f32 = 11_000.0;
/// The gains are `exp(min(x, 7))`.
const GAIN_CAP: f32 = 7.0;

/// The acoustic model's outputs for one utterance: five `[BINS, frames]` row-major planes and
/// the pitch curve `[frames]`.
#[derive(Debug, Clone, Default)]
pub struct Spectra {
    pub frames: usize,
    pub lh: Vec<f32>,
    pub theta: Vec<f32>,
    pub ln: Vec<f32>,
    pub lr: Vec<f32>,
    pub phi: Vec<f32>,
    pub f0: Vec<f32>,
}

/// Planned FFTs and windows, shared by every utterance.
pub struct Dsp {
    win: Vec<f32>,
    win_src: Vec<f32>,
    /// Linear-interpolation weights of the frame-rate pitch at each sample of a frame.
    interp_u: Vec<f32>,
    interp_v: Vec<f32>,
    r2c: Arc<dyn RealToComplex<f64>>,
    c2r: Arc<dyn ComplexToReal<f64>>,
}

impl std::fmt::Debug for Dsp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dsp")
            .field("n_fft", &N_FFT)
            .field("hop", &HOP)
            .finish()
    }
}

impl Default for Dsp {
    fn default() -> Self {
        Self::new()
    }
}

fn gain(x: f32) -> f32 {
    x.min(GAIN_CAP).exp()
}

fn sin32(x: f32) -> f32 {
    x.sin()
}

/// tanh through one exp (glibc's `tanhf` is several times slower): absolute error within a
/// few f32 ulps of 1, a phase error far below what the audio can show.
fn tanh32(x: f32) -> f32 {
    1.0 - 2.0 / ((2.0 * x).exp() + 1.0)
}

/// `(sin x, cos x)` of an f32 (libm's `sincosf`, within an ulp).
fn sin_cos32(x: f32) -> (f32, f32) {
    x.sin_cos()
}

impl Dsp {
    pub fn new() -> Self {
        let mut planner = RealFftPlanner::<f64>::new();
        // Periodic Hann, computed in f64 and rounded.
        let win: Vec<f32> = (0..N_FFT)
            .map(|n| {
                (0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / N_FFT as f64).cos()) as f32
            })
            .collect();
        // A unit cosine peaks at sum(win)/2 = N_FFT/4 in the STFT: dividing makes exp(lh) the
        // harmonic's magnitude.
        let win_src = win.iter().map(|w| w / (N_FFT as f32 / 4.0)).collect();
        let interp_u: Vec<f32> = (0..HOP)
            .map(|j| ((j as f64 + 0.5) / HOP as f64 - 0.5).rem_euclid(1.0) as f32)
            .collect();
        let interp_v = interp_u.iter().map(|u| 1.0 - u).collect();
        Self {
            win,
            win_src,
            interp_u,
            interp_v,
            r2c: planner.plan_fft_forward(N_FFT),
            c2r: planner.plan_fft_inverse(N_FFT),
        }
    }

    /// Band-limited pulse train at 24 kHz from the frame-rate pitch: every harmonic below
    /// `F_MAX` at unit amplitude, in closed form `sin((H+1/2)t) / (2 sin(t/2)) - 1/2`; zero where
    /// unvoiced. `f0.len() * HOP` samples.
    pub fn pulses(&self, f0: &[f32]) -> Vec<f32> {
        let frames = f0.len();
        if frames == 0 {
            return Vec::new();
        }
        let half = HOP / 2;
        let at = |k: isize| f0[k.clamp(0, frames as isize - 1) as usize];
        let mut out = Vec::with_capacity(frames * HOP);
        let mut phase_acc = 0.0f64;
        for k in 0..frames as isize {
            for j in 0..HOP {
                // Sample j of frame k lies between frames (k-1, k) in the first half, (k, k+1) after.
                let (a, b) = if j < half {
                    (at(k - 1), at(k))
                } else {
                    (at(k), at(k + 1))
                };
                let f = a * self.interp_v[j] + b * self.interp_u[j];
                let voiced = f > VOICED_HZ;
                let f = f.max(VOICED_HZ);
                phase_acc += f64::from(f);
                let mut t = phase_acc * (1.0 / f64::from(SAMPLE_RATE));
                t = t.fract();
                t *= 2.0 * std::f64::consts::PI;
                let t = t as f32;
                let h = (F_MAX / f).floor() + 0.5;
                let mut s = sin32(t * 0.5);
                s *= 2.0;
                let e = if s.abs() <= 2e-3 { h } else { sin32(h * t) / s };
                out.push(if voiced { e - 0.5 } else { 0.0 });
            }
        }
        out
    }

    /// The first `frames` frames of the centred STFT (reflect padding) of `x`, each `BINS` values.
    fn stft(&self, x: &[f32], frames: usize) -> Vec<Complex<f32>> {
        let n = x.len();
        let pad = N_FFT / 2;
        // numpy's "reflect": mirror without repeating the edge sample, periodically if needed.
        let reflect = |i: isize| -> f32 {
            if n == 1 {
                return x[0];
            }
            let period = 2 * (n as isize - 1);
            let mut i = i.rem_euclid(period);
            if i >= n as isize {
                i = period - i;
            }
            x[i as usize]
        };
        let mut input = self.r2c.make_input_vec();
        let mut spectrum = self.r2c.make_output_vec();
        let mut out = Vec::with_capacity(frames * BINS);
        for k in 0..frames {
            for (m, slot) in input.iter_mut().enumerate() {
                let v = reflect((k * HOP + m) as isize - pad as isize);
                *slot = f64::from(v * self.win_src[m]);
            }
            // Lengths come from the plan, so processing cannot fail.
            let _ = self.r2c.process(&mut input, &mut spectrum);
            out.extend(
                spectrum
                    .iter()
                    .map(|c| Complex::new(c.re as f32, c.im as f32)),
            );
        }
        out
    }

    /// Audio for one utterance: `spectra.frames * HOP` samples. Draws `BINS * 2 * frames` normals
    /// from `rng` (the reference's order: bin-major, then frame, real before imaginary).
    pub fn synthesize(&self, spectra: &Spectra, rng: &mut NumpyRng) -> Vec<f32> {
        let frames = spectra.frames;
        if frames == 0 {
            return Vec::new();
        }
        let excitation = self.stft(&self.pulses(&spectra.f0), frames);
        let mut noise = vec![0.0f32; BINS * 2 * frames];
        rng.fill_standard_normal(&mut noise);
        let pi = std::f32::consts::PI;

        // The combined spectrum, frame-major for the inverse FFTs; filled bin by bin so the
        // model's planes (bin-major) and the noise are read in order.
        let mut spec = vec![Complex::new(0.0f64, 0.0); frames * BINS];
        for b in 0..BINS {
            let row = b * frames;
            for k in 0..frames {
                let at = row + k;
                let e = excitation[k * BINS + b];
                let c = tanh32(spectra.theta[at]) * pi;
                let g = gain(spectra.lh[at]);
                let (sc, cc) = sin_cos32(c);
                let (rr, ri) = (cc * g, sc * g);
                let mut re = e.re * rr - e.im * ri;
                let mut im = e.re * ri + e.im * rr;
                let gn = gain(spectra.ln[at]);
                re += noise[2 * at] * gn;
                im += noise[2 * at + 1] * gn;
                let gr = gain(spectra.lr[at]);
                let (sp, cp) = sin_cos32(spectra.phi[at]);
                re += cp * gr;
                im += sp * gr;
                spec[k * BINS + b] = Complex::new(f64::from(re), f64::from(im));
            }
        }
        let mut frame = self.c2r.make_output_vec();
        let out_len = (frames + 3) * HOP;
        let mut y = vec![0.0f32; out_len];
        // Every frame's windowed iFFT, kept so that the overlap-add sums in the reference's order.
        let mut frames_td = vec![0.0f32; frames * N_FFT];
        for k in 0..frames {
            let bins = &mut spec[k * BINS..(k + 1) * BINS];
            // A real signal's DC and Nyquist bins are real: the inverse real FFT ignores their
            // imaginary parts, as numpy's does.
            bins[0].im = 0.0;
            bins[BINS - 1].im = 0.0;
            let _ = self.c2r.process(bins, &mut frame);
            let dst = &mut frames_td[k * N_FFT..(k + 1) * N_FFT];
            for ((d, s), w) in dst.iter_mut().zip(&frame).zip(&self.win) {
                *d = (s / N_FFT as f64) as f32 * w;
            }
        }
        // Overlap-add in the reference's order: quarter q of every frame, then the next quarter.
        let quarters = N_FFT / HOP;
        for q in 0..quarters {
            for k in 0..frames {
                let src = &frames_td[k * N_FFT + q * HOP..k * N_FFT + (q + 1) * HOP];
                let dst = &mut y[(k + q) * HOP..(k + q + 1) * HOP];
                for (d, s) in dst.iter_mut().zip(src) {
                    *d += s;
                }
            }
        }
        // Normalise by the summed squared window (constant inside, tapered at the ends).
        let mut wsum = vec![0.0f32; out_len];
        for q in 0..quarters {
            for k in 0..frames {
                for j in 0..HOP {
                    let w = self.win[q * HOP + j];
                    wsum[(k + q) * HOP + j] += w * w;
                }
            }
        }
        for (v, w) in y.iter_mut().zip(&wsum) {
            *v *= 1.0 / w.max(1e-11);
        }
        y.drain(..N_FFT / 2);
        y.truncate(frames * HOP);
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unvoiced_pitch_gives_silent_pulses() {
        let dsp = Dsp::new();
        let p = dsp.pulses(&[0.0; 4]);
        assert_eq!(p.len(), 4 * HOP);
        assert!(p.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn output_has_hop_samples_per_frame() {
        let dsp = Dsp::new();
        let frames = 5;
        let plane = vec![-20.0f32; BINS * frames];
        let s = Spectra {
            frames,
            lh: plane.clone(),
            theta: plane.clone(),
            ln: plane.clone(),
            lr: plane.clone(),
            phi: plane,
            f0: vec![120.0; frames],
        };
        let y = dsp.synthesize(&s, &mut NumpyRng::from_seed(0));
        assert_eq!(y.len(), frames * HOP);
        assert!(y.iter().all(|v| v.abs() < 1e-3));
    }
}
