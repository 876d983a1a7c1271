//! `proxy-agent run`: load or adopt the dataplane, attach to pod interfaces as they appear,
//! and keep the maps in step with the sources until SIGTERM. On exit the programs, maps and
//! links stay pinned, so traffic keeps flowing until the next run adopts them.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::Duration,
};

use anyhow::Context as _;
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::mpsc,
};

use crate::{
    dataplane::{
        ebpf::{
            attach::{Attachments, DevicePatterns},
            loader::LoadOptions,
            EbpfDataplane,
        },
        Dataplane as _,
    },
    model::store::{Kind, Store},
    netlink::{self, LinkChange},
    reconcile::{Reconciler, SyncStats},
    source::manifests::{self, ManifestDir},
};

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub manifests: PathBuf,
    pub pod_devices: Vec<String>,
    pub bpffs_root: PathBuf,
    pub hostname: String,
    pub lb_map_max: u32,
    pub ct_map_max: u32,
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

fn on_link(dp: &mut EbpfDataplane, patterns: &DevicePatterns, change: LinkChange) {
    match change {
        LinkChange::Present { index, name } => {
            if dp.is_attached(index) {
                dp.interface_renamed(index, &name);
            } else if patterns.matches(&name) {
                if let Err(e) = dp.attach(index, &name) {
                    tracing::error!("{e}");
                }
            }
        }
        LinkChange::Gone { index } => {
            if let Some(name) = dp.forget_interface(index) {
                tracing::info!(interface = name, ifindex = index, "interface gone");
            }
        }
    }
}

pub async fn run(cfg: RunConfig) -> anyhow::Result<()> {
    let patterns = DevicePatterns::parse(&cfg.pod_devices).map_err(anyhow::Error::msg)?;
    let dir = ManifestDir::new(&cfg.manifests).map_err(anyhow::Error::msg)?;
    let dp = EbpfDataplane::load(LoadOptions {
        pin_root: Some(cfg.bpffs_root.clone()),
        lb_map_max: cfg.lb_map_max,
        ct_map_max: cfg.ct_map_max,
    })?;
    tracing::info!(
        bpffs_root = %cfg.bpffs_root.display(),
        node = cfg.hostname,
        adopted_frontends = dp.programmed_keys().len(),
        "dataplane loaded"
    );
    let mut rec = Reconciler::new(Store::new(cfg.hostname.clone()), dp, vec![Kind::Service, Kind::EndpointSlice]);

    let (link_tx, mut link_rx) = mpsc::channel(256);
    let links = netlink::watch(link_tx).await.context("watching network interfaces over rtnetlink")?;
    let live: BTreeMap<u32, String> = links.iter().cloned().collect();
    Attachments::prune_pins(&cfg.bpffs_root, &live);
    for (index, name) in links {
        on_link(rec.dataplane_mut(), &patterns, LinkChange::Present { index, name });
    }
    if rec.dataplane().attached().is_empty() {
        tracing::warn!(
            patterns = ?cfg.pod_devices,
            "no interface matches --pod-devices yet; attaching as matching interfaces appear"
        );
    }

    let (src_tx, mut src_rx) = mpsc::channel(64);
    let _watcher = manifests::spawn(dir, src_tx, cfg.resync)
        .with_context(|| format!("watching {}", cfg.manifests.display()))?;

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut retry = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            Some(ev) = src_rx.recv() => {
                rec.handle(ev);
                // Coalesce a burst: take what is already queued, then program once.
                while let Ok(ev) = src_rx.try_recv() {
                    rec.handle(ev);
                }
                if let Some(s) = rec.sync() {
                    log_sync(&s);
                }
            }
            Some(change) = link_rx.recv() => on_link(rec.dataplane_mut(), &patterns, change),
            _ = retry.tick(), if rec.has_failures() => {
                if let Some(s) = rec.sync() {
                    log_sync(&s);
                }
            }
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
