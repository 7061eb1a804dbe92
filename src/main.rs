//! The agentd binary.
fn main() {}
