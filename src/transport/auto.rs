//! The `auto` backend: `shm` when both endpoints are on one host and the kernel lets them share
//! memory, `tcp` otherwise.
//!
//! `bind` binds both and returns `auto://?shm=<url>&tcp=<url>` (each base64url); `connect`
//! compares the peer's host with this one, tries `shm`, and falls back to `tcp` with the
//! reason kept for [`Backend::describe`]. Registrations are exposed through both, so the peer
//! reaches them whichever way it connected.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::shm::{self, ShmBackend};
use super::tcp::TcpBackend;
use super::{Backend, Options, Registration, Request};
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Shm,
    Tcp,
}

/// The `auto` backend.
pub struct AutoBackend {
    shm: Option<ShmBackend>,
    tcp: TcpBackend,
    chosen: Mutex<Option<Path>>,
    why_not_shm: Mutex<Option<String>>,
}

impl AutoBackend {
    /// A backend; options go to both (`timeout`) or to tcp (`flows`, `host`, `chunk_size`).
    pub fn new(options: &Options) -> Result<AutoBackend> {
        let shm_opts: Options =
            options.iter().filter(|(k, _)| k.as_str() == "timeout").map(|(k, v)| (k.clone(), v.clone())).collect();
        let (shm, why) = match ShmBackend::new(&shm_opts) {
            Ok(s) => (Some(s), None),
            Err(e) => (None, Some(e.to_string())),
        };
        Ok(AutoBackend { shm, tcp: TcpBackend::new(options)?, chosen: Mutex::new(None), why_not_shm: Mutex::new(why) })
    }

    fn chosen(&self) -> Option<Path> {
        *self.chosen.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn decode(v: &str) -> Option<Vec<u8>> {
    URL_SAFE_NO_PAD.decode(v).ok()
}

impl Backend for AutoBackend {
    fn name(&self) -> &str {
        "auto"
    }

    fn bind(&self, timeout: Duration) -> Result<Vec<u8>> {
        let tcp = self.tcp.bind(timeout)?;
        let mut url = format!("auto://?tcp={}", URL_SAFE_NO_PAD.encode(tcp));
        if let Some(s) = &self.shm {
            url.push_str(&format!("&shm={}", URL_SAFE_NO_PAD.encode(s.bind(timeout)?)));
        }
        Ok(url.into_bytes())
    }

    fn connect(&self, url: &[u8], timeout: Duration) -> Result<()> {
        let bad = || Error::InvalidArgument(format!("invalid auto transport URL {:?}", String::from_utf8_lossy(url)));
        let s = std::str::from_utf8(url).map_err(|_| bad())?;
        let query = s.strip_prefix("auto://?").ok_or_else(bad)?;
        let (mut tcp, mut shm_url) = (None, None);
        for kv in query.split('&') {
            match kv.split_once('=').ok_or_else(bad)? {
                ("tcp", v) => tcp = Some(decode(v).ok_or_else(bad)?),
                ("shm", v) => shm_url = Some(decode(v).ok_or_else(bad)?),
                _ => return Err(bad()),
            }
        }
        let tcp = tcp.ok_or_else(bad)?;
        if let (Some(shm_url), Some(shm_backend)) = (shm_url, &self.shm) {
            let same_host = shm::url_host(&shm_url).is_some_and(|h| h == crate::topo::this_host());
            if same_host {
                match shm_backend.connect(&shm_url, timeout) {
                    Ok(()) => {
                        *self.chosen.lock().unwrap_or_else(|p| p.into_inner()) = Some(Path::Shm);
                        return Ok(());
                    }
                    Err(e) => {
                        tracing::info!("auto transport: shm refused, using tcp: {e}");
                        *self.why_not_shm.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                    }
                }
            } else {
                *self.why_not_shm.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some("the peer is on another host".into());
            }
        }
        self.tcp.connect(&tcp, timeout)?;
        *self.chosen.lock().unwrap_or_else(|p| p.into_inner()) = Some(Path::Tcp);
        Ok(())
    }

    fn connected(&self) -> bool {
        match self.chosen() {
            Some(Path::Shm) => self.shm.as_ref().is_some_and(|s| s.connected()),
            Some(Path::Tcp) => self.tcp.connected(),
            None => false,
        }
    }

    fn expose(&self, reg: &Arc<Registration>) -> Result<()> {
        if let Some(s) = &self.shm {
            s.expose(reg)?;
        }
        self.tcp.expose(reg)
    }

    fn withdraw(&self, reg: &Registration) {
        if let Some(s) = &self.shm {
            s.withdraw(reg);
        }
        self.tcp.withdraw(reg);
    }

    fn submit(&self, req: Request) -> Result<()> {
        match (self.chosen(), &self.shm) {
            (Some(Path::Shm), Some(s)) => s.submit(req),
            (Some(Path::Tcp), _) => self.tcp.submit(req),
            _ => Err(Error::InvalidArgument("auto transport is not connected".into())),
        }
    }

    fn shutdown(&self) {
        if let Some(s) = &self.shm {
            s.shutdown();
        }
        self.tcp.shutdown();
    }

    fn default_timeout(&self) -> Duration {
        self.tcp.default_timeout()
    }

    fn disconnect_reason(&self) -> Option<String> {
        match (self.chosen(), &self.shm) {
            (Some(Path::Shm), Some(s)) => s.disconnect_reason(),
            (Some(Path::Tcp), _) => self.tcp.disconnect_reason(),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        match self.chosen() {
            Some(Path::Shm) => "auto via shm".into(),
            Some(Path::Tcp) => format!(
                "auto via tcp ({})",
                self.why_not_shm
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
                    .unwrap_or_else(|| "shm unavailable".into())
            ),
            None => "auto (not connected)".into(),
        }
    }
}
