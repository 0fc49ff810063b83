//! The undo journal: its records, and the revert that applies them.
//!
//! Shared by the shim (which appends records) and the revert tool (which
//! reads them); both include this file as a module of their own.
//!
//! The journal is a sequence of records, little-endian, each starting with
//! a kind byte:
//!
//! - `UNDO` (1): `dev u64, ino u64, path_len u32, path, offset u64,
//!   old_size u64, old_len u32, old bytes` — written *before* a write or
//!   truncation of the file `(dev, ino)` at `path`: the bytes that stood in
//!   `[offset, offset + old_len)` and the file's size before it.
//! - `SYNCED` (2): `dev u64, ino u64, upto u64` — written after an fsync or
//!   fdatasync of the file returned success: every `UNDO` of that file that
//!   starts before byte `upto` of the journal (where the journal ended when
//!   the fsync began) is on stable storage.
//!
//! A torn last record (the process was killed while appending it) is
//! ignored: its write had not been made yet.

#![allow(dead_code)] // Each of the two crates that include it uses half.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub const UNDO: u8 = 1;
pub const SYNCED: u8 = 2;

/// An `UNDO` record, encoded.
pub fn undo(dev: u64, ino: u64, path: &[u8], offset: u64, old_size: u64, old: &[u8]) -> Vec<u8> {
    let mut rec = Vec::with_capacity(41 + path.len() + old.len());
    rec.push(UNDO);
    rec.extend_from_slice(&dev.to_le_bytes());
    rec.extend_from_slice(&ino.to_le_bytes());
    rec.extend_from_slice(&u32::try_from(path.len()).unwrap_or(u32::MAX).to_le_bytes());
    rec.extend_from_slice(path);
    rec.extend_from_slice(&offset.to_le_bytes());
    rec.extend_from_slice(&old_size.to_le_bytes());
    rec.extend_from_slice(&u32::try_from(old.len()).unwrap_or(u32::MAX).to_le_bytes());
    rec.extend_from_slice(old);
    rec
}

/// A `SYNCED` record, encoded.
pub fn synced(dev: u64, ino: u64, upto: u64) -> [u8; 25] {
    let mut rec = [0u8; 25];
    rec[0] = SYNCED;
    rec[1..9].copy_from_slice(&dev.to_le_bytes());
    rec[9..17].copy_from_slice(&ino.to_le_bytes());
    rec[17..25].copy_from_slice(&upto.to_le_bytes());
    rec
}

/// One undo, as read back.
#[derive(Debug)]
struct Undo {
    /// Where the record starts in the journal.
    at: u64,
    file: (u64, u64),
    path: PathBuf,
    offset: u64,
    old_size: u64,
    old: Vec<u8>,
}

/// What a revert did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reverted {
    /// Writes and truncations journaled.
    pub writes: usize,
    /// Of those, undone (not covered by an fsync of their file).
    pub undone: usize,
    /// Bytes put back.
    pub bytes: u64,
    /// Files touched by the undone writes.
    pub files: usize,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
}

/// Applies the journal at `journal`: undoes, newest first, every write and
/// truncation that no later fsync of its file covered, restoring each
/// file's bytes and size. Run it only after the process that wrote the
/// journal is dead.
pub fn revert(journal: &Path) -> io::Result<Reverted> {
    use std::os::unix::ffi::OsStrExt;
    let buf = std::fs::read(journal)?;
    let mut r = Reader { buf: &buf, pos: 0 };
    let mut undos = Vec::new();
    let mut synced_upto: HashMap<(u64, u64), u64> = HashMap::new();
    loop {
        let at = r.pos as u64;
        let Some(kind) = r.take(1).map(|k| k[0]) else {
            break;
        };
        let parsed = match kind {
            UNDO => (|| {
                let file = (r.u64()?, r.u64()?);
                let n = r.u32()? as usize;
                let path = PathBuf::from(std::ffi::OsStr::from_bytes(r.take(n)?));
                let offset = r.u64()?;
                let old_size = r.u64()?;
                let n = r.u32()? as usize;
                let old = r.take(n)?.to_vec();
                undos.push(Undo {
                    at,
                    file,
                    path,
                    offset,
                    old_size,
                    old,
                });
                Some(())
            })(),
            SYNCED => (|| {
                let file = (r.u64()?, r.u64()?);
                let upto = r.u64()?;
                let e = synced_upto.entry(file).or_insert(0);
                *e = (*e).max(upto);
                Some(())
            })(),
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "journal {}: unknown record kind {other} at byte {at}",
                        journal.display()
                    ),
                ));
            }
        };
        if parsed.is_none() {
            break; // A torn last record.
        }
    }
    let mut done = Reverted {
        writes: undos.len(),
        ..Reverted::default()
    };
    let mut files = std::collections::HashSet::new();
    for u in undos.iter().rev() {
        if u.at < synced_upto.get(&u.file).copied().unwrap_or(0) {
            continue;
        }
        let f = OpenOptions::new().write(true).open(&u.path)?;
        f.write_all_at(&u.old, u.offset)?;
        f.set_len(u.old_size)?;
        done.undone += 1;
        done.bytes += u.old.len() as u64;
        files.insert(u.file);
    }
    done.files = files.len();
    Ok(done)
}
