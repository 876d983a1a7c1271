//! Project tasks: `cargo xtask <setup|build|run|test|bench>`.
//!
//! Every task runs `setup` first. Setup is idempotent and quick when everything is present; on
//! a fresh machine it installs what the build and the tests need: the nightly `rust-src`
//! component, `bpf-linker` linked against the nightly toolchain's own LLVM, and the Debian
//! packages the tests use. This crate uses only std so it builds before any of that exists.

use std::{
    env,
    path::{Path, PathBuf},
    process::{exit, Command, ExitStatus, Stdio},
};

/// Debian packages the lab, the tests and the tools they call need.
const PACKAGES: &[(&str, &str)] = &[
    ("iproute2", "ip: network namespaces, veth pairs and routes of the test lab"),
    ("bpftool", "dumping pinned maps in tests and by hand"),
    ("iptables", "netfilter tools (fallback modes, benchmarks)"),
    ("nftables", "netfilter tools (fallback modes, benchmarks)"),
    ("conntrack", "the netfilter modes delete stale UDP conntrack entries, as kube-proxy does"),
    ("iperf3", "traffic generation in benchmarks"),
    ("linux-perf", "`proxy-bench profile --where`: where a datapath path's time goes"),
    ("ethtool", "turning checksum offload off on lab veths, so XDP sees complete checksums as on a wire"),
    ("ipvsadm", "IPVS mode (run in the qemu guest: this kernel has no IPVS)"),
    ("ipset", "IPVS mode's sets"),
    ("qemu-system-x86", "the guest that runs the IPVS conformance suite on Debian's kernel"),
    ("busybox-static", "the IPVS guest's initramfs"),
    ("cpio", "packing the IPVS guest's initramfs"),
    ("kmod", "depmod/modprobe for the IPVS guest's kernel modules"),
    ("buildah", "building the agent's image (cargo xtask image)"),
    ("debootstrap", "a Debian 12 base for the image where no registry is reachable"),
    ("runc", "the container test runs the image the way kubelet runs the DaemonSet"),
    ("ca-certificates", "the container test's ServiceAccount CA file"),
];
const BPF_LINKER_VERSION: &str = "0.13.0";

type Result<T = ()> = std::result::Result<T, String>;

fn main() {
    interrupt::catch();
    let args: Vec<String> = env::args().skip(1).collect();
    let (task, rest) = match args.split_first() {
        Some((t, r)) => (t.as_str(), r),
        None => ("help", &[][..]),
    };
    let result = match task {
        "setup" if rest.iter().any(|a| a == "--toolchain") => nightly_rust_src().and_then(|()| bpf_linker()),
        "setup" => setup(),
        "image" => setup().and_then(|()| image(rest)),
        "build" => setup().and_then(|()| build(rest)),
        "run" => setup().and_then(|()| run_demo(rest)),
        "test" => setup().and_then(|()| test(rest)),
        "bench" => setup().and_then(|()| bench(rest)),
        "fuzz" => setup().and_then(|()| fuzz(rest)),
        "help" | "-h" | "--help" => {
            print_help();
            Ok(())
        }
        other => Err(format!("unknown task {other:?}; run `cargo xtask help`")),
    };
    // A task that failed because a signal stopped its command ends by that signal.
    interrupt::end_if_interrupted();
    if let Err(e) = result {
        eprintln!("xtask {task}: {e}");
        exit(1);
    }
}

fn print_help() {
    println!(
        "cargo xtask <task>\n\n\
         \x20 setup   install what the build and tests need (rustfmt, clippy, nightly rust-src, bpf-linker, Debian packages);\n\
         \x20         `--toolchain`: only what building the agent needs (no Debian packages)\n\
         \x20 image   the agent's container image (deploy/Containerfile) as localhost/proxy-agent:dev;\n\
         \x20         `--base IMAGE` for another runtime base\n\
         \x20 build   build the agent and the lab binaries\n\
         \x20 run     the demo: a lab of network namespaces, the agent on examples/, traffic; Ctrl-C ends it\n\
         \x20         `cargo xtask run -- <agent arguments>` runs the agent on this node instead,\n\
         \x20         e.g. `cargo xtask run -- run --kubeconfig ~/.kube/config`\n\
         \x20 test    every test (run as root: the lab and the eBPF tests need it), after `cargo fmt --check`\n\
         \x20         and clippy with warnings as errors; `cargo xtask test <filter>` runs the tests only\n\
         \x20 fuzz    mutated frames through every eBPF program, longer than the test's fixed seed:\n\
         \x20         `--frames N` (2,000,000), `--seed S` (new each run; printed, to replay a failure)\n\
         \x20 bench   benchmarks; `cargo xtask bench datapath` for per-packet cost, `footprint` for the agent at 30,000 Services,\n\
         \x20         `connect` for new-connection latency through every mode at 1k, 10k and 30k Services;\n\
         \x20         every run ends with target/bench/report.html (tables and plots of all figures there)"
    );
}

fn cargo() -> Command {
    Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn status(cmd: &mut Command) -> Result<ExitStatus> {
    interrupt::end_if_interrupted();
    interrupt::wait(cmd.spawn().map_err(|e| format!("running {cmd:?}: {e}"))?).map_err(|e| format!("waiting for {cmd:?}: {e}"))
}

fn check(cmd: &mut Command) -> Result {
    let st = status(cmd)?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed ({st})"))
    }
}

fn output(cmd: &mut Command) -> Result<String> {
    interrupt::end_if_interrupted();
    let child =
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().map_err(|e| format!("running {cmd:?}: {e}"))?;
    let out = interrupt::wait_with_output(child).map_err(|e| format!("waiting for {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed ({})", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn is_root() -> bool {
    // std has no geteuid; /proc/self/status carries it without a libc dependency.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(2) == Some("0")))
        .unwrap_or(false)
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

// ---------------------------------------------------------------------------------------------
// setup

fn setup() -> Result {
    lint_components()?;
    nightly_rust_src()?;
    bpf_linker()?;
    packages()?;
    python_tools()
}

/// kubernetes-validate (PyPI): the tests check deploy/'s manifests against Kubernetes' schemas
/// with it, offline.
fn python_tools() -> Result {
    if Command::new("kubernetes-validate").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    {
        return Ok(());
    }
    println!("setup: installing kubernetes-validate (PyPI) to check deploy/'s manifests");
    check(Command::new("python3").args(["-m", "pip", "install", "--quiet", "--root-user-action=ignore", "kubernetes-validate==1.37.0"]))
}

/// rustfmt and clippy on the toolchain that builds the agent: the full test run checks the
/// house style with them.
fn lint_components() -> Result {
    let installed = output(Command::new("rustup").args(["component", "list", "--installed"])).unwrap_or_default();
    for c in ["rustfmt", "clippy"] {
        if !installed.lines().any(|l| l.starts_with(c)) {
            println!("setup: adding {c} (the test run checks formatting and lints)");
            check(Command::new("rustup").args(["component", "add", c]))?;
        }
    }
    Ok(())
}

fn nightly_rust_src() -> Result {
    let toolchains = output(Command::new("rustup").args(["toolchain", "list"]))
        .map_err(|e| format!("{e}\nrustup is needed to build the eBPF programs with the nightly toolchain"))?;
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        println!("setup: installing the nightly toolchain (the eBPF programs need -Z build-std)");
        check(Command::new("rustup").args(["toolchain", "install", "nightly", "--profile", "minimal", "--component", "rust-src"]))?;
    }
    let installed = output(Command::new("rustup").args(["component", "list", "--toolchain", "nightly", "--installed"]))?;
    if !installed.lines().any(|l| l.starts_with("rust-src")) {
        println!("setup: adding rust-src to nightly (to build core for the bpf target)");
        check(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))?;
    }
    Ok(())
}

/// The nightly sysroot, its LLVM major version and the name of its LLVM shared library.
fn nightly_llvm() -> Result<(PathBuf, String, String)> {
    let sysroot = PathBuf::from(output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?.trim());
    let vv = output(Command::new("rustc").args(["+nightly", "-vV"]))?;
    let major = vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .ok_or("`rustc +nightly -vV` reports no LLVM version")?
        .to_string();
    let prefix = format!("libLLVM-{major}-");
    let lib = std::fs::read_dir(sysroot.join("lib"))
        .map_err(|e| format!("reading {}: {e}", sysroot.join("lib").display()))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .find(|n| n.starts_with(&prefix) && n.ends_with(".so"))
        .ok_or_else(|| {
            format!("no {prefix}*.so in {}/lib: the nightly toolchain ships no LLVM library to link bpf-linker against", sysroot.display())
        })?;
    let name = lib.trim_start_matches("lib").trim_end_matches(".so").to_string();
    Ok((sysroot, major, name))
}

/// True when the installed bpf-linker runs and loads its LLVM from the current nightly.
fn bpf_linker_matches(sysroot: &Path) -> bool {
    let Ok(path) = output(Command::new("sh").args(["-c", "command -v bpf-linker"])) else { return false };
    let Ok(ldd) = output(Command::new("ldd").arg(path.trim())) else { return false };
    let llvm: Vec<&str> = ldd.lines().filter(|l| l.contains("libLLVM")).collect();
    !llvm.is_empty()
        && llvm.iter().all(|l| !l.contains("not found") && l.contains(&*sysroot.to_string_lossy()))
        && Command::new("bpf-linker").arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success())
}

fn bpf_linker() -> Result {
    let (sysroot, major, lib) = nightly_llvm()?;
    if bpf_linker_matches(&sysroot) {
        return Ok(());
    }
    println!("setup: building bpf-linker {BPF_LINKER_VERSION} against nightly's LLVM {major} ({lib}); about a minute");
    let libdir = sysroot.join("lib");
    let rustflags = format!("-L {} -l dylib={lib} -C link-arg=-Wl,-rpath,{}", libdir.display(), libdir.display());
    check(
        cargo()
            .args(["install", "--force", &format!("bpf-linker@{BPF_LINKER_VERSION}"), "--no-default-features"])
            .args(["--features", &format!("llvm-{major},no-llvm-linking")])
            .env("RUSTFLAGS", rustflags),
    )
    .map_err(|e| {
        format!(
            "{e}\nbpf-linker could not be built against LLVM {major}. If bpf-linker {BPF_LINKER_VERSION} has no \
             llvm-{major} feature, a newer bpf-linker is needed for this nightly; or pin an older nightly."
        )
    })?;
    if !bpf_linker_matches(&sysroot) {
        return Err("bpf-linker was installed but is not on PATH or does not load nightly's LLVM; add ~/.cargo/bin to PATH".into());
    }
    Ok(())
}

fn packages() -> Result {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .map(|(p, _)| *p)
        .filter(|p| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        let why: Vec<String> = PACKAGES.iter().filter(|(p, _)| missing.contains(p)).map(|(p, w)| format!("  {p}: {w}")).collect();
        return Err(format!(
            "missing Debian packages:\n{}\ninstall them with `sudo apt-get install -y {}` or run this task as root",
            why.join("\n"),
            missing.join(" ")
        ));
    }
    println!("setup: installing {}", missing.join(" "));
    check(Command::new("apt-get").args(["update", "-qq"]))?;
    check(
        Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

// ---------------------------------------------------------------------------------------------
// tasks

fn build(extra: &[String]) -> Result {
    check(cargo().current_dir(workspace_root()).args(["build", "--bins"]).args(extra))
}

fn require_root(what: &str) -> Result {
    if is_root() {
        Ok(())
    } else {
        Err(format!("{what} creates network namespaces and loads eBPF programs: run it as root (`sudo -E cargo xtask ...`)"))
    }
}

/// `cargo xtask run`: the demo. `cargo xtask run -- <agent arguments>`: the agent itself on
/// this node, e.g. `cargo xtask run -- run --kubeconfig ~/.kube/config`.
fn run_demo(extra: &[String]) -> Result {
    if let Some(("--", agent_args)) = extra.split_first().map(|(a, rest)| (a.as_str(), rest)) {
        return run_agent(agent_args);
    }
    require_root("the demo")?;
    check(cargo().current_dir(workspace_root()).args(["build", "-p", "proxy-tests", "--bins"]))?;
    check(cargo().current_dir(workspace_root()).args(["run", "-q", "-p", "proxy-tests", "--bin", "proxy-demo", "--"]).args(extra))
}

fn run_agent(args: &[String]) -> Result {
    check(cargo().current_dir(workspace_root()).args(["build", "-p", "proxy-agent", "--bin", "proxy-agent"]))?;
    let bin = target_dir()?.join("debug").join("proxy-agent");
    if !is_root() {
        println!("xtask run: not root; the agent will say which capabilities it lacks (run with sudo -E for the eBPF mode)");
    }
    check(Command::new(&bin).args(args))
}

fn test(extra: &[String]) -> Result {
    if is_root() {
        // The container test runs the image as kubelet would: it must hold this tree's agent.
        image(&[])?;
    }
    if extra.is_empty() {
        lint()?;
    }
    let mut cmd = cargo();
    cmd.current_dir(workspace_root()).arg("test").args(extra);
    if is_root() {
        // Root can run everything: a test that finds it cannot is a failure, not a skip.
        cmd.env("PROXY_TESTS_STRICT", "1");
    } else {
        println!("xtask test: not root; tests that need root (eBPF, network namespaces) will say so and not run");
    }
    check(&mut cmd)
}

/// The house style, before the full test run: rustfmt's layout (rustfmt.toml) and no clippy
/// warning, in every crate but the eBPF one (it builds for the bpf target only, through the
/// agent's build script).
fn lint() -> Result {
    println!("xtask test: cargo fmt --check, then clippy with warnings as errors");
    check(cargo().current_dir(workspace_root()).args(["fmt", "--all", "--", "--check"]))
        .map_err(|e| format!("{e}\nformatting differs from rustfmt.toml's: run `cargo fmt --all`"))?;
    check(cargo().current_dir(workspace_root()).args([
        "clippy",
        "-p",
        "proxy-agent",
        "-p",
        "proxy-common",
        "-p",
        "proxy-tests",
        "-p",
        "xtask",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))
}

/// `cargo xtask fuzz [--frames N] [--seed S]`: the fuzz test with a new seed and more frames.
fn fuzz(extra: &[String]) -> Result {
    require_root("running eBPF programs with BPF_PROG_TEST_RUN")?;
    let arg = |name: &str| extra.iter().position(|a| a == name).and_then(|i| extra.get(i + 1)).cloned();
    let frames = arg("--frames").unwrap_or_else(|| "2000000".into());
    let seed = arg("--seed").unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        (now.as_nanos() as u64 | 1).to_string()
    });
    println!("fuzz: {frames} frames, seed {seed} (replay with --seed {seed})");
    check(
        cargo()
            .current_dir(workspace_root())
            .args(["test", "-p", "proxy-tests", "--test", "fuzz", "--", "--nocapture"])
            .env("PROXY_FUZZ_FRAMES", &frames)
            .env("PROXY_FUZZ_SEED", &seed)
            .env("PROXY_TESTS_STRICT", "1"),
    )
}

// ---------------------------------------------------------------------------------------------
// image

/// What `cargo xtask image` makes (in the containers-storage that buildah and podman share).
pub const IMAGE: &str = "localhost/proxy-agent:dev";
/// The runtime base deploy/Containerfile names by default.
const DEFAULT_BASE: &str = "docker.io/library/debian:bookworm-slim";
/// The Debian 12 base made with debootstrap where no registry is reachable.
const LOCAL_BASE: &str = "localhost/proxy-agent-base:bookworm";

fn buildah() -> Command {
    Command::new("buildah")
}

fn image_exists(name: &str) -> bool {
    buildah().args(["inspect", "--type", "image", name]).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// `cargo xtask image [--base IMAGE]`: the release agent built here (a Debian 12 host, as the
/// base is), then deploy/Containerfile's `prebuilt` path with buildah, tagged `IMAGE`.
fn image(extra: &[String]) -> Result {
    require_root("building the image (buildah, debootstrap)")?;
    let base = match extra.iter().position(|a| a == "--base") {
        Some(i) => extra.get(i + 1).ok_or("--base needs an image name")?.clone(),
        None => DEFAULT_BASE.to_string(),
    };
    let root = workspace_root();
    check(cargo().current_dir(&root).args(["build", "--release", "-p", "proxy-agent", "--bin", "proxy-agent"]))?;
    let base = runtime_base(&base)?;
    println!("image: building {IMAGE} on {base}");
    check(
        buildah()
            .current_dir(&root)
            .args(["bud", "--isolation", "chroot", "--network", "host", "--layers=false", "-f", "deploy/Containerfile"])
            .args(["--build-arg", &format!("BASE={base}"), "--build-arg", "AGENT_FROM=prebuilt", "-t", IMAGE, "."]),
    )?;
    // The previous build's image and the prebuilt stage are dangling now.
    let _ = buildah().args(["rmi", "--prune"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    let json = output(buildah().args(["images", "--json", IMAGE]))?;
    let size = json.lines().find_map(|l| l.trim().strip_prefix("\"size\": \"")).map(|s| s.trim_end_matches(['"', ','])).unwrap_or("?");
    println!("image: {IMAGE} built, {size}");
    Ok(())
}

/// The base to build on: `wanted` if it is here or can be pulled; for the default base where
/// no registry answers, a Debian 12 made with debootstrap from the Debian mirror.
fn runtime_base(wanted: &str) -> Result<String> {
    if image_exists(wanted) {
        return Ok(wanted.to_string());
    }
    if buildah().args(["pull", "--quiet", wanted]).stdout(Stdio::null()).status().is_ok_and(|s| s.success()) {
        return Ok(wanted.to_string());
    }
    if wanted != DEFAULT_BASE {
        return Err(format!("the base image {wanted} is neither here nor pullable"));
    }
    if image_exists(LOCAL_BASE) {
        println!("image: no registry reachable; using {LOCAL_BASE} (Debian 12 from debootstrap)");
        return Ok(LOCAL_BASE.to_string());
    }
    let mirror = env::var("PROXY_DEBIAN_MIRROR").unwrap_or_else(|_| "http://deb.debian.org/debian".into());
    println!("image: no registry reachable; making {LOCAL_BASE} with debootstrap from {mirror} (about half a minute)");
    let ctr = output(buildah().args(["from", "scratch"]))?.trim().to_string();
    let made = (|| {
        let mnt = PathBuf::from(output(buildah().args(["mount", &ctr]))?.trim());
        check(Command::new("debootstrap").args(["--variant=minbase", "bookworm"]).arg(&mnt).arg(&mirror))?;
        // What a slim image leaves out: package caches and lists, documentation.
        for dir in ["var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info"] {
            let _ = std::fs::remove_dir_all(mnt.join(dir));
        }
        let _ = std::fs::create_dir_all(mnt.join("var/lib/apt/lists/partial"));
        let _ = std::fs::create_dir_all(mnt.join("var/cache/apt/archives/partial"));
        check(buildah().args(["config", "--cmd", "/bin/bash", &ctr]))?;
        check(buildah().args(["commit", "--quiet", &ctr, LOCAL_BASE]).stdout(Stdio::null()))
    })();
    let _ = buildah().args(["rm", &ctr]).stdout(Stdio::null()).status();
    made.map(|()| LOCAL_BASE.to_string())
}

fn target_dir() -> Result<PathBuf> {
    let meta = output(cargo().current_dir(workspace_root()).args(["metadata", "--format-version", "1", "--no-deps"]))?;
    let key = "\"target_directory\":\"";
    let start = meta.find(key).ok_or("cargo metadata has no target_directory")? + key.len();
    let end = meta[start..].find('"').ok_or("malformed cargo metadata")? + start;
    Ok(PathBuf::from(&meta[start..end]))
}

fn bench(extra: &[String]) -> Result {
    require_root("the benchmark")?;
    let out = target_dir()?.join("bench");
    std::fs::create_dir_all(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    check(cargo().current_dir(workspace_root()).args(["build", "--release", "-p", "proxy-tests", "--bins"]))?;
    // No argument: every benchmark.
    let which = extra.to_vec();
    check(
        cargo()
            .current_dir(workspace_root())
            .args(["run", "-q", "--release", "-p", "proxy-tests", "--bin", "proxy-bench", "--"])
            .args(&which)
            .env("BENCH_OUT_DIR", &out),
    )
}

/// Ctrl-C and a closed terminal reach the whole foreground process group: the task's child
/// (cargo, the demo, a benchmark) gets them itself and cleans up (its namespaces, pins and
/// agents), so xtask waits for it to end and then ends by the same signal; the prompt comes
/// back once the cleanup is done. A second Ctrl-C ends xtask at once. A SIGTERM is passed on
/// to the child, once (one sent to the process group reaches the child twice then; ours ignore
/// a second SIGTERM while they clean up). The child is the demo or the benchmark itself
/// (`cargo run` becomes the program), but for `test` it is cargo, which does not pass a signal
/// on to its test binary. Only std here (see the top): the few libc calls are declared by hand.
mod interrupt {
    use std::{
        io,
        process::{Child, ExitStatus, Output},
        sync::atomic::{AtomicBool, AtomicI32, Ordering},
    };

    const SIGHUP: i32 = 1;
    const SIGINT: i32 = 2;
    const SIGTERM: i32 = 15;
    const SIG_DFL: usize = 0;
    const SIG_IGN: usize = 1;

    extern "C" {
        fn signal(signum: i32, handler: usize) -> usize;
        /// Only to read an action: `old` is glibc's `struct sigaction`, whose first field is
        /// the handler (152 bytes on x86_64; the buffer given is larger).
        fn sigaction(signum: i32, act: *const u8, old: *mut u64) -> i32;
        fn kill(pid: i32, sig: i32) -> i32;
        fn raise(sig: i32) -> i32;
    }

    /// The child being waited for, 0 if none.
    static CHILD: AtomicI32 = AtomicI32::new(0);
    /// The signal that came last, 0 if none.
    static SIGNAL: AtomicI32 = AtomicI32::new(0);
    /// Set once a SIGTERM was passed on.
    static FORWARDED: AtomicBool = AtomicBool::new(false);

    /// Passes a SIGTERM on to the child being waited for, unless one was already.
    fn forward(child: i32) {
        if child > 0 && !FORWARDED.swap(true, Ordering::SeqCst) {
            // SAFETY: signals the child this process started and has not reaped yet.
            unsafe { kill(child, SIGTERM) };
        }
    }

    extern "C" fn on_signal(sig: i32) {
        // Only atomics, kill, signal and raise: async-signal-safe.
        let before = SIGNAL.swap(sig, Ordering::SeqCst);
        if sig == SIGINT && before != 0 {
            // Ctrl-C again: end now, as without us.
            // SAFETY: the default action, delivered to ourselves.
            unsafe {
                signal(sig, SIG_DFL);
                raise(sig);
            }
        }
        if sig == SIGTERM {
            forward(CHILD.load(Ordering::SeqCst));
        }
    }

    /// Catches SIGINT, SIGTERM and SIGHUP, but not one ignored from the start (`nohup`). The
    /// handler is glibc's `signal`'s: it stays, and a wait it interrupts goes on. Children
    /// start with the default action (exec resets a handler).
    pub fn catch() {
        for sig in [SIGHUP, SIGINT, SIGTERM] {
            let mut old = [0u64; 32];
            // SAFETY: reads the action into a buffer larger than `struct sigaction`; then
            // installs a handler that only touches atomics and calls kill, signal and raise.
            unsafe {
                if sigaction(sig, std::ptr::null(), old.as_mut_ptr()) != 0 || old[0] as usize == SIG_IGN {
                    continue;
                }
                signal(sig, on_signal as *const () as usize);
            }
        }
    }

    /// Ends xtask by the signal that came, if one did, as it would have ended without the
    /// handler (called before each command too: a Ctrl-C between two stops the task).
    pub fn end_if_interrupted() {
        let sig = SIGNAL.load(Ordering::SeqCst);
        if sig != 0 {
            // SAFETY: the default action, delivered to ourselves; exit if it returns.
            unsafe {
                signal(sig, SIG_DFL);
                raise(sig);
            }
            std::process::exit(128 + sig);
        }
    }

    fn waiting<T>(child: Child, wait: impl FnOnce(Child) -> io::Result<T>) -> io::Result<T> {
        CHILD.store(child.id() as i32, Ordering::SeqCst);
        // A SIGTERM that came before the child's pid was known: passed on now.
        if SIGNAL.load(Ordering::SeqCst) == SIGTERM {
            forward(child.id() as i32);
        }
        let done = wait(child);
        CHILD.store(0, Ordering::SeqCst);
        end_if_interrupted();
        done
    }

    /// `Child::wait`, then the end if a signal came meanwhile.
    pub fn wait(child: Child) -> io::Result<ExitStatus> {
        waiting(child, |mut c| c.wait())
    }

    /// `Child::wait_with_output`, then the end if a signal came meanwhile.
    pub fn wait_with_output(child: Child) -> io::Result<Output> {
        waiting(child, Child::wait_with_output)
    }
}

#[cfg(test)]
mod tests {
    use std::{
        os::unix::process::{CommandExt, ExitStatusExt},
        path::{Path, PathBuf},
        process::{Child, Command, ExitStatus},
        time::{Duration, Instant},
    };

    extern "C" {
        fn kill(pid: i32, sig: i32) -> i32;
        fn signal(signum: i32, handler: usize) -> usize;
    }

    const SIGINT: i32 = 2;
    const SIGTERM: i32 = 15;

    /// Set in the process a test starts: it is xtask running a task's command; the value names
    /// the file the command writes to, and how long its cleanup takes.
    const AS_XTASK: &str = "XTASK_TEST_INTERRUPT";

    /// A task's command that cleans up for `secs` after Ctrl-C or a SIGTERM, as the bench and
    /// the demo do, and notes when it is done.
    fn slow_cleaner(file: &Path, secs: &str) -> Command {
        let f = file.display();
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(format!(
            "trap 'sleep {secs}; echo INT done >> {f}; exit 130' INT; \
             trap 'sleep {secs}; echo TERM done >> {f}; exit 143' TERM; \
             echo started >> {f}; while :; do sleep 0.1; done"
        ));
        cmd
    }

    fn read(file: &Path) -> String {
        std::fs::read_to_string(file).unwrap_or_default()
    }

    /// This test binary run as xtask, in a process group of its own (as a terminal's
    /// foreground job); the group is killed and the file removed when it drops, however the
    /// test ends.
    struct Xtask {
        child: Child,
        file: PathBuf,
    }

    impl Xtask {
        /// Starts it for the calling test (libtest names the thread after it), with the command
        /// cleaning up for `secs`, and waits until the command runs. In the started process,
        /// acts as xtask instead and never returns (`as_xtask`).
        fn start(secs: &str) -> Self {
            as_xtask();
            let thread = std::thread::current();
            let test = thread.name().expect("libtest names the test's thread").trim_start_matches("tests::");
            let file = std::env::temp_dir().join(format!("xtask-{test}-{}", std::process::id()));
            let _ = std::fs::remove_file(&file);
            let mut cmd = Command::new(std::env::current_exe().expect("this test binary"));
            cmd.args(["--exact", &format!("tests::{test}"), "--nocapture"])
                .env(AS_XTASK, format!("{secs} {}", file.display()))
                .process_group(0);
            // SAFETY: only `signal` between fork and exec. The signals start at their default
            // action even if this test runs with them ignored (a background job of a script).
            unsafe {
                cmd.pre_exec(|| {
                    for sig in [1, SIGINT, SIGTERM] {
                        signal(sig, 0);
                    }
                    Ok(())
                });
            }
            let xtask = Self { child: cmd.spawn().expect("start xtask"), file };
            let t = Instant::now();
            while !read(&xtask.file).contains("started") {
                assert!(t.elapsed() < Duration::from_secs(30), "the command did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
            xtask
        }

        fn pid(&self) -> i32 {
            self.child.id() as i32
        }

        /// How it ended (within 30 s) and what the command had written by then.
        fn end(&mut self) -> (ExitStatus, String) {
            let t = Instant::now();
            loop {
                if let Some(s) = self.child.try_wait().expect("wait for xtask") {
                    return (s, read(&self.file));
                }
                assert!(t.elapsed() < Duration::from_secs(30), "xtask did not end within 30 s; its command wrote {:?}", read(&self.file));
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    impl Drop for Xtask {
        fn drop(&mut self) {
            // SAFETY: signals the process group this test made.
            unsafe { kill(-self.pid(), 9) };
            let _ = self.child.wait();
            let _ = std::fs::remove_file(&self.file);
        }
    }

    /// In the started process: xtask's handling, then the task's command, waited for as every
    /// command of a task is; the signal ends the process. Elsewhere, nothing.
    fn as_xtask() {
        let Some(value) = std::env::var_os(AS_XTASK) else { return };
        let value = value.to_string_lossy().into_owned();
        let (secs, file) = value.split_once(' ').expect("seconds and file");
        super::interrupt::catch();
        let _ = super::status(&mut slow_cleaner(Path::new(file), secs));
        super::interrupt::end_if_interrupted();
        panic!("xtask went on after the signal");
    }

    #[test]
    fn ctrl_c_waits_for_the_tasks_cleanup_then_ends_xtask_by_it() {
        let mut xtask = Xtask::start("0.5");
        // Ctrl-C: the terminal signals the whole foreground group.
        // SAFETY: the test's own process group.
        unsafe { kill(-xtask.pid(), SIGINT) };
        let (status, seen) = xtask.end();
        assert!(seen.contains("INT done"), "xtask ended before its command had cleaned up: {seen:?}");
        assert_eq!(status.signal(), Some(SIGINT), "xtask's end ({status})");
    }

    #[test]
    fn a_second_ctrl_c_ends_xtask_at_once() {
        let mut xtask = Xtask::start("20");
        // SAFETY: the test's own process group, then its xtask.
        unsafe { kill(-xtask.pid(), SIGINT) };
        std::thread::sleep(Duration::from_millis(200));
        unsafe { kill(xtask.pid(), SIGINT) };
        let (status, seen) = xtask.end();
        assert!(!seen.contains("INT done"), "xtask waited for the cleanup after the second Ctrl-C: {seen:?}");
        assert_eq!(status.signal(), Some(SIGINT), "xtask's end ({status})");
    }

    #[test]
    fn a_sigterm_to_xtask_alone_reaches_the_task_and_ends_xtask_after_it() {
        let mut xtask = Xtask::start("0.5");
        // SAFETY: the test's own child.
        unsafe { kill(xtask.pid(), SIGTERM) };
        let (status, seen) = xtask.end();
        assert!(seen.contains("TERM done"), "the command did not get the SIGTERM, or xtask did not wait: {seen:?}");
        assert_eq!(status.signal(), Some(SIGTERM), "xtask's end ({status})");
    }
}
