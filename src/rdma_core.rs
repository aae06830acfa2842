//! `stag run` and `stag install`: stag0 as a device of rdma-core, for
//! programs written against libibverbs and librdmacm.
//!
//! libibverbs discovers devices through netlink or, where the kernel has no
//! RDMA, through sysfs under `$SYSFS_PATH`. Both commands write a device
//! tree that names stag0 (plus links to the kernel's own RDMA devices, if
//! any, so that they stay visible) and point libibverbs at it:
//!
//! - `stag run -- CMD…` (no root): the tree goes to a temporary directory,
//!   and CMD runs with `SYSFS_PATH` on it and the plugin preloaded, which
//!   registers the `stag` driver, puts stag's rdma_cm in front of the
//!   system's librdmacm, and stands in for the device node.
//! - `stag install` (root, once): the plugin goes to libibverbs' driver
//!   directory, the tree to `/var/lib/stag/sysfs`, the node to
//!   `/dev/infiniband/` (and `/etc/tmpfiles.d`, for the next boot), and
//!   `SYSFS_PATH` to `/etc/environment` and `/etc/profile.d`: a new login
//!   session's `ibv_devices`/`ibv_devinfo` list stag0 with no wrapper.
//!   Programs that need rdma_cm still want `stag run` (librdmacm itself
//!   only speaks to the kernel).

use std::fs;
use std::io;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

use provider::identity;

/// The plugin's file name as cargo builds it.
const PLUGIN_BUILT: &str = "libstag_rdmav34.so";
/// The name libibverbs loads for driver `stag` (`<name>-rdmav34.so`).
const PLUGIN_INSTALLED: &str = "libstag-rdmav34.so";
/// Where `stag install` puts the tree.
const INSTALL_TREE: &str = "/var/lib/stag/sysfs";
const PROFILE_SCRIPT: &str = "/etc/profile.d/stag-rdma.sh";
const TMPFILES: &str = "/etc/tmpfiles.d/stag-rdma.conf";
const DRIVER_FILE: &str = "/etc/libibverbs.d/stag.driver";

/// Errors of `stag run` / `stag install`.
#[derive(Debug, thiserror::Error)]
pub enum RdmaCoreError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot find the plugin {PLUGIN_BUILT} (build it with `cargo build -p stag-rdma`, or set STAG_PLUGIN)")]
    NoPlugin,
    #[error("stag install needs root")]
    NotRoot,
    #[error("no command given: stag run -- CMD [ARGS...]")]
    NoCommand,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> RdmaCoreError {
    let what = what.into();
    move |source| RdmaCoreError::Io { what, source }
}

fn write(path: &Path, content: &str) -> Result<(), RdmaCoreError> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(io_err(format!("mkdir {}", dir.display())))?;
    }
    fs::write(path, content).map_err(io_err(format!("write {}", path.display())))
}

/// `xxxx:xxxx:xxxx:xxxx`, as sysfs prints GUIDs.
fn guid_text(g: u64) -> String {
    format!(
        "{:04x}:{:04x}:{:04x}:{:04x}",
        g >> 48,
        (g >> 32) & 0xffff,
        (g >> 16) & 0xffff,
        g & 0xffff
    )
}

fn gid_text(gid: &[u8; 16]) -> String {
    gid.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// Write the device tree under `root`: stag0, and links to the kernel's
/// RDMA devices (from `/sys`) so that they stay visible.
pub fn write_tree(root: &Path) -> Result<(), RdmaCoreError> {
    let verbs = root.join("class/infiniband_verbs");
    let ib = root.join("class/infiniband");
    let kernel_abi = fs::read_to_string("/sys/class/infiniband_verbs/abi_version").ok();
    let abi = kernel_abi
        .as_deref()
        .map(str::trim)
        .map(str::to_owned)
        .unwrap_or_else(|| identity::UVERBS_ABI_VERSION.to_string());
    write(&verbs.join("abi_version"), &format!("{abi}\n"))?;
    let uv = verbs.join(identity::UVERBS_NAME);
    write(&uv.join("ibdev"), &format!("{}\n", identity::DEVICE_NAME))?;
    let (major, minor) = identity::UVERBS_DEV;
    write(&uv.join("dev"), &format!("{major}:{minor}\n"))?;
    write(&uv.join("abi_version"), &format!("{abi}\n"))?;
    let dev = ib.join(identity::DEVICE_NAME);
    write(&dev.join("node_type"), "4: RNIC\n")?;
    write(
        &dev.join("node_guid"),
        &format!("{}\n", guid_text(identity::NODE_GUID)),
    )?;
    write(
        &dev.join("sys_image_guid"),
        &format!("{}\n", guid_text(identity::NODE_GUID)),
    )?;
    write(&dev.join("fw_ver"), "0.1.0\n")?;
    write(&dev.join("hca_type"), "stag userspace iWARP\n")?;
    let port = dev.join("ports/1");
    write(
        &port.join("gids/0"),
        &format!("{}\n", gid_text(&identity::GID)),
    )?;
    write(&port.join("gid_attrs/types/0"), "IB/RoCE v1\n")?;
    write(&port.join("gid_attrs/ndevs/0"), "lo\n")?;
    write(&port.join("pkeys/0"), "0xffff\n")?;
    write(&port.join("link_layer"), "Ethernet\n")?;
    write(&port.join("state"), "4: ACTIVE\n")?;
    write(&port.join("phys_state"), "5: LinkUp\n")?;
    write(&port.join("rate"), "100 Gb/sec (4X EDR)\n")?;
    // The kernel's devices, linked as they are.
    for (class, dir) in [("infiniband_verbs", &verbs), ("infiniband", &ib)] {
        let Ok(entries) = fs::read_dir(Path::new("/sys/class").join(class)) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if name == "abi_version" || dir.join(&name).exists() {
                continue;
            }
            symlink(e.path(), dir.join(&name))
                .map_err(io_err(format!("link {}", e.path().display())))?;
        }
    }
    Ok(())
}

/// Whether the kernel answers RDMA netlink (it has RDMA devices): then
/// libibverbs would discover through netlink and never read the tree.
fn kernel_has_rdma() -> bool {
    Path::new("/sys/class/infiniband")
        .read_dir()
        .map(|mut d| d.next().is_some())
        .unwrap_or(false)
}

/// The plugin: `$STAG_PLUGIN`, next to this executable, or installed.
fn plugin_path() -> Result<PathBuf, RdmaCoreError> {
    if let Some(p) = std::env::var_os("STAG_PLUGIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(io_err("current_exe"))?;
    let mut candidates = Vec::new();
    if let Some(dir) = exe.parent() {
        candidates.push(dir.join(PLUGIN_BUILT));
        // target/debug/examples/… or target/debug/deps/… → target/debug
        if let Some(up) = dir.parent() {
            candidates.push(up.join(PLUGIN_BUILT));
        }
    }
    candidates.push(libibverbs_driver_dir().join(PLUGIN_INSTALLED));
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or(RdmaCoreError::NoPlugin)
}

fn libibverbs_driver_dir() -> PathBuf {
    for d in [
        "/usr/lib/x86_64-linux-gnu/libibverbs",
        "/usr/lib64/libibverbs",
        "/usr/lib/libibverbs",
    ] {
        if Path::new(d).is_dir() {
            return PathBuf::from(d);
        }
    }
    PathBuf::from("/usr/lib/x86_64-linux-gnu/libibverbs")
}

/// A new, private directory for one run's device tree (mkdtemp: a random
/// name, mode 0700). Named after the PID it was not unique: a tree left by
/// a `stag run` that was killed before it cleaned up, possibly another
/// user's, was in the way of a later run whose PID matched (PIDs wrap), and
/// that run failed to write it (issue #19's user-* gate flakes).
fn fresh_tree_dir() -> Result<PathBuf, RdmaCoreError> {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let template = std::env::temp_dir().join("stag-sysfs-XXXXXX");
    let mut buf = template.as_os_str().as_bytes().to_vec();
    buf.push(0);
    // SAFETY: `buf` is a writable, NUL-terminated template ending in
    // "XXXXXX", which mkdtemp rewrites in place.
    if unsafe { libc::mkdtemp(buf.as_mut_ptr().cast()) }.is_null() {
        return Err(io_err(format!("mkdtemp {}", template.display()))(
            io::Error::last_os_error(),
        ));
    }
    buf.pop();
    Ok(PathBuf::from(std::ffi::OsString::from_vec(buf)))
}

/// `stag run -- CMD…`: CMD's exit status (128 + signal if killed).
pub fn run(cmd: &[String]) -> Result<i32, RdmaCoreError> {
    let (prog, args) = cmd.split_first().ok_or(RdmaCoreError::NoCommand)?;
    let plugin = plugin_path()?;
    let plugin = plugin.canonicalize().unwrap_or(plugin);
    let root = fresh_tree_dir()?;
    if let Err(e) = write_tree(&root) {
        let _ = fs::remove_dir_all(&root);
        return Err(e);
    }
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", plugin.display()),
        _ => plugin.display().to_string(),
    };
    let mut child = Command::new(prog);
    child
        .args(args)
        .env("SYSFS_PATH", &root)
        .env("LD_PRELOAD", preload)
        .env("STAG_RUN", "1");
    if kernel_has_rdma() {
        child.env("STAG_RUN_HIDE_NETLINK", "1");
    }
    // SIGTERM/SIGINT/SIGHUP sent to `stag run` go on to the child.
    let status =
        crate::signal_forward::run_forwarding(&mut child).map_err(io_err(format!("run {prog}")));
    let _ = fs::remove_dir_all(&root);
    let status = status?;
    use std::os::unix::process::ExitStatusExt;
    Ok(status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}

/// `stag install [--uninstall]`.
pub fn install(uninstall: bool) -> Result<(), RdmaCoreError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(RdmaCoreError::NotRoot);
    }
    let node = PathBuf::from("/dev/infiniband").join(identity::UVERBS_NAME);
    let lib = libibverbs_driver_dir().join(PLUGIN_INSTALLED);
    if uninstall {
        for p in [
            Path::new(DRIVER_FILE),
            Path::new(PROFILE_SCRIPT),
            Path::new(TMPFILES),
            &lib,
            &node,
        ] {
            let _ = fs::remove_file(p);
        }
        let _ = fs::remove_dir_all(INSTALL_TREE);
        // /var/lib/stag, if nothing else is in it.
        if let Some(dir) = Path::new(INSTALL_TREE).parent() {
            let _ = fs::remove_dir(dir);
        }
        edit_environment(None)?;
        println!("stag: uninstalled stag0 from rdma-core");
        return Ok(());
    }
    let plugin = plugin_path()?;
    fs::create_dir_all(libibverbs_driver_dir()).map_err(io_err("mkdir libibverbs"))?;
    // Copy to a temporary name and rename, so a running program that has
    // the old file mapped keeps it. Every step here is atomic or
    // idempotent, and temporary names carry the PID: nodes that share a
    // filesystem may all run `stag install` at once (`mpirun stag
    // install`), which a shared name made fail on all but one.
    let tmp = lib.with_extension(format!("so.new.{}", std::process::id()));
    fs::copy(&plugin, &tmp).map_err(io_err(format!("copy {}", plugin.display())))?;
    fs::rename(&tmp, &lib).map_err(io_err(format!("install {}", lib.display())))?;
    write(Path::new(DRIVER_FILE), "driver stag\n")?;
    install_tree(Path::new(INSTALL_TREE))?;
    make_node(&node)?;
    let (major, minor) = identity::UVERBS_DEV;
    write(
        Path::new(TMPFILES),
        &format!("c {} 0666 - - - {major}:{minor}\n", node.display()),
    )?;
    write(
        Path::new(PROFILE_SCRIPT),
        &format!("# stag0 for rdma-core (stag install)\nexport SYSFS_PATH={INSTALL_TREE}\n"),
    )?;
    edit_environment(Some(INSTALL_TREE))?;
    println!(
        "stag: installed {} (driver stag), device tree {INSTALL_TREE}, node {}",
        lib.display(),
        node.display()
    );
    if kernel_has_rdma() {
        println!("stag: this kernel has RDMA devices: libibverbs discovers those through netlink and will not read the tree; use `stag run -- CMD` to see stag0 next to them");
    } else {
        println!("stag: new login sessions list stag0 in ibv_devices; programs using rdma_cm run with `stag run -- CMD`");
    }
    Ok(())
}

/// Replace the tree at `dest` with a new one, written beside it and
/// renamed into place: a concurrent install (another node on the same
/// filesystem) never finds it half written or removed under it.
fn install_tree(dest: &Path) -> Result<(), RdmaCoreError> {
    let parent = dest.parent().unwrap_or(Path::new("/"));
    fs::create_dir_all(parent).map_err(io_err(format!("mkdir {}", parent.display())))?;
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let me = format!(
        "{}.{}",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let fresh = parent.join(format!(".sysfs.new.{me}"));
    let old = parent.join(format!(".sysfs.old.{me}"));
    let _ = fs::remove_dir_all(&fresh);
    write_tree(&fresh)?;
    match fs::rename(dest, &old) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(format!("move {}", dest.display()))(e)),
    }
    let placed = fs::rename(&fresh, dest);
    let _ = fs::remove_dir_all(&old);
    if let Err(e) = placed {
        // Another install put its tree (the same one) there first.
        let _ = fs::remove_dir_all(&fresh);
        if !dest.join("class").is_dir() {
            return Err(io_err(format!("install {}", dest.display()))(e));
        }
    }
    Ok(())
}

fn make_node(node: &Path) -> Result<(), RdmaCoreError> {
    if node.exists() {
        return Ok(());
    }
    if let Some(dir) = node.parent() {
        fs::create_dir_all(dir).map_err(io_err("mkdir /dev/infiniband"))?;
    }
    let (major, minor) = identity::UVERBS_DEV;
    let path = std::ffi::CString::new(node.as_os_str().as_encoded_bytes()).map_err(|_| {
        RdmaCoreError::Io {
            what: "node path".into(),
            source: io::ErrorKind::InvalidInput.into(),
        }
    })?;
    // SAFETY: a valid path; makedev/mknod have no other preconditions.
    let rc = unsafe {
        libc::mknod(
            path.as_ptr(),
            libc::S_IFCHR | 0o666,
            libc::makedev(major, minor),
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        // A concurrent install made it between the check and here.
        if e.raw_os_error() == Some(libc::EEXIST) {
            return Ok(());
        }
        return Err(RdmaCoreError::Io {
            what: format!("mknod {}", node.display()),
            source: e,
        });
    }
    // SAFETY: as above; mknod's mode is filtered by the umask.
    unsafe { libc::chmod(path.as_ptr(), 0o666) };
    Ok(())
}

/// Set (or remove) `SYSFS_PATH` in `/etc/environment`.
fn edit_environment(value: Option<&str>) -> Result<(), RdmaCoreError> {
    let path = Path::new("/etc/environment");
    let old = fs::read_to_string(path).unwrap_or_default();
    let mut lines: Vec<String> = old
        .lines()
        .filter(|l| !l.starts_with("SYSFS_PATH="))
        .map(str::to_owned)
        .collect();
    if let Some(v) = value {
        lines.push(format!("SYSFS_PATH={v}"));
    }
    let mut text = lines.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    // A new file renamed over the old: a concurrent install or a login
    // reading it never sees it truncated (and so never writes back only
    // its own line).
    let tmp = path.with_extension(format!("stag.{}", std::process::id()));
    fs::write(&tmp, &text).map_err(io_err(format!("write {}", tmp.display())))?;
    match fs::rename(&tmp, path) {
        Ok(()) => Ok(()),
        // A file mounted there (a container's bind mount): rewrite it.
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            let _ = fs::remove_file(&tmp);
            fs::write(path, text).map_err(io_err("write /etc/environment"))
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(io_err("replace /etc/environment")(e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each run gets its own new tree, whatever the temp directory holds:
    /// a leftover at the old PID-named path (here a file, which no run
    /// could write a tree into) does not stop it, and two trees never
    /// share a directory.
    #[test]
    fn tree_dirs_are_fresh_and_private() {
        use std::os::unix::fs::PermissionsExt;
        let stale = std::env::temp_dir().join(format!("stag-sysfs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&stale);
        fs::write(&stale, "left by an earlier run").unwrap();
        let a = fresh_tree_dir().unwrap();
        let b = fresh_tree_dir().unwrap();
        assert_ne!(a, b);
        assert_ne!(a, stale);
        assert_eq!(
            fs::metadata(&a).unwrap().permissions().mode() & 0o777,
            0o700
        );
        assert_eq!(fs::read_dir(&a).unwrap().count(), 0, "new and empty");
        write_tree(&a).unwrap();
        assert!(a.join("class/infiniband_verbs/abi_version").is_file());
        for d in [&a, &b] {
            fs::remove_dir_all(d).unwrap();
        }
        fs::remove_file(&stale).unwrap();
    }

    /// Installs that run at once (nodes sharing a filesystem) all succeed
    /// and leave one whole tree and nothing else beside it.
    #[test]
    fn concurrent_tree_installs_all_succeed() {
        let base = fresh_tree_dir().unwrap();
        let dest = base.join("sysfs");
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6).map(|_| s.spawn(|| install_tree(&dest))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &results {
            assert!(r.is_ok(), "{r:?}");
        }
        let dev = dest.join("class/infiniband").join(identity::DEVICE_NAME);
        assert!(dev.join("ports/1/gids/0").is_file());
        let names: Vec<_> = fs::read_dir(&base)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("sysfs")]);
        fs::remove_dir_all(&base).unwrap();
    }
}
