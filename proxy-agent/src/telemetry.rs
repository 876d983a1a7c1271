//! Metrics with kube-proxy's names and kube-proxy's health semantics, so existing dashboards,
//! alerts and load-balancer health checks keep working.
//!
//! Health (kube-proxy `ProxyHealthServer`): an update queued and not programmed within
//! `health_timeout` (2 x --sync-period) makes /livez and /healthz answer 503; /healthz also
//! answers 503 while the Node is being deleted or is tainted ToBeDeletedByClusterAutoscaler.

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use aya::maps::{Map, MapData, PerCpuArray};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::{exponential_buckets, Histogram},
        MetricType,
    },
    registry::Registry,
};
use proxy_common::{map_names, Counter as DpCounter, Reason};

use crate::{dataplane::ebpf::loader, model::store::ChangeCounts, sync::SyncStats};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: String,
}

/// kube-proxy's network-programming buckets (0.25 s .. 5 min), with finer ones below 0.25 s
/// added in front: this agent programs in milliseconds, and extra buckets do not disturb
/// queries written against kube-proxy's.
fn programming_buckets() -> Vec<f64> {
    let mut b = vec![0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

#[derive(Debug, Default)]
struct Health {
    last_updated: Option<SystemTime>,
    oldest_pending: Option<Instant>,
    /// The last step of a long write in steps that programmed part of what is queued
    /// (`progressed`).
    last_progress: Option<Instant>,
    node_eligible: bool,
    /// API resources whose watch stalled and has brought nothing since.
    stalled_watches: std::collections::BTreeSet<String>,
}

/// Map sizes the reconciler reports after each sync.
#[derive(Debug, Default)]
pub struct MapFill {
    pub services: AtomicU64,
    pub backends: AtomicU64,
    pub conntrack: AtomicU64,
    /// The IPv6 family's maps.
    pub services6: AtomicU64,
    pub backends6: AtomicU64,
    pub conntrack6: AtomicU64,
    /// Bits set in each family's conntrack filter (`proxy_common::ct_filter`), as its last
    /// rebuild left them.
    pub conntrack_filter: AtomicU64,
    pub conntrack_filter6: AtomicU64,
    /// Expired flows removed from each family's conntrack map so far (`ct_gc`).
    pub conntrack_removed: AtomicU64,
    pub conntrack_removed6: AtomicU64,
    /// Reply entries removed without their flow (no flow claimed them any more).
    pub conntrack_orphans: AtomicU64,
    pub conntrack_orphans6: AtomicU64,
    /// Services refused whole as too large for the load-balancer maps (the log names them).
    pub services_refused: AtomicU64,
}

/// Bits of a conntrack filter's half, where there is a conntrack map (`ct` entries; 0: none).
fn filter_bits(ct: u64) -> u64 {
    if ct == 0 {
        0
    } else {
        (proxy_common::ct_filter::HALF_WORDS * 64) as u64
    }
}

/// Entries each datapath map holds at most (all 0 without the eBPF dataplane): the IPv4 and
/// IPv6 load-balancer maps (`lb`, `lb6`) and conntrack tables.
#[derive(Clone, Copy, Debug, Default)]
pub struct MapCapacities {
    pub lb: u64,
    pub lb6: u64,
    pub ct: u64,
    pub ct6: u64,
}

pub struct Telemetry {
    pub registry: Registry,
    health: Mutex<Health>,
    health_timeout: Duration,
    start: SystemTime,
    sync_duration: Histogram,
    last_sync: Gauge<f64, AtomicU64>,
    last_queued: Gauge<f64, AtomicU64>,
    programming: Histogram,
    service_changes: Counter,
    service_pending: Gauge,
    endpoint_changes: Counter,
    endpoint_pending: Gauge,
    seen: Mutex<ChangeCounts>,
    healthz: Family<CodeLabel, Counter>,
    livez: Family<CodeLabel, Counter>,
    pub fill: Arc<MapFill>,
    /// Export kube-proxy's nfacct counters (iptables mode, where the kernel has them).
    nfacct: Arc<std::sync::atomic::AtomicBool>,
    /// The proxy mode serving (`/proxyMode`; auto mode may leave nftables for iptables).
    mode: Mutex<&'static str>,
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

fn rfc3339(t: SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t).map(|t| t.to_string()).unwrap_or_default()
}

impl Telemetry {
    /// `pin_root`: where the datapath maps are pinned, for the datapath counters.
    pub fn new(health_timeout: Duration, pin_root: Option<&Path>, capacities: MapCapacities) -> Arc<Self> {
        let mut registry = Registry::default();
        let sync_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        registry.register("kubeproxy_sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds", sync_duration.clone());
        let last_sync = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            last_sync.clone(),
        );
        let last_queued = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            last_queued.clone(),
        );
        let programming = Histogram::new(programming_buckets());
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            programming.clone(),
        );
        let service_changes = Counter::default();
        registry.register("kubeproxy_sync_proxy_rules_service_changes", "Cumulative proxy rules Service changes", service_changes.clone());
        let service_pending = Gauge::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            service_pending.clone(),
        );
        let endpoint_changes = Counter::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            endpoint_changes.clone(),
        );
        let endpoint_pending = Gauge::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            endpoint_pending.clone(),
        );
        let healthz = Family::<CodeLabel, Counter>::default();
        registry.register("kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status", healthz.clone());
        let livez = Family::<CodeLabel, Counter>::default();
        registry.register("kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status", livez.clone());
        let fill = Arc::new(MapFill::default());
        let nfacct = Arc::new(std::sync::atomic::AtomicBool::new(false));
        registry.register_collector(Box::new(NfacctCollector { enabled: nfacct.clone() }));
        registry.register_collector(Box::new(DatapathCollector {
            stats: pin_root.and_then(open_stats).map(Mutex::new),
            fill: fill.clone(),
            capacities,
        }));
        Arc::new(Self {
            registry,
            // The node is eligible while starting up, until a Node event says otherwise.
            health: Mutex::new(Health { node_eligible: true, ..Default::default() }),
            health_timeout,
            start: SystemTime::now(),
            sync_duration,
            last_sync,
            last_queued,
            programming,
            service_changes,
            service_pending,
            endpoint_changes,
            endpoint_pending,
            seen: Mutex::new(ChangeCounts::default()),
            healthz,
            livez,
            fill,
            nfacct,
            mode: Mutex::new(""),
        })
    }

    /// The proxy mode serving, for `/proxyMode`.
    pub fn set_mode(&self, mode: &'static str) {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner()) = mode;
    }

    pub fn mode(&self) -> &'static str {
        *self.mode.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The iptables mode's rules count into kube-proxy's nfacct objects: export them.
    pub fn count_nfacct(&self) {
        self.nfacct.store(true, Ordering::Relaxed);
    }

    /// A change arrived that needs programming.
    pub fn queued(&self) {
        let mut h = self.health.lock().unwrap();
        h.oldest_pending.get_or_insert_with(Instant::now);
        self.last_queued.set(unix(SystemTime::now()));
    }

    /// Everything queued is programmed.
    pub fn updated(&self) {
        let mut h = self.health.lock().unwrap();
        h.oldest_pending = None;
        h.last_progress = None;
        h.last_updated = Some(SystemTime::now());
    }

    /// A step of a long write in steps programmed part of what is queued (a table built from
    /// nothing): `/healthz` still waits for the whole, but `/livez` takes it as a sign of life,
    /// so that the kubelet does not kill an agent that is writing a large table.
    pub fn progressed(&self) {
        self.health.lock().unwrap().last_progress = Some(Instant::now());
    }

    pub fn set_node_eligible(&self, eligible: bool) {
        self.health.lock().unwrap().node_eligible = eligible;
    }

    /// Records a sync, and the change counts the store holds after it.
    pub fn synced(&self, stats: &SyncStats, counts: &ChangeCounts) {
        self.sync_duration.observe(stats.duration.as_secs_f64());
        if stats.failed == 0 {
            self.last_sync.set(unix(SystemTime::now()));
        }
        let now = SystemTime::now();
        for t in &stats.trigger_times {
            // Changes from before the agent started were not waiting for it (kube-proxy skips
            // them too).
            if *t >= self.start {
                self.programming.observe(now.duration_since(*t).unwrap_or_default().as_secs_f64());
            }
        }
        self.record_changes(counts);
    }

    pub fn record_changes(&self, counts: &ChangeCounts) {
        let mut seen = self.seen.lock().unwrap();
        self.service_changes.inc_by(counts.service_changes.saturating_sub(seen.service_changes));
        self.endpoint_changes.inc_by(counts.endpoint_changes.saturating_sub(seen.endpoint_changes));
        self.service_pending.set(counts.services_pending as i64);
        self.endpoint_pending.set(counts.endpoints_pending as i64);
        *seen = counts.clone();
    }

    fn healthy(&self) -> (bool, bool, Option<SystemTime>) {
        let h = self.health.lock().unwrap();
        let late = h.oldest_pending.is_some_and(|t| t.elapsed() >= self.health_timeout);
        (!late, h.node_eligible, h.last_updated)
    }

    /// A watch of `resource` brought an event or a bookmark.
    pub fn watch_progress(&self, resource: &str) {
        let mut h = self.health.lock().unwrap();
        if h.stalled_watches.remove(resource) {
            tracing::info!(resource, "the watch brings updates again");
        }
    }

    /// A watch of `resource` brought nothing for too long: updates may be missed.
    pub fn watch_stalled(&self, resource: &str) {
        self.health.lock().unwrap().stalled_watches.insert(resource.to_string());
    }

    /// The proxy programs changes in time (kube-proxy's `serviceProxyHealthy` of the
    /// health-check node ports).
    pub fn proxy_healthy(&self) -> bool {
        self.healthy().0
    }

    /// `/healthz`: status code and kube-proxy's JSON body.
    pub fn healthz(&self) -> (u16, String) {
        let (healthy, eligible, last) = self.healthy();
        let stalled: Vec<String> = self.health.lock().unwrap().stalled_watches.iter().cloned().collect();
        let ok = healthy && eligible && stalled.is_empty();
        let now = SystemTime::now();
        let code = if ok { 200 } else { 503 };
        self.healthz.get_or_create(&CodeLabel { code: code.to_string() }).inc();
        // As kube-proxy: a healthy server reports lastUpdated as now.
        let last = if ok { Some(now) } else { last };
        // Beyond kube-proxy's fields: which watches bring no updates.
        let stalled = if stalled.is_empty() {
            String::new()
        } else {
            format!(r#", "stalledWatches": {}"#, serde_json::to_string(&stalled).unwrap_or_default())
        };
        let body = format!(
            r#"{{"lastUpdated": "{}","currentTime": "{}", "nodeEligible": {eligible}{stalled}}}"#,
            last.map(rfc3339).unwrap_or_default(),
            rfc3339(now)
        );
        (code, body)
    }

    /// What was queued has waited `by` longer (tests of what turns late).
    #[cfg(test)]
    pub fn backdate_queued(&self, by: Duration) {
        let mut h = self.health.lock().unwrap();
        h.oldest_pending = h.oldest_pending.map(|t| t - by);
    }

    /// `/livez`: like /healthz but regardless of the Node, and alive while a long write in
    /// steps progresses (`progressed`).
    pub fn livez(&self) -> (u16, String) {
        let (healthy, _, last) = self.healthy();
        let progressing = self.health.lock().unwrap().last_progress.is_some_and(|t| t.elapsed() < self.health_timeout);
        let healthy = healthy || progressing;
        let now = SystemTime::now();
        let code = if healthy { 200 } else { 503 };
        self.livez.get_or_create(&CodeLabel { code: code.to_string() }).inc();
        let last = if healthy { Some(now) } else { last };
        (code, format!(r#"{{"lastUpdated": "{}","currentTime": "{}"}}"#, last.map(rfc3339).unwrap_or_default(), rfc3339(now)))
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("encoding metrics into a String");
        out
    }
}

/// kube-proxy's iptables packet counters (nfacct objects), read at scrape time.
#[derive(Debug)]
struct NfacctCollector {
    enabled: Arc<std::sync::atomic::AtomicBool>,
}

impl Collector for NfacctCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if !self.enabled.load(Ordering::Relaxed) {
            return Ok(());
        }
        for (name, metric, help) in crate::dataplane::netfilter::nfacct::COUNTERS {
            // A counter that cannot be read (deleted meanwhile) is left out, not made up.
            let Ok(packets) = crate::dataplane::netfilter::nfacct::packets(name) else { continue };
            let c = encoder.encode_descriptor(metric, help, None, MetricType::Counter)?;
            ConstCounter::new(packets).encode(c)?;
        }
        Ok(())
    }
}

fn open_stats(root: &Path) -> Option<PerCpuArray<MapData, DpCounter>> {
    let path: PathBuf = loader::maps_dir(root).join(map_names::STATS);
    let data =
        MapData::from_pin(&path).map_err(|e| tracing::warn!(path = %path.display(), error = %e, "datapath counters unavailable")).ok()?;
    PerCpuArray::try_from(Map::PerCpuArray(data)).ok()
}

/// Datapath figures, read at scrape time.
struct DatapathCollector {
    stats: Option<Mutex<PerCpuArray<MapData, DpCounter>>>,
    fill: Arc<MapFill>,
    capacities: MapCapacities,
}

impl std::fmt::Debug for DatapathCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DatapathCollector")
    }
}

impl Collector for DatapathCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(stats) = &self.stats {
            let stats = stats.lock().unwrap();
            let totals: Vec<(Reason, u64, u64)> = Reason::ALL
                .iter()
                .filter_map(|r| {
                    let v = stats.get(&(*r as u32), 0).ok()?;
                    Some((*r, v.iter().map(|c| c.packets).sum(), v.iter().map(|c| c.bytes).sum()))
                })
                .collect();
            let mut packets = encoder.encode_descriptor(
                "proxy_agent_datapath_packets",
                "Packets the eBPF datapath handled, by what it did with them",
                None,
                MetricType::Counter,
            )?;
            for (r, p, _) in &totals {
                ConstCounter::new(*p).encode(packets.encode_family(&[("reason", r.label())])?)?;
            }
            let mut bytes = encoder.encode_descriptor(
                "proxy_agent_datapath_bytes",
                "Bytes the eBPF datapath handled, by what it did with them",
                None,
                MetricType::Counter,
            )?;
            for (r, _, b) in &totals {
                ConstCounter::new(*b).encode(bytes.encode_family(&[("reason", r.label())])?)?;
            }
        }
        let (f, c) = (&self.fill, self.capacities);
        if c.ct > 0 {
            let mut removed = encoder.encode_descriptor(
                "proxy_agent_conntrack_expired_flows_removed",
                "Flows past their conntrack lifetime the agent removed from each family's conntrack map, with their reply entries",
                None,
                MetricType::Counter,
            )?;
            for (family, n) in [("ipv4", &f.conntrack_removed), ("ipv6", &f.conntrack_removed6)] {
                ConstCounter::new(n.load(Ordering::Relaxed)).encode(removed.encode_family(&[("family", family)])?)?;
            }
            let mut orphans = encoder.encode_descriptor(
                "proxy_agent_conntrack_orphan_replies_removed",
                "Reply entries past their lifetime that no flow claimed any more (their forward entry evicted, or naming another \
                 backend), removed from each family's conntrack map; each held its reply tuple, a SNAT port among them",
                None,
                MetricType::Counter,
            )?;
            for (family, n) in [("ipv4", &f.conntrack_orphans), ("ipv6", &f.conntrack_orphans6)] {
                ConstCounter::new(n.load(Ordering::Relaxed)).encode(orphans.encode_family(&[("family", family)])?)?;
            }
        }
        if c.lb > 0 {
            let refused = encoder.encode_descriptor(
                "proxy_agent_services_refused",
                "Services refused whole because their frontends would take more than half of a load-balancer map \
                 (--lb-map-max); each keeps what was programmed for it, and the log names it, the map and the figures",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(f.services_refused.load(Ordering::Relaxed) as i64).encode(refused)?;
        }
        let mut entries =
            encoder.encode_descriptor("proxy_agent_map_entries", "Entries in use in each datapath map", None, MetricType::Gauge)?;
        let fill = [
            ("services", f.services.load(Ordering::Relaxed), c.lb),
            ("backends", f.backends.load(Ordering::Relaxed), c.lb),
            ("conntrack", f.conntrack.load(Ordering::Relaxed), c.ct),
            ("services_ipv6", f.services6.load(Ordering::Relaxed), c.lb6),
            ("backends_ipv6", f.backends6.load(Ordering::Relaxed), c.lb6),
            ("conntrack_ipv6", f.conntrack6.load(Ordering::Relaxed), c.ct6),
            // Bits, of a half's: a packet of no tracked flow meets a set one (and pays a
            // conntrack lookup) about as often as this share says.
            ("conntrack_filter", f.conntrack_filter.load(Ordering::Relaxed), filter_bits(c.ct)),
            ("conntrack_filter_ipv6", f.conntrack_filter6.load(Ordering::Relaxed), filter_bits(c.ct6)),
        ];
        for (map, n, _) in fill {
            ConstGauge::new(n as i64).encode(entries.encode_family(&[("map", map)])?)?;
        }
        let mut capacity =
            encoder.encode_descriptor("proxy_agent_map_capacity", "Capacity of each datapath map", None, MetricType::Gauge)?;
        for (map, _, cap) in fill {
            ConstGauge::new(cap as i64).encode(capacity.encode_family(&[("map", map)])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_follows_kube_proxy() {
        let t = Telemetry::new(Duration::from_secs(60), None, MapCapacities { lb: 1, lb6: 1, ct: 1, ct6: 1 });
        assert_eq!(t.healthz().0, 200, "healthy while starting up");
        t.queued();
        assert_eq!(t.healthz().0, 200, "a fresh queued update is not late yet");
        // Queued 61 s ago (moved back rather than waited for).
        let queued = t.health.lock().unwrap().oldest_pending.expect("pending");
        t.health.lock().unwrap().oldest_pending = Some(queued - Duration::from_secs(61));
        assert_eq!(t.healthz().0, 503, "an update queued longer than the timeout");
        assert_eq!(t.livez().0, 503);
        t.progressed();
        assert_eq!((t.healthz().0, t.livez().0), (503, 200), "a long write that progresses is alive, not ready");
        t.updated();
        assert_eq!(t.healthz().0, 200);
        t.set_node_eligible(false);
        let (code, body) = t.healthz();
        assert_eq!(code, 503, "a node being deleted fails /healthz");
        assert!(body.contains(r#""nodeEligible": false"#), "{body}");
        assert_eq!(t.livez().0, 200, "/livez ignores the node");
        let metrics = t.encode();
        assert!(metrics.contains(r#"kubeproxy_proxy_healthz_total{code="503"} 3"#), "{metrics}");
    }

    #[test]
    fn metrics_use_kube_proxy_names() {
        let mut t = Telemetry::new(Duration::from_secs(60), None, MapCapacities { lb: 65536, lb6: 32768, ct: 262144, ct6: 4096 });
        // A change that arrived 15 ms before the sync, after the agent started: its latency is
        // at least that.
        std::sync::Arc::get_mut(&mut t).expect("the only handle").start -= Duration::from_secs(1);
        let trigger = SystemTime::now() - Duration::from_millis(15);
        let stats = SyncStats { duration: Duration::from_millis(3), trigger_times: vec![trigger], ..Default::default() };
        t.synced(&stats, &ChangeCounts { service_changes: 3, endpoint_changes: 5, services_pending: 0, endpoints_pending: 1 });
        let m = t.encode();
        for want in [
            "kubeproxy_sync_proxy_rules_duration_seconds_count 1",
            "kubeproxy_network_programming_duration_seconds_count 1",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.01\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"+Inf\"} 1",
            "kubeproxy_sync_proxy_rules_service_changes_total 3",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 5",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 1",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "proxy_agent_map_capacity{map=\"conntrack\"} 262144",
            "proxy_agent_map_capacity{map=\"conntrack_ipv6\"} 4096",
            "proxy_agent_map_capacity{map=\"conntrack_filter\"} 1048576",
            "proxy_agent_map_capacity{map=\"services_ipv6\"} 32768",
            "proxy_agent_map_capacity{map=\"services\"} 65536",
            "proxy_agent_conntrack_expired_flows_removed_total{family=\"ipv6\"} 0",
            "proxy_agent_conntrack_orphan_replies_removed_total{family=\"ipv4\"} 0",
        ] {
            assert!(m.contains(want), "missing {want} in\n{m}");
        }
        // Triggers from before the agent started are not counted.
        let old = SyncStats { trigger_times: vec![UNIX_EPOCH], ..Default::default() };
        t.synced(&old, &ChangeCounts::default());
        assert!(t.encode().contains("kubeproxy_network_programming_duration_seconds_count 1"));
    }
}
