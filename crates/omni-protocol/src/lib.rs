//! Every type that crosses a process boundary, versioned and checked at handshake.
