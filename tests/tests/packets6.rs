//! IPv6 packet tables: frames through the real TC programs (the entry points attached to an
//! interface, which serve IPv6 or tail-call its programs) with BPF_PROG_TEST_RUN, the IPv6 maps written by the agent's own map writer;
//! outputs are dissected and checksums verified independently (`packet6`).

use std::net::SocketAddrV6;

use aya::maps::HashMap;
use proxy_agent::{
    dataplane::{ebpf::EbpfDataplane, Dataplane},
    model::{Backend as ModelBackend, Frontend, FrontendKey, FrontendKind, ObjectKey, Protocol, ServicePortName},
};
use proxy_common::{csum, map_names, CtEntry, CtKey, Ip6};
use proxy_tests::{
    packet::{ACK, SYN, TCP, UDP},
    packet6::{self, dissect, tcp_frame, tcp_segment, Ipv6, DEST_OPTS, ESP, FRAGMENT, HOP_BY_HOP, ICMPV6, ROUTING},
    require,
    testrun::{
        self, assert_leaves, assert_untouched, counters, forget_conntrack, run, run_egress, within_a_window, without_conntrack, TC_ACT_OK,
        TC_ACT_REDIRECT, TC_ACT_SHOT,
    },
};

fn sock(s: &str) -> SocketAddrV6 {
    s.parse().unwrap()
}

const CLIENT: &str = "[fd00:10:244::5]:40000";
const VIP: &str = "[fd00:10:96::10]:80";
const BACKEND: &str = "[fd00:10:244:1::2]:8080";

fn setup(test: &str) -> Option<EbpfDataplane> {
    require::root(test).then(testrun::dataplane)
}

/// Programs a ClusterIP frontend through the agent's own map writer (`Dataplane::upsert`),
/// which writes the IPv6 maps for an IPv6 key.
fn program6(dp: &mut EbpfDataplane, vip: &str, proto: u8, backends: &[&str]) {
    let protocol = if proto == TCP { Protocol::Tcp } else { Protocol::Udp };
    let v = sock(vip);
    let name = ServicePortName { service: ObjectKey::new("default", format!("web-{}", v.port())), port: "http".into(), protocol };
    let backends = backends
        .iter()
        .map(|b| {
            let b = sock(b);
            ModelBackend { addr: (*b.ip()).into(), port: b.port(), terminating: false, local: false }
        })
        .collect();
    let key = FrontendKey { addr: (*v.ip()).into(), port: v.port(), protocol };
    dp.upsert(&key, &Frontend::new(name, FrontendKind::ClusterIp, backends)).expect("program the IPv6 frontend");
}

fn conntrack6(dp: &mut EbpfDataplane) -> Vec<(CtKey<Ip6>, CtEntry<Ip6>)> {
    let ct: HashMap<_, CtKey<Ip6>, CtEntry<Ip6>> = HashMap::try_from(dp.ebpf_mut().map(map_names::CT6).unwrap()).unwrap();
    ct.iter().map(|e| e.unwrap()).collect()
}

/// The IPv6 conntrack map, to write behind the datapath's back.
fn ct6_map(dp: &mut EbpfDataplane) -> HashMap<&mut aya::maps::MapData, CtKey<Ip6>, CtEntry<Ip6>> {
    HashMap::try_from(dp.ebpf_mut().map_mut(map_names::CT6).unwrap()).unwrap()
}

#[test]
fn ipv6_tcp_to_a_cluster_ip_is_dnatted_and_its_replies_restored() {
    let Some(mut dp) = setup("ipv6_tcp_to_a_cluster_ip_is_dnatted_and_its_replies_restored") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip, backend) = (sock(CLIENT), sock(VIP), sock(BACKEND));

    let out = run(&mut dp, &tcp_frame(client, vip, SYN));
    assert_eq!(out.action, TC_ACT_OK);
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (client, backend), "SYN translated to the backend");
    assert_eq!(d.l4_checksum_ok, Some(true), "TCP checksum after DNAT");
    let ct = conntrack6(&mut dp);
    assert_eq!(ct.len(), 2, "a forward and a reply entry: {ct:?}");

    // The backend's answer leaves towards the client with the Service as its source.
    let reply = run_egress(&mut dp, &tcp_frame(backend, client, SYN | ACK));
    let d = dissect(&reply.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (vip, client), "reply restored to the Service address");
    assert_eq!(d.l4_checksum_ok, Some(true), "TCP checksum after reverse NAT");

    // Later packets of the flow, in the checksum form the first one taught.
    for _ in 0..3 {
        let d = dissect(&run(&mut dp, &tcp_frame(client, vip, ACK)).frame);
        assert_eq!(d.dst_sock(), backend);
        assert_eq!(d.l4_checksum_ok, Some(true), "TCP checksum of an established packet");
        let d = dissect(&run_egress(&mut dp, &tcp_frame(backend, client, ACK)).frame);
        assert_eq!(d.src_sock(), vip);
        assert_eq!(d.l4_checksum_ok, Some(true));
    }
    let c = counters(&mut dp);
    assert_eq!((c.get("new_flow"), c.get("established"), c.get("reverse_nat")), (Some(&1), Some(&3), Some(&4)), "{c:?}");
}

#[test]
fn ipv6_udp_is_dnatted_with_a_valid_checksum() {
    let Some(mut dp) = setup("ipv6_udp_is_dnatted_with_a_valid_checksum") else { return };
    program6(&mut dp, "[fd00:10:96::a]:53", UDP, &["[fd00:10:244:1::9]:5353"]);
    let (client, vip) = (sock(CLIENT), sock("[fd00:10:96::a]:53"));
    let q = Ipv6::new(*client.ip(), *vip.ip(), UDP, packet6::udp_datagram(client, vip, b"an odd-sized query")).frame();
    let d = dissect(&run(&mut dp, &q).frame);
    assert_eq!(d.dst_sock(), sock("[fd00:10:244:1::9]:5353"));
    assert_eq!(d.l4_checksum_ok, Some(true), "UDP checksum after DNAT");
}

/// IPv6's new-flow program holds back a segment under way that no entry tracks while IPv6's
/// takeover may adopt its connection (`ct::ADOPTING_V6`), not while only IPv4's may, and
/// balances it once the hold ends, as IPv4's does.
#[test]
fn ipv6_segment_under_way_is_held_back_while_its_familys_takeover_may_adopt_it() {
    use proxy_common::ct::{ADOPTING_V4, ADOPTING_V6};
    let Some(mut dp) = setup("ipv6_segment_under_way_is_held_back_while_its_familys_takeover_may_adopt_it") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let until = proxy_agent::dataplane::ebpf::ct_gc::monotonic_coarse_ns() + 5_000_000_000;
    testrun::hold_adoption(&mut dp, ADOPTING_V6, until);
    let ack = tcp_frame(sock(CLIENT), sock(VIP), ACK);
    assert_eq!(run(&mut dp, &ack).action, TC_ACT_SHOT, "held back");
    assert_eq!(counters(&mut dp).get("drop_adopt_pending"), Some(&1));
    assert!(conntrack6(&mut dp).is_empty(), "and not tracked");
    testrun::hold_adoption(&mut dp, ADOPTING_V6, 0);
    testrun::hold_adoption(&mut dp, ADOPTING_V4, until);
    assert_eq!(dissect(&run(&mut dp, &ack).frame).dst_sock(), sock(BACKEND), "IPv4's hold is not IPv6's: a new flow");
}

/// Extension headers (Hop-by-Hop, Destination Options, Routing) are walked to the ports; the
/// translated packet keeps them.
#[test]
fn ipv6_extension_headers_are_walked_to_the_ports() {
    let Some(mut dp) = setup("ipv6_extension_headers_are_walked_to_the_ports") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip) = (sock(CLIENT), sock(VIP));
    // A Routing header with segments left 0 (type 4, no segments): 8 bytes.
    let routing = vec![0, 4, 0, 0, 0, 0, 0];
    let frame = Ipv6::new(*client.ip(), *vip.ip(), TCP, tcp_segment(client, vip, SYN, b""))
        .with_ext(HOP_BY_HOP, Ipv6::padding_options())
        .with_ext(DEST_OPTS, Ipv6::padding_options())
        .with_ext(ROUTING, routing)
        .frame();
    let out = run(&mut dp, &frame);
    let d = dissect(&out.frame);
    assert_eq!((d.dst_sock(), d.l4_off), (sock(BACKEND), 64), "translated past three extension headers");
    assert_eq!(d.l4_checksum_ok, Some(true));
    assert_eq!(out.frame[14 + 40..14 + 64], frame[14 + 40..14 + 64], "extension headers unchanged");
}

/// What the parser does not understand, or must not touch, is passed as it came.
#[test]
fn ipv6_frames_the_parser_does_not_take_pass_untouched() {
    let Some(mut dp) = setup("ipv6_frames_the_parser_does_not_take_pass_untouched") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip) = (sock(CLIENT), sock(VIP));
    let syn = || Ipv6::new(*client.ip(), *vip.ip(), TCP, tcp_segment(client, vip, SYN, b""));

    let mut deep = syn();
    for _ in 0..7 {
        deep = deep.with_ext(DEST_OPTS, Ipv6::padding_options());
    }
    assert_untouched(&mut dp, &deep.frame(), "more extension headers than are walked");
    // A Routing header with a segment left: the destination is a hop on the way.
    let routed = syn().with_ext(ROUTING, vec![0, 4, 1, 0, 0, 0, 0]).frame();
    assert_untouched(&mut dp, &routed, "a routing header with segments left");
    let esp = Ipv6::new(*client.ip(), *vip.ip(), ESP, vec![0; 24]).frame();
    assert_untouched(&mut dp, &esp, "ESP");
    let ns = Ipv6::new(*client.ip(), "ff02::1:ff00:10".parse().unwrap(), ICMPV6, vec![135, 0, 0, 0, 0, 0, 0, 0]).frame();
    assert_untouched(&mut dp, &ns, "neighbour solicitation");

    let full = syn().frame();
    let mut lying = full.clone();
    lying[18..20].copy_from_slice(&200u16.to_be_bytes());
    assert_untouched(&mut dp, &lying, "payload length beyond the frame");
    // (A frame cut inside the IPv6 header cannot be test-run: the kernel refuses it.)
    assert_untouched(&mut dp, &full[..14 + 40 + 10], "cut inside the TCP header");
    let mut v4 = full.clone();
    v4[14] = 0x45;
    assert_untouched(&mut dp, &v4, "version 4 in an IPv6 frame");
    let c = counters(&mut dp);
    assert_eq!(c.get("new_flow"), None, "{c:?}");
    assert_eq!(c.get("pass_no_stage"), None, "every IPv6 program is reachable: {c:?}");
}

#[test]
fn ipv6_without_endpoints_answers_icmpv6_port_unreachable() {
    let Some(mut dp) = setup("ipv6_without_endpoints_answers_icmpv6_port_unreachable") else { return };
    program6(&mut dp, VIP, TCP, &[]);
    let (client, vip) = (sock(CLIENT), sock(VIP));
    for payload in [&b""[..], &[7u8; 400][..]] {
        let frame = Ipv6::new(*client.ip(), *vip.ip(), TCP, tcp_segment(client, vip, SYN, payload)).frame();
        let out = run(&mut dp, &frame);
        assert_eq!(out.action, TC_ACT_REDIRECT, "sent back out the interface it came in on");
        let d = dissect(&out.frame);
        assert_eq!((d.src, d.dst), (*vip.ip(), *client.ip()), "from the Service address to the client");
        let (kind, code, body) = d.icmp.expect("an ICMPv6 message (its checksum verified)");
        assert_eq!((kind, code), (1, 4), "destination unreachable, port unreachable");
        let quoted = body.len().min(frame.len() - 14);
        assert!(quoted >= 48, "the quote holds the IPv6 and TCP headers");
        assert_eq!(body[..quoted], frame[14..14 + quoted], "the quote is the offending packet");
    }
    assert_eq!(counters(&mut dp).get("reject_no_endpoints"), Some(&2));
}

/// A fragmented datagram: the first fragment carries the ports and is translated (its checksum
/// made right for the whole datagram); the later one follows it.
#[test]
fn ipv6_fragments_follow_their_first_fragment() {
    let Some(mut dp) = setup("ipv6_fragments_follow_their_first_fragment") else { return };
    program6(&mut dp, "[fd00:10:96::a]:53", UDP, &["[fd00:10:244:1::9]:5353"]);
    let (client, vip, backend) = (sock(CLIENT), sock("[fd00:10:96::a]:53"), sock("[fd00:10:244:1::9]:5353"));
    let whole = packet6::udp_datagram(client, vip, &[5u8; 100]);
    let (first, rest) = whole.split_at(56);
    let frag = |off: u16, more: bool, bytes: &[u8]| {
        Ipv6::new(*client.ip(), *vip.ip(), UDP, bytes.to_vec()).with_ext(FRAGMENT, Ipv6::fragment(off, more, 0xabcd)).frame()
    };
    let out1 = run(&mut dp, &frag(0, true, first));
    let d1 = dissect(&out1.frame);
    assert_eq!(d1.dst_sock(), backend, "first fragment translated");
    let out2 = run(&mut dp, &frag(7, false, rest));
    let d2 = dissect(&out2.frame);
    assert_eq!(d2.dst, *backend.ip(), "later fragment follows");
    assert!(d2.sport.is_none());
    let mut reassembled = out1.frame[14 + 48..].to_vec();
    reassembled.extend_from_slice(&out2.frame[14 + 48..]);
    assert!(packet6::l4_checksum_ok_over(*client.ip(), *backend.ip(), UDP, &reassembled), "checksum of the reassembled datagram");
    assert_eq!(counters(&mut dp).get("fragment_nat"), Some(&1));
}

/// Mutated IPv6 frames (extension header chains, fragments, length lies, truncations, flipped
/// bits) through the pod-facing ingress and egress programs and the IPv6 programs they
/// tail-call: no fault, a verdict the hook allows, and every rewritten frame whole IPv6 with
/// each checksum that was valid still valid (one the program built, an ICMPv6 reject, valid
/// throughout). A fixed seed (`PROXY_FUZZ_SEED` and `PROXY_FUZZ_FRAMES` change it).
#[test]
fn mutated_ipv6_frames_fault_nothing_and_break_no_checksum() {
    let Some(mut dp) = setup("mutated_ipv6_frames_fault_nothing_and_break_no_checksum") else { return };
    let seed: u64 = std::env::var("PROXY_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x6eed_f00d);
    let frames: usize = std::env::var("PROXY_FUZZ_FRAMES").ok().and_then(|s| s.parse().ok()).unwrap_or(30_000);
    program6(&mut dp, VIP, TCP, &[BACKEND, "[fd00:10:244:2::7]:8080"]);
    program6(&mut dp, "[fd00:10:96::a]:53", UDP, &["[fd00:10:244:1::9]:5353"]);
    program6(&mut dp, "[fd00:10:96::63]:80", TCP, &[]);
    let clients = [sock(CLIENT), sock("[fd00:10:244::6]:40001"), sock("[2001:db8::7]:61000")];
    let ends = [
        (sock(VIP), TCP),
        (sock("[fd00:10:96::a]:53"), UDP),
        (sock("[fd00:10:96::63]:80"), TCP),
        (sock(BACKEND), TCP),
        (sock("[fd00:10:244:1::9]:5353"), UDP),
    ];
    let mut rng = proxy_tests::fuzz::Rng::new(seed);
    let (mut ran, mut rewritten) = (0u64, 0u64);
    let quoted = [(sock(BACKEND), TCP), (sock("[fd00:10:244:1::9]:5353"), UDP)];
    for i in 0..frames {
        let (f, label) = proxy_tests::fuzz::ipv6_frame(&mut rng, &clients, &ends, &quoted);
        for egress in [false, true] {
            let out = if egress { run_egress(&mut dp, &f) } else { run(&mut dp, &f) };
            ran += 1;
            let hook = if egress { "egress" } else { "ingress" };
            match proxy_tests::fuzz::check_ipv6_output(&f, out.action, &out.frame, &[TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT]) {
                Ok(changed) => rewritten += u64::from(changed),
                Err(why) => panic!("seed {seed}, frame {i} ({label}) through {hook}: {why}\n in:  {f:02x?}\n out: {:02x?}", out.frame),
            }
        }
    }
    println!("ipv6 fuzz: seed {seed}, {frames} frames, {ran} program runs, {rewritten} rewritten");
    assert!(rewritten > frames as u64 / 20, "the frames reach the translation: {rewritten} rewritten");
    let c = counters(&mut dp);
    assert_eq!(c.values().sum::<u64>(), ran, "every run counted once: {c:?}");
    assert_eq!(c.get("pass_no_stage"), None, "{c:?}");
    assert!(c.get("icmp_error_nat").is_some_and(|n| *n > 0), "ICMPv6 errors about tracked flows were rewritten: {c:?}");
    // Still serving afterwards.
    let d = dissect(&run(&mut dp, &tcp_frame(sock("[fd00:10:244::99]:40999"), sock(VIP), SYN)).frame);
    assert!(d.dst_sock() == sock(BACKEND) || d.dst_sock() == sock("[fd00:10:244:2::7]:8080"));
}

/// IPv6 frontends written by the agent's own map writer (`Dataplane::upsert`), with what a
/// frontend can carry: ClientIP affinity, loadBalancerSourceRanges, externalTrafficPolicy
/// Local's two scopes (pods get every endpoint); and a removal leaves nothing behind.
#[test]
fn ipv6_frontends_from_the_agents_writer_keep_affinity_source_ranges_and_scopes() {
    let Some(mut dp) = setup("ipv6_frontends_from_the_agents_writer_keep_affinity_source_ranges_and_scopes") else { return };
    let name = |svc: &str| ServicePortName { service: ObjectKey::new("default", svc), port: "http".into(), protocol: Protocol::Tcp };
    let backend = |s: &str| {
        let s = sock(s);
        ModelBackend { addr: (*s.ip()).into(), port: s.port(), terminating: false, local: false }
    };
    let key = |s: &str| {
        let s = sock(s);
        FrontendKey { addr: (*s.ip()).into(), port: s.port(), protocol: Protocol::Tcp }
    };
    let backends = ["[fd00:10:244:1::2]:8080", "[fd00:10:244:1::3]:8080", "[fd00:10:244:2::4]:8080"];

    // ClientIP affinity: every new connection of a client goes to one backend.
    let mut sticky = Frontend::new(name("sticky"), FrontendKind::ClusterIp, backends.iter().map(|b| backend(b)).collect());
    sticky.affinity_timeout = Some(10_800);
    dp.upsert(&key(VIP), &sticky).expect("program the IPv6 frontend");
    let client = sock(CLIENT);
    let seen: std::collections::BTreeSet<_> = (0..20u16)
        .map(|i| {
            let from = SocketAddrV6::new(*client.ip(), 41000 + i, 0, 0);
            dissect(&run(&mut dp, &tcp_frame(from, sock(VIP), SYN)).frame).dst_sock()
        })
        .collect();
    assert_eq!(seen.len(), 1, "one backend for the client: {seen:?}");

    // Load-balancer IP with source ranges, and externalTrafficPolicy Local: outside clients
    // would get the local endpoint only; pods get every endpoint; sources outside the ranges
    // are dropped.
    let lb = "[2001:db8::10]:80";
    let mut fe = Frontend::new(name("lb"), FrontendKind::LoadBalancer, vec![backend(backends[0])]);
    fe.internal_backends = Some(backends.iter().map(|b| backend(b)).collect());
    fe.source_ranges = vec!["fd00:10:244::/64".parse().unwrap()];
    dp.upsert(&key(lb), &fe).expect("program the IPv6 load-balancer frontend");
    let spread: std::collections::BTreeSet<_> = (0..60u16)
        .map(|i| {
            let from = SocketAddrV6::new(*client.ip(), 42000 + i, 0, 0);
            dissect(&run(&mut dp, &tcp_frame(from, sock(lb), SYN)).frame).dst_sock()
        })
        .collect();
    assert_eq!(spread.len(), 3, "pods reach every endpoint through the internal scope: {spread:?}");
    let outsider = sock("[fd00:10:245::9]:40000");
    let out = run(&mut dp, &tcp_frame(outsider, sock(lb), SYN));
    assert_eq!(out.action, TC_ACT_SHOT, "a source outside the ranges");
    assert_eq!(counters(&mut dp).get("drop_source_range"), Some(&1));

    // Removal leaves the IPv6 maps empty.
    dp.remove(&key(VIP)).expect("remove");
    dp.remove(&key(lb)).expect("remove");
    dp.collect_garbage().expect("collect garbage");
    let counts = dp.count_in_kernel().expect("count");
    for map in [map_names::SERVICES6, map_names::REVNAT6, map_names::NAMES6, map_names::BACKENDS6, map_names::SOURCE_RANGES6] {
        assert_eq!(counts.get(map), Some(&0), "{map} emptied: {counts:?}");
    }
    assert_eq!(dp.backend_count(), 0);
}

/// A pod reaching itself through an IPv6 Service: sent back to it from the IPv6 hairpin
/// address (of the discard-only prefix 100::/64, which the pod routes to the node), and its
/// answer turned back into the Service's.
#[test]
fn an_ipv6_pod_reaching_itself_through_its_service_is_hairpinned() {
    let Some(mut dp) = setup("an_ipv6_pod_reaching_itself_through_its_service_is_hairpinned") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let me = sock("[fd00:10:244:1::2]:40000");
    let hairpin = sock("[100::a9fe:2a01]:40000");
    let out = run(&mut dp, &tcp_frame(me, sock(VIP), SYN));
    assert_eq!(out.action, TC_ACT_REDIRECT, "straight back out the pod's interface");
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (hairpin, sock(BACKEND)), "the pod must not see itself as the source");
    assert_eq!(d.l4_checksum_ok, Some(true));
    let out = run(&mut dp, &tcp_frame(sock(BACKEND), hairpin, SYN | ACK));
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (sock(VIP), me));
    assert_eq!(d.l4_checksum_ok, Some(true));
    let out = run(&mut dp, &tcp_frame(me, sock(VIP), ACK));
    assert_eq!((out.action, dissect(&out.frame).src_sock()), (TC_ACT_REDIRECT, hairpin), "established packets too");
}

/// TC's flow cache serves IPv6 flows as IPv4's (`packets::tc_repeats_a_tracked_flows_...`):
/// with the flow's entries gone, its packets in the window are translated each way as before,
/// until the agent deletes the Service.
#[test]
fn ipv6_tc_repeats_a_tracked_flows_translation_from_its_cache_until_its_service_goes() {
    let Some(mut dp) = setup("ipv6_tc_repeats_a_tracked_flows_translation_from_its_cache") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip, backend) = (sock(CLIENT), sock(VIP), sock(BACKEND));
    let (ack, reply) = (tcp_frame(client, vip, ACK), tcp_frame(backend, client, ACK));
    within_a_window("cached translations", || {
        forget_conntrack(&mut dp);
        dp.invalidate_cached_flows();
        assert_eq!(run(&mut dp, &tcp_frame(client, vip, SYN)).action, TC_ACT_OK, "a new flow");
        let tracked = run(&mut dp, &ack);
        assert_eq!(dissect(&tracked.frame).dst_sock(), backend);
        let learned = run_egress(&mut dp, &reply);
        assert_eq!(run_egress(&mut dp, &reply).frame, learned.frame);
        forget_conntrack(&mut dp);
        let (out, back) = (run(&mut dp, &ack), run_egress(&mut dp, &reply));
        if !conntrack6(&mut dp).is_empty() {
            return false;
        }
        assert_eq!((out.action, &out.frame), (TC_ACT_OK, &tracked.frame), "sent on from the cache, translated as before");
        let d = dissect(&back.frame);
        assert_eq!((back.action, d.src_sock(), d.dst_sock()), (TC_ACT_OK, vip, client), "the reply from the cache");
        assert_eq!(d.l4_checksum_ok, Some(true));
        true
    });
    let key = FrontendKey { addr: (*vip.ip()).into(), port: vip.port(), protocol: Protocol::Tcp };
    dp.remove(&key).unwrap();
    let back = run_egress(&mut dp, &reply);
    assert_eq!((back.action, &back.frame), (TC_ACT_OK, &reply), "the Service gone: untranslated");
}

/// A fragmented IPv6 datagram of a flow whose step TC's cache holds takes the conntrack path
/// (its first fragment tells the fragment map where the later ones go; the cache serves whole
/// datagrams only), and its later fragment follows it.
#[test]
fn an_ipv6_fragmented_datagram_of_a_cached_flow_is_followed_by_its_later_fragment() {
    let Some(mut dp) = setup("an_ipv6_fragmented_datagram_of_a_cached_flow") else { return };
    program6(&mut dp, "[fd00:10:96::a]:53", UDP, &["[fd00:10:244:1::9]:5353"]);
    let (client, vip, backend) = (sock(CLIENT), sock("[fd00:10:96::a]:53"), sock("[fd00:10:244:1::9]:5353"));
    let small = packet6::udp_frame(client, vip, b"q");
    let whole = packet6::udp_datagram(client, vip, &[5u8; 100]);
    let (first, rest) = whole.split_at(56);
    let mut id = 0xabcd;
    within_a_window("a fragmented datagram of a cached flow", || {
        forget_conntrack(&mut dp);
        dp.invalidate_cached_flows();
        run(&mut dp, &small);
        assert_eq!(dissect(&run(&mut dp, &small).frame).dst_sock(), backend, "caches the entry");
        // Served from the cache with the entries gone; the datagram's first fragment then
        // tracks the flow afresh, and remembers where its later one goes.
        forget_conntrack(&mut dp);
        if dissect(&run(&mut dp, &small).frame).dst_sock() != backend || !conntrack6(&mut dp).is_empty() {
            return false;
        }
        id += 1;
        let frag = |off: u16, more: bool, bytes: &[u8]| {
            Ipv6::new(*client.ip(), *vip.ip(), UDP, bytes.to_vec()).with_ext(FRAGMENT, Ipv6::fragment(off, more, id)).frame()
        };
        assert_eq!(dissect(&run(&mut dp, &frag(0, true, first)).frame).dst_sock(), backend);
        assert_eq!(dissect(&run(&mut dp, &frag(7, false, rest)).frame).dst, *backend.ip(), "the later fragment follows the first");
        true
    });
}

/// An IPv6 reply's cached step lasts until the conntrack path would next write the reply entry
/// (a second after the packet that last refreshed it), where that path checks the connection's
/// forward entry: a reply entry refreshed 900 ms ago leaves a window of 100 ms, in which the
/// cache answers the reply with the flow's entries gone, and after which a reply whose
/// connection's forward entry is gone is left as it is.
#[test]
fn an_ipv6_replys_cached_step_ends_where_the_conntrack_path_would_check_its_connection() {
    let Some(mut dp) = setup("an_ipv6_replys_cached_step_ends_where_the_conntrack_path_would_check") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip, backend) = (sock(CLIENT), sock(VIP), sock(BACKEND));
    let reply = tcp_frame(backend, client, ACK);
    let is_reply = |e: &CtEntry<Ip6>| e.flags & proxy_common::ct::flags::REPLY != 0;
    let entry = |dp: &mut EbpfDataplane, reply: bool| conntrack6(dp).into_iter().find(|(_, e)| is_reply(e) == reply).expect("the entry");
    within_a_window("a reply's window ended by a refresh", || {
        forget_conntrack(&mut dp);
        dp.invalidate_cached_flows();
        assert_eq!(run(&mut dp, &tcp_frame(client, vip, SYN)).action, TC_ACT_OK);
        run_egress(&mut dp, &reply);
        let old = proxy_agent::dataplane::ebpf::ct_gc::monotonic_coarse_ns() - 900_000_000;
        let (k, mut e) = entry(&mut dp, true);
        e.last_seen_ns = old;
        ct6_map(&mut dp).insert(k, e, 0).unwrap();
        assert_eq!(dissect(&run_egress(&mut dp, &reply).frame).src_sock(), vip, "not due yet: caches the step");
        // Cached: answered with the entries gone (then put back), unless the window ended.
        if !without_conntrack(&mut dp, |dp| dissect(&run_egress(dp, &reply).frame).src_sock() == vip) {
            return false;
        }
        if entry(&mut dp, true).1.last_seen_ns != old {
            // The clock ticked past the refresh before the reply that filled the slot.
            return false;
        }
        let (fk, _) = entry(&mut dp, false);
        ct6_map(&mut dp).remove(&fk).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(150));
        let back = run_egress(&mut dp, &reply);
        assert_eq!((back.action, &back.frame), (TC_ACT_OK, &reply), "the connection gone: left as it is, not answered from the cache");
        true
    });
}

/// A forward conntrack entry keeps the two address sums its DNAT needs. An entry an older build
/// wrote has zeroes there (its padding then); its established packets are translated all the
/// same, from the addresses, with valid checksums.
#[test]
fn ipv6_entries_without_kept_sums_are_translated_from_their_addresses() {
    kept_sums("ipv6_entries_without_kept_sums_are_translated_from_their_addresses", false);
}

/// The same for a reply entry and the reverse NAT on egress: its sums are the reply's addresses
/// and the change from the backend's address to the Service's, made from the forward ones.
#[test]
fn ipv6_reply_entries_keep_their_sums_and_go_without_them() {
    kept_sums("ipv6_reply_entries_keep_their_sums_and_go_without_them", true);
}

/// A new flow's entry (the reply's if `reply`) keeps the sums of its key's addresses and of its
/// rewrite; the datapath uses them (a wrong delta breaks the checksum), and an entry without
/// them is translated to the same packet from the addresses.
fn kept_sums(test: &str, reply: bool) {
    let Some(mut dp) = setup(test) else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip, backend) = (sock(CLIENT), sock(VIP), sock(BACKEND));
    assert_eq!(run(&mut dp, &tcp_frame(client, vip, SYN)).action, TC_ACT_OK);
    let (frame, seen_at, want) = if reply {
        (tcp_frame(backend, client, ACK), Ip6::from_bytes(backend.ip().octets()), (vip, client))
    } else {
        (tcp_frame(client, vip, ACK), Ip6::from_bytes(vip.ip().octets()), (client, backend))
    };
    let send = |dp: &mut EbpfDataplane| if reply { run_egress(dp, &frame) } else { run(dp, &frame) };
    // The entry whose key has the Service's address (forward) or the backend's (reply).
    let mine = |dp: &mut EbpfDataplane| {
        conntrack6(dp).into_iter().find(|(k, _)| if reply { k.saddr == seen_at } else { k.daddr == seen_at }).expect("the entry")
    };
    // A first reply learns its checksum's form through the helper; the rows below are later ones.
    send(&mut dp);
    let (key, mut entry) = mine(&mut dp);
    let sums = if reply {
        (csum::address_pair(key.saddr, key.daddr), csum::address_delta(key.saddr, entry.nat_addr))
    } else {
        (csum::address_pair(key.saddr, key.daddr), csum::address_delta(key.daddr, entry.nat_addr))
    };
    assert_eq!((entry.addr_sum, entry.addr_delta), sums, "a new flow's entry keeps its sums");
    let kept = send(&mut dp);
    let d = dissect(&kept.frame);
    assert_eq!((kept.action, d.src_sock(), d.dst_sock(), d.l4_checksum_ok), (TC_ACT_OK, want.0, want.1, Some(true)));
    let write = |dp: &mut EbpfDataplane, entry: CtEntry<Ip6>| {
        ct6_map(dp).insert(key, entry, 0).expect("write the entry");
        // Written behind the datapath's back: TC's flow cache would serve the step it holds
        // for up to a second.
        dp.invalidate_cached_flows();
    };
    // The kept delta is what the translation adds: a wrong one gives a wrong checksum.
    entry.addr_delta = [entry.addr_delta[0] ^ 0x10, entry.addr_delta[1]];
    write(&mut dp, entry);
    assert_eq!(dissect(&send(&mut dp).frame).l4_checksum_ok, Some(false), "the datapath uses the kept delta");
    (entry.addr_sum, entry.addr_delta) = ([0, 0], [0, 0]);
    write(&mut dp, entry);
    let summed = send(&mut dp);
    let d = dissect(&summed.frame);
    assert_eq!((summed.action, d.src_sock(), d.dst_sock()), (TC_ACT_OK, want.0, want.1));
    assert_eq!(d.l4_checksum_ok, Some(true), "TCP checksum from the summed addresses");
    assert_eq!(summed.frame, kept.frame, "the same packet as with the kept sums");
    assert_eq!(mine(&mut dp).1.addr_sum, [0, 0], "the entry is left as it was found");
}

/// `proxy_tc_ingress6`, which pod ingress no longer enters, is what an older build's ingress
/// program tail-calls while an upgrade replaces it: it still serves a new flow and an
/// established one, with the new build's maps and new-flow program.
#[test]
fn the_ipv6_program_an_older_ingress_enters_serves_new_and_tracked_flows() {
    let Some(mut dp) = setup("the_ipv6_program_an_older_ingress_enters_serves_new_and_tracked_flows") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip, backend) = (sock(CLIENT), sock(VIP), sock(BACKEND));
    for (flags, what) in [(SYN, "a new flow"), (ACK, "an established one")] {
        let out = testrun::run_program(&mut dp, proxy_common::prog_names::TC_INGRESS6, &tcp_frame(client, vip, flags));
        let d = dissect(&out.frame);
        assert_eq!((out.action, d.src_sock(), d.dst_sock()), (TC_ACT_OK, client, backend), "{what}");
        assert_eq!(d.l4_checksum_ok, Some(true), "{what}");
    }
    let c = counters(&mut dp);
    assert_eq!((c.get("new_flow"), c.get("established")), (Some(&1), Some(&1)), "{c:?}");
}

/// With the IPv6 programs' slots empty (as for a moment while a restart between builds refills
/// them), IPv6 passes untouched, as before this agent served IPv6: never dropped. (Pod ingress
/// serves IPv6's tracked flows itself and enters a slot for a new flow's stage, or an ICMPv6
/// error.)
#[test]
fn ipv6_passes_untouched_when_its_programs_cannot_be_entered() {
    let Some(mut dp) = setup("ipv6_passes_untouched_when_its_programs_cannot_be_entered") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    {
        let map = dp.ebpf_mut().map_mut(map_names::PROGS).expect("the program array");
        let mut progs = aya::maps::ProgramArray::try_from(map).expect("a program array");
        for slot in [proxy_common::prog_slots::INGRESS6, proxy_common::prog_slots::INGRESS6_NEW, proxy_common::prog_slots::EGRESS6] {
            progs.clear_index(&slot).expect("empty the slot");
        }
    }
    let syn = tcp_frame(sock(CLIENT), sock(VIP), SYN);
    assert_untouched(&mut dp, &syn, "ingress");
    let out = run_egress(&mut dp, &syn);
    assert_eq!((out.action, out.frame == syn), (TC_ACT_OK, true), "egress");
    assert_eq!(counters(&mut dp).get("pass_no_stage"), Some(&2));
}

/// kube-proxy's `cluster-ips-check` for an IPv6 Service CIDR, beside an IPv4 one (the agent
/// writes each family's ranges and allocated cluster IPs to its own map): a new flow to an
/// IPv6 cluster IP on a port its Service lacks gets ICMPv6 port unreachable where it enters,
/// a packet to a free address is dropped as it leaves; outside the ranges nothing changes, and
/// removing the IPv6 range leaves the IPv4 check as it was.
#[test]
fn ipv6_service_cidrs_drop_free_addresses_and_reject_unserved_ports() {
    let Some(mut dp) = setup("ipv6_service_cidrs_drop_free_addresses_and_reject_unserved_ports") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let client = sock(CLIENT);
    let other_port = tcp_frame(client, sock("[fd00:10:96::10]:81"), SYN);
    let free = tcp_frame(client, sock("[fd00:10:96::77]:80"), SYN);
    let (free_udp_to, outside_to) = (sock("[fd00:10:96::ff01]:53"), sock("[fd00:10:97::1]:80"));
    let free_udp = Ipv6::new(*client.ip(), *free_udp_to.ip(), UDP, packet6::udp_datagram(client, free_udp_to, b"q")).frame();
    let outside = tcp_frame(client, outside_to, SYN);
    assert_untouched(&mut dp, &other_port, "no ranges: another port of a cluster IP");
    assert_leaves(&mut dp, &free, "no ranges: a free address leaves");
    let cidr = |s: &str| s.parse::<proxy_agent::model::store::Cidr>().unwrap();
    let v4_free = proxy_tests::packet::tcp_frame("10.244.0.5:40000".parse().unwrap(), "10.96.0.77:80".parse().unwrap(), SYN);
    let allocated: std::collections::BTreeSet<std::net::IpAddr> = ["fd00:10:96::10".parse().unwrap(), "10.96.0.10".parse().unwrap()].into();
    // A second IPv6 range far from the first: the prefilter, their common prefix, holds both.
    let ranges = [cidr("10.96.0.0/16"), cidr("fd00:10:96::/112"), cidr("fd00:20::/112")];
    dp.set_cluster_ip_ranges(&ranges, &allocated).expect("write both families' ranges");
    let config: aya::maps::Array<_, proxy_common::Config> =
        aya::maps::Array::try_from(dp.ebpf_mut().map(map_names::CONFIG).unwrap()).unwrap();
    let config = config.get(&0, 0).unwrap();
    let ip6 = |s: &str| Ip6::from_bytes(s.parse::<std::net::Ipv6Addr>().unwrap().octets());
    assert_eq!((config.svc_net6, config.svc_mask6, config.svc_cidrs6), (ip6("fd00::"), ip6("ffff:ffc0::"), 2), "fd00::/26");
    let out = run(&mut dp, &other_port);
    assert_eq!(out.action, TC_ACT_REDIRECT, "an unserved port of an IPv6 cluster IP is answered");
    let d = dissect(&out.frame);
    assert_eq!((d.src, d.dst), ("fd00:10:96::10".parse().unwrap(), *client.ip()), "from the cluster IP to the client");
    let (kind, code, _) = d.icmp.expect("an ICMPv6 message (its checksum verified)");
    assert_eq!((kind, code), (1, 4), "port unreachable");
    for (frame, what) in [(&free, "a free TCP address"), (&free_udp, "a free UDP address")] {
        assert_untouched(&mut dp, frame, &format!("{what} on ingress: something on the way may still take it"));
        assert_eq!(run_egress(&mut dp, frame).action, TC_ACT_SHOT, "{what} is dropped as it leaves");
    }
    let second = tcp_frame(client, sock("[fd00:20::9]:443"), SYN);
    assert_eq!(run_egress(&mut dp, &second).action, TC_ACT_SHOT, "the second range too");
    assert_untouched(&mut dp, &outside, "outside every range");
    assert_leaves(&mut dp, &outside, "outside every range, leaving");
    assert_leaves(&mut dp, &other_port, "an allocated address is not dropped as it leaves");
    assert_eq!(run_egress(&mut dp, &v4_free).action, TC_ACT_SHOT, "the IPv4 range's check beside it");
    let out = run(&mut dp, &tcp_frame(client, sock(VIP), SYN));
    assert_eq!(dissect(&out.frame).dst_sock(), sock(BACKEND), "the Service itself is served");
    let c = counters(&mut dp);
    assert_eq!((c.get("reject_cluster_ip_port"), c.get("drop_unallocated_cluster_ip")), (Some(&1), Some(&4)), "{c:?}");
    // Outside the common prefix nothing is looked up: a stray range there (written behind the
    // agent's back) is not seen.
    fn trie6(dp: &mut EbpfDataplane) -> aya::maps::lpm_trie::LpmTrie<&mut aya::maps::MapData, proxy_common::SvcCidrKey<Ip6>, u8> {
        aya::maps::lpm_trie::LpmTrie::try_from(dp.ebpf_mut().map_mut(map_names::SERVICE_CIDRS6).unwrap()).unwrap()
    }
    let stray = aya::maps::lpm_trie::Key::new(16, proxy_common::SvcCidrKey { addr: ip6("fd01::") });
    trie6(&mut dp).insert(&stray, proxy_common::svc_cidr::RANGE, 0).expect("write a stray range");
    let beyond = tcp_frame(client, sock("[fd01::1]:80"), SYN);
    assert_leaves(&mut dp, &beyond, "outside the common prefix, leaving");
    trie6(&mut dp).remove(&stray).expect("remove the stray range");
    // The far range goes: the prefix narrows to the one left, whose check holds.
    dp.set_cluster_ip_ranges(&ranges[..2], &allocated).expect("remove the far IPv6 range");
    let config: aya::maps::Array<_, proxy_common::Config> =
        aya::maps::Array::try_from(dp.ebpf_mut().map(map_names::CONFIG).unwrap()).unwrap();
    let config = config.get(&0, 0).unwrap();
    let want = (ip6("fd00:10:96::"), ip6("ffff:ffff:ffff:ffff:ffff:ffff:ffff:0"), 1);
    assert_eq!((config.svc_net6, config.svc_mask6, config.svc_cidrs6), want, "fd00:10:96::/112");
    assert_leaves(&mut dp, &second, "the far range's address leaves");
    assert_eq!(run_egress(&mut dp, &free).action, TC_ACT_SHOT, "a free address of the range left is dropped");
    // The IPv6 ranges go, the IPv4 one stays.
    dp.set_cluster_ip_ranges(&ranges[..1], &allocated).expect("remove the IPv6 ranges");
    assert_leaves(&mut dp, &free, "IPv6 range removed");
    assert_eq!(run_egress(&mut dp, &v4_free).action, TC_ACT_SHOT, "the IPv4 range still checked");
    assert_eq!(trie6(&mut dp).keys().count(), 0, "no IPv6 entries left");
}

/// ICMPv6 errors about translated flows reach the client rewritten, as nf_nat rewrites RELATED
/// packets: the quoted packet names the Service (address, port, the quoted UDP checksum made
/// right), the outer source is the Service where the backend itself sent the error, and the
/// ICMPv6 checksum holds. Packet Too Big most of all: without it the client cannot lower its
/// path MTU, and the connection stalls. An error about no tracked flow leaves untouched.
#[test]
fn icmpv6_errors_about_translated_flows_reach_the_client_rewritten() {
    let Some(mut dp) = setup("icmpv6_errors_about_translated_flows_reach_the_client_rewritten") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let dns_vip = sock("[fd00:10:96::a]:53");
    let dns_backend = sock("[fd00:10:244:1::9]:5353");
    program6(&mut dp, "[fd00:10:96::a]:53", UDP, &["[fd00:10:244:1::9]:5353"]);
    let (client, vip, backend) = (sock(CLIENT), sock(VIP), sock(BACKEND));
    let router: std::net::Ipv6Addr = "fd00:10:1::1".parse().unwrap();
    // The flows, as the backends see them (DNATed on their way in).
    let syn = run(&mut dp, &Ipv6::new(*client.ip(), *vip.ip(), TCP, tcp_segment(client, vip, ACK, &[9; 1300])).frame()).frame;
    assert_eq!(dissect(&syn).dst_sock(), backend);
    let query = Ipv6::new(*client.ip(), *dns_vip.ip(), UDP, packet6::udp_datagram(client, dns_vip, b"a query")).frame();
    let query = run(&mut dp, &query).frame;
    assert_eq!(dissect(&query).dst_sock(), dns_backend);
    let error = |from: std::net::Ipv6Addr, kind: u8, code: u8, rest: [u8; 4], about: &[u8]| {
        // An error quotes as much of the packet as fits in 1280 bytes.
        let quote = &about[14..about.len().min(14 + 1280 - 48)];
        Ipv6::new(from, *client.ip(), ICMPV6, packet6::icmpv6_message(from, *client.ip(), kind, code, rest, quote)).frame()
    };
    let quoted = |frame: &[u8]| {
        let d = dissect(frame);
        let (kind, code, body) = d.icmp.clone().expect("an ICMPv6 message (its checksum verified)");
        (d, kind, code, body)
    };
    let ip6 = |b: &[u8]| std::net::Ipv6Addr::from(<[u8; 16]>::try_from(b).unwrap());
    // Packet Too Big from a router on the way: the outer source stays, the quote is translated.
    let out = run_egress(&mut dp, &error(router, 2, 0, 1280u32.to_be_bytes(), &syn));
    assert_eq!(out.action, TC_ACT_OK);
    let (d, kind, code, body) = quoted(&out.frame);
    assert_eq!((d.src, d.dst, kind, code), (router, *client.ip(), 2, 0), "a router's PTB, to the client");
    assert_eq!((ip6(&body[8..24]), ip6(&body[24..40])), (*client.ip(), *vip.ip()), "the quote names the Service");
    assert_eq!(&body[40..44], &[&client.port().to_be_bytes()[..], &vip.port().to_be_bytes()[..]].concat()[..], "and its port");
    assert_eq!(out.frame[14 + 40 + 4..14 + 40 + 8], 1280u32.to_be_bytes(), "the MTU is kept");
    // Time exceeded and destination unreachable from the backend itself: the outer source
    // becomes the Service too.
    for (kind, code) in [(3, 0), (1, 1)] {
        let out = run_egress(&mut dp, &error(*backend.ip(), kind, code, [0; 4], &syn));
        let (d, k, c, body) = quoted(&out.frame);
        assert_eq!((d.src, k, c), (*vip.ip(), kind, code), "from the Service, not the backend");
        assert_eq!(ip6(&body[24..40]), *vip.ip());
    }
    // UDP port unreachable from the DNS backend: the quoted UDP checksum is right for the
    // datagram the client sent.
    let out = run_egress(&mut dp, &error(*dns_backend.ip(), 1, 4, [0; 4], &query));
    let (d, kind, code, body) = quoted(&out.frame);
    assert_eq!((d.src, kind, code), (*dns_vip.ip(), 1, 4));
    assert_eq!(&body[42..44], &dns_vip.port().to_be_bytes(), "the quoted destination port");
    assert!(packet6::l4_checksum_ok_over(*client.ip(), *dns_vip.ip(), UDP, &body[40..]), "the quoted UDP checksum");
    // A Packet Too Big about the first fragment of a large query the client sent: the quote
    // carries the Fragment header before the UDP header, and is translated past it.
    let frag_id = 0x4242;
    let big = Ipv6::new(*client.ip(), *dns_vip.ip(), UDP, packet6::udp_datagram(client, dns_vip, &[7; 1400]))
        .with_ext(FRAGMENT, Ipv6::fragment(0, true, frag_id));
    let first = run(&mut dp, &big.frame()).frame;
    assert_eq!(dissect(&first).dst_sock(), dns_backend, "the first fragment is DNATed");
    let out = run_egress(&mut dp, &error(router, 2, 0, 1280u32.to_be_bytes(), &first));
    let (_, kind, _, body) = quoted(&out.frame);
    assert_eq!(kind, 2);
    assert_eq!((body[6], body[40]), (FRAGMENT, UDP), "the quote keeps its Fragment header");
    assert_eq!(ip6(&body[24..40]), *dns_vip.ip(), "the quote names the Service");
    assert_eq!(&body[48 + 2..48 + 4], &dns_vip.port().to_be_bytes(), "and its port, past the Fragment header");
    let sent_udp = packet6::udp_datagram(client, dns_vip, &[7; 1400]);
    assert_eq!(&body[48 + 6..48 + 8], &sent_udp[6..8], "and the UDP checksum of the datagram as the client sent it");
    // A Destination Options header before TCP: the same.
    let opts =
        Ipv6::new(*client.ip(), *vip.ip(), TCP, tcp_segment(client, vip, ACK, &[5; 64])).with_ext(DEST_OPTS, Ipv6::padding_options());
    let sent = run(&mut dp, &opts.frame()).frame;
    assert_eq!(dissect(&sent).dst_sock(), backend);
    let out = run_egress(&mut dp, &error(router, 2, 0, 1280u32.to_be_bytes(), &sent));
    let (_, _, _, body) = quoted(&out.frame);
    assert_eq!(ip6(&body[24..40]), *vip.ip());
    assert_eq!(&body[48 + 2..48 + 4], &vip.port().to_be_bytes(), "the port past the options");
    // A later fragment quotes no ports: left as it is.
    // (Its payload starts with the flow's ports, so a walk that took it for a UDP header would
    // find the flow and translate.)
    let mut tail = [&client.port().to_be_bytes()[..], &dns_backend.port().to_be_bytes()[..]].concat();
    tail.resize(64, 7);
    let later = Ipv6::new(*client.ip(), *dns_backend.ip(), UDP, tail).with_ext(FRAGMENT, Ipv6::fragment(181, false, frag_id));
    let about_later = error(router, 2, 0, 1280u32.to_be_bytes(), &later.frame());
    assert_leaves(&mut dp, &about_later, "an error quoting a later fragment");
    // About a flow nobody tracks: left as it is.
    let stranger =
        Ipv6::new(*client.ip(), "fd00:10:244:1::77".parse().unwrap(), TCP, tcp_segment(client, sock("[fd00:10:244:1::77]:80"), SYN, &[]));
    let untracked = error(router, 2, 0, 1280u32.to_be_bytes(), &stranger.frame());
    assert_leaves(&mut dp, &untracked, "an error about no translated flow");
    // The same client port to a second Service of the same backend: the flow's client port is
    // moved (the translated tuple would clash), and an error about it names the client's own.
    let vip2 = sock("[fd00:10:96::11]:80");
    program6(&mut dp, "[fd00:10:96::11]:80", TCP, &[BACKEND]);
    let moved = run(&mut dp, &Ipv6::new(*client.ip(), *vip2.ip(), TCP, tcp_segment(client, vip2, SYN, &[])).frame()).frame;
    let d = dissect(&moved);
    assert_eq!(d.dst_sock(), backend);
    assert_ne!(d.sport, Some(client.port()), "the client port was moved");
    let out = run_egress(&mut dp, &error(*backend.ip(), 1, 4, [0; 4], &moved));
    let (d, _, _, body) = quoted(&out.frame);
    assert_eq!(d.src, *vip2.ip());
    assert_eq!(ip6(&body[24..40]), *vip2.ip(), "the quote names the second Service");
    assert_eq!(
        &body[40..44],
        &[&client.port().to_be_bytes()[..], &vip2.port().to_be_bytes()[..]].concat()[..],
        "and the client's own port"
    );
    assert_eq!(counters(&mut dp).get("icmp_error_nat"), Some(&7));
}

/// ICMPv6 errors about a Service's replies, arriving from the client's side, reach the backend
/// as nf_nat sends them: addressed to the backend, quoting the reply as the backend sent it, the
/// ICMPv6 checksum (whose pseudo-header holds the new destination) made right. A router's
/// Packet Too Big most of all: routers do not fragment IPv6, so without it a backend's large
/// replies are lost for good and the connection stalls.
#[test]
fn icmpv6_errors_about_a_services_replies_reach_the_backend() {
    let Some(mut dp) = setup("icmpv6_errors_about_a_services_replies_reach_the_backend") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip, backend) = (sock(CLIENT), sock(VIP), sock(BACKEND));
    let router: std::net::Ipv6Addr = "fd00:10:1::1".parse().unwrap();
    let syn = run(&mut dp, &tcp_frame(client, vip, SYN)).frame;
    assert_eq!(dissect(&syn).dst_sock(), backend);
    // A large reply, as the client's side of the path sees it.
    let reply = Ipv6::new(*backend.ip(), *client.ip(), TCP, tcp_segment(backend, client, ACK, &[3; 1400])).frame();
    let reply = run_egress(&mut dp, &reply).frame;
    assert_eq!((dissect(&reply).src_sock(), dissect(&reply).dst_sock()), (vip, client));
    let error = |from: std::net::Ipv6Addr, kind: u8, code: u8, rest: [u8; 4]| {
        let quote = &reply[14..reply.len().min(14 + 1280 - 48)];
        Ipv6::new(from, *vip.ip(), ICMPV6, packet6::icmpv6_message(from, *vip.ip(), kind, code, rest, quote)).frame()
    };
    let ip6 = |b: &[u8]| std::net::Ipv6Addr::from(<[u8; 16]>::try_from(b).unwrap());
    for (from, kind, code, rest) in [(router, 2, 0, 1280u32.to_be_bytes()), (*client.ip(), 1, 4, [0; 4])] {
        let out = run(&mut dp, &error(from, kind, code, rest));
        assert_eq!(out.action, TC_ACT_OK, "on through the stack, to the backend");
        // `dissect` checks the ICMPv6 checksum over the new pseudo-header.
        let d = dissect(&out.frame);
        assert_eq!((d.src, d.dst), (from, *backend.ip()), "type {kind}: to the backend, from whoever sent it");
        let (k, c, body) = d.icmp.expect("still ICMPv6");
        assert_eq!((k, c), (kind, code));
        assert_eq!(out.frame[14 + 40 + 4..14 + 40 + 8], rest, "the MTU is kept");
        assert_eq!((ip6(&body[8..24]), ip6(&body[24..40])), (*backend.ip(), *client.ip()), "the quote is the reply as sent");
        assert_eq!(&body[40..44], &[&backend.port().to_be_bytes()[..], &client.port().to_be_bytes()[..]].concat()[..], "and its ports");
    }
    // An error addressed elsewhere than the Service it quotes: untouched.
    let mut stray = error(router, 2, 0, 1280u32.to_be_bytes());
    stray[14 + 24 + 15] ^= 1;
    assert_untouched(&mut dp, &stray, "an error addressed elsewhere");
    assert_eq!(counters(&mut dp).get("icmp_error_nat"), Some(&2));
}

/// A ping to an IPv6 cluster IP is answered with port unreachable from the cluster IP, from a
/// pod (where it enters) and from the node (as it leaves), as IPv4's; a ping to a free address
/// of the Service CIDR is dropped as it leaves; neighbour discovery is no Service's business.
#[test]
fn a_ping_to_an_ipv6_cluster_ip_is_answered_port_unreachable() {
    let Some(mut dp) = setup("a_ping_to_an_ipv6_cluster_ip_is_answered_port_unreachable") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip) = (sock(CLIENT), sock(VIP));
    let ping = |to: std::net::Ipv6Addr| {
        Ipv6::new(*client.ip(), to, ICMPV6, packet6::icmpv6_message(*client.ip(), to, 128, 0, [0, 1, 0, 1], b"ping")).frame()
    };
    assert_untouched(&mut dp, &ping(*vip.ip()), "no Service CIDR known: a ping to a cluster IP");
    let allocated: std::collections::BTreeSet<std::net::IpAddr> = [(*vip.ip()).into()].into();
    dp.set_cluster_ip_ranges(&["fd00:10:96::/112".parse().unwrap()], &allocated).expect("write the range");
    for (out, what) in [(run(&mut dp, &ping(*vip.ip())), "from a pod"), (run_egress(&mut dp, &ping(*vip.ip())), "from the node")] {
        assert_eq!(out.action, TC_ACT_REDIRECT, "{what}: answered");
        let d = dissect(&out.frame);
        let (kind, code, body) = d.icmp.expect("an ICMPv6 message (its checksum verified)");
        assert_eq!((d.src, d.dst, kind, code), (*vip.ip(), *client.ip(), 1, 4), "{what}: port unreachable from the cluster IP");
        assert_eq!(body, ping(*vip.ip())[14..].to_vec(), "{what}: quoting the ping");
    }
    let free = ping("fd00:10:96::77".parse().unwrap());
    assert_untouched(&mut dp, &free, "a ping to a free address, entering");
    assert_eq!(run_egress(&mut dp, &free).action, TC_ACT_SHOT, "a ping to a free address is dropped as it leaves");
    let outside = ping("fd00:10:97::1".parse().unwrap());
    assert_untouched(&mut dp, &outside, "outside the range");
    assert_leaves(&mut dp, &outside, "a ping outside the range, leaving");
    // A neighbour solicitation for a cluster IP (to its solicited-node group): not a Service's.
    let group: std::net::Ipv6Addr = "ff02::1:ff00:10".parse().unwrap();
    let target = vip.ip().octets();
    let ns = Ipv6::new(*client.ip(), group, ICMPV6, packet6::icmpv6_message(*client.ip(), group, 135, 0, [0; 4], &target)).frame();
    assert_untouched(&mut dp, &ns, "neighbour solicitation");
    assert_leaves(&mut dp, &ns, "neighbour solicitation, leaving");
    assert_eq!(counters(&mut dp).get("reject_cluster_ip_port"), Some(&2));
}

/// IPv6 load-balancer maps an earlier run pinned at another size than the IPv4 ones (as when
/// the IPv4 ones were resized and the IPv6 ones kept) are adopted as they are, a missing one
/// of them is made at their size, and the writer and the fill gauges follow it, not IPv4's.
#[test]
fn ipv6_maps_pinned_at_another_size_keep_it_and_the_writer_follows_it() {
    if !require::root("ipv6_maps_pinned_at_another_size_keep_it_and_the_writer_follows_it") {
        return;
    }
    use proxy_agent::dataplane::{ebpf::loader::LoadOptions, DataplaneError};
    let root = proxy_tests::lab::TempBpffs::new("pxpin6");
    let load = |lb_map_max: u32| {
        EbpfDataplane::load(LoadOptions { pin_root: Some(root.0.clone()), lb_map_max, ..Default::default() }).expect("load with pins")
    };
    drop(load(8));
    // The IPv4 load-balancer maps go (so the next start creates them at the new size); the
    // IPv6 ones stay pinned at 8 entries.
    let maps = proxy_agent::dataplane::ebpf::loader::maps_dir(&root.0);
    for name in map_names::LB_V4 {
        std::fs::remove_file(maps.join(name)).expect("remove an IPv4 pin");
    }
    // And one IPv6 map goes too (as when a build adds one): it must come back at its family's
    // size, not IPv4's, or ids the writer hands out would fall past its end.
    std::fs::remove_file(maps.join(map_names::BACKENDS6)).expect("remove an IPv6 pin");
    let mut dp = load(64);
    let caps = dp.capacities();
    assert_eq!((caps.lb, caps.lb6), (64, 8), "each family's maps reported at their own size");
    let held = |name: &str| aya::maps::MapInfo::from_pin(maps.join(name)).expect("a pinned map").max_entries();
    assert_eq!((held(map_names::BACKENDS6), held(map_names::BACKENDS)), (8, 64), "an unpinned map is made at its family's size");
    // IPv4 takes more than 8 entries; IPv6 is refused as full at its own 8.
    for i in 0..6u8 {
        let key = FrontendKey { addr: std::net::IpAddr::from([10, 96, 0, 10 + i]), port: 80, protocol: Protocol::Tcp };
        let name = ServicePortName { service: ObjectKey::new("default", format!("v4-{i}")), port: "http".into(), protocol: Protocol::Tcp };
        let backend = ModelBackend { addr: std::net::IpAddr::from([10, 244, 1, 2 + i]), port: 8080, terminating: false, local: false };
        dp.upsert(&key, &Frontend::new(name, FrontendKind::ClusterIp, vec![backend])).expect("an IPv4 frontend");
    }
    let mut programmed = 0;
    let refused = (0..8u16).find_map(|i| {
        let key = FrontendKey { addr: format!("fd00:10:96::{:x}", 0x10 + i).parse().unwrap(), port: 80, protocol: Protocol::Tcp };
        let name = ServicePortName { service: ObjectKey::new("default", format!("v6-{i}")), port: "http".into(), protocol: Protocol::Tcp };
        let backend =
            ModelBackend { addr: format!("fd00:10:244:1::{:x}", 2 + i).parse().unwrap(), port: 8080, terminating: false, local: false };
        match dp.upsert(&key, &Frontend::new(name, FrontendKind::ClusterIp, vec![backend])) {
            Ok(()) => {
                programmed += 1;
                None
            }
            Err(e) => Some(e),
        }
    });
    match refused {
        Some(DataplaneError::MapFull { max, .. }) => assert_eq!(max, 8, "full at the IPv6 maps' own size"),
        other => panic!("expected the IPv6 maps to fill at 8 entries, got {other:?} after {programmed} frontends"),
    }
    assert_eq!(programmed, 4, "the IPv6 frontends that fit are programmed: a master and a backend slot each, in 8 entries");
    // The ones that fit serve.
    let out = run(&mut dp, &tcp_frame(sock(CLIENT), sock("[fd00:10:96::10]:80"), SYN));
    assert_eq!(dissect(&out.frame).dst_sock(), sock("[fd00:10:244:1::2]:8080"));
}

/// IPv6's conntrack filter, as IPv4's (`packets.rs`): heeded before the lookup (a cleared filter
/// leaves a tracked reply untranslated), and rebuilt from the IPv6 conntrack map.
#[test]
fn ipv6_conntrack_filter_is_heeded_and_rebuilt() {
    use proxy_agent::dataplane::ebpf::ct_filter;
    use std::os::fd::AsFd;
    let Some(mut dp) = setup("ipv6_conntrack_filter_is_heeded_and_rebuilt") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip, backend) = (sock(CLIENT), sock(VIP), sock(BACKEND));
    run(&mut dp, &tcp_frame(client, vip, SYN));
    let reply = tcp_frame(backend, client, SYN | ACK);
    assert_eq!(dissect(&run_egress(&mut dp, &reply).frame).src_sock(), vip, "a tracked reply is translated");
    ct_filter::clear(testrun::map_fd(&mut dp, map_names::CT_FILTER6).as_fd()).unwrap();
    assert_leaves(&mut dp, &reply, "with the filter cleared, the reply is taken for a packet of no flow");
    // And at pod ingress, the flow's next segment for a new flow's, met mid-connection.
    run(&mut dp, &tcp_frame(client, vip, ACK));
    assert_eq!(counters(&mut dp).get("new_flow_mid_connection"), Some(&1), "{:?}", counters(&mut dp));
    // Tracked afresh, that segment set its flow's bits again: cleared once more, so that only
    // the rebuild can give them back.
    ct_filter::clear(testrun::map_fd(&mut dp, map_names::CT_FILTER6).as_fd()).unwrap();
    assert_leaves(&mut dp, &reply, "cleared again");
    let [v4, v6] = dp.rebuild_conntrack_filters().unwrap();
    assert_eq!((v4.keys, v6.keys), (0, 2), "the IPv6 map's forward and reply entries walked");
    assert_eq!(dissect(&run_egress(&mut dp, &reply).frame).src_sock(), vip, "translated again once rebuilt");
    assert_eq!(dissect(&run(&mut dp, &tcp_frame(client, vip, ACK)).frame).dst_sock(), backend);
    assert_eq!(counters(&mut dp).get("new_flow_mid_connection"), Some(&1), "found at pod ingress once rebuilt");
}

/// IPv6 flows past their lifetime go with their reply entries (`ct_gc`), a hairpinned one's
/// (replies to IPv6's hairpin address) included; until then they stay.
#[test]
fn ipv6_expired_flows_are_removed_with_their_reply_entries() {
    use proxy_agent::dataplane::ebpf::ct_gc::{self, Collected};
    let Some(mut dp) = setup("ipv6_expired_flows_are_removed_with_their_reply_entries") else { return };
    program6(&mut dp, VIP, TCP, &[BACKEND]);
    let (client, vip, backend) = (sock(CLIENT), sock(VIP), sock(BACKEND));
    run(&mut dp, &tcp_frame(client, vip, SYN));
    let me = SocketAddrV6::new(*backend.ip(), 41000, 0, 0);
    run(&mut dp, &tcp_frame(me, vip, SYN));
    let ct = conntrack6(&mut dp);
    assert_eq!(ct.len(), 4, "two flows, one hairpinned, each with its reply entry: {ct:#?}");
    assert!(ct.iter().any(|(_, e)| e.flags & proxy_common::ct::flags::HAIRPIN != 0), "{ct:#?}");
    let now = ct_gc::monotonic_coarse_ns();
    let syn = proxy_common::ct::Lifetimes::DEFAULT.tcp_syn_ns;
    assert_eq!(dp.collect_expired_flows(now + syn).unwrap(), [Collected::default(); 2], "inside the margin");
    let [v4, v6] = dp.collect_expired_flows(now + syn + 1_000_000_000 + ct_gc::MARGIN_NS).unwrap();
    assert_eq!((v4, v6), (Collected::default(), Collected { flows: 2, replies: 2, orphans: 0 }));
    assert!(conntrack6(&mut dp).is_empty());
}
