//! North-south packet tables: frames arriving on an external interface through the real TC
//! external ingress and XDP programs (BPF_PROG_TEST_RUN), inside a namespace of the test's own
//! whose routes and neighbours the programs' FIB lookups use. Outputs are dissected and every
//! checksum is verified independently.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddrV4},
};

use proxy_agent::{
    dataplane::{
        ebpf::{xdpdevs, EbpfDataplane},
        Dataplane,
    },
    model::{Backend, Frontend, FrontendKey, FrontendKind, ObjectKey, Protocol, ServicePortName},
};
use proxy_common::{
    ct::{flags, ROUTE_XDP_KNOWN},
    xdp_dev, Config,
};
use proxy_tests::{
    netns::{enter, ifindex, routed_uplink_node, Netns},
    packet::{dissect, tcp_frame, udp_frame, Ipv4, ACK, FIN, ICMP, RST, SYN, TCP, UDP},
    require,
    testrun::{
        self, conntrack, counters, forget_conntrack, run, run_egress, run_ext, run_xdp, within_a_window, without_conntrack, TC_ACT_OK,
        TC_ACT_REDIRECT, TC_ACT_SHOT, XDP_DROP, XDP_PASS, XDP_TX,
    },
};

const NODE_IP: &str = "192.168.50.1";
const ROUTER: &str = "192.168.50.2";
const ROUTER_MAC: [u8; 6] = [0x02, 0x50, 0, 0, 0, 0x02];
const CLIENT: &str = "198.51.100.7:40000";
const NODE_PORT: &str = "192.168.50.1:30080";
const REMOTE: &str = "10.244.2.5:8080";
const LOCAL: &str = "10.244.1.5:8080";

/// XDP hands `frame` to TC and the stack as it arrived.
fn assert_xdp_passes(n: &mut Node, frame: &[u8], what: &str) {
    let out = run_xdp(&mut n.dp, frame, n.ifindex);
    assert_eq!((out.action, out.frame.as_slice()), (XDP_PASS, frame), "{what}: expected XDP_PASS, the frame untouched");
}
fn sock(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

/// A node namespace with one external interface (`ext0`, 192.168.50.1/24) whose next hop
/// (192.168.50.2) leads to the client's network and to the other node's pods. The test's
/// thread enters it, so the programs' FIB lookups see its routes.
struct Node {
    _ns: Netns,
    ifindex: u32,
    mac: [u8; 6],
    dp: EbpfDataplane,
}

fn node(test: &str) -> Option<Node> {
    if !require::root(test) {
        return None;
    }
    let ns = routed_uplink_node("pxn", false);
    enter(&ns.file()).expect("enter the node namespace");
    let ifindex = ifindex("ext0");
    let mut dp = testrun::dataplane();
    dp.set_interface_address(ifindex, Some(NODE_IP.parse().unwrap())).unwrap();
    // What the agent records for an uplink whose far end takes frames from native XDP, as a
    // NIC's does (see `xdp_hands_flows_to_tc_when_the_uplink_cannot_take_its_frames`).
    dp.set_xdp_devices(&[(ifindex, xdp_dev::TX | xdp_dev::XMIT)].into()).unwrap();
    Some(Node { _ns: ns, ifindex, mac: [0x02, 0x50, 0, 0, 0, 1], dp })
}

fn backend(s: &str, local: bool) -> Backend {
    let s = sock(s);
    Backend { addr: (*s.ip()).into(), port: s.port(), terminating: false, local }
}

fn frontend(kind: FrontendKind, backends: Vec<Backend>) -> Frontend {
    let name = ServicePortName { service: ObjectKey::new("default", "web"), port: "http".into(), protocol: Protocol::Tcp };
    Frontend::new(name, kind, backends)
}

fn key(s: &str, protocol: Protocol) -> FrontendKey {
    let s = sock(s);
    FrontendKey { addr: (*s.ip()).into(), port: s.port(), protocol }
}

#[test]
fn a_node_port_flow_to_a_remote_backend_is_dnatted_snatted_and_sent_by_fib() {
    let Some(mut n) = node("a_node_port_flow_to_a_remote_backend_is_dnatted_snatted_and_sent_by_fib") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let syn = tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN);
    let out = run_ext(&mut n.dp, &syn, n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT, "sent on past the stack");
    let d = dissect(&out.frame);
    assert_eq!(d.dst_sock(), sock(REMOTE));
    assert_eq!(d.src, NODE_IP.parse::<Ipv4Addr>().unwrap(), "SNAT to the node's address");
    let snat_port = d.sport.unwrap();
    assert!((61000..=65535).contains(&snat_port), "SNAT port {snat_port} outside the reserved range");
    assert!(d.ip_checksum_ok && d.l4_checksum_ok == Some(true), "{d:?}");
    assert_eq!((d.eth_dst, d.eth_src), (ROUTER_MAC, n.mac), "addressed to the next hop");
    assert_eq!(out.frame[14 + 8], 63, "TTL decremented");

    // The port mapping is tracked both ways.
    let ct = conntrack(&mut n.dp);
    let fwd = ct.iter().find(|(k, _)| k.src() == sock(CLIENT)).expect("forward entry").1;
    assert!(fwd.flags & flags::SNAT != 0 && u16::from_be_bytes(fwd.snat_port) == snat_port);
    let reply_key = ct.iter().find(|(k, _)| k.src() == sock(REMOTE)).expect("reply entry").0;
    assert_eq!(reply_key.dst(), SocketAddrV4::new(NODE_IP.parse().unwrap(), snat_port));

    // The backend's reply comes back to the node and leaves towards the client as the NodePort.
    let reply = tcp_frame(sock(REMOTE), SocketAddrV4::new(NODE_IP.parse().unwrap(), snat_port), SYN | ACK);
    let out = run_ext(&mut n.dp, &reply, n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (sock(NODE_PORT), sock(CLIENT)));
    assert!(d.ip_checksum_ok && d.l4_checksum_ok == Some(true));

    // Later packets of the flow keep their port mapping.
    let ack = tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK);
    let d = dissect(&run_ext(&mut n.dp, &ack, n.ifindex).frame);
    assert_eq!((d.src.to_string(), d.sport), (NODE_IP.to_string(), Some(snat_port)));
    let c = counters(&mut n.dp);
    assert_eq!((c.get("ext_new_remote"), c.get("ext_reply"), c.get("ext_established")), (Some(&1), Some(&1), Some(&1)), "{c:?}");
}

/// Records what the kernel says XDP may send out of each interface of the node, as the agent
/// does.
fn sync_xdp_devices(n: &mut Node) -> std::collections::BTreeMap<u32, xdpdevs::XdpDevice> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let devs = rt.block_on(xdpdevs::read()).expect("listing the node's interfaces");
    n.dp.set_xdp_devices(&devs.iter().map(|(i, d)| (*i, d.flags())).collect()).unwrap();
    devs
}

#[test]
fn xdp_hands_flows_to_tc_when_the_uplink_cannot_take_its_frames() {
    let Some(mut n) = node("xdp_hands_flows_to_tc_when_the_uplink_cannot_take_its_frames") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    // ext0 is in truth a veth whose peer runs no XDP program and has GRO off: the kernel would
    // drop a frame native XDP sent out of it. The agent records what the kernel says.
    let devs = sync_xdp_devices(&mut n);
    assert!(devs[&n.ifindex].why_not_native().is_some(), "the kernel reports ext0 unable: {:?}", devs[&n.ifindex]);
    let syn = tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN);
    let out = run_xdp(&mut n.dp, &syn, n.ifindex);
    assert_eq!((out.action, &out.frame), (XDP_PASS, &syn), "handed to TC untouched");
    assert!(conntrack(&mut n.dp).is_empty(), "XDP tracked nothing it did not send");
    let out = run_ext(&mut n.dp, &syn, n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT, "TC sends it on as an skb");
    assert_eq!(dissect(&out.frame).dst_sock(), sock(REMOTE));
    // Later packets of the flow are TC's too.
    assert_xdp_passes(&mut n, &tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK), "later packets of a flow TC tracked");
    let c = counters(&mut n.dp);
    assert_eq!((c.get("xdp_forward"), c.get("ext_new_remote")), (None, Some(&1)), "{c:?}");
}

/// The forward conntrack entry of the flow from CLIENT to NODE_PORT.
fn forward_entry(dp: &mut EbpfDataplane) -> (proxy_common::CtKey, proxy_common::CtEntry) {
    let client = sock(CLIENT);
    conntrack(dp)
        .into_iter()
        .find(|(k, _)| k.saddr == client.ip().octets() && k.sport == client.port().to_be_bytes())
        .expect("forward entry")
}

/// Changes the flow's forward entry in the kernel's map, as nothing but time would; and ends
/// the window in which XDP's flow cache repeats the flow's step, as that time would (the
/// window ends with the route's epoch at the latest).
fn edit_forward_entry(dp: &mut EbpfDataplane, edit: impl FnOnce(&mut proxy_common::CtEntry)) {
    let (k, mut e) = forward_entry(dp);
    edit(&mut e);
    let map = dp.ebpf_mut().map_mut(proxy_common::map_names::CT).unwrap();
    let mut ct = aya::maps::HashMap::<_, proxy_common::CtKey, proxy_common::CtEntry>::try_from(map).unwrap();
    ct.insert(k, e, 0).unwrap();
    dp.invalidate_cached_flows();
}

#[test]
fn xdp_keeps_what_a_device_takes_with_a_flows_route_and_learns_a_change_when_the_route_is_looked_up_again() {
    let Some(mut n) = node("xdp_keeps_what_a_device_takes_with_a_flows_route") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let both = xdp_dev::TX | xdp_dev::XMIT;
    let ack = tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK);
    assert_eq!(run_xdp(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex).action, XDP_TX);
    // The first packet after the SYN caches the route, and with it what its device takes.
    assert_eq!(run_xdp(&mut n.dp, &ack, n.ifindex).action, XDP_TX);
    let (_, e) = forward_entry(&mut n.dp);
    assert_eq!((e.route_ifindex, e.route_xdp), (n.ifindex, ROUTE_XDP_KNOWN | both as u8), "cached with the route");
    // While the route is fresh, established packets go by the cached flags, not the device
    // map: with the map saying the device takes nothing, the flow still leaves from XDP. (The
    // route is fresh for about a second: if its epoch turned meanwhile, the packet looked the
    // device up, passed to TC, and the round is tried again.)
    let mut cached_used = false;
    for _ in 0..5 {
        n.dp.set_xdp_devices(&[(n.ifindex, both)].into()).unwrap();
        assert_eq!(run_xdp(&mut n.dp, &ack, n.ifindex).action, XDP_TX);
        let epoch = forward_entry(&mut n.dp).1.route_epoch;
        n.dp.set_xdp_devices(&[].into()).unwrap();
        let out = run_xdp(&mut n.dp, &ack, n.ifindex);
        let action = out.action;
        if action == XDP_TX && forward_entry(&mut n.dp).1.route_epoch == epoch {
            cached_used = true;
            break;
        }
        // The epoch turned: the route was looked up again, and the device with it.
        assert_eq!((action, &out.frame), (XDP_PASS, &ack), "handed to TC untouched");
        // Cache the route again for the next round, with the device taking frames.
        edit_forward_entry(&mut n.dp, |e| e.route_ifindex = 0);
    }
    assert!(cached_used, "established packets went by the flags cached with their route");
    // When the route is looked up again (its epoch over; here: forgotten), the device is too:
    // taking nothing now, the flow is TC's.
    edit_forward_entry(&mut n.dp, |e| e.route_epoch = e.route_epoch.wrapping_add(0x8000));
    assert_xdp_passes(&mut n, &ack, "handed to TC once the device is looked up again");
    assert_eq!(forward_entry(&mut n.dp).1.route_xdp, ROUTE_XDP_KNOWN, "the device's new flags (none) cached with the route");
    assert_eq!(run_ext(&mut n.dp, &ack, n.ifindex).action, TC_ACT_REDIRECT, "TC carries the flow on");
}

#[test]
fn xdp_forwards_remote_flows_and_their_replies_with_valid_checksums() {
    let Some(mut n) = node("xdp_forwards_remote_flows_and_their_replies_with_valid_checksums") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Udp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    for (frame, proto) in
        [(udp_frame(sock(CLIENT), sock(NODE_PORT), b"ping"), "UDP"), (tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), "TCP")]
    {
        let out = run_xdp(&mut n.dp, &frame, n.ifindex);
        assert_eq!(out.action, XDP_TX, "{proto}: out the interface it came in on, from the driver");
        let d = dissect(&out.frame);
        assert_eq!(d.dst_sock(), sock(REMOTE), "{proto}");
        assert_eq!(d.src.to_string(), NODE_IP);
        assert!(d.ip_checksum_ok, "{proto}: IP checksum");
        assert_eq!(d.l4_checksum_ok, Some(true), "{proto}: checksum computed by hand in XDP");
        assert_eq!((d.eth_dst, d.eth_src), (ROUTER_MAC, n.mac));

        let back = SocketAddrV4::new(NODE_IP.parse().unwrap(), d.sport.unwrap());
        let reply = if proto == "UDP" { udp_frame(sock(REMOTE), back, b"pong") } else { tcp_frame(sock(REMOTE), back, SYN | ACK) };
        let out = run_xdp(&mut n.dp, &reply, n.ifindex);
        assert_eq!(out.action, XDP_TX, "{proto}: the reply too");
        let d = dissect(&out.frame);
        assert_eq!((d.src_sock(), d.dst_sock()), (sock(NODE_PORT), sock(CLIENT)), "{proto}");
        assert!(d.ip_checksum_ok && d.l4_checksum_ok == Some(true), "{proto}");
    }
    let c = counters(&mut n.dp);
    assert_eq!((c.get("xdp_forward"), c.get("xdp_reply")), (Some(&2), Some(&2)), "{c:?}");
}

#[test]
fn xdp_repeats_a_tracked_flows_step_from_its_cache_only_while_the_conntrack_path_would_repeat_it_unchanged() {
    let Some(mut n) = node("xdp_repeats_a_tracked_flows_step_from_its_cache") else { return };
    let udp = key(NODE_PORT, Protocol::Udp);
    n.dp.upsert(&udp, &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let ping = udp_frame(sock(CLIENT), sock(NODE_PORT), b"ping");
    // The cache serves: with the flow's conntrack entries gone (as an LRU eviction would take
    // them), a packet in its window is still sent on as before, and nothing is tracked anew.
    within_a_window("a cached forward step", || {
        forget_conntrack(&mut n.dp);
        n.dp.invalidate_cached_flows();
        let first = run_xdp(&mut n.dp, &ping, n.ifindex);
        assert_eq!(first.action, XDP_TX, "a new flow");
        // Tracked now: this packet takes the conntrack path and caches its step.
        let tracked = run_xdp(&mut n.dp, &ping, n.ifindex);
        assert_eq!((tracked.action, &tracked.frame), (XDP_TX, &first.frame));
        forget_conntrack(&mut n.dp);
        let out = run_xdp(&mut n.dp, &ping, n.ifindex);
        if !conntrack(&mut n.dp).is_empty() {
            // The window ended between the two packets: tracked afresh.
            return false;
        }
        assert_eq!((out.action, &out.frame), (XDP_TX, &first.frame), "sent on from the cache, translated as before");
        true
    });
    // Its reply's step too.
    within_a_window("a cached reply step", || {
        forget_conntrack(&mut n.dp);
        n.dp.invalidate_cached_flows();
        assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).action, XDP_TX);
        let snat_port = dissect(&run_xdp(&mut n.dp, &ping, n.ifindex).frame).sport.unwrap();
        let pong = udp_frame(sock(REMOTE), SocketAddrV4::new(NODE_IP.parse().unwrap(), snat_port), b"pong");
        let tracked = run_xdp(&mut n.dp, &pong, n.ifindex);
        assert_eq!(tracked.action, XDP_TX, "the reply, by the conntrack path");
        forget_conntrack(&mut n.dp);
        let out = run_xdp(&mut n.dp, &pong, n.ifindex);
        if out.action != XDP_TX {
            assert_eq!((out.action, &out.frame), (XDP_PASS, &pong), "a reply of no flow, when the window ended");
            return false;
        }
        assert_eq!(out.frame, tracked.frame, "the reply sent on from the cache, translated as before");
        let d = dissect(&out.frame);
        assert_eq!((d.src_sock(), d.dst_sock()), (sock(NODE_PORT), sock(CLIENT)));
        true
    });

    // A backend the agent deleted is not sent to from the cache: its deletion moves the
    // generation on, and the flow's next packet finds it gone (TC tracks the flow afresh).
    forget_conntrack(&mut n.dp);
    n.dp.invalidate_cached_flows();
    assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).action, XDP_TX);
    assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).action, XDP_TX, "cached");
    n.dp.upsert(&udp, &frontend(FrontendKind::NodePort, vec![backend("10.244.2.6:8080", false)])).unwrap();
    assert_xdp_passes(&mut n, &ping, "its backend gone");
    n.dp.upsert(&udp, &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();

    // The window ends where the conntrack path would write the entry: its refresh, due a
    // second after the packet that last refreshed it. An entry refreshed 999 ms ago leaves a
    // window of a millisecond; after it, the next packet refreshes the entry.
    use proxy_agent::dataplane::ebpf::ct_gc;
    within_a_window("a window ended by a refresh", || {
        forget_conntrack(&mut n.dp);
        n.dp.invalidate_cached_flows();
        assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).action, XDP_TX);
        assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).action, XDP_TX, "caches the route in the entry");
        let old = ct_gc::monotonic_coarse_ns() - 999_000_000;
        edit_forward_entry(&mut n.dp, |e| e.last_seen_ns = old);
        let epoch = forward_entry(&mut n.dp).1.route_epoch;
        assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).action, XDP_TX, "not due yet: caches its step");
        if forward_entry(&mut n.dp).1.last_seen_ns != old {
            // The clock ticked past the refresh before that packet.
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert_eq!(run_xdp(&mut n.dp, &ping, n.ifindex).action, XDP_TX);
        let (_, e) = forward_entry(&mut n.dp);
        if e.route_epoch != epoch {
            return false;
        }
        assert!(e.last_seen_ns > old, "refreshed by the conntrack path, not skipped by the cache");
        true
    });
}

#[test]
fn xdp_leaves_tcp_segments_that_change_a_flows_state_to_the_conntrack_path() {
    let Some(mut n) = node("xdp_leaves_tcp_segments_that_change_a_flows_state") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let ack = tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK);
    let snat_port = |out: &testrun::Output| dissect(&out.frame).sport.unwrap();
    within_a_window("a FIN and a RST beside a cached step", || {
        forget_conntrack(&mut n.dp);
        n.dp.invalidate_cached_flows();
        assert_eq!(run_xdp(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex).action, XDP_TX);
        assert_eq!(run_xdp(&mut n.dp, &ack, n.ifindex).action, XDP_TX, "caches its step");
        // The step is cached (sent on with the entry gone; the entry is put back after).
        let ifindex = n.ifindex;
        if !without_conntrack(&mut n.dp, |dp| run_xdp(dp, &ack, ifindex).action == XDP_TX && conntrack(dp).is_empty()) {
            return false;
        }
        // A FIN is recorded on the entry, which a step served from the cache would not do.
        let fin = tcp_frame(sock(CLIENT), sock(NODE_PORT), FIN | ACK);
        assert_eq!(run_xdp(&mut n.dp, &fin, n.ifindex).action, XDP_TX);
        assert!(forward_entry(&mut n.dp).1.flags & flags::FIN_FWD != 0, "the FIN recorded");
        // And a RST.
        let rst = tcp_frame(sock(CLIENT), sock(NODE_PORT), RST);
        assert_eq!(run_xdp(&mut n.dp, &rst, n.ifindex).action, XDP_TX);
        assert!(forward_entry(&mut n.dp).1.flags & flags::RST != 0, "the RST recorded");
        true
    });
    // The client connects again from the same port at once: its SYN is a new flow (TC tracks
    // it afresh), and the new connection's packets take its new SNAT port, not the step XDP
    // cached for the old one (on any CPU: TC's tracking afresh moves the generation on).
    let (mut old, mut new) = (0, 0);
    for _ in 0..5 {
        old = snat_port(&run_xdp(&mut n.dp, &ack, n.ifindex));
        let rst = tcp_frame(sock(CLIENT), sock(NODE_PORT), RST);
        assert_eq!(run_xdp(&mut n.dp, &rst, n.ifindex).action, XDP_TX);
        let syn = tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN);
        assert_xdp_passes(&mut n, &syn, "a SYN on a closed flow's tuple");
        let out = run_ext(&mut n.dp, &syn, n.ifindex);
        assert_eq!(out.action, TC_ACT_REDIRECT, "TC tracks it afresh");
        new = snat_port(&out);
        if new != old {
            break;
        }
    }
    assert_ne!(old, new, "five new connections all drew their old SNAT port");
    let out = run_xdp(&mut n.dp, &ack, n.ifindex);
    assert_eq!((out.action, snat_port(&out)), (XDP_TX, new), "the new connection's port, from its entry");
    assert_eq!(u16::from_be_bytes(forward_entry(&mut n.dp).1.snat_port), new);
}

#[test]
fn a_local_backend_is_only_dnatted_and_keeps_the_client_address() {
    let Some(mut n) = node("a_local_backend_is_only_dnatted_and_keeps_the_client_address") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(LOCAL, true)])).unwrap();
    let syn = tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN);
    assert_xdp_passes(&mut n, &syn, "XDP leaves local delivery to TC and the stack");
    let out = run_ext(&mut n.dp, &syn, n.ifindex);
    assert_eq!(out.action, TC_ACT_OK, "routed by the stack to the pod");
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (sock(CLIENT), sock(LOCAL)));
    assert!(d.l4_checksum_ok == Some(true));
    // The pod's reply leaves through TC egress with the NodePort as its source.
    let reply = tcp_frame(sock(LOCAL), sock(CLIENT), SYN | ACK);
    let d = dissect(&run_egress(&mut n.dp, &reply).frame);
    assert_eq!(d.src_sock(), sock(NODE_PORT));
    assert_eq!(counters(&mut n.dp).get("ext_new_local"), Some(&1));
}

/// An ICMP error from `from` to `to`, quoting `about` (a frame).
fn icmp_error(from: Ipv4Addr, to: Ipv4Addr, code: u8, about: &[u8]) -> Vec<u8> {
    let mut body = vec![3, code, 0, 0, 0, 0, 0x05, 0x00];
    body.extend_from_slice(&about[14..]);
    let c = proxy_tests::packet::internet_checksum(&body);
    body[2..4].copy_from_slice(&c.to_be_bytes());
    Ipv4::new(from, to, ICMP, body).frame()
}

/// What an ICMP error frame quotes, dissected, after its outer header is checked: passed on
/// through the stack, or (`forwarded`) sent on past it to the next hop, one hop less.
fn quote_of(out: &testrun::Output, forwarded: bool) -> (proxy_tests::packet::Dissected, proxy_tests::packet::Dissected) {
    if forwarded {
        assert_eq!(out.action, TC_ACT_REDIRECT, "sent on past the stack");
        assert_eq!((&out.frame[..6], out.frame[14 + 8]), (&ROUTER_MAC[..], 63), "to the next hop, one hop less");
    } else {
        assert_eq!(out.action, TC_ACT_OK, "on through the stack");
    }
    let d = dissect(&out.frame);
    assert!(d.ip_checksum_ok, "outer IP checksum");
    let icmp = d.icmp.clone().expect("still ICMP");
    assert!(icmp.checksum_ok, "ICMP checksum");
    assert_eq!(&out.frame[14 + 20 + 4..14 + 20 + 8], &[0, 0, 5, 0], "the next-hop MTU is kept");
    let mut inner = vec![0u8; 12];
    inner.extend_from_slice(&[0x08, 0x00]);
    inner.extend_from_slice(&icmp.body);
    let q = dissect(&inner);
    assert!(q.ip_checksum_ok, "quoted IP checksum");
    (d, q)
}

/// ICMP errors from outside about north-south flows reach the host that must act on them, as
/// nf_nat sends them. A router's fragmentation needed about a reply to the client, addressed
/// to the NodePort's or load balancer's address, goes to the backend quoting the reply as the
/// backend sent it: to a local one through the stack (its flow is the kernel's too), to a
/// remote one past the stack from the node's SNAT address, as that flow's packets go (the
/// kernel never saw them). Without it the backend's large replies are lost for good. One about
/// a packet the node forwarded to a remote backend, addressed to the node's SNAT address, goes
/// to the client quoting what it sent, past the stack too, from the Service when the backend
/// sent it.
#[test]
fn icmp_errors_about_north_south_flows_reach_the_backend_or_the_client() {
    let Some(mut n) = node("icmp_errors_about_north_south_flows_reach_the_backend_or_the_client") else { return };
    let node_ip: Ipv4Addr = NODE_IP.parse().unwrap();
    let router: Ipv4Addr = ROUTER.parse().unwrap();
    let (client, node_port) = (sock(CLIENT), sock(NODE_PORT));

    // A local backend: the reply left by TC egress as the NodePort.
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(LOCAL, true)])).unwrap();
    run_ext(&mut n.dp, &tcp_frame(client, node_port, SYN), n.ifindex);
    let reply = run_egress(&mut n.dp, &tcp_frame(sock(LOCAL), client, SYN | ACK)).frame;
    assert_eq!(dissect(&reply).src_sock(), node_port);
    let (d, q) = quote_of(&run_ext(&mut n.dp, &icmp_error(router, node_ip, 4, &reply), n.ifindex), false);
    assert_eq!((d.src, d.dst), (router, *sock(LOCAL).ip()), "to the local backend, from the router");
    assert_eq!((q.src_sock(), q.dst_sock()), (sock(LOCAL), client), "quoting the reply as the backend sent it");

    // A remote backend behind a load-balancer IP (not the SNAT address), through SNAT.
    let lb = sock("203.0.113.10:80");
    let client2 = sock("198.51.100.8:40001");
    n.dp.upsert(&key("203.0.113.10:80", Protocol::Tcp), &frontend(FrontendKind::LoadBalancer, vec![backend(REMOTE, false)])).unwrap();
    let out = run_ext(&mut n.dp, &tcp_frame(client2, lb, SYN), n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let forwarded = out.frame;
    let snat = SocketAddrV4::new(node_ip, dissect(&forwarded).sport.unwrap());
    let reply = run_ext(&mut n.dp, &tcp_frame(sock(REMOTE), snat, SYN | ACK), n.ifindex).frame;
    assert_eq!((dissect(&reply).src_sock(), dissect(&reply).dst_sock()), (lb, client2));
    let (d, q) = quote_of(&run_ext(&mut n.dp, &icmp_error(router, *lb.ip(), 4, &reply), n.ifindex), true);
    assert_eq!((d.src, d.dst), (node_ip, *sock(REMOTE).ip()), "to the remote backend, from the node's SNAT address");
    assert_eq!((q.src_sock(), q.dst_sock()), (sock(REMOTE), snat), "quoting the reply as sent to the SNAT address and port");
    // From the backend's side, about the forwarded packet: to the client, naming the Service.
    let (d, q) = quote_of(&run_ext(&mut n.dp, &icmp_error(router, node_ip, 4, &forwarded), n.ifindex), true);
    assert_eq!((d.src, d.dst), (router, *client2.ip()), "to the client, from the router");
    assert_eq!((q.src_sock(), q.dst_sock()), (client2, lb), "quoting what the client sent");
    let (d, _) = quote_of(&run_ext(&mut n.dp, &icmp_error(*sock(REMOTE).ip(), node_ip, 4, &forwarded), n.ifindex), true);
    assert_eq!((d.src, d.dst), (*lb.ip(), *client2.ip()), "sent by the backend itself: from the Service");

    // Not addressed to the sender of what it quotes (a reply's error must go to the Service,
    // the forwarded packet's to the SNAT address): the node's, untouched.
    for (to, about) in [(node_ip, &reply), (*lb.ip(), &forwarded)] {
        let stray = icmp_error(router, to, 4, about);
        let out = run_ext(&mut n.dp, &stray, n.ifindex);
        assert_eq!((out.action, &out.frame), (TC_ACT_OK, &stray), "an error to {to} about a packet it did not send");
    }
    // An error on its last hop is left to the kernel.
    let mut last_hop = icmp_error(router, *lb.ip(), 4, &reply);
    last_hop[14 + 8] = 1;
    let c = proxy_tests::packet::internet_checksum(&{
        let mut h = last_hop[14..34].to_vec();
        h[10..12].copy_from_slice(&[0, 0]);
        h
    });
    last_hop[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
    let out = run_ext(&mut n.dp, &last_hop, n.ifindex);
    assert_eq!((out.action, &out.frame), (TC_ACT_OK, &last_hop), "an error with one hop left");
    // XDP leaves ICMP to TC; an error about no flow of ours is the node's.
    let err = icmp_error(router, *lb.ip(), 4, &reply);
    assert_xdp_passes(&mut n, &err, "XDP leaves ICMP to TC");
    let own = icmp_error(router, node_ip, 4, &tcp_frame(SocketAddrV4::new(node_ip, 22), client, ACK));
    let out = run_ext(&mut n.dp, &own, n.ifindex);
    assert_eq!((out.action, &out.frame), (TC_ACT_OK, &own), "about the node's own SSH connection");
    assert_eq!(counters(&mut n.dp).get("icmp_error_nat"), Some(&4));
}

#[test]
fn without_endpoints_the_client_is_refused_or_with_only_remote_ones_under_local_policy_dropped() {
    let Some(mut n) = node("without_endpoints_the_client_is_refused_or_with_only_remote_ones_under_local_policy_dropped") else {
        return;
    };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![])).unwrap();
    let out = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT);
    let d = dissect(&out.frame);
    assert_eq!((d.proto, d.dst), (ICMP, *sock(CLIENT).ip()));
    assert_eq!(d.icmp.map(|i| (i.kind, i.code)), Some((3, 3)), "port unreachable");

    let mut fe = frontend(FrontendKind::NodePort, vec![]);
    fe.drop_when_empty = true;
    fe.internal_backends = Some(vec![backend(REMOTE, false)]);
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &fe).unwrap();
    let out = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(out.action, TC_ACT_SHOT, "externalTrafficPolicy Local without a local endpoint drops");
    // Pods reaching the same address are not subject to the external policy.
    let pod = sock("10.244.1.9:33333");
    let d = dissect(&run(&mut n.dp, &tcp_frame(pod, sock(NODE_PORT), SYN)).frame);
    assert_eq!(d.dst_sock(), sock(REMOTE), "pods get the cluster-wide endpoints");
}

#[test]
fn traffic_for_a_cluster_ip_or_the_node_itself_passes_the_external_hooks() {
    let Some(mut n) = node("traffic_for_a_cluster_ip_or_the_node_itself_passes_the_external_hooks") else { return };
    n.dp.upsert(&key("10.96.0.10:80", Protocol::Tcp), &frontend(FrontendKind::ClusterIp, vec![backend(REMOTE, false)])).unwrap();
    for to in ["10.96.0.10:80", "192.168.50.1:22"] {
        let f = tcp_frame(sock(CLIENT), sock(to), SYN);
        let out = run_ext(&mut n.dp, &f, n.ifindex);
        assert_eq!((out.action, &out.frame), (TC_ACT_OK, &f), "{to}: untouched");
        assert_xdp_passes(&mut n, &f, to);
    }
    assert!(conntrack(&mut n.dp).is_empty());
}

#[test]
fn maglev_picks_the_same_backend_on_every_node_whatever_the_ids() {
    if !require::root("maglev_picks_the_same_backend_on_every_node_whatever_the_ids") {
        return;
    }
    let backends: Vec<Backend> = (1..=7).map(|i| backend(&format!("10.244.2.{i}:8080"), false)).collect();
    let mut picks: Vec<Vec<SocketAddrV4>> = Vec::new();
    for order in 0..2 {
        let mut n = node("maglev").unwrap();
        // Another node learns the backends in another order, with other ids: a filler
        // frontend takes ids first on the second node.
        if order == 1 {
            let filler: Vec<Backend> = (1..=5).map(|i| backend(&format!("10.244.9.{i}:80"), false)).collect();
            n.dp.upsert(&key("10.96.9.9:80", Protocol::Tcp), &frontend(FrontendKind::ClusterIp, filler)).unwrap();
        }
        let mut list = backends.clone();
        if order == 1 {
            list.reverse();
        }
        n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, list)).unwrap();
        let mut seen = Vec::new();
        for port in 0..200u16 {
            let f = tcp_frame(SocketAddrV4::new("198.51.100.7".parse().unwrap(), 20000 + port), sock(NODE_PORT), SYN);
            seen.push(dissect(&run_xdp(&mut n.dp, &f, n.ifindex).frame).dst_sock());
        }
        picks.push(seen);
    }
    assert_eq!(picks[0], picks[1], "two nodes must send each flow to the same backend");
    let distinct: BTreeSet<_> = picks[0].iter().collect();
    assert_eq!(distinct.len(), 7, "200 flows spread over all 7 backends");
}

#[test]
fn client_ip_affinity_holds_across_connections_for_node_ports_and_cluster_ips() {
    let Some(mut n) = node("client_ip_affinity_holds_across_connections_for_node_ports_and_cluster_ips") else { return };
    let backends: Vec<Backend> = (1..=5).map(|i| backend(&format!("10.244.2.{i}:8080"), false)).collect();
    for (k, kind) in [(NODE_PORT, FrontendKind::NodePort), ("10.96.0.10:80", FrontendKind::ClusterIp)] {
        let mut fe = frontend(kind, backends.clone());
        fe.affinity_timeout = Some(10800);
        n.dp.upsert(&key(k, Protocol::Tcp), &fe).unwrap();
    }
    for (to, external) in [(NODE_PORT, true), ("10.96.0.10:80", false)] {
        let mut seen = BTreeSet::new();
        for port in 0..30u16 {
            let from = SocketAddrV4::new("198.51.100.7".parse().unwrap(), 30000 + port);
            let f = tcp_frame(from, sock(to), SYN);
            let out = if external { run_ext(&mut n.dp, &f, n.ifindex) } else { run(&mut n.dp, &f) };
            seen.insert(dissect(&out.frame).dst_sock());
        }
        assert_eq!(seen.len(), 1, "{to}: one client, one backend: {seen:?}");
    }
    // Another client may land elsewhere, but also sticks.
    let mut seen = BTreeSet::new();
    for port in 0..30u16 {
        let f = tcp_frame(SocketAddrV4::new("10.244.1.77".parse().unwrap(), 30000 + port), sock("10.96.0.10:80"), SYN);
        seen.insert(dissect(&run(&mut n.dp, &f).frame).dst_sock());
    }
    assert_eq!(seen.len(), 1);
    // A backend that leaves the Service is not picked again through affinity.
    let first = dissect(&run(&mut n.dp, &tcp_frame(sock("10.244.1.77:50000"), sock("10.96.0.10:80"), SYN)).frame).dst_sock();
    let rest: Vec<Backend> =
        backends.iter().filter(|b| std::net::SocketAddr::new(b.addr, b.port) != std::net::SocketAddr::V4(first)).copied().collect();
    let mut fe = frontend(FrontendKind::ClusterIp, rest);
    fe.affinity_timeout = Some(10800);
    n.dp.upsert(&key("10.96.0.10:80", Protocol::Tcp), &fe).unwrap();
    let now = dissect(&run(&mut n.dp, &tcp_frame(sock("10.244.1.77:50001"), sock("10.96.0.10:80"), SYN)).frame).dst_sock();
    assert_ne!(now, first, "affinity to a removed backend is ignored");
}

#[test]
fn snat_ports_run_out_cleanly() {
    let Some(mut n) = node("snat_ports_run_out_cleanly") else { return };
    // One SNAT port only: the second client to the same backend cannot get a mapping.
    let cfg = testrun::map_by_name(&mut n.dp, "CONFIG_V3");
    let mut cfg: aya::maps::Array<_, Config> = aya::maps::Array::try_from(aya::maps::Map::Array(cfg)).unwrap();
    cfg.set(0, Config { maglev_size: 16381, snat_port_min: 62000, snat_port_max: 62000, ..Default::default() }, 0).unwrap();
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let a = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(dissect(&a.frame).sport, Some(62000));
    let b = run_ext(&mut n.dp, &tcp_frame(sock("198.51.100.8:40000"), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(b.action, TC_ACT_SHOT);
    assert_eq!(counters(&mut n.dp).get("drop_snat_exhausted"), Some(&1));
    // The first flow is unaffected.
    let d = dissect(&run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK), n.ifindex).frame);
    assert_eq!(d.sport, Some(62000));
    // A flow the client resets gives its port back at once.
    let rst = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), proxy_tests::packet::RST), n.ifindex);
    assert_eq!(rst.action, TC_ACT_REDIRECT, "the reset is forwarded too");
    let b = run_ext(&mut n.dp, &tcp_frame(sock("198.51.100.8:40000"), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!((b.action, dissect(&b.frame).sport), (TC_ACT_REDIRECT, Some(62000)), "a reset flow's port is reused");
    // Once a flow has ended (its entries expired), its port is taken by the next flow, long
    // before the LRU would evict the entry.
    let ct = testrun::map_by_name(&mut n.dp, proxy_common::map_names::CT);
    let mut ct: aya::maps::HashMap<_, proxy_common::CtKey, proxy_common::CtEntry> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(ct)).unwrap();
    let entries: Vec<_> = ct.iter().map(|e| e.unwrap()).collect();
    for (k, mut e) in entries {
        e.last_seen_ns = 1;
        ct.insert(k, e, 0).unwrap();
    }
    let b = run_ext(&mut n.dp, &tcp_frame(sock("198.51.100.9:40000"), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(b.action, TC_ACT_REDIRECT, "an expired mapping's port is reused");
    assert_eq!(dissect(&b.frame).sport, Some(62000));
}

#[test]
fn a_packet_whose_ttl_would_expire_is_left_to_the_kernel() {
    let Some(mut n) = node("a_packet_whose_ttl_would_expire_is_left_to_the_kernel") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let mut ip = Ipv4::new(
        *sock(CLIENT).ip(),
        *sock(NODE_PORT).ip(),
        TCP,
        proxy_tests::packet::tcp_segment(sock(CLIENT), sock(NODE_PORT), SYN, b""),
    );
    ip.ttl = 1;
    let f = ip.frame();
    assert_xdp_passes(&mut n, &f, "one hop left: the kernel answers");
    let out = run_ext(&mut n.dp, &f, n.ifindex);
    assert_eq!((out.action, out.frame), (TC_ACT_OK, f), "the kernel answers with time exceeded");
}

#[test]
fn a_trace_decides_like_a_real_packet_without_writing_anything() {
    let Some(mut n) = node("a_trace_decides_like_a_real_packet_without_writing_anything") else { return };
    let backends: Vec<Backend> = (1..=5).map(|i| backend(&format!("10.244.2.{i}:8080"), false)).collect();
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, backends)).unwrap();
    let syn = tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN);
    let (reason, id) = testrun::run_trace(&mut n.dp, &syn);
    assert_eq!(reason, proxy_common::Reason::ExtNewRemote);
    assert!(conntrack(&mut n.dp).is_empty(), "a trace tracks nothing");
    assert!(counters(&mut n.dp).is_empty(), "a trace counts nothing");
    let real = dissect(&run_ext(&mut n.dp, &syn, n.ifindex).frame).dst_sock();
    let backend_of_id = conntrack(&mut n.dp).iter().find(|(k, _)| k.src() == sock(CLIENT)).map(|(_, e)| e.backend_id);
    assert_eq!(backend_of_id, Some(id), "the real packet went where the trace said ({real})");
}

/// Maglev disruption measured in the datapath: many synthetic flows, one backend removed.
#[test]
fn removing_a_backend_moves_only_about_its_share_of_flows() {
    let Some(mut n) = node("removing_a_backend_moves_only_about_its_share_of_flows") else { return };
    let all: Vec<Backend> = (1..=10).map(|i| backend(&format!("10.244.2.{i}:8080"), false)).collect();
    let picks = |n: &mut Node| -> Vec<u32> {
        (0..5000u32)
            .map(|i| {
                let from = SocketAddrV4::new(Ipv4Addr::from(0xc633_6400 + (i % 250)), 10000 + (i / 250) as u16);
                testrun::run_trace(&mut n.dp, &tcp_frame(from, sock(NODE_PORT), SYN)).1
            })
            .collect()
    };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, all.clone())).unwrap();
    let before = picks(&mut n);
    let removed_id = before[0];
    let rest: Vec<Backend> = all
        .iter()
        .copied()
        .filter(|b| {
            let id = n.dp.maglev().tables.values().next().unwrap();
            let pos = id.members.iter().position(|m| *m == proxy_agent::dataplane::ebpf::maglev::member(b.addr, b.port)).unwrap();
            id.backend_ids[pos] != removed_id
        })
        .collect();
    assert_eq!(rest.len(), 9);
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, rest)).unwrap();
    let after = picks(&mut n);
    let on_removed = before.iter().filter(|b| **b == removed_id).count();
    let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
    let collateral = moved - on_removed;
    eprintln!(
        "maglev disruption: 10 -> 9 backends, {moved} of 5000 flows moved ({:.1}%), {on_removed} had to, {collateral} others ({:.2}%)",
        moved as f64 / 50.0,
        collateral as f64 / 50.0
    );
    assert!(after.iter().all(|a| *a != removed_id));
    assert!(moved as f64 / 5000.0 < 0.1 + 0.03, "at most about 1/N of flows move: {moved}");
}

#[test]
fn load_balancer_source_ranges_admit_only_their_sources_from_outside_and_from_pods() {
    let Some(mut n) = node("load_balancer_source_ranges_admit_only_their_sources_from_outside_and_from_pods") else { return };
    const LB: &str = "203.0.113.1:80";
    let mut fe = frontend(FrontendKind::LoadBalancer, vec![backend(REMOTE, false)]);
    fe.source_ranges = vec!["198.51.100.0/24".parse().unwrap()];
    n.dp.upsert(&key(LB, Protocol::Tcp), &fe).unwrap();
    // The NodePort of the same Service is not subject to the ranges (as with kube-proxy).
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();

    // A source inside a range is load-balanced, by XDP and by TC alike.
    let allowed = tcp_frame(sock(CLIENT), sock(LB), SYN);
    let out = run_xdp(&mut n.dp, &allowed, n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (XDP_TX, sock(REMOTE)), "allowed source, XDP");
    let allowed2 = tcp_frame(sock("198.51.100.8:40000"), sock(LB), SYN);
    let out = run_ext(&mut n.dp, &allowed2, n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_REDIRECT, sock(REMOTE)), "allowed source, TC");

    // Any other source is dropped, already in XDP, and by TC when XDP is not attached.
    let outsider = sock("192.0.2.9:40000");
    let denied = tcp_frame(outsider, sock(LB), SYN);
    assert_eq!(run_xdp(&mut n.dp, &denied, n.ifindex).action, XDP_DROP, "outside the ranges, XDP");
    assert_eq!(run_ext(&mut n.dp, &denied, n.ifindex).action, TC_ACT_SHOT, "outside the ranges, TC");
    assert_eq!(testrun::run_trace(&mut n.dp, &denied).0, proxy_common::Reason::DropSourceRange, "trace says why");
    let udp_denied = udp_frame(outsider, sock(LB), b"q");
    assert_eq!(run_ext(&mut n.dp, &udp_denied, n.ifindex).action, TC_ACT_OK, "another protocol is another frontend");
    // Pods are held to the ranges too: kube-proxy's firewall sits before the Service chains.
    assert_eq!(run(&mut n.dp, &tcp_frame(sock("10.244.1.9:33333"), sock(LB), SYN)).action, TC_ACT_SHOT, "a pod outside the ranges");
    // The same outsider reaches the NodePort.
    let out = run_ext(&mut n.dp, &tcp_frame(outsider, sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_REDIRECT, sock(REMOTE)), "NodePort without ranges");
    assert_eq!(counters(&mut n.dp).get("drop_source_range"), Some(&3));
    assert!(
        conntrack(&mut n.dp).iter().all(|(k, _)| k.src() != outsider || k.dst() == sock(NODE_PORT)),
        "nothing tracked for a dropped flow"
    );

    // Narrowing the ranges keeps established flows (the firewall judges new flows only) and
    // refuses new ones from the sources it no longer holds.
    fe.source_ranges = vec!["198.51.100.7/32".parse().unwrap(), "10.244.1.0/24".parse().unwrap()];
    n.dp.upsert(&key(LB, Protocol::Tcp), &fe).unwrap();
    assert_eq!(n.dp.count_in_kernel().unwrap()["LB4_SRCRANGE_V1"], 2, "the old range is gone from the trie");
    let out = run_ext(&mut n.dp, &tcp_frame(sock("198.51.100.8:40000"), sock(LB), ACK), n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_REDIRECT, sock(REMOTE)), "an established flow carries on");
    assert_eq!(run_ext(&mut n.dp, &tcp_frame(sock("198.51.100.8:40001"), sock(LB), SYN), n.ifindex).action, TC_ACT_SHOT);
    let out = run(&mut n.dp, &tcp_frame(sock("10.244.1.9:33333"), sock(LB), SYN));
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_OK, sock(REMOTE)), "a pod inside the new range");

    // externalTrafficPolicy Local: pods get every endpoint (the internal scope), but the ranges
    // of the external master still judge them first.
    fe.internal_backends = Some(vec![backend(REMOTE, false), backend(LOCAL, true)]);
    fe.backends = vec![backend(LOCAL, true)];
    n.dp.upsert(&key(LB, Protocol::Tcp), &fe).unwrap();
    assert_eq!(run(&mut n.dp, &tcp_frame(sock("10.244.3.9:33333"), sock(LB), SYN)).action, TC_ACT_SHOT, "Local policy: a pod outside");
    let pods: BTreeSet<SocketAddrV4> = (0..40)
        .map(|i| {
            dissect(&run(&mut n.dp, &tcp_frame(SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 9), 34000 + i), sock(LB), SYN)).frame).dst_sock()
        })
        .collect();
    assert_eq!(pods, BTreeSet::from([sock(REMOTE), sock(LOCAL)]), "Local policy: a pod inside gets the cluster's endpoints");
    let out = run_ext(&mut n.dp, &tcp_frame(sock("198.51.100.7:40009"), sock(LB), SYN), n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_OK, sock(LOCAL)), "Local policy: an allowed client, local endpoint");
    assert_eq!(run_ext(&mut n.dp, &tcp_frame(sock("192.0.2.9:40009"), sock(LB), SYN), n.ifindex).action, TC_ACT_SHOT);
    fe.internal_backends = None;
    fe.backends = vec![backend(REMOTE, false)];

    // Without ranges the load balancer is open again, and the trie holds nothing.
    fe.source_ranges.clear();
    n.dp.upsert(&key(LB, Protocol::Tcp), &fe).unwrap();
    let out = run_ext(&mut n.dp, &tcp_frame(sock("192.0.2.9:40001"), sock(LB), SYN), n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_REDIRECT, sock(REMOTE)), "no ranges: open");
    assert_eq!(n.dp.count_in_kernel().unwrap()["LB4_SRCRANGE_V1"], 0);
    fe.source_ranges = vec!["198.51.100.0/24".parse().unwrap()];
    n.dp.upsert(&key(LB, Protocol::Tcp), &fe).unwrap();
    n.dp.remove(&key(LB, Protocol::Tcp)).unwrap();
    assert_eq!(n.dp.count_in_kernel().unwrap()["LB4_SRCRANGE_V1"], 0, "removing the frontend removes its ranges");
}

/// An outside client reaches two NodePorts of one local backend from one source port: at the
/// backend both flows would be one tuple (the client's address is kept), so the second flow's
/// port is moved, as netfilter's NAT does, and each reply goes back as its own NodePort.
#[test]
fn one_client_port_to_two_node_ports_of_one_local_backend_keeps_both_flows() {
    let Some(mut n) = node("one_client_port_to_two_node_ports_of_one_local_backend_keeps_both_flows") else { return };
    let other = "192.168.50.1:30081";
    for np in [NODE_PORT, other] {
        n.dp.upsert(&key(np, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(LOCAL, true)])).unwrap();
    }
    let checked = |out: &testrun::Output| {
        let d = dissect(&out.frame);
        assert!(d.ip_checksum_ok && d.l4_checksum_ok == Some(true), "{d:?}");
        d
    };
    let first = checked(&run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex));
    assert_eq!((first.src_sock(), first.dst_sock()), (sock(CLIENT), sock(LOCAL)));
    let second = checked(&run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(other), SYN), n.ifindex));
    assert_eq!((second.src, second.dst_sock()), (*sock(CLIENT).ip(), sock(LOCAL)));
    let moved = second.sport.unwrap();
    assert_ne!(moved, sock(CLIENT).port(), "the second flow's port is moved");
    let back = SocketAddrV4::new(*sock(CLIENT).ip(), moved);
    let r2 = checked(&run_egress(&mut n.dp, &tcp_frame(sock(LOCAL), back, SYN | ACK)));
    assert_eq!(
        (r2.src_sock(), r2.dst_sock()),
        (sock(other), sock(CLIENT)),
        "the second reply goes back as its NodePort, to the client's port"
    );
    let r1 = checked(&run_egress(&mut n.dp, &tcp_frame(sock(LOCAL), sock(CLIENT), SYN | ACK)));
    assert_eq!((r1.src_sock(), r1.dst_sock()), (sock(NODE_PORT), sock(CLIENT)), "the first flow is intact");
    let again = checked(&run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(other), ACK), n.ifindex));
    assert_eq!(again.sport, Some(moved), "later packets keep the moved port");
    let out = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK), n.ifindex);
    let again = checked(&out);
    assert_eq!((out.action, again.src_sock(), again.dst_sock()), (TC_ACT_OK, sock(CLIENT), sock(LOCAL)), "the first flow, translated");
}

/// A localhost NodePort (127.0.0.1:nodePort, for the node's own processes through the socket
/// hooks) is never served from outside: a frame from the wire addressed to it, as in
/// CVE-2020-8558, is left to the kernel, which drops martians, on both TC and XDP.
#[test]
fn a_localhost_node_port_is_not_served_from_outside() {
    let Some(mut n) = node("a_localhost_node_port_is_not_served_from_outside") else { return };
    n.dp.upsert(&key("127.0.0.1:30080", Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let syn = tcp_frame(sock(CLIENT), sock("127.0.0.1:30080"), SYN);
    let out = run_ext(&mut n.dp, &syn, n.ifindex);
    assert_eq!((out.action, &out.frame), (TC_ACT_OK, &syn), "TC leaves it alone");
    assert_xdp_passes(&mut n, &syn, "XDP leaves it alone");
    // The node's address still serves it.
    let out = run_ext(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(dissect(&out.frame).dst_sock(), sock(REMOTE));
}

/// A host process's flow the socket hooks left to TC (every backend's tuple taken from its
/// port, or no hooks attached): it leaves by the uplink still addressed to the Service, and
/// TC egress gives it a backend and moves its port into the SNAT range, keeping the node's
/// address, with no hop taken (the node sent it). The backend's replies, to the node's address
/// and the moved port, come back translated from the Service to the process's own port and go
/// up the stack: from another node through external ingress, from a pod of this node through
/// pod ingress; so do ICMP errors about what it sent. TCP and UDP.
#[test]
fn a_host_flow_left_to_tc_gets_a_moved_port_and_its_replies_reach_the_process() {
    let Some(mut n) = node("a_host_flow_left_to_tc_gets_a_moved_port_and_its_replies_reach_the_process") else { return };
    let node_ip: Ipv4Addr = NODE_IP.parse().unwrap();
    let router: Ipv4Addr = ROUTER.parse().unwrap();
    let host = SocketAddrV4::new(node_ip, 41053);
    let (vip_udp, vip_tcp, vip_local) = ("10.96.0.10:53", "10.96.0.10:80", "10.96.0.11:53");
    n.dp.upsert(&key(vip_udp, Protocol::Udp), &frontend(FrontendKind::ClusterIp, vec![backend(REMOTE, false)])).unwrap();
    n.dp.upsert(&key(vip_tcp, Protocol::Tcp), &frontend(FrontendKind::ClusterIp, vec![backend(REMOTE, false)])).unwrap();
    n.dp.upsert(&key(vip_local, Protocol::Udp), &frontend(FrontendKind::ClusterIp, vec![backend(LOCAL, true)])).unwrap();
    for (vip, proto) in [(vip_udp, "UDP"), (vip_tcp, "TCP")] {
        let first = if proto == "UDP" { udp_frame(host, sock(vip), b"query") } else { tcp_frame(host, sock(vip), SYN) };
        let out = testrun::run_egress_on(&mut n.dp, &first, n.ifindex);
        assert_eq!(out.action, TC_ACT_REDIRECT, "{proto}: sent by the route to the backend");
        let d = dissect(&out.frame);
        assert_eq!(d.dst_sock(), sock(REMOTE), "{proto}");
        assert_eq!(d.src, node_ip, "{proto}: the node's own address is kept");
        let moved = d.sport.unwrap();
        assert!((61000..=65535).contains(&moved), "{proto}: port {moved} moved into the SNAT range");
        assert!(d.ip_checksum_ok && d.l4_checksum_ok == Some(true), "{proto}: {d:?}");
        assert_eq!((d.eth_dst, d.eth_src), (ROUTER_MAC, n.mac), "{proto}: addressed to the next hop");
        assert_eq!(out.frame[14 + 8], 64, "{proto}: no hop taken from a packet the node sent");

        // Errors about what left (a router's fragmentation needed, the backend's port
        // unreachable) reach the process's socket, quoting what it sent.
        let forwarded = out.frame;
        let (d, q) = quote_of(&run_ext(&mut n.dp, &icmp_error(router, node_ip, 4, &forwarded), n.ifindex), false);
        assert_eq!((d.src, d.dst), (router, node_ip), "{proto}: up the stack, from the router");
        assert_eq!((q.src_sock(), q.dst_sock()), (host, sock(vip)), "{proto}: quoting what the process sent");
        let (d, _) = quote_of(&run_ext(&mut n.dp, &icmp_error(*sock(REMOTE).ip(), node_ip, 3, &forwarded), n.ifindex), false);
        assert_eq!(d.src, *sock(vip).ip(), "{proto}: sent by the backend itself: from the Service");

        let back = SocketAddrV4::new(node_ip, moved);
        let reply = if proto == "UDP" { udp_frame(sock(REMOTE), back, b"answer") } else { tcp_frame(sock(REMOTE), back, SYN | ACK) };
        let out = run_ext(&mut n.dp, &reply, n.ifindex);
        assert_eq!(out.action, TC_ACT_OK, "{proto}: up the stack to the process");
        let d = dissect(&out.frame);
        assert_eq!((d.src_sock(), d.dst_sock()), (sock(vip), host), "{proto}: from the Service to the process's own port");
        assert!(d.ip_checksum_ok && d.l4_checksum_ok == Some(true), "{proto}: {d:?}");
        assert_xdp_passes(&mut n, &reply, &format!("{proto}: XDP leaves the reply to TC"));

        // The flow's next packet keeps its backend and port.
        let next = if proto == "UDP" { udp_frame(host, sock(vip), b"again") } else { tcp_frame(host, sock(vip), ACK) };
        let d = dissect(&testrun::run_egress_on(&mut n.dp, &next, n.ifindex).frame);
        assert_eq!((d.src_sock(), d.dst_sock()), (back, sock(REMOTE)), "{proto}");
    }

    // A backend on this node: the reply comes from its pod.
    let out = testrun::run_egress_on(&mut n.dp, &udp_frame(host, sock(vip_local), b"query"), n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT, "sent by the route to the pod");
    let d = dissect(&out.frame);
    assert_eq!(d.dst_sock(), sock(LOCAL));
    let back = SocketAddrV4::new(node_ip, d.sport.unwrap());
    let out = run(&mut n.dp, &udp_frame(sock(LOCAL), back, b"answer"));
    assert_eq!(out.action, TC_ACT_OK);
    let d = dissect(&out.frame);
    assert_eq!((d.src_sock(), d.dst_sock()), (sock(vip_local), host), "the pod's reply, from the Service to the process's port");
    assert!(d.ip_checksum_ok && d.l4_checksum_ok == Some(true), "{d:?}");
    // The pod's port unreachable about the datagram: to the process, from the Service.
    let pod_error = icmp_error(*sock(LOCAL).ip(), node_ip, 3, &udp_frame(back, sock(LOCAL), b"query"));
    let (d, q) = quote_of(&run(&mut n.dp, &pod_error), false);
    assert_eq!((d.src, d.dst), (*sock(vip_local).ip(), node_ip));
    assert_eq!((q.src_sock(), q.dst_sock()), (host, sock(vip_local)));

    // A pod's reply to the node under no such entry is left alone.
    let stray = udp_frame(sock(LOCAL), SocketAddrV4::new(node_ip, 61999), b"stray");
    let out = run(&mut n.dp, &stray);
    assert_eq!((out.action, &out.frame), (TC_ACT_OK, &stray));

    // The node's own traffic to no Service leaves untouched.
    let plain = udp_frame(host, sock("198.51.100.9:53"), b"query");
    let out = testrun::run_egress_on(&mut n.dp, &plain, n.ifindex);
    assert_eq!((out.action, &out.frame), (TC_ACT_OK, &plain), "not a Service's: untouched");

    let c = counters(&mut n.dp);
    assert_eq!((c.get("host_flow_new"), c.get("host_flow"), c.get("host_reply")), (Some(&3), Some(&2), Some(&3)), "{c:?}");
}

/// A host flow left to TC from a privileged port keeps a privileged port, as nf_nat keeps it (a
/// server may insist: NFS's `secure` exports), never the process's own. One whose backend is an
/// address of the node itself (a host-network endpoint here) has no route past the stack: the
/// process is refused at once (port unreachable, received as if from the Service).
#[test]
fn a_host_flow_left_to_tc_keeps_a_privileged_port_and_is_refused_when_its_backend_is_the_node() {
    let Some(mut n) = node("a_host_flow_left_to_tc_keeps_a_privileged_port_and_is_refused_when_its_backend_is_the_node") else { return };
    let node_ip: Ipv4Addr = NODE_IP.parse().unwrap();
    n.dp.upsert(&key("10.96.0.20:2049", Protocol::Tcp), &frontend(FrontendKind::ClusterIp, vec![backend(REMOTE, false)])).unwrap();
    let mut seen = BTreeSet::new();
    for port in [700u16, 600, 1023, 1022, 650] {
        let host = SocketAddrV4::new(node_ip, port);
        let out = testrun::run_egress_on(&mut n.dp, &tcp_frame(host, sock("10.96.0.20:2049"), SYN), n.ifindex);
        assert_eq!(out.action, TC_ACT_REDIRECT);
        let moved = dissect(&out.frame).sport.unwrap();
        assert!((600..1024).contains(&moved) && moved != port, "from {port}: moved to {moved}, a privileged port of nf_nat's range");
        seen.insert(moved);
    }
    assert_eq!(seen.len(), 5, "each flow its own port: {seen:?}");

    let own = SocketAddrV4::new(node_ip, 6443);
    n.dp.upsert(&key("10.96.0.1:443", Protocol::Tcp), &frontend(FrontendKind::ClusterIp, vec![backend(&own.to_string(), true)])).unwrap();
    let syn = tcp_frame(SocketAddrV4::new(node_ip, 41000), sock("10.96.0.1:443"), SYN);
    let out = testrun::run_egress_on(&mut n.dp, &syn, n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT, "the answer is turned back into the node");
    let d = dissect(&out.frame);
    assert_eq!((d.proto, d.src, d.dst), (ICMP, *sock("10.96.0.1:443").ip(), node_ip), "port unreachable from the Service");
    assert_eq!(counters(&mut n.dp).get("reject_host_no_route"), Some(&1));
}

/// The conntrack filter stands before the conntrack lookup at the external hooks too: with its
/// bits cleared, the reply of a NodePort flow SNATed to a remote backend is taken for a packet
/// of no flow, in XDP and in TC, and passes untranslated; once rebuilt from the conntrack map,
/// it reaches the client again. (The reply tuple's bit was set before its SNAT port was chosen:
/// the destination port is not hashed.)
#[test]
fn the_conntrack_filter_is_heeded_at_the_external_hooks() {
    use proxy_agent::dataplane::ebpf::ct_filter;
    use std::os::fd::AsFd;
    let Some(mut n) = node("the_conntrack_filter_is_heeded_at_the_external_hooks") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let out = run_xdp(&mut n.dp, &tcp_frame(sock(CLIENT), sock(NODE_PORT), SYN), n.ifindex);
    assert_eq!(out.action, XDP_TX);
    let back = SocketAddrV4::new(NODE_IP.parse().unwrap(), dissect(&out.frame).sport.unwrap());
    let reply = tcp_frame(sock(REMOTE), back, SYN | ACK);
    let translated = |out: &testrun::Output| dissect(&out.frame).dst_sock() == sock(CLIENT);
    assert!(translated(&run_xdp(&mut n.dp, &reply, n.ifindex)), "a tracked reply is translated in XDP");
    ct_filter::clear(testrun::map_fd(&mut n.dp, proxy_common::map_names::CT_FILTER).as_fd()).unwrap();
    assert_xdp_passes(&mut n, &reply, "with the filter cleared, XDP takes the reply for a packet of no flow");
    let out = run_ext(&mut n.dp, &reply, n.ifindex);
    assert_eq!((out.action, out.frame == reply), (TC_ACT_OK, true), "and so does TC");
    n.dp.rebuild_conntrack_filters().unwrap();
    assert!(translated(&run_xdp(&mut n.dp, &reply, n.ifindex)), "translated again once rebuilt");
}

/// An expired NodePort flow SNATed to a remote backend goes with its reply entry, the one that
/// holds its SNAT port (`ct_gc`), and its reply, met later, is no longer translated; a SNAT
/// reply entry whose flow's forward entry is gone (evicted) goes on its own; a live flow's
/// stays, however old (found through the Service's reverse NAT entry, as the datapath finds
/// it).
#[test]
fn an_expired_snat_flow_is_removed_with_the_reply_entry_holding_its_port() {
    use proxy_agent::dataplane::ebpf::ct_gc::{self, Collected};
    let Some(mut n) = node("an_expired_snat_flow_is_removed_with_the_reply_entry_holding_its_port") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Udp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let mut replies = Vec::new();
    for port in [40000, 40001, 40002] {
        let from = SocketAddrV4::new(*sock(CLIENT).ip(), port);
        let out = run_ext(&mut n.dp, &udp_frame(from, sock(NODE_PORT), b"q"), n.ifindex);
        let back = SocketAddrV4::new(NODE_IP.parse().unwrap(), dissect(&out.frame).sport.unwrap());
        let reply = udp_frame(sock(REMOTE), back, b"a");
        assert_eq!(dissect(&run_ext(&mut n.dp, &reply, n.ifindex).frame).dst_sock(), from, "translated while tracked");
        replies.push(reply);
    }
    let ct = testrun::conntrack(&mut n.dp);
    assert_eq!(ct.len(), 6);
    let forward =
        |port: u16| ct.iter().find(|(k, e)| e.flags & proxy_common::ct::flags::REPLY == 0 && k.sport == port.to_be_bytes()).unwrap();
    let now = ct_gc::monotonic_coarse_ns();
    let sec = 1_000_000_000;
    let map = n.dp.ebpf_mut().map_mut(proxy_common::map_names::CT).unwrap();
    let mut map = aya::maps::HashMap::<_, proxy_common::CtKey, proxy_common::CtEntry>::try_from(map).unwrap();
    // The second flow's forward entry evicted; the third's seen later than the others.
    map.remove(&forward(40001).0).unwrap();
    let (k3, mut f3) = *forward(40002);
    f3.last_seen_ns = now + 10 * sec;
    map.insert(k3, f3, 0).unwrap();
    let answered = proxy_common::ct::Lifetimes::DEFAULT.udp_stream_ns;
    assert_eq!(n.dp.collect_expired_flows(now).unwrap()[0], Collected::default());
    let [v4, _] = n.dp.collect_expired_flows(now + answered + sec + ct_gc::MARGIN_NS).unwrap();
    assert_eq!(v4, Collected { flows: 1, replies: 1, orphans: 1 });
    let left: Vec<_> = testrun::conntrack(&mut n.dp).into_iter().map(|(k, _)| k).collect();
    assert_eq!(left.len(), 2, "the flow seen later and its reply entry, holding its SNAT port, stay: {left:?}");
    assert!(left.contains(&proxy_common::ct::reply_key_of(&k3, &f3, proxy_common::ct::HAIRPIN_ADDR)));
    let out = run_ext(&mut n.dp, &replies[0], n.ifindex);
    assert_eq!((out.action, out.frame == replies[0]), (TC_ACT_OK, true), "the reply of a flow removed passes untranslated");
    let from = SocketAddrV4::new(*sock(CLIENT).ip(), 40002);
    assert_eq!(dissect(&run_ext(&mut n.dp, &replies[2], n.ifindex).frame).dst_sock(), from, "the live flow's is translated");
}

/// A host flow's entries (a node process's connection to a Service with a remote backend, its
/// port moved into the SNAT range: `create_snat` for the host) are claimed and removed as a
/// north-south flow's are (`ct_gc`): its old reply entry stays while the flow is seen, and
/// both go once it has expired.
#[test]
fn a_host_flows_entries_are_removed_once_it_has_expired() {
    use proxy_agent::dataplane::ebpf::ct_gc::{self, Collected};
    use proxy_common::{ct::flags, CtEntry, CtKey};
    let Some(mut n) = node("a_host_flows_entries_are_removed_once_it_has_expired") else { return };
    let host = SocketAddrV4::new(NODE_IP.parse().unwrap(), 41053);
    n.dp.upsert(&key("10.96.0.10:53", Protocol::Udp), &frontend(FrontendKind::ClusterIp, vec![backend(REMOTE, false)])).unwrap();
    let out = testrun::run_egress_on(&mut n.dp, &udp_frame(host, sock("10.96.0.10:53"), b"query"), n.ifindex);
    assert_eq!(out.action, TC_ACT_REDIRECT, "sent by the route to the backend");
    let ct = testrun::conntrack(&mut n.dp);
    assert_eq!(ct.len(), 2);
    let (k, mut f) = *ct.iter().find(|(_, e)| e.flags & flags::REPLY == 0).unwrap();
    assert!(f.flags & flags::SNAT != 0, "{f:?}");
    let now = ct_gc::monotonic_coarse_ns();
    let sec = 1_000_000_000;
    f.last_seen_ns = now + 10 * sec;
    let map = n.dp.ebpf_mut().map_mut(proxy_common::map_names::CT).unwrap();
    aya::maps::HashMap::<_, CtKey, CtEntry>::try_from(map).unwrap().insert(k, f, 0).unwrap();
    let unanswered = proxy_common::ct::Lifetimes::DEFAULT.udp_ns;
    assert_eq!(n.dp.collect_expired_flows(now + unanswered + sec + ct_gc::MARGIN_NS).unwrap()[0], Collected::default());
    assert_eq!(testrun::conntrack(&mut n.dp).len(), 2, "the reply entry of a flow seen since stays, however old");
    let [v4, _] = n.dp.collect_expired_flows(now + 10 * sec + unanswered + sec + ct_gc::MARGIN_NS).unwrap();
    assert_eq!(v4, Collected { flows: 1, replies: 1, orphans: 0 });
    assert!(testrun::conntrack(&mut n.dp).is_empty());
}

/// The external hooks hold back a TCP segment under way that no entry tracks while a takeover
/// may still adopt its connection (`ct::ADOPTING_V4`), as pod ingress does (TC drops it; XDP,
/// which drops only what is outside a load balancer's source ranges, leaves it to TC); a SYN
/// is balanced; once the adoption ends, the segment is a new flow again.
#[test]
fn the_external_hooks_hold_back_a_segment_under_way_while_a_takeover_may_adopt_it() {
    let Some(mut n) = node("the_external_hooks_hold_back_a_segment_under_way_while_a_takeover_may_adopt_it") else { return };
    n.dp.upsert(&key(NODE_PORT, Protocol::Tcp), &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    let now = proxy_agent::dataplane::ebpf::ct_gc::monotonic_coarse_ns();
    testrun::hold_adoption(&mut n.dp, proxy_common::ct::ADOPTING_V4, now + 5_000_000_000);
    let ack = tcp_frame(sock(CLIENT), sock(NODE_PORT), ACK);
    assert_xdp_passes(&mut n, &ack, "XDP leaves what it would drop to TC");
    assert_eq!(run_ext(&mut n.dp, &ack, n.ifindex).action, TC_ACT_SHOT, "TC holds it back");
    assert_eq!(counters(&mut n.dp).get("drop_adopt_pending"), Some(&1));
    let syn = tcp_frame(sock("198.51.100.8:40000"), sock(NODE_PORT), SYN);
    let out = run_ext(&mut n.dp, &syn, n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_REDIRECT, sock(REMOTE)), "a SYN is a new flow");
    testrun::hold_adoption(&mut n.dp, proxy_common::ct::ADOPTING_V4, 0);
    let out = run_ext(&mut n.dp, &ack, n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_REDIRECT, sock(REMOTE)), "the adoption over: a new flow");
}

/// A NodePort's UDP flow that kube-proxy masqueraded before the takeover, left to netfilter
/// (`ct::owner::NETFILTER`): XDP and TC pass its datagrams and its backend's replies untouched
/// while that backend is served; once it is removed, the next datagram is the agent's new flow
/// (as kube-proxy deletes a removed endpoint's UDP conntrack entries).
#[test]
fn a_udp_flow_left_to_netfilter_passes_the_external_hooks_until_its_endpoint_goes() {
    let Some(mut n) = node("a_udp_flow_left_to_netfilter_passes_the_external_hooks_until_its_endpoint_goes") else { return };
    const OTHER: &str = "10.244.2.6:8080";
    let np = key(NODE_PORT, Protocol::Udp);
    n.dp.upsert(&np, &frontend(FrontendKind::NodePort, vec![backend(REMOTE, false)])).unwrap();
    // The backend's id, from a flow of ours.
    run_ext(&mut n.dp, &udp_frame(sock(CLIENT), sock(NODE_PORT), b"q"), n.ifindex);
    let id = forward_entry(&mut n.dp).1.backend_id;
    let (client, masq) = (sock("198.51.100.8:40000"), SocketAddrV4::new(NODE_IP.parse().unwrap(), 50123));
    let now = proxy_agent::dataplane::ebpf::ct_gc::monotonic_coarse_ns();
    testrun::left_to_netfilter(&mut n.dp, UDP, [(client, sock(NODE_PORT)), (sock(REMOTE), masq)], sock(REMOTE), id, now);
    let (query, answer) = (udp_frame(client, sock(NODE_PORT), b"q"), udp_frame(sock(REMOTE), masq, b"a"));
    for frame in [&query, &answer] {
        assert_xdp_passes(&mut n, frame, "a flow left to netfilter");
        let out = run_ext(&mut n.dp, frame, n.ifindex);
        assert_eq!((out.action, out.frame.as_slice()), (TC_ACT_OK, frame.as_slice()), "TC leaves it to the stack, untouched");
    }
    assert_eq!(counters(&mut n.dp).get("pass_netfilter"), Some(&2));
    n.dp.upsert(&np, &frontend(FrontendKind::NodePort, vec![backend(OTHER, false)])).unwrap();
    let out = run_ext(&mut n.dp, &query, n.ifindex);
    assert_eq!((out.action, dissect(&out.frame).dst_sock()), (TC_ACT_REDIRECT, sock(OTHER)), "its endpoint removed: a flow of ours");
}
