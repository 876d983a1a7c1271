//! End-to-end scenarios in the lab, with real TCP and UDP through the agent's programs.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, ErrorKind, Write as _},
    thread,
    time::Duration,
};

use proxy_tests::{
    lab::{self, sock, standard_manifests, Lab, DNS_VIP, EMPTY_VIP, WEB_VIP},
    netns, require,
    servers::{tcp_ask, udp_ask, udp_ask_connected, Conn, UdpFlow},
};

const AGENT: &str = env!("CARGO_BIN_EXE_proxy-lab-agent");

/// A lab with three backends behind the standard Services, agent running and synced.
fn lab(test: &str) -> Option<Lab> {
    let mut lab = lab_with(test, &[])?;
    lab.wait_programmed(WEB_VIP, "TCP", 3);
    lab.wait_programmed(DNS_VIP, "UDP", 3);
    Some(lab)
}

/// A lab with three backends behind the standard Services, the agent started with `extra`
/// flags (not waited for).
fn lab_with(test: &str, extra: &[&str]) -> Option<Lab> {
    if !require::root(test) {
        return None;
    }
    let mut lab = Lab::new(AGENT, 3);
    lab.write_manifest("services.yaml", &standard_manifests(&lab.backend_ips()));
    lab.start_agent_with_extra(extra);
    Some(lab)
}

fn counts(lab: &Lab, n: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for i in 0..n {
        let a = tcp_ask(&lab.client.ns, sock(WEB_VIP)).unwrap_or_else(|e| panic!("connection {i} to {WEB_VIP}: {e}"));
        *seen.entry(a.backend).or_default() += 1;
    }
    seen
}

/// What the agent's metrics server answers at `path`.
fn metrics_server(lab: &Lab, path: &str) -> String {
    proxy_tests::servers::http_get(&lab.node, "127.0.0.1:10249".parse().unwrap(), path).unwrap_or_else(|e| panic!("{path}: {e}")).1
}

/// The value of the agent's metric `series` (its name and labels, as `/metrics` prints them).
fn metric(lab: &Lab, series: &str) -> Option<u64> {
    metrics_server(lab, "/metrics").lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The mode the agent says it serves in (`/proxyMode`).
fn proxy_mode(lab: &Lab) -> String {
    metrics_server(lab, "/proxyMode")
}

/// Waits up to 20 s for a connection to the web Service to be answered (a netfilter mode
/// serving, which `wait_programmed` cannot see).
fn wait_served(lab: &Lab, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while tcp_ask(&lab.client.ns, sock(WEB_VIP)).is_err() {
        assert!(std::time::Instant::now() < deadline, "{what}:\n{}", lab.agent_log());
        thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn tcp_connections_spread_over_every_backend() {
    let Some(lab) = lab("tcp_connections_spread_over_every_backend") else { return };
    let seen = counts(&lab, 100);
    assert_eq!(seen.keys().cloned().collect::<Vec<_>>(), ["backend-1", "backend-2", "backend-3"], "100 connections: {seen:?}");
    // The backend sees the client's own address: a ClusterIP is DNAT only.
    let a = tcp_ask(&lab.client.ns, sock(WEB_VIP)).unwrap();
    assert_eq!(a.peer.ip(), std::net::IpAddr::V4(lab.client.ip));
}

#[test]
fn udp_request_and_reply_through_the_service_address() {
    let Some(lab) = lab("udp_request_and_reply_through_the_service_address") else { return };
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..30 {
        let (answer, from) = udp_ask(&lab.client.ns, sock(DNS_VIP)).expect("UDP answer through the service");
        assert_eq!(from, sock(DNS_VIP).into(), "the reply must come from the service address");
        seen.insert(answer.backend);
    }
    assert!(seen.len() > 1, "UDP flows from new source ports spread over backends: {seen:?}");
}

#[test]
fn a_service_without_endpoints_refuses_at_once() {
    let Some(lab) = lab("a_service_without_endpoints_refuses_at_once") else { return };
    let resent = lab.client.ns.tcp_ext("TCPSynRetrans");
    let err = tcp_ask(&lab.client.ns, sock(EMPTY_VIP)).expect_err("no endpoints: the connection must fail");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "expected connection refused (ICMP), got {err}");
    assert_eq!(lab.client.ns.tcp_ext("TCPSynRetrans"), resent, "refused at the first SYN");
    lab.write_manifest(
        "empty-udp.yaml",
        &[
            lab::service("empty-udp", "10.96.0.98", &[("dns", 53, "UDP", 5353)]),
            lab::endpoint_slice("empty-udp", "empty-udp-1", &[], &[("dns", 5353, "UDP")]),
        ]
        .join("---\n"),
    );
    let mut lab = lab;
    lab.wait_programmed("10.96.0.98:53", "UDP", 0);
    let err = udp_ask_connected(&lab.client.ns, sock("10.96.0.98:53")).expect_err("no endpoints: UDP must fail");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "expected ECONNREFUSED from the ICMP error, got {err}");
    assert!(lab.inspect().unwrap().counters["reject_no_endpoints"].packets >= 2);
}

#[test]
fn a_removed_backend_gets_no_new_flows() {
    let Some(mut lab) = lab("a_removed_backend_gets_no_new_flows") else { return };
    let remaining = &lab.backend_ips()[..2];
    lab.write_manifest("services.yaml", &standard_manifests(remaining));
    lab.wait_programmed(WEB_VIP, "TCP", 2);
    let seen = counts(&lab, 60);
    assert!(!seen.contains_key("backend-3"), "once the file change is programmed backend-3 gets no new flows: {seen:?}");
    assert_eq!(seen.len(), 2, "{seen:?}");
}

#[test]
fn an_added_backend_starts_getting_traffic() {
    let Some(mut lab) = lab("an_added_backend_starts_getting_traffic") else { return };
    let two = &lab.backend_ips()[..2];
    lab.write_manifest("services.yaml", &standard_manifests(two));
    lab.wait_programmed(WEB_VIP, "TCP", 2);
    assert!(!counts(&lab, 30).contains_key("backend-3"));
    lab.write_manifest("services.yaml", &standard_manifests(&lab.backend_ips()));
    lab.wait_programmed(WEB_VIP, "TCP", 3);
    assert!(counts(&lab, 60).contains_key("backend-3"), "the added backend must get new flows");
}

#[test]
fn an_established_connection_survives_kill_and_restart_of_the_agent() {
    let Some(mut lab) = lab("an_established_connection_survives_kill_and_restart_of_the_agent") else { return };
    let mut conn = Conn::open(&lab.client.ns, sock(WEB_VIP)).expect("connect");
    let first = conn.ask().expect("first request").backend;
    lab.kill_agent();
    assert_eq!(conn.ask().expect("request while the agent is dead").backend, first, "same backend without an agent");
    assert!(tcp_ask(&lab.client.ns, sock(WEB_VIP)).is_ok(), "new connections work while the agent is dead");
    lab.start_agent();
    // The restarted agent adopts the pins and finishes its initial sync against them.
    lab.wait_log("initial sync done", 2);
    lab.wait_for("the restarted agent to attach again", |r| r.interfaces.len() == 4 && r.frontends.len() == 3);
    let log = lab.agent_log();
    let second_run = &log[log.rfind("dataplane loaded").unwrap()..];
    assert!(second_run.contains("adopted_frontends=3"), "the restarted agent adopts what is pinned:\n{second_run}");
    assert!(second_run.contains("programmed=0"), "nothing unchanged is rewritten:\n{second_run}");
    for i in 0..5 {
        assert_eq!(
            conn.ask().unwrap_or_else(|e| panic!("request {i} after restart: {e}")).backend,
            first,
            "the connection keeps its backend across the restart"
        );
    }
    assert_eq!(counts(&lab, 30).len(), 3, "new connections still spread after the restart");
}

#[test]
fn a_pod_interface_created_later_is_attached() {
    let Some(mut lab) = lab("a_pod_interface_created_later_is_attached") else { return };
    let late = lab.add_pod("late-client", false).ns.name.clone();
    lab.wait_for("the new interface to be attached", |r| r.interfaces.values().any(|n| n == "vethx1"));
    let ns = &lab.extra[0].ns;
    assert_eq!(ns.name, late);
    let a = tcp_ask(ns, sock(WEB_VIP)).expect("a pod created after the agent reaches the service");
    assert!(a.backend.starts_with("backend-"));
}

#[test]
fn a_broken_manifest_is_reported_and_breaks_nothing() {
    let Some(mut lab) = lab("a_broken_manifest_is_reported_and_breaks_nothing") else { return };
    lab.write_manifest(
        "bad.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: bad}\nspec: {clusterIP: 10.96.0.300, ports: [{port: 80}]}\n",
    );
    lab.write_manifest("broken.yaml", "kind: [unclosed");
    // The valid Services keep working, and the problems are named in the log.
    thread::sleep(Duration::from_millis(500));
    assert_eq!(counts(&lab, 10).values().sum::<usize>(), 10);
    let log = lab.agent_log();
    assert!(log.contains("Service default/bad") && log.contains("10.96.0.300"), "the invalid Service must be named:\n{log}");
    assert!(log.contains("broken.yaml") && log.contains("not valid YAML"), "the broken file must be named:\n{log}");
    assert!(lab.agent_running(), "the agent must keep running");
}

#[test]
fn sigterm_leaves_traffic_flowing_and_cleanup_removes_everything() {
    let Some(mut lab) = lab("sigterm_leaves_traffic_flowing_and_cleanup_removes_everything") else { return };
    let mut conn = Conn::open(&lab.client.ns, sock(WEB_VIP)).expect("connect");
    let backend = conn.ask().unwrap().backend;
    lab.stop_agent();
    assert!(lab.agent_log().contains("stay pinned"), "the agent says what it leaves behind");
    assert_eq!(conn.ask().expect("established traffic after SIGTERM").backend, backend);
    assert_eq!(counts(&lab, 20).len(), 3, "new connections are still balanced after SIGTERM");

    let out = std::process::Command::new(AGENT).args(["cleanup", "--bpffs-root"]).arg(lab.bpffs()).output().unwrap();
    assert!(out.status.success(), "cleanup: {}", String::from_utf8_lossy(&out.stderr));
    // A fresh bpffs holds the kernel's own maps.debug and progs.debug; everything else was ours.
    let left: Vec<_> = walk(&lab.bpffs()).into_iter().filter(|p| p.extension().is_none_or(|e| e != "debug")).collect();
    assert!(left.is_empty(), "cleanup must remove every pin: {left:?}");
    for dir in ["maps", "progs", "links"] {
        assert!(!lab.bpffs().join(dir).exists(), "{dir}/ must be gone");
    }
    // bpftool lists the tcx programs of the namespace it runs in.
    let progs = lab.node.run(|| {
        std::process::Command::new("bpftool")
            .args(["net", "show", "dev", "vethc"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
    });
    let progs = progs.expect("bpftool net show");
    assert!(!progs.contains("proxy_tc"), "no program may stay attached after cleanup:\n{progs}");
    // With nothing translating, the service address is just an unrouted address.
    assert!(tcp_ask(&lab.client.ns, sock(WEB_VIP)).is_err(), "the service must be gone after cleanup");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[test]
fn pinned_maps_dump_with_field_names() {
    let Some(lab) = lab("pinned_maps_dump_with_field_names") else { return };
    let path = lab.bpffs().join("maps").join(proxy_common::map_names::SERVICES);
    let out = std::process::Command::new("bpftool").args(["-j", "map", "dump", "pinned"]).arg(&path).output().expect("bpftool");
    assert!(out.status.success(), "bpftool map dump: {}", String::from_utf8_lossy(&out.stderr));
    let dump: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    let first = &dump.as_array().expect("a list of entries")[0];
    // With BTF, bpftool prints typed keys and values under "formatted", by field name.
    let formatted = &first["formatted"];
    for field in ["addr", "port", "proto", "slot"] {
        assert!(!formatted["key"][field].is_null(), "key field {field} missing in {first}");
    }
    for field in ["backend_id", "service_id", "count"] {
        assert!(!formatted["value"][field].is_null(), "value field {field} missing in {first}");
    }
}

/// A pod's own stack sends with checksum offload (CHECKSUM_PARTIAL: the field holds only the
/// pseudo-header sum), and its flows and their replies are rewritten in that form without the
/// kernel's helper. Between two veths on one node a wrong partial checksum would go
/// unnoticed, so here the node completes checksums in software on the way to every pod
/// (`tx off` on the host-side veths) and the pods verify them (`rx off`): every byte must
/// arrive, both ways.
#[test]
fn checksum_offloaded_flows_arrive_intact_after_dnat() {
    let Some(lab) = lab("checksum_offloaded_flows_arrive_intact_after_dnat") else { return };
    for p in lab.backends.iter().chain([&lab.client]) {
        netns::sh(&["ip", "netns", "exec", &lab.node.name, "ethtool", "-K", &p.host_if, "tx", "off"]);
        netns::sh(&["ip", "netns", "exec", &p.ns.name, "ethtool", "-K", "eth0", "rx", "off"]);
    }
    let mut seen = BTreeMap::new();
    // 30 connections: all three backends answer but for a chance of 3 * (2/3)^30 (2e-5).
    for i in 0..30 {
        let stream =
            lab.client.ns.run(|| std::net::TcpStream::connect_timeout(&sock(WEB_VIP).into(), Duration::from_secs(2))).expect("connect");
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        stream.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
        // Large enough for segmentation offload too.
        let mut line = vec![b'x'; 256 * 1024];
        line.push(b'\n');
        (&stream).write_all(&line).unwrap_or_else(|e| panic!("connection {i}: sending 256 KiB: {e}"));
        let mut answer = String::new();
        std::io::BufReader::new(&stream).read_line(&mut answer).unwrap_or_else(|e| panic!("connection {i}: no answer after 256 KiB: {e}"));
        let backend = answer.split_whitespace().next().unwrap_or_default().to_string();
        *seen.entry(backend).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 3, "every backend answered: {seen:?}");
    for i in 0..10 {
        let (a, from) = udp_ask(&lab.client.ns, sock(DNS_VIP)).unwrap_or_else(|e| panic!("UDP query {i}: {e}"));
        assert!(a.backend.starts_with("backend-") && from == sock(DNS_VIP).into(), "{a:?} from {from}");
    }
    // And the flows were indeed handled in the partial form (bpftool shows the field by name).
    let path = lab.bpffs().join("maps").join(proxy_common::map_names::CT);
    let out = std::process::Command::new("bpftool").args(["-j", "map", "dump", "pinned"]).arg(&path).output().expect("bpftool");
    let dump: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool JSON");
    let partial = dump
        .as_array()
        .expect("entries")
        .iter()
        .filter(|e| e["formatted"]["value"]["l4_csum"] == u64::from(proxy_common::ct::l4_csum::PARTIAL))
        .count();
    // Forward and reply entries of the 30 TCP connections at least.
    assert!(partial >= 60, "the TCP flows and their replies were learned as partial-form: {partial} entries");
}

#[test]
fn a_vanished_interface_loses_its_pins() {
    let Some(mut lab) = lab("a_vanished_interface_loses_its_pins") else { return };
    lab.add_pod("short-lived", false);
    lab.wait_for("the new interface to be attached", |r| r.interfaces.values().any(|n| n == "vethx1"));
    let pod = lab.extra.pop().unwrap();
    drop(pod); // deletes its namespace, and with it the veth pair
    lab.wait_for("the pins of the deleted interface to go", |r| !r.interfaces.values().any(|n| n == "vethx1"));
}

#[test]
fn a_pod_reaching_its_own_service_gets_through_when_it_picks_itself() {
    let Some(lab) = lab("a_pod_reaching_its_own_service_gets_through_when_it_picks_itself") else { return };
    let me = &lab.backends[0];
    let mut seen = BTreeMap::new();
    for i in 0..60 {
        let a = tcp_ask(&me.ns, sock(WEB_VIP)).unwrap_or_else(|e| panic!("request {i} from {} to its own Service: {e}", me.name));
        seen.insert(a.backend.clone(), a.peer);
    }
    let own = seen.get(&me.name).unwrap_or_else(|| panic!("60 requests never picked the caller itself: {seen:?}"));
    assert_eq!(own.ip().to_string(), "169.254.42.1", "the pod sees the hairpin address, not itself");
    assert_eq!(seen[&"backend-2".to_string()].ip().to_string(), me.ip.to_string(), "other backends see the caller");
    let (a, from) = udp_ask(&me.ns, sock(DNS_VIP)).expect("UDP to its own Service");
    assert_eq!(from, sock(DNS_VIP).into());
    assert!(a.backend.starts_with("backend-"));
}

/// IPv6 sockets of host-network processes reach IPv4 Services through IPv4-mapped addresses
/// (`::ffff:10.96.0.10`, what a JVM passes for an IPv4 peer): the IPv6 socket hooks translate
/// TCP connects and unconnected UDP, and the socket reports the Service as its peer.
#[test]
fn host_ipv6_sockets_reach_ipv4_services_through_mapped_addresses() {
    let Some(lab) = lab("host_ipv6_sockets_reach_ipv4_services_through_mapped_addresses") else { return };
    if !require::cgroup2("host_ipv6_sockets_reach_ipv4_services_through_mapped_addresses", lab.cgroup.is_some()) {
        return;
    }
    let mapped = |vip: &str| {
        let v4 = sock(vip);
        format!("[::ffff:{}]:{}", v4.ip(), v4.port())
    };
    let mut backends = BTreeMap::new();
    for i in 0..10 {
        let out = lab.host_ask("tcp", &mapped(WEB_VIP));
        let f: Vec<&str> = out.split_whitespace().collect();
        assert!(f.len() == 4 && f[0] == "ok", "TCP connection {i} over an IPv6 socket: {out}\n{}", lab.agent_log());
        assert_eq!(f[3], mapped(WEB_VIP), "getpeername shows the Service (IPv4-mapped), not the backend");
        *backends.entry(f[1].to_string()).or_insert(0) += 1;
    }
    assert!(backends.len() >= 2, "spread over the backends: {backends:?}");
    for i in 0..5 {
        let out = lab.host_ask("udp", &mapped(DNS_VIP));
        let f: Vec<&str> = out.split_whitespace().collect();
        assert!(f.len() == 4 && f[0] == "ok", "UDP query {i} over an IPv6 socket: {out}");
        assert_eq!(f[3], mapped(DNS_VIP), "recvfrom shows the answer as coming from the Service");
    }
    assert_eq!(lab.host_ask("tcp", &mapped(EMPTY_VIP)), "err ConnectionRefused", "no endpoints: refused");
}

/// A host-network process (in the node's namespace, as a hostNetwork pod or a node daemon)
/// reaches Services as kube-proxy's OUTPUT chain lets it: the socket hooks send its TCP
/// connections and unconnected UDP datagrams to backends, and its socket reports the Service
/// as its peer.
#[test]
fn host_network_processes_reach_services_through_the_socket_hooks() {
    let Some(mut lab) = lab("host_network_processes_reach_services_through_the_socket_hooks") else { return };
    if !require::cgroup2("host_network_processes_reach_services_through_the_socket_hooks", lab.cgroup.is_some()) {
        return;
    }
    let mut backends = BTreeMap::new();
    for i in 0..15 {
        let out = lab.host_ask("tcp", WEB_VIP);
        let f: Vec<&str> = out.split_whitespace().collect();
        assert!(f.len() == 4 && f[0] == "ok", "TCP connection {i} from the node: {out}\n{}", lab.agent_log());
        assert_eq!(f[3], WEB_VIP, "getpeername shows the Service, not the backend");
        assert!(f[2].starts_with("10.244.0.") || f[2].starts_with("192.168.250.1:"), "the backend saw the node: {out}");
        *backends.entry(f[1].to_string()).or_insert(0) += 1;
    }
    assert!(backends.len() >= 2, "connections from the node are spread over the backends: {backends:?}");
    for i in 0..5 {
        let out = lab.host_ask("udp", DNS_VIP);
        let f: Vec<&str> = out.split_whitespace().collect();
        assert!(f.len() == 4 && f[0] == "ok", "UDP query {i} from the node: {out}");
        assert_eq!(f[3], DNS_VIP, "recvfrom shows the answer as coming from the Service");
    }
    // Without endpoints: refused at once, as kube-proxy's REJECT (the socket hook refuses the
    // connect() itself: no SYN is sent, let alone sent again).
    let resent = lab.node.tcp_ext("TCPSynRetrans");
    assert_eq!(lab.host_ask("tcp", EMPTY_VIP), "err ConnectionRefused");
    assert_eq!(lab.node.tcp_ext("TCPSynRetrans"), resent, "refused without a SYN sent again");
    // Load balancers with source ranges: the node gets through when a range holds its primary
    // IP (kube-proxy admits the load balancer's own address then), and is refused otherwise.
    // The node IP is the Node's InternalIP, as kube-proxy takes it.
    lab.write_manifest(
        "node.yaml",
        &format!("{}status:\n  addresses:\n  - {{type: InternalIP, address: 192.168.250.1}}\n", lab::node_manifest()),
    );
    let lb = |name: &str, cluster_ip: &str, node_port: u16, ip: &str, ranges: &str| {
        let spec = format!(
            "  type: LoadBalancer\n  clusterIP: {cluster_ip}\n  loadBalancerSourceRanges: [{ranges}]\n  ports:\n  - {{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: {node_port}}}\n"
        );
        let status = format!("  loadBalancer:\n    ingress:\n    - {{ip: {ip}}}\n");
        let slice = lab::endpoint_slice(name, &format!("{name}-1"), &lab.backend_ips(), &[("http", 8080, "TCP")]);
        format!("{}---\n{slice}", proxy_tests::cluster::service(name, &spec, Some(&status)))
    };
    lab.write_manifest("lb-open.yaml", &lb("lb-open", "10.96.0.71", 30071, "203.0.113.71", "192.168.250.0/24"));
    lab.write_manifest("lb-closed.yaml", &lb("lb-closed", "10.96.0.72", 30072, "203.0.113.72", "198.51.100.0/24"));
    lab.wait_programmed("203.0.113.72:80", "TCP", 3);
    lab.wait_programmed("203.0.113.71:80", "TCP", 3);
    let mut lb_backends = std::collections::BTreeSet::new();
    for _ in 0..12 {
        let out = lab.host_ask("tcp", "203.0.113.71:80");
        assert!(out.starts_with("ok ") && out.ends_with(" 203.0.113.71:80"), "a range holds the node: {out}");
        lb_backends.insert(out.split_whitespace().nth(1).unwrap_or("").to_string());
    }
    // A load balancer selects with Maglev, which hashes each socket apart.
    assert!(lb_backends.len() >= 2, "connections from the node to a load balancer spread: {lb_backends:?}");
    assert_eq!(lab.host_ask("tcp", "203.0.113.72:80"), "err PermissionDenied", "no range holds the node");
    let r = lab.inspect().unwrap();
    assert!(r.counters.get("drop_source_range").is_some_and(|c| c.packets >= 1), "{:?}", r.counters);
    assert!(r.counters.get("host_connect").is_some_and(|c| c.packets >= 20), "{:?}", r.counters);
    assert!(r.counters.get("host_reject").is_some_and(|c| c.packets >= 1), "{:?}", r.counters);
    // Pods are left to the packet path: nothing of theirs goes through the socket hooks.
    let before = r.counters.get("host_connect").map(|c| c.packets);
    tcp_ask(&lab.client.ns, sock(WEB_VIP)).expect("a pod's connection");
    assert_eq!(lab.inspect().unwrap().counters.get("host_connect").map(|c| c.packets), before);

    // The hooks are pinned: they serve while the agent is down, and a restarted agent replaces
    // them instead of adding a second set.
    let hooks = |lab: &Lab| {
        let cgroup = lab.cgroup.as_ref().unwrap().to_str().unwrap().to_string();
        netns::sh(&["bpftool", "cgroup", "show", &cgroup]).lines().filter(|l| l.contains("proxy_sock_")).count()
    };
    assert_eq!(hooks(&lab), 9, "connect, sendmsg, recvmsg, getpeername for each family, and release");
    assert_eq!(
        lab.inspect().unwrap().socket_hooks,
        ["connect4", "connect6", "getpeername4", "getpeername6", "recvmsg4", "recvmsg6", "release", "sendmsg4", "sendmsg6"],
        "inspect lists them"
    );
    lab.kill_agent();
    assert!(lab.host_ask("tcp", WEB_VIP).starts_with("ok "), "served with the agent down");
    lab.start_agent();
    lab.wait_log("socket hooks attached", 2);
    // An unpinned link is freed after an RCU grace period: give it a moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while hooks(&lab) != 9 && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(hooks(&lab), 9, "the restarted agent's hooks replaced the old ones");
    assert!(lab.host_ask("tcp", WEB_VIP).starts_with("ok "));
    // An unconnected UDP socket keeps its backend per Service, as conntrack keeps a flow's.
    let out = lab.host_ask("udp-many", DNS_VIP);
    assert!(
        out.starts_with("ok ") && out.split_whitespace().nth(1).is_some_and(|n| n.parse::<usize>() == Ok(1)),
        "one backend for one socket: {out}"
    );
    // --cgroup-root none takes the hooks away, a previous run's pinned ones too.
    lab.stop_agent();
    lab.start_agent_with_extra(&["--cgroup-root", "none"]);
    lab.wait_log("--cgroup-root none", 1);
    assert_eq!(hooks(&lab), 0, "no hooks left");
}

#[test]
fn with_every_default_inside_ip_netns_exec_the_agent_mounts_what_it_needs_and_says_pins_are_private() {
    let test = "with_every_default_inside_ip_netns_exec_the_agent_mounts_what_it_needs_and_says_pins_are_private";
    if !require::root(test) {
        return;
    }
    let cgroup = proxy_agent::dataplane::ebpf::hostsock::cgroup2_mount();
    let mut lab = Lab::new(AGENT, 3);
    lab.write_manifest("services.yaml", &standard_manifests(&lab.backend_ips()));
    let made_cgroup_dir = !std::path::Path::new(proxy_agent::dataplane::ebpf::hostsock::CGROUP2_DIR).exists();
    lab.start_agent_with_defaults_in_ip_netns_exec();
    // No --bpffs-root: /sys/fs/bpf there is a bare sysfs directory. The agent mounts a bpffs
    // and serves in eBPF mode (auto), instead of stopping or falling back to nftables.
    lab.wait_log("initial sync done", 1);
    let log = lab.agent_log();
    assert!(log.contains("the kernel runs the eBPF dataplane"), "auto chose eBPF:\n{log}");
    assert!(log.contains("private to this agent's mount namespace"), "the private pins are said loudly:\n{log}");
    // No cgroup v2 hierarchy there either: the agent mounts one for the socket hooks.
    assert!(log.contains("mounted one for the socket hooks"), "{log}");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let seen = loop {
        match tcp_ask(&lab.client.ns, sock(WEB_VIP)) {
            Ok(a) => break a,
            Err(e) if std::time::Instant::now() > deadline => panic!("the pod reaches the Service: {e}\n{}", lab.agent_log()),
            Err(_) => thread::sleep(Duration::from_millis(100)),
        }
    };
    assert!(seen.backend.starts_with("backend-"));
    // The hooks sit on the root of the one cgroup v2 hierarchy, so the lab's cgroup (seen
    // through the host's mount, where it has one for the lab's host clients) is served too.
    if require::cgroup2(&format!("{test}: its host-network part"), cgroup.is_some()) {
        let cgroup = cgroup.expect("a cgroup v2 mount");
        assert!(lab.cgroup.as_deref().is_some_and(|c| c.starts_with(&cgroup)));
        let out = lab.host_ask("tcp", WEB_VIP);
        assert!(out.starts_with("ok backend-"), "a host-network process reaches the Service: {out}\n{}", lab.agent_log());
    }
    lab.kill_agent();
    if made_cgroup_dir {
        // The mount went with the agent's namespace; the directory it made is ours to remove.
        let _ = std::fs::remove_dir(proxy_agent::dataplane::ebpf::hostsock::CGROUP2_DIR);
        let _ = std::fs::remove_dir("/run/proxy-agent");
    }
}

#[test]
fn link_loops_in_the_manifest_directory_wedge_nothing() {
    let Some(mut lab) = lab("link_loops_in_the_manifest_directory_wedge_nothing") else { return };
    for link in ["x", "y"] {
        std::os::unix::fs::symlink(".", lab.manifests().join(link)).unwrap();
    }
    // Changes are still programmed and the endpoints still answer.
    lab.write_manifest("more.yaml", &lab::service("more", "10.96.0.20", &[("http", 80, "TCP", lab::TCP_PORT)]));
    lab.wait_for("the Service added after the loops", |r| r.frontends.iter().any(|f| f.address == "10.96.0.20:80"));
    let (code, _) = proxy_tests::servers::http_get(&lab.node, "127.0.0.1:10249".parse().unwrap(), "/metrics").expect("/metrics answers");
    assert_eq!(code, 200);
    // Each link is named once, however often the directory is scanned.
    lab.write_manifest("more.yaml", &lab::service("more", "10.96.0.21", &[("http", 80, "TCP", lab::TCP_PORT)]));
    lab.wait_for("the change after that", |r| r.frontends.iter().any(|f| f.address == "10.96.0.21:80"));
    let log = lab.agent_log();
    assert_eq!(log.matches("links to directories are not followed").count(), 2, "{log}");
}

#[test]
fn idle_connections_from_a_pod_to_the_health_port_exhaust_nothing() {
    let test = "idle_connections_from_a_pod_to_the_health_port_exhaust_nothing";
    if !require::root(test) {
        return;
    }
    let mut lab = Lab::new(AGENT, 3);
    lab.write_manifest("services.yaml", &standard_manifests(&lab.backend_ips()));
    // The soft limit most hosts give a process; the agent lifts it to the hard one.
    lab.agent_limits.nofile = Some((1024, 8192));
    lab.start_agent();
    lab.wait_programmed(WEB_VIP, "TCP", 3);
    // 1,100 connections from a pod to the node's health port, opened and left idle.
    let idle: Vec<std::net::TcpStream> = lab.client.ns.run(|| {
        (0..1100)
            .filter_map(|_| std::net::TcpStream::connect_timeout(&"192.168.250.1:10256".parse().unwrap(), Duration::from_secs(2)).ok())
            .collect()
    });
    assert!(idle.len() > 1000, "the pod opened its connections: {}", idle.len());
    // Health and metrics still answer, and a change is still programmed.
    let get = |addr: &str, path: &str| proxy_tests::servers::http_get(&lab.node, addr.parse().unwrap(), path);
    assert_eq!(get("127.0.0.1:10256", "/healthz").expect("/healthz answers").0, 200);
    assert_eq!(get("127.0.0.1:10249", "/metrics").expect("/metrics answers").0, 200);
    lab.write_manifest("more.yaml", &lab::service("more", "10.96.0.20", &[("http", 80, "TCP", lab::TCP_PORT)]));
    lab.wait_for("a Service added meanwhile", |r| r.frontends.iter().any(|f| f.address == "10.96.0.20:80"));
    let log = lab.agent_log();
    assert_eq!(log.matches("closing the oldest").count(), 1, "the pressure is said once:\n{log}");
    drop(idle);
}

#[test]
fn health_check_node_ports_listen_where_node_ports_are_served() {
    let test = "health_check_node_ports_listen_where_node_ports_are_served";
    if !require::root(test) {
        return;
    }
    let lb = proxy_tests::cluster::service(
        "lb",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.30\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n",
        Some("  loadBalancer:\n    ingress:\n    - {ip: 203.0.113.30}\n"),
    );
    for (flags, loopback_answers) in [(vec![], true), (vec!["--nodeport-addresses", "192.168.250.1/32"], false)] {
        let mut lab = Lab::new(AGENT, 1);
        let slice = lab::endpoint_slice("lb", "lb-1", &lab.backend_ips(), &[("http", lab::TCP_PORT, "TCP")]);
        lab.write_manifest("lb.yaml", &format!("{lb}---\n{slice}---\n{}", lab::node_manifest()));
        lab.start_agent_with_extra(&flags);
        lab.wait_programmed("10.96.0.30:80", "TCP", 1);
        let get = |addr: &str| proxy_tests::servers::http_get(&lab.node, addr.parse().unwrap(), "/");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while get("192.168.250.1:32000").is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "{flags:?}: the health check answers on the NodePort address:\n{}",
                lab.agent_log()
            );
            thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(
            get("127.0.0.1:32000").is_ok(),
            loopback_answers,
            "{flags:?}: on 127.0.0.1 only when NodePorts are served on every address"
        );
    }
}

/// Two Services share a backend and a pod reuses one source port towards both (Linux allows
/// it: the destinations differ). At the backend both flows would be one tuple; the dataplane
/// moves the second flow's source port, as netfilter's NAT does on a clash, and both
/// connections (and both UDP flows) keep working.
#[test]
fn a_source_port_reused_towards_two_services_of_one_backend_keeps_both_connections() {
    let Some(mut lab) = lab("a_source_port_reused_towards_two_services_of_one_backend_keeps_both_connections") else { return };
    let one = &lab.backend_ips()[..1];
    let (tcp_a, tcp_b, udp_a, udp_b) = ("10.96.0.61:80", "10.96.0.62:80", "10.96.0.63:53", "10.96.0.64:53");
    let mut objects = Vec::new();
    for (name, vip, proto, port, target) in [
        ("same-a", tcp_a, "TCP", 80, lab::TCP_PORT),
        ("same-b", tcp_b, "TCP", 80, lab::TCP_PORT),
        ("same-c", udp_a, "UDP", 53, lab::UDP_PORT),
        ("same-d", udp_b, "UDP", 53, lab::UDP_PORT),
    ] {
        objects.push(lab::service(name, vip.split(':').next().unwrap(), &[("p", port, proto, target)]));
        objects.push(lab::endpoint_slice(name, &format!("{name}-1"), one, &[("p", target, proto)]));
    }
    lab.write_manifest("same-backend.yaml", &objects.join("---\n"));
    for (vip, proto) in [(tcp_a, "TCP"), (tcp_b, "TCP"), (udp_a, "UDP"), (udp_b, "UDP")] {
        lab.wait_programmed(vip, proto, 1);
    }
    let port = 41061;
    let mut a = Conn::open_from_port(&lab.client.ns, port, sock(tcp_a)).expect("first connection");
    let first = a.ask().expect("first connection answers");
    assert_eq!(first.peer, std::net::SocketAddr::from((lab.client.ip, port)), "the first flow keeps its port");
    let mut b = Conn::open_from_port(&lab.client.ns, port, sock(tcp_b)).expect("second connection from the same port");
    let second = b.ask().expect("second connection answers");
    assert_eq!(second.peer.ip(), std::net::IpAddr::V4(lab.client.ip));
    assert_ne!(second.peer.port(), port, "the backend sees the second flow on another port");
    for i in 0..5 {
        assert_eq!(
            a.ask().unwrap_or_else(|e| panic!("request {i} on the first connection: {e}")).peer,
            first.peer,
            "the first connection lives"
        );
        assert_eq!(b.ask().unwrap_or_else(|e| panic!("request {i} on the second connection: {e}")).peer, second.peer);
    }
    let (ua, ub) = (
        UdpFlow::open_from_port(&lab.client.ns, port, sock(udp_a)).expect("udp a"),
        UdpFlow::open_from_port(&lab.client.ns, port, sock(udp_b)).expect("udp b"),
    );
    let (fa, fb) = (ua.ask().expect("first UDP flow"), ub.ask().expect("second UDP flow"));
    assert_ne!(fa.peer, fb.peer, "the backend tells the two UDP flows apart");
    for i in 0..5 {
        assert_eq!(ua.ask().unwrap_or_else(|e| panic!("datagram {i} of the first UDP flow: {e}")).peer, fa.peer);
        assert_eq!(ub.ask().unwrap_or_else(|e| panic!("datagram {i} of the second UDP flow: {e}")).peer, fb.peer);
    }
    let ct = lab.inspect().unwrap();
    assert!(ct.counters.get("new_flow_port_nat").is_some_and(|c| c.packets >= 2), "moved ports are counted: {:?}", ct.counters);
}

/// The same from a host-network process, whose connections the socket hooks send straight to
/// a backend at connect time: there is no packet whose port could be moved, so the hooks move
/// the backend instead. Two connected sockets on one local port (SO_REUSEADDR), TCP and UDP,
/// and one unconnected socket asking two Services at once, reach different backends and each
/// gets its own answers. Where the Services share their only backend, the hooks leave the
/// second flow to TC, which moves its port (`host`): both connect and keep their answers, as
/// under kube-proxy's NAT.
#[test]
fn a_host_process_reusing_its_source_port_towards_two_services_of_one_backend_loses_nothing() {
    let Some(mut lab) = lab("a_host_process_reusing_its_source_port_towards_two_services_of_one_backend_loses_nothing") else { return };
    if !require::cgroup2("a_host_process_reusing_its_source_port_towards_two_services_of_one_backend_loses_nothing", lab.cgroup.is_some()) {
        return;
    }
    let ports = [("http", 80, "TCP", lab::TCP_PORT), ("dns", 53, "UDP", lab::UDP_PORT)];
    let slice_ports = [("http", lab::TCP_PORT, "TCP"), ("dns", lab::UDP_PORT, "UDP")];
    let mut objects = Vec::new();
    // host-a and host-b share their only backend; host-c and host-d share two.
    let (one, two) = (&lab.backend_ips()[..1], &lab.backend_ips()[1..3]);
    for (name, ip, backends) in
        [("host-a", "10.96.0.65", one), ("host-b", "10.96.0.66", one), ("host-c", "10.96.0.67", two), ("host-d", "10.96.0.68", two)]
    {
        objects.push(lab::service(name, ip, &ports));
        objects.push(lab::endpoint_slice(name, &format!("{name}-1"), backends, &slice_ports));
    }
    lab.write_manifest("host-same-backend.yaml", &objects.join("---\n"));
    for (vip, n) in [("10.96.0.65", 1), ("10.96.0.66", 1), ("10.96.0.67", 2), ("10.96.0.68", 2)] {
        lab.wait_programmed(&format!("{vip}:80"), "TCP", n);
        lab.wait_programmed(&format!("{vip}:53"), "UDP", n);
    }
    let counter = |lab: &Lab, name: &str| lab.inspect().unwrap().counters.get(name).map_or(0, |c| c.packets);

    // Two backends: every pair gets through, on two backends, and the first keeps answering.
    for round in 0..8 {
        for proto in ["tcp-same-port", "udp-same-port"] {
            let to = if proto == "tcp-same-port" { "10.96.0.67:80,10.96.0.68:80" } else { "10.96.0.67:53,10.96.0.68:53" };
            let out = lab.host_ask(proto, to);
            let f: Vec<&str> = out.split_whitespace().collect();
            let backend = |field: &str, key: &str| {
                field.strip_prefix(key).filter(|a| a.starts_with("backend-")).and_then(|a| a.split('/').next()).map(str::to_string)
            };
            let (first, second) = (backend(f[0], "first="), backend(f[1], "second="));
            assert!(
                f.len() == 4
                    && first.is_some()
                    && second.is_some()
                    && first != second
                    && f[2] == format!("first-again={}", &f[0]["first=".len()..]),
                "round {round}, {proto}: both connect, to two backends, and the first keeps its answers: {out}"
            );
        }
        let out = lab.host_ask("udp-two-services", "10.96.0.67:53,10.96.0.68:53");
        let f: Vec<&str> = out.split_whitespace().collect();
        assert!(
            f.len() == 2
                && f[0].starts_with("10.96.0.67:53=backend-")
                && f[1].starts_with("10.96.0.68:53=backend-")
                && f[0][14..] != f[1][14..],
            "round {round}: one unconnected socket asking two Services gets each answer from its Service: {out}"
        );
    }
    // Half the first picks land on the other socket's backend: 24 pairs, at least one moved.
    assert!(counter(&lab, "host_backend_moved") >= 1, "{:?}", lab.inspect().unwrap().counters);

    // One shared backend: no backend is left to move to, so the hooks leave the second
    // socket's flow to TC, which moves its port as netfilter's NAT would: both connect, each
    // keeps its own answers, and the backend sees the second on a port of the SNAT range. The
    // flow follows the node's route for the Service address, by the uplink, whose gateway a
    // node has resolved (the lab's answers no ARP: its neighbour is set by hand here).
    lab.node.ip(&["neigh", "replace", "192.168.250.254", "lladdr", "02:00:00:00:fa:fe", "dev", "uplink0", "nud", "permanent"]);
    let port_of = |answer: &str| answer.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    for (proto, to) in [("tcp-same-port", "10.96.0.65:80,10.96.0.66:80"), ("udp-same-port", "10.96.0.65:53,10.96.0.66:53")] {
        let out = lab.host_ask(proto, to);
        let f: Vec<&str> = out.split_whitespace().collect();
        assert!(
            f.len() == 4 && f[0].starts_with("first=backend-1/") && f[2] == format!("first-again={}", &f[0]["first=".len()..]),
            "{proto}: the first connection answers before and after: {out}\n{}",
            lab.agent_log()
        );
        assert!(f[1].starts_with("second=backend-1/"), "{proto}: the second connection answers too: {out}");
        let (first_port, second_port) = (port_of(f[0]), port_of(f[1]));
        assert!(
            second_port.is_some_and(|p| p >= 61000) && second_port != first_port,
            "{proto}: the backend sees the second flow on a moved port of the SNAT range: {out}"
        );
        if proto == "udp-same-port" {
            assert!(f[3].starts_with("after-close=backend-1/"), "the closed socket's tuple is free again: {out}");
        }
    }
    // One unconnected socket: each answer arrives from its own Service.
    let out = lab.host_ask("udp-two-services", "10.96.0.65:53,10.96.0.66:53");
    assert_eq!(out, "10.96.0.65:53=backend-1 10.96.0.66:53=backend-1", "each answer shows its Service");
    for name in ["host_shared_backend", "host_flow_new", "host_reply"] {
        assert!(counter(&lab, name) >= 1, "{name}: {:?}", lab.inspect().unwrap().counters);
    }
}

/// A restart storm under load: the agent killed (SIGKILL) 100 times, at random moments of its
/// start (loading, adopting pins, attaching, syncing) or after it has synced, while long-lived
/// TCP connections keep talking and new TCP connections and UDP queries keep coming. Not one is
/// lost, and the agent that finally stays up serves as before.
#[test]
fn a_hundred_kill_restarts_under_load_lose_no_connection() {
    let Some(mut lab) = lab("a_hundred_kill_restarts_under_load_lose_no_connection") else { return };
    let mut conns: Vec<(Conn, String)> = (0..8)
        .map(|i| {
            let mut c = Conn::open(&lab.client.ns, sock(WEB_VIP)).unwrap_or_else(|e| panic!("long-lived connection {i}: {e}"));
            let b = c.ask().expect("first answer").backend;
            (c, b)
        })
        .collect();
    let dns = UdpFlow::open(&lab.client.ns, sock(DNS_VIP)).expect("a resolver's flow");
    let resolver = dns.ask().expect("first query").backend;
    let mut seed = 0x2545_f491_u64;
    let (mut new_conns, mut queries) = (0, 0);
    for round in 0..100 {
        lab.kill_agent();
        lab.start_agent();
        // Somewhere in the first 400 ms of the start, or after the initial sync.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        if round % 10 == 9 {
            lab.wait_log("initial sync done", round / 10 + 1);
        } else {
            thread::sleep(Duration::from_millis(seed % 400));
        }
        for (i, (c, backend)) in conns.iter_mut().enumerate() {
            let a = c.ask().unwrap_or_else(|e| panic!("round {round}: long-lived connection {i}: {e}\n{}", lab.agent_log()));
            assert_eq!(&a.backend, backend, "round {round}: connection {i} keeps its backend");
        }
        tcp_ask(&lab.client.ns, sock(WEB_VIP)).unwrap_or_else(|e| panic!("round {round}: a new connection: {e}\n{}", lab.agent_log()));
        assert_eq!(dns.ask().unwrap_or_else(|e| panic!("round {round}: the resolver's flow: {e}")).backend, resolver);
        udp_ask(&lab.client.ns, sock(DNS_VIP)).unwrap_or_else(|e| panic!("round {round}: a new UDP query: {e}"));
        new_conns += 1;
        queries += 2;
    }
    lab.kill_agent();
    lab.start_agent();
    lab.wait_log("initial sync done", 11);
    lab.wait_for("the last agent to attach", |r| r.interfaces.len() == 4 && r.frontends.len() == 3);
    assert_eq!(counts(&lab, 30).len(), 3, "new connections spread over every backend after the storm");
    for (i, (c, backend)) in conns.iter_mut().enumerate() {
        assert_eq!(&c.ask().unwrap_or_else(|e| panic!("after the storm, connection {i}: {e}")).backend, backend);
    }
    println!("100 kill -9 restarts: 8 long-lived connections and a resolver flow kept, {new_conns} new connections and {queries} queries answered");
}

/// `--proxy-mode auto` does not trade an attached eBPF dataplane for nftables: a restart that
/// cannot run eBPF (here the DaemonSet lost CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN) stops with
/// the reason, and the pinned programs go on carrying the open connections and new ones. On a
/// node with nothing pinned, the same start falls back to nftables as before.
#[test]
fn auto_mode_keeps_an_attached_ebpf_dataplane_when_ebpf_cannot_load() {
    let test = "auto_mode_keeps_an_attached_ebpf_dataplane_when_ebpf_cannot_load";
    let Some(mut lab) = lab(test) else { return };
    let mut conn = Conn::open(&lab.client.ns, sock(WEB_VIP)).expect("a long-lived connection");
    let backend = conn.ask().expect("first answer").backend;
    lab.stop_agent();
    // CAP_BPF 39, CAP_PERFMON 38, CAP_SYS_ADMIN 21.
    lab.agent_limits.drop_caps = vec![39, 38, 21];
    lab.start_agent();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while lab.agent_running() {
        assert!(std::time::Instant::now() < deadline, "the agent should stop:\n{}", lab.agent_log());
        thread::sleep(Duration::from_millis(100));
    }
    let log = lab.agent_log();
    assert!(log.contains("missing CAP_BPF, CAP_PERFMON") && log.contains("still attached"), "the reason is said:\n{log}");
    assert!(!log.contains("falling back") && !log.contains("pinned objects under"), "nothing is removed:\n{log}");
    assert!(!std::process::Command::new("ip")
        .args(["netns", "exec", &lab.node.name, "nft", "list", "table", "ip", "kube-proxy"])
        .output()
        .unwrap()
        .status
        .success());
    assert_eq!(conn.ask().expect("the open connection goes on").backend, backend);
    assert_eq!(counts(&lab, 30).len(), 3, "new connections are served by the attached programs");
    // With the privileges back, the next start adopts everything and rewrites nothing.
    lab.agent_limits.drop_caps.clear();
    lab.stop_agent();
    lab.start_agent();
    lab.wait_log("initial sync done", 2);
    assert!(lab.agent_log().contains("unchanged=3"), "{}", lab.agent_log());
    assert_eq!(conn.ask().expect("the open connection after the restart").backend, backend);

    // Nothing pinned: auto falls back to nftables, as before.
    let mut bare = Lab::new(AGENT, 3);
    bare.write_manifest("services.yaml", &standard_manifests(&bare.backend_ips()));
    bare.agent_limits.drop_caps = vec![39, 38, 21];
    bare.start_agent();
    bare.wait_log("proxy mode auto: nf_tables and nft are available", 1);
    wait_served(&bare, "nftables mode should serve");
}

/// `auto` on a dual-stack cluster (an IPv6 range in --cluster-cidr) takes the eBPF dataplane,
/// which serves both families, and sizes the IPv6 tables like the IPv4 ones (elsewhere they
/// are small: an LRU map is allocated whole).
#[test]
fn auto_mode_takes_ebpf_on_a_dual_stack_cluster_with_full_size_ipv6_tables() {
    let Some(mut lab) = lab("auto_mode_takes_ebpf_on_a_dual_stack_cluster_with_full_size_ipv6_tables") else { return };
    let size = |lab: &Lab, name: &str| {
        aya::maps::MapInfo::from_pin(lab.bpffs().join("maps").join(name)).map(|i| i.max_entries()).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let ct = size(&lab, proxy_common::map_names::CT);
    assert_eq!(
        size(&lab, proxy_common::map_names::CT6),
        proxy_agent::dataplane::ebpf::loader::IPV6_LRU_MAX_SMALL.min(ct),
        "IPv4 only: small"
    );
    lab.stop_agent();
    lab.start_agent_with_extra(&["--cluster-cidr", "10.244.0.0/16,fd00:244::/64"]);
    lab.wait_log("initial sync done", 2);
    let log = lab.agent_log();
    assert!(log.contains("proxy mode auto: the kernel runs the eBPF dataplane"), "{log}");
    assert_eq!(size(&lab, proxy_common::map_names::CT6), ct, "dual-stack: the IPv6 conntrack table is the IPv4 one's size");
    assert_eq!(size(&lab, proxy_common::map_names::SOCK6_REVNAT), proxy_common::limits::SOCK_REVNAT_MAX);
    assert_eq!(counts(&lab, 30).len(), 3, "IPv4 Services are served");
}

/// Upgrading over an older build's pins: its program array had fewer slots (the build before
/// IPv6 north-south had three), which this build replaces instead of failing to load, while
/// the older programs still attached keep theirs until the links move on; the Services go on
/// serving, a connection open across the restart included.
#[test]
fn an_older_builds_smaller_program_array_is_replaced_and_connections_survive() {
    let Some(mut lab) = lab("an_older_builds_smaller_program_array_is_replaced_and_connections_survive") else { return };
    let mut conn = Conn::open(&lab.client.ns, sock(WEB_VIP)).expect("a long-lived connection");
    let backend = conn.ask().expect("first answer").backend;
    lab.stop_agent();
    let pin = lab.bpffs().join("maps").join(proxy_common::map_names::PROGS);
    std::fs::remove_file(&pin).expect("remove this build's program array pin");
    let path = pin.to_str().unwrap();
    netns::sh(&["bpftool", "map", "create", path, "type", "prog_array", "key", "4", "value", "4", "entries", "3", "name", "PROGS_V1"]);
    lab.start_agent();
    lab.wait_log("initial sync done", 2);
    assert!(lab.agent_log().contains("replacing the program array of an older build"), "{}", lab.agent_log());
    let slots = aya::maps::MapInfo::from_pin(&pin).expect("the new program array is pinned").max_entries();
    assert_eq!(slots, proxy_common::prog_slots::COUNT);
    assert_eq!(conn.ask().expect("the open connection goes on").backend, backend);
    assert_eq!(counts(&lab, 30).len(), 3, "new connections are served");
}

/// Pins of a build before the frontend and conntrack filters (its maps without them): the
/// restarted agent creates the frontend filter and sets the bit of every frontend it adopts
/// before its programs replace the old ones, so new connections are served without a rewrite
/// of the Services. (Had it not, the new programs would take every Service address for none
/// and pass its packets.) The conntrack filter is created with every bit set, since the
/// tracked connections have none, and the agent's first rebuild, once its programs are
/// attached, keeps the bits of the open connection and drops the rest.
#[test]
fn an_older_builds_pins_get_the_filters_filled_before_the_programs_serve() {
    let Some(mut lab) = lab("an_older_builds_pins_get_the_filters_filled_before_the_programs_serve") else { return };
    let mut conn = Conn::open(&lab.client.ns, sock(WEB_VIP)).expect("a long-lived connection");
    let backend = conn.ask().expect("first answer").backend;
    lab.stop_agent();
    use proxy_common::map_names::{CT_FILTER, CT_FILTER6, FILTER, FILTER6};
    for name in [FILTER, FILTER6, CT_FILTER, CT_FILTER6] {
        std::fs::remove_file(lab.bpffs().join("maps").join(name)).expect("remove this build's filter pin");
    }
    lab.start_agent();
    lab.wait_log("initial sync done", 2);
    let log = lab.agent_log();
    let second_run = &log[log.rfind("dataplane loaded").unwrap()..];
    assert!(second_run.contains("programmed=0"), "the Services are adopted, not written again:\n{second_run}");
    assert_eq!(conn.ask().expect("the open connection goes on").backend, backend);
    // The first rebuild: the gauge of the filter's bits leaves 0 (it is not set before).
    let bits = || metric(&lab, "proxy_agent_map_entries{map=\"conntrack_filter\"}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let rebuilt = loop {
        match bits() {
            Some(n) if n > 0 => break n,
            _ if std::time::Instant::now() > deadline => panic!("no rebuild of the conntrack filter in 30 s:\n{}", lab.agent_log()),
            _ => std::thread::sleep(std::time::Duration::from_millis(200)),
        }
    };
    assert!(rebuilt < 1000, "the rebuild dropped the bits set for want of knowing: {rebuilt} left");
    assert_eq!(conn.ask().expect("the open connection goes on after the rebuild").backend, backend);
    assert_eq!(counts(&lab, 30).len(), 3, "new connections are served");
    assert!(tcp_ask(&lab.client.ns, sock(WEB_VIP)).is_ok());
}

/// A restart that no longer serves an interface leaves the previous run's links on it attached
/// (here: `--pod-devices` narrowed). Their programs are this build's, which set their flows'
/// conntrack filter bits, so they do not hold the agent's rebuilds back (an older build's
/// would: `--test packets a_link_whose_program_sets_no_bits`): the filter is rebuilt, and the
/// connections are served throughout.
#[test]
fn links_of_this_build_a_restart_leaves_behind_do_not_hold_the_conntrack_filter_back() {
    let Some(mut lab) = lab("links_of_this_build_a_restart_leaves_behind_do_not_hold_the_conntrack_filter_back") else { return };
    lab.add_pod("extra", false);
    lab.wait_for("the extra pod's interface to be attached", |r| r.interfaces.values().any(|n| n == "vethx1"));
    let mut conn = Conn::open(&lab.client.ns, sock(WEB_VIP)).expect("a long-lived connection");
    let backend = conn.ask().expect("first answer").backend;
    lab.stop_agent();
    lab.start_agent_with_extra(&["--pod-devices", "vethc,vethb*"]);
    lab.wait_log("initial sync done", 2);
    let links = std::fs::read_dir(lab.bpffs().join("links")).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned());
    assert!(links.into_iter().any(|n| n.ends_with("_vethx1")), "the previous run's links on vethx1 stay");
    // A rebuild: the gauge of the filter's bits leaves 0 (it is not set before one).
    let bits = || metric(&lab, "proxy_agent_map_entries{map=\"conntrack_filter\"}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while bits().unwrap_or(0) == 0 {
        assert!(std::time::Instant::now() < deadline, "no rebuild of the conntrack filter in 30 s:\n{}", lab.agent_log());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert!(!lab.agent_log().contains("not rebuilding the conntrack filters"), "{}", lab.agent_log());
    assert_eq!(conn.ask().expect("the open connection goes on after the rebuild").backend, backend);
    assert_eq!(counts(&lab, 30).len(), 3, "new connections are served");
}

/// The agent removes flows past their lifetime from the conntrack maps in its 15 s upkeep
/// round (`ct_gc`), with their reply entries: with kube-proxy's UDP conntrack timeouts at 1 s,
/// answered UDP flows are gone a round after their lifetime and the margin, and counted in the
/// metrics; the Service goes on answering.
#[test]
fn the_agent_removes_expired_flows_from_the_conntrack_map() {
    let timeouts = ["--conntrack-udp-timeout", "1s", "--conntrack-udp-timeout-stream", "1s"];
    let Some(mut lab) = lab_with("the_agent_removes_expired_flows_from_the_conntrack_map", &timeouts) else { return };
    lab.wait_programmed(DNS_VIP, "UDP", 3);
    let removed = || metric(&lab, "proxy_agent_conntrack_expired_flows_removed_total{family=\"ipv4\"}");
    let before = removed().unwrap_or(0);
    for i in 0..5 {
        udp_ask(&lab.client.ns, sock(DNS_VIP)).unwrap_or_else(|e| panic!("UDP query {i}: {e}"));
    }
    let ct = aya::maps::MapData::from_pin(lab.bpffs().join("maps").join(proxy_common::map_names::CT)).expect("the pinned conntrack map");
    let entries = || {
        proxy_agent::dataplane::ebpf::batch::count_entries(
            std::os::fd::AsFd::as_fd(ct.fd()),
            size_of::<proxy_common::CtKey>(),
            size_of::<proxy_common::CtEntry>(),
        )
        .unwrap()
    };
    // Five flows, each with its reply entry (fewer if two queries happened on one port).
    let flows = entries() / 2;
    assert!(flows >= 4, "the flows and their reply entries tracked: {}", entries());
    // 1 s of lifetime, 5 s of margin, and up to a round of 15 s.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(45);
    while removed().unwrap_or(0) < before + flows {
        assert!(std::time::Instant::now() < deadline, "the flows were not removed in 45 s ({:?}):\n{}", removed(), lab.agent_log());
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    assert_eq!(entries(), 0, "the flows and their reply entries are gone");
    // And their filter bits, with the rebuild that follows the removal in the same round.
    let bits = || metric(&lab, "proxy_agent_map_entries{map=\"conntrack_filter\"}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while bits() != Some(0) {
        assert!(std::time::Instant::now() < deadline, "the filter keeps {:?} bits", bits());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let (_, from) = udp_ask(&lab.client.ns, sock(DNS_VIP)).expect("the Service answers after");
    assert_eq!(from, sock(DNS_VIP).into());
}

#[test]
fn the_malformed_manifest_corpus_is_named_once_and_breaks_nothing() {
    let test = "the_malformed_manifest_corpus_is_named_once_and_breaks_nothing";
    if !require::root(test) {
        return;
    }
    let mut lab = Lab::new(AGENT, 3);
    // Info, as nodes run it: the log volume checked below is what an operator would get.
    lab.agent_log_level = "info";
    // An address of the node's own, for the corpus's Service that claims it as cluster IP.
    lab.node.ip(&["addr", "add", "10.250.0.1/32", "dev", "lo"]);
    // First by name: the corpus's invalid copies of `web` and `web-1` come later and win, as
    // with `kubectl apply -f dir`; being invalid, they must leave the last good versions.
    lab.write_manifest("a-services.yaml", &standard_manifests(&lab.backend_ips()));
    lab.start_agent_with_extra(&["--config-sync-period", "1s"]);
    lab.wait_programmed(WEB_VIP, "TCP", 3);
    lab.wait_programmed(DNS_VIP, "UDP", 3);

    let corpus = proxy_tests::corpus::malformed("10.250.0.1");
    assert!(corpus.len() >= 236, "the corpus has {} files", corpus.len());
    for c in &corpus {
        let path = lab.manifests().join(&c.file);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &c.content).unwrap();
    }
    // Files that would block a reader or never end: a pipe, a link to a device.
    let fifo = lab.manifests().join("corpus-fifo.yaml");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    std::os::unix::fs::symlink("/dev/zero", lab.manifests().join("corpus-zero.yaml")).unwrap();
    let mut needles: Vec<&str> = corpus.iter().filter_map(|c| c.needle.as_deref()).collect();
    needles.extend(["corpus-fifo.yaml: is not a regular file", "corpus-zero.yaml: is not a regular file"]);
    // Every problem is named: the file for what cannot be read, the object for what is refused.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let missing = loop {
        let log = lab.agent_log();
        let missing: Vec<&str> = needles.iter().copied().filter(|n| !log.contains(n)).collect();
        if missing.is_empty() || std::time::Instant::now() > deadline {
            break missing;
        }
        assert!(lab.agent_running(), "the agent exited:\n{log}");
        thread::sleep(Duration::from_millis(200));
    };
    let log = lab.agent_log();
    assert!(missing.is_empty(), "not named in the log after 60 s: {missing:?}\n\nlog:\n{log}");
    assert!(log.contains("a-services.yaml: Service default/web: is defined again in"), "the shadowed copy is named:\n{log}");
    assert!(log.lines().all(|l| l.len() < 4096), "a log line quotes too much");

    // The standard Services are untouched: the same three backends, nothing the corpus's slices
    // for `web` claimed.
    let seen = counts(&lab, 30);
    assert_eq!(seen.len(), 3, "web's backends: {seen:?}");
    assert!(seen.keys().all(|b| b.starts_with("backend-")), "{seen:?}");
    assert!(udp_ask(&lab.client.ns, sock(DNS_VIP)).is_ok(), "dns answers");
    let refused = tcp_ask(&lab.client.ns, sock(EMPTY_VIP)).expect_err("the Service without endpoints refuses");
    assert_eq!(refused.kind(), ErrorKind::ConnectionRefused);
    let report = lab.inspect().expect("inspect");
    let web = report.frontends.iter().find(|f| f.address == WEB_VIP).expect("web programmed");
    assert_eq!(web.backends.len(), 3, "{web:?}");
    // Nothing the API server would refuse was programmed: no frontend beyond the standard ones.
    let programmed: std::collections::BTreeSet<&str> = report.frontends.iter().map(|f| f.address.as_str()).collect();
    assert_eq!(programmed, [WEB_VIP, DNS_VIP, EMPTY_VIP].into_iter().collect(), "{}", proxy_agent::inspect::render(&report));
    let (code, _) = proxy_tests::servers::http_get(&lab.node, "127.0.0.1:10256".parse().unwrap(), "/healthz").expect("/healthz answers");
    assert_eq!(code, 200, "/healthz");
    let pid = lab.agent_pid().unwrap();
    let rss = lab::rss_mib(pid);
    assert!(rss < 256, "the agent holds {rss} MiB after the corpus");

    // Rescans (one a second, and one per change) name nothing again, and changes still flow.
    let before = lab.agent_log().len();
    thread::sleep(Duration::from_secs(4));
    lab.write_manifest("later.yaml", &lab::service("later", "10.96.0.20", &[("http", 80, "TCP", lab::TCP_PORT)]));
    lab.wait_for("a Service added after the corpus", |r| r.frontends.iter().any(|f| f.address == "10.96.0.20:80"));
    thread::sleep(Duration::from_secs(2));
    let log = lab.agent_log();
    let since = &log[before..];
    let repeated: Vec<&str> = needles.iter().copied().filter(|n| since.contains(n)).collect();
    assert!(repeated.is_empty(), "named again on a rescan: {repeated:?}\n{since}");
    assert!(since.lines().count() < 20, "log lines over 6 s of rescans with the corpus present:\n{since}");

    // Removing the corpus clears its problems, once each, and leaves the Services as they were.
    for c in &corpus {
        let _ = std::fs::remove_file(lab.manifests().join(&c.file));
    }
    let _ = std::fs::remove_dir_all(lab.manifests().join("corpus-deep"));
    let _ = std::fs::remove_file(&fifo);
    let _ = std::fs::remove_file(lab.manifests().join("corpus-zero.yaml"));
    let files = needles.iter().filter(|n| n.starts_with("corpus-")).count();
    lab.wait_log("manifest problem cleared", files);
    thread::sleep(Duration::from_secs(2));
    assert_eq!(counts(&lab, 30).len(), 3, "web keeps its three backends");
    assert!(lab.agent_running());
    eprintln!("{test}: {} files, agent at {rss} MiB with them", corpus.len());
}

/// NodePorts on 127.0.0.1 for the node's own processes (kube-proxy's `localhostNodePorts`,
/// on by default), served by the socket hooks; off with `--iptables-localhost-nodeports=false`.
#[test]
fn host_processes_reach_node_ports_on_localhost_unless_told_not_to() {
    let test = "host_processes_reach_node_ports_on_localhost_unless_told_not_to";
    if !require::root(test) {
        return;
    }
    let mut lab = Lab::new(AGENT, 3);
    if !require::cgroup2(test, lab.cgroup.is_some()) {
        return;
    }
    let np = lab::service("np", "10.96.0.30", &[("http", 80, "TCP", lab::TCP_PORT)])
        .replace("type: ClusterIP", "type: NodePort")
        .replace(&format!("targetPort: {}\n", lab::TCP_PORT), &format!("targetPort: {}\n    nodePort: 30080\n", lab::TCP_PORT));
    let slice = lab::endpoint_slice("np", "np-1", &lab.backend_ips(), &[("http", lab::TCP_PORT, "TCP")]);
    lab.write_manifest("np.yaml", &[np, slice].join("---\n"));
    lab.start_agent();
    lab.wait_programmed("127.0.0.1:30080", "TCP", 3);
    for i in 0..5 {
        let out = lab.host_ask("tcp", "127.0.0.1:30080");
        let f: Vec<&str> = out.split_whitespace().collect();
        assert!(
            f.len() == 4 && f[0] == "ok" && f[1].starts_with("backend-"),
            "connection {i} to 127.0.0.1:30080: {out}\n{}",
            lab.agent_log()
        );
        assert_eq!(f[3], "127.0.0.1:30080", "getpeername shows the NodePort");
    }
    lab.stop_agent();
    lab.start_agent_with_extra(&["--iptables-localhost-nodeports=false"]);
    lab.wait_for("the localhost NodePort to go", |r| !r.frontends.iter().any(|f| f.address == "127.0.0.1:30080"));
    assert_eq!(lab.host_ask("tcp", "127.0.0.1:30080"), "err ConnectionRefused", "nothing listens there on the node");
}

/// Pinned maps keep the size they were made with: a restart asking for another size says so,
/// and the map-fill figures (and the ids handed out) follow the kernel's size, not the flag.
#[test]
fn a_restart_with_another_map_size_keeps_the_pinned_size_and_says_so() {
    let Some(mut lab) = lab_with("a_restart_with_another_map_size_keeps_the_pinned_size_and_says_so", &["--lb-map-max", "1024"]) else {
        return;
    };
    lab.wait_programmed(WEB_VIP, "TCP", 3);
    lab.stop_agent();
    lab.start_agent_with_extra(&["--lb-map-max", "4096"]);
    lab.wait_log("--lb-map-max 4096 differs from the 1024 entries", 1);
    lab.wait_log("initial sync done", 2);
    let log = lab.agent_log();
    assert!(!log.contains("cannot load"), "the pinned maps are adopted, not given up:\n{log}");
    assert!(log.contains("unchanged=3"), "the restart rewrites nothing:\n{log}");
    let metrics = metrics_server(&lab, "/metrics");
    assert!(metrics.contains("proxy_agent_map_capacity{map=\"services\"} 1024"), "{metrics}");
    // Each family's maps have gauges of their own; without IPv6 ranges its conntrack is small.
    assert!(metrics.contains("proxy_agent_map_capacity{map=\"services_ipv6\"} 1024"), "{metrics}");
    assert!(metrics.contains("proxy_agent_map_capacity{map=\"conntrack_ipv6\"} 4096"), "{metrics}");
    assert_eq!(counts(&lab, 30).len(), 3);
}

/// A cluster IP the node holds itself (NodeLocal DNSCache binds kube-dns's on a dummy
/// interface; its Service is refused, the address is the node's) stays reachable with a
/// ServiceCIDR around it: the free-address drop applies only to what would leave the node.
#[test]
fn an_address_of_a_service_cidr_the_node_holds_still_reaches_the_node() {
    let test = "an_address_of_a_service_cidr_the_node_holds_still_reaches_the_node";
    if !require::root(test) {
        return;
    }
    let mut lab = Lab::new(AGENT, 3);
    lab.node.ip(&["addr", "add", "10.96.0.200/32", "dev", "lo"]);
    let _local = proxy_tests::servers::Backend::start(&lab.node, "node-local", 8053, 8054);
    let mut manifests = standard_manifests(&lab.backend_ips());
    manifests +=
        "---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16]}\n---\n";
    manifests += &lab::service("local-dns", "10.96.0.200", &[("dns", 8053, "TCP", 8053)]);
    lab.write_manifest("services.yaml", &manifests);
    lab.start_agent();
    lab.wait_programmed(WEB_VIP, "TCP", 3);
    lab.wait_log("one of this node's own addresses", 1);
    let a = tcp_ask(&lab.client.ns, sock("10.96.0.200:8053")).expect("the node's own listener answers");
    assert_eq!(a.backend, "node-local");
    // A free address of the range is still dropped (it would leave by the default route; the
    // uplink's far end answers no ARP here, so its gateway gets a neighbour entry, as on a node).
    lab.node.ip(&["neigh", "replace", "192.168.250.254", "lladdr", "02:00:00:00:00:fe", "dev", "uplink0", "nud", "permanent"]);
    assert!(tcp_ask(&lab.client.ns, sock("10.96.0.201:8053")).is_err());
    assert!(lab.inspect().unwrap().counters.get("drop_unallocated_cluster_ip").is_some_and(|c| c.packets >= 1));
}

/// An external interface masquerades north-south flows with an address the kernel would pick
/// as a source itself: not an IPv4 secondary nor a deprecated IPv6 address, even when one is
/// numerically first, and it follows the flags as they change (a primary deleted, its
/// secondary promoted; an address deprecated). When the interface goes, so do its SNAT
/// addresses (its index may come back as another interface). The interface is a veth pair of the lab node's own namespace
/// with nothing on the far end, as a second NIC would be.
#[test]
fn an_external_interfaces_snat_addresses_are_usable_ones_and_go_with_it() {
    let Some(mut lab) = lab("an_external_interfaces_snat_addresses_are_usable_ones_and_go_with_it") else { return };
    use proxy_common::{map_names, IfAddr, Ip6};
    lab.node.ip(&["link", "add", "extsn0", "type", "veth", "peer", "name", "extsn1"]);
    lab.node.ip(&["addr", "add", "192.0.2.9/24", "dev", "extsn0"]);
    // Same subnet: a secondary address, numerically before the primary.
    lab.node.ip(&["addr", "add", "192.0.2.3/24", "dev", "extsn0"]);
    // Deprecated (preferred lifetime 0), numerically before the usable one.
    lab.node.ip(&["-6", "addr", "add", "2001:db8:9::1/64", "dev", "extsn0", "nodad", "preferred_lft", "0"]);
    lab.node.ip(&["-6", "addr", "add", "2001:db8:9::9/64", "dev", "extsn0", "nodad"]);
    lab.node.ip(&["link", "set", "extsn0", "up"]);
    lab.node.ip(&["link", "set", "extsn1", "up"]);
    let r = lab.wait_for("the new external interface to be attached", |r| r.external_interfaces.values().any(|e| e.name == "extsn0"));
    let index = *r.external_interfaces.iter().find(|(_, e)| e.name == "extsn0").unwrap().0;
    let maps = lab.bpffs().join("maps");
    let v4 = || -> Option<[u8; 4]> {
        let map = aya::maps::MapData::from_pin(maps.join(map_names::IFADDRS)).expect("the IPv4 interface-address map");
        let m: aya::maps::HashMap<_, u32, IfAddr> = aya::maps::HashMap::try_from(aya::maps::Map::HashMap(map)).expect("a hash map");
        m.get(&index, 0).ok().map(|a| a.addr)
    };
    let v6 = || -> Option<std::net::Ipv6Addr> {
        let map = aya::maps::MapData::from_pin(maps.join(map_names::IFADDRS6)).expect("the IPv6 interface-address map");
        let m: aya::maps::HashMap<_, u32, IfAddr<Ip6>> = aya::maps::HashMap::try_from(aya::maps::Map::HashMap(map)).expect("a hash map");
        m.get(&index, 0).ok().map(|a| std::net::Ipv6Addr::from(a.addr.to_bytes()))
    };
    let log = lab.log_path();
    let until = |what: &str, f: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            let agent_log = std::fs::read_to_string(&log).unwrap_or_default();
            assert!(std::time::Instant::now() < deadline, "{what}: IPv4 {:?}, IPv6 {:?}\n{agent_log}", v4(), v6());
            thread::sleep(Duration::from_millis(100));
        }
    };
    until("the primary IPv4 and the usable IPv6 address as SNAT sources", &|| {
        v4() == Some([192, 0, 2, 9]) && v6() == Some("2001:db8:9::9".parse().unwrap())
    });
    // Flags change at run time: the usable IPv6 address is deprecated too (both are then
    // fallbacks: the first serves), and the IPv4 primary goes with secondaries promoted.
    lab.node.ip(&["-6", "addr", "change", "2001:db8:9::9/64", "dev", "extsn0", "preferred_lft", "0"]);
    lab.node.sysctl("net.ipv4.conf.extsn0.promote_secondaries", "1");
    lab.node.ip(&["addr", "del", "192.0.2.9/24", "dev", "extsn0"]);
    until("the promoted IPv4 address, and the first of two deprecated IPv6 ones", &|| {
        v4() == Some([192, 0, 2, 3]) && v6() == Some("2001:db8:9::1".parse().unwrap())
    });
    lab.node.ip(&["link", "del", "extsn0"]);
    lab.wait_for("the interface to be detached", |r| !r.external_interfaces.values().any(|e| e.name == "extsn0"));
    until("no SNAT address left for the vanished interface", &|| v4().is_none() && v6().is_none());
}

/// The nftables mode's full write of a large table that exists (an agent restart, the hourly
/// resync, the sync after a failed one) goes in steps over the table in place, never in one
/// transaction (one of 10,000 Services took 82 s: nothing else was programmed meanwhile), and
/// repairs what someone changed; the steps are one per sync, so changes made meanwhile are
/// written between them (the control loop is not held for the whole write). Through the mode
/// itself, in a namespace of the test's own: 2,500 Services (ClusterIP ones with two
/// endpoints; every tenth a LoadBalancer of externalTrafficPolicy Local with ClientIP
/// affinity) are built from nothing (in steps as well, with changes between them), the table
/// drifts, and a restarted proxier writes 1,500 of them again, with two Services deleted and a LoadBalancer one created while it was down (new chains that others
/// jump to: they must exist before those rules), and three changes between two of its steps.
/// Last, a build from nothing whose fixed part changes between steps, and then a change to
/// every Service at once, written 1,000 Services a sync.
#[test]
fn nftables_rewrites_a_large_table_in_place_in_steps_and_repairs_drift() {
    if !require::root("nftables_rewrites_a_large_table_in_place_in_steps_and_repairs_drift") {
        return;
    }
    use proxy_agent::{
        dataplane::{netfilter::proxier::NetfilterProxier, ProxyMode},
        model::store::{Event, Kind, Object},
    };
    let vip = |i: u32| std::net::Ipv4Addr::from(0x0a60_0000 + i + 1);
    let moved = |i: u32| std::net::Ipv4Addr::from(0x0a90_0000 + i);
    let objects = move |n: std::ops::Range<u32>, skip: &[u32]| -> (Vec<Object>, Vec<Object>) {
        let (mut services, mut slices) = (Vec::new(), Vec::new());
        for i in n.filter(|i| !skip.contains(i)) {
            let name = format!("svc-{i}");
            let mut svc = lab::service(&name, &vip(i).to_string(), &[("http", 80, "TCP", 8080)]);
            if i % 10 == 0 {
                svc = svc
                    .replace("  type: ClusterIP\n", "  type: LoadBalancer\n  externalTrafficPolicy: Local\n  sessionAffinity: ClientIP\n");
                svc = svc.replace("    targetPort: 8080\n", &format!("    targetPort: 8080\n    nodePort: {}\n", 30000 + i));
                svc += &format!("status:\n  loadBalancer:\n    ingress:\n    - ip: 203.0.{}.{}\n", i / 250, i % 250 + 1);
            }
            services.push(Object::Service(Box::new(serde_yaml::from_str(&svc).expect("service YAML"))));
            let eps = [std::net::Ipv4Addr::from(0x0a80_0000 + i * 4), std::net::Ipv4Addr::from(0x0a80_0000 + i * 4 + 1)];
            let slice = lab::endpoint_slice(&name, &format!("{name}-1"), &eps, &[("http", 8080, "TCP")]);
            slices.push(Object::EndpointSlice(Box::new(serde_yaml::from_str(&slice).expect("slice YAML"))));
        }
        (services, slices)
    };
    let proxier = || netfilter_proxier(ProxyMode::Nftables);
    let ns = netns::Netns::create(format!("pxnft-{}", netns::unique_id()));
    let nft = |args: &[&str]| {
        let mut v = vec!["ip", "netns", "exec", &ns.name, "nft"];
        v.extend_from_slice(args);
        netns::sh(&v)
    };
    // Built from nothing, 1,000 Services a sync; after the first step svc-1 and svc-10 (written
    // by it, in key order) go and have their endpoint moved, and svc-2600 comes: the middle step writes the
    // next 1,000 as they are, and the last step the rest with each of those changes.
    let first = objects(0..2500, &[]);
    let (built, middle, steps) = ns.run(move || {
        let nft = |args: &[&str]| netns::sh(&[&["nft"], args].concat());
        let mut p = proxier();
        p.handle(Event::Replace { kind: Kind::Service, objects: first.0 });
        p.handle(Event::Replace { kind: Kind::EndpointSlice, objects: first.1 });
        let step = |p: &mut NetfilterProxier| {
            let s = p.sync().expect("a step of the build");
            assert_eq!(s.failed, 0, "a step failed (see the log)");
        };
        step(&mut p);
        assert!(p.pending() && p.building(), "2,500 Services are built in more than one step");
        let built = nft(&["list", "map", "ip", "kube-proxy", "service-ips"]);
        p.handle(Event::Delete { kind: Kind::Service, key: proxy_agent::model::ObjectKey::new("default", "svc-1") });
        let moved = lab::endpoint_slice("svc-10", "svc-10-1", &["10.250.0.2".parse().unwrap()], &[("http", 8080, "TCP")]);
        p.handle(Event::Apply(Object::EndpointSlice(Box::new(serde_yaml::from_str(&moved).expect("slice YAML")))));
        let (services, slices) = objects(2600..2601, &[]);
        for o in services.into_iter().chain(slices) {
            p.handle(Event::Apply(o));
        }
        step(&mut p);
        assert!(p.pending() && p.building());
        let middle = nft(&["list", "table", "ip", "kube-proxy"]);
        let mut steps = 2;
        while p.pending() {
            step(&mut p);
            steps += 1;
        }
        assert!(!p.building());
        (built, middle, steps)
    });
    assert_eq!(steps, 3, "1,000 Services, 1,000 more, then the rest with the changes");
    let served = |map: &str, i: u32| map.contains(&format!("{} . tcp . 80 ", vip(i)));
    assert!(
        served(&built, 1) && served(&built, 10) && (0..2500).filter(|i| served(&built, *i)).count() == 1000,
        "the first step serves its 1,000 Services, complete:\n{built}"
    );
    let written = (0..2601).filter(|i| served(&middle, *i)).count();
    let chains = middle.lines().filter(|l| l.trim_start().starts_with("chain service-") && l.contains("/svc-")).count();
    assert!(written == 2000 && chains == 2000, "the middle step serves 1,000 more, each with its chain: {written}, {chains}");
    let table = nft(&["list", "table", "ip", "kube-proxy"]);
    let map = nft(&["list", "map", "ip", "kube-proxy", "service-ips"]);
    assert!((0..2500).filter(|i| served(&map, *i)).count() == 2499 && !served(&map, 1), "every Service but the one deleted");
    assert!(!table.contains("default/svc-1/"), "a Service deleted during the build leaves no chain");
    assert!(served(&map, 2600) && table.contains("default/svc-2600/tcp/http"), "one created during it is in");
    assert!(
        table.contains("dnat to 10.250.0.2:8080")
            && !(0..2).any(|n| table.contains(&format!("dnat to {}:8080", std::net::Ipv4Addr::from(0x0a80_0000 + 10 * 4 + n)))),
        "an endpoint moved during it is what its Service picks"
    );
    // (nft lists a chain as `chain <name> {`.)
    let named = |table: &str, kind: &str, prefix: &str, what: &str| -> Option<String> {
        table.lines().find_map(|l| {
            let name = l.trim().strip_prefix(kind)?.strip_suffix(" {")?;
            (name.starts_with(prefix) && name.contains(what)).then(|| name.to_string())
        })
    };
    let service_chain = |i: u32| named(&table, "chain ", "service-", &format!("-default/svc-{i}/tcp/http")).expect("a Service chain");
    let (s5, s7, s9) = (service_chain(5), service_chain(7), service_chain(9));
    // (svc-20's: a Service the restart keeps.)
    let affinity = named(&table, "set ", "affinity-", "/svc-20/").expect("an affinity set");
    nft(&["flush", "chain", "ip", "kube-proxy", &s5]);
    nft(&["flush", "chain", "ip", "kube-proxy", "services"]);
    nft(&["delete", "element", "ip", "kube-proxy", "service-ips", &format!("{{ {} . tcp . 80 }}", vip(7))]);
    nft(&["add", "chain", "ip", "kube-proxy", "leftover"]);
    nft(&["add", "set", "ip", "kube-proxy", "leftover-set", "{ type ipv4_addr ; }"]);
    nft(&["add", "element", "ip", "kube-proxy", &affinity, "{ 192.0.2.99 }"]);

    // The restart: svc-3 and svc-4 went, svc-1500 (a LoadBalancer) came. The table is written
    // again in steps, one per sync; between two of them svc-8 goes, svc-9's endpoint moves
    // and svc-1501 comes, and the next step has each of them.
    let second = objects(0..1501, &[3, 4]);
    let s9_during = s9.clone();
    let ((map, during, table_during), steps) = ns.run(move || {
        let nft = |args: &[&str]| netns::sh(&[&["nft"], args].concat());
        let mut p = proxier();
        p.handle(Event::Replace { kind: Kind::Service, objects: second.0 });
        p.handle(Event::Replace { kind: Kind::EndpointSlice, objects: second.1 });
        let step = |p: &mut NetfilterProxier| {
            let s = p.sync().expect("a step of the refresh");
            assert_eq!(s.failed, 0, "a step failed (see the log)");
        };
        step(&mut p);
        step(&mut p);
        assert!(p.pending(), "1,500 Services are written again in more than two steps");
        p.handle(Event::Delete { kind: Kind::Service, key: proxy_agent::model::ObjectKey::new("default", "svc-8") });
        let moved = lab::endpoint_slice("svc-9", "svc-9-1", &["10.250.0.9".parse().unwrap()], &[("http", 8080, "TCP")]);
        p.handle(Event::Apply(Object::EndpointSlice(Box::new(serde_yaml::from_str(&moved).expect("slice YAML")))));
        let (services, slices) = objects(1501..1502, &[]);
        for o in services.into_iter().chain(slices) {
            p.handle(Event::Apply(o));
        }
        step(&mut p);
        assert!(p.pending(), "the refresh goes on");
        let during = (
            nft(&["list", "map", "ip", "kube-proxy", "service-ips"]),
            nft(&["list", "chain", "ip", "kube-proxy", &s9_during]),
            nft(&["list", "table", "ip", "kube-proxy"]),
        );
        let mut steps = 3;
        while p.pending() {
            step(&mut p);
            steps += 1;
        }
        (during, steps)
    });
    assert!(!map.contains(&format!("{} . tcp . 80", vip(8))), "a Service deleted during the refresh leaves the map at the next step");
    assert!(map.contains(&format!("{} . tcp . 80", vip(1501))), "one created during it is in at the next step");
    assert!(
        during.contains("default/svc-9/tcp/http__10.250.0.9/8080")
            && !during.contains(&format!("__{}/8080", std::net::Ipv4Addr::from(0x0a80_0000 + 9 * 4))),
        "an endpoint moved during it is what its Service's chain picks at the next step:\n{during}"
    );
    assert!(table_during.contains("dnat to 10.250.0.9:8080"), "and its chain is written");
    eprintln!("written again in {steps} steps");
    let table = nft(&["list", "table", "ip", "kube-proxy"]);
    let chain = |name: &str| nft(&["list", "chain", "ip", "kube-proxy", name]);
    assert_eq!(chain(&s5).matches("numgen random").count(), 1, "a flushed Service chain is whole again:\n{}", chain(&s5));
    assert_eq!(chain(&s7).matches("numgen random").count(), 1, "an intact one is not doubled:\n{}", chain(&s7));
    assert_eq!(chain("services").matches("vmap @service-ips").count(), 1, "a flushed fixed chain is whole again");
    let map = nft(&["list", "map", "ip", "kube-proxy", "service-ips"]);
    assert!(map.contains(&format!("{} . tcp . 80 : goto {s7}", vip(7))), "a deleted element is back");
    assert!(table.contains("default/svc-1500/tcp/http"), "the Service created meanwhile is in");
    assert!(map.contains(&format!("{} . tcp . 80", vip(1500))));
    assert!(
        !table.contains("default/svc-3/") && !table.contains("default/svc-4/") && !table.contains("default/svc-8/"),
        "the chains of Services deleted meanwhile are gone"
    );
    assert!(
        table.contains("default/svc-1501/tcp/http") && table.contains("dnat to 10.250.0.9:8080"),
        "the changes during the refresh stay"
    );
    assert!(!map.contains(&format!("{} . tcp . 80", vip(3))));
    assert!(!table.contains("leftover"), "so are a chain and a set nobody has");
    assert!(nft(&["list", "set", "ip", "kube-proxy", &affinity]).contains("192.0.2.99"), "a client's affinity is kept");

    // A table no step can write (a set of another type where one of ours goes): the write in
    // steps is tried twice, then the table is replaced in one transaction.
    nft(&["flush", "chain", "ip", "kube-proxy", "cluster-ips-check"]);
    nft(&["delete", "set", "ip", "kube-proxy", "cluster-ips"]);
    nft(&["add", "set", "ip", "kube-proxy", "cluster-ips", "{ type inet_service ; }"]);
    let third = objects(0..1500, &[]);
    let failed = ns.run(move || {
        let mut p = proxier();
        p.handle(Event::Replace { kind: Kind::Service, objects: third.0 });
        p.handle(Event::Replace { kind: Kind::EndpointSlice, objects: third.1 });
        // (The IPv6 table's write in steps goes on meanwhile, and the failing IPv4 one waits
        // its turn while it does: the count of syncs depends on that.)
        let mut failed = Vec::new();
        while failed.last() != Some(&false) && failed.len() < 8 {
            failed.push(p.sync().expect("a sync").failed > 0);
        }
        assert!(!p.pending(), "replaced whole");
        failed
    });
    assert!(failed.len() >= 3 && failed.ends_with(&[false]), "writes in steps fail, then the table is replaced: {failed:?}");
    assert!(nft(&["list", "set", "ip", "kube-proxy", "cluster-ips"]).contains("type ipv4_addr"));
    assert_eq!(chain("cluster-ips-check").matches("@cluster-ips").count(), 1, "the fixed chains are whole");

    // A build from nothing whose fixed part changes between steps (a ServiceCIDR came): the
    // table that exists by then is written again in steps, with the new fixed part.
    nft(&["delete", "table", "ip", "kube-proxy"]);
    let fourth = objects(0..1500, &[]);
    let (steps, map, first_batch, batches) = ns.run(move || {
        let mut p = proxier();
        p.handle(Event::Replace { kind: Kind::Service, objects: fourth.0 });
        p.handle(Event::Replace { kind: Kind::EndpointSlice, objects: fourth.1 });
        assert_eq!(p.sync().expect("a step").failed, 0);
        assert!(p.building());
        let cidr = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16]}\n";
        p.handle(Event::Apply(Object::ServiceCidr(Box::new(serde_yaml::from_str(cidr).expect("ServiceCIDR YAML")))));
        assert_eq!(p.sync().expect("a step").failed, 0);
        assert!(p.pending() && p.building(), "the Services the build had not reached wait for the maps to be filled");
        let mut steps = 2;
        while p.pending() {
            assert_eq!(p.sync().expect("a step").failed, 0, "a step failed (see the log)");
            steps += 1;
        }
        let map = netns::sh(&["nft", "list", "map", "ip", "kube-proxy", "service-ips"]);
        // Then every Service's endpoint moves at once (a namespace's Services redeployed, say):
        // 1,000 Services a sync, the others served as they were until their turn.
        for i in 0..1500 {
            let name = format!("svc-{i}");
            let slice = lab::endpoint_slice(&name, &format!("{name}-1"), &[moved(i)], &[("http", 8080, "TCP")]);
            p.handle(Event::Apply(Object::EndpointSlice(Box::new(serde_yaml::from_str(&slice).expect("slice YAML")))));
        }
        assert_eq!(p.sync().expect("a batch").failed, 0);
        // (Building: changes are not all programmed, so health-check ports and the latency
        // histogram wait for the last batch.)
        assert!(p.pending() && p.building(), "the rest waits for the next sync, every Service served meanwhile");
        let first_batch = netns::sh(&["nft", "list", "table", "ip", "kube-proxy"]);
        let mut batches = 1;
        while p.pending() {
            assert_eq!(p.sync().expect("a batch").failed, 0);
            batches += 1;
        }
        assert!(!p.building());
        (steps, map, first_batch, batches)
    });
    assert!(steps > 2, "written again in steps after the fixed part changed: {steps}");
    assert_eq!((0..1500).filter(|i| map.contains(&format!("{} . tcp . 80 ", vip(*i)))).count(), 1500, "every Service is served");
    assert!(chain("cluster-ips-check").contains("10.96.0.0/16"), "with the new fixed part:\n{}", chain("cluster-ips-check"));
    let at = |table: &str, i: u32| table.contains(&format!("dnat to {}:8080", moved(i)));
    assert_eq!(batches, 2, "1,500 Services changed: 1,000, then 500");
    // (In key order: svc-0, svc-1, svc-10, svc-100...)
    let mut order: Vec<u32> = (0..1500).collect();
    order.sort_by_key(|i| format!("svc-{i}"));
    let old = |n: u32| format!("dnat to {}:8080", std::net::Ipv4Addr::from(0x0a80_0000 + n));
    assert!(order[..1000].iter().all(|i| at(&first_batch, *i)), "the first batch writes the first 1,000 of them");
    assert!(
        order[1000..].iter().all(|i| !at(&first_batch, *i) && first_batch.contains(&old(i * 4))),
        "the others are served as they were until the next"
    );
    let table = nft(&["list", "table", "ip", "kube-proxy"]);
    assert_eq!((0..1500).filter(|i| at(&table, *i)).count(), 1500, "the second the rest");
    assert!(!(0..6000).any(|n| table.contains(&old(n))), "and no chain keeps an endpoint gone");
}

/// A node whose other tools run a newer nft (1.1.2 or later: Debian 13's, a CNI plugin's, a
/// firewall's) holds sets that older nft versions crash on in every command that loads sets,
/// Debian 12's 1.0.6 (this image's) among them (kubernetes#136786). The set is made over netlink
/// as nft 1.1.3 writes it (`proxy_tests::newernft`), once the nftables mode has written its
/// Services. Where this machine's nft crashes on it: auto mode's check says why and names the
/// table, so does the failed sync, the rules written before stay in the kernel, and the iptables
/// mode (which runs no nft) writes its rules beside the set, after the switch's cleanup removed
/// the nftables mode's table (which nft cannot delete there). Where it does not (a newer or
/// patched nft), the nftables mode writes on.
#[test]
fn a_set_of_a_newer_nft_that_crashes_this_one_is_named_and_iptables_mode_still_works() {
    if !require::root("a_set_of_a_newer_nft_that_crashes_this_one_is_named_and_iptables_mode_still_works") {
        return;
    }
    use proxy_agent::{
        dataplane::{modes::nftables_unsupported, ProxyMode},
        model::store::{Event, Kind, Object},
    };
    let proxier = netfilter_proxier;
    let slice = |backend: &str| {
        let yaml = lab::endpoint_slice("web", "web-1", &[backend.parse().unwrap()], &[("http", 8080, "TCP")]);
        Object::EndpointSlice(Box::new(serde_yaml::from_str(&yaml).expect("slice YAML")))
    };
    let service = || {
        Object::Service(Box::new(
            serde_yaml::from_str(&lab::service("web", "10.96.0.10", &[("http", 80, "TCP", 8080)])).expect("service YAML"),
        ))
    };
    // (The test namespace is its own: a fixed name clashes with nothing.)
    let table = "pxnewer".to_string();
    let ns = netns::Netns::create(format!("pxnew-{}", netns::unique_id()));
    ns.run(move || {
        let mut nft = proxier(ProxyMode::Nftables);
        nft.handle(Event::Replace { kind: Kind::Service, objects: vec![service()] });
        nft.handle(Event::Replace { kind: Kind::EndpointSlice, objects: vec![slice("10.1.0.1")] });
        assert_eq!(nft.sync().expect("a sync").failed, 0, "written before the set comes");
        proxy_tests::newernft::add_table_with_newer_set(&table).expect("the newer nft's set");
        let crashes = proxy_tests::newernft::this_nft_crashes();
        nft.handle(Event::Apply(slice("10.1.0.2")));
        let synced = nft.sync().expect("a sync");
        if !crashes {
            println!("NOT APPLICABLE the crash's report: this machine's nft reads the sets of newer nft versions");
            assert_eq!(synced.failed, 0, "the nftables mode writes on beside the set");
            return;
        }
        let named = format!("table ip {table}");
        let why = nftables_unsupported().expect("auto mode's check fails where nft crashes");
        println!("auto mode's reason: {why}");
        for part in ["SIGSEGV", named.as_str(), "nft 1.1.2 or later", "eBPF and iptables modes run no nft", "proxy-agent cleanup"] {
            assert!(why.contains(part), "auto mode's reason says {part:?}: {why}");
        }
        assert!(synced.failed > 0 && nft.has_failures());
        let error = nft.last_error().expect("the failed sync's error").to_string();
        assert!(error.contains(&named) && error.contains("SIGSEGV"), "the sync's error names the table and the crash: {error}");
        // (Listing one table loads only its own sets.)
        let kept = netns::sh(&["nft", "list", "table", "ip", "kube-proxy"]);
        assert!(kept.contains("10.1.0.1") && !kept.contains("10.1.0.2"), "what was written stays, unchanged:\n{kept}");
        let mut ipt = proxier(ProxyMode::Iptables);
        ipt.handle(Event::Replace { kind: Kind::Service, objects: vec![service()] });
        ipt.handle(Event::Replace { kind: Kind::EndpointSlice, objects: vec![slice("10.1.0.2")] });
        assert_eq!(ipt.sync().expect("a sync").failed, 0, "the iptables mode writes beside the set: {:?}", ipt.last_error());
        let nat = netns::sh(&["iptables-nft-save", "-t", "nat"]);
        assert!(nat.contains("10.96.0.10/32") && nat.contains("10.1.0.2:8080"), "the Service in iptables:\n{nat}");
        // Switching modes removes the nftables mode's table (over netlink: `nft delete table`
        // crashes too), else its rules would go on translating beside iptables'.
        let removed = proxy_agent::dataplane::netfilter::nftables::cleanup();
        assert!(
            removed.contains(&"nftables: table ip kube-proxy".to_string()) && removed.iter().all(|r| r.starts_with("nftables: table ")),
            "{removed:?}"
        );
        let tables = proxy_agent::dataplane::netfilter::nftables::tables().expect("the tables");
        assert!(!tables.iter().any(|(_, name)| name == "kube-proxy"), "{tables:?}");
        assert!(tables.contains(&("ip".to_string(), table.clone())), "and only it: {tables:?}");
    });
}

/// Auto mode in nftables (no eBPF privileges here) on a node where another tool's newer nft
/// later writes a set that this nft cannot read: from then on every nft write crashes. The next
/// change hands the Services to the iptables mode in the same process (as auto mode would pick
/// at a start there), which writes them in full before the nftables table goes: an open
/// connection goes on, the change is served, and the other tool's table stays.
#[test]
fn auto_mode_leaves_nftables_for_iptables_when_a_newer_nfts_set_appears() {
    let test = "auto_mode_leaves_nftables_for_iptables_when_a_newer_nfts_set_appears";
    if !require::root(test) {
        return;
    }
    let mut lab = Lab::new(AGENT, 3);
    let backends = lab.backend_ips();
    lab.write_manifest("services.yaml", &standard_manifests(&backends));
    // (No CAP_BPF, CAP_PERFMON or CAP_SYS_ADMIN: auto mode cannot take eBPF.)
    lab.agent_limits.drop_caps = vec![39, 38, 21];
    lab.start_agent();
    lab.wait_log("proxy mode auto: nf_tables and nft are available", 1);
    wait_served(&lab, "nftables mode should serve");
    let mut conn = Conn::open(&lab.client.ns, sock(WEB_VIP)).expect("a long-lived connection");
    let backend = conn.ask().expect("first answer").backend;
    let crashes = lab.node.run(|| {
        proxy_tests::newernft::add_table_with_newer_set("pxnewer").expect("the newer nft's set");
        proxy_tests::newernft::this_nft_crashes()
    });
    if !crashes {
        println!("NOT APPLICABLE {test}: this machine's nft reads the sets of newer nft versions");
        return;
    }
    // A change: the Services lose a backend, not the connection's.
    let dropped = (0..backends.len()).find(|i| format!("backend-{}", i + 1) != backend).expect("another backend");
    let keep: Vec<_> = (0..backends.len()).filter(|i| *i != dropped).collect();
    let kept: Vec<_> = keep.iter().map(|i| backends[*i]).collect();
    lab.write_manifest("services.yaml", &standard_manifests(&kept));
    lab.wait_log("switching to the iptables mode", 1);
    lab.wait_log("removed the nftables mode's", 1);
    let log = lab.agent_log();
    assert!(log.contains("table ip pxnewer") && log.contains("SIGSEGV"), "the reason names the table and the crash:\n{log}");
    // (Either backend, as the agent detected.)
    let nat = lab.node.run(|| netns::sh(&["iptables-legacy-save", "-t", "nat"]) + &netns::sh(&["iptables-nft-save", "-t", "nat"]));
    assert!(nat.contains(&format!("-d {}/32", sock(WEB_VIP).ip())), "the Services in iptables:\n{nat}");
    let tables = lab.node.run(|| proxy_agent::dataplane::netfilter::nftables::tables().expect("the tables"));
    assert!(!tables.iter().any(|(_, name)| name == "kube-proxy"), "the nftables mode's tables are removed: {tables:?}");
    assert!(tables.contains(&("ip".to_string(), "pxnewer".to_string())), "and only those: {tables:?}");
    assert_eq!(conn.ask().expect("the open connection goes on").backend, backend);
    let served: Vec<String> = counts(&lab, 30).into_keys().collect();
    let wanted: Vec<String> = keep.iter().map(|i| format!("backend-{}", i + 1)).collect();
    assert_eq!(served, wanted, "the change is served, by the iptables mode");
    let mode = proxy_mode(&lab);
    assert!(mode.ends_with("iptables"), "{mode}");
    assert!(lab.agent_running(), "the same process serves on:\n{}", lab.agent_log());
    // Later changes go to iptables alone: nft crashes no more syncs.
    lab.write_manifest("services.yaml", &standard_manifests(&backends));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while counts(&lab, 30).len() != 3 {
        assert!(std::time::Instant::now() < deadline, "the third backend comes back:\n{}", lab.agent_log());
        thread::sleep(Duration::from_millis(300));
    }
    assert_eq!(lab.agent_log().matches("crashed").count(), log.matches("crashed").count(), "{}", lab.agent_log());

    // An explicit nftables mode does not switch: its syncs fail, saying why.
    lab.stop_agent();
    let before = lab.agent_log().len();
    lab.start_agent_with_extra(&["--proxy-mode", "nftables"]);
    lab.wait_log("applying the rules failed; retrying", 1);
    thread::sleep(Duration::from_secs(3));
    let log = lab.agent_log().split_off(before);
    assert!(log.contains("table ip pxnewer") && !log.contains("switching to the iptables mode"), "{log}");
    let mode = proxy_mode(&lab);
    assert!(mode.ends_with("nftables"), "{mode}");
}

/// A netfilter mode's proxier as the agent makes it (cluster CIDR 10.0.0.0/8, node
/// "test-node"), for tests that drive its syncs themselves.
fn netfilter_proxier(mode: proxy_agent::dataplane::ProxyMode) -> proxy_agent::dataplane::netfilter::proxier::NetfilterProxier {
    use proxy_agent::{
        config::{Config, Flags},
        dataplane::{
            modes::rules_for,
            netfilter::proxier::{Masquerading, NetfilterProxier},
        },
        model::store::{Kind, Store},
    };
    let flags = Flags { cluster_cidr: Some(vec!["10.0.0.0/8".parse().unwrap()]), ..Default::default() };
    let (cfg, _) = Config::resolve(flags, || "test-node".into()).expect("configuration");
    let rules = rules_for(mode, &cfg, Default::default(), false).expect("the mode's rules");
    let masquerading = Masquerading { masquerade_all: false, detect_local: None, cluster_cidrs: vec!["10.0.0.0/8".parse().unwrap()] };
    NetfilterProxier::new(Store::new("test-node"), rules, vec![Kind::Service, Kind::EndpointSlice], masquerading, vec![])
}
