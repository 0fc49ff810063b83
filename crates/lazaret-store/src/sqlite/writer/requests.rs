//! Runs each [`Request`] with the writer's function for it (in the file
//! named for its concern), and the writer's own commands.

use super::*;

impl Writer {
    /// Runs one command; returns its held-back answer and whether it succeeded.
    pub(super) fn execute(&mut self, cmd: Cmd) -> (Pending, bool) {
        macro_rules! run {
            ($tx:expr, $e:expr) => {{
                let r = $e;
                let ok = r.is_ok();
                (pend($tx, r), ok)
            }};
        }
        let r = match cmd {
            Cmd::Request(r) => r,
            Cmd::Close(tx) => return run!(tx, Ok(())),
            #[cfg(test)]
            Cmd::Sql(sql, gate, tx) => {
                let _ = gate.recv();
                return run!(tx, db(self.conn.execute_batch(&sql)));
            }
            #[cfg(any(test, feature = "test-hooks"))]
            Cmd::Hold(held, resume) => {
                let _ = held.send(());
                let _ = resume.recv();
                return (Box::new(|_: Option<StoreError>| {}), true);
            }
            #[cfg(any(test, feature = "test-hooks"))]
            Cmd::Crash => panic!("the writer crashed (a test hook)"),
        };
        match r {
            Request::Enqueue { jobs, reply } => run!(reply, self.enqueue(jobs)),
            Request::Lease { req, reply } => run!(reply, self.lease(&req)),
            Request::Complete { items, now, reply } => run!(reply, self.complete(items, now)),
            Request::Heartbeat {
                id,
                token,
                expires_at,
                now,
                reply,
            } => run!(reply, self.heartbeat(id, token, expires_at, now)),
            Request::Cancel {
                id,
                now,
                audit,
                reply,
            } => run!(reply, self.cancel(id, now, audit)),
            Request::SetPause {
                target,
                paused,
                audit,
                reply,
            } => run!(reply, self.set_pause(&target, paused, &audit)),
            Request::Tick { now, reply } => run!(reply, self.tick(now)),
            Request::RecordAdmission { rec, reply } => run!(reply, self.record_admission(&rec)),
            Request::Redrive {
                ids,
                to,
                now,
                audit,
                reply,
            } => run!(reply, self.redrive(&ids, &to, now, audit)),
            Request::RedriveCorrected {
                id,
                fix,
                now,
                audit,
                reply,
            } => run!(reply, self.redrive_corrected(id, &fix, now, audit)),
            Request::Purge { ids, audit, reply } => run!(reply, self.purge(&ids, audit)),
            Request::Archive {
                ids,
                archived,
                now,
                audit,
                reply,
            } => run!(reply, self.archive(&ids, archived, now, audit)),
            Request::Audit { entry, reply } => run!(reply, self.audit(&entry)),
            Request::RecordRedrive { id, audit, reply } => {
                run!(reply, self.record_redrive(&id, audit))
            }
            Request::RedroveMessage {
                id,
                redrive,
                now,
                audit,
                reply,
            } => run!(reply, self.redrove_message(id, &redrive, now, audit)),
            Request::RedrivenMessageSucceeded { key, now, reply } => {
                run!(reply, self.redriven_message_succeeded(&key, now))
            }
            Request::Stats { reply } => run!(reply, self.stats()),
            Request::WriteSignals {
                minute,
                rows,
                keep_after,
                reply,
            } => run!(reply, self.write_signals(minute, &rows, keep_after)),
            Request::RemoveSucceeded {
                before,
                batch,
                reply,
            } => run!(reply, self.remove_succeeded(before, batch)),
            Request::CreateToken {
                token,
                audit,
                reply,
            } => run!(reply, self.create_token(&token, &audit)),
            Request::RevokeToken { name, audit, reply } => {
                run!(reply, self.revoke_token(&name, &audit))
            }
            Request::Quarantine { dls, reply } => run!(reply, self.quarantine(&dls)),
            Request::HoldRetry { p, reply } => run!(reply, self.hold_retry(&p)),
            Request::ReleaseHeldRetry { key, reply } => run!(reply, self.release_held_retry(&key)),
            Request::ClaimDue { claim, reply } => run!(reply, self.claim_due(&claim)),
        }
    }
}
