//! TC ingress of external interfaces: applies the north-south decision (`north`) with the
//! kernel's checksum helpers, and answers `proxy-agent trace` packets.

use aya_ebpf::{
    bindings::{bpf_redir_neigh, TC_ACT_OK, TC_ACT_REDIRECT},
    helpers::{bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use proxy_common::{csum, prog_slots, Reason, TRACE_MARK};

use crate::{
    ct,
    family::Family,
    frag, icmp_nat,
    maps::{PROGS_V1, TRACE_V2},
    nat::{self, Side},
    north::{self, Env, Route, Step},
    parse::{self, ptr_at, Frag, Frame, Packet, Parsed, IP_OFF, L3},
    value::Slot,
    verdict::Verdict,
};

const LOOPBACK_IFINDEX: u32 = 1;

/// Outcome of the program: verdict, or for a trace the decision it recorded instead.
pub enum Outcome {
    Counted(Result<Verdict, Reason>),
    Traced,
}

#[inline(always)]
pub fn try_tc_ext_ingress(ctx: &TcContext) -> Outcome {
    let env = env_of(ctx, None);
    let dry = env.dry;
    let mut pkt = match parse::l3(ctx) {
        L3::V4(Parsed::Packet(p)) => p,
        L3::Other => return Outcome::Counted(Ok(Verdict::pass(Reason::PassNotIpv4))),
        L3::V4(Parsed::Icmp { l4_off, saddr, daddr, .. }) => return icmp_message(ctx, l4_off, saddr, daddr, dry),
        L3::V4(Parsed::OtherProto { .. }) => return Outcome::Counted(Ok(Verdict::pass(Reason::PassNotService))),
        L3::V4(Parsed::Malformed) => return Outcome::Counted(Ok(Verdict::pass(Reason::PassMalformed))),
        L3::V6 => {
            // SAFETY: plain helper call; on success it does not return.
            unsafe { PROGS_V1.tail_call(ctx, prog_slots::EXT_INGRESS6) };
            return passed_unstaged(dry);
        }
    };
    if pkt.frag == Frag::Later && !frag::resolve_ports(&mut pkt) {
        return Outcome::Counted(Ok(Verdict::pass(Reason::PassFragmentUnknown)));
    }
    let step = north::decide(&env, &pkt, ct::now);
    if dry {
        trace(&step);
        return Outcome::Traced;
    }
    Outcome::Counted(apply(ctx, &pkt, step))
}

/// An IPv6 packet on an external interface (a program of its own, see `map_names::PROGS`):
/// the same decisions as IPv4's, trace packets included.
#[inline(always)]
pub fn try_tc_ext_ingress6(ctx: &TcContext) -> Outcome {
    let mut pkt = match crate::parse6::ipv6(ctx) {
        Parsed::Packet(p) => p,
        Parsed::Icmp { l4_off, .. } => {
            if env_of(ctx, None).dry || !crate::icmp6::is_error(crate::icmp6::kind(ctx, l4_off)) {
                return Outcome::Counted(Ok(Verdict::pass(Reason::PassNotService)));
            }
            // SAFETY: plain helper call; on success it does not return.
            unsafe { PROGS_V1.tail_call(ctx, prog_slots::ICMP6) };
            return passed_unstaged(false);
        }
        Parsed::OtherProto { .. } => return Outcome::Counted(Ok(Verdict::pass(Reason::PassNotService))),
        Parsed::Malformed => return Outcome::Counted(Ok(Verdict::pass(Reason::PassMalformed))),
    };
    if pkt.frag == Frag::Later && !frag::resolve_ports(&mut pkt) {
        return Outcome::Counted(Ok(Verdict::pass(Reason::PassFragmentUnknown)));
    }
    let env = env_of(ctx, None);
    // A new flow's decision runs as a program of its own (`try_tc_ext_ingress6_new`): IPv6's
    // whole decision does not fit one 512-byte stack frame.
    let step = match north::decide_tracked(&env, &pkt, ct::now, true) {
        Step::NewFlow => {
            // Most untracked packets on an external interface are the node's own (SSH, the
            // kubelet) or routed on: passed here, without the stage's copy and tail call.
            if crate::select::frontend(pkt.daddr, pkt.dport, pkt.proto).is_some_and(|m| m.flags & proxy_common::svc_flags::EXTERNAL != 0) {
                // A trace packet's new flow is decided by a program of its own, which only
                // records (the new-flow program has no room for that beside its work).
                let slot = if env.dry { prog_slots::EXT_INGRESS6_TRACE } else { prog_slots::EXT_INGRESS6_NEW };
                crate::family::enter_stage(ctx, &pkt, ct::now(), Reason::NewFlow, None, slot);
                return passed_unstaged(env.dry);
            }
            Step::Pass(Reason::PassNotService)
        }
        step => step,
    };
    finish6(ctx, &env, &pkt, step)
}

/// An ICMP message from outside: an error about a translated flow is rewritten for the host it
/// must reach (`icmp_nat`); the rest is the node's. (A trace sends no ICMP. IPv6's errors go
/// to a program of their own, `prog_names::TC_ICMP6`.)
#[inline(always)]
fn icmp_message(ctx: &TcContext, l4_off: usize, saddr: [u8; 4], daddr: [u8; 4], dry: bool) -> Outcome {
    if dry {
        return passed_unstaged(true);
    }
    Outcome::Counted(icmp_nat::arriving(ctx, l4_off, saddr, daddr))
}

/// The IPv6 north-south new-flow program: `north::new_flow` for the packet
/// `try_tc_ext_ingress6` staged, once it is checked to be this one.
#[inline(always)]
pub fn try_tc_ext_ingress6_new(ctx: &TcContext) -> Result<Verdict, Reason> {
    let Some(stage) = crate::family::staged(ctx) else { return Ok(Verdict::pass(Reason::PassNoStage)) };
    let now = stage.now;
    let step = north::new_flow(&env_of(ctx, Some(false)), &stage.pkt, || now);
    apply(ctx, &stage.pkt, step)
}

/// The same for a trace packet: decides, writes nothing, records the decision.
#[inline(always)]
pub fn try_tc_ext_ingress6_trace(ctx: &TcContext) -> Outcome {
    let Some(stage) = crate::family::staged(ctx) else { return passed_unstaged(true) };
    let now = stage.now;
    trace(&north::new_flow(&env_of(ctx, Some(true)), &stage.pkt, || now));
    Outcome::Traced
}

/// A packet whose next program could not be entered (a restart refilling the program array):
/// passed untouched, or for a trace packet recorded so (a trace counts nothing).
#[inline(always)]
fn passed_unstaged(dry: bool) -> Outcome {
    if dry {
        trace::<[u8; 4]>(&Step::Pass(Reason::PassNoStage));
        return Outcome::Traced;
    }
    Outcome::Counted(Ok(Verdict::pass(Reason::PassNoStage)))
}

/// Applies the step, or for a trace packet records it.
#[inline(always)]
fn finish6(ctx: &TcContext, env: &Env, pkt: &Packet<proxy_common::Ip6>, step: Step<proxy_common::Ip6>) -> Outcome {
    if env.dry {
        trace(&step);
        return Outcome::Traced;
    }
    Outcome::Counted(apply(ctx, pkt, step))
}

/// The environment of an external program; `dry`: as the staging program said, else from
/// the packet's mark and interface (a trace packet).
#[inline(always)]
fn env_of(ctx: &TcContext, dry: Option<bool>) -> Env {
    // SAFETY: reads fields of our own context.
    let (mark, ifindex) = unsafe { ((*ctx.skb.skb).mark, (*ctx.skb.skb).ifindex) };
    let dry = dry.unwrap_or(mark == TRACE_MARK && ifindex == LOOPBACK_IFINDEX);
    Env { ctx: ctx.skb.skb as *mut _, ifindex, xdp: false, dry, cache_under: None }
}

#[inline(always)]
fn apply<A: Family>(ctx: &TcContext, pkt: &Packet<A>, step: Step<A>) -> Result<Verdict, Reason> {
    match step {
        Step::Pass(reason) => Ok(Verdict::pass(reason)),
        // Only `decide_tracked` with `stage_new` returns it, and its caller stages the packet.
        Step::NewFlow => Ok(Verdict::pass(Reason::PassNoStage)),
        Step::Drop(reason) => Err(reason),
        Step::Reject { .. } => A::reject(ctx, pkt, Reason::RejectNoEndpoints),
        step @ (Step::Dnat { .. } | Step::Deliver { .. }) => {
            // Both rewrite one side whole and perhaps the other side's port, and go on through
            // the stack: a flow to a backend here (its client's port moved on a clash), and a
            // host flow's reply (`host`). One code path for both: two would not fit IPv6's
            // stack frame.
            let (side, addr, port, other, other_port, reason) = match step {
                Step::Dnat { backend, reason, sport, .. } => (Side::Dst, backend.addr, backend.port, Side::Src, sport, reason),
                Step::Deliver { src, dport, .. } => (Side::Src, src.0, src.1, Side::Dst, Some(dport), Reason::HostReply),
                _ => return Ok(Verdict::pass(Reason::PassNoStage)),
            };
            frag::remember(pkt);
            nat::rewrite(ctx, pkt, side, addr, port)?;
            if let Some(p) = other_port {
                let kept = match other {
                    Side::Src => pkt.saddr,
                    Side::Dst => pkt.daddr,
                };
                nat::rewrite(ctx, pkt, other, kept, p)?;
            }
            let reason = if pkt.frag == Frag::Later { Reason::FragmentNat } else { reason };
            Ok(Verdict::pass(reason))
        }
        Step::Forward { dst, src, route, reason, .. } => {
            if pkt.ttl <= 1 {
                return Ok(Verdict::pass(Reason::PassTtl));
            }
            frag::remember(pkt);
            nat::rewrite(ctx, pkt, Side::Dst, dst.0, dst.1)?;
            nat::rewrite(ctx, pkt, Side::Src, src.0, src.1)?;
            A::decrement_hops(ctx)?;
            Ok(Verdict { action: send(ctx, &route)?, reason })
        }
    }
}

/// The packet is routed here, past the stack: the TTL goes down as the stack would take it.
#[inline(always)]
pub fn decrement_ttl<F: Frame>(ctx: &F) -> Result<(), Reason> {
    let ip = ptr_at::<[u8; 20]>(ctx, IP_OFF).ok_or(Reason::DropRewrite)?;
    // SAFETY: bounds checked by ptr_at; the program owns the packet data.
    let ip = unsafe { &mut *ip };
    let old = [ip[8], ip[9]];
    let new = [ip[8].wrapping_sub(1), ip[9]];
    let check = csum::update2([ip[10], ip[11]], old, new);
    ip[8] = new[0];
    ip[10] = check[0];
    ip[11] = check[1];
    Ok(())
}

/// Out by `route`: with the next hop's address known, straight to the device; otherwise the
/// kernel resolves the neighbour first.
#[inline(always)]
pub fn send<A: Family>(ctx: &TcContext, route: &Route<A>) -> Result<i32, Reason> {
    if route.no_neigh {
        let mut nh = A::redirect_neigh_params(route.nexthop);
        // SAFETY: a valid parameter block of the size passed.
        let rc = unsafe { bpf_redirect_neigh(route.ifindex, &mut nh, size_of::<bpf_redir_neigh>() as i32, 0) } as i32;
        return if rc == TC_ACT_REDIRECT { Ok(rc) } else { Err(Reason::DropNoRoute) };
    }
    let macs = ptr_at::<[u8; 12]>(ctx, 0).ok_or(Reason::DropRewrite)?;
    // SAFETY: bounds checked by ptr_at.
    let macs = unsafe { &mut *macs };
    macs[..6].copy_from_slice(&route.dmac);
    macs[6..].copy_from_slice(&route.smac);
    // SAFETY: plain helper call.
    let rc = unsafe { bpf_redirect(route.ifindex, 0) } as i32;
    if rc == TC_ACT_REDIRECT {
        Ok(rc)
    } else {
        Err(Reason::DropNoRoute)
    }
}

/// Records a trace packet's decision for `proxy-agent trace`, in the map's value itself (a
/// copy on the stack would not fit beside IPv6's decision).
#[inline(always)]
fn trace<A: Family>(step: &Step<A>) {
    // Only trace packets write it.
    let Some(mut slot) = Slot::of(&TRACE_V2, 0) else { return };
    let (reason, backend_id, service_id) = match step {
        Step::Pass(reason) | Step::Drop(reason) => (*reason, 0, 0),
        Step::NewFlow => (Reason::PassNoStage, 0, 0),
        Step::Reject { service_id } => (Reason::RejectNoEndpoints, 0, *service_id),
        Step::Dnat { backend_id, service_id, reason, .. } | Step::Forward { backend_id, service_id, reason, .. } => {
            (*reason, *backend_id, *service_id)
        }
        Step::Deliver { backend_id, service_id, .. } => (Reason::HostReply, *backend_id, *service_id),
    };
    // Values, not the step, go into the write (a step referred to from there would have to
    // stay on the stack).
    let (forward, snat, ifindex) = match step {
        Step::Forward { src, route, .. } => (true, src.0, route.ifindex),
        _ => (false, A::UNSPECIFIED, 0),
    };
    slot.update(move |r| {
        r.reason = reason as u32;
        r.backend_id = backend_id;
        r.service_id = service_id;
        r.snat_addr = [0; 4];
        r.snat_addr6 = proxy_common::Ip6([0; 4]);
        r.ifindex = ifindex;
        if forward {
            A::trace_snat(r, snat);
        }
        r.seq = r.seq.wrapping_add(1);
    });
}

/// Returned for a trace packet: nothing leaves.
pub const TRACE_ACTION: i32 = TC_ACT_OK as i32;
