//! IPv6 header parsing: the fixed header, then its extension headers one by one (RFC 8200 §4)
//! to the upper-layer header. The walk is bounded (`EXT_HEADERS` headers, `EXT_MAX` bytes);
//! a packet beyond the bound, or with ESP or no next header, is passed untouched as
//! `OtherProto`: nothing the parser does not understand is dropped.

use proxy_common::{Ip6, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    access,
    parse::{ptr_at, Frag, Frame, Packet, Parsed, IP_OFF},
};

const IPV6_HDR_LEN: usize = 40;
/// Extension headers walked at most, and the bytes they may take together.
pub const EXT_HEADERS: usize = 6;
pub const EXT_MAX: usize = 256;
const _: () = assert!(crate::parse::IP_OFF + IPV6_HDR_LEN + EXT_MAX < 0x200);

pub const NEXTHDR_HOP: u8 = 0;
pub const NEXTHDR_ROUTING: u8 = 43;
pub const NEXTHDR_FRAGMENT: u8 = 44;
pub const NEXTHDR_AUTH: u8 = 51;
pub const NEXTHDR_DEST: u8 = 60;
pub const IPPROTO_ICMPV6: u8 = 58;

/// Fragment header: offset in 8-byte units (high 13 bits), then the M flag (bit 0).
pub const FRAG_OFFSET_MASK: u16 = 0xfff8;
const FRAG_MORE: u16 = 0x0001;

/// True for the extension headers the walk takes (Hop-by-Hop, Routing, Destination Options,
/// AH, Fragment).
#[inline(always)]
pub fn is_ext_header(next: u8) -> bool {
    matches!(next, NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST | NEXTHDR_AUTH | NEXTHDR_FRAGMENT)
}

/// The length of extension header `next` whose length field is `hdr_len`: a Fragment header's
/// is fixed, AH's is in 4-byte units less 2, the others' in 8-byte units less 1.
#[inline(always)]
pub fn ext_header_len(next: u8, hdr_len: u8) -> usize {
    match next {
        NEXTHDR_FRAGMENT => 8,
        NEXTHDR_AUTH => (usize::from(hdr_len) + 2) * 4,
        _ => (usize::from(hdr_len) + 1) * 8,
    }
}

/// The IPv6 address at `p` (four word loads).
///
/// # Safety
/// `p..p + 16` must be inside the packet's checked range.
#[inline(always)]
unsafe fn load_ip6(p: usize) -> Ip6 {
    // SAFETY: the caller's bounds check.
    unsafe { Ip6([access::load_word(p), access::load_word(p + 4), access::load_word(p + 8), access::load_word(p + 12)]) }
}

/// True when `pkt` (a staged copy) is this frame's packet: its addresses, and where it carries
/// its L4 header, its ports.
#[inline(always)]
pub fn is_staged<F: Frame>(ctx: &F, pkt: &Packet<Ip6>) -> bool {
    let Some(ip) = ptr_at::<[u8; IPV6_HDR_LEN]>(ctx, IP_OFF) else { return false };
    // SAFETY: bounds checked by ptr_at (the 40-byte header).
    let (saddr, daddr) = unsafe { (load_ip6(ip as usize + 8), load_ip6(ip as usize + 24)) };
    if saddr != pkt.saddr || daddr != pkt.daddr {
        return false;
    }
    if !pkt.has_l4() {
        return true;
    }
    let Some(l4) = ptr_at::<[u8; 4]>(ctx, pkt.l4()) else { return false };
    // SAFETY: bounds checked by ptr_at.
    let ports = unsafe { access::load4(l4 as usize) };
    ports == [pkt.sport[0], pkt.sport[1], pkt.dport[0], pkt.dport[1]]
}

/// Parses an IPv6 frame (the caller has seen its ethertype).
#[inline(always)]
pub fn ipv6<F: Frame>(ctx: &F) -> Parsed<Ip6> {
    crate::parse::pull_headers(ctx, crate::parse::HEADERS6_MAX);
    let len = ctx.total_len();
    let Some(ip) = ptr_at::<[u8; IPV6_HDR_LEN]>(ctx, IP_OFF) else {
        return Parsed::Malformed;
    };
    let ip = ip as usize;
    // SAFETY: bounds checked by ptr_at (the 40-byte header), for every read below.
    let (vtc, payload_len, mut next, hop_limit, saddr, daddr) = unsafe {
        (
            *(ip as *const u8),
            u16::from_be_bytes(access::load2(ip + 4)),
            *((ip + 6) as *const u8),
            *((ip + 7) as *const u8),
            load_ip6(ip + 8),
            load_ip6(ip + 24),
        )
    };
    if vtc >> 4 != 6 {
        return Parsed::Malformed;
    }
    // What ipv6_rcv drops (a payload longer than what arrived) is left to it untouched.
    let mut total = IPV6_HDR_LEN as u32 + u32::from(payload_len);
    if payload_len == 0 && len > 0xffff + IP_OFF as u32 {
        // BIG TCP: a GSO packet beyond 64 KiB says 0, and its length is the skb's.
        total = len - IP_OFF as u32;
    }
    if total + IP_OFF as u32 > len {
        return Parsed::Malformed;
    }
    // Beyond 64 KiB the length cannot be carried: 0, which sends such packets to the helpers.
    let tot_len = if total <= 0xffff { (total as u16).to_be_bytes() } else { [0; 2] };

    let mut off = IP_OFF + IPV6_HDR_LEN;
    let mut frag = Frag::Whole;
    let mut ip_id = [0u8; 4];
    for _ in 0..EXT_HEADERS {
        if !is_ext_header(next) {
            break;
        }
        let Some(h) = ptr_at::<[u8; 8]>(ctx, off) else {
            return Parsed::Malformed;
        };
        let h = h as usize;
        // SAFETY: bounds checked by ptr_at (8 bytes: every extension header has at least that).
        let (nh, hdr_len, offset_flags, id) =
            unsafe { (*(h as *const u8), *((h + 1) as *const u8), u16::from_be_bytes(access::load2(h + 2)), access::load4(h + 4)) };
        if next == NEXTHDR_FRAGMENT {
            frag = if offset_flags & FRAG_OFFSET_MASK != 0 {
                Frag::Later
            } else if offset_flags & FRAG_MORE != 0 {
                Frag::First
            } else {
                // An atomic fragment (RFC 6946): the whole datagram.
                Frag::Whole
            };
            ip_id = id;
        } else if next == NEXTHDR_ROUTING && (offset_flags & 0xff) != 0 {
            // A Routing header with segments left: the destination is a hop on the way, not
            // the packet's final one (which the L4 checksum covers), so no Service's.
            return Parsed::OtherProto { daddr };
        }
        off += ext_header_len(next, hdr_len);
        next = nh;
        if off > IP_OFF + IPV6_HDR_LEN + EXT_MAX {
            return Parsed::OtherProto { daddr };
        }
        // What follows a later fragment's Fragment header is payload, not headers.
        if frag == Frag::Later {
            break;
        }
    }
    if off as u32 > IP_OFF as u32 + total {
        return Parsed::Malformed;
    }
    if next == IPPROTO_ICMPV6 && frag != Frag::Later {
        return Parsed::Icmp { l4_off: off, saddr, daddr, tot_len };
    }
    if next != IPPROTO_TCP && next != IPPROTO_UDP {
        // Also ESP, no next header (59), and headers beyond the walk's bound.
        return Parsed::OtherProto { daddr };
    }
    let mut pkt =
        Packet { l4_off: off, proto: next, saddr, daddr, sport: [0; 2], dport: [0; 2], tcp_flags: 0, ip_id, tot_len, ttl: hop_limit, frag };
    if frag == Frag::Later {
        return Parsed::Packet(pkt);
    }
    if !crate::parse::ports(ctx, &mut pkt, total) {
        return Parsed::Malformed;
    }
    Parsed::Packet(pkt)
}
