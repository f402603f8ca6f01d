//! The phoneme ids of the 20 reference sentences equal those of the hibari package.

mod common;

#[test]
fn phoneme_ids_match_the_reference_package() {
    let Some(voice) = common::voice("phoneme_ids_match_the_reference_package") else {
        return;
    };
    let golden = common::golden();
    let sentences = golden["sentences"].as_array().expect("sentences");
    let mut matched = 0;
    let mut report = Vec::new();
    for s in sentences {
        let text = s["text"].as_str().expect("text");
        let want: Vec<Vec<i64>> = serde_json::from_value(s["ids"].clone()).expect("ids");
        let got = voice.phonemize(text).expect("phonemize");
        if got == want {
            matched += 1;
        } else {
            let ps = voice.phoneme_strings(text).expect("phonemes");
            report.push(format!("{text:?}\n  got  {ps:?}\n  want {}", s["phonemes"]));
        }
    }
    println!("phoneme ids: {matched}/{} sentences match", sentences.len());
    assert!(report.is_empty(), "mismatches:\n{}", report.join("\n"));
}

/// The normaliser's and the number reader's cases, acronyms, hyphens, possessives,
/// part-of-speech readings and unknown words (`g2p_extra` of the golden file).
#[test]
fn phoneme_ids_match_on_the_normaliser_and_reader_cases() {
    let Some(voice) = common::voice("phoneme_ids_match_on_the_normaliser_and_reader_cases") else {
        return;
    };
    let golden = common::golden();
    let cases = golden["g2p_extra"].as_array().expect("g2p_extra");
    let mut report = Vec::new();
    for s in cases {
        let text = s["text"].as_str().expect("text");
        let want: Vec<Vec<i64>> = serde_json::from_value(s["ids"].clone()).expect("ids");
        if voice.phonemize(text).expect("phonemize") != want {
            let ps = voice.phoneme_strings(text).expect("phonemes");
            report.push(format!("{text:?}\n  got  {ps:?}\n  want {}", s["phonemes"]));
        }
    }
    println!(
        "phoneme ids (extra cases): {}/{} match",
        cases.len() - report.len(),
        cases.len()
    );
    assert!(report.is_empty(), "mismatches:\n{}", report.join("\n"));
}

#[test]
fn bracketed_phonemes_are_used_as_given() {
    let Some(voice) = common::voice("bracketed_phonemes_are_used_as_given") else {
        return;
    };
    let ps = voice
        .phoneme_strings("Say [hibari](/hibˈɑɹi/) now.")
        .expect("phonemes");
    assert_eq!(ps.len(), 1);
    assert!(ps[0].contains("hibˈɑɹi"), "{ps:?}");
}
