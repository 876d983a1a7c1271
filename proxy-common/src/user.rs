//! Host-side helpers: `aya::Pod` impls and conversions to std types.

extern crate std;

use std::net::{Ipv4Addr, SocketAddrV4};

use crate::{Backend, BackendFlows, Counter, CtEntry, CtKey, FragKey, FragPorts, RevNat, ServiceKey, ServiceName, ServiceValue};

// SAFETY: all of these are #[repr(C)] with explicit padding fields and only integer or byte-array
// fields, so every bit pattern is valid and there are no uninitialised bytes.
unsafe impl aya::Pod for crate::ct::Lifetimes {}
unsafe impl aya::Pod for crate::ct::FlowGen {}
unsafe impl aya::Pod for ServiceValue {}
unsafe impl aya::Pod for BackendFlows {}
unsafe impl aya::Pod for FragKey {}
unsafe impl aya::Pod for FragPorts {}
unsafe impl aya::Pod for Counter {}
unsafe impl aya::Pod for ServiceName {}
unsafe impl aya::Pod for crate::AffinityValue {}
unsafe impl aya::Pod for crate::AffinityMatchKey {}
unsafe impl aya::Pod for crate::Config {}
unsafe impl aya::Pod for crate::TraceResult {}
unsafe impl aya::Pod for crate::Frag6Key {}
unsafe impl aya::Pod for crate::ct_filter::CtFilter {}

/// Protocol name as Kubernetes spells it.
pub fn proto_name(proto: u8) -> &'static str {
    match proto {
        crate::IPPROTO_TCP => "TCP",
        crate::IPPROTO_UDP => "UDP",
        crate::IPPROTO_ICMP => "ICMP",
        _ => "?",
    }
}

impl ServiceKey {
    pub fn frontend(addr: Ipv4Addr, port: u16, proto: u8) -> Self {
        Self::new(addr.octets(), port.to_be_bytes(), proto, 0)
    }

    pub fn socket(&self) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::from(self.addr), u16::from_be_bytes(self.port))
    }
}

impl Backend {
    pub fn new(addr: Ipv4Addr, port: u16, proto: u8, flags: u8) -> Self {
        Self { addr: addr.octets(), port: port.to_be_bytes(), proto, flags }
    }

    pub fn socket(&self) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::from(self.addr), u16::from_be_bytes(self.port))
    }
}

impl RevNat {
    pub fn new(addr: Ipv4Addr, port: u16) -> Self {
        Self { addr: addr.octets(), port: port.to_be_bytes(), _pad: [0; 2] }
    }

    pub fn socket(&self) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::from(self.addr), u16::from_be_bytes(self.port))
    }
}

impl CtKey {
    pub fn new(src: SocketAddrV4, dst: SocketAddrV4, proto: u8) -> Self {
        Self {
            saddr: src.ip().octets(),
            daddr: dst.ip().octets(),
            sport: src.port().to_be_bytes(),
            dport: dst.port().to_be_bytes(),
            proto,
            _pad: 0,
            _pad2: 0,
        }
    }

    pub fn src(&self) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::from(self.saddr), u16::from_be_bytes(self.sport))
    }

    pub fn dst(&self) -> SocketAddrV4 {
        SocketAddrV4::new(Ipv4Addr::from(self.daddr), u16::from_be_bytes(self.dport))
    }
}

impl ServiceName {
    /// Stores `s` as `fit` makes it.
    pub fn new(s: &str) -> Self {
        let s = Self::fit(s);
        let mut name = [0u8; 128];
        name[..s.len()].copy_from_slice(s.as_bytes());
        Self { name }
    }

    /// `s` as the field holds it: unchanged when it fits; else cut at a character boundary and
    /// ended with `~` and a hash of the whole in 16 hex digits. Two names that differ only past
    /// the cut (two ports of a Service whose `namespace/name:` alone fills the field: Kubernetes
    /// allows 143 bytes) stay two, and a name read back after a restart is the one written.
    pub fn fit(s: &str) -> std::borrow::Cow<'_, str> {
        const FIELD: usize = 128;
        if s.len() <= FIELD {
            return s.into();
        }
        // FNV-1a: the same digits from every build, as a name written by one run is compared
        // with the next run's.
        let hash = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        let tag = std::format!("~{hash:016x}");
        std::format!("{}{tag}", &s[..s.floor_char_boundary(FIELD - tag.len())]).into()
    }

    pub fn as_str(&self) -> &str {
        let end = self.name.iter().position(|b| *b == 0).unwrap_or(self.name.len());
        std::str::from_utf8(&self.name[..end]).unwrap_or("?")
    }
}

/// An address as the maps hold it, on the user side: IPv4's four bytes or an `Ip6`, each with
/// its family's load-balancer maps.
pub trait MapAddr:
    Copy + Default + PartialEq + Eq + Ord + std::hash::Hash + std::fmt::Debug + Send + Sync + aya::Pod + crate::filter::Addr + 'static
{
    /// Bits of an address (the longest prefix).
    const BITS: u8;
    const LB: crate::map_names::LbMaps;
    /// Where the datapath sends a hairpinned flow's replies (`ct::HAIRPIN_ADDR`, `HAIRPIN_ADDR6`).
    const HAIRPIN: Self;
    /// The address in the maps' form; None for the other family's.
    fn from_ip(ip: std::net::IpAddr) -> Option<Self>;
    fn ip(self) -> std::net::IpAddr;
}

impl MapAddr for [u8; 4] {
    const BITS: u8 = 32;
    const LB: crate::map_names::LbMaps = crate::map_names::LB4;
    const HAIRPIN: Self = crate::ct::HAIRPIN_ADDR;
    fn from_ip(ip: std::net::IpAddr) -> Option<Self> {
        match ip {
            std::net::IpAddr::V4(a) => Some(a.octets()),
            std::net::IpAddr::V6(_) => None,
        }
    }
    fn ip(self) -> std::net::IpAddr {
        Ipv4Addr::from(self).into()
    }
}

impl MapAddr for crate::Ip6 {
    const BITS: u8 = 128;
    const LB: crate::map_names::LbMaps = crate::map_names::LB6;
    const HAIRPIN: Self = crate::ct::HAIRPIN_ADDR6;
    fn from_ip(ip: std::net::IpAddr) -> Option<Self> {
        match ip {
            std::net::IpAddr::V6(a) => Some(crate::Ip6::from_bytes(a.octets())),
            std::net::IpAddr::V4(_) => None,
        }
    }
    fn ip(self) -> std::net::IpAddr {
        std::net::Ipv6Addr::from(self.to_bytes()).into()
    }
}

unsafe impl aya::Pod for crate::Ip6 {}

// SAFETY (all below): `repr(C)` with explicit padding for both address types, which are the
// only `MapAddr`s (the size asserts beside the types check both layouts).
unsafe impl<A: MapAddr> aya::Pod for ServiceKey<A> {}
unsafe impl<A: MapAddr> aya::Pod for Backend<A> {}
unsafe impl<A: MapAddr> aya::Pod for RevNat<A> {}
unsafe impl<A: MapAddr> aya::Pod for CtKey<A> {}
unsafe impl<A: MapAddr> aya::Pod for CtEntry<A> {}
unsafe impl<A: MapAddr> aya::Pod for crate::AffinityKey<A> {}
unsafe impl<A: MapAddr> aya::Pod for crate::SourceRangeKey<A> {}
unsafe impl<A: MapAddr> aya::Pod for crate::SvcCidrKey<A> {}
unsafe impl<A: MapAddr> aya::Pod for crate::SockRevKey<A> {}
unsafe impl<A: MapAddr> aya::Pod for crate::SockFwd<A> {}
unsafe impl<A: MapAddr> aya::Pod for crate::SockPortKey<A> {}
unsafe impl<A: MapAddr> aya::Pod for crate::IfAddr<A> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_name_round_trips_and_truncates_on_char_boundary() {
        assert_eq!(ServiceName::new("default/web:http").as_str(), "default/web:http");
        let long = "é".repeat(100);
        let n = ServiceName::new(&long);
        assert_eq!(n.as_str().len(), 127, "cut before a character that would not fit whole");
        let (kept, tag) = n.as_str().split_at(127 - 17);
        assert!(long.starts_with(kept) && tag.starts_with('~'), "{:?}", n.as_str());
        // Names that differ only past the cut stay distinct, and the same name fits alike.
        let port = |p: &str| std::format!("{}/{}:{p}", "n".repeat(63), "s".repeat(63));
        assert_ne!(ServiceName::new(&port("http")), ServiceName::new(&port("https")));
        assert_eq!(ServiceName::new(&port("http")), ServiceName::new(&port("http")));
        assert_eq!(ServiceName::fit(&port("http")).len(), 128);
        let exact = "x".repeat(128);
        assert_eq!(ServiceName::new(&exact).as_str(), exact, "a name that fits is kept whole");
    }
}
