//! ICMPv6 port unreachable for IPv6 Services without endpoints (what kube-proxy's ip6tables
//! REJECT sends: type 1, code 4), built in place of the packet as `icmp` does for IPv4; and the
//! reading of ICMPv6 errors' quotes, which `icmp_nat` translates.

use aya_ebpf::{bindings::BPF_F_INGRESS, programs::TcContext};
use proxy_common::{csum, Ip6, Reason, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    access,
    family::Family,
    icmp::{self, ICMP_HDR_LEN},
    icmp_nat::Quote,
    parse::{ptr_at, Packet, IP_OFF},
    parse6::IPPROTO_ICMPV6,
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

/// The upper-layer protocol (TCP or UDP) of a quoted packet whose first header after the IPv6
/// one is `next` at `off`, and that header's offset: past Hop-by-Hop, Routing, Destination
/// Options and AH headers, and a Fragment header of a first fragment (a later one quotes no
/// ports), as many as the parser walks. None for anything else. (Read through the helper: the
/// offsets depend on the quote.)
#[inline(always)]
fn quoted_upper_layer(ctx: &TcContext, mut off: usize, mut next: u8) -> Option<(u8, usize)> {
    use crate::parse6::{ext_header_len, is_ext_header, EXT_HEADERS, FRAG_OFFSET_MASK, NEXTHDR_FRAGMENT};
    for _ in 0..EXT_HEADERS {
        if next == IPPROTO_TCP || next == IPPROTO_UDP {
            return Some((next, off));
        }
        if !is_ext_header(next) {
            return None;
        }
        let h: [u8; 4] = ctx.load(off).ok()?;
        if next == NEXTHDR_FRAGMENT && u16::from_be_bytes([h[2], h[3]]) & FRAG_OFFSET_MASK != 0 {
            return None;
        }
        off += ext_header_len(next, h[1]);
        next = h[0];
    }
    (next == IPPROTO_TCP || next == IPPROTO_UDP).then_some((next, off))
}

/// The quote of the ICMPv6 error at `l4_off` (destination unreachable, packet too big, time
/// exceeded, parameter problem), if it quotes a TCP or UDP packet with its ports within the
/// message (bytes past the outer payload length are not the message's: the ICMPv6 checksum
/// does not cover them). Extension headers in the quote are walked to its upper-layer header (a
/// Packet Too Big about a fragmented UDP datagram quotes its first fragment, Fragment header
/// and all); a quote of a later fragment carries no ports.
#[inline(always)]
pub fn read_quote(ctx: &TcContext, l4_off: usize) -> Option<Quote<Ip6>> {
    let l4_off = Ip6::bound_offset(l4_off);
    if !is_error(kind(ctx, l4_off)) {
        return None;
    }
    let inner_off = l4_off + ICMP_HDR_LEN;
    // The quoted IPv6 header.
    let inner = ptr_at::<[u8; 40]>(ctx, inner_off)? as usize;
    // SAFETY: bounds checked by ptr_at (40 bytes), for every read below.
    let (first_next, saddr, daddr) = unsafe {
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
    let (proto, l4) = quoted_upper_layer(ctx, inner_off + 40, first_next)?;
    let payload_len: [u8; 2] = ctx.load(IP_OFF + 4).ok()?;
    if l4 + 8 > IP_OFF + 40 + usize::from(u16::from_be_bytes(payload_len)) {
        return None;
    }
    let h: [u8; 8] = ctx.load(l4).ok()?;
    Some(Quote {
        icmp_csum: l4_off + 2,
        ip: inner_off,
        l4,
        proto,
        saddr,
        daddr,
        sport: [h[0], h[1]],
        dport: [h[2], h[3]],
        udp_check: [h[6], h[7]],
    })
}
