//! The `mlxcel` binary: see [`mlxcel::cli`].
use std::process::ExitCode;

fn main() -> ExitCode {
    match mlxcel::cli::main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // the cause chain on one line; logs went to stderr before it
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
