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

use std::path::{Path, PathBuf};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::config::{self, env};
use crate::error::{Error, Result};
use crate::wire::store::{NONCE_LEN, PROOF_LEN};

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
        config::store_secret().and_then(Secret::new)
    }

    /// The job's secret for links between ranks: `SYMMEM_JOB_SECRET`, else
    /// `SYMMEM_STORE_SECRET`, if either is set and not empty.
    pub fn job_from_env() -> Option<Secret> {
        config::job_secret().and_then(Secret::new).or_else(Secret::from_env)
    }

    /// 32 fresh random bytes, as 64 hexadecimal characters (so it travels in environment
    /// variables and files unchanged).
    pub fn random() -> Result<Secret> {
        let bytes = nonce().map_err(|e| Error::io("draw a random secret", e))?;
        Ok(Secret(bytes.iter().map(|b| format!("{b:02x}")).collect::<String>().into_bytes()))
    }

    /// The secret in a file: its contents without surrounding whitespace. Refused when the file
    /// is readable or writable by anyone but its owner (as ssh refuses such keys), or empty.
    pub fn from_file(path: &Path) -> Result<Secret> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).map_err(|e| Error::io(format!("read secret file {}", path.display()), e))?;
        if meta.mode() & 0o077 != 0 {
            return Err(Error::InvalidArgument(format!(
                "secret file {} has mode {:o}: it must be readable by its owner only (chmod 600)",
                path.display(),
                meta.mode() & 0o777
            )));
        }
        let text = std::fs::read(path).map_err(|e| Error::io(format!("read secret file {}", path.display()), e))?;
        Secret::new(text.trim_ascii().to_vec())
            .ok_or_else(|| Error::InvalidArgument(format!("secret file {} is empty", path.display())))
    }

    /// Where this user's key lives: `$XDG_CONFIG_HOME/symmem/secret`, by default
    /// `~/.config/symmem/secret`.
    pub fn user_key_path() -> Result<PathBuf> {
        let config = config::config_home().ok_or_else(|| Error::Env {
            var: env::HOME,
            reason: "not set, so there is no place for the user's key".into(),
        })?;
        Ok(config.join("symmem").join("secret"))
    }

    /// This user's key ([`Secret::user_key_path`]), made on first use (mode 0600, in a 0700
    /// directory), like Erlang's cookie: the hosts of a job that share a home directory share
    /// it with no setting at all. Returns the key and where it is.
    pub fn user_key() -> Result<(Secret, PathBuf)> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let path = Secret::user_key_path()?;
        if !path.exists() {
            let dir = path.parent().unwrap_or(Path::new("."));
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
            // Written under a private name, then linked into place: two launchers racing on a
            // shared home directory both end up reading the one that won.
            let tmp = dir.join(format!(".secret.{}.{}", std::process::id(), u64::from_le_bytes(nonce_8())));
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| Error::io(format!("create {}", tmp.display()), e))?;
            let key = Secret::random()?;
            std::io::Write::write_all(&mut f, &key.0).map_err(|e| Error::io(format!("write {}", tmp.display()), e))?;
            drop(f);
            let linked = std::fs::hard_link(&tmp, &path);
            let _ = std::fs::remove_file(&tmp);
            match linked {
                Ok(()) => tracing::info!("created the user's symmem key at {}", path.display()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::io(format!("create {}", path.display()), e)),
            }
        }
        Ok((Secret::from_file(&path)?, path))
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

    /// An HMAC-SHA256 of `parts` under this secret, for a protocol whose messages carry
    /// `label` (so a proof made for one purpose is never valid for another).
    pub(crate) fn sign(&self, label: &[u8], parts: &[&[u8]]) -> [u8; PROOF_LEN] {
        let mut mac = self.mac();
        mac.update(label);
        for p in parts {
            mac.update(p);
        }
        mac.finalize().into_bytes().into()
    }

    /// Checks a [`Secret::sign`] proof in constant time.
    pub(crate) fn check(&self, label: &[u8], parts: &[&[u8]], proof: &[u8]) -> bool {
        let mut mac = self.mac();
        mac.update(label);
        for p in parts {
            mac.update(p);
        }
        mac.verify_slice(proof).is_ok()
    }

    /// The sealed-record keys of one connection whose handshake was `transcript`, for `side`
    /// ([`crate::wire::seal::derive`]; `label` names the protocol).
    pub(crate) fn link_keys(
        &self,
        label: &[u8],
        transcript: &[u8],
        side: crate::wire::seal::Side,
    ) -> crate::wire::seal::Keys {
        crate::wire::seal::derive(&self.0, label, transcript, side)
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

fn nonce_8() -> [u8; 8] {
    let mut n = [0u8; 8];
    // A unique-enough file name; a failure leaves zeros, and create_new then catches a clash.
    let _ = getrandom::fill(&mut n);
    n
}

/// Where a secret came from, for messages (never the secret itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretSource {
    /// `SYMMEM_STORE_SECRET`.
    Env,
    /// A file named on the command line.
    File(PathBuf),
    /// This user's key ([`Secret::user_key`]).
    UserKey(PathBuf),
    /// Drawn at random for one job.
    Random,
}

impl std::fmt::Display for SecretSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretSource::Env => f.write_str(env::STORE_SECRET),
            SecretSource::File(p) => write!(f, "the file {}", p.display()),
            SecretSource::UserKey(p) => write!(f, "this user's key {}", p.display()),
            SecretSource::Random => f.write_str("a random secret for this job"),
        }
    }
}

impl Secret {
    /// The secret of a store or a job spanning hosts: the file given, else
    /// `SYMMEM_STORE_SECRET`, else this user's key (made on first use). Every host of a job
    /// must resolve the same one: a shared home directory does it with no setting.
    pub fn resolve(file: Option<&Path>) -> Result<(Secret, SecretSource)> {
        if let Some(p) = file {
            return Ok((Secret::from_file(p)?, SecretSource::File(p.to_path_buf())));
        }
        if let Some(s) = Secret::from_env() {
            return Ok((s, SecretSource::Env));
        }
        let (s, p) = Secret::user_key()?;
        Ok((s, SecretSource::UserKey(p)))
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

    #[test]
    fn secret_files_must_be_private_and_the_user_key_is_made_once() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("s");
        std::fs::write(&f, "  hunter2\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Secret::from_file(&f).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Secret::from_file(&f).unwrap() == Secret::new("hunter2").unwrap());
        assert_ne!(Secret::random().unwrap().0, Secret::random().unwrap().0);
        assert_eq!(Secret::random().unwrap().0.len(), 64);
    }
}
