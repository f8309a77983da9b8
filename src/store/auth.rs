//! Shared-secret authentication for the store: a mutual HMAC-SHA256 challenge–response.
//!
//! ```text
//!   client                                        server
//!   VALIDATE magic                     ──▶
//!   AUTH_BEGIN client_nonce            ──▶
//!                                      ◀──  server_nonce, HMAC(secret, "server" ‖ cn ‖ sn)
//!   (client checks the server's proof)
//!   AUTH_PROOF HMAC(secret, "client" ‖ cn ‖ sn) ──▶
//!                                      ◀──  0x00, or the connection closes
//! ```
//!
//! Both nonces are 32 random bytes, so neither proof can be replayed on another connection, and
//! the secret itself never crosses the wire. Until the proof is accepted the server answers
//! nothing else: a client without the secret can read or write no key.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::wire::store::{NONCE_LEN, PROOF_LEN};

/// The environment variable that holds the store's shared secret.
pub const SECRET_ENV: &str = "SYMMEM_STORE_SECRET";

/// A shared secret. Its `Debug` form never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret from bytes; an empty secret is refused, since it would authenticate anyone.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<Secret> {
        let bytes = bytes.into();
        (!bytes.is_empty()).then_some(Secret(bytes))
    }

    /// The secret in `SYMMEM_STORE_SECRET`, if that is set and not empty.
    pub fn from_env() -> Option<Secret> {
        std::env::var_os(SECRET_ENV).and_then(|v| Secret::new(v.into_encoded_bytes()))
    }

    /// The secret as an environment-variable value, to hand to a launched rank.
    pub(crate) fn expose_os(&self) -> std::ffi::OsString {
        use std::os::unix::ffi::OsStringExt;
        std::ffi::OsString::from_vec(self.0.clone())
    }

    /// The proof that the holder of this secret is `role` on the connection with these nonces.
    pub(crate) fn proof(&self, role: Role, client_nonce: &[u8], server_nonce: &[u8]) -> [u8; PROOF_LEN] {
        let mut mac = self.mac();
        mac.update(role.label());
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac.finalize().into_bytes().into()
    }

    /// Checks a proof in constant time.
    pub(crate) fn verify(&self, role: Role, client_nonce: &[u8], server_nonce: &[u8], proof: &[u8]) -> bool {
        let mut mac = self.mac();
        mac.update(role.label());
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac.verify_slice(proof).is_ok()
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes keys of any length, so this cannot fail.
        <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0).expect("hmac accepts any key length")
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Which side a proof speaks for, so a server's proof can never be replayed as a client's.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Role {
    Client,
    Server,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Client => b"symmem-store-v1 client",
            Role::Server => b"symmem-store-v1 server",
        }
    }
}

/// 32 fresh random bytes.
pub(crate) fn nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(std::io::Error::other)?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_role_secret_and_nonces() {
        let s = Secret::new("hunter2").unwrap();
        let (c, n) = ([1u8; 32], [2u8; 32]);
        let p = s.proof(Role::Client, &c, &n);
        assert!(s.verify(Role::Client, &c, &n, &p));
        assert!(!s.verify(Role::Server, &c, &n, &p), "a client proof must not pass as a server's");
        assert!(!s.verify(Role::Client, &n, &c, &p), "nonces are bound");
        assert!(!Secret::new("other").unwrap().verify(Role::Client, &c, &n, &p));
        assert!(Secret::new("").is_none());
        assert_eq!(format!("{s:?}"), "Secret(..)");
    }
}
