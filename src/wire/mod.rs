//! Every byte that crosses a process boundary: today the store protocol.
//!
//! Layer: the bottom of the safe layers. Pure encoding and decoding, no I/O, no unsafe code;
//! decoding never panics on any input.

#![forbid(unsafe_code)]

pub mod descriptor;
pub mod store;
pub mod symm;
pub mod tcp;
