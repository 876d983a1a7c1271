//! The test lab shared by the integration tests, the demo (`cargo xtask run`) and the
//! benchmarks (`cargo xtask bench`).

pub mod apiserver;
pub mod cluster;
pub mod conformance;
pub mod connectbench;
pub mod container;
pub mod corpus;
pub mod fuzz;
pub mod lab;
pub mod modesbench;
pub mod netns;
pub mod northbench;
pub mod packet;
pub mod packet6;
pub mod require;
pub mod servers;
pub mod testrun;
