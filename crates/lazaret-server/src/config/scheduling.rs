//! `[tenants]` and `[lanes.X]`: tenants' in-flight caps, lane weights,
//! reserves and what a lane does while a breaker is open.

use std::collections::{BTreeMap, BTreeSet};

use lazaret_core::{Lane, SchedulerConfig, SchedulerConfigError, Share, TenantId};
use serde::Deserialize;

use super::{ConfigError, Ctx, RawConfig, ServerConfig, root};

/// The in-flight cap when `[tenants] inflight_max` is absent: none. Tenants
/// still take turns (round robin needs no cap); a cap is for a tenant whose
/// jobs must not hold every worker at once.
pub const INFLIGHT_UNCAPPED: u32 = u32::MAX;

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table with inflight_max, ready_max and overrides"
)]
pub(super) struct RawTenants {
    inflight_max: Option<u32>,
    ready_max: Option<u32>,
    #[serde(default)]
    overrides: BTreeMap<String, u32>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table such as { weight = 4, reserve = 0.2, on_breaker_open = \"park\" }"
)]
pub(super) struct RawLane {
    weight: Option<u32>,
    reserve: Option<f64>,
    on_breaker_open: Option<String>,
}

impl Ctx<'_> {
    pub(super) fn scheduler(&self, raw: &RawConfig) -> Result<SchedulerConfig, ConfigError> {
        let mut s = ServerConfig::default().scheduler;
        if let Some(t) = &raw.tenants {
            if let Some(n) = t.inflight_max {
                s.inflight_max = n;
            }
            if let Some(n) = t.ready_max {
                if n == 0 {
                    return Err(self.invalid(
                        &root("tenants").key("ready_max"),
                        "ready_max is 0, so no job could ever be queued; set it to at least 1 (it bounds how many distinct tenants may have jobs ready at once), or leave it out for no bound",
                    ));
                }
                s.tenants_ready_max = Some(n);
            }
            for (name, n) in &t.overrides {
                self.not_blank(&root("tenants").key("overrides").key(name), name, "tenant")?;
                s.tenant_inflight_max
                    .insert(TenantId::new(name.as_str()), *n);
            }
        }
        for (name, lane) in &raw.lanes {
            self.not_blank(&root("lanes").key(name), name, "lane")?;
            s.lane_weights
                .insert(Lane::new(name.as_str()), lane.weight.unwrap_or(1));
            if let Some(r) = lane.reserve {
                let share = Share::from_fraction(r).ok_or_else(|| {
                    self.invalid(
                        &root("lanes").key(name).key("reserve"),
                        format!(
                            "reserve must be a share between 0 and 1, such as 0.2 for a fifth of the leases held (got {r})"
                        ),
                    )
                })?;
                s.lane_reserves.insert(Lane::new(name.as_str()), share);
            }
        }
        s.validate().map_err(|e| match e {
            SchedulerConfigError::ZeroLaneWeight { lane } => self.invalid(
                &root("lanes").key(lane.as_str()).key("weight"),
                format!(
                    "lane `{lane}` has weight 0; a weight is the lane's share of leases while lanes compete, so it must be at least 1 (to shrink this lane's share, raise the other lanes' weights)"
                ),
            ),
            SchedulerConfigError::ZeroInflightMax => self.invalid(
                &root("tenants").key("inflight_max"),
                "inflight_max is 0, so no tenant could ever lease a job; set it to at least 1 (to pause one tenant, set it to 0 under [tenants.overrides])",
            ),
            SchedulerConfigError::ReservesOverOne { .. } => {
                let last = s.lane_reserves.keys().next_back().map(Lane::as_str);
                self.invalid(
                    &root("lanes").key(last.unwrap_or_default()).key("reserve"),
                    e.to_string(),
                )
            }
            other => self.error(None, None, other.to_string()),
        })?;
        Ok(s)
    }

    /// The lanes with `on_breaker_open = "park"`.
    pub(super) fn park_lanes(&self, raw: &RawConfig) -> Result<BTreeSet<Lane>, ConfigError> {
        let mut park = BTreeSet::new();
        for (name, lane) in &raw.lanes {
            match lane.on_breaker_open.as_deref() {
                None | Some("shed") => {}
                Some("park") => {
                    park.insert(Lane::new(name.as_str()));
                }
                Some(other) => {
                    return Err(self.invalid(
                        &root("lanes").key(name).key("on_breaker_open"),
                        format!(
                            "on_breaker_open is \"shed\" (answer 503 SHED while the type's breaker is open, the default) or \"park\" (accept the job and run it once the breaker closes); got {other:?}"
                        ),
                    ));
                }
            }
        }
        Ok(park)
    }
}
