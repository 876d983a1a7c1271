//! The address-family seam. What differs between IPv4 and IPv6 (the address, the family's
//! maps, its network header and checksum arithmetic, its ICMP) is reached through `Family`,
//! which the address type itself implements, so conntrack, backend selection and the NAT
//! logic are written once and compiled once per family: the IPv4 code is what it was, with
//! nothing decided at run time (Cilium keeps lb4/lb6 siblings, Katran passes `is_ipv6`).
//! Functions take `Packet<A>` and let the compiler infer the family from it.
//!
//! Each family has its own maps, keyed by its own address size: IPv4 keys stay 4-byte
//! addresses (an IPv4-mapped 16-byte key would make every IPv4 lookup hash 24 more bytes).

use aya_ebpf::{
    bindings::{bpf_fib_lookup as FibParams, bpf_redir_neigh, BPF_F_NO_PREALLOC},
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::TcContext,
};
use proxy_common::{
    limits, svc_cidr, AffinityKey, AffinityMatchKey, AffinityValue, Backend, BackendFlows, CtEntry, CtKey, Frag6Key, FragKey, FragPorts,
    Ip6, Reason, RevNat, ServiceKey, ServiceValue,
};

use crate::{icmp, maps, parse::Packet, value, verdict::Verdict};

const LB_MAX: usize = limits::LB_MAP_MAX as usize;
const NO_PREALLOC: usize = BPF_F_NO_PREALLOC as usize;

pub type CtMap<A> = LruHashMap<CtKey<A>, CtEntry<A>, { limits::CT_MAP_MAX as usize }>;
pub type ServicesMap<A> = HashMap<ServiceKey<A>, ServiceValue, LB_MAX, NO_PREALLOC>;
pub type BackendsMap<A> = Array<Backend<A>, LB_MAX>;
pub type RevNatMap<A> = HashMap<u32, RevNat<A>, LB_MAX, NO_PREALLOC>;
pub type AffinityMap<A> = LruHashMap<AffinityKey<A>, AffinityValue, { limits::AFFINITY_MAP_MAX as usize }>;
pub type FilterMap = Array<u64, { proxy_common::filter::WORDS as usize }>;
/// The conntrack filter (`proxy_common::ct_filter`): one value, mmapable so that the agent
/// rebuilds a half in place.
pub type CtFilterMap = Array<proxy_common::ct_filter::CtFilter, 1, { aya_ebpf::bindings::BPF_F_MMAPABLE as usize }>;

/// True when `filter` has the bit of frontend (`addr`, `port`, `proto`) (see `Family::in_filter`).
#[inline(always)]
fn in_filter<A: proxy_common::filter::Addr>(filter: &FilterMap, addr: A, port: [u8; 2], proto: u8) -> bool {
    let (word, bit) = proxy_common::filter::place(addr, port, proto);
    filter.get(word).is_some_and(|w| *w & bit != 0)
}

/// An address family, implemented by its address type (network order bytes).
pub trait Family:
    Copy + PartialEq + Sized + proxy_common::csum::Words + proxy_common::filter::Addr + proxy_common::ct_filter::Addr + 'static
{
    /// The fragment identification a datagram's fragments share (IPv4: 16 bits, IPv6: 32).
    type FragId: Copy + Default;
    /// The family's flow does not fit one BPF stack frame (512 bytes): a new flow's stage runs
    /// as a program of its own (`new_flow_apart`). IPv4's stays inline.
    const STAGES_APART: bool;
    /// Enters the family's new-flow program with this packet (a tail call, which does not
    /// return); returns the reason to pass it untouched under when that cannot be done.
    /// `master`: the frontend's master entry, which the caller looked up already (`None`: no
    /// such frontend).
    fn new_flow_apart(ctx: &TcContext, pkt: &Packet<Self>, now: u64, reason: Reason, master: Option<&ServiceValue>) -> Reason;
    /// The unset address (an unset backend entry holds it).
    const UNSPECIFIED: Self;
    /// Where replies of a hairpinned flow (a pod reaching itself through a Service) are sent.
    const HAIRPIN: Self;

    /// The conntrack map. Insert into it only after `ct::mark` has set the key's bit in the
    /// conntrack filter (`ct_filter`): a key without its bit is not found by `ct::lookup`.
    fn ct() -> &'static CtMap<Self>;
    fn ct_filter() -> &'static CtFilterMap;
    /// XDP's cache of tracked flows (`flowcache`).
    fn flow_cache() -> &'static crate::flowcache::FlowMap<Self>;
    /// TC's cache of tracked pod flows (`flowcache`).
    fn tc_cache() -> &'static crate::flowcache::TrackedMap<Self>;
    fn services() -> &'static ServicesMap<Self>;
    /// True when the family's frontend filter (`proxy_common::filter`) has the bit of frontend
    /// (`addr`, `port`, `proto`): it may be one.
    fn in_filter(addr: Self, port: [u8; 2], proto: u8) -> bool;
    fn backends() -> &'static BackendsMap<Self>;
    fn revnat() -> &'static RevNatMap<Self>;
    fn affinity() -> &'static AffinityMap<Self>;
    /// Flows sent to each backend (indexed by backend id).
    fn flows() -> &'static Array<BackendFlows, LB_MAX>;
    /// The (service, backend) pairs affinity may lead to.
    fn affinity_matches() -> &'static HashMap<AffinityMatchKey, u32, LB_MAX, NO_PREALLOC>;
    /// Where new conntrack entries are built (see `ct::scratch`).
    fn ct_scratch() -> &'static PerCpuArray<CtEntry<Self>, 1>;
    /// True when one of service `service_id`'s loadBalancerSourceRanges holds `addr`.
    fn in_source_ranges(service_id: u32, addr: Self) -> bool;
    /// What the Service CIDR map says of `addr` (`svc_cidr`; `NONE`: in no Service CIDR).
    fn service_cidr_of(addr: Self) -> u8;
    /// The entry of Maglev table `table_id` (of `size` entries) this flow's hash picks (0:
    /// none).
    fn maglev_pick(pkt: &Packet<Self>, table_id: u32, size: u32) -> Option<u32>;

    /// The key of the family's fragment map, and the map (see `frag`).
    type FragKey: 'static;
    fn frag_key(pkt: &Packet<Self>) -> Self::FragKey;
    fn frags() -> &'static LruHashMap<Self::FragKey, FragPorts, { limits::FRAG_MAP_MAX as usize }>;

    /// Writes `new` over the address `old` at `addr_off` of the network header, with whatever
    /// the header's own checksum needs.
    fn store_address(ctx: &TcContext, addr_off: usize, old: Self, new: Self) -> Result<(), Reason>;
    /// A packet offset the program read from memory it does not own the bounds of (a map): held
    /// to the range headers can take, so the verifier accepts it for packet access. IPv4's come
    /// from the parser alone and are left as they are.
    fn bound_offset(off: usize) -> usize;
    /// The address sits under a header checksum (IPv4's): changing it leaves the sum of the
    /// network header as it was, so a CHECKSUM_COMPLETE skb's `skb->csum` moves only by the L4
    /// checksum field's change, which the kernel's helper applies (`nat`'s module comment).
    /// IPv6 has no header checksum: there the address change and the field change cancel in
    /// `skb->csum`, which must stay as it was.
    const HEADER_CSUM: bool;
    /// Offsets of the source and destination address in the network header.
    const SRC_OFF: usize;
    const DST_OFF: usize;
    /// Offset of the TTL (hop limit) in the network header, and the family's ICMP protocol.
    const HOPS_OFF: usize;
    const ICMP_PROTO: u8;
    /// The L4 checksum's update for an address of the pseudo-header, through the kernel's
    /// helper (which also keeps a CHECKSUM_COMPLETE skb's `skb->csum` right).
    fn l4_address_helper(ctx: &TcContext, csum_off: usize, mangled: u64, old: Self, new: Self) -> Result<(), Reason>;
    /// A partial-form L4 checksum field (the pseudo-header sum) after an address change.
    fn partial_update(field: [u8; 2], old: Self, new: Self) -> [u8; 2];
    /// A complete L4 checksum field after an address and a port change.
    fn complete_update(field: [u8; 2], old_addr: Self, new_addr: Self, old_port: [u8; 2], new_port: [u8; 2], udp: bool) -> [u8; 2];
    /// The pseudo-header sum of a packet from `saddr` to `daddr` with `l4_len` bytes of L4.
    fn pseudo_header(saddr: Self, daddr: Self, proto: u8, l4_len: u16) -> [u8; 2];

    /// The quote of the ICMP (ICMPv6) message at `l4_off`, if it is an error quoting a TCP or
    /// UDP packet with its ports (`icmp_nat`).
    fn read_quote(ctx: &TcContext, l4_off: usize) -> Option<crate::icmp_nat::Quote<Self>>;
    /// `icmp_nat::send_on` for a translated error from `src` to `dst`: inline (IPv4), or in a
    /// program of its own (IPv6: the translation and the route do not fit one stack frame).
    fn send_translated(ctx: &TcContext, src: Self, dst: Self) -> Result<Verdict, Reason>;
    /// Answers the packet with the family's port unreachable, back where it came from.
    fn reject(ctx: &TcContext, pkt: &Packet<Self>, reason: Reason) -> Result<Verdict, Reason>;
    /// The same for a packet about to leave (TC egress): the answer is received on the
    /// interface instead, as from the destination.
    fn reject_leaving(ctx: &TcContext, pkt: &Packet<Self>, reason: Reason) -> Result<Verdict, Reason>;
    /// The slot of `map_names::PROGS` a host flow's packet leaving is handed on to (`host`):
    /// IPv4's is `prog_slots::EGRESS6`, the egress program's one tail call (a second call site
    /// there made every IPv6 reply slower); IPv6's `prog_slots::HOST6`.
    const HOST_SLOT: u32;
    /// The family's slot of `maps::ADOPTING_V1`.
    const ADOPTING_SLOT: u32;

    /// The address SNAT puts on the family's flows leaving by external interface `ifindex`.
    fn node_address(ifindex: u32) -> Option<Self>;
    /// A FIB lookup's family and addresses.
    fn set_fib_addresses(p: &mut FibParams, src: Self, dst: Self);
    /// The next hop a successful FIB lookup left in its parameters.
    fn fib_nexthop(p: &FibParams) -> Self;
    /// The next hop as `bpf_redirect_neigh` takes it.
    fn redirect_neigh_params(nexthop: Self) -> bpf_redir_neigh;
    /// One hop less (IPv4's TTL with its header checksum, IPv6's hop limit), as the stack would
    /// take it from a packet it routes.
    fn decrement_hops(ctx: &TcContext) -> Result<(), Reason>;
    /// Records a trace packet's SNAT source.
    fn trace_snat(r: &mut proxy_common::TraceResult, addr: Self);
}

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

impl Family for [u8; 4] {
    type FragId = [u8; 2];
    const STAGES_APART: bool = false;
    const HOST_SLOT: u32 = proxy_common::prog_slots::EGRESS6;
    const ADOPTING_SLOT: u32 = proxy_common::ct::ADOPTING_V4;
    #[inline(always)]
    fn bound_offset(off: usize) -> usize {
        off
    }
    #[inline(always)]
    fn new_flow_apart(_ctx: &TcContext, _pkt: &Packet<Self>, _now: u64, _reason: Reason, _master: Option<&ServiceValue>) -> Reason {
        Reason::PassNoStage
    }
    const UNSPECIFIED: Self = [0; 4];
    const HAIRPIN: Self = proxy_common::ct::HAIRPIN_ADDR;
    const HEADER_CSUM: bool = true;
    const SRC_OFF: usize = 12;
    const DST_OFF: usize = 16;
    const HOPS_OFF: usize = 8;
    const ICMP_PROTO: u8 = proxy_common::IPPROTO_ICMP;

    #[inline(always)]
    fn ct() -> &'static CtMap<Self> {
        &maps::CT4_V2
    }
    #[inline(always)]
    fn ct_filter() -> &'static CtFilterMap {
        &maps::CT4_FILTER_V1
    }
    #[inline(always)]
    fn flow_cache() -> &'static crate::flowcache::FlowMap<Self> {
        &crate::flowcache::FLOWS4
    }
    #[inline(always)]
    fn tc_cache() -> &'static crate::flowcache::TrackedMap<Self> {
        &crate::flowcache::TRACKED4
    }
    #[inline(always)]
    fn services() -> &'static ServicesMap<Self> {
        &maps::LB4_SERVICES_V1
    }
    #[inline(always)]
    fn in_filter(addr: Self, port: [u8; 2], proto: u8) -> bool {
        in_filter(&maps::LB4_FILTER_V1, addr, port, proto)
    }
    #[inline(always)]
    fn backends() -> &'static BackendsMap<Self> {
        &maps::LB4_BACKENDS_V1
    }
    #[inline(always)]
    fn revnat() -> &'static RevNatMap<Self> {
        &maps::LB4_REVNAT_V1
    }
    #[inline(always)]
    fn affinity() -> &'static AffinityMap<Self> {
        &maps::LB4_AFFINITY_V1
    }
    #[inline(always)]
    fn flows() -> &'static Array<BackendFlows, LB_MAX> {
        &maps::LB4_FLOWS_V1
    }
    #[inline(always)]
    fn affinity_matches() -> &'static HashMap<AffinityMatchKey, u32, LB_MAX, NO_PREALLOC> {
        &maps::LB4_AFFMATCH_V1
    }
    #[inline(always)]
    fn ct_scratch() -> &'static PerCpuArray<CtEntry<Self>, 1> {
        &maps::CT_SCRATCH
    }
    #[inline(always)]
    fn in_source_ranges(service_id: u32, addr: Self) -> bool {
        use aya_ebpf::btf_maps::lpm_trie::Key;
        let key = Key::new(proxy_common::SourceRangeKey::ID_BITS + 32, proxy_common::SourceRangeKey { service_id, addr });
        maps::LB4_SRCRANGE_V1.get(&key).is_some()
    }
    /// Checked in two ALU operations against the ranges' common prefix first.
    #[inline(always)]
    fn service_cidr_of(addr: Self) -> u8 {
        use aya_ebpf::btf_maps::lpm_trie::Key;
        let Some(cfg) = maps::CONFIG_V3.get(0) else { return svc_cidr::NONE };
        if cfg.svc_cidrs == 0 || u32::from_ne_bytes(addr) & u32::from_ne_bytes(cfg.svc_mask) != u32::from_ne_bytes(cfg.svc_net) {
            return svc_cidr::NONE;
        }
        maps::LB4_SVCCIDR_V1.get(&Key::new(32, proxy_common::SvcCidrKey { addr })).copied().unwrap_or(svc_cidr::NONE)
    }
    #[inline(always)]
    fn maglev_pick(pkt: &Packet<Self>, table_id: u32, size: u32) -> Option<u32> {
        let index = proxy_common::hash::flow(pkt.saddr, pkt.daddr, pkt.sport, pkt.dport, pkt.proto) % size;
        // The agent only ever stores whole u32s into it.
        value::copy_inner(&maps::LB4_MAGLEV_V1, &table_id, index)
    }

    type FragKey = FragKey;
    #[inline(always)]
    fn frag_key(pkt: &Packet<Self>) -> FragKey {
        FragKey { saddr: pkt.saddr, daddr: pkt.daddr, id: pkt.ip_id, proto: pkt.proto, _pad: 0 }
    }
    #[inline(always)]
    fn frags() -> &'static LruHashMap<FragKey, FragPorts, { limits::FRAG_MAP_MAX as usize }> {
        &maps::FRAG4_V1
    }

    #[inline(always)]
    fn store_address(ctx: &TcContext, addr_off: usize, old: Self, new: Self) -> Result<(), Reason> {
        crate::nat::rewrite_ipv4(ctx, addr_off, old, new)
    }
    #[inline(always)]
    fn l4_address_helper(ctx: &TcContext, csum_off: usize, mangled: u64, old: Self, new: Self) -> Result<(), Reason> {
        let old = u64::from(u32::from_ne_bytes(old));
        let new = u64::from(u32::from_ne_bytes(new));
        let flags = u64::from(aya_ebpf::bindings::BPF_F_PSEUDO_HDR) | mangled | 4;
        ctx.l4_csum_replace(csum_off, old, new, flags).map_err(|_| Reason::DropRewrite)
    }
    #[inline(always)]
    fn partial_update(field: [u8; 2], old: Self, new: Self) -> [u8; 2] {
        proxy_common::csum::partial_update(field, old, new)
    }
    #[inline(always)]
    fn complete_update(field: [u8; 2], old_addr: Self, new_addr: Self, old_port: [u8; 2], new_port: [u8; 2], udp: bool) -> [u8; 2] {
        proxy_common::csum::l4_update(field, old_addr, new_addr, old_port, new_port, udp)
    }
    #[inline(always)]
    fn pseudo_header(saddr: Self, daddr: Self, proto: u8, l4_len: u16) -> [u8; 2] {
        proxy_common::csum::pseudo_header(saddr, daddr, proto, l4_len)
    }

    #[inline(always)]
    fn reject(ctx: &TcContext, pkt: &Packet<Self>, reason: Reason) -> Result<Verdict, Reason> {
        icmp::reject(ctx, pkt, reason)
    }
    #[inline(always)]
    fn reject_leaving(ctx: &TcContext, pkt: &Packet<Self>, reason: Reason) -> Result<Verdict, Reason> {
        icmp::reject_leaving(ctx, pkt, reason)
    }
    #[inline(always)]
    fn read_quote(ctx: &TcContext, l4_off: usize) -> Option<crate::icmp_nat::Quote<Self>> {
        icmp::read_quote(ctx, l4_off)
    }
    #[inline(always)]
    fn send_translated(ctx: &TcContext, src: Self, dst: Self) -> Result<Verdict, Reason> {
        crate::icmp_nat::send_on(ctx, src, dst)
    }

    #[inline(always)]
    fn node_address(ifindex: u32) -> Option<Self> {
        // SAFETY: the value is copied out at once.
        value::copy(&maps::NODE_IFADDR_V1, &ifindex).map(|a| a.addr)
    }
    #[inline(always)]
    fn set_fib_addresses(p: &mut FibParams, src: Self, dst: Self) {
        p.family = AF_INET;
        p.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(src);
        p.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(dst);
    }
    #[inline(always)]
    fn fib_nexthop(p: &FibParams) -> Self {
        // SAFETY: the union field an IPv4 lookup fills in.
        unsafe { p.__bindgen_anon_4.ipv4_dst }.to_ne_bytes()
    }
    #[inline(always)]
    fn redirect_neigh_params(nexthop: Self) -> bpf_redir_neigh {
        // SAFETY: plain data; all-zero is a valid value.
        let mut nh = bpf_redir_neigh { nh_family: u32::from(AF_INET), __bindgen_anon_1: unsafe { core::mem::zeroed() } };
        nh.__bindgen_anon_1.ipv4_nh = u32::from_ne_bytes(nexthop);
        nh
    }
    #[inline(always)]
    fn decrement_hops(ctx: &TcContext) -> Result<(), Reason> {
        crate::ext::decrement_ttl(ctx)
    }
    #[inline(always)]
    fn trace_snat(r: &mut proxy_common::TraceResult, addr: Self) {
        r.snat_addr = addr;
    }
}

impl Family for Ip6 {
    type FragId = [u8; 4];
    const STAGES_APART: bool = true;
    const HOST_SLOT: u32 = proxy_common::prog_slots::HOST6;
    const ADOPTING_SLOT: u32 = proxy_common::ct::ADOPTING_V6;
    /// The parser's longest (`parse6::EXT_MAX`) is below 512.
    #[inline(always)]
    fn bound_offset(off: usize) -> usize {
        off & 0x1ff
    }
    #[inline(always)]
    fn new_flow_apart(ctx: &TcContext, pkt: &Packet<Self>, now: u64, reason: Reason, master: Option<&ServiceValue>) -> Reason {
        enter_stage(ctx, pkt, now, reason, Some(master), proxy_common::prog_slots::INGRESS6_NEW)
    }
    type FragKey = Frag6Key;
    const UNSPECIFIED: Self = Ip6([0; 4]);
    const HAIRPIN: Self = proxy_common::ct::HAIRPIN_ADDR6;
    const HEADER_CSUM: bool = false;
    const SRC_OFF: usize = 8;
    const DST_OFF: usize = 24;
    const HOPS_OFF: usize = 7;
    const ICMP_PROTO: u8 = crate::parse6::IPPROTO_ICMPV6;

    #[inline(always)]
    fn ct() -> &'static CtMap<Self> {
        &maps::CT6_V1
    }
    #[inline(always)]
    fn ct_filter() -> &'static CtFilterMap {
        &maps::CT6_FILTER_V1
    }
    #[inline(always)]
    fn flow_cache() -> &'static crate::flowcache::FlowMap<Self> {
        &crate::flowcache::FLOWS6
    }
    #[inline(always)]
    fn tc_cache() -> &'static crate::flowcache::TrackedMap<Self> {
        &crate::flowcache::TRACKED6
    }
    #[inline(always)]
    fn services() -> &'static ServicesMap<Self> {
        &maps::LB6_SERVICES_V1
    }
    #[inline(always)]
    fn in_filter(addr: Self, port: [u8; 2], proto: u8) -> bool {
        in_filter(&maps::LB6_FILTER_V1, addr, port, proto)
    }
    #[inline(always)]
    fn backends() -> &'static BackendsMap<Self> {
        &maps::LB6_BACKENDS_V1
    }
    #[inline(always)]
    fn revnat() -> &'static RevNatMap<Self> {
        &maps::LB6_REVNAT_V1
    }
    #[inline(always)]
    fn affinity() -> &'static AffinityMap<Self> {
        &maps::LB6_AFFINITY_V1
    }
    #[inline(always)]
    fn flows() -> &'static Array<BackendFlows, LB_MAX> {
        &maps::LB6_FLOWS_V1
    }
    #[inline(always)]
    fn affinity_matches() -> &'static HashMap<AffinityMatchKey, u32, LB_MAX, NO_PREALLOC> {
        &maps::LB6_AFFMATCH_V1
    }
    #[inline(always)]
    fn ct_scratch() -> &'static PerCpuArray<CtEntry<Self>, 1> {
        &maps::CT6_SCRATCH
    }
    #[inline(always)]
    fn in_source_ranges(service_id: u32, addr: Self) -> bool {
        use aya_ebpf::btf_maps::lpm_trie::Key;
        let key = Key::new(proxy_common::SourceRangeKey::ID_BITS + 128, proxy_common::SourceRangeKey { service_id, addr });
        maps::LB6_SRCRANGE_V1.get(&key).is_some()
    }
    /// As IPv4's, the common prefix checked a word at a time (pod and node addresses mostly
    /// differ from it in the first two).
    #[inline(always)]
    fn service_cidr_of(addr: Self) -> u8 {
        use aya_ebpf::btf_maps::lpm_trie::Key;
        let Some(cfg) = maps::CONFIG_V3.get(0) else { return svc_cidr::NONE };
        if cfg.svc_cidrs6 == 0 || (0..4).any(|i| addr.0[i] & cfg.svc_mask6.0[i] != cfg.svc_net6.0[i]) {
            return svc_cidr::NONE;
        }
        maps::LB6_SVCCIDR_V1.get(&Key::new(128, proxy_common::SvcCidrKey { addr })).copied().unwrap_or(svc_cidr::NONE)
    }
    #[inline(always)]
    fn maglev_pick(pkt: &Packet<Self>, table_id: u32, size: u32) -> Option<u32> {
        let index = proxy_common::hash::flow6(pkt.saddr, pkt.daddr, pkt.sport, pkt.dport, pkt.proto) % size;
        // The agent only ever stores whole u32s into it.
        value::copy_inner(&maps::LB6_MAGLEV_V1, &table_id, index)
    }
    #[inline(always)]
    fn frag_key(pkt: &Packet<Self>) -> Frag6Key {
        Frag6Key { saddr: pkt.saddr, daddr: pkt.daddr, id: pkt.ip_id, proto: pkt.proto, _pad: 0, _pad2: 0 }
    }
    #[inline(always)]
    fn frags() -> &'static LruHashMap<Frag6Key, FragPorts, { limits::FRAG_MAP_MAX as usize }> {
        &maps::FRAG6_V1
    }

    /// IPv6 has no header checksum: the address is written, four words.
    #[inline(always)]
    fn store_address(ctx: &TcContext, addr_off: usize, _old: Self, new: Self) -> Result<(), Reason> {
        let ip = crate::parse::ptr_at::<[u8; 40]>(ctx, crate::parse::IP_OFF).ok_or(Reason::DropRewrite)? as usize;
        let at = ip + addr_off;
        // SAFETY: bounds checked by ptr_at (the 40-byte header holds both addresses).
        unsafe {
            crate::access::store_word(at, new.0[0]);
            crate::access::store_word(at + 4, new.0[1]);
            crate::access::store_word(at + 8, new.0[2]);
            crate::access::store_word(at + 12, new.0[3]);
        }
        Ok(())
    }
    /// One helper call with the difference of the two addresses (the helper takes at most a
    /// 4-byte field, or a precomputed difference). With BPF_F_PSEUDO_HDR the helper also moves
    /// a CHECKSUM_COMPLETE skb's `skb->csum` by the field's change, which is IPv4's due (see
    /// `HEADER_CSUM`) but not IPv6's: `bpf_csum_update` (a no-op for other skbs) moves it back.
    /// (Linux 6.16's BPF_F_IPV6 says the same to the helper; older kernels refuse the flag.)
    /// (Summing the difference in the program instead, `csum::address_delta`, saves the
    /// `bpf_csum_diff` call but took the external IPv6 program's frame from 424 to 496 bytes.)
    #[inline(always)]
    fn l4_address_helper(ctx: &TcContext, csum_off: usize, mangled: u64, old: Self, new: Self) -> Result<(), Reason> {
        let mut old = old.0;
        let mut new = new.0;
        // SAFETY: two 16-byte stack buffers, sizes multiples of 4.
        let diff = unsafe { aya_ebpf::helpers::bpf_csum_diff(old.as_mut_ptr(), 16, new.as_mut_ptr(), 16, 0) };
        if diff < 0 {
            return Err(Reason::DropRewrite);
        }
        let flags = u64::from(aya_ebpf::bindings::BPF_F_PSEUDO_HDR) | mangled;
        ctx.l4_csum_replace(csum_off, 0, diff as u64, flags).map_err(|_| Reason::DropRewrite)?;
        // SAFETY: plain helper call on our own skb.
        unsafe { aya_ebpf::helpers::bpf_csum_update(ctx.skb.skb, diff as u32) };
        Ok(())
    }
    #[inline(always)]
    fn partial_update(field: [u8; 2], old: Self, new: Self) -> [u8; 2] {
        proxy_common::csum::partial_update(field, old, new)
    }
    #[inline(always)]
    fn complete_update(field: [u8; 2], old_addr: Self, new_addr: Self, old_port: [u8; 2], new_port: [u8; 2], udp: bool) -> [u8; 2] {
        proxy_common::csum::l4_update(field, old_addr, new_addr, old_port, new_port, udp)
    }
    #[inline(always)]
    fn pseudo_header(saddr: Self, daddr: Self, proto: u8, l4_len: u16) -> [u8; 2] {
        proxy_common::csum::pseudo_header(saddr, daddr, proto, l4_len)
    }

    #[inline(always)]
    fn reject(ctx: &TcContext, pkt: &Packet<Self>, reason: Reason) -> Result<Verdict, Reason> {
        crate::icmp6::reject(ctx, pkt, reason)
    }
    #[inline(always)]
    fn reject_leaving(ctx: &TcContext, pkt: &Packet<Self>, reason: Reason) -> Result<Verdict, Reason> {
        crate::icmp6::reject_leaving(ctx, pkt, reason)
    }
    #[inline(always)]
    fn read_quote(ctx: &TcContext, l4_off: usize) -> Option<crate::icmp_nat::Quote<Self>> {
        crate::icmp6::read_quote(ctx, l4_off)
    }
    #[inline(always)]
    fn send_translated(ctx: &TcContext, _src: Self, _dst: Self) -> Result<Verdict, Reason> {
        // SAFETY: plain helper call; on success it does not return.
        unsafe { maps::PROGS_V1.tail_call(ctx, proxy_common::prog_slots::ICMP6_SEND) };
        // Translated, but its stage could not be entered (a restart refilling the program
        // array): the stack may still route it.
        Ok(Verdict::pass(Reason::PassNoStage))
    }

    #[inline(always)]
    fn node_address(ifindex: u32) -> Option<Self> {
        // SAFETY: the value is copied out at once.
        value::copy(&maps::NODE_IFADDR6_V1, &ifindex).map(|a| a.addr)
    }
    #[inline(always)]
    fn set_fib_addresses(p: &mut FibParams, src: Self, dst: Self) {
        p.family = AF_INET6;
        p.__bindgen_anon_3.ipv6_src = src.0;
        p.__bindgen_anon_4.ipv6_dst = dst.0;
    }
    #[inline(always)]
    fn fib_nexthop(p: &FibParams) -> Self {
        // SAFETY: the union field an IPv6 lookup fills in.
        Ip6(unsafe { p.__bindgen_anon_4.ipv6_dst })
    }
    #[inline(always)]
    fn redirect_neigh_params(nexthop: Self) -> bpf_redir_neigh {
        bpf_redir_neigh {
            nh_family: u32::from(AF_INET6),
            __bindgen_anon_1: aya_ebpf::bindings::bpf_redir_neigh__bindgen_ty_1 { ipv6_nh: nexthop.0 },
        }
    }
    /// No header checksum, but a CHECKSUM_COMPLETE skb's `skb->csum` covers the header: it
    /// moves by the change (`bpf_csum_update` does nothing to other skbs).
    #[inline(always)]
    fn decrement_hops(ctx: &TcContext) -> Result<(), Reason> {
        let ip = crate::parse::ptr_at::<[u8; 8]>(ctx, crate::parse::IP_OFF).ok_or(Reason::DropRewrite)?;
        // SAFETY: bounds checked by ptr_at; the program owns the packet data.
        let ip = unsafe { &mut *ip };
        // The header's second word: payload length, next header, hop limit.
        let mut old = [u32::from_ne_bytes([ip[4], ip[5], ip[6], ip[7]])];
        ip[7] = ip[7].wrapping_sub(1);
        let mut new = [u32::from_ne_bytes([ip[4], ip[5], ip[6], ip[7]])];
        // SAFETY: two 4-byte stack buffers.
        let diff = unsafe { aya_ebpf::helpers::bpf_csum_diff(old.as_mut_ptr(), 4, new.as_mut_ptr(), 4, 0) };
        if diff >= 0 {
            // SAFETY: plain helper call on our own skb.
            unsafe { aya_ebpf::helpers::bpf_csum_update(ctx.skb.skb, diff as u32) };
        }
        Ok(())
    }
    #[inline(always)]
    fn trace_snat(r: &mut proxy_common::TraceResult, addr: Self) {
        r.snat_addr6 = addr;
    }
}

/// Hands an IPv6 packet to the program in `slot` of `PROGS_V1` through this CPU's stage (a tail
/// call, which does not return); returns the reason to pass the packet untouched under when
/// that cannot be done. The program there checks that the stage holds its packet
/// (`parse6::is_staged`). `master`: what the caller's lookup of the frontend's master entry
/// gave (`Some(None)`: no such frontend), `None` when it did not look.
#[inline(always)]
pub fn enter_stage(
    ctx: &TcContext,
    pkt: &Packet<Ip6>,
    now: u64,
    reason: Reason,
    master: Option<Option<&ServiceValue>>,
    slot: u32,
) -> Reason {
    // SAFETY: taken once, written, and dropped before the tail call; the next program runs on
    // this CPU before any other packet.
    let Some(stage) = (unsafe { value::per_cpu(&maps::STAGE6, 0) }) else { return Reason::PassNoStage };
    stage.pkt = *pkt;
    stage.now = now;
    stage.reason = reason as u32;
    match master {
        Some(Some(m)) => (stage.lookup, stage.master) = (lookup::FOUND, *m),
        Some(None) => stage.lookup = lookup::MISSED,
        None => stage.lookup = lookup::NOT_DONE,
    }
    // SAFETY: plain helper call; on success it does not return.
    unsafe { maps::PROGS_V1.tail_call(ctx, slot) };
    Reason::PassNoStage
}

/// The staged packet, if it is this frame's (see `enter_stage`).
#[inline(always)]
pub fn staged(ctx: &TcContext) -> Option<&'static Stage<Ip6>> {
    // SAFETY: written by the program that tail-called here; each staged program takes it once
    // and only reads it.
    let stage: &'static Stage<Ip6> = unsafe { value::per_cpu(&maps::STAGE6, 0) }?;
    (crate::parse6::is_staged(ctx, &stage.pkt) && (stage.reason as usize) < Reason::ALL.len()).then_some(stage)
}

impl Stage<Ip6> {
    /// The reason the staging program gave (checked by `staged` to be one).
    #[inline(always)]
    pub fn reason(&self) -> Reason {
        // SAFETY: a `Reason`'s discriminant (`repr(u32)`), checked in `staged`.
        unsafe { core::mem::transmute::<u32, Reason>(self.reason) }
    }
}

/// A packet handed from one of the family's programs to the next (`Family::new_flow_apart`).
#[repr(C)]
pub struct Stage<A: Family> {
    pub pkt: Packet<A>,
    pub now: u64,
    pub reason: u32,
    /// What the staging program's lookup of the frontend's master entry gave (`lookup`), so
    /// that the next program need not look it up again: with `lookup::FOUND`, `master`.
    pub lookup: u32,
    pub master: ServiceValue,
}

/// `Stage::lookup`.
pub mod lookup {
    /// Not looked up: an external interface's new flow, whose program decides with lookups of
    /// its own. (The pod new-flow program passes such a stage's packet: not one of its own.)
    pub const NOT_DONE: u32 = 0;
    pub const FOUND: u32 = 1;
    /// Looked up, and no such frontend.
    pub const MISSED: u32 = 2;
}
