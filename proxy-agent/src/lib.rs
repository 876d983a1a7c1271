//! The proxy agent: sources feed a store of cluster objects, the pure model translates them into
//! this node's frontends, the reconciler diffs desired against applied, and a dataplane programs
//! the kernel.

pub mod agent;
pub mod bpffs;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod devices;
pub mod healthcheck;
pub mod http;
pub mod init;
pub mod inspect;
pub mod memory;
pub mod model;
pub mod netlink;
pub mod rules;
pub mod source;
pub mod sync;
pub mod telemetry;
pub mod trace;
