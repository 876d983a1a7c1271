//! `cargo xtask bench north`: NodePort forwarding from a client through node A to a backend on
//! node B, in the two-node lab, with node A running the agent, in turn:
//! - with XDP (the default),
//! - with XDP disabled (TC only),
//! - in its iptables mode (kube-proxy's ruleset, with the iptables-legacy backend), then with
//!   the iptables-nft backend,
//! - in its nftables mode (kube-proxy's `ip kube-proxy` table).
//!
//! Each mode serves the same Services: the NodePort under test plus `filler` ClusterIP Services
//! (kube-proxy's KUBE-SERVICES chain holds one rule per cluster IP, which new connections walk).
//!
//! Packets per second: 64-byte UDP frames of 16 flows (`PROXY_BENCH_FLOWS`: `flows`) are
//! generated in the kernel with XDP live frames (BPF_PROG_TEST_RUN) as if node A's external
//! interface received them; in XDP mode the agent's own XDP program is run on them, otherwise
//! a pass-through program hands them to node A's stack (TC, or netfilter). Node B's interface
//! drops what arrives with XDP and counts it: the rate delivered to node B is node A's
//! forwarding rate.
//!
//! XDP's share of the floor is measured in `FLOOR_ROUNDS` rounds of the floor and XDP one right
//! after the other (the agent's maps stay programmed: the floor program does not use them).
//!
//! New TCP connections per second: two client threads in the external client namespace
//! connect to the NodePort and close with a reset; the backend on node B accepts and closes.

use std::{
    io,
    net::{Ipv4Addr, SocketAddrV4, SocketAddrV6, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    path::PathBuf,
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use aya::programs::{TestRun as _, TestRunAttrs, TestRunOptions, Xdp};

use crate::{
    cluster::{nodes_manifest, service, slice, Cluster},
    netns::{enter, sh, Netns},
};

const CONN_PORT: u16 = 9090;
/// Flows the generator cycles through (as in the eBPF generator).
const FLOWS: u32 = 16;

/// Flows the generator cycles through: `PROXY_BENCH_FLOWS` (at most 16,384: each takes a SNAT
/// port), else `FLOWS`. More flows than XDP's flow cache has slots a CPU (1,024) show its
/// misses; many more, the conntrack map's out of cache.
pub fn flows() -> u32 {
    std::env::var("PROXY_BENCH_FLOWS").ok().and_then(|f| f.parse().ok()).filter(|f| (1..=16_384).contains(f)).unwrap_or(FLOWS)
}
/// Rounds of the floor and XDP, one after the other, for XDP's share of the floor (odd).
const FLOOR_ROUNDS: usize = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No processing: frames go straight back out (what the lab itself costs).
    Floor,
    Xdp,
    Tc,
    /// The agent's iptables mode, iptables-legacy backend.
    Iptables,
    /// The agent's iptables mode, iptables-nft backend.
    IptablesNft,
    Nftables,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Floor => "floor (XDP_TX, no processing)",
            Mode::Xdp => "ebpf, XDP",
            Mode::Tc => "ebpf, TC only",
            Mode::Iptables => "the agent's iptables mode (iptables-legacy)",
            Mode::IptablesNft => "the agent's iptables mode (iptables-nft)",
            Mode::Nftables => "the agent's nftables mode",
        }
    }

    /// The agent's flags for this mode.
    fn flags(self) -> &'static [&'static str] {
        match self {
            Mode::Floor => &[],
            Mode::Xdp => &["--snat-port-range", "1024-65535"],
            Mode::Tc => &["--xdp", "disabled", "--snat-port-range", "1024-65535"],
            Mode::Iptables => &["--proxy-mode", "iptables", "--iptables-backend", "legacy"],
            Mode::IptablesNft => &["--proxy-mode", "iptables", "--iptables-backend", "nft"],
            Mode::Nftables => &["--proxy-mode", "nftables"],
        }
    }

    /// The mode's name in `PROXY_BENCH_MODES` (as the other benches name them).
    pub fn key(self) -> &'static str {
        match self {
            Mode::Floor => "floor",
            Mode::Xdp => "xdp",
            Mode::Tc => "tc",
            Mode::Iptables => "iptables-legacy",
            Mode::IptablesNft => "iptables-nft",
            Mode::Nftables => "nftables",
        }
    }

    fn netfilter(self) -> bool {
        matches!(self, Mode::Iptables | Mode::IptablesNft | Mode::Nftables)
    }
}

pub struct Figures {
    pub mode: Mode,
    /// Packets per second of the floor measured in the same run.
    pub floor_pps: f64,
    /// XDP: its rate over the floor's in rounds that measure one right after the other (one
    /// figure each is a single measurement, and this VM's pace moves between them).
    pub of_floor: Vec<f64>,
    pub pps_delivered: f64,
    pub pps_offered: f64,
    pub conns_per_sec: f64,
}

fn filler_vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a61_0000 + i + 1)
}

fn manifests(c: &Cluster, filler: u32) {
    c.write_manifest("nodes.yaml", &nodes_manifest());
    let svc = service(
        "bench",
        &format!(
            "  type: NodePort\n  clusterIP: 10.96.0.10\n  ports:\n  - {{name: http, port: 80, targetPort: {CONN_PORT}, nodePort: 30080, protocol: TCP}}\n  - {{name: dns, port: 53, targetPort: 5353, nodePort: 30053, protocol: UDP}}\n"
        ),
        None,
    );
    c.write_manifest("bench.yaml", &svc);
    let mut eps = slice("bench", &[(Ipv4Addr::new(10, 244, 2, 11), "node-b")]);
    eps = eps.replace("port: 8080", &format!("port: {CONN_PORT}"));
    c.write_manifest("bench-eps.yaml", &eps);
    let mut filler_docs = Vec::new();
    for i in 0..filler {
        filler_docs.push(format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: filler-{i}, namespace: default}}\nspec: {{clusterIP: {}, ports: [{{name: http, port: 80, targetPort: {CONN_PORT}}}]}}\n",
            filler_vip(i)
        ));
        filler_docs.push(format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: filler-{i}-1, namespace: default, labels: {{kubernetes.io/service-name: filler-{i}}}}}\naddressType: IPv4\nports: [{{name: http, port: {CONN_PORT}}}]\nendpoints: [{{addresses: [10.244.2.11], nodeName: node-b}}]\n"
        ));
    }
    c.write_manifest("filler.yaml", &filler_docs.join("---\n"));
}

fn mac_of(ns: &Netns, dev: &str) -> [u8; 6] {
    let out = ns.ip(&["link", "show", dev]);
    let mac = out.split("link/ether ").nth(1).and_then(|r| r.split_whitespace().next()).expect("MAC");
    let b: Vec<u8> = mac.split(':').map(|h| u8::from_str_radix(h, 16).unwrap()).collect();
    b.try_into().unwrap()
}

fn xdp_stat(ns: &Netns, dev: &str, stat: &str) -> u64 {
    let out = sh(&["ip", "netns", "exec", &ns.name, "ethtool", "-S", dev]);
    out.lines().find_map(|l| l.trim().strip_prefix(&format!("{stat}:")).map(|v| v.trim().parse().unwrap_or(0))).unwrap_or(0)
}

/// The client's frame to node A's UDP NodePort, as it arrives at node A.
fn frame(dst_mac: [u8; 6], src_port: u16) -> Vec<u8> {
    let from = SocketAddrV4::new(Ipv4Addr::new(192, 168, 100, 100), src_port);
    let to = SocketAddrV4::new(Ipv4Addr::new(192, 168, 100, 1), 30053);
    generator_frame(from, to, dst_mac, [0x02, 0xbe, 0x4c, 0, 0, 1]).to_vec()
}

/// A 64-byte UDP frame of the generator's (`proxy_xdp_bench_*`): no UDP checksum, so the
/// generator may vary the source port.
pub fn generator_frame(from: SocketAddrV4, to: SocketAddrV4, dst_mac: [u8; 6], src_mac: [u8; 6]) -> [u8; 64] {
    let udp = crate::packet::udp_datagram(from, to, &[0u8; 22], false);
    with_macs(crate::packet::Ipv4::new(*from.ip(), *to.ip(), crate::packet::UDP, udp).frame(), dst_mac, src_mac)
}

/// The same in IPv6: a 64-byte frame too (a UDP datagram of two bytes, with its checksum,
/// which IPv6 requires). The generator writes its flows' source ports at IPv4's offset, inside
/// this frame's source address: it takes one flow (`BENCH_FLOWS_V1` = 1), whose port it writes
/// back unchanged.
pub fn generator_frame6(from: SocketAddrV6, to: SocketAddrV6, dst_mac: [u8; 6], src_mac: [u8; 6]) -> [u8; 64] {
    with_macs(crate::packet6::udp_frame(from, to, &[0u8; 2]), dst_mac, src_mac)
}

/// The 64-byte `frame` with its Ethernet addresses.
fn with_macs(mut frame: Vec<u8>, dst_mac: [u8; 6], src_mac: [u8; 6]) -> [u8; 64] {
    frame[0..6].copy_from_slice(&dst_mac);
    frame[6..12].copy_from_slice(&src_mac);
    frame.try_into().expect("a 64-byte frame")
}

fn udp_pps(c: &mut Cluster, mode: Mode, frames: u32) -> (f64, f64) {
    // Frames node A sends on are dropped (and counted) by XDP on the other end of its link:
    // the rate measured is node A's.
    c.set_switch_xdp("p1", proxy_common::prog_names::XDP_DROP);
    let node_a = c.node("node-a");
    let dst_mac = mac_of(&node_a.ns, "wire0");
    let root = node_a.bpffs();
    let ns_file = node_a.ns.file();
    let run = move |repeat: u32| -> (u64, Duration) {
        let (ns_file, root) = (ns_file.try_clone().unwrap(), root.clone());
        thread::spawn(move || {
            enter(&ns_file).expect("enter node A");
            let name = std::ffi::CString::new("wire0").unwrap();
            // SAFETY: a valid C string.
            let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
            let (mut ebpf, program) = match mode {
                Mode::Floor => (crate::load_lab_object(), proxy_common::prog_names::XDP_BENCH_TX),
                // The agent's XDP logic on the agent's own maps.
                Mode::Xdp => (crate::load_lab_object_on(&root), proxy_common::prog_names::XDP_BENCH_EXT),
                _ => (crate::load_lab_object(), proxy_common::prog_names::XDP_BENCH_PASS),
            };
            let mut template: aya::maps::Array<_, [u8; 64]> =
                aya::maps::Array::try_from(ebpf.take_map("BENCH_FRAME_V1").expect("frame map")).expect("an array");
            let mut flow_count: aya::maps::Array<_, u32> =
                aya::maps::Array::try_from(ebpf.take_map("BENCH_FLOWS_V1").expect("flow count map")).expect("an array");
            flow_count.set(0, flows(), 0).expect("flow count");
            let prog: &mut Xdp = ebpf.program_mut(program).expect("bench program").try_into().expect("XDP");
            proxy_agent::dataplane::ebpf::loader::load_program(|| prog.load()).expect("load the bench program");
            // One run: the program cycles the frame through `flows()` source ports itself (a live
            // test run has a fixed set-up cost of tens of milliseconds, so runs must be long).
            let f = frame(dst_mac, 40000);
            let t: [u8; 64] = f.as_slice().try_into().unwrap();
            template.set(0, t, 0).expect("frame template");
            let ctx = crate::testrun::xdp_md(f.len(), ifindex);
            let opts = TestRunOptions {
                data_in: Some(&f),
                ctx_in: Some(&ctx),
                repeat,
                attrs: TestRunAttrs::new().xdp_live_frames(64),
                ..Default::default()
            };
            let start = Instant::now();
            prog.test_run(opts).expect("XDP live frames");
            (u64::from(repeat), start.elapsed())
        })
        .join()
        .unwrap()
    };
    // Warm up: flows tracked, neighbours resolved (the sink drops ARP, so pin node B's).
    let node_b_mac = mac_of(&c.node("node-b").ns, "wire0").iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
    c.node("node-a").ns.ip(&["neigh", "replace", "192.168.100.2", "lladdr", &node_b_mac, "dev", "wire0", "nud", "permanent"]);
    run(flows() * 4);
    thread::sleep(Duration::from_millis(300));
    let before = xdp_stat(c.switch(), "p1", "rx_queue_0_xdp_drops");
    let (sent, took) = run(frames);
    thread::sleep(Duration::from_millis(200));
    let delivered = xdp_stat(c.switch(), "p1", "rx_queue_0_xdp_drops") - before;
    if std::env::var_os("NORTH_DEBUG").is_some() {
        if let Ok(r) = c.node("node-a").inspect() {
            eprintln!("{:?}", r.counters);
        }
    }
    c.set_switch_xdp("p1", proxy_common::prog_names::XDP_PASS);
    let secs = took.as_secs_f64();
    eprintln!("  {}: {sent} frames offered in {secs:.2} s, {delivered} sent on by node A", mode.label());
    (delivered as f64 / secs, sent as f64 / secs)
}

/// Accepts and closes connections on the backend until dropped.
struct AcceptClose {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
    addr: SocketAddrV4,
    ns: std::fs::File,
}

impl AcceptClose {
    fn start(ns: &Netns, ip: Ipv4Addr) -> Self {
        let listener = ns.run(move || TcpListener::bind((ip, CONN_PORT)).expect("bind backend"));
        // A backlog of std's 128 overflows under the clients' bursts on a busy 2-core machine
        // (the backend's TcpExt ListenOverflows rose with the attempts that timed out, in
        // every mode): a few thousand. (listen() again on a listening socket sets its backlog;
        // the namespace's net.core.somaxconn, 4096 by default, caps it.)
        // SAFETY: plain syscall on the listener's own descriptor.
        assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 4096) }, 0, "listen backlog");
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Ok((c, _)) = listener.accept() {
                    drop(c);
                }
            }
        });
        Self { stop, thread: Some(thread), addr: SocketAddrV4::new(ip, CONN_PORT), ns: ns.file() }
    }
}

impl Drop for AcceptClose {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let (addr, ns) = (self.addr, self.ns.try_clone().unwrap());
        // Wake the accept.
        let _ = thread::spawn(move || {
            let _ = enter(&ns);
            let _ = TcpStream::connect_timeout(&addr.into(), Duration::from_millis(200));
        })
        .join();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn reset_on_close(s: &TcpStream) {
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: valid socket and option struct.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            size_of::<libc::linger>() as u32,
        )
    };
}

fn tcp_cps(c: &Cluster, secs: f64) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let to = SocketAddrV4::new(Ipv4Addr::new(192, 168, 100, 1), 30080);
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (done, failed, stop, ns) = (done.clone(), failed.clone(), stop.clone(), c.client.file());
            thread::spawn(move || {
                enter(&ns).expect("enter client");
                while !stop.load(Ordering::Relaxed) {
                    match TcpStream::connect_timeout(&to.into(), Duration::from_secs(1)) {
                        Ok(s) => {
                            reset_on_close(&s);
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    let (d0, t0) = (done.load(Ordering::Relaxed), Instant::now());
    thread::sleep(Duration::from_secs_f64(secs));
    let (d1, took) = (done.load(Ordering::Relaxed), t0.elapsed());
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let f = failed.load(Ordering::Relaxed);
    if f > 0 {
        eprintln!("  {f} connection attempts failed");
    }
    (d1 - d0) as f64 / took.as_secs_f64()
}

/// A netfilter mode has written its first full ruleset (its `starts`-th start logs it), with
/// the NodePort under test and a Service chain for every filler Service.
fn wait_netfilter_programmed(c: &Cluster, mode: Mode, starts: usize, filler: u32) {
    let node = c.node("node-a");
    let (save, chain): (&[&str], &str) = match mode {
        Mode::Iptables => (&["iptables-legacy-save", "-t", "nat"], ":KUBE-SVC-"),
        Mode::IptablesNft => (&["iptables-nft-save", "-t", "nat"], ":KUBE-SVC-"),
        _ => (&["nft", "list", "table", "ip", "kube-proxy"], "chain service-"),
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let log = node.agent_log();
        let rules = Command::new("ip")
            .args(["netns", "exec", &node.ns.name])
            .args(save)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let chains = rules.lines().filter(|l| l.trim_start().starts_with(chain)).count();
        if log.matches("initial sync done").count() >= starts && rules.contains("30053") && chains > filler as usize {
            return;
        }
        assert!(Instant::now() < deadline, "{}: not programmed in 120 s ({chains} Service chains)\n{log}", mode.label());
        thread::sleep(Duration::from_millis(200));
    }
}

fn wait_programmed(c: &mut Cluster, filler: u32) {
    c.wait_all("node A programmed", |n, r| {
        n.name != "node-a"
            || (r.frontends.iter().any(|f| f.address == "192.168.100.1:30053" && f.backends.len() == 1)
                && r.frontends.len() >= filler as usize
                // XDP sends frames itself once the agent has seen that the switch takes them.
                && r.external_interfaces.values().all(|e| !e.xdp || e.xdp_sends))
    });
}

/// `wanted`: the modes to run (`Mode::key`); the floor runs always. `xdp_rounds`: XDP's rounds
/// against the floor (odd; `FLOOR_ROUNDS` by default).
pub fn run(agent_bin: PathBuf, quick: bool, filler: u32, wanted: impl Fn(&str) -> bool, xdp_rounds: Option<usize>) -> Vec<Figures> {
    let mut c = Cluster::new(agent_bin, [&[], &["b1"]]);
    // What is measured is native XDP forwarding: the far end of node A's link takes XDP
    // frames, as a NIC's does.
    c.switch_takes_xdp_frames();
    manifests(&c, filler);
    let backend = AcceptClose::start(&c.node("node-b").pods[0].ns, Ipv4Addr::new(10, 244, 2, 11));
    let frames = if quick { 300_000 } else { 4_000_000 };
    let cps_secs = if quick { 1.0 } else { 5.0 };
    let mut out = Vec::new();
    let (floor, _) = udp_pps(&mut c, Mode::Floor, frames);
    let modes = [Mode::Xdp, Mode::Tc, Mode::Iptables, Mode::IptablesNft, Mode::Nftables];
    for (starts, mode) in modes.into_iter().filter(|m| wanted(m.key())).enumerate() {
        // Each start removes what the mode before left (the eBPF pins, the other rules).
        c.start_agent_on("node-a", mode.flags());
        if mode.netfilter() {
            wait_netfilter_programmed(&c, mode, starts + 1, filler);
        } else {
            wait_programmed(&mut c, filler);
        }
        let mut of_floor = Vec::new();
        let (pps_delivered, pps_offered) = if mode != Mode::Xdp {
            udp_pps(&mut c, mode, frames)
        } else {
            // An odd number of rounds, so that the median is one of them.
            let mut rounds = Vec::new();
            for _ in 0..xdp_rounds.unwrap_or(if quick { 3 } else { FLOOR_ROUNDS }) | 1 {
                let (floor, _) = udp_pps(&mut c, Mode::Floor, frames);
                let (delivered, offered) = udp_pps(&mut c, mode, frames);
                of_floor.push(delivered / floor);
                rounds.push((delivered, offered));
            }
            // XDP's rate is the median round's.
            rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
            rounds[rounds.len() / 2]
        };
        let conns_per_sec = tcp_cps(&c, cps_secs);
        eprintln!("  {}: {:.0} pps delivered, {:.0} new TCP connections/s", mode.label(), pps_delivered, conns_per_sec);
        out.push(Figures { mode, floor_pps: floor, of_floor, pps_delivered, pps_offered, conns_per_sec });
        c.stop_agent_on("node-a");
    }
    drop(backend);
    let _: io::Result<()> = Ok(());
    out
}
