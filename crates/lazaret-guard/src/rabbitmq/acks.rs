//! Which acknowledgements of one channel can go out as one frame: a pure
//! tracker of the channel's delivery tags, no I/O (the adapter sends the
//! frames it plans).
//!
//! `basic.ack multiple=true` with tag `t` acknowledges *every* delivery of
//! the channel at or below `t` that is still unacknowledged. So one may be
//! sent only when every such delivery is ready to be acknowledged: a
//! delivery still being handled, being handed back (`basic.nack`), or
//! dropped unsettled (a crash) must never be covered, or RabbitMQ would
//! forget a message lazaret has not written down. The tracker knows every
//! tag the consumer handed over ([`AckTracker::delivered`]) and keeps each
//! until it is acknowledged or its hand-back is sent; a tag the consumer
//! has not handed over yet is above every tag handed over, since one
//! consumer on one channel receives its deliveries in tag order.
//!
//! [`AckTracker::take_frames`] plans what to send for the acks that are
//! ready: one frame for the ready prefix of the channel's unsettled tags
//! (`multiple=true` when it covers more than one), and one `multiple=false`
//! frame for each other ready tag, so no ack waits on a delivery still
//! being handled. Frames of one plan cover disjoint tags and must all be
//! sent before the next plan's: a tag acknowledged twice (once alone, once
//! covered) is a channel error in RabbitMQ.

use std::collections::BTreeSet;

/// An AMQP delivery tag (per channel, from 1).
pub type DeliveryTag = u64;

/// One `basic.ack` to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AckFrame {
    /// The tag in the frame.
    pub tag: DeliveryTag,
    /// `multiple=true`: every unacknowledged tag at or below `tag` too.
    pub multiple: bool,
    /// The tags it acknowledges, `tag` included (whose waiters to answer).
    pub covers: Vec<DeliveryTag>,
}

/// The delivery tags of one channel and which of them are ready to ack.
#[derive(Debug, Default)]
pub struct AckTracker {
    /// Handed over by the consumer, and neither acknowledged (in a frame
    /// planned) nor handed back (its `basic.nack` sent). A tag dropped
    /// unsettled stays here for the channel's life: RabbitMQ still holds
    /// it unacknowledged, so no `multiple` frame may cover it.
    unsettled: BTreeSet<DeliveryTag>,
    /// The unsettled tags whose acknowledgement was asked for.
    ready: BTreeSet<DeliveryTag>,
    /// Unsettled tags, not ready yet, whose outcome is decided: lazaret is
    /// writing it down, and their ack or hand-back follows the write.
    decided: BTreeSet<DeliveryTag>,
    /// The highest tag handed over.
    last: DeliveryTag,
    /// A tag came at or below `last` (never on one consumer's channel):
    /// the order this tracker relies on does not hold, so every frame of
    /// the channel goes alone.
    disordered: bool,
}

impl AckTracker {
    /// The consumer handed over delivery `tag`.
    pub fn delivered(&mut self, tag: DeliveryTag) {
        if tag <= self.last {
            self.disordered = true;
        }
        self.last = self.last.max(tag);
        self.unsettled.insert(tag);
    }

    /// `tag` may be acknowledged now; `false` when it is not an unsettled
    /// tag of this channel (acknowledged or handed back already), which
    /// the caller answers as an error rather than send.
    pub fn ready(&mut self, tag: DeliveryTag) -> bool {
        if !self.unsettled.contains(&tag) {
            return false;
        }
        self.ready.insert(tag);
        self.decided.remove(&tag);
        true
    }

    /// `tag`'s outcome is decided and being written: it will be ready (or
    /// handed back) once the write is done, so acks above it may wait for
    /// it ([`AckTracker::blocked_by_decided`]). Ignored for a tag that is not
    /// unsettled or is ready already.
    pub fn decided(&mut self, tag: DeliveryTag) {
        if self.unsettled.contains(&tag) && !self.ready.contains(&tag) {
            self.decided.insert(tag);
        }
    }

    /// Whether the lowest unsettled tag, the one that keeps the held acks
    /// out of the prefix, is decided: then it closes as soon as its write
    /// ends, not when a handler answers. `true` when nothing is held.
    pub fn blocked_by_decided(&self) -> bool {
        if self.ready.is_empty() {
            return true;
        }
        self.unsettled
            .iter()
            .find(|t| !self.ready.contains(t))
            .is_none_or(|t| self.decided.contains(t))
    }

    /// `tag`'s hand-back (`basic.nack` with requeue) was sent: RabbitMQ no
    /// longer holds it for this channel. Until this is called the tag
    /// blocks every `multiple` frame above it.
    pub fn handed_back(&mut self, tag: DeliveryTag) {
        self.unsettled.remove(&tag);
        self.ready.remove(&tag);
        self.decided.remove(&tag);
    }

    /// Ready tags that the last [`AckTracker::take_prefix`] left: each
    /// above a tag not ready yet.
    pub fn held(&self) -> usize {
        self.ready.len()
    }

    /// The frame for the ready prefix of the unsettled tags alone (none
    /// when the lowest is not ready); the ready tags above a gap stay
    /// ready, so that they can join a later prefix instead of going one
    /// frame each. With tags out of order there is no prefix to wait
    /// for, and every ready tag goes alone as in
    /// [`AckTracker::take_frames`].
    pub fn take_prefix(&mut self) -> Vec<AckFrame> {
        if self.disordered {
            return self.take_frames();
        }
        self.prefix_frame()
    }

    /// The frames that acknowledge every ready tag, which then count as
    /// acknowledged: the ready prefix of the unsettled tags in one frame,
    /// each other ready tag alone.
    pub fn take_frames(&mut self) -> Vec<AckFrame> {
        let mut frames = self.prefix_frame();
        for t in std::mem::take(&mut self.ready) {
            self.unsettled.remove(&t);
            frames.push(alone(t));
        }
        frames
    }

    /// Takes the ready prefix: one frame, or one per tag when disordered.
    fn prefix_frame(&mut self) -> Vec<AckFrame> {
        let mut frames = Vec::new();
        if self.ready.is_empty() {
            return frames;
        }
        let prefix: Vec<DeliveryTag> = self
            .unsettled
            .iter()
            .take_while(|t| self.ready.contains(t))
            .copied()
            .collect();
        for t in &prefix {
            self.unsettled.remove(t);
            self.ready.remove(t);
        }
        if self.disordered {
            frames.extend(prefix.into_iter().map(alone));
        } else if let Some(&tag) = prefix.last() {
            frames.push(AckFrame {
                tag,
                multiple: prefix.len() > 1,
                covers: prefix,
            });
        }
        frames
    }
}

fn alone(tag: DeliveryTag) -> AckFrame {
    AckFrame {
        tag,
        multiple: false,
        covers: vec![tag],
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn frame(tag: DeliveryTag, multiple: bool, covers: &[DeliveryTag]) -> AckFrame {
        AckFrame {
            tag,
            multiple,
            covers: covers.to_vec(),
        }
    }

    #[test]
    fn a_ready_prefix_goes_as_one_multiple_ack() {
        let mut t = AckTracker::default();
        (1..=4).for_each(|tag| t.delivered(tag));
        assert!(t.ready(2) && t.ready(1) && t.ready(3));
        assert_eq!(t.take_frames(), vec![frame(3, true, &[1, 2, 3])]);
        assert!(t.ready(4));
        assert_eq!(t.take_frames(), vec![frame(4, false, &[4])]);
        assert!(t.take_frames().is_empty());
    }

    #[test]
    fn a_tag_still_handled_below_keeps_the_acks_above_it_single() {
        let mut t = AckTracker::default();
        (1..=5).for_each(|tag| t.delivered(tag));
        assert!(t.ready(1) && t.ready(3) && t.ready(4));
        assert_eq!(
            t.take_frames(),
            vec![
                frame(1, false, &[1]),
                frame(3, false, &[3]),
                frame(4, false, &[4])
            ]
        );
        // 2 is done now; 5 too: the prefix is 2 and 5 (3 and 4 are acked).
        assert!(t.ready(5) && t.ready(2));
        assert_eq!(t.take_frames(), vec![frame(5, true, &[2, 5])]);
    }

    #[test]
    fn acks_above_a_gap_wait_in_a_holding_plan_and_join_the_prefix() {
        let mut t = AckTracker::default();
        (1..=5).for_each(|tag| t.delivered(tag));
        // 2 is being written (a dead letter): 1 goes, 3 and 4 wait.
        assert!(t.ready(1) && t.ready(3) && t.ready(4));
        assert_eq!(t.take_prefix(), vec![frame(1, false, &[1])]);
        assert_eq!(t.held(), 2);
        assert!(t.take_prefix().is_empty(), "nothing at the bottom is ready");
        // 2 is written: one frame covers 2, 3 and 4.
        assert!(t.ready(2));
        assert_eq!(t.take_prefix(), vec![frame(4, true, &[2, 3, 4])]);
        assert_eq!(t.held(), 0);
        // Held past the hold, they go alone.
        assert!(t.ready(5));
        t.delivered(6);
        assert_eq!(t.take_prefix(), vec![frame(5, false, &[5])]);
        t.delivered(7);
        assert!(t.ready(7));
        assert!(t.take_prefix().is_empty());
        assert_eq!(t.take_frames(), vec![frame(7, false, &[7])]);
    }

    #[test]
    fn held_acks_know_whether_a_write_or_a_handler_blocks_them() {
        let mut t = AckTracker::default();
        (1..=4).for_each(|tag| t.delivered(tag));
        assert!(t.blocked_by_decided(), "nothing held");
        assert!(t.ready(2) && t.ready(4));
        assert!(t.take_prefix().is_empty());
        assert!(!t.blocked_by_decided(), "1 is still with its handler");
        // 1 failed: its dead letter is being written.
        t.decided(1);
        assert!(t.blocked_by_decided());
        // Written: the prefix moves up to 3, whose handler still runs.
        assert!(t.ready(1));
        assert_eq!(t.take_prefix(), vec![frame(2, true, &[1, 2])]);
        assert!(!t.blocked_by_decided());
        t.decided(3);
        assert!(t.blocked_by_decided());
        // Its write failed and it was handed back: 4 goes alone.
        t.handed_back(3);
        assert_eq!(t.take_prefix(), vec![frame(4, false, &[4])]);
        // Settled tags, ready ones and unknown ones are not gaps.
        t.decided(3);
        t.decided(4);
        t.decided(9);
        t.delivered(5);
        t.delivered(6);
        assert!(t.ready(6));
        t.decided(6);
        assert!(!t.blocked_by_decided(), "5 blocks, and it is not decided");
    }

    #[test]
    fn a_hand_back_blocks_until_its_nack_is_sent() {
        let mut t = AckTracker::default();
        (1..=3).for_each(|tag| t.delivered(tag));
        // 1 is being handed back: its nack is not sent yet.
        assert!(t.ready(2) && t.ready(3));
        assert_eq!(
            t.take_frames(),
            vec![frame(2, false, &[2]), frame(3, false, &[3])]
        );
        t.handed_back(1);
        t.delivered(4);
        t.delivered(5);
        assert!(t.ready(4) && t.ready(5));
        assert_eq!(t.take_frames(), vec![frame(5, true, &[4, 5])]);
        assert!(!t.ready(1), "handed back: no ack for it");
        assert!(!t.ready(4), "acked already");
    }

    #[test]
    fn out_of_order_tags_are_acked_alone() {
        let mut t = AckTracker::default();
        t.delivered(2);
        t.delivered(1);
        assert!(t.ready(1) && t.ready(2));
        assert_eq!(
            t.take_frames(),
            vec![frame(1, false, &[1]), frame(2, false, &[2])]
        );
    }

    /// What happens to one tag in a generated run.
    #[derive(Clone, Copy, Debug)]
    enum Fate {
        /// Acknowledged after `at` steps.
        Ack(u8),
        /// Handed back: the nack asked for after `at` steps, sent after
        /// `sent` more.
        Release(u8, u8),
        /// Dropped unsettled (a crash between write and ack).
        Drop,
    }

    fn fate() -> impl Strategy<Value = Fate> {
        prop_oneof![
            6 => any::<u8>().prop_map(|at| Fate::Ack(at % 40)),
            2 => (any::<u8>(), any::<u8>()).prop_map(|(at, s)| Fate::Release(at % 40, s % 8)),
            1 => Just(Fate::Drop),
        ]
    }

    /// RabbitMQ's side of one channel: what it holds unacknowledged.
    #[derive(Default)]
    struct Server {
        unacked: BTreeSet<DeliveryTag>,
        acked: BTreeSet<DeliveryTag>,
    }

    impl Server {
        /// Applies a frame as RabbitMQ does; panics where it would close
        /// the channel (an unknown tag) or ack what was not ready.
        fn ack(&mut self, f: &AckFrame, ready: &BTreeSet<DeliveryTag>) {
            assert!(
                self.unacked.contains(&f.tag),
                "unknown delivery tag {} (PRECONDITION_FAILED)",
                f.tag
            );
            let gone: Vec<DeliveryTag> = if f.multiple {
                self.unacked.range(..=f.tag).copied().collect()
            } else {
                vec![f.tag]
            };
            for t in gone {
                assert!(ready.contains(&t), "acked {t}, which was not ready");
                assert!(f.covers.contains(&t), "{t} acked but not reported covered");
                self.unacked.remove(&t);
                self.acked.insert(t);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Tags handed over in order (some while others are settling),
        /// acked, handed back or dropped at random times, with plans taken
        /// at random steps, some of them holding the acks above a gap:
        /// every frame is one RabbitMQ accepts, acks only
        /// tags that were ready, answers each ack exactly once, never
        /// covers a tag handed back or dropped; every ack asked for is
        /// sent by the next plan.
        #[test]
        fn frames_ack_exactly_the_ready_tags(
            fates in proptest::collection::vec(fate(), 1..40),
            deliver_at in proptest::collection::vec(0u8..40, 1..40),
            plan_every in 1u8..6,
            holding in any::<u64>(),
            decide_first in any::<bool>(),
        ) {
            let n = fates.len();
            let mut t = AckTracker::default();
            let mut server = Server::default();
            // The step at which each tag is handed over, in tag order.
            let mut at: Vec<u8> = deliver_at.iter().cycle().take(n).copied().collect();
            at.sort_unstable();
            let mut asked: BTreeSet<DeliveryTag> = BTreeSet::new();
            let mut answered: BTreeMap<DeliveryTag, u32> = BTreeMap::new();
            let mut handed_back: BTreeSet<DeliveryTag> = BTreeSet::new();
            let mut delivered = 0usize;
            for step in 0u16..200 {
                while delivered < n && u16::from(at[delivered]) <= step {
                    delivered += 1;
                    let tag = delivered as DeliveryTag;
                    t.delivered(tag);
                    server.unacked.insert(tag);
                }
                for (i, f) in fates.iter().take(delivered).enumerate() {
                    let tag = i as DeliveryTag + 1;
                    let since = step - u16::from(at[i]);
                    match *f {
                        Fate::Ack(a) if since == u16::from(a) => {
                            prop_assert!(t.ready(tag));
                            asked.insert(tag);
                        }
                        // Some outcomes are decided (written) a step
                        // before they are acked or handed back: that
                        // only tells the adapter how long to hold.
                        Fate::Ack(a) | Fate::Release(a, _)
                            if decide_first && since + 1 == u16::from(a) =>
                        {
                            t.decided(tag);
                        }
                        Fate::Release(r, s) if since == u16::from(r) + u16::from(s) => {
                            // The nack is sent, then the tracker told.
                            prop_assert!(server.unacked.remove(&tag));
                            t.handed_back(tag);
                            handed_back.insert(tag);
                        }
                        _ => {}
                    }
                }
                if step % u16::from(plan_every) == 0 || step == 199 {
                    let ready: BTreeSet<DeliveryTag> =
                        asked.difference(&answered.keys().copied().collect()).copied().collect();
                    // Some plans hold the acks above a gap (the adapter's
                    // hold); the last one never does.
                    let hold = step != 199 && holding & (1 << (step % 64)) != 0;
                    let frames = if hold { t.take_prefix() } else { t.take_frames() };
                    for f in frames {
                        server.ack(&f, &ready);
                        for c in &f.covers {
                            *answered.entry(*c).or_default() += 1;
                        }
                    }
                    if hold {
                        prop_assert!(t.take_prefix().is_empty(), "one holding plan takes the whole prefix");
                    } else {
                        prop_assert!(t.take_frames().is_empty());
                        prop_assert_eq!(t.held(), 0);
                    }
                }
            }
            prop_assert_eq!(&asked.iter().copied().collect::<Vec<_>>(),
                &answered.keys().copied().collect::<Vec<_>>(), "every ack answered");
            prop_assert!(answered.values().all(|&k| k == 1), "answered once");
            prop_assert_eq!(&server.acked, &asked, "RabbitMQ forgot exactly the acked");
            for (i, f) in fates.iter().enumerate() {
                let tag = i as DeliveryTag + 1;
                match f {
                    Fate::Drop => prop_assert!(server.unacked.contains(&tag), "dropped {} kept", tag),
                    Fate::Release(..) => prop_assert!(handed_back.contains(&tag)),
                    Fate::Ack(_) => {}
                }
            }
        }

        /// When every tag is ready before a plan, one frame acknowledges
        /// them all.
        #[test]
        fn all_ready_is_one_frame(n in 2u64..200) {
            let mut t = AckTracker::default();
            (1..=n).for_each(|tag| t.delivered(tag));
            for tag in (1..=n).rev() {
                prop_assert!(t.ready(tag));
            }
            let frames = t.take_frames();
            prop_assert_eq!(frames.len(), 1);
            prop_assert_eq!(frames[0].tag, n);
            prop_assert!(frames[0].multiple);
        }
    }
}
