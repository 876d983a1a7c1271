//! TC egress of every attached interface, pod-facing and external: replies of translated flows
//! leave towards their client with the service address as source, ICMP errors about those
//! flows are rewritten so the client's socket recognises them (`icmp_nat`), what would leave
//! for a free address of a Service CIDR (or a host's ping to a cluster IP) is dropped
//! (rejected), and the node's own flows to a Service that the socket hooks left to TC get a
//! backend and a moved port (`host`).

use aya_ebpf::programs::TcContext;
use proxy_common::{
    ct::{flags, l4_csum},
    prog_slots, svc_cidr, CtEntry, Reason,
};

use crate::{
    ct,
    family::Family,
    flowcache::{self, Lookup},
    frag, host, icmp, icmp6, icmp_nat,
    maps::PROGS_V1,
    nat::{self, Side},
    parse::{self, Frag, Packet, Parsed, L3},
    select::{self, revnat_of},
    value::Slot,
    verdict::Verdict,
};

/// A packet of no translated flow about to leave, whose destination `LB4_SVCCIDR_V1` says
/// `cidr` of: to a free address of a Service CIDR (nothing, not another proxy nor a local
/// address, took it on the way) it is dropped, whatever its protocol, as kube-proxy's
/// `cluster-ips-check` drops traffic to unallocated cluster IPs, instead of following the
/// default route.
#[inline(always)]
fn leaving_unmatched(cidr: u8) -> Result<Verdict, Reason> {
    if cidr == svc_cidr::RANGE {
        return Err(Reason::DropUnallocatedClusterIp);
    }
    Ok(Verdict::pass(Reason::EgressPass))
}

#[inline(always)]
pub fn try_tc_egress(ctx: &TcContext) -> Result<Verdict, Reason> {
    let pkt = match parse::l3(ctx) {
        L3::V4(parsed) => parsed,
        L3::V6 => {
            // SAFETY: plain helper call; on success it does not return.
            unsafe { PROGS_V1.tail_call(ctx, prog_slots::EGRESS6) };
            return Ok(Verdict::pass(Reason::PassNoStage));
        }
        L3::Other => return Ok(Verdict::pass(Reason::PassNotIpv4)),
    };
    let pkt = match pkt {
        Parsed::Packet(p) => p,
        Parsed::Icmp { l4_off, saddr, daddr, tot_len } => {
            if !icmp::is_query(ctx, l4_off) {
                return icmp_nat::leaving(ctx, l4_off, saddr, daddr);
            }
            // A host process's ping to a cluster IP (a pod's was answered where it entered):
            // rejected as kube-proxy's `cluster-ips-check` rejects it. (The socket hooks answer
            // a host's TCP and UDP; they see no ICMP.)
            return match select::service_cidr_of(daddr) {
                svc_cidr::ALLOCATED => icmp::reject_leaving(
                    ctx,
                    &icmp::query_packet(l4_off, proxy_common::IPPROTO_ICMP, saddr, daddr, tot_len),
                    Reason::RejectClusterIpPort,
                ),
                cidr => leaving_unmatched(cidr),
            };
        }
        Parsed::OtherProto { daddr } => {
            return match select::service_cidr_of(daddr) {
                svc_cidr::ALLOCATED => Err(Reason::DropClusterIpProtocol),
                cidr => leaving_unmatched(cidr),
            };
        }
        Parsed::Malformed => return Ok(Verdict::pass(Reason::PassMalformed)),
    };
    flow(ctx, pkt)
}

/// An IPv6 packet about to leave (a program of its own, see `map_names::PROGS`): as IPv4's,
/// with ICMPv6.
#[inline(always)]
pub fn try_tc_egress6(ctx: &TcContext) -> Result<Verdict, Reason> {
    match crate::parse6::ipv6(ctx) {
        Parsed::Packet(p) => flow(ctx, p),
        Parsed::OtherProto { daddr } => match select::service_cidr_of(daddr) {
            svc_cidr::ALLOCATED => Err(Reason::DropClusterIpProtocol),
            cidr => leaving_unmatched(cidr),
        },
        Parsed::Icmp { l4_off, saddr, daddr, tot_len } => {
            let kind = icmp6::kind(ctx, l4_off);
            if icmp6::is_error(kind) {
                return icmp_nat::leaving(ctx, l4_off, saddr, daddr);
            }
            if !icmp6::is_echo_request(kind) {
                return Ok(Verdict::pass(Reason::EgressPass));
            }
            // A host process's ping to a cluster IP, as IPv4's.
            match select::service_cidr_of(daddr) {
                svc_cidr::ALLOCATED => {
                    let query = icmp::query_packet(l4_off, crate::parse6::IPPROTO_ICMPV6, saddr, daddr, tot_len);
                    icmp6::reject_leaving(ctx, &query, Reason::RejectClusterIpPort)
                }
                cidr => leaving_unmatched(cidr),
            }
        }
        Parsed::Malformed => Ok(Verdict::pass(Reason::PassMalformed)),
    }
}

/// A TCP or UDP packet about to leave, of either family: a reply of a translated flow gets
/// the Service's address back.
#[inline(always)]
fn flow<A: Family>(ctx: &TcContext, mut pkt: Packet<A>) -> Result<Verdict, Reason> {
    if pkt.frag == Frag::Later && !frag::resolve_ports(&mut pkt) {
        return Ok(Verdict::pass(Reason::PassFragmentUnknown));
    }
    if let Some(hash) = ct::may_hold(&ct::key(&pkt)) {
        if let Some(verdict) = tracked(ctx, &pkt, hash) {
            return verdict;
        }
    }
    untracked(ctx, &pkt)
}

/// A packet whose tuple the conntrack filter may hold (None: the conntrack map does not): a
/// reply served from TC's flow cache (in its flow's window, which the conntrack path would
/// translate the same way and write nothing for), else by its conntrack entry (the filter is
/// read: the entry is looked up directly). (The key is made afresh at each use, as at pod
/// ingress.)
#[inline(always)]
fn tracked<A: Family>(ctx: &TcContext, pkt: &Packet<A>, hash: u64) -> Option<Result<Verdict, Reason>> {
    let now = ct::now();
    let mut cache_under = None;
    match flowcache::consult_tc(pkt, hash, now) {
        Lookup::Hit(t) if t.entry.flags & flags::REPLY != 0 => return Some(reverse_nat(ctx, pkt, &t.entry, (t.rn_addr, t.rn_port))),
        Lookup::Miss { generation } => cache_under = Some(generation),
        _ => {}
    }
    let mut e = Slot::of(A::ct(), ct::key(pkt))?;
    let entry = e.get();
    if entry.flags & flags::REPLY == 0 {
        // A tracked host flow's next packet (a SNAT entry's flow from this node).
        if entry.flags & flags::SNAT != 0 && host::from_host(ctx) {
            return Some(Ok(Verdict::pass(host::hand_on::<A>(ctx))));
        }
        return Some(Ok(Verdict::pass(Reason::EgressPass)));
    }
    // The service is gone: nothing to restore, the client gets the packet as it is.
    let Some(rn) = revnat_of(&entry) else {
        return Some(Ok(Verdict::pass(Reason::EgressPass)));
    };
    if !ct::touch_reply(pkt, &mut e, &entry, &ct::forward_key_of_reply(pkt, &entry, rn.addr, rn.port), now) {
        return Some(Ok(Verdict::pass(Reason::EgressPass)));
    }
    frag::remember(pkt);
    if entry.l4_csum == l4_csum::UNKNOWN {
        // The first reply (or one the form could not be told from): learn the form.
        let form = match nat::rewrite_learning(ctx, pkt, Side::Src, rn.addr, rn.port) {
            Ok(form) => form,
            Err(reason) => return Some(Err(reason)),
        };
        if form != l4_csum::UNKNOWN {
            // A racing writer stores the same value.
            e.update(move |e| e.l4_csum = form);
        }
        return Some(client_port(ctx, pkt, &entry));
    }
    // (Only an entry that had seen a reply before this packet: a later reply the cache takes
    // then adds no flag to it.)
    if let (Some(generation), true) = (cache_under, entry.flags & flags::SEEN_REPLY != 0 && flowcache::caches(entry.flags)) {
        flowcache::fill_tc(pkt, generation, now, &e, &entry, (rn.addr, rn.port));
    }
    Some(reverse_nat(ctx, pkt, &entry, (rn.addr, rn.port)))
}

/// A packet of no tracked flow about to leave.
#[inline(always)]
fn untracked<A: Family>(ctx: &TcContext, pkt: &Packet<A>) -> Result<Verdict, Reason> {
    // A host process's first packet to a Service, which the socket hooks left to TC.
    if host::from_host(ctx) && select::frontend(pkt.daddr, pkt.dport, pkt.proto).is_some() {
        return Ok(Verdict::pass(host::hand_on::<A>(ctx)));
    }
    leaving_unmatched(select::service_cidr_of(pkt.daddr))
}

/// The reverse NAT of a reply whose entry `entry` knows its checksum form: the Service's
/// address `rn` as its source, and the client's own port back (`client_port`).
#[inline(always)]
fn reverse_nat<A: Family>(ctx: &TcContext, pkt: &Packet<A>, entry: &CtEntry<A>, rn: (A, [u8; 2])) -> Result<Verdict, Reason> {
    nat::rewrite_known(ctx, pkt, Side::Src, rn.0, rn.1, entry.l4_csum, nat::Kept::of(entry))?;
    client_port(ctx, pkt, entry)
}

/// The end of a reply's reverse NAT: the client's own port back if the forward direction moved
/// it.
#[inline(always)]
fn client_port<A: Family>(ctx: &TcContext, pkt: &Packet<A>, entry: &CtEntry<A>) -> Result<Verdict, Reason> {
    if entry.flags & flags::PORT_NAT != 0 {
        nat::rewrite(ctx, pkt, Side::Dst, pkt.daddr, entry.snat_port)?;
    }
    let reason = if pkt.frag == Frag::Later { Reason::FragmentNat } else { Reason::ReverseNat };
    Ok(Verdict::pass(reason))
}
