//! EngineCore, Scheduler, KV cache manager: the engine's brain, with no device code.
