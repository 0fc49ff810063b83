//! API tokens and the audit log (and the count an audit entry keeps of
//! what its request did).

use super::*;

impl Writer {
    pub(super) async fn audit(&mut self, e: &AuditEntry) -> Result<AuditId, StoreError> {
        let rows = self
            .query(
                "INSERT INTO audit (at, actor, action, request, count) VALUES ($1, $2, $3, $4, $5)
                 RETURNING id",
                &[
                    &ms(e.at),
                    &e.actor,
                    &e.action,
                    &e.request.to_string(),
                    &(e.count as i64),
                ],
            )
            .await?;
        Ok(AuditId(rows[0].get::<_, i64>(0) as u64))
    }

    pub(super) async fn audit_add(
        &mut self,
        audit: Option<AuditId>,
        n: u64,
    ) -> Result<(), StoreError> {
        if let (Some(id), 1..) = (audit, n) {
            self.execute(
                "UPDATE audit SET count = count + $2 WHERE id = $1",
                &[&(id.0 as i64), &(n as i64)],
            )
            .await?;
        }
        Ok(())
    }

    pub(super) async fn create_token(
        &mut self,
        t: &ApiToken,
        entry: &AuditEntry,
    ) -> Result<Result<(), TokenError>, StoreError> {
        if !self
            .query("SELECT 1 FROM tokens WHERE name = $1", &[&t.name])
            .await?
            .is_empty()
        {
            return Ok(Err(TokenError::NameTaken));
        }
        if !self
            .query(
                "SELECT 1 FROM tokens WHERE token_sha256 = $1",
                &[&t.token_sha256],
            )
            .await?
            .is_empty()
        {
            return Ok(Err(TokenError::SecretTaken));
        }
        self.execute(
            "INSERT INTO tokens (name, role, token_sha256, created_at, created_by)
             VALUES ($1, $2, $3, $4, $5)",
            &[
                &t.name,
                &t.role,
                &t.token_sha256,
                &ms(t.created_at),
                &t.created_by,
            ],
        )
        .await?;
        self.audit(entry).await?;
        self.tokens_changed().await?;
        Ok(Ok(()))
    }

    pub(super) async fn revoke_token(
        &mut self,
        name: &str,
        entry: &AuditEntry,
    ) -> Result<bool, StoreError> {
        let n = self
            .execute("DELETE FROM tokens WHERE name = $1", &[&name])
            .await?;
        if n == 0 {
            return Ok(false);
        }
        self.audit(entry).await?;
        self.tokens_changed().await?;
        Ok(true)
    }

    /// Tells every node (at commit) that the API tokens changed.
    pub(super) async fn tokens_changed(&mut self) -> Result<(), StoreError> {
        let channel = self.channels.tokens.clone();
        self.execute("SELECT pg_notify($1, '')", &[&channel])
            .await?;
        Ok(())
    }

    // -----------------------------------------------------------------
    // Broker messages.
}
