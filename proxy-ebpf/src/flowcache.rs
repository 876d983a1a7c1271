//! XDP's per-CPU cache of tracked north-south flows: what the conntrack path decided for a
//! tuple (its rewrite and its route), kept for the window in which that path would decide the
//! same again and write nothing, so that a packet in that window is sent on without the
//! conntrack lookup (the kernel's hash of the key and its walk: about half of what XDP spent
//! on a tracked packet).
//!
//! A slot holds one flow, at the place its tuple's hash gives (direct-mapped); a flow that
//! meets another in its slot is looked up in the conntrack map as before, and takes the slot
//! once the other's window has ended (`fill`).
//! A slot serves a packet only:
//! - of the same tuple, arriving on the same interface;
//! - before `until`: the first of the moments at which the conntrack path would write the
//!   entry (its refresh, due `REFRESH_NS` after the packet that last refreshed it), find it
//!   expired, or take another route (the route's epoch ends; see `north::route_of`);
//! - under the generation the slot was filled under (`FLOW_GEN_V1`, `ct::FlowGen`): the agent
//!   moves it on after it deleted a backend, wrote or deleted a reverse NAT entry, or changed
//!   what a device takes from XDP (the entries a tracked flow's step reads besides its own,
//!   with the FIB, whose answer the entry keeps for the epoch anyway); the datapath moves it on
//!   when TC tracks afresh the tuple of a flow that had not expired (a SYN reusing a closing
//!   connection's ports, a flow whose backend went), whose old step any CPU's slot may hold;
//! - that is not a TCP segment with SYN, FIN or RST, which change or end a flow's state (those
//!   take the conntrack path, and do not fill a slot).
//!
//! A CPU whose lookups meet other flows' live slots more often than they hit rests its cache
//! for a while (`Tally`): with more flows than slots taking turns, a lookup is a cost with
//! nothing to show for it.
//!
//! So a packet the cache sends on is one the conntrack path would have sent the same way,
//! leaving the entry as it was. What the cache cannot see: another CPU's packet changing the
//! entry's flags (a FIN: the flow then lives on for at least the half-closed or closing
//! lifetime, longer than a window unless those are set under a second); an entry the LRU
//! evicts while its flow is sending (at most one window); and, on a kernel whose softirqs can
//! be preempted (PREEMPT_RT), another XDP run on the same CPU writing a slot being read.
//! (Weakly ordered CPUs may read the generation after the entries it guards: a slot filled
//! then lasts one window at most.)

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    btf_maps::{Array, PerCpuArray},
    macros::btf_map,
};
use proxy_common::{
    ct::{self, FlowGen},
    CtKey, Ip6, Reason, IPPROTO_TCP,
};

use crate::{
    family::Family,
    north::Route,
    parse::{Packet, TCP_FIN, TCP_RST, TCP_SYN},
};

/// Slots per CPU and family (IPv4's are 64 bytes, IPv6's 112: 64 KiB and 112 KiB a CPU).
pub const SLOTS: u32 = 1024;

/// One cached flow. `until == 0`: empty.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Flow<A> {
    key: CtKey<A>,
    dst: A,
    src: A,
    dport: [u8; 2],
    sport: [u8; 2],
    ingress: u32,
    egress: u32,
    dmac: [u8; 6],
    smac: [u8; 6],
    generation: u32,
    /// A reply's slot (`Reason::XdpReply`), else a forward packet's (`Reason::XdpForward`).
    reply: u32,
    until: u64,
}

pub type FlowMap<A> = PerCpuArray<Flow<A>, { SLOTS as usize }>;

#[btf_map]
pub static FLOWS4: FlowMap<[u8; 4]> = PerCpuArray::new();

#[btf_map]
pub static FLOWS6: FlowMap<Ip6> = PerCpuArray::new();

/// The generation (see the module comment). Pinned: programs of an earlier load that are
/// still attached read the one the agent moves on.
#[btf_map]
pub static FLOW_GEN_V1: Array<FlowGen, 1, { aya_ebpf::bindings::BPF_F_MMAPABLE as usize }> = Array::new();

/// This CPU's count of how the cache fares. A round of `ROUND` lookups that met another flow's
/// live slot more often than they hit (more flows than slots taking turns, each flow's packets
/// far apart) rests the cache for the next `REST` tracked packets: a lookup that misses costs
/// a cache line the conntrack path then reads besides its own (with 16,384 flows taking turns,
/// about 15 ns a packet here), which the flows that hit must pay back. A lookup that finds an
/// empty or ended slot counts neither way: the cache warming up (at its start, at the end of
/// a route epoch, after the generation moved, after a rest) is not thrashing, nor is a flow
/// whose step is never cached (XDP hands it to TC).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Tally {
    probes: u32,
    hits: u32,
    /// Lookups that met another flow's live slot.
    taken: u32,
    rest: u32,
}

const ROUND: u32 = 256;
const REST: u32 = 8192;

#[btf_map]
pub static FLOW_TALLY: PerCpuArray<Tally, 1> = PerCpuArray::new();

/// What a slot sends a packet on with.
pub struct Hit<A> {
    pub dst: (A, [u8; 2]),
    pub src: (A, [u8; 2]),
    pub route: Route<A>,
    pub reason: Reason,
}

/// The current generation.
#[inline(always)]
fn generation() -> u32 {
    FLOW_GEN_V1.get(0).map_or(0, |g| g.generation())
}

/// Moves the datapath's count of the generation on: every CPU's cached steps go. For TC
/// tracking afresh the tuple of a flow that had not expired, whose old step a slot may hold
/// (on any CPU: a veth uplink runs XDP on the sender's).
#[inline(always)]
pub fn retracked() {
    let Some(g) = FLOW_GEN_V1.get_ptr_mut(0) else { return };
    // SAFETY: a field of the map's live value, changed by one atomic instruction (the agent
    // changes only the other field).
    unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(&raw mut (*g).datapath, 1) };
}

/// Whether the cache may serve (or learn from) `pkt`: not a TCP segment that changes its
/// flow's state.
#[inline(always)]
pub fn takes<A: Family>(pkt: &Packet<A>) -> bool {
    pkt.proto != IPPROTO_TCP || pkt.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
}

#[inline(always)]
fn slot<A: Family>(key: &CtKey<A>) -> Option<&'static mut Flow<A>> {
    // The top bits of the conntrack filter's hash place the key in the filter; the next ones
    // place it here.
    let index = (proxy_common::ct_filter::hash(key) >> 32) as u32 & (SLOTS - 1);
    // SAFETY: per-CPU, and only XDP uses the slots; XDP runs in a softirq, which another does
    // not interrupt on the same CPU (see the module comment for PREEMPT_RT).
    unsafe { crate::value::per_cpu(A::flow_cache(), index) }
}

/// What the cache has for a tracked flow's packet.
pub enum Lookup<A> {
    /// The flow's step.
    Hit(Hit<A>),
    /// Nothing: the packet's step is to be cached once decided (`fill`), under `generation`
    /// (read before the decision's lookups).
    Miss { generation: u32 },
    /// Not looked in (`Tally`): neither served nor cached.
    Resting,
}

/// The cached step for `key`, arriving on `ingress`, at `now`, if its slot holds one and this
/// CPU's cache is not resting.
#[inline(always)]
pub fn lookup<A: Family>(key: &CtKey<A>, ingress: u32, now: u64) -> Lookup<A> {
    // SAFETY: per-CPU, taken once here (as `slot`).
    let Some(t) = (unsafe { crate::value::per_cpu(&FLOW_TALLY, 0) }) else { return Lookup::Resting };
    if t.rest > 0 {
        t.rest -= 1;
        return Lookup::Resting;
    }
    let Some(f) = slot(key) else { return Lookup::Resting };
    let generation = generation();
    let live = now < f.until && f.generation == generation;
    let hit = live && f.ingress == ingress && f.key == *key;
    t.probes += 1;
    t.hits += u32::from(hit);
    t.taken += u32::from(live && !hit);
    if t.probes == ROUND {
        if t.taken > t.hits {
            t.rest = REST;
        }
        (t.probes, t.hits, t.taken) = (0, 0, 0);
    }
    if !hit {
        return Lookup::Miss { generation };
    }
    Lookup::Hit(Hit {
        dst: (f.dst, f.dport),
        src: (f.src, f.sport),
        route: Route { ifindex: f.egress, smac: f.smac, dmac: f.dmac, no_neigh: false, nexthop: f.dst },
        reason: if f.reply != 0 { Reason::XdpReply } else { Reason::XdpForward },
    })
}

/// The end of the window, from `now`, in which the conntrack path leaves an entry last
/// refreshed at `last_seen` as it is (its refresh is not due, and it has not outlived
/// `lifetime`) and keeps its cached route (the route's epoch, `ct::route_epoch`, is the same).
#[inline(always)]
pub fn window_end(last_seen: u64, lifetime: u64, now: u64) -> u64 {
    let quiet = last_seen.saturating_add(if lifetime < ct::REFRESH_NS { lifetime } else { ct::REFRESH_NS });
    let epoch_end = ct::route_epoch_end(now);
    if quiet < epoch_end {
        quiet
    } else {
        epoch_end
    }
}

/// Records what the conntrack path decided at `now` for `key` (arriving on `ingress`), valid
/// until `until` under generation `generation`; unless the slot serves another flow still:
/// with more flows than slots, the slots keep the flows that took them until their windows
/// end, where taking turns would have every flow miss. (A flow of one packet each way, a DNS
/// query's, holds the slot it took until its window ends too.)
#[inline(always)]
pub fn fill<A: Family>(
    key: &CtKey<A>,
    ingress: u32,
    generation: u32,
    now: u64,
    until: u64,
    dst: (A, [u8; 2]),
    src: (A, [u8; 2]),
    route: &Route<A>,
    reason: Reason,
) {
    let Some(f) = slot(key) else { return };
    if now < f.until && f.generation == generation && f.key != *key {
        return;
    }
    *f = Flow {
        key: *key,
        dst: dst.0,
        src: src.0,
        dport: dst.1,
        sport: src.1,
        ingress,
        egress: route.ifindex,
        dmac: route.dmac,
        smac: route.smac,
        generation,
        reply: u32::from(reason == Reason::XdpReply),
        until,
    };
}
