//! The agent's configuration, in typed sections: what every mode uses (`Common`), what only the
//! eBPF dataplane uses (`Ebpf`), what only the netfilter modes use (`Netfilter`).
//!
//! It is resolved as kube-proxy resolves its own: built-in defaults, then kube-proxy's
//! configuration file (`--config`), then the flags given on the command line. A field of the
//! file that the chosen mode does not use is named in one warning at start (`unused_in`).

pub mod duration;
pub mod kubeproxy;

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use proxy_common::{ct::Lifetimes, limits};

use crate::{
    dataplane::{
        ebpf::attach::XdpSetting,
        netfilter::{ipvs::Scheduler, Iptables},
        ProxyMode,
    },
    model::store::{Cidr, NodePortAddresses},
};

/// Where Services and endpoints come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A directory of manifests, watched for changes.
    Manifests(PathBuf),
    /// The API server.
    Kube(ApiClient),
}

/// How the agent talks to the API server (kube-proxy's `clientConnection`).
#[derive(Clone, Debug, PartialEq)]
pub struct ApiClient {
    /// None: $KUBECONFIG, the in-cluster service account, then ~/.kube/config.
    pub kubeconfig: Option<PathBuf>,
    /// Requests per second, on average, and in a burst.
    pub qps: f32,
    pub burst: u32,
    /// A watch that brings no event (nor bookmark) for this long is started again, and
    /// `/healthz` says so meanwhile.
    pub watch_stall: Duration,
}

impl Default for ApiClient {
    fn default() -> Self {
        Self { kubeconfig: None, qps: 5.0, burst: 10, watch_stall: Duration::from_secs(120) }
    }
}

/// How pod traffic is told from other traffic in the netfilter modes (kube-proxy's
/// `detectLocalMode`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DetectLocal {
    /// Sources in the cluster CIDR (`clusterCIDR`); without one, nothing is local.
    ClusterCidr,
    /// Sources in this Node's `spec.podCIDRs`.
    NodeCidr,
    /// Packets arriving from this bridge.
    BridgeInterface(String),
    /// Packets arriving from interfaces whose name starts with this.
    InterfaceNamePrefix(String),
}

/// kube-proxy's `conntrack` settings. None and zero leave the kernel's value as it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conntrack {
    pub max_per_core: Option<u32>,
    pub min: Option<u32>,
    pub tcp_established_timeout: Option<Duration>,
    pub tcp_close_wait_timeout: Option<Duration>,
    pub tcp_be_liberal: bool,
    pub udp_timeout: Option<Duration>,
    pub udp_stream_timeout: Option<Duration>,
}

impl Conntrack {
    /// What kube-proxy writes to the kernel's conntrack table when nothing is configured
    /// (its defaults), with what is configured on top: the netfilter modes' settings.
    pub fn with_kube_proxy_defaults(&self) -> Self {
        Self {
            max_per_core: self.max_per_core.or(Some(32768)),
            min: self.min.or(Some(131072)),
            tcp_established_timeout: self.tcp_established_timeout.or(Some(Duration::from_secs(86400))),
            tcp_close_wait_timeout: self.tcp_close_wait_timeout.or(Some(Duration::from_secs(3600))),
            ..self.clone()
        }
    }

    /// The eBPF dataplane's own conntrack lifetimes: the TCP and UDP timeouts where set.
    pub fn lifetimes(&self) -> Lifetimes {
        let ns =
            |d: Option<Duration>, default: u64| d.filter(|d| !d.is_zero()).map_or(default, |d| d.as_nanos().min(u64::MAX as u128) as u64);
        let d = Lifetimes::DEFAULT;
        Lifetimes {
            tcp_established_ns: ns(self.tcp_established_timeout, d.tcp_established_ns),
            tcp_half_closed_ns: ns(self.tcp_close_wait_timeout, d.tcp_half_closed_ns),
            udp_ns: ns(self.udp_timeout, d.udp_ns),
            udp_stream_ns: ns(self.udp_stream_timeout, d.udp_stream_ns),
            ..d
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// What every mode uses.
#[derive(Clone, Debug)]
pub struct Common {
    pub source: Source,
    /// None: auto.
    pub proxy_mode: Option<ProxyMode>,
    pub hostname: String,
    /// `bindAddress` when it names an address: the node's primary IP, over the Node's
    /// InternalIP.
    pub node_ip: Option<IpAddr>,
    pub metrics_bind: SocketAddr,
    pub healthz_bind: SocketAddr,
    pub nodeport_addresses: NodePortAddresses,
    /// The pods' ranges (IPv4; `clusterCIDR`).
    pub cluster_cidrs: Vec<Cidr>,
    /// `--service-cluster-ip-range`: Service CIDRs besides the ServiceCIDR objects'.
    pub service_cidrs: Vec<Cidr>,
    pub oom_score_adj: Option<i32>,
    pub conntrack: Conntrack,
    /// Rescan the manifest directory at least this often, in case inotify misses a change.
    pub resync: Duration,
    /// Where the eBPF dataplane pins (every mode cleans up what an earlier eBPF run left there).
    pub bpffs_root: PathBuf,
    /// Changes not programmed within twice this fail /healthz, in the eBPF mode (the netfilter
    /// modes take their own section's `syncPeriod`).
    pub sync_period: Duration,
    pub log_format: LogFormat,
    /// `logging.verbosity` (klog's -v) when no --log-level was given.
    pub log_verbosity: Option<u32>,
    /// The API server's `--service-node-port-range`, which objects are checked against: the
    /// flag's, else for a manifest directory the API server's default, else (objects the API
    /// server checked already) none.
    pub node_port_range: Option<(u16, u16)>,
}

/// What only the eBPF dataplane uses.
#[derive(Clone, Debug)]
pub struct Ebpf {
    pub pod_devices: Vec<String>,
    /// External interfaces (glob patterns); empty: those with a global IPv4 address.
    pub devices: Vec<String>,
    pub xdp: XdpSetting,
    /// `--cgroup-root`: None: no socket hooks; Some(None): auto.
    pub cgroup_root: Option<Option<PathBuf>>,
    pub maglev_size: u32,
    pub snat_ports: (u16, u16),
    pub lb_map_max: u32,
    pub ct_map_max: u32,
}

/// A netfilter mode's sync periods (kube-proxy's per-mode `syncPeriod` and `minSyncPeriod`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncPeriods {
    /// Everything is applied again at least this often (and /healthz fails when a change waits
    /// twice this).
    pub sync: Duration,
    /// Syncs come no closer together than this; changes meanwhile are applied together.
    pub min: Duration,
}

/// IPVS mode's settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IpvsSettings {
    pub scheduler: Scheduler,
    /// Virtual servers in these ranges are never removed (they are not ours).
    pub exclude_cidrs: Vec<Cidr>,
    /// arp_ignore=1 and arp_announce=2, so nodes do not answer ARP for the VIPs on kube-ipvs0.
    pub strict_arp: bool,
    pub tcp_timeout: Option<Duration>,
    pub tcp_fin_timeout: Option<Duration>,
    pub udp_timeout: Option<Duration>,
}

/// A netfilter mode's masquerading and timing (kube-proxy's per-mode section).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModeSettings {
    pub masquerade_all: bool,
    /// The bit of the packet mark that asks for masquerading (0-31; kube-proxy's 14).
    pub masquerade_bit: u8,
    pub sync: SyncPeriods,
}

impl ModeSettings {
    /// The masquerade mark as rules write it (`0x4000` for bit 14).
    pub fn mark(&self) -> String {
        format!("{:#x}", 1u32 << self.masquerade_bit)
    }
}

/// What only the netfilter modes use.
#[derive(Clone, Debug)]
pub struct Netfilter {
    /// iptables mode's section (IPVS mode takes its masquerading from it too, as kube-proxy).
    pub iptables: ModeSettings,
    pub nftables: ModeSettings,
    pub ipvs_sync: SyncPeriods,
    /// iptables mode serves NodePorts on 127.0.0.1 (route_localnet), as kube-proxy does.
    pub localhost_nodeports: bool,
    pub detect_local: DetectLocal,
    /// None: auto.
    pub iptables_backend: Option<Iptables>,
    pub ipvs: IpvsSettings,
}

impl Netfilter {
    pub fn for_mode(&self, mode: ProxyMode) -> ModeSettings {
        match mode {
            ProxyMode::Nftables => self.nftables,
            ProxyMode::Ipvs => ModeSettings { sync: self.ipvs_sync, ..self.iptables },
            _ => self.iptables,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub common: Common,
    pub ebpf: Ebpf,
    pub netfilter: Netfilter,
    /// Fields of the configuration file, each with the modes that use it (empty: none).
    file_fields: Vec<(String, &'static [ProxyMode])>,
}

pub const DEFAULT_BPFFS_ROOT: &str = "/sys/fs/bpf/proxy-agent";
/// Host-side names of pod interfaces in common CNIs: veth (bridge, flannel, kindnet), lxc
/// (Cilium), cali (Calico), eni (AWS VPC CNI), gke (GKE), azv (Azure CNI).
pub const DEFAULT_POD_DEVICES: &str = "veth*,lxc*,cali*,eni*,gke*,azv*";

/// Settings from the command line; None where a flag was not given.
#[derive(Clone, Debug, Default)]
pub struct Flags {
    pub config: Option<PathBuf>,
    pub manifests: Option<PathBuf>,
    pub kubeconfig: Option<PathBuf>,
    pub kube_api_qps: Option<f32>,
    pub kube_api_burst: Option<u32>,
    pub watch_stall: Option<Duration>,
    pub proxy_mode: Option<Option<ProxyMode>>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<IpAddr>,
    pub metrics_bind_address: Option<SocketAddr>,
    pub healthz_bind_address: Option<SocketAddr>,
    pub nodeport_addresses: Option<NodePortAddresses>,
    pub cluster_cidr: Option<Vec<Cidr>>,
    pub service_cluster_ip_range: Option<Vec<Cidr>>,
    pub detect_local_mode: Option<String>,
    pub pod_bridge_interface: Option<String>,
    pub pod_interface_name_prefix: Option<String>,
    pub oom_score_adj: Option<i32>,
    pub config_sync_period: Option<Duration>,
    pub sync_period: Option<Duration>,
    pub conntrack: ConntrackFlags,
    pub bpffs_root: Option<PathBuf>,
    pub service_node_port_range: Option<(u16, u16)>,
    // eBPF
    pub pod_devices: Option<Vec<String>>,
    pub devices: Option<Vec<String>>,
    pub xdp: Option<XdpSetting>,
    pub cgroup_root: Option<Option<Option<PathBuf>>>,
    pub maglev_table_size: Option<u32>,
    pub snat_port_range: Option<(u16, u16)>,
    pub lb_map_max: Option<u32>,
    pub ct_map_max: Option<u32>,
    // netfilter
    pub masquerade_all: Option<bool>,
    pub iptables_masquerade_bit: Option<u8>,
    pub iptables_localhost_nodeports: Option<bool>,
    pub iptables_sync_period: Option<Duration>,
    pub iptables_min_sync_period: Option<Duration>,
    pub iptables_backend: Option<Option<Iptables>>,
    pub ipvs_scheduler: Option<Scheduler>,
    pub ipvs_exclude_cidrs: Option<Vec<Cidr>>,
    pub ipvs_strict_arp: Option<bool>,
    pub ipvs_tcp_timeout: Option<Duration>,
    pub ipvs_tcpfin_timeout: Option<Duration>,
    pub ipvs_udp_timeout: Option<Duration>,
    pub ipvs_sync_period: Option<Duration>,
    pub ipvs_min_sync_period: Option<Duration>,
    pub nftables_sync_period: Option<Duration>,
    pub nftables_min_sync_period: Option<Duration>,
}

#[derive(Clone, Debug, Default)]
pub struct ConntrackFlags {
    pub max_per_core: Option<u32>,
    pub min: Option<u32>,
    pub tcp_timeout_established: Option<Duration>,
    pub tcp_timeout_close_wait: Option<Duration>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<Duration>,
    pub udp_timeout_stream: Option<Duration>,
}

const ALL: &[ProxyMode] = &ProxyMode::ALL;
const NETFILTER: &[ProxyMode] = &[ProxyMode::Iptables, ProxyMode::Ipvs, ProxyMode::Nftables];
const IPTABLES: &[ProxyMode] = &[ProxyMode::Iptables];
const IPTABLES_IPVS: &[ProxyMode] = &[ProxyMode::Iptables, ProxyMode::Ipvs];
const IPVS: &[ProxyMode] = &[ProxyMode::Ipvs];
const NFTABLES: &[ProxyMode] = &[ProxyMode::Nftables];
const NONE: &[ProxyMode] = &[];

/// The first of the given values that is there.
fn first<T>(options: impl IntoIterator<Item = Option<T>>) -> Option<T> {
    options.into_iter().flatten().next()
}

/// A file's duration: zero means "not set" (kubeadm writes `0s` for unset ones).
fn set_duration(d: Option<kubeproxy::GoDuration>) -> Option<Duration> {
    d.map(|d| d.0).filter(|d| !d.is_zero())
}

/// `host:port` as kube-proxy takes it for its bind addresses; an address alone gets `port`.
fn parse_bind(field: &str, s: &str, port: u16) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Some((host, p)) = s.rsplit_once(':').filter(|(h, _)| !h.contains(':')) {
        if let (Some(ip), Ok(p)) = (crate::model::addr::parse_ip(host), p.parse::<u16>()) {
            return Ok(SocketAddr::new(ip, p));
        }
    }
    crate::model::addr::parse_ip(s).map(|ip| SocketAddr::new(ip, port)).ok_or_else(|| format!("{field}: {s:?} is not IP:PORT"))
}

/// CIDRs of either family, comma-separated or listed.
fn cidrs(field: &str, items: &[String]) -> Result<Vec<Cidr>, String> {
    items
        .iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| item.parse::<Cidr>().map_err(|e| format!("{field}: {e}")))
        .collect()
}

/// `clusterCIDR` as kube-proxy takes it: one range, or a dual-stack pair (one per family).
pub fn cluster_cidr_pair(field: &str, list: &[Cidr]) -> Result<(), String> {
    if list.len() > 2 || (list.len() == 2 && list[0].family() == list[1].family()) {
        let shown: Vec<String> = list.iter().map(|c| c.to_string()).collect();
        return Err(format!("{field}: {} is not one range or one range per family", shown.join(",")));
    }
    Ok(())
}

fn masquerade_bit(field: &str, bit: i32) -> Result<u8, String> {
    u8::try_from(bit).ok().filter(|b| *b <= 31).ok_or_else(|| format!("{field}: {bit} is not a bit of the packet mark (0-31)"))
}

impl Config {
    /// Resolves defaults, then the file `flags.config` names, then the flags given. Returns
    /// the configuration and notes to log once logging is set up (unknown fields, parts left
    /// out). `hostname` is the fallback node name.
    pub fn resolve(flags: Flags, hostname: impl FnOnce() -> String) -> Result<(Self, Vec<String>), String> {
        let mut notes = Vec::new();
        let file = match &flags.config {
            Some(path) => {
                let loaded = kubeproxy::load(path).map_err(|e| e.to_string())?;
                if !loaded.unknown_fields.is_empty() {
                    notes.push(format!(
                        "{}: ignoring fields KubeProxyConfiguration does not have: {}",
                        path.display(),
                        loaded.unknown_fields.join(", ")
                    ));
                }
                loaded.config
            }
            None => kubeproxy::KubeProxyConfiguration::default(),
        };
        let mut fields: Vec<(String, &'static [ProxyMode])> = Vec::new();
        let mut used = |name: &str, set: bool, modes: &'static [ProxyMode]| {
            if set {
                fields.push((name.to_string(), modes));
            }
        };
        let cc = file.client_connection.clone().unwrap_or_default();
        let ipt = file.iptables.clone().unwrap_or_default();
        let ipvs = file.ipvs.clone().unwrap_or_default();
        let nft = file.nftables.clone().unwrap_or_default();
        let ct = file.conntrack.clone().unwrap_or_default();
        let dl = file.detect_local.clone().unwrap_or_default();
        let non_empty = |s: &Option<String>| s.as_deref().is_some_and(|s| !s.is_empty());

        // Common.
        let mode = match flags.proxy_mode {
            Some(m) => m,
            None => match file.mode.as_deref() {
                None | Some("") | Some("auto") => None,
                Some(m) => Some(m.parse::<ProxyMode>().map_err(|e| format!("mode: {e}"))?),
            },
        };
        let kubeconfig = first([flags.kubeconfig.clone(), cc.kubeconfig.clone().filter(|s| !s.is_empty()).map(PathBuf::from)]);
        let qps = first([flags.kube_api_qps, cc.qps.filter(|q| *q > 0.0)]).unwrap_or(5.0);
        let burst = first([flags.kube_api_burst, cc.burst.filter(|b| *b > 0).map(|b| b as u32)]).unwrap_or(10);
        used("clientConnection.kubeconfig", non_empty(&cc.kubeconfig), ALL);
        used("clientConnection.qps", cc.qps.is_some_and(|q| q != 0.0), ALL);
        used("clientConnection.burst", cc.burst.is_some_and(|b| b != 0), ALL);
        if let Some(ct) = cc.content_type.as_deref().filter(|c| !c.is_empty() && *c != "application/json") {
            notes.push(format!("clientConnection.contentType {ct:?}: this agent's client speaks JSON to the API server"));
        }
        used("clientConnection.acceptContentTypes", non_empty(&cc.accept_content_types), NONE);
        let source = match (&flags.manifests, kubeconfig) {
            (Some(dir), _) => Source::Manifests(dir.clone()),
            (None, kubeconfig) => {
                Source::Kube(ApiClient { kubeconfig, qps, burst, watch_stall: flags.watch_stall.unwrap_or(Duration::from_secs(120)) })
            }
        };
        let hostname = match first([flags.hostname_override.clone(), file.hostname_override.clone().filter(|s| !s.is_empty())]) {
            Some(h) => h,
            None => hostname(),
        };
        used("hostnameOverride", non_empty(&file.hostname_override), ALL);
        let bind = match flags.bind_address {
            Some(a) => Some(a),
            None => match file.bind_address.as_deref().filter(|s| !s.is_empty()) {
                Some(s) => Some(crate::model::addr::parse_ip(s).ok_or_else(|| format!("bindAddress: {s:?} is not an IP address"))?),
                None => None,
            },
        };
        let node_ip = bind.filter(|a| !a.is_unspecified());
        used("bindAddress", node_ip.is_some(), ALL);
        let metrics_bind = match flags.metrics_bind_address {
            Some(a) => a,
            None => match file.metrics_bind_address.as_deref().filter(|s| !s.is_empty()) {
                Some(s) => parse_bind("metricsBindAddress", s, 10249)?,
                None => "127.0.0.1:10249".parse().expect("valid"),
            },
        };
        let healthz_bind = match flags.healthz_bind_address {
            Some(a) => a,
            None => match file.healthz_bind_address.as_deref().filter(|s| !s.is_empty()) {
                Some(s) => parse_bind("healthzBindAddress", s, 10256)?,
                None => "0.0.0.0:10256".parse().expect("valid"),
            },
        };
        used("metricsBindAddress", non_empty(&file.metrics_bind_address), ALL);
        used("healthzBindAddress", non_empty(&file.healthz_bind_address), ALL);
        used("bindAddressHardFail", file.bind_address_hard_fail == Some(true), ALL);
        let nodeport_addresses = match flags.nodeport_addresses.clone() {
            Some(n) => n,
            None => match file.node_port_addresses.as_deref() {
                None | Some([]) => NodePortAddresses::default(),
                Some(list) if list.len() == 1 && list[0] == "primary" => NodePortAddresses::Primary,
                Some(list) => NodePortAddresses::Cidrs(cidrs("nodePortAddresses", list)?),
            },
        };
        used("nodePortAddresses", file.node_port_addresses.as_ref().is_some_and(|l| !l.is_empty()), ALL);
        let cluster_cidrs = match flags.cluster_cidr.clone() {
            Some(c) => c,
            None => cidrs("clusterCIDR", &file.cluster_cidr.clone().into_iter().collect::<Vec<_>>())?,
        };
        cluster_cidr_pair("clusterCIDR", &cluster_cidrs)?;
        used("clusterCIDR", non_empty(&file.cluster_cidr), NETFILTER);
        let oom_score_adj = first([flags.oom_score_adj, file.oom_score_adj]).or(Some(-999));
        if let Some(v) = oom_score_adj.filter(|v| !(-1000..=1000).contains(v)) {
            return Err(format!("oomScoreAdj: {v} is outside -1000..1000"));
        }
        used("oomScoreAdj", file.oom_score_adj.is_some(), ALL);
        let positive = |field: &str, v: Option<i32>| -> Result<Option<u32>, String> {
            match v {
                None => Ok(None),
                Some(v) if v < 0 => Err(format!("{field}: {v} must not be negative")),
                Some(v) => Ok(Some(v as u32)),
            }
        };
        let conntrack = Conntrack {
            max_per_core: first([flags.conntrack.max_per_core, positive("conntrack.maxPerCore", ct.max_per_core)?]),
            min: first([flags.conntrack.min, positive("conntrack.min", ct.min)?]),
            tcp_established_timeout: first([flags.conntrack.tcp_timeout_established, set_duration(ct.tcp_established_timeout)]),
            tcp_close_wait_timeout: first([flags.conntrack.tcp_timeout_close_wait, set_duration(ct.tcp_close_wait_timeout)]),
            tcp_be_liberal: first([flags.conntrack.tcp_be_liberal, ct.tcp_be_liberal]).unwrap_or(false),
            udp_timeout: first([flags.conntrack.udp_timeout, set_duration(ct.udp_timeout)]),
            udp_stream_timeout: first([flags.conntrack.udp_timeout_stream, set_duration(ct.udp_stream_timeout)]),
        };
        used("conntrack.maxPerCore", ct.max_per_core.is_some(), NETFILTER);
        used("conntrack.min", ct.min.is_some(), NETFILTER);
        used("conntrack.tcpBeLiberal", ct.tcp_be_liberal == Some(true), NETFILTER);
        used("conntrack.tcpEstablishedTimeout", set_duration(ct.tcp_established_timeout).is_some(), ALL);
        used("conntrack.tcpCloseWaitTimeout", set_duration(ct.tcp_close_wait_timeout).is_some(), ALL);
        used("conntrack.udpTimeout", set_duration(ct.udp_timeout).is_some(), ALL);
        used("conntrack.udpStreamTimeout", set_duration(ct.udp_stream_timeout).is_some(), ALL);
        let config_sync = first([flags.config_sync_period, set_duration(file.config_sync_period)]);
        used("configSyncPeriod", config_sync.is_some() && flags.config_sync_period.is_none(), ALL);
        let logging = file.logging.clone().unwrap_or_default();
        let log_format = match logging.format.as_deref() {
            None | Some("") | Some("text") => LogFormat::Text,
            Some("json") => LogFormat::Json,
            Some(other) => return Err(format!("logging.format: {other:?} is not text or json")),
        };
        used("logging.format", logging.format.as_deref().is_some_and(|f| !f.is_empty()), ALL);
        used("logging.verbosity", logging.verbosity.is_some_and(|v| v > 0), ALL);
        let zero = |v: &Option<serde_yaml::Value>| match v {
            None | Some(serde_yaml::Value::Null) => true,
            Some(serde_yaml::Value::Number(n)) => n.as_f64() == Some(0.0),
            Some(serde_yaml::Value::String(s)) => s.is_empty() || s == "0" || s == "0s",
            Some(serde_yaml::Value::Mapping(m)) => m.is_empty(),
            Some(serde_yaml::Value::Sequence(s)) => s.is_empty(),
            _ => false,
        };
        used("logging.flushFrequency", !zero(&logging.flush_frequency), NONE);
        used("logging.vmodule", !zero(&logging.vmodule), NONE);

        // Fields no mode of this agent has a use for.
        used("featureGates", file.feature_gates.as_ref().is_some_and(|g| !g.is_empty()), NONE);
        used("enableProfiling", file.enable_profiling == Some(true), NONE);
        used("showHiddenMetricsForVersion", non_empty(&file.show_hidden_metrics_for_version), NONE);
        used("portRange", non_empty(&file.port_range), NONE);
        used("windowsRunAsService", file.windows_run_as_service == Some(true), NONE);
        if let Some(w) = &file.winkernel {
            let set = non_empty(&w.network_name)
                || non_empty(&w.source_vip)
                || non_empty(&w.root_hns_endpoint_name)
                || w.enable_dsr == Some(true)
                || w.forward_health_check_vip == Some(true);
            used("winkernel", set, NONE);
        }

        let common = Common {
            source,
            proxy_mode: mode,
            hostname,
            node_ip,
            metrics_bind,
            healthz_bind,
            nodeport_addresses,
            cluster_cidrs: cluster_cidrs.clone(),
            service_cidrs: flags.service_cluster_ip_range.clone().unwrap_or_default().iter().map(|c| c.network()).collect(),
            oom_score_adj,
            conntrack,
            resync: config_sync.unwrap_or(Duration::from_secs(30)),
            bpffs_root: flags.bpffs_root.clone().unwrap_or_else(|| DEFAULT_BPFFS_ROOT.into()),
            sync_period: flags.sync_period.unwrap_or(Duration::from_secs(30)),
            log_format,
            log_verbosity: logging.verbosity,
            node_port_range: flags
                .service_node_port_range
                .or(flags.manifests.as_ref().map(|_| crate::model::validate::DEFAULT_NODE_PORT_RANGE)),
        };

        // eBPF. detectLocal's interface prefix names the pod interfaces for it too.
        let prefix = first([flags.pod_interface_name_prefix.clone(), dl.interface_name_prefix.clone().filter(|s| !s.is_empty())]);
        // Written into every iptables and nft rule set: a name they refuse would fail every
        // write, so no Service would be programmed.
        let prefix = prefix.map(|p| interface_name("detectLocal.interfaceNamePrefix (--pod-interface-name-prefix)", p, 14)).transpose()?;
        let pod_devices = match (&flags.pod_devices, &prefix) {
            (Some(d), _) => d.clone(),
            (None, Some(p)) if flags.detect_local_mode.as_deref().or(file.detect_local_mode.as_deref()) == Some("InterfaceNamePrefix") => {
                vec![format!("{p}*")]
            }
            _ => DEFAULT_POD_DEVICES.split(',').map(String::from).collect(),
        };
        let ebpf = Ebpf {
            pod_devices,
            devices: flags.devices.clone().unwrap_or_default(),
            xdp: flags.xdp.unwrap_or(XdpSetting::Native),
            cgroup_root: flags.cgroup_root.clone().unwrap_or(Some(None)),
            maglev_size: flags.maglev_table_size.unwrap_or(limits::MAGLEV_TABLE_SIZE),
            snat_ports: flags.snat_port_range.unwrap_or((limits::SNAT_PORT_MIN, limits::SNAT_PORT_MAX)),
            lb_map_max: flags.lb_map_max.unwrap_or(limits::LB_MAP_MAX),
            ct_map_max: flags.ct_map_max.unwrap_or(limits::CT_MAP_MAX),
        };

        // Netfilter.
        let detect_mode = first([flags.detect_local_mode.clone(), file.detect_local_mode.clone().filter(|s| !s.is_empty())]);
        let bridge = first([flags.pod_bridge_interface.clone(), dl.bridge_interface.clone().filter(|s| !s.is_empty())]);
        let bridge = bridge.map(|b| interface_name("detectLocal.bridgeInterface (--pod-bridge-interface)", b, 15)).transpose()?;
        let detect_local = match detect_mode.as_deref() {
            None | Some("ClusterCIDR") => DetectLocal::ClusterCidr,
            Some("NodeCIDR") => DetectLocal::NodeCidr,
            Some("BridgeInterface") => {
                DetectLocal::BridgeInterface(bridge.ok_or("detectLocalMode BridgeInterface needs detectLocal.bridgeInterface")?)
            }
            Some("InterfaceNamePrefix") => DetectLocal::InterfaceNamePrefix(
                prefix.clone().ok_or("detectLocalMode InterfaceNamePrefix needs detectLocal.interfaceNamePrefix")?,
            ),
            Some(other) => {
                return Err(format!("detectLocalMode: {other:?} is not ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix"))
            }
        };
        used("detectLocalMode", detect_mode.is_some() && flags.detect_local_mode.is_none(), NETFILTER);
        used("detectLocal.bridgeInterface", non_empty(&dl.bridge_interface), NETFILTER);
        // With InterfaceNamePrefix the prefix also names the eBPF mode's pod interfaces.
        let by_prefix = matches!(detect_local, DetectLocal::InterfaceNamePrefix(_));
        used("detectLocal.interfaceNamePrefix", non_empty(&dl.interface_name_prefix), if by_prefix { ALL } else { NONE });

        let ipt_bit = ipt.masquerade_bit.map(|b| masquerade_bit("iptables.masqueradeBit", b)).transpose()?;
        let nft_bit = nft.masquerade_bit.map(|b| masquerade_bit("nftables.masqueradeBit", b)).transpose()?;
        used("iptables.masqueradeBit", ipt.masquerade_bit.is_some(), IPTABLES_IPVS);
        used("nftables.masqueradeBit", nft.masquerade_bit.is_some(), NFTABLES);
        used("iptables.masqueradeAll", ipt.masquerade_all == Some(true), IPTABLES_IPVS);
        used("nftables.masqueradeAll", nft.masquerade_all == Some(true), NFTABLES);
        let localhost_nodeports = first([flags.iptables_localhost_nodeports, ipt.localhost_node_ports]).unwrap_or(true);
        // The eBPF mode serves localhost NodePorts from its socket hooks (as Cilium does).
        used("iptables.localhostNodePorts", ipt.localhost_node_ports.is_some(), &[ProxyMode::Iptables, ProxyMode::Ebpf]);
        let periods = |sync: Option<Duration>, min: Option<Duration>, default_min: Duration| SyncPeriods {
            sync: sync.unwrap_or(Duration::from_secs(30)),
            min: min.unwrap_or(default_min),
        };
        let iptables_sync = periods(
            first([flags.iptables_sync_period, set_duration(ipt.sync_period)]),
            first([flags.iptables_min_sync_period, set_duration(ipt.min_sync_period)]),
            Duration::from_secs(1),
        );
        let ipvs_sync = periods(
            first([flags.ipvs_sync_period, set_duration(ipvs.sync_period)]),
            first([flags.ipvs_min_sync_period, set_duration(ipvs.min_sync_period)]),
            Duration::ZERO,
        );
        let nftables_sync = periods(
            first([flags.nftables_sync_period, set_duration(nft.sync_period)]),
            first([flags.nftables_min_sync_period, set_duration(nft.min_sync_period)]),
            Duration::from_secs(1),
        );
        used("iptables.syncPeriod", set_duration(ipt.sync_period).is_some(), IPTABLES);
        used("iptables.minSyncPeriod", set_duration(ipt.min_sync_period).is_some(), IPTABLES);
        used("ipvs.syncPeriod", set_duration(ipvs.sync_period).is_some(), IPVS);
        used("ipvs.minSyncPeriod", set_duration(ipvs.min_sync_period).is_some(), IPVS);
        used("nftables.syncPeriod", set_duration(nft.sync_period).is_some(), NFTABLES);
        used("nftables.minSyncPeriod", set_duration(nft.min_sync_period).is_some(), NFTABLES);
        let scheduler = match (&flags.ipvs_scheduler, ipvs.scheduler.as_deref().filter(|s| !s.is_empty())) {
            (Some(s), _) => s.clone(),
            (None, Some(s)) => s.parse().map_err(|e| format!("ipvs.scheduler: {e}"))?,
            (None, None) => Scheduler::default(),
        };
        used("ipvs.scheduler", ipvs.scheduler.as_deref().is_some_and(|s| !s.is_empty()), IPVS);
        let exclude_cidrs = match &flags.ipvs_exclude_cidrs {
            Some(c) => c.clone(),
            None => cidrs("ipvs.excludeCIDRs", ipvs.exclude_cidrs.as_deref().unwrap_or_default())?,
        };
        used("ipvs.excludeCIDRs", ipvs.exclude_cidrs.as_ref().is_some_and(|c| !c.is_empty()), IPVS);
        let ipvs_settings = IpvsSettings {
            scheduler,
            exclude_cidrs,
            strict_arp: first([flags.ipvs_strict_arp, ipvs.strict_arp]).unwrap_or(false),
            tcp_timeout: first([flags.ipvs_tcp_timeout, set_duration(ipvs.tcp_timeout)]),
            tcp_fin_timeout: first([flags.ipvs_tcpfin_timeout, set_duration(ipvs.tcp_fin_timeout)]),
            udp_timeout: first([flags.ipvs_udp_timeout, set_duration(ipvs.udp_timeout)]),
        };
        used("ipvs.strictARP", ipvs.strict_arp == Some(true), IPVS);
        used("ipvs.tcpTimeout", set_duration(ipvs.tcp_timeout).is_some(), IPVS);
        used("ipvs.tcpFinTimeout", set_duration(ipvs.tcp_fin_timeout).is_some(), IPVS);
        used("ipvs.udpTimeout", set_duration(ipvs.udp_timeout).is_some(), IPVS);
        let section = |all: Option<bool>, bit: Option<u8>, sync| ModeSettings {
            masquerade_all: first([flags.masquerade_all, all]).unwrap_or(false),
            masquerade_bit: first([flags.iptables_masquerade_bit, bit]).unwrap_or(14),
            sync,
        };
        let netfilter = Netfilter {
            iptables: section(ipt.masquerade_all, ipt_bit, iptables_sync),
            nftables: section(nft.masquerade_all, nft_bit, nftables_sync),
            ipvs_sync,
            localhost_nodeports,
            detect_local,
            iptables_backend: flags.iptables_backend.unwrap_or(None),
            ipvs: ipvs_settings,
        };
        if netfilter.detect_local == DetectLocal::ClusterCidr && cluster_cidrs.is_empty() && flags.detect_local_mode.is_some() {
            notes.push("detectLocalMode ClusterCIDR without a clusterCIDR: no traffic counts as local".into());
        }
        Ok((Self { common, ebpf, netfilter, file_fields: fields }, notes))
    }

    /// Fields of the configuration file that `mode` does not use, by name.
    pub fn unused_in(&self, mode: ProxyMode) -> Vec<&str> {
        self.file_fields.iter().filter(|(_, modes)| !modes.contains(&mode)).map(|(f, _)| f.as_str()).collect()
    }

    /// The conntrack lifetimes of the eBPF dataplane.
    pub fn ct_lifetimes(&self) -> Lifetimes {
        self.common.conntrack.lifetimes()
    }
}

/// `name` if it can name a network interface (or, as a prefix, begin one) in iptables and nft
/// rules: 1 to `max` bytes (the kernel takes 15; iptables' prefix match adds a `+`), printable
/// ASCII without whitespace, quotes, `/`, `:`, `\\` or glob and wildcard characters.
fn interface_name(field: &str, name: String, max: usize) -> Result<String, String> {
    let bad = |c: char| !c.is_ascii_graphic() || "\"'/:\\*?[]+".contains(c);
    if name.is_empty() || name.len() > max || name == "." || name == ".." || name.chars().any(bad) {
        return Err(format!(
            "{field}: {:?} is not an interface name (1 to {max} bytes of printable ASCII, without whitespace, quotes, '/', ':', '\\' or '*?[]+')",
            crate::model::clip(&name, 64)
        ));
    }
    Ok(name)
}

#[cfg(test)]
mod tests;
