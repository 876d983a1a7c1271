//! XDP on external interfaces: north-south flows to backends on other nodes, and their
//! replies, translated and sent back out from the driver (XDP_TX on the same interface,
//! XDP_REDIRECT to another), before the kernel allocates an skb. Everything else is XDP_PASS,
//! for TC and the stack.

use aya_ebpf::{
    bindings::xdp_action::{XDP_PASS, XDP_REDIRECT, XDP_TX},
    helpers::bpf_redirect,
    programs::XdpContext,
};
use proxy_common::{csum, Reason, IPPROTO_TCP};

use crate::{
    ct,
    nat::{TCP_CSUM_OFF, UDP_CSUM_OFF},
    north::{self, Env, Step},
    parse::{self, ptr_at, Frag, Packet, Parsed, IP_OFF},
};

pub struct XdpVerdict {
    pub action: u32,
    pub reason: Reason,
}

#[inline(always)]
const fn pass(reason: Reason) -> XdpVerdict {
    XdpVerdict { action: XDP_PASS, reason }
}

#[inline(always)]
pub fn try_xdp(ctx: &XdpContext) -> XdpVerdict {
    let pkt = match parse::ipv4(ctx) {
        Parsed::Packet(p) => p,
        Parsed::NotIpv4 => return pass(Reason::PassNotIpv4),
        _ => return pass(Reason::XdpPass),
    };
    // Fragments need the fragment map and TC's helpers; the TTL check needs the stack.
    if pkt.frag != Frag::Whole || pkt.ttl <= 1 {
        return pass(Reason::XdpPass);
    }
    // SAFETY: reads a field of our own context.
    let ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    let env = Env { ctx: ctx.ctx as *mut _, ifindex, xdp: true, dry: false };
    match north::decide(&env, &pkt, ct::now()) {
        Step::Forward { dst, src, route, reason, .. } => {
            if rewrite(ctx, &pkt, dst, src).is_err() {
                // Half-written: must not reach the stack.
                return XdpVerdict { action: aya_ebpf::bindings::xdp_action::XDP_DROP, reason: Reason::DropRewrite };
            }
            let Some(macs) = ptr_at::<[u8; 12]>(ctx, 0) else {
                return XdpVerdict { action: aya_ebpf::bindings::xdp_action::XDP_DROP, reason: Reason::DropRewrite };
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
        Step::Pass(reason) => pass(reason),
        // A source outside a load balancer's ranges goes no further than here.
        Step::Drop(Reason::DropSourceRange) => {
            XdpVerdict { action: aya_ebpf::bindings::xdp_action::XDP_DROP, reason: Reason::DropSourceRange }
        }
        _ => pass(Reason::XdpPass),
    }
}

/// Both addresses and ports, and the TTL (the packet is routed here, past the stack), with the
/// IPv4 and L4 checksums updated by hand (RFC 1624): XDP has no checksum helpers, and frames
/// from the wire carry complete checksums. The IPv4 header is fetched and summed once.
#[inline(always)]
fn rewrite(ctx: &XdpContext, pkt: &Packet, dst: ([u8; 4], [u8; 2]), src: ([u8; 4], [u8; 2])) -> Result<(), ()> {
    let ip = ptr_at::<[u8; 20]>(ctx, IP_OFF).ok_or(())?;
    // SAFETY: bounds checked by ptr_at.
    let ip = unsafe { &mut *ip };
    let mut check = csum::update4([ip[10], ip[11]], pkt.saddr, src.0);
    check = csum::update4(check, pkt.daddr, dst.0);
    let ttl = [ip[8].wrapping_sub(1), ip[9]];
    check = csum::update2(check, [ip[8], ip[9]], ttl);
    ip[8] = ttl[0];
    ip[12..16].copy_from_slice(&src.0);
    ip[16..20].copy_from_slice(&dst.0);
    ip[10] = check[0];
    ip[11] = check[1];

    let tcp = pkt.proto == IPPROTO_TCP;
    let off = pkt.l4_off + if tcp { TCP_CSUM_OFF } else { UDP_CSUM_OFF };
    let ports = ptr_at::<[u8; 4]>(ctx, pkt.l4_off).ok_or(())?;
    let sum = ptr_at::<[u8; 2]>(ctx, off).ok_or(())?;
    // SAFETY: bounds checked by ptr_at.
    let (ports, sum) = unsafe { (&mut *ports, &mut *sum) };
    ports[..2].copy_from_slice(&src.1);
    ports[2..].copy_from_slice(&dst.1);
    // A UDP checksum of zero means "none" and stays so.
    if !tcp && *sum == [0, 0] {
        return Ok(());
    }
    let mut c = csum::update4(*sum, pkt.saddr, src.0);
    c = csum::update4(c, pkt.daddr, dst.0);
    c = csum::update2(c, pkt.sport, src.1);
    c = csum::update2(c, pkt.dport, dst.1);
    if !tcp && c == [0, 0] {
        c = [0xff, 0xff];
    }
    *sum = c;
    Ok(())
}
