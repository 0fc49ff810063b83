//! Broker messages: their dead letters, held retries and claims
//! (`super::super::sources` holds their SQL).

use super::*;

impl Writer {
    pub(super) fn quarantine(
        &mut self,
        dls: Vec<crate::SourceDeadLetter>,
    ) -> Result<Vec<crate::Quarantined>, StoreError> {
        dls.iter()
            .map(|dl| super::super::sources::quarantine(&self.conn, dl))
            .collect()
    }

    pub(super) fn hold_retry(&mut self, p: Box<crate::HeldRetry>) -> Result<(), StoreError> {
        super::super::sources::hold_retry(&self.conn, &p)
    }

    pub(super) fn release_held_retry(
        &mut self,
        key: Box<crate::MessageKey>,
    ) -> Result<bool, StoreError> {
        super::super::sources::release_held_retry(&self.conn, &key)
    }

    pub(super) fn redriven_message_succeeded(
        &mut self,
        key: Box<crate::MessageKey>,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        super::super::sources::redriven_message_succeeded(&self.conn, &key, now)
    }

    pub(super) fn claim_due(
        &mut self,
        claim: Box<Claim>,
    ) -> Result<Vec<crate::ClaimedRetry>, StoreError> {
        super::super::sources::claim_due(&self.conn, &claim)
    }
}
