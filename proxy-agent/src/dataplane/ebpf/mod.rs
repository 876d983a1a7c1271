//! The eBPF dataplane: the embedded TC program, its pinned maps and links.

pub mod adopt;
pub mod attach;
pub mod batch;
pub mod ct_filter;
pub mod ct_gc;
pub mod filter;
pub mod frontends;
pub mod hostsock;
pub mod ids;
pub mod lbmaps;
pub mod loader;
pub mod maglev;
pub mod reconcile;
pub mod snapshot;
pub mod tables;
pub mod xdpdevs;

use std::path::{Path, PathBuf};

use aya::{
    maps::{Array, MapData},
    programs::SchedClassifier,
    Ebpf,
};
use proxy_common::{map_names, prog_names, user::MapAddr, Config, IfAddr};

use self::{
    attach::{AttachError, Attachments, Role, XdpSetting},
    lbmaps::LbMaps,
    loader::{LoadError, LoadOptions},
};
use super::{Dataplane, DataplaneError};
use crate::model::{store::Cidr, Frontend, FrontendKey};
use std::net::IpAddr;

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Maps(#[from] DataplaneError),
    #[error("{0}")]
    Config(String),
}

pub struct EbpfDataplane {
    ebpf: Ebpf,
    lb: LbMaps,
    /// The IPv6 frontends' maps (served to pods and host processes so far: see `proxy_ebpf`'s `family`).
    lb6: LbMaps<proxy_common::Ip6>,
    /// The IPv6 conntrack table was made small (`LoadOptions::ipv6` false); said once when an
    /// IPv6 frontend is programmed all the same.
    ipv6_tables_small: bool,
    pin_root: Option<PathBuf>,
    attachments: Attachments,
    /// The socket hooks' links (see `hostsock`).
    host_sockets: Vec<aya::programs::links::FdLink>,
    /// The pins stay when the agent stops (false: they are on a bpffs private to its mount
    /// namespace).
    pins_outlive_agent: bool,
    /// What `XDP_DEVS_V1` holds: interface index -> `xdp_dev` flags (none are 0).
    xdp_devs: std::collections::BTreeMap<u32, u32>,
    /// `LbMaps::entries_changed` of both families when the flow cache's generation last moved
    /// on for them (`after_lb_write`).
    lb_changes_seen: u64,
    /// `FLOW_GEN_V1`'s value, mapped (see `invalidate_cached_flows`).
    flow_gen: batch::Mapped,
    /// What `CONFIG_V3` holds.
    config: Config,
    /// Entries the load-balancer maps and each family's conntrack map hold at most, as the
    /// kernel has them.
    capacities: crate::telemetry::MapCapacities,
    /// What `LB4_SVCCIDR_V1` holds: (prefix length, address) -> `svc_cidr` value; read from the
    /// map the first time (a previous run's pins).
    svc_cidrs: Option<SvcCidrs<[u8; 4]>>,
    /// The same of `LB6_SVCCIDR_V1`.
    svc_cidrs6: Option<SvcCidrs<proxy_common::Ip6>>,
    /// Maps of an older build still in use by its attached programs (`loader::Loaded`).
    _retired: Vec<MapData>,
    /// The conntrack lifetimes the programs were loaded with.
    ct_lifetimes: proxy_common::ct::Lifetimes,
}

/// A Service CIDR map's entries: (prefix length, address) -> `svc_cidr` value.
type SvcCidrs<A> = std::collections::BTreeMap<(u8, A), u8>;

/// How one family's Service CIDR check is switched in `CONFIG_V3`, for `write_ranges`.
struct CheckSwitch {
    /// The config with the check on for the new ranges, and with it off.
    on: Config,
    off: Config,
    /// The check must go off before the entries change (the ranges go, or its prefilter
    /// changes).
    off_first: bool,
}

impl EbpfDataplane {
    /// Loads the programs, creates or adopts the pinned maps and reads back what they hold.
    pub fn load(options: LoadOptions) -> Result<Self, EbpfError> {
        let maglev_size = options.maglev_size;
        if !maglev::is_prime(maglev_size) || maglev_size > (1 << 20) {
            return Err(EbpfError::Config(format!(
                "--maglev-table-size {maglev_size} must be a prime no larger than 1048576 (e.g. 16381, 65521)"
            )));
        }
        let loader::Loaded {
            mut ebpf,
            outlives_agent: pins_outlive_agent,
            lb_map_max: lb_max,
            lb6_map_max: lb6_max,
            ct_map_max: ct_max,
            ct6_map_max: ct6_max,
            retired,
        } = loader::load(&options)?;
        // Maps adopted from a previous run keep their size: ids and the fill gauges follow the
        // kernel's, not the option.
        for (what, asked, held) in [("--lb-map-max", options.lb_map_max, lb_max), ("--ct-map-max", options.ct_map_max, ct_max)] {
            if asked.max(2) != held {
                tracing::warn!(
                    "{what} {asked} differs from the {held} entries of the maps a previous run pinned, which are kept (their \
                     connections with them); `proxy-agent cleanup` before the start resizes them"
                );
            }
        }
        if lb6_max != lb_max {
            tracing::warn!(
                "the IPv6 load-balancer maps a previous run pinned hold {lb6_max} entries where the IPv4 ones hold {lb_max}; each \
                 family keeps its own (`proxy-agent cleanup` before the start makes them one size again)"
            );
        }
        let lb = LbMaps::adopt(&mut ebpf, lb_max, maglev_size)?;
        let lb6 = LbMaps::adopt(&mut ebpf, lb6_max, maglev_size)?;
        // The Service CIDR check stays as a previous run left it until the first sync (off
        // where the config map is new: the first start, or an upgrade that changed its layout).
        // The options' settings over what the map holds.
        let mut config = options.config();
        {
            let map = ebpf.map(map_names::CONFIG).expect("the object defines the config map");
            if let Ok(old) = Array::<&MapData, Config>::try_from(map).and_then(|a| a.get(&0, 0)) {
                let Config { maglev_size, snat_port_min, snat_port_max, .. } = config;
                config = Config { maglev_size, snat_port_min, snat_port_max, ..old };
            }
        }
        let flow_gen = {
            let fail = |source| loader::LoadError::Fill { what: format!("{}, mapped", map_names::FLOW_GEN), source };
            match ebpf.map(map_names::FLOW_GEN) {
                Some(aya::maps::Map::Array(data)) => {
                    batch::Mapped::of(std::os::fd::AsFd::as_fd(data.fd()), size_of::<proxy_common::ct::FlowGen>()).map_err(fail)?
                }
                _ => return Err(fail(std::io::Error::other("the object has no such array")).into()),
            }
        };
        let mut me = Self {
            ebpf,
            lb,
            lb6,
            ipv6_tables_small: !options.ipv6,
            pin_root: options.pin_root,
            attachments: Attachments::default(),
            host_sockets: Vec::new(),
            xdp_devs: Default::default(),
            lb_changes_seen: 0,
            flow_gen,
            pins_outlive_agent,
            config,
            svc_cidrs: None,
            svc_cidrs6: None,
            _retired: retired,
            ct_lifetimes: options.ct_lifetimes,
            capacities: crate::telemetry::MapCapacities {
                lb: u64::from(lb_max),
                lb6: u64::from(lb6_max),
                ct: u64::from(ct_max),
                ct6: u64::from(ct6_max),
            },
        };
        me.write_config(config)?;
        Ok(me)
    }

    fn write_config(&mut self, config: Config) -> Result<(), DataplaneError> {
        let map = self.ebpf.map_mut(map_names::CONFIG).expect("the object defines the config map");
        let mut array: Array<&mut MapData, Config> =
            Array::try_from(map).map_err(|source| DataplaneError::Map { op: "open", map: map_names::CONFIG, source })?;
        array.set(0, config, 0).map_err(|source| DataplaneError::Map { op: "update", map: map_names::CONFIG, source })?;
        self.config = config;
        Ok(())
    }

    /// See `Dataplane::set_cluster_ip_ranges`: each family's ranges and allocated cluster IPs
    /// in its own map, each family's check switched in `CONFIG_V3` behind a prefilter, the
    /// ranges' common prefix.
    fn write_cluster_ip_ranges(
        &mut self,
        cidrs: &[Cidr],
        allocated: &std::collections::BTreeSet<std::net::IpAddr>,
    ) -> Result<(), DataplaneError> {
        let v4: Vec<Cidr> = cidrs.iter().copied().filter(|c| c.v4().is_some()).collect();
        let (net, mask) = common_prefix(&v4);
        let c = self.config;
        let switch = CheckSwitch {
            on: Config { svc_net: net, svc_mask: mask, svc_cidrs: v4.len() as u32, ..c },
            off: Config { svc_net: [0; 4], svc_mask: [0; 4], svc_cidrs: 0, ..c },
            off_first: c.svc_cidrs != 0 && (v4.is_empty() || (c.svc_net, c.svc_mask) != (net, mask)),
        };
        let held = self.svc_cidrs.take();
        let (held, v4_result) = self.write_ranges(&v4, allocated, held, switch);
        self.svc_cidrs = held;
        let v6: Vec<Cidr> = cidrs.iter().copied().filter(|c| c.v4().is_none()).collect();
        let (net, mask) = common_prefix(&v6);
        let c = self.config;
        let none = proxy_common::Ip6::default();
        let switch = CheckSwitch {
            on: Config { svc_net6: net, svc_mask6: mask, svc_cidrs6: v6.len() as u32, ..c },
            off: Config { svc_net6: none, svc_mask6: none, svc_cidrs6: 0, ..c },
            off_first: c.svc_cidrs6 != 0 && (v6.is_empty() || (c.svc_net6, c.svc_mask6) != (net, mask)),
        };
        let held = self.svc_cidrs6.take();
        let (held, v6_result) = self.write_ranges(&v6, allocated, held, switch);
        self.svc_cidrs6 = held;
        v4_result.and(v6_result)
    }

    /// One family's part of `write_cluster_ip_ranges`: `cidrs` are that family's. Make-before-
    /// break: new entries are written before the check is switched on or widened, and the check
    /// is narrowed or switched off before entries go. Returns what the map holds afterwards
    /// (also when something failed: the next call diffs it), `held` being what it held (None:
    /// read it).
    fn write_ranges<A: MapAddr>(
        &mut self,
        cidrs: &[Cidr],
        allocated: &std::collections::BTreeSet<std::net::IpAddr>,
        held: Option<SvcCidrs<A>>,
        switch: CheckSwitch,
    ) -> (Option<SvcCidrs<A>>, Result<(), DataplaneError>) {
        use aya::maps::lpm_trie::{Key, LpmTrie};
        use proxy_common::{svc_cidr, SvcCidrKey};
        let name = A::LB.service_cidrs;
        let err = |op, source| DataplaneError::Map { op, map: name, source };
        let mut want: SvcCidrs<A> = cidrs.iter().filter_map(|c| Some(((c.prefix, A::from_ip(c.addr)?), svc_cidr::RANGE))).collect();
        for ip in allocated.iter().filter(|ip| cidrs.iter().any(|c| c.contains(**ip))) {
            if let Some(a) = A::from_ip(*ip) {
                want.insert((A::BITS, a), svc_cidr::ALLOCATED);
            }
        }
        if switch.off_first {
            if let Err(e) = self.write_config(switch.off) {
                return (held, Err(e));
            }
        }
        fn open<'a, A: MapAddr>(
            ebpf: &'a mut aya::Ebpf,
            name: &'static str,
        ) -> Result<LpmTrie<&'a mut MapData, SvcCidrKey<A>, u8>, DataplaneError> {
            let map = ebpf.map_mut(name).expect("the object defines the Service CIDR maps");
            LpmTrie::try_from(map).map_err(|source| DataplaneError::Map { op: "open", map: name, source })
        }
        let mut trie = match open::<A>(&mut self.ebpf, name) {
            Ok(t) => t,
            Err(e) => return (held, Err(e)),
        };
        let have = match held {
            Some(h) => h,
            None => trie
                .keys()
                .filter_map(Result::ok)
                .filter_map(|k| Some(((k.prefix_len() as u8, k.data().addr), trie.get(&k, 0).ok()?)))
                .collect(),
        };
        // What the map holds as this goes.
        let mut now = have.clone();
        for ((prefix, addr), value) in to_write(&want, &have) {
            if let Err(e) = trie.insert(&Key::new(u32::from(prefix), SvcCidrKey { addr }), value, 0) {
                return (Some(now), Err(err("insert", e)));
            }
            now.insert((prefix, addr), value);
        }
        if !cidrs.is_empty() && self.config != switch.on {
            if let Err(e) = self.write_config(switch.on) {
                return (Some(now), Err(e));
            }
            trie = match open::<A>(&mut self.ebpf, name) {
                Ok(t) => t,
                Err(e) => return (Some(now), Err(e)),
            };
        }
        for key in have.keys().filter(|k| !want.contains_key(*k)) {
            match trie.remove(&Key::new(u32::from(key.0), SvcCidrKey { addr: key.1 })) {
                Ok(()) => {
                    now.remove(key);
                }
                Err(e) if lbmaps::is_not_found(&e) => {
                    now.remove(key);
                }
                Err(e) => return (Some(now), Err(err("delete", e))),
            }
        }
        (Some(now), Ok(()))
    }

    /// Records the address SNAT uses on IPv4 flows leaving by external interface `ifindex`
    /// (None: the interface has no IPv4 address any more).
    pub fn set_interface_address(&mut self, ifindex: u32, addr: Option<std::net::Ipv4Addr>) -> Result<(), DataplaneError> {
        self.write_interface_address(map_names::IFADDRS, ifindex, addr.map(|a| a.octets()))
    }

    /// The same for IPv6 flows.
    pub fn set_interface_address6(&mut self, ifindex: u32, addr: Option<std::net::Ipv6Addr>) -> Result<(), DataplaneError> {
        self.write_interface_address(map_names::IFADDRS6, ifindex, addr.map(|a| proxy_common::Ip6::from_bytes(a.octets())))
    }

    /// Deletes the interface-address entries (both families) of interfaces that are not
    /// `present` (gone while the agent ran, or before it started). Returns how many went.
    pub fn prune_interface_addresses(&mut self, present: impl Fn(u32) -> bool) -> Result<usize, DataplaneError> {
        Ok(self.prune_interface_addresses_of::<[u8; 4]>(map_names::IFADDRS, &present)?
            + self.prune_interface_addresses_of::<proxy_common::Ip6>(map_names::IFADDRS6, &present)?)
    }

    fn prune_interface_addresses_of<A: MapAddr>(
        &mut self,
        name: &'static str,
        present: &dyn Fn(u32) -> bool,
    ) -> Result<usize, DataplaneError> {
        let map = self.ebpf.map_mut(name).expect("the object defines the interface address maps");
        let err = |op, source| DataplaneError::Map { op, map: name, source };
        let mut m: aya::maps::HashMap<&mut MapData, u32, IfAddr<A>> = aya::maps::HashMap::try_from(map).map_err(|e| err("open", e))?;
        let keys: Vec<u32> = m.keys().collect::<Result<_, _>>().map_err(|e| err("iterate", e))?;
        let gone: Vec<u32> = keys.into_iter().filter(|i| !present(*i)).collect();
        for index in &gone {
            match m.remove(index) {
                Ok(()) => {}
                Err(e) if lbmaps::is_not_found(&e) => {}
                Err(e) => return Err(err("delete", e)),
            }
        }
        Ok(gone.len())
    }

    fn write_interface_address<A: MapAddr>(&mut self, name: &'static str, ifindex: u32, addr: Option<A>) -> Result<(), DataplaneError> {
        let map = self.ebpf.map_mut(name).expect("the object defines the interface address maps");
        let err = |op, source| DataplaneError::Map { op, map: name, source };
        let mut m: aya::maps::HashMap<&mut MapData, u32, IfAddr<A>> = aya::maps::HashMap::try_from(map).map_err(|e| err("open", e))?;
        match addr {
            Some(addr) => m.insert(ifindex, IfAddr { addr }, 0).map_err(|e| err("update", e)),
            None => match m.remove(&ifindex) {
                Ok(()) => Ok(()),
                Err(e) if lbmaps::is_not_found(&e) => Ok(()),
                Err(e) => Err(err("delete", e)),
            },
        }
    }

    /// Records what native XDP may send out of each interface (`xdpdevs`): the entries that
    /// changed are written, those of interfaces gone or now unable are deleted. A stale map
    /// (adopted from a previous run) is rewritten whole the first time.
    pub fn set_xdp_devices(&mut self, want: &std::collections::BTreeMap<u32, u32>) -> Result<(), DataplaneError> {
        let mut changed = false;
        let written = self.write_xdp_devices(want, &mut changed);
        if changed {
            // A step XDP cached may rest on a device's old entry.
            self.invalidate_cached_flows();
        }
        written
    }

    fn write_xdp_devices(&mut self, want: &std::collections::BTreeMap<u32, u32>, changed: &mut bool) -> Result<(), DataplaneError> {
        let map = self.ebpf.map_mut(map_names::XDP_DEVS).expect("the object defines the XDP device map");
        let err = |op, source| DataplaneError::Map { op, map: map_names::XDP_DEVS, source };
        let mut m: aya::maps::HashMap<&mut MapData, u32, u32> = aya::maps::HashMap::try_from(map).map_err(|e| err("open", e))?;
        let want: std::collections::BTreeMap<u32, u32> = want.iter().filter(|(_, f)| **f != 0).map(|(i, f)| (*i, *f)).collect();
        if self.xdp_devs.is_empty() {
            self.xdp_devs = m.iter().flatten().collect();
        }
        for (index, flags) in &want {
            if self.xdp_devs.get(index) != Some(flags) {
                *changed = true;
                m.insert(index, flags, 0).map_err(|e| err("update", e))?;
            }
        }
        for index in self.xdp_devs.keys().filter(|i| !want.contains_key(i)) {
            *changed = true;
            match m.remove(index) {
                Ok(()) => {}
                Err(e) if lbmaps::is_not_found(&e) => {}
                Err(e) => return Err(err("delete", e)),
            }
        }
        self.xdp_devs = want;
        Ok(())
    }

    /// Moves the generation the flow caches are valid under on (`map_names::FLOW_GEN`): no
    /// step cached before is used again (each flow's next packet takes the conntrack path).
    /// An atomic add to the agent's count, through the mapping: another agent on the node (a
    /// rollout that surges) moving it on at once loses nothing, nor does the datapath's count.
    pub fn invalidate_cached_flows(&self) {
        // SAFETY: the mapping holds a `FlowGen`, whose first field is the agent's count; only
        // agents change it, and only with atomic adds.
        let agent = unsafe { std::sync::atomic::AtomicU32::from_ptr(self.flow_gen.ptr().cast()) };
        agent.fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    /// After a write of the load-balancer maps: the flow cache's generation moves on if the
    /// write deleted or wrote over what a tracked flow's step reads (`LbMaps::entries_changed`).
    fn after_lb_write(&mut self) {
        let changed = self.lb.entries_changed() + self.lb6.entries_changed();
        if changed != self.lb_changes_seen {
            self.invalidate_cached_flows();
            self.lb_changes_seen = changed;
        }
    }

    /// `Dataplane::upsert` in the family's maps.
    fn upsert_family(&mut self, key: &FrontendKey, fe: &Frontend) -> Result<(), DataplaneError> {
        match key.addr {
            IpAddr::V4(_) => self.lb.upsert(key, fe),
            IpAddr::V6(_) => {
                if std::mem::take(&mut self.ipv6_tables_small) {
                    tracing::warn!(
                        frontend = %key,
                        "IPv6 Services are programmed, but the configuration names no IPv6 range (--cluster-cidr, \
                         --service-cluster-ip-range), so the IPv6 conntrack table holds {} entries: name the ranges so \
                         it is sized like IPv4's (--ct-map-max); the next start resizes it",
                        loader::IPV6_LRU_MAX_SMALL
                    );
                }
                self.lb6.upsert(key, fe)
            }
        }
    }

    /// Serves Services to the sockets of this network namespace in `cgroup` (and below it) with
    /// the socket hooks.
    pub fn serve_host_sockets(&mut self, cgroup: &Path) -> Result<(), hostsock::HostSockError> {
        if self.host_sockets.is_empty() {
            self.host_sockets = hostsock::attach(&mut self.ebpf, self.pin_root.as_deref(), cgroup)?;
        }
        Ok(())
    }

    /// Detaches the socket hooks, this run's and any a previous run pinned. Returns how many
    /// pinned links were removed.
    pub fn stop_serving_host_sockets(&mut self) -> usize {
        self.host_sockets.clear();
        hostsock::detach(&mut self.ebpf, self.pin_root.as_deref())
    }

    pub fn maglev(&self) -> &maglev::Maglev {
        self.lb.maglev()
    }

    pub fn pins_outlive_agent(&self) -> bool {
        self.pins_outlive_agent
    }

    pub fn pin_root(&self) -> Option<&Path> {
        self.pin_root.as_deref()
    }

    /// The ingress (DNAT) program.
    pub fn ingress_program(&mut self) -> &mut SchedClassifier {
        loader::classifier(&mut self.ebpf, prog_names::TC_INGRESS)
    }

    /// The egress (reverse NAT) program.
    pub fn egress_program(&mut self) -> &mut SchedClassifier {
        loader::classifier(&mut self.ebpf, prog_names::TC_EGRESS)
    }

    /// The object, for the maps the writer does not own (conntrack, counters).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    pub fn attach(&mut self, ifindex: u32, ifname: &str, role: Role, xdp: XdpSetting) -> Result<(), AttachError> {
        self.attachments.attach(&mut self.ebpf, self.pin_root.as_deref(), ifindex, ifname, role, xdp)
    }

    /// Indexes of the external interfaces attached.
    pub fn external_interfaces(&self) -> Vec<u32> {
        self.attachments.roles.iter().filter(|(_, r)| **r == Role::External).map(|(i, _)| *i).collect()
    }

    /// The external ingress program (north-south; `trace` runs packets through it).
    pub fn ext_ingress_program(&mut self) -> &mut SchedClassifier {
        loader::classifier(&mut self.ebpf, prog_names::TC_EXT_INGRESS)
    }

    /// The XDP program.
    pub fn xdp_program(&mut self) -> &mut aya::programs::Xdp {
        loader::xdp(&mut self.ebpf, prog_names::XDP_EXT)
    }

    pub fn interface_renamed(&mut self, ifindex: u32, ifname: &str) {
        self.attachments.renamed(self.pin_root.as_deref(), ifindex, ifname);
    }

    pub fn forget_interface(&mut self, ifindex: u32) -> Option<String> {
        self.attachments.forget(self.pin_root.as_deref(), ifindex)
    }

    pub fn is_attached(&self, ifindex: u32) -> bool {
        self.attachments.interfaces.contains_key(&ifindex)
    }

    pub fn attached(&self) -> &std::collections::BTreeMap<u32, String> {
        &self.attachments.interfaces
    }

    /// The maps' capacities (each family's), as the kernel has them.
    pub fn capacities(&self) -> crate::telemetry::MapCapacities {
        self.capacities
    }

    pub fn backend_count(&self) -> usize {
        self.lb.backend_count() + self.lb6.backend_count()
    }

    /// Entries counted in the kernel's maps (see `LbMaps::count_in_kernel`), both families.
    pub fn count_in_kernel(&self) -> std::io::Result<std::collections::BTreeMap<&'static str, u64>> {
        let mut counts = self.lb.count_in_kernel()?;
        counts.extend(self.lb6.count_in_kernel()?);
        Ok(counts)
    }

    /// A map of the object (an array or an LRU hash map), for the calls that take its descriptor.
    fn map_fd(&self, name: &str) -> std::io::Result<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        match self.ebpf.map(name) {
            Some(aya::maps::Map::Array(m) | aya::maps::Map::LruHashMap(m)) => Ok(m.fd().as_fd()),
            _ => Err(std::io::Error::other(format!("no map {name}"))),
        }
    }

    /// Adopts the connections netfilter's DNAT translated (kube-proxy's rules, at a takeover)
    /// as their frontends are first written (`adopt`), both families, until their trailing read
    /// after the first sync (`trail_adoption`);
    /// not those of the node's own processes (from `node_addresses`).
    pub fn adopt_translated(&mut self, node_addresses: &[IpAddr]) -> std::io::Result<()> {
        use crate::model::Family;
        let lock = match &self.pin_root {
            Some(root) => ct_filter::RebuildLock::try_take(root)?,
            None => None,
        };
        let own: std::collections::HashSet<IpAddr> = node_addresses.iter().copied().collect();
        let fds = |ct, filter| Ok::<_, std::io::Error>([self.map_fd(ct)?, self.map_fd(filter)?, self.map_fd(map_names::ADOPTING)?]);
        let v4 = adopt::Adoption::<[u8; 4]>::new(Family::V4, fds(map_names::CT, map_names::CT_FILTER)?, own.clone(), lock)?;
        let v6 = adopt::Adoption::<proxy_common::Ip6>::new(Family::V6, fds(map_names::CT6, map_names::CT_FILTER6)?, own, None)?;
        self.lb.adopt_connections(Box::new(v4));
        self.lb6.adopt_connections(Box::new(v6));
        Ok(())
    }

    /// Every few seconds (the agent's housekeeping): ends a takeover's adoption, both families,
    /// once its trailing read is done (`adopt`).
    pub fn trail_adoption(&mut self) {
        // IPv6's first: IPv4's adoption holds the filter rebuild's lock (`adopt_translated`),
        // which must stay taken while IPv6's inserts too.
        self.lb6.trail_adoption();
        if !self.lb6.adopting() {
            self.lb.trail_adoption();
        }
    }

    /// Rebuilds each family's conntrack filter (IPv4's, then IPv6's) from its conntrack map
    /// (`ct_filter::rebuild`), as the agent does every 15 s through the pins.
    pub fn rebuild_conntrack_filters(&self) -> std::io::Result<[ct_filter::Rebuilt; 2]> {
        let fd = |name| self.map_fd(name);
        ct_filter::rebuild_families([fd(map_names::CT_FILTER)?, fd(map_names::CT_FILTER6)?], [fd(map_names::CT)?, fd(map_names::CT6)?])
    }

    /// Removes each family's expired flows and the reply entries left without their flow, at
    /// `now` (the datapath's clock: `ct_gc`), by the lifetimes the programs were loaded with, as
    /// the agent does every 15 s through the pins.
    pub fn collect_expired_flows(&self, now: u64) -> std::io::Result<[ct_gc::Collected; 2]> {
        let fd = |name| self.map_fd(name);
        let revnat = |fd: Option<_>| fd.ok_or_else(|| std::io::Error::other("no reverse NAT map"));
        let revnats = [revnat(self.lb.revnat_fd()), revnat(self.lb6.revnat_fd())];
        let (removed, mut errors) = ct_gc::collect_families([fd(map_names::CT)?, fd(map_names::CT6)?], revnats, &self.ct_lifetimes, now);
        errors.pop().map_or(Ok(removed), Err)
    }

    pub fn service_entries(&self) -> usize {
        self.lb.service_entries() + self.lb6.service_entries()
    }

    /// ((IPv4, IPv6) service entries, (IPv4, IPv6) backends), for the map gauges: each family
    /// has maps of its own.
    pub fn entries_by_family(&self) -> ((usize, usize), (usize, usize)) {
        ((self.lb.service_entries(), self.lb6.service_entries()), (self.lb.backend_count(), self.lb6.backend_count()))
    }
}

impl Dataplane for EbpfDataplane {
    fn programmed_keys(&self) -> Vec<FrontendKey> {
        let mut keys = self.lb.keys();
        keys.extend(self.lb6.keys());
        keys
    }

    fn is_current(&self, key: &FrontendKey, fe: &Frontend) -> bool {
        match key.addr {
            IpAddr::V4(_) => self.lb.is_current(key, fe),
            IpAddr::V6(_) => self.lb6.is_current(key, fe),
        }
    }

    fn upsert(&mut self, key: &FrontendKey, fe: &Frontend) -> Result<(), DataplaneError> {
        let written = self.upsert_family(key, fe);
        self.after_lb_write();
        written
    }

    fn remove(&mut self, key: &FrontendKey) -> Result<(), DataplaneError> {
        let removed = match key.addr {
            IpAddr::V4(_) => self.lb.remove(key),
            IpAddr::V6(_) => self.lb6.remove(key),
        };
        self.after_lb_write();
        removed
    }

    fn admit(&self, wanted: &[frontends::Group]) -> Result<(), DataplaneError> {
        // Each group's frontend counted once per key of the family.
        let of = |ipv6: bool| {
            wanted.iter().filter_map(move |g| {
                let n = g.keys.iter().filter(|k| k.addr.is_ipv6() == ipv6).count();
                Some((n, g.keys.first()?, &g.frontend)).filter(|(n, _, _)| *n > 0)
            })
        };
        self.lb.admit(of(false))?;
        self.lb6.admit(of(true))
    }

    fn entries_of(&self, key: &FrontendKey) -> usize {
        match key.addr {
            IpAddr::V4(_) => self.lb.entries_of(key),
            IpAddr::V6(_) => self.lb6.entries_of(key),
        }
    }

    fn holds_for(&self, key: &FrontendKey, fe: &Frontend) -> bool {
        let name = match key.addr {
            IpAddr::V4(_) => self.lb.name_of(key),
            IpAddr::V6(_) => self.lb6.name_of(key),
        };
        name.is_some_and(|n| n == lbmaps::stored_name(fe))
    }

    fn collect_garbage(&mut self) -> Result<usize, DataplaneError> {
        // (After the first sync: a takeover's adoption has its trailing read left: `trail_adoption`.)
        self.lb.end_adoption();
        self.lb6.end_adoption();
        let collected = self.lb.collect_garbage().and_then(|n| Ok(n + self.lb6.collect_garbage()?));
        self.after_lb_write();
        collected
    }

    fn has_leftovers(&self) -> bool {
        self.lb.has_leftovers() || self.lb6.has_leftovers()
    }

    fn set_cluster_ip_ranges(
        &mut self,
        cidrs: &[Cidr],
        allocated: &std::collections::BTreeSet<std::net::IpAddr>,
    ) -> Result<(), DataplaneError> {
        self.write_cluster_ip_ranges(cidrs, allocated)
    }
}

/// The entries of `want` that `have` lacks or holds with another value, in the order they are
/// written: longest prefix first, so that a cluster IP's entry is in before the range around it
/// (which, in between, would have it taken for a free address and dropped). Deletions go the
/// other way, ranges first, as `have`'s order gives them.
fn to_write<A: MapAddr>(want: &SvcCidrs<A>, have: &SvcCidrs<A>) -> Vec<((u8, A), u8)> {
    want.iter().rev().filter(|(k, v)| have.get(k) != Some(v)).map(|(k, v)| (*k, *v)).collect()
}

/// The common prefix of one family's ranges as `Config` holds it (network address, mask; as
/// packets carry addresses). None: all zeroes.
fn common_prefix<A: MapAddr>(cidrs: &[Cidr]) -> (A, A) {
    Cidr::covering(cidrs).and_then(|c| Some((A::from_ip(c.addr)?, A::from_ip(c.netmask())?))).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proxy_common::svc_cidr::{ALLOCATED, RANGE};

    /// A range added while the check is on (inside the common prefix): its allocated cluster
    /// IPs go in first, or packets to them would be taken for free addresses in between.
    #[test]
    fn a_ranges_cluster_ips_are_written_before_the_range() {
        let have: SvcCidrs<[u8; 4]> = [((16, [10, 96, 0, 0]), RANGE), ((32, [10, 96, 0, 1]), ALLOCATED)].into();
        let mut want = have.clone();
        want.extend([((16, [10, 97, 0, 0]), RANGE), ((32, [10, 97, 0, 10]), ALLOCATED), ((32, [10, 97, 1, 1]), ALLOCATED)]);
        assert_eq!(
            to_write(&want, &have),
            [((32, [10, 97, 1, 1]), ALLOCATED), ((32, [10, 97, 0, 10]), ALLOCATED), ((16, [10, 97, 0, 0]), RANGE)],
            "what the map lacks, cluster IPs before their range"
        );
        assert!(to_write(&have, &have).is_empty(), "nothing written twice");
    }
}
