//! UCX's UCP API, loaded at run time from the system's `libucp.so.0` (Debian's libucx0, 1.13):
//! a machine without UCX builds and runs, and the `ucx` backend reports itself unavailable.
//!
//! A thin binding of the calls the `ucx` transport uses: a context, a worker with its wake-up
//! descriptor, endpoints with peer error handling, active messages (send, receive handlers,
//! rendezvous data) and request completion. The parameter structs are passed as zeroed byte
//! blocks of UCX 1.13's sizes with the fields we set at their offsets (checked against the C
//! headers by `ucx_layout_matches_the_headers`, where the headers are installed); UCX reads
//! only the fields a struct's mask names.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

/// `ucs_status_t`.
pub type Status = i32;
/// Success.
pub const UCS_OK: Status = 0;
/// An operation still in progress.
pub const UCS_INPROGRESS: Status = 1;
/// A resource is busy (arming a worker with events pending).
pub const UCS_ERR_BUSY: Status = -15;

const UCP_API_MAJOR: c_uint = 1;
const UCP_API_MINOR: c_uint = 13;

const UCP_PARAM_FIELD_FEATURES: u64 = 1;
/// Active messages.
pub const UCP_FEATURE_AM: u64 = 64;
// Not UCP_FEATURE_RMA: it installs UCP's software RMA handlers, which write wherever a
// connected peer's PUT names, and active-message rendezvous does not need it (UCP selects
// its zero-copy lanes for UCP_FEATURE_AM alone).
/// Wake-up through a file descriptor.
pub const UCP_FEATURE_WAKEUP: u64 = 16;

const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1;
/// `UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER`.
const UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER: u64 = 8;
const UCS_THREAD_MODE_SERIALIZED: u32 = 1;

const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1;
const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 2;
const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 4;
const UCP_ERR_HANDLING_MODE_PEER: u32 = 1;

const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 2;
const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 4;
const UCP_OP_ATTR_FIELD_FLAGS: u32 = 16;
const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1;
/// `ucp_am_send_nbx` flag: the receiver gets an endpoint to reply on.
pub const UCP_AM_SEND_FLAG_REPLY: u32 = 1;
/// `ucp_am_send_nbx` flag: eager protocols only (no rendezvous).
pub const UCP_AM_SEND_FLAG_EAGER: u32 = 2;

const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1;
const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 4;
const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 8;

/// `recv_attr` bit: `param.reply_ep` is valid.
pub const UCP_AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1;
/// `recv_attr` bit: the data is a rendezvous descriptor for `ucp_am_recv_data_nbx`.
pub const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;

// Sizes and offsets of UCX 1.13's parameter structs (x86-64).
const PARAMS_SIZE: usize = 80;
const WORKER_PARAMS_SIZE: usize = 200;
const EP_PARAMS_SIZE: usize = 104;
const REQUEST_PARAM_SIZE: usize = 72;
const AM_HANDLER_PARAM_SIZE: usize = 32;

/// Opaque UCX handles.
pub type Handle = *mut c_void;

/// `ucp_send_nbx_callback_t`.
pub type SendCallback = unsafe extern "C" fn(request: *mut c_void, status: Status, user_data: *mut c_void);
/// `ucp_am_recv_data_nbx_callback_t`.
pub type RecvDataCallback =
    unsafe extern "C" fn(request: *mut c_void, status: Status, length: usize, user_data: *mut c_void);
/// `ucp_err_handler_cb_t`.
pub type ErrCallback = unsafe extern "C" fn(arg: *mut c_void, ep: Handle, status: Status);
/// `ucp_am_recv_callback_t`.
pub type AmCallback = unsafe extern "C" fn(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const AmRecvParam,
) -> Status;

/// `ucp_am_recv_param_t`.
#[repr(C)]
pub struct AmRecvParam {
    /// Which attributes and flags hold.
    pub recv_attr: u64,
    /// The endpoint to reply on, with `UCP_AM_RECV_ATTR_FIELD_REPLY_EP`.
    pub reply_ep: Handle,
}

type StatusPtr = *mut c_void;

/// The entry points, resolved once.
struct Api {
    config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut Handle) -> Status,
    config_modify: unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> Status,
    config_release: unsafe extern "C" fn(Handle),
    #[cfg_attr(not(test), allow(dead_code, reason = "read by tests only (`config_text`)"))]
    config_print: unsafe extern "C" fn(Handle, *mut libc::FILE, *const c_char, c_int),
    context_print_info: unsafe extern "C" fn(Handle, *mut libc::FILE),
    #[cfg_attr(not(test), allow(dead_code, reason = "read by tests only (an endpoint's protocols)"))]
    ep_print_info: unsafe extern "C" fn(Handle, *mut libc::FILE),
    init_version: unsafe extern "C" fn(c_uint, c_uint, *const u8, Handle, *mut Handle) -> Status,
    worker_create: unsafe extern "C" fn(Handle, *const u8, *mut Handle) -> Status,
    worker_destroy: unsafe extern "C" fn(Handle),
    worker_get_address: unsafe extern "C" fn(Handle, *mut *mut c_void, *mut usize) -> Status,
    worker_release_address: unsafe extern "C" fn(Handle, *mut c_void),
    worker_query: unsafe extern "C" fn(Handle, *mut u8) -> Status,
    worker_progress: unsafe extern "C" fn(Handle) -> c_uint,
    worker_get_efd: unsafe extern "C" fn(Handle, *mut c_int) -> Status,
    worker_arm: unsafe extern "C" fn(Handle) -> Status,
    worker_set_am_recv_handler: unsafe extern "C" fn(Handle, *const u8) -> Status,
    ep_create: unsafe extern "C" fn(Handle, *const u8, *mut Handle) -> Status,
    ep_close_nbx: unsafe extern "C" fn(Handle, *const u8) -> StatusPtr,
    am_send_nbx:
        unsafe extern "C" fn(Handle, c_uint, *const c_void, usize, *const c_void, usize, *const u8) -> StatusPtr,
    am_recv_data_nbx: unsafe extern "C" fn(Handle, *mut c_void, *mut c_void, usize, *const u8) -> StatusPtr,
    am_data_release: unsafe extern "C" fn(Handle, *mut c_void),
    request_check_status: unsafe extern "C" fn(*mut c_void) -> Status,
    request_cancel: unsafe extern "C" fn(Handle, *mut c_void),
    request_free: unsafe extern "C" fn(*mut c_void),
    status_string: unsafe extern "C" fn(Status) -> *const c_char,
    version_string: unsafe extern "C" fn() -> *const c_char,
    _ucs: libloading::Library,
    _ucp: libloading::Library,
}

fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Api, String> {
    // SAFETY: loading UCX runs its library constructors, which only initialize UCX's own
    // state; the libraries stay loaded for the life of the process (they live in `API`).
    let ucp =
        unsafe { libloading::Library::new("libucp.so.0") }.map_err(|e| format!("libucp.so.0 cannot be loaded: {e}"))?;
    // SAFETY: as above; libucs is a dependency of libucp, already loaded by it.
    let ucs = unsafe { libloading::Library::new("libucs.so.0") }.map_err(|e| format!("libucs.so.0: {e}"))?;
    macro_rules! sym {
        ($lib:expr, $name:literal) => {
            // SAFETY: the symbol is UCX 1.13's function of that name, and the field's type
            // is its C signature (ucp.h); the pointer stays valid while the library is loaded,
            // which is for the life of the process.
            *unsafe { $lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| format!("UCX lacks {}: {e}", $name))?
        };
    }
    Ok(Api {
        config_read: sym!(ucp, "ucp_config_read"),
        config_modify: sym!(ucp, "ucp_config_modify"),
        config_release: sym!(ucp, "ucp_config_release"),
        config_print: sym!(ucp, "ucp_config_print"),
        context_print_info: sym!(ucp, "ucp_context_print_info"),
        ep_print_info: sym!(ucp, "ucp_ep_print_info"),
        init_version: sym!(ucp, "ucp_init_version"),
        worker_create: sym!(ucp, "ucp_worker_create"),
        worker_destroy: sym!(ucp, "ucp_worker_destroy"),
        worker_get_address: sym!(ucp, "ucp_worker_get_address"),
        worker_release_address: sym!(ucp, "ucp_worker_release_address"),
        worker_query: sym!(ucp, "ucp_worker_query"),
        worker_progress: sym!(ucp, "ucp_worker_progress"),
        worker_get_efd: sym!(ucp, "ucp_worker_get_efd"),
        worker_arm: sym!(ucp, "ucp_worker_arm"),
        worker_set_am_recv_handler: sym!(ucp, "ucp_worker_set_am_recv_handler"),
        ep_create: sym!(ucp, "ucp_ep_create"),
        ep_close_nbx: sym!(ucp, "ucp_ep_close_nbx"),
        am_send_nbx: sym!(ucp, "ucp_am_send_nbx"),
        am_recv_data_nbx: sym!(ucp, "ucp_am_recv_data_nbx"),
        am_data_release: sym!(ucp, "ucp_am_data_release"),
        request_check_status: sym!(ucp, "ucp_request_check_status"),
        request_cancel: sym!(ucp, "ucp_request_cancel"),
        request_free: sym!(ucp, "ucp_request_free"),
        status_string: sym!(ucs, "ucs_status_string"),
        version_string: sym!(ucp, "ucp_get_version_string"),
        _ucs: ucs,
        _ucp: ucp,
    })
}

/// Whether UCX can be used here (with the transports the environment names), or why not.
pub fn available() -> Result<(), String> {
    context(Tls::Configured).map(|_| ())
}

/// The loaded UCX's version (e.g. "1.13.1"), or why UCX cannot be used.
pub fn version() -> Result<String, String> {
    let a = api()?;
    // SAFETY: ucp_get_version_string returns a static NUL-terminated string.
    Ok(unsafe { CStr::from_ptr((a.version_string)()) }.to_string_lossy().into_owned())
}

/// UCX's name for a status.
pub fn status_string(s: Status) -> String {
    match api() {
        // SAFETY: ucs_status_string returns a static NUL-terminated string for any value.
        Ok(a) => unsafe { CStr::from_ptr((a.status_string)(s)) }.to_string_lossy().into_owned(),
        Err(_) => format!("UCX status {s}"),
    }
}

/// A zeroed parameter block with `u64`/`u32`/pointer fields set at byte offsets.
struct Params<const N: usize>([u64; N]);

impl<const N: usize> Params<N> {
    fn new() -> Self {
        Params([0; N])
    }
    fn set64(&mut self, at: usize, v: u64) -> &mut Self {
        assert!(at.is_multiple_of(8) && at / 8 < N);
        self.0[at / 8] = v;
        self
    }
    fn set32(&mut self, at: usize, v: u32) -> &mut Self {
        assert!(at.is_multiple_of(4) && at / 8 < N);
        let w = &mut self.0[at / 8];
        // Little-endian: the low half is the lower address.
        if at.is_multiple_of(8) {
            *w = (*w & !0xffff_ffff) | u64::from(v);
        } else {
            *w = (*w & 0xffff_ffff) | (u64::from(v) << 32);
        }
        self
    }
    fn ptr(&self) -> *const u8 {
        self.0.as_ptr().cast()
    }
}

/// A `ucp_request_param_t` with a callback and user data (and flags).
fn request_param(cb: Option<usize>, user_data: usize, flags: u32) -> Params<{ REQUEST_PARAM_SIZE / 8 }> {
    let mut p = Params::new();
    let mut mask = 0;
    if let Some(cb) = cb {
        mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        p.set64(16, cb as u64).set64(32, user_data as u64);
    }
    if flags != 0 {
        mask |= UCP_OP_ATTR_FIELD_FLAGS;
        p.set32(4, flags);
    }
    p.set32(0, mask);
    p
}

/// What a non-blocking call returned: done now, a request to wait for, or an error.
#[derive(Debug)]
pub enum Started {
    /// Completed immediately (no callback will run).
    Done,
    /// In progress: the callback runs on completion; the request is freed there.
    Pending(*mut c_void),
    /// Failed immediately (no callback will run).
    Failed(Status),
}

fn started(p: StatusPtr) -> Started {
    let v = p as isize;
    if v == 0 {
        Started::Done
    } else if (-100..0).contains(&v) {
        Started::Failed(v as Status)
    } else {
        Started::Pending(p)
    }
}

/// Which of UCX's transports a context may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tls {
    /// Those the `UCX_*` environment names (`UCX_TLS`, `UCX_NET_DEVICES`): the user's choice,
    /// taken when they ask for `ucx` by name.
    Configured,
    /// `UCX_TLS` set to this value instead (the caller's policy: symmem leaves UCX's tcp out
    /// where it picks UCX by itself).
    Set(&'static str),
}

/// A UCX context (features: active messages and wake-up), one per [`Tls`] for the life of the
/// process; `UCX_*` environment variables configure it.
pub struct Context(Handle);

// SAFETY: a UCP context is thread-safe for the calls made on it here (worker creation is
// serialized by the caller, which makes one worker per transport from its own thread).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

fn context(tls: Tls) -> Result<&'static Context, String> {
    static CONFIGURED: OnceLock<Result<Context, String>> = OnceLock::new();
    // One per value asked for (a process asks for one), kept for the life of the process.
    static SET: std::sync::Mutex<Vec<(&'static str, &'static Result<Context, String>)>> =
        std::sync::Mutex::new(Vec::new());
    match tls {
        Tls::Configured => CONFIGURED.get_or_init(|| new_context(tls)).as_ref().map_err(Clone::clone),
        Tls::Set(v) => {
            let mut set = SET.lock().unwrap_or_else(|p| p.into_inner());
            let made = match set.iter().find(|(k, _)| *k == v) {
                Some((_, made)) => *made,
                None => {
                    let made: &'static Result<Context, String> = Box::leak(Box::new(new_context(tls)));
                    set.push((v, made));
                    made
                }
            };
            made.as_ref().map_err(Clone::clone)
        }
    }
}

/// UCX's tcp segments as symmem sets them ([`set_tcp_segments`]): sending and receiving. UCX's
/// (8 KiB, 64 KiB) send a message of more than 8 KiB as 8 KiB fragments that the receiver
/// reassembles with a copy, and symmem sends up to 64 KiB eagerly (its rendezvous messages too
/// go whole). Over UCX's tcp, `bench/ab_builds.py` both ways round: a 1 MiB read 0.69x and
/// 0.75x of the time, 2 ranks on 2 played hosts all-reduce 4 MiB 0.64x and 0.71x, 16 MiB 0.69x
/// and 0.74x, 4 ranks all-to-all 16 MiB 0.82x and 0.81x; 8 bytes unchanged. Named as UCX's tcp
/// transport names its fields (`ucp_config_modify` hands names it does not know to the
/// transports, matched without their `TCP_` prefix); no other transport of UCX 1.13 has
/// fields of these names (its shared-memory and verbs ones have `SEG_SIZE`).
const TCP_SEGMENTS: [(&std::ffi::CStr, &std::ffi::CStr); 2] = [(c"TX_SEG_SIZE", c"64K"), (c"RX_SEG_SIZE", c"256K")];

/// Whether contexts made from now on get [`TCP_SEGMENTS`] (the default).
static SETS_TCP_SEGMENTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether contexts made from now on set UCX's tcp segments to symmem's ([`TCP_SEGMENTS`]) or
/// leave them to UCX's configuration (the caller's policy: the user set either). Contexts are
/// made once per [`Tls`] and kept, so a caller says this before it asks for any.
pub fn set_tcp_segments(on: bool) {
    // Relaxed: read when a context is made, which the caller orders after this call on its
    // own thread (it says this before asking for a context).
    SETS_TCP_SEGMENTS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether contexts made now get [`TCP_SEGMENTS`] ([`set_tcp_segments`]).
pub(crate) fn sets_tcp_segments() -> bool {
    // Relaxed: see `set_tcp_segments`.
    SETS_TCP_SEGMENTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// UCX's configuration read from its defaults and `UCX_*` variables, then set as `tls` and
/// `segments` ask ([`configure`]); released when dropped.
struct Config(&'static Api, Handle);

impl Config {
    fn read(tls: Tls, segments: bool) -> Result<Config, String> {
        let a = api()?;
        let mut config: Handle = std::ptr::null_mut();
        // SAFETY: null prefix and file mean the defaults and UCX_* variables; `config` is an
        // out-pointer.
        let s = unsafe { (a.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
        if s != UCS_OK {
            return Err(format!("reading UCX's configuration: {}", status_string(s)));
        }
        let c = Config(a, config);
        configure(a, c.1, tls, segments)?;
        Ok(c)
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: `self.1` came from ucp_config_read and is released once; a context made from
        // it keeps its own copy.
        unsafe { (self.0.config_release)(self.1) };
    }
}

/// UCX's configuration as a context of `tls` would be made with it (`segments` as
/// [`set_tcp_segments`]), printed by UCX: `UCX_NAME=value` lines, then the settings given for
/// its transports as `NAME=value`.
#[cfg(test)]
pub(crate) fn config_text(tls: Tls, segments: bool) -> Result<String, String> {
    let c = Config::read(tls, segments)?;
    // SAFETY: `c.1` is a live configuration; the title is NUL-terminated; 1 is
    // UCS_CONFIG_PRINT_CONFIG (the values); `f` is a stream open for writing.
    memstream(|f| unsafe { (c.0.config_print)(c.1, f, c"symmem".as_ptr(), 1) })
}

fn new_context(tls: Tls) -> Result<Context, String> {
    let c = Config::read(tls, sets_tcp_segments())?;
    let mut p = Params::<{ PARAMS_SIZE / 8 }>::new();
    p.set64(0, UCP_PARAM_FIELD_FEATURES).set64(8, UCP_FEATURE_AM | UCP_FEATURE_WAKEUP);
    let mut ctx: Handle = std::ptr::null_mut();
    // SAFETY: `p` is a ucp_params_t of UCX 1.13's size naming only `features`; `c.1` came
    // from ucp_config_read and outlives the call (the context copies what it needs); `ctx` is
    // an out-pointer.
    match unsafe { (c.0.init_version)(UCP_API_MAJOR, UCP_API_MINOR, p.ptr(), c.1, &mut ctx) } {
        UCS_OK => Ok(Context(ctx)),
        s => Err(format!("initializing UCX: {}", status_string(s))),
    }
}

/// Sets `UCX_TLS` in `config` as `tls` asks, UCX's tcp segments to symmem's if `segments`
/// ([`TCP_SEGMENTS`]), and keeps a UCX before 1.16 on its established protocols
/// ([`keeps_v1_protocols`]).
fn configure(a: &Api, config: Handle, tls: Tls, segments: bool) -> Result<(), String> {
    if version().is_ok_and(|v| keeps_v1_protocols(&v)) {
        // SAFETY: `config` came from ucp_config_read; both strings are NUL-terminated and UCX
        // copies them. A UCX without the variable refuses it, and then has nothing to keep.
        let _ = unsafe { (a.config_modify)(config, c"PROTO_ENABLE".as_ptr(), c"n".as_ptr()) };
    }
    if segments {
        for (name, value) in TCP_SEGMENTS {
            // SAFETY: as above. A UCX without its tcp transport refuses the names: nothing to set.
            let _ = unsafe { (a.config_modify)(config, name.as_ptr(), value.as_ptr()) };
        }
    }
    let Tls::Set(v) = tls else { return Ok(()) };
    let c = std::ffi::CString::new(v).map_err(|_| "UCX_TLS holds a NUL byte".to_string())?;
    // SAFETY: as above.
    match unsafe { (a.config_modify)(config, c"TLS".as_ptr(), c.as_ptr()) } {
        UCS_OK => Ok(()),
        s => Err(format!("setting UCX_TLS={v:?}: {}", status_string(s))),
    }
}

/// Whether a UCX of version `v` ("1.13.1") runs symmem's contexts on its established
/// protocols whatever `UCX_PROTO_ENABLE` says: before 1.16, where the new protocols became
/// the default, their active messages were a first, experimental implementation, and UCX
/// 1.13's overruns a stack buffer when it sends symmem's (a small message with a user header
/// and a reply endpoint): the process aborts with "stack smashing detected".
fn keeps_v1_protocols(v: &str) -> bool {
    let mut parts = v.trim().split('.').map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) < (1, 16),
        _ => false,
    }
}

/// One of UCX's transport resources: a transport on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    /// The transport (`tcp`, `rc_mlx5`, `posix`, ...).
    pub tl: String,
    /// The device (`eth0`, `mlx5_0:1`, `memory`, ...).
    pub device: String,
    /// What kind of device, as UCX's transport layer reports it.
    pub kind: DeviceKind,
}

/// `uct_device_type_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// A network device: reaches other hosts.
    Network,
    /// Shared memory: this host only.
    SharedMemory,
    /// An accelerator (GPU memory).
    Accelerator,
    /// The process itself.
    Loopback,
    /// Not reported (UCX's transport layer could not be queried).
    Unknown,
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Network => "network",
            DeviceKind::SharedMemory => "shared memory",
            DeviceKind::Accelerator => "accelerator",
            DeviceKind::Loopback => "loopback",
            DeviceKind::Unknown => "unknown",
        })
    }
}

/// The transports a context of `tls` uses here (after `UCX_TLS` and `UCX_NET_DEVICES`), each
/// with its device's kind.
pub fn resources(tls: Tls) -> Result<Vec<Resource>, String> {
    let ctx = context(tls)?;
    let kinds = super::uct::device_kinds().unwrap_or_default();
    Ok(print_info(ctx)?
        .lines()
        .filter_map(parse_resource)
        .map(|(tl, device)| {
            let kind = kinds.get(&(tl.clone(), device.clone())).copied().unwrap_or(DeviceKind::Unknown);
            Resource { tl, device, kind }
        })
        .collect())
}

/// What `ucp_context_print_info` writes for `ctx`.
fn print_info(ctx: &Context) -> Result<String, String> {
    let a = api()?;
    // SAFETY: the context is live for the process; `f` is a stream open for writing.
    memstream(|f| unsafe { (a.context_print_info)(ctx.0, f) })
}

/// What `write` writes to a stream it is given, as text.
fn memstream(write: impl FnOnce(*mut libc::FILE)) -> Result<String, String> {
    let (mut buf, mut len): (*mut c_char, libc::size_t) = (std::ptr::null_mut(), 0);
    // SAFETY: out-pointers that open_memstream fills when the stream is flushed or closed.
    let f = unsafe { libc::open_memstream(&mut buf, &mut len) };
    if f.is_null() {
        return Err(format!("open_memstream: {}", std::io::Error::last_os_error()));
    }
    write(f);
    // SAFETY: `f` came from open_memstream; closing it sets `buf` and `len` for the last time.
    unsafe { libc::fclose(f) };
    if buf.is_null() {
        return Ok(String::new());
    }
    // SAFETY: open_memstream's buffer holds `len` bytes; it is ours to free with free(3).
    let text = String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }).into_owned();
    // SAFETY: as above, freed once.
    unsafe { libc::free(buf.cast()) };
    Ok(text)
}

/// `(transport, device)` of a line `#      resource 1  :  md 1  dev 1  flags -- tcp/eth0` of
/// `ucp_context_print_info`'s output.
fn parse_resource(line: &str) -> Option<(String, String)> {
    let (head, tail) = line.split_once(" -- ")?;
    if !head.trim_start_matches('#').trim_start().starts_with("resource") {
        return None;
    }
    let (tl, device) = tail.trim().split_once('/')?;
    Some((tl.to_string(), device.to_string()))
}

/// A UCP worker in serialized mode: any thread may call it, one at a time (the `ucx` transport
/// holds a mutex around it and everything its callbacks touch).
pub struct Worker {
    h: Handle,
    api: &'static Api,
}

// SAFETY: a serialized-mode worker may be used from any thread; the owner guarantees one
// thread at a time (a mutex).
unsafe impl Send for Worker {}

impl Worker {
    /// A new worker on the process's context for `tls`.
    pub fn new(tls: Tls) -> Result<Worker, String> {
        let ctx = context(tls)?;
        let api = api()?;
        let mut p = Params::<{ WORKER_PARAMS_SIZE / 8 }>::new();
        p.set64(0, UCP_WORKER_PARAM_FIELD_THREAD_MODE).set32(8, UCS_THREAD_MODE_SERIALIZED);
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: a ucp_worker_params_t of 1.13's size naming only the thread mode; `h` is an
        // out-pointer; the context lives for the process.
        let s = unsafe { (api.worker_create)(ctx.0, p.ptr(), &mut h) };
        if s != UCS_OK {
            return Err(format!("creating a UCX worker: {}", status_string(s)));
        }
        Ok(Worker { h, api })
    }

    /// The worker's address, for peers to connect to.
    pub fn address(&self) -> Result<Vec<u8>, String> {
        let (mut at, mut len): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: out-pointers; the worker is live.
        let s = unsafe { (self.api.worker_get_address)(self.h, &mut at, &mut len) };
        if s != UCS_OK {
            return Err(format!("UCX worker address: {}", status_string(s)));
        }
        // SAFETY: UCX returned `len` readable bytes at `at`, ours until released below.
        let v = unsafe { std::slice::from_raw_parts(at.cast::<u8>(), len) }.to_vec();
        // SAFETY: `at` came from ucp_worker_get_address on this worker.
        unsafe { (self.api.worker_release_address)(self.h, at) };
        Ok(v)
    }

    /// The largest header [`Worker::am_send`] takes (`ucp_worker_attr_t::max_am_header`, which
    /// UCX sends with the message's first fragment, eagerly); `None` when this UCX does not say.
    pub fn max_am_header(&self) -> Option<usize> {
        // A ucp_worker_attr_t (72 bytes in 1.13; room to spare): field_mask at 0, and
        // max_am_header, a size_t, at 32 (after thread_mode, address_flags, address and
        // address_length). UCX writes only the fields the mask names.
        let mut attr = [0u64; 16];
        attr[0] = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
        // SAFETY: the worker is live; `attr` is a writable ucp_worker_attr_t asking for one
        // field, which UCX writes within the struct's first 40 bytes.
        let s = unsafe { (self.api.worker_query)(self.h, attr.as_mut_ptr().cast()) };
        (s == UCS_OK && attr[4] > 0).then_some(attr[4] as usize)
    }

    /// Progresses communication once; the number of events processed.
    pub fn progress(&self) -> u32 {
        // SAFETY: the worker is live; the owner serializes calls.
        unsafe { (self.api.worker_progress)(self.h) }
    }

    /// The file descriptor that becomes readable when the armed worker has events.
    pub fn event_fd(&self) -> Result<c_int, String> {
        let mut fd: c_int = -1;
        // SAFETY: out-pointer; the worker was made with the wake-up feature.
        let s = unsafe { (self.api.worker_get_efd)(self.h, &mut fd) };
        if s != UCS_OK {
            return Err(format!("UCX worker event fd: {}", status_string(s)));
        }
        Ok(fd)
    }

    /// Arms the event descriptor: `Ok(true)` armed (safe to sleep on it), `Ok(false)` events
    /// are pending (progress again first).
    pub fn arm(&self) -> Result<bool, String> {
        // SAFETY: the worker is live; the owner serializes calls.
        match unsafe { (self.api.worker_arm)(self.h) } {
            UCS_OK => Ok(true),
            UCS_ERR_BUSY => Ok(false),
            s => Err(format!("arming the UCX worker: {}", status_string(s))),
        }
    }

    /// Routes active messages `id` to `cb` with `arg`.
    ///
    /// # Safety
    /// `cb` must be sound to call with `arg` during any later `progress` of this worker, until
    /// the worker is destroyed.
    pub unsafe fn set_am_handler(&self, id: u32, cb: AmCallback, arg: *mut c_void) -> Result<(), String> {
        let mut p = Params::<{ AM_HANDLER_PARAM_SIZE / 8 }>::new();
        p.set64(0, UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG)
            .set32(8, id)
            .set64(16, cb as usize as u64)
            .set64(24, arg as u64);
        // SAFETY: a ucp_am_handler_param_t of 1.13's size naming id, cb and arg; the caller
        // vouches for cb and arg.
        let s = unsafe { (self.api.worker_set_am_recv_handler)(self.h, p.ptr()) };
        if s != UCS_OK {
            return Err(format!("UCX active-message handler: {}", status_string(s)));
        }
        Ok(())
    }

    /// An endpoint to the worker at `address`. With `on_error`, UCX detects a vanished peer
    /// (`UCP_ERR_HANDLING_MODE_PEER`) and calls `on_error(arg, ep, status)`; not every UCX
    /// transport can (1.13's shared-memory ones cannot), so callers may retry without.
    ///
    /// # Safety
    /// `on_error` must be sound to call with `arg` during any later `progress` of this
    /// worker while the endpoint exists.
    pub unsafe fn connect(
        &self,
        address: &[u8],
        on_error: Option<ErrCallback>,
        arg: *mut c_void,
    ) -> Result<Handle, String> {
        let mut p = Params::<{ EP_PARAMS_SIZE / 8 }>::new();
        p.set64(8, address.as_ptr() as u64);
        match on_error {
            Some(cb) => {
                p.set64(
                    0,
                    UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                        | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                        | UCP_EP_PARAM_FIELD_ERR_HANDLER,
                )
                .set32(16, UCP_ERR_HANDLING_MODE_PEER)
                .set64(24, cb as usize as u64)
                .set64(32, arg as u64);
            }
            None => {
                p.set64(0, UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
            }
        }
        let mut ep: Handle = std::ptr::null_mut();
        // SAFETY: a ucp_ep_params_t of 1.13's size; `address` is a worker address (UCX
        // validates what it parses); `ep` is an out-pointer.
        let s = unsafe { (self.api.ep_create)(self.h, p.ptr(), &mut ep) };
        if s != UCS_OK {
            return Err(format!("connecting to the UCX peer: {}", status_string(s)));
        }
        Ok(ep)
    }

    /// Starts closing `ep` (flushing it, or at once with `force`).
    ///
    /// # Safety
    /// `ep` must be an endpoint of this worker, not closed before; it is unusable after.
    pub unsafe fn close(&self, ep: Handle, force: bool) -> Started {
        let p = request_param(None, 0, if force { UCP_EP_CLOSE_FLAG_FORCE } else { 0 });
        // SAFETY: the caller vouches for `ep`; the parameter block is a 1.13 request param.
        started(unsafe { (self.api.ep_close_nbx)(ep, p.ptr()) })
    }

    /// Sends active message `id` with `header` and `len` bytes at `data` on `ep`; `cb` runs
    /// with `user_data` when the buffers may be reused.
    ///
    /// # Safety
    /// `ep` must be a live endpoint of this worker (or a reply endpoint UCX handed to a
    /// handler); `header`'s bytes and `len` bytes at `data` must stay readable until
    /// completion (UCX 1.13 reads both then).
    #[allow(clippy::too_many_arguments, reason = "ucp_am_send_nbx's own arguments")]
    pub unsafe fn am_send(
        &self,
        ep: Handle,
        id: u32,
        header: &[u8],
        data: *const u8,
        len: usize,
        flags: u32,
        cb: SendCallback,
        user_data: usize,
    ) -> Started {
        let p = request_param(Some(cb as usize), user_data, flags);
        // SAFETY: the caller vouches for `ep`, the header and the data.
        started(unsafe {
            (self.api.am_send_nbx)(ep, id, header.as_ptr().cast(), header.len(), data.cast(), len, p.ptr())
        })
    }

    /// Receives rendezvous data `desc` (handed to an active-message handler) into `len` bytes
    /// at `into`; `cb` runs with `user_data` when it landed.
    ///
    /// # Safety
    /// `desc` must be an undelivered rendezvous descriptor of this worker; `into` must stay
    /// writable for `len` bytes until completion.
    pub unsafe fn am_recv_data(
        &self,
        desc: *mut c_void,
        into: *mut u8,
        len: usize,
        cb: RecvDataCallback,
        user_data: usize,
    ) -> Started {
        let p = request_param(Some(cb as usize), user_data, 0);
        // SAFETY: the caller vouches for `desc` and `into`.
        started(unsafe { (self.api.am_recv_data_nbx)(self.h, desc, into.cast(), len, p.ptr()) })
    }

    /// Drops an undelivered rendezvous descriptor (its sender completes).
    ///
    /// # Safety
    /// `desc` must be an undelivered data descriptor of this worker.
    pub unsafe fn am_data_release(&self, desc: *mut c_void) {
        // SAFETY: the caller vouches for `desc`.
        unsafe { (self.api.am_data_release)(self.h, desc) }
    }

    /// The status of a pending request.
    ///
    /// # Safety
    /// `req` must be a request of this worker not yet freed.
    pub unsafe fn request_status(&self, req: *mut c_void) -> Status {
        // SAFETY: the caller vouches for `req`.
        unsafe { (self.api.request_check_status)(req) }
    }

    ///
    /// # Safety
    /// `req` must be a request of this worker not yet freed.
    pub unsafe fn request_cancel(&self, req: *mut c_void) {
        // SAFETY: the caller vouches for `req`.
        unsafe { (self.api.request_cancel)(self.h, req) }
    }
}

/// Frees a completed (or abandoned) request.
///
/// # Safety
/// `req` must be a request UCX returned, freed once.
pub unsafe fn request_free(req: *mut c_void) {
    if let Ok(a) = api() {
        // SAFETY: the caller vouches for `req`.
        unsafe { (a.request_free)(req) }
    }
}

/// Set once the process exits ([`begin_exit`]): UCX's own exit-time destructors are about to
/// tear down its global state, and a worker destroyed after that crashes.
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Workers being destroyed now: [`begin_exit`] waits for them.
static DESTROYING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Called as the process exits, before UCX's libraries run their destructors (an `atexit`
/// handler registered after they were loaded runs before them): from now on a dropped worker
/// is left to the process's end rather than destroyed, and the destructions already under way
/// (a thread dropping its transport while another exits) finish first, for at most a second.
pub(crate) fn begin_exit() {
    use std::sync::atomic::Ordering;
    // SeqCst: a Dekker pair with `Worker::drop` (its increment, then its load of EXITING):
    // either this sees its increment and waits, or it sees EXITING and destroys nothing.
    EXITING.store(true, Ordering::SeqCst);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
    while DESTROYING.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        // SeqCst: see `begin_exit`.
        DESTROYING.fetch_add(1, Ordering::SeqCst);
        if !EXITING.load(Ordering::SeqCst) {
            // SAFETY: the worker is live and dropped by its owner, after its endpoints closed;
            // UCX's libraries are not being torn down (the process is not exiting, or
            // `begin_exit` waits for this).
            unsafe { (self.api.worker_destroy)(self.h) }
        }
        DESTROYING.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles a C program against the installed headers and compares the sizes, offsets and
    /// constants this binding hard-codes. Skipped where the headers or a C compiler are absent.
    #[test]
    fn ucx_layout_matches_the_headers() {
        let Some(out) = crate::sys::c_program_output(
            "ucp/api/ucp.h",
            r#"printf("%zu %zu %zu %zu %zu\n", sizeof(ucp_params_t), sizeof(ucp_worker_params_t), sizeof(ucp_ep_params_t), sizeof(ucp_request_param_t), sizeof(ucp_am_handler_param_t));
printf("%zu %zu %zu %zu %zu %zu\n", offsetof(ucp_params_t,features), offsetof(ucp_worker_params_t,thread_mode), offsetof(ucp_ep_params_t,address), offsetof(ucp_ep_params_t,err_mode), offsetof(ucp_ep_params_t,err_handler), offsetof(ucp_request_param_t,cb));
printf("%zu %zu %zu %zu %zu\n", offsetof(ucp_request_param_t,user_data), offsetof(ucp_request_param_t,flags), offsetof(ucp_am_handler_param_t,id), offsetof(ucp_am_handler_param_t,cb), offsetof(ucp_am_handler_param_t,arg));
printf("%d %d %lu %lu %lu %lu\n", UCP_API_MAJOR, UCP_API_MINOR, (unsigned long)UCP_AM_SEND_FLAG_REPLY, (unsigned long)UCP_AM_SEND_FLAG_EAGER, (unsigned long)UCP_AM_RECV_ATTR_FLAG_RNDV, (unsigned long)UCP_AM_RECV_ATTR_FIELD_REPLY_EP);
printf("%zu %zu\n", sizeof(ucp_am_recv_param_t), offsetof(ucp_am_recv_param_t,reply_ep));"#,
        ) else {
            return;
        };
        let want = format!(
            "{PARAMS_SIZE} {WORKER_PARAMS_SIZE} {EP_PARAMS_SIZE} {REQUEST_PARAM_SIZE} {AM_HANDLER_PARAM_SIZE}\n\
             8 8 8 16 24 16\n32 4 8 16 24\n{UCP_API_MAJOR} {UCP_API_MINOR} {UCP_AM_SEND_FLAG_REPLY} \
             {UCP_AM_SEND_FLAG_EAGER} {UCP_AM_RECV_ATTR_FLAG_RNDV} {UCP_AM_RECV_ATTR_FIELD_REPLY_EP}\n{} 8\n",
            std::mem::size_of::<AmRecvParam>()
        );
        assert_eq!(out, want);
    }

    #[test]
    fn context_resources_are_read_from_ucps_own_listing() {
        let line = "#      resource 1  :  md 1  dev 1  flags -- tcp/eth0";
        assert_eq!(parse_resource(line), Some(("tcp".into(), "eth0".into())));
        assert_eq!(parse_resource("#            md 0  :  component 0  self "), None);
        assert_eq!(parse_resource("# something -- else"), None);
        if available().is_err() {
            eprintln!("SKIPPED: UCX unavailable");
            return;
        }
        // UCX_TLS is not set under `cargo test`: every transport, tcp among them (a network
        // device), and none of tcp without it.
        let all = resources(Tls::Configured).unwrap();
        assert!(all.iter().any(|r| r.tl == "tcp" && r.kind == DeviceKind::Network), "{all:?}");
        assert!(all.iter().any(|r| r.tl == "self" && r.kind == DeviceKind::Loopback), "{all:?}");
        let no_tcp = resources(Tls::Set("^tcp")).unwrap();
        assert!(!no_tcp.is_empty() && no_tcp.iter().all(|r| r.tl != "tcp"), "{no_tcp:?}");
    }

    /// TCP sockets in LISTEN state that this process holds.
    fn tcp_listeners() -> usize {
        let inodes: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string))
            .collect();
        ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(f).ok())
            .flat_map(|t| t.lines().skip(1).map(str::to_string).collect::<Vec<_>>())
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 9 && f[3] == "0A" && inodes.contains(f[9])
            })
            .count()
    }

    /// The child of `a_worker_symmem_picks_by_itself_listens_on_no_tcp_port`, in a process
    /// of its own: how many TCP listeners a worker without UCX's tcp opens, then one as
    /// configured.
    #[test]
    #[ignore = "run by a_worker_symmem_picks_by_itself_listens_on_no_tcp_port"]
    #[allow(clippy::print_stdout, reason = "the child reports to the parent test on stdout")]
    fn ucx_listeners_child() {
        let before = tcp_listeners();
        let no_tcp = Worker::new(Tls::Set("^tcp")).unwrap();
        let after_no_tcp = tcp_listeners();
        let configured = Worker::new(Tls::Configured).unwrap();
        println!("LISTENERS {} {}", after_no_tcp - before, tcp_listeners() - after_no_tcp);
        drop((no_tcp, configured));
    }

    /// What symmem picks by itself never opens UCX's tcp door: its worker listens on no TCP
    /// port, so no peer can connect over UCX's tcp at all. Run in a child process of its own
    /// (no other test's workers or listeners); a worker as configured (tcp included) is the
    /// control, which does listen.
    #[test]
    fn a_worker_symmem_picks_by_itself_listens_on_no_tcp_port() {
        if available().is_err() {
            eprintln!("SKIPPED: UCX unavailable");
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "sys::ucx::tests::ucx_listeners_child", "--include-ignored"])
            .args(["--nocapture", "--test-threads=1"])
            .env_remove("UCX_TLS")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("LISTENERS ").map(|(_, v)| v.trim()))
            .unwrap_or_else(|| panic!("no LISTENERS line: {stdout}\n{}", String::from_utf8_lossy(&out.stderr)));
        let n: Vec<usize> = line.split(' ').map(|v| v.parse().unwrap()).collect();
        assert_eq!(n[0], 0, "a worker without UCX's tcp listens on a TCP port");
        assert!(n[1] > 0, "the control (UCX's tcp included) opened no listener: the check sees nothing");
    }

    /// symmem's tcp segments reach UCX's tcp transport: an endpoint of a worker on UCX's tcp
    /// alone sends a message eagerly in one piece up to about 64 KiB (its `egr/short` range,
    /// as `ucp_ep_print_info` reports it), where UCX's own segments stop at about 8 KiB.
    #[test]
    fn symmems_tcp_segments_reach_ucxs_tcp_transport() {
        if available().is_err() {
            eprintln!("SKIPPED: UCX unavailable");
            return;
        }
        if !sets_tcp_segments() {
            eprintln!("SKIPPED: the user set UCX's tcp segments");
            return;
        }
        let w = Worker::new(Tls::Set("tcp")).unwrap();
        // SAFETY: the worker's own address; no error handler.
        let ep = unsafe { w.connect(&w.address().unwrap(), None, std::ptr::null_mut()) }.unwrap();
        // SAFETY: `ep` is a live endpoint of `w`; `f` is a stream open for writing.
        let text = memstream(|f| unsafe { (w.api.ep_print_info)(ep, f) }).unwrap();
        // "am_send: 0..<egr/short>..65529..<egr/zcopy>..65536..<rndv>..(inf)"
        let short_up_to = text
            .lines()
            .find_map(|l| l.split_once("am_send:").map(|(_, r)| r.to_string()))
            .and_then(|r| r.split("<egr/short>..").nth(1).and_then(|t| t.split("..").next()?.parse::<usize>().ok()))
            .unwrap_or_else(|| panic!("no eager range in the endpoint's configuration:\n{text}"));
        assert!((60 << 10..=64 << 10).contains(&short_up_to), "eager in one piece up to {short_up_to}:\n{text}");
        // SAFETY: `ep` is a live endpoint of `w`, closed once.
        if let Started::Pending(r) = unsafe { w.close(ep, true) } {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            // SAFETY: `r` is the close's request, checked until done, then freed once.
            while unsafe { w.request_status(r) } == UCS_INPROGRESS {
                assert!(std::time::Instant::now() < deadline, "closing an endpoint to itself took over 10 s");
                w.progress();
            }
            // SAFETY: as above.
            unsafe { request_free(r) };
        }
    }

    #[test]
    fn ucx_before_1_16_keeps_its_established_protocols() {
        assert!(keeps_v1_protocols("1.13.1"));
        assert!(keeps_v1_protocols("1.15.0"));
        assert!(!keeps_v1_protocols("1.16.0"));
        assert!(!keeps_v1_protocols("1.21.0"));
        assert!(!keeps_v1_protocols("2.0"));
        assert!(!keeps_v1_protocols("unknown"));
    }

    #[test]
    fn status_pointers_decode_as_ucx_encodes_them() {
        assert!(matches!(started(std::ptr::null_mut()), Started::Done));
        assert!(matches!(started(-25isize as StatusPtr), Started::Failed(-25)));
        assert!(matches!(started(0x1000 as StatusPtr), Started::Pending(_)));
    }
}
