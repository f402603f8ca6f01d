//! `EngineConfig` and the one registry of environment variables.
