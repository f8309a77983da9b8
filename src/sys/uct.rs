//! UCX's transport layer (UCT, `libuct.so.0`, loaded at run time), asked one thing: what kind
//! of device each transport resource is on (network, shared memory, ...), which UCP's API
//! does not say. The layouts are UCX 1.13's (x86-64), checked against the installed headers
//! by `uct_layout_matches_the_headers`.

use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void};

use super::ucx::{DeviceKind, Status, UCS_OK};

type Handle = *mut c_void;

const UCT_COMPONENT_ATTR_FIELD_NAME: u64 = 1;
const UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT: u64 = 2;
const UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES: u64 = 4;
const UCT_MD_NAME_MAX: usize = 16;
const UCT_TL_NAME_MAX: usize = 10;
const UCT_DEVICE_NAME_MAX: usize = 32;

/// `uct_component_attr_t`.
#[repr(C)]
struct ComponentAttr {
    field_mask: u64,
    name: [c_char; 16],
    md_resource_count: c_uint,
    md_resources: *mut [c_char; UCT_MD_NAME_MAX],
    flags: u64,
}

/// `uct_tl_resource_desc_t`.
#[repr(C)]
struct TlResource {
    tl_name: [c_char; UCT_TL_NAME_MAX],
    dev_name: [c_char; UCT_DEVICE_NAME_MAX],
    dev_type: c_uint,
    sys_device: u8,
}

struct Api {
    query_components: unsafe extern "C" fn(*mut *mut Handle, *mut c_uint) -> Status,
    release_component_list: unsafe extern "C" fn(*mut Handle),
    component_query: unsafe extern "C" fn(Handle, *mut ComponentAttr) -> Status,
    md_config_read: unsafe extern "C" fn(Handle, *const c_char, *const c_char, *mut Handle) -> Status,
    config_release: unsafe extern "C" fn(Handle),
    md_open: unsafe extern "C" fn(Handle, *const c_char, Handle, *mut Handle) -> Status,
    md_close: unsafe extern "C" fn(Handle),
    md_query_tl_resources: unsafe extern "C" fn(Handle, *mut *mut TlResource, *mut c_uint) -> Status,
    release_tl_resource_list: unsafe extern "C" fn(*mut TlResource),
}

fn load(lib: &'static libloading::Library) -> Result<Api, String> {
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is UCX 1.13's function of that name and the field's type its
            // C signature (uct.h); the library stays loaded for the life of the process.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| format!("UCT lacks {}: {e}", $name))?
        };
    }
    Ok(Api {
        query_components: sym!("uct_query_components"),
        release_component_list: sym!("uct_release_component_list"),
        component_query: sym!("uct_component_query"),
        md_config_read: sym!("uct_md_config_read"),
        config_release: sym!("uct_config_release"),
        md_open: sym!("uct_md_open"),
        md_close: sym!("uct_md_close"),
        md_query_tl_resources: sym!("uct_md_query_tl_resources"),
        release_tl_resource_list: sym!("uct_release_tl_resource_list"),
    })
}

fn api() -> Result<&'static Api, String> {
    static LIB: std::sync::OnceLock<Result<libloading::Library, String>> = std::sync::OnceLock::new();
    static API: std::sync::OnceLock<Result<Api, String>> = std::sync::OnceLock::new();
    API.get_or_init(|| {
        let lib = LIB.get_or_init(|| {
            // SAFETY: libuct is a dependency of libucp; its constructors only set up UCX's own
            // state; it stays loaded for the life of the process (in `LIB`).
            unsafe { libloading::Library::new("libuct.so.0") }.map_err(|e| format!("libuct.so.0: {e}"))
        });
        load(lib.as_ref().map_err(Clone::clone)?)
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn text(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn kind(dev_type: c_uint) -> DeviceKind {
    match dev_type {
        0 => DeviceKind::Network,
        1 => DeviceKind::SharedMemory,
        2 => DeviceKind::Accelerator,
        3 => DeviceKind::Loopback,
        _ => DeviceKind::Unknown,
    }
}

/// The kind of device of every transport resource UCT offers here, by (transport, device).
pub(crate) fn device_kinds() -> Result<HashMap<(String, String), DeviceKind>, String> {
    let a = api()?;
    let mut out = HashMap::new();
    let (mut components, mut n): (*mut Handle, c_uint) = (std::ptr::null_mut(), 0);
    // SAFETY: out-pointers; the list is released below.
    let s = unsafe { (a.query_components)(&mut components, &mut n) };
    if s != UCS_OK {
        return Err(format!("uct_query_components: status {s}"));
    }
    // SAFETY: UCT returned `n` component handles at `components`, live until released.
    let list = unsafe { std::slice::from_raw_parts(components, n as usize) };
    for &component in list {
        let mut attr = ComponentAttr {
            field_mask: UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT,
            name: [0; 16],
            md_resource_count: 0,
            md_resources: std::ptr::null_mut(),
            flags: 0,
        };
        // SAFETY: `attr` is a uct_component_attr_t of 1.13's layout asking for the name and count.
        if unsafe { (a.component_query)(component, &mut attr) } != UCS_OK {
            continue;
        }
        let mut mds = vec![[0 as c_char; UCT_MD_NAME_MAX]; attr.md_resource_count as usize];
        attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        attr.md_resources = mds.as_mut_ptr();
        // SAFETY: `md_resources` has room for the `md_resource_count` names UCT just reported.
        if unsafe { (a.component_query)(component, &mut attr) } != UCS_OK {
            continue;
        }
        for md_name in &mds {
            let mut config: Handle = std::ptr::null_mut();
            // SAFETY: out-pointer; null prefix and file mean the defaults and UCX_* variables.
            if unsafe { (a.md_config_read)(component, std::ptr::null(), std::ptr::null(), &mut config) } != UCS_OK {
                continue;
            }
            let mut md: Handle = std::ptr::null_mut();
            // SAFETY: a name UCT reported for this component, NUL-terminated (UCT writes at
            // most UCT_MD_NAME_MAX bytes with the NUL); `config` is live; `md` an out-pointer.
            let s = unsafe { (a.md_open)(component, md_name.as_ptr(), config, &mut md) };
            // SAFETY: `config` came from uct_md_config_read and is not used again.
            unsafe { (a.config_release)(config) };
            if s != UCS_OK {
                continue;
            }
            let (mut res, mut count): (*mut TlResource, c_uint) = (std::ptr::null_mut(), 0);
            // SAFETY: `md` is open; out-pointers; the list is released below.
            if unsafe { (a.md_query_tl_resources)(md, &mut res, &mut count) } == UCS_OK {
                if !res.is_null() {
                    // SAFETY: UCT returned `count` descriptors at `res`, live until released.
                    for r in unsafe { std::slice::from_raw_parts(res, count as usize) } {
                        out.insert((text(&r.tl_name), text(&r.dev_name)), kind(r.dev_type));
                    }
                }
                // SAFETY: `res` came from uct_md_query_tl_resources, released once.
                unsafe { (a.release_tl_resource_list)(res) };
            }
            // SAFETY: `md` was opened above and is not used again.
            unsafe { (a.md_close)(md) };
        }
    }
    // SAFETY: the list came from uct_query_components and is released once.
    unsafe { (a.release_component_list)(components) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-written layouts equal the installed headers'. Skipped without them.
    #[test]
    fn uct_layout_matches_the_headers() {
        let Some(out) = crate::sys::c_program_output(
            "uct/api/uct.h",
            r#"printf("%zu %zu %zu %zu %zu\n", sizeof(uct_component_attr_t), offsetof(uct_component_attr_t,name), offsetof(uct_component_attr_t,md_resource_count), offsetof(uct_component_attr_t,md_resources), sizeof(uct_md_resource_desc_t));
printf("%zu %zu %zu %zu\n", sizeof(uct_tl_resource_desc_t), offsetof(uct_tl_resource_desc_t,dev_name), offsetof(uct_tl_resource_desc_t,dev_type), offsetof(uct_tl_resource_desc_t,sys_device));
printf("%d %d %d %d %d %d %d\n", UCT_COMPONENT_ATTR_FIELD_NAME, UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT, UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES, UCT_DEVICE_TYPE_NET, UCT_DEVICE_TYPE_SHM, UCT_DEVICE_TYPE_ACC, UCT_DEVICE_TYPE_SELF);"#,
        ) else {
            return;
        };
        let want = format!(
            "{} {} {} {} {}\n{} {} {} {}\n{} {} {} 0 1 2 3\n",
            std::mem::size_of::<ComponentAttr>(),
            std::mem::offset_of!(ComponentAttr, name),
            std::mem::offset_of!(ComponentAttr, md_resource_count),
            std::mem::offset_of!(ComponentAttr, md_resources),
            UCT_MD_NAME_MAX,
            std::mem::size_of::<TlResource>(),
            std::mem::offset_of!(TlResource, dev_name),
            std::mem::offset_of!(TlResource, dev_type),
            std::mem::offset_of!(TlResource, sys_device),
            UCT_COMPONENT_ATTR_FIELD_NAME,
            UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT,
            UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES,
        );
        assert_eq!(out, want);
        assert_eq!(kind(0), DeviceKind::Network);
        assert_eq!(kind(3), DeviceKind::Loopback);
    }
}
