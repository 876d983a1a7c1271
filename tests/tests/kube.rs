//! The kube-rs path end to end: the agent's unmodified watchers talk to the in-process API
//! server through a kubeconfig, and real traffic shows what got programmed.

use std::{collections::BTreeMap, net::SocketAddrV4, thread, time::Duration};

use proxy_tests::{
    apiserver::{ApiServer, Kind},
    lab::{self, endpoint_slice, node_manifest, service, sock, standard_objects, Lab, DNS_VIP, WEB_VIP},
    require,
    servers::{http_get, tcp_ask},
};

const AGENT: &str = env!("CARGO_BIN_EXE_proxy-lab-agent");
const METRICS: &str = "127.0.0.1:10249";
const HEALTHZ: &str = "127.0.0.1:10256";

struct KubeLab {
    lab: Lab,
    api: ApiServer,
}

/// A lab with three backends, the standard objects and the Node in the API server, and the
/// agent watching it. `extra`: more agent flags.
fn kube_lab(test: &str, extra: &[&str]) -> Option<KubeLab> {
    let mut k = kube_lab_started(test, extra)?;
    k.lab.wait_programmed(WEB_VIP, "TCP", 3);
    k.lab.wait_programmed(DNS_VIP, "UDP", 3);
    Some(k)
}

/// As `kube_lab`, without waiting for the eBPF maps (for the netfilter modes).
fn kube_lab_started(test: &str, extra: &[&str]) -> Option<KubeLab> {
    if !require::root(test) {
        return None;
    }
    let mut lab = Lab::new(AGENT, 3);
    let api = ApiServer::start(&lab.node, 0);
    api.apply(&node_manifest());
    for obj in standard_objects(&lab.backend_ips()) {
        api.apply(&obj);
    }
    let kubeconfig = lab.dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    lab.start_agent_kube(&kubeconfig, extra);
    Some(KubeLab { lab, api })
}

fn web_slice(lab: &Lab, backends: usize, trigger: Option<&str>) -> String {
    let mut s = endpoint_slice("web", "web-1", &lab.backend_ips()[..backends], &[("http", lab::TCP_PORT, "TCP")]);
    if let Some(t) = trigger {
        s = s
            .replace("  labels:\n", &format!("  annotations:\n    endpoints.kubernetes.io/last-change-trigger-time: \"{t}\"\n  labels:\n"));
    }
    s
}

fn spread(lab: &Lab, n: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for _ in 0..n {
        let a = tcp_ask(&lab.client.ns, sock(WEB_VIP)).expect("request to web");
        *seen.entry(a.backend).or_default() += 1;
    }
    seen
}

/// `metric` once it holds still: the agent records a sync's figures just after it writes the
/// maps, which is what the tests wait for.
fn settled(lab: &Lab, name: &str) -> f64 {
    let mut last = metric(lab, name);
    loop {
        thread::sleep(Duration::from_millis(200));
        let now = metric(lab, name);
        if now == last {
            return now;
        }
        last = now;
    }
}

fn metric(lab: &Lab, name: &str) -> f64 {
    let (code, body) = http_get(&lab.node, sock(METRICS), "/metrics").expect("GET /metrics");
    assert_eq!(code, 200);
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{body}"))
}

fn now_rfc3339() -> String {
    // Seconds and microseconds since the epoch, formatted without a date crate.
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let out = std::process::Command::new("date").args(["-u", "-d", &format!("@{}", d.as_secs()), "+%Y-%m-%dT%H:%M:%S"]).output().unwrap();
    format!("{}.{:06}Z", String::from_utf8_lossy(&out.stdout).trim(), d.subsec_micros())
}

#[test]
fn api_server_objects_steer_traffic_and_follow_changes() {
    let Some(mut k) = kube_lab("api_server_objects_steer_traffic_and_follow_changes", &[]) else { return };
    assert_eq!(spread(&k.lab, 60).len(), 3);
    // The watches use kube-proxy's selectors.
    let reqs = k.api.requests();
    assert!(
        reqs.iter().any(|(kind, q)| kind == "Service" && q.contains("labelSelector=!service.kubernetes.io/service-proxy-name")),
        "{reqs:?}"
    );
    assert!(
        reqs.iter().any(|(kind, q)| kind == "EndpointSlice" && q.contains("labelSelector=!service.kubernetes.io/headless")),
        "{reqs:?}"
    );
    assert!(reqs.iter().any(|(kind, q)| kind == "Node" && q.contains("fieldSelector=metadata.name=lab-node")), "{reqs:?}");

    // An endpoint removed in the API server stops getting flows.
    k.api.apply(&web_slice(&k.lab, 2, None));
    k.lab.wait_programmed(WEB_VIP, "TCP", 2);
    assert!(!spread(&k.lab, 40).contains_key("backend-3"));

    // A Service that another proxy claims is dropped, as the label selector excludes it.
    k.api.apply(&service("web", "10.96.0.10", &[("http", 80, "TCP", lab::TCP_PORT)]).replace(
        "  namespace: default\n",
        "  namespace: default\n  labels:\n    service.kubernetes.io/service-proxy-name: someone-else\n",
    ));
    k.lab.wait_for("web to be dropped", |r| !r.frontends.iter().any(|f| f.address == WEB_VIP));
    assert!(tcp_ask(&k.lab.client.ns, sock(WEB_VIP)).is_err());

    // Back, then deleted.
    k.api.apply(&service("web", "10.96.0.10", &[("http", 80, "TCP", lab::TCP_PORT)]));
    k.lab.wait_programmed(WEB_VIP, "TCP", 2);
    k.api.delete(Kind::Service, "default", "web");
    k.lab.wait_for("web to be removed", |r| !r.frontends.iter().any(|f| f.address == WEB_VIP));
    let (code, mode) = http_get(&k.lab.node, sock(METRICS), "/proxyMode").unwrap();
    assert_eq!((code, mode.as_str()), (200, "ebpf"));
}

#[test]
fn a_watch_cut_mid_way_leaves_no_stale_state() {
    let Some(mut k) = kube_lab("a_watch_cut_mid_way_leaves_no_stale_state", &[]) else { return };
    k.api.cut_watches(true);
    // Changes while the agent reconnects: it must resume from where it was and see them.
    k.api.apply(&web_slice(&k.lab, 1, None));
    k.api.delete(Kind::Service, "default", "dns");
    k.lab.wait_programmed(WEB_VIP, "TCP", 1);
    k.lab.wait_for("dns to be removed", |r| !r.frontends.iter().any(|f| f.address == DNS_VIP));
    assert_eq!(spread(&k.lab, 10).keys().collect::<Vec<_>>(), ["backend-1"]);
    k.api.cut_watches(false);
    k.api.apply(&web_slice(&k.lab, 3, None));
    k.lab.wait_programmed(WEB_VIP, "TCP", 3);
}

#[test]
fn gone_410_leads_to_a_relist_that_converges() {
    let Some(mut k) = kube_lab("gone_410_leads_to_a_relist_that_converges", &[]) else { return };
    let lists_before = k.api.requests().iter().filter(|(kind, q)| kind == "Service" && q.starts_with("watch= ")).count();
    // History is compacted while the agent's watches are cut; what changed meanwhile is only
    // visible in a fresh list.
    k.api.compact();
    k.api.delete(Kind::Service, "default", "dns");
    k.api.apply(&web_slice(&k.lab, 2, None));
    k.api.compact();
    k.lab.wait_for("dns to go after the relist", |r| !r.frontends.iter().any(|f| f.address == DNS_VIP));
    k.lab.wait_programmed(WEB_VIP, "TCP", 2);
    let lists_after = k.api.requests().iter().filter(|(kind, q)| kind == "Service" && q.starts_with("watch= ")).count();
    assert!(lists_after > lists_before, "the 410 must lead to a new list ({lists_before} -> {lists_after})");
    // And the agent keeps watching afterwards.
    k.api.apply(&web_slice(&k.lab, 3, None));
    k.lab.wait_programmed(WEB_VIP, "TCP", 3);
}

#[test]
fn each_endpoint_change_yields_a_programming_latency_sample() {
    let Some(mut k) = kube_lab("each_endpoint_change_yields_a_programming_latency_sample", &[]) else { return };
    let before = settled(&k.lab, "kubeproxy_network_programming_duration_seconds_count");
    let changes_before = settled(&k.lab, "kubeproxy_sync_proxy_rules_endpoint_changes_total");
    for (i, n) in [2, 3, 1].iter().enumerate() {
        k.api.apply(&web_slice(&k.lab, *n, Some(&now_rfc3339())));
        k.lab.wait_programmed(WEB_VIP, "TCP", *n);
        // The sample is recorded right after the maps are written; allow for that.
        let mut got = metric(&k.lab, "kubeproxy_network_programming_duration_seconds_count");
        for _ in 0..20 {
            if got >= before + (i + 1) as f64 {
                break;
            }
            thread::sleep(Duration::from_millis(50));
            got = metric(&k.lab, "kubeproxy_network_programming_duration_seconds_count");
        }
        assert_eq!(got, before + (i + 1) as f64, "one sample per change");
    }
    let changes = metric(&k.lab, "kubeproxy_sync_proxy_rules_endpoint_changes_total") - changes_before;
    assert_eq!(changes, 3.0, "one endpoint change counted per EndpointSlice change");
    assert!(metric(&k.lab, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 1.7e9);
}

#[test]
fn healthz_turns_503_when_programming_stalls_or_the_node_goes() {
    let Some(k) = kube_lab("healthz_turns_503_when_programming_stalls_or_the_node_goes", &["--lb-map-max", "32", "--sync-period", "1s"])
    else {
        return;
    };
    let health = |path: &str| http_get(&k.lab.node, sock(HEALTHZ), path).expect("GET health").0;
    assert_eq!((health("/healthz"), health("/livez")), (200, 200));

    let pods = |third: u8, n: u8| -> Vec<std::net::Ipv4Addr> { (1..=n).map(|i| std::net::Ipv4Addr::new(10, 244, third, i)).collect() };
    // A Service that grows to take more than half of a map alone (21 of 32 entries) is
    // refused whole, said once, and not retried: health does not wait for it, the others keep
    // room, and it keeps serving the endpoints it had.
    let real = k.lab.backend_ips();
    k.api.apply(&service("huge", "10.96.0.76", &[("http", 80, "TCP", lab::TCP_PORT)]));
    k.api.apply(&endpoint_slice("huge", "huge-1", &real, &[("http", lab::TCP_PORT, "TCP")]));
    let ask = || tcp_ask(&k.lab.client.ns, sock("10.96.0.76:80"));
    wait_until("huge served", Duration::from_secs(10), || k.lab.agent_log(), || ask().is_ok());
    let grown: Vec<_> = real.iter().copied().chain(pods(8, 17)).collect();
    k.api.apply(&endpoint_slice("huge", "huge-1", &grown, &[("http", lab::TCP_PORT, "TCP")]));
    wait_until("the refusal", Duration::from_secs(10), || k.lab.agent_log(), || k.lab.agent_log().contains("needs 21 entries"));
    thread::sleep(Duration::from_secs(3));
    let log = k.lab.agent_log();
    assert!(log.contains("service=default/huge") && log.contains("more than the 16 one Service may take"), "{log}");
    assert_eq!((health("/healthz"), log.matches("not programmed:").count()), (200, 1), "{log}");
    assert_eq!(metric(&k.lab, "proxy_agent_services_refused"), 1.0, "a refused Service is counted for alerts");
    for _ in 0..12 {
        ask().expect("the refused Service still reaches the pods it had");
    }

    // Services that each fit but together overflow the maps cannot all be programmed: the
    // change stays pending, and after 2 x --sync-period the proxy is unhealthy.
    k.api.apply(&service("big", "10.96.0.77", &[("http", 80, "TCP", 8080)]));
    k.api.apply(&endpoint_slice("big", "big-1", &pods(9, 12), &[("http", 8080, "TCP")]));
    k.api.apply(&service("bigger", "10.96.0.78", &[("http", 80, "TCP", 8080)]));
    k.api.apply(&endpoint_slice("bigger", "bigger-1", &pods(10, 13), &[("http", 8080, "TCP")]));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while health("/healthz") != 503 {
        assert!(std::time::Instant::now() < deadline, "/healthz never turned 503; log:\n{}", k.lab.agent_log());
        thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(health("/livez"), 503);
    let log = k.lab.agent_log();
    assert!(log.contains("is full"), "the map-full error is logged");
    // The operator is told who holds the room: the largest Service programmed first.
    assert!(log.contains("IPv4 load-balancer entries (masters and slots): default/big (13)"), "{log}");
    // Retried while it fails (2 s, then ever later), but said once, not at every retry.
    thread::sleep(Duration::from_secs(7));
    let log = k.lab.agent_log();
    assert_eq!(log.matches("not programmed:").count(), 2, "each failure is said once, not at every retry:\n{log}");
    // Other Services keep working while one cannot be programmed.
    assert!(tcp_ask(&k.lab.client.ns, sock(WEB_VIP)).is_ok());

    // Remove the culprits: programming catches up and health returns.
    for (svc, slice) in [("big", "big-1"), ("bigger", "bigger-1"), ("huge", "huge-1")] {
        k.api.delete(Kind::EndpointSlice, "default", slice);
        k.api.delete(Kind::Service, "default", svc);
    }
    // Health can return before the last delete (huge) is taken: wait for both.
    let refused = || metric(&k.lab, "proxy_agent_services_refused");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while health("/healthz") != 200 || refused() != 0.0 {
        if std::time::Instant::now() >= deadline {
            assert_eq!(health("/healthz"), 200, "/healthz never recovered; log:\n{}", k.lab.agent_log());
            assert_eq!(refused(), 0.0, "a refused Service deleted is not counted; log:\n{}", k.lab.agent_log());
        }
        thread::sleep(Duration::from_millis(200));
    }

    // The Node being deleted: /healthz fails (so load balancers drain it), /livez does not.
    k.api.apply(&node_manifest().replace("  name: lab-node\n", "  name: lab-node\n  deletionTimestamp: \"2026-11-21T09:00:00Z\"\n"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while health("/healthz") != 503 {
        assert!(std::time::Instant::now() < deadline, "/healthz ignored the Node deletion");
        thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(health("/livez"), 200);
    let (_, body) = http_get(&k.lab.node, sock(HEALTHZ), "/healthz").unwrap();
    assert!(body.contains("\"nodeEligible\": false"), "{body}");
}

/// The fallback modes report the Node's state as the eBPF dataplane does: a Node that goes
/// away makes `/healthz` fail, so load balancers stop sending to the node.
#[test]
fn netfilter_modes_health_follows_the_node() {
    let Some(KubeLab { lab, api }) =
        kube_lab_started("netfilter_modes_health_follows_the_node", &["--proxy-mode", "nftables", "--cluster-cidr", "10.244.0.0/16"])
    else {
        return;
    };
    let health = |path: &str| http_get(&lab.node, sock(HEALTHZ), path).map(|r| r.0).unwrap_or(0);
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while tcp_ask(&lab.client.ns, sock(WEB_VIP)).is_err() || health("/healthz") != 200 {
        assert!(std::time::Instant::now() < deadline, "nftables mode never served web; log:\n{}", lab.agent_log());
        thread::sleep(Duration::from_millis(200));
    }
    api.delete(Kind::Node, "", "lab-node");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while health("/healthz") != 503 {
        assert!(std::time::Instant::now() < deadline, "/healthz ignored the Node's deletion; log:\n{}", lab.agent_log());
        thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(health("/livez"), 200, "the proxy itself is alive");
    // Services keep working meanwhile.
    assert!(tcp_ask(&lab.client.ns, sock(WEB_VIP)).is_ok());
}

#[test]
fn bad_objects_are_named_and_never_stop_the_watch() {
    let Some(mut k) = kube_lab("bad_objects_are_named_and_never_stop_the_watch", &[]) else { return };
    k.api.apply(&service("bad-ip", "10.96.0.300", &[("http", 80, "TCP", 8080)]));
    k.api.apply(&service("bad-port", "10.96.0.31", &[("http", 7000, "TCP", 8080)]).replace("port: 7000", "port: 70000"));
    k.api.apply(&service("zero-port", "10.96.0.32", &[("http", 0, "TCP", 8080)]));
    k.api.apply(
        &endpoint_slice("web", "orphan", &k.lab.backend_ips(), &[("http", 8080, "TCP")])
            .replace("  labels:\n    kubernetes.io/service-name: web\n", ""),
    );
    k.api.apply(
        &endpoint_slice("web", "weird", &k.lab.backend_ips(), &[("http", 8080, "TCP")]).replace("addressType: IPv4", "addressType: IPv5"),
    );
    // A valid change after them is still applied: the watch goes on.
    k.api.apply(&web_slice(&k.lab, 1, None));
    k.lab.wait_programmed(WEB_VIP, "TCP", 1);
    let log = k.lab.agent_log();
    for want in [
        "Service default/bad-ip",
        "\"10.96.0.300\" is not a valid IP address",
        "Service default/bad-port",
        "70000 is out of range",
        "Service default/zero-port",
        "port 0 is out of range",
        "EndpointSlice default/orphan",
        "kubernetes.io/service-name",
        "EndpointSlice default/weird",
        "addressType \"IPv5\" is unknown",
    ] {
        assert!(log.contains(want), "the log must say {want:?}:\n{log}");
    }
    assert!(k.lab.agent_running());
}

#[test]
fn an_unreachable_api_server_at_start_is_retried_while_pins_keep_serving() {
    let Some(mut k) = kube_lab("an_unreachable_api_server_at_start_is_retried_while_pins_keep_serving", &[]) else { return };
    k.lab.kill_agent();
    // A port nobody listens on yet.
    let port = k.lab.node.run(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
    let later = format!("127.0.0.1:{port}").parse::<SocketAddrV4>().unwrap();
    let kubeconfig = k.lab.dir.join("kubeconfig-later");
    std::fs::write(
        &kubeconfig,
        std::fs::read_to_string(k.lab.dir.join("kubeconfig")).unwrap().replace(&k.api.addr.to_string(), &later.to_string()),
    )
    .unwrap();
    k.lab.start_agent_kube(&kubeconfig, &[]);
    thread::sleep(Duration::from_secs(2));
    assert!(k.lab.agent_running(), "the agent must keep retrying, not exit:\n{}", k.lab.agent_log());
    assert_eq!(spread(&k.lab, 30).len(), 3, "the pinned state keeps serving meanwhile");

    let api = ApiServer::start(&k.lab.node, port);
    api.apply(&node_manifest());
    for obj in standard_objects(&k.lab.backend_ips()[..2]) {
        api.apply(&obj);
    }
    k.lab.wait_programmed(WEB_VIP, "TCP", 2);
    assert_eq!(spread(&k.lab, 30).len(), 2);
}

#[test]
fn a_burst_of_changes_is_programmed_in_fewer_syncs_and_a_lone_change_after_it() {
    let Some(mut k) = kube_lab("a_burst_of_changes_is_programmed_in_fewer_syncs_and_a_lone_change_after_it", &[]) else { return };
    let syncs = |lab: &Lab| settled(lab, "kubeproxy_sync_proxy_rules_duration_seconds_count");
    k.api.apply(&web_slice(&k.lab, 1, None));
    k.lab.wait_programmed(WEB_VIP, "TCP", 1);
    let before = syncs(&k.lab);
    // Every change but the last alternates 2 and 1 backends; only the last has 3, so the maps
    // show 3 once the whole burst is in.
    const CHANGES: usize = 200;
    for i in 0..CHANGES - 1 {
        k.api.apply(&web_slice(&k.lab, 2 - i % 2, None));
    }
    k.api.apply(&web_slice(&k.lab, 3, None));
    k.lab.wait_programmed(WEB_VIP, "TCP", 3);
    let used = syncs(&k.lab) - before;
    assert!(used < CHANGES as f64, "{CHANGES} queued changes must be coalesced, took {used} syncs");
    // A lone change after it is programmed too (how soon is the control bench's figure).
    let t = std::time::Instant::now();
    k.api.apply(&web_slice(&k.lab, 2, None));
    k.lab.wait_programmed(WEB_VIP, "TCP", 2);
    eprintln!("lone change programmed after {:?} (incl. polling)", t.elapsed());
}

fn wait_until(what: &str, limit: Duration, log: impl Fn() -> String, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}; log:\n{}", log());
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_stalled_watch_is_restarted_and_healthz_says_so_meanwhile() {
    let Some(k) = kube_lab("a_stalled_watch_is_restarted_and_healthz_says_so_meanwhile", &["--watch-stall-timeout", "3s"]) else { return };
    let healthz = || http_get(&k.lab.node, sock(HEALTHZ), "/healthz").unwrap_or((0, String::new()));
    assert_eq!(healthz().0, 200);
    // The EndpointSlice watch now trickles a byte every half second and never a whole event.
    k.api.set_hostile(Kind::EndpointSlice, Some(proxy_tests::apiserver::Hostile::Trickle));
    wait_until(
        "/healthz to say the watch brings nothing",
        Duration::from_secs(15),
        || k.lab.agent_log(),
        || {
            let (code, body) = healthz();
            code == 503 && body.contains("\"stalledWatches\": [\"endpointslices\"]")
        },
    );
    assert!(k.lab.agent_log().contains("no complete watch event or bookmark for 3 s"), "{}", k.lab.agent_log());
    // A change made meanwhile, and the server behaving again: the agent catches up.
    k.api.apply(&web_slice(&k.lab, 2, None));
    k.api.set_hostile(Kind::EndpointSlice, None);
    wait_until("/healthz to recover", Duration::from_secs(15), || k.lab.agent_log(), || healthz().0 == 200);
    let mut lab = k.lab;
    lab.wait_programmed(WEB_VIP, "TCP", 2);
}

#[test]
fn an_endless_watch_line_is_cut_and_memory_stays_bounded() {
    let Some(k) = kube_lab("an_endless_watch_line_is_cut_and_memory_stays_bounded", &[]) else { return };
    let pid = k.lab.agent_pid().expect("agent running");
    let before = lab::rss_mib(pid);
    k.api.set_hostile(Kind::EndpointSlice, Some(proxy_tests::apiserver::Hostile::EndlessLine));
    wait_until(
        "the endless line to be cut",
        Duration::from_secs(30),
        || k.lab.agent_log(),
        || k.lab.agent_log().contains("one line is over 16 MiB"),
    );
    // Several times over, while the server keeps at it: the footprint stays bounded.
    let mut peak = 0;
    for _ in 0..20 {
        peak = peak.max(lab::rss_mib(pid));
        thread::sleep(Duration::from_millis(100));
    }
    assert!(peak < before + 200, "resident memory stays bounded: {before} MiB before, {peak} MiB at most while hostile");
    assert_eq!(http_get(&k.lab.node, "127.0.0.1:10249".parse().unwrap(), "/metrics").expect("/metrics").0, 200);
    k.api.set_hostile(Kind::EndpointSlice, None);
    k.api.apply(&web_slice(&k.lab, 2, None));
    let mut lab = k.lab;
    lab.wait_programmed(WEB_VIP, "TCP", 2);
    assert!(lab::rss_mib(pid) < before + 100, "and comes back down: {} MiB", lab::rss_mib(pid));
}

/// ServiceCIDRs from the API server: with one, a cluster IP's unserved port is refused; without
/// it again, nothing is checked. An API server that does not serve them (before 1.33) is said
/// once and changes nothing else.
#[test]
fn service_cidrs_are_watched_and_an_api_server_without_them_changes_nothing() {
    let Some(k) = kube_lab("service_cidrs_are_watched_and_an_api_server_without_them_changes_nothing", &[]) else { return };
    let unserved = sock("10.96.0.10:81");
    k.api.apply("apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16]}\n");
    wait_until(
        "the unserved port to be refused",
        Duration::from_secs(15),
        || k.lab.agent_log(),
        || tcp_ask(&k.lab.client.ns, unserved).is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused),
    );
    let c = k.lab.inspect().expect("inspect").counters;
    assert!(c.get("reject_cluster_ip_port").is_some_and(|c| c.packets >= 1), "{c:?}");
    assert!(k.api.requests().iter().any(|(kind, _)| kind == "ServiceCIDR"), "the agent watches ServiceCIDRs");
    k.api.delete(Kind::ServiceCidr, "", "kubernetes");
    wait_until(
        "the check to go with the ServiceCIDR",
        Duration::from_secs(15),
        || k.lab.agent_log(),
        || tcp_ask(&k.lab.client.ns, unserved).is_err_and(|e| e.kind() != std::io::ErrorKind::ConnectionRefused),
    );

    // An API server before 1.33.
    let mut lab = Lab::new(AGENT, 3);
    let api = ApiServer::start(&lab.node, 0);
    api.without_service_cidrs();
    api.apply(&node_manifest());
    for obj in standard_objects(&lab.backend_ips()) {
        api.apply(&obj);
    }
    let kubeconfig = lab.dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    lab.start_agent_kube(&kubeconfig, &[]);
    lab.wait_programmed(WEB_VIP, "TCP", 3);
    assert_eq!(spread(&lab, 30).len(), 3);
    lab.wait_log("ServiceCIDRs cannot be watched", 1);
    let (code, _) = http_get(&lab.node, sock(HEALTHZ), "/healthz").unwrap();
    assert_eq!(code, 200, "healthy without ServiceCIDRs");
    thread::sleep(Duration::from_secs(3));
    let log = lab.agent_log();
    assert_eq!(log.matches("ServiceCIDRs cannot be watched").count(), 1, "said once, however often it is retried:\n{log}");
}

/// Lists larger than a page (the agent asks for 5,000 Services or 2,000 EndpointSlices at a
/// time) are read page by page through continue tokens, and every object of every page is
/// programmed: 12,000 Services with a slice each, beside the standard ones.
#[test]
fn lists_larger_than_a_page_are_read_page_by_page() {
    if !require::root("lists_larger_than_a_page_are_read_page_by_page") {
        return;
    }
    const N: u32 = 12_000;
    let mut lab = Lab::new(AGENT, 3);
    let api = ApiServer::start(&lab.node, 0);
    api.apply(&node_manifest());
    for obj in standard_objects(&lab.backend_ips()) {
        api.apply(&obj);
    }
    let vip = |i: u32| std::net::Ipv4Addr::from(0x0a60_1000 + i);
    for i in 0..N {
        let name = format!("paged-{i}");
        api.apply(&service(&name, &vip(i).to_string(), &[("http", 80, "TCP", lab::TCP_PORT)]));
        api.apply(&endpoint_slice(&name, &format!("{name}-1"), &lab.backend_ips()[..1], &[("http", lab::TCP_PORT, "TCP")]));
    }
    let kubeconfig = lab.dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    lab.start_agent_kube(&kubeconfig, &[]);
    // (12,000 Services listed in pages, then programmed in one sync: 15 s was once not enough
    // with the IPVS guest's qemu running beside it on this 2-core machine, the sync then near
    // its end.)
    lab.wait_programmed_within(WEB_VIP, "TCP", 3, std::time::Duration::from_secs(60));
    // One Service of a late page (names sort as text), with its endpoint.
    lab.wait_programmed(&format!("{}:80", vip(N - 1)), "TCP", 1);
    let r = lab.inspect().expect("inspect");
    let paged = r
        .frontends
        .iter()
        .filter_map(|f| f.address.parse::<SocketAddrV4>().ok())
        .filter(|a| (vip(0)..=vip(N - 1)).contains(a.ip()))
        .count();
    assert_eq!(paged, N as usize, "every paged Service is programmed");
    let reqs = api.requests();
    for (kind, limit) in [("Service", 5_000), ("EndpointSlice", 2_000)] {
        let pages = reqs
            .iter()
            .filter(|(k, q)| {
                k == kind && q.starts_with("watch= ") && q.contains(&format!("limit={limit} ")) && q.contains("continue=page-")
            })
            .count();
        assert!(pages >= 2, "{kind}: the list was read in pages of {limit} ({pages} continued)");
    }
}

/// After a restart over a large nftables table (more than the 1,000 Services written in one
/// transaction), the mode writes it again in steps, one per sync, and the control loop goes
/// from step to step by itself: a chain someone left in the table is removed at the end (the
/// last step's leftover removal) with no change to set it off, and a Service created right
/// after the restart, while the steps run, is served.
#[test]
fn nftables_writes_a_large_table_again_step_by_step_on_its_own() {
    let test = "nftables_writes_a_large_table_again_step_by_step_on_its_own";
    let extra = ["--proxy-mode", "nftables", "--cluster-cidr", "10.244.0.0/16"];
    let Some(KubeLab { mut lab, api }) = kube_lab_started(test, &extra) else {
        return;
    };
    let backends = lab.backend_ips();
    let vip = |i: u32| std::net::Ipv4Addr::from(0x0a60_6400 + i);
    for i in 0..1200 {
        let name = format!("bulk-{i}");
        api.apply(&service(&name, &vip(i).to_string(), &[("http", 80, "TCP", lab::TCP_PORT)]));
        api.apply(&endpoint_slice(&name, &format!("{name}-1"), &backends, &[("http", lab::TCP_PORT, "TCP")]));
    }
    let node = lab.node.name.clone();
    let nft = |args: &[&str]| proxy_tests::netns::sh(&[&["ip", "netns", "exec", &node, "nft"], args].concat());
    let ask = |lab: &Lab, to: std::net::Ipv4Addr| tcp_ask(&lab.client.ns, SocketAddrV4::new(to, 80));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while ask(&lab, vip(1199)).is_err() {
        assert!(std::time::Instant::now() < deadline, "the 1,200 Services were never served; log:\n{}", lab.agent_log());
        thread::sleep(Duration::from_millis(200));
    }
    nft(&["add", "chain", "ip", "kube-proxy", "left-by-someone"]);
    lab.stop_agent();
    let kubeconfig = lab.dir.join("kubeconfig");
    lab.start_agent_kube(&kubeconfig, &extra);
    api.apply(&service("late", "10.96.99.1", &[("http", 80, "TCP", lab::TCP_PORT)]));
    api.apply(&endpoint_slice("late", "late-1", &backends, &[("http", lab::TCP_PORT, "TCP")]));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while nft(&["-t", "list", "chains", "ip"]).contains("left-by-someone") || ask(&lab, "10.96.99.1".parse().unwrap()).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the write after the restart never ended, or the Service created meanwhile was never served; log:\n{}",
            lab.agent_log()
        );
        thread::sleep(Duration::from_millis(200));
    }
    assert!(ask(&lab, vip(0)).is_ok() && tcp_ask(&lab.client.ns, sock(WEB_VIP)).is_ok(), "Services served throughout are served after");
    assert!(!lab.agent_log().contains("applying the rules failed"), "{}", lab.agent_log());
}
