//! `proxy-agent inspect`: what is programmed, read straight from the pinned maps.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
};

use aya::maps::{lpm_trie::LpmTrie, Array, HashMap, Map, MapData, PerCpuArray};
use proxy_common::{
    backend_flags, ct, map_names, svc_flags,
    user::{proto_name, MapAddr},
    BackendFlows, Counter, CtEntry, CtKey, Reason, SourceRangeKey,
};
use serde::Serialize;

use crate::dataplane::ebpf::{attach, lbmaps, loader, snapshot};

#[derive(Debug, Serialize)]
pub struct Report {
    pub bpffs_root: PathBuf,
    pub frontends: Vec<FrontendReport>,
    /// Backends in the map that no frontend slot names: kept for the flows they have.
    pub retained_backends: Vec<BackendReport>,
    pub conntrack: ConntrackReport,
    /// Packets and bytes per datapath reason, summed over CPUs.
    pub counters: BTreeMap<String, CounterReport>,
    /// Pod interfaces (index -> name): a pinned tc ingress link.
    pub interfaces: BTreeMap<u32, String>,
    /// External interfaces: a pinned external tc ingress link, and whether XDP is attached.
    pub external_interfaces: BTreeMap<u32, ExternalInterface>,
    /// Socket hooks with a pinned link (host-network processes reach Services through them).
    pub socket_hooks: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct ExternalInterface {
    pub name: String,
    pub xdp: bool,
    /// XDP may send frames out of it itself (else it hands the flows leaving by it to TC: a
    /// veth whose peer runs no XDP program, say).
    pub xdp_sends: bool,
}

#[derive(Debug, Serialize)]
pub struct FrontendReport {
    pub address: String,
    pub protocol: String,
    pub service: Option<String>,
    pub service_id: u32,
    /// "external": what clients of the address get; "internal": what pods get instead, for
    /// a Service whose external traffic policy differs.
    pub scope: &'static str,
    /// Master entry flags: external (served on external interfaces), maglev,
    /// drop-when-empty, two-scopes.
    pub flags: Vec<&'static str>,
    pub affinity_timeout: Option<u32>,
    /// loadBalancerSourceRanges: the only sources new flows are accepted from (empty: any).
    pub source_ranges: Vec<String>,
    pub backends: Vec<BackendReport>,
    /// Live tracked connections of this frontend.
    pub connections: u64,
}

#[derive(Debug, Serialize, Clone)]
pub struct BackendReport {
    pub id: u32,
    pub address: String,
    /// New flows the datapath sent to this backend since it got its id.
    pub flows: u64,
    pub terminating: bool,
    pub local: bool,
}

#[derive(Debug, Serialize, Default)]
pub struct ConntrackReport {
    pub entries: u64,
    pub connections: u64,
    pub expired: u64,
    /// Entries of connections kube-proxy masqueraded before the takeover, which netfilter goes
    /// on translating (two a connection: `ct::owner::NETFILTER`).
    pub netfilter: u64,
}

#[derive(Debug, Serialize, Default)]
pub struct CounterReport {
    pub packets: u64,
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error(
        "nothing is programmed under {0}: no pinned maps there. Is the agent running with \
         --bpffs-root {0}?"
    )]
    NotFound(String),
    #[error("{path}: permission denied: reading what the agent pinned needs root (CAP_BPF, and access to the BPF filesystem)")]
    Permission { path: String },
    #[error("reading {map}: {source}")]
    Map {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
}

fn open(root: &Path, name: &'static str) -> Result<MapData, InspectError> {
    MapData::from_pin(loader::maps_dir(root).join(name)).map_err(|source| InspectError::Map { map: name, source })
}

/// Whether `path` is there; a directory on the way this process may not read is an error,
/// not "nothing there".
pub fn pinned(path: &Path) -> Result<bool, InspectError> {
    for p in path.ancestors().collect::<Vec<_>>().into_iter().rev() {
        match std::fs::symlink_metadata(p) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                return Err(InspectError::Permission { path: p.display().to_string() })
            }
            Err(_) => return Ok(false),
        }
        if p != path && std::fs::read_dir(p).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied) {
            return Err(InspectError::Permission { path: p.display().to_string() });
        }
    }
    Ok(true)
}

pub fn read(root: &Path) -> Result<Report, InspectError> {
    if !pinned(&loader::maps_dir(root).join(map_names::SERVICES))? {
        return Err(InspectError::NotFound(root.display().to_string()));
    }
    let err = |map| move |source| InspectError::Map { map, source };
    let stats: PerCpuArray<_, Counter> =
        PerCpuArray::try_from(Map::PerCpuArray(open(root, map_names::STATS)?)).map_err(err(map_names::STATS))?;
    let now = crate::dataplane::ebpf::ct_gc::monotonic_coarse_ns();
    let mut family = family_report::<[u8; 4]>(root, map_names::CT, now)?;
    // Absent in pins of a version before IPv6: none then.
    if pinned(&loader::maps_dir(root).join(map_names::SERVICES6))? {
        let v6 = family_report::<proxy_common::Ip6>(root, map_names::CT6, now)?;
        family.frontends.extend(v6.frontends);
        family.retained_backends.extend(v6.retained_backends);
        family.conntrack.entries += v6.conntrack.entries;
        family.conntrack.connections += v6.conntrack.connections;
        family.conntrack.expired += v6.conntrack.expired;
        family.conntrack.netfilter += v6.conntrack.netfilter;
    }
    let FamilyReport { frontends, retained_backends, conntrack } = family;

    let mut counters = BTreeMap::new();
    for r in Reason::ALL {
        if let Ok(per_cpu) = stats.get(&(*r as u32), 0) {
            let c = per_cpu
                .iter()
                .fold(CounterReport::default(), |acc, c| CounterReport { packets: acc.packets + c.packets, bytes: acc.bytes + c.bytes });
            if c.packets > 0 {
                counters.insert(r.label().to_string(), c);
            }
        }
    }

    let mut interfaces = BTreeMap::new();
    let mut external_interfaces = BTreeMap::new();
    let mut with_xdp = BTreeSet::new();
    let mut socket_hooks = Vec::new();
    if let Ok(dir) = std::fs::read_dir(loader::links_dir(root)) {
        for e in dir.flatten() {
            if let Some(hook) = e.file_name().to_str().and_then(|n| n.strip_prefix(crate::dataplane::ebpf::hostsock::PIN_PREFIX)) {
                socket_hooks.push(hook.trim_start_matches("proxy_sock_").to_string());
                continue;
            }
            match e.file_name().to_str().and_then(attach::parse_pin_hook) {
                Some(("tc_ingress_", idx, name)) => {
                    interfaces.insert(idx, name);
                }
                Some(("tc_ext_ingress_", idx, name)) => {
                    external_interfaces.insert(idx, ExternalInterface { name, xdp: false, xdp_sends: false });
                }
                Some(("xdp_", idx, _)) => {
                    with_xdp.insert(idx);
                }
                _ => {}
            }
        }
    }
    // Absent in pins of a version before it: nothing recorded then.
    let xdp_devs: BTreeMap<u32, u32> = open(root, map_names::XDP_DEVS)
        .ok()
        .and_then(|m| HashMap::<_, u32, u32>::try_from(Map::HashMap(m)).ok())
        .map(|m| m.iter().flatten().collect())
        .unwrap_or_default();
    for (idx, e) in external_interfaces.iter_mut() {
        e.xdp = with_xdp.contains(idx);
        e.xdp_sends = e.xdp && xdp_devs.get(idx).is_some_and(|f| f & (proxy_common::xdp_dev::TX | proxy_common::xdp_dev::GENERIC) != 0);
    }
    socket_hooks.sort();
    Ok(Report {
        bpffs_root: root.to_path_buf(),
        frontends,
        retained_backends,
        conntrack,
        counters,
        interfaces,
        external_interfaces,
        socket_hooks,
    })
}

/// One family's part of the report, from its maps (`MapAddr::LB`) and its conntrack table
/// `ct`.
struct FamilyReport {
    frontends: Vec<FrontendReport>,
    retained_backends: Vec<BackendReport>,
    conntrack: ConntrackReport,
}

fn family_report<A: MapAddr>(root: &Path, ct_name: &'static str, now: u64) -> Result<FamilyReport, InspectError> {
    let err = |map| move |source| InspectError::Map { map, source };
    let maps = A::LB;
    let services = HashMap::try_from(Map::HashMap(open(root, maps.services)?)).map_err(err(maps.services))?;
    let backends = Array::try_from(Map::Array(open(root, maps.backends)?)).map_err(err(maps.backends))?;
    let revnat = HashMap::try_from(Map::HashMap(open(root, maps.revnat)?)).map_err(err(maps.revnat))?;
    let names = HashMap::try_from(Map::HashMap(open(root, maps.names)?)).map_err(err(maps.names))?;
    let flows: Array<_, BackendFlows> = Array::try_from(Map::Array(open(root, maps.flows)?)).map_err(err(maps.flows))?;
    let ct_map: HashMap<_, CtKey<A>, CtEntry<A>> = HashMap::try_from(Map::LruHashMap(open(root, ct_name)?)).map_err(err(ct_name))?;

    let snap: snapshot::Snapshot<A> = snapshot::read(&services, &backends, &revnat, &names).map_err(err(maps.services))?;
    let mut ranges: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    // Absent in pins of a version without source ranges: none then.
    if let Ok(m) = open(root, maps.source_ranges) {
        let trie: LpmTrie<_, SourceRangeKey<A>, u8> = LpmTrie::try_from(Map::LpmTrie(m)).map_err(err(maps.source_ranges))?;
        for k in trie.keys().flatten() {
            let shown = match lbmaps::range_of(&k) {
                Some(r) => r.to_string(),
                // Not a key the agent writes: shown as it is.
                None => format!("{}/{}", k.data().addr.ip(), k.prefix_len().saturating_sub(SourceRangeKey::ID_BITS)),
            };
            ranges.entry(k.data().service_id).or_default().push(shown);
        }
    }

    let mut conntrack = ConntrackReport::default();
    let mut per_service: BTreeMap<u32, u64> = BTreeMap::new();
    for entry in ct_map.iter() {
        let Ok((k, e)) = entry else { continue };
        conntrack.entries += 1;
        if e.flags & ct::flags::REPLY != 0 {
            continue;
        }
        if e.owner == ct::owner::NETFILTER {
            conntrack.netfilter += 1;
            continue;
        }
        if ct::expired(k.proto, e.flags, e.last_seen_ns, now, &ct::Lifetimes::DEFAULT) {
            conntrack.expired += 1;
        } else {
            conntrack.connections += 1;
            *per_service.entry(e.service_id).or_default() += 1;
        }
    }

    let backend_report = |id: u32| -> Option<BackendReport> {
        let b = snap.backends.get(&id)?;
        Some(BackendReport {
            id,
            address: SocketAddr::new(b.addr.ip(), u16::from_be_bytes(b.port)).to_string(),
            flows: flows.get(&id, 0).map(|f| f.flows).unwrap_or(0),
            terminating: b.flags & backend_flags::TERMINATING != 0,
            local: b.flags & backend_flags::LOCAL != 0,
        })
    };
    let mut in_slots = BTreeSet::new();
    let frontends = snap
        .frontends
        .values()
        .map(|fe| {
            in_slots.extend(fe.slots.iter().copied());
            let f = fe.master.flags;
            let flags = [
                (svc_flags::EXTERNAL, "external"),
                (svc_flags::MAGLEV, "maglev"),
                (svc_flags::DROP_WHEN_EMPTY, "drop-when-empty"),
                (svc_flags::TWO_SCOPES, "two-scopes"),
                (svc_flags::SOURCE_RANGES, "source-ranges"),
            ]
            .iter()
            .filter(|(bit, _)| f & bit != 0)
            .map(|(_, n)| *n)
            .collect();
            FrontendReport {
                address: SocketAddr::new(fe.key.addr.ip(), u16::from_be_bytes(fe.key.port)).to_string(),
                protocol: proto_name(fe.key.proto).to_string(),
                service: fe.name.clone(),
                service_id: fe.master.service_id,
                scope: if fe.key.scope == proxy_common::scope::INTERNAL { "internal" } else { "external" },
                flags,
                affinity_timeout: (fe.master.affinity_timeout != 0).then_some(fe.master.affinity_timeout),
                source_ranges: ranges.get(&fe.master.service_id).cloned().unwrap_or_default(),
                backends: fe.slots.iter().filter_map(|id| backend_report(*id)).collect(),
                connections: per_service.get(&fe.master.service_id).copied().unwrap_or(0),
            }
        })
        .collect();
    let retained_backends = snap.backends.keys().filter(|id| !in_slots.contains(id)).filter_map(|id| backend_report(*id)).collect();
    Ok(FamilyReport { frontends, retained_backends, conntrack })
}

/// The report for people.
pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let backends: usize = r.frontends.iter().map(|f| f.backends.len()).sum();
    let _ = writeln!(
        s,
        "Services programmed under {} ({} frontends, {} backends in use)\n",
        r.bpffs_root.display(),
        r.frontends.len(),
        backends
    );
    for f in &r.frontends {
        let address = format!("{}/{}", f.address, f.protocol);
        let _ = write!(s, "  {address:<24} {:<32}", f.service.as_deref().unwrap_or("(unnamed)"));
        let _ = write!(s, " connections {}", f.connections);
        if f.scope == "internal" {
            s.push_str("  (pods' view)");
        }
        if !f.flags.is_empty() {
            let _ = write!(s, "  [{}]", f.flags.join(","));
        }
        if let Some(t) = f.affinity_timeout {
            let _ = write!(s, "  affinity ClientIP {t}s");
        }
        s.push('\n');
        if !f.source_ranges.is_empty() {
            let _ = writeln!(s, "      new flows only from {}", f.source_ranges.join(", "));
        }
        if f.backends.is_empty() {
            s.push_str("      no endpoints: clients get ICMP port unreachable (connection refused)\n");
        }
        for b in &f.backends {
            let _ = write!(s, "      -> {:<22} flows {:>6}", b.address, b.flows);
            if b.terminating {
                s.push_str("  terminating");
            }
            if b.local {
                s.push_str("  local");
            }
            s.push('\n');
        }
    }
    if !r.retained_backends.is_empty() {
        s.push_str("\n  Kept for existing flows only:");
        for b in &r.retained_backends {
            let _ = write!(s, " {}{}", b.address, if b.terminating { " (terminating)" } else { "" });
        }
        s.push('\n');
    }
    let _ = writeln!(
        s,
        "\nConnection tracking: {} live connections, {} expired, {} entries",
        r.conntrack.connections, r.conntrack.expired, r.conntrack.entries
    );
    if r.conntrack.netfilter > 0 {
        let _ = writeln!(
            s,
            "  {} entries of connections netfilter masqueraded before the takeover, left to it (two a connection)",
            r.conntrack.netfilter
        );
    }
    s.push_str("\nDatapath counters           packets        bytes\n");
    if r.counters.is_empty() {
        s.push_str("  (no packets yet)\n");
    }
    for (name, c) in &r.counters {
        let _ = writeln!(s, "  {name:<24} {:>10} {:>12}", c.packets, c.bytes);
    }
    s.push_str("\nAttached to:");
    if r.interfaces.is_empty() {
        s.push_str(" no interface");
    }
    for (idx, name) in &r.interfaces {
        let _ = write!(s, " {name}({idx})");
    }
    s.push('\n');
    if !r.external_interfaces.is_empty() {
        s.push_str("External:   ");
        for (idx, e) in &r.external_interfaces {
            let xdp = match (e.xdp, e.xdp_sends) {
                (true, true) => " +xdp",
                (true, false) => " +xdp(hands flows to tc)",
                (false, _) => "",
            };
            let _ = write!(s, " {}({idx}){xdp}", e.name);
        }
        s.push('\n');
    }
    if !r.socket_hooks.is_empty() {
        let _ = writeln!(s, "Host sockets: {} (host-network processes reach Services)", r.socket_hooks.join(", "));
    }
    s
}
