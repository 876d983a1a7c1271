//! Per-CPU caches of tracked flows: what the conntrack path decided for a tuple, kept for the
//! window in which that path would decide the same again and write nothing, so that a packet
//! in that window is sent on without the conntrack lookup (the kernel's hash of the key and
//! its walk: about half of what XDP spent on a tracked packet, a fifth to a quarter of what
//! TC spent on an established or reply packet). Two caches, of the same kind:
//! - XDP's, of north-south flows: the step (rewrite and route) of a forward or reply packet
//!   (`XdpStep`, `lookup_xdp`, `fill_xdp`);
//! - TC's, of pod flows: the conntrack entry pod ingress translated a forward packet with, or
//!   egress a reply (with the Service address the reverse NAT map gave; `Tracked`,
//!   `lookup_tc`, `fill_tc`). The rest of their paths run as for an entry of the map, with
//!   the conntrack path's own checks that need no write (the backend still there).
//!
//! A slot holds one flow, at the place its tuple's hash gives (direct-mapped); a flow that
//! meets another in its slot is looked up in the conntrack map as before, and takes the slot
//! once the other's window has ended (`fill`).
//! A slot serves a packet only:
//! - of the same tuple (for XDP, arriving on the same interface), a whole datagram for TC;
//! - before `until`: the first of the moments at which the conntrack path would write the
//!   entry (its refresh, due `REFRESH_NS` after the packet that last refreshed it), find it
//!   expired, or (XDP) take another route (the route's epoch ends; see `north::route_of`);
//! - under the generation the slot was filled under (`FLOW_GEN_V1`, `ct::FlowGen`): the agent
//!   moves it on after it deleted a backend, wrote or deleted a reverse NAT entry, or changed
//!   what a device takes from XDP (the entries a tracked flow's step reads besides its own,
//!   with the FIB, whose answer the entry keeps for the epoch anyway); the datapath moves it on
//!   when TC tracks afresh the tuple of a flow refreshed within the last two seconds (a SYN
//!   reusing a closing connection's ports, a flow whose backend went), whose old step any
//!   CPU's slot may hold (`retracked_unless_ended`), and when a new flow writes over another
//!   flow's reply entry (a reset connection's reply tuple or SNAT port, free to take at once:
//!   `ct::create`, `create_snat`);
//! - that is not a TCP segment with SYN, FIN or RST, which change or end a flow's state (those
//!   take the conntrack path, do not fill a slot, and empty this CPU's slot of the tuple).
//!
//! A closing flow (a FIN or a RST seen) is not cached at all (`caches`): a SYN may track its
//! tuple afresh at any time, and a CPU that read the generation moved on for that, then the old
//! entry before the new one was written, would cache the old step under the new generation.
//!
//! A CPU whose lookups meet other flows' live slots more often than they hit rests its cache
//! for a while (`Tally`, one per cache): with more flows than slots taking turns, a lookup is
//! a cost with nothing to show for it.
//!
//! So a packet a cache sends on is one the conntrack path would have sent the same way,
//! leaving the entry as it was. What the caches cannot see: another CPU's packet changing the
//! entry's flags (a FIN: the flow then lives on for at least the half-closed or closing
//! lifetime, longer than a window unless those are set under a second); an entry the LRU
//! evicts while its flow is sending (at most one window); during an upgrade, an older build's
//! program tracking a flow afresh without moving the generation (at most one window); and, on
//! a kernel whose softirqs can be preempted (PREEMPT_RT), another run on the same CPU writing
//! a slot being read. (Weakly ordered CPUs may read the generation after the entries it
//! guards: a slot filled then lasts one window at most.)

use core::intrinsics::{atomic_xadd, AtomicOrdering};

use aya_ebpf::{
    btf_maps::{Array, PerCpuArray},
    macros::btf_map,
};
use proxy_common::{
    ct::{self, FlowGen},
    ct_filter, CtEntry, CtKey, Ip6, Reason, IPPROTO_TCP,
};

use crate::{
    family::Family,
    north::Route,
    parse::{Packet, TCP_FIN, TCP_RST, TCP_SYN},
    value::Slot,
};

/// Slots per CPU and family of XDP's cache (IPv4's are 64 bytes, IPv6's 112: 64 KiB and
/// 112 KiB a CPU).
pub const SLOTS: u32 = 1024;
/// Slots per CPU and family of TC's cache (`Tracked`: IPv4's are 96 bytes, IPv6's 160: 48 KiB
/// and 80 KiB a CPU).
pub const TC_SLOTS: u32 = 512;

/// One cached flow: `step` is what its packets are sent on with. `until == 0`: empty.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Cached<A, S> {
    key: CtKey<A>,
    ingress: u32,
    generation: u32,
    until: u64,
    step: S,
}

/// XDP's step of a tracked north-south flow: its rewrite and its route.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct XdpStep<A> {
    dst: A,
    src: A,
    dport: [u8; 2],
    sport: [u8; 2],
    egress: u32,
    dmac: [u8; 6],
    smac: [u8; 6],
    /// A reply's slot (`Reason::XdpReply`), else a forward packet's (`Reason::XdpForward`).
    reply: u16,
    /// What the rewrite of both addresses adds to the checksums, folded (`addrs_change`):
    /// summed once, at the slot's first hit, not at every packet (sixteen words in IPv6). 0:
    /// not summed yet.
    addrs: [u8; 2],
}

/// TC's step of a tracked pod flow (pod ingress's DNAT of a forward packet, egress's reverse
/// NAT of a reply): the flow's entry as the conntrack path read it, and for a reply the
/// Service address the reverse NAT map gave.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Tracked<A> {
    pub entry: CtEntry<A>,
    pub rn_addr: A,
    pub rn_port: [u8; 2],
    _pad: [u8; 2],
}

pub type FlowMap<A> = PerCpuArray<Cached<A, XdpStep<A>>, { SLOTS as usize }>;
pub type TrackedMap<A> = PerCpuArray<Cached<A, Tracked<A>>, { TC_SLOTS as usize }>;

#[btf_map]
pub static FLOWS4: FlowMap<[u8; 4]> = PerCpuArray::new();

#[btf_map]
pub static FLOWS6: FlowMap<Ip6> = PerCpuArray::new();

#[btf_map]
pub static TRACKED4: TrackedMap<[u8; 4]> = PerCpuArray::new();

#[btf_map]
pub static TRACKED6: TrackedMap<Ip6> = PerCpuArray::new();

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

/// XDP's tally.
#[btf_map]
pub static FLOW_TALLY: PerCpuArray<Tally, 1> = PerCpuArray::new();

/// TC's tally (pod ingress and egress share it, and the slots).
#[btf_map]
pub static TC_TALLY: PerCpuArray<Tally, 1> = PerCpuArray::new();

/// The current generation.
#[inline(always)]
fn generation() -> u32 {
    FLOW_GEN_V1.get(0).map_or(0, |g| g.generation())
}

/// Moves the datapath's count of the generation on: every CPU's cached steps go. For TC
/// tracking afresh the tuple of a flow whose old step a slot may hold (on any CPU: a veth
/// uplink runs XDP on the sender's; `retracked_unless_ended`), and for a new flow writing over
/// another flow's reply entry (`ct::create`, `create_snat`).
#[inline(always)]
pub fn retracked() {
    let Some(g) = FLOW_GEN_V1.get_ptr_mut(0) else { return };
    // SAFETY: a field of the map's live value, changed by one atomic instruction (the agent
    // changes only the other field).
    unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(&raw mut (*g).datapath, 1) };
}

/// Moves the datapath's count of the generation on (`retracked`), for a flow tracked afresh
/// whose entry was last refreshed at `last_seen`: unless every window a slot could hold for it
/// has ended by `now` (a window ends at most `REFRESH_NS` after the refresh it was filled
/// after; twice that here, for CPUs whose clocks are a tick apart). Whatever the entry's
/// lifetime: one set under a second may have ended before a slot's window did.
#[inline(always)]
pub fn retracked_unless_ended(last_seen: u64, now: u64) {
    if now.saturating_sub(last_seen) <= 2 * ct::REFRESH_NS {
        retracked();
    }
}

/// Whether the step of a flow whose entry has flags `f` may be cached: not once the flow is
/// closing (a FIN or a RST seen). Its tuple may then be tracked afresh by a SYN at any time;
/// and a CPU that reads the generation moved on for that, then the old entry before the new
/// one is written, would cache the old step under it.
#[inline(always)]
pub fn caches(f: u8) -> bool {
    f & (ct::flags::FIN_FWD | ct::flags::FIN_REV | ct::flags::RST) == 0
}

/// Whether the cache may serve (or learn from) `pkt`: not a TCP segment that changes its
/// flow's state.
#[inline(always)]
pub fn takes<A: Family>(pkt: &Packet<A>) -> bool {
    pkt.proto != IPPROTO_TCP || pkt.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
}

#[inline(always)]
fn slot<A: Family, S: 'static, const M: usize>(
    slots: &'static PerCpuArray<Cached<A, S>, M>,
    hash: u64,
) -> Option<&'static mut Cached<A, S>> {
    // `hash`: the key's in the conntrack filter (`ct_filter::hash`), whose top bits place the
    // key in the filter; the next ones place it here.
    let index = (hash >> 32) as u32 & (M as u32 - 1);
    // SAFETY: per-CPU, and each cache is used by programs that run in a softirq or with them
    // held off (XDP; TC), which do not interrupt one another on the same CPU (see the module
    // comment for PREEMPT_RT).
    unsafe { crate::value::per_cpu(slots, index) }
}

/// What the cache has for a tracked flow's packet.
pub enum Lookup<T> {
    /// The flow's step.
    Hit(T),
    /// Nothing: the packet's step is to be cached once decided (`fill`), under `generation`
    /// (read before the decision's lookups).
    Miss { generation: u32 },
    /// Not looked in (`Tally`): neither served nor cached.
    Resting,
}

/// The cached step for the key `is_key` accepts (of filter hash `hash`, `ct::may_hold`),
/// arriving on `ingress`, at `now`, if its slot in `slots` holds one and this CPU's cache is
/// not resting (`tally`).
#[inline(always)]
fn lookup<A: Family, S: 'static, const M: usize>(
    slots: &'static PerCpuArray<Cached<A, S>, M>,
    tally: &'static PerCpuArray<Tally, 1>,
    is_key: impl FnOnce(&CtKey<A>) -> bool,
    hash: u64,
    ingress: u32,
    now: u64,
) -> Lookup<&'static mut S> {
    // SAFETY: per-CPU, taken once here (as `slot`).
    let Some(t) = (unsafe { crate::value::per_cpu(tally, 0) }) else { return Lookup::Resting };
    if t.rest > 0 {
        t.rest -= 1;
        return Lookup::Resting;
    }
    let Some(f) = slot(slots, hash) else { return Lookup::Resting };
    let generation = generation();
    let live = now < f.until && f.generation == generation;
    let hit = live && f.ingress == ingress && is_key(&f.key);
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
    Lookup::Hit(&mut f.step)
}

/// Records what the conntrack path decided at `now` for `key()` (the key `is_key` accepts; made
/// where it is used, as one held took TC's callers' stack), arriving on `ingress`, valid
/// until `until` under generation `generation` (`step` writes the step into the slot, and
/// says whether it is one to serve: false leaves the slot empty); unless
/// the slot serves another flow still: with more flows than slots, the slots keep the flows
/// that took them until their windows end, where taking turns would have every flow miss. (A
/// flow of one packet each way, a DNS query's, holds the slot it took until its window ends
/// too.)
#[inline(always)]
fn fill<A: Family, S: 'static, const M: usize>(
    slots: &'static PerCpuArray<Cached<A, S>, M>,
    key: impl Fn() -> CtKey<A>,
    is_key: impl FnOnce(&CtKey<A>) -> bool,
    ingress: u32,
    generation: u32,
    now: u64,
    until: u64,
    step: impl FnOnce(&mut S) -> bool,
) {
    // (Hashed again, not kept from the lookup: a miss pays the conntrack lookup besides.)
    let Some(f) = slot(slots, ct_filter::hash(&key())) else { return };
    if now < f.until && f.generation == generation && !is_key(&f.key) {
        return;
    }
    f.key = key();
    f.ingress = ingress;
    f.generation = generation;
    f.until = if step(&mut f.step) { until } else { 0 };
}

/// What an XDP slot sends a packet on with.
pub struct Hit<A> {
    pub dst: (A, [u8; 2]),
    pub src: (A, [u8; 2]),
    pub route: Route<A>,
    pub reason: Reason,
    /// The addresses' change, folded (`XdpStep::addrs`).
    pub addrs: [u8; 2],
}

/// What rewriting the addresses of `key` to `src` and `dst` adds to a checksum
/// (`xdp::addrs_change`), folded: equal to it in the one's-complement sum, and never 0 (which
/// stands for "not summed yet") unless the change is nil.
#[inline(always)]
fn addrs_change<A: Family>(key: &CtKey<A>, dst: A, src: A) -> [u8; 2] {
    proxy_common::csum::fold(crate::xdp::addrs_change(key.saddr, key.daddr, dst, src)).to_ne_bytes()
}

/// XDP: the cached step for `key` (of filter hash `hash`), arriving on `ingress`, at `now`.
#[inline(always)]
pub fn lookup_xdp<A: Family>(key: &CtKey<A>, hash: u64, ingress: u32, now: u64) -> Lookup<Hit<A>> {
    match lookup(A::flow_cache(), &FLOW_TALLY, |k| k == key, hash, ingress, now) {
        Lookup::Hit(s) => {
            if s.addrs == [0, 0] {
                s.addrs = addrs_change(key, s.dst, s.src);
            }
            Lookup::Hit(Hit {
                dst: (s.dst, s.dport),
                src: (s.src, s.sport),
                route: Route { ifindex: s.egress, smac: s.smac, dmac: s.dmac, no_neigh: false, nexthop: s.dst },
                reason: if s.reply != 0 { Reason::XdpReply } else { Reason::XdpForward },
                addrs: s.addrs,
            })
        }
        Lookup::Miss { generation } => Lookup::Miss { generation },
        Lookup::Resting => Lookup::Resting,
    }
}

/// The end of the window in which the conntrack path leaves an entry last refreshed at
/// `last_seen` as it is: its refresh is not due, and it has not outlived `lifetime`.
#[inline(always)]
pub fn quiet_end(last_seen: u64, lifetime: u64) -> u64 {
    last_seen.saturating_add(if lifetime < ct::REFRESH_NS { lifetime } else { ct::REFRESH_NS })
}

/// The end of the window, from `now`, in which the conntrack path leaves an entry as it is
/// (`quiet_end`) and keeps its cached route (the route's epoch, `ct::route_epoch`, is the
/// same).
#[inline(always)]
pub fn window_end(last_seen: u64, lifetime: u64, now: u64) -> u64 {
    let quiet = quiet_end(last_seen, lifetime);
    let epoch_end = ct::route_epoch_end(now);
    if quiet < epoch_end {
        quiet
    } else {
        epoch_end
    }
}

/// XDP: records the step decided for `key` (`fill`): sent on to `dst` from `src` by `route`.
#[inline(always)]
pub fn fill_xdp<A: Family>(
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
    fill(
        A::flow_cache(),
        || *key,
        |k| k == key,
        ingress,
        generation,
        now,
        until,
        |s| {
            *s = XdpStep {
                dst: dst.0,
                src: src.0,
                dport: dst.1,
                sport: src.1,
                egress: route.ifindex,
                dmac: route.dmac,
                smac: route.smac,
                reply: u16::from(reason == Reason::XdpReply),
                // Summed at the first hit (`lookup_xdp`): here, on the conntrack path, the sum
                // took the IPv6 XDP program past its stack.
                addrs: [0; 2],
            };
            true
        },
    );
}

/// TC: the cached step for `pkt`'s tuple (of filter hash `hash`) at `now` (pod ingress's forward
/// packets and egress's replies; the interface plays no part in their steps).
#[inline(always)]
pub fn lookup_tc<A: Family>(pkt: &Packet<A>, hash: u64, now: u64) -> Lookup<&'static Tracked<A>> {
    // (TC's callers only read the slot: handed on shared.)
    match lookup(A::tc_cache(), &TC_TALLY, |k| crate::ct::is_key_of(k, pkt), hash, 0, now) {
        Lookup::Hit(t) => Lookup::Hit(t),
        Lookup::Miss { generation } => Lookup::Miss { generation },
        Lookup::Resting => Lookup::Resting,
    }
}

/// TC: what the cache has for a tracked flow's packet `pkt` (whose tuple's filter hash is
/// `hash`, `ct::may_hold`) at `now`. A packet `takes`
/// refuses empties its tuple's slot on this CPU (`forget_tc`) and, as a fragment, is not looked
/// up (`Resting`: neither served nor cached).
#[inline(always)]
pub fn consult_tc<A: Family>(pkt: &Packet<A>, hash: u64, now: u64) -> Lookup<&'static Tracked<A>> {
    // (No key is made for the lookup, which compares the packet's fields: `ct::is_key_of`. One
    // held across took the callers' stack.)
    if !takes(pkt) {
        forget_tc(&crate::ct::key(pkt), hash);
        return Lookup::Resting;
    }
    if pkt.frag != crate::parse::Frag::Whole {
        return Lookup::Resting;
    }
    lookup_tc(pkt, hash, now)
}

/// TC: records the entry the conntrack path just served `pkt` with at `now` (`e`, the map's;
/// `entry`, the path's copy as it read it), and the Service address `rn` a reply was given,
/// for the window in which that path would leave the entry as it is: until its next refresh
/// (counted from `now` if the packet refreshed it) or the end of its lifetime (`quiet_end`).
/// Unless the entry no longer names the Service and backend the path read in it: the LRU may
/// have given the element to another key since (the copy is taken from the map, as one from
/// the program's own copy took stack the IPv6 programs do not have). For a packet that added
/// no flag to the entry (callers fill only then: a later packet the cache takes adds none).
#[inline(always)]
pub fn fill_tc<A: Family>(pkt: &Packet<A>, generation: u32, now: u64, e: &Slot<CtEntry<A>>, entry: &CtEntry<A>, rn: (A, [u8; 2])) {
    let last_seen = if now.wrapping_sub(entry.last_seen_ns) > ct::REFRESH_NS { now } else { entry.last_seen_ns };
    let until = quiet_end(last_seen, crate::ct::lifetime(pkt.proto, entry.flags));
    let ids = (entry.service_id, entry.backend_id);
    fill(
        A::tc_cache(),
        || crate::ct::key(pkt),
        |k| crate::ct::is_key_of(k, pkt),
        0,
        generation,
        now,
        until,
        |s| {
            e.read(|m| crate::value::copy_words(&mut s.entry, m));
            s.rn_addr = rn.0;
            s.rn_port = rn.1;
            (s.entry.service_id, s.entry.backend_id) == ids
        },
    );
}

/// TC: forgets the slot of `key` (of filter hash `hash`) on this CPU, if it holds it: for a
/// packet that changes its flow's state (`takes` refuses it), after which the slot's window
/// may outlast the entry's new lifetime. (Another CPU's slot keeps its window: see the module comment.)
#[inline(always)]
pub fn forget_tc<A: Family>(key: &CtKey<A>, hash: u64) {
    forget(A::tc_cache(), key, hash);
}

/// XDP: as `forget_tc`.
#[inline(always)]
pub fn forget_xdp<A: Family>(key: &CtKey<A>, hash: u64) {
    forget(A::flow_cache(), key, hash);
}

#[inline(always)]
fn forget<A: Family, S: 'static, const M: usize>(slots: &'static PerCpuArray<Cached<A, S>, M>, key: &CtKey<A>, hash: u64) {
    if let Some(f) = slot(slots, hash) {
        if f.until != 0 && f.key == *key {
            f.until = 0;
        }
    }
}
