//! `proxy-agent run`: load or adopt the dataplane, attach to pod interfaces as they appear,
//! and keep the maps in step with the source (API server or manifest directory) until SIGTERM.
//! On exit the programs, maps and links stay pinned, so traffic keeps flowing until the next
//! run adopts them.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::PathBuf,
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use std::os::fd::AsFd as _;

use anyhow::Context as _;
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::mpsc,
};

use crate::{
    dataplane::{
        ebpf::{
            attach::{Attachments, DevicePatterns, XdpSetting},
            batch,
            loader::{self, LoadOptions},
            EbpfDataplane,
        },
        Dataplane as _,
    },
    dataplane::ProxyMode,
    devices::Devices,
    healthcheck::HealthServers,
    http,
    model::store::{Event, Kind, NodePortAddresses, Store},
    netlink,
    proxier::NetfilterProxier,
    reconcile::{Reconciler, SyncStats},
    source::{self, manifests::ManifestDir},
    telemetry::Telemetry,
};

#[derive(Clone, Debug)]
pub enum Source {
    /// A directory of manifests, watched for changes.
    Manifests(PathBuf),
    /// The API server, from a kubeconfig (None: $KUBECONFIG, in-cluster, ~/.kube/config).
    Kube(Option<PathBuf>),
}

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub source: Source,
    /// None: auto.
    pub proxy_mode: Option<ProxyMode>,
    /// `--cluster-cidr` (netfilter modes: what counts as pod traffic).
    pub cluster_cidr: Option<crate::model::store::Cidr>,
    /// `--masquerade-all` (netfilter modes).
    pub masquerade_all: bool,
    /// `--ipvs-scheduler` (IPVS mode).
    pub ipvs_scheduler: crate::dataplane::netfilter::ipvs::Scheduler,
    /// `--iptables-backend` (iptables and IPVS modes); None: auto.
    pub iptables_backend: Option<crate::dataplane::netfilter::Iptables>,
    pub pod_devices: Vec<String>,
    /// External interfaces (glob patterns); empty: those with a global IPv4 address.
    pub devices: Vec<String>,
    pub nodeport_addresses: NodePortAddresses,
    pub xdp: XdpSetting,
    /// `--cgroup-root`: None: no socket hooks; Some(None): the cgroup v2 root.
    pub cgroup_root: Option<Option<PathBuf>>,
    pub maglev_size: u32,
    /// North-south SNAT source ports (inclusive).
    pub snat_ports: (u16, u16),
    pub bpffs_root: PathBuf,
    pub hostname: String,
    pub lb_map_max: u32,
    pub ct_map_max: u32,
    pub metrics_bind: SocketAddr,
    pub healthz_bind: SocketAddr,
    /// kube-proxy's --sync-period: programming later than twice this fails /healthz.
    pub sync_period: Duration,
    /// Rescan the manifest directory at least this often, in case inotify misses a change.
    pub resync: Duration,
}

fn log_sync(s: &SyncStats) {
    if s.initial {
        tracing::info!(
            services = s.services,
            programmed = s.upserted,
            unchanged = s.unchanged,
            removed = s.removed,
            failed = s.failed,
            unused_entries_removed = s.garbage,
            millis = s.duration.as_secs_f64() * 1e3,
            "initial sync done"
        );
    } else if s.upserted + s.removed + s.failed > 0 {
        tracing::info!(
            services = s.services,
            programmed = s.upserted,
            removed = s.removed,
            failed = s.failed,
            millis = s.duration.as_secs_f64() * 1e3,
            "sync"
        );
    }
}

/// Counts conntrack entries every 15 s for the map gauge (a batched walk of the map).
fn spawn_conntrack_gauge(root: PathBuf, t: Arc<Telemetry>) {
    tokio::spawn(async move {
        let path = loader::maps_dir(&root).join(proxy_common::map_names::CT);
        loop {
            let p = path.clone();
            let counted = tokio::task::spawn_blocking(move || {
                let map = aya::maps::MapData::from_pin(&p).map_err(std::io::Error::other)?;
                batch::count_entries(map.fd().as_fd(), size_of::<proxy_common::CtKey>(), size_of::<proxy_common::CtEntry>())
            })
            .await;
            match counted {
                Ok(Ok(n)) => t.fill.conntrack.store(n, Ordering::Relaxed),
                Ok(Err(e)) => tracing::debug!(error = %e, "counting conntrack entries"),
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_secs(15)).await;
        }
    });
}

/// The source of Services and endpoints, started; the returned guard keeps a directory
/// watcher alive.
async fn start_source(cfg: &RunConfig) -> anyhow::Result<(mpsc::Receiver<Event>, Option<notify::RecommendedWatcher>)> {
    let (src_tx, src_rx) = mpsc::channel(256);
    let mut watcher = None;
    match &cfg.source {
        Source::Manifests(dir) => {
            let dir = ManifestDir::new(dir).map_err(anyhow::Error::msg)?;
            watcher = Some(
                source::manifests::spawn(dir, src_tx, cfg.resync).with_context(|| format!("watching {:?}", cfg.source))?,
            );
        }
        Source::Kube(kubeconfig) => {
            let client = source::kube::client(kubeconfig.as_deref()).await?;
            source::kube::spawn(client, &cfg.hostname, src_tx);
        }
    }
    Ok((src_rx, watcher))
}

fn load_ebpf(cfg: &RunConfig) -> Result<EbpfDataplane, crate::dataplane::ebpf::EbpfError> {
    EbpfDataplane::load(LoadOptions {
        pin_root: Some(cfg.bpffs_root.clone()),
        lb_map_max: cfg.lb_map_max,
        ct_map_max: cfg.ct_map_max,
        maglev_size: cfg.maglev_size,
        snat_ports: cfg.snat_ports,
    })
}

/// `--proxy-mode auto`: ebpf when this kernel and these privileges run our programs, else
/// nftables, else iptables. Says why.
fn choose_mode(cfg: &RunConfig) -> (ProxyMode, Option<EbpfDataplane>) {
    match crate::dataplane::modes::ebpf_unsupported() {
        None => match load_ebpf(cfg) {
            Ok(dp) => {
                tracing::info!(mode = "ebpf", "proxy mode auto: the kernel runs the eBPF dataplane");
                return (ProxyMode::Ebpf, Some(dp));
            }
            Err(e) => tracing::warn!("proxy mode auto: the eBPF dataplane cannot load ({e}); falling back"),
        },
        Some(why) => tracing::warn!("proxy mode auto: not using eBPF: {why}; falling back"),
    }
    match crate::dataplane::modes::nftables_unsupported() {
        None => {
            tracing::info!(mode = "nftables", "proxy mode auto: nf_tables and nft are available");
            (ProxyMode::Nftables, None)
        }
        Some(why) => {
            tracing::warn!(mode = "iptables", "proxy mode auto: not using nftables: {why}; using iptables");
            (ProxyMode::Iptables, None)
        }
    }
}

pub async fn run(cfg: RunConfig) -> anyhow::Result<()> {
    let (mode, loaded) = match cfg.proxy_mode {
        Some(m) => {
            tracing::info!(mode = %m, "proxy mode as configured (--proxy-mode)");
            (m, None)
        }
        None => choose_mode(&cfg),
    };
    let backends = crate::dataplane::netfilter::Iptables::available();
    let ipt = matches!(mode, ProxyMode::Iptables | ProxyMode::Ipvs).then(|| match cfg.iptables_backend {
        Some(b) => {
            tracing::info!(backend = %b, "iptables backend as configured (--iptables-backend)");
            b
        }
        None => {
            let (b, why) = crate::dataplane::netfilter::Iptables::detect(&backends);
            tracing::info!(backend = %b, "iptables backend auto: {why}");
            b
        }
    });
    crate::dataplane::modes::cleanup_other_modes(mode, ipt, &backends, &cfg.bpffs_root);
    match mode {
        ProxyMode::Ebpf => {
            let dp = match loaded {
                Some(dp) => dp,
                None => load_ebpf(&cfg)?,
            };
            run_ebpf(cfg, dp).await
        }
        other => run_netfilter(cfg, other, ipt.unwrap_or_default()).await,
    }
}

async fn run_netfilter(cfg: RunConfig, mode: ProxyMode, iptables: crate::dataplane::netfilter::Iptables) -> anyhow::Result<()> {
    let opts = crate::dataplane::modes::RuleOptions { scheduler: cfg.ipvs_scheduler.clone(), iptables };
    let rules = crate::dataplane::modes::rules_for(mode, opts).map_err(anyhow::Error::msg)?;
    let (mut src_rx, _watcher) = start_source(&cfg).await?;
    let telemetry = Telemetry::new(2 * cfg.sync_period, None, (0, 0));
    http::spawn("metrics", "--metrics-bind-address", cfg.metrics_bind, http::metrics_router(telemetry.clone(), mode.as_str()));
    http::spawn("healthz", "--healthz-bind-address", cfg.healthz_bind, http::health_router(telemetry.clone()));
    let mut store = Store::new(cfg.hostname.clone());
    store.set_nodeport_config(cfg.nodeport_addresses.clone());
    let mut proxier = NetfilterProxier::new(
        store,
        rules,
        vec![Kind::Service, Kind::EndpointSlice, Kind::Node],
        cfg.cluster_cidr,
        cfg.masquerade_all,
    );
    let mut health = HealthServers::new(telemetry.clone());
    // Node addresses, for NodePorts.
    let (link_tx, mut link_rx) = mpsc::channel(256);
    let (links, addrs) = netlink::watch(link_tx).await.context("watching network interfaces over rtnetlink")?;
    let no_devices = DevicePatterns::parse(&[]).expect("empty pattern list");
    let mut devices = Devices::new(no_devices, Some(DevicePatterns::parse(&[]).expect("empty")), XdpSetting::Disabled);
    for (index, name) in links {
        devices.apply(&netlink::LinkChange::Present { index, name });
    }
    for a in &addrs {
        devices.apply(a);
    }
    proxier.store.set_local_addresses(devices.node_addresses());
    tracing::info!(mode = %mode, node = cfg.hostname, "programming Services with the kernel's netfilter");

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut retry = tokio::time::interval(Duration::from_secs(2));
    // A retry comes 2 s after the last one, never as a burst of ticks missed meanwhile.
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let netfilter_sync = |p: &mut NetfilterProxier, health: &mut HealthServers| {
        if let Some(s) = p.sync() {
            log_sync(&s);
            health.update(&p.health_checks());
            telemetry.synced(&s, &p.store.change_counts());
            if !p.has_failures() {
                telemetry.updated();
            }
        } else {
            telemetry.record_changes(&p.store.change_counts());
        }
    };
    let mut node_watch = NodeWatch::default();
    loop {
        tokio::select! {
            Some(ev) = src_rx.recv() => {
                proxier.handle(ev);
                while let Ok(ev) = src_rx.try_recv() {
                    proxier.handle(ev);
                }
                node_watch.observe(&proxier.store, proxier.ready(), &telemetry, &cfg.hostname);
                if proxier.store.has_dirty() {
                    telemetry.queued();
                }
                netfilter_sync(&mut proxier, &mut health);
            }
            Some(change) = link_rx.recv() => {
                let mut changed = devices.apply(&change);
                while let Ok(change) = link_rx.try_recv() {
                    changed |= devices.apply(&change);
                }
                if changed {
                    proxier.store.set_local_addresses(devices.node_addresses());
                    if proxier.store.has_dirty() {
                        telemetry.queued();
                        netfilter_sync(&mut proxier, &mut health);
                    }
                }
            }
            _ = retry.tick(), if proxier.has_failures() => netfilter_sync(&mut proxier, &mut health),
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
    }
    tracing::info!(mode = %mode, "stopping; the rules stay in place (`proxy-agent cleanup` removes them)");
    Ok(())
}

/// Attaches the socket hooks that serve Services to host-network processes (`--cgroup-root`).
/// A failure is reported and the agent goes on: pods and outside clients are served all the
/// same.
fn serve_host_sockets(cfg: &RunConfig, dp: &mut EbpfDataplane) {
    use crate::dataplane::ebpf::hostsock;
    let Some(root) = &cfg.cgroup_root else {
        let removed = dp.stop_serving_host_sockets();
        tracing::info!(removed_hooks = removed, "--cgroup-root none: host-network processes do not reach Services through this agent");
        return;
    };
    let cgroup = match root {
        Some(path) => path.clone(),
        None if !hostsock::in_host_cgroup_namespace() => {
            tracing::warn!(
                "the agent runs in a cgroup namespace of its own (a container): the cgroup v2 hierarchy it sees is its \
                 own container's, so host-network processes would not be served. Mount the host's (hostPath /sys/fs/cgroup) \
                 and pass it as --cgroup-root"
            );
            return;
        }
        None => match hostsock::cgroup2_mount() {
            Some(m) => m,
            None => {
                tracing::warn!("no cgroup v2 hierarchy is mounted: host-network processes do not reach Services (mount one, or pass --cgroup-root)");
                return;
            }
        },
    };
    if let Err(e) = dp.serve_host_sockets(&cgroup) {
        tracing::warn!("{e}; host-network processes are served only by hooks a previous run left attached, if any");
    }
}

async fn run_ebpf(cfg: RunConfig, dp: EbpfDataplane) -> anyhow::Result<()> {
    let patterns = DevicePatterns::parse(&cfg.pod_devices).map_err(anyhow::Error::msg)?;
    let external = if cfg.devices.is_empty() {
        None
    } else {
        Some(DevicePatterns::parse(&cfg.devices).map_err(|e| anyhow::anyhow!("--devices: {e}"))?)
    };
    let (mut src_rx, _watcher) = start_source(&cfg).await?;
    tracing::info!(
        bpffs_root = %cfg.bpffs_root.display(),
        node = cfg.hostname,
        adopted_frontends = dp.programmed_keys().len(),
        "dataplane loaded"
    );
    let telemetry = Telemetry::new(2 * cfg.sync_period, Some(&cfg.bpffs_root), (cfg.lb_map_max.into(), cfg.ct_map_max.into()));
    http::spawn("metrics", "--metrics-bind-address", cfg.metrics_bind, http::metrics_router(telemetry.clone(), "ebpf"));
    http::spawn("healthz", "--healthz-bind-address", cfg.healthz_bind, http::health_router(telemetry.clone()));
    spawn_conntrack_gauge(cfg.bpffs_root.clone(), telemetry.clone());

    let mut store = Store::new(cfg.hostname.clone());
    store.set_nodeport_config(cfg.nodeport_addresses.clone());
    let mut rec = Reconciler::new(store, dp, vec![Kind::Service, Kind::EndpointSlice, Kind::Node]);
    let mut health = HealthServers::new(telemetry.clone());

    let (link_tx, mut link_rx) = mpsc::channel(256);
    let (links, addrs) = netlink::watch(link_tx).await.context("watching network interfaces over rtnetlink")?;
    let live: BTreeMap<u32, String> = links.iter().cloned().collect();
    Attachments::prune_pins(&cfg.bpffs_root, &live);
    let mut devices = Devices::new(patterns, external, cfg.xdp);
    for (index, name) in links {
        devices.apply(&netlink::LinkChange::Present { index, name });
    }
    for a in &addrs {
        devices.apply(a);
    }
    rec.store.set_local_addresses(devices.node_addresses());
    devices.sync(rec.dataplane_mut());
    if !rec.dataplane().attached().values().any(|n| devices.role(0, n) == Some(crate::dataplane::ebpf::attach::Role::Pod)) {
        tracing::warn!(
            patterns = ?cfg.pod_devices,
            "no interface matches --pod-devices yet; attaching as matching interfaces appear"
        );
    }
    serve_host_sockets(&cfg, rec.dataplane_mut());
    if rec.dataplane().external_interfaces().is_empty() {
        tracing::warn!(
            devices = ?cfg.devices,
            "no external interface (--devices, or one with a global IPv4 address); NodePort and load-balancer \
             traffic from outside is not served until one appears"
        );
    }

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut retry = tokio::time::interval(Duration::from_secs(2));
    // A retry comes 2 s after the last one, never as a burst of ticks missed meanwhile.
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut attach_retry = tokio::time::interval(Duration::from_secs(5));
    let mut node_watch = NodeWatch::default();
    loop {
        tokio::select! {
            Some(ev) = src_rx.recv() => {
                rec.handle(ev);
                // Coalesce a burst: take what is already queued, then program once.
                while let Ok(ev) = src_rx.try_recv() {
                    rec.handle(ev);
                }
                node_watch.observe(&rec.store, rec.ready(), &telemetry, &cfg.hostname);
                if rec.store.has_dirty() {
                    telemetry.queued();
                }
                sync(&mut rec, &telemetry, &mut health);
            }
            Some(change) = link_rx.recv() => {
                let mut addresses_changed = devices.apply(&change);
                while let Ok(change) = link_rx.try_recv() {
                    addresses_changed |= devices.apply(&change);
                }
                devices.sync(rec.dataplane_mut());
                if addresses_changed {
                    rec.store.set_local_addresses(devices.node_addresses());
                    if rec.store.has_dirty() {
                        telemetry.queued();
                        sync(&mut rec, &telemetry, &mut health);
                    }
                }
            }
            _ = retry.tick(), if rec.has_failures() => sync(&mut rec, &telemetry, &mut health),
            _ = attach_retry.tick(), if !devices.failed.is_empty() => devices.sync(rec.dataplane_mut()),
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
    }
    tracing::info!(
        bpffs_root = %cfg.bpffs_root.display(),
        "stopping; programs, maps and links stay pinned and keep serving (`proxy-agent cleanup` removes them)"
    );
    Ok(())
}

/// Follows this node's Node object for `/healthz`, in every mode: eligible while it exists
/// and is not being deleted; a Node that was there and is gone is being deleted.
#[derive(Default)]
struct NodeWatch {
    seen: bool,
    warned: bool,
}

impl NodeWatch {
    fn observe(&mut self, store: &Store, ready: bool, telemetry: &Telemetry, hostname: &str) {
        match store.node() {
            Some(n) => {
                self.seen = true;
                telemetry.set_node_eligible(!n.deleting);
            }
            None if self.seen => telemetry.set_node_eligible(false),
            None => {}
        }
        if ready && store.node().is_none() && !self.warned {
            self.warned = true;
            tracing::warn!(
                node = hostname,
                "no Node object of this name: topology hints and node-local endpoints need it; check --hostname-override"
            );
        }
    }
}

fn sync(rec: &mut Reconciler<EbpfDataplane>, telemetry: &Telemetry, health: &mut HealthServers) {
    if let Some(s) = rec.sync() {
        health.update(&rec.health_checks());
        log_sync(&s);
        telemetry.synced(&s, &rec.store.change_counts());
        if !rec.has_failures() {
            telemetry.updated();
        }
        telemetry.fill.services.store(rec.dataplane().service_entries() as u64, Ordering::Relaxed);
        telemetry.fill.backends.store(rec.dataplane().backend_count() as u64, Ordering::Relaxed);
    } else {
        telemetry.record_changes(&rec.store.change_counts());
    }
}
