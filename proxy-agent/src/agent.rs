//! `proxy-agent run`: choose the mode, load or adopt its dataplane, and keep it in step with
//! the source (API server or manifest directory) until SIGTERM. One control loop serves every
//! mode: the eBPF dataplane's reconciler and the netfilter modes' proxier both implement
//! `Proxier`, as kube-proxy's proxiers implement its `Provider`. In eBPF mode the programs,
//! maps and links stay pinned on exit, so traffic keeps flowing until the next run adopts them;
//! the netfilter modes' rules stay in the kernel likewise.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use std::os::fd::AsFd as _;

use anyhow::Context as _;
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::mpsc,
    time::Instant,
};

use crate::{
    config::{Config, Source, SyncPeriods},
    dataplane::{
        ebpf::{
            attach::{Attachments, DevicePatterns, Role, XdpSetting},
            batch, ct_filter, ct_gc,
            loader::{self, LoadOptions},
            reconcile::Reconciler,
            EbpfDataplane,
        },
        netfilter::{
            proxier::{Masquerading, NetfilterProxier},
            Iptables,
        },
        Dataplane as _, ProxyMode,
    },
    devices::Devices,
    healthcheck::HealthServers,
    http,
    model::store::{Event, Kind, Store},
    netlink,
    source::{self, manifests::ManifestDir},
    sync::{PortState, SyncStats},
    telemetry::Telemetry,
};

/// How often the control loop does its housekeeping (`Proxier::housekeeping`).
pub const HOUSEKEEPING: Duration = Duration::from_secs(5);

/// What the control loop drives: one mode's way of programming the kernel.
pub(crate) trait Proxier {
    fn store(&self) -> &Store;
    fn store_mut(&mut self) -> &mut Store;
    /// Feeds one source event to the store.
    fn handle(&mut self, event: Event) {
        self.store_mut().apply_logged(event);
    }
    /// Every source has listed everything (nothing is written before).
    fn ready(&self) -> bool;
    fn has_failures(&self) -> bool;
    /// Applies pending changes. None when not ready or nothing was done.
    fn sync(&mut self) -> Option<SyncStats>;
    /// Health-check node ports and what each reports.
    fn health_checks(&self) -> BTreeMap<u16, PortState>;
    /// After a sync: what the mode reports besides (map fill).
    fn report(&self, _telemetry: &Telemetry) {}
    /// Interfaces came, went or were renamed.
    fn interfaces_changed(&mut self, _devices: &mut Devices) {}
    /// Every few seconds.
    async fn housekeeping(&mut self, _devices: &mut Devices) {}
    /// The next sync rewrites everything (periodic full resync).
    fn resync_all(&mut self) {}
    /// The last sync left work for the next (a long write cut into steps, `RuleSet::pending`).
    fn pending(&self) -> bool {
        false
    }
    /// Services are missing from the kernel until the pending steps are written (a large
    /// table built from nothing, `RuleSet::building`): the changes queued are not programmed.
    fn building(&self) -> bool {
        false
    }
}

impl Proxier for Reconciler<EbpfDataplane> {
    fn store(&self) -> &Store {
        &self.store
    }
    fn store_mut(&mut self) -> &mut Store {
        &mut self.store
    }
    fn ready(&self) -> bool {
        Reconciler::ready(self)
    }
    fn has_failures(&self) -> bool {
        Reconciler::has_failures(self)
    }
    fn sync(&mut self) -> Option<SyncStats> {
        Reconciler::sync(self)
    }
    fn health_checks(&self) -> BTreeMap<u16, PortState> {
        Reconciler::health_checks(self)
    }
    fn report(&self, telemetry: &Telemetry) {
        let ((services, services6), (backends, backends6)) = self.dataplane().entries_by_family();
        let fill = &telemetry.fill;
        fill.services_refused.store(self.refused() as u64, Ordering::Relaxed);
        for (gauge, n) in
            [(&fill.services, services), (&fill.services6, services6), (&fill.backends, backends), (&fill.backends6, backends6)]
        {
            gauge.store(n as u64, Ordering::Relaxed);
        }
    }
    fn interfaces_changed(&mut self, devices: &mut Devices) {
        devices.sync(self.dataplane_mut());
    }
    async fn housekeeping(&mut self, devices: &mut Devices) {
        self.dataplane_mut().trail_adoption();
        if devices.retry_due() {
            devices.sync(self.dataplane_mut());
        }
        // A veth's xdp_features follow its peer, which changes without a netlink event here.
        match crate::dataplane::ebpf::xdpdevs::read().await {
            Ok(devs) => devices.sync_xdp(self.dataplane_mut(), &devs),
            Err(e) => tracing::debug!("listing interfaces for XDP: {e}"),
        }
    }
}

impl Proxier for NetfilterProxier {
    fn store(&self) -> &Store {
        &self.store
    }
    fn store_mut(&mut self) -> &mut Store {
        &mut self.store
    }
    fn ready(&self) -> bool {
        NetfilterProxier::ready(self)
    }
    fn has_failures(&self) -> bool {
        NetfilterProxier::has_failures(self)
    }
    fn sync(&mut self) -> Option<SyncStats> {
        NetfilterProxier::sync(self)
    }
    fn health_checks(&self) -> BTreeMap<u16, PortState> {
        NetfilterProxier::health_checks(self)
    }
    fn resync_all(&mut self) {
        NetfilterProxier::resync_all(self);
    }
    fn pending(&self) -> bool {
        NetfilterProxier::pending(self)
    }
    fn building(&self) -> bool {
        NetfilterProxier::building(self)
    }
    fn report(&self, telemetry: &Telemetry) {
        // (Auto mode may have left nftables for iptables: `NetfilterProxier::set_fallback`.)
        telemetry.set_mode(self.mode().as_str());
    }
}

/// Logs a sync. The initial one is "done" once everything is written: when it is the first
/// step of a table built in steps (`Proxier::building`), at the step that ends the build
/// (`initial_steps` holds the first step's figures until then).
fn log_sync(s: &SyncStats, building: bool, initial_steps: &mut Option<SyncStats>) {
    if s.initial && building {
        tracing::info!(
            services = s.services,
            millis = s.duration.as_secs_f64() * 1e3,
            "initial sync: the table is written in steps, one per sync"
        );
        *initial_steps = Some(SyncStats { trigger_times: Vec::new(), ..*s });
        return;
    }
    let first = if building { None } else { initial_steps.take() };
    if let Some(first) = first {
        tracing::info!(
            services = first.services,
            programmed = first.upserted,
            unchanged = first.unchanged,
            removed = first.removed,
            failed = s.failed,
            "initial sync done (in steps)"
        );
    } else if s.initial {
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

/// Every 15 s, removes each family's expired flows (`ct_gc`, by the lifetimes the programs
/// were loaded with) and rebuilds its conntrack filter from its conntrack map (see
/// `ct_filter::rebuild`), which counts the entries for the map gauges on the way. Started once
/// this run's programs are attached: at an upgrade, the filter was created with every bit set
/// because the older programs did not set theirs, and they must be gone before a rebuild (and
/// before flows are removed by this run's lifetimes, which theirs may not be).
fn spawn_conntrack_upkeep(root: PathBuf, lifetimes: proxy_common::ct::Lifetimes, t: Arc<Telemetry>) {
    tokio::spawn(async move {
        // Said when it first holds the rebuilds back, and again when that changes.
        let mut held_back: Option<String> = None;
        // The same for a removal of expired flows that fails.
        let mut removal_failed: Option<String> = None;
        loop {
            let r = root.clone();
            let round = match tokio::task::spawn_blocking(move || conntrack_round(&r, &lifetimes)).await {
                Ok(r) => r,
                Err(e) => Err(std::io::Error::other(format!("the task failed: {e}"))),
            };
            match round {
                Ok(ConntrackRound::Rebuilt([v4, v6], removed)) => {
                    if held_back.take().is_some() {
                        tracing::info!("rebuilding the conntrack filters again");
                    }
                    let f = &t.fill;
                    let ([r4, r6], error) = removed;
                    f.conntrack_removed.fetch_add(r4.flows, Ordering::Relaxed);
                    f.conntrack_removed6.fetch_add(r6.flows, Ordering::Relaxed);
                    f.conntrack_orphans.fetch_add(r4.orphans, Ordering::Relaxed);
                    f.conntrack_orphans6.fetch_add(r6.orphans, Ordering::Relaxed);
                    if r4 != Default::default() || r6 != Default::default() {
                        tracing::debug!(ipv4 = ?r4, ipv6 = ?r6, "expired flows removed from the conntrack maps");
                    }
                    if error.is_some() && removal_failed != error {
                        tracing::warn!(
                            error = error.as_deref().unwrap_or_default(),
                            "removing expired flows from the conntrack maps; tried again each round"
                        );
                    }
                    removal_failed = error;
                    f.conntrack.store(v4.keys, Ordering::Relaxed);
                    f.conntrack6.store(v6.keys, Ordering::Relaxed);
                    f.conntrack_filter.store(v4.bits, Ordering::Relaxed);
                    f.conntrack_filter6.store(v6.bits, Ordering::Relaxed);
                }
                Ok(ConntrackRound::Counted([v4, v6], why)) => {
                    t.fill.conntrack.store(v4, Ordering::Relaxed);
                    t.fill.conntrack6.store(v6, Ordering::Relaxed);
                    if held_back.as_ref() != Some(&why) {
                        tracing::warn!("not rebuilding the conntrack filters (every bit of them set, which costs only lookups): {why}");
                        held_back = Some(why);
                    }
                }
                Err(e) => {
                    let why = format!("error: {e}");
                    if held_back.as_ref() != Some(&why) {
                        tracing::warn!(error = %e, "rebuilding the conntrack filters; they keep every bit they have");
                        held_back = Some(why);
                    }
                }
            }
            tokio::time::sleep(Duration::from_secs(15)).await;
        }
    });
}

/// What one round of `spawn_conntrack_upkeep` did.
enum ConntrackRound {
    /// Each family's expired flows removed (and why not all, if an error stopped a removal),
    /// then its filter rebuilt (IPv4, IPv6).
    Rebuilt([ct_filter::Rebuilt; 2], ([ct_gc::Collected; 2], Option<String>)),
    /// The entries counted only, and why.
    Counted([u64; 2], String),
}

/// Removes both families' expired flows and rebuilds their conntrack filters through the pins
/// under `root`, unless a link of an older build that sets no bits is attached
/// (`ct_filter::stale_links`: the filters are then filled with every bit, in case it tracked
/// flows since the last rebuild, and no flow is removed) or another agent is at it.
fn conntrack_round(root: &Path, lifetimes: &proxy_common::ct::Lifetimes) -> std::io::Result<ConntrackRound> {
    use proxy_common::{map_names, CtEntry, CtKey, Ip6};
    let open = |name: &str| aya::maps::MapData::from_pin(loader::maps_dir(root).join(name)).map_err(std::io::Error::other);
    let (ct4, ct6) = (open(map_names::CT)?, open(map_names::CT6)?);
    let (ct4, ct6) = (ct4.fd().as_fd(), ct6.fd().as_fd());
    let (f4, f6) = (open(map_names::CT_FILTER)?, open(map_names::CT_FILTER6)?);
    let count = || -> std::io::Result<[u64; 2]> {
        Ok([
            batch::count_entries(ct4, size_of::<CtKey>(), size_of::<CtEntry>())?,
            batch::count_entries(ct6, size_of::<CtKey<Ip6>>(), size_of::<CtEntry<Ip6>>())?,
        ])
    };
    let Some(_lock) = ct_filter::RebuildLock::try_take(root)? else {
        return Ok(ConntrackRound::Counted(count()?, "another agent on this node is rebuilding them".into()));
    };
    let stale = ct_filter::stale_links(root)?;
    if !stale.is_empty() {
        ct_filter::fill(f4.fd().as_fd(), true)?;
        ct_filter::fill(f6.fd().as_fd(), true)?;
        let pins: Vec<String> = stale.iter().map(|p| p.display().to_string()).collect();
        let why = format!(
            "links of an older build, which track flows without the filter, stay attached ({}); this run does not serve \
             those hooks: remove the pins to detach them",
            pins.join(", ")
        );
        return Ok(ConntrackRound::Counted(count()?, why));
    }
    // A removal that fails (a map that cannot be opened or read) does not hold the rebuild
    // back: it is said, and tried again next round.
    let (rn4, rn6) = (open(map_names::REVNAT), open(map_names::REVNAT6));
    fn fd(m: &std::io::Result<aya::maps::MapData>) -> std::io::Result<std::os::fd::BorrowedFd<'_>> {
        match m {
            Ok(m) => Ok(m.fd().as_fd()),
            Err(e) => Err(std::io::Error::new(e.kind(), format!("opening a reverse NAT map: {e}"))),
        }
    }
    let revnats = [fd(&rn4), fd(&rn6)];
    let (removed, errors) = ct_gc::collect_families([ct4, ct6], revnats, lifetimes, ct_gc::monotonic_coarse_ns());
    let errors = (!errors.is_empty()).then(|| errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "));
    let removed = (removed, errors);
    Ok(ConntrackRound::Rebuilt(ct_filter::rebuild_families([f4.fd().as_fd(), f6.fd().as_fd()], [ct4, ct6])?, removed))
}

/// The source of Services and endpoints, started; the returned guard keeps a directory
/// watcher alive.
async fn start_source(
    cfg: &Config,
    telemetry: &Arc<Telemetry>,
) -> anyhow::Result<(mpsc::Receiver<Event>, Option<notify::RecommendedWatcher>)> {
    let (src_tx, src_rx) = mpsc::channel(256);
    let mut watcher = None;
    match &cfg.common.source {
        Source::Manifests(dir) => {
            let dir = ManifestDir::new(dir).map_err(anyhow::Error::msg)?;
            watcher = Some(
                source::manifests::spawn(dir, src_tx, cfg.common.resync).with_context(|| format!("watching {:?}", cfg.common.source))?,
            );
        }
        Source::Kube(api) => {
            let client = source::kube::client(api, telemetry.clone()).await?;
            source::kube::spawn(client, &cfg.common.hostname, src_tx);
        }
    }
    Ok((src_rx, watcher))
}

fn load_ebpf(cfg: &Config) -> Result<EbpfDataplane, crate::dataplane::ebpf::EbpfError> {
    EbpfDataplane::load(LoadOptions {
        pin_root: Some(cfg.common.bpffs_root.clone()),
        lb_map_max: cfg.ebpf.lb_map_max,
        ct_map_max: cfg.ebpf.ct_map_max,
        maglev_size: cfg.ebpf.maglev_size,
        snat_ports: cfg.ebpf.snat_ports,
        ct_lifetimes: cfg.ct_lifetimes(),
        ipv6: !ipv6_ranges(cfg).is_empty(),
    })
}

/// The cluster's IPv6 ranges the configuration names (`--cluster-cidr`,
/// `--service-cluster-ip-range`): a dual-stack or IPv6-only cluster.
fn ipv6_ranges(cfg: &Config) -> Vec<String> {
    cfg.common
        .cluster_cidrs
        .iter()
        .chain(&cfg.common.service_cidrs)
        .filter(|c| c.family() == crate::model::Family::V6)
        .map(|c| c.to_string())
        .collect()
}

/// `--proxy-mode auto`: ebpf when this kernel and these privileges run our programs, else
/// nftables, else iptables. Says why. An eBPF dataplane an earlier run left attached is not
/// given up for another mode: switching would remove its pins and reset every connection it
/// carries, so the start fails instead and the attached programs go on serving what they last
/// had (as Cilium's datapath outlives a failing agent). An explicit `--proxy-mode` switches.
fn choose_mode(cfg: &Config) -> anyhow::Result<(ProxyMode, Option<EbpfDataplane>)> {
    let root = &cfg.common.bpffs_root;
    let links = crate::dataplane::ebpf::loader::pinned_links(root);
    let why = match crate::dataplane::modes::ebpf_unsupported() {
        None => match load_ebpf(cfg) {
            Ok(dp) => {
                tracing::info!(mode = "ebpf", "proxy mode auto: the kernel runs the eBPF dataplane");
                return Ok((ProxyMode::Ebpf, Some(dp)));
            }
            Err(e) => format!("the eBPF dataplane cannot load ({e})"),
        },
        Some(why) => format!("not using eBPF: {why}"),
    };
    if links > 0 {
        anyhow::bail!(
            "proxy mode auto: {why}; an earlier run's eBPF dataplane is still attached ({links} pinned links under {}) and keeps \
             serving what it last programmed. Falling back to another mode would detach it and reset every connection it carries, \
             so this start stops here: fix the cause above, or switch modes on purpose with --proxy-mode (or `proxy-agent \
             cleanup`), which resets those connections",
            crate::dataplane::ebpf::loader::links_dir(root).display()
        );
    }
    tracing::warn!("proxy mode auto: {why}; falling back");
    Ok(match crate::dataplane::modes::nftables_unsupported() {
        None => {
            tracing::info!(mode = "nftables", "proxy mode auto: nf_tables and nft are available");
            (ProxyMode::Nftables, None)
        }
        Some(why) => {
            tracing::warn!(mode = "iptables", "proxy mode auto: not using nftables: {why}; using iptables");
            (ProxyMode::Iptables, None)
        }
    })
}

/// kube-proxy's `oomScoreAdj`: lowering it needs CAP_SYS_RESOURCE, which a DaemonSet's agent
/// need not have (kubelet gives node-critical pods a low score anyway).
fn set_oom_score_adj(value: Option<i32>) {
    let Some(v) = value else { return };
    let current = std::fs::read_to_string("/proc/self/oom_score_adj").ok().and_then(|s| s.trim().parse::<i32>().ok());
    if current == Some(v) {
        return;
    }
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", v.to_string()) {
        tracing::info!(
            current = ?current,
            "oomScoreAdj {v} not set ({e}): lowering it needs CAP_SYS_RESOURCE; kubelet gives system-node-critical pods a low score"
        );
    }
}

/// The iptables backend of `mode`, for the modes that write iptables rules.
fn iptables_backend(cfg: &Config, mode: ProxyMode, backends: &[Iptables]) -> Option<Iptables> {
    matches!(mode, ProxyMode::Iptables | ProxyMode::Ipvs).then(|| match cfg.netfilter.iptables_backend {
        Some(b) => {
            tracing::info!(backend = %b, "iptables backend as configured (--iptables-backend)");
            b
        }
        None => {
            let (b, why) = Iptables::detect(backends);
            tracing::info!(backend = %b, "iptables backend auto: {why}");
            b
        }
    })
}

/// Lifts the soft limit on open files to the hard one: every pod may open connections to the
/// node's health port, and running out of descriptors must not stop the agent.
fn raise_fd_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

pub async fn run(cfg: Config) -> anyhow::Result<()> {
    raise_fd_limit();
    let (mode, loaded) = match cfg.common.proxy_mode {
        Some(m) => {
            tracing::info!(mode = %m, "proxy mode as configured");
            (m, None)
        }
        None => choose_mode(&cfg)?,
    };
    let unused = cfg.unused_in(mode);
    if !unused.is_empty() {
        tracing::warn!("configuration fields not used in mode {mode}: {} (kube-proxy's other modes use them)", unused.join(", "));
    }
    set_oom_score_adj(cfg.common.oom_score_adj);
    let backends = Iptables::available();
    let ipt = iptables_backend(&cfg, mode, &backends);
    let root = cfg.common.bpffs_root.clone();
    let held = backends.clone();
    let cleanup = move || crate::dataplane::modes::cleanup_other_modes(mode, ipt, &backends, &root);
    match mode {
        ProxyMode::Ebpf => {
            let dp = match loaded {
                Some(dp) => dp,
                None => load_ebpf(&cfg)?,
            };
            // Over kube-proxy's rules, the connections they translated are adopted as their
            // Services are first written (`run_ebpf`), so that none is reset by the takeover.
            let leftovers = crate::dataplane::netfilter::takeover::translating_leftovers(&held);
            // What kube-proxy or a netfilter mode left goes once the eBPF maps are whole: until
            // then, new connections to a Service are still served by those rules (our programs
            // pass what their empty maps do not know). Both can be there at once: the programs
            // translate before netfilter, so its rules no longer match what they translated.
            tracing::info!("what kube-proxy or another mode left is removed after the first whole write");
            // On a thread of its own: on a large node the saves and restores of every backend
            // and family take a while, and nothing of the eBPF mode waits for them.
            let after = move || {
                let spawned = std::thread::Builder::new().name("takeover-cleanup".into()).spawn(move || {
                    let left = || crate::dataplane::netfilter::takeover::translating_leftovers(&held);
                    remove_until_clean(cleanup, left, std::thread::sleep);
                });
                if let Err(e) = spawned {
                    tracing::warn!("what kube-proxy or another mode left stays: no thread to remove it ({e})");
                }
            };
            run_ebpf(cfg, dp, leftovers, Some(Box::new(after))).await
        }
        other => {
            // Before the first write: IPVS and iptables modes write chains of the same names.
            cleanup();
            run_netfilter(cfg, other, ipt.unwrap_or_default()).await
        }
    }
}

/// The first wait before the takeover's removal is tried again, doubled up to
/// `TAKEOVER_RETRY_MAX`.
const TAKEOVER_RETRY: Duration = Duration::from_secs(10);
const TAKEOVER_RETRY_MAX: Duration = Duration::from_secs(300);

/// Runs `cleanup` (the eBPF mode's removal of what kube-proxy or another mode left) until
/// `left` finds nothing in netfilter that still translates Services, waiting between tries.
/// A try can fail for a while (the xtables lock held past its wait by another agent's long
/// restore, a kube-proxy still terminating and writing), and rules left behind would go on
/// sending packets our maps do not hold to the endpoints those rules last knew. Returns the
/// number of tries.
fn remove_until_clean(cleanup: impl Fn(), left: impl Fn() -> Vec<String>, sleep: impl Fn(Duration)) -> u32 {
    let (mut tries, mut wait) = (0, TAKEOVER_RETRY);
    loop {
        cleanup();
        tries += 1;
        let still = left();
        if still.is_empty() {
            tracing::info!("first whole write done: what kube-proxy or another mode left is removed");
            return tries;
        }
        tracing::warn!(
            "what kube-proxy or another mode left still translates Services ({}); removal tried {tries} times, again in {} s",
            still.join("; "),
            wait.as_secs()
        );
        sleep(wait);
        wait = (wait * 2).min(TAKEOVER_RETRY_MAX);
    }
}

/// What every mode's loop is fed from: the source, the interfaces and their addresses.
struct Inputs {
    src_rx: mpsc::Receiver<Event>,
    /// Keeps a manifest directory's watcher alive.
    _watcher: Option<notify::RecommendedWatcher>,
    link_rx: mpsc::Receiver<netlink::LinkChange>,
    devices: Devices,
}

/// Starts the source and the interface watch, and brings `devices` to what exists now.
async fn start_inputs(cfg: &Config, telemetry: &Arc<Telemetry>, mut devices: Devices) -> anyhow::Result<(Inputs, BTreeMap<u32, String>)> {
    let (src_rx, watcher) = start_source(cfg, telemetry).await?;
    let (link_tx, link_rx) = mpsc::channel(256);
    let (links, addrs) = netlink::watch(link_tx).await.context("watching network interfaces over rtnetlink")?;
    let live: BTreeMap<u32, String> = links.iter().cloned().collect();
    for (index, name) in links {
        devices.apply(&netlink::LinkChange::Present { index, name });
    }
    for a in &addrs {
        devices.apply(a);
    }
    Ok((Inputs { src_rx, _watcher: watcher, link_rx, devices }, live))
}

fn telemetry_and_servers(
    cfg: &Config,
    health_timeout: Duration,
    mode: ProxyMode,
    pins: Option<&Path>,
    capacities: crate::telemetry::MapCapacities,
) -> Arc<Telemetry> {
    let telemetry = Telemetry::new(health_timeout, pins, capacities);
    telemetry.set_mode(mode.as_str());
    http::spawn("metrics", "--metrics-bind-address", cfg.common.metrics_bind, http::metrics_router(telemetry.clone()));
    http::spawn("healthz", "--healthz-bind-address", cfg.common.healthz_bind, http::health_router(telemetry.clone()));
    telemetry
}

fn new_store(cfg: &Config) -> Store {
    let mut store = Store::new(cfg.common.hostname.clone());
    store.set_rules(crate::model::validate::Rules { node_port_range: cfg.common.node_port_range });
    store.set_nodeport_config(cfg.common.nodeport_addresses.clone());
    if cfg.common.node_ip.is_some() {
        store.set_node_ip_override(cfg.common.node_ip);
    }
    store.set_service_cidr_flag(cfg.common.service_cidrs.clone());
    store
}

/// kube-proxy's packet counters, where the kernel has nfacct (iptables mode); else rules
/// without them.
fn nfacct_counters(mode: ProxyMode) -> bool {
    mode == ProxyMode::Iptables
        && crate::dataplane::netfilter::nfacct::ensure_all()
            .map_err(|e| tracing::info!("{e}: the iptables rules count no packets (as kube-proxy does without nfacct)"))
            .is_ok()
}

fn masquerading(cfg: &Config, mode: ProxyMode) -> Masquerading {
    Masquerading {
        masquerade_all: cfg.netfilter.for_mode(mode).masquerade_all,
        detect_local: Some(cfg.netfilter.detect_local.clone()),
        cluster_cidrs: cfg.common.cluster_cidrs.clone(),
    }
}

/// Auto mode's way out of the nftables mode where nft finds tables it cannot read (a newer
/// nft's sets, which the node's other tools may write at any time): the iptables mode, as
/// auto mode would choose at a start there (`nftables_unsupported`).
fn iptables_fallback(cfg: Config, telemetry: Arc<Telemetry>) -> crate::dataplane::netfilter::proxier::MakeFallback {
    Box::new(move || {
        let mode = ProxyMode::Iptables;
        let backends = Iptables::available();
        let iptables = iptables_backend(&cfg, mode, &backends).unwrap_or_default();
        let nfacct = nfacct_counters(mode);
        let rules = crate::dataplane::modes::rules_for(mode, &cfg, iptables, nfacct)?;
        if nfacct {
            telemetry.count_nfacct();
        }
        Ok(crate::dataplane::netfilter::proxier::Fallback {
            rules,
            masquerading: masquerading(&cfg, mode),
            settings: crate::dataplane::netfilter::sysctl::settings(mode, &cfg),
            retire: crate::dataplane::netfilter::nftables::remove_tables,
        })
    })
}

async fn run_netfilter(cfg: Config, mode: ProxyMode, iptables: Iptables) -> anyhow::Result<()> {
    let nfacct = nfacct_counters(mode);
    let rules = crate::dataplane::modes::rules_for(mode, &cfg, iptables, nfacct).map_err(anyhow::Error::msg)?;
    let settings = cfg.netfilter.for_mode(mode);
    let telemetry = telemetry_and_servers(&cfg, 2 * settings.sync.sync, mode, None, Default::default());
    if nfacct {
        telemetry.count_nfacct();
    }
    let sysctls = crate::dataplane::netfilter::sysctl::settings(mode, &cfg);
    let mut proxier = NetfilterProxier::new(
        new_store(&cfg),
        rules,
        vec![Kind::Service, Kind::EndpointSlice, Kind::Node],
        masquerading(&cfg, mode),
        sysctls,
    );
    if mode == ProxyMode::Nftables && cfg.common.proxy_mode.is_none() {
        proxier.set_fallback(iptables_fallback(cfg.clone(), telemetry.clone()));
    }
    // Node addresses only, for NodePorts: nothing is attached.
    let no_patterns = DevicePatterns::parse(&[]).expect("empty pattern list");
    let devices = Devices::new(no_patterns.clone(), Some(no_patterns), XdpSetting::Disabled);
    let (mut inputs, _) = start_inputs(&cfg, &telemetry, devices).await?;
    proxier.store.set_local_addresses(inputs.devices.node_addresses());
    tracing::info!(mode = %mode, node = cfg.common.hostname, "programming Services with the kernel's netfilter");
    let health = HealthServers::new(telemetry.clone());
    let hostname = cfg.common.hostname.clone();
    control_loop(&mut proxier, &mut inputs, &telemetry, health, settings.sync, &hostname, None).await?;
    tracing::info!(mode = %proxier.mode(), "stopping; the rules stay in place (`proxy-agent cleanup` removes them)");
    Ok(())
}

/// Attaches the socket hooks that serve Services to host-network processes (`--cgroup-root`).
/// A failure is reported and the agent goes on: pods and outside clients are served all the
/// same.
fn serve_host_sockets(cfg: &Config, dp: &mut EbpfDataplane) {
    use crate::dataplane::ebpf::hostsock;
    let Some(root) = &cfg.ebpf.cgroup_root else {
        let removed = dp.stop_serving_host_sockets();
        tracing::info!(
            removed_hooks = removed,
            "--cgroup-root none: no socket hooks; host-network processes reach Services only where TC meets their packets (the node's route for the Service address leaving by an attached interface)"
        );
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
                let dir = Path::new(hostsock::CGROUP2_DIR);
                match hostsock::mount_cgroup2(dir) {
                    Ok(()) => {
                        tracing::info!(cgroup = %dir.display(), "no cgroup v2 hierarchy was mounted (a cgroup v1 host): mounted one for the socket hooks");
                        dir.to_path_buf()
                    }
                    Err(e) => {
                        tracing::warn!(
                            "no cgroup v2 hierarchy is mounted and mounting one at {} failed ({e}): host-network processes \
                             do not reach Services. Mount one on the host (`mount -t cgroup2 none {}`, as \
                             deploy/daemonset.yaml's init container does) and pass it as --cgroup-root",
                            dir.display(),
                            dir.display()
                        );
                        return;
                    }
                }
            }
        },
    };
    if let Err(e) = dp.serve_host_sockets(&cgroup) {
        tracing::warn!("{e}; host-network processes are served only by hooks a previous run left attached, if any");
    }
}

/// `leftovers`: what of kube-proxy's (or a netfilter mode's) rules that translate Services
/// netfilter holds at start; where there is any, the connections they translated are adopted.
async fn run_ebpf(cfg: Config, dp: EbpfDataplane, leftovers: Vec<String>, after_first_write: AfterFirstWrite) -> anyhow::Result<()> {
    let patterns = DevicePatterns::parse(&cfg.ebpf.pod_devices).map_err(anyhow::Error::msg)?;
    let external = if cfg.ebpf.devices.is_empty() {
        None
    } else {
        Some(DevicePatterns::parse(&cfg.ebpf.devices).map_err(|e| anyhow::anyhow!("--devices: {e}"))?)
    };
    let root = &cfg.common.bpffs_root;
    tracing::info!(bpffs_root = %root.display(), node = cfg.common.hostname, adopted_frontends = dp.programmed_keys().len(), "dataplane loaded");
    let telemetry = telemetry_and_servers(&cfg, 2 * cfg.common.sync_period, ProxyMode::Ebpf, Some(root), dp.capacities());
    let mut store = new_store(&cfg);
    // NodePorts on 127.0.0.1 for the node's processes, through the socket hooks (no
    // route_localnet: nothing from outside can reach them); kube-proxy's rule for which
    // NodePort addresses allow it.
    store.set_localhost_nodeports(crate::dataplane::netfilter::sysctl::localhost_nodeports(&cfg));
    let mut rec = Reconciler::new(store, dp, vec![Kind::Service, Kind::EndpointSlice, Kind::Node]);
    let (mut inputs, live) = start_inputs(&cfg, &telemetry, Devices::new(patterns, external, cfg.ebpf.xdp)).await?;
    Attachments::prune_pins(root, &live);
    rec.store.set_local_addresses(inputs.devices.node_addresses());
    if !leftovers.is_empty() {
        match rec.dataplane_mut().adopt_translated(&inputs.devices.node_addresses()) {
            Ok(()) => tracing::info!(
                found = leftovers.join(", "),
                "rules that translate Services are in netfilter: the connections they translated are adopted as their Services \
                 are first written"
            ),
            Err(e) => tracing::warn!(error = %e, "the connections netfilter translated cannot be adopted: each is balanced afresh"),
        }
    }
    inputs.devices.sync(rec.dataplane_mut());
    if !rec.dataplane().attached().values().any(|n| inputs.devices.role(0, n) == Some(Role::Pod)) {
        tracing::warn!(patterns = ?cfg.ebpf.pod_devices, "no interface matches --pod-devices yet; attaching as matching interfaces appear");
    }
    serve_host_sockets(&cfg, rec.dataplane_mut());
    spawn_conntrack_upkeep(root.clone(), cfg.ct_lifetimes(), telemetry.clone());
    if rec.dataplane().external_interfaces().is_empty() {
        tracing::warn!(
            devices = ?cfg.ebpf.devices,
            "no external interface (--devices, or one with a global IPv4 address); NodePort and load-balancer \
             traffic from outside is not served until one appears"
        );
    }
    let health = HealthServers::new(telemetry.clone());
    // The eBPF dataplane programs every change at once: a change costs microseconds.
    let periods = SyncPeriods { sync: cfg.common.sync_period, min: Duration::ZERO };
    control_loop(&mut rec, &mut inputs, &telemetry, health, periods, &cfg.common.hostname, after_first_write).await?;
    if rec.dataplane().pins_outlive_agent() {
        tracing::info!(
            bpffs_root = %root.display(),
            "stopping; programs, maps and links stay pinned and keep serving (`proxy-agent cleanup` removes them)"
        );
    } else {
        tracing::warn!(
            bpffs_root = %root.display(),
            "stopping; the pins are on a BPF filesystem private to this process's mount namespace and go with it: \
             Services stop being served"
        );
    }
    Ok(())
}

const RETRY_FIRST: Duration = Duration::from_secs(2);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// Everything is written again at least this often (kube-proxy's nftables mode does a full
/// sync hourly; between them only what changed is written).
const FULL_RESYNC: Duration = Duration::from_secs(3600);

/// The one control loop: source events and interface changes in, syncs out, no closer
/// together than `periods.min` (but a sync that left work, `Proxier::pending`, is followed at
/// once, with the events that came meanwhile), and a full resync every
/// `max(periods.sync, FULL_RESYNC)`.
async fn control_loop<P: Proxier>(
    p: &mut P,
    inputs: &mut Inputs,
    telemetry: &Telemetry,
    mut health: HealthServers,
    periods: SyncPeriods,
    hostname: &str,
    mut after_first_write: AfterFirstWrite,
) -> anyhow::Result<()> {
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    // Failed work is retried 2 s later, then ever later up to a minute while it keeps failing.
    let mut backoff = RETRY_FIRST;
    let mut retry_at = Instant::now() + backoff;
    let mut housekeeping = tokio::time::interval(HOUSEKEEPING);
    housekeeping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let full = periods.sync.max(FULL_RESYNC);
    let mut full_resync = tokio::time::interval_at(Instant::now() + full, full);
    let mut node_watch = NodeWatch::default();
    let mut wanted = false;
    // When the next sync may run: minSyncPeriod after the last one began, or at once when it
    // left work for the next (`pending`).
    let mut due = Instant::now();
    let mut ticks = 0u64;
    let mut initial_steps = None;
    loop {
        tokio::select! {
            Some(ev) = inputs.src_rx.recv() => {
                take_events(p, ev, &mut inputs.src_rx, &mut node_watch, telemetry, hostname);
                wanted = true;
            }
            Some(change) = inputs.link_rx.recv() => {
                let mut addresses_changed = inputs.devices.apply(&change);
                while let Ok(change) = inputs.link_rx.try_recv() {
                    addresses_changed |= inputs.devices.apply(&change);
                }
                p.interfaces_changed(&mut inputs.devices);
                if addresses_changed {
                    p.store_mut().set_local_addresses(inputs.devices.node_addresses());
                    if p.store().has_dirty() {
                        telemetry.queued();
                        wanted = true;
                    }
                }
            }
            // minSyncPeriod: a sync wanted too soon after the last one waits for its turn.
            _ = tokio::time::sleep_until(due), if wanted => {}
            _ = tokio::time::sleep_until(retry_at), if p.has_failures() => wanted = true,
            _ = housekeeping.tick() => {
                p.housekeeping(&mut inputs.devices).await;
                // Every minute, what smaller changes freed.
                ticks += 1;
                if ticks.is_multiple_of(12) {
                    crate::memory::release_free();
                }
            }
            _ = full_resync.tick() => {
                p.resync_all();
                wanted = true;
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        if wanted && Instant::now() >= due {
            wanted = false;
            let started = Instant::now();
            if p.pending() {
                // A step of a long write: what came during the last one goes into this one.
                if let Ok(ev) = inputs.src_rx.try_recv() {
                    take_events(p, ev, &mut inputs.src_rx, &mut node_watch, telemetry, hostname);
                }
            }
            let failing_before = p.has_failures();
            sync(p, telemetry, &mut health, &mut initial_steps, &mut after_first_write);
            if p.has_failures() {
                backoff = if failing_before { (backoff * 2).min(RETRY_MAX) } else { RETRY_FIRST };
                retry_at = Instant::now() + backoff;
            } else {
                backoff = RETRY_FIRST;
            }
            // The next step of a long write follows at once (it is the same sync's work, cut so
            // that changes and signals are taken between steps), even while something else
            // fails (the other family's table, say, which waits its own backoff meanwhile:
            // `PerFamily`). A step that fails ends the write: the retry's backoff applies.
            if p.pending() {
                wanted = true;
                due = Instant::now();
            } else {
                due = started + periods.min;
            }
        }
    }
    Ok(())
}

/// Feeds `first` and whatever else is queued to the proxier: a burst is programmed once.
fn take_events<P: Proxier>(
    p: &mut P,
    first: Event,
    rx: &mut mpsc::Receiver<Event>,
    node_watch: &mut NodeWatch,
    telemetry: &Telemetry,
    hostname: &str,
) {
    p.handle(first);
    while let Ok(ev) = rx.try_recv() {
        p.handle(ev);
    }
    node_watch.observe(p.store(), p.ready(), telemetry, hostname);
    if p.store().has_dirty() {
        telemetry.queued();
    }
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

/// Work that waits for the mode's first whole write (every Service written or tried, no step
/// of a long write left), started once that write counts as programmed.
type AfterFirstWrite = Option<Box<dyn FnOnce() + Send>>;

fn sync<P: Proxier>(
    p: &mut P,
    telemetry: &Telemetry,
    health: &mut HealthServers,
    initial_steps: &mut Option<SyncStats>,
    after_first_write: &mut AfterFirstWrite,
) {
    if let Some(s) = p.sync() {
        // On the NodePort addresses, as kube-proxy binds its health-check servers; not while
        // a table is built in steps or changes go in batches (a load balancer would send
        // traffic for a Service whose rules are not written yet).
        if !p.building() {
            let store = p.store();
            let addresses =
                (*store.nodeport_config() != crate::model::store::NodePortAddresses::All).then(|| store.node_info().nodeport_addresses);
            health.update(&p.health_checks(), addresses);
        }
        // (The step that ends an initial build in steps: it drops what the steps kept.)
        let built = initial_steps.is_some() && !p.building();
        log_sync(&s, p.building(), initial_steps);
        // A large change (the initial list, a relist, a build's end) leaves much of what it
        // used free.
        if s.initial || built || s.upserted + s.removed >= 1000 {
            crate::memory::release_free();
        }
        telemetry.synced(&s, &p.store().change_counts());
        // (While a table is built in steps, what was queued waits for the last: `/healthz`
        // reports it late as it would a single long write, `/livez` sees the steps progress.
        // A table written again in place serves throughout once its maps are filled.)
        if !p.has_failures() {
            if p.building() {
                telemetry.progressed();
            } else {
                telemetry.updated();
            }
        }
        p.report(telemetry);
        // (Also when a Service failed: what could be written is, and the rest is retried.)
        if p.ready() && !p.building() && !p.pending() {
            if let Some(work) = after_first_write.take() {
                work();
            }
        }
    } else {
        telemetry.record_changes(&p.store().change_counts());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A proxier whose syncs are steps of a long write: `steps` more after each, building
    /// (Services missing from the kernel until the last) or writing again what exists.
    struct Stepping {
        store: Store,
        steps: usize,
        building: bool,
    }

    impl Proxier for Stepping {
        fn store(&self) -> &Store {
            &self.store
        }
        fn store_mut(&mut self) -> &mut Store {
            &mut self.store
        }
        fn ready(&self) -> bool {
            true
        }
        fn has_failures(&self) -> bool {
            false
        }
        fn sync(&mut self) -> Option<SyncStats> {
            self.steps = self.steps.saturating_sub(1);
            Some(SyncStats::default())
        }
        fn health_checks(&self) -> BTreeMap<u16, PortState> {
            // (Port 0: the server listens on a port of the kernel's choosing.)
            let service = crate::model::ObjectKey::new("default", "lb");
            BTreeMap::from([(0, PortState { service, local_endpoints: 1 })])
        }
        fn pending(&self) -> bool {
            self.steps > 0
        }
        fn building(&self) -> bool {
            self.building && self.steps > 0
        }
    }

    /// The eBPF mode's removal of what kube-proxy left is tried until nothing translates.
    #[test]
    fn the_takeover_removal_is_tried_again_until_nothing_translates() {
        use std::cell::RefCell;
        // Left over after two tries (a lock held past the tools' wait), gone after the third.
        let (tries, waits) = (RefCell::new(0u32), RefCell::new(Vec::new()));
        let left = || {
            if *tries.borrow() < 3 {
                vec!["iptables-nft (IPv4): 3 chains in the nat table (KUBE-SERVICES, ...)".to_string()]
            } else {
                vec![]
            }
        };
        let n = remove_until_clean(|| *tries.borrow_mut() += 1, left, |d| waits.borrow_mut().push(d.as_secs()));
        assert_eq!((n, *tries.borrow()), (3, 3), "tried until clean, and no more");
        assert_eq!(*waits.borrow(), [10, 20], "waits doubled between tries");
        // Clean at once: one try, no wait.
        let waits = RefCell::new(Vec::new());
        assert_eq!(remove_until_clean(|| {}, Vec::new, |d| waits.borrow_mut().push(d)), 1);
        assert!(waits.borrow().is_empty());
        // The wait stops growing at its most.
        let (count, waits) = (RefCell::new(0), RefCell::new(Vec::new()));
        let left = || {
            *count.borrow_mut() += 1;
            if *count.borrow() < 8 {
                vec!["nftables: table ip kube-proxy".to_string()]
            } else {
                vec![]
            }
        };
        assert_eq!(remove_until_clean(|| {}, left, |d| waits.borrow_mut().push(d.as_secs())), 8);
        assert_eq!(*waits.borrow(), [10, 20, 40, 80, 160, 300, 300]);
    }

    /// What waits for the first whole write runs once, at the step that ends it, once that
    /// write counts as programmed.
    #[tokio::test]
    async fn what_waits_for_the_first_write_runs_once_at_its_end() {
        let telemetry = Telemetry::new(Duration::from_secs(60), None, Default::default());
        let mut health = HealthServers::new(telemetry.clone());
        let mut p = Stepping { store: Store::new("node"), steps: 3, building: true };
        // Queued long enough ago that /healthz says 503 until it is programmed.
        telemetry.queued();
        telemetry.backdate_queued(Duration::from_secs(61));
        let runs = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (seen, t) = (runs.clone(), telemetry.clone());
        let mut after: AfterFirstWrite = Some(Box::new(move || seen.lock().unwrap().push(t.healthz().0)));
        sync(&mut p, &telemetry, &mut health, &mut None, &mut after);
        assert!(runs.lock().unwrap().is_empty(), "not while steps are left");
        sync(&mut p, &telemetry, &mut health, &mut None, &mut after);
        assert!(runs.lock().unwrap().is_empty(), "not while steps are left");
        sync(&mut p, &telemetry, &mut health, &mut None, &mut after);
        assert_eq!(*runs.lock().unwrap(), vec![200], "at the last step, once it counts as programmed");
        assert_eq!(telemetry.healthz().0, 200);
        p.steps = 0;
        sync(&mut p, &telemetry, &mut health, &mut None, &mut after);
        assert_eq!(runs.lock().unwrap().len(), 1, "once");
    }

    /// What was queued counts as programmed after a step that writes again a table that
    /// exists (it serves throughout), but not before the last step of one built from nothing
    /// (`/livez` takes its steps as signs of life); health-check node ports open then too (a
    /// load balancer would otherwise send traffic that no rule takes yet).
    #[tokio::test]
    async fn a_table_built_in_steps_is_programmed_at_its_last_step() {
        for building in [true, false] {
            let telemetry = Telemetry::new(Duration::from_secs(60), None, Default::default());
            let mut health = HealthServers::new(telemetry.clone());
            let mut p = Stepping { store: Store::new("node"), steps: 2, building };
            telemetry.queued();
            telemetry.backdate_queued(Duration::from_secs(61));
            assert_eq!((telemetry.healthz().0, telemetry.livez().0), (503, 503), "queued and late");
            sync(&mut p, &telemetry, &mut health, &mut None, &mut None);
            assert!(p.pending());
            if building {
                assert_eq!((telemetry.healthz().0, telemetry.livez().0), (503, 200), "not ready, but alive while the steps progress");
                assert_eq!(health.ports(), Vec::<u16>::new(), "no health-check port opens");
            } else {
                assert_eq!((telemetry.healthz().0, telemetry.livez().0), (200, 200));
                assert_eq!(health.ports(), vec![0]);
            }
            sync(&mut p, &telemetry, &mut health, &mut None, &mut None);
            assert!(!p.pending());
            assert_eq!(telemetry.healthz().0, 200, "building: {building}");
            assert_eq!(health.ports(), vec![0], "building: {building}");
        }
    }
}
