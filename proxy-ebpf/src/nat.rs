//! Address and port rewrites. The IPv4 header and the port are written in place, and the IPv4
//! header checksum is updated with plain arithmetic (it is never offloaded). The TCP/UDP
//! checksum goes through the kernel helper on purpose: for a CHECKSUM_PARTIAL skb (anything a
//! local pod sends through a veth) the field holds only the pseudo-header sum, and only the
//! helper knows to update it for an address change but leave it alone for a port change.
//!
//! The work is the same whether or not the values change, so a no-op rewrite costs what a real
//! one does (the benchmark relies on that).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_common::{csum, Reason, IPPROTO_TCP};

use crate::parse::{ptr_at, Packet, IP_OFF};

const IP_CSUM: usize = 10;
const IP_SRC: usize = 12;
const IP_DST: usize = 16;
pub const TCP_CSUM_OFF: usize = 16;
pub const UDP_CSUM_OFF: usize = 6;

#[derive(Clone, Copy)]
pub enum Side {
    /// Destination: DNAT towards a backend.
    Dst,
    /// Source: reverse NAT of a reply.
    Src,
}

/// Replaces the address and port on `side` with `addr`:`port`, fixing the IPv4 header checksum
/// and, when this packet carries the L4 header, the TCP/UDP checksum.
#[inline(always)]
pub fn rewrite(
    ctx: &TcContext,
    pkt: &Packet,
    side: Side,
    addr: [u8; 4],
    port: [u8; 2],
) -> Result<(), Reason> {
    let (addr_off, port_off, old_addr, old_port) = match side {
        Side::Dst => (IP_DST, 2, pkt.daddr, pkt.dport),
        Side::Src => (IP_SRC, 0, pkt.saddr, pkt.sport),
    };
    let ip = ptr_at::<[u8; 20]>(ctx, IP_OFF).ok_or(Reason::DropRewrite)?;
    // SAFETY: bounds checked by ptr_at; the program owns the (unshared) packet data.
    let ip = unsafe { &mut *ip };
    let check = csum::update4([ip[IP_CSUM], ip[IP_CSUM + 1]], old_addr, addr);
    ip[addr_off..addr_off + 4].copy_from_slice(&addr);
    ip[IP_CSUM..IP_CSUM + 2].copy_from_slice(&check);
    if !pkt.has_l4() {
        return Ok(());
    }
    let ports = ptr_at::<[u8; 4]>(ctx, pkt.l4_off).ok_or(Reason::DropRewrite)?;
    // SAFETY: as above.
    let ports = unsafe { &mut *ports };
    ports[port_off..port_off + 2].copy_from_slice(&port);
    let (csum_off, mangled) = if pkt.proto == IPPROTO_TCP {
        (pkt.l4_off + TCP_CSUM_OFF, 0)
    } else {
        // A zero UDP checksum means "none" and must stay zero.
        (pkt.l4_off + UDP_CSUM_OFF, u64::from(BPF_F_MARK_MANGLED_0))
    };
    let old_a = u64::from(u32::from_ne_bytes(old_addr));
    let new_a = u64::from(u32::from_ne_bytes(addr));
    ctx.l4_csum_replace(csum_off, old_a, new_a, u64::from(BPF_F_PSEUDO_HDR) | mangled | 4)
        .map_err(|_| Reason::DropRewrite)?;
    let old_p = u64::from(u16::from_ne_bytes(old_port));
    let new_p = u64::from(u16::from_ne_bytes(port));
    ctx.l4_csum_replace(csum_off, old_p, new_p, mangled | 2).map_err(|_| Reason::DropRewrite)
}

/// Sends the packet back out the interface it came in on, to the host it came from: hairpinned
/// flows go straight back to their pod, past routing (whose reverse-path filter would drop a
/// source no route leads to) and netfilter.
#[inline(always)]
pub fn bounce(ctx: &TcContext) -> Result<i32, Reason> {
    let macs = crate::parse::ptr_at::<[u8; 12]>(ctx, 0).ok_or(Reason::DropRewrite)?;
    // SAFETY: bounds checked by ptr_at.
    let macs = unsafe { &mut *macs };
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    *macs = swapped;
    // SAFETY: reads the ifindex field of our own context; plain helper call.
    let action = unsafe { aya_ebpf::helpers::bpf_redirect((*ctx.skb.skb).ifindex, 0) } as i32;
    if action != aya_ebpf::bindings::TC_ACT_REDIRECT {
        return Err(Reason::DropRewrite);
    }
    Ok(action)
}
