//! The agent's copy of the cluster objects it needs, fed by any source (manifest directory or
//! API server watch) through the same events. It validates what comes in, keeps the last good
//! version of an object when an update is invalid, and records which Services need translating
//! again, so a changed EndpointSlice touches only its own Service.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::Arc,
};

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};

use super::{
    translate::{self, Translation},
    validate::{self, CheckedNode, CheckedService, CheckedSlice, LABEL_ZONE},
    NodeInfo, ObjectKey,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
    /// `networking.k8s.io/v1` ServiceCIDR: the ranges cluster IPs are allocated from.
    ServiceCidr,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
        }
    }
}

#[derive(Clone, Debug)]
pub enum Object {
    Service(Box<Service>),
    EndpointSlice(Box<EndpointSlice>),
    Node(Box<Node>),
    ServiceCidr(Box<k8s_openapi::api::networking::v1::ServiceCIDR>),
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Object::Service(_) => Kind::Service,
            Object::EndpointSlice(_) => Kind::EndpointSlice,
            Object::Node(_) => Kind::Node,
            Object::ServiceCidr(_) => Kind::ServiceCidr,
        }
    }
}

#[derive(Clone, Debug)]
pub enum Event {
    /// The complete current set of one kind: an initial list, a relist after a lost watch, or
    /// a rescan of the manifest directory. Objects not in it are deleted.
    Replace {
        kind: Kind,
        objects: Vec<Object>,
    },
    Apply(Object),
    Delete {
        kind: Kind,
        key: ObjectKey,
    },
    /// `Replace` in pieces, as a watch lists: a (re)list of one kind begins; the `Listed`
    /// objects that follow are its complete set, and objects not among them are deleted at
    /// `ListEnd`. Each object is checked and stored as it arrives, so a list of 30,000 Services
    /// is never held whole as API objects.
    ListBegin {
        kind: Kind,
    },
    Listed(Object),
    ListEnd {
        kind: Kind,
    },
}

/// Something the user should hear about: which object, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    pub warning: bool,
    pub object: String,
    pub message: String,
}

/// Logs what translating Service `svc` noted, as the store logs what it refuses (`object` names
/// the Service); refusals are warnings.
pub fn log_notes(svc: &ObjectKey, notes: &[String]) {
    for note in notes {
        if note.starts_with("refused") {
            tracing::warn!(object = %format_args!("Service {svc}"), "{note}");
        } else {
            tracing::info!(object = %format_args!("Service {svc}"), "{note}");
        }
    }
}

pub use super::addr::Cidr;

/// kube-proxy's `--nodeport-addresses`: which of the node's addresses serve NodePorts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every address of the node (kube-proxy's iptables and IPVS default).
    #[default]
    All,
    /// The node's primary address (the Node's first InternalIP).
    Primary,
    /// Addresses within these CIDRs.
    Cidrs(Vec<Cidr>),
}

impl NodePortAddresses {
    /// NodePorts of `family` are on every local address: no flag, or ranges of the other
    /// family only (kube-proxy reads the flag per family, and a family it names no range of
    /// gets all of its addresses).
    pub fn all_of(&self, family: super::Family) -> bool {
        match self {
            Self::All => true,
            Self::Primary => false,
            Self::Cidrs(c) => !c.iter().any(|c| c.family() == family),
        }
    }
}

impl std::str::FromStr for NodePortAddresses {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "primary" {
            return Ok(Self::Primary);
        }
        s.split(',').map(str::trim).filter(|c| !c.is_empty()).map(str::parse).collect::<Result<Vec<_>, _>>().map(Self::Cidrs)
    }
}

/// Change accounting, as kube-proxy's change trackers keep it for its metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChangeCounts {
    /// Service changes seen since start.
    pub service_changes: u64,
    /// EndpointSlice changes seen since start.
    pub endpoint_changes: u64,
    /// Services with a Service change not yet handed to the reconciler.
    pub services_pending: usize,
    /// Services with an endpoint change not yet handed to the reconciler.
    pub endpoints_pending: usize,
}

/// What changed since the last `take_dirty`.
#[derive(Debug, Default)]
pub struct Dirty {
    pub services: BTreeSet<ObjectKey>,
    /// `last-change-trigger-time`s of the EndpointSlice changes, per Service.
    pub trigger_times: BTreeMap<ObjectKey, Vec<std::time::SystemTime>>,
}

#[derive(Default)]
pub struct Store {
    node_name: String,
    nodeport_config: NodePortAddresses,
    /// `bindAddress`: the node's primary IP over its Node's InternalIP.
    node_ip_override: Option<std::net::IpAddr>,
    /// What the API server would enforce (the NodePort range).
    rules: validate::Rules,
    /// The node's own addresses, both families (loopback and IPv6 link-local excluded), from
    /// netlink.
    local_addresses: Vec<std::net::IpAddr>,
    /// Boxed: a hash table holds its values inline in slots of which up to half are empty, and
    /// these are a few hundred bytes each.
    services: HashMap<ObjectKey, Box<CheckedService>>,
    slices: HashMap<ObjectKey, Box<CheckedSlice>>,
    /// The slices of each Service, sorted. (A Vec: nearly every Service has one slice, and a
    /// BTreeSet's first node alone takes half a kilobyte.)
    slices_by_service: HashMap<ObjectKey, Vec<ObjectKey>>,
    node: Option<CheckedNode>,
    synced: BTreeSet<Kind>,
    dirty: BTreeSet<ObjectKey>,
    svc_pending: BTreeSet<ObjectKey>,
    ep_pending: BTreeSet<ObjectKey>,
    trigger_times: BTreeMap<ObjectKey, Vec<std::time::SystemTime>>,
    service_changes: u64,
    endpoint_changes: u64,
    /// Last problem reported per object, so a rescan does not repeat it.
    reported: HashMap<(Kind, ObjectKey), String>,
    /// See `set_localhost_nodeports`.
    localhost_nodeports: bool,
    /// The ranges of each ServiceCIDR object, by name.
    service_cidr_objects: BTreeMap<String, Vec<Cidr>>,
    /// `--service-cluster-ip-range`: ranges given on the command line (a manifest directory
    /// without ServiceCIDR objects).
    service_cidr_flag: Vec<Cidr>,
    /// Changes with every change to the Service CIDRs or the set of cluster IPs (see
    /// `cluster_ip_ranges`), so a dataplane rewrites them only then.
    cluster_ip_generation: u64,
    /// Lists in progress (`Event::ListBegin`): the keys listed so far, per kind.
    listing: BTreeMap<Kind, BTreeSet<ObjectKey>>,
    /// The node names endpoints carry, one copy each (`share_node_names`), and how many there
    /// were when names no endpoint holds were last dropped.
    node_names: HashSet<Arc<String>>,
    node_names_kept: usize,
    /// The external and load-balancer addresses Services claim: which Services claim each, and
    /// whose cluster IP it is. Only addresses some Service claims (a few in most clusters).
    claims: HashMap<std::net::IpAddr, Claim>,
    /// Some claim is not `resolved` yet.
    claims_unresolved: bool,
}

/// The cluster IPs a Service is served at: none for one skipped (another proxy's, say).
fn served_cluster_ips(s: &CheckedService) -> &[std::net::IpAddr] {
    if s.skip.is_some() {
        &[]
    } else {
        &s.cluster_ips
    }
}

/// An external or load-balancer address some Service claims (`Store::claims`).
#[derive(Debug, Default)]
struct Claim {
    /// The Services that list it (a set: 10,000 Services may list one address).
    claimants: HashSet<ObjectKey>,
    /// The Services whose cluster IP it is (served ones: not skipped). Complete once
    /// `resolved`; until then only those that changed since the address was first claimed.
    owners: Vec<ObjectKey>,
    resolved: bool,
}

impl Store {
    pub fn new(node_name: impl Into<String>) -> Self {
        Self { node_name: node_name.into(), ..Default::default() }
    }

    /// True once a complete list of each kind in `kinds` has been seen.
    pub fn synced(&self, kinds: &[Kind]) -> bool {
        kinds.iter().all(|k| self.synced.contains(k))
    }

    pub fn node_info(&self) -> NodeInfo {
        NodeInfo {
            name: self.node_name.clone(),
            zone: self.node.as_ref().and_then(|n| n.labels.get(LABEL_ZONE).cloned()),
            nodeport_addresses: self.nodeport_addresses(),
            node_ips: self.node_ips(),
            localhost_nodeports: self.localhost_nodeports,
        }
    }

    /// Serve NodePorts on 127.0.0.1 too (the eBPF mode, see `NodeInfo::localhost_nodeports`).
    pub fn set_localhost_nodeports(&mut self, on: bool) {
        if self.localhost_nodeports != on {
            self.localhost_nodeports = on;
            self.dirty.extend(self.services.keys().cloned());
        }
    }

    pub fn nodeport_config(&self) -> &NodePortAddresses {
        &self.nodeport_config
    }

    pub fn set_nodeport_config(&mut self, config: NodePortAddresses) {
        self.nodeport_config = config;
        self.dirty.extend(self.services.keys().cloned());
    }

    /// The node's addresses changed: NodePort frontends follow them.
    pub fn set_local_addresses(&mut self, mut addrs: Vec<std::net::IpAddr>) {
        addrs.retain(|a| !a.is_loopback() && !super::addr::is_v6_link_local(*a));
        addrs.sort();
        addrs.dedup();
        let before = self.nodeport_addresses();
        let changed: BTreeSet<std::net::IpAddr> = self
            .local_addresses
            .iter()
            .copied()
            .collect::<BTreeSet<_>>()
            .symmetric_difference(&addrs.iter().copied().collect())
            .copied()
            .collect();
        self.local_addresses = addrs;
        if !changed.is_empty() {
            self.cluster_ip_generation += 1;
        }
        if self.nodeport_addresses() != before {
            self.dirty.extend(self.services.keys().cloned());
        } else if !changed.is_empty() {
            // Services whose cluster IP became (or stopped being) a node address (such a Service
            // is refused, and owns none of its cluster IPs while it is), and the Services
            // claiming any of those cluster IPs, or a changed address, as external addresses.
            let hit: Vec<&CheckedService> =
                self.services.values().filter(|s| s.cluster_ips.iter().any(|a| changed.contains(a))).map(|s| &**s).collect();
            let dirty: Vec<ObjectKey> = hit
                .iter()
                .flat_map(|s| s.cluster_ips.iter())
                .chain(&changed)
                .filter_map(|a| self.claims.get(a))
                .flat_map(|c| c.claimants.iter().cloned())
                .chain(hit.iter().map(|s| s.key.clone()))
                .collect();
            self.dirty.extend(dirty);
        }
    }

    fn nodeport_addresses(&self) -> Vec<std::net::IpAddr> {
        match &self.nodeport_config {
            NodePortAddresses::All => self.local_addresses.clone(),
            NodePortAddresses::Primary => self.node_ips(),
            NodePortAddresses::Cidrs(cidrs) => self
                .local_addresses
                .iter()
                .copied()
                .filter(|a| self.nodeport_config.all_of(super::Family::of(*a)) || cidrs.iter().any(|c| c.contains(*a)))
                .collect(),
        }
    }

    /// The node's primary IPs, at most one per family: `bindAddress` for its family when set,
    /// else the Node's first InternalIP of each family (kube-proxy's rule).
    pub fn node_ips(&self) -> Vec<std::net::IpAddr> {
        let mut ips: Vec<std::net::IpAddr> = self.node_ip_override.into_iter().collect();
        for a in self.node.iter().flat_map(|n| n.internal_ips.iter()) {
            if !ips.iter().any(|b| b.is_ipv4() == a.is_ipv4()) {
                ips.push(*a);
            }
        }
        ips.sort();
        ips
    }

    /// The API server's rules objects are checked against (manifests are not checked by one).
    pub fn set_rules(&mut self, rules: validate::Rules) {
        self.rules = rules;
    }

    pub fn set_node_ip_override(&mut self, ip: Option<std::net::IpAddr>) {
        self.node_ip_override = ip;
        self.dirty.extend(self.services.keys().cloned());
    }

    pub fn node(&self) -> Option<&CheckedNode> {
        self.node.as_ref()
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    /// Services whose translation may have changed since the last call, and the trigger times
    /// of their endpoint changes.
    pub fn take_dirty(&mut self) -> Dirty {
        self.svc_pending.clear();
        self.ep_pending.clear();
        Dirty { services: std::mem::take(&mut self.dirty), trigger_times: std::mem::take(&mut self.trigger_times) }
    }

    /// Some Service needs translating again.
    pub fn has_dirty(&self) -> bool {
        !self.dirty.is_empty()
    }

    pub fn change_counts(&self) -> ChangeCounts {
        ChangeCounts {
            service_changes: self.service_changes,
            endpoint_changes: self.endpoint_changes,
            services_pending: self.svc_pending.len(),
            endpoints_pending: self.ep_pending.len(),
        }
    }

    fn service_changed(&mut self, key: &ObjectKey) {
        self.cluster_ip_generation += 1;
        self.service_changes += 1;
        self.svc_pending.insert(key.clone());
        self.dirty.insert(key.clone());
    }

    /// Keeps `claims` up to date for Service `key`, which was `old` (none: it is new) and is
    /// now what the store holds (nothing: removed), and re-translates the Services claiming a
    /// cluster IP it gained or lost. O(1) for a Service without external addresses; an address
    /// claimed for the first time is looked for among the cluster IPs once.
    fn service_addresses_changed(&mut self, key: &ObjectKey, old: Option<&CheckedService>) {
        // Sets: a Service may list 100,000 external IPs, and comparing two such lists pairwise
        // took seconds of the control loop at each update.
        fn claimed(s: Option<&CheckedService>) -> HashSet<std::net::IpAddr> {
            s.map(|s| s.external_ips.iter().chain(&s.lb_ingress).copied().collect()).unwrap_or_default()
        }
        let new = self.services.get(key).map(|s| &**s);
        let (old_claims, new_claims) = (claimed(old), claimed(new));
        for ip in old_claims.iter().filter(|ip| !new_claims.contains(ip)) {
            if let Some(c) = self.claims.get_mut(ip) {
                c.claimants.remove(key);
                if c.claimants.is_empty() {
                    self.claims.remove(ip);
                }
            }
        }
        for ip in new_claims.iter().filter(|ip| !old_claims.contains(ip)) {
            // Its owners are looked for once the event is applied (`resolve_claims`): one pass
            // for all the addresses a list claims, not one each.
            let c = self.claims.entry(*ip).or_default();
            self.claims_unresolved |= !c.resolved;
            c.claimants.insert(key.clone());
        }
        if self.claims.is_empty() {
            return;
        }
        let (old_cluster, new_cluster) = (old.map_or(&[][..], served_cluster_ips), new.map_or(&[][..], served_cluster_ips));
        let mut claimants = Vec::new();
        for ip in old_cluster.iter().filter(|ip| !new_cluster.contains(ip)) {
            if let Some(c) = self.claims.get_mut(ip) {
                c.owners.retain(|k| k != key);
                claimants.extend(c.claimants.iter().cloned());
            }
        }
        for ip in new_cluster.iter().filter(|ip| !old_cluster.contains(ip)) {
            if let Some(c) = self.claims.get_mut(ip) {
                if !c.owners.contains(key) {
                    c.owners.push(key.clone());
                }
                claimants.extend(c.claimants.iter().cloned());
            }
        }
        self.dirty.extend(claimants);
    }

    /// Completes the owners of the addresses claimed since the last call, in one pass over the
    /// Services. Not while a list of Services is in progress: its end does it. (Only theirs: a
    /// ServiceCIDR list that never ends, on a cluster that does not serve them, would leave
    /// every lookup scanning.)
    fn resolve_claims(&mut self) {
        if self.listing.contains_key(&Kind::Service) || !self.claims_unresolved {
            return;
        }
        self.claims_unresolved = false;
        for (key, s) in &self.services {
            for ip in served_cluster_ips(s) {
                if let Some(c) = self.claims.get_mut(ip).filter(|c| !c.resolved && !c.owners.contains(key)) {
                    c.owners.push(key.clone());
                }
            }
        }
        for c in self.claims.values_mut() {
            c.resolved = true;
        }
    }

    /// The Service other than `claimant` whose cluster IP the external or load-balancer address
    /// `ip` is, if any, and that is served: not skipped, and with no cluster IP that is a node
    /// address (such a Service is refused, so it owns nothing). An address not resolved yet
    /// (a list in progress) is looked for among every Service.
    fn claimed_cluster_ip(&self, ip: std::net::IpAddr, claimant: &ObjectKey) -> Option<&ObjectKey> {
        let served = |k: &&ObjectKey| {
            *k != claimant && self.services.get(*k).is_some_and(|s| !s.cluster_ips.iter().any(|a| self.local_addresses.contains(a)))
        };
        let c = self.claims.get(&ip)?;
        if c.resolved {
            c.owners.iter().find(served)
        } else {
            self.services.iter().filter(|(_, s)| served_cluster_ips(s).contains(&ip)).map(|(k, _)| k).find(served)
        }
    }

    fn endpoints_changed(&mut self, service: &ObjectKey, trigger: Option<std::time::SystemTime>) {
        self.endpoint_changes += 1;
        self.ep_pending.insert(service.clone());
        self.dirty.insert(service.clone());
        if let Some(t) = trigger {
            self.trigger_times.entry(service.clone()).or_default().push(t);
        }
    }

    /// The plan of one Service, or none when it does not exist (any more).
    pub fn translate(&self, key: &ObjectKey) -> Translation {
        self.translate_on(key, &self.node_info())
    }

    /// `translate` with this node's identity as `node_info` gives it, taken once by a caller
    /// that translates many Services (and renders them with it).
    pub fn translate_on(&self, key: &ObjectKey, node: &NodeInfo) -> Translation {
        let Some(svc) = self.services.get(key) else {
            return Translation::default();
        };
        let slices: Vec<&CheckedSlice> =
            self.slices_by_service.get(key).into_iter().flatten().filter_map(|k| self.slices.get(k).map(|s| &**s)).collect();
        // A cluster IP that is one of this node's own addresses would capture the node's own
        // traffic to that address (its SSH, its kubelet): refused, as the API server never
        // allocates one.
        if let Some(ip) = svc.cluster_ips.iter().find(|a| self.local_addresses.contains(a)) {
            return Translation {
                notes: vec![format!("refused: cluster IP {ip} is one of this node's own addresses")],
                ..Default::default()
            };
        }
        // An external or load-balancer address that is another Service's cluster IP stays that
        // Service's: served as this one's too, it would take the other's traffic on the ports
        // this one lists (`externalIPs: [<kube-dns's cluster IP>]`). Refused here, the same in
        // every mode. (kube-proxy serves both and leaves this to admission control:
        // CVE-2020-8554.) A Service's own cluster IP as its load-balancer or external address
        // (`minikube tunnel` writes that) is served as its cluster IP, as kube-proxy's cluster
        // IP rule, first, serves it: not as a second frontend of the same address.
        let taken: Vec<(std::net::IpAddr, &ObjectKey)> = svc
            .external_ips
            .iter()
            .chain(&svc.lb_ingress)
            .filter_map(|ip| self.claimed_cluster_ip(*ip, key).map(|owner| (*ip, owner)))
            .collect();
        let own = |ip: &std::net::IpAddr| svc.cluster_ips.contains(ip);
        // Multicast and broadcast external IPs pass the API server, but no node serves them.
        let unservable = |ip: &std::net::IpAddr| super::validate::unservable_external_ip(*ip).is_some();
        if taken.is_empty() && !svc.external_ips.iter().chain(&svc.lb_ingress).any(|ip| own(ip) || unservable(ip)) {
            return translate::service(svc, &slices, node);
        }
        let mut trimmed = svc.clone();
        let refused: HashSet<std::net::IpAddr> = taken.iter().map(|(ip, _)| *ip).collect();
        let keep = |ip: &&std::net::IpAddr| !own(ip) && !refused.contains(*ip) && !unservable(ip);
        trimmed.external_ips = svc.external_ips.iter().filter(keep).copied().collect();
        trimmed.lb_ingress = svc.lb_ingress.iter().filter(keep).copied().collect();
        let mut t = translate::service(&trimmed, &slices, node);
        for (ip, owner) in taken {
            t.notes.push(format!("refused: external address {ip} is Service {owner}'s cluster IP; not served as an external address"));
        }
        // One note however many (the note is logged at each translation of the Service).
        let left_out: Vec<String> = svc
            .external_ips
            .iter()
            .filter(|ip| unservable(ip))
            .map(|ip| format!("{ip} ({})", super::validate::unservable_external_ip(*ip).unwrap_or_default()))
            .collect();
        if !left_out.is_empty() {
            let shown = left_out.iter().take(3).cloned().collect::<Vec<_>>().join(", ");
            let more = if left_out.len() > 3 { format!(" and {} more", left_out.len() - 3) } else { String::new() };
            t.notes
                .push(format!("refused: external addresses no node serves, left out (the rest of the Service is served): {shown}{more}"));
        }
        t
    }

    /// `apply`, logging what it reports (what the agent's loops feed every source event to).
    pub fn apply_logged(&mut self, event: Event) {
        for r in self.apply(event) {
            let message = super::clip(&r.message, 1024);
            if r.warning {
                tracing::warn!(object = %r.object, "{message}");
            } else {
                tracing::info!(object = %r.object, "{message}");
            }
        }
    }

    pub fn apply(&mut self, event: Event) -> Vec<Report> {
        let mut reports = Vec::new();
        match event {
            Event::Replace { kind, objects } => {
                let mut present = BTreeSet::new();
                for obj in objects {
                    if let Some(key) = self.upsert(obj, &mut reports) {
                        present.insert(key);
                    }
                }
                self.end_listing(kind, &present);
            }
            Event::Apply(obj) => {
                self.upsert(obj, &mut reports);
            }
            Event::Delete { kind, key } => self.remove(kind, &key),
            Event::ListBegin { kind } => {
                self.listing.insert(kind, BTreeSet::new());
            }
            Event::Listed(obj) => {
                let kind = obj.kind();
                if let Some(key) = self.upsert(obj, &mut reports) {
                    if let Some(present) = self.listing.get_mut(&kind) {
                        present.insert(key);
                    }
                }
            }
            Event::ListEnd { kind } => {
                // (An end without a beginning lists nothing: everything of the kind goes.)
                let present = self.listing.remove(&kind).unwrap_or_default();
                self.end_listing(kind, &present);
            }
        }
        self.resolve_claims();
        reports
    }

    /// A complete list of `kind` is in: what it did not hold is deleted, and the kind is synced.
    fn end_listing(&mut self, kind: Kind, present: &BTreeSet<ObjectKey>) {
        let stale: Vec<ObjectKey> = self.keys(kind).filter(|k| !present.contains(k)).collect();
        for key in stale {
            self.remove(kind, &key);
        }
        self.synced.insert(kind);
    }

    fn keys(&self, kind: Kind) -> Box<dyn Iterator<Item = ObjectKey> + '_> {
        match kind {
            Kind::Service => Box::new(self.services.keys().cloned()),
            Kind::EndpointSlice => Box::new(self.slices.keys().cloned()),
            Kind::Node => Box::new(self.node.iter().map(|n| ObjectKey::new("", n.name.clone()))),
            Kind::ServiceCidr => Box::new(self.service_cidr_objects.keys().map(|n| ObjectKey::new("", n.clone()))),
        }
    }

    /// `--service-cluster-ip-range`.
    pub fn set_service_cidr_flag(&mut self, cidrs: Vec<Cidr>) {
        self.service_cidr_flag = cidrs;
        self.cluster_ip_generation += 1;
    }

    /// The Service CIDRs (every ServiceCIDR object's, and the flag's; both families, networks, sorted)
    /// and the cluster IPs of the Services this proxy serves: what kube-proxy's
    /// `cluster-ips-check` drops (a free address of the ranges) and rejects (a cluster IP on a
    /// port its Service does not have). No ranges: nothing is checked.
    pub fn cluster_ip_ranges(&self) -> (Vec<Cidr>, BTreeSet<std::net::IpAddr>) {
        let mut cidrs: Vec<Cidr> =
            self.service_cidr_objects.values().flatten().chain(&self.service_cidr_flag).map(|c| c.network()).collect();
        cidrs.sort();
        cidrs.dedup();
        let ips = self
            .services
            .values()
            .filter(|s| s.skip.is_none())
            .flat_map(|s| s.cluster_ips.iter())
            .filter(|a| !self.local_addresses.contains(a))
            .copied()
            .collect();
        (cidrs, ips)
    }

    /// See `cluster_ip_generation`.
    pub fn cluster_ip_generation(&self) -> u64 {
        self.cluster_ip_generation
    }

    /// Validates and stores an object. Returns the key it is known under, also when an invalid
    /// update left the previous version in place (so a Replace does not delete it).
    fn upsert(&mut self, obj: Object, reports: &mut Vec<Report>) -> Option<ObjectKey> {
        match obj {
            Object::Service(svc) => {
                let key = validate::object_key(&svc.metadata);
                match validate::service_with(&svc, &self.rules) {
                    Ok(mut checked) => {
                        if let Some(known) = self.known_service_key(&checked.key) {
                            checked.key = known;
                        }
                        let key = checked.key.clone();
                        self.clear_report(Kind::Service, &key);
                        if self.services.get(&key).map(|s| &**s) != Some(&checked) {
                            let old = self.services.insert(key.clone(), Box::new(checked));
                            self.service_changed(&key);
                            self.service_addresses_changed(&key, old.as_deref());
                        }
                        Some(key)
                    }
                    Err(invalid) => {
                        let key = key.ok();
                        let kept = key.as_ref().is_some_and(|k| self.services.contains_key(k));
                        self.report_invalid(Kind::Service, key.clone(), &invalid.to_string(), kept, reports);
                        key.filter(|_| kept)
                    }
                }
            }
            Object::EndpointSlice(slice) => {
                let key = validate::object_key(&slice.metadata);
                match validate::endpoint_slice(&slice) {
                    Ok(Ok(mut checked)) => {
                        self.share_node_names(&mut checked);
                        if let Some(known) = self.known_service_key(&checked.service) {
                            checked.service = known;
                        }
                        if let Some((known, _)) = self.slices.get_key_value(&checked.key) {
                            checked.key = known.clone();
                        }
                        let key = checked.key.clone();
                        self.clear_report(Kind::EndpointSlice, &key);
                        if self.slices.get(&key).map(|s| &**s) != Some(&checked) {
                            // Relabelled to another Service: the old one loses these endpoints.
                            if let Some(old) = self.unlink_slice(&key) {
                                if old.service != checked.service {
                                    self.endpoints_changed(&old.service, None);
                                }
                            }
                            super::insert_sorted(self.slices_by_service.entry(checked.service.clone()).or_default(), key.clone());
                            self.endpoints_changed(&checked.service.clone(), checked.trigger_time);
                            self.slices.insert(key.clone(), Box::new(checked));
                        }
                        Some(key)
                    }
                    Ok(Err(ignored)) => {
                        let key = key.ok()?;
                        // It may have been ours before (say, its label was removed).
                        if let Some(old) = self.unlink_slice(&key) {
                            self.endpoints_changed(&old.service, None);
                        }
                        let message = format!("ignored: {ignored}");
                        if self.reported.get(&(Kind::EndpointSlice, key.clone())) != Some(&message) {
                            reports.push(Report {
                                warning: matches!(ignored, validate::SliceIgnored::NoServiceLabel),
                                object: format!("EndpointSlice {key}"),
                                message: message.clone(),
                            });
                            self.reported.insert((Kind::EndpointSlice, key), message);
                        }
                        None
                    }
                    Err(invalid) => {
                        let key = key.ok();
                        let kept = key.as_ref().is_some_and(|k| self.slices.contains_key(k));
                        self.report_invalid(Kind::EndpointSlice, key.clone(), &invalid.to_string(), kept, reports);
                        key.filter(|_| kept)
                    }
                }
            }
            Object::Node(node) => {
                let checked = match validate::node(&node) {
                    Ok(n) => n,
                    Err(invalid) => {
                        self.report_invalid(Kind::Node, None, &invalid.to_string(), false, reports);
                        return None;
                    }
                };
                if checked.name != self.node_name {
                    return None;
                }
                let key = ObjectKey::new("", checked.name.clone());
                let before = self.node_info();
                self.node = Some(checked);
                // Zone (topology) and primary address (NodePorts) shape every translation.
                if self.node_info() != before {
                    self.dirty.extend(self.services.keys().cloned());
                }
                Some(key)
            }
            Object::ServiceCidr(obj) => {
                // Cluster-scoped: the name alone.
                let key = validate::names(&obj.metadata).ok().map(|(_, name)| ObjectKey::new("", name));
                match validate::service_cidr(&obj) {
                    Ok(cidrs) => {
                        let key = key?;
                        self.clear_report(Kind::ServiceCidr, &key);
                        if self.service_cidr_objects.get(key.name()) != Some(&cidrs) {
                            self.service_cidr_objects.insert(key.name().to_string(), cidrs);
                            self.cluster_ip_generation += 1;
                        }
                        Some(key)
                    }
                    Err(invalid) => {
                        let kept = key.as_ref().is_some_and(|k| self.service_cidr_objects.contains_key(k.name()));
                        self.report_invalid(Kind::ServiceCidr, key.clone(), &invalid.to_string(), kept, reports);
                        key.filter(|_| kept)
                    }
                }
            }
        }
    }

    fn remove(&mut self, kind: Kind, key: &ObjectKey) {
        self.reported.remove(&(kind, key.clone()));
        match kind {
            Kind::Service => {
                if let Some(old) = self.services.remove(key) {
                    self.service_changed(key);
                    self.service_addresses_changed(key, Some(&old));
                }
            }
            Kind::EndpointSlice => {
                if let Some(old) = self.unlink_slice(key) {
                    self.endpoints_changed(&old.service, None);
                }
            }
            Kind::Node => {
                if self.node.as_ref().is_some_and(|n| n.name == key.name()) {
                    self.node = None;
                    self.dirty.extend(self.services.keys().cloned());
                }
            }
            Kind::ServiceCidr => {
                if self.service_cidr_objects.remove(key.name()).is_some() {
                    self.cluster_ip_generation += 1;
                }
            }
        }
    }

    /// The store's copy of a Service's key, if it holds one: an update, and each EndpointSlice
    /// of the Service, then share it (a key is an allocation, and 30,000 Services have as many
    /// slices) instead of keeping one more copy each.
    fn known_service_key(&self, key: &ObjectKey) -> Option<ObjectKey> {
        let held = self.services.get_key_value(key).map(|(k, _)| k);
        held.or_else(|| self.slices_by_service.get_key_value(key).map(|(k, _)| k)).cloned()
    }

    /// Points `slice`'s endpoints at the store's copy of their node's name: a cluster has a few
    /// hundred nodes, and 120,000 endpoints each held its own copy of one of their names.
    fn share_node_names(&mut self, slice: &mut CheckedSlice) {
        for name in slice.endpoints.iter_mut().filter_map(|e| e.node_name.as_mut()) {
            match self.node_names.get(name) {
                Some(shared) => *name = shared.clone(),
                None => {
                    self.node_names.insert(name.clone());
                }
            }
        }
        // Nodes come and go: once the set has doubled, names only the set holds are dropped.
        if self.node_names.len() > 2 * self.node_names_kept.max(64) {
            self.node_names.retain(|n| Arc::strong_count(n) > 1);
            self.node_names_kept = self.node_names.len();
        }
    }

    /// Takes a slice out of the indexes, without counting it as a change.
    fn unlink_slice(&mut self, key: &ObjectKey) -> Option<Box<CheckedSlice>> {
        let old = self.slices.remove(key)?;
        if let Some(set) = self.slices_by_service.get_mut(&old.service) {
            set.retain(|k| k != key);
            if set.is_empty() {
                self.slices_by_service.remove(&old.service);
            }
        }
        Some(old)
    }

    fn clear_report(&mut self, kind: Kind, key: &ObjectKey) {
        self.reported.remove(&(kind, key.clone()));
    }

    fn report_invalid(&mut self, kind: Kind, key: Option<ObjectKey>, problem: &str, kept: bool, reports: &mut Vec<Report>) {
        let consequence = if kept { "keeping the previous version" } else { "ignoring it" };
        let message = format!("rejected: {problem}; {consequence}");
        let object = match &key {
            Some(k) => format!("{} {k}", kind.as_str()),
            None => format!("{} (unnamed)", kind.as_str()),
        };
        if let Some(k) = key {
            if self.reported.get(&(kind, k.clone())) == Some(&message) {
                return;
            }
            self.reported.insert((kind, k), message.clone());
        }
        reports.push(Report { warning: true, object, message });
    }

    /// Number of slices per Service, for tests and diagnostics.
    pub fn slice_counts(&self) -> BTreeMap<ObjectKey, usize> {
        self.slices_by_service.iter().map(|(k, v)| (k.clone(), v.len())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frontend, FrontendKey};

    /// The eBPF dataplane's frontends of a Service: what most of these checks look at.
    fn frontends(s: &Store, key: &ObjectKey) -> Vec<(FrontendKey, Frontend)> {
        crate::dataplane::ebpf::frontends::render(&s.translate(key).ports, &s.node_info())
    }

    fn svc(yaml: &str) -> Object {
        Object::Service(Box::new(serde_yaml::from_str(yaml).unwrap()))
    }

    fn slice(yaml: &str) -> Object {
        Object::EndpointSlice(Box::new(serde_yaml::from_str(yaml).unwrap()))
    }

    const WEB: &str = "metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}";
    const WEB_SLICE: &str = "metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.1.0.1]}]";

    fn web() -> ObjectKey {
        ObjectKey::new("default", "web")
    }

    fn service_cidr(yaml: &str) -> Object {
        Object::ServiceCidr(Box::new(serde_yaml::from_str(yaml).unwrap()))
    }

    #[test]
    fn service_cidrs_and_the_cluster_ips_in_them() {
        let mut s = Store::new("n");
        let generation = s.cluster_ip_generation();
        s.apply(Event::Apply(svc(WEB)));
        s.apply(Event::Apply(svc("metadata: {name: headless}\nspec: {clusterIP: None, ports: [{port: 80}]}")));
        assert!(s.cluster_ip_generation() > generation, "a Service change moves the generation");
        let (cidrs, ips) = s.cluster_ip_ranges();
        assert!(cidrs.is_empty());
        assert_eq!(ips, ["10.96.0.10".parse().unwrap()].into(), "headless Services hold no cluster IP");
        let before = s.cluster_ip_generation();
        let reports = s.apply(Event::Replace {
            kind: Kind::ServiceCidr,
            objects: vec![
                service_cidr("metadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.1/16, 'fd00:10:96::/112']}"),
                service_cidr("metadata: {name: extra}\nspec: {cidrs: [010.100.000.000/24]}"),
                service_cidr("metadata: {name: bad}\nspec: {cidrs: [10.0.0.0/8, 10.1.0.0/16]}"),
                service_cidr("metadata: {name: worse}\nspec: {cidrs: [not-a-cidr]}"),
            ],
        });
        assert!(s.cluster_ip_generation() > before);
        let text: Vec<String> = reports.iter().map(|r| format!("{}: {}", r.object, r.message)).collect();
        assert!(text.iter().any(|t| t.contains("ServiceCIDR /bad") && t.contains("a second range of the same family")), "{text:?}");
        assert!(text.iter().any(|t| t.contains("ServiceCIDR /worse") && t.contains("\"not-a-cidr\" is not a CIDR")), "{text:?}");
        let (cidrs, _) = s.cluster_ip_ranges();
        assert_eq!(
            cidrs,
            vec!["10.96.0.0/16".parse().unwrap(), "10.100.0.0/24".parse().unwrap(), "fd00:10:96::/112".parse().unwrap()],
            "networks of both families, sorted; the invalid ones left out"
        );
        // The flag adds to them; deleting an object takes its ranges away.
        s.set_service_cidr_flag(vec!["10.200.0.0/16".parse().unwrap()]);
        s.apply(Event::Delete { kind: Kind::ServiceCidr, key: ObjectKey::new("", "extra") });
        let v4: Vec<Cidr> = s.cluster_ip_ranges().0.into_iter().filter(|c| c.family() == super::super::Family::V4).collect();
        assert_eq!(v4, vec!["10.96.0.0/16".parse().unwrap(), "10.200.0.0/16".parse().unwrap()]);
        // A cluster IP that is a node address is not the Service's (it is refused).
        s.set_local_addresses(vec!["10.96.0.10".parse().unwrap()]);
        assert!(s.cluster_ip_ranges().1.is_empty());
    }

    /// A multicast or broadcast external IP, which the API server accepts, is left out with a
    /// note; the Service's other addresses are served.
    #[test]
    fn an_unservable_external_ip_is_left_out_and_the_rest_served() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc(
            "metadata: {name: m}\nspec: {clusterIP: 10.96.0.9, externalIPs: [239.1.2.3, 192.0.2.7, 255.255.255.255], ports: [{port: 80}]}",
        )));
        let key = ObjectKey::new("default", "m");
        let addresses: Vec<String> = frontends(&s, &key).iter().map(|(k, _)| k.addr.to_string()).collect();
        assert_eq!(addresses, ["10.96.0.9", "192.0.2.7"]);
        assert_eq!(
            s.translate(&key).notes,
            ["refused: external addresses no node serves, left out (the rest of the Service is served): 239.1.2.3 (a multicast address), 255.255.255.255 (the broadcast address)"]
        );
        // However many, one note.
        let many: Vec<String> = (1..=200).map(|i| format!("239.1.{}.{}", i / 250, i % 250)).collect();
        s.apply(Event::Apply(svc(&format!(
            "metadata: {{name: m}}\nspec: {{clusterIP: 10.96.0.9, externalIPs: [{}], ports: [{{port: 80}}]}}",
            many.join(", ")
        ))));
        let notes = s.translate(&key).notes;
        assert_eq!(notes.len(), 1);
        assert!(notes[0].ends_with("239.1.0.3 (a multicast address) and 197 more"), "{notes:?}");
    }

    /// The eBPF dataplane checks a Service's frontends by group (cluster IPs, node ports,
    /// load-balancer IPs, external IPs), each address once, before copying them out.
    #[test]
    fn frontends_come_in_groups_of_one_value_each_address_once() {
        use crate::model::FrontendKind;
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc(
            "metadata: {name: g}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.9, externalIPs: [192.0.2.7, 192.0.2.8, 192.0.2.7], ports: [{port: 80, nodePort: 30080}]}\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.1}]}}",
        )));
        s.set_local_addresses(vec!["172.18.0.2".parse().unwrap()]);
        let key = ObjectKey::new("default", "g");
        let groups = crate::dataplane::ebpf::frontends::render_groups(&s.translate(&key).ports, &s.node_info());
        let shape: Vec<(FrontendKind, Vec<String>)> =
            groups.iter().map(|g| (g.frontend.kind, g.keys.iter().map(|k| format!("{}:{}", k.addr, k.port)).collect())).collect();
        let want = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            shape,
            [
                (FrontendKind::ClusterIp, want(&["10.96.0.9:80"])),
                (FrontendKind::NodePort, want(&["172.18.0.2:30080"])),
                (FrontendKind::LoadBalancer, want(&["203.0.113.1:80"])),
                (FrontendKind::ExternalIp, want(&["192.0.2.7:80", "192.0.2.8:80"])),
            ]
        );
        let flat = frontends(&s, &key);
        assert_eq!(flat.len(), 5, "one frontend per address: {flat:?}");
    }

    /// Claims wait for a Service list in progress, and for nothing else: a cluster without
    /// ServiceCIDRs begins their list at every retry and never ends it.
    #[test]
    fn claims_are_resolved_while_another_kinds_list_never_ends() {
        let claimant = || svc("metadata: {name: lb}\nspec: {clusterIP: 10.96.0.9, externalIPs: [192.0.2.7], ports: [{port: 80}]}");
        let resolved = |s: &Store| s.claims.values().all(|c| c.resolved);
        let mut s = Store::new("n");
        s.apply(Event::ListBegin { kind: Kind::ServiceCidr });
        s.apply(Event::Apply(claimant()));
        assert!(resolved(&s) && !s.claims_unresolved, "resolved at once");
        s.apply(Event::ListBegin { kind: Kind::Service });
        s.apply(Event::Listed(svc("metadata: {name: lb2}\nspec: {clusterIP: 10.96.0.8, externalIPs: [192.0.2.8], ports: [{port: 80}]}")));
        assert!(!resolved(&s), "not while the Services are listed");
        s.apply(Event::ListEnd { kind: Kind::Service });
        assert!(resolved(&s) && !s.claims_unresolved);
    }

    #[test]
    fn an_external_address_that_is_a_cluster_ip_stays_that_services() {
        const DNS: &str = "metadata: {name: kube-dns, namespace: kube-system}\nspec: {clusterIP: 10.96.0.10, ports: [{name: dns, port: 53, protocol: UDP}]}";
        let evil = || {
            svc("metadata: {name: aaa, namespace: aaa}\nspec: {clusterIP: 10.96.0.99, externalIPs: [10.96.0.10, 192.0.2.7], ports: [{name: dns, port: 53, protocol: UDP}]}")
        };
        let (dns, aaa) = (ObjectKey::new("kube-system", "kube-dns"), ObjectKey::new("aaa", "aaa"));
        let addresses = |s: &Store, key: &ObjectKey| -> Vec<String> { frontends(s, key).iter().map(|(k, _)| k.addr.to_string()).collect() };
        // The claim comes first (as a list in name order brings it), the owner after: the
        // claimant is translated again, and its claim refused.
        let mut s = Store::new("n");
        s.apply(Event::Apply(evil()));
        assert_eq!(addresses(&s, &aaa), ["10.96.0.99", "10.96.0.10", "192.0.2.7"], "no Service has 10.96.0.10 yet");
        s.take_dirty();
        s.apply(Event::Apply(svc(DNS)));
        assert_eq!(s.take_dirty().services, BTreeSet::from([dns.clone(), aaa.clone()]), "the claimant is translated again");
        assert_eq!(addresses(&s, &aaa), ["10.96.0.99", "192.0.2.7"]);
        assert_eq!(addresses(&s, &dns), ["10.96.0.10"]);
        let notes = s.translate(&aaa).notes;
        assert_eq!(
            notes,
            ["refused: external address 10.96.0.10 is Service kube-system/kube-dns's cluster IP; not served as an external address"]
        );
        // The owner first: the same.
        let mut other = Store::new("n");
        other.apply(Event::Apply(svc(DNS)));
        other.apply(Event::Apply(evil()));
        assert_eq!(addresses(&other, &aaa), ["10.96.0.99", "192.0.2.7"]);
        // An owner another proxy serves (labelled), or whose cluster IP is a node address (it
        // is refused), owns nothing here; unlabelled, it owns the address again.
        s.take_dirty();
        s.apply(Event::Apply(svc(
            &DNS.replace("namespace: kube-system}", "namespace: kube-system, labels: {service.kubernetes.io/service-proxy-name: other}}")
        )));
        assert!(s.take_dirty().services.contains(&aaa), "the claimant is translated again");
        assert_eq!(addresses(&s, &aaa), ["10.96.0.99", "10.96.0.10", "192.0.2.7"]);
        s.apply(Event::Apply(svc(DNS)));
        assert!(s.take_dirty().services.contains(&aaa));
        assert_eq!(addresses(&s, &aaa), ["10.96.0.99", "192.0.2.7"]);
        // (NodePorts on the primary IP: a node address change then re-translates only the
        // Services it concerns.)
        s.set_nodeport_config(NodePortAddresses::Primary);
        s.take_dirty();
        s.set_local_addresses(vec!["10.96.0.10".parse().unwrap()]);
        assert!(s.take_dirty().services.contains(&aaa));
        assert_eq!(addresses(&s, &aaa), ["10.96.0.99", "10.96.0.10", "192.0.2.7"]);
        s.set_local_addresses(vec![]);
        assert!(s.take_dirty().services.contains(&aaa));
        assert_eq!(addresses(&s, &aaa), ["10.96.0.99", "192.0.2.7"]);
        // The owner gone, the address is the claimant's.
        s.take_dirty();
        s.apply(Event::Delete { kind: Kind::Service, key: dns.clone() });
        assert!(s.take_dirty().services.contains(&aaa), "the claimant is translated again");
        assert_eq!(addresses(&s, &aaa), ["10.96.0.99", "10.96.0.10", "192.0.2.7"]);
        // A load-balancer address is checked the same way; a Service's own cluster IP as its
        // load-balancer address (`minikube tunnel`) is served, as its cluster IP.
        let lb = |ingress: &str| {
            svc(&format!("metadata: {{name: lb}}\nspec: {{type: LoadBalancer, clusterIP: 10.96.0.20, ports: [{{port: 80, nodePort: 30080}}]}}\nstatus: {{loadBalancer: {{ingress: [{{ip: {ingress}}}, {{ip: 203.0.113.9}}]}}}}"))
        };
        let lb_key = ObjectKey::new("default", "lb");
        let lb_at = |s: &Store, addr: &str| {
            frontends(s, &lb_key).iter().any(|(k, f)| k.addr.to_string() == addr && f.kind == crate::model::FrontendKind::LoadBalancer)
        };
        s.apply(Event::Apply(lb("10.96.0.99")));
        assert!(!lb_at(&s, "10.96.0.99") && lb_at(&s, "203.0.113.9"), "aaa's cluster IP");
        assert!(s.translate(&lb_key).notes.iter().any(|n| n.contains("10.96.0.99 is Service aaa/aaa's cluster IP")));
        s.apply(Event::Apply(lb("10.96.0.20")));
        let own =
            frontends(&s, &lb_key).into_iter().filter(|(k, _)| k.addr.to_string() == "10.96.0.20").map(|(_, f)| f.kind).collect::<Vec<_>>();
        assert_eq!(own, [crate::model::FrontendKind::ClusterIp], "its own cluster IP, served as its cluster IP");
        assert!(lb_at(&s, "203.0.113.9"));
        assert!(s.translate(&lb_key).notes.is_empty(), "{:?}", s.translate(&lb_key).notes);
        // A dual-stack owner whose other cluster IP becomes a node address is refused whole:
        // it owns neither address then.
        s.apply(Event::Apply(svc("metadata: {name: ds}\nspec: {clusterIP: 10.96.0.30, clusterIPs: [10.96.0.30, 'fd00::30'], ipFamilies: [IPv4, IPv6], ports: [{port: 80}]}")));
        s.apply(Event::Apply(svc("metadata: {name: c2}\nspec: {clusterIP: 10.96.0.31, externalIPs: [10.96.0.30], ports: [{port: 80}]}")));
        let c2 = ObjectKey::new("default", "c2");
        assert_eq!(addresses(&s, &c2), ["10.96.0.31"]);
        s.take_dirty();
        s.set_local_addresses(vec!["fd00::30".parse().unwrap()]);
        assert!(s.take_dirty().services.contains(&c2), "the claimant is translated again");
        assert_eq!(addresses(&s, &c2), ["10.96.0.31", "10.96.0.30"]);
    }

    #[test]
    fn a_cluster_ip_that_is_a_node_address_is_refused_while_it_is_one() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc(WEB)));
        s.apply(Event::Apply(slice(WEB_SLICE)));
        s.take_dirty();
        s.set_local_addresses(vec!["10.96.0.10".parse().unwrap(), "192.168.1.5".parse().unwrap()]);
        assert!(s.take_dirty().services.contains(&web()), "the address change re-checks the Service");
        let t = s.translate(&web());
        assert!(t.ports.is_empty());
        assert_eq!(t.notes, ["refused: cluster IP 10.96.0.10 is one of this node's own addresses"]);
        s.set_local_addresses(vec!["192.168.1.5".parse().unwrap()]);
        assert!(s.take_dirty().services.contains(&web()));
        assert_eq!(frontends(&s, &web()).len(), 1, "programmed again once it is not");
    }

    #[test]
    fn endpoints_share_one_copy_of_their_node_name_and_unused_names_go() {
        let mut s = Store::new("n");
        let on = |slice: &str, node: &str| {
            format!("metadata: {{name: {slice}, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{port: 8080}}]\nendpoints: [{{addresses: [10.1.0.1], nodeName: {node}}}]")
        };
        s.apply(Event::Apply(slice(&on("web-1", "node-a"))));
        s.apply(Event::Apply(slice(&on("web-2", "node-a"))));
        let name = |s: &Store, slice: &str| s.slices[&ObjectKey::new("default", slice)].endpoints[0].node_name.clone().unwrap();
        assert_eq!(name(&s, "web-1").as_str(), "node-a");
        assert!(Arc::ptr_eq(&name(&s, "web-1"), &name(&s, "web-2")), "one copy of the name");
        // Endpoints move over many nodes: names no endpoint holds any more are dropped.
        for i in 0..300 {
            s.apply(Event::Apply(slice(&on("web-2", &format!("node-{i}")))));
        }
        assert!(s.node_names.len() <= 130, "{} names kept", s.node_names.len());
        assert!(s.node_names.iter().any(|n| n.as_str() == "node-a"), "still held by web-1");
        assert!(s.node_names.iter().any(|n| n.as_str() == "node-299"));
    }

    #[test]
    fn a_service_and_its_slices_share_one_copy_of_its_key() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(slice(WEB_SLICE)));
        s.apply(Event::Apply(svc(WEB)));
        s.apply(Event::Apply(svc(&WEB.replace("port: 80", "port: 81"))));
        let slice_key = ObjectKey::new("default", "web-1");
        s.apply(Event::Apply(slice(&WEB_SLICE.replace("10.1.0.1", "10.1.0.2"))));
        let (held, service) = s.services.get_key_value(&web()).unwrap();
        assert_eq!(service.ports[0].port, 81);
        assert!(held.shares(&service.key), "an update keeps the key the map holds");
        let (slice_held, checked) = s.slices.get_key_value(&slice_key).unwrap();
        assert!(checked.service.shares(held), "the slice names its Service with the Service's own key");
        assert!(slice_held.shares(&checked.key));
        assert!(s.slices_by_service.get_key_value(&web()).unwrap().0.shares(held));
    }

    #[test]
    fn slice_before_its_service_is_used_once_the_service_arrives() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(slice(WEB_SLICE)));
        assert!(frontends(&s, &web()).is_empty());
        s.apply(Event::Apply(svc(WEB)));
        let t = frontends(&s, &web());
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].1.backends.len(), 1);
    }

    #[test]
    fn a_slice_change_dirties_only_its_service() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc(WEB)));
        s.apply(Event::Apply(svc("metadata: {name: other}\nspec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}")));
        s.take_dirty();
        s.apply(Event::Apply(slice(WEB_SLICE)));
        assert_eq!(s.take_dirty().services, BTreeSet::from([web()]));
        // The same object again changes nothing.
        s.apply(Event::Apply(slice(WEB_SLICE)));
        assert!(s.take_dirty().services.is_empty());
    }

    #[test]
    fn a_list_in_pieces_deletes_what_it_did_not_hold_only_at_its_end() {
        let mut s = Store::new("n");
        let other = "metadata: {name: other}\nspec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}";
        s.apply(Event::ListBegin { kind: Kind::Service });
        s.apply(Event::Listed(svc(WEB)));
        s.apply(Event::Listed(svc(other)));
        assert!(!s.synced(&[Kind::Service]), "not before the list ends");
        s.apply(Event::ListEnd { kind: Kind::Service });
        assert!(s.synced(&[Kind::Service]));
        assert_eq!(s.take_dirty().services.len(), 2);
        // A relist without `other`: it stays until the list ends, then goes; `web` is untouched.
        s.apply(Event::ListBegin { kind: Kind::Service });
        s.apply(Event::Listed(svc(WEB)));
        assert!(s.take_dirty().services.is_empty(), "the same object again changes nothing");
        s.apply(Event::Apply(slice(WEB_SLICE)));
        s.apply(Event::ListEnd { kind: Kind::Service });
        let other_key = ObjectKey::new("default", "other");
        assert_eq!(s.take_dirty().services, BTreeSet::from([web(), other_key.clone()]));
        assert!(frontends(&s, &other_key).is_empty());
        assert_eq!(frontends(&s, &web()).len(), 1, "objects of other kinds are not the list's business");
    }

    #[test]
    fn replace_deletes_what_is_missing_and_marks_synced() {
        let mut s = Store::new("n");
        assert!(!s.synced(&[Kind::Service]));
        s.apply(Event::Replace { kind: Kind::Service, objects: vec![svc(WEB)] });
        assert!(s.synced(&[Kind::Service]));
        s.take_dirty();
        s.apply(Event::Replace { kind: Kind::Service, objects: vec![] });
        assert_eq!(s.take_dirty().services, BTreeSet::from([web()]));
        assert!(frontends(&s, &web()).is_empty());
    }

    #[test]
    fn an_invalid_update_keeps_the_previous_version_and_is_reported_once() {
        let mut s = Store::new("n");
        s.apply(Event::Replace { kind: Kind::Service, objects: vec![svc(WEB)] });
        let bad = "metadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 70000}]}";
        let reports = s.apply(Event::Replace { kind: Kind::Service, objects: vec![svc(bad)] });
        assert_eq!(reports.len(), 1);
        assert_eq!(reports[0].object, "Service default/web");
        assert!(
            reports[0].message.contains("70000 is out of range") && reports[0].message.contains("keeping the previous version"),
            "{reports:?}"
        );
        assert_eq!(frontends(&s, &web()).len(), 1, "the good version must stay programmed");
        assert!(s.apply(Event::Replace { kind: Kind::Service, objects: vec![svc(bad)] }).is_empty(), "reported once");
    }

    #[test]
    fn a_slice_that_loses_its_label_leaves_its_service() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc(WEB)));
        s.apply(Event::Apply(slice(WEB_SLICE)));
        let reports = s.apply(Event::Apply(slice(
            "metadata: {name: web-1}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints: [{addresses: [10.1.0.1]}]",
        )));
        assert!(reports[0].message.contains("kubernetes.io/service-name"), "{reports:?}");
        assert!(frontends(&s, &web())[0].1.backends.is_empty());
    }

    #[test]
    fn a_slice_relabelled_to_another_service_leaves_the_first() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc(WEB)));
        s.apply(Event::Apply(svc("metadata: {name: other}\nspec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}")));
        s.apply(Event::Apply(slice(WEB_SLICE)));
        s.take_dirty();
        s.apply(Event::Apply(slice(&WEB_SLICE.replace("service-name: web", "service-name: other"))));
        assert_eq!(s.take_dirty().services, BTreeSet::from([web(), ObjectKey::new("default", "other")]));
        assert!(frontends(&s, &web())[0].1.backends.is_empty());
    }

    #[test]
    fn nodeport_addresses_follow_the_flag_and_the_node() {
        let np = "metadata: {name: web}\nspec: {type: NodePort, clusterIP: 10.96.0.10, ports: [{port: 80, nodePort: 30080}]}";
        let addrs = |s: &Store| frontends(s, &web()).iter().skip(1).map(|(k, _)| k.addr.to_string()).collect::<Vec<_>>();
        let mut s = Store::new("node-a");
        s.apply(Event::Apply(svc(np)));
        s.set_local_addresses(vec!["127.0.0.1".parse().unwrap(), "192.168.1.5".parse().unwrap(), "10.0.0.5".parse().unwrap()]);
        assert_eq!(addrs(&s), ["10.0.0.5", "192.168.1.5"], "all node addresses but loopback");
        s.set_nodeport_config("192.168.0.0/16".parse().unwrap());
        assert_eq!(addrs(&s), ["192.168.1.5"]);
        s.set_nodeport_config("primary".parse().unwrap());
        assert!(addrs(&s).is_empty(), "no Node yet, so no primary address");
        s.take_dirty();
        s.apply(Event::Apply(Object::Node(Box::new(
            serde_yaml::from_str(
                "metadata: {name: node-a}\nstatus: {addresses: [{type: Hostname, address: a}, {type: InternalIP, address: 10.0.0.5}]}",
            )
            .unwrap(),
        ))));
        assert_eq!(addrs(&s), ["10.0.0.5"]);
        assert!(s.take_dirty().services.contains(&web()), "a new primary address re-translates");
        assert!("10.0.0.0/33".parse::<NodePortAddresses>().is_err());
        assert!("bogus".parse::<NodePortAddresses>().is_err());
        // Per family, as kube-proxy reads the flag: a family it names no range of has NodePorts
        // on all of its addresses; link-local IPv6 addresses are never NodePort addresses.
        s.set_local_addresses(["192.168.1.5", "10.0.0.5", "fd00::5", "fe80::5", "2001:db8::5"].map(|a| a.parse().unwrap()).to_vec());
        s.set_nodeport_config("192.168.0.0/16".parse().unwrap());
        let all = |s: &Store| s.node_info().nodeport_addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        assert_eq!(all(&s), ["192.168.1.5", "2001:db8::5", "fd00::5"]);
        s.set_nodeport_config("fd00::/64".parse().unwrap());
        assert_eq!(all(&s), ["10.0.0.5", "192.168.1.5", "fd00::5"]);
        let cfg: NodePortAddresses = "192.168.0.0/16,fd00::/64".parse().unwrap();
        assert!(!cfg.all_of(super::super::Family::V4) && !cfg.all_of(super::super::Family::V6));
        assert!(NodePortAddresses::All.all_of(super::super::Family::V6) && !NodePortAddresses::Primary.all_of(super::super::Family::V4));
    }

    #[test]
    fn node_zone_change_retranslates_everything() {
        let mut s = Store::new("node-a");
        s.apply(Event::Apply(svc(WEB)));
        s.take_dirty();
        s.apply(Event::Apply(Object::Node(Box::new(
            serde_yaml::from_str("metadata: {name: node-b, labels: {topology.kubernetes.io/zone: z}}").unwrap(),
        ))));
        assert!(s.take_dirty().services.is_empty(), "other nodes do not matter");
        s.apply(Event::Apply(Object::Node(Box::new(
            serde_yaml::from_str("metadata: {name: node-a, labels: {topology.kubernetes.io/zone: z}}").unwrap(),
        ))));
        assert_eq!(s.node_info().zone.as_deref(), Some("z"));
        assert_eq!(s.take_dirty().services, BTreeSet::from([web()]));
    }

    #[test]
    fn changes_are_counted_as_kube_proxy_counts_them() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc(WEB)));
        s.apply(Event::Apply(slice(WEB_SLICE)));
        s.apply(Event::Apply(slice(&WEB_SLICE.replace("web-1", "web-2"))));
        let c = s.change_counts();
        assert_eq!((c.service_changes, c.endpoint_changes, c.services_pending, c.endpoints_pending), (1, 2, 1, 1));
        s.apply(Event::Apply(slice(WEB_SLICE)));
        assert_eq!(s.change_counts().endpoint_changes, 2, "an unchanged object is no change");
        s.take_dirty();
        let c = s.change_counts();
        assert_eq!((c.services_pending, c.endpoints_pending), (0, 0));
    }

    #[test]
    fn trigger_times_of_slice_changes_are_handed_over_once() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc(WEB)));
        let annotated = "metadata: {name: web-1, labels: {kubernetes.io/service-name: web}, annotations: {endpoints.kubernetes.io/last-change-trigger-time: '2026-11-21T09:00:00Z'}}\naddressType: IPv4\nendpoints: [{addresses: [10.1.0.1]}]";
        s.apply(Event::Apply(slice(annotated)));
        let d = s.take_dirty();
        assert_eq!(d.trigger_times.get(&web()).map(Vec::len), Some(1));
        assert!(s.take_dirty().trigger_times.is_empty());
    }

    #[test]
    fn a_slice_that_outlives_its_service_is_used_again_when_the_service_returns() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc(WEB)));
        s.apply(Event::Apply(slice(WEB_SLICE)));
        s.apply(Event::Delete { kind: Kind::Service, key: web() });
        assert!(frontends(&s, &web()).is_empty());
        s.apply(Event::Apply(svc(WEB)));
        assert_eq!(frontends(&s, &web())[0].1.backends.len(), 1);
    }

    #[test]
    fn a_selectorless_service_uses_hand_made_slices_of_any_name() {
        let mut s = Store::new("n");
        s.apply(Event::Apply(svc("metadata: {name: external-db}\nspec: {clusterIP: 10.96.0.20, ports: [{port: 5432}]}")));
        s.apply(Event::Apply(slice("metadata: {name: my-own-slice, labels: {kubernetes.io/service-name: external-db}}\naddressType: IPv4\nports: [{port: 5432}]\nendpoints: [{addresses: [192.168.10.5]}]")));
        let t = frontends(&s, &ObjectKey::new("default", "external-db"));
        assert_eq!(t[0].1.backends[0].addr.to_string(), "192.168.10.5");
    }

    #[test]
    fn zone_hints_follow_the_node_label() {
        let mut s = Store::new("node-a");
        s.apply(Event::Apply(svc(WEB)));
        s.apply(Event::Apply(slice("metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{port: 8080}]\nendpoints:\n- {addresses: [10.1.0.1], hints: {forZones: [{name: z1}]}}\n- {addresses: [10.1.0.2], hints: {forZones: [{name: z2}]}}\n")));
        assert_eq!(frontends(&s, &web())[0].1.backends.len(), 2, "no Node yet: no zone, hints ignored");
        s.apply(Event::Apply(Object::Node(Box::new(
            serde_yaml::from_str("metadata: {name: node-a, labels: {topology.kubernetes.io/zone: z2}}").unwrap(),
        ))));
        let b = &frontends(&s, &web())[0].1.backends;
        assert_eq!(b.iter().map(|b| b.addr.to_string()).collect::<Vec<_>>(), ["10.1.0.2"]);
    }
}
