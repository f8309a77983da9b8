//! symmem's logs reach Python's `logging`, under the logger `symmem` and its children
//! (`symmem.transport.tcp`, ...), where a PyTorch user sees torch's. `SYMMEM_LOG` (tracing's
//! filter syntax, warnings by default) decides what is sent; Python's levels and handlers
//! decide what is shown.
//!
//! Events are handed to one forwarding thread over a bounded queue, and that thread calls
//! `logging` with the interpreter attached: a Rust thread that logs never waits for the GIL
//! (a Python thread holding the GIL may be waiting for it), and a full queue drops the event
//! rather than stall the thread that logged it.

use std::fmt::Write as _;
use std::sync::OnceLock;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};

/// Events waiting for the forwarding thread, at most.
const QUEUE: usize = 4096;

/// One event: Python's level number, the logger's name, the message.
type Record = (u32, String, String);

/// The forwarding layer.
struct ToPython {
    queue: OnceLock<SyncSender<Record>>,
}

impl ToPython {
    fn sender(&self) -> Option<&SyncSender<Record>> {
        if let Some(s) = self.queue.get() {
            return Some(s);
        }
        let (tx, rx) = sync_channel::<Record>(QUEUE);
        let spawned = std::thread::Builder::new().name("symmem-log".into()).spawn(move || {
            for (level, name, message) in rx {
                // After the interpreter has begun to finalize there is nobody to tell.
                let _ = Python::try_attach(|py| {
                    let logged = py
                        .import("logging")
                        .and_then(|l| l.call_method1("getLogger", (name.as_str(),)))
                        .and_then(|logger| logger.call_method1("log", (level, message.as_str())));
                    if let Err(e) = logged {
                        e.print(py);
                    }
                });
            }
        });
        if spawned.is_err() {
            return None;
        }
        let _ = self.queue.set(tx);
        self.queue.get()
    }
}

/// Collects an event's message and fields into one line.
struct Line(String);

impl Visit for Line {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.insert_str(0, value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0.insert_str(0, &format!("{value:?}"));
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ToPython {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        // Python's levels: DEBUG 10, INFO 20, WARNING 30, ERROR 40 (TRACE goes out as 5).
        let level = match *meta.level() {
            tracing::Level::ERROR => 40,
            tracing::Level::WARN => 30,
            tracing::Level::INFO => 20,
            tracing::Level::DEBUG => 10,
            tracing::Level::TRACE => 5,
        };
        let mut line = Line(String::new());
        event.record(&mut line);
        let name = meta.target().replace("::", ".");
        if let Some(tx) = self.sender() {
            match tx.try_send((level, name, line.0)) {
                Ok(()) | Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {}
            }
        }
    }
}

/// Installs the forwarding as this process's tracing subscriber, unless it has one.
pub fn install() {
    let filter = symmem::config::log_filter()
        .and_then(|f| tracing_subscriber::EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("warn"));
    let subscriber = tracing_subscriber::registry().with(filter).with(ToPython { queue: OnceLock::new() });
    let _ = tracing::subscriber::set_global_default(subscriber);
}
