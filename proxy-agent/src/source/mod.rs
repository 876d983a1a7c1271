//! Where cluster objects come from. Every source emits the same `model::store::Event`s.

pub mod kube;
pub mod manifests;
