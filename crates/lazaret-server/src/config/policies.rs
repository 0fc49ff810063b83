//! `[defaults]` and `[types.X]`: retry policies, breakers and schemas.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use lazaret_core::{
    Backoff, BreakerConfig, BreakerConfigError, ErrorKind, FailureClass, JobType, Policies,
    PolicyError, TypePolicy, TypeSchemas,
};
use serde::Deserialize;

use super::{ConfigError, Ctx, KeyPath, Ms, RawConfig, ServerConfig, root};

/// `[defaults]` or `[types.X]`: the same keys, but only a type has schemas.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a policy table such as { attempts_max = 4 }"
)]
pub(super) struct RawPolicy {
    attempts_max: Option<u32>,
    backoff_base_ms: Option<Ms>,
    backoff_cap_ms: Option<Ms>,
    backoff_floor_ms: Option<Ms>,
    backoff_schedule_ms: Option<Vec<Ms>>,
    crash_loop_max: Option<u32>,
    deferrals_max: Option<u32>,
    #[serde(default)]
    kinds: BTreeMap<String, u32>,
    #[serde(default)]
    kind_classes: BTreeMap<String, FailureClass>,
    schemas: Option<BTreeMap<String, String>>,
    breaker: Option<RawBreaker>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a breaker table such as { failures_min = 20, window_ms = 30000 }"
)]
pub(super) struct RawBreaker {
    failures_min: Option<u32>,
    failure_ratio: Option<f64>,
    window_ms: Option<Ms>,
    cooldown_ms: Option<Ms>,
    probes: Option<u32>,
}

impl Ctx<'_> {
    pub(super) fn policies_and_breakers(
        &self,
        raw: &RawConfig,
        cfg: &mut ServerConfig,
    ) -> Result<(), ConfigError> {
        let defaults_path = root("defaults");
        let mut defaults = TypePolicy::default();
        let mut breaker_default = None;
        if let Some(d) = &raw.defaults {
            if d.schemas.is_some() {
                return Err(self.invalid(
                    &defaults_path.key("schemas"),
                    "schemas belong to one type: move them under [types.NAME]",
                ));
            }
            defaults = self.policy(&defaults, d, &defaults_path)?;
            if let Some(b) = &d.breaker {
                breaker_default =
                    Some(self.breaker(BreakerConfig::default(), b, &defaults_path)?);
            }
        }
        let mut types = std::collections::HashMap::new();
        let mut breakers = BTreeMap::new();
        for (name, t) in &raw.types {
            let path = root("types").key(name);
            self.not_blank(&path, name, "job type")?;
            types.insert(
                JobType::new(name.as_str()),
                self.policy(&defaults, t, &path)?,
            );
            if let Some(b) = &t.breaker {
                let base = breaker_default.unwrap_or_default();
                breakers.insert(JobType::new(name.as_str()), self.breaker(base, b, &path)?);
            }
        }
        cfg.policies = Policies { defaults, types };
        cfg.breaker_default = breaker_default;
        cfg.breakers = breakers;
        Ok(())
    }

    /// `raw` merged over `base`, then validated; errors are located under `path`.
    fn policy(
        &self,
        base: &TypePolicy,
        raw: &RawPolicy,
        path: &KeyPath,
    ) -> Result<TypePolicy, ConfigError> {
        let mut p = base.clone();
        let ms = |v: Option<Ms>, d: Duration| v.map_or(d, Ms::duration);
        p.attempts_max = raw.attempts_max.unwrap_or(p.attempts_max);
        p.crash_loop_max = raw.crash_loop_max.unwrap_or(p.crash_loop_max);
        p.deferrals_max = raw.deferrals_max.unwrap_or(p.deferrals_max);
        p.backoff = Backoff {
            base: ms(raw.backoff_base_ms, p.backoff.base),
            cap: ms(raw.backoff_cap_ms, p.backoff.cap),
            floor: ms(raw.backoff_floor_ms, p.backoff.floor),
            schedule: match &raw.backoff_schedule_ms {
                Some(s) => s.iter().map(|m| m.duration()).collect(),
                None => p.backoff.schedule,
            },
        };
        for (kind, n) in &raw.kinds {
            self.not_blank(&path.key("kinds").key(kind), kind, "failure kind")?;
            p.kinds.insert(ErrorKind::new(kind.as_str()), *n);
        }
        for (kind, class) in &raw.kind_classes {
            self.not_blank(&path.key("kind_classes").key(kind), kind, "failure kind")?;
            p.kind_classes.insert(ErrorKind::new(kind.as_str()), *class);
        }
        p.validate().map_err(|e| {
            let key = match &e {
                PolicyError::ZeroCount { field } => {
                    field.split('.').fold(path.clone(), |p, k| p.key(k))
                }
                PolicyError::FloorAboveCap { .. } if raw.backoff_floor_ms.is_some() => {
                    path.key("backoff_floor_ms")
                }
                PolicyError::FloorAboveCap { .. } => path.key("backoff_cap_ms"),
                _ => path.clone(),
            };
            self.invalid(&key, e.to_string())
        })?;
        Ok(p)
    }

    fn breaker(
        &self,
        base: BreakerConfig,
        raw: &RawBreaker,
        path: &KeyPath,
    ) -> Result<BreakerConfig, ConfigError> {
        let b = BreakerConfig {
            failures_min: raw.failures_min.unwrap_or(base.failures_min),
            failure_ratio: raw.failure_ratio.unwrap_or(base.failure_ratio),
            window: raw.window_ms.map_or(base.window, Ms::duration),
            cooldown: raw.cooldown_ms.map_or(base.cooldown, Ms::duration),
            probes: raw.probes.unwrap_or(base.probes),
        };
        b.validate().map_err(|e: BreakerConfigError| {
            self.invalid(&path.key("breaker").key(e.field), e.to_string())
        })?;
        Ok(b)
    }

    /// Every listed type, with its schema files read and compiled.
    pub(super) fn schemas(
        &self,
        raw: &RawConfig,
        base_dir: &Path,
    ) -> Result<BTreeMap<JobType, TypeSchemas>, ConfigError> {
        let mut out = BTreeMap::new();
        for (name, t) in &raw.types {
            let ty = JobType::new(name.as_str());
            let path = root("types").key(name).key("schemas");
            let mut versions = BTreeMap::new();
            let mut files = BTreeMap::new();
            for (version, file) in t.schemas.iter().flatten() {
                let key = path.key(version);
                let n: u32 = version.trim().parse().map_err(|_| {
                    self.invalid(
                        &key,
                        format!(
                            "schema version \"{version}\" is not a whole number; write schemas = {{ 1 = \"file.json\" }}"
                        ),
                    )
                })?;
                let resolved = base_dir.join(file);
                let text = std::fs::read_to_string(&resolved).map_err(|e| {
                    self.invalid(
                        &key,
                        format!(
                            "cannot read schema file {}: {e}; schema paths are relative to the config file's directory",
                            resolved.display()
                        ),
                    )
                })?;
                let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                    self.invalid(
                        &key,
                        format!(
                            "schema file {} is not valid JSON: {e}; fix the file",
                            resolved.display()
                        ),
                    )
                })?;
                if versions.insert(n, schema).is_some() {
                    return Err(
                        self.invalid(&key, format!("schema version {n} is given twice; keep one"))
                    );
                }
                files.insert(n, (key, resolved));
            }
            let compiled = TypeSchemas::compile(&ty, versions).map_err(|e| {
                let (key, file) = &files[&e.version];
                self.invalid(
                    key,
                    format!(
                        "schema file {} is not a usable JSON Schema: {}; fix the file",
                        file.display(),
                        e.reason
                    ),
                )
            })?;
            out.insert(ty, compiled);
        }
        Ok(out)
    }
}
