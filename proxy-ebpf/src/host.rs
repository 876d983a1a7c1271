//! Flows of host-network processes that the socket hooks leave to TC: those whose every
//! backend's tuple is taken from the process's local port (`sock`), and every host flow where
//! no hooks are attached. netfilter's NAT keeps such flows apart by moving the local port; a
//! socket hook acts before there is a packet and cannot. So the call goes on to the Service's
//! address, and the packet follows the node's route for it (a cluster IP needs one, as under
//! kube-proxy) to TC egress of the interface that route takes. There the flow gets a backend
//! as a pod's would, and the process's port is moved to one of the SNAT range
//! (`--snat-port-range`, outside the kernel's own local ports; a privileged port to another
//! privileged one, as nf_nat moves it), the claim of its reply entry keeping it unique at the
//! backend; the source address stays the one the stack chose. The
//! packet then goes by the route to the backend. The backend's replies, to the node's address
//! and the moved port, are translated back where they come in (pod ingress for a backend on
//! this node, external ingress for another node's), from the Service to the process's own
//! port, and go up the stack to its socket; conntrack on the node sees the connection the
//! process opened, to the Service.
//!
//! The conntrack entries are north-south SNAT entries (`ct::create_snat`) whose client address
//! is the node's own: a reply entry is a host flow's when its client is the packet's
//! destination.

use aya_ebpf::programs::TcContext;
use proxy_common::{ct::flags, prog_slots, CtEntry, Reason, ServiceKey};

use crate::{
    ct, ext,
    family::Family,
    frag,
    nat::{self, Side},
    north::{self, Env, Step},
    parse::Packet,
    pod_ingress::count_flow,
    select,
    value::Slot,
    verdict::Verdict,
};

/// True when the packet was sent by a socket of this node (the egress program also sees what
/// the node forwards, whose sockets are elsewhere).
#[inline(always)]
pub fn from_host(ctx: &TcContext) -> bool {
    // SAFETY: a field of our own context, read whole; the verifier knows it as a socket
    // pointer or null, and it is only compared.
    let sk = unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*ctx.skb.skb).__bindgen_anon_2.sk)) };
    !sk.is_null()
}

/// Hands a host flow's packet on to the program that serves it (`Family::HOST_SLOT`); returns
/// the reason to pass it untouched under when that cannot be done.
#[inline(always)]
pub fn hand_on<A: Family>(ctx: &TcContext) -> Reason {
    // SAFETY: plain helper call; on success it does not return.
    unsafe { crate::maps::PROGS_V1.tail_call(ctx, A::HOST_SLOT) };
    Reason::PassNoStage
}

/// A host process's packet the egress program handed on (no reply entry): a packet of a host
/// flow (tracked, or a new one to a Service), translated and sent by the backend's route.
/// None: not such a packet after all (it passes).
#[inline(always)]
fn leaving<A: Family>(ctx: &TcContext, pkt: &Packet<A>) -> Option<Result<Verdict, Reason>> {
    let env = env_of(ctx);
    let now = ct::now();
    // Each step applied where it is made: one value merged from both, its payload undefined
    // for some variants, was read by the compiled code as an unwritten register.
    match north::decide_tracked(&env, pkt, || now, true) {
        Step::NewFlow => apply(ctx, pkt, new_flow(&env, pkt, now)?),
        step => apply(ctx, pkt, step),
    }
}

/// An IPv4 host flow's packet the egress program handed on (a forward entry's, or one to a
/// Service frontend; in `proxy_tc_egress6`'s program): `leaving`, parsed again.
#[inline(always)]
pub fn try_host4(ctx: &TcContext) -> Result<Verdict, Reason> {
    let mut pkt = match crate::parse::l3(ctx) {
        crate::parse::L3::V4(crate::parse::Parsed::Packet(p)) => p,
        _ => return Ok(Verdict::pass(Reason::EgressPass)),
    };
    if pkt.frag == crate::parse::Frag::Later && !frag::resolve_ports(&mut pkt) {
        return Ok(Verdict::pass(Reason::PassFragmentUnknown));
    }
    leaving(ctx, &pkt).unwrap_or(Ok(Verdict::pass(Reason::EgressPass)))
}

/// The IPv6 host flow program: `leaving` for the packet the egress program handed on, parsed
/// again; its new flow goes on in a program of its own (`try_host6_new`, through the stage:
/// both do not fit one frame).
#[inline(always)]
pub fn try_host6(ctx: &TcContext) -> Result<Verdict, Reason> {
    let mut pkt = match crate::parse6::ipv6(ctx) {
        crate::parse::Parsed::Packet(p) => p,
        _ => return Ok(Verdict::pass(Reason::EgressPass)),
    };
    if pkt.frag == crate::parse::Frag::Later && !frag::resolve_ports(&mut pkt) {
        return Ok(Verdict::pass(Reason::PassFragmentUnknown));
    }
    let now = ct::now();
    let step = match north::decide_tracked(&env_of(ctx), &pkt, || now, true) {
        Step::NewFlow => {
            let reason = crate::family::enter_stage(ctx, &pkt, now, Reason::HostFlowNew, None, prog_slots::HOST6_NEW);
            return Ok(Verdict::pass(reason));
        }
        step => step,
    };
    apply(ctx, &pkt, step).unwrap_or(Ok(Verdict::pass(Reason::EgressPass)))
}

/// The IPv6 host flow's first packet (see `try_host6`).
#[inline(always)]
pub fn try_host6_new(ctx: &TcContext) -> Result<Verdict, Reason> {
    let Some(stage) = crate::family::staged(ctx) else { return Ok(Verdict::pass(Reason::PassNoStage)) };
    let step = new_flow(&env_of(ctx), &stage.pkt, stage.now);
    step.and_then(|step| apply(ctx, &stage.pkt, step)).unwrap_or(Ok(Verdict::pass(Reason::EgressPass)))
}

#[inline(always)]
fn env_of(ctx: &TcContext) -> Env {
    // SAFETY: reads a field of our own context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    Env { ctx: ctx.skb.skb.cast(), ifindex, xdp: false, dry: false, cache_under: None }
}

/// Applies a host flow's step (None: it is not one, the packet goes on as before). A tracked
/// flow's packet is counted as a host flow's, not as the north-south one `north` calls it.
#[inline(always)]
fn apply<A: Family>(ctx: &TcContext, pkt: &Packet<A>, step: Step<A>) -> Option<Result<Verdict, Reason>> {
    Some(match step {
        Step::Forward { dst, src, route, reason, .. } => {
            let reason = if reason == Reason::ExtEstablished { Reason::HostFlow } else { reason };
            forward(ctx, pkt, dst, src, &route, reason)
        }
        Step::Reject { service_id: 0 } => A::reject_leaving(ctx, pkt, Reason::RejectHostNoRoute),
        Step::Reject { .. } => A::reject_leaving(ctx, pkt, Reason::RejectNoEndpoints),
        Step::Drop(reason) => Err(reason),
        _ => return None,
    })
}

/// The packet, translated, out by the route to the backend (no hop is taken from it: the node
/// sent it).
#[inline(always)]
fn forward<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    dst: (A, [u8; 2]),
    src: (A, [u8; 2]),
    route: &north::Route<A>,
    reason: Reason,
) -> Result<Verdict, Reason> {
    frag::remember(pkt);
    nat::rewrite(ctx, pkt, Side::Dst, dst.0, dst.1)?;
    nat::rewrite(ctx, pkt, Side::Src, src.0, src.1)?;
    Ok(Verdict { action: ext::send(ctx, route)?, reason })
}

/// A host flow's first packet: a backend of the Service's internal scope (a host process is
/// inside the cluster, as for kube-proxy), tracked with a moved port. None: the destination is
/// no Service's.
#[inline(always)]
fn new_flow<A: Family>(env: &Env, pkt: &Packet<A>, now: u64) -> Option<Step<A>> {
    let master = select::frontend(pkt.daddr, pkt.dport, pkt.proto)?;
    let mut key = ServiceKey::new(pkt.daddr, pkt.dport, pkt.proto, 0);
    // The node passes a load-balancer IP's ranges that admit its address, or the IP itself
    // (as the socket hooks let it).
    if !select::source_allowed(pkt, &master) && !A::in_source_ranges(master.service_id, pkt.daddr) {
        return Some(Step::Drop(Reason::DropSourceRange));
    }
    let master = select::internal_master(&mut key, master)?;
    if master.count == 0 {
        return Some(match select::without_endpoints(pkt, &master) {
            Ok(()) => Step::Reject { service_id: master.service_id },
            Err(r) => Step::Drop(r),
        });
    }
    let choice = match select::choose(pkt, &key, &master, now, true) {
        Ok(c) => c,
        Err(r) => return Some(Step::Drop(r)),
    };
    let be = choice.backend;
    let Ok(route) = north::fib(env, pkt, pkt.saddr, be.addr) else {
        // An address of the node itself (a host-network endpoint here), or none routed: the
        // process hears it at once rather than waiting on a flow that goes nowhere. (Service id
        // 0, which no Service has, tells it from a Service without endpoints.)
        return Some(Step::Reject { service_id: 0 });
    };
    let (min, max) = ports_for(pkt.sport);
    let port = match ct::create_snat::<A, true>(pkt, master.service_id, choice.id, &be, pkt.saddr, min, max, now) {
        Ok(p) => p,
        Err(r) => return Some(Step::Drop(r)),
    };
    count_flow::<A>(choice.id);
    Some(Step::Forward {
        dst: (be.addr, be.port),
        src: (pkt.saddr, port),
        route,
        backend_id: choice.id,
        service_id: master.service_id,
        reason: Reason::HostFlowNew,
    })
}

/// The ports a host flow from local port `sport` (network byte order) may be moved to: as
/// nf_nat moves them, a privileged port stays privileged (a server may insist on one, as NFS's
/// `secure` exports do), others go to the SNAT range.
#[inline(always)]
fn ports_for(sport: [u8; 2]) -> (u16, u16) {
    match u16::from_be_bytes(sport) {
        0..512 => (1, 511),
        512..1024 => (600, 1023),
        _ => north::snat_ports(),
    }
}

/// A reply from a pod of this node to the node's address under a SNAT reply entry: a host
/// flow's (its client is the node), translated back and delivered; any other is left as
/// before.
#[inline(always)]
pub fn pod_reply<A: Family>(
    ctx: &TcContext,
    pkt: &Packet<A>,
    mut e: Slot<CtEntry<A>>,
    entry: &CtEntry<A>,
    now: u64,
) -> Result<Verdict, Reason> {
    let rn = select::revnat_of(entry);
    let Some(rn) = rn.filter(|_| entry.flags & flags::SNAT != 0 && entry.nat_addr == pkt.daddr) else {
        return Ok(Verdict::pass(Reason::ReplyIngress));
    };
    if !ct::touch_reply(pkt, &mut e, entry, &ct::snat_forward_key(entry, rn.addr, rn.port, pkt.proto), now) {
        return Ok(Verdict::pass(Reason::ReplyIngress));
    }
    deliver(ctx, pkt, (rn.addr, rn.port), entry.nat_port)
}

/// A host flow's reply, from `src` (the Service) to the process's port `dport`, on up the
/// stack.
#[inline(always)]
pub fn deliver<A: Family>(ctx: &TcContext, pkt: &Packet<A>, src: (A, [u8; 2]), dport: [u8; 2]) -> Result<Verdict, Reason> {
    frag::remember(pkt);
    nat::rewrite(ctx, pkt, Side::Src, src.0, src.1)?;
    nat::rewrite(ctx, pkt, Side::Dst, pkt.daddr, dport)?;
    Ok(Verdict::pass(Reason::HostReply))
}
