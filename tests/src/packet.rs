//! Building and dissecting Ethernet/IPv4/TCP/UDP/ICMP frames for packet tables. The checksum
//! code here is written independently of the datapath's (a plain RFC 1071 loop over the bytes),
//! so a datapath checksum bug cannot hide behind a shared helper.

use std::net::{Ipv4Addr, SocketAddrV4};

pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;

pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;
pub const FIN: u8 = 0x01;
pub const RST: u8 = 0x04;

/// RFC 1071 Internet checksum of `data` (the value to store, already complemented).
pub fn internet_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The TCP/UDP pseudo-header bytes (RFC 793, RFC 768).
pub fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(12);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.push(0);
    p.push(proto);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p
}

/// An IPv4 packet to be framed. Fields default to a plain, unfragmented packet.
#[derive(Clone, Debug)]
pub struct Ipv4 {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub id: u16,
    /// Flags (DF 0x4000, MF 0x2000) and fragment offset in 8-byte units.
    pub frag: u16,
    pub ttl: u8,
    /// IP options, padded by the caller to a multiple of 4 bytes.
    pub options: Vec<u8>,
    /// Everything after the IP header (L4 header and payload, or a fragment of them).
    pub payload: Vec<u8>,
}

impl Ipv4 {
    pub fn new(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, payload: Vec<u8>) -> Self {
        Self { src, dst, proto, id: 0x1234, frag: 0, ttl: 64, options: vec![], payload }
    }

    pub fn header(&self) -> Vec<u8> {
        let ihl = 5 + self.options.len() / 4;
        let total = ihl * 4 + self.payload.len();
        let mut h = vec![0x40 | ihl as u8, 0];
        h.extend_from_slice(&(total as u16).to_be_bytes());
        h.extend_from_slice(&self.id.to_be_bytes());
        h.extend_from_slice(&self.frag.to_be_bytes());
        h.push(self.ttl);
        h.push(self.proto);
        h.extend_from_slice(&[0, 0]);
        h.extend_from_slice(&self.src.octets());
        h.extend_from_slice(&self.dst.octets());
        h.extend_from_slice(&self.options);
        let c = internet_checksum(&h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
        h
    }

    /// The Ethernet frame client -> node.
    pub fn frame(&self) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&NODE_MAC);
        f.extend_from_slice(&CLIENT_MAC);
        f.extend_from_slice(&[0x08, 0x00]);
        f.extend_from_slice(&self.header());
        f.extend_from_slice(&self.payload);
        f
    }
}

/// A TCP segment (20-byte header, no options) with a valid checksum.
pub fn tcp_segment(src: SocketAddrV4, dst: SocketAddrV4, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut s = Vec::new();
    s.extend_from_slice(&src.port().to_be_bytes());
    s.extend_from_slice(&dst.port().to_be_bytes());
    s.extend_from_slice(&1000u32.to_be_bytes());
    s.extend_from_slice(&(if flags & ACK != 0 { 2000u32 } else { 0 }).to_be_bytes());
    s.push(5 << 4);
    s.push(flags);
    s.extend_from_slice(&64240u16.to_be_bytes());
    s.extend_from_slice(&[0, 0, 0, 0]);
    s.extend_from_slice(payload);
    let mut sum_in = pseudo_header(*src.ip(), *dst.ip(), TCP, s.len());
    sum_in.extend_from_slice(&s);
    let c = internet_checksum(&sum_in);
    s[16..18].copy_from_slice(&c.to_be_bytes());
    s
}

/// A UDP datagram with a valid checksum (or none, when `with_checksum` is false).
pub fn udp_datagram(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8], with_checksum: bool) -> Vec<u8> {
    let len = 8 + payload.len();
    let mut d = Vec::new();
    d.extend_from_slice(&src.port().to_be_bytes());
    d.extend_from_slice(&dst.port().to_be_bytes());
    d.extend_from_slice(&(len as u16).to_be_bytes());
    d.extend_from_slice(&[0, 0]);
    d.extend_from_slice(payload);
    if with_checksum {
        let mut sum_in = pseudo_header(*src.ip(), *dst.ip(), UDP, len);
        sum_in.extend_from_slice(&d);
        let mut c = internet_checksum(&sum_in);
        if c == 0 {
            c = 0xffff;
        }
        d[6..8].copy_from_slice(&c.to_be_bytes());
    }
    d
}

pub fn tcp_frame(src: SocketAddrV4, dst: SocketAddrV4, flags: u8) -> Vec<u8> {
    Ipv4::new(*src.ip(), *dst.ip(), TCP, tcp_segment(src, dst, flags, b"")).frame()
}

pub fn udp_frame(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
    Ipv4::new(*src.ip(), *dst.ip(), UDP, udp_datagram(src, dst, payload, true)).frame()
}

/// An ICMP echo request (a ping) with a valid checksum.
pub fn icmp_echo_frame(src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
    let mut m = vec![8, 0, 0, 0, 0x12, 0x34, 0, 1];
    m.extend_from_slice(b"ping payload");
    let c = internet_checksum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    Ipv4::new(src, dst, ICMP, m).frame()
}

/// A frame taken apart, with every checksum checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dissected {
    pub eth_dst: [u8; 6],
    pub eth_src: [u8; 6],
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub ihl_bytes: usize,
    pub ip_checksum_ok: bool,
    pub total_len: usize,
    pub id: u16,
    pub frag: u16,
    /// Ports, when the L4 header is present.
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    /// TCP/UDP checksum over the pseudo header and the whole segment; None when this is a
    /// fragment (the checksum spans fragments) or a UDP datagram without checksum.
    pub l4_checksum_ok: Option<bool>,
    pub udp_checksum_zero: bool,
    pub icmp: Option<Icmp>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Icmp {
    pub kind: u8,
    pub code: u8,
    pub checksum_ok: bool,
    /// The bytes after the 8-byte ICMP header.
    pub body: Vec<u8>,
}

impl Dissected {
    pub fn src_sock(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.src, self.sport.expect("L4 header present"))
    }

    pub fn dst_sock(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.dst, self.dport.expect("L4 header present"))
    }
}

/// Dissects an Ethernet/IPv4 frame. Panics with a description if it is not one.
pub fn dissect(frame: &[u8]) -> Dissected {
    assert!(frame.len() >= 34, "frame of {} bytes is too short for Ethernet + IPv4", frame.len());
    assert_eq!(&frame[12..14], &[0x08, 0x00], "not an IPv4 frame");
    let ip = &frame[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    assert!(total <= ip.len(), "IPv4 total length {total} exceeds the {} bytes present", ip.len());
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let proto = ip[9];
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    let mut d = Dissected {
        eth_dst: frame[0..6].try_into().unwrap(),
        eth_src: frame[6..12].try_into().unwrap(),
        src,
        dst,
        proto,
        ihl_bytes: ihl,
        ip_checksum_ok: internet_checksum(&ip[..ihl]) == 0,
        total_len: total,
        id: u16::from_be_bytes([ip[4], ip[5]]),
        frag,
        sport: None,
        dport: None,
        l4_checksum_ok: None,
        udp_checksum_zero: false,
        icmp: None,
    };
    let l4 = &ip[ihl..total];
    let later_fragment = frag & 0x1fff != 0;
    let more_fragments = frag & 0x2000 != 0;
    if later_fragment {
        return d;
    }
    match proto {
        TCP | UDP => {
            d.sport = Some(u16::from_be_bytes([l4[0], l4[1]]));
            d.dport = Some(u16::from_be_bytes([l4[2], l4[3]]));
            if proto == UDP && l4[6] == 0 && l4[7] == 0 {
                d.udp_checksum_zero = true;
            } else if !more_fragments {
                let mut sum_in = pseudo_header(src, dst, proto, l4.len());
                sum_in.extend_from_slice(l4);
                d.l4_checksum_ok = Some(internet_checksum(&sum_in) == 0);
            }
        }
        ICMP => {
            d.icmp = Some(Icmp { kind: l4[0], code: l4[1], checksum_ok: internet_checksum(l4) == 0, body: l4[8..].to_vec() });
        }
        _ => {}
    }
    d
}

/// Checksum of the L4 part of a first fragment, given the whole reassembled L4 payload: used
/// to check that DNAT of a first fragment fixed the checksum for the whole datagram.
pub fn l4_checksum_ok_over(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8]) -> bool {
    let mut sum_in = pseudo_header(src, dst, proto, l4.len());
    sum_in.extend_from_slice(l4);
    internet_checksum(&sum_in) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_frames_dissect_with_valid_checksums() {
        let c = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 40000);
        let s = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 1), 80);
        let d = dissect(&tcp_frame(c, s, SYN));
        assert!(d.ip_checksum_ok);
        assert_eq!(d.l4_checksum_ok, Some(true));
        assert_eq!((d.src_sock(), d.dst_sock()), (c, s));
        let d = dissect(&udp_frame(c, s, b"hello"));
        assert_eq!(d.l4_checksum_ok, Some(true));
    }

    #[test]
    fn checksum_detects_a_flipped_bit() {
        let c = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 40000);
        let s = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 1), 80);
        let mut f = tcp_frame(c, s, SYN);
        f[14 + 20 + 4] ^= 0x01;
        assert_eq!(dissect(&f).l4_checksum_ok, Some(false));
        f[14 + 8] ^= 0x01;
        assert!(!dissect(&f).ip_checksum_ok);
    }
}
