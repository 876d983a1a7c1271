//! Addresses as kube-proxy reads them from API objects and flags.
//!
//! Objects stored before Go 1.17 may hold IPv4 addresses with leading zeros (`172.30.0.041`),
//! which Go then accepted. The API server still serves them, and kube-proxy reads every address
//! with `ParseIPSloppy` / `ParseCIDRSloppy` (k8s.io/utils/net): each dotted part is decimal,
//! whatever zeros lead it, so `041` is 41, never octal 33. Rust's parser refuses leading zeros,
//! so every address a Kubernetes object or a kube-proxy flag carries is read through here.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A dotted quad whose parts may carry leading zeros, each read as decimal (Go 1.16's rule: 1 to
/// any number of digits, value at most 255).
fn ipv4_sloppy(s: &str) -> Option<Ipv4Addr> {
    let mut out = [0u8; 4];
    let mut parts = s.split('.');
    for o in &mut out {
        let p = parts.next()?;
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let digits = p.trim_start_matches('0');
        // "000" is 0; anything with more than three significant digits is above 255.
        *o = if digits.is_empty() { 0 } else { u8::try_from(digits.parse::<u16>().ok()?).ok()? };
    }
    parts.next().is_none().then(|| Ipv4Addr::from(out))
}

/// An IP address as kube-proxy reads one: the standard forms, and IPv4 parts with leading zeros
/// (also in the dotted tail of an IPv6 address such as `::ffff:010.0.0.1`).
pub fn parse_ip(s: &str) -> Option<IpAddr> {
    if let Ok(a) = s.parse::<IpAddr>() {
        return Some(a);
    }
    if let Some(a) = ipv4_sloppy(s) {
        return Some(IpAddr::V4(a));
    }
    // IPv6 with an embedded dotted quad: read the quad sloppily and the rest strictly.
    let (head, tail) = s.rsplit_once(':')?;
    let quad = ipv4_sloppy(tail)?;
    format!("{head}:{quad}").parse::<Ipv6Addr>().ok().map(IpAddr::V6)
}

/// `address/prefix` as kube-proxy reads one (`ParseCIDRSloppy`): the address as `parse_ip`, the
/// prefix decimal (leading zeros allowed) and at most the family's width. The address is
/// returned as written, not masked.
pub fn parse_cidr(s: &str) -> Option<(IpAddr, u8)> {
    let (a, p) = s.split_once('/')?;
    let addr = parse_ip(a)?;
    if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = p.trim_start_matches('0');
    let prefix: u8 = if digits.is_empty() { 0 } else { digits.parse().ok()? };
    let width = if addr.is_ipv4() { 32 } else { 128 };
    (prefix <= width).then_some((addr, prefix))
}

/// An IPv4 CIDR, as `--nodeport-addresses` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: std::net::Ipv4Addr,
    pub prefix: u8,
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Cidr {
    fn mask(&self) -> u32 {
        if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.prefix))
        }
    }

    /// The same range written with its network address (`10.1.2.3/8` -> `10.0.0.0/8`).
    pub fn network(self) -> Self {
        Self { addr: std::net::Ipv4Addr::from(u32::from(self.addr) & self.mask()), prefix: self.prefix }
    }

    pub fn contains(&self, a: std::net::Ipv4Addr) -> bool {
        u32::from(a) & self.mask() == u32::from(self.addr) & self.mask()
    }

    /// True when one of `ranges` holds one of `addrs` (loadBalancerSourceRanges holding a node
    /// address, which then admit the load balancer's own address too, as kube-proxy does).
    pub fn any_contains(ranges: &[Cidr], addrs: &[std::net::Ipv4Addr]) -> bool {
        ranges.iter().any(|r| addrs.iter().any(|a| r.contains(*a)))
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s.split_once('/').ok_or_else(|| format!("{s:?} is not a CIDR (address/prefix)"))?;
        // Read as kube-proxy reads CIDRs (ParseCIDRSloppy): leading zeros are decimal.
        let Some(std::net::IpAddr::V4(addr)) = parse_ip(a) else {
            return Err(format!("{s:?}: {a:?} is not an IPv4 address"));
        };
        match parse_cidr(s) {
            Some((_, prefix)) => Ok(Self { addr, prefix }),
            None => Err(format!("{s:?}: prefix {p:?} is not 0-32")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> Option<IpAddr> {
        s.parse().ok()
    }

    #[test]
    fn leading_zeros_are_decimal_as_kube_proxy_reads_them() {
        assert_eq!(parse_ip("172.30.0.041"), v4("172.30.0.41"), "041 is 41, not octal 33");
        assert_eq!(parse_ip("010.096.000.010"), v4("10.96.0.10"));
        assert_eq!(parse_ip("0000000010.1.1.1"), v4("10.1.1.1"), "Go allows any number of zeros");
        assert_eq!(parse_ip("10.96.0.10"), v4("10.96.0.10"));
        assert_eq!(parse_ip("::ffff:010.000.000.001"), "::ffff:10.0.0.1".parse().ok());
        assert_eq!(parse_ip("fd00::1"), "fd00::1".parse().ok());
    }

    #[test]
    fn what_go_refused_stays_refused() {
        for bad in [
            "256.0.0.1",
            "1.2.3",
            "1.2.3.4.5",
            "1..2.3",
            "1.2.3.0400",
            "0x10.0.0.1",
            "+1.2.3.4",
            "1.2.3.4 ",
            "",
            "1.2.3.-1",
            "::ffff:1.2.3.256",
            "fd00::1::2",
        ] {
            assert_eq!(parse_ip(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn cidrs_take_sloppy_addresses_and_prefixes() {
        assert_eq!(parse_cidr("010.000.0.0/08"), Some((v4("10.0.0.0").unwrap(), 8)));
        assert_eq!(parse_cidr("10.0.0.0/32"), Some((v4("10.0.0.0").unwrap(), 32)));
        assert_eq!(parse_cidr("fd00::/64"), Some(("fd00::".parse().unwrap(), 64)));
        for bad in ["10.0.0.0/33", "10.0.0.0/", "10.0.0.0", "10.0.0.0/-1", "10.0.0.0/8/8", "fd00::/129", "10.0.0.256/8"] {
            assert_eq!(parse_cidr(bad), None, "{bad:?}");
        }
    }
}
