//! Where cluster objects come from. Every source emits the same `model::store::Event`s.

pub mod manifests;
pub mod kube;
