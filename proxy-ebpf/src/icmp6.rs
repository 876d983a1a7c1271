//! ICMPv6 port unreachable for IPv6 Services without endpoints (what kube-proxy's ip6tables
//! REJECT sends: type 1, code 4), built in place of the packet as `icmp` does for IPv4; and
//! ICMPv6 errors about translated flows rewritten on their way to the client, as nf_nat does
//! for RELATED packets. Packet Too Big matters most: routers do not fragment IPv6, so a PTB the
//! client cannot match to its connection (it names the backend, which the client never
//! talked to) stalls the connection for good instead of lowering its path MTU.

use aya_ebpf::{
    bindings::{BPF_F_INGRESS, BPF_F_MARK_MANGLED_0},
    helpers::bpf_csum_diff,
    programs::TcContext,
};
use proxy_common::{csum, ct::flags, CtKey, Ip6, Reason, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    access,
    family::Family,
    icmp::{self, ICMP_HDR_LEN},
    parse::{ptr_at, Packet, IP_OFF},
    parse6::IPPROTO_ICMPV6,
    select::revnat_of,
    verdict::Verdict,
};

const IPV6_HDR_LEN: usize = 40;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;

/// ICMPv6 errors (RFC 4443 §2.1: types below 128) that quote the offending packet.
const ICMPV6_ERRORS: [u8; 4] = [1, 2, 3, 4];
const ICMPV6_ECHO_REQUEST: u8 = 128;

/// Turns the packet into an ICMPv6 port unreachable from its destination (the Service address)
/// back to its sender, and sends it out the interface it came in on, counted under `reason`.
#[inline(always)]
pub fn reject(ctx: &TcContext, pkt: &Packet<Ip6>, reason: Reason) -> Result<Verdict, Reason> {
    reject_to(ctx, pkt, 0, reason)
}

/// The same for a packet about to leave the node (TC egress): the answer is received on the
/// interface instead, as if the destination had sent it, and routed back to the sender.
#[inline(always)]
pub fn reject_leaving(ctx: &TcContext, pkt: &Packet<Ip6>, reason: Reason) -> Result<Verdict, Reason> {
    reject_to(ctx, pkt, u64::from(BPF_F_INGRESS), reason)
}

#[inline(always)]
fn reject_to(ctx: &TcContext, pkt: &Packet<Ip6>, redirect_flags: u64, reason: Reason) -> Result<Verdict, Reason> {
    let quote_len = icmp::quote_len(ctx, pkt.tot_len, pkt.l4(), IPV6_HDR_LEN)?;
    let sum = icmp::quote(ctx, quote_len, ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH)?;
    // The checksum covers the pseudo-header too (RFC 4443 §2.3): from the Service to the sender.
    let payload_len = (ICMP_HDR_LEN + quote_len) as u16;
    let pseudo = u64::from(u16::from_ne_bytes(csum::pseudo_header(pkt.daddr, pkt.saddr, IPPROTO_ICMPV6, payload_len)));
    let icmp_csum = (!csum::fold(sum + pseudo)).to_ne_bytes();
    let mut ip = [0u8; IPV6_HDR_LEN];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&payload_len.to_be_bytes());
    ip[6] = IPPROTO_ICMPV6;
    ip[7] = 64; // hop limit
    ip[8..24].copy_from_slice(&pkt.daddr.to_bytes());
    ip[24..40].copy_from_slice(&pkt.saddr.to_bytes());
    let icmp_hdr = [ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, icmp_csum[0], icmp_csum[1], 0, 0, 0, 0];
    icmp::send_in_place(ctx, quote_len, &ip, icmp_hdr, redirect_flags, reason)
}

/// The ICMPv6 message type at `l4_off`, if the packet holds its header.
#[inline(always)]
pub fn kind(ctx: &TcContext, l4_off: usize) -> Option<u8> {
    // SAFETY: bounds checked by ptr_at (the first 4 bytes: see `icmp::is_query`).
    ptr_at::<[u8; 4]>(ctx, Ip6::bound_offset(l4_off)).map(|h| unsafe { (*h)[0] })
}

/// True for an echo request (a ping): the one ICMPv6 message that opens an exchange with an
/// address (neighbour discovery and multicast listener messages are the link's business).
#[inline(always)]
pub fn is_echo_request(kind: Option<u8>) -> bool {
    kind == Some(ICMPV6_ECHO_REQUEST)
}

#[inline(always)]
pub fn is_error(kind: Option<u8>) -> bool {
    kind.is_some_and(|k| ICMPV6_ERRORS.contains(&k))
}

/// The checksum update for address `old` becoming `new` under the checksum at `csum_off`
/// (`flags`: the helper's, without a size: the update is a difference).
#[inline(always)]
fn fold_address(ctx: &TcContext, csum_off: usize, old: Ip6, new: Ip6, flags: u64) -> Result<(), Reason> {
    let (mut old, mut new) = (old.0, new.0);
    // SAFETY: two 16-byte stack buffers, sizes multiples of 4.
    let diff = unsafe { bpf_csum_diff(old.as_mut_ptr(), 16, new.as_mut_ptr(), 16, 0) };
    if diff < 0 {
        return Err(Reason::DropRewrite);
    }
    ctx.l4_csum_replace(csum_off, 0, diff as u64, flags).map_err(|_| Reason::DropRewrite)
}

/// The upper-layer protocol (TCP or UDP) of a quoted packet whose first header after the IPv6
/// one is `next` at `off`, and that header's offset: past Hop-by-Hop, Routing, Destination
/// Options and AH headers, and a Fragment header of a first fragment (a later one quotes no
/// ports), as many as the parser walks. None for anything else. (Read through the helper: the
/// offsets depend on the quote.)
#[inline(always)]
fn quoted_upper_layer(ctx: &TcContext, mut off: usize, mut next: u8) -> Option<(u8, usize)> {
    use crate::parse6::{EXT_HEADERS, FRAG_OFFSET_MASK, NEXTHDR_AUTH, NEXTHDR_DEST, NEXTHDR_FRAGMENT, NEXTHDR_HOP, NEXTHDR_ROUTING};
    for _ in 0..EXT_HEADERS {
        if next == IPPROTO_TCP || next == IPPROTO_UDP {
            return Some((next, off));
        }
        if !matches!(next, NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST | NEXTHDR_AUTH | NEXTHDR_FRAGMENT) {
            return None;
        }
        let h: [u8; 4] = ctx.load(off).ok()?;
        if next == NEXTHDR_FRAGMENT {
            if u16::from_be_bytes([h[2], h[3]]) & FRAG_OFFSET_MASK != 0 {
                return None;
            }
            off += 8;
        } else if next == NEXTHDR_AUTH {
            // AH's length is in 4-byte units, less 2.
            off += (usize::from(h[1]) + 2) * 4;
        } else {
            off += (usize::from(h[1]) + 1) * 8;
        }
        next = h[0];
    }
    (next == IPPROTO_TCP || next == IPPROTO_UDP).then_some((next, off))
}

/// Rewrites an ICMPv6 error (destination unreachable, packet too big, time exceeded, parameter
/// problem) leaving towards a client about a packet that client sent to a Service: the quoted
/// packet went client -> backend, the client knows it as client -> Service. The quoted
/// destination (address, port, the quoted UDP checksum) becomes the Service's, the quoted
/// source port the client's own where the flow moved it, and when the backend itself sent the
/// error, so does the outer source; the ICMPv6 checksum (which covers the pseudo-header and
/// the quote) follows every change. Extension headers in the quote are walked to its
/// upper-layer header (a Packet Too Big about a fragmented UDP datagram quotes its first
/// fragment, Fragment header and all); a quote of a later fragment carries no ports and is
/// passed as it is.
#[inline(always)]
pub fn translate_error(ctx: &TcContext, l4_off: usize, outer_saddr: Ip6) -> Result<Verdict, Reason> {
    let l4_off = Ip6::bound_offset(l4_off);
    let inner_off = l4_off + ICMP_HDR_LEN;
    // The quoted IPv6 header.
    let Some(inner) = ptr_at::<[u8; 40]>(ctx, inner_off) else {
        return Ok(Verdict::pass(Reason::EgressPass));
    };
    let inner = inner as usize;
    // SAFETY: bounds checked by ptr_at (40 bytes), for every read below.
    let (first_next, src, dst) = unsafe {
        (
            *((inner + 6) as *const u8),
            Ip6([
                access::load_word(inner + 8),
                access::load_word(inner + 12),
                access::load_word(inner + 16),
                access::load_word(inner + 20),
            ]),
            Ip6([
                access::load_word(inner + 24),
                access::load_word(inner + 28),
                access::load_word(inner + 32),
                access::load_word(inner + 36),
            ]),
        )
    };
    let Some((next, l4)) = quoted_upper_layer(ctx, inner_off + 40, first_next) else {
        return Ok(Verdict::pass(Reason::EgressPass));
    };
    // The quote, up to the upper-layer header's first 8 bytes (ports; UDP's checksum), must lie
    // within the outer packet's payload (bytes past it are not the message's: the ICMPv6
    // checksum does not cover them).
    let payload_len: [u8; 2] = ctx.load(IP_OFF + 4).map_err(|_| Reason::DropRewrite)?;
    if l4 + 8 > IP_OFF + 40 + usize::from(u16::from_be_bytes(payload_len)) {
        return Ok(Verdict::pass(Reason::EgressPass));
    }
    let head: [u8; 8] = ctx.load(l4).map_err(|_| Reason::DropRewrite)?;
    let (sport, dport, udp_check) = ([head[0], head[1]], [head[2], head[3]], [head[6], head[7]]);
    let reply_key = CtKey { saddr: dst, daddr: src, sport: dport, dport: sport, proto: next, _pad: 0, _pad2: 0 };
    let Some(e) = crate::value::Slot::of(Ip6::ct(), &reply_key) else {
        return Ok(Verdict::pass(Reason::EgressPass));
    };
    // Read field by field (not copied whole: the stack is short).
    let (entry_flags, snat_port) = e.read(|e| (e.flags, e.snat_port));
    if entry_flags & flags::REPLY == 0 {
        return Ok(Verdict::pass(Reason::EgressPass));
    }
    let Some(rn) = e.read(revnat_of) else {
        return Ok(Verdict::pass(Reason::EgressPass));
    };
    let fail = |_| Reason::DropRewrite;
    let icmp_csum = l4_off + 2;
    let word2 = |b: [u8; 2]| u64::from(u16::from_ne_bytes(b));

    // Quoted destination address: every quoted byte that changes is folded into the ICMPv6
    // checksum as a change of the message (not of the pseudo-header).
    ctx.store(inner_off + 24, &rn.addr, 0).map_err(fail)?;
    fold_address(ctx, icmp_csum, dst, rn.addr, 0)?;
    // Quoted destination port.
    ctx.store(l4 + 2, &rn.port, 0).map_err(fail)?;
    ctx.l4_csum_replace(icmp_csum, word2(dport), word2(rn.port), 2).map_err(fail)?;
    // Quoted source port, when the flow's client port was moved (`PORT_NAT`).
    let moved = entry_flags & flags::PORT_NAT != 0;
    if moved {
        ctx.store(l4, &snat_port, 0).map_err(fail)?;
        ctx.l4_csum_replace(icmp_csum, word2(sport), word2(snat_port), 2).map_err(fail)?;
    }
    // The quoted UDP checksum (inside the 8 quoted bytes; TCP's is not) follows the new
    // destination, as nf_nat keeps it.
    if next == IPPROTO_UDP && udp_check != [0; 2] {
        let mangled = u64::from(BPF_F_MARK_MANGLED_0);
        let udp_csum = l4 + 6;
        fold_address(ctx, udp_csum, dst, rn.addr, mangled)?;
        ctx.l4_csum_replace(udp_csum, word2(dport), word2(rn.port), mangled | 2).map_err(fail)?;
        if moved {
            ctx.l4_csum_replace(udp_csum, word2(sport), word2(snat_port), mangled | 2).map_err(fail)?;
        }
        let new_udp: [u8; 2] = ctx.load(udp_csum).map_err(fail)?;
        ctx.l4_csum_replace(icmp_csum, word2(udp_check), word2(new_udp), 2).map_err(fail)?;
    }
    // Sent by the backend itself: it must appear to come from the Service. The outer source is
    // in the ICMPv6 pseudo-header.
    if outer_saddr == dst {
        Ip6::store_address(ctx, Ip6::SRC_OFF, outer_saddr, rn.addr)?;
        Ip6::l4_address_helper(ctx, icmp_csum, 0, outer_saddr, rn.addr)?;
    }
    Ok(Verdict::pass(Reason::IcmpErrorNat))
}
