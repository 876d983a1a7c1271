//! What the command line says when it cannot do what it is asked: without privileges, with a
//! malformed configuration file.

use std::{os::unix::process::CommandExt as _, process::Command};

use proxy_tests::require;

const AGENT: &str = env!("CARGO_BIN_EXE_proxy-lab-agent");

fn run_as_nobody(args: &[&str]) -> (bool, String) {
    let out = Command::new(AGENT).args(args).uid(65534).gid(65534).output().expect("run the agent");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn without_privileges_inspect_trace_and_cleanup_say_so_instead_of_nothing() {
    if !require::root("without_privileges_inspect_trace_and_cleanup_say_so_instead_of_nothing") {
        return;
    }
    // Pins the test made, in a directory only root may read (as /sys/fs/bpf is).
    let guard = tempfile::Builder::new().prefix("proxy-cli-").tempdir().unwrap();
    let dir = guard.path();
    std::fs::create_dir_all(dir.join("bpf/maps")).unwrap();
    std::fs::write(dir.join("bpf/maps/LB4_SERVICES_V1"), "").unwrap();
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let root = dir.join("bpf");
    let root = root.to_str().unwrap();
    for args in [
        vec!["inspect", "--bpffs-root", root],
        vec!["trace", "--bpffs-root", root, "--from", "198.51.100.1:4000", "--to", "10.96.0.10:80"],
        vec!["cleanup", "--bpffs-root", root],
    ] {
        let (ok, out) = run_as_nobody(&args);
        assert!(!ok, "{args:?} fails without privileges: {out}");
        assert!(out.contains("permission denied") || out.contains("needs CAP_NET_ADMIN"), "{args:?} says why: {out}");
        assert!(!out.contains("nothing is programmed") && !out.contains("nothing to remove"), "{args:?} does not pretend: {out}");
    }
}

#[test]
fn a_malformed_configuration_file_is_an_error_naming_the_field() {
    let guard = tempfile::Builder::new().prefix("proxy-cli-").tempdir().unwrap();
    let file = guard.path().join("config.conf");
    std::fs::write(
        &file,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables:\n  minSyncPeriod: often\n",
    )
    .unwrap();
    // As kube-proxy is run: no subcommand.
    let out = Command::new(AGENT).arg(format!("--config={}", file.display())).output().expect("run the agent");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(text.contains("iptables.minSyncPeriod") && text.contains("\"often\" is not a duration"), "{text}");
}

#[test]
fn without_cap_perfmon_the_ebpf_mode_names_it() {
    if !require::root("without_cap_perfmon_the_ebpf_mode_names_it") {
        return;
    }
    let pins = proxy_tests::lab::TempBpffs::new("proxy-cli-perfmon");
    std::fs::create_dir_all(&pins.0).unwrap();
    let target = std::ffi::CString::new(pins.0.to_str().unwrap()).unwrap();
    // SAFETY: a bpffs mount on the test's own directory (released when `pins` drops).
    assert_eq!(unsafe { libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, std::ptr::null()) }, 0);
    let manifests = pins.0.with_extension("manifests");
    std::fs::create_dir_all(&manifests).unwrap();
    let mut cmd = Command::new(AGENT);
    cmd.args(["run", "--proxy-mode", "ebpf", "--bpffs-root"]).arg(&pins.0).arg("--manifests").arg(&manifests);
    // SAFETY: prctl only, between fork and exec: root keeps every capability but these two.
    unsafe {
        cmd.pre_exec(|| {
            for cap in [38, 21] {
                libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
            }
            Ok(())
        });
    }
    let out = cmd.output().expect("run the agent");
    let text = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&manifests);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("lacks CAP_PERFMON"), "the missing capability is named: {text}");
    assert!(!text.contains("5.15"), "{text}");
}
