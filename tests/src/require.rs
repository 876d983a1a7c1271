//! Preconditions of tests that touch the kernel. A test that cannot run says why, on stderr,
//! and returns; it never passes silently.

/// True when running as root (needed for BPF, netns and veth). Otherwise prints why the test
/// named `test` cannot run.
pub fn root(test: &str) -> bool {
    // SAFETY: trivial syscall.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    eprintln!(
        "SKIPPED {test}: needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN) to load eBPF programs \
         and create network namespaces; run `cargo xtask test` as root"
    );
    false
}
