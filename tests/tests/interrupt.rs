//! A benchmark stopped by a signal (Ctrl-C, `kill`) removes what it made: its namespaces, its
//! bpffs mounts and lab directories, and the agents it started (`proxy_tests::interrupt`).

use std::{
    collections::BTreeSet,
    os::unix::process::{CommandExt, ExitStatusExt},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use proxy_tests::{interrupt::children_of, lab, lab::bpf_mounts, require};

const BENCH: &str = env!("CARGO_BIN_EXE_proxy-bench");

fn namespaces() -> BTreeSet<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().next()).map(String::from).collect()
}

/// A bench run and what the test saw it make, removed when the test ends whatever happened
/// (on success the bench removed it already): the bench killed, the processes it started too
/// if they are still the ones (`strays`: a pid, and what its command line holds; the lab's
/// agent names the lab's directory), namespaces deleted, bpffs released and directories
/// removed.
struct Run {
    bench: Child,
    /// The lab's agent and directory.
    agent: Option<(u32, PathBuf)>,
    strays: Vec<(u32, String)>,
    namespaces: Vec<String>,
    dirs: Vec<PathBuf>,
}

impl Drop for Run {
    fn drop(&mut self) {
        // Child::kill signals nothing once the child was reaped.
        let _ = self.bench.kill();
        let _ = self.bench.wait();
        for (pid, marker) in &self.strays {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(marker.as_str()) {
                // SAFETY: a process the bench started, still running.
                unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
            }
        }
        for n in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
        for d in &self.dirs {
            lab::remove_lab_dir(d);
        }
        // The lab's cgroup, once the agent killed above has left it.
        let cgroup = self.agent.as_ref().and_then(|(_, dir)| {
            let id = dir.file_name()?.to_string_lossy().into_owned();
            Some(proxy_agent::dataplane::ebpf::hostsock::cgroup2_mount()?.join(format!("proxy-lab-{id}")))
        });
        for _ in 0..50 {
            if cgroup.as_ref().is_none_or(|c| !c.exists() || std::fs::remove_dir(c).is_ok()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
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
            panic!("{what}: not within {limit:?} (bench exit: {exited:?}):\n{}", std::fs::read_to_string(log).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends `signal` to the bench (`twice`: a second time 20 ms later, while it cleans up) and
/// waits for it to end; it must end by itself within a minute, by that signal (as without a
/// handler, once it has cleaned up).
fn interrupt(bench: &mut Child, log: &std::path::Path, signal: i32, twice: bool) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(bench.id() as i32, signal) };
    if twice {
        std::thread::sleep(Duration::from_millis(20));
        // SAFETY: as above (not reaped yet: the test reaps it below).
        unsafe { libc::kill(bench.id() as i32, signal) };
    }
    let t = Instant::now();
    let status = loop {
        if let Some(s) = bench.try_wait().expect("try_wait") {
            break s;
        }
        if t.elapsed() > Duration::from_secs(60) {
            panic!("the bench did not end within a minute of signal {signal}:\n{}", std::fs::read_to_string(log).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(log).unwrap_or_default();
    assert_eq!(status.signal(), Some(signal), "how it ended after signal {signal} ({status}):\n{text}");
    assert!(text.contains("removing the namespaces, pins and agents"), "it said what it cleans up:\n{text}");
}

/// Starts `cmd`'s process with SIGHUP, SIGINT and SIGTERM at their default action, even if
/// this test runs with them ignored (a background job of a script): the process must catch
/// them.
fn default_signals(cmd: &mut Command) -> &mut Command {
    // SAFETY: only `signal` between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            for s in [libc::SIGHUP, libc::SIGINT, libc::SIGTERM] {
                libc::signal(s, libc::SIG_DFL);
            }
            Ok(())
        })
    }
}

fn spawn_bench(args: &[&str], env: &[(&str, &str)], log: &std::path::Path) -> Run {
    let out = std::fs::File::create(log).expect("bench log");
    let bench = default_signals(&mut Command::new(BENCH))
        .args(args)
        .envs(env.iter().copied())
        .env("BENCH_OUT_DIR", std::env::temp_dir())
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log fd"))
        .stderr(out)
        .spawn()
        .expect("start proxy-bench");
    Run { bench, agent: None, strays: Vec::new(), namespaces: Vec::new(), dirs: Vec::new() }
}

#[test]
fn ctrl_c_in_the_xdp_profile_removes_its_namespace_and_its_pins() {
    if !require::root("ctrl_c_in_the_xdp_profile_removes_its_namespace_and_its_pins") {
        return;
    }
    let log = std::env::temp_dir().join(format!("interrupt-xdp-{}.log", std::process::id()));
    let (ns_before, mounts_before) = (namespaces(), bpf_mounts());
    let mut run = spawn_bench(&["profile", "--xdp"], &[], &log);
    // Its node and pins are in place; its programs load and measure for seconds after. (The
    // other test of this file runs beside this one: only the profile's own, `pxb-`, count.)
    let (ns, mounts) = wait_for(&mut run.bench, &log, Duration::from_secs(120), "the profile's namespace and bpffs", || {
        let ns: Vec<String> = namespaces().difference(&ns_before).filter(|n| n.starts_with("pxb-")).cloned().collect();
        let mounts: Vec<PathBuf> =
            bpf_mounts().difference(&mounts_before).filter(|m| m.to_string_lossy().contains("/pxb-")).cloned().collect();
        (!ns.is_empty() && !mounts.is_empty()).then_some((ns, mounts))
    });
    run.namespaces.clone_from(&ns);
    run.dirs.clone_from(&mounts);
    interrupt(&mut run.bench, &log, libc::SIGINT, false);
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
    // Two sizes: the signal comes while the first is being programmed, long before the end.
    let mut run = spawn_bench(&["connect"], &[("PROXY_BENCH_MODES", "ebpf"), ("PROXY_BENCH_SIZES", "1000,10000")], &log);
    let pid = run.bench.id();
    // The lab's agent is running and has pinned its maps.
    let (agent, lab_dir) = wait_for(&mut run.bench, &log, Duration::from_secs(300), "the lab's agent with its pins", || {
        children_of(pid).into_iter().find_map(|child| {
            let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).ok()?;
            let args: Vec<String> = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
            let root = PathBuf::from(args.iter().skip_while(|a| *a != "--bpffs-root").nth(1)?);
            let dir = root.parent()?.to_path_buf();
            bpf_mounts().contains(&root).then_some((child, dir))
        })
    });
    run.agent = Some((agent, lab_dir.clone()));
    run.strays.push((agent, lab_dir.to_string_lossy().into_owned()));
    run.dirs.push(lab_dir.clone());
    // The lab's namespaces are `pxl-<id>-...`, its directory /run/proxy-lab/<id>.
    let id = lab_dir.file_name().expect("lab id").to_string_lossy().into_owned();
    let ns: Vec<String> = namespaces().difference(&ns_before).filter(|n| n.starts_with(&format!("pxl-{id}-"))).cloned().collect();
    run.namespaces.clone_from(&ns);
    assert!(ns.len() >= 2, "the lab's node and pod namespaces: {ns:?}");
    // The agent can be stopped as the benches stop it (SIGTERM, then a wait): catching the
    // signals in the bench must not leave them blocked in what it starts.
    let status = std::fs::read_to_string(format!("/proc/{agent}/status")).expect("the agent's status");
    let blocked = status.lines().find_map(|l| l.strip_prefix("SigBlk:")).map(|m| u64::from_str_radix(m.trim(), 16).expect("SigBlk"));
    let ends = [libc::SIGHUP, libc::SIGINT, libc::SIGTERM].iter().fold(0u64, |m, s| m | 1 << (s - 1));
    assert_eq!(blocked.map(|b| b & ends), Some(0), "SIGHUP, SIGINT or SIGTERM blocked in the agent");
    // Twice, as a SIGTERM to `cargo xtask bench`'s process group reaches the bench (from the
    // sender, and passed on by xtask): the second must not cut the cleanup short.
    interrupt(&mut run.bench, &log, libc::SIGTERM, true);
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

/// Set in the process the next tests start: it is the test binary stopped, and this is the
/// name of the namespace it makes.
const STOPPED_TEST: &str = "PROXY_TESTS_INTERRUPT_STOPPED_TEST";

/// How a test binary is stopped.
#[derive(Clone, Copy)]
enum Stop {
    /// A Ctrl-C in its terminal (SIGINT).
    CtrlC,
    /// Its parent (cargo) ends without passing anything on: a SIGTERM to cargo alone, say.
    ParentEnds,
}

/// Runs test `test` of this binary again, alone, as `cargo test` runs it, stops it by `how` once
/// it has made its namespace and started a process, and requires that it cleaned both up on
/// the signal it got.
fn stop_a_test_binary(test: &str, how: Stop) {
    if let Ok(name) = std::env::var(STOPPED_TEST) {
        // The test binary run again: libtest owns `main`, so nothing called
        // `clean_up_on_signals`; the namespace's registration catches the signals. It makes a
        // namespace and starts a process, then waits to be stopped. The namespace is made on a
        // thread that ends at once, as a test's thread ends with its test: what the process
        // asked of the kernel at that registration must outlive it.
        let _ns = std::thread::spawn(|| proxy_tests::netns::Netns::create(name)).join().expect("make the namespace");
        let mut sleeper = Command::new("sleep").arg("600").spawn().expect("start sleep");
        println!("stopped test {} sleeper {}", std::process::id(), sleeper.id());
        std::thread::sleep(Duration::from_secs(120));
        let _ = sleeper.kill();
        let _ = sleeper.wait();
        panic!("not stopped within two minutes");
    }
    if !require::root(test) {
        return;
    }
    let log = std::env::temp_dir().join(format!("interrupt-test-{}-{}.log", std::process::id(), how as u8));
    let name = format!("pxi-{}-{}", std::process::id(), how as u8);
    let out = std::fs::File::create(&log).expect("test log");
    let exe = std::env::current_exe().expect("this test binary");
    let mut cmd = match how {
        Stop::CtrlC => Command::new(&exe),
        // A `sh` stands for cargo; `; exit` keeps it the test binary's parent.
        Stop::ParentEnds => {
            let mut sh = Command::new("sh");
            sh.args(["-c", "\"$0\" \"$@\"; exit"]).arg(&exe);
            sh
        }
    };
    let child = default_signals(&mut cmd)
        .args(["--exact", test, "--nocapture"])
        .env(STOPPED_TEST, &name)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log fd"))
        .stderr(out)
        .spawn()
        .expect("start the test binary");
    // The guard kills the test binary (and the shell), and its sleep if they outlive the test.
    let mut run = Run { bench: child, agent: None, strays: Vec::new(), namespaces: vec![name.clone()], dirs: Vec::new() };
    let (test_pid, sleeper) = wait_for(&mut run.bench, &log, Duration::from_secs(60), "the stopped test's namespace and process", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let pids = text.lines().find_map(|l| l.strip_prefix("stopped test "))?;
        let (test_pid, sleeper) = pids.split_once(" sleeper ")?;
        let pids = (test_pid.trim().parse::<u32>().ok()?, sleeper.trim().parse::<u32>().ok()?);
        namespaces().contains(&name).then_some(pids)
    });
    run.strays = vec![(test_pid, exe.to_string_lossy().into_owned()), (sleeper, "sleep\x00600\x00".into())];
    // A process that is no child of ours is gone from /proc once init has reaped it, or a
    // zombie until then.
    let ended = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
    };
    match how {
        // It must end by the SIGINT, once it has cleaned up.
        Stop::CtrlC => interrupt(&mut run.bench, &log, libc::SIGINT, false),
        Stop::ParentEnds => {
            // SAFETY: ending our child, the test binary's parent, as a SIGTERM ends cargo.
            unsafe { libc::kill(run.bench.id() as i32, libc::SIGKILL) };
            let _ = run.bench.wait();
            let t = Instant::now();
            while !ended(test_pid) {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                assert!(t.elapsed() < Duration::from_secs(60), "the test binary did not end within a minute of its parent:\n{log}");
                std::thread::sleep(Duration::from_millis(50));
            }
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let said = format!("signal {}: removing the namespaces", libc::SIGTERM);
            assert!(text.contains(&said), "its parent's end came as a SIGTERM, and it cleaned up:\n{text}");
        }
    }
    assert!(!namespaces().contains(&name), "namespace {name} left behind");
    // Stopped by the stopped test (a process it left would live on under init).
    assert!(ended(sleeper), "its process {sleeper} still running");
    let _ = std::fs::remove_file(&log);
}

#[test]
fn ctrl_c_in_a_test_binary_removes_the_namespaces_of_the_tests_it_stopped() {
    stop_a_test_binary("ctrl_c_in_a_test_binary_removes_the_namespaces_of_the_tests_it_stopped", Stop::CtrlC);
}

#[test]
fn a_test_binary_whose_cargo_ends_removes_the_namespaces_of_its_tests() {
    stop_a_test_binary("a_test_binary_whose_cargo_ends_removes_the_namespaces_of_its_tests", Stop::ParentEnds);
}
