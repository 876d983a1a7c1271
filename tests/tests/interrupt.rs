//! A benchmark stopped by a signal (Ctrl-C, `kill`) removes what it made: its namespaces, its
//! bpffs mounts and lab directories, and the agents it started (`proxy_tests::interrupt`).

use std::{
    collections::BTreeSet,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use proxy_tests::require;

const BENCH: &str = env!("CARGO_BIN_EXE_proxy-bench");

fn namespaces() -> BTreeSet<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().next()).map(String::from).collect()
}

/// Mount points of every bpffs.
fn bpf_mounts() -> BTreeSet<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").expect("/proc/self/mounts");
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (at, kind) = (f.nth(1)?, f.next()?);
            (kind == "bpf").then(|| PathBuf::from(at))
        })
        .collect()
}

/// The pids whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok()) == Some(parent)
        })
        .collect()
}

/// Polls `f` every 100 ms until it gives something; panics with `what` and the bench's output
/// after `limit`.
fn wait_for<T>(bench: &mut Child, log: &std::path::Path, limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        let exited = bench.try_wait().expect("try_wait");
        if exited.is_some() || t.elapsed() > limit {
            let _ = bench.kill();
            let _ = bench.wait();
            panic!("{what}: not within {limit:?} (bench exit: {exited:?}):\n{}", std::fs::read_to_string(log).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends `signal` to the bench and waits for it to end; it must end by itself within a minute,
/// with 128 + the signal's number.
fn interrupt(bench: &mut Child, log: &std::path::Path, signal: i32) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(bench.id() as i32, signal) };
    let t = Instant::now();
    let status = loop {
        if let Some(s) = bench.try_wait().expect("try_wait") {
            break s;
        }
        if t.elapsed() > Duration::from_secs(60) {
            let _ = bench.kill();
            let _ = bench.wait();
            panic!("the bench did not end within a minute of signal {signal}:\n{}", std::fs::read_to_string(log).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(log).unwrap_or_default();
    assert_eq!(status.code(), Some(128 + signal), "exit status after signal {signal}:\n{text}");
    assert!(text.contains("removing the namespaces, pins and agents"), "it said what it cleans up:\n{text}");
}

fn spawn_bench(args: &[&str], env: &[(&str, &str)], log: &std::path::Path) -> Child {
    let out = std::fs::File::create(log).expect("bench log");
    Command::new(BENCH)
        .args(args)
        .envs(env.iter().copied())
        .env("BENCH_OUT_DIR", std::env::temp_dir())
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log fd"))
        .stderr(out)
        .spawn()
        .expect("start proxy-bench")
}

#[test]
fn ctrl_c_in_the_xdp_profile_removes_its_namespace_and_its_pins() {
    if !require::root("ctrl_c_in_the_xdp_profile_removes_its_namespace_and_its_pins") {
        return;
    }
    let log = std::env::temp_dir().join(format!("interrupt-xdp-{}.log", std::process::id()));
    let (ns_before, mounts_before) = (namespaces(), bpf_mounts());
    let mut bench = spawn_bench(&["profile", "--xdp"], &[], &log);
    // Measuring: its node, its pins and its programs are all in place.
    wait_for(&mut bench, &log, Duration::from_secs(120), "a first xdp figure", || {
        std::fs::read_to_string(&log).ok().filter(|t| t.contains("xdp forward")).map(|_| ())
    });
    // The other test of this file runs beside this one: only the profile's own (`pxb-`) count.
    let ns: Vec<String> = namespaces().difference(&ns_before).filter(|n| n.starts_with("pxb-")).cloned().collect();
    let mounts: Vec<PathBuf> = bpf_mounts().difference(&mounts_before).filter(|m| m.to_string_lossy().contains("/pxb-")).cloned().collect();
    assert!(!ns.is_empty(), "the bench's node namespace");
    assert!(!mounts.is_empty(), "the bench's bpffs");
    interrupt(&mut bench, &log, libc::SIGINT);
    let (ns_after, mounts_after) = (namespaces(), bpf_mounts());
    for n in &ns {
        assert!(!ns_after.contains(n), "namespace {n} left behind");
    }
    for m in &mounts {
        assert!(!mounts_after.contains(m), "bpffs {} left mounted", m.display());
        assert!(!m.exists(), "pin directory {} left behind", m.display());
    }
    let _ = std::fs::remove_file(&log);
}

#[test]
fn a_sigterm_during_a_lab_benchmark_stops_its_agent_and_removes_the_lab() {
    if !require::root("a_sigterm_during_a_lab_benchmark_stops_its_agent_and_removes_the_lab") {
        return;
    }
    let log = std::env::temp_dir().join(format!("interrupt-lab-{}.log", std::process::id()));
    let ns_before = namespaces();
    let mut bench = spawn_bench(&["connect"], &[("PROXY_BENCH_MODES", "ebpf"), ("PROXY_BENCH_SIZES", "1000")], &log);
    let pid = bench.id();
    // The lab's agent is running and has pinned its maps.
    let (agent, lab_dir) = wait_for(&mut bench, &log, Duration::from_secs(300), "the lab's agent with its pins", || {
        children_of(pid).into_iter().find_map(|child| {
            let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).ok()?;
            let args: Vec<String> = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
            let root = PathBuf::from(args.iter().skip_while(|a| *a != "--bpffs-root").nth(1)?);
            let dir = root.parent()?.to_path_buf();
            bpf_mounts().contains(&root).then_some((child, dir))
        })
    });
    // The lab's namespaces are `pxl-<id>-...`, its directory /run/proxy-lab/<id>.
    let id = lab_dir.file_name().expect("lab id").to_string_lossy().into_owned();
    let ns: Vec<String> = namespaces().difference(&ns_before).filter(|n| n.starts_with(&format!("pxl-{id}-"))).cloned().collect();
    assert!(ns.len() >= 2, "the lab's node and pod namespaces: {ns:?}");
    interrupt(&mut bench, &log, libc::SIGTERM);
    // Reaped by the bench: an agent it left would live on under init.
    assert!(!std::path::Path::new(&format!("/proc/{agent}")).exists(), "agent {agent} still running");
    assert!(!lab_dir.exists(), "lab directory {} left behind", lab_dir.display());
    assert!(!bpf_mounts().iter().any(|m| m.starts_with(&lab_dir)), "a bpffs under {} left mounted", lab_dir.display());
    if let Some(cgroup) = proxy_agent::dataplane::ebpf::hostsock::cgroup2_mount().map(|m| m.join(format!("proxy-lab-{id}"))) {
        assert!(!cgroup.exists(), "the lab's cgroup {} left behind", cgroup.display());
    }
    let ns_after = namespaces();
    for n in &ns {
        assert!(!ns_after.contains(n), "namespace {n} left behind");
    }
    let _ = std::fs::remove_file(&log);
}
