//! Empty library target: it only exists so that `lb-user` can name this
//! crate as a build-dependency and be rebuilt when it changes. The programs
//! are in `main.rs`, built for the BPF target by `lb-user/build.rs`.
#![no_std]
