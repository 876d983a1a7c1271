//! `cargo xtask bench north`: NodePort forwarding from a client through node A to a backend on
//! node B, in the two-node lab, with node A running, in turn:
//! - the agent with XDP (the default),
//! - the agent with XDP disabled (TC only),
//! - no agent and a kube-proxy-style iptables ruleset (KUBE-SERVICES -> KUBE-NODEPORTS ->
//!   KUBE-EXT -> KUBE-SVC -> KUBE-SEP DNAT, KUBE-MARK-MASQ and MASQUERADE), written for the
//!   bench until the fallback renderer exists.
//!
//! Each mode serves the same Services: the NodePort under test plus `filler` ClusterIP Services
//! (kube-proxy's KUBE-SERVICES chain holds one rule per cluster IP, which new connections walk).
//!
//! Packets per second: 64-byte UDP frames of 16 flows are generated in the kernel with XDP
//! live frames (BPF_PROG_TEST_RUN) as if node A's external interface received them; in XDP
//! mode the agent's own XDP program is run on them, otherwise a pass-through program hands
//! them to node A's stack (TC, or netfilter). Node B's interface drops what arrives with XDP
//! and counts it: the rate delivered to node B is node A's forwarding rate.
//!
//! New TCP connections per second: two client threads in the external client namespace
//! connect to the NodePort and close with a reset; the backend on node B accepts and closes.

use std::{
    io,
    net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    path::PathBuf,
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// No processing: frames go straight back out (what the lab itself costs).
    Floor,
    Xdp,
    Tc,
    Iptables,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Floor => "floor (XDP_TX, no processing)",
            Mode::Xdp => "ebpf, XDP",
            Mode::Tc => "ebpf, TC only",
            Mode::Iptables => "iptables (kube-proxy style)",
        }
    }
}

pub struct Figures {
    pub mode: Mode,
    /// Packets per second of the floor measured in the same run.
    pub floor_pps: f64,
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

/// kube-proxy's iptables layout for the bench's Services on node A.
pub fn iptables_ruleset(node_ip: Ipv4Addr, filler: u32) -> String {
    let mut nat = String::from("*nat\n");
    let mut chains =
        vec!["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"].into_iter().map(String::from).collect::<Vec<_>>();
    let mut rules = vec![
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_string(),
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_string(),
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING".to_string(),
        "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000".to_string(),
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN".to_string(),
        "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0".to_string(),
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully".to_string(),
    ];
    let mut svc = |name: &str, proto: &str, vip: Ipv4Addr, port: u16, node_port: Option<u16>, backend: SocketAddrV4| {
        let tag = name.to_uppercase().replace(['-', ':'], "");
        let (svc_chain, sep_chain, ext_chain) = (format!("KUBE-SVC-{tag}"), format!("KUBE-SEP-{tag}"), format!("KUBE-EXT-{tag}"));
        chains.extend([svc_chain.clone(), sep_chain.clone()]);
        rules.push(format!(
            "-A KUBE-SERVICES -d {vip}/32 -p {proto} -m comment --comment \"default/{name} cluster IP\" -m {proto} --dport {port} -j {svc_chain}"
        ));
        rules.push(format!("-A {svc_chain} ! -s 10.244.0.0/16 -d {vip}/32 -p {proto} -m {proto} --dport {port} -j KUBE-MARK-MASQ"));
        rules.push(format!("-A {svc_chain} -m comment --comment \"default/{name} -> {backend}\" -j {sep_chain}"));
        rules.push(format!("-A {sep_chain} -s {}/32 -j KUBE-MARK-MASQ", backend.ip()));
        rules.push(format!("-A {sep_chain} -p {proto} -m {proto} -j DNAT --to-destination {backend}"));
        if let Some(np) = node_port {
            chains.push(ext_chain.clone());
            rules.push(format!(
                "-A KUBE-NODEPORTS -p {proto} -m comment --comment \"default/{name}\" -m {proto} --dport {np} -j {ext_chain}"
            ));
            rules.push(format!(
                "-A {ext_chain} -m comment --comment \"masquerade traffic for default/{name} external destinations\" -j KUBE-MARK-MASQ"
            ));
            rules.push(format!("-A {ext_chain} -j {svc_chain}"));
        }
    };
    for i in 0..filler {
        svc(&format!("filler-{i}"), "tcp", filler_vip(i), 80, None, SocketAddrV4::new(Ipv4Addr::new(10, 244, 2, 11), CONN_PORT));
    }
    svc("bench:http", "tcp", Ipv4Addr::new(10, 96, 0, 10), 80, Some(30080), SocketAddrV4::new(Ipv4Addr::new(10, 244, 2, 11), CONN_PORT));
    svc("bench:dns", "udp", Ipv4Addr::new(10, 96, 0, 10), 53, Some(30053), SocketAddrV4::new(Ipv4Addr::new(10, 244, 2, 11), 5353));
    rules.push(String::from(
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
    ));
    let _ = node_ip;
    for ch in &chains {
        nat += &format!(":{ch} - [0:0]\n");
    }
    for r in &rules {
        nat += r;
        nat.push('\n');
    }
    nat += "COMMIT\n";
    nat
}

fn iptables_restore(ns: &Netns, rules: &str) {
    use std::io::Write as _;
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.name, "iptables-restore"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("iptables-restore");
    child.stdin.take().unwrap().write_all(rules.as_bytes()).unwrap();
    assert!(child.wait().unwrap().success(), "iptables-restore failed");
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

/// A 64-byte UDP frame (no UDP checksum, so the generator may vary the source port) from the
/// client to node A's UDP NodePort, as it arrives at node A.
fn frame(dst_mac: [u8; 6], src_port: u16) -> Vec<u8> {
    let from = SocketAddrV4::new(Ipv4Addr::new(192, 168, 100, 100), src_port);
    let to = SocketAddrV4::new(Ipv4Addr::new(192, 168, 100, 1), 30053);
    let udp = crate::packet::udp_datagram(from, to, &[0u8; 22], false);
    let mut f = crate::packet::Ipv4::new(*from.ip(), *to.ip(), crate::packet::UDP, udp).frame();
    f[0..6].copy_from_slice(&dst_mac);
    f[6..12].copy_from_slice(&[0x02, 0xbe, 0x4c, 0, 0, 1]);
    assert_eq!(f.len(), 64);
    f
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
            let mut loader = aya::EbpfLoader::new();
            let program = if mode == Mode::Floor {
                for n in proxy_common::map_names::ALL {
                    loader.map_max_entries(n, 1);
                }
                proxy_common::prog_names::XDP_BENCH_TX
            } else if mode == Mode::Xdp {
                // The agent's XDP logic on the agent's own maps.
                for n in proxy_common::map_names::ALL {
                    loader.map_pin_path(n, proxy_agent::dataplane::ebpf::loader::maps_dir(&root).join(n));
                }
                proxy_common::prog_names::XDP_BENCH_EXT
            } else {
                for n in proxy_common::map_names::ALL {
                    loader.map_max_entries(n, 1);
                }
                proxy_common::prog_names::XDP_BENCH_PASS
            };
            let mut ebpf = loader.load(proxy_agent::dataplane::ebpf::loader::OBJECT).expect("load the object");
            let mut template: aya::maps::Array<_, [u8; 64]> =
                aya::maps::Array::try_from(ebpf.take_map("BENCH_FRAME_V1").expect("frame map")).expect("an array");
            let prog: &mut Xdp = ebpf.program_mut(program).expect("bench program").try_into().expect("XDP");
            prog.load().expect("load the bench program");
            // One run: the program cycles the frame through FLOWS source ports itself (a live
            // test run has a fixed set-up cost of tens of milliseconds, so runs must be long).
            let f = frame(dst_mac, 40000);
            let t: [u8; 64] = f.as_slice().try_into().unwrap();
            template.set(0, t, 0).expect("frame template");
            let mut ctx = [0u8; 24];
            ctx[4..8].copy_from_slice(&(f.len() as u32).to_ne_bytes());
            ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
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
    run(FLOWS * 4);
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

fn wait_programmed(c: &mut Cluster, filler: u32) {
    c.wait_all("node A programmed", |n, r| {
        n.name != "node-a"
            || (r.frontends.iter().any(|f| f.address == "192.168.100.1:30053" && f.backends.len() == 1)
                && r.frontends.len() >= filler as usize
                // XDP sends frames itself once the agent has seen that the switch takes them.
                && r.external_interfaces.values().all(|e| !e.xdp || e.xdp_sends))
    });
}

pub fn run(agent_bin: PathBuf, quick: bool, filler: u32) -> Vec<Figures> {
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
    for mode in [Mode::Xdp, Mode::Tc, Mode::Iptables] {
        match mode {
            Mode::Xdp => c.start_agent_on("node-a", &["--snat-port-range", "1024-65535"]),
            Mode::Tc => c.start_agent_on("node-a", &["--xdp", "disabled", "--snat-port-range", "1024-65535"]),
            Mode::Iptables => iptables_restore(&c.node("node-a").ns, &iptables_ruleset(Ipv4Addr::new(192, 168, 100, 1), filler)),
            Mode::Floor => unreachable!(),
        }
        if mode != Mode::Iptables {
            wait_programmed(&mut c, filler);
        }
        let (pps_delivered, pps_offered) = udp_pps(&mut c, mode, frames);
        let conns_per_sec = tcp_cps(&c, cps_secs);
        eprintln!("  {}: {:.0} pps delivered, {:.0} new TCP connections/s", mode.label(), pps_delivered, conns_per_sec);
        out.push(Figures { mode, floor_pps: floor, pps_delivered, pps_offered, conns_per_sec });
        if mode != Mode::Iptables {
            c.stop_agent_on("node-a");
        }
    }
    drop(backend);
    let _: io::Result<()> = Ok(());
    out
}
