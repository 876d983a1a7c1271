//! Preconditions of tests that touch the kernel. A test that cannot run says why, on stderr,
//! and returns; it never passes silently. Under `cargo xtask test` as root
//! (PROXY_TESTS_STRICT=1) a test that cannot run fails instead.

/// True when running as root (needed for BPF, netns and veth). Otherwise prints why the test
/// named `test` cannot run.
pub fn root(test: &str) -> bool {
    // SAFETY: trivial syscall.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let why = format!(
        "{test}: needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN) to load eBPF programs and \
         create network namespaces; run `cargo xtask test` as root"
    );
    cannot_run(&why)
}

/// True when the lab has a cgroup v2 hierarchy (`has`), which the socket hooks attach to and the
/// lab's host-network clients run in. Otherwise prints why `what` (a test, or its part) cannot
/// run; under PROXY_TESTS_STRICT that fails instead, as `root` does.
pub fn cgroup2(what: &str, has: bool) -> bool {
    if has {
        return true;
    }
    let why = format!("{what}: no cgroup v2 hierarchy is mounted for the socket hooks and the lab's host clients");
    cannot_run(&why)
}

/// True when the kernel has netfilter's packet queue (nfnetlink_queue, which lists itself in
/// /proc/net/netfilter), which the lab's delay lines hold packets back with
/// (`synack_delay`). Otherwise prints why `what` cannot run; under PROXY_TESTS_STRICT that
/// fails instead, as `root` does.
pub fn nfqueue(what: &str) -> bool {
    if std::path::Path::new("/proc/net/netfilter/nfnetlink_queue").exists() {
        return true;
    }
    let why = format!("{what}: this kernel has no netfilter packet queue (CONFIG_NETFILTER_NETLINK_QUEUE) to delay packets with");
    cannot_run(&why)
}

/// Says why a test cannot run, and false; under PROXY_TESTS_STRICT (`cargo xtask test` as root)
/// fails instead.
fn cannot_run(why: &str) -> bool {
    if std::env::var_os("PROXY_TESTS_STRICT").is_some() {
        panic!("{why}");
    }
    eprintln!("SKIPPED {why}");
    false
}
