//! The eBPF dataplane: the embedded TC program, its pinned maps and links.

pub mod attach;
pub mod batch;
pub mod ids;
pub mod lbmaps;
pub mod loader;
pub mod snapshot;

use std::path::{Path, PathBuf};

use aya::{programs::SchedClassifier, Ebpf};
use proxy_common::prog_names;

use self::{
    attach::{AttachError, Attachments},
    lbmaps::LbMaps,
    loader::{LoadError, LoadOptions},
};
use super::{Dataplane, DataplaneError};
use crate::model::{Frontend, FrontendKey};

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Maps(#[from] DataplaneError),
}

pub struct EbpfDataplane {
    ebpf: Ebpf,
    lb: LbMaps,
    pin_root: Option<PathBuf>,
    attachments: Attachments,
}

impl EbpfDataplane {
    /// Loads the programs, creates or adopts the pinned maps and reads back what they hold.
    pub fn load(options: LoadOptions) -> Result<Self, EbpfError> {
        let lb_max = options.lb_map_max;
        let pin_root = options.pin_root.clone();
        let mut loaded = loader::load(options)?;
        let lb = LbMaps::adopt(&mut loaded.ebpf, lb_max)?;
        Ok(Self { ebpf: loaded.ebpf, lb, pin_root, attachments: Attachments::default() })
    }

    pub fn pin_root(&self) -> Option<&Path> {
        self.pin_root.as_deref()
    }

    /// The ingress (DNAT) program.
    pub fn ingress_program(&mut self) -> &mut SchedClassifier {
        loader::classifier(&mut self.ebpf, prog_names::TC_INGRESS)
    }

    /// The egress (reverse NAT) program.
    pub fn egress_program(&mut self) -> &mut SchedClassifier {
        loader::classifier(&mut self.ebpf, prog_names::TC_EGRESS)
    }

    /// The object, for the maps the writer does not own (conntrack, counters).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    pub fn attach(&mut self, ifindex: u32, ifname: &str) -> Result<(), AttachError> {
        self.attachments.attach(&mut self.ebpf, self.pin_root.as_deref(), ifindex, ifname)
    }

    pub fn interface_renamed(&mut self, ifindex: u32, ifname: &str) {
        self.attachments.renamed(self.pin_root.as_deref(), ifindex, ifname);
    }

    pub fn forget_interface(&mut self, ifindex: u32) -> Option<String> {
        self.attachments.forget(self.pin_root.as_deref(), ifindex)
    }

    pub fn is_attached(&self, ifindex: u32) -> bool {
        self.attachments.interfaces.contains_key(&ifindex)
    }

    pub fn attached(&self) -> &std::collections::BTreeMap<u32, String> {
        &self.attachments.interfaces
    }

    pub fn backend_count(&self) -> usize {
        self.lb.backend_count()
    }

    /// Entries counted in the kernel's maps (see `LbMaps::count_in_kernel`).
    pub fn count_in_kernel(&self) -> std::io::Result<std::collections::BTreeMap<&'static str, u64>> {
        self.lb.count_in_kernel()
    }

    pub fn service_entries(&self) -> usize {
        self.lb.service_entries()
    }
}

impl Dataplane for EbpfDataplane {
    fn programmed_keys(&self) -> Vec<FrontendKey> {
        self.lb.keys()
    }

    fn is_current(&self, key: &FrontendKey, fe: &Frontend) -> bool {
        self.lb.is_current(key, fe)
    }

    fn upsert(&mut self, key: &FrontendKey, fe: &Frontend) -> Result<(), DataplaneError> {
        self.lb.upsert(key, fe)
    }

    fn remove(&mut self, key: &FrontendKey) -> Result<(), DataplaneError> {
        self.lb.remove(key)
    }

    fn collect_garbage(&mut self) -> Result<usize, DataplaneError> {
        self.lb.collect_garbage()
    }
}
