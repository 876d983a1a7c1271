//! The maps, declared with BTF so `bpftool map dump` prints field names. Names match
//! `proxy_common::map_names`; sizes are defaults the agent may override at creation.

use aya_ebpf::{
    bindings::{BPF_F_INNER_MAP, BPF_F_MMAPABLE, BPF_F_NO_PREALLOC},
    btf_maps::{Array, HashMap, HashOfMaps, LpmTrie, LruHashMap, PerCpuArray, ProgramArray},
    macros::btf_map,
};
use proxy_common::{
    limits, AffinityKey, AffinityMatchKey, AffinityValue, Backend, BackendFlows, ClockCache, Config, Counter, CtEntry, CtKey, Frag6Key,
    FragKey, FragPorts, IfAddr, Ip6, RevNat, ServiceKey, ServiceName, ServiceValue, SockFwd, SockOwner, SockPortKey, SockRevKey,
    SourceRangeKey, SvcCidrKey, TraceResult, REASON_SLOTS,
};

const LB_MAX: usize = limits::LB_MAP_MAX as usize;
// Load-balancer maps are written only by the agent; without preallocation their memory follows
// the number of services instead of the configured maximum.
const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

#[btf_map]
pub static LB4_SERVICES_V1: HashMap<ServiceKey, ServiceValue, LB_MAX, NO_PREALLOC> = HashMap::new();

/// An array: the verifier inlines array lookups, and every established packet does one.
#[btf_map]
pub static LB4_BACKENDS_V1: Array<Backend, LB_MAX> = Array::new();

#[btf_map]
pub static LB4_REVNAT_V1: HashMap<u32, RevNat, LB_MAX, NO_PREALLOC> = HashMap::new();

#[btf_map]
pub static LB4_FLOWS_V1: Array<BackendFlows, LB_MAX> = Array::new();

/// One LRU list for the whole map. Per-CPU lists (BPF_F_NO_COMMON_LRU) would spare new flows a
/// lock, but split the capacity evenly between CPUs: a CPU that sees most new connections would
/// start evicting live ones at 1/N of the map, and an evicted entry is a reset connection.
#[btf_map]
pub static CT4_V2: LruHashMap<CtKey, CtEntry, { limits::CT_MAP_MAX as usize }> = LruHashMap::new();

#[btf_map]
pub static FRAG4_V1: LruHashMap<FragKey, FragPorts, { limits::FRAG_MAP_MAX as usize }> = LruHashMap::new();

#[btf_map]
pub static STATS_V1: PerCpuArray<Counter, { REASON_SLOTS as usize }> = PerCpuArray::new();

/// Names for people; no program reads it, it is declared here so it is created and pinned with
/// the others.
#[btf_map]
pub static LB4_NAMES_V1: HashMap<u32, ServiceName, LB_MAX, NO_PREALLOC> = HashMap::new();

/// Where new conntrack entries are built (see `ct::scratch`). Scratch, never pinned.
#[btf_map]
pub static CT_SCRATCH: PerCpuArray<CtEntry, 1> = PerCpuArray::new();

/// Where ICMP port unreachable messages are built (see `icmp::reject`). Scratch, never
/// pinned.
#[btf_map]
pub static ICMP_SCRATCH: PerCpuArray<crate::icmp::Message, 1> = PerCpuArray::new();

/// Per-CPU cache of the coarse clock (see `ct::now`). Scratch, never pinned.
#[btf_map]
pub static CLOCK: PerCpuArray<ClockCache, 1> = PerCpuArray::new();

/// Flags of every Maglev table: user space fills and updates them through a memory mapping,
/// and their size is chosen at run time (`--maglev-table-size`), which the inner-map template
/// must allow.
pub const MAGLEV_INNER_FLAGS: usize = (BPF_F_INNER_MAP | BPF_F_MMAPABLE) as usize;

/// The template of the inner maps: an array of backend ids.
pub type MaglevTable = Array<u32, { limits::MAGLEV_TABLE_SIZE as usize }, MAGLEV_INNER_FLAGS>;

/// Maglev table id (a service's master entry, `backend_id`) -> its table.
#[btf_map]
pub static LB4_MAGLEV_V1: HashOfMaps<u32, MaglevTable, LB_MAX, NO_PREALLOC> = HashOfMaps::new();

/// The IPv6 frontends' Maglev tables (their own ids).
#[btf_map]
pub static LB6_MAGLEV_V1: HashOfMaps<u32, MaglevTable, LB_MAX, NO_PREALLOC> = HashOfMaps::new();

/// ClientIP session affinity. An LRU: a client that went away is forgotten first.
#[btf_map]
pub static LB4_AFFINITY_V1: LruHashMap<AffinityKey, AffinityValue, { limits::AFFINITY_MAP_MAX as usize }> = LruHashMap::new();

/// The (service, backend) pairs affinity may lead to: an affinity entry naming a backend that
/// left the service is ignored.
#[btf_map]
pub static LB4_AFFMATCH_V1: HashMap<AffinityMatchKey, u32, LB_MAX, NO_PREALLOC> = HashMap::new();

/// loadBalancerSourceRanges (see `proxy_common::map_names::SOURCE_RANGES`). An LPM trie is
/// never preallocated.
#[btf_map]
pub static LB4_SRCRANGE_V1: LpmTrie<SourceRangeKey, u8, LB_MAX> = LpmTrie::new();

/// Service CIDRs and the cluster IPs allocated in them (see `select::service_cidr_of`); sized
/// like the load-balancer maps.
#[btf_map]
pub static LB4_SVCCIDR_V1: LpmTrie<SvcCidrKey, u8, LB_MAX> = LpmTrie::new();

/// Host-network sockets sent to a backend (see `sock`).
#[btf_map]
pub static SOCK_REVNAT_V1: LruHashMap<SockRevKey, RevNat, { limits::SOCK_REVNAT_MAX as usize }> = LruHashMap::new();

/// Unconnected host-network UDP sockets: their backend per Service (see `sock`).
#[btf_map]
pub static SOCK_FWD_V1: LruHashMap<SockRevKey, SockFwd, { limits::SOCK_REVNAT_MAX as usize }> = LruHashMap::new();

/// Connected host-network sockets on a local port of their own: who holds which backend
/// tuple (see `sock`). Entries go when their socket is closed.
#[btf_map]
pub static SOCK_PORTS_V1: LruHashMap<SockPortKey, SockOwner, { limits::SOCK_REVNAT_MAX as usize }> = LruHashMap::new();

/// A socket's cookie -> the tuple it holds in `SOCK_PORTS_V1` (a socket closing cannot read
/// its own ports).
#[btf_map]
pub static SOCK_HELD_V1: LruHashMap<u64, SockPortKey, { limits::SOCK_REVNAT_MAX as usize }> = LruHashMap::new();

/// The same four for IPv6 Services (an IPv6 socket's IPv4-mapped peers use the IPv4 ones).
#[btf_map]
pub static SOCK6_REVNAT_V1: LruHashMap<SockRevKey<Ip6>, RevNat<Ip6>, { limits::SOCK_REVNAT_MAX as usize }> = LruHashMap::new();
#[btf_map]
pub static SOCK6_FWD_V1: LruHashMap<SockRevKey<Ip6>, SockFwd<Ip6>, { limits::SOCK_REVNAT_MAX as usize }> = LruHashMap::new();
#[btf_map]
pub static SOCK6_PORTS_V1: LruHashMap<SockPortKey<Ip6>, SockOwner, { limits::SOCK_REVNAT_MAX as usize }> = LruHashMap::new();
#[btf_map]
pub static SOCK6_HELD_V1: LruHashMap<u64, SockPortKey<Ip6>, { limits::SOCK_REVNAT_MAX as usize }> = LruHashMap::new();

/// The cookie of the network namespace the socket hooks serve (0: none).
#[btf_map]
pub static HOST_NETNS_V1: Array<u64, 1> = Array::new();

/// External interface index -> the address SNAT puts on flows leaving by it.
#[btf_map]
pub static NODE_IFADDR_V1: HashMap<u32, IfAddr, { limits::IFADDR_MAP_MAX as usize }> = HashMap::new();

/// External interface index -> the IPv6 address SNAT puts on IPv6 flows leaving by it.
#[btf_map]
pub static NODE_IFADDR6_V1: HashMap<u32, IfAddr<Ip6>, { limits::IFADDR_MAP_MAX as usize }> = HashMap::new();

/// Interface index -> what native XDP may send out of it (`xdp_dev` flags; absent: nothing).
#[btf_map]
pub static XDP_DEVS_V1: HashMap<u32, u32, { limits::XDP_DEVS_MAX as usize }> = HashMap::new();

#[btf_map]
pub static CONFIG_V3: Array<Config, 1> = Array::new();

/// Until when each family's takeover may still adopt connections to served frontends
/// (`proxy_common::ct::ADOPTING_V4`).
#[btf_map]
pub static ADOPTING_V1: Array<u64, 2> = Array::new();

/// The frontend filter of each family (`proxy_common::filter`).
#[btf_map]
pub static LB4_FILTER_V1: Array<u64, { proxy_common::filter::WORDS as usize }> = Array::new();

#[btf_map]
pub static LB6_FILTER_V1: Array<u64, { proxy_common::filter::WORDS as usize }> = Array::new();

/// The conntrack filter of each family (`proxy_common::ct_filter`).
#[btf_map]
pub static CT4_FILTER_V1: crate::family::CtFilterMap = Array::new();

#[btf_map]
pub static CT6_FILTER_V1: crate::family::CtFilterMap = Array::new();

#[btf_map]
pub static TRACE_V2: Array<TraceResult, 1> = Array::new();

// The IPv6 family's maps (see `family`): the same roles as the IPv4 ones above.

#[btf_map]
pub static LB6_SERVICES_V1: HashMap<ServiceKey<Ip6>, ServiceValue, LB_MAX, NO_PREALLOC> = HashMap::new();

#[btf_map]
pub static LB6_BACKENDS_V1: Array<Backend<Ip6>, LB_MAX> = Array::new();

#[btf_map]
pub static LB6_REVNAT_V1: HashMap<u32, RevNat<Ip6>, LB_MAX, NO_PREALLOC> = HashMap::new();

#[btf_map]
pub static LB6_FLOWS_V1: Array<BackendFlows, LB_MAX> = Array::new();

#[btf_map]
pub static CT6_V1: LruHashMap<CtKey<Ip6>, CtEntry<Ip6>, { limits::CT_MAP_MAX as usize }> = LruHashMap::new();

#[btf_map]
pub static FRAG6_V1: LruHashMap<Frag6Key, FragPorts, { limits::FRAG_MAP_MAX as usize }> = LruHashMap::new();

#[btf_map]
pub static LB6_AFFINITY_V1: LruHashMap<AffinityKey<Ip6>, AffinityValue, { limits::AFFINITY_MAP_MAX as usize }> = LruHashMap::new();

#[btf_map]
pub static LB6_AFFMATCH_V1: HashMap<AffinityMatchKey, u32, LB_MAX, NO_PREALLOC> = HashMap::new();

#[btf_map]
pub static LB6_SRCRANGE_V1: LpmTrie<SourceRangeKey<Ip6>, u8, LB_MAX> = LpmTrie::new();

#[btf_map]
pub static LB6_SVCCIDR_V1: LpmTrie<SvcCidrKey<Ip6>, u8, LB_MAX> = LpmTrie::new();

#[btf_map]
pub static LB6_NAMES_V1: HashMap<u32, ServiceName, LB_MAX, NO_PREALLOC> = HashMap::new();

/// Where new IPv6 conntrack entries are built. Scratch, never pinned.
#[btf_map]
pub static CT6_SCRATCH: PerCpuArray<CtEntry<Ip6>, 1> = PerCpuArray::new();

/// The IPv6 programs the IPv4 ones tail-call (`proxy_common::prog_slots`; the agent fills it).
#[btf_map]
pub static PROGS_V1: ProgramArray<{ proxy_common::prog_slots::COUNT as usize }> = ProgramArray::new();

/// The IPv6 XDP program, which the IPv4 one tail-calls (slot 0).
#[btf_map]
pub static PROGS_XDP_V1: ProgramArray<{ proxy_common::prog_slots::XDP_COUNT as usize }> = ProgramArray::new();

/// An IPv6 packet between two of its programs (see `family::Family::new_flow_apart`). Scratch,
/// never pinned.
#[btf_map]
pub static STAGE6: PerCpuArray<crate::family::Stage<Ip6>, 1> = PerCpuArray::new();
