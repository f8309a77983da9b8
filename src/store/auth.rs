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

    /// The secret in a file: its contents without surrounding whitespace. Refused, as ssh's
    /// StrictModes refuses keys, if the file is not a regular file (a symlink, a FIFO), is
    /// larger than 64 KiB, is not this user's (the effective uid), may be read or written by
    /// anyone else, or is empty. Never blocks.
    pub fn from_file(path: &Path) -> Result<Secret> {
        match Secret::open_private(rustix::fs::CWD, path, path)? {
            Some(f) => Secret::read_private(f, path),
            None => Err(Error::io(
                format!("read secret file {}", path.display()),
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )),
        }
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
    ///
    /// The key is [`Secret::from_file`]'s kind of file, and its directory must belong to this
    /// user and be writable by nobody else: another user's directory could hold a key of their
    /// choosing, or take a new one. The key is read and made through the directory checked,
    /// never by its path again, so the directory cannot be swapped in between.
    pub fn user_key() -> Result<(Secret, PathBuf)> {
        use rustix::fs::{Mode, OFlags};
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        let path = Secret::user_key_path()?;
        let (Some(dir_path), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(Error::InvalidArgument(format!("{} names no file", path.display())));
        };
        // Missing directories are made for this user only.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir_path)
            .map_err(|e| Error::io(format!("create {}", dir_path.display()), e))?;
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let dir = std::fs::File::from(
            rustix::fs::open(dir_path, flags, Mode::empty())
                .map_err(|e| Error::io(format!("open {}", dir_path.display()), e.into()))?,
        );
        let meta = dir.metadata().map_err(|e| Error::io(format!("stat {}", dir_path.display()), e))?;
        let me = rustix::process::geteuid().as_raw();
        if meta.uid() != me {
            return Err(Secret::bad(
                dir_path,
                format!("it is owned by uid {}, not by this user (uid {me})", meta.uid()),
            ));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(Secret::bad(
                dir_path,
                format!("it has mode {:o}: it is writable by others (chmod go-w)", meta.mode() & 0o777),
            ));
        }
        if let Some(f) = Secret::open_private(&dir, Path::new(name), &path)? {
            return Ok((Secret::read_private(f, &path)?, path));
        }
        // Written under a private name, then linked into place (link never replaces a file):
        // two launchers racing on a shared home directory both end up reading the one that won.
        let tmp = format!(".secret.{}.{:016x}", std::process::id(), u64::from_le_bytes(nonce_8()));
        let create = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let shown = dir_path.join(&tmp);
        let mut f = std::fs::File::from(
            rustix::fs::openat(&dir, tmp.as_str(), create, Mode::from_raw_mode(0o600))
                .map_err(|e| Error::io(format!("create {}", shown.display()), e.into()))?,
        );
        let key = Secret::random()?;
        let written = std::io::Write::write_all(&mut f, &key.0).and_then(|()| f.sync_all());
        drop(f);
        let linked = written.and_then(|()| {
            rustix::fs::linkat(&dir, tmp.as_str(), &dir, name, rustix::fs::AtFlags::empty()).map_err(Into::into)
        });
        let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), rustix::fs::AtFlags::empty());
        match linked {
            Ok(()) => tracing::info!("created the user's symmem key at {}", path.display()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io(format!("create {}", path.display()), e)),
        }
        match Secret::open_private(&dir, Path::new(name), &path)? {
            Some(f) => Ok((Secret::read_private(f, &path)?, path)),
            None => Err(Error::io(
                format!("read secret file {}", path.display()),
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )),
        }
    }

    /// The largest secret file read.
    const MAX_FILE: u64 = 64 << 10;

    /// Opens secret file `name` in `dir` (`shown` in messages) for reading, if it exists, and
    /// checks it is one [`Secret::from_file`] accepts: never through a symlink, never blocking
    /// (a FIFO), and only a regular file of this user's that nobody else may read or write.
    fn open_private(dir: impl std::os::fd::AsFd, name: &Path, shown: &Path) -> Result<Option<std::fs::File>> {
        use rustix::fs::{Mode, OFlags};
        use std::os::unix::fs::MetadataExt;
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
        let f = match rustix::fs::openat(dir, name, flags, Mode::empty()) {
            Ok(fd) => std::fs::File::from(fd),
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(rustix::io::Errno::LOOP) => {
                return Err(Secret::bad(shown, "it is a symbolic link: name the file itself".into()));
            }
            Err(e) => return Err(Error::io(format!("read secret file {}", shown.display()), e.into())),
        };
        let meta = f.metadata().map_err(|e| Error::io(format!("stat {}", shown.display()), e))?;
        let me = rustix::process::geteuid().as_raw();
        if !meta.is_file() {
            use std::os::unix::fs::FileTypeExt;
            let t = meta.file_type();
            let kind = if t.is_dir() {
                "a directory"
            } else if t.is_fifo() {
                "a FIFO"
            } else if t.is_socket() {
                "a socket"
            } else {
                "a device"
            };
            return Err(Secret::bad(shown, format!("it is not a regular file but {kind}")));
        }
        if meta.uid() != me {
            return Err(Secret::bad(shown, format!("it is owned by uid {}, not by this user (uid {me})", meta.uid())));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(Error::InvalidArgument(format!(
                "secret file {} has mode {:o}: it must be readable by its owner only (chmod 600)",
                shown.display(),
                meta.mode() & 0o777
            )));
        }
        Ok(Some(f))
    }

    /// Reads a secret file [`Secret::open_private`] opened: at most [`Secret::MAX_FILE`] bytes.
    fn read_private(f: std::fs::File, shown: &Path) -> Result<Secret> {
        use std::io::Read;
        let mut text = Vec::new();
        f.take(Secret::MAX_FILE + 1)
            .read_to_end(&mut text)
            .map_err(|e| Error::io(format!("read secret file {}", shown.display()), e))?;
        if text.len() as u64 > Secret::MAX_FILE {
            return Err(Secret::bad(shown, format!("it is larger than {} bytes", Secret::MAX_FILE)));
        }
        Secret::new(text.trim_ascii().to_vec())
            .ok_or_else(|| Error::InvalidArgument(format!("secret file {} is empty", shown.display())))
    }

    /// A refusal of `path` as a secret file or its directory, saying why (as ssh's "Bad owner or
    /// permissions on ...").
    fn bad(path: &Path, why: String) -> Error {
        Error::InvalidArgument(format!("bad owner or permissions on {}: {why}", path.display()))
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

    /// Key material for one connection whose handshake was `transcript`
    /// ([`crate::wire::seal::expand_secret`]; `label` names the protocol and the use).
    pub(crate) fn expand(&self, label: &[u8], transcript: &[u8], out: &mut [u8]) {
        crate::wire::seal::expand_secret(&self.0, label, transcript, out)
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
        // Never through a symlink, never from anything but a regular file, never blocking,
        // never more than 64 KiB; each refusal names the file and why.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        let e = Secret::from_file(&link).unwrap_err().to_string();
        assert!(e.contains(link.to_str().unwrap()) && e.contains("symbolic link"), "{e}");
        let fifo = dir.path().join("fifo");
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, rustix::fs::FileType::Fifo, rustix::fs::Mode::RUSR, 0).unwrap();
        let e = Secret::from_file(&fifo).unwrap_err().to_string();
        assert!(e.contains("fifo") && e.contains("not a regular file"), "{e}");
        let e = Secret::from_file(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::write(&f, vec![b'k'; 64 << 10]).unwrap();
        assert!(Secret::from_file(&f).is_ok());
        std::fs::write(&f, vec![b'k'; (64 << 10) + 1]).unwrap();
        let e = Secret::from_file(&f).unwrap_err().to_string();
        assert!(e.contains("larger than 65536 bytes"), "{e}");
        std::fs::write(&f, " \n").unwrap();
        assert!(Secret::from_file(&f).unwrap_err().to_string().contains("is empty"));
        let e = Secret::from_file(&dir.path().join("missing")).unwrap_err().to_string();
        assert!(e.contains("missing"), "{e}");
    }
}
