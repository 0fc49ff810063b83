//! Duties one node does for a cluster (`Store::lead`): alerts, retention.

use lazaret_store::{Duty, Store};

use crate::Backend;

pub async fn one_store_leads_every_duty_and_a_second_takes_over_when_it_goes<B: Backend>(b: &B) {
    let place = b.place().await;
    let first = b.open(&place).await;
    for duty in Duty::ALL {
        assert!(
            first.lead(duty).await.unwrap(),
            "{duty:?}: the only store leads"
        );
        assert!(
            first.lead(duty).await.unwrap(),
            "{duty:?}: and goes on leading"
        );
    }
    if !b.capabilities().several_nodes {
        return;
    }
    let second = b.open(&place).await;
    for duty in Duty::ALL {
        assert!(
            !second.lead(duty).await.unwrap(),
            "{duty:?}: a second node does not lead while the first does"
        );
    }
    // The first goes: the second's next call leads.
    first.close().await.unwrap();
    drop(first);
    for duty in Duty::ALL {
        assert!(
            second.lead(duty).await.unwrap(),
            "{duty:?}: the second node takes over"
        );
    }
    let third = b.open(&place).await;
    assert!(!third.lead(Duty::Alerts).await.unwrap());
}
