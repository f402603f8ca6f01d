//! A loaded voice: the G2P data, the acoustic model and the DSP, and the calls that turn text
//! into 24 kHz audio (whole, per sentence, or streamed).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

use crate::Error;
use crate::dsp::{BINS, Dsp, Spectra};
use crate::g2p::G2p;
use crate::g2p::lexicon::{Dict, Lexicon};
use crate::g2p::normalize::{Normalizer, Tables};
use crate::g2p::oov::Oov;
use crate::g2p::tagger::Tagger;
use crate::g2p::tokenize::Tokenizer;
use crate::onnx::{OnnxModel, default_library};
use crate::rng::NumpyRng;
use crate::split::{SentenceSplitter, SentenceStream, chunk_phonemes};

/// The acoustic model's file in a voice folder.
pub const MODEL_FILE: &str = "hibari.onnx";

fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T, Error> {
    let file = File::open(path).map_err(|source| Error::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let reader: Box<dyn Read> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(flate2::read::GzDecoder::new(BufReader::new(file)))
    } else {
        Box::new(BufReader::new(file))
    };
    serde_json::from_reader(BufReader::new(reader)).map_err(|e| Error::data(path, e))
}

/// A text-to-speech voice (the hibari "heart" voice: American English, female).
#[derive(Debug)]
pub struct Voice {
    dir: PathBuf,
    g2p: G2p,
    model: OnnxModel,
    vocab: HashMap<char, i64>,
    dsp: Dsp,
    splitter: SentenceSplitter,
}

impl Voice {
    /// Loads the voice in `dir` (the folder `scripts/fetch-voice.sh` prints), with the ONNX
    /// Runtime library next to it.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self, Error> {
        let dir = dir.as_ref();
        Self::load_with_runtime(dir, &default_library(dir))
    }

    /// Loads the voice in `dir` with the ONNX Runtime shared library at `runtime`.
    pub fn load_with_runtime(dir: impl AsRef<Path>, runtime: &Path) -> Result<Self, Error> {
        let dir = dir.as_ref();
        let at = |name: &str| dir.join(name);
        let tables: Tables = read_json(&at("normalize.json"))?;
        let titles = tables.titles.0.iter().map(|(k, _)| k.clone());
        let splitter = SentenceSplitter::new(titles);
        let normalizer = Normalizer::new(&tables)?;
        let tokenizer = Tokenizer::new(read_json(&at("tokenizer_exceptions.json"))?)?;
        let tagger = Tagger::new(read_json(&at("tagger.json.gz"))?);
        let lexicon = Lexicon::new(
            Dict::new(read_json(&at("lexicon_us_gold.json.gz"))?),
            Dict::new(read_json(&at("lexicon_us_silver.json.gz"))?),
        );
        let oov = Oov::load(runtime, &at("oov.onnx"), read_json(&at("oov.json"))?)?;
        let g2p = G2p::new(normalizer, tokenizer, tagger, lexicon, oov)?;
        let vocab_raw: HashMap<String, i64> = read_json(&at("vocab.json"))?;
        let vocab = vocab_raw
            .into_iter()
            .filter_map(|(k, v)| {
                let mut cs = k.chars();
                match (cs.next(), cs.next()) {
                    (Some(c), None) => Some((c, v)),
                    _ => None,
                }
            })
            .collect();
        let model = OnnxModel::load(runtime, &at(MODEL_FILE))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            g2p,
            model,
            vocab,
            dsp: Dsp::new(),
            splitter,
        })
    }

    /// The folder the voice was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Output sample rate in Hz.
    pub fn sample_rate(&self) -> u32 {
        crate::dsp::SAMPLE_RATE
    }

    /// The sentences of `text`, each synthesized in one model call (or a few, if very long).
    pub fn sentences(&self, text: &str) -> Vec<String> {
        self.splitter.split(text)
    }

    /// A streaming splitter with this voice's sentence rules.
    pub fn sentence_stream(&self) -> SentenceStream {
        SentenceStream::new(self.splitter.clone())
    }

    /// Phoneme strings of `text`, one per model call (sentences; long ones cut at clauses).
    pub fn phoneme_strings(&self, text: &str) -> Result<Vec<String>, Error> {
        let mut out = Vec::new();
        for sentence in self.sentences(text) {
            let ps = self.g2p.phonemize(&sentence)?;
            if !ps.is_empty() {
                out.extend(chunk_phonemes(&ps));
            }
        }
        Ok(out)
    }

    /// The model's ids of a phoneme string, with the 0 pad at both ends (unknown symbols skipped).
    pub fn ids(&self, phonemes: &str) -> Vec<i64> {
        let mut ids = vec![0];
        ids.extend(phonemes.chars().filter_map(|c| self.vocab.get(&c).copied()));
        ids.push(0);
        ids
    }

    /// Phoneme ids of `text`, one sequence per model call.
    pub fn phonemize(&self, text: &str) -> Result<Vec<Vec<i64>>, Error> {
        Ok(self
            .phoneme_strings(text)?
            .iter()
            .map(|ps| self.ids(ps))
            .collect())
    }

    /// The acoustic model's outputs for one id sequence (`speed` divides the durations).
    pub fn spectra(&self, ids: &[i64], speed: f32) -> Result<Spectra, Error> {
        let outs = self.model.run_acoustic(ids, speed)?;
        let mut s = Spectra::default();
        let bad = |what: String| Error::Shape {
            model: self.model.name().to_string(),
            what,
        };
        for (name, out) in outs {
            let frames = *out.shape.last().unwrap_or(&0) as usize;
            match name.as_str() {
                "f0" => {
                    s.frames = frames;
                    s.f0 = out.data;
                }
                plane => {
                    if out.data.len() != BINS * frames {
                        return Err(bad(format!("{plane} of shape {:?}", out.shape)));
                    }
                    match plane {
                        "lh" => s.lh = out.data,
                        "theta" => s.theta = out.data,
                        "ln" => s.ln = out.data,
                        "lr" => s.lr = out.data,
                        "phi" => s.phi = out.data,
                        other => return Err(bad(format!("an unknown output {other}"))),
                    }
                }
            }
        }
        let n = BINS * s.frames;
        if [&s.lh, &s.theta, &s.ln, &s.lr, &s.phi]
            .iter()
            .any(|p| p.len() != n)
        {
            return Err(bad(format!("planes that do not match {} frames", s.frames)));
        }
        Ok(s)
    }

    /// Audio of one id sequence; noise from `rng`. Fewer than three ids (nothing between the
    /// pads) give no audio.
    pub fn synthesize_ids(
        &self,
        ids: &[i64],
        speed: f32,
        rng: &mut NumpyRng,
    ) -> Result<Vec<f32>, Error> {
        if ids.len() < 3 {
            return Ok(Vec::new());
        }
        let s = self.spectra(ids, speed)?;
        Ok(self.dsp.synthesize(&s, rng))
    }

    /// The DSP alone: audio of the acoustic model's outputs.
    pub fn render(&self, spectra: &Spectra, rng: &mut NumpyRng) -> Vec<f32> {
        self.dsp.synthesize(spectra, rng)
    }

    /// Audio of `text` at 24 kHz, float in [-1, 1]; `speed` 1.0 is the trained pace (0.5 .. 2.0).
    pub fn synthesize(&self, text: &str, speed: f32) -> Result<Vec<f32>, Error> {
        self.synthesize_with(text, speed, &mut NumpyRng::from_entropy())
    }

    /// As [`Voice::synthesize`] with reproducible noise: the same seed gives the same samples as
    /// the reference package's `Hibari()(text, speed, seed)`.
    pub fn synthesize_seeded(&self, text: &str, speed: f32, seed: u64) -> Result<Vec<f32>, Error> {
        self.synthesize_with(text, speed, &mut NumpyRng::from_seed(seed))
    }

    fn synthesize_with(
        &self,
        text: &str,
        speed: f32,
        rng: &mut NumpyRng,
    ) -> Result<Vec<f32>, Error> {
        let mut audio = Vec::new();
        for ids in self.phonemize(text)? {
            audio.extend(self.synthesize_ids(&ids, speed, rng)?);
        }
        Ok(audio)
    }

    /// A speech stream: push text as it arrives, get audio per completed sentence.
    pub fn stream(&self, speed: f32, seed: Option<u64>) -> SpeechStream<'_> {
        self.stream_with(self.sentence_stream(), speed, seed)
    }

    /// A speech stream over a configured text splitter (e.g.
    /// [`SentenceStream::flush_clauses_after`] for earlier audio from long sentences).
    pub fn stream_with(
        &self,
        text: SentenceStream,
        speed: f32,
        seed: Option<u64>,
    ) -> SpeechStream<'_> {
        SpeechStream {
            voice: self,
            text,
            rng: seed.map_or_else(NumpyRng::from_entropy, NumpyRng::from_seed),
            speed,
        }
    }
}

/// Text in, audio out, one chunk per sentence as soon as the sentence is complete.
#[derive(Debug)]
pub struct SpeechStream<'v> {
    voice: &'v Voice,
    text: SentenceStream,
    rng: NumpyRng,
    speed: f32,
}

impl SpeechStream<'_> {
    fn speak(&mut self, sentences: Vec<String>) -> Result<Vec<Vec<f32>>, Error> {
        let mut out = Vec::new();
        for sentence in sentences {
            for ids in self.voice.phonemize(&sentence)? {
                let audio = self.voice.synthesize_ids(&ids, self.speed, &mut self.rng)?;
                if !audio.is_empty() {
                    out.push(audio);
                }
            }
        }
        Ok(out)
    }

    /// Appends streamed text; returns the audio of the sentences it completed.
    pub fn push(&mut self, text: &str) -> Result<Vec<Vec<f32>>, Error> {
        let done = self.text.push(text);
        self.speak(done)
    }

    /// Ends the text; returns the audio of what was still buffered.
    pub fn finish(&mut self) -> Result<Vec<Vec<f32>>, Error> {
        let rest = self.text.finish();
        self.speak(rest)
    }
}
