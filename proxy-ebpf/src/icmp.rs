//! ICMP: port unreachable for services without endpoints (what kube-proxy's REJECT rule sends,
//! so clients fail at once with "connection refused" instead of timing out), and ICMP errors
//! about translated flows rewritten on their way to the client, as nf_nat does for RELATED
//! packets: a UDP client then sees ECONNREFUSED when the backend has no listener, and TCP path
//! MTU discovery works through a service.

use aya_ebpf::{
    bindings::{bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, BPF_F_MARK_MANGLED_0, TC_ACT_REDIRECT},
    helpers::{bpf_csum_diff, bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes},
    programs::TcContext,
};
use network_types::ip::Ipv4Hdr;
use proxy_common::{csum, ct::flags, CtKey, Reason, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    maps::CT4_V2,
    parse::{ptr_at, Packet, ETH_LEN, IP_OFF},
    select::revnat_of,
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
const IP_CSUM_OFF: usize = IP_OFF + 10;
const IP_SRC_OFF: usize = IP_OFF + 12;

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

/// Rewrites an ICMP error leaving towards a client about a packet that client sent to a service:
/// the quoted packet went client -> backend, the client knows it as client -> service. The
/// quoted destination (address, port, and the quoted checksums) becomes the service's, and when
/// the backend itself sent the error, so does the outer source.
#[inline(always)]
pub fn translate_error(ctx: &TcContext, l4_off: usize, outer_saddr: [u8; 4]) -> Result<Verdict, Reason> {
    let Some(hdr) = ptr_at::<[u8; 4]>(ctx, l4_off) else {
        return Ok(Verdict::pass(Reason::PassMalformed));
    };
    // SAFETY: bounds checked by ptr_at.
    let kind = unsafe { (*hdr)[0] };
    if kind != ICMP_DEST_UNREACH && kind != ICMP_TIME_EXCEEDED && kind != ICMP_PARAMETERPROB {
        return Ok(Verdict::pass(Reason::EgressPass));
    }
    let inner_off = l4_off + ICMP_HDR_LEN;
    let Some(inner) = ptr_at::<Ipv4Hdr>(ctx, inner_off) else {
        return Ok(Verdict::pass(Reason::EgressPass));
    };
    // SAFETY: bounds checked by ptr_at; copied before any rewrite invalidates the pointer.
    let inner = unsafe { *inner };
    let inner_ihl = usize::from(inner.vihl & 0x0f) * 4;
    if inner_ihl < IP_HDR_LEN || (inner.proto != IPPROTO_TCP && inner.proto != IPPROTO_UDP) {
        return Ok(Verdict::pass(Reason::EgressPass));
    }
    let inner_l4 = inner_off + inner_ihl;
    // The quote must hold the inner header and 8 bytes of ports and checksum within the
    // outer packet's total length (bytes past it are a trailer the ICMP checksum does not
    // cover; the parser has checked that length against the frame).
    let outer_len: [u8; 2] = ctx.load(IP_OFF + 2).map_err(|_| Reason::DropRewrite)?;
    if inner_l4 + 8 > IP_OFF + usize::from(u16::from_be_bytes(outer_len)) {
        return Ok(Verdict::pass(Reason::EgressPass));
    }
    let Some(l4) = ptr_at::<[u8; 8]>(ctx, inner_l4) else {
        return Ok(Verdict::pass(Reason::EgressPass));
    };
    // SAFETY: bounds checked by ptr_at.
    let l4 = unsafe { *l4 };
    let (sport, dport) = ([l4[0], l4[1]], [l4[2], l4[3]]);
    let reply_key =
        CtKey { saddr: inner.dst_addr, daddr: inner.src_addr, sport: dport, dport: sport, proto: inner.proto, _pad: 0, _pad2: 0 };
    let Some(entry) = crate::value::copy(&CT4_V2, &reply_key) else {
        return Ok(Verdict::pass(Reason::EgressPass));
    };
    if entry.flags & flags::REPLY == 0 {
        return Ok(Verdict::pass(Reason::EgressPass));
    }
    let Some(rn) = revnat_of(&entry) else {
        return Ok(Verdict::pass(Reason::EgressPass));
    };
    let fail = |_| Reason::DropRewrite;
    let icmp_csum = l4_off + 2;
    let word4 = |b: [u8; 4]| u64::from(u32::from_ne_bytes(b));
    let word2 = |b: [u8; 2]| u64::from(u16::from_ne_bytes(b));

    // Quoted destination address, and the quoted IP header checksum that covers it. Every
    // quoted byte that changes is also folded into the ICMP checksum.
    ctx.store(inner_off + 16, &rn.addr, 0).map_err(fail)?;
    ctx.l4_csum_replace(icmp_csum, word4(inner.dst_addr), word4(rn.addr), 4).map_err(fail)?;
    ctx.l3_csum_replace(inner_off + 10, word4(inner.dst_addr), word4(rn.addr), 4).map_err(fail)?;
    let new_check: [u8; 2] = ctx.load(inner_off + 10).map_err(fail)?;
    ctx.l4_csum_replace(icmp_csum, word2(inner.check), word2(new_check), 2).map_err(fail)?;

    // Quoted destination port.
    ctx.store(inner_l4 + 2, &rn.port, 0).map_err(fail)?;
    ctx.l4_csum_replace(icmp_csum, word2(dport), word2(rn.port), 2).map_err(fail)?;

    // Quoted source port, when the flow's client port was moved (`PORT_NAT`).
    let moved = entry.flags & flags::PORT_NAT != 0;
    if moved {
        ctx.store(inner_l4, &entry.snat_port, 0).map_err(fail)?;
        ctx.l4_csum_replace(icmp_csum, word2(sport), word2(entry.snat_port), 2).map_err(fail)?;
    }

    // The quoted UDP checksum (inside the 8 quoted bytes; TCP's is not) follows the new
    // destination, as nf_nat keeps it.
    if inner.proto == IPPROTO_UDP && (l4[6] != 0 || l4[7] != 0) {
        let mangled = u64::from(BPF_F_MARK_MANGLED_0);
        let udp_csum = inner_l4 + 6;
        ctx.l4_csum_replace(udp_csum, word4(inner.dst_addr), word4(rn.addr), mangled | 4).map_err(fail)?;
        ctx.l4_csum_replace(udp_csum, word2(dport), word2(rn.port), mangled | 2).map_err(fail)?;
        if moved {
            ctx.l4_csum_replace(udp_csum, word2(sport), word2(entry.snat_port), mangled | 2).map_err(fail)?;
        }
        let new_udp: [u8; 2] = ctx.load(udp_csum).map_err(fail)?;
        ctx.l4_csum_replace(icmp_csum, word2([l4[6], l4[7]]), word2(new_udp), 2).map_err(fail)?;
    }

    // Sent by the backend itself: it must appear to come from the service. ICMP has no
    // pseudo-header, so only the IP header checksum changes.
    if outer_saddr == inner.dst_addr {
        ctx.store(IP_SRC_OFF, &rn.addr, 0).map_err(fail)?;
        ctx.l3_csum_replace(IP_CSUM_OFF, word4(outer_saddr), word4(rn.addr), 4).map_err(fail)?;
    }
    Ok(Verdict::pass(Reason::IcmpErrorNat))
}
