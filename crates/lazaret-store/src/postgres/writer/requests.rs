//! Runs each [`Request`] with the writer's function for it (in the file
//! named for its concern), on the group's clock.

use super::*;

impl Writer {
    pub(super) async fn exec<'a>(
        &mut self,
        op: &'a Request,
        db_now: Option<Timestamp>,
    ) -> Result<Held<'a>, StoreError> {
        // On the database's clock, a caller's times keep their distance from
        // the caller's `now` but count from the database's.
        let rebase = |t: Timestamp, now: Timestamp| rebase(db_now, t, now);
        let now_of = |now: Timestamp| db_now.unwrap_or(now);
        Ok(match op {
            Request::Enqueue { jobs, reply } => {
                let jobs: Vec<NewJob> = jobs
                    .iter()
                    .map(|j| NewJob {
                        run_at: rebase(j.run_at, j.now),
                        now: now_of(j.now),
                        ..j.clone()
                    })
                    .collect();
                held(reply, self.enqueue(&jobs).await?)
            }
            Request::Lease { req, reply } => {
                self.leases += 1;
                let req = LeaseRequest {
                    now: now_of(req.now),
                    ..req.clone()
                };
                held(reply, self.lease(&req).await?)
            }
            Request::Complete { items, now, reply } => {
                let items: Vec<&Completion> = items.iter().collect();
                held(reply, self.complete(&items, now_of(*now)).await?)
            }
            Request::Heartbeat {
                id,
                token,
                expires_at,
                now,
                reply,
            } => {
                let until = rebase(*expires_at, *now);
                held(
                    reply,
                    self.heartbeat(*id, *token, until, now_of(*now)).await?,
                )
            }
            Request::Cancel {
                id,
                now,
                audit,
                reply,
            } => held(reply, self.cancel(*id, now_of(*now), audit.clone()).await?),
            Request::SetPause {
                target,
                paused,
                audit,
                reply,
            } => held(reply, self.set_pause(target, *paused, audit).await?),
            Request::Tick { now, reply } => held(reply, self.tick(now_of(*now)).await?),
            Request::RecordAdmission { rec, reply } => {
                let rec = AdmissionRecord {
                    now: now_of(rec.now),
                    ..rec.clone()
                };
                held(reply, self.record_admission(&rec).await?)
            }
            Request::Redrive {
                ids,
                to,
                now,
                audit,
                reply,
            } => held(reply, self.redrive(ids, to, now_of(*now), *audit).await?),
            Request::RedriveCorrected {
                id,
                fix,
                now,
                audit,
                reply,
            } => held(
                reply,
                self.redrive_corrected(*id, fix, now_of(*now), *audit)
                    .await?,
            ),
            Request::Purge { ids, audit, reply } => held(reply, self.purge(ids, *audit).await?),
            Request::Archive {
                ids,
                archived,
                now,
                audit,
                reply,
            } => held(
                reply,
                self.archive(ids, *archived, now_of(*now), *audit).await?,
            ),
            Request::Audit { entry, reply } => held(reply, self.audit(entry).await?),
            Request::RecordRedrive { id, audit, reply } => {
                held(reply, self.record_redrive(id, *audit).await?)
            }
            Request::RedroveMessage {
                id,
                redrive,
                now,
                audit,
                reply,
            } => held(
                reply,
                self.redrove_message(*id, redrive, now_of(*now), *audit)
                    .await?,
            ),
            Request::RedrivenMessageSucceeded { key, now, reply } => held(
                reply,
                self.redriven_message_succeeded(key, now_of(*now)).await?,
            ),
            Request::Stats { reply } => held(reply, self.stats().await?),
            Request::WriteSignals {
                minute,
                rows,
                keep_after,
                reply,
            } => held(reply, self.write_signals(*minute, rows, *keep_after).await?),
            Request::RemoveSucceeded {
                before,
                batch,
                reply,
            } => held(reply, self.remove_succeeded(*before, *batch).await?),
            Request::CreateToken {
                token,
                audit,
                reply,
            } => held(reply, self.create_token(token, audit).await?),
            Request::RevokeToken { name, audit, reply } => {
                held(reply, self.revoke_token(name, audit).await?)
            }
            Request::Quarantine { dls, reply } => {
                let mut out = Vec::with_capacity(dls.len());
                for dl in dls {
                    out.push(self.quarantine(dl).await?);
                }
                held(reply, out)
            }
            Request::HoldRetry { p, reply } => {
                self.hold_retry(p).await?;
                held(reply, ())
            }
            Request::ReleaseHeldRetry { key, reply } => {
                held(reply, self.release_held_retry(key).await?)
            }
            // Claims run on a reader connection (`Postgres::claim_held_retries`).
            Request::ClaimDue { .. } => {
                return Err(corrupt(
                    "a claim of held retries reached the PostgreSQL writer, which does not run them",
                ));
            }
        })
    }

    // -----------------------------------------------------------------
    // Jobs.
}
