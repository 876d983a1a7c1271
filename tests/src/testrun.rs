//! Running frames through the loaded TC program with BPF_PROG_TEST_RUN, and reading what the
//! datapath recorded.

use std::collections::BTreeMap;

use aya::{
    maps::{HashMap, PerCpuArray},
    programs::{TestRun, TestRunOptions},
};
use proxy_agent::dataplane::ebpf::{loader::LoadOptions, EbpfDataplane};
use proxy_common::{map_names, Counter, CtEntry, CtKey, Reason};

pub const TC_ACT_OK: i32 = 0;
pub const TC_ACT_SHOT: i32 = 2;
pub const TC_ACT_REDIRECT: i32 = 7;

pub struct Output {
    pub action: i32,
    pub frame: Vec<u8>,
}

/// A dataplane loaded without pins, for packet tables.
pub fn dataplane() -> EbpfDataplane {
    EbpfDataplane::load(LoadOptions::default()).expect("load the eBPF dataplane (are you root?)")
}

/// Which program a frame goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    /// Arriving from a pod: DNAT.
    Ingress,
    /// Leaving towards a pod: reverse NAT.
    Egress,
}

/// Runs a frame arriving from a pod through the ingress program.
pub fn run(dp: &mut EbpfDataplane, frame: &[u8]) -> Output {
    run_at(dp, Hook::Ingress, frame)
}

/// Runs a frame leaving towards a pod through the egress program.
pub fn run_egress(dp: &mut EbpfDataplane, frame: &[u8]) -> Output {
    run_at(dp, Hook::Egress, frame)
}

/// A frame from a pod passes the ingress program exactly as it went in. (BPF_PROG_TEST_RUN
/// gives the frame back unchanged also when the program drops it: the verdict tells.)
pub fn assert_untouched(dp: &mut EbpfDataplane, frame: &[u8], what: &str) {
    let out = run(dp, frame);
    assert_eq!(out.action, TC_ACT_OK, "{what}: expected TC_ACT_OK");
    assert_eq!(out.frame, frame, "{what}: expected the frame unchanged");
}

/// The same on egress: the frame leaves as it is.
pub fn assert_leaves(dp: &mut EbpfDataplane, frame: &[u8], what: &str) {
    let out = run_egress(dp, frame);
    assert_eq!(out.action, TC_ACT_OK, "{what}: expected TC_ACT_OK");
    assert_eq!(out.frame, frame, "{what}: expected the frame unchanged");
}

pub fn run_at(dp: &mut EbpfDataplane, hook: Hook, frame: &[u8]) -> Output {
    let prog = match hook {
        Hook::Ingress => dp.ingress_program(),
        Hook::Egress => dp.egress_program(),
    };
    run_classifier(prog, frame)
}

/// Runs a frame through the loaded TC program `name` itself (`prog_names`), as a tail call
/// into its slot would.
pub fn run_program(dp: &mut EbpfDataplane, name: &'static str, frame: &[u8]) -> Output {
    run_classifier(proxy_agent::dataplane::ebpf::loader::classifier(dp.ebpf_mut(), name), frame)
}

fn run_classifier(prog: &mut aya::programs::SchedClassifier, frame: &[u8]) -> Output {
    let mut out = vec![0u8; frame.len() + 512];
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), repeat: 1, ..Default::default() };
    let res = prog.test_run(opts).unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN with a {}-byte frame: {e:?}", frame.len()));
    out.truncate(res.data_size_out as usize);
    Output { action: res.return_value as i32, frame: out }
}

/// Packets counted per reason, summed over CPUs.
pub fn counters(dp: &mut EbpfDataplane) -> BTreeMap<&'static str, u64> {
    let map = dp.ebpf_mut().map(map_names::STATS).expect("stats map");
    let stats = PerCpuArray::<_, Counter>::try_from(map).expect("stats is a per-CPU array");
    Reason::ALL
        .iter()
        .filter_map(|r| {
            let per_cpu = stats.get(&(*r as u32), 0).ok()?;
            let n: u64 = per_cpu.iter().map(|c| c.packets).sum();
            (n > 0).then_some((r.label(), n))
        })
        .collect()
}

pub fn conntrack(dp: &mut EbpfDataplane) -> Vec<(CtKey, CtEntry)> {
    let map = dp.ebpf_mut().map(map_names::CT).expect("ct map");
    let ct = HashMap::<_, CtKey, CtEntry>::try_from(map).expect("ct is a hash map");
    ct.iter().map(|e| e.expect("ct entry")).collect()
}

/// A descriptor of the loaded object's map `name` (an array or a hash map), of its own: for a
/// thread that works on the map beside the test's packets.
pub fn map_fd(dp: &mut EbpfDataplane, name: &str) -> std::os::fd::OwnedFd {
    use std::os::fd::AsFd;
    match dp.ebpf_mut().map(name) {
        Some(aya::maps::Map::Array(m) | aya::maps::Map::LruHashMap(m) | aya::maps::Map::HashMap(m)) => {
            m.fd().as_fd().try_clone_to_owned().expect("dup a map descriptor")
        }
        _ => panic!("no array or hash map {name}"),
    }
}

/// A map of the loaded programs by its kernel name, opened afresh (for maps the agent's writer
/// owns, which tests poke at to simulate what the writer would never do).
pub fn map_by_name(dp: &mut EbpfDataplane, name: &str) -> aya::maps::MapData {
    let mut ids = dp.ingress_program().info().expect("program info").map_ids().expect("map ids").unwrap_or_default();
    ids.extend(dp.ext_ingress_program().info().expect("program info").map_ids().expect("map ids").unwrap_or_default());
    ids.into_iter()
        .map(|id| aya::maps::MapData::from_id(id).expect("open map by id"))
        .find(|m| m.info().ok().and_then(|i| i.name_as_str().map(|n| n == name)).unwrap_or(false))
        .unwrap_or_else(|| panic!("no map named {name}"))
}

pub const XDP_DROP: i32 = 1;
pub const XDP_PASS: i32 = 2;
pub const XDP_TX: i32 = 3;
pub const XDP_REDIRECT: i32 = 4;

/// Runs a frame arriving on external interface `ifindex` through the TC external ingress
/// program (FIB lookups use the calling thread's network namespace).
pub fn run_ext(dp: &mut EbpfDataplane, frame: &[u8], ifindex: u32) -> Output {
    run_on(dp.ext_ingress_program(), frame, ifindex)
}

/// Runs a frame leaving by interface `ifindex` through the TC egress program, as a packet of
/// the node's own (BPF_PROG_TEST_RUN gives every skb a socket).
pub fn run_egress_on(dp: &mut EbpfDataplane, frame: &[u8], ifindex: u32) -> Output {
    run_on(dp.egress_program(), frame, ifindex)
}

fn run_on(prog: &mut aya::programs::SchedClassifier, frame: &[u8], ifindex: u32) -> Output {
    let mut out = vec![0u8; frame.len() + 512];
    // `struct __sk_buff` up to `ifindex`: ingress_ifindex at 36, ifindex at 40.
    let mut ctx = [0u8; 44];
    ctx[36..40].copy_from_slice(&ifindex.to_ne_bytes());
    ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), ctx_in: Some(&ctx), repeat: 1, ..Default::default() };
    let res = prog.test_run(opts).unwrap_or_else(|e| panic!("test run on interface {ifindex}: {e:?}"));
    out.truncate(res.data_size_out as usize);
    Output { action: res.return_value as i32, frame: out }
}

/// Runs a frame arriving on external interface `ifindex` through the XDP program.
pub fn run_xdp(dp: &mut EbpfDataplane, frame: &[u8], ifindex: u32) -> Output {
    let mut out = vec![0u8; frame.len() + 512];
    let ctx = xdp_md(frame.len(), ifindex);
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), ctx_in: Some(&ctx), repeat: 1, ..Default::default() };
    let res = dp.xdp_program().test_run(opts).unwrap_or_else(|e| panic!("test run of XDP: {e:?}"));
    out.truncate(res.data_size_out as usize);
    Output { action: res.return_value as i32, frame: out }
}

/// The context of an XDP test run of a `len`-byte frame arriving on `ifindex`: `struct xdp_md`
/// (data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex).
pub fn xdp_md(len: usize, ifindex: u32) -> [u8; 24] {
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(len as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    ctx
}

/// Runs a `proxy-agent trace` packet (marked, arriving on loopback) through the external
/// ingress program and returns what it recorded: (reason, backend id).
pub fn run_trace(dp: &mut EbpfDataplane, frame: &[u8]) -> (Reason, u32) {
    let map = map_by_name(dp, map_names::TRACE);
    let trace = aya::maps::Array::<_, proxy_common::TraceResult>::try_from(aya::maps::Map::Array(map)).expect("trace map");
    let before = trace.get(&0, 0).expect("trace entry").seq;
    let mut out = vec![0u8; frame.len() + 512];
    let mut ctx = [0u8; 12];
    ctx[8..12].copy_from_slice(&proxy_common::TRACE_MARK.to_ne_bytes());
    let opts = TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), ctx_in: Some(&ctx), repeat: 1, ..Default::default() };
    dp.ext_ingress_program().test_run(opts).expect("trace test run");
    let r = trace.get(&0, 0).expect("trace entry");
    assert_eq!(r.seq, before.wrapping_add(1), "the program recorded the trace");
    (Reason::try_from(r.reason).expect("known reason"), r.backend_id)
}

/// Deletes every conntrack entry of both families behind the datapath's back, as an LRU
/// eviction would take them.
pub fn forget_conntrack(dp: &mut EbpfDataplane) {
    let keys: Vec<CtKey> = conntrack(dp).into_iter().map(|(k, _)| k).collect();
    let mut ct = HashMap::<_, CtKey, CtEntry>::try_from(dp.ebpf_mut().map_mut(map_names::CT).expect("ct map")).expect("a hash map");
    for k in keys {
        ct.remove(&k).expect("delete a conntrack entry");
    }
    let mut ct6 = HashMap::<_, CtKey<proxy_common::Ip6>, CtEntry<proxy_common::Ip6>>::try_from(
        dp.ebpf_mut().map_mut(map_names::CT6).expect("ct6 map"),
    )
    .expect("a hash map");
    let keys6: Vec<_> = ct6.keys().map(|k| k.expect("ct6 key")).collect();
    for k in keys6 {
        ct6.remove(&k).expect("delete a conntrack entry");
    }
}

/// Runs `f` with the conntrack entries of both families taken out of the maps behind the
/// datapath's back (as an LRU eviction would take them), then puts them back: a flow `f` sees
/// served was served from a flow cache.
pub fn without_conntrack<R>(dp: &mut EbpfDataplane, f: impl FnOnce(&mut EbpfDataplane) -> R) -> R {
    use proxy_common::Ip6;
    fn map<'a, A: aya::Pod>(dp: &'a mut EbpfDataplane, name: &str) -> HashMap<&'a mut aya::maps::MapData, CtKey<A>, CtEntry<A>>
    where
        CtKey<A>: aya::Pod,
        CtEntry<A>: aya::Pod,
    {
        HashMap::try_from(dp.ebpf_mut().map_mut(name).expect("conntrack map")).expect("a hash map")
    }
    let entries = conntrack(dp);
    let entries6: Vec<(CtKey<Ip6>, CtEntry<Ip6>)> = map::<Ip6>(dp, map_names::CT6).iter().map(|e| e.expect("ct6 entry")).collect();
    entries.iter().for_each(|(k, _)| map::<[u8; 4]>(dp, map_names::CT).remove(k).expect("take a conntrack entry out"));
    entries6.iter().for_each(|(k, _)| map::<Ip6>(dp, map_names::CT6).remove(k).expect("take a conntrack entry out"));
    let r = f(dp);
    entries.into_iter().for_each(|(k, e)| map::<[u8; 4]>(dp, map_names::CT).insert(k, e, 0).expect("put a conntrack entry back"));
    entries6.into_iter().for_each(|(k, e)| map::<Ip6>(dp, map_names::CT6).insert(k, e, 0).expect("put a conntrack entry back"));
    r
}

/// Runs `attempt` up to five times until it says it was not cut short by the end of a flow
/// cache's window (a window ends at most a second after it began; an attempt takes a few
/// milliseconds). The thread stays on one CPU meanwhile: the caches are per CPU, and a test
/// run runs where its caller does.
pub fn within_a_window(what: &str, mut attempt: impl FnMut() -> bool) {
    stay_on_this_cpu();
    assert!((0..5).any(|_| attempt()), "{what}: in five attempts the cache never served (or each met the end of a window)");
}

/// Keeps the calling thread on the CPU it runs on: a test run runs the program where its caller
/// does, and per-CPU state (the flow caches) is then the same from one run to the next.
pub fn stay_on_this_cpu() {
    // SAFETY: plain calls on this thread's own affinity, with a zeroed set of the size passed.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(libc::sched_getcpu() as usize, &mut set);
        assert_eq!(libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set), 0, "pin the thread to its CPU");
    }
}

/// Writes the two IPv4 conntrack entries the takeover writes for a connection it leaves to
/// netfilter (`ct::owner::NETFILTER`, at each of `tuples`, of protocol `proto`: the client's to
/// the Service, the backend's reply to the masquerading address), naming `backend` by
/// `backend_id`, last seen at `seen`, with their conntrack filter bits; the entry.
pub fn left_to_netfilter(
    dp: &mut EbpfDataplane,
    proto: u8,
    tuples: [(std::net::SocketAddrV4, std::net::SocketAddrV4); 2],
    backend: std::net::SocketAddrV4,
    backend_id: u32,
    seen: u64,
) -> CtEntry {
    use std::os::fd::AsFd;

    use proxy_common::ct;
    let e = CtEntry {
        last_seen_ns: seen,
        backend_id,
        flags: ct::flags::SEEN_REPLY,
        nat_addr: backend.ip().octets(),
        nat_port: backend.port().to_be_bytes(),
        owner: ct::owner::NETFILTER,
        ..Default::default()
    };
    let marker = proxy_agent::dataplane::ebpf::ct_filter::Marker::of(map_fd(dp, map_names::CT_FILTER).as_fd()).expect("the filter");
    let mut map: HashMap<_, CtKey, CtEntry> = HashMap::try_from(dp.ebpf_mut().map_mut(map_names::CT).expect("conntrack map")).unwrap();
    for (from, to) in tuples {
        let k = CtKey::new(from, to, proto);
        marker.mark(&k);
        map.insert(k, e, 0).expect("an entry left to netfilter");
    }
    e
}

/// Sets until when the takeover of the family of `slot` (`proxy_common::ct::ADOPTING_V4`, `_V6`) may
/// still adopt connections, as the agent's adoption does (0: none).
pub fn hold_adoption(dp: &mut EbpfDataplane, slot: u32, until: u64) {
    let mut map: aya::maps::Array<_, u64> =
        aya::maps::Array::try_from(dp.ebpf_mut().map_mut(map_names::ADOPTING).expect("the adoption's map")).unwrap();
    map.set(slot, until, 0).expect("the adoption's time");
}
