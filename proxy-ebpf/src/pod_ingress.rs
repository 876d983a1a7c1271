//! Service load balancing on TC ingress of pod-facing interfaces: conntrack first (one lookup
//! finds tracked flows in either direction), then the service map for new flows. Replies are
//! left alone here and translated on egress, after the kernel has routed them, so that
//! netfilter on the node sees an ordinary client <-> backend connection, as it does with
//! kube-proxy's DNAT; translating them here would show conntrack two half-connections that any
//! `ctstate INVALID` drop rule discards.

use aya_ebpf::{bindings::TC_ACT_OK, programs::TcContext};
use proxy_common::{
    ct::{flags, owner},
    prog_slots, svc_cidr, Backend, CtEntry, Reason, ServiceKey, ServiceValue,
};

use crate::{
    ct,
    family::Family,
    flowcache::{self, Lookup},
    frag, icmp, icmp6, icmp_nat,
    maps::PROGS_V1,
    nat::{self, Side},
    parse::{self, Frag, Packet, Parsed, L3},
    parse6,
    select::{self, backend_of},
    value::Slot,
    verdict::Verdict,
};

#[inline(always)]
pub fn try_tc_ingress(ctx: &TcContext) -> Result<Verdict, Reason> {
    match parse::l3(ctx) {
        L3::V4(Parsed::Packet(p)) => flow(ctx, p),
        L3::V4(Parsed::Icmp { l4_off, saddr, daddr, tot_len }) => icmp_message(ctx, l4_off, saddr, daddr, tot_len),
        L3::V4(Parsed::OtherProto { .. }) => Ok(Verdict::pass(Reason::PassNotService)),
        L3::V4(Parsed::Malformed) => Ok(Verdict::pass(Reason::PassMalformed)),
        // IPv6 never comes here: the entry point sends it to `try_tc_ingress6` on the same
        // ethertype.
        L3::V6 | L3::Other => Ok(Verdict::pass(Reason::PassNotIpv4)),
    }
}

/// An IPv6 packet from a pod (a program of its own, see `map_names::PROGS`). Of ICMPv6 (neighbour
/// discovery among it), only an error about a translated flow and a ping to a cluster IP are a
/// Service's business, handled as IPv4's are.
#[inline(always)]
pub fn try_tc_ingress6(ctx: &TcContext) -> Result<Verdict, Reason> {
    match parse6::ipv6(ctx) {
        Parsed::Packet(p) => flow(ctx, p),
        Parsed::Icmp { l4_off, saddr, daddr, tot_len } => {
            let kind = icmp6::kind(ctx, l4_off);
            if icmp6::is_error(kind) {
                // SAFETY: plain helper call; on success it does not return.
                unsafe { PROGS_V1.tail_call(ctx, prog_slots::ICMP6) };
                return Ok(Verdict::pass(Reason::PassNoStage));
            }
            if !icmp6::is_echo_request(kind) || select::service_cidr_of(daddr) != svc_cidr::ALLOCATED {
                return Ok(Verdict::pass(Reason::PassNotService));
            }
            let query = icmp::query_packet(l4_off, parse6::IPPROTO_ICMPV6, saddr, daddr, tot_len);
            icmp6::reject(ctx, &query, Reason::RejectClusterIpPort)
        }
        Parsed::OtherProto { .. } => Ok(Verdict::pass(Reason::PassNotService)),
        Parsed::Malformed => Ok(Verdict::pass(Reason::PassMalformed)),
    }
}

/// A TCP or UDP packet from a pod, of either family.
#[inline(always)]
fn flow<A: Family>(ctx: &TcContext, mut pkt: Packet<A>) -> Result<Verdict, Reason> {
    if pkt.frag == Frag::Later && !frag::resolve_ports(&mut pkt) {
        return Ok(Verdict::pass(Reason::PassFragmentUnknown));
    }
    let (now, reason) = if let Some(hash) = ct::may_hold(&ct::key(&pkt)) {
        match tracked(ctx, &pkt, hash) {
            Tracked::Done(verdict) => return verdict,
            Tracked::Afresh(now, reason) => (now, reason),
        }
    } else {
        (None, reason_of_new(&pkt))
    };
    // (Out here, the new-flow path has the stack the tracked path's copies took.)
    to_service_stage(ctx, &pkt, now, reason)
}

/// What a packet that may be of a tracked flow comes to.
enum Tracked {
    Done(Result<Verdict, Reason>),
    /// To be tracked afresh (a new flow), with the time if it was read.
    Afresh(Option<u64>, Reason),
}

/// A packet whose tuple the conntrack filter may hold: served from TC's flow cache (a forward
/// packet in its flow's window, which the conntrack path would translate the same way and
/// write nothing for), else by its conntrack entry (the filter is read: the entry is looked up
/// directly). (The key is made afresh at each use: one held across took stack.)
#[inline(always)]
fn tracked<A: Family>(ctx: &TcContext, pkt: &Packet<A>, hash: u64) -> Tracked {
    let now = ct::now();
    let mut cache_under = None;
    match flowcache::consult_tc(pkt, hash, now) {
        Lookup::Hit(t) if t.entry.flags & flags::REPLY == 0 => return established(ctx, pkt, None, &t.entry, now, None),
        // A local backend's reply (the slot egress filled): passed, as the conntrack path
        // passes it.
        Lookup::Hit(t) if t.entry.flags & (flags::HAIRPIN | flags::SNAT) == 0 => {
            return Tracked::Done(Ok(Verdict::pass(Reason::ReplyIngress)));
        }
        Lookup::Miss { generation } => cache_under = Some(generation),
        _ => {}
    }
    let Some(mut e) = Slot::of(A::ct(), ct::key(pkt)) else {
        return Tracked::Afresh(None, reason_of_new(pkt));
    };
    let entry = e.get();
    if entry.owner == owner::HANDOVER && !ct::handed_over(&mut e, &entry, now) {
        // Either way: a reply, netfilter would track as a new connection.
        return Tracked::Done(Err(Reason::DropHandover));
    }
    if entry.flags & flags::REPLY != 0 {
        let verdict = if entry.flags & flags::HAIRPIN != 0 {
            hairpin_reply(ctx, pkt, e, &entry, now)
        } else if entry.flags & flags::SNAT != 0 {
            // Only a flow of the node's own (`host`) has a SNAT entry at a pod.
            crate::host::pod_reply(ctx, pkt, e, &entry, now)
        } else {
            Ok(Verdict::pass(Reason::ReplyIngress))
        };
        return Tracked::Done(verdict);
    }
    if ct::forward_stale(pkt, &entry, now) {
        // Tracked afresh; the old connection's reply entry must not outlive it.
        retrack(pkt, &entry, now);
        return Tracked::Afresh(Some(now), reason_of_new(pkt));
    }
    if entry.owner == owner::NETFILTER && (pkt.proto != proxy_common::IPPROTO_UDP || backend_of(&entry).is_some()) {
        // A connection netfilter's entry translates (either of its tuples): kept alive here,
        // left to it. (A UDP flow whose endpoint went is balanced afresh by `established`, as
        // kube-proxy clears such a flow's netfilter entry; TCP stays with it, as there.)
        ct::touch_forward(pkt, &mut e, now);
        return Tracked::Done(Ok(Verdict::pass(Reason::PassNetfilter)));
    }
    established(ctx, pkt, Some(e), &entry, now, cache_under)
}

/// Before a flow is tracked afresh (a SYN reusing a closing connection's ports, a flow whose
/// backend went, an expired flow): its old reply entry goes, and the flow caches' steps go too,
/// on every CPU, unless every window a slot could hold for it has ended
/// (`flowcache::retracked_unless_ended`).
#[inline(always)]
fn retrack<A: Family>(pkt: &Packet<A>, entry: &CtEntry<A>, now: u64) {
    ct::drop_reply(pkt, entry);
    flowcache::retracked_unless_ended(entry.last_seen_ns, now);
}

#[inline(always)]
fn reason_of_new<A: Family>(pkt: &Packet<A>) -> Reason {
    if pkt.is_tcp_mid_connection() {
        Reason::NewFlowMidConnection
    } else {
        Reason::NewFlow
    }
}

/// `to_service`, inline, or for a family whose flow does not fit one stack frame
/// (`Family::STAGES_APART`) in its new-flow program (`try_tc_ingress6_new`). `now`, if the
/// caller has it: a packet for no Service (pod to pod, most of a node's traffic) is passed
/// without reading the clock.
#[inline(always)]
fn to_service_stage<A: Family>(ctx: &TcContext, pkt: &Packet<A>, now: Option<u64>, reason: Reason) -> Result<Verdict, Reason> {
    let master = select::frontend(pkt.daddr, pkt.dport, pkt.proto);
    if master.is_none() {
        if !A::STAGES_APART {
            return unserved(ctx, pkt);
        }
        // Most packets without a flow are for no Service: they are passed here, without the
        // stage's copy and tail call. What the new-flow program may still act on (an
        // allocated cluster IP's other ports) goes on.
        if select::service_cidr_of(pkt.daddr) != svc_cidr::ALLOCATED {
            return Ok(Verdict::pass(Reason::PassNotService));
        }
    }
    let now = now.unwrap_or_else(ct::now);
    if A::STAGES_APART {
        return Ok(Verdict::pass(A::new_flow_apart(ctx, pkt, now, reason, master.as_ref())));
    }
    to_service(ctx, pkt, now, reason, master.as_ref())
}

/// The IPv6 new-flow program: `to_service` for the packet the flow stage left in `STAGE6`,
/// once it is checked to be this one (while an agent restart refills `PROGS_V1` slot by slot,
/// a new flow stage may tail-call an old new-flow program, whose stage map is the old one).
#[inline(always)]
pub fn try_tc_ingress6_new(ctx: &TcContext) -> Result<Verdict, Reason> {
    let Some(stage) = crate::family::staged(ctx) else { return Ok(Verdict::pass(Reason::PassNoStage)) };
    // The frontend as the flow stage found it. (Pod ingress always looks; a stage that did not
    // is not one of its own, and the packet passes as when no program can be entered.)
    let master = match stage.lookup {
        crate::family::lookup::FOUND => Some(&stage.master),
        crate::family::lookup::MISSED => None,
        _ => return Ok(Verdict::pass(Reason::PassNoStage)),
    };
    to_service(ctx, &stage.pkt, stage.now, stage.reason(), master)
}

/// A packet without a usable conntrack entry: a new flow if it is addressed to a service.
/// `master`: the frontend's master entry (`select::service` of the packet's destination).
#[inline(always)]
fn to_service<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    now: u64,
    reason: Reason,
    master: Option<&ServiceValue>,
) -> Result<Verdict, Reason> {
    let Some(master) = master else {
        return unserved(ctx, pkt);
    };
    let mut key = ServiceKey::new(pkt.daddr, pkt.dport, pkt.proto, 0);
    // kube-proxy's firewall applies to pods too: it sits before the Service's own chains.
    if !select::source_allowed(pkt, master) {
        return Err(Reason::DropSourceRange);
    }
    match select::internal_master(&mut key, *master) {
        Some(master) => new_flow(ctx, pkt, &key, &master, now, reason),
        None => Ok(Verdict::pass(Reason::PassNotService)),
    }
}

/// An ICMP message from a pod: an error about a reply it received from a Service goes to the
/// backend (`icmp_nat`); a query (a ping) to an allocated cluster IP is rejected, as
/// kube-proxy's `cluster-ips-check` rejects every new flow to a cluster IP that no Service
/// port takes; anything else is no Service's.
#[inline(always)]
fn icmp_message(ctx: &TcContext, l4_off: usize, saddr: [u8; 4], daddr: [u8; 4], tot_len: [u8; 2]) -> Result<Verdict, Reason> {
    if !icmp::is_query(ctx, l4_off) {
        return icmp_nat::arriving(ctx, l4_off, saddr, daddr);
    }
    if select::service_cidr_of(daddr) != svc_cidr::ALLOCATED {
        return Ok(Verdict::pass(Reason::PassNotService));
    }
    icmp::reject(ctx, &icmp::query_packet(l4_off, proxy_common::IPPROTO_ICMP, saddr, daddr, tot_len), Reason::RejectClusterIpPort)
}

/// A packet to no Service: passed, unless it opens a flow to an allocated cluster IP on a port
/// its Service does not have, which is rejected as kube-proxy's `cluster-ips-check` does. (A
/// free address of a Service CIDR is dropped where it would leave the node, by the egress
/// program: here another proxy's DNAT, or a local address such as NodeLocal DNSCache's, may
/// still claim it.)
#[inline(always)]
fn unserved<A: Family>(ctx: &TcContext, pkt: &Packet<A>) -> Result<Verdict, Reason> {
    if pkt.frag == Frag::Later || pkt.is_tcp_mid_connection() || select::service_cidr_of(pkt.daddr) != svc_cidr::ALLOCATED {
        return Ok(Verdict::pass(Reason::PassNotService));
    }
    A::reject(ctx, pkt, Reason::RejectClusterIpPort)
}

/// A packet of a tracked connection towards the service. `e`: its entry in the conntrack
/// map, None when TC's flow cache served `entry`; `cache_under`: the generation under which
/// its step is to be cached (the cache missed it).
#[inline(always)]
fn established<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    e: Option<Slot<CtEntry<A>>>,
    entry: &CtEntry<A>,
    now: u64,
    cache_under: Option<u32>,
) -> Tracked {
    // The id must still name the backend the flow went to: ids are reused eventually.
    let Some(be) = backend_of(entry) else {
        // The backend was removed. Send the flow to a live one: UDP carries on, and TCP gets a
        // reset from the new backend (it has no such connection) instead of hanging. (A step
        // the cache served is the entry's: the agent moves the cache's generation on once it
        // has deleted a backend, so only a packet in between comes here from the cache.)
        retrack(pkt, entry, now);
        return Tracked::Afresh(Some(now), Reason::Reselected);
    };
    if let Some(mut e) = e {
        ct::touch_forward(pkt, &mut e, now);
        frag::remember(pkt);
        if let (Some(generation), true) = (cache_under, flowcache::caches(entry.flags)) {
            flowcache::fill_tc(pkt, generation, now, &e, entry, (A::UNSPECIFIED, [0; 2]));
        }
    }
    Tracked::Done(translate(ctx, pkt, entry, &be))
}

/// The translation of a tracked connection's packet towards the service, sent to `be` by
/// forward entry `entry`.
#[inline(always)]
fn translate<A: Family>(ctx: &TcContext, pkt: &Packet<A>, entry: &CtEntry<A>, be: &Backend<A>) -> Result<Verdict, Reason> {
    let action = if entry.flags & flags::HAIRPIN != 0 {
        translate_hairpin(ctx, pkt, be)?
    } else {
        nat::rewrite_known(ctx, pkt, Side::Dst, be.addr, be.port, entry.l4_csum, nat::Kept::of(entry))?;
        if entry.flags & flags::PORT_NAT != 0 {
            nat::rewrite(ctx, pkt, Side::Src, pkt.saddr, entry.snat_port)?;
        }
        TC_ACT_OK
    };
    let reason = if pkt.frag == Frag::Later { Reason::FragmentNat } else { Reason::Established };
    Ok(Verdict { action, reason })
}

/// DNAT of a hairpinned flow towards `be` (the sender itself), with the hairpin address as
/// source, straight back out (through the helper: rare, and two rewrites).
#[inline(always)]
fn translate_hairpin<A: Family>(ctx: &TcContext, pkt: &Packet<A>, be: &Backend<A>) -> Result<i32, Reason> {
    nat::rewrite(ctx, pkt, Side::Dst, be.addr, be.port)?;
    nat::rewrite(ctx, pkt, Side::Src, A::HAIRPIN, pkt.sport)?;
    nat::bounce(ctx)
}

/// A pod's reply to its own hairpinned flow: from the pod to the hairpin address, it must reach
/// the pod again as coming from the service.
#[inline(always)]
fn hairpin_reply<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    mut e: Slot<CtEntry<A>>,
    entry: &CtEntry<A>,
    now: u64,
) -> Result<Verdict, Reason> {
    let Some(rn) = select::revnat_of(entry) else {
        return Ok(Verdict::pass(Reason::ReplyIngress));
    };
    // The client is the pod itself: its forward tuple starts at this packet's source address.
    let fwd_key =
        proxy_common::CtKey { saddr: pkt.saddr, daddr: rn.addr, sport: pkt.dport, dport: rn.port, proto: pkt.proto, _pad: 0, _pad2: 0 };
    if !ct::touch_reply(pkt, &mut e, entry, &fwd_key, now) {
        return Ok(Verdict::pass(Reason::ReplyIngress));
    }
    nat::rewrite(ctx, pkt, Side::Dst, pkt.saddr, pkt.dport)?;
    nat::rewrite(ctx, pkt, Side::Src, rn.addr, rn.port)?;
    Ok(Verdict { action: nat::bounce(ctx)?, reason: Reason::ReverseNat })
}

/// A flow without a usable conntrack entry: pick a backend, track, translate.
#[inline(always)]
fn new_flow<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    key: &ServiceKey<A>,
    master: &ServiceValue,
    now: u64,
    reason: Reason,
) -> Result<Verdict, Reason> {
    if master.count == 0 {
        select::without_endpoints(pkt, master)?;
        return A::reject(ctx, pkt, Reason::RejectNoEndpoints);
    }
    if ct::adopt_pending(pkt, now) {
        return Err(Reason::DropAdoptPending);
    }
    let select::Choice { id: backend_id, backend: be } = select::choose(pkt, key, master, now, true)?;
    let hairpin = be.addr == pkt.saddr;
    // Translated before it is tracked, to track the checksum form the translation found; a
    // failed insert drops the packet all the same.
    let (action, l4_csum) = if hairpin {
        (translate_hairpin(ctx, pkt, &be)?, proxy_common::ct::l4_csum::UNKNOWN)
    } else {
        (TC_ACT_OK, nat::rewrite_learning(ctx, pkt, Side::Dst, be.addr, be.port)?)
    };
    let mut reason = reason;
    if let Some(port) = ct::create(pkt, master.service_id, backend_id, &be, now, hairpin, l4_csum)? {
        // Another flow from this client port already reaches this backend: keep the tuples apart.
        nat::rewrite(ctx, pkt, Side::Src, pkt.saddr, port)?;
        if reason == Reason::NewFlow {
            reason = Reason::NewFlowPortNat;
        }
    }
    count_flow::<A>(backend_id);
    frag::remember(pkt);
    Ok(Verdict { action, reason })
}

/// Counts a new flow to the backend.
#[inline(always)]
pub fn count_flow<A: Family>(backend_id: u32) {
    if let Some(c) = Slot::of(A::flows(), backend_id) {
        c.count_flow();
    }
}
