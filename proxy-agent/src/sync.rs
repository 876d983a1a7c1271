//! What a sync hands on: its figures (to telemetry and the log) and the state of each
//! health-check node port (to the health servers). A leaf module, so the control loop, the
//! proxiers, telemetry and the health servers share these without importing each other.

use std::time::{Duration, SystemTime};

use crate::model::ObjectKey;

/// What one sync did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SyncStats {
    pub services: usize,
    pub upserted: usize,
    pub removed: usize,
    pub unchanged: usize,
    pub failed: usize,
    pub garbage: usize,
    pub duration: Duration,
    /// This sync was the first complete one.
    pub initial: bool,
    /// `last-change-trigger-time`s of the endpoint changes this sync programmed.
    pub trigger_times: Vec<SystemTime>,
}

/// What one port reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortState {
    pub service: ObjectKey,
    pub local_endpoints: usize,
}
