//! Command line: `run`, `inspect`, `cleanup`. Flags use kube-proxy's names where it has one.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::{Args, Parser, Subcommand, ValueEnum};
use proxy_common::limits;

use crate::{agent, inspect};

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
    /// Remove every program, map and link the agent pinned (tracked connections are lost).
    Cleanup(RootArgs),
}

#[derive(Args)]
struct RootArgs {
    /// Where maps, programs and links are pinned (a bpffs is mounted there if needed).
    #[arg(long, default_value = DEFAULT_BPFFS_ROOT)]
    bpffs_root: PathBuf,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    root: RootArgs,
    /// Directory of Service, EndpointSlice and Node manifests (YAML or JSON, as
    /// `kubectl get -o yaml` prints them), watched for changes.
    #[arg(long)]
    manifests: PathBuf,
    /// Glob patterns of the host-side pod interfaces to attach to.
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_POD_DEVICES)]
    pod_devices: Vec<String>,
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
    tracing_subscriber::fmt().with_env_filter(filter).with_target(false).init();
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.log_level);
    let result = match cli.cmd {
        Cmd::Run(a) => {
            let cfg = agent::RunConfig {
                manifests: a.manifests,
                pod_devices: a.pod_devices,
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
        Cmd::Cleanup(a) => inspect::cleanup(&a.bpffs_root).map_err(anyhow::Error::from).map(|removed| {
            println!("removed {} pinned objects under {}", removed.len(), a.bpffs_root.display());
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("proxy-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}
