//! Mutated frames through every program (TC ingress and egress of pod interfaces, TC external
//! ingress, XDP) with BPF_PROG_TEST_RUN: no fault, verdicts each hook allows, valid checksums on
//! every rewritten frame, every packet counted once, and the dataplane still serving after.
//! A fixed seed here (`PROXY_FUZZ_SEED`, `PROXY_FUZZ_FRAMES` change it); `cargo xtask fuzz`
//! runs longer with a new seed.

use std::net::{Ipv4Addr, SocketAddrV4};

use aya::programs::{TestRun, TestRunOptions};
use proxy_agent::{
    dataplane::{ebpf::EbpfDataplane, Dataplane},
    model::{Backend, Frontend, FrontendKey, FrontendKind, ObjectKey, Protocol, ServicePortName},
};
use proxy_common::xdp_dev;
use proxy_tests::{
    fuzz::{self, Addresses, Rng, Tally},
    netns::{enter, ifindex, uplink_node},
    packet::{dissect, tcp_frame, SYN, TCP, UDP},
    require,
    testrun::{self, counters, run, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX},
};

const NODE_IP: &str = "192.168.50.1";

fn sock(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

fn upsert(dp: &mut EbpfDataplane, kind: FrontendKind, at: &str, protocol: Protocol, backends: &[(&str, bool)]) {
    let at = sock(at);
    let name = ServicePortName { service: ObjectKey::new("default", format!("fuzz-{}", at.port())), port: "p".into(), protocol };
    let backends = backends
        .iter()
        .map(|(b, local)| Backend { addr: (*sock(b).ip()).into(), port: sock(b).port(), terminating: false, local: *local })
        .collect();
    dp.upsert(&FrontendKey { addr: (*at.ip()).into(), port: at.port(), protocol }, &Frontend::new(name, kind, backends))
        .expect("program a frontend");
}

/// Runs `frame` through a program with BPF_PROG_TEST_RUN: Some((verdict, output)), or None
/// when the kernel refuses the frame itself (shorter than the headers it insists on).
fn try_run<P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = aya::programs::TestRunResult>>(
    prog: &P,
    frame: &[u8],
    ctx: Option<&[u8]>,
) -> Option<(i32, Vec<u8>)> {
    let mut out = vec![0u8; frame.len() + 512];
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), ctx_in: ctx, repeat: 1, ..Default::default() };
    match prog.test_run(opts) {
        Ok(res) => {
            out.truncate(res.data_size_out as usize);
            Some((res.return_value as i32, out))
        }
        Err(e) => {
            // The kernel refuses runts before any program sees them; anything else is a fault.
            assert!(frame.len() < 14 + 60, "BPF_PROG_TEST_RUN failed on a {}-byte frame: {e:?}", frame.len());
            None
        }
    }
}

#[test]
fn mutated_frames_through_every_program_fault_nothing_and_break_no_checksum() {
    if !require::root("mutated_frames_through_every_program_fault_nothing_and_break_no_checksum") {
        return;
    }
    let seed: u64 = std::env::var("PROXY_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_f00d);
    let frames: usize = std::env::var("PROXY_FUZZ_FRAMES").ok().and_then(|s| s.parse().ok()).unwrap_or(100_000);

    // A node namespace of the test's own with an uplink and routes, for the FIB lookups of the
    // external programs; the calling thread enters it.
    let ns = uplink_node("pxf");
    ns.ip(&["route", "add", "default", "via", "192.168.50.2"]);
    enter(&ns.file()).expect("enter the node namespace");
    let ifindex = ifindex("ext0");

    let mut dp = testrun::dataplane();
    dp.set_interface_address(ifindex, Some(NODE_IP.parse().unwrap())).unwrap();
    dp.set_xdp_devices(&[(ifindex, xdp_dev::TX | xdp_dev::XMIT)].into()).unwrap();
    upsert(&mut dp, FrontendKind::ClusterIp, "10.96.0.10:80", Protocol::Tcp, &[("10.244.1.2:8080", false), ("10.244.1.3:8080", false)]);
    upsert(&mut dp, FrontendKind::ClusterIp, "10.96.0.53:53", Protocol::Udp, &[("10.244.1.9:5353", false)]);
    upsert(&mut dp, FrontendKind::ClusterIp, "10.96.0.99:80", Protocol::Tcp, &[]);
    upsert(&mut dp, FrontendKind::NodePort, "192.168.50.1:30080", Protocol::Tcp, &[("10.244.2.5:8080", false), ("10.244.1.5:8080", true)]);
    upsert(&mut dp, FrontendKind::NodePort, "192.168.50.1:30053", Protocol::Udp, &[("10.244.2.5:5353", false)]);
    upsert(&mut dp, FrontendKind::LoadBalancer, "203.0.113.7:80", Protocol::Tcp, &[("10.244.2.5:8080", false), ("10.244.1.2:8080", false)]);
    // A ServiceCIDR: unserved ports of the cluster IPs are rejected, free addresses dropped.
    let allocated = ["10.96.0.10", "10.96.0.53", "10.96.0.99"].iter().map(|a| a.parse().unwrap()).collect();
    dp.set_cluster_ip_ranges(&["10.96.0.0/16".parse().unwrap()], &allocated).expect("write the Service CIDR");
    let addrs = Addresses {
        clients: vec![Ipv4Addr::new(10, 244, 0, 5), Ipv4Addr::new(198, 51, 100, 7), NODE_IP.parse().unwrap()],
        services: ["10.96.0.10", "10.96.0.53", "10.96.0.99", NODE_IP, "203.0.113.7", "10.96.0.77"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect(),
        backends: ["10.244.1.2", "10.244.1.3", "10.244.1.9", "10.244.2.5", "10.244.1.5"].iter().map(|a| a.parse().unwrap()).collect(),
        ports: vec![80, 53, 8080, 5353, 30080, 30053, 40000, 40001, 61000, 65535],
        frontends: [
            ("10.96.0.10:80", TCP),
            ("10.96.0.53:53", UDP),
            ("10.96.0.99:80", TCP),
            ("192.168.50.1:30080", TCP),
            ("192.168.50.1:30053", UDP),
            ("203.0.113.7:80", TCP),
        ]
        .iter()
        .map(|(s, p)| (sock(s), *p))
        .collect(),
        endpoints: [
            ("10.244.1.2:8080", TCP),
            ("10.244.1.3:8080", TCP),
            ("10.244.1.9:5353", UDP),
            ("10.244.2.5:8080", TCP),
            ("10.244.2.5:5353", UDP),
            ("10.244.1.5:8080", TCP),
        ]
        .iter()
        .map(|(s, p)| (sock(s), *p))
        .collect(),
    };

    // `struct __sk_buff` up to ifindex, and `struct xdp_md`, naming the uplink.
    let mut skb = [0u8; 44];
    skb[36..40].copy_from_slice(&ifindex.to_ne_bytes());
    skb[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    let mut xdp_md = [0u8; 24];
    xdp_md[12..16].copy_from_slice(&ifindex.to_ne_bytes());

    let tc_verdicts = [TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT];
    let xdp_verdicts = [XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT];
    let mut rng = Rng::new(seed);
    let mut tally = Tally::default();
    let mut ran = 0u64;
    for i in 0..frames {
        let (frame, label) = fuzz::frame(&mut rng, &addrs);
        xdp_md[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
        for hook in 0..4 {
            let (name, allowed, result): (&'static str, &[i32], _) = match hook {
                0 => ("tc ingress", &tc_verdicts, try_run(dp.ingress_program(), &frame, None)),
                1 => ("tc egress", &tc_verdicts, try_run(dp.egress_program(), &frame, None)),
                2 => ("tc external", &tc_verdicts, try_run(dp.ext_ingress_program(), &frame, Some(&skb))),
                _ => ("xdp", &xdp_verdicts, try_run(dp.xdp_program(), &frame, Some(&xdp_md))),
            };
            let Some((verdict, out)) = result else {
                tally.refused += 1;
                continue;
            };
            ran += 1;
            if let Err(e) = fuzz::judge(&frame, verdict, allowed, &out) {
                panic!("seed {seed}, frame {i} ({label}) through {name}: {e}\n in:  {frame:02x?}\n out: {out:02x?}");
            }
            // What XDP passes on, TC and the stack see as it arrived.
            assert!(
                hook != 3 || verdict != XDP_PASS || out == frame,
                "seed {seed}, frame {i} ({label}): XDP passed a frame it changed\n in:  {frame:02x?}\n out: {out:02x?}"
            );
            *tally.by_verdict.entry((name, verdict)).or_default() += 1;
            if out != frame {
                *tally.rewritten.entry(name).or_default() += 1;
            }
        }
    }
    println!("fuzz: seed {seed}, {frames} frames, {ran} program runs\n{}", tally.report());

    // Every run is counted under exactly one reason.
    let counted: u64 = counters(&mut dp).values().sum();
    assert_eq!(counted, ran, "every packet is counted once: {:?}", counters(&mut dp));
    assert!(
        tally.rewritten.get("tc ingress").copied().unwrap_or(0) > frames as u64 / 100,
        "the frames reached services: {}",
        tally.report()
    );
    // And the dataplane still serves a plain new flow.
    let out = run(&mut dp, &tcp_frame(sock("10.244.0.77:12345"), sock("10.96.0.10:80"), SYN));
    let d = dissect(&out.frame);
    assert!(
        ["10.244.1.2:8080", "10.244.1.3:8080"].contains(&d.dst_sock().to_string().as_str())
            && d.ip_checksum_ok
            && d.l4_checksum_ok == Some(true),
        "{d:?}"
    );
}
