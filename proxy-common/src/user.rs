//! Host-side helpers: `aya::Pod` impls and conversions to std types.

extern crate std;

use std::net::{Ipv4Addr, SocketAddrV4};

use crate::{Backend, BackendFlows, Counter, CtEntry, CtKey, FragKey, FragPorts, RevNat, ServiceKey, ServiceName, ServiceValue};

// SAFETY: all of these are #[repr(C)] with explicit padding fields and only integer or byte-array
// fields, so every bit pattern is valid and there are no uninitialised bytes.
unsafe impl aya::Pod for ServiceKey {}
unsafe impl aya::Pod for crate::ct::Lifetimes {}
unsafe impl aya::Pod for ServiceValue {}
unsafe impl aya::Pod for Backend {}
unsafe impl aya::Pod for RevNat {}
unsafe impl aya::Pod for BackendFlows {}
unsafe impl aya::Pod for CtKey {}
unsafe impl aya::Pod for CtEntry {}
unsafe impl aya::Pod for FragKey {}
unsafe impl aya::Pod for FragPorts {}
unsafe impl aya::Pod for Counter {}
unsafe impl aya::Pod for ServiceName {}
unsafe impl aya::Pod for crate::AffinityKey {}
unsafe impl aya::Pod for crate::AffinityValue {}
unsafe impl aya::Pod for crate::AffinityMatchKey {}
unsafe impl aya::Pod for crate::SourceRangeKey {}
unsafe impl aya::Pod for crate::SockRevKey {}
unsafe impl aya::Pod for crate::SockFwd {}
unsafe impl aya::Pod for crate::IfAddr {}
unsafe impl aya::Pod for crate::Config {}
unsafe impl aya::Pod for crate::SvcCidrKey {}
unsafe impl aya::Pod for crate::TraceResult {}
unsafe impl aya::Pod for crate::Frag6Key {}
unsafe impl aya::Pod for ServiceKey<crate::Ip6> {}
unsafe impl aya::Pod for Backend<crate::Ip6> {}
unsafe impl aya::Pod for RevNat<crate::Ip6> {}
unsafe impl aya::Pod for CtKey<crate::Ip6> {}
unsafe impl aya::Pod for CtEntry<crate::Ip6> {}
unsafe impl aya::Pod for crate::AffinityKey<crate::Ip6> {}
unsafe impl aya::Pod for crate::SourceRangeKey<crate::Ip6> {}
unsafe impl aya::Pod for crate::SvcCidrKey<crate::Ip6> {}

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
    /// Stores `s`, cut at a character boundary if it is longer than the field.
    pub fn new(s: &str) -> Self {
        let mut name = [0u8; 128];
        let mut end = s.len().min(name.len());
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        name[..end].copy_from_slice(&s.as_bytes()[..end]);
        Self { name }
    }

    pub fn as_str(&self) -> &str {
        let end = self.name.iter().position(|b| *b == 0).unwrap_or(self.name.len());
        std::str::from_utf8(&self.name[..end]).unwrap_or("?")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_name_round_trips_and_truncates_on_char_boundary() {
        assert_eq!(ServiceName::new("default/web:http").as_str(), "default/web:http");
        let long = "é".repeat(100);
        let n = ServiceName::new(&long);
        assert_eq!(n.as_str().len(), 128);
        assert!(long.starts_with(n.as_str()));
    }
}
