//! `cargo xtask run`: the agent on the bundled examples in a lab of network namespaces, with
//! traffic, until Ctrl-C. `--once` stops after the first round (used by the tests).

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use proxy_agent::inspect;
use proxy_tests::{
    lab::{sibling, sock, Lab, DNS_VIP},
    servers::{tcp_ask, udp_ask},
};

const WEB: &str = "10.96.0.10:80";
const EMPTY: &str = "10.96.0.99:80";

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: i32) {
    STOP.store(true, Ordering::Relaxed);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let once = args.iter().any(|a| a == "--once");
    let examples = args
        .iter()
        .position(|a| a == "--manifests")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples")));
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("the demo creates network namespaces and loads eBPF programs: run it as root (`sudo -E cargo xtask run`)");
        std::process::exit(1);
    }
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }

    println!("proxy-agent demo: ClusterIP Services through eBPF, in a lab of network namespaces\n");
    let mut lab = Lab::new(sibling("proxy-lab-agent"), 3);
    let mut copied = Vec::new();
    for entry in std::fs::read_dir(&examples).unwrap_or_else(|e| panic!("reading {}: {e}", examples.display())).flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        lab.write_manifest(&name, &std::fs::read_to_string(entry.path()).expect("read example"));
        copied.push(name);
    }
    copied.sort();
    println!("Lab {}:", lab.id);
    println!("  node        namespace {:<24} runs proxy-agent (log: {})", lab.node.name, lab.log_path().display());
    println!("  client      {:<12} namespace {}", lab.client.ip, lab.client.ns.name);
    for b in &lab.backends {
        println!("  {:<11} {:<12} answers TCP :8080 and UDP :5353 with its name", b.name, b.ip);
    }
    println!("Manifests: {} from {}\n", copied.join(", "), examples.display());

    let t0 = Instant::now();
    lab.start_agent();
    lab.wait_programmed(WEB, "TCP", 3);
    lab.wait_programmed(DNS_VIP, "UDP", 3);
    lab.wait_programmed(EMPTY, "TCP", 0);
    println!("The agent programmed the Services {} ms after it started.\n", t0.elapsed().as_millis());

    println!("TCP to web {WEB}, a new connection per request:");
    let mut spread: BTreeMap<String, usize> = BTreeMap::new();
    for i in 1..=12 {
        match tcp_ask(&lab.client.ns, sock(WEB)) {
            Ok(a) => {
                println!("  request {i:>2} -> {}   (it saw the client as {})", a.backend, a.peer);
                *spread.entry(a.backend).or_default() += 1;
            }
            Err(e) => println!("  request {i:>2} failed: {e}"),
        }
    }
    let spread: Vec<String> = spread.iter().map(|(b, n)| format!("{b} x{n}")).collect();
    println!("  spread: {}\n", spread.join(", "));

    println!("UDP to dns {DNS_VIP}:");
    for i in 1..=4 {
        match udp_ask(&lab.client.ns, sock(DNS_VIP)) {
            Ok((a, from)) => println!("  query {i} -> {}, reply from {from}", a.backend),
            Err(e) => println!("  query {i} failed: {e}"),
        }
    }

    println!("\nTCP to maintenance {EMPTY}, a Service without endpoints:");
    let t = Instant::now();
    match tcp_ask(&lab.client.ns, sock(EMPTY)) {
        Err(e) => println!(
            "  {e}, after {:.1} ms (ICMP port unreachable from the datapath, as kube-proxy's REJECT)",
            t.elapsed().as_secs_f64() * 1e3
        ),
        Ok(a) => println!("  unexpectedly answered by {}", a.backend),
    }

    println!("\nWhat is programmed (`proxy-agent inspect`):\n");
    match lab.inspect() {
        Ok(r) => {
            for line in inspect::render(&r).lines() {
                println!("  {line}");
            }
        }
        Err(e) => println!("  {e}"),
    }

    if !once {
        println!("\nThe lab stays up. Edit {}/*.yaml and watch the traffic follow;", lab.manifests().display());
        println!("inspect it with: {} inspect --bpffs-root {}", sibling("proxy-lab-agent").display(), lab.bpffs().display());
        println!("Press Ctrl-C to stop and remove the lab.\n");
        while !STOP.load(Ordering::Relaxed) {
            let web = tcp_ask(&lab.client.ns, sock(WEB)).map(|a| a.backend).unwrap_or_else(|e| e.to_string());
            let dns = udp_ask(&lab.client.ns, sock(DNS_VIP)).map(|(a, _)| a.backend).unwrap_or_else(|e| e.to_string());
            println!("  web -> {web:<24} dns -> {dns}");
            for _ in 0..20 {
                if STOP.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    drop(lab);
    println!("\nLab removed: namespaces, interfaces, pinned programs and maps.");
}
