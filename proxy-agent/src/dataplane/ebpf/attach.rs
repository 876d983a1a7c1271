//! Attaching the TC programs to pod interfaces with tcx links (ingress: DNAT, egress: reverse
//! NAT), pinned so traffic keeps flowing while the agent is stopped or restarting. A restarted
//! agent swaps its freshly loaded programs into the existing links atomically
//! (BPF_LINK_UPDATE), so no packet goes unhandled.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use aya::{
    programs::{
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions, TcAttachType},
        LinkOrder, SchedClassifier,
    },
    Ebpf,
};
use proxy_common::prog_names;

use super::loader::{classifier, links_dir};

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

/// The hooks every pod interface gets: (attach point, program, pin file prefix). Egress comes
/// first: on its own it is harmless (it only translates replies of flows tracked elsewhere),
/// while ingress on its own would DNAT flows whose replies nobody translates back.
const HOOKS: [(TcAttachType, &str, &str); 2] = [
    (TcAttachType::Egress, prog_names::TC_EGRESS, "tc_egress_"),
    (TcAttachType::Ingress, prog_names::TC_INGRESS, "tc_ingress_"),
];

/// Where a hook's link of interface `ifindex` is pinned: `<hook>_<ifindex>_<ifname>`. The index
/// identifies the interface (a renamed interface keeps it); the name is there for people and
/// for `inspect` run from another network namespace.
fn pin_path(root: &Path, prefix: &str, ifindex: u32, ifname: &str) -> PathBuf {
    links_dir(root).join(format!("{prefix}{ifindex}_{ifname}"))
}

/// The interface index and name a link pin file is for.
pub fn parse_pin(file_name: &str) -> Option<(u32, String)> {
    let rest = HOOKS.iter().find_map(|(_, _, prefix)| file_name.strip_prefix(prefix))?;
    let (idx, name) = rest.split_once('_').unwrap_or((rest, ""));
    Some((idx.parse().ok()?, name.to_string()))
}

/// Pins of `prefix` for interface `ifindex`, whatever name they carry.
fn pins_of(root: &Path, prefix: &str, ifindex: u32) -> Vec<PathBuf> {
    let Ok(dir) = fs::read_dir(links_dir(root)) else { return Vec::new() };
    dir.flatten()
        .filter(|e| {
            e.file_name().to_str().is_some_and(|n| n.starts_with(prefix) && parse_pin(n).is_some_and(|(i, _)| i == ifindex))
        })
        .map(|e| e.path())
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("attaching {program} to {ifname} (index {ifindex}): {source}")]
    Attach {
        program: &'static str,
        ifname: String,
        ifindex: u32,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("pinning the {program} link of {ifname}: {detail}")]
    Pin { program: &'static str, ifname: String, detail: String },
}

/// Interfaces the programs are attached to: index -> name.
#[derive(Default)]
pub struct Attachments {
    pub interfaces: BTreeMap<u32, String>,
    /// Link handles of this process. Pinned links stay attached without them; unpinned ones
    /// (no --bpffs-root) detach when these drop.
    links: BTreeMap<(u32, &'static str), FdLink>,
}

impl Attachments {
    /// Attaches both hooks to `ifname`, taking over links pinned by a previous run.
    pub fn attach(&mut self, ebpf: &mut Ebpf, root: Option<&Path>, ifindex: u32, ifname: &str) -> Result<(), AttachError> {
        if self.interfaces.contains_key(&ifindex) {
            return Ok(());
        }
        for (hook, program, prefix) in HOOKS {
            let prog = classifier(ebpf, program);
            let pins = root.map(|r| (pins_of(r, prefix, ifindex), pin_path(r, prefix, ifindex, ifname)));
            let link = attach_one(prog, hook, program, pins, ifindex, ifname)?;
            self.links.insert((ifindex, program), link);
        }
        tracing::info!(interface = ifname, ifindex, "attached tc ingress and egress (tcx)");
        self.interfaces.insert(ifindex, ifname.into());
        Ok(())
    }

    /// Forgets an interface that went away and removes its pins (the kernel already detached
    /// the links when the device was unregistered).
    pub fn forget(&mut self, root: Option<&Path>, ifindex: u32) -> Option<String> {
        for (_, program, prefix) in HOOKS {
            self.links.remove(&(ifindex, program));
            for pin in root.map(|r| pins_of(r, prefix, ifindex)).unwrap_or_default() {
                let _ = fs::remove_file(pin);
            }
        }
        self.interfaces.remove(&ifindex)
    }

    /// Follows an interface rename in the pin names.
    pub fn renamed(&mut self, root: Option<&Path>, ifindex: u32, ifname: &str) {
        let Some(old) = self.interfaces.get_mut(&ifindex) else { return };
        if old == ifname {
            return;
        }
        tracing::info!(ifindex, from = %old, to = ifname, "interface renamed");
        *old = ifname.to_string();
        for (_, _, prefix) in HOOKS {
            let Some(root) = root else { break };
            for pin in pins_of(root, prefix, ifindex) {
                let _ = fs::rename(pin, pin_path(root, prefix, ifindex, ifname));
            }
        }
    }

    /// Removes pins of interfaces that no longer exist.
    pub fn prune_pins(root: &Path, live: &BTreeMap<u32, String>) {
        let Ok(dir) = fs::read_dir(links_dir(root)) else { return };
        for entry in dir.flatten() {
            let Some((idx, _)) = entry.file_name().to_str().and_then(parse_pin) else { continue };
            if !live.contains_key(&idx) {
                tracing::info!(ifindex = idx, "removing the pinned link of a vanished interface");
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

/// `pins`: the pins a previous run left for this interface, and where to pin now.
fn attach_one(
    prog: &mut SchedClassifier,
    hook: TcAttachType,
    program: &'static str,
    pins: Option<(Vec<PathBuf>, PathBuf)>,
    ifindex: u32,
    ifname: &str,
) -> Result<FdLink, AttachError> {
    let attach_err = |source| AttachError::Attach { program, ifname: ifname.into(), ifindex, source };
    let pin_err = |detail: String| AttachError::Pin { program, ifname: ifname.into(), detail };
    let (old_pins, pin) = match pins {
        Some((old, new)) => (old, Some(new)),
        None => (Vec::new(), None),
    };
    for old in &old_pins {
        match adopt(prog, old) {
            Ok(link) => {
                tracing::debug!(interface = ifname, program, "took over pinned link; program replaced atomically");
                if let Some(pin) = pin.as_ref().filter(|p| *p != old) {
                    let _ = fs::rename(old, pin);
                }
                return Ok(link);
            }
            Err(e) => {
                // The interface it was made for is gone (its index was reused) or the pin is
                // not a tcx link: start afresh.
                tracing::info!(interface = ifname, program, reason = %e, "dropping stale pinned link");
                let _ = fs::remove_file(old);
            }
        }
    }
    // First in the tcx chain: services must be translated before other programs look at
    // addresses.
    let id = prog.attach_with_options(ifname, hook, TcAttachOptions::TcxOrder(LinkOrder::first())).map_err(attach_err)?;
    let link = FdLink::try_from(prog.take_link(id).map_err(attach_err)?).map_err(|e| pin_err(e.to_string()))?;
    match pin {
        Some(pin) => link.pin(pin).map(FdLink::from).map_err(|e| pin_err(e.to_string())),
        None => Ok(link),
    }
}

fn adopt(prog: &mut SchedClassifier, pin: &Path) -> Result<FdLink, String> {
    let pinned = PinnedLink::from_pin(pin).map_err(|e| e.to_string())?;
    let link = SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(|e| e.to_string())?;
    let id = prog.attach_to_link(link).map_err(|e| e.to_string())?;
    let link = prog.take_link(id).map_err(|e| e.to_string())?;
    FdLink::try_from(link).map_err(|e| e.to_string())
}
