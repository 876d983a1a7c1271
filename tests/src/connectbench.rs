//! `cargo xtask bench connect`: what a new connection costs through each mode as Services grow.
//! A client pod opens new TCP connections (the time `connect()` takes: SYN to SYN-ACK through
//! the mode) and sends UDP requests from new sockets (request to answer) to a ClusterIP
//! Service, and opens TCP connections to its NodePort, with 1,000, 10,000 and 30,000 Services
//! x 4 endpoints programmed from the in-process API server by the agent itself, in each mode.
//! The floor is the same client reaching a backend straight.
//!
//! The Service under test is one of the N, picked at random per run (`PROXY_BENCH_SEED` fixes
//! the pick): iptables walks KUBE-SERVICES rule by rule for a connection's first packet, so its
//! place in that chain decides what iptables costs, and the run reports it. nftables and eBPF
//! look Services up in a map: no place to report.

use std::{
    net::{Ipv4Addr, SocketAddrV4, TcpStream},
    time::{Duration, Instant},
};

use serde::Serialize;

use crate::{
    apiserver::ApiServer,
    lab::{self, Lab},
    netns,
    servers::udp_ask,
};

/// New connections (and requests) timed per kind, per mode and size.
pub const SAMPLES: usize = 2000;

#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub mode: String,
    pub services: u32,
    /// Agent start -> its first complete sync (NaN for the floor, or a skipped size).
    pub program_s: f64,
    /// Where the Service under test sits (iptables: its rule's place in KUBE-SERVICES).
    pub position: String,
    /// p50, p99, p999 in microseconds: ClusterIP TCP connect, ClusterIP UDP request, NodePort
    /// TCP connect (the floor has no NodePort: NaN).
    pub cluster_tcp_us: [f64; 3],
    pub cluster_udp_us: [f64; 3],
    pub nodeport_tcp_us: [f64; 3],
    pub note: String,
}

impl Row {
    /// A row with nothing measured yet (NaN figures), and `note`.
    fn unmeasured(mode: &str, services: u32, note: String) -> Self {
        Self {
            mode: mode.into(),
            services,
            program_s: f64::NAN,
            position: String::new(),
            cluster_tcp_us: [f64::NAN; 3],
            cluster_udp_us: [f64::NAN; 3],
            nodeport_tcp_us: [f64::NAN; 3],
            note,
        }
    }
}

/// A mode as this benchmark runs it: its label and the agent's flags (None: no agent, the floor).
pub struct Variant {
    pub label: &'static str,
    pub flags: Option<&'static [&'static str]>,
}

pub const VARIANTS: [Variant; 5] = [
    Variant { label: "floor", flags: None },
    Variant { label: "ebpf", flags: Some(&["--proxy-mode", "ebpf", "--lb-map-max", "262144"]) },
    Variant { label: "nftables", flags: Some(&["--proxy-mode", "nftables"]) },
    Variant { label: "iptables-legacy", flags: Some(&["--proxy-mode", "iptables", "--iptables-backend", "legacy"]) },
    Variant { label: "iptables-nft", flags: Some(&["--proxy-mode", "iptables", "--iptables-backend", "nft"]) },
];

const NODE_PORT: u16 = 30080;
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 250, 1);
/// Where the backends' sinks listen: they accept and close at once, so no connection waits on
/// a full accept queue (the lab's echo servers poll, and a burst of new connections overflows
/// their queue into one-second SYN retransmissions).
const SINK_PORT: u16 = 9090;

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000 + i + 1)
}

/// Service `i` of `n`: ClusterIP with 4 endpoints that do not exist, except the one under
/// test, a NodePort whose endpoints are the lab's backends.
fn objects(i: u32, under_test: bool, backends: &[Ipv4Addr]) -> [String; 2] {
    let name = format!("svc-{i}");
    if under_test {
        let svc = lab::service(&name, &vip(i).to_string(), &[("http", 80, "TCP", SINK_PORT), ("dns", 53, "UDP", lab::UDP_PORT)])
            .replace("type: ClusterIP", "type: NodePort")
            .replace(&format!("    targetPort: {SINK_PORT}\n"), &format!("    targetPort: {SINK_PORT}\n    nodePort: {NODE_PORT}\n"));
        let slice =
            lab::endpoint_slice(&name, &format!("{name}-1"), backends, &[("http", SINK_PORT, "TCP"), ("dns", lab::UDP_PORT, "UDP")]);
        return [svc, slice];
    }
    let eps: Vec<Ipv4Addr> = (0..4).map(|b| Ipv4Addr::from(0x0ac8_0000 + i * 4 + b)).collect();
    [
        lab::service(&name, &vip(i).to_string(), &[("http", 80, "TCP", 8080)]),
        lab::endpoint_slice(&name, &format!("{name}-1"), &eps, &[("http", 8080, "TCP")]),
    ]
}

/// p50, p99, p999 of `samples` (microseconds).
fn percentiles(mut samples: Vec<f64>) -> [f64; 3] {
    if samples.is_empty() {
        return [f64::NAN; 3];
    }
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let at = |p: f64| samples[((samples.len() as f64 - 1.0) * p).round() as usize];
    [at(0.5), at(0.99), at(0.999)]
}

/// `SAMPLES` new TCP connections from `ns` to `to`: how long each `connect()` took, and the
/// failures (when, since the first connection, and why).
fn tcp_connects(ns: &netns::Netns, to: SocketAddrV4) -> (Vec<f64>, Vec<String>) {
    ns.run(move || {
        let start = Instant::now();
        let mut times = Vec::new();
        let mut failures = Vec::new();
        for i in 0..SAMPLES {
            let t = Instant::now();
            match TcpStream::connect_timeout(&to.into(), Duration::from_secs(2)) {
                Ok(s) => {
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                    drop(s);
                }
                Err(e) => failures.push(format!("connection {i} to {to} after {:.3} s: {e}", start.elapsed().as_secs_f64())),
            }
        }
        (times, failures)
    })
}

/// `SAMPLES` UDP requests from new sockets: send to answer, and the failures.
fn udp_requests(ns: &netns::Netns, to: SocketAddrV4) -> (Vec<f64>, Vec<String>) {
    let mut times = Vec::new();
    let mut failures = Vec::new();
    for i in 0..SAMPLES {
        let t = Instant::now();
        match udp_ask(ns, to) {
            Ok(_) => times.push(t.elapsed().as_secs_f64() * 1e6),
            Err(e) => failures.push(format!("UDP request {i} to {to}: {e}")),
        }
    }
    (times, failures)
}

/// Where rule matching finds `vip` in KUBE-SERVICES (nat), for the iptables modes.
fn position(lab: &Lab, label: &str, vip: Ipv4Addr) -> String {
    let save = match label {
        "iptables-legacy" => "iptables-legacy-save",
        "iptables-nft" => "iptables-nft-save",
        "nftables" => return "a verdict map (service-ips): no order".into(),
        "ebpf" => return "a hash map: no order".into(),
        _ => return "-".into(),
    };
    let out = lab.node.run(move || std::process::Command::new(save).args(["-t", "nat"]).output());
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    let rules: Vec<&str> = text.lines().filter(|l| l.starts_with("-A KUBE-SERVICES ")).collect();
    match rules.iter().position(|l| l.contains(&format!("-d {vip}/32"))) {
        Some(p) => format!("rule {} of {} in KUBE-SERVICES", p + 1, rules.len()),
        None => format!("not found among {} KUBE-SERVICES rules", rules.len()),
    }
}

/// Failed connections are part of the result: said, with what the agent logged meanwhile.
fn report(lab: &Lab, failures: &[String]) {
    if failures.is_empty() {
        return;
    }
    eprintln!("  {} connections failed; the first: {}", failures.len(), failures[0]);
    let log = lab.agent_log();
    let lines: Vec<&str> = log.lines().collect();
    eprintln!("  agent log (last 15 lines):\n{}", lines[lines.len().saturating_sub(15)..].join("\n"));
}

/// A small xorshift generator: the pick of the Service under test.
fn pick(seed: &mut u64, n: u32) -> u32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    (*seed % u64::from(n)) as u32
}

/// One mode at one size, in a lab of its own.
pub fn one(agent: &std::path::Path, v: &Variant, n: u32, seed: &mut u64) -> Row {
    let k = pick(seed, n);
    let mut lab = Lab::new(agent, 3);
    let backends = lab.backend_ips();
    // Connections come one after another: the queue (128) never fills at this poll.
    let sink = |ns| crate::servers::Acceptor::start(ns, (Ipv4Addr::UNSPECIFIED, SINK_PORT).into(), None, Duration::from_micros(100));
    let sinks: Vec<crate::servers::Acceptor> = lab.backends.iter().map(|p| sink(&p.ns)).collect();
    let mut row = Row::unmeasured(v.label, n, String::new());
    let Some(flags) = v.flags else {
        // The floor: straight to a backend.
        let to = SocketAddrV4::new(backends[0], SINK_PORT);
        row.cluster_tcp_us = percentiles(tcp_connects(&lab.client.ns, to).0);
        row.cluster_udp_us = percentiles(udp_requests(&lab.client.ns, SocketAddrV4::new(backends[0], lab::UDP_PORT)).0);
        row.position = "no proxy".into();
        return row;
    };
    let api = ApiServer::start(&lab.node, 0);
    api.apply(&lab::node_manifest());
    let kubeconfig = lab.dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    for i in 0..n {
        for obj in objects(i, i == k, &backends) {
            api.apply(&obj);
        }
    }
    lab.agent_log_level = "info";
    let mut args = flags.to_vec();
    args.extend(["--cluster-cidr", "10.244.0.0/16"]);
    let t = Instant::now();
    lab.start_agent_kube(&kubeconfig, &args);
    let target = SocketAddrV4::new(vip(k), 80);
    loop {
        let answers = lab.client.ns.run(move || TcpStream::connect_timeout(&target.into(), Duration::from_millis(500)).is_ok());
        if lab.agent_log().contains("initial sync done") && answers {
            break;
        }
        assert!(lab.agent_running(), "{}: the agent exited:\n{}", v.label, lab.agent_log());
        assert!(t.elapsed() < Duration::from_secs(3600), "{}: {n} Services not programmed in an hour", v.label);
        std::thread::sleep(Duration::from_millis(200));
    }
    row.program_s = t.elapsed().as_secs_f64();
    row.position = position(&lab, v.label, vip(k));
    let (times, failures) = tcp_connects(&lab.client.ns, target);
    report(&lab, &failures);
    row.cluster_tcp_us = percentiles(times);
    let (times, udp_failures) = udp_requests(&lab.client.ns, SocketAddrV4::new(vip(k), 53));
    report(&lab, &udp_failures);
    row.cluster_udp_us = percentiles(times);
    let (times, more) = tcp_connects(&lab.client.ns, SocketAddrV4::new(NODE_IP, NODE_PORT));
    report(&lab, &more);
    row.nodeport_tcp_us = percentiles(times);
    row.note = format!("svc-{k} of {n}");
    let failed = failures.len() + more.len() + udp_failures.len();
    if failed > 0 {
        row.note += &format!("; {failed} connections or requests failed");
    }
    drop(sinks);
    row
}

/// Every wanted mode at every size. Sizes projected (from the previous size's programming time,
/// scaled by the cube of the ratio) to take longer than the modes benchmark's limit
/// (`modesbench::skip_projected_over`) are skipped.
pub fn run(agent: &std::path::Path, sizes: &[u32], wanted: impl Fn(&str) -> bool, seed: u64) -> Vec<Row> {
    let mut seed = seed.max(1);
    let mut rows = Vec::new();
    for v in VARIANTS.iter().filter(|v| wanted(v.label)) {
        let mut last: Option<(u32, f64)> = None;
        for &n in if v.flags.is_none() { &sizes[..1] } else { sizes } {
            if let Some((prev, secs)) = last {
                let projected = secs * (f64::from(n) / f64::from(prev)).powi(3);
                if projected > crate::modesbench::skip_projected_over().as_secs_f64() {
                    let note = format!("not run: {prev} Services took {secs:.0} s to program, so {n} would take about {projected:.0} s");
                    eprintln!("connect: {}, {n} services: {note}", v.label);
                    rows.push(Row::unmeasured(v.label, n, note));
                    continue;
                }
            }
            eprintln!("connect: {}, {n} services x 4 endpoints...", v.label);
            let row = one(agent, v, n, &mut seed);
            eprintln!("  programmed in {:.1} s; ClusterIP connect p99 {:.0} us ({})", row.program_s, row.cluster_tcp_us[1], row.position);
            if !row.program_s.is_nan() {
                last = Some((n, row.program_s));
            }
            rows.push(row);
        }
    }
    rows
}
