//! North-south end to end: an external client, two nodes each running its own agent, pods
//! behind each node; real TCP and UDP through NodePorts, load-balancer IPs and external IPs.
//! Backends answer with their name and the client address they saw, so the tests assert where
//! the source address was kept and where it was translated.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    time::Duration,
};

use proxy_tests::{
    cluster::{nodes_manifest, pod_ipv6, service, slice, slice6, sock, Cluster, CLIENT_IP, CLIENT_IP6},
    require,
    servers::{http_get_with_headers, tcp_ask, udp_ask, Answer},
};

fn cluster(test: &str, pods: [&[&str]; 2]) -> Option<Cluster> {
    require::root(test).then(|| Cluster::new(env!("CARGO_BIN_EXE_proxy-lab-agent"), pods))
}

const A1: &str = "10.244.1.11";
const B1: &str = "10.244.2.11";
const B2: &str = "10.244.2.12";

fn ip(s: &str) -> Ipv4Addr {
    s.parse().unwrap()
}

/// Asks `to` over TCP (or UDP) from the client `n` times, on fresh connections.
fn ask_many(c: &Cluster, to: &str, udp: bool, n: usize) -> Vec<Answer> {
    (0..n)
        .map(|i| {
            let r = if udp { udp_ask(&c.client, sock(to)).map(|(a, _)| a) } else { tcp_ask(&c.client, sock(to)) };
            r.unwrap_or_else(|e| {
                let state: Vec<String> = c
                    .nodes
                    .iter()
                    .map(|n| {
                        format!(
                            "--- {} ---\n{}",
                            n.name,
                            n.inspect().map(|r| proxy_agent::inspect::render(&r)).unwrap_or_else(|e| e.to_string())
                        )
                    })
                    .collect();
                panic!("request {i} to {to} ({}): {e}\n{}", if udp { "UDP" } else { "TCP" }, state.join("\n"))
            })
        })
        .collect()
}

fn peers_by_backend(answers: &[Answer]) -> BTreeMap<String, BTreeSet<Ipv4Addr>> {
    let mut m: BTreeMap<String, BTreeSet<Ipv4Addr>> = BTreeMap::new();
    for a in answers {
        let SocketAddr::V4(p) = a.peer else { panic!("IPv6 peer") };
        m.entry(a.backend.clone()).or_default().insert(*p.ip());
    }
    m
}

fn web(spec_extra: &str) -> String {
    service(
        "web",
        &format!(
            "  type: NodePort\n  clusterIP: 10.96.0.10\n  ports:\n  - {{name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}}\n  - {{name: dns, port: 53, targetPort: 5353, nodePort: 30053, protocol: UDP}}\n{spec_extra}"
        ),
        None,
    )
}

#[test]
fn node_port_cluster_policy_keeps_the_client_ip_for_local_backends_and_snats_for_remote_ones() {
    let Some(mut c) = cluster("node_port_cluster_policy", [&["a1"], &["b1", "b2"]]) else { return };
    // The far end of each uplink takes XDP frames, as a NIC's does.
    c.switch_takes_xdp_frames();
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &web(""));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a"), (ip(B1), "node-b"), (ip(B2), "node-b")]));
    c.start_agents(&[]);
    c.wait_frontend("NODE:30080", "TCP", 3);
    c.wait_frontend("NODE:30053", "UDP", 3);
    for (to, udp) in [("192.168.100.1:30080", false), ("192.168.100.1:30053", true), ("192.168.100.2:30080", false)] {
        let answers = ask_many(&c, to, udp, 40);
        let peers = peers_by_backend(&answers);
        assert_eq!(peers.keys().cloned().collect::<Vec<_>>(), ["a1", "b1", "b2"], "{to}: every backend, on both nodes: {peers:?}");
        let via: Ipv4Addr = sock(to).ip().to_owned();
        for (backend, seen) in &peers {
            let local = (backend == "a1") == (via == ip("192.168.100.1"));
            let want = if local { ip(CLIENT_IP) } else { via };
            assert_eq!(seen, &BTreeSet::from([want]), "{to}: {backend} ({}) must see {want}", if local { "local" } else { "remote" });
        }
    }
    // Remote flows took the XDP path on the node that forwarded them (once the agent had seen
    // that the switch takes XDP frames: before, TC sent them).
    c.wait_all("XDP to send frames itself", |_, r| r.external_interfaces.values().all(|e| e.xdp_sends));
    let _ = ask_many(&c, "192.168.100.1:30080", false, 40);
    let r = c.node("node-a").inspect().unwrap();
    assert!(r.external_interfaces.values().all(|e| e.xdp), "XDP attached natively: {:?}", r.external_interfaces);
    let count = |k: &str| r.counters.get(k).map_or(0, |c| c.packets);
    assert!(count("xdp_forward") > 0 && count("xdp_reply") > 0, "XDP forwarded remote flows: {:?}", r.counters);
}

#[test]
fn external_traffic_policy_local_keeps_the_client_ip_and_answers_health_checks() {
    let Some(mut c) = cluster("external_traffic_policy_local", [&["a1"], &["b1"]]) else { return };
    c.write_manifest("nodes.yaml", &nodes_manifest());
    let lb = service(
        "web",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n",
        Some("  loadBalancer:\n    ingress:\n    - {ip: 203.0.113.10}\n"),
    );
    c.write_manifest("web.yaml", &lb);
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a")]));
    c.start_agents(&[]);
    c.wait_frontend_on("node-a", "192.168.100.1:30080", "TCP", 1);
    c.wait_frontend_on("node-b", "192.168.100.2:30080", "TCP", 0);
    // Through node A (which has the endpoint): the backend sees the real client.
    for to in ["192.168.100.1:30080", "203.0.113.10:80"] {
        let peers = peers_by_backend(&ask_many(&c, to, false, 5));
        assert_eq!(peers, BTreeMap::from([("a1".to_string(), BTreeSet::from([ip(CLIENT_IP)]))]), "{to}");
    }
    // Through node B (no local endpoint): dropped, as kube-proxy does; the client times out
    // rather than being refused.
    let err = tcp_ask(&c.client, sock("192.168.100.2:30080")).expect_err("node B has no local endpoint");
    assert!(matches!(err.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock), "dropped, not refused: {err}");
    // Health checks tell the load balancer which node to use.
    let (code, headers, body) = http_get_with_headers(&c.client, sock("192.168.100.1:32000"), "/").unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(headers.get("x-load-balancing-endpoint-weight").map(String::as_str), Some("1"));
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"service": {"namespace": "default", "name": "web"}, "localEndpoints": 1, "serviceProxyHealthy": true})
    );
    let (code, headers, body) = http_get_with_headers(&c.client, sock("192.168.100.2:32000"), "/healthz").unwrap();
    assert_eq!(code, 503, "{body}");
    assert_eq!(headers.get("x-load-balancing-endpoint-weight").map(String::as_str), Some("0"));
    // Pods on node B reaching the load-balancer IP are not bound by the external policy.
    let from_pod = tcp_ask(&c.node("node-b").client_pod.ns, sock("203.0.113.10:80")).unwrap();
    assert_eq!(from_pod.backend, "a1");
    // The endpoint moves to node B: the health checks follow.
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(B1), "node-b")]));
    c.wait_frontend_on("node-b", "192.168.100.2:30080", "TCP", 1);
    c.wait_frontend_on("node-a", "192.168.100.1:30080", "TCP", 0);
    let (code, _, _) = http_get_with_headers(&c.client, sock("192.168.100.2:32000"), "/").unwrap();
    assert_eq!(code, 200);
    let (code, _, _) = http_get_with_headers(&c.client, sock("192.168.100.1:32000"), "/").unwrap();
    assert_eq!(code, 503);
}

#[test]
fn load_balancer_and_external_ips_are_served_but_proxy_mode_ingress_is_not() {
    let Some(mut c) = cluster("load_balancer_and_external_ips", [&["a1"], &["b1"]]) else { return };
    c.write_manifest("nodes.yaml", &nodes_manifest());
    let lb = service(
        "web",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalIPs: [192.0.2.7]\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n  - {name: dns, port: 53, targetPort: 5353, nodePort: 30053, protocol: UDP}\n",
        Some("  loadBalancer:\n    ingress:\n    - {ip: 203.0.113.10}\n    - {ip: 203.0.113.11, ipMode: Proxy}\n"),
    );
    c.write_manifest("web.yaml", &lb);
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a"), (ip(B1), "node-b")]));
    c.start_agents(&[]);
    c.wait_frontend("203.0.113.10:80", "TCP", 2);
    c.wait_frontend("192.0.2.7:53", "UDP", 2);
    for (to, udp) in [("203.0.113.10:80", false), ("203.0.113.10:53", true), ("192.0.2.7:80", false), ("192.0.2.7:53", true)] {
        let peers = peers_by_backend(&ask_many(&c, to, udp, 30));
        assert_eq!(peers.len(), 2, "{to}: both backends: {peers:?}");
    }
    let r = c.node("node-a").inspect().unwrap();
    assert!(!r.frontends.iter().any(|f| f.address.starts_with("203.0.113.11")), "ipMode Proxy: the load balancer proxies, not us");
    assert!(tcp_ask(&c.client, sock("203.0.113.11:80")).is_err());
}

#[test]
fn a_node_port_without_endpoints_refuses_at_once() {
    let Some(mut c) = cluster("a_node_port_without_endpoints_refuses_at_once", [&[], &[]]) else { return };
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &web(""));
    c.write_manifest("web-eps.yaml", &slice("web", &[]));
    c.start_agents(&[]);
    c.wait_frontend("NODE:30080", "TCP", 0);
    let resent = c.client.tcp_ext("TCPSynRetrans");
    let err = tcp_ask(&c.client, sock("192.168.100.1:30080")).expect_err("no endpoints");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    assert_eq!(c.client.tcp_ext("TCPSynRetrans"), resent, "refused at the first SYN");
    let udp = proxy_tests::servers::udp_ask_connected(&c.client, sock("192.168.100.1:30053")).expect_err("no endpoints");
    assert_eq!(udp.kind(), io::ErrorKind::ConnectionRefused, "{udp}");
}

#[test]
fn client_ip_affinity_keeps_each_client_on_one_backend() {
    let Some(mut c) = cluster("client_ip_affinity", [&["a1"], &["b1", "b2"]]) else { return };
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &web("  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}\n"));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a"), (ip(B1), "node-b"), (ip(B2), "node-b")]));
    c.start_agents(&[]);
    c.wait_frontend("NODE:30080", "TCP", 3);
    for to in ["192.168.100.1:30080", "192.168.100.1:30053"] {
        let answers = ask_many(&c, to, to.ends_with("53"), 20);
        let backends: BTreeSet<_> = answers.iter().map(|a| a.backend.clone()).collect();
        assert_eq!(backends.len(), 1, "NodePort {to}: one client, one backend: {backends:?}");
    }
    // The same from a pod through the cluster IP.
    let pod = &c.node("node-a").client_pod.ns;
    let backends: BTreeSet<_> = (0..20).map(|_| tcp_ask(pod, sock("10.96.0.10:80")).unwrap().backend).collect();
    assert_eq!(backends.len(), 1, "ClusterIP: {backends:?}");
}

#[test]
fn internal_traffic_policy_local_keeps_pods_on_their_node() {
    let Some(mut c) = cluster("internal_traffic_policy_local", [&["a1"], &["b1"]]) else { return };
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &web("  internalTrafficPolicy: Local\n"));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a"), (ip(B1), "node-b")]));
    c.start_agents(&[]);
    c.wait_all("cluster IP with its node's endpoint", |_, r| {
        r.frontends.iter().any(|f| f.address == "10.96.0.10:80" && f.backends.len() == 1)
    });
    for (node, want) in [("node-a", "a1"), ("node-b", "b1")] {
        let pod = &c.node(node).client_pod.ns;
        let seen: BTreeSet<_> = (0..10).map(|_| tcp_ask(pod, sock("10.96.0.10:80")).unwrap().backend).collect();
        assert_eq!(seen, BTreeSet::from([want.to_string()]), "pods on {node}");
    }
    // Outside clients are not affected by the internal policy.
    let peers = peers_by_backend(&ask_many(&c, "192.168.100.1:30080", false, 30));
    assert_eq!(peers.len(), 2);
}

#[test]
fn every_node_sends_a_flow_to_the_same_backend() {
    let Some(mut c) = cluster("every_node_sends_a_flow_to_the_same_backend", [&["a1", "a2"], &["b1", "b2"]]) else { return };
    c.write_manifest("nodes.yaml", &nodes_manifest());
    let lb = service(
        "web",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n",
        Some("  loadBalancer:\n    ingress:\n    - {ip: 203.0.113.10}\n"),
    );
    c.write_manifest("web.yaml", &lb);
    let eps = [(ip(A1), "node-a"), (ip("10.244.1.12"), "node-a"), (ip(B1), "node-b"), (ip(B2), "node-b")];
    c.write_manifest("web-eps.yaml", &slice("web", &eps));
    c.start_agents(&[]);
    c.wait_frontend("203.0.113.10:80", "TCP", 4);
    let mut picks: Vec<Vec<String>> = Vec::new();
    for node in &c.nodes {
        let root = node.bpffs();
        let seen = node.ns.run(move || {
            (0..100u16)
                .map(|p| {
                    let from = SocketAddrV4::new(ip("198.51.100.20"), 40000 + p);
                    let r =
                        proxy_agent::trace::run(&root, from, sock("203.0.113.10:80"), proxy_agent::model::Protocol::Tcp).expect("trace");
                    r.backend.unwrap_or_default()
                })
                .collect::<Vec<_>>()
        });
        picks.push(seen);
    }
    assert_eq!(picks[0], picks[1], "node A and node B must agree on every flow");
    assert_eq!(picks[0].iter().collect::<BTreeSet<_>>().len(), 4, "100 flows reach all 4 backends");
    // And the command line says the same, for people.
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &c.node("node-b").ns.name, env!("CARGO_BIN_EXE_proxy-lab-agent"), "trace", "--bpffs-root"])
        .arg(c.node("node-b").bpffs())
        .args(["--from", "198.51.100.20:40000", "--to", "203.0.113.10:80/TCP"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains(&format!("backend   {}", picks[0][0])), "{text}");
    assert!(text.contains("service   default/web:http"), "{text}");
}

/// A UDP flow that XDP forwards to a backend on node B, its step cached on node A, leaves that
/// backend once the agent has removed it: the removed backend's pod still runs and would
/// answer, so an answer from it would be a packet the cache sent where the conntrack path
/// sends the flow elsewhere (its backend gone, it is tracked afresh). Without the agent's move
/// of the cache's generation, answers from the removed backend go on until the flow's window
/// ends (up to a second: two runs in three failed so), and the move itself is checked in the
/// pinned map. The node is the way nodes are: the uplink's far end takes XDP frames (as a NIC
/// does), the agent runs with its defaults.
#[test]
fn a_udp_flow_through_xdp_leaves_a_removed_backend_at_once() {
    let Some(mut c) = cluster("a_udp_flow_through_xdp_leaves_a_removed_backend", [&[], &["b1", "b2"]]) else { return };
    c.switch_takes_xdp_frames();
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &web(""));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(B1), "node-b"), (ip(B2), "node-b")]));
    c.start_agents(&[]);
    c.wait_frontend("NODE:30053", "UDP", 2);
    c.wait_all("XDP to send frames itself", |_, r| r.external_interfaces.values().all(|e| e.xdp_sends));
    let flow = proxy_tests::servers::UdpFlow::open(&c.client, sock("192.168.100.1:30053")).expect("a resolver's flow");
    let first = flow.ask().expect("first answer").backend;
    let forwarded = |c: &Cluster| c.node("node-a").inspect().unwrap().counters.get("xdp_forward").map_or(0, |c| c.packets);
    let before = forwarded(&c);
    for _ in 0..50 {
        assert_eq!(flow.ask().expect("an answer").backend, first, "the flow keeps its backend");
    }
    assert!(forwarded(&c) >= before + 50, "the flow's packets took XDP");
    let (keep, ip_keep) = if first == "b1" { ("b2", B2) } else { ("b1", B1) };
    // The flow keeps asking while the backend goes (a cached step's window is renewed by the
    // packet that refreshes the entry, once a second: a flow that keeps sending always has
    // one open), from one CPU: node A's XDP then runs where the client sends (veth), and the
    // flow's packets meet one CPU's cache. (From two, a packet that misses on one of them is
    // tracked afresh by TC, which moves the generation on for both: the agent's own move
    // would go untested.)
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let asker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            proxy_tests::testrun::stay_on_this_cpu();
            let mut answers = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let sent = std::time::Instant::now();
                answers.push((sent, flow.ask().map(|a| a.backend)));
            }
            answers
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let generation = || {
        let pin = proxy_agent::dataplane::ebpf::loader::maps_dir(&c.node("node-a").bpffs()).join(proxy_common::map_names::FLOW_GEN);
        let map = aya::maps::MapData::from_pin(pin).expect("the pinned flow cache generation");
        aya::maps::Array::<_, proxy_common::ct::FlowGen>::try_from(aya::maps::Map::Array(map)).unwrap().get(&0, 0).unwrap()
    };
    let before = generation();
    let removed_backend = format!("{}:5353", if keep == "b1" { B2 } else { B1 });
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(ip_keep), "node-b")]));
    // The moment node A's agent has removed the backend (within 100 ms): its entry is gone
    // from the backends map (every frontend rewritten; the writer deletes a backend after the
    // last slot naming it), and the generation moves right after.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !c
        .node("node-a")
        .inspect()
        .is_ok_and(|r| !r.frontends.iter().flat_map(|f| &f.backends).chain(&r.retained_backends).any(|b| b.address == removed_backend))
    {
        assert!(std::time::Instant::now() < deadline, "node A did not remove the backend");
        std::thread::sleep(Duration::from_millis(5));
    }
    let removed = std::time::Instant::now() + Duration::from_millis(100);
    // Longer than a window.
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let answers = asker.join().unwrap();
    assert!(generation().agent > before.agent, "the agent moved the cache's generation on: {before:?} -> {:?}", generation());
    let after: Vec<_> = answers.iter().filter(|(sent, _)| *sent >= removed).collect();
    assert!(after.len() >= 50, "the flow kept asking after the removal: {} requests", after.len());
    for (i, (_, a)) in after.iter().enumerate() {
        assert_eq!(a.as_deref().ok(), Some(keep), "request {i} after the removal: {a:?}");
    }
}

#[test]
fn a_north_south_connection_survives_an_agent_restart() {
    let Some(mut c) = cluster("a_north_south_connection_survives_an_agent_restart", [&["a1"], &["b1", "b2"]]) else { return };
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &web(""));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a"), (ip(B1), "node-b"), (ip(B2), "node-b")]));
    c.start_agents(&[]);
    c.wait_frontend("NODE:30080", "TCP", 3);
    // Open connections until one goes to a backend on node B (SNAT and a port mapping).
    let mut remote = None;
    for _ in 0..40 {
        let mut k = proxy_tests::servers::Conn::open(&c.client, sock("192.168.100.1:30080")).unwrap();
        let a = k.ask().unwrap();
        if a.backend.starts_with('b') {
            remote = Some((k, a.backend));
            break;
        }
    }
    let (mut conn, backend) = remote.expect("a connection to a backend on node B");
    // 60 flows: each backend holds a third of the table, so one is missed by chance about
    // once in 10^10 runs (20 flows missed one in a CI run).
    let picks_before: Vec<String> = (0..60).map(|_| tcp_ask(&c.client, sock("192.168.100.1:30080")).unwrap().backend).collect();
    c.kill_agent_on("node-a");
    // While the agent is down, the pinned dataplane keeps serving the connection.
    assert_eq!(conn.ask().unwrap().backend, backend);
    c.start_agent_on("node-a", &[]);
    let log_has_sync = |c: &Cluster| c.node("node-a").agent_log().matches("initial sync done").count() >= 2;
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !log_has_sync(&c) {
        assert!(std::time::Instant::now() < deadline, "the restarted agent did not sync:\n{}", c.node("node-a").agent_log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        c.node("node-a").agent_log().lines().rev().find(|l| l.contains("initial sync done")).is_some_and(|l| l.contains("programmed=0")),
        "nothing to reprogram: the Maglev tables and slots were adopted as they were"
    );
    assert_eq!(conn.ask().unwrap().backend, backend, "the connection kept its backend and port mapping");
    // Maglev picks the same backends for the same flows as before the restart: the client's
    // source ports differ each time, so compare the spread, not single flows.
    let picks_after: Vec<String> = (0..60).map(|_| tcp_ask(&c.client, sock("192.168.100.1:30080")).unwrap().backend).collect();
    let spread = |picks: &[String]| -> std::collections::BTreeMap<String, usize> {
        picks.iter().fold(Default::default(), |mut m, b| {
            *m.entry(b.clone()).or_default() += 1;
            m
        })
    };
    assert_eq!(
        spread(&picks_after).keys().collect::<BTreeSet<_>>(),
        spread(&picks_before).keys().collect::<BTreeSet<_>>(),
        "the backends new flows reach, before {:?} and after {:?} the restart",
        spread(&picks_before),
        spread(&picks_after)
    );
}

#[test]
fn node_ports_are_served_only_on_the_addresses_asked_for() {
    let Some(mut c) = cluster("node_ports_are_served_only_on_the_addresses_asked_for", [&["a1"], &[]]) else { return };
    c.node("node-a").ns.ip(&["addr", "add", "192.168.100.11/24", "dev", "wire0"]);
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &web(""));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a")]));
    c.start_agents(&["--nodeport-addresses", "primary"]);
    c.wait_frontend("NODE:30080", "TCP", 1);
    assert_eq!(tcp_ask(&c.client, sock("192.168.100.1:30080")).unwrap().backend, "a1", "the Node's InternalIP serves");
    let r = c.node("node-a").inspect().unwrap();
    assert!(!r.frontends.iter().any(|f| f.address.starts_with("192.168.100.11:")), "the second address serves no NodePort");
    let err = tcp_ask(&c.client, sock("192.168.100.11:30080")).expect_err("not a NodePort address");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "the node's own stack answers: nothing listens there");
}

#[test]
fn load_balancer_source_ranges_admit_only_their_clients() {
    let Some(mut c) = cluster("load_balancer_source_ranges_admit_only_their_clients", [&["a1"], &["b1"]]) else { return };
    c.write_manifest("nodes.yaml", &nodes_manifest());
    let lb = |ranges: &str| {
        service(
            "web",
            &format!("  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  loadBalancerSourceRanges: [{ranges}]\n  ports:\n  - {{name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}}\n"),
            Some("  loadBalancer:\n    ingress:\n    - {ip: 203.0.113.10}\n"),
        )
    };
    c.write_manifest("web.yaml", &lb(&format!("{CLIENT_IP}/32")));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a"), (ip(B1), "node-b")]));
    c.start_agents(&[]);
    c.wait_frontend("203.0.113.10:80", "TCP", 2);
    let peers = peers_by_backend(&ask_many(&c, "203.0.113.10:80", false, 20));
    assert_eq!(peers.len(), 2, "a client inside the ranges reaches both backends: {peers:?}");

    // The ranges move away from the client: its new connections are dropped (they time out,
    // as with kube-proxy's DROP), while the NodePort of the same Service still serves it.
    c.write_manifest("web.yaml", &lb("198.51.100.0/24"));
    c.wait_all("the new source ranges", |_, r| {
        r.frontends.iter().any(|f| f.address == "203.0.113.10:80" && f.source_ranges == ["198.51.100.0/24"])
    });
    let err = tcp_ask(&c.client, sock("203.0.113.10:80")).expect_err("a client outside the ranges");
    assert_eq!(err.kind(), io::ErrorKind::TimedOut, "dropped, not refused: {err}");
    assert_eq!(ask_many(&c, "192.168.100.1:30080", false, 5).len(), 5, "the NodePort is not subject to the ranges");
    let dropped: u64 =
        c.nodes.iter().filter_map(|n| n.inspect().ok()).filter_map(|r| r.counters.get("drop_source_range").map(|c| c.packets)).sum();
    assert!(dropped >= 1, "the drops are counted");
}

/// IPv6 north-south end to end on a dual-stack lab: an outside client reaches a dual-stack
/// Service's IPv6 NodePorts (TCP and UDP) on both nodes; a backend on the node it asked sees
/// the client's own address, one on the other node the asking node's (SNAT with a tracked
/// port, and the reply comes back the same way); without endpoints the client is refused at
/// once; the IPv4 NodePorts serve beside them.
#[test]
fn ipv6_node_ports_keep_the_client_address_for_local_backends_and_snat_for_remote_ones() {
    let Some(mut c) = cluster("ipv6_node_ports", [&["a1"], &["b1", "b2"]]) else { return };
    c.add_ipv6();
    c.write_manifest("nodes.yaml", &nodes_manifest());
    let dual = |name: &str, cluster_ips: &str, node_ports: (u16, u16)| {
        let primary = cluster_ips.split(',').next().unwrap_or_default();
        service(
            name,
            &format!(
                "  type: NodePort\n  clusterIP: {primary}\n  clusterIPs: [{cluster_ips}]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports:\n  - {{name: http, port: 80, targetPort: http, nodePort: {}, protocol: TCP}}\n  - {{name: dns, port: 53, targetPort: dns, nodePort: {}, protocol: UDP}}\n",
                node_ports.0, node_ports.1
            ),
            None,
        )
    };
    c.write_manifest("web.yaml", &dual("web", "10.96.0.10, 'fd00:96::10'", (30080, 30053)));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a"), (ip(B1), "node-b"), (ip(B2), "node-b")]));
    let eps6 = [(pod_ipv6(1, 0), "node-a"), (pod_ipv6(2, 0), "node-b"), (pod_ipv6(2, 1), "node-b")];
    c.write_manifest("web-eps6.yaml", &slice6("web", &eps6));
    c.write_manifest("empty.yaml", &dual("empty", "10.96.0.11, 'fd00:96::11'", (30090, 30091)));
    c.start_agents(&["--cluster-cidr", "10.244.0.0/16,fd00:244::/48", "--service-cluster-ip-range", "10.96.0.0/16,fd00:96::/112"]);
    c.wait_frontend("NODE:30080", "TCP", 3);
    let client6: std::net::Ipv6Addr = CLIENT_IP6.parse().unwrap();
    for (node, via) in [("node-a", "fd00:100::1"), ("node-b", "fd00:100::2")] {
        for udp in [false, true] {
            let to: SocketAddr = format!("[{via}]:{}", if udp { 30053 } else { 30080 }).parse().unwrap();
            let ask = || {
                if udp {
                    proxy_tests::servers::udp_ask_any(&c.client, to).map(|(a, _)| a)
                } else {
                    proxy_tests::servers::tcp_ask_any(&c.client, to)
                }
            };
            // The agents program the IPv6 NodePorts once they have seen the nodes' addresses.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while let Err(e) = ask() {
                assert!(std::time::Instant::now() < deadline, "{to} via {node}: {e}\n{}", c.node(node).agent_log());
                std::thread::sleep(Duration::from_millis(200));
            }
            let mut peers: BTreeMap<String, BTreeSet<std::net::IpAddr>> = BTreeMap::new();
            for i in 0..40 {
                let a = ask().unwrap_or_else(|e| panic!("request {i} to {to}: {e}"));
                peers.entry(a.backend).or_default().insert(a.peer.ip());
            }
            assert_eq!(peers.keys().cloned().collect::<Vec<_>>(), ["a1", "b1", "b2"], "{to}: every backend, on both nodes: {peers:?}");
            for (backend, seen) in &peers {
                let local = (backend == "a1") == (node == "node-a");
                let want: std::net::IpAddr = if local { client6.into() } else { via.parse::<std::net::Ipv6Addr>().unwrap().into() };
                assert_eq!(seen, &BTreeSet::from([want]), "{to}: {backend} ({}) must see {want}", if local { "local" } else { "remote" });
            }
        }
    }
    // Once the far end takes XDP frames (as a NIC's does), XDP carries the IPv6 flows to
    // remote backends after their first packet, which TC tracks.
    c.switch_takes_xdp_frames();
    c.wait_all("XDP to send frames itself", |_, r| r.external_interfaces.values().all(|e| e.xdp_sends));
    let xdp_forwarded = |c: &Cluster| c.node("node-a").inspect().unwrap().counters.get("xdp_forward").map_or(0, |c| c.packets);
    let before = xdp_forwarded(&c);
    for i in 0..20 {
        proxy_tests::servers::tcp_ask_any(&c.client, "[fd00:100::1]:30080".parse().unwrap())
            .unwrap_or_else(|e| panic!("request {i} with XDP: {e}"));
    }
    assert!(xdp_forwarded(&c) > before, "IPv6 flows to remote backends took the XDP path");
    // `inspect` shows the IPv6 frontends beside the IPv4 ones.
    let r = c.node("node-a").inspect().unwrap();
    let f = r.frontends.iter().find(|f| f.address == "[fd00:100::1]:30080" && f.scope == "external").expect("the IPv6 NodePort in inspect");
    assert_eq!(f.backends.len(), 3, "{:?}", f.backends);
    assert!(f.backends.iter().any(|b| b.address == format!("[{}]:8081", pod_ipv6(2, 0))), "{:?}", f.backends);
    assert!(r.frontends.iter().any(|f| f.address == "192.168.100.1:30080"), "and the IPv4 one");
    assert!(r.counters.get("ext_new_remote").is_some_and(|c| c.packets > 0), "{:?}", r.counters);
    // `proxy-agent trace` for an IPv6 NodePort names the backend and, for a remote one, the
    // node's IPv6 address as the SNAT source.
    let root = c.node("node-a").bpffs();
    let traced: Vec<proxy_agent::trace::TraceReport> = c.node("node-a").ns.run(move || {
        (0..20u16)
            .map(|p| {
                let from: SocketAddr = format!("[{CLIENT_IP6}]:{}", 41000 + p).parse().unwrap();
                let to: SocketAddr = "[fd00:100::1]:30080".parse().unwrap();
                proxy_agent::trace::run(&root, from, to, proxy_agent::model::Protocol::Tcp).expect("trace")
            })
            .collect()
    });
    for r in &traced {
        assert!(r.backend.as_deref().is_some_and(|b| b.starts_with("[fd00:244:")), "{r:?}");
        let remote = r.verdict == "ext_new_remote";
        assert!(remote || r.verdict == "ext_new_local", "{r:?}");
        assert_eq!(r.snat_address, remote.then(|| "fd00:100::1".parse().unwrap()), "{r:?}");
    }
    // Without endpoints: refused at once (ICMPv6 port unreachable from the node).
    let err = proxy_tests::servers::tcp_ask_any(&c.client, "[fd00:100::1]:30090".parse().unwrap()).expect_err("no endpoints");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
    // The IPv4 NodePort beside it.
    assert_eq!(ask_many(&c, "192.168.100.1:30080", false, 10).len(), 10);
}

/// A node's own processes reach a cluster IP through TC when no socket hooks translate for them
/// (the agents here run with `--cgroup-root none`; with hooks, this is the path they leave a
/// flow whose every backend's tuple is taken from its port): the packets leave by the node's
/// route for the Service address, the egress program on the uplink gives each flow a backend
/// and a port of the SNAT range, and sends it on to a pod of this node or across to the other
/// node; the replies reach the process from the Service. TCP and UDP, real traffic.
#[test]
fn a_node_process_reaches_a_cluster_ip_through_tc_without_socket_hooks() {
    let Some(mut c) = cluster("a_node_process_reaches_a_cluster_ip_through_tc", [&["a1"], &["b1", "b2"]]) else { return };
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &web(""));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a"), (ip(B1), "node-b"), (ip(B2), "node-b")]));
    // A node routes a cluster IP by its default route, as under kube-proxy (here the gateway is
    // the client's address on the uplink's network).
    c.node("node-a").ns.ip(&["route", "add", "default", "via", CLIENT_IP]);
    c.start_agents(&[]);
    c.wait_frontend("10.96.0.10:80", "TCP", 3);
    c.wait_frontend("10.96.0.10:53", "UDP", 3);
    let node = c.node("node-a");
    // Each flow's backend and SNAT port: one per flow (a UDP socket's port that the kernel
    // happens to hand out again within the flow's lifetime is the same flow, as in conntrack).
    let mut flows = BTreeSet::new();
    for udp in [false, true] {
        let mut backends = BTreeSet::new();
        for i in 0..30 {
            let vip = sock(if udp { "10.96.0.10:53" } else { "10.96.0.10:80" });
            let asked =
                if udp { udp_ask(&node.ns, vip).map(|(a, from)| (a, Some(from))) } else { tcp_ask(&node.ns, vip).map(|a| (a, None)) };
            let (answer, from) = asked.unwrap_or_else(|e| panic!("request {i} to {vip} from the node: {e}\n{}", node.agent_log()));
            if let Some(from) = from {
                assert_eq!(from, SocketAddr::V4(vip), "the datagram's answer comes from the Service");
            }
            let SocketAddr::V4(peer) = answer.peer else { panic!("IPv6 peer") };
            assert!(*peer.ip() == node.ip && peer.port() >= 61000, "{vip}: the backend sees the node at a port of the SNAT range: {peer}");
            flows.insert((udp, answer.backend.clone(), peer.port()));
            backends.insert(answer.backend);
        }
        assert_eq!(backends, BTreeSet::from(["a1".to_string(), "b1".into(), "b2".into()]), "udp={udp}: backends on both nodes");
    }
    let r = node.inspect().unwrap();
    let count = |k: &str| r.counters.get(k).map_or(0, |c| c.packets);
    let n = flows.len() as u64;
    assert!(n >= 55, "60 requests took only {n} flows");
    assert!(count("host_flow_new") >= n && count("host_reply") >= n, "{n} flows: {:?}", r.counters);
}

/// The takeover tests' cluster: node A with endpoints a1 and a2, node B with b1, all three the
/// endpoints of `web` (whose spec ends with `spec_extra`).
fn takeover_cluster(test: &str, spec_extra: &str) -> Option<Cluster> {
    let c = cluster(test, [&["a1", "a2"], &["b1"]])?;
    c.write_manifest("nodes.yaml", &nodes_manifest());
    c.write_manifest("web.yaml", &web(spec_extra));
    c.write_manifest("web-eps.yaml", &slice("web", &[(ip(A1), "node-a"), (ip("10.244.1.12"), "node-a"), (ip(B1), "node-b")]));
    Some(c)
}

/// Node A's netfilter as a node with kube-proxy has it: kube-proxy's nat chain `KUBE-SERVICES`
/// from PREROUTING, to which each of `rules` is appended (the chain name is added), beside what
/// keeps netfilter tracking there once kube-proxy's rules are gone: a CNI's masquerade of pods'
/// traffic and a drop of invalid packets. Then `n` TCP connections from the outside client to
/// node A's NodePort 30080 through them, each with its first answer.
fn connections_through_kube_proxy(c: &Cluster, rules: &[&[&str]], n: usize) -> Vec<(proxy_tests::servers::Conn, Answer)> {
    use proxy_tests::{netns::sh, servers::Conn};
    let a = c.node("node-a").ns.name.clone();
    let ipt = |args: &[&str]| sh(&[&["ip", "netns", "exec", &a, "iptables-nft"], args].concat());
    ipt(&["-t", "nat", "-N", "KUBE-SERVICES"]);
    ipt(&["-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES"]);
    ipt(&["-t", "nat", "-A", "POSTROUTING", "-s", "10.244.0.0/16", "!", "-d", "10.244.0.0/16", "-j", "MASQUERADE"]);
    ipt(&["-A", "FORWARD", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP"]);
    for rule in rules {
        ipt(&[&["-t", "nat", "-A", "KUBE-SERVICES"], *rule].concat());
    }
    (0..n)
        .map(|i| {
            let mut conn = Conn::open(&c.client, sock("192.168.100.1:30080"))
                .unwrap_or_else(|e| panic!("connection {i} through kube-proxy's rules: {e}"));
            let first = conn.ask().unwrap_or_else(|e| panic!("connection {i} through kube-proxy's rules: {e}"));
            (conn, first)
        })
        .collect()
}

/// Starts the agents, waits for node A's NodePort 30080 with `endpoints` and its first whole
/// write (after which kube-proxy's rules there are gone), then asks over each of `conns` twice
/// more: each must reach the endpoint it reached first, which must see it come from the same
/// address and port. The first two connections ask without pause from before the agents start
/// until half a second after that write, and must not fail or move either. Node A's log.
fn take_over_keeping(c: &mut Cluster, endpoints: usize, conns: &mut [(proxy_tests::servers::Conn, Answer)]) -> String {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = AtomicBool::new(false);
    let (busy, idle) = conns.split_at_mut(2);
    std::thread::scope(|s| {
        let threads: Vec<_> = busy
            .iter_mut()
            .enumerate()
            .map(|(i, (conn, first))| {
                let stop = &stop;
                s.spawn(move || proxy_tests::servers::ask_until(stop, &format!("busy connection {i}"), first, || conn.ask()))
            })
            .collect();
        c.start_agents(&[]);
        c.wait_frontend_on("node-a", "192.168.100.1:30080", "TCP", endpoints);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !c.node("node-a").agent_log().contains("first whole write done") {
            assert!(std::time::Instant::now() < deadline, "node A's first write:\n{}", c.node("node-a").agent_log());
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            let asked = t.join().expect("a busy connection's thread").unwrap_or_else(|e| panic!("{e}\n{}", c.node("node-a").agent_log()));
            assert!(asked > 100, "a busy connection asked {asked} times");
        }
    });
    let a = c.node("node-a").ns.name.clone();
    let nat = proxy_tests::netns::sh(&["ip", "netns", "exec", &a, "iptables-nft", "-t", "nat", "-S"]);
    assert!(!nat.contains("KUBE-SERVICES"), "kube-proxy's rules are gone:\n{nat}");
    for (i, (conn, first)) in idle.iter_mut().enumerate() {
        for _ in 0..2 {
            let now = conn.ask().unwrap_or_else(|e| {
                panic!("connection {} (to {}) after the takeover: {e}\n{}", i + 2, first.backend, c.node("node-a").agent_log())
            });
            assert_eq!((&now.backend, now.peer), (&first.backend, first.peer), "connection {} stays with its endpoint, as it was", i + 2);
        }
    }
    // The adoption's summary comes at its trailing read, a second or more after the first sync.
    proxy_tests::conformance::eventually("node A's adoption's end", || {
        let log = c.node("node-a").agent_log();
        if log.contains("adopted the connections netfilter translated") {
            Ok(log)
        } else {
            Err(log)
        }
    })
}

/// A takeover on the north path: connections from outside that kube-proxy's rules on node A
/// DNATed to its own endpoints (a NodePort of externalTrafficPolicy Local: no masquerade) are
/// adopted by the agent there and keep their endpoint once its programs serve the NodePort and
/// kube-proxy's rules are gone.
#[test]
fn outside_connections_kube_proxy_translated_to_a_local_endpoint_survive_the_takeover() {
    let Some(mut c) = takeover_cluster("takeover_north", "  externalTrafficPolicy: Local\n") else { return };
    let nodeport = ["-d", "192.168.100.1", "-p", "tcp", "--dport", "30080"];
    let half = [&nodeport[..], &["-m", "statistic", "--mode", "random", "--probability", "0.5"]].concat();
    let mut conns = connections_through_kube_proxy(
        &c,
        &[
            &[&half[..], &["-j", "DNAT", "--to-destination", "10.244.1.11:8080"]].concat(),
            &[&nodeport[..], &["-j", "DNAT", "--to-destination", "10.244.1.12:8080"]].concat(),
        ],
        8,
    );
    assert!(conns.iter().all(|(_, first)| first.peer.ip() == ip(CLIENT_IP)), "kube-proxy's rules kept the client's address");
    let reached: BTreeSet<&String> = conns.iter().map(|(_, first)| &first.backend).collect();
    assert_eq!(reached.len(), 2, "kube-proxy's rules spread the connections: {reached:?}");
    let log = take_over_keeping(&mut c, 2, &mut conns);
    assert!(log.contains("adopted=8"), "node A adopted the 8 connections:\n{log}");
}

/// The same with externalTrafficPolicy Cluster: kube-proxy's rules masquerade the connections
/// too, to node A's address and a port netfilter chose (`--random-fully`), for the endpoints on
/// node A and on node B alike. The agent leaves them to netfilter, whose conntrack entries go
/// on translating them: each keeps its endpoint and the address and port that endpoint sees.
/// New connections are the agent's (the client's address kept for node A's endpoints).
#[test]
fn outside_connections_kube_proxy_masqueraded_stay_netfilters_through_the_takeover() {
    let Some(mut c) = takeover_cluster("takeover_masq", "") else { return };
    let a = c.node("node-a").ns.name.clone();
    proxy_tests::netns::sh(&[
        "ip",
        "netns",
        "exec",
        &a,
        "iptables-nft",
        "-t",
        "nat",
        "-A",
        "POSTROUTING",
        "-m",
        "mark",
        "--mark",
        "0x4000/0x4000",
        "-j",
        "MASQUERADE",
        "--random-fully",
    ]);
    let nodeport = ["-d", "192.168.100.1", "-p", "tcp", "--dport", "30080"];
    // Round robin over the three endpoints (the nat table sees a connection's first packet only).
    let nth = |every: &'static str| [&nodeport[..], &["-m", "statistic", "--mode", "nth", "--every", every, "--packet", "0"]].concat();
    let mut conns = connections_through_kube_proxy(
        &c,
        &[
            &[&nodeport[..], &["-j", "MARK", "--set-xmark", "0x4000/0x4000"]].concat(),
            &[&nth("3")[..], &["-j", "DNAT", "--to-destination", "10.244.1.11:8080"]].concat(),
            &[&nth("2")[..], &["-j", "DNAT", "--to-destination", "10.244.2.11:8080"]].concat(),
            &[&nodeport[..], &["-j", "DNAT", "--to-destination", "10.244.1.12:8080"]].concat(),
        ],
        9,
    );
    let reached: BTreeSet<&str> = conns.iter().map(|(_, first)| first.backend.as_str()).collect();
    assert_eq!(reached, BTreeSet::from(["a1", "a2", "b1"]), "kube-proxy's rules spread the connections over both nodes");
    assert!(
        conns.iter().all(|(_, first)| first.peer.ip() != ip(CLIENT_IP)),
        "kube-proxy's rules masqueraded the client: {:?}",
        conns.iter().map(|(_, f)| f.peer).collect::<Vec<_>>()
    );
    let log = take_over_keeping(&mut c, 3, &mut conns);
    assert!(log.contains("left_to_netfilter=9"), "node A left the 9 connections to netfilter:\n{log}");
    let r = c.node("node-a").inspect().unwrap();
    assert_eq!(r.conntrack.netfilter, 18, "both tuples of each connection are netfilter's");
    let passed = r.counters.get("pass_netfilter").map_or(0, |c| c.packets);
    assert!(passed >= 18, "their packets were passed to netfilter ({passed}): {:?}", r.counters);
    let fresh = ask_many(&c, "192.168.100.1:30080", false, 12);
    let peers = peers_by_backend(&fresh);
    assert!(
        ["a1", "a2"].iter().filter_map(|b| peers.get(*b)).all(|p| p == &BTreeSet::from([ip(CLIENT_IP)])),
        "new connections are the agent's, which keeps the client's address for node A's endpoints: {peers:?}"
    );
}
