//! Loading the embedded object: maps created or adopted from their pins, programs verified.

use std::{
    fs, io,
    mem::size_of,
    path::{Path, PathBuf},
};

use aya::{
    maps::{MapData, MapInfo, MapType},
    programs::{SchedClassifier, Xdp},
    Ebpf, EbpfLoader,
};
use proxy_common::{
    limits, map_names, prog_names, AffinityKey, AffinityMatchKey, AffinityValue, Backend, BackendFlows, Config, Counter, CtEntry, CtKey,
    FragKey, FragPorts, IfAddr, Ip6, RevNat, ServiceKey, ServiceName, ServiceValue, SockFwd, SockRevKey, SourceRangeKey, TraceResult,
    REASON_SLOTS,
};

use crate::bpffs;

/// The eBPF object built by build.rs from proxy-ebpf.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"));

#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Where maps, programs and links are pinned. None: nothing is pinned (tests, trace).
    pub pin_root: Option<PathBuf>,
    /// Entries of each load-balancer map.
    pub lb_map_max: u32,
    /// Entries of the conntrack map.
    pub ct_map_max: u32,
    /// Entries of each Maglev table (a prime).
    pub maglev_size: u32,
    /// North-south SNAT source ports (inclusive).
    pub snat_ports: (u16, u16),
    /// How long tracked connections last per state (kube-proxy's conntrack timeouts).
    pub ct_lifetimes: proxy_common::ct::Lifetimes,
    /// The cluster has IPv6 ranges: the IPv6 conntrack and affinity tables get the IPv4 ones'
    /// sizes. Otherwise they are small (`IPV6_LRU_MAX_SMALL`), as those tables are allocated
    /// whole when created.
    pub ipv6: bool,
}

impl LoadOptions {
    /// The config map's entry these options make, the Service CIDR checks off (the ranges come
    /// with the first sync).
    pub fn config(&self) -> Config {
        let (snat_port_min, snat_port_max) = self.snat_ports;
        Config { maglev_size: self.maglev_size, snat_port_min, snat_port_max, ..Default::default() }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            pin_root: None,
            lb_map_max: limits::LB_MAP_MAX,
            ct_map_max: limits::CT_MAP_MAX,
            maglev_size: limits::MAGLEV_TABLE_SIZE,
            snat_ports: (limits::SNAT_PORT_MIN, limits::SNAT_PORT_MAX),
            ct_lifetimes: proxy_common::ct::Lifetimes::DEFAULT,
            ipv6: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Bpffs(#[from] bpffs::BpffsError),
    #[error("creating {path}: {source}")]
    PinDir { path: String, source: io::Error },
    #[error(
        "pinned map {path} was created by an incompatible version ({found}; this agent needs \
         {wanted}). Run `proxy-agent cleanup --bpffs-root {root}` (tracked connections are \
         reset) or choose another --bpffs-root"
    )]
    IncompatiblePin { path: String, root: String, found: String, wanted: String },
    #[error("loading the eBPF object: {0}{hint}", hint = permission_hint(.0))]
    Load(#[source] aya::EbpfError),
    #[error("loading program {name}: {source}{hint}", hint = program_hint(source))]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("pinning {path}: {source}")]
    Pin { path: String, source: io::Error },
    #[error("filling {what}: {source}")]
    Fill { what: String, source: io::Error },
}

fn is_eperm(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            if io.raw_os_error() == Some(libc::EPERM) {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

fn permission_hint(e: &aya::EbpfError) -> String {
    capability_hint(is_eperm(e))
}

fn program_hint(e: &aya::programs::ProgramError) -> String {
    capability_hint(is_eperm(e))
}

/// What to do about a load failure: the capabilities this process lacks, if any (without
/// CAP_PERFMON the verifier refuses the programs with EACCES rather than EPERM), else what the
/// kernel must have.
fn capability_hint(eperm: bool) -> String {
    use crate::dataplane::modes::{effective_capabilities, missing_ebpf_capabilities};
    let missing = missing_ebpf_capabilities(effective_capabilities());
    if !missing.is_empty() {
        format!(" (this process lacks {}: the eBPF mode needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON)", missing.join(", "))
    } else if eperm {
        " (permission denied although CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON are held: a seccomp or LSM policy may \
         forbid bpf(2))"
            .into()
    } else {
        " (the kernel refused the program: the eBPF mode needs Linux 6.6+ with CONFIG_DEBUG_INFO_BTF)".into()
    }
}

/// Expected shape of each map: type, key size, value size.
fn expected(name: &str) -> (MapType, usize, usize) {
    match name {
        map_names::SERVICES => (MapType::Hash, size_of::<ServiceKey>(), size_of::<ServiceValue>()),
        map_names::BACKENDS => (MapType::Array, size_of::<u32>(), size_of::<Backend>()),
        map_names::REVNAT => (MapType::Hash, size_of::<u32>(), size_of::<RevNat>()),
        map_names::NAMES => (MapType::Hash, size_of::<u32>(), size_of::<ServiceName>()),
        map_names::BACKEND_FLOWS => (MapType::Array, size_of::<u32>(), size_of::<BackendFlows>()),
        map_names::CT => (MapType::LruHash, size_of::<CtKey>(), size_of::<CtEntry>()),
        map_names::FRAGS => (MapType::LruHash, size_of::<FragKey>(), size_of::<FragPorts>()),
        map_names::STATS => (MapType::PerCpuArray, size_of::<u32>(), size_of::<Counter>()),
        map_names::MAGLEV | map_names::MAGLEV6 => (MapType::HashOfMaps, size_of::<u32>(), size_of::<u32>()),
        map_names::AFFINITY => (MapType::LruHash, size_of::<AffinityKey>(), size_of::<AffinityValue>()),
        map_names::AFFINITY_MATCH => (MapType::Hash, size_of::<AffinityMatchKey>(), size_of::<u32>()),
        map_names::IFADDRS => (MapType::Hash, size_of::<u32>(), size_of::<IfAddr>()),
        map_names::IFADDRS6 => (MapType::Hash, size_of::<u32>(), size_of::<IfAddr<Ip6>>()),
        map_names::CONFIG => (MapType::Array, size_of::<u32>(), size_of::<Config>()),
        map_names::TRACE => (MapType::Array, size_of::<u32>(), size_of::<TraceResult>()),
        map_names::SOURCE_RANGES => (MapType::LpmTrie, size_of::<u32>() + size_of::<SourceRangeKey>(), size_of::<u8>()),
        map_names::SOCK_REVNAT => (MapType::LruHash, size_of::<SockRevKey>(), size_of::<RevNat>()),
        map_names::SOCK_FWD => (MapType::LruHash, size_of::<SockRevKey>(), size_of::<SockFwd>()),
        map_names::SOCK_PORTS => (MapType::LruHash, size_of::<proxy_common::SockPortKey>(), size_of::<proxy_common::SockOwner>()),
        map_names::SOCK_HELD => (MapType::LruHash, size_of::<u64>(), size_of::<proxy_common::SockPortKey>()),
        map_names::HOST_NETNS => (MapType::Array, size_of::<u32>(), size_of::<u64>()),
        map_names::XDP_DEVS => (MapType::Hash, size_of::<u32>(), size_of::<u32>()),
        map_names::FLOW_GEN => (MapType::Array, size_of::<u32>(), size_of::<proxy_common::ct::FlowGen>()),
        map_names::ADOPTING => (MapType::Array, size_of::<u32>(), size_of::<u64>()),
        map_names::SERVICE_CIDRS => (MapType::LpmTrie, size_of::<u32>() + size_of::<proxy_common::SvcCidrKey>(), size_of::<u8>()),
        map_names::SERVICES6 => (MapType::Hash, size_of::<ServiceKey<Ip6>>(), size_of::<ServiceValue>()),
        map_names::BACKENDS6 => (MapType::Array, size_of::<u32>(), size_of::<Backend<Ip6>>()),
        map_names::REVNAT6 => (MapType::Hash, size_of::<u32>(), size_of::<RevNat<Ip6>>()),
        map_names::BACKEND_FLOWS6 => (MapType::Array, size_of::<u32>(), size_of::<BackendFlows>()),
        map_names::CT6 => (MapType::LruHash, size_of::<CtKey<Ip6>>(), size_of::<CtEntry<Ip6>>()),
        map_names::FRAGS6 => (MapType::LruHash, size_of::<proxy_common::Frag6Key>(), size_of::<FragPorts>()),
        map_names::AFFINITY6 => (MapType::LruHash, size_of::<AffinityKey<Ip6>>(), size_of::<AffinityValue>()),
        map_names::AFFINITY_MATCH6 => (MapType::Hash, size_of::<AffinityMatchKey>(), size_of::<u32>()),
        map_names::SOURCE_RANGES6 => (MapType::LpmTrie, size_of::<u32>() + size_of::<SourceRangeKey<Ip6>>(), size_of::<u8>()),
        map_names::SERVICE_CIDRS6 => (MapType::LpmTrie, size_of::<u32>() + size_of::<proxy_common::SvcCidrKey<Ip6>>(), size_of::<u8>()),
        map_names::NAMES6 => (MapType::Hash, size_of::<u32>(), size_of::<ServiceName>()),
        map_names::SOCK6_REVNAT => (MapType::LruHash, size_of::<SockRevKey<Ip6>>(), size_of::<RevNat<Ip6>>()),
        map_names::SOCK6_FWD => (MapType::LruHash, size_of::<SockRevKey<Ip6>>(), size_of::<SockFwd<Ip6>>()),
        map_names::SOCK6_PORTS => (MapType::LruHash, size_of::<proxy_common::SockPortKey<Ip6>>(), size_of::<proxy_common::SockOwner>()),
        map_names::SOCK6_HELD => (MapType::LruHash, size_of::<u64>(), size_of::<proxy_common::SockPortKey<Ip6>>()),
        map_names::PROGS | map_names::PROGS_XDP => (MapType::ProgramArray, size_of::<u32>(), size_of::<u32>()),
        map_names::FILTER | map_names::FILTER6 => (MapType::Array, size_of::<u32>(), size_of::<u64>()),
        map_names::CT_FILTER | map_names::CT_FILTER6 => (MapType::Array, size_of::<u32>(), size_of::<proxy_common::ct_filter::CtFilter>()),
        other => unreachable!("unknown map {other}"),
    }
}

pub fn maps_dir(root: &Path) -> PathBuf {
    root.join("maps")
}

pub fn progs_dir(root: &Path) -> PathBuf {
    root.join("progs")
}

pub fn links_dir(root: &Path) -> PathBuf {
    root.join("links")
}

/// How many links an earlier run pinned under `root` (each an attached program); 0 when the
/// directory is not there or cannot be read.
pub fn pinned_links(root: &Path) -> usize {
    std::fs::read_dir(links_dir(root)).map(|d| d.flatten().count()).unwrap_or(0)
}

/// Refuses pinned maps whose layout differs from ours; adopting them would corrupt both.
/// Returns the maps whose pins it replaced and that must stay alive meanwhile (see below).
fn check_pins(root: &Path) -> Result<Vec<MapData>, LoadError> {
    let mut retired = Vec::new();
    // Maps of an older build's layout (a bumped version suffix, `CONFIG_V1` say): no program
    // of this build uses them; the old programs keep theirs alive until their links move on.
    if let Ok(entries) = fs::read_dir(maps_dir(root)) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !map_names::ALL.contains(&name.as_str()) && e.file_type().is_ok_and(|t| t.is_file()) {
                tracing::info!(pin = %e.path().display(), "removing the pin of a map an older build used");
                let _ = fs::remove_file(e.path());
            }
        }
    }
    for name in map_names::ALL {
        let path = maps_dir(root).join(name);
        if !path.exists() {
            continue;
        }
        let (ty, k, v) = expected(name);
        let bad = |found: String| LoadError::IncompatiblePin {
            path: path.display().to_string(),
            root: root.display().to_string(),
            found,
            wanted: format!("{ty:?} key {k} value {v}"),
        };
        let info = MapInfo::from_pin(&path).map_err(|e| bad(format!("unreadable: {e}")))?;
        let found_ty = info.map_type().map_err(|e| bad(format!("unknown type: {e}")))?;
        if found_ty != ty || info.key_size() as usize != k || info.value_size() as usize != v {
            return Err(bad(format!("{found_ty:?} key {} value {}", info.key_size(), info.value_size())));
        }
        // The counters of an older build with fewer reasons: counters only, so replaced (the
        // programs would not count the reasons beyond its end).
        if *name == *map_names::STATS && info.max_entries() != REASON_SLOTS {
            tracing::info!(pin = %path.display(), entries = info.max_entries(), "replacing the packet counters of an older build");
            fs::remove_file(&path).map_err(|e| bad(format!("cannot replace it: {e}")))?;
        }
        // A program array of an older build with fewer slots: this build's programs do not
        // fit in it, so it is replaced. A program array is emptied when its last holder of a
        // descriptor or pin lets go; the older programs, attached until this run's links replace
        // them, keep calling into it meanwhile, so this process holds it open (as long as it
        // runs: by then nothing attached uses it).
        // A frontend filter of another size (a build with another `filter::BITS_LOG2`) places
        // frontends elsewhere: replaced, and filled anew (see `load`).
        if [map_names::FILTER, map_names::FILTER6].contains(&name) && info.max_entries() != proxy_common::filter::WORDS {
            tracing::info!(pin = %path.display(), words = info.max_entries(), "replacing the frontend filter of an older build");
            fs::remove_file(&path).map_err(|e| bad(format!("cannot replace it: {e}")))?;
        }
        let slots = match name {
            map_names::PROGS => Some(proxy_common::prog_slots::COUNT),
            map_names::PROGS_XDP => Some(proxy_common::prog_slots::XDP_COUNT),
            _ => None,
        };
        if slots.is_some_and(|n| info.max_entries() != n) {
            tracing::info!(pin = %path.display(), slots = info.max_entries(), "replacing the program array of an older build");
            retired.push(MapData::from_pin(&path).map_err(|e| bad(format!("cannot hold it open: {e}")))?);
            fs::remove_file(&path).map_err(|e| bad(format!("cannot replace it: {e}")))?;
        }
    }
    Ok(retired)
}

/// The loaded object: maps (created, or adopted from pins) and the verified programs; and
/// whether the pins outlive this process (see `bpffs`).
/// What `load` made: the object, whether its pins outlive this process (see `bpffs`), and the
/// entries the load-balancer maps and the conntrack map hold at most (an adopted map keeps the
/// size it was created with, whatever the options ask now).
pub struct Loaded {
    pub ebpf: Ebpf,
    pub outlives_agent: bool,
    pub lb_map_max: u32,
    /// Entries of the IPv6 load-balancer maps: IPv4's, unless an earlier run pinned them at
    /// another size (adopted as they are).
    pub lb6_map_max: u32,
    pub ct_map_max: u32,
    /// Entries of the IPv6 conntrack map.
    pub ct6_map_max: u32,
    /// Maps of an older build whose pins were replaced, held open (see `check_pins`).
    pub retired: Vec<MapData>,
}

pub fn load(options: &LoadOptions) -> Result<Loaded, LoadError> {
    raise_memlock();
    let mut loader = EbpfLoader::new();
    loader.map_max_entries(map_names::STATS, REASON_SLOTS);
    loader.override_global("CT_LIFETIMES", &options.ct_lifetimes, true);
    let mut outlives_agent = false;
    let mut retired = Vec::new();
    let pin_paths: Vec<(&str, PathBuf)> = match &options.pin_root {
        Some(root) => {
            let prepared = bpffs::prepare(root)?;
            report_bpffs(root, &prepared);
            outlives_agent = prepared.outlives_agent;
            for dir in [maps_dir(root), progs_dir(root), links_dir(root)] {
                fs::create_dir_all(&dir).map_err(|source| LoadError::PinDir { path: dir.display().to_string(), source })?;
            }
            retired = check_pins(root)?;
            map_names::ALL.iter().map(|n| (*n, maps_dir(root).join(n))).collect()
        }
        None => Vec::new(),
    };
    // A map a previous run pinned is adopted as it is, its size included (its entries are the
    // connections' state): the object asks for that size, else the kernel would not take the
    // pin for the object's map and the load would fail.
    let pinned =
        |name: &str| pin_paths.iter().find(|(n, _)| *n == name).and_then(|(_, p)| MapInfo::from_pin(p).ok()).map(|i| i.max_entries());
    // Each family's load-balancer maps share one size, the writer's id limit: the smallest an
    // earlier run pinned (adopted as they are), else the option for IPv4 and IPv4's for IPv6.
    // A map of the family that is not pinned (a build that adds one, a pin removed by hand) is
    // created at that size, so no id the writer hands out falls past its end.
    let family_size = |names: &[&str], otherwise: u32| names.iter().filter_map(|n| pinned(n)).min().unwrap_or(otherwise);
    let lb_map_max = family_size(&map_names::LB_V4, options.lb_map_max.max(2));
    let lb6_map_max = family_size(&map_names::LB_V6, lb_map_max);
    for (names, size) in [(map_names::LB_V4, lb_map_max), (map_names::LB_V6, lb6_map_max)] {
        for name in names {
            loader.map_max_entries(name, pinned(name).unwrap_or(size));
        }
    }
    let ct_map_max = pinned(map_names::CT).unwrap_or(options.ct_map_max.max(2));
    // The IPv6 tables that are allocated whole when created (LRUs): sized like IPv4's (as the
    // IPv4 ones are, adopted sizes included) on a cluster with IPv6 ranges, small elsewhere
    // instead of doubling the conntrack table's memory on every IPv4 node. A pinned one of
    // the other size is replaced (its IPv6 flows are tracked afresh; a host socket already
    // connected to an IPv6 Service then shows its backend to getpeername): that follows a
    // change of the cluster's ranges, or an IPv4 table resized by `proxy-agent cleanup`.
    let small = |v4: u32| if options.ipv6 { v4 } else { v4.min(IPV6_LRU_MAX_SMALL) };
    for (name, want) in [
        (map_names::CT6, small(ct_map_max)),
        (map_names::AFFINITY6, small(limits::AFFINITY_MAP_MAX)),
        (map_names::FRAGS6, small(limits::FRAG_MAP_MAX)),
        (map_names::SOCK6_REVNAT, small(limits::SOCK_REVNAT_MAX)),
        (map_names::SOCK6_FWD, small(limits::SOCK_REVNAT_MAX)),
        (map_names::SOCK6_PORTS, small(limits::SOCK_REVNAT_MAX)),
        (map_names::SOCK6_HELD, small(limits::SOCK_REVNAT_MAX)),
    ] {
        if let Some(held) = pinned(name).filter(|held| *held != want) {
            let path = pin_paths.iter().find(|(n, _)| *n == name).map(|(_, p)| p.clone()).expect("a pinned map has a path");
            tracing::warn!(pin = %path.display(), held, want, "resizing an IPv6 table: its IPv6 flows are tracked afresh");
            fs::remove_file(&path).map_err(|source| LoadError::Pin { path: path.display().to_string(), source })?;
        }
        loader.map_max_entries(name, want);
    }
    loader.map_max_entries(map_names::CT, ct_map_max);
    // A frontend filter created now (the first start, or pins of a build without it) says
    // "maybe" everywhere until the map writer has counted the Services it adopts and cleared
    // the rest: the IPv6 programs go into the pinned program array below, where the programs
    // still attached call them from their next packet, before the writer runs. It is pinned
    // once filled, so that a start that dies before leaves no pin to be trusted. (Without pins
    // nothing attached can reach this load's programs before the writer has run.)
    // A config map created now (the first start, or pins of a build with another layout) is
    // likewise filled before it is pinned: the options' settings, with the Service CIDR checks
    // off until the first sync writes the ranges.
    let filled_at_load = [map_names::FILTER, map_names::FILTER6, map_names::CONFIG];
    let new_maps: Vec<&str> = filled_at_load.into_iter().filter(|n| options.pin_root.is_some() && pinned(n).is_none()).collect();
    // A conntrack filter created now is filled before it is pinned too, pins or not (its
    // control word says which half lookups read): every bit set when the family's conntrack
    // map is adopted, none when it is new (see `ct_filter::fill`).
    let ct_filters: Vec<(&str, bool)> = [(map_names::CT_FILTER, map_names::CT), (map_names::CT_FILTER6, map_names::CT6)]
        .into_iter()
        .filter(|(filter, _)| pinned(filter).is_none())
        .map(|(filter, ct)| (filter, pinned(ct).is_some()))
        .collect();
    for (name, path) in &pin_paths {
        if !new_maps.contains(name) && !ct_filters.iter().any(|(n, _)| n == name) {
            loader.map_pin_path(name, path.as_path());
        }
    }
    let mut ebpf = loader.load(OBJECT).map_err(LoadError::Load)?;
    for name in new_maps {
        let fail = |source: io::Error| LoadError::Fill { what: format!("{name}, created at load"), source };
        let map = ebpf.map_mut(name).ok_or_else(|| fail(io::Error::other("the object has no such map")))?;
        if name == map_names::CONFIG {
            let mut array: aya::maps::Array<_, Config> = aya::maps::Array::try_from(&mut *map).map_err(|e| fail(io::Error::other(e)))?;
            array.set(0, options.config(), 0).map_err(|e| fail(io::Error::other(e)))?;
        } else {
            let mut words: aya::maps::Array<_, u64> = aya::maps::Array::try_from(&mut *map).map_err(|e| fail(io::Error::other(e)))?;
            for i in 0..proxy_common::filter::WORDS {
                words.set(i, u64::MAX, 0).map_err(|e| fail(io::Error::other(e)))?;
            }
        }
        if let Some((_, path)) = pin_paths.iter().find(|(n, _)| *n == name) {
            map.pin(path).map_err(|e| LoadError::Pin { path: path.display().to_string(), source: io::Error::other(e) })?;
        }
    }
    for (name, ct_adopted) in ct_filters {
        let fail = |source: io::Error| LoadError::Fill { what: format!("{name}, created at load"), source };
        let map = ebpf.map_mut(name).ok_or_else(|| fail(io::Error::other("the object has no such map")))?;
        let fd = match &*map {
            aya::maps::Map::Array(data) => std::os::fd::AsFd::as_fd(data.fd()),
            _ => return Err(fail(io::Error::other("not an array"))),
        };
        super::ct_filter::fill(fd, ct_adopted).map_err(fail)?;
        if let Some((_, path)) = pin_paths.iter().find(|(n, _)| *n == name) {
            map.pin(path).map_err(|e| LoadError::Pin { path: path.display().to_string(), source: io::Error::other(e) })?;
        }
    }
    for name in [prog_names::TC_INGRESS, prog_names::TC_EGRESS, prog_names::TC_EXT_INGRESS, prog_names::XDP_EXT] {
        let pin = |pin: &mut dyn FnMut(&Path) -> Result<(), aya::pin::PinError>| -> Result<(), LoadError> {
            let Some(root) = &options.pin_root else { return Ok(()) };
            let path = progs_dir(root).join(name);
            // Replace the previous run's pin; its links keep the old program alive until they
            // are updated to this one.
            let _ = fs::remove_file(&path);
            pin(&path).map_err(|e| LoadError::Pin { path: path.display().to_string(), source: io::Error::other(e) })
        };
        if name == prog_names::XDP_EXT {
            let prog = xdp(&mut ebpf, name);
            load_program(|| prog.load()).map_err(|source| LoadError::Program { name, source })?;
            pin(&mut |p| prog.pin(p))?;
        } else {
            let prog = classifier(&mut ebpf, name);
            load_program(|| prog.load()).map_err(|source| LoadError::Program { name, source })?;
            pin(&mut |p| prog.pin(p))?;
        }
    }
    fill_tail_calls(&mut ebpf)?;
    Ok(Loaded { ebpf, outlives_agent, lb_map_max, lb6_map_max, ct_map_max, ct6_map_max: small(ct_map_max), retired })
}

/// Loads a program (`load`: its `load()`), again while the kernel answers EAGAIN, as libbpf
/// does: the verifier gives up with EAGAIN when a signal is pending for the loading thread
/// (a child process's SIGCHLD, to a process that handles it), more often the longer a program
/// takes to verify.
pub fn load_program(load: impl FnMut() -> Result<(), aya::programs::ProgramError>) -> Result<(), aya::programs::ProgramError> {
    retried(load, |e| matches!(e, aya::programs::ProgramError::LoadError { io_error, .. } if io_error.raw_os_error() == Some(libc::EAGAIN)))
}

/// `f`, called again (five calls at most) while its error is one `again` says may pass.
fn retried<E>(mut f: impl FnMut() -> Result<(), E>, again: impl Fn(&E) -> bool) -> Result<(), E> {
    let mut calls = 1;
    loop {
        match f() {
            Err(e) if again(&e) && calls < 5 => calls += 1,
            done => return done,
        }
    }
}

/// See the IPv6 LRUs' sizing in `load`.
pub const IPV6_LRU_MAX_SMALL: u32 = 4096;

/// Loads the programs the others tail-call and puts each in its slot of `map_names::PROGS`
/// (replacing an earlier run's: the pinned array keeps whatever it holds alive, and the
/// attached programs reach the new ones from their next packet).
fn fill_tail_calls(ebpf: &mut Ebpf) -> Result<(), LoadError> {
    let mut fds = Vec::new();
    for (name, slot) in prog_names::TAIL_CALLED {
        let prog = classifier(ebpf, name);
        load_program(|| prog.load()).map_err(|source| LoadError::Program { name, source })?;
        let fd = prog.fd().map_err(|source| LoadError::Program { name, source })?;
        let fd = fd.try_clone().map_err(|source| LoadError::Fill { what: format!("{name}'s descriptor"), source })?;
        fds.push((slot, fd));
    }
    let map = ebpf.map_mut(map_names::PROGS).expect("the object defines PROGS_V1");
    let mut progs = aya::maps::ProgramArray::try_from(map).expect("PROGS_V1 is a program array");
    for (slot, fd) in &fds {
        progs
            .set(*slot, fd, 0)
            .map_err(|e| LoadError::Fill { what: format!("{}[{slot}]", map_names::PROGS), source: io::Error::other(e) })?;
    }
    let name = prog_names::XDP_EXT6;
    let prog = xdp(ebpf, name);
    load_program(|| prog.load()).map_err(|source| LoadError::Program { name, source })?;
    let fd = prog.fd().map_err(|source| LoadError::Program { name, source })?;
    let fd = fd.try_clone().map_err(|source| LoadError::Fill { what: format!("{name}'s descriptor"), source })?;
    let map = ebpf.map_mut(map_names::PROGS_XDP).expect("the object defines PROGS_XDP_V1");
    let mut progs = aya::maps::ProgramArray::try_from(map).expect("PROGS_XDP_V1 is a program array");
    progs.set(0, &fd, 0).map_err(|e| LoadError::Fill { what: format!("{}[0]", map_names::PROGS_XDP), source: io::Error::other(e) })?;
    Ok(())
}

fn report_bpffs(root: &Path, p: &bpffs::Prepared) {
    let Some(mounted) = &p.mounted else { return };
    if p.outlives_agent {
        tracing::info!(bpffs = %mounted.display(), "mounted a BPF filesystem for the pins");
    } else {
        tracing::error!(
            bpffs = %mounted.display(),
            "mounted a BPF filesystem that is private to this agent's mount namespace (a container, or `ip netns exec`): \
             every pin under {} dies with this process, so the next start resets every tracked connection and the \
             programs stop when the agent stops. Mount a bpffs on the host (`mount -t bpf bpf /sys/fs/bpf`) and give the \
             agent the host's /sys/fs/bpf (deploy/daemonset.yaml does), or start it with `nsenter --net=...` instead of \
             `ip netns exec`",
            root.display()
        );
    }
}

/// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK; lift it so map creation does not
/// fail there. Newer kernels ignore it.
fn raise_memlock() {
    let lim = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: plain setrlimit call with a valid struct.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) };
}

/// `proxy-agent cleanup`: unpins links (detaching the programs), programs and maps.
pub fn unpin_all(root: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for dir in [links_dir(root), progs_dir(root), maps_dir(root)] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            std::fs::remove_file(e.path())?;
            removed.push(e.path());
        }
        std::fs::remove_dir(&dir)?;
    }
    // The root itself may be a bpffs mount point; leave it.
    Ok(removed)
}

/// A program of the loaded object, by name, as the type `kind` names.
fn program<'a, T>(ebpf: &'a mut Ebpf, name: &'static str, kind: &str) -> &'a mut T
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program>,
{
    ebpf.program_mut(name).unwrap_or_else(|| panic!("the object defines {name}")).try_into().unwrap_or_else(|_| panic!("{name} is {kind}"))
}

/// A classifier program of the loaded object, by name (`prog_names`).
pub fn classifier<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> &'a mut SchedClassifier {
    program(ebpf, name, "a classifier")
}

/// A cgroup sock_addr program of the loaded object, by name (`prog_names::SOCK_HOOKS`).
pub fn sock_addr<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> &'a mut aya::programs::CgroupSockAddr {
    program(ebpf, name, "a cgroup sock_addr program")
}

/// A cgroup sock program of the loaded object, by name (`prog_names::SOCK_RELEASE`).
pub fn cgroup_sock<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> &'a mut aya::programs::CgroupSock {
    program(ebpf, name, "a cgroup sock program")
}

/// An XDP program of the loaded object, by name (`prog_names`).
pub fn xdp<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> &'a mut Xdp {
    program(ebpf, name, "an XDP program")
}

#[cfg(test)]
mod tests {
    use super::retried;

    /// The embedded object keeps its BTF with the line info (what the loader, verifier logs and
    /// `bpftool ... linum` use) and carries no DWARF (build.rs `strip_dwarf`): that was 5 of
    /// its 6.5 MB, in the agent's binary and partly in its memory.
    #[test]
    fn the_embedded_object_has_btf_and_no_dwarf() {
        use object::{Object as _, ObjectSection as _};
        let elf = object::File::parse(super::OBJECT).expect("the embedded object");
        let size = |name: &str| elf.section_by_name(name).map(|s| s.size()).unwrap_or(0);
        // The line info is most of .BTF.ext: a few hundred KB for the object's programs.
        assert!(size(".BTF") > 0 && size(".BTF.ext") > 100_000, "BTF {} and .BTF.ext {} bytes", size(".BTF"), size(".BTF.ext"));
        let dwarf: Vec<_> = elf.sections().filter_map(|s| s.name().ok().filter(|n| n.contains(".debug")).map(str::to_owned)).collect();
        assert!(dwarf.is_empty(), "DWARF left in the object: {dwarf:?}");
        assert!(super::OBJECT.len() < 3 << 20, "the object is {} bytes", super::OBJECT.len());
    }

    /// A program load the verifier gave up on because of a signal (EAGAIN) is tried again, up
    /// to five times in all; another error is not.
    #[test]
    fn a_load_interrupted_by_a_signal_is_tried_again() {
        // Calls `retried` on a load whose call `n` (from 1) answers `answer(n)`: its result and
        // how many calls it took.
        let run = |answer: &dyn Fn(u32) -> Result<(), i32>| {
            let mut calls = 0;
            let r = retried(
                || {
                    calls += 1;
                    answer(calls).map_err(std::io::Error::from_raw_os_error)
                },
                |e| e.raw_os_error() == Some(libc::EAGAIN),
            );
            (r, calls)
        };
        let (r, calls) = run(&|n| if n < 3 { Err(libc::EAGAIN) } else { Ok(()) });
        assert!(r.is_ok() && calls == 3, "loaded at the third call ({calls})");
        let (r, calls) = run(&|_| Err(libc::EAGAIN));
        assert!(r.is_err() && calls == 5, "given up after five calls ({calls})");
        let (r, calls) = run(&|_| Err(libc::EINVAL));
        assert!(r.is_err() && calls == 1, "a refusal is not tried again ({calls})");
    }
}
