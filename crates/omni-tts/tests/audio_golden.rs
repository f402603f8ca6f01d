//! Audio equals the hibari package's float output (seed 0) within 1e-4, for the DSP alone on the
//! package's own model outputs and for the whole path from text.

mod common;

use std::time::Instant;

use omni_tts::{NumpyRng, Spectra};
use serde_json::Value;

const TOLERANCE: f32 = 1e-4;

fn cached_spectra(dir: &std::path::Path, entry: &Value) -> Option<Spectra> {
    let name = entry["name"].as_str()?;
    let frames = entry["frames"].as_u64()? as usize;
    let plane = |out: &str| common::read_f32(&dir.join(format!("{name}.{out}.f32")));
    Some(Spectra {
        frames,
        lh: plane("lh"),
        theta: plane("theta"),
        ln: plane("ln"),
        lr: plane("lr"),
        phi: plane("phi"),
        f0: plane("f0"),
    })
}

#[test]
fn dsp_matches_the_reference_on_its_model_outputs() {
    let Some(dir) = common::golden_cache() else {
        println!(
            "SKIP dsp_matches_the_reference_on_its_model_outputs: no .cache/tts-golden (run scripts/make-tts-golden.sh)"
        );
        return;
    };
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).expect("index"))
            .expect("index parses");
    let dsp = omni_tts::dsp::Dsp::new();
    let mut worst = 0.0f32;
    let mut checked = 0;
    for entry in index["sentences"].as_array().expect("sentences") {
        let Some(spectra) = cached_spectra(&dir, entry) else {
            continue;
        };
        let name = entry["name"].as_str().expect("name");
        let want = common::read_f32(&dir.join(format!("{name}.audio.f32")));
        let got = dsp.synthesize(&spectra, &mut NumpyRng::from_seed(0));
        let d = common::max_abs_diff(&got, &want);
        assert!(d < TOLERANCE, "{name}: max abs diff {d}");
        worst = worst.max(d);
        checked += 1;
    }
    println!("dsp alone: {checked} sentences, max abs diff {worst:e}");
    assert!(checked > 0);
}

#[test]
fn model_outputs_match_onnxruntime_in_python() {
    let Some(voice) = common::voice("model_outputs_match_onnxruntime_in_python") else {
        return;
    };
    let Some(dir) = common::golden_cache() else {
        println!("SKIP model_outputs_match_onnxruntime_in_python: no .cache/tts-golden");
        return;
    };
    let golden = common::golden();
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).expect("index"))
            .expect("index parses");
    let mut worst = 0.0f32;
    for (entry, g) in index["sentences"]
        .as_array()
        .expect("sentences")
        .iter()
        .zip(golden["sentences"].as_array().expect("sentences"))
    {
        let Some(want) = cached_spectra(&dir, entry) else {
            continue;
        };
        let ids: Vec<i64> = serde_json::from_value(g["ids"][0].clone()).expect("ids");
        let got = voice.spectra(&ids, 1.0).expect("model runs");
        assert_eq!(got.frames, want.frames);
        for (a, b) in [
            (&got.lh, &want.lh),
            (&got.theta, &want.theta),
            (&got.ln, &want.ln),
            (&got.lr, &want.lr),
            (&got.phi, &want.phi),
            (&got.f0, &want.f0),
        ] {
            worst = worst.max(common::max_abs_diff(a, b));
        }
    }
    println!("model outputs vs onnxruntime in Python: max abs diff {worst:e}");
    assert!(worst < 1e-4, "{worst}");
}

#[test]
fn audio_from_text_matches_the_reference_package() {
    let Some(voice) = common::voice("audio_from_text_matches_the_reference_package") else {
        return;
    };
    let golden = common::golden();
    let cache = common::golden_cache();
    let mut worst = 0.0f32;
    let mut checked = 0;
    let (mut audio_s, mut wall_s) = (0.0f64, 0.0f64);
    for (i, s) in golden["sentences"]
        .as_array()
        .expect("sentences")
        .iter()
        .enumerate()
    {
        let text = s["text"].as_str().expect("text");
        let want = match (s["audio"].as_str(), &cache) {
            (Some(f), _) => common::read_f32(&common::fixtures().join(f)),
            (None, Some(dir)) => common::read_f32(&dir.join(format!("s{i:02}.audio.f32"))),
            (None, None) => continue,
        };
        let t0 = Instant::now();
        let got = voice.synthesize_seeded(text, 1.0, 0).expect("synthesize");
        wall_s += t0.elapsed().as_secs_f64();
        audio_s += got.len() as f64 / f64::from(omni_tts::SAMPLE_RATE);
        let d = common::max_abs_diff(&got, &want);
        assert!(d < TOLERANCE, "{text:?}: max abs diff {d}");
        worst = worst.max(d);
        checked += 1;
    }
    println!(
        "audio from text: {checked} sentences, max abs diff {worst:e}; {audio_s:.1} s of audio in {wall_s:.2} s ({:.0}x real time)",
        audio_s / wall_s.max(1e-9)
    );
    assert!(checked >= 3);
}

/// The rewrite that makes int8 products exact on CPUs without VNNI (`X64_QUANT_PRECISION`, with
/// the shared weights copied) gives the outputs of ONNX Runtime's own kernels where those are
/// exact (VNNI), bit for bit; where they are not, both loads take the rewrite and the audio test
/// above holds it to the reference.
#[test]
fn the_exact_int8_rewrite_gives_the_same_outputs_as_the_default_load() {
    use omni_tts::onnx::{Int8Products, OnnxModel, default_library};
    let Some(voice) =
        common::voice("the_exact_int8_rewrite_gives_the_same_outputs_as_the_default_load")
    else {
        return;
    };
    let dir = voice.dir();
    let (runtime, model) = (default_library(dir), dir.join(omni_tts::MODEL_FILE));
    let auto = OnnxModel::load(&runtime, &model).expect("default load");
    let rewritten =
        OnnxModel::load_with(&runtime, &model, Int8Products::Rewritten).expect("rewritten load");
    let golden = common::golden();
    let mut checked = 0;
    for s in golden["sentences"]
        .as_array()
        .expect("sentences")
        .iter()
        .take(8)
    {
        for ids in s["ids"].as_array().expect("ids") {
            let ids: Vec<i64> = serde_json::from_value(ids.clone()).expect("ids");
            let a = auto.run_acoustic(&ids, 1.0).expect("default runs");
            let b = rewritten.run_acoustic(&ids, 1.0).expect("rewritten runs");
            assert_eq!(a.len(), b.len());
            for ((na, oa), (nb, ob)) in a.iter().zip(&b) {
                assert_eq!((na, &oa.shape), (nb, &ob.shape));
                assert_eq!(common::max_abs_diff(&oa.data, &ob.data), 0.0, "{na}");
            }
            checked += 1;
        }
    }
    println!(
        "exact int8 rewrite: {checked} inputs bit for bit (this CPU's own kernels exact: {})",
        omni_tts::onnx::cpu_int8_is_exact()
    );
    assert!(checked >= 8);
}
