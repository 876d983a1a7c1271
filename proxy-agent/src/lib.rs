//! The proxy agent: sources feed a store of cluster objects, the pure model translates them into
//! this node's frontends, the reconciler diffs desired against applied, and a dataplane programs
//! the kernel.

pub mod model;
pub mod bpffs;
pub mod dataplane;
