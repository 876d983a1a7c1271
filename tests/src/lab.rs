//! The lab: a node namespace running the agent, a client pod and backend pods wired to it with
//! veth pairs the way a routed CNI (Calico-style) wires pods: /32 addresses, a link-local
//! gateway, host-side interfaces named `veth*` so the agent's default `--pod-devices` picks
//! them up. Everything it creates carries a unique id and is removed on drop, also on panic.

use std::{
    fs,
    io::Read as _,
    net::{Ipv4Addr, SocketAddrV4},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use proxy_agent::inspect::{self, Report};

use crate::{
    netns::{enter, unique_id, Netns},
    servers,
};

/// Gateway address every pod routes through; answered by the node side of its veth.
const GATEWAY: &str = "169.254.1.1";
/// MAC of every node-side veth (as Calico does).
pub const NODE_MAC: &str = "ee:ee:ee:ee:ee:ee";
pub const NODE_NAME: &str = "lab-node";
pub const TCP_PORT: u16 = 8080;
pub const UDP_PORT: u16 = 5353;

pub const WEB_VIP: &str = "10.96.0.10:80";
pub const DNS_VIP: &str = "10.96.0.53:53";
pub const EMPTY_VIP: &str = "10.96.0.99:80";

pub fn sock(s: &str) -> SocketAddrV4 {
    s.parse().expect("socket address")
}

pub struct Pod {
    pub name: String,
    pub ns: Netns,
    pub ip: Ipv4Addr,
    /// The node-side interface.
    pub host_if: String,
}

pub struct Lab {
    pub id: String,
    pub dir: PathBuf,
    pub node: Netns,
    pub client: Pod,
    pub backends: Vec<Pod>,
    pub extra: Vec<Pod>,
    servers: Vec<servers::Backend>,
    agent_bin: PathBuf,
    agent: Option<Child>,
    /// `--log-level` of the agent (debug by default, for test failures' logs).
    pub agent_log_level: &'static str,
    /// What the agent is started without, when a test says.
    pub agent_limits: Limits,
    /// The lab's own cgroup (v2), the agent's `--cgroup-root`: host-network processes of the
    /// lab (`host_ask`) run in it, so the socket hooks touch nothing outside the lab. None: no
    /// cgroup v2 hierarchy is mounted.
    pub cgroup: Option<PathBuf>,
    /// Remove `dir` and `cgroup` if a signal ends the run first (`interrupt`).
    _interrupt: (crate::interrupt::Registration, Option<crate::interrupt::Registration>),
}

impl Lab {
    /// Builds the namespaces and starts a name server in each backend. The agent is not
    /// started: write manifests first, then call `start_agent`.
    pub fn new(agent_bin: impl Into<PathBuf>, backends: usize) -> Self {
        let id = unique_id();
        let dir = PathBuf::from("/run/proxy-lab").join(&id);
        // Registered first: a signal may come as soon as it exists.
        let removes_dir = {
            let dir = dir.clone();
            crate::interrupt::register(move || remove_lab_dir(&dir))
        };
        fs::create_dir_all(dir.join("manifests")).expect("lab directory");
        let node = Netns::create(format!("pxl-{id}-node"));
        node.sysctl("net.ipv4.ip_forward", "1");
        // Replies are translated after routing, so strict reverse-path filtering is fine; the
        // lab keeps the kernel default (off) explicit so it does not depend on the host.
        node.sysctl("net.ipv4.conf.all.rp_filter", "0");
        node.sysctl("net.ipv4.conf.default.rp_filter", "0");
        // An uplink with an address and a default route, as every node has: traffic for an
        // address no route leads to would otherwise die in routing before netfilter's FORWARD
        // chain (where the netfilter modes REJECT), and masquerading needs a node address.
        node.ip(&["link", "add", "uplink0", "type", "veth", "peer", "name", "uplink1"]);
        node.ip(&["addr", "add", "192.168.250.1/24", "dev", "uplink0"]);
        node.ip(&["link", "set", "uplink0", "up"]);
        node.ip(&["link", "set", "uplink1", "up"]);
        node.ip(&["route", "add", "default", "via", "192.168.250.254"]);
        let cgroup = proxy_agent::dataplane::ebpf::hostsock::cgroup2_mount().map(|m| m.join(format!("proxy-lab-{id}")));
        let removes_cgroup = cgroup.clone().map(|c| {
            crate::interrupt::register(move || {
                let _ = fs::remove_dir(c);
            })
        });
        if let Some(dir) = &cgroup {
            fs::create_dir(dir).unwrap_or_else(|e| panic!("creating the lab's cgroup {}: {e}", dir.display()));
        }
        let mut lab = Self {
            client: Pod::create(&id, &node, "client", "vethc", Ipv4Addr::new(10, 244, 0, 2)),
            backends: Vec::new(),
            extra: Vec::new(),
            servers: Vec::new(),
            id,
            dir,
            node,
            agent_bin: agent_bin.into(),
            agent: None,
            agent_log_level: "debug",
            agent_limits: Limits::default(),
            cgroup,
            _interrupt: (removes_dir, removes_cgroup),
        };
        for i in 1..=backends {
            let pod = Pod::create(&lab.id, &lab.node, &format!("backend-{i}"), &format!("vethb{i}"), Ipv4Addr::new(10, 244, 1, i as u8));
            lab.servers.push(servers::Backend::start(&pod.ns, &pod.name, TCP_PORT, UDP_PORT));
            lab.backends.push(pod);
        }
        lab
    }

    /// A pod added while the agent runs (its interface appears later than the others).
    pub fn add_pod(&mut self, name: &str, with_server: bool) -> &Pod {
        let n = self.extra.len() as u8 + 1;
        let pod = Pod::create(&self.id, &self.node, name, &format!("vethx{n}"), Ipv4Addr::new(10, 244, 2, n));
        if with_server {
            self.servers.push(servers::Backend::start(&pod.ns, &pod.name, TCP_PORT, UDP_PORT));
        }
        self.extra.push(pod);
        self.extra.last().unwrap()
    }

    /// Keeps a server the test started until the lab is dropped.
    pub fn keep_server(&mut self, server: servers::Backend) {
        self.servers.push(server);
    }

    /// The agent binary the lab runs.
    pub fn agent_bin(&self) -> &Path {
        &self.agent_bin
    }

    pub fn bpffs(&self) -> PathBuf {
        self.dir.join("bpf")
    }

    pub fn manifests(&self) -> PathBuf {
        self.dir.join("manifests")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    /// Writes a manifest atomically (see `write_atomically`).
    pub fn write_manifest(&self, name: &str, text: &str) {
        write_atomically(&self.manifests(), name, text);
    }

    pub fn remove_manifest(&self, name: &str) {
        fs::remove_file(self.manifests().join(name)).expect("remove manifest");
    }

    /// Starts the agent inside the node namespace on the manifest directory (its log goes to
    /// `agent.log`).
    pub fn start_agent(&mut self) {
        self.start_agent_with_extra(&[]);
    }

    /// Starts the agent on the manifest directory with `extra` flags.
    pub fn start_agent_with_extra(&mut self, extra: &[&str]) {
        let dir = self.manifests();
        let mut args = vec![std::ffi::OsStr::new("--manifests"), dir.as_os_str()];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        self.start_agent_with(&args);
    }

    /// Starts the agent against an API server through `kubeconfig`, with `extra` flags.
    pub fn start_agent_kube(&mut self, kubeconfig: &Path, extra: &[&str]) {
        let mut args = vec![std::ffi::OsStr::new("--kubeconfig"), kubeconfig.as_os_str()];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        self.start_agent_with(&args);
    }

    /// Starts `proxy-agent run` in the node namespace with the lab's root and node name and
    /// the given source flags.
    pub fn start_agent_with(&mut self, source: &[&std::ffi::OsStr]) {
        assert!(self.agent.is_none(), "agent already running");
        let fixed = ["--hostname-override", NODE_NAME, "--log-level", self.agent_log_level];
        let mut args: Vec<&std::ffi::OsStr> = fixed.iter().map(std::ffi::OsStr::new).collect();
        args.extend_from_slice(source);
        let root = self.bpffs();
        args.push(std::ffi::OsStr::new("--bpffs-root"));
        args.push(root.as_os_str());
        let none = PathBuf::from("none");
        if !source.iter().any(|a| *a == "--cgroup-root") {
            args.push(std::ffi::OsStr::new("--cgroup-root"));
            args.push(self.cgroup.as_ref().unwrap_or(&none).as_os_str());
        }
        self.agent = Some(spawn_agent_limited(&self.agent_bin, &self.node, &args, &self.log_path(), &self.agent_limits));
    }

    /// Starts the agent as `ip netns exec <node> proxy-agent run --manifests DIR` with every
    /// other setting at its default (pin root, cgroup root), the way a newcomer tries it. Unlike
    /// `start_agent`, `ip netns exec` gives the agent a mount namespace of its own with a fresh
    /// /sys: no bpffs at /sys/fs/bpf and no cgroup v2 hierarchy, as inside a container or on a
    /// cgroup v1 host.
    pub fn start_agent_with_defaults_in_ip_netns_exec(&mut self) {
        assert!(self.agent.is_none(), "agent already running");
        let log = fs::OpenOptions::new().create(true).append(true).open(self.log_path()).expect("agent log");
        let child = Command::new("ip")
            .args(["netns", "exec", &self.node.name])
            .arg(&self.agent_bin)
            .args(["run", "--hostname-override", NODE_NAME, "--log-level", self.agent_log_level, "--manifests"])
            .arg(self.manifests())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {} in ip netns exec: {e}", self.agent_bin.display()));
        self.agent = Some(child);
    }

    fn signal_agent(&mut self, sig: i32) {
        if let Some(mut child) = self.agent.take() {
            // Not once it has been reaped (`agent_running` reaps an agent that ended): its pid
            // may be another process's by now.
            if matches!(child.try_wait(), Ok(None)) {
                // SAFETY: signalling our own child, not reaped yet.
                unsafe { libc::kill(child.id() as i32, sig) };
            }
            let _ = child.wait();
        }
    }

    /// SIGKILL: the agent gets no chance to clean up.
    pub fn kill_agent(&mut self) {
        self.signal_agent(libc::SIGKILL);
    }

    /// SIGTERM and wait.
    pub fn stop_agent(&mut self) {
        self.signal_agent(libc::SIGTERM);
    }

    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.as_ref().map(|c| c.id())
    }

    pub fn agent_running(&mut self) -> bool {
        self.agent.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn agent_log(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = fs::File::open(self.log_path()) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    pub fn log_tail(&self) -> String {
        let log = self.agent_log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub fn inspect(&self) -> Result<Report, inspect::InspectError> {
        inspect::read(&self.bpffs())
    }

    /// Waits until `cond` holds for what is programmed, or panics after 15 s with the agent's
    /// log, so a broken agent fails the test instead of hanging it.
    pub fn wait_for(&mut self, what: &str, cond: impl Fn(&Report) -> bool) -> Report {
        self.wait_for_within(what, Duration::from_secs(15), cond)
    }

    /// `wait_for`, panicking after `limit`.
    pub fn wait_for_within(&mut self, what: &str, limit: Duration, cond: impl Fn(&Report) -> bool) -> Report {
        let deadline = Instant::now() + limit;
        loop {
            let report = self.inspect();
            if let Ok(r) = &report {
                if cond(r) {
                    return report.unwrap();
                }
            }
            if self.agent.is_some() && !self.agent_running() {
                panic!("the agent exited while waiting for {what}; its log:\n{}", self.log_tail());
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out waiting for {what}; programmed: {}\nagent log:\n{}",
                    match &report {
                        Ok(r) => inspect::render(r),
                        Err(e) => e.to_string(),
                    },
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the agent's log holds `needle` at least `count` times (15 s at most).
    pub fn wait_log(&mut self, needle: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.agent_log().matches(needle).count() < count {
            if self.agent.is_some() && !self.agent_running() {
                panic!("the agent exited while waiting for {needle:?} in its log:\n{}", self.log_tail());
            }
            assert!(Instant::now() < deadline, "timed out waiting for {count}x {needle:?} in the log:\n{}", self.log_tail());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the frontend `vip` (`a.b.c.d:port`) has exactly `backends` backends and every
    /// pod interface has the programs attached.
    pub fn wait_programmed(&mut self, vip: &str, proto: &str, backends: usize) -> Report {
        self.wait_programmed_within(vip, proto, backends, Duration::from_secs(15))
    }

    /// `wait_programmed`, panicking after `limit`.
    pub fn wait_programmed_within(&mut self, vip: &str, proto: &str, backends: usize, limit: Duration) -> Report {
        let interfaces = 1 + self.backends.len() + self.extra.len();
        self.wait_for_within(&format!("{vip}/{proto} with {backends} backends on {interfaces} interfaces"), limit, |r| {
            r.interfaces.len() >= interfaces
                && r.frontends.iter().any(|f| f.address == vip && f.protocol == proto && f.backends.len() == backends)
        })
    }

    /// Asks `to` once from a host-network process of the node (in the lab's cgroup): `ok
    /// <backend> <peer the backend saw> <peer the socket reports>` or `err <kind>` (see
    /// `proxy-host-client`). `proto`: tcp or udp (unconnected).
    pub fn host_ask(&self, proto: &str, to: &str) -> String {
        let cgroup = self.cgroup.as_ref().expect("a cgroup v2 hierarchy (see Lab::cgroup)");
        let bin = self.agent_bin.with_file_name("proxy-host-client");
        let netns = format!("/run/netns/{}", self.node.name);
        let out = Command::new(&bin)
            .args([cgroup.as_os_str(), std::ffi::OsStr::new(&netns), std::ffi::OsStr::new(proto), std::ffi::OsStr::new(to)])
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
        assert!(out.status.success(), "{}: {}", bin.display(), String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    pub fn backend_ips(&self) -> Vec<Ipv4Addr> {
        self.backends.iter().map(|b| b.ip).collect()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.kill_agent();
        self.servers.clear();
        remove_lab_dir(&self.dir);
        // Empty once the host clients have exited; the hooks' links went with their pins.
        if let Some(c) = &self.cgroup {
            let _ = fs::remove_dir(c);
        }
        // The namespaces (and the veths in them) go when the fields drop.
    }
}

/// Writes `dir/name` atomically (a hidden temporary file, then a rename), as editors and
/// ConfigMap updates do, so the agent never reads half a manifest.
pub fn write_atomically(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, text).expect("write manifest");
    fs::rename(&tmp, dir.join(name)).expect("rename manifest");
}

/// Unpins everything pinned under `root` (detaching its links) and unmounts the bpffs the
/// agent or a test mounted there. The directory itself is the caller's to remove.
pub fn release_bpffs(root: &Path) {
    let _ = proxy_agent::dataplane::ebpf::loader::unpin_all(root);
    if let Ok(c) = std::ffi::CString::new(root.as_os_str().as_encoded_bytes()) {
        // SAFETY: plain umount of a bpffs mounted for a test.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Releases every bpffs mounted at or under `dir` (`release_bpffs`), deepest first, then
/// removes `dir`: what a lab whose run was interrupted leaves (its agents, children of the run,
/// are gone by then; see `interrupt`).
pub fn remove_lab_dir(dir: &Path) {
    // Sorted: a mount under another comes after it, and is released first.
    for p in bpf_mounts().iter().rev().filter(|p| p.starts_with(dir)) {
        release_bpffs(p);
    }
    let _ = fs::remove_dir_all(dir);
}

/// The mount points of every bpffs this process sees.
pub fn bpf_mounts() -> std::collections::BTreeSet<PathBuf> {
    proxy_agent::bpffs::mount_points("bpf").into_iter().collect()
}

/// A temporary directory for pins (a bpffs is mounted there when they are first made),
/// released and removed when it drops, also when a test fails.
/// Its second field removes the directory if a signal ends the run first (`interrupt`); it is
/// held, not read.
pub struct TempBpffs(pub PathBuf, #[allow(dead_code)] crate::interrupt::Registration);

impl TempBpffs {
    pub fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("{prefix}-{}", unique_id()));
        let at = dir.clone();
        Self(dir, crate::interrupt::register(move || remove_lab_dir(&at)))
    }
}

impl Drop for TempBpffs {
    fn drop(&mut self) {
        remove_lab_dir(&self.0);
    }
}

/// Starts `proxy-agent run <args>` inside `node`'s network namespace, logging to `log`.
pub fn spawn_agent(bin: &Path, node: &Netns, args: &[&std::ffi::OsStr], log: &Path) -> Child {
    spawn_agent_limited(bin, node, args, log, &Limits::default())
}

/// What a test starts the agent without.
#[derive(Clone, Debug, Default)]
pub struct Limits {
    /// A limit on open files (soft, hard).
    pub nofile: Option<(u64, u64)>,
    /// Capabilities taken out of the bounding set, so the agent (run as root) lacks them, as
    /// in a container whose securityContext does not add them.
    pub drop_caps: Vec<u32>,
}

/// As `spawn_agent`, within `limits`.
pub fn spawn_agent_limited(bin: &Path, node: &Netns, args: &[&std::ffi::OsStr], log: &Path, limits: &Limits) -> Child {
    let log = fs::OpenOptions::new().create(true).append(true).open(log).expect("agent log");
    let ns = node.file();
    let mut cmd = Command::new(bin);
    cmd.arg("run").args(args).stdin(Stdio::null()).stdout(log.try_clone().expect("log fd")).stderr(log);
    let (nofile, drop_caps) = (limits.nofile, limits.drop_caps.clone());
    // SAFETY: only async-signal-safe work (setrlimit, prctl, setns) between fork and exec.
    // Entering only the network namespace keeps the agent's bpffs mount in the host's mount
    // namespace, where it outlives the agent.
    unsafe {
        cmd.pre_exec(move || {
            if let Some((soft, hard)) = nofile {
                let lim = libc::rlimit { rlim_cur: soft, rlim_max: hard };
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
            for &cap in &drop_caps {
                if libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            enter(&ns)
        });
    }
    cmd.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()))
}

impl Pod {
    /// The pod's MAC address (its `eth0`), made from its IPv4 address.
    pub fn mac(&self) -> String {
        mac_of(self.ip)
    }

    /// Gives the pod an IPv6 address too (`ip`/128, no duplicate detection), routed both
    /// ways through the node like its IPv4 one: the node's side of the pair is the pod's
    /// gateway (fe80::1, a static neighbour), and the node routes `ip` to the pair. The node
    /// must forward IPv6 (`net.ipv6.conf.all.forwarding`).
    pub fn add_ipv6(&self, node: &Netns, ip: std::net::Ipv6Addr) {
        self.ns.ip(&["-6", "addr", "add", &format!("{ip}/128"), "dev", "eth0", "nodad"]);
        self.ns.ip(&["-6", "route", "add", "fe80::1", "dev", "eth0"]);
        self.ns.ip(&["-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0"]);
        self.ns.ip(&["-6", "neigh", "add", "fe80::1", "lladdr", NODE_MAC, "dev", "eth0", "nud", "permanent"]);
        node.ip(&["-6", "route", "add", &format!("{ip}/128"), "dev", &self.host_if]);
        node.ip(&["-6", "neigh", "add", &ip.to_string(), "lladdr", &self.mac(), "dev", &self.host_if, "nud", "permanent"]);
    }

    pub fn create(id: &str, node: &Netns, name: &str, host_if: &str, ip: Ipv4Addr) -> Self {
        let ns = Netns::create(format!("pxl-{id}-{name}"));
        let pod_mac = mac_of(ip);
        node.ip(&[
            "link", "add", host_if, "address", NODE_MAC, "type", "veth", "peer", "name", "eth0", "address", &pod_mac, "netns", &ns.name,
        ]);
        node.ip(&["link", "set", host_if, "up"]);
        node.ip(&["route", "add", &format!("{ip}/32"), "dev", host_if, "scope", "link"]);
        // Static neighbours both ways: the lab needs no ARP to work.
        node.ip(&["neigh", "add", &ip.to_string(), "lladdr", &pod_mac, "dev", host_if, "nud", "permanent"]);
        ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
        ns.ip(&["link", "set", "eth0", "up"]);
        ns.ip(&["route", "add", GATEWAY, "dev", "eth0", "scope", "link"]);
        ns.ip(&["route", "add", "default", "via", GATEWAY, "dev", "eth0"]);
        ns.ip(&["neigh", "add", GATEWAY, "lladdr", NODE_MAC, "dev", "eth0", "nud", "permanent"]);
        Self { name: name.into(), ns, ip, host_if: host_if.into() }
    }
}

fn mac_of(ip: Ipv4Addr) -> String {
    format!("02:00:0a:f4:{:02x}:{:02x}", ip.octets()[2], ip.octets()[3])
}

/// A process's resident memory in MiB, from /proc (0 when it is gone).
pub fn rss_mib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kb| kb / 1024)
}

/// A Service manifest. `ports`: (name, port, protocol, targetPort).
pub fn service(name: &str, cluster_ip: &str, ports: &[(&str, u16, &str, u16)]) -> String {
    let mut s = format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  type: ClusterIP\n  clusterIP: {cluster_ip}\n  ports:\n");
    for (n, p, proto, t) in ports {
        s += &format!("  - name: {n}\n    port: {p}\n    protocol: {proto}\n    targetPort: {t}\n");
    }
    s
}

/// An EndpointSlice manifest for Service `svc`. `ports`: (name, port, protocol).
pub fn endpoint_slice(svc: &str, name: &str, endpoints: &[Ipv4Addr], ports: &[(&str, u16, &str)]) -> String {
    endpoint_slice_in("default", svc, name, endpoints, ports)
}

/// `endpoint_slice` in namespace `namespace`.
pub fn endpoint_slice_in(namespace: &str, svc: &str, name: &str, endpoints: &[Ipv4Addr], ports: &[(&str, u16, &str)]) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {namespace}\n  labels:\n    kubernetes.io/service-name: {svc}\naddressType: IPv4\nports:\n"
    );
    for (n, p, proto) in ports {
        s += &format!("- name: {n}\n  port: {p}\n  protocol: {proto}\n");
    }
    s += if endpoints.is_empty() { "endpoints: []\n" } else { "endpoints:\n" };
    for ip in endpoints {
        s += &format!(
            "- addresses: [\"{ip}\"]\n  conditions: {{ready: true, serving: true, terminating: false}}\n  nodeName: {NODE_NAME}\n"
        );
    }
    s
}

/// The lab's Node object, in zone `zone-a`.
pub fn node_manifest() -> String {
    format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE_NAME}\n  labels:\n    topology.kubernetes.io/zone: zone-a\n")
}

/// The three standard Services: web (TCP 80 -> 8080), dns (UDP 53 -> 5353) over `endpoints`,
/// and one without endpoints.
pub fn standard_manifests(endpoints: &[Ipv4Addr]) -> String {
    standard_objects(endpoints).join("---\n")
}

/// The standard Services and their slices, one manifest each.
pub fn standard_objects(endpoints: &[Ipv4Addr]) -> Vec<String> {
    vec![
        service("web", "10.96.0.10", &[("http", 80, "TCP", TCP_PORT)]),
        endpoint_slice("web", "web-1", endpoints, &[("http", TCP_PORT, "TCP")]),
        service("dns", "10.96.0.53", &[("dns", 53, "UDP", UDP_PORT)]),
        endpoint_slice("dns", "dns-1", endpoints, &[("dns", UDP_PORT, "UDP")]),
        service("empty", "10.96.0.99", &[("http", 80, "TCP", TCP_PORT)]),
        endpoint_slice("empty", "empty-1", &[], &[("http", TCP_PORT, "TCP")]),
    ]
}

/// The directory an executable lives in, to find its sibling binaries (the demo and the
/// benchmarks use the lab agent built next to them).
pub fn sibling(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current executable");
    let dir = exe.parent().unwrap_or(Path::new("."));
    dir.join(name)
}
