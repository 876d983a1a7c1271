//! Attaching the TC ingress program to interfaces with tcx links, pinned so traffic keeps
//! flowing while the agent is stopped or restarting. A restarted agent swaps its freshly loaded
//! program into the existing links atomically (BPF_LINK_UPDATE), so no packet goes unhandled.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use aya::programs::{
    links::{FdLink, PinnedLink},
    tc::{SchedClassifierLink, TcAttachOptions, TcAttachType},
    LinkOrder, SchedClassifier,
};

use super::loader::links_dir;

/// Glob patterns for pod-facing interface names.
#[derive(Clone, Debug)]
pub struct DevicePatterns(Vec<glob::Pattern>);

impl DevicePatterns {
    pub fn parse(list: &[String]) -> Result<Self, String> {
        list.iter()
            .map(|p| glob::Pattern::new(p).map_err(|e| format!("--pod-devices pattern {p:?}: {e}")))
            .collect::<Result<_, _>>()
            .map(Self)
    }

    pub fn matches(&self, name: &str) -> bool {
        self.0.iter().any(|p| p.matches(name))
    }
}

/// Where the link of interface `ifindex` is pinned. Keyed by index, which a renamed interface
/// keeps.
fn pin_path(root: &Path, ifindex: u32) -> PathBuf {
    links_dir(root).join(format!("tc_ingress_{ifindex}"))
}

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("attaching to {ifname} (index {ifindex}): {source}")]
    Attach {
        ifname: String,
        ifindex: u32,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("pinning the link of {ifname}: {detail}")]
    Pin { ifname: String, detail: String },
}

/// Interfaces the program is attached to: index -> name.
#[derive(Default)]
pub struct Attachments {
    pub interfaces: BTreeMap<u32, String>,
    /// Link handles of this process. Pinned links stay attached without them; unpinned ones
    /// (no --bpffs-root) detach when these drop.
    links: BTreeMap<u32, FdLink>,
}

impl Attachments {
    /// Attaches to `ifname`, taking over a link pinned by a previous run when there is one.
    pub fn attach(
        &mut self,
        prog: &mut SchedClassifier,
        root: Option<&Path>,
        ifindex: u32,
        ifname: &str,
    ) -> Result<(), AttachError> {
        if self.interfaces.contains_key(&ifindex) {
            return Ok(());
        }
        let attach_err = |source| AttachError::Attach { ifname: ifname.into(), ifindex, source };
        if let Some(root) = root {
            let pin = pin_path(root, ifindex);
            if pin.exists() {
                match adopt(prog, &pin) {
                    Ok(link) => {
                        tracing::info!(interface = ifname, ifindex, "took over pinned link; program replaced atomically");
                        self.interfaces.insert(ifindex, ifname.into());
                        self.links.insert(ifindex, link);
                        return Ok(());
                    }
                    Err(e) => {
                        // The interface it was for is gone (the index was reused) or the pin is
                        // not a tcx link: start afresh.
                        tracing::info!(interface = ifname, ifindex, reason = %e, "dropping stale pinned link");
                        let _ = fs::remove_file(&pin);
                    }
                }
            }
        }
        let id = prog
            .attach_with_options(ifname, TcAttachType::Ingress, TcAttachOptions::TcxOrder(LinkOrder::first()))
            .map_err(attach_err)?;
        let link = prog.take_link(id).map_err(attach_err)?;
        let fd_link = FdLink::try_from(link)
            .map_err(|e| AttachError::Pin { ifname: ifname.into(), detail: e.to_string() })?;
        let fd_link = match root {
            Some(root) => {
                let pinned = fd_link
                    .pin(pin_path(root, ifindex))
                    .map_err(|e| AttachError::Pin { ifname: ifname.into(), detail: e.to_string() })?;
                FdLink::from(pinned)
            }
            None => fd_link,
        };
        tracing::info!(interface = ifname, ifindex, "attached tc ingress (tcx)");
        self.interfaces.insert(ifindex, ifname.into());
        self.links.insert(ifindex, fd_link);
        Ok(())
    }

    /// Forgets an interface that went away and removes its pin (the kernel already detached
    /// the link when the device was unregistered).
    pub fn forget(&mut self, root: Option<&Path>, ifindex: u32) -> Option<String> {
        self.links.remove(&ifindex);
        if let Some(root) = root {
            let _ = fs::remove_file(pin_path(root, ifindex));
        }
        self.interfaces.remove(&ifindex)
    }

    /// Removes pins of interfaces that no longer exist.
    pub fn prune_pins(root: &Path, live: &BTreeMap<u32, String>) {
        let Ok(dir) = fs::read_dir(links_dir(root)) else { return };
        for entry in dir.flatten() {
            let name = entry.file_name();
            let Some(idx) = name.to_str().and_then(|n| n.strip_prefix("tc_ingress_")).and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if !live.contains_key(&idx) {
                tracing::info!(ifindex = idx, "removing the pinned link of a vanished interface");
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

fn adopt(prog: &mut SchedClassifier, pin: &Path) -> Result<FdLink, String> {
    let pinned = PinnedLink::from_pin(pin).map_err(|e| e.to_string())?;
    let link = SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(|e| e.to_string())?;
    let id = prog.attach_to_link(link).map_err(|e| e.to_string())?;
    let link = prog.take_link(id).map_err(|e| e.to_string())?;
    FdLink::try_from(link).map_err(|e| e.to_string())
}
