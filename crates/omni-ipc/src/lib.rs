//! Shared-memory broadcast queue (`ShmRingBuffer`, `MessageQueue`) with ZeroMQ overflow and remote readers.
