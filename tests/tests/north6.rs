//! IPv6 north-south packet tables: frames arriving on an external interface through the real
//! TC external ingress program (which tail-calls the IPv6 ones) and XDP, inside a namespace of
//! the test's own whose IPv6 routes and neighbours the programs' FIB lookups use. Outputs are
//! dissected and every checksum is verified independently (`packet6`).

use std::net::SocketAddrV6;

use proxy_agent::{
    dataplane::{ebpf::EbpfDataplane, Dataplane},
    model::{Backend, Frontend, FrontendKey, FrontendKind, ObjectKey, Protocol, ServicePortName},
};
use proxy_common::{xdp_dev, CtEntry, CtKey, Ip6};
use proxy_tests::{
    netns::{enter, ifindex, routed_uplink_node, Netns},
    packet::{ACK, SYN, TCP},
    packet6::{self, dissect, tcp_frame, udp_frame, Ipv6, ICMPV6},
    require,
    testrun::{self, counters, run_egress, run_ext, run_xdp, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, XDP_PASS, XDP_TX},
};

const NODE_IP: &str = "fd00:50::1";
const ROUTER_MAC: [u8; 6] = [0x02, 0x50, 0, 0, 0, 0x02];
const NODE_MAC: [u8; 6] = [0x02, 0x50, 0, 0, 0, 0x01];
const CLIENT: &str = "[2001:db8:100::7]:40000";
const NODE_PORT: &str = "[fd00:50::1]:30080";
const REMOTE: &str = "[fd00:244:2::5]:8080";
const LOCAL: &str = "[fd00:244:1::5]:8080";

fn sock(s: &str) -> SocketAddrV6 {
    s.parse().unwrap()
}

/// A node namespace with one external interface (`ext0`, fd00:50::1/64 beside an IPv4
/// address) whose next hop (fd00:50::2) leads to the client's network and to the other node's
/// pods. The test's thread enters it, so the programs' FIB lookups see its routes.
struct Node {
    _ns: Netns,
    ifindex: u32,
    dp: EbpfDataplane,
}

fn node(test: &str) -> Option<Node> {
    if !require::root(test) {
        return None;
    }
    let ns = routed_uplink_node("pxn6", true);
    enter(&ns.file()).expect("enter the node namespace");
    let ifindex = ifindex("ext0");
    let mut dp = testrun::dataplane();
    dp.set_interface_address(ifindex, Some("192.168.50.1".parse().unwrap())).unwrap();
    dp.set_interface_address6(ifindex, Some(NODE_IP.parse().unwrap())).unwrap();
    dp.set_xdp_devices(&[(ifindex, xdp_dev::TX | xdp_dev::XMIT)].into()).unwrap();
    Some(Node { _ns: ns, ifindex, dp })
}

fn backend(s: &str, local: bool) -> Backend {
    let s = sock(s);
    Backend { addr: (*s.ip()).into(), port: s.port(), terminating: false, local }
}

fn node_port(n: &mut Node, backends: Vec<Backend>) {
    node_port_of(n, Protocol::Tcp, backends);
}

fn node_port_of(n: &mut Node, protocol: Protocol, backends: Vec<Backend>) {
    let name = ServicePortName { service: ObjectKey::new("default", "web"), port: "http".into(), protocol };
    let s = sock(NODE_PORT);
    let key = FrontendKey { addr: (*s.ip()).into(), port: s.port(), protocol };
    n.dp.upsert(&key, &Frontend::new(name, FrontendKind::NodePort, backends)).unwrap();
}

fn conntrack6(dp: &mut EbpfDataplane) -> Vec<(CtKey<Ip6>, CtEntry<Ip6>)> {
    let map = dp.ebpf_mut().map(proxy_common::map_names::CT6).unwrap();
    let ct: aya::maps::HashMap<_, CtKey<Ip6>, CtEntry<Ip6>> = aya::maps::HashMap::try_from(map).unwrap();
    ct.iter().map(|e| e.unwrap()).collect()
}

#[test]
fn an_ipv6_node_port_flow_to_a_remote_backend_is_dnatted_snatted_and_sent_by_fib() {
    let Some(mut n) = node("an_ipv6_node_port_flow_to_a_remote_backend_is_dnatted_snatted_and_sent_by_fib") else { return };
    node_port(&mut n, vec![backend(REMOTE, false)]);
    let syn = tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN);
    let out = run_ext(&mut n.dp, &syn, n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT, "sent on past the stack");
    let d = dissect(&out.frame);
    assert_eq!(d.dst_sock(), sock(REMOTE));
    assert_eq!(d.src, NODE_IP.parse::<std::net::Ipv6Addr>().unwrap(), "SNAT to the node's IPv6 address");
    let snat_port = d.sport.unwrap();
    assert!((61000..=65535).contains(&snat_port), "SNAT port {snat_port} outside the reserved range");
    assert_eq!(d.l4_checksum_ok, Some(true), "{d:?}");
    assert_eq!((&out.frame[..6], &out.frame[6..12]), (&ROUTER_MAC[..], &NODE_MAC[..]), "addressed to the next hop");
    assert_eq!(out.frame[14 + 7], 63, "hop limit decremented");

    // The port mapping is tracked both ways.
    let ct = conntrack6(&mut n.dp);
    assert_eq!(ct.len(), 2, "{ct:?}");
    let node_ip = Ip6::from_bytes(NODE_IP.parse::<std::net::Ipv6Addr>().unwrap().octets());
    assert!(ct.iter().any(|(k, _)| k.daddr == node_ip && u16::from_be_bytes(k.dport) == snat_port), "the reply entry: {ct:?}");

    // The backend's reply comes back to the node and leaves towards the client as the NodePort.
    let snat = SocketAddrV6::new(NODE_IP.parse().unwrap(), snat_port, 0, 0);
    let out = run_ext(&mut n.dp, &tcp_frame(sock(REMOTE), snat, SYN | ACK), n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (sock(NODE_PORT), sock(CLIENT)));
    assert_eq!(d.l4_checksum_ok, Some(true));

    // Later packets of the flow keep their port mapping (the tracked path: no new-flow stage).
    let d = dissect(&run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK), n.ifindex).frame);
    assert_eq!((d.src, d.sport), (NODE_IP.parse().unwrap(), Some(snat_port)));
    let c = counters(&mut n.dp);
    assert_eq!((c.get("ext_new_remote"), c.get("ext_reply"), c.get("ext_established")), (Some(&1), Some(&1), Some(&1)), "{c:?}");

    // XDP takes the tracked flow both ways, out of the interface it came in by (XDP_TX), with
    // the same translation and checksums computed by hand.
    let out = run_xdp(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK), n.ifindex);
    assert_eq!(out.action, XDP_TX, "an established IPv6 flow in XDP");
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (snat, sock(REMOTE)));
    assert_eq!(d.l4_checksum_ok, Some(true));
    assert_eq!((out.frame[14 + 7], &out.frame[..6]), (63, &ROUTER_MAC[..]), "hop limit and next hop");
    let out = run_xdp(&mut n.dp, &tcp_frame(sock(REMOTE), snat, ACK), n.ifindex);
    assert_eq!(out.action, XDP_TX, "its reply in XDP");
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (sock(NODE_PORT), sock(CLIENT)));
    assert_eq!(d.l4_checksum_ok, Some(true));
    let c = counters(&mut n.dp);
    assert_eq!((c.get("xdp_forward"), c.get("xdp_reply")), (Some(&1), Some(&1)), "{c:?}");
}

#[test]
fn an_ipv6_local_backend_is_only_dnatted_and_keeps_the_client_address() {
    let Some(mut n) = node("an_ipv6_local_backend_is_only_dnatted_and_keeps_the_client_address") else { return };
    node_port(&mut n, vec![backend(LOCAL, true)]);
    let out = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(out.action, TC_ACT_OK, "routed by the stack to the pod");
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (sock(CLIENT), sock(LOCAL)));
    assert_eq!(d.l4_checksum_ok, Some(true));
    // The pod's reply leaves through TC egress with the NodePort as its source.
    let d = dissect(&run_egress(&mut n.dp, &tcp_frame(sock(LOCAL), sock(CLIENT), SYN | ACK)).frame);
    assert_eq!(d.src_sock(), sock(NODE_PORT));
    assert_eq!(d.l4_checksum_ok, Some(true));
    assert_eq!(counters(&mut n.dp).get("ext_new_local"), Some(&1));
}

/// A Packet Too Big from `from` to `to` (MTU 1280), quoting `about` (a frame).
fn packet_too_big(from: std::net::Ipv6Addr, to: std::net::Ipv6Addr, about: &[u8]) -> Vec<u8> {
    let quote = &about[14..about.len().min(14 + 1280 - 48)];
    Ipv6::new(from, to, ICMPV6, packet6::icmpv6_message(from, to, 2, 0, 1280u32.to_be_bytes(), quote)).frame()
}

/// The outer addresses of a translated Packet Too Big, and its quote's sockets; passed on
/// through the stack, or (`forwarded`) sent on past it to the next hop, one hop less.
fn ptb_of(out: &testrun::Output, forwarded: bool) -> ((std::net::Ipv6Addr, std::net::Ipv6Addr), (SocketAddrV6, SocketAddrV6)) {
    if forwarded {
        assert_eq!(out.action, TC_ACT_REDIRECT, "sent on past the stack");
        assert_eq!((&out.frame[..6], out.frame[14 + 7]), (&ROUTER_MAC[..], 63), "to the next hop, one hop less");
    } else {
        assert_eq!(out.action, TC_ACT_OK, "on through the stack");
    }
    // `dissect` checks the ICMPv6 checksum over the new pseudo-header.
    let d = dissect(&out.frame);
    let (kind, _, body) = d.icmp.expect("still ICMPv6");
    assert_eq!((kind, &out.frame[14 + 44..14 + 48]), (2, &1280u32.to_be_bytes()[..]), "a Packet Too Big, its MTU kept");
    let ip6 = |b: &[u8]| std::net::Ipv6Addr::from(<[u8; 16]>::try_from(b).unwrap());
    let port = |b: &[u8]| u16::from_be_bytes([b[0], b[1]]);
    let (src, dst) = (ip6(&body[8..24]), ip6(&body[24..40]));
    ((d.src, d.dst), (SocketAddrV6::new(src, port(&body[40..]), 0, 0), SocketAddrV6::new(dst, port(&body[42..]), 0, 0)))
}

/// Packet Too Big from outside about IPv6 north-south flows reaches the host that must lower
/// its path MTU, as IPv4's errors do: about a reply to the client, the backend (local through
/// the stack, or remote past it from the node's SNAT address); about a packet forwarded to a
/// remote backend, the client, past the stack.
#[test]
fn ipv6_packet_too_big_about_north_south_flows_reaches_the_backend_or_the_client() {
    let Some(mut n) = node("ipv6_packet_too_big_about_north_south_flows_reaches_the_backend_or_the_client") else { return };
    let node_ip: std::net::Ipv6Addr = NODE_IP.parse().unwrap();
    let router: std::net::Ipv6Addr = "fd00:50::2".parse().unwrap();
    let (client, np) = (sock(CLIENT), sock(NODE_PORT));

    node_port(&mut n, vec![backend(LOCAL, true)]);
    run_ext(&mut n.dp, &tcp_frame(client, np, SYN), n.ifindex);
    let reply = run_egress(&mut n.dp, &tcp_frame(sock(LOCAL), client, SYN | ACK)).frame;
    assert_eq!(dissect(&reply).src_sock(), np);
    let (outer, quote) = ptb_of(&run_ext(&mut n.dp, &packet_too_big(router, node_ip, &reply), n.ifindex), false);
    assert_eq!(outer, (router, *sock(LOCAL).ip()), "to the local backend");
    assert_eq!(quote, (sock(LOCAL), client), "quoting the reply as the backend sent it");

    let client2 = sock("[2001:db8:100::8]:40001");
    node_port(&mut n, vec![backend(REMOTE, false)]);
    let forwarded = run_ext(&mut n.dp, &tcp_frame(client2, np, SYN), n.ifindex).frame;
    let snat = SocketAddrV6::new(node_ip, dissect(&forwarded).sport.unwrap(), 0, 0);
    let reply = run_ext(&mut n.dp, &tcp_frame(sock(REMOTE), snat, SYN | ACK), n.ifindex).frame;
    assert_eq!(dissect(&reply).dst_sock(), client2);
    let (outer, quote) = ptb_of(&run_ext(&mut n.dp, &packet_too_big(router, node_ip, &reply), n.ifindex), true);
    assert_eq!(outer, (node_ip, *sock(REMOTE).ip()), "to the remote backend, from the node's SNAT address");
    assert_eq!(quote, (sock(REMOTE), snat), "quoting the reply as sent to the SNAT address and port");
    let (outer, quote) = ptb_of(&run_ext(&mut n.dp, &packet_too_big(router, node_ip, &forwarded), n.ifindex), true);
    assert_eq!(outer, (router, *client2.ip()), "to the client");
    assert_eq!(quote, (client2, np), "quoting what the client sent");
    assert_eq!(counters(&mut n.dp).get("icmp_error_nat"), Some(&3));
}

#[test]
fn an_ipv6_node_port_without_endpoints_refuses_or_under_local_policy_drops() {
    let Some(mut n) = node("an_ipv6_node_port_without_endpoints_refuses_or_under_local_policy_drops") else { return };
    node_port(&mut n, vec![]);
    let out = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let d = dissect(&out.frame);
    assert_eq!((d.proto, d.src, d.dst), (ICMPV6, *sock(NODE_PORT).ip(), *sock(CLIENT).ip()));
    assert_eq!(d.icmp.map(|(kind, code, _)| (kind, code)), Some((1, 4)), "ICMPv6 port unreachable");
    // externalTrafficPolicy Local with endpoints on other nodes only: dropped.
    let name = ServicePortName { service: ObjectKey::new("default", "web"), port: "http".into(), protocol: Protocol::Tcp };
    let mut fe = Frontend::new(name, FrontendKind::NodePort, vec![]);
    fe.drop_when_empty = true;
    fe.internal_backends = Some(vec![backend(REMOTE, false)]);
    let s = sock(NODE_PORT);
    n.dp.upsert(&FrontendKey { addr: (*s.ip()).into(), port: s.port(), protocol: Protocol::Tcp }, &fe).unwrap();
    let out = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(out.action, TC_ACT_SHOT, "externalTrafficPolicy Local without a local endpoint drops");
}

#[test]
fn ipv6_for_no_node_port_passes_the_external_hooks_untouched() {
    let Some(mut n) = node("ipv6_for_no_node_port_passes_the_external_hooks_untouched") else { return };
    node_port(&mut n, vec![backend(REMOTE, false)]);
    for to in ["[fd00:50::1]:22", "[fd00:50::1]:30081"] {
        let f = tcp_frame(sock(CLIENT), sock(to), SYN);
        let out = run_ext(&mut n.dp, &f, n.ifindex);
        assert_eq!((out.action, &out.frame), (TC_ACT_OK, &f), "{to}: untouched");
    }
    assert!(conntrack6(&mut n.dp).is_empty());
}

/// Mutated IPv6 frames (truncations, length lies, flipped bits, extension headers, trailers)
/// through the external TC programs and XDP: no fault, a verdict the hook allows, every
/// rewritten frame whole IPv6 with each checksum that was valid still valid (and one the
/// program built valid), every run counted once, and the NodePorts still served after.
#[test]
fn mutated_ipv6_frames_through_the_external_programs_fault_nothing() {
    let Some(mut n) = node("mutated_ipv6_frames_through_the_external_programs_fault_nothing") else { return };
    let frames: usize = std::env::var("PROXY_FUZZ_FRAMES").ok().and_then(|s| s.parse().ok()).unwrap_or(30_000);
    let seed: u64 = std::env::var("PROXY_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x6e0f_f00d);
    node_port(&mut n, vec![backend(REMOTE, false), backend(LOCAL, true)]);
    let udp = |n: &mut Node, at: &str, backends: Vec<Backend>| {
        let name = ServicePortName { service: ObjectKey::new("default", "dns"), port: "dns".into(), protocol: Protocol::Udp };
        let s = sock(at);
        let key = FrontendKey { addr: (*s.ip()).into(), port: s.port(), protocol: Protocol::Udp };
        n.dp.upsert(&key, &Frontend::new(name, FrontendKind::NodePort, backends)).unwrap();
    };
    udp(&mut n, "[fd00:50::1]:30053", vec![backend("[fd00:244:2::5]:5353", false)]);
    udp(&mut n, "[fd00:50::1]:30054", vec![]);
    let clients = [sock(CLIENT), sock("[2001:db8:100::8]:1024"), sock("[fd00:50::2]:61000")];
    let ends = [
        (sock(NODE_PORT), TCP),
        (sock("[fd00:50::1]:30053"), proxy_tests::packet::UDP),
        (sock("[fd00:50::1]:30054"), proxy_tests::packet::UDP),
        (sock(REMOTE), TCP),
        (SocketAddrV6::new(NODE_IP.parse().unwrap(), 61000, 0, 0), TCP),
    ];
    let mut rng = proxy_tests::fuzz::Rng::new(seed);
    let (mut ran, mut rewritten) = (0u64, 0u64);
    let quoted = [(sock(REMOTE), TCP)];
    for i in 0..frames {
        let (f, label) = proxy_tests::fuzz::ipv6_frame(&mut rng, &clients, &ends, &quoted);
        let xdp = run_xdp(&mut n.dp, &f, n.ifindex);
        let tc = run_ext(&mut n.dp, &f, n.ifindex);
        ran += 2;
        // XDP passes a frame as it came, or sends it back out the one interface translated.
        assert!(xdp.action != XDP_PASS || xdp.frame == f, "frame {i} ({label}): XDP passed a frame it changed");
        for (hook, out, allowed) in [("XDP", &xdp, &[XDP_PASS, XDP_TX][..]), ("TC", &tc, &[TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT][..])] {
            match proxy_tests::fuzz::check_ipv6_output(&f, out.action, &out.frame, allowed) {
                Ok(changed) => rewritten += u64::from(changed),
                Err(why) => panic!("seed {seed}, frame {i} ({label}) through {hook}: {why}\n in:  {f:02x?}\n out: {:02x?}", out.frame),
            }
        }
    }
    println!("ipv6 external fuzz: seed {seed}, {frames} frames, {ran} program runs, {rewritten} rewritten");
    assert!(rewritten > frames as u64 / 20, "the frames reach the translation: {rewritten} rewritten");
    let c = counters(&mut n.dp);
    assert_eq!(c.values().sum::<u64>(), ran, "every run counted once: {c:?}");
    assert_eq!(c.get("pass_no_stage"), None, "{c:?}");
    let out = run_ext(&mut n.dp, &tcp_frame(sock("[2001:db8:100::99]:40999"), sock(NODE_PORT), SYN), n.ifindex);
    assert!([TC_ACT_OK, TC_ACT_REDIRECT].contains(&out.action), "still serving");
    let to = dissect(&out.frame).dst_sock();
    assert!([sock(REMOTE), sock(LOCAL)].contains(&to), "still serving: sent to a backend, not {to}");
}

/// loadBalancerSourceRanges on an IPv6 load-balancer IP: a source inside an IPv6 range is
/// load-balanced, any other dropped, the Service's NodePort not subject to them.
#[test]
fn an_ipv6_load_balancer_admits_only_sources_in_its_ranges() {
    let Some(mut n) = node("an_ipv6_load_balancer_admits_only_sources_in_its_ranges") else { return };
    const LB: &str = "[2001:db8:ff::10]:80";
    let name = ServicePortName { service: ObjectKey::new("default", "web"), port: "http".into(), protocol: Protocol::Tcp };
    let mut fe = Frontend::new(name, FrontendKind::LoadBalancer, vec![backend(REMOTE, false)]);
    fe.source_ranges = vec!["2001:db8:100::/64".parse().unwrap()];
    let s = sock(LB);
    n.dp.upsert(&FrontendKey { addr: (*s.ip()).into(), port: s.port(), protocol: Protocol::Tcp }, &fe).unwrap();
    node_port(&mut n, vec![backend(REMOTE, false)]);
    let out = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(LB), SYN), n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_REDIRECT, sock(REMOTE)), "a source inside the range");
    let outsider = sock("[2001:db8:200::9]:40000");
    assert_eq!(run_ext(&mut n.dp, &tcp_frame(outsider, sock(LB), SYN), n.ifindex).action, TC_ACT_SHOT, "outside the ranges");
    let out = run_ext(&mut n.dp, &tcp_frame(outsider, sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_REDIRECT, sock(REMOTE)), "the NodePort has no ranges");
    assert_eq!(counters(&mut n.dp).get("drop_source_range"), Some(&1));
}

/// A packet whose hop limit would expire here is left to the kernel (which answers time
/// exceeded), and a next hop without a neighbour entry yet is resolved by the kernel
/// (`bpf_redirect_neigh`) rather than dropped.
#[test]
fn ipv6_hop_limit_and_unresolved_neighbours_are_left_to_the_kernel() {
    let Some(mut n) = node("ipv6_hop_limit_and_unresolved_neighbours_are_left_to_the_kernel") else { return };
    node_port(&mut n, vec![backend(REMOTE, false)]);
    let mut ip = proxy_tests::packet6::Ipv6::new(
        *sock(CLIENT).ip(),
        *sock(NODE_PORT).ip(),
        TCP,
        proxy_tests::packet6::tcp_segment(sock(CLIENT), sock(NODE_PORT), SYN, &[]),
    );
    ip.hop_limit = 1;
    let f = ip.frame();
    let out = run_ext(&mut n.dp, &f, n.ifindex);
    assert_eq!((out.action, &out.frame), (TC_ACT_OK, &f), "hop limit 1: untouched");
    assert_eq!(counters(&mut n.dp).get("pass_ttl"), Some(&1));
    // A backend behind a next hop the node has no neighbour entry for.
    n._ns.ip(&["-6", "route", "add", "fd00:244:3::/64", "via", "fd00:50::3"]);
    node_port(&mut n, vec![backend("[fd00:244:3::5]:8080", false)]);
    let out = run_ext(&mut n.dp, &tcp_frame(sock("[2001:db8:100::8]:40001"), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT, "handed to the kernel's neighbour resolution");
    let d = dissect(&out.frame);
    assert_eq!((d.dst_sock(), d.src), (sock("[fd00:244:3::5]:8080"), NODE_IP.parse().unwrap()), "translated all the same");
    assert_eq!(d.l4_checksum_ok, Some(true));
}

/// Maglev for IPv6 north-south: two nodes that learned the backends in other orders, with
/// other ids, send every flow to the same backend (so a flow an upstream router moves between
/// nodes keeps its backend), and the flows spread over all backends.
#[test]
fn ipv6_maglev_picks_the_same_backend_on_every_node_whatever_the_ids() {
    if !require::root("ipv6_maglev_picks_the_same_backend_on_every_node_whatever_the_ids") {
        return;
    }
    let backends: Vec<Backend> = (1..=7).map(|i| backend(&format!("[fd00:244:2::{i}]:8080"), false)).collect();
    let mut picks: Vec<Vec<SocketAddrV6>> = Vec::new();
    for order in 0..2 {
        let mut n = node("ipv6_maglev").unwrap();
        if order == 1 {
            // Another node: a filler frontend takes ids first, and the list comes reversed.
            let filler: Vec<Backend> = (1..=5).map(|i| backend(&format!("[fd00:244:9::{i}]:80"), false)).collect();
            let name = ServicePortName { service: ObjectKey::new("default", "filler"), port: "p".into(), protocol: Protocol::Tcp };
            let key = FrontendKey { addr: "fd00:96::99".parse::<std::net::Ipv6Addr>().unwrap().into(), port: 80, protocol: Protocol::Tcp };
            n.dp.upsert(&key, &Frontend::new(name, FrontendKind::ClusterIp, filler)).unwrap();
        }
        let mut list = backends.clone();
        if order == 1 {
            list.reverse();
        }
        node_port(&mut n, list);
        let seen: Vec<SocketAddrV6> = (0..200u16)
            .map(|port| {
                let from = SocketAddrV6::new("2001:db8:100::7".parse().unwrap(), 20000 + port, 0, 0);
                dissect(&run_ext(&mut n.dp, &tcp_frame(from, sock(NODE_PORT), SYN), n.ifindex).frame).dst_sock()
            })
            .collect();
        picks.push(seen);
    }
    assert_eq!(picks[0], picks[1], "two nodes must send each flow to the same backend");
    let distinct: std::collections::BTreeSet<_> = picks[0].iter().collect();
    assert_eq!(distinct.len(), 7, "200 flows spread over all 7 backends");
    assert!(picks[0].iter().all(|s| s.ip().segments()[2] == 2), "only the NodePort's backends");
}

/// `proxy-agent trace` for IPv6: a marked packet on loopback is decided by the IPv6 programs
/// (a new flow by a trace program of its own) without writing anything, and a real packet
/// then goes where the trace said; a tracked flow's trace says so, and a packet for no
/// NodePort is left to the kernel.
#[test]
fn an_ipv6_trace_decides_like_a_real_packet_without_writing_anything() {
    let Some(mut n) = node("an_ipv6_trace_decides_like_a_real_packet_without_writing_anything") else { return };
    let backends: Vec<Backend> = (1..=5).map(|i| backend(&format!("[fd00:244:2::{i}]:8080"), false)).collect();
    node_port(&mut n, backends);
    let syn = tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN);
    let (reason, id) = testrun::run_trace(&mut n.dp, &syn);
    assert_eq!(reason, proxy_common::Reason::ExtNewRemote);
    assert!(conntrack6(&mut n.dp).is_empty(), "a trace tracks nothing");
    assert!(counters(&mut n.dp).is_empty(), "a trace counts nothing");
    run_ext(&mut n.dp, &syn, n.ifindex);
    let backend_of_id = conntrack6(&mut n.dp).iter().find(|(k, _)| k.sport == sock(CLIENT).port().to_be_bytes()).map(|(_, e)| e.backend_id);
    assert_eq!(backend_of_id, Some(id), "the real packet went where the trace said");
    let (reason, again) = testrun::run_trace(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK));
    assert_eq!((reason, again), (proxy_common::Reason::ExtEstablished, id), "the tracked flow");
    let (reason, _) = testrun::run_trace(&mut n.dp, &tcp_frame(sock(CLIENT), sock("[fd00:50::1]:22"), SYN));
    assert_eq!(reason, proxy_common::Reason::PassNotService);
    // The command's own frame builder makes the same packet.
    let built = proxy_agent::trace::frame(sock(CLIENT).into(), sock(NODE_PORT).into(), Protocol::Tcp).unwrap();
    assert_eq!(testrun::run_trace(&mut n.dp, &built).0, proxy_common::Reason::ExtEstablished);
}

/// XDP decides new IPv6 flows as it does IPv4's: a NodePort's first packet (TCP and UDP) to a
/// remote backend leaves from the driver translated (DNAT, SNAT to a tracked port, one hop
/// less, checksums by hand), and so does the backend's reply towards the client.
#[test]
fn xdp_forwards_new_ipv6_flows_and_their_replies() {
    let Some(mut n) = node("xdp_forwards_new_ipv6_flows_and_their_replies") else { return };
    node_port(&mut n, vec![backend(REMOTE, false)]);
    node_port_of(&mut n, Protocol::Udp, vec![backend(REMOTE, false)]);
    let (client, np) = (sock(CLIENT), sock(NODE_PORT));
    for (frame, proto) in [(udp_frame(client, np, b"ping"), "UDP"), (tcp_frame(client, np, SYN), "TCP")] {
        let out = run_xdp(&mut n.dp, &frame, n.ifindex);
        assert_eq!(out.action, XDP_TX, "{proto}: a new flow leaves from the driver");
        let d = dissect(&out.frame);
        assert_eq!((d.dst_sock(), d.src), (sock(REMOTE), NODE_IP.parse::<std::net::Ipv6Addr>().unwrap()), "{proto}");
        assert_eq!(d.l4_checksum_ok, Some(true), "{proto}: checksum computed by hand in XDP");
        assert_eq!((&out.frame[..6], out.frame[14 + 7]), (&ROUTER_MAC[..], 63), "{proto}: next hop and hop limit");
        let snat = SocketAddrV6::new(NODE_IP.parse().unwrap(), d.sport.unwrap(), 0, 0);
        let reply = if proto == "UDP" { udp_frame(sock(REMOTE), snat, b"pong") } else { tcp_frame(sock(REMOTE), snat, SYN | ACK) };
        let out = run_xdp(&mut n.dp, &reply, n.ifindex);
        assert_eq!(out.action, XDP_TX, "{proto}: the reply too");
        let d = dissect(&out.frame);
        assert_eq!((d.src_sock(), d.dst_sock()), (np, client), "{proto}");
        assert_eq!(d.l4_checksum_ok, Some(true), "{proto}");
    }
    assert_eq!(conntrack6(&mut n.dp).len(), 4, "each flow tracked both ways");
    let c = counters(&mut n.dp);
    assert_eq!((c.get("xdp_forward"), c.get("xdp_reply"), c.get("ext_new_remote")), (Some(&2), Some(&2), None), "{c:?}");
}

/// UDP through XDP: a tracked IPv6 UDP flow's later datagrams and its replies leave by XDP with
/// their checksums right, and a datagram without a checksum (zero, which IPv6 receivers
/// refuse anyway) is not given one.
#[test]
fn ipv6_udp_flows_take_the_xdp_path_with_valid_checksums() {
    let Some(mut n) = node("ipv6_udp_flows_take_the_xdp_path_with_valid_checksums") else { return };
    let name = ServicePortName { service: ObjectKey::new("default", "dns"), port: "dns".into(), protocol: Protocol::Udp };
    let (np, be) = (sock("[fd00:50::1]:30053"), sock("[fd00:244:2::5]:5353"));
    let key = FrontendKey { addr: (*np.ip()).into(), port: np.port(), protocol: Protocol::Udp };
    n.dp.upsert(&key, &Frontend::new(name, FrontendKind::NodePort, vec![backend(&be.to_string(), false)])).unwrap();
    let client = sock(CLIENT);
    let first = run_ext(&mut n.dp, &udp_frame(client, np, b"first"), n.ifindex);
    assert_eq!(first.action, TC_ACT_REDIRECT, "the first datagram: TC tracks the flow");
    let snat = dissect(&first.frame).src_sock();
    for body in [&b"an odd-sized query"[..], b"even"] {
        let out = run_xdp(&mut n.dp, &udp_frame(client, np, body), n.ifindex);
        assert_eq!(out.action, XDP_TX, "a later datagram in XDP");
        let d = dissect(&out.frame);
        assert_eq!((d.src_sock(), d.dst_sock(), d.l4_checksum_ok), (snat, be, Some(true)));
        let out = run_xdp(&mut n.dp, &udp_frame(be, snat, body), n.ifindex);
        assert_eq!(out.action, XDP_TX, "a reply in XDP");
        let d = dissect(&out.frame);
        assert_eq!((d.src_sock(), d.dst_sock(), d.l4_checksum_ok), (np, client, Some(true)));
    }
    let mut zero = udp_frame(client, np, b"no checksum");
    let l4 = 14 + 40;
    zero[l4 + 6..l4 + 8].copy_from_slice(&[0, 0]);
    let out = run_xdp(&mut n.dp, &zero, n.ifindex);
    assert_eq!(out.action, XDP_TX);
    assert_eq!(&out.frame[l4 + 6..l4 + 8], &[0, 0], "no checksum stays none");
}

/// IPv6's host flows left to TC (see north's
/// `a_host_flow_left_to_tc_gets_a_moved_port_and_its_replies_reach_the_process`): the egress
/// program stages them for programs of their own, which translate the first packet and the next
/// with a port of the SNAT range; replies from another node (external ingress) and from a pod
/// of this node (pod ingress) reach the process's port from the Service, and a Packet Too Big
/// about what it sent reaches it too.
#[test]
fn an_ipv6_host_flow_left_to_tc_gets_a_moved_port_and_its_replies_reach_the_process() {
    let Some(mut n) = node("an_ipv6_host_flow_left_to_tc_gets_a_moved_port_and_its_replies_reach_the_process") else { return };
    let node_ip: std::net::Ipv6Addr = NODE_IP.parse().unwrap();
    let router: std::net::Ipv6Addr = "fd00:50::2".parse().unwrap();
    let host = SocketAddrV6::new(node_ip, 41053, 0, 0);
    let (vip_udp, vip_tcp, vip_local) = ("[fd00:96::10]:53", "[fd00:96::10]:80", "[fd00:96::11]:53");
    let upsert = |n: &mut Node, vip: &str, protocol: Protocol, b: Backend| {
        let name = ServicePortName { service: ObjectKey::new("default", "dns"), port: "p".into(), protocol };
        let s = sock(vip);
        let key = FrontendKey { addr: (*s.ip()).into(), port: s.port(), protocol };
        n.dp.upsert(&key, &Frontend::new(name, FrontendKind::ClusterIp, vec![b])).unwrap();
    };
    upsert(&mut n, vip_udp, Protocol::Udp, backend(REMOTE, false));
    upsert(&mut n, vip_tcp, Protocol::Tcp, backend(REMOTE, false));
    upsert(&mut n, vip_local, Protocol::Udp, backend(LOCAL, true));
    for (vip, proto) in [(vip_udp, "UDP"), (vip_tcp, "TCP")] {
        let first = if proto == "UDP" { udp_frame(host, sock(vip), b"query") } else { tcp_frame(host, sock(vip), SYN) };
        let out = testrun::run_egress_on(&mut n.dp, &first, n.ifindex);
        assert_eq!(out.action, TC_ACT_REDIRECT, "{proto}: sent by the route to the backend");
        let d = dissect(&out.frame);
        assert_eq!(d.dst_sock(), sock(REMOTE), "{proto}");
        assert_eq!(d.src, node_ip, "{proto}: the node's own address is kept");
        let moved = d.sport.unwrap();
        assert!((61000..=65535).contains(&moved), "{proto}: port {moved} moved into the SNAT range");
        assert_eq!(d.l4_checksum_ok, Some(true), "{proto}: {d:?}");
        assert_eq!((&out.frame[..6], &out.frame[6..12]), (&ROUTER_MAC[..], &NODE_MAC[..]), "{proto}: to the next hop");
        assert_eq!(out.frame[14 + 7], 64, "{proto}: no hop taken from a packet the node sent");
        // A router's Packet Too Big about it reaches the process, quoting what it sent.
        let (outer, quote) = ptb_of(&run_ext(&mut n.dp, &packet_too_big(router, node_ip, &out.frame), n.ifindex), false);
        assert_eq!((outer, quote), ((router, node_ip), (host, sock(vip))), "{proto}: up the stack, about what the process sent");

        let back = SocketAddrV6::new(node_ip, moved, 0, 0);
        let reply = if proto == "UDP" { udp_frame(sock(REMOTE), back, b"answer") } else { tcp_frame(sock(REMOTE), back, SYN | ACK) };
        let out = run_ext(&mut n.dp, &reply, n.ifindex);
        assert_eq!(out.action, TC_ACT_OK, "{proto}: up the stack to the process");
        let d = dissect(&out.frame);
        assert_eq!((d.src_sock(), d.dst_sock()), (sock(vip), host), "{proto}: from the Service to the process's own port");
        assert_eq!(d.l4_checksum_ok, Some(true), "{proto}: {d:?}");
        let out = run_xdp(&mut n.dp, &reply, n.ifindex);
        assert_eq!((out.action, &out.frame), (XDP_PASS, &reply), "{proto}: XDP leaves the reply to TC, untouched");

        let next = if proto == "UDP" { udp_frame(host, sock(vip), b"again") } else { tcp_frame(host, sock(vip), ACK) };
        let d = dissect(&testrun::run_egress_on(&mut n.dp, &next, n.ifindex).frame);
        assert_eq!((d.src_sock(), d.dst_sock()), (back, sock(REMOTE)), "{proto}: the next packet keeps backend and port");
    }

    let out = testrun::run_egress_on(&mut n.dp, &udp_frame(host, sock(vip_local), b"query"), n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT, "sent by the route to the pod");
    let d = dissect(&out.frame);
    assert_eq!(d.dst_sock(), sock(LOCAL));
    let back = SocketAddrV6::new(node_ip, d.sport.unwrap(), 0, 0);
    let out = testrun::run(&mut n.dp, &udp_frame(sock(LOCAL), back, b"answer"));
    assert_eq!(out.action, TC_ACT_OK);
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (sock(vip_local), host), "the pod's reply, from the Service to the process's port");
    assert_eq!(d.l4_checksum_ok, Some(true), "{d:?}");
    // A pod's reply to the node under no such entry is left alone.
    let stray = udp_frame(sock(LOCAL), SocketAddrV6::new(node_ip, 61999, 0, 0), b"stray");
    let out = testrun::run(&mut n.dp, &stray);
    assert_eq!((out.action, &out.frame), (TC_ACT_OK, &stray));

    let c = counters(&mut n.dp);
    assert_eq!((c.get("host_flow_new"), c.get("host_flow"), c.get("host_reply")), (Some(&3), Some(&2), Some(&3)), "{c:?}");
}

/// XDP's flow cache (`flowcache`) serves IPv6 flows as IPv4's: a tracked flow's packet is sent
/// on from it while the conntrack path would repeat its step (here: with the flow's entries
/// gone behind the datapath's back, nothing is tracked anew), and not once the agent deleted
/// its backend.
#[test]
fn xdp_repeats_an_ipv6_flows_step_from_its_cache_until_its_backend_goes() {
    let Some(mut n) = node("xdp_repeats_an_ipv6_flows_step_from_its_cache") else { return };
    node_port_of(&mut n, Protocol::Udp, vec![backend(REMOTE, false)]);
    let ping = udp_frame(sock(CLIENT), sock(NODE_PORT), b"ping");
    let forget = |dp: &mut EbpfDataplane| {
        let keys: Vec<CtKey<Ip6>> = conntrack6(dp).into_iter().map(|(k, _)| k).collect();
        let map = dp.ebpf_mut().map_mut(proxy_common::map_names::CT6).unwrap();
        let mut ct = aya::maps::HashMap::<_, CtKey<Ip6>, CtEntry<Ip6>>::try_from(map).unwrap();
        for k in keys {
            ct.remove(&k).unwrap();
        }
    };
    // A route epoch (about a second) may end between two packets: a few attempts, on one CPU
    // (the cache is per CPU).
    testrun::stay_on_this_cpu();
    let served = (0..5).any(|_| {
        forget(&mut n.dp);
        n.dp.invalidate_cached_flows();
        let first = run_xdp(&mut n.dp, &ping, n.ifindex);
        assert_eq!(first.action, XDP_TX, "a new flow");
        assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).frame, first.frame, "tracked: its step cached");
        forget(&mut n.dp);
        let out = run_xdp(&mut n.dp, &ping, n.ifindex);
        if !conntrack6(&mut n.dp).is_empty() {
            return false;
        }
        assert_eq!((out.action, &out.frame), (XDP_TX, &first.frame), "sent on from the cache, translated as before");
        let d = dissect(&out.frame);
        assert!(d.l4_checksum_ok == Some(true), "{d:?}");
        true
    });
    assert!(served, "every attempt met the end of a window");
    forget(&mut n.dp);
    n.dp.invalidate_cached_flows();
    assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).action, XDP_TX);
    assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).action, XDP_TX, "cached");
    node_port_of(&mut n, Protocol::Udp, vec![backend("[fd00:244:2::6]:8080", false)]);
    let out = run_xdp(&mut n.dp, &ping, n.ifindex);
    assert_eq!((out.action, &out.frame), (XDP_PASS, &ping), "its backend gone: handed to TC untouched");
}

/// `proxy-bench profile --xdp --ipv6` (the figure of XDP's tracked IPv6 path) runs the agent's
/// IPv6 XDP program on the generator's frame, through the tail call the generator's program
/// makes from the pinned program array: the bench itself requires the flow translated both
/// ways with valid checksums, every run sent back out, and every packet counted.
#[test]
fn the_xdp_profile_measures_the_ipv6_flow_both_ways() {
    if !require::root("the_xdp_profile_measures_the_ipv6_flow_both_ways") {
        return;
    }
    for (extra, what) in [(None, "xdp IPv6 forward "), (Some("--reply"), "xdp IPv6 reply ")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_proxy-bench"))
            .args(["profile", "--xdp", "--ipv6", "--quick"])
            .args(extra)
            .env("BENCH_OUT_DIR", std::env::temp_dir())
            .output()
            .expect("run proxy-bench");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "profile --xdp --ipv6 {extra:?}: {}\n{text}", out.status);
        assert_eq!(text.lines().filter(|l| l.starts_with(what)).count(), 10, "ten rounds of {what:?}:\n{text}");
    }
}
