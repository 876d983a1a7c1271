//! The agent, built inside the test package so integration tests can locate it with
//! `CARGO_BIN_EXE_proxy-lab-agent` and the demo next to its own executable.
fn main() -> std::process::ExitCode {
    proxy_agent::cli::main()
}
