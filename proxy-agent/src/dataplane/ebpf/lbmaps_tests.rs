//! The map writer's transactions without a kernel: in-memory tables behind the `Table` seam
//! count every call, can fail any one of them, and after each call check what a packet could
//! see at that moment: a master's slots all there and naming set backends, its reverse NAT
//! there, the internal scope complete before an external master sends pods to it, source
//! ranges in before the master that turns them on.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    marker::PhantomData,
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

use aya::maps::{lpm_trie::Key, MapError};
use proxy_common::{
    filter, scope, svc_flags, AffinityMatchKey, Backend, BackendFlows, RevNat, ServiceKey, ServiceName, ServiceValue, SourceRangeKey,
};

use super::{Found, LbMaps, Tables};
use crate::{
    dataplane::ebpf::{maglev::Maglev, snapshot, tables::Table},
    model::{self, store::Cidr, Frontend, FrontendKey, FrontendKind, ObjectKey, Protocol, ServicePortName},
};

/// What the fake kernel holds, and what happened to it.
#[derive(Default)]
struct Kernel {
    services: BTreeMap<ServiceKey, ServiceValue>,
    backends: BTreeMap<u32, Backend>,
    revnat: BTreeMap<u32, RevNat>,
    names: BTreeMap<u32, ServiceName>,
    flows: BTreeMap<u32, BackendFlows>,
    affinity: BTreeMap<(u32, u32, u8), u32>,
    /// (service id, prefix length, address).
    ranges: BTreeMap<(u32, u32, [u8; 4]), u8>,
    /// The frontend filter's words (an array: a missing word is unset).
    filter: BTreeMap<u32, u64>,
    calls: usize,
    /// The call (counted from 1) that fails, with E2BIG as a full map answers.
    fail_at: Option<usize>,
    /// Every call from `fail_at` on fails: the agent was killed there.
    killed: bool,
    /// What a packet could have seen wrong, after which call.
    broken: Vec<String>,
}

type Shared = Arc<Mutex<Kernel>>;

impl Kernel {
    fn call(&mut self) -> Result<(), MapError> {
        self.calls += 1;
        if self.fail_at == Some(self.calls) || (self.killed && self.fail_at.is_some_and(|at| self.calls >= at)) {
            return Err(MapError::SyscallError(aya::sys::SyscallError {
                call: "bpf",
                io_error: io::Error::from_raw_os_error(libc::E2BIG),
            }));
        }
        Ok(())
    }

    /// The datapath's view after a call: every master names only what is there.
    fn check(&mut self, after: &str) {
        let mut wrong = Vec::new();
        for (k, m) in self.services.iter().filter(|(k, _)| k.slot == 0) {
            for slot in 1..=m.count {
                match self.services.get(&k.with_slot(slot)) {
                    None => wrong.push(format!("{k:?}: slot {slot} of {} missing", m.count)),
                    Some(v) if !self.backends.contains_key(&v.backend_id) => {
                        wrong.push(format!("{k:?}: slot {slot} names unset backend {}", v.backend_id))
                    }
                    Some(_) => {}
                }
            }
            if !self.revnat.contains_key(&m.service_id) {
                wrong.push(format!("{k:?}: no reverse NAT for service {}", m.service_id));
            }
            if m.flags & svc_flags::TWO_SCOPES != 0 {
                let mut internal = *k;
                internal.scope = scope::INTERNAL;
                if !self.services.contains_key(&internal) {
                    wrong.push(format!("{k:?}: two scopes, no internal master"));
                }
            }
            if m.flags & svc_flags::SOURCE_RANGES != 0 && !self.ranges.keys().any(|(id, _, _)| *id == m.service_id) {
                wrong.push(format!("{k:?}: source ranges on, none in the trie"));
            }
            let (word, bit) = filter::place(k.addr, k.port, k.proto);
            if self.filter.get(&word).is_none_or(|w| w & bit == 0) {
                wrong.push(format!("{k:?}: its frontend filter bit is clear"));
            }
        }
        self.broken.extend(wrong.into_iter().map(|w| format!("after {after} (call {}): {w}", self.calls)));
    }
}

/// One fake map: entries of `K` stored under `S` in one of the kernel's tables.
struct Fake<K, V, S> {
    kernel: Shared,
    table: fn(&mut Kernel) -> &mut BTreeMap<S, V>,
    key: fn(&K) -> S,
    /// An array: deleting sets the entry unset and never fails.
    array: bool,
    name: &'static str,
    _k: PhantomData<fn(&K)>,
}

impl<K, V: Copy + Send, S: Ord + Send> Table<K, V> for Fake<K, V, S> {
    fn put(&mut self, key: &K, value: &V) -> Result<(), MapError> {
        let mut k = self.kernel.lock().unwrap();
        k.call()?;
        (self.table)(&mut k).insert((self.key)(key), *value);
        k.check(&format!("put {}", self.name));
        Ok(())
    }

    fn del(&mut self, key: &K) -> Result<(), MapError> {
        let mut k = self.kernel.lock().unwrap();
        k.call()?;
        let gone = (self.table)(&mut k).remove(&(self.key)(key)).is_some();
        k.check(&format!("del {}", self.name));
        if gone || self.array {
            Ok(())
        } else {
            Err(MapError::KeyNotFound)
        }
    }

    fn count(&self) -> io::Result<u64> {
        Ok((self.table)(&mut self.kernel.lock().unwrap()).len() as u64)
    }
}

fn fake<K: 'static, V: Copy + Send + 'static, S: Ord + Send + 'static>(
    kernel: &Shared,
    name: &'static str,
    table: fn(&mut Kernel) -> &mut BTreeMap<S, V>,
    key: fn(&K) -> S,
    array: bool,
) -> Box<dyn Table<K, V>> {
    Box::new(Fake { kernel: kernel.clone(), table, key, array, name, _k: PhantomData })
}

fn tables(kernel: &Shared) -> Tables {
    Tables {
        services: fake(kernel, "services", |k| &mut k.services, |k| *k, false),
        backends: fake(kernel, "backends", |k| &mut k.backends, |k| *k, true),
        revnat: fake(kernel, "revnat", |k| &mut k.revnat, |k| *k, false),
        names: fake(kernel, "names", |k| &mut k.names, |k| *k, false),
        flows: fake(kernel, "flows", |k| &mut k.flows, |k| *k, true),
        affinity_match: fake(kernel, "affinity", |k| &mut k.affinity, |k: &AffinityMatchKey| (k.service_id, k.backend_id, k.scope), false),
        source_ranges: fake(
            kernel,
            "source ranges",
            |k| &mut k.ranges,
            |k: &Key<SourceRangeKey>| (k.data().service_id, k.prefix_len(), k.data().addr),
            false,
        ),
        filter: fake(kernel, "filter", |k| &mut k.filter, |k| *k, true),
    }
}

const LIMIT: u32 = 64;
const MAGLEV_SIZE: u32 = 31;

/// A writer over a fresh fake kernel.
fn writer() -> (LbMaps, Shared) {
    let kernel = Shared::default();
    let lb = LbMaps::with_found(tables(&kernel), Maglev::in_memory(MAGLEV_SIZE, LIMIT), LIMIT, Found::default()).expect("writer");
    (lb, kernel)
}

/// A writer adopting what `kernel` holds, as a restarted agent does.
fn restarted(kernel: &Shared) -> LbMaps {
    let found = {
        let k = kernel.lock().unwrap();
        let top = k.backends.keys().max().copied().unwrap_or(0);
        let backends = (0..=top).map(|i| Ok(k.backends.get(&i).copied().unwrap_or_default()));
        let snapshot = snapshot::assemble(
            k.services.iter().map(|(a, b)| Ok((*a, *b))),
            backends,
            k.revnat.iter().map(|(a, b)| Ok((*a, *b))),
            k.names.iter().map(|(a, b)| Ok((*a, *b))),
        )
        .expect("snapshot");
        Found {
            snapshot,
            affinity_matches: k
                .affinity
                .keys()
                .map(|(service_id, backend_id, scope)| AffinityMatchKey {
                    service_id: *service_id,
                    backend_id: *backend_id,
                    scope: *scope,
                    _pad: 0,
                    _pad2: 0,
                })
                .collect(),
            source_ranges: k
                .ranges
                .keys()
                .map(|(service_id, prefix, addr)| Key::new(*prefix, SourceRangeKey { service_id: *service_id, addr: *addr }))
                .collect(),
            filter: (0..filter::WORDS).map(|w| k.filter.get(&w).copied().unwrap_or(0)).collect(),
        }
    };
    LbMaps::with_found(tables(kernel), Maglev::in_memory(MAGLEV_SIZE, LIMIT), LIMIT, found).expect("adopting writer")
}

fn backend(last: u8) -> model::Backend {
    model::Backend { addr: Ipv4Addr::new(10, 244, 0, last).into(), port: 8080, terminating: false, local: false }
}

fn frontend(kind: FrontendKind, backends: &[u8]) -> Frontend {
    let name = ServicePortName { service: ObjectKey::new("default", "web"), port: "http".into(), protocol: Protocol::Tcp };
    Frontend::new(name, kind, backends.iter().map(|b| backend(*b)).collect())
}

fn cluster_ip() -> FrontendKey {
    FrontendKey { addr: Ipv4Addr::new(10, 96, 0, 10).into(), port: 80, protocol: Protocol::Tcp }
}

fn load_balancer() -> FrontendKey {
    FrontendKey { addr: Ipv4Addr::new(192, 0, 2, 10).into(), port: 80, protocol: Protocol::Tcp }
}

/// The states a ClusterIP frontend goes through: grow, replace, shrink, empty, affinity,
/// terminating endpoints kept, and back.
fn cluster_ip_states() -> Vec<Frontend> {
    let mut affinity = frontend(FrontendKind::ClusterIp, &[1, 2]);
    affinity.affinity_timeout = Some(10800);
    let mut retained = frontend(FrontendKind::ClusterIp, &[2]);
    retained.retained = vec![backend(1), backend(3)];
    vec![
        frontend(FrontendKind::ClusterIp, &[1, 2, 3]),
        frontend(FrontendKind::ClusterIp, &[2, 3, 4, 5]),
        frontend(FrontendKind::ClusterIp, &[5]),
        frontend(FrontendKind::ClusterIp, &[]),
        affinity,
        retained,
        frontend(FrontendKind::ClusterIp, &[1, 2, 3]),
    ]
}

/// The states of a load-balancer frontend with externalTrafficPolicy Local (two scopes) and
/// source ranges: Maglev on the external scope.
fn load_balancer_states() -> Vec<Frontend> {
    let state = |local: &[u8], all: &[u8], ranges: &[&str]| {
        let mut f = frontend(FrontendKind::LoadBalancer, local);
        f.internal_backends = Some(all.iter().map(|b| backend(*b)).collect());
        f.source_ranges = ranges.iter().map(|r| r.parse::<Cidr>().expect("range")).collect();
        f.drop_when_empty = true;
        f
    };
    // ClientIP affinity: its matches are written after the ranges, so a full affinity map
    // makes the ranges' undo run.
    let mut affinity = state(&[1, 4], &[1, 2, 3, 4], &["203.0.113.0/24", "198.51.100.0/24"]);
    affinity.affinity_timeout = Some(10800);
    // Affinity again after a state without a Maglev table: its matches, written after the
    // table, failing leave the table to the undo.
    let mut affinity_after_none = state(&[3], &[2, 3], &[]);
    affinity_after_none.affinity_timeout = Some(60);
    vec![
        state(&[1], &[1, 2, 3], &["203.0.113.0/24"]),
        affinity,
        state(&[], &[2, 3], &["198.51.100.0/24"]),
        affinity_after_none,
        frontend(FrontendKind::LoadBalancer, &[2, 3]),
        state(&[2], &[2, 3], &["203.0.113.0/24"]),
    ]
}

/// What the kernel holds, without ids (which differ between runs): per master, its count,
/// flags and the backends its slots name; the reverse NAT; and how many entries each other
/// map holds.
fn picture(kernel: &Shared) -> String {
    let k = kernel.lock().unwrap();
    let mut out = String::new();
    for (key, m) in k.services.iter().filter(|(k, _)| k.slot == 0) {
        let named: BTreeSet<String> = (1..=m.count)
            .filter_map(|s| k.services.get(&key.with_slot(s)))
            .filter_map(|v| k.backends.get(&v.backend_id))
            .map(|b| format!("{}:{}", Ipv4Addr::from(b.addr), u16::from_be_bytes(b.port)))
            .collect();
        let rn = k.revnat.get(&m.service_id).map(|r| format!("{}:{}", Ipv4Addr::from(r.addr), u16::from_be_bytes(r.port)));
        let ranges: Vec<_> =
            k.ranges.keys().filter(|(id, _, _)| *id == m.service_id).map(|(_, p, a)| (Ipv4Addr::from(*a), p - 32)).collect();
        let matches = k.affinity.keys().filter(|(id, _, _)| *id == m.service_id).count();
        out += &format!(
            "{}:{} scope {} count {} flags {:#x} affinity {} -> {named:?} revnat {rn:?} ranges {ranges:?} matches {matches}\n",
            Ipv4Addr::from(key.addr),
            u16::from_be_bytes(key.port),
            key.scope,
            m.count,
            m.flags,
            m.affinity_timeout,
        );
    }
    out += &format!(
        "entries: services {} backends {} revnat {} names {} affinity {} ranges {} filter bits {:?}\n",
        k.services.len(),
        k.backends.len(),
        k.revnat.len(),
        k.names.len(),
        k.affinity.len(),
        k.ranges.len(),
        filter_bits(&k),
    );
    out
}

/// The set bits of the frontend filter.
fn filter_bits(k: &Kernel) -> Vec<u32> {
    k.filter.iter().flat_map(|(w, v)| (0..64).filter(move |i| v & 1 << i != 0).map(move |i| w * 64 + i)).collect()
}

fn broken(kernel: &Shared) -> Vec<String> {
    std::mem::take(&mut kernel.lock().unwrap().broken)
}

fn empty(kernel: &Shared) -> bool {
    let k = kernel.lock().unwrap();
    k.services.is_empty()
        && k.backends.is_empty()
        && k.revnat.is_empty()
        && k.names.is_empty()
        && k.affinity.is_empty()
        && k.ranges.is_empty()
        && filter_bits(&k).is_empty()
}

/// Every state of both frontends in turn, then their removal: after every single call the
/// datapath's view holds, each state is current once written, and nothing is left at the end.
#[test]
fn every_call_of_every_change_leaves_a_view_packets_can_use() {
    let (mut lb, kernel) = writer();
    for (key, states) in [(cluster_ip(), cluster_ip_states()), (load_balancer(), load_balancer_states())] {
        for (i, fe) in states.iter().enumerate() {
            lb.upsert(&key, fe).unwrap_or_else(|e| panic!("{key} state {i}: {e}"));
            assert!(lb.is_current(&key, fe), "{key} state {i} is current once written");
            assert_eq!(broken(&kernel), Vec::<String>::new(), "{key} state {i}");
            let k = kernel.lock().unwrap();
            let referenced =
                fe.backends.iter().chain(&fe.retained).chain(fe.internal_backends.iter().flatten()).collect::<BTreeSet<_>>().len();
            assert_eq!(k.backends.len(), referenced, "{key} state {i}: exactly the backends in use are set");
        }
        lb.remove(&key).expect("remove");
        assert_eq!(broken(&kernel), Vec::<String>::new(), "{key} removed");
    }
    lb.collect_garbage().expect("garbage");
    assert!(empty(&kernel) && lb.maglev().tables.is_empty(), "nothing left:\n{}", picture(&kernel));
    assert_eq!(lb.service_entries(), 0);
}

/// Each call of each change fails in turn (with E2BIG, as a full map answers), either alone
/// or with every call after it (then the undo fails too). The failed change leaves a view
/// packets can use and is not taken as current; the next attempt reaches the same maps as a
/// change that never failed, and removal then leaves nothing; so does removing the Service
/// instead of trying the change again.
#[test]
fn a_failure_at_any_call_is_undone_or_finished_by_the_next_sync() {
    for (key, states) in [(cluster_ip(), cluster_ip_states()), (load_balancer(), load_balancer_states())] {
        for step in 0..states.len() {
            let earlier = || {
                let (mut lb, kernel) = writer();
                for fe in &states[..step] {
                    lb.upsert(&key, fe).expect("earlier state");
                }
                (lb, kernel)
            };
            // Calls the change makes when nothing fails, and the maps it leaves.
            let (mut lb, kernel) = earlier();
            let before = kernel.lock().unwrap().calls;
            lb.upsert(&key, &states[step]).expect("the change");
            let calls = kernel.lock().unwrap().calls - before;
            let want = picture(&kernel);
            for (fail, onwards) in (1..=calls).flat_map(|f| [(f, false), (f, true)]) {
                let context =
                    format!("{key} state {step}, call {fail} of {calls} failing{}", if onwards { " and every one after" } else { "" });
                let attempt = |lb: &mut LbMaps, kernel: &Shared| {
                    {
                        let mut k = kernel.lock().unwrap();
                        k.fail_at = Some(k.calls + fail);
                        k.killed = onwards;
                    }
                    let result = lb.upsert(&key, &states[step]);
                    let mut k = kernel.lock().unwrap();
                    k.fail_at = None;
                    k.killed = false;
                    result
                };
                let (mut lb, kernel) = earlier();
                let failed = attempt(&mut lb, &kernel);
                assert_eq!(broken(&kernel), Vec::<String>::new(), "{context}");
                // A change that fails is reported and not taken as done. (One that succeeds
                // while a clean-up after it failed leaves that to the next sync or to garbage
                // collection.)
                if failed.is_err() {
                    assert!(!lb.is_current(&key, &states[step]), "{context}: a failed change is not current");
                }
                lb.upsert(&key, &states[step]).unwrap_or_else(|e| panic!("{context}: the retry: {e}"));
                assert_eq!(broken(&kernel), Vec::<String>::new(), "{context}: the retry");
                assert!(lb.is_current(&key, &states[step]), "{context}");
                lb.collect_garbage().expect("garbage");
                assert_eq!(picture(&kernel), want, "{context}: the retry reaches the same maps");
                lb.remove(&key).expect("remove");
                lb.collect_garbage().expect("garbage");
                assert!(empty(&kernel) && lb.maglev().tables.is_empty(), "{context}: nothing left after removal:\n{}", picture(&kernel));

                let (mut lb, kernel) = earlier();
                let _ = attempt(&mut lb, &kernel);
                lb.remove(&key).unwrap_or_else(|e| panic!("{context}: removal after the failure: {e}"));
                lb.collect_garbage().expect("garbage");
                assert_eq!(broken(&kernel), Vec::<String>::new(), "{context}: removal after the failure");
                assert!(
                    empty(&kernel) && lb.maglev().tables.is_empty(),
                    "{context}: nothing left after a removal instead of the retry:\n{}",
                    picture(&kernel)
                );
            }
        }
    }
}

/// A restart after a change died half way (the agent killed at any call): the new writer
/// adopts what it finds, packets keep a usable view, the next sync finishes the change, and
/// garbage collection leaves exactly what the frontend uses.
#[test]
fn a_restart_after_a_change_died_at_any_call_converges() {
    let key = cluster_ip();
    let states = cluster_ip_states();
    for step in 1..states.len() {
        let (mut lb, kernel) = writer();
        lb.upsert(&key, &states[step - 1]).expect("earlier state");
        let before = kernel.lock().unwrap().calls;
        lb.upsert(&key, &states[step]).expect("the change");
        let calls = kernel.lock().unwrap().calls - before;
        let want = picture(&kernel);
        for fail in 1..=calls {
            let (mut lb, kernel) = writer();
            lb.upsert(&key, &states[step - 1]).expect("earlier state");
            // The agent dies at this call: nothing after it happens.
            let at = kernel.lock().unwrap().calls + fail;
            {
                let mut k = kernel.lock().unwrap();
                k.fail_at = Some(at);
                k.killed = true;
            }
            let _ = lb.upsert(&key, &states[step]);
            drop(lb);
            {
                let mut k = kernel.lock().unwrap();
                k.fail_at = None;
                k.killed = false;
            }
            let context = format!("state {step}, killed at call {fail} of {calls}");
            assert_eq!(broken(&kernel), Vec::<String>::new(), "{context}");
            let mut lb = restarted(&kernel);
            lb.upsert(&key, &states[step]).unwrap_or_else(|e| panic!("{context}: the first sync: {e}"));
            lb.collect_garbage().expect("garbage");
            assert_eq!(broken(&kernel), Vec::<String>::new(), "{context}: after the restart");
            assert_eq!(picture(&kernel), want, "{context}: the restart reaches the same maps");
            assert!(lb.is_current(&key, &states[step]), "{context}");
        }
    }
}

/// A restart with nothing changed rewrites nothing.
#[test]
fn a_restart_adopts_the_maps_without_a_write() {
    let (mut lb, kernel) = writer();
    let fe = frontend(FrontendKind::ClusterIp, &[1, 2, 3]);
    lb.upsert(&cluster_ip(), &fe).expect("upsert");
    let calls = kernel.lock().unwrap().calls;
    let lb = restarted(&kernel);
    assert!(lb.is_current(&cluster_ip(), &fe));
    assert_eq!(lb.service_entries(), 4);
    assert_eq!(kernel.lock().unwrap().calls, calls, "adopting writes nothing");
}

/// Pinned maps holding one backend under two ids (left by an interrupted older run): the
/// unused id is collected, and the frontend's own stays known, so the next sync writes nothing.
#[test]
fn a_backend_pinned_under_two_ids_keeps_the_one_in_use() {
    let (mut lb, kernel) = writer();
    let fe = frontend(FrontendKind::ClusterIp, &[1]);
    lb.upsert(&cluster_ip(), &fe).expect("upsert");
    {
        let mut k = kernel.lock().unwrap();
        let (&used, &entry) = k.backends.iter().next().expect("one backend");
        for spare in [used.saturating_sub(1).max(1), used + 1].into_iter().filter(|id| *id != used) {
            k.backends.insert(spare, entry);
        }
        assert_eq!(k.backends.len(), if used > 1 { 3 } else { 2 });
    }
    let mut lb = restarted(&kernel);
    lb.collect_garbage().expect("garbage");
    assert_eq!(kernel.lock().unwrap().backends.len(), 1, "the spare ids are removed:\n{}", picture(&kernel));
    assert!(lb.is_current(&cluster_ip(), &fe), "the frontend's backend is still known by its id");
    let calls = kernel.lock().unwrap().calls;
    lb.upsert(&cluster_ip(), &fe).expect("upsert");
    lb.collect_garbage().expect("garbage");
    assert_eq!(kernel.lock().unwrap().calls, calls, "nothing to write");
}

/// Each call of a removal fails in turn: packets keep a usable view, and the next attempt
/// removes everything.
#[test]
fn a_failure_at_any_call_of_a_removal_is_finished_by_the_next_attempt() {
    for (key, states) in [(cluster_ip(), cluster_ip_states()), (load_balancer(), load_balancer_states())] {
        for (step, fe) in states.iter().enumerate() {
            let (mut lb, kernel) = writer();
            lb.upsert(&key, fe).expect("state");
            let before = kernel.lock().unwrap().calls;
            lb.remove(&key).expect("removal");
            let calls = kernel.lock().unwrap().calls - before;
            for fail in 1..=calls {
                let (mut lb, kernel) = writer();
                lb.upsert(&key, fe).expect("state");
                let at = kernel.lock().unwrap().calls + fail;
                kernel.lock().unwrap().fail_at = Some(at);
                let _ = lb.remove(&key);
                kernel.lock().unwrap().fail_at = None;
                let context = format!("{key} state {step}, call {fail} of {calls} of the removal failing");
                assert_eq!(broken(&kernel), Vec::<String>::new(), "{context}");
                lb.remove(&key).unwrap_or_else(|e| panic!("{context}: the retry: {e}"));
                lb.collect_garbage().expect("garbage");
                assert!(empty(&kernel) && lb.maglev().tables.is_empty(), "{context}: nothing left:\n{}", picture(&kernel));
                assert_eq!(lb.service_entries(), 0, "{context}");

                // Or the Service comes back before the removal is tried again: it is written
                // whole, not taken as still there.
                let (mut lb, kernel) = writer();
                lb.upsert(&key, fe).expect("state");
                let want = picture(&kernel);
                let at = kernel.lock().unwrap().calls + fail;
                kernel.lock().unwrap().fail_at = Some(at);
                let _ = lb.remove(&key);
                kernel.lock().unwrap().fail_at = None;
                lb.upsert(&key, fe).unwrap_or_else(|e| panic!("{context}: written again: {e}"));
                lb.collect_garbage().expect("garbage");
                assert_eq!(broken(&kernel), Vec::<String>::new(), "{context}: written again");
                assert!(lb.is_current(&key, fe), "{context}: written again");
                assert_eq!(picture(&kernel), want, "{context}: written again, the maps are the state's");
            }
        }
    }
}

/// A backend entry leaving the maps, or a reverse NAT entry written or deleted, moves
/// `entries_changed` on (the flow caches' steps of tracked flows read those two maps besides the
/// flow's own entry: the agent then moves the flow cache's generation on); writes that change
/// neither leave it.
#[test]
fn changing_what_a_tracked_flows_step_reads_is_counted() {
    let held = |kernel: &Shared| {
        let k = kernel.lock().unwrap();
        (k.backends.iter().map(|(i, b)| (*i, *b)).collect::<Vec<_>>(), k.revnat.iter().map(|(i, r)| (*i, *r)).collect::<Vec<_>>())
    };
    for (key, states) in [(cluster_ip(), cluster_ip_states()), (load_balancer(), load_balancer_states())] {
        let (mut lb, kernel) = writer();
        // A second frontend shares the backends: removing the first deletes its reverse NAT
        // entry and none of them.
        let other = FrontendKey { port: 8443, ..key };
        for (step, fe) in states.iter().chain([&states[0]]).enumerate() {
            let (before, count) = (held(&kernel), lb.entries_changed());
            lb.upsert(&key, fe).expect("state");
            lb.upsert(&other, fe).expect("state");
            let after = held(&kernel);
            let changed = before.0.iter().any(|b| !after.0.contains(b)) || before.1 != after.1;
            assert_eq!(lb.entries_changed() > count, changed, "{key} state {step}: {before:?} -> {after:?}");
        }
        let count = lb.entries_changed();
        let backends = held(&kernel).0;
        lb.remove(&key).expect("removal");
        assert_eq!(held(&kernel).0, backends, "{key}: the backends stay, the other frontend's");
        assert!(lb.entries_changed() > count, "{key}: the removal's reverse NAT entry counted");
    }
}

/// One Service may take half of a map (`LbMaps::admit`): masters and slots of every scope of
/// every frontend it has in the services map, its distinct backends (terminating ones kept for
/// their flows included) in the backend map, its source ranges in the trie.
#[test]
fn one_service_may_take_half_of_a_map() {
    use crate::dataplane::DataplaneError;
    let (lb, _) = writer();
    let ports = |n: u16, backends: &[u8]| -> Vec<(FrontendKey, Frontend)> {
        (0..n).map(|i| (FrontendKey { port: 80 + i, ..cluster_ip() }, frontend(FrontendKind::ClusterIp, backends))).collect()
    };
    let admit = |fes: &[(FrontendKey, Frontend)]| lb.admit(fes.iter().map(|(k, f)| (1, k, f)));
    let refused = |fes: &[(FrontendKey, Frontend)]| match admit(fes) {
        Err(DataplaneError::TooLarge { map, need, max }) => (map, need, max),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let many: Vec<u8> = (1..=32).collect();
    // 31 backends: a master and 31 slots, half of the 64.
    admit(&ports(1, &many[..31])).expect("half fits");
    assert_eq!(refused(&ports(1, &many)), (proxy_common::map_names::SERVICES, 33, LIMIT));
    // Four ports of the same 7 pods: 4 x 8 entries; a fifth is too many, though the pods are shared.
    admit(&ports(4, &many[..7])).expect("4 x 8 fits");
    assert_eq!(refused(&ports(5, &many[..7])).1, 40);
    // Terminating endpoints kept for their flows take backend entries, not slots.
    let mut fe = frontend(FrontendKind::ClusterIp, &many[..10]);
    fe.retained = (11..=33).map(backend).collect();
    assert_eq!(refused(&[(cluster_ip(), fe.clone())]), (proxy_common::map_names::BACKENDS, 33, LIMIT));
    fe.retained.pop();
    admit(&[(cluster_ip(), fe)]).expect("32 backends fit");
    // An external frontend's internal scope counts too.
    let mut lbfe = frontend(FrontendKind::LoadBalancer, &many[..10]);
    lbfe.internal_backends = Some(many[..20].iter().map(|b| backend(*b)).collect());
    admit(&[(load_balancer(), lbfe.clone())]).expect("11 + 21 entries fit");
    lbfe.internal_backends.as_mut().unwrap().push(backend(21));
    assert_eq!(refused(&[(load_balancer(), lbfe)]).1, 33);
    // loadBalancerSourceRanges take an entry each in the trie, per load-balancer frontend.
    let mut ranged = frontend(FrontendKind::LoadBalancer, &[1]);
    ranged.source_ranges = (0..16).map(|i| format!("192.0.{i}.0/24").parse().unwrap()).collect();
    let two = [(load_balancer(), ranged.clone()), (FrontendKey { port: 443, ..load_balancer() }, ranged.clone())];
    admit(&two).expect("2 x 16 ranges fit");
    ranged.source_ranges.push("198.51.100.0/24".parse().unwrap());
    let two = [(load_balancer(), ranged.clone()), (FrontendKey { port: 443, ..load_balancer() }, ranged)];
    assert_eq!(refused(&two), (proxy_common::map_names::SOURCE_RANGES, 34, LIMIT));
}

/// `demand` counts what the writer then holds in the kernel's maps, for a Service of every
/// kind of frontend: a cluster IP, a load balancer with an internal scope and source ranges,
/// terminating endpoints kept, duplicates.
#[test]
fn the_demand_of_a_service_is_what_its_frontends_take() {
    let (mut lb, kernel) = writer();
    let mut cip = frontend(FrontendKind::ClusterIp, &[1, 2, 3, 3]);
    cip.retained = vec![backend(4), backend(5)];
    let mut lbfe = frontend(FrontendKind::LoadBalancer, &[1, 2]);
    lbfe.internal_backends = Some(vec![backend(1), backend(2), backend(6)]);
    lbfe.retained = vec![backend(7)];
    lbfe.source_ranges = vec!["10.0.0.0/8".parse().unwrap(), "10.0.0.1/8".parse().unwrap(), "192.0.2.0/24".parse().unwrap()];
    let http = FrontendKey { port: 443, ..load_balancer() };
    let fes = [(cluster_ip(), cip), (load_balancer(), lbfe.clone()), (http, lbfe)];
    for (key, fe) in &fes {
        lb.upsert(key, fe).expect("upsert");
    }
    let k = kernel.lock().unwrap();
    let held = super::Demand { services: k.services.len(), backends: k.backends.len(), source_ranges: k.ranges.len() };
    assert_eq!(held, super::Demand { services: 4 + 2 * (3 + 4), backends: 7, source_ranges: 4 });
    assert_eq!(<LbMaps>::demand(fes.iter().map(|(k, f)| (1, k, f))), held);
    // A frontend at n addresses (a group) takes n times its entries, and its backends once.
    let (key, fe) = &fes[1];
    assert_eq!(<LbMaps>::demand([(1000, key, fe)]), super::Demand { services: 7000, backends: 4, source_ranges: 2000 });
}

#[test]
fn a_frontends_entries_are_its_masters_and_slots() {
    let (mut lb, kernel) = writer();
    let mut lbfe = frontend(FrontendKind::LoadBalancer, &[1, 2]);
    lbfe.internal_backends = Some(vec![backend(1), backend(2), backend(3)]);
    lb.upsert(&load_balancer(), &lbfe).expect("upsert");
    assert_eq!(lb.entries_of(&load_balancer()), 3 + 4);
    assert_eq!(kernel.lock().unwrap().services.len(), 7, "as the kernel holds them");
    assert_eq!(lb.entries_of(&cluster_ip()), 0);
}
