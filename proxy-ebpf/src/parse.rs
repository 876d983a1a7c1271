//! Header parsing. Everything the later stages need is copied into `Packet`, because every
//! rewrite helper invalidates direct packet pointers.

use core::mem::size_of;

use aya_ebpf::programs::{TcContext, XdpContext};
use network_types::{
    eth::{EthHdr, EtherType},
    ip::Ipv4Hdr,
    tcp::TcpHdr,
    udp::UdpHdr,
};
use proxy_common::{IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{access, family::Family};

pub const ETH_LEN: usize = size_of::<EthHdr>();
pub const IP_OFF: usize = ETH_LEN;
/// Ethernet + the longest IPv4 header + a TCP header without options.
const HEADERS_MAX: u32 = (ETH_LEN + 60 + size_of::<TcpHdr>()) as u32;
/// Ethernet + the IPv6 header + extension headers as far as `parse6` walks them + TCP.
pub const HEADERS6_MAX: u32 = (ETH_LEN + 40 + crate::parse6::EXT_MAX + size_of::<TcpHdr>()) as u32;

const IP_MF: u16 = 0x2000;
pub const IP_OFFSET_MASK: u16 = 0x1fff;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// What parsing needs from a program's context: TC and XDP share the parser.
pub trait Frame {
    fn start(&self) -> usize;
    fn end(&self) -> usize;
    /// Length of the whole packet (TC: including paged data).
    fn total_len(&self) -> u32;
    /// Makes the first `len` bytes directly readable (TC may hold headers in paged data).
    fn pull(&self, len: u32);
}

impl Frame for TcContext {
    #[inline(always)]
    fn start(&self) -> usize {
        self.data()
    }
    #[inline(always)]
    fn end(&self) -> usize {
        self.data_end()
    }
    #[inline(always)]
    fn total_len(&self) -> u32 {
        self.len()
    }
    #[inline(always)]
    fn pull(&self, len: u32) {
        let _ = self.pull_data(len);
    }
}

impl Frame for XdpContext {
    #[inline(always)]
    fn start(&self) -> usize {
        self.data()
    }
    #[inline(always)]
    fn end(&self) -> usize {
        self.data_end()
    }
    #[inline(always)]
    fn total_len(&self) -> u32 {
        (self.data_end() - self.data()) as u32
    }
    #[inline(always)]
    fn pull(&self, _len: u32) {}
}

/// Bounds-checked pointer into the linear part of the packet, for reading or writing (TC may
/// write packet data directly; the verifier adds an unclone prologue). The comparison is written
/// against `data_end` on a pointer derived from `data`, the form the verifier can track.
#[inline(always)]
pub fn ptr_at<T>(ctx: &impl Frame, off: usize) -> Option<*mut T> {
    let start = ctx.start();
    let end = ctx.end();
    if start + off + size_of::<T>() > end {
        return None;
    }
    Some((start + off) as *mut T)
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Frag {
    /// Not fragmented.
    Whole,
    /// First fragment: carries the L4 header, more follow.
    First,
    /// A later fragment: no L4 header; ports come from the fragment map.
    Later,
}

/// A TCP or UDP packet (or fragment) of family `A` (see `family`).
#[derive(Clone, Copy)]
pub struct Packet<A: Family = [u8; 4]> {
    /// Offset of the L4 header (after the network header and, in IPv6, its extension headers).
    pub l4_off: usize,
    pub proto: u8,
    pub saddr: A,
    pub daddr: A,
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    /// TCP flags byte; 0 for UDP.
    pub tcp_flags: u8,
    pub ip_id: A::FragId,
    /// Length of the IP packet, its network header included (IPv4's total length), network
    /// order.
    pub tot_len: [u8; 2],
    pub ttl: u8,
    pub frag: Frag,
}

impl<A: Family> Packet<A> {
    /// `l4_off`, in a form the verifier can bound wherever the packet came from (an IPv6
    /// packet may come from the stage map between two programs: see `Family::bound_offset`).
    #[inline(always)]
    pub fn l4(&self) -> usize {
        A::bound_offset(self.l4_off)
    }

    /// True when this packet holds the L4 header (and so its checksum).
    #[inline(always)]
    pub fn has_l4(&self) -> bool {
        self.frag != Frag::Later
    }

    #[inline(always)]
    pub fn is_tcp_syn(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    /// A TCP segment of a connection under way (no SYN): one that finds no conntrack entry
    /// lost it (evicted from a full map, or expired).
    #[inline(always)]
    pub fn is_tcp_mid_connection(&self) -> bool {
        self.proto == IPPROTO_TCP && self.has_l4() && self.tcp_flags & TCP_SYN == 0
    }
}

pub enum Parsed<A: Family = [u8; 4]> {
    Packet(Packet<A>),
    /// An ICMP (ICMPv6) message; `l4_off` is the offset of its header.
    Icmp {
        l4_off: usize,
        saddr: A,
        daddr: A,
        tot_len: [u8; 2],
    },
    /// Not a protocol services use (or a later fragment of ICMP; in IPv6 also ESP, no next
    /// header, or more extension headers than are walked).
    OtherProto {
        daddr: A,
    },
    /// Too short, or an invalid header: left for the kernel to drop.
    Malformed,
}

/// A frame by its network protocol: the one place the ethertype is read. IPv6 is parsed by
/// its own programs (`parse6`).
pub enum L3 {
    V4(Parsed<[u8; 4]>),
    V6,
    /// Neither (ARP, VLAN-tagged, ...), or too short for an Ethernet header.
    Other,
}

/// Drivers and GRO may leave headers in paged fragments; pulls up to `max` bytes into the
/// linear area, but only when they are not there already (pull may copy).
#[inline(always)]
pub fn pull_headers<F: Frame>(ctx: &F, max: u32) {
    let linear = (ctx.end() - ctx.start()) as u32;
    let len = ctx.total_len();
    let wanted = if len < max { len } else { max };
    if linear < wanted {
        ctx.pull(wanted);
    }
}

#[inline(always)]
fn ether_type<F: Frame>(ctx: &F) -> Option<u16> {
    let eth = ptr_at::<EthHdr>(ctx, 0)?;
    // SAFETY: bounds checked by ptr_at.
    Some(unsafe { (*eth).ether_type })
}

/// Whether the frame is IPv6 (its Ethernet header's type: what `l3` answers `L3::V6` for).
#[inline(always)]
pub fn is_ipv6<F: Frame>(ctx: &F) -> bool {
    ether_type(ctx) == Some(EtherType::Ipv6 as u16)
}

#[inline(always)]
pub fn l3<F: Frame>(ctx: &F) -> L3 {
    pull_headers(ctx, HEADERS_MAX);
    match ether_type(ctx) {
        Some(t) if t == EtherType::Ipv4 as u16 => L3::V4(ipv4_header(ctx)),
        Some(t) if t == EtherType::Ipv6 as u16 => L3::V6,
        _ => L3::Other,
    }
}

#[inline(always)]
fn ipv4_header<F: Frame>(ctx: &F) -> Parsed {
    let len = ctx.total_len();
    let Some(ip) = ptr_at::<Ipv4Hdr>(ctx, IP_OFF) else {
        return Parsed::Malformed;
    };
    // SAFETY: bounds checked by ptr_at (the 20 bytes of Ipv4Hdr), for every read below.
    let (vihl, proto, frags, tot_len, ip_id, ttl, saddr, daddr) = unsafe {
        let ip = ip as usize;
        (
            *(ip as *const u8),
            *((ip + 9) as *const u8),
            u16::from_be_bytes(access::load2(ip + 6)),
            access::load2(ip + 2),
            access::load2(ip + 4),
            *((ip + 8) as *const u8),
            access::load4(ip + 12),
            access::load4(ip + 16),
        )
    };
    let ihl = usize::from(vihl & 0x0f) * 4;
    if vihl >> 4 != 4 || ihl < size_of::<Ipv4Hdr>() {
        return Parsed::Malformed;
    }
    // What the kernel's ip_rcv drops (a total length shorter than the header, or longer than
    // what arrived) is left to it untouched: translating it would track a flow for a packet
    // that is never delivered.
    let mut total = u32::from(u16::from_be_bytes(tot_len));
    if total == 0 && len > 0xffff + IP_OFF as u32 {
        // BIG TCP: a GSO packet beyond 64 KiB says 0, and its length is the skb's.
        total = len - IP_OFF as u32;
    }
    if total < ihl as u32 || total + IP_OFF as u32 > len {
        return Parsed::Malformed;
    }
    if proto == IPPROTO_ICMP && frags & IP_OFFSET_MASK == 0 {
        return Parsed::Icmp { l4_off: IP_OFF + ihl, saddr, daddr, tot_len };
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Parsed::OtherProto { daddr };
    }
    let frag = if frags & IP_OFFSET_MASK != 0 {
        Frag::Later
    } else if frags & IP_MF != 0 {
        Frag::First
    } else {
        Frag::Whole
    };
    let mut pkt =
        Packet { l4_off: IP_OFF + ihl, proto, saddr, daddr, sport: [0; 2], dport: [0; 2], tcp_flags: 0, ip_id, tot_len, ttl, frag };
    if frag == Frag::Later {
        return Parsed::Packet(pkt);
    }
    if !ports(ctx, &mut pkt, total) {
        return Parsed::Malformed;
    }
    Parsed::Packet(pkt)
}

/// Reads the ports (and TCP's flags) of a packet holding its L4 header into `pkt`; false when
/// the header is cut short. `total` is the IP packet's length, its network header included.
#[inline(always)]
pub fn ports<F: Frame, A: Family>(ctx: &F, pkt: &mut Packet<A>, total: u32) -> bool {
    // The ports lead both headers; TCP's flags are its byte 13.
    let l4 = if pkt.proto == IPPROTO_TCP {
        ptr_at::<TcpHdr>(ctx, pkt.l4_off).map(|p| p as usize)
    } else {
        ptr_at::<UdpHdr>(ctx, pkt.l4_off).map(|p| p as usize)
    };
    let Some(l4) = l4 else {
        return false;
    };
    // The header must lie within the total length too, not in a trailer the kernel trims.
    let l4_hdr = if pkt.proto == IPPROTO_TCP { size_of::<TcpHdr>() } else { size_of::<UdpHdr>() };
    if (pkt.l4_off + l4_hdr) as u32 > IP_OFF as u32 + total {
        return false;
    }
    // SAFETY: bounds checked by ptr_at: 4 bytes of ports, and for TCP the 20-byte header.
    unsafe {
        let ports = access::load4(l4);
        pkt.sport = [ports[0], ports[1]];
        pkt.dport = [ports[2], ports[3]];
        if pkt.proto == IPPROTO_TCP {
            pkt.tcp_flags = *((l4 + 13) as *const u8);
        }
    }
    true
}
