//! XDP on external interfaces: north-south flows to backends on other nodes, and their
//! replies, translated and sent back out from the driver (XDP_TX on the same interface,
//! XDP_REDIRECT to another), before the kernel allocates an skb. Everything else is XDP_PASS,
//! for TC and the stack.
//!
//! IPv6 runs in a program of its own, tail-called (`PROGS_XDP_V1`): both families' decisions do
//! not fit one frame together. It takes new flows, tracked ones and their replies, as IPv4's
//! does. (Its frame is 504 of the 512 bytes. TC's external IPv6 program, which also serves
//! trace packets and ICMPv6 errors, stages its new flows into a program of their own.)

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX},
    helpers::bpf_redirect,
    programs::XdpContext,
};
use proxy_common::{csum, Ip6, Reason, IPPROTO_TCP};

use crate::{
    access, ct,
    family::Family,
    flowcache::{self, Lookup},
    maps::PROGS_XDP_V1,
    nat::{TCP_CSUM_OFF, UDP_CSUM_OFF},
    north::{self, Env, Route, Step},
    parse::{self, ptr_at, Frag, Packet, Parsed, IP_OFF, L3},
    value::Slot,
};

pub struct XdpVerdict {
    pub action: u32,
    pub reason: Reason,
}

/// Counts the verdict against the frame and returns its action (the programs' last step).
#[inline(always)]
pub fn finish(ctx: &XdpContext, v: XdpVerdict) -> u32 {
    crate::stats::count(v.reason, (ctx.data_end() - ctx.data()) as u32);
    v.action
}

#[inline(always)]
const fn pass(reason: Reason) -> XdpVerdict {
    XdpVerdict { action: XDP_PASS, reason }
}

/// The interface the frame arrived on.
#[inline(always)]
fn ingress(ctx: &XdpContext) -> u32 {
    // SAFETY: reads a field of our own context.
    unsafe { (*ctx.ctx).ingress_ifindex }
}

/// The step for `pkt`; or, for a packet of a tracked flow whose step XDP's flow cache holds
/// (`flowcache`), the verdict it was sent on with.
#[inline(always)]
fn step<A: XdpFamily>(ctx: &XdpContext, pkt: &Packet<A>) -> Result<Step<A>, XdpVerdict> {
    let mut env = Env { ctx: ctx.ctx as *mut _, ifindex: ingress(ctx), xdp: true, dry: false, cache_under: None };
    let key = ct::key(pkt);
    // A packet of no tracked flow (most of them) is told so by the conntrack filter, before
    // the cache, as the conntrack lookup would be: only a new flow's decision is left.
    let Some(hash) = ct::may_hold(&key) else {
        return Ok(north::new_flow(&env, pkt, ct::now));
    };
    let now = ct::now();
    if flowcache::takes(pkt) {
        match flowcache::lookup_xdp(&key, hash, env.ifindex, now) {
            Lookup::Hit(h) => {
                let addrs = u64::from(u16::from_ne_bytes(h.addrs));
                return Err(forward(ctx, pkt, h.dst, h.src, addrs, &h.route, env.ifindex, h.reason));
            }
            Lookup::Miss { generation } => env.cache_under = Some(generation),
            Lookup::Resting => {}
        }
    } else {
        flowcache::forget_xdp(&key, hash);
    }
    // The filter is read: the entry is looked up directly.
    Ok(north::decide_found(&env, pkt, move || now, false, Slot::of(A::ct(), key)))
}

#[inline(always)]
pub fn try_xdp(ctx: &XdpContext) -> XdpVerdict {
    let pkt = match parse::l3(ctx) {
        L3::V4(Parsed::Packet(p)) => p,
        L3::Other => return pass(Reason::PassNotIpv4),
        L3::V6 => {
            // SAFETY: plain helper call; on success it does not return.
            unsafe { PROGS_XDP_V1.tail_call(ctx, 0) };
            return pass(Reason::PassNoStage);
        }
        _ => return pass(Reason::XdpPass),
    };
    // Fragments need the fragment map and TC's helpers; the TTL check needs the stack.
    if pkt.frag != Frag::Whole || pkt.ttl <= 1 {
        return pass(Reason::XdpPass);
    }
    let step = match step(ctx, &pkt) {
        Ok(step) => step,
        Err(sent) => return sent,
    };
    match step {
        Step::Forward { dst, src, route, reason, .. } => {
            forward(ctx, &pkt, dst, src, addrs_change(pkt.saddr, pkt.daddr, dst.0, src.0), &route, ingress(ctx), reason)
        }
        Step::Pass(reason) => pass(reason),
        // A source outside a load balancer's ranges goes no further than here.
        Step::Drop(Reason::DropSourceRange) => XdpVerdict { action: XDP_DROP, reason: Reason::DropSourceRange },
        _ => pass(Reason::XdpPass),
    }
}

/// IPv6 (a program of its own): new flows, tracked ones, and their replies.
#[inline(always)]
pub fn try_xdp6(ctx: &XdpContext) -> XdpVerdict {
    let pkt = match crate::parse6::ipv6(ctx) {
        Parsed::Packet(p) => p,
        _ => return pass(Reason::XdpPass),
    };
    if pkt.frag != Frag::Whole || pkt.ttl <= 1 {
        return pass(Reason::XdpPass);
    }
    let step = match step(ctx, &pkt) {
        Ok(step) => step,
        Err(sent) => return sent,
    };
    match step {
        Step::Forward { dst, src, route, reason, .. } => {
            forward(ctx, &pkt, dst, src, addrs_change(pkt.saddr, pkt.daddr, dst.0, src.0), &route, ingress(ctx), reason)
        }
        Step::Pass(reason) => pass(reason),
        _ => pass(Reason::XdpPass),
    }
}

/// What rewriting the addresses `saddr` and `daddr` to `src` and `dst` adds to the checksums,
/// summed once for both (a cached step has it summed already: `flowcache::Hit::addrs`).
#[inline(always)]
pub fn addrs_change<A: Family>(saddr: A, daddr: A, dst: A, src: A) -> u64 {
    csum::address_change(saddr, src) + csum::address_change(daddr, dst)
}

/// Rewrites the packet for `Step::Forward` and sends it out by `route`. `addrs`: what the
/// addresses' rewrite adds to the checksums (`addrs_change`).
#[inline(always)]
fn forward<A: XdpFamily>(
    ctx: &XdpContext,
    pkt: &Packet<A>,
    dst: (A, [u8; 2]),
    src: (A, [u8; 2]),
    addrs: u64,
    route: &Route<A>,
    ifindex: u32,
    reason: Reason,
) -> XdpVerdict {
    if A::rewrite(ctx, pkt, dst, src, addrs).is_err() {
        // Half-written: must not reach the stack.
        return XdpVerdict { action: XDP_DROP, reason: Reason::DropRewrite };
    }
    let Some(macs) = ptr_at::<[u8; 12]>(ctx, 0) else {
        return XdpVerdict { action: XDP_DROP, reason: Reason::DropRewrite };
    };
    // SAFETY: bounds checked by ptr_at.
    let macs = unsafe { &mut *macs };
    macs[..6].copy_from_slice(&route.dmac);
    macs[6..].copy_from_slice(&route.smac);
    if route.ifindex == ifindex {
        return XdpVerdict { action: XDP_TX, reason };
    }
    // SAFETY: plain helper call.
    let action = unsafe { bpf_redirect(route.ifindex, 0) } as u32;
    XdpVerdict { action, reason: if action == XDP_REDIRECT { reason } else { Reason::DropNoRoute } }
}

/// A family's header rewrite in XDP: both addresses and ports and one hop less, with the
/// checksums updated by hand (RFC 1624): XDP has no checksum helpers, and frames from the wire
/// carry complete checksums.
trait XdpFamily: Family + csum::Words {
    /// `addrs`: the addresses' change (`csum::address_change`, both of them).
    fn rewrite(ctx: &XdpContext, pkt: &Packet<Self>, dst: (Self, [u8; 2]), src: (Self, [u8; 2]), addrs: u64) -> Result<(), ()>;
}

impl XdpFamily for [u8; 4] {
    /// The IPv4 header is fetched and summed once, and written a field at a time (`access`:
    /// as bytes, each address was four stores and three shifts).
    #[inline(always)]
    fn rewrite(ctx: &XdpContext, pkt: &Packet, dst: ([u8; 4], [u8; 2]), src: ([u8; 4], [u8; 2]), addrs: u64) -> Result<(), ()> {
        let at = ptr_at::<[u8; 20]>(ctx, IP_OFF).ok_or(())? as usize;
        // SAFETY: bounds checked by ptr_at (the 20-byte header).
        unsafe {
            // The TTL and protocol word: one hop less.
            let word = access::load2(at + 8);
            let ttl = [word[0].wrapping_sub(1), word[1]];
            let check = csum::apply(access::load2(at + 10), addrs + csum::word_change(word, ttl));
            access::store2(at + 8, ttl);
            access::store2(at + 10, check);
            access::store4(at + 12, src.0);
            access::store4(at + 16, dst.0);
        }
        rewrite_l4(ctx, pkt, dst, src, addrs)
    }
}

impl XdpFamily for Ip6 {
    /// No header checksum: the addresses and the hop limit are written as they are.
    #[inline(always)]
    fn rewrite(ctx: &XdpContext, pkt: &Packet<Ip6>, dst: (Ip6, [u8; 2]), src: (Ip6, [u8; 2]), addrs: u64) -> Result<(), ()> {
        let ip = ptr_at::<[u8; 40]>(ctx, IP_OFF).ok_or(())?;
        let at = ip as usize;
        // SAFETY: bounds checked by ptr_at (the 40-byte header).
        unsafe {
            *((at + 7) as *mut u8) = (*((at + 7) as *const u8)).wrapping_sub(1);
            for i in 0..4 {
                access::store_word(at + 8 + 4 * i, src.0 .0[i]);
                access::store_word(at + 24 + 4 * i, dst.0 .0[i]);
            }
        }
        rewrite_l4(ctx, pkt, dst, src, addrs)
    }
}

/// Both ports and the L4 checksum over the new pseudo-header (a UDP checksum of zero means
/// "none" and stays so). `addrs`: the addresses' change (`csum::address_change`), summed once
/// for both checksums; the checksum is folded once.
#[inline(always)]
fn rewrite_l4<A: XdpFamily>(ctx: &XdpContext, pkt: &Packet<A>, dst: (A, [u8; 2]), src: (A, [u8; 2]), addrs: u64) -> Result<(), ()> {
    let tcp = pkt.proto == IPPROTO_TCP;
    let l4_off = pkt.l4();
    let off = l4_off + if tcp { TCP_CSUM_OFF } else { UDP_CSUM_OFF };
    let ports = ptr_at::<[u8; 4]>(ctx, l4_off).ok_or(())? as usize;
    let sum = ptr_at::<[u8; 2]>(ctx, off).ok_or(())? as usize;
    // SAFETY: bounds checked by ptr_at.
    unsafe {
        access::store2(ports, src.1);
        access::store2(ports + 2, dst.1);
        let change = addrs + csum::word_change(pkt.sport, src.1) + csum::word_change(pkt.dport, dst.1);
        access::store2(sum, csum::l4_apply(access::load2(sum), change, !tcp));
    }
    Ok(())
}
