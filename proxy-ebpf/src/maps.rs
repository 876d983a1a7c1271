//! The maps, declared with BTF so `bpftool map dump` prints field names. Names match
//! `proxy_common::map_names`; sizes are defaults the agent may override at creation.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray},
    macros::btf_map,
};
use proxy_common::{
    limits, Backend, ClockCache, BackendFlows, Counter, CtEntry, CtKey, FragKey, FragPorts, RevNat,
    ServiceKey, ServiceName, ServiceValue, REASON_SLOTS,
};

const LB_MAX: usize = limits::LB_MAP_MAX as usize;
// Load-balancer maps are written only by the agent; without preallocation their memory follows
// the number of services instead of the configured maximum.
const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

#[btf_map]
pub static LB4_SERVICES_V1: HashMap<ServiceKey, ServiceValue, LB_MAX, NO_PREALLOC> =
    HashMap::new();

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
pub static CT4_V1: LruHashMap<CtKey, CtEntry, { limits::CT_MAP_MAX as usize }> = LruHashMap::new();

#[btf_map]
pub static FRAG4_V1: LruHashMap<FragKey, FragPorts, { limits::FRAG_MAP_MAX as usize }> =
    LruHashMap::new();

#[btf_map]
pub static STATS_V1: PerCpuArray<Counter, { REASON_SLOTS as usize }> = PerCpuArray::new();

/// Names for people; no program reads it, it is declared here so it is created and pinned with
/// the others.
#[btf_map]
pub static LB4_NAMES_V1: HashMap<u32, ServiceName, LB_MAX, NO_PREALLOC> = HashMap::new();

/// Per-CPU cache of the coarse clock (see `ct::now`). Scratch, never pinned.
#[btf_map]
pub static CLOCK: PerCpuArray<ClockCache, 1> = PerCpuArray::new();
