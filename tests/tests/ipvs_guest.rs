//! The conformance suite in IPVS mode. This machine's kernel has no IPVS, so the test boots
//! Debian's own kernel (which has it) in a qemu guest whose root filesystem is this machine's,
//! shared read-only, and runs the suite there with the same binaries (tests/guest/).
//! Building the guest takes a few seconds and is cached under target/ipvs-guest.

use std::{path::Path, process::Command};

use proxy_tests::require;

fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root")
}

#[test]
fn the_conformance_suite_passes_in_ipvs_mode_in_a_guest() {
    if !require::root("the_conformance_suite_passes_in_ipvs_mode_in_a_guest") {
        return;
    }
    let missing: Vec<&str> = ["qemu-system-x86_64", "busybox", "cpio", "depmod", "ipvsadm", "ipset"]
        .into_iter()
        .filter(|t| Command::new("sh").args(["-c", &format!("command -v {t}")]).output().map(|o| !o.status.success()).unwrap_or(true))
        .collect();
    if !missing.is_empty() {
        let why = format!("the IPVS guest needs {missing:?}; `cargo xtask setup` installs them");
        if std::env::var_os("PROXY_TESTS_STRICT").is_some() {
            panic!("{why}");
        }
        eprintln!("SKIPPED the IPVS guest run: {why}");
        return;
    }
    let guest = workspace().join("target/ipvs-guest");
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("guest");
    let build = Command::new("bash").arg(scripts.join("build-guest.sh")).arg(&guest).output().expect("build-guest.sh");
    assert!(
        build.status.success(),
        "building the guest failed:\n{}{}",
        String::from_utf8_lossy(&build.stdout),
        String::from_utf8_lossy(&build.stderr)
    );
    let job = guest.join("conformance-job.sh");
    std::fs::write(
        &job,
        format!(
            "#!/bin/sh\nset -e\nmodprobe ip_vs\nfor m in ip_vs_rr ip_set xt_set veth dummy; do modprobe $m || true; done\nexport PROXY_TESTS_STRICT=1 RUST_BACKTRACE=0\nexec {} --mode ipvs --agent {}\n",
            env!("CARGO_BIN_EXE_proxy-conformance"),
            env!("CARGO_BIN_EXE_proxy-lab-agent")
        ),
    )
    .unwrap();
    let out = Command::new("bash").arg(scripts.join("run-guest.sh")).arg(&guest).arg(&job).arg("1800").output().expect("run-guest.sh");
    let console = String::from_utf8_lossy(&out.stdout);
    println!("{console}");
    assert!(
        out.status.success() && console.contains("CONFORMANCE-OK ipvs"),
        "the IPVS conformance run failed (guest exit {:?}):\n{console}\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
}
