//! Dataplanes program the kernel from the model. The reconciler owns exactly one.

pub mod ebpf;
pub mod modes;
pub mod netfilter;

/// How Services are programmed (`--proxy-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProxyMode {
    Ebpf,
    Iptables,
    Ipvs,
    Nftables,
}

impl ProxyMode {
    /// Every mode, in the order cleanup removes them: IPVS before iptables (IPVS mode's jumps
    /// would block the removal of the iptables chains they lead to).
    pub const ALL: [ProxyMode; 4] = [ProxyMode::Ipvs, ProxyMode::Iptables, ProxyMode::Nftables, ProxyMode::Ebpf];

    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Ebpf => "ebpf",
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Nftables => "nftables",
        }
    }
}

impl std::fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ProxyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        ProxyMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("unknown proxy mode {s:?} (ebpf, iptables, ipvs, nftables or auto)"))
    }
}

use crate::model::{Frontend, FrontendKey};

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// The dataplane cannot express this frontend; the message says what to use instead.
    #[error("{0}")]
    Unsupported(String),
    #[error("map {map} is full ({max} entries); raise --lb-map-max (takes effect after `proxy-agent cleanup`, which resets tracked connections)")]
    MapFull { map: &'static str, max: u32 },
    /// One Service would take more than half of a fixed-size map.
    #[error(
        "this Service needs {need} entries of map {map}, more than the {} one Service may take (half of its {max}); \
         the addresses it had keep what was programmed; raise --lb-map-max (takes effect after `proxy-agent cleanup`, \
         which resets tracked connections) or split the Service",
        max / 2
    )]
    TooLarge { map: &'static str, need: usize, max: u32 },
    #[error("{op} on map {map} failed: {source}")]
    Map {
        op: &'static str,
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
}

impl DataplaneError {
    /// Retrying cannot help until the Service changes.
    pub fn is_permanent(&self) -> bool {
        matches!(self, DataplaneError::Unsupported(_) | DataplaneError::TooLarge { .. })
    }

    /// Short, stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            DataplaneError::Unsupported(_) => "unsupported",
            DataplaneError::MapFull { .. } => "map_full",
            DataplaneError::TooLarge { .. } => "service_too_large",
            DataplaneError::Map { .. } => "map_syscall",
        }
    }
}

/// What the reconciler needs from a dataplane. Calls are per frontend so that a change to one
/// Service touches only that Service's state.
pub trait Dataplane {
    /// Frontends found programmed when the agent started (pinned state of a previous run).
    fn programmed_keys(&self) -> Vec<FrontendKey>;
    /// True when `key` is programmed exactly as `fe` asks.
    fn is_current(&self, key: &FrontendKey, fe: &Frontend) -> bool;
    /// Programs `key`, make-before-break: packets never see a half-written frontend.
    fn upsert(&mut self, key: &FrontendKey, fe: &Frontend) -> Result<(), DataplaneError>;
    fn remove(&mut self, key: &FrontendKey) -> Result<(), DataplaneError>;
    /// Refuses a Service whose frontends (`wanted`, all of them, by group) would take more of
    /// the dataplane's fixed-size maps than one Service may. A dataplane without such maps
    /// admits every Service.
    fn admit(&self, _wanted: &[ebpf::frontends::Group]) -> Result<(), DataplaneError> {
        Ok(())
    }
    /// Map entries the frontend `key` holds, to name the largest Services when a map is full.
    fn entries_of(&self, _key: &FrontendKey) -> usize {
        0
    }
    /// True when what is programmed at `key` is for `fe`'s Service port (a previous run's
    /// frontend that a refused Service may keep).
    fn holds_for(&self, _key: &FrontendKey, _fe: &Frontend) -> bool {
        false
    }
    /// Drops state no frontend uses any more (after the first full sync). Returns how many
    /// entries went.
    fn collect_garbage(&mut self) -> Result<usize, DataplaneError>;
    /// True when a failed delete left entries that `collect_garbage` should try again.
    fn has_leftovers(&self) -> bool {
        false
    }
    /// The Service CIDRs and the cluster IPs allocated in them (`Store::cluster_ip_ranges`):
    /// new flows to a free address of the ranges are dropped, to a cluster IP on a port its
    /// Service lacks rejected. A dataplane without the check ignores it.
    fn set_cluster_ip_ranges(
        &mut self,
        _cidrs: &[crate::model::store::Cidr],
        _allocated: &std::collections::BTreeSet<std::net::IpAddr>,
    ) -> Result<(), DataplaneError> {
        Ok(())
    }
}
