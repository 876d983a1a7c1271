//! The conformance suite: the ClusterIP and north-south lab scenarios, run against every proxy
//! mode with the same assertions, so the fallback modes are held to the eBPF dataplane's
//! Service semantics. Where a mode cannot do something (XDP, Maglev) or does it differently by
//! design (kube-proxy masquerades externally-sourced traffic to local endpoints under
//! externalTrafficPolicy Cluster), the scenario says so in its output and asserts the mode's
//! own behaviour; nothing is skipped silently.
//!
//! Scenarios are plain functions of a mode, so `cargo test` (tests/tests/conformance.rs) and
//! the IPVS guest's runner (`proxy-conformance`) run the same code.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
    time::{Duration, Instant},
};

use proxy_agent::dataplane::ProxyMode;

use crate::{
    cluster::{self, nodes_manifest, slice, Cluster, CLIENT_IP},
    lab::{sock, standard_manifests, Lab, DNS_VIP, EMPTY_VIP, WEB_VIP},
    require,
    servers::{http_get_with_headers, tcp_ask, tcp_ask_any, udp_ask_any, udp_ask_connected, Answer, UdpFlow},
};

/// What a mode cannot do at all, and why.
pub fn unsupported(mode: ProxyMode, feature: &str) -> Option<&'static str> {
    match (mode, feature) {
        (ProxyMode::Ebpf, _) => None,
        (_, "xdp") => Some("XDP is an eBPF program; the netfilter modes work in the kernel's stack"),
        (_, "maglev") => Some("consistent hashing is the eBPF dataplane's; iptables and nftables pick at random, IPVS by its scheduler"),
        (_, "trace") => Some("`proxy-agent trace` runs packets through the eBPF programs"),
        (ProxyMode::Iptables | ProxyMode::Ipvs, "service-cidrs") => {
            Some("kube-proxy's iptables and IPVS modes do not act on ServiceCIDRs (its nftables mode does: cluster-ips-check)")
        }
        _ => None,
    }
}

/// Prints that a scenario does not apply to `mode`, and why. True when it does not.
pub fn not_applicable(mode: ProxyMode, feature: &str, scenario: &str) -> bool {
    match unsupported(mode, feature) {
        Some(why) => {
            println!("NOT APPLICABLE {scenario} in {mode} mode: {why}");
            true
        }
        None => false,
    }
}

/// The agent flags of a mode in the lab (pods are 10.244.0.0/16).
pub fn mode_args(mode: ProxyMode) -> Vec<String> {
    vec!["--proxy-mode".into(), mode.as_str().into(), "--cluster-cidr".into(), "10.244.0.0/16".into()]
}

/// Retries `f` until it returns Ok (or 30 s pass): the netfilter modes have no programmed
/// state to poll, so readiness is the traffic itself. (A deadline, not a timing: in the IPVS
/// guest on a busy host an agent's first sync, with its first kernel module loads, took more
/// than 15 s.)
pub fn eventually<T>(what: &str, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if Instant::now() > deadline => panic!("timed out waiting for {what}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// One family of the single-node lab: its Services' addresses (web TCP, dns UDP, one without
/// endpoints) and the pods' addresses in it.
struct InFamily {
    name: &'static str,
    web: SocketAddr,
    dns: SocketAddr,
    empty: SocketAddr,
    client: IpAddr,
    backends: Vec<IpAddr>,
}

/// SYNs a refused connect() to `to` may send again before the refusal (see
/// `a_service_without_endpoints_refuses`): none in IPv4, one in IPv6.
fn syn_resends(to: IpAddr) -> u64 {
    u64::from(to.is_ipv6())
}

/// The lab's families: IPv4, and IPv6 (`dual_stack`).
fn families(lab: &Lab) -> [InFamily; 2] {
    let v4 = InFamily {
        name: "IPv4",
        web: sock(WEB_VIP).into(),
        dns: sock(DNS_VIP).into(),
        empty: sock(EMPTY_VIP).into(),
        client: lab.client.ip.into(),
        backends: lab.backend_ips().into_iter().map(IpAddr::from).collect(),
    };
    let v6 = InFamily {
        name: "IPv6",
        web: "[fd00:96::10]:80".parse().unwrap(),
        dns: "[fd00:96::53]:53".parse().unwrap(),
        empty: "[fd00:96::99]:80".parse().unwrap(),
        client: pod6(2).into(),
        backends: (1..=lab.backends.len()).map(|i| pod6(0x100 + i as u16).into()).collect(),
    };
    [v4, v6]
}

/// A pod's IPv6 address in the lab (`dual_stack`).
fn pod6(i: u16) -> std::net::Ipv6Addr {
    std::net::Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, i)
}

/// Makes the lab dual-stack, as a dual-stack node is: the node an IPv6 address and default
/// route on its uplink, every pod an IPv6 address (the client fd00:244::2, backend i
/// fd00:244::10i), and each backend the servers of the IPv6 endpoints (TCP 8082, UDP 5354:
/// the IPv4 servers hold 8080 and 5353).
fn dual_stack(lab: &mut Lab) {
    lab.node.sysctl("net.ipv6.conf.all.forwarding", "1");
    lab.node.ip(&["-6", "addr", "add", "fd00:250::1/64", "dev", "uplink0", "nodad"]);
    lab.node.ip(&["-6", "route", "add", "default", "via", "fd00:250::fe", "dev", "uplink0"]);
    lab.client.add_ipv6(&lab.node, pod6(2));
    let mut servers = Vec::new();
    for (i, b) in lab.backends.iter().enumerate() {
        b.add_ipv6(&lab.node, pod6(0x100 + i as u16 + 1));
        servers.push(crate::servers::Backend::start_on(&b.ns, &b.name, std::net::Ipv6Addr::UNSPECIFIED.into(), 8082, 5354));
    }
    for s in servers {
        lab.keep_server(s);
    }
}

/// The IPv6 EndpointSlice `<svc>-v6` of Service `namespace/svc`: port `port` (YAML), over the
/// backends `v6` (1-based backend numbers).
fn slice6(namespace: &str, svc: &str, port: &str, v6: &[usize]) -> String {
    let eps: String = v6.iter().map(|&i| format!("- addresses: ['{}']\n", pod6(0x100 + i as u16))).collect();
    let eps = if eps.is_empty() { "[]\n".to_string() } else { format!("\n{eps}") };
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {svc}-v6\n  namespace: {namespace}\n  labels:\n    kubernetes.io/service-name: {svc}\naddressType: IPv6\nports:\n- {port}\nendpoints: {eps}"
    )
}

/// The standard Services (`lab::standard_manifests`) made dual-stack: each with an IPv6
/// cluster IP beside its IPv4 one and an IPv6 EndpointSlice beside its IPv4 one, over the
/// backends `v4` and `v6` (1-based backend numbers in each).
fn dual_stack_manifests(lab: &Lab, v4: &[usize], v6: &[usize]) -> String {
    let ips4: Vec<Ipv4Addr> = v4.iter().map(|&i| lab.backend_ips()[i - 1]).collect();
    let slice6 = |svc: &str, port: &str, v6: &[usize]| slice6("default", svc, port, v6);
    let svc = |name: &str, n: u8, port: &str| {
        cluster::service(
            name,
            &format!(
                "  clusterIP: 10.96.0.{n}\n  clusterIPs: [10.96.0.{n}, 'fd00:96::{n}']\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports:\n  - {port}\n"
            ),
            None,
        )
    };
    let (tcp, udp) = (crate::lab::TCP_PORT, crate::lab::UDP_PORT);
    [
        svc("web", 10, &format!("{{name: http, port: 80, targetPort: {tcp}, protocol: TCP}}")),
        crate::lab::endpoint_slice("web", "web-1", &ips4, &[("http", tcp, "TCP")]),
        slice6("web", "{name: http, port: 8082, protocol: TCP}", v6),
        svc("dns", 53, &format!("{{name: dns, port: 53, targetPort: {udp}, protocol: UDP}}")),
        crate::lab::endpoint_slice("dns", "dns-1", &ips4, &[("dns", udp, "UDP")]),
        slice6("dns", "{name: dns, port: 5354, protocol: UDP}", v6),
        svc("empty", 99, &format!("{{name: http, port: 80, targetPort: {tcp}, protocol: TCP}}")),
        crate::lab::endpoint_slice("empty", "empty-1", &[], &[("http", tcp, "TCP")]),
        slice6("empty", "{name: http, port: 8082, protocol: TCP}", &[]),
    ]
    .join("---\n")
}

/// `lab` with ServiceCIDR objects for both families' Service ranges (10.96.0.0/16,
/// fd00:96::/112).
fn lab_with_service_cidrs(agent: &Path, mode: ProxyMode) -> Lab {
    lab_with(
        agent,
        mode,
        Some((
            "service-cidr.yaml",
            "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16, 'fd00:96::/112']}\n",
        )),
    )
}

/// The single-node lab with three backends and the standard Services in both families
/// (`dual_stack_manifests`), agent running in `mode`, traffic flowing in both.
pub fn lab(agent: &Path, mode: ProxyMode) -> Lab {
    lab_with(agent, mode, None)
}

/// `lab`, with one more manifest (file name, text) beside the Services.
fn lab_with(agent: &Path, mode: ProxyMode, extra: Option<(&str, &str)>) -> Lab {
    lab_with_objects(agent, mode, 3, |_| extra.map(|(name, text)| (name.to_string(), text.to_string())))
}

/// `lab_with`, with `backends` backends (the standard Services use the first three), the extra
/// manifest made from the lab (its backends' addresses).
fn lab_with_objects(agent: &Path, mode: ProxyMode, backends: usize, extra: impl FnOnce(&Lab) -> Option<(String, String)>) -> Lab {
    let mut lab = Lab::new(agent, backends);
    dual_stack(&mut lab);
    lab.write_manifest("services.yaml", &dual_stack_manifests(&lab, &[1, 2, 3], &[1, 2, 3]));
    if let Some((name, text)) = extra(&lab) {
        lab.write_manifest(&name, &text);
    }
    start_dual_stack(&mut lab, mode);
    lab
}

/// Starts the agent in `mode` on the dual-stack lab and waits until the web Service reaches
/// every backend in both families.
fn start_dual_stack(lab: &mut Lab, mode: ProxyMode) {
    lab.start_agent_with_extra(&["--proxy-mode", mode.as_str(), "--cluster-cidr", "10.244.0.0/16,fd00:244::/64"]);
    let all: BTreeSet<String> = (1..=3).map(|i| format!("backend-{i}")).collect();
    for f in families(lab) {
        eventually(&format!("the {} web Service to reach every backend", f.name), || {
            let seen: BTreeSet<String> = (0..30).filter_map(|_| tcp_ask_any(&lab.client.ns, f.web).ok()).map(|a| a.backend).collect();
            if seen == all {
                Ok(())
            } else {
                Err(format!("answered by {seen:?}"))
            }
        });
    }
}

/// Starts the agent in `mode` (with `extra` flags) and waits until the web Service reaches
/// every backend.
fn start(lab: &mut Lab, mode: ProxyMode, extra: &[&str]) {
    let mode_args = mode_args(mode);
    let args: Vec<&str> = mode_args.iter().map(String::as_str).chain(extra.iter().copied()).collect();
    lab.start_agent_with_extra(&args);
    let all: BTreeSet<String> = (1..=3).map(|i| format!("backend-{i}")).collect();
    eventually("the web Service to reach every backend", || {
        let seen: BTreeSet<String> = (0..30).filter_map(|_| tcp_ask(&lab.client.ns, sock(WEB_VIP)).ok()).map(|a| a.backend).collect();
        if seen == all {
            Ok(())
        } else {
            Err(format!("answered by {seen:?}"))
        }
    });
}

/// `--iptables-backend`: with kubelet's hint chain in iptables-legacy, `auto` writes there and
/// Services work from there; restarted with `--iptables-backend nft`, the rules move to
/// iptables-nft and nothing of ours stays in legacy, while kubelet's chain does.
pub fn iptables_backends(agent: &Path) {
    let mut lab = Lab::new(agent, 3);
    lab.write_manifest("services.yaml", &standard_manifests(&lab.backend_ips()));
    let node = lab.node.name.clone();
    let in_node = |args: &[&str]| in_netns(&node, args);
    // What kubelet does on a legacy node.
    in_node(&["iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"]);
    let nat = |save: &str| in_node(&[save, "-t", "nat"]);
    let ours = |save: &str| -> Vec<String> {
        nat(save).lines().filter(|l| l.starts_with(":KUBE-") || l.contains("-j KUBE-")).map(String::from).collect()
    };
    start(&mut lab, ProxyMode::Iptables, &[]);
    let legacy = nat("iptables-legacy-save");
    assert!(
        legacy.contains(":KUBE-SERVICES")
            && legacy.contains(":KUBE-SVC-")
            && legacy.contains("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"),
        "auto: the rules are in iptables-legacy:\n{legacy}"
    );
    assert_eq!(ours("iptables-nft-save"), Vec::<String>::new(), "auto: nothing in iptables-nft");
    let log = lab.agent_log();
    assert!(log.contains("KUBE-IPTABLES-HINT"), "the agent says why it chose legacy:\n{log}");
    let err = tcp_ask(&lab.client.ns, sock(EMPTY_VIP)).expect_err("no endpoints");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "legacy: {err}");

    lab.stop_agent();
    start(&mut lab, ProxyMode::Iptables, &["--iptables-backend", "nft"]);
    let nft = nat("iptables-nft-save");
    assert!(nft.contains(":KUBE-SVC-"), "nft: the rules are in iptables-nft:\n{nft}");
    assert_eq!(ours("iptables-legacy-save"), Vec::<String>::new(), "switching to nft leaves nothing of ours in legacy");
    assert!(in_node(&["iptables-legacy-save", "-t", "mangle"]).contains(":KUBE-IPTABLES-HINT"), "kubelet's chain stays");
    let err = tcp_ask(&lab.client.ns, sock(EMPTY_VIP)).expect_err("no endpoints");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "nft: {err}");
}

/// Runs a command in network namespace `ns` (`ip netns exec`), panicking if it fails.
fn in_netns(ns: &str, args: &[&str]) -> String {
    let mut a = vec!["ip", "netns", "exec", ns];
    a.extend_from_slice(args);
    crate::netns::sh(&a)
}

/// Loads `fixtures/<file>` (kube-proxy's rules) into namespace `ns` with `tool --noflush`.
fn restore_fixture(ns: &str, tool: &str, file: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(file);
    let status = std::process::Command::new("ip")
        .args(["netns", "exec", ns, tool, "--noflush"])
        .stdin(std::fs::File::open(&path).expect("fixture"))
        .status()
        .expect("restore");
    assert!(status.success(), "{tool} < {}", path.display());
}

/// Taking a node over from kube-proxy: what kube-proxy left (its IPv4 and IPv6 iptables rules,
/// each in another backend, and both of its nftables tables) is gone or rewritten as the
/// agent's own once the agent starts in `mode`, while kubelet's chains and the CNI's rules and table stay; going back with
/// `proxy-agent cleanup` leaves nothing of the agent's and still keeps theirs. (IPVS state is
/// not loaded here: this kernel has no IPVS; the IPVS mode's own cleanup covers it.)
pub fn taking_over_from_kube_proxy(agent: &Path, mode: ProxyMode) {
    let mut lab = Lab::new(agent, 3);
    lab.write_manifest("services.yaml", &standard_manifests(&lab.backend_ips()));
    let node = lab.node.name.clone();
    let in_node = |args: &[&str]| in_netns(&node, args);
    restore_fixture(&node, "iptables-nft-restore", "kube-proxy-ipv4.rules");
    restore_fixture(&node, "ip6tables-legacy-restore", "kube-proxy-ipv6.rules");
    in_node(&["nft", "-f", concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/kube-proxy.nft")]);
    // kube-proxy's chains in every family, backend and table, and the nftables tables left.
    let leftovers = |in_node: &dyn Fn(&[&str]) -> String| -> Vec<String> {
        let mut out = Vec::new();
        for save in ["iptables-nft-save", "iptables-legacy-save", "ip6tables-nft-save", "ip6tables-legacy-save"] {
            for line in in_node(&[save]).lines().filter(|l| l.starts_with(":KUBE-")) {
                let chain = line[1..].split(' ').next().unwrap_or("");
                if !["KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-FIREWALL"].contains(&chain) {
                    out.push(format!("{save}: {chain}"));
                }
            }
        }
        out.extend(in_node(&["nft", "list", "tables"]).lines().filter(|l| l.ends_with("kube-proxy")).map(String::from));
        out
    };
    let theirs = |in_node: &dyn Fn(&[&str]) -> String| {
        for (save, chain) in [
            ("iptables-nft-save", ":KUBE-KUBELET-CANARY"),
            ("iptables-nft-save", ":CNI-FORWARD"),
            ("iptables-nft-save", "-A FORWARD -m comment --comment \"CNI firewall plugin rules\" -j CNI-FORWARD"),
            ("iptables-nft-save", ":KUBE-IPTABLES-HINT"),
            ("ip6tables-legacy-save", ":KUBE-KUBELET-CANARY"),
            ("ip6tables-legacy-save", ":CNI-HOSTPORT-DNAT"),
        ] {
            assert!(in_node(&[save]).contains(chain), "{mode}: {save} keeps {chain}");
        }
        assert!(in_node(&["nft", "list", "tables"]).contains("table inet cni-firewall"), "{mode}: the CNI's table stays");
    };
    let loaded = leftovers(&in_node);
    assert!(loaded.len() > 20, "the fixtures load kube-proxy's state");
    if mode == ProxyMode::Ebpf {
        // The DaemonSet's init container, in eBPF mode, leaves kube-proxy's rules to the agent.
        let root = lab.bpffs();
        let args = ["--init-only", "--proxy-mode", "ebpf", "--bpffs-root", root.to_str().unwrap(), "--cgroup-root", "none"];
        let args: Vec<&std::ffi::OsStr> = args.iter().map(std::ffi::OsStr::new).collect();
        let init = crate::lab::spawn_agent_limited(lab.agent_bin(), &lab.node, &args, &lab.log_path(), &Default::default());
        let status = init.wait_with_output().expect("init-only").status;
        assert!(status.success(), "--init-only: {status}\n{}", lab.agent_log());
        assert_eq!(leftovers(&in_node), loaded, "ebpf: --init-only leaves kube-proxy's state for the agent's first write");
    }
    start(&mut lab, mode, &[]);
    if mode == ProxyMode::Ebpf {
        // Removed after the maps are whole, not before: kube-proxy's rules serve until then.
        lab.wait_log("first whole write done: what kube-proxy or another mode left is removed", 1);
        let log = lab.agent_log();
        assert!(removed_after_the_first_write(&log), "ebpf: kube-proxy's state is removed after the first write:\n{log}");
    }
    let left = leftovers(&in_node);
    // The agent's own mode writes some of the same names, in both families: those are its own.
    let own: &[&str] = match mode {
        ProxyMode::Iptables => &["iptables-nft-save", "ip6tables-nft-save"],
        ProxyMode::Nftables => &["table ip kube-proxy", "table ip6 kube-proxy"],
        _ => &[],
    };
    let foreign: Vec<&String> = left.iter().filter(|l| !own.iter().any(|o| l.starts_with(o))).collect();
    assert!(foreign.is_empty(), "{mode}: kube-proxy's state is gone once the agent runs: {foreign:?}");
    assert!(
        !left.iter().any(|l| l.contains("KUBE-PROXY-CANARY") || l.contains("XPGD46QRK7WJZT7O")),
        "{mode}: nor its canaries and stale Services: {left:?}"
    );
    theirs(&in_node);

    // Going back: the agent's cleanup leaves nothing of its own.
    lab.stop_agent();
    let out = in_node(&[lab.agent_bin().to_str().unwrap(), "cleanup", "--bpffs-root", lab.bpffs().to_str().unwrap()]);
    assert!(!out.contains("nothing to remove"), "{mode}: cleanup removed what the agent had: {out}");
    assert_eq!(leftovers(&in_node), Vec::<String>::new(), "{mode}: nothing of ours after cleanup");
    assert!(lab.inspect().is_err(), "{mode}: no pins after cleanup");
    theirs(&in_node);
}

/// The eBPF mode removes kube-proxy's chains even where another chain jumps into them: that
/// jump makes the iptables mode's removal fail (one restore, KUBE-SERVICES still in use), and
/// the eBPF mode then removes the chains that translate with every jump into them (another
/// chain's too: it would lead nowhere). The other chain stays.
pub fn takeover_removes_chains_another_jumps_into(agent: &Path) {
    let mut lab = Lab::new(agent, 3);
    lab.write_manifest("services.yaml", &standard_manifests(&lab.backend_ips()));
    let node = lab.node.name.clone();
    let in_node = |args: &[&str]| in_netns(&node, args);
    restore_fixture(&node, "iptables-nft-restore", "kube-proxy-ipv4.rules");
    in_node(&["iptables-nft", "-t", "nat", "-N", "OTHER-PRE"]);
    in_node(&["iptables-nft", "-t", "nat", "-A", "OTHER-PRE", "-j", "KUBE-SERVICES"]);
    in_node(&["iptables-nft", "-t", "nat", "-A", "OTHER-PRE", "-p", "udp", "--dport", "9", "-j", "RETURN"]);
    let nat = || in_node(&["iptables-nft-save", "-t", "nat"]);
    assert!(nat().contains(":KUBE-SVC-"), "the fixture loads kube-proxy's Service chains:\n{}", nat());
    start(&mut lab, ProxyMode::Ebpf, &[]);
    lab.wait_log("first whole write done: what kube-proxy or another mode left is removed", 1);
    let after = nat();
    assert!(!after.contains(":KUBE-SERVICES") && !after.contains(":KUBE-SVC-") && !after.contains(":KUBE-SEP-"), "removed:\n{after}");
    assert!(
        after.contains(":OTHER-PRE") && after.contains("-A OTHER-PRE -p udp -m udp --dport 9 -j RETURN"),
        "the other chain stays:\n{after}"
    );
    assert!(!after.contains("-j KUBE-SERVICES"), "its jump into the removed chain goes:\n{after}");
}

/// Connections kube-proxy translated survive the eBPF mode's takeover: TCP connections and UDP
/// flows opened through DNAT rules of kube-proxy's form (random among the three backends, in
/// KUBE-SERVICES), before the agent starts, still reach the backend they had once our programs
/// serve their Services and kube-proxy's rules are gone. Without the adoption most of them
/// would be balanced afresh, and a TCP connection sent to another backend is reset; without the
/// deletion of their netfilter entries, netfilter's NAT would move the source port of what our
/// programs translated (its reply tuple is the old entry's), and the backend resets that. The
/// node's own connections (through kube-proxy's OUTPUT rules) go on too, left to netfilter's
/// entries: adopted, they stalled (our programs let their packets leave untranslated).
/// Connections kube-proxy's rules sent to the third backend are masqueraded as well (to the
/// node's address and a port netfilter chose, as `masqueradeAll` or a pod reaching itself has
/// it): they are left to netfilter, whose entries go on translating them, and keep their
/// backend and the address and port it sees.
///
/// With `loose` false (`nf_conntrack_tcp_loose` 0, where netfilter picks up no connection in
/// mid-stream, and the drop rule here would stall what it took for INVALID) all the same: the
/// adopted TCP connections' netfilter entries are made again as our programs translate them.
pub fn takeover_adopts_translated_connections(agent: &Path, loose: bool) {
    use crate::servers::Conn;
    let mut lab = Lab::new(agent, 3);
    dual_stack(&mut lab);
    lab.write_manifest("services.yaml", &dual_stack_manifests(&lab, &[1, 2, 3], &[1, 2, 3]));
    let node = lab.node.name.clone();
    let in_node = |args: &[&str]| in_netns(&node, args);
    let (tcp, udp) = (crate::lab::TCP_PORT.to_string(), crate::lab::UDP_PORT.to_string());
    let v4: Vec<String> = lab.backend_ips().iter().map(|b| b.to_string()).collect();
    let v6: Vec<String> = (1..=3).map(|i| format!("[{}]", pod6(0x100 + i))).collect();
    for (tool, pods, backends, services) in [
        ("iptables-nft", "10.244.0.0/16", &v4, [("10.96.0.10", "tcp", "80", tcp.as_str()), ("10.96.0.53", "udp", "53", udp.as_str())]),
        ("ip6tables-nft", "fd00:244::/64", &v6, [("fd00:96::10", "tcp", "80", "8082"), ("fd00:96::53", "udp", "53", "5354")]),
    ] {
        let nat = |args: &[&str]| in_node(&[&[tool, "-t", "nat"], args].concat());
        nat(&["-N", "KUBE-SERVICES"]);
        nat(&["-A", "PREROUTING", "-j", "KUBE-SERVICES"]);
        nat(&["-A", "OUTPUT", "-j", "KUBE-SERVICES"]);
        // What keeps netfilter's conntrack and NAT on in a node's namespace once kube-proxy's
        // rules are gone (a CNI's masquerade, a drop of invalid packets): without them the
        // lab's kernel would stop tracking there, which a node's does not.
        nat(&["-A", "POSTROUTING", "-s", pods, "!", "-d", pods, "-j", "MASQUERADE"]);
        in_node(&[tool, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"]);
        let third = backends[2].trim_matches(['[', ']']);
        nat(&["-A", "POSTROUTING", "-d", third, "-j", "MASQUERADE", "--random-fully"]);
        // kube-proxy's form: each endpoint by a random draw among those left.
        for (vip, proto, port, to_port) in services {
            for (i, b) in backends.iter().enumerate() {
                let to = format!("{b}:{to_port}");
                let probability = format!("{:.5}", 1.0 / (backends.len() - i) as f64);
                let mut rule = vec!["-A", "KUBE-SERVICES", "-d", vip, "-p", proto, "--dport", port];
                if i + 1 < backends.len() {
                    rule.extend(["-m", "statistic", "--mode", "random", "--probability", &probability]);
                }
                rule.extend(["-j", "DNAT", "--to-destination", &to]);
                nat(&rule);
            }
        }
    }
    let web6: std::net::SocketAddr = "[fd00:96::10]:80".parse().unwrap();
    let dns6: std::net::SocketAddr = "[fd00:96::53]:53".parse().unwrap();
    let tcp_to: Vec<std::net::SocketAddr> = [[sock(WEB_VIP).into(); 12].as_slice(), &[web6; 6]].concat();
    let udp_to: Vec<std::net::SocketAddr> = [[sock(DNS_VIP).into(); 6].as_slice(), &[dns6; 3]].concat();
    let mut conns: Vec<(Conn, Answer)> = tcp_to
        .iter()
        .enumerate()
        .map(|(i, to)| {
            let mut c = Conn::open(&lab.client.ns, *to).unwrap_or_else(|e| panic!("connection {i} to {to} through kube-proxy's DNAT: {e}"));
            let first = c.ask().unwrap_or_else(|e| panic!("connection {i} to {to} through kube-proxy's DNAT: {e}"));
            (c, first)
        })
        .collect();
    let mut flows: Vec<(UdpFlow, Answer)> = udp_to
        .iter()
        .enumerate()
        .map(|(i, to)| {
            let f = UdpFlow::open(&lab.client.ns, *to).expect("UDP socket");
            let first = f.ask().unwrap_or_else(|e| panic!("UDP flow {i} to {to} through kube-proxy's DNAT: {e}"));
            (f, first)
        })
        .collect();
    let clients = families(&lab).map(|f| f.client);
    let masqueraded = conns.iter().map(|(_, a)| a).chain(flows.iter().map(|(_, a)| a)).filter(|a| a.backend == "backend-3");
    assert!(
        masqueraded.clone().all(|a| !clients.contains(&a.peer.ip())),
        "kube-proxy's rules masqueraded what reached the third backend: {:?}",
        masqueraded.map(|a| a.peer).collect::<Vec<_>>()
    );
    // The node's own processes' connections (kube-proxy's OUTPUT rules translated them): left
    // to netfilter's entries, which go on translating them.
    let mut host: Vec<(Conn, String)> = (0..3)
        .map(|i| {
            let mut c =
                Conn::open(&lab.node, sock(WEB_VIP)).unwrap_or_else(|e| panic!("host connection {i} through kube-proxy's DNAT: {e}"));
            let first = c.ask().unwrap_or_else(|e| panic!("host connection {i} through kube-proxy's DNAT: {e}")).backend;
            (c, first)
        })
        .collect();
    let reached: BTreeSet<&String> = conns.iter().map(|(_, a)| &a.backend).collect();
    assert!(reached.len() > 1, "kube-proxy's rules spread the connections: {reached:?}");
    if !loose {
        lab.node.sysctl("net.netfilter.nf_conntrack_tcp_loose", "0");
    }
    let left = conns.iter().map(|(_, a)| a).chain(flows.iter().map(|(_, a)| a)).filter(|a| a.backend == "backend-3").count() as u64;
    // Four of the TCP connections and two of the UDP flows are busy through the takeover: each
    // asks again as soon as it has its answer, from before the agent starts until after its
    // first write.
    type Ask = Box<dyn FnMut() -> std::io::Result<Answer> + Send>;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tcp_busy = conns.drain(..4).map(|(mut c, first)| (Box::new(move || c.ask()) as Ask, first));
    // (A datagram held back at the handover is lost: its client asks again, twice at most.)
    let udp_busy = flows.drain(..2).map(|(f, first)| {
        let ask = move || (0..2).find_map(|_| f.ask().ok()).map_or_else(|| f.ask(), Ok);
        (Box::new(ask) as Ask, first)
    });
    let busy: Vec<_> = tcp_busy
        .chain(udp_busy)
        .enumerate()
        .map(|(i, (mut ask, first))| {
            let stop = stop.clone();
            std::thread::spawn(move || crate::servers::ask_until(&stop, &format!("busy flow {i}"), &first, &mut ask))
        })
        .collect();
    start_dual_stack(&mut lab, ProxyMode::Ebpf);
    lab.wait_log("first whole write done: what kube-proxy or another mode left is removed", 1);
    std::thread::sleep(std::time::Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in busy {
        let asked = t.join().expect("a busy flow's thread").unwrap_or_else(|e| panic!("{e}\n{}", lab.log_tail()));
        assert!(asked > 100, "a busy flow asked {asked} times");
    }
    for tool in ["iptables-nft", "ip6tables-nft"] {
        let nat = in_node(&[tool, "-t", "nat", "-S"]);
        assert!(!nat.contains("KUBE-SERVICES"), "kube-proxy's rules are gone ({tool}):\n{nat}");
    }
    for (i, (c, first)) in conns.iter_mut().enumerate() {
        for _ in 0..2 {
            let now = c.ask().unwrap_or_else(|e| panic!("connection {i} ({first:?}) after the takeover: {e}\n{}", lab.log_tail()));
            assert_eq!((&now.backend, now.peer), (&first.backend, first.peer), "connection {i} stays with its backend, as it was");
        }
    }
    for (i, (c, first)) in host.iter_mut().enumerate() {
        let now = c.ask().unwrap_or_else(|e| panic!("host connection {i} (to {first}) after the takeover: {e}\n{}", lab.log_tail()));
        assert_eq!(&now.backend, first, "host connection {i} stays with its backend");
    }
    for (i, (f, first)) in flows.iter().enumerate() {
        let now = f.ask().unwrap_or_else(|e| panic!("UDP flow {i} ({first:?}) after the takeover: {e}\n{}", lab.log_tail()));
        assert_eq!((&now.backend, now.peer), (&first.backend, first.peer), "UDP flow {i} stays with its backend, as it was");
    }
    // The adoption says what it took at its end, its trailing read (a second or more after
    // the first sync's end).
    lab.wait_log("adopted the connections netfilter translated", 2);
    let log = lab.agent_log();
    let taken_over: Vec<(u64, u64)> = log
        .lines()
        .filter(|l| l.contains("adopted the connections netfilter translated"))
        .map(|l| {
            let field = |name: &str| l.split_whitespace().find_map(|w| w.strip_prefix(name)?.parse::<u64>().ok()).unwrap_or(u64::MAX);
            (field("adopted="), field("left_to_netfilter="))
        })
        .collect();
    assert!(
        taken_over.len() == 2
            && taken_over.iter().map(|(a, l)| a + l).collect::<BTreeSet<_>>() == BTreeSet::from([18, 9])
            && taken_over.iter().map(|(_, l)| l).sum::<u64>() == left,
        "the log counts IPv4's 12 TCP connections and 6 UDP flows, and IPv6's 6 and 3, the {left} to the third backend left to \
         netfilter: {taken_over:?}\n{}",
        lab.log_tail()
    );
}

/// kube-proxy's rules for the web Service alone, through `nat` (iptables-nft's nat table in
/// the lab's node): KUBE-SERVICES from PREROUTING, each of `backends` by a random draw among
/// those left, and a CNI's masquerade of pods' traffic (as in
/// `takeover_adopts_translated_connections`: what keeps netfilter's conntrack on in the node's
/// namespace once kube-proxy's rules are gone).
fn kube_proxy_web_rules(nat: &dyn Fn(&[&str]) -> String, backends: &[std::net::Ipv4Addr]) {
    nat(&["-N", "KUBE-SERVICES"]);
    nat(&["-A", "PREROUTING", "-j", "KUBE-SERVICES"]);
    nat(&["-A", "POSTROUTING", "-s", "10.244.0.0/16", "!", "-d", "10.244.0.0/16", "-j", "MASQUERADE"]);
    let backends: Vec<String> = backends.iter().map(|b| format!("{b}:{}", crate::lab::TCP_PORT)).collect();
    for (i, to) in backends.iter().enumerate() {
        let probability = format!("{:.5}", 1.0 / (backends.len() - i) as f64);
        let mut rule = vec!["-A", "KUBE-SERVICES", "-d", "10.96.0.10", "-p", "tcp", "--dport", "80"];
        if i + 1 < backends.len() {
            rule.extend(["-m", "statistic", "--mode", "random", "--probability", &probability]);
        }
        rule.extend(["-j", "DNAT", "--to-destination", to]);
        nat(&rule);
    }
}

/// `clients` threads in the lab's client namespace, each opening connections to the web
/// Service until `stop`: it connects, asks, waits 30 ms and asks again, waiting up to
/// `patience` for each answer. Each thread's (connections opened, those that failed or whose
/// second answer came from another backend).
fn keep_opening(
    lab: &Lab,
    clients: usize,
    patience: std::time::Duration,
    stop: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<std::thread::JoinHandle<(usize, Vec<String>)>> {
    use crate::servers::Conn;
    let to: std::net::SocketAddr = sock(WEB_VIP).into();
    let stop = stop.clone();
    // Threads made in the client's namespace are in it too.
    lab.client.ns.run(move || {
        (0..clients)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let (mut opened, mut failed) = (0usize, Vec::new());
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        opened += 1;
                        let asked = Conn::here(to).and_then(|c| c.patient(patience)).and_then(|mut c| {
                            let first = c.ask()?;
                            std::thread::sleep(std::time::Duration::from_millis(30));
                            Ok((first, c.ask()?))
                        });
                        match asked {
                            Ok((first, second)) if first.backend == second.backend => {}
                            Ok((first, second)) => failed.push(format!("moved from {first:?} to {second:?}")),
                            Err(e) => failed.push(e.to_string()),
                        }
                    }
                    (opened, failed)
                })
            })
            .collect()
    })
}

/// `keep_opening`'s threads joined: (connections opened, those that failed), all threads.
fn joined(clients: Vec<std::thread::JoinHandle<(usize, Vec<String>)>>) -> (usize, Vec<String>) {
    clients.into_iter().map(|c| c.join().expect("a client thread")).fold((0, Vec::new()), |(n, mut all), (o, f)| {
        all.extend(f);
        (n + o, all)
    })
}

/// Connections opened while the eBPF mode's first write runs survive the takeover too. The
/// adoption reads the conntrack table as the first frontend is written; a connection that
/// kube-proxy's rules translate after that read, and before its own frontend's master, has no
/// entry of ours when its next segment comes. Here 4,000 other Services come first in the
/// write's order (by name), so the web Service's master comes a while after the read, and
/// clients keep opening connections to it through kube-proxy's DNAT rules (random among the
/// three backends) from before the agent starts until after its first write: each connects,
/// asks, waits 30 ms, asks again. Every second answer must come from the first's backend: the
/// datapath holds back (drops) a segment under way that no entry tracks while the adoption may
/// still take its connection, the adoption's next read (the one as the first sync ends)
/// adopts it, and TCP's retransmission reaches the backend it had. Balanced afresh instead, 2
/// in 3 of those connections were reset. The log's `adopted_late` must show some: without
/// them, this run tested nothing.
pub fn takeover_adopts_connections_opened_during_the_first_write(agent: &Path) {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };

    const OTHERS: usize = 4000;
    const CLIENTS: usize = 8;
    let mut lab = Lab::new(agent, 3);
    let mut objects = crate::lab::standard_objects(&lab.backend_ips());
    for i in 0..OTHERS {
        let name = format!("filler-{i:05}");
        let vip = format!("10.96.{}.{}", 100 + i / 250, 1 + i % 250);
        objects.push(crate::lab::service(&name, &vip, &[("http", 80, "TCP", crate::lab::TCP_PORT)]));
        objects.push(crate::lab::endpoint_slice(
            &name,
            &format!("{name}-1"),
            &lab.backend_ips()[..1],
            &[("http", crate::lab::TCP_PORT, "TCP")],
        ));
    }
    lab.write_manifest("services.yaml", &objects.join("---\n"));
    let node = lab.node.name.clone();
    let nat = |args: &[&str]| in_netns(&node, &[&["iptables-nft", "-t", "nat"], args].concat());
    kube_proxy_web_rules(&nat, &lab.backend_ips());
    let stop = Arc::new(AtomicBool::new(false));
    let clients = keep_opening(&lab, CLIENTS, crate::servers::TIMEOUT, &stop);
    std::thread::sleep(std::time::Duration::from_millis(300));
    start(&mut lab, ProxyMode::Ebpf, &[]);
    lab.wait_log("first whole write done: what kube-proxy or another mode left is removed", 1);
    std::thread::sleep(std::time::Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let (opened, failed) = joined(clients);
    let nat_rules = nat(&["-S"]);
    assert!(!nat_rules.contains("KUBE-SERVICES"), "kube-proxy's rules are gone:\n{nat_rules}");
    assert!(failed.is_empty(), "{} of {opened} connections failed: {failed:?}\n{}", failed.len(), lab.log_tail());
    lab.wait_log("adopted the connections netfilter translated", 1);
    let log = lab.agent_log();
    let late: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("adopted the connections netfilter translated"))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("adopted_late=")?.parse().ok()))
        .collect();
    assert!(
        matches!(late.as_slice(), [n] if *n > 0),
        "connections were opened between the adoption's read and the web Service's master, and adopted late (one IPv4 \
         adoption; {opened} opened): {late:?}\n{}",
        lab.log_tail()
    );
    // The hold is let go as the adoption ends (not left to lapse: a segment under way of a
    // connection no read found is balanced afresh at once, as without a takeover).
    let pin = lab.bpffs().join("maps").join(proxy_common::map_names::ADOPTING);
    let map = aya::maps::MapData::from_pin(&pin).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
    let adopting: aya::maps::Array<_, u64> = aya::maps::Array::try_from(aya::maps::Map::Array(map)).expect("an array");
    assert_eq!(adopting.get(&proxy_common::ct::ADOPTING_V4, 0).ok(), Some(0), "IPv4's hold after the adoption's end");
}

/// A connection whose SYN kube-proxy's rules translated before the takeover, and whose backend
/// answered after the first sync's last read, survives it too. A read of the conntrack table
/// finds only answered connections, so no read during the first sync finds such a handshake;
/// the adoption's trailing read (a second or more after the first sync, the hold on until then)
/// does. Each backend's SYN-ACKs are held back 600 ms here (`SynAckDelay`: this kernel has no
/// netem; less than the second after which a client sends its SYN again), and clients keep
/// opening connections to the web Service through kube-proxy's DNAT rules (random among the
/// three backends) from before the agent starts until after the trailing read: each connects,
/// asks, waits 30 ms, asks again, with 20 s for each answer (a request held back until the
/// trailing read comes by TCP's retransmission, seconds later). Most of the time each client is
/// in a handshake, so the ones under way as the web Service's master is written are answered
/// after the first sync. Every second answer must come from the first's backend; the log's
/// `adopted_at_trailing_read` must show some, else this run tested nothing. Without the
/// trailing read, those connections' requests were balanced afresh once the hold ended, and
/// reset.
pub fn takeover_adopts_connections_answered_after_the_first_sync(agent: &Path) {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };

    use crate::synack_delay::SynAckDelay;
    const CLIENTS: usize = 8;
    const SYN_ACK_DELAY: std::time::Duration = std::time::Duration::from_millis(600);
    const PATIENCE: std::time::Duration = std::time::Duration::from_secs(20);
    let mut lab = Lab::new(agent, 3);
    lab.write_manifest("services.yaml", &standard_manifests(&lab.backend_ips()));
    let node = lab.node.name.clone();
    let nat = |args: &[&str]| in_netns(&node, &[&["iptables-nft", "-t", "nat"], args].concat());
    kube_proxy_web_rules(&nat, &lab.backend_ips());
    let delays: Vec<SynAckDelay> = lab
        .backends
        .iter()
        .map(|b| SynAckDelay::start(&b.ns, 7, SYN_ACK_DELAY).unwrap_or_else(|e| panic!("a delay line in {}: {e}", b.ns.name)))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let clients = keep_opening(&lab, CLIENTS, PATIENCE, &stop);
    std::thread::sleep(std::time::Duration::from_millis(1000));
    start(&mut lab, ProxyMode::Ebpf, &[]);
    lab.wait_log("first whole write done: what kube-proxy or another mode left is removed", 1);
    lab.wait_log("adopted the connections netfilter translated", 1);
    std::thread::sleep(std::time::Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let (opened, failed) = joined(clients);
    let held: Vec<usize> = delays.into_iter().map(|d| d.stop().expect("a delay line")).collect();
    assert!(held.iter().all(|n| *n > 0), "each backend's SYN-ACKs were held back: {held:?}");
    let nat_rules = nat(&["-S"]);
    assert!(!nat_rules.contains("KUBE-SERVICES"), "kube-proxy's rules are gone:\n{nat_rules}");
    assert!(failed.is_empty(), "{} of {opened} connections failed: {failed:?}\n{}", failed.len(), lab.log_tail());
    let log = lab.agent_log();
    let trailing: Vec<u64> = log
        .lines()
        .filter(|l| l.contains("adopted the connections netfilter translated"))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("adopted_at_trailing_read=")?.parse().ok()))
        .collect();
    assert!(
        matches!(trailing.as_slice(), [n] if *n > 0),
        "handshakes kube-proxy's rules translated were answered after the first sync, and the trailing read adopted them (one \
         IPv4 adoption; {opened} opened): {trailing:?}\n{}",
        lab.log_tail()
    );
}

/// Whether an eBPF-mode agent's log shows the first removal of what kube-proxy or another mode
/// left after its initial sync.
pub fn removed_after_the_first_write(log: &str) -> bool {
    matches!((log.find("initial sync done"), log.find("removed what ")), (Some(w), Some(r)) if w < r)
}

/// localhost NodePorts: iptables mode serves `127.0.0.1:<nodePort>` by default, as kube-proxy
/// does (route_localnet, with KUBE-FIREWALL's guard against martian localnet packets), and not
/// when `--iptables-localhost-nodeports=false`; nftables mode never does, as kube-proxy's.
pub fn localhost_node_ports(agent: &Path, mode: ProxyMode, enabled: bool) {
    let mut lab = Lab::new(agent, 3);
    let mut objects = crate::lab::standard_objects(&lab.backend_ips());
    objects.push(crate::cluster::service(
        "web-np",
        "  type: NodePort\n  clusterIP: 10.96.0.11\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n",
        None,
    ));
    objects.push(crate::lab::endpoint_slice("web-np", "web-np-1", &lab.backend_ips(), &[("http", crate::lab::TCP_PORT, "TCP")]));
    lab.write_manifest("services.yaml", &objects.join("---\n"));
    let flag = format!("--iptables-localhost-nodeports={enabled}");
    start(&mut lab, mode, &[&flag]);
    eventually("the NodePort on the node's address", || tcp_ask(&lab.client.ns, sock("192.168.250.1:30080")).map_err(|e| e.to_string()));
    let served = matches!(mode, ProxyMode::Iptables | ProxyMode::Ebpf) && enabled;
    let node = lab.node.name.clone();
    let localnet = lab.node.run(|| std::fs::read_to_string("/proc/sys/net/ipv4/conf/all/route_localnet").unwrap_or_default());
    if served {
        if mode == ProxyMode::Iptables {
            assert_eq!(localnet.trim(), "1", "route_localnet is set for localhost NodePorts");
            let filter = crate::netns::sh(&["ip", "netns", "exec", &node, "iptables-save", "-t", "filter"]);
            assert!(filter.contains("block incoming localnet connections"), "the CVE-2020-8558 guard is in place:\n{filter}");
        } else {
            assert_eq!(localnet.trim(), "0", "{mode}: the socket hooks need no route_localnet");
        }
        let out = eventually("127.0.0.1:30080 to answer", || {
            let out = lab.host_ask("tcp", "127.0.0.1:30080");
            if out.starts_with("ok ") {
                Ok(out)
            } else {
                Err(out)
            }
        });
        assert!(out.starts_with("ok backend-"), "{mode}: {out}");
        if mode == ProxyMode::Iptables {
            // kube-proxy's counters (nfacct), as its metrics.
            let nat = crate::netns::sh(&["ip", "netns", "exec", &node, "iptables-save", "-t", "nat"]);
            assert!(nat.contains("-m nfacct") && nat.contains("localhost_nps_accepted_pkts"), "{nat}");
            let (_, metrics) = crate::servers::http_get(&lab.node, sock("127.0.0.1:10249"), "/metrics").expect("/metrics");
            let value =
                |name: &str| metrics.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).and_then(|v| v.trim().parse::<f64>().ok());
            assert!(value("kubeproxy_iptables_localhost_nodeports_accepted_packets_total").is_some_and(|v| v >= 1.0), "{metrics}");
            assert!(value("kubeproxy_iptables_ct_state_invalid_dropped_packets_total").is_some(), "{metrics}");
        }
    } else {
        let out = lab.host_ask("tcp", "127.0.0.1:30080");
        assert!(out.starts_with("err"), "{mode} (localhost NodePorts {enabled}): 127.0.0.1:30080 is not a NodePort: {out}");
    }
}

pub fn clusterip_tcp_and_udp_reach_every_backend(agent: &Path, mode: ProxyMode) {
    let lab = lab(agent, mode);
    for f in families(&lab) {
        let mut tcp = BTreeMap::<String, usize>::new();
        for _ in 0..90 {
            let a = tcp_ask_any(&lab.client.ns, f.web).unwrap_or_else(|e| panic!("{mode}: TCP through the {} cluster IP: {e}", f.name));
            assert_eq!(a.peer.ip(), f.client, "{mode}: a cluster IP is DNAT only, the backend sees the pod ({})", f.name);
            *tcp.entry(a.backend).or_default() += 1;
        }
        assert_eq!(tcp.len(), 3, "{mode}: 90 {} connections over 3 backends: {tcp:?}", f.name);
        let mut udp = BTreeSet::new();
        for _ in 0..40 {
            let (a, from) =
                udp_ask_any(&lab.client.ns, f.dns).unwrap_or_else(|e| panic!("{mode}: UDP through the {} cluster IP: {e}", f.name));
            assert_eq!(from, f.dns, "{mode}: the reply comes from the service address ({})", f.name);
            udp.insert(a.backend);
        }
        assert!(udp.len() > 1, "{mode}: {} UDP flows spread: {udp:?}", f.name);
    }
}

/// Refused at once, not left to time out. "At once" is the first SYN's answer in IPv4; in
/// IPv6 it is the first SYN retransmission's, about a second later, in the iptables mode
/// (kube-proxy's REJECT) as in eBPF: here the answer to the first SYN reaches the client while
/// its connect() still holds the socket, and the kernel drops it (`TcpExtLockDroppedIcmps`
/// counts it, in both families), which IPv4's connect survives and IPv6's does not. Counted
/// in SYNs sent again (the client's `TCPSynRetrans`), not in seconds.
pub fn a_service_without_endpoints_refuses(agent: &Path, mode: ProxyMode) {
    let lab = lab(agent, mode);
    for f in families(&lab) {
        let resent = lab.client.ns.tcp_ext("TCPSynRetrans");
        let err = tcp_ask_any(&lab.client.ns, f.empty).expect_err("no endpoints");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{mode} ({}): {err}", f.name);
        let resent = lab.client.ns.tcp_ext("TCPSynRetrans") - resent;
        assert!(resent <= syn_resends(f.web.ip()), "{mode} ({}): refused at the first SYN, not after {resent} more", f.name);
    }
}

/// Services with the longest names Kubernetes allows (a 63-character namespace and name, a
/// 15-character port name): `namespace/name:port` is 143 characters, past the 128 nft allows in a
/// comment (kube-proxy's nftables mode once failed every sync on one, kubernetes#139515). One
/// with endpoints is served, one without refuses, and the lab's standard Services are served
/// beside them (the lab's start waits for its web Service in both families).
pub fn services_with_the_longest_names_are_served(agent: &Path, mode: ProxyMode) {
    let namespace = format!("ns-{}", "n".repeat(60));
    let (served, refused) = (format!("served-{}", "s".repeat(56)), format!("refused-{}", "r".repeat(55)));
    let port = "http-port-name1";
    assert_eq!((namespace.len(), served.len(), refused.len(), port.len()), (63, 63, 63, 15));
    let tcp = crate::lab::TCP_PORT;
    let service = |name: &str, n: u8| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec:\n  clusterIP: 10.96.0.{n}\n  ports:\n  - {{name: {port}, port: 80, targetPort: {tcp}, protocol: TCP}}\n"
        )
    };
    // Named as the EndpointSlice controller names them: the Service's name cut short, then a
    // suffix (a subdomain's labels take 63 characters at most).
    let slice = |svc: &str, endpoints: &[Ipv4Addr]| {
        crate::lab::endpoint_slice_in(&namespace, svc, &format!("{}-x1", &svc[..20]), endpoints, &[(port, tcp, "TCP")])
    };
    let lab = lab_with_objects(agent, mode, 3, |lab| {
        let objects = [service(&served, 71), slice(&served, &lab.backend_ips()), service(&refused, 72), slice(&refused, &[])];
        Some(("long-names.yaml".into(), objects.join("---\n")))
    });
    let answer =
        eventually("the long-named Service to be served", || tcp_ask(&lab.client.ns, sock("10.96.0.71:80")).map_err(|e| e.to_string()));
    assert!(answer.backend.starts_with("backend-"), "{mode}: {answer:?}");
    let err = tcp_ask(&lab.client.ns, sock("10.96.0.72:80")).expect_err("no endpoints");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{mode}: {err}");
}

/// An external IP that is another Service's cluster IP does not take that Service's traffic:
/// two `thief` Services, `aaa/` and `zzz/` (first and last in name order: a start programs in
/// that order, iptables and nftables write rules in it, IPVS keeps the last), list web's
/// cluster IPs (both families) among their external IPs, over a fourth backend web does not
/// have. The lab's start requires web to reach its three backends and no other, in both
/// families (a share of its traffic taken would show backend-4), and each thief is served at
/// its own cluster IPs.
pub fn an_external_ip_does_not_take_another_services_cluster_ip(agent: &Path, mode: ProxyMode) {
    let tcp = crate::lab::TCP_PORT;
    let thieves = [("aaa", 98), ("zzz", 97)];
    let lab = lab_with_objects(agent, mode, 4, |lab| {
        let objects: Vec<String> = thieves
            .iter()
            .flat_map(|(ns, n)| {
                let service = format!(
                    "apiVersion: v1\nkind: Service\nmetadata: {{name: thief, namespace: {ns}}}\nspec:\n  clusterIP: 10.96.0.{n}\n  clusterIPs: [10.96.0.{n}, 'fd00:96::{n}']\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  externalIPs: [10.96.0.10, 'fd00:96::10']\n  ports:\n  - {{name: http, port: 80, targetPort: {tcp}, protocol: TCP}}\n"
                );
                let slice = crate::lab::endpoint_slice_in(ns, "thief", "thief-1", &lab.backend_ips()[3..], &[("http", tcp, "TCP")]);
                [service, slice, slice6(ns, "thief", "{name: http, port: 8082, protocol: TCP}", &[4])]
            })
            .collect();
        Some(("thieves.yaml".into(), objects.join("---\n")))
    });
    for f in families(&lab) {
        for _ in 0..60 {
            let a = tcp_ask_any(&lab.client.ns, f.web).unwrap_or_else(|e| panic!("{mode}: TCP through the {} cluster IP: {e}", f.name));
            assert_ne!(a.backend, "backend-4", "{mode}: web's {} cluster IP answered by a thief's backend", f.name);
        }
    }
    for (ns, n) in thieves {
        for to in [format!("10.96.0.{n}:80"), format!("[fd00:96::{n}]:80")] {
            let to: SocketAddr = to.parse().unwrap();
            let answer = eventually(&format!("{ns}/thief at its own cluster IP {to}"), || {
                tcp_ask_any(&lab.client.ns, to).map_err(|e| e.to_string())
            });
            assert_eq!(answer.backend, "backend-4", "{mode}: {to}");
        }
    }
    let log = lab.agent_log();
    for (ns, _) in thieves {
        for web in ["10.96.0.10", "fd00:96::10"] {
            let refusal = format!("refused: external address {web} is Service default/web's cluster IP");
            let object = format!("Service {ns}/thief");
            assert!(
                log.lines().any(|l| l.contains(&refusal) && l.contains(&object)),
                "{mode}: {ns}/thief's refusal of {web} is logged:\n{log}"
            );
        }
    }
}

pub fn endpoint_changes_are_followed(agent: &Path, mode: ProxyMode) {
    let lab = lab(agent, mode);
    let [v4, v6] = families(&lab);
    // A resolver's UDP flow that backend-3 answers, in each family: it must move when
    // backend-3 goes, though its packets keep coming (conntrack would keep it there: the
    // classic stale DNS entry).
    let pinned = |f: &InFamily| {
        (0..100)
            .find_map(|_| {
                let flow = UdpFlow::open(&lab.client.ns, f.dns).ok()?;
                (flow.ask().ok()?.backend == "backend-3").then_some(flow)
            })
            .unwrap_or_else(|| panic!("{mode}: no {} UDP flow got backend-3 in 100 tries", f.name))
    };
    let pinned = [pinned(&v4), pinned(&v6)];
    lab.write_manifest("services.yaml", &dual_stack_manifests(&lab, &[1, 2], &[1, 2]));
    for (f, flow) in [&v4, &v6].into_iter().zip(&pinned) {
        eventually(&format!("backend-3 to get no new {} connections", f.name), || {
            let seen: BTreeSet<String> = (0..30).filter_map(|_| tcp_ask_any(&lab.client.ns, f.web).ok()).map(|a| a.backend).collect();
            if seen.contains("backend-3") || seen.len() != 2 {
                Err(format!("{seen:?}"))
            } else {
                Ok(())
            }
        });
        eventually(&format!("{} UDP to leave backend-3 too", f.name), || {
            let seen: BTreeSet<String> = (0..30).filter_map(|_| udp_ask_any(&lab.client.ns, f.dns).ok()).map(|(a, _)| a.backend).collect();
            if seen.contains("backend-3") {
                Err(format!("{seen:?}"))
            } else {
                Ok(())
            }
        });
        eventually(&format!("the {} UDP flow that backend-3 answered to move to another backend", f.name), || match flow.ask() {
            Ok(a) if a.backend != "backend-3" => Ok(()),
            other => Err(format!("{other:?}")),
        });
    }
    lab.write_manifest("services.yaml", &dual_stack_manifests(&lab, &[1, 2, 3], &[1, 2, 3]));
    for f in [&v4, &v6] {
        eventually(&format!("backend-3 to be back in {}", f.name), || {
            let seen: BTreeSet<String> = (0..30).filter_map(|_| tcp_ask_any(&lab.client.ns, f.web).ok()).map(|a| a.backend).collect();
            if seen.contains("backend-3") {
                Ok(())
            } else {
                Err(format!("{seen:?}"))
            }
        });
    }
}

/// A client that tried a Service address before anything served it (a Service just created,
/// or an agent just started) gets through once it is served, from the same source port: its
/// retransmitted SYN (or a later connection that reuses the port, or a resolver's UDP socket)
/// has the tuple of the first attempt, which left by the node's default route untranslated and
/// which conntrack still holds (120 s for an unanswered SYN, renewed by every retransmission).
/// kube-proxy's rules then refuse it (nftables: traffic to a ClusterIP port nothing serves) or
/// send it to nowhere (iptables); the agent deletes such attempts once the address is served.
/// The eBPF dataplane translates before conntrack and is held to the same. (IPv4: the lab's
/// port-bound sockets are IPv4 ones; the sweep reads both families alike.)
pub fn a_connection_tried_before_its_service_existed_gets_through(agent: &Path, mode: ProxyMode) {
    let lab = lab(agent, mode);
    let (tcp, udp) = (crate::lab::TCP_PORT, crate::lab::UDP_PORT);
    let late = Ipv4Addr::new(10, 96, 0, 77);
    let (web, dns) = (std::net::SocketAddrV4::new(late, 80), std::net::SocketAddrV4::new(late, 53));
    // A source port of the client's own, outside the ephemeral range its other connections use.
    const PORT: u16 = 20077;
    // Unanswered, not refused: its SYN left by the default route (a refused SYN would leave no
    // entry, and nothing to test). It times out, or the node's failed neighbour lookup of the
    // gateway (3 s) answers it with host unreachable first.
    let early = crate::servers::Conn::open_from_port(&lab.client.ns, PORT, web).map(|_| ());
    let err = early.expect_err(&format!("{mode}: nothing serves {web} yet, but a connection went through"));
    assert!(
        matches!(err.raw_os_error(), Some(libc::EINPROGRESS | libc::EHOSTUNREACH)),
        "{mode}: the first attempt should go unanswered, not fail with {err}"
    );
    let resolver = UdpFlow::open_from_port(&lab.client.ns, PORT, dns).expect("a UDP socket");
    assert!(resolver.ask().is_err(), "{mode}: nothing serves {dns} yet, but it answered");
    if mode != ProxyMode::Ebpf {
        // The entry that would keep the retransmissions untranslated. (The eBPF dataplane's
        // lab loads no netfilter rules, and the kernel tracks nothing there.)
        let held = in_netns(&lab.node.name, &["conntrack", "-L", "-p", "tcp", "--orig-port-src", &PORT.to_string()]);
        assert!(
            held.lines().any(|l| l.contains("SYN_SENT") && l.contains(&format!("dst={late} ")) && l.contains("[UNREPLIED]")),
            "{mode}: no untranslated attempt in conntrack:\n{held}"
        );
    }
    let backends = lab.backend_ips();
    lab.write_manifest(
        "late.yaml",
        &[
            crate::lab::service("late", &late.to_string(), &[("http", 80, "TCP", tcp), ("dns", 53, "UDP", udp)]),
            crate::lab::endpoint_slice("late", "late-1", &backends, &[("http", tcp, "TCP"), ("dns", udp, "UDP")]),
        ]
        .join("---\n"),
    );
    eventually(&format!("{web} to be served"), || tcp_ask(&lab.client.ns, web).map_err(|e| e.to_string()));
    eventually(&format!("a connection to {web} from the port tried before it was served"), || {
        crate::servers::Conn::open_from_port(&lab.client.ns, PORT, web).and_then(|mut c| c.ask()).map_err(|e| e.to_string())
    });
    eventually(&format!("the resolver that asked {dns} before it was served to be answered"), || resolver.ask().map_err(|e| e.to_string()));
}

pub fn a_pod_reaching_its_own_service_gets_through(agent: &Path, mode: ProxyMode) {
    let lab = lab(agent, mode);
    let me = &lab.backends[0];
    for f in families(&lab) {
        let mut own = None;
        for i in 0..80 {
            let a = tcp_ask_any(&me.ns, f.web)
                .unwrap_or_else(|e| panic!("{mode}: {} request {i} from {} to its own Service: {e}", f.name, me.name));
            if a.backend == me.name {
                own = Some(a);
            }
        }
        let own = own.unwrap_or_else(|| panic!("{mode}: 80 {} requests never picked the caller itself", f.name));
        assert_eq!(own.peer.is_ipv4(), f.web.is_ipv4(), "{mode}: an {} connection", f.name);
        assert_ne!(own.peer.ip(), f.backends[0], "{mode}: hairpinned {} traffic is masqueraded, the pod does not see itself", f.name);
    }
}

fn web(spec_extra: &str) -> String {
    cluster::service(
        "web",
        &format!(
            "  type: NodePort\n  clusterIP: 10.96.0.10\n  ports:\n  - {{name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}}\n  - {{name: dns, port: 53, targetPort: 5353, nodePort: 30053, protocol: UDP}}\n{spec_extra}"
        ),
        None,
    )
}

/// One family of the two-node lab (`Cluster::add_ipv6`): the addresses a scenario reaches and
/// sees.
struct NorthFamily {
    name: &'static str,
    node_a: IpAddr,
    node_b: IpAddr,
    client: IpAddr,
    cluster_ip: IpAddr,
    /// The load-balancer IP, one with ipMode Proxy, and the external IP, of the scenarios'
    /// Services.
    lb: IpAddr,
    lb_proxy: IpAddr,
    external: IpAddr,
}

fn north_families() -> [NorthFamily; 2] {
    let a = |s: &str| s.parse::<IpAddr>().unwrap();
    [
        NorthFamily {
            name: "IPv4",
            node_a: a("192.168.100.1"),
            node_b: a("192.168.100.2"),
            client: a(CLIENT_IP),
            cluster_ip: a("10.96.0.10"),
            lb: a("203.0.113.10"),
            lb_proxy: a("203.0.113.11"),
            external: a("192.0.2.7"),
        },
        NorthFamily {
            name: "IPv6",
            node_a: a("fd00:100::1"),
            node_b: a("fd00:100::2"),
            client: a(cluster::CLIENT_IP6),
            cluster_ip: a("fd00:96::10"),
            lb: a("2001:db8:203::10"),
            lb_proxy: a("2001:db8:203::11"),
            external: a("2001:db8:192::7"),
        },
    ]
}

fn at(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

/// The web Service `svc` made dual-stack: an IPv6 cluster IP beside 10.96.0.10, and IPv6
/// load-balancer and external IPs beside the IPv4 ones it names (`NorthFamily`).
fn dual_stack_web(svc: &str) -> String {
    svc.replace(
        "  clusterIP: 10.96.0.10\n",
        "  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, 'fd00:96::10']\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n",
    )
    .replace("    - {ip: 203.0.113.10}\n", "    - {ip: 203.0.113.10}\n    - {ip: '2001:db8:203::10'}\n")
    .replace("    - {ip: 203.0.113.11, ipMode: Proxy}\n", "    - {ip: 203.0.113.11, ipMode: Proxy}\n    - {ip: '2001:db8:203::11', ipMode: Proxy}\n")
    .replace("  externalIPs: [192.0.2.7]\n", "  externalIPs: [192.0.2.7, '2001:db8:192::7']\n")
}

/// The two-node lab, dual-stack, running `mode` on both nodes, `web` programmed in both
/// families (`dual_stack_web`): its IPv6 EndpointSlice names the same pods as `eps`, by their
/// IPv6 addresses.
fn cluster_with(agent: &Path, mode: ProxyMode, pods: [&[&str]; 2], svc: &str, eps: &[(Ipv4Addr, &str)], extra: &[&str]) -> Cluster {
    let mut c = Cluster::new(agent, pods);
    c.add_ipv6();
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &dual_stack_web(svc));
    c.write_manifest("web-eps.yaml", &slice("web", eps));
    let eps6: Vec<(std::net::Ipv6Addr, &str)> =
        eps.iter().map(|(ip, node)| (cluster::pod_ipv6(u16::from(ip.octets()[2]), usize::from(ip.octets()[3] - 11)), *node)).collect();
    c.write_manifest("web-eps6.yaml", &cluster::slice6("web", &eps6));
    let mut args = vec!["--proxy-mode", mode.as_str(), "--cluster-cidr", "10.244.0.0/16,fd00:244::/48"];
    args.extend(extra);
    c.start_agents(&args);
    c
}

fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

fn answers(c: &Cluster, to: SocketAddr, udp: bool, n: usize) -> Vec<Answer> {
    (0..n).filter_map(|_| if udp { udp_ask_any(&c.client, to).ok().map(|(a, _)| a) } else { tcp_ask_any(&c.client, to).ok() }).collect()
}

fn by_backend(a: &[Answer]) -> BTreeMap<String, BTreeSet<IpAddr>> {
    let mut m: BTreeMap<String, BTreeSet<IpAddr>> = BTreeMap::new();
    for x in a {
        m.entry(x.backend.clone()).or_default().insert(x.peer.ip());
    }
    m
}

pub fn node_port_from_outside(agent: &Path, mode: ProxyMode) {
    let eps = [(ip("10.244.1.11"), "node-a"), (ip("10.244.2.11"), "node-b"), (ip("10.244.2.12"), "node-b")];
    let c = cluster_with(agent, mode, [&["a1"], &["b1", "b2"]], &web(""), &eps, &[]);
    for f in north_families() {
        for (to, udp) in [(at(f.node_a, 30080), false), (at(f.node_a, 30053), true), (at(f.node_b, 30080), false)] {
            let seen = eventually(&format!("{to} to reach all three backends"), || {
                let m = by_backend(&answers(&c, to, udp, 40));
                if m.len() == 3 {
                    Ok(m)
                } else {
                    Err(format!("{m:?}"))
                }
            });
            let via = to.ip();
            for (backend, peers) in &seen {
                let local = (backend == "a1") == (via == f.node_a);
                // Remote backends see the node that forwarded (SNAT). Local ones: the eBPF
                // dataplane only DNATs (the client's address is kept, as the issue asks);
                // kube-proxy's modes masquerade all externally-sourced traffic under
                // externalTrafficPolicy Cluster, local endpoints included.
                let want = if local && mode == ProxyMode::Ebpf { f.client } else { via };
                if local && mode != ProxyMode::Ebpf {
                    println!("{mode}: as kube-proxy, a local endpoint under externalTrafficPolicy Cluster sees the node address");
                }
                assert_eq!(peers, &BTreeSet::from([want]), "{mode} {to}: {backend} ({})", if local { "local" } else { "remote" });
            }
        }
    }
}

pub fn external_traffic_policy_local(agent: &Path, mode: ProxyMode) {
    let lb = cluster::service(
        "web",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n",
        Some("  loadBalancer:\n    ingress:\n    - {ip: 203.0.113.10}\n"),
    );
    let c = cluster_with(agent, mode, [&["a1"], &["b1"]], &lb, &[(ip("10.244.1.11"), "node-a")], &[]);
    for f in north_families() {
        for to in [at(f.node_a, 30080), at(f.lb, 80)] {
            let m = eventually(&format!("{to} to answer"), || {
                let m = by_backend(&answers(&c, to, false, 5));
                if m.is_empty() {
                    Err("no answer".into())
                } else {
                    Ok(m)
                }
            });
            assert_eq!(m, BTreeMap::from([("a1".to_string(), BTreeSet::from([f.client]))]), "{mode} {to}: the client address is kept");
        }
    }
    let (code, headers, _) = eventually("the health check on node A", || {
        http_get_with_headers(&c.client, sock("192.168.100.1:32000"), "/").map_err(|e| e.to_string())
    });
    assert_eq!((code, headers.get("x-load-balancing-endpoint-weight").map(String::as_str)), (200, Some("1")), "{mode}");
    // Node B's health check answers once its agent has synced the Service: only then is
    // what node B does with the NodePort its answer (before, nothing listens and the kernel
    // refuses).
    let (code, _, _) = eventually("the health check on node B", || {
        http_get_with_headers(&c.client, sock("192.168.100.2:32000"), "/").map_err(|e| e.to_string())
    });
    assert_eq!(code, 503, "{mode}");
    for f in north_families() {
        let err = tcp_ask_any(&c.client, at(f.node_b, 30080)).expect_err("node B has no local endpoint");
        assert!(
            matches!(err.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock),
            "{mode} ({}): dropped, not refused: {err}",
            f.name
        );
    }
}

pub fn internal_traffic_policy_local(agent: &Path, mode: ProxyMode) {
    let eps = [(ip("10.244.1.11"), "node-a"), (ip("10.244.2.11"), "node-b")];
    let c = cluster_with(agent, mode, [&["a1"], &["b1"]], &web("  internalTrafficPolicy: Local\n"), &eps, &[]);
    for f in north_families() {
        for (node, want) in [("node-a", "a1"), ("node-b", "b1")] {
            let pod = &c.node(node).client_pod.ns;
            let to = at(f.cluster_ip, 80);
            let seen = eventually(&format!("pods on {node} to reach {want} ({})", f.name), || {
                let s: BTreeSet<String> = (0..10).filter_map(|_| tcp_ask_any(pod, to).ok()).map(|a| a.backend).collect();
                if s.is_empty() {
                    Err("no answer".into())
                } else {
                    Ok(s)
                }
            });
            assert_eq!(seen, BTreeSet::from([want.to_string()]), "{mode} ({}): pods on {node}", f.name);
        }
    }
}

pub fn load_balancer_and_external_ips(agent: &Path, mode: ProxyMode) {
    let lb = cluster::service(
        "web",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalIPs: [192.0.2.7]\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n  - {name: dns, port: 53, targetPort: 5353, nodePort: 30053, protocol: UDP}\n",
        Some("  loadBalancer:\n    ingress:\n    - {ip: 203.0.113.10}\n    - {ip: 203.0.113.11, ipMode: Proxy}\n"),
    );
    let c = cluster_with(agent, mode, [&["a1"], &["b1"]], &lb, &[(ip("10.244.1.11"), "node-a"), (ip("10.244.2.11"), "node-b")], &[]);
    for f in north_families() {
        for (to, udp) in [(at(f.lb, 80), false), (at(f.lb, 53), true), (at(f.external, 80), false), (at(f.external, 53), true)] {
            eventually(&format!("{to} to reach both backends"), || {
                let m = by_backend(&answers(&c, to, udp, 30));
                if m.len() == 2 {
                    Ok(())
                } else {
                    Err(format!("{m:?}"))
                }
            });
        }
        assert!(tcp_ask_any(&c.client, at(f.lb_proxy, 80)).is_err(), "{mode} ({}): ipMode Proxy is the load balancer's to serve", f.name);
    }
}

pub fn client_ip_affinity(agent: &Path, mode: ProxyMode) {
    let eps = [(ip("10.244.1.11"), "node-a"), (ip("10.244.2.11"), "node-b"), (ip("10.244.2.12"), "node-b")];
    let svc = web("  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}\n");
    let c = cluster_with(agent, mode, [&["a1"], &["b1", "b2"]], &svc, &eps, &[]);
    let pod = &c.node("node-a").client_pod.ns;
    for f in north_families() {
        let cluster_ip = at(f.cluster_ip, 80);
        eventually("the cluster IP to answer", || tcp_ask_any(pod, cluster_ip).map_err(|e| e.to_string()));
        let seen: BTreeSet<String> = (0..20).map(|_| tcp_ask_any(pod, cluster_ip).unwrap().backend).collect();
        assert_eq!(seen.len(), 1, "{mode} ({}): cluster IP: one client, one backend: {seen:?}", f.name);
        let node_port = at(f.node_a, 30080);
        eventually("the NodePort to answer", || tcp_ask_any(&c.client, node_port).map_err(|e| e.to_string()));
        let seen: BTreeSet<String> = (0..20).map(|_| tcp_ask_any(&c.client, node_port).unwrap().backend).collect();
        assert_eq!(seen.len(), 1, "{mode} ({}): NodePort: one client, one backend: {seen:?}", f.name);
    }
    // The timeout changed to a second: an affinity now lasts that long after its client's last
    // packet, so connections a second and a half apart go to any backend (the nftables mode once
    // kept the old timeout: its affinity sets were added only where missing). IPVS keeps a
    // client's persistence while its earlier connections linger in IPVS's own table (TIME_WAIT,
    // two minutes), under kube-proxy as well: not checked there.
    if mode == ProxyMode::Ipvs {
        println!(
            "NOT APPLICABLE client_ip_affinity's timeout change in ipvs mode: persistence outlives the timeout while connections linger"
        );
        return;
    }
    if mode == ProxyMode::Nftables && !nft_updates_set_timeouts() {
        println!("NOT APPLICABLE client_ip_affinity's timeout change in nftables mode: this kernel keeps a set's timeout when it is added again (nf_tables takes the new one since mid-2023), as it does under kube-proxy");
        return;
    }
    let svc = web("  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 1}}\n");
    c.write_manifest("web.yaml", &dual_stack_web(&svc));
    for f in north_families() {
        let cluster_ip = at(f.cluster_ip, 80);
        eventually(&format!("{mode} ({}): affinity to end a second after the last packet", f.name), || {
            let mut seen = BTreeSet::new();
            for _ in 0..8 {
                std::thread::sleep(Duration::from_millis(1500));
                seen.insert(tcp_ask_any(pod, cluster_ip).map_err(|e| e.to_string())?.backend);
                if seen.len() > 1 {
                    return Ok(());
                }
            }
            Err(format!("one backend for 8 connections 1.5 s apart: {seen:?}"))
        });
    }
}

/// Whether this kernel takes a new timeout for a set that is added again (`add set` of an
/// existing set with another timeout), tried in a namespace of its own.
fn nft_updates_set_timeouts() -> bool {
    let ns = crate::netns::Netns::create(format!("pxset-{}", crate::netns::unique_id()));
    // (A kernel that refuses the second `add set` does not take the new timeout either.)
    let nft = |cmd: &str| {
        let out = std::process::Command::new("ip").args(["netns", "exec", &ns.name, "nft", cmd]).output().expect("run nft");
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    nft("add table ip probe").expect("nft: add table");
    nft("add set ip probe s { type ipv4_addr ; flags dynamic,timeout ; timeout 10s ; }").expect("nft: add set");
    nft("add set ip probe s { type ipv4_addr ; flags dynamic,timeout ; timeout 20s ; }").is_some()
        && nft("list set ip probe s").is_some_and(|s| s.contains("timeout 20s"))
}

pub fn a_node_port_without_endpoints_refuses(agent: &Path, mode: ProxyMode) {
    let c = cluster_with(agent, mode, [&[], &[]], &web(""), &[], &[]);
    for f in north_families() {
        let to = at(f.node_a, 30080);
        eventually(&format!("{mode} ({}): {to} to refuse", f.name), || match tcp_ask_any(&c.client, to) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(()),
            other => Err(format!("{other:?}")),
        });
        // Once programmed, at once.
        let resent = c.client.tcp_ext("TCPSynRetrans");
        let err = tcp_ask_any(&c.client, to).expect_err("no endpoints");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{mode} ({}): {err}", f.name);
        let resent = c.client.tcp_ext("TCPSynRetrans") - resent;
        assert!(resent <= syn_resends(to.ip()), "{mode} ({}): refused at the first SYN, not after {resent} more", f.name);
        let udp = udp_ask_connected(&c.client, at(f.node_a, 30053)).expect_err("no endpoints");
        assert_eq!(udp.kind(), io::ErrorKind::ConnectionRefused, "{mode} ({}): {udp}", f.name);
    }
}

pub fn xdp_forwards_north_south(agent: &Path, mode: ProxyMode) {
    if not_applicable(mode, "xdp", "xdp_forwards_north_south") {
        return;
    }
    let eps = [(ip("10.244.2.11"), "node-b")];
    let mut c = cluster_with(agent, mode, [&[], &["b1"]], &web(""), &eps, &[]);
    let families = north_families();
    // Every family's NodePort, TCP and UDP.
    // Every UDP request is answered: a frame sent where it vanishes would lose one.
    let udp_all = |c: &Cluster, f: &NorthFamily| {
        let to = at(f.node_a, 30053);
        eventually(&format!("{to} to answer"), || udp_ask_any(&c.client, to).map_err(|e| e.to_string()));
        let got = answers(c, to, true, 10);
        assert_eq!(got.len(), 10, "{mode} ({}): UDP NodePort requests answered", f.name);
    };
    let traffic = |c: &Cluster| {
        for f in &families {
            let to = at(f.node_a, 30080);
            eventually(&format!("{to} to answer"), || tcp_ask_any(&c.client, to).map_err(|e| e.to_string()));
            udp_all(c, f);
        }
    };
    let n = |r: &proxy_agent::inspect::Report, k: &str| r.counters.get(k).map_or(0, |c| c.packets);
    // A veth uplink whose far end runs no XDP program (kind nodes, many VMs): the kernel would
    // drop frames native XDP sent out of it, so XDP hands these flows to TC, and nothing is lost.
    traffic(&c);
    let r = c.node("node-a").inspect().unwrap();
    assert!(!r.external_interfaces.is_empty(), "an external interface is attached");
    assert!(r.external_interfaces.values().all(|e| e.xdp && !e.xdp_sends), "{:?}", r.external_interfaces);
    assert!(n(&r, "xdp_forward") == 0 && n(&r, "ext_new_remote") > 0, "TC forwarded: {:?}", r.counters);
    // GRO on the far end makes the kernel report that it takes XDP frames, yet frames sent
    // into it vanish: XDP must go on handing these flows to TC (after a refresh, 5 s).
    c.switch_gro_on();
    std::thread::sleep(std::time::Duration::from_secs(6));
    let r = c.node("node-a").inspect().unwrap();
    assert!(r.external_interfaces.values().all(|e| !e.xdp_sends), "GRO alone is not enough: {:?}", r.external_interfaces);
    traffic(&c);
    let r = c.node("node-a").inspect().unwrap();
    assert_eq!(n(&r, "xdp_forward"), 0, "with GRO alone TC still forwards: {:?}", r.counters);
    // Once the far end takes XDP frames (as a NIC's does), XDP sends the flows itself, in
    // both families (IPv6's after a first packet TC tracks).
    c.switch_takes_xdp_frames();
    eventually("XDP to send frames itself", || {
        let r = c.node("node-a").inspect().map_err(|e| e.to_string())?;
        r.external_interfaces.values().all(|e| e.xdp_sends).then_some(()).ok_or(format!("{:?}", r.external_interfaces))
    });
    for f in &families {
        let before = n(&c.node("node-a").inspect().unwrap(), "xdp_forward");
        let to = at(f.node_a, 30080);
        eventually(&format!("{to} to answer through XDP"), || tcp_ask_any(&c.client, to).map_err(|e| e.to_string()));
        udp_all(&c, f);
        let r = c.node("node-a").inspect().unwrap();
        assert!(n(&r, "xdp_forward") > before && n(&r, "xdp_reply") > 0, "{}: {:?}", f.name, r.counters);
    }
}

pub fn maglev_agreement(agent: &Path, mode: ProxyMode) {
    if not_applicable(mode, "maglev", "maglev_agreement") {
        return;
    }
    let lb = cluster::service(
        "web",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n",
        Some("  loadBalancer:\n    ingress:\n    - {ip: 203.0.113.10}\n"),
    );
    let eps = [(ip("10.244.1.11"), "node-a"), (ip("10.244.2.11"), "node-b"), (ip("10.244.2.12"), "node-b")];
    let c = cluster_with(agent, mode, [&["a1"], &["b1", "b2"]], &lb, &eps, &[]);
    for f in north_families() {
        let lb = at(f.lb, 80);
        eventually("the load-balancer IP to answer", || tcp_ask_any(&c.client, lb).map_err(|e| e.to_string()));
        let client_net: IpAddr = if f.lb.is_ipv4() { "198.51.100.1".parse().unwrap() } else { "2001:db8:100::1".parse().unwrap() };
        let mut picks = Vec::new();
        for node in &c.nodes {
            let root = node.bpffs();
            // The client's traffic reached one node; the other may still be programming its maps.
            picks.push(eventually(&format!("{} to pick a backend for every {} flow", node.name, f.name), || {
                let root = root.clone();
                let picks = node.ns.run(move || {
                    (0..60u16)
                        .map(|p| {
                            proxy_agent::trace::run(&root, at(client_net, 40000 + p), lb, proxy_agent::model::Protocol::Tcp)
                                .map_or_else(|e| format!("trace: {e}"), |t| t.backend.unwrap_or_default())
                        })
                        .collect::<Vec<_>>()
                });
                if picks.iter().all(|b| !b.is_empty() && !b.starts_with("trace: ")) {
                    Ok(picks)
                } else {
                    Err(format!("{picks:?}"))
                }
            }));
        }
        assert_eq!(picks[0], picks[1], "{mode} ({}): both nodes pick the same backend for every flow", f.name);
        assert_eq!(picks[0].iter().collect::<BTreeSet<_>>().len(), 3, "{mode} ({}): 60 flows reach all 3 backends", f.name);
    }
}

/// What answered a ping: the sender, ICMP (ICMPv6) type and code; or the send's errno.
type PingAnswer = Result<Option<(IpAddr, u8, u8)>, i32>;

/// Sends one ICMP (ICMPv6) echo request from namespace `ns` to `dst` and returns what first
/// answers it within a second, if anything does; Err(errno) when the send itself fails
/// (netfilter dropping or rejecting a local packet fails it with EPERM; a drop on TC egress
/// fails an IPv6 raw send with ENOBUFS, which IPv4's raw sockets report only with IP_RECVERR).
fn ping(ns: &crate::netns::Netns, dst: impl Into<IpAddr>) -> PingAnswer {
    let dst = dst.into();
    ns.run(move || {
        // SAFETY: plain socket calls on a descriptor this closure owns and closes, with buffers
        // and addresses of the sizes given.
        unsafe {
            let (domain, proto) = if dst.is_ipv4() { (libc::AF_INET, libc::IPPROTO_ICMP) } else { (libc::AF_INET6, libc::IPPROTO_ICMPV6) };
            let fd = libc::socket(domain, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto);
            assert!(fd >= 0, "a raw ICMP socket: {}", io::Error::last_os_error());
            let timeout = libc::timeval { tv_sec: 0, tv_usec: 200_000 };
            libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&raw const timeout).cast(), size_of::<libc::timeval>() as u32);
            // Echo request (ICMPv6's type 128: the kernel fills in its checksum), id 0x4b50.
            let mut echo = [8u8, 0, 0, 0, 0x4b, 0x50, 0, 1, b'p', b'i', b'n', b'g'];
            let n = match dst {
                IpAddr::V4(d) => {
                    let sum = crate::packet::internet_checksum(&echo);
                    echo[2..4].copy_from_slice(&sum.to_be_bytes());
                    let to = libc::sockaddr_in {
                        sin_family: libc::AF_INET as u16,
                        sin_port: 0,
                        sin_addr: libc::in_addr { s_addr: u32::from(d).to_be() },
                        sin_zero: [0; 8],
                    };
                    libc::sendto(fd, echo.as_ptr().cast(), echo.len(), 0, (&raw const to).cast(), size_of::<libc::sockaddr_in>() as u32)
                }
                IpAddr::V6(d) => {
                    echo[0] = 128;
                    let mut to: libc::sockaddr_in6 = std::mem::zeroed();
                    to.sin6_family = libc::AF_INET6 as u16;
                    to.sin6_addr.s6_addr = d.octets();
                    libc::sendto(fd, echo.as_ptr().cast(), echo.len(), 0, (&raw const to).cast(), size_of::<libc::sockaddr_in6>() as u32)
                }
            };
            if n < 0 {
                let e = io::Error::last_os_error().raw_os_error().unwrap_or(0);
                libc::close(fd);
                return Err(e);
            }
            let deadline = Instant::now() + Duration::from_secs(1);
            let mut answer = None;
            let mut buf = [0u8; 1500];
            while answer.is_none() && Instant::now() < deadline {
                let mut from: libc::sockaddr_in6 = std::mem::zeroed();
                let mut len = size_of::<libc::sockaddr_in6>() as u32;
                let n = libc::recvfrom(fd, buf.as_mut_ptr().cast(), buf.len(), 0, (&raw mut from).cast(), &mut len);
                let Ok(n) = usize::try_from(n) else { continue };
                // An IPv4 raw socket gets the IP header too, an ICMPv6 one only the message. This
                // echo's id marks what is ours: an echo reply carries it at 4, an error quotes the
                // echo after the inner header.
                let (at, from): (usize, IpAddr) = match dst {
                    IpAddr::V4(_) => (usize::from(buf[0] & 0x0f) * 4, Ipv4Addr::new(buf[12], buf[13], buf[14], buf[15]).into()),
                    IpAddr::V6(_) => (0, std::net::Ipv6Addr::from(from.sin6_addr.s6_addr).into()),
                };
                if n < at + 8 {
                    continue;
                }
                let (kind, code) = (buf[at], buf[at + 1]);
                let inner = at + 8;
                let quoted = match dst {
                    IpAddr::V4(_) => inner + usize::from(buf[inner] & 0x0f) * 4,
                    IpAddr::V6(_) => inner + 40,
                };
                let ours = match (dst.is_ipv4(), kind) {
                    (true, 0) | (false, 129) => buf[at + 4..at + 6] == [0x4b, 0x50],
                    (true, 3 | 11) | (false, 1 | 3) => n >= quoted + 6 && buf[quoted + 4..quoted + 6] == [0x4b, 0x50],
                    _ => false,
                };
                if ours {
                    answer = Some((from, kind, code));
                }
            }
            libc::close(fd);
            Ok(answer)
        }
    })
}

/// True when a ping was refused: answered with port unreachable (ICMPv6's code 4 of type 1),
/// or (from the node itself, by netfilter) failed at once with EPERM.
fn ping_refused(answer: &PingAnswer) -> bool {
    matches!(answer, Ok(Some((IpAddr::V4(_), 3, 3) | (IpAddr::V6(_), 1, 4))) | Err(libc::EPERM))
}

/// How many IPv4 packets to `dst` the node's uplink sent while `f` ran (a packet socket on it:
/// the link's other traffic, IPv6 router solicitations say, does not count).
fn sent_by_uplink<T>(lab: &Lab, dst: impl Into<IpAddr>, f: impl FnOnce() -> T) -> (usize, T) {
    let dst = dst.into();
    let ifindex: i32 =
        lab.node.ip(&["-o", "link", "show", "uplink0"]).split(':').next().and_then(|i| i.trim().parse().ok()).expect("uplink0's index");
    let fd = lab.node.run(move || {
        // SAFETY: plain socket calls on a descriptor this function owns.
        unsafe {
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from((libc::ETH_P_ALL as u16).to_be()));
            assert!(fd >= 0, "a packet socket: {}", io::Error::last_os_error());
            let mut addr: libc::sockaddr_ll = std::mem::zeroed();
            addr.sll_family = libc::AF_PACKET as u16;
            // Outgoing frames reach only ETH_P_ALL taps.
            addr.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
            addr.sll_ifindex = ifindex;
            let rc = libc::bind(fd, (&raw const addr).cast(), std::mem::size_of::<libc::sockaddr_ll>() as u32);
            assert_eq!(rc, 0, "bind to uplink0: {}", io::Error::last_os_error());
            fd
        }
    });
    let out = f();
    let mut count = 0;
    let mut buf = [0u8; 2048];
    loop {
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: buffers of the sizes given.
        let n = unsafe { libc::recvfrom(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT, (&raw mut from).cast(), &mut len) };
        if n < 0 {
            break;
        }
        let n = n as usize;
        // Outgoing frames only; the destination at bytes 16..20 of the IPv4 header, 24..40 of
        // the IPv6 one.
        let to_dst = match dst {
            IpAddr::V4(d) => n >= 14 + 20 && buf[12..14] == [0x08, 0x00] && buf[14 + 16..14 + 20] == d.octets(),
            IpAddr::V6(d) => n >= 14 + 40 && buf[12..14] == [0x86, 0xdd] && buf[14 + 24..14 + 40] == d.octets(),
        };
        if from.sll_pkttype == libc::PACKET_OUTGOING && to_dst {
            count += 1;
        }
    }
    // SAFETY: the descriptor opened above.
    unsafe { libc::close(fd) };
    (count, out)
}

/// kube-proxy's `cluster-ips-check` with a ServiceCIDR: a cluster IP's unserved port is refused
/// at once; a free address of the range is dropped on the node (without the check, the SYN
/// would leave by the default route).
pub fn service_cidrs_drop_free_addresses_and_reject_unserved_ports(agent: &Path, mode: ProxyMode) {
    if not_applicable(mode, "service-cidrs", "service_cidrs_drop_free_addresses_and_reject_unserved_ports") {
        return;
    }
    let lab = lab_with_service_cidrs(agent, mode);
    // The uplink's far end answers no ARP (no neighbour discovery): a neighbour entry for the
    // gateway lets a SYN that is not dropped leave as it would on a node, where the gateway
    // answers.
    lab.node.ip(&["neigh", "replace", "192.168.250.254", "lladdr", "02:00:00:00:00:fe", "dev", "uplink0", "nud", "permanent"]);
    lab.node.ip(&["-6", "neigh", "replace", "fd00:250::fe", "lladdr", "02:00:00:00:00:fe", "dev", "uplink0", "nud", "permanent"]);
    for f in families(&lab) {
        // An allocated cluster IP on a port its Service does not have: refused (as in
        // `a_service_without_endpoints_refuses`, IPv6's answer ends its connect() at the first
        // SYN retransmission).
        let resent = lab.client.ns.tcp_ext("TCPSynRetrans");
        let err = tcp_ask_any(&lab.client.ns, at(f.web.ip(), 81)).expect_err("no such port");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{mode} ({}): {err}", f.name);
        let resent = lab.client.ns.tcp_ext("TCPSynRetrans") - resent;
        assert!(resent <= syn_resends(f.web.ip()), "{mode} ({}): refused at the first SYN, not after {resent} more", f.name);
        let (free, outside): (IpAddr, IpAddr) = if f.web.is_ipv4() {
            (Ipv4Addr::new(10, 96, 0, 77).into(), Ipv4Addr::new(10, 97, 0, 77).into())
        } else {
            ("fd00:96::77".parse().unwrap(), "fd00:97::77".parse().unwrap())
        };
        let (sent, err) =
            sent_by_uplink(&lab, free, || tcp_ask_any(&lab.client.ns, at(free, 80)).expect_err("a free address answers nothing"));
        assert!(
            matches!(err.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock),
            "{mode} ({}): dropped, so it times out: {err}",
            f.name
        );
        assert_eq!(sent, 0, "{mode} ({}): nothing left by the default route; log:\n{}", f.name, lab.agent_log());
        // Outside the range, the same packet goes where routing sends it.
        let (sent, _) = sent_by_uplink(&lab, outside, || tcp_ask_any(&lab.client.ns, at(outside, 80)));
        assert!(sent >= 1, "{mode} ({}): outside the ServiceCIDR the SYN leaves by the default route", f.name);
    }
    // A ping is a new flow too: to a cluster IP it is rejected, to a free address dropped.
    // (nftables' reject answers from the node's address, the eBPF dataplane from the cluster IP.)
    for f in families(&lab) {
        let (vip, free): (IpAddr, IpAddr) =
            if f.web.is_ipv4() { (f.web.ip(), Ipv4Addr::new(10, 96, 0, 79).into()) } else { (f.web.ip(), "fd00:96::79".parse().unwrap()) };
        let answer = ping(&lab.client.ns, vip);
        assert!(matches!(answer, Ok(Some(_))) && ping_refused(&answer), "{mode} ({}): port unreachable: {answer:?}", f.name);
        let (sent, answer) = sent_by_uplink(&lab, free, || ping(&lab.client.ns, free));
        assert_eq!((sent, answer), (0, Ok(None)), "{mode} ({}): a ping to a free address is dropped", f.name);
        // The node's own ping too (netfilter fails a local packet it rejects or drops with EPERM).
        let answer = ping(&lab.node, vip);
        if mode == ProxyMode::Ebpf {
            assert!(
                matches!(answer, Ok(Some((from, _, _))) if from == vip),
                "{mode} ({}): the node's ping answered from the cluster IP: {answer:?}",
                f.name
            );
        }
        assert!(ping_refused(&answer), "{mode} ({}): the node's ping to a cluster IP is refused: {answer:?}", f.name);
        let (sent, answer) = sent_by_uplink(&lab, free, || ping(&lab.node, free));
        // ENOBUFS: the eBPF dataplane's drop on TC egress, as IPv6's raw sockets report it.
        let dropped_on_egress = mode == ProxyMode::Ebpf && !f.web.is_ipv4() && answer == Err(libc::ENOBUFS);
        assert!(
            sent == 0 && (matches!(answer, Ok(None) | Err(libc::EPERM)) || dropped_on_egress),
            "{mode} ({}): the node's ping to a free address is dropped: {answer:?}",
            f.name
        );
    }
    if mode == ProxyMode::Ebpf {
        // Host-network processes: refused through the socket hooks; what they send to a free
        // address is dropped as it would leave, as a pod's.
        if require::cgroup2(&format!("the host-process part of the Service CIDR checks ({mode})"), lab.cgroup.is_some()) {
            assert_eq!(lab.host_ask("tcp", "10.96.0.10:81"), "err ConnectionRefused");
            for (proto, to) in [("tcp", "10.96.0.77:80"), ("udp", "10.96.0.78:53")] {
                let dst = *sock(to).ip();
                let (sent, out) = sent_by_uplink(&lab, dst, || lab.host_ask(proto, to));
                assert!(out.starts_with("err ") && !out.contains("Refused"), "{mode}: {proto} to {to}: {out}");
                assert_eq!(sent, 0, "{mode}: {proto} to {to} left by the default route");
            }
        }
        let c = lab.inspect().expect("inspect").counters;
        assert!(c.get("drop_unallocated_cluster_ip").is_some_and(|c| c.packets >= 1), "{mode}: {c:?}");
        assert!(c.get("reject_cluster_ip_port").is_some_and(|c| c.packets >= 1), "{mode}: {c:?}");
    }
}

/// A scenario: the agent binary, the mode.
pub type Scenario = fn(&Path, ProxyMode);

/// Every scenario, by name.
pub const SCENARIOS: &[(&str, Scenario)] = &[
    ("clusterip_tcp_and_udp_reach_every_backend", clusterip_tcp_and_udp_reach_every_backend),
    ("a_service_without_endpoints_refuses", a_service_without_endpoints_refuses),
    ("endpoint_changes_are_followed", endpoint_changes_are_followed),
    ("services_with_the_longest_names_are_served", services_with_the_longest_names_are_served),
    ("an_external_ip_does_not_take_another_services_cluster_ip", an_external_ip_does_not_take_another_services_cluster_ip),
    ("a_pod_reaching_its_own_service_gets_through", a_pod_reaching_its_own_service_gets_through),
    ("a_connection_tried_before_its_service_existed_gets_through", a_connection_tried_before_its_service_existed_gets_through),
    ("node_port_from_outside", node_port_from_outside),
    ("external_traffic_policy_local", external_traffic_policy_local),
    ("internal_traffic_policy_local", internal_traffic_policy_local),
    ("load_balancer_and_external_ips", load_balancer_and_external_ips),
    ("client_ip_affinity", client_ip_affinity),
    ("a_node_port_without_endpoints_refuses", a_node_port_without_endpoints_refuses),
    ("xdp_forwards_north_south", xdp_forwards_north_south),
    ("maglev_agreement", maglev_agreement),
    ("service_cidrs_drop_free_addresses_and_reject_unserved_ports", service_cidrs_drop_free_addresses_and_reject_unserved_ports),
    ("ipv6_services", ipv6_services),
    ("path_mtu_discovery_through_a_service", path_mtu_discovery_through_a_service),
    ("path_mtu_discovery_through_a_node_port", path_mtu_discovery_through_a_node_port),
];

/// Connects from `ns` to `to` and reads the name the server answers with.
fn ask_name(ns: &crate::netns::Netns, to: SocketAddr) -> io::Result<String> {
    use std::io::Read as _;
    let mut stream = ns.run(move || std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2)))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    Ok(text.trim().to_string())
}

/// IPv6 and dual-stack Services (iptables writes ip6tables, nftables the `ip6 kube-proxy`
/// table, IPVS IPv6 virtual servers and `KUBE-6-` sets, as kube-proxy's IPv6 proxiers; the eBPF
/// dataplane its IPv6 maps, which serve pods: the client here is a pod): the lab's pods get
/// IPv6 addresses
/// beside their IPv4 ones and the node an IPv6 address and default route on its uplink. An IPv6-only Service
/// reaches every backend over IPv6 and its NodePort on the node's IPv6 address; one without
/// endpoints refuses; a dual-stack Service answers on both cluster IPs, each from its own
/// family's EndpointSlice; the IPv4 Services stay served throughout. In eBPF mode also: its
/// Service CIDR check refuses an IPv6 cluster IP's unserved port, and host-network processes
/// reach the IPv6 Services through the socket hooks.
pub fn ipv6_services(agent: &Path, mode: ProxyMode) {
    if not_applicable(mode, "ipv6", "ipv6_services") {
        return;
    }
    let mut lab = Lab::new(agent, 2);
    // Addresses, a default route (without one, traffic to a cluster IP dies in routing, ICMPv6
    // no route, before netfilter sees it) and the IPv6 servers on TCP 8082 and UDP 5354.
    dual_stack(&mut lab);
    let v6 = pod6;
    // Answers with the pod's name (the lab's own servers listen on IPv4 only).
    let servers: Vec<_> = lab
        .backends
        .iter()
        .map(|b| {
            let at = (std::net::Ipv6Addr::UNSPECIFIED, 8081).into();
            crate::servers::Acceptor::start(&b.ns, at, Some(format!("{}\n", b.name)), Duration::from_millis(20))
        })
        .collect();
    let v6_slice = |svc: &str| {
        let eps: String = (1..=lab.backends.len()).map(|i| format!("- addresses: ['{}']\n", v6(0x100 + i as u16))).collect();
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {svc}-v6\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {svc}\naddressType: IPv6\nports:\n- {{name: http, port: 8081, protocol: TCP}}\nendpoints:\n{eps}"
        )
    };
    let objects = [
        standard_manifests(&lab.backend_ips()),
        cluster::service(
            "web6",
            "  type: NodePort\n  clusterIP: fd00:96::10\n  clusterIPs: ['fd00:96::10']\n  ipFamilies: [IPv6]\n  ports:\n  - {name: http, port: 80, targetPort: 8081, nodePort: 30081, protocol: TCP}\n",
            None,
        ),
        v6_slice("web6"),
        cluster::service("empty6", "  clusterIP: fd00:96::11\n  ipFamilies: [IPv6]\n  ports:\n  - {name: http, port: 80, protocol: TCP}\n", None),
        cluster::service(
            "dual",
            "  clusterIP: 10.96.0.50\n  clusterIPs: [10.96.0.50, 'fd00:96::50']\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports:\n  - {name: http, port: 80, targetPort: 8080, protocol: TCP}\n",
            None,
        ),
        crate::lab::endpoint_slice("dual", "dual-v4", &lab.backend_ips(), &[("http", crate::lab::TCP_PORT, "TCP")]),
        v6_slice("dual"),
        cluster::service(
            "host6",
            "  clusterIP: fd00:96::53\n  ipFamilies: [IPv6]\n  ports:\n  - {name: http, port: 80, targetPort: 8082, protocol: TCP}\n  - {name: dns, port: 53, targetPort: 5354, protocol: UDP}\n",
            None,
        ),
        v6_slice("host6")
            .replace("- {name: http, port: 8081, protocol: TCP}", "- {name: http, port: 8082, protocol: TCP}\n- {name: dns, port: 5354, protocol: UDP}"),
    ];
    lab.write_manifest("services.yaml", &objects.join("---\n"));
    let mut args = vec!["--proxy-mode", mode.as_str(), "--cluster-cidr", "10.244.0.0/16,fd00:244::/64"];
    if mode == ProxyMode::Ebpf {
        // Its Service CIDR check, in both families (kube-proxy's `cluster-ips-check`).
        args.extend(["--service-cluster-ip-range", "10.96.0.0/16,fd00:96::/112"]);
    }
    lab.start_agent_with_extra(&args);
    let all: BTreeSet<String> = lab.backends.iter().map(|b| b.name.clone()).collect();
    let every_backend = |to: &str| {
        let to: SocketAddr = to.parse().unwrap();
        eventually(&format!("{to} to reach every backend"), || {
            let seen: BTreeSet<String> = (0..30).filter_map(|_| ask_name(&lab.client.ns, to).ok()).collect();
            if seen == all {
                Ok(())
            } else {
                Err(format!("answered by {seen:?}"))
            }
        })
    };
    every_backend("[fd00:96::10]:80");
    // The IPv6 cluster IP is not the only way in: the NodePort on the node's IPv6 address.
    eventually("the IPv6 NodePort", || ask_name(&lab.client.ns, "[fd00:250::1]:30081".parse().unwrap()).map_err(|e| e.to_string()));
    // No endpoints: refused at once (kube-proxy's REJECT), not left to time out.
    let refused = ask_name(&lab.client.ns, "[fd00:96::11]:80".parse().unwrap());
    assert_eq!(refused.as_ref().map_err(|e| e.kind()), Err(io::ErrorKind::ConnectionRefused), "{mode}: IPv6 Service without endpoints");
    // Dual-stack: each cluster IP served from its own family's slice (the IPv6 slice's
    // port is 8081, the IPv4 one's 8080: the wrong pairing would not answer).
    every_backend("[fd00:96::50]:80");
    eventually("the dual-stack Service's IPv4 cluster IP", || tcp_ask(&lab.client.ns, sock("10.96.0.50:80")).map_err(|e| e.to_string()));
    tcp_ask(&lab.client.ns, sock(WEB_VIP)).unwrap_or_else(|e| panic!("{mode}: the IPv4 Service beside the IPv6 ones: {e}"));
    // The rules are where kube-proxy's IPv6 proxier keeps them (the eBPF dataplane: its IPv6
    // maps).
    if mode == ProxyMode::Ebpf {
        use proxy_common::{map_names, Ip6, ServiceKey, ServiceValue};
        let pin = lab.bpffs().join("maps").join(map_names::SERVICES6);
        let map = aya::maps::MapData::from_pin(&pin).unwrap_or_else(|e| panic!("{}: {e}", pin.display()));
        let services: aya::maps::HashMap<_, ServiceKey<Ip6>, ServiceValue> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(map)).expect("a hash map");
        let vip: std::net::Ipv6Addr = "fd00:96::10".parse().unwrap();
        let key = ServiceKey::new(Ip6::from_bytes(vip.octets()), 80u16.to_be_bytes(), 6, 0);
        let master = services.get(&key, 0).expect("the IPv6 cluster IP's master entry in LB6_SERVICES_V1");
        assert_eq!(usize::from(master.count), lab.backends.len(), "one slot per IPv6 endpoint");
        // An IPv6 cluster IP on a port its Service lacks is refused at once (the Service CIDR
        // check), not left to time out.
        let refused = ask_name(&lab.client.ns, "[fd00:96::10]:81".parse().unwrap());
        assert_eq!(refused.map_err(|e| e.kind()), Err(io::ErrorKind::ConnectionRefused), "an unserved port of an IPv6 cluster IP");
        host_processes_reach_ipv6_services(&lab, &all);
        // The IPv6 maps' gauges count the IPv6 frontends (the IPv4 ones count IPv4's only).
        eventually("the IPv6 services gauge", || {
            let (_, metrics) =
                crate::servers::http_get(&lab.node, "127.0.0.1:10249".parse().unwrap(), "/metrics").map_err(|e| e.to_string())?;
            let gauge = |map: &str| {
                let line = format!("proxy_agent_map_entries{{map=\"{map}\"}} ");
                metrics.lines().find_map(|l| l.strip_prefix(line.as_str())).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0)
            };
            if gauge("services_ipv6") > 0 && gauge("backends_ipv6") > 0 {
                Ok(())
            } else {
                Err(format!("services_ipv6 {}, backends_ipv6 {}", gauge("services_ipv6"), gauge("backends_ipv6")))
            }
        });
        drop(servers);
        return;
    }
    let node = lab.node.name.clone();
    let listing = match mode {
        ProxyMode::Nftables => in_netns(&node, &["nft", "list", "table", "ip6", "kube-proxy"]),
        ProxyMode::Ipvs => in_netns(&node, &["ipvsadm", "-Sn"]) + &in_netns(&node, &["ipset", "list", "KUBE-6-CLUSTER-IP"]),
        _ => in_netns(&node, &["ip6tables-nft-save", "-t", "nat"]),
    };
    assert!(listing.contains("fd00:96::10"), "{mode}: the IPv6 cluster IP in the IPv6 rules:\n{listing}");
    drop(servers);
}

/// The eBPF dataplane's socket hooks for IPv6 Services (`ipv6_services`' Services): a
/// host-network process's TCP connection and unconnected UDP datagrams reach the backends, its
/// socket shows the Service as its peer, and a Service without endpoints refuses at once. (The
/// iptables and nftables modes serve the node through their OUTPUT chains, which the rules
/// listing above covers.)
fn host_processes_reach_ipv6_services(lab: &Lab, all: &BTreeSet<String>) {
    if !require::cgroup2("the host-process part of ipv6_services", lab.cgroup.is_some()) {
        return;
    }
    let mut seen = BTreeSet::new();
    for i in 0..20 {
        let out = lab.host_ask("tcp", "[fd00:96::53]:80");
        let f: Vec<&str> = out.split_whitespace().collect();
        assert!(f.len() == 4 && f[0] == "ok", "host TCP connection {i} to an IPv6 Service: {out}\n{}", lab.agent_log());
        assert_eq!(f[3], "[fd00:96::53]:80", "getpeername shows the Service, not the backend");
        seen.insert(f[1].to_string());
    }
    assert_eq!(&seen, all, "host connections to an IPv6 Service spread over its backends");
    for i in 0..5 {
        let out = lab.host_ask("udp", "[fd00:96::53]:53");
        let f: Vec<&str> = out.split_whitespace().collect();
        assert!(f.len() == 4 && f[0] == "ok" && all.contains(f[1]), "host UDP query {i} to an IPv6 Service: {out}");
        assert_eq!(f[3], "[fd00:96::53]:53", "recvfrom shows the answer as coming from the Service");
    }
    let out = lab.host_ask("udp-many", "[fd00:96::53]:53");
    assert!(out.starts_with("ok 1 "), "an unconnected IPv6 UDP socket keeps one backend per Service: {out}");
    assert_eq!(lab.host_ask("tcp", "[fd00:96::11]:80"), "err ConnectionRefused", "no endpoints: refused at once");
    assert_eq!(lab.host_ask("tcp", "[fd00:96::53]:81"), "err ConnectionRefused", "an unserved port of an IPv6 cluster IP");
    // IPv4-mapped addresses still reach the IPv4 Services beside the IPv6 ones.
    let out = lab.host_ask("tcp", "[::ffff:10.96.0.50]:80");
    assert!(out.starts_with("ok ") && out.ends_with(" [::ffff:10.96.0.50]:80"), "an IPv4-mapped address: {out}");
}

/// Path MTU discovery through a Service, in both families: a client behind a router whose
/// next link has a smaller MTU (1280) than the backend's (1500) downloads from a Service. The
/// backend's full-sized replies cannot cross that link; the router answers each with
/// fragmentation needed (ICMPv6 packet too big), addressed to the Service address the replies
/// carry. Only when the proxy hands that error to the backend, quoting the reply as the
/// backend sent it, does the backend lower its path MTU; otherwise the download stalls for
/// good (routers fragment neither IPv6 nor IPv4 with DF set, and Linux probes for black holes
/// only when asked to). kube-proxy's modes get this from conntrack, which NATs ICMP errors
/// RELATED to a connection.
///
/// Lab versus node: the router is a pod here (the client pod with forwarding on and a second
/// link to the client's namespace, inside the cluster CIDR), so the error arrives on a pod
/// interface; on a node, an outside client's router sends it in by the uplink, which
/// `tests/north.rs` and `north6.rs` cover packet by packet.
pub fn path_mtu_discovery_through_a_service(agent: &Path, mode: ProxyMode) {
    let mut lab = Lab::new(agent, 1);
    dual_stack(&mut lab);
    let (router_v6, backend_v6) = (pod6(2), pod6(0x101));
    let router = &lab.client;
    // The client, one link past the router.
    let far = behind_a_small_link(&router.ns, &format!("pxl-{}-far", lab.id), ("10.244.250", "fd00:244::250:"));
    lab.node.ip(&["route", "add", "10.244.250.0/24", "via", &router.ip.to_string(), "dev", &router.host_if]);
    lab.node.ip(&["-6", "route", "add", "fd00:244::250:0/112", "via", &router_v6.to_string(), "dev", &router.host_if]);
    let _server = bulk_server(&lab.backends[0].ns, "");
    let objects = [
        crate::lab::service("bulk", "10.96.0.60", &[("http", 80, "TCP", 8090)]),
        crate::lab::endpoint_slice("bulk", "bulk-v4", &lab.backend_ips(), &[("http", 8090, "TCP")]),
        cluster::service(
            "bulk6",
            "  clusterIP: fd00:96::60\n  clusterIPs: ['fd00:96::60']\n  ipFamilies: [IPv6]\n  ports:\n  - {name: http, port: 80, targetPort: 8090, protocol: TCP}\n",
            None,
        ),
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: bulk6-v6\n  namespace: default\n  labels:\n    kubernetes.io/service-name: bulk6\naddressType: IPv6\nports:\n- {{name: http, port: 8090, protocol: TCP}}\nendpoints:\n- addresses: ['{backend_v6}']\n"
        ),
    ];
    lab.write_manifest("services.yaml", &objects.join("---\n"));
    lab.start_agent_with_extra(&["--proxy-mode", mode.as_str(), "--cluster-cidr", "10.244.0.0/16,fd00:244::/64"]);
    for to in ["10.96.0.60:80", "[fd00:96::60]:80"] {
        let to: SocketAddr = to.parse().unwrap();
        // The Service's rules come first: until they are there, connecting fails at once.
        eventually(&format!("{to} to accept connections"), || {
            far.run(move || std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2))).map(drop).map_err(|e| e.to_string())
        });
        download(&far, to).unwrap_or_else(|e| {
            panic!(
                "{mode}: a download from {to} through a link of MTU 1280 (the backend must learn the path MTU): {e}\n{}",
                lab.agent_log()
            )
        });
    }
}

/// Bytes a `bulk_server` sends after its greeting: more than any window.
const BULK: usize = 256 * 1024;

/// A listener in `ns` taking both families on TCP 8090 that sends every connection `name`, a
/// newline and `BULK` bytes, then closes it.
fn bulk_server(ns: &crate::netns::Netns, name: &str) -> crate::servers::Acceptor {
    let text = format!("{name}\n{}", "x".repeat(BULK));
    crate::servers::Acceptor::start(ns, (std::net::Ipv6Addr::UNSPECIFIED, 8090).into(), Some(text), Duration::from_millis(20))
}

/// Downloads from a `bulk_server` at `to`, from `ns`: the server's name once every byte came.
fn download(ns: &crate::netns::Netns, to: SocketAddr) -> Result<String, String> {
    use std::io::Read as _;
    let mut stream =
        ns.run(move || std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2))).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    let end = match stream.read_to_end(&mut got) {
        Ok(_) => "the end".to_string(),
        Err(e) => e.to_string(),
    };
    let text = String::from_utf8_lossy(&got);
    match text.split_once('\n') {
        Some((name, rest)) if rest.len() == BULK => Ok(name.to_string()),
        _ => Err(format!("{} bytes, then {end}", got.len())),
    }
}

/// A namespace `name` one router past `router`: a link of MTU 1280 on the router's side and
/// 1500 on the far one (so the far end's SYN offers the full MSS), addressed `<v4>.1`/`.2`
/// (a /24) and `<v6>1`/`2` (a /112), the far end routing everything through the router.
fn behind_a_small_link(router: &crate::netns::Netns, name: &str, (v4, v6): (&str, &str)) -> crate::netns::Netns {
    router.sysctl("net.ipv4.ip_forward", "1");
    router.sysctl("net.ipv6.conf.all.forwarding", "1");
    let far = crate::netns::Netns::create(name);
    router.ip(&["link", "add", "far0", "mtu", "1280", "type", "veth", "peer", "name", "eth0", "netns", &far.name]);
    router.ip(&["addr", "add", &format!("{v4}.1/24"), "dev", "far0"]);
    router.ip(&["-6", "addr", "add", &format!("{v6}1/112"), "dev", "far0", "nodad"]);
    router.ip(&["link", "set", "far0", "up"]);
    far.ip(&["addr", "add", &format!("{v4}.2/24"), "dev", "eth0"]);
    far.ip(&["-6", "addr", "add", &format!("{v6}2/112"), "dev", "eth0", "nodad"]);
    far.ip(&["link", "set", "eth0", "up"]);
    far.ip(&["route", "add", "default", "via", &format!("{v4}.1")]);
    far.ip(&["-6", "route", "add", "default", "via", &format!("{v6}1")]);
    far
}

/// Path MTU discovery through NodePorts from outside, in both families: the client is one
/// router past a link of MTU 1280 (the lab's outside client routes for it), and downloads
/// from a Service whose backends are on node A, which it asks, and on node B. The router's
/// fragmentation needed (packet too big) about the backends' full-sized replies is addressed
/// to node A's NodePort address; only when the proxy hands it to the backend, on node A or
/// past node A's stack to node B (the SNATed flow's path), quoting the reply as the backend
/// sent it, does the download finish. kube-proxy's modes get this from conntrack.
pub fn path_mtu_discovery_through_a_node_port(agent: &Path, mode: ProxyMode) {
    let c = cluster_with(agent, mode, [&["a1"], &["b1"]], &web(""), &[], &[]);
    let far = behind_a_small_link(&c.client, &format!("pxc-{}-far", c.id), ("100.64.0", "fd00:64::"));
    for node in &c.nodes {
        node.ns.ip(&["route", "add", "100.64.0.0/24", "via", CLIENT_IP]);
        node.ns.ip(&["-6", "route", "add", "fd00:64::/112", "via", cluster::CLIENT_IP6]);
    }
    let _servers = [bulk_server(&c.nodes[0].pods[0].ns, "a1"), bulk_server(&c.nodes[1].pods[0].ns, "b1")];
    let bulk = cluster::service(
        "bulk",
        "  type: NodePort\n  clusterIP: 10.96.0.60\n  clusterIPs: [10.96.0.60, 'fd00:96::60']\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports:\n  - {name: http, port: 80, targetPort: 8090, nodePort: 30090, protocol: TCP}\n",
        None,
    );
    let slice_of = |family: &str, eps: [(String, &str); 2]| {
        let eps: String = eps.iter().map(|(a, n)| format!("- addresses: ['{a}']\n  nodeName: {n}\n")).collect();
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: bulk-{}\n  namespace: default\n  labels:\n    kubernetes.io/service-name: bulk\naddressType: {family}\nports:\n- {{name: http, port: 8090, protocol: TCP}}\nendpoints:\n{eps}",
            family.to_lowercase()
        )
    };
    let objects = [
        bulk,
        slice_of("IPv4", [("10.244.1.11".into(), "node-a"), ("10.244.2.11".into(), "node-b")]),
        slice_of("IPv6", [(cluster::pod_ipv6(1, 0).to_string(), "node-a"), (cluster::pod_ipv6(2, 0).to_string(), "node-b")]),
    ];
    c.write_manifest("bulk.yaml", &objects.join("---\n"));
    for f in north_families() {
        let to = at(f.node_a, 30090);
        eventually(&format!("{to} to accept connections"), || {
            far.run(move || std::net::TcpStream::connect_timeout(&to, Duration::from_secs(2))).map(drop).map_err(|e| e.to_string())
        });
        let mut seen = BTreeSet::new();
        for i in 0..30 {
            let name = download(&far, to).unwrap_or_else(|e| {
                panic!(
                    "{mode}: download {i} from {to} through a link of MTU 1280 (the backend must learn the path MTU): {e}\n{}",
                    c.node("node-a").agent_log()
                )
            });
            seen.insert(name);
            if seen.len() == 2 {
                break;
            }
        }
        assert_eq!(seen, BTreeSet::from(["a1".to_string(), "b1".to_string()]), "{mode} {to}: both the local and the remote backend");
    }
}
