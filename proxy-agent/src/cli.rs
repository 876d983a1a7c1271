//! Command line: `run`, `inspect`, `cleanup`, `rules`, `trace`. Flags use kube-proxy's names
//! where it has one, and `proxy-agent --config F ...` (no subcommand, as kube-proxy is
//! invoked) means `run`. A flag given overrides the configuration file; defaults are
//! kube-proxy's (see `config`).

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::ExitCode,
    time::Duration,
};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{
    config::{self, Config, ConntrackFlags, Flags, LogFormat},
    dataplane::{
        ebpf::attach::XdpSetting,
        netfilter::{ipvs::Scheduler, Iptables},
        ProxyMode,
    },
    inspect,
    model::{
        store::{Cidr, NodePortAddresses},
        Protocol,
    },
};

#[derive(Parser)]
#[command(name = "proxy-agent", version, about = "eBPF kube-proxy replacement: node agent")]
struct Cli {
    /// Log level (error, warn, info, debug, trace); RUST_LOG overrides it. Default: info, or
    /// what the configuration file's logging.verbosity says.
    #[arg(long, global = true)]
    log_level: Option<String>,
    /// klog-style verbosity, as kube-proxy's -v (2: info, 4: debug, 6: trace).
    #[arg(long = "v", global = true)]
    verbosity: Option<u32>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Program Services into the kernel and keep them up to date.
    Run(Box<RunArgs>),
    /// Print what is programmed: services, backends, connections, counters.
    Inspect(InspectArgs),
    /// Remove what the agent installed in every mode (pinned programs, maps and links: tracked
    /// connections are lost; iptables chains, nftables tables, IPVS services), and what
    /// kube-proxy installed (the same chains and tables).
    Cleanup(RootArgs),
    /// Print what the agent would program for a manifest directory, in one mode, without
    /// touching the kernel.
    Rules(Box<RulesArgs>),
    /// Run a synthetic packet arriving from outside through the loaded program and print what
    /// it would do (verdict, Service, backend). Run it in the node's network namespace.
    Trace(TraceArgs),
}

#[derive(Args)]
struct TraceArgs {
    #[command(flatten)]
    root: RootArgs,
    /// Source of the packet, IP:PORT ([IPv6]:PORT).
    #[arg(long)]
    from: std::net::SocketAddr,
    /// Destination, IP:PORT/PROTO (TCP or UDP; TCP when omitted), e.g. 192.168.1.10:30080/TCP
    /// or [2001:db8::10]:30080/UDP; of the source's family.
    #[arg(long, value_parser = parse_destination)]
    to: (std::net::SocketAddr, Protocol),
    #[arg(long, value_enum, default_value = "text")]
    output: Output,
}

fn parse_destination(s: &str) -> Result<(std::net::SocketAddr, Protocol), String> {
    let (addr, proto) = s.split_once('/').unwrap_or((s, "TCP"));
    let addr = addr.parse().map_err(|_| format!("{addr:?} is not IP:PORT ([IPv6]:PORT)"))?;
    let proto = match proto.to_ascii_uppercase().as_str() {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        other => return Err(format!("protocol {other:?}: TCP or UDP")),
    };
    Ok((addr, proto))
}

#[derive(Args)]
struct RootArgs {
    /// Where maps, programs and links are pinned (a bpffs is mounted there if needed).
    #[arg(long, default_value = config::DEFAULT_BPFFS_ROOT)]
    bpffs_root: PathBuf,
}

/// A boolean flag that may be given bare (`--masquerade-all`) or with a value
/// (`--masquerade-all=false`), as Go's flags take them.
#[derive(Args)]
struct Settings {
    /// kube-proxy's configuration file (a KubeProxyConfiguration, YAML or JSON); flags given
    /// override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// This node's name, as in its Node object. Default: $NODE_NAME, the file's
    /// hostnameOverride, then the hostname.
    #[arg(long, env = "NODE_NAME")]
    hostname_override: Option<String>,
    /// The node's primary IP when not 0.0.0.0 (default: the Node's InternalIP).
    #[arg(long, value_parser = parse_ip)]
    bind_address: Option<IpAddr>,
    /// Node addresses NodePorts are served on: `primary` (the node IP) or CIDRs. Default: every
    /// address of the node.
    #[arg(long, value_parser = parse_nodeport_addresses)]
    nodeport_addresses: Option<NodePortAddresses>,
    /// The pods' ranges (netfilter modes: traffic from outside them to a cluster IP is
    /// masqueraded). Comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_cidr)]
    cluster_cidr: Option<Vec<Cidr>>,
    /// The cluster's Service CIDRs (the API server's --service-cluster-ip-range), for a
    /// manifest directory without ServiceCIDR objects: new flows to a free address of them are
    /// dropped, to a cluster IP on a port its Service lacks rejected, as kube-proxy's
    /// nftables mode does with ServiceCIDRs. Comma-separated; added to the ServiceCIDRs.
    #[arg(long, value_delimiter = ',', value_parser = parse_cidr)]
    service_cluster_ip_range: Option<Vec<Cidr>>,
    /// The cluster's NodePort range (the API server's --service-node-port-range): Services
    /// with NodePorts outside it are refused, as the API server refuses them. MIN-MAX.
    #[arg(long, value_parser = parse_port_range)]
    service_node_port_range: Option<(u16, u16)>,
    /// How the netfilter modes tell pod traffic: ClusterCIDR, NodeCIDR, BridgeInterface or
    /// InterfaceNamePrefix.
    #[arg(long)]
    detect_local_mode: Option<String>,
    /// The bridge pods hang off (detect-local-mode BridgeInterface).
    #[arg(long)]
    pod_bridge_interface: Option<String>,
    /// The prefix of pod interfaces' names (detect-local-mode InterfaceNamePrefix).
    #[arg(long)]
    pod_interface_name_prefix: Option<String>,
    /// Masquerade all traffic to Services (netfilter modes).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    masquerade_all: Option<bool>,
    /// The bit of the packet mark that asks for masquerading (0-31; default 14).
    #[arg(long)]
    iptables_masquerade_bit: Option<u8>,
    /// NodePorts on 127.0.0.1 too (default true, as kube-proxy): the iptables mode with
    /// route_localnet and its guard, the eBPF mode for the node's processes through the
    /// socket hooks (nothing from outside reaches them).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    iptables_localhost_nodeports: Option<bool>,
    /// Everything is applied again at least this often, iptables and nftables modes (default 30s).
    #[arg(long, value_parser = parse_duration)]
    iptables_sync_period: Option<Duration>,
    /// Syncs come no closer together than this, iptables and nftables modes (default 1s).
    #[arg(long, value_parser = parse_duration)]
    iptables_min_sync_period: Option<Duration>,
    /// The iptables the iptables and IPVS modes write to: nft, legacy or auto (the one the node
    /// already uses: kubelet's hint chains, else the one holding more rules, else nft).
    #[arg(long, value_parser = parse_or_auto::<Iptables>)]
    iptables_backend: Option<OrAuto<Iptables>>,
    /// IPVS mode's scheduler: rr, wrr, lc, wlc, lblc, lblcr, dh, sh, sed, nq or mh.
    #[arg(long)]
    ipvs_scheduler: Option<Scheduler>,
    /// IPVS virtual servers in these ranges are not removed (comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = parse_cidr)]
    ipvs_exclude_cidrs: Option<Vec<Cidr>>,
    /// arp_ignore=1 and arp_announce=2 in IPVS mode.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    ipvs_strict_arp: Option<bool>,
    #[arg(long, value_parser = parse_duration)]
    ipvs_tcp_timeout: Option<Duration>,
    #[arg(long, value_parser = parse_duration)]
    ipvs_tcpfin_timeout: Option<Duration>,
    #[arg(long, value_parser = parse_duration)]
    ipvs_udp_timeout: Option<Duration>,
    #[arg(long, value_parser = parse_duration)]
    ipvs_sync_period: Option<Duration>,
    #[arg(long, value_parser = parse_duration)]
    ipvs_min_sync_period: Option<Duration>,
    /// The kernel's conntrack table: entries per CPU, and at least (netfilter modes).
    #[arg(long)]
    conntrack_max_per_core: Option<u32>,
    #[arg(long)]
    conntrack_min: Option<u32>,
    /// TCP established and close-wait, UDP and UDP stream timeouts: the kernel's conntrack in
    /// the netfilter modes, the eBPF dataplane's own in eBPF mode.
    #[arg(long, value_parser = parse_duration)]
    conntrack_tcp_timeout_established: Option<Duration>,
    #[arg(long, value_parser = parse_duration)]
    conntrack_tcp_timeout_close_wait: Option<Duration>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    conntrack_tcp_be_liberal: Option<bool>,
    #[arg(long, value_parser = parse_duration)]
    conntrack_udp_timeout: Option<Duration>,
    #[arg(long, value_parser = parse_duration)]
    conntrack_udp_timeout_stream: Option<Duration>,
}

#[derive(Args)]
struct RulesArgs {
    /// ebpf (the map entries), iptables (iptables-restore input), nftables (nft -f input) or
    /// ipvs (virtual servers, ipsets and iptables rules).
    #[arg(long, value_parser = parse_mode)]
    proxy_mode: ProxyMode,
    #[arg(long)]
    manifests: PathBuf,
    /// The node's own addresses (where `run` reads them from the kernel): NodePorts are on
    /// those `--nodeport-addresses` selects, as with `run`. Default: none listed; iptables then
    /// matches every local address, as kube-proxy does. The node's primary IP is not taken
    /// from here but from `--bind-address` or the directory's Node (its InternalIP).
    #[arg(long, value_delimiter = ',', value_parser = parse_ip)]
    node_ip: Vec<IpAddr>,
    #[command(flatten)]
    settings: Settings,
}

fn parse_mode(s: &str) -> Result<ProxyMode, String> {
    s.parse()
}

fn parse_cidr(s: &str) -> Result<Cidr, String> {
    s.parse()
}

/// An address as kube-proxy reads its flags (leading zeros are decimal).
fn parse_ip(s: &str) -> Result<IpAddr, String> {
    crate::model::addr::parse_ip(s).ok_or_else(|| format!("{s:?} is not an IP address"))
}

/// A flag that is `auto` (None) or a value (`--proxy-mode`, `--iptables-backend`).
#[derive(Clone, Copy, Debug)]
struct OrAuto<T>(Option<T>);

fn parse_or_auto<T: std::str::FromStr<Err = String>>(s: &str) -> Result<OrAuto<T>, String> {
    if s == "auto" || s.is_empty() {
        Ok(OrAuto(None))
    } else {
        s.parse().map(|v| OrAuto(Some(v)))
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    settings: Settings,
    /// ebpf, iptables, ipvs, nftables, or auto: ebpf where the kernel and privileges allow,
    /// else nftables, else iptables (the choice and its reason are logged). Default: the
    /// file's mode, else auto.
    #[arg(long, value_parser = parse_or_auto::<ProxyMode>)]
    proxy_mode: Option<OrAuto<ProxyMode>>,
    /// Read Service, EndpointSlice and Node manifests (YAML or JSON, as `kubectl get -o yaml`
    /// prints them) from this directory, watched for changes, instead of the API server.
    #[arg(long, conflicts_with = "kubeconfig")]
    manifests: Option<PathBuf>,
    /// Kubeconfig for the API server. Without it (nor the file's clientConnection.kubeconfig):
    /// $KUBECONFIG, the in-cluster service account, then ~/.kube/config.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// API server requests per second on average, and at once (default 5 and 10).
    #[arg(long)]
    kube_api_qps: Option<f32>,
    #[arg(long)]
    kube_api_burst: Option<u32>,
    /// A watch that brings no event nor bookmark for this long is started again, and /healthz
    /// fails meanwhile (default 120s; the API server sends a bookmark about every minute).
    #[arg(long, value_parser = parse_duration)]
    watch_stall_timeout: Option<Duration>,
    /// Accepted for kube-proxy's sake; the API server is spoken to in JSON.
    #[arg(long, hide = true)]
    kube_api_content_type: Option<String>,
    /// Rescan the manifest directory at least this often (default 30s).
    #[arg(long, value_parser = parse_duration)]
    config_sync_period: Option<Duration>,
    /// Address for /metrics, /proxyMode and /healthz (default 127.0.0.1:10249).
    #[arg(long)]
    metrics_bind_address: Option<SocketAddr>,
    /// Address for /healthz and /livez (default 0.0.0.0:10256).
    #[arg(long)]
    healthz_bind_address: Option<SocketAddr>,
    /// eBPF mode: changes not programmed within twice this fail /healthz (default 30s; the
    /// netfilter modes take their own sync period).
    #[arg(long, value_parser = parse_duration)]
    sync_period: Option<Duration>,
    /// kube-proxy's oomScoreAdj (default -999; lowering it needs CAP_SYS_RESOURCE).
    #[arg(long, allow_hyphen_values = true)]
    oom_score_adj: Option<i32>,
    /// Where maps, programs and links are pinned (a bpffs is mounted there if needed).
    #[arg(long)]
    bpffs_root: Option<PathBuf>,
    /// Glob patterns of the host-side pod interfaces to attach to (default: veth*, lxc*,
    /// cali*, eni*, gke*, azv*).
    #[arg(long, value_delimiter = ',')]
    pod_devices: Option<Vec<String>>,
    /// Glob patterns of the external interfaces (NodePort, load-balancer and external IP
    /// traffic; XDP). Default: every interface with a global IPv4 address that is not a pod
    /// interface, a container bridge or a tunnel.
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<String>>,
    /// XDP on external interfaces: native (in the driver; flows leaving by a device that cannot
    /// take XDP frames are handed to TC), generic, or disabled. Default: native.
    #[arg(long, value_enum)]
    xdp: Option<XdpArg>,
    /// The cgroup v2 directory whose processes' sockets in the agent's network namespace
    /// (host-network processes) reach Services through socket hooks: `auto` (the root of the
    /// cgroup v2 hierarchy, mounted at /run/proxy-agent/cgroupv2 when none is), a path, or
    /// `none`.
    #[arg(long)]
    cgroup_root: Option<String>,
    /// Source ports north-south SNAT uses towards each backend, MIN-MAX (default
    /// 61000-65535). Keep it outside the node's ephemeral port range and listening ports.
    #[arg(long, value_parser = parse_port_range)]
    snat_port_range: Option<(u16, u16)>,
    /// Entries of each Maglev table (a prime; default 16381). Applies to tables as they are
    /// next written.
    #[arg(long)]
    maglev_table_size: Option<u32>,
    /// Entries of each load-balancer map (default 65536). Applies when the maps are created.
    #[arg(long)]
    lb_map_max: Option<u32>,
    /// Connection-tracking entries, two per connection (default 262144). Applies when the map
    /// is created.
    #[arg(long)]
    ct_map_max: Option<u32>,
    /// Prepare the node for the configured mode with full privileges, then exit: mount a bpffs
    /// at the pin root and a cgroup v2 hierarchy at --cgroup-root where missing, set the
    /// mode's sysctls and load its kernel modules, remove what other modes (and kube-proxy)
    /// left. For a privileged init container (see deploy/daemonset.yaml).
    #[arg(long)]
    init_only: bool,
    /// With --init-only: the host's /proc (a hostPath volume), to mount the cgroup v2
    /// hierarchy in the host's cgroup namespace.
    #[arg(long)]
    host_proc: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum XdpArg {
    Native,
    Generic,
    Disabled,
}

fn parse_port_range(s: &str) -> Result<(u16, u16), String> {
    let (a, b) = s.split_once('-').ok_or_else(|| format!("{s:?} is not MIN-MAX"))?;
    let a: u16 = a.trim().parse().map_err(|_| format!("{a:?} is not a port"))?;
    let b: u16 = b.trim().parse().map_err(|_| format!("{b:?} is not a port"))?;
    if a == 0 || a > b {
        return Err(format!("{s:?}: need 1 <= MIN <= MAX"));
    }
    Ok((a, b))
}

fn parse_nodeport_addresses(s: &str) -> Result<NodePortAddresses, String> {
    s.parse()
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Args)]
struct InspectArgs {
    #[command(flatten)]
    root: RootArgs,
    #[arg(long, value_enum, default_value = "text")]
    output: Output,
}

/// A Go duration, as kube-proxy's flags take them (`30s`, `1m0s`, `250ms`).
fn parse_duration(s: &str) -> Result<Duration, String> {
    config::duration::parse(s)
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is large enough for a hostname and NUL-terminated by the kernel.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    // kube-proxy lower-cases the hostname it falls back to.
    String::from_utf8_lossy(&buf[..end]).to_lowercase()
}

/// klog verbosity as a level: kube-proxy logs its routine at -v 2, details at 4 and more.
fn level_of_verbosity(v: u32) -> &'static str {
    match v {
        0..=3 => "info",
        4 | 5 => "debug",
        _ => "trace",
    }
}

fn init_logging(level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("warn,proxy_agent={level}")));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_target(false).with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        // Colours only on a terminal: log files and `kubectl logs` get plain text.
        LogFormat::Text => builder.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
    }
}

impl Settings {
    fn flags(&self) -> Flags {
        Flags {
            config: self.config.clone(),
            hostname_override: self.hostname_override.clone(),
            bind_address: self.bind_address,
            nodeport_addresses: self.nodeport_addresses.clone(),
            cluster_cidr: self.cluster_cidr.clone(),
            service_cluster_ip_range: self.service_cluster_ip_range.clone(),
            detect_local_mode: self.detect_local_mode.clone(),
            pod_bridge_interface: self.pod_bridge_interface.clone(),
            pod_interface_name_prefix: self.pod_interface_name_prefix.clone(),
            service_node_port_range: self.service_node_port_range,
            masquerade_all: self.masquerade_all,
            iptables_masquerade_bit: self.iptables_masquerade_bit,
            iptables_localhost_nodeports: self.iptables_localhost_nodeports,
            iptables_sync_period: self.iptables_sync_period,
            iptables_min_sync_period: self.iptables_min_sync_period,
            nftables_sync_period: self.iptables_sync_period,
            nftables_min_sync_period: self.iptables_min_sync_period,
            iptables_backend: self.iptables_backend.map(|b| b.0),
            ipvs_scheduler: self.ipvs_scheduler.clone(),
            ipvs_exclude_cidrs: self.ipvs_exclude_cidrs.clone(),
            ipvs_strict_arp: self.ipvs_strict_arp,
            ipvs_tcp_timeout: self.ipvs_tcp_timeout,
            ipvs_tcpfin_timeout: self.ipvs_tcpfin_timeout,
            ipvs_udp_timeout: self.ipvs_udp_timeout,
            ipvs_sync_period: self.ipvs_sync_period,
            ipvs_min_sync_period: self.ipvs_min_sync_period,
            conntrack: ConntrackFlags {
                max_per_core: self.conntrack_max_per_core,
                min: self.conntrack_min,
                tcp_timeout_established: self.conntrack_tcp_timeout_established,
                tcp_timeout_close_wait: self.conntrack_tcp_timeout_close_wait,
                tcp_be_liberal: self.conntrack_tcp_be_liberal,
                udp_timeout: self.conntrack_udp_timeout,
                udp_timeout_stream: self.conntrack_udp_timeout_stream,
            },
            ..Default::default()
        }
    }
}

impl RunArgs {
    fn flags(&self) -> Result<Flags, String> {
        Ok(Flags {
            manifests: self.manifests.clone(),
            kubeconfig: self.kubeconfig.clone(),
            kube_api_qps: self.kube_api_qps,
            kube_api_burst: self.kube_api_burst,
            watch_stall: self.watch_stall_timeout,
            proxy_mode: self.proxy_mode.map(|m| m.0),
            metrics_bind_address: self.metrics_bind_address,
            healthz_bind_address: self.healthz_bind_address,
            oom_score_adj: self.oom_score_adj,
            config_sync_period: self.config_sync_period,
            sync_period: self.sync_period,
            bpffs_root: self.bpffs_root.clone(),
            pod_devices: self.pod_devices.clone(),
            devices: self.devices.clone(),
            xdp: self.xdp.map(|x| match x {
                XdpArg::Native => XdpSetting::Native,
                XdpArg::Generic => XdpSetting::Generic,
                XdpArg::Disabled => XdpSetting::Disabled,
            }),
            cgroup_root: self.cgroup_root.as_deref().map(|c| match c {
                "none" => None,
                "auto" => Some(None),
                path => Some(Some(PathBuf::from(path))),
            }),
            maglev_table_size: self.maglev_table_size,
            snat_port_range: self.snat_port_range,
            lb_map_max: self.lb_map_max,
            ct_map_max: self.ct_map_max,
            ..self.settings.flags()
        })
    }
}

/// `cleanup` removes netfilter rules (CAP_NET_ADMIN) and pins (access to the bpffs): without
/// them it would find nothing and say so, which is not true.
fn privileged_for_cleanup(root: &std::path::Path) -> Result<(), String> {
    use crate::dataplane::modes::{effective_capabilities, CAP_NET_ADMIN};
    if effective_capabilities() & (1 << CAP_NET_ADMIN) == 0 {
        return Err("cleanup removes netfilter rules and pinned programs: it needs CAP_NET_ADMIN (run it as root)".into());
    }
    inspect::pinned(root).map(|_| ()).map_err(|e| e.to_string())
}

/// kube-proxy is run without a subcommand (`kube-proxy --config=...`): so may we.
fn args() -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let first = args.get(1).and_then(|a| a.to_str()).unwrap_or("");
    let global = ["-h", "--help", "-V", "--version", "--log-level", "--v"];
    if first.starts_with('-') && !global.iter().any(|g| first == *g || first.starts_with(&format!("{g}="))) {
        args.insert(1, "run".into());
    }
    args
}

pub fn main() -> ExitCode {
    crate::memory::limit_arenas();
    let cli = Cli::parse_from(args());
    let level = |file_verbosity: Option<u32>| -> String {
        match (&cli.log_level, cli.verbosity.or(file_verbosity)) {
            (Some(l), _) => l.clone(),
            (None, Some(v)) => level_of_verbosity(v).into(),
            (None, None) => "info".into(),
        }
    };
    let result = match cli.cmd {
        Cmd::Run(ref a) => {
            let resolved = a.flags().and_then(|flags| Config::resolve(flags, hostname));
            let (cfg, notes) = match resolved {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("proxy-agent: {e}");
                    return ExitCode::FAILURE;
                }
            };
            init_logging(&level(cfg.common.log_verbosity), cfg.common.log_format);
            for n in notes {
                tracing::warn!("{n}");
            }
            if a.kube_api_content_type.as_deref().is_some_and(|c| c != "application/json") {
                tracing::warn!("--kube-api-content-type: this agent's client speaks JSON to the API server");
            }
            if a.init_only {
                crate::init::run(&cfg, a.host_proc.as_deref())
            } else {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .map_err(anyhow::Error::from)
                    .and_then(|rt| rt.block_on(crate::agent::run(cfg)))
            }
        }
        Cmd::Inspect(a) => {
            init_logging(&level(None), LogFormat::Text);
            inspect::read(&a.root.bpffs_root).map_err(anyhow::Error::from).map(|r| match a.output {
                Output::Text => print!("{}", inspect::render(&r)),
                Output::Json => println!("{}", serde_json::to_string_pretty(&r).expect("report serialises")),
            })
        }
        Cmd::Trace(a) => {
            init_logging(&level(None), LogFormat::Text);
            crate::trace::run(&a.root.bpffs_root, a.from, a.to.0, a.to.1).map_err(anyhow::Error::from).map(|r| match a.output {
                Output::Text => print!("{}", crate::trace::render(&r)),
                Output::Json => println!("{}", serde_json::to_string_pretty(&r).expect("report serialises")),
            })
        }
        Cmd::Cleanup(a) => {
            init_logging(&level(None), LogFormat::Text);
            if let Err(e) = privileged_for_cleanup(&a.bpffs_root) {
                eprintln!("proxy-agent: {e}");
                return ExitCode::FAILURE;
            }
            let lines = crate::dataplane::modes::cleanup_all(&a.bpffs_root);
            if lines.is_empty() {
                println!("nothing to remove");
            }
            for l in lines {
                println!("removed {l}");
            }
            Ok(())
        }
        Cmd::Rules(a) => {
            init_logging(&level(None), LogFormat::Text);
            let flags = Flags { manifests: Some(a.manifests.clone()), proxy_mode: Some(Some(a.proxy_mode)), ..a.settings.flags() };
            match Config::resolve(flags, hostname) {
                Ok((cfg, notes)) => {
                    for n in notes {
                        eprintln!("note: {n}");
                    }
                    crate::rules::print(a.proxy_mode, &a.manifests, &cfg, &a.node_ip).map(|text| print!("{text}"))
                }
                Err(e) => Err(anyhow::anyhow!(e)),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("proxy-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_proxy_style_flags_parse() {
        let cli = Cli::try_parse_from([
            "proxy-agent",
            "run",
            "--config=/var/lib/kube-proxy/config.conf",
            "--hostname-override=node-1",
            "--masquerade-all",
            "--iptables-localhost-nodeports=false",
            "--iptables-sync-period=1m0s",
            "--oom-score-adj=-999",
            "--cluster-cidr=10.244.0.0/16",
        ])
        .unwrap();
        let Cmd::Run(a) = cli.cmd else { panic!("run") };
        let f = a.flags().unwrap();
        assert_eq!(f.config, Some(PathBuf::from("/var/lib/kube-proxy/config.conf")));
        assert_eq!(f.masquerade_all, Some(true));
        assert_eq!(f.iptables_localhost_nodeports, Some(false));
        assert_eq!(f.iptables_sync_period, Some(Duration::from_secs(60)));
        assert_eq!(f.oom_score_adj, Some(-999));
        assert_eq!(f.proxy_mode, None, "not given: the file's, else auto");
        assert_eq!(level_of_verbosity(2), "info");
        assert_eq!(level_of_verbosity(4), "debug");
    }
}
