//! Builds `musl/resolve.c` into a static musl binary (Debian's
//! `musl-tools`), for the resolver tests (`tests/resolvers.rs`): its path
//! is `LB_MUSL_RESOLVE` at compile time. Without `musl-gcc` nothing is
//! built and those tests say so.

use std::{env, path::PathBuf, process::Command};

fn main() {
    println!("cargo:rerun-if-changed=musl/resolve.c");
    println!("cargo:rerun-if-env-changed=PATH");
    // Built again once musl-tools is installed (Debian's path).
    println!("cargo:rerun-if-changed=/usr/bin/musl-gcc");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("resolve");
    let built = Command::new("musl-gcc")
        .args(["-static", "-O2", "-Wall", "-o"])
        .arg(&out)
        .arg("musl/resolve.c")
        .status();
    match built {
        Ok(status) if status.success() => {
            println!("cargo:rustc-env=LB_MUSL_RESOLVE={}", out.display());
        }
        Ok(status) => println!("cargo:warning=musl-gcc failed ({status}): no musl resolver"),
        // Not installed: the tests that need it say so.
        Err(_) => {}
    }
}
