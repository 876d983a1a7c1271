//! The conformance suite (tests/src/conformance.rs) in every mode this kernel runs: ebpf,
//! iptables and nftables. IPVS needs a kernel with IPVS: its run is `ipvs_in_a_guest`
//! (tests/tests/ipvs_guest.rs), which boots Debian's kernel in qemu and runs the same
//! scenarios there.

use std::path::PathBuf;

use proxy_agent::dataplane::ProxyMode;
use proxy_tests::{conformance, require};

fn agent() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_proxy-lab-agent"))
}

fn run(mode: ProxyMode, scenario: &str) {
    if !require::root(&format!("conformance {scenario} ({mode})")) {
        return;
    }
    let (_, f) = conformance::SCENARIOS.iter().find(|(n, _)| *n == scenario).expect("known scenario");
    f(&agent(), mode);
}

/// Each scenario a test of its own in every mode's module (`ebpf::node_port_from_outside`...).
macro_rules! suite {
    ($($scenario:ident),* $(,)?) => {
        /// The scenarios the modules below run (`every_scenario_is_in_the_suite`).
        const SUITE: &[&str] = &[$(stringify!($scenario)),*];
        suite!(@mode ebpf, ProxyMode::Ebpf, $($scenario),*);
        suite!(@mode iptables, ProxyMode::Iptables, $($scenario),*);
        suite!(@mode nftables, ProxyMode::Nftables, $($scenario),*);
    };
    (@mode $mode:ident, $m:expr, $($scenario:ident),*) => {
        mod $mode {
            use super::*;
            $(
                #[test]
                fn $scenario() {
                    run($m, stringify!($scenario))
                }
            )*
        }
    };
}

suite!(
    clusterip_tcp_and_udp_reach_every_backend,
    a_service_without_endpoints_refuses,
    endpoint_changes_are_followed,
    services_with_the_longest_names_are_served,
    an_external_ip_does_not_take_another_services_cluster_ip,
    a_pod_reaching_its_own_service_gets_through,
    a_connection_tried_before_its_service_existed_gets_through,
    node_port_from_outside,
    external_traffic_policy_local,
    internal_traffic_policy_local,
    load_balancer_and_external_ips,
    client_ip_affinity,
    a_node_port_without_endpoints_refuses,
    xdp_forwards_north_south,
    maglev_agreement,
    service_cidrs_drop_free_addresses_and_reject_unserved_ports,
    path_mtu_discovery_through_a_service,
    path_mtu_discovery_through_a_node_port,
    ipv6_services,
);

/// Not a scenario of every mode (IPVS state cannot be loaded on this kernel): taking a node
/// over from kube-proxy, and going back.
mod takeover {
    use super::*;

    fn takeover(mode: ProxyMode) {
        if require::root(&format!("taking over from kube-proxy ({mode})")) {
            conformance::taking_over_from_kube_proxy(&agent(), mode);
        }
    }

    #[test]
    fn ebpf() {
        takeover(ProxyMode::Ebpf)
    }
    #[test]
    fn iptables() {
        takeover(ProxyMode::Iptables)
    }
    #[test]
    fn nftables() {
        takeover(ProxyMode::Nftables)
    }

    #[test]
    fn ebpf_removes_kube_proxys_chains_another_chain_jumps_into() {
        if require::root("the eBPF mode's removal of kube-proxy's chains another jumps into") {
            conformance::takeover_removes_chains_another_jumps_into(&agent());
        }
    }

    #[test]
    fn ebpf_adopts_the_connections_kube_proxy_translated() {
        if require::root("the eBPF mode's adoption of the connections kube-proxy translated") {
            conformance::takeover_adopts_translated_connections(&agent(), true);
        }
    }

    #[test]
    fn ebpf_adopts_them_where_netfilter_picks_up_no_connection_in_mid_stream() {
        if require::root("the eBPF mode's adoption with nf_conntrack_tcp_loose 0") {
            conformance::takeover_adopts_translated_connections(&agent(), false);
        }
    }

    #[test]
    fn ebpf_adopts_the_connections_opened_during_its_first_write() {
        if require::root("the eBPF mode's adoption of connections opened during its first write") {
            conformance::takeover_adopts_connections_opened_during_the_first_write(&agent());
        }
    }

    #[test]
    fn ebpf_adopts_the_connections_answered_after_its_first_sync() {
        let what = "the eBPF mode's adoption of connections answered after its first sync";
        if require::root(what) && require::nfqueue(what) {
            conformance::takeover_adopts_connections_answered_after_the_first_sync(&agent());
        }
    }

    /// The adoption's deletion of netfilter's entries, in batches of requests: 150 entries made
    /// in a namespace of the test's own (more than two batches), with 10 tuples that have none
    /// among them, each deleted and told apart.
    #[test]
    fn ctnetlink_deletes_in_batches_and_tells_each_result() {
        if !require::root("ctnetlink deletions in a namespace") {
            return;
        }
        use proxy_agent::dataplane::netfilter::conntrack::{Forgetter, Translated};
        let ns = proxy_tests::netns::Netns::create(format!("ctb-{}", proxy_tests::netns::unique_id()));
        let flows: Vec<Translated> = (0..160u16)
            .map(|i| Translated {
                proto: libc::IPPROTO_TCP as u8,
                client: format!("10.244.0.2:{}", 20000 + i).parse().unwrap(),
                service: "10.96.0.10:80".parse().unwrap(),
                backend: "10.244.1.3:8080".parse().unwrap(),
                masquerade: None,
            })
            .collect();
        for t in flows.iter().filter(|t| t.client.port() % 16 != 0) {
            dnat_entry(&ns.name, t);
        }
        let results = ns.run(move || Forgetter::new().expect("ctnetlink socket").forget_all(&flows).expect("batched deletions"));
        let deleted: Vec<bool> = results.into_iter().map(|r| r.expect("each deletion is done or finds nothing")).collect();
        let expected: Vec<bool> = (0..160u16).map(|i| (20000 + i) % 16 != 0).collect();
        assert_eq!(deleted, expected, "true where an entry was deleted, false where there was none");
        let left = proxy_tests::netns::sh(&["ip", "netns", "exec", &ns.name, "conntrack", "-L"]);
        assert!(!left.contains("src="), "nothing is left:\n{left}");
    }

    /// Writes, in namespace `ns`, the conntrack entry kube-proxy's DNAT leaves for the TCP
    /// connection `t` (client -> Service, replies from the backend), established.
    fn dnat_entry(ns: &str, t: &proxy_agent::dataplane::netfilter::conntrack::Translated) {
        let (client, service, backend) = (t.client.ip().to_string(), t.service.ip().to_string(), t.backend.ip().to_string());
        let (cport, sport, bport) = (t.client.port().to_string(), t.service.port().to_string(), t.backend.port().to_string());
        proxy_tests::netns::sh(&[
            "ip",
            "netns",
            "exec",
            ns,
            "conntrack",
            "-I",
            "-p",
            "tcp",
            "-s",
            &client,
            "-d",
            &service,
            "--sport",
            &cport,
            "--dport",
            &sport,
            "-r",
            &backend,
            "-q",
            &client,
            "--reply-port-src",
            &bport,
            "--reply-port-dst",
            &cport,
            "--state",
            "ESTABLISHED",
            "-t",
            "300",
            "-u",
            "ASSURED",
        ]);
    }

    /// The adoption's replacement of netfilter's entries: each adopted connection's, as our
    /// programs' translation leaves it (client -> backend), answered (a TCP connection
    /// established), in both families, where the old one (client -> Service) is deleted; made
    /// again, each is found there already (and no old one).
    #[test]
    fn ctnetlink_makes_the_entries_of_translated_connections() {
        if !require::root("ctnetlink creations in a namespace") {
            return;
        }
        use proxy_agent::dataplane::netfilter::conntrack::{Forgetter, Translated};
        let ns = proxy_tests::netns::Netns::create(format!("ctm-{}", proxy_tests::netns::unique_id()));
        let flow = |client: &str, service: &str, backend: &str| Translated {
            proto: if client.ends_with(":53000") { libc::IPPROTO_UDP } else { libc::IPPROTO_TCP } as u8,
            client: client.parse().unwrap(),
            service: service.parse().unwrap(),
            backend: backend.parse().unwrap(),
            masquerade: None,
        };
        let flows = [
            flow("10.244.0.2:40000", "10.96.0.10:80", "10.244.1.3:8080"),
            flow("192.0.2.9:50000", "192.168.0.4:30080", "10.244.1.4:8080"),
            flow("[fd00:244::2]:40000", "[fd00:96::10]:80", "[fd00:244:1::3]:8080"),
            flow("10.244.0.2:53000", "10.96.0.53:53", "10.244.1.3:5353"),
        ];
        // The first connection's entry as kube-proxy's DNAT left it.
        dnat_entry(&ns.name, &flows[0]);
        let (made, again) = ns.run(move || {
            let mut f = Forgetter::new().expect("ctnetlink socket");
            (f.replace_all(&flows).expect("replaced"), f.replace_all(&flows).expect("replaced again"))
        });
        let ok =
            |r: Vec<[std::io::Result<bool>; 2]>| r.into_iter().map(|d| d.map(|r| r.expect("each is done or found"))).collect::<Vec<_>>();
        let first = [vec![[true, true]], vec![[false, true]; 3]].concat();
        assert_eq!((ok(made), ok(again)), (first, vec![[false, false]; 4]), "the old entry deleted and the new ones made, then found");
        let listed = proxy_tests::netns::sh(&["ip", "netns", "exec", &ns.name, "conntrack", "-L", "-f", "ipv4"])
            + &proxy_tests::netns::sh(&["ip", "netns", "exec", &ns.name, "conntrack", "-L", "-f", "ipv6"]);
        for want in [
            "ESTABLISHED src=10.244.0.2 dst=10.244.1.3 sport=40000 dport=8080 src=10.244.1.3 dst=10.244.0.2 sport=8080 dport=40000 [ASSURED]",
            "ESTABLISHED src=192.0.2.9 dst=10.244.1.4 sport=50000 dport=8080 src=10.244.1.4 dst=192.0.2.9 sport=8080 dport=50000 [ASSURED]",
            "ESTABLISHED src=fd00:244::2 dst=fd00:244:1::3 sport=40000 dport=8080 src=fd00:244:1::3 dst=fd00:244::2 sport=8080 dport=40000 [ASSURED]",
            "src=10.244.0.2 dst=10.244.1.3 sport=53000 dport=5353 src=10.244.1.3 dst=10.244.0.2 sport=5353 dport=53000 [ASSURED]",
        ] {
            assert!(listed.contains(want), "{want}:\n{listed}");
        }
        assert!(!listed.contains("dst=10.96.0.10"), "the old entry is gone:\n{listed}");
    }

    /// What lets the eBPF mode leave kube-proxy's rules in place until its first write: a
    /// packet to an address its maps do not hold passes the attached programs untouched, and
    /// netfilter's DNAT (kube-proxy's, here a rule of the same form) translates it, replies
    /// included.
    #[test]
    fn ebpf_passes_what_its_maps_do_not_hold_to_netfilter() {
        if !require::root("the eBPF mode beside netfilter's DNAT") {
            return;
        }
        use proxy_tests::servers::tcp_ask;
        let lab = conformance::lab(&agent(), ProxyMode::Ebpf);
        let backend = lab.backend_ips()[0];
        let to = format!("{backend}:{}", proxy_tests::lab::TCP_PORT);
        let rule =
            ["-t", "nat", "-I", "PREROUTING", "-d", "172.30.0.10/32", "-p", "tcp", "--dport", "80", "-j", "DNAT", "--to-destination", &to];
        let node = lab.node.name.clone();
        let mut args = vec!["netns", "exec", &node, "iptables-nft"];
        args.extend(rule);
        let status = std::process::Command::new("ip").args(&args).status().expect("iptables-nft");
        assert!(status.success(), "iptables-nft {rule:?}");
        let answer = tcp_ask(&lab.client.ns, "172.30.0.10:80".parse().unwrap()).expect("netfilter's DNAT serves what the maps do not hold");
        assert_eq!(answer.backend, "backend-1", "{answer:?}");
    }
}

/// Not a scenario of every mode: localhost NodePorts are served by the iptables mode (as
/// kube-proxy's) and by the eBPF mode's socket hooks, not by nftables (as kube-proxy's).
mod localhost_node_ports {
    use super::*;

    fn check(mode: ProxyMode, enabled: bool) {
        if require::root(&format!("localhost NodePorts ({mode})")) {
            conformance::localhost_node_ports(&agent(), mode, enabled);
        }
    }

    #[test]
    fn iptables_serves_them_by_default() {
        check(ProxyMode::Iptables, true)
    }
    #[test]
    fn iptables_does_not_when_told_not_to() {
        check(ProxyMode::Iptables, false)
    }
    #[test]
    fn ebpf_serves_them_by_default() {
        check(ProxyMode::Ebpf, true)
    }
    #[test]
    fn ebpf_does_not_when_told_not_to() {
        check(ProxyMode::Ebpf, false)
    }
    #[test]
    fn nftables_does_not_as_kube_proxy() {
        check(ProxyMode::Nftables, true)
    }
}

/// Not a scenario of every mode: which iptables the iptables mode writes to.
#[test]
fn iptables_backend_auto_and_switching() {
    if !require::root("iptables backends") {
        return;
    }
    conformance::iptables_backends(&agent());
}

#[test]
fn every_scenario_is_in_the_suite() {
    let library: std::collections::BTreeSet<&str> = conformance::SCENARIOS.iter().map(|(name, _)| *name).collect();
    let suite: std::collections::BTreeSet<&str> = SUITE.iter().copied().collect();
    assert_eq!(suite, library, "every scenario of the library runs in every mode, and nothing else");
    assert_eq!((SUITE.len(), conformance::SCENARIOS.len()), (suite.len(), library.len()), "none listed twice");
}

/// IPVS mode's cleanup, which runs whenever another mode starts, leaves the iptables mode's
/// nat jumps alone where IPVS mode never ran: they are the same rules, and a starting iptables
/// mode would otherwise translate no new connection until its first sync.
#[test]
fn ipvs_cleanup_leaves_the_iptables_modes_jumps() {
    if !require::root("ipvs cleanup beside the iptables mode") {
        return;
    }
    use proxy_agent::dataplane::netfilter::{ipvs, Iptables};
    use proxy_tests::{
        lab::{sock, WEB_VIP},
        servers::tcp_ask,
    };
    let mut lab = conformance::lab(&agent(), ProxyMode::Iptables);
    // The agent's own syncs must not put back what the cleanup takes.
    lab.kill_agent();
    let removed: Vec<String> = lab.node.run(|| [Iptables::Nft, Iptables::Legacy].into_iter().flat_map(ipvs::cleanup_iptables).collect());
    assert!(removed.is_empty(), "IPVS mode never ran here, yet its cleanup removed {removed:?}");
    let answer = tcp_ask(&lab.client.ns, sock(WEB_VIP)).expect("a new connection to the Service is still translated");
    assert!(answer.backend.starts_with("backend-"), "{answer:?}");
}
