//! A power cut for tests: an `LD_PRELOAD` shim that keeps, for every write
//! not yet fsynced under one directory, what it overwrote, so that after a
//! `kill -9` the directory can be put back as a power cut would leave it —
//! with only the synced writes.
//!
//! # Use
//!
//! ```text
//! LD_PRELOAD=target/debug/liblazaret_powercut.so \
//! LAZARET_POWERCUT_DIR=/path/to/data LAZARET_POWERCUT_JOURNAL=/elsewhere/undo \
//!     lazaret serve --data /path/to/data ...
//! kill -9 $PID
//! target/debug/lazaret-powercut-revert /elsewhere/undo
//! ```
//!
//! Without `LAZARET_POWERCUT_DIR` the shim passes every call through.
//!
//! # The model
//!
//! Before each `write`, `pwrite`, `pwrite64`, `writev`, `pwritev`,
//! `pwritev64` or `ftruncate` of a regular file under the directory, the
//! shim appends an undo record to the journal (the file's device and inode,
//! its path, the offset, the bytes that stood there and the file's size),
//! then makes the call. When `fsync` or `fdatasync` of a file returns
//! success — through any descriptor of it: lazaret's store fsyncs the WAL
//! through a second one — the records of that file written before the
//! fsync *began* are covered (a write racing the fsync is not). The revert
//! tool (`lazaret-powercut-revert`) undoes every
//! uncovered record, newest first. The disk it models loses every write
//! not covered by a completed fsync, whole, and keeps every covered one.
//!
//! # What it does not model
//!
//! - **Directory entries.** Creating, renaming and deleting files is
//!   taken as durable at once (no fsync of the directory is needed or
//!   checked). SQLite's WAL is created once and kept; lazaret does not
//!   rename files in the data directory.
//! - **The `-shm` file** (SQLite's wal-index) is mapped into memory and
//!   written through the mapping, which no shim sees; it is left out, and
//!   SQLite rebuilds it from the WAL when the first connection opens after
//!   the crash. Other memory-mapped writes are not seen either (SQLite's
//!   `mmap_size` is 0 in lazaret, so it writes the database with `pwrite`).
//! - **Partial writes.** An unsynced write is lost whole and a synced one
//!   kept whole: no torn sectors, no reordering of unsynced writes that
//!   keeps a later one and loses an earlier one, no `fallocate`,
//!   `O_DIRECT`, `O_SYNC` / `O_DSYNC` (taken as unsynced: lazaret does not
//!   use them), `sync_file_range`, `syncfs` or `sync`.
//! - Only one process writes the directory while the shim is loaded.
//!
//! Each tracked write costs an `fstat`, a `readlink`, a `pread` of the
//! bytes it overwrites and an append to the journal, under one lock: fine
//! for a test, not for a benchmark.

#[path = "journal.rs"]
mod journal;

use std::ffi::{CStr, c_int, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use libc::{iovec, off_t, size_t, ssize_t};

/// The directory whose files are journaled.
pub const DIR_VAR: &str = "LAZARET_POWERCUT_DIR";
/// The journal file (outside that directory); created, appended to.
pub const JOURNAL_VAR: &str = "LAZARET_POWERCUT_JOURNAL";

struct Shim {
    dir: PathBuf,
    journal_fd: c_int,
    /// The journal's length: where the next record starts. The lock also
    /// makes "journal the old bytes, then write" one step.
    journal_len: Mutex<u64>,
}

fn shim() -> Option<&'static Shim> {
    static SHIM: OnceLock<Option<Shim>> = OnceLock::new();
    SHIM.get_or_init(|| {
        let dir = std::env::var_os(DIR_VAR)?;
        let journal = std::env::var_os(JOURNAL_VAR)?;
        // The directory may not exist yet (the store makes it): resolve
        // what exists of it, so paths read back from /proc compare.
        let dir = PathBuf::from(dir);
        let dir = match (dir.parent(), dir.file_name()) {
            (Some(p), Some(n)) => std::fs::canonicalize(p).ok()?.join(n),
            _ => dir,
        };
        let mut path = journal.as_bytes().to_vec();
        path.push(0);
        // SAFETY: `path` is NUL-terminated; open is not interposed.
        let fd = unsafe {
            libc::open(
                path.as_ptr().cast(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC,
                0o644,
            )
        };
        if fd < 0 {
            return None;
        }
        // SAFETY: a plain fstat into a zeroed struct.
        let len = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &raw mut st) == 0 {
                st.st_size as u64
            } else {
                0
            }
        };
        Some(Shim {
            dir,
            journal_fd: fd,
            journal_len: Mutex::new(len),
        })
    })
    .as_ref()
}

/// The next definition of `name` after this library (libc's).
fn next(name: &CStr, slot: &OnceLock<usize>) -> usize {
    *slot.get_or_init(|| {
        // SAFETY: dlsym with a NUL-terminated name.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
        assert!(!p.is_null(), "lazaret-powercut: no next {name:?}");
        p as usize
    })
}

/// A regular file under the directory: its (dev, ino) and path.
struct Tracked {
    dev: u64,
    ino: u64,
    size: u64,
    path: Vec<u8>,
}

fn tracked(shim: &Shim, fd: c_int) -> Option<Tracked> {
    // SAFETY: fstat into a zeroed struct.
    let st = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &raw mut st) != 0 {
            return None;
        }
        st
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return None;
    }
    let path = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    if !path.starts_with(&shim.dir) || path.as_os_str().as_bytes().ends_with(b"-shm") {
        return None;
    }
    Some(Tracked {
        dev: st.st_dev,
        ino: st.st_ino,
        size: st.st_size as u64,
        path: path.into_os_string().into_vec(),
    })
}

use std::os::unix::ffi::OsStringExt;

fn append(shim: &Shim, len: &mut u64, rec: &[u8]) {
    let mut done = 0;
    while done < rec.len() {
        // SAFETY: the journal fd is ours; write via the raw syscall, never
        // through this shim's own `write`.
        let n = unsafe {
            libc::syscall(
                libc::SYS_write,
                shim.journal_fd,
                rec[done..].as_ptr(),
                rec.len() - done,
            )
        };
        if n <= 0 {
            // A journal that cannot be written makes the test a lie.
            std::process::abort();
        }
        done += n as usize;
    }
    *len += rec.len() as u64;
}

/// Journals what a write of `n` bytes at `offset` (None: the file
/// position, or the end with O_APPEND) or a truncation to `truncate_to`
/// will replace, and returns the lock to hold across the real call.
fn before(
    fd: c_int,
    offset: Option<u64>,
    n: u64,
    truncate_to: Option<u64>,
) -> Option<std::sync::MutexGuard<'static, u64>> {
    let shim = shim()?;
    let t = tracked(shim, fd)?;
    let mut len = shim.journal_len.lock().unwrap_or_else(|e| e.into_inner());
    let (at, end) = match truncate_to {
        Some(size) => (size.min(t.size), t.size),
        None => {
            let at = match offset {
                Some(o) => o,
                None => {
                    // SAFETY: fcntl and lseek on the caller's descriptor.
                    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
                    if flags >= 0 && flags & libc::O_APPEND != 0 {
                        t.size
                    } else {
                        let pos = unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) };
                        if pos < 0 { t.size } else { pos as u64 }
                    }
                }
            };
            (at, (at + n).min(t.size))
        }
    };
    let mut old = vec![0u8; end.saturating_sub(at) as usize];
    let mut got = 0;
    while got < old.len() {
        // SAFETY: pread into our own buffer; pread is not interposed.
        let r = unsafe {
            libc::pread(
                fd,
                old[got..].as_mut_ptr().cast(),
                old.len() - got,
                (at + got as u64) as off_t,
            )
        };
        if r <= 0 {
            break; // Not readable (write-only fd?): keep what we have.
        }
        got += r as usize;
    }
    old.truncate(got);
    let rec = journal::undo(t.dev, t.ino, &t.path, at, t.size, &old);
    append(shim, &mut len, &rec);
    Some(len)
}

fn iov_len(iov: *const iovec, cnt: c_int) -> u64 {
    if iov.is_null() || cnt <= 0 {
        return 0;
    }
    // SAFETY: the caller passes `cnt` iovecs, as libc requires.
    unsafe { std::slice::from_raw_parts(iov, cnt as usize) }
        .iter()
        .map(|v| v.iov_len as u64)
        .sum()
}

/// Runs a real fsync-like call and, when it succeeds, marks the file's
/// records journaled before it began as covered.
fn synced(fd: c_int, call: impl FnOnce() -> c_int) -> c_int {
    let Some(shim) = shim() else {
        return call();
    };
    let Some(t) = tracked(shim, fd) else {
        return call();
    };
    let upto = *shim.journal_len.lock().unwrap_or_else(|e| e.into_inner());
    let r = call();
    if r == 0 {
        let mut len = shim.journal_len.lock().unwrap_or_else(|e| e.into_inner());
        append(shim, &mut len, &journal::synced(t.dev, t.ino, upto));
    }
    r
}

macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static SLOT: OnceLock<usize> = OnceLock::new();
        let p = next($name, &SLOT);
        // SAFETY: `p` is libc's definition of that very function.
        unsafe { std::mem::transmute::<usize, $ty>(p) }
    }};
}

type WriteFn = unsafe extern "C" fn(c_int, *const c_void, size_t) -> ssize_t;
type PwriteFn = unsafe extern "C" fn(c_int, *const c_void, size_t, off_t) -> ssize_t;
type WritevFn = unsafe extern "C" fn(c_int, *const iovec, c_int) -> ssize_t;
type PwritevFn = unsafe extern "C" fn(c_int, *const iovec, c_int, off_t) -> ssize_t;
type TruncFn = unsafe extern "C" fn(c_int, off_t) -> c_int;
type SyncFn = unsafe extern "C" fn(c_int) -> c_int;

/// # Safety
/// As libc's `write`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    let f = real!(c"write", WriteFn);
    let _g = before(fd, None, n as u64, None);
    // SAFETY: the caller's arguments, passed on.
    unsafe { f(fd, buf, n) }
}

/// # Safety
/// As libc's `pwrite`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    let f = real!(c"pwrite", PwriteFn);
    let _g = before(fd, Some(off as u64), n as u64, None);
    // SAFETY: the caller's arguments, passed on.
    unsafe { f(fd, buf, n, off) }
}

/// # Safety
/// As libc's `pwrite64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    let f = real!(c"pwrite64", PwriteFn);
    let _g = before(fd, Some(off as u64), n as u64, None);
    // SAFETY: the caller's arguments, passed on.
    unsafe { f(fd, buf, n, off) }
}

/// # Safety
/// As libc's `writev`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let f = real!(c"writev", WritevFn);
    let _g = before(fd, None, iov_len(iov, cnt), None);
    // SAFETY: the caller's arguments, passed on.
    unsafe { f(fd, iov, cnt) }
}

/// # Safety
/// As libc's `pwritev`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pwritev(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    let f = real!(c"pwritev", PwritevFn);
    let _g = before(fd, Some(off as u64), iov_len(iov, cnt), None);
    // SAFETY: the caller's arguments, passed on.
    unsafe { f(fd, iov, cnt, off) }
}

/// # Safety
/// As libc's `pwritev64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pwritev64(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    off: off_t,
) -> ssize_t {
    let f = real!(c"pwritev64", PwritevFn);
    let _g = before(fd, Some(off as u64), iov_len(iov, cnt), None);
    // SAFETY: the caller's arguments, passed on.
    unsafe { f(fd, iov, cnt, off) }
}

/// # Safety
/// As libc's `ftruncate`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ftruncate(fd: c_int, len: off_t) -> c_int {
    let f = real!(c"ftruncate", TruncFn);
    let _g = before(fd, None, 0, Some(len.max(0) as u64));
    // SAFETY: the caller's arguments, passed on.
    unsafe { f(fd, len) }
}

/// # Safety
/// As libc's `ftruncate64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ftruncate64(fd: c_int, len: off_t) -> c_int {
    let f = real!(c"ftruncate64", TruncFn);
    let _g = before(fd, None, 0, Some(len.max(0) as u64));
    // SAFETY: the caller's arguments, passed on.
    unsafe { f(fd, len) }
}

/// # Safety
/// As libc's `fsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    let f = real!(c"fsync", SyncFn);
    // SAFETY: the caller's argument, passed on.
    synced(fd, || unsafe { f(fd) })
}

/// # Safety
/// As libc's `fdatasync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    let f = real!(c"fdatasync", SyncFn);
    // SAFETY: the caller's argument, passed on.
    synced(fd, || unsafe { f(fd) })
}
