//! The omni-engine binary.
fn main() {}
