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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A file with `bytes`, and an empty journal, in a directory of their own.
    fn setup(name: &str, bytes: &[u8]) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("powercut-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, bytes).unwrap();
        (file, dir.join("journal"))
    }

    /// Journals and makes a write, as the shim does.
    fn write_at(file: &Path, journal: &mut Vec<u8>, offset: u64, bytes: &[u8]) {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(file).unwrap();
        let old = std::fs::read(file).unwrap();
        let end = (offset as usize + bytes.len()).min(old.len());
        let start = (offset as usize).min(old.len());
        let path = file.as_os_str().as_encoded_bytes();
        journal.extend(undo(
            meta.dev(),
            meta.ino(),
            path,
            offset,
            meta.len(),
            &old[start..end],
        ));
        let f = OpenOptions::new().write(true).open(file).unwrap();
        f.write_all_at(bytes, offset).unwrap();
    }

    fn sync(file: &Path, journal: &mut Vec<u8>, upto: usize) {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(file).unwrap();
        journal.extend(synced(meta.dev(), meta.ino(), upto as u64));
    }

    #[test]
    fn unsynced_writes_are_undone_and_synced_ones_kept() {
        let (file, jpath) = setup("undo", b"aaaa");
        let mut j = Vec::new();
        write_at(&file, &mut j, 0, b"bb"); // synced below
        let before_sync = j.len();
        write_at(&file, &mut j, 2, b"cccc"); // races the fsync: not covered
        sync(&file, &mut j, before_sync);
        write_at(&file, &mut j, 8, b"dd"); // after: not covered, grows the file
        std::fs::write(&jpath, &j).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"bbcccc\0\0dd");
        let r = revert(&jpath).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"bbaa");
        assert_eq!((r.writes, r.undone, r.files), (3, 2, 1));
    }

    #[test]
    fn a_truncation_is_undone_and_a_torn_record_ignored() {
        let (file, jpath) = setup("trunc", b"hello world");
        let mut j = Vec::new();
        // A truncation to 5, journaled as the shim does: the tail and the size.
        {
            use std::os::unix::fs::MetadataExt;
            let meta = std::fs::metadata(&file).unwrap();
            let path = file.as_os_str().as_encoded_bytes();
            j.extend(undo(meta.dev(), meta.ino(), path, 5, 11, b" world"));
            OpenOptions::new()
                .write(true)
                .open(&file)
                .unwrap()
                .set_len(5)
                .unwrap();
        }
        let torn = undo(1, 2, b"/nowhere", 0, 0, b"xyz");
        j.extend(&torn[..torn.len() - 1]);
        std::fs::File::create(&jpath)
            .unwrap()
            .write_all(&j)
            .unwrap();
        let r = revert(&jpath).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"hello world");
        assert_eq!((r.writes, r.undone), (1, 1));
    }
}
