//! Connection tracking. Each translated connection has two entries in an LRU map: the forward
//! tuple (client -> service) names the backend, the reply tuple (backend -> client) names the
//! service whose address replies must carry.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_coarse_ns},
};
use core::intrinsics::{atomic_or, AtomicOrdering};

use proxy_common::{
    ct::{self, flags},
    ct_filter, Backend, CtEntry, CtKey, Reason, IPPROTO_TCP,
};

use crate::{
    family::Family,
    maps::{ADOPTING_V1, CLOCK},
    parse::{Packet, TCP_FIN, TCP_RST},
    value::{self, Slot},
};

/// Monotonic nanoseconds at the last timer tick (`bpf_ktime_get_coarse_ns`). Timeouts are in
/// seconds, so tick resolution is plenty. The coarse clock only moves on a tick, so a per-CPU
/// cache keyed by jiffies returns exactly what it would, for a fraction of its cost (a plain
/// load instead of a seqlock read and a conversion; measured at ~15 ns per packet).
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: plain helper calls.
    let jiffies = unsafe { bpf_jiffies64() };
    // SAFETY: taken once per call and dropped at its end. The socket hooks use the cache too;
    // a TC program interrupting one can at worst leave it a tick behind for one packet.
    let Some(c) = (unsafe { value::per_cpu(&CLOCK, 0) }) else {
        // SAFETY: as above.
        return unsafe { bpf_ktime_get_coarse_ns() };
    };
    if c.jiffies != jiffies || c.ns == 0 {
        // SAFETY: as above.
        c.ns = unsafe { bpf_ktime_get_coarse_ns() };
        c.jiffies = jiffies;
    }
    c.ns
}

/// True when `pkt`, which no entry tracks, is a TCP segment of a connection under way that a
/// takeover may still adopt (`proxy_common::ct::ADOPTING_V4`): it is dropped, not balanced
/// afresh.
#[inline(always)]
pub fn adopt_pending<A: Family>(pkt: &Packet<A>, now: u64) -> bool {
    pkt.is_tcp_mid_connection() && ADOPTING_V1.get(A::ADOPTING_SLOT).is_some_and(|until| now < *until)
}

/// May the conntrack map hold `k`? `None`: it surely does not, the conntrack filter says
/// (`proxy_common::ct_filter`). Else the key's hash in the filter, which also places the key in
/// the flow caches (`flowcache`): a packet's tuple is hashed once.
#[inline(always)]
pub fn may_hold<A: Family>(k: &CtKey<A>) -> Option<u64> {
    let hash = ct_filter::hash(k);
    let Some(f) = A::ct_filter().get_ptr(0) else { return Some(hash) };
    // SAFETY: the map's live value, read a word at a time.
    let Some(half) = ct_filter::half(unsafe { (*f).control }) else { return Some(hash) };
    let (word, bit) = ct_filter::place(hash);
    // SAFETY: in bounds: `half` is 0 or 1 and `word` below `HALF_WORDS`.
    let set = unsafe { *(*f).words.as_ptr().add(half * ct_filter::HALF_WORDS + word) & bit != 0 };
    set.then_some(hash)
}

/// The entry of `k`, looked up only where the conntrack filter says it may be there: the
/// lookup of a packet's own tuple, most of whose packets belong to no tracked flow.
#[inline(always)]
pub fn lookup<A: Family>(k: CtKey<A>) -> Option<Slot<CtEntry<A>>> {
    may_hold(&k)?;
    Slot::of(A::ct(), k)
}

/// Sets the bits of the keys of hashes `hashes` in both halves of the conntrack filter, before
/// their entries are inserted (see `proxy_common::ct_filter` for why both, and why first).
#[inline(always)]
fn mark<A: Family>(hashes: [u64; 2]) {
    let Some(f) = A::ct_filter().get_ptr_mut(0) else { return };
    for h in hashes {
        let (word, bit) = ct_filter::place(h);
        // SAFETY: in bounds (`word` is below `HALF_WORDS`); set by one atomic instruction each,
        // as other CPUs and the agent set bits of the same words. A bit already set is only
        // read: new flows on many CPUs then seldom write the same cache line.
        unsafe {
            let w = (*f).words.as_mut_ptr().add(word);
            for w in [w, w.add(ct_filter::HALF_WORDS)] {
                if *w & bit == 0 {
                    atomic_or::<u64, u64, { AtomicOrdering::Relaxed }>(w, bit);
                }
            }
        }
    }
}

/// The tuple of the packet as it is on the wire.
#[inline(always)]
pub fn key<A: Family>(pkt: &Packet<A>) -> CtKey<A> {
    CtKey { saddr: pkt.saddr, daddr: pkt.daddr, sport: pkt.sport, dport: pkt.dport, proto: pkt.proto, _pad: 0, _pad2: 0 }
}

/// Whether `k` is the packet's tuple (`key`), compared field by field (a key made to compare
/// with took stack). The padding is not compared: for keys written by `key`, whose padding is
/// zero (TC's flow cache writes its slots' keys only so).
#[inline(always)]
pub fn is_key_of<A: Family>(k: &CtKey<A>, pkt: &Packet<A>) -> bool {
    k.saddr == pkt.saddr && k.daddr == pkt.daddr && k.sport == pkt.sport && k.dport == pkt.dport && k.proto == pkt.proto
}

/// Where replies of a flow from this packet's sender go: the sender, or the hairpin address
/// when the sender is its own backend.
#[inline(always)]
fn reply_daddr<A: Family>(pkt: &Packet<A>, hairpin: bool) -> A {
    if hairpin {
        A::HAIRPIN
    } else {
        pkt.saddr
    }
}

/// The tuple replies from `backend` to this packet's sender will carry.
#[inline(always)]
fn reply_key<A: Family>(pkt: &Packet<A>, backend: &Backend<A>, hairpin: bool) -> CtKey<A> {
    CtKey {
        saddr: backend.addr,
        daddr: reply_daddr(pkt, hairpin),
        sport: backend.port,
        dport: pkt.sport,
        proto: pkt.proto,
        _pad: 0,
        _pad2: 0,
    }
}

/// The forward tuple of the connection a reply (tracked by `entry`) belongs to, given the
/// service address: the client at its own port, moved or not.
#[inline(always)]
pub fn forward_key_of_reply<A: Family>(pkt: &Packet<A>, entry: &CtEntry<A>, vip: A, vport: [u8; 2]) -> CtKey<A> {
    CtKey {
        saddr: pkt.daddr,
        daddr: vip,
        sport: if entry.flags & flags::PORT_NAT != 0 { entry.snat_port } else { pkt.dport },
        dport: vport,
        proto: pkt.proto,
        _pad: 0,
        _pad2: 0,
    }
}

/// The forward tuple of the SNAT flow a reply entry belongs to (north-south, or a host flow's),
/// given the service address: its client, at the address and port the entry keeps.
#[inline(always)]
pub fn snat_forward_key<A: Family>(entry: &CtEntry<A>, vip: A, vport: [u8; 2], proto: u8) -> CtKey<A> {
    CtKey { saddr: entry.nat_addr, daddr: vip, sport: entry.nat_port, dport: vport, proto, _pad: 0, _pad2: 0 }
}

/// The lifetimes the agent set at load (kube-proxy's conntrack settings). A read-only global:
/// the verifier sees its frozen value.
#[no_mangle]
static CT_LIFETIMES: ct::Lifetimes = ct::Lifetimes::DEFAULT;

/// The lifetime of an entry with flags `f` (`proxy_common::ct::lifetime_ns`), by the loaded
/// settings: that field alone, read volatile so that the default is not folded in before the
/// loader sets the value. (A volatile read of the whole struct put a 48-byte copy on the
/// programs' stack at each use.)
#[inline(always)]
pub fn lifetime(proto: u8, f: u8) -> u64 {
    let i = ct::Lifetimes::index(proto, f);
    // SAFETY: within our own static, which is six `u64`s (`Lifetimes` is `repr(C)`, 48 bytes).
    unsafe { core::ptr::read_volatile((&raw const CT_LIFETIMES).cast::<u64>().add(i)) }
}

/// True when an entry no longer steers packets at `now` (see `proxy_common::ct::expired`).
#[inline(always)]
pub fn expired(proto: u8, f: u8, last_seen_ns: u64, now: u64) -> bool {
    now.saturating_sub(last_seen_ns) > lifetime(proto, f)
}

/// CT flags a TCP packet contributes. `fin` is the FIN flag for its direction.
#[inline(always)]
fn tcp_state_flags<A: Family>(pkt: &Packet<A>, fin: u8) -> u8 {
    let mut f = 0;
    if pkt.tcp_flags & TCP_FIN != 0 {
        f |= fin;
    }
    if pkt.tcp_flags & TCP_RST != 0 {
        f |= flags::RST;
    }
    f
}

/// True when a forward entry must not steer this packet: it has expired, or a new SYN reuses
/// the tuple of a connection that was closing.
#[inline(always)]
pub fn forward_stale<A: Family>(pkt: &Packet<A>, e: &CtEntry<A>, now: u64) -> bool {
    expired(pkt.proto, e.flags, e.last_seen_ns, now)
        || (pkt.proto == IPPROTO_TCP && pkt.is_tcp_syn() && e.flags & (flags::FIN_FWD | flags::FIN_REV | flags::RST) != 0)
}

/// Records a forward packet on its entry: state flags always, the timestamp at most once a second.
#[inline(always)]
pub fn touch_forward<A: Family>(pkt: &Packet<A>, e: &mut Slot<CtEntry<A>>, now: u64) {
    let add = if pkt.proto == IPPROTO_TCP { tcp_state_flags(pkt, flags::FIN_FWD) } else { 0 };
    // Racing writers store the same kind of data; a lost update costs at most one second of
    // lifetime or one flag that the next packet sets again.
    e.update(move |e| {
        if e.flags & add != add {
            e.flags |= add;
        }
        if now.wrapping_sub(e.last_seen_ns) > ct::REFRESH_NS {
            e.last_seen_ns = now;
        }
    });
}

/// Whether the entry `e` (read: `entry`, forward or reply) of a connection at its handover
/// (`owner::HANDOVER`) is ours at `now`: once the agent has not finished it in time, the entry
/// is made ours here. False: its packets are held back.
#[inline(always)]
pub fn handed_over<A: Family>(e: &mut Slot<CtEntry<A>>, entry: &CtEntry<A>, now: u64) -> bool {
    if now.wrapping_sub(entry.last_seen_ns) < ct::HANDOVER_NS {
        return false;
    }
    e.update(|e| e.owner = ct::owner::DATAPATH);
    true
}

/// Records a reply, and checks that it still belongs to a live connection. A reply entry is
/// only valid while its forward entry is live and names the same backend: otherwise the
/// connection closed, expired or moved to another backend, and the tuple may now be a
/// different, direct connection between the same two ports, which must not be translated.
/// The check needs the forward entry, so it runs when the entry is due a refresh (at most once
/// a second) or gains a flag; it also refreshes the forward entry, so a flow where only the
/// backend talks stays alive. Returns false (after deleting the entry) when the reply is stale.
#[inline(always)]
pub fn touch_reply<A: Family>(pkt: &Packet<A>, e: &mut Slot<CtEntry<A>>, entry: &CtEntry<A>, fwd_key: &CtKey<A>, now: u64) -> bool {
    let add = flags::SEEN_REPLY | if pkt.proto == IPPROTO_TCP { tcp_state_flags(pkt, flags::FIN_REV) } else { 0 };
    let gains_flags = entry.flags & add != add;
    let due = now.wrapping_sub(entry.last_seen_ns) > ct::REFRESH_NS;
    if !gains_flags && !due {
        return true;
    }
    // Racing writers store the same kind of data.
    let live = Slot::of(A::ct(), fwd_key).is_some_and(|mut f| {
        f.update(move |f| {
            let ok = f.flags & flags::REPLY == 0 && f.backend_id == entry.backend_id && !expired(pkt.proto, f.flags, f.last_seen_ns, now);
            if ok {
                f.flags |= add;
                f.last_seen_ns = now;
            }
            ok
        })
    });
    if !live {
        let _ = A::ct().remove(key(pkt));
        return false;
    }
    // As in touch_forward.
    e.update(move |e| {
        e.flags |= add;
        e.last_seen_ns = now;
    });
    true
}

/// Forgets the reply entry of the connection `fwd` tracked, when the flow moves to another
/// backend or is tracked afresh: left behind, it would translate an unrelated connection that
/// happens to reuse the same ports.
#[inline(always)]
pub fn drop_reply<A: Family>(pkt: &Packet<A>, fwd: &CtEntry<A>) {
    let _ = A::ct().remove(ct::reply_key_of(&key(pkt), fwd, A::HAIRPIN));
}

/// The tuple replies from `backend` to the node's `snat_addr`:`port` carry.
#[inline(always)]
fn snat_reply_key<A: Family>(pkt: &Packet<A>, backend: &Backend<A>, snat_addr: A, port: [u8; 2]) -> CtKey<A> {
    CtKey { saddr: backend.addr, daddr: snat_addr, sport: backend.port, dport: port, proto: pkt.proto, _pad: 0, _pad2: 0 }
}

/// True when the SNAT reply entry `old` no longer guards a connection, so its port may be given
/// to a new flow: it has expired, or its flow has: the forward entry is gone, expired, moved to
/// another backend, or was reset (a reset connection has no socket left on either side that a
/// new SYN could confuse; a connection closed with FINs waits for expiry, as the backend may
/// hold it in TIME_WAIT).
#[inline(always)]
fn reply_reusable<A: Family>(proto: u8, old: &Slot<CtEntry<A>>, now: u64) -> bool {
    let (oflags, olast, nat_addr, nat_port, service_id, backend_id) =
        old.read(|o| (o.flags, o.last_seen_ns, o.nat_addr, o.nat_port, o.service_id, o.backend_id));
    if oflags & flags::SNAT == 0 {
        // Not a port mapping: not ours to hand out.
        return false;
    }
    if expired(proto, oflags, olast, now) {
        return true;
    }
    let Some(rn) = value::copy(A::revnat(), service_id) else { return true };
    let fwd_key = CtKey { saddr: nat_addr, daddr: rn.addr, sport: nat_port, dport: rn.port, proto, _pad: 0, _pad2: 0 };
    match Slot::of(A::ct(), &fwd_key) {
        None => true,
        Some(f) => f.read(move |f| {
            f.flags & flags::REPLY != 0
                || f.backend_id != backend_id
                || f.flags & flags::RST != 0
                || expired(proto, f.flags, f.last_seen_ns, now)
        }),
    }
}

/// A per-CPU entry to build new entries in: map values, unlike stack variables, do not count
/// against the programs' 512-byte stack.
#[inline(always)]
fn scratch<A: Family>() -> Result<&'static mut CtEntry<A>, Reason> {
    // SAFETY: `create` and `create_snat` take the scratch entry once per packet, and only the
    // TC and XDP programs use it (they do not interrupt each other on a CPU).
    let e = unsafe { value::per_cpu(A::ct_scratch(), 0) }.ok_or(Reason::DropCtInsert)?;
    // Zeroed (no route cached, nothing set) a word at a time: assigned as a whole, the entry
    // was cleared by a call to a byte-at-a-time `memset`, a loop of 56 or 80 rounds per new
    // flow. (The volatile stores keep the compiler from merging them back into that call.)
    let words = (e as *mut CtEntry<A>).cast::<u64>();
    for i in 0..size_of::<CtEntry<A>>() / 8 {
        // SAFETY: within the entry, which is 8-byte aligned (it starts with a u64) and a
        // multiple of 8 bytes long (checked in proxy_common); all zeroes is a valid entry.
        unsafe { words.add(i).write_volatile(0) };
    }
    Ok(e)
}

/// Whether the reply entry `old`, at the backend -> client tuple a new flow `own` would take,
/// still answers for a live connection other than `own` (then the new flow must not take the
/// tuple: the backend would see two connections as one, and the first would die).
#[inline(always)]
fn reply_in_use<A: Family>(pkt: &Packet<A>, old: &Slot<CtEntry<A>>, client_port: [u8; 2], own: &CtKey<A>, now: u64) -> bool {
    let (oflags, olast, nat_addr, nat_port, snat_port, backend_id) =
        old.read(|o| (o.flags, o.last_seen_ns, o.nat_addr, o.nat_port, o.snat_port, o.backend_id));
    if oflags & flags::SNAT != 0 {
        return !reply_reusable(pkt.proto, old, now);
    }
    if oflags & flags::REPLY == 0 || expired(pkt.proto, oflags, olast, now) {
        return false;
    }
    // Its connection's forward tuple: the client (the tuple's destination, at its own port,
    // `client_port` unless it was moved), to the Service address it reached.
    let cport = if oflags & flags::PORT_NAT != 0 { snat_port } else { client_port };
    let fwd = CtKey { saddr: pkt.saddr, daddr: nat_addr, sport: cport, dport: nat_port, proto: pkt.proto, _pad: 0, _pad2: 0 };
    if fwd == *own {
        // The same connection, tracked afresh.
        return false;
    }
    match Slot::of(A::ct(), &fwd) {
        None => false,
        Some(f) => f.read(move |f| {
            f.flags & flags::REPLY == 0
                && f.backend_id == backend_id
                && f.flags & flags::RST == 0
                && !expired(pkt.proto, f.flags, f.last_seen_ns, now)
        }),
    }
}

/// Client ports a clashing flow is moved to (nf_nat's range for ports above the privileged).
const PORT_NAT_MIN: u32 = 1024;
const PORT_NAT_TRIES: u32 = 8;

/// Claims a free client port for a flow whose translated tuple is taken: the reply entry (in
/// `e`, already filled in) is inserted at backend -> client:port only where that is free.
#[inline(always)]
fn claim_client_port<A: Family>(
    pkt: &Packet<A>,
    backend: &Backend<A>,
    e: &mut CtEntry<A>,
    own: &CtKey<A>,
    now: u64,
) -> Result<[u8; 2], Reason> {
    // SAFETY: plain helper call.
    let start = unsafe { bpf_get_prandom_u32() };
    e.flags |= flags::PORT_NAT;
    e.snat_port = pkt.sport;
    for i in 0..PORT_NAT_TRIES {
        let port = ((PORT_NAT_MIN + start.wrapping_add(i) % (65536 - PORT_NAT_MIN)) as u16).to_be_bytes();
        if port == pkt.sport {
            continue;
        }
        let k = CtKey { saddr: backend.addr, daddr: pkt.saddr, sport: backend.port, dport: port, proto: pkt.proto, _pad: 0, _pad2: 0 };
        if A::ct().insert(k, &*e, BPF_NOEXIST as u64).is_ok() {
            return Ok(port);
        }
        let free = Slot::of(A::ct(), &k).is_some_and(|old| !reply_in_use(pkt, &old, port, own, now));
        if free && A::ct().insert(k, &*e, BPF_ANY as u64).is_ok() {
            // Another flow's entry written over: a cached step may still be that flow's.
            crate::flowcache::retracked();
            return Ok(port);
        }
    }
    Err(Reason::DropCtInsert)
}

/// Tracks a new connection (or re-tracks one whose backend changed). The reply tuple is taken
/// only when no other live connection holds it; otherwise the client's port is moved to a free
/// one, which is returned (the caller rewrites the packet's source port to it).
#[inline(always)]
pub fn create<A: Family>(
    pkt: &Packet<A>,
    service_id: u32,
    backend_id: u32,
    backend: &Backend<A>,
    now: u64,
    hairpin: bool,
    l4_csum: u8,
) -> Result<Option<[u8; 2]>, Reason> {
    let fin_rst = if pkt.proto == IPPROTO_TCP { tcp_state_flags(pkt, flags::FIN_FWD) } else { 0 };
    let hp = if hairpin { flags::HAIRPIN } else { 0 };
    let e = scratch::<A>()?;
    e.last_seen_ns = now;
    e.backend_id = backend_id;
    e.service_id = service_id;
    e.flags = flags::REPLY | hp;
    e.l4_csum = proxy_common::ct::l4_csum::UNKNOWN;
    e.nat_port = pkt.dport;
    // Read into a register first: `pkt` may be in a map (an IPv6 stage), and a copy between two
    // map values became a call to a byte-at-a-time `memmove`.
    // SAFETY: a plain read of a field of a valid reference.
    e.nat_addr = unsafe { core::ptr::read_volatile(&pkt.daddr) };
    let reply = reply_key(pkt, backend, hairpin);
    let own = key(pkt);
    let (pair, delta) =
        (proxy_common::csum::address_pair(pkt.saddr, pkt.daddr), proxy_common::csum::address_delta(pkt.daddr, backend.addr));
    if !hairpin {
        // The reply's sums, for egress's reverse NAT. (A hairpinned reply is bounced at pod
        // ingress by the helper, and goes to the hairpin address: none kept.)
        (e.addr_sum, e.addr_delta) = proxy_common::csum::reply_sums(pair, delta);
    }
    // The reply tuple's bit holds whatever client port it ends with (`ct_filter::hash`).
    mark::<A>([ct_filter::hash(&reply), ct_filter::hash(&own)]);
    // A hairpinned flow's replies go to the hairpin address: no other flow has them.
    // (The moved port is a flag and a value, not an `Option`: a `None` leaves its payload
    // undefined, which the compiler may spill as an unwritten register the verifier refuses.)
    let (mut moved, mut port) = (false, [0u8; 2]);
    if hairpin || A::ct().insert(reply, &*e, BPF_NOEXIST as u64).is_err() {
        let in_use = !hairpin && Slot::of(A::ct(), &reply).is_some_and(|old| reply_in_use(pkt, &old, pkt.sport, &own, now));
        if in_use {
            port = claim_client_port(pkt, backend, e, &own, now)?;
            moved = true;
        } else {
            A::ct().insert(reply, &*e, BPF_ANY as u64).map_err(|_| Reason::DropCtInsert)?;
            if !hairpin {
                // Another flow's reply entry written over (a reset connection's, whose tuple
                // is free to take at once): a cached step may still be that flow's. (No cache
                // holds a hairpinned reply's, which pod ingress bounces and egress never sees.)
                crate::flowcache::retracked();
            }
        }
    }
    e.flags = fin_rst | hp | if moved { flags::PORT_NAT } else { 0 };
    e.l4_csum = l4_csum;
    e.nat_port = backend.port;
    e.nat_addr = backend.addr;
    e.snat_port = port;
    e.addr_sum = pair;
    e.addr_delta = delta;
    if A::ct().insert(own, &*e, BPF_ANY as u64).is_err() {
        let taken = if moved { CtKey { dport: port, ..reply } } else { reply };
        let _ = A::ct().remove(taken);
        return Err(Reason::DropCtInsert);
    }
    Ok(moved.then_some(port))
}

/// Tries for a free SNAT source port before giving up. Each try is one insert that fails only
/// when that exact (backend, node address, port) tuple is taken, so with a few thousand ports
/// per backend this many misses in a row means the range is nearly used up.
const SNAT_TRIES: u32 = 8;

/// Tracks a new north-south flow to a remote backend, with its source translated to
/// `snat_addr` and a free port of `[port_min, port_max]`. The port is claimed by inserting the
/// reply entry only if its tuple is free, so two flows never share a reply tuple. Returns the
/// port (network order). `HOST`: a host flow (`host`), whose own port is never the one given.
#[inline(always)]
pub fn create_snat<A: Family, const HOST: bool>(
    pkt: &Packet<A>,
    service_id: u32,
    backend_id: u32,
    backend: &Backend<A>,
    snat_addr: A,
    port_min: u16,
    port_max: u16,
    now: u64,
) -> Result<[u8; 2], Reason> {
    let range = u32::from(port_max.saturating_sub(port_min)) + 1;
    // SAFETY: plain helper call.
    let start = unsafe { bpf_get_prandom_u32() };
    let e = scratch::<A>()?;
    e.last_seen_ns = now;
    e.backend_id = backend_id;
    e.service_id = service_id;
    e.flags = flags::REPLY | flags::SNAT;
    e.nat_port = pkt.sport;
    e.nat_addr = pkt.saddr;
    // The reply tuple's bit holds whatever SNAT port it ends with (`ct_filter::hash`).
    mark::<A>([ct_filter::hash(&snat_reply_key(pkt, backend, snat_addr, [0; 2])), ct_filter::hash(&key(pkt))]);
    let mut port = [0u8; 2];
    let mut claimed = false;
    for i in 0..SNAT_TRIES {
        port = ((port_min as u32 + start.wrapping_add(i) % range) as u16).to_be_bytes();
        if HOST && port == pkt.sport {
            // A host flow keeps its address: its own port is the tuple it must leave.
            continue;
        }
        let k = snat_reply_key(pkt, backend, snat_addr, port);
        if A::ct().insert(k, &*e, BPF_NOEXIST as u64).is_ok() {
            claimed = true;
            break;
        }
        // Taken, but perhaps by a flow that has ended: its mapping may be reused. (The LRU
        // would only evict it once the whole table is full.)
        let stale = Slot::of(A::ct(), &k).is_some_and(|old| reply_reusable(pkt.proto, &old, now));
        if stale && A::ct().insert(k, &*e, BPF_ANY as u64).is_ok() {
            // Another flow's mapping written over: a cached step may still be that flow's.
            crate::flowcache::retracked();
            claimed = true;
            break;
        }
    }
    if !claimed {
        return Err(Reason::DropSnatExhausted);
    }
    let fin_rst = if pkt.proto == IPPROTO_TCP { tcp_state_flags(pkt, flags::FIN_FWD) } else { 0 };
    e.flags = fin_rst | flags::SNAT;
    e.nat_port = backend.port;
    e.nat_addr = backend.addr;
    e.snat_port = port;
    e.snat_addr = snat_addr;
    if A::ct().insert(key(pkt), &*e, BPF_ANY as u64).is_err() {
        let _ = A::ct().remove(snat_reply_key(pkt, backend, snat_addr, port));
        return Err(Reason::DropCtInsert);
    }
    Ok(port)
}
