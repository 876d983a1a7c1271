//! Command line: `run`, `inspect`, `cleanup`. Flags use kube-proxy's names where it has one.

use crate::dataplane::netfilter::{ipvs::Scheduler, Iptables};
use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};
use proxy_common::limits;

use crate::{
    agent::{self, Source},
    dataplane::ProxyMode,
    model::store::Cidr,
    dataplane::ebpf::attach::XdpSetting,
    inspect,
    model::{store::NodePortAddresses, Protocol},
};

const DEFAULT_BPFFS_ROOT: &str = "/sys/fs/bpf/proxy-agent";
/// Host-side names of pod interfaces in common CNIs: veth (bridge, flannel, kindnet), lxc
/// (Cilium), cali (Calico), eni (AWS VPC CNI), gke (GKE), azv (Azure CNI).
const DEFAULT_POD_DEVICES: &str = "veth*,lxc*,cali*,eni*,gke*,azv*";

#[derive(Parser)]
#[command(name = "proxy-agent", version, about = "eBPF kube-proxy replacement: node agent")]
struct Cli {
    /// Log level (error, warn, info, debug, trace); RUST_LOG overrides it.
    #[arg(long, global = true, default_value = "info")]
    log_level: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Program Services into the eBPF dataplane and keep them up to date.
    Run(RunArgs),
    /// Print what is programmed: services, backends, connections, counters.
    Inspect(InspectArgs),
    /// Remove what the agent installed in every mode: pinned programs, maps and links (tracked
    /// connections are lost), iptables chains, the nftables table, IPVS services.
    Cleanup(RootArgs),
    /// Print what the agent would program for a manifest directory, in one mode, without
    /// touching the kernel.
    Rules(RulesArgs),
    /// Run a synthetic packet arriving from outside through the loaded program and print what
    /// it would do (verdict, Service, backend). Run it in the node's network namespace.
    Trace(TraceArgs),
}

#[derive(Args)]
struct TraceArgs {
    #[command(flatten)]
    root: RootArgs,
    /// Source of the packet, IP:PORT.
    #[arg(long)]
    from: std::net::SocketAddrV4,
    /// Destination, IP:PORT/PROTO (TCP or UDP; TCP when omitted), e.g. 192.168.1.10:30080/TCP.
    #[arg(long, value_parser = parse_destination)]
    to: (std::net::SocketAddrV4, Protocol),
    #[arg(long, value_enum, default_value = "text")]
    output: Output,
}

fn parse_destination(s: &str) -> Result<(std::net::SocketAddrV4, Protocol), String> {
    let (addr, proto) = s.split_once('/').unwrap_or((s, "TCP"));
    let addr = addr.parse().map_err(|_| format!("{addr:?} is not IPv4:PORT"))?;
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
    #[arg(long, default_value = DEFAULT_BPFFS_ROOT)]
    bpffs_root: PathBuf,
}

#[derive(Args)]
struct RulesArgs {
    /// ebpf (the map entries), iptables (iptables-restore input), nftables (nft -f input) or
    /// ipvs (virtual servers, ipsets and iptables rules).
    #[arg(long, value_parser = parse_mode)]
    proxy_mode: ProxyMode,
    #[arg(long)]
    manifests: PathBuf,
    /// This node's name, as in its Node object (which endpoints are local).
    #[arg(long, env = "NODE_NAME")]
    hostname_override: Option<String>,
    /// The node's addresses NodePorts are served on (default: none listed; iptables then
    /// matches every local address, as kube-proxy does).
    #[arg(long, value_delimiter = ',')]
    node_ip: Vec<std::net::Ipv4Addr>,
    #[command(flatten)]
    netfilter: NetfilterArgs,
}

/// What only the netfilter modes use (`run` and `rules`).
#[derive(Args)]
struct NetfilterArgs {
    /// The pods' address range: traffic from outside it to a cluster IP is masqueraded, and
    /// externalTrafficPolicy Local short-circuits traffic from inside it.
    #[arg(long, value_parser = parse_cidr)]
    cluster_cidr: Option<Cidr>,
    /// Masquerade all traffic to Services.
    #[arg(long)]
    masquerade_all: bool,
    /// IPVS mode's scheduler: rr, wrr, lc, wlc, lblc, lblcr, dh, sh, sed, nq or mh.
    #[arg(long, default_value = "rr")]
    ipvs_scheduler: Scheduler,
    /// The iptables the iptables and IPVS modes write to: nft (iptables-nft), legacy
    /// (iptables-legacy) or auto (the one the node already uses: kubelet's hint chains, else the
    /// one holding more rules, else nft).
    #[arg(long, default_value = "auto", value_parser = parse_or_auto::<Iptables>)]
    iptables_backend: OrAuto<Iptables>,
}

fn parse_mode(s: &str) -> Result<ProxyMode, String> {
    s.parse()
}

fn parse_cidr(s: &str) -> Result<Cidr, String> {
    s.parse()
}

/// A flag that is `auto` (None) or a value (`--proxy-mode`, `--iptables-backend`).
#[derive(Clone, Copy, Debug)]
struct OrAuto<T>(Option<T>);

fn parse_or_auto<T: std::str::FromStr<Err = String>>(s: &str) -> Result<OrAuto<T>, String> {
    if s == "auto" {
        Ok(OrAuto(None))
    } else {
        s.parse().map(|v| OrAuto(Some(v)))
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    root: RootArgs,
    /// ebpf, iptables, ipvs, nftables, or auto: ebpf where the kernel and privileges allow,
    /// else nftables, else iptables (the choice and its reason are logged).
    #[arg(long, default_value = "auto", value_parser = parse_or_auto::<ProxyMode>)]
    proxy_mode: OrAuto<ProxyMode>,
    #[command(flatten)]
    netfilter: NetfilterArgs,
    /// Read Service, EndpointSlice and Node manifests (YAML or JSON, as `kubectl get -o yaml`
    /// prints them) from this directory, watched for changes, instead of the API server.
    #[arg(long, conflicts_with = "kubeconfig")]
    manifests: Option<PathBuf>,
    /// Kubeconfig for the API server. Without it (and without --manifests): $KUBECONFIG, the
    /// in-cluster service account, then ~/.kube/config.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Address for /metrics, /proxyMode and /healthz ("ok"), as kube-proxy's.
    #[arg(long, default_value = "127.0.0.1:10249")]
    metrics_bind_address: SocketAddr,
    /// Address for /healthz and /livez, as kube-proxy's.
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: SocketAddr,
    /// Changes not programmed within twice this (kube-proxy's --sync-period) fail /healthz.
    /// Units: ms, s, m, h.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    sync_period: Duration,
    /// Glob patterns of the host-side pod interfaces to attach to.
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_POD_DEVICES)]
    pod_devices: Vec<String>,
    /// Glob patterns of the external interfaces (NodePort, load-balancer and external IP
    /// traffic; XDP). Default: every interface with a global IPv4 address that is not a pod
    /// interface, a container bridge or a tunnel.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Node addresses NodePorts are served on, as kube-proxy's flag: `primary` (the Node's
    /// InternalIP) or a comma-separated list of CIDRs. Default: every address of the node.
    #[arg(long, value_parser = parse_nodeport_addresses)]
    nodeport_addresses: Option<NodePortAddresses>,
    /// XDP on external interfaces: native (in the driver), generic, or disabled.
    #[arg(long, value_enum, default_value = "native")]
    xdp: XdpArg,
    /// The cgroup v2 directory whose processes' sockets in the agent's network namespace
    /// (host-network processes) reach Services through socket hooks: `auto` (the root of the
    /// cgroup v2 hierarchy), a path, or `none`.
    #[arg(long, default_value = "auto")]
    cgroup_root: String,
    /// Source ports north-south SNAT uses towards each backend, MIN-MAX. Keep it outside the
    /// node's ephemeral port range (net.ipv4.ip_local_port_range) and its listening ports.
    #[arg(long, default_value = "61000-65535", value_parser = parse_port_range)]
    snat_port_range: (u16, u16),
    /// Entries of each Maglev table (a prime; about 100x the largest backend count keeps the
    /// load within 1%). Applies to tables as they are next written.
    #[arg(long, default_value_t = limits::MAGLEV_TABLE_SIZE)]
    maglev_table_size: u32,
    /// This node's name, as in its Node object. Defaults to $NODE_NAME, then the hostname.
    #[arg(long, env = "NODE_NAME")]
    hostname_override: Option<String>,
    /// Entries of each load-balancer map (services + slots, backends). Applies when the maps
    /// are first created.
    #[arg(long, default_value_t = limits::LB_MAP_MAX)]
    lb_map_max: u32,
    /// Connection-tracking entries (two per connection). Applies when the map is first created.
    #[arg(long, default_value_t = limits::CT_MAP_MAX)]
    ct_map_max: u32,
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

/// A Go-style duration as kube-proxy takes: a number and a unit (ms, s, m, h).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').ok_or_else(|| format!("{s:?} has no unit (ms, s, m, h)"))?;
    let (n, unit) = s.split_at(split);
    let n: f64 = n.parse().map_err(|_| format!("{s:?} does not start with a number"))?;
    let secs = match unit {
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (ms, s, m, h)")),
    };
    if secs <= 0.0 {
        return Err(format!("{s:?} must be positive"));
    }
    Ok(Duration::from_secs_f64(secs))
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

fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("warn,proxy_agent={level}")));
    // Colours only on a terminal: log files and `kubectl logs` get plain text.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log_level);
    let result = match cli.cmd {
        Cmd::Run(a) => {
            let cfg = agent::RunConfig {
                proxy_mode: a.proxy_mode.0,
                cluster_cidr: a.netfilter.cluster_cidr,
                masquerade_all: a.netfilter.masquerade_all,
                ipvs_scheduler: a.netfilter.ipvs_scheduler,
                iptables_backend: a.netfilter.iptables_backend.0,
                source: match a.manifests {
                    Some(dir) => Source::Manifests(dir),
                    None => Source::Kube(a.kubeconfig),
                },
                metrics_bind: a.metrics_bind_address,
                healthz_bind: a.healthz_bind_address,
                sync_period: a.sync_period,
                pod_devices: a.pod_devices,
                devices: a.devices,
                nodeport_addresses: a.nodeport_addresses.unwrap_or_default(),
                xdp: match a.xdp {
                    XdpArg::Native => XdpSetting::Native,
                    XdpArg::Generic => XdpSetting::Generic,
                    XdpArg::Disabled => XdpSetting::Disabled,
                },
                cgroup_root: match a.cgroup_root.as_str() {
                    "none" => None,
                    "auto" => Some(None),
                    path => Some(Some(PathBuf::from(path))),
                },
                maglev_size: a.maglev_table_size,
                snat_ports: a.snat_port_range,
                bpffs_root: a.root.bpffs_root,
                hostname: a.hostname_override.unwrap_or_else(hostname),
                lb_map_max: a.lb_map_max,
                ct_map_max: a.ct_map_max,
                resync: Duration::from_secs(30),
            };
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(anyhow::Error::from)
                .and_then(|rt| rt.block_on(agent::run(cfg)))
        }
        Cmd::Inspect(a) => inspect::read(&a.root.bpffs_root).map_err(anyhow::Error::from).map(|r| match a.output {
            Output::Text => print!("{}", inspect::render(&r)),
            Output::Json => println!("{}", serde_json::to_string_pretty(&r).expect("report serialises")),
        }),
        Cmd::Trace(a) => crate::trace::run(&a.root.bpffs_root, a.from, a.to.0, a.to.1).map_err(anyhow::Error::from).map(|r| {
            match a.output {
                Output::Text => print!("{}", crate::trace::render(&r)),
                Output::Json => println!("{}", serde_json::to_string_pretty(&r).expect("report serialises")),
            }
        }),
        Cmd::Cleanup(a) => {
            let mut lines = Vec::new();
            let backends = crate::dataplane::netfilter::Iptables::available();
            for mode in crate::dataplane::ProxyMode::ALL {
                lines.extend(crate::dataplane::modes::cleanup(mode, &a.bpffs_root, &backends));
            }
            if lines.is_empty() {
                println!("nothing to remove");
            }
            for l in lines {
                println!("removed {l}");
            }
            Ok(())
        }
        Cmd::Rules(a) => crate::rules::print(
            a.proxy_mode,
            &a.manifests,
            &a.hostname_override.unwrap_or_else(hostname),
            crate::dataplane::netfilter::NodeContext {
                nodeport_all: a.node_ip.is_empty(),
                nodeport_ips: a.node_ip,
                cluster_cidr: a.netfilter.cluster_cidr,
                masquerade_all: a.netfilter.masquerade_all,
            },
            crate::dataplane::modes::RuleOptions {
                scheduler: a.netfilter.ipvs_scheduler,
                // What is printed does not depend on the backend.
                iptables: a.netfilter.iptables_backend.0.unwrap_or_default(),
            },
        )
        .map(|text| print!("{text}")),
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
    fn durations_parse_like_kube_proxy_flags() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert!(parse_duration("30").unwrap_err().contains("no unit"));
        assert!(parse_duration("5d").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("0s").is_err());
    }
}
