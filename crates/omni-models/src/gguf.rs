//! GGUF checkpoints as a [`crate::weights::WeightSource`].
