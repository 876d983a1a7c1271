//! Dataplanes program the kernel from the model. The reconciler owns exactly one.

pub mod ebpf;

use crate::model::{Frontend, FrontendKey};

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// The dataplane cannot express this frontend; the message says what to use instead.
    #[error("{0}")]
    Unsupported(String),
    #[error("map {map} is full ({max} entries); raise --lb-map-max (takes effect after `proxy-agent cleanup`, which resets tracked connections)")]
    MapFull { map: &'static str, max: u32 },
    #[error("{op} on map {map} failed: {source}")]
    Map {
        op: &'static str,
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
}

impl DataplaneError {
    /// Retrying cannot help until the Service changes.
    pub fn is_permanent(&self) -> bool {
        matches!(self, DataplaneError::Unsupported(_))
    }

    /// Short, stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            DataplaneError::Unsupported(_) => "unsupported",
            DataplaneError::MapFull { .. } => "map_full",
            DataplaneError::Map { .. } => "map_syscall",
        }
    }
}

/// What the reconciler needs from a dataplane. Calls are per frontend so that a change to one
/// Service touches only that Service's state.
pub trait Dataplane {
    /// Frontends found programmed when the agent started (pinned state of a previous run).
    fn programmed_keys(&self) -> Vec<FrontendKey>;
    /// True when `key` is programmed exactly as `fe` asks.
    fn is_current(&self, key: &FrontendKey, fe: &Frontend) -> bool;
    /// Programs `key`, make-before-break: packets never see a half-written frontend.
    fn upsert(&mut self, key: &FrontendKey, fe: &Frontend) -> Result<(), DataplaneError>;
    fn remove(&mut self, key: &FrontendKey) -> Result<(), DataplaneError>;
    /// Drops state no frontend uses any more (after the first full sync). Returns how many
    /// entries went.
    fn collect_garbage(&mut self) -> Result<usize, DataplaneError>;
}
