//! The `symmem` binary.

fn main() -> std::process::ExitCode {
    symmem_cli::main_with(std::env::args_os(), None)
}
