//! The agentd binary (temporary entry point until the CLI lands): `agentd bench`.

use std::sync::Arc;
use std::time::Duration;

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let opts = agentd::bench::BenchOptions {
        runs: arg(&args, "--runs", 1000) as usize,
        steps: arg(&args, "--steps", 10) as u32,
        model_delay: Duration::from_millis(arg(&args, "--model-delay-ms", 0)),
        ..Default::default()
    };
    let store = Arc::new(agentd::store::memory::MemoryStore::new());
    match agentd::bench::run(opts, store).await {
        Ok(r) => {
            println!("{r}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("agentd bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
