//! The north-south lab: two node namespaces and an external client on one shared link (a
//! bridge in a switch namespace), each node with its own pods, its own agent and its own pin
//! root. Node A is 192.168.100.1 with pods in 10.244.1.0/24, node B 192.168.100.2 with pods
//! in 10.244.2.0/24; each routes the other's pod range through it, as a routed CNI does. The
//! client (192.168.100.100) reaches load-balancer and external IPs through node A, as an
//! upstream router announcing them would send it.
//!
//! Checksum offload is off on every interface that originates traffic, so frames carry
//! complete checksums as they do on a wire (XDP rewrites them by hand). Everything is created
//! with names unique to the lab and removed on drop, also on panic.

use std::{
    ffi::OsStr,
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    process::Child,
    time::{Duration, Instant},
};

use proxy_agent::inspect::{self, Report};

use crate::{
    lab::{spawn_agent, Pod},
    netns::{sh, unique_id, Netns},
    servers,
};

pub const CLIENT_IP: &str = "192.168.100.100";
pub const TCP_PORT: u16 = 8080;
pub const UDP_PORT: u16 = 5353;
/// The backends' IPv6 servers (`Cluster::add_ipv6`).
pub const TCP_PORT6: u16 = 8081;
pub const UDP_PORT6: u16 = 5354;
pub const CLIENT_IP6: &str = "fd00:100::100";

/// The IPv6 address of node `n`'s (1, 2) `j`th backend pod (`Cluster::add_ipv6`).
pub fn pod_ipv6(n: u16, j: usize) -> std::net::Ipv6Addr {
    std::net::Ipv6Addr::new(0xfd00, 0x244, n, 0, 0, 0, 0, 0x11 + j as u16)
}

pub struct Node {
    pub name: String,
    pub ns: Netns,
    pub ip: Ipv4Addr,
    pub pods: Vec<Pod>,
    /// A pod without a server, to connect from.
    pub client_pod: Pod,
    dir: PathBuf,
    agent: Option<Child>,
}

impl Node {
    pub fn bpffs(&self) -> PathBuf {
        self.dir.join("bpf")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    pub fn agent_log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn inspect(&self) -> Result<Report, inspect::InspectError> {
        inspect::read(&self.bpffs())
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no pod {name} on {}", self.name))
    }
}

/// `proxy_xdp_pass` attached to interfaces; detached when dropped.
pub struct XdpPass {
    _ebpf: aya::Ebpf,
}

/// Attaches one of the lab object's XDP programs natively to `devs` in `ns`.
pub fn xdp_program_on(ns: &Netns, devs: &[&str], program: &'static str) -> XdpPass {
    let devs: Vec<String> = devs.iter().map(|d| d.to_string()).collect();
    let ebpf = ns.run(move || {
        let mut ebpf = crate::load_lab_object();
        let prog: &mut aya::programs::Xdp = ebpf.program_mut(program).expect("program").try_into().expect("an XDP program");
        proxy_agent::dataplane::ebpf::loader::load_program(|| prog.load()).expect("load the program");
        for d in &devs {
            prog.attach(d, aya::programs::XdpMode::Driver).unwrap_or_else(|e| panic!("attach XDP pass to {d}: {e}"));
        }
        ebpf
    });
    XdpPass { _ebpf: ebpf }
}

pub struct Cluster {
    pub id: String,
    dir: PathBuf,
    /// XDP programs on the switch's ports, by port.
    switch_xdp: std::collections::BTreeMap<String, XdpPass>,
    switch: Netns,
    pub client: Netns,
    pub nodes: Vec<Node>,
    servers: Vec<servers::Backend>,
    agent_bin: PathBuf,
    /// Removes `dir` (the nodes' pins with it) if a signal ends the run first (`interrupt`).
    _interrupt: crate::interrupt::Registration,
}

/// `ethtool -K <dev> tx off` inside `ns`.
fn checksum_offload_off(ns: &Netns, dev: &str) {
    sh(&["ip", "netns", "exec", &ns.name, "ethtool", "-K", dev, "tx", "off"]);
}

impl Cluster {
    /// Builds the lab. `pods[i]`: names of the backend pods of node i (each answers with its
    /// name on TCP 8080 and UDP 5353). Agents are not started: write manifests first.
    pub fn new(agent_bin: impl Into<PathBuf>, pods: [&[&str]; 2]) -> Self {
        let id = unique_id();
        let dir = PathBuf::from("/run/proxy-lab").join(format!("c{id}"));
        // Registered first: a signal may come as soon as it exists.
        let _interrupt = {
            let dir = dir.clone();
            crate::interrupt::register(move || crate::lab::remove_lab_dir(&dir))
        };
        fs::create_dir_all(dir.join("manifests")).expect("lab directory");
        let switch = Netns::create(format!("pxc-{id}-sw"));
        switch.ip(&["link", "add", "br0", "type", "bridge"]);
        switch.ip(&["link", "set", "br0", "up"]);
        let wire = |ns: &Netns, dev: &str, port: &str, addr: &str| {
            ns.ip(&["link", "add", dev, "type", "veth", "peer", "name", port, "netns", &switch.name]);
            ns.ip(&["addr", "add", addr, "dev", dev]);
            ns.ip(&["link", "set", dev, "up"]);
            switch.ip(&["link", "set", port, "master", "br0"]);
            switch.ip(&["link", "set", port, "up"]);
            checksum_offload_off(ns, dev);
        };
        let client = Netns::create(format!("pxc-{id}-ext"));
        wire(&client, "eth0", "pc", &format!("{CLIENT_IP}/24"));
        // Load-balancer and external IPs are announced by node A.
        for net in ["203.0.113.0/24", "192.0.2.0/24"] {
            client.ip(&["route", "add", net, "via", "192.168.100.1"]);
        }
        let mut nodes = Vec::new();
        let mut servers = Vec::new();
        for (i, names) in pods.iter().enumerate() {
            let n = i as u8 + 1;
            let name = format!("node-{}", (b'a' + i as u8) as char);
            let ns = Netns::create(format!("pxc-{id}-{name}"));
            ns.sysctl("net.ipv4.ip_forward", "1");
            ns.sysctl("net.ipv4.conf.all.rp_filter", "0");
            ns.sysctl("net.ipv4.conf.default.rp_filter", "0");
            let ip = Ipv4Addr::new(192, 168, 100, n);
            wire(&ns, "wire0", &format!("p{n}"), &format!("{ip}/24"));
            let other = 3 - n;
            ns.ip(&["route", "add", &format!("10.244.{other}.0/24"), "via", &format!("192.168.100.{other}")]);
            let mut node_pods = Vec::new();
            for (j, pod) in names.iter().enumerate() {
                let p = Pod::create(&id, &ns, pod, &format!("veth{n}{j}"), Ipv4Addr::new(10, 244, n, 11 + j as u8));
                checksum_offload_off(&p.ns, "eth0");
                servers.push(servers::Backend::start(&p.ns, pod, TCP_PORT, UDP_PORT));
                node_pods.push(p);
            }
            let client_pod = Pod::create(&id, &ns, &format!("client-{name}"), &format!("veth{n}c"), Ipv4Addr::new(10, 244, n, 2));
            checksum_offload_off(&client_pod.ns, "eth0");
            let node_dir = dir.join(&name);
            fs::create_dir_all(&node_dir).expect("node directory");
            nodes.push(Node { name, ns, ip, pods: node_pods, client_pod, dir: node_dir, agent: None });
        }
        // The switch's ports are plain veths, as the far end of a node's uplink is on kind and
        // many VM and container setups: native XDP on a node cannot send frames into them.
        Self { id, dir, switch_xdp: Default::default(), switch, client, nodes, servers, agent_bin: agent_bin.into(), _interrupt }
    }

    /// Turns GRO on for the switch's ports (which makes the kernel report that they take XDP
    /// frames, though frames sent into them vanish).
    pub fn switch_gro_on(&self) {
        for port in ["pc", "p1", "p2"] {
            sh(&["ip", "netns", "exec", &self.switch.name, "ethtool", "-K", port, "gro", "on"]);
        }
    }

    /// Lets the switch's ports take frames from the nodes' native XDP, as a NIC's far end
    /// does: a veth takes them when it runs an XDP program itself (here one that passes
    /// everything). The agents see it in the ports' xdp_features within their refresh period
    /// (5 s).
    pub fn switch_takes_xdp_frames(&mut self) {
        for port in ["pc", "p1", "p2"] {
            if !self.switch_xdp.contains_key(port) {
                self.set_switch_xdp(port, proxy_common::prog_names::XDP_PASS);
            }
        }
    }

    /// Replaces the XDP program on switch port `port` (`pc`, `p1`, `p2`) with `program`.
    pub fn set_switch_xdp(&mut self, port: &str, program: &'static str) {
        self.switch_xdp.remove(port);
        self.switch_xdp.insert(port.to_string(), xdp_program_on(&self.switch, &[port], program));
    }

    /// Makes the lab dual-stack, as a node's network is: the client is fd00:100::100, node A
    /// fd00:100::1 with pods in fd00:244:1::/64, node B fd00:100::2 with pods in
    /// fd00:244:2::/64 (each routing the other's through it; each node's client pod is
    /// fd00:244:n::2), and every backend pod answers over IPv6 too, on TCP `TCP_PORT6` and UDP
    /// `UDP_PORT6` (an IPv6 socket on the IPv4 servers' ports would be refused: it is
    /// dual-stack). The client reaches IPv6 load-balancer and external IPs (2001:db8:203::/64,
    /// 2001:db8:192::/64) through node A, as IPv4's.
    pub fn add_ipv6(&mut self) {
        self.client.ip(&["-6", "addr", "add", "fd00:100::100/64", "dev", "eth0", "nodad"]);
        for net in ["2001:db8:203::/64", "2001:db8:192::/64"] {
            self.client.ip(&["-6", "route", "add", net, "via", "fd00:100::1"]);
        }
        for (i, node) in self.nodes.iter().enumerate() {
            let n = i as u16 + 1;
            node.ns.sysctl("net.ipv6.conf.all.forwarding", "1");
            node.ns.ip(&["-6", "addr", "add", &format!("fd00:100::{n}/64"), "dev", "wire0", "nodad"]);
            let other = 3 - n;
            node.ns.ip(&["-6", "route", "add", &format!("fd00:244:{other}::/64"), "via", &format!("fd00:100::{other}")]);
            node.client_pod.add_ipv6(&node.ns, std::net::Ipv6Addr::new(0xfd00, 0x244, n, 0, 0, 0, 0, 2));
            for (j, pod) in node.pods.iter().enumerate() {
                pod.add_ipv6(&node.ns, pod_ipv6(n, j));
                let any = std::net::Ipv6Addr::UNSPECIFIED.into();
                self.servers.push(servers::Backend::start_on(&pod.ns, &pod.name, any, TCP_PORT6, UDP_PORT6));
            }
        }
    }

    /// The switch namespace (the bench reads its ports' counters).
    pub fn switch(&self) -> &Netns {
        &self.switch
    }

    pub fn manifests(&self) -> PathBuf {
        self.dir.join("manifests")
    }

    /// Writes a manifest atomically, as editors and ConfigMap updates do.
    pub fn write_manifest(&self, name: &str, text: &str) {
        crate::lab::write_atomically(&self.manifests(), name, text);
    }

    /// Starts both agents on the shared manifest directory, each with its node's name and pin
    /// root, plus `extra` flags.
    pub fn start_agents(&mut self, extra: &[&str]) {
        for name in ["node-a", "node-b"] {
            self.start_agent_on(name, extra);
        }
    }

    /// Kills a node's agent (SIGKILL): its programs, maps and links stay pinned and keep
    /// serving, as after a crash.
    pub fn kill_agent_on(&mut self, name: &str) {
        let node = self.nodes.iter_mut().find(|n| n.name == name).expect("node");
        if let Some(mut a) = node.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
    }

    /// Stops a node's agent and removes everything it pinned (its programs detach).
    pub fn stop_agent_on(&mut self, name: &str) {
        let node = self.nodes.iter_mut().find(|n| n.name == name).expect("node");
        if let Some(mut a) = node.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
        let _ = proxy_agent::dataplane::ebpf::loader::unpin_all(&node.bpffs());
    }

    /// Starts the agent of one node (see `start_agents`).
    pub fn start_agent_on(&mut self, name: &str, extra: &[&str]) {
        let manifests = self.manifests();
        for node in self.nodes.iter_mut().filter(|n| n.name == name) {
            let root = node.bpffs();
            // No socket hooks: these tests are about traffic from outside and from pods.
            let fixed = ["--hostname-override", node.name.as_str(), "--log-level", "debug", "--cgroup-root", "none"];
            let mut args: Vec<&OsStr> = fixed.iter().map(OsStr::new).collect();
            args.extend([OsStr::new("--manifests"), manifests.as_os_str(), OsStr::new("--bpffs-root"), root.as_os_str()]);
            args.extend(extra.iter().map(OsStr::new));
            node.agent = Some(spawn_agent(&self.agent_bin, &node.ns, &args, &node.log_path()));
        }
    }

    fn log_tails(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                let log = n.agent_log();
                let lines: Vec<&str> = log.lines().collect();
                format!("--- {} agent log ---\n{}", n.name, lines[lines.len().saturating_sub(30)..].join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits until `cond` holds on every node's programmed state (60 s at most: the first wait
    /// after a start includes loading the programs, through the verifier, in each node's agent,
    /// and with two tests side by side on a 2-core machine four agents load at once; 15 s ran
    /// out there on one VM, every agent still in the verifier).
    pub fn wait_all(&mut self, what: &str, cond: impl Fn(&Node, &Report) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut ok = true;
            // Nodes without an agent (the benchmark runs one on node A only) are not asked.
            for node in self.nodes.iter_mut().filter(|n| n.agent.is_some()) {
                if let Some(a) = node.agent.as_mut() {
                    if !matches!(a.try_wait(), Ok(None)) {
                        panic!("the agent of {} exited while waiting for {what}\n{}", node.name, node.agent_log());
                    }
                }
                ok &= node.inspect().is_ok_and(|r| cond(node, &r));
            }
            if ok {
                return;
            }
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}\n{}", self.log_tails());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until frontend `addr:port/proto` is programmed on both nodes with `backends`
    /// backends in its external scope, and each node has its external interface attached.
    /// `NODE` in `address` stands for each node's own address (NodePorts).
    pub fn wait_frontend(&mut self, address: &str, proto: &str, backends: usize) {
        self.wait_all(&format!("{address}/{proto} with {backends} backends"), |node, r| {
            let address = address.replace("NODE", &node.ip.to_string());
            !r.external_interfaces.is_empty()
                && r.frontends
                    .iter()
                    .any(|f| f.address == address && f.protocol == proto && f.scope == "external" && f.backends.len() == backends)
        });
    }

    /// As `wait_frontend`, on one node only.
    pub fn wait_frontend_on(&mut self, node_name: &str, address: &str, proto: &str, backends: usize) {
        let node_name = node_name.to_string();
        self.wait_all(&format!("{address}/{proto} with {backends} backends on {node_name}"), |node, r| {
            node.name != node_name
                || r.frontends
                    .iter()
                    .any(|f| f.address == address && f.protocol == proto && f.scope == "external" && f.backends.len() == backends)
        });
    }

    pub fn node(&self, name: &str) -> &Node {
        self.nodes.iter().find(|n| n.name == name).unwrap_or_else(|| panic!("no node {name}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut a) = node.agent.take() {
                let _ = a.kill();
                let _ = a.wait();
            }
        }
        self.servers.clear();
        // Every node's pins are under it.
        crate::lab::remove_lab_dir(&self.dir);
    }
}

/// A Service manifest with the given spec body (YAML, indented two spaces under `spec:`),
/// and optional status.
pub fn service(name: &str, spec: &str, status: Option<&str>) -> String {
    let mut s = format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n{spec}");
    if let Some(st) = status {
        s += &format!("status:\n{st}");
    }
    s
}

/// An EndpointSlice for `svc`: (address, node) endpoints on TCP 8080 "http" and UDP 5353 "dns".
pub fn slice(svc: &str, endpoints: &[(Ipv4Addr, &str)]) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {svc}-1\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {svc}\naddressType: IPv4\nports:\n- {{name: http, port: {TCP_PORT}, protocol: TCP}}\n- {{name: dns, port: {UDP_PORT}, protocol: UDP}}\n"
    );
    s += if endpoints.is_empty() { "endpoints: []\n" } else { "endpoints:\n" };
    for (ip, node) in endpoints {
        s += &format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n  nodeName: {node}\n");
    }
    s
}

/// An IPv6 EndpointSlice for `svc` (named `<svc>-v6`): (address, node) endpoints on the
/// backends' IPv6 ports (`Cluster::add_ipv6`), "http" and "dns".
pub fn slice6(svc: &str, endpoints: &[(std::net::Ipv6Addr, &str)]) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {svc}-v6\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {svc}\naddressType: IPv6\nports:\n- {{name: http, port: {TCP_PORT6}, protocol: TCP}}\n- {{name: dns, port: {UDP_PORT6}, protocol: UDP}}\n"
    );
    s += if endpoints.is_empty() { "endpoints: []\n" } else { "endpoints:\n" };
    for (ip, node) in endpoints {
        s += &format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n  nodeName: {node}\n");
    }
    s
}

/// The two Node objects, with their InternalIPs.
pub fn nodes_manifest() -> String {
    (1..=2)
        .map(|n| {
            let name = format!("node-{}", (b'a' + n - 1) as char);
            format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\nstatus:\n  addresses:\n  - {{type: InternalIP, address: 192.168.100.{n}}}\n")
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

pub fn sock(s: &str) -> SocketAddrV4 {
    s.parse().expect("socket address")
}
