//! ICMP: port unreachable for services without endpoints (what kube-proxy's REJECT rule sends,
//! so clients fail at once with "connection refused" instead of timing out), and the reading of
//! ICMP errors' quotes, which `icmp_nat` translates.

use aya_ebpf::{
    bindings::{bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, TC_ACT_REDIRECT},
    helpers::{bpf_csum_diff, bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes},
    programs::TcContext,
};
use network_types::ip::Ipv4Hdr;
use proxy_common::{csum, Reason, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    icmp_nat::Quote,
    parse::{ptr_at, Packet, ETH_LEN, IP_OFF, IP_OFFSET_MASK},
    verdict::Verdict,
};

const IP_HDR_LEN: usize = 20;
pub const ICMP_HDR_LEN: usize = 8;
/// How much of the offending datagram is quoted. RFC 792 asks for the IP header and 8 bytes;
/// RFC 1812 asks for as much as fits, and Linux quotes up to 548. 128 bytes always holds the
/// IP and L4 headers whole, which matters: for a CHECKSUM_PARTIAL skb the kernel refuses to cut
/// a packet before the L4 checksum field.
const QUOTE_MAX: usize = 128;
/// The longest message `reject` builds: ICMP header and quote (IPv4's and ICMPv6's alike).
pub const MESSAGE_MAX: usize = ICMP_HDR_LEN + QUOTE_MAX;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;

/// A message buffer (see `maps::ICMP_SCRATCH`), with room for the checksum's rounding up to
/// whole words, which the verifier bounds less tightly than the arithmetic does.
#[repr(C)]
pub struct Message {
    pub bytes: [u8; MESSAGE_MAX + 4],
}

/// True for an ICMP message that opens an exchange (echo, timestamp, information and address
/// mask requests: what conntrack counts as new), as opposed to an error about another packet.
#[inline(always)]
pub fn is_query<F: crate::parse::Frame>(ctx: &F, l4_off: usize) -> bool {
    // SAFETY: bounds checked by ptr_at (the first 4 bytes of the header: a one-byte check
    // compiles to a form the verifier does not take as a bound).
    ptr_at::<[u8; 4]>(ctx, l4_off).is_some_and(|h| matches!(unsafe { (*h)[0] }, 8 | 13 | 15 | 17))
}

/// An ICMP (ICMPv6: `proto`) query as a `Packet`, for `reject` (it quotes the message; there
/// are no ports).
#[inline(always)]
pub fn query_packet<A: crate::family::Family>(l4_off: usize, proto: u8, saddr: A, daddr: A, tot_len: [u8; 2]) -> Packet<A> {
    Packet {
        l4_off,
        proto,
        saddr,
        daddr,
        sport: [0; 2],
        dport: [0; 2],
        tcp_flags: 0,
        ip_id: Default::default(),
        tot_len,
        ttl: 0,
        frag: crate::parse::Frag::Whole,
    }
}

/// Turns the packet into an ICMP port unreachable from the service address back to the sender,
/// and sends it out the interface it came in on, counted under `reason`.
#[inline(always)]
pub fn reject(ctx: &TcContext, pkt: &Packet, reason: Reason) -> Result<Verdict, Reason> {
    reject_to(ctx, pkt, 0, reason)
}

/// The same for a packet about to leave the node (TC egress): the answer is received on the
/// interface instead, as if the destination had sent it, and routed back to the sender.
#[inline(always)]
pub fn reject_leaving(ctx: &TcContext, pkt: &Packet, reason: Reason) -> Result<Verdict, Reason> {
    reject_to(ctx, pkt, u64::from(aya_ebpf::bindings::BPF_F_INGRESS), reason)
}

#[inline(always)]
fn reject_to(ctx: &TcContext, pkt: &Packet, redirect_flags: u64, reason: Reason) -> Result<Verdict, Reason> {
    let quote_len = quote_len(ctx, pkt.tot_len, pkt.l4_off, IP_HDR_LEN)?;
    let sum = quote(ctx, quote_len, ICMP_DEST_UNREACH, ICMP_PORT_UNREACH)?;
    // bpf_csum_diff sums memory in host order; the folded value is stored back the same way.
    let icmp_csum = (!csum::fold(sum)).to_ne_bytes();
    let mut ip = [0u8; IP_HDR_LEN];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((IP_HDR_LEN + ICMP_HDR_LEN + quote_len) as u16).to_be_bytes());
    ip[8] = 64; // TTL
    ip[9] = IPPROTO_ICMP;
    ip[12..16].copy_from_slice(&pkt.daddr);
    ip[16..20].copy_from_slice(&pkt.saddr);
    let ip_csum = csum::ipv4_header(&ip);
    ip[10] = ip_csum[0];
    ip[11] = ip_csum[1];
    let icmp_hdr = [ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, icmp_csum[0], icmp_csum[1], 0, 0, 0, 0];
    send_in_place(ctx, quote_len, &ip, icmp_hdr, redirect_flags, reason)
}

/// How much of the offending packet an ICMP (ICMPv6) error quotes: the packet as its IP header
/// sizes it (`tot_len`: a frame may carry Ethernet padding after it; 0 for one too long to say),
/// at most QUOTE_MAX bytes, and at least its headers up to the ports (`l4_off` + 8, and the
/// family's `ip_hdr_len` + 8, the bound in a form the verifier tracks).
#[inline(always)]
pub fn quote_len(ctx: &TcContext, tot_len: [u8; 2], l4_off: usize, ip_hdr_len: usize) -> Result<usize, Reason> {
    let frame_ip_len = (ctx.len() as usize).saturating_sub(ETH_LEN);
    let tot = usize::from(u16::from_be_bytes(tot_len));
    let ip_len = if tot != 0 && tot < frame_ip_len { tot } else { frame_ip_len };
    let quote_len = if ip_len < QUOTE_MAX { ip_len } else { QUOTE_MAX };
    if quote_len < l4_off - IP_OFF + 8 || quote_len < ip_hdr_len + 8 {
        return Err(Reason::DropRejectFailed);
    }
    Ok(quote_len)
}

/// Builds an ICMP (ICMPv6) message of `kind`/`code` quoting the packet's first `quote_len`
/// bytes in this CPU's message buffer, and returns the sum of the message (`bpf_csum_diff`'s,
/// in host order; the caller adds IPv6's pseudo-header and folds).
#[inline(always)]
pub fn quote(ctx: &TcContext, quote_len: usize, kind: u8, code: u8) -> Result<u64, Reason> {
    // ICMP header followed by the quote (zero-padded to a multiple of 4 for bpf_csum_diff;
    // zero padding does not change a one's-complement sum), so one pass covers the message. In
    // a per-CPU buffer: the stack has no room for it beside the flow's state.
    // SAFETY: taken once per message; only the TC programs use it.
    let msg = &mut unsafe { crate::value::per_cpu(&crate::maps::ICMP_SCRATCH, 0) }.ok_or(Reason::DropRejectFailed)?.bytes;
    *msg = [0; MESSAGE_MAX + 4];
    msg[0] = kind;
    msg[1] = code;
    // SAFETY: `msg` has room for QUOTE_MAX bytes after the header and quote_len <= QUOTE_MAX.
    let rc = unsafe {
        bpf_skb_load_bytes(ctx.skb.skb as *const _, IP_OFF as u32, msg.as_mut_ptr().add(ICMP_HDR_LEN) as *mut _, quote_len as u32)
    };
    if rc != 0 {
        return Err(Reason::DropRejectFailed);
    }
    let sum_len = ((ICMP_HDR_LEN + quote_len + 3) & !3) as u32;
    // SAFETY: reads sum_len <= size_of_val(msg) bytes of the buffer.
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, msg.as_mut_ptr() as *mut _, sum_len, 0) };
    if sum < 0 {
        return Err(Reason::DropRejectFailed);
    }
    Ok(sum as u64)
}

/// Turns the packet into the message: cut to Ethernet + quote, room opened for the new IP
/// header `ip` and the ICMP header `icmp_hdr` between the Ethernet header and the quote, the
/// MAC addresses swapped, and sent out the interface it came in on (`redirect_flags`:
/// BPF_F_INGRESS to be received there instead).
#[inline(always)]
pub fn send_in_place<const IP_LEN: usize>(
    ctx: &TcContext,
    quote_len: usize,
    ip: &[u8; IP_LEN],
    icmp_hdr: [u8; ICMP_HDR_LEN],
    redirect_flags: u64,
    reason: Reason,
) -> Result<Verdict, Reason> {
    let fail = |_| Reason::DropRejectFailed;
    let macs: [u8; 12] = ctx.load(0).map_err(fail)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    if ETH_LEN + quote_len < ctx.len() as usize {
        // SAFETY: plain helper call on our own skb.
        if unsafe { bpf_skb_change_tail(ctx.skb.skb, (ETH_LEN + quote_len) as u32, 0) } != 0 {
            return Err(Reason::DropRejectFailed);
        }
    }
    ctx.adjust_room((IP_LEN + ICMP_HDR_LEN) as i32, BPF_ADJ_ROOM_MAC, 0).map_err(fail)?;
    ctx.store(0, &swapped, 0).map_err(fail)?;
    ctx.store(IP_OFF, ip, 0).map_err(fail)?;
    ctx.store(IP_OFF + IP_LEN, &icmp_hdr, 0).map_err(fail)?;
    // SAFETY: reads the ifindex field of our own context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper call.
    let action = unsafe { bpf_redirect(ifindex, redirect_flags) } as i32;
    if action != TC_ACT_REDIRECT {
        return Err(Reason::DropRejectFailed);
    }
    Ok(Verdict { action, reason })
}

/// The quote of the ICMP error at `l4_off` (destination unreachable, time exceeded, parameter
/// problem), if it quotes a TCP or UDP packet, not a later fragment, with its ports within the
/// message (bytes past the outer packet's total length are a trailer the ICMP checksum does not
/// cover; the parser has checked that length against the frame).
#[inline(always)]
pub fn read_quote(ctx: &TcContext, l4_off: usize) -> Option<Quote<[u8; 4]>> {
    let hdr = ptr_at::<[u8; 4]>(ctx, l4_off)?;
    // SAFETY: bounds checked by ptr_at.
    let kind = unsafe { (*hdr)[0] };
    if kind != ICMP_DEST_UNREACH && kind != ICMP_TIME_EXCEEDED && kind != ICMP_PARAMETERPROB {
        return None;
    }
    let inner_off = l4_off + ICMP_HDR_LEN;
    // SAFETY: bounds checked by ptr_at; copied before any rewrite invalidates the pointer.
    let inner = unsafe { *ptr_at::<Ipv4Hdr>(ctx, inner_off)? };
    let inner_ihl = usize::from(inner.vihl & 0x0f) * 4;
    let later_fragment = u16::from_be_bytes(inner.frags) & IP_OFFSET_MASK != 0;
    if inner_ihl < IP_HDR_LEN || (inner.proto != IPPROTO_TCP && inner.proto != IPPROTO_UDP) || later_fragment {
        return None;
    }
    let l4 = inner_off + inner_ihl;
    let outer_len: [u8; 2] = ctx.load(IP_OFF + 2).ok()?;
    if l4 + 8 > IP_OFF + usize::from(u16::from_be_bytes(outer_len)) {
        return None;
    }
    // SAFETY: bounds checked by ptr_at.
    let h = unsafe { *ptr_at::<[u8; 8]>(ctx, l4)? };
    Some(Quote {
        icmp_csum: l4_off + 2,
        ip: inner_off,
        l4,
        proto: inner.proto,
        saddr: inner.src_addr,
        daddr: inner.dst_addr,
        sport: [h[0], h[1]],
        dport: [h[2], h[3]],
        udp_check: [h[6], h[7]],
    })
}
