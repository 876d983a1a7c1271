//! `cargo xtask bench [datapath]`: per-packet cost of the TC programs through
//! BPF_PROG_TEST_RUN, at 1, 10,000 and 100,000 Services with 4 backends each, next to an empty
//! program of the same type (the floor). Prints a table and writes JSON to $BENCH_OUT_DIR.
//!
//! Two methods, because the kernel repeats a test run on the same skb and the programs rewrite
//! it:
//! - "repeat": BPF_PROG_TEST_RUN with repeat = 1,000,000 on one frame, which each run finds as
//!   the run before left it. So the established flow and its reply are arranged as two
//!   services, each the other's backend ("ping" 10.100.0.2:80 -> 10.100.0.3:8080 and "pong"
//!   the other way), with a tracked flow to each: every run is a packet of a tracked flow (or
//!   a reply) whose address and port really change. Each figure is the median of ROUNDS such
//!   calls, so that one disturbed call (this is a shared 2-CPU machine) does not make it; the
//!   cases (the floor among them) take turns, round after round, so that a change in the
//!   machine's pace weighs on all alike.
//! - "calls": 1,000,000 BPF_PROG_TEST_RUN calls with repeat = 1, a fresh frame each, for new
//!   flows (each a distinct 5-tuple) and, as a cross-check, the established flow.
//!   The kernel's per-call duration includes one clock read, which the floor measured the same
//!   way includes too.
//!
//! The maps hold what a node's do: beside the Services, a Service CIDR per family with the
//! cluster IPs allocated in it, which traffic for no Service is checked against.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    time::Instant,
};

use aya::{
    maps::PerCpuArray,
    programs::{SchedClassifier, TestRun, TestRunOptions},
};
use proxy_agent::{
    dataplane::{
        ebpf::{
            loader::{self, LoadOptions},
            EbpfDataplane,
        },
        Dataplane,
    },
    model::{Backend, Frontend, FrontendKey, FrontendKind, ObjectKey, Protocol, ServicePortName},
};
use proxy_common::{limits, map_names, prog_names, Counter, Reason};
use proxy_tests::{
    packet::{tcp_frame, ACK, SYN},
    packet6,
};

const REPEAT: u32 = 1_000_000;
/// Calls of REPEAT runs each per "repeat" figure, which is their median.
const ROUNDS: usize = 11;
/// Rounds of new flows, an IPv4 and an IPv6 share of CALLS each.
const NEW_ROUNDS: u32 = 5;
const CALLS: u32 = 1_000_000;
const SIZES: [u32; 3] = [1, 10_000, 100_000];

/// `--quick` (for development only): fewer repetitions; the reported figures come from a full run.
fn scale() -> u32 {
    if std::env::args().any(|a| a == "--quick") {
        10
    } else {
        1
    }
}

fn frontend(name: &str, backends: Vec<(Ipv4Addr, u16)>) -> Frontend {
    Frontend {
        name: ServicePortName { service: ObjectKey::new("bench", name), port: "http".into(), protocol: Protocol::Tcp },
        backends: backends.into_iter().map(|(addr, port)| Backend { addr: addr.into(), port, terminating: false, local: false }).collect(),
        retained: vec![],
        affinity_timeout: None,
        drop_when_empty: false,
        kind: FrontendKind::ClusterIp,
        internal_backends: None,
        source_ranges: vec![],
    }
}

fn key(addr: Ipv4Addr, port: u16) -> FrontendKey {
    FrontendKey { addr: addr.into(), port, protocol: Protocol::Tcp }
}

/// Services 0..n: 10.96.x.y:80 -> 4 backends 10.(128+...).
fn program_services(dp: &mut EbpfDataplane, n: u32) {
    for i in 0..n {
        let vip = Ipv4Addr::from(0x0a60_0000 + i);
        let backends = (0..4).map(|b| (Ipv4Addr::from(0x0a80_0000 + i * 4 + b), 8080)).collect();
        dp.upsert(&key(vip, 80), &frontend(&format!("svc-{i}"), backends)).expect("program a service");
    }
}

/// Two services, each the other's backend: a packet of a tracked flow to either is translated
/// into a packet of the tracked flow to the other (see the module comment).
fn ping_pong(dp: &mut EbpfDataplane) -> (SocketAddrV4, SocketAddrV4) {
    let ping = SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, 2), 80);
    let pong = SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, 3), 8080);
    dp.upsert(&key(*ping.ip(), ping.port()), &frontend("ping", vec![(*pong.ip(), pong.port())])).unwrap();
    dp.upsert(&key(*pong.ip(), pong.port()), &frontend("pong", vec![(*ping.ip(), ping.port())])).unwrap();
    (ping, pong)
}

/// The IPv6 ping/pong pair, in the IPv6 maps through the agent's writer.
fn ping_pong6(dp: &mut EbpfDataplane) -> (SocketAddrV6, SocketAddrV6) {
    let ping: SocketAddrV6 = "[fd00:100::2]:80".parse().unwrap();
    let pong: SocketAddrV6 = "[fd00:100::3]:8080".parse().unwrap();
    let one = |name: &str, to: SocketAddrV6| Frontend {
        backends: vec![Backend { addr: (*to.ip()).into(), port: to.port(), terminating: false, local: false }],
        ..frontend(name, vec![])
    };
    let key6 = |at: SocketAddrV6| FrontendKey { addr: (*at.ip()).into(), port: at.port(), protocol: Protocol::Tcp };
    dp.upsert(&key6(ping), &one("ping6", pong)).unwrap();
    dp.upsert(&key6(pong), &one("pong6", ping)).unwrap();
    (ping, pong)
}

/// The Service CIDRs a node has (kube-apiserver's `kubernetes` ServiceCIDR, one range per
/// family), with the cluster IPs the bench programmed allocated in them: the datapath checks
/// traffic for no Service against them as it would on a node. `ipv4` is how many of
/// `program_services`' addresses to allocate besides the fixed ones.
fn node_service_cidrs(dp: &mut EbpfDataplane, ipv4: u32) {
    let ranges = ["10.96.0.0/12".parse().unwrap(), "fd00:100::/112".parse().unwrap()];
    let fixed = ["10.100.0.1", "10.100.0.2", "10.100.0.3", "fd00:100::1", "fd00:100::2", "fd00:100::3"];
    let mut allocated: std::collections::BTreeSet<std::net::IpAddr> = fixed.iter().map(|a| a.parse().unwrap()).collect();
    allocated.extend((0..ipv4).map(|i| std::net::IpAddr::V4(Ipv4Addr::from(0x0a60_0000 + i))));
    dp.set_cluster_ip_ranges(&ranges, &allocated).expect("write the Service CIDRs");
}

/// Mean ns per packet over `repeat` runs of `frame` in one test run (TC or XDP).
fn run<P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = aya::programs::TestRunResult>>(
    prog: &P,
    frame: &[u8],
    repeat: u32,
) -> u64 {
    let mut out = vec![0u8; frame.len() + 256];
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), repeat, ..Default::default() };
    prog.test_run(opts).expect("BPF_PROG_TEST_RUN").duration.as_nanos() as u64
}

/// The median of per-call figures.
fn median(mut ns: Vec<u64>) -> f64 {
    ns.sort_unstable();
    ns[ns.len() / 2] as f64
}

/// The median of ratios.
fn median_f(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median of the ratios `b[i] / a[i]` of figures taken one after the other (round `i` of
/// each), from which a change in the machine's pace between rounds cancels out.
fn paired_ratio(a: &[u64], b: &[u64]) -> f64 {
    median_f(a.iter().zip(b).map(|(x, y)| *y as f64 / *x as f64).collect())
}

/// `paired_ratio` of figures that are means (ns per call over a round's calls).
fn paired_ratio_f(a: &[f64], b: &[f64]) -> f64 {
    median_f(a.iter().zip(b).map(|(x, y)| y / x).collect())
}

/// Mean ns per packet over REPEAT runs of one frame in one call; the median of ROUNDS calls.
fn repeated(prog: &mut SchedClassifier, frame: &[u8]) -> f64 {
    median((0..ROUNDS).map(|_| run(prog, frame, REPEAT / scale())).collect())
}

/// Mean ns per packet over CALLS calls, the frame for call i from `frame(i)`.
fn calls(prog: &mut SchedClassifier, frame: impl Fn(u32) -> Vec<u8>) -> f64 {
    calls_from(prog, 0, CALLS / scale(), frame)
}

/// Mean ns per packet over `n` calls, the frame for call i (from `first` on) from `frame(i)`.
fn calls_from(prog: &mut SchedClassifier, first: u32, n: u32, frame: impl Fn(u32) -> Vec<u8>) -> f64 {
    let mut total = 0u64;
    for i in first..first + n {
        total += run(prog, &frame(i), 1);
    }
    total as f64 / f64::from(n)
}

/// Reads the datapath's per-reason counters, to confirm what a measurement exercised.
struct Checker {
    last: BTreeMap<u32, u64>,
}

impl Checker {
    fn counts(dp: &mut EbpfDataplane) -> BTreeMap<u32, u64> {
        let map = dp.ebpf_mut().map(map_names::STATS).expect("stats map");
        let stats = PerCpuArray::<_, Counter>::try_from(map).expect("per-CPU array");
        Reason::ALL
            .iter()
            .map(|r| (*r as u32, stats.get(&(*r as u32), 0).map(|v| v.iter().map(|c| c.packets).sum()).unwrap_or(0)))
            .collect()
    }

    fn new(dp: &mut EbpfDataplane) -> Self {
        Self { last: Self::counts(dp) }
    }

    /// Panics unless exactly `n` packets since the last check were counted, all under `reason`.
    fn took(&mut self, dp: &mut EbpfDataplane, reason: Reason, n: u64, what: &str) {
        self.took_all(dp, &[(reason, n)], what);
    }

    /// As `took`, for several reasons: exactly these counts since the last check, nothing else.
    fn took_all(&mut self, dp: &mut EbpfDataplane, expected: &[(Reason, u64)], what: &str) {
        let now = Self::counts(dp);
        let delta: BTreeMap<u32, u64> =
            now.iter().map(|(k, v)| (*k, v - self.last.get(k).copied().unwrap_or(0))).filter(|(_, d)| *d > 0).collect();
        let want: BTreeMap<u32, u64> = expected.iter().map(|(r, n)| (*r as u32, *n)).collect();
        let labels: Vec<&str> = expected.iter().map(|(r, _)| r.label()).collect();
        assert_eq!(delta, want, "{what}: expected exactly these counts of {labels:?}");
        self.last = now;
    }
}

/// The repeat cases measured in both families (`<case>/repeat` and `<case>6/repeat`).
const TWINS: [&str; 6] = ["established", "reply", "not_service", "not_service_egress", "not_service_xdp", "not_service_ext"];

/// Where a repeat case runs: a pod interface's TC ingress or egress, or an external
/// interface's XDP or TC ingress.
#[derive(Clone, Copy)]
enum Hook {
    Ingress,
    Egress,
    Xdp,
    Ext,
}

struct Measured {
    cases: BTreeMap<&'static str, f64>,
    /// IPv6's cost over IPv4's per case (`TWINS`, and new_flow): the median of the ratios of
    /// figures taken one after the other.
    ratios6: BTreeMap<&'static str, f64>,
    /// Each repeat case's figure of every round (the sizes' rounds take turns: `datapath`).
    rounds: BTreeMap<&'static str, Vec<u64>>,
    /// Each call case's mean of every round (the sizes' rounds take turns too).
    call_rounds: BTreeMap<&'static str, Vec<f64>>,
    program_ms: f64,
}

/// One size's dataplane, programmed, with the frames of its cases. The sizes' repeat rounds
/// take turns (`datapath`), so that a change in the machine's pace (a shared 2-CPU VM) weighs
/// on every size alike, as the cases' turns within a round make it weigh on every case.
struct SizeRun {
    dp: EbpfDataplane,
    /// The lab object, for the floor: its empty classifier and XDP program (the agent's
    /// object does not carry them).
    lab: aya::Ebpf,
    check: Checker,
    program_ms: f64,
    bench_vip: Ipv4Addr,
    bench6: SocketAddrV6,
    not_service: Vec<u8>,
    bench_fwd: Vec<u8>,
    /// (case, hook, frame); each IPv4 case is followed by its IPv6 twin, and odd rounds run
    /// the cases in the reverse order, so that neither family always goes first.
    order: Vec<(&'static str, Hook, Vec<u8>)>,
    rounds: BTreeMap<&'static str, Vec<u64>>,
    call_rounds: BTreeMap<&'static str, Vec<f64>>,
    /// IPv6's new flow over IPv4's, each call round's.
    new_ratios: Vec<f64>,
}

impl SizeRun {
    fn prepare(services: u32) -> Self {
        // `new_flow_by_ct_size` shows how a new flow's cost follows the conntrack map's size.
        let mut dp =
            EbpfDataplane::load(LoadOptions { pin_root: None, lb_map_max: 1 << 20, ct_map_max: DATAPATH_CT_MAX, ..Default::default() })
                .expect("load the dataplane (as root)");
        let t = Instant::now();
        // The measured services: `bench` with 4 real backends, and ping/pong (see the module
        // comment).
        let bench_vip = Ipv4Addr::new(10, 100, 0, 1);
        dp.upsert(&key(bench_vip, 80), &frontend("bench", (1..=4).map(|b| (Ipv4Addr::new(10, 200, 0, b), 8080)).collect())).unwrap();
        let (ping, pong) = ping_pong(&mut dp);
        program_services(&mut dp, services.saturating_sub(3));
        let program_ms = t.elapsed().as_secs_f64() * 1e3;
        node_service_cidrs(&mut dp, services.saturating_sub(3));
        // IPv6 beside: its own ping/pong and a service for new flows, in the IPv6 maps (the
        // IPv4 Services fill the IPv4 ones; the IPv6 maps are separate, so their number does
        // not matter to IPv6's lookups).
        let (ping6, pong6) = ping_pong6(&mut dp);
        let bench6: SocketAddrV6 = "[fd00:100::1]:80".parse().unwrap();
        let bench6_backends =
            (1..=4u16).map(|b| Backend { addr: format!("fd00:200::{b}").parse().unwrap(), port: 8080, terminating: false, local: false });
        let fe6 = Frontend { backends: bench6_backends.collect(), ..frontend("bench6", vec![]) };
        dp.upsert(&FrontendKey { addr: (*bench6.ip()).into(), port: 80, protocol: Protocol::Tcp }, &fe6).unwrap();
        let client6: SocketAddrV6 = "[fd00:244::5]:40000".parse().unwrap();

        let client = SocketAddrV4::new(Ipv4Addr::new(10, 244, 0, 5), 40000);
        let not_service = tcp_frame(client, SocketAddrV4::new(Ipv4Addr::new(10, 50, 0, 1), 80), ACK);
        let bench_fwd = tcp_frame(client, SocketAddrV4::new(bench_vip, 80), ACK);

        let mut lab = proxy_tests::load_lab_object();
        loader::classifier(&mut lab, prog_names::TC_FLOOR).load().expect("load the floor program");
        loader::xdp(&mut lab, prog_names::XDP_PASS).load().expect("load the XDP floor program");

        // Each measurement checks that every run took the path it is named for.
        let mut check = Checker::new(&mut dp);
        // First packets create the flows; every later one is established.
        run(dp.ingress_program(), &tcp_frame(client, SocketAddrV4::new(bench_vip, 80), SYN), 1);
        run(dp.ingress_program(), &tcp_frame(client, ping, SYN), 1);
        run(dp.ingress_program(), &tcp_frame(client, pong, SYN), 1);
        run(dp.ingress_program(), &packet6::tcp_frame(client6, ping6, SYN), 1);
        run(dp.ingress_program(), &packet6::tcp_frame(client6, pong6, SYN), 1);
        check.took(&mut dp, Reason::NewFlow, 5, "flow set-up");
        let not_service6 = packet6::tcp_frame(client6, "[fd00:50::1]:80".parse().unwrap(), ACK);
        let (established6, reply6) = (packet6::tcp_frame(client6, ping6, ACK), packet6::tcp_frame(pong6, client6, ACK));
        // A reply from pong's address to the flow to ping is reverse-NATed to ping's, whose
        // reply entry (of the flow to pong) turns it back, and so on.
        let (established, reply) = (tcp_frame(client, ping, ACK), tcp_frame(pong, client, ACK));
        // Pod-to-pod traffic (most of a cluster's) meets both hooks: the sender's ingress and
        // the receiver's egress, where the same frame is for no Service either. From another
        // node it first meets the uplink's: XDP, then TC's external ingress.
        let order = vec![
            ("not_service/repeat", Hook::Ingress, not_service.clone()),
            ("not_service6/repeat", Hook::Ingress, not_service6.clone()),
            ("not_service_egress/repeat", Hook::Egress, not_service.clone()),
            ("not_service_egress6/repeat", Hook::Egress, not_service6.clone()),
            ("not_service_xdp/repeat", Hook::Xdp, not_service.clone()),
            ("not_service_xdp6/repeat", Hook::Xdp, not_service6.clone()),
            ("not_service_ext/repeat", Hook::Ext, not_service.clone()),
            ("not_service_ext6/repeat", Hook::Ext, not_service6),
            ("established/repeat", Hook::Ingress, established),
            ("established6/repeat", Hook::Ingress, established6),
            ("reply/repeat", Hook::Egress, reply),
            ("reply6/repeat", Hook::Egress, reply6),
        ];
        Self {
            dp,
            lab,
            check,
            program_ms,
            bench_vip,
            bench6,
            not_service,
            bench_fwd,
            order,
            rounds: BTreeMap::new(),
            call_rounds: BTreeMap::new(),
            new_ratios: Vec::new(),
        }
    }

    /// One round of the repeat cases, the floors first: the cases take turns, round after
    /// round, so that a change in the machine's pace weighs on the floor as on the rest; each
    /// figure is its median.
    fn repeat_round(&mut self, round: usize) {
        let repeat = REPEAT / scale();
        let floor = loader::classifier(&mut self.lab, prog_names::TC_FLOOR);
        self.rounds.entry("floor/repeat").or_default().push(run(floor, &self.not_service, repeat));
        let floor = loader::xdp(&mut self.lab, prog_names::XDP_PASS);
        self.rounds.entry("floor_xdp/repeat").or_default().push(run(floor, &self.not_service, repeat));
        let (dp, order) = (&mut self.dp, &self.order);
        let n = order.len();
        for i in 0..n {
            let (case, hook, frame) = &order[if round.is_multiple_of(2) { i } else { n - 1 - i }];
            let ns = match hook {
                Hook::Ingress => run(dp.ingress_program(), frame, repeat),
                Hook::Egress => run(dp.egress_program(), frame, repeat),
                Hook::Ext => run(dp.ext_ingress_program(), frame, repeat),
                Hook::Xdp => run(dp.xdp_program(), frame, repeat),
            };
            self.rounds.entry(case).or_default().push(ns);
        }
    }

    /// One round of the calls (`NEW_ROUNDS` of them, the sizes taking turns as for the repeat
    /// rounds): a share of the floor's, an established flow's, and new flows', IPv4's and
    /// IPv6's in alternating order (call i of the whole run opens client i).
    fn call_round(&mut self, round: u32) {
        let share = CALLS / scale() / NEW_ROUNDS;
        let first = round * share;
        let (not_service, bench_fwd, bench_vip, bench6) = (&self.not_service, &self.bench_fwd, self.bench_vip, self.bench6);
        let floor = calls_from(loader::classifier(&mut self.lab, prog_names::TC_FLOOR), first, share, |_| not_service.clone());
        let dp = &mut self.dp;
        let established = calls_from(dp.ingress_program(), first, share, |_| bench_fwd.clone());
        let v4 = |dp: &mut EbpfDataplane| calls_from(dp.ingress_program(), first, share, |i| new_flow(i, SocketAddrV4::new(bench_vip, 80)));
        let v6 = |dp: &mut EbpfDataplane| {
            calls_from(dp.ingress_program(), first, share, |i| {
                let src = SocketAddrV6::new(
                    std::net::Ipv6Addr::from(0xfd00_0b00_u128 << 96 | u128::from(i >> 8)),
                    1024 + (i & 0xff) as u16,
                    0,
                    0,
                );
                packet6::tcp_frame(src, bench6, SYN)
            })
        };
        // Alternating which family goes first.
        let (v4, v6) = if round.is_multiple_of(2) {
            let a = v4(dp);
            (a, v6(dp))
        } else {
            let b = v6(dp);
            (v4(dp), b)
        };
        for (case, ns) in [("floor/calls", floor), ("established/calls", established), ("new_flow/calls", v4), ("new_flow6/calls", v6)] {
            self.call_rounds.entry(case).or_default().push(ns);
        }
        self.new_ratios.push(v6 / v4);
    }

    /// Checks the rounds took their paths, and gives the figures: a repeat case's median, a
    /// call case's mean over its rounds (of as many calls each).
    fn finish(self) -> Measured {
        let Self { mut dp, mut check, program_ms, rounds, call_rounds, new_ratios, .. } = self;
        let n_repeat = u64::from(REPEAT / scale());
        let n_calls = u64::from(CALLS / scale() / NEW_ROUNDS * NEW_ROUNDS);
        let n_rounds = rounds["floor/repeat"].len() as u64;
        check.took_all(
            &mut dp,
            &[
                // Pod ingress and TC's external ingress.
                (Reason::PassNotService, 4 * n_repeat * n_rounds),
                (Reason::EgressPass, 2 * n_repeat * n_rounds),
                (Reason::XdpPass, 2 * n_repeat * n_rounds),
                (Reason::Established, 2 * n_repeat * n_rounds + n_calls),
                (Reason::ReverseNat, 2 * n_repeat * n_rounds),
                (Reason::NewFlow, 2 * n_calls),
            ],
            "repeat rounds, established calls and new flows",
        );
        // IPv6 against IPv4 round by round: each round's two figures ran one after the other,
        // so a change in the machine's pace between rounds cancels out of their ratio.
        let mut ratios6 = BTreeMap::new();
        for case in TWINS {
            ratios6.insert(case, paired_ratio(&rounds[format!("{case}/repeat").as_str()], &rounds[format!("{case}6/repeat").as_str()]));
        }
        ratios6.insert("new_flow", median_f(new_ratios));
        let mut cases = BTreeMap::new();
        for (case, ns) in &rounds {
            cases.insert(*case, median(ns.clone()));
        }
        for (case, ns) in &call_rounds {
            cases.insert(*case, ns.iter().sum::<f64>() / ns.len() as f64);
        }
        Measured { cases, ratios6, rounds, call_rounds, program_ms }
    }
}

/// The SYN of IPv4 connection `i` to `to`: a client of its own (256 ports an address from
/// 11.0.0.0 on), so every `i` is a new flow.
fn new_flow(i: u32, to: SocketAddrV4) -> Vec<u8> {
    tcp_frame(SocketAddrV4::new(Ipv4Addr::from(0x0b00_0000 + (i >> 8)), 1024 + (i & 0xff) as u16), to, SYN)
}

/// The agent's removal of expired flows, run as if every tracked flow had ended (a million
/// seconds from now), so that all of them go.
fn end_every_flow(dp: &EbpfDataplane) -> [proxy_agent::dataplane::ebpf::ct_gc::Collected; 2] {
    let ended = proxy_agent::dataplane::ebpf::ct_gc::monotonic_coarse_ns() + 1_000_000 * 1_000_000_000;
    dp.collect_expired_flows(ended).expect("remove the ended flows")
}

/// Conntrack map sizes of `new_flow_by_ct_size`: a small map, the agent's default, and the
/// datapath cases' map (eight times the default).
const CT_SIZES: [u32; 3] = [1 << 15, limits::CT_MAP_MAX, DATAPATH_CT_MAX];

/// The conntrack map of `measure`'s cases: room for every flow they open (1,000,000 new flows
/// a family, two entries each), so their new flows find free entries, as they did in every
/// earlier run of this bench.
const DATAPATH_CT_MAX: u32 = 1 << 21;

/// A new IPv4 flow's cost at one conntrack map size, two ways: with room (rounds of flows that
/// fill at most half the map, which the agent's removal of expired flows takes after each
/// round, as if they had all ended: a node whose flows end) and full (the map first filled,
/// then every new flow evicts the least recently used entries: a node with more flows than the
/// map holds, or a flood of new ones).
struct CtSize {
    size: u32,
    room_ns: f64,
    full_ns: f64,
    floor_ns: f64,
}

/// `CtSize` for each of `CT_SIZES`, the empty program's calls after each round. A new flow's
/// map work lands on memory spread over the whole map (the bucket, the element the LRU hands
/// out, the entries it moves and evicts), so its cost follows the map's size and fullness
/// rather than the program's instructions.
fn new_flow_by_ct_size() -> Vec<CtSize> {
    let mut lab = proxy_tests::load_lab_object();
    loader::classifier(&mut lab, prog_names::TC_FLOOR).load().expect("load the floor program");
    let client = SocketAddrV4::new(Ipv4Addr::new(10, 244, 0, 5), 40000);
    let not_service = tcp_frame(client, SocketAddrV4::new(Ipv4Addr::new(10, 50, 0, 1), 80), ACK);
    let vip = Ipv4Addr::new(10, 100, 0, 1);
    let flow = |i: u32| new_flow(i, SocketAddrV4::new(vip, 80));
    let share = CALLS / scale() / NEW_ROUNDS;
    let rounds = f64::from(NEW_ROUNDS);
    CT_SIZES
        .iter()
        .map(|&size| {
            let mut dp = EbpfDataplane::load(LoadOptions { pin_root: None, ct_map_max: size, ..Default::default() })
                .expect("load the dataplane (as root)");
            dp.upsert(&key(vip, 80), &frontend("bench", (1..=4).map(|b| (Ipv4Addr::new(10, 200, 0, b), 8080)).collect())).unwrap();
            let mut check = Checker::new(&mut dp);
            let (mut next, mut floor) = (0u32, 0.0);
            let mut floor_after = |lab: &mut aya::Ebpf, n: u32| {
                floor += calls_from(loader::classifier(lab, prog_names::TC_FLOOR), 0, n, |_| not_service.clone()) / rounds / 2.0;
            };
            // With room: each round's flows (two entries each) fill at most half the map.
            let per_round = share.min(size / 4);
            let mut room = 0.0;
            for _ in 0..NEW_ROUNDS {
                room += calls_from(dp.ingress_program(), next, per_round, flow) / rounds;
                next += per_round;
                floor_after(&mut lab, per_round);
                end_every_flow(&dp);
            }
            // Full: as many flows as the map has entries, untimed, then the rounds.
            calls_from(dp.ingress_program(), next, size, flow);
            next += size;
            let mut full = 0.0;
            for _ in 0..NEW_ROUNDS {
                full += calls_from(dp.ingress_program(), next, share, flow) / rounds;
                next += share;
                floor_after(&mut lab, share);
            }
            check.took(&mut dp, Reason::NewFlow, u64::from(next), "new flows by conntrack size");
            CtSize { size, room_ns: room, full_ns: full, floor_ns: floor }
        })
        .collect()
}

/// `profile`: the established-flow and not-for-a-service packets in a loop for ~10 s, to run
/// under `perf record -a` when working on the datapath (`--ipv6` for IPv6's).
fn profile() {
    // `--where`: `perf` samples the machine meanwhile, and the end prints where the path's time
    // went: the programs' own code by source line, the kernel functions they call
    // (`perfwhere`). Started before the programs load, so perf sees them all.
    let recording = std::env::args().any(|a| a == "--where").then(|| proxy_tests::perfwhere::Recording::start().expect("start perf"));
    // `--xdp`: XDP's tracked north-south path, forward and reply (`xdp_profile`).
    if std::env::args().any(|a| a == "--xdp") {
        return xdp_profile(recording);
    }
    // `--ct-max=N`: the conntrack map's size (the default's, else), to tell the cost of cold
    // memory from the LRU's own work.
    let ct_max = std::env::args().find_map(|a| a.strip_prefix("--ct-max=")?.parse().ok());
    let options = LoadOptions { ct_map_max: ct_max.unwrap_or(LoadOptions::default().ct_map_max), ..Default::default() };
    let mut dp = EbpfDataplane::load(options).expect("load the dataplane (as root)");
    let (ping, pong) = ping_pong(&mut dp);
    node_service_cidrs(&mut dp, 0);
    let mut lab = proxy_tests::load_lab_object();
    loader::classifier(&mut lab, prog_names::TC_FLOOR).load().expect("load the floor program");
    let client = SocketAddrV4::new(Ipv4Addr::new(10, 244, 0, 5), 40000);
    let ingress = dp.ingress_program();
    run(ingress, &tcp_frame(client, ping, SYN), 1);
    run(ingress, &tcp_frame(client, pong, SYN), 1);
    let (mut est, mut other) = (tcp_frame(client, ping, ACK), tcp_frame(client, SocketAddrV4::new(Ipv4Addr::new(10, 50, 0, 1), 80), ACK));
    let mut reply = tcp_frame(pong, client, ACK);
    let frame = |i: u32| new_flow(i, ping);
    let mut new_flow: Box<dyn Fn(u32) -> Vec<u8>> = Box::new(frame);
    // `--ipv6`: the same packets in IPv6, for comparing the families' paths.
    if std::env::args().any(|a| a == "--ipv6") {
        let (ping6, pong6) = ping_pong6(&mut dp);
        new_flow = Box::new(move |i: u32| {
            let src =
                SocketAddrV6::new(std::net::Ipv6Addr::from(0xfd00_0b00_u128 << 96 | u128::from(i >> 8)), 1024 + (i & 0xff) as u16, 0, 0);
            packet6::tcp_frame(src, ping6, SYN)
        });
        let client6: SocketAddrV6 = "[fd00:244::5]:40000".parse().unwrap();
        let ingress = dp.ingress_program();
        run(ingress, &packet6::tcp_frame(client6, ping6, SYN), 1);
        run(ingress, &packet6::tcp_frame(client6, pong6, SYN), 1);
        est = packet6::tcp_frame(client6, ping6, ACK);
        reply = packet6::tcp_frame(pong6, client6, ACK);
        other = packet6::tcp_frame(client6, "[fd00:50::1]:80".parse().unwrap(), ACK);
    }
    // `--reply`: only the reply of the established flow (TC egress), as `--established`;
    // `--egress-other`: only the packet for no Service, on TC egress.
    for (flag, what, frame) in [("--reply", "reply", &reply), ("--egress-other", "not for a service on egress", &other)] {
        if std::env::args().any(|a| a == flag) {
            let egress = dp.egress_program();
            for _ in 0..10 {
                println!("{what} {:.1} ns", repeated(egress, frame));
            }
            return where_it_went(recording);
        }
    }
    let ingress = dp.ingress_program();
    // `--established`: only the established flow, for a profiler's view of that path alone.
    let only_established = std::env::args().any(|a| a == "--established");
    let only_new = std::env::args().any(|a| a == "--only-new-flows");
    for _ in 0..if only_new { 0 } else { 10 } {
        if only_established {
            println!("established {:.1} ns", repeated(ingress, &est));
        } else {
            println!("established {:.1} ns, not for a service {:.1} ns", repeated(ingress, &est), repeated(ingress, &other));
        }
    }
    // `--new-flows`: then new flows (one call each), beside the empty program's calls;
    // `--only-new-flows` skips the established rounds, for a profiler's view of that path.
    // `--collect`: after each round, the agent's removal of expired flows (`ct_gc`) takes the
    // round's flows, as if they had all ended: the next round's find free entries (a node whose
    // flows end and are removed) instead of evicting (one whose map is full).
    let collect = std::env::args().any(|a| a == "--collect");
    if std::env::args().any(|a| a == "--new-flows" || a == "--only-new-flows") {
        for round in 0..if only_new { 10 } else { 1 } {
            let n = CALLS / scale();
            let ns = calls_from(dp.ingress_program(), round * n, n, &new_flow);
            if recording.is_some() {
                // The empty program's calls would be sampled with the path's.
                print!("new flow {ns:.1} ns");
            } else {
                let floor = calls(loader::classifier(&mut lab, prog_names::TC_FLOOR), |_| other.clone());
                print!("new flow {ns:.1} ns, empty program {floor:.1} ns ({:.1}x)", ns / floor);
            }
            if collect {
                let t = Instant::now();
                let [v4, v6] = end_every_flow(&dp);
                print!(
                    "; removed {} flows ({} reply entries) in {:.0} ms",
                    v4.flows + v6.flows,
                    v4.replies + v6.replies,
                    t.elapsed().as_secs_f64() * 1e3
                );
            }
            println!();
        }
    }
    where_it_went(recording);
}

/// `profile --where`'s table, while the measured programs are still loaded (their line info
/// is read from the kernel).
fn where_it_went(recording: Option<proxy_tests::perfwhere::Recording>) {
    if let Some(r) = recording {
        let breakdown = r.finish().expect("read perf's samples");
        println!("\nwhere the time went (`perf record -a -g`, this process's samples inside BPF_PROG_TEST_RUN):\n{}", breakdown.render(20));
    }
}

/// A node for XDP's figures: a namespace of its own (`uplink_node`), which the calling thread
/// enters, whose uplink's next hop leads to the clients and to another node's pods; a UDP
/// NodePort on it whose one backend is on that other node; and the lab object's generator
/// programs on the dataplane's maps, pinned in a bpffs of its own (the programs' per-CPU flow
/// caches, which are not pinned, are their own). Everything goes when it drops.
struct XdpNode {
    ifindex: u32,
    dp: EbpfDataplane,
    lab: aya::Ebpf,
    // Dropped after the programs and maps: the pins, then the namespace.
    _pins: proxy_tests::lab::TempBpffs,
    _ns: proxy_tests::netns::Netns,
}

const XDP_NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 1);
const XDP_CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(198, 51, 100, 7), 40000);
const XDP_NODE_PORT: SocketAddrV4 = SocketAddrV4::new(XDP_NODE_IP, 30053);
const XDP_BACKEND: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 2, 5), 8080);
/// The same flow in IPv6 (`profile --xdp --ipv6`).
const XDP_NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 1);
const XDP_CLIENT6: SocketAddrV6 = SocketAddrV6::new(Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 7), 40000, 0, 0);
const XDP_NODE_PORT6: SocketAddrV6 = SocketAddrV6::new(XDP_NODE_IP6, 30053, 0, 0);
const XDP_BACKEND6: SocketAddrV6 = SocketAddrV6::new(Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 5), 8080, 0, 0);

/// `flow`: the NodePort's flow, in whose family the node gets its address and routes.
fn xdp_node(flow: &XdpFlow) -> XdpNode {
    use proxy_tests::netns::{enter, ifindex, routed_uplink_node};
    let ipv6 = flow.node_port.is_ipv6();
    let ns = routed_uplink_node("pxb", ipv6);
    enter(&ns.file()).expect("enter the node namespace");
    let ifindex = ifindex("ext0");
    let pins = proxy_tests::lab::TempBpffs::new("pxb");
    let mut dp = EbpfDataplane::load(LoadOptions { pin_root: Some(pins.0.clone()), ..Default::default() }).expect("load the dataplane");
    if ipv6 {
        dp.set_interface_address6(ifindex, Some(XDP_NODE_IP6)).expect("the node's IPv6 address");
    } else {
        dp.set_interface_address(ifindex, Some(XDP_NODE_IP)).expect("the node's address");
    }
    // What the agent records for an uplink whose far end takes native XDP's frames (a NIC's).
    dp.set_xdp_devices(&[(ifindex, proxy_common::xdp_dev::TX | proxy_common::xdp_dev::XMIT)].into()).expect("XDP devices");
    let name = ServicePortName { service: ObjectKey::new("bench", "north"), port: "dns".into(), protocol: Protocol::Udp };
    let backend = Backend { addr: flow.backend.ip(), port: flow.backend.port(), terminating: false, local: false };
    let key = FrontendKey { addr: flow.node_port.ip(), port: flow.node_port.port(), protocol: Protocol::Udp };
    dp.upsert(&key, &Frontend::new(name, FrontendKind::NodePort, vec![backend])).expect("the NodePort");
    let mut lab = proxy_tests::load_lab_object_on(&pins.0);
    for p in [prog_names::XDP_BENCH_EXT, prog_names::XDP_BENCH_TX] {
        let prog: &mut aya::programs::Xdp = lab.program_mut(p).expect("bench program").try_into().expect("XDP");
        loader::load_program(|| prog.load()).expect("load the bench program");
    }
    // One flow: the generator's frame keeps its source port (an IPv6 frame needs that: the
    // generator writes the port at IPv4's offset).
    let mut flows: aya::maps::Array<_, u32> = aya::maps::Array::try_from(lab.map_mut("BENCH_FLOWS_V1").expect("flow count")).unwrap();
    flows.set(0, 1, 0).expect("flow count");
    XdpNode { ifindex, dp, lab, _pins: pins, _ns: ns }
}

/// The addresses of `profile --xdp`'s flow in one family, and how its frames are made and read.
struct XdpFlow {
    client: SocketAddr,
    node_port: SocketAddr,
    backend: SocketAddr,
}

impl XdpFlow {
    fn v4() -> Self {
        Self { client: XDP_CLIENT.into(), node_port: XDP_NODE_PORT.into(), backend: XDP_BACKEND.into() }
    }

    fn v6() -> Self {
        Self { client: XDP_CLIENT6.into(), node_port: XDP_NODE_PORT6.into(), backend: XDP_BACKEND6.into() }
    }

    /// The generator's frame from `from` to `to`, arriving on `ext0` from its next hop.
    fn frame(from: SocketAddr, to: SocketAddr) -> [u8; 64] {
        let (dst_mac, src_mac) = ([0x02, 0x50, 0, 0, 0, 1], [0x02, 0x50, 0, 0, 0, 2]);
        match (from, to) {
            (SocketAddr::V4(from), SocketAddr::V4(to)) => proxy_tests::northbench::generator_frame(from, to, dst_mac, src_mac),
            (SocketAddr::V6(from), SocketAddr::V6(to)) => proxy_tests::northbench::generator_frame6(from, to, dst_mac, src_mac),
            _ => unreachable!("one family per flow"),
        }
    }

    /// The frame's source and destination; panics unless its checksums hold (the IPv4
    /// generator's UDP datagrams carry none, IPv6's must).
    fn ends(frame: &[u8]) -> (SocketAddr, SocketAddr) {
        if frame.get(12..14) == Some(&[0x86, 0xdd][..]) {
            let d = packet6::dissect(frame);
            assert_eq!(d.l4_checksum_ok, Some(true), "the UDP checksum of {d:?}");
            (d.src_sock().into(), d.dst_sock().into())
        } else {
            let d = proxy_tests::packet::dissect(frame);
            assert!(d.ip_checksum_ok && d.udp_checksum_zero, "the checksums of {d:?}");
            (d.src_sock().into(), d.dst_sock().into())
        }
    }
}

impl XdpNode {
    /// Mean ns per packet of `program` over `repeat` runs, each on `frame` afresh (the generator
    /// restores it: a test run repeats on the frame the last run left), arriving on `ext0`;
    /// and the frame the last run left. Panics unless the last run sent it back out (XDP_TX).
    fn run(&mut self, program: &str, frame: [u8; 64], repeat: u32) -> (u64, Vec<u8>) {
        let mut template: aya::maps::Array<_, [u8; 64]> =
            aya::maps::Array::try_from(self.lab.map_mut("BENCH_FRAME_V1").expect("frame map")).unwrap();
        template.set(0, frame, 0).expect("frame template");
        let ctx = proxy_tests::testrun::xdp_md(frame.len(), self.ifindex);
        let mut out = vec![0u8; 64 + 256];
        let prog: &mut aya::programs::Xdp = self.lab.program_mut(program).unwrap().try_into().unwrap();
        let opts = TestRunOptions { data_in: Some(&frame), data_out: Some(&mut out), ctx_in: Some(&ctx), repeat, ..Default::default() };
        let r = prog.test_run(opts).expect("BPF_PROG_TEST_RUN");
        assert_eq!(r.return_value as i32, proxy_tests::testrun::XDP_TX, "{program}: sent back out");
        out.truncate(r.data_size_out as usize);
        (r.duration.as_nanos() as u64, out)
    }
}

/// `profile --xdp`: a tracked north-south flow's packets through XDP (a NodePort flow to a
/// backend on another node, sent back out of the interface it came in on, XDP_TX), in a loop,
/// beside the generator's restore alone (`proxy_xdp_bench_tx`, the floor of these figures: the
/// frame restored and sent back out). `--reply`: its reply's. `--ipv6`: the same flow in IPv6,
/// which the generator's program hands to the agent's IPv6 XDP program by the tail call the
/// agent's own XDP program makes (the dataplane fills the pinned program array). Each figure
/// is the median of ROUNDS runs of REPEAT packets; every run must return XDP_TX, and the
/// counters must hold every packet under `xdp_forward` (`xdp_reply`). It runs on a thread of
/// its own, which enters the node's namespace.
fn xdp_profile(recording: Option<proxy_tests::perfwhere::Recording>) {
    std::thread::spawn(move || xdp_profile_here(recording)).join().unwrap_or_else(|p| std::panic::resume_unwind(p));
}

fn xdp_profile_here(recording: Option<proxy_tests::perfwhere::Recording>) {
    let (flow, family) = if std::env::args().any(|a| a == "--ipv6") { (XdpFlow::v6(), "IPv6 ") } else { (XdpFlow::v4(), "") };
    let mut n = xdp_node(&flow);
    let forward = XdpFlow::frame(flow.client, flow.node_port);
    let (_, out) = n.run(prog_names::XDP_BENCH_EXT, forward, 1);
    let (src, dst) = XdpFlow::ends(&out);
    assert_eq!((src.ip(), dst), (flow.node_port.ip(), flow.backend), "the flow's first packet: SNAT and DNAT");
    let reply = XdpFlow::frame(flow.backend, src);
    let (_, out) = n.run(prog_names::XDP_BENCH_EXT, reply, 1);
    assert_eq!(XdpFlow::ends(&out), (flow.node_port, flow.client), "its reply, translated back");
    let (frame, reason, what) = if std::env::args().any(|a| a == "--reply") {
        (reply, Reason::XdpReply, "reply")
    } else {
        (forward, Reason::XdpForward, "forward")
    };
    let mut check = Checker::new(&mut n.dp);
    let repeat = REPEAT / scale();
    for _ in 0..10 {
        let (mut ours, mut floor) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            ours.push(n.run(prog_names::XDP_BENCH_EXT, frame, repeat).0);
            floor.push(n.run(prog_names::XDP_BENCH_TX, frame, repeat).0);
        }
        let (ours, floor) = (median(ours), median(floor));
        println!("xdp {family}{what} {ours:.1} ns, restore only {floor:.1} ns ({:.1} ns above it)", ours - floor);
    }
    check.took(&mut n.dp, reason, 10 * ROUNDS as u64 * u64::from(repeat), "xdp rounds");
    where_it_went(recording);
}

// ---------------------------------------------------------------------------------------------
// control: API server change -> map write, and memory

fn svc_vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000 + i + 1)
}

fn svc_objects(i: u32, first_endpoint: Ipv4Addr) -> [String; 2] {
    let name = format!("svc-{i}");
    let mut eps = vec![first_endpoint];
    eps.extend((1..4).map(|b| Ipv4Addr::from(0x0ac8_0000 + i * 4 + b)));
    [
        proxy_tests::lab::service(&name, &svc_vip(i).to_string(), &[("http", 80, "TCP", 8080)]),
        proxy_tests::lab::endpoint_slice(&name, &format!("{name}-1"), &eps, &[("http", 8080, "TCP")]),
    ]
}

/// The backends the pinned maps give frontend `vip`:80/TCP, read straight from the kernel.
struct Probe {
    services: aya::maps::HashMap<aya::maps::MapData, proxy_common::ServiceKey, proxy_common::ServiceValue>,
    backends: aya::maps::Array<aya::maps::MapData, proxy_common::Backend>,
}

impl Probe {
    /// None until the agent has pinned its maps.
    fn open(root: &std::path::Path) -> Option<Self> {
        let open = |n: &str| aya::maps::MapData::from_pin(root.join("maps").join(n)).ok();
        Some(Self {
            services: aya::maps::HashMap::try_from(aya::maps::Map::HashMap(open(map_names::SERVICES)?)).ok()?,
            backends: aya::maps::Array::try_from(aya::maps::Map::Array(open(map_names::BACKENDS)?)).ok()?,
        })
    }

    fn has_backend(&self, vip: Ipv4Addr, addr: Ipv4Addr) -> bool {
        let key = proxy_common::ServiceKey::frontend(vip, 80, proxy_common::IPPROTO_TCP);
        let Ok(master) = self.services.get(&key, 0) else { return false };
        (1..=master.count).any(|slot| {
            self.services
                .get(&key.with_slot(slot), 0)
                .ok()
                .and_then(|s| self.backends.get(&s.backend_id, 0).ok())
                .is_some_and(|b| b.addr == addr.octets())
        })
    }

    fn frontends(&self) -> usize {
        self.services.keys().filter(|k| k.as_ref().is_ok_and(|k| k.slot == 0)).count()
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map(|kib| kib / 1024.0)
        .unwrap_or(0.0)
}

/// A lab without backends, an in-process API server holding its Node, and a kubeconfig for it.
fn api_lab() -> (proxy_tests::lab::Lab, proxy_tests::apiserver::ApiServer, std::path::PathBuf) {
    use proxy_tests::{apiserver::ApiServer, lab};
    let lab = lab::Lab::new(lab::sibling("proxy-lab-agent"), 0);
    let api = ApiServer::start(&lab.node, 0);
    api.apply(&lab::node_manifest());
    let kubeconfig = lab.dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    (lab, api, kubeconfig)
}

fn control(out_dir: &std::path::Path) {
    const SAMPLES: u32 = 200;
    let sizes = [1_000u32, 10_000];
    let (mut lab, api, kubeconfig) = api_lab();
    let first = |i: u32| Ipv4Addr::from(0x0ac8_0000 + i * 4);
    let mut added = 0;
    let mut rows = Vec::new();
    let mut rss = 0.0;
    for (round, n) in sizes.iter().enumerate() {
        eprintln!("control plane: {n} services x 4 endpoints...");
        for i in added..*n {
            for obj in svc_objects(i, first(i)) {
                api.apply(&obj);
            }
        }
        added = *n;
        if round == 0 {
            lab.agent_log_level = "info";
            lab.start_agent_kube(&kubeconfig, &[]);
        }
        let t = Instant::now();
        let probe = loop {
            if let Some(p) = Probe::open(&lab.bpffs()) {
                if p.frontends() >= *n as usize {
                    break p;
                }
            }
            assert!(lab.agent_running(), "the agent exited:\n{}", lab.agent_log());
            assert!(t.elapsed() < std::time::Duration::from_secs(300), "the agent never programmed {n} services:\n{}", lab.agent_log());
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        let initial = t.elapsed();
        let mut lat = Vec::new();
        for s in 0..SAMPLES {
            let i = (s * 7919) % n;
            let fresh = Ipv4Addr::from(0x0b00_0000 + round as u32 * 0x10000 + s);
            let [_, slice] = svc_objects(i, fresh);
            let t0 = Instant::now();
            api.apply(&slice);
            while !probe.has_backend(svc_vip(i), fresh) {
                assert!(t0.elapsed() < std::time::Duration::from_secs(30), "change {s} never reached the maps");
            }
            lat.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
        if *n == 10_000 {
            std::thread::sleep(std::time::Duration::from_secs(1));
            rss = lab_agent_rss(&lab);
        }
        rows.push((*n, percentile(&lat, 0.5), percentile(&lat, 0.99), lat[lat.len() - 1], initial.as_secs_f64()));
    }
    println!("\nControl plane: one EndpointSlice change in the API server -> the maps ({SAMPLES} changes each)");
    println!("{:<28}{:>12}{:>12}{:>12}{:>26}", "services x 4 endpoints", "p50 ms", "p99 ms", "max ms", "all programmed after (s)");
    for (n, p50, p99, max, init) in &rows {
        println!("{n:<28}{p50:>12.2}{p99:>12.2}{max:>12.2}{init:>26.2}");
    }
    println!("agent RSS with 10,000 services x 4 endpoints programmed: {rss:.1} MiB");
    let json = serde_json::json!({
        "benchmark": "control",
        "samples": SAMPLES,
        "rows": rows.iter().map(|(n, p50, p99, max, init)| serde_json::json!({"services": n, "p50_ms": p50, "p99_ms": p99, "max_ms": max, "added_batch_programmed_s": init})).collect::<Vec<_>>(),
        "rss_mib_10k": rss,
    });
    let path = out_dir.join("control.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).expect("write JSON");
    println!("written to {}", path.display());
}

/// CPU time (user + system) a process has used, with that of the programs it ran and waited
/// for (the nftables mode's `nft`), in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is the 3rd, utime the 14th.
    let rest = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12) + ticks(13) + ticks(14)) / hz
}

const FOOTPRINT_SERVICES: u32 = 30_000;
const FOOTPRINT_RATE: u32 = 100;
const FOOTPRINT_SECONDS: u32 = 60;

/// A lab and API server holding `FOOTPRINT_SERVICES` Services x 4 endpoints.
fn footprint_lab() -> (proxy_tests::lab::Lab, proxy_tests::apiserver::ApiServer, std::path::PathBuf) {
    let (mut lab, api, kubeconfig) = api_lab();
    eprintln!("footprint: {FOOTPRINT_SERVICES} services x 4 endpoints in the API server...");
    for i in 0..FOOTPRINT_SERVICES {
        for obj in svc_objects(i, Ipv4Addr::from(0x0ac8_0000 + i * 4)) {
            api.apply(&obj);
        }
    }
    lab.agent_log_level = "info";
    (lab, api, kubeconfig)
}

/// How long the changes run: `FOOTPRINT_SECONDS`, or `PROXY_BENCH_FOOTPRINT_SECONDS` (a longer
/// run shows whether the agent's memory keeps growing under churn).
fn footprint_seconds() -> u32 {
    // At most a day (its changes are counted in a u32).
    std::env::var("PROXY_BENCH_FOOTPRINT_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&s| s > 0)
        .map_or(FOOTPRINT_SECONDS, |s: u32| s.min(86_400))
}

/// What `cpu_under_changes` saw.
struct UnderChanges {
    /// Percent of one core, with the programs the agent runs.
    cpu: f64,
    wall: f64,
    /// The agent's RSS (MiB) every `RSS_EVERY` changes, the first before any, the last after
    /// the last.
    rss: Vec<f64>,
}

/// The agent's CPU while `FOOTPRINT_RATE` EndpointSlice changes a second arrive for
/// `footprint_seconds()`, the wall time taken, and its RSS every ten seconds of it.
fn cpu_under_changes(pid: u32, api: &proxy_tests::apiserver::ApiServer) -> UnderChanges {
    const RSS_EVERY: u32 = 10 * FOOTPRINT_RATE;
    let seconds = footprint_seconds();
    eprintln!("footprint: {FOOTPRINT_RATE} EndpointSlice changes a second for {seconds} s...");
    let cpu0 = cpu_seconds(pid);
    let t0 = Instant::now();
    let mut rss = Vec::new();
    for s in 0..FOOTPRINT_RATE * seconds {
        if s % RSS_EVERY == 0 {
            rss.push(rss_mib(pid));
        }
        let due = std::time::Duration::from_secs_f64(f64::from(s) / f64::from(FOOTPRINT_RATE));
        if let Some(wait) = due.checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
        let i = (s * 7919) % FOOTPRINT_SERVICES;
        let [_, slice] = svc_objects(i, Ipv4Addr::from(0x0b00_0000 + s));
        api.apply(&slice);
    }
    let wall = t0.elapsed().as_secs_f64();
    rss.push(rss_mib(pid));
    UnderChanges { cpu: (cpu_seconds(pid) - cpu0) / wall * 100.0, wall, rss }
}

/// `MiB at 0 s, MiB at 10 s, ...`: an RSS series of `cpu_under_changes`.
fn rss_series(rss: &[f64]) -> String {
    rss.iter().map(|r| format!("{r:.1}")).collect::<Vec<_>>().join(", ")
}

/// The nftables mode beside eBPF (issue: its CPU under the same changes): a lab of its own,
/// programmed when the agent logs its first complete sync.
fn footprint_nftables() -> serde_json::Value {
    let (mut lab, api, kubeconfig) = footprint_lab();
    let t = Instant::now();
    lab.start_agent_kube(&kubeconfig, &["--proxy-mode", "nftables"]);
    while !lab.agent_log().contains("initial sync done") {
        assert!(t.elapsed() < std::time::Duration::from_secs(1800), "nftables mode never synced:\n{}", lab.agent_log());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let programmed = t.elapsed();
    std::thread::sleep(std::time::Duration::from_secs(2));
    let pid = lab.agent_pid().expect("agent running");
    let rss = rss_mib(pid);
    let changes = cpu_under_changes(pid, &api);
    let rss_after = rss_mib(pid);
    println!("\nThe same in the nftables mode (its own lab and API server)");
    println!("  all programmed after start:        {:.1} s", programmed.as_secs_f64());
    println!("  agent RSS:                          {rss:.1} MiB ({rss_after:.1} MiB after the changes below)");
    println!(
        "  agent CPU, {FOOTPRINT_RATE} slice changes/s:    {:.1} % of one core over {:.0} s (with the nft it runs)",
        changes.cpu, changes.wall
    );
    println!("  RSS every 10 s of the changes, and at their end: {} MiB", rss_series(&changes.rss));
    serde_json::json!({
        "programmed_s": programmed.as_secs_f64(),
        "rss_mib": rss,
        "rss_mib_after_changes": rss_after,
        "rss_mib_every_10_s_of_changes": changes.rss,
        "changes_s": changes.wall,
        "cpu_percent_at_100_changes_per_s": changes.cpu,
    })
}

/// `cargo xtask bench footprint`: the agent at 30,000 Services x 4 endpoints from the API
/// server: its memory, its CPU while 100 EndpointSlice changes a second arrive for a minute,
/// and a restart with everything pinned (time to /healthz 200, what it rewrites); then the
/// nftables mode's memory and CPU beside it (`PROXY_BENCH_MODES=ebpf` leaves that out).
fn footprint(out_dir: &std::path::Path) {
    use proxy_tests::lab;
    const N: u32 = FOOTPRINT_SERVICES;
    let (mut lab, api, kubeconfig) = footprint_lab();
    let wait_programmed = |lab: &lab::Lab| {
        let t = Instant::now();
        loop {
            if Probe::open(&lab.bpffs()).is_some_and(|p| p.frontends() >= N as usize) {
                return t.elapsed();
            }
            assert!(t.elapsed() < std::time::Duration::from_secs(600), "the agent never programmed {N} services:\n{}", lab.agent_log());
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    // 30,000 frontends of 1 + 4 entries each need more than the default 65,536 map entries.
    let flags = ["--lb-map-max", "262144"];
    lab.start_agent_kube(&kubeconfig, &flags);
    let programmed = wait_programmed(&lab);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let pid = lab.agent_pid().expect("agent running");
    let rss = rss_mib(pid);
    let changes = cpu_under_changes(pid, &api);
    let rss_after = rss_mib(pid);
    // A restart with everything pinned: time until /healthz answers 200, and what it rewrote.
    lab.stop_agent();
    let log_before = lab.agent_log().len();
    let t = Instant::now();
    lab.start_agent_kube(&kubeconfig, &flags);
    let ready = loop {
        if let Ok((200, _)) = proxy_tests::servers::http_get(&lab.node, "127.0.0.1:10256".parse().unwrap(), "/healthz") {
            break t.elapsed();
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(600), "not ready after a restart:\n{}", lab.agent_log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // /healthz answers 200 from the start (kube-proxy's rule: nothing is overdue yet); the
    // restart is done when its first complete sync is.
    let sync = loop {
        let log = lab.agent_log();
        if let Some(l) = log.get(log_before..).unwrap_or(&log).lines().find(|l| l.contains("initial sync done")) {
            break l.to_string();
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(600), "no initial sync after a restart:\n{}", lab.agent_log());
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let synced = t.elapsed();
    let field = |name: &str| sync.split_whitespace().find_map(|w| w.strip_prefix(&format!("{name}="))).unwrap_or("?").to_string();
    println!("\nFootprint at {N} Services x 4 endpoints (eBPF mode, API server source)");
    println!("  all programmed after start:        {:.1} s", programmed.as_secs_f64());
    println!("  agent RSS:                          {rss:.1} MiB ({rss_after:.1} MiB after the changes below)");
    println!("  agent CPU, {FOOTPRINT_RATE} slice changes/s:    {:.1} % of one core over {:.0} s", changes.cpu, changes.wall);
    println!("  RSS every 10 s of the changes, and at their end: {} MiB", rss_series(&changes.rss));
    println!(
        "  restart with everything pinned:     /healthz 200 after {:.2} s, first sync done after {:.2} s: unchanged={} programmed={} removed={}",
        ready.as_secs_f64(),
        synced.as_secs_f64(),
        field("unchanged"),
        field("programmed"),
        field("removed")
    );
    drop((lab, api));
    let nftables_wanted = std::env::var("PROXY_BENCH_MODES").map_or(true, |m| m.split(',').any(|x| x.trim() == "nftables"));
    let nftables = if nftables_wanted { footprint_nftables() } else { serde_json::Value::Null };
    let json = serde_json::json!({
        "benchmark": "footprint",
        "services": N,
        "programmed_s": programmed.as_secs_f64(),
        "rss_mib": rss,
        "rss_mib_after_changes": rss_after,
        "rss_mib_every_10_s_of_changes": changes.rss,
        "changes_s": changes.wall,
        "cpu_percent_at_100_changes_per_s": changes.cpu,
        "restart_healthz_s": ready.as_secs_f64(),
        "restart_synced_s": synced.as_secs_f64(),
        "restart_initial_sync": sync,
        "nftables": nftables,
    });
    let path = out_dir.join("footprint.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).expect("write JSON");
    println!("written to {}", path.display());
}

fn lab_agent_rss(lab: &proxy_tests::lab::Lab) -> f64 {
    lab.agent_pid().map(rss_mib).unwrap_or(0.0)
}

fn datapath(out_dir: &std::path::Path) {
    let mut runs: Vec<(u32, SizeRun)> = SIZES
        .iter()
        .map(|&n| {
            eprintln!("programming {n} services x 4 backends...");
            (n, SizeRun::prepare(n))
        })
        .collect();
    eprintln!("measuring the repeat cases, the sizes taking turns round after round...");
    for round in 0..ROUNDS {
        for (_, r) in &mut runs {
            r.repeat_round(round);
        }
    }
    eprintln!("measuring the calls, the sizes taking turns round after round...");
    for round in 0..NEW_ROUNDS {
        for (_, r) in &mut runs {
            r.call_round(round);
        }
    }
    let results: Vec<(u32, Measured)> = runs.into_iter().map(|(n, r)| (n, r.finish())).collect();
    let rows: [(&str, &str); 18] = [
        ("floor/repeat", "empty program (floor)"),
        ("not_service/repeat", "not for a service (ingress)"),
        ("not_service_egress/repeat", "not for a service (egress)"),
        ("established/repeat", "established flow (ingress DNAT)"),
        ("reply/repeat", "reply (egress reverse NAT)"),
        ("not_service6/repeat", "IPv6: not for a service (ingress)"),
        ("not_service_egress6/repeat", "IPv6: not for a service (egress)"),
        ("established6/repeat", "IPv6: established flow"),
        ("reply6/repeat", "IPv6: reply"),
        ("floor_xdp/repeat", "empty XDP program (XDP floor)"),
        ("not_service_xdp/repeat", "not for a service (external, XDP)"),
        ("not_service_ext/repeat", "not for a service (external, TC)"),
        ("not_service_xdp6/repeat", "IPv6: not for a service (ext., XDP)"),
        ("not_service_ext6/repeat", "IPv6: not for a service (ext., TC)"),
        ("floor/calls", "empty program (floor)"),
        ("established/calls", "established flow (ingress DNAT)"),
        ("new_flow/calls", "new flow (select, track, DNAT)"),
        ("new_flow6/calls", "IPv6: new flow"),
    ];
    // 100,000 Services against 1, in percent: the median of each round's ratio (the sizes'
    // rounds ran one after the other, so a change in the machine's pace between rounds cancels
    // out).
    let flat = |case: &str| {
        let (one, most) = (&results[0].1, &results[results.len() - 1].1);
        let ratio = match (one.rounds.get(case), most.rounds.get(case)) {
            (Some(a), Some(b)) => paired_ratio(a, b),
            _ => paired_ratio_f(&one.call_rounds[case], &most.call_rounds[case]),
        };
        (ratio - 1.0) * 100.0
    };
    let (kernel, cpus) = (proxy_tests::report::kernel(), proxy_tests::report::cores());
    println!("\nDatapath cost per packet through BPF_PROG_TEST_RUN (ns), kernel {kernel}, {cpus} CPUs");
    println!("{:<44}{:>10}{:>12}{:>13}{:>12}", "", "1 svc", "10,000 svc", "100,000 svc", "100k vs 1");
    for (i, (case, label)) in rows.iter().enumerate() {
        if case.is_empty() {
            continue;
        }
        if i == 0 {
            println!("repeat = {REPEAT} in one call (median of {ROUNDS} rounds, the cases and the sizes taking turns; 100k vs 1: the median of the rounds' ratios):");
        }
        if case.ends_with("/calls") && rows[i - 1].0.ends_with("/repeat") {
            println!("{CALLS} calls, repeat = 1, a fresh frame each (in {NEW_ROUNDS} rounds, the sizes taking turns; 100k vs 1: the median of the rounds' ratios):");
        }
        let v: Vec<f64> = results.iter().map(|(_, m)| m.cases[case]).collect();
        println!("  {label:<42}{:>10.1}{:>12.1}{:>13.1}{:>12}", v[0], v[1], v[2], format!("{:+.1}%", flat(case)));
    }
    let ratio = |case: &str, floor: &str| -> Vec<f64> { results.iter().map(|(_, m)| m.cases[case] / m.cases[floor]).collect() };
    let est = ratio("established/repeat", "floor/repeat");
    let est_calls = ratio("established/calls", "floor/calls");
    println!(
        "\nestablished / floor: {:.2}x {:.2}x {:.2}x (repeat); {:.2}x {:.2}x {:.2}x (calls)   target <= 2.5x",
        est[0], est[1], est[2], est_calls[0], est_calls[1], est_calls[2]
    );
    println!(
        "100,000 vs 1 service: established {:+.1}%, new flow {:+.1}%, not for a service {:+.1}% (ingress), {:+.1}% (egress)   target within 10%",
        flat("established/repeat"),
        flat("new_flow/calls"),
        flat("not_service/repeat"),
        flat("not_service_egress/repeat")
    );
    let v6: Vec<String> = TWINS
        .iter()
        .chain(&["new_flow"])
        .map(|c| {
            let r: Vec<f64> = results.iter().map(|(_, m)| m.ratios6[c]).collect();
            let each: Vec<String> = r.iter().map(|x| format!("{:+.0}", (x - 1.0) * 100.0)).collect();
            format!("{c} {:+.0}% ({})", (r.iter().sum::<f64>() / r.len() as f64 - 1.0) * 100.0, each.join("/"))
        })
        .collect();
    println!(
        "IPv6 vs IPv4 (median of the ratios of figures taken one after the other, in alternating order; mean over the sizes, then each size): {}   target within 15%",
        v6.join(", ")
    );
    let programming: Vec<String> = results.iter().map(|(n, m)| format!("{n} services in {:.0} ms", m.program_ms)).collect();
    println!("programming (agent map writer, 4 backends each): {}", programming.join(", "));
    let new_flow = ratio("new_flow/calls", "floor/calls");
    println!(
        "new flow / floor: {:.1}x {:.1}x {:.1}x (calls; a conntrack map of {DATAPATH_CT_MAX} entries with room)   target <= 10x",
        new_flow[0], new_flow[1], new_flow[2]
    );
    eprintln!("measuring new flows by conntrack map size...");
    let by_size = new_flow_by_ct_size();
    println!(
        "\nNew IPv4 flow by conntrack map size (1 service; ns, and x the empty program's {} ns measured beside):",
        by_size.iter().map(|c| format!("{:.1}", c.floor_ns)).collect::<Vec<_>>().join(" / ")
    );
    println!("  {:<30}{:>24}{:>24}", "entries", "with room (flows end)", "full (evicting)");
    for c in &by_size {
        let default = if c.size == limits::CT_MAP_MAX { " (default)" } else { "" };
        let cell = |ns: f64| format!("{ns:.1} ns {:>5.1}x", ns / c.floor_ns);
        println!("  {:<30}{:>24}{:>24}", format!("{}{default}", c.size), cell(c.room_ns), cell(c.full_ns));
    }

    let json = serde_json::json!({
        "benchmark": "datapath",
        "unit": "ns_per_packet",
        "kernel": kernel,
        "cpus": cpus,
        "repeat": REPEAT,
        "repeat_rounds_median_of": ROUNDS,
        "calls": CALLS,
        "services": SIZES,
        "cases": results.iter().map(|(n, m)| serde_json::json!({"services": n, "program_ms": m.program_ms, "ns": m.cases, "ipv6_over_ipv4": m.ratios6})).collect::<Vec<_>>(),
        "most_services_over_one_pct": rows.iter().map(|(case, _)| (case.to_string(), flat(case))).collect::<BTreeMap<_, _>>(),
        "ct_map_max": DATAPATH_CT_MAX,
        "ct_map_max_default": limits::CT_MAP_MAX,
        "new_flow_by_ct_size": by_size
            .iter()
            .map(|c| serde_json::json!({"ct_map_max": c.size, "with_room_ns": c.room_ns, "full_ns": c.full_ns, "floor_ns": c.floor_ns}))
            .collect::<Vec<_>>(),
    });
    let path = out_dir.join("datapath.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).expect("write JSON");
    println!("written to {}", path.display());
}

/// `PROXY_BENCH_MODES=xdp` (labels: xdp, tc, iptables-legacy, iptables-nft, nftables) runs only
/// those modes, and `PROXY_BENCH_ROUNDS=N` gives XDP N rounds against the floor: for working on
/// the XDP path. Such a run writes no JSON (the report's figures are a whole run's).
/// `PROXY_BENCH_FLOWS=N`: frames of N flows instead of 16 (see `northbench::flows`).
fn north(out_dir: &std::path::Path) {
    let quick = std::env::args().any(|a| a == "--quick");
    let filler = 1000;
    let modes = std::env::var("PROXY_BENCH_MODES").unwrap_or_default();
    let wanted = |m: &str| modes.trim().is_empty() || modes.split(',').any(|w| w.trim() == m);
    let rounds = std::env::var("PROXY_BENCH_ROUNDS").ok().and_then(|r| r.parse().ok());
    let flows = proxy_tests::northbench::flows();
    println!(
        "\nNodePort forwarding, client -> node A -> backend on node B ({filler} other Services programmed; UDP frames of {flows} flows)"
    );
    let figures = proxy_tests::northbench::run(proxy_tests::lab::sibling("proxy-lab-agent"), quick, filler, wanted, rounds);
    let of = |mode| figures.iter().find(|f| f.mode == mode);
    use proxy_tests::northbench::Mode;
    let floor = figures[0].floor_pps;
    println!(
        "\nfloor (frames generated, sent straight back out, dropped at the far end; no processing): {floor:.0} pps = {:.0} ns/packet",
        1e9 / floor
    );
    let ipt = of(Mode::Iptables).map(|f| f.pps_delivered);
    let ipt_cps = of(Mode::Iptables).map(|f| f.conns_per_sec);
    let ratio = |a: f64, b: Option<f64>| b.map_or("-".to_string(), |b| format!("{:.2}x", a / b));
    println!(
        "\n{:<12} {:>13} {:>8} {:>13} {:>15} {:>8}",
        "node A runs", "UDP 64B pps", "vs ipt", "ns/pkt > floor", "new TCP conn/s", "vs ipt"
    );
    for f in &figures {
        println!(
            "{:<12} {:>13.0} {:>8} {:>13.0} {:>15.0} {:>8}",
            format!("{:?}", f.mode),
            f.pps_delivered,
            ratio(f.pps_delivered, ipt),
            1e9 / f.pps_delivered - 1e9 / floor,
            f.conns_per_sec,
            ratio(f.conns_per_sec, ipt_cps)
        );
    }
    let Some(xdp) = of(Mode::Xdp) else { return };
    // XDP's share of the floor: the median of the rounds that measured them one after the other.
    let mut shares = xdp.of_floor.clone();
    shares.sort_by(f64::total_cmp);
    let share = shares.get(shares.len() / 2).copied().unwrap_or(xdp.pps_delivered / floor);
    let pct = |v: &[f64]| v.iter().map(|r| format!("{:.0}", 100.0 * r)).collect::<Vec<_>>().join(", ");
    println!(
        "\nXDP pps: {} iptables (target >= 5x), {} nftables (target >= 3x), {:.0} % of the floor (target >= 85 %; the median of {} rounds of the floor and XDP one after the other: {} %)",
        ratio(xdp.pps_delivered, ipt),
        ratio(xdp.pps_delivered, of(Mode::Nftables).map(|f| f.pps_delivered)),
        100.0 * share,
        xdp.of_floor.len(),
        pct(&xdp.of_floor)
    );
    let (Some(ipt), Some(ipt_cps), 5) = (ipt, ipt_cps, figures.len()) else {
        println!("(PROXY_BENCH_MODES left modes out: no JSON written)");
        return;
    };
    let json = serde_json::json!({
        "benchmark": "north",
        "filler_services": filler,
        "flows": flows,
        "floor_pps": floor,
        "xdp_share_of_floor": share,
        "xdp_share_of_floor_rounds": xdp.of_floor,
        "modes": figures.iter().map(|f| serde_json::json!({
            "mode": format!("{:?}", f.mode),
            "udp_pps_delivered": f.pps_delivered,
            "udp_pps_offered": f.pps_offered,
            "tcp_new_conns_per_sec": f.conns_per_sec,
            "pps_vs_iptables": f.pps_delivered / ipt,
            "conns_vs_iptables": f.conns_per_sec / ipt_cps,
        })).collect::<Vec<_>>(),
    });
    let path = out_dir.join("north.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).expect("write JSON");
    println!("written to {}", path.display());
}

// ---------------------------------------------------------------------------------------------
// modes: time to program N Services in each mode

/// `cargo xtask bench connect` (see `proxy_tests::connectbench`). PROXY_BENCH_MODES and
/// PROXY_BENCH_SIZES narrow it as for `modes` (labels: floor, ebpf, nftables, iptables-legacy,
/// iptables-nft); PROXY_BENCH_SEED fixes the Services under test.
fn connect(out_dir: &std::path::Path) {
    use proxy_tests::connectbench::{run, SAMPLES};
    let wanted = std::env::var("PROXY_BENCH_MODES").unwrap_or_default();
    let wanted = |m: &str| wanted.trim().is_empty() || wanted.split(',').any(|w| w.trim() == m);
    let seed = std::env::var("PROXY_BENCH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    let rows = run(&proxy_tests::lab::sibling("proxy-lab-agent"), &proxy_tests::modesbench::sizes(), wanted, seed);
    println!("\nNew connections through each mode ({SAMPLES} each; microseconds p50 / p99 / p999; seed {seed})");
    println!(
        "{:<16}{:>9}{:>12}  {:<24}{:<24}{:<24}Service under test",
        "mode", "services", "program s", "ClusterIP TCP connect", "ClusterIP UDP request", "NodePort TCP connect"
    );
    let f = |p: &[f64; 3]| if p[0].is_nan() { "-".to_string() } else { format!("{:.0} / {:.0} / {:.0}", p[0], p[1], p[2]) };
    for r in &rows {
        if r.cluster_tcp_us[0].is_nan() {
            println!("{:<16}{:>9}    {}", r.mode, r.services, r.note);
            continue;
        }
        let program = if r.program_s.is_nan() { "-".to_string() } else { format!("{:.1}", r.program_s) };
        println!(
            "{:<16}{:>9}{:>12}  {:<24}{:<24}{:<24}{} ({})",
            r.mode,
            r.services,
            program,
            f(&r.cluster_tcp_us),
            f(&r.cluster_udp_us),
            f(&r.nodeport_tcp_us),
            r.note,
            r.position
        );
    }
    let json = serde_json::json!({ "benchmark": "connect", "samples": SAMPLES, "seed": seed, "rows": rows });
    let path = out_dir.join("connect.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).expect("write JSON");
    println!("written to {}", path.display());
}

fn modes(out_dir: &std::path::Path) {
    use proxy_agent::dataplane::ProxyMode;
    use proxy_tests::modesbench::{run_mode, sizes, Row, Variant};
    // PROXY_BENCH_MODES=nftables,ipvs runs only those (labels: ebpf, iptables-nft,
    // iptables-legacy, nftables, ipvs).
    let wanted = std::env::var("PROXY_BENCH_MODES").unwrap_or_default();
    let wanted = |m: &str| wanted.trim().is_empty() || wanted.split(',').any(|w| w.trim() == m);
    let mut rows: Vec<Row> = Vec::new();
    for v in Variant::ALL.into_iter().filter(|v| v.mode != ProxyMode::Ipvs) {
        if wanted(&v.label()) {
            rows.extend(run_mode(v, &sizes()));
        }
    }
    let (ipvs, ipvs_note) = if wanted("ipvs") { modes_ipvs_in_guest() } else { (vec![], "IPVS not asked for (PROXY_BENCH_MODES)".into()) };
    let per = proxy_tests::modesbench::endpoints();
    println!("\nModes: ClusterIP Services x {per} endpoints handed to the mode -> programmed in the kernel");
    println!("(one endpoint change: {} changes at each size; p50 / max)", proxy_tests::modesbench::CHANGES);
    println!("(written again: the same Services handed to a new proxier, as after a restart, over what the first wrote;");
    println!(" its syncs: the first, and the longest after it where the write goes in steps, one per sync)");
    println!("(half changed: every other Service's endpoints changed at once -> programmed, and the longest sync of it)");
    println!(
        "{:<17}{:>10}{:>16}{:>24}{:>20}{:>24}{:>28}",
        "mode", "services", "program (s)", "one change (ms)", "written again (s)", "first / later sync (s)", "half changed / longest (s)"
    );
    for r in rows.iter().chain(ipvs.iter()) {
        let mode = if r.mode == "ipvs" { "ipvs*".to_string() } else { r.mode.clone() };
        if r.program_s.is_nan() {
            println!("{mode:<17}{:>10}    {}", r.services, r.checked);
        } else {
            println!(
                "{mode:<17}{:>10}{:>16.3}{:>24}{:>20.3}{:>24}{:>28}",
                r.services,
                r.program_s,
                format!("{:.2} / {:.2}", r.change_ms_p50, r.change_ms_max),
                r.rewrite_s,
                format!("{:.2} / {:.2}", r.rewrite_first_s, r.rewrite_later_s),
                format!("{:.2} / {:.2}", r.burst_s, r.burst_longest_s)
            );
        }
    }
    println!("* {ipvs_note}");
    let json =
        serde_json::json!({ "benchmark": "modes", "endpoints_per_service": per, "rows": rows, "ipvs_guest": ipvs, "ipvs_note": ipvs_note });
    let path = out_dir.join("modes.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).expect("write JSON");
    println!("written to {}", path.display());
}

/// IPVS mode in the qemu guest of the IPVS conformance test. Returns the rows and what they
/// are (or why there are none).
fn modes_ipvs_in_guest() -> (Vec<proxy_tests::modesbench::Row>, String) {
    use std::process::Command;
    let tests = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let guest = tests.parent().unwrap().join("target/ipvs-guest");
    let missing: Vec<&str> = ["qemu-system-x86_64", "busybox", "cpio", "ipvsadm", "ipset"]
        .into_iter()
        .filter(|t| !Command::new("sh").args(["-c", &format!("command -v {t}")]).status().is_ok_and(|s| s.success()))
        .collect();
    if !missing.is_empty() {
        return (vec![], format!("IPVS not measured: the guest needs {missing:?} (`cargo xtask setup` installs them)"));
    }
    let build = Command::new("bash").arg(tests.join("guest/build-guest.sh")).arg(&guest).output().expect("build-guest.sh");
    if !build.status.success() {
        return (vec![], format!("IPVS not measured: building the guest failed: {}", String::from_utf8_lossy(&build.stderr)));
    }
    let me = std::env::current_exe().expect("own path");
    let job = guest.join("modes-job.sh");
    std::fs::write(
        &job,
        format!("#!/bin/sh\nset -e\nfor m in ip_vs ip_vs_rr ip_set xt_set dummy; do modprobe $m || true; done\nRUST_LOG='{}' PROXY_BENCH_SIZES='{}' PROXY_BENCH_ENDPOINTS='{}' exec {} modes-guest\n", std::env::var("RUST_LOG").unwrap_or_default(), std::env::var("PROXY_BENCH_SIZES").unwrap_or_default(), std::env::var("PROXY_BENCH_ENDPOINTS").unwrap_or_default(), me.display()),
    )
    .unwrap();
    eprintln!("modes: ipvs in the qemu guest (emulated; this takes minutes)...");
    let out = Command::new("bash").arg(tests.join("guest/run-guest.sh")).arg(&guest).arg(&job).arg("3000").output().expect("run-guest.sh");
    let console = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<proxy_tests::modesbench::Row> =
        console.lines().filter_map(|l| l.split_once("MODES-ROW ")).filter_map(|(_, j)| serde_json::from_str(j.trim()).ok()).collect();
    let accel = if console.contains("accel kvm") { "KVM" } else { "TCG, i.e. emulated: several times slower than this machine" };
    let expected = proxy_tests::modesbench::sizes().len();
    let note = if rows.len() == expected {
        format!(
            "IPVS ran in a qemu guest booted from Debian's kernel ({accel}); compare its rows with each other, not with the modes above"
        )
    } else {
        format!(
            "IPVS in the guest gave {} of {expected} rows (guest exit {:?}); console tail:\n{}",
            rows.len(),
            out.status.code(),
            console.lines().rev().take(15).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    };
    (rows, note)
}

/// Inside the guest: IPVS mode at every size, a JSON line per size.
fn modes_guest() {
    for n in proxy_tests::modesbench::sizes() {
        let ipvs = proxy_tests::modesbench::Variant { mode: proxy_agent::dataplane::ProxyMode::Ipvs, iptables: Default::default() };
        for r in proxy_tests::modesbench::run_mode(ipvs, &[n]) {
            println!("MODES-ROW {}", serde_json::to_string(&r).unwrap());
        }
    }
}

fn main() {
    // Ctrl-C: the namespaces, pins and agents of the benchmark running go too.
    proxy_tests::interrupt::clean_up_on_signals();
    let only_report = std::env::args().skip(1).filter(|a| !a.starts_with("--")).all(|a| a == "report") && std::env::args().len() > 1;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 && !only_report {
        eprintln!("the benchmark loads eBPF programs: run it as root (`sudo -E cargo xtask bench`)");
        std::process::exit(1);
    }
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    }
    let out_dir = std::path::PathBuf::from(std::env::var_os("BENCH_OUT_DIR").unwrap_or_else(|| ".".into()));
    // (Made here, not found missing after a run of minutes.)
    if let Err(e) = std::fs::create_dir_all(&out_dir) {
        eprintln!("proxy-bench: cannot create BENCH_OUT_DIR {}: {e}", out_dir.display());
        std::process::exit(1);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut which: Vec<String> = args.into_iter().filter(|a| !a.starts_with("--")).collect();
    if which.is_empty() {
        which = vec!["datapath".into(), "control".into(), "footprint".into(), "north".into(), "modes".into(), "connect".into()];
    }
    // The profiler's loop writes no figures, and the IPVS guest hands its rows to the host.
    let report = which.iter().any(|b| b != "profile" && b != "modes-guest");
    for b in which {
        match b.as_str() {
            "datapath" => datapath(&out_dir),
            "control" => control(&out_dir),
            "profile" => profile(),
            "north" => north(&out_dir),
            "modes" => modes(&out_dir),
            "modes-guest" => modes_guest(),
            "footprint" => footprint(&out_dir),
            "connect" => connect(&out_dir),
            // Only the report, from the figures already written.
            "report" => {}
            other => {
                eprintln!("unknown benchmark {other:?}; available: datapath, control, north, modes, footprint, connect, profile, report");
                std::process::exit(2);
            }
        }
    }
    // Every run ends with the report of all the figures the output directory holds.
    if report {
        match proxy_tests::report::write(&out_dir) {
            Ok((path, found)) => println!("\nreport of {} written to {}", found.join(", "), path.display()),
            Err(e) => eprintln!("writing the report in {}: {e}", out_dir.display()),
        }
    }
}
