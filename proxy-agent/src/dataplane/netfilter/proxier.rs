//! The reconciling loop of the netfilter modes: every pending Service change is translated into
//! its ports, and the mode's rules are rendered and applied once per sync (a burst of changes
//! is one kernel transaction). Nothing is written until every source has listed everything.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Instant, SystemTime},
};

use crate::{
    dataplane::{
        netfilter::{conntrack, NodeContext, RuleSet, Services},
        ProxyMode,
    },
    model::{
        store::{Event, Kind, NodePortAddresses, Store},
        translate::HealthCheck,
        ObjectKey,
    },
    sync::{PortState, SyncStats},
};

/// Another mode's rules, to take over from the nftables mode where nft can no longer write
/// (auto mode: `NetfilterProxier::set_fallback`).
pub struct Fallback {
    pub rules: Box<dyn RuleSet + Send>,
    pub masquerading: Masquerading,
    pub settings: Vec<crate::dataplane::netfilter::sysctl::Setting>,
    /// Removes the mode's own rules once the fallback's are whole (`modes::cleanup`'s).
    pub retire: Retire,
}

/// Removes a mode's rules: a line per thing removed, or why something is left.
pub type Retire = fn() -> Result<Vec<String>, String>;

/// Makes the fallback when it is needed (its iptables backend and counters are looked at then).
pub type MakeFallback = Box<dyn FnOnce() -> Result<Fallback, String> + Send>;

/// How the node's traffic is recognised and masqueraded in the rules.
#[derive(Clone, Debug, Default)]
pub struct Masquerading {
    pub masquerade_all: bool,
    pub detect_local: Option<crate::config::DetectLocal>,
    /// `clusterCIDR`: one range, or one per family.
    pub cluster_cidrs: Vec<crate::model::store::Cidr>,
}

impl Masquerading {
    /// How the rules tell pod traffic, from `detectLocalMode` (NodeCIDR needs the Node).
    pub fn local_traffic(&self, store: &Store) -> crate::dataplane::netfilter::LocalTraffic {
        use crate::{config::DetectLocal, dataplane::netfilter::LocalTraffic};
        let cidrs = |c: &[crate::model::store::Cidr]| if c.is_empty() { LocalTraffic::Unknown } else { LocalTraffic::Cidrs(c.to_vec()) };
        match &self.detect_local {
            None | Some(DetectLocal::ClusterCidr) => cidrs(&self.cluster_cidrs),
            Some(DetectLocal::NodeCidr) => cidrs(store.node().map_or(&[][..], |n| &n.pod_cidrs[..])),
            Some(DetectLocal::BridgeInterface(b)) => LocalTraffic::Interface(b.clone()),
            Some(DetectLocal::InterfaceNamePrefix(p)) => LocalTraffic::InterfacePrefix(p.clone()),
        }
    }
}

pub struct NetfilterProxier {
    pub store: Store,
    rules: Box<dyn RuleSet + Send>,
    required: Vec<Kind>,
    services: Services,
    health_checks: BTreeMap<ObjectKey, HealthCheck>,
    masquerading: Masquerading,
    /// Kernel settings to make at the first sync (sysctls; see `netfilter::sysctl`).
    settings: Vec<crate::dataplane::netfilter::sysctl::Setting>,
    /// The last apply failed: everything is applied again on the next sync.
    failed: bool,
    /// A full resync is due (`resync_all`).
    resync: bool,
    /// The last apply's error, as reported (a retry that fails alike says nothing more).
    last_error: Option<String>,
    synced_once: bool,
    triggers: Vec<SystemTime>,
    /// A UDP Service changed since stale UDP conntrack entries were last deleted (true at
    /// first: flows from before the agent ran may be stale too).
    udp_changed: bool,
    /// TCP Service addresses with endpoints whose earlier attempts are still to be deleted from
    /// conntrack once the rules are in (`conntrack::forget_untranslated_attempts`): all of them
    /// at first (attempts made before the agent ran are stuck alike), then each address that
    /// gets endpoints and is not in `swept`.
    to_sweep: BTreeSet<(std::net::IpAddr, u16)>,
    /// TCP Service addresses swept and in the rules ever since. While such an address has no
    /// endpoints the rules refuse (or drop) its attempts, which leaves no conntrack entry, so
    /// it needs no second sweep until it leaves the rules: endpoints that come and go cost no
    /// conntrack listing.
    swept: BTreeSet<(std::net::IpAddr, u16)>,
    /// `Store::cluster_ip_generation` last looked at, and the Service CIDRs the rules hold.
    cluster_ips_written: Option<u64>,
    service_cidrs: Option<Vec<crate::model::store::Cidr>>,
    /// Auto mode's way out of a mode that can no longer write here (`set_fallback`).
    fallback: Option<MakeFallback>,
    /// The rules of the mode left for the fallback, removed once the fallback's are whole:
    /// its mode, and how.
    retire: Option<(ProxyMode, Retire)>,
    /// The fallback took over at the last sync: the next writes its rules at once.
    switched: bool,
}

impl NetfilterProxier {
    pub fn new(
        store: Store,
        rules: Box<dyn RuleSet + Send>,
        required: Vec<Kind>,
        masquerading: Masquerading,
        settings: Vec<crate::dataplane::netfilter::sysctl::Setting>,
    ) -> Self {
        Self {
            store,
            rules,
            required,
            services: Services::new(),
            health_checks: BTreeMap::new(),
            masquerading,
            settings,
            failed: false,
            resync: false,
            last_error: None,
            synced_once: false,
            triggers: Vec::new(),
            udp_changed: true,
            to_sweep: BTreeSet::new(),
            swept: BTreeSet::new(),
            cluster_ips_written: None,
            service_cidrs: None,
            fallback: None,
            retire: None,
            switched: false,
        }
    }

    /// Auto mode: where nft is found to crash on tables that it cannot read (a newer nft's
    /// sets, `NetfilterError::unreadable_tables`), the Services go to `make`'s rules instead, in
    /// this same process: the nftables mode could write nothing more until they went. Its
    /// rules serve until the fallback's are whole, and are removed then.
    pub fn set_fallback(&mut self, make: MakeFallback) {
        self.fallback = Some(make);
    }

    /// The mode whose rules are being written.
    pub fn mode(&self) -> ProxyMode {
        self.rules.mode()
    }

    /// Once the fallback's rules are whole: the old mode's rules go (tried again at the next
    /// sync while some are left: they would go on translating beside the new ones).
    fn retire_old_rules(&mut self) {
        let Some((old, retire)) = self.retire else { return };
        let mode = self.rules.mode();
        match retire() {
            Ok(removed) => {
                self.retire = None;
                tracing::info!(mode = %mode, "proxy mode auto: the {mode} mode's rules are whole; removed the {old} mode's: {}", removed.join(", "));
            }
            Err(e) => {
                tracing::warn!(mode = %mode, "proxy mode auto: the {mode} mode's rules are whole, but the {old} mode's are not all removed (tried again at the next sync): {e}");
                self.failed = true;
            }
        }
    }

    /// Hands the Services to the fallback's rules: the next sync writes them all.
    fn fall_back(&mut self, make: MakeFallback, why: &str) {
        let from = self.rules.mode();
        match make() {
            Ok(f) => {
                tracing::warn!(
                    mode = %f.rules.mode(),
                    "proxy mode auto: switching to the {} mode, as the {from} mode cannot write here any more. Its rules are \
                     written in full at once, and only then are the {from} mode's removed (they serve until then). The {from} \
                     mode's failure: {why}",
                    f.rules.mode()
                );
                for failure in crate::dataplane::netfilter::sysctl::apply(&f.settings) {
                    tracing::warn!("{failure}");
                }
                self.rules = f.rules;
                self.masquerading = f.masquerading;
                self.settings = f.settings;
                self.retire = Some((from, f.retire));
                // (Still failing: nothing is programmed until the new rules are written.)
                self.switched = true;
                // Everything again, with the Service CIDRs given to the new rules.
                self.resync = true;
                self.cluster_ips_written = None;
                self.service_cidrs = None;
                self.last_error = None;
            }
            Err(e) => {
                tracing::error!(
                    mode = %from,
                    "applying the rules failed; retrying: {why}. Proxy mode auto cannot switch modes either: {e}"
                );
                self.last_error = Some(why.to_string());
            }
        }
    }

    pub fn handle(&mut self, event: Event) {
        self.store.apply_logged(event);
    }

    pub fn ready(&self) -> bool {
        self.store.synced(&self.required)
    }

    pub fn has_failures(&self) -> bool {
        self.failed
    }

    /// Why the last sync failed, as it was logged (None after one that applied).
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// The rules have more to write (`RuleSet::pending`): the next sync goes on, changes or not.
    pub fn pending(&self) -> bool {
        self.switched || self.rules.pending()
    }

    /// The rules' pending steps build what the kernel lacks (`RuleSet::building`).
    pub fn building(&self) -> bool {
        self.rules.building()
    }

    pub fn node_context(&self) -> NodeContext {
        NodeContext {
            nodeport_ips: self.store.node_info().nodeport_addresses,
            nodeport_all: *self.store.nodeport_config() == NodePortAddresses::All,
            local: self.masquerading.local_traffic(&self.store),
            masquerade_all: self.masquerading.masquerade_all,
            node_ips: self.store.node_ips(),
            nodeport_all_families: crate::model::Family::ALL.into_iter().filter(|f| self.store.nodeport_config().all_of(*f)).collect(),
        }
    }

    /// A full resync: the next sync writes every rule again (repairing what someone else
    /// changed), as kube-proxy does periodically.
    pub fn resync_all(&mut self) {
        self.rules.forget_applied();
        self.resync = true;
    }

    pub fn health_checks(&self) -> BTreeMap<u16, PortState> {
        let mut out = BTreeMap::new();
        for h in self.health_checks.values() {
            out.entry(h.port).or_insert_with(|| PortState { service: h.service.clone(), local_endpoints: h.local_endpoints });
        }
        out
    }

    /// Takes in every pending change and applies the rules. None until the sources are synced
    /// or when there is nothing to do.
    pub fn sync(&mut self) -> Option<SyncStats> {
        if !self.ready() {
            return None;
        }
        let start = Instant::now();
        let dirty = self.store.take_dirty();
        for (_, times) in dirty.trigger_times {
            self.triggers.extend(times);
        }
        let generation = self.store.cluster_ip_generation();
        let cidrs_changed = self.cluster_ips_written != Some(generation);
        if cidrs_changed {
            self.cluster_ips_written = Some(generation);
            let (cidrs, _) = self.store.cluster_ip_ranges();
            // Rewritten only when the ranges themselves changed (a Service change moves the
            // generation too; the rules' own cluster-ips set follows the Services).
            if self.service_cidrs.as_ref() != Some(&cidrs) {
                self.rules.set_service_cidrs(cidrs.clone());
                self.service_cidrs = Some(cidrs);
                self.resync |= self.synced_once;
            }
        }
        if dirty.services.is_empty() && self.synced_once && !self.failed && !self.resync && !self.rules.pending() {
            return None;
        }
        let mut stats = SyncStats { services: dirty.services.len(), ..Default::default() };
        let node_info = self.store.node_info();
        for svc in &dirty.services {
            let mut t = self.store.translate_on(svc, &node_info);
            crate::model::store::log_notes(svc, &t.notes);
            // Rules are written for the chosen endpoints only; the others (what the eBPF
            // dataplane keeps flows to) would only make a change that writes no rule look like
            // one, and sweep UDP conntrack for it.
            for p in &mut t.ports {
                p.endpoints = Vec::new();
            }
            match t.health_check {
                Some(h) => {
                    self.health_checks.insert(svc.clone(), h);
                }
                None => {
                    self.health_checks.remove(svc);
                }
            }
            let before = self.services.get(svc).map(|p| conntrack::tcp_frontends(p, false)).unwrap_or_default();
            let present = conntrack::tcp_frontends(&t.ports, false);
            for gone in before.difference(&present) {
                self.swept.remove(gone);
                self.to_sweep.remove(gone);
            }
            let swept = &self.swept;
            self.to_sweep.extend(conntrack::tcp_frontends(&t.ports, true).into_iter().filter(|a| !swept.contains(a)));
            // A change to a Service with UDP ports (before or after) calls for a conntrack sweep.
            let udp = |ports: &[crate::model::PortView]| ports.iter().any(|p| p.name.protocol == crate::model::Protocol::Udp);
            if t.ports.is_empty() {
                if let Some(old) = self.services.remove(svc) {
                    self.udp_changed |= udp(&old);
                    self.rules.changed(svc, Some(&old));
                    stats.removed += 1;
                }
            } else if self.services.get(svc) != Some(&t.ports) {
                let new_udp = udp(&t.ports);
                let old = self.services.insert(svc.clone(), t.ports);
                self.rules.changed(svc, old.as_deref());
                self.udp_changed |= new_udp || old.is_some_and(|o| udp(&o));
                stats.upserted += 1;
            } else {
                stats.unchanged += 1;
            }
        }
        let node = self.node_context();
        if !self.synced_once {
            // kube-proxy's kernel settings (conntrack table, route_localnet, IPVS), once.
            for failure in crate::dataplane::netfilter::sysctl::apply(&self.settings) {
                tracing::warn!("{failure}");
            }
        }
        self.switched = false;
        match self.rules.apply(&self.services, &node) {
            Ok(written) => {
                if self.last_error.take().is_some() {
                    tracing::info!(mode = %self.rules.mode(), "the rules are applied again");
                }
                self.failed = false;
                self.resync = false;
                tracing::debug!(mode = %self.rules.mode(), written, "rules applied");
                // (Changes are programmed once every Service is in the kernel: not at a step of
                // a build.)
                if !self.rules.building() {
                    stats.trigger_times = std::mem::take(&mut self.triggers);
                }
                // Conntrack is swept once the rules are whole: while a long write goes on, a
                // Service's chain may still hold what it had before (an endpoint gone since),
                // which a swept flow's next packet could pick again.
                if !self.rules.pending() {
                    // The old mode's rules go first: until then they may still translate a
                    // new flow to an endpoint gone, which the sweep would miss.
                    self.retire_old_rules();
                    self.sweep_conntrack(&node);
                }
            }
            Err(e) => {
                self.failed = true;
                stats.failed = stats.services.max(1);
                let msg = e.to_string();
                let fallback = if e.unreadable_tables().is_empty() { None } else { self.fallback.take() };
                if let Some(make) = fallback {
                    // (Says why.)
                    self.fall_back(make, &msg);
                } else if self.last_error.as_ref() != Some(&msg) {
                    tracing::error!(mode = %self.rules.mode(), "applying the rules failed; retrying: {msg}");
                    self.last_error = Some(msg);
                }
            }
        }
        stats.initial = !self.synced_once;
        self.synced_once = true;
        stats.duration = start.elapsed();
        Some(stats)
    }

    /// After the rules are applied: UDP flows to endpoints gone, and TCP attempts made before
    /// their Services were served, leave conntrack.
    fn sweep_conntrack(&mut self, node: &NodeContext) {
        if std::mem::take(&mut self.udp_changed) {
            // After the rules: new flows must not pick the old endpoint again.
            if let Err(e) = conntrack::reconcile(&self.services, node) {
                tracing::warn!(
                    "stale UDP conntrack entries were not deleted (UDP flows to removed endpoints last until their conntrack timeout): {e}"
                );
            }
        }
        if !self.to_sweep.is_empty() {
            let to_sweep = std::mem::take(&mut self.to_sweep);
            if let Err(e) = conntrack::forget_untranslated_attempts(&to_sweep) {
                tracing::warn!("connection attempts made before their Services were served were not deleted from conntrack (their retransmissions stay untranslated until the entries time out): {e}");
            }
            self.swept.extend(to_sweep);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{dataplane::netfilter::fake, model::store::Object};

    /// While the rules have more to write, a sync goes on without a change, and conntrack is
    /// not swept: a chain not written yet may still send a swept flow to an endpoint gone.
    /// (The sweep itself, after the last step, runs `conntrack`; this test stops before it.)
    #[test]
    fn a_long_write_goes_on_without_changes_and_sweeps_conntrack_once_whole() {
        let mut p =
            NetfilterProxier::new(Store::new("node-a"), Box::new(fake::Rules::stepping(4)), vec![], Masquerading::default(), vec![]);
        let svc = "metadata: {name: dns, namespace: kube-system}\nspec: {clusterIP: 10.96.0.10, ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]}";
        p.handle(Event::Apply(Object::Service(Box::new(serde_yaml::from_str(svc).unwrap()))));
        p.handle(Event::Apply(Object::EndpointSlice(Box::new(
            serde_yaml::from_str(
                "metadata: {name: dns-a, namespace: kube-system, labels: {kubernetes.io/service-name: dns}}\naddressType: IPv4\nports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]\nendpoints: [{addresses: [10.244.0.5]}]",
            )
            .unwrap(),
        ))));
        assert_eq!(p.sync().expect("a first sync").upserted, 1);
        for step in 0..2 {
            assert!(p.pending());
            assert!(p.udp_changed && !p.to_sweep.is_empty(), "swept before the rules are whole");
            let s = p.sync().unwrap_or_else(|| panic!("step {step} goes on without a change"));
            assert_eq!((s.services, s.failed), (0, 0));
        }
        assert!(p.pending(), "one step is left, and with it the sweep");
    }

    /// Calls of `retire`; the first fails (a table left), the others remove.
    static RETIRED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    fn retire() -> Result<Vec<String>, String> {
        match RETIRED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            0 => Err("could not delete table ip kube-proxy: a test".into()),
            _ => Ok(vec!["nftables: table ip kube-proxy".into()]),
        }
    }

    /// Auto mode's fallback: a failure that is not nft's crash on tables it cannot read keeps
    /// the mode; that crash hands the Services to the fallback's rules, which the next sync
    /// writes at once, in full (with no change since); a write of them that fails is retried
    /// as any; the old mode's rules are removed only once the fallback's are whole, and again
    /// while some are left.
    #[test]
    fn a_crash_on_unreadable_tables_hands_the_services_to_the_fallback_which_retires_the_old_rules_once_whole() {
        use std::sync::atomic::Ordering::Relaxed;
        let applied = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let fallback = fake::Rules { mode: ProxyMode::Iptables, applied: applied.clone(), ..fake::Rules::failing() };
        let mut fallback = Some(fallback);
        let mut p = NetfilterProxier::new(Store::new("node-a"), Box::new(fake::Rules::failing()), vec![], Masquerading::default(), vec![]);
        p.set_fallback(Box::new(move || {
            let rules = Box::new(fallback.take().expect("made once"));
            Ok(Fallback { rules, masquerading: Masquerading::default(), settings: vec![], retire })
        }));
        let svc =
            "metadata: {name: web, namespace: default}\nspec: {clusterIP: 10.96.0.80, ports: [{name: http, port: 80, protocol: TCP}]}";
        p.handle(Event::Apply(Object::Service(Box::new(serde_yaml::from_str(svc).unwrap()))));
        assert_eq!(p.sync().expect("a sync").failed, 1);
        assert_eq!(p.mode(), ProxyMode::Nftables, "another failure keeps the mode");
        assert!(!p.pending(), "retried after the backoff");
        // (No conntrack sweep, an outside command, when the fallback's rules are whole.)
        p.udp_changed = false;
        p.to_sweep.clear();
        p.rules = Box::new(fake::Rules { unreadable: vec!["ip fw".into()], ..fake::Rules::failing() });
        assert_eq!(p.sync().expect("a retry").failed, 1);
        assert_eq!(p.mode(), ProxyMode::Iptables, "nft crashes on a table it cannot read: the fallback takes over");
        assert!(p.has_failures() && p.pending() && p.last_error().is_none(), "still failing, the new rules written at once");
        assert_eq!(p.sync().expect("the fallback's first write").failed, 1, "failing");
        assert!(p.has_failures() && !p.pending(), "retried after the backoff, as any failure");
        assert_eq!((applied.load(Relaxed), RETIRED.load(Relaxed)), (1, 0));
        // (Its write goes through now.)
        p.rules = Box::new(fake::Rules { mode: ProxyMode::Iptables, applied: applied.clone(), ..fake::Rules::stepping(2) });
        let s = p.sync().expect("its first step, with no change since");
        assert_eq!((s.failed, applied.load(Relaxed), RETIRED.load(Relaxed)), (0, 2, 0), "written in part: the old rules serve on");
        assert!(p.pending());
        p.sync().expect("the fallback's last step");
        assert_eq!((applied.load(Relaxed), RETIRED.load(Relaxed)), (3, 1), "whole: the old rules' removal tried");
        assert!(p.has_failures(), "a table left: tried again");
        p.sync().expect("the retry");
        assert_eq!(RETIRED.load(Relaxed), 2, "removed");
        assert_eq!(p.sync().map(|s| s.services), None, "nothing more to do");
        assert_eq!(RETIRED.load(Relaxed), 2);
    }

    fn slice(endpoints: &str) -> Event {
        let yaml = format!(
            "metadata: {{name: dns-a, namespace: kube-system, labels: {{kubernetes.io/service-name: dns}}}}\naddressType: IPv4\nports: [{{port: 53, protocol: UDP}}]\nendpoints:\n{endpoints}"
        );
        Event::Apply(Object::EndpointSlice(Box::new(serde_yaml::from_str(&yaml).unwrap())))
    }

    /// A TCP Service address is swept for stuck attempts when it is served (has endpoints) for
    /// the first time since it entered the rules, and only then: not on a change that leaves it
    /// served, nor when endpoints come back to an address that stayed in the rules (its
    /// attempts meanwhile were refused and left nothing), nor for a UDP port (the UDP sweep has
    /// those). It is again once it left the rules and came back.
    #[test]
    fn a_tcp_address_is_swept_when_first_served_after_entering_the_rules() {
        let mut p = NetfilterProxier::new(Store::new("node-a"), Box::new(fake::Rules::failing()), vec![], Masquerading::default(), vec![]);
        let svc = "metadata: {name: web, namespace: default}\nspec: {clusterIP: 10.96.0.80, ports: [{name: http, port: 80, protocol: TCP}, {name: dns, port: 53, protocol: UDP}]}";
        let service = || Event::Apply(Object::Service(Box::new(serde_yaml::from_str(svc).unwrap())));
        p.handle(service());
        let slice = |endpoints: &str| {
            let yaml = format!(
                "metadata: {{name: web-a, namespace: default, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}, {{name: dns, port: 53, protocol: UDP}}]\nendpoints: {endpoints}"
            );
            Event::Apply(Object::EndpointSlice(Box::new(serde_yaml::from_str(&yaml).unwrap())))
        };
        let web: BTreeSet<(std::net::IpAddr, u16)> = [("10.96.0.80".parse().unwrap(), 80)].into();
        // The refusing rules keep the sweep pending, as a failed apply does; an applied sync's
        // sweep is played by hand (the real one runs `conntrack`).
        let swept = |p: &mut NetfilterProxier| {
            let done = std::mem::take(&mut p.to_sweep);
            p.swept.extend(done);
        };
        p.handle(slice("[{addresses: [10.244.0.5]}]"));
        p.sync().expect("a first sync");
        assert_eq!(p.to_sweep, web, "served at the first sync");
        swept(&mut p);
        p.handle(slice("[{addresses: [10.244.0.5]}, {addresses: [10.244.0.6]}]"));
        p.sync().expect("a sync");
        assert!(p.to_sweep.is_empty(), "still served: {:?}", p.to_sweep);
        p.handle(slice("[]"));
        p.sync().expect("a sync");
        p.handle(slice("[{addresses: [10.244.0.7]}]"));
        p.sync().expect("a sync");
        assert!(p.to_sweep.is_empty(), "endpoints back at an address that stayed in the rules: {:?}", p.to_sweep);
        p.handle(Event::Delete { kind: Kind::Service, key: ObjectKey::new("default", "web") });
        p.sync().expect("a sync");
        assert!(p.swept.is_empty() && p.to_sweep.is_empty(), "out of the rules: {:?} {:?}", p.swept, p.to_sweep);
        p.handle(service());
        p.sync().expect("a sync");
        assert_eq!(p.to_sweep, web, "back in the rules, served");
    }

    /// An endpoint that no rule is written for (not ready, not serving) changes no rule: the
    /// Service counts as unchanged and no UDP conntrack sweep is due.
    #[test]
    fn an_endpoint_no_rule_uses_leaves_the_service_unchanged() {
        let mut p = NetfilterProxier::new(Store::new("node-a"), Box::new(fake::Rules::failing()), vec![], Masquerading::default(), vec![]);
        let svc = "metadata: {name: dns, namespace: kube-system}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 53, protocol: UDP}]}";
        p.handle(Event::Apply(Object::Service(Box::new(serde_yaml::from_str(svc).unwrap()))));
        p.handle(slice("- addresses: [10.244.0.5]\n"));
        assert_eq!(p.sync().expect("a first sync").upserted, 1);
        p.udp_changed = false;
        p.handle(slice("- addresses: [10.244.0.5]\n- addresses: [10.244.0.6]\n  conditions: {ready: false, serving: false}\n"));
        let second = p.sync().expect("a sync for the changed slice");
        assert_eq!((second.upserted, second.unchanged), (0, 1), "{second:?}");
        assert!(!p.udp_changed, "no UDP conntrack sweep for a change no rule shows");
        // A ready endpoint is a change.
        p.handle(slice("- addresses: [10.244.0.5]\n- addresses: [10.244.0.6]\n"));
        assert_eq!(p.sync().expect("a sync").upserted, 1);
        assert!(p.udp_changed, "a UDP Service's endpoints changed");
    }
}
