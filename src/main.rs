fn main() -> std::process::ExitCode {
    meshgate::cli::main()
}
