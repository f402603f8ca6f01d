//! Benchmarks for omni-engine.
