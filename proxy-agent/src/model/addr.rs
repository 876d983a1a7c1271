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

/// `fe80::/10`: an IPv6 interface's own scope, never a Service's, an endpoint's or a NodePort's
/// address.
pub fn is_v6_link_local(a: IpAddr) -> bool {
    matches!(a, IpAddr::V6(v) if v.segments()[0] & 0xffc0 == 0xfe80)
}

/// An address family. Kubernetes names them `IPv4` and `IPv6` (`spec.ipFamilies`, an
/// EndpointSlice's `addressType`); kube-proxy runs one proxier per family, and so do the
/// netfilter modes here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    #[default]
    V4,
    V6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    pub fn of(a: IpAddr) -> Self {
        if a.is_ipv4() {
            Self::V4
        } else {
            Self::V6
        }
    }

    /// The family's name in the Kubernetes API.
    pub fn api_name(self) -> &'static str {
        match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        }
    }

    /// Address width in bits.
    pub fn bits(self) -> u8 {
        match self {
            Self::V4 => 32,
            Self::V6 => 128,
        }
    }

    /// The loopback range (`127.0.0.0/8`, `::1/128`).
    pub fn loopback(self) -> Cidr {
        match self {
            Self::V4 => Cidr { addr: IpAddr::V4(Ipv4Addr::new(127, 0, 0, 0)), prefix: 8 },
            Self::V6 => Cidr::host(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.api_name())
    }
}

/// An address range of either family (`--nodeport-addresses`, `--cluster-cidr`,
/// loadBalancerSourceRanges, ServiceCIDRs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// An address as a number, IPv4 in the low 32 bits.
fn bits_of(a: IpAddr) -> u128 {
    match a {
        IpAddr::V4(v) => u128::from(u32::from(v)),
        IpAddr::V6(v) => u128::from(v),
    }
}

impl Cidr {
    /// The range holding `a` alone (`/32`, `/128`).
    pub fn host(a: IpAddr) -> Self {
        Self { addr: a, prefix: Family::of(a).bits() }
    }

    pub fn family(&self) -> Family {
        Family::of(self.addr)
    }

    /// The IPv4 range, for the eBPF dataplane's IPv4 maps.
    pub fn v4(&self) -> Option<(Ipv4Addr, u8)> {
        match self.addr {
            IpAddr::V4(a) => Some((a, self.prefix)),
            IpAddr::V6(_) => None,
        }
    }

    fn mask(&self) -> u128 {
        let width = u32::from(self.family().bits());
        let full = u128::MAX >> (128 - width);
        // The host bits cleared (none at /0's shift of 0, all kept at the full width).
        full & !full.checked_shr(u32::from(self.prefix)).unwrap_or(0)
    }

    /// The same range written with its network address (`10.1.2.3/8` -> `10.0.0.0/8`).
    pub fn network(self) -> Self {
        let n = bits_of(self.addr) & self.mask();
        let addr = match self.addr {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(n as u32)),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(n)),
        };
        Self { addr, prefix: self.prefix }
    }

    /// `a` is in the range (never across families).
    pub fn contains(&self, a: IpAddr) -> bool {
        Family::of(a) == self.family() && bits_of(a) & self.mask() == bits_of(self.addr) & self.mask()
    }

    /// The range's mask written as an address (`10.0.0.0/8` -> `255.0.0.0`).
    pub fn netmask(&self) -> IpAddr {
        match self.addr {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(self.mask() as u32)),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(self.mask())),
        }
    }

    /// The smallest range holding every one of `ranges`, written with its network address;
    /// None when there are none or they are of both families.
    pub fn covering(ranges: &[Cidr]) -> Option<Cidr> {
        let first = *ranges.first()?;
        if ranges.iter().any(|c| c.family() != first.family()) {
            return None;
        }
        let at = |c: &Cidr, prefix| Cidr { addr: c.addr, prefix }.network();
        let mut prefix = ranges.iter().map(|c| c.prefix).min()?;
        while prefix > 0 && ranges.iter().any(|c| at(c, prefix) != at(&first, prefix)) {
            prefix -= 1;
        }
        Some(at(&first, prefix))
    }

    /// True when one of `ranges` holds one of `addrs` (loadBalancerSourceRanges holding a node
    /// address, which then admit the load balancer's own address too, as kube-proxy does).
    pub fn any_contains(ranges: &[Cidr], addrs: &[IpAddr]) -> bool {
        ranges.iter().any(|r| addrs.iter().any(|a| r.contains(*a)))
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, p) = s.split_once('/').ok_or_else(|| format!("{s:?} is not a CIDR (address/prefix)"))?;
        // Read as kube-proxy reads CIDRs (ParseCIDRSloppy): leading zeros are decimal.
        let Some(addr) = parse_ip(a) else {
            return Err(format!("{s:?}: {a:?} is not an IP address"));
        };
        match parse_cidr(s) {
            Some((_, prefix)) => Ok(Self { addr, prefix }),
            None => Err(format!("{s:?}: prefix {p:?} is not 0-{}", Family::of(addr).bits())),
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
    fn the_range_covering_others_is_their_longest_common_prefix() {
        let c = |s: &str| s.parse::<Cidr>().unwrap();
        let covering = |r: &[&str]| Cidr::covering(&r.iter().map(|s| c(s)).collect::<Vec<_>>()).map(|c| c.to_string());
        assert_eq!(covering(&["10.96.0.0/12"]).as_deref(), Some("10.96.0.0/12"));
        assert_eq!(covering(&["10.96.0.0/16", "10.100.0.0/24"]).as_deref(), Some("10.96.0.0/13"));
        assert_eq!(covering(&["10.96.0.0/16", "192.168.0.0/24"]).as_deref(), Some("0.0.0.0/0"));
        assert_eq!(covering(&["fd00:10:96::/112"]).as_deref(), Some("fd00:10:96::/112"));
        assert_eq!(covering(&["fd00:10:96::/112", "fd00:10:97::/108"]).as_deref(), Some("fd00:10:96::/47"));
        assert_eq!(covering(&["fd00:10:96::/112", "2001:db8::/112"]).as_deref(), Some("::/0"));
        assert_eq!(covering(&["10.96.0.0/12", "fd00:10:96::/112"]), None, "one family at a time");
        assert_eq!(covering(&[]), None);
        assert_eq!(c("10.96.0.0/12").netmask(), v4("255.240.0.0").unwrap());
        assert_eq!(c("fd00:10:96::/112").netmask(), "ffff:ffff:ffff:ffff:ffff:ffff:ffff:0".parse::<IpAddr>().unwrap());
        assert_eq!(c("::/0").netmask(), "::".parse::<IpAddr>().unwrap());
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
