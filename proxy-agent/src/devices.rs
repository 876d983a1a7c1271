//! Which interfaces the dataplane hooks, and in which role, from what netlink reports: pod
//! interfaces by name (`--pod-devices`), external ones by name (`--devices`) or, by default,
//! those that carry a global address (the node's addresses, and so its default route).
//! Also the node's addresses, which NodePorts are served on, and the addresses (one per
//! family) each external interface gives north-south SNAT.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use crate::{
    dataplane::ebpf::{
        attach::{DevicePatterns, Role, XdpSetting},
        xdpdevs::XdpDevice,
        EbpfDataplane,
    },
    netlink::{LinkChange, SourceUse},
};

/// Never external by default: loopback, container bridges and overlay or tunnel devices hold
/// addresses but do not face the network the node serves NodePorts on.
const NOT_EXTERNAL: &[&str] =
    &["lo", "docker*", "cni*", "br-*", "virbr*", "kube-ipvs0", "flannel*", "cilium_*", "tunl*", "vxlan*", "genev*", "wg*", "nodelocaldns"];

/// What an interface's address is good for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AddrKind {
    /// Scope universe.
    global: bool,
    /// As a source address.
    source: SourceUse,
}

/// An external interface's SNAT address of each family as written to its map (None: not
/// known to be written).
type Written = (Option<Option<Ipv4Addr>>, Option<Option<Ipv6Addr>>);

pub struct Devices {
    pod: DevicePatterns,
    /// `--devices`; None: automatic.
    external: Option<DevicePatterns>,
    not_external: DevicePatterns,
    xdp: XdpSetting,
    pub links: BTreeMap<u32, String>,
    /// Addresses per interface (both families).
    addrs: BTreeMap<u32, BTreeMap<IpAddr, AddrKind>>,
    /// Interfaces to attach again (the last try failed).
    pub failed: BTreeMap<u32, String>,
    /// What the interface-address maps hold, per external interface and family (None: not
    /// written yet, or the last write failed).
    snat_addrs: BTreeMap<u32, Written>,
    /// Why native XDP on an external interface hands its flows to TC, as last logged.
    xdp_to_tc: BTreeMap<u32, Option<&'static str>>,
    /// The interface-address maps hold entries of present interfaces only (false until the
    /// first sync has removed those of interfaces gone before the agent started, and again
    /// whenever one goes).
    addresses_pruned: bool,
    /// Interfaces reported gone since the maps were last pruned: their SNAT addresses go even
    /// when another interface has already taken the index.
    gone: std::collections::BTreeSet<u32>,
}

impl Devices {
    pub fn new(pod: DevicePatterns, external: Option<DevicePatterns>, xdp: XdpSetting) -> Self {
        let not_external =
            DevicePatterns::parse(&NOT_EXTERNAL.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("built-in patterns are valid");
        Self {
            pod,
            external,
            not_external,
            xdp,
            links: BTreeMap::new(),
            addrs: BTreeMap::new(),
            failed: BTreeMap::new(),
            snat_addrs: BTreeMap::new(),
            xdp_to_tc: BTreeMap::new(),
            addresses_pruned: false,
            gone: Default::default(),
        }
    }

    /// The global addresses of an interface (both families): what makes it external.
    fn global_addrs(&self, index: u32) -> impl Iterator<Item = (IpAddr, SourceUse)> + '_ {
        self.addrs.get(&index).into_iter().flatten().filter(|(_, k)| k.global).map(|(a, k)| (*a, k.source))
    }

    /// The SNAT source of each family on an interface: of its global addresses, one the kernel
    /// would pick as a source itself, else an IPv4 secondary or a temporary or deprecated IPv6
    /// one (a temporary address goes away within a day, taking the flows masqueraded with it),
    /// never a tentative one or one that failed duplicate address detection (another host's).
    fn snat_addrs_of(&self, index: u32) -> (Option<Ipv4Addr>, Option<Ipv6Addr>) {
        let best =
            |v6: bool| self.global_addrs(index).filter(|(a, s)| a.is_ipv6() == v6 && *s != SourceUse::Never).min_by_key(|(a, s)| (*s, *a));
        let v4 = match best(false) {
            Some((IpAddr::V4(v), _)) => Some(v),
            _ => None,
        };
        let v6 = match best(true) {
            Some((IpAddr::V6(v), _)) => Some(v),
            _ => None,
        };
        (v4, v6)
    }

    /// The role `name` should have, if any. Pod patterns win.
    pub fn role(&self, index: u32, name: &str) -> Option<Role> {
        if self.pod.matches(name) {
            return Some(Role::Pod);
        }
        let external = match &self.external {
            Some(p) => p.matches(name),
            None => !self.not_external.matches(name) && self.global_addrs(index).next().is_some(),
        };
        external.then_some(Role::External)
    }

    /// Every address of the node (both families) but loopback ones: where NodePorts are served
    /// by default. (The store leaves IPv6 link-local ones out.)
    pub fn node_addresses(&self) -> Vec<IpAddr> {
        // Service addresses IPVS mode binds to its dummy interface are not the node's.
        let mut v: Vec<IpAddr> = self
            .addrs
            .iter()
            .filter(|(index, _)| self.links.get(index).map(String::as_str) != Some(crate::dataplane::netfilter::ipvs::DUMMY))
            .flat_map(|(_, addrs)| addrs.keys().copied())
            .filter(|a| !a.is_loopback())
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Applies a netlink change. True when the node's addresses changed.
    pub fn apply(&mut self, change: &LinkChange) -> bool {
        match change {
            LinkChange::Present { index, name } => {
                self.links.insert(*index, name.clone());
                false
            }
            LinkChange::Gone { index } => {
                self.links.remove(index);
                self.gone.insert(*index);
                self.addresses_pruned = false;
                self.failed.remove(index);
                self.snat_addrs.remove(index);
                self.addrs.remove(index).is_some_and(|a| !a.is_empty())
            }
            LinkChange::Address { index, addr, global, source, added } => {
                let on_dummy = self.links.get(index).map(String::as_str) == Some(crate::dataplane::netfilter::ipvs::DUMMY);
                let set = self.addrs.entry(*index).or_default();
                // A change of flags (an address deprecated, its duplicate detection done) is a
                // new message for the same address: only its presence is a change of the
                // node's addresses.
                let changed = if *added {
                    set.insert(*addr, AddrKind { global: *global, source: *source }).is_none()
                } else {
                    set.remove(addr).is_some()
                };
                changed && !on_dummy
            }
        }
    }

    /// Something a sync should retry without waiting for a netlink event: an attach, or the
    /// removal of vanished interfaces' SNAT addresses.
    pub fn retry_due(&self) -> bool {
        !self.failed.is_empty() || !self.addresses_pruned
    }

    /// Attaches to every interface that should be and is not yet, follows renames, detaches
    /// vanished ones, and keeps the SNAT address of each external interface current.
    pub fn sync(&mut self, dp: &mut EbpfDataplane) {
        let gone: Vec<u32> = dp.attached().keys().filter(|i| !self.links.contains_key(i)).copied().collect();
        for index in gone {
            if let Some(name) = dp.forget_interface(index) {
                tracing::info!(interface = name, ifindex = index, "interface gone");
            }
        }
        // The SNAT addresses of interfaces that are gone: their index may come back as another
        // interface, which must not masquerade with the old one's address (its own are written
        // below, where it is external).
        if !self.addresses_pruned {
            match dp.prune_interface_addresses(|i| self.links.contains_key(&i) && !self.gone.contains(&i)) {
                Ok(n) => {
                    if n > 0 {
                        tracing::info!(entries = n, "removed the SNAT addresses of interfaces that are gone");
                    }
                    self.addresses_pruned = true;
                    self.gone.clear();
                }
                Err(e) => tracing::warn!("removing the SNAT addresses of interfaces that are gone (retried): {e}"),
            }
        }
        for (index, name) in self.links.clone() {
            if dp.is_attached(index) {
                dp.interface_renamed(index, &name);
                continue;
            }
            let Some(role) = self.role(index, &name) else { continue };
            match dp.attach(index, &name, role, self.xdp) {
                Ok(()) => {
                    self.failed.remove(&index);
                }
                Err(e) => {
                    if self.failed.insert(index, name).is_none() {
                        tracing::error!("{e}; retrying every 5 s");
                    }
                }
            }
        }
        let externals: Vec<u32> = dp.external_interfaces();
        for index in externals {
            let (want4, want6) = self.snat_addrs_of(index);
            // A failed write is retried at the next sync (its family stays unknown).
            let have = self.snat_addrs.entry(index).or_default();
            if have.0 != Some(want4) {
                match dp.set_interface_address(index, want4) {
                    Ok(()) => {
                        tracing::info!(ifindex = index, address = ?want4, "north-south IPv4 SNAT address of external interface");
                        have.0 = Some(want4);
                    }
                    Err(e) => tracing::error!(ifindex = index, "recording the interface's IPv4 address for SNAT: {e}"),
                }
            }
            if have.1 != Some(want6) {
                match dp.set_interface_address6(index, want6) {
                    Ok(()) => {
                        tracing::info!(ifindex = index, address = ?want6, "north-south IPv6 SNAT address of external interface");
                        have.1 = Some(want6);
                    }
                    Err(e) => tracing::error!(ifindex = index, "recording the interface's IPv6 address for SNAT: {e}"),
                }
            }
        }
    }
}

impl Devices {
    /// Records what native XDP may send out of each interface (see `xdpdevs`) and says, once
    /// per change, when XDP on an external interface has to hand the flows leaving by it to TC.
    pub fn sync_xdp(&mut self, dp: &mut EbpfDataplane, devices: &BTreeMap<u32, XdpDevice>) {
        let flags = devices.iter().map(|(i, d)| (*i, d.flags())).collect();
        if let Err(e) = dp.set_xdp_devices(&flags) {
            tracing::error!("recording what XDP may send out of each interface: {e}; XDP hands the flows it cannot send to TC");
        }
        if self.xdp == XdpSetting::Disabled {
            return;
        }
        self.xdp_to_tc.retain(|i, _| devices.contains_key(i));
        for index in dp.external_interfaces() {
            let Some(dev) = devices.get(&index) else { continue };
            let why = dev.why_not_native();
            if self.xdp_to_tc.get(&index) == Some(&why) {
                continue;
            }
            match why {
                Some(why) => tracing::warn!(
                    interface = dev.name,
                    "XDP hands the north-south flows leaving by {} to TC instead of sending them itself: {why} \
                     (attach an XDP program to the peer, or use --xdp generic)",
                    dev.name
                ),
                None if self.xdp_to_tc.contains_key(&index) => {
                    tracing::info!(interface = dev.name, "XDP sends north-south flows out of {} itself again", dev.name)
                }
                None => {}
            }
            self.xdp_to_tc.insert(index, why);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_addresses_on_the_ipvs_dummy_are_not_node_addresses() {
        let mut d = Devices::new(DevicePatterns::parse(&[]).unwrap(), None, XdpSetting::Disabled);
        let addr = |index, a: &str, added| LinkChange::Address {
            index,
            addr: a.parse().unwrap(),
            global: true,
            source: SourceUse::Preferred,
            added,
        };
        d.apply(&LinkChange::Present { index: 2, name: "eth0".into() });
        d.apply(&LinkChange::Present { index: 7, name: "kube-ipvs0".into() });
        assert!(d.apply(&addr(2, "192.168.1.10", true)), "a node address is a change");
        assert!(!d.apply(&addr(7, "10.96.0.10", true)), "a VIP bound by IPVS mode is not");
        assert_eq!(d.node_addresses(), vec![IpAddr::V4(Ipv4Addr::new(192, 168, 1, 10))]);
        assert!(d.apply(&addr(2, "192.168.1.10", false)));
        assert!(d.node_addresses().is_empty());
    }

    #[test]
    fn the_snat_source_is_an_address_the_kernel_would_pick_and_follows_its_flags() {
        let mut d = Devices::new(DevicePatterns::parse(&[]).unwrap(), None, XdpSetting::Disabled);
        let addr = |a: &str, source| LinkChange::Address { index: 2, addr: a.parse().unwrap(), global: true, source, added: true };
        use SourceUse::{Fallback, Never, Preferred};
        d.apply(&LinkChange::Present { index: 2, name: "eth0".into() });
        assert!(d.apply(&addr("2001:db8::1", Fallback)), "a new address is a change of the node's addresses");
        assert!(d.apply(&addr("2001:db8::9", Preferred)));
        assert!(d.apply(&addr("192.0.2.3", Fallback)));
        assert!(d.apply(&addr("192.0.2.9", Preferred)));
        let want = |v4: &str, v6: &str| (Some(v4.parse().unwrap()), Some(v6.parse().unwrap()));
        assert_eq!(d.snat_addrs_of(2), want("192.0.2.9", "2001:db8::9"), "preferred ones before numerically smaller ones");
        // ::9 deprecated, ::1 usable again: new flags for known addresses, not new addresses.
        assert!(!d.apply(&addr("2001:db8::9", Fallback)));
        assert!(!d.apply(&addr("2001:db8::1", Preferred)));
        assert_eq!(d.snat_addrs_of(2), want("192.0.2.9", "2001:db8::1"));
        // With none preferred, a fallback one serves; a tentative one never does.
        assert!(!d.apply(&addr("2001:db8::1", Never)));
        assert_eq!(d.snat_addrs_of(2).1, Some("2001:db8::9".parse().unwrap()));
        assert!(!d.apply(&addr("2001:db8::9", Never)));
        assert_eq!(d.snat_addrs_of(2).1, None, "only tentative or failed addresses: none");
    }
}
