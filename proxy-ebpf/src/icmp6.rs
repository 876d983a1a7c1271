//! ICMPv6 port unreachable for IPv6 Services without endpoints (what kube-proxy's ip6tables
//! REJECT sends: type 1, code 4), built in place of the packet as `icmp` does for IPv4.

use aya_ebpf::{
    bindings::{bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, TC_ACT_REDIRECT},
    helpers::{bpf_csum_diff, bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes},
    programs::TcContext,
};
use proxy_common::{csum, Ip6, Reason};

use crate::{
    parse::{Packet, ETH_LEN, IP_OFF},
    parse6::IPPROTO_ICMPV6,
    verdict::Verdict,
};

const IPV6_HDR_LEN: usize = 40;
const ICMP_HDR_LEN: usize = 8;
/// How much of the offending packet is quoted (RFC 4443 asks for as much as fits in the
/// minimum MTU; 128 bytes hold the IPv6 header, common extension headers and the L4 header).
const QUOTE_MAX: usize = 128;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;

/// Turns the packet into an ICMPv6 port unreachable from its destination (the Service address)
/// back to its sender, and sends it out the interface it came in on, counted under `reason`.
#[inline(always)]
pub fn reject(ctx: &TcContext, pkt: &Packet<Ip6>, reason: Reason) -> Result<Verdict, Reason> {
    let fail = |_| Reason::DropRejectFailed;
    let frame_ip_len = (ctx.len() as usize).saturating_sub(ETH_LEN);
    let tot = usize::from(u16::from_be_bytes(pkt.tot_len));
    let ip_len = if tot != 0 && tot < frame_ip_len { tot } else { frame_ip_len };
    let quote_len = if ip_len < QUOTE_MAX { ip_len } else { QUOTE_MAX };
    // At least the headers up to the ports (the second test is the first's lower bound, in a
    // form the verifier tracks: the packet's offsets come from the stage map).
    if quote_len < pkt.l4_off - IP_OFF + 8 || quote_len < IPV6_HDR_LEN + 8 {
        return Err(Reason::DropRejectFailed);
    }
    // ICMPv6 header followed by the quote, zero-padded to a multiple of 4 for bpf_csum_diff, in
    // a per-CPU buffer (the stack has no room for it beside the flow's state).
    let msg = crate::maps::ICMP_SCRATCH.get_ptr_mut(0).ok_or(Reason::DropRejectFailed)?;
    // SAFETY: this CPU's buffer; the program does not migrate while it runs.
    let msg = unsafe { &mut (*msg).bytes };
    *msg = [0; crate::icmp::MESSAGE_MAX + 4];
    msg[0] = ICMPV6_DEST_UNREACH;
    msg[1] = ICMPV6_PORT_UNREACH;
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
    // The checksum covers the pseudo-header too (RFC 4443 §2.3): from the Service to the sender.
    let payload_len = (ICMP_HDR_LEN + quote_len) as u16;
    let pseudo = u64::from(u16::from_ne_bytes(csum::pseudo_header(pkt.daddr, pkt.saddr, IPPROTO_ICMPV6, payload_len)));
    let icmp_csum = (!csum::fold(sum as u64 + pseudo)).to_ne_bytes();

    let mut ip = [0u8; IPV6_HDR_LEN];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&payload_len.to_be_bytes());
    ip[6] = IPPROTO_ICMPV6;
    ip[7] = 64; // hop limit
    ip[8..24].copy_from_slice(&pkt.daddr.to_bytes());
    ip[24..40].copy_from_slice(&pkt.saddr.to_bytes());

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
    ctx.adjust_room((IPV6_HDR_LEN + ICMP_HDR_LEN) as i32, BPF_ADJ_ROOM_MAC, 0).map_err(fail)?;
    ctx.store(0, &swapped, 0).map_err(fail)?;
    ctx.store(IP_OFF, &ip, 0).map_err(fail)?;
    let icmp_hdr = [ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, icmp_csum[0], icmp_csum[1], 0, 0, 0, 0];
    ctx.store(IP_OFF + IPV6_HDR_LEN, &icmp_hdr, 0).map_err(fail)?;

    // SAFETY: reads the ifindex field of our own context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper call.
    let action = unsafe { bpf_redirect(ifindex, 0) } as i32;
    if action != TC_ACT_REDIRECT {
        return Err(Reason::DropRejectFailed);
    }
    Ok(Verdict { action, reason })
}
