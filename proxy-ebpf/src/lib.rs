// The programs are in the `proxy` binary (src/main.rs), built for the bpf target by
// proxy-agent's build script. This empty library lets proxy-agent name this crate as a
// build-dependency so cargo rebuilds the object when the programs change.
#![no_std]
