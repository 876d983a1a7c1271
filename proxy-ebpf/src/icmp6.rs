//! ICMPv6 port unreachable for IPv6 Services without endpoints (what kube-proxy's ip6tables
//! REJECT sends: type 1, code 4), built in place of the packet as `icmp` does for IPv4.

use aya_ebpf::programs::TcContext;
use proxy_common::{csum, Ip6, Reason};

use crate::{
    icmp::{self, ICMP_HDR_LEN},
    parse::Packet,
    parse6::IPPROTO_ICMPV6,
    verdict::Verdict,
};

const IPV6_HDR_LEN: usize = 40;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;

/// Turns the packet into an ICMPv6 port unreachable from its destination (the Service address)
/// back to its sender, and sends it out the interface it came in on, counted under `reason`.
#[inline(always)]
pub fn reject(ctx: &TcContext, pkt: &Packet<Ip6>, reason: Reason) -> Result<Verdict, Reason> {
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
    icmp::send_in_place(ctx, quote_len, &ip, icmp_hdr, 0, reason)
}
