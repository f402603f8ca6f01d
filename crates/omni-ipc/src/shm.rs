//! Shared-memory segments: `shm_open` + `mmap`, created mode 0600 under `/dev/shm` with names
//! `omni.<instance>.<channel>`, unlinked by their creator on drop, and swept at start-up when
//! their creator is dead.
//!
//! Every segment starts with a one-page [`SegmentHeader`] recording who created it (pid and
//! process start time, so a recycled pid is not mistaken for the creator). The caller's region
//! follows the header; [`ShmSegment::as_ptr`] points at it.
//!
//! Mappings are made with `MAP_POPULATE`, so page-table faults are paid at start-up rather
//! than by the first messages (they showed as a 4 ms p99 on 11 MiB payloads).
//!
//! Before creating, free space in `/dev/shm` is checked and the pages are reserved with
//! `posix_fallocate`, so a too-small tmpfs is a clear error at start-up and never a SIGBUS later.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use memmap2::MmapMut;

use crate::IpcError;

/// Where POSIX shared memory lives on Linux.
pub const SHM_DIR: &str = "/dev/shm";
/// Prefix of every segment this project creates.
pub const SEGMENT_PREFIX: &str = "omni.";
/// Bytes reserved at the start of every segment for the header.
pub const HEADER_BYTES: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"OMNISEG1");
/// A segment without a valid header (its creator died while creating it) is swept once it is
/// this old.
const HEADERLESS_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// `omni.<instance>.<channel>`: deterministic per engine instance and channel.
pub fn segment_name(instance: &str, channel: &str) -> String {
    format!("{SEGMENT_PREFIX}{instance}.{channel}")
}

/// A fresh instance id for this process: `<pid>x<random hex>`.
pub fn new_instance_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{}x{:x}",
        std::process::id(),
        nanos ^ (std::process::id().rotate_left(16))
    )
}

/// The header at offset 0 of every segment.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SegmentHeader {
    /// `OMNISEG1`.
    pub magic: u64,
    /// Creator's pid.
    pub creator_pid: u32,
    /// Padding.
    pub _pad: u32,
    /// Creator's start time (clock ticks since boot, `/proc/<pid>/stat` field 22).
    pub creator_start: u64,
    /// Bytes of the caller's region (after the header).
    pub len: u64,
}

/// A mapped shared-memory segment.
#[derive(Debug)]
pub struct ShmSegment {
    name: String,
    map: MmapMut,
    owner: bool,
}

fn c_name(name: &str) -> Result<CString, IpcError> {
    if name.is_empty() || name.contains('/') || name.len() > 200 {
        return Err(IpcError::Config(format!("bad shared memory name {name:?}")));
    }
    CString::new(format!("/{name}"))
        .map_err(|_| IpcError::Config(format!("bad shared memory name {name:?}")))
}

fn shm_err(name: &str, op: &'static str) -> IpcError {
    IpcError::Shm {
        name: name.to_string(),
        op,
        source: std::io::Error::last_os_error(),
    }
}

/// Free bytes in the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let c = CString::new(dir.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a valid NUL-terminated path and `st` points to writable storage of the
    // right type; statvfs fills it on success.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialized `st`.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail * st.f_frsize)
}

/// This process's start time in clock ticks since boot (0 if unknown).
pub fn process_start_time(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // Field 2 (comm) may contain spaces and parentheses: parse after the last ')'.
    stat.rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().nth(19))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Whether process `pid` exists and, when `start` is non-zero, is the same process that had
/// that start time (not a recycled pid). Zombies count as dead.
pub fn process_alive(pid: u32, start: u64) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    let state = fields.next().unwrap_or("X");
    if state == "Z" || state == "X" {
        return false;
    }
    if start == 0 {
        return true;
    }
    rest.split_whitespace()
        .nth(19)
        .and_then(|s| s.parse::<u64>().ok())
        == Some(start)
}

impl ShmSegment {
    /// Creates segment `name` with a region of `len` bytes (zeroed), mode 0600.
    ///
    /// Fails with [`IpcError::ShmTooSmall`] when `/dev/shm` cannot hold it. A stale segment of
    /// the same name whose creator is dead is removed first.
    pub fn create(name: &str, len: usize) -> Result<Self, IpcError> {
        let cname = c_name(name)?;
        let total = (HEADER_BYTES + len) as u64;
        let available = free_bytes(Path::new(SHM_DIR)).map_err(|source| IpcError::Shm {
            name: name.to_string(),
            op: "statvfs(/dev/shm)",
            source,
        })?;
        if total > available {
            return Err(IpcError::ShmTooSmall {
                name: name.to_string(),
                needed: total,
                available,
            });
        }
        let open = || {
            // SAFETY: `cname` is a valid NUL-terminated name; shm_open has no other
            // preconditions. The returned fd is checked below.
            unsafe {
                libc::shm_open(
                    cname.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                    0o600,
                )
            }
        };
        let mut fd = open();
        if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) {
            if sweep_one(name) {
                fd = open();
            } else {
                return Err(IpcError::Shm {
                    name: name.to_string(),
                    op: "shm_open (a live process owns a segment of this name)",
                    source: std::io::Error::from_raw_os_error(libc::EEXIST),
                });
            }
        }
        if fd < 0 {
            return Err(shm_err(name, "shm_open"));
        }
        // SAFETY: `fd` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // From here on, failures must unlink the name we just created.
        let fail = |e: IpcError| {
            // SAFETY: valid NUL-terminated name.
            unsafe { libc::shm_unlink(cname.as_ptr()) };
            e
        };
        // SAFETY: valid fd; fchmod has no memory preconditions. Enforces 0600 whatever the umask.
        if unsafe { libc::fchmod(fd.as_raw_fd(), 0o600) } != 0 {
            return Err(fail(shm_err(name, "fchmod")));
        }
        // SAFETY: valid fd. posix_fallocate reserves tmpfs pages now, so the mapping cannot
        // SIGBUS later when the filesystem fills up.
        let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, total as libc::off_t) };
        if rc != 0 {
            let available = free_bytes(Path::new(SHM_DIR)).unwrap_or(0);
            return Err(fail(if rc == libc::ENOSPC {
                IpcError::ShmTooSmall {
                    name: name.to_string(),
                    needed: total,
                    available,
                }
            } else {
                IpcError::Shm {
                    name: name.to_string(),
                    op: "posix_fallocate",
                    source: std::io::Error::from_raw_os_error(rc),
                }
            }));
        }
        let file = std::fs::File::from(fd);
        // SAFETY: the file is a shared-memory object sized `total` above. Mapping it shared is
        // the point; all concurrent access to the mapping goes through atomics or through the
        // ring protocol that gives one side exclusive access to a slot at a time.
        let mut map =
            unsafe { memmap2::MmapOptions::new().populate().map_mut(&file) }.map_err(|source| {
                fail(IpcError::Shm {
                    name: name.to_string(),
                    op: "mmap",
                    source,
                })
            })?;
        let pid = std::process::id();
        let header = SegmentHeader {
            magic: MAGIC,
            creator_pid: pid,
            _pad: 0,
            creator_start: process_start_time(pid),
            len: len as u64,
        };
        // SAFETY: the mapping is at least HEADER_BYTES long and page aligned; nobody else has
        // the segment yet (we created it exclusively and have not published its name).
        unsafe { std::ptr::write(map.as_mut_ptr() as *mut SegmentHeader, header) };
        Ok(Self {
            name: name.to_string(),
            map,
            owner: true,
        })
    }

    /// Opens an existing segment created by another process.
    pub fn open(name: &str) -> Result<Self, IpcError> {
        let cname = c_name(name)?;
        // SAFETY: valid NUL-terminated name.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            return Err(shm_err(name, "shm_open"));
        }
        // SAFETY: fresh descriptor we own.
        let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        // SAFETY: see `create`; the creator sized the object before publishing its name.
        let map =
            unsafe { memmap2::MmapOptions::new().populate().map_mut(&file) }.map_err(|source| {
                IpcError::Shm {
                    name: name.to_string(),
                    op: "mmap",
                    source,
                }
            })?;
        let bad = |reason: &str| IpcError::BadSegment {
            name: name.to_string(),
            reason: reason.to_string(),
        };
        if map.len() < HEADER_BYTES {
            return Err(bad("shorter than its header"));
        }
        // SAFETY: at least HEADER_BYTES are mapped; the header was written before the name
        // was handed out and is never written again.
        let header = unsafe { std::ptr::read(map.as_ptr() as *const SegmentHeader) };
        if header.magic != MAGIC {
            return Err(bad("bad magic"));
        }
        if header.len as usize + HEADER_BYTES > map.len() {
            return Err(bad("header length exceeds the mapping"));
        }
        Ok(Self {
            name: name.to_string(),
            map,
            owner: false,
        })
    }

    /// The segment's name (without `/`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Start of the caller's region (after the header), page aligned.
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: the mapping is at least HEADER_BYTES long, so the offset stays in bounds.
        unsafe { self.map.as_ptr().add(HEADER_BYTES) as *mut u8 }
    }

    /// Bytes of the caller's region.
    pub fn len(&self) -> usize {
        self.map.len() - HEADER_BYTES
    }

    /// Whether the caller's region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The header.
    pub fn header(&self) -> SegmentHeader {
        // SAFETY: validated at open/create; immutable after creation.
        unsafe { std::ptr::read(self.map.as_ptr() as *const SegmentHeader) }
    }

    /// Whether this handle created (and will unlink) the segment.
    pub fn is_owner(&self) -> bool {
        self.owner
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        if self.owner
            && let Ok(c) = c_name(&self.name)
        {
            // SAFETY: valid NUL-terminated name; unlinking only removes the name, live
            // mappings in other processes stay valid until they unmap.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
}

/// Removes `name` if its creator is dead. Returns whether it is gone.
fn sweep_one(name: &str) -> bool {
    let path = Path::new(SHM_DIR).join(name);
    let Ok(mut f) = std::fs::File::open(&path) else {
        return !path.exists();
    };
    let mut buf = [0u8; std::mem::size_of::<SegmentHeader>()];
    let dead = match std::io::Read::read_exact(&mut f, &mut buf) {
        Ok(()) => {
            let magic = u64::from_le_bytes(buf[0..8].try_into().unwrap_or_default());
            let pid = u32::from_le_bytes(buf[8..12].try_into().unwrap_or_default());
            let start = u64::from_le_bytes(buf[16..24].try_into().unwrap_or_default());
            if magic == MAGIC {
                !process_alive(pid, start)
            } else {
                headerless_and_old(&f)
            }
        }
        Err(_) => headerless_and_old(&f),
    };
    if dead {
        tracing::info!(
            segment = name,
            "removing stale shared memory segment of a dead process"
        );
        let _ = std::fs::remove_file(&path);
    }
    dead
}

fn headerless_and_old(f: &std::fs::File) -> bool {
    f.metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age > HEADERLESS_GRACE)
}

/// Removes every segment in `/dev/shm` whose name starts with `prefix`, whoever is still mapping
/// it (a mapping outlives the name); returns the names removed.
pub fn remove_segments_with_prefix(prefix: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(prefix) && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// Removes every `omni.<pid>x*` segment: those of the engine instances process `pid` created
/// (instance ids begin with the creating process's pid, [`new_instance_id`]), its workers'
/// included.
pub fn remove_segments_of(pid: u32) -> Vec<String> {
    remove_segments_with_prefix(&format!("{SEGMENT_PREFIX}{pid}x"))
}

/// Removes every `omni.*` segment in `/dev/shm` whose creator process is dead (after a crash
/// or kill -9). Returns the names removed. Segments of live processes are left alone.
pub fn sweep_stale() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(SEGMENT_PREFIX) && sweep_one(&name) {
            removed.push(name);
        }
    }
    removed
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn unique(channel: &str) -> String {
        segment_name(&new_instance_id(), channel)
    }

    #[test]
    fn segment_is_mode_0600_and_unlinked_on_drop() {
        let name = unique("t0600");
        let seg = ShmSegment::create(&name, 8192).unwrap();
        let path = Path::new(SHM_DIR).join(&name);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(seg.len(), 8192);
        drop(seg);
        assert!(!path.exists());
    }

    #[test]
    fn reader_sees_creator_bytes() {
        let name = unique("tshare");
        let seg = ShmSegment::create(&name, 4096).unwrap();
        // SAFETY: test writes within the region.
        unsafe { *seg.as_ptr().add(10) = 42 };
        let other = ShmSegment::open(&name).unwrap();
        // SAFETY: test reads within the region.
        assert_eq!(unsafe { *other.as_ptr().add(10) }, 42);
        assert!(!other.is_owner());
        assert_eq!(other.header().creator_pid, std::process::id());
    }

    #[test]
    fn too_small_dev_shm_is_a_clear_error() {
        let free = free_bytes(Path::new(SHM_DIR)).unwrap();
        let name = unique("thuge");
        let err =
            ShmSegment::create(&name, (free as usize).saturating_mul(2) + (1 << 30)).unwrap_err();
        assert!(matches!(err, IpcError::ShmTooSmall { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("not enough free space in /dev/shm")
        );
        assert!(!Path::new(SHM_DIR).join(&name).exists());
    }

    #[test]
    fn sweep_keeps_segments_of_live_processes() {
        let name = unique("tlive");
        let _seg = ShmSegment::create(&name, 4096).unwrap();
        let removed = sweep_stale();
        assert!(!removed.contains(&name));
        assert!(Path::new(SHM_DIR).join(&name).exists());
    }

    #[test]
    fn sweep_removes_segment_of_dead_creator() {
        let name = unique("tdead");
        let seg = ShmSegment::create(&name, 4096).unwrap();
        // Pretend the creator is a pid that cannot exist.
        // SAFETY: the header is at the start of the mapping; we own it.
        unsafe {
            let h = seg.map.as_ptr() as *mut SegmentHeader;
            (*h).creator_pid = u32::MAX - 1;
        }
        std::mem::forget(seg);
        assert!(sweep_stale().contains(&name));
        assert!(!Path::new(SHM_DIR).join(&name).exists());
    }
}
