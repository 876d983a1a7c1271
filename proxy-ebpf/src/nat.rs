//! Address and port rewrites with incremental checksum updates. The kernel helpers are used on
//! purpose: for a CHECKSUM_PARTIAL skb (anything a local pod sends through a veth) the L4
//! checksum field holds only the pseudo-header sum, and only the helpers know to update it for
//! an address change but leave it alone for a port change.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use proxy_common::{Reason, IPPROTO_TCP};

use crate::parse::{Packet, IP_OFF};

const IP_CSUM_OFF: usize = IP_OFF + 10;
const IP_SRC_OFF: usize = IP_OFF + 12;
const IP_DST_OFF: usize = IP_OFF + 16;
const TCP_CSUM_OFF: usize = 16;
const UDP_CSUM_OFF: usize = 6;

#[derive(Clone, Copy)]
pub enum Side {
    /// Destination: DNAT towards a backend.
    Dst,
    /// Source: reverse NAT of a reply.
    Src,
}

/// Replaces the address and port on `side` with `addr`:`port`, fixing the IPv4 header checksum
/// and, when this packet carries the L4 header, the TCP/UDP checksum. The work is the same
/// whether or not the values change, so a no-op rewrite costs what a real one does.
#[inline(always)]
pub fn rewrite(
    ctx: &TcContext,
    pkt: &Packet,
    side: Side,
    addr: [u8; 4],
    port: [u8; 2],
) -> Result<(), Reason> {
    let (addr_off, port_off, old_addr, old_port) = match side {
        Side::Dst => (IP_DST_OFF, 2, pkt.daddr, pkt.dport),
        Side::Src => (IP_SRC_OFF, 0, pkt.saddr, pkt.sport),
    };
    let old_a = u64::from(u32::from_ne_bytes(old_addr));
    let new_a = u64::from(u32::from_ne_bytes(addr));
    ctx.store(addr_off, &addr, 0).map_err(|_| Reason::DropRewrite)?;
    ctx.l3_csum_replace(IP_CSUM_OFF, old_a, new_a, 4).map_err(|_| Reason::DropRewrite)?;
    if !pkt.has_l4() {
        return Ok(());
    }
    let (csum_off, mangled) = if pkt.proto == IPPROTO_TCP {
        (pkt.l4_off + TCP_CSUM_OFF, 0)
    } else {
        // A zero UDP checksum means "none" and must stay zero.
        (pkt.l4_off + UDP_CSUM_OFF, u64::from(BPF_F_MARK_MANGLED_0))
    };
    ctx.l4_csum_replace(csum_off, old_a, new_a, u64::from(BPF_F_PSEUDO_HDR) | mangled | 4)
        .map_err(|_| Reason::DropRewrite)?;
    let old_p = u64::from(u16::from_ne_bytes(old_port));
    let new_p = u64::from(u16::from_ne_bytes(port));
    ctx.store(pkt.l4_off + port_off, &port, 0).map_err(|_| Reason::DropRewrite)?;
    ctx.l4_csum_replace(csum_off, old_p, new_p, mangled | 2).map_err(|_| Reason::DropRewrite)
}
