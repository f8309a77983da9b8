//! Every byte that crosses a process boundary: the store protocol, the tcp transport's frames,
//! descriptors, symmetric memory's records, and the sealed records that protect links.
//!
//! Layer: the bottom of the safe layers. Pure encoding and decoding, no I/O, no unsafe code;
//! decoding never panics on any input.

#![forbid(unsafe_code)]

pub mod descriptor;
pub mod seal;
pub mod store;
pub mod symm;
pub mod tcp;
