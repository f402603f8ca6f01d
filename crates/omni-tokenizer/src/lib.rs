//! Tokenizers (tokenizer.json or GGUF metadata), chat templates (minijinja), incremental detokenization.
