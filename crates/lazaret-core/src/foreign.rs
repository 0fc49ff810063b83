//! Messages of a foreign broker: how many attempts a delivery has already
//! spent, and what the deliveries lazaret never saw end (a consumer that
//! died mid-message) count for.
//!
//! A broker message carries no envelope. What lazaret knows of its past is
//! two numbers: the `x-lazaret-attempt` header, which lazaret writes when it
//! republishes a message (attempts already charged), and the broker's own
//! count of earlier deliveries that lazaret did not cause itself (RabbitMQ
//! quorum `x-delivery-count`, JetStream deliveries − 1, Redis delivery
//! count − 1, SQS `ApproximateReceiveCount` − 1). The larger of the two is
//! the attempts spent; the broker deliveries above the header are attempts
//! whose consumer died, which are lease expiries as far as the policy is
//! concerned (they count towards `crash_loop_max`).

use crate::bound::normalize_attempt_header;
use crate::decide::{Event, Transition, decide, grant_lease};
use crate::envelope::Envelope;
use crate::failure::DeadLetterReason;
use crate::policy::TypePolicy;
use crate::rng::Entropy;
use crate::time::Timestamp;

/// The attempts a foreign delivery has spent before this one: the larger of
/// the `x-lazaret-attempt` header (raw bytes; missing or malformed: 0) and
/// the broker's count of earlier deliveries lazaret did not cause.
pub fn attempts_spent(lazaret_header: Option<&[u8]>, broker_prior: u32) -> u32 {
    normalize_attempt_header(lazaret_header).max(broker_prior)
}

/// Charges a fresh envelope with the deliveries it spent before lazaret saw
/// it: the attempts the header vouches for as plain charged attempts, and
/// each broker delivery beyond them as a lease expiry (a consumer died with
/// the message). Returns the dead-letter reason when those alone spend the
/// budget (a message that keeps killing its consumer is `crash_loop`,
/// before it is delivered again); `None` when it may be delivered.
///
/// Call it once, on an envelope that has no attempts yet, before
/// [`grant_lease`] charges the delivery at hand.
pub fn absorb_earlier_deliveries(
    env: &mut Envelope,
    policy: &TypePolicy,
    lazaret_header: Option<&[u8]>,
    broker_prior: u32,
    now: Timestamp,
    rng: &mut impl Entropy,
) -> Option<DeadLetterReason> {
    let vouched = normalize_attempt_header(lazaret_header);
    env.attempts = env.attempts.saturating_add(vouched);
    // lazaret charged them all already (its own header says so): another
    // delivery would be over budget.
    if env.attempts >= policy.attempts_max {
        return Some(DeadLetterReason::Exhausted);
    }
    let unseen = broker_prior.saturating_sub(vouched);
    for _ in 0..unseen {
        grant_lease(env, None, now);
        // The backoff of a retry is moot: the broker delivered it again
        // already. Only a dead letter matters.
        if let Transition::DeadLetter { reason } =
            decide(env, policy, Event::LeaseExpired, now, rng)
        {
            return Some(reason);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::ids::{JobId, JobType, Lane, TenantId};
    use crate::rng::SplitMix64;

    fn env() -> Envelope {
        Envelope::new(
            JobId(0),
            JobType::from("orders"),
            TenantId::from("default"),
            Lane::from("default"),
            b"{}",
            Timestamp::from_millis(0),
        )
    }

    fn policy(attempts_max: u32, crash_loop_max: u32) -> TypePolicy {
        TypePolicy {
            attempts_max,
            crash_loop_max,
            ..TypePolicy::default()
        }
    }

    #[test]
    fn the_larger_of_header_and_broker_count_is_spent() {
        assert_eq!(attempts_spent(None, 0), 0);
        assert_eq!(attempts_spent(Some(b"3"), 1), 3);
        assert_eq!(attempts_spent(Some(b"1"), 4), 4);
        assert_eq!(attempts_spent(Some(b"garbage"), 2), 2);
    }

    #[test]
    fn a_first_delivery_spends_nothing() {
        let mut e = env();
        let r = absorb_earlier_deliveries(
            &mut e,
            &policy(5, 3),
            None,
            0,
            Timestamp::from_millis(1),
            &mut SplitMix64::new(1),
        );
        assert_eq!(r, None);
        assert_eq!(grant_lease(&mut e, None, Timestamp::from_millis(1)), 1);
        assert!(e.history.len() == 1);
    }

    #[test]
    fn broker_deliveries_past_the_header_are_crashes_and_can_crash_loop() {
        let mut e = env();
        let r = absorb_earlier_deliveries(
            &mut e,
            &policy(10, 3),
            Some(b"1"),
            4,
            Timestamp::from_millis(1),
            &mut SplitMix64::new(1),
        );
        // header 1, then unseen deliveries 2 and 3: the third crash is the loop.
        assert_eq!(r, Some(DeadLetterReason::CrashLoop));
        assert_eq!(e.crashes, 3);
        assert_eq!(e.attempts, 4);
    }

    #[test]
    fn a_redriven_message_starts_again_whatever_the_broker_counted_before() {
        let mut e = env();
        let r = absorb_earlier_deliveries(
            &mut e,
            &policy(5, 3),
            Some(b"0"),
            0,
            Timestamp::from_millis(1),
            &mut SplitMix64::new(1),
        );
        assert_eq!(r, None);
        assert_eq!(e.attempts, 0);
    }

    #[test]
    fn a_header_charging_the_whole_budget_is_exhausted_undelivered() {
        for raw in [&b"3"[..], b"2147483648", b"9223372036854775807"] {
            let mut e = env();
            let r = absorb_earlier_deliveries(
                &mut e,
                &policy(3, 3),
                Some(raw),
                0,
                Timestamp::from_millis(1),
                &mut SplitMix64::new(1),
            );
            assert_eq!(r, Some(DeadLetterReason::Exhausted), "{raw:?}");
            assert!(e.history.is_empty(), "no delivery was charged");
        }
    }

    proptest! {
        /// The delivery at hand is always charged as one more than the
        /// attempts spent, unless the earlier ones already dead-lettered it;
        /// and no dead letter comes from fewer crashes than the policy allows.
        #[test]
        fn the_next_attempt_follows_the_contract(
            header in proptest::option::of(prop_oneof![0u32..20, Just(1 << 31), Just(u32::MAX)]),
            prior in 0u32..20,
            attempts_max in 1u32..15,
            crash_loop_max in 1u32..8,
            seed: u64,
        ) {
            let mut e = env();
            let raw = header.map(|h| h.to_string());
            let p = policy(attempts_max, crash_loop_max);
            let now = Timestamp::from_millis(1_000);
            let r = absorb_earlier_deliveries(
                &mut e, &p, raw.as_deref().map(str::as_bytes), prior, now, &mut SplitMix64::new(seed),
            );
            let spent = attempts_spent(raw.as_deref().map(str::as_bytes), prior);
            match r {
                None => {
                    prop_assert_eq!(e.attempts, spent);
                    prop_assert!(spent < attempts_max, "never delivered over budget");
                    prop_assert!(e.crashes < crash_loop_max);
                    prop_assert_eq!(grant_lease(&mut e, None, now), spent + 1);
                }
                Some(DeadLetterReason::CrashLoop) => prop_assert_eq!(e.crashes, crash_loop_max),
                Some(DeadLetterReason::Exhausted) => prop_assert!(e.attempts >= attempts_max),
                Some(other) => prop_assert!(false, "unexpected reason {other}"),
            }
        }
    }
}
