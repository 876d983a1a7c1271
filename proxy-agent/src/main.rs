fn main() -> std::process::ExitCode {
    proxy_agent::cli::main()
}
