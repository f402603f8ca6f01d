//! What flows between the stages of an omni pipeline, independent of transport: the
//! Talker -> Code2Wav windowing ([`CodecChunker`]). The Thinker -> Talker hand-off and the
//! shared-memory transport come with the pipeline.

mod codec_chunks;

pub use codec_chunks::{CodecChunker, CodecWindow};
