//! Link flags for the eBPF object.
//!
//! bpf-linker passes `--bpf-expand-memcpy-in-order` to LLVM by default,
//! which stops LLVM from expanding memset and memcpy of a known size into
//! stores: every key's 3 bytes of padding and every zeroed struct became
//! a call to a byte-at-a-time `memset` subprogram, on every packet (an
//! established flow's packet: 180 ns with them, 160 ns without).
//! Expanded, they are a few stores. (The in-order expansion exists for
//! JITs that pattern-match memcpy; the kernel's do not.)
fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-link-arg-bins=--disable-expand-memcpy-in-order");
}
