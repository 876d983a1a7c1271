//! `cargo xtask bench modes`: how long each mode takes to program 1,000, 10,000 and 30,000
//! ClusterIP Services with 4 endpoints each (`PROXY_BENCH_ENDPOINTS`: another number), and to
//! apply one endpoint change with the largest number present.
//!
//! Every mode runs the agent's own reconciling code (the eBPF `Reconciler`, the netfilter
//! `NetfilterProxier`) on the same Service and EndpointSlice objects, from "the objects are in
//! hand" to "the kernel has them", in a network namespace of its own (netfilter state, ipsets
//! and IPVS are per namespace; eBPF maps are the process's own, unpinned). Not measured: the
//! API server watch, which is the same for every mode. Each run checks in the kernel that what
//! it timed was programmed. IPVS runs in the qemu guest of the IPVS conformance test (this
//! kernel has no IPVS); that guest is emulated (TCG), so its figures are not comparable with
//! the others and are reported apart.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_agent::{
    config::{Config, Flags},
    dataplane::{
        ebpf::{loader::LoadOptions, reconcile::Reconciler, EbpfDataplane},
        modes::rules_for,
        netfilter::{
            proxier::{Masquerading, NetfilterProxier},
            Iptables,
        },
        ProxyMode,
    },
    model::store::{Event, Kind, Object, Store},
    sync::SyncStats,
};
use serde::{Deserialize, Serialize};

use crate::{lab, netns};

pub const SIZES: [u32; 3] = [1_000, 10_000, 30_000];

/// The sizes to run: `PROXY_BENCH_SIZES=1000,5000` overrides SIZES (for a quick look).
pub fn sizes() -> Vec<u32> {
    match std::env::var("PROXY_BENCH_SIZES") {
        Ok(v) if !v.trim().is_empty() => {
            v.split(',').map(|n| n.trim().parse().unwrap_or_else(|_| panic!("PROXY_BENCH_SIZES: {n:?} is not a number"))).collect()
        }
        _ => SIZES.to_vec(),
    }
}
/// Endpoint changes timed at the largest size; the median and the largest are reported.
pub const CHANGES: u32 = 9;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    pub mode: String,
    pub services: u32,
    /// All Services and EndpointSlices handed over -> the kernel programmed.
    pub program_s: f64,
    /// One EndpointSlice change -> the kernel programmed (median, max), measured at each size.
    pub change_ms_p50: f64,
    pub change_ms_max: f64,
    /// The same Services handed to a new proxier, as after an agent restart (and as an hourly
    /// full resync or the sync after a failed one writes) -> the kernel programmed again.
    #[serde(default)]
    pub rewrite_s: f64,
    /// That write's first sync (it also translates every Service), and the longest of the
    /// syncs after it (0 when there are none): a mode that writes a large table in steps, one
    /// per sync, takes changes between them, so these are the longest a change waited.
    #[serde(default)]
    pub rewrite_first_s: f64,
    #[serde(default)]
    pub rewrite_later_s: f64,
    /// Half the Services' endpoints changed at once (a namespace redeployed) -> the kernel
    /// programmed, over every sync it takes, and the longest of those syncs (the longest a
    /// change made meanwhile waited). NaN in results from before these were measured.
    #[serde(default = "nan")]
    pub burst_s: f64,
    #[serde(default = "nan")]
    pub burst_longest_s: f64,
    /// What the run counted in the kernel afterwards.
    pub checked: String,
}

fn vip(i: u32) -> Ipv4Addr {
    // 10.96.0.0/16 and up: 30,000 fit below 10.96.117.48.
    Ipv4Addr::from(0x0a60_0000 + i + 1)
}

/// Endpoints per Service: 4, or `PROXY_BENCH_ENDPOINTS` (1 to 64; kube-proxy's users report
/// nftables syncs of minutes at 5,000 Services of 50: kubernetes#135639).
pub fn endpoints() -> u32 {
    // (Read once: every endpoint address is made from it.)
    static ENDPOINTS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *ENDPOINTS.get_or_init(|| match std::env::var("PROXY_BENCH_ENDPOINTS") {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse() {
            Ok(n) if (1..=64).contains(&n) => n,
            _ => panic!("PROXY_BENCH_ENDPOINTS: {v:?} is not a number from 1 to 64"),
        },
        _ => 4,
    })
}

fn endpoint(i: u32, b: u32) -> Ipv4Addr {
    // (30,000 Services of 64 endpoints end below 10.158.0.0.)
    Ipv4Addr::from(0x0a80_0000 + i * endpoints() + b)
}

fn slice(i: u32, first: Ipv4Addr) -> EndpointSlice {
    let mut eps = vec![first];
    eps.extend((1..endpoints()).map(|b| endpoint(i, b)));
    let name = format!("svc-{i}");
    serde_yaml::from_str(&lab::endpoint_slice(&name, &format!("{name}-1"), &eps, &[("http", 8080, "TCP")])).expect("slice YAML")
}

fn objects(n: u32) -> (Vec<Object>, Vec<Object>) {
    let services = (0..n)
        .map(|i| {
            let svc: Service = serde_yaml::from_str(&lab::service(&format!("svc-{i}"), &vip(i).to_string(), &[("http", 80, "TCP", 8080)]))
                .expect("service YAML");
            Object::Service(Box::new(svc))
        })
        .collect();
    let slices = (0..n).map(|i| Object::EndpointSlice(Box::new(slice(i, endpoint(i, 0))))).collect();
    (services, slices)
}

/// A fresh endpoint for change `c`, outside every range above.
fn fresh(c: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 250, (c >> 8) as u8, c as u8)
}

/// Service i's first endpoint after the burst of changes (every even Service), outside every
/// range above.
fn burst(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0afb_0000 + i)
}

fn nan() -> f64 {
    f64::NAN
}

trait Programmer {
    fn handle(&mut self, e: Event);
    fn sync(&mut self) -> Option<SyncStats>;
    /// The last sync left work for the next (`NetfilterProxier::pending`).
    fn pending(&self) -> bool {
        false
    }
}

impl Programmer for Reconciler<EbpfDataplane> {
    fn handle(&mut self, e: Event) {
        Reconciler::handle(self, e)
    }
    fn sync(&mut self) -> Option<SyncStats> {
        Reconciler::sync(self)
    }
}

impl Programmer for NetfilterProxier {
    fn handle(&mut self, e: Event) {
        NetfilterProxier::handle(self, e)
    }
    fn sync(&mut self) -> Option<SyncStats> {
        NetfilterProxier::sync(self)
    }
    fn pending(&self) -> bool {
        NetfilterProxier::pending(self)
    }
}

fn timed_sync(p: &mut dyn Programmer, what: &str) -> Duration {
    let t = Instant::now();
    let s = p.sync().unwrap_or_else(|| panic!("{what}: nothing was synced"));
    let took = t.elapsed();
    assert_eq!(s.failed, 0, "{what}: the sync failed (see the log above)");
    took
}

/// Counts what `mode` has in the kernel for the benchmark's Services: (Services, endpoints
/// found with address `probe`).
fn kernel_count(mode: ProxyMode, ipt: Iptables, p: &mut dyn std::any::Any, probe: Ipv4Addr) -> (usize, usize) {
    let needle = format!("{probe}:8080");
    match mode {
        ProxyMode::Ebpf => {
            // What `proxy-agent inspect` reads: the pinned maps.
            let root = p.downcast_ref::<Reconciler<EbpfDataplane>>().and_then(|r| r.dataplane().pin_root()).expect("pinned").to_path_buf();
            let report = proxy_agent::inspect::read(&root).expect("read the pinned maps");
            let found = report.frontends.iter().flat_map(|f| &f.backends).filter(|b| b.address == needle).count();
            (report.frontends.len(), found)
        }
        ProxyMode::Iptables => {
            let nat = netns::sh(&[ipt.save(), "-t", "nat"]);
            (nat.lines().filter(|l| l.starts_with(":KUBE-SVC-")).count(), nat.matches(&format!("--to-destination {needle}")).count())
        }
        ProxyMode::Nftables => {
            let t = netns::sh(&["nft", "list", "table", "ip", "kube-proxy"]);
            (
                t.lines().filter(|l| l.trim_start().starts_with("chain service-") && l.contains('/')).count(),
                t.matches(&format!("dnat to {needle}")).count(),
            )
        }
        ProxyMode::Ipvs => {
            let s = netns::sh(&["ipvsadm", "-Sn"]);
            (s.lines().filter(|l| l.starts_with("-A ")).count(), s.matches(&format!("-r {needle}")).count())
        }
    }
}

/// A mode as benchmarked: iptables runs once per backend.
#[derive(Clone, Copy, Debug)]
pub struct Variant {
    pub mode: ProxyMode,
    pub iptables: Iptables,
}

impl Variant {
    pub const ALL: [Variant; 5] = [
        Variant { mode: ProxyMode::Ebpf, iptables: Iptables::Nft },
        Variant { mode: ProxyMode::Iptables, iptables: Iptables::Nft },
        Variant { mode: ProxyMode::Iptables, iptables: Iptables::Legacy },
        Variant { mode: ProxyMode::Nftables, iptables: Iptables::Nft },
        Variant { mode: ProxyMode::Ipvs, iptables: Iptables::Nft },
    ];

    /// ebpf, iptables-nft, iptables-legacy, nftables, ipvs.
    pub fn label(&self) -> String {
        match self.mode {
            ProxyMode::Iptables => self.iptables.iptables().to_string(),
            m => m.to_string(),
        }
    }
}

/// Programs `n` Services in `v` (in the calling thread's network namespace), then times
/// `changes` single-endpoint changes.
fn programmer(mode: ProxyMode, boxed: &mut Box<dyn std::any::Any>) -> &mut dyn Programmer {
    match mode {
        ProxyMode::Ebpf => boxed.downcast_mut::<Reconciler<EbpfDataplane>>().unwrap(),
        _ => boxed.downcast_mut::<NetfilterProxier>().unwrap(),
    }
}

fn one(v: Variant, n: u32, changes: u32) -> Row {
    let mode = v.mode;
    let (services, slices) = objects(n);
    let pins = crate::lab::TempBpffs::new("pxbm");
    let pin_root = pins.0.clone();
    if mode == ProxyMode::Ebpf {
        // A bpffs of its own, mounted on a temporary directory.
        proxy_agent::bpffs::prepare(&pin_root).unwrap_or_else(|e| panic!("{}: {e}", pin_root.display()));
    }
    let proxier = || -> Box<dyn std::any::Any> {
        let store = Store::new("bench-node");
        let kinds = vec![Kind::Service, Kind::EndpointSlice];
        match mode {
            ProxyMode::Ebpf => {
                let dp = EbpfDataplane::load(LoadOptions {
                    pin_root: Some(pin_root.clone()),
                    lb_map_max: 1 << 18,
                    ct_map_max: 1 << 16,
                    ..Default::default()
                })
                .expect("load the eBPF dataplane (as root)");
                Box::new(Reconciler::new(store, dp, kinds))
            }
            _ => {
                let cluster_cidrs = vec!["10.0.0.0/8".parse().unwrap()];
                let flags = Flags { cluster_cidr: Some(cluster_cidrs.clone()), ..Default::default() };
                let (cfg, _) = Config::resolve(flags, || "bench-node".into()).expect("configuration");
                let rules = rules_for(mode, &cfg, v.iptables, false).expect("netfilter rules");
                let masquerading = Masquerading { masquerade_all: false, detect_local: None, cluster_cidrs };
                Box::new(NetfilterProxier::new(store, rules, kinds, masquerading, vec![]))
            }
        }
    };
    let mut boxed = proxier();
    let prog = programmer(mode, &mut boxed);
    let t = Instant::now();
    prog.handle(Event::Replace { kind: Kind::Service, objects: services });
    prog.handle(Event::Replace { kind: Kind::EndpointSlice, objects: slices });
    // (A large nftables table is built in steps, one per sync.)
    let what = format!("{mode}: programming {n} services");
    let _ = timed_sync(prog, &what);
    while prog.pending() {
        let _ = timed_sync(prog, &what);
    }
    let program_s = t.elapsed().as_secs_f64();
    let mut lat = Vec::new();
    let mut last = endpoint(0, 0);
    for c in 0..changes {
        let i = (c * 7919 + n / 2) % n;
        last = fresh(c);
        let t = Instant::now();
        prog.handle(Event::Apply(Object::EndpointSlice(Box::new(slice(i, last)))));
        let _ = timed_sync(prog, &format!("{mode}: endpoint change {c}"));
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    // Half the Services change at once (their slices made before the clock starts).
    let changed: Vec<EndpointSlice> = (0..n).step_by(2).map(|i| slice(i, burst(i))).collect();
    let t = Instant::now();
    for s in changed {
        prog.handle(Event::Apply(Object::EndpointSlice(Box::new(s))));
    }
    let what = format!("{mode}: {} services changed at once", n.div_ceil(2));
    let mut burst_longest = timed_sync(prog, &what);
    while prog.pending() {
        burst_longest = burst_longest.max(timed_sync(prog, &what));
    }
    let burst_s = t.elapsed().as_secs_f64();
    // The burst's last Service in key order (the nftables mode writes more than 1,000 changes
    // in batches, in that order) is in the kernel as changed.
    let last_key = (0..n).step_by(2).max_by_key(|i| format!("svc-{i}")).unwrap_or(0);
    let (_, found) = kernel_count(mode, v.iptables, boxed.as_mut(), burst(last_key));
    assert!(found >= 1, "{mode}: the burst's change to svc-{last_key} ({}) is not in the kernel", burst(last_key));
    // A restart: a new proxier (the eBPF one adopting the pinned maps) handed the Services as
    // they are now (the last change included) writes the kernel again.
    drop(boxed);
    let mut boxed = proxier();
    let prog = programmer(mode, &mut boxed);
    let (services, mut slices) = objects(n);
    let i = (changes.saturating_sub(1) * 7919 + n / 2) % n;
    if changes > 0 {
        slices[i as usize] = Object::EndpointSlice(Box::new(slice(i, last)));
    }
    // (The burst came after: its Services, the last changed one among them if it is even.)
    for b in (0..n).step_by(2) {
        slices[b as usize] = Object::EndpointSlice(Box::new(slice(b, burst(b))));
    }
    if i.is_multiple_of(2) {
        last = burst(i);
    }
    let t = Instant::now();
    prog.handle(Event::Replace { kind: Kind::Service, objects: services });
    prog.handle(Event::Replace { kind: Kind::EndpointSlice, objects: slices });
    let what = format!("{mode}: {n} services written again by a new proxier");
    let first = timed_sync(prog, &what);
    let mut later = Duration::ZERO;
    while prog.pending() {
        later = later.max(timed_sync(prog, &what));
    }
    let rewrite_s = t.elapsed().as_secs_f64();
    let (programmed, found) = kernel_count(mode, v.iptables, boxed.as_mut(), last);
    assert_eq!(programmed, n as usize, "{mode}: the kernel should have {n} services");
    assert!(found >= 1, "{mode}: the last changed Service's endpoint ({last}) is not in the kernel");
    Row {
        mode: v.label(),
        services: n,
        program_s,
        change_ms_p50: lat.get(lat.len() / 2).copied().unwrap_or(0.0),
        change_ms_max: lat.last().copied().unwrap_or(0.0),
        rewrite_s,
        rewrite_first_s: first.as_secs_f64(),
        rewrite_later_s: later.as_secs_f64(),
        burst_s,
        burst_longest_s: burst_longest.as_secs_f64(),
        checked: format!("{programmed} services in the kernel, the changed endpoint present"),
    }
}

/// A size is skipped when the one before it, scaled by the cube of the size ratio, would take
/// longer than this. iptables-nft's `--noflush` restore looks chains up by name one by one and
/// grows faster than the square of the Services: 1,000 took 0.8 s, 10,000 took 120 s, and a
/// 30,000 run stopped after 47 minutes had read a third of its input.
pub const SKIP_PROJECTED_OVER: Duration = Duration::from_secs(45 * 60);

/// `SKIP_PROJECTED_OVER`, or `PROXY_BENCH_SKIP_OVER` seconds (a shorter run: the largest size
/// of a slow mode alone can take most of an hour).
pub fn skip_projected_over() -> Duration {
    std::env::var("PROXY_BENCH_SKIP_OVER").ok().and_then(|s| s.parse().ok()).map_or(SKIP_PROJECTED_OVER, Duration::from_secs)
}

/// Runs `v` at each size, each in a fresh network namespace. A size projected to take longer
/// than SKIP_PROJECTED_OVER is skipped, and its row says so.
pub fn run_mode(v: Variant, sizes: &[u32]) -> Vec<Row> {
    let label = v.label();
    let mut rows: Vec<Row> = Vec::new();
    for &n in sizes {
        if let Some(prev) = rows.last().filter(|r| !r.program_s.is_nan()) {
            let projected = prev.program_s * (f64::from(n) / f64::from(prev.services)).powi(3);
            if projected > skip_projected_over().as_secs_f64() {
                let why =
                    format!("not run: {} Services took {:.0} s, so {n} would take about {:.0} s", prev.services, prev.program_s, projected);
                eprintln!("modes: {label}, {n} services: {why}");
                rows.push(Row {
                    mode: label.clone(),
                    services: n,
                    program_s: f64::NAN,
                    change_ms_p50: f64::NAN,
                    change_ms_max: f64::NAN,
                    rewrite_s: f64::NAN,
                    rewrite_first_s: f64::NAN,
                    rewrite_later_s: f64::NAN,
                    burst_s: f64::NAN,
                    burst_longest_s: f64::NAN,
                    checked: why,
                });
                continue;
            }
        }
        eprintln!("modes: {label}, {n} services x {} endpoints...", endpoints());
        let ns = netns::Netns::create(format!("pxbm-{}", netns::unique_id()));
        let row = ns.run(move || one(v, n, CHANGES));
        drop(ns);
        eprintln!("  programmed in {:.2} s; one endpoint change p50 {:.2} ms", row.program_s, row.change_ms_p50);
        rows.push(row);
    }
    rows
}
