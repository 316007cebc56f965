/// mimalloc instead of glibc's malloc: the request path allocates and frees
/// small buffers and header maps on every request, and glibc's malloc was
/// about 6% of the proxy's node CPU; every HTTP path answers a few percent
/// more requests per second with it (BENCHMARKS.md). Built with `no_thp`:
/// with transparent huge pages each thread's first segment became a
/// resident 2 MiB page, and an idle node took 77 MB (24.5 MB without them,
/// glibc 25.6 MB).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    meshgate::cli::main()
}
