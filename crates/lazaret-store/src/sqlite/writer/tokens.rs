//! API tokens and the audit log (and the count an audit entry keeps of
//! what its request did).

use super::*;

impl Writer {
    pub(super) fn audit(&mut self, entry: AuditEntry) -> Result<crate::AuditId, StoreError> {
        self.write_audit(&entry)
    }

    /// Writes an audit entry, in the transaction of what it records.
    pub(super) fn write_audit(&mut self, e: &AuditEntry) -> Result<crate::AuditId, StoreError> {
        db(self
            .conn
            .prepare_cached(
                "INSERT INTO audit (at, actor, action, request, count) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                ms(e.at),
                e.actor,
                e.action,
                e.request.to_string(),
                e.count as i64
            ]))?;
        Ok(crate::AuditId(self.conn.last_insert_rowid() as u64))
    }

    /// Adds `n` to an audit entry's count, in the transaction of what it counts.
    pub(super) fn audit_add(
        &mut self,
        audit: Option<crate::AuditId>,
        n: u64,
    ) -> Result<(), StoreError> {
        if let (Some(id), 1..) = (audit, n) {
            db(self
                .conn
                .prepare_cached("UPDATE audit SET count = count + ?2 WHERE id = ?1")?
                .execute(params![id.0 as i64, n as i64]))?;
        }
        Ok(())
    }

    /// Inserts an API token and its audit entry. A taken name or secret is
    /// checked first and answered as a refusal, not a failed command, so it
    /// does not roll back the rest of the group.
    pub(super) fn create_token(
        &mut self,
        t: crate::ApiToken,
        entry: AuditEntry,
    ) -> Result<Result<(), crate::TokenError>, StoreError> {
        let taken = |sql: &str, value: &str| -> Result<bool, StoreError> {
            db(self
                .conn
                .prepare_cached(sql)?
                .query_row(params![value], |_| Ok(()))
                .optional())
            .map(|row| row.is_some())
        };
        if taken("SELECT 1 FROM tokens WHERE name = ?1", &t.name)? {
            return Ok(Err(crate::TokenError::NameTaken));
        }
        if taken(
            "SELECT 1 FROM tokens WHERE token_sha256 = ?1",
            &t.token_sha256,
        )? {
            return Ok(Err(crate::TokenError::SecretTaken));
        }
        db(self
            .conn
            .prepare_cached(
                "INSERT INTO tokens (name, role, token_sha256, created_at, created_by)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                t.name,
                t.role,
                t.token_sha256,
                ms(t.created_at),
                t.created_by
            ]))?;
        self.write_audit(&entry)?;
        Ok(Ok(()))
    }

    /// Deletes an API token and writes its audit entry; `false` when unknown.
    pub(super) fn revoke_token(
        &mut self,
        name: String,
        entry: AuditEntry,
    ) -> Result<bool, StoreError> {
        let n = db(self
            .conn
            .prepare_cached("DELETE FROM tokens WHERE name = ?1")?
            .execute(params![name]))?;
        if n == 0 {
            return Ok(false);
        }
        self.write_audit(&entry)?;
        Ok(true)
    }
}
