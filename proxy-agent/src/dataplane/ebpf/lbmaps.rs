//! The load-balancer map writer. It keeps the agent's picture of what the maps hold (rebuilt
//! from the maps at start) and applies per-frontend changes make-before-break:
//! backends -> new slots -> reverse NAT -> source ranges -> Maglev table -> affinity matches ->
//! existing slots -> master -> surplus slots -> stale affinity matches and source ranges ->
//! unused backends. A packet never sees a
//! count that points at a missing slot or a slot that names a missing backend.
//!
//! A frontend whose outside clients get other backends than pods (externalTrafficPolicy Local)
//! has two scopes: the internal one is written completely before the external master points
//! at it (`TWO_SCOPES`), and removed only after the master stopped pointing at it.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap as StdHashMap, HashSet},
    io,
    net::IpAddr,
};

use aya::{
    maps::{
        lpm_trie::{Key, LpmTrie},
        Array, HashMap, MapData, MapError,
    },
    Ebpf,
};
use proxy_common::{
    backend_flags, filter, limits, scope, svc_flags, user::MapAddr, AffinityMatchKey, Backend, BackendFlows, RevNat, ServiceKey,
    ServiceName, ServiceValue, SourceRangeKey,
};

use super::{
    filter::Filter,
    ids::{assign_slots, ById, IdAllocator},
    maglev::{self, Maglev},
    snapshot,
    tables::Table,
};
use crate::{
    dataplane::DataplaneError,
    model::{self, store::Cidr, Frontend, FrontendKey, Protocol},
};

/// A frontend in one scope (`proxy_common::scope`).
type Scoped = (FrontendKey, u8);

/// Connections another proxy translated, adopted as their frontends are first written
/// (`adopt`, at a takeover).
pub trait Adopt {
    /// Seeds the conntrack map with `frontend`'s connections whose backend is one of
    /// `backends` (of ids `ids`, in that order), under reverse NAT id `service_id`: called
    /// before the frontend's master entry is written.
    fn seed(&mut self, frontend: &FrontendKey, service_id: u32, backends: &[model::Backend], ids: &[u32]);
    /// After the master (`served`: it was written): what `seed` adopted is ours now. (Not
    /// served: netfilter goes on translating those connections.)
    fn settle(&mut self, frontend: &FrontendKey, served: bool);
    /// `frontend` was removed: what a later read finds for it is not adopted.
    fn forget(&mut self, frontend: &FrontendKey);
    /// The first sync is over (called again after later syncs that collect garbage: once is
    /// what counts).
    fn end(&mut self);
    /// Called every few seconds: true once the adoption is over after its end (a last, trailing
    /// read done), and says what was adopted.
    fn trail(&mut self) -> bool;
}

/// What one scope of a frontend should hold.
struct View {
    backends: Vec<model::Backend>,
    retained: Vec<model::Backend>,
    flags: u16,
    /// Selection by Maglev (external scope of a north-south frontend with backends).
    maglev: bool,
    affinity_timeout: Option<u32>,
    /// loadBalancerSourceRanges (external scope only; the datapath checks them on the external
    /// master, before it turns to the internal scope).
    source_ranges: BTreeSet<Cidr>,
}

/// The scopes `fe` needs: the external (always) and the internal one (when pods see other
/// backends than outside clients). A loopback frontend (a localhost NodePort) is for the node's
/// own sockets only: never served on external interfaces, where 127.0.0.0/8 is a martian
/// (CVE-2020-8558 was such traffic reaching localhost NodePorts).
fn views(key: &FrontendKey, fe: &Frontend) -> (View, Option<View>) {
    let external = fe.kind.is_external() && !key.addr.is_loopback();
    let mut flags = svc_flags::NONE;
    if fe.drop_when_empty {
        flags |= svc_flags::DROP_WHEN_EMPTY;
    }
    if external {
        flags |= svc_flags::EXTERNAL;
    }
    let internal = fe.internal_backends.as_ref().map(|ib| {
        let mut retained: Vec<model::Backend> =
            fe.backends.iter().chain(&fe.retained).filter(|b| !ib.iter().any(|i| (i.addr, i.port) == (b.addr, b.port))).copied().collect();
        retained.sort();
        View {
            backends: ib.clone(),
            retained,
            flags: svc_flags::NONE,
            maglev: false,
            affinity_timeout: fe.affinity_timeout,
            source_ranges: BTreeSet::new(),
        }
    });
    if internal.is_some() {
        flags |= svc_flags::TWO_SCOPES;
    }
    if !fe.source_ranges.is_empty() {
        flags |= svc_flags::SOURCE_RANGES;
    }
    let ext = View {
        backends: fe.backends.clone(),
        retained: fe.retained.clone(),
        flags,
        maglev: external && !fe.backends.is_empty(),
        affinity_timeout: fe.affinity_timeout,
        source_ranges: fe.source_ranges.iter().map(|c| c.network()).collect(),
    };
    (ext, internal)
}

/// Maglev members of `backends`, sorted (as every node sorts them), with the backends.
fn maglev_members(backends: &[model::Backend]) -> Vec<(maglev::Member, model::Backend)> {
    let mut m: Vec<_> = backends.iter().map(|b| (maglev::member(b.addr, b.port), *b)).collect();
    m.sort_by_key(|(k, _)| *k);
    m.dedup_by_key(|(k, _)| *k);
    m
}

/// A backend as the maps know it, its address in the family's own form (an IPv4 one in 4
/// bytes: the two tables of these hold one entry per backend on the node).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Ident<A> {
    addr: A,
    port: u16,
    proto: u8,
}

impl<A: MapAddr> Ident<A> {
    /// `b`'s, or None for a backend of the other family.
    fn of(b: &model::Backend, proto: u8) -> Option<Self> {
        Some(Self { addr: A::from_ip(b.addr)?, port: b.port, proto })
    }
}

/// A backend the maps hold, by its id (`LbMaps::by_id`): its `Ident`'s fields laid out beside
/// the others, so that an IPv4 one takes 12 bytes (an `Ident` field, padded, made it 16). A
/// table of these spans every id the allocator has moved over (`ById`).
#[derive(Debug, Default)]
struct BackendEntry<A> {
    addr: A,
    port: u16,
    proto: u8,
    flags: u8,
    /// Frontends that use this backend (in slots or retained).
    refs: u32,
}
const _: () = assert!(size_of::<BackendEntry<[u8; 4]>>() == 12);
const _: () = assert!(size_of::<BackendEntry<proxy_common::Ip6>>() == 24);

impl<A: MapAddr> BackendEntry<A> {
    fn new(ident: Ident<A>, flags: u8, refs: u32) -> Self {
        Self { addr: ident.addr, port: ident.port, proto: ident.proto, flags, refs }
    }

    fn ident(&self) -> Ident<A> {
        Ident { addr: self.addr, port: self.port, proto: self.proto }
    }
}

#[derive(Clone, Debug)]
struct Programmed {
    service_id: u32,
    /// Backend id per slot (slot = index + 1); 0 marks a slot missing from the maps.
    slots: Vec<u32>,
    name: String,
    master: ServiceValue,
    /// What most frontends do not have, boxed only where one does: with 30,000 ClusterIP
    /// Services, four empty fields in every record were a sixth of the map writer's memory.
    extra: Option<Box<Extra>>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Extra {
    /// Backends referenced beside the slots: terminating endpoints flows may still reach, and
    /// after an interrupted write those the old version named.
    retained: Vec<u32>,
    /// Name of the Maglev table the master points at.
    maglev: Option<String>,
    /// Backend ids with an affinity-match entry for this service id.
    affinity_matches: BTreeSet<u32>,
    /// Entries of the source-range trie for this service id.
    source_ranges: BTreeSet<Cidr>,
}

static NO_EXTRA: Extra = Extra { retained: Vec::new(), maglev: None, affinity_matches: BTreeSet::new(), source_ranges: BTreeSet::new() };

impl Programmed {
    fn new(service_id: u32, slots: Vec<u32>, name: String, master: ServiceValue, extra: Extra) -> Self {
        let extra = (extra != NO_EXTRA).then(|| Box::new(extra));
        Self { service_id, slots, name, master, extra }
    }

    fn extra(&self) -> &Extra {
        self.extra.as_deref().unwrap_or(&NO_EXTRA)
    }

    fn extra_mut(&mut self) -> &mut Extra {
        self.extra.get_or_insert_default()
    }
}

/// The source-range trie's key for `range` of service `service_id` (a range of the frontend's
/// family: translate keeps each family's own).
fn range_key<A: MapAddr>(service_id: u32, range: Cidr) -> Key<SourceRangeKey<A>> {
    let addr = A::from_ip(range.addr).unwrap_or_default();
    Key::new(SourceRangeKey::ID_BITS + u32::from(range.prefix), SourceRangeKey { service_id, addr })
}

/// The range a source-range trie key holds (the inverse of `range_key`); None for a key no
/// writer of ours makes.
pub fn range_of<A: MapAddr>(key: &Key<SourceRangeKey<A>>) -> Option<Cidr> {
    let bits = key.prefix_len().checked_sub(SourceRangeKey::ID_BITS).filter(|b| *b <= u32::from(A::BITS))?;
    Some(Cidr { addr: key.data().addr.ip(), prefix: bits as u8 })
}

/// The maps the writer changes, behind the `Table` seam.
pub struct Tables<A: MapAddr = [u8; 4]> {
    pub services: Box<dyn Table<ServiceKey<A>, ServiceValue>>,
    /// An array: an entry with the unspecified address is unset.
    pub backends: Box<dyn Table<u32, Backend<A>>>,
    pub revnat: Box<dyn Table<u32, RevNat<A>>>,
    pub names: Box<dyn Table<u32, ServiceName>>,
    pub flows: Box<dyn Table<u32, BackendFlows>>,
    pub affinity_match: Box<dyn Table<AffinityMatchKey, u32>>,
    pub source_ranges: Box<dyn Table<Key<SourceRangeKey<A>>, u8>>,
    /// The frontend filter's words (an array).
    pub filter: Box<dyn Table<u32, u64>>,
}

/// What a previous run left in the maps, read before the writer takes them over.
pub struct Found<A: MapAddr = [u8; 4]> {
    pub snapshot: snapshot::Snapshot<A>,
    pub affinity_matches: Vec<AffinityMatchKey>,
    pub source_ranges: Vec<Key<SourceRangeKey<A>>>,
    /// The frontend filter's words, by index.
    pub filter: Vec<u64>,
}

impl<A: MapAddr> Default for Found<A> {
    fn default() -> Self {
        Self { snapshot: snapshot::Snapshot::default(), affinity_matches: Vec::new(), source_ranges: Vec::new(), filter: Vec::new() }
    }
}

/// What a Service's frontends take of a family's maps (`LbMaps::demand`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    pub services: usize,
    pub backends: usize,
    pub source_ranges: usize,
}

/// The writer of one family's maps (`A`: the family's address as the maps hold it, which also
/// names its maps: `MapAddr::LB`). Frontend keys and backends of the other family are refused.
pub struct LbMaps<A: MapAddr = [u8; 4]> {
    services: Box<dyn Table<ServiceKey<A>, ServiceValue>>,
    backends: Box<dyn Table<u32, Backend<A>>>,
    revnat: Box<dyn Table<u32, RevNat<A>>>,
    names: Box<dyn Table<u32, ServiceName>>,
    flows: Box<dyn Table<u32, BackendFlows>>,
    affinity_match: Box<dyn Table<AffinityMatchKey, u32>>,
    source_ranges: Box<dyn Table<Key<SourceRangeKey<A>>, u8>>,
    filter: Filter,
    maglev: Maglev,
    limit: u32,
    /// Backend ids by backend, and the backends by id: the entries sit in the dense Vec by id,
    /// the hash map holds only ids (a smaller table, for 120,000 backends on a large node).
    by_ident: StdHashMap<Ident<A>, u32>,
    by_id: ById<BackendEntry<A>>,
    backend_ids: IdAllocator,
    service_ids: IdAllocator,
    /// Boxed: a B-tree node holds eleven values inline, most of a node is unused, and 30,000
    /// frontends of inline values took a third more memory than their boxes do.
    frontends: BTreeMap<Scoped, Box<Programmed>>,
    /// Entries of the services map `frontends` account for (a master and its slots each),
    /// kept as they change: the gauge is read after every sync.
    entries: usize,
    /// Service ids found in REVNAT/NAMES with no frontend, removed by `collect_garbage`.
    stray_service_ids: Vec<u32>,
    stray_slots: Vec<ServiceKey<A>>,
    stray_affinity_matches: Vec<AffinityMatchKey>,
    /// Source ranges a failed delete left, removed by `collect_garbage`.
    stray_ranges: Vec<Key<SourceRangeKey<A>>>,
    /// Service ids of frontends never written whose undo left entries behind: not given out
    /// again until `collect_garbage` has removed those.
    held_service_ids: Vec<u32>,
    /// Backend and reverse NAT entries deleted or written (tried) so far: what a tracked flow's
    /// step reads besides its conntrack entry (see `entries_changed`).
    entries_changed: u64,
    /// At a takeover, until its trailing read after the first sync (`trail_adoption`).
    adoption: Option<Box<dyn Adopt>>,
}

fn take_raw(ebpf: &mut Ebpf, name: &'static str) -> Result<aya::maps::Map, DataplaneError> {
    ebpf.take_map(name).ok_or(DataplaneError::Map { op: "take", map: name, source: MapError::InvalidName { name: name.into() } })
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, DataplaneError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    T::try_from(take_raw(ebpf, name)?).map_err(|source| DataplaneError::Map { op: "open", map: name, source })
}

fn map_error(op: &'static str, map: &'static str, max: u32, source: MapError) -> DataplaneError {
    if let MapError::SyscallError(e) = &source {
        // Hash maps say E2BIG when full, the LPM trie ENOSPC.
        if matches!(e.io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC)) {
            return DataplaneError::MapFull { map, max };
        }
    }
    DataplaneError::Map { op, map, source }
}

pub(super) fn is_not_found(e: &MapError) -> bool {
    matches!(e, MapError::KeyNotFound) || matches!(e, MapError::SyscallError(s) if s.io_error.kind() == io::ErrorKind::NotFound)
}

/// A delete that failed with the entry still there (a missing entry is what was wanted).
fn failed(r: Result<(), MapError>) -> bool {
    r.is_err_and(|e| !is_not_found(&e))
}

fn ipproto(p: Protocol) -> Result<u8, DataplaneError> {
    match p {
        Protocol::Tcp | Protocol::Udp => Ok(p.ipproto()),
        Protocol::Sctp => Err(DataplaneError::Unsupported(
            "SCTP is not supported by the ebpf dataplane (its CRC32c checksum cannot be updated \
             incrementally); use --proxy-mode nftables or iptables on nodes that need SCTP"
                .into(),
        )),
    }
}

fn flags_of(b: &model::Backend) -> u8 {
    let mut f = 0;
    if b.terminating {
        f |= backend_flags::TERMINATING;
    }
    if b.local {
        f |= backend_flags::LOCAL;
    }
    f
}

impl<A: MapAddr> LbMaps<A> {
    /// Opens the family's maps of a loaded object and adopts whatever a previous run left in
    /// them. `maglev_size`: entries of each Maglev table (a prime).
    pub fn adopt(ebpf: &mut Ebpf, limit: u32, maglev_size: u32) -> Result<Self, DataplaneError> {
        let name = A::LB.maglev;
        let outer = match take_raw(ebpf, name)? {
            aya::maps::Map::HashOfMaps(m) => m,
            _ => return Err(DataplaneError::Unsupported(format!("{name} is not a hash of maps"))),
        };
        let maglev = Maglev::adopt(outer, maglev_size, limit).map_err(|e| DataplaneError::Map {
            op: "read",
            map: name,
            source: MapError::SyscallError(aya::sys::SyscallError { call: "bpf", io_error: e }),
        })?;
        let services: HashMap<MapData, ServiceKey<A>, ServiceValue> = take(ebpf, A::LB.services)?;
        let backends: Array<MapData, Backend<A>> = take(ebpf, A::LB.backends)?;
        let revnat: HashMap<MapData, u32, RevNat<A>> = take(ebpf, A::LB.revnat)?;
        let names: HashMap<MapData, u32, ServiceName> = take(ebpf, A::LB.names)?;
        let affinity_match: HashMap<MapData, AffinityMatchKey, u32> = take(ebpf, A::LB.affinity_match)?;
        let source_ranges: LpmTrie<MapData, SourceRangeKey<A>, u8> = take(ebpf, A::LB.source_ranges)?;
        let filter: Array<MapData, u64> = take(ebpf, A::LB.filter)?;
        let snapshot = snapshot::read(&services, &backends, &revnat, &names).map_err(|source| DataplaneError::Map {
            op: "read",
            map: A::LB.services,
            source,
        })?;
        let found = Found {
            snapshot,
            affinity_matches: affinity_match.keys().collect::<Result<_, _>>().map_err(|source| DataplaneError::Map {
                op: "read",
                map: A::LB.affinity_match,
                source,
            })?,
            source_ranges: source_ranges.keys().collect::<Result<_, _>>().map_err(|source| DataplaneError::Map {
                op: "read",
                map: A::LB.source_ranges,
                source,
            })?,
            filter: filter.iter().collect::<Result<_, _>>().map_err(|source| DataplaneError::Map {
                op: "read",
                map: A::LB.filter,
                source,
            })?,
        };
        let tables = Tables {
            services: Box::new(services),
            backends: Box::new(backends),
            revnat: Box::new(revnat),
            names: Box::new(names),
            flows: Box::new(take::<Array<MapData, BackendFlows>>(ebpf, A::LB.flows)?),
            affinity_match: Box::new(affinity_match),
            source_ranges: Box::new(source_ranges),
            filter: Box::new(filter),
        };
        Self::with_found(tables, maglev, limit, found)
    }

    /// The writer over `tables`, taking over what `found` says they hold.
    pub fn with_found(tables: Tables<A>, maglev: Maglev, limit: u32, found: Found<A>) -> Result<Self, DataplaneError> {
        let Tables { services, backends, revnat, names, flows, affinity_match, source_ranges, filter } = tables;
        let mut me = Self {
            services,
            backends,
            revnat,
            names,
            flows,
            affinity_match,
            source_ranges,
            filter: Filter::new(filter),
            maglev,
            limit,
            by_ident: StdHashMap::new(),
            by_id: ById::default(),
            backend_ids: IdAllocator::new(limit),
            service_ids: IdAllocator::new(limit),
            frontends: BTreeMap::new(),
            entries: 0,
            stray_service_ids: Vec::new(),
            stray_slots: Vec::new(),
            stray_affinity_matches: Vec::new(),
            stray_ranges: Vec::new(),
            held_service_ids: Vec::new(),
            entries_changed: 0,
            adoption: None,
        };
        let snap = found.snapshot;
        // Bits for every master the maps hold, before anything else is written.
        me.filter.adopt(&found.filter, snap.frontends.values().map(|fe| &fe.key)).map_err(|source| DataplaneError::Map {
            op: "update",
            map: A::LB.filter,
            source,
        })?;
        // Backends pinned under a second id (an interrupted older run may leave one).
        let mut twins = Vec::new();
        for (id, b) in &snap.backends {
            if me.backend_ids.claim(*id) {
                let ident = Ident { addr: b.addr, port: u16::from_be_bytes(b.port), proto: b.proto };
                if me.by_ident.insert(ident, *id).is_some() {
                    twins.push(ident);
                }
                me.by_id.insert(*id, BackendEntry::new(ident, b.flags, 0));
            }
        }
        for fe in snap.frontends.values() {
            let Some(protocol) = Protocol::from_ipproto(fe.key.proto) else { continue };
            let key = FrontendKey { addr: fe.key.addr.ip(), port: u16::from_be_bytes(fe.key.port), protocol };
            me.service_ids.claim(fe.master.service_id);
            for id in &fe.slots {
                me.add_ref(*id);
            }
            let name = fe.name.clone().unwrap_or_default();
            let mut table = None;
            if fe.master.flags & svc_flags::MAGLEV != 0 && fe.key.scope == scope::EXTERNAL {
                let by_id = &me.by_id;
                let held =
                    me.maglev.claim(fe.master.backend_id, &name, key, |id| by_id.get(id).map(|e| maglev::member(e.addr.ip(), e.port)));
                for id in held {
                    me.add_ref(id);
                }
                table = Some(name.clone());
            }
            me.set_frontend(
                (key, fe.key.scope),
                Programmed::new(fe.master.service_id, fe.slots.clone(), name, fe.master, Extra { maglev: table, ..Extra::default() }),
            );
        }
        // Such a backend is known by the id frontends use; garbage collection takes the other.
        for ident in twins {
            let used = me.by_id.iter().filter(|(_, e)| e.ident() == ident).max_by_key(|(_, e)| e.refs).map(|(id, _)| id);
            if let Some(id) = used {
                me.by_ident.insert(ident, id);
            }
        }
        let by_service: StdHashMap<u32, Scoped> = me.frontends.iter().map(|(k, p)| (p.service_id, *k)).collect();
        for k in found.affinity_matches {
            match by_service.get(&k.service_id).and_then(|s| me.frontends.get_mut(s)) {
                Some(p) => {
                    p.extra_mut().affinity_matches.insert(k.backend_id);
                }
                None => me.stray_affinity_matches.push(k),
            }
        }
        // Source ranges go to the external scope's frontend of their service id. Entries of no
        // frontend guard nothing (no master names their id), but would open a frontend that is
        // given the id later: they go at once.
        let mut stray_ranges = Vec::new();
        for k in found.source_ranges {
            let external = by_service.get(&k.data().service_id).filter(|(_, sc)| *sc == scope::EXTERNAL);
            match (range_of(&k), external.and_then(|s| me.frontends.get_mut(s))) {
                (Some(r), Some(p)) => {
                    p.extra_mut().source_ranges.insert(r);
                }
                _ => stray_ranges.push(k),
            }
        }
        for k in stray_ranges {
            me.source_ranges.del(&k).map_err(|source| DataplaneError::Map { op: "delete", map: A::LB.source_ranges, source })?;
        }
        me.stray_service_ids = snap.stray_service_ids;
        me.stray_slots = snap.stray_slots;
        Ok(me)
    }

    /// `addr` in the maps' form; an error for the other family's.
    fn addr(addr: IpAddr) -> Result<A, DataplaneError> {
        A::from_ip(addr).ok_or_else(|| DataplaneError::Unsupported(format!("{addr} is not of the family of {}", A::LB.services)))
    }

    pub fn maglev(&self) -> &Maglev {
        &self.maglev
    }

    /// Programmed frontends (either scope).
    pub fn keys(&self) -> Vec<FrontendKey> {
        let set: BTreeSet<FrontendKey> = self.frontends.keys().map(|(k, _)| *k).collect();
        set.into_iter().collect()
    }

    pub fn backend_count(&self) -> usize {
        self.by_ident.len()
    }

    /// Entries the kernel holds in each hash map the writer owns, and set entries of the
    /// backends array, counted in the maps themselves (not from the writer's own picture).
    pub fn count_in_kernel(&self) -> std::io::Result<BTreeMap<&'static str, u64>> {
        Ok(BTreeMap::from([
            (A::LB.services, self.services.count()?),
            (A::LB.revnat, self.revnat.count()?),
            (A::LB.names, self.names.count()?),
            (A::LB.backends, self.backends.count()?),
            (A::LB.source_ranges, self.source_ranges.count()?),
        ]))
    }

    /// Entries in the services map: a master per frontend and its slots.
    pub fn service_entries(&self) -> usize {
        self.entries
    }

    /// The Service port name the frontend `key` was programmed for, as the names map holds it.
    pub fn name_of(&self, key: &FrontendKey) -> Option<&str> {
        self.frontends.get(&(*key, scope::EXTERNAL)).map(|p| p.name.as_str())
    }

    /// Entries the frontend `key` holds in the services map (a master and its slots, per scope).
    pub fn entries_of(&self, key: &FrontendKey) -> usize {
        [scope::EXTERNAL, scope::INTERNAL].iter().filter_map(|s| self.frontends.get(&(*key, *s))).map(|p| 1 + p.slots.len()).sum()
    }

    /// Entries the frontends `fes` (all of this family) take once programmed: masters and
    /// slots in the services map, distinct backends in the backend map (terminating ones kept
    /// for their flows included), source ranges in the source-range trie. Each item is a
    /// frontend programmed at `n` keys (`key`: one of them, for the protocol).
    pub fn demand<'a>(fes: impl IntoIterator<Item = (usize, &'a FrontendKey, &'a Frontend)>) -> Demand {
        let mut d = Demand::default();
        let mut backends = HashSet::new();
        for (n, key, fe) in fes {
            let Ok(proto) = ipproto(key.protocol) else { continue };
            let mut scope = |list: &[model::Backend]| {
                let active: HashSet<_> = list.iter().map(|b| (b.addr, b.port)).collect();
                d.services += n * (1 + active.len());
                backends.extend(active.into_iter().map(|(a, p)| (a, p, proto)));
            };
            scope(&fe.backends);
            if let Some(ib) = &fe.internal_backends {
                scope(ib);
            }
            backends.extend(fe.retained.iter().map(|b| (b.addr, b.port, proto)));
            d.source_ranges += n * fe.source_ranges.iter().map(|c| c.network()).collect::<BTreeSet<_>>().len();
        }
        d.backends = backends.len();
        d
    }

    /// Refuses one Service whose frontends (`fes`, all of this family) would take more than
    /// half of a load-balancer map (`demand`). Without the cap one Service (700 ports of 100
    /// pods, say) fills the maps, and every Service written after it stops being updated.
    pub fn admit<'a>(&self, fes: impl IntoIterator<Item = (usize, &'a FrontendKey, &'a Frontend)>) -> Result<(), DataplaneError> {
        let d = Self::demand(fes);
        let most = (self.limit / 2) as usize;
        for (map, need) in [(A::LB.services, d.services), (A::LB.backends, d.backends), (A::LB.source_ranges, d.source_ranges)] {
            if need > most {
                return Err(DataplaneError::TooLarge { map, need, max: self.limit });
            }
        }
        Ok(())
    }

    fn set_frontend(&mut self, scoped: Scoped, p: Programmed) {
        self.entries += 1 + p.slots.len();
        if let Some(old) = self.frontends.insert(scoped, Box::new(p)) {
            self.entries -= 1 + old.slots.len();
        }
    }

    fn add_ref(&mut self, id: u32) {
        if let Some(e) = self.by_id.get_mut(id) {
            e.refs += 1;
        }
    }

    /// Takes a reference on the backend, creating or updating its map entry.
    fn acquire(&mut self, b: &model::Backend, proto: u8) -> Result<u32, DataplaneError> {
        let addr = Self::addr(b.addr)?;
        let ident = Ident { addr, port: b.port, proto };
        let flags = flags_of(b);
        let value = Backend { addr, port: b.port.to_be_bytes(), proto, flags };
        if let Some((&id, e)) = self.by_ident.get(&ident).and_then(|id| Some((id, self.by_id.get_mut(*id)?))) {
            if e.flags != flags {
                self.backends.put(&id, &value).map_err(|s| map_error("update", A::LB.backends, self.limit, s))?;
                e.flags = flags;
            }
            e.refs += 1;
            return Ok(id);
        }
        let id = self.backend_ids.alloc().ok_or(DataplaneError::MapFull { map: A::LB.backends, max: self.limit })?;
        let written = self
            .flows
            .put(&id, &BackendFlows::default())
            .map_err(|s| map_error("reset", A::LB.flows, self.limit, s))
            .and_then(|()| self.backends.put(&id, &value).map_err(|s| map_error("insert", A::LB.backends, self.limit, s)));
        if let Err(e) = written {
            self.backend_ids.free(id);
            return Err(e);
        }
        self.by_ident.insert(ident, id);
        self.by_id.insert(id, BackendEntry::new(ident, flags, 1));
        Ok(id)
    }

    fn acquire_all(&mut self, list: &[model::Backend], proto: u8) -> Result<Vec<u32>, DataplaneError> {
        let mut ids = Vec::with_capacity(list.len());
        for b in list {
            match self.acquire(b, proto) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    self.release_all(&ids);
                    return Err(e);
                }
            }
        }
        Ok(ids)
    }

    /// Drops a reference; the backend's entry goes when the last one does.
    fn release(&mut self, id: u32) {
        let Some(e) = self.by_id.get_mut(id) else { return };
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 {
            let ident = e.ident();
            self.delete_backend(id, ident);
        }
    }

    fn delete_backend(&mut self, id: u32, ident: Ident<A>) {
        self.entries_changed += 1;
        match self.backends.del(&id) {
            Ok(()) => {}
            Err(e) => {
                // Keep our record so a later pass retries; the entry is harmless meanwhile.
                tracing::warn!(backend_id = id, error = %e, "could not delete backend entry");
                return;
            }
        }
        // Pinned state may hold one backend under two ids (an interrupted older run): the map
        // by backend names one of them, which must not lose its entry when the other goes.
        if self.by_ident.get(&ident) == Some(&id) {
            self.by_ident.remove(&ident);
        }
        self.by_id.remove(id);
        self.backend_ids.free(id);
    }

    /// Deletes service `id`'s reverse NAT entry (counted, as its writes and a backend's deletion
    /// are).
    fn del_revnat(&mut self, id: &u32) -> Result<(), MapError> {
        self.entries_changed += 1;
        self.revnat.del(id)
    }

    /// Backend entries this writer has deleted and reverse NAT entries it has written or
    /// deleted (or tried to): when it moves, a step XDP cached for a tracked flow may name what
    /// is gone or changed (`proxy_ebpf`'s `flowcache`). (A backend is written at an id only
    /// after the id's last backend was deleted, or with new flags, which a tracked flow does
    /// not read.)
    pub fn entries_changed(&self) -> u64 {
        self.entries_changed
    }

    fn release_all(&mut self, ids: &[u32]) {
        for id in ids {
            self.release(*id);
        }
    }

    fn remove_key(&mut self, key: &ServiceKey<A>) -> Result<(), DataplaneError> {
        match self.services.del(key) {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(source) => Err(DataplaneError::Map { op: "delete", map: A::LB.services, source }),
        }
    }

    fn set_ids_equal(&self, ids: &[u32], want: &[model::Backend], proto: u8) -> bool {
        if ids.len() != want.len() {
            return false;
        }
        let have: HashSet<u32> = ids.iter().copied().collect();
        want.iter().all(|b| self.id_of(b, proto).is_some_and(|id| have.contains(&id)))
    }

    /// The master entry of a view. `maglev_id`: the table it selects with, if any.
    fn master_for(view: &View, service_id: u32, count: usize, maglev_id: Option<u32>) -> ServiceValue {
        let mut flags = view.flags;
        if maglev_id.is_some() {
            flags |= svc_flags::MAGLEV;
        }
        ServiceValue {
            // In a master entry this field names the Maglev table.
            backend_id: maglev_id.unwrap_or(0),
            service_id,
            count: count as u16,
            flags,
            affinity_timeout: view.affinity_timeout.unwrap_or(0),
        }
    }

    /// Backend ids of `list` as the maps hold them now, if every one is there.
    fn ids_of(&self, list: &[model::Backend], proto: u8) -> Option<Vec<u32>> {
        list.iter().map(|b| self.id_of(b, proto)).collect()
    }

    /// The id of `b` as the maps hold it now (with its current flags), if they do.
    fn id_of(&self, b: &model::Backend, proto: u8) -> Option<u32> {
        let id = *self.by_ident.get(&Ident::of(b, proto)?)?;
        self.by_id.get(id).filter(|e| e.flags == flags_of(b)).map(|_| id)
    }

    fn scope_current(&self, key: &FrontendKey, scope_id: u8, view: &View, name: &str, proto: u8) -> bool {
        let Some(p) = self.frontends.get(&(*key, scope_id)) else { return false };
        let maglev_id = if view.maglev {
            let members = maglev_members(&view.backends);
            let backends: Vec<model::Backend> = members.iter().map(|(_, b)| *b).collect();
            let Some(ids) = self.ids_of(&backends, proto) else { return false };
            let keys: Vec<maglev::Member> = members.iter().map(|(k, _)| *k).collect();
            if !self.maglev.is_current(name, &keys, &ids) {
                return false;
            }
            self.maglev.table_id(name)
        } else {
            None
        };
        let wants_matches: BTreeSet<u32> =
            if view.affinity_timeout.is_some() { p.slots.iter().copied().collect() } else { BTreeSet::new() };
        p.name == name
            && p.master == Self::master_for(view, p.service_id, view.backends.len(), maglev_id)
            && p.extra().maglev.as_deref() == maglev_id.map(|_| name)
            && p.extra().affinity_matches == wants_matches
            && p.extra().source_ranges == view.source_ranges
            && self.set_ids_equal(&p.slots, &view.backends, proto)
            && self.set_ids_equal(&p.extra().retained, &view.retained, proto)
    }

    pub fn is_current(&self, key: &FrontendKey, fe: &Frontend) -> bool {
        let Ok(proto) = ipproto(key.protocol) else { return false };
        let fe = normalized(fe);
        let name = stored_name(&fe);
        let (ext, int) = views(key, &fe);
        self.scope_current(key, scope::EXTERNAL, &ext, &name, proto)
            && match &int {
                Some(v) => self.scope_current(key, scope::INTERNAL, v, &name, proto),
                None => !self.frontends.contains_key(&(*key, scope::INTERNAL)),
            }
    }

    pub fn upsert(&mut self, key: &FrontendKey, fe: &Frontend) -> Result<(), DataplaneError> {
        ipproto(key.protocol)?;
        let fe = normalized(fe);
        for b in fe.internal_backends.iter().flatten().chain(&fe.backends) {
            if b.addr.is_unspecified() {
                return Err(DataplaneError::Unsupported(format!("endpoint address {b} cannot be programmed")));
            }
        }
        let name = stored_name(&fe);
        let (ext, int) = views(key, &fe);
        // Internal scope first: the external master may only point at a complete one.
        if let Some(v) = &int {
            self.upsert_scope(key, scope::INTERNAL, v, &name)?;
        }
        self.upsert_scope(key, scope::EXTERNAL, &ext, &name)?;
        if int.is_none() && self.frontends.contains_key(&(*key, scope::INTERNAL)) {
            self.remove_scope(key, scope::INTERNAL)?;
        }
        Ok(())
    }

    fn upsert_scope(&mut self, key: &FrontendKey, scope_id: u8, view: &View, name: &str) -> Result<(), DataplaneError> {
        let proto = ipproto(key.protocol)?;
        let scoped = (*key, scope_id);
        let fe = view;
        if fe.backends.len() > limits::MAX_SLOTS as usize {
            return Err(DataplaneError::Unsupported(format!(
                "{} endpoints is more than the {} a frontend can hold",
                fe.backends.len(),
                limits::MAX_SLOTS
            )));
        }
        let old = self.frontends.get(&scoped).cloned();
        let old_slots: Vec<u32> = old.as_ref().map(|o| o.slots.clone()).unwrap_or_default();
        let name = name.to_string();
        let mut skey = ServiceKey::new(Self::addr(key.addr)?, key.port.to_be_bytes(), proto, 0);
        skey.scope = scope_id;
        let fresh = old.is_none();
        // A new frontend's filter bit first; it stays counted while the frontend is recorded,
        // and is released on every way out that leaves it unrecorded.
        if fresh {
            self.filter.hold(&skey).map_err(|s| map_error("update", A::LB.filter, filter::WORDS, s))?;
        }

        // Phase A: everything that adds entries, and so may find a map full. Undone on failure,
        // leaving the frontend exactly as it was.
        let active = match self.acquire_all(&fe.backends, proto) {
            Ok(a) => a,
            Err(e) => {
                self.release_filter(fresh, &skey);
                return Err(e);
            }
        };
        let retained = match self.acquire_all(&fe.retained, proto) {
            Ok(r) => r,
            Err(e) => {
                self.release_all(&active);
                self.release_filter(fresh, &skey);
                return Err(e);
            }
        };
        let service_id = match &old {
            Some(o) => o.service_id,
            None => match self.service_ids.alloc() {
                Some(id) => id,
                None => {
                    self.release_all(&active);
                    self.release_all(&retained);
                    self.release_filter(fresh, &skey);
                    return Err(DataplaneError::MapFull { map: A::LB.revnat, max: self.limit });
                }
            },
        };
        let wanted: BTreeSet<u32> = active.iter().copied().collect();
        let slots = assign_slots(&old_slots, &wanted);
        let slot_value = |id: u32| ServiceValue { backend_id: id, service_id, ..Default::default() };
        let mut added = Vec::new();
        let phase_a = (|| {
            if fresh {
                // A fresh service id may be one an earlier run left entries under.
                self.entries_changed += 1;
                self.revnat
                    .put(&service_id, &RevNat { addr: Self::addr(key.addr)?, port: key.port.to_be_bytes(), _pad: [0; 2] })
                    .map_err(|s| map_error("insert", A::LB.revnat, self.limit, s))?;
            }
            if fresh || old.as_ref().is_some_and(|o| o.name != name) {
                self.names.put(&service_id, &ServiceName::new(&name)).map_err(|s| map_error("insert", A::LB.names, self.limit, s))?;
            }
            for (i, id) in slots.iter().enumerate().skip(old_slots.len()) {
                let k = skey.with_slot((i + 1) as u16);
                self.services.put(&k, &slot_value(*id)).map_err(|s| map_error("insert", A::LB.services, self.limit, s))?;
                added.push(k);
            }
            Ok(())
        })();
        // The Maglev table (shared by the Service port's external frontends) and the affinity
        // matches of new backends, before the master that uses them.
        let mut maglev_id = None;
        let mut new_matches = Vec::new();
        let mut new_ranges = Vec::new();
        let phase_a = phase_a.and_then(|()| {
            // Source ranges before the master that turns them on.
            for r in view.source_ranges.iter().filter(|r| !old.as_ref().is_some_and(|o| o.extra().source_ranges.contains(r))) {
                self.source_ranges
                    .put(&range_key(service_id, *r), &1)
                    .map_err(|s| map_error("insert", A::LB.source_ranges, self.limit, s))?;
                new_ranges.push(*r);
            }
            if view.maglev {
                let members = maglev_members(&view.backends);
                let backends: Vec<model::Backend> = members.iter().map(|(_, b)| *b).collect();
                let keys: Vec<maglev::Member> = members.iter().map(|(k, _)| *k).collect();
                let ids = self.acquire_all(&backends, proto)?;
                match self.maglev.write(&name, &keys, &ids, *key) {
                    Ok((id, release)) => {
                        self.release_all(&release);
                        maglev_id = Some(id);
                    }
                    Err(e) => {
                        self.release_all(&ids);
                        return Err(map_error(
                            "write",
                            A::LB.maglev,
                            self.limit,
                            MapError::SyscallError(aya::sys::SyscallError { call: "bpf", io_error: e }),
                        ));
                    }
                }
            }
            if view.affinity_timeout.is_some() {
                for id in slots.iter().filter(|id| !old.as_ref().is_some_and(|o| o.extra().affinity_matches.contains(id))) {
                    let k = AffinityMatchKey { service_id, backend_id: *id, scope: scope_id, _pad: 0, _pad2: 0 };
                    self.affinity_match.put(&k, &1).map_err(|s| map_error("insert", A::LB.affinity_match, self.limit, s))?;
                    new_matches.push(*id);
                }
            }
            Ok(())
        });
        if let Err(e) = phase_a {
            // What cannot be undone now is left to `collect_garbage`, and a new frontend's id
            // is held until then: a range or a match left under an id given out again would
            // hold for its next frontend.
            let mut left = false;
            for r in &new_ranges {
                let k = range_key(service_id, *r);
                if failed(self.source_ranges.del(&k)) {
                    self.stray_ranges.push(k);
                    left = true;
                }
            }
            for id in &new_matches {
                let k = AffinityMatchKey { service_id, backend_id: *id, scope: scope_id, _pad: 0, _pad2: 0 };
                if failed(self.affinity_match.del(&k)) {
                    self.stray_affinity_matches.push(k);
                    left = true;
                }
            }
            for k in &added {
                if failed(self.services.del(k)) {
                    self.stray_slots.push(*k);
                }
            }
            // A Maglev table this frontend's record does not name yet: it was added as a user
            // above, and no removal would release it.
            if maglev_id.is_some() && old.as_ref().is_none_or(|o| o.extra().maglev.as_deref() != Some(name.as_str())) {
                let released = self.maglev.release(&name, key);
                self.release_all(&released);
            }
            if fresh {
                if failed(self.del_revnat(&service_id)) | failed(self.names.del(&service_id)) {
                    self.stray_service_ids.push(service_id);
                    left = true;
                }
                if left {
                    self.held_service_ids.push(service_id);
                } else {
                    self.service_ids.free(service_id);
                }
            }
            self.release_all(&active);
            self.release_all(&retained);
            self.release_filter(fresh, &skey);
            return Err(e);
        }

        // Connections another proxy translated to these backends, tracked before the master
        // makes our programs serve them.
        if let Some(a) = self.adoption.as_mut() {
            a.seed(key, service_id, &fe.backends, &active);
        }
        // Phase B: rewrites of existing entries, then the master, then the surplus.
        let master = Self::master_for(view, service_id, slots.len(), maglev_id);
        let phase_b = (|| {
            for (i, id) in slots.iter().enumerate().take(old_slots.len()) {
                if old_slots[i] != *id {
                    self.services
                        .put(&skey.with_slot((i + 1) as u16), &slot_value(*id))
                        .map_err(|s| map_error("update", A::LB.services, self.limit, s))?;
                }
            }
            if old.as_ref().map(|o| o.master) != Some(master) {
                self.services.put(&skey, &master).map_err(|s| map_error("insert", A::LB.services, self.limit, s))?;
            }
            for slot in slots.len() + 1..=old_slots.len() {
                self.remove_key(&skey.with_slot(slot as u16))?;
            }
            Ok(())
        })();
        if let Some(a) = self.adoption.as_mut() {
            a.settle(key, phase_b.is_ok());
        }
        if let Err(e) = phase_b {
            // The maps may now mix old and new slots, up to the longer of the two. Record every
            // slot as unknown (0) so the next attempt rewrites them all and deletes any surplus,
            // and keep every backend either version names alive until then.
            let mut keep = old.as_ref().map(|o| o.extra().retained.clone()).unwrap_or_default();
            keep.extend(old_slots.iter().filter(|id| **id != 0));
            keep.extend(active);
            keep.extend(retained);
            let slots = vec![0; old_slots.len().max(slots.len())];
            let mut matches = old.as_ref().map(|o| o.extra().affinity_matches.clone()).unwrap_or_default();
            matches.extend(new_matches);
            // The old slot references move into `keep`; they are released with it. The table
            // stays in use by this frontend until it is written again.
            let table = maglev_id.map(|_| name.clone()).or(old.as_ref().and_then(|o| o.extra().maglev.clone()));
            let mut ranges = old.as_ref().map(|o| o.extra().source_ranges.clone()).unwrap_or_default();
            ranges.extend(new_ranges);
            self.set_frontend(
                scoped,
                Programmed::new(
                    service_id,
                    slots,
                    String::new(),
                    ServiceValue::default(),
                    Extra { retained: keep, maglev: table, affinity_matches: matches, source_ranges: ranges },
                ),
            );
            return Err(e);
        }

        // Phase C: the old references go last.
        let mut matches: BTreeSet<u32> = old.as_ref().map(|o| o.extra().affinity_matches.clone()).unwrap_or_default();
        matches.extend(new_matches);
        let keep: BTreeSet<u32> = if view.affinity_timeout.is_some() { slots.iter().copied().collect() } else { BTreeSet::new() };
        // An affinity match or a range that could not be deleted goes on the stray lists, which
        // `collect_garbage` tries again after the sync (and the id is not given out while they
        // name it): left unrecorded, it would stay in the map for good.
        for id in matches.difference(&keep) {
            let k = AffinityMatchKey { service_id, backend_id: *id, scope: scope_id, _pad: 0, _pad2: 0 };
            if failed(self.affinity_match.del(&k)) {
                self.stray_affinity_matches.push(k);
            }
        }
        let source_ranges = view.source_ranges.clone();
        for r in old.iter().flat_map(|o| o.extra().source_ranges.difference(&view.source_ranges)) {
            let k = range_key(service_id, *r);
            if failed(self.source_ranges.del(&k)) {
                self.stray_ranges.push(k);
            }
        }
        if let Some(o) = &old {
            self.release_all(&o.slots);
            self.release_all(&o.extra().retained);
            if let Some(t) = o.extra().maglev.as_ref().filter(|t| maglev_id.is_none() || **t != name) {
                let released = self.maglev.release(t, key);
                self.release_all(&released);
            }
        }
        let table = maglev_id.map(|_| name.clone());
        self.set_frontend(
            scoped,
            Programmed::new(service_id, slots, name, master, Extra { retained, maglev: table, affinity_matches: keep, source_ranges }),
        );
        Ok(())
    }

    pub fn remove(&mut self, key: &FrontendKey) -> Result<(), DataplaneError> {
        if let Some(a) = self.adoption.as_mut() {
            a.forget(key);
        }
        // External first: its master may point at the internal scope.
        self.remove_scope(key, scope::EXTERNAL)?;
        self.remove_scope(key, scope::INTERNAL)
    }

    fn remove_scope(&mut self, key: &FrontendKey, scope_id: u8) -> Result<(), DataplaneError> {
        let scoped = (*key, scope_id);
        let Some(mut p) = self.frontends.get(&scoped).cloned() else { return Ok(()) };
        // Should this stop half way, the record must not say the frontend is still written:
        // its master is unset and its slots unknown (their backends kept referenced), so
        // writing the frontend again rewrites everything.
        // Its affinity matches and ranges move to the stray lists: deleted below, and any
        // that cannot be stay there (the id held) until `collect_garbage` removes them.
        if let Some(r) = self.frontends.get_mut(&scoped) {
            r.master = ServiceValue::default();
            let live: Vec<u32> = r.slots.iter().copied().filter(|id| *id != 0).collect();
            if !live.is_empty() {
                r.extra_mut().retained.extend(live);
            }
            r.slots.iter_mut().for_each(|id| *id = 0);
            let (matches, ranges) = match r.extra.as_deref_mut() {
                Some(x) => (std::mem::take(&mut x.affinity_matches), std::mem::take(&mut x.source_ranges)),
                None => Default::default(),
            };
            for id in matches {
                self.stray_affinity_matches.push(AffinityMatchKey {
                    service_id: r.service_id,
                    backend_id: id,
                    scope: scope_id,
                    _pad: 0,
                    _pad2: 0,
                });
            }
            for range in ranges {
                self.stray_ranges.push(range_key(r.service_id, range));
            }
            p = r.clone();
        }
        let mut skey = ServiceKey::new(Self::addr(key.addr)?, key.port.to_be_bytes(), key.protocol.ipproto(), 0);
        skey.scope = scope_id;
        // Master first: from here on new packets see no service.
        self.remove_key(&skey)?;
        for slot in 1..=p.slots.len() {
            self.remove_key(&skey.with_slot(slot as u16))?;
        }
        // Before the id is freed: a match or a range left behind would hold for the next
        // frontend with this id.
        let (matches, ranges) = (&mut self.affinity_match, &mut self.source_ranges);
        self.stray_affinity_matches.retain(|k| k.service_id != p.service_id || failed(matches.del(k)));
        self.stray_ranges.retain(|k| k.data().service_id != p.service_id || failed(ranges.del(k)));
        if let Some(t) = &p.extra().maglev {
            let released = self.maglev.release(t, key);
            self.release_all(&released);
        }
        // Left entries are overwritten when the id is given out again, and removed by
        // `collect_garbage` if it is not.
        if failed(self.del_revnat(&p.service_id)) | failed(self.names.del(&p.service_id)) {
            self.stray_service_ids.push(p.service_id);
        }
        // An id that stray entries still name is held until `collect_garbage` removed them.
        if self.leftovers_name(p.service_id) {
            self.held_service_ids.push(p.service_id);
        } else {
            self.service_ids.free(p.service_id);
        }
        self.release_all(&p.slots);
        self.release_all(&p.extra().retained);
        if let Some(old) = self.frontends.remove(&scoped) {
            self.entries -= 1 + old.slots.len();
            self.filter.release(&skey);
        }
        Ok(())
    }

    /// `Filter::release` of a new frontend's bit (`fresh`) that ends up unrecorded.
    fn release_filter(&mut self, fresh: bool, skey: &ServiceKey<A>) {
        if fresh {
            self.filter.release(skey);
        }
    }

    /// True when stray entries of a failed delete still name service id `id`.
    fn leftovers_name(&self, id: u32) -> bool {
        self.stray_service_ids.contains(&id)
            || self.stray_affinity_matches.iter().any(|k| k.service_id == id)
            || self.stray_ranges.iter().any(|k| k.data().service_id == id)
    }

    /// Adopts connections another proxy translated as frontends are written, until
    /// `trail_adoption` ends it after the first sync.
    pub fn adopt_connections(&mut self, adoption: Box<dyn Adopt>) {
        self.adoption = Some(adoption);
    }

    /// The first sync is over: the adoption goes on until `trail_adoption` ends it.
    pub fn end_adoption(&mut self) {
        if let Some(a) = self.adoption.as_mut() {
            a.end();
        }
    }

    /// Every few seconds: ends the adoption once its trailing read is done (`Adopt::trail`).
    pub fn trail_adoption(&mut self) {
        if self.adoption.as_mut().is_some_and(|a| a.trail()) {
            self.adoption = None;
        }
    }

    /// A takeover's adoption is still on.
    pub fn adopting(&self) -> bool {
        self.adoption.is_some()
    }

    /// The reverse NAT map's descriptor (a Service's address and port by id), for readers of
    /// the kernel's maps beside the writer (`ct_gc`); none where the tables are not the
    /// kernel's.
    pub fn revnat_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.revnat.fd()
    }

    /// True when a failed delete left entries (or held an id) for `collect_garbage`. (A backend
    /// entry whose delete failed waits for the next full garbage collection.)
    pub fn has_leftovers(&self) -> bool {
        !(self.stray_service_ids.is_empty()
            && self.stray_affinity_matches.is_empty()
            && self.stray_ranges.is_empty()
            && self.stray_slots.is_empty()
            && self.held_service_ids.is_empty()
            && !self.filter.has_dirty())
    }

    /// Removes backends no frontend references, and leftovers of an interrupted run.
    pub fn collect_garbage(&mut self) -> Result<usize, DataplaneError> {
        let mut removed = 0;
        let orphans: Vec<(u32, Ident<A>)> = self.by_id.iter().filter(|(_, e)| e.refs == 0).map(|(id, e)| (id, e.ident())).collect();
        for (id, ident) in orphans {
            self.delete_backend(id, ident);
            removed += 1;
        }
        removed += self.maglev.collect_garbage();
        // Filter words a failed write left as they were.
        self.filter.retry();
        // A stray match or range stays only where a frontend's record lists it (it was
        // written again since); one that cannot be deleted now is tried again next time.
        for k in std::mem::take(&mut self.stray_affinity_matches) {
            if self.frontends.values().any(|p| p.service_id == k.service_id && p.extra().affinity_matches.contains(&k.backend_id)) {
                continue;
            }
            if failed(self.affinity_match.del(&k)) {
                self.stray_affinity_matches.push(k);
            } else {
                removed += 1;
            }
        }
        for k in std::mem::take(&mut self.stray_ranges) {
            let listed = range_of(&k).is_some_and(|r| {
                self.frontends.values().any(|p| p.service_id == k.data().service_id && p.extra().source_ranges.contains(&r))
            });
            if listed {
                continue;
            }
            if failed(self.source_ranges.del(&k)) {
                self.stray_ranges.push(k);
            } else {
                removed += 1;
            }
        }
        for k in std::mem::take(&mut self.stray_slots) {
            // A frontend that grew during the initial sync may use this slot again now.
            let reused = self.frontends.iter().any(|((fk, sc), p)| {
                let Ok(addr) = Self::addr(fk.addr) else { return false };
                let mut master = ServiceKey::new(addr, fk.port.to_be_bytes(), fk.protocol.ipproto(), 0);
                master.scope = *sc;
                master == k.with_slot(0) && usize::from(k.slot) <= p.slots.len()
            });
            if reused {
                continue;
            }
            if failed(self.services.del(&k)) {
                self.stray_slots.push(k);
            } else {
                removed += 1;
            }
        }
        for id in std::mem::take(&mut self.stray_service_ids) {
            if self.frontends.values().any(|p| p.service_id == id) {
                continue;
            }
            if failed(self.del_revnat(&id)) | failed(self.names.del(&id)) {
                self.stray_service_ids.push(id);
            } else {
                removed += 1;
            }
        }
        for id in std::mem::take(&mut self.held_service_ids) {
            if self.leftovers_name(id) {
                self.held_service_ids.push(id);
            } else {
                self.service_ids.free(id);
            }
        }
        Ok(removed)
    }
}

/// The name of `fe`'s Service port as the names map holds it (`ServiceName::fit`), so that the
/// name a restart reads back is the one kept in memory: frontends and Maglev tables are known
/// by it.
pub fn stored_name(fe: &Frontend) -> String {
    let name = fe.name.to_string();
    match ServiceName::fit(&name) {
        std::borrow::Cow::Borrowed(_) => name,
        std::borrow::Cow::Owned(fitted) => fitted,
    }
}

/// `fe` with each endpoint once (a duplicate would take a second reference and never match)
/// and retained endpoints that are not also active.
fn normalized(fe: &Frontend) -> Frontend {
    let mut fe = fe.clone();
    fe.backends.sort();
    fe.backends.dedup_by_key(|b| (b.addr, b.port));
    fe.retained.retain(|r| !fe.backends.iter().any(|b| (b.addr, b.port) == (r.addr, r.port)));
    fe.retained.sort();
    fe.retained.dedup_by_key(|b| (b.addr, b.port));
    if let Some(ib) = fe.internal_backends.as_mut() {
        ib.sort();
        ib.dedup_by_key(|b| (b.addr, b.port));
    }
    fe
}

#[cfg(test)]
#[path = "lbmaps_tests.rs"]
mod tests;
