//! ICMP port unreachable for services without endpoints: what kube-proxy's REJECT rule sends,
//! so clients fail at once ("connection refused") instead of timing out.

use aya_ebpf::{
    bindings::{bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, TC_ACT_REDIRECT},
    helpers::{bpf_csum_diff, bpf_redirect, bpf_skb_change_tail, bpf_skb_load_bytes},
    programs::TcContext,
};
use proxy_common::{csum, Reason, IPPROTO_ICMP};

use crate::{
    lb::Verdict,
    parse::{Packet, ETH_LEN, IP_OFF},
};

const IP_HDR_LEN: usize = 20;
const ICMP_HDR_LEN: usize = 8;
/// RFC 792: the original IP header (with options, up to 60 bytes) and 64 bits of its data.
const QUOTE_MAX: usize = 60 + 8;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;

/// Turns the packet into an ICMP port unreachable from the service address back to the sender,
/// and sends it out the interface it came in on.
#[inline(always)]
pub fn reject(ctx: &TcContext, pkt: &Packet) -> Result<Verdict, Reason> {
    let quote_len = pkt.l4_off - IP_OFF;
    let quote_len = quote_len + 8;
    if quote_len > QUOTE_MAX {
        return Err(Reason::DropRejectFailed);
    }
    // ICMP header followed by the quote, so one checksum pass covers the whole ICMP message.
    let mut msg = [0u8; ICMP_HDR_LEN + QUOTE_MAX];
    msg[0] = ICMP_DEST_UNREACH;
    msg[1] = ICMP_PORT_UNREACH;
    // SAFETY: `msg` has room for QUOTE_MAX bytes after the header and quote_len <= QUOTE_MAX.
    let rc = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const _,
            IP_OFF as u32,
            msg.as_mut_ptr().add(ICMP_HDR_LEN) as *mut _,
            quote_len as u32,
        )
    };
    if rc != 0 {
        return Err(Reason::DropRejectFailed);
    }
    let msg_len = (ICMP_HDR_LEN + quote_len) as u32;
    // SAFETY: reads msg_len <= size_of_val(&msg) bytes of the stack buffer.
    let sum = unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, msg.as_mut_ptr() as *mut _, msg_len, 0) };
    if sum < 0 {
        return Err(Reason::DropRejectFailed);
    }
    // bpf_csum_diff sums memory in host order; the folded value is stored back the same way.
    let icmp_csum = (!csum::fold(sum as u64)).to_ne_bytes();

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

    let macs: [u8; 12] = ctx.load(0).map_err(|_| Reason::DropRejectFailed)?;
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);

    // Cut the packet to Ethernet + quote, then open room for the new IP and ICMP headers
    // between the Ethernet header and the quote.
    // SAFETY: plain helper call on our own skb.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb, (ETH_LEN + quote_len) as u32, 0) } != 0 {
        return Err(Reason::DropRejectFailed);
    }
    ctx.adjust_room((IP_HDR_LEN + ICMP_HDR_LEN) as i32, BPF_ADJ_ROOM_MAC, 0)
        .map_err(|_| Reason::DropRejectFailed)?;
    ctx.store(0, &swapped, 0).map_err(|_| Reason::DropRejectFailed)?;
    ctx.store(IP_OFF, &ip, 0).map_err(|_| Reason::DropRejectFailed)?;
    let icmp_hdr = [ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, icmp_csum[0], icmp_csum[1], 0, 0, 0, 0];
    ctx.store(IP_OFF + IP_HDR_LEN, &icmp_hdr, 0).map_err(|_| Reason::DropRejectFailed)?;

    // SAFETY: reads the ifindex field of our own context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper call.
    let action = unsafe { bpf_redirect(ifindex, 0) } as i32;
    if action != TC_ACT_REDIRECT {
        return Err(Reason::DropRejectFailed);
    }
    Ok(Verdict { action, reason: Reason::RejectNoEndpoints })
}
