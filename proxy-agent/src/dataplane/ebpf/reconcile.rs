//! Diffs what the store wants against what the dataplane holds, one Service at a time.
//!
//! The first sync after start waits until every source has listed everything, then compares
//! against what a previous run left pinned: unchanged frontends are not touched (established
//! connections keep their backends), changed ones are updated, stale ones removed.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    time::{Instant, SystemTime},
};

use crate::{
    dataplane::Dataplane,
    model::{
        store::{Event, Kind, Store},
        translate::HealthCheck,
        Frontend, FrontendKey, NodeInfo, ObjectKey,
    },
    sync::{PortState, SyncStats},
};

pub struct Reconciler<D> {
    pub store: Store,
    dp: D,
    required: Vec<Kind>,
    owners: HashMap<FrontendKey, ObjectKey>,
    /// The frontends each Service holds, sorted. (A Vec: nearly every Service holds one or two,
    /// and a BTreeSet's first node alone takes hundreds of bytes.)
    by_service: HashMap<ObjectKey, Vec<FrontendKey>>,
    /// Services that want a frontend another Service holds.
    contenders: HashMap<FrontendKey, BTreeSet<ObjectKey>>,
    /// The frontends each Service waits for (`contenders` the other way round): a Service that
    /// stops wanting them, or goes, stops waiting, instead of staying listed until the owner
    /// lets go (Services created and deleted in a loop piled up there).
    contending: HashMap<ObjectKey, Vec<FrontendKey>>,
    /// Frontends a previous run left, not yet claimed by a Service; cleared at the first sync.
    adopted: Option<BTreeSet<FrontendKey>>,
    retry: BTreeSet<ObjectKey>,
    /// Services waiting for a frontend another Service released during this sync: they take it
    /// before the sync ends, not at the next retry.
    released: BTreeSet<ObjectKey>,
    /// Trigger times of changes not programmed yet, per Service.
    triggers: BTreeMap<ObjectKey, Vec<SystemTime>>,
    /// Frontends the dataplane cannot express, with the reason last reported.
    unsupported: HashMap<FrontendKey, String>,
    /// Frontends whose programming fails for now (a full map, say), with the error last
    /// reported: a retry that fails alike says nothing more.
    failing: HashMap<FrontendKey, String>,
    /// Services refused whole (`Dataplane::admit`), with the map last reported too small.
    refused: HashMap<ObjectKey, &'static str>,
    /// A map newly found full in this sync, and the family of the frontend that found it: the
    /// largest Services are named at the sync's end.
    full_this_sync: Option<(&'static str, bool)>,
    /// Health-check node ports to serve, per Service.
    health_checks: BTreeMap<ObjectKey, HealthCheck>,
    /// `Store::cluster_ip_generation` the dataplane's cluster IP ranges were last written at.
    cluster_ips_written: Option<u64>,
    /// Writing them failed: retried at every sync, and a failure until then.
    cluster_ips_failed: bool,
}

impl<D: Dataplane> Reconciler<D> {
    /// `required`: the kinds that must be fully listed before anything is written.
    pub fn new(store: Store, dp: D, required: Vec<Kind>) -> Self {
        let adopted = dp.programmed_keys().into_iter().collect();
        Self {
            store,
            dp,
            required,
            owners: HashMap::new(),
            by_service: HashMap::new(),
            contenders: HashMap::new(),
            contending: HashMap::new(),
            adopted: Some(adopted),
            retry: BTreeSet::new(),
            released: BTreeSet::new(),
            triggers: BTreeMap::new(),
            unsupported: HashMap::new(),
            failing: HashMap::new(),
            refused: HashMap::new(),
            full_this_sync: None,
            health_checks: BTreeMap::new(),
            cluster_ips_written: None,
            cluster_ips_failed: false,
        }
    }

    /// Health-check node ports and what each should report (a port two Services claim goes
    /// to the first by name; the API server does not allow that anyway).
    pub fn health_checks(&self) -> BTreeMap<u16, PortState> {
        let mut out = BTreeMap::new();
        for h in self.health_checks.values() {
            out.entry(h.port).or_insert_with(|| PortState { service: h.service.clone(), local_endpoints: h.local_endpoints });
        }
        out
    }

    pub fn dataplane(&self) -> &D {
        &self.dp
    }

    pub fn dataplane_mut(&mut self) -> &mut D {
        &mut self.dp
    }

    /// Feeds one source event to the store, logging what it reports.
    pub fn handle(&mut self, event: Event) {
        self.store.apply_logged(event);
    }

    /// Every required kind has been listed.
    pub fn ready(&self) -> bool {
        self.store.synced(&self.required)
    }

    pub fn has_failures(&self) -> bool {
        !self.retry.is_empty() || self.cluster_ips_failed
    }

    /// Services refused whole as too large for the maps (`refuse`), until they change to fit
    /// or go.
    pub fn refused(&self) -> usize {
        self.refused.len()
    }

    /// Programmed frontends and their Service, for diagnostics.
    pub fn owners(&self) -> BTreeMap<FrontendKey, ObjectKey> {
        self.owners.iter().map(|(k, v)| (*k, v.clone())).collect()
    }

    /// Applies every pending change. Does nothing until the sources are synced.
    pub fn sync(&mut self) -> Option<SyncStats> {
        if !self.ready() {
            return None;
        }
        let start = Instant::now();
        let mut stats = SyncStats::default();
        let taken = self.store.take_dirty();
        let mut dirty = taken.services;
        for (svc, times) in taken.trigger_times {
            self.triggers.entry(svc).or_default().extend(times);
        }
        dirty.append(&mut self.retry);
        stats.services = dirty.len();
        let node = self.store.node_info();
        for svc in dirty {
            if self.sync_service(&svc, &node, &mut stats) {
                stats.trigger_times.extend(self.triggers.remove(&svc).unwrap_or_default());
            }
        }
        // A Service waiting for a frontend that another released in this sync takes it now
        // (an owner recreated while a Service claiming its address still held it, whose
        // refusal comes later in the sync's order), not at the retry. A few passes at most:
        // what a pass releases waits for the next; what is left, for the retry.
        for _ in 0..4 {
            if self.released.is_empty() {
                break;
            }
            for svc in std::mem::take(&mut self.released) {
                if self.sync_service(&svc, &node, &mut stats) {
                    // It may have failed earlier in this sync.
                    self.retry.remove(&svc);
                    stats.trigger_times.extend(self.triggers.remove(&svc).unwrap_or_default());
                }
            }
        }
        self.retry.append(&mut self.released);
        if let Some((map, ipv6)) = self.full_this_sync.take() {
            self.name_the_largest(map, ipv6);
        }
        let generation = self.store.cluster_ip_generation();
        if self.cluster_ips_written != Some(generation) {
            let (cidrs, allocated) = self.store.cluster_ip_ranges();
            match self.dp.set_cluster_ip_ranges(&cidrs, &allocated) {
                Ok(()) => {
                    self.cluster_ips_written = Some(generation);
                    self.cluster_ips_failed = false;
                }
                // Retried at the next sync (a failure keeps syncs coming); the Services
                // themselves are programmed.
                Err(e) => {
                    if !self.cluster_ips_failed {
                        tracing::warn!(error = %e, "could not write the Service CIDRs; retrying");
                    }
                    self.cluster_ips_failed = true;
                }
            }
        }
        if let Some(adopted) = self.adopted.take() {
            stats.initial = true;
            for key in adopted.into_iter().filter(|k| !self.owners.contains_key(k)) {
                match self.dp.remove(&key) {
                    Ok(()) => stats.removed += 1,
                    Err(e) => tracing::warn!(frontend = %key, error = %e, "could not remove a stale frontend"),
                }
            }
        }
        // After the first sync, and after any that left what a failed delete could not remove.
        if stats.initial || self.dp.has_leftovers() {
            match self.dp.collect_garbage() {
                Ok(n) => stats.garbage = n,
                Err(e) => tracing::warn!(error = %e, "could not collect unused dataplane entries"),
            }
        }
        stats.duration = start.elapsed();
        Some(stats)
    }

    /// Programs one Service; false when something failed and it will be retried.
    fn sync_service(&mut self, svc: &ObjectKey, node: &NodeInfo, stats: &mut SyncStats) -> bool {
        let translation = self.store.translate_on(svc, node);
        crate::model::store::log_notes(svc, &translation.notes);
        let groups = super::frontends::render_groups(&translation.ports, node);
        let wanted_keys: std::collections::HashSet<FrontendKey> = groups.iter().flat_map(|g| g.keys.iter().copied()).collect();
        let mut failed = false;
        let mut contended = Vec::new();
        match self.dp.admit(&groups) {
            Ok(()) => {
                match translation.health_check {
                    Some(h) => {
                        self.health_checks.insert(svc.clone(), h);
                    }
                    None => {
                        self.health_checks.remove(svc);
                    }
                }
                if self.refused.remove(svc).is_some() && !groups.is_empty() {
                    tracing::info!(service = %svc, "fits the maps now; programming it");
                }
                let wanted: BTreeMap<FrontendKey, Frontend> = super::frontends::expand(groups).collect();
                failed = self.program(svc, &wanted, stats, &mut contended);
            }
            // What it still wants keeps its programmed version, and its health check what
            // that version serves; what it no longer wants goes below (removing only frees room).
            Err(e) => self.refuse(svc, &groups, e),
        }
        // What it waited for and no longer does.
        let still: std::collections::HashSet<&FrontendKey> = contended.iter().collect();
        for key in self.contending.remove(svc).unwrap_or_default().into_iter().filter(|k| !still.contains(k)) {
            if let Some(waiting) = self.contenders.get_mut(&key) {
                waiting.remove(svc);
                if waiting.is_empty() {
                    self.contenders.remove(&key);
                }
            }
        }
        if !contended.is_empty() {
            self.contending.insert(svc.clone(), contended);
        }
        let held = self.by_service.get(svc).cloned().unwrap_or_default();
        let mut removed = std::collections::HashSet::new();
        for key in held.iter().filter(|k| !wanted_keys.contains(k)) {
            match self.dp.remove(key) {
                Ok(()) => {
                    stats.removed += 1;
                    self.unsupported.remove(key);
                    self.failing.remove(key);
                    tracing::debug!(service = %svc, frontend = %key, "removed");
                    self.owners.remove(key);
                    removed.insert(*key);
                    // A Service that wanted this frontend may have it now.
                    if let Some(waiting) = self.contenders.remove(key) {
                        self.released.extend(waiting);
                    }
                }
                Err(e) => {
                    stats.failed += 1;
                    failed = true;
                    tracing::error!(service = %svc, frontend = %key, "not removed: {e}");
                }
            }
        }
        if let Some(held) = self.by_service.get_mut(svc) {
            if !removed.is_empty() {
                held.retain(|k| !removed.contains(k));
            }
            if held.is_empty() {
                self.by_service.remove(svc);
            }
        }
        if failed {
            self.retry.insert(svc.clone());
        }
        !failed
    }

    /// Programs the frontends `wanted` of `svc`; true when one failed (it is retried). Those
    /// another Service holds go to `contended`.
    fn program(
        &mut self,
        svc: &ObjectKey,
        wanted: &BTreeMap<FrontendKey, Frontend>,
        stats: &mut SyncStats,
        contended: &mut Vec<FrontendKey>,
    ) -> bool {
        let mut failed = false;
        for (key, fe) in wanted {
            if let Some(owner) = self.owners.get(key).filter(|o| *o != svc) {
                contended.push(*key);
                if self.contenders.entry(*key).or_default().insert(svc.clone()) {
                    tracing::warn!(
                        service = %svc,
                        frontend = %key,
                        owner = %owner,
                        "frontend already belongs to another Service; not programmed until that one releases it"
                    );
                }
                continue;
            }
            if self.dp.is_current(key, fe) {
                stats.unchanged += 1;
            } else {
                match self.dp.upsert(key, fe) {
                    Ok(()) => {
                        stats.upserted += 1;
                        self.unsupported.remove(key);
                        if self.failing.remove(key).is_some() {
                            tracing::info!(service = %fe.name, frontend = %key, "programmed after all");
                        }
                        tracing::debug!(service = %fe.name, frontend = %key, backends = fe.backends.len(), "programmed");
                    }
                    // Retrying cannot help until the Service changes: say so once, and neither
                    // retry nor hold health back for it.
                    Err(e) if e.is_permanent() => {
                        let msg = e.to_string();
                        if self.unsupported.get(key) != Some(&msg) {
                            tracing::error!(service = %fe.name, frontend = %key, reason = e.metric_label(), "not programmed: {msg}");
                            self.unsupported.insert(*key, msg);
                        }
                    }
                    Err(e) => {
                        stats.failed += 1;
                        failed = true;
                        let msg = e.to_string();
                        if self.failing.get(key) != Some(&msg) {
                            if let crate::dataplane::DataplaneError::MapFull { map, .. } = e {
                                self.full_this_sync.get_or_insert((map, key.addr.is_ipv6()));
                            }
                            tracing::error!(service = %fe.name, frontend = %key, reason = e.metric_label(), "not programmed: {msg}; retrying");
                            self.failing.insert(*key, msg);
                        }
                    }
                }
            }
            // Owned even when programming failed: a previous run's working version of it must
            // not be removed as stale, and it is retried as this Service's.
            self.owners.insert(*key, svc.clone());
            crate::model::insert_sorted(self.by_service.entry(svc.clone()).or_default(), *key);
        }
        failed
    }

    /// A Service the dataplane refuses whole: said once per map, and not retried (nothing
    /// changes until the Service does). The frontends it holds and still wants stay as they
    /// were, and so do those a previous run left for it (not removed as stale at the first
    /// sync): a Service that grew past the cap keeps serving its earlier endpoints. (Those it
    /// no longer wants are removed by the caller.)
    fn refuse(&mut self, svc: &ObjectKey, wanted: &[super::frontends::Group], e: crate::dataplane::DataplaneError) {
        let map = match &e {
            crate::dataplane::DataplaneError::TooLarge { map, .. } => *map,
            _ => e.metric_label(),
        };
        // Said again when another map is the one too small, not whenever the figures move
        // (a large Service's endpoints churn).
        if self.refused.get(svc) != Some(&map) {
            tracing::error!(service = %svc, reason = e.metric_label(), "not programmed: {e}");
            self.refused.insert(svc.clone(), map);
        } else {
            tracing::debug!(service = %svc, "still not programmed: {e}");
        }
        // A frontend a previous run left for this Service port is kept; one another Service
        // left at an address this one has taken since is not (it goes as stale).
        let left = self.adopted.as_ref();
        for (key, fe) in wanted.iter().flat_map(|g| g.keys.iter().map(move |k| (k, &g.frontend))) {
            if !self.owners.contains_key(key) && left.is_some_and(|a| a.contains(key)) && self.dp.holds_for(key, fe) {
                self.owners.insert(*key, svc.clone());
                crate::model::insert_sorted(self.by_service.entry(svc.clone()).or_default(), *key);
            }
        }
        // The change is not programmed: no latency sample for it.
        self.triggers.remove(svc);
    }

    /// Logs the Services holding the most entries of the family's load-balancer maps (masters
    /// and slots), once per sync in which a frontend newly failed for want of room in `map`:
    /// the operator sees which Services crowd the others out.
    fn name_the_largest(&self, map: &str, ipv6: bool) {
        let mut held: Vec<(usize, &ObjectKey)> = self
            .by_service
            .iter()
            .map(|(svc, keys)| (keys.iter().filter(|k| k.addr.is_ipv6() == ipv6).map(|k| self.dp.entries_of(k)).sum(), svc))
            .collect();
        held.sort_unstable_by(|a, b| b.cmp(a));
        let top: Vec<String> = held.iter().take(3).filter(|(n, _)| *n > 0).map(|(n, svc)| format!("{svc} ({n})")).collect();
        if !top.is_empty() {
            tracing::warn!(
                "map {map} has no room for a change; the Services holding the most {} load-balancer entries (masters and \
                 slots): {}; {} in all",
                if ipv6 { "IPv6" } else { "IPv4" },
                top.join(", "),
                held.iter().map(|(n, _)| n).sum::<usize>()
            );
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::{
        dataplane::DataplaneError,
        model::{store::Object, Protocol},
    };

    /// A dataplane that records what it holds.
    #[derive(Default)]
    struct Fake {
        held: BTreeMap<FrontendKey, Frontend>,
        writes: usize,
        fail: bool,
        unsupported: bool,
        /// The most frontends one Service may have (`admit`).
        cap: Option<usize>,
    }

    impl Dataplane for Fake {
        fn programmed_keys(&self) -> Vec<FrontendKey> {
            self.held.keys().copied().collect()
        }
        fn is_current(&self, key: &FrontendKey, fe: &Frontend) -> bool {
            self.held.get(key) == Some(fe)
        }
        fn upsert(&mut self, key: &FrontendKey, fe: &Frontend) -> Result<(), DataplaneError> {
            if self.fail {
                return Err(DataplaneError::MapFull { map: "injected", max: 1 });
            }
            if self.unsupported {
                return Err(DataplaneError::Unsupported("injected".into()));
            }
            self.writes += 1;
            self.held.insert(*key, fe.clone());
            Ok(())
        }
        fn remove(&mut self, key: &FrontendKey) -> Result<(), DataplaneError> {
            self.writes += 1;
            self.held.remove(key);
            Ok(())
        }
        fn collect_garbage(&mut self) -> Result<usize, DataplaneError> {
            Ok(0)
        }
        fn admit(&self, wanted: &[crate::dataplane::ebpf::frontends::Group]) -> Result<(), DataplaneError> {
            let n: usize = wanted.iter().map(|g| g.keys.len()).sum();
            match self.cap {
                Some(cap) if n > cap => Err(DataplaneError::TooLarge { map: "injected", need: n, max: 2 * cap as u32 }),
                _ => Ok(()),
            }
        }
        fn entries_of(&self, key: &FrontendKey) -> usize {
            self.held.get(key).map_or(0, |fe| 1 + fe.backends.len())
        }
        fn holds_for(&self, key: &FrontendKey, fe: &Frontend) -> bool {
            self.held.get(key).is_some_and(|h| h.name == fe.name)
        }
    }

    /// A Service of `ports` ports (80, 81, ...).
    fn svc_ports(name: &str, ip: &str, ports: u16) -> Object {
        let list: Vec<String> = (0..ports).map(|i| format!("{{name: p{i}, port: {}}}", 80 + i)).collect();
        Object::Service(Box::new(
            serde_yaml::from_str(&format!("metadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{}]}}", list.join(", "))).unwrap(),
        ))
    }

    fn port(ip: &str, port: u16) -> FrontendKey {
        FrontendKey { port, ..key(ip) }
    }

    fn svc(name: &str, ip: &str) -> Object {
        Object::Service(Box::new(
            serde_yaml::from_str(&format!("metadata: {{name: {name}}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}")).unwrap(),
        ))
    }

    fn key(ip: &str) -> FrontendKey {
        FrontendKey { addr: ip.parse().unwrap(), port: 80, protocol: Protocol::Tcp }
    }

    fn replace(objects: Vec<Object>) -> Vec<Event> {
        vec![Event::Replace { kind: Kind::Service, objects }, Event::Replace { kind: Kind::EndpointSlice, objects: vec![] }]
    }

    fn rec(dp: Fake) -> Reconciler<Fake> {
        Reconciler::new(Store::new("n"), dp, vec![Kind::Service, Kind::EndpointSlice])
    }

    #[test]
    fn nothing_is_written_before_every_kind_is_listed() {
        let mut r = rec(Fake::default());
        r.handle(Event::Replace { kind: Kind::Service, objects: vec![svc("a", "10.96.0.1")] });
        assert_eq!(r.sync(), None);
        assert_eq!(r.dp.writes, 0);
        r.handle(Event::Replace { kind: Kind::EndpointSlice, objects: vec![] });
        let s = r.sync().unwrap();
        assert!(s.initial);
        assert_eq!(s.upserted, 1);
    }

    #[test]
    fn restart_keeps_unchanged_frontends_and_drops_stale_ones() {
        // A previous run programmed a (unchanged) and b (gone from the cluster since).
        let mut first = rec(Fake::default());
        replace(vec![svc("a", "10.96.0.1"), svc("b", "10.96.0.2")]).into_iter().for_each(|e| first.handle(e));
        first.sync();
        let mut dp = std::mem::take(&mut first.dp);
        dp.writes = 0;

        let mut r = rec(dp);
        replace(vec![svc("a", "10.96.0.1")]).into_iter().for_each(|e| r.handle(e));
        let s = r.sync().unwrap();
        assert_eq!((s.upserted, s.unchanged, s.removed), (0, 1, 1), "{s:?}");
        assert_eq!(r.dp.writes, 1, "only the stale frontend is touched");
        assert!(r.dp.held.contains_key(&key("10.96.0.1")) && !r.dp.held.contains_key(&key("10.96.0.2")));
    }

    #[test]
    fn a_changed_cluster_ip_moves_the_frontend() {
        let mut r = rec(Fake::default());
        replace(vec![svc("a", "10.96.0.1")]).into_iter().for_each(|e| r.handle(e));
        r.sync();
        r.handle(Event::Apply(svc("a", "10.96.0.9")));
        let s = r.sync().unwrap();
        assert_eq!((s.upserted, s.removed), (1, 1));
        assert_eq!(r.dp.programmed_keys(), vec![key("10.96.0.9")]);
    }

    #[test]
    fn a_conflicting_frontend_goes_to_the_first_owner_then_to_the_waiting_one() {
        let mut r = rec(Fake::default());
        replace(vec![svc("a", "10.96.0.1")]).into_iter().for_each(|e| r.handle(e));
        r.sync();
        r.handle(Event::Apply(svc("b", "10.96.0.1")));
        r.sync();
        assert_eq!(r.owners()[&key("10.96.0.1")], ObjectKey::new("default", "a"));
        r.handle(Event::Delete { kind: Kind::Service, key: ObjectKey::new("default", "a") });
        r.sync();
        // In the same sync: a released frontend goes to the Service waiting for it.
        assert_eq!(r.owners()[&key("10.96.0.1")], ObjectKey::new("default", "b"));
        assert!(!r.has_failures(), "nothing left to retry");
    }

    /// A Service that waited for another's frontend and goes, or stops wanting it, stops
    /// waiting: nothing of it is left behind in the bookkeeping.
    #[test]
    fn a_contender_that_goes_leaves_nothing_behind() {
        let mut r = rec(Fake::default());
        replace(vec![svc("a", "10.96.0.1")]).into_iter().for_each(|e| r.handle(e));
        r.sync();
        r.handle(Event::Apply(svc("b", "10.96.0.1")));
        r.handle(Event::Apply(svc("c", "10.96.0.1")));
        r.sync();
        assert_eq!(r.contenders[&key("10.96.0.1")].len(), 2);
        r.handle(Event::Delete { kind: Kind::Service, key: ObjectKey::new("default", "b") });
        r.handle(Event::Apply(svc("c", "10.96.0.3")));
        r.sync();
        assert!(r.contenders.is_empty() && r.contending.is_empty(), "{:?} {:?}", r.contenders, r.contending);
        assert_eq!(r.owners().len(), 2, "c took its new address");
        // Synced again while it waits, it is listed once.
        r.handle(Event::Apply(svc("d", "10.96.0.1")));
        r.sync();
        r.handle(Event::Apply(svc("d", "10.96.0.1")));
        r.sync();
        assert_eq!(r.contending[&ObjectKey::new("default", "d")], [key("10.96.0.1")]);
        r.handle(Event::Delete { kind: Kind::Service, key: ObjectKey::new("default", "a") });
        r.sync();
        assert_eq!(r.owners()[&key("10.96.0.1")], ObjectKey::new("default", "d"), "the one still waiting takes it");
        assert!(r.contenders.is_empty() && r.contending.is_empty());
    }

    /// A Service claiming another's cluster IP as an external IP holds that frontend until the
    /// owner appears (`Store::translate_on`); the owner, first in the sync's order, then takes
    /// it in the same sync as the claimant lets it go.
    #[test]
    fn an_owner_takes_its_cluster_ip_from_a_claimant_in_one_sync() {
        let mut r = rec(Fake::default());
        let claimant = Object::Service(Box::new(
            serde_yaml::from_str("metadata: {name: zzz}\nspec: {clusterIP: 10.96.0.9, externalIPs: [10.96.0.1], ports: [{port: 80}]}")
                .unwrap(),
        ));
        replace(vec![claimant]).into_iter().for_each(|e| r.handle(e));
        r.sync();
        assert_eq!(r.owners()[&key("10.96.0.1")], ObjectKey::new("default", "zzz"));
        r.handle(Event::Apply(svc("a", "10.96.0.1")));
        r.sync();
        assert_eq!(r.owners()[&key("10.96.0.1")], ObjectKey::new("default", "a"));
        assert!(!r.has_failures());
    }

    #[test]
    fn unsupported_frontends_are_not_retried() {
        let mut r = rec(Fake { unsupported: true, ..Default::default() });
        replace(vec![svc("a", "10.96.0.1")]).into_iter().for_each(|e| r.handle(e));
        let s = r.sync().unwrap();
        assert_eq!(s.failed, 0, "not a failure to retry");
        assert!(!r.has_failures(), "health must not wait for something that cannot work");
    }

    #[test]
    fn a_failed_update_keeps_the_previous_runs_version() {
        let mut first = rec(Fake::default());
        replace(vec![svc("a", "10.96.0.1")]).into_iter().for_each(|e| first.handle(e));
        first.sync();
        let mut dp = std::mem::take(&mut first.dp);
        dp.fail = true;
        let mut r = rec(dp);
        // The Service changed while the agent was down, and the update fails (map full).
        let changed = Object::Service(Box::new(
            serde_yaml::from_str("metadata: {name: a}\nspec: {clusterIP: 10.96.0.1, sessionAffinity: ClientIP, ports: [{port: 80}]}")
                .unwrap(),
        ));
        replace(vec![changed]).into_iter().for_each(|e| r.handle(e));
        let s = r.sync().unwrap();
        assert_eq!((s.failed, s.removed), (1, 0), "{s:?}");
        assert!(r.dp.held.contains_key(&key("10.96.0.1")), "the old version keeps serving");
    }

    /// One Service too large for the maps is refused whole, said once, not retried; what it
    /// had keeps serving (also what a previous run left for it), and the others are programmed.
    #[test]
    fn a_service_too_large_is_refused_whole_and_keeps_what_it_had() {
        let mut r = rec(Fake { cap: Some(2), ..Default::default() });
        replace(vec![svc_ports("a", "10.96.0.1", 2)]).into_iter().for_each(|e| r.handle(e));
        assert_eq!(r.sync().unwrap().upserted, 2);
        r.handle(Event::Apply(svc_ports("a", "10.96.0.1", 3)));
        r.handle(Event::Apply(svc("b", "10.96.0.2")));
        let s = r.sync().unwrap();
        assert_eq!((s.upserted, s.removed, s.failed), (1, 0, 0), "only b is written: {s:?}");
        assert!(!r.has_failures(), "refused, not retried: health must not wait for it");
        assert_eq!(r.dp.programmed_keys(), vec![port("10.96.0.1", 80), port("10.96.0.1", 81), key("10.96.0.2")]);
        assert!(r.refused.contains_key(&ObjectKey::new("default", "a")));

        // A restart with the Service still too large: a previous run's frontends of it are
        // not removed as stale.
        let mut dp = std::mem::take(&mut r.dp);
        dp.writes = 0;
        let mut r = rec(dp);
        replace(vec![svc_ports("a", "10.96.0.1", 3), svc("b", "10.96.0.2")]).into_iter().for_each(|e| r.handle(e));
        let s = r.sync().unwrap();
        assert_eq!((s.upserted, s.removed, r.dp.writes), (0, 0, 0), "{s:?}");
        assert_eq!(r.owners().len(), 3, "the refused Service still owns what it holds");

        // Still too large, at another address: the old one goes (removing only frees room), the
        // new one waits until it fits.
        r.handle(Event::Apply(svc_ports("a", "10.96.0.3", 3)));
        let s = r.sync().unwrap();
        assert_eq!((s.upserted, s.removed), (0, 2), "{s:?}");
        assert_eq!(r.dp.programmed_keys(), vec![key("10.96.0.2")]);
        assert!(r.owners().keys().all(|k| k.addr.to_string() != "10.96.0.1"), "nothing owned at the old address");
        r.handle(Event::Apply(svc_ports("a", "10.96.0.1", 3)));
        r.sync();

        // A previous run's frontend of another Service at an address a refused one has taken
        // since is not kept for it: it goes as stale.
        let mut first = rec(Fake::default());
        replace(vec![svc("x", "10.96.0.5")]).into_iter().for_each(|e| first.handle(e));
        first.sync();
        let mut r2 = rec(Fake { cap: Some(2), ..std::mem::take(&mut first.dp) });
        replace(vec![svc_ports("a", "10.96.0.5", 3)]).into_iter().for_each(|e| r2.handle(e));
        assert_eq!(r2.sync().unwrap().removed, 1);
        assert!(r2.dp.programmed_keys().is_empty() && r2.owners().is_empty());

        // Shrunk back, it is programmed again; deleted, its frontends go.
        r.handle(Event::Apply(svc_ports("a", "10.96.0.1", 1)));
        assert_eq!(r.sync().unwrap().upserted, 1);
        assert!(!r.refused.contains_key(&ObjectKey::new("default", "a")));
        r.handle(Event::Apply(svc_ports("a", "10.96.0.1", 3)));
        r.sync();
        r.handle(Event::Delete { kind: Kind::Service, key: ObjectKey::new("default", "a") });
        r.sync();
        assert_eq!(r.dp.programmed_keys(), vec![key("10.96.0.2")]);
    }

    #[test]
    fn failures_are_retried() {
        let mut r = rec(Fake { fail: true, ..Default::default() });
        replace(vec![svc("a", "10.96.0.1")]).into_iter().for_each(|e| r.handle(e));
        let s = r.sync().unwrap();
        assert_eq!(s.failed, 1);
        assert!(r.has_failures());
        r.dp.fail = false;
        let s = r.sync().unwrap();
        assert_eq!(s.upserted, 1);
        assert!(!r.has_failures());
    }
}
