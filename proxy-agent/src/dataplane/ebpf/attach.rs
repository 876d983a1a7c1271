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
        xdp::XdpLink,
        LinkOrder, SchedClassifier, Xdp, XdpMode,
    },
    Ebpf,
};
use proxy_common::prog_names;

use super::loader::{self, classifier, links_dir};

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

/// What an interface is to the dataplane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Faces pods: ClusterIP DNAT on ingress, reverse NAT on egress.
    Pod,
    /// Carries traffic from outside the node: north-south on XDP and TC ingress, reverse NAT of
    /// local backends' replies on egress.
    External,
}

/// XDP attach mode for external interfaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpSetting {
    /// In the driver (veth, and most physical NICs); the interface is served by TC alone if
    /// the driver refuses.
    Native,
    /// Generic (skb) mode: works everywhere, gains little over TC.
    Generic,
    Disabled,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hook {
    Tc(TcAttachType, &'static str),
    Xdp,
}

impl Hook {
    fn program(self) -> &'static str {
        match self {
            Hook::Tc(_, p) => p,
            Hook::Xdp => prog_names::XDP_EXT,
        }
    }

    /// Prefix of the hook's link pin files.
    fn prefix(self) -> &'static str {
        match self.program() {
            prog_names::TC_EGRESS => "tc_egress_",
            prog_names::TC_INGRESS => "tc_ingress_",
            prog_names::TC_EXT_INGRESS => "tc_ext_ingress_",
            _ => "xdp_",
        }
    }
}

/// The hooks of each role, in attach order. Egress comes first: on its own it is nearly
/// harmless (it translates replies of flows tracked elsewhere, and the rare host flow the
/// socket hooks leave to TC, whose first replies may come before ingress is there to
/// translate them and are retransmitted), while ingress on its own would DNAT every flow whose
/// replies nobody translates back. XDP comes last: it only takes over flows TC
/// would handle the same way.
const POD_HOOKS: [Hook; 2] =
    [Hook::Tc(TcAttachType::Egress, prog_names::TC_EGRESS), Hook::Tc(TcAttachType::Ingress, prog_names::TC_INGRESS)];
const EXTERNAL_HOOKS: [Hook; 3] =
    [Hook::Tc(TcAttachType::Egress, prog_names::TC_EGRESS), Hook::Tc(TcAttachType::Ingress, prog_names::TC_EXT_INGRESS), Hook::Xdp];
const ALL_PREFIXES: [&str; 4] = ["tc_egress_", "tc_ingress_", "tc_ext_ingress_", "xdp_"];

fn hooks(role: Role) -> &'static [Hook] {
    match role {
        Role::Pod => &POD_HOOKS,
        Role::External => &EXTERNAL_HOOKS,
    }
}

/// Where a hook's link of interface `ifindex` is pinned: `<hook>_<ifindex>_<ifname>`. The index
/// identifies the interface (a renamed interface keeps it); the name is there for people and
/// for `inspect` run from another network namespace.
fn pin_path(root: &Path, prefix: &str, ifindex: u32, ifname: &str) -> PathBuf {
    links_dir(root).join(format!("{prefix}{ifindex}_{ifname}"))
}

/// The hook prefix, interface index and name a link pin file is for.
pub fn parse_pin_hook(file_name: &str) -> Option<(&'static str, u32, String)> {
    let (prefix, rest) = ALL_PREFIXES.iter().find_map(|p| file_name.strip_prefix(p).map(|r| (*p, r)))?;
    let (idx, name) = rest.split_once('_').unwrap_or((rest, ""));
    Some((prefix, idx.parse().ok()?, name.to_string()))
}

/// The interface index and name a link pin file is for.
pub fn parse_pin(file_name: &str) -> Option<(u32, String)> {
    parse_pin_hook(file_name).map(|(_, i, n)| (i, n))
}

/// Pins of `prefix` for interface `ifindex`, whatever name they carry.
fn pins_of(root: &Path, prefix: &str, ifindex: u32) -> Vec<PathBuf> {
    let Ok(dir) = fs::read_dir(links_dir(root)) else { return Vec::new() };
    dir.flatten()
        .filter(|e| e.file_name().to_str().and_then(parse_pin_hook).is_some_and(|(p, i, _)| p == prefix && i == ifindex))
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

/// Interfaces the programs are attached to.
#[derive(Default)]
pub struct Attachments {
    /// Index -> name.
    pub interfaces: BTreeMap<u32, String>,
    pub roles: BTreeMap<u32, Role>,
    /// External interfaces where XDP could not be attached (the driver refused).
    pub xdp_failed: BTreeMap<u32, String>,
    /// Link handles of this process. Pinned links stay attached without them; unpinned ones
    /// (no --bpffs-root) detach when these drop.
    links: BTreeMap<(u32, &'static str), FdLink>,
}

impl Attachments {
    /// Attaches the hooks of `role` to `ifname`, taking over links pinned by a previous run.
    pub fn attach(
        &mut self,
        ebpf: &mut Ebpf,
        root: Option<&Path>,
        ifindex: u32,
        ifname: &str,
        role: Role,
        xdp: XdpSetting,
    ) -> Result<(), AttachError> {
        if self.interfaces.contains_key(&ifindex) {
            return Ok(());
        }
        let mut done = Vec::new();
        for hook in hooks(role) {
            let program = hook.program();
            let prefix = hook.prefix();
            let pins = root.map(|r| (pins_of(r, prefix, ifindex), pin_path(r, prefix, ifindex, ifname)));
            let attached = match hook {
                Hook::Tc(at, _) => attach_tc(classifier(ebpf, program), *at, program, pins, ifindex, ifname),
                Hook::Xdp if xdp == XdpSetting::Disabled => continue,
                Hook::Xdp => {
                    let mode = if xdp == XdpSetting::Native { XdpMode::Driver } else { XdpMode::Skb };
                    match attach_xdp(loader::xdp(ebpf, program), mode, pins, ifindex, ifname) {
                        Ok(l) => Ok(l),
                        Err(e) => {
                            // TC serves the interface without it, only slower.
                            if self.xdp_failed.insert(ifindex, ifname.into()).is_none() {
                                tracing::warn!(interface = ifname, "{e}; north-south traffic on it is handled by TC only");
                            }
                            continue;
                        }
                    }
                }
            };
            match attached {
                Ok(link) => {
                    self.links.insert((ifindex, program), link);
                    done.push(program);
                }
                Err(e) => {
                    // Leave nothing half-attached: an ingress without its egress would DNAT
                    // flows whose replies are not translated back.
                    for p in done {
                        self.links.remove(&(ifindex, p));
                    }
                    if let Some(r) = root {
                        for hook in hooks(role) {
                            for pin in pins_of(r, hook.prefix(), ifindex) {
                                let _ = fs::remove_file(pin);
                            }
                        }
                    }
                    return Err(e);
                }
            }
        }
        let with_xdp = done.contains(&prog_names::XDP_EXT);
        match role {
            Role::Pod => tracing::info!(interface = ifname, ifindex, "attached to pod interface: tc ingress and egress (tcx)"),
            Role::External => tracing::info!(
                interface = ifname,
                ifindex,
                xdp = if with_xdp { "native/generic as configured" } else { "off" },
                "attached to external interface: tc ingress and egress (tcx), xdp"
            ),
        }
        self.interfaces.insert(ifindex, ifname.into());
        self.roles.insert(ifindex, role);
        Ok(())
    }

    /// Forgets an interface that went away, or that the agent detaches, and removes its pins
    /// (dropping the last handle of a link detaches it).
    pub fn forget(&mut self, root: Option<&Path>, ifindex: u32) -> Option<String> {
        for prefix in ALL_PREFIXES {
            for pin in root.map(|r| pins_of(r, prefix, ifindex)).unwrap_or_default() {
                let _ = fs::remove_file(pin);
            }
        }
        self.links.retain(|(i, _), _| *i != ifindex);
        self.roles.remove(&ifindex);
        self.xdp_failed.remove(&ifindex);
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
        for prefix in ALL_PREFIXES {
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

/// Takes over a link a previous run pinned for this hook (`adopt` swaps our program into it),
/// or else makes a new one (`attach`), and pins it. `pins`: the pins a previous run left for
/// this interface, and where to pin now.
fn take_over_or_attach(
    program: &'static str,
    ifname: &str,
    pins: Option<(Vec<PathBuf>, PathBuf)>,
    mut adopt: impl FnMut(&Path) -> Result<FdLink, String>,
    attach: impl FnOnce() -> Result<FdLink, AttachError>,
) -> Result<FdLink, AttachError> {
    let pin_err = |detail: String| AttachError::Pin { program, ifname: ifname.into(), detail };
    let (old_pins, pin) = match pins {
        Some((old, new)) => (old, Some(new)),
        None => (Vec::new(), None),
    };
    for old in &old_pins {
        match adopt(old) {
            Ok(link) => {
                tracing::debug!(interface = ifname, program, "took over pinned link; program replaced atomically");
                if let Some(pin) = pin.as_ref().filter(|p| *p != old) {
                    let _ = fs::rename(old, pin);
                }
                return Ok(link);
            }
            Err(e) => {
                // The interface it was made for is gone (its index was reused) or the pin is
                // not a link of this kind: start afresh.
                tracing::info!(interface = ifname, program, reason = %e, "dropping stale pinned link");
                let _ = fs::remove_file(old);
            }
        }
    }
    let link = attach()?;
    match pin {
        Some(pin) => link.pin(pin).map(FdLink::from).map_err(|e| pin_err(e.to_string())),
        None => Ok(link),
    }
}

fn attach_tc(
    prog: &mut SchedClassifier,
    hook: TcAttachType,
    program: &'static str,
    pins: Option<(Vec<PathBuf>, PathBuf)>,
    ifindex: u32,
    ifname: &str,
) -> Result<FdLink, AttachError> {
    let attach_err = |source| AttachError::Attach { program, ifname: ifname.into(), ifindex, source };
    let pin_err = |detail: String| AttachError::Pin { program, ifname: ifname.into(), detail };
    let prog = std::cell::RefCell::new(prog);
    let adopt = |pin: &Path| -> Result<FdLink, String> {
        let mut prog = prog.borrow_mut();
        let pinned = PinnedLink::from_pin(pin).map_err(|e| e.to_string())?;
        let link = SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(|e| e.to_string())?;
        let id = prog.attach_to_link(link).map_err(|e| e.to_string())?;
        FdLink::try_from(prog.take_link(id).map_err(|e| e.to_string())?).map_err(|e| e.to_string())
    };
    let attach = || {
        let mut prog = prog.borrow_mut();
        // First in the tcx chain: services must be translated before other programs look at
        // addresses.
        let id = prog.attach_with_options(ifname, hook, TcAttachOptions::TcxOrder(LinkOrder::first())).map_err(attach_err)?;
        FdLink::try_from(prog.take_link(id).map_err(attach_err)?).map_err(|e| pin_err(e.to_string()))
    };
    take_over_or_attach(program, ifname, pins, adopt, attach)
}

fn attach_xdp(
    prog: &mut Xdp,
    mode: XdpMode,
    pins: Option<(Vec<PathBuf>, PathBuf)>,
    ifindex: u32,
    ifname: &str,
) -> Result<FdLink, AttachError> {
    let program = prog_names::XDP_EXT;
    let attach_err = |source| AttachError::Attach { program, ifname: ifname.into(), ifindex, source };
    let pin_err = |detail: String| AttachError::Pin { program, ifname: ifname.into(), detail };
    let prog = std::cell::RefCell::new(prog);
    let adopt = |pin: &Path| -> Result<FdLink, String> {
        let mut prog = prog.borrow_mut();
        let pinned = PinnedLink::from_pin(pin).map_err(|e| e.to_string())?;
        let link = XdpLink::try_from(FdLink::from(pinned)).map_err(|e| e.to_string())?;
        let id = prog.attach_to_link(link).map_err(|e| e.to_string())?;
        FdLink::try_from(prog.take_link(id).map_err(|e| e.to_string())?).map_err(|e| e.to_string())
    };
    let attach = || {
        let mut prog = prog.borrow_mut();
        let id = prog.attach_to_if_index(ifindex, mode).map_err(attach_err)?;
        // A netlink attachment (kernels without XDP links) cannot be pinned.
        FdLink::try_from(prog.take_link(id).map_err(attach_err)?)
            .map_err(|e| pin_err(format!("{e} (this kernel has no XDP links; 5.9+ is needed)")))
    };
    take_over_or_attach(program, ifname, pins, adopt, attach)
}
