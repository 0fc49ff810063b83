//! `lazaret-powercut-revert JOURNAL`: after the process that ran with the
//! shim was killed, undoes every write the journal shows unsynced, leaving
//! its directory as a power cut would have. Prints one line,
//! `writes=N undone=N bytes=N files=N`.

#[path = "../journal.rs"]
mod journal;

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(path), None) = (args.next(), args.next()) else {
        let _ = writeln!(std::io::stderr(), "usage: lazaret-powercut-revert JOURNAL");
        return ExitCode::from(2);
    };
    match journal::revert(path.as_ref()) {
        Ok(r) => {
            let _ = writeln!(
                std::io::stdout(),
                "writes={} undone={} bytes={} files={}",
                r.writes,
                r.undone,
                r.bytes,
                r.files
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "lazaret-powercut-revert: {}: {e}",
                path.to_string_lossy()
            );
            ExitCode::FAILURE
        }
    }
}
