//! Wake-ups for long-polling leases.
//!
//! Every change that may make a job leasable wakes the waiting leases. An
//! enqueue says which (lane, type) it made ready, so a waiter whose lanes or
//! types cannot match goes back to sleep without asking the store: with
//! workers dedicated to some types, an enqueue no longer costs one store
//! command per idle worker of the other types. Every other change that
//! wakes them (promotions of due jobs, expired leases, failures queued for
//! retry, redrives, resumes) concerns everyone; so does an ack or a fail
//! that frees an in-flight slot of a tenant held at its cap with jobs
//! ready (other acks publish nothing, so that they wake nobody in vain).

use std::collections::VecDeque;
use std::sync::Mutex;

use lazaret_core::{JobType, Lane};
use tokio::sync::Notify;
use tokio::sync::futures::Notified;

/// Recent events remembered; a waiter that fell further behind takes its
/// wake-up as relevant.
const LOG_MAX: usize = 1024;

/// The wake-up channel of long-polling leases.
#[derive(Debug, Default)]
pub struct Ready {
    notify: Notify,
    log: Mutex<Log>,
}

#[derive(Debug, Default)]
struct Log {
    /// Sequence number of the newest event (0: none yet).
    seq: u64,
    /// The newest events, oldest first, with their sequence numbers: the
    /// (lane, type) made ready, or `None` for "anything may have".
    events: VecDeque<(u64, Option<(Lane, JobType)>)>,
}

/// The lanes and types a waiting lease takes (`None`: any).
#[derive(Clone, Copy, Debug)]
pub struct Interest<'a> {
    /// Lanes it leases from.
    pub lanes: Option<&'a [Lane]>,
    /// Types it leases.
    pub types: Option<&'a [JobType]>,
}

impl Interest<'_> {
    fn wants(&self, lane: &Lane, job_type: &JobType) -> bool {
        self.lanes.is_none_or(|ls| ls.contains(lane))
            && self.types.is_none_or(|ts| ts.contains(job_type))
    }
}

impl Ready {
    /// Something may have made any job leasable: wakes every waiter.
    pub fn anything(&self) {
        self.publish(std::iter::once(None));
    }

    /// Jobs of these (lane, type) became ready: wakes every waiter, and only
    /// those interested go on to lease.
    pub fn jobs<'a>(&self, ready: impl IntoIterator<Item = (&'a Lane, &'a JobType)>) {
        self.publish(ready.into_iter().map(|(l, t)| Some((l.clone(), t.clone()))));
    }

    fn publish(&self, events: impl Iterator<Item = Option<(Lane, JobType)>>) {
        {
            let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            let before = log.seq;
            for e in events {
                log.seq += 1;
                let seq = log.seq;
                log.events.push_back((seq, e));
                if log.events.len() > LOG_MAX {
                    log.events.pop_front();
                }
            }
            if log.seq == before {
                return;
            }
        }
        self.notify.notify_waiters();
    }

    /// A future that completes at the next event. Enable it before reading
    /// [`Ready::seq`], so no event falls between the two.
    pub fn notified(&self) -> Notified<'_> {
        self.notify.notified()
    }

    /// Sequence number of the newest event.
    pub fn seq(&self) -> u64 {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).seq
    }

    /// Whether an event after `since` may concern `interest`, and the newest
    /// sequence number.
    pub fn relevant_since(&self, since: u64, interest: Interest<'_>) -> (bool, u64) {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        if log.seq == since {
            return (false, since);
        }
        let oldest_kept = log.events.front().map_or(log.seq + 1, |(s, _)| *s);
        if since + 1 < oldest_kept {
            // Fell behind the log: cannot tell, so look.
            return (true, log.seq);
        }
        let relevant = log
            .events
            .iter()
            .rev()
            .take_while(|(s, _)| *s > since)
            .any(|(_, e)| e.as_ref().is_none_or(|(l, t)| interest.wants(l, t)));
        (relevant, log.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(ls: &[&str]) -> Vec<Lane> {
        ls.iter().map(|l| Lane::new(*l)).collect()
    }

    fn types(ts: &[&str]) -> Vec<JobType> {
        ts.iter().map(|t| JobType::new(*t)).collect()
    }

    #[test]
    fn an_enqueue_concerns_only_waiters_that_could_lease_it() {
        let r = Ready::default();
        let since = r.seq();
        r.jobs([(&Lane::new("default"), &JobType::new("email"))]);
        let (email, sms) = (types(&["email"]), types(&["sms"]));
        let batch = lanes(&["batch"]);
        let any = Interest {
            lanes: None,
            types: None,
        };
        let wants_email = Interest {
            lanes: None,
            types: Some(&email),
        };
        let wants_sms = Interest {
            lanes: None,
            types: Some(&sms),
        };
        let batch_only = Interest {
            lanes: Some(&batch),
            types: None,
        };
        assert_eq!(r.relevant_since(since, any), (true, since + 1));
        assert_eq!(r.relevant_since(since, wants_email), (true, since + 1));
        assert_eq!(r.relevant_since(since, wants_sms), (false, since + 1));
        assert_eq!(r.relevant_since(since, batch_only), (false, since + 1));
        // Nothing new since: not relevant to anyone.
        assert_eq!(r.relevant_since(since + 1, any), (false, since + 1));
        // A wildcard concerns everyone.
        r.anything();
        assert_eq!(r.relevant_since(since + 1, wants_sms), (true, since + 2));
    }

    #[test]
    fn a_waiter_behind_the_log_looks() {
        let r = Ready::default();
        let sms = types(&["sms"]);
        let wants_sms = Interest {
            lanes: None,
            types: Some(&sms),
        };
        let (lane, email) = (Lane::new("default"), JobType::new("email"));
        for _ in 0..LOG_MAX + 5 {
            r.jobs([(&lane, &email)]);
        }
        let newest = (LOG_MAX + 5) as u64;
        assert_eq!(r.relevant_since(0, wants_sms), (true, newest));
        // Within the log, the same events concern it not.
        assert_eq!(r.relevant_since(newest - 3, wants_sms), (false, newest));
    }

    #[tokio::test]
    async fn publishing_wakes_an_enabled_waiter_and_nothing_published_wakes_none() {
        let r = Ready::default();
        let n = r.notified();
        tokio::pin!(n);
        n.as_mut().enable();
        r.jobs(std::iter::empty());
        // Waking is synchronous (`notify_waiters`): had the empty enqueue
        // woken it, the first poll would be ready. No timer needed.
        assert!(
            futures_util::FutureExt::now_or_never(n.as_mut()).is_none(),
            "an empty enqueue woke a waiter"
        );
        r.anything();
        tokio::time::timeout(std::time::Duration::from_secs(5), n)
            .await
            .expect("woken");
    }
}
