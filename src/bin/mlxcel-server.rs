//! `mlxcel-server`: the OpenAI-compatible HTTP server, the same as `mlxcel serve`.
//! See `docs/server.md`.
use std::process::ExitCode;

use clap::Parser;

/// OpenAI-compatible HTTP server over mlxcel (continuous batching, streaming, metrics).
#[derive(Debug, Parser)]
#[command(name = "mlxcel-server", version)]
struct ServerCli {
    /// More log output (-v debug, -vv trace). `RUST_LOG`, when set, wins.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(flatten)]
    serve: mlxcel::server::ServeArgs,
}

fn main() -> ExitCode {
    // Tensor-parallel ranks are started as `<this executable> _rank ...`: hand
    // the internal subcommands to the main CLI.
    let internal = std::env::args_os()
        .nth(1)
        .is_some_and(|a| a.to_string_lossy().starts_with('_'));
    let result = if internal {
        mlxcel::cli::main()
    } else {
        let cli = ServerCli::parse();
        mlxcel::cli::startup(cli.verbose).and_then(|()| mlxcel::server::run(&cli.serve))
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
